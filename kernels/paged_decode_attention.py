"""Paged attention for decode: one new query token per sequence (flash-decoding).

Each program owns one (sequence, KV head, context split): it reads its slice of the
sequence's paged K/V once and serves every query head of that KV head's group with one
tl.dot (the group is padded to 16 rows, the smallest dot tile; decode is bound by the
K/V bytes, so the idle rows cost nothing measurable). When the context is split, each
program writes a normalised partial output and its log-sum-exp, and a second kernel
merges the splits (or, with the config's "merge", the last split of each sequence and KV head
to finish, found by a ticket as kernels/split_k.py's kernels find theirs). Every sequence's context is divided into the same number of splits,
so the grid depends on shapes only and the launch is safe to capture in a CUDA graph.

An fp8 (e4m3fn) cache halves the bytes read: K and V tiles are upcast in registers (exact:
every e4m3 value is a bf16/fp16 value) and both dots run with fp32 accumulation, in fp16 for
a bf16 engine (e4m3 converts to fp16 in one instruction per pair, to bf16 through fp32), in
q's dtype otherwise; no fp8 tl.dot, so q is never rounded to fp8. The per-layer K scale is
folded into the softmax scale and the V scale multiplies the normalised output.

The fp8 tiles are gathered as int32 words (four e4m3 bytes each) and unpacked in registers
(_e4m3_words_to_f16). Loaded as fp8 values, V (the second dot's [tokens, head_dim] operand, whose
reduction axis is not the contiguous one) is staged in shared memory in the swizzle Triton
derives for an 8-bit dot operand read transposed: 8 elements (8 bytes) per vector, so its
global-to-shared copies are 8-byte cp.async.ca instead of 16-byte cp.async.cg, and the dot reads
it back one byte per ld.shared (sm_90 has no 8-bit transposing ldmatrix). Words are no dot
operand: the pipeliner copies them with 16-byte cp.async.cg, and V's unpacked fp16 tile reaches
the dot through ldmatrix.trans, as a bf16 cache's does. Loading K the same way gives K and V one
register layout, so each tile's block-table entries are loaded and widened once for both.
benchmarks/decode_ptx.py counts the instructions (fp8 byte path: --fp8-bytes).

Which read is faster is measured, not derived: the word read sends each unpacked tile through
shared memory once more (ncu on an H200: shared memory at 69% of its throughput, the DRAM at
56%), the byte read converts K after its ldmatrix but reads V byte by byte. The tuner times both
(config key fp8_words); on two-warp programs the byte read won the large buckets (324.6 against
389.1 us at 256 sequences x 2048 tokens, benchmarks/RESULTS.md).

The pair read (fp8_words 2, FP8_PAIR_CONFIGS; in the tuner's space since it was timed on an H200,
below) reads K as the word read does and unpacks V straight into the PV dot's operand
registers (_e4m3_pairs_to_f16): an mma B register holds one head dim of two consecutive tokens,
so two prmt.b32 interleave two tokens' words byte by byte and cvt.rn.f16x2.e4m3x2 converts the
pairs, and the dot's columns are the head dims in an order in which every thread holds whole
words (the accumulator is put back in head-dim order after the loop). Triton 3.6 then keeps the
layout conversion on the int32 word tile: V crosses shared memory once, as the words the 16-byte
cp.async wrote, read back with 4- to 16-byte ld.shared into the mma's registers; no fp16 tile is
stored, no ldmatrix.trans, no byte loads. On sm_90 (benchmarks/decode_ptx.py --compare) its loop
has 1-12% fewer SASS instructions than the word read's and 20-31% fewer than the byte read's,
and a program needs the byte read's shared memory. The word tile is stored unswizzled (the
pipeliner picks its shared layout before the conversion is moved to it), so those loads are
4-way bank conflicted: by decode_ptx's model 256 wavefronts per 64 tokens for V, against the
word read's 448 (its word loads, fp16 stores and ldmatrix.trans).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from pagecast.kernels import pdl, split_k
from pagecast.kernels.paged_attention_args import check_paged_attention_args, check_sinks, check_window
from pagecast.kernels.tuning import KernelConfig, num_sms

_LOG2E = 1.4426950408889634


@triton.jit
def _e4m3_words_to_f16(w, USE_ASM: tl.constexpr):
    """[R, C] int32 words of four e4m3 bytes each -> [R, 4C] fp16: byte i (little-endian) of word
    c is column 4c + i. Exact (every e4m3 value is an fp16 value).

    On the GPU two cvt.rn.f16x2.e4m3x2 a word in inline PTX (what tl's fp8 -> fp16 conversion
    emits too); the interpreter, which has no PTX, takes the bytes apart with shifts and
    converts each through tl's fp8 type, which gives the same values."""
    if USE_ASM:
        b0, b1, b2, b3 = tl.inline_asm_elementwise(
            asm="""
            {
            .reg .b16 lo, hi;
            .reg .b32 h01, h23;
            mov.b32 {lo, hi}, $4;
            cvt.rn.f16x2.e4m3x2 h01, lo;
            cvt.rn.f16x2.e4m3x2 h23, hi;
            mov.b32 {$0, $1}, h01;
            mov.b32 {$2, $3}, h23;
            }
            """,
            constraints="=h,=h,=h,=h,r",
            args=[w],
            dtype=(tl.float16, tl.float16, tl.float16, tl.float16),
            is_pure=True,
            pack=1,
        )
    else:
        b0 = (w & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16)
        b1 = ((w >> 8) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16)
        b2 = ((w >> 16) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16)
        b3 = ((w >> 24) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16)
    # join puts its new axis last: join(join(b0, b2), join(b1, b3)) is [R, C, 2, 2] holding
    # b0, b1, b2, b3 in row-major order, so the reshape lays each word's bytes out in order.
    return tl.reshape(tl.join(tl.join(b0, b2), tl.join(b1, b3)), [w.shape[0], 4 * w.shape[1]])


@triton.jit
def _e4m3_pairs_to_f16(w, USE_ASM: tl.constexpr):
    """[R, C] int32 words of V (row n: four e4m3 bytes of token n) -> [R, 4C] fp16 with row n token n
    and the head dims in the PV dot's column order (pair_read_dims; _pair_read_to_dims undoes it).

    The mma B operand's 32-bit register holds two consecutive k values, here two tokens (2m, 2m + 1)
    of one head dim: on the GPU two prmt.b32 interleave the two tokens' words byte by byte (a0 b0 a1
    b1, a2 b2 a3 b3) and four cvt.rn.f16x2.e4m3x2 convert the pairs, in inline PTX whose 32-bit
    outputs are the pairs as Triton holds them (pack=2 over the joined words). The interpreter
    converts each byte through tl's fp8 type and joins the pair: the same values.

    The column order gives each thread of the dot operand whole words: a word's four head dims sit
    in the top two bits of the column index, which are register bits of every mma layout up to
    HEAD_DIM / 32 warps, so the layout conversion can stay on the int32 tile. The next two word
    bits go to the next column bits (registers on one warp, one of them on two), so a thread's
    words are 16 (8) contiguous bytes of a token row."""
    R: tl.constexpr = w.shape[0]
    C: tl.constexpr = w.shape[1]
    # a: the even tokens' words, b: the odd tokens', [R / 2, C] each
    a, b = tl.split(tl.permute(tl.reshape(w, [R // 2, 2, C]), (0, 2, 1)))
    if USE_ASM:
        d0, d1, d2, d3 = tl.inline_asm_elementwise(
            asm="""
            {
            .reg .b32 lo, hi;
            .reg .b16 l0, l1, h0, h1;
            prmt.b32 lo, $4, $5, 0x5140;
            prmt.b32 hi, $4, $5, 0x7362;
            mov.b32 {l0, l1}, lo;
            mov.b32 {h0, h1}, hi;
            cvt.rn.f16x2.e4m3x2 $0, l0;
            cvt.rn.f16x2.e4m3x2 $1, l1;
            cvt.rn.f16x2.e4m3x2 $2, h0;
            cvt.rn.f16x2.e4m3x2 $3, h1;
            }
            """,
            constraints="=r,=r,=r,=r,r,r",
            args=[tl.join(a, b)],
            dtype=(tl.float16, tl.float16, tl.float16, tl.float16),
            is_pure=True,
            pack=2,
        )
    else:
        d0 = tl.join(_e4m3_byte(a, 0), _e4m3_byte(b, 0))
        d1 = tl.join(_e4m3_byte(a, 8), _e4m3_byte(b, 8))
        d2 = tl.join(_e4m3_byte(a, 16), _e4m3_byte(b, 16))
        d3 = tl.join(_e4m3_byte(a, 24), _e4m3_byte(b, 24))
    # d_i: [R / 2, C, 2], head dim 4c + i of tokens (2m, 2m + 1). x: [m, c, j, i0, i1] (i = i0 + 2 i1)
    x = tl.join(tl.join(d0, d1), tl.join(d2, d3))
    # -> [m, j, i1, i0, c] = [R, 4, C]: row 2m + j; then c = 4 c_hi + 2 c1 + c0 -> (c0, c1, c_hi)
    v = tl.reshape(tl.permute(x, (0, 2, 4, 3, 1)), [R, 4, C // 4, 2, 2])
    return tl.reshape(tl.permute(v, (0, 1, 4, 3, 2)), [R, 4 * C])


@triton.jit
def _e4m3_byte(w, SHIFT: tl.constexpr):
    """Byte SHIFT / 8 of each int32 word as an e4m3 value, in fp16 (the interpreter's path)."""
    return ((w >> SHIFT) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16)


@triton.jit
def _pair_read_to_dims(acc):
    """The PV accumulator [G, D] from _e4m3_pairs_to_f16's column order back to head dims."""
    G: tl.constexpr = acc.shape[0]
    D: tl.constexpr = acc.shape[1]
    # column i D/4 + c0 D/8 + c1 D/16 + c_hi holds head dim 4 (4 c_hi + 2 c1 + c0) + i
    x = tl.reshape(acc, [G, 4, 2, 2, D // 16])  # [g, i, c0, c1, c_hi]
    return tl.reshape(tl.permute(x, (0, 4, 3, 2, 1)), [G, D])


def pair_read_dims(head_dim: int) -> list[int]:
    """The head dim at each column of the pair read's PV dot (fp8_words 2; _e4m3_pairs_to_f16)."""
    c = head_dim // 4
    return [
        4 * (4 * (k % (c // 4)) + 2 * ((k // (c // 4)) % 2) + (k // (c // 2)) % 2) + k // c
        for k in range(head_dim)
    ]


@triton.jit
def _soft_cap(s, cap):
    """cap * tanh(s / cap), tanh(x) = 1 - 2 / (exp(2x) + 1): exp overflowing to inf gives 1, so
    no clamp is needed. In the log2 domain the scores and the cap are both scaled by log2(e)."""
    return cap * (1.0 - 2.0 / (tl.exp(2.0 * s / cap) + 1.0))


@triton.jit(do_not_specialize=["num_splits", "stride_bt", "window"])
def _paged_decode_kernel(
    q_ptr,  # q: [num_tokens, num_heads, head_dim]
    k_cache_ptr,  # k_cache: [num_blocks, num_kv_heads, block_size, head_dim]
    v_cache_ptr,  # v_cache: [num_blocks, num_kv_heads, block_size, head_dim]
    block_tables_ptr,  # block_tables: [num_seqs, max_blocks] int32
    seq_lens_ptr,  # seq_lens: [num_seqs] int32
    query_start_loc_ptr,  # query_start_loc: [num_seqs + 1] int32
    out_ptr,  # out: [num_tokens, num_heads, head_dim]
    part_out_ptr,  # part_out: [num_seqs, num_heads, num_splits, HEAD_DIM_PAD] fp32
    part_lse_ptr,  # part_lse: [num_seqs, num_heads, num_splits] fp32 (log2 domain)
    sinks_ptr,  # sinks: [num_heads] fp32/bf16 (HAS_SINKS; read here only when DIRECT or MERGE)
    count_ptr,  # int32 [num_seqs * num_kv_heads] (MERGE): splits finished, 0 between launches
    qk_scale,  # softmax scale * k_scale * log2(e)
    v_scale,  # V's dequantisation scale (fp8 cache; 1.0 otherwise)
    softcap,  # logit soft-cap * log2(e) (SOFTCAP): scores -> cap * tanh(scores / cap)
    window,  # sliding window (SLIDING): the query at seq_len - 1 sees keys >= seq_len - window;
    #          CHUNKED: the attention chunk's size, the query sees keys of its own chunk only
    num_splits,
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
    BLOCK_N: tl.constexpr,
    DIRECT: tl.constexpr,
    FP8_WORDS: tl.constexpr,  # fp8 cache read as int32 words (head_dim, strides multiples of 4); 2: V
    #                           unpacked by token pairs in the PV dot's column order (the pair read)
    USE_ASM: tl.constexpr,  # inline PTX for the fp8 unpacking (False in the interpreter)
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 engines (exact), "tf32" (ignored) for half types
    SOFTCAP: tl.constexpr = False,
    SLIDING: tl.constexpr = False,
    HAS_SINKS: tl.constexpr = False,
    MERGE: tl.constexpr = 0,  # > 0 (num_splits rounded up to a power of two): the last split of a
    #                            (sequence, KV head) merges the splits here
    PDL: tl.constexpr = False,  # launched with programmatic dependent launch (kernels/pdl.py)
    CHUNKED: tl.constexpr = False,  # with SLIDING: ``window`` is an attention chunk (Llama 4)
):
    if PDL:
        gdc_wait()  # before any memory access: the kernel before may still be running
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_heads = tl.num_programs(1) * GROUP

    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    # A padded batch slot (no query this step) has nothing to compute or merge.
    if q_len > 0:
        seq_len = tl.load(seq_lens_ptr + seq)
        if SLIDING:
            # only the tiles that hold the window's keys are read (and split among the programs)
            if CHUNKED:  # the query's chunk starts at the last multiple of the chunk size
                first_key = ((seq_len - 1) // window) * window
            else:
                first_key = tl.maximum(seq_len - window, 0)
            first_tile = first_key // BLOCK_N
        else:
            first_key = 0
            first_tile = 0
        num_tiles = tl.cdiv(seq_len, BLOCK_N) - first_tile
        tiles_per_split = tl.cdiv(num_tiles, num_splits)
        tile_lo = first_tile + split * tiles_per_split
        tile_hi = tl.minimum(tile_lo + tiles_per_split, first_tile + num_tiles)

        offs_g = tl.arange(0, GROUP_PAD)
        offs_d = tl.arange(0, HEAD_DIM_PAD)
        heads = kv_head * GROUP + offs_g
        if HEAD_DIM_PAD == HEAD_DIM:
            q_mask = (offs_g < GROUP)[:, None]
        else:
            q_mask = (offs_g < GROUP)[:, None] & (offs_d < HEAD_DIM)[None, :]
        q = tl.load(
            q_ptr + q_start.to(tl.int64) * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
            mask=q_mask,
            other=0.0,
        )

        if k_cache_ptr.dtype.element_ty == tl.float8e4nv and q_ptr.dtype.element_ty == tl.bfloat16:
            # fp8 cache of a bf16 engine: both dots in fp16, which e4m3 converts to in one
            # instruction per pair (bf16 has no such conversion: it goes through fp32). q and p
            # lose nothing: bf16 values in fp16's range are exact there, and p <= 1. An fp32
            # engine keeps fp32 (exact).
            q = q.to(tl.float16)
        m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], tl.float32)
        block_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
        if FP8_WORDS:
            # Four e4m3 values a word; the strides are multiples of 4 (the launcher checks).
            offs_w = tl.arange(0, HEAD_DIM_PAD // 4)
            k_base = k_cache_ptr.to(tl.pointer_type(tl.int32), bitcast=True) + kv_head * (stride_kh // 4)
            v_base = v_cache_ptr.to(tl.pointer_type(tl.int32), bitcast=True) + kv_head * (stride_vh // 4)
            k_base = k_base + offs_w[None, :]
            v_base = v_base + offs_w[None, :]
            stride_kb, stride_kt = stride_kb // 4, stride_kt // 4
            stride_vb, stride_vt = stride_vb // 4, stride_vt // 4
        else:
            k_base = k_cache_ptr + kv_head * stride_kh + offs_d[None, :]
            v_base = v_cache_ptr + kv_head * stride_vh + offs_d[None, :]
        for tile in range(tile_lo, tile_hi):
            offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
            n_mask = offs_n < seq_len
            if HEAD_DIM_PAD == HEAD_DIM:
                kv_mask = n_mask[:, None]
            else:
                kv_mask = n_mask[:, None] & (offs_d < HEAD_DIM)[None, :]
            if BLOCK_SIZE % BLOCK_N == 0:
                # the tile is consecutive rows of one cache block: one block id, affine slots
                first = tile * BLOCK_N
                block = tl.load(block_row + first // BLOCK_SIZE, mask=first < seq_len, other=0).to(tl.int64)
                slot = first % BLOCK_SIZE + tl.arange(0, BLOCK_N)
            else:
                block = tl.load(block_row + offs_n // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)[:, None]
                slot = offs_n % BLOCK_SIZE
            # k, v: [BLOCK_N, HEAD_DIM_PAD], rows gathered through the block table
            if FP8_WORDS:
                # [BLOCK_N, HEAD_DIM / 4] words -> [BLOCK_N, HEAD_DIM] fp16 (masked rows read 0)
                w_mask = n_mask[:, None]
                k_rows = block * stride_kb + slot[:, None] * stride_kt
                v_rows = block * stride_vb + slot[:, None] * stride_vt
                k = tl.load(k_base + k_rows, mask=w_mask, other=0)
                v = tl.load(v_base + v_rows, mask=w_mask, other=0)
                k = _e4m3_words_to_f16(k, USE_ASM)
                if FP8_WORDS == 2:
                    v = _e4m3_pairs_to_f16(v, USE_ASM)  # head dims permuted (undone after the loop)
                else:
                    v = _e4m3_words_to_f16(v, USE_ASM)
            else:
                k = tl.load(k_base + block * stride_kb + slot[:, None] * stride_kt, mask=kv_mask, other=0.0)
                v = tl.load(v_base + block * stride_vb + slot[:, None] * stride_vt, mask=kv_mask, other=0.0)
            k = k.to(q.dtype)  # fp8 cache: upcast in registers (a no-op for a cache in q's dtype)
            v = v.to(q.dtype)
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [GROUP_PAD, BLOCK_N]
            if SOFTCAP:
                s = _soft_cap(s, softcap)
            if SLIDING:
                s = tl.where((n_mask & (offs_n >= first_key))[None, :], s, float("-inf"))
            else:
                s = tl.where(n_mask[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
            m_i = m_new

        if FP8_WORDS == 2:
            acc = _pair_read_to_dims(acc)
        # l_i is 0 only for an empty split or an empty context: write 0 / -inf, never NaN.
        has = l_i > 0.0
        if HAS_SINKS and DIRECT:
            # The whole context is this program's: its head's sink joins the denominator here (a
            # split context adds it once, in the merge). The sink is finite, so no row is empty.
            sink = tl.load(sinks_ptr + heads, mask=offs_g < GROUP, other=0.0).to(tl.float32) * 1.4426950408889634
            m_fin = tl.maximum(m_i, sink)
            alpha = tl.exp2(m_i - m_fin)
            o = acc * (alpha / (l_i * alpha + tl.exp2(sink - m_fin)))[:, None] * v_scale
        else:
            o = acc / tl.where(has, l_i, 1.0)[:, None] * v_scale
        if DIRECT:
            tl.store(
                out_ptr + q_start.to(tl.int64) * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
                o.to(out_ptr.dtype.element_ty),
                mask=q_mask,
            )
        else:
            lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
            part = (seq.to(tl.int64) * num_heads + heads) * num_splits + split  # [GROUP_PAD]
            g_mask = offs_g < GROUP
            tl.store(part_lse_ptr + part, lse, mask=g_mask)
            tl.store(part_out_ptr + part[:, None] * HEAD_DIM_PAD + offs_d[None, :], o, mask=g_mask[:, None])
            if MERGE:
                # The split drawing the last ticket of its (sequence, KV head) merges every split's
                # partials for the group's heads, as _decode_merge_kernel does, and sets the
                # counter back to 0: no second launch (kernels/split_k.py for the ordering).
                counter = count_ptr + seq * tl.num_programs(1) + kv_head
                if split_k.last_to_arrive(counter, num_splits):
                    # Every load below is independent of the others (all splits' log-sum-exps in
                    # one, each split's output unrolled), so their L2 round trips overlap: a loop
                    # over the splits that loads, then adds, costs one round trip a split.
                    base = (seq.to(tl.int64) * num_heads + heads) * num_splits  # [GROUP_PAD]
                    offs_s = tl.arange(0, MERGE)
                    lse_all = tl.load(part_lse_ptr + base[:, None] + offs_s[None, :],
                                      mask=g_mask[:, None] & (offs_s < num_splits)[None, :], other=float("-inf"),
                                      cache_modifier=".cg")  # fmt: skip  # .cg: from L2, where the partials are
                    lse_top = tl.max(lse_all, axis=1)
                    if HAS_SINKS:
                        sink_m = tl.load(sinks_ptr + heads, mask=g_mask, other=0.0).to(tl.float32) * 1.4426950408889634
                        lse_top = tl.maximum(lse_top, sink_m)
                    # all splits empty (an empty context): weights are 0, the output is 0
                    lse_ref = tl.where(lse_top == float("-inf"), 0.0, lse_top)
                    w_all = tl.exp2(lse_all - lse_ref[:, None])  # [GROUP_PAD, MERGE]; 0 past num_splits
                    total = tl.sum(w_all, axis=1)
                    if HAS_SINKS:
                        total += tl.exp2(sink_m - lse_ref)
                    merged = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], tl.float32)
                    for s in tl.static_range(MERGE):
                        o_s = tl.load(part_out_ptr + (base + s)[:, None] * HEAD_DIM_PAD + offs_d[None, :],
                                      mask=g_mask[:, None] & (s < num_splits), other=0.0, cache_modifier=".cg")  # fmt: skip
                        w_s = tl.sum(tl.where(offs_s[None, :] == s, w_all, 0.0), axis=1)
                        merged += w_s[:, None] * o_s
                    merged = merged / tl.where(total > 0.0, total, 1.0)[:, None]
                    tl.store(
                        out_ptr + q_start.to(tl.int64) * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
                        merged.to(out_ptr.dtype.element_ty),
                        mask=q_mask,
                    )
                    split_k.reset(counter)


@triton.jit(do_not_specialize=["num_splits"])
def _decode_merge_kernel(
    part_out_ptr,  # part_out: [num_seqs, num_heads, num_splits, HEAD_DIM_PAD] fp32
    part_lse_ptr,  # part_lse: [num_seqs, num_heads, num_splits] fp32 (log2 domain)
    query_start_loc_ptr,  # query_start_loc: [num_seqs + 1] int32
    out_ptr,  # out: [num_tokens, num_heads, head_dim]
    sinks_ptr,  # sinks: [num_heads] fp32/bf16 (HAS_SINKS)
    num_splits,
    stride_ot,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    SPLIT_CHUNK: tl.constexpr,
    HAS_SINKS: tl.constexpr = False,
    PDL: tl.constexpr = False,  # launched with programmatic dependent launch (kernels/pdl.py)
):
    if PDL:
        gdc_wait()  # before any memory access: the kernel before may still be running
    seq = tl.program_id(0)
    head = tl.program_id(1)
    num_heads = tl.num_programs(1)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if q_len > 0:
        base = (seq.to(tl.int64) * num_heads + head) * num_splits
        offs_s = tl.arange(0, SPLIT_CHUNK)
        offs_d = tl.arange(0, HEAD_DIM_PAD)
        lse_max = tl.full([SPLIT_CHUNK], float("-inf"), tl.float32)
        for s0 in range(0, num_splits, SPLIT_CHUNK):
            lse = tl.load(
                part_lse_ptr + base + s0 + offs_s, mask=s0 + offs_s < num_splits, other=float("-inf")
            )
            lse_max = tl.maximum(lse_max, lse)
        lse_top = tl.max(lse_max, 0)
        if HAS_SINKS:
            # The sink is one more term of the log-sum-exp over the splits, with no value: it
            # enters the denominator once per (sequence, head), here.
            sink = tl.load(sinks_ptr + head).to(tl.float32) * 1.4426950408889634
            lse_top = tl.maximum(lse_top, sink)
        # all splits empty (an empty context): weights are 0, the output is 0
        lse_ref = tl.where(lse_top == float("-inf"), 0.0, lse_top)
        acc = tl.zeros([HEAD_DIM_PAD], tl.float32)
        denom = tl.zeros([SPLIT_CHUNK], tl.float32)
        for s0 in range(0, num_splits, SPLIT_CHUNK):
            s_mask = s0 + offs_s < num_splits
            lse = tl.load(part_lse_ptr + base + s0 + offs_s, mask=s_mask, other=float("-inf"))
            w = tl.exp2(lse - lse_ref)  # [SPLIT_CHUNK]
            o = tl.load(
                part_out_ptr + (base + s0 + offs_s)[:, None] * HEAD_DIM_PAD + offs_d[None, :],
                mask=s_mask[:, None],
                other=0.0,
            )
            acc += tl.sum(w[:, None] * o, 0)
            denom += w
        total = tl.sum(denom, 0)
        if HAS_SINKS:
            total += tl.exp2(sink - lse_ref)
        out = acc / tl.where(total > 0.0, total, 1.0)
        tl.store(
            out_ptr + q_start.to(tl.int64) * stride_ot + head * stride_oh + offs_d,
            out.to(out_ptr.dtype.element_ty),
            mask=offs_d < HEAD_DIM,
        )


# Kernel variants (tile of context tokens, warps, pipeline depth); num_splits is a launch
# argument, so it costs no compilation.
_VARIANTS = [
    (64, 4, 2),
    (32, 4, 2),
    (64, 4, 3),
    (128, 4, 2),
    (128, 8, 2),
    (64, 8, 3),
    (32, 2, 3),
    (128, 8, 3),
]
_SPLITS = (1, 2, 4, 8, 16, 32, 64)
# An fp8 cache's programs do twice the per-byte work (each e4m3 value unpacked), so one or a few
# long sequences want more of them in flight: on an H200 (block size 128, 2026-12-04,
# benchmarks/decode_fp8_time.py --more-splits) one sequence of 128k read fastest at 128 splits of
# one-warp pair-read programs, 82.0 us against 89.4 at 64 (the bf16 cache's best stayed at 32).
_FP8_SPLITS = (*_SPLITS, 128)
MAX_SPLITS = _FP8_SPLITS[-1]

CONFIG_SPACE: list[KernelConfig] = [
    KernelConfig({"BLOCK_N": n, "num_splits": s}, num_warps=w, num_stages=st)
    for s in _SPLITS
    for (n, w, st) in _VARIANTS
]
# An fp8 cache times (tile, warps, stages, fp8_words) variants of its own: the pair read
# (fp8_words 2, see the module docstring), the word read (1, the default outside the tuner) and
# the byte read (0). On an H200 (benchmarks/decode_fp8_time.py, benchmarks/RESULTS.md, ninth
# session) the pair read's best, 64 tokens on one warp at two stages, beat the best word or byte
# read at every size timed: 412.4 against 464.6 us at 1024 sequences x 768 tokens, 278.6 / 315.6
# at 512 x 1024, 271.5 / 327.3 at 256 x 2048, 41.7 / 48.9 at 128 x 512. The bf16 cache's tiles
# (CONFIG_SPACE, read as words) lost to these everywhere and are not timed for fp8.
_FP8_PAIR_VARIANTS = [
    (32, 1, 2),
    (32, 1, 3),
    (64, 1, 2),
    (32, 2, 3),
    (64, 2, 2),
    (64, 2, 3),
    (64, 4, 3),
    (128, 4, 2),
]
# The one-warp programs (more of them resident per multiprocessor) won at 128 x 512, 512 x 1024
# and 1024 x 768 among the word and byte reads (eighth session).
_FP8_VARIANTS = [(n, w, st, 2) for (n, w, st) in _FP8_PAIR_VARIANTS] + [
    (64, 2, 2, 1),
    (64, 2, 2, 0),
    (64, 2, 3, 0),
    (128, 4, 3, 0),
    (64, 4, 3, 0),
    (32, 1, 3, 0),
    (32, 1, 2, 1),
    (64, 2, 4, 0),
    (128, 2, 3, 0),
]
FP8_CONFIG_SPACE: list[KernelConfig] = [
    KernelConfig({"BLOCK_N": n, "num_splits": s, "fp8_words": fw}, num_warps=w, num_stages=st)
    for s in _FP8_SPLITS
    for (n, w, st, fw) in _FP8_VARIANTS
]
FP8_PAIR_CONFIGS: list[KernelConfig] = [c for c in FP8_CONFIG_SPACE if c["fp8_words"] == 2]

# The merge inside the attention launch ("merge": 1): the last split of each (sequence, KV head),
# found by a ticket, merges the splits, so a split context costs one launch, not two. At one
# sequence the merge kernel was 2.5 us of a 6.3 us attention a layer (Qwen3-30B-A3B W4 on the
# H200, twenty-fifth session), most of it a launch's ramp and drain. Timed only at small batches
# (MERGE_MAX_SEQS), where the step is a chain of latency-bound launches; at large ones the merge
# kernel is a small share and the last splits' serial merges would trail the launch.
MERGE_MAX_SEQS = 8
MERGE_MAX_SPLITS = 16  # the merge's loads are unrolled over the splits


def _merging(configs: list[KernelConfig]) -> list[KernelConfig]:
    """The split configs of ``configs`` (up to MERGE_MAX_SPLITS) with the merge in the launch."""
    return [
        KernelConfig({**c.params, "merge": 1}, num_warps=c.num_warps, num_stages=c.num_stages)
        for c in configs
        if 1 < c["num_splits"] <= MERGE_MAX_SPLITS
    ]


MERGE_CONFIGS = _merging(CONFIG_SPACE)
FP8_MERGE_CONFIGS = _merging(FP8_PAIR_CONFIGS)
CONFIG_SPACE = CONFIG_SPACE + MERGE_CONFIGS
FP8_CONFIG_SPACE = FP8_CONFIG_SPACE + FP8_MERGE_CONFIGS


def prune_configs(
    configs: list[KernelConfig], num_seqs: int, max_seq_len: int, num_kv_heads: int, sms: int
) -> list[KernelConfig]:
    """Drop configs that cannot win: splits with no tile to read, or far more programs than SMs.

    Splitting also evens out the last wave of programs, so split counts up to ~32 programs
    per multiprocessor stay in; 1 (no merge kernel) is always kept. The in-launch merge is
    timed only up to MERGE_MAX_SEQS sequences.
    """
    kept = []
    for cfg in configs:
        s, n = cfg["num_splits"], cfg["BLOCK_N"]
        if cfg.params.get("merge", 0) and num_seqs > MERGE_MAX_SEQS:
            continue
        if s == 1 or (s <= triton.cdiv(max_seq_len, n) and num_seqs * num_kv_heads * s <= 32 * sms):
            kept.append(cfg)
    return kept


def default_config(
    num_seqs: int, max_seq_len: int, num_kv_heads: int, sms: int | None = None
) -> KernelConfig:
    """A config for a shape bucket the tuning table lacks: split until about 2 programs per SM."""
    sms = sms or num_sms()
    block_n = 64
    programs = max(1, num_seqs * num_kv_heads)
    splits = 1
    max_useful = max(1, triton.cdiv(max_seq_len, 4 * block_n))  # at least 4 tiles per split
    while splits < _SPLITS[-1] and programs * splits < 2 * sms and splits * 2 <= max_useful:
        splits *= 2
    return KernelConfig({"BLOCK_N": block_n, "num_splits": splits}, num_warps=4, num_stages=2)


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    max_seq_len: int,
    config: Mapping[str, int] | None = None,
    out: torch.Tensor | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    softcap: float = 0.0,
    window: int = 0,
    sinks: torch.Tensor | None = None,
    chunk: int = 0,
) -> torch.Tensor:
    """Attention of each sequence's single new token over its paged context.

    Sequence i's query row is q[query_start_loc[i]] (a sequence with no query row is skipped),
    its context the first seq_lens[i] tokens of its blocks. max_seq_len (an upper bound of
    seq_lens, known on the host) only sizes the split count. Capture-safe: no host syncs,
    allocations depend on shapes only. The caches are in q's dtype, or fp8 e4m3fn read as
    fp8 * k_scale / v_scale. ``softcap`` > 0 soft-caps the scores (Gemma 2); ``window`` > 0 sees
    only the last ``window`` keys (sliding-window layers), reading only their tiles; ``chunk`` > 0
    only the keys of the query's own ``chunk``-token chunk (Llama 4's chunked layers: positions
    p // chunk * chunk..p), likewise. ``sinks``
    [num_heads] (fp32 or bf16; gpt-oss) adds exp(sinks[h]) to head h's softmax denominator, once
    per sequence: in the merge of a split context, in the one program's output otherwise. Returns
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

    cfg = KernelConfig.coerce(config) or default_config(num_seqs, max_seq_len, num_kv_heads)
    block_n = cfg["BLOCK_N"]
    num_splits = max(1, min(int(cfg["num_splits"]), MAX_SPLITS))
    group = num_heads // num_kv_heads
    group_pad = max(16, triton.next_power_of_2(group))
    head_dim_pad = max(16, triton.next_power_of_2(head_dim))
    direct = num_splits == 1
    # An fp8 cache is read as int32 words when its rows split into whole words (see the module
    # docstring) and the config does not ask for the byte read; otherwise (the config's choice,
    # an odd head_dim, a strided view) as bytes. fp8_words 2 (the pair read) is the
    # word read with V unpacked by token pairs, where words can be read.
    read = int(cfg.params.get("fp8_words", 1))
    fp8_words = (
        k_cache.dtype == torch.float8_e4m3fn
        and bool(read)
        and head_dim == head_dim_pad
        and all(t.data_ptr() % 4 == 0 and all(s % 4 == 0 for s in t.stride()[:3]) for t in (k_cache, v_cache))
    )
    if fp8_words and read == 2:
        fp8_words = 2
    merge = not direct and bool(cfg.params.get("merge", 0)) and num_splits <= MERGE_MAX_SPLITS
    counters = seq_lens  # unread without MERGE
    if merge:
        if split_k.available(q.device, num_seqs * num_kv_heads):
            counters = split_k.counters(q.device, num_seqs * num_kv_heads, "paged_decode_attention")
        else:
            merge = False  # the counters cannot grow inside a capture: the merge kernel instead
    if direct:
        part_out = part_lse = out  # unused by the DIRECT variant
    else:
        part_out = torch.empty(
            (num_seqs, num_heads, num_splits, head_dim_pad), dtype=torch.float32, device=q.device
        )
        part_lse = torch.empty((num_seqs, num_heads, num_splits), dtype=torch.float32, device=q.device)
    has_sinks = sinks is not None
    sinks_arg = sinks if sinks is not None else q  # unread without HAS_SINKS
    _paged_decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, out, part_out, part_lse, sinks_arg, counters,
        scale * k_scale * _LOG2E, v_scale, softcap * _LOG2E, window, num_splits,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        GROUP=group, GROUP_PAD=group_pad, HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad,
        BLOCK_SIZE=block_size, BLOCK_N=block_n, DIRECT=direct, FP8_WORDS=fp8_words,
        USE_ASM=q.is_cuda and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"),
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        SOFTCAP=softcap > 0, SLIDING=window > 0, HAS_SINKS=has_sinks, CHUNKED=chunk > 0,
        MERGE=triton.next_power_of_2(num_splits) if merge else 0,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl.launch_options(),
    )  # fmt: skip
    if not direct and not merge:
        _decode_merge_kernel[(num_seqs, num_heads)](
            part_out, part_lse, query_start_loc, out, sinks_arg, num_splits, out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, SPLIT_CHUNK=16, HAS_SINKS=has_sinks, num_warps=4,
            **pdl.launch_options(),
        )  # fmt: skip
    return out
