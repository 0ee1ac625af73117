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

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
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
    shared = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "gate_up", "up_proj": "gate_up"}
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
