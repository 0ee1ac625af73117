"""W4A16 GEMV: y = x @ dequant(W).T (+ b) for decode batches of a few rows, at the weight's
read bandwidth.

Same weight layout as kernels/w4a16_gemm.py (qweight int32 [K / 8, N], nibble i of row r is
input 8r + i; scales [K / G, N]; int8 zeros [K / G, N]; optional act-order perm [K]).

At 1..8 rows a projection is a matrix-vector product: the time is the int4 weight read once,
K * N / 2 bytes, as long as the per-weight arithmetic keeps up with memory. An H200 streams
~8e12 int4 weights a second, about 33 a clock per multiprocessor, and a multiprocessor issues
128 lane-instructions a clock: the budget is under 4 instructions per weight. The tensor-core
kernel spends more than that unpacking (shift, mask, subtract, int-to-float and float-to-bf16
conversions, whose units run at a quarter rate) and pads one row to 16. This kernel uses no
tl.dot and no conversion instruction per weight:

- A nibble is moved to bits 16..19 (one shift, none for nibble 4) and or-ed into the bits of
  1.0f (one lop3 with the mask): as a float that is v = 1 + q / 128, exact.
- One FMA per weight and row: T += x * v. Over the 8 inputs of a packed word,
  sum x * (q - z) = 128 * (T - xs * (1 + z / 128)) with xs = sum x, so zero point and scale
  cost two FMAs per packed word (8 weights), not per weight. fp32 throughout; T stays near xs,
  so the cancellation costs ~7 of fp32's 24 bits, far below the half-type output's rounding.
- Each thread keeps its own rows of K in a [BLOCK_M, BLOCK_K / 8, BLOCK_N] accumulator and the
  rows are summed once at the end, so the loop has no cross-thread reduction.

A decode projection has too few columns to give every multiprocessor a program (Llama-3-8B's
o_proj: 4096 columns), so SPLIT_K programs share a column tile, each over a slice of K. The
split-K reduction stays inside this kernel: each program writes its fp32 partial tile, then
takes a ticket from the tile's counter (atomic, acq_rel at GPU scope, after a CTA barrier so
every thread's partial is ordered before it); the program that draws the last ticket adds the
partials up in split order (deterministic, whichever program finishes last), adds the bias,
writes y and resets the counter for the next launch. One launch per projection, no memset, no
second kernel: at batch 1 a separate reduction and cast cost more than o_proj's weight read.

The counters live in a per-device int32 buffer that every launch leaves at zero. Two launches
on different streams of one device must not overlap (the engine runs one stream a device).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagecast.kernels.tuning import KernelConfig


@triton.jit
def _nibbles_as_floats(packed, USE_ASM: tl.constexpr):
    """The 8 nibbles of each int32 as floats 1 + q / 128 (q at bits 16..19 under the bits of 1.0f).

    On the GPU one shift and one lop3 ((a & b) | c) a nibble, in inline PTX: from the plain
    expression ptxas emits two lop3s (it does not fold two immediates into one). The interpreter
    runs the plain expression, which computes the same bits."""
    if USE_ASM:
        return tl.inline_asm_elementwise(
            asm="""
            {
            .reg .b32 t;
            shl.b32 t, $8, 16;
            lop3.b32 $0, t, 0x000F0000, 0x3F800000, 0xEA;
            shl.b32 t, $8, 12;
            lop3.b32 $1, t, 0x000F0000, 0x3F800000, 0xEA;
            shl.b32 t, $8, 8;
            lop3.b32 $2, t, 0x000F0000, 0x3F800000, 0xEA;
            shl.b32 t, $8, 4;
            lop3.b32 $3, t, 0x000F0000, 0x3F800000, 0xEA;
            lop3.b32 $4, $8, 0x000F0000, 0x3F800000, 0xEA;
            shr.u32 t, $8, 4;
            lop3.b32 $5, t, 0x000F0000, 0x3F800000, 0xEA;
            shr.u32 t, $8, 8;
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
    v0 = (((packed << 16) & 0x000F0000) | 0x3F800000).to(tl.float32, bitcast=True)
    v1 = (((packed << 12) & 0x000F0000) | 0x3F800000).to(tl.float32, bitcast=True)
    v2 = (((packed << 8) & 0x000F0000) | 0x3F800000).to(tl.float32, bitcast=True)
    v3 = (((packed << 4) & 0x000F0000) | 0x3F800000).to(tl.float32, bitcast=True)
    v4 = ((packed & 0x000F0000) | 0x3F800000).to(tl.float32, bitcast=True)
    v5 = (((packed >> 4) & 0x000F0000) | 0x3F800000).to(tl.float32, bitcast=True)
    v6 = (((packed >> 8) & 0x000F0000) | 0x3F800000).to(tl.float32, bitcast=True)
    v7 = (((packed >> 12) & 0x000F0000) | 0x3F800000).to(tl.float32, bitcast=True)
    return v0, v1, v2, v3, v4, v5, v6, v7


@triton.jit
def _dot8(x_row, perm_ptr, rows, r_ok, packed, t, xs, HAS_PERM: tl.constexpr, USE_ASM: tl.constexpr):
    """t += sum over a packed word's 8 inputs of x * (1 + q / 128); xs += sum of those x."""
    v = _nibbles_as_floats(packed, USE_ASM)
    for i in tl.static_range(8):
        ks = rows * 8 + i  # [ROWS] input index of nibble i
        if HAS_PERM:
            ks = tl.load(perm_ptr + ks, mask=r_ok, other=0)
        xi = tl.load(x_row + ks, mask=r_ok, other=0.0).to(tl.float32)  # [ROWS]
        xs += xi
        t += xi[:, None] * v[i]
    return t, xs


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
    lock_ptr,  # int32 [M * column tiles] tickets, zero between launches (SPLIT_K > 1)
    M,
    N,
    K,
    stride_xm,
    stride_ym,
    GROUP_SIZE: tl.constexpr,
    HAS_PERM: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    INNER: tl.constexpr,  # BLOCK_K steps per scale/zero application (all inside one group when > 1)
    SPLIT_K: tl.constexpr,
    K_ITERS: tl.constexpr,  # INNER * BLOCK_K blocks per split
    USE_ASM: tl.constexpr,
):
    # Rows vary fastest: the programs of one weight tile for every row run back to back, so
    # rows after the first read the tile from L2.
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    ROWS: tl.constexpr = BLOCK_K // 8  # packed rows a step reads
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_r = tl.arange(0, ROWS)
    n_ok = offs_n < N
    k_rows = K // 8
    x_row = x_ptr + pid_m * stride_xm
    acc = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
    k_begin = pid_k * (K_ITERS * INNER * BLOCK_K)
    for it in range(K_ITERS):
        k0 = k_begin + it * (INNER * BLOCK_K)
        t = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
        xs = tl.zeros((ROWS,), dtype=tl.float32)
        for j in tl.static_range(INNER):
            rows = (k0 + j * BLOCK_K) // 8 + offs_r  # [ROWS]
            r_ok = rows < k_rows
            packed = tl.load(
                qw_ptr + rows[:, None].to(tl.int64) * N + offs_n[None, :],
                mask=r_ok[:, None] & n_ok[None, :],
                other=0,
            )  # [ROWS, BLOCK_N] int32
            t, xs = _dot8(x_row, perm_ptr, rows, r_ok, packed, t, xs, HAS_PERM, USE_ASM)
        # sum x * (q - z) = 128 * (t - xs * (1 + z / 128)), times the scale
        if GROUP_SIZE % BLOCK_K == 0:  # the block lies in one group: one row of scales and zeros
            g = k0 // GROUP_SIZE
            gn_ok = n_ok & (k0 < K)
            s = tl.load(s_ptr + g * N + offs_n, mask=gn_ok, other=0.0).to(tl.float32)[None, :]
            z = tl.load(z_ptr + g * N + offs_n, mask=gn_ok, other=0).to(tl.float32)[None, :]
        else:  # a packed row's 8 inputs share a group (G % 8 == 0); rows may not (INNER == 1)
            rows = k0 // 8 + offs_r
            r_ok = rows < k_rows
            g_rows = (rows * 8) // GROUP_SIZE
            gn_ok = r_ok[:, None] & n_ok[None, :]
            s = tl.load(s_ptr + g_rows[:, None] * N + offs_n[None, :], mask=gn_ok, other=0.0).to(tl.float32)
            z = tl.load(z_ptr + g_rows[:, None] * N + offs_n[None, :], mask=gn_ok, other=0).to(tl.float32)
        acc += (s * 128.0) * (t - xs[:, None] * (z * (1.0 / 128.0) + 1.0))
    out = tl.sum(acc, axis=0)  # [BLOCK_N]
    y_ptrs = y_ptr + pid_m * stride_ym + offs_n
    if SPLIT_K == 1:
        if HAS_BIAS:
            out += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)
        tl.store(y_ptrs, out.to(y_ptr.dtype.element_ty), mask=n_ok)
    else:
        part = part_ptr + pid_m * N + offs_n
        split_stride = M * N
        tl.store(part + pid_k * split_stride, out, mask=n_ok)
        tl.debug_barrier()  # every thread's partial is written before the ticket is taken
        lock = lock_ptr + pid_m * tl.num_programs(1) + pid_n
        ticket = tl.atomic_add(lock, 1, sem="acq_rel", scope="gpu")
        if ticket == SPLIT_K - 1:  # the last program of this tile: add the partials in split order
            total = tl.zeros((BLOCK_N,), dtype=tl.float32)
            for sk in range(SPLIT_K):
                total += tl.load(part + sk * split_stride, mask=n_ok, other=0.0, cache_modifier=".cg")
            if HAS_BIAS:
                total += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)
            tl.store(y_ptrs, total.to(y_ptr.dtype.element_ty), mask=n_ok)
            tl.atomic_xchg(lock, 0)  # ready for the next launch


# (BLOCK_N, BLOCK_K, num_warps). Triton gives each thread 4 adjacent columns per 128 a warp
# covers, so BLOCK_N / (32 * num_warps) columns a thread: 8 in each tile here, over which one
# activation load, conversion and sum are shared. BLOCK_K / 8 packed rows a step keep the
# accumulators at 2 * BLOCK_K / 8 * 8 registers a thread. w4a16_gemm.gemv_configs adds the
# splits of K for the shape.
TILES = (
    (1024, 32, 4),
    (512, 32, 2),
    (512, 64, 2),
)


def make_config(block_n: int, block_k: int, split_k: int, num_warps: int = 4) -> KernelConfig:
    return KernelConfig(
        {"gemv": 1, "BLOCK_N": block_n, "BLOCK_K": block_k, "SPLIT_K": split_k},
        num_warps=num_warps,
        num_stages=1,
    )


def is_gemv(config: KernelConfig | None) -> bool:
    return config is not None and bool(config.params.get("gemv"))


def default_config(m: int, n: int, k: int, num_sms: int = 132) -> KernelConfig:
    """Untuned choice: 512 columns by 32 inputs a step on two warps, and enough splits of K for
    about two programs a multiprocessor."""
    bn, bk = 512, 32
    tiles = triton.cdiv(n, bn) * m
    split = 1
    while tiles * split < 2 * num_sms and split * 2 <= k // 128:
        split *= 2
    return make_config(bn, bk, split, 2)


_LOCKS: dict[torch.device, torch.Tensor] = {}


def _locks(device: torch.device, size: int) -> torch.Tensor:
    """The device's ticket counters (zero between launches), grown outside CUDA-graph capture."""
    locks = _LOCKS.get(device)
    if locks is None or locks.numel() < size:
        if torch.cuda.is_available() and device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "w4a16_gemv: the split-K counters must be allocated before CUDA-graph capture; "
                "run the same batch eagerly once first (the runtime's warm-up forward does)"
            )
        locks = torch.zeros(max(size, 4096), dtype=torch.int32, device=device)
        _LOCKS[device] = locks
    return locks


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
    m, k = x.shape
    n = qweight.shape[1]
    if group_size % 8:
        raise ValueError(f"the W4A16 GEMV needs a group size divisible by 8, got {group_size}")
    bn, bk, split = config["BLOCK_N"], config["BLOCK_K"], config["SPLIT_K"]
    # A whole group per outer step when it is a few BLOCK_K: scales and zeros once a group.
    inner = group_size // bk if group_size % bk == 0 and group_size // bk <= 8 else 1
    step = inner * bk
    k_per_split = triton.cdiv(triton.cdiv(k, split), step) * step
    split = triton.cdiv(k, k_per_split)  # no empty split
    tiles_n = triton.cdiv(n, bn)
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if split > 1:
        partials = torch.empty((split, m, n), dtype=torch.float32, device=x.device)
        locks = _locks(x.device, tiles_n * m)
    else:
        partials = locks = y
    _w4a16_gemv_kernel[(m, tiles_n, split)](
        x, qweight, scales, zeros, perm if perm is not None else qweight, bias if bias is not None else scales,
        y, partials, locks, m, n, k, x.stride(0), y.stride(0),
        GROUP_SIZE=group_size, HAS_PERM=perm is not None, HAS_BIAS=bias is not None,
        BLOCK_N=bn, BLOCK_K=bk, INNER=inner, SPLIT_K=split, K_ITERS=k_per_split // step,
        USE_ASM=x.is_cuda,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip
    return y
