"""W4A16 GEMM: y = x @ dequant(W).T (+ b) with 4-bit weights dequantized in registers.

The weight is in the artifact layout ``builder/quant.py`` writes (AWQ and GPTQ both repacked
into it at build time):

    qweight  int32 [K / 8, N]   nibble i of row r is input 8r + i
    scales   half  [K / G, N]
    zeros    int8  [K / G, N]   W[k, n] = (q[k, n] - zeros[k // G, n]) * scales[k // G, n]
    perm     int32 [K]          act-order only: input k multiplies activation column perm[k]

K is the weight's (qweight's rows times 8). Without a perm the activations have K columns; with
one they may have fewer: a row-parallel act-order shard (builder/quant.py, row_layout) pads its
inputs to whole groups with zero weights whose perm entries read column 0.

One program owns a [BLOCK_M, BLOCK_N] tile of y and walks its share of K in BLOCK_K steps: it
loads BLOCK_K / 8 rows of packed words, expands each word to its 8 nibbles with shifts and
masks, subtracts the zero point and multiplies by the scale in fp32, casts to x's dtype for
``tl.dot`` and accumulates in fp32. Decode batches have too few output tiles to fill the GPU,
so the split-K path (SPLIT_K > 1) gives each of SPLIT_K programs a slice of K and writes fp32
partial sums that one reduction adds up (deterministic, unlike atomics). Large token counts are
compute-bound: there ``{"dequant": 1}`` dequantizes the weight once per call
(``_dequantize_kernel``) and lets cuBLAS multiply. The build times both per projection and row
bucket and keeps the faster (kernels/tuning.py); the default below is a reasonable guess.
Decode batches of up to 16 rows in a half type have a faster choice, ``{"tcgemv": 1, ...}``:
the tensor-core decode kernel of kernels/w4a16_tcgemv.py (magic-number unpacking straight into
the mma's operand registers, the scale and zero point applied once per chunk, split-K reduced
inside the one launch). On an H200 it beat both this kernel and the CUDA-core GEMV at every
Llama-3-8B projection at 1, 4 and 8 rows (benchmarks/RESULTS.md). The CUDA-core GEMV of
kernels/w4a16_gemv.py (``{"gemv": 1, ...}``) stays the decode choice where the tensor-core kernel
cannot run: fp32 activations, or a group size not divisible by 32.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import triton
import triton.language as tl

from pagecast.kernels import activation, reference, w4a16_gemv, w4a16_tcgemv
from pagecast.kernels.tuning import KernelConfig


@triton.jit
def _w4a16_gemm_kernel(
    x_ptr,  # [M, K] activations
    qw_ptr,  # int32 [K / 8, N]
    s_ptr,  # [K / G, N]
    z_ptr,  # int8 [K / G, N]
    perm_ptr,  # int32 [K] or unused
    b_ptr,  # [N] or unused
    y_ptr,  # [M, N] (SPLIT_K == 1) or fp32 partials [SPLIT_K, M, N]
    M,
    N,
    K,
    stride_xm,
    stride_ym,
    stride_ys,  # partials: stride between splits
    GROUP_SIZE: tl.constexpr,
    HAS_PERM: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    K_ITERS: tl.constexpr,  # BLOCK_K steps per split (a constant of the projection's shape)
    DOT_PRECISION: tl.constexpr,
):
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    num_n = tl.cdiv(N, BLOCK_N)
    pid_m = pid // num_n
    pid_n = pid % num_n
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    n_ok = offs_n < N
    # Row j of a K-tile is nibble j % 8 of packed row j // 8.
    shifts = ((tl.arange(0, BLOCK_K) % 8) * 4)[:, None]  # [BLOCK_K, 1]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_begin = pid_k * (K_ITERS * BLOCK_K)
    # The last split may run past K: those steps load nothing (masked) and add zeros.
    for i in range(K_ITERS):
        k0 = k_begin + i * BLOCK_K
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        if HAS_PERM:
            cols = tl.load(perm_ptr + offs_k, mask=k_ok, other=0)
        else:
            cols = offs_k
        x = tl.load(
            x_ptr + offs_m[:, None] * stride_xm + cols[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0
        )
        # Each packed word once: [BLOCK_K / 8, BLOCK_N], then broadcast to its 8 rows.
        offs_kw = k0 // 8 + tl.arange(0, BLOCK_K // 8)
        kw_ok = offs_kw < tl.cdiv(K, 8)
        packed = tl.load(
            qw_ptr + offs_kw[:, None].to(tl.int64) * N + offs_n[None, :],
            mask=kw_ok[:, None] & n_ok[None, :],
            other=0,
        )
        packed = tl.reshape(
            tl.broadcast_to(packed[:, None, :], (BLOCK_K // 8, 8, BLOCK_N)), (BLOCK_K, BLOCK_N)
        )
        q = (packed >> shifts) & 0xF  # [BLOCK_K, BLOCK_N] int32
        if GROUP_SIZE % BLOCK_K == 0:
            # The whole tile lies in one group: one row of scales and zeros.
            g = k0 // GROUP_SIZE
            gn_ok = n_ok & (k0 < K)
            s = tl.load(s_ptr + g * N + offs_n, mask=gn_ok, other=0.0).to(tl.float32)[None, :]
            z = tl.load(z_ptr + g * N + offs_n, mask=gn_ok, other=0).to(tl.int32)[None, :]
        else:
            g_rows = offs_k // GROUP_SIZE
            gn_ok = k_ok[:, None] & n_ok[None, :]
            s = tl.load(s_ptr + g_rows[:, None] * N + offs_n[None, :], mask=gn_ok, other=0.0).to(tl.float32)
            z = tl.load(z_ptr + g_rows[:, None] * N + offs_n[None, :], mask=gn_ok, other=0).to(tl.int32)
        w = ((q - z).to(tl.float32) * s).to(x_ptr.dtype.element_ty)  # [BLOCK_K, BLOCK_N]
        acc = tl.dot(x, w, acc, input_precision=DOT_PRECISION)
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        y_ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])
    else:
        y_ptrs = y_ptr + pid_k * stride_ys + offs_m[:, None] * stride_ym + offs_n[None, :]
        tl.store(y_ptrs, acc, mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _dequantize_kernel(
    qw_ptr,  # int32 [K / 8, N]
    s_ptr,  # [K / G, N]
    z_ptr,  # int8 [K / G, N]
    w_ptr,  # [N, K] out: nn.Linear.weight in the permuted input order
    N,
    K,
    GROUP_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    offs_k = tl.program_id(0) * BLOCK_K + tl.arange(0, BLOCK_K)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = (offs_k < K)[:, None] & (offs_n < N)[None, :]
    packed = tl.load(qw_ptr + (offs_k // 8)[:, None].to(tl.int64) * N + offs_n[None, :], mask=ok, other=0)
    q = (packed >> ((offs_k % 8) * 4)[:, None]) & 0xF
    g = offs_k // GROUP_SIZE
    s = tl.load(s_ptr + g[:, None] * N + offs_n[None, :], mask=ok, other=0.0).to(tl.float32)
    z = tl.load(z_ptr + g[:, None] * N + offs_n[None, :], mask=ok, other=0).to(tl.int32)
    w = ((q - z).to(tl.float32) * s).to(w_ptr.dtype.element_ty)
    tl.store(w_ptr + offs_n[None, :].to(tl.int64) * K + offs_k[:, None], w, mask=ok)


DEQUANT = KernelConfig({"dequant": 1}, num_warps=0, num_stages=0)  # dequantize once, then cuBLAS

_TILES = (
    # (BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages)
    # decode batches: narrow M, split K so there are programs for every multiprocessor
    (16, 64, 128, 1, 4, 4),
    (16, 64, 128, 2, 4, 4),
    (16, 64, 128, 4, 4, 4),
    (16, 128, 128, 4, 4, 3),
    (16, 32, 128, 8, 4, 4),
    (16, 64, 64, 8, 4, 4),
    (16, 128, 64, 2, 4, 4),
    (16, 32, 64, 4, 2, 4),
    # medium batches
    (32, 64, 128, 2, 4, 4),
    (32, 128, 64, 1, 4, 4),
    (64, 64, 128, 1, 4, 4),
    (64, 128, 64, 1, 4, 4),
    (64, 128, 128, 1, 8, 3),
    # prefill-sized: compute-bound tiles
    (128, 128, 64, 1, 8, 4),
    (128, 256, 64, 1, 8, 3),
    (128, 128, 128, 1, 8, 3),
    (64, 256, 64, 1, 8, 4),
)

CONFIG_SPACE: list[KernelConfig] = [DEQUANT] + [
    KernelConfig({"BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": k, "SPLIT_K": sk}, num_warps=w, num_stages=st)
    for (m, n, k, sk, w, st) in _TILES
]


GEMV_MAX_ROWS = 8  # the GEMV re-reads the weight (from L2) and re-unpacks it for every row
TCGEMV_MAX_ROWS = w4a16_tcgemv.MAX_ROWS  # the mma's n16: more rows re-read the weight
# The untuned default up to here: on the H200 it beat every other kernel at 1, 4 and 8 rows, and
# at qkv.m16 took 17.1 us against the tl.dot tile default's 23.7 (benchmarks/RESULTS.md).
TCGEMV_DEFAULT_ROWS = 16


# Shared memory one program may use on an H100/H200 (sm_90: 227 KB; Triton's "Hardware limit").
SHARED_MEMORY_LIMIT = 232448


def shared_memory(config: KernelConfig, x_elt: int, scale_elt: int, group_size: int) -> int:
    """Bytes of shared memory a tl.dot tile of _w4a16_gemm_kernel needs on sm_90, an upper bound:
    the pipeliner stages each K step's loads num_stages - 1 deep (the activations, the packed
    words, and the scales and int8 zeros: one row a step where a step lies in one group, else a
    row per input, as the kernel loads them), once more for the activations where the dot runs
    on wgmma (half types, 64 or more rows: it reads them in place), plus the dequantized weight
    tile the dot reads. Checked against sm_90 compiles (Triton 3.6) of every tile of _TILES in
    fp32 (fp32 scales) and bf16 (fp16 scales) at G 64 and 128: exact where the scales are per
    input, at most 2.3 KB over elsewhere; an act-order perm and few K steps need less
    (tests/test_kernels_compile_sm90.py compiles a few). ``x_elt``/``scale_elt``: element sizes
    of the activations and scales."""
    bm, bn, bk, stages = config["BLOCK_M"], config["BLOCK_N"], config["BLOCK_K"], config.num_stages
    scale_rows = 1 if group_size % bk == 0 else bk
    step = bk // 8 * bn * 4 + scale_rows * bn * (scale_elt + 1)
    buffers = max(stages - 1, 1)
    x_buffers = stages if x_elt <= 2 and bm >= 64 else buffers
    return x_buffers * bm * bk * x_elt + buffers * step + bk * bn * x_elt


def prune_configs(
    configs: list[KernelConfig], m: int, n: int, k: int, num_sms: int = 132, tc: bool = False,
    *, x_elt: int = 2, scale_elt: int = 2, group_size: int = 128,
) -> list[KernelConfig]:  # fmt: skip
    """Keep the dequant path, and tiles whose BLOCK_M fits the rows (no 128-row tile for 4 rows,
    no 16-row tile for prefill), whose BLOCK_K is at most K, whose splits each get K to do, and
    whose shared memory (``shared_memory``: activations of ``x_elt`` bytes, scales of
    ``scale_elt``, groups of ``group_size``; by default half types, fp16 scales, groups of 128)
    fits SHARED_MEMORY_LIMIT: in fp32 several do not.
    Decode rows come first with a decode kernel's candidates (their config spaces are
    shape-dependent): the tensor-core kernel's up to TCGEMV_MAX_ROWS rows where ``tc`` (the
    activations and group size suit it: ``w4a16_tcgemv.supports``), else the CUDA-core GEMV's up to
    GEMV_MAX_ROWS (it lost to the tensor-core kernel at every shape and row count timed)."""
    if tc:
        kept = tcgemv_configs(m, n, k, num_sms) if m <= TCGEMV_MAX_ROWS else []
    else:
        kept = gemv_configs(m, n, k, num_sms) if m <= GEMV_MAX_ROWS else []
    m_tile = max(16, triton.next_power_of_2(m))
    for c in configs:
        if is_dequant(c):
            kept.append(c)
            continue
        bm, bk, sk = c["BLOCK_M"], c["BLOCK_K"], c["SPLIT_K"]
        if bm > m_tile or (m > 256 and bm < 64) or bk > k or sk > 1 and k // (bk * sk) < 2:
            continue
        if shared_memory(c, x_elt, scale_elt, group_size) > SHARED_MEMORY_LIMIT:
            continue
        kept.append(c)
    return kept


# Rows from which the tuner also times PREFETCH 1 (w4a16_tcgemv's docstring). On an H200 (one layer's
# four Llama-3-8B projections, G = 128, bf16; benchmarks/RESULTS.md, eleventh session) the 128 x 2
# tile with it beat the best config without it at gate_up by 7.7% at 4 rows and 7.3% at 8, and at
# qkv, o and down by 1.4-4.7% at 8 rows; at 1 row, where a program holds 2-4 chunks, it lost at
# every projection (56.14 against 62.34 us for the four).
PREFETCH_MIN_ROWS = 4


def tcgemv_configs(m: int, n: int, k: int, num_sms: int = 132) -> list[KernelConfig]:
    """The tensor-core decode kernel's candidates at this shape: its default first, then the tiles
    (BLOCK_N, warps) that won somewhere on the H200 (benchmarks/w4a16_micro.py: 256 columns on 4
    warps at 1 row, 128 on 2 warps at 4-8 rows for the narrow projections, 512 on 4 for gate_up)
    at the smallest power-of-two split giving every multiprocessor a program and twice that,
    the first tile also with its packed loads double-buffered (num_stages 2: o_proj's best at 1
    row), all with the zero points subtracted in the unpacking (SUB_ZEROS: faster at every
    projection and row count timed, w4a16_tcgemv's docstring). From PREFETCH_MIN_ROWS rows the
    128-column tile also with the next chunk prefetched into L2 (PREFETCH 1). The launcher rounds
    a split to a divisor of K's chunks; launches that makes identical are timed once."""
    out = [w4a16_tcgemv.default_config(m, n, k, num_sms)]
    for bn, warps in ((256, 4), (128, 2), (512, 4)):
        tiles = triton.cdiv(n, bn) * triton.cdiv(m, TCGEMV_MAX_ROWS)
        split = 1
        while tiles * split < num_sms and split * 2 <= max(1, k // 128):
            split *= 2
        for s in sorted({split, min(split * 2, max(1, k // 128))}):
            for stages in (1, 2) if (bn, warps) == (256, 4) else (1,):
                out.append(w4a16_tcgemv.make_config(bn, 128, s, warps, stages, sub_zeros=True))
            if (bn, warps) == (128, 2) and m >= PREFETCH_MIN_ROWS:
                out.append(w4a16_tcgemv.make_config(bn, 128, s, warps, 1, sub_zeros=True, prefetch=1))
    return list({tuple(sorted(c.as_dict().items())): c for c in out}.values())


def gemv_configs(m: int, n: int, k: int, num_sms: int = 132) -> list[KernelConfig]:
    """The GEMV's candidates at this shape: each tile of w4a16_gemv.TILES with the smallest
    power-of-two split giving every multiprocessor a program, and twice that; the narrow tiles
    (4 columns a thread) also at 4 and 8 times that, where the H200 timed them fastest at 1 row
    (benchmarks/RESULTS.md: 12-14 programs a multiprocessor for gate_up, 4-6 for the others).
    Splits hold whole outer steps (the launcher rounds them so), hence at most K / OUTER_K."""
    out: list[KernelConfig] = []
    max_split = max(1, k // w4a16_gemv.OUTER_K)
    step_cap = w4a16_gemv.STEP_K[min(triton.next_power_of_2(m), w4a16_gemv.MAX_BLOCK_M)]
    launches = set()  # tiles whose steps the row count caps to the same launch are timed once
    for bn, bk, warps in w4a16_gemv.TILES:
        if bk > k:
            continue
        tiles = triton.cdiv(n, bn) * m
        split = 1
        while tiles * split < num_sms and split * 2 <= max_split:
            split *= 2
        factors = (1, 2, 4, 8) if (bn, bk, warps) in w4a16_gemv.NARROW_TILES else (1, 2)
        for s in sorted({min(split * f, max_split) for f in factors}):
            if (bn, min(bk, step_cap), warps, s) not in launches:
                launches.add((bn, min(bk, step_cap), warps, s))
                out.append(w4a16_gemv.make_config(bn, bk, s, warps))
    return out


def is_dequant(config: KernelConfig | None) -> bool:
    return config is not None and bool(config.params.get("dequant"))


def default_config(
    m: int, n: int, k: int, num_sms: int = 132, tc: bool = False,
    *, x_elt: int = 2, scale_elt: int = 2, group_size: int = 128,
) -> KernelConfig:  # fmt: skip
    """Untuned choice: the dequant path for prefill-sized batches; up to TCGEMV_DEFAULT_ROWS rows
    the tensor-core decode kernel where ``tc`` (``w4a16_tcgemv.supports``), else the GEMV up to 4 rows;
    else a tile with enough splits of K to give about two programs per multiprocessor, pipelined
    4 deep, or less deep where that needs more shared memory than SHARED_MEMORY_LIMIT (fp32
    activations and scales with a group size not a multiple of BLOCK_K: 3 stages from 33 rows;
    half types always fit). ``x_elt``, ``scale_elt``, ``group_size``: as for ``prune_configs``."""
    if m > 256:
        return DEQUANT
    if tc and m <= TCGEMV_DEFAULT_ROWS:
        return w4a16_tcgemv.default_config(m, n, k, num_sms)
    if m <= 4:
        return w4a16_gemv.default_config(m, n, k, num_sms)
    bm = 16 if m <= 16 else (32 if m <= 32 else 64)
    bn, bk = 64, 128 if k >= 256 else 64
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    split = 1
    while split < 8 and tiles * split < 2 * num_sms and k // (bk * split * 2) >= 2:
        split *= 2
    params = {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": split}
    cfg = KernelConfig(params, num_warps=4, num_stages=4)
    while cfg.num_stages > 1 and shared_memory(cfg, x_elt, scale_elt, group_size) > SHARED_MEMORY_LIMIT:
        cfg = KernelConfig(cfg.params, cfg.num_warps, cfg.num_stages - 1)
    return cfg


def dequantize(
    qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int, dtype: torch.dtype
) -> torch.Tensor:
    """The weight as nn.Linear.weight [N, K] in ``dtype`` (permuted input order), one kernel."""
    k, n = qweight.shape[0] * 8, qweight.shape[1]
    w = torch.empty((n, k), dtype=dtype, device=qweight.device)
    block_n, block_k = 64, 64
    _dequantize_kernel[(triton.cdiv(k, block_k), triton.cdiv(n, block_n))](
        qweight, scales, zeros, w, n, k, GROUP_SIZE=group_size, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4
    )
    return w


def check_shapes(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, perm: torch.Tensor | None,
    group_size: int, bias: torch.Tensor | None,
) -> None:  # fmt: skip
    k = qweight.shape[0] * 8
    n = qweight.shape[1]
    if qweight.dtype != torch.int32 or (perm is None and x.shape[1] != k):
        raise ValueError(
            f"qweight must be int32 [K/8={x.shape[1] // 8}, N] (K = x's columns without a perm), got "
            f"{qweight.dtype} {tuple(qweight.shape)}"
        )
    if (
        k % group_size
        or tuple(scales.shape) != (k // group_size, n)
        or tuple(zeros.shape) != (k // group_size, n)
    ):
        raise ValueError(
            f"scales/zeros must be [K/G={k // group_size}, N={n}], got {tuple(scales.shape)} / {tuple(zeros.shape)}"
        )
    if zeros.dtype != torch.int8:
        raise ValueError(f"zeros must be int8, got {zeros.dtype}")
    if perm is not None and tuple(perm.shape) != (k,):
        raise ValueError(f"perm must be [K={k}], got {tuple(perm.shape)}")
    if bias is not None and tuple(bias.shape) != (n,):
        raise ValueError(f"bias must be [N={n}], got {tuple(bias.shape)}")
    for t in (qweight, scales, zeros):
        if not t.is_contiguous():
            raise ValueError("qweight, scales and zeros must be contiguous")


def _config_or_default(
    config: Mapping[str, int] | KernelConfig | None, x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
    group_size: int,
) -> KernelConfig:  # fmt: skip
    """``config``, or default_config for x's rows and this weight when there is none."""
    return KernelConfig.coerce(config) or default_config(
        x.shape[0], qweight.shape[1], qweight.shape[0] * 8,
        tc=x.is_cuda and w4a16_tcgemv.supports(x.dtype, group_size),
        x_elt=x.element_size(), scale_elt=scales.element_size(), group_size=group_size,
    )  # fmt: skip


def w4a16_gemm(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    perm: torch.Tensor | None,
    group_size: int,
    bias: torch.Tensor | None = None,
    config: Mapping[str, int] | KernelConfig | None = None,
) -> torch.Tensor:
    """x [M, K] @ dequant(W).T (+ bias [N]) -> [M, N] in x's dtype, fp32 accumulation (with a
    perm, x [M, any width]: input k reads column perm[k]).

    ``config`` None picks ``default_config``; ``{"dequant": 1}`` dequantizes and calls cuBLAS.
    Capture-safe (no host syncs): split-K's partial buffer is allocated per call and reduced
    with one torch sum."""
    m, k = x.shape[0], qweight.shape[0] * 8
    n = qweight.shape[1]
    check_shapes(x, qweight, scales, zeros, perm, group_size, bias)
    if x.stride(1) != 1:
        x = x.contiguous()
    cfg = _config_or_default(config, x, qweight, scales, group_size)
    if w4a16_tcgemv.is_tcgemv(cfg):
        return w4a16_tcgemv.w4a16_tcgemv(x, qweight, scales, zeros, perm, group_size, bias, cfg)
    if w4a16_gemv.is_gemv(cfg):
        return w4a16_gemv.w4a16_gemv(x, qweight, scales, zeros, perm, group_size, bias, cfg)
    if is_dequant(cfg):
        if perm is not None:
            x = x.index_select(1, perm)
        return reference.linear(x, dequantize(qweight, scales, zeros, group_size, x.dtype), bias)
    bm, bn, bk, split = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"], cfg["SPLIT_K"]
    k_per_split = triton.cdiv(triton.cdiv(k, split), bk) * bk
    split = triton.cdiv(k, k_per_split)  # no empty split
    if split == 1:
        y = torch.empty((m, n), dtype=x.dtype, device=x.device)
        stride_ys = 0
    else:
        y = torch.empty((split, m, n), dtype=torch.float32, device=x.device)
        stride_ys = y.stride(0)
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn), split)
    _w4a16_gemm_kernel[grid](
        x, qweight, scales, zeros, perm if perm is not None else qweight, bias if bias is not None else scales, y,
        m, n, k, x.stride(0), n, stride_ys,
        GROUP_SIZE=group_size, HAS_PERM=perm is not None, HAS_BIAS=bias is not None and split == 1,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split, K_ITERS=k_per_split // bk,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    if split == 1:
        return y
    out = y.sum(0)
    if bias is not None:
        out += bias.float()
    return out.to(x.dtype)


def w4a16_silu_and_mul_gemm(
    gate_up: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    perm: torch.Tensor | None,
    group_size: int,
    bias: torch.Tensor | None = None,
    config: Mapping[str, int] | KernelConfig | None = None,
) -> torch.Tensor:
    """w4a16_gemm(silu(gate) * up, ...) for gate_up [M, 2D] ([gate | up] per row, the gate_up
    projection's output): one launch of the tensor-core decode kernel, which computes the
    activation as it loads x, where the config is one of its SUB_ZEROS configs
    (``w4a16_tcgemv.fuses_silu_and_mul``); else kernels/activation.py's kernel, then w4a16_gemm.
    The same values either way (the activation is rounded to x's dtype as activation.py does)."""
    d = gate_up.shape[1] // 2
    cfg = _config_or_default(config, gate_up, qweight, scales, group_size)
    if not (w4a16_tcgemv.fuses_silu_and_mul(cfg) and gate_up.shape[1] % 2 == 0 and gate_up.stride(1) == 1):
        return w4a16_gemm(activation.silu_and_mul(gate_up), qweight, scales, zeros, perm, group_size, bias, cfg)
    check_shapes(gate_up[:, :d], qweight, scales, zeros, perm, group_size, bias)
    return w4a16_tcgemv.w4a16_tcgemv(gate_up, qweight, scales, zeros, perm, group_size, bias, cfg, silu_and_mul=True)
