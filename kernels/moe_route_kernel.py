"""Fused MoE routing: router logits [T, E] -> (topk_weights [T, k], topk_ids [T, k] int64) in
one launch, what kernels/moe_routing.py's ``route`` does in torch in five to seven (softmax,
topk, sum, divide, cast), for one token row per program with the whole row in registers.

    scoring "softmax_topk"  probs = softmax(logits) in fp32 (max-subtracted, exp / sum as torch's
                            CUDA softmax divides); the top k of probs; where RENORMALIZE divided
                            by their fp32 sum; stored in the weights' dtype (fp32, or x's dtype:
                            round to nearest even, as torch's ``.to``).
    scoring "topk_softmax"  the top k of the logits (x's dtype, compared exactly in fp32); their
                            softmax computed in fp32 and rounded to x's dtype, which is what
                            torch.softmax(..., dtype=x.dtype) does for half types (it accumulates
                            in float; on the CPU equal but for 1 in ~10,000 an ulp apart, where
                            two fp32 results straddle a midpoint: tests/test_moe_route_kernel.py).

The top k are k passes over the row, each one (value, index) max-reduction: the largest score
still in the row, the lowest expert index holding it, that expert taken out. So the ids come in
descending-score order (torch.topk's sorted=True) and **exact ties go to the lowest expert
index**. torch.topk promises no order for ties on either device: on the CPU (torch 2.13)
``topk(zeros(128), 8)`` returns experts 84, 87, 86, ..., not 0..7, and on CUDA its order is not
specified either. Where scores tie exactly this kernel may therefore route a token to other
experts than transformers (or the torch path) does, with the same weights; with a softmax over
distinct fp32 logits exact ties are rare, with gpt-oss's bf16 logits (8 mantissa bits) they are
not. A NaN score ranks above everything (torch.topk's rule) and a -inf one as -FLT_MAX, so the
ids are always distinct experts in [0, E) whatever the logits hold: fused_moe never reads out of
bounds. (Only a row holding both -FLT_MAX and -inf logits would rank them by index, not value.)

On CUDA the exps are libdevice's expf (what torch's CUDA softmax calls), not Triton's fast
``tl.exp``, and the divisions IEEE ones (div_rn: Triton's ``/`` is the approximate div.full);
under the interpreter NumPy's exp. The sums add in another order than torch's, so fp32
weights may differ from the torch path's by a few fp32 ulps (a sum of E terms; the tests allow 4,
6 renormalised, against fp64) and weights in x's dtype, rarely, by one step of it.

Widened (``route(..., widen=True)``, what ops.moe asks for on a GPU) the weights are stored as
fp32 holding the same values (rounded to x's dtype first where the routing keeps them in it), the
fp32 weights fused_moe reads: its ``.float()`` is then no launch, so a MoE layer's routing is the
router GEMV and this one launch.

**The router GEMV with it** (``router_route``, ``_router_route_kernel``; the tuning table's
"moe_router" entry per decode bucket of up to 16 tokens): at one token Qwen3-30B-A3B's router
GEMV (cuBLAS, 0.5 MB) took 4.7 us and this kernel 3.9 more, a layer (H200, benchmarks/
moe_routing.py), both latency-bound. The fused launch computes the logits of BLOCK_X experts over
a 1/SPLIT_H share of H per program (tl.dot, the tokens padded to 16 rows), stores the fp32
partials, and the program drawing the last ticket of the launch's shared counter
(kernels/split_k.py: a CTA barrier, then acq_rel at GPU scope) adds them in split order, adds the
bias, rounds to x's dtype (F.linear's output) and routes every token as ``_route_kernel`` does
(``_route_rows``, a [tokens, experts] tile) before setting the counter back to 0. The sums come in
another order than cuBLAS's, so a logit may round to the neighbouring value of x's dtype; the
tuner (kernels/problems.py) compares the two paths on integer-valued inputs, where both are exact.
Whether it pays was not measured when this was written: the tuner keeps the unfused path where
it is faster, and it is the default.

**The residual add and the post-attention RMSNorm with it** (``add_norm_router_route``, NORM; what
ops.add_norm_moe runs where the table fuses the router): every program computes its tokens' rstd
over the whole row of x + residual (2-8 KB a token, read from L2) and normalises its own share of
H before the dot; the first expert block's programs store that share of the normalised rows (the
experts' input) and of x + residual. One launch a layer fewer (the norm kernel took 1.9 us a
layer at one token on the H200). It is not tuned on its own: it follows the router's fused or
unfused choice.

Rows run one program each with no integer arguments (the row stride is E, a constexpr), so one
compiled variant per model (E, k, scoring, renormalisation, dtypes) serves every batch size and a
CUDA graph captures it like any launch; builder/tune.py compiles it into the artifact
(``compile_route_kernel``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from pagecast.kernels import pdl, split_k
from pagecast.kernels.moe_routing import KERNEL_SCORINGS as SCORINGS
from pagecast.kernels.sampling import torch_exp
from pagecast.kernels.tuning import KernelConfig

MAX_EXPERTS = 1024  # one row in one program's registers; wider routers take the torch path
MAX_TOP_K = 32  # k passes unrolled


def supported(num_experts: int, top_k: int) -> bool:
    """Whether the kernel routes this many experts and this top-k (else the torch path does)."""
    return 1 <= top_k <= min(num_experts, MAX_TOP_K) and num_experts <= MAX_EXPERTS


@triton.jit
def _route_rows(
    x,  # fp32 [BLOCK_T, BLOCK_E]: rows of logits in x's dtype's values, -inf past E
    rows,  # int64 [BLOCK_T]: the rows' indices in the outputs
    row_ok,  # [BLOCK_T]
    valid,  # [BLOCK_E]: offs < E
    offs,  # [BLOCK_E]: tl.arange(0, BLOCK_E)
    weights_ptr,  # [T, K] out: fp32 or x's dtype
    ids_ptr,  # [T, K] out: int64
    x_dtype_ptr,  # any pointer of x's (the logits') dtype: ROUND_TO_LOGITS rounds to it
    K: tl.constexpr,
    TOPK_SOFTMAX: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISE_EXP: tl.constexpr,
    ROUND_TO_LOGITS: tl.constexpr,
):
    # The routing of BLOCK_T rows at once, every reduction along the experts (axis 1).
    if TOPK_SOFTMAX:
        score = x
    else:
        e = torch_exp(x - tl.max(x, axis=1)[:, None], PRECISE_EXP)  # padding: exp(-inf) = 0
        score = tl.math.div_rn(e, tl.sum(e, axis=1)[:, None])  # IEEE, as torch (Triton's / is div.full)
    # The ranking key: NaN first (torch.topk's rule; x != x, the interpreter has no isnan), a -inf
    # score above the experts already taken (-inf here), so each pass takes a new expert.
    key = tl.where(score != score, float("inf"), score)  # noqa: PLR0124
    key = tl.where(key == float("-inf"), -3.4028234663852886e38, key)
    alive = valid[None, :] & (rows >= 0)[:, None]  # [BLOCK_T, BLOCK_E]
    slots = tl.arange(0, BLOCK_K)[None, :]
    top = tl.zeros([x.shape[0], BLOCK_K], dtype=tl.float32)
    ids = tl.zeros([x.shape[0], BLOCK_K], dtype=tl.int32)
    for j in tl.static_range(K):
        # One (value, index) reduction a row: the largest key, the lowest index among equal ones.
        _, pick = tl.max(tl.where(alive, key, float("-inf")), axis=1, return_indices=True,
                         return_indices_tie_break_left=True)  # fmt: skip
        chosen = offs[None, :] == pick[:, None]
        top = tl.where(slots == j, tl.sum(tl.where(chosen, score, 0.0), axis=1)[:, None], top)
        ids = tl.where(slots == j, pick[:, None], ids)
        alive = alive & (offs[None, :] != pick[:, None])
    in_k = slots < K
    if TOPK_SOFTMAX:
        t = tl.where(in_k, top, float("-inf"))
        e = torch_exp(t - tl.max(t, axis=1)[:, None], PRECISE_EXP)
        w = tl.math.div_rn(e, tl.sum(e, axis=1)[:, None])
    elif RENORMALIZE:
        w = tl.math.div_rn(top, tl.sum(tl.where(in_k, top, 0.0), axis=1)[:, None])
    else:
        w = top
    if ROUND_TO_LOGITS:
        w = w.to(x_dtype_ptr.dtype.element_ty).to(tl.float32)
    out = rows[:, None] * K + slots
    ok = row_ok[:, None] & in_k
    tl.store(weights_ptr + out, w.to(weights_ptr.dtype.element_ty), mask=ok)
    tl.store(ids_ptr + out, ids.to(tl.int64), mask=ok)


@triton.jit
def _route_kernel(
    logits_ptr,  # [T, E] contiguous, x's dtype
    weights_ptr,  # [T, K] out: fp32 or x's dtype
    ids_ptr,  # [T, K] out: int64
    E: tl.constexpr,
    K: tl.constexpr,
    TOPK_SOFTMAX: tl.constexpr,  # 0: softmax then top-k; 1: top-k then softmax over the k
    RENORMALIZE: tl.constexpr,  # softmax_topk: divide the top-k probabilities by their sum
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISE_EXP: tl.constexpr,  # libdevice's exp (CUDA); tl.exp under the interpreter
    ROUND_TO_LOGITS: tl.constexpr,  # round the weights to the logits' (x's) dtype, then store them as fp32
    PDL: tl.constexpr = False,  # launched with programmatic dependent launch (kernels/pdl.py)
):
    if PDL:
        gdc_wait()  # before any memory access: the kernel before may still be running
    rows = tl.program_id(0).to(tl.int64) + tl.arange(0, 1)  # one row a program
    offs = tl.arange(0, BLOCK_E)
    valid = offs < E
    x = tl.load(logits_ptr + rows[:, None] * E + offs[None, :], mask=valid[None, :], other=float("-inf"))
    _route_rows(
        x.to(tl.float32), rows, rows >= 0, valid, offs, weights_ptr, ids_ptr, logits_ptr, K, TOPK_SOFTMAX,
        RENORMALIZE, BLOCK_K, PRECISE_EXP, ROUND_TO_LOGITS,
    )  # fmt: skip


def num_warps(num_experts: int) -> int:
    """One warp for up to 256 experts (8 a thread: every reduction stays in the warp's shuffles)."""
    return max(1, triton.next_power_of_2(num_experts) // 256)


def route_logits(
    logits: torch.Tensor,
    top_k: int,
    scoring: str,
    renormalize: bool,
    weights_dtype: torch.dtype,
    widen: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] (x's dtype) -> (topk_weights [T, k] in ``weights_dtype``, topk_ids [T, k]
    int64), moe_routing.route's results (see the module docstring for ties and rounding). With
    ``widen`` the weights are stored as fp32, holding the same values (rounded to
    ``weights_dtype`` first): what fused_moe reads, without its conversion launch. The caller
    checks ``supported``; no host sync."""
    t, e = logits.shape
    if not supported(e, top_k):
        raise ValueError(
            f"the routing kernel takes up to {MAX_EXPERTS} experts and top-k <= {MAX_TOP_K}; got {e}, {top_k}"
        )
    if scoring not in SCORINGS:
        raise ValueError(f"unknown scoring {scoring!r}")
    if weights_dtype not in (torch.float32, logits.dtype):
        raise ValueError(f"the weights are fp32 or the logits' dtype {logits.dtype}, not {weights_dtype}")
    logits = logits.contiguous()
    round_to_logits = widen and weights_dtype != torch.float32
    out_dtype = torch.float32 if widen else weights_dtype
    weights = torch.empty((t, top_k), dtype=out_dtype, device=logits.device)
    ids = torch.empty((t, top_k), dtype=torch.int64, device=logits.device)
    if t == 0:
        return weights, ids
    _route_kernel[(t,)](
        logits, weights, ids, E=e, K=top_k, TOPK_SOFTMAX=scoring == "topk_softmax", RENORMALIZE=renormalize,
        BLOCK_E=triton.next_power_of_2(e), BLOCK_K=triton.next_power_of_2(top_k), PRECISE_EXP=logits.is_cuda,
        ROUND_TO_LOGITS=round_to_logits, num_warps=num_warps(e), **pdl.launch_options(),
    )  # fmt: skip
    return weights, ids


# ---------------------------------------------------------------------------- router GEMV + routing, one launch


@triton.jit(do_not_specialize=["T"])
def _router_route_kernel(
    x_ptr,  # [T, H], H contiguous (NORM: the stream's new part, added to the residual first)
    w_ptr,  # router [E, H] contiguous, x's dtype
    b_ptr,  # router bias [E] or unused
    part_ptr,  # fp32 [SPLIT_H, T, E]: each split's partial logits
    count_ptr,  # int32 [>= 1]: programs finished, 0 between launches (kernels/split_k.py)
    weights_ptr,  # [T, K] out: fp32 or x's dtype
    ids_ptr,  # [T, K] out: int64
    res_ptr,  # NORM: residual [T, H] contiguous, x's dtype
    norm_w_ptr,  # NORM: the RMSNorm weight [H], x's dtype
    res_out_ptr,  # NORM: out, x + residual [T, H] contiguous
    normed_ptr,  # NORM: out, RMSNorm(x + residual) * weight [T, H] contiguous: the experts' input
    eps,  # NORM: the RMSNorm epsilon
    T,
    H,
    stride_xm,
    STEPS,  # BLOCK_H steps per split (the last split may have fewer)
    E: tl.constexpr,
    K: tl.constexpr,
    TOPK_SOFTMAX: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_T: tl.constexpr,  # 16: the tensor cores' minimum rows, >= T
    ROUTE_T: tl.constexpr,  # next_power_of_2(T): the rows the last program routes
    BLOCK_X: tl.constexpr,  # experts a program computes the logits of
    BLOCK_H: tl.constexpr,
    SPLIT_H: tl.constexpr,  # programs per expert block, each over STEPS steps of H (grid axis 1)
    BLOCK_E: tl.constexpr,  # next_power_of_2(E)
    BLOCK_K: tl.constexpr,
    PRECISE_EXP: tl.constexpr,
    ROUND_TO_LOGITS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    NORM: tl.constexpr = False,  # the residual add and the RMSNorm first (rms_norm.fused_add_rms_norm's)
    NORM_H: tl.constexpr = 1,  # NORM: next_power_of_2(H)
    NORM_CHUNK: tl.constexpr = 1,  # NORM: elements of a row a load takes (8 a thread)
    PDL: tl.constexpr = False,  # launched with programmatic dependent launch (kernels/pdl.py)
):
    if PDL:
        gdc_wait()  # before any memory access: the kernel before may still be running
    # The logits of BLOCK_X experts over this program's share of H, for every token.
    offs_t = tl.arange(0, BLOCK_T)
    t_ok = offs_t < T
    offs_x = tl.program_id(0) * BLOCK_X + tl.arange(0, BLOCK_X)
    x_ok = offs_x < E
    first = tl.program_id(1) * STEPS
    last = tl.minimum(first + STEPS, tl.cdiv(H, BLOCK_H))
    if NORM:
        # Every program needs each token's rstd over the whole row (2-8 KB a token, from L2): the
        # sum of squares of x + residual rounded to x's dtype, as fused_add_rms_norm sums them.
        # Unrolled over tokens and chunks, so every load is independent and their L2 round trips
        # overlap (a loop that loads, then adds, pays one round trip a step: the first version,
        # over BLOCK_H steps, doubled the launch's time on an H100).
        rstd = tl.zeros((BLOCK_T,), dtype=tl.float32)
        for t in tl.static_range(ROUTE_T):
            sq = 0.0
            for c in tl.static_range(0, NORM_H, NORM_CHUNK):
                offs_c = c + tl.arange(0, NORM_CHUNK)
                c_ok = (offs_c < H) & (t < T)
                v = tl.load(x_ptr + t * stride_xm + offs_c, mask=c_ok, other=0.0).to(tl.float32)
                v += tl.load(res_ptr + t * stride_xm + offs_c, mask=c_ok, other=0.0).to(tl.float32)
                v = v.to(x_ptr.dtype.element_ty).to(tl.float32)
                sq += tl.sum(v * v, axis=0)
            rstd = tl.where(offs_t == t, tl.math.rsqrt(sq / H + eps), rstd)
    acc = tl.zeros((BLOCK_T, BLOCK_X), dtype=tl.float32)
    for i in range(first, last):
        offs_h = i * BLOCK_H + tl.arange(0, BLOCK_H)
        h_ok = offs_h < H
        a = tl.load(x_ptr + offs_t[:, None] * stride_xm + offs_h[None, :], mask=t_ok[:, None] & h_ok[None, :], other=0.0)
        if NORM:
            # This program's share of the row: x + residual, normalised and weighted as
            # fused_add_rms_norm rounds them; the first expert block's programs store both.
            m = t_ok[:, None] & h_ok[None, :]
            row = offs_t[:, None] * stride_xm + offs_h[None, :]
            xr = (a.to(tl.float32) + tl.load(res_ptr + row, mask=m, other=0.0).to(tl.float32)).to(a.dtype)
            normed = (xr.to(tl.float32) * rstd[:, None]).to(a.dtype).to(tl.float32)
            a = (tl.load(norm_w_ptr + offs_h, mask=h_ok, other=0.0).to(tl.float32)[None, :] * normed).to(a.dtype)
            store = m & (tl.program_id(0) == 0)
            tl.store(res_out_ptr + row, xr, mask=store)
            tl.store(normed_ptr + row, a, mask=store)
        w = tl.load(w_ptr + offs_x[None, :].to(tl.int64) * H + offs_h[:, None], mask=h_ok[:, None] & x_ok[None, :], other=0.0)
        acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
    tl.store(part_ptr + tl.program_id(1) * (T * E) + offs_t[:, None] * E + offs_x[None, :], acc,
             mask=t_ok[:, None] & x_ok[None, :])  # fmt: skip
    # The program drawing the launch's last ticket adds the partials in split order (the same sum
    # whichever program is last), adds the bias, rounds to x's dtype as F.linear's output is,
    # routes every token and sets the counter back to 0.
    if split_k.last_to_arrive(count_ptr, tl.num_programs(0) * SPLIT_H):
        rows = tl.arange(0, ROUTE_T).to(tl.int64)
        r_ok = rows < T
        offs = tl.arange(0, BLOCK_E)
        valid = offs < E
        ok = r_ok[:, None] & valid[None, :]
        logits = tl.zeros((ROUTE_T, BLOCK_E), dtype=tl.float32)
        for s in range(SPLIT_H):  # .cg: from L2, where the other programs' partials are
            logits += tl.load(part_ptr + s * (T * E) + rows[:, None] * E + offs[None, :], mask=ok, other=0.0,
                              cache_modifier=".cg")  # fmt: skip
        if HAS_BIAS:
            logits += tl.load(b_ptr + offs, mask=valid, other=0.0).to(tl.float32)[None, :]
        logits = logits.to(x_ptr.dtype.element_ty).to(tl.float32)
        logits = tl.where(valid[None, :], logits, float("-inf"))
        _route_rows(
            logits, rows, r_ok, valid, offs, weights_ptr, ids_ptr, x_ptr, K, TOPK_SOFTMAX, RENORMALIZE, BLOCK_K,
            PRECISE_EXP, ROUND_TO_LOGITS,
        )  # fmt: skip
        split_k.reset(count_ptr)


UNFUSED = KernelConfig({"unfused": 1}, num_warps=0, num_stages=0)  # F.linear (cuBLAS), then _route_kernel
FUSED_MAX_TOKENS = 16  # one 16-row dot holds every token (and the split counters serve 16 rows at most)
FUSED_MAX_EXPERTS = 256  # the last program holds [tokens, experts] logits in registers
FUSED_CONFIG_SPACE: list[KernelConfig] = [UNFUSED] + [
    KernelConfig({"BLOCK_X": bx, "BLOCK_H": bh, "SPLIT_H": sh}, num_warps=w, num_stages=st)
    for (bx, bh, sh, w, st) in (
        # (experts a program, BLOCK_H, splits of H, num_warps, num_stages). A router is small
        # (Qwen3-30B-A3B's 128 x 2048 bf16: 0.5 MB), so the launch is latency-bound: many small
        # programs, each a few K steps.
        (16, 128, 1, 4, 4),
        (16, 128, 2, 4, 4),
        (16, 128, 4, 4, 3),
        (16, 128, 8, 4, 2),
        (16, 256, 4, 4, 2),
        (32, 128, 4, 4, 3),
        (32, 64, 8, 4, 3),
        (64, 128, 2, 4, 3),
        # Fewer warps: the last program's routing (k max-reductions over the experts, a softmax, a
        # sum) then stays in one warp's shuffles instead of crossing warps through shared memory
        # with a barrier each time; Qwen3-30B-A3B's fused launch (4 warps) took 7.1 us at one token
        # on the H200 (twenty-fifth session), the one-warp routing kernel alone 2.6.
        (16, 128, 4, 1, 3),
        (16, 128, 8, 1, 2),
        (16, 128, 4, 2, 3),
    )
]


def is_fused(config: KernelConfig | None) -> bool:
    return config is not None and "BLOCK_X" in config.params


def fused_supported(num_tokens: int, num_experts: int, top_k: int) -> bool:
    """Whether ``router_route`` takes this many tokens, experts and this top-k."""
    return 1 <= num_tokens <= FUSED_MAX_TOKENS and num_experts <= FUSED_MAX_EXPERTS and supported(num_experts, top_k)


def runs_fused(config: KernelConfig | None, num_tokens: int, num_experts: int, top_k: int) -> bool:
    """Whether the router runs fused (``router_route``) for this batch: a fused config that takes it."""
    return is_fused(config) and fused_supported(num_tokens, num_experts, top_k)


def prune_configs(configs: list[KernelConfig], num_experts: int, hidden: int) -> list[KernelConfig]:
    """The unfused path, and fused tiles no wider than the experts (rounded up to 16, tl.dot's
    minimum) whose every split gets at least one BLOCK_H step."""
    widest = max(16, triton.next_power_of_2(num_experts))
    return [
        c for c in configs
        if not is_fused(c) or (c["BLOCK_X"] <= widest and triton.cdiv(hidden, c["BLOCK_H"]) >= c["SPLIT_H"])
    ]  # fmt: skip


def router_route(
    x: torch.Tensor,
    router_weight: torch.Tensor,
    router_bias: torch.Tensor | None,
    top_k: int,
    scoring: str,
    renormalize: bool,
    weights_dtype: torch.dtype,
    widen: bool,
    config: KernelConfig,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``route_logits(F.linear(x, router_weight, router_bias), ...)`` in one launch for up to
    FUSED_MAX_TOKENS tokens (``fused_supported``): the router GEMV split over expert blocks and H,
    the last program to finish adding the partial logits in a fixed order and routing every token
    (the module docstring's routing, unchanged). The logits are the GEMV's fp32 sums rounded to x's
    dtype, as F.linear's are, summed in another order than cuBLAS's: a token whose top-k boundary
    lies within a rounding step of x's dtype may be routed as either would. No host sync; the
    caller checks ``fused_supported``."""
    weights, ids, _, _ = _router_launch(
        x, None, router_weight, router_bias, top_k, scoring, renormalize, weights_dtype, widen, config
    )
    return weights, ids


def norm_fusable(hidden: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, router_weight: torch.Tensor) -> bool:
    """Whether ``add_norm_router_route`` takes these: one dtype for all four, contiguous rows."""
    return (
        hidden.dtype == residual.dtype == norm_weight.dtype == router_weight.dtype
        and hidden.is_contiguous() and residual.is_contiguous() and norm_weight.is_contiguous()
    )  # fmt: skip


def add_norm_router_route(
    hidden: torch.Tensor,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    router_weight: torch.Tensor,
    router_bias: torch.Tensor | None,
    top_k: int,
    scoring: str,
    renormalize: bool,
    weights_dtype: torch.dtype,
    widen: bool,
    config: KernelConfig,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """rms_norm.fused_add_rms_norm(hidden, residual, norm_weight, eps) and ``router_route`` of its
    output in the router's one launch: returns (x, residual', topk_weights, topk_ids), x =
    RMSNorm(hidden + residual) * norm_weight (the experts' input), residual' = hidden + residual,
    as new tensors. Every program computes its tokens' rstd over the whole row; the first expert
    block's programs store their share of x and residual'. The sum of squares adds in another
    order than the norm kernel's, so x may differ from it by a rounding step of its dtype. The
    caller checks ``fused_supported`` and ``norm_fusable``."""
    weights, ids, x, residual_out = _router_launch(
        hidden, (residual, norm_weight, eps), router_weight, router_bias, top_k, scoring, renormalize,
        weights_dtype, widen, config,
    )  # fmt: skip
    return x, residual_out, weights, ids  # type: ignore[return-value]


def _router_launch(
    x: torch.Tensor,
    norm: tuple[torch.Tensor, torch.Tensor, float] | None,
    router_weight: torch.Tensor,
    router_bias: torch.Tensor | None,
    top_k: int,
    scoring: str,
    renormalize: bool,
    weights_dtype: torch.dtype,
    widen: bool,
    config: KernelConfig,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    t, h = x.shape
    e = router_weight.shape[0]
    if not fused_supported(t, e, top_k):
        raise ValueError(f"the fused router takes 1-{FUSED_MAX_TOKENS} tokens and up to {FUSED_MAX_EXPERTS} experts")
    if scoring not in SCORINGS:
        raise ValueError(f"unknown scoring {scoring!r}")
    if weights_dtype not in (torch.float32, x.dtype):
        raise ValueError(f"the weights are fp32 or x's dtype {x.dtype}, not {weights_dtype}")
    if norm is not None:
        residual, norm_weight, eps = norm
        if not norm_fusable(x, residual, norm_weight, router_weight) or residual.shape != x.shape:
            raise ValueError("the fused norm takes contiguous hidden, residual, norm and router weights of one dtype")
        res_out, normed = torch.empty_like(x), torch.empty_like(x)
    elif x.stride(1) != 1:
        x = x.contiguous()
    router_weight = router_weight.contiguous()
    bx, bh = config["BLOCK_X"], config["BLOCK_H"]
    num_steps = triton.cdiv(h, bh)
    split, steps = split_k.split_steps(num_steps, config["SPLIT_H"])
    round_to_logits = widen and weights_dtype != torch.float32
    weights = torch.empty((t, top_k), dtype=torch.float32 if widen else weights_dtype, device=x.device)
    ids = torch.empty((t, top_k), dtype=torch.int64, device=x.device)
    part, counters = split_k.partials(x.device, split, t, e, 1, "router_route")
    if norm is None:
        residual = norm_weight = res_out = normed = x  # unread without NORM
        eps = 0.0
    _router_route_kernel[(triton.cdiv(e, bx), split)](
        x, router_weight, router_bias if router_bias is not None else router_weight, part, counters, weights, ids,
        residual, norm_weight, res_out, normed, eps, t, h, x.stride(0), steps, E=e, K=top_k, TOPK_SOFTMAX=scoring == "topk_softmax", RENORMALIZE=renormalize,
        HAS_BIAS=router_bias is not None, BLOCK_T=FUSED_MAX_TOKENS, ROUTE_T=triton.next_power_of_2(t), BLOCK_X=bx,
        BLOCK_H=bh, SPLIT_H=split, BLOCK_E=triton.next_power_of_2(e), BLOCK_K=triton.next_power_of_2(top_k),
        PRECISE_EXP=x.is_cuda, ROUND_TO_LOGITS=round_to_logits,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32", NORM=norm is not None,
        NORM_H=triton.next_power_of_2(h), NORM_CHUNK=min(triton.next_power_of_2(h), 256 * config.num_warps),
        num_warps=config.num_warps, num_stages=config.num_stages, **pdl.launch_options(),
    )  # fmt: skip
    if norm is None:
        return weights, ids, None, None
    return weights, ids, normed, res_out
