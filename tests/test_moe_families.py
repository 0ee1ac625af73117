"""Mixture-of-experts families end to end on the CPU (float32): tiny random checkpoints of
Qwen3-MoE (norm_topk_prob true and false), Mixtral, Qwen2-MoE (a dense first layer, then MoE
layers with a gated shared expert), OLMoE (whole-projection q/k norms, clip_qkv) and gpt-oss
(attention sinks, sliding windows on alternate layers, router and expert biases, the clamped
SwiGLU, YaRN) give
transformers' greedy tokens and last-position logits through LLM, and greedy text through
engine-serve; Qwen2-MoE and gpt-oss also as TP=2 builds on gloo. Each family's test also shows that its own MoE part
moves transformers' output on these checkpoints, so a lowering that dropped it would fail.
Unsupported MoE architectures and models that do not fit the GPU are refused at build.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from engine_utils import engine_last_logits, hf_greedy

from pagecast.builder.ir import BuildOptions
from pagecast.builder.pipeline import build
from pagecast.runtime import LLM, SamplingParams
from pagecast.runtime.errors import BuildError

PROMPTS = [
    "Hello, my name is",
    "def fib(n):\n    return",
    " ".join(str(i) for i in range(40)),  # 109 tokens: past gpt-oss's 8-token windows and YaRN's original 32
]
MAX_TOKENS = 8

# (family, checkpoint overrides, the config change (or weight change) that removes the case's own
# part: transformers' logits must move under it)
CASES = {
    "qwen3_moe-norm": ("qwen3_moe", {}, [{"norm_topk_prob": False}]),
    "qwen3_moe-no-norm": ("qwen3_moe", {"norm_topk_prob": False}, [{"norm_topk_prob": True}]),
    "mixtral": ("mixtral", {}, [{"num_experts_per_tok": 1}]),
    "qwen2_moe-shared-dense0": ("qwen2_moe", {}, ["no_shared_expert"]),
    "olmoe-clip": ("olmoe", {}, [{"clip_qkv": None}]),
    "gpt_oss": ("gpt_oss", {}, ["no_sinks", {"sliding_window": 4096}]),
    "granitemoe": ("granitemoe", {}, [{"num_experts_per_tok": 1}, {"residual_multiplier": 1.0}]),
    "glm4_moe": ("glm4_moe", {}, ["no_score_bias", {"n_group": 1, "topk_group": 1}, {"routed_scaling_factor": 1.0}]),
    # DeepSeek-V3's routing with other families' attention (the windows and dense first layers too)
    "dots1": ("dots1", {}, ["no_score_bias", {"sliding_window": 4096}]),
    "exaone_moe": ("exaone_moe", {}, ["no_score_bias", {"sliding_window": 4096}]),
    "solar_open": ("solar_open", {}, ["no_score_bias", {"n_group": 1, "topk_group": 1}]),
    # HunYuan's MoE: an fp32 router, a shared MLP, q/k norms on the rotated heads, the NTK-alpha base
    "hunyuan_moe": ("hunyuan_moe", {}, [{"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}]),
    # ERNIE 4.5's softmax routing with a score bias for the choice, its first layer dense
    "ernie4_5_moe": ("ernie4_5_moe", {}, ["no_score_bias", {"moe_layer_start_index": 2}]),
    "minimax_m2": ("minimax_m2", {}, ["no_score_bias", {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}]),
    # Llama 4: chunked attention, weightless q/k norms after RoPE on adjacent pairs, the attention
    # temperature of its no-RoPE layer, top-1 sigmoid routing on the experts' input, dense layers between
    "llama4": ("llama4", {}, [{"attention_chunk_size": 4096}, {"attn_temperature_tuning": False}, {"use_qk_norm": False},
                              {"no_rope_layers": [1, 1, 1, 1]}]),
}


def hf_model(checkpoint: Path, neutralised: dict | str | None = None):  # type: ignore[no-untyped-def,type-arg]
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(checkpoint))
    for key, value in (neutralised if isinstance(neutralised, dict) else {}).items():
        setattr(config, key, value)
    model = AutoModelForCausalLM.from_pretrained(str(checkpoint), config=config, dtype=torch.float32).eval()
    with torch.no_grad():
        if neutralised == "no_shared_expert":  # Qwen2-MoE without its shared expert's contribution
            for layer in model.model.layers[1:]:
                layer.mlp.shared_expert.down_proj.weight.zero_()
        if neutralised == "no_score_bias":  # GLM-4.5 or MiniMax-M2 choosing its experts by the scores alone
            for layer in model.model.layers:
                gate = getattr(layer.mlp, "gate", None)  # MiniMax-M2's block, GLM's router, ERNIE's statics
                for module in (layer.mlp, gate, getattr(gate, "moe_statics", None)):
                    if module is not None and hasattr(module, "e_score_correction_bias"):
                        module.e_score_correction_bias.zero_()
        if neutralised == "no_sinks":  # gpt-oss with sinks that take no probability
            for layer in model.model.layers:
                layer.self_attn.sinks.fill_(-1e9)
    return model


@pytest.fixture(scope="module")
def moe_llm(tiny_artifact_factory):  # type: ignore[no-untyped-def]
    made: dict[str, LLM] = {}

    def get(case: str) -> LLM:
        if case not in made:
            family, overrides, _ = CASES[case]
            made[case] = LLM(tiny_artifact_factory(family, **overrides), max_num_batched_tokens=64, max_num_seqs=8)
        return made[case]

    yield get
    made.clear()


@pytest.mark.parametrize("case", list(CASES))
def test_moe_family_matches_transformers(case, moe_llm, tiny_checkpoint_factory):  # type: ignore[no-untyped-def]
    family, overrides, neutralised = CASES[case]
    ckpt = tiny_checkpoint_factory(family, **overrides)
    llm = moe_llm(case)
    tok = llm.tokenizer
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True), use_tqdm=False)
    hf = hf_model(ckpt)
    for prompt, out in zip(PROMPTS, outputs, strict=True):
        ids = tok.encode(prompt, add_special_tokens=False)
        assert out.token_ids == hf_greedy(hf, ids, MAX_TOKENS), prompt

    long_ids = tok.encode(PROMPTS[-1], add_special_tokens=False)
    with torch.no_grad():
        ref = hf(torch.tensor([long_ids])).logits[0, -1]
        for change in neutralised:
            moved = hf_model(ckpt, change)(torch.tensor([long_ids])).logits[0, -1]
            assert (moved - ref).abs().max() > 1e-2, f"{case}: {change} does not change transformers' output"
    torch.testing.assert_close(engine_last_logits(llm.engine, long_ids), ref, atol=1e-4, rtol=0)


def test_moe_ir_and_plan(tiny_artifact_factory):  # type: ignore[no-untyped-def]
    """Qwen2-MoE's layer 0 is dense (mlp_only_layers), the others MoE with the gated shared expert;
    the plan counts every expert and the MoE workspace per token bucket."""
    art = tiny_artifact_factory("qwen2_moe")
    model_py = (art / "model.py").read_text()
    assert "MOE_LAYERS = [False, True, True]" in model_py
    assert "MoeRouting(top_k=2, scoring='softmax_topk', renormalize=False, weights_in_x_dtype=True)" in model_py
    from safetensors import safe_open

    with safe_open(str(art / "weights" / "rank0.safetensors"), "pt") as f:
        names = set(f.keys())
        assert tuple(f.get_slice("layers.1.experts.gate_up").get_shape()) == (8, 64, 64)  # [E, 2I, H]
        assert tuple(f.get_slice("layers.1.experts.down").get_shape()) == (8, 64, 32)  # [E, H, I]
        assert tuple(f.get_slice("layers.1.shared_expert_gate.weight").get_shape()) == (1, 64)
    assert "layers.0.gate_up_proj.weight" in names and "layers.0.router.weight" not in names
    plan = json.loads((art / "memory_plan.json").read_text())
    # embeddings (tied) + per layer attention and norms + one dense MLP + two MoE blocks
    attn = 64 * 64 * 2 + 2 * 32 * 64 + 64 + 2 * 32  # q, o, k, v and their biases
    moe = 8 * 64 + 8 * 3 * 32 * 64 + 3 * 48 * 64 + 64
    expected = 49152 * 64 + 64 + 3 * (attn + 2 * 64) + 3 * 96 * 64 + 2 * moe
    assert plan["num_parameters"] == expected
    workspace = plan["moe_workspace_bytes"]
    assert workspace["t1"] > 0 and workspace["t2048"] > workspace["t16"] > workspace["t1"]


# engine-serve runs the rendered model LLM runs (test_moe_family_matches_transformers checks every
# family there): gpt-oss's sinks, windows and biased experts. The others passed it when they were
# added (Qwen3-MoE and GLM-4.5 until the forty-first session).
@pytest.mark.parametrize("family", ["gpt_oss"])
def test_family_through_engine_serve(family, tmp_path, tiny_artifact_factory, tiny_checkpoint_factory):  # type: ignore[no-untyped-def]
    from server_support import assert_served_greedy_matches

    assert_served_greedy_matches(
        tiny_artifact_factory(family),
        [PROMPTS[2], PROMPTS[0]],
        MAX_TOKENS,
        lambda: hf_model(tiny_checkpoint_factory(family)),
        tmp_path / "serve.log",
    )


@pytest.mark.parametrize("family", ["qwen2_moe", "gpt_oss", "granitemoe", "glm4_moe"])
def test_moe_tp2_matches_transformers(family, tiny_checkpoint_factory, tmp_path):  # type: ignore[no-untyped-def]
    """TP=2 on gloo: every rank holds every expert and half of each expert's (and the shared
    expert's and the dense layer's) intermediate columns; gpt-oss's down bias on rank 0 only,
    its sinks cut with the heads; Granite-MoE's stacked [E, 2I, H] cut in its gate and its up
    halves alike; GLM-4.5's score bias on every rank, in fp32. (Whole-projection q/k norms at TP=2:
    test_families.py's OLMo 2 case, the path MiniMax-M2 takes.)"""
    from conftest import build_artifact
    from safetensors import safe_open

    ckpt = tiny_checkpoint_factory(family)
    art = build_artifact(ckpt, tmp_path / "tp2", tp=2)
    with safe_open(str(art / "weights" / "rank1.safetensors"), "pt") as f:
        inter = 16  # half of each tiny expert's 32 intermediate columns
        assert tuple(f.get_slice("layers.1.experts.gate_up").get_shape()) == (8, 2 * inter, 64)
        assert tuple(f.get_slice("layers.1.experts.down").get_shape()) == (8, 64, inter)
        if family == "granitemoe":  # rank 1's gate rows are the second quarter of the checkpoint's [2I, H]
            with safe_open(str(ckpt / "model.safetensors"), "pt") as c:
                stacked = c.get_tensor("model.layers.1.block_sparse_moe.input_linear.weight")
            torch.testing.assert_close(f.get_tensor("layers.1.experts.gate_up")[:, :inter], stacked[:, inter : 2 * inter])
            torch.testing.assert_close(f.get_tensor("layers.1.experts.gate_up")[:, inter:], stacked[:, 3 * inter :])
        elif family == "glm4_moe":
            assert tuple(f.get_slice("layers.1.shared_expert.down_proj.weight").get_shape()) == (64, 16)
            with safe_open(str(ckpt / "model.safetensors"), "pt") as c:
                bias = c.get_tensor("model.layers.1.mlp.gate.e_score_correction_bias")
            assert torch.equal(f.get_tensor("layers.1.router.score_bias"), bias) and bias.dtype == torch.float32
        elif family == "qwen2_moe":
            assert tuple(f.get_slice("layers.1.shared_expert.down_proj.weight").get_shape()) == (64, 24)
        else:
            assert tuple(f.get_slice("layers.1.sinks").get_shape()) == (2,)
            assert not f.get_tensor("layers.1.experts.down_bias").any()  # rank 0 adds it
    assert_tp_greedy_matches(art, ckpt)


def assert_tp_greedy_matches(art: Path, ckpt: Path) -> None:
    """A tensor-parallel artifact's greedy tokens for PROMPTS through LLM (gloo workers) are
    transformers' on its checkpoint."""
    llm = LLM(art, max_num_batched_tokens=32, max_num_seqs=4, kv_cache_memory="4MiB")
    try:
        outputs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    finally:
        llm.engine.runner.close()
    hf = hf_model(ckpt)
    for prompt, out in zip(PROMPTS, outputs, strict=True):
        ids = llm.tokenizer.encode(prompt, add_special_tokens=False)
        assert out.token_ids == hf_greedy(hf, ids, 8), prompt


def test_gpt_oss_mxfp4_checkpoint_is_dequantised_at_build(tiny_checkpoint_factory, tmp_path):  # type: ignore[no-untyped-def]
    """gpt-oss as published: its experts in MXFP4 (_blocks and _scales), read dequantised to bf16 at
    build. The reference is transformers' own dequantisation of the same blocks put into the float
    model (with the checkpoint's other tensors, bf16): greedy tokens and last logits equal, and the
    MXFP4 rounding moves the float model's."""
    from conftest import build_artifact
    from quant_writer import write_mxfp4
    from safetensors import safe_open
    from safetensors.torch import load_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    src = tiny_checkpoint_factory("gpt_oss")
    ckpt = write_mxfp4(src, tmp_path / "mxfp4")
    art = build_artifact(ckpt, tmp_path / "engine", gpu="cpu", dtype="float32")
    with safe_open(str(art / "weights" / "rank0.safetensors"), "pt") as f:
        assert f.get_tensor("layers.0.experts.gate_up").dtype == torch.float32  # built float, not MXFP4
    hf = hf_model(src)
    ids = list(range(100, 140))
    with torch.no_grad():
        float_logits = hf(torch.tensor([ids])).logits[0, -1]
    written = load_file(str(ckpt / "model.safetensors"))
    with torch.no_grad():
        state = hf.state_dict()
        for name, t in written.items():  # the rest as written: bf16, as the releases hold it
            if name in state:
                state[name].copy_(t.float())
        for i, layer in enumerate(hf.model.layers):
            for name in ("gate_up_proj", "down_proj"):
                stem = f"model.layers.{i}.mlp.experts.{name}"
                deq = convert_moe_packed_tensors(written[f"{stem}_blocks"], written[f"{stem}_scales"])
                getattr(layer.mlp.experts, name).copy_(deq.float())
    llm = LLM(art, max_num_batched_tokens=64, max_num_seqs=4)
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True), use_tqdm=False)
    for prompt, out in zip(PROMPTS, outputs, strict=True):
        assert out.token_ids == hf_greedy(hf, llm.tokenizer.encode(prompt, add_special_tokens=False), MAX_TOKENS)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0, -1]
    assert (ref - float_logits).abs().max() > 1e-2  # the MXFP4 rounding matters
    torch.testing.assert_close(engine_last_logits(llm.engine, ids), ref, atol=1e-4, rtol=0)


# -- refusals ---------------------------------------------------------------------------------


def _config_only(tmp_path: Path, config) -> Path:  # type: ignore[no-untyped-def]
    path = tmp_path / "config-only"
    path.mkdir()
    config.save_pretrained(str(path))
    return path


def test_deepseek_mla_is_refused_naming_what_is_missing(tmp_path):  # type: ignore[no-untyped-def]
    from transformers import DeepseekV3Config

    ckpt = _config_only(tmp_path, DeepseekV3Config(architectures=["DeepseekV3ForCausalLM"], num_hidden_layers=2))
    with pytest.raises(BuildError, match="DeepseekV3ForCausalLM.*multi-head latent attention.*Qwen3MoeForCausalLM"):
        build(BuildOptions(model=str(ckpt), output=tmp_path / "art", force=True, quiet=True, load_format="dummy"))


def test_moe_that_does_not_fit_the_gpu_is_refused_with_the_numbers(tmp_path):  # type: ignore[no-untyped-def]
    from tiny_models import tiny_config

    # 4 layers of 256 experts of 3 x 6144 x 4096: 36 GiB of experts per layer in bf16, 144 GiB in
    # all, more than one H200 holds; at tp 2 each rank holds 72 GiB.
    config = tiny_config(
        "qwen3_moe", hidden_size=4096, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
        num_hidden_layers=4, num_experts=256, moe_intermediate_size=6144, num_experts_per_tok=8,
        dtype="bfloat16",
    )  # fmt: skip
    ckpt = _config_only(tmp_path, config)
    options = {"model": str(ckpt), "force": True, "quiet": True, "load_format": "dummy", "gpu": "h200", "tune_budget_s": 0.0}
    with pytest.raises(BuildError, match=r"does not fit this GPU: weights 1[0-9][0-9]\.\d\d GiB .*MoE workspace.*133\.\d\d GiB"):
        build(BuildOptions(output=tmp_path / "art", **options))  # type: ignore[arg-type]
    art = build(BuildOptions(output=tmp_path / "art2", tp=2, **options))  # type: ignore[arg-type]
    plan = json.loads((art / "memory_plan.json").read_text())
    assert plan["per_rank"] and plan["budgets"][-1]["num_blocks"] > 0


@pytest.mark.parametrize(
    "family,overrides",
    [
        ("qwen2_moe", {"mlp_only_layers": [], "decoder_sparse_step": 2, "num_hidden_layers": 4}),
        ("qwen3_moe", {"mlp_only_layers": [2], "norm_topk_prob": False}),
        ("mixtral", {}),
    ],
)
def test_lowering_finds_the_moe_layers_and_their_routing(family, overrides):  # type: ignore[no-untyped-def]
    """Which layers are MoE blocks comes from the trace (transformers' own decision), and agrees
    with moe_routing.is_moe_layer; the routing recorded is the family's."""
    from tiny_models import tiny_config

    from pagecast.builder.lower import lower
    from pagecast.builder.trace import trace_model
    from pagecast.kernels.moe_routing import is_moe_layer

    config = tiny_config(family, **overrides)
    arch = config.architectures[0]
    model = lower(trace_model(config), config, family, arch)
    kinds = [layer.mlp.kind == "moe" for layer in model.layers]
    assert kinds == [is_moe_layer(arch, config.to_dict(), i) for i in range(config.num_hidden_layers)]
    assert not all(kinds) if family != "mixtral" else all(kinds)
    moe = model.moe
    assert moe is not None and moe.renormalize == (family == "mixtral" or bool(config.to_dict().get("norm_topk_prob")))
    assert moe.weights_in_x_dtype == (family != "mixtral")


def test_gpt_oss_gpu_builds(tmp_path, monkeypatch):  # type: ignore[no-untyped-def]
    """The Triton attention kernels take the sinks (tests/test_kernels_sinks.py), so a GPU build
    goes through: its model passes each layer's sinks to ops.paged_attention, and the tune pass
    would time the attention kernels with sinks and the fused MoE in gpt-oss's variant (clamped
    SwiGLU, expert biases), so that they are compiled into the artifact."""
    from tiny_models import tiny_config

    from pagecast.builder import pipeline, tune

    ckpt = _config_only(tmp_path, tiny_config("gpt_oss"))
    options = {"model": str(ckpt), "force": True, "quiet": True, "load_format": "dummy"}
    shapes: list[dict] = []

    def tune_pass(state):  # type: ignore[no-untyped-def]
        shapes.append(tune.model_shapes(state))  # what the tuner gets on the target GPU
        return tune.run(state)

    monkeypatch.setattr(pipeline, "PASSES", [(n, tune_pass if n == "tune" else r) for n, r in pipeline.PASSES])
    art = build(BuildOptions(output=tmp_path / "gpu", gpu="h200", **options))  # type: ignore[arg-type]
    assert "sinks=sinks," in (art / "model.py").read_text()
    assert len(shapes) == 1
    assert shapes[0]["attn_sinks"] is True
    assert (shapes[0]["moe_activation"], shapes[0]["moe_bias"]) == ("swiglu_oai", True)
    # the routing kernel is compiled in gpt-oss's variant (top-k then softmax over the k)
    routing = {"scoring": "topk_softmax", "renormalize": False, "weights_in_x_dtype": False}
    assert shapes[0]["moe_routing"] == routing
    assert tune.kernel_shapes(shapes[0]).attn_sinks  # as _tune_main reads them


def test_gpt_oss_through_the_triton_kernels(tmp_path, monkeypatch):  # type: ignore[no-untyped-def]
    """The rendered gpt-oss model's kernel path in the Triton interpreter: the paged attention
    kernels with sinks (decode, chunked prefill over a cached prefix, 8-token windows on alternate
    layers) and the fused MoE with the clamped SwiGLU and expert biases; what runs on a GPU, checked
    here on the CPU against transformers' greedy tokens."""
    from tiny_models import make_checkpoint

    from pagecast.kernels import ops

    ckpt = make_checkpoint(tmp_path / "ckpt", "gpt_oss", tokenizer=False, vocab_size=512)
    art = build(BuildOptions(model=str(ckpt), output=tmp_path / "art", force=True, quiet=True))
    llm = LLM(art, max_num_batched_tokens=32, max_num_seqs=4)
    monkeypatch.setattr(ops, "_triton", lambda x: True)
    kernels, launched = ops._kernels(), []

    def recorded(name):  # type: ignore[no-untyped-def]
        def launch(*args, **kwargs):  # type: ignore[no-untyped-def]
            launched.append((name, kwargs.get("sinks") is not None, kwargs.get("window", 0)))
            return getattr(kernels, name)(*args, **kwargs)

        return launch

    namespace = type(kernels)(**{**vars(kernels), "decode": recorded("decode"), "prefill": recorded("prefill")})
    monkeypatch.setattr(ops, "_kernels", lambda: namespace)
    prompts = [[1 + (i * 37 + j * 11) % 500 for j in range(n)] for i, n in enumerate([5, 40])]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    hf = hf_model(ckpt)
    assert [o.token_ids for o in outs] == [hf_greedy(hf, p, 4) for p in prompts]
    # every attention ran in a kernel with its layer's sinks; sliding and full layers both ran
    assert {(name, sinks) for name, sinks, _ in launched} == {("decode", True), ("prefill", True)}
    assert {window > 0 for _, _, window in launched} == {True, False}


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_moe_through_the_routing_and_fused_kernels(tmp_path, monkeypatch, family):  # type: ignore[no-untyped-def]
    """The MoE block's GPU path in the Triton interpreter: routing in the fused kernel
    (kernels/moe_route_kernel.py, its weights widened to fp32 as ops.moe asks), then the fused
    MoE kernels; transformers' greedy tokens on the CPU."""
    from tiny_models import make_checkpoint

    from pagecast.kernels import moe_route_kernel, ops

    ckpt = make_checkpoint(tmp_path / "ckpt", family, tokenizer=False, vocab_size=512)
    art = build(BuildOptions(model=str(ckpt), output=tmp_path / "art", force=True, quiet=True))
    llm = LLM(art, max_num_batched_tokens=32, max_num_seqs=4)
    monkeypatch.setattr(ops, "_triton", lambda x: True)
    routed = []
    original = moe_route_kernel.route_logits

    def recorded(*args, **kwargs):  # type: ignore[no-untyped-def]
        weights, ids = original(*args, **kwargs)
        routed.append(weights.dtype)
        return weights, ids

    monkeypatch.setattr(moe_route_kernel, "route_logits", recorded)
    prompts = [[1 + (i * 37 + j * 11) % 500 for j in range(n)] for i, n in enumerate([5, 23])]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    hf = hf_model(ckpt)
    assert [o.token_ids for o in outs] == [hf_greedy(hf, p, 4) for p in prompts]
    assert routed and set(routed) == {torch.float32}


def test_gpu_build_report_shows_each_moe_bucket_against_its_bound(tmp_path, monkeypatch):  # type: ignore[no-untyped-def]
    """report.md of a MoE build for a GPU: per token bucket the fused-MoE choice, its time, the
    per-expert loop's and the fraction of the bucket's bound, from the table the tune pass made
    (here a stand-in: no GPU to time on)."""
    import dataclasses

    from tiny_models import tiny_config

    from pagecast.builder import pipeline

    ckpt = _config_only(tmp_path, tiny_config("qwen3_moe"))
    table = {"device": "h200", "tuned": True, "copy_bandwidth_gbs": 4000.0, "matmul_tflops": 700.0, "kernels": {
        "fused_moe": {
            "t1": {"config": {"gemv": 1, "BLOCK_N": 16}, "time_us": 5.0, "reference_us": 25.0},
            "t4096": {"config": {"naive": 1}, "time_us": 400.0, "reference_us": 400.0},
        },
    }}  # fmt: skip

    def tune_pass(state):  # type: ignore[no-untyped-def]
        return dataclasses.replace(state, tuning=table)

    monkeypatch.setattr(pipeline, "PASSES", [(n, tune_pass if n == "tune" else r) for n, r in pipeline.PASSES])
    options = {"model": str(ckpt), "force": True, "quiet": True, "load_format": "dummy"}
    art = build(BuildOptions(output=tmp_path / "gpu", gpu="h200", **options))  # type: ignore[arg-type]
    report = (art / "report.md").read_text()
    assert "## Mixture of experts" in report and "4,000 GB/s" in report and "700 TFLOP/s" in report
    # A tiny model's buckets are all bound by their bytes (the unit test in test_fused_moe.py has a
    # real shape's compute-bound prefill buckets).
    assert "| fused_moe | 1 | gemv=1, BLOCK_N=16 | 5.0 | 25.0 | 0.20 | weights (" in report
    assert "| fused_moe | 4096 | per-expert loop | 400.0 | 400.0 | 1.00 | weights (" in report
