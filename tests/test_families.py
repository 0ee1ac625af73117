"""The families built from parts (builder/families.py): tiny random checkpoints, fp32 on the CPU,
give transformers' greedy tokens and last-position logits through LLM, and greedy text through
engine-serve. Each family's test also shows that the part it adds changes transformers'
output on these checkpoints, so a lowering that dropped the part would fail.

transformers runs with eager attention here: its sdpa path drops Gemma 2's logit soft-cap.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from engine_utils import engine_last_logits, hf_greedy
from tiny_models import MINISTRAL3_ROPE, PART_FAMILIES

from pagecast.builder.ir import BuildOptions
from pagecast.builder.pipeline import build
from pagecast.runtime import LLM, SamplingParams
from pagecast.runtime.errors import BuildError

PROMPTS = [
    "Hello, my name is",
    "一二三四五六七八九十",  # 19 tokens: Phi-3 passes its 32-token original context while generating
    "Once upon a time in a land far, far away, there lived a very old king who",
    " ".join(str(i) for i in range(40)),
]
LONG = " ".join(str(i) for i in range(40))  # 109 tokens: past Gemma's 8-token windows and Phi-3's 32
MAX_TOKENS = 16

# The config change that removes each family's own part(s): transformers' logits on LONG must move.
NEUTRALISED = {
    "gemma2": [{"attn_logit_softcapping": None}, {"final_logit_softcapping": None}, {"sliding_window": 4096}],
    "gemma3": [{"sliding_window": 4096}],
    "phi3": [{"rope_parameters": "short_only"}],
    "olmo2": [],  # post-norms and whole-projection q/k norms: the logits check covers them
    "granite": [{"residual_multiplier": 1.0}, {"embedding_multiplier": 1.0}, {"logits_scaling": 1.0}],
    "smollm3": [{"no_rope_layers": [1, 1, 1, 1]}],
    "gemma": [{"hidden_act": "silu"}],
    "olmo3": [
        {"sliding_window": 4096},
        {"rope_parameters": {t: {"rope_type": "default", "rope_theta": 10000.0} for t in ("sliding_attention", "full_attention")}},
    ],
    "exaone4": [{"sliding_window": 4096}],
    "glm": [{"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 1.0}}],
    "glm4": [{"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 1.0}}],
    "helium": [],  # Llama's parts, RoPE on adjacent pairs: the logits check covers it
    "ernie4_5": [],
    "seed_oss": [],  # Llama's parts with q/k/v and o biases: the logits check covers them
    # the NTK-alpha base (the norms on the rotated heads: a norm before RoPE fails the logits check)
    "hunyuan_dense": [{"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}],
    # the queries' position scale (llama_4_scaling_beta), then YaRN itself
    "ministral3": [
        {"rope_parameters": dict(MINISTRAL3_ROPE, llama_4_scaling_beta=0.0)},
        {"rope_parameters": dict(MINISTRAL3_ROPE, rope_type="default")},
    ],
}


def hf_model(checkpoint: Path, **overrides):  # type: ignore[no-untyped-def]
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(checkpoint))
    for key, value in overrides.items():
        if value == "short_only":  # LongRoPE with the long factors replaced by the short ones
            value = dict(config.rope_parameters, long_factor=list(config.rope_parameters["short_factor"]))
        setattr(config, key, value)
    return AutoModelForCausalLM.from_pretrained(
        str(checkpoint), config=config, dtype=torch.float32, attn_implementation="eager"
    ).eval()


@torch.no_grad()
def hf_cached_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:  # type: ignore[no-untyped-def]
    """Greedy decoding with transformers' KV cache, one token per forward call. For Phi-3's
    LongRoPE this is the reference: once a sequence passes the original context the new tokens
    take the long factors while the K already cached keep the short ones. (transformers'
    generate() gives other tokens from that step on, disagreeing with its own cached forward.)"""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    device = model.device
    out = model(torch.tensor([prompt_ids], device=device), past_key_values=cache, use_cache=True)
    tokens: list[int] = []
    for step in range(max_new_tokens):
        tokens.append(int(out.logits[0, -1].argmax()))
        position = torch.tensor([[len(prompt_ids) + step]], device=device)
        ids = torch.tensor([tokens[-1:]], device=device)
        out = model(ids, past_key_values=cache, use_cache=True, position_ids=position)
    return tokens


@pytest.fixture(scope="module")
def family_llm(tiny_artifact_factory):  # type: ignore[no-untyped-def]
    made: dict[str, LLM] = {}

    def get(family: str) -> LLM:
        if family not in made:
            # Phi-3 without chunked prefill: transformers takes LongRoPE's long factors for a whole
            # prompt past the original context, a prompt prefilled in chunks would take the short
            # ones for its first chunks (kernels.rope.longrope_positions). The others chunk at 64.
            budget = 2048 if family == "phi3" else 64
            made[family] = LLM(tiny_artifact_factory(family), max_num_batched_tokens=budget, max_num_seqs=8)
        return made[family]

    yield get
    made.clear()


@pytest.mark.parametrize("family", PART_FAMILIES)
def test_family_matches_transformers(family, family_llm, tiny_checkpoint_factory):  # type: ignore[no-untyped-def]
    ckpt = tiny_checkpoint_factory(family)
    llm = family_llm(family)
    tok = llm.tokenizer
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    hf = hf_model(ckpt)
    greedy = hf_cached_greedy if family == "phi3" else hf_greedy
    crossed = 0
    for prompt, out in zip(PROMPTS, outputs, strict=True):
        ids = tok.encode(prompt, add_special_tokens=False)
        assert out.token_ids == greedy(hf, ids, MAX_TOKENS), prompt
        crossed += len(ids) <= 32 < len(ids) + MAX_TOKENS
    if family == "phi3":
        assert crossed, "no prompt passes Phi-3's original context while generating"

    long_ids = tok.encode(LONG, add_special_tokens=False)
    for ids in (tok.encode(PROMPTS[0], add_special_tokens=False), long_ids):
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0, -1]
        torch.testing.assert_close(engine_last_logits(llm.engine, ids), ref, atol=1e-4, rtol=0)

    with torch.no_grad():
        ref = hf(torch.tensor([long_ids])).logits[0, -1]
        for overrides in NEUTRALISED[family]:
            moved = hf_model(ckpt, **overrides)(torch.tensor([long_ids])).logits[0, -1]
            assert (moved - ref).abs().max() > 1e-2, f"{family}: {overrides} does not change the output"


def test_gemma2_ir_has_its_parts(tiny_artifact_factory):  # type: ignore[no-untyped-def]
    model_py = (tiny_artifact_factory("gemma2") / "model.py").read_text()
    assert "WINDOWS = [8, 0, 8, 0]" in model_py
    assert "SOFTCAPS = [2.0, 2.0, 2.0, 2.0]" in model_py
    assert f"SCALES = {[24**-0.5] * 4}" in model_py
    assert "FINAL_LOGIT_SOFTCAP = 3.0" in model_py and 'ACTIVATION = "gelu_tanh"' in model_py
    assert "EMBEDDING_MULTIPLIER = 8.0" in model_py  # sqrt(64)
    import json

    plan = json.loads((tiny_artifact_factory("gemma2") / "memory_plan.json").read_text())
    assert plan["sliding_window_layers"] == {"layers": [0, 2], "windows": [8], "kv_blocks": "all kept"}


def test_smollm3_skips_rope_on_its_no_rope_layers(tiny_artifact_factory):  # type: ignore[no-untyped-def]
    model_py = (tiny_artifact_factory("smollm3") / "model.py").read_text()
    assert "ROPE_OF_LAYER = [0, 1, 0, 1]" in model_py and "None]" in model_py


# engine-serve runs the rendered model LLM runs (test_family_matches_transformers checks every
# family there, in chunks); these two take the parts whose state spans steps and chunks: Gemma 2's
# windows and soft-caps, Phi-3's switch to LongRoPE's long factors while generating. The other
# families passed it when they were added (Gemma 3 and OLMo 3 until the forty-first session).
SERVED_FAMILIES = ("gemma2", "phi3")


@pytest.mark.parametrize("family", SERVED_FAMILIES)
def test_family_through_engine_serve(family, tmp_path, tiny_artifact_factory, tiny_checkpoint_factory):  # type: ignore[no-untyped-def]
    """engine-serve (32 batched tokens: LONG prefills in chunks) gives transformers' greedy text.
    Phi-3's prompts fit one chunk, and its reference is the cached decode (see hf_cached_greedy);
    the first one passes the 32-token original context while generating."""
    from server_support import assert_served_greedy_matches

    phi3 = family == "phi3"
    assert_served_greedy_matches(
        tiny_artifact_factory(family),
        [PROMPTS[1], PROMPTS[2]] if phi3 else [LONG, PROMPTS[2]],
        MAX_TOKENS,
        lambda: hf_model(tiny_checkpoint_factory(family)),
        tmp_path / "serve.log",
        decode=hf_cached_greedy if phi3 else None,
    )


def test_gemma2_through_the_triton_kernels(tmp_path, monkeypatch):  # type: ignore[no-untyped-def]
    """The rendered model's kernel path (windows, soft-caps, GELU-tanh, post-norms) in the Triton
    interpreter: what runs on a GPU, checked here on the CPU."""
    from tiny_models import make_checkpoint

    from pagecast.kernels import ops

    ckpt = make_checkpoint(tmp_path / "ckpt", "gemma2", tokenizer=False, vocab_size=512)
    llm = LLM(_build(ckpt, tmp_path), max_num_batched_tokens=32, max_num_seqs=4)
    monkeypatch.setattr(ops, "_triton", lambda x: True)
    prompts = [[1 + (i * 37 + j * 11) % 500 for j in range(n)] for i, n in enumerate([5, 40])]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    hf = hf_model(ckpt)
    assert [o.token_ids for o in outs] == [hf_greedy(hf, p, 4) for p in prompts]


TP_CASES = {
    # Phi-3's fused qkv_proj / gate_up_proj are read as row ranges and cut per rank like separate
    # tensors (LongRoPE off: these prompts are prefilled in chunks); Gemma 3's (1 + w) norms and
    # per-head q/k norms stay whole on each rank, its windows and RoPE tables apply per rank.
    "phi3": {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}},
    "gemma3": {},
    # GLM-4's q and k rows reordered for its adjacent-pair RoPE over half of each head, then cut by heads
    "glm4": {},
    # OLMo 2's q/k norms over the whole projection, its weights cut with the heads and each row's sum
    # of squares all-reduced; one KV head, so both ranks hold it (counted once in k's norm)
    "olmo2": {"num_key_value_heads": 1},
}


@pytest.mark.parametrize("family", list(TP_CASES))
def test_tp2_matches_transformers(family, tiny_checkpoint_factory, tmp_path):  # type: ignore[no-untyped-def]
    ckpt = tiny_checkpoint_factory(family, **TP_CASES[family])
    llm = LLM(_build(ckpt, tmp_path, tp=2), max_num_batched_tokens=32, max_num_seqs=4, kv_cache_memory="4MiB")
    try:
        assert llm.engine.runner.workers is not None
        outputs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    finally:
        llm.engine.runner.close()
    hf = hf_model(ckpt)
    for out in outputs:
        assert out.token_ids == hf_greedy(hf, out.prompt_token_ids, 8)


# -- refusals ---------------------------------------------------------------------------------


def _build(ckpt: Path, tmp_path: Path, **options) -> Path:  # type: ignore[no-untyped-def]
    return build(BuildOptions(model=str(ckpt), output=tmp_path / "art", force=True, quiet=True, **options))


def test_unknown_op_is_refused_with_its_module(tmp_path):  # type: ignore[no-untyped-def]
    from tiny_models import make_checkpoint

    ckpt = make_checkpoint(tmp_path / "relu", "llama", tokenizer=False, hidden_act="relu")
    with pytest.raises(BuildError) as e:
        _build(ckpt, tmp_path)
    msg = str(e.value)
    assert "'relu'" in msg and "model.layers.0.mlp.act_fn" in msg and "Gemma2ForCausalLM" in msg


def test_unknown_architecture_lists_the_supported_ones(tmp_path):  # type: ignore[no-untyped-def]
    import json

    from tiny_models import make_checkpoint

    ckpt = make_checkpoint(tmp_path / "mm", "llama", tokenizer=False)
    config = json.loads((ckpt / "config.json").read_text())
    config["architectures"] = ["Qwen3NextForCausalLM"]
    (ckpt / "config.json").write_text(json.dumps(config))
    with pytest.raises(BuildError, match="'Qwen3NextForCausalLM' is not supported; supported architectures: .*SmolLM3ForCausalLM"):
        _build(ckpt, tmp_path)
    config["architectures"] = ["DeepseekV3ForCausalLM"]  # refused with its reason
    (ckpt / "config.json").write_text(json.dumps(config))
    with pytest.raises(BuildError, match="multi-head latent attention.*supported architectures: .*Gemma3ForConditionalGeneration"):
        _build(ckpt, tmp_path)


def test_interleaved_rope_refuses_int4_checkpoints(tiny_checkpoint_factory, tmp_path):  # type: ignore[no-untyped-def]
    # The reorder of q/k rows is done on float and FP8 weights (see test_fp8_build.py); an AWQ/GPTQ
    # checkpoint would need it on packed int4 columns, so it is refused with what to do, not built wrong.
    from quant_writer import Format, write

    ckpt, _ = write(tiny_checkpoint_factory("helium"), tmp_path / "awq", Format("awq", 32))
    with pytest.raises(BuildError, match="interleaved RoPE.*AWQ checkpoints of it are not supported.*--quant fp8"):
        _build(ckpt, tmp_path, quant="awq")

