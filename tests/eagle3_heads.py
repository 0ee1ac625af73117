"""Tiny random EAGLE-3 heads in the published layout (config.json + weights) for the tiny Llama
target of tests/tiny_models.py: a random one, and one whose drafts the target accepts. Shared by
tests/test_spec_eagle.py (CPU) and tests/test_spec_eagle_gpu.py."""

from __future__ import annotations

import json
from pathlib import Path

import torch

TARGET_DIMS = {"hidden_size": 96, "vocab_size": 49152, "num_layers": 3}  # tests/tiny_models.py's llama
HEAD = {"num_heads": 4, "num_kv_heads": 2, "head_dim": 24, "intermediate": 128, "draft_vocab": 640}


def make_head(
    path: Path,
    *,
    seed: int = 0,
    target_hidden: int = 96,
    own_embedding: bool = False,
    norm_before_residual: bool = False,
    aux_layer_ids: list[int] | None = None,
    rope_theta: float | None = 10000.0,
    weights_format: str = "safetensors",
    drop: tuple[str, ...] = (),
) -> Path:
    """A random EAGLE-3 head for a target of hidden ``target_hidden`` and the tiny vocabulary, in
    the published layout (config.json + model.safetensors or pytorch_model.bin)."""
    g = torch.Generator().manual_seed(seed)
    h, vocab, vd = 96, TARGET_DIMS["vocab_size"], HEAD["draft_vocab"]
    q, kv, inter = (
        HEAD["num_heads"] * HEAD["head_dim"],
        HEAD["num_kv_heads"] * HEAD["head_dim"],
        HEAD["intermediate"],
    )

    def rand(*shape: int, std: float = 0.1) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * std

    def norm() -> torch.Tensor:
        return 1.0 + rand(h, std=0.1)

    # The draft vocabulary: a sorted subset of the target's, as EAGLE-3's d2t offsets describe it.
    targets = torch.randperm(vocab, generator=g)[:vd].sort().values
    w = {
        "fc.weight": rand(h, 3 * target_hidden, std=0.15),
        "midlayer.input_layernorm.weight": norm(),
        "midlayer.hidden_norm.weight": norm(),
        "midlayer.post_attention_layernorm.weight": norm(),
        "midlayer.self_attn.q_proj.weight": rand(q, 2 * h, std=0.2),
        "midlayer.self_attn.k_proj.weight": rand(kv, 2 * h, std=0.2),
        "midlayer.self_attn.v_proj.weight": rand(kv, 2 * h),
        "midlayer.self_attn.o_proj.weight": rand(h, q),
        "midlayer.mlp.gate_proj.weight": rand(inter, h),
        "midlayer.mlp.up_proj.weight": rand(inter, h),
        "midlayer.mlp.down_proj.weight": rand(h, inter),
        "norm.weight": norm(),
        "lm_head.weight": rand(vd, h, std=0.5),  # peaky draft logits: argmax far from ties
        "d2t": targets - torch.arange(vd),
        "t2d": torch.zeros(vocab, dtype=torch.bool).index_fill_(0, targets, True),
    }
    if own_embedding:
        w["embed_tokens.weight"] = rand(vocab, h, std=0.5)
    for key in drop:
        del w[key]
    path.mkdir(parents=True, exist_ok=True)
    if weights_format == "safetensors":
        from safetensors.torch import save_file

        save_file(w, str(path / "model.safetensors"))
    else:
        torch.save(w, path / "pytorch_model.bin")
    config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": h,
        "num_attention_heads": HEAD["num_heads"],
        "num_key_value_heads": HEAD["num_kv_heads"],
        "head_dim": HEAD["head_dim"],
        "intermediate_size": inter,
        "num_hidden_layers": 1,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "vocab_size": vocab,
        "draft_vocab_size": vd,
        "max_position_embeddings": 512,
        "tie_word_embeddings": False,
    }
    if rope_theta is not None:
        config["rope_theta"] = rope_theta
    if target_hidden != h:
        config["target_hidden_size"] = target_hidden
    if aux_layer_ids is not None:
        config["eagle_aux_hidden_state_layer_ids"] = aux_layer_ids
    if norm_before_residual:
        config["norm_before_residual"] = True
    (path / "config.json").write_text(json.dumps(config))
    return path


def make_echo_head(path: Path, target_embedding: torch.Tensor) -> Path:
    """A head that drafts, at every step, the token two before the one it drafts after: fc passes
    the layer-0 feature (the target's embedding of t_i) straight through, the attention and MLP
    add nothing, and the LM head is the target's embedding matrix over the whole vocabulary (no
    d2t), whose best match for embed(t) is t itself. The tiny random target's greedy output runs
    into repeats (X X X ...), where these drafts are right: it makes the engine accept drafts."""
    from safetensors.torch import load_file, save_file

    make_head(path)
    w = load_file(str(path / "model.safetensors"))
    h = TARGET_DIMS["hidden_size"]
    w["fc.weight"] = torch.cat([torch.eye(h), torch.zeros(h, 2 * h)], 1)
    w["midlayer.self_attn.o_proj.weight"].zero_()
    w["midlayer.mlp.down_proj.weight"].zero_()
    w["norm.weight"] = torch.ones(h)
    w["lm_head.weight"] = target_embedding.detach().clone()
    del w["d2t"], w["t2d"]
    save_file(w, str(path / "model.safetensors"))
    config = json.loads((path / "config.json").read_text())
    config["draft_vocab_size"] = TARGET_DIMS["vocab_size"]
    (path / "config.json").write_text(json.dumps(config))
    return path


def checkpoint_embedding(checkpoint: Path) -> torch.Tensor:
    """The tiny target checkpoint's input embedding, for make_echo_head (read from its weights
    file, so no transformers model is loaded)."""
    from safetensors.torch import load_file

    return load_file(str(Path(checkpoint) / "model.safetensors"))["model.embed_tokens.weight"]
