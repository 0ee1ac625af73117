"""The CPU's step budget: left unset, a CPU engine computes at most CPU_MAX_NUM_PREFILL_TOKENS
prompt tokens per step, so a long prompt is prefilled in chunks while the running streams go on
decoding (one token each, every step) instead of waiting for the whole prompt; a GPU engine's
steps are bounded by max_num_batched_tokens alone, as before."""

from __future__ import annotations

import pytest

from pagecast.runtime import SamplingParams
from pagecast.runtime.artifact import DEFAULT_MAX_NUM_SEQS
from pagecast.runtime.block_pool import BlockPool
from pagecast.runtime.engine import LLMEngine
from pagecast.runtime.engine_core import (
    CPU_MAX_NUM_PREFILL_TOKENS,
    CPU_PREFILL_CONTEXT_WEIGHT,
    ONLINE_MAX_NUM_PREFILL_TOKENS,
    EngineOptions,
    default_max_num_prefill_tokens,
)
from pagecast.runtime.request import Request
from pagecast.runtime.scheduler import Scheduler, SchedulerConfig


def test_default_prefill_bound_by_device() -> None:
    assert default_max_num_prefill_tokens("cuda") is None
    assert default_max_num_prefill_tokens("cpu") == CPU_MAX_NUM_PREFILL_TOKENS < EngineOptions().resolved(DEFAULT_MAX_NUM_SEQS).max_num_batched_tokens
    # Serving online on a GPU: a bound that keeps prompts from holding the running streams up.
    assert default_max_num_prefill_tokens("cuda", online=True) == ONLINE_MAX_NUM_PREFILL_TOKENS
    assert ONLINE_MAX_NUM_PREFILL_TOKENS < EngineOptions().resolved(DEFAULT_MAX_NUM_SEQS).max_num_batched_tokens
    assert default_max_num_prefill_tokens("cpu", online=True) == CPU_MAX_NUM_PREFILL_TOKENS
    with pytest.raises(ValueError, match="max_num_prefill_tokens"):
        EngineOptions(max_num_prefill_tokens=0)


def test_prefill_bound_leaves_decodes_alone() -> None:
    """Exact scheduling: 3 decoding requests and 2 prompts; each step decodes all three and
    takes at most 8 prompt tokens; without the bound the prompts go in one step."""

    def run(bound: int | None) -> list[dict[str, int]]:
        sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64,
                                          max_num_prefill_tokens=bound), BlockPool(64, 4))  # fmt: skip
        params = SamplingParams(max_tokens=30, ignore_eos=True)
        for rid in ("d0", "d1", "d2"):
            sched.add_request(Request(rid, [1], params))
        steps = []
        for i in range(6):
            if i == 1:
                sched.add_request(Request("p0", list(range(2, 14)), params))  # 12 prompt tokens
                sched.add_request(Request("p1", list(range(20, 25)), params))  # 5
            out = sched.schedule()
            steps.append({r.request_id: n for r, n in zip(out.scheduled_requests, out.num_scheduled_tokens)})
            sched.update_from_output(out, {r.request_id: 9 for r in out.scheduled_requests})
        return steps

    assert run(8) == [
        {"d0": 1, "d1": 1, "d2": 1},
        {"d0": 1, "d1": 1, "d2": 1, "p0": 8},
        {"d0": 1, "d1": 1, "d2": 1, "p0": 4, "p1": 4},
        {"d0": 1, "d1": 1, "d2": 1, "p0": 1, "p1": 1},
        {"d0": 1, "d1": 1, "d2": 1, "p0": 1, "p1": 1},
        {"d0": 1, "d1": 1, "d2": 1, "p0": 1, "p1": 1},
    ]
    assert run(None)[1] == {"d0": 1, "d1": 1, "d2": 1, "p0": 12, "p1": 5}


def test_a_long_prompt_is_chunked_while_a_stream_decodes(tiny_llama_artifact):  # type: ignore[no-untyped-def]
    engine = LLMEngine(tiny_llama_artifact, kv_cache_memory="16MiB", max_num_seqs=8)
    bound = engine.scheduler.config.max_num_prefill_tokens
    assert bound == CPU_MAX_NUM_PREFILL_TOKENS
    long_len = engine.max_model_len - 8
    assert long_len > bound  # the tiny model's context holds a prompt of several chunks
    steps: list[dict[str, int]] = []
    schedule = engine.scheduler.schedule

    def recording_schedule():  # type: ignore[no-untyped-def]
        out = schedule()
        steps.append({r.request_id: n for r, n in zip(out.scheduled_requests, out.num_scheduled_tokens)})
        return out

    engine.scheduler.schedule = recording_schedule  # type: ignore[method-assign]
    engine.add_request("stream", [5, 6, 7, 8], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    for _ in range(3):  # the stream is decoding
        engine.step()
    engine.add_request("long", [(7 * i) % 4000 + 10 for i in range(long_len)], SamplingParams(max_tokens=2))
    stream = engine.scheduler.requests["stream"]
    tokens_before = len(stream.output_token_ids)
    prefill_steps = []
    while not engine.scheduler.requests["long"].output_token_ids:
        engine.step()
        prefill_steps.append(steps[-1])
    # The prompt took several steps of at most `bound` tokens, fewer the further in (a token after
    # c tokens of context counts as 1 + c * CPU_PREFILL_CONTEXT_WEIGHT of the bound), and the
    # stream got a token in every one of them.
    chunks = [s["long"] for s in prefill_steps]
    assert len(chunks) >= 3 and sum(chunks) == long_len, chunks
    assert chunks[0] == bound and chunks[1] < chunks[0], chunks
    contexts = [sum(chunks[:i]) for i in range(len(chunks))]
    assert all(n * (1 + c * CPU_PREFILL_CONTEXT_WEIGHT) <= bound for n, c in zip(chunks, contexts)), chunks
    assert all(s["stream"] == 1 for s in prefill_steps), prefill_steps
    assert len(stream.output_token_ids) == tokens_before + len(prefill_steps)
    while engine.has_unfinished_requests():
        engine.step()


def test_engine_core_processes_run_online_and_llm_does_not(tiny_llama_artifact) -> None:  # type: ignore[no-untyped-def]
    """Every online engine (engine-serve's, AsyncEngine's) runs in an engine-core process, whose
    options default to online; an explicit option still wins. LLM's engine stays offline."""
    from pagecast.runtime.core_process import core_options

    assert core_options({}).online is True
    assert core_options({"max_num_seqs": 8}).max_num_seqs == 8
    assert core_options({"online": False}).online is False
    assert LLMEngine(tiny_llama_artifact).core.options.online is False


def test_a_cost_bound_takes_fewer_prompt_tokens_further_into_a_prompt() -> None:
    """SchedulerConfig.prefill_context_weight: the bound counts a prompt token after c tokens of
    context as 1 + c * w tokens, for chunks of a running prompt and for a new prompt that starts
    after a cached prefix; decodes are not charged."""
    w, bound = 1 / 64, 32
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=512, max_model_len=512,
                                      max_num_prefill_tokens=bound, prefill_context_weight=w), BlockPool(256, 4))  # fmt: skip
    params = SamplingParams(max_tokens=2, ignore_eos=True)

    def step() -> dict[str, int]:
        out = sched.schedule()
        sched.update_from_output(out, {r.request_id: 9 for r in out.scheduled_requests})
        return {r.request_id: n for r, n in zip(out.scheduled_requests, out.num_scheduled_tokens)}

    sched.add_request(Request("d", [1], SamplingParams(max_tokens=100, ignore_eos=True)))
    step()  # "d" decodes from here on
    prompt = list(range(2, 202))  # 200 tokens
    sched.add_request(Request("p", prompt, params))
    chunks: list[tuple[int, int]] = []  # (context, tokens)
    while sum(n for _, n in chunks) < len(prompt):
        counts = step()
        assert counts["d"] == 1  # the stream decodes every step
        chunks.append((sum(n for _, n in chunks), counts["p"]))
    # Each chunk is the most the bound buys at its context (but the last, which takes the rest).
    for c, n in chunks[:-1]:
        assert n * (1 + c * w) <= bound < (n + 1) * (1 + c * w), chunks
    assert chunks[0] == (0, 32) and chunks[1] == (32, 21), chunks
    while "p" in sched.requests:
        step()
    # A prompt that starts after 200 cached tokens ("p"'s 50 blocks) is charged as one that far
    # in: 32 / (1 + 200 / 64) = 7.8, so 7 of its 12 new tokens in its first step.
    sched.add_request(Request("q", [*prompt, *range(300, 312)], params))
    assert step()["q"] == 7
    # Without the weight the same bound is a plain count of tokens.
    flat = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=512, max_model_len=512,
                                     max_num_prefill_tokens=bound), BlockPool(256, 4))  # fmt: skip
    flat.add_request(Request("p", prompt, params))
    out = flat.schedule()
    flat.update_from_output(out, {})
    assert flat.schedule().num_scheduled_tokens == [32]
