"""The KV cache's storage type, planned at build time (part of the plan pass).

``--kv-cache-dtype auto`` keeps K and V in the model's dtype. ``fp8`` (alias ``fp8_e4m3``)
stores them as OCP e4m3 (``torch.float8_e4m3fn``, largest value 448): half the bytes of a
bf16 cache, so twice the tokens in the same memory and half the KV bytes every decode step
reads. Each layer has one K and one V scale (fp32): the cache holds fp8(x / scale), saturated
to +-448, and attention reads fp8 * scale.

Scales come from the checkpoint when it carries calibrated ones, under the names the common
tools write (what vLLM also reads):

    model.layers.N.self_attn.k_scale / v_scale            llm-compressor (compressed-tensors)
    model.layers.N.self_attn.k_proj.k_scale / v_proj.v_scale   NVIDIA ModelOpt
    model.layers.N.self_attn.kv_scale                     older exports: one scale for K and V

and are 1.0 otherwise (``DEFAULT_SCALE``), which suits models whose K and V stay well inside
+-448 (the common case: e4m3 keeps 3 mantissa bits from 2**-6 to 448, values below 2**-9
flush to 0). The scales are recorded in the manifest (``kv_cache``) and rendered into model.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from pagecast.runtime.errors import BuildError

FP8 = "float8_e4m3fn"
# --kv-cache-dtype values: None = the model's dtype.
OPTIONS: dict[str, str | None] = {"auto": None, "fp8": FP8, "fp8_e4m3": FP8}
DEFAULT_SCALE = 1.0
FP8_MIN_CAPABILITY = (8, 9)  # Triton converts to and from float8e4nv on Ada / Hopper and later

# (K name, V name) suffixes under a layer's attention module, in the order they are tried.
SCALE_NAMES: tuple[tuple[str, str], ...] = (
    ("k_scale", "v_scale"),
    ("k_proj.k_scale", "v_proj.v_scale"),
    ("kv_scale", "kv_scale"),
)


@dataclass(frozen=True)
class KVCachePlan:
    """How the KV cache is stored. ``dtype`` is a torch dtype name; the scales (one per layer)
    are meaningful for fp8 only and are all 1.0 for a cache in the model's dtype."""

    dtype: str
    k_scales: tuple[float, ...] = ()
    v_scales: tuple[float, ...] = ()
    scales_source: str = "none"  # "checkpoint" (calibrated), "default" (1.0) or "none" (not fp8)
    scale_names: tuple[str, str] | None = field(default=None)  # the checkpoint names they came from

    def __post_init__(self) -> None:
        if len(self.k_scales) != len(self.v_scales):
            raise ValueError("one K and one V scale per layer")
        for s in (*self.k_scales, *self.v_scales):
            if not (math.isfinite(s) and s > 0):
                raise ValueError(f"KV-cache scales must be positive and finite (got {s})")

    @property
    def is_fp8(self) -> bool:
        return self.dtype == FP8

    @property
    def element_bytes(self) -> int:
        return {FP8: 1, "float16": 2, "bfloat16": 2, "float32": 4}[self.dtype]

    def as_manifest(self) -> dict[str, Any]:
        out: dict[str, Any] = {"dtype": self.dtype}
        if self.is_fp8:
            out.update(
                k_scales=list(self.k_scales),
                v_scales=list(self.v_scales),
                scales_source=self.scales_source,
                format="e4m3fn: stored fp8(x / scale) saturated to +-448, read fp8 * scale",
            )
            if self.scale_names is not None:
                out["checkpoint_scale_names"] = list(self.scale_names)
        return out


def is_kv_cache_only(quantization_config: dict[str, Any] | None) -> bool:
    """Whether a checkpoint's quantization_config quantises the KV cache and nothing else: a
    compressed-tensors config (llm-compressor) with a ``kv_cache_scheme`` and no weight groups.
    Its weights are in the float type and its calibrated scales are self_attn.k_scale / v_scale,
    so it builds as an ordinary checkpoint. A KV scheme other than per-tensor fp8 is refused."""
    qc = quantization_config or {}
    if str(qc.get("quant_method", "")).lower() != "compressed-tensors" or qc.get("config_groups"):
        return False
    scheme = qc.get("kv_cache_scheme")
    if not scheme:
        return False
    if int(scheme.get("num_bits", 0)) != 8 or scheme.get("type") != "float" or scheme.get("strategy", "tensor") != "tensor":
        raise BuildError(
            f"the checkpoint's kv_cache_scheme {scheme} is not per-tensor 8-bit float; pagecast's fp8 KV cache takes "
            f"one e4m3 scale per layer: re-calibrate with strategy 'tensor', num_bits 8, type 'float'"
        )
    return True


def parse_option(value: str) -> str | None:
    """--kv-cache-dtype -> a torch dtype name, or None for the model's dtype."""
    key = value.lower()
    if key not in OPTIONS:
        raise ValueError(f"--kv-cache-dtype must be one of {', '.join(OPTIONS)} (got {value!r})")
    return OPTIONS[key]


def read_scales(
    checkpoint: Any, num_layers: int, layer_prefixes: list[str]
) -> tuple[list[float], list[float], tuple[str, str]] | None:
    """Per-layer (K scales, V scales, the name pair used) from the checkpoint's tensors, or None
    when it carries none. Scales on some layers only, or unusable values, are a BuildError."""
    names: dict[str, Any] = getattr(checkpoint, "tensor_shapes", {}) or {}
    for k_name, v_name in SCALE_NAMES:
        found = [
            f"{p}.self_attn.{k_name}" in names and f"{p}.self_attn.{v_name}" in names for p in layer_prefixes
        ]
        if not any(found):
            continue
        if not all(found):
            missing = [p for p, ok in zip(layer_prefixes, found) if not ok]
            raise BuildError(
                f"the checkpoint has KV-cache scales ({k_name}/{v_name}) for some layers but not for "
                f"{', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''}: it is incomplete; re-export it, "
                f"or build with --kv-cache-dtype auto"
            )
        k_scales = [_scalar(checkpoint, f"{p}.self_attn.{k_name}") for p in layer_prefixes]
        v_scales = [_scalar(checkpoint, f"{p}.self_attn.{v_name}") for p in layer_prefixes]
        return k_scales, v_scales, (k_name, v_name)
    return None


def _scalar(checkpoint: Any, name: str) -> float:
    t = checkpoint.tensor(name)
    if t.numel() != 1:
        raise BuildError(
            f"KV-cache scale {name!r} has shape {list(t.shape)}; pagecast takes one scale per layer "
            f"(per-tensor), not per head or per channel: build with --kv-cache-dtype auto"
        )
    value = float(t.float().reshape(()))
    if not (math.isfinite(value) and value > 0):
        raise BuildError(
            f"KV-cache scale {name!r} is {value}; a scale must be positive and finite: re-export the checkpoint"
        )
    return value


def plan_kv_cache(
    option: str,
    model_dtype: str,
    device: str,
    compute_capability: tuple[int, int] | None,
    gpu_name: str,
    checkpoint: Any,
    num_layers: int,
    layer_prefixes: list[str],
) -> tuple[KVCachePlan, list[str]]:
    """The KV cache plan and notes for report.md."""
    dtype = parse_option(option)
    if dtype is None:
        notes = []
        names = getattr(checkpoint, "tensor_shapes", {}) or {}
        suffixes = tuple(f".self_attn.{k}" for k, _ in SCALE_NAMES)
        if any(name.endswith(suffixes) for name in names):
            notes.append("the checkpoint carries calibrated KV-cache scales: build with --kv-cache-dtype fp8 to use them")
        return KVCachePlan(dtype=model_dtype, k_scales=(1.0,) * num_layers, v_scales=(1.0,) * num_layers), notes
    if device == "cuda" and compute_capability is not None and tuple(compute_capability) < FP8_MIN_CAPABILITY:
        raise BuildError(
            f"--kv-cache-dtype {option}: the fp8 KV cache needs compute capability "
            f"{'.'.join(map(str, FP8_MIN_CAPABILITY))} or newer (Ada, Hopper); {gpu_name} is "
            f"{'.'.join(map(str, compute_capability))}: build with --kv-cache-dtype auto"
        )
    found = (
        None if getattr(checkpoint, "dummy", False) else read_scales(checkpoint, num_layers, layer_prefixes)
    )
    if found is None:
        ones = (DEFAULT_SCALE,) * num_layers
        note = (
            f"KV cache fp8 e4m3 with the default scale {DEFAULT_SCALE} (the checkpoint carries no calibrated "
            f"k_scale/v_scale)"
        )
        return KVCachePlan(dtype=FP8, k_scales=ones, v_scales=ones, scales_source="default"), [note]
    k_scales, v_scales, names = found
    note = (
        f"KV cache fp8 e4m3 with the checkpoint's calibrated scales (self_attn.{names[0]} / {names[1]}): "
        f"K {min(k_scales):.4g}..{max(k_scales):.4g}, V {min(v_scales):.4g}..{max(v_scales):.4g}"
    )
    plan = KVCachePlan(FP8, tuple(k_scales), tuple(v_scales), scales_source="checkpoint", scale_names=names)
    return plan, [note]
