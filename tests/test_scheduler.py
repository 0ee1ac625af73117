"""Scheduler: token budget, chunked prefill, mixed batches, preemption, FCFS and stops (CPU, no model).

A fake runner stands in for the model: it "samples" for every request whose computed tokens reach
its length after the step, from a dict or from a deterministic function of the request's tokens.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import pytest

from pagecast.runtime.block_pool import BlockPool
from pagecast.runtime.request import Request, RequestStatus
from pagecast.runtime.sampling_params import SamplingParams
from pagecast.runtime.scheduler import Scheduler, SchedulerConfig, SchedulerOutput

EOS = 2


def make_scheduler(
    num_blocks: int = 16,
    block_size: int = 4,
    max_num_seqs: int = 4,
    max_num_batched_tokens: int = 16,
    max_model_len: int = 64,
    enable_prefix_caching: bool = True,
    policy: str = "fcfs",
) -> Scheduler:
    config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        policy=policy,  # type: ignore[arg-type]
    )
    return Scheduler(config, BlockPool(num_blocks, block_size, enable_prefix_caching))


def make_request(request_id: str, prompt: list[int], max_tokens: int = 8, priority: int = 0, **params: Any) -> Request:
    return Request(
        request_id,
        prompt,
        SamplingParams(max_tokens=max_tokens, **params),
        eos_token_ids=frozenset({EOS}),
        priority=priority,
    )


def fake_model(request: Request) -> int:
    """A deterministic next token that depends only on the tokens so far (so a preempted and
    recomputed request must produce the same output), never EOS."""
    return 3 + (sum(request.all_token_ids) * 31 + request.num_tokens) % 50


def step(
    scheduler: Scheduler, sample: Callable[[Request], int] | dict[str, int] = fake_model
) -> tuple[SchedulerOutput, list[Request]]:
    """One engine step: schedule, 'run', sample for requests that reach their length."""
    was_running = set(map(id, scheduler.running))
    output = scheduler.schedule()
    if output.preempted_requests:  # blocks are short: nobody is admitted in this step
        assert all(id(r) in was_running for r in output.scheduled_requests)
        assert not set(map(id, output.scheduled_requests)) & set(map(id, output.preempted_requests))
    assert output.total_num_scheduled_tokens == sum(output.num_scheduled_tokens)
    assert output.total_num_scheduled_tokens <= scheduler.config.max_num_batched_tokens
    assert len(scheduler.running) <= scheduler.config.max_num_seqs
    if isinstance(sample, dict):
        sampled = sample
    else:
        sampled = {
            r.request_id: sample(r)
            for r, n in zip(output.scheduled_requests, output.num_scheduled_tokens)
            if r.num_computed_tokens + n == r.num_tokens
        }
    return output, scheduler.update_from_output(output, sampled)


def ids(requests: list[Request]) -> list[str]:
    return [r.request_id for r in requests]


def test_chunked_prefill_of_a_long_prompt_within_the_budget() -> None:
    sched = make_scheduler(max_num_batched_tokens=8)
    r = make_request("r", list(range(10, 30)))
    sched.add_request(r)
    out, updated = step(sched)
    assert (ids(out.scheduled_requests), out.num_scheduled_tokens) == (["r"], [8])
    assert (r.num_computed_tokens, r.block_ids, updated) == (8, [0, 1], [])
    out, updated = step(sched)
    assert out.num_scheduled_tokens == [8]
    assert (r.num_computed_tokens, r.block_ids, updated) == (16, [0, 1, 2, 3], [])
    out, updated = step(sched)
    assert out.num_scheduled_tokens == [4]
    assert (r.num_computed_tokens, r.block_ids, updated) == (20, [0, 1, 2, 3, 4], [r])
    assert r.num_output_tokens == 1
    out, _ = step(sched)  # now a decode
    assert out.num_scheduled_tokens == [1]
    assert r.block_ids == [0, 1, 2, 3, 4, 5]


def test_a_token_sampled_for_a_partial_prefill_is_ignored() -> None:
    sched = make_scheduler(max_num_batched_tokens=8)
    r = make_request("r", list(range(12)))
    sched.add_request(r)
    _, updated = step(sched, {"r": 99})
    assert updated == [] and r.output_token_ids == []
    assert r.num_computed_tokens == 8


def test_decodes_and_prefill_chunks_share_one_step() -> None:
    sched = make_scheduler(max_num_batched_tokens=8)
    a = make_request("a", [5, 6, 7])
    sched.add_request(a)
    out, _ = step(sched)
    assert out.num_scheduled_tokens == [3]
    b = make_request("b", list(range(40, 52)))
    sched.add_request(b)
    out, updated = step(sched)
    assert (ids(out.scheduled_requests), out.num_scheduled_tokens) == (["a", "b"], [1, 7])
    assert updated == [a]
    out, updated = step(sched)
    assert (ids(out.scheduled_requests), out.num_scheduled_tokens) == (["a", "b"], [1, 5])
    assert updated == [a, b]  # batch order
    assert (a.block_ids, b.block_ids) == ([0, 3], [1, 2, 4])


def test_running_requests_can_use_up_the_budget() -> None:
    sched = make_scheduler(max_num_batched_tokens=8, max_num_seqs=8)
    a = make_request("a", list(range(20)))
    sched.add_request(a)
    sched.add_request(make_request("b", [1, 3]))
    out, _ = step(sched)
    assert ids(out.scheduled_requests) == ["a"]
    assert sched.num_waiting == 1


def test_max_num_seqs_is_respected() -> None:
    sched = make_scheduler(max_num_seqs=2)
    a = make_request("a", [3, 4], max_tokens=1)
    b = make_request("b", [5, 6], max_tokens=3)
    c = make_request("c", [7, 8])
    for r in (a, b, c):
        sched.add_request(r)
    out, updated = step(sched)
    assert ids(out.scheduled_requests) == ["a", "b"]
    assert updated == [a, b] and a.status == RequestStatus.FINISHED_LENGTH
    assert (sched.num_running, sched.num_waiting) == (1, 1)
    out, _ = step(sched)
    assert (ids(out.scheduled_requests), out.num_scheduled_tokens) == (["b", "c"], [1, 2])
    assert out.finished_request_ids == {"a"}


def test_waiting_requests_are_admitted_first_come_first_served() -> None:
    sched = make_scheduler(num_blocks=4)
    a = make_request("a", list(range(8)))
    sched.add_request(a)
    step(sched)
    b = make_request("b", list(range(20, 32)))  # needs 3 blocks
    c = make_request("c", [1, 3])  # needs 1: would fit, but must not overtake b
    sched.add_request(b)
    sched.add_request(c)
    out, _ = step(sched)
    assert ids(out.scheduled_requests) == ["a"]
    assert a.block_ids == [0, 1, 2]
    assert ids(list(sched.waiting)) == ["b", "c"]
    assert sched.block_pool.num_free_blocks == 1


def test_preempts_the_newest_request_and_resumes_it_by_recomputing() -> None:
    sched = make_scheduler(num_blocks=3, enable_prefix_caching=False)
    a = make_request("a", [1, 3, 4, 5], max_tokens=3)
    b = make_request("b", [6, 7, 8, 9, 10, 11])
    c = make_request("c", [12])
    for r in (a, b, c):
        sched.add_request(r)
    out, _ = step(sched)
    assert (a.block_ids, b.block_ids) == ([0], [1, 2])
    assert list(sched.waiting) == [c]  # no block left for it
    b_first_token = b.output_token_ids[0]
    # a needs a second block and none is free: b, the newest, gives up its blocks.
    out, _ = step(sched)
    assert ids(out.scheduled_requests) == ["a"] and out.preempted_requests == [b]
    assert (a.block_ids, b.block_ids) == ([0, 1], [])
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert list(sched.waiting) == [b, c] and sched.running == [a]  # b goes back to the front
    assert sched.num_preemptions == 1 and b.metrics.num_preemptions == 1
    # b needs 2 blocks for its 7 tokens, 1 is free: it waits until a finishes, and c behind it.
    out, updated = step(sched)
    assert ids(out.scheduled_requests) == ["a"] and a.status == RequestStatus.FINISHED_LENGTH
    out, updated = step(sched)
    # Resumed: prompt and its first output token are all computed again, in one chunk.
    assert (ids(out.scheduled_requests), out.num_scheduled_tokens) == (["b", "c"], [7, 1])
    assert (b.block_ids, c.block_ids) == ([0, 1], [2])
    assert updated == [b, c] and b.status == RequestStatus.RUNNING
    assert b.output_token_ids[0] == b_first_token and b.num_output_tokens == 2
    assert b.num_computed_tokens == 7


def test_preempted_request_resumes_from_its_cached_prefix() -> None:
    sched = make_scheduler(num_blocks=4, block_size=2)
    a = make_request("a", [1, 3], max_tokens=3)
    b = make_request("b", [4, 5, 6, 7, 8])
    sched.add_request(a)
    sched.add_request(b)
    step(sched)
    assert (a.block_ids, b.block_ids) == ([0], [1, 2, 3])  # b's blocks 1, 2 are full: cached
    out, _ = step(sched)
    assert out.preempted_requests == [b]
    assert a.block_ids == [0, 3]  # b's uncached last block is reused first
    step(sched)  # a finishes
    out, _ = step(sched)
    # 6 tokens, the first 4 found in the prefix cache.
    assert (ids(out.scheduled_requests), out.num_scheduled_tokens) == (["b"], [2])
    assert b.block_ids[:2] == [1, 2]
    assert b.num_cached_tokens == 0  # the usage number is the first admission's


def test_no_admission_in_a_step_that_preempted() -> None:
    # The victim's freed blocks would fit a small chunk of it again: re-admitting it at once
    # would only thrash.
    sched = make_scheduler(num_blocks=4, block_size=2, max_num_batched_tokens=4, enable_prefix_caching=False)
    r = make_request("r", [5])
    v = make_request("v", [6, 7, 8, 9, 10, 11])
    sched.add_request(r)
    sched.add_request(v)
    step(sched)
    step(sched)
    assert (r.block_ids, v.block_ids) == ([0], [1, 2, 3])
    out, _ = step(sched)
    assert ids(out.scheduled_requests) == ["r"] and out.preempted_requests == [v]
    assert sched.block_pool.num_free_blocks == 2
    out, _ = step(sched)
    assert (ids(out.scheduled_requests), out.num_scheduled_tokens) == (["r", "v"], [1, 3])


def test_a_request_that_preempts_itself_ends_the_step() -> None:
    sched = make_scheduler(num_blocks=2)
    r = make_request("r", list(range(8)))
    sched.add_request(r)
    step(sched)
    out, _ = step(sched)  # needs a third block: there is none, and nobody else to preempt
    assert out.scheduled_requests == [] and out.preempted_requests == [r]
    assert list(sched.waiting) == [r] and sched.running == []
    out, _ = step(sched)
    assert out.is_empty and sched.num_waiting == 1


def test_finish_requests_frees_running_and_waiting_requests() -> None:
    sched = make_scheduler(num_blocks=4, max_num_batched_tokens=8)  # a takes the whole budget
    a = make_request("a", list(range(8)))
    b = make_request("b", list(range(20, 32)))
    sched.add_request(a)
    sched.add_request(b)
    step(sched)
    assert sched.running == [a] and list(sched.waiting) == [b]
    sched.finish_requests(["a", "b", "unknown"], RequestStatus.FINISHED_ABORTED)
    assert a.status == b.status == RequestStatus.FINISHED_ABORTED
    assert a.block_ids == [] and sched.block_pool.num_free_blocks == 4
    assert not sched.has_unfinished_requests()
    assert a.metrics.finished_time is not None
    sched.finish_requests(["a"], RequestStatus.FINISHED_STOPPED)  # already finished: ignored
    assert a.status == RequestStatus.FINISHED_ABORTED
    out = sched.schedule()
    assert out.finished_request_ids == {"a", "b"} and out.is_empty


def test_finish_requests_during_a_step() -> None:
    sched = make_scheduler()
    a = make_request("a", [1, 3, 4])
    b = make_request("b", [5, 6, 7])
    sched.add_request(a)
    sched.add_request(b)
    out = sched.schedule()
    sched.finish_requests("a", RequestStatus.FINISHED_STOPPED)  # a stop string matched
    updated = sched.update_from_output(out, {"a": 9, "b": 9})
    assert updated == [b]
    assert a.output_token_ids == [] and a.block_ids == []
    assert sched.running == [b]


def test_finish_requests_needs_a_finished_status() -> None:
    with pytest.raises(ValueError, match="finished status"):
        make_scheduler().finish_requests(["a"], RequestStatus.RUNNING)


@pytest.mark.parametrize(
    ("params", "tokens", "status", "num_output", "stop_reason"),
    [
        ({}, [5, EOS, 5], RequestStatus.FINISHED_STOPPED, 2, None),
        ({"stop_token_ids": [7]}, [5, 7, 5], RequestStatus.FINISHED_STOPPED, 2, 7),
        ({"max_tokens": 2}, [5, 5, 5], RequestStatus.FINISHED_LENGTH, 2, None),
        ({"ignore_eos": True, "max_tokens": 3}, [EOS, EOS, EOS], RequestStatus.FINISHED_LENGTH, 3, None),
        # min_tokens tokens come before the stopping one (as for a stop string).
        ({"min_tokens": 2, "max_tokens": 4}, [EOS, EOS, EOS, 5], RequestStatus.FINISHED_STOPPED, 3, None),
        ({"max_tokens": 100}, [5] * 5, RequestStatus.FINISHED_LENGTH, 4, None),  # max_model_len 8
    ],
)
def test_stop_conditions(
    params: dict[str, Any],
    tokens: list[int],
    status: RequestStatus,
    num_output: int,
    stop_reason: int | None,
) -> None:
    sched = make_scheduler(max_model_len=8)
    r = make_request("r", [10, 11, 12, 13], **{"max_tokens": 8, **params})
    sched.add_request(r)
    for i, token in enumerate(tokens):
        _, updated = step(sched, {"r": token})
        assert updated == [r]
        if r.is_finished:
            break
        assert i + 1 < num_output, "should have finished"
    assert r.status == status and r.num_output_tokens == num_output
    assert r.stop_reason == stop_reason
    assert sched.running == [] and r.block_ids == []
    assert sched.block_pool.num_free_blocks == sched.block_pool.num_blocks
    assert r.metrics.finished_time is not None


def test_admission_records_cached_tokens_and_times() -> None:
    sched = make_scheduler()
    a = make_request("a", list(range(9)))
    sched.add_request(a)
    step(sched)
    assert a.num_cached_tokens == 0
    assert a.metrics.first_scheduled_time is not None
    assert a.metrics.first_token_time == a.metrics.last_token_time is not None
    b = make_request("b", list(range(9)))
    sched.add_request(b)
    out, _ = step(sched)
    assert (ids(out.scheduled_requests), out.num_scheduled_tokens) == (["a", "b"], [1, 1])
    assert b.num_cached_tokens == b.metrics.num_cached_tokens == 8
    assert b.block_ids[:2] == a.block_ids[:2] == [0, 1]
    assert sched.block_pool.num_prefix_hits == 8


def test_prompt_logprobs_requests_compute_their_whole_prompt() -> None:
    # Positions served from the prefix cache are never run, so their logits (which score the
    # prompt) would be missing: such a request reads no cache until its prompt is scored.
    sched = make_scheduler()
    a = make_request("a", list(range(9)))
    sched.add_request(a)
    step(sched)
    echo = make_request("echo", list(range(9)), prompt_logprobs=0)
    sched.add_request(echo)
    out, _ = step(sched)
    assert out.num_scheduled_tokens == [1, 9]
    assert echo.num_cached_tokens == 0 and echo.block_ids == [3, 4, 5]
    assert sched.block_pool.num_prefix_queries == 9  # a's lookup only


def test_prompt_logprobs_request_resumes_from_the_cache_once_its_prompt_is_scored() -> None:
    sched = make_scheduler(num_blocks=6, max_num_batched_tokens=32)
    a = make_request("a", list(range(100, 108)), max_tokens=5)
    echo = make_request("echo", list(range(9)), prompt_logprobs=0)
    sched.add_request(a)
    sched.add_request(echo)
    step(sched)
    assert echo.prompt_logprobs is not None
    echo.prompt_logprobs.extend([{}] * 8)  # what the runner records: one entry per prompt token
    for _ in range(3):
        step(sched)
    assert (a.block_ids, echo.block_ids) == ([0, 1, 5], [2, 3, 4])
    out, _ = step(sched)  # echo needs a fourth block, none is free: it preempts itself
    assert out.preempted_requests == [echo] and a.is_finished
    out, _ = step(sched)
    # 13 tokens, the first 12 (its own three blocks) found in the cache.
    assert (ids(out.scheduled_requests), out.num_scheduled_tokens) == (["echo"], [1])
    assert echo.block_ids == [2, 3, 4, 5]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_num_seqs": 0}, "max_num_seqs must be a positive integer"),
        ({"max_num_batched_tokens": 2.5}, "max_num_batched_tokens must be a positive integer"),
        ({"max_model_len": True}, "max_model_len must be a positive integer"),
        ({"max_num_seqs": 64, "max_num_batched_tokens": 32}, "raise max_num_batched_tokens"),
    ],
)
def test_config_is_checked(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SchedulerConfig(**kwargs)  # type: ignore[arg-type]


def test_add_request_is_checked() -> None:
    sched = make_scheduler(max_model_len=8)
    sched.add_request(make_request("a", [1]))
    with pytest.raises(ValueError, match="already in use"):
        sched.add_request(make_request("a", [1]))
    with pytest.raises(ValueError, match="empty prompt"):
        sched.add_request(make_request("b", []))
    with pytest.raises(ValueError, match="more than max_model_len"):
        sched.add_request(make_request("c", list(range(9))))


def run_workload(num_blocks: int, seed: int = 0, policy: str = "fcfs") -> tuple[dict[str, list[int]], Scheduler]:
    rng = random.Random(seed)
    sched = make_scheduler(num_blocks=num_blocks, max_num_seqs=6, max_num_batched_tokens=12, policy=policy)
    shared = [rng.randrange(3, 60) for _ in range(8)]  # a common prefix, for cache hits
    pending = [
        make_request(
            f"r{i}",
            (shared if i % 2 else []) + [rng.randrange(3, 60) for _ in range(rng.randrange(1, 13))],
            max_tokens=rng.randrange(1, 10),
            priority=rng.randrange(-3, 4),  # drawn under both policies: the same workload
        )
        for i in range(14)
    ]
    requests = list(pending)
    for _ in range(500):
        if pending and rng.random() < 0.5:
            sched.add_request(pending.pop(0))
        if not pending and not sched.has_unfinished_requests():
            break
        step(sched)
    assert all(r.status == RequestStatus.FINISHED_LENGTH for r in requests)
    assert sched.block_pool.num_free_blocks == num_blocks
    return {r.request_id: r.output_token_ids for r in requests}, sched


def test_tight_pool_preempts_but_produces_the_same_outputs() -> None:
    roomy_outputs, roomy = run_workload(num_blocks=200)
    tight_outputs, tight = run_workload(num_blocks=8)
    assert roomy.num_preemptions == 0
    assert tight.num_preemptions > 0
    assert tight_outputs == roomy_outputs
    assert tight.block_pool.num_prefix_hits > 0


def test_a_128k_prompt_in_8k_chunks_and_a_100k_prefix_hit() -> None:
    """max_model_len 131,072 with 16-token blocks (issue 32): a prompt of all but two tokens of the
    context is prefilled in 16 chunks of up to 8,192 tokens, holding ceil(computed / 16) blocks
    after each, 8,192 at the end; a later prompt sharing its first 100,000 tokens finds them in
    the prefix cache."""
    context, chunk = 131072, 8192
    sched = make_scheduler(
        num_blocks=2 * context // 16, block_size=16, max_num_seqs=2, max_num_batched_tokens=chunk,
        max_model_len=context,
    )  # fmt: skip
    rng = random.Random(0)
    prompt = [rng.randrange(3, 60_000) for _ in range(context - 2)]  # two output tokens fill the context
    a = make_request("a", prompt, max_tokens=2)
    sched.add_request(a)
    chunks = []
    while a.num_output_tokens == 0:
        out, _ = step(sched)
        chunks += out.num_scheduled_tokens
        assert len(a.block_ids) == -(-a.num_computed_tokens // 16)
    assert chunks == [chunk] * 15 + [chunk - 2]
    assert len(a.block_ids) == context // 16 == 8192 and sched.block_pool.num_free_blocks == 8192
    out, _ = step(sched)  # the last token's decode
    assert out.num_scheduled_tokens == [1] and len(a.block_ids) == 0
    assert a.status == RequestStatus.FINISHED_LENGTH and a.num_tokens == context
    assert sched.block_pool.num_free_blocks == sched.block_pool.num_blocks  # its blocks freed

    b = make_request("b", prompt[:100_000] + [rng.randrange(3, 60_000) for _ in range(1000)])
    sched.add_request(b)
    out, _ = step(sched)
    assert out.num_scheduled_tokens == [1000]  # 100,000 / 16 = 6,250 whole blocks from the cache
    assert b.num_cached_tokens == 100_000 and sched.block_pool.num_prefix_hits == 100_000
    assert len(b.block_ids) == -(-101_000 // 16) and b.num_output_tokens == 1


# The "priority" policy (vLLM's --scheduling-policy priority): lower priority values first, then arrival.


def test_priority_policy_admits_by_priority_then_arrival() -> None:
    sched = make_scheduler(max_num_seqs=1, policy="priority")
    requests = [make_request(name, [5, 6], max_tokens=1, priority=p) for name, p in
                [("a", 0), ("b", 5), ("c", -1), ("d", 5), ("e", 0)]]  # fmt: skip
    for r in requests:
        sched.add_request(r)
    assert ids(list(sched.waiting)) == ["c", "a", "e", "b", "d"]
    served = []
    while sched.has_unfinished_requests():
        out, _ = step(sched)
        served += ids(out.scheduled_requests)
    assert served == ["c", "a", "e", "b", "d"]


def test_fcfs_ignores_priority() -> None:
    sched = make_scheduler(policy="fcfs")
    for name, p in [("a", 3), ("b", -3)]:
        sched.add_request(make_request(name, [5, 6], priority=p))
    assert ids(list(sched.waiting)) == ["a", "b"]


@pytest.mark.parametrize("policy, victim", [("fcfs", "hi"), ("priority", "lo")])
def test_preemption_takes_the_newest_or_the_lowest_priority(policy: str, victim: str) -> None:
    sched = make_scheduler(num_blocks=3, enable_prefix_caching=False, policy=policy)
    lo = make_request("lo", [6, 7, 8, 9, 10, 11], priority=9)  # first come, lowest priority
    hi = make_request("hi", [1, 3, 4, 5], max_tokens=3, priority=0)
    sched.add_request(lo)
    sched.add_request(hi)
    out, _ = step(sched)
    assert sorted(ids(out.scheduled_requests)) == ["hi", "lo"]  # 1 + 2 blocks: the pool is full
    # The request holding one block needs a second: one of them gives its blocks up.
    out, _ = step(sched)
    assert ids(out.preempted_requests) == [victim]
    assert ids(out.scheduled_requests) == [{"hi": "lo", "lo": "hi"}[victim]]
    assert ids(list(sched.waiting)) == [victim]


def test_a_preempted_request_goes_back_to_its_place_by_priority() -> None:
    sched = make_scheduler(num_blocks=3, max_num_seqs=2, enable_prefix_caching=False, policy="priority")
    hi = make_request("hi", [1, 3, 4, 5], max_tokens=3, priority=0)
    lo = make_request("lo", [6, 7, 8, 9, 10, 11], priority=9)
    sched.add_request(hi)
    sched.add_request(lo)
    step(sched)
    mid = make_request("mid", [12], priority=5)  # waits: max_num_seqs
    last = make_request("last", [13], priority=20)
    sched.add_request(mid)
    sched.add_request(last)
    out, _ = step(sched)
    assert ids(out.preempted_requests) == ["lo"]
    assert ids(list(sched.waiting)) == ["mid", "lo", "last"]


def test_priority_policy_with_a_tight_pool_produces_the_same_outputs() -> None:
    roomy_outputs, _ = run_workload(num_blocks=200)
    tight_outputs, tight = run_workload(num_blocks=8, policy="priority")
    assert tight.num_preemptions > 0
    assert tight_outputs == roomy_outputs


def test_the_policy_is_checked() -> None:
    with pytest.raises(ValueError, match="policy must be one of fcfs, priority"):
        SchedulerConfig(policy="lifo")  # type: ignore[arg-type]
