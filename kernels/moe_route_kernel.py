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

from pagecast.kernels import pdl
from pagecast.kernels.moe_routing import SCORINGS
from pagecast.kernels.sampling import torch_exp

MAX_EXPERTS = 1024  # one row in one program's registers; wider routers take the torch path
MAX_TOP_K = 32  # k passes unrolled


def supported(num_experts: int, top_k: int) -> bool:
    """Whether the kernel routes this many experts and this top-k (else the torch path does)."""
    return 1 <= top_k <= min(num_experts, MAX_TOP_K) and num_experts <= MAX_EXPERTS


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
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_E)
    valid = offs < E
    x = tl.load(logits_ptr + row * E + offs, mask=valid, other=float("-inf")).to(tl.float32)
    if TOPK_SOFTMAX:
        score = x
    else:
        e = torch_exp(x - tl.max(x, axis=0), PRECISE_EXP)  # padding: exp(-inf) = 0
        score = tl.math.div_rn(e, tl.sum(e, axis=0))  # IEEE, as torch (Triton's / is div.full)
    # The ranking key: NaN first (torch.topk's rule; x != x, the interpreter has no isnan), a -inf
    # score above the experts already taken (-inf here), so each pass takes a new expert.
    key = tl.where(score != score, float("inf"), score)  # noqa: PLR0124
    key = tl.where(key == float("-inf"), -3.4028234663852886e38, key)
    alive = valid
    slots = tl.arange(0, BLOCK_K)
    top = tl.zeros([BLOCK_K], dtype=tl.float32)
    ids = tl.zeros([BLOCK_K], dtype=tl.int32)
    for j in tl.static_range(K):
        # One (value, index) reduction: the largest key, the lowest index among equal ones.
        _, pick = tl.max(tl.where(alive, key, float("-inf")), axis=0, return_indices=True,
                         return_indices_tie_break_left=True)  # fmt: skip
        top = tl.where(slots == j, tl.sum(tl.where(offs == pick, score, 0.0), axis=0), top)
        ids = tl.where(slots == j, pick, ids)
        alive = alive & (offs != pick)
    in_k = slots < K
    if TOPK_SOFTMAX:
        t = tl.where(in_k, top, float("-inf"))
        e = torch_exp(t - tl.max(t, axis=0), PRECISE_EXP)
        w = tl.math.div_rn(e, tl.sum(e, axis=0))
    elif RENORMALIZE:
        w = tl.math.div_rn(top, tl.sum(tl.where(in_k, top, 0.0), axis=0))
    else:
        w = top
    if ROUND_TO_LOGITS:
        w = w.to(logits_ptr.dtype.element_ty).to(tl.float32)
    out = row * K + slots
    tl.store(weights_ptr + out, w.to(weights_ptr.dtype.element_ty), mask=in_k)
    tl.store(ids_ptr + out, ids.to(tl.int64), mask=in_k)


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
