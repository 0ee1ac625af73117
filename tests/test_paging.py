"""Paging, prefix caching and continuous batching on a tiny model: outputs never change."""

from __future__ import annotations

import pytest
from engine_utils import PROMPTS

from pagecast.runtime import LLM, SamplingParams
from pagecast.runtime.engine import LLMEngine

GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
# Every test runs with the synchronous step and with asynchronous scheduling (step N+1 planned
# while step N runs, decode inputs read from the device): outputs must not change.
BOTH_MODES = pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])


@pytest.fixture(scope="module")
def reference(tiny_llama_artifact):  # type: ignore[no-untyped-def]
    """Each prompt alone, with a roomy cache."""
    llm = LLM(tiny_llama_artifact, enable_prefix_caching=False)
    return {p: llm.generate(p, GREEDY)[0].token_ids for p in PROMPTS}


@BOTH_MODES
def test_preemption_keeps_outputs(tiny_llama_artifact, reference, async_scheduling):  # type: ignore[no-untyped-def]
    # 12 blocks of 16 tokens cannot hold six ~40-token sequences: the newest are preempted and recomputed.
    llm = LLM(
        tiny_llama_artifact,
        async_scheduling=async_scheduling,
        kv_cache_memory=12 * llm_block_bytes(tiny_llama_artifact),
        max_model_len=64,
        enable_prefix_caching=False,
    )
    outputs = llm.generate(PROMPTS, GREEDY)
    assert llm.engine.scheduler.num_preemptions > 0
    assert [o.token_ids for o in outputs] == [reference[p] for p in PROMPTS]
    assert llm.engine.block_pool.num_used_blocks == 0


@BOTH_MODES
def test_shared_prefix_is_served_from_cached_blocks(tiny_llama_artifact, reference, async_scheduling):  # type: ignore[no-untyped-def]
    llm = LLM(tiny_llama_artifact, async_scheduling=async_scheduling)
    system = "You are a careful assistant who answers in one short sentence. " * 3
    prompts = [system + q for q in ("What is rain?", "Why is the sky blue?", "Name a prime.")]
    alone = {p: LLM(tiny_llama_artifact, enable_prefix_caching=False).generate(p, GREEDY)[0].token_ids
             for p in prompts[:1]}
    first = llm.generate(prompts[0], GREEDY)[0]
    assert first.token_ids == alone[prompts[0]]
    hits_before = llm.engine.block_pool.num_prefix_hits
    rest = llm.generate(prompts[1:], GREEDY)
    prefix_len = len(llm.tokenizer.encode(system, add_special_tokens=False))
    full_blocks = (prefix_len - 1) // 16 * 16  # at least the shared full blocks of the prefix
    assert llm.engine.block_pool.num_prefix_hits - hits_before >= 2 * full_blocks > 0
    assert all(o.metrics.num_cached_tokens >= full_blocks for o in rest)
    # And the outputs are the ones computed without any cache.
    no_cache = LLM(tiny_llama_artifact, enable_prefix_caching=False)
    assert [o.token_ids for o in rest] == [o.token_ids for o in no_cache.generate(prompts[1:], GREEDY)]
    assert llm.engine.block_pool.num_used_blocks == 0


@BOTH_MODES
def test_requests_added_while_others_run(tiny_llama_artifact, reference, async_scheduling):  # type: ignore[no-untyped-def]
    engine = LLMEngine(tiny_llama_artifact, max_num_batched_tokens=32, max_num_seqs=4, async_scheduling=async_scheduling)
    lengths = {PROMPTS[0]: 40, PROMPTS[1]: 3, PROMPTS[2]: 24, PROMPTS[3]: 1, PROMPTS[4]: 10}
    finished_order: list[str] = []
    results: dict[str, list[int]] = {}
    pending = list(lengths)
    engine.add_request(pending[0], pending[0], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    pending = pending[1:]
    steps = 0
    while engine.has_unfinished_requests() or pending:
        if pending and steps % 3 == 2:  # new requests arrive while the first is decoding
            p = pending.pop(0)
            engine.add_request(p, p, SamplingParams(temperature=0, max_tokens=lengths[p], ignore_eos=True))
        for out in engine.step():
            if out.finished:
                finished_order.append(out.request_id)
                results[out.request_id] = out.token_ids
        steps += 1
    for p, n in lengths.items():
        assert results[p] == reference[p][:n], p
    assert finished_order.index(PROMPTS[1]) < finished_order.index(PROMPTS[0])
    assert finished_order.index(PROMPTS[3]) < finished_order.index(PROMPTS[2])
    assert finished_order[-1] == PROMPTS[0]
    assert engine.block_pool.num_used_blocks == 0


@BOTH_MODES
def test_chunked_prefill_of_a_long_prompt(tiny_llama_artifact, async_scheduling):  # type: ignore[no-untyped-def]
    prompt = " ".join(f"word{i}" for i in range(120))
    whole = LLM(tiny_llama_artifact, max_num_batched_tokens=2048).generate(prompt, GREEDY)[0]
    chunked_llm = LLM(tiny_llama_artifact, max_num_batched_tokens=16, max_num_seqs=4, async_scheduling=async_scheduling)
    chunked = chunked_llm.generate(prompt, GREEDY)[0]
    assert len(whole.prompt_token_ids) > 16 * 4
    assert chunked.token_ids == whole.token_ids


@BOTH_MODES
def test_n_and_seed_are_reproducible(tiny_llama_artifact, async_scheduling):  # type: ignore[no-untyped-def]
    llm = LLM(tiny_llama_artifact, async_scheduling=async_scheduling)
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=12, ignore_eos=True)
    a = llm.generate("Tell me a story", params)[0]
    b = llm.generate(["Tell me a story", "Something else"], [params, SamplingParams(temperature=1.0, max_tokens=5)])[0]
    assert len(a.outputs) == 3
    assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]
    assert len({tuple(o.token_ids) for o in a.outputs}) > 1, "the three choices should differ"
    assert llm.engine.block_pool.num_used_blocks == 0


@BOTH_MODES
def test_n_choices_compute_the_prompt_once(tiny_llama_artifact, async_scheduling):  # type: ignore[no-untyped-def]
    # The 2nd..4th choices take the first one's prompt blocks from the prefix cache instead of
    # prefilling the prompt three more times; the tokens are the ones computed without a cache.
    prompt = " ".join(f"item{i}" for i in range(60))
    params = SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=8, ignore_eos=True)
    llm = LLM(tiny_llama_artifact, async_scheduling=async_scheduling)
    out = llm.generate(prompt, params)[0]
    full_blocks = (len(out.prompt_token_ids) - 1) // 16
    assert full_blocks >= 4
    pool = llm.engine.block_pool
    assert pool.num_prefix_hits >= 3 * full_blocks
    assert llm.engine.stats().num_prompt_tokens == len(out.prompt_token_ids)
    uncached = LLM(tiny_llama_artifact, enable_prefix_caching=False).generate(prompt, params)[0]
    assert [o.token_ids for o in out.outputs] == [o.token_ids for o in uncached.outputs]
    assert pool.num_used_blocks == 0


def llm_block_bytes(artifact) -> int:  # type: ignore[no-untyped-def]
    import json

    return json.loads((artifact / "memory_plan.json").read_text())["bytes_per_block"]
