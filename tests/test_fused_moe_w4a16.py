"""The fused W4A16 MoE kernels (kernels/fused_moe_w4a16.py) in the Triton interpreter (fp32 and fp16)
against the per-expert reference loop on weights dequantised here, independently of the kernels'
and the builder's code: the tile path, the GEMV path and the naive loop at 1, 3 and 40 tokens,
group sizes that do and do not hold a K step, act-order perms on gate_up; the tuner's problem
and config space. GPU checks (bf16, CUDA graphs) are in tests/test_fused_moe_w4a16_gpu.py."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from pagecast.kernels import reference
from pagecast.kernels.quant_linear import Int4ExpertsWeight
from pagecast.kernels.tuning import KernelConfig, ModelShapes

triton = pytest.importorskip("triton")
from pagecast.kernels import fused_moe_w4a16

interpreter = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="CPU kernel tests run under the Triton interpreter"
)


def random_experts(
    e: int, n: int, k: int, group: int, act_order: bool, scale_dtype: torch.dtype, g: torch.Generator
) -> tuple[Int4ExpertsWeight, torch.Tensor]:
    """Random int4 experts in the stacked layout and their exact dequantization [E, N, K] (fp32,
    original input order), computed from the nibbles as the layout describes them."""
    q = torch.randint(0, 16, (e, k, n), generator=g)  # [E, K, N]: input k of the (permuted) order
    zeros = torch.randint(0, 16, (e, k // group, n), generator=g)
    scales = (torch.rand((e, k // group, n), generator=g) * 0.04 + 0.01).to(scale_dtype)
    words = torch.zeros((e, k // 8, n), dtype=torch.int64)
    for i in range(8):
        words |= q[:, i::8, :].to(torch.int64) << (4 * i)
    qweight = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    rows = torch.arange(k) // group
    w_perm = (q - zeros[:, rows, :]).float() * scales.float()[:, rows, :]  # [E, K, N] in the kernel's order
    perm = None
    dense = w_perm.transpose(1, 2).clone()
    if act_order:
        perm = torch.stack([torch.randperm(k, generator=g) for _ in range(e)]).to(torch.int32)
        for i in range(e):
            dense[i][:, perm[i].long()] = w_perm[i].t()
    return Int4ExpertsWeight(qweight, scales, zeros.to(torch.int8), perm, group), dense


def moe_case(t: int, e: int, k: int, h: int, i: int, group: int, act_order: bool, dtype: torch.dtype, seed: int = 0):  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g).to(dtype)
    scale_dtype = torch.float32 if dtype == torch.float32 else torch.float16
    gu, gu_dense = random_experts(e, 2 * i, h, group if group > 0 else h, act_order, scale_dtype, g)
    down, down_dense = random_experts(e, h, i, group if group > 0 else i, False, scale_dtype, g)
    weights, ids = torch.topk(torch.randn(t, e, generator=g).softmax(-1), k)
    return x, weights, ids, gu, down, gu_dense, down_dense


TOL = {torch.float32: (1e-4, 1e-4), torch.float16: (5e-3, 1e-2)}
GEMV = {"gemv": 1, "BLOCK_N": 32, "BLOCK_K": 32, "num_warps": 4, "num_stages": 1}
TILE = {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32, "GROUP_M": 2}
CASES = [
    # (tokens, experts, top-k, hidden, intermediate, group (-1 per channel), act-order, config)
    pytest.param(1, 8, 2, 64, 32, 32, False, GEMV, id="t1-gemv"),
    pytest.param(3, 8, 2, 64, 32, 32, True, GEMV, id="t3-gemv-actorder"),
    pytest.param(3, 8, 4, 64, 32, 32, True, {**GEMV, "PAIRS": 1}, id="t3-gemv-pairs"),
    pytest.param(1, 8, 1, 64, 32, 32, False, {**GEMV, "PAIRS": 1}, id="t1-top1-gemv-pairs"),
    pytest.param(3, 8, 2, 64, 32, 32, False, TILE, id="t3-tile"),
    pytest.param(40, 8, 2, 64, 32, 32, False, TILE, id="t40-tile"),
    pytest.param(40, 6, 3, 64, 32, 32, True, TILE, id="t40-tile-actorder"),
    pytest.param(40, 8, 2, 64, 64, 16, False, TILE, id="t40-tile-group16-gathered-scales"),
    pytest.param(40, 8, 2, 64, 32, -1, False, {**TILE, "BLOCK_K": 16}, id="t40-tile-per-channel"),
    pytest.param(40, 4, 1, 64, 32, 32, False, None, id="t40-top1-default"),
    pytest.param(3, 8, 2, 64, 32, 32, True, None, id="t3-default"),
]


@interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("t,e,k,h,i,group,act_order,config", CASES)
def test_fused_moe_w4a16_matches_reference(t, e, k, h, i, group, act_order, config, dtype):  # type: ignore[no-untyped-def]
    x, weights, ids, gu, down, gu_dense, down_dense = moe_case(t, e, k, h, i, group, act_order, dtype)
    out = fused_moe_w4a16.fused_moe_w4a16(x, weights, ids, gu, down, config=config)
    # the reference in fp32 on the weights rounded to x's dtype, as the kernels feed them
    expected = reference.fused_moe(
        x.float(), weights, ids, gu_dense.to(dtype).float(), down_dense.to(dtype).float()
    )
    assert out.dtype == dtype and out.shape == (t, h)
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(out.float(), expected, atol=atol, rtol=rtol)


def test_experts_weight_dequantises_exactly():
    """Int4ExpertsWeight.dense (the CPU path) undoes the act-order perm and is the exact weight."""
    g = torch.Generator().manual_seed(3)
    w, dense = random_experts(4, 48, 64, 32, True, torch.float16, g)
    torch.testing.assert_close(w.dense(torch.float32), dense, atol=0, rtol=0)
    assert w.shape == (4, 48, 64)


@interpreter
@pytest.mark.parametrize("t", [1, 3, 40])
def test_naive_loop_matches_reference(t):  # type: ignore[no-untyped-def]
    x, weights, ids, gu, down, gu_dense, down_dense = moe_case(t, 8, 2, 64, 32, 32, True, torch.float32)
    out = fused_moe_w4a16.fused_moe_w4a16(x, weights, ids, gu, down, config=fused_moe_w4a16.NAIVE)
    expected = reference.fused_moe(x, weights, ids, gu_dense, down_dense)
    torch.testing.assert_close(out, expected, atol=1e-3 * expected.abs().max().item(), rtol=1e-3)


def test_checks_shapes():
    x, weights, ids, gu, down, _, _ = moe_case(3, 8, 2, 64, 32, 32, False, torch.float32)
    with pytest.raises(ValueError, match="w_down must be"):
        fused_moe_w4a16.fused_moe_w4a16(x, weights, ids, gu, gu)
    with pytest.raises(ValueError, match="SiLU"):
        fused_moe_w4a16.fused_moe_w4a16(x, weights, ids, gu, down, activation="swiglu_oai")


def test_config_space_keeps_k_steps_within_a_group():
    space = fused_moe_w4a16.CONFIG_SPACE
    decode = fused_moe_w4a16.prune_configs(space, 1, 8, 128, 2048, 768, 128, allow_naive=False)
    assert decode and all(fused_moe_w4a16.is_gemv(c) or c["BLOCK_M"] == 16 for c in decode)
    assert not any(fused_moe_w4a16.is_naive(c) for c in decode)
    prefill = fused_moe_w4a16.prune_configs(space, 4096, 8, 128, 2048, 768, 32)
    assert fused_moe_w4a16.is_naive(prefill[0])
    assert all(c["BLOCK_K"] <= 32 and c["BLOCK_M"] >= 64 for c in prefill[1:]) and len(prefill) > 1
    for t in (1, 4, 64, 4096):
        cfg = fused_moe_w4a16.default_config(t, 8, 128, 2048, 768, 32)
        assert cfg in [KernelConfig.coerce(c.as_dict()) for c in space] or cfg["BLOCK_K"] <= 32


# ---------------------------------------------------------------------------- the tuner's problem

QWEN3_30B_INT4 = ModelShapes(
    32, 4, 128, 2048, 6144, 16, "bfloat16", quant_group_size=128, num_experts=128, top_k=8, moe_intermediate=768
)


def test_int4_moe_buckets_and_sizes():
    from pagecast.kernels import problems

    names = [b for b, _ in problems.buckets("fused_moe_w4a16", QWEN3_30B_INT4)]
    assert names[0] == "t1" and "t4096" in names
    assert problems.buckets("fused_moe", QWEN3_30B_INT4) == []  # the half-type kernel never runs there
    half = dataclasses.replace(QWEN3_30B_INT4, quant_group_size=0)
    assert problems.buckets("fused_moe_w4a16", half) == [] and problems.buckets("fused_moe", half)
    nbytes, flops = problems.problem_size("fused_moe_w4a16", QWEN3_30B_INT4, {"num_tokens": 1})
    # one token: its 8 experts' nibbles, fp16 scales and int8 zeros (gate_up 16 groups x 1536, down 6 x 2048)
    groups = 16 * 1536 + 6 * 2048
    assert nbytes == 8 * (3 * 2048 * 768 // 2 + groups * 3) + 2 * 2048 * 2
    assert flops == 2 * 8 * 3 * 2048 * 768
    bf16, _ = problems.problem_size("fused_moe", half, {"num_tokens": 1})
    assert 3.5 < bf16 / nbytes < 4  # what int4 saves a decode step


def test_int4_moe_config_space_by_bucket():
    from pagecast.kernels import problems

    space = {b: problems.config_space("fused_moe_w4a16", QWEN3_30B_INT4, d) for b, d in problems.buckets("fused_moe_w4a16", QWEN3_30B_INT4)}
    assert not any(fused_moe_w4a16.is_naive(c) for c in space["t256"])
    assert any(fused_moe_w4a16.is_naive(c) for c in space["t512"])
    assert any(fused_moe_w4a16.is_gemv(c) for c in space["t1"])
    for b, d in problems.buckets("fused_moe_w4a16", QWEN3_30B_INT4):
        assert space[b], b
        problems.default_config("fused_moe_w4a16", QWEN3_30B_INT4, d)


@interpreter
@pytest.mark.parametrize("group", [16, -1])
def test_int4_moe_problem_launches_agree(group):  # type: ignore[no-untyped-def]
    """The tuner's problem at a tiny shape: the default config, a tile, a GEMV config and the naive
    baseline (the dense W4A16 GEMM per expert, also the reported reference) agree."""
    from pagecast.kernels import problems

    shapes = ModelShapes(
        2, 1, 16, 32, 64, 16, "float32", max_num_seqs=4, quant_group_size=group, num_experts=6, top_k=2,
        moe_intermediate=16,
    )  # fmt: skip
    dims = {"num_tokens": 4}
    problem = problems.make_problem("fused_moe_w4a16", shapes, dims, "cpu")
    assert problem.bucket == "t4" and problem.reference is not None
    naive = problem.launch(fused_moe_w4a16.NAIVE, 1)
    tile = KernelConfig({"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "GROUP_M": 2}, 4, 2)
    gemv = KernelConfig({"gemv": 1, "BLOCK_N": 16, "BLOCK_K": 16}, 4, 1)
    scale = naive.abs().max().item()
    for cfg in (problems.default_config("fused_moe_w4a16", shapes, dims), tile, gemv):
        torch.testing.assert_close(problem.launch(cfg, 1), naive, atol=1e-4 * scale, rtol=1e-4)
    torch.testing.assert_close(problem.reference(None, 1), naive, atol=0, rtol=0)


def test_default_configs_keep_k_steps_within_a_group():
    """What runs untuned: for decode a GEMV config the tuner would time (PAIRS for one token), for
    more tokens a tile; BLOCK_K within a quantisation group either way."""
    space = fused_moe_w4a16.CONFIG_SPACE
    for group in (32, 128):
        for t in (1, 4):
            cfg = fused_moe_w4a16.default_config(t, 8, 128, 2048, 768, group)
            assert fused_moe_w4a16.is_gemv(cfg) and cfg["BLOCK_K"] <= group
            assert cfg in fused_moe_w4a16.prune_configs(space, t, 8, 128, 2048, 768, group), (group, t, cfg)
        assert fused_moe_w4a16.default_config(1, 8, 128, 2048, 768, group)["PAIRS"] == 1
        for t in (16, 64, 4096):
            cfg = fused_moe_w4a16.default_config(t, 8, 128, 2048, 768, group)
            assert "BLOCK_M" in cfg.params and cfg["BLOCK_K"] <= group, (group, t, cfg)
