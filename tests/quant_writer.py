"""A format writer for tests: quantise a float checkpoint round-to-nearest into AWQ "gemm" or GPTQ
(v1/v2, sym/asym, act-order, any group size), packed exactly as the real tools pack it.

Written from the format descriptions (shared QUANT.md), independently of builder/quant.py's
reader, so a test that builds what this writes and compares with the float model catches a
reader that unpacks the wrong nibble. Next to each quantised checkpoint it writes the same model
with every projection replaced by its exact fp32 dequantization, for transformers to run.
"""

from __future__ import annotations

import json
import shutil
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

# Mixtral's experts name their gate / down / up projections w1 / w2 / w3.
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "w1", "w2", "w3")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of a word holds column 8j + AWQ_ORDER[i]


@dataclass(frozen=True)
class Format:
    method: str  # "awq" | "gptq"
    group_size: int = 32  # -1: per channel
    sym: bool = False
    desc_act: bool = False
    checkpoint_format: str = "gptq"  # gptq | gptq_v2 (GPTQ only)

    @property
    def name(self) -> str:
        if self.method == "awq":
            return f"awq-g{self.group_size}"
        return (
            f"{self.checkpoint_format}-g{self.group_size}-{'sym' if self.sym else 'asym'}"
            f"{'-actorder' if self.desc_act else ''}"
        )


def _pack_words(nibbles: torch.Tensor) -> torch.Tensor:
    """[..., 8] values 0..15 -> int32 [...], nibble i in bits 4i..4i+3."""
    words = torch.zeros(nibbles.shape[:-1], dtype=torch.int64)
    for i in range(8):
        words |= nibbles[..., i].to(torch.int64) << (4 * i)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def quantise(w: torch.Tensor, fmt: Format, seed: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """nn.Linear.weight [N, K] -> (the module's tensors in ``fmt``, exact dequantized [N, K] fp32)."""
    n, k = w.shape
    g = k if fmt.group_size == -1 else fmt.group_size
    wt = w.t().float()  # [K, N]
    if fmt.desc_act:
        order = torch.randperm(k, generator=torch.Generator().manual_seed(seed))
        g_idx = torch.empty(k, dtype=torch.int64)
        g_idx[order] = torch.arange(k) // g
    else:
        g_idx = torch.arange(k) // g
    groups = k // g
    scales = torch.empty(groups, n)
    zeros = torch.empty(groups, n, dtype=torch.int64)
    for gi in range(groups):
        rows = wt[g_idx == gi]
        if fmt.sym:
            s = (rows.abs().amax(0) * 2 / 15).clamp_min(1e-5)
            z = torch.full((n,), 8, dtype=torch.int64)
        else:
            lo, hi = rows.amin(0).clamp(max=0), rows.amax(0).clamp(min=0)
            s = ((hi - lo) / 15).clamp_min(1e-5)
            s = s.half().float()
            z = torch.round(-lo / s).clamp(0, 15).to(torch.int64)
        scales[gi], zeros[gi] = s.half().float(), z
    q = torch.clamp(torch.round(wt / scales[g_idx]) + zeros[g_idx], 0, 15).to(torch.int64)
    deq = (q - zeros[g_idx]).float() * scales[g_idx]  # [K, N]
    out: dict[str, torch.Tensor] = {"scales": scales.half()}
    if fmt.method == "awq":
        cols = torch.tensor(AWQ_ORDER)
        out["qweight"] = _pack_words(q.view(k, n // 8, 8)[..., cols])
        out["qzeros"] = _pack_words(zeros.view(groups, n // 8, 8)[..., cols])
    else:
        stored = zeros if fmt.checkpoint_format == "gptq_v2" else (zeros - 1) & 0xF
        out["qweight"] = _pack_words(q.view(k // 8, 8, n).permute(0, 2, 1))
        out["qzeros"] = _pack_words(stored.view(groups, n // 8, 8))
        out["g_idx"] = g_idx.to(torch.int32)
    return out, deq.t().contiguous()


def quantization_config(fmt: Format) -> dict[str, object]:
    if fmt.method == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": fmt.group_size, "zero_point": True,
                "version": "gemm", "modules_to_not_convert": None}  # fmt: skip
    return {"quant_method": "gptq", "bits": 4, "group_size": fmt.group_size, "sym": fmt.sym,
            "desc_act": fmt.desc_act, "checkpoint_format": fmt.checkpoint_format}  # fmt: skip


def _input_key(module: str) -> str:
    """Projections that read the same input (q/k/v; gate/up) get the same act-order permutation,
    as GPTQ gives them (their Hessians are the same)."""
    parent, _, leaf = module.rpartition(".")
    shared = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "gate_up", "up_proj": "gate_up",
              "w1": "gate_up", "w3": "gate_up"}  # fmt: skip
    if ".experts." in module:  # each MoE expert is quantised on its own tokens: a permutation of its own
        return f"{parent}.{shared.get(leaf, leaf)}"
    return f"{parent.rpartition('.')[0]}.{shared.get(leaf, leaf)}"


def write(src: Path, dst: Path, fmt: Format, shared_perm: bool = True) -> tuple[Path, Path]:
    """Quantise the float checkpoint ``src`` into ``dst`` (quantised) and ``dst``-dequantized
    (float, for transformers). Returns both directories. ``shared_perm=False`` gives q/k/v (and
    gate/up) different act-order permutations, which a fused build must refuse."""
    deq_dir = dst.with_name(dst.name + "-dequantized")
    for d in (dst, deq_dir):
        shutil.rmtree(d, ignore_errors=True)
        shutil.copytree(src, d)
        for f in d.glob("*.safetensors"):
            f.unlink()
    tensors = {}
    for f in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    quantised, dequantised = {}, {}
    for name, t in sorted(tensors.items()):
        module = name.removesuffix(".weight")
        if name.endswith(".weight") and module.rpartition(".")[2] in PROJECTIONS:
            key = _input_key(module) if shared_perm else module
            parts, deq = quantise(t, fmt, seed=zlib.crc32(key.encode()))
            quantised.update({f"{module}.{p}": v for p, v in parts.items()})
            dequantised[name] = deq
        else:
            quantised[name] = t
            dequantised[name] = t
    save_file(quantised, str(dst / "model.safetensors"), metadata={"format": "pt"})
    save_file(dequantised, str(deq_dir / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = quantization_config(fmt)
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst, deq_dir


# ---------------------------------------------------------------------------- FP8 (W8A8)
#
# Written from the published format descriptions (shared QUANT.md), independently of
# builder/fp8.py and kernels/reference.py: e4m3 values are x / scale saturated to +-448 and cast
# (round to nearest even); a weight's scale is its amax / 448 over the tensor (ModelOpt), or over
# each 128x128 block (the fine-grained format, stored as ``weight_scale_inv``: despite the name,
# the multiplier that dequantises).

E4M3_MAX = 448.0
# ct-channel-static: compressed-tensors channel weights with static per-tensor activations;
# ct-tensor-token: per-tensor weights with dynamic per-token activations (both accepted by the reader).
FP8_FORMATS = ("modelopt", "fp8-block", "ct-channel", "ct-block", "ct-channel-static", "ct-tensor-token")
# with a static input scale per module (Mistral's fine-grained per-tensor format names it activation_scale)
STATIC_FP8_FORMATS = ("modelopt", "ct-channel-static", "fp8-tensor-static")


def _e4m3(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (x / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def fp8_quantise(w: torch.Tensor, fmt: str) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """nn.Linear.weight [N, K] -> (the module's tensors in ``fmt``, exact fp32 dequantization [N, K])."""
    w = w.float()
    n, k = w.shape
    if fmt == "modelopt":
        scale = (w.abs().max().clamp_min(1e-12) / E4M3_MAX).reshape(())
        q = _e4m3(w, scale)
        return {"weight": q, "weight_scale": scale}, q.float() * scale
    if fmt == "fp8-tensor-static":  # Mistral's FP8 releases: one fp32 weight_scale_inv (a multiplier), shape []
        scale = (w.abs().max().clamp_min(1e-12) / E4M3_MAX).reshape(())
        q = _e4m3(w, scale)
        return {"weight": q, "weight_scale_inv": scale}, q.float() * scale
    if fmt == "ct-tensor-token":  # compressed-tensors per-tensor weights: one fp32 scale, shape [1]
        scale = (w.abs().max().clamp_min(1e-12) / E4M3_MAX).reshape(1)
        q = _e4m3(w, scale)
        return {"weight": q, "weight_scale": scale}, q.float() * scale
    if fmt in ("ct-channel", "ct-channel-static"):  # FP8_DYNAMIC: one bf16 scale per output row, [N, 1]
        scale = (w.abs().amax(1, keepdim=True).clamp_min(1e-12) / E4M3_MAX).to(torch.bfloat16)
        q = _e4m3(w, scale.float())
        return {"weight": q, "weight_scale": scale}, q.float() * scale.float()
    if fmt in ("fp8-block", "ct-block"):  # ct-block: compressed-tensors FP8_BLOCK, the same blocks as weight_scale
        nb, kb = -(-n // 128), -(-k // 128)
        scales = torch.empty(nb, kb)
        q = torch.empty(n, k, dtype=torch.float8_e4m3fn)
        deq = torch.empty(n, k)
        for i in range(nb):
            for j in range(kb):
                block = w[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128]
                s = block.abs().max().clamp_min(1e-12) / E4M3_MAX
                scales[i, j] = s
                qb = _e4m3(block, s)
                q[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128] = qb
                deq[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128] = qb.float() * s
        return {"weight": q, "weight_scale" if fmt == "ct-block" else "weight_scale_inv": scales}, deq
    raise ValueError(f"unknown fp8 format {fmt!r}")


def fp8_quantization_config(fmt: str, lm_head: bool = False) -> dict[str, object]:
    """``fmt``'s quantization_config; ``lm_head``: the LM head quantised too (not in the ignore list)."""
    head = [] if lm_head else ["lm_head"]
    if fmt == "modelopt":
        return {"quant_method": "modelopt", "quant_algo": "FP8", "kv_cache_quant_algo": None,
                "exclude_modules": head}  # fmt: skip
    if fmt.startswith("ct-"):  # llm-compressor's FP8_DYNAMIC / FP8_BLOCK / FP8 schemes, the MoE routers ignored
        scheme = {"type": "float", "num_bits": 8, "symmetric": True}
        weights = {**scheme, "strategy": "tensor" if fmt == "ct-tensor-token" else "channel", "dynamic": False}
        acts = {**scheme, "strategy": "token", "dynamic": True}
        if fmt == "ct-block":
            weights = {**weights, "strategy": "block", "block_structure": [128, 128]}
            acts = {**acts, "strategy": "group", "group_size": 128}
        if fmt == "ct-channel-static":
            acts = {**acts, "strategy": "tensor", "dynamic": False}
        return {"quant_method": "compressed-tensors", "format": "float-quantized",
                "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": acts}},
                "ignore": [*head, "re:.*mlp.gate$"]}  # fmt: skip
    if fmt == "fp8-tensor-static":  # as Ministral 3's config.json has it
        return {"quant_method": "fp8", "activation_scheme": "static", "weight_block_size": None, "dequantize": False,
                "modules_to_not_convert": head}  # fmt: skip
    return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
            "modules_to_not_convert": head}  # fmt: skip


def copy_without_weights(src: Path, dst: Path) -> dict[str, torch.Tensor]:
    """``dst`` a fresh copy of checkpoint ``src`` but for its weights files; returns ``src``'s tensors."""
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(src, dst)
    for f in dst.glob("*.safetensors"):
        f.unlink()
    tensors = {}
    for f in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    return tensors


def write_fp8(
    src: Path, dst: Path, fmt: str, input_scales: dict[str, float] | None = None, *, lm_head: bool = False,
    hf_quant_config: bool = False,
) -> tuple[Path, dict[str, torch.Tensor]]:  # fmt: skip
    """Quantise the float checkpoint ``src`` into ``dst`` in ``fmt`` (bf16 for what stays
    unquantised, as published checkpoints). Returns ``dst`` and every projection's exact fp32
    dequantization. A static format's ``input_scale`` of a module is ``input_scales[key]``, the key
    shared by the modules reading one input (q/k/v, gate/up: ``_input_key``), 0.02 by default;
    a module's own name as the key gives it alone that scale.

    ``lm_head``: the LM head (an untied one) quantised in ``fmt`` too, without an input scale (as
    a checkpoint whose ignore list leaves lm_head out). ``hf_quant_config`` (ModelOpt only): the
    config in hf_quant_config.json, as ModelOpt's export writes it, and none in config.json."""
    tensors = copy_without_weights(src, dst)
    out, deq = {}, {}
    scales = input_scales or {}
    for name, t in sorted(tensors.items()):
        module = name.removesuffix(".weight")
        projection = module.rpartition(".")[2] in PROJECTIONS
        if name.endswith(".weight") and (projection or (lm_head and name == "lm_head.weight")):
            parts, d = fp8_quantise(t, fmt)
            out.update({f"{module}.{p}": v for p, v in parts.items()})
            if fmt in STATIC_FP8_FORMATS and projection:
                leaf = "activation_scale" if fmt == "fp8-tensor-static" else "input_scale"
                out[f"{module}.{leaf}"] = torch.tensor(scales.get(module, scales.get(_input_key(module), 0.02)))
            deq[name] = d
        else:
            out[name] = t.to(torch.bfloat16) if t.is_floating_point() else t
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    qc = fp8_quantization_config(fmt, lm_head)
    if hf_quant_config:
        assert fmt == "modelopt", "hf_quant_config.json is ModelOpt's"
        section = {k: v for k, v in qc.items() if k != "quant_method"}
        producer = {"name": "modelopt", "version": "0.29.0"}
        (dst / "hf_quant_config.json").write_text(json.dumps({"producer": producer, "quantization": section}, indent=2))
    else:
        config["quantization_config"] = qc
    config["torch_dtype"] = config["dtype"] = "bfloat16"
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst, deq


def quantised_artifacts(tiny_checkpoint_factory, tmp_path_factory, spec):  # type: ignore[no-untyped-def]
    """``make(case)`` -> (quantised checkpoint, its exact dequantisation, a CPU artifact of it), each
    made once per case: ``spec(case)`` gives (family, checkpoint overrides, Format)."""
    from conftest import build_artifact

    made: dict[str, tuple[Path, Path, Path]] = {}

    def make(case: str) -> tuple[Path, Path, Path]:
        if case not in made:
            family, overrides, fmt = spec(case)
            src = tiny_checkpoint_factory(family, **overrides)
            root = tmp_path_factory.mktemp(f"quant-{case}")
            ckpt, deq = write(src, root / case, fmt)
            made[case] = (ckpt, deq, build_artifact(ckpt, root / "engine", gpu="cpu"))
        return made[case]

    return make


# FP4 (e2m1) magnitudes by the low three bits of a code; bit 3 is the sign
_E2M1_MAGNITUDES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def mxfp4_quantise(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An expert stack in transformers' gpt-oss layout [E, in, out] as its MXFP4 checkpoints store it:
    blocks [E, out, in / 32, 16] uint8 (each byte two FP4 codes, the first value in the low nibble)
    and scales [E, out, in / 32] uint8 (a power of two per group of 32 inputs, biased by 127). Each
    group's scale is the least power of two that brings its largest magnitude within 6; values
    round to the nearest FP4 magnitude."""
    rows = w.float().transpose(1, 2)  # [E, out, in]
    e, out, k = rows.shape
    groups = rows.reshape(e, out, k // 32, 32)
    amax = groups.abs().amax(-1).clamp_min(2.0**-100)
    exponent = torch.ceil(torch.log2(amax / 6.0)).clamp(-126, 127)
    scaled = groups / torch.pow(2.0, exponent).unsqueeze(-1)
    magnitude = (scaled.abs().unsqueeze(-1) - _E2M1_MAGNITUDES).abs().argmin(-1)
    codes = (magnitude | ((scaled < 0).long() << 3)).to(torch.uint8)  # [E, out, G, 32]
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks.contiguous(), (exponent + 127).to(torch.uint8)


def write_mxfp4(src: Path, dst: Path) -> Path:
    """The float gpt-oss checkpoint ``src`` as its MXFP4 releases are: each expert stack
    (``experts.gate_up_proj``, ``experts.down_proj``) as ``_blocks`` and ``_scales``, the rest in
    bf16, ``quantization_config.quant_method: mxfp4``."""
    out = {}
    for name, t in sorted(copy_without_weights(src, dst).items()):
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            out[f"{name}_blocks"], out[f"{name}_scales"] = mxfp4_quantise(t)
        else:
            out[name] = t.to(torch.bfloat16) if t.is_floating_point() else t
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"],
    }
    config["torch_dtype"] = config["dtype"] = "bfloat16"
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst
