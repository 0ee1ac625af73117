"""The fused W4A16 MoE kernels (kernels/fused_moe_w4a16.py) on the GPU: bf16 against the reference
on the exactly dequantised experts for every config of the space at an odd shape, at the
Qwen3-30B-A3B and Mixtral-8x7B expert shapes (group 128, act-order) at 1, 3, 40, 256 and 4096
tokens, captured in a CUDA graph, through ops.moe with a tuning table, through the tuner, and an
int4 MoE artifact end to end against transformers. Run with ``pytest -m gpu``."""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

from test_fused_moe_gpu import DT, rel_err
from test_fused_moe_w4a16 import random_experts

from pagecast.kernels import fused_moe_w4a16, moe_routing, ops, problems, reference, tuning
from pagecast.kernels.quant_linear import Int4ExpertsWeight
from pagecast.kernels.tuning import ModelShapes


def to_cuda(w: Int4ExpertsWeight) -> Int4ExpertsWeight:
    perm = None if w.perm is None else w.perm.cuda()
    return Int4ExpertsWeight(w.qweight.cuda(), w.scales.cuda(), w.zeros.cuda(), perm, w.group_size)


def case(t: int, e: int, k: int, h: int, i: int, group: int, act_order: bool, seed: int = 0):  # type: ignore[no-untyped-def]
    """bf16 inputs, int4 experts on the GPU (fp16 scales, as a half artifact stores them) and their
    exact fp32 dequantisation."""
    g = torch.Generator().manual_seed(seed)
    gu, gu_dense = random_experts(e, 2 * i, h, group, act_order, torch.float16, g)
    down, down_dense = random_experts(e, h, i, group, False, torch.float16, g)
    x = torch.randn(t, h, generator=g).to(DT).cuda()
    weights, ids = torch.topk(torch.randn(t, e, generator=g).softmax(-1), k)
    return x, weights.cuda(), ids.cuda(), to_cuda(gu), to_cuda(down), gu_dense.cuda(), down_dense.cuda()


def fp32_reference(x, weights, ids, gu_dense, down_dense):  # type: ignore[no-untyped-def]
    # the weights rounded to bf16 as the kernels feed them to the multiplies, then fp32 throughout
    return reference.fused_moe(x.float(), weights, ids, gu_dense.to(DT).float(), down_dense.to(DT).float())


def test_every_config_matches_the_reference_bf16():
    t, e, k, h, i = 41, 24, 4, 256, 192
    x, weights, ids, gu, down, gu_dense, down_dense = case(t, e, k, h, i, 64, True)
    expected = fp32_reference(x, weights, ids, gu_dense, down_dense)
    configs = list(fused_moe_w4a16.CONFIG_SPACE) + [fused_moe_w4a16.default_config(t, k, e, h, i, 64)]
    for cfg in configs:
        out = fused_moe_w4a16.fused_moe_w4a16(x, weights, ids, gu, down, config=cfg)
        assert out.dtype == DT
        assert rel_err(out, expected) < 1e-2, cfg.as_dict()


SHAPES = {
    "qwen3-30b-a3b": (128, 8, 2048, 768),  # experts, top-k, hidden, moe_intermediate
    "mixtral-8x7b": (8, 2, 4096, 14336),
}


@pytest.mark.parametrize("shape", list(SHAPES))
def test_model_shapes_default_config_against_the_reference(shape):
    """The untuned default at 1, 3, 40, 256 and 4096 tokens (GEMV, then tiles) at group 128 with
    act-order, against the fp32 reference on the exact dequantisation."""
    e, k, h, i = SHAPES[shape]
    x, weights, ids, gu, down, gu_dense, down_dense = case(4096, e, k, h, i, 128, True)
    for t in (1, 3, 40, 256, 4096):
        expected = fp32_reference(x[:t], weights[:t], ids[:t], gu_dense, down_dense)
        out = fused_moe_w4a16.fused_moe_w4a16(x[:t], weights[:t], ids[:t], gu, down)
        assert rel_err(out, expected) < 1e-2, t
        if t <= 40:
            naive = fused_moe_w4a16.fused_moe_w4a16(x[:t], weights[:t], ids[:t], gu, down, config=fused_moe_w4a16.NAIVE)
            assert rel_err(naive, expected) < 1e-2, t


def test_fp32_matches_the_reference():
    g = torch.Generator().manual_seed(1)
    gu, gu_dense = random_experts(8, 192, 128, 32, True, torch.float32, g)
    down, down_dense = random_experts(8, 128, 96, 32, False, torch.float32, g)
    gu, down = to_cuda(gu), to_cuda(down)
    x = torch.randn(41, 128, generator=g).cuda()
    weights, ids = torch.topk(torch.randn(41, 8, generator=g).softmax(-1), 2)
    weights, ids = weights.cuda(), ids.cuda()
    for tokens in (3, 41):  # the GEMV path, then a tile
        out = fused_moe_w4a16.fused_moe_w4a16(x[:tokens], weights[:tokens], ids[:tokens], gu, down)
        expected = reference.fused_moe(x[:tokens], weights[:tokens], ids[:tokens], gu_dense.cuda(), down_dense.cuda())
        torch.testing.assert_close(out, expected, atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("tokens", [1, 64])
def test_captured_in_a_cuda_graph(tokens):
    """The GEMV path (1 token) and the tile path (64) never sync with the host: a captured launch
    replays on new inputs (new routing) and matches an eager one."""
    e, k, h, i = 16, 4, 256, 128
    x, weights, ids, gu, down, _, _ = case(tokens, e, k, h, i, 64, True)
    fused_moe_w4a16.fused_moe_w4a16(x, weights, ids, gu, down)  # compile
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe_w4a16.fused_moe_w4a16(x, weights, ids, gu, down)
    x2, weights2, ids2, *_ = case(tokens, e, k, h, i, 64, True, seed=1)
    x.copy_(x2)
    weights.copy_(weights2)
    ids.copy_(ids2)
    graph.replay()
    torch.cuda.synchronize()
    eager = fused_moe_w4a16.fused_moe_w4a16(x, weights, ids, gu, down)
    torch.testing.assert_close(out, eager, atol=0, rtol=0)


def test_op_uses_the_tuning_table():
    """ops.moe with int4 experts on the GPU takes the table's fused_moe_w4a16 config for the bucket
    and gives the CPU path's (dequantise + reference loop) output."""
    e, k, h, i = 16, 4, 128, 64
    x, _, _, gu, down, _, _ = case(7, e, k, h, i, 32, True)
    router = torch.randn(e, h, device="cuda", dtype=DT) * 0.1
    routing = moe_routing.MoeRouting(k, renormalize=True)
    gemv = {"gemv": 1, "BLOCK_N": 32, "BLOCK_K": 32, "num_warps": 4, "num_stages": 1}
    table = ops.configure({"kernels": {"fused_moe_w4a16": {"t8": {"config": gemv}}}})
    try:
        actual = ops.moe(x, router, None, gu, down, routing=routing)
        assert table.configs[("fused_moe_w4a16", "t8")] is not None
        ops.configure(use_triton=False)
        expected = ops.moe(x, router, None, gu, down, routing=routing)
        assert rel_err(actual, expected) < 1e-2
    finally:
        ops.configure()


def test_tuner_fills_every_bucket():
    shapes = ModelShapes(
        4, 2, 64, 256, 512, 16, "bfloat16", max_num_seqs=8, quant_group_size=128, num_experts=16, top_k=4,
        moe_intermediate=128,
    )  # fmt: skip
    table = tuning.tune(["fused_moe_w4a16"], shapes, budget_s=120, reps=3)
    entries = table["kernels"]["fused_moe_w4a16"]
    assert list(entries) == [b for b, _ in problems.buckets("fused_moe_w4a16", shapes)]
    for bucket, entry in entries.items():
        assert entry["time_us"] > 0 and entry["reference_us"] > 0, bucket
        if int(bucket[1:]) <= shapes.max_num_seqs:
            assert not fused_moe_w4a16.is_naive(tuning.KernelConfig.coerce(entry["config"])), bucket


@pytest.mark.parametrize("family,fmt", [("qwen3_moe", "gptq-actorder"), ("mixtral", "awq")])
def test_int4_moe_artifact_matches_transformers_on_gpu(family, fmt, tiny_checkpoint_factory, tmp_path):  # type: ignore[no-untyped-def]
    """A tuned fp32 GPU build (the fused W4A16 MoE kernels at the tuner's configs, CUDA graphs for
    decode) gives transformers' greedy tokens on the exact dequantisation."""
    from conftest import build_artifact
    from engine_utils import hf_greedy
    from quant_writer import Format, write
    from transformers import AutoModelForCausalLM

    from pagecast.runtime import LLM, SamplingParams

    wide = {"moe_intermediate_size": 64} if family == "qwen3_moe" else {"intermediate_size": 64}
    src = tiny_checkpoint_factory(family, **wide)
    fmt_ = Format("gptq", 32, sym=True, desc_act=True) if fmt == "gptq-actorder" else Format("awq", 32)
    ckpt, deq = write(src, tmp_path / "q", fmt_)
    art = build_artifact(ckpt, tmp_path / "art", gpu="auto", dtype="float32", tune_budget_s=60.0)
    # A small KV cache, freed at the end: the next case's tuner (a process of its own) measures
    # copy bandwidth with 2 GiB buffers, which an H100 run found held by this engine's default cache.
    llm = LLM(art, max_num_seqs=4, max_num_batched_tokens=64, kv_cache_memory="256MiB")
    prompts = [[1, 504, 3458, 22, 333, 17], [5, 6, 7], list(range(100, 140))]
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    hf = AutoModelForCausalLM.from_pretrained(str(deq), dtype=torch.float32).eval()
    for ids, out in zip(prompts, outputs, strict=True):
        assert out.token_ids == hf_greedy(hf, ids, 8)
    del llm, hf
    torch.cuda.empty_cache()


def test_int4_moe_bf16_engine_matches_its_dequantization_on_gpu(tiny_checkpoint_factory, tmp_path):  # type: ignore[no-untyped-def]
    """bf16: a tuned int4 Qwen3-MoE artifact (GPTQ act-order) against a bf16 engine built from the
    exact dequantisation of the same checkpoint, teacher-forced (a 160-token prefill through the
    tile path, then 40 one-token decode steps through the GEMV path), and the same tokens with CUDA
    graphs as eager; the table holds a fused_moe_w4a16 entry per bucket."""
    import json

    from conftest import build_artifact
    from engine_utils import assert_graphs_match_eager
    from kv_cache_support import logit_agreement, teacher_forced_logits
    from quant_writer import Format, write

    src = tiny_checkpoint_factory("qwen3_moe", moe_intermediate_size=64)
    ckpt, deq = write(src, tmp_path / "q", Format("gptq", 32, sym=True, desc_act=True))
    int4 = build_artifact(ckpt, tmp_path / "int4", gpu="auto", dtype="bfloat16", tune_budget_s=30.0)
    dense = build_artifact(deq, tmp_path / "dense", gpu="auto", dtype="bfloat16", tune_budget_s=5.0)
    table = json.loads((int4 / "tuning.json").read_text())
    assert table["kernels"]["fused_moe_w4a16"] and not table["kernels"].get("fused_moe")
    tokens = torch.randint(3, 49000, (200,), generator=torch.Generator().manual_seed(0)).tolist()
    agreement = logit_agreement(teacher_forced_logits(int4, tokens, 160), teacher_forced_logits(dense, tokens, 160))
    print(f"int4 MoE bf16 vs its dequantization: {agreement}")
    assert agreement["max_rel_diff"] <= 0.5 and agreement["top1_agreement"] >= 0.9, agreement
    assert_graphs_match_eager(int4, [tokens[:n] for n in (5, 40, 130)], 24)
