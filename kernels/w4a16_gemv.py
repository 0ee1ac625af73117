"""W4A16 GEMV: y = x @ dequant(W).T (+ b) for decode batches of a few rows, at the weight's
read bandwidth.

Where it runs: since the tensor-core decode kernel (kernels/w4a16_tcgemv.py) beat it at every
Llama-3-8B projection and row count timed on an H200, kernels/w4a16_gemm.py uses this GEMV only
where that kernel cannot run: fp32 activations, or a group size not divisible by 32.

Same weight layout as kernels/w4a16_gemm.py (qweight int32 [K / 8, N], nibble i of row r is
input 8r + i; scales [K / G, N]; int8 zeros [K / G, N]; optional act-order perm [K]).

At 1..8 rows a projection is a matrix-vector product: the time is the int4 weight read once,
K * N / 2 bytes, as long as the per-weight arithmetic keeps up with memory. An H200 streams
~8e12 int4 weights a second, about 33 a clock per multiprocessor, and a multiprocessor issues
128 lane-instructions a clock: the budget is under 4 instructions per weight. The tl.dot
kernel (kernels/w4a16_gemm.py) spends ~11 at 16 rows (sm_90 SASS of its loop: shifts, masks, int-to-float and
float-to-bf16 conversions at quarter rate, and a shared-memory round trip to reach the
tensor-core operand layout). This kernel uses no tl.dot and no conversion per weight (~3.6
instructions a weight in its loop at 1 row):

- A nibble is moved to bits 12..15 or 16..19 (four shifts a packed word) and or-ed into the
  bits of 1.0f with its mask (one lop3): as a float that is v = 1 + q / 2048 or 1 + q / 128,
  exact. Activations of the first kind are scaled by 16 once, for every column they meet.
- One or two rows: one FMA per weight and row, t += x' * v. Over a group, sum x * (q - z) =
  128 * (t - 15 xl - xs * (1 + z / 128)) with xs the sum of x and xl that of the 16-scaled x,
  so zero point and scale cost two FMAs per packed word, not per weight. fp32 throughout;
  t stays near the sum of x', so the cancellation costs ~11 of fp32's 24 bits (relative
  error ~1e-5), far below the half-type output's rounding. From DEQUANT_ROWS rows each weight
  is dequantized once instead (one exact FFMA) and every row takes one FFMA.
- A program computes up to BLOCK_M (8) rows: each packed word is unpacked once and multiplied
  into every row as an outer product into a [BLOCK_M, BLOCK_N] fp32 accumulator, so the loop
  has no cross-thread reduction; a thread holds 4 or 8 columns (the tile's), over which each
  activation load, conversion and sum is shared. Row blocks are a grid axis, varying fastest
  (the programs of one weight tile run together and row blocks after the first read it from L2).

Measured on an H200 at 1 row (benchmarks/RESULTS.md) it streams 0.75-2.1 TB/s of int4 weight
against ~4.2 of copy bandwidth: the small projections are latency-bound, and at ~3.6
instructions a weight the loop is near the issue limit for full bandwidth.

A decode projection has too few columns to give every multiprocessor a program (Llama-3-8B's
o_proj: 4096 columns), so SPLIT_K programs share a column tile, each over a slice of K. The
split-K reduction stays inside this kernel: each program writes its fp32 partial tile, then
takes a ticket from the tile's counter (atomic, acq_rel at GPU scope, after a CTA barrier so
every thread's partial is ordered before it); the program that draws the last ticket adds the
partials up in split order (deterministic, whichever program finishes last), adds the bias,
writes y and resets the counter for the next launch. One launch per projection, no memset, no
second kernel: at batch 1 o_proj's int4 weight is ~2.4 us of reading at ~3.5 TB/s, the order
of what one more dependent launch costs (an estimate, not measured here).

The counters live in a per-device int32 buffer that every launch leaves at zero. Two launches
on different streams of one device must not overlap (the engine runs one stream a device).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from pagecast.kernels import split_k
from pagecast.kernels.tuning import KernelConfig

# Nibbles 0, 2, 3 and 5 land at bits 12..15 ("low": v = 1 + q / 2048, their activations are
# scaled by 16 to match), 1, 4, 6 and 7 at bits 16..19 ("high": v = 1 + q / 128). Four shifts
# place all eight (packed << 12 holds nibbles 0 and 1, packed itself 3 and 4, packed >> 8 holds
# 5 and 6), where one position for all would take seven. Bit i of LOW_NIBBLES marks nibble i low.
LOW_NIBBLES = tl.constexpr(0b00101101)


@triton.jit
def _nibbles_as_floats(packed, USE_ASM: tl.constexpr):
    """The 8 nibbles of each int32 as floats: 1 + q / 2048 for the low nibbles (q at bits 12..15
    of the bits of 1.0f), 1 + q / 128 for the high ones (bits 16..19); exact.

    On the GPU four shifts and eight lop3s ((a & b) | c) a word, in inline PTX: from the plain
    expression ptxas emits two lop3s a nibble (it does not fold two immediates into one). The
    interpreter runs the plain expression, which computes the same bits."""
    if USE_ASM:
        return tl.inline_asm_elementwise(
            asm="""
            {
            .reg .b32 t;
            shl.b32 t, $8, 12;
            lop3.b32 $0, t, 0x0000F000, 0x3F800000, 0xEA;
            lop3.b32 $1, t, 0x000F0000, 0x3F800000, 0xEA;
            shl.b32 t, $8, 4;
            lop3.b32 $2, t, 0x0000F000, 0x3F800000, 0xEA;
            lop3.b32 $3, $8, 0x0000F000, 0x3F800000, 0xEA;
            lop3.b32 $4, $8, 0x000F0000, 0x3F800000, 0xEA;
            shr.u32 t, $8, 8;
            lop3.b32 $5, t, 0x0000F000, 0x3F800000, 0xEA;
            lop3.b32 $6, t, 0x000F0000, 0x3F800000, 0xEA;
            shr.u32 t, $8, 12;
            lop3.b32 $7, t, 0x000F0000, 0x3F800000, 0xEA;
            }
            """,
            constraints="=r,=r,=r,=r,=r,=r,=r,=r,r",
            args=[packed],
            dtype=(tl.float32,) * 8,
            is_pure=True,
            pack=1,
        )
    a = packed << 12
    c = packed >> 8  # arithmetic: the sign bits land above the masks
    v0 = ((a & 0x0000F000) | 0x3F800000).to(tl.float32, bitcast=True)
    v1 = ((a & 0x000F0000) | 0x3F800000).to(tl.float32, bitcast=True)
    v2 = (((packed << 4) & 0x0000F000) | 0x3F800000).to(tl.float32, bitcast=True)
    v3 = ((packed & 0x0000F000) | 0x3F800000).to(tl.float32, bitcast=True)
    v4 = ((packed & 0x000F0000) | 0x3F800000).to(tl.float32, bitcast=True)
    v5 = ((c & 0x0000F000) | 0x3F800000).to(tl.float32, bitcast=True)
    v6 = ((c & 0x000F0000) | 0x3F800000).to(tl.float32, bitcast=True)
    v7 = (((packed >> 12) & 0x000F0000) | 0x3F800000).to(tl.float32, bitcast=True)
    return v0, v1, v2, v3, v4, v5, v6, v7


@triton.jit
def _packed_row(qw_cols, row, N, ok, USE_ASM: tl.constexpr):
    """Packed row ``row`` of the program's columns ([1, BLOCK_N] int32, masked by ``ok``) as
    its 8 nibbles' floats (_nibbles_as_floats)."""
    packed = tl.load(qw_cols + row * N, mask=ok, other=0)
    return _nibbles_as_floats(packed, USE_ASM)


@triton.jit
def _load_x(x_ptr, offs_m, m_ok, stride_xm, perm_ptr, k, k_ok, HAS_PERM: tl.constexpr):
    """Activation k (a scalar input index) of the program's rows [BLOCK_M], in fp32 (with a
    perm, its entry is loaded once for every row)."""
    if HAS_PERM:
        k = tl.load(perm_ptr + k, mask=k_ok, other=0)
    return tl.load(x_ptr + offs_m * stride_xm + k, mask=m_ok & k_ok, other=0.0).to(tl.float32)


@triton.jit
def _finish(
    out, offs_m, offs_n, m_ok, n_ok, y_ptr, stride_ym, b_ptr, part_ptr, lock_ptr, pid_m, pid_n, pid_k, M, N,
    HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr,
):  # fmt: skip
    """Writes a program's fp32 tile ``out`` [BLOCK_M, BLOCK_N] (rows offs_m, columns offs_n) to y,
    adding the bias; with SPLIT_K > 1 through the partials and the tile's ticket (the module
    docstring). Shared with kernels/w4a16_tcgemv.py."""
    mn_ok = m_ok[:, None] & n_ok[None, :]
    y_ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
    if SPLIT_K == 1:
        if HAS_BIAS:
            out += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptrs, out.to(y_ptr.dtype.element_ty), mask=mn_ok)
    else:
        part = part_ptr + offs_m[:, None] * N + offs_n[None, :]
        split_stride = M * N
        tl.store(part + pid_k * split_stride, out, mask=mn_ok)
        tl.debug_barrier()  # every thread's partial is written before the ticket is taken
        lock = lock_ptr + pid_m * tl.num_programs(1) + pid_n
        ticket = tl.atomic_add(lock, 1, sem="acq_rel", scope="gpu")
        if ticket == SPLIT_K - 1:  # the last program of this tile: add the partials in split order
            total = tl.zeros_like(out)
            for sk in range(SPLIT_K):
                total += tl.load(part + sk * split_stride, mask=mn_ok, other=0.0, cache_modifier=".cg")
            if HAS_BIAS:
                total += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
            tl.store(y_ptrs, total.to(y_ptr.dtype.element_ty), mask=mn_ok)
            tl.atomic_xchg(lock, 0)  # ready for the next launch


@triton.jit
def _w4a16_gemv_kernel(
    x_ptr,  # [M, K] activations
    qw_ptr,  # int32 [K / 8, N]
    s_ptr,  # [K / G, N]
    z_ptr,  # int8 [K / G, N]
    perm_ptr,  # int32 [K] or unused
    b_ptr,  # [N] or unused
    y_ptr,  # [M, N]
    part_ptr,  # fp32 [SPLIT_K, M, N] partial sums (SPLIT_K > 1) or unused
    lock_ptr,  # int32 [row blocks * column tiles] tickets, zero between launches (SPLIT_K > 1)
    M,
    N,
    K,
    stride_xm,
    stride_ym,
    GROUP_SIZE: tl.constexpr,
    HAS_PERM: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,  # rows a program computes: each weight is unpacked once for all
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # inputs a K step reads; divides GROUP_SIZE (the launcher sees to it)
    SPLIT_K: tl.constexpr,
    K_ITERS: tl.constexpr,  # BLOCK_K steps per split
    DEQUANT_FIRST: tl.constexpr,  # dequantize each weight once (worth it from DEQUANT_ROWS rows)
    USE_ASM: tl.constexpr,
):
    # Row blocks vary fastest: the programs of one weight tile run back to back, so row blocks
    # after the first (more than BLOCK_M rows) read the tile from L2.
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    P: tl.constexpr = BLOCK_K // 8  # packed rows a step reads
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    n_ok = offs_n < N
    k_rows = K // 8
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_begin = pid_k * (K_ITERS * BLOCK_K)
    # [1, BLOCK_N]: a 2-D load's layout (4 adjacent columns a thread, the warps along N) is the
    # one every [BLOCK_M, BLOCK_N] tensor below takes, rows held within each thread; a 1-D
    # load broadcast over the rows made Triton move every weight through shared memory.
    # A packed row's offset is added as a scalar.
    qw_cols = qw_ptr + offs_n[None, :]
    ld_ok = n_ok[None, :]
    for it in range(K_ITERS):
        k0 = k_begin + it * BLOCK_K
        # t = sum over the step of x' * v, x' = 16 x for the low nibbles: [BLOCK_M, BLOCK_N].
        # Packed row by packed row (a [BLOCK_N] load each, all issued before the arithmetic:
        # nothing depends on them), each nibble is unpacked once and multiplied into every
        # row: an outer product, one FFMA per weight and row, no reduction (a [rows, P, N]
        # product summed over P made Triton convert layouts through shared memory).
        g = k0 // GROUP_SIZE  # the step lies in one group: one row of scales and zeros
        gn_ok = ld_ok & (k0 < K)
        s = tl.load(s_ptr + g * N + offs_n[None, :], mask=gn_ok, other=0.0).to(tl.float32)
        z = tl.load(z_ptr + g * N + offs_n[None, :], mask=gn_ok, other=0).to(tl.float32)
        if DEQUANT_FIRST:
            # Rows enough to share it: each weight becomes (q - z) * s once, one FFMA from its
            # float v: v * (2048 s) - (2048 + z) s for a low nibble (v = 1 + q / 2048), the same
            # with 128 for a high one. Exact for 16-bit scales: (2048 + z) s has at most
            # 12 + 11 bits and (q - z) s is representable, so the one rounding returns it (for
            # fp32 scales, v * 2048 - (2048 + z) is exact and one FMUL by s rounds once, as the
            # reference does). Then one FFMA per weight and row into acc: no per-row sums.
            if s_ptr.dtype.element_ty == tl.float32:
                c_lo, d_lo, c_hi, d_hi = 2048.0, -(z + 2048.0), 128.0, -(z + 128.0)
            else:
                c_lo, d_lo, c_hi, d_hi = s * 2048.0, -(z + 2048.0) * s, s * 128.0, -(z + 128.0) * s
            for p in tl.static_range(P):
                row = k0 // 8 + p
                r_ok = row < k_rows
                v = _packed_row(qw_cols, row, N, ld_ok & r_ok, USE_ASM)
                for i in tl.static_range(8):
                    xi = _load_x(x_ptr, offs_m, m_ok, stride_xm, perm_ptr, row * 8 + i, r_ok, HAS_PERM)
                    if (LOW_NIBBLES >> i) & 1:
                        w = v[i] * c_lo + d_lo
                    else:
                        w = v[i] * c_hi + d_hi
                    if s_ptr.dtype.element_ty == tl.float32:
                        w = w * s
                    acc += xi[:, None] * w
        else:
            # One row or two: the per-group algebra below, no per-weight dequantization.
            t = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            xs = tl.zeros((BLOCK_M,), dtype=tl.float32)
            xl = tl.zeros((BLOCK_M,), dtype=tl.float32)
            for p in tl.static_range(P):
                row = k0 // 8 + p
                r_ok = row < k_rows
                v = _packed_row(qw_cols, row, N, ld_ok & r_ok, USE_ASM)
                for i in tl.static_range(8):
                    xi = _load_x(x_ptr, offs_m, m_ok, stride_xm, perm_ptr, row * 8 + i, r_ok, HAS_PERM)
                    xs += xi
                    if (LOW_NIBBLES >> i) & 1:
                        xl += xi
                        xi = xi * 16.0
                    t += xi[:, None] * v[i]
            # t = sum x' + sum x * q / 128 and sum x' = xs + 15 xl, so
            # sum x * (q - z) = 128 * (t - 15 xl - xs * (1 + z / 128)); times the scale.
            acc += (s * 128.0) * ((t - (xl * 15.0)[:, None]) - xs[:, None] * (z * (1.0 / 128.0) + 1.0))
    _finish(
        acc, offs_m, offs_n, m_ok, n_ok, y_ptr, stride_ym, b_ptr, part_ptr, lock_ptr, pid_m, pid_n, pid_k, M, N,
        HAS_BIAS, SPLIT_K,
    )  # fmt: skip


# (BLOCK_N, BLOCK_K, num_warps). Triton gives each thread 4 adjacent columns per 128 a warp
# covers: BLOCK_N / (32 * num_warps) columns a thread, over which one activation load, conversion
# and sum are shared. The first three tiles hold 8 a thread; the last two 4, which measured
# faster at 1 row on an H200 (qkv 12.6 against 19.9 us at the same split, gate_up 28.8 against
# 30.6 at the best splits of each; benchmarks/RESULTS.md). BLOCK_K caps the inputs a K step reads
# (launch_shape). w4a16_gemm.gemv_configs adds the splits of K: NARROW_TILES get more of them.
TILES = (
    (512, 64, 2),
    (1024, 64, 4),
    (512, 32, 2),
    (256, 64, 2),
    (512, 64, 4),
)
NARROW_TILES = frozenset({(256, 64, 2), (512, 64, 4)})
# A K step loads at most STEP_K[rows a program] inputs, prefetched one step ahead: 2 x 8 words
# a thread per 8 inputs, plus [rows, 8] fp32 sums a thread; more spills registers (counted by
# benchmarks/w4a16_ptx.py).
STEP_K = {1: 64, 2: 64, 4: 32, 8: 32}
OUTER_K = 64  # the widest step (w4a16_gemm.gemv_configs: splits hold whole steps)
MAX_BLOCK_M = 8
# From this many rows a program, each weight is dequantized once (one FFMA, exact) and every row
# takes one FFMA: below, the per-group algebra (no dequantization, but three per-row sums of
# the activations a thread, shared over only its 8 columns) spends fewer (w4a16_ptx.py).
DEQUANT_ROWS = 4


def make_config(
    block_n: int, block_k: int, split_k: int, num_warps: int = 4, block_m: int = MAX_BLOCK_M
) -> KernelConfig:
    """``block_m``: the most rows a program computes (the launcher uses the next power of two
    of the batch's rows, up to this); 1 gives one program a row (the original kernel)."""
    return KernelConfig(
        {"gemv": 1, "BLOCK_N": block_n, "BLOCK_K": block_k, "SPLIT_K": split_k, "BLOCK_M": block_m},
        num_warps=num_warps,
        num_stages=1,
    )


def is_gemv(config: KernelConfig | None) -> bool:
    return config is not None and bool(config.params.get("gemv"))


def default_config(m: int, n: int, k: int, num_sms: int = 132) -> KernelConfig:
    """Untuned choice: 512 columns by up to 64 inputs a step on two warps, and enough splits of K for
    about two programs a multiprocessor (counted per row, as w4a16_gemm.gemv_configs counts:
    the launcher turns a row block's saved programs into splits)."""
    bn, bk = 512, 64  # BLOCK_K caps the step now (launch_shape): 64, the widest
    tiles = triton.cdiv(n, bn) * m
    split = 1
    while tiles * split < 2 * num_sms and split * 2 <= k // OUTER_K:
        split *= 2
    return make_config(bn, bk, split, 2)


def launch_shape(m: int, k: int, group_size: int, config: KernelConfig) -> tuple[int, int, int, int]:
    """(rows a program, inputs a step, splits, steps a split) of a launch.

    The split in a config counts programs as one a row (w4a16_gemm.gemv_configs sizes it so:
    rows x column tiles x splits fill the GPU); a program of BLOCK_M rows replaces BLOCK_M of
    them, so the split is multiplied by the rows a row block holds, keeping the program count.
    The step is the widest power of two that divides the group and is at most BLOCK_K and
    STEP_K[rows]: it lies in one group (one row of scales and zeros) and divides K."""
    bm = min(triton.next_power_of_2(m), config.params.get("BLOCK_M", 1), MAX_BLOCK_M)
    cap = min(config["BLOCK_K"], STEP_K[bm])
    step = 8
    while group_size % (step * 2) == 0 and step * 2 <= cap:
        step *= 2
    blocks = triton.cdiv(m, bm)
    split = config["SPLIT_K"] * m // blocks
    split = max(1, min(split, k // step))
    k_per_split = triton.cdiv(triton.cdiv(k, split), step) * step
    split = triton.cdiv(k, k_per_split)  # no empty split
    return bm, step, split, k_per_split // step


def split_k_buffers(
    x: torch.Tensor, n: int, split: int, tiles: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y [M, N] in x's dtype, the fp32 partials [split, M, N], the tiles' ticket counters) of a
    launch that reduces with _finish; without a split the last two are y (unused)."""
    m = x.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if split == 1:
        return y, y, y
    partials = torch.empty((split, m, n), dtype=torch.float32, device=x.device)
    return y, partials, split_k.counters(x.device, tiles, "w4a16_gemv")


def w4a16_gemv(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    perm: torch.Tensor | None,
    group_size: int,
    bias: torch.Tensor | None,
    config: KernelConfig,
) -> torch.Tensor:
    """x [M, K] (contiguous rows) @ dequant(W).T (+ bias) -> [M, N] in x's dtype, one launch.

    Shapes are checked by the caller (w4a16_gemm.w4a16_gemm). Capture-safe once the same batch
    ran eagerly (the counters are allocated then); partials are allocated per call."""
    m, k = x.shape[0], qweight.shape[0] * 8  # with a perm x may be narrower than K (w4a16_gemm)
    n = qweight.shape[1]
    if group_size % 8:
        raise ValueError(f"the W4A16 GEMV needs a group size divisible by 8, got {group_size}")
    bm, step, split, k_iters = launch_shape(m, k, group_size, config)
    bn = config["BLOCK_N"]
    tiles_n = triton.cdiv(n, bn)
    blocks_m = triton.cdiv(m, bm)
    y, partials, locks = split_k_buffers(x, n, split, tiles_n * blocks_m)
    _w4a16_gemv_kernel[(blocks_m, tiles_n, split)](
        x, qweight, scales, zeros, perm if perm is not None else qweight, bias if bias is not None else scales,
        y, partials, locks, m, n, k, x.stride(0), y.stride(0),
        GROUP_SIZE=group_size, HAS_PERM=perm is not None, HAS_BIAS=bias is not None,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=step, SPLIT_K=split, K_ITERS=k_iters, DEQUANT_FIRST=bm >= DEQUANT_ROWS,
        USE_ASM=x.is_cuda and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"),
        num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip
    return y
