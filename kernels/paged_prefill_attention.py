"""Paged attention for prefill, chunked prefill and mixed batches (flash-attention style).

Every sequence's new tokens attend causally to themselves and to the sequence's cached
prefix, all read through the block table (this step's K/V are already in the cache). One
launch covers the whole batch: the grid's first axis enumerates query tiles of all
sequences (each program finds its sequence by a binary search over query_start_loc), the
second the KV heads. A tile packs BLOCK_Q query tokens x the GQA group's query heads into
BLOCK_M rows, so each K/V tile is read once per KV head; a decode row (query length 1) is
just a short tile, which is how mixed batches run in this kernel.

An fp8 (e4m3fn) cache is read as the decode kernel reads it: tiles upcast in registers (to
fp16 for a bf16 engine, whose dots then run in fp16 with fp32 accumulation, to q's dtype
otherwise), the K scale folded into the softmax scale, the V scale applied to the output.

Launch options (issue 32, long prompts; constexprs a config's params switch on, see _OPTION_SETS):
HEAVY_FIRST reverses the program order, FOLD_SCALE fuses the softmax scale into the exp2 FMA,
PREFETCH_BLOCKS reads block ids a tile ahead so K/V copies pipeline num_stages deep, LAZY_RESCALE
skips acc's rescale while no row's max grew by more than 2^8. Each leaves the result the same up
to rounding; benchmarks/prefill_attention.py times them.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import triton
import triton.language as tl

from pagecast.kernels.paged_attention_args import check_paged_attention_args, check_sinks, check_window
from pagecast.kernels.tuning import KernelConfig

_LOG2E = 1.4426950408889634


@triton.jit
def _soft_cap(s, cap):
    """cap * tanh(s / cap) (see paged_decode_attention._soft_cap)."""
    return cap * (1.0 - 2.0 / (tl.exp(2.0 * s / cap) + 1.0))


# POLY_EXP2: of every four exponentials a thread computes, three run on the multi-function unit
# (ex2.approx, 16 a clock on an sm_90 SM) and one on the FMA pipe (128 lanes a clock): the
# argument's integer part goes into the exponent bits, 2^frac comes from a degree-3 polynomial
# with p(0) = 1 exactly (minimax relative error 1.0e-4 on [-0.5, 0.5], against the 3.9e-3 of the
# bf16 p the PV dot reads). Arguments are <= 0 (a score minus its row max; LAZY_RESCALE's reach
# 8) or -inf: clamped at -127, whose integer part cancels 1.0's exponent to give +0.0, as
# ex2(-inf) does. Inline PTX: CUDA only (the launcher leaves it off in the interpreter).
_POLY_EXP2_ASM = tl.constexpr("""{
.reg .f32 t, j, f, p;
.reg .b32 tb, pb;
ex2.approx.ftz.f32 $0, $4;
ex2.approx.ftz.f32 $1, $5;
ex2.approx.ftz.f32 $2, $6;
max.ftz.f32 f, $7, 0fC2FE0000;
add.rn.ftz.f32 t, f, 0f4B400000;
sub.rn.ftz.f32 j, t, 0f4B400000;
sub.rn.ftz.f32 f, f, j;
fma.rn.ftz.f32 p, f, 0f3D6150AE, 0f3E7805FF;
fma.rn.ftz.f32 p, p, f, 0f3F317AFD;
fma.rn.ftz.f32 p, p, f, 0f3F800000;
mov.b32 tb, t;
mov.b32 pb, p;
shl.b32 tb, tb, 23;
add.s32 pb, pb, tb;
mov.b32 $3, pb;
}""")


@triton.jit
def _exp2(x, POLY_EXP2: tl.constexpr):
    """2^x of an fp32 tile (see _POLY_EXP2_ASM)."""
    if POLY_EXP2:
        return tl.inline_asm_elementwise(
            _POLY_EXP2_ASM, "=f,=f,=f,=f,f,f,f,f", [x], dtype=tl.float32, is_pure=True, pack=4
        )
    else:
        return tl.exp2(x)


@triton.jit
def _attend_tile(
    q, m_i, l_i, acc, q_pos, start, kv_end, block_row, k_base, v_base,
    stride_kb, stride_kt, stride_vb, stride_vt,
    qk_scale, softcap, window,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr, SOFTCAP: tl.constexpr, SLIDING: tl.constexpr,
    FOLD_SCALE: tl.constexpr = False, LAZY_RESCALE: tl.constexpr = False, POLY_EXP2: tl.constexpr = False,
    blocks=None, CHUNKED: tl.constexpr = False,
):  # fmt: skip
    # One BLOCK_N tile of keys for all rows of the query tile; CAUSAL masks keys past each
    # row's position (and past kv_end) and, SLIDING, those at or before q_pos - window (CHUNKED:
    # those before the row's chunk, which starts at q_pos // window * window); otherwise
    # every key of the tile is visible to every row. m_i is in scaled (log2) units either way.
    # FOLD_SCALE (without SOFTCAP, which needs the scaled scores): the raw scores' row max is
    # scaled once per row, and each score's scale and max subtraction are one FMA (the tile's
    # separate multiply pass is gone; qk_scale > 0, so scaling commutes with the max).
    offs_n = start + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    # Each key's cache row: (its block, its offset in the block). Where a cache block holds whole
    # tiles (BLOCK_SIZE a multiple of BLOCK_N, e.g. --block-size 128) the tile is one block's
    # consecutive rows: one block id (a scalar) and an affine offset, so the copies' addresses are
    # the base plus a constant stride, not a gathered block id per key.
    if BLOCK_SIZE % BLOCK_N == 0:
        if blocks is None:
            block = tl.load(block_row + start // BLOCK_SIZE).to(tl.int64)
        else:
            block = blocks.to(tl.int64)  # loaded by the caller one tile ahead (PREFETCH_BLOCKS)
        rows = start % BLOCK_SIZE + tl.arange(0, BLOCK_N)
    else:
        if blocks is not None:
            block = blocks.to(tl.int64)
        elif CAUSAL:
            block = tl.load(block_row + offs_n // BLOCK_SIZE, mask=offs_n < kv_end, other=0).to(tl.int64)
        else:
            block = tl.load(block_row + offs_n // BLOCK_SIZE).to(tl.int64)
        block = block[:, None]
        rows = offs_n % BLOCK_SIZE
    k_rows = k_base + block * stride_kb + rows[:, None] * stride_kt
    v_rows = v_base + block * stride_vb + rows[:, None] * stride_vt
    if CAUSAL:
        n_mask = offs_n < kv_end
        if HEAD_DIM_PAD == HEAD_DIM:
            kv_mask = n_mask[:, None]
        else:
            kv_mask = n_mask[:, None] & (offs_d < HEAD_DIM)[None, :]
        k = tl.load(k_rows, mask=kv_mask, other=0.0)
        v = tl.load(v_rows, mask=kv_mask, other=0.0)
    elif HEAD_DIM_PAD == HEAD_DIM:
        k = tl.load(k_rows)
        v = tl.load(v_rows)
    else:
        d_mask = (offs_d < HEAD_DIM)[None, :]
        k = tl.load(k_rows, mask=d_mask, other=0.0)
        v = tl.load(v_rows, mask=d_mask, other=0.0)
    k = k.to(q.dtype)  # fp8 cache: upcast in registers (a no-op for a cache in q's dtype)
    v = v.to(q.dtype)
    FOLD: tl.constexpr = FOLD_SCALE and not SOFTCAP
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # [BLOCK_M, BLOCK_N]
    if not FOLD:
        s = s * qk_scale
    if SOFTCAP:
        s = _soft_cap(s, softcap)
    if CAUSAL:
        visible = (offs_n[None, :] <= q_pos[:, None]) & (offs_n < kv_end)[None, :]
        if CHUNKED:
            visible = visible & (offs_n[None, :] >= (q_pos // window * window)[:, None])
        elif SLIDING:
            visible = visible & (offs_n[None, :] > q_pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
    if FOLD:
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
    else:
        m_new = tl.maximum(m_i, tl.max(s, 1))
    if SLIDING:
        # a row may see no key of a tile below its window: keep exp2 away from -inf - -inf
        m_new = tl.where(m_new == float("-inf"), 0.0, m_new)
    if LAZY_RESCALE:
        # Keep every row's reference max unless some row's max grew by more than 8 (log2 units):
        # then p <= 2^8, harmless in fp32 sums and half-type dots, and most tiles of a long row
        # skip the rescale of acc and l. (The caller leaves this off with a window, where a row's
        # max can stay -inf.) The reference max m_i is what acc and l are relative to either way.
        grow = tl.max(tl.where(m_new > m_i, m_new - m_i, 0.0), 0) > 8.0
        if grow:
            alpha = tl.exp2(m_i - m_new)
            l_i = l_i * alpha
            acc = acc * alpha[:, None]
            m_i = m_new
        m_new = m_i
    if FOLD:
        p = _exp2(tl.fma(s, qk_scale, -m_new[:, None]), POLY_EXP2)
    else:
        p = _exp2(s - m_new[:, None], POLY_EXP2)
    if LAZY_RESCALE:
        l_i = l_i + tl.sum(p, 1)
        acc = acc + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    else:
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit(do_not_specialize=["num_seqs", "stride_bt", "window"])
def _paged_prefill_kernel(
    q_ptr,  # q: [num_tokens, num_heads, head_dim]
    k_cache_ptr,  # k_cache: [num_blocks, num_kv_heads, block_size, head_dim]
    v_cache_ptr,  # v_cache: [num_blocks, num_kv_heads, block_size, head_dim]
    block_tables_ptr,  # block_tables: [num_seqs, max_blocks] int32
    seq_lens_ptr,  # seq_lens: [num_seqs] int32
    query_start_loc_ptr,  # query_start_loc: [num_seqs + 1] int32
    out_ptr,  # out: [num_tokens, num_heads, head_dim]
    sinks_ptr,  # sinks: [num_heads] fp32/bf16 (HAS_SINKS)
    qk_scale,  # softmax scale * k_scale * log2(e)
    v_scale,  # V's dequantisation scale (fp8 cache; 1.0 otherwise)
    softcap,  # logit soft-cap * log2(e) (SOFTCAP)
    window,  # sliding window (SLIDING): a row at q_pos sees keys q_pos - window < k <= q_pos;
    #          CHUNKED: the attention chunk, keys q_pos // window * window <= k <= q_pos
    num_seqs,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_kh,
    stride_kt,
    stride_vb,
    stride_vh,
    stride_vt,
    stride_bt,
    stride_ot,
    stride_oh,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 engines (exact), "tf32" (ignored) for half types
    SOFTCAP: tl.constexpr = False,
    SLIDING: tl.constexpr = False,
    HAS_SINKS: tl.constexpr = False,
    HEAVY_FIRST: tl.constexpr = False,  # programs in reverse: the tiles that see the most keys start first
    FOLD_SCALE: tl.constexpr = False,  # see _attend_tile
    PREFETCH_BLOCKS: tl.constexpr = False,  # the full-tile loop reads the next tile's block ids a tile ahead
    LAZY_RESCALE: tl.constexpr = False,  # see _attend_tile (off under SLIDING)
    POLY_EXP2: tl.constexpr = False,  # one exp2 in four on the FMA pipe (_POLY_EXP2_ASM; CUDA half types)
    CHUNKED: tl.constexpr = False,  # with SLIDING: ``window`` is an attention chunk (Llama 4)
):
    LAZY: tl.constexpr = LAZY_RESCALE and not SLIDING
    BLOCK_Q: tl.constexpr = BLOCK_M // GROUP_PAD
    if HEAVY_FIRST:
        # Blocks start roughly in program-id order. A causal tile's work grows with its position,
        # so in launch order the last wave is the longest tiles, some running alone at the end;
        # reversed (a bijection of ids, so the search below is unchanged) the tail is short tiles.
        pid = tl.num_programs(0) - 1 - tl.program_id(0)
    else:
        pid = tl.program_id(0)
    kv_head = tl.program_id(1)

    # Sequence s owns programs [qsl[s] // BLOCK_Q + s, qsl[s+1] // BLOCK_Q + s + 1): find the
    # last s whose first program is <= pid.
    lo: tl.int32 = 0
    hi: tl.int32 = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first <= pid:
            lo = mid + 1
        else:
            hi = mid
    seq = lo - 1

    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    tile = pid - (q_start // BLOCK_Q + seq)
    if tile * BLOCK_Q < q_len:
        seq_len = tl.load(seq_lens_ptr + seq)
        prefix = seq_len - q_len  # cached tokens before this step's queries

        offs_m = tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, HEAD_DIM_PAD)
        tok = tile * BLOCK_Q + offs_m // GROUP_PAD  # query index within the sequence
        g = offs_m % GROUP_PAD
        row_mask = (tok < q_len) & (g < GROUP)
        if HEAD_DIM_PAD == HEAD_DIM:
            io_mask = row_mask[:, None]
        else:
            io_mask = row_mask[:, None] & (offs_d < HEAD_DIM)[None, :]
        rows = (q_start + tok).to(tl.int64)
        heads = kv_head * GROUP + g
        q = tl.load(
            q_ptr + rows[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
            mask=io_mask,
            other=0.0,
        )
        if k_cache_ptr.dtype.element_ty != q_ptr.dtype.element_ty and q_ptr.dtype.element_ty == tl.bfloat16:
            # As in decode: both dots of a bf16 engine over an fp8 cache run in fp16 (one
            # conversion instruction per pair of e4m3 values; q and p lose nothing). So do they
            # over the cache's fp16 stage (STAGE), which holds the same values.
            q = q.to(tl.float16)
        q_pos = prefix + tok  # [BLOCK_M] position of each row in its sequence

        last_tok = tl.minimum(tile * BLOCK_Q + BLOCK_Q, q_len) - 1
        kv_end = prefix + last_tok + 1  # keys the tile's last row sees
        kv_full = prefix + tile * BLOCK_Q + 1  # keys every row of the tile sees
        full_end = (kv_full // BLOCK_N) * BLOCK_N
        if SLIDING:
            # Keys from the last row's window start on are seen by every row (up to kv_full);
            # below that, down to the first row's window start, each row masks its own.
            # (CHUNKED: each row's chunk start, as monotone in the row as a window's start.)
            first_q = prefix + tile * BLOCK_Q
            if CHUNKED:
                first_start = first_q // window * window
                last_start = (prefix + last_tok) // window * window
            else:
                first_start = tl.maximum(first_q - window + 1, 0)
                last_start = tl.maximum(prefix + last_tok - window + 1, 0)
            lo_start = (first_start // BLOCK_N) * BLOCK_N
            full_lo = tl.minimum(tl.cdiv(last_start, BLOCK_N) * BLOCK_N, full_end)
        else:
            lo_start = 0
            full_lo = 0

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
        block_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
        k_base = k_cache_ptr + kv_head * stride_kh + offs_d[None, :]
        v_base = v_cache_ptr + kv_head * stride_vh + offs_d[None, :]
        if SLIDING:
            for start in range(lo_start, full_lo, BLOCK_N):
                m_i, l_i, acc = _attend_tile(
                    q, m_i, l_i, acc, q_pos, start, kv_end, block_row, k_base, v_base,
                    stride_kb, stride_kt, stride_vb, stride_vt, qk_scale, softcap, window,
                    HEAD_DIM, HEAD_DIM_PAD, BLOCK_SIZE, BLOCK_N, CAUSAL=True, DOT_PRECISION=DOT_PRECISION,
                    SOFTCAP=SOFTCAP, SLIDING=SLIDING, FOLD_SCALE=FOLD_SCALE, LAZY_RESCALE=LAZY, POLY_EXP2=POLY_EXP2, CHUNKED=CHUNKED,
                )  # fmt: skip
        if PREFETCH_BLOCKS:
            # The K/V addresses of a tile then come from a loop-carried register, not from a load
            # in the same iteration: the pipeliner sees no indirect load chain, so the K/V copies
            # can run num_stages - 1 tiles ahead (with the chain they run one ahead whatever the
            # stages, the table read taking the other stage).
            if BLOCK_SIZE % BLOCK_N == 0:  # a tile's one block id (see _attend_tile)
                offs_t = 0
            else:  # each key's
                offs_t = tl.arange(0, BLOCK_N)
            blocks = tl.load(block_row + (full_lo + offs_t) // BLOCK_SIZE, mask=full_lo + offs_t < full_end, other=0)
            for start in range(full_lo, full_end, BLOCK_N):
                nxt = start + BLOCK_N + offs_t
                blocks_next = tl.load(block_row + nxt // BLOCK_SIZE, mask=nxt < full_end, other=0)
                m_i, l_i, acc = _attend_tile(
                    q, m_i, l_i, acc, q_pos, start, kv_end, block_row, k_base, v_base,
                    stride_kb, stride_kt, stride_vb, stride_vt, qk_scale, softcap, window,
                    HEAD_DIM, HEAD_DIM_PAD, BLOCK_SIZE, BLOCK_N, CAUSAL=False, DOT_PRECISION=DOT_PRECISION,
                    SOFTCAP=SOFTCAP, SLIDING=SLIDING, FOLD_SCALE=FOLD_SCALE, LAZY_RESCALE=LAZY, POLY_EXP2=POLY_EXP2, CHUNKED=CHUNKED, blocks=blocks,
                )  # fmt: skip
                blocks = blocks_next
        else:
            for start in range(full_lo, full_end, BLOCK_N):
                m_i, l_i, acc = _attend_tile(
                    q, m_i, l_i, acc, q_pos, start, kv_end, block_row, k_base, v_base,
                    stride_kb, stride_kt, stride_vb, stride_vt, qk_scale, softcap, window,
                    HEAD_DIM, HEAD_DIM_PAD, BLOCK_SIZE, BLOCK_N, CAUSAL=False, DOT_PRECISION=DOT_PRECISION,
                    SOFTCAP=SOFTCAP, SLIDING=SLIDING, FOLD_SCALE=FOLD_SCALE, LAZY_RESCALE=LAZY, POLY_EXP2=POLY_EXP2, CHUNKED=CHUNKED,
                )  # fmt: skip
        for start in range(full_end, kv_end, BLOCK_N):
            m_i, l_i, acc = _attend_tile(
                q, m_i, l_i, acc, q_pos, start, kv_end, block_row, k_base, v_base,
                stride_kb, stride_kt, stride_vb, stride_vt, qk_scale, softcap, window,
                HEAD_DIM, HEAD_DIM_PAD, BLOCK_SIZE, BLOCK_N, CAUSAL=True, DOT_PRECISION=DOT_PRECISION,
                SOFTCAP=SOFTCAP, SLIDING=SLIDING, FOLD_SCALE=FOLD_SCALE, LAZY_RESCALE=LAZY, POLY_EXP2=POLY_EXP2, CHUNKED=CHUNKED,
            )  # fmt: skip

        if HAS_SINKS:
            # each row's head's sink logit joins its denominator, with no value
            sink = tl.load(sinks_ptr + heads, mask=row_mask, other=0.0).to(tl.float32) * 1.4426950408889634
            m_fin = tl.maximum(m_i, sink)
            alpha = tl.exp2(m_i - m_fin)
            o = acc * (alpha / (l_i * alpha + tl.exp2(sink - m_fin)))[:, None] * v_scale
        else:
            o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None] * v_scale
        tl.store(
            out_ptr + rows[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
            o.to(out_ptr.dtype.element_ty),
            mask=io_mask,
        )


# (BLOCK_M rows = query tokens x padded group, BLOCK_N keys, warps, stages)
_VARIANTS = [
    (64, 64, 4, 2),
    (64, 32, 4, 2),
    (128, 64, 8, 2),
    (128, 32, 4, 2),
    (128, 64, 4, 2),
    (128, 64, 8, 3),
    (64, 64, 4, 3),
    (128, 128, 8, 2),
]
# Issue 32 (long prompts): deeper pipelines and 128-row tiles on sm_90's wgmma, with the launch
# options below. Shared memory at head_dim 128, bf16, with PREFETCH_BLOCKS (compiled for sm_90,
# benchmarks/prefill_ptx.py): 64x64 s3 112 KiB (two programs an SM), s4 144 KiB; 128x64 s4
# 160 KiB; 128x128 s3 224 KiB, of the 227 KiB a program may take. Without PREFETCH_BLOCKS the
# K/V tiles stay double-buffered whatever the stages (the block-table read takes the other stage).
# Measured on an H200 (benchmarks/prefill_attention.py --quick, 2026-12-03, Llama-3.1-8B heads, one
# sequence, bf16): 128x128 w8 s3 with HEAVY_FIRST + FOLD_SCALE + PREFETCH_BLOCKS was the fastest
# at 8k, 32k and 128k (387 / 461 / 458 TFLOP/s against the old default's 335 / 393 / 372), then
# 128x64 w8 s4 and s3 at 32k and 128k, 64x64 w4 s3 at 8k (1.14x); 64x32 s3 lost, and so did every
# LAZY_RESCALE set.
_LONG_VARIANTS = [
    (128, 64, 8, 4),
    (128, 128, 8, 3),
]
# Launch options, constexprs of the kernel that ride in a config's params (absent = 0, so older
# tuning tables run as before) for the tuner to pick per bucket: HEAVY_FIRST starts the tiles that
# see the most keys first; FOLD_SCALE fuses the softmax scale into the exp2 argument's FMA;
# PREFETCH_BLOCKS reads the full-tile loop's block ids a tile ahead, so K/V copies pipeline deeper.
# LAZY_RESCALE (acc rescaled only when a row's max grew by more than 2^8) is in the kernel and its
# tests but not in the space: it was slower in every set timed (0.88-0.95x). To drop an option,
# delete it here and its constexpr (the launcher reads each with .get). POLY_EXP2 (one exp2 in four
# on the FMA pipe, where the softmax waits on the multi-function unit) rides on the long tiles only.
_OPTION_SETS = [
    {"HEAVY_FIRST": 1, "FOLD_SCALE": 1, "PREFETCH_BLOCKS": 1},
]
# Measured on an H200 (2026-12-04, block size 128, bf16, one sequence): with it 128x128 w8 s3 ran
# 1.086x / 1.042x / 1.031x at 8k / 32k / 128k, 64x64 w4 s3 1.014x at 8k but 0.94x past it, and
# 128x64 w8 s4 0.95-0.99x past 8k (that one left the space).
_POLY_TILES = [(64, 64, 4, 3), (128, 128, 8, 3)]
OPTION_NAMES = ("HEAVY_FIRST", "FOLD_SCALE", "PREFETCH_BLOCKS", "LAZY_RESCALE", "POLY_EXP2")

# The POLY_EXP2 tiles come before the same tiles without it: the tuner keeps the earlier of two
# configs within TIE_TOLERANCE (2%) of each other, and the tuner's timing of one 128k bucket
# (34.6 against 35.3 ms, an fp8 cache's stage) sat inside that where the kernel benchmark's
# repeated launches measured 3-4% (the table above). Where the plain tile is faster by more, it
# still wins.
CONFIG_SPACE: list[KernelConfig] = (
    [KernelConfig({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s) for (m, n, w, s) in _VARIANTS]
    + [
        KernelConfig({"BLOCK_M": m, "BLOCK_N": n, **_OPTION_SETS[0], "POLY_EXP2": 1}, num_warps=w, num_stages=s)
        for (m, n, w, s) in _POLY_TILES
    ]
    + [
        KernelConfig({"BLOCK_M": m, "BLOCK_N": n, **options}, num_warps=w, num_stages=s)
        for options in _OPTION_SETS
        for (m, n, w, s) in [(64, 64, 4, 2), (64, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 2)] + _LONG_VARIANTS
    ]
)


# The block-table width varies with every batch's longest context: not specialised, so a staged
# launch at any width runs the variant the tuner compiled.
@triton.jit(do_not_specialize=["max_blocks", "stride_bt"])
def _stage_blocks_kernel(
    k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, k_out_ptr, v_out_ptr, max_blocks,
    stride_kb, stride_kh, stride_kt, stride_vb, stride_vh, stride_vt, stride_bt,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
):  # fmt: skip
    """One program per (sequence x block-table column, KV head): that block's K and V rows,
    converted to the output's dtype, into the stage [num_seqs * max_blocks, kv_heads, BLOCK_SIZE,
    HEAD_DIM] (contiguous) at row seq * max_blocks + column. Columns past the sequence's blocks are
    left as they are (the attention never reads them)."""
    idx = tl.program_id(0)
    head = tl.program_id(1)
    seq = idx // max_blocks
    col = idx % max_blocks
    if col * BLOCK_SIZE < tl.load(seq_lens_ptr + seq):
        block = tl.load(block_tables_ptr + seq * stride_bt + col).to(tl.int64)
        offs_t = tl.arange(0, BLOCK_SIZE)
        offs_d = tl.arange(0, HEAD_DIM_PAD)
        mask = (offs_d < HEAD_DIM)[None, :]
        dst = ((idx.to(tl.int64) * tl.num_programs(1) + head) * BLOCK_SIZE + offs_t[:, None]) * HEAD_DIM + offs_d[None, :]
        k = tl.load(k_cache_ptr + block * stride_kb + head * stride_kh + offs_t[:, None] * stride_kt + offs_d[None, :], mask=mask)
        tl.store(k_out_ptr + dst, k.to(k_out_ptr.dtype.element_ty), mask=mask)
        v = tl.load(v_cache_ptr + block * stride_vb + head * stride_vh + offs_t[:, None] * stride_vt + offs_d[None, :], mask=mask)
        tl.store(v_out_ptr + dst, v.to(v_out_ptr.dtype.element_ty), mask=mask)


def stage_dtype(q_dtype: torch.dtype) -> torch.dtype:
    """The dtype an fp8 cache is staged in for q of ``q_dtype``: fp16 for half types (every e4m3
    value is exact in fp16, and the kernel's dots over an fp8 cache run in fp16 anyway), else q's."""
    return torch.float16 if q_dtype in (torch.float16, torch.bfloat16) else q_dtype


def stage_bytes(tokens: int, num_kv_heads: int, head_dim: int, block_size: int, q_dtype: torch.dtype) -> int:
    """Device memory the STAGE path allocates for one sequence of ``tokens`` context: its K and V
    blocks in stage_dtype (the memory plan counts it at max_model_len)."""
    blocks = -(-tokens // block_size)
    return 2 * blocks * num_kv_heads * block_size * head_dim * stage_dtype(q_dtype).itemsize


def stage_cache(
    k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """The batch's K/V blocks gathered out of an fp8 cache into a contiguous ``dtype`` stage (one
    memory-bound launch), with the block table that reads it: (k_stage, v_stage, table), the
    stage [num_seqs * max_blocks, kv_heads, block_size, head_dim], sequence s's block j at row
    s * max_blocks + j."""
    num_seqs, max_blocks = block_tables.shape
    _, num_kv_heads, block_size, head_dim = k_cache.shape
    shape = (num_seqs * max_blocks, num_kv_heads, block_size, head_dim)
    k_stage = torch.empty(shape, dtype=dtype, device=k_cache.device)
    v_stage = torch.empty(shape, dtype=dtype, device=k_cache.device)
    if num_seqs * max_blocks:
        _stage_blocks_kernel[(num_seqs * max_blocks, num_kv_heads)](
            k_cache, v_cache, block_tables, seq_lens, k_stage, v_stage, max_blocks,
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0),
            BLOCK_SIZE=block_size, HEAD_DIM=head_dim, HEAD_DIM_PAD=max(16, triton.next_power_of_2(head_dim)),
            num_warps=4,
        )  # fmt: skip
    table = torch.arange(num_seqs * max_blocks, dtype=torch.int32, device=k_cache.device).view(num_seqs, max_blocks)
    return k_stage, v_stage, table


# STAGE (an fp8 cache only; issue 32): the batch's K/V blocks are first converted into an fp16
# stage (stage_cache, one memory-bound launch), then the tile runs over the stage as over a cache
# of q's dtype. Over an fp8 cache every query tile upcasts each K/V tile it reads, and at long
# contexts a block is read by hundreds of tiles; the stage upcasts it once. Same values, same dots
# (fp16 either way), so the same bits as the tile reading the fp8 cache. Only batches of up to
# STAGE_MAX_SEQS sequences are staged (the stage holds their whole context: the memory plan counts
# one sequence at max_model_len); others run the same tile over the fp8 cache. The tuner times it
# in the long-context buckets of an fp8 cache (STAGE_TILES), against reading the cache directly.
STAGE_MAX_SEQS = 1
STAGE_TILES = [
    KernelConfig({"BLOCK_M": m, "BLOCK_N": n, "STAGE": 1, **p, **_OPTION_SETS[0]}, num_warps=w, num_stages=st)
    for (m, n, w, st, p) in [
        (64, 64, 4, 3, {}),
        (128, 64, 8, 4, {}),
        # the stage's 128x128 tile with POLY_EXP2 (the same fp16 dots, the softmax's wait on the
        # multi-function unit shortened), before the same tile without it (see CONFIG_SPACE)
        (128, 128, 8, 3, {"POLY_EXP2": 1}),
        (128, 128, 8, 3, {}),
    ]
]


def prune_configs(configs: list[KernelConfig], group: int, head_dim: int) -> list[KernelConfig]:
    """Drop tiles whose rows cannot hold one token's whole GQA group, and at head_dim > 128 tiles
    past 128x64 or whose half-type Q and K/V buffers pass 192 KiB of shared memory (K/V are
    double-buffered, or num_stages-buffered with PREFETCH_BLOCKS). At head_dim <= 128 every
    tile fits in bf16 (the largest, 128x128 with 3 stages prefetched, takes 224 KiB)."""
    group_pad = max(1, triton.next_power_of_2(group))

    def fits(c: KernelConfig) -> bool:
        if head_dim <= 128:
            return True
        d = triton.next_power_of_2(head_dim)
        buffers = c.num_stages if c.params.get("PREFETCH_BLOCKS") else 2
        smem = 2 * d * (c["BLOCK_M"] + 2 * buffers * c["BLOCK_N"])
        return c["BLOCK_M"] * c["BLOCK_N"] <= 128 * 64 and smem <= 192 * 1024

    return [c for c in configs if c["BLOCK_M"] >= group_pad and fits(c)]


def default_config(group: int, head_dim: int) -> KernelConfig:
    return prune_configs(CONFIG_SPACE, group, head_dim)[0] if group <= 64 else CONFIG_SPACE[0]


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    config: Mapping[str, int] | None = None,
    out: torch.Tensor | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    softcap: float = 0.0,
    window: int = 0,
    sinks: torch.Tensor | None = None,
    chunk: int = 0,
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens (rows query_start_loc[i]:[i+1] of q) over
    its whole paged context of seq_lens[i] tokens, whose K/V are already in the cache (in q's
    dtype, or fp8 e4m3fn read as fp8 * k_scale / v_scale). ``softcap`` > 0 soft-caps the scores;
    ``window`` > 0 lets a row at position p see keys p - window < k <= p only (the tiles wholly
    below every row's window are not read); ``chunk`` > 0 lets it see keys p // chunk * chunk <= k
    <= p only (Llama 4's chunked layers), likewise. ``sinks`` [num_heads] (fp32 or bf16; gpt-oss) adds
    exp(sinks[h]) to head h's softmax denominator: a logit that takes probability, gives no value.

    Capture-safe (no host syncs; the grid depends on shapes only). Returns
    [num_tokens, num_heads, head_dim] in q's dtype.
    """
    num_tokens, num_heads, head_dim = q.shape
    _, num_kv_heads, block_size, _ = k_cache.shape
    num_seqs = seq_lens.shape[0]
    block_tables, seq_lens, query_start_loc, out = check_paged_attention_args(
        q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, out, k_scale, v_scale
    )
    check_sinks(sinks, num_heads, q.device)
    window = check_window(window, chunk)
    if num_seqs == 0 or num_tokens == 0:
        return out

    group = num_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    cfg = KernelConfig.coerce(config) or default_config(group, head_dim)
    if cfg.params.get("STAGE") and k_cache.dtype == torch.float8_e4m3fn and num_seqs <= STAGE_MAX_SEQS:
        k_cache, v_cache, block_tables = stage_cache(k_cache, v_cache, block_tables, seq_lens, stage_dtype(q.dtype))
    block_m = max(cfg["BLOCK_M"], group_pad, 16)
    block_q = block_m // group_pad
    head_dim_pad = max(16, triton.next_power_of_2(head_dim))
    grid = (num_tokens // block_q + num_seqs, num_kv_heads)
    _paged_prefill_kernel[grid](
        q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, out, sinks if sinks is not None else q,
        scale * k_scale * _LOG2E, v_scale, softcap * _LOG2E, window, num_seqs,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        GROUP=group, GROUP_PAD=group_pad, HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad,
        BLOCK_SIZE=block_size, BLOCK_M=block_m, BLOCK_N=cfg["BLOCK_N"],
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        SOFTCAP=softcap > 0, SLIDING=window > 0, HAS_SINKS=sinks is not None, CHUNKED=chunk > 0,
        HEAVY_FIRST=bool(cfg.params.get("HEAVY_FIRST", 0)), FOLD_SCALE=bool(cfg.params.get("FOLD_SCALE", 0)),
        PREFETCH_BLOCKS=bool(cfg.params.get("PREFETCH_BLOCKS", 0)),
        LAZY_RESCALE=bool(cfg.params.get("LAZY_RESCALE", 0)),
        # inline PTX: not in the interpreter (CPU tensors), nor for fp32 engines (exact softmax)
        POLY_EXP2=bool(cfg.params.get("POLY_EXP2", 0)) and q.is_cuda and q.dtype != torch.float32,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return out
