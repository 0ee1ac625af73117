"""Fused mixture-of-experts with FP8 (W8A8, OCP e4m3) experts: kernels/fused_moe.py's two paths
with fp8 x fp8 products, fp32 accumulation and the scales applied in the epilogue.

Expert weights in the artifact layout (builder/fp8.py, ``expert parts``):

    w_gate_up  float8_e4m3fn [E, 2I, H]   gate rows then up rows, as kernels/moe_routing.py's layout
    s_gate_up  float32 [E, 2I]            "channel": one scale per output row (amax / 448), or
               float32 [E, 2I, ceil(H/128)]  "block": per output row and 128-column block
    w_down     float8_e4m3fn [E, H, I],  s_down [E, H] or [E, H, ceil(I/128)]

Activations are quantised at run time as the dense FP8 GEMM quantises them (kernels/fp8_gemm.py,
reference.quantize_fp8_activations): per token with channel scales ("token"), per 1x128 group with
block scales ("group"): x before gate_up, and each (token, expert) pair's intermediate row before
down. The tile path quantises each input in a launch of its own (``fp8_gemm.quantize_activations``,
the dense GEMM's), the GEMV path in its programs' registers with the same arithmetic
(``fp8_gemm._scale_of`` and ``_quantise_rows``: the saturating round-to-nearest-even cast), so the
whole launcher is tested on the CPU (kernels/interpreter_fix.py makes the interpreter's e4m3 casts
torch's) against ``reference.fused_moe_fp8``.

Prefill-sized batches (the tile path, ``_moe_fp8_gemm_kernel``): fused_moe.align_by_expert's sorted
blocks; a program's [BLOCK_M, BLOCK_N] tile takes ``tl.dot`` of e4m3 tiles every BLOCK_K step,
each step's product started from zero and added into an fp32 accumulator (as the dense kernel:
Hopper's fp8 wgmma accumulates in reduced precision). Channel scales multiply the sum once, x
scale per row times weight scale per column, before the activation (gate and up have their own
columns' scales); block scales (BLOCK_K divides 128, so a step lies in one block) each step's
product. gate_up writes the activated intermediate in the half type in sorted order; it is
quantised per row (padding rows too: they hold garbage, are never read back); down scales by the
routing weights and scatters to pair order; the top-k sum as in fused_moe.

Decode batches (the GEMV path, ``{"gemv": 1, ...}``): no sorting, two launches as fused_moe's; a
program per (pair, columns) for gate_up, per (token, columns) for down adding its k pairs. It reads
the half-type activations (x; the intermediate in pair order) and quantises them itself (per
token: a first pass over the row for its amax, every program again, the row is a few KB in L2; per
group: BLOCK_K is 128, each step its own group), multiplies the e4m3 values by the e4m3 weights in
fp32 on CUDA cores (the products are exact in fp32: the tensor-core path's arithmetic up to the
order of the fp32 sums) and applies the scales as the tile path does. Both paths compute the
emulation's values.

``{"naive": 1}``: the baseline the tuner times against, a per-expert loop of the dense FP8 GEMM
(kernels/fp8_gemm.fp8_linear at its launcher's default config: torch._scaled_mm from 64 rows
where it runs). It syncs with the host; kernels/problems.py offers it only where no CUDA graph
captures the bucket.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import triton
import triton.language as tl

from pagecast.kernels import fused_moe, reference
from pagecast.kernels.fp8_gemm import _quantise_rows, _scale_of, quantize_activations
from pagecast.kernels.fused_moe import _activate, _tile_block, _tile_epilogue, _tile_rows
from pagecast.kernels.tuning import KernelConfig, num_sms

GROUP = reference.FP8_GROUP
FP8_MAX = reference.FP8_MAX


# ---------------------------------------------------------------------------- the tile path


@triton.jit(do_not_specialize=["num_pairs", "max_blocks"])  # one variant for every token count (fused_moe.py)
def _moe_fp8_gemm_kernel(
    a_ptr,  # e4m3, gate_up: quantised x [T, K]; down: quantised intermediate [max_blocks * BLOCK_M, K]
    as_ptr,  # fp32 activation scales, a's rows: [rows] (token) or [rows, KB] (group)
    w_ptr,  # e4m3 [E, N_w, K]: N_w = 2N (gate rows, then up rows) with an activation, else N
    ws_ptr,  # fp32 [E, N_w] (channel) or [E, N_w, KB] (block)
    b_ptr,  # [E, N_w] (gpt-oss's expert biases, the half type) or unused
    c_ptr,  # gate_up: intermediate [max_blocks * BLOCK_M, N] in sorted order; down: [P, N] in pair order
    sorted_ids_ptr,  # int32 [max_blocks * BLOCK_M]: pair ids grouped by expert, num_pairs = padding
    block_expert_ptr,  # int32 [max_blocks]: the expert of each block, -1 for unused blocks
    weights_ptr,  # fp32 [P] routing weights (MUL_ROUTING_WEIGHT) or unused
    N,
    K,
    num_pairs,
    max_blocks,
    stride_am,
    stride_we,
    stride_wn,
    stride_se,
    stride_be,
    stride_cm,
    top_k,
    ACTIVATION: tl.constexpr,  # 0: none (down), 1: SiLU-and-mul, 2: gpt-oss SwiGLU
    MUL_ROUTING_WEIGHT: tl.constexpr,
    BLOCK_SCALED: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ALPHA: tl.constexpr,
    LIMIT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    GROUP_K: tl.constexpr,
):
    pid_m, pid_n, expert = _tile_block(max_blocks, block_expert_ptr, N, BLOCK_N, GROUP_M)
    if expert < 0:
        return
    offs_m, pair, m_ok, a_rows, offs_n, n_ok = _tile_rows(
        pid_m, pid_n, sorted_ids_ptr, num_pairs, top_k, N, MUL_ROUTING_WEIGHT, BLOCK_M, BLOCK_N
    )
    w_base = w_ptr + expert.to(tl.int64) * stride_we
    s_base = ws_ptr + expert.to(tl.int64) * stride_se
    num_kb = tl.cdiv(K, GROUP_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        a = tl.load(a_ptr + a_rows[:, None] * stride_am + offs_k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w_ok = k_ok[:, None] & n_ok[None, :]
        w = tl.load(w_base + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None], mask=w_ok, other=0.0)
        part = tl.dot(a, w)  # [BLOCK_M, BLOCK_N] fp32, a fresh dot promoted into acc every step
        if ACTIVATION != 0:
            w_up = tl.load(
                w_base + (N + offs_n)[None, :].to(tl.int64) * stride_wn + offs_k[:, None], mask=w_ok, other=0.0
            )
            part_up = tl.dot(a, w_up)
        if BLOCK_SCALED:
            kb = k0 // GROUP_K
            sa = tl.load(as_ptr + a_rows * num_kb + kb, mask=m_ok, other=0.0)[:, None]
            acc += part * sa * tl.load(s_base + offs_n.to(tl.int64) * num_kb + kb, mask=n_ok, other=0.0)[None, :]
            if ACTIVATION != 0:
                sw_up = tl.load(s_base + (N + offs_n).to(tl.int64) * num_kb + kb, mask=n_ok, other=0.0)
                acc_up += part_up * sa * sw_up[None, :]
        else:
            acc += part
            if ACTIVATION != 0:
                acc_up += part_up
    if not BLOCK_SCALED:
        sa = tl.load(as_ptr + a_rows, mask=m_ok, other=0.0)[:, None]
        acc = acc * sa * tl.load(s_base + offs_n, mask=n_ok, other=0.0)[None, :]
        if ACTIVATION != 0:
            acc_up = acc_up * sa * tl.load(s_base + N + offs_n, mask=n_ok, other=0.0)[None, :]
    _tile_epilogue(
        acc, acc_up, b_ptr, expert, stride_be, weights_ptr, c_ptr, stride_cm, offs_m, pair, m_ok, offs_n, n_ok, N,
        HAS_BIAS, ACTIVATION, ALPHA, LIMIT, MUL_ROUTING_WEIGHT,
    )  # fmt: skip


# ---------------------------------------------------------------------------- the GEMV path


@triton.jit
def _expert_gemv_fp8(
    a_ptr,  # one row of half / fp32 activations [K], quantised here
    w_base,  # the expert's e4m3 weight [N_w, K]
    s_base,  # its scales [N_w] or [N_w, KB]
    offs_n,
    n_ok,
    N,
    K,
    stride_wn,
    GATED: tl.constexpr,  # also the up rows N + offs_n
    BLOCK_SCALED: tl.constexpr,  # then BLOCK_K == GROUP_K: a step is one 1x128 activation group
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_K: tl.constexpr,
    MIN_AMAX: tl.constexpr,
    QMAX: tl.constexpr,
):
    # The row quantised as quantize_activations does (per token: a first pass for the amax, the row is a
    # few KB and stays in L2; per group: each step's own amax), held as fp32 values on the e4m3
    # grid; [BLOCK_N, BLOCK_K] partial products in fp32 (exact), reduced over K at the end; block
    # scales weight each step's products, channel scales the sums.
    num_kb = tl.cdiv(K, GROUP_K)
    sa = 1.0
    if not BLOCK_SCALED:
        amax = tl.zeros((BLOCK_K,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            amax = tl.maximum(amax, tl.abs(tl.load(a_ptr + offs_k, mask=offs_k < K, other=0.0).to(tl.float32)))
        sa = _scale_of(tl.max(amax, axis=0), MIN_AMAX, QMAX)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        x = tl.load(a_ptr + offs_k, mask=k_ok, other=0.0).to(tl.float32)
        if BLOCK_SCALED:
            sa = _scale_of(tl.max(tl.abs(x), axis=0), MIN_AMAX, QMAX)
        a = _quantise_rows(x, sa, QMAX, tl.float8e4nv).to(tl.float32)[None, :]
        w_ok = n_ok[:, None] & k_ok[None, :]
        w = tl.load(w_base + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :], mask=w_ok, other=0.0)
        prod = w.to(tl.float32) * a
        if GATED:
            w_up = tl.load(
                w_base + (N + offs_n)[:, None].to(tl.int64) * stride_wn + offs_k[None, :], mask=w_ok, other=0.0
            )
            prod_up = w_up.to(tl.float32) * a
        if BLOCK_SCALED:
            kb = k0 // GROUP_K
            acc += prod * (sa * tl.load(s_base + offs_n.to(tl.int64) * num_kb + kb, mask=n_ok, other=0.0))[:, None]
            if GATED:
                sw_up = tl.load(s_base + (N + offs_n).to(tl.int64) * num_kb + kb, mask=n_ok, other=0.0)
                acc_up += prod_up * (sa * sw_up)[:, None]
        else:
            acc += prod
            if GATED:
                acc_up += prod_up
    y = tl.sum(acc, axis=1)
    y_up = tl.sum(acc_up, axis=1)
    if not BLOCK_SCALED:
        y = y * sa * tl.load(s_base + offs_n, mask=n_ok, other=0.0)
        if GATED:
            y_up = y_up * sa * tl.load(s_base + N + offs_n, mask=n_ok, other=0.0)
    return y, y_up  # [BLOCK_N] each


@triton.jit
def _moe_fp8_gemv_kernel(
    a_ptr,  # half / fp32, gate_up: x [T, K]; down: the intermediate [P, K] in pair order
    w_ptr,  # e4m3 [E, N_w, K]
    ws_ptr,  # fp32 [E, N_w] or [E, N_w, KB]
    b_ptr,  # [E, N_w] or unused
    c_ptr,  # gate_up: intermediate [P, N] in pair order; down: out [T, N]
    ids_ptr,  # topk_ids [P] (int64)
    weights_ptr,  # fp32 [P] routing weights (down) or unused
    N,
    K,
    stride_am,
    stride_we,
    stride_wn,
    stride_se,
    stride_be,
    stride_cm,
    top_k,
    ACTIVATION: tl.constexpr,  # gate_up: 1 or 2; 0: the down launch
    BLOCK_SCALED: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ALPHA: tl.constexpr,
    LIMIT: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_K: tl.constexpr,
    MIN_AMAX: tl.constexpr,
    QMAX: tl.constexpr,
):
    pid_n = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    if ACTIVATION != 0:
        pair = tl.program_id(0)
        expert = tl.load(ids_ptr + pair).to(tl.int64)
        row = (pair // top_k).to(tl.int64)
        gate, up = _expert_gemv_fp8(
            a_ptr + row * stride_am, w_ptr + expert * stride_we, ws_ptr + expert * stride_se, offs_n, n_ok, N, K,
            stride_wn, True, BLOCK_SCALED, BLOCK_N, BLOCK_K, GROUP_K, MIN_AMAX, QMAX,
        )  # fmt: skip
        if HAS_BIAS:
            gate += tl.load(b_ptr + expert * stride_be + offs_n, mask=n_ok, other=0.0).to(tl.float32)
            up += tl.load(b_ptr + expert * stride_be + N + offs_n, mask=n_ok, other=0.0).to(tl.float32)
        y = _activate(gate, up, ACTIVATION, ALPHA, LIMIT)
        out_row = pair.to(tl.int64)
    else:
        token = tl.program_id(0)
        y = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for j in range(top_k):
            pair = (token * top_k + j).to(tl.int64)
            expert = tl.load(ids_ptr + pair).to(tl.int64)
            down, _ = _expert_gemv_fp8(
                a_ptr + pair * stride_am, w_ptr + expert * stride_we, ws_ptr + expert * stride_se, offs_n, n_ok, N,
                K, stride_wn, False, BLOCK_SCALED, BLOCK_N, BLOCK_K, GROUP_K, MIN_AMAX, QMAX,
            )  # fmt: skip
            if HAS_BIAS:
                down += tl.load(b_ptr + expert * stride_be + offs_n, mask=n_ok, other=0.0).to(tl.float32)
            y += down * tl.load(weights_ptr + pair)
        out_row = token.to(tl.int64)
    tl.store(c_ptr + out_row * stride_cm + offs_n, y.to(c_ptr.dtype.element_ty), mask=n_ok)


# ---------------------------------------------------------------------------- configs

NAIVE = fused_moe.NAIVE  # the per-expert loop of the dense FP8 GEMM

# (BLOCK_N, BLOCK_K, num_warps): fused_moe's GEMV tiles. e4m3 weights are half the bytes of bf16
# ones, so its wider K steps move the same bytes a step; block scales take BLOCK_K <= 128
# (prune_configs).
_GEMV_TILES = fused_moe._GEMV_TILES

_TILES = (
    # (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages): fp8 tensor cores take K steps of 32
    # or more; BLOCK_K divides 128 so a step lies in one scale block (64: experts narrower than 128)
    (16, 64, 64, 1, 4, 4),
    (16, 64, 128, 1, 4, 4),
    (16, 128, 128, 8, 4, 3),
    (32, 64, 64, 8, 4, 4),
    (32, 64, 128, 8, 4, 4),
    (32, 128, 128, 8, 4, 3),
    (64, 64, 128, 8, 4, 4),
    (64, 128, 128, 8, 4, 3),
    (64, 128, 64, 8, 4, 4),
    (128, 64, 128, 8, 4, 4),
    (128, 128, 128, 8, 8, 3),
    (128, 128, 64, 8, 8, 4),
    (128, 256, 64, 8, 8, 3),
)

CONFIG_SPACE: list[KernelConfig] = (
    [NAIVE]
    + [KernelConfig({"gemv": 1, "BLOCK_N": n, "BLOCK_K": k}, num_warps=w, num_stages=1) for n, k, w in _GEMV_TILES]
    + [
        KernelConfig({"BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": k, "GROUP_M": g}, num_warps=w, num_stages=s)
        for m, n, k, g, w, s in _TILES
    ]
)


def prune_configs(
    configs: list[KernelConfig], num_tokens: int, top_k: int, num_experts: int, hidden: int, intermediate: int,
    *, block: bool, allow_naive: bool = True,
) -> list[KernelConfig]:  # fmt: skip
    """fused_moe.prune_configs' rules at one byte an element (e4m3 activations and weights), K steps
    of 128 kept for reductions shorter than that (tiny models: a masked step); with block scales the
    GEMV's K step is one 128-column block (BLOCK_K 128; the tiles' all divide 128)."""
    kept = fused_moe.prune_configs(
        configs, num_tokens, top_k, num_experts, max(hidden, GROUP), max(intermediate, GROUP), elt=1,
        allow_naive=allow_naive,
    )  # fmt: skip
    return [c for c in kept if fused_moe.is_naive(c) or not block or c["BLOCK_K"] == GROUP or not fused_moe.is_gemv(c)]


def default_config(
    num_tokens: int, top_k: int, num_experts: int, hidden: int, intermediate: int, num_sms: int = 132,
    block: bool = False,
) -> KernelConfig:  # fmt: skip
    """fused_moe.default_config's choice of path and tile, with K steps of 128 (fp8 tensor cores
    want long K steps; a step lies in one scale block)."""
    cfg = fused_moe.default_config(num_tokens, top_k, num_experts, hidden, intermediate, num_sms, elt=1)
    if fused_moe.is_gemv(cfg):
        bk = GROUP if block else cfg["BLOCK_K"]
        return KernelConfig({**cfg.params, "BLOCK_K": bk}, cfg.num_warps, cfg.num_stages)
    bk = min(GROUP, triton.next_power_of_2(max(32, min(hidden, intermediate))))
    return KernelConfig({**cfg.params, "BLOCK_K": bk}, cfg.num_warps, cfg.num_stages)


# ---------------------------------------------------------------------------- launchers


def workspace_bytes(
    num_tokens: int, top_k: int, num_experts: int, hidden: int, intermediate: int, elt: int, config: KernelConfig,
    block: bool = False,
) -> int:  # fmt: skip
    """fused_moe.workspace_bytes (the half-type intermediate and the tile path's buffers) plus, for
    the tile path and the naive loop, the quantised activations: e4m3 with their fp32 scales."""

    def buf(n: int) -> int:
        return -(-n // 512) * 512

    def scales(rows: int, k: int) -> int:
        return buf(rows * 4 * (triton.cdiv(k, GROUP) if block else 1))

    base = fused_moe.workspace_bytes(num_tokens, top_k, num_experts, hidden, intermediate, elt, config)
    p = num_tokens * top_k
    if fused_moe.is_naive(config):
        return base + buf(num_tokens * max(hidden, intermediate)) + scales(num_tokens, max(hidden, intermediate))
    if fused_moe.is_gemv(config):  # quantises in registers
        return base
    rows = fused_moe.max_blocks(p, num_experts, config["BLOCK_M"]) * config["BLOCK_M"]
    return base + buf(num_tokens * hidden) + scales(num_tokens, hidden) + buf(rows * intermediate) + scales(rows, intermediate)


def check_shapes(
    x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, w_gate_up: torch.Tensor,
    s_gate_up: torch.Tensor, w_down: torch.Tensor, s_down: torch.Tensor,
) -> bool:  # fmt: skip
    """Raises ValueError on shapes the kernels cannot take; returns whether the scales are blocks."""
    t, h = x.shape
    e, i2, _ = w_gate_up.shape
    if w_gate_up.dtype != torch.float8_e4m3fn or w_down.dtype != torch.float8_e4m3fn:
        raise ValueError(f"fp8 experts must be float8_e4m3fn, got {w_gate_up.dtype} / {w_down.dtype}")
    if tuple(w_gate_up.shape[2:]) != (h,) or i2 % 2 or tuple(w_down.shape) != (e, h, i2 // 2):
        raise ValueError(f"experts must be [E, 2I, H={h}] and [E, H, I], got {tuple(w_gate_up.shape)} / {tuple(w_down.shape)}")
    if topk_ids.shape != topk_weights.shape or topk_ids.dim() != 2 or topk_ids.shape[0] != t:
        raise ValueError(
            f"topk_ids / topk_weights must be [T={t}, k], got {tuple(topk_ids.shape)} / {tuple(topk_weights.shape)}"
        )
    block = s_gate_up.dim() == 3
    expect_gu = (e, i2, triton.cdiv(h, GROUP)) if block else (e, i2)
    expect_d = (e, h, triton.cdiv(i2 // 2, GROUP)) if block else (e, h)
    if tuple(s_gate_up.shape) != expect_gu or tuple(s_down.shape) != expect_d:
        raise ValueError(
            f"expert scales must be {expect_gu} / {expect_d}, got {tuple(s_gate_up.shape)} / {tuple(s_down.shape)}"
        )
    for name, w in (("w_gate_up", w_gate_up), ("w_down", w_down), ("s_gate_up", s_gate_up), ("s_down", s_down)):
        if not w.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    return block


def naive_fused_moe_fp8(
    x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, w_gate_up: torch.Tensor,
    s_gate_up: torch.Tensor, w_down: torch.Tensor, s_down: torch.Tensor, activation: str = "silu",
    alpha: float = 1.702, limit: float = 7.0, b_gate_up: torch.Tensor | None = None, b_down: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """The per-expert loop of dense FP8 GEMMs (fp8_gemm.fp8_linear at its default configs), as
    reference.fused_moe_fp8 runs its loop. Syncs with the host."""
    from pagecast.kernels import fp8_gemm
    from pagecast.kernels.quant_linear import Fp8LinearWeight

    acts = "group" if s_gate_up.dim() == 3 else "token"

    def project(w: torch.Tensor, s: torch.Tensor, b: torch.Tensor | None):  # type: ignore[no-untyped-def]
        return lambda e, rows: fp8_gemm.fp8_linear(rows, Fp8LinearWeight(w[e], s[e], None, acts), None if b is None else b[e])

    return reference.expert_loop(
        x, topk_weights, topk_ids, project(w_gate_up, s_gate_up, b_gate_up), project(w_down, s_down, b_down),
        activation, alpha, limit,
    )  # fmt: skip


def fused_moe_fp8(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w_gate_up: torch.Tensor,
    s_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    s_down: torch.Tensor,
    activation: str = "silu",
    alpha: float = 1.702,
    limit: float = 7.0,
    config: Mapping[str, int] | KernelConfig | None = None,
    b_gate_up: torch.Tensor | None = None,
    b_down: torch.Tensor | None = None,
) -> torch.Tensor:
    """reference.fused_moe_fp8's result (x [T, H] -> [T, H] in x's dtype) by the tile path, the
    GEMV path or the naive loop as ``config`` says (None: ``default_config``). Channel scales
    ([E, N]) quantise the activations per token, block scales ([E, N, KB]) per 1x128 group. The
    tile and GEMV paths never sync with the host. ``b_gate_up`` [E, 2I] / ``b_down`` [E, H]: gpt-oss's
    expert biases (added in fp32 after the scales, as the reference adds them)."""
    block = check_shapes(x, topk_weights, topk_ids, w_gate_up, s_gate_up, w_down, s_down)
    e_, i2 = w_gate_up.shape[:2]
    if (b_gate_up is not None and tuple(b_gate_up.shape) != (e_, i2)) or (
        b_down is not None and tuple(b_down.shape) != (e_, x.shape[1])
    ):
        shapes = [None if b is None else tuple(b.shape) for b in (b_gate_up, b_down)]
        raise ValueError(f"expert biases must be [E={e_}, 2I={i2}] / [E, H={x.shape[1]}], got {shapes[0]} / {shapes[1]}")
    if activation not in fused_moe._ACTIVATIONS:
        raise ValueError(f"unknown MoE activation {activation!r}")
    t, h = x.shape
    num_experts, i = w_gate_up.shape[0], w_gate_up.shape[1] // 2
    top_k = topk_ids.shape[1]
    cfg = KernelConfig.coerce(config) or default_config(t, top_k, num_experts, h, i, num_sms(x.device), block)
    if fused_moe.is_naive(cfg):
        return naive_fused_moe_fp8(
            x, topk_weights, topk_ids, w_gate_up, s_gate_up, w_down, s_down, activation, alpha, limit, b_gate_up, b_down
        )
    if block and (GROUP % cfg["BLOCK_K"] or (fused_moe.is_gemv(cfg) and cfg["BLOCK_K"] != GROUP)):
        raise ValueError(
            f"block-scaled experts need BLOCK_K dividing {GROUP} (the GEMV path: equal to it), got {cfg['BLOCK_K']}"
        )
    if t == 0:
        return torch.zeros_like(x)
    acts = "group" if block else "token"
    p = t * top_k
    ids = topk_ids.reshape(-1)
    weights = topk_weights.reshape(-1).float()
    act = fused_moe._ACTIVATIONS[activation]
    common = {"ALPHA": alpha, "LIMIT": limit, "BLOCK_SCALED": block, "GROUP_K": GROUP}
    if fused_moe.is_gemv(cfg):
        bn, bk = cfg["BLOCK_N"], cfg["BLOCK_K"]
        inter = torch.empty((p, i), dtype=x.dtype, device=x.device)
        out = torch.empty((t, h), dtype=x.dtype, device=x.device)
        if x.stride(1) != 1:
            x = x.contiguous()

        def gemv(a: torch.Tensor, w: torch.Tensor, s: torch.Tensor, b: torch.Tensor | None, c: torch.Tensor, rows: int,
                 n: int, k: int, a_kind: int) -> None:  # fmt: skip
            _moe_fp8_gemv_kernel[(rows, triton.cdiv(n, bn))](
                a, w, s, b if b is not None else s, c, ids, weights, n, k, a.stride(0), w.stride(0), w.stride(1),
                s.stride(0), b.stride(0) if b is not None else 0, c.stride(0), top_k, HAS_BIAS=b is not None,
                ACTIVATION=a_kind, BLOCK_N=bn, BLOCK_K=bk, MIN_AMAX=reference.FP8_MIN_AMAX, QMAX=FP8_MAX,
                num_warps=cfg.num_warps, num_stages=cfg.num_stages, **common,
            )  # fmt: skip

        gemv(x, w_gate_up, s_gate_up, b_gate_up, inter, p, i, h, act)
        gemv(inter, w_down, s_down, b_down, out, t, h, i, fused_moe.ACT_NONE)
        return out
    qx, sx = quantize_activations(x, acts)
    bm, bn, bk, gm = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"], cfg["GROUP_M"]
    sorted_ids, block_expert = fused_moe.align_by_expert(ids.view(t, top_k), num_experts, bm)
    nb = block_expert.shape[0]

    def gemm(qa: torch.Tensor, sa: torch.Tensor, w: torch.Tensor, s: torch.Tensor, b: torch.Tensor | None,
             c: torch.Tensor, n: int, k: int, a_kind: int, weighted: bool) -> None:  # fmt: skip
        _moe_fp8_gemm_kernel[(nb * triton.cdiv(n, bn),)](
            qa, sa, w, s, b if b is not None else s, c, sorted_ids, block_expert, weights, n, k, p, nb,
            qa.stride(0), w.stride(0), w.stride(1), s.stride(0), b.stride(0) if b is not None else 0, c.stride(0),
            top_k, HAS_BIAS=b is not None, ACTIVATION=a_kind, MUL_ROUTING_WEIGHT=weighted, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=gm,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages, **common,
        )  # fmt: skip

    # Padding rows of the intermediate stay uninitialised: quantised with the rest, never read back.
    inter = torch.empty((nb * bm, i), dtype=x.dtype, device=x.device)
    gemm(qx, sx, w_gate_up, s_gate_up, b_gate_up, inter, i, h, act, False)
    qi, si = quantize_activations(inter, acts)
    out = torch.empty((p, h), dtype=x.dtype, device=x.device)
    gemm(qi, si, w_down, s_down, b_down, out, h, i, fused_moe.ACT_NONE, True)
    return out if top_k == 1 else out.view(t, top_k, h).sum(1)
