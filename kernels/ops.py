"""The kernel entry points the generated model code calls.

Each op runs the Triton kernel when its tensors are on a CUDA device (with the launch
config from the artifact's tuning table) and the pure-torch reference otherwise.
"""

from __future__ import annotations

from typing import Any

import torch

from pagecast.kernels import reference

# kernel name -> shape bucket -> config, loaded from the artifact's tuning.json by the runtime.
_tuning: dict[str, Any] = {}
_use_triton = True


def configure(tuning: dict[str, Any] | None = None, use_triton: bool = True) -> None:
    """Install the artifact's tuning table; ``use_triton=False`` forces the torch reference."""
    global _tuning, _use_triton
    _tuning = dict(tuning or {})
    _use_triton = use_triton


def _triton(x: torch.Tensor) -> bool:
    return _use_triton and x.is_cuda


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return reference.rms_norm(x, weight, eps)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    return reference.fused_add_rms_norm(x, residual, weight, eps)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    return reference.silu_and_mul(x)


def rotary_and_write_kv(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> torch.Tensor:
    return reference.rotary_and_write_kv(positions, q, k, v, cos_sin_cache, k_cache, v_cache, slot_mapping)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    max_query_len: int,
    max_seq_len: int,
) -> torch.Tensor:
    return reference.paged_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale)
