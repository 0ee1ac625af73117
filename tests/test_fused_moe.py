"""Mixture of experts on the CPU: routing and the MoE op against transformers' own sparse-MoE
modules (float32, random weights), the fused-MoE Triton kernels against the per-expert reference
loop through the interpreter (fp32 and fp16; bf16 is checked on the GPU, tests/test_fused_moe_gpu.py),
the tensor-parallel shard rule, and the tuner's MoE problem definitions."""

from __future__ import annotations

import os

import pytest
import torch

from pagecast.kernels import moe_routing, ops, problems, reference
from pagecast.kernels.moe_routing import MoeActivation, MoeRouting, SharedExpert
from pagecast.kernels.tuning import KernelConfig, ModelShapes, moe_bucket

triton = pytest.importorskip("triton")
from pagecast.kernels import fused_moe

interpreter = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="CPU kernel tests run under the Triton interpreter"
)

H, I, E = 32, 24, 8  # hidden, each expert's intermediate size, experts (transformers blocks)


# ---------------------------------------------------------------------------- transformers' blocks


def _randomize(module: torch.nn.Module, seed: int) -> None:
    # Blocks built outside a PreTrainedModel keep torch.empty's contents: give every parameter values.
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)


def hf_block(family: str, seed: int = 0, **overrides):  # type: ignore[no-untyped-def]
    """(transformers' sparse-MoE block in float32 with random weights, its config)."""
    common = {"hidden_size": H, "num_experts_per_tok": 2, "hidden_act": "silu"}
    if family == "mixtral":
        from transformers import MixtralConfig
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock as Block

        cfg = MixtralConfig(**{**common, "intermediate_size": I, "num_local_experts": E, **overrides})
    elif family == "qwen2_moe":
        from transformers import Qwen2MoeConfig
        from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock as Block

        cfg = Qwen2MoeConfig(
            **{
                **common,
                "moe_intermediate_size": I,
                "shared_expert_intermediate_size": 40,
                "num_experts": E,
                **overrides,
            }
        )
    elif family == "qwen3_moe":
        from transformers import Qwen3MoeConfig
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock as Block

        cfg = Qwen3MoeConfig(**{**common, "moe_intermediate_size": I, "num_experts": E, **overrides})
    elif family == "olmoe":
        from transformers import OlmoeConfig
        from transformers.models.olmoe.modeling_olmoe import OlmoeSparseMoeBlock as Block

        cfg = OlmoeConfig(**{**common, "intermediate_size": I, "num_experts": E, **overrides})
    elif family == "glm4_moe":
        from transformers import Glm4MoeConfig
        from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeMoE as Block

        cfg = Glm4MoeConfig(
            **{
                **common, "moe_intermediate_size": I, "n_routed_experts": E, "n_shared_experts": 1, "n_group": 2,
                "topk_group": 1, "routed_scaling_factor": 2.5, **overrides,
            }
        )  # fmt: skip
    elif family == "hunyuan_moe":
        from transformers import HunYuanMoEV1Config
        from transformers.models.hunyuan_v1_moe.modeling_hunyuan_v1_moe import HunYuanMoEV1Moe as Block

        k = common.pop("num_experts_per_tok")
        cfg = HunYuanMoEV1Config(**{**common, "moe_topk": k, "intermediate_size": I, "num_experts": E, **overrides})
    elif family == "ernie4_5_moe":
        from transformers import Ernie4_5_MoeConfig
        from transformers.models.ernie4_5_moe.modeling_ernie4_5_moe import Ernie4_5_MoeSparseMoeBlock as Block

        k = common.pop("num_experts_per_tok")
        cfg = Ernie4_5_MoeConfig(
            **{**common, "moe_k": k, "moe_intermediate_size": I, "moe_num_experts": E, "moe_num_shared_experts": 1,
               **overrides}
        )  # fmt: skip
    elif family == "minimax_m2":
        from transformers import MiniMaxM2Config
        from transformers.models.minimax_m2.modeling_minimax_m2 import MiniMaxM2SparseMoeBlock as Block

        cfg = MiniMaxM2Config(**{**common, "intermediate_size": I, "num_local_experts": E, **overrides})
    elif family == "granitemoe":
        from transformers import GraniteMoeConfig
        from transformers.models.granitemoe.modeling_granitemoe import GraniteMoeMoE as Block

        cfg = GraniteMoeConfig(**{**common, "intermediate_size": I, "num_local_experts": E, **overrides})
    else:
        from transformers import GptOssConfig
        from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP as Block

        cfg = GptOssConfig(**{**common, "intermediate_size": I, "num_local_experts": E, **overrides})
    block = Block(cfg).float().eval()
    _randomize(block, seed)
    if family in ("glm4_moe", "minimax_m2"):  # a buffer, not a parameter: the choice's score bias
        holder = block.gate if family == "glm4_moe" else block
        holder.e_score_correction_bias.copy_(torch.randn(E, generator=torch.Generator().manual_seed(seed)) * 0.1)
    if family == "ernie4_5_moe":  # randomised above, but a bias on softmax probabilities wants their scale
        with torch.no_grad():
            block.gate.moe_statics.e_score_correction_bias.mul_(0.1)
    return block, cfg


ARCH = {
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "olmoe": "OlmoeForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
    "granitemoe": "GraniteMoeForCausalLM",
    "glm4_moe": "Glm4MoeForCausalLM",
    "minimax_m2": "MiniMaxM2ForCausalLM",
    "ernie4_5_moe": "Ernie4_5_MoeForCausalLM",
    "hunyuan_moe": "HunYuanMoEV1ForCausalLM",
}


def op_arguments(family: str, block, cfg) -> dict:  # type: ignore[no-untyped-def]
    """ops.moe's arguments read from a transformers block (the builder's job, done by hand)."""
    routing, activation = moe_routing.moe_spec(ARCH[family], cfg.to_dict())
    if family == "gpt_oss":
        ex = block.experts
        w_gu, w_d, b_gu, b_d = moe_routing.gpt_oss_experts(
            ex.gate_up_proj, ex.gate_up_proj_bias, ex.down_proj, ex.down_proj_bias
        )
        return {
            "router_weight": block.router.weight, "router_bias": block.router.bias, "w_gate_up": w_gu, "w_down": w_d,
            "b_gate_up": b_gu, "b_down": b_d, "routing": routing, "activation": activation,
        }  # fmt: skip
    router = block.router if family == "granitemoe" else block.gate.wg if family == "hunyuan_moe" else block.gate
    args = {
        "router_weight": router.weight, "router_bias": None, "w_gate_up": block.experts.gate_up_proj,
        "w_down": block.experts.down_proj, "routing": routing, "activation": activation,
    }  # fmt: skip
    if family == "qwen2_moe":
        mlp = block.shared_expert
        args["shared_expert"] = SharedExpert(
            torch.cat((mlp.gate_proj.weight, mlp.up_proj.weight)),
            mlp.down_proj.weight,
            block.shared_expert_gate.weight,
        )
    if family == "minimax_m2":  # the score bias goes where a router bias would
        args["router_bias"] = block.e_score_correction_bias
    if family == "hunyuan_moe":  # its shared MLP, without a gate
        mlp = block.shared_mlp
        args["shared_expert"] = SharedExpert(torch.cat((mlp.gate_proj.weight, mlp.up_proj.weight)), mlp.down_proj.weight)
    if family == "ernie4_5_moe":  # the score bias goes where a router bias would; a shared expert without a gate
        mlp = block.shared_experts
        args["router_bias"] = block.gate.moe_statics.e_score_correction_bias
        args["shared_expert"] = SharedExpert(torch.cat((mlp.gate_proj.weight, mlp.up_proj.weight)), mlp.down_proj.weight)
    if family == "glm4_moe":  # the score bias goes where a router bias would; a shared expert without a gate
        mlp = block.shared_experts
        args["router_bias"] = block.gate.e_score_correction_bias
        args["shared_expert"] = SharedExpert(torch.cat((mlp.gate_proj.weight, mlp.up_proj.weight)), mlp.down_proj.weight)
    return args


def hf_forward(family: str, block, x: torch.Tensor) -> torch.Tensor:  # type: ignore[no-untyped-def]
    out = block(x[None])
    return (out[0] if isinstance(out, tuple) else out)[0]


def hf_router(family: str, block, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[no-untyped-def]
    if family == "minimax_m2":  # the block hands its score bias to the router
        _, weights, ids = block.gate(x, block.e_score_correction_bias)
        return weights, ids
    if family == "granitemoe":  # (ids, weights, logits)
        ids, weights, _ = block.router(x)
        return weights, ids
    router = block.router if family == "gpt_oss" else block.gate
    _, weights, ids = router(x)
    return weights, ids


FAMILIES = [
    pytest.param("mixtral", {}, id="mixtral"),
    pytest.param("qwen2_moe", {"norm_topk_prob": False}, id="qwen2-moe-shared-expert"),
    pytest.param("qwen3_moe", {"norm_topk_prob": True, "num_experts_per_tok": 4}, id="qwen3-moe-norm"),
    pytest.param("qwen3_moe", {"norm_topk_prob": False}, id="qwen3-moe-no-norm"),
    pytest.param("olmoe", {"norm_topk_prob": False, "num_experts_per_tok": 8}, id="olmoe-top8"),
    pytest.param("gpt_oss", {"num_experts_per_tok": 4}, id="gpt-oss"),
    pytest.param("granitemoe", {"num_experts_per_tok": 3}, id="granite-moe"),
    pytest.param("glm4_moe", {"num_experts_per_tok": 3}, id="glm4-moe-groups"),
    pytest.param(
        "glm4_moe", {"n_group": 4, "topk_group": 2, "norm_topk_prob": False, "routed_scaling_factor": 1.0},
        id="glm4-moe-no-norm",
    ),
    pytest.param("minimax_m2", {"num_experts_per_tok": 3}, id="minimax-m2"),
    pytest.param("ernie4_5_moe", {"num_experts_per_tok": 3}, id="ernie4.5-moe"),
    pytest.param("hunyuan_moe", {"num_experts_per_tok": 3}, id="hunyuan-moe"),
]


def test_hunyuan_fp32_router_in_bf16_matches_transformers():
    """HunYuan's router keeps its weight in fp32 and routes a bf16 model's tokens in fp32 (its
    weights come back fp32): ids and weights exactly as transformers', and not as a bf16 GEMV's."""
    block, cfg = hf_block("hunyuan_moe", num_experts_per_tok=3)
    block = block.to(torch.bfloat16)
    block.gate.wg.float()  # transformers builds it in fp32
    routing, _ = moe_routing.moe_spec(ARCH["hunyuan_moe"], cfg.to_dict())
    x = torch.randn(64, H, generator=torch.Generator().manual_seed(5)).bfloat16()
    with torch.no_grad():
        weights, ids = moe_routing.route(x, block.gate.wg.weight, None, routing)
        hf_weights, hf_ids = hf_router("hunyuan_moe", block, x)
        bf16 = moe_routing.route(x, block.gate.wg.weight.bfloat16(), None, moe_routing.MoeRouting(3, renormalize=True))[0]
    assert torch.equal(ids, hf_ids)
    assert weights.dtype == hf_weights.dtype == torch.float32
    torch.testing.assert_close(weights, hf_weights, atol=0, rtol=0)
    assert not torch.equal(bf16.float(), weights)


@pytest.mark.parametrize("family", ["glm4_moe", "minimax_m2"])
def test_sigmoid_routing_in_bf16_matches_transformers(family):
    """In bf16 the two sigmoid routers part ways: GLM-4.5's GEMV runs in fp32, MiniMax-M2's in
    bf16 (then cast up); each is routed as transformers does, ids and weights exactly."""
    block, cfg = hf_block(family, num_experts_per_tok=3)
    block = block.to(torch.bfloat16)
    if family == "glm4_moe":  # transformers keeps it fp32
        block.gate.e_score_correction_bias.data = block.gate.e_score_correction_bias.float()
    routing, _ = moe_routing.moe_spec(ARCH[family], cfg.to_dict())
    x = torch.randn(64, H, generator=torch.Generator().manual_seed(4)).bfloat16()
    args = op_arguments(family, block, cfg)
    with torch.no_grad():
        weights, ids = moe_routing.route(x, args["router_weight"], args["router_bias"], routing)
        hf_weights, hf_ids = hf_router(family, block, x)
        wrong = moe_routing.MoeRouting(3, "sigmoid_group", True, fp32_logits=family != "glm4_moe")
        wrong_weights, _ = moe_routing.route(x, args["router_weight"], args["router_bias"], wrong)
    assert torch.equal(ids, hf_ids)
    torch.testing.assert_close(weights, hf_weights.float(), atol=0, rtol=0)
    assert not torch.equal(wrong_weights, weights)  # the logits' dtype matters here


@pytest.mark.parametrize("family,overrides", FAMILIES)
def test_routing_matches_transformers_router(family, overrides):
    block, cfg = hf_block(family, **overrides)
    routing, _ = moe_routing.moe_spec(ARCH[family], cfg.to_dict())
    x = torch.randn(41, H, generator=torch.Generator().manual_seed(1))
    args = op_arguments(family, block, cfg)
    with torch.no_grad():
        weights, ids = moe_routing.route(x, args["router_weight"], args["router_bias"], routing)
        hf_weights, hf_ids = hf_router(family, block, x)
    assert torch.equal(ids, hf_ids)
    assert weights.dtype == hf_weights.dtype
    torch.testing.assert_close(weights, hf_weights, atol=0, rtol=0)


@pytest.mark.parametrize("family", ["mixtral", "gpt_oss", "granitemoe"])
def test_routing_breaks_ties_as_transformers(family):
    """Experts with equal router rows score equally for every token: the same ones are kept."""
    block, cfg = hf_block(family, num_experts_per_tok=3)
    with torch.no_grad():
        router = block.router if family in ("gpt_oss", "granitemoe") else block.gate
        router.weight[5] = router.weight[2]
        router.weight[6] = router.weight[2]
        router.weight[1] = router.weight[7]
        if family == "gpt_oss":
            router.bias[5] = router.bias[2]
            router.bias[6] = router.bias[2]
            router.bias[1] = router.bias[7]
    routing, _ = moe_routing.moe_spec(ARCH[family], cfg.to_dict())
    x = torch.randn(41, H, generator=torch.Generator().manual_seed(2))
    args = op_arguments(family, block, cfg)
    with torch.no_grad():
        _, ids = moe_routing.route(x, args["router_weight"], args["router_bias"], routing)
        _, hf_ids = hf_router(family, block, x)
    tied = ((ids == 2) | (ids == 5) | (ids == 6)).sum(1) >= 2
    assert tied.any()  # some tokens really choose between tied experts
    assert torch.equal(ids, hf_ids)


@pytest.mark.parametrize("family,overrides", FAMILIES)
def test_moe_op_matches_transformers_block(family, overrides):
    block, cfg = hf_block(family, **overrides)
    x = torch.randn(9, H, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = hf_forward(family, block, x)
        actual = ops.moe(x, **op_arguments(family, block, cfg))
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "family,overrides",
    [("qwen2_moe", {"mlp_only_layers": [0], "decoder_sparse_step": 1}), ("qwen3_moe", {"decoder_sparse_step": 2}),
     ("mixtral", {})],
)  # fmt: skip
def test_moe_layers_as_transformers_builds_them(family, overrides):
    """is_moe_layer names the decoder layers whose mlp transformers makes a sparse block (a dense
    first layer in Qwen2-MoE via mlp_only_layers, every other layer with decoder_sparse_step 2)."""
    import transformers

    _, cfg = hf_block(family, **overrides)
    cfg.num_hidden_layers = 4
    module = transformers.models.__dict__[family].__dict__[f"modeling_{family}"]
    layer_class = next(v for k, v in vars(module).items() if k.endswith("DecoderLayer"))
    for layer in range(4):
        sparse = "Sparse" in type(layer_class(cfg, layer).mlp).__name__
        assert moe_routing.is_moe_layer(ARCH[family], cfg.to_dict(), layer) == sparse, layer


def test_moe_spec_refuses_other_architectures():
    with pytest.raises(ValueError, match="DeepseekV3ForCausalLM"):
        moe_routing.moe_spec("DeepseekV3ForCausalLM", {"num_experts_per_tok": 8})
    with pytest.raises(ValueError, match="top_k"):
        MoeRouting(0)
    with pytest.raises(ValueError, match="activation"):
        MoeActivation("gelu")


# ---------------------------------------------------------------------------- tensor parallelism


@pytest.mark.parametrize("family,size", [("qwen2_moe", 2), ("gpt_oss", 3), ("mixtral", 4)])
def test_tp_shards_sum_to_the_whole(family, size):
    """Each rank runs the op on its shard of every expert (and of the shared expert); the ranks'
    partial outputs (one engine's all-reduce) add up to the unsharded block's."""
    block, cfg = hf_block(family)
    x = torch.randn(9, H, generator=torch.Generator().manual_seed(4))
    args = op_arguments(family, block, cfg)
    with torch.no_grad():
        whole = ops.moe(x, **args)
        parts = []
        for rank in range(size):
            w_gu, w_d, b_gu, b_d = moe_routing.shard_experts(
                args["w_gate_up"], args["w_down"], args.get("b_gate_up"), args.get("b_down"), rank, size
            )
            assert w_gu.shape[1] == 2 * I // size and w_d.shape[2] == I // size
            shard = {**args, "w_gate_up": w_gu, "w_down": w_d, "b_gate_up": b_gu, "b_down": b_d}
            if "shared_expert" in args:
                shard["shared_expert"] = moe_routing.shard_shared_expert(args["shared_expert"], rank, size)
            parts.append(ops.moe(x, **shard))  # one rank: no all-reduce
    torch.testing.assert_close(sum(parts), whole, atol=1e-5, rtol=1e-5)


def test_tp_refuses_an_uneven_cut():
    w_gu, w_d = torch.zeros(2, 2 * 10, 4), torch.zeros(2, 4, 10)
    with pytest.raises(ValueError, match="not divisible"):
        moe_routing.shard_experts(w_gu, w_d, None, None, 0, 4)


# ---------------------------------------------------------------------------- kernels


def test_align_reference_groups_and_pads_each_experts_pairs():
    # 5 tokens, top-2, 4 experts: expert 0 gets pairs 0, 3, 9; expert 1 none; 2 gets 1, 2, 4, 5, 6, 8; 3 gets 7.
    ids = torch.tensor([[0, 2], [2, 0], [2, 2], [2, 3], [2, 0]])
    sorted_ids, block_expert = reference.moe_align_by_expert(ids, 4, 4)
    pad = 10
    assert block_expert.tolist() == [0, 2, 2, 3, -1, -1, -1]  # cdiv(10, 4) + min(4, 10) = 7 blocks
    assert sorted_ids.tolist() == [0, 3, 9, pad, 1, 2, 4, 5, 6, 8, pad, pad, 7, pad, pad, pad] + [pad] * 12


def random_ids(t: int, e: int, k: int) -> torch.Tensor:
    return torch.topk(torch.randn(t, e, generator=torch.Generator().manual_seed(t)), k).indices


def assert_runs_hold_the_same_pairs(sorted_ids, other_ids, block_expert, e: int, block_m: int) -> None:  # type: ignore[no-untyped-def]
    """Each expert's blocks (by ``block_expert``) hold the same pairs in both layouts, in any
    order (the align kernels' atomics choose it)."""
    runs, other = sorted_ids.view(-1, block_m), other_ids.view(-1, block_m)
    for expert in range(e):
        mine = runs[block_expert == expert].flatten().sort().values
        assert torch.equal(mine, other[block_expert == expert].flatten().sort().values)


@interpreter
@pytest.mark.parametrize("t,e,k,block_m", [(5, 4, 2, 4), (41, 60, 4, 16), (9, 3, 1, 32), (300, 8, 8, 16)])
def test_align_kernels_match_the_reference(t, e, k, block_m):
    """The same blocks, and in each expert's run the same pairs (the atomics choose their order)."""
    ids = random_ids(t, e, k)
    sorted_ids, block_expert = fused_moe.align_by_expert(ids, e, block_m)
    ref_ids, ref_blocks = reference.moe_align_by_expert(ids, e, block_m)
    assert torch.equal(block_expert, ref_blocks)
    assert_runs_hold_the_same_pairs(sorted_ids, ref_ids, block_expert, e, block_m)
    runs, ref_runs = sorted_ids.view(-1, block_m), ref_ids.view(-1, block_m)
    assert torch.equal(runs[block_expert < 0], ref_runs[ref_blocks < 0])  # all padding


def moe_inputs(t: int, e: int, k: int, h: int, i: int, dtype: torch.dtype, bias: bool, seed: int = 0):  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g).to(dtype)
    w_gu = (torch.randn(e, 2 * i, h, generator=g) * h**-0.5).to(dtype)
    w_d = (torch.randn(e, h, i, generator=g) * i**-0.5).to(dtype)
    b_gu = torch.randn(e, 2 * i, generator=g).to(dtype) if bias else None
    b_d = torch.randn(e, h, generator=g).to(dtype) if bias else None
    weights, ids = torch.topk(torch.randn(t, e, generator=g).softmax(-1), k)
    return x, weights, ids, w_gu, w_d, b_gu, b_d


TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (3e-3, 1e-2)}
GEMV = {"gemv": 1, "BLOCK_N": 32, "BLOCK_K": 32, "num_warps": 4, "num_stages": 1}
GEMV_PER_PAIR = {**GEMV, "DOWN_PER_PAIR": 1}
TILE = {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 32, "GROUP_M": 2}
KERNEL_CASES = [
    # (tokens, experts, top-k, hidden, intermediate, activation, bias, config)
    pytest.param(9, 8, 2, 64, 40, "silu", False, TILE, id="t9-e8-top2-tile"),
    pytest.param(9, 8, 2, 64, 40, "silu", False, GEMV, id="t9-e8-top2-gemv"),
    pytest.param(41, 3, 1, 48, 24, "silu", False, None, id="t41-e3-top1-default"),
    pytest.param(9, 60, 4, 32, 24, "silu", False, {**TILE, "BLOCK_N": 32}, id="t9-e60-top4-tile"),
    pytest.param(9, 8, 8, 32, 16, "silu", False, {**TILE, "BLOCK_M": 32}, id="t9-e8-top8-tile32"),
    pytest.param(41, 8, 2, 48, 40, "swiglu_oai", True, TILE, id="t41-gptoss-bias-tile"),
    pytest.param(3, 8, 4, 48, 40, "swiglu_oai", True, GEMV, id="t3-gptoss-bias-gemv"),
    pytest.param(9, 8, 2, 64, 40, "silu", False, GEMV_PER_PAIR, id="t9-e8-top2-gemv-per-pair"),
    pytest.param(3, 8, 4, 48, 40, "swiglu_oai", True, GEMV_PER_PAIR, id="t3-gptoss-bias-gemv-per-pair"),
    # the GEMV through tl.dot (the row padded to 16): serial down, and per pair with the top-k ticket
    pytest.param(9, 8, 2, 64, 40, "silu", False, {**GEMV, "DOT": 1, "BLOCK_N": 16, "BLOCK_K": 16}, id="t9-gemv-dot"),
    pytest.param(
        3, 8, 4, 48, 40, "swiglu_oai", True,
        {**GEMV_PER_PAIR, "DOT": 1, "BLOCK_N": 16, "BLOCK_K": 32, "TOPK_TICKET": 1, "num_stages": 3},
        id="t3-gptoss-bias-gemv-dot-ticket",
    ),  # fmt: skip
    pytest.param(9, 8, 2, 64, 40, "silu", False, {**TILE, "SPLIT_ACT": 1}, id="t9-e8-top2-split-act"),
    pytest.param(
        9, 8, 4, 48, 40, "swiglu_oai", True, {**TILE, "SPLIT_ACT": 1}, id="t9-gptoss-bias-split-act"
    ),
    # read by the tensor memory accelerator (descriptors; the interpreter emulates them)
    pytest.param(41, 8, 2, 64, 40, "silu", False, {**TILE, "TMA": 1}, id="t41-e8-top2-tma"),
    pytest.param(9, 60, 4, 32, 24, "silu", False, {**TILE, "BLOCK_N": 32, "TMA": 1}, id="t9-e60-top4-tma"),
    pytest.param(41, 8, 2, 48, 40, "swiglu_oai", True, {**TILE, "TMA": 1}, id="t41-gptoss-bias-tma"),
    pytest.param(9, 8, 2, 64, 40, "silu", False, {**TILE, "SPLIT_ACT": 1, "TMA": 1}, id="t9-split-act-tma"),
    # torch._grouped_mm's two GEMMs (torch's own CPU loop here; the GPU tests run CUTLASS's)
    pytest.param(41, 8, 2, 64, 40, "silu", False, {"grouped": 1}, id="t41-e8-top2-grouped"),
    pytest.param(9, 60, 4, 32, 24, "silu", False, {"grouped": 1}, id="t9-e60-top4-grouped"),
    pytest.param(1, 8, 2, 32, 24, "silu", False, {"grouped": 1}, id="t1-e8-top2-grouped"),
    pytest.param(41, 8, 2, 48, 40, "swiglu_oai", True, {"grouped": 1}, id="t41-gptoss-bias-grouped"),
    pytest.param(100, 8, 8, 32, 16, "silu", True, {"grouped": 1}, id="t100-e8-top8-bias-grouped"),
]


@interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("t,e,k,h,i,activation,bias,config", KERNEL_CASES)
def test_fused_moe_matches_reference(t, e, k, h, i, activation, bias, config, dtype):
    x, weights, ids, w_gu, w_d, b_gu, b_d = moe_inputs(t, e, k, h, i, dtype, bias)
    out = fused_moe.fused_moe(x, weights, ids, w_gu, w_d, b_gu, b_d, activation, config=config)
    # the reference in fp32 from the same (rounded) values
    up = [None if b is None else b.float() for b in (b_gu, b_d)]
    expected = reference.fused_moe(x.float(), weights, ids, w_gu.float(), w_d.float(), *up, activation)
    assert out.dtype == dtype and out.shape == (t, h)
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(out.float(), expected, atol=atol, rtol=rtol)


@interpreter
@pytest.mark.parametrize(
    "i,dtype,tma",
    [(40, torch.float16, True), (20, torch.float16, False), (20, torch.float32, True)],
    ids=["i40-fp16", "i20-fp16-rows-of-40-bytes", "i20-fp32"],
)
def test_tma_tiles_run_where_the_copy_engine_can_read_the_rows(monkeypatch, i, dtype, tma):
    """A TMA config launches the descriptor kernel when every row it reads is a multiple of 16
    bytes, and otherwise the pointer kernel with the same tile; both give the reference's sums."""
    launched = []
    kernel = fused_moe._moe_gemm_kernel

    class Count:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                launched.append(("tma" if kwargs["TMA"] else "pointer", type(args[0]).__name__))
                return kernel[grid](*args, **kwargs)

            return launch

    monkeypatch.setattr(fused_moe, "_moe_gemm_kernel", Count())
    x, weights, ids, w_gu, w_d, _, _ = moe_inputs(17, 8, 2, 64, i, dtype, False)
    out = fused_moe.fused_moe(x, weights, ids, w_gu, w_d, config={**TILE, "TMA": 1})
    assert launched == ([("tma", "TensorDescriptor")] * 2 if tma else [("pointer", "Tensor")] * 2)
    expected = reference.fused_moe(x.float(), weights, ids, w_gu.float(), w_d.float())
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(out.float(), expected, atol=atol, rtol=rtol)


@interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("top_k", [1, 4])
def test_gemv_down_per_pair_gives_the_serial_launchs_bits(dtype, top_k):
    """DOWN_PER_PAIR splits the decode down projection into a program per pair and a top-k sum;
    the sum adds the pairs' fp32 rows in the order the serial launch does, so the output is the
    same to the bit (a config the tuner picks must not change what a model generates)."""
    x, weights, ids, w_gu, w_d, b_gu, b_d = moe_inputs(5, 8, top_k, 64, 40, dtype, True, seed=3)
    serial = fused_moe.fused_moe(x, weights, ids, w_gu, w_d, b_gu, b_d, config=GEMV)
    per_pair = fused_moe.fused_moe(x, weights, ids, w_gu, w_d, b_gu, b_d, config=GEMV_PER_PAIR)
    assert torch.equal(per_pair, serial)


@interpreter
def test_fused_moe_matches_a_transformers_gpt_oss_block():
    """The kernel on gpt-oss's experts rewritten to the common layout (interleaved gate/up columns,
    biases, the clamped SwiGLU) gives transformers' GptOssMLP output (limit 7 is reached: the
    weights are scaled up)."""
    block, cfg = hf_block("gpt_oss", num_experts_per_tok=4)
    with torch.no_grad():
        block.experts.gate_up_proj.mul_(8.0)
    args = op_arguments("gpt_oss", block, cfg)
    x = torch.randn(9, H, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        gate_up = x @ block.experts.gate_up_proj[0]
        assert gate_up.abs().max() > cfg.to_dict().get("swiglu_limit", 7.0)
        expected = hf_forward("gpt_oss", block, x)
        weights, ids = moe_routing.route(x, args["router_weight"], args["router_bias"], args["routing"])
        out = fused_moe.fused_moe(
            x, weights, ids, args["w_gate_up"], args["w_down"], args["b_gate_up"], args["b_down"], "swiglu_oai",
            config=TILE,
        )  # fmt: skip
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-5)


def test_fused_moe_checks_shapes():
    x, weights, ids, w_gu, w_d, _, _ = moe_inputs(3, 4, 2, 16, 8, torch.float32, False)
    with pytest.raises(ValueError, match="w_down"):
        fused_moe.fused_moe(x, weights, ids, w_gu, w_d.transpose(1, 2).contiguous())
    with pytest.raises(ValueError, match="activation"):
        fused_moe.fused_moe(x, weights, ids, w_gu, w_d, activation="gelu")


def test_naive_config_runs_the_reference_loop():
    x, weights, ids, w_gu, w_d, _, _ = moe_inputs(5, 4, 2, 16, 8, torch.float32, False)
    out = fused_moe.fused_moe(x, weights, ids, w_gu, w_d, config=fused_moe.NAIVE)
    torch.testing.assert_close(out, reference.fused_moe(x, weights, ids, w_gu, w_d), atol=0, rtol=0)


# ---------------------------------------------------------------------------- tuner problems

QWEN3_30B = ModelShapes(
    32, 4, 128, 2048, 6144, 16, "bfloat16", num_experts=128, top_k=8, moe_intermediate=768
)
MIXTRAL = ModelShapes(32, 8, 128, 4096, 14336, 16, "bfloat16", num_experts=8, top_k=2, moe_intermediate=14336)


def test_moe_buckets_and_sizes():
    assert problems.buckets("fused_moe", ModelShapes(4, 2, 16, 64, 128, 16)) == []  # dense: nothing to tune
    names = [b for b, _ in problems.buckets("fused_moe", QWEN3_30B)]
    assert names[0] == "t1" and "t16" in names and "t256" in names and "t4096" in names
    assert moe_bucket(1) == "t1" and moe_bucket(3) == "t4" and moe_bucket(10**6) == names[-1]
    expert = 3 * 2048 * 768 * 2
    nbytes, flops = problems.problem_size("fused_moe", QWEN3_30B, {"num_tokens": 1})
    assert nbytes == 8 * expert + 2 * 2048 * 2  # one token: its 8 experts' weights
    assert flops == 2 * 8 * 3 * 2048 * 768
    nbytes, _ = problems.problem_size("fused_moe", QWEN3_30B, {"num_tokens": 4096})
    assert nbytes == 128 * expert + 2 * 4096 * 2048 * 2  # every expert visited
    with pytest.raises(ValueError, match="top_k"):
        ModelShapes(4, 2, 16, 64, 128, 16, num_experts=4, top_k=5, moe_intermediate=8)


def test_moe_bound_names_weights_at_decode_and_compute_at_prefill():
    decode = problems.moe_bound(QWEN3_30B, {"num_tokens": 1}, 20.0, 4262.0, 783.0)
    assert decode["bound"] == "weights" and 0 < decode["fraction"] < 1
    assert decode["bound_us"] == pytest.approx(8 * 3 * 2048 * 768 * 2 / 4262e3, abs=0.02)
    prefill = problems.moe_bound(MIXTRAL, {"num_tokens": 4096}, 10_000.0, 4262.0, 783.0)
    assert prefill["bound"] == "compute"
    assert prefill["bound_us"] == pytest.approx(2 * 4096 * 2 * 3 * 4096 * 14336 / 783e6, rel=1e-3)


def test_build_report_gives_each_moe_bucket_its_bound():
    import dataclasses

    from pagecast.builder.tune import moe_report_lines

    table = {"copy_bandwidth_gbs": 4262.0, "matmul_tflops": 783.0, "kernels": {"fused_moe": {
        "t1": {"config": {"gemv": 1, "BLOCK_N": 32}, "time_us": 20.0, "reference_us": 60.0},
        "t4096": {"config": {"naive": 1}, "time_us": 1000.0, "reference_us": 1000.0},
    }}}  # fmt: skip
    lines = moe_report_lines(table, dataclasses.asdict(QWEN3_30B))
    text = "\n".join(lines)
    assert "128 experts, top 8, each 768 wide" in text and "4,262 GB/s" in text and "783 TFLOP/s" in text
    decode = problems.moe_bound(QWEN3_30B, {"num_tokens": 1}, 20.0, 4262.0, 783.0)
    prefill = problems.moe_bound(QWEN3_30B, {"num_tokens": 4096}, 1000.0, 4262.0, 783.0)
    assert decode["bound"] == "weights" and prefill["bound"] == "compute"
    assert (
        f"| fused_moe | 1 | gemv=1, BLOCK_N=32 | 20.0 | 60.0 | 0.33 | weights ({decode['bound_us']:.2f} us) | "
        f"{decode['fraction']:.1%} |" in text
    )
    assert (
        f"| fused_moe | 4096 | per-expert loop | 1000.0 | 1000.0 | 1.00 | compute ({prefill['bound_us']:.2f} us) | "
        f"{prefill['fraction']:.1%} |" in text
    )
    # Without the measured ceilings (an artifact tuned before they were recorded) the bound is left out.
    bare = moe_report_lines({"kernels": table["kernels"]}, dataclasses.asdict(QWEN3_30B))
    assert "| fused_moe | 1 | gemv=1, BLOCK_N=32 | 20.0 | 60.0 | 0.33 | - | - |" in "\n".join(bare)
    # A dense model's table has no MoE section.
    assert moe_report_lines({"kernels": {"rms_norm": {}}}, dataclasses.asdict(QWEN3_30B)) == []


@interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("top_k,tokens", [(1, 5), (4, 5), (2, 16)])
def test_gemv_down_ticket_and_down_tiles_give_the_serial_launchs_bits(monkeypatch, dtype, top_k, tokens):
    """TOPK_TICKET adds a token's pairs up in the per-pair down launch (the last of its pairs to
    finish, in pair order), and DOWN_BLOCK_N / DOWN_BLOCK_K / DOWN_WARPS give that launch a tile of
    its own: the same bits as the serial launch where the reduction's BLOCK_K is the same (the
    column block does not change the order of a sum), the same result within rounding where it is
    not, and the shared counters back at 0. Past TICKET_MAX_TOKENS tokens a ticket config runs the
    top-k sum as a launch of its own."""
    from pagecast.kernels import split_k

    x, weights, ids, w_gu, w_d, b_gu, b_d = moe_inputs(tokens, 8, top_k, 64, 40, dtype, True, seed=5)
    serial = fused_moe.fused_moe(x, weights, ids, w_gu, w_d, b_gu, b_d, config=GEMV)
    launched = []
    kernel = fused_moe._moe_topk_sum_kernel

    class Count:
        def __getitem__(self, grid):
            launched.append(grid)
            return kernel[grid]

    monkeypatch.setattr(fused_moe, "_moe_topk_sum_kernel", Count())
    for extra in ({}, {"DOWN_BLOCK_N": 16, "DOWN_BLOCK_K": 16, "DOWN_WARPS": 2}, {"DOWN_BLOCK_N": 64}):
        cfg = {**GEMV_PER_PAIR, "TOPK_TICKET": 1, **extra}
        out = fused_moe.fused_moe(x, weights, ids, w_gu, w_d, b_gu, b_d, config=cfg)
        if "DOWN_BLOCK_K" in extra:  # another order of the down reduction's fp32 sums
            torch.testing.assert_close(out, serial, atol=TOL[dtype][0], rtol=TOL[dtype][1])
        else:
            assert torch.equal(out, serial), extra
        assert launched == []  # no top-k sum launch
        assert int(split_k.counters(x.device, 1, "test").abs().sum()) == 0
    if tokens != fused_moe.TICKET_MAX_TOKENS:  # past the limit once a dtype, from the case at it
        return
    x, weights, ids, *_ = moe_inputs(fused_moe.TICKET_MAX_TOKENS + 1, 8, top_k, 64, 40, dtype, True, seed=6)
    big = fused_moe.fused_moe(x, weights, ids, w_gu, w_d, b_gu, b_d, config={**GEMV_PER_PAIR, "TOPK_TICKET": 1})
    assert len(launched) == 1
    assert torch.equal(big, fused_moe.fused_moe(x, weights, ids, w_gu, w_d, b_gu, b_d, config=GEMV))


ONE_LAUNCH = {**GEMV_PER_PAIR, "TOPK_TICKET": 1, "ONE_LAUNCH": 1, "BLOCK_N": 16, "BLOCK_K": 32, "DOWN_BLOCK_N": 16}


@interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    "tokens,top_k,activation,bias,extra",
    [
        (1, 8, "silu", False, {}),
        (5, 2, "silu", False, {"DOT": 1, "BLOCK_K": 16, "num_stages": 3, "DOWN_BLOCK_N": 32}),
        (3, 4, "swiglu_oai", True, {}),
        (16, 1, "silu", True, {"DOWN_BLOCK_N": 8}),
    ],
)
def test_one_launch_gives_the_reference_in_a_single_launch(monkeypatch, dtype, tokens, top_k, activation, bias, extra):
    """ONE_LAUNCH runs gate_up and down (and the top-k sum) as one launch, each down program
    waiting on its pair's flag: the reference's result within rounding (its down products add
    up in another order), the ticket launches' result within the same, one launch and no other,
    and the shared counters (tickets and pair flags) back at 0 for the next launch."""
    from pagecast.kernels import split_k

    x, weights, ids, w_gu, w_d, b_gu, b_d = moe_inputs(tokens, 8, top_k, 64, 40, dtype, bias, seed=7)
    expected = reference.fused_moe(x, weights, ids, w_gu, w_d, b_gu, b_d, activation)
    ticket = fused_moe.fused_moe(
        x, weights, ids, w_gu, w_d, b_gu, b_d, activation, config={**GEMV_PER_PAIR, "TOPK_TICKET": 1}
    )
    launched = []
    for name in ("_moe_gemv_kernel", "_moe_topk_sum_kernel", "_moe_gemv_one_launch_kernel"):
        kernel = getattr(fused_moe, name)

        class Count:
            def __getitem__(self, grid, name=name, kernel=kernel):
                launched.append(name)
                return kernel[grid]

        monkeypatch.setattr(fused_moe, name, Count())
    cfg = {**ONE_LAUNCH, **extra}
    out = fused_moe.fused_moe(x, weights, ids, w_gu, w_d, b_gu, b_d, activation, config=cfg)
    assert launched == ["_moe_gemv_one_launch_kernel"]
    torch.testing.assert_close(out, expected, atol=TOL[dtype][0], rtol=TOL[dtype][1])
    torch.testing.assert_close(out, ticket, atol=TOL[dtype][0], rtol=TOL[dtype][1])
    assert int(split_k.counters(x.device, 1, "test").abs().sum()) == 0


def test_one_launch_configs_only_where_a_down_tile_fits_in_registers(monkeypatch):
    """A ONE_LAUNCH down program holds DOWN_BLOCK_N rows of all of I: Qwen3-30B-A3B's 768 fits
    every ONE_LAUNCH config at one to 16 tokens, Mixtral's 14,336 none. The build times them only
    with PAGECAST_MOE_ONE_LAUNCH=1 (not yet run on a GPU)."""

    def one_launch(tokens, hidden, intermediate, top_k, experts):
        cfgs = fused_moe.prune_configs(fused_moe.config_space(), tokens, top_k, experts, hidden, intermediate, tma=False)
        return [c for c in cfgs if c.params.get("ONE_LAUNCH")]

    monkeypatch.delenv("PAGECAST_MOE_ONE_LAUNCH", raising=False)
    assert one_launch(1, 2048, 768, 8, 128) == []
    monkeypatch.setenv("PAGECAST_MOE_ONE_LAUNCH", "1")
    assert one_launch(1, 2048, 768, 8, 128) == fused_moe.ONE_LAUNCH_SPACE
    assert one_launch(16, 2048, 768, 8, 128) == fused_moe.ONE_LAUNCH_SPACE
    assert one_launch(1, 4096, 14336, 2, 8) == []
    assert one_launch(fused_moe.TICKET_MAX_TOKENS + 1, 2048, 768, 8, 128) == []
    space = {b: problems.config_space("fused_moe", QWEN3_30B, d) for b, d in problems.buckets("fused_moe", QWEN3_30B)}
    assert any(c.params.get("ONE_LAUNCH") for c in space["t1"])


def test_ticket_configs_are_pruned_past_their_token_limit():
    def tickets(tokens):
        cfgs = fused_moe.prune_configs(fused_moe.CONFIG_SPACE, tokens, 8, 128, 2048, 768, tma=False)
        return [c for c in cfgs if c.params.get("TOPK_TICKET")]

    assert tickets(1) and any("DOWN_BLOCK_N" in c.params for c in tickets(1))
    assert tickets(fused_moe.TICKET_MAX_TOKENS) and not tickets(fused_moe.TICKET_MAX_TOKENS + 1)


def test_moe_config_space_by_bucket():
    space = {
        b: problems.config_space("fused_moe", QWEN3_30B, d)
        for b, d in problems.buckets("fused_moe", QWEN3_30B)
    }
    # the naive loop is a candidate only for batches past max_num_seqs (never in a CUDA graph)
    assert not any(fused_moe.is_naive(c) for c in space["t256"]) and any(
        fused_moe.is_naive(c) for c in space["t512"]
    )
    assert any(fused_moe.is_gemv(c) for c in space["t1"]) and not any(
        fused_moe.is_gemv(c) for c in space["t32"]
    )
    # decode buckets: 16-row tiles only; prefill: at least 64 rows an expert
    assert {c["BLOCK_M"] for c in space["t1"] if "BLOCK_M" in c.params} == {16}
    assert min(c["BLOCK_M"] for c in space["t4096"] if "BLOCK_M" in c.params) >= 64
    for configs in space.values():
        assert configs
        for c in configs:
            if "BLOCK_M" in c.params:
                assert fused_moe.shared_memory(c, 2) <= fused_moe.SHARED_MEMORY_LIMIT
    for b, d in problems.buckets("fused_moe", MIXTRAL):
        assert problems.config_space("fused_moe", MIXTRAL, d), b
        problems.default_config("fused_moe", MIXTRAL, d)


def test_grouped_is_kept_where_torch_runs_it_and_experts_get_rows():
    prune = fused_moe.prune_configs
    space = [fused_moe.GROUPED]
    # Mixtral at 4,096 tokens: 1,024 rows an expert
    assert prune(space, 4096, 2, 8, 4096, 14336, grouped=True) == space
    assert prune(space, 4096, 2, 8, 4096, 14336, grouped=False) == []
    # Qwen3-30B-A3B at 16 tokens: 128 pairs over up to 128 experts, about 1 row each
    assert prune(space, 16, 8, 128, 2048, 768, grouped=True) == []
    assert prune(space, 256, 8, 128, 2048, 768, grouped=True) == space  # 16 rows an expert
    # a tuner candidate (where prune_configs keeps it), timed against the tiles at each bucket
    assert fused_moe.GROUPED in fused_moe.CONFIG_SPACE


def test_grouped_support_follows_the_device():
    if torch.cuda.is_available():
        pytest.skip("the GPU's answer depends on the card")
    assert fused_moe.grouped_supported(torch.float32) == hasattr(torch, "_grouped_mm")


def test_default_splits_the_decode_down_launch_by_pair_where_tokens_are_few():
    """At one and two tokens of Qwen3-30B-A3B the serial down launch has fewer than four programs
    a multiprocessor (each streaming 8 experts in turn): the default runs a program per pair
    there, the serial launch from four tokens, and never for top-1 (nothing to split)."""

    def default(t: int, shapes: ModelShapes) -> KernelConfig:
        return fused_moe.default_config(
            t, shapes.top_k, shapes.num_experts, shapes.hidden, shapes.moe_intermediate
        )

    per_pair = {t: default(t, QWEN3_30B).params.get("DOWN_PER_PAIR") for t in (1, 2, 4)}
    assert per_pair == {1: 1, 2: 1, 4: None}
    assert default(1, MIXTRAL).params.get("DOWN_PER_PAIR") == 1
    top1 = fused_moe.default_config(1, 1, 16, 2048, 768)
    assert fused_moe.is_gemv(top1) and "DOWN_PER_PAIR" not in top1.params


@interpreter
@pytest.mark.parametrize(
    "experts", [{}, {"moe_activation": "swiglu_oai", "moe_alpha": 1.5, "moe_limit": 0.5, "moe_bias": True}],
    ids=["silu", "gpt-oss"],
)
def test_moe_problem_launches_agree(experts):  # type: ignore[no-untyped-def]
    """The tuner's problem at a tiny shape: the default config, a tile, a GEMV config and the naive baseline
    (the problem's own loop, and the reference it reports) give the same output. gpt-oss's experts
    (clamped SwiGLU, biases) are timed in their own variant: the kernel's constexprs, compiled into
    the artifact (a limit of 0.5 clamps most values, so a launch without it would not agree)."""
    shapes = ModelShapes(
        2, 1, 16, 32, 64, 16, "float32", max_num_seqs=4, num_experts=6, top_k=2, moe_intermediate=16, **experts
    )
    dims = {"num_tokens": 4}
    problem = problems.make_problem("fused_moe", shapes, dims, "cpu")
    assert problem.bucket == "t4" and problem.num_sets > 1 and problem.reference is not None
    naive = problem.launch(fused_moe.NAIVE, 1)
    gemv, per_pair = KernelConfig.coerce(GEMV), KernelConfig.coerce(GEMV_PER_PAIR)
    tile = KernelConfig(dict(TILE), 4, 2)
    for cfg in (problems.default_config("fused_moe", shapes, dims), tile, gemv, per_pair):
        torch.testing.assert_close(problem.launch(cfg, 1), naive, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(problem.reference(None, 1), naive, atol=0, rtol=0)


class _NotLaunched:
    """A Triton kernel whose launches do nothing, as in the tuner's precompile pass (Triton compiles
    and launches nothing; the launcher's own torch operations still run on the buffers those
    kernels would have written)."""

    def __getitem__(self, grid):  # type: ignore[no-untyped-def]
        return lambda *args, **kwargs: None


@interpreter
@pytest.mark.parametrize(
    "config",
    [{**TILE, "TMA": 1}, {"grouped": 1}],
    ids=["tma", "grouped"],
)
def test_the_launchers_torch_operations_stay_in_range_over_unwritten_routing_buffers(monkeypatch, config):
    """tuning.precompile runs a config's launch with every Triton launch turned into a compile, so
    the alignment kernels write nothing and the launcher's torch operations read whatever the
    allocator left in their buffers. Gathers indexed by those buffers must stay in range: on the
    GPU an index out of range is a device-side assert that ends the whole build (seen on an H200
    building Qwen3-30B-A3B, 2026-12-05)."""
    if config.get("grouped") and not fused_moe.grouped_supported(torch.float32):
        pytest.skip("torch._grouped_mm does not run in float32 here")
    x, weights, ids, w_gu, w_d, b_gu, b_d = moe_inputs(9, 8, 2, 64, 40, torch.float32, True)

    def garbage_alignment(topk_ids, num_experts, block_m):  # type: ignore[no-untyped-def]
        nb = fused_moe.max_blocks(topk_ids.numel(), num_experts, block_m)
        sorted_ids = torch.tensor([-7, 10**6, -(2**30), 3], dtype=torch.int32).repeat(nb * block_m // 4 + 1)
        block_expert = torch.tensor([-5, 10**6, 2], dtype=torch.int32).repeat(nb // 3 + 1)
        return sorted_ids[: nb * block_m].contiguous(), block_expert[:nb].contiguous()

    monkeypatch.setattr(fused_moe, "align_by_expert", garbage_alignment)
    for name in ("_moe_gemm_kernel", "_moe_gather_sum_kernel"):
        monkeypatch.setattr(fused_moe, name, _NotLaunched())
    out = fused_moe.fused_moe(x, weights, ids, w_gu, w_d, b_gu, b_d, config=config)
    assert out.shape == x.shape
