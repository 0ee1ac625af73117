"""Argument checks shared by the paged attention launchers (decode and prefill): one place
that says what the kernels accept."""

from __future__ import annotations

import torch


def check_paged_attention_args(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    out: torch.Tensor | None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Raise ValueError on inconsistent shapes, dtypes or strides; returns (block_tables,
    seq_lens, query_start_loc) as int32 and the output tensor (``out`` or a new one)."""
    _, num_heads, head_dim = q.shape
    _, num_kv_heads, _, cache_head_dim = k_cache.shape
    num_seqs = seq_lens.shape[0]
    if v_cache.shape != k_cache.shape or cache_head_dim != head_dim:
        raise ValueError(
            f"cache shapes {tuple(k_cache.shape)}/{tuple(v_cache.shape)} do not match q {tuple(q.shape)}"
        )
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if v_cache.dtype != k_cache.dtype or k_cache.dtype not in (q.dtype, torch.float8_e4m3fn):
        raise ValueError(
            f"the caches ({k_cache.dtype}, {v_cache.dtype}) must both be q's dtype ({q.dtype}) or float8_e4m3fn"
        )
    if not (k_scale > 0 and v_scale > 0):
        raise ValueError(f"k_scale {k_scale} and v_scale {v_scale} must be positive")
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("q and the caches need a contiguous last (head_dim) dimension")
    if block_tables.shape[0] != num_seqs or query_start_loc.shape[0] != num_seqs + 1:
        raise ValueError("block_tables, seq_lens and query_start_loc disagree on the number of sequences")
    return (
        block_tables.to(torch.int32),
        seq_lens.to(torch.int32),
        query_start_loc.to(torch.int32),
        torch.empty_like(q) if out is None else out,
    )


def check_sinks(sinks: torch.Tensor | None, num_heads: int, device: torch.device) -> None:
    """Raise ValueError unless ``sinks`` is None or one fp32/bf16/fp16 logit per query head,
    contiguous, on q's device (the kernels index it by query head)."""
    if sinks is None:
        return
    if sinks.shape != (num_heads,) or sinks.stride(0) != 1:
        raise ValueError(f"sinks must be a contiguous [num_heads] = [{num_heads}] tensor, got {tuple(sinks.shape)}")
    if sinks.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"sinks must be float32, bfloat16 or float16, got {sinks.dtype}")
    if sinks.device != device:
        raise ValueError(f"sinks are on {sinks.device}, q on {device}")


def check_window(window: int, chunk: int) -> int:
    """The kernels' one ``window`` argument for a layer's sliding ``window`` or attention ``chunk``
    (Llama 4's chunked layers; the kernel's CHUNKED constexpr tells them apart): at most one of
    them, neither negative."""
    if window < 0 or chunk < 0:
        raise ValueError(f"window and chunk must not be negative, got {window} and {chunk}")
    if window and chunk:
        raise ValueError(f"a layer has a sliding window ({window}) or attention chunks ({chunk}), not both")
    return window or chunk
