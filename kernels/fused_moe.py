"""Fused mixture-of-experts: the experts of a MoE block in two grouped GEMMs and a top-k sum.

x [T, H] visits the experts topk_ids [T, k] with weights topk_weights [T, k]; its P = T * k
(token, slot) pairs are numbered p = t * k + j. Expert weights in kernels/moe_routing.py's
layout (w_gate_up [E, 2I, H], gate rows then up rows; w_down [E, H, I]; optional biases).

Prefill-sized batches (the tile path, ``_moe_gemm_kernel``):

1. ``align_by_expert`` (two small launches, no host sync; reference.moe_align_by_expert does
   the same in torch) sorts the pairs by expert and pads each expert's run to a multiple of
   BLOCK_M: sorted_ids [max_blocks * BLOCK_M] holds pair ids (P marks padding), block_expert
   [max_blocks] each block's expert (-1 past the used blocks; max_blocks = cdiv(P, BLOCK_M) +
   min(E, P) bounds the blocks any routing can need, so the grid does not depend on the routing).
2. gate_up: one program per (block, BLOCK_N columns of I) gathers its block's token rows of x,
   multiplies them by its expert's gate rows and up rows (two accumulators), applies the
   activation (SiLU-and-mul, or gpt-oss's clamped SwiGLU, after the biases) and writes the
   intermediate [max_blocks * BLOCK_M, I] in sorted order: the activation is fused, so the
   [rows, 2I] product never reaches memory. With ``SPLIT_ACT`` (the tuner times both) the
   launch writes that product instead and the activation runs as a launch of its own: one
   weight tile a K step, so wider tiles fit.
3. down: the same kernel over the intermediate (contiguous rows), adds the bias, scales by each
   pair's routing weight (fp32) and scatters the rows to pair order: out [P, H].
4. the top-k sum: out.view(T, k, H).sum(1) (deterministic; torch sums half types in fp32).

With ``TMA`` (sm_90; the tuner times both) the two GEMMs read a block's rows and its expert's
weight tile with the tensor memory accelerator, which needs consecutive rows, so the tokens are
first gathered into sorted order (one index_select). Where a row is not a multiple of 16 bytes
the same tile runs by pointers instead.

Decode batches (the GEMV path, ``_moe_gemv_kernel``, ``{"gemv": 1, ...}``): a few pairs, each
visiting its own expert, so tiles of 16 rows would be mostly padding. No sorting: for gate_up
one program per (pair, BLOCK_N columns of I) streams its expert's gate and up rows once and
reduces over K on CUDA cores, the activation fused, into the intermediate [P, I] (pair order);
for down one program per (token, BLOCK_N columns of H) adds up its k pairs' weighted rows (the
top-k sum in the same launch). Only the visited experts' weights are read (the weight-streaming
bound), in two launches. With ``DOWN_PER_PAIR`` the down launch runs a program per (pair, column
block) writing fp32 rows and ``_moe_topk_sum_kernel`` adds a token's rows up; with
``TOPK_TICKET`` as well (up to TICKET_MAX_TOKENS tokens) the last of a token's pairs to finish a
column block adds them up in that launch (a ticket on a kernels/split_k.py counter; pair order, so
the same bits), one launch fewer a layer. With ``ONE_LAUNCH`` as well (``_moe_gemv_one_launch_kernel``)
gate_up, down and the top-k sum are one launch: its first programs are gate_up's, each counting
its pair's flag up (release) once its intermediate columns are stored; each down program (a pair
and DOWN_BLOCK_N columns of H) loads its expert's whole [DOWN_BLOCK_N, I] weight tile into
registers, then waits for the flag to reach the pair's gate_up program count (acquire), reads the
pair's intermediate row from L2 and finishes as TOPK_TICKET does. So the down weights stream
while gate_up runs, and the gap between two launches and the down launch's ramp go. Programs
start in id order, so every gate_up program has started before any down program waits. Only
where a down tile fits in registers (``one_launch_fits``), and timed by the build only with
PAGECAST_MOE_ONE_LAUNCH=1 until it has run on a GPU (``config_space``). ``DOWN_BLOCK_N``, ``DOWN_BLOCK_K`` and ``DOWN_WARPS``
give the down launch a tile of its own (else gate_up's): its reduction is I, not H. With ``DOT``
the products run through tl.dot, the row padded to a 16-row tile whose other rows are masked
(never read): loads that feed a dot are the ones Triton pipelines (num_stages), so the weight
streams as in the dense skinny GEMM; the CUDA-core loop keeps one load in flight a program.

``{"grouped": 1}`` (``GROUPED``; sm_90 bf16, and the CPU): the same layout (``align_by_expert``
at GROUP_ALIGN rows a block) with both GEMMs as ``torch._grouped_mm`` (PyTorch's CUTLASS grouped
GEMM: one launch over every expert's rows, the group ends computed on the device), the
activation a launch of its own, and ``_moe_gather_sum_kernel`` adding each token's k rows times
their routing weights. No host sync. In CONFIG_SPACE since its bf16 GPU tests passed: at
Mixtral's 4,096 tokens it is the fastest config on an H100 and on the H200, and it loses to the
tiles at Qwen3-30B-A3B's buckets and at Mixtral's 512-2,048 on the H200 (RESULTS.md,
twenty-fourth and twenty-fifth sessions), where the tuner keeps a tile.

``{"naive": 1}`` is the baseline the tuner times against: the per-expert loop of cuBLAS GEMMs
(reference.fused_moe). It syncs with the host, so it is a candidate only for batches that are
never captured in a CUDA graph (kernels/problems.py).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait
from triton.tools.tensor_descriptor import TensorDescriptor

from pagecast.kernels import activation as activation_kernels
from pagecast.kernels import pdl, reference, split_k
from pagecast.kernels.tuning import KernelConfig, num_sms

ACT_NONE, ACT_SILU, ACT_SWIGLU_OAI = 0, 1, 2
_ACTIVATIONS = {"silu": ACT_SILU, "swiglu_oai": ACT_SWIGLU_OAI}


# The pair and block counts follow the batch's token count, and Triton would compile a variant per
# count divisible by 16 or not: the tuner launches each bucket at one token count, serving at every
# count up to it, so a config chosen for a bucket could compile while serving (the dense GEMMs' rows
# were seen to, on the H200). The counts only bound loops and masks here, so they are not specialised.
@triton.jit(do_not_specialize=["num_pairs", "max_blocks"])
def _moe_align_kernel(
    ids_ptr,  # topk_ids [P] (int64): each pair's expert
    sorted_ids_ptr,  # int32 [max_blocks * BLOCK_M] out: filled with P here (padding)
    block_expert_ptr,  # int32 [max_blocks] out: each block's expert, -1 past the used blocks
    cursor_ptr,  # int32 [E] out: each expert's first padded position (_moe_scatter_kernel's cursors)
    num_pairs,
    num_experts,
    max_blocks,
    BLOCK_M: tl.constexpr,
    NUM_BINS: tl.constexpr,  # E rounded up to a power of two
    CHUNK: tl.constexpr,
    BLOCKS_STEP: tl.constexpr,  # blocks a step compares with every expert's run end
):
    # One program: count each expert's pairs, pad the counts to whole blocks, and lay the blocks out.
    counts = tl.zeros((NUM_BINS,), dtype=tl.int32)
    for p0 in range(0, num_pairs, CHUNK):
        offs = p0 + tl.arange(0, CHUNK)
        ok = offs < num_pairs
        ids = tl.load(ids_ptr + offs, mask=ok, other=0).to(tl.int32)
        counts += tl.histogram(ids, NUM_BINS, mask=ok)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, 0)  # [NUM_BINS]
    offs_e = tl.arange(0, NUM_BINS)
    e_ok = offs_e < num_experts
    tl.store(cursor_ptr + offs_e, ends - padded, mask=e_ok)
    # A block's expert is the first whose run ends after the block starts: the count of runs
    # ending at or before it (empty experts' runs end where the one before ends).
    for b0 in range(0, max_blocks, BLOCKS_STEP):
        offs_b = b0 + tl.arange(0, BLOCKS_STEP)
        ended = (ends[None, :] <= (offs_b * BLOCK_M)[:, None]) & e_ok[None, :]
        expert = tl.sum(ended.to(tl.int32), axis=1)
        expert = tl.where(expert < num_experts, expert, -1)
        tl.store(block_expert_ptr + offs_b, expert, mask=offs_b < max_blocks)
    for s0 in range(0, max_blocks * BLOCK_M, CHUNK):
        offs_s = s0 + tl.arange(0, CHUNK)
        tl.store(
            sorted_ids_ptr + offs_s,
            tl.full((CHUNK,), 0, tl.int32) + num_pairs,
            mask=offs_s < max_blocks * BLOCK_M,
        )


@triton.jit(do_not_specialize=["num_pairs"])
def _moe_scatter_kernel(
    ids_ptr,  # topk_ids [P] (int64)
    sorted_ids_ptr,  # int32 [max_blocks * BLOCK_M]: each pair's id written at its place in its expert's run
    cursor_ptr,  # int32 [E]: the next free position of each expert's run (atomically advanced)
    num_pairs,
    CHUNK: tl.constexpr,
):
    # Pairs of one expert take its run's positions in whatever order the atomics grant them: the
    # rows of a block are independent, and the down launch writes each pair's row by its id.
    offs = tl.program_id(0) * CHUNK + tl.arange(0, CHUNK)
    ok = offs < num_pairs
    expert = tl.load(ids_ptr + offs, mask=ok, other=0).to(tl.int32)
    pos = tl.atomic_add(cursor_ptr + expert, tl.full((CHUNK,), 1, tl.int32), mask=ok)
    tl.store(sorted_ids_ptr + pos, offs.to(tl.int32), mask=ok)


@triton.jit
def _activate(gate, up, ACTIVATION: tl.constexpr, ALPHA: tl.constexpr, LIMIT: tl.constexpr):
    # gate, up: fp32 tiles of the same shape
    if ACTIVATION == 1:
        return gate / (1.0 + tl.exp(-gate)) * up
    else:
        gate = tl.minimum(gate, LIMIT)
        up = tl.minimum(tl.maximum(up, -LIMIT), LIMIT)
        return gate / (1.0 + tl.exp(-ALPHA * gate)) * (up + 1.0)


@triton.jit
def _tile_block(max_blocks, block_expert_ptr, N, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """A tile-path program's (block, column tile) and its block's expert (-1: an unused block).
    Consecutive programs take GROUP_M blocks' tiles of the same columns, so an expert's weight
    tile is read from L2 by the blocks after the first."""
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    group_m = tl.minimum(max_blocks - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_m
    pid_n = (pid % per_group) // group_m
    expert = tl.load(block_expert_ptr + pid_m)
    return pid_m, pid_n, expert


@triton.jit
def _tile_rows(
    pid_m, pid_n, sorted_ids_ptr, num_pairs, top_k, N,
    MUL_ROUTING_WEIGHT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """A tile's rows: its pairs (num_pairs: padding), the input row each reads (gate_up: the
    pair's token in x; down, MUL_ROUTING_WEIGHT: the intermediate's sorted row) and its columns."""
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ids_ptr + offs_m)  # [BLOCK_M]
    m_ok = pair < num_pairs
    if MUL_ROUTING_WEIGHT:
        a_rows = offs_m.to(tl.int64)
    else:
        a_rows = (pair // top_k).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    return offs_m, pair, m_ok, a_rows, offs_n, n_ok


@triton.jit
def _tile_epilogue(
    acc, acc_up, b_ptr, expert, stride_be, weights_ptr, c_ptr, stride_cm, offs_m, pair, m_ok, offs_n, n_ok, N,
    HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr, ALPHA: tl.constexpr, LIMIT: tl.constexpr,
    MUL_ROUTING_WEIGHT: tl.constexpr,
):  # fmt: skip
    """A tile's fp32 sums to its output rows, as every MoE tile kernel ends: the expert's biases
    (HAS_BIAS), the activation of gate and up (ACTIVATION), then gate_up stores in sorted order, or
    down (MUL_ROUTING_WEIGHT) scales each row by its routing weight and scatters it to pair order."""
    if HAS_BIAS:
        b_base = b_ptr + expert.to(tl.int64) * stride_be
        acc += tl.load(b_base + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        if ACTIVATION != 0:
            acc_up += tl.load(b_base + N + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    if ACTIVATION != 0:
        acc = _activate(acc, acc_up, ACTIVATION, ALPHA, LIMIT)
    if MUL_ROUTING_WEIGHT:
        acc *= tl.load(weights_ptr + pair, mask=m_ok, other=0.0)[:, None]
        c_rows = pair.to(tl.int64)
    else:
        c_rows = offs_m.to(tl.int64)
    c_ptrs = c_ptr + c_rows[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit(do_not_specialize=["num_pairs", "max_blocks"])
def _moe_gemm_kernel(
    a_ptr,  # gate_up: x [T, K]; down: intermediate [max_blocks * BLOCK_M, K] in sorted order (TMA: see below)
    w_ptr,  # [E, N_w, K]: N_w = 2N (gate rows, then up rows) with an activation, else N (TMA: see below)
    b_ptr,  # [E, N_w] or unused
    c_ptr,  # gate_up: intermediate [max_blocks * BLOCK_M, N] in sorted order; down: [P, N] in pair order
    sorted_ids_ptr,  # int32 [max_blocks * BLOCK_M]: pair ids grouped by expert, num_pairs = padding
    block_expert_ptr,  # int32 [max_blocks]: the expert of each block, -1 for unused blocks
    weights_ptr,  # fp32 [P] routing weights (MUL_ROUTING_WEIGHT) or unused
    N,  # output columns
    K,
    num_pairs,
    max_blocks,
    stride_am,
    stride_we,
    stride_wn,
    stride_be,
    stride_cm,
    top_k,  # a runtime argument: one compiled kernel serves every top-k
    ACTIVATION: tl.constexpr,  # 0: none (down), 1: SiLU-and-mul, 2: gpt-oss SwiGLU
    MUL_ROUTING_WEIGHT: tl.constexpr,  # down: scale rows by their weight and scatter to pair order
    HAS_BIAS: tl.constexpr,
    ALPHA: tl.constexpr,
    LIMIT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    TMA: tl.constexpr = False,
):
    """One (block, column tile) of the tile path. With TMA (sm_90) both operands are tensor
    descriptors read by the tensor memory accelerator: ``a_ptr`` over [rows, K] whose block rows
    are consecutive (the launcher gathers gate_up's tokens into sorted order first), box [BLOCK_M,
    BLOCK_K]; ``w_ptr`` over the weights as [E * N_w, K], box [BLOCK_N, BLOCK_K]; the three
    operand strides are unused. The K loop then has no per-element addresses or masks: the copy
    engine zero-fills past K and past the weight rows' end. A tile whose columns pass N reads the
    next rows (the up half, or the next expert): those columns are never stored."""
    pid_m, pid_n, expert = _tile_block(max_blocks, block_expert_ptr, N, BLOCK_N, GROUP_M)
    if expert < 0:
        return
    offs_m, pair, m_ok, a_rows, offs_n, n_ok = _tile_rows(
        pid_m, pid_n, sorted_ids_ptr, num_pairs, top_k, N, MUL_ROUTING_WEIGHT, BLOCK_M, BLOCK_N
    )
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if TMA:
        w_row = expert * (2 * N if ACTIVATION != 0 else N) + pid_n * BLOCK_N
        for k0 in range(0, K, BLOCK_K):
            a = a_ptr.load([pid_m * BLOCK_M, k0])
            acc = tl.dot(a, w_ptr.load([w_row, k0]).T, acc, input_precision=DOT_PRECISION)
            if ACTIVATION != 0:
                acc_up = tl.dot(a, w_ptr.load([w_row + N, k0]).T, acc_up, input_precision=DOT_PRECISION)
    else:
        w_base = w_ptr + expert.to(tl.int64) * stride_we
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_ok = offs_k < K
            a = tl.load(
                a_ptr + a_rows[:, None] * stride_am + offs_k[None, :],
                mask=m_ok[:, None] & k_ok[None, :],
                other=0.0,
            )
            w_ok = k_ok[:, None] & n_ok[None, :]
            w = tl.load(w_base + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None], mask=w_ok, other=0.0)
            acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)  # [BLOCK_M, BLOCK_N]
            if ACTIVATION != 0:
                w_up = tl.load(
                    w_base + (N + offs_n)[None, :].to(tl.int64) * stride_wn + offs_k[:, None],
                    mask=w_ok,
                    other=0.0,
                )
                acc_up = tl.dot(a, w_up, acc_up, input_precision=DOT_PRECISION)
    _tile_epilogue(
        acc, acc_up, b_ptr, expert, stride_be, weights_ptr, c_ptr, stride_cm, offs_m, pair, m_ok, offs_n, n_ok, N,
        HAS_BIAS, ACTIVATION, ALPHA, LIMIT, MUL_ROUTING_WEIGHT,
    )  # fmt: skip


@triton.jit
def _expert_gemv(
    a_ptr,  # one row of activations [K]
    w_base,  # the expert's weight [N_w, K]
    offs_n,
    n_ok,
    N,
    K,
    stride_wn,
    GATED: tl.constexpr,  # also the up rows N + offs_n
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT: tl.constexpr = False,  # through tl.dot, the row padded to 16 (the module docstring)
    DOT_PRECISION: tl.constexpr = "tf32",
):
    if DOT:
        # The row as a 16-row tile (rows 1-15 masked: never read, zero) times [BLOCK_K, BLOCK_N]
        # weight tiles on the tensor cores: loads that feed a dot are what Triton pipelines
        # (num_stages deep), as the dense skinny GEMM's are; the CUDA-core loop below is not.
        rows = tl.arange(0, 16)
        first = (rows == 0)[:, None]
        dacc = tl.zeros((16, BLOCK_N), dtype=tl.float32)
        dacc_up = tl.zeros((16, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_ok = offs_k < K
            a = tl.load(a_ptr + offs_k[None, :] + rows[:, None] * 0, mask=first & k_ok[None, :], other=0.0)
            w_ok = k_ok[:, None] & n_ok[None, :]
            w = tl.load(w_base + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None], mask=w_ok, other=0.0)
            dacc = tl.dot(a.to(w.dtype), w, dacc, input_precision=DOT_PRECISION)
            if GATED:
                w_up = tl.load(
                    w_base + (N + offs_n)[None, :].to(tl.int64) * stride_wn + offs_k[:, None], mask=w_ok, other=0.0
                )
                dacc_up = tl.dot(a.to(w_up.dtype), w_up, dacc_up, input_precision=DOT_PRECISION)
        return tl.sum(tl.where(first, dacc, 0.0), axis=0), tl.sum(tl.where(first, dacc_up, 0.0), axis=0)
    # [BLOCK_N, BLOCK_K] partial products on CUDA cores, reduced over K once at the end
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        a = tl.load(a_ptr + offs_k, mask=k_ok, other=0.0).to(tl.float32)[None, :]
        w_ok = n_ok[:, None] & k_ok[None, :]
        w = tl.load(w_base + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :], mask=w_ok, other=0.0)
        acc += w.to(tl.float32) * a
        if GATED:
            w_up = tl.load(
                w_base + (N + offs_n)[:, None].to(tl.int64) * stride_wn + offs_k[None, :],
                mask=w_ok,
                other=0.0,
            )
            acc_up += w_up.to(tl.float32) * a
    return tl.sum(acc, axis=1), tl.sum(acc_up, axis=1)  # [BLOCK_N] each


@triton.jit
def _weighted_down_row(
    a_ptr, w_ptr, b_ptr, ids_ptr, weights_ptr, pair, offs_n, n_ok, N, K,
    stride_am, stride_we, stride_wn, stride_be,
    HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    # One pair's down row (its expert's projection of its intermediate row, with the bias) times
    # its routing weight, in fp32 [BLOCK_N].
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    down, _ = _expert_gemv(
        a_ptr + pair.to(tl.int64) * stride_am, w_ptr + expert * stride_we, offs_n, n_ok, N, K, stride_wn,
        False, BLOCK_N, BLOCK_K, DOT, DOT_PRECISION,
    )  # fmt: skip
    if HAS_BIAS:
        down += tl.load(b_ptr + expert * stride_be + offs_n, mask=n_ok, other=0.0).to(tl.float32)
    return down * tl.load(weights_ptr + pair)


@triton.jit
def _gate_up_row(
    x_ptr, w_ptr, b_ptr, ids_ptr, pair, offs_n, n_ok, N, K, stride_xm, stride_we, stride_wn, stride_be, top_k,
    ACTIVATION: tl.constexpr, HAS_BIAS: tl.constexpr, ALPHA: tl.constexpr, LIMIT: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    # One pair's BLOCK_N intermediate columns in fp32: its expert's gate and up rows times its
    # token's row of x, the biases, the activation.
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    gate, up = _expert_gemv(
        x_ptr + (pair // top_k).to(tl.int64) * stride_xm, w_ptr + expert * stride_we, offs_n, n_ok, N, K, stride_wn,
        True, BLOCK_N, BLOCK_K, DOT, DOT_PRECISION,
    )  # fmt: skip
    if HAS_BIAS:
        gate += tl.load(b_ptr + expert * stride_be + offs_n, mask=n_ok, other=0.0).to(tl.float32)
        up += tl.load(b_ptr + expert * stride_be + N + offs_n, mask=n_ok, other=0.0).to(tl.float32)
    return _activate(gate, up, ACTIVATION, ALPHA, LIMIT)


@triton.jit
def _topk_ticket_sum(y, pair, top_k, part_ptr, stride_pm, out_ptr, counter_row, count_ptr, offs_n, n_ok, N,
                     BLOCK_N: tl.constexpr):  # fmt: skip
    # The top-k sum in the down launch (TOPK_TICKET): the pair's weighted fp32 row y stored, then a
    # ticket on its (token, column block) counter, count_ptr + token * counter_row; the token's
    # last pair to finish adds its top_k rows in pair order, in fp32 from zero, as
    # _moe_topk_sum_kernel does (the same bits), and sets the counter back to 0.
    tl.store(part_ptr + pair.to(tl.int64) * stride_pm + offs_n, y, mask=n_ok)
    token = (pair // top_k).to(tl.int64)
    counter = count_ptr + token * counter_row
    if split_k.last_to_arrive(counter, top_k):
        total = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for j in range(top_k):  # .cg: from L2, where the other pairs' rows are
            total += tl.load(part_ptr + (token * top_k + j) * stride_pm + offs_n, mask=n_ok, other=0.0,
                             cache_modifier=".cg")  # fmt: skip
        tl.store(out_ptr + token * N + offs_n, total.to(out_ptr.dtype.element_ty), mask=n_ok)
        split_k.reset(counter)


@triton.jit
def _moe_gemv_kernel(
    a_ptr,  # gate_up: x [T, K]; down: intermediate [P, K] in pair order
    w_ptr,  # [E, N_w, K] as for _moe_gemm_kernel
    b_ptr,  # [E, N_w] or unused
    c_ptr,  # gate_up: intermediate [P, N] in pair order; down: out [T, N]
    ids_ptr,  # topk_ids [P] (int64): each pair's expert
    weights_ptr,  # fp32 [P] routing weights (down) or unused
    N,
    K,
    stride_am,
    stride_we,
    stride_wn,
    stride_be,
    stride_cm,
    top_k,  # a runtime argument: one compiled kernel serves every top-k
    out_ptr,  # TICKET: out [T, N] in x's dtype; else unused
    count_ptr,  # TICKET: int32 [T * cdiv(N, BLOCK_N)] counters, 0 between launches (kernels/split_k.py); else unused
    ACTIVATION: tl.constexpr,  # gate_up: 1 or 2; 0: the down launch
    HAS_BIAS: tl.constexpr,
    ALPHA: tl.constexpr,
    LIMIT: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PER_PAIR: tl.constexpr = False,  # down: a program per (pair, column block), fp32 rows [P, N]
    TICKET: tl.constexpr = False,  # PER_PAIR: the last of a token's pairs adds them up (no top-k sum launch)
    DOT: tl.constexpr = False,  # the products through tl.dot (_expert_gemv)
    DOT_PRECISION: tl.constexpr = "tf32",
    PDL: tl.constexpr = False,  # launched with programmatic dependent launch (kernels/pdl.py)
):
    if PDL:
        gdc_wait()  # before any memory access: the kernel before may still be running
    # gate_up: a program per (pair, column block). down: a program per (token, column block) adds
    # up the token's top_k pairs' weighted rows itself (the top-k sum, without a [P, N] buffer);
    # with PER_PAIR, a program per (pair, column block) writes its pair's weighted row in fp32 and
    # _moe_topk_sum_kernel adds them up: top_k times the programs, each reading one expert's rows
    # rather than top_k experts' one after another (few tokens leave the serial loop latency-bound).
    pid_n = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    if ACTIVATION != 0:
        pair = tl.program_id(0)
        y = _gate_up_row(
            a_ptr, w_ptr, b_ptr, ids_ptr, pair, offs_n, n_ok, N, K, stride_am, stride_we, stride_wn, stride_be, top_k,
            ACTIVATION, HAS_BIAS, ALPHA, LIMIT, BLOCK_N, BLOCK_K, DOT, DOT_PRECISION,
        )  # fmt: skip
        row = pair.to(tl.int64)
    elif PER_PAIR:
        pair = tl.program_id(0)
        y = _weighted_down_row(
            a_ptr, w_ptr, b_ptr, ids_ptr, weights_ptr, pair, offs_n, n_ok, N, K,
            stride_am, stride_we, stride_wn, stride_be, HAS_BIAS, BLOCK_N, BLOCK_K, DOT, DOT_PRECISION,
        )  # fmt: skip
        row = pair.to(tl.int64)
        if TICKET:  # the top-k sum in this launch
            _topk_ticket_sum(
                y, pair, top_k, c_ptr, stride_cm, out_ptr, tl.num_programs(1), count_ptr + pid_n, offs_n, n_ok, N,
                BLOCK_N,
            )  # fmt: skip
            return
    else:
        token = tl.program_id(0)
        y = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for j in range(top_k):
            y += _weighted_down_row(
                a_ptr, w_ptr, b_ptr, ids_ptr, weights_ptr, token * top_k + j, offs_n, n_ok, N, K,
                stride_am, stride_we, stride_wn, stride_be, HAS_BIAS, BLOCK_N, BLOCK_K, DOT, DOT_PRECISION,
            )  # fmt: skip
        row = token.to(tl.int64)
    tl.store(c_ptr + row * stride_cm + offs_n, y.to(c_ptr.dtype.element_ty), mask=n_ok)


@triton.jit(do_not_specialize=["num_pairs"])
def _moe_gemv_one_launch_kernel(
    x_ptr,  # [T, K = H]
    w_gu_ptr,  # [E, 2I, H]
    w_d_ptr,  # [E, H, I]
    b_gu_ptr,  # [E, 2I] or unused
    b_d_ptr,  # [E, H] or unused
    inter_ptr,  # [P, I] in x's dtype: the activated gate_up rows, in pair order
    part_ptr,  # fp32 [P, H]: each pair's weighted down row
    out_ptr,  # [T, H] in x's dtype
    ids_ptr,  # topk_ids [P] (int64)
    weights_ptr,  # fp32 [P] routing weights
    count_ptr,  # int32, 0 between launches (kernels/split_k.py): [T * cdiv(H, DOWN_BLOCK_N)] top-k tickets, then [P] pair flags
    num_pairs,
    H,
    I,
    stride_xm,
    stride_gue,
    stride_gun,
    stride_gube,
    stride_de,
    stride_dn,
    stride_dbe,
    top_k,
    ACTIVATION: tl.constexpr,
    HAS_BIAS: tl.constexpr,  # gate_up's
    HAS_DOWN_BIAS: tl.constexpr,
    ALPHA: tl.constexpr,
    LIMIT: tl.constexpr,
    BLOCK_N: tl.constexpr,  # gate_up: columns of I a program
    BLOCK_K: tl.constexpr,
    DOWN_BLOCK_N: tl.constexpr,  # down: columns of H a program
    DOWN_K: tl.constexpr,  # next_power_of_2(I): a down program's whole weight tile is loaded at once
    DOT: tl.constexpr = False,  # gate_up's products through tl.dot (_expert_gemv)
    DOT_PRECISION: tl.constexpr = "tf32",
    PDL: tl.constexpr = False,  # launched with programmatic dependent launch (kernels/pdl.py)
):
    if PDL:
        gdc_wait()  # before any memory access: the kernel before may still be running
    # ONE_LAUNCH (the module docstring): programs 0 .. P * gu_blocks - 1 are gate_up's, one per
    # (pair, column block of I), in pair order; the rest are down's, one per (pair, column block of
    # H). A down program loads its expert's weight tile first, then waits for its pair's gate_up
    # programs (a flag each counts up, release), so the down weights stream while gate_up runs.
    # Programs start in the order of their ids, so every gate_up program has started before any
    # down program waits: the wait always ends.
    pid = tl.program_id(0)
    gu_blocks = tl.cdiv(I, BLOCK_N)
    down_blocks = tl.cdiv(H, DOWN_BLOCK_N)
    num_tokens = num_pairs // top_k
    gu_programs = num_pairs * gu_blocks
    if pid < gu_programs:
        pair = pid // gu_blocks
        offs_n = (pid % gu_blocks) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < I
        y = _gate_up_row(
            x_ptr, w_gu_ptr, b_gu_ptr, ids_ptr, pair, offs_n, n_ok, I, H, stride_xm, stride_gue, stride_gun,
            stride_gube, top_k, ACTIVATION, HAS_BIAS, ALPHA, LIMIT, BLOCK_N, BLOCK_K, DOT, DOT_PRECISION,
        )  # fmt: skip
        tl.store(inter_ptr + pair.to(tl.int64) * I + offs_n, y.to(inter_ptr.dtype.element_ty), mask=n_ok)
        # every thread's stores before the flag (a CTA barrier), then the flag up with release
        tl.debug_barrier()
        tl.atomic_add(count_ptr + num_tokens * down_blocks + pair, 1, sem="release", scope="gpu")
    else:
        d = pid - gu_programs
        d_pair = d // down_blocks
        pid_n = d % down_blocks
        cols = pid_n * DOWN_BLOCK_N + tl.arange(0, DOWN_BLOCK_N)
        cols_ok = cols < H
        offs_k = tl.arange(0, DOWN_K)
        k_ok = offs_k < I
        d_expert = tl.load(ids_ptr + d_pair).to(tl.int64)
        # the weight tile (and bias, routing weight) in flight before the wait
        w = tl.load(
            w_d_ptr + d_expert * stride_de + cols[:, None].to(tl.int64) * stride_dn + offs_k[None, :],
            mask=cols_ok[:, None] & k_ok[None, :],
            other=0.0,
        )
        routing = tl.load(weights_ptr + d_pair)
        if HAS_DOWN_BIAS:
            bias = tl.load(b_d_ptr + d_expert * stride_dbe + cols, mask=cols_ok, other=0.0).to(tl.float32)
        flag = count_ptr + num_tokens * down_blocks + d_pair
        while tl.atomic_add(flag, 0, sem="acquire", scope="gpu") < gu_blocks:
            pass
        # .cg: from L2, where the gate_up programs' rows are
        a = tl.load(inter_ptr + d_pair.to(tl.int64) * I + offs_k, mask=k_ok, other=0.0, cache_modifier=".cg")
        acc = tl.sum(w.to(tl.float32) * a.to(tl.float32)[None, :], axis=1)
        if HAS_DOWN_BIAS:
            acc += bias
        acc = acc * routing
        # The pair's flag: its gate_up programs counted it to gu_blocks, its down programs count on;
        # the last of them sets it back to 0 for the next launch.
        if split_k.last_to_arrive(flag, gu_blocks + down_blocks):
            split_k.reset(flag)
        # the top-k sum in this launch, as _moe_gemv_kernel's TICKET does
        _topk_ticket_sum(
            acc, d_pair, top_k, part_ptr, H, out_ptr, down_blocks, count_ptr + pid_n, cols, cols_ok, H, DOWN_BLOCK_N
        )


@triton.jit
def _moe_topk_sum_kernel(
    part_ptr,  # fp32 [T * top_k, N]: each pair's weighted down row (PER_PAIR)
    out_ptr,  # [T, N]
    N,
    top_k,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr = False,  # launched with programmatic dependent launch (kernels/pdl.py)
):
    if PDL:
        gdc_wait()  # before any memory access: the kernel before may still be running
    # A program per (token, column block): the token's pairs added in pair order, in fp32 from
    # zero, as the serial down launch adds them (so both give the same bits).
    token = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < N
    y = tl.zeros((BLOCK,), dtype=tl.float32)
    for j in range(top_k):
        y += tl.load(part_ptr + (token * top_k + j) * N + offs, mask=ok, other=0.0)
    tl.store(out_ptr + token * N + offs, y.to(out_ptr.dtype.element_ty), mask=ok)


TOPK_SUM_BLOCK = 1024


@triton.jit
def _moe_gather_sum_kernel(
    rows_ptr,  # [R, N] in x's dtype: the down product in sorted order (GROUPED)
    row_of_pair_ptr,  # int32 [>= T * top_k]: each pair's row in rows_ptr
    weights_ptr,  # fp32 [T * top_k]: each pair's routing weight
    out_ptr,  # [T, N]
    N,
    top_k,
    BLOCK: tl.constexpr,
):
    # A program per (token, column block): the token's pairs' rows times their weights, added in
    # pair order in fp32 from zero, rounded once to the output's dtype.
    token = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < N
    y = tl.zeros((BLOCK,), dtype=tl.float32)
    for j in range(top_k):
        pair = token * top_k + j
        row = tl.load(row_of_pair_ptr + pair).to(tl.int64)
        y += tl.load(weights_ptr + pair) * tl.load(rows_ptr + row * N + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + token * N + offs, y.to(out_ptr.dtype.element_ty), mask=ok)


# ---------------------------------------------------------------------------- configs

NAIVE = KernelConfig({"naive": 1}, num_warps=0, num_stages=0)  # the per-expert cuBLAS loop
GROUPED = KernelConfig({"grouped": 1}, num_warps=0, num_stages=0)  # torch._grouped_mm (module docstring)
GROUP_ALIGN = 16  # GROUPED: each expert's rows padded to a multiple of this (PyTorch's CUDA grouped GEMM wants group ends divisible by 16)

_GEMV_TILES = (
    # (BLOCK_N, BLOCK_K, num_warps): a program streams BLOCK_N rows of its expert's weight
    (8, 256, 2),
    (16, 128, 2),
    (16, 256, 4),
    (16, 512, 4),
    (32, 128, 4),
    (32, 256, 4),
    (64, 128, 4),
    (64, 64, 2),
    (128, 64, 4),
)

_PER_PAIR_GEMV_TILES = (
    # (BLOCK_N, BLOCK_K, num_warps, num_stages) with DOWN_PER_PAIR: the down launch a program per
    # pair. At one token of Qwen3-30B-A3B (H200, 2026-12-03) 8x256 took 31.3-32.0 us, the serial
    # launch's best 38.2 us. Three stages timed the same as one (32.1 us): Triton does not
    # pipeline these loads, which feed no dot, so only one stage is kept
    (8, 256, 2, 1),
    (16, 128, 2, 1),
    (16, 256, 4, 1),
    (32, 128, 4, 1),
)

# TOPK_TICKET (the top-k sum in the per-pair down launch, no launch of its own) for every per-pair
# tile, and for the two narrow ones (the tuner's picks at one and two tokens of Qwen3-30B-A3B) also
# with a down tile of its own: gate_up reads 2 x BLOCK_N rows of H, down BLOCK_N rows of the
# narrower I, so at one token its programs were a quarter as long (8 x 768 per program at 8 x 256).
# Neither was timed on a GPU when this was written; the tuner keeps them only where they win.
_DOWN_TILED = ((8, 256, 2), (16, 256, 4))
_DOWN_GEMV_TILES = (
    # (DOWN_BLOCK_N, DOWN_BLOCK_K, DOWN_WARPS)
    (16, 256, 4),
    (32, 256, 4),
    (64, 128, 4),
)
TICKET_MAX_TOKENS = 16  # the split counters serve launches of up to 16 rows (kernels/split_k.py)
_DOT_GEMV_TILES = (
    # (BLOCK_N, BLOCK_K, num_warps, num_stages) of the GEMV through tl.dot (DOT, with DOWN_PER_PAIR
    # and TOPK_TICKET): the row padded to 16 so that Triton pipelines the weight loads, as in the
    # dense skinny GEMM, whose tiles these follow. The CUDA-core GEMV streamed Qwen3-30B-A3B's
    # experts at 58% of the weight-streaming bound at one token (H200).
    (16, 128, 4, 4),
    (16, 256, 4, 4),
    (32, 128, 4, 4),
    (32, 256, 4, 3),
    (64, 128, 4, 3),
)
_ONE_LAUNCH_GEMV_TILES = (
    # (BLOCK_N, BLOCK_K, num_warps, num_stages, DOT, DOWN_BLOCK_N) of ONE_LAUNCH: gate_up's tile
    # (through tl.dot or on CUDA cores, as above), and the columns of H a down program holds, all
    # of I at once (ONE_LAUNCH_MAX_ELEMENTS bounds it)
    (16, 128, 4, 4, 1, 8),
    (16, 128, 4, 4, 1, 16),
    (16, 256, 4, 4, 1, 16),
    (32, 128, 4, 4, 1, 16),
    (64, 128, 4, 3, 1, 16),
    (32, 128, 8, 4, 1, 32),
    (16, 128, 8, 4, 1, 16),
    (8, 256, 2, 1, 0, 8),
    (16, 256, 4, 1, 0, 8),
    (16, 256, 4, 1, 0, 16),
)
# A down program of ONE_LAUNCH holds its DOWN_BLOCK_N x next_power_of_2(I) weight tile in registers:
# at most this many elements a thread (bf16: half as many 32-bit registers)
ONE_LAUNCH_MAX_ELEMENTS = 128

_TILES = (
    # (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages)
    # few rows an expert: 16-row blocks, narrow columns for programs enough to fill the GPU
    (16, 32, 128, 1, 4, 4),
    (16, 64, 64, 1, 4, 4),
    (16, 64, 128, 8, 4, 3),
    (16, 128, 64, 8, 4, 4),
    (32, 64, 64, 8, 4, 4),
    (32, 128, 64, 8, 4, 3),
    # many rows an expert: compute-bound tiles
    (64, 64, 64, 8, 4, 4),
    (64, 128, 64, 8, 4, 3),
    (64, 128, 64, 8, 8, 4),
    (128, 64, 64, 8, 4, 4),
    (128, 128, 64, 8, 8, 3),
    (128, 128, 32, 8, 8, 4),
    (128, 256, 64, 8, 8, 3),
)

_SPLIT_TILES = (
    # (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages) with the activation a launch of
    # its own (SPLIT_ACT): one weight tile a K step, so wider tiles fit than with it fused
    (64, 128, 64, 8, 4, 4),
    (128, 128, 64, 8, 8, 4),
    (128, 256, 64, 8, 8, 3),
)

_TMA_TILES = (
    # (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages, SPLIT_ACT) read by the tensor
    # memory accelerator (_moe_gemm_kernel's TMA, sm_90): the prefill buckets' compute-bound tiles.
    # Timed at Mixtral-8x7B's 512, 1,024 and 4,096 tokens (H200, 2026-12-04), 128x128x64 at four
    # stages was the fastest of every tile at all three: 5-12% under the fastest tile read by pointers.
    # Also timed there and never within 10% of the best, so left out: 128x64x64 w4, BLOCK_K 128 at
    # two stages (128x128, and 128x256 SPLIT_ACT), 256x128 SPLIT_ACT, and 64x256 (w8, fused or
    # SPLIT_ACT; it halves the padding where an expert's rows overrun a block, but ran 7-15% slower).
    (64, 128, 64, 8, 4, 4, 0),
    (128, 128, 64, 8, 8, 3, 0),
    (128, 128, 64, 8, 8, 4, 0),
    (128, 256, 64, 8, 8, 3, 1),
    (128, 256, 64, 8, 8, 4, 1),
)

CONFIG_SPACE: list[KernelConfig] = (
    [NAIVE]
    + [
        KernelConfig({"gemv": 1, "BLOCK_N": n, "BLOCK_K": k}, num_warps=w, num_stages=1)
        for n, k, w in _GEMV_TILES
    ]
    + [
        KernelConfig({"gemv": 1, "BLOCK_N": n, "BLOCK_K": k, "DOWN_PER_PAIR": 1}, num_warps=w, num_stages=st)
        for n, k, w, st in _PER_PAIR_GEMV_TILES
    ]
    + [
        KernelConfig(
            {"gemv": 1, "BLOCK_N": n, "BLOCK_K": k, "DOWN_PER_PAIR": 1, "TOPK_TICKET": 1, **down},
            num_warps=w, num_stages=st,
        )
        for n, k, w, st in _PER_PAIR_GEMV_TILES
        for down in [{}] + [
            {"DOWN_BLOCK_N": dn, "DOWN_BLOCK_K": dk, "DOWN_WARPS": dw}
            for dn, dk, dw in _DOWN_GEMV_TILES
            if (n, k, w) in _DOWN_TILED and (dn, dk, dw) != (n, k, w)
        ]
    ]
    + [
        KernelConfig(
            {"gemv": 1, "DOT": 1, "BLOCK_N": n, "BLOCK_K": k, "DOWN_PER_PAIR": 1, "TOPK_TICKET": 1},
            num_warps=w, num_stages=st,
        )
        for n, k, w, st in _DOT_GEMV_TILES
    ]
    + [
        KernelConfig({"BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": k, "GROUP_M": g}, num_warps=w, num_stages=s)
        for m, n, k, g, w, s in _TILES
    ]
    + [
        KernelConfig(
            {"BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": k, "GROUP_M": g, "SPLIT_ACT": 1},
            num_warps=w,
            num_stages=s,
        )
        for m, n, k, g, w, s in _SPLIT_TILES
    ]
    + [
        KernelConfig(
            {"BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": k, "GROUP_M": g, "TMA": 1, **({"SPLIT_ACT": 1} if split else {})},
            num_warps=w,
            num_stages=s,
        )
        for m, n, k, g, w, s, split in _TMA_TILES
    ]
    + [GROUPED]
)

# ONE_LAUNCH configs: timed by the build only with PAGECAST_MOE_ONE_LAUNCH=1 (config_space) until
# they have run on a GPU (their down programs wait on flags other programs of the launch set)
ONE_LAUNCH_SPACE: list[KernelConfig] = [
    KernelConfig(
        {"gemv": 1, "ONE_LAUNCH": 1, **({"DOT": 1} if dot else {}), "BLOCK_N": n, "BLOCK_K": k,
         "DOWN_BLOCK_N": dn, "DOWN_PER_PAIR": 1, "TOPK_TICKET": 1},
        num_warps=w, num_stages=st,
    )  # fmt: skip
    for n, k, w, st, dot, dn in _ONE_LAUNCH_GEMV_TILES
]


def config_space() -> list[KernelConfig]:
    """The build tuner's space: CONFIG_SPACE, and ONE_LAUNCH_SPACE where the environment sets
    PAGECAST_MOE_ONE_LAUNCH=1 (read at each call, so a build process can set it)."""
    return CONFIG_SPACE + (ONE_LAUNCH_SPACE if os.environ.get("PAGECAST_MOE_ONE_LAUNCH") == "1" else [])


GEMV_MAX_PAIRS = 128  # more pairs re-read shared experts' weights once a pair (from L2 at best)
SHARED_MEMORY_LIMIT = 232448  # sm_90 (H100/H200): bytes of shared memory one program may use


def is_naive(config: KernelConfig | None) -> bool:
    return config is not None and bool(config.params.get("naive"))


def is_gemv(config: KernelConfig | None) -> bool:
    return config is not None and bool(config.params.get("gemv"))


def is_grouped(config: KernelConfig | None) -> bool:
    return config is not None and bool(config.params.get("grouped"))


def grouped_supported(dtype: torch.dtype) -> bool:
    """Whether GROUPED runs here in ``dtype``: PyTorch's grouped GEMM on a Hopper GPU takes bf16
    (and no other dtype without a slower fallback); on the CPU (no GPU) torch computes it in any
    float dtype, which is what the tests use."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    if not torch.cuda.is_available():
        return True
    return dtype == torch.bfloat16 and torch.cuda.get_device_capability() >= (9, 0)


def tma_supported() -> bool:
    """Whether TMA tiles can run here: a CUDA GPU of compute capability 9 or more (Hopper), or no
    GPU at all (Triton's CPU interpreter emulates the tensor descriptors)."""
    return not torch.cuda.is_available() or torch.cuda.get_device_capability() >= (9, 0)


def _tma_ready(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor) -> bool:
    """Whether the operands meet the copy engine's rules: contiguous weights at 16-byte aligned
    addresses, and rows of x, of the weights and of the intermediate (I wide) a multiple of 16
    bytes (x itself is gathered into a new tensor first)."""
    elt = x.element_size()
    return (
        w_gate_up.is_contiguous()
        and w_down.is_contiguous()
        and w_gate_up.data_ptr() % 16 == 0
        and w_down.data_ptr() % 16 == 0
        and (x.shape[1] * elt) % 16 == 0
        and (w_down.shape[2] * elt) % 16 == 0
    )


def shared_memory(config: KernelConfig, elt: int) -> int:
    """Bytes of shared memory a tile config of the gate_up launch (two weight tiles a K step, one
    with SPLIT_ACT) needs: the pipeliner's buffers of the activations and both weight tiles, num_stages of them
    where the dot runs on wgmma (half types, 64 or more rows), num_stages - 1 for half types'
    narrower tiles. Checked against sm_90 compiles of every tile in bf16 (Triton 3.6: exact;
    tests/test_fused_moe_compile_sm90.py, TMA tiles too); fp32 is counted num_stages deep, an upper bound."""
    bm, bn, bk, stages = config["BLOCK_M"], config["BLOCK_N"], config["BLOCK_K"], config.num_stages
    buffers = max(stages - 1, 1) if elt <= 2 and bm < 64 else max(stages, 1)
    weight_tiles = 1 if config.params.get("SPLIT_ACT") else 2
    barriers = 32 * stages if config.params.get("TMA") else 0  # the copy engine's mbarriers (an upper bound)
    return buffers * (bm * bk + weight_tiles * bk * bn) * elt + barriers


def prune_configs(
    configs: list[KernelConfig], num_tokens: int, top_k: int, num_experts: int, hidden: int, intermediate: int,
    *, elt: int = 2, allow_naive: bool = True, tma: bool | None = None, grouped: bool = False,
) -> list[KernelConfig]:  # fmt: skip
    """The configs worth timing at this shape: the naive loop where ``allow_naive`` (batches never
    captured in a CUDA graph); the GEMV up to GEMV_MAX_PAIRS pairs, with BLOCK_K at most the
    smaller reduction (I, for down) rounded up to a power of two; tiles whose BLOCK_M is at most
    the expected rows an expert (P / min(E, P), rounded up to a power of two, at least 16) and,
    from 64 rows an expert, at least 64; whose BLOCK_K fits the smaller reduction; whose shared
    memory fits SHARED_MEMORY_LIMIT; TMA tiles only where ``tma`` (None: ``tma_supported()``);
    GROUPED only where ``grouped`` (``grouped_supported`` for the model's dtype) and an expert gets
    at least GROUP_ALIGN rows on average (below that the GEMV and the small tiles read less)."""
    if tma is None:
        tma = tma_supported()
    pairs = num_tokens * top_k
    rows = max(16, triton.next_power_of_2(triton.cdiv(pairs, min(num_experts, pairs))))
    k_min = triton.next_power_of_2(min(hidden, intermediate))
    kept = []
    for c in configs:
        if is_naive(c):
            if allow_naive:
                kept.append(c)
        elif is_grouped(c):
            if grouped and pairs >= GROUP_ALIGN * min(num_experts, pairs):
                kept.append(c)
        elif is_gemv(c):
            ticket_ok = num_tokens <= TICKET_MAX_TOKENS or not c.params.get("TOPK_TICKET")
            if c.params.get("ONE_LAUNCH") and not one_launch_fits(c, intermediate):
                continue
            if pairs <= GEMV_MAX_PAIRS and max(c["BLOCK_K"], c.params.get("DOWN_BLOCK_K", 0)) <= k_min and ticket_ok:
                kept.append(c)
        else:
            bm = c["BLOCK_M"]
            if bm > rows or (rows >= 64 and bm < 64) or c["BLOCK_K"] > k_min:
                continue
            if shared_memory(c, elt) > SHARED_MEMORY_LIMIT or (c.params.get("TMA") and not tma):
                continue
            kept.append(c)
    return kept


def one_launch_fits(config: KernelConfig, intermediate: int) -> bool:
    """Whether a ONE_LAUNCH config's down programs can hold their weight tile (DOWN_BLOCK_N rows of
    all of I, padded to a power of two) in registers: ONE_LAUNCH_MAX_ELEMENTS a thread at most."""
    elements = config["DOWN_BLOCK_N"] * triton.next_power_of_2(intermediate)
    return elements <= ONE_LAUNCH_MAX_ELEMENTS * 32 * config.num_warps


def default_config(
    num_tokens: int, top_k: int, num_experts: int, hidden: int, intermediate: int, num_sms: int = 132,
    elt: int = 2,
) -> KernelConfig:  # fmt: skip
    """Untuned choice: the GEMV for up to 32 pairs where a balanced router's tokens visit each
    expert they visit at most 1.5 times on average (the GEMV reads an expert's weights once a
    pair), its BLOCK_N the widest of 32, 16 and 8 that gives the down launch (a program per token
    and column block) two programs a multiprocessor, and its down launch a program per pair where
    a program per token would leave fewer than four a multiprocessor at BLOCK_N 8; else a tile
    sized by the rows an expert gets, pipelined less deep where its shared memory (activations of
    ``elt`` bytes) would not fit SHARED_MEMORY_LIMIT (fp32's widest tiles; half types always fit)."""
    pairs = num_tokens * top_k
    visited = num_experts * (1 - (1 - top_k / num_experts) ** num_tokens)  # expected, uniform routing
    if pairs <= 32 and pairs <= 1.5 * visited:
        bn = next((b for b in (32, 16) if num_tokens * triton.cdiv(hidden, b) >= 2 * num_sms), 8)
        bk = min(256, triton.next_power_of_2(min(hidden, intermediate)))
        params = {"gemv": 1, "BLOCK_N": bn, "BLOCK_K": bk}
        if top_k > 1 and num_tokens * triton.cdiv(hidden, 8) < 4 * num_sms:
            # Fewer than 4 down programs a multiprocessor even at the narrowest column block, each
            # streaming top_k experts one after another: a program per pair instead (the tuner's
            # pick at 1 and 2 tokens of Qwen3-30B-A3B; at 4 it kept the serial launch).
            params["DOWN_PER_PAIR"] = 1
        return KernelConfig(params, 4 if bn * bk >= 4096 else 2, 1)
    rows = triton.cdiv(pairs, min(num_experts, pairs))
    bk = 64 if min(hidden, intermediate) >= 64 else 32
    if rows <= 16:
        bm, bn, gm, warps, stages = 16, 64, 1, 4, 4
    elif rows <= 48:
        bm, bn, gm, warps, stages = 32, 64, 8, 4, 4
    elif rows <= 96:
        bm, bn, gm, warps, stages = 64, 128, 8, 4, 3
    else:
        bm, bn, gm, warps, stages = 128, 128, 8, 8, 3
    cfg = KernelConfig({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": gm}, warps, stages)
    while cfg.num_stages > 1 and shared_memory(cfg, elt) > SHARED_MEMORY_LIMIT:
        cfg = KernelConfig(cfg.params, cfg.num_warps, cfg.num_stages - 1)
    return cfg


# ---------------------------------------------------------------------------- launchers


def max_blocks(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Blocks of BLOCK_M rows any routing of ``num_pairs`` pairs can need: each expert's run
    rounds up by less than one block, and at most min(E, P) experts have a run."""
    return triton.cdiv(num_pairs, block_m) + min(num_experts, num_pairs)


ALIGN_CHUNK = 1024  # pairs (and blocks, and padding slots) the align kernels take a step


def align_by_expert(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """topk_ids [T, k] -> (sorted_ids int32 [max_blocks * block_m]: pair ids grouped by expert,
    each expert's run padded to a multiple of block_m with P; block_expert int32 [max_blocks]:
    each block's expert, -1 past the used blocks). Two launches (count and lay out, then
    scatter), no host sync; within an expert's run the pairs' order is the atomics' (which
    reference.moe_align_by_expert, the same layout in pair order, leaves out)."""
    flat = topk_ids.reshape(-1)
    p = flat.numel()
    nb = max_blocks(p, num_experts, block_m)
    dev = flat.device
    sorted_ids = torch.empty((nb * block_m,), dtype=torch.int32, device=dev)
    block_expert = torch.empty((nb,), dtype=torch.int32, device=dev)
    cursor = torch.empty((num_experts,), dtype=torch.int32, device=dev)
    _moe_align_kernel[(1,)](
        flat, sorted_ids, block_expert, cursor, p, num_experts, nb,
        BLOCK_M=block_m, NUM_BINS=(bins := triton.next_power_of_2(num_experts)), CHUNK=ALIGN_CHUNK,
        BLOCKS_STEP=max(16, 8192 // bins), num_warps=8,
    )  # fmt: skip
    _moe_scatter_kernel[(triton.cdiv(p, ALIGN_CHUNK),)](
        flat, sorted_ids, cursor, p, CHUNK=ALIGN_CHUNK, num_warps=4
    )
    return sorted_ids, block_expert


def workspace_bytes(
    num_tokens: int, top_k: int, num_experts: int, hidden: int, intermediate: int, elt: int,
    config: KernelConfig,
) -> int:  # fmt: skip
    """Device memory one fused_moe call allocates besides its output [T, H] (for the memory plan),
    each buffer rounded up to the caching allocator's 512 bytes: the routing weights in fp32, the
    intermediate, and for the tile path the align buffers and the per-pair output the top-k sum
    reads (and with TMA the tokens gathered in sorted order). The naive loop: one expert's rows at worst (every token through one expert) through
    both projections (fp32 where the routing weights scale them), and their token lists."""

    def buf(n: int) -> int:
        return -(-n // 512) * 512

    t, p = num_tokens, num_tokens * top_k
    if is_naive(config):
        return buf(t * 8) * 3 + 6 * buf(t * max(2 * intermediate, hidden) * 4)
    if is_gemv(config):
        per_pair = buf(p * hidden * 4) if config.params.get("DOWN_PER_PAIR") else 0
        return buf(p * 4) + buf(p * intermediate * elt) + per_pair
    if is_grouped(config):
        rows = max_blocks(p, num_experts, GROUP_ALIGN) * GROUP_ALIGN
        # align_by_expert's buffers, the pairs' fp32 weights, the blocks' experts (twice: the sort
        # key, the biases' clamp), the experts, the group ends (int64, then int32), sorted_ids
        # widened, the gather index, the rows' experts, the row numbers, each pair's row; and
        # torch._grouped_mm's own workspace (the groups' problem shapes and pointers), bounded at 1 MiB
        fixed = (
            buf(rows * 4) + 3 * buf(rows // GROUP_ALIGN * 4) + 2 * buf(num_experts * 4) + buf(num_experts * 8)
            + buf(num_experts * 4) + buf(p * 4) + buf(rows * 8) + 3 * buf(rows * 4) + buf((p + 1) * 4) + (1 << 20)
        )  # fmt: skip
        x_rows, gu_rows, i_rows = (buf(rows * n * elt) for n in (hidden, 2 * intermediate, intermediate))
        # alive at once (_grouped_experts frees each product after its last use; a bias's rows
        # are gathered into a temporary the size of the product it is added to)
        phases = (x_rows + 2 * gu_rows, gu_rows + i_rows, i_rows + 2 * x_rows)
        return fixed + max(phases)
    bm = config["BLOCK_M"]
    nb = max_blocks(p, num_experts, bm)
    align = buf(nb * bm * 4) + buf(nb * 4) + buf(num_experts * 4)
    gate_up = buf(nb * bm * 2 * intermediate * elt) if config.params.get("SPLIT_ACT") else 0
    # TMA: the tokens gathered into sorted order, and the row indices they are gathered by
    gathered = buf(nb * bm * 4) + buf(nb * bm * hidden * elt) if config.params.get("TMA") else 0
    return buf(p * 4) + align + gate_up + gathered + buf(nb * bm * intermediate * elt) + buf(p * hidden * elt)


def check_shapes(
    x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, w_gate_up: torch.Tensor,
    w_down: torch.Tensor, b_gate_up: torch.Tensor | None, b_down: torch.Tensor | None,
) -> None:  # fmt: skip
    t, h = x.shape
    e, i2, h2 = w_gate_up.shape
    if h2 != h or i2 % 2:
        raise ValueError(f"w_gate_up must be [E, 2I, H={h}], got {tuple(w_gate_up.shape)}")
    if tuple(w_down.shape) != (e, h, i2 // 2):
        raise ValueError(f"w_down must be [E={e}, H={h}, I={i2 // 2}], got {tuple(w_down.shape)}")
    if topk_ids.shape != topk_weights.shape or topk_ids.dim() != 2 or topk_ids.shape[0] != t:
        raise ValueError(
            f"topk_ids / topk_weights must be [T={t}, k], got {tuple(topk_ids.shape)} / {tuple(topk_weights.shape)}"
        )
    if b_gate_up is not None and tuple(b_gate_up.shape) != (e, i2):
        raise ValueError(f"b_gate_up must be [E={e}, 2I={i2}], got {tuple(b_gate_up.shape)}")
    if b_down is not None and tuple(b_down.shape) != (e, h):
        raise ValueError(f"b_down must be [E={e}, H={h}], got {tuple(b_down.shape)}")
    for name, w in (("w_gate_up", w_gate_up), ("w_down", w_down)):
        if w.stride(2) != 1:
            raise ValueError(f"{name} must have a contiguous last dimension")
        if w.dtype != x.dtype:
            raise ValueError(f"{name} is {w.dtype}, x is {x.dtype}")


def _activation(gate_up: torch.Tensor, activation: str, alpha: float, limit: float) -> torch.Tensor:
    """gate_up [rows, 2I] -> [rows, I] for SPLIT_ACT: SiLU-and-mul by kernels/activation.py's kernel,
    gpt-oss's SwiGLU by the reference's torch ops (both round as the reference does)."""
    if activation == "silu":
        return activation_kernels.silu_and_mul(gate_up)
    return reference.moe_activation(gate_up, activation, alpha, limit)


def fused_moe(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    b_gate_up: torch.Tensor | None = None,
    b_down: torch.Tensor | None = None,
    activation: str = "silu",
    alpha: float = 1.702,
    limit: float = 7.0,
    config: Mapping[str, int] | KernelConfig | None = None,
) -> torch.Tensor:
    """reference.fused_moe's result (x [T, H] -> [T, H] in x's dtype, fp32 accumulation) by the
    tile path, the GEMV path or the naive loop as ``config`` says (None: ``default_config``).
    The tile and GEMV paths never sync with the host."""
    check_shapes(x, topk_weights, topk_ids, w_gate_up, w_down, b_gate_up, b_down)
    if activation not in _ACTIVATIONS:
        raise ValueError(f"unknown MoE activation {activation!r}")
    t, h = x.shape
    num_experts, i = w_gate_up.shape[0], w_gate_up.shape[1] // 2
    top_k = topk_ids.shape[1]
    cfg = KernelConfig.coerce(config) or default_config(
        t, top_k, num_experts, h, i, num_sms(x.device), x.element_size()
    )
    if is_naive(cfg):
        return reference.fused_moe(
            x, topk_weights, topk_ids, w_gate_up, w_down, b_gate_up, b_down, activation, alpha, limit
        )
    if t == 0:
        return torch.zeros_like(x)
    if x.stride(1) != 1:
        x = x.contiguous()
    p = t * top_k
    ids = topk_ids.reshape(-1)
    weights = topk_weights.reshape(-1).float()
    act = _ACTIVATIONS[activation]
    dot = "ieee" if x.dtype == torch.float32 else "tf32"
    common = {"ALPHA": alpha, "LIMIT": limit}
    if is_grouped(cfg):
        return _grouped_experts(x, weights, ids, w_gate_up, w_down, b_gate_up, b_down, activation, alpha, limit)
    if is_gemv(cfg):
        launches = (  # (weight, bias, output columns, reduction, activation)
            (w_gate_up, b_gate_up, i, h, act),
            (w_down, b_down, h, i, ACT_NONE),
        )
        per_pair = bool(cfg.params.get("DOWN_PER_PAIR"))
        # The down launch's own tile where the config names one (DOWN_BLOCK_N, DOWN_BLOCK_K,
        # DOWN_WARPS: its reduction is I, not H, and its programs a pair's H columns), else gate_up's.
        tiles = (
            (cfg["BLOCK_N"], cfg["BLOCK_K"], cfg.num_warps),
            (cfg.params.get("DOWN_BLOCK_N", cfg["BLOCK_N"]), cfg.params.get("DOWN_BLOCK_K", cfg["BLOCK_K"]),
             cfg.params.get("DOWN_WARPS", cfg.num_warps)),
        )  # fmt: skip
        ticket = per_pair and bool(cfg.params.get("TOPK_TICKET")) and t <= TICKET_MAX_TOKENS
        dot_gemv = bool(cfg.params.get("DOT"))
        inter = torch.empty((p, i), dtype=x.dtype, device=x.device)
        out = torch.empty((t, h), dtype=x.dtype, device=x.device)
        if ticket and cfg.params.get("ONE_LAUNCH"):
            down_out = torch.empty((p, h), dtype=torch.float32, device=x.device)
            bn, dbn = cfg["BLOCK_N"], cfg["DOWN_BLOCK_N"]
            down_blocks = triton.cdiv(h, dbn)
            counters = split_k.counters(x.device, t * down_blocks + p, "fused_moe")
            grid = (p * (triton.cdiv(i, bn) + down_blocks),)
            _moe_gemv_one_launch_kernel[grid](
                x, w_gate_up, w_down, b_gate_up if b_gate_up is not None else w_gate_up,
                b_down if b_down is not None else w_down, inter, down_out, out, ids, weights, counters, p, h, i,
                x.stride(0), w_gate_up.stride(0), w_gate_up.stride(1), b_gate_up.stride(0) if b_gate_up is not None else 0,
                w_down.stride(0), w_down.stride(1), b_down.stride(0) if b_down is not None else 0, top_k,
                ACTIVATION=act, HAS_BIAS=b_gate_up is not None, HAS_DOWN_BIAS=b_down is not None, BLOCK_N=bn, BLOCK_K=cfg["BLOCK_K"], DOWN_BLOCK_N=dbn,
                DOWN_K=triton.next_power_of_2(i), DOT=dot_gemv, DOT_PRECISION=dot, num_warps=cfg.num_warps,
                num_stages=cfg.num_stages, **common, **pdl.launch_options(),
            )  # fmt: skip
            return out
        down_out = torch.empty((p, h), dtype=torch.float32, device=x.device) if per_pair else out
        down_rows = p if per_pair else t
        counters = split_k.counters(x.device, t * triton.cdiv(h, tiles[1][0]), "fused_moe") if ticket else out
        for (w, b, n, k, a_kind), a, c, rows, (bn, bk, warps), last in zip(
            launches, (x, inter), (inter, down_out), (p, down_rows), tiles, (False, True)
        ):
            _moe_gemv_kernel[(rows, triton.cdiv(n, bn))](
                a, w, b if b is not None else w, c, ids, weights, n, k,
                a.stride(0), w.stride(0), w.stride(1), b.stride(0) if b is not None else 0, c.stride(0), top_k,
                out, counters, ACTIVATION=a_kind, HAS_BIAS=b is not None, BLOCK_N=bn, BLOCK_K=bk, PER_PAIR=per_pair,
                TICKET=ticket and last, DOT=dot_gemv, DOT_PRECISION=dot, num_warps=warps, num_stages=cfg.num_stages,
                **common, **pdl.launch_options(),
            )  # fmt: skip
        if per_pair and not ticket:
            block = min(TOPK_SUM_BLOCK, triton.next_power_of_2(h))
            grid = (t, triton.cdiv(h, block))
            _moe_topk_sum_kernel[grid](down_out, out, h, top_k, BLOCK=block, num_warps=4, **pdl.launch_options())
        return out
    bm, bn, bk, gm = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"], cfg["GROUP_M"]
    sorted_ids, block_expert = align_by_expert(ids.view(t, top_k), num_experts, bm)
    nb = block_expert.shape[0]

    tma = bool(cfg.params.get("TMA")) and _tma_ready(x, w_gate_up, w_down)

    def gemm(a: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, c: torch.Tensor, n: int, k: int,
             a_kind: int, weighted: bool) -> None:  # fmt: skip
        # With TMA: descriptors over a's rows and the weights as [E * N_w, K] (the strides unused)
        a_arg = TensorDescriptor.from_tensor(a, [bm, bk]) if tma else a
        w_arg = TensorDescriptor.from_tensor(w.view(-1, k), [bn, bk]) if tma else w
        _moe_gemm_kernel[(nb * triton.cdiv(n, bn),)](
            a_arg, w_arg, b if b is not None else w, c, sorted_ids, block_expert, weights, n, k, p, nb,
            a.stride(0), w.stride(0), w.stride(1), b.stride(0) if b is not None else 0, c.stride(0), top_k,
            ACTIVATION=a_kind, MUL_ROUTING_WEIGHT=weighted, HAS_BIAS=b is not None,
            BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=gm, DOT_PRECISION=dot, TMA=tma,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages, **common,
        )  # fmt: skip

    if tma:
        # The copy engine reads consecutive rows only: gather each block's tokens into sorted order
        # (padding rows read the last token; the down launch never stores them).
        x = x.index_select(0, (sorted_ids // top_k).clamp_(0, t - 1))
    if cfg.params.get("SPLIT_ACT"):
        # Padding rows stay uninitialised: the activation runs over them too, the down launch masks them.
        gate_up = torch.empty((nb * bm, 2 * i), dtype=x.dtype, device=x.device)
        gemm(x, w_gate_up, b_gate_up, gate_up, 2 * i, h, ACT_NONE, False)
        inter = _activation(gate_up, activation, alpha, limit)
    else:
        inter = torch.empty((nb * bm, i), dtype=x.dtype, device=x.device)
        gemm(x, w_gate_up, b_gate_up, inter, i, h, act, False)
    out = torch.empty((p, h), dtype=x.dtype, device=x.device)
    gemm(inter, w_down, b_down, out, h, i, ACT_NONE, True)
    return out if top_k == 1 else out.view(t, top_k, h).sum(1)


def _grouped_experts(
    x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
    b_gate_up: torch.Tensor | None, b_down: torch.Tensor | None, activation: str, alpha: float, limit: float,
) -> torch.Tensor:  # fmt: skip
    """GROUPED (the module docstring): x [T, H], the pairs' fp32 weights and experts [P] -> [T, H]."""
    t, h = x.shape
    num_experts, p = w_gate_up.shape[0], ids.numel()
    top_k = p // t
    dev = x.device
    sorted_ids, block_expert = align_by_expert(ids.view(t, top_k), num_experts, GROUP_ALIGN)
    rows = sorted_ids.numel()
    # Each expert's group ends where its last block of align_by_expert's layout does: the blocks of
    # experts up to it (the unused blocks, -1, sort last), read from the layout itself.
    blocks = torch.where(block_expert < 0, num_experts, block_expert)
    experts = torch.arange(num_experts, dtype=blocks.dtype, device=dev)
    ends = (torch.searchsorted(blocks, experts, right=True) * GROUP_ALIGN).to(torch.int32)
    # Padding rows read the last token; past the last group's end the products are never read.
    # Each product is freed after its last use (workspace_bytes counts what is alive at once).
    gathered = x.index_select(0, (sorted_ids // top_k).clamp_(0, t - 1))
    gate_up = torch._grouped_mm(gathered, w_gate_up.transpose(1, 2), offs=ends)
    del gathered
    if b_gate_up is not None or b_down is not None:
        row_expert = block_expert.clamp(0, num_experts - 1).repeat_interleave(GROUP_ALIGN)
    if b_gate_up is not None:  # torch._grouped_mm takes no bias
        gate_up += b_gate_up.index_select(0, row_expert)
    inter = _activation(gate_up, activation, alpha, limit)
    del gate_up
    down = torch._grouped_mm(inter, w_down.transpose(1, 2), offs=ends)
    del inter
    if b_down is not None:
        down += b_down.index_select(0, row_expert)
    # Each pair's row: sorted_ids inverted (every padding slot holds P, so they all land in slot P).
    row_of_pair = torch.empty(p + 1, dtype=torch.int32, device=dev)
    row_of_pair.scatter_(0, sorted_ids.long().clamp_(0, p), torch.arange(rows, dtype=torch.int32, device=dev))
    out = torch.empty((t, h), dtype=x.dtype, device=dev)
    block = min(TOPK_SUM_BLOCK, triton.next_power_of_2(h))
    _moe_gather_sum_kernel[(t, triton.cdiv(h, block))](
        down, row_of_pair, weights, out, h, top_k, BLOCK=block, num_warps=4
    )
    return out
