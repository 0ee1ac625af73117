"""Fused mixture-of-experts with 4-bit experts (W4A16): AWQ and GPTQ experts, repacked by the
builder into the dense int4 layout (builder/quant.py) stacked over the experts:

    qweight  int32 [E, K / 8, N]   nibble i of row r is input 8r + i (of the expert's input order)
    scales   half  [E, K / G, N]
    zeros    int8  [E, K / G, N]   W_e[k, n] = (q[e, k, n] - zeros[e, k // G, n]) * scales[e, k // G, n]
    perm     int32 [E, K]          GPTQ act-order, gate_up only: input k of expert e reads column perm[e, k]

gate_up: K = H, N = 2I (each expert's gate columns, then its up columns); down: K = I, N = H, never
a perm (its act-order is folded into gate_up's output order at build time, as for a dense MLP).

The two paths are kernels/fused_moe.py's with the weight loads replaced: a program loads BLOCK_K / 8
rows of packed words, expands them to nibbles with shifts and masks, subtracts the zero point and
multiplies by the group's scale in fp32, casts to x's dtype and multiplies (``tl.dot`` for the tile
path, CUDA-core products for the GEMV path), accumulating in fp32.

- Prefill (tile path): pairs sorted by expert into BLOCK_M blocks by fused_moe.align_by_expert;
  gate_up with the activation fused into [blocks * BLOCK_M, I] (sorted order), then down with the
  routing weights, scattered to pair order, and the top-k sum.
- Decode (GEMV path, ``{"gemv": 1, ...}``): no sorting; a program per (pair, column block) for
  gate_up and per (token, column block) for down (the top-k sum in the launch), or with
  ``PAIRS`` per (pair, column block) for down too, the top-k sum a torch sum after it (a single
  token's down launch has otherwise too few programs to fill the GPU). Only the visited
  experts' int4 weights are read: about a quarter of the bf16 kernel's bytes.
- ``{"naive": 1}``: the baseline the tuner times against, a loop over the visited experts of the
  dense W4A16 GEMM (kernels/w4a16_gemm.py, its own default config: the tensor-core decode kernel
  for few rows, dequantize + cuBLAS for many). It syncs with the host (the visited experts).

On the CPU the experts are dequantised exactly and run through reference.fused_moe
(``reference_fused_moe_w4a16``).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import triton
import triton.language as tl

from pagecast.kernels import fused_moe, reference
from pagecast.kernels.fused_moe import _activate, _tile_block, _tile_epilogue, _tile_rows
from pagecast.kernels.quant_linear import Int4ExpertsWeight
from pagecast.kernels.tuning import KernelConfig, num_sms


@triton.jit
def _dequant_tile(
    qw_base,  # the expert's int32 [K / 8, N_w]
    s_base,  # its scales [K / G, N_w]
    z_base,  # its int8 zeros [K / G, N_w]
    k0,
    offs_n,  # [BLOCK_N] columns of N_w
    n_ok,
    K,
    N_w,
    GROUP: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    # -> fp32 [BLOCK_K, BLOCK_N]: rows k0 .. k0 + BLOCK_K of the weight (K-major), 0 past K.
    offs_kw = k0 // 8 + tl.arange(0, BLOCK_K // 8)
    kw_ok = offs_kw < tl.cdiv(K, 8)
    packed = tl.load(
        qw_base + offs_kw[:, None].to(tl.int64) * N_w + offs_n[None, :], mask=kw_ok[:, None] & n_ok[None, :], other=0
    )
    packed = tl.reshape(tl.broadcast_to(packed[:, None, :], (BLOCK_K // 8, 8, BLOCK_N)), (BLOCK_K, BLOCK_N))
    q = (packed >> ((tl.arange(0, BLOCK_K) % 8) * 4)[:, None]) & 0xF
    if GROUP % BLOCK_K == 0:  # the tile lies in one group: one row of scales and zeros
        g = k0 // GROUP
        ok = n_ok & (k0 < K)
        s = tl.load(s_base + g * N_w + offs_n, mask=ok, other=0.0).to(tl.float32)[None, :]
        z = tl.load(z_base + g * N_w + offs_n, mask=ok, other=0).to(tl.int32)[None, :]
    else:
        offs_k = k0 + tl.arange(0, BLOCK_K)
        g_rows = (offs_k // GROUP)[:, None]
        ok = (offs_k < K)[:, None] & n_ok[None, :]
        s = tl.load(s_base + g_rows * N_w + offs_n[None, :], mask=ok, other=0.0).to(tl.float32)
        z = tl.load(z_base + g_rows * N_w + offs_n[None, :], mask=ok, other=0).to(tl.int32)
    return (q - z).to(tl.float32) * s


@triton.jit(do_not_specialize=["num_pairs", "max_blocks"])  # one variant for every token count (fused_moe.py)
def _moe_w4a16_gemm_kernel(
    a_ptr,  # gate_up: x [T, K]; down: intermediate [max_blocks * BLOCK_M, K] in sorted order
    qw_ptr,  # int32 [E, K / 8, N_w]: N_w = 2N (gate columns, then up columns) with an activation, else N
    s_ptr,  # [E, K / G, N_w]
    z_ptr,  # int8 [E, K / G, N_w]
    perm_ptr,  # int32 [E, K] (HAS_PERM) or unused
    c_ptr,  # gate_up: intermediate [max_blocks * BLOCK_M, N] in sorted order; down: [P, N] in pair order
    sorted_ids_ptr,  # int32 [max_blocks * BLOCK_M]: pair ids grouped by expert, num_pairs = padding
    block_expert_ptr,  # int32 [max_blocks]: the expert of each block, -1 for unused blocks
    weights_ptr,  # fp32 [P] routing weights (MUL_ROUTING_WEIGHT) or unused
    N,  # output columns
    K,
    num_pairs,
    max_blocks,
    stride_am,
    stride_cm,
    top_k,
    ACTIVATION: tl.constexpr,  # 0: none (down), 1: SiLU-and-mul
    MUL_ROUTING_WEIGHT: tl.constexpr,
    HAS_PERM: tl.constexpr,
    GROUP: tl.constexpr,
    ALPHA: tl.constexpr,
    LIMIT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    pid_m, pid_n, expert = _tile_block(max_blocks, block_expert_ptr, N, BLOCK_N, GROUP_M)
    if expert < 0:
        return
    offs_m, pair, m_ok, a_rows, offs_n, n_ok = _tile_rows(
        pid_m, pid_n, sorted_ids_ptr, num_pairs, top_k, N, MUL_ROUTING_WEIGHT, BLOCK_M, BLOCK_N
    )
    n_w = N * 2 if ACTIVATION != 0 else N
    e64 = expert.to(tl.int64)
    qw_base = qw_ptr + e64 * (K // 8) * n_w
    s_base = s_ptr + e64 * (K // GROUP) * n_w
    z_base = z_ptr + e64 * (K // GROUP) * n_w
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        if HAS_PERM:
            cols = tl.load(perm_ptr + e64 * K + offs_k, mask=k_ok, other=0)
        else:
            cols = offs_k
        a = tl.load(a_ptr + a_rows[:, None] * stride_am + cols[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = _dequant_tile(qw_base, s_base, z_base, k0, offs_n, n_ok, K, n_w, GROUP, BLOCK_K, BLOCK_N)
        acc = tl.dot(a, w.to(a.dtype), acc, input_precision=DOT_PRECISION)
        if ACTIVATION != 0:
            w_up = _dequant_tile(qw_base, s_base, z_base, k0, N + offs_n, n_ok, K, n_w, GROUP, BLOCK_K, BLOCK_N)
            acc_up = tl.dot(a, w_up.to(a.dtype), acc_up, input_precision=DOT_PRECISION)
    # no expert biases here: HAS_BIAS False, so b_ptr (weights_ptr again) and its stride go unused
    _tile_epilogue(
        acc, acc_up, weights_ptr, expert, 0, weights_ptr, c_ptr, stride_cm, offs_m, pair, m_ok, offs_n, n_ok, N,
        False, ACTIVATION, ALPHA, LIMIT, MUL_ROUTING_WEIGHT,
    )  # fmt: skip


@triton.jit
def _expert_gemv_w4(
    a_row,  # one row of activations [K] (the columns of the input order: with a perm, gathered)
    perm_row,  # int32 [K] of this expert or unused
    qw_base,
    s_base,
    z_base,
    offs_n,
    n_ok,
    N,
    K,
    n_w,
    GATED: tl.constexpr,
    HAS_PERM: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # [BLOCK_K, BLOCK_N] partial products on CUDA cores, reduced over K once at the end
    acc = tl.zeros((BLOCK_K, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_K, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        if HAS_PERM:
            cols = tl.load(perm_row + offs_k, mask=k_ok, other=0)
        else:
            cols = offs_k
        a = tl.load(a_row + cols, mask=k_ok, other=0.0).to(tl.float32)[:, None]
        w = _dequant_tile(qw_base, s_base, z_base, k0, offs_n, n_ok, K, n_w, GROUP, BLOCK_K, BLOCK_N)
        # rounded to the activations' dtype, as the tile path feeds the weight to tl.dot
        acc += w.to(a_row.dtype.element_ty).to(tl.float32) * a
        if GATED:
            w_up = _dequant_tile(qw_base, s_base, z_base, k0, N + offs_n, n_ok, K, n_w, GROUP, BLOCK_K, BLOCK_N)
            acc_up += w_up.to(a_row.dtype.element_ty).to(tl.float32) * a
    return tl.sum(acc, axis=0), tl.sum(acc_up, axis=0)  # [BLOCK_N] each


@triton.jit
def _moe_w4a16_gemv_kernel(
    a_ptr,  # gate_up: x [T, K]; down: intermediate [P, K] in pair order
    qw_ptr,  # int32 [E, K / 8, N_w]
    s_ptr,  # [E, K / G, N_w]
    z_ptr,  # int8 [E, K / G, N_w]
    perm_ptr,  # int32 [E, K] (HAS_PERM) or unused
    c_ptr,  # gate_up: intermediate [P, N] in pair order; down: out [T, N] (PAIRS: weighted rows [P, N])
    ids_ptr,  # topk_ids [P] (int64)
    weights_ptr,  # fp32 [P] routing weights (down) or unused
    N,
    K,
    stride_am,
    stride_cm,
    top_k,
    ACTIVATION: tl.constexpr,  # gate_up: 1; 0: the down launch
    HAS_PERM: tl.constexpr,
    PAIRS: tl.constexpr,  # down: a program per (pair, column block), the top-k sum left to the host
    GROUP: tl.constexpr,
    ALPHA: tl.constexpr,
    LIMIT: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_n = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    if ACTIVATION != 0:
        n_w = N * 2
        pair = tl.program_id(0)
        expert = tl.load(ids_ptr + pair).to(tl.int64)
        a_row = a_ptr + (pair // top_k).to(tl.int64) * stride_am
        gate, up = _expert_gemv_w4(
            a_row, perm_ptr + expert * K, qw_ptr + expert * (K // 8) * n_w, s_ptr + expert * (K // GROUP) * n_w,
            z_ptr + expert * (K // GROUP) * n_w, offs_n, n_ok, N, K, n_w, True, HAS_PERM, GROUP, BLOCK_N, BLOCK_K,
        )  # fmt: skip
        y = _activate(gate, up, ACTIVATION, ALPHA, LIMIT)
        row = pair.to(tl.int64)
    else:
        # a token's top_k pairs summed here, or (PAIRS: programs enough for one token's decode) one pair
        if PAIRS:
            first = tl.program_id(0)
            count = 1
        else:
            first = tl.program_id(0) * top_k
            count = top_k
        row = tl.program_id(0).to(tl.int64)
        y = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for j in range(count):
            pair = first + j
            expert = tl.load(ids_ptr + pair).to(tl.int64)
            down, _ = _expert_gemv_w4(
                a_ptr + pair.to(tl.int64) * stride_am, perm_ptr, qw_ptr + expert * (K // 8) * N,
                s_ptr + expert * (K // GROUP) * N, z_ptr + expert * (K // GROUP) * N, offs_n, n_ok, N, K, N,
                False, False, GROUP, BLOCK_N, BLOCK_K,
            )  # fmt: skip
            y += down * tl.load(weights_ptr + pair)
    tl.store(c_ptr + row * stride_cm + offs_n, y.to(c_ptr.dtype.element_ty), mask=n_ok)


# ---------------------------------------------------------------------------- configs

NAIVE = fused_moe.NAIVE  # the per-expert loop of dense W4A16 GEMMs

_GEMV_TILES = (
    # (BLOCK_N, BLOCK_K, num_warps): a program streams BLOCK_N columns of its expert's packed weight
    # (BLOCK_K 32 for groups of 32: a K step within one group)
    (16, 32, 2),
    (16, 128, 2),
    (16, 256, 4),
    (32, 64, 2),
    (32, 128, 4),
    (32, 256, 4),
    (64, 64, 4),
    (64, 128, 4),
    (128, 32, 4),
    (128, 64, 4),
    (256, 32, 4),
)

_TILES = (
    # (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages); BLOCK_K at most 64 so a K step
    # lies in one quantisation group for every group size but 32
    (16, 32, 64, 1, 4, 3),
    (16, 64, 64, 1, 4, 3),
    (16, 128, 32, 8, 4, 4),
    (32, 64, 64, 8, 4, 3),
    (32, 128, 32, 8, 4, 4),
    (64, 64, 64, 8, 4, 3),
    (64, 128, 32, 8, 4, 4),
    (64, 128, 64, 8, 8, 3),
    (128, 64, 64, 8, 8, 3),
    (128, 128, 32, 8, 8, 4),
    (128, 128, 64, 8, 8, 3),
)

# GEMV tiles also timed with the down launch a program per pair (PAIRS): at one or a few tokens a
# program per token and column block leaves most multiprocessors idle.
_PAIRS_TILES = ((16, 32, 2), (16, 128, 2), (32, 128, 4), (64, 128, 4))

CONFIG_SPACE: list[KernelConfig] = (
    [NAIVE]
    + [KernelConfig({"gemv": 1, "BLOCK_N": n, "BLOCK_K": k}, num_warps=w, num_stages=1) for n, k, w in _GEMV_TILES]
    + [
        KernelConfig({"gemv": 1, "BLOCK_N": n, "BLOCK_K": k, "PAIRS": 1}, num_warps=w, num_stages=1)
        for n, k, w in _PAIRS_TILES
    ]
    + [
        KernelConfig({"BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": k, "GROUP_M": g}, num_warps=w, num_stages=s)
        for m, n, k, g, w, s in _TILES
    ]
)

is_naive = fused_moe.is_naive
is_gemv = fused_moe.is_gemv


def prune_configs(
    configs: list[KernelConfig], num_tokens: int, top_k: int, num_experts: int, hidden: int, intermediate: int,
    min_group: int, *, elt: int = 2, allow_naive: bool = True,
) -> list[KernelConfig]:  # fmt: skip
    """fused_moe.prune_configs's rules (the naive loop where ``allow_naive``, the GEMV up to
    fused_moe.GEMV_MAX_PAIRS pairs, tiles by the rows an expert gets), and BLOCK_K at most
    ``min_group``, the smaller group length of the two launches (a K step in one group: one row
    of scales and zeros a step)."""
    kept = fused_moe.prune_configs(
        configs, num_tokens, top_k, num_experts, hidden, intermediate, elt=elt, allow_naive=allow_naive
    )
    return [c for c in kept if is_naive(c) or c["BLOCK_K"] <= min_group]


def default_config(
    num_tokens: int, top_k: int, num_experts: int, hidden: int, intermediate: int, min_group: int,
    num_sms: int = 132, elt: int = 2,
) -> KernelConfig:  # fmt: skip
    """Untuned choice: the GEMV where fused_moe.default_config takes it (few pairs), its BLOCK_N the
    widest of 64, 32 and 16 that gives the down launch (a program per token and column block) two
    programs a multiprocessor, with a program per pair (PAIRS) where even 16 does not, BLOCK_K 128
    or less (the experts' width, ``min_group``); else fused_moe's tile with BLOCK_K cut to ``min_group``
    (prune_configs)."""
    base = fused_moe.default_config(num_tokens, top_k, num_experts, hidden, intermediate, num_sms, elt)
    g = min_group
    if is_gemv(base):
        bn = next((b for b in (64, 32) if num_tokens * triton.cdiv(hidden, b) >= 2 * num_sms), 16)
        bk = min(128, triton.next_power_of_2(min(hidden, intermediate)), max(32, g))
        params = {"gemv": 1, "BLOCK_N": bn, "BLOCK_K": bk}
        if top_k > 1 and num_tokens * triton.cdiv(hidden, bn) < 2 * num_sms:
            params["PAIRS"] = 1
        return KernelConfig(params, 4 if bn * bk >= 4096 else 2, 1)
    bk = min(base["BLOCK_K"], max(16, min(64, g)))
    return KernelConfig({**base.params, "BLOCK_K": bk}, base.num_warps, base.num_stages)


def workspace_bytes(
    num_tokens: int, top_k: int, num_experts: int, hidden: int, intermediate: int, elt: int, config: KernelConfig
) -> int:
    """fused_moe.workspace_bytes for the tile and GEMV paths (the same buffers; the GEMV's PAIRS adds
    the weighted rows [P, H]); the naive loop adds one expert's dense gate_up weight (w4a16_gemm's
    dequantize + cuBLAS for many rows)."""
    extra = 2 * intermediate * hidden * elt if is_naive(config) else 0
    if is_gemv(config) and config.params.get("PAIRS"):
        extra = -(-num_tokens * top_k * hidden * elt // 512) * 512
    return fused_moe.workspace_bytes(num_tokens, top_k, num_experts, hidden, intermediate, elt, config) + extra


# ---------------------------------------------------------------------------- launchers


def check_shapes(
    x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, w_gate_up: Int4ExpertsWeight,
    w_down: Int4ExpertsWeight,
) -> None:  # fmt: skip
    t, h = x.shape
    e, i2, h2 = w_gate_up.shape
    if h2 != h or i2 % 2:
        raise ValueError(f"w_gate_up must be [E, 2I, H={h}] int4, got {(e, i2, h2)}")
    if w_down.shape != (e, h, i2 // 2):
        raise ValueError(f"w_down must be [E={e}, H={h}, I={i2 // 2}] int4, got {w_down.shape}")
    if w_down.perm is not None:
        raise ValueError("w_down must have no perm (its act-order is folded into gate_up's output order)")
    if topk_ids.shape != topk_weights.shape or topk_ids.dim() != 2 or topk_ids.shape[0] != t:
        raise ValueError(
            f"topk_ids / topk_weights must be [T={t}, k], got {tuple(topk_ids.shape)} / {tuple(topk_weights.shape)}"
        )
    for name, w in (("w_gate_up", w_gate_up), ("w_down", w_down)):
        if w.qweight.dtype != torch.int32 or w.zeros.dtype != torch.int8:
            raise ValueError(f"{name}: qweight must be int32 and zeros int8, got {w.qweight.dtype} / {w.zeros.dtype}")
        for part in (w.qweight, w.scales, w.zeros):
            if not part.is_contiguous():
                raise ValueError(f"{name}'s qweight, scales and zeros must be contiguous")


def reference_fused_moe_w4a16(
    x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, w_gate_up: Int4ExpertsWeight,
    w_down: Int4ExpertsWeight, activation: str = "silu", alpha: float = 1.702, limit: float = 7.0,
) -> torch.Tensor:  # fmt: skip
    """The experts dequantised exactly (rounded to x's dtype, as the kernels feed them to the
    multiplies), then reference.fused_moe."""
    return reference.fused_moe(
        x, topk_weights, topk_ids, w_gate_up.dense(x.dtype), w_down.dense(x.dtype), None, None, activation, alpha, limit
    )


def _naive(
    x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, w_gate_up: Int4ExpertsWeight,
    w_down: Int4ExpertsWeight, activation: str, alpha: float, limit: float,
) -> torch.Tensor:  # fmt: skip
    """The per-expert loop, each projection through the dense W4A16 GEMM at its default config."""
    from pagecast.kernels import w4a16_gemm

    def project(weights: Int4ExpertsWeight, with_perm: bool):  # type: ignore[no-untyped-def]
        def run(e: int, rows: torch.Tensor) -> torch.Tensor:
            w = weights.expert(e)
            return w4a16_gemm.w4a16_gemm(rows, w.qweight, w.scales, w.zeros, w.perm if with_perm else None, w.group_size)

        return run

    return reference.expert_loop(
        x, topk_weights, topk_ids, project(w_gate_up, True), project(w_down, False), activation, alpha, limit
    )


def fused_moe_w4a16(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w_gate_up: Int4ExpertsWeight,
    w_down: Int4ExpertsWeight,
    activation: str = "silu",
    alpha: float = 1.702,
    limit: float = 7.0,
    config: Mapping[str, int] | KernelConfig | None = None,
) -> torch.Tensor:
    """reference_fused_moe_w4a16's result (x [T, H] -> [T, H] in x's dtype, fp32 accumulation) by
    the tile path, the GEMV path or the naive loop as ``config`` says (None: ``default_config``).
    The tile and GEMV paths never sync with the host. SiLU experts only (the AWQ/GPTQ families)."""
    check_shapes(x, topk_weights, topk_ids, w_gate_up, w_down)
    if activation != "silu":
        raise ValueError(f"int4 experts run the SiLU activation only, got {activation!r}")
    t, h = x.shape
    num_experts, i = w_gate_up.shape[0], w_gate_up.shape[1] // 2
    top_k = topk_ids.shape[1]
    cfg = KernelConfig.coerce(config) or default_config(
        t, top_k, num_experts, h, i, min(w_gate_up.group_size, w_down.group_size), num_sms(x.device), x.element_size()
    )
    if is_naive(cfg):
        return _naive(x, topk_weights, topk_ids, w_gate_up, w_down, activation, alpha, limit)
    if t == 0:
        return torch.zeros_like(x)
    if x.stride(1) != 1:
        x = x.contiguous()
    p = t * top_k
    ids = topk_ids.reshape(-1)
    weights = topk_weights.reshape(-1).float()
    common = {"ALPHA": alpha, "LIMIT": limit}
    perm = w_gate_up.perm
    if is_gemv(cfg):
        bn, bk = cfg["BLOCK_N"], cfg["BLOCK_K"]
        pairs = bool(cfg.params.get("PAIRS"))
        inter = torch.empty((p, i), dtype=x.dtype, device=x.device)
        out = torch.empty((p if pairs else t, h), dtype=x.dtype, device=x.device)
        launches = (  # (weight, output columns, reduction, activation, input, output, rows)
            (w_gate_up, i, h, fused_moe.ACT_SILU, x, inter, p),
            (w_down, h, i, fused_moe.ACT_NONE, inter, out, p if pairs else t),
        )
        for w, n, k, act, a, c, rows in launches:
            has_perm = act != fused_moe.ACT_NONE and perm is not None
            _moe_w4a16_gemv_kernel[(rows, triton.cdiv(n, bn))](
                a, w.qweight, w.scales, w.zeros, perm if has_perm else w.qweight, c, ids, weights, n, k,
                a.stride(0), c.stride(0), top_k,
                ACTIVATION=act, HAS_PERM=has_perm, PAIRS=pairs, GROUP=w.group_size, BLOCK_N=bn, BLOCK_K=bk,
                num_warps=cfg.num_warps, num_stages=cfg.num_stages, **common,
            )  # fmt: skip
        return out.view(t, top_k, h).sum(1) if pairs and top_k > 1 else out
    bm, bn, bk, gm = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"], cfg["GROUP_M"]
    sorted_ids, block_expert = fused_moe.align_by_expert(ids.view(t, top_k), num_experts, bm)
    nb = block_expert.shape[0]
    dot = "ieee" if x.dtype == torch.float32 else "tf32"

    def gemm(a: torch.Tensor, w: Int4ExpertsWeight, c: torch.Tensor, n: int, k: int, act: int, weighted: bool) -> None:
        has_perm = act != fused_moe.ACT_NONE and perm is not None
        _moe_w4a16_gemm_kernel[(nb * triton.cdiv(n, bn),)](
            a, w.qweight, w.scales, w.zeros, perm if has_perm else w.qweight, c, sorted_ids, block_expert, weights,
            n, k, p, nb, a.stride(0), c.stride(0), top_k,
            ACTIVATION=act, MUL_ROUTING_WEIGHT=weighted, HAS_PERM=has_perm, GROUP=w.group_size,
            BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=gm, DOT_PRECISION=dot,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages, **common,
        )  # fmt: skip

    inter = torch.empty((nb * bm, i), dtype=x.dtype, device=x.device)
    gemm(x, w_gate_up, inter, i, h, fused_moe.ACT_SILU, False)
    out = torch.empty((p, h), dtype=x.dtype, device=x.device)
    gemm(inter, w_down, out, h, i, fused_moe.ACT_NONE, True)
    return out if top_k == 1 else out.view(t, top_k, h).sum(1)
