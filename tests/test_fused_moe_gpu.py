"""The fused-MoE kernels on the GPU: bf16 against the reference at odd shapes and every config the
tuner may pick, at the Qwen3-30B-A3B and Mixtral-8x7B expert shapes against the naive per-expert
cuBLAS loop at 1, 16, 256 and 4096 tokens, captured in a CUDA graph (no host syncs), through
ops.moe with a tuning table, and through the tuner. Run with ``pytest -m gpu``."""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

from pagecast.kernels import fused_moe, moe_routing, ops, problems, reference, tuning
from pagecast.kernels.tuning import ModelShapes

DT = torch.bfloat16


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    assert not actual.isnan().any(), "NaN in the output"
    return ((actual.float() - expected.float()).norm() / expected.float().norm()).item()


def moe_inputs(t: int, e: int, k: int, h: int, i: int, bias: bool, dtype: torch.dtype = DT, seed: int = 0):  # type: ignore[no-untyped-def]
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(t, h, generator=g, device="cuda").to(dtype)
    w_gu = (torch.randn(e, 2 * i, h, generator=g, device="cuda") * h**-0.5).to(dtype)
    w_d = (torch.randn(e, h, i, generator=g, device="cuda") * i**-0.5).to(dtype)
    b_gu = torch.randn(e, 2 * i, generator=g, device="cuda").to(dtype) if bias else None
    b_d = torch.randn(e, h, generator=g, device="cuda").to(dtype) if bias else None
    weights, ids = torch.topk(torch.randn(t, e, generator=g, device="cuda").softmax(-1), k)
    return x, weights, ids, w_gu, w_d, b_gu, b_d


def fp32_reference(x, weights, ids, w_gu, w_d, b_gu, b_d, activation="silu"):  # type: ignore[no-untyped-def]
    up = [None if b is None else b.float() for b in (b_gu, b_d)]
    return reference.fused_moe(x.float(), weights, ids, w_gu.float(), w_d.float(), *up, activation)


ODD = [
    # (tokens, experts, top-k, hidden, intermediate, activation, bias, every config or a few)
    pytest.param(41, 60, 4, 256, 96, "silu", False, True, id="t41-e60-top4-all"),
    pytest.param(41, 32, 4, 192, 128, "swiglu_oai", True, True, id="t41-gptoss-all"),
    pytest.param(9, 8, 2, 320, 192, "silu", False, False, id="t9-e8-top2"),
    pytest.param(341, 3, 1, 128, 200, "silu", False, False, id="t341-e3-top1"),
    pytest.param(41, 8, 8, 192, 64, "silu", False, False, id="t41-e8-top8"),
]


@pytest.mark.parametrize("t,e,k,h,i,activation,bias,every", ODD)
def test_configs_match_the_reference_bf16(t, e, k, h, i, activation, bias, every):
    """Every config of the space (two shapes; a few at the others: each extra shape compiles each
    kernel again) against the fp32 reference, in bf16."""
    x, weights, ids, w_gu, w_d, b_gu, b_d = moe_inputs(t, e, k, h, i, bias)
    expected = fp32_reference(x, weights, ids, w_gu, w_d, b_gu, b_d, activation)
    configs = [c for c in fused_moe.CONFIG_SPACE if not fused_moe.is_naive(c)]
    if not every:
        tiles = [c for c in configs if "BLOCK_M" in c.params]
        configs = [configs[0], tiles[0], tiles[-1]]  # a GEMV, a 16-row tile, a SPLIT_ACT tile
    configs.append(fused_moe.default_config(t, k, e, h, i))
    for cfg in configs:
        if "BLOCK_M" in cfg.params and fused_moe.shared_memory(cfg, 2) > fused_moe.SHARED_MEMORY_LIMIT:
            continue
        out = fused_moe.fused_moe(x, weights, ids, w_gu, w_d, b_gu, b_d, activation, config=cfg)
        assert out.dtype == DT
        assert rel_err(out, expected) < 1e-2, cfg.as_dict()


def test_fp32_matches_the_reference():
    x, weights, ids, w_gu, w_d, _, _ = moe_inputs(41, 8, 2, 128, 96, False, torch.float32)
    for tokens in (3, 41):  # the GEMV path, then a tile
        out = fused_moe.fused_moe(x[:tokens], weights[:tokens], ids[:tokens], w_gu, w_d)
        expected = reference.fused_moe(x[:tokens], weights[:tokens], ids[:tokens], w_gu, w_d)
        torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)


SHAPES = {
    "qwen3-30b-a3b": (128, 8, 2048, 768),  # experts, top-k, hidden, moe_intermediate
    "mixtral-8x7b": (8, 2, 4096, 14336),
}


@pytest.mark.parametrize("shape", list(SHAPES))
def test_model_shapes_against_the_naive_loop(shape):
    """The default config at each of the benchmark's token counts against the per-expert loop of
    cuBLAS GEMMs (reference.fused_moe on the GPU) on the same bf16 weights."""
    e, k, h, i = SHAPES[shape]
    x, weights, ids, w_gu, w_d, _, _ = moe_inputs(4096, e, k, h, i, False)
    for t in (1, 16, 256, 4096):
        naive = reference.fused_moe(x[:t], weights[:t], ids[:t], w_gu, w_d)
        out = fused_moe.fused_moe(x[:t], weights[:t], ids[:t], w_gu, w_d)
        assert rel_err(out, naive) < 1e-2, t


@pytest.mark.parametrize(
    "t,e,k,block_m", [(1, 128, 8, 16), (41, 60, 4, 16), (4096, 128, 8, 64), (8192, 8, 2, 128)]
)
def test_align_kernels_match_the_reference(t, e, k, block_m):
    ids = torch.topk(torch.randn(t, e, device="cuda"), k).indices
    sorted_ids, block_expert = fused_moe.align_by_expert(ids, e, block_m)
    ref_ids, ref_blocks = reference.moe_align_by_expert(ids, e, block_m)
    assert torch.equal(block_expert, ref_blocks)
    runs, ref_runs = sorted_ids.view(-1, block_m), ref_ids.view(-1, block_m)
    for expert in ids.unique().tolist():
        mine = runs[block_expert == expert].flatten().sort().values
        assert torch.equal(mine, ref_runs[ref_blocks == expert].flatten().sort().values)
    assert torch.equal(runs[block_expert < 0], ref_runs[ref_blocks < 0])


TMA_TILE = {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8, "TMA": 1, "num_warps": 4, "num_stages": 4}


TICKET_GEMV = {"gemv": 1, "BLOCK_N": 8, "BLOCK_K": 128, "DOWN_PER_PAIR": 1, "TOPK_TICKET": 1, "DOWN_BLOCK_N": 32,
               "DOWN_BLOCK_K": 128, "DOWN_WARPS": 4, "num_warps": 2, "num_stages": 1}  # fmt: skip
ONE_LAUNCH_GEMV = {"gemv": 1, "ONE_LAUNCH": 1, "DOT": 1, "BLOCK_N": 16, "BLOCK_K": 128, "DOWN_BLOCK_N": 16,
                   "DOWN_PER_PAIR": 1, "TOPK_TICKET": 1, "num_warps": 4, "num_stages": 4}  # fmt: skip


@pytest.mark.parametrize(
    "tokens,config",
    [(1, None), (4, TICKET_GEMV), (4, ONE_LAUNCH_GEMV), (64, None), (64, TMA_TILE), (64, {"grouped": 1})],
    ids=["gemv", "gemv-ticket", "gemv-one-launch", "tile", "tma-tile", "grouped"],
)
def test_captured_in_a_cuda_graph(tokens, config):
    """The GEMV path (1 token; 4 with the top-k sum in the down launch, whose shared counters must
    be back at 0 after a replay for the eager launch after it) and the tile path with its align
    kernels (64) never sync with the host: a captured launch replays on new inputs (new routing) and matches an eager one (the
    atomics may order an expert's rows differently; each row's values do not depend on it). The
    TMA tile's descriptors are captured by value: they hold the addresses of the graph's buffers.
    GROUPED's grouped GEMMs read their group ends from the device."""
    if config is not None and config.get("grouped") and not fused_moe.grouped_supported(DT):
        pytest.skip("torch._grouped_mm does not run bf16 on this GPU")
    e, k, h, i = 16, 4, 256, 128
    x, weights, ids, w_gu, w_d, _, _ = moe_inputs(tokens, e, k, h, i, False)
    fused_moe.fused_moe(x, weights, ids, w_gu, w_d, config=config)  # compile
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe.fused_moe(x, weights, ids, w_gu, w_d, config=config)
    x2, weights2, ids2, *_ = moe_inputs(tokens, e, k, h, i, False, seed=1)
    x.copy_(x2)
    weights.copy_(weights2)
    ids.copy_(ids2)
    graph.replay()
    torch.cuda.synchronize()
    eager = fused_moe.fused_moe(x, weights, ids, w_gu, w_d, config=config)
    torch.testing.assert_close(out, eager, atol=0, rtol=0)


ONE_LAUNCH_SHAPES = [
    # (tokens, experts, top-k, hidden, intermediate, activation, bias)
    pytest.param(1, 128, 8, 2048, 768, "silu", False, id="qwen3-30b-t1"),
    pytest.param(3, 128, 8, 2048, 768, "silu", False, id="qwen3-30b-t3"),
    pytest.param(16, 128, 8, 2048, 768, "silu", False, id="qwen3-30b-t16"),
    pytest.param(5, 32, 4, 256, 192, "swiglu_oai", True, id="gptoss-bias-t5"),
]


@pytest.mark.parametrize("t,e,k,h,i,activation,bias", ONE_LAUNCH_SHAPES)
def test_one_launch_configs_match_the_reference_bf16(t, e, k, h, i, activation, bias):
    """Every ONE_LAUNCH config (gate_up and down in one launch, each down program waiting on its
    pair's flag) against the fp32 reference in bf16, launched three times over on new routing
    each time (the flags and tickets must be back at 0, or a launch waits on nothing or for ever)."""
    from pagecast.kernels import split_k

    configs = [c for c in fused_moe.ONE_LAUNCH_SPACE if fused_moe.one_launch_fits(c, i)]
    assert configs
    for seed in range(3):
        x, weights, ids, w_gu, w_d, b_gu, b_d = moe_inputs(t, e, k, h, i, bias, seed=seed)
        expected = fp32_reference(x, weights, ids, w_gu, w_d, b_gu, b_d, activation)
        for cfg in configs:
            out = fused_moe.fused_moe(x, weights, ids, w_gu, w_d, b_gu, b_d, activation, config=cfg)
            assert rel_err(out, expected) < 1e-2, (seed, cfg.as_dict())
    torch.cuda.synchronize()
    assert int(split_k.counters(x.device, 1, "test").abs().sum()) == 0


def test_op_uses_the_tuning_table_and_matches_transformers():
    """ops.moe on the GPU takes the table's config for the token bucket (a GEMV config at t8 here)
    and gives transformers' Qwen2-MoE block output (shared expert included) in fp32."""
    from transformers import Qwen2MoeConfig
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock

    cfg = Qwen2MoeConfig(
        hidden_size=128, moe_intermediate_size=64, shared_expert_intermediate_size=96, num_experts=16,
        num_experts_per_tok=4, norm_topk_prob=False,
    )  # fmt: skip
    block = Qwen2MoeSparseMoeBlock(cfg).float().cuda().eval()
    g = torch.Generator(device="cuda").manual_seed(0)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=g, device="cuda") * 0.2)
    routing, activation = moe_routing.moe_spec("Qwen2MoeForCausalLM", cfg.to_dict())
    mlp = block.shared_expert
    shared = moe_routing.SharedExpert(
        torch.cat((mlp.gate_proj.weight, mlp.up_proj.weight)),
        mlp.down_proj.weight,
        block.shared_expert_gate.weight,
    )
    gemv = {"gemv": 1, "BLOCK_N": 16, "BLOCK_K": 64, "num_warps": 4, "num_stages": 1}
    table = ops.configure({"kernels": {"fused_moe": {"t8": {"config": gemv}}}})
    try:
        x = torch.randn(7, 128, generator=g, device="cuda")
        with torch.no_grad():
            expected = block(x[None])[0]
            actual = ops.moe(
                x, block.gate.weight, None, block.experts.gate_up_proj, block.experts.down_proj,
                routing=routing, activation=activation, shared_expert=shared,
            )  # fmt: skip
        assert table.configs[("fused_moe", "t8")] is not None  # the table's entry was looked up
        torch.testing.assert_close(actual, expected, atol=1e-4, rtol=1e-4)
    finally:
        ops.configure()


def test_tuner_fills_every_bucket():
    """tuning.tune over a small MoE: an entry per token bucket, the naive loop timed as the
    reference everywhere and a candidate only past max_num_seqs."""
    shapes = ModelShapes(
        4, 2, 64, 256, 512, 16, "bfloat16", max_num_seqs=8, num_experts=16, top_k=4, moe_intermediate=128
    )
    table = tuning.tune(["fused_moe"], shapes, budget_s=120, reps=3)
    entries = table["kernels"]["fused_moe"]
    assert list(entries) == [b for b, _ in problems.buckets("fused_moe", shapes)]
    for bucket, entry in entries.items():
        assert entry["time_us"] > 0 and entry["reference_us"] > 0, bucket
        if int(bucket[1:]) <= shapes.max_num_seqs:
            assert not fused_moe.is_naive(tuning.KernelConfig.coerce(entry["config"])), bucket


@pytest.mark.parametrize("tokens", [1, 16, 256, 4096])
def test_workspace_bytes_bounds_what_a_call_allocates(tokens):
    """fused_moe.workspace_bytes (what the memory plan counts) is at least the peak a call
    allocates beyond its inputs and output, for the default config and each path."""
    from conftest import cuda_workspace_bytes

    e, k, h, i = 128, 8, 2048, 768
    x, weights, ids, w_gu, w_d, _, _ = moe_inputs(tokens, e, k, h, i, False)
    configs = [fused_moe.default_config(tokens, k, e, h, i), fused_moe.NAIVE]
    tiles = [c for c in fused_moe.CONFIG_SPACE if "BLOCK_M" in c.params]
    configs += [next(c for c in tiles if c["BLOCK_M"] == 16), next(c for c in tiles if c["BLOCK_M"] == 128)]
    configs += [next(c for c in tiles if c.params.get("SPLIT_ACT"))]
    configs += [next(c for c in tiles if c.params.get("TMA") and c.params.get("SPLIT_ACT"))]
    configs += [fused_moe.GROUPED] if fused_moe.grouped_supported(DT) else []
    for cfg in configs:
        fused_moe.fused_moe(x, weights, ids, w_gu, w_d, config=cfg)  # compile outside the measurement
        _, used = cuda_workspace_bytes(lambda: fused_moe.fused_moe(x, weights, ids, w_gu, w_d, config=cfg))  # noqa: B023
        assert used <= fused_moe.workspace_bytes(tokens, k, e, h, i, 2, cfg), (cfg.as_dict(), used)


@pytest.mark.parametrize("t,e,k,h,i,activation,bias,every", ODD)
def test_grouped_matches_the_reference_bf16(t, e, k, h, i, activation, bias, every):
    """fused_moe.GROUPED (torch._grouped_mm, PyTorch's CUTLASS grouped GEMM on sm_90) at the odd
    shapes, against the fp32 reference as the Triton configs are."""
    if not fused_moe.grouped_supported(DT):
        pytest.skip("torch._grouped_mm does not run bf16 on this GPU")
    x, weights, ids, w_gu, w_d, b_gu, b_d = moe_inputs(t, e, k, h, i, bias)
    expected = fp32_reference(x, weights, ids, w_gu, w_d, b_gu, b_d, activation)
    out = fused_moe.fused_moe(x, weights, ids, w_gu, w_d, b_gu, b_d, activation, config=fused_moe.GROUPED)
    assert rel_err(out, expected) < 1e-2
