"""W4A16 decode on the tensor cores: y = x @ dequant(W).T (+ b) for 1..16 rows, fp16 or bf16.

kernels/w4a16_gemm.py runs it for decode batches of up to 16 rows in fp16 or bf16 with group
sizes divisible by 32 (``supports``): its tuner times this kernel's candidates there, and its
untuned default is this kernel up to 16 rows. On an H200 (benchmarks/RESULTS.md, G = 128) it beat
the CUDA-core GEMV and the tl.dot kernel at every Llama-3-8B projection at 1, 4 and 8 rows; one
layer's four projections at 1 row took 0.52x of bf16 cuBLAS's time (the GEMV's best: 0.67x).

Same weight layout as kernels/w4a16_gemv.py (qweight int32 [K / 8, N], nibble i of row r is
input 8r + i; scales [K / G, N]; int8 zeros [K / G, N]; optional act-order perm [K]), the same
launch signature, and its split-K with the in-kernel ticket reduction (w4a16_gemv._finish).

The CUDA-core GEMV spends ~3.6 SASS instructions a weight (an FMA per weight and row, plus the
unpacking); an H200 multiprocessor must consume ~36 int4 weights a clock out of 128
lane-instructions to keep up with memory. Here the weight tile is the A operand of the mma (its
columns as the mma's rows, the x rows, padded to 8 or 16, as its columns): mma.sync m16n8k16
takes 256 weights a warp, so the weights cost little more than their unpacking:

- Magic numbers, no int->float conversion: for a packed word w, (w >> s) & 0x000F000F | MAGIC is
  two 16-bit floats equal to BIAS + q of nibbles s/4 and s/4 + 4, exactly. bf16: MAGIC
  0x43004300 (128 + q), shifts 0, 4, 8, 12: 3 shifts and 4 lop3 a word. fp16 has 10 mantissa
  bits: w & 0x00F000F0 | 0x54005400 is 64 + q for nibbles 1 and 5 without a shift, so w and
  w >> 8 give all eight (1024 + q for nibbles 0, 4, 2, 6; 64 + q for 1, 5, 3, 7): 1 shift and
  4 lop3 a word. Inline PTX on the GPU (the interpreter computes the same bits).
- The pairs (i, i + 4) permute K inside a packed row; the dot does not care about the order as
  long as x is permuted the same way (in registers: reshape / permute of its natural-order
  tile; with a perm, gathered straight in the dot's order). The order is chosen so that every
  k' a thread holds in the mma operand comes from packed words it holds whole (pair_order).
- No zero point or scale per weight: over a chunk of inputs inside one group, acc = dot(W', x)
  in fp32 with W'_k = BIAS_k + q_k, and out += s * (acc - sum_k x_k BIAS_k - z * sum_k x_k) per
  output: 3 fp32 operations per output and row a chunk. acc runs ~7-10 bits above the result
  (the bias against q - z), which costs ~1e-5 of the result in fp32, far below the half-type
  output's rounding (tests/test_w4a16_tcgemv.py checks to 1e-4 of the largest output). The
  per-row sums of x are computed once per program before the main loop, for every chunk of its
  split at once, into a small fp32 scratch read back a chunk at a time; summed inside the loop
  they cost 0.15-0.35 instructions a weight more (shuffles and barriers each step).

What Triton 3.6 makes of it on sm_90 (benchmarks/w4a16_tcgemv_ptx.py, o 4096 -> 4096):

- The conversion to the mma operand layout is hoisted above the unpacking to the int32 load:
  the TTGIR's only convert_layout on the weight path is the packed [BLOCK_N, BLOCK_K / 8] int32
  tile; the inline asm, tl.join, tl.permute and tl.reshape then produce the dot-operand layout
  in registers (the lop3 results are the mma's A registers). The weights cross shared memory as
  packed int4: ~0.55 bytes a weight stored (st.shared.v4, with ~1 register move per word: the
  mma's k lanes need the tile K-contiguous, the weight is N-contiguous) and 0.5 loaded
  (ldmatrix), two barriers a step. With a pairing order that splits a word's pairs over lanes
  (k' = 8q + 2j + b, kept as PAIR_ORDER 1 for comparison) the unpacked 16-bit tile is converted
  instead: ~4.5 shared bytes and +0.6 instructions a weight.
- At 16 rows on 4 or 8 warps Triton uses wgmma, the unpacked tile still the A operand in
  registers (x from shared memory); 255 registers, no spills.
- num_stages = 2 makes the packed load a cp.async, but of 4 bytes (the shared tile is
  K-contiguous), with the address arithmetic: +0.2-0.3 instructions a weight.
- The weight as the B operand (x rows as the mma's 16 rows) doubles the mma count: +0.4-0.5.

At 1 row a split holds 1-8 chunks, so a program's fixed latencies matter as much as its loop:
in the sm_90 SASS each global load is followed by its layout conversion (a shared-memory round
trip and a barrier), so the loads wait on each other: x and the sums' pass, then the packed
words, then (after the dots) the scales. Issuing the first chunk's loads first (tried, not kept) did
not overlap them in the compiled code: each still waited on the previous one's conversion. A bulk
L2 prefetch of each split's first chunks when a program starts (cp.async.bulk.prefetch.L2) was
tried and measured slower or equal on an H200 (one layer's four Llama-3-8B projections, G = 128,
with it against without: 64.33 vs 60.72 us at 1 row, 80.45 vs 79.52 at 4, 94.19 vs 93.78 at 8),
and removed; see benchmarks/RESULTS.md.

SUB_ZEROS (a config key; the default's and every tuner candidate's since it won on an H200: one
layer's four Llama-3-8B projections, G = 128, bf16, each at its best tile, 57.67 against 61.07 us
at 1 row, 67.81 / 79.33 at 4, 74.51 / 93.49 at 8, faster at each projection and row count timed;
benchmarks/w4a16_micro.py, benchmarks/RESULTS.md, ninth session) subtracts the zero point in the
unpacking instead: each pair loses BIAS + z (sub.f16x2 with the pair's own
BIAS, 1024 or 64; bf16 fma.rn.bf16x2 by -1), exact for zero points 0..63 (the artifact's are
4-bit; the sums' kernel takes any int8), so acc = sum (q - z) x and a chunk adds s * acc: no
sums of x, no pre-pass, no scratch, and no bias in the fp32 accumulator. A chunk loads x, the
scales, the zero points and the packed words before using any of them: Triton puts the words'
layout conversion right after their load (it moves dot-operand conversions next to their
loads), the scales' and zero points' at their first use, and x's behind a move that is not pure
(_hold; else right after x's load), so in the sm_90 SASS every global load of a chunk (11 at 256
columns on 4 warps, 1 row) issues before its first shared store and barrier, and the kernel has
about half the barriers (12 against 24 there). The zero points' int8 load in the weight
operand's chain makes Triton take kWidth 8 for mma.sync, so pair_order gives PAIR_ORDER 1 (a
thread holds whole words), which also moves the packed tile through shared memory in one round
trip instead of two. Cost: a packed subtraction a pair (0.5 instructions a weight) and a little
more: loop 2.00-2.10 instructions a weight fp16, 2.29-2.33 bf16 at 1 row (256 x 4 and 128 x 2
warps, o_proj and gate_up at the tuner's splits) against 1.46-1.50 / 1.73-1.77; no spills at the
tuner's tiles (benchmarks/w4a16_tcgemv_ptx.py --sub-zeros --order). The second step of a
per-channel chunk loads its words and x when it starts (loading them ahead made ptxas spill).

PREFETCH (a config key, with SUB_ZEROS; among the tuner's candidates from 4 rows, where it won on
an H200, w4a16_gemm.PREFETCH_MIN_ROWS; never the default): a chunk's
loads wait on memory once per chunk, and a program's next chunk is not requested until its
current one is done, so a program has one chunk's bytes in flight. With PREFETCH d, when a
program starts chunk c it prefetches chunk c + d of its split into L2 (prefetch.global.L2, one
a 128-byte line: the packed words, the scales, the zero points), so the chunk's own loads later
wait on L2. +0.1 loop instructions a weight (2.41 against 2.29 at gate_up 256 x 4, 1 row, bf16),
the same registers and barriers, the weight still converted as its packed tile. Holding the next
chunk's words in registers instead (loaded a chunk ahead, passed to the next iteration through
_hold) was compiled and dropped: Triton then no longer hoists the weight's conversion to the int32
load (its chain starts at the move, not at a load) and stages the unpacked bf16 tile in shared
memory, at 255 registers and 3.2-3.6 loop instructions a weight. Timed on an H200 (one layer's four
Llama-3-8B projections, G = 128, bf16, each variant at its best tuner tile; benchmarks/RESULTS.md,
eleventh session): 56.14 us without against 62.34 with at 1 row, where a program holds 2-4 chunks
and the prefetches are mostly overhead; 66.35 / 65.96 at 4 rows (gate_up 30.69 / 28.33); 73.64 /
70.29 at 8, where the 128-column tile's programs hold 16 chunks at gate_up.

Loop SASS instructions a weight, G = 128, BLOCK_N 256 on 4 warps (1 / 4 / 8 / 16 rows): fp16
1.46 / 1.61 / 1.56 / 1.75, bf16 1.73 / 1.84 / 1.82 / 1.99 (unpacking 0.63 fp16, 0.88 bf16; mma
0.13; the rest the packed tile's loads and shared round trip, x, the scales and the per-chunk
correction), no spills. Smaller groups pay the per-chunk work more often: G = 64 ~2.0-2.4,
G = 32 ~2.7-4.0 (the per-chunk step, ~3 operations per output and row, dominates).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from pagecast.kernels import w4a16_gemv
from pagecast.kernels.tuning import KernelConfig


@triton.jit
def _halves(word, dtype: tl.constexpr):
    """The two 16-bit floats of an int32, [.., 2] (low half first): the interpreter's plain path."""
    lo = (word & 0xFFFF).to(tl.int16).to(dtype, bitcast=True)
    hi = (word >> 16).to(tl.int16).to(dtype, bitcast=True)
    return tl.join(lo, hi)


@triton.jit
def _magic_pairs(packed, dt: tl.constexpr, USE_ASM: tl.constexpr):
    """The packed words' nibbles as 16-bit floats BIAS + q, exactly: four [.., 2] tensors, the
    nibble pairs (0, 4), (1, 5), (2, 6), (3, 7) of each word (the low half first). fp16:
    1024 + q for nibbles 0, 4, 2, 6 and 64 + q for 1, 5, 3, 7; bf16: 128 + q.

    On the GPU one lop3 ((a & b) | c) a pair, in inline PTX whose 32-bit outputs are the pairs as
    Triton holds them (pack=2 over two copies of each word; eight 16-bit outputs made ptxas
    reassemble the halves with a register move a pair). The interpreter computes the same bits."""
    if USE_ASM:
        if dt == tl.float16:
            return tl.inline_asm_elementwise(
                asm="""
                {
                .reg .b32 t;
                lop3.b32 $0, $4, 0x000F000F, 0x64006400, 0xEA;
                lop3.b32 $1, $4, 0x00F000F0, 0x54005400, 0xEA;
                shr.u32 t, $4, 8;
                lop3.b32 $2, t, 0x000F000F, 0x64006400, 0xEA;
                lop3.b32 $3, t, 0x00F000F0, 0x54005400, 0xEA;
                }
                """,
                constraints="=r,=r,=r,=r,r,r",
                args=[tl.join(packed, packed)],
                dtype=(tl.float16,) * 4,
                is_pure=True,
                pack=2,
            )
        else:
            return tl.inline_asm_elementwise(
                asm="""
                {
                .reg .b32 t;
                lop3.b32 $0, $4, 0x000F000F, 0x43004300, 0xEA;
                shr.u32 t, $4, 4;
                lop3.b32 $1, t, 0x000F000F, 0x43004300, 0xEA;
                shr.u32 t, $4, 8;
                lop3.b32 $2, t, 0x000F000F, 0x43004300, 0xEA;
                shr.u32 t, $4, 12;
                lop3.b32 $3, t, 0x000F000F, 0x43004300, 0xEA;
                }
                """,
                constraints="=r,=r,=r,=r,r,r",
                args=[tl.join(packed, packed)],
                dtype=(tl.bfloat16,) * 4,
                is_pure=True,
                pack=2,
            )
    if dt == tl.float16:
        w0 = (packed & 0x000F000F) | 0x64006400
        w1 = (packed & 0x00F000F0) | 0x54005400
        t = packed >> 8
        w2 = (t & 0x000F000F) | 0x64006400
        w3 = (t & 0x00F000F0) | 0x54005400
    else:
        w0 = (packed & 0x000F000F) | 0x43004300
        w1 = ((packed >> 4) & 0x000F000F) | 0x43004300
        w2 = ((packed >> 8) & 0x000F000F) | 0x43004300
        w3 = ((packed >> 12) & 0x000F000F) | 0x43004300
    return _halves(w0, dt), _halves(w1, dt), _halves(w2, dt), _halves(w3, dt)


@triton.jit
def _zero_words(z, dt: tl.constexpr):
    """The zero points z [..] (int32) as the words the SUB_ZEROS unpacking subtracts: BIAS + z in
    both 16-bit halves, exactly for 0 <= z < 64 (the artifact's are 4-bit), [.., 2]: fp16
    (1024 + z, 64 + z) (the two BIAS of _magic_pairs), bf16 (128 + z) twice. The interpreter's
    path; _magic_pairs_sub's PTX computes the same with a mad.lo each."""
    zi = z.to(tl.int32)
    if dt == tl.float16:
        return tl.join(zi * 0x00010001 + 0x64006400, zi * 0x00100010 + 0x54005400)
    else:
        zw = zi * 0x00010001 + 0x43004300
        return tl.join(zw, zw)


@triton.jit
def _magic_pairs_sub(packed, zi, dt: tl.constexpr, USE_ASM: tl.constexpr):
    """_magic_pairs less BIAS + z: the nibbles as 16-bit floats q - z, exactly ((BIAS + q) -
    (BIAS + z) of small integers), one packed subtraction a pair after its lop3. ``zi``: each
    word's column's zero point (int32, 0 <= z < 64), ``packed``'s shape (broadcast by the caller).

    On the GPU sub.f16x2 (fp16, the pair's own BIAS: 1024 for pairs 0 and 2, 64 for 1 and 3) or
    fma.rn.bf16x2 by -1 (bf16: sm_80's packed bf16 subtraction), in the same inline PTX as
    _magic_pairs; the BIAS + z words (_zero_words) are a mad.lo each there, which ptxas computes
    once a column (the same register in every word's block). The interpreter subtracts in fp32
    (exact too)."""
    if USE_ASM:
        if dt == tl.float16:
            return tl.inline_asm_elementwise(
                asm="""
                {
                .reg .b32 t, u, za, zb;
                mad.lo.u32 za, $6, 0x00010001, 0x64006400;
                mad.lo.u32 zb, $6, 0x00100010, 0x54005400;
                lop3.b32 t, $4, 0x000F000F, 0x64006400, 0xEA;
                sub.f16x2 $0, t, za;
                lop3.b32 t, $4, 0x00F000F0, 0x54005400, 0xEA;
                sub.f16x2 $1, t, zb;
                shr.u32 u, $4, 8;
                lop3.b32 t, u, 0x000F000F, 0x64006400, 0xEA;
                sub.f16x2 $2, t, za;
                lop3.b32 t, u, 0x00F000F0, 0x54005400, 0xEA;
                sub.f16x2 $3, t, zb;
                }
                """,
                constraints="=r,=r,=r,=r,r,r,r,r",
                args=[tl.join(packed, packed), tl.join(zi, zi)],
                dtype=(tl.float16,) * 4,
                is_pure=True,
                pack=2,
            )
        else:
            return tl.inline_asm_elementwise(
                asm="""
                {
                .reg .b32 t, u, m, za;
                mov.b32 m, 0xBF80BF80;
                mad.lo.u32 za, $6, 0x00010001, 0x43004300;
                lop3.b32 t, $4, 0x000F000F, 0x43004300, 0xEA;
                fma.rn.bf16x2 $0, za, m, t;
                shr.u32 u, $4, 4;
                lop3.b32 t, u, 0x000F000F, 0x43004300, 0xEA;
                fma.rn.bf16x2 $1, za, m, t;
                shr.u32 u, $4, 8;
                lop3.b32 t, u, 0x000F000F, 0x43004300, 0xEA;
                fma.rn.bf16x2 $2, za, m, t;
                shr.u32 u, $4, 12;
                lop3.b32 t, u, 0x000F000F, 0x43004300, 0xEA;
                fma.rn.bf16x2 $3, za, m, t;
                }
                """,
                constraints="=r,=r,=r,=r,r,r,r,r",
                args=[tl.join(packed, packed), tl.join(zi, zi)],
                dtype=(tl.bfloat16,) * 4,
                is_pure=True,
                pack=2,
            )
    p0, p1, p2, p3 = _magic_pairs(packed, dt, False)
    za, zb = tl.split(_zero_words(zi, dt))
    z_a = _halves(za, dt).to(tl.float32)  # pairs 0, 2
    z_b = _halves(zb, dt).to(tl.float32)  # pairs 1, 3
    return (
        (p0.to(tl.float32) - z_a).to(dt),
        (p1.to(tl.float32) - z_b).to(dt),
        (p2.to(tl.float32) - z_a).to(dt),
        (p3.to(tl.float32) - z_b).to(dt),
    )


@triton.jit
def _input_bias(k, dt: tl.constexpr):
    """BIAS of input k (its nibble is k % 8) as _magic_pairs unpacks it, in fp32."""
    if dt == tl.float16:
        return tl.where(k % 2 == 1, 64.0, 1024.0)
    else:
        return tl.zeros(k.shape, dtype=tl.float32) + 128.0


@triton.jit
def _load_packed(qw_ptr, N, k0, offs_n, n_ok, P: tl.constexpr, W_AS_A: tl.constexpr, EVEN_N: tl.constexpr):
    """The packed words of the step at input k0: [BLOCK_N, P] with the weight as the mma's A
    operand, else [P, BLOCK_N]."""
    rows = k0 // 8 + tl.arange(0, P)
    if W_AS_A:
        ptrs = qw_ptr + rows[None, :] * N + offs_n[:, None]
        ld_ok = n_ok[:, None]
    else:
        ptrs = qw_ptr + rows[:, None] * N + offs_n[None, :]
        ld_ok = n_ok[None, :]
    if EVEN_N:
        packed = tl.load(ptrs)
    else:
        packed = tl.load(ptrs, mask=ld_ok, other=0)
    return packed


@triton.jit
def _load_scales(s_ptr, z_ptr, N, kc, offs_n, n_ok, GROUP_SIZE: tl.constexpr, EVEN_N: tl.constexpr):
    """The scales and zero points of the group holding input kc, [BLOCK_N] each, in fp32."""
    g = kc // GROUP_SIZE
    if EVEN_N:
        s = tl.load(s_ptr + g * N + offs_n).to(tl.float32)
        z = tl.load(z_ptr + g * N + offs_n).to(tl.float32)
    else:
        s = tl.load(s_ptr + g * N + offs_n, mask=n_ok, other=0.0).to(tl.float32)
        z = tl.load(z_ptr + g * N + offs_n, mask=n_ok, other=0).to(tl.float32)
    return s, z


@triton.jit
def _load_group(s_ptr, z_ptr, N, kc, offs_n, n_ok, GROUP_SIZE: tl.constexpr, EVEN_N: tl.constexpr):
    """SUB_ZEROS: the scales and the int8 zero points of the group holding kc, as loaded."""
    g = kc // GROUP_SIZE
    if EVEN_N:
        s = tl.load(s_ptr + g * N + offs_n)
        z = tl.load(z_ptr + g * N + offs_n)
    else:
        s = tl.load(s_ptr + g * N + offs_n, mask=n_ok, other=0.0)
        z = tl.load(z_ptr + g * N + offs_n, mask=n_ok, other=0)
    return s, z


@triton.jit
def _load_x_step(x_ptr, perm_ptr, offs_m, m_ok, stride_xm, k0, kk, k_nat, HAS_PERM: tl.constexpr,
                 W_AS_A: tl.constexpr):  # fmt: skip
    """The activations of the step at input k0 as loaded: with a perm, gathered straight in the
    dot's order ([BLOCK_K, BLOCK_M] with the weight as A, else [BLOCK_M, BLOCK_K]: reshaping a
    gathered [16, BLOCK_K] tile made Triton 3.6's OptimizeDotOperands abort, "Illegal shared
    layout"); without, [BLOCK_M, BLOCK_K] in the natural order (contiguous loads, permuted in
    registers by _dot_step)."""
    # (one return: Triton checks every return's type, constexpr branches included)
    if HAS_PERM:
        cols = tl.load(perm_ptr + k0 + k_nat)
        if W_AS_A:
            xs = tl.load(x_ptr + offs_m[None, :] * stride_xm + cols[:, None], mask=m_ok[None, :], other=0.0)
        else:
            xs = tl.load(x_ptr + offs_m[:, None] * stride_xm + cols[None, :], mask=m_ok[:, None], other=0.0)
    else:
        xs = tl.load(x_ptr + offs_m[:, None] * stride_xm + (k0 + kk)[None, :], mask=m_ok[:, None], other=0.0)
    return xs


@triton.jit
def _load_x_act(x_ptr, perm_ptr, offs_m, m_ok, stride_xm, k0, kk, k_nat, HAS_PERM: tl.constexpr,
                W_AS_A: tl.constexpr, ACT_UP: tl.constexpr):  # fmt: skip
    """_load_x_step, or with ACT_UP (the up half's offset in a gate_up row, [gate | up]) the
    activations silu(gate) * up computed as they load, rounded as kernels/activation.py rounds them
    (silu in fp32 to the half type, times up in fp32, to the half type): the same x, bitwise."""
    xs = _load_x_step(x_ptr, perm_ptr, offs_m, m_ok, stride_xm, k0, kk, k_nat, HAS_PERM, W_AS_A)
    if ACT_UP:
        up = _load_x_step(x_ptr + ACT_UP, perm_ptr, offs_m, m_ok, stride_xm, k0, kk, k_nat, HAS_PERM, W_AS_A)
        g = xs.to(tl.float32)
        act = (g / (1.0 + tl.exp(-g))).to(xs.dtype).to(tl.float32)
        xs = (act * up.to(tl.float32)).to(xs.dtype)
    return xs


@triton.jit
def _dot_order(DT: tl.constexpr, BLOCK_K: tl.constexpr, P: tl.constexpr, PAIR_ORDER: tl.constexpr):
    """A step's inputs in their natural order (kk) and in the dot's (k_nat: the input at each
    position of the dot's order, nibble j + 4b of packed row q), with their BIAS."""
    kk = tl.arange(0, BLOCK_K)  # a step's inputs in their natural order
    k_bias = _input_bias(kk, DT)
    # the input at each position of the dot's order: nibble j + 4b of packed row q
    if PAIR_ORDER == 0:  # k' = 2P j + 2q + b
        k_nat = ((kk // 2) % P) * 8 + kk // (2 * P) + (kk % 2) * 4
    elif PAIR_ORDER == 2:  # k' = 4P j1 + 4q + 2 j0 + b
        k_nat = ((kk // 4) % P) * 8 + (kk // (4 * P)) * 2 + (kk // 2) % 2 + (kk % 2) * 4
    else:  # k' = 8q + 2j + b
        k_nat = (kk // 8) * 8 + (kk // 2) % 4 + (kk % 2) * 4
    k_bias_dot = _input_bias(k_nat, DT)
    return kk, k_bias, k_nat, k_bias_dot


@triton.jit
def _unpack(packed, DT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, W_AS_A: tl.constexpr,
            PAIR_ORDER: tl.constexpr, USE_ASM: tl.constexpr):  # fmt: skip
    """A step's packed words as the mma operand of BIAS + q in the dot's order of inputs:
    [BLOCK_N, BLOCK_K] with the weight as A, else [BLOCK_K, BLOCK_N]."""
    p0, p1, p2, p3 = _magic_pairs(packed, DT, USE_ASM)
    return _arrange(p0, p1, p2, p3, BLOCK_N, BLOCK_K, W_AS_A, PAIR_ORDER)


@triton.jit
def _unpack_sub(packed, zi, DT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                W_AS_A: tl.constexpr, PAIR_ORDER: tl.constexpr, USE_ASM: tl.constexpr):  # fmt: skip
    """_unpack of q - z (SUB_ZEROS): ``zi`` the words' zero points, ``packed``'s shape (int32)."""
    p0, p1, p2, p3 = _magic_pairs_sub(packed, zi, DT, USE_ASM)
    return _arrange(p0, p1, p2, p3, BLOCK_N, BLOCK_K, W_AS_A, PAIR_ORDER)


@triton.jit
def _arrange(p0, p1, p2, p3, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, W_AS_A: tl.constexpr,
             PAIR_ORDER: tl.constexpr):  # fmt: skip
    """The four pair tensors of _magic_pairs as the mma operand in the dot's order of inputs."""
    # [.., P, b, j0, j1] with nibble j + 4b, j = j0 + 2 j1 (the joins append a last axis)
    w5 = tl.join(tl.join(p0, p1), tl.join(p2, p3))
    if W_AS_A:
        if PAIR_ORDER == 0:  # [BLOCK_N, j1, j0, P, b]
            w = tl.reshape(tl.permute(w5, (0, 4, 3, 1, 2)), (BLOCK_N, BLOCK_K))
        elif PAIR_ORDER == 2:  # [BLOCK_N, j1, P, j0, b]
            w = tl.reshape(tl.permute(w5, (0, 4, 1, 3, 2)), (BLOCK_N, BLOCK_K))
        else:  # [BLOCK_N, P, j1, j0, b]
            w = tl.reshape(tl.permute(w5, (0, 1, 4, 3, 2)), (BLOCK_N, BLOCK_K))
    else:
        if PAIR_ORDER == 0:  # [j1, j0, P, b, BLOCK_N]
            w = tl.reshape(tl.permute(w5, (4, 3, 0, 2, 1)), (BLOCK_K, BLOCK_N))
        elif PAIR_ORDER == 2:  # [j1, P, j0, b, BLOCK_N]
            w = tl.reshape(tl.permute(w5, (4, 0, 3, 2, 1)), (BLOCK_K, BLOCK_N))
        else:  # [P, j1, j0, b, BLOCK_N]
            w = tl.reshape(tl.permute(w5, (0, 4, 3, 2, 1)), (BLOCK_K, BLOCK_N))
    return w


@triton.jit
def _dot_step(w, xs, acc, sx, sxb, k_bias, k_bias_dot, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
              P: tl.constexpr, HAS_PERM: tl.constexpr, SUMS_FIRST: tl.constexpr, W_AS_A: tl.constexpr,
              PAIR_ORDER: tl.constexpr, DOT_FP32: tl.constexpr):  # fmt: skip
    """acc += W' x for one step, x as _load_x_step loads it (put in the dot's order of inputs
    here when it came in the natural one); sx and sxb (the sums of x and x * BIAS) as well when
    they are summed in the loop."""
    if HAS_PERM:
        xk = xs  # gathered in the dot's order
        if not SUMS_FIRST:
            xf = xk.to(tl.float32)
            if W_AS_A:
                sx += tl.sum(xf, axis=0)
                sxb += tl.sum(xf * k_bias_dot[:, None], axis=0)
            else:
                sx += tl.sum(xf, axis=1)
                sxb += tl.sum(xf * k_bias_dot[None, :], axis=1)
    else:
        if not SUMS_FIRST:
            xf = xs.to(tl.float32)
            sx += tl.sum(xf, axis=1)
            sxb += tl.sum(xf * k_bias[None, :], axis=1)
        x5 = tl.reshape(xs, (BLOCK_M, P, 2, 2, 2))  # [M, q, b, j1, j0]: nibble i = j0 + 2 j1 + 4b
        if PAIR_ORDER == 0:  # [M, j1, j0, q, b]
            xk = tl.reshape(tl.permute(x5, (0, 3, 4, 1, 2)), (BLOCK_M, BLOCK_K))
        elif PAIR_ORDER == 2:  # [M, j1, q, j0, b]
            xk = tl.reshape(tl.permute(x5, (0, 3, 1, 4, 2)), (BLOCK_M, BLOCK_K))
        else:  # [M, q, j1, j0, b]
            xk = tl.reshape(tl.permute(x5, (0, 1, 3, 4, 2)), (BLOCK_M, BLOCK_K))
        if W_AS_A:
            xk = tl.trans(xk)
    if W_AS_A:
        if DOT_FP32:
            acc = tl.dot(w.to(tl.float32), xk.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(w, xk, acc)
    else:
        if DOT_FP32:
            acc = tl.dot(xk.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(xk, w, acc)
    return acc, sx, sxb


@triton.jit
def _apply_scales(out, acc, sx, sxb, s, z, W_AS_A: tl.constexpr):
    """out += s * sum x (q - z) over a chunk: acc - sum x BIAS - z sum x."""
    if W_AS_A:
        out += s[:, None] * ((acc - sxb[None, :]) - z[:, None] * sx[None, :])
    else:
        out += s[None, :] * ((acc - sxb[:, None]) - z[None, :] * sx[:, None])
    return out


@triton.jit
def _apply_scales_sub(out, acc, s, W_AS_A: tl.constexpr):
    """SUB_ZEROS: out += s * sum x (q - z) over a chunk, acc as it is."""
    if W_AS_A:
        out += s[:, None] * acc
    else:
        out += s[None, :] * acc
    return out


@triton.jit
def _zeros_acc(BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, W_AS_A: tl.constexpr):
    """The fp32 accumulator: [BLOCK_N, BLOCK_M] with the weight as the mma's A operand."""
    if W_AS_A:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    return acc


@triton.jit
def _hold(v, USE_ASM: tl.constexpr):
    """v itself, through an inline-PTX move that is not pure: Triton moves a dot operand's layout
    conversion (a shared-memory round trip and a barrier) to right after its load, but not past
    this, so that the loads written before it issue first. The interpreter returns v. 16- or
    32-bit elements."""
    if USE_ASM:
        if v.dtype.primitive_bitwidth == 16:
            return tl.inline_asm_elementwise(
                "mov.b16 $0, $1;", "=h,h", [v], dtype=v.dtype, is_pure=False, pack=1
            )
        else:
            return tl.inline_asm_elementwise(
                "mov.b32 $0, $1;", "=r,r", [v], dtype=v.dtype, is_pure=False, pack=1
            )
    return v


@triton.jit
def _prefetch_l2(ptr, offsets, limit, USE_ASM: tl.constexpr):
    """prefetch.global.L2 of ptr + offsets (clamped below ``limit`` elements, so that a prefetch
    past the tensor's end stays inside it): a hint, nothing waits for it. The interpreter skips it."""
    if USE_ASM:
        tl.inline_asm_elementwise(
            "prefetch.global.L2 [$1]; // dummy $0", "=r,l", [ptr + tl.minimum(offsets, limit - 1)],
            dtype=tl.int32, is_pure=False, pack=1,
        )  # fmt: skip


@triton.jit
def _prefetch_chunk(qw_ptr, s_ptr, z_ptr, N, K, kc, col0, GROUP_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                    CHUNK: tl.constexpr, USE_ASM: tl.constexpr):  # fmt: skip
    """PREFETCH: the chunk at input kc into L2, one prefetch per 128-byte line: its packed words
    (CHUNK / 8 rows of BLOCK_N int32), its group's scales (16-bit) and zero points (int8)."""
    WORD_LINES: tl.constexpr = BLOCK_N // 32  # 32 int32 a line
    rows = kc // 8 + tl.arange(0, CHUNK // 8)
    words = rows[:, None] * N + col0 + tl.arange(0, WORD_LINES)[None, :] * 32
    _prefetch_l2(qw_ptr, words, (K // 8) * N, USE_ASM)
    g = kc // GROUP_SIZE
    SCALE_LINES: tl.constexpr = (BLOCK_N + 63) // 64  # 64 16-bit scales a line
    _prefetch_l2(s_ptr, g * N + col0 + tl.arange(0, SCALE_LINES) * 64, (K // GROUP_SIZE) * N, USE_ASM)
    ZERO_LINES: tl.constexpr = (BLOCK_N + 127) // 128
    _prefetch_l2(z_ptr, g * N + col0 + tl.arange(0, ZERO_LINES) * 128, (K // GROUP_SIZE) * N, USE_ASM)


@triton.jit
def _chunk_sub_zeros(out, x_ptr, qw_ptr, s_ptr, z_ptr, perm_ptr, N, stride_xm, kc, offs_m, m_ok, offs_n,
                     n_ok, kk, k_nat, DT: tl.constexpr, GROUP_SIZE: tl.constexpr, HAS_PERM: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, P: tl.constexpr,
                     STEPS: tl.constexpr, EVEN_N: tl.constexpr, W_AS_A: tl.constexpr,
                     PAIR_ORDER: tl.constexpr, DOT_FP32: tl.constexpr, USE_ASM: tl.constexpr,
                     ACT_UP: tl.constexpr):  # fmt: skip
    """SUB_ZEROS: one chunk at input kc, out += s * dot(q - z, x) (x = silu(gate) * up where ACT_UP). The global loads of the chunk's
    first step come first (x, the scales, the zero points, the packed words: the words' layout
    conversion goes right after their load, the others' after their first use, x's behind
    _hold), so that none waits on another's conversion; a later step (per-channel chunks of two)
    loads its words and x when it starts (loading them ahead made ptxas spill)."""
    xs = _load_x_act(x_ptr, perm_ptr, offs_m, m_ok, stride_xm, kc, kk, k_nat, HAS_PERM, W_AS_A, ACT_UP)
    s, z = _load_group(s_ptr, z_ptr, N, kc, offs_n, n_ok, GROUP_SIZE, EVEN_N)
    packed = _load_packed(qw_ptr, N, kc, offs_n, n_ok, P, W_AS_A, EVEN_N)
    if W_AS_A:
        zi = tl.broadcast_to(z.to(tl.int32)[:, None], (BLOCK_N, P))
    else:
        zi = tl.broadcast_to(z.to(tl.int32)[None, :], (P, BLOCK_N))
    acc = _zeros_acc(BLOCK_M, BLOCK_N, W_AS_A)
    no_sums = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for st in tl.static_range(STEPS):
        if st > 0:
            k0 = kc + st * BLOCK_K
            xs = _load_x_act(x_ptr, perm_ptr, offs_m, m_ok, stride_xm, k0, kk, k_nat, HAS_PERM, W_AS_A, ACT_UP)
            packed = _load_packed(qw_ptr, N, k0, offs_n, n_ok, P, W_AS_A, EVEN_N)
        w = _unpack_sub(packed, zi, DT, BLOCK_N, BLOCK_K, W_AS_A, PAIR_ORDER, USE_ASM)
        acc, _, _ = _dot_step(
            w, _hold(xs, USE_ASM), acc, no_sums, no_sums, kk, kk, BLOCK_M, BLOCK_K, P, HAS_PERM, True, W_AS_A,
            PAIR_ORDER, DOT_FP32,
        )  # fmt: skip
    return _apply_scales_sub(out, acc, s.to(tl.float32), W_AS_A)


@triton.jit
def _tcgemv_kernel(
    x_ptr,  # [M, K] activations (fp16 / bf16)
    qw_ptr,  # int32 [K / 8, N]
    s_ptr,  # [K / G, N]
    z_ptr,  # int8 [K / G, N]
    perm_ptr,  # int32 [K] or unused
    b_ptr,  # [N] or unused
    y_ptr,  # [M, N]
    part_ptr,  # fp32 [SPLIT_K, M, N] partial sums (SPLIT_K > 1) or unused
    lock_ptr,  # int32 [row blocks * column tiles] tickets, zero between launches (SPLIT_K > 1)
    sums_ptr,  # fp32 scratch [programs, CHUNKS, 2, BLOCK_M] (SUMS_FIRST) or unused (SUB_ZEROS too)
    M,
    N,
    K,
    stride_xm,
    stride_ym,
    GROUP_SIZE: tl.constexpr,
    HAS_PERM: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,  # rows a program computes (a power of two up to 16; the mma pads to 8)
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # inputs a dot step covers; divides CHUNK
    CHUNK: tl.constexpr,  # inputs between two applications of the scales; divides GROUP_SIZE
    SPLIT_K: tl.constexpr,
    CHUNKS: tl.constexpr,  # chunks a split covers (SPLIT_K * CHUNKS * CHUNK == K: nothing masked along K)
    EVEN_N: tl.constexpr,  # N % BLOCK_N == 0
    SUMS_FIRST: tl.constexpr,  # sum x per chunk before the loop (else inside it)
    SUMS_BLOCK: tl.constexpr,  # chunks the first pass sums at once
    W_AS_A: tl.constexpr,  # the weight tile is the mma's A operand (else B, x rows as the mma's M)
    PAIR_ORDER: tl.constexpr,  # k' of (packed row q, pair j = j0 + 2 j1, half b): 0: 2P j + 2q + b,
    #                             1: 8q + 2j + b, 2: 4P j1 + 4q + 2 j0 + b (see pair_order)
    DOT_FP32: tl.constexpr,  # the interpreter, bf16: dot in fp32 (its bf16 dot is wrong; exact here)
    USE_ASM: tl.constexpr,
    SUB_ZEROS: tl.constexpr = 0,  # unpack q - z (BIAS + z subtracted a pair): no sums of x, no scratch
    PREFETCH: tl.constexpr = 0,  # SUB_ZEROS: chunk c + PREFETCH prefetched into L2 when chunk c starts
    ACT_UP: tl.constexpr = 0,  # SUB_ZEROS: x is gate_up [M, 2 ACT_UP], the input silu(gate) * up
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    DT: tl.constexpr = x_ptr.dtype.element_ty
    P: tl.constexpr = BLOCK_K // 8  # packed rows a step
    STEPS: tl.constexpr = CHUNK // BLOCK_K
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    n_ok = offs_n < N
    k_begin = pid_k * (CHUNKS * CHUNK)
    if SUMS_FIRST:
        # Per chunk and row: sum x and sum x * BIAS over this split's inputs, SUMS_BLOCK chunks at
        # a time (one cross-thread reduction for all of them), into this program's scratch row.
        cb = tl.arange(0, SUMS_BLOCK)
        kc_ar = tl.arange(0, CHUNK)
        bias3 = _input_bias(kc_ar, DT)[None, None, :]  # chunks start at multiples of 16
        prog = (pid_m * tl.num_programs(1) + pid_n) * SPLIT_K + pid_k
        scr = sums_ptr + prog * (CHUNKS * 2 * BLOCK_M)
        for c0 in range(0, CHUNKS, SUMS_BLOCK):
            ci = c0 + cb
            c_ok = ci < CHUNKS
            kidx = k_begin + ci[:, None] * CHUNK + kc_ar[None, :]  # [CB, CHUNK]
            if HAS_PERM:
                cols = tl.load(perm_ptr + kidx, mask=c_ok[:, None], other=0)
            else:
                cols = kidx
            x3 = tl.load(
                x_ptr + offs_m[:, None, None] * stride_xm + cols[None, :, :],
                mask=m_ok[:, None, None] & c_ok[None, :, None],
                other=0.0,
            ).to(tl.float32)  # [BLOCK_M, CB, CHUNK]
            dst = scr + ci[None, :] * (2 * BLOCK_M) + tl.arange(0, BLOCK_M)[:, None]
            tl.store(dst, tl.sum(x3 * bias3, axis=2), mask=c_ok[None, :])
            tl.store(dst + BLOCK_M, tl.sum(x3, axis=2), mask=c_ok[None, :])
        tl.debug_barrier()  # the loop reads sums other threads wrote
    kk, k_bias, k_nat, k_bias_dot = _dot_order(DT, BLOCK_K, P, PAIR_ORDER)
    out = _zeros_acc(BLOCK_M, BLOCK_N, W_AS_A)
    for c in range(CHUNKS):
        kc = k_begin + c * CHUNK
        if SUB_ZEROS:
            if PREFETCH:
                # this split's chunk PREFETCH ahead (the last one again near the end: an L2 hit);
                # the first chunk also those between
                if c == 0:
                    for d in tl.static_range(1, PREFETCH):
                        kp = k_begin + min(d, CHUNKS - 1) * CHUNK
                        _prefetch_chunk(qw_ptr, s_ptr, z_ptr, N, K, kp, pid_n * BLOCK_N, GROUP_SIZE, BLOCK_N, CHUNK,
                                        USE_ASM)  # fmt: skip
                kp = k_begin + tl.minimum(c + PREFETCH, CHUNKS - 1) * CHUNK
                _prefetch_chunk(qw_ptr, s_ptr, z_ptr, N, K, kp, pid_n * BLOCK_N, GROUP_SIZE, BLOCK_N, CHUNK, USE_ASM)
            out = _chunk_sub_zeros(
                out, x_ptr, qw_ptr, s_ptr, z_ptr, perm_ptr, N, stride_xm, kc, offs_m, m_ok, offs_n, n_ok, kk,
                k_nat, DT, GROUP_SIZE, HAS_PERM, BLOCK_M, BLOCK_N, BLOCK_K, P, STEPS, EVEN_N, W_AS_A,
                PAIR_ORDER, DOT_FP32, USE_ASM, ACT_UP,
            )  # fmt: skip
        else:
            acc = _zeros_acc(BLOCK_M, BLOCK_N, W_AS_A)
            sx = tl.zeros((BLOCK_M,), dtype=tl.float32)
            sxb = tl.zeros((BLOCK_M,), dtype=tl.float32)
            for st in tl.static_range(STEPS):
                k0 = kc + st * BLOCK_K
                packed = _load_packed(qw_ptr, N, k0, offs_n, n_ok, P, W_AS_A, EVEN_N)
                w = _unpack(packed, DT, BLOCK_N, BLOCK_K, W_AS_A, PAIR_ORDER, USE_ASM)
                xs = _load_x_step(x_ptr, perm_ptr, offs_m, m_ok, stride_xm, k0, kk, k_nat, HAS_PERM, W_AS_A)
                acc, sx, sxb = _dot_step(
                    w, xs, acc, sx, sxb, k_bias, k_bias_dot, BLOCK_M, BLOCK_K, P, HAS_PERM, SUMS_FIRST,
                    W_AS_A, PAIR_ORDER, DOT_FP32,
                )  # fmt: skip
            if SUMS_FIRST:
                src = scr + c * (2 * BLOCK_M) + tl.arange(0, BLOCK_M)
                sxb = tl.load(src)
                sx = tl.load(src + BLOCK_M)
            s, z = _load_scales(s_ptr, z_ptr, N, kc, offs_n, n_ok, GROUP_SIZE, EVEN_N)
            out = _apply_scales(out, acc, sx, sxb, s, z, W_AS_A)
    if W_AS_A:
        out = tl.trans(out)
    w4a16_gemv._finish(
        out, offs_m, offs_n, m_ok, n_ok, y_ptr, stride_ym, b_ptr, part_ptr, lock_ptr, pid_m, pid_n, pid_k, M, N,
        HAS_BIAS, SPLIT_K,
    )  # fmt: skip


MAX_ROWS = 16  # rows a program: the mma's n16 (more rows take more row blocks, re-reading W)
MAX_CHUNK = 256  # inputs between two applications of the scales (per-channel groups are split)


def fuses_silu_and_mul(config: KernelConfig | None) -> bool:
    """Whether this config's launch can compute silu(gate) * up as it loads x (SUB_ZEROS only)."""
    return is_tcgemv(config) and bool(config.params.get("SUB_ZEROS"))  # type: ignore[union-attr]


def supports(dtype: torch.dtype, group_size: int) -> bool:
    """fp16 or bf16 activations and groups of a multiple of 32 inputs (``launch_shape``)."""
    return dtype in (torch.float16, torch.bfloat16) and group_size % 32 == 0


def is_tcgemv(config: KernelConfig | None) -> bool:
    return config is not None and bool(config.params.get("tcgemv"))


def make_config(
    block_n: int,
    block_k: int,
    split_k: int,
    num_warps: int = 4,
    num_stages: int = 1,
    *,
    w_as_a: bool = True,
    pair_order: int | None = None,
    sums_first: bool = True,
    sub_zeros: bool = False,
    prefetch: int = 0,
) -> KernelConfig:
    """``block_k``: the most inputs a dot step covers (the launcher takes the widest power of two
    dividing the group). The keyword options choose the variants the static counts compare
    (benchmarks/w4a16_tcgemv_ptx.py); but for ``sub_zeros`` the defaults are the cheapest.
    ``sub_zeros``: the zero points subtracted in the unpacking (the module docstring: more
    instructions, yet faster on an H200, so default_config and the tuner ask for it). It is named in
    the config only when on, so a table written before it keeps naming the sums' kernel.
    ``prefetch`` (with ``sub_zeros``): when a program starts chunk c it prefetches chunk c +
    ``prefetch`` of its split into L2 (_prefetch_chunk), so that chunk's loads wait on L2 rather
    than on memory; off (0) by default, a tuner candidate from w4a16_gemm.PREFETCH_MIN_ROWS rows
    (timed on an H200 by benchmarks/w4a16_micro.py's ``tcgemv_prefetch``)."""
    if prefetch and not sub_zeros:
        raise ValueError("prefetch is a variant of the sub_zeros kernel")
    return KernelConfig(
        {
            "tcgemv": 1, "BLOCK_N": block_n, "BLOCK_K": block_k, "SPLIT_K": split_k,
            "W_AS_A": int(w_as_a), "SUMS_FIRST": int(sums_first),
            **({} if pair_order is None else {"PAIR_ORDER": pair_order}),
            **({"SUB_ZEROS": 1} if sub_zeros else {}),
            **({"PREFETCH": prefetch} if prefetch else {}),
        },
        num_warps=num_warps,
        num_stages=num_stages,
    )  # fmt: skip


# Rows (the tuner's buckets 4 and 8) whose untuned default is the 128-column tile on 2 warps.
NARROW_DEFAULT_ROWS = (3, 8)


def default_config(m: int, n: int, k: int, num_sms: int = 132) -> KernelConfig:
    """Untuned choice: 256 columns on 4 warps by 128 inputs a step (the fewest loop instructions a
    weight in benchmarks/w4a16_tcgemv_ptx.py at 1-8 rows), or 128 on 2 warps at 3-8 rows
    (NARROW_DEFAULT_ROWS: on an H200 the fastest tuner tile at 7 of the 8 Llama-3-8B projections
    and row counts 4 and 8, at this split at 6 of them (o at 8 rows: half of it); o at 4 rows took
    14.24 us with the 256-column default in one run, 8.5 with this one in another; benchmarks/RESULTS.md,
    eleventh session), splits of K for about two
    programs a multiprocessor (the launcher rounds them to a divisor of K / chunk), the zero
    points subtracted in the unpacking (SUB_ZEROS, the module docstring: the artifact's are 4-bit)."""
    bn, warps = (128, 2) if NARROW_DEFAULT_ROWS[0] <= m <= NARROW_DEFAULT_ROWS[1] else (256, 4)
    tiles = triton.cdiv(n, bn) * triton.cdiv(m, MAX_ROWS)
    split = 1
    while tiles * split < 2 * num_sms and split * 2 <= max(1, k // 128):
        split *= 2
    return make_config(bn, 128, split, num_warps=warps, num_stages=1, sub_zeros=True)


def pair_order(step: int, rows: int, w_as_a: bool, config: KernelConfig) -> int:
    """The dot's order of a step's inputs (the kernel's PAIR_ORDER) for which every k' a thread
    holds in the mma operand comes from packed words it holds whole, so that Triton converts the
    packed int32 tile and unpacks it in registers. The mma's k lanes hold k' bits 2-3 (mma.sync,
    Triton's kWidth 4) or 1-2 (wgmma's register A, kWidth 2, which Triton 3.6 picks from 16 rows
    on 4 or 8 warps); those bits must index packed rows. 2P j + 2q + b does for both from 8
    packed rows a step (64 inputs), and for wgmma from 4; with 4 (32 inputs) on mma.sync,
    4P j1 + 4q + 2 j0 + b.

    SUB_ZEROS puts the int8 zero points' load in the weight operand's chain, and Triton 3.6 then
    takes kWidth 8 for mma.sync (AccelerateMatmul's computeOrigBitWidth: the narrowest load
    feeding the operand): the k lanes hold k' bits 3-4, which 8q + 2j + b (1, a thread holding
    whole words) gives at every step; 2P j + 2q + b only from 16 packed rows, 4P j1 + 4q + 2 j0 + b
    from 8. wgmma keeps 0."""
    wgmma = w_as_a and rows >= 16 and config.num_warps % 4 == 0
    if config.params.get("SUB_ZEROS"):
        return 0 if wgmma else 1
    return 0 if step >= 64 or wgmma else 2


def launch_shape(k: int, group_size: int, config: KernelConfig) -> tuple[int, int, int, int]:
    """(inputs a dot step covers, inputs a chunk covers, splits, chunks a split covers).

    The step is the widest power of two up to BLOCK_K dividing the group, 32 at least (16 would
    leave two packed rows a k16 step, so two of the mma's four k lanes would need the same words,
    and Triton converts the unpacked tile instead, through shared memory); the chunk the widest power-of-two multiple of it dividing the group, up to MAX_CHUNK; the
    split the largest divisor of K / chunk up to SPLIT_K, so that every split covers whole chunks
    and none runs past K."""
    if group_size % 32:
        raise ValueError(f"the tensor-core W4A16 GEMV needs a group size divisible by 32, got {group_size}")
    step = 32
    while group_size % (step * 2) == 0 and step * 2 <= config["BLOCK_K"]:
        step *= 2
    chunk = step
    while group_size % (chunk * 2) == 0 and chunk * 2 <= MAX_CHUNK:
        chunk *= 2
    chunks = k // chunk
    split = max(d for d in range(1, min(config["SPLIT_K"], chunks) + 1) if chunks % d == 0)
    return step, chunk, split, chunks // split


def w4a16_tcgemv(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    perm: torch.Tensor | None,
    group_size: int,
    bias: torch.Tensor | None,
    config: KernelConfig,
    silu_and_mul: bool = False,
) -> torch.Tensor:
    """x [M, K] (fp16 or bf16, contiguous rows) @ dequant(W).T (+ bias) -> [M, N] in x's dtype,
    one launch; w4a16_gemv.w4a16_gemv's signature (shapes are the caller's to check, as
    w4a16_gemm.check_shapes does). Partials and the sums' scratch are allocated per call.
    ``silu_and_mul``: x is gate_up [M, 2D] and the input is silu(gate) * up (kernels/activation.py's
    values), computed as x loads: a SUB_ZEROS config only (``fuses_silu_and_mul``)."""
    if silu_and_mul and not fuses_silu_and_mul(config):
        raise ValueError(f"the activation is fused only into SUB_ZEROS configs, got {config.as_dict()}")
    m, k = x.shape[0], qweight.shape[0] * 8  # with a perm x may be narrower than K
    n = qweight.shape[1]
    if x.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"the tensor-core W4A16 GEMV takes fp16 or bf16 activations, got {x.dtype}")
    params = config.params
    bm = min(triton.next_power_of_2(m), MAX_ROWS)
    step, chunk, split, chunks = launch_shape(k, group_size, config)
    bn = config["BLOCK_N"]
    tiles_n = triton.cdiv(n, bn)
    blocks_m = triton.cdiv(m, bm)
    y, partials, locks = w4a16_gemv.split_k_buffers(x, n, split, tiles_n * blocks_m)
    sub_zeros = bool(params.get("SUB_ZEROS", 0))
    sums_first = bool(params.get("SUMS_FIRST", 1)) and not sub_zeros
    w_as_a = bool(params.get("W_AS_A", 1))
    if sums_first:
        sums = torch.empty(
            (blocks_m * tiles_n * split * chunks * 2 * bm,), dtype=torch.float32, device=x.device
        )
    else:
        sums = y
    # the first pass holds at most ~32 inputs a thread (at least one chunk)
    sums_block = max(1, min(triton.next_power_of_2(chunks), 32 * 32 * config.num_warps // (bm * chunk)))
    interp = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    _tcgemv_kernel[(blocks_m, tiles_n, split)](
        x, qweight, scales, zeros, perm if perm is not None else qweight, bias if bias is not None else scales,
        y, partials, locks, sums, m, n, k, x.stride(0), y.stride(0),
        GROUP_SIZE=group_size, HAS_PERM=perm is not None, HAS_BIAS=bias is not None,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=step, CHUNK=chunk, SPLIT_K=split, CHUNKS=chunks, EVEN_N=n % bn == 0,
        SUMS_FIRST=sums_first, SUMS_BLOCK=sums_block, W_AS_A=w_as_a,
        PAIR_ORDER=pair_order(step, bm, w_as_a, config) if "PAIR_ORDER" not in params else params["PAIR_ORDER"],
        DOT_FP32=interp and x.dtype == torch.bfloat16,
        USE_ASM=x.is_cuda and not interp,
        SUB_ZEROS=int(sub_zeros), PREFETCH=int(params.get("PREFETCH", 0)) if sub_zeros else 0,
        ACT_UP=x.shape[1] // 2 if silu_and_mul else 0,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip
    return y
