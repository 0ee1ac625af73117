"""Kernel launch configs, shape buckets and the autotuner that fills the artifact's tuning table.

The table maps kernel name -> shape bucket -> the config that won on the target GPU:

    {"kernels": {"paged_decode_attention": {"64x2048": {"config": {...}, "time_us": 41.2,
                                                        "alternatives": [...]}}},
     "device": "NVIDIA H200", "tuned": true}

The runtime looks a config up by bucket (``decode_bucket`` / ``token_bucket``) on every call,
so the lookup is a bisect plus a dict access. Tuning is deterministic up to timing noise:
fixed seeds, the median of repeats, and a config only displaces an earlier one in the space
when it is faster by more than ``TIE_TOLERANCE``. Every config written into the table has
been launched during tuning, so a TRITON_CACHE_DIR captured then holds every kernel the
runtime will run for those buckets.

This module imports triton lazily: the CPU runtime imports the bucket functions without it.
"""

from __future__ import annotations

import bisect
import functools
import json
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

# Shape buckets. A shape maps to the smallest bucket at least as large (clamped to the last).
DECODE_BATCH_BUCKETS = (1, 8, 32, 64, 128, 256)
DECODE_CONTEXT_BUCKETS = (512, 2048, 8192, 32768)
TOKEN_BUCKETS = (8, 64, 256, 1024, 4096, 16384)
PREFILL_TOKEN_BUCKETS = (128, 512, 2048, 8192)

KERNELS = (
    "paged_decode_attention",
    "paged_prefill_attention",
    "rotary_kv",
    "rms_norm",
    "fused_add_rms_norm",
    "silu_and_mul",
)

TIE_TOLERANCE = 0.02  # a later config must beat the best so far by 2% to take its place
_DEFAULTS_DIR = Path(__file__).parent / "tuning_defaults"


@dataclass(frozen=True)
class KernelConfig:
    """One launch configuration: tunable kernel parameters plus num_warps / num_stages.

    ``params`` holds the kernel's block sizes and launch-time knobs (e.g. BLOCK_N,
    num_splits); it is read with ``cfg["BLOCK_N"]``. ``as_dict`` / ``coerce`` convert to and
    from the JSON form stored in tuning.json.
    """

    params: Mapping[str, int] = field(default_factory=dict)
    num_warps: int = 4
    num_stages: int = 2

    def __getitem__(self, key: str) -> int:
        return self.params[key]

    def as_dict(self) -> dict[str, int]:
        return {**dict(self.params), "num_warps": self.num_warps, "num_stages": self.num_stages}

    @classmethod
    def coerce(cls, config: Mapping[str, Any] | KernelConfig | None) -> KernelConfig | None:
        """A KernelConfig from a table entry's dict (or None / a KernelConfig, passed through)."""
        if config is None or isinstance(config, KernelConfig):
            return config
        params = {k: int(v) for k, v in config.items() if k not in ("num_warps", "num_stages")}
        return cls(params, int(config.get("num_warps", 4)), int(config.get("num_stages", 2)))


@dataclass(frozen=True)
class ModelShapes:
    """The model dimensions the kernels are tuned for (one tensor-parallel rank's share)."""

    num_heads: int  # query heads on this rank
    num_kv_heads: int  # KV heads on this rank
    head_dim: int
    hidden: int
    intermediate: int  # the MLP's intermediate size on this rank (silu_and_mul's output width)
    block_size: int  # KV-cache block size in tokens
    dtype: str | torch.dtype = "bfloat16"  # activation and KV-cache dtype
    max_model_len: int = 8192  # longest context: context buckets beyond it are not tuned
    max_num_seqs: int = 256  # largest decode batch: batch buckets beyond it are not tuned

    def __post_init__(self) -> None:
        if self.num_heads <= 0 or self.num_kv_heads <= 0 or self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} must be a positive multiple of num_kv_heads {self.num_kv_heads}")
        for name in ("head_dim", "hidden", "intermediate", "block_size", "max_model_len", "max_num_seqs"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        torch_dtype(self.dtype)

    @property
    def torch_dtype(self) -> torch.dtype:
        return torch_dtype(self.dtype)


def torch_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    name = str(dtype).removeprefix("torch.")
    value = getattr(torch, name, None)
    if not isinstance(value, torch.dtype):
        raise ValueError(f"unknown dtype {dtype!r}")
    return value


# ---------------------------------------------------------------------------- buckets


def _ceil_bucket(buckets: tuple[int, ...], value: int) -> int:
    i = bisect.bisect_left(buckets, value)
    return buckets[min(i, len(buckets) - 1)]


def decode_bucket(num_seqs: int, max_seq_len: int) -> str:
    """'<batch>x<context>' for the decode kernel, e.g. decode_bucket(40, 1000) == '64x2048'."""
    return f"{_ceil_bucket(DECODE_BATCH_BUCKETS, num_seqs)}x{_ceil_bucket(DECODE_CONTEXT_BUCKETS, max_seq_len)}"


def token_bucket(num_tokens: int) -> str:
    """'t<tokens>' for the per-token kernels (norms, activation, rotary)."""
    return f"t{_ceil_bucket(TOKEN_BUCKETS, num_tokens)}"


def prefill_bucket(num_tokens: int) -> str:
    """'t<tokens>' for the prefill attention kernel (all query tokens of the batch)."""
    return f"t{_ceil_bucket(PREFILL_TOKEN_BUCKETS, num_tokens)}"


def bucket_for(kernel: str, **dims: int) -> str:
    if kernel == "paged_decode_attention":
        return decode_bucket(dims["num_seqs"], dims["max_seq_len"])
    if kernel == "paged_prefill_attention":
        return prefill_bucket(dims["num_tokens"])
    return token_bucket(dims["num_tokens"])


def lookup(table: Mapping[str, Any] | None, kernel: str, bucket: str) -> dict[str, int] | None:
    """The config dict for (kernel, bucket) from a tuning table, or None when it has none.

    Accepts the whole table ({"kernels": ...}) or its "kernels" part, and entries that are
    either {"config": {...}, ...} or a bare config dict.
    """
    if not table:
        return None
    kernels = table.get("kernels", table)
    entry = kernels.get(kernel, {}).get(bucket) if isinstance(kernels, Mapping) else None
    if not isinstance(entry, Mapping):
        return None
    config = entry.get("config", entry)
    return dict(config) if isinstance(config, Mapping) else None


@functools.cache
def _device_sms(index: int) -> int:
    return int(torch.cuda.get_device_properties(index).multi_processor_count)


def num_sms(device: torch.device | int | None = None) -> int:
    """Multiprocessors of the current (or given) CUDA device; 132 (an H100/H200) without one."""
    if not torch.cuda.is_available():
        return 132
    if device is None:
        index = torch.cuda.current_device()
    else:
        index = device if isinstance(device, int) else (torch.device(device).index or 0)
    return _device_sms(index)
