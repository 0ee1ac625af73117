"""Priority scheduling end to end (EngineOptions.scheduling_policy, engine-serve
--scheduling-policy priority; vLLM's semantics: lower ``priority`` first, then arrival; under the
default first-come-first-served policy only priority 0 is accepted). The scheduler's own rules are
in test_scheduler.py; these check that a request's priority reaches it, through LLMEngine, LLM and
the server's core process, and that a refused priority is a clear error that queues nothing."""

from __future__ import annotations

import threading

import httpx
import openai
import pytest
from server_support import make_engine, serve, wait_for

from pagecast.runtime import LLM, SamplingParams
from pagecast.runtime.engine import LLMEngine
from pagecast.runtime.errors import InvalidRequestError

MODEL = "tiny"
PROMPTS = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [14]]
PRIORITIES = [3, -1, 0, 3]


def _served_order(engine: LLMEngine, priorities: list[int]) -> tuple[list[str], dict[str, list[int]]]:
    """Queue PROMPTS with ``priorities`` before the first step; the order they are first scheduled
    in (max_num_seqs 1: one at a time) and their greedy tokens."""
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    names = [engine.add_request(f"r{i}", p, params, priority=pr) for i, (p, pr) in enumerate(zip(PROMPTS, priorities))]
    order: list[str] = []
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id not in order:
                order.append(out.request_id)
            if out.finished:
                tokens[out.request_id] = list(out.outputs[0].token_ids)
    assert sorted(order) == sorted(names)
    return order, tokens


def test_the_engine_serves_by_priority_then_arrival(tiny_llama_artifact) -> None:  # type: ignore[no-untyped-def]
    fcfs = LLMEngine(tiny_llama_artifact, max_num_seqs=1, max_num_batched_tokens=64)
    fcfs_order, fcfs_tokens = _served_order(fcfs, [0] * len(PROMPTS))
    assert fcfs_order == ["r0", "r1", "r2", "r3"]
    by_priority = LLMEngine(tiny_llama_artifact, max_num_seqs=1, max_num_batched_tokens=64, scheduling_policy="priority")
    order, tokens = _served_order(by_priority, PRIORITIES)
    assert order == ["r1", "r2", "r0", "r3"]  # -1, 0, then the two 3s in arrival order
    assert tokens == fcfs_tokens  # the order a request is served in never changes its tokens


def test_a_priority_under_fcfs_is_refused_and_queues_nothing(tiny_llama_artifact) -> None:  # type: ignore[no-untyped-def]
    llm = LLM(tiny_llama_artifact, max_num_seqs=2)
    with pytest.raises(InvalidRequestError, match="--scheduling-policy priority") as info:
        llm.generate(PROMPTS, SamplingParams(max_tokens=2), priority=[0, 0, 1, 0], use_tqdm=False)
    assert info.value.param == "priority"
    assert not llm.engine.has_unfinished_requests()
    with pytest.raises(ValueError, match="4 prompts but 3 priorities"):
        llm.generate(PROMPTS, SamplingParams(max_tokens=2), priority=[0, 0, 0], use_tqdm=False)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=2), priority=[0] * 4, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [2] * 4


def test_llm_generate_takes_priorities(tiny_llama_artifact) -> None:  # type: ignore[no-untyped-def]
    llm = LLM(tiny_llama_artifact, max_num_seqs=1, scheduling_policy="priority")
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    plain = llm.generate(PROMPTS, params, use_tqdm=False)
    ranked = llm.generate(PROMPTS, params, priority=PRIORITIES, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in ranked] == [o.outputs[0].token_ids for o in plain]  # prompt order kept
    first_scheduled = [o.metrics.first_scheduled_time for o in ranked]
    assert sorted(range(4), key=first_scheduled.__getitem__) == [1, 2, 0, 3]
    with pytest.raises(InvalidRequestError, match="within"):
        llm.generate(PROMPTS[:1], params, priority=[2**63], use_tqdm=False)


@pytest.fixture(scope="module")
def priority_server(tiny_llama_artifact):  # type: ignore[no-untyped-def]
    engine = make_engine(tiny_llama_artifact, max_num_seqs=1, max_model_len=512, scheduling_policy="priority")
    with serve({MODEL: engine}, max_queue=8) as srv:
        yield srv, engine


def test_the_server_serves_waiting_requests_by_priority(priority_server) -> None:  # type: ignore[no-untyped-def]
    srv, engine = priority_server
    client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="none", max_retries=0)
    finished: list[str] = []
    errors: list[BaseException] = []

    def ask(name: str, priority: int) -> None:
        try:
            client.completions.create(model=MODEL, prompt=[5, 6], max_tokens=4, extra_body={"priority": priority})
            finished.append(name)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)

    # One sequence at a time: a long stream holds the slot while two requests queue behind it.
    stream = client.completions.create(
        model=MODEL, prompt=[7, 8], max_tokens=500, stream=True, extra_body={"ignore_eos": True, "priority": 0}
    )
    chunks = iter(stream)
    next(chunks)
    low = threading.Thread(target=ask, args=("low", 5))
    low.start()
    wait_for(lambda: engine.stats().num_waiting == 1, timeout=10)
    high = threading.Thread(target=ask, args=("high", -5))
    high.start()
    wait_for(lambda: engine.stats().num_waiting == 2, timeout=10)
    assert engine.stats().num_running == 1  # both queued while the stream still runs
    for _ in chunks:
        pass
    low.join(60)
    high.join(60)
    assert not errors
    assert finished == ["high", "low"]  # the later arrival first: its priority is higher


def test_the_server_bounds_priority(priority_server) -> None:  # type: ignore[no-untyped-def]
    srv, _ = priority_server
    for value in (10**30, -(10**30)):
        r = httpx.post(f"{srv.url}/v1/completions", json={"model": MODEL, "prompt": "hi", "priority": value}, timeout=30)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "priority"
    r = httpx.post(f"{srv.url}/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2, "priority": -7},
                   timeout=30)  # fmt: skip
    assert r.status_code == 200, r.text
