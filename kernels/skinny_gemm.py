"""Skinny GEMM: y = x @ w.T (+ b) for the few rows of a small decode batch.

At batch 1..16 a projection is a matrix-vector product bound by reading the weight once.
cuBLAS picks split-K kernels for some of these shapes (Llama-3-8B's qkv and o_proj reach 64-78%
of the H200's read bandwidth at batch 1, measured), so the tune pass times this kernel against
torch for every projection and batch bucket and keeps whichever is faster; ``{"torch": 1}`` in
the table (and the default, untuned) means F.linear.

One program owns BLOCK_N output columns for every row: it streams its [BLOCK_N, K] slice of the
weight once, through tl.dot with the rows padded to 16 (the tensor cores' minimum), so Triton
pipelines the weight loads.

Narrow projections give that too few programs: Qwen3-30B-A3B's o_proj (N = 2048) has 128 column
blocks of 16 on an H200's 132 multiprocessors, each reading all of K = 4096, and cuBLAS's answer
at one row is a split-K kernel plus a reduction kernel (7.2 + 1.7 us a layer, measured on the
H200). A ``{"BLOCK_N": n, "BLOCK_K": k, "SPLIT_K": s}`` config splits K over s programs per
column block and reduces in the same launch, as kernels/fp8_gemm.py's fused decode kernel does:
each program dots its ``STEPS`` K steps, stores its fp32 [M, BLOCK_N] partial to a [s, M, N]
workspace, and after a CTA barrier takes a ticket on the column block's counter
(kernels/split_k.py; acq_rel at GPU scope); the program drawing the last ticket adds the partials
in split order 0..s-1 (the same sum whichever program is last: deterministic), adds the bias,
casts, stores y and sets the counter back to 0. Up to 16 rows only, so no two of these launches
run at once on a device (runtime/cuda_graphs.py's half batches start at 32 rows).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from pagecast.kernels import pdl, reference, split_k
from pagecast.kernels.tuning import SKINNY_ROW_BUCKETS, KernelConfig

MAX_ROWS = SKINNY_ROW_BUCKETS[-1]  # larger batches are GEMMs for cuBLAS


@triton.jit
def _skinny_gemm_kernel(
    x_ptr,  # [M, K]
    w_ptr,  # [N, K]
    b_ptr,  # [N] or unused
    y_ptr,  # [M, N]
    part_ptr,  # fp32 [SPLIT_K, M, N]: each split's partial sums (SPLIT_K > 1), else unused
    count_ptr,  # int32 [>= cdiv(N, BLOCK_N)]: splits finished per column block, 0 between launches (SPLIT_K > 1)
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_ym,
    STEPS,  # K steps per split (SPLIT_K > 1; the last split may have fewer, even none), else unused
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    SPLIT_K: tl.constexpr = 1,  # programs per column block (grid axis 1), reduced in this launch
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
    if SPLIT_K == 1:
        first = 0
        last = tl.cdiv(K, BLOCK_K)  # K % BLOCK_K == 0 (the launcher checks)
    else:
        first = tl.program_id(1) * STEPS
        last = tl.minimum(first + STEPS, tl.cdiv(K, BLOCK_K))
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + (first * BLOCK_K + offs_k)[None, :]
    w_ptrs = w_ptr + offs_n[None, :].to(tl.int64) * stride_wn + (first * BLOCK_K + offs_k)[:, None]  # w.T tiles
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for _ in range(first, last):
        x = tl.load(x_ptrs, mask=row_ok[:, None], other=0.0)
        w = tl.load(w_ptrs, mask=col_ok[None, :], other=0.0)
        acc = tl.dot(x, w, acc, input_precision=DOT_PRECISION)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    y_ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
    y_ok = row_ok[:, None] & col_ok[None, :]
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=y_ok)
    else:
        # The split-K reduction in this launch (the module docstring): the partial out; the last of
        # the column block's SPLIT_K programs adds the partials in split order.
        parts = part_ptr + offs_m[:, None] * N + offs_n[None, :]
        tl.store(parts + tl.program_id(1) * (M * N), acc, mask=y_ok)
        counter = count_ptr + pid
        if split_k.last_to_arrive(counter, SPLIT_K):
            total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for s in range(SPLIT_K):  # .cg: from L2, where the other programs' partials are
                total += tl.load(parts + s * (M * N), mask=y_ok, other=0.0, cache_modifier=".cg")
            if HAS_BIAS:
                total += tl.load(b_ptr + offs_n, mask=col_ok, other=0.0).to(tl.float32)[None, :]
            tl.store(y_ptrs, total.to(y_ptr.dtype.element_ty), mask=y_ok)
            split_k.reset(counter)


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
] + [
    # K split over SPLIT_K programs a column block, reduced in the launch (the module docstring):
    # for the narrow projections, whose unsplit tiles give one program a multiprocessor or fewer.
    KernelConfig({"BLOCK_N": n, "BLOCK_K": k, "SPLIT_K": sk}, num_warps=w, num_stages=s)
    for (n, k, sk, w, s) in (
        (16, 256, 2, 4, 4),
        (16, 256, 4, 4, 4),
        (16, 128, 4, 4, 6),
        (16, 128, 8, 4, 6),
        (32, 256, 2, 4, 4),
        (32, 128, 4, 4, 5),
        (32, 128, 8, 4, 5),
    )
]
# Split only where the unsplit tile gives at most three programs a multiprocessor (an H200 has 132):
# o_proj at 128-256 column blocks of 16, qkv at 320-384 (Qwen3-30B-A3B's 5,120 and Llama-3-8B's 6,144
# columns; cuBLAS's qkv GEMV ran at 65% of copy at one row of the former).
MAX_SPLIT_COLUMN_BLOCKS = 400


def split_of(config: KernelConfig | None) -> int:
    return 1 if config is None else int(config.params.get("SPLIT_K", 1))


def prune_configs(configs: list[KernelConfig], n: int, k: int) -> list[KernelConfig]:
    """Keep torch, and tiles that divide K and give about a program per multiprocessor or more
    (the narrowest tile always stays); split tiles where their column blocks are few (at most
    MAX_SPLIT_COLUMN_BLOCKS) and every split gets at least two K steps."""
    kept = []
    for c in configs:
        if is_torch(c):
            kept.append(c)
        elif k % c["BLOCK_K"] == 0:
            blocks, split = -(-n // c["BLOCK_N"]), split_of(c)
            if split == 1:
                if c["BLOCK_N"] == 16 or n // c["BLOCK_N"] >= 128:
                    kept.append(c)
            elif blocks <= MAX_SPLIT_COLUMN_BLOCKS and k // c["BLOCK_K"] >= 2 * split:
                kept.append(c)
    return kept


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
    block_n, block_k = cfg["BLOCK_N"], cfg["BLOCK_K"]
    blocks = triton.cdiv(n, block_n)
    num_steps = k // block_k
    split, steps = split_k.split_steps(num_steps, split_of(cfg))
    if split > 1:
        part, counters = split_k.partials(x.device, split, m, n, blocks, "skinny_gemm")
    else:
        part, counters, steps = y, y, 0  # unused
    _skinny_gemm_kernel[(blocks, split)](
        x, weight, bias if bias is not None else y, y, part, counters, m, n, k,
        x.stride(0), weight.stride(0), y.stride(0), steps,
        HAS_BIAS=bias is not None, BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=block_k,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32", SPLIT_K=split,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl.launch_options(),
    )  # fmt: skip
    return y
