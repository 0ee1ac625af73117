"""The fused MoE routing kernel on CUDA (run with ``pytest -m gpu``): against moe_routing's torch
path (torch's CUDA softmax and topk, what transformers runs) in bf16 and fp32 at the
Qwen3-30B-A3B, Mixtral-8x7B and gpt-oss-20b routers and 1, 16 and 256 tokens; captured in a CUDA
graph; and the variant the build compiles is the one serving launches (no compile at serve time).
tests/test_moe_route_kernel.py checks the same in the interpreter."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

from test_moe_route_kernel import exact_weights, lowest_index_topk, scores, ulps

from pagecast.kernels import moe_route_kernel
from pagecast.kernels.moe_routing import MoeRouting, route, route_torch

FAMILIES = {  # experts, routing
    "qwen3-30b-a3b": (128, MoeRouting(8, renormalize=True, weights_in_x_dtype=True)),
    "mixtral-8x7b": (8, MoeRouting(2, renormalize=True)),
    "gpt-oss-20b": (32, MoeRouting(4, scoring="topk_softmax")),
}
HIDDEN = 2048


def router(e: int, dtype: torch.dtype, bias: bool, seed: int = 0):  # type: ignore[no-untyped-def]
    g = torch.Generator(device="cuda").manual_seed(seed)
    w = (torch.randn(e, HIDDEN, generator=g, device="cuda") * HIDDEN**-0.5).to(dtype)
    b = torch.randn(e, generator=g, device="cuda").to(dtype) if bias else None
    return w, b


def check_against_torch(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, routing: MoeRouting) -> int:
    """route() on CUDA (the kernel) against the torch path on the same logits; returns the rows
    where torch's CUDA topk broke an exact tie otherwise (the only difference in ids allowed)."""
    weights, ids = route(x, w, b, routing)
    wide_w, wide_ids = route(x, w, b, routing, widen=True)  # as ops.moe asks on a GPU
    assert (
        wide_w.dtype == torch.float32 and torch.equal(wide_w, weights.float()) and torch.equal(wide_ids, ids)
    )
    logits = torch.nn.functional.linear(x, w, b)
    ref_w, ref_ids = route_torch(logits, routing)
    assert weights.dtype == ref_w.dtype and ids.dtype == torch.int64
    s = scores(logits, routing.scoring)
    assert torch.equal(ids, lowest_index_topk(s, routing.top_k))  # descending, ties to the lowest index
    differ = (ids != ref_ids).any(dim=-1)
    # Where torch took other experts, they hold exactly the same scores slot by slot: an exact tie.
    assert torch.equal(s.gather(1, ids)[differ], s.gather(1, ref_ids)[differ])
    exact64 = exact_weights(logits, ids, routing)
    exact = exact64.to(weights.dtype)
    normal = exact64.abs() >= torch.finfo(torch.float32).tiny
    if weights.dtype == torch.float32:
        # The same exp as torch's (CUDA's expf, within 2 ulps) and IEEE divisions; the sums of E
        # terms add in another order. Bounds with room (not measured here: no GPU where this was
        # written): within 6 ulps of torch's (8 renormalised) and 8 of fp64 (10).
        steps = 8 if routing.renormalize else 6
        assert ulps(weights[normal], ref_w[normal]).max().item() <= steps
        assert ulps(weights[normal], exact[normal]).max().item() <= steps + 2
    else:
        assert ulps(weights[normal], ref_w[normal]).max().item() <= 1
        assert ulps(weights[normal], exact[normal]).max().item() <= 1
    return int(differ.sum())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("tokens", [1, 16, 256])
def test_kernel_against_torch_on_cuda(family: str, dtype: torch.dtype, tokens: int) -> None:
    e, routing = FAMILIES[family]
    w, b = router(e, dtype, bias=routing.scoring == "topk_softmax")
    g = torch.Generator(device="cuda").manual_seed(tokens)
    x = torch.randn(tokens, HIDDEN, generator=g, device="cuda").to(dtype)
    check_against_torch(x, w, b, routing)
    # Exact ties: all-equal logits (x = 0, no bias), and a router whose experts 0, 1, e/2 and e-1
    # share one weight row (equal logits wherever cuBLAS computes equal rows equally).
    tied = w.clone()
    tied[[1, e // 2, e - 1]] = w[0]
    zeros = torch.zeros(2, HIDDEN, device="cuda", dtype=dtype)
    check_against_torch(torch.cat([zeros, x]), tied, None, routing)


def test_route_on_cuda_runs_the_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """route() on CUDA tensors takes the kernel (ops.moe asks for it wherever it runs Triton)."""
    e, routing = FAMILIES["qwen3-30b-a3b"]
    w, _ = router(e, torch.bfloat16, bias=False)
    x = torch.randn(4, HIDDEN, device="cuda").bfloat16()
    calls = []
    original = moe_route_kernel.route_logits

    def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(moe_route_kernel, "route_logits", counted)
    route(x, w, None, routing)
    route(x, w, None, routing, use_kernel=False)
    assert len(calls) == 1


@pytest.mark.parametrize("family", list(FAMILIES))
def test_captured_in_a_cuda_graph(family: str) -> None:
    """No host sync: route() as ops.moe calls it (weights widened to fp32) captures in a CUDA graph
    and its replays route new inputs as eager."""
    e, routing = FAMILIES[family]
    w, b = router(e, torch.bfloat16, bias=routing.scoring == "topk_softmax")
    x = torch.randn(16, HIDDEN, device="cuda").bfloat16()
    route(x, w, b, routing, widen=True)  # compiled (and the cuBLAS handle made) before capture
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        route(x, w, b, routing, widen=True)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        weights, ids = route(x, w, b, routing, widen=True)
    for seed in range(3):
        x.copy_(
            torch.randn(16, HIDDEN, generator=torch.Generator(device="cuda").manual_seed(seed), device="cuda")
        )
        graph.replay()
        eager_w, eager_ids = route(x, w, b, routing, widen=True)
        assert torch.equal(ids, eager_ids) and torch.equal(weights, eager_w)


FUSED = [c for c in moe_route_kernel.FUSED_CONFIG_SPACE if moe_route_kernel.is_fused(c)]


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("tokens", [1, 3, 16])
def test_fused_router_in_bf16_against_the_unfused_path(family: str, tokens: int) -> None:
    """The fused router (GEMV + routing in one launch) in bf16 on CUDA, every pruned config: with
    integer-valued inputs (exact logits in any summation order) the same weights and ids as
    cuBLAS's F.linear then the routing kernel, bit for bit; with real values the same ids wherever
    the top-k boundary is more than a few bf16 rounding steps of the logits from a tie."""
    e, routing = FAMILIES[family]
    has_bias = routing.scoring == "topk_softmax"
    g = torch.Generator(device="cuda").manual_seed(tokens)

    def ints(*shape: int) -> torch.Tensor:
        return torch.randint(-2, 3, shape, generator=g, device="cuda").bfloat16()

    w, b = ints(e, HIDDEN), (ints(e) if has_bias else None)
    x = ints(tokens, HIDDEN)
    configs = moe_route_kernel.prune_configs(FUSED, e, HIDDEN)
    assert configs
    want = route(x, w, b, routing, widen=True)
    for cfg in configs:
        got = route(x, w, b, routing, widen=True, config=cfg)
        assert torch.equal(got[1], want[1]) and torch.equal(got[0], want[0]), cfg
    w, b = router(e, torch.bfloat16, bias=has_bias, seed=tokens)
    # Real-valued rows whose top-k boundary is clear of bf16 rounding: a logit's bf16 step is 2^-8
    # of it, so 5% of the k-th score is several steps either way. With 128 experts few random rows
    # have such a gap, so the batch is drawn from rows that do (and every row is routed in one batch).
    pool = torch.randn(512, HIDDEN, generator=g, device="cuda").bfloat16()
    s = scores(torch.nn.functional.linear(pool, w, b).float(), routing.scoring).sort(dim=-1, descending=True).values
    clear = (s[:, routing.top_k - 1] - s[:, routing.top_k]) > 0.05 * s[:, routing.top_k - 1].abs()
    assert int(clear.sum()) >= tokens, int(clear.sum())
    x = pool[clear][:tokens].contiguous()
    want = route(x, w, b, routing, widen=True)
    for cfg in configs:
        got = route(x, w, b, routing, widen=True, config=cfg)
        assert torch.equal(got[1], want[1]), cfg


@pytest.mark.parametrize("tokens", [1, 3, 16])
def test_norm_inside_the_fused_router_in_bf16(tokens: int) -> None:
    """add_norm_router_route in bf16 on CUDA, every pruned fused config of a 128-expert top-8 router
    (Qwen3-MoE; two of them at 16 tokens): residual' bit for bit the norm kernel's, the normalised rows within one bf16 step
    of it (another summation order), the same ids as the norm kernel then the fused router on rows
    whose top-k boundary is clear of bf16 rounding; and three CUDA-graph replays equal eager."""
    from pagecast.kernels import rms_norm

    family = next(f for f, (e, r) in FAMILIES.items() if e == 128)
    e, routing = FAMILIES[family]
    w, _ = router(e, torch.bfloat16, bias=False, seed=tokens)
    g = torch.Generator(device="cuda").manual_seed(100 + tokens)
    norm_w = (1 + 0.1 * torch.randn(HIDDEN, generator=g, device="cuda")).bfloat16()
    pool_h = torch.randn(512, HIDDEN, generator=g, device="cuda").bfloat16()
    pool_r = torch.randn(512, HIDDEN, generator=g, device="cuda").bfloat16()
    px, _ = rms_norm.fused_add_rms_norm(pool_h, pool_r, norm_w, 1e-6)
    s = scores(torch.nn.functional.linear(px, w).float(), routing.scoring).sort(dim=-1, descending=True).values
    clear = (s[:, routing.top_k - 1] - s[:, routing.top_k]) > 0.05 * s[:, routing.top_k - 1].abs()
    assert int(clear.sum()) >= tokens, int(clear.sum())
    h, r = pool_h[clear][:tokens].contiguous(), pool_r[clear][:tokens].contiguous()
    want_x, want_r = rms_norm.fused_add_rms_norm(h, r, norm_w, 1e-6)
    configs = [c for c in moe_route_kernel.prune_configs(FUSED, e, HIDDEN) if moe_route_kernel.is_fused(c)]
    if tokens == 16:  # the 16-row variants compile slowly (all configs ran past 120 s in LLVM on an H100)
        configs = [configs[0], next(c for c in configs if c.num_warps == 1)]
    args = (routing.top_k, routing.scoring, routing.renormalize, torch.bfloat16, True)
    for cfg in configs:
        x, res, _, ids = moe_route_kernel.add_norm_router_route(h, r, norm_w, 1e-6, w, None, *args, cfg)
        assert torch.equal(res, want_r), cfg
        assert ((x.float() - want_x.float()).abs() <= want_x.float().abs() * 2**-7 + 1e-6).all(), cfg
        _, want_ids = moe_route_kernel.router_route(want_x, w, None, *args, cfg)
        assert torch.equal(ids, want_ids), cfg
    cfg = next(c for c in configs if c["SPLIT_H"] > 1)
    moe_route_kernel.add_norm_router_route(h, r, norm_w, 1e-6, w, None, *args, cfg)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = moe_route_kernel.add_norm_router_route(h, r, norm_w, 1e-6, w, None, *args, cfg)
    for seed in range(3):
        h.copy_(torch.randn(h.shape, generator=torch.Generator(device="cuda").manual_seed(seed), device="cuda"))
        graph.replay()
        eager = moe_route_kernel.add_norm_router_route(h, r, norm_w, 1e-6, w, None, *args, cfg)
        assert all(torch.equal(a, b) for a, b in zip(outs, eager, strict=True))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_fused_router_captured_in_a_cuda_graph(family: str) -> None:
    """The fused router replays in a CUDA graph (its workspace from the graph's pool, the shared
    split counters back at 0 after every launch): three replays route as eager launches do."""
    e, routing = FAMILIES[family]
    w, b = router(e, torch.bfloat16, bias=routing.scoring == "topk_softmax")
    cfg = next(c for c in moe_route_kernel.prune_configs(FUSED, e, HIDDEN) if c["SPLIT_H"] > 1)
    x = torch.randn(4, HIDDEN, device="cuda").bfloat16()
    route(x, w, b, routing, widen=True, config=cfg)  # compiled, and the counters made, before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        weights, ids = route(x, w, b, routing, widen=True, config=cfg)
    for seed in range(3):
        x.copy_(torch.randn(4, HIDDEN, generator=torch.Generator(device="cuda").manual_seed(seed), device="cuda"))
        graph.replay()
        eager_w, eager_ids = route(x, w, b, routing, widen=True, config=cfg)
        assert torch.equal(ids, eager_ids) and torch.equal(weights, eager_w)


# A fresh process with the given Triton cache: argv[1] "build" runs builder/tune.py's routing pass
# for one family, "serve" routes batches of every size (eager and in a CUDA graph) and prints how
# many kernels Triton compiled.
ROUTE_PROCESS = """
import json, sys
import torch
from pagecast.runtime.kernel_cache import TritonCompiles
from pagecast.builder import tune
from pagecast.kernels.moe_routing import MoeRouting, route

mode, e, k, fields = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), json.loads(sys.argv[4])
compiles = TritonCompiles()
if mode == "build":
    tune.compile_route_kernel("cuda", e, k, fields, torch.bfloat16)
else:
    w = torch.randn(e, 256, device="cuda").bfloat16()
    for rows in (1, 2, 5, 8, 16, 17, 64, 255, 256, 1000):
        route(torch.randn(rows, 256, device="cuda").bfloat16(), w, None, MoeRouting(k, **fields), widen=True)
    torch.cuda.synchronize()
print(json.dumps(compiles.names))
"""


@pytest.mark.parametrize("family", list(FAMILIES))
def test_serving_compiles_no_routing_kernel_the_build_compiled(tmp_path: Path, family: str) -> None:
    e, routing = FAMILIES[family]
    fields = {"scoring": routing.scoring, "renormalize": routing.renormalize,
              "weights_in_x_dtype": routing.weights_in_x_dtype}  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton_cache")

    def run(mode: str) -> list[str]:
        args = [sys.executable, "-c", ROUTE_PROCESS, mode, str(e), str(routing.top_k), json.dumps(fields)]
        proc = subprocess.run(args, env=env, capture_output=True, text=True, timeout=600, check=False)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return json.loads(proc.stdout.strip().splitlines()[-1])

    assert "_route_kernel" in run("build")
    assert run("serve") == []


# A fresh process (its Triton has compiled nothing) that starts the engine of the artifact argv[1]
# (its Triton cache the artifact's), serves prompts of several lengths, alone and batched, and
# prints the kernels Triton compiled meanwhile.
SERVE_MOE = """
import json, sys
from pagecast.runtime import LLM, SamplingParams
from pagecast.runtime.kernel_cache import TritonCompiles

compiles = TritonCompiles()
llm = LLM(sys.argv[1], max_num_batched_tokens=256, max_num_seqs=8, kv_cache_memory="256MiB")
prompts = [[1 + (i * 37 + j * 11) % 500 for j in range(n)] for i, n in enumerate([5, 17, 64, 3, 200, 9])]
params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
llm.generate(prompts, params, use_tqdm=False)
for prompt in prompts[:2]:
    llm.generate([prompt], params, use_tqdm=False)
print(json.dumps(compiles.names))
"""


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_a_built_moe_engine_compiles_no_routing_kernel(tmp_path: Path, family: str) -> None:
    """End to end: a bf16 MoE artifact built on this GPU serves without compiling the routing
    kernel (the build's tune pass compiled the variant ops.moe launches). Other kernels compiled
    while serving are named in the message but are not this test's subject."""
    from conftest import build_artifact
    from tiny_models import make_checkpoint

    ckpt = make_checkpoint(tmp_path / "ckpt", family, tokenizer=False, vocab_size=512)
    art = build_artifact(ckpt, tmp_path / "art", gpu="auto", dtype="bfloat16", tune_budget_s=10.0)
    assert list((art / "triton_cache").glob("*/_route_kernel.json")), "the build compiled no routing kernel"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-c", SERVE_MOE, str(art)],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    compiled = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "_route_kernel" not in compiled, compiled
