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


def assert_same_logprobs(got, ref) -> None:  # type: ignore[no-untyped-def]
    """Same positions, same tokens in the same order, same ranks, logprobs within 1e-5."""
    assert (got is None) == (ref is None)
    if ref is None:
        return
    assert len(got) == len(ref)
    for a, b in zip(got, ref):
        if b is None:  # the first prompt position has no logprobs
            assert a is None
            continue
        assert list(a) == list(b)
        for token in a:
            assert a[token].rank == b[token].rank
            assert abs(a[token].logprob - b[token].logprob) < 1e-5
            assert a[token].decoded_token == b[token].decoded_token


def assert_same_outputs(got, ref) -> None:  # type: ignore[no-untyped-def]
    assert len(got) == len(ref)
    for g, r in zip(got, ref):
        assert_same_logprobs(g.prompt_logprobs, r.prompt_logprobs)
        assert len(g.outputs) == len(r.outputs)
        for a, b in zip(g.outputs, r.outputs):
            assert (a.token_ids, a.text, a.finish_reason, a.stop_reason) == (b.token_ids, b.text, b.finish_reason, b.stop_reason)
            assert_same_logprobs(a.logprobs, b.logprobs)
            if b.cumulative_logprob is not None:
                assert abs(a.cumulative_logprob - b.cumulative_logprob) < 1e-4


def test_logprobs_and_penalties_run_asynchronously(tiny_llama_artifact):  # type: ignore[no-untyped-def]
    # A request asking for logprobs or penalties no longer switches the engine to synchronous
    # steps: every step after the first is launched before the previous one is read.
    engine = LLMEngine(tiny_llama_artifact, async_scheduling=True)
    plain = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    lp = SamplingParams(temperature=0, max_tokens=6, logprobs=2, ignore_eos=True)
    pen = SamplingParams(temperature=0, max_tokens=6, repetition_penalty=1.3, ignore_eos=True)
    engine.add_request("plain", PROMPTS[0], plain)
    results = {}
    for _ in range(3):
        for o in engine.step():
            results[o.request_id] = o
    assert engine.core._inflight is not None  # running asynchronously
    engine.add_request("lp", PROMPTS[1], lp)
    engine.add_request("pen", PROMPTS[2], pen)
    while engine.has_unfinished_requests():
        for o in engine.step():
            results[o.request_id] = o
        assert engine.core._inflight is not None or not engine.scheduler.has_unfinished_requests()
    expected = LLM(tiny_llama_artifact, async_scheduling=False).generate(PROMPTS[:3], [plain, lp, pen])
    assert_same_outputs([results[k] for k in ("plain", "lp", "pen")], expected)
    assert len(results["lp"].outputs[0].logprobs) == 6
    assert engine.block_pool.num_used_blocks == 0


# Every sampling feature at once, in one batch with plain requests: the asynchronous engine
# computes penalties, logprobs and prompt logprobs on the device and must give what the
# synchronous engine (the reference, penalties from the host's token lists) gives.
MIXED = [
    SamplingParams(temperature=0, max_tokens=14, logprobs=5, ignore_eos=True),
    SamplingParams(temperature=0.9, top_k=20, top_p=0.9, seed=11, max_tokens=14, logprobs=3,
                   repetition_penalty=1.4, presence_penalty=0.6, frequency_penalty=0.4, ignore_eos=True),
    SamplingParams(temperature=0, max_tokens=8, prompt_logprobs=3, logprobs=0, frequency_penalty=1.5, ignore_eos=True),
    SamplingParams(temperature=1.0, seed=7, n=2, max_tokens=12, presence_penalty=-1.0, logprobs=1, ignore_eos=True),
    SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
    SamplingParams(temperature=1.2, min_p=0.05, seed=3, max_tokens=10, repetition_penalty=0.8, ignore_eos=True),
]


@pytest.mark.parametrize(
    "options",
    [{"max_num_batched_tokens": 32, "max_num_seqs": 4}, {"max_num_batched_tokens": 256, "max_num_seqs": 8}],
    ids=["chunked", "roomy"],
)
def test_every_sampling_feature_matches_the_synchronous_engine(tiny_llama_artifact, options):  # type: ignore[no-untyped-def]
    prompts = (ALL_PROMPTS * 2)[: len(MIXED)]
    sync, got, llm = run_both(tiny_llama_artifact, prompts, MIXED, **options)
    assert_same_outputs(got, sync)
    assert got[2].prompt_logprobs is not None and len(got[2].prompt_logprobs) == len(got[2].prompt_token_ids)
    assert got[3].outputs[0].token_ids != got[3].outputs[1].token_ids  # the n choices have their own streams
    assert llm.engine.block_pool.num_used_blocks == 0
    # Rows of penalty state are held only for finished requests (given back when rows are
    # next needed), never more than the batch needs.
    penalties = llm.engine.runner.penalties
    assert all(r.is_finished for r, _ in penalties.rows.values())
    assert penalties.num_rows <= 8


def test_seeded_penalised_requests_survive_preemption_in_both_modes(tiny_llama_artifact):  # type: ignore[no-untyped-def]
    # Preempted requests recompute their tokens; their penalty rows (output counts) and their
    # seeded noise (keyed by output position) must carry on as if nothing happened.
    from test_paging import llm_block_bytes

    params = [
        SamplingParams(temperature=1.0, seed=i, max_tokens=40, repetition_penalty=1.3, frequency_penalty=0.3,
                       logprobs=2, ignore_eos=True)
        for i in range(4)
    ]
    prompts = ALL_PROMPTS[:4]  # 12 blocks hold fewer than four 50-token sequences
    options = {"kv_cache_memory": 12 * llm_block_bytes(tiny_llama_artifact), "max_model_len": 64, "enable_prefix_caching": False}
    sync, got, llm = run_both(tiny_llama_artifact, prompts, params, **options)
    assert llm.engine.scheduler.num_preemptions > 0
    alone = LLM(tiny_llama_artifact, async_scheduling=False).generate(prompts, params)
    assert_same_outputs(got, sync)
    assert [o.token_ids for o in got] == [o.token_ids for o in alone]
    assert llm.engine.block_pool.num_used_blocks == 0


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
