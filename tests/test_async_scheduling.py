"""Asynchronous scheduling: the engine plans and launches step N+1 before it reads step N's
tokens (decode inputs come from the device), and books step N while N+1 runs. Users must see
exactly what the synchronous engine gives them: the same tokens, stops, aborts and freed blocks."""

from __future__ import annotations

import asyncio
import itertools

import pytest
from engine_utils import PROMPTS as ALL_PROMPTS

from pagecast.runtime import LLM, AsyncEngine, SamplingParams
from pagecast.runtime.engine import LLMEngine

PROMPTS = ALL_PROMPTS[:5]


def run_both(artifact, prompts, params, **options):  # type: ignore[no-untyped-def]
    sync = LLM(artifact, async_scheduling=False, **options).generate(prompts, params)
    llm = LLM(artifact, async_scheduling=True, **options)
    out = llm.generate(prompts, params)
    return sync, out, llm


def test_greedy_stops_and_lengths_match_the_synchronous_engine(tiny_llama_artifact):  # type: ignore[no-untyped-def]
    # Stop tokens and stop strings end requests at steps the scheduler could not foresee: the
    # step already planned for them is computed and its token dropped.
    base = LLM(tiny_llama_artifact, async_scheduling=False)
    free_run = base.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    params = []
    for i, out in enumerate(free_run):
        if i % 2 == 0:  # stop on the token generated at step 5 + i
            params.append(SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[out.token_ids[5 + i]]))
        else:  # a stop string taken from the middle of the free-running text
            params.append(SamplingParams(temperature=0, max_tokens=3 + 5 * i, stop=[out.text[6:9]] if len(out.text) > 9 else None))
    sync, got, llm = run_both(tiny_llama_artifact, PROMPTS, params, max_num_batched_tokens=32, max_num_seqs=4)
    for a, b in zip(sync, got):
        assert (b.token_ids, b.text, b.outputs[0].finish_reason, b.outputs[0].stop_reason) == (
            a.token_ids, a.text, a.outputs[0].finish_reason, a.outputs[0].stop_reason)
    assert {o.outputs[0].finish_reason for o in got} >= {"stop"}
    assert llm.engine.block_pool.num_used_blocks == 0
    assert llm.engine.stats().num_generation_tokens == sum(len(o.token_ids) for o in got)


def test_the_next_step_is_launched_before_the_previous_one_is_read(tiny_llama_artifact, monkeypatch):  # type: ignore[no-untyped-def]
    engine = LLMEngine(tiny_llama_artifact, async_scheduling=True)
    calls: list[str] = []
    launch, collect = engine.runner.launch, engine.runner.collect
    monkeypatch.setattr(engine.runner, "launch", lambda *a: calls.append("launch") or launch(*a))
    monkeypatch.setattr(engine.runner, "collect", lambda *a: calls.append("collect") or collect(*a))
    engine.add_request("a", PROMPTS[0], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    # One prefill step and five decodes, each launched before its predecessor is collected; the
    # sixth token ends the request by length, so no seventh step is launched.
    assert calls == ["launch"] + ["launch", "collect"] * 5 + ["collect"]
    assert [len(o.token_ids) for o in outputs] == [1, 2, 3, 4, 5, 6]
    assert outputs[-1].finished and engine.block_pool.num_used_blocks == 0


def test_logprobs_and_penalties_switch_to_synchronous_steps(tiny_llama_artifact):  # type: ignore[no-untyped-def]
    engine = LLMEngine(tiny_llama_artifact, async_scheduling=True)
    plain = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    engine.add_request("plain", PROMPTS[0], plain)
    results = {}
    for _ in range(3):
        for o in engine.step():
            results[o.request_id] = o
    assert engine.core._inflight is not None  # running asynchronously
    engine.add_request("lp", PROMPTS[1], SamplingParams(temperature=0, max_tokens=6, logprobs=2, ignore_eos=True))
    engine.add_request("pen", PROMPTS[2], SamplingParams(temperature=0, max_tokens=6, repetition_penalty=1.3, ignore_eos=True))
    while engine.has_unfinished_requests():
        for o in engine.step():
            results[o.request_id] = o
        assert engine.core._inflight is None or not {"lp", "pen"} & set(engine.output_processor.parents)
    ref = LLM(tiny_llama_artifact, async_scheduling=False)
    expected = ref.generate(
        PROMPTS[:3],
        [plain, SamplingParams(temperature=0, max_tokens=6, logprobs=2, ignore_eos=True),
         SamplingParams(temperature=0, max_tokens=6, repetition_penalty=1.3, ignore_eos=True)],
    )
    assert [results[k].token_ids for k in ("plain", "lp", "pen")] == [o.token_ids for o in expected]
    got_lp, ref_lp = results["lp"].outputs[0].logprobs, expected[1].outputs[0].logprobs
    assert len(got_lp) == 6
    for a, b in zip(got_lp, ref_lp):
        assert a.keys() == b.keys()
        assert all(abs(a[t].logprob - b[t].logprob) < 1e-5 for t in a)
    assert engine.block_pool.num_used_blocks == 0


def test_abort_while_a_step_is_in_flight_frees_everything(tiny_llama_artifact):  # type: ignore[no-untyped-def]
    engine = LLMEngine(tiny_llama_artifact, async_scheduling=True, max_num_seqs=4)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    for i, p in enumerate(PROMPTS[:3]):
        engine.add_request(f"r{i}", p, params)
    for _ in range(4):
        engine.step()
    assert engine.core._inflight is not None
    aborted = engine.abort_request(["r1"])
    assert aborted[0].finished and aborted[0].outputs[0].finish_reason == "abort"
    results = {}
    while engine.has_unfinished_requests():
        for o in engine.step(only_finished=True):
            results[o.request_id] = o
    assert set(results) == {"r0", "r2"}
    ref = LLM(tiny_llama_artifact, async_scheduling=False).generate([PROMPTS[0], PROMPTS[2]], params)
    assert [results["r0"].token_ids, results["r2"].token_ids] == [o.token_ids for o in ref]
    assert engine.block_pool.num_used_blocks == 0


def test_streaming_through_the_async_engine(tiny_llama_artifact):  # type: ignore[no-untyped-def]
    engine = AsyncEngine.from_artifact(tiny_llama_artifact, async_scheduling=True)
    engine.start()
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)

    async def stream(prompt: str) -> list[list[int]]:
        return [list(o.outputs[0].token_ids) async for o in engine.generate(prompt, params)]

    async def main() -> list[list[list[int]]]:
        return await asyncio.gather(*(stream(p) for p in PROMPTS))

    try:
        streams = asyncio.run(main())
        assert engine.stats().num_kv_blocks_used == 0
    finally:
        engine.shutdown()
    ref = LLM(tiny_llama_artifact, async_scheduling=False).generate(PROMPTS, params)
    for chunks, expected in zip(streams, ref):
        assert chunks[-1] == expected.token_ids
        assert all(a == b[: len(a)] for a, b in itertools.pairwise(chunks))  # each output extends the last


@pytest.mark.parametrize("value", [True, False])
def test_the_option_is_explicit(tiny_llama_artifact, value):  # type: ignore[no-untyped-def]
    assert LLMEngine(tiny_llama_artifact, async_scheduling=value).async_scheduling is value
    assert LLMEngine(tiny_llama_artifact).async_scheduling is False  # default: on for GPUs only
