"""The fused MoE routing kernel (kernels/moe_route_kernel.py) against moe_routing's torch path, in
the Triton interpreter on the CPU: ids equal where the scores have no exact tie, the lowest expert
index where they do, weights within an ulp or two; and the build compiles the one variant serving
launches. tests/test_moe_route_kernel_gpu.py checks the same on CUDA."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

pytest.importorskip("triton")

from triton.backends.compiler import BaseBackend
from triton.runtime.jit import JITFunction, create_function_from_signature

from pagecast.kernels import moe_route_kernel
from pagecast.kernels.moe_routing import MoeRouting, route, route_torch, weights_dtype

INT_VIEW = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}

# softmax_topk with each (renormalize, weights_in_x_dtype), and gpt-oss's topk_softmax
ROUTINGS = [("softmax_topk", r, w) for r in (False, True) for w in (False, True)] + [
    ("topk_softmax", False, False)
]


def ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Steps between two tensors of non-negative floats of one dtype (their bits as integers)."""
    assert a.dtype == b.dtype
    view = INT_VIEW[a.dtype]
    return (a.contiguous().view(view).long() - b.contiguous().view(view).long()).abs()


def scores(logits: torch.Tensor, scoring: str) -> torch.Tensor:
    """What the top-k ranks, as the torch path computes it."""
    return logits.float() if scoring == "topk_softmax" else torch.softmax(logits, dim=-1, dtype=torch.float32)


def lowest_index_topk(s: torch.Tensor, k: int) -> torch.Tensor:
    """The top k by descending score, exact ties to the lowest index (a stable sort keeps index order)."""
    return torch.sort(s, dim=-1, descending=True, stable=True).indices[:, :k]


def has_tie(s: torch.Tensor, k: int) -> torch.Tensor:
    """Rows whose top k + 1 sorted scores hold an exact tie (one that can change the top-k's ids)."""
    top = torch.sort(s, dim=-1, descending=True).values[:, : k + 1]
    return (top[:, 1:] == top[:, :-1]).any(dim=-1)


def exact_weights(logits: torch.Tensor, ids: torch.Tensor, routing: MoeRouting) -> torch.Tensor:
    """The routing weights at ``ids`` computed in fp64 from the fp32 differences to the row's maximum
    (which torch and the kernel both round to fp32 first; the ids' order: equal scores, equal weights)."""

    def softmax(x: torch.Tensor) -> torch.Tensor:
        return torch.softmax((x - x.max(dim=-1, keepdim=True).values).double(), dim=-1)

    x = logits.float()
    if routing.scoring == "topk_softmax":
        return softmax(x.gather(1, ids))
    top = softmax(x).gather(1, ids)
    return top / top.sum(dim=-1, keepdim=True) if routing.renormalize else top


def make_logits(rows: int, e: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random logits, with some rows of exact ties (all equal; the maximum at three experts; a tie
    straddling the top-k boundary), large ones (saturated softmax: probabilities underflow to exact
    zeros) and logits far from 0 (shifted by +-1000)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, e, generator=g) * 2
    special = [
        lambda r: r.zero_(),
        lambda r: r.index_fill_(0, torch.tensor([e - 1, e // 2, 1]), r.max().item() + 1),
        lambda r: r.index_fill_(0, torch.tensor([e - 2, 3, 0]), r.sort(descending=True).values[1].item()),
        lambda r: r.mul_(40),
        lambda r: r.add_(1000),
        lambda r: r.sub_(1000),
    ]
    for i, fill in enumerate(special[: max(0, rows - 1)]):
        fill(x[i + 1])
    return x.to(dtype)


def check(logits: torch.Tensor, routing: MoeRouting) -> tuple[int, int]:
    """Kernel against the torch path on these logits; returns (rows with a tie, rows without)."""
    k = routing.top_k
    w, ids = moe_route_kernel.route_logits(
        logits, k, routing.scoring, routing.renormalize, weights_dtype(routing, logits.dtype)
    )
    ref_w, ref_ids = route_torch(logits, routing)
    assert w.dtype == ref_w.dtype and ids.dtype == torch.int64 and ids.shape == ref_ids.shape
    # widened (what ops.moe asks for on a GPU): the same weights as fp32, the same ids
    wide_w, wide_ids = moe_route_kernel.route_logits(
        logits, k, routing.scoring, routing.renormalize, weights_dtype(routing, logits.dtype), widen=True
    )
    # (The interpreter converts subnormal bf16 values to fp32 wrongly, so those are left out here.)
    normal_w = w.float().abs() >= torch.finfo(torch.float32).tiny
    assert wide_w.dtype == torch.float32 and torch.equal(wide_ids, ids)
    assert torch.equal(wide_w[normal_w], w.float()[normal_w])
    s = scores(logits, routing.scoring)
    tie = has_tie(s, k)
    # Every row: descending score, exact ties to the lowest index (torch.topk's own tie order is
    # arbitrary on the CPU, so its ids are compared only on rows without ties).
    assert torch.equal(ids, lowest_index_topk(s, k))
    assert torch.equal(ids[~tie], ref_ids[~tie])
    # The weights, against the same formula in fp64 at the kernel's ids, rounded to the weights'
    # dtype: fp32 ones within 4 ulps (an exp, a sum of up to 128, a division; the interpreter's
    # exp is NumPy's), 6 where renormalised (another sum and division), as the torch path's are
    # (its CPU softmax multiplies by the sum's reciprocal): the two may differ by more than an
    # ulp. Rounded to a half type, within one step of it and of the torch path's (the
    # interpreter's fp32 -> bf16 cast truncates; compiled, it rounds to nearest even, as torch).
    # Below fp32's normal range (saturated rows' underflowing probabilities) fp32 steps are
    # absolute: there, within fp32's smallest normal.
    exact64 = exact_weights(logits, ids, routing)
    exact = exact64.to(w.dtype)
    assert torch.equal(exact.isfinite(), w.isfinite()) and torch.equal(exact.isfinite(), ref_w.isfinite())
    tiny = torch.finfo(torch.float32).tiny
    normal = exact64.abs() >= tiny
    fp32_steps = 6 if routing.renormalize else 4
    assert ulps(w[normal], exact[normal]).max().item() <= (fp32_steps if w.dtype == torch.float32 else 1)
    assert ((w.double() - exact64)[~normal].abs() <= tiny).all()
    if w.dtype == torch.float32:
        assert ulps(ref_w[normal], exact[normal]).max().item() <= fp32_steps
    if w.dtype != torch.float32:
        assert ulps(w[normal], ref_w[normal]).max().item() <= 1
    return int(tie.sum()), int((~tie).sum())


# (experts, top-k) of the families served: Mixtral's 8 x 2, Qwen2-MoE's 60 x 4, Qwen3-MoE's 128 x 8
# (OLMoE's 64 x 8 and gpt-oss's 32 / 128 x 4 take the same paths), and top-1, where renormalising
# makes every weight 1.
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize(("e", "top_k"), [(8, 1), (8, 2), (60, 4), (128, 8)])
def test_kernel_equals_the_torch_path(dtype: torch.dtype, e: int, top_k: int) -> None:
    ties = plain = 0
    for i, (scoring, renormalize, in_x) in enumerate(ROUTINGS):
        routing = MoeRouting(top_k, scoring=scoring, renormalize=renormalize, weights_in_x_dtype=in_x)
        for rows in (1, 3, 17):
            t, p = check(make_logits(rows, e, dtype, seed=100 * e + 10 * top_k + i), routing)
            ties, plain = ties + t, plain + p
    assert ties and plain  # both kinds of row were checked


def test_tied_rows_go_to_the_lowest_indices() -> None:
    """Explicitly: all-equal logits take experts 0..k-1; a three-way tie at the maximum takes the
    tied experts in index order; torch.topk on the CPU does not (why the rule is documented)."""
    logits = torch.zeros(2, 128)
    logits[1, [90, 7, 40]] = 5.0
    for scoring in ("softmax_topk", "topk_softmax"):
        _, ids = moe_route_kernel.route_logits(logits, 8, scoring, True, torch.float32)
        assert ids[0].tolist() == list(range(8))
        assert ids[1].tolist() == [7, 40, 90, 0, 1, 2, 3, 4]
    assert torch.topk(logits[:1], 8).indices[0].tolist() != list(range(8))


def test_nan_logits_still_route_to_distinct_experts() -> None:
    """A NaN ranks first (torch.topk's rule) and every id is a distinct expert in range, so the
    fused MoE never reads outside the expert weights."""
    logits = torch.randn(3, 60)
    logits[0, 5] = float("nan")
    logits[1] = float("nan")
    logits[2] = float("-inf")
    for scoring in ("softmax_topk", "topk_softmax"):
        _, ids = moe_route_kernel.route_logits(logits, 8, scoring, False, torch.float32)
        assert all(len(set(row)) == 8 and 0 <= min(row) and max(row) < 60 for row in ids.tolist())
    _, ids = moe_route_kernel.route_logits(logits, 8, "topk_softmax", False, torch.float32)
    assert ids[0, 0].item() == 5 and ids[1].tolist() == list(range(8)) and ids[2].tolist() == list(range(8))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_torch_half_softmax_is_the_fp32_one_rounded(dtype: torch.dtype) -> None:
    """What the kernel's topk_softmax relies on: torch.softmax(top, dtype=x.dtype) for a half type
    is the fp32 softmax rounded to it (torch accumulates half types in float). Not bit for bit:
    where the exact value lies within an fp32 ulp of a half-type midpoint, torch's fp32 and another
    fp32 computation may round to either neighbour (1 in ~10,000 here)."""
    top = (torch.randn(4000, 4, generator=torch.Generator().manual_seed(0)) * 3).to(dtype)
    torch_half = torch.softmax(top, dim=-1, dtype=dtype)
    rounded = torch.softmax(top.float(), dim=-1).to(dtype)
    assert ulps(torch_half, rounded).max().item() <= 1
    assert (torch_half != rounded).float().mean().item() < 1e-3


def test_route_takes_the_kernel_only_where_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    """On the CPU ``route`` is the torch path (the CPU engine routes as before); use_kernel=True runs
    the kernel; routers the kernel does not take fall back to torch."""
    g = torch.Generator().manual_seed(1)
    x, w, b = torch.randn(5, 32, generator=g), torch.randn(60, 32, generator=g), torch.randn(60, generator=g)
    routing = MoeRouting(4, renormalize=True)
    expected = route_torch(torch.nn.functional.linear(x, w, b), routing)
    kernel_w, kernel_ids = route(x, w, b, routing, use_kernel=True)
    assert torch.equal(kernel_ids, expected[1]) and ulps(kernel_w, expected[0]).max() <= 2

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the kernel ran")

    monkeypatch.setattr(moe_route_kernel, "route_logits", refuse)
    for got, want in zip(route(x, w, b, routing), expected):
        assert torch.equal(got, want)
    wide = torch.randn(moe_route_kernel.MAX_EXPERTS + 1, 32, generator=g)
    for got, want in zip(route(x, wide, None, routing, use_kernel=True), route_torch(x @ wide.T, routing)):
        assert torch.equal(got, want)
    assert route(x, w, b, MoeRouting(moe_route_kernel.MAX_TOP_K + 1), use_kernel=True)[1].shape == (5, 33)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_widened_weights_change_no_expert_loop_result(dtype: torch.dtype) -> None:
    """ops.moe on a GPU hands fused_moe the weights widened to fp32 (``route(..., widen=True)``),
    which its kernels read anyway; the naive expert loop (reference.fused_moe) then multiplies
    the half-type expert outputs by fp32 weights. A product of two half-type values is exact in
    fp32, so rounded to the half type it is the product the loop computed before, bit for bit."""
    from pagecast.kernels import reference

    g = torch.Generator().manual_seed(0)
    e, k, h, i, t = 8, 2, 32, 16, 9
    x = torch.randn(t, h, generator=g).to(dtype)
    w_gate_up = (torch.randn(e, 2 * i, h, generator=g) * 0.3).to(dtype)
    w_down = (torch.randn(e, h, i, generator=g) * 0.3).to(dtype)
    routing = MoeRouting(k, renormalize=True, weights_in_x_dtype=True)
    router = torch.randn(e, h, generator=g).to(dtype)
    weights, ids = route(x, router, None, routing, use_kernel=True)
    wide, wide_ids = route(x, router, None, routing, use_kernel=True, widen=True)
    assert weights.dtype == dtype and wide.dtype == torch.float32 and torch.equal(wide, weights.float())
    assert torch.equal(wide_ids, ids)
    weights, ids = route(x, router, None, routing)  # the torch path widens exactly too
    assert torch.equal(route(x, router, None, routing, widen=True)[0], weights.float())
    before = reference.fused_moe(x, weights, ids, w_gate_up, w_down)
    assert torch.equal(reference.fused_moe(x, weights.float(), ids, w_gate_up, w_down), before)
    # (fp32 weights that are not half-type values do change it)
    assert not torch.equal(
        reference.fused_moe(x, weights.float() * (1 + 2**-12), ids, w_gate_up, w_down), before
    )


def record_variants(
    monkeypatch: pytest.MonkeyPatch, name: str, only: Callable[[dict[str, Any]], bool] = lambda kwargs: True
) -> list[tuple]:
    """Replace moe_route_kernel.<name> by a launcher that records each launch's Triton variant
    (specialisation and options, through Triton's own argument binder) where ``only`` says, then
    launches it; returns the list the keys go to."""
    kernel = getattr(moe_route_kernel, name)
    jit = JITFunction(getattr(kernel, "fn", kernel))
    binder = create_function_from_signature(jit.signature, jit.params, BaseBackend)
    keys: list[tuple] = []

    class Recorded:
        def __getitem__(self, grid: Any) -> Any:
            def launch(*args: Any, **kwargs: Any) -> None:
                _, specialization, options = binder(*args, **kwargs)
                if only(kwargs):
                    keys.append((tuple(map(tuple, specialization)), tuple(sorted(options.items()))))
                kernel[grid](*args, **kwargs)

            return launch

    monkeypatch.setattr(moe_route_kernel, name, Recorded())
    return keys


def test_served_launches_are_the_built_variant(monkeypatch: pytest.MonkeyPatch) -> None:
    """The build (builder/tune.py, compile_route_kernel) launches the routing kernel in the variant
    (Triton's specialisation key, through its own argument binder) that ops.moe's launches take
    on a GPU at every batch size, for each family's routing; another model's experts are another
    variant. (ops.moe runs here with Triton on and the fused experts stubbed out.)"""
    from pagecast.builder import tune
    from pagecast.kernels import ops

    monkeypatch.setattr(ops, "_triton", lambda x: True)
    monkeypatch.setattr(ops, "_moe_kernel", lambda: lambda x, *args: torch.zeros_like(x))
    keys = record_variants(monkeypatch, "_route_kernel")
    families = {  # (experts, top_k, routing): Qwen3-30B-A3B, Mixtral, gpt-oss-20b
        "qwen3": (128, 8, {"scoring": "softmax_topk", "renormalize": True, "weights_in_x_dtype": True}),
        "mixtral": (8, 2, {"scoring": "softmax_topk", "renormalize": True, "weights_in_x_dtype": False}),
        "gpt-oss": (32, 4, {"scoring": "topk_softmax", "renormalize": False, "weights_in_x_dtype": False}),
    }
    built_by_family = {}
    for name, (e, k, fields) in families.items():
        keys.clear()
        tune.compile_route_kernel("cpu", e, k, fields, torch.bfloat16)
        built = set(keys)
        assert len(keys) == len(tune.ROUTE_ROWS) and len(built) == 1  # one variant for every row count
        keys.clear()
        routing = MoeRouting(k, **fields)
        w = torch.randn(e, 48).bfloat16()
        experts = torch.zeros(e, 2, 48).bfloat16(), torch.zeros(e, 48, 1).bfloat16()
        for rows in (1, 2, 5, 33, 64):  # (no integer argument: row counts alike past these)
            ops.moe(torch.randn(rows, 48).bfloat16(), w, None, *experts, routing=routing)
        assert set(keys) == built, name
        built_by_family[name] = built
    assert len(set().union(*built_by_family.values())) == 3


def test_the_tune_process_compiles_the_models_routing_kernel(monkeypatch: pytest.MonkeyPatch, capsys) -> None:  # type: ignore[no-untyped-def]
    """builder/tune.py's tuning process (run on the target GPU with the artifact's Triton cache)
    hands the model's routing from model_shapes to the untuned-kernel pass, which compiles the
    routing kernel in it; a dense model's compiles none. (Tuning itself is stubbed out here.)"""
    import json

    from pagecast.builder import tune
    from pagecast.kernels import tuning

    monkeypatch.setattr(tuning, "tune", lambda *args, **kwargs: {"kernels": {}})
    monkeypatch.setattr(tuning, "compile_window_variants", lambda *args: None)
    monkeypatch.setattr(tuning, "measure_copy_bandwidth", lambda device: 1000.0)
    monkeypatch.setattr(tuning, "measure_matmul_tflops", lambda device: 500.0)  # a MoE build's report needs it
    monkeypatch.setattr(tuning, "bandwidth_report", lambda *args: [])
    calls: list[tuple] = []
    monkeypatch.setattr(tune, "_compile_untuned_kernels", lambda *args: calls.append(args))
    routing = {"scoring": "softmax_topk", "renormalize": True, "weights_in_x_dtype": True}
    dense = {"num_heads": 4, "num_kv_heads": 2, "head_dim": 16, "hidden": 64, "intermediate": 128,
             "block_size": 16, "dtype": "bfloat16", "vocab_size": 3001, "logits_stride": 3001}  # fmt: skip
    moe = {**dense, "num_experts": 60, "top_k": 4, "moe_intermediate": 32, "moe_routing": routing}
    tune._tune_main(json.dumps(moe), "1")
    assert json.loads(capsys.readouterr().out)["table"]["matmul_tflops"] == 500.0
    tune._tune_main(json.dumps({**dense, "moe_routing": None}), "1")
    assert "matmul_tflops" not in json.loads(capsys.readouterr().out)["table"]  # dense: not measured
    # the sampler's kernels are compiled in the model's dtype too (its LM head's logits)
    assert calls == [(3001, 3001, (60, 4, routing, torch.bfloat16), torch.bfloat16), (3001, 3001, None, torch.bfloat16)]
    launched = []
    real = moe_route_kernel.route_logits
    monkeypatch.setattr(
        moe_route_kernel, "route_logits", lambda *args: launched.append(args[1:]) or real(*args)
    )
    tune.compile_route_kernel("cpu", *calls[0][2])
    assert launched == [(4, "softmax_topk", True, torch.bfloat16, True)] * len(tune.ROUTE_ROWS)


# ---------------------------------------------------------------------------- the fused router (GEMV + routing)

FAMILY_ROUTERS = {  # (experts, top_k, routing fields, router bias): Qwen3-MoE, Mixtral, gpt-oss, Qwen2-MoE, Granite-MoE
    "qwen3": (128, 8, {"scoring": "softmax_topk", "renormalize": True, "weights_in_x_dtype": True}, False),
    "mixtral": (8, 2, {"scoring": "softmax_topk", "renormalize": True, "weights_in_x_dtype": False}, False),
    "gpt-oss": (32, 4, {"scoring": "topk_softmax", "renormalize": False, "weights_in_x_dtype": False}, True),
    "qwen2-moe": (60, 4, {"scoring": "softmax_topk", "renormalize": False, "weights_in_x_dtype": True}, False),
    "granite-moe": (40, 8, {"scoring": "topk_softmax", "renormalize": False, "weights_in_x_dtype": False}, False),
}


def small_ints(shape: tuple[int, ...], dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    """Integers in [-2, 2]: every sum of their products is exact in fp32, in any order."""
    return torch.randint(-2, 3, shape, generator=g).to(dtype)


# fp32 and fp16 (the interpreter's bf16 tl.dot is wrong; bf16 runs in the GPU test)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("family", list(FAMILY_ROUTERS))
def test_fused_router_routes_bit_for_bit_as_the_gemv_then_the_routing_kernel(dtype: torch.dtype, family: str) -> None:
    """Every pruned fused config, 1 to 16 tokens, against F.linear then the routing kernel (what
    runs unfused): where the logits are exact (integer inputs), the same ids and the same weights,
    bit for bit, widened or not, with the router's bias where the family has one. So the fused
    launch sums every split, rounds the logits to x's dtype as F.linear does and routes as before.
    Integer logits tie often: the ties go to the lowest index in both."""
    e, k, fields, has_bias = FAMILY_ROUTERS[family]
    routing = MoeRouting(k, **fields)
    hidden = 256  # two steps of 128: split in two
    g = torch.Generator().manual_seed(e)
    router = small_ints((e, hidden), dtype, g)
    bias = small_ints((e,), dtype, g) if has_bias else None
    configs = [c for c in moe_route_kernel.prune_configs(moe_route_kernel.FUSED_CONFIG_SPACE, e, hidden)
               if moe_route_kernel.is_fused(c)]  # fmt: skip
    assert {c["SPLIT_H"] for c in configs} >= {1, 2}
    for tokens in (1, 3, 16):
        x = small_ints((tokens, hidden), dtype, g)
        for widen in (False, True):
            want_w, want_ids = route(x, router, bias, routing, use_kernel=True, widen=widen)
            for cfg in configs:
                got_w, got_ids = route(x, router, bias, routing, use_kernel=True, widen=widen, config=cfg)
                assert torch.equal(got_ids, want_ids), (tokens, cfg)
                assert got_w.dtype == want_w.dtype and torch.equal(got_w, want_w), (tokens, cfg)


def test_fused_router_on_real_valued_logits_routes_as_the_torch_path() -> None:
    """fp32 activations and router of real values: the fused sums come in another order than
    F.linear's, so the logits may differ in the last bits; the ids are the torch path's on every
    token whose k-th and (k+1)-th probabilities are more than 1e-4 apart (all of them here), the
    weights within 1e-5; the split counters are back at 0 after each launch."""
    from pagecast.kernels import split_k

    g = torch.Generator().manual_seed(7)
    routing = MoeRouting(8, renormalize=True, weights_in_x_dtype=True)
    x, router = torch.randn(16, 256, generator=g), torch.randn(128, 256, generator=g) * 0.1
    want_w, want_ids = route_torch(torch.nn.functional.linear(x, router), routing)
    probs = torch.softmax(torch.nn.functional.linear(x, router), dim=-1).sort(dim=-1, descending=True).values
    assert bool(((probs[:, 7] - probs[:, 8]) > 1e-4).all())
    for cfg in (c for c in moe_route_kernel.FUSED_CONFIG_SPACE if moe_route_kernel.is_fused(c)):
        got_w, got_ids = route(x, router, None, routing, use_kernel=True, config=cfg)
        assert torch.equal(got_ids, want_ids), cfg
        torch.testing.assert_close(got_w, want_w, rtol=1e-5, atol=1e-6)
        assert int(split_k.counters(x.device, 1, "test")[0]) == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_the_norm_inside_the_router_equals_the_norm_kernel_then_the_router(dtype: torch.dtype) -> None:
    """add_norm_router_route against rms_norm.fused_add_rms_norm then router_route (same config),
    every pruned fused config, 1, 3 and 16 tokens, H 320 (not a multiple of 128: the last step is
    masked): the same residual' bit for bit, the normalised rows within a rounding step of the dtype
    (the sum of squares adds in another order), the same routing wherever the unfused path's
    normalised rows are fed to both (checked through the ids: the inputs keep every top-k boundary
    clear of a rounding step), the counters back at 0."""
    from pagecast.kernels import rms_norm, split_k

    e, k, fields, _ = FAMILY_ROUTERS["qwen3"]
    routing = MoeRouting(k, **fields)
    hidden = 320
    g = torch.Generator().manual_seed(11)
    router = (torch.randn(e, hidden, generator=g) * 0.5).to(dtype)
    norm_w = (1 + 0.1 * torch.randn(hidden, generator=g)).to(dtype)
    configs = [c for c in moe_route_kernel.prune_configs(moe_route_kernel.FUSED_CONFIG_SPACE, e, hidden)
               if moe_route_kernel.is_fused(c)]  # fmt: skip
    step = 1e-6 if dtype == torch.float32 else 2e-3
    for tokens in (1, 3, 16):
        h = torch.randn(tokens, hidden, generator=g).to(dtype)
        r = torch.randn(tokens, hidden, generator=g).to(dtype)
        want_x, want_r = rms_norm.fused_add_rms_norm(h, r, norm_w, 1e-6)
        for cfg in configs:
            want_w, want_ids = moe_route_kernel.router_route(want_x, router, None, k, routing.scoring,
                                                             routing.renormalize, torch.float32, True, cfg)  # fmt: skip
            x, res, w, ids = moe_route_kernel.add_norm_router_route(
                h, r, norm_w, 1e-6, router, None, k, routing.scoring, routing.renormalize, torch.float32, True, cfg
            )
            assert torch.equal(res, want_r), (tokens, cfg)
            torch.testing.assert_close(x, want_x, rtol=step, atol=step)
            assert torch.equal(ids, want_ids), (tokens, cfg)
            torch.testing.assert_close(w, want_w, rtol=10 * step, atol=10 * step)
            assert int(split_k.counters(h.device, 1, "test")[0]) == 0


def test_ops_add_norm_moe_fuses_the_norm_only_where_the_router_is_fused(monkeypatch: pytest.MonkeyPatch) -> None:
    """ops.add_norm_moe on a "GPU" (the interpreter): where the table fuses the router (t1, t4 here)
    the add and norm run in its launch, elsewhere the norm kernel then ops.moe; both give the
    reference's residual' and (fp32) the same block output within fp32 rounding."""
    from pagecast.kernels import ops, reference

    monkeypatch.setattr(ops, "_triton", lambda x: True)
    fused_runs: list[int] = []
    real = moe_route_kernel.add_norm_router_route
    monkeypatch.setattr(moe_route_kernel, "add_norm_router_route",
                        lambda h, *a: fused_runs.append(h.shape[0]) or real(h, *a))  # fmt: skip
    fused = {"BLOCK_X": 16, "BLOCK_H": 64, "SPLIT_H": 2, "num_warps": 4, "num_stages": 2}
    ops.configure({"kernels": {"moe_router": {"t1": {"config": fused}, "t2": {"config": {"unfused": 1}},
                                              "t4": {"config": fused}}}})  # fmt: skip
    g = torch.Generator().manual_seed(5)
    routing = MoeRouting(2, renormalize=True)
    router, norm_w = torch.randn(8, 48, generator=g), 1 + 0.1 * torch.randn(48, generator=g)
    w_gu, w_down = torch.randn(8, 64, 48, generator=g) * 0.2, torch.randn(8, 48, 32, generator=g) * 0.2
    try:
        for rows in (1, 2, 3, 4, 20):
            h, r = torch.randn(rows, 48, generator=g), torch.randn(rows, 48, generator=g)
            out, res = ops.add_norm_moe(h, r, norm_w, 1e-5, router, None, w_gu, w_down, routing=routing)
            x, want_r = reference.fused_add_rms_norm(h, r, norm_w, 1e-5)
            tw, ti = route(x, router, None, routing, use_kernel=False)
            want = reference.fused_moe(x, tw.float(), ti, w_gu, w_down, None, None, "silu", 1.0, None)
            assert torch.equal(res, want_r)
            torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-5)
    finally:
        ops.configure(None)
    assert fused_runs == [1, 3, 4]


def test_the_build_compiles_the_norm_variants_serving_launches(monkeypatch: pytest.MonkeyPatch) -> None:
    """tuning.compile_router_norm_variants (run by the build's tuner) launches the fused router with
    the norm inside in the Triton variant (specialisation and constexprs, through Triton's own
    binder) that ops.add_norm_moe launches at every token count of each bucket the table fuses
    (t1 and t4 here, t2 unfused: no norm variant), and nothing where no bucket is fused."""
    from pagecast.kernels import ops, tuning

    monkeypatch.setattr(ops, "_triton", lambda x: True)
    monkeypatch.setattr(ops, "_moe_kernel", lambda: lambda x, *args: torch.zeros_like(x))
    keys = record_variants(monkeypatch, "_router_route_kernel", only=lambda kwargs: bool(kwargs.get("NORM")))
    fused = {"BLOCK_X": 16, "BLOCK_H": 64, "SPLIT_H": 2, "num_warps": 4, "num_stages": 2}
    table = {"kernels": {"moe_router": {"t1": {"config": fused}, "t2": {"config": {"unfused": 1}},
                                        "t4": {"config": fused}}}}  # fmt: skip
    shapes = tuning.ModelShapes(
        num_heads=4, num_kv_heads=2, head_dim=16, hidden=128, intermediate=256, block_size=16, dtype="float32",
        num_experts=8, top_k=2, moe_intermediate=32, moe_renormalize=True,
    )  # fmt: skip
    assert tuning.compile_router_norm_variants(table, shapes, "cpu") == 2
    built = set(keys)
    assert len(built) == 2  # one variant a fused bucket (its ROUTE_T)
    keys.clear()
    routing = MoeRouting(2, renormalize=True)
    w, norm_w = torch.randn(8, 128), torch.ones(128)
    experts = torch.zeros(8, 64, 128), torch.zeros(8, 128, 32)
    ops.configure(table)
    try:
        for rows in (1, 2, 3, 4):
            ops.add_norm_moe(torch.randn(rows, 128), torch.randn(rows, 128), norm_w, 1e-6, w, None, *experts,
                             routing=routing)  # fmt: skip
    finally:
        ops.configure(None)
    assert len(keys) == 3 and set(keys) <= built  # rows 1, 3 and 4; row 2's bucket is unfused
    keys.clear()
    assert tuning.compile_router_norm_variants({"kernels": {}}, shapes, "cpu") == 0 and not keys


def test_the_fused_router_runs_only_where_it_takes_the_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    """A fused config past FUSED_MAX_TOKENS tokens, or for a router wider than FUSED_MAX_EXPERTS,
    keeps F.linear and the routing kernel (same result as no config); an unfused config too; the
    torch path (use_kernel False: the CPU engine) never runs a kernel."""
    fused = next(c for c in moe_route_kernel.FUSED_CONFIG_SPACE if moe_route_kernel.is_fused(c))
    ran: list[int] = []
    real = moe_route_kernel.router_route
    monkeypatch.setattr(moe_route_kernel, "router_route", lambda x, *a: ran.append(x.shape[0]) or real(x, *a))
    g = torch.Generator().manual_seed(3)
    routing = MoeRouting(2, renormalize=True)
    router = torch.randn(8, 32, generator=g)
    for tokens in (1, 16, 17):
        x = torch.randn(tokens, 32, generator=g)
        unfused = route(x, router, None, routing, use_kernel=True)
        for cfg in (fused, moe_route_kernel.UNFUSED, None):
            got = route(x, router, None, routing, use_kernel=True, config=cfg)
            assert torch.equal(got[1], unfused[1])
        assert torch.equal(route(x, router, None, routing, use_kernel=False, config=fused)[1], route_torch(x @ router.T, routing)[1])
    assert ran == [1, 16]  # the fused config, at 1 and 16 tokens only
    wide = torch.randn(moe_route_kernel.FUSED_MAX_EXPERTS * 2, 32, generator=g)
    route(torch.randn(2, 32, generator=g), wide, None, MoeRouting(4), use_kernel=True, config=fused)
    assert ran == [1, 16]


def test_ops_moe_takes_the_tables_router_config_for_the_token_bucket(monkeypatch: pytest.MonkeyPatch) -> None:
    """ops.moe on a GPU reads the table's "moe_router" entry for the batch's token bucket: fused
    at t1 and t4 here, unfused at t2, nothing past t16."""
    from pagecast.kernels import ops

    monkeypatch.setattr(ops, "_triton", lambda x: True)
    monkeypatch.setattr(ops, "_moe_kernel", lambda: lambda x, *args: torch.zeros_like(x))
    ran: list[int] = []
    real = moe_route_kernel.router_route
    monkeypatch.setattr(moe_route_kernel, "router_route", lambda x, *a: ran.append(x.shape[0]) or real(x, *a))
    fused = {"BLOCK_X": 16, "BLOCK_H": 64, "SPLIT_H": 2, "num_warps": 4, "num_stages": 2}
    ops.configure({"kernels": {"moe_router": {"t1": {"config": fused}, "t2": {"config": {"unfused": 1}},
                                              "t4": {"config": fused}}}})  # fmt: skip
    try:
        routing = MoeRouting(2, renormalize=True)
        w = torch.randn(8, 48)
        experts = torch.zeros(8, 2, 48), torch.zeros(8, 48, 1)
        for rows in (1, 2, 3, 4, 5, 20):
            ops.moe(torch.randn(rows, 48), w, None, *experts, routing=routing)
    finally:
        ops.configure(None)
    assert ran == [1, 3, 4]


def test_the_tuner_times_the_fused_router_against_the_unfused_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """tuning.tune on the CPU (the interpreter; times stubbed): the "moe_router" buckets are the
    decode buckets up to 16 tokens (and max_num_seqs), the unfused path is the default and timed
    first, no fused config's output is rejected (the problem's exact logits), and a faster fused
    config is kept. A dense model, and a router wider than the fused kernel takes, have no buckets."""
    from pagecast.kernels import problems, tuning

    shapes = tuning.ModelShapes(
        num_heads=4, num_kv_heads=2, head_dim=16, hidden=64, intermediate=96, block_size=16, dtype="float32",
        max_model_len=256, max_num_seqs=4, num_experts=32, top_k=4, moe_intermediate=32, moe_router_bias=True,
        moe_scoring="topk_softmax",
    )  # fmt: skip
    assert [b for b, _ in problems.buckets("moe_router", shapes)] == ["t1", "t2", "t4"]
    assert [b for b, _ in problems.buckets("moe_router", tuning.ModelShapes(4, 2, 16, 64, 96, 16))] == []
    wide = tuning.ModelShapes(4, 2, 16, 64, 96, 16, num_experts=512, top_k=8, moe_intermediate=32)
    assert problems.buckets("moe_router", wide) == []
    dims = dict(problems.buckets("moe_router", shapes))["t2"]
    assert problems.default_config("moe_router", shapes, dims) == moe_route_kernel.UNFUSED
    space = problems.config_space("moe_router", shapes, dims)
    assert space[0] == moe_route_kernel.UNFUSED and all(c["BLOCK_X"] <= 32 for c in space[1:])
    winner = space[-1]

    def timed(launch: Any, launches: int, reps: int) -> float:
        return 1.0 if launch.args[0] == winner else 5.0

    monkeypatch.setattr(tuning, "time_launches", timed)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "fake GPU")
    logged: list[str] = []
    table = tuning.tune(["moe_router"], shapes, budget_s=1e9, device="cpu", log=logged.append)
    entries = table["kernels"]["moe_router"]
    assert set(entries) == {"t1", "t2", "t4"}
    assert not [line for line in logged if "REJECTED" in line], logged
    for entry in entries.values():
        assert entry["config"] == winner.as_dict() and entry["time_us"] == 1.0
