"""FP8 (W8A8) builds end to end on the CPU, in fp32: checkpoints written by llm-compressor
(committed under tests/fixtures/fp8/, made by its make_fixtures.py), ModelOpt and fine-grained
checkpoints (128x128 blocks; Mistral's per-tensor static form) written by tests/quant_writer.py,
and ``--quant fp8`` on a float checkpoint.

The reference is transformers running the float model with every projection's weight replaced by
its dequantised value (fp8 x scale, computed here from the checkpoint's tensors as the format
documents it, not by pagecast's reader) and every projection's input fake-quantised the same
way (per token, per 1x128 group or with the static input scale; quantise then dequantise): the
"same activation quantisation". The artifact runs the exact CPU emulation (fp32 matmul of the
e4m3 values, then the scales), so greedy tokens must agree.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import build_artifact
from engine_utils import engine_last_logits, near_tie_divergences
from quant_writer import write_fp8
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from pagecast.runtime import LLM, SamplingParams
from pagecast.runtime.errors import BuildError

FIXTURES = Path(__file__).parent / "fixtures" / "fp8"
FLOAT = Path(__file__).parent / "fixtures" / "quant" / "float"
PROMPTS = [[1, 50, 200, 7, 300, 11], [400, 3, 99], list(range(20, 60))]
MAX_TOKENS = 10
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
E4M3_MAX = 448.0


# ---------------------------------------------------------------------------- the reference


def _fake_quant(x: torch.Tensor, activations: str, input_scale: float | None) -> torch.Tensor:
    """x quantised to e4m3 and back, as the format says (independent of kernels/reference.py)."""
    shape = x.shape
    x = x.reshape(-1, shape[-1]).float()
    if activations == "static":
        s = torch.tensor(input_scale)
    elif activations == "token":
        s = x.abs().amax(-1, keepdim=True).clamp_min(1e-12) / E4M3_MAX
    else:  # 1x128 groups along the input
        k = x.shape[1]
        pad = torch.nn.functional.pad(x, (0, -k % 128)).view(x.shape[0], -1, 128)
        s = (pad.abs().amax(-1, keepdim=True).clamp_min(1e-12) / E4M3_MAX).expand(-1, -1, 128).reshape(x.shape[0], -1)[:, :k]
    q = (x / s).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return (q.float() * s).reshape(shape)


def dequantised(ckpt: Path) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """Every tensor of an FP8 checkpoint as fp32 (projections: fp8 x scale) and each module's static input scale."""
    weights, inputs = {}, {}
    with safe_open(str(ckpt / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        for name in names:
            module, _, leaf = name.rpartition(".")
            if leaf in ("weight_scale", "weight_scale_inv", "input_scale", "activation_scale", "k_scale", "v_scale"):
                if leaf in ("input_scale", "activation_scale"):
                    inputs[module] = float(f.get_tensor(name).float().reshape(-1)[0])
                continue
            t = f.get_tensor(name)
            if t.dtype != torch.float8_e4m3fn:
                weights[name] = t.float()
                continue
            scale = f.get_tensor(next(f"{module}.{s}" for s in ("weight_scale", "weight_scale_inv") if f"{module}.{s}" in names)).float()
            n, k = t.shape
            if scale.dim() == 2 and scale.shape != (n, 1):  # [ceil(N/128), ceil(K/128)] blocks
                scale = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[:n, :k]
            weights[name] = t.float() * scale.reshape(-1, 1) if scale.dim() < 2 else t.float() * scale
    return weights, inputs


_FP8_KV = "pagecast_fp8_kv_reference"


def _fp8_kv_attention(hf: torch.nn.Module, k_scales: list[float], v_scales: list[float]) -> None:
    """``hf``'s attention reads K (after rotary) and V as an e4m3 KV cache holds them: fp8(x /
    scale) saturated to +-448, times the scale, with each layer's scales (the FP8 KV cache's
    definition, written here independently of kernels/reference.py)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    from transformers.models.llama.modeling_llama import eager_attention_forward

    def e4m3(x: torch.Tensor, scale: float) -> torch.Tensor:
        return (x.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float() * scale

    def attention(module, query, key, value, attention_mask, **kwargs):  # type: ignore[no-untyped-def]
        i = module.layer_idx
        return eager_attention_forward(module, query, e4m3(key, k_scales[i]), e4m3(value, v_scales[i]), attention_mask, **kwargs)

    AttentionInterface.register(_FP8_KV, attention)
    AttentionMaskInterface.register(_FP8_KV, ALL_MASK_ATTENTION_FUNCTIONS["eager"])
    hf.config._attn_implementation = _FP8_KV


def reference_model(
    ckpt: Path, activations: str, quantised: tuple[str, ...] = PROJECTIONS, kv_scales: tuple[list[float], list[float]] | None = None
) -> torch.nn.Module:
    """``kv_scales``: (K, V) scales per layer of an FP8 KV cache, which the reference's attention then reads through."""
    weights, inputs = dequantised(ckpt)
    config = json.loads((ckpt / "config.json").read_text())
    config.pop("quantization_config", None)
    from transformers import AutoConfig

    cfg = AutoConfig.for_model(**{k: v for k, v in config.items() if k not in ("architectures",)})
    cfg.architectures = config.get("architectures")
    hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    state = hf.state_dict()
    missing = [n for n in state if n not in weights and not (n == "lm_head.weight" and cfg.tie_word_embeddings)]
    assert not missing, missing
    with torch.no_grad():
        for name, value in weights.items():
            state[name].copy_(value)
        if cfg.tie_word_embeddings:
            hf.lm_head.weight = hf.model.embed_tokens.weight
    for name, module in hf.named_modules():
        if name.rpartition(".")[2] in quantised:
            scale = inputs.get(name)

            def hook(mod, args, scale=scale):  # type: ignore[no-untyped-def]
                return (_fake_quant(args[0], activations, scale),)

            module.register_forward_pre_hook(hook)
    if kv_scales is not None:
        _fp8_kv_attention(hf, *kv_scales)
    return hf


def _generate(
    artifact: Path, prompts: list[list[int]] = PROMPTS, logits: bool = True
) -> tuple[list[list[int]], list[torch.Tensor] | None]:  # fmt: skip
    """Greedy tokens of ``prompts`` and (``logits``: one-rank engines only, the probe runs rank 0
    alone) the last-position logits of each."""
    llm = LLM(artifact, max_num_seqs=4, max_num_batched_tokens=64)
    last = None
    try:
        outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
        if logits:
            last = [engine_last_logits(llm.engine, p) for p in prompts]
    finally:
        llm.engine.runner.close()
    return [o.token_ids for o in outputs], last


# Where the two sides sum in another order, an activation within an fp32 rounding of an e4m3
# rounding boundary can round the other way (one e4m3 step, up to 1/8 of its value): a logit
# moves by ~0.01-0.05. Greedy decoding then differs only where the reference's top two tokens are
# that close; a divergence is accepted only there (the engine's token within NEAR_TIE of the
# reference's best logit at the first differing position), and must then stop being compared.
NEAR_TIE = 0.1


def _assert_greedy_parity(
    artifact: Path, ckpt: Path, activations: str, tp: int = 1, quantised: tuple[str, ...] = PROJECTIONS,
    kv_scales: tuple[list[float], list[float]] | None = None, flip_tol: float | None = None,
) -> None:  # fmt: skip
    """Greedy tokens equal up to a near tie, and the first prompt's last logits within 2e-3 of the
    reference's. ``flip_tol``: every prompt's last logits compared instead, each within
    ``flip_tol`` and at least one within 2e-3 (where one value in the pass may round to the other
    e4m3 value, see NEAR_TIE)."""
    hf = reference_model(ckpt, activations, quantised, kv_scales)
    tokens, logits = _generate(artifact, logits=tp == 1)
    diverged = near_tie_divergences(hf, PROMPTS, tokens, MAX_TOKENS, NEAR_TIE)
    assert diverged <= 1, "more than one prompt diverged from the reference"
    if logits is None:
        return
    with torch.no_grad():
        refs = [hf(torch.tensor([p])).logits[0, -1] for p in PROMPTS]
    if flip_tol is None:
        # The same fp8 values and scales; only fp32 summation order differs (and, rarely, an
        # activation that rounds the other way to e4m3 because of it).
        torch.testing.assert_close(logits[0], refs[0], atol=2e-3, rtol=0)
        return
    diffs = [(got - ref).abs().max().item() for got, ref in zip(logits, refs, strict=True)]
    assert max(diffs) <= flip_tol and min(diffs) <= 2e-3, diffs


# ---------------------------------------------------------------------------- llm-compressor checkpoints

LLMC = {  # fixture -> (activations, weight scale layout in the checkpoint)
    "llmcompressor-fp8-dynamic": ("token", "channel"),
    "llmcompressor-fp8-static": ("static", "tensor"),
    "llmcompressor-fp8-block": ("group", "block"),
}


@pytest.fixture(scope="module")
def llmc_artifacts(tmp_path_factory):  # type: ignore[no-untyped-def]
    made: dict[str, Path] = {}

    def make(name: str) -> Path:
        if name not in made:
            made[name] = build_artifact(FIXTURES / name, tmp_path_factory.mktemp(name) / "engine", gpu="cpu")
        return made[name]

    return make


@pytest.mark.parametrize("name", list(LLMC))
def test_llmcompressor_checkpoint_greedy_tokens_equal_transformers_dequantised(name, llmc_artifacts):  # type: ignore[no-untyped-def]
    artifact = llmc_artifacts(name)
    _assert_greedy_parity(artifact, FIXTURES / name, LLMC[name][0])
    manifest = json.loads((artifact / "manifest.json").read_text())
    assert manifest["quant"] == "fp8"
    assert manifest["quantization"]["source"] == "compressed-tensors"
    assert (manifest["quantization"]["activations"], manifest["quantization"]["checkpoint_weights"]) == LLMC[name]


@pytest.mark.parametrize("name", list(LLMC))
def test_llmcompressor_weights_are_within_half_an_e4m3_step_of_the_float_weights(name):  # type: ignore[no-untyped-def]
    """A check that does not trust pagecast's reader or the reference's scale handling: the
    dequantised weight of every projection is the float weight rounded to e4m3 (relative error
    at most 2^-4, e4m3's half step, where it is not in the subnormal range)."""
    weights, _ = dequantised(FIXTURES / name)
    with safe_open(str(FLOAT / "model.safetensors"), "pt") as f:
        for module in [n for n in weights if n.rpartition(".")[0].rpartition(".")[2] in PROJECTIONS]:
            w = f.get_tensor(module).to(torch.bfloat16).float()
            deq = weights[module]
            big = w.abs() > w.abs().max() / 32
            assert ((deq - w).abs()[big] / w.abs()[big]).max() <= 2**-4 + 1e-3, module


def test_llmcompressor_artifact_layout_keeps_fp8_weights_and_half_embedding(llmc_artifacts):  # type: ignore[no-untyped-def]
    artifact = llmc_artifacts("llmcompressor-fp8-static")
    with safe_open(str(artifact / "weights" / "rank0.safetensors"), "pt") as f:
        assert f.get_tensor("layers.0.qkv_proj.weight").dtype == torch.float8_e4m3fn
        assert f.get_tensor("layers.0.qkv_proj.weight").shape == (128 + 2 * 64, 128)
        # per-tensor q, k, v scales held per channel: each section repeats its module's scale
        s = f.get_tensor("layers.0.qkv_proj.weight_scale")
        assert s.shape == (256,) and s.dtype == torch.float32
        assert len({float(v) for v in s[:128]}) == 1 and len({float(v) for v in s[128:192]}) == 1
        assert f.get_tensor("layers.0.down_proj.input_scale").shape == (1,)
        assert f.get_tensor("embed_tokens.weight").dtype == torch.float32
    model_py = (artifact / "model.py").read_text()
    assert "LINEAR = quant_linear.Fp8Linear(weights='channel', activations='static')" in model_py
    assert "compressed-tensors checkpoint): per-tensor weight scales" in (artifact / "report.md").read_text()


# ---------------------------------------------------------------------------- writer formats and --quant fp8

# hidden 192: K is not a multiple of 128, so the block format has partial blocks (as SmolLM2's 576).
SHAPE = {"vocab_size": 512, "num_hidden_layers": 2, "hidden_size": 192, "intermediate_size": 320, "num_attention_heads": 6, "num_key_value_heads": 2, "head_dim": 32}


WRITTEN = {  # writer format -> (source, activations, checkpoint weights) in the manifest
    "modelopt": ("modelopt", "static", "tensor"),
    "fp8-block": ("fp8", "group", "block"),
    "fp8-tensor-static": ("fp8", "static", "tensor"),  # Mistral's releases (Ministral 3)
    # compressed-tensors schemes llm-compressor's presets do not produce, which the reader accepts:
    "ct-channel-static": ("compressed-tensors", "static", "channel"),
    "ct-tensor-token": ("compressed-tensors", "token", "tensor"),
}


@pytest.mark.parametrize("fmt", list(WRITTEN))
def test_written_checkpoint_greedy_tokens_equal_transformers_dequantised(fmt, tiny_checkpoint_factory, tmp_path):  # type: ignore[no-untyped-def]
    src = tiny_checkpoint_factory("llama", **SHAPE)
    ckpt, _ = write_fp8(src, tmp_path / fmt, fmt, input_scales={"model.layers.0.down_proj": 0.005})
    artifact = build_artifact(ckpt, tmp_path / "engine", gpu="cpu", quant="fp8")
    q = json.loads((artifact / "manifest.json").read_text())["quantization"]
    assert (q["source"], q["activations"], q["checkpoint_weights"]) == WRITTEN[fmt]
    _assert_greedy_parity(artifact, ckpt, WRITTEN[fmt][1])


def _per_channel_checkpoint(src: Path, expected: Path) -> dict[str, torch.Tensor]:
    """``src`` with each projection rounded per output channel (amax / 448) as compressed-tensors
    would write it, into ``expected``, for the reference to read like the others; its tensors."""
    from safetensors.torch import load_file, save_file

    expected.mkdir()
    tensors = load_file(str(src / "model.safetensors"))
    out = {}
    for name, t in tensors.items():
        if name.removesuffix(".weight").rpartition(".")[2] in PROJECTIONS and name.endswith(".weight"):
            s = t.float().abs().amax(1, keepdim=True).clamp_min(1e-12) / E4M3_MAX
            out[name] = (t.float() / s).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
            out[name.removesuffix("weight") + "weight_scale"] = s
        else:
            out[name] = t
    save_file(out, str(expected / "model.safetensors"))
    (expected / "config.json").write_text((src / "config.json").read_text())
    return out


def test_quant_fp8_on_a_float_checkpoint_equals_per_channel_rounding(tiny_checkpoint_factory, tmp_path):  # type: ignore[no-untyped-def]
    src = tiny_checkpoint_factory("qwen2", **SHAPE)  # q/k/v biases stay in the half type
    artifact = build_artifact(src, tmp_path / "engine", gpu="cpu", quant="fp8")
    expected = tmp_path / "expected"
    out = _per_channel_checkpoint(src, expected)
    _assert_greedy_parity(artifact, expected, "token")
    with safe_open(str(artifact / "weights" / "rank0.safetensors"), "pt") as f:
        got = f.get_tensor("layers.1.gate_up_proj.weight")
        gate, up = out["model.layers.1.mlp.gate_proj.weight"], out["model.layers.1.mlp.up_proj.weight"]
        assert torch.equal(got.view(torch.uint8), torch.cat([gate, up]).view(torch.uint8))
        assert f.get_tensor("layers.0.qkv_proj.bias").dtype == torch.float32
        head = "lm_head.weight" if "lm_head.weight" in set(f.keys()) else "embed_tokens.weight"  # tied
        assert f.get_tensor(head).dtype == torch.float32
    manifest = json.loads((artifact / "manifest.json").read_text())
    assert manifest["quantization"] == {
        "source": "build", "weights": "channel", "activations": "token", "checkpoint_weights": "channel",
        "method": "fp8", "block_size": 0, "group_size": 0, "lm_head": False,
    }  # fmt: skip
    # The memory plan counts the FP8 weights at one byte each (the KV blocks fit beside them).
    plan = json.loads((artifact / "memory_plan.json").read_text())
    raw = (artifact / "weights" / "rank0.safetensors").read_bytes()
    header = json.loads(raw[8 : 8 + int.from_bytes(raw[:8], "little")])
    header.pop("__metadata__", None)
    assert plan["weight_bytes"] == sum(v["data_offsets"][1] - v["data_offsets"][0] for v in header.values())


@pytest.mark.parametrize("fmt", ["ct-channel-static", "fp8-block"])
def test_fp8_checkpoint_of_interleaved_rope_reorders_rows_and_scales(fmt, tiny_checkpoint_factory, tmp_path):  # type: ignore[no-untyped-def]
    """An FP8 checkpoint of a model that rotates adjacent pairs (Helium; Llama 4's FP8 releases):
    its q and k rows are reordered to the kernels' rotary order with their per-row scales (per
    channel; a block checkpoint's, which the artifact holds per row), so the engine equals
    transformers on the dequantised checkpoint."""
    src = tiny_checkpoint_factory("helium", **SHAPE)
    ckpt, _ = write_fp8(src, tmp_path / fmt, fmt)
    artifact = build_artifact(ckpt, tmp_path / "engine", gpu="cpu", quant="fp8")
    assert json.loads((artifact / "manifest.json").read_text())["quantization"]["source"] == WRITTEN[fmt][0]
    _assert_greedy_parity(artifact, ckpt, WRITTEN[fmt][1])


def test_quant_fp8_of_interleaved_rope_reorders_rows_before_rounding(tiny_checkpoint_factory, tmp_path):  # type: ignore[no-untyped-def]
    """Helium rotates adjacent pairs (Llama 4, GLM and ERNIE 4.5 too): the build reorders each head's
    q and k rows to the kernels' rotary order before it quantises them, so per-channel rounding
    gives each row the scale it has in the checkpoint: the engine equals transformers on the
    per-channel rounded checkpoint, in the checkpoint's own row order."""
    src = tiny_checkpoint_factory("helium", **SHAPE)
    artifact = build_artifact(src, tmp_path / "engine", gpu="cpu", quant="fp8")
    expected = tmp_path / "expected"
    out = _per_channel_checkpoint(src, expected)
    _assert_greedy_parity(artifact, expected, "token")
    with safe_open(str(artifact / "weights" / "rank0.safetensors"), "pt") as f:
        q_rows = f.get_tensor("layers.0.qkv_proj.weight")[: 6 * 32].view(torch.uint8)
    checkpoint_q = out["model.layers.0.self_attn.q_proj.weight"].view(torch.uint8).view(6, 32, -1)
    reordered = torch.cat((checkpoint_q[:, 0::2], checkpoint_q[:, 1::2]), dim=1).reshape(6 * 32, -1)
    assert torch.equal(q_rows, reordered) and not torch.equal(q_rows, checkpoint_q.reshape(6 * 32, -1))


def test_quant_fp8_block_scheme_on_a_float_checkpoint_is_the_block_format(tiny_checkpoint_factory, tmp_path):  # type: ignore[no-untyped-def]
    """--quant fp8 --fp8-scheme block: each projection quantised at build in 128x128 blocks (amax /
    448 a block; hidden 192 leaves partial blocks), activations per 1x128 group at run time: the
    e4m3 values of the fine-grained block checkpoint the test writer makes from the same weights,
    and transformers' greedy tokens on that checkpoint dequantised, its activations so quantised."""
    from quant_writer import fp8_quantise
    from safetensors.torch import load_file, save_file

    src = tiny_checkpoint_factory("llama", **SHAPE)
    artifact = build_artifact(src, tmp_path / "engine", gpu="cpu", quant="fp8", fp8_scheme="block")
    # The expected checkpoint: each projection in the writer's fine-grained block format
    # (weight_scale_inv per 128x128 block), every other tensor as it is.
    expected = tmp_path / "expected"
    expected.mkdir()
    out = {}
    for name, t in load_file(str(src / "model.safetensors")).items():
        if name.endswith(".weight") and name.removesuffix(".weight").rpartition(".")[2] in PROJECTIONS:
            parts, _ = fp8_quantise(t, "fp8-block")
            out.update({f"{name.removesuffix('weight')}{leaf}": v for leaf, v in parts.items()})
        else:
            out[name] = t
    save_file(out, str(expected / "model.safetensors"))
    (expected / "config.json").write_text((src / "config.json").read_text())
    manifest = json.loads((artifact / "manifest.json").read_text())
    assert manifest["quantization"] == {
        "source": "build", "weights": "block", "activations": "group", "checkpoint_weights": "block",
        "method": "fp8", "block_size": 128, "group_size": 0, "lm_head": False,
    }  # fmt: skip
    assert manifest["build_options"]["fp8_scheme"] == "block"
    _assert_greedy_parity(artifact, expected, "group")
    with safe_open(str(artifact / "weights" / "rank0.safetensors"), "pt") as f, \
            safe_open(str(expected / "model.safetensors"), "pt") as e:  # fmt: skip
        got = f.get_tensor("layers.1.gate_up_proj.weight")
        gate, up = (e.get_tensor(f"model.layers.1.mlp.{p}_proj.weight") for p in ("gate", "up"))
        assert torch.equal(got.view(torch.uint8), torch.cat([gate, up]).view(torch.uint8))
        scale = f.get_tensor("layers.1.down_proj.weight_scale")  # [N, ceil(K / 128)]: each block's scale on its rows
        blocks = e.get_tensor("model.layers.1.mlp.down_proj.weight_scale_inv")
        assert torch.equal(scale, blocks.repeat_interleave(128, 0)[: scale.shape[0]])
    assert "128x128 weight blocks" in (artifact / "report.md").read_text()


@pytest.mark.parametrize(
    ("source", "options", "message"),
    [
        ("float", {}, "add --quant fp8"),
        ("ct-channel", {"quant": "fp8"}, "already FP8"),
    ],
)
def test_fp8_scheme_is_refused_where_it_cannot_apply(source, options, message, tiny_checkpoint_factory, tmp_path):  # type: ignore[no-untyped-def]
    ckpt = tiny_checkpoint_factory("llama", **SHAPE)
    if source != "float":
        ckpt, _ = write_fp8(ckpt, tmp_path / source, source)
    with pytest.raises(BuildError, match=message):
        build_artifact(ckpt, tmp_path / "e", gpu="cpu", fp8_scheme="block", **options)


# ---------------------------------------------------------------------------- --fp8-lm-head

UNTIED = {**SHAPE, "tie_word_embeddings": False}


def _per_channel(tensors: dict[str, torch.Tensor], quantised: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """The float checkpoint with each named module's weight quantised per output channel (amax /
    448), written as a compressed-tensors checkpoint holds it: e4m3 weight, fp32 weight_scale."""
    out = {}
    for name, t in tensors.items():
        if name.endswith(".weight") and name.removesuffix(".weight").rpartition(".")[2] in quantised:
            s = t.float().abs().amax(1, keepdim=True).clamp_min(1e-12) / E4M3_MAX
            out[name] = (t.float() / s).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
            out[name.removesuffix("weight") + "weight_scale"] = s
        else:
            out[name] = t
    return out


def test_fp8_lm_head_greedy_tokens_equal_transformers_with_the_head_quantised(tiny_checkpoint_factory, tmp_path):  # type: ignore[no-untyped-def]
    """--fp8-lm-head: the LM head quantised per output channel like the projections, its input per
    token; the reference quantises the head's weight and fake-quantises its input the same way."""
    from safetensors.torch import load_file, save_file

    src = tiny_checkpoint_factory("llama", **UNTIED)
    artifact = build_artifact(src, tmp_path / "engine", gpu="cpu", quant="fp8", fp8_lm_head=True)
    quantised = (*PROJECTIONS, "lm_head")
    expected = tmp_path / "expected"
    expected.mkdir()
    out = _per_channel(load_file(str(src / "model.safetensors")), quantised)
    save_file(out, str(expected / "model.safetensors"))
    (expected / "config.json").write_text((src / "config.json").read_text())
    _assert_greedy_parity(artifact, expected, "token", quantised=quantised)
    with safe_open(str(artifact / "weights" / "rank0.safetensors"), "pt") as f:
        assert torch.equal(f.get_tensor("lm_head.weight").view(torch.uint8), out["lm_head.weight"].view(torch.uint8))
        torch.testing.assert_close(f.get_tensor("lm_head.weight_scale"), out["lm_head.weight_scale"].reshape(-1))
        assert f.get_tensor("embed_tokens.weight").dtype == torch.float32  # the lookup stays in the half type
    manifest = json.loads((artifact / "manifest.json").read_text())
    assert manifest["quantization"]["lm_head"] is True and manifest["build_options"]["fp8_lm_head"] is True
    assert "LM head FP8" in (artifact / "report.md").read_text()
    from pagecast.runtime.artifact import load_manifest, rebuild_command

    assert "--fp8-lm-head" in rebuild_command(artifact, load_manifest(artifact)).split()
    # The head's bytes are half the half-type build's (fp32 here: a quarter), and the plan counts them.
    plain = build_artifact(src, tmp_path / "plain", gpu="cpu", quant="fp8")
    saved = json.loads((plain / "memory_plan.json").read_text())["weight_bytes"] - json.loads(
        (artifact / "memory_plan.json").read_text()
    )["weight_bytes"]
    assert saved == 512 * 192 * 4 - (512 * 192 + 512 * 4)


def test_fp8_lm_head_tp2_cuts_the_head_and_its_scales_by_vocabulary_rows(tiny_checkpoint_factory, tmp_path):  # type: ignore[no-untyped-def]
    """TP=2 on gloo: each rank holds its vocabulary rows of the FP8 head and their scales (the
    second rank's padded with zeros past the vocabulary), and the engine serves."""
    src = tiny_checkpoint_factory("llama", **{**UNTIED, "vocab_size": 509})  # odd: the last rank is padded
    one = build_artifact(src, tmp_path / "tp1", gpu="cpu", quant="fp8", fp8_lm_head=True)
    two = build_artifact(src, tmp_path / "tp2", gpu="cpu", quant="fp8", fp8_lm_head=True, tp=2)
    with safe_open(str(one / "weights" / "rank0.safetensors"), "pt") as f:
        whole_w, whole_s = f.get_tensor("lm_head.weight"), f.get_tensor("lm_head.weight_scale")
    parts = []
    for rank in (0, 1):
        with safe_open(str(two / "weights" / f"rank{rank}.safetensors"), "pt") as f:
            parts.append((f.get_tensor("lm_head.weight"), f.get_tensor("lm_head.weight_scale")))
    assert [p[0].shape for p in parts] == [(255, 192), (255, 192)] and [p[1].shape for p in parts] == [(255,), (255,)]
    assert torch.equal(torch.cat([p[0] for p in parts])[:509].view(torch.uint8), whole_w.view(torch.uint8))
    assert torch.equal(torch.cat([p[1] for p in parts])[:509], whole_s)
    assert not parts[1][1][-1].any()  # the padding row
    tokens, _ = _generate(two, logits=False)
    assert all(len(t) == MAX_TOKENS and max(t) < 509 for t in tokens)


@pytest.mark.parametrize(
    ("source", "overrides", "options", "message"),
    [
        ("llama", {}, {}, r"--fp8-lm-head quantises the LM head of an FP8 build: add --quant fp8"),
        ("llama", {"tie_word_embeddings": True}, {"quant": "fp8"}, r"ties its LM head to the embedding"),
        ("llmcompressor-fp8-static", None, {}, r"needs per-channel weights with per-token activations .* tensor weights with static"),
    ],
)  # fmt: skip
def test_fp8_lm_head_is_refused_where_it_cannot_apply(source, overrides, options, message, tiny_checkpoint_factory, tmp_path):  # type: ignore[no-untyped-def]
    ckpt = FIXTURES / source if overrides is None else tiny_checkpoint_factory(source, **{**UNTIED, **overrides})
    with pytest.raises(BuildError, match=message):
        build_artifact(ckpt, tmp_path / "e", gpu="cpu", fp8_lm_head=True, **options)


# ---------------------------------------------------------------------------- refusals


def _edited(tmp_path: Path, name: str, edit) -> Path:  # type: ignore[no-untyped-def]
    import shutil

    dst = tmp_path / f"edited-{name}"
    shutil.copytree(FIXTURES / name, dst)
    config = json.loads((dst / "config.json").read_text())
    edit(config["quantization_config"])
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def test_quant_option_must_match_an_fp8_checkpoint(tmp_path):  # type: ignore[no-untyped-def]
    with pytest.raises(BuildError, match=r"--quant awq: the checkpoint is FP8-quantised \(compressed-tensors, channel weights, token"):
        build_artifact(FIXTURES / "llmcompressor-fp8-dynamic", tmp_path / "a", gpu="cpu", quant="awq")
    with pytest.raises(BuildError, match=r"--quant fp8: the checkpoint is already quantised \(quant_method 'gptq'\)"):
        build_artifact(Path(__file__).parent / "fixtures" / "quant" / "autoround-gptq-g32-sym", tmp_path / "b", gpu="cpu", quant="fp8")


def _int8_weights(qc):  # type: ignore[no-untyped-def]
    qc["config_groups"]["group_0"]["weights"]["type"] = "int"


def _weight_only(qc):  # type: ignore[no-untyped-def]
    qc["config_groups"]["group_0"]["input_activations"] = None


def _ignore_q(qc):  # type: ignore[no-untyped-def]
    qc["ignore"] = ["lm_head", "re:.*q_proj"]


@pytest.mark.parametrize(
    ("name", "edit", "message"),
    [
        ("llmcompressor-fp8-dynamic", _int8_weights, r"compressed-tensors scheme not supported \(weights int 8-bit channel; activations float 8-bit token dynamic\)"),
        ("llmcompressor-fp8-dynamic", _weight_only, r"weights float 8-bit channel; no activation quantisation"),
        ("llmcompressor-fp8-block", _ignore_q, r"ignore list \['re:\.\*q_proj'\] leaves decoder projections unquantised"),
    ],
)  # fmt: skip
def test_unsupported_fp8_schemes_are_refused_naming_what_was_found(name, edit, message, tmp_path):  # type: ignore[no-untyped-def]
    with pytest.raises(BuildError, match=message):
        build_artifact(_edited(tmp_path, name, edit), tmp_path / "e", gpu="cpu")


_FP8 = {"type": "float", "num_bits": 8, "symmetric": True}
_CHANNEL = {**_FP8, "strategy": "channel", "dynamic": False}
_TOKEN = {**_FP8, "strategy": "token", "dynamic": True}
_BLOCK_W = {**_FP8, "strategy": "block", "block_structure": [128, 128], "dynamic": False}


def _ct(*groups, **extra):  # type: ignore[no-untyped-def]
    """A compressed-tensors quantization_config with one config group per (weights, activations)."""
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"], **extra,
            "config_groups": {f"group_{i}": {"targets": ["Linear"], "weights": w, "input_activations": a}
                              for i, (w, a) in enumerate(groups)}}  # fmt: skip


def _fine(**qc):  # type: ignore[no-untyped-def]
    return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128], **qc}


@pytest.mark.parametrize(
    ("qc", "message"),
    [
        ({"quant_method": "modelopt", "quant_algo": "NVFP4"}, r"ModelOpt quant_algo 'NVFP4' is not supported: pagecast reads ModelOpt 'FP8'"),
        ({"quant_method": "modelopt", "quantization": {"quant_algo": "INT4_AWQ"}}, r"ModelOpt quant_algo 'INT4_AWQ' is not supported"),
        ({"quant_method": "modelopt", "quantization": {"quant_algo": "FP8", "exclude_modules": ["lm_head", "model.layers.1.mlp.down_proj"]}},
         r"exclude_modules \['model.layers.1.mlp.down_proj'\] leaves decoder projections unquantised"),
        (_fine(weight_block_size=[64, 64]), r"quant_method fp8 with weight_block_size \[64, 64\] and activation_scheme 'dynamic' is not supported"),
        (_fine(weight_block_size=None), r"quant_method fp8 with weight_block_size None and activation_scheme 'dynamic'"),
        (_fine(activation_scheme="static"), r"weight_block_size \[128, 128\] and activation_scheme 'static' is not supported"),
        (_fine(fmt="e5m2"), r"quant_method fp8 with fmt 'e5m2' is not supported \(only e4m3\)"),
        (_fine(modules_to_not_convert=["lm_head", "model.layers.0.mlp.gate_proj"]), r"modules_to_not_convert \['model.layers.0.mlp.gate_proj'\] leaves"),
        (_ct((_CHANNEL, _TOKEN), (_BLOCK_W, {**_TOKEN, "strategy": "group", "group_size": 128})),
         r"config_groups \['group_0', 'group_1'\]: one scheme for every Linear is supported, not 2"),
        (_ct((_BLOCK_W, {**_TOKEN, "strategy": "group", "group_size": 64})),
         r"scheme not supported \(weights float 8-bit block \[128, 128\]; activations float 8-bit group dynamic\)"),
        (_ct(({**_BLOCK_W, "block_structure": [64, 64]}, {**_TOKEN, "strategy": "group", "group_size": 128})),
         r"scheme not supported \(weights float 8-bit block \[64, 64\]"),
        (_ct((_BLOCK_W, {**_FP8, "strategy": "tensor", "dynamic": False})),
         r"scheme not supported \(weights float 8-bit block \[128, 128\]; activations float 8-bit tensor static\)"),
        (_ct((_CHANNEL, {**_TOKEN, "type": "int"})), r"scheme not supported \(weights float 8-bit channel; activations int 8-bit token dynamic\)"),
        (_ct(({**_CHANNEL, "num_bits": 4}, _TOKEN)), r"scheme not supported \(weights float 4-bit channel"),
        (_ct((_CHANNEL, {**_TOKEN, "dynamic": False})), r"activations float 8-bit token static\)"),
        (_ct((_CHANNEL, _TOKEN), format="pack-quantized"), r"compressed-tensors format 'pack-quantized' .* is not supported"),
    ],
)  # fmt: skip
def test_fp8_config_refusals_name_what_was_found(qc, message):  # type: ignore[no-untyped-def]
    from pagecast.builder import fp8

    with pytest.raises(BuildError, match=message):
        fp8.read_config(qc, None)


def _edited_tensors(tmp_path: Path, name: str, edit) -> Path:  # type: ignore[no-untyped-def]
    """A copy of fixture ``name`` with ``edit`` applied to its tensors (a dict, edited in place)."""
    import shutil

    from safetensors.torch import load_file, save_file

    dst = tmp_path / f"tensors-{name}"
    shutil.copytree(FIXTURES / name, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


Q = "model.layers.0.self_attn.q_proj"
K = "model.layers.0.self_attn.k_proj"


def _bf16_q(t):  # type: ignore[no-untyped-def]
    t[f"{Q}.weight"] = (t[f"{Q}.weight"].float() * t[f"{Q}.weight_scale"].float()).to(torch.bfloat16)


def _half_the_channel_scales(t):  # type: ignore[no-untyped-def]
    t[f"{Q}.weight_scale"] = t[f"{Q}.weight_scale"][:64].contiguous()


def _block_scales_per_tensor(t):  # type: ignore[no-untyped-def]
    t[f"{Q}.weight_scale"] = t[f"{Q}.weight_scale"].reshape(1)


def _no_k_input_scale(t):  # type: ignore[no-untyped-def]
    del t[f"{K}.input_scale"]


def _no_k_weight_scale(t):  # type: ignore[no-untyped-def]
    del t[f"{K}.weight_scale"]


def _negative_scale(t):  # type: ignore[no-untyped-def]
    t[f"{K}.weight_scale"] = -t[f"{K}.weight_scale"]


@pytest.mark.parametrize(
    ("name", "edit", "message"),
    [
        ("llmcompressor-fp8-dynamic", _bf16_q, rf"{Q}.weight is bfloat16, not float8_e4m3fn, in an FP8 \(compressed-tensors\) checkpoint"),
        ("llmcompressor-fp8-dynamic", _half_the_channel_scales, rf"{Q}.weight_scale has shape \(64, 1\); expected one scale or 128 \(per channel\)"),
        ("llmcompressor-fp8-block", _block_scales_per_tensor, rf"{Q} block scales have shape \(1,\), expected \(1, 1\) for \[128, 128\]"),
        ("llmcompressor-fp8-static", _no_k_input_scale, rf"has static activations but no '{K}.input_scale'"),
        ("llmcompressor-fp8-static", _no_k_weight_scale, rf"checkpoint has no tensor '{K}.weight_scale'"),
        ("llmcompressor-fp8-dynamic", _negative_scale, rf"{K}.weight_scale holds NaN, inf or negative scales"),
    ],
)  # fmt: skip
def test_fp8_checkpoint_tensors_that_do_not_fit_the_scheme_are_refused_by_name(name, edit, message, tmp_path):  # type: ignore[no-untyped-def]
    with pytest.raises(BuildError, match=message):
        build_artifact(_edited_tensors(tmp_path, name, edit), tmp_path / "e", gpu="cpu")


def test_fused_modules_with_different_static_input_scales_keep_the_largest_and_say_so(tmp_path):  # type: ignore[no-untyped-def]
    """q/k/v read one input, so the fused qkv_proj has one static input scale: where the
    checkpoint's differ the largest is kept (nothing clips that did not) and report.md names them."""
    scales = {}

    def k_scale_4x(t):  # type: ignore[no-untyped-def]
        t[f"{K}.input_scale"] = t[f"{Q}.input_scale"] * 4
        scales.update({m: float(t[f"model.layers.0.self_attn.{m}.input_scale"].float()) for m in ("q_proj", "k_proj", "v_proj")})

    artifact = build_artifact(_edited_tensors(tmp_path, "llmcompressor-fp8-static", k_scale_4x), tmp_path / "e", gpu="cpu")
    assert scales["k_proj"] == 4 * scales["q_proj"] and scales["k_proj"] > scales["v_proj"]
    with safe_open(str(artifact / "weights" / "rank0.safetensors"), "pt") as f:
        assert f.get_tensor("layers.0.qkv_proj.input_scale").tolist() == [scales["k_proj"]]
        assert f.get_tensor("layers.1.qkv_proj.input_scale").tolist() != [scales["k_proj"]]
    report = (artifact / "report.md").read_text()
    listed = ", ".join(f"{scales[m]:.6g}" for m in ("q_proj", "k_proj", "v_proj"))
    assert f"layers.0.qkv_proj: the fused modules' static input scales differ ({listed}); their shared input uses the largest" in report
    assert "layers.1.qkv_proj: the fused" not in report  # the unedited layers' are equal: no note


def test_block_format_tp_that_cuts_a_weight_block_is_refused(tmp_path):  # type: ignore[no-untyped-def]
    with pytest.raises(BuildError, match=r"--tp 2: layers.0.o_proj is row-parallel and its 64 inputs per rank are not a multiple of the 128"):
        build_artifact(FIXTURES / "llmcompressor-fp8-block", tmp_path / "e", gpu="cpu", tp=2)


# ---------------------------------------------------------------------------- TP and the FP8 KV cache


def test_tp2_static_fp8_greedy_tokens_equal_transformers_dequantised(tmp_path):  # type: ignore[no-untyped-def]
    """Static activation scales are the same on every rank, so TP=2 computes what TP=1 does."""
    name = "llmcompressor-fp8-static"
    artifact = build_artifact(FIXTURES / name, tmp_path / "tp2", gpu="cpu", tp=2)
    with safe_open(str(artifact / "weights" / "rank1.safetensors"), "pt") as f:
        assert f.get_tensor("layers.0.down_proj.weight").shape == (128, 192)
        assert f.get_tensor("layers.0.down_proj.weight_scale").shape == (128,)  # per channel: whole
        assert f.get_tensor("layers.0.qkv_proj.weight").shape == (64 + 32 + 32, 128)
    _assert_greedy_parity(artifact, FIXTURES / name, "static", tp=2)


def test_fp8_weights_with_the_fp8_kv_cache_equal_transformers_with_k_and_v_quantised(tmp_path, llmc_artifacts):  # type: ignore[no-untyped-def]
    """FP8 weights and the FP8 KV cache together compute what transformers computes with the
    dequantised weights, the activations fake-quantised and K / V read through e4m3 at the
    manifest's scales: the same tokens and last logits (2e-3). The model-dtype-cache engine of the
    same weights is farther from that reference than the tolerance (and the FP8-cache engine from
    the plain reference), so an engine that ignored the cache setting, or wrote or read the cache
    wrongly, would fail."""
    name = "llmcompressor-fp8-dynamic"
    artifact = build_artifact(FIXTURES / name, tmp_path / "kv", gpu="cpu", kv_cache_dtype="fp8")
    manifest = json.loads((artifact / "manifest.json").read_text())
    assert manifest["quant"] == "fp8" and manifest["kv_cache"]["dtype"] == "float8_e4m3fn"
    scales = (manifest["kv_cache"]["k_scales"], manifest["kv_cache"]["v_scales"])
    # Each K and V value is rounded to e4m3 on both sides, computed in another fp32 order: on a
    # Sapphire Rapids CPU (2026-12-06) one rounded the other way and moved the first prompt's logits
    # by 0.063, against 0.30 between the two caches' references (checked below).
    _assert_greedy_parity(artifact, FIXTURES / name, "token", kv_scales=scales, flip_tol=0.1)
    fp8_kv = reference_model(FIXTURES / name, "token", kv_scales=scales)
    plain = reference_model(FIXTURES / name, "token")
    _, plain_lasts = _generate(llmc_artifacts(name), PROMPTS[:1])
    _, fp8_lasts = _generate(artifact, PROMPTS[:1])
    assert plain_lasts is not None and fp8_lasts is not None
    plain_engine, fp8_engine = plain_lasts[0], fp8_lasts[0]
    with torch.no_grad():
        ids = torch.tensor([PROMPTS[0]])
        ref_fp8_kv, ref_plain = fp8_kv(ids).logits[0, -1], plain(ids).logits[0, -1]
    torch.testing.assert_close(plain_engine, ref_plain, atol=2e-3, rtol=0)  # each engine matches its own reference
    assert (plain_engine - ref_fp8_kv).abs().max() > 10 * 2e-3  # and not the other's
    assert (fp8_engine - ref_plain).abs().max() > 10 * 2e-3


# ---------------------------------------------------------------------------- ModelOpt's hf_quant_config.json, FP8 LM heads


def test_modelopt_export_with_only_hf_quant_config_builds_as_modelopt(tiny_checkpoint_factory, tmp_path):  # type: ignore[no-untyped-def]
    """ModelOpt's export writes its settings to hf_quant_config.json (nested under "quantization")
    and none to config.json: read as ModelOpt FP8, not as a float checkpoint whose FP8 weights
    would crash the plain path."""
    src = tiny_checkpoint_factory("llama", **SHAPE)
    ckpt, _ = write_fp8(src, tmp_path / "modelopt", "modelopt", hf_quant_config=True)
    assert "quantization_config" not in json.loads((ckpt / "config.json").read_text())
    artifact = build_artifact(ckpt, tmp_path / "engine", gpu="cpu")
    manifest = json.loads((artifact / "manifest.json").read_text())
    assert manifest["quant"] == "fp8"
    assert (manifest["quantization"]["source"], manifest["quantization"]["activations"]) == ("modelopt", "static")
    _assert_greedy_parity(artifact, ckpt, "static")


def _hf_quant_config(ckpt: Path, **quantization) -> Path:  # type: ignore[no-untyped-def]
    section = json.loads((ckpt / "hf_quant_config.json").read_text())
    section["quantization"].update(quantization)
    (ckpt / "hf_quant_config.json").write_text(json.dumps(section))
    return ckpt


def test_modelopt_hf_quant_config_exclude_modules_and_algorithm_are_checked(tiny_checkpoint_factory, tmp_path):  # type: ignore[no-untyped-def]
    src = tiny_checkpoint_factory("llama", **SHAPE)
    ckpt, _ = write_fp8(src, tmp_path / "modelopt", "modelopt", hf_quant_config=True)
    _hf_quant_config(ckpt, exclude_modules=["lm_head", "model.layers.0.self_attn.q_proj"])
    with pytest.raises(BuildError, match=r"exclude_modules \['model.layers.0.self_attn.q_proj'\] leaves decoder projections"):
        build_artifact(ckpt, tmp_path / "e1", gpu="cpu")
    _hf_quant_config(ckpt, exclude_modules=["lm_head"], quant_algo="NVFP4")
    with pytest.raises(BuildError, match=r"ModelOpt quant_algo 'NVFP4' is not supported"):
        build_artifact(ckpt, tmp_path / "e2", gpu="cpu")


def test_modelopt_kv_cache_only_hf_quant_config_builds_float_weights(tiny_checkpoint_factory, tmp_path):  # type: ignore[no-untyped-def]
    """quant_algo null with a KV algorithm: only the KV cache was calibrated; the weights are float."""
    import shutil

    ckpt = tmp_path / "kv-only"
    shutil.copytree(tiny_checkpoint_factory("llama", **SHAPE), ckpt)
    (ckpt / "hf_quant_config.json").write_text(json.dumps(
        {"producer": {"name": "modelopt"}, "quantization": {"quant_algo": None, "kv_cache_quant_algo": "FP8"}}
    ))  # fmt: skip
    manifest = json.loads((build_artifact(ckpt, tmp_path / "e", gpu="cpu") / "manifest.json").read_text())
    assert manifest["quant"] is None


@pytest.mark.parametrize(("fmt", "activations"), [("ct-channel", "token"), ("modelopt", "static"), ("fp8-block", "group")])
def test_fp8_checkpoint_head_is_dequantised_into_the_half_type(fmt, activations, tiny_checkpoint_factory, tmp_path):  # type: ignore[no-untyped-def]
    """An FP8 checkpoint that quantised its LM head too (lm_head not in its ignore list; no input
    scale for it, even with static activations) builds with the head dequantised at build (fp8 x
    its per-channel, per-tensor or block scales) into the half type, as transformers' dequantised
    model holds it; report.md says so."""
    src = tiny_checkpoint_factory("llama", **UNTIED)
    ckpt, deq = write_fp8(src, tmp_path / fmt, fmt, lm_head=True)
    with safe_open(str(ckpt / "model.safetensors"), "pt") as f:
        assert f.get_tensor("lm_head.weight").dtype == torch.float8_e4m3fn and "lm_head.input_scale" not in set(f.keys())
    artifact = build_artifact(ckpt, tmp_path / "engine", gpu="cpu")
    with safe_open(str(artifact / "weights" / "rank0.safetensors"), "pt") as f:
        assert torch.equal(f.get_tensor("lm_head.weight"), deq["lm_head.weight"])  # fp32 artifact: exact
    assert "the checkpoint stores the LM head in FP8" in (artifact / "report.md").read_text()
    _assert_greedy_parity(artifact, ckpt, activations)


def test_fp8_checkpoint_head_tp2_cuts_the_dequantised_head(tiny_checkpoint_factory, tmp_path):  # type: ignore[no-untyped-def]
    src = tiny_checkpoint_factory("llama", **UNTIED)
    ckpt, deq = write_fp8(src, tmp_path / "ct", "ct-channel", lm_head=True)
    artifact = build_artifact(ckpt, tmp_path / "engine", gpu="cpu", tp=2)
    parts = []
    for rank in (0, 1):
        with safe_open(str(artifact / "weights" / f"rank{rank}.safetensors"), "pt") as f:
            parts.append(f.get_tensor("lm_head.weight"))
    assert torch.equal(torch.cat(parts), deq["lm_head.weight"])


def test_fp8_checkpoint_head_with_fp8_lm_head_keeps_its_values_and_scales(tiny_checkpoint_factory, tmp_path):  # type: ignore[no-untyped-def]
    """--fp8-lm-head on a checkpoint whose head is FP8 already: its e4m3 values and scales as they are."""
    src = tiny_checkpoint_factory("llama", **UNTIED)
    ckpt, _ = write_fp8(src, tmp_path / "ct", "ct-channel", lm_head=True)
    artifact = build_artifact(ckpt, tmp_path / "engine", gpu="cpu", fp8_lm_head=True)
    with safe_open(str(ckpt / "model.safetensors"), "pt") as f:
        q, s = f.get_tensor("lm_head.weight"), f.get_tensor("lm_head.weight_scale")
    with safe_open(str(artifact / "weights" / "rank0.safetensors"), "pt") as f:
        assert torch.equal(f.get_tensor("lm_head.weight").view(torch.uint8), q.view(torch.uint8))
        assert torch.equal(f.get_tensor("lm_head.weight_scale"), s.float().reshape(-1))
    _assert_greedy_parity(artifact, ckpt, "token", quantised=(*PROJECTIONS, "lm_head"))


def _fp8_tensor(ckpt: Path, name: str) -> Path:
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(ckpt / "model.safetensors"))
    tensors[name] = tensors[name].to(torch.float8_e4m3fn)
    save_file(tensors, str(ckpt / "model.safetensors"), metadata={"format": "pt"})
    return ckpt


def test_fp8_tensors_outside_the_fp8_reader_are_a_build_error(tiny_checkpoint_factory, tmp_path):  # type: ignore[no-untyped-def]
    """The safety net: an FP8 tensor pagecast would read as a plain weight (an FP8 embedding; FP8
    projections under no FP8 config) is refused by name, not a float8 NotImplementedError."""
    src = tiny_checkpoint_factory("llama", **UNTIED)
    ckpt, _ = write_fp8(src, tmp_path / "ct", "ct-channel")
    _fp8_tensor(ckpt, "model.embed_tokens.weight")
    with pytest.raises(BuildError, match=r"model.embed_tokens.weight \(the artifact's embed_tokens.weight\) are float8_e4m3fn: pagecast reads FP8 weights only for the decoder projections"):
        build_artifact(ckpt, tmp_path / "e1", gpu="cpu")
    bare, _ = write_fp8(src, tmp_path / "bare", "ct-channel")
    config = json.loads((bare / "config.json").read_text())
    del config["quantization_config"]
    (bare / "config.json").write_text(json.dumps(config))
    with pytest.raises(BuildError, match=r"model.layers.0.self_attn.q_proj.weight, .* are float8_e4m3fn"):
        build_artifact(bare, tmp_path / "e2", gpu="cpu")
