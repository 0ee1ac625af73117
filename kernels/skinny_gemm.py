"""Skinny GEMM: y = x @ w.T (+ b) for the few rows of a small decode batch.

At batch 1..16 a projection is a matrix-vector product bound by reading the weight once.
cuBLAS picks split-K kernels for some of these shapes (Llama-3-8B's qkv and o_proj reach 64-78%
of the H200's read bandwidth at batch 1, measured), so the tune pass times this kernel against
torch for every projection and batch bucket and keeps whichever is faster; ``{"torch": 1}`` in
the table (and the default, untuned) means F.linear.

One program owns BLOCK_N output columns for every row: it streams its [BLOCK_N, K] slice of the
weight once, through tl.dot with the rows padded to 16 (the tensor cores' minimum), so Triton
pipelines the weight loads; there is no split-K and no second reduction kernel.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from pagecast.kernels import pdl, reference
from pagecast.kernels.tuning import SKINNY_ROW_BUCKETS, KernelConfig

MAX_ROWS = SKINNY_ROW_BUCKETS[-1]  # larger batches are GEMMs for cuBLAS


@triton.jit
def _skinny_gemm_kernel(
    x_ptr,  # [M, K]
    w_ptr,  # [N, K]
    b_ptr,  # [N] or unused
    y_ptr,  # [M, N]
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_ym,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    PDL: tl.constexpr = False,  # launched with programmatic dependent launch (kernels/pdl.py)
):
    if PDL:
        gdc_wait()  # before any memory access: the kernel before may still be running
    pid = tl.program_id(0)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    row_ok = offs_m < M
    col_ok = offs_n < N
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]
    w_ptrs = w_ptr + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]  # [BLOCK_K, BLOCK_N]: w.T
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for _ in range(tl.cdiv(K, BLOCK_K)):  # K % BLOCK_K == 0 (the launcher checks)
        x = tl.load(x_ptrs, mask=row_ok[:, None], other=0.0)
        w = tl.load(w_ptrs, mask=col_ok[None, :], other=0.0)
        acc = tl.dot(x, w, acc, input_precision=DOT_PRECISION)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    y_ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


TORCH = KernelConfig({"torch": 1}, num_warps=0, num_stages=0)  # F.linear (cuBLAS)

CONFIG_SPACE: list[KernelConfig] = [TORCH] + [
    KernelConfig({"BLOCK_N": n, "BLOCK_K": k}, num_warps=w, num_stages=s)
    for (n, k, w, s) in (
        (16, 256, 4, 4),
        (16, 512, 4, 3),
        (32, 256, 4, 4),
        (32, 128, 4, 5),
        (64, 128, 4, 4),
        (16, 128, 4, 6),
        (32, 512, 8, 3),
        (64, 256, 8, 3),
        (16, 64, 4, 8),  # K that only 64 divides (SmolLM2's 576)
        (32, 64, 4, 8),
    )
]


def prune_configs(configs: list[KernelConfig], n: int, k: int) -> list[KernelConfig]:
    """Keep torch, and tiles that divide K and give about a program per multiprocessor or more
    (the narrowest tile always stays)."""
    return [
        c for c in configs if is_torch(c) or (k % c["BLOCK_K"] == 0 and (c["BLOCK_N"] == 16 or n // c["BLOCK_N"] >= 128))
    ]


def is_torch(config: KernelConfig | None) -> bool:
    return config is None or bool(config.params.get("torch"))


def skinny_gemm(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, config: Mapping[str, int] | None = None
) -> torch.Tensor:
    """x [M <= 16, K] @ weight [N, K].T (+ bias [N]) -> [M, N] in x's dtype, fp32 accumulation.

    ``config`` None or ``{"torch": 1}`` runs F.linear. Capture-safe (no host syncs)."""
    cfg = KernelConfig.coerce(config)
    m, k = x.shape
    n = weight.shape[0]
    if is_torch(cfg) or m > MAX_ROWS or k % cfg["BLOCK_K"] or x.stride(1) != 1 or weight.stride(1) != 1:  # type: ignore[index]
        return reference.linear(x, weight, bias)
    assert cfg is not None
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    block_n = cfg["BLOCK_N"]
    _skinny_gemm_kernel[(triton.cdiv(n, block_n),)](
        x, weight, bias if bias is not None else y, y, m, n, k,
        x.stride(0), weight.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=cfg["BLOCK_K"],
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl.launch_options(),
    )  # fmt: skip
    return y
