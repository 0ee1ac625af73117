"""An EAGLE-3 draft head's checkpoint: its published layout, read and checked against a target.

EAGLE-3 (Li et al., 2025, "Scaling up Inference Acceleration of Large Language Models via
Training-Time Test") drafts with one decoder layer that reads the target's own features: ``fc``
fuses the residual stream entering three of the target's layers (low, middle, high) into one
hidden vector, and the layer's attention takes that (after ``hidden_norm``) concatenated with the
embedding of the next token (after ``input_layernorm``), so q/k/v take ``2 * hidden`` inputs. Its
LM head covers a smaller *draft* vocabulary; ``d2t[d]`` maps draft id ``d`` to target id
``d + d2t[d]``. runtime/spec_eagle.py runs it.

Two layouts are read, both checked against the target's dims with errors that name the key:

- the published one (EAGLE's ``LlamaForCausalLMEagle3`` checkpoints and those trained in its
  layout): ``config.json`` and ``model.safetensors`` (any ``*.safetensors``) or
  ``pytorch_model.bin``, with the keys in ``EXPECTED_KEYS``;
- the one ``enginebuild --speculative-config '{"method": "eagle3", ...}'`` writes (builder/eagle3.py):
  ``eagle3_head.json`` (the resolved ``Eagle3HeadConfig``) and ``eagle3_head.safetensors`` with
  the same keys.

The runtime never imports the builder, so both read here; the builder only writes.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

HEAD_CONFIG = "eagle3_head.json"
HEAD_WEIGHTS = "eagle3_head.safetensors"
FORMAT_VERSION = 1

# Keys that are ignored when present: buffers some exports carry that the head recomputes.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclass(frozen=True)
class Eagle3HeadConfig:
    """The head's shape and conventions, resolved from its config.json and the target's dims."""

    hidden_size: int  # the head's hidden size (its layer, fc's output, lm_head's input)
    target_hidden_size: int  # the target's hidden size: fc takes len(aux_layer_ids) of these
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    vocab_size: int  # the target's vocabulary: embeddings and proposed ids
    draft_vocab_size: int  # lm_head's rows; d2t maps them into the target's vocabulary
    # The target layers whose *incoming* residual stream fc reads, ascending (transformers'
    # hidden_states[i]: 0 is the embedding output, i the output of layer i - 1).
    aux_layer_ids: tuple[int, ...]
    rope: dict[str, Any] | None  # rope_type, rope_theta and the variant's keys; None: the target's
    norm_before_residual: bool  # the layer's residual is hidden_norm(fc(...)) instead of fc(...)
    has_embedding: bool  # the head has its own embed_tokens; False: it shares the target's


def default_aux_layer_ids(num_layers: int) -> tuple[int, ...]:
    """EAGLE-3's choice when the head's config names none: layers 2, num_layers // 2 and
    num_layers - 3 (the EAGLE reference code and vLLM alike)."""
    return tuple(sorted({2, num_layers // 2, num_layers - 3}))


def expected_shapes(cfg: Eagle3HeadConfig) -> dict[str, tuple[int, ...]]:
    """Every key the head needs (embed_tokens only when it has its own) and its shape."""
    h, i = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "fc.weight": (h, len(cfg.aux_layer_ids) * cfg.target_hidden_size),
        "midlayer.input_layernorm.weight": (h,),
        "midlayer.hidden_norm.weight": (h,),
        "midlayer.post_attention_layernorm.weight": (h,),
        "midlayer.self_attn.q_proj.weight": (q, 2 * h),
        "midlayer.self_attn.k_proj.weight": (kv, 2 * h),
        "midlayer.self_attn.v_proj.weight": (kv, 2 * h),
        "midlayer.self_attn.o_proj.weight": (h, q),
        "midlayer.mlp.gate_proj.weight": (i, h),
        "midlayer.mlp.up_proj.weight": (i, h),
        "midlayer.mlp.down_proj.weight": (h, i),
        "norm.weight": (h,),
        "lm_head.weight": (cfg.draft_vocab_size, h),
        "d2t": (cfg.draft_vocab_size,),
    }
    if cfg.has_embedding:
        shapes["embed_tokens.weight"] = (cfg.vocab_size, h)
    return shapes


@dataclass
class Eagle3Head:
    """A checked head: its config and its tensors (on the CPU, in the checkpoint's dtypes; d2t
    int64, zeros when the checkpoint has none and the draft vocabulary is the target's)."""

    config: Eagle3HeadConfig
    weights: dict[str, torch.Tensor]


def read_eagle3_head(path: str | Path, target_dims: dict[str, Any]) -> Eagle3Head:
    """The head in directory ``path`` (either layout), checked against ``target_dims`` (the
    target artifact's manifest dims: hidden_size, vocab_size, num_layers). ValueError names what
    does not fit."""
    path = Path(path)
    if not path.is_dir():
        raise ValueError(
            f"EAGLE-3 head {path} is not a directory (expected config.json and the head's weights)"
        )
    if (path / HEAD_CONFIG).is_file():
        raw = json.loads((path / HEAD_CONFIG).read_text())
        if raw.get("format_version") != FORMAT_VERSION:
            raise ValueError(
                f"{path / HEAD_CONFIG} has format_version {raw.get('format_version')!r}; this pagecast reads "
                f"{FORMAT_VERSION}: convert the head again with enginebuild --speculative-config"
            )
        c = dict(raw["config"])
        c["aux_layer_ids"] = tuple(c["aux_layer_ids"])
        cfg = Eagle3HeadConfig(**c)
        _check_against_target(cfg, target_dims, path / HEAD_CONFIG)
        if not (path / HEAD_WEIGHTS).is_file():
            raise ValueError(f"EAGLE-3 head {path} has {HEAD_CONFIG} but no {HEAD_WEIGHTS}")
        weights = _load_safetensors([path / HEAD_WEIGHTS])
    else:
        cfg_path = path / "config.json"
        if not cfg_path.is_file():
            raise ValueError(f"EAGLE-3 head {path} has no config.json")
        weights = _load_published_weights(path)
        cfg = parse_head_config(
            json.loads(cfg_path.read_text()), target_dims, "embed_tokens.weight" in weights
        )
        _check_against_target(cfg, target_dims, cfg_path)
    weights = {k: v for k, v in weights.items() if not k.endswith(IGNORED_SUFFIXES)}
    if "d2t" not in weights and cfg.draft_vocab_size == cfg.vocab_size:
        weights["d2t"] = torch.zeros(cfg.vocab_size, dtype=torch.int64)  # draft ids are target ids
    t2d = weights.pop("t2d", None)  # target -> draft membership: the runtime maps the other way only
    if t2d is not None and tuple(t2d.shape) != (cfg.vocab_size,):
        raise ValueError(f"EAGLE-3 head key t2d has shape {tuple(t2d.shape)}, expected ({cfg.vocab_size},)")
    check_weights(cfg, weights)
    return Eagle3Head(cfg, weights)


def parse_head_config(
    raw: dict[str, Any], target_dims: dict[str, Any], has_embedding: bool
) -> Eagle3HeadConfig:
    """Eagle3HeadConfig from a published config.json (a LlamaConfig with EAGLE-3's extra keys)."""
    archs = raw.get("architectures") or []
    if not any("eagle3" in str(a).lower() for a in archs):
        raise ValueError(
            f"config.json architectures {archs} name no EAGLE-3 head (such as LlamaForCausalLMEagle3); "
            "speculative_config method eagle3 needs an EAGLE-3 head's directory"
        )
    if "speculators_config" in raw or "transformer_layer_config" in raw:
        raise ValueError(
            "this is an EAGLE-3 head in the speculators layout (Eagle3Speculator: layers.0.* keys, a nested "
            "transformer_layer_config); pagecast reads the EAGLE layout (LlamaForCausalLMEagle3: midlayer.* "
            "keys, a flat config.json)"
        )
    missing = [k for k in ("hidden_size", "num_attention_heads", "intermediate_size") if k not in raw]
    if missing:
        raise ValueError(f"EAGLE-3 head config.json lacks {', '.join(missing)}")
    if int(raw.get("num_hidden_layers", 1)) != 1:
        raise ValueError(f"EAGLE-3 heads with {raw['num_hidden_layers']} layers are not supported (only 1)")
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"EAGLE-3 head hidden_act {act!r} is not supported (only silu)")
    if raw.get("attention_bias") or raw.get("mlp_bias"):
        raise ValueError("EAGLE-3 heads with attention or MLP biases are not supported")
    hidden = int(raw["hidden_size"])
    heads = int(raw["num_attention_heads"])
    vocab = int(raw.get("vocab_size", target_dims["vocab_size"]))
    eagle_config = raw.get("eagle_config") or {}
    ids = raw.get("eagle_aux_hidden_state_layer_ids") or eagle_config.get("eagle_aux_hidden_state_layer_ids")
    aux = tuple(sorted(int(i) for i in ids)) if ids else default_aux_layer_ids(int(target_dims["num_layers"]))
    return Eagle3HeadConfig(
        hidden_size=hidden,
        target_hidden_size=int(raw.get("target_hidden_size") or target_dims["hidden_size"]),
        num_heads=heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or heads),
        head_dim=int(raw.get("head_dim") or hidden // heads),
        intermediate_size=int(raw["intermediate_size"]),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        vocab_size=vocab,
        draft_vocab_size=int(raw.get("draft_vocab_size") or vocab),
        aux_layer_ids=aux,
        rope=_rope(raw),
        norm_before_residual=bool(raw.get("norm_before_residual", False)),
        has_embedding=has_embedding,
    )


def _rope(raw: dict[str, Any]) -> dict[str, Any] | None:
    """The rotary parameters of a config.json: transformers 5's ``rope_parameters`` or the older
    ``rope_theta`` + ``rope_scaling`` (whose ``type`` is the older name of ``rope_type``)."""
    params = raw.get("rope_parameters")
    if params:
        rope = dict(params)
    elif raw.get("rope_theta") is not None:
        rope = dict(raw.get("rope_scaling") or {})
        rope["rope_theta"] = raw["rope_theta"]
    else:
        return None
    if "type" in rope and "rope_type" not in rope:
        rope["rope_type"] = rope.pop("type")
    rope.setdefault("rope_type", "default")
    scaled = rope["rope_type"] in ("yarn", "longrope", "llama3")
    if scaled and "original_max_position_embeddings" not in rope and "max_position_embeddings" in raw:
        rope["original_max_position_embeddings"] = raw["max_position_embeddings"]
    return rope


def _check_against_target(cfg: Eagle3HeadConfig, target_dims: dict[str, Any], where: Path) -> None:
    target_hidden, target_vocab = int(target_dims["hidden_size"]), int(target_dims["vocab_size"])
    num_layers = int(target_dims["num_layers"])
    if cfg.target_hidden_size != target_hidden:
        raise ValueError(
            f"EAGLE-3 head {where}: it was trained on a target of hidden size {cfg.target_hidden_size}; "
            f"this target's is {target_hidden} (a head for another model?)"
        )
    if cfg.vocab_size != target_vocab:
        raise ValueError(
            f"EAGLE-3 head {where}: vocab_size {cfg.vocab_size} is not the target's {target_vocab} "
            "(a head for another model?)"
        )
    if not cfg.has_embedding and cfg.hidden_size != target_hidden:
        raise ValueError(
            f"EAGLE-3 head {where} has no embed_tokens.weight, so it shares the target's embedding, but its "
            f"hidden size {cfg.hidden_size} is not the target's {target_hidden}"
        )
    ids = cfg.aux_layer_ids
    if len(set(ids)) != len(ids) or any(not 0 <= i < num_layers for i in ids):
        raise ValueError(
            f"EAGLE-3 head {where}: auxiliary hidden-state layers {list(ids)} must be distinct layers of "
            f"the target's {num_layers} (0..{num_layers - 1})"
        )
    if cfg.num_heads % cfg.num_kv_heads:
        raise ValueError(
            f"EAGLE-3 head {where}: {cfg.num_heads} heads is not a multiple of {cfg.num_kv_heads} KV heads"
        )


def check_weights(cfg: Eagle3HeadConfig, weights: dict[str, torch.Tensor]) -> None:
    """Every expected key is there with its shape, nothing else is, d2t maps into the vocabulary."""
    expected = expected_shapes(cfg)
    missing = [k for k in expected if k not in weights]
    if missing:
        raise ValueError(f"EAGLE-3 head weights lack {', '.join(missing)}")
    unknown = sorted(set(weights) - set(expected))
    if unknown:
        raise ValueError(f"EAGLE-3 head weights have keys this runtime does not know: {', '.join(unknown)}")
    for key, shape in expected.items():
        got = tuple(weights[key].shape)
        if got != shape:
            what = {
                "fc.weight": f" (hidden {cfg.hidden_size} x {len(cfg.aux_layer_ids)} * target hidden {cfg.target_hidden_size})"
            }
            raise ValueError(f"EAGLE-3 head key {key} has shape {got}, expected {shape}{what.get(key, '')}")
    d2t = weights["d2t"]
    if d2t.dtype.is_floating_point or d2t.dtype == torch.bool:
        raise ValueError(f"EAGLE-3 head key d2t is {d2t.dtype}, expected integer offsets")
    targets = torch.arange(cfg.draft_vocab_size) + d2t.long()
    if targets.numel() and (int(targets.min()) < 0 or int(targets.max()) >= cfg.vocab_size):
        raise ValueError(
            f"EAGLE-3 head key d2t maps draft ids outside the target vocabulary of {cfg.vocab_size} "
            f"(target ids {int(targets.min())}..{int(targets.max())})"
        )


def config_to_json(cfg: Eagle3HeadConfig) -> dict[str, Any]:
    """eagle3_head.json's content for ``cfg``."""
    c = asdict(cfg)
    c["aux_layer_ids"] = list(cfg.aux_layer_ids)
    return {"format_version": FORMAT_VERSION, "config": c}


def _load_published_weights(path: Path) -> dict[str, torch.Tensor]:
    files = sorted(path.glob("*.safetensors"))
    if files:
        return _load_safetensors(files)
    if (path / "pytorch_model.bin").is_file():
        loaded = torch.load(path / "pytorch_model.bin", map_location="cpu", weights_only=True)
        return {str(k): v for k, v in loaded.items()}
    raise ValueError(f"EAGLE-3 head {path} has no weights (*.safetensors or pytorch_model.bin)")


def _load_safetensors(files: list[Path]) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in files:
        out.update(load_file(str(f)))
    return out
