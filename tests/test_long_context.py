"""Long context on the CPU (issue 32).

- A tiny random Llama with Llama 3 rope scaling and a yarn-scaled Qwen, both with a 16k context,
  give transformers' greedy tokens in float32 for prompts of 5k and 16k tokens, prefilled through
  chunked prefill in many chunks (positions far beyond the original context, so every rope
  frequency band matters).
- --max-model-len is accepted up to the model's limit (yarn: original context x factor where
  longer) and refused above it with the numbers.
- On the llama3 model, a 6k shared prefix is served from the prefix cache with the uncached run's
  tokens; a KV cache of half a context preempts and recomputes a 6k request, seeded with penalties,
  without changing its tokens.
- The memory plan of a Llama-3.1-8B-shaped dummy build at 128k states the KV bytes per token and
  per 128k sequence and how many such sequences fit, matching a hand computation.
"""

from __future__ import annotations

import json
import re

import pytest
import torch
from conftest import build_artifact
from tiny_models import make_checkpoint
from transformers import AutoModelForCausalLM

from pagecast.runtime import LLM, SamplingParams
from pagecast.runtime.errors import BuildError

CONTEXT = 16384
SMALL = {
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": CONTEXT,
}  # fmt: skip
CASES = {
    # rope_theta 500000 with head_dim 16: wavelengths 6 .. 610k positions, so against an original
    # context of 1024 the frequencies fall in all three of llama3's bands (kept, smoothed, / factor).
    "llama3": (
        "llama",
        {
            "rope_parameters": {
                "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 1024,
            }
        },
    ),
    # Qwen3 rather than Qwen2: the tiny Qwen2's large qkv biases (tiny_models) make its tokens on
    # random prompts the same with and without yarn, so a yarn bug would pass unseen.
    "yarn-qwen3": (
        "qwen3",
        {
            "rope_parameters": {
                "rope_type": "yarn", "rope_theta": 1000000.0, "factor": 4.0,
                "original_max_position_embeddings": 4096,
            }
        },
    ),
}  # fmt: skip
PROMPT_LENGTHS = (5000, CONTEXT - 8)
MAX_TOKENS = 8
# Attention scores x 9 (q and k x 3): a tiny random model otherwise attends almost uniformly over
# 16k random tokens, and its greedy tokens hardly depend on positions. Sharpened, the tokens of
# every prompt below differ between the scaled rope and the plain one (checked with transformers),
# so these tests see the rope variant.
SHARPEN = 3.0


def _prompts(vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    # token ids 3.. (clear of bos / eos / pad), random: nothing repeats that attention could lean on
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


def sharpened_checkpoint(path, family: str, **overrides):  # type: ignore[no-untyped-def]
    """tiny_models' checkpoint with q and k (Qwen3: its q/k norms) scaled by SHARPEN."""
    make_checkpoint(path, family, **overrides)
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    with torch.no_grad():
        for layer in model.model.layers:
            a = layer.self_attn
            for w in (a.q_norm.weight, a.k_norm.weight) if family == "qwen3" else (a.q_proj.weight, a.k_proj.weight):
                w.mul_(SHARPEN)
    model.save_pretrained(str(path))
    return path


@pytest.fixture(scope="module")
def long_model(tmp_path_factory):  # type: ignore[no-untyped-def]
    """case -> (checkpoint, artifact), each built once for the module's tests."""
    built: dict[str, tuple] = {}

    def get(case: str):  # type: ignore[no-untyped-def]
        if case not in built:
            family, rope = CASES[case]
            root = tmp_path_factory.mktemp(case)
            ckpt = sharpened_checkpoint(root / "ckpt", family, **SMALL, **rope)
            built[case] = (ckpt, build_artifact(ckpt, root / "engine"))
        return built[case]

    return get


def long_llm(artifact, **options):  # type: ignore[no-untyped-def]
    """An engine taking prompts in chunks of up to 2,048 tokens (on the CPU a step's prompt tokens
    are otherwise cut to CPU_MAX_NUM_PREFILL_TOKENS, 128)."""
    options = {"max_num_batched_tokens": 2048, "max_num_prefill_tokens": 2048, "max_num_seqs": 2} | options
    return LLM(artifact, **options)


def record_prefill_chunks(llm, monkeypatch) -> dict[str, list[int]]:  # type: ignore[no-untyped-def]
    """request id -> the prompt tokens the scheduler gave it in each step, filled as it schedules."""
    scheduler = llm.engine.core.scheduler
    schedule, chunks = scheduler.schedule, {}

    def recording():  # type: ignore[no-untyped-def]
        out = schedule()
        for r, n in zip(out.scheduled_requests, out.num_scheduled_tokens):
            if r.num_computed_tokens < r.num_prompt_tokens:
                chunks.setdefault(r.request_id, []).append(n)
        return out

    monkeypatch.setattr(scheduler, "schedule", recording)
    return chunks


@pytest.mark.parametrize("case", list(CASES))
def test_long_prompts_give_transformers_greedy_tokens(case, long_model, monkeypatch):
    rope = CASES[case][1]
    ckpt, artifact = long_model(case)
    assert json.loads((artifact / "manifest.json").read_text())["max_model_len"] == CONTEXT
    llm = long_llm(artifact)
    chunks = record_prefill_chunks(llm, monkeypatch)
    prompts = _prompts(llm.engine.vocab_size, seed=len(case))
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    # 2048-token chunks: the 5k prompt in 3 steps; the 16k one takes what it leaves of those steps'
    # budget, then 2,047 a step beside the 5k one's decodes, its last chunk past position 14k.
    short, long = (chunks[o.request_id] for o in outputs)
    assert short == [2048] * 2 + [5000 - 2 * 2048]
    assert len(long) >= 8 and max(long) <= 2048 and sum(long) == PROMPT_LENGTHS[1]
    assert sum(long[:-1]) >= 14000

    hf = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32, attn_implementation="sdpa")
    hf.eval()
    assert hf.config.rope_parameters["rope_type"] == rope["rope_parameters"]["rope_type"]
    for ids, out in zip(prompts, outputs):
        assert out.prompt_token_ids == ids
        with torch.no_grad():
            ref = hf.generate(
                torch.tensor([ids]), max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS, do_sample=False,
                pad_token_id=0, output_logits=True, return_dict_in_generate=True,
            )  # fmt: skip
        expected = ref.sequences[0, len(ids) :].tolist()
        assert out.token_ids == expected, f"prompt of {len(ids)} tokens"
        # and the chosen tokens' log-probabilities, which a small rope error would move
        ours = torch.tensor([out.outputs[0].logprobs[i][t].logprob for i, t in enumerate(expected)])
        theirs = torch.stack([torch.log_softmax(step[0].float(), -1)[t] for step, t in zip(ref.logits, expected)])
        torch.testing.assert_close(ours, theirs, atol=1e-3, rtol=0)


SHARED = 6000  # a whole number of 16-token blocks: every shared token can be served from the cache
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
# Seeded sampling with every penalty: the repetition penalty reads the 6k prompt's tokens, presence
# and frequency the outputs so far.
SEEDED = SamplingParams(
    temperature=1.0, seed=1234, max_tokens=2 * MAX_TOKENS, ignore_eos=True, repetition_penalty=1.3,
    presence_penalty=0.5, frequency_penalty=0.5,
)  # fmt: skip


@pytest.fixture(scope="module")
def shared_prefix(long_model):  # type: ignore[no-untyped-def]
    """On the 16k llama3 model, two prompts of a 6k shared prefix and 100 tokens of their own, run
    in one engine with the prefix cache: the first greedily (nothing cached), then the second
    greedily and seeded (the first's prefix cached). -> (artifact, prompts, first, second's two)."""
    _, artifact = long_model("llama3")
    llm = long_llm(artifact)
    g = torch.Generator().manual_seed(12)
    prefix = torch.randint(3, llm.engine.vocab_size, (SHARED,), generator=g).tolist()
    prompts = [prefix + torch.randint(3, llm.engine.vocab_size, (100,), generator=g).tolist() for _ in range(2)]
    (first,) = llm.generate(prompts[:1], GREEDY, use_tqdm=False)
    second = llm.generate([prompts[1]] * 2, [GREEDY, SEEDED], use_tqdm=False)
    return artifact, prompts, first, second


def test_a_6k_shared_prefix_is_served_from_the_cache(shared_prefix):  # type: ignore[no-untyped-def]
    artifact, prompts, first, second = shared_prefix
    assert first.metrics.num_cached_tokens == 0
    assert [o.metrics.num_cached_tokens for o in second] == [SHARED, SHARED]
    # the same tokens as the whole prompt computed without the cache
    (uncached,) = long_llm(artifact, enable_prefix_caching=False).generate(prompts[1:], GREEDY, use_tqdm=False)
    assert uncached.metrics.num_cached_tokens == 0
    assert uncached.token_ids == second[0].token_ids


def test_preemption_and_seeded_penalties_at_long_context(shared_prefix):  # type: ignore[no-untyped-def]
    """A KV cache of half the 16k context, no prefix cache: the two 6.1k prompts cannot both be held, so
    the second (seeded, with penalties) is preempted while the first decodes and is recomputed. Its
    tokens are those of the run above that read its prefix from the cache, and the first's too."""
    artifact, prompts, first, second = shared_prefix
    plan = json.loads((artifact / "memory_plan.json").read_text())
    half = CONTEXT // 2  # (the engine's max_model_len with it: a cache must hold one whole sequence)
    tight = long_llm(artifact, enable_prefix_caching=False, kv_cache_memory=half * plan["bytes_per_token"], max_model_len=half)
    assert tight.engine.stats().num_kv_blocks_total * 16 == half
    outputs = tight.generate(prompts, [GREEDY, SEEDED], use_tqdm=False)
    assert tight.engine.stats().num_preemptions > 0 and outputs[1].metrics.num_preemptions > 0
    assert outputs[0].token_ids == first.token_ids
    assert outputs[1].token_ids == second[1].token_ids
    assert second[1].token_ids[:MAX_TOKENS] != second[0].token_ids  # sampled, not greedy


LLAMA31_8B = {
    "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "bos_token_id": 128000, "eos_token_id": 128001,
    "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
}  # fmt: skip


@pytest.fixture(scope="module")
def llama31_8b_config_dir(tmp_path_factory):  # type: ignore[no-untyped-def]
    from transformers import LlamaConfig

    path = tmp_path_factory.mktemp("llama31-8b-config")
    LlamaConfig(architectures=["LlamaForCausalLM"], **LLAMA31_8B).save_pretrained(str(path))
    return path


def _build_8b(config_dir, output, **options):  # type: ignore[no-untyped-def]
    return build_artifact(config_dir, output, gpu="h200", load_format="dummy", tune_budget_s=0, **options)


def test_memory_plan_at_128k_for_the_llama31_8b_shape(llama31_8b_config_dir, tmp_path):
    from pagecast.builder.plan import GPUS

    artifact = _build_8b(llama31_8b_config_dir, tmp_path / "engine", max_model_len=131072)
    plan = json.loads((artifact / "memory_plan.json").read_text())
    assert plan["max_model_len"] == 131072
    # K and V, 32 layers, 8 KV heads of 128, 2 bytes: 128 KiB per token, 16 GiB per 128k sequence
    assert plan["bytes_per_token"] == 2 * 32 * 8 * 128 * 2 == 128 * 1024
    assert plan["bytes_per_block"] == 16 * 128 * 1024
    assert plan["bytes_per_seq_at_max_model_len"] == 131072 * 128 * 1024 == 16 * 2**30
    # embeddings and an untied head, per layer q/k/v/o, gate/up/down and two norms, the final norm
    per_layer = (4096 + 2 * 1024) * 4096 + 4096 * 4096 + 3 * 14336 * 4096 + 2 * 4096
    params = 2 * 128256 * 4096 + 32 * per_layer + 4096
    assert params == 8_030_261_248
    assert plan["num_parameters"] == params and plan["weight_bytes"] == 2 * params
    memory = GPUS["h200"]["memory_bytes"]
    assert plan["device_memory_bytes"] == memory
    budgets = {b["gpu_memory_utilization"]: b for b in plan["budgets"]}
    at_90 = budgets[0.9]
    kv = int(memory * 0.9) - 2 * params - plan["activation_bytes"]
    assert at_90["kv_bytes"] == kv
    assert at_90["num_blocks"] == kv // (16 * 128 * 1024)
    assert at_90["max_tokens"] == at_90["num_blocks"] * 16
    # (141.2 GB x 0.9 - 16.06 GB of weights - activations) / 16 GiB: six whole 128k sequences
    assert at_90["max_seqs_at_max_model_len"] == at_90["max_tokens"] // 131072 == 6
    assert "16.00 GiB per sequence of max_model_len 131,072" in (artifact / "report.md").read_text()


def test_fp8_kv_halves_the_128k_sequence(llama31_8b_config_dir, tmp_path):
    artifact = _build_8b(llama31_8b_config_dir, tmp_path / "e", max_model_len=131072, kv_cache_dtype="fp8")
    plan = json.loads((artifact / "memory_plan.json").read_text())
    assert plan["bytes_per_token"] == 64 * 1024
    assert plan["bytes_per_seq_at_max_model_len"] == 8 * 2**30
    at_90 = {b["gpu_memory_utilization"]: b for b in plan["budgets"]}[0.9]
    assert at_90["max_seqs_at_max_model_len"] == at_90["num_blocks"] * 16 // 131072 == 13


def test_max_model_len_up_to_the_model_limit_and_refused_above_it(tmp_path):
    from click.testing import CliRunner
    from transformers import LlamaConfig

    from pagecast.builder.cli import main

    # the 8B shape's context limit on two of its layers (the refusal reads the config, not the depth)
    config_dir = tmp_path / "config"
    LlamaConfig(architectures=["LlamaForCausalLM"], **LLAMA31_8B | {"num_hidden_layers": 2}).save_pretrained(str(config_dir))
    refusal = r"--max-model-len 131073 exceeds the model's max_position_embeddings 131072"
    with pytest.raises(BuildError, match=refusal):
        _build_8b(config_dir, tmp_path / "over", max_model_len=131073)
    assert not (tmp_path / "over").exists()
    # the CLI: exit status 2 and the numbers on stderr
    args = ["--model", str(config_dir), "--gpu", "h200", "--load-format", "dummy", "--quiet",
            "--max-model-len", "200000", "--output", str(tmp_path / "cli")]  # fmt: skip
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2
    assert "200000" in result.output and "131072" in result.output


def test_yarn_qwen3_reaches_128k_past_its_max_position_embeddings(tmp_path):
    """Qwen3's docs enable 128k by adding yarn (factor 4 over 32,768) and leave
    max_position_embeddings at 40,960: the limit is original x factor, as vLLM takes it."""
    from transformers import Qwen3Config

    config = Qwen3Config(
        architectures=["Qwen3ForCausalLM"], **SMALL | {"max_position_embeddings": 40960}, vocab_size=1024,
        rope_theta=1e6, rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
    )  # fmt: skip
    config.save_pretrained(str(tmp_path / "ckpt"))

    def build(output, **options):  # type: ignore[no-untyped-def]
        return _build_8b(tmp_path / "ckpt", tmp_path / output, **options)

    for output, options in (("default", {}), ("128k", {"max_model_len": 131072})):
        plan = json.loads((build(output, **options) / "memory_plan.json").read_text())
        assert plan["max_model_len"] == 131072, output
    refusal = (
        "--max-model-len 131073 exceeds the model's context limit 131072, the larger of max_position_embeddings "
        "40960 and yarn's original_max_position_embeddings 32768 x factor 4.0 = 131072"
    )
    with pytest.raises(BuildError, match=re.escape(refusal)):
        build("over", max_model_len=131073)


def test_w7_benchmark_counts_the_8b_shape_by_hand():
    """benchmarks/long_context.py's bounds: per prompt token 2 x 6.98 G projection FLOPs, causal
    attention 4 x 32 layers x 32 heads x 128 x L(L+1)/2, and a decode step reads 15.01 GB of
    weights (all but the embedding table) plus 128 KiB of bf16 KV per token of context."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
    import long_context as w7

    cfg = w7.LLAMA31_8B
    assert w7.linear_params_per_token(cfg) == 32 * ((4096 + 2048) * 4096 + 4096 * 4096 + 3 * 14336 * 4096)
    linear, attention = w7.prefill_flops(cfg, 32768)
    assert linear == 2 * 6_979_321_856 * 32768 + 2 * 128256 * 4096
    assert attention == 4 * 32 * 32 * 128 * 32768 * 32769 / 2  # 0.28 PFLOP at 32k (4.5 at 128k)
    assert (
        w7.kv_bytes_per_token(cfg, "bf16", 2) == 128 * 1024
        and w7.kv_bytes_per_token(cfg, "fp8", 2) == 64 * 1024
    )
    assert w7.decode_weight_bytes(cfg, 2) == 2 * (8_030_261_248 - 128256 * 4096)


def test_w7_benchmark_dry_run(tmp_path, monkeypatch, capsys):  # type: ignore[no-untyped-def]
    """benchmarks/long_context.py --dry-run (a tiny model on the CPU, about 12 s): every figure's
    code path runs and writes its rows to OUT/long_context.jsonl, and the table is printed."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
    import long_context as w7

    monkeypatch.setattr(w7, "RESULTS", [])
    w7.main(["--dry-run", "--out", str(tmp_path)])
    rows = [json.loads(line) for line in (tmp_path / "long_context.jsonl").read_text().splitlines()]
    by_figure: dict[str, list[dict]] = {}
    for row in rows:
        by_figure.setdefault(row["figure"], []).append(row)
    assert [r["prompt_tokens"] for r in by_figure["ttft_s"]] == [256, 512 - 4 - 4]  # the longest leaves room
    assert [r["seqs"] for r in by_figure["inter_token_latency_ms"]] == [1, 2]
    assert [r["tokens"] for r in by_figure["prefill_attention_fraction_of_peak"]] == [256, 512]
    assert [r["seqs"] for r in by_figure["decode_attention_fraction_of_copy"]] == [1, 2]
    for figure in ("matmul_peak_tflops", "copy_bandwidth_gb_s", "enginebuild_seconds", "total_seconds"):
        assert len(by_figure[figure]) == 1, figure
    assert all(r["kv"] == "bf16" for r in rows if "kv" in r)  # the dry run skips the fp8 KV cache
    assert all(r["value"] > 0 for r in by_figure["ttft_s"] + by_figure["inter_token_latency_ms"])
    assert "| TTFT | bf16 | 1 x 504 |" in capsys.readouterr().out
    # the inter-token figure is the mean of the timed steps (drive), as --help says
    with pytest.raises(SystemExit):
        w7.main(["--help"])
    usage = " ".join(capsys.readouterr().out.split())
    assert "--decode-tokens DECODE_TOKENS decode steps timed for the inter-token figures (their mean" in usage


def test_tp2_plan_states_one_ranks_kv_per_128k_sequence(llama31_8b_config_dir, tmp_path):
    artifact = _build_8b(llama31_8b_config_dir, tmp_path / "engine", max_model_len=131072, tp=2)
    plan = json.loads((artifact / "memory_plan.json").read_text())
    assert plan["tp"] == 2 and plan["bytes_per_token"] == 64 * 1024  # 4 of the 8 KV heads per rank
    assert plan["bytes_per_seq_at_max_model_len"] == 131072 * 64 * 1024 == 8 * 2**30
