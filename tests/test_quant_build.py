"""enginebuild on AWQ / GPTQ checkpoints, end to end on the CPU in fp32.

Tiny random checkpoints are quantised round-to-nearest by tests/quant_writer.py into each format;
the artifact's greedy tokens and logits must equal transformers running the same checkpoint
dequantized exactly (every product of a 4-bit integer and an fp16 scale is exact in fp32, so
the two models hold identical weights). Committed fixtures made by the real tools are checked the
same way in test_quant_fixtures.py.
"""

from __future__ import annotations

import json

import pytest
import torch
from conftest import build_artifact
from engine_utils import assert_graphs_match_eager, engine_last_logits, hf_greedy
from kv_cache_support import logit_agreement, teacher_forced_logits
from quant_writer import Format, quantised_artifacts, write
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from pagecast.runtime import LLM, SamplingParams
from pagecast.runtime.errors import BuildError

# Group sizes up to 128 need K (hidden 128, intermediate 384) to be multiples of 128.
SHAPE = {
    "hidden_size": 128,
    "intermediate_size": 384,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
}
PROMPTS = [[1, 504, 3458, 22, 333, 17], [5, 6, 7], list(range(100, 140))]
MAX_TOKENS = 12

CASES = {
    "awq-g64-qwen2-bias": ("qwen2", Format("awq", 64)),
    "gptq-g64-sym-actorder": ("llama", Format("gptq", 64, sym=True, desc_act=True)),
    "gptq_v2-g128-asym": ("llama", Format("gptq", 128, sym=False, checkpoint_format="gptq_v2")),
    "gptq-perchannel-asym-actorder": ("llama", Format("gptq", -1, sym=False, desc_act=True)),
}


@pytest.fixture(scope="module")
def quantised(tiny_checkpoint_factory, tmp_path_factory):  # type: ignore[no-untyped-def]
    return quantised_artifacts(
        tiny_checkpoint_factory, tmp_path_factory, lambda case: (CASES[case][0], SHAPE, CASES[case][1])
    )


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_tokens_equal_transformers_on_the_exact_dequantization(case, quantised):  # type: ignore[no-untyped-def]
    _, deq, artifact = quantised(case)
    llm = LLM(artifact, max_num_seqs=4, max_num_batched_tokens=64)
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    hf = AutoModelForCausalLM.from_pretrained(str(deq), dtype=torch.float32).eval()
    for ids, out in zip(PROMPTS, outputs, strict=True):
        assert out.token_ids == hf_greedy(hf, ids, MAX_TOKENS)
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPTS[0]])).logits[0, -1]
    torch.testing.assert_close(engine_last_logits(llm.engine, PROMPTS[0]), ref, atol=1e-4, rtol=0)


def test_artifact_holds_repacked_int4_and_half_embedding(quantised):  # type: ignore[no-untyped-def]
    _, _, artifact = quantised("gptq-g64-sym-actorder")
    manifest = json.loads((artifact / "manifest.json").read_text())
    assert manifest["quant"] == "gptq"
    assert manifest["quantization"] == {
        "method": "gptq", "group_size": 64, "sym": True, "desc_act": True, "checkpoint_format": "gptq", "bits": 4,
    }  # fmt: skip
    with safe_open(str(artifact / "weights" / "rank0.safetensors"), "pt") as f:
        names = set(f.keys())
        assert f.get_tensor("layers.0.qkv_proj.qweight").shape == (128 // 8, 128 + 2 * 64)
        assert f.get_tensor("layers.0.qkv_proj.qweight").dtype == torch.int32
        assert f.get_tensor("layers.0.down_proj.zeros").shape == (384 // 64, 128)
        assert f.get_tensor("layers.0.gate_up_proj.perm").shape == (128,)
        assert f.get_tensor("embed_tokens.weight").dtype == torch.float32
    assert not any(n.endswith("proj.weight") for n in names)
    assert (
        "LINEAR = quant_linear.Int4Linear(method='gptq', group_size=64)"
        in (artifact / "model.py").read_text()
    )
    assert "GPTQ (gptq), 4-bit, group size 64, symmetric, act-order" in (artifact / "report.md").read_text()


def test_quant_option_must_match_the_checkpoint(quantised, tiny_checkpoint_factory, tmp_path):  # type: ignore[no-untyped-def]
    ckpt, _, _ = quantised("awq-g64-qwen2-bias")
    with pytest.raises(BuildError, match="AWQ-quantised, not GPTQ"):
        build_artifact(ckpt, tmp_path / "a", gpu="cpu", quant="gptq")
    with pytest.raises(BuildError, match="has no quantization_config"):
        build_artifact(tiny_checkpoint_factory("llama", **SHAPE), tmp_path / "b", gpu="cpu", quant="awq")


def test_incompatible_group_size_is_refused(tiny_checkpoint_factory, tmp_path):  # type: ignore[no-untyped-def]
    src = tiny_checkpoint_factory("llama", **SHAPE)
    ckpt, _ = write(src, tmp_path / "q", Format("awq", 32))
    config = json.loads((ckpt / "config.json").read_text())
    config["quantization_config"]["group_size"] = 256  # K = 128 cannot hold a group of 256
    (ckpt / "config.json").write_text(json.dumps(config))
    with pytest.raises(BuildError, match="group size 256"):
        build_artifact(ckpt, tmp_path / "e", gpu="cpu")


@pytest.mark.parametrize("method", ["awq", "gptq"])
def test_dummy_int4_weights_build_and_generate(method, tmp_path):  # type: ignore[no-untyped-def]
    from tiny_models import tiny_config

    config_dir = tmp_path / "config-only"
    tiny_config("llama", **SHAPE).save_pretrained(str(config_dir))
    artifact = build_artifact(config_dir, tmp_path / "engine", gpu="cpu", load_format="dummy", quant=method)
    manifest = json.loads((artifact / "manifest.json").read_text())
    assert manifest["quantization"]["group_size"] == 128 and manifest["quant"] == method
    with safe_open(str(artifact / "weights" / "rank0.safetensors"), "pt") as f:
        assert f.get_tensor("layers.1.o_proj.qweight").dtype == torch.int32
        assert f.get_tensor("layers.1.o_proj.qweight").abs().sum() > 0
    llm = LLM(artifact, max_num_seqs=2)
    out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert len(out[0].token_ids) == 4


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("case", ["awq-g64-qwen2-bias", "gptq-g64-sym-actorder"])
def test_int4_greedy_matches_transformers_on_gpu(case, quantised, tmp_path):  # type: ignore[no-untyped-def]
    """The tuned W4A16 GEMM (every bucket the tuner picked, split-K and dequantize + cuBLAS alike)
    in fp32 on the GPU gives transformers' tokens on the exact dequantization."""
    ckpt, deq, _ = quantised(case)
    artifact = build_artifact(ckpt, tmp_path / "art", gpu="auto", dtype="float32", tune_budget_s=60.0)
    llm = LLM(artifact, max_num_seqs=4, max_num_batched_tokens=64)
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    hf = AutoModelForCausalLM.from_pretrained(str(deq), dtype=torch.float32).eval()
    for ids, out in zip(PROMPTS, outputs, strict=True):
        assert out.token_ids == hf_greedy(hf, ids, MAX_TOKENS)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("case", ["awq-g64-qwen2-bias", "gptq-g64-sym-actorder"])
def test_int4_bf16_engine_matches_its_dequantization_on_gpu(case, quantised, tmp_path):  # type: ignore[no-untyped-def]
    """In bf16 the decode rows run the tensor-core W4A16 kernel (kernels/w4a16_tcgemv.py): its
    teacher-forced logits (a 160-token prefill, then 40 one-row decode steps) against a bf16
    engine built from the exact dequantization of the same checkpoint, and the same tokens with
    CUDA graphs as eager."""
    ckpt, deq, _ = quantised(case)
    int4 = build_artifact(ckpt, tmp_path / "int4", gpu="auto", dtype="bfloat16", tune_budget_s=20.0)
    dense = build_artifact(deq, tmp_path / "dense", gpu="auto", dtype="bfloat16", tune_budget_s=5.0)
    table = json.loads((int4 / "tuning.json").read_text())
    m1 = {b: e["config"] for b, e in table["kernels"]["w4a16_gemm"].items() if b.endswith(".m1")}
    assert m1 and all(c.get("tcgemv") for c in m1.values()), m1
    tokens = torch.randint(3, 49000, (200,), generator=torch.Generator().manual_seed(0)).tolist()
    agreement = logit_agreement(teacher_forced_logits(int4, tokens, 160), teacher_forced_logits(dense, tokens, 160))
    print(f"{case} bf16: int4 engine vs its dequantization: {agreement}")
    assert agreement["max_rel_diff"] <= 0.5 and agreement["top1_agreement"] >= 0.9, agreement
    assert_graphs_match_eager(int4, [tokens[:n] for n in (5, 40, 130)], 24)
    # silu_and_mul folded into the down projection (kernels/ops.py FUSE_SILU_DOWN, on: the tuner
    # timed the down buckets fused and marked them): the same activations, so the same logits to
    # within the fused kernel's rounding as with it off
    from pagecast.kernels import ops

    assert all(e.get("fused_silu") for b, e in table["kernels"]["w4a16_gemm"].items() if b.startswith("down.")), table
    fused = teacher_forced_logits(int4, tokens, 160)
    ops.FUSE_SILU_DOWN = False
    try:
        plain = teacher_forced_logits(int4, tokens, 160)
    finally:
        ops.FUSE_SILU_DOWN = True
    agreement = logit_agreement(fused, plain)
    print(f"{case} bf16: fused silu_and_mul vs not: {agreement}")
    assert agreement["max_rel_diff"] <= 0.05 and agreement["top1_agreement"] >= 0.98, agreement
