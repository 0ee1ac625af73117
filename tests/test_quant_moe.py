"""enginebuild on AWQ / GPTQ mixture-of-experts checkpoints, end to end on the CPU in fp32.

Tiny random Qwen3-MoE, Mixtral, Qwen2-MoE (shared expert, dense first layer) and OLMoE checkpoints
are quantised round-to-nearest by tests/quant_writer.py the way AutoAWQ / GPTQModel store MoE
models: every expert's gate/up/down (Mixtral's w1/w3/w2) a dense int4 module, GPTQ act-order with a
permutation of each expert's own, the router in the float type. The artifact's greedy tokens and
logits must equal transformers running the same checkpoint dequantised exactly (the writer's own
dequantisation, independent of pagecast's reader). The fused W4A16 MoE kernels themselves are
checked in tests/test_fused_moe_w4a16.py; here one case also runs through them in the interpreter.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import build_artifact
from engine_utils import engine_last_logits, hf_greedy
from quant_writer import Format, quantised_artifacts, write
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from pagecast.runtime import LLM, SamplingParams
from pagecast.runtime.errors import BuildError

PROMPTS = [[1, 504, 3458, 22, 333, 17], [5, 6, 7], list(range(100, 140))]
MAX_TOKENS = 8

# Experts 64 wide where act-order is on, so that down_proj has two groups of 32 to reorder.
WIDE = {"qwen3_moe": {"moe_intermediate_size": 64}, "mixtral": {"intermediate_size": 64}}
CASES = {
    "qwen3_moe-awq-g32": ("qwen3_moe", {}, Format("awq", 32)),
    "qwen3_moe-gptq-g32-sym-actorder": ("qwen3_moe", WIDE["qwen3_moe"], Format("gptq", 32, sym=True, desc_act=True)),
    "mixtral-awq-g32": ("mixtral", {}, Format("awq", 32)),
    "mixtral-gptq_v2-g32-asym-actorder": (
        "mixtral", WIDE["mixtral"], Format("gptq", 32, desc_act=True, checkpoint_format="gptq_v2"),
    ),
    # the shared expert (48 wide) and the dense layer take the dense int4 path; per-channel groups
    "qwen2_moe-gptq-perchannel-actorder": ("qwen2_moe", {}, Format("gptq", -1, desc_act=True)),
    "olmoe-awq-g32": ("olmoe", {}, Format("awq", 32)),
    # GLM-4.5: sigmoid routing from its float router (fp32) and score bias, the shared expert int4
    "glm4_moe-awq-g32": ("glm4_moe", {}, Format("awq", 32)),
}


@pytest.fixture(scope="module")
def quantised(tiny_checkpoint_factory, tmp_path_factory):  # type: ignore[no-untyped-def]
    return quantised_artifacts(tiny_checkpoint_factory, tmp_path_factory, CASES.__getitem__)


@pytest.mark.parametrize("case", list(CASES))
def test_moe_greedy_tokens_equal_transformers_on_the_exact_dequantization(case, quantised):  # type: ignore[no-untyped-def]
    _, deq, artifact = quantised(case)
    llm = LLM(artifact, max_num_seqs=4, max_num_batched_tokens=64)
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True), use_tqdm=False)
    hf = AutoModelForCausalLM.from_pretrained(str(deq), dtype=torch.float32).eval()
    for ids, out in zip(PROMPTS, outputs, strict=True):
        assert out.token_ids == hf_greedy(hf, ids, MAX_TOKENS)
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPTS[2]])).logits[0, -1]
    torch.testing.assert_close(engine_last_logits(llm.engine, PROMPTS[2]), ref, atol=1e-4, rtol=0)


def test_artifact_holds_stacked_int4_experts_and_a_half_router(quantised):  # type: ignore[no-untyped-def]
    _, _, artifact = quantised("qwen3_moe-gptq-g32-sym-actorder")
    with safe_open(str(artifact / "weights" / "rank0.safetensors"), "pt") as f:
        names = set(f.keys())
        # 8 experts, hidden 64, intermediate 64: gate_up [E, H/8, 2I], down [E, I/8, H]
        assert f.get_tensor("layers.1.experts.gate_up.qweight").shape == (8, 8, 128)
        assert f.get_tensor("layers.1.experts.gate_up.qweight").dtype == torch.int32
        assert f.get_tensor("layers.1.experts.gate_up.scales").shape == (8, 2, 128)
        assert f.get_tensor("layers.1.experts.gate_up.zeros").dtype == torch.int8
        perm = f.get_tensor("layers.1.experts.gate_up.perm")
        assert perm.shape == (8, 64) and not torch.equal(perm[0], perm[1])  # each expert's own act-order
        assert f.get_tensor("layers.1.experts.down.qweight").shape == (8, 8, 64)
        assert f.get_tensor("layers.1.router.weight").dtype == torch.float32
    assert "layers.1.experts.down.perm" not in names  # folded into gate_up's output order
    assert "layers.1.experts.gate_up" not in names
    # the memory plan counts the weights as stored: the experts at their int4 parts' bytes
    plan = json.loads((artifact / "memory_plan.json").read_text())
    with safe_open(str(artifact / "weights" / "rank0.safetensors"), "pt") as f:
        names = list(f.keys())
        stored = sum(f.get_tensor(n).numel() * f.get_tensor(n).element_size() for n in names)
    assert plan["weight_bytes"] == stored
    experts_fp32 = 3 * 8 * 3 * 64 * 64 * 4  # layers x experts x projections x H x I x 4 bytes
    assert plan["num_parameters"] * 4 - plan["weight_bytes"] > experts_fp32 * 3 // 4


def test_moe_through_the_fused_w4a16_kernels(tmp_path, quantised, monkeypatch):  # type: ignore[no-untyped-def]
    """The int4 MoE block's GPU path in the Triton interpreter (routing kernel, then the fused
    W4A16 MoE kernels: GEMV for decode, tiles for the prefill), against transformers' tokens."""
    from pagecast.kernels import fused_moe_w4a16, ops

    _, deq, artifact = quantised("mixtral-gptq_v2-g32-asym-actorder")
    llm = LLM(artifact, max_num_seqs=4, max_num_batched_tokens=32)
    monkeypatch.setattr(ops, "_triton", lambda x: True)
    launched = []
    original = fused_moe_w4a16.fused_moe_w4a16

    def recorded(x, *args, **kwargs):  # type: ignore[no-untyped-def]
        launched.append(x.shape[0])
        return original(x, *args, **kwargs)

    monkeypatch.setattr(fused_moe_w4a16, "fused_moe_w4a16", recorded)
    prompts = [PROMPTS[0], PROMPTS[2][:23]]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    hf = AutoModelForCausalLM.from_pretrained(str(deq), dtype=torch.float32).eval()
    assert [o.token_ids for o in outs] == [hf_greedy(hf, p, 4) for p in prompts]
    assert launched and min(launched) <= 2 and max(launched) > 16


def test_dummy_int4_moe_builds_and_generates(tmp_path):  # type: ignore[no-untyped-def]
    from tiny_models import tiny_config

    config_dir = tmp_path / "config-only"
    tiny_config("qwen2_moe", moe_intermediate_size=128, shared_expert_intermediate_size=128, hidden_size=256,
                intermediate_size=256).save_pretrained(str(config_dir))  # fmt: skip
    artifact = build_artifact(config_dir, tmp_path / "engine", gpu="cpu", load_format="dummy", quant="gptq")
    with safe_open(str(artifact / "weights" / "rank0.safetensors"), "pt") as f:
        assert f.get_tensor("layers.1.experts.gate_up.qweight").shape == (8, 32, 256)
        assert f.get_tensor("layers.1.experts.gate_up.scales").shape == (8, 2, 256)  # groups of 128
        assert f.get_tensor("layers.1.experts.down.scales").shape == (8, 1, 256)
        assert f.get_tensor("layers.1.shared_expert.gate_up_proj.qweight").shape == (32, 256)
    llm = LLM(artifact, max_num_seqs=2)
    out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out[0].token_ids) == 4
    # a benchmark artifact at --tp 2: every rank's experts drawn at its shard's shape
    tp2 = build_artifact(config_dir, tmp_path / "tp2", gpu="cpu", load_format="dummy", quant="gptq", tp=2)
    with safe_open(str(tp2 / "weights" / "rank1.safetensors"), "pt") as f:
        assert f.get_tensor("layers.1.experts.gate_up.qweight").shape == (8, 32, 128)
        assert f.get_tensor("layers.1.experts.gate_up.scales").shape == (8, 2, 128)
        assert f.get_tensor("layers.1.experts.down.qweight").shape == (8, 8, 256)
        assert f.get_tensor("layers.1.experts.down.scales").shape == (8, 1, 256)  # half of one group of 128


# -- refusals ---------------------------------------------------------------------------------


def _rewrite(ckpt: Path, dst: Path, change) -> Path:  # type: ignore[no-untyped-def]
    import shutil

    shutil.copytree(ckpt, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    change(tensors)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def test_a_quantised_router_is_refused_by_name(quantised, tmp_path):  # type: ignore[no-untyped-def]
    from quant_writer import quantise

    ckpt, _, _ = quantised("qwen3_moe-awq-g32")

    def quantise_router(tensors):  # type: ignore[no-untyped-def]
        router = tensors.pop("model.layers.1.mlp.gate.weight")  # [8, 64]
        parts, _ = quantise(router, Format("awq", 32), seed=0)
        tensors.update({f"model.layers.1.mlp.gate.{p}": v for p, v in parts.items()})

    bad = _rewrite(ckpt, tmp_path / "router", quantise_router)
    with pytest.raises(BuildError, match=r"model\.layers\.1\.mlp\.gate \(the MoE router\) is AWQ-quantised"):
        build_artifact(bad, tmp_path / "e", gpu="cpu")


def test_a_float_expert_in_a_quantised_checkpoint_is_refused(quantised, tmp_path):  # type: ignore[no-untyped-def]
    ckpt, deq, _ = quantised("qwen3_moe-awq-g32")
    dense = load_file(str(deq / "model.safetensors"))

    def unquantise_one(tensors):  # type: ignore[no-untyped-def]
        m = "model.layers.2.mlp.experts.5.down_proj"
        for part in ("qweight", "qzeros", "scales"):
            tensors.pop(f"{m}.{part}")
        tensors[f"{m}.weight"] = dense[f"{m}.weight"]

    bad = _rewrite(ckpt, tmp_path / "mixed", unquantise_one)
    with pytest.raises(BuildError, match=r"experts\.5\.down_proj is stored unquantised"):
        build_artifact(bad, tmp_path / "e", gpu="cpu")


def test_gpt_oss_int4_is_refused(tmp_path):  # type: ignore[no-untyped-def]
    from tiny_models import tiny_config

    config_dir = tmp_path / "config-only"
    tiny_config("gpt_oss").save_pretrained(str(config_dir))
    with pytest.raises(BuildError, match="GptOssForCausalLM: AWQ builds of this mixture-of-experts model are not"):
        build_artifact(config_dir, tmp_path / "e", gpu="cpu", load_format="dummy", quant="awq")


def test_awq_router_in_modules_to_not_convert_is_accepted():
    """AutoAWQ lists MoE routers ("gate") in modules_to_not_convert; that leaves no projection unquantised."""
    from quant_writer import quantization_config

    from pagecast.builder.quant import read_config

    qc = {**quantization_config(Format("awq", 32)), "modules_to_not_convert": ["gate"]}
    assert read_config(qc, None).method == "awq"
    with pytest.raises(BuildError, match="modules_to_not_convert"):
        read_config({**qc, "modules_to_not_convert": ["down_proj"]}, None)


# -- tensor parallelism -------------------------------------------------------------------------

# Every width a multiple of 2 x 32, so each rank holds whole groups of 32: the experts' and the
# shared expert's intermediate 64 (32 a rank), the dense layer's 128.
TP_SHAPE = {"moe_intermediate_size": 64, "shared_expert_intermediate_size": 64, "intermediate_size": 128}


def test_tp2_int4_moe_matches_transformers(tiny_checkpoint_factory, tmp_path):  # type: ignore[no-untyped-def]
    """TP=2 on gloo: each rank holds every expert's int4 gate/up columns and down inputs of its half
    of the intermediate dimension (whole groups), act-order folded per expert before the cut."""
    src = tiny_checkpoint_factory("qwen2_moe", **TP_SHAPE)
    ckpt, deq = write(src, tmp_path / "q", Format("gptq", 32, sym=False, desc_act=True))
    art = build_artifact(ckpt, tmp_path / "tp2", gpu="cpu", tp=2)
    with safe_open(str(art / "weights" / "rank1.safetensors"), "pt") as f:
        assert f.get_tensor("layers.1.experts.gate_up.qweight").shape == (8, 8, 64)  # [E, H/8, 2 x 32]
        assert f.get_tensor("layers.1.experts.gate_up.perm").shape == (8, 64)
        assert f.get_tensor("layers.1.experts.down.qweight").shape == (8, 4, 64)  # [E, 32/8, H]
        assert f.get_tensor("layers.1.experts.down.scales").shape == (8, 1, 64)
    llm = LLM(art, max_num_batched_tokens=32, max_num_seqs=4, kv_cache_memory="4MiB")
    try:
        outputs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True), use_tqdm=False)
    finally:
        llm.engine.runner.close()
    hf = AutoModelForCausalLM.from_pretrained(str(deq), dtype=torch.float32).eval()
    for ids, out in zip(PROMPTS, outputs, strict=True):
        assert out.token_ids == hf_greedy(hf, ids, MAX_TOKENS)


def test_tp_that_would_cut_an_expert_group_is_refused(tiny_checkpoint_factory, tmp_path):  # type: ignore[no-untyped-def]
    """Experts 64 wide in groups of 32 split 4 ways: 16 inputs of down_proj a rank would cut a group.
    (One group spanning all of an expert's inputs splits like per-channel scales, which is allowed.)"""
    src = tiny_checkpoint_factory("qwen3_moe", num_attention_heads=8, moe_intermediate_size=64)
    ckpt, _ = write(src, tmp_path / "q", Format("awq", 32))
    with pytest.raises(BuildError, match=r"--tp 4: layers\.0\.experts\.down .*16 inputs per rank is not a multiple"):
        build_artifact(ckpt, tmp_path / "e", gpu="cpu", tp=4)


def test_int4_moe_gpu_build_tunes_the_w4a16_moe_kernel(tmp_path, monkeypatch):  # type: ignore[no-untyped-def]
    """A GPU build's tune pass would time the fused W4A16 MoE kernel (not the half-type one) per
    token bucket at this model's experts and group size, so its kernels go into the artifact."""
    from tiny_models import tiny_config

    from pagecast.builder import pipeline, tune
    from pagecast.kernels import problems, tuning

    config_dir = tmp_path / "config-only"
    tiny_config("qwen3_moe", moe_intermediate_size=128, hidden_size=128, num_attention_heads=8).save_pretrained(
        str(config_dir)
    )
    shapes: list[dict] = []

    def tune_pass(state):  # type: ignore[no-untyped-def]
        shapes.append(tune.model_shapes(state))
        return tune.run(state)

    monkeypatch.setattr(pipeline, "PASSES", [(n, tune_pass if n == "tune" else r) for n, r in pipeline.PASSES])
    build_artifact(config_dir, tmp_path / "gpu", gpu="h200", load_format="dummy", quant="awq")
    model = tune.kernel_shapes(shapes[0])
    assert (model.quant_group_size, model.num_experts, model.moe_intermediate) == (128, 8, 128)
    assert "fused_moe_w4a16" in tuning.MOE_KERNELS
    assert problems.buckets("fused_moe_w4a16", model) and not problems.buckets("fused_moe", model)


def test_report_lists_the_int4_moe_tuning():
    from pagecast.builder.quant import QuantConfig, report_lines
    from pagecast.builder.tune import moe_report_lines

    cfg = QuantConfig("gptq", 128, True, False, "gptq")
    tuning = {"kernels": {"fused_moe_w4a16": {
        "t1": {"config": {"gemv": 1, "BLOCK_N": 16, "BLOCK_K": 128, "PAIRS": 1}, "time_us": 9.0, "reference_us": 30.0},
        "t4096": {"config": {"naive": 1}, "time_us": 900.0, "reference_us": 900.0},
    }}}  # fmt: skip
    assert "MoE experts: int4" in "\n".join(report_lines(tuning, cfg))
    shapes = {"num_heads": 4, "num_kv_heads": 2, "head_dim": 16, "hidden": 64, "intermediate": 128, "block_size": 16,
              "dtype": "float16", "quant_group_size": 128, "num_experts": 8, "top_k": 2, "moe_intermediate": 128}  # fmt: skip
    text = "\n".join(moe_report_lines(tuning, shapes))
    assert "| fused_moe_w4a16 | 1 | gemv=1, BLOCK_N=16, BLOCK_K=128, PAIRS=1 | 9.0 | 30.0 | 0.30 |" in text
    assert "| fused_moe_w4a16 | 4096 | per-expert loop | 900.0 | 900.0 | 1.00 |" in text
