"""FP8 GEMM (W8A8, OCP e4m3): y = (quant(x) @ W.T) * scales (+ b), fp32 accumulation.

The weight is in the artifact layout ``builder/fp8.py`` writes:

    weight        float8_e4m3fn [N, K]
    weight_scale  float32 [N]        per output channel, or
                  float32 [N, KB]    per output row and 128-column block (KB = ceil(K / 128))
    input_scale   float32 [1]        static activations only

Unless a SKINNY config fuses it (below), the activations are quantised first
(``quantize_activations``, one launch): per token (scale = row amax / 448), per 1x128 group (block
weights), or with the static ``input_scale``; e4m3 values saturated to +-448, rounded to nearest
even. Then one program owns a [BLOCK_M, BLOCK_N] tile of
y and walks its share of K in BLOCK_K steps. Each step's ``tl.dot`` starts from zero and is added
into the fp32 accumulator (Hopper's fp8 wgmma accumulates in reduced precision; a fresh dot per
step promotes every BLOCK_K, as ``max_num_imprecise_acc`` would). Per-channel scaling applies
x_scale[m] * w_scale[n] once in the epilogue; block scaling applies x_scale[m, kb] *
w_scale[n, kb] to each step's product (BLOCK_K divides 128, so a step lies in one block).
Decode batches split K over SPLIT_K programs writing fp32 partials that one sum reduces
(deterministic).

Up to 16 rows, a ``{"SKINNY": 1, ...}`` config runs all of that as one launch instead
(``_fp8_skinny_kernel``, ``fp8_skinny_linear``): the extra launches per projection (the
quantisation, split-K partials, their sum, the bias and the cast) were an estimated 0.5-1 ms of
Llama-3-8B's 3.9 ms batch-1 decode step on an H200 (issue 29). Each program owns BLOCK_N output
columns for every row and quantises the activations itself with the quantisation kernel's
arithmetic (amax in fp32; max(amax, 1e-12) / 448 and x / scale, each div_rn; clamp, e4m3): per
token, a first pass over K for each row's amax (x is a few KB and stays in L2), static scales skip
it. tl.dot needs 16
rows; with ROWS = next_power_of_2(M) <= 8 the 16 rows of the quantised tile hold the real rows
for 16 / ROWS consecutive K steps, so each activation is divided once per program rather than
once per padding row: every step dots that tile with its [BLOCK_K, BLOCK_N] weight tile, keeps
the product of its own tile rows (a fresh dot per step, added in fp32 as above), and the rows
of the chunks are summed at the end. Block-scaled weights take BLOCK_K 128, so a tile row is
one 1x128 activation group whose scale comes from the tile itself and is applied, with the
weight's, to the step's product. No torch ops after.

The RMSNorm that makes a projection's input (qkv, gate_up: ops.norm_linear) runs inside that
kernel too (``fp8_skinny_norm_linear``, NORM 1, or NORM 2 with the residual add): its first pass
over x, which takes the amax, also sums each row's squares of the stream s (x + residual, added in
fp32 and rounded to x's dtype, as fused_add_rms_norm stores it; program (0, 0) stores it) and takes
the amax of s * g, g the norm's weight. rstd = rsqrt(mean + eps) scales every value of a row alike
and fp32 rounding keeps order, so rstd times that amax is exactly the amax of the normalised row
(s * g) * rstd, which the quantising steps form. The normalised row is not rounded to x's dtype
first, as rms_norm's output is (``reference.fp8_norm_linear`` is the definition). One launch a
layer's norm fewer at decode.

Narrow projections give that kernel too few programs (N = 4096 in column blocks of 32: 128 on an
H200's 132 multiprocessors, each reading all of K; o_proj streamed 1.65 TB/s of weight at one row
against 3.45 at gate_up's 28,672 columns), so a SKINNY config may also split K:
``{"SKINNY": 1, ..., "SPLIT_K": s}`` launches a (column blocks, s) grid, still one launch. Every
program computes the per-token scales over the whole row (the same scales as unsplit), quantises
and dots only its split's K steps (ceil(steps / s) each; the launcher runs fewer splits where the
last would have none, the kernel also takes an empty one), and stores its unscaled fp32 [ROWS,
BLOCK_N] partial to a [s, M, N] workspace (torch.empty per call: the caching allocator, no host
sync, a graph's own pool inside a capture). Then the reduction, in the same launch: a CTA barrier
(every thread's partial stored), one atomic add on the column block's counter, acq_rel at GPU scope
(releases the program's partial, acquires the earlier ones'); the program drawing ticket s - 1 is
the last, adds the partials in split order 0..s-1 (.cg loads, from L2) - the same sum whichever
program finishes last, so the result is deterministic - applies the scales, bias and cast, stores
y and sets the counter back to 0. The counters are one int32 buffer per device (zero-initialised,
grown only outside CUDA-graph capture, outgrown buffers kept for graphs that hold them) shared by
all split launches: launches on one stream run one after another, so each finds them zero; launches
on concurrent streams of one device would need counters of their own (the engine runs one stream
a device).

The tuner (kernels/problems.py) times the tiles per projection and row bucket against
``torch._scaled_mm`` (rowwise scales, bf16 out: the ``{"scaled_mm": 1}`` config) and keeps the
fastest. ``reference.fp8_linear`` is the definition the kernels are tested against.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from pagecast.kernels import pdl, reference, split_k
from pagecast.kernels.gated import ACT_CODES, gated_apply, gated_load
from pagecast.kernels.tuning import KernelConfig

FP8_MAX = reference.FP8_MAX
GROUP = reference.FP8_GROUP
SCALED_MM = KernelConfig({"scaled_mm": 1}, num_warps=0, num_stages=0)  # torch._scaled_mm (cuBLASLt)
# The same with cuBLASLt's FP8 fast accumulation: Hopper's tensor cores accumulate the whole K in
# their own reduced precision instead of promoting to fp32 every few steps, as the leading engine's
# sm90 FP8 GEMMs do. On an H100 (forty-second session, benchmarks/fp8_fast_accum.py) it took
# 0.85-0.98x the time at Llama-3-8B's projections from 512 rows (1.07x at down's 8,192) for
# 2.1e-3 (K 4,096) and 3.3e-3 (K 14,336) relative error against the exact fp32 sum, where the
# default's is bf16's rounding alone (1.7e-3): a tenth of what the e4m3 rounding of the weights
# and activations costs. The untuned choice from 64 rows; the tuner keeps whichever is faster.
SCALED_MM_FAST = KernelConfig({"scaled_mm": 1, "fast_accum": 1}, num_warps=0, num_stages=0)
# PAGECAST_FP8_FAST_ACCUM=0 in a serving process runs every torch._scaled_mm config with the
# promoted accumulation, for the same-artifact comparison.
FAST_ACCUM = os.environ.get("PAGECAST_FP8_FAST_ACCUM", "1") != "0"


# ---------------------------------------------------------------------------- activation quantisation


@triton.jit
def _quant_act_kernel(
    x_ptr,  # [M, K] half / fp32
    q_ptr,  # float8e4nv [M, K]
    s_ptr,  # fp32 [M] (token), [M, KB] (group) or the static [1] (read)
    K,
    stride_xm,
    MODE: tl.constexpr,  # 0 token, 1 group of GROUP_K, 2 static
    GROUP_K: tl.constexpr,
    BLOCK: tl.constexpr,
    NUM_BLOCKS: tl.constexpr,  # cdiv(K, BLOCK): a constant of the projection
    MIN_AMAX: tl.constexpr,
    QMAX: tl.constexpr,
):
    row = tl.program_id(0)
    x_row = x_ptr + row.to(tl.int64) * stride_xm
    q_row = q_ptr + row.to(tl.int64) * K
    if MODE == 1:
        g = tl.program_id(1)
        offs = g * GROUP_K + tl.arange(0, GROUP_K)
        ok = offs < K
        x = tl.load(x_row + offs, mask=ok, other=0.0).to(tl.float32)
        scale = _scale_of(tl.max(tl.abs(x), axis=0), MIN_AMAX, QMAX)
        tl.store(q_row + offs, _quantise_rows(x, scale, QMAX, q_ptr.dtype.element_ty), mask=ok)
        tl.store(s_ptr + row.to(tl.int64) * tl.cdiv(K, GROUP_K) + g, scale)
    else:
        if MODE == 2:
            scale = tl.load(s_ptr).to(tl.float32)
        else:
            amax = tl.zeros((BLOCK,), dtype=tl.float32)
            for i in range(NUM_BLOCKS):
                offs = i * BLOCK + tl.arange(0, BLOCK)
                x = tl.load(x_row + offs, mask=offs < K, other=0.0).to(tl.float32)
                amax = tl.maximum(amax, tl.abs(x))
            scale = _scale_of(tl.max(amax, axis=0), MIN_AMAX, QMAX)
            tl.store(s_ptr + row, scale)
        for i in range(NUM_BLOCKS):
            offs = i * BLOCK + tl.arange(0, BLOCK)
            ok = offs < K
            x = tl.load(x_row + offs, mask=ok, other=0.0).to(tl.float32)
            tl.store(q_row + offs, _quantise_rows(x, scale, QMAX, q_ptr.dtype.element_ty), mask=ok)


def quantize_activations(
    x: torch.Tensor, activations: str, input_scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 [M, K], fp32 scales [M] / [M, KB] / [1]) as ``reference.quantize_fp8_activations``."""
    m, k = x.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    q = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=x.device)
    if activations == "group":
        s = torch.empty((m, triton.cdiv(k, GROUP)), dtype=torch.float32, device=x.device)
        grid: tuple[int, ...] = (m, s.shape[1])
        mode = 1
    elif activations == "token":
        s = torch.empty((m,), dtype=torch.float32, device=x.device)
        grid, mode = (m,), 0
    elif activations == "static":
        assert input_scale is not None
        s = input_scale.float().reshape(1)
        grid, mode = (m,), 2
    else:
        raise ValueError(f"unknown fp8 activation scheme {activations!r}")
    if m:
        block = min(1024, triton.next_power_of_2(k))
        _quant_act_kernel[grid](
            x, q, s, k, x.stride(0), MODE=mode, GROUP_K=GROUP, BLOCK=block, NUM_BLOCKS=triton.cdiv(k, block),
            MIN_AMAX=reference.FP8_MIN_AMAX, QMAX=FP8_MAX, num_warps=4,
        )  # fmt: skip
    return q, s


# ---------------------------------------------------------------------------- the GEMM


@triton.jit
def _fp8_gemm_kernel(
    a_ptr,  # e4m3 [M, K]
    b_ptr,  # e4m3 [N, K] (the weight, K contiguous)
    as_ptr,  # fp32 [M] / [1] (channel) or [M, KB] (block)
    bs_ptr,  # fp32 [N] (channel) or [N, KB] (block)
    bias_ptr,  # [N] or unused
    y_ptr,  # [M, N] (SPLIT_K == 1) or fp32 partials [SPLIT_K, M, N]
    M,
    N,
    K,
    stride_ys,
    BLOCK_SCALED: tl.constexpr,
    STATIC_A: tl.constexpr,  # one activation scale (static) instead of one per row
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    K_ITERS: tl.constexpr,
    GROUP_K: tl.constexpr,
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
    num_kb = tl.cdiv(K, GROUP_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_begin = pid_k * (K_ITERS * BLOCK_K)
    for i in range(K_ITERS):
        k0 = k_begin + i * BLOCK_K
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        a = tl.load(a_ptr + offs_m[:, None].to(tl.int64) * K + offs_k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptr + offs_n[None, :].to(tl.int64) * K + offs_k[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        part = tl.dot(a, b)  # [BLOCK_M, BLOCK_N] fp32, promoted into acc every step
        if BLOCK_SCALED:
            kb = k0 // GROUP_K
            kb_ok = kb < num_kb
            sa = tl.load(as_ptr + offs_m.to(tl.int64) * num_kb + kb, mask=m_ok & kb_ok, other=0.0)
            sb = tl.load(bs_ptr + offs_n.to(tl.int64) * num_kb + kb, mask=n_ok & kb_ok, other=0.0)
            acc += part * sa[:, None] * sb[None, :]
        else:
            acc += part
    if not BLOCK_SCALED:
        if STATIC_A:
            sa = tl.load(as_ptr + offs_m * 0)
        else:
            sa = tl.load(as_ptr + offs_m, mask=m_ok, other=0.0)
        sb = tl.load(bs_ptr + offs_n, mask=n_ok, other=0.0)
        acc = acc * sa[:, None] * sb[None, :]
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        y_ptrs = y_ptr + offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])
    else:
        y_ptrs = y_ptr + pid_k * stride_ys + offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
        tl.store(y_ptrs, acc, mask=m_ok[:, None] & n_ok[None, :])


# ---------------------------------------------------------------------------- the fused decode path


@triton.jit
def _quantise_rows(x, scale, QMAX: tl.constexpr, dtype: tl.constexpr):
    """x / scale saturated to +-QMAX and rounded to nearest even: _quant_act_kernel's arithmetic."""
    return tl.clamp(tl.math.div_rn(x, scale), -QMAX, QMAX).to(dtype)


@triton.jit
def _scale_of(amax, MIN_AMAX: tl.constexpr, QMAX: tl.constexpr):
    """The dynamic scale of values whose largest magnitude is ``amax``: max(amax, MIN_AMAX) / QMAX,
    divided exactly (reference._amax_scale)."""
    return tl.math.div_rn(tl.maximum(amax, MIN_AMAX), QMAX)


@triton.jit
def _skinny_load(x_rows, r_rows, offs_k, mask, K, NORM: tl.constexpr, ACT: tl.constexpr):
    """The loads of the fused kernel's input at ``offs_k``, as a pair for _skinny_combine: (x, x); with
    NORM 2 (x, residual); with ACT >= 0 x's rows' (gate, up). Apart, so that a loop can issue the
    next step's loads before it waits on this step's."""
    if ACT >= 0:
        return gated_load(x_rows, offs_k, mask, K)
    x = tl.load(x_rows + offs_k, mask=mask, other=0.0)
    if NORM == 2:
        return x, tl.load(r_rows + offs_k, mask=mask, other=0.0)
    return x, x


@triton.jit
def _skinny_combine(a, b, NORM: tl.constexpr, ACT: tl.constexpr):
    """The fused kernel's input in x's dtype from _skinny_load's pair: x; with NORM 2 x + residual
    (added in fp32 and rounded, as rms_norm's fused add stores the stream); with ACT >= 0
    act(gate) * up rounded as silu_and_mul / gelu_tanh_and_mul store it (gated.gated_apply)."""
    if ACT >= 0:
        return gated_apply(a, b, ACT).to(a.dtype)
    if NORM == 2:
        return (a.to(tl.float32) + b.to(tl.float32)).to(a.dtype)
    return a


@triton.jit
def _skinny_input(x_rows, r_rows, offs_k, mask, K, NORM: tl.constexpr, ACT: tl.constexpr):
    """The fused kernel's input at ``offs_k`` in x's dtype (_skinny_combine of _skinny_load)."""
    a, b = _skinny_load(x_rows, r_rows, offs_k, mask, K, NORM, ACT)
    return _skinny_combine(a, b, NORM, ACT)


@triton.jit
def _skinny_store(
    y, rows_scale, offs_n, n_ok, ws_ptr, bias_ptr, y_ptr, M, N,
    MODE: tl.constexpr, HAS_BIAS: tl.constexpr, ROWS: tl.constexpr,
):  # fmt: skip
    """The fused kernel's epilogue: y [ROWS, BLOCK_N] (the fp32 sum over K) times the scales (per
    channel; block scales were applied per step), plus the bias, cast and stored."""
    if MODE != 1:
        sw = tl.load(ws_ptr + offs_n, mask=n_ok, other=0.0)
        if MODE == 0:
            y = y * rows_scale[:, None] * sw[None, :]
        else:
            y = y * rows_scale * sw[None, :]
    if HAS_BIAS:
        y += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    offs_r = tl.arange(0, ROWS)
    y_ptrs = y_ptr + offs_r[:, None].to(tl.int64) * N + offs_n[None, :]
    tl.store(y_ptrs, y.to(y_ptr.dtype.element_ty), mask=(offs_r < M)[:, None] & n_ok[None, :])


@triton.jit
def _fp8_skinny_kernel(
    x_ptr,  # [M, K] half / fp32, K contiguous
    w_ptr,  # e4m3 [N, K]
    ws_ptr,  # fp32 [N] (channel) or [N, KB] (block)
    xs_ptr,  # fp32 [1]: the static input scale (MODE 2), else unused
    bias_ptr,  # [N] or unused
    y_ptr,  # [M, N]
    part_ptr,  # fp32 [SPLIT_K, M, N]: each split's partial sums (SPLIT_K > 1), else unused
    count_ptr,  # int32 [>= cdiv(N, BLOCK_N)]: splits finished per column block, 0 between launches (SPLIT_K > 1)
    r_ptr,  # [M, K]: the residual stream x joins (NORM 2), else unused
    g_ptr,  # [K]: the RMSNorm weight (NORM > 0), else unused
    stream_ptr,  # [M, K], contiguous: x + residual, written by program (0, 0) (NORM 2), else unused
    M,
    N,
    K,
    stride_xm,
    stride_rm,
    STEPS,  # K steps per split (SPLIT_K > 1; the last split may have fewer, even none), else unused
    eps,  # the RMSNorm's epsilon (NORM > 0)
    MODE: tl.constexpr,  # 0 token, 1 group of GROUP_K (block weights, BLOCK_K == GROUP_K), 2 static
    HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr,  # K % BLOCK_K == 0: no K masks on the weight
    ROWS: tl.constexpr,  # next_power_of_2(M)
    BLOCK_M: tl.constexpr,  # 16 >= ROWS: the tensor cores' minimum
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,  # programs per column block, each over STEPS steps of K (grid axis 1)
    GROUP_K: tl.constexpr,
    MIN_AMAX: tl.constexpr,
    QMAX: tl.constexpr,
    NORM: tl.constexpr = 0,  # x is: 0 the input; 1 RMS-normalised first; 2 added to r_ptr's rows, then normalised
    ACT: tl.constexpr = -1,  # >= 0: x [M, 2K] holds (gate, up), the input is act(gate) * up (0 silu, 1 gelu_tanh)
    PDL: tl.constexpr = False,  # launched with programmatic dependent launch (kernels/pdl.py)
    PASS_AHEAD: tl.constexpr = False,  # the scale pass's loads a step ahead where they fit (below)
):
    if PDL:
        gdc_wait()  # before any memory access: the kernel before may still be running
    # The dot's 16 rows hold the ROWS rows of x for CHUNKS consecutive K steps: tile row c * ROWS + r
    # is x row r at step i + c. Those activations are quantised together once per CHUNKS steps, so
    # each activation is divided once per program, not once per padding row; step i + c's product
    # is kept from its own tile rows only, and the chunks' sums are added at the end.
    CHUNKS: tl.constexpr = BLOCK_M // ROWS
    pid = tl.program_id(0)
    offs_t = tl.arange(0, BLOCK_M)
    row = offs_t % ROWS
    chunk = offs_t // ROWS
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = row < M
    n_ok = offs_n < N
    x_rows = x_ptr + row[:, None].to(tl.int64) * stride_xm
    r_rows = r_ptr + row[:, None].to(tl.int64) * stride_rm
    w_cols = w_ptr + offs_n[None, :].to(tl.int64) * K  # [BLOCK_K, BLOCK_N] tiles: w.T
    num_steps = tl.cdiv(K, BLOCK_K)
    # The activation scale, as _quant_act_kernel computes it: the row's amax (a max, so the order
    # does not matter) over the whole row first, in every split too (the same scale as unsplit);
    # x is a few KB, read again from L2 below. With NORM the same pass sums the stream's squares
    # for each row's rstd and takes the amax of stream x norm weight: rstd > 0 scales every value
    # of a row alike and fp32 rounding keeps order, so rstd times that amax is exactly the amax of
    # the normalised row ((s * g) * rstd, formed so below). Program (0, 0) stores the stream (NORM 2).
    if MODE == 0 or NORM > 0:
        amax = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)
        row_sumsq = tl.zeros((BLOCK_M,), dtype=tl.float32)  # summed per step: fewer live registers
        stores_stream = (pid == 0) & (tl.program_id(1) == 0)
        # Each pass step's loads are issued a step ahead (a, b), before the arithmetic that waits on
        # the step before's: the pass is a chain of L2 reads (the previous kernel's output), one
        # latency each otherwise. The same values in the same order, so the same bits. Up to 8 rows
        # (a few steps of a chunked tile), or x alone: at 16 rows two steps' gate and up tiles, or
        # stream, residual and norm weight, spill registers in some configs (ptxas, sm_90).
        AHEAD: tl.constexpr = PASS_AHEAD and (CHUNKS > 1 or (ACT < 0 and NORM == 0))
        if AHEAD:
            pre_k = chunk[:, None] * BLOCK_K + tl.arange(0, BLOCK_K)[None, :]
            a, b = _skinny_load(x_rows, r_rows, pre_k, row_ok[:, None] & (pre_k < K), K, NORM, ACT)
            if NORM > 0:
                gw = tl.load(g_ptr + pre_k, mask=pre_k < K, other=0.0)
        for i in range(tl.cdiv(num_steps, CHUNKS)):
            pre_k = (i * CHUNKS + chunk)[:, None] * BLOCK_K + tl.arange(0, BLOCK_K)[None, :]
            pre_ok = row_ok[:, None] & (pre_k < K)
            if AHEAD:
                next_k = pre_k + CHUNKS * BLOCK_K
                a_next, b_next = _skinny_load(x_rows, r_rows, next_k, row_ok[:, None] & (next_k < K), K, NORM, ACT)
                if NORM > 0:
                    gw_next = tl.load(g_ptr + next_k, mask=next_k < K, other=0.0)
                x = _skinny_combine(a, b, NORM, ACT)
                a, b = a_next, b_next
            else:
                x = _skinny_input(x_rows, r_rows, pre_k, pre_ok, K, NORM, ACT)
            if NORM == 2:
                tl.store(stream_ptr + row[:, None].to(tl.int64) * K + pre_k, x, mask=pre_ok & stores_stream)
            x = x.to(tl.float32)
            if NORM > 0:
                row_sumsq += tl.sum(x * x, axis=1)
                if AHEAD:
                    x = x * gw.to(tl.float32)
                    gw = gw_next
                else:
                    x = x * tl.load(g_ptr + pre_k, mask=pre_k < K, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        if NORM > 0:
            if CHUNKS > 1:
                rows_sumsq = tl.sum(tl.reshape(row_sumsq, (CHUNKS, ROWS)), axis=0)
                row_sumsq = tl.reshape(tl.broadcast_to(rows_sumsq[None, :], (CHUNKS, ROWS)), (BLOCK_M,))
            # [BLOCK_M]: each tile row's x row's (padding rows 0, not the inf of eps 0)
            rstd = tl.where(row_ok, tl.math.rsqrt(row_sumsq / K + eps), 0.0)
    if MODE == 0:
        row_amax = tl.max(amax, axis=1)  # each tile row's share of its x row
        if CHUNKS > 1:
            rows_amax = tl.max(tl.reshape(row_amax, (CHUNKS, ROWS)), axis=0)
            row_amax = tl.reshape(tl.broadcast_to(rows_amax[None, :], (CHUNKS, ROWS)), (BLOCK_M,))
        else:
            rows_amax = row_amax
        if NORM > 0:
            row_amax = row_amax * rstd
            if CHUNKS > 1:
                rows_amax = tl.max(tl.reshape(row_amax, (CHUNKS, ROWS)), axis=0)  # the chunks' are alike
            else:
                rows_amax = row_amax
        x_scale = tl.math.div_rn(tl.maximum(row_amax, MIN_AMAX), QMAX)  # [BLOCK_M]
        rows_scale = tl.math.div_rn(tl.maximum(rows_amax, MIN_AMAX), QMAX)  # [ROWS], for the epilogue
    elif MODE == 2:
        x_scale = tl.load(xs_ptr).to(tl.float32)
        rows_scale = x_scale
    else:
        rows_scale = 1.0  # block scales are applied per step
    # This program's K steps: all of them, or its split's (empty for a split past the end).
    if SPLIT_K == 1:
        first = 0
        last = num_steps
        k_end = K
    else:
        first = tl.program_id(1) * STEPS
        last = tl.minimum(first + STEPS, num_steps)
        k_end = tl.minimum(last * BLOCK_K, K)  # the split's activations only
    num_kb = tl.cdiv(K, GROUP_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    q = tl.zeros((BLOCK_M, BLOCK_K), dtype=w_ptr.dtype.element_ty)
    g_scale = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for i in range(first, last):
        if (i - first) % CHUNKS == 0:
            offs_k = (i + chunk)[:, None] * BLOCK_K + tl.arange(0, BLOCK_K)[None, :]
            x = _skinny_input(x_rows, r_rows, offs_k, row_ok[:, None] & (offs_k < k_end), K, NORM, ACT).to(tl.float32)
            if NORM > 0:
                if CHUNKS == 1:  # every tile row at the same columns: the norm weight's once
                    offs_g = i * BLOCK_K + tl.arange(0, BLOCK_K)
                    g = tl.load(g_ptr + offs_g, mask=offs_g < k_end, other=0.0).to(tl.float32)[None, :]
                else:
                    g = tl.load(g_ptr + offs_k, mask=offs_k < k_end, other=0.0).to(tl.float32)
                x = x * g * rstd[:, None]
            if MODE == 1:  # a step is one 1x128 group: its scale from its own amax
                g_scale = tl.math.div_rn(tl.maximum(tl.max(tl.abs(x), axis=1), MIN_AMAX), QMAX)
                q = _quantise_rows(x, g_scale[:, None], QMAX, w_ptr.dtype.element_ty)
            elif MODE == 0:
                q = _quantise_rows(x, x_scale[:, None], QMAX, w_ptr.dtype.element_ty)
            else:
                q = _quantise_rows(x, x_scale, QMAX, w_ptr.dtype.element_ty)
        offs_k = i * BLOCK_K + tl.arange(0, BLOCK_K)
        if EVEN_K:
            w = tl.load(w_cols + offs_k[:, None], mask=n_ok[None, :], other=0.0)
        else:
            w = tl.load(w_cols + offs_k[:, None], mask=(offs_k < K)[:, None] & n_ok[None, :], other=0.0)
        # A fresh dot per step, promoted into the fp32 accumulator, as _fp8_gemm_kernel does.
        part = tl.dot(q, w)
        if MODE == 1:
            sw = tl.load(ws_ptr + offs_n.to(tl.int64) * num_kb + i, mask=n_ok, other=0.0)
            part = part * g_scale[:, None] * sw[None, :]
        if CHUNKS > 1:
            part = tl.where((chunk == (i - first) % CHUNKS)[:, None], part, 0.0)
        acc += part
    if CHUNKS > 1:
        y = tl.sum(tl.reshape(acc, (CHUNKS, ROWS, BLOCK_N)), axis=0)  # [ROWS, BLOCK_N]
    else:
        y = acc
    if SPLIT_K == 1:
        _skinny_store(y, rows_scale, offs_n, n_ok, ws_ptr, bias_ptr, y_ptr, M, N, MODE, HAS_BIAS, ROWS)
    else:
        # The split-K reduction, in this launch (the module docstring): the partial out, a barrier
        # so every thread of the program has stored it before one thread takes the ticket
        # (acq_rel at GPU scope: the partials happen-before a later ticket, whose holder reads them
        # after), and the last of the column block's SPLIT_K programs sums the partials in split
        # order 0..SPLIT_K-1 (the same sum whichever program is last) and finishes the tile.
        offs_r = tl.arange(0, ROWS)
        r_ok = (offs_r < M)[:, None] & n_ok[None, :]
        parts = part_ptr + offs_r[:, None] * N + offs_n[None, :]
        tl.store(parts + tl.program_id(1) * (M * N), y, mask=r_ok)
        tl.debug_barrier()
        counter = count_ptr + pid
        ticket = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
        if ticket == SPLIT_K - 1:
            total = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
            for s in range(SPLIT_K):  # .cg: from L2, where the other programs' partials are
                total += tl.load(parts + s * (M * N), mask=r_ok, other=0.0, cache_modifier=".cg")
            _skinny_store(total, rows_scale, offs_n, n_ok, ws_ptr, bias_ptr, y_ptr, M, N, MODE, HAS_BIAS, ROWS)
            tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")  # zero for the next launch


_TILES = (
    # (BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages); wgmma needs BLOCK_M >= 64 to
    # use all four warps of a warpgroup, but decode tiles of 16 rows waste less of the weight read.
    (16, 64, 128, 1, 4, 4),
    (16, 64, 128, 2, 4, 4),
    (16, 64, 128, 4, 4, 4),
    (16, 128, 128, 2, 4, 4),
    (16, 128, 128, 4, 4, 3),
    (16, 32, 128, 8, 4, 4),
    (32, 64, 128, 2, 4, 4),
    (32, 128, 128, 1, 4, 4),
    (64, 64, 128, 1, 4, 4),
    (64, 128, 128, 1, 4, 4),
    (64, 128, 128, 2, 4, 4),
    (64, 256, 128, 1, 8, 3),
    (128, 128, 128, 1, 8, 4),
    (128, 256, 128, 1, 8, 3),
    (128, 128, 64, 1, 4, 4),
)
_SKINNY_TILES = (
    # (BLOCK_N, BLOCK_K, num_warps, num_stages) of the fused decode kernel. Narrow tiles give more
    # programs (Llama-3-8B's N = 4096: 256 at 16, 128 at 32, 64 at 64), wide ones quantise the
    # activations fewer times over (every program quantises all of x: each of its ROWS rows once up
    # to 8 rows, all 16 padded rows at 9-16). BLOCK_K 512 spills registers at one row (ptxas,
    # sm_90: the [16, 512] activation tile stays live across the steps); 128 is the only one that
    # block-scaled weights take (a step is then one 1x128 activation group).
    (16, 128, 4, 6),
    (16, 256, 4, 4),
    (16, 256, 8, 4),
    (32, 128, 4, 4),
    (32, 128, 8, 4),
    (32, 256, 4, 4),
    (32, 256, 4, 6),
    (32, 256, 8, 3),
    (64, 128, 4, 4),
    (64, 128, 8, 4),
    (64, 256, 4, 3),
    (64, 256, 8, 3),
)
_SKINNY_SPLIT_TILES = (
    # (BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages): the fused kernel with K split over SPLIT_K
    # programs per column block, reduced in the launch. For the narrow projections: Llama-3-8B's
    # o_proj (N = 4096) has 128 column blocks of 32 on an H200's 132 multiprocessors, each reading
    # all of K, and streamed 1.65 TB/s of weight at one row against 3.45 at gate_up's 28,672 columns
    # (issue 29). prune_configs keeps a split where each split has at least two K steps. Every
    # program still reads all of x for the per-token amax (from L2): at 16 rows and SPLIT_K 8 that is
    # ROWS * K * 2 bytes a program, several times its weight slice; the tuner weighs it.
    (32, 128, 2, 4, 4),
    (32, 128, 4, 4, 4),
    (32, 128, 8, 4, 4),
    (32, 256, 2, 4, 4),
    (32, 256, 4, 4, 4),
    (32, 256, 8, 4, 3),
    (64, 128, 2, 4, 4),
    (64, 128, 4, 4, 4),
    (64, 128, 8, 4, 4),
    (64, 256, 2, 4, 3),
    (64, 256, 4, 4, 3),
    (64, 256, 8, 4, 3),
)
SKINNY_MAX_ROWS = 16  # one 16-row dot holds every row: beyond that the tiles above take over
CONFIG_SPACE: list[KernelConfig] = (
    [SCALED_MM_FAST, SCALED_MM]
    + [
        KernelConfig({"BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": k, "SPLIT_K": sk}, num_warps=w, num_stages=st)
        for (m, n, k, sk, w, st) in _TILES
    ]
    + [KernelConfig({"SKINNY": 1, "BLOCK_N": n, "BLOCK_K": k}, num_warps=w, num_stages=st) for (n, k, w, st) in _SKINNY_TILES]
    + [
        KernelConfig({"SKINNY": 1, "BLOCK_N": n, "BLOCK_K": k, "SPLIT_K": sk}, num_warps=w, num_stages=st)
        for (n, k, sk, w, st) in _SKINNY_SPLIT_TILES
    ]
)


def is_scaled_mm(config: KernelConfig | None) -> bool:
    return config is not None and bool(config.params.get("scaled_mm"))


def is_skinny(config: KernelConfig | None) -> bool:
    return config is not None and bool(config.params.get("SKINNY"))


def scaled_mm_supported(m: int, n: int, k: int, block: bool, dtype: torch.dtype) -> bool:
    """Whether ``torch._scaled_mm`` can run this GEMM: rowwise scales (per-token / per-channel) need
    a bf16 output and K, N multiples of 16; 128x128 block scales are not offered to it here."""
    return not block and dtype == torch.bfloat16 and k % 16 == 0 and n % 16 == 0 and m > 0


def prune_configs(configs: list[KernelConfig], m: int, n: int, k: int, block: bool, dtype: torch.dtype) -> list[KernelConfig]:
    """The configs worth timing for an [m, k] x [n, k] GEMM: tiles at most twice as tall as m needs,
    at least 64 tall from 256 rows; split-K only up to 64 rows and only where each split keeps at
    least two K steps; scaled_mm where it can run; the fused decode kernel up to 16 rows (with
    BLOCK_K 128 for block scales; split only where K holds at least two steps per split)."""
    out = []
    for cfg in configs:
        if is_scaled_mm(cfg):
            if scaled_mm_supported(m, n, k, block, dtype):
                out.append(cfg)
            continue
        if is_skinny(cfg):
            split = cfg.params.get("SPLIT_K", 1)
            if 0 < m <= SKINNY_MAX_ROWS and not (block and cfg["BLOCK_K"] != GROUP) and (split == 1 or k // (cfg["BLOCK_K"] * split) >= 2):
                out.append(cfg)
            continue
        bm, bk, split = cfg["BLOCK_M"], cfg["BLOCK_K"], cfg["SPLIT_K"]
        if bm > max(16, triton.next_power_of_2(m)) * 2 or (m >= 256 and bm < 64) or (block and GROUP % bk):
            continue
        if split > 1 and (m > 64 or triton.cdiv(k, bk * split) < 2):
            continue
        out.append(cfg)
    return out


def default_config(m: int, n: int, k: int, block: bool, dtype: torch.dtype, num_sms: int = 132) -> KernelConfig:
    """Untuned choice: torch._scaled_mm with fast accumulation where it runs from 64 rows (prefill
    is compute-bound and cuBLASLt's fp8 kernels are the known-good ones there), the fused decode kernel up to 16 rows,
    else a tile with enough K splits to give about two programs per multiprocessor."""
    if m >= 64 and scaled_mm_supported(m, n, k, block, dtype):
        return SCALED_MM_FAST
    if 0 < m <= SKINNY_MAX_ROWS:
        # One launch instead of the quantisation, the split-K GEMM and its sum (+ bias, cast): at
        # decode those launches were an estimated 0.5-1 ms of the step (issue 29). Every program
        # quantises x for itself: ROWS / BLOCK_N divisions (div_rn, ~10 instructions) per weight
        # byte up to 8 rows (ROWS = next_power_of_2(m)), 16 / BLOCK_N at 9-16, against ~7 lane-
        # instructions per weight byte at an H200's full bandwidth. So 16 columns (the most
        # programs: 256 at N = 4096) up to 4 rows, 32 beyond (half the division work per byte).
        # A model, not a measurement: the tuner times every SKINNY tile against the others.
        bn = 16 if m <= 4 else 32
        return KernelConfig({"SKINNY": 1, "BLOCK_N": bn, "BLOCK_K": 128 if block else 256}, num_warps=4, num_stages=4)
    return _default_tile(m, n, k, num_sms)


def _default_tile(m: int, n: int, k: int, num_sms: int = 132) -> KernelConfig:
    """The two-launch GEMM's untuned tile: enough K splits for about two programs per multiprocessor."""
    bm = 16 if m <= 16 else (32 if m <= 32 else (64 if m <= 64 else 128))
    bn, bk = (64 if m <= 32 else 128), 128
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    split = 1
    while split < 8 and tiles * split < 2 * num_sms and k // (bk * split * 2) >= 2:
        split *= 2
    return KernelConfig({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": split},
                        num_warps=8 if bm >= 128 else 4, num_stages=3 if bm >= 128 else 4)  # fmt: skip


def fp8_gemm(
    qx: torch.Tensor,
    x_scale: torch.Tensor,
    weight: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    config: Mapping[str, int] | KernelConfig | None = None,
) -> torch.Tensor:
    """qx e4m3 [M, K] (scales [M] per token, [1] static, or [M, KB] per group) times weight e4m3
    [N, K] (scales [N] or [N, KB]) -> [M, N] in ``out_dtype``, as ``reference.fp8_gemm``.
    Capture-safe (no host syncs)."""
    m, k = qx.shape
    n = weight.shape[0]
    block = w_scale.dim() == 2
    if weight.dtype != torch.float8_e4m3fn or qx.dtype != torch.float8_e4m3fn or weight.shape[1] != k:
        raise ValueError(f"fp8_gemm: x {qx.dtype} {tuple(qx.shape)} and weight {weight.dtype} {tuple(weight.shape)}")
    if block and (tuple(w_scale.shape) != (n, triton.cdiv(k, GROUP)) or tuple(x_scale.shape) != (m, triton.cdiv(k, GROUP))):
        raise ValueError(f"block scales must be [N, KB] / [M, KB], got {tuple(w_scale.shape)} / {tuple(x_scale.shape)}")
    cfg = KernelConfig.coerce(config) or default_config(m, n, k, block, out_dtype)
    if is_scaled_mm(cfg) and not scaled_mm_supported(m, n, k, block, out_dtype):
        cfg = _default_tile(m, n, k)  # a table entry from another dtype: fall back
    if is_skinny(cfg):
        cfg = _default_tile(m, n, k)  # the fused kernel quantises x itself; qx is quantised already
    if is_scaled_mm(cfg):
        sa = x_scale.reshape(-1, 1)
        if sa.shape[0] != m:
            sa = sa.expand(m, 1).contiguous()
        # weight.t() is the column-major [K, N] operand torch._scaled_mm wants, as a view.
        return torch._scaled_mm(
            qx, weight.t(), scale_a=sa, scale_b=w_scale.reshape(1, n), bias=bias, out_dtype=out_dtype,
            use_fast_accum=FAST_ACCUM and bool(cfg.params.get("fast_accum")),
        )  # fmt: skip
    bm, bn, bk, split = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"], cfg["SPLIT_K"]
    if block and GROUP % bk:
        raise ValueError(f"block-scaled fp8_gemm needs BLOCK_K dividing {GROUP}, got {bk}")
    k_per_split = triton.cdiv(triton.cdiv(k, split), bk) * bk
    split = triton.cdiv(k, k_per_split)
    if split == 1:
        y = torch.empty((m, n), dtype=out_dtype, device=qx.device)
        stride_ys = 0
    else:
        y = torch.empty((split, m, n), dtype=torch.float32, device=qx.device)
        stride_ys = y.stride(0)
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn), split)
    _fp8_gemm_kernel[grid](
        qx, weight, x_scale, w_scale, bias if bias is not None else w_scale, y, m, n, k, stride_ys,
        BLOCK_SCALED=block, STATIC_A=not block and x_scale.numel() == 1 and m != 1,
        HAS_BIAS=bias is not None and split == 1,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split, K_ITERS=k_per_split // bk, GROUP_K=GROUP,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    if split == 1:
        return y
    out = y.sum(0)
    if bias is not None:
        out += bias.float()
    return out.to(out_dtype)


def fp8_skinny_norm_linear(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    w: Any,
    bias: torch.Tensor | None,
    config: Mapping[str, int] | KernelConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's RMSNorm and the FP8 projection it feeds (an ``Fp8LinearWeight``), for up to 16
    rows, in one launch of the fused decode kernel: x joins the residual stream (``residual`` None:
    x is the stream), each row is RMS-normalised (sum of squares in fp32) times ``norm_weight``,
    kept in fp32, and quantised and multiplied as ``fp8_skinny_linear`` does. Returns (y [M, N] in
    x's dtype, the stream: x + residual added in fp32 and rounded to x's dtype, as
    fused_add_rms_norm stores it). ``reference.fp8_norm_linear`` is its definition. ``config``: a
    SKINNY one (None: the untuned default, SKINNY up to 16 rows)."""
    m, k = x.shape
    block = w.weight_scale.dim() == 2
    cfg = KernelConfig.coerce(config) or default_config(m, w.weight.shape[0], k, block, x.dtype)
    if not is_skinny(cfg) or not 0 < m <= SKINNY_MAX_ROWS:
        raise ValueError(f"fp8_skinny_norm_linear: {m} rows with config {cfg} (a SKINNY config, 1-{SKINNY_MAX_ROWS} rows)")
    if tuple(norm_weight.shape) != (k,) or (residual is not None and residual.shape != x.shape):
        raise ValueError(f"fp8_skinny_norm_linear: x {tuple(x.shape)}, norm weight {tuple(norm_weight.shape)}")
    if residual is not None and residual.stride(1) != 1:
        residual = residual.contiguous()
    stream = x if residual is None else torch.empty((m, k), dtype=x.dtype, device=x.device)
    y = fp8_skinny_linear(x, w.weight, w.weight_scale, w.activations, w.input_scale, bias, x.dtype, cfg, (residual, norm_weight, eps, stream))
    return y, stream


def fp8_skinny_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    w_scale: torch.Tensor,
    activations: str,
    input_scale: torch.Tensor | None,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    config: Mapping[str, int] | KernelConfig,
    norm: tuple[torch.Tensor | None, torch.Tensor, float, torch.Tensor] | None = None,
    act: int = -1,
) -> torch.Tensor:
    """x [M <= 16, K] (half / fp32) -> [M, N] in ``out_dtype`` in one launch: the activations
    quantised as ``quantize_activations`` does, inside the GEMM (``{"SKINNY": 1, ...}`` configs).
    ``norm`` (fp8_skinny_norm_linear's): normalise x first; ``act`` >= 0: x is [M, 2K] holding
    gate and up, activated on the way in (gated.ACT_CODES). Capture-safe (no host syncs)."""
    cfg = KernelConfig.coerce(config)
    assert cfg is not None and is_skinny(cfg)
    m, k = x.shape[0], x.shape[1] // 2 if act >= 0 else x.shape[1]
    n = weight.shape[0]
    block = w_scale.dim() == 2
    bk = cfg["BLOCK_K"]
    if not 0 < m <= SKINNY_MAX_ROWS or weight.dtype != torch.float8_e4m3fn or weight.shape[1] != k:
        raise ValueError(f"fp8_skinny_linear: x {tuple(x.shape)} and weight {weight.dtype} {tuple(weight.shape)}")
    mode = {"token": 0, "group": 1, "static": 2}[activations]
    if block != (mode == 1) or (block and (bk != GROUP or tuple(w_scale.shape) != (n, triton.cdiv(k, GROUP)))):
        raise ValueError(f"fp8_skinny_linear: {activations} activations, weight scales {tuple(w_scale.shape)}, BLOCK_K {bk}")
    if mode == 2:
        assert input_scale is not None
        xs = input_scale.float().reshape(1)
    else:
        xs = w_scale  # unused
    if x.stride(1) != 1:
        x = x.contiguous()
    y = torch.empty((m, n), dtype=out_dtype, device=x.device)
    # Each split takes ceil(steps / SPLIT_K) K steps; fewer splits where that leaves the last ones
    # without a step (prune_configs offers none such, a table entry met by another K may be).
    num_steps = triton.cdiv(k, bk)
    split, steps = split_k.split_steps(num_steps, cfg.params.get("SPLIT_K", 1))
    _launch_skinny(x, weight, w_scale, xs, bias, y, mode, split, steps, cfg, norm, act)
    return y


# Whether the fused decode kernel's scale pass issues its loads a step ahead (the kernel's
# PASS_AHEAD). Off until timed on a GPU (benchmarks/fp8_decode_chain.py compares both in one
# process; gpu_queue's fp8_pass_ahead): off, the kernel is the one before 6417833 line for line.
PASS_AHEAD = False


def _launch_skinny(
    x: torch.Tensor,
    weight: torch.Tensor,
    w_scale: torch.Tensor,
    xs: torch.Tensor,
    bias: torch.Tensor | None,
    y: torch.Tensor,
    mode: int,
    split: int,
    steps: int,
    cfg: KernelConfig,
    norm: tuple[torch.Tensor | None, torch.Tensor, float, torch.Tensor] | None = None,
    act: int = -1,
) -> None:
    """One launch of _fp8_skinny_kernel: ``split`` programs per column block of ``steps`` K steps
    each (fp8_skinny_linear leaves none of them empty; the kernel handles an empty one). ``norm``:
    (residual or None, norm weight, eps, the stream out) to normalise x first (NORM 2 or 1);
    ``act`` >= 0: x holds (gate, up), activated first (ACT: 0 silu, 1 gelu_tanh)."""
    m, k = x.shape[0], x.shape[1] // 2 if act >= 0 else x.shape[1]
    n = weight.shape[0]
    bn, bk = cfg["BLOCK_N"], cfg["BLOCK_K"]
    blocks = triton.cdiv(n, bn)
    if split > 1:
        part, counters = split_k.partials(x.device, split, m, n, blocks, "fp8_skinny_linear")
    else:
        part, counters, steps = y, y, 0  # unused
    if norm is None:
        residual, g, eps, stream, norm_mode = x, x, 0.0, x, 0  # unused
    else:
        res, g, eps, stream = norm
        residual, norm_mode = (x, 1) if res is None else (res, 2)
    _fp8_skinny_kernel[(blocks, split)](
        x, weight, w_scale, xs, bias if bias is not None else w_scale, y, part, counters, residual, g, stream,
        m, n, k, x.stride(0), residual.stride(0), steps, eps,
        MODE=mode, HAS_BIAS=bias is not None, EVEN_K=k % bk == 0, ROWS=triton.next_power_of_2(m),
        BLOCK_M=SKINNY_MAX_ROWS, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split, GROUP_K=GROUP,
        MIN_AMAX=reference.FP8_MIN_AMAX, QMAX=FP8_MAX, NORM=norm_mode, ACT=act, PASS_AHEAD=PASS_AHEAD,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl.launch_options(),
    )  # fmt: skip


def fp8_linear(x: torch.Tensor, w: Any, bias: torch.Tensor | None, config: Mapping[str, int] | KernelConfig | None = None) -> torch.Tensor:
    """x [M, K] @ W.T (+ bias) for an ``quant_linear.Fp8LinearWeight``: up to 16 rows with a SKINNY
    config (the default there) one fused launch, else quantise x, then ``fp8_gemm``."""
    m, k = x.shape
    block = w.weight_scale.dim() == 2
    cfg = KernelConfig.coerce(config) or default_config(m, w.weight.shape[0], k, block, x.dtype)
    if is_skinny(cfg):
        if 0 < m <= SKINNY_MAX_ROWS:
            return fp8_skinny_linear(x, w.weight, w.weight_scale, w.activations, w.input_scale, bias, x.dtype, cfg)
        cfg = _default_tile(m, w.weight.shape[0], k)  # no rows, or a table entry of a smaller bucket
    qx, sx = quantize_activations(x, w.activations, w.input_scale)
    return fp8_gemm(qx, sx, w.weight, w.weight_scale, bias, x.dtype, cfg)


def fp8_gemm_quantised(
    qx: torch.Tensor, x_scale: torch.Tensor, w: Any, bias: torch.Tensor | None, out_dtype: torch.dtype,
    config: Mapping[str, int] | KernelConfig | None = None,
) -> torch.Tensor:  # fmt: skip
    """``fp8_linear``'s GEMM for an input quantised already (qx e4m3 [M, K] and its scales in the
    weight's activation scheme): the table's config, a tile where it names SKINNY (which quantises
    an unquantised input itself; ``quantises_apart`` says where that runs)."""
    m, k = qx.shape
    block = w.weight_scale.dim() == 2
    cfg = KernelConfig.coerce(config) or default_config(m, w.weight.shape[0], k, block, out_dtype)
    if is_skinny(cfg):
        cfg = _default_tile(m, w.weight.shape[0], k)
    return fp8_gemm(qx, x_scale, w.weight, w.weight_scale, bias, out_dtype, cfg)


def quantises_apart(m: int, k: int, w: Any, dtype: torch.dtype, config: Mapping[str, int] | KernelConfig | None) -> bool:
    """Whether ``fp8_linear`` of an [m, k] input in ``dtype`` quantises it in a launch of its own
    (a tile or torch._scaled_mm config, or rows past a SKINNY config's), not inside the GEMM."""
    block = w.weight_scale.dim() == 2
    cfg = KernelConfig.coerce(config) or default_config(m, w.weight.shape[0], k, block, dtype)
    return not (is_skinny(cfg) and 0 < m <= SKINNY_MAX_ROWS)


def fp8_act_and_mul_linear(
    x: torch.Tensor, w: Any, bias: torch.Tensor | None, activation: str,
    config: Mapping[str, int] | KernelConfig | None = None,
) -> torch.Tensor:  # fmt: skip
    """The down projection of a gated MLP: act(gate) * up of x [M, 2 * d] (gate, up) @ W.T (+ bias)
    for an ``Fp8LinearWeight``, with the bits of ``fp8_linear(act_and_mul(x), ...)`` (activation
    "silu" or "gelu_tanh"). Where ``quantises_apart`` holds the activation and the quantisation run
    in one launch (``activation.act_and_mul_fp8``), else (up to 16 rows, a SKINNY config) the fused
    decode kernel activates its input on the way in (ACT): the [M, d] intermediate in x's dtype is
    never written, and no launch is the activation's alone."""
    from pagecast.kernels import activation as act_kernels

    m, d = x.shape[0], x.shape[1] // 2
    if activation not in ACT_CODES:
        raise ValueError(f"fp8_act_and_mul_linear: activation {activation!r}, not one of {sorted(ACT_CODES)}")
    if not quantises_apart(m, d, w, x.dtype, config):
        cfg = KernelConfig.coerce(config) or default_config(m, w.weight.shape[0], d, w.weight_scale.dim() == 2, x.dtype)
        return fp8_skinny_linear(x, w.weight, w.weight_scale, w.activations, w.input_scale, bias, x.dtype, cfg, act=ACT_CODES[activation])
    qx, sx = act_kernels.act_and_mul_fp8(x, activation, w.activations, w.input_scale)
    return fp8_gemm_quantised(qx, sx, w, bias, x.dtype, config)
