"""A MoE model with the engine's features (issue 27: "prefix caching, structured output,
logprobs and preemption behave as for dense models"): a tiny Qwen3-MoE on the CPU, each feature
checked the way the dense tests check it (tests/test_paging.py, test_sampler.py,
test_speculative.py): outputs unchanged by preemption and by the prefix cache, logprobs equal to
transformers' log-softmax, a constrained output inside its grammar."""

from __future__ import annotations

import re

import pytest
import torch
from test_paging import llm_block_bytes

from pagecast.runtime import LLM, SamplingParams
from pagecast.runtime.sampling_params import StructuredOutput

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
PROMPTS = [[(11 + 17 * i + 5 * j) % 4000 + 3 for j in range(n)] for i, n in enumerate([40, 37, 45, 33, 41, 38])]


@pytest.fixture(scope="module")
def moe_artifact(tiny_artifact_factory):  # type: ignore[no-untyped-def]
    return tiny_artifact_factory("qwen3_moe")


@pytest.fixture(scope="module")
def alone(moe_artifact):  # type: ignore[no-untyped-def]
    """Each prompt's greedy tokens with a roomy cache and no prefix cache."""
    llm = LLM(moe_artifact, enable_prefix_caching=False)
    return [o.token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def test_preemption_keeps_a_moe_models_outputs(moe_artifact, alone) -> None:  # type: ignore[no-untyped-def]
    # 12 blocks of 16 tokens cannot hold six ~60-token sequences: the newest are preempted and recomputed.
    llm = LLM(moe_artifact, kv_cache_memory=12 * llm_block_bytes(moe_artifact), max_model_len=80, enable_prefix_caching=False)
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0
    assert [o.token_ids for o in outputs] == alone
    assert llm.engine.block_pool.num_used_blocks == 0


def test_a_moe_models_shared_prefix_comes_from_cached_blocks(moe_artifact) -> None:  # type: ignore[no-untyped-def]
    prefix = PROMPTS[0] * 2  # 80 tokens: five full blocks
    prompts = [prefix + p[:5] for p in PROMPTS[1:4]]
    llm = LLM(moe_artifact)
    first = llm.generate([prompts[0]], GREEDY, use_tqdm=False)[0]
    rest = llm.generate(prompts[1:], GREEDY, use_tqdm=False)
    assert all(o.metrics.num_cached_tokens >= 80 for o in rest)
    no_cache = LLM(moe_artifact, enable_prefix_caching=False).generate(prompts, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in [first, *rest]] == [o.token_ids for o in no_cache]


def test_a_moe_models_logprobs_are_transformers_log_softmax(moe_artifact, tiny_checkpoint_factory) -> None:  # type: ignore[no-untyped-def]
    from transformers import AutoModelForCausalLM

    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=3)
    out = LLM(moe_artifact).generate([PROMPTS[1]], params, use_tqdm=False)[0].outputs[0]
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_checkpoint_factory("qwen3_moe")), dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(torch.tensor([PROMPTS[1] + out.token_ids])).logits[0]
    expected = torch.log_softmax(logits[len(PROMPTS[1]) - 1 : -1], dim=-1)  # the positions that chose each token
    assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids)
    for position, (token, entry) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
        top = torch.topk(expected[position], 3)
        assert set(entry) >= set(top.indices.tolist()) and token in entry
        assert entry[token].rank == 1  # greedy: the chosen token is the most likely
        for token_id, logprob in entry.items():
            assert logprob.logprob == pytest.approx(expected[position, token_id].item(), abs=1e-4)


def test_a_moe_models_constrained_output_stays_in_its_grammar(moe_artifact) -> None:  # type: ignore[no-untyped-def]
    llm = LLM(moe_artifact)
    choice = StructuredOutput(type="choice", choice=("alpha beta alpha", "gamma"))
    regex = StructuredOutput(type="regex", regex="(ab){1,3}c")
    outputs = llm.generate(
        ["Pick one:", "Write the pattern:"],
        [SamplingParams(temperature=0, max_tokens=16, structured_output=choice),
         SamplingParams(temperature=0, max_tokens=16, structured_output=regex)],
        use_tqdm=False,
    )  # fmt: skip
    assert outputs[0].outputs[0].text in ("alpha beta alpha", "gamma")
    assert re.fullmatch("(ab){1,3}c", outputs[1].outputs[0].text)
    assert all(o.outputs[0].finish_reason == "stop" for o in outputs)
