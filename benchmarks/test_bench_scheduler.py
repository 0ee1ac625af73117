"""Host overhead of the scheduler and block pool per engine step (pytest-benchmark).

Run: ``.venv/bin/pytest benchmarks/test_bench_scheduler.py --benchmark-only -q``. Not part of
``make test`` (testpaths = tests). A GPU decode step at batch 256 takes a few milliseconds, so the
scheduler's share of it must stay well under a millisecond.
"""

from __future__ import annotations

from typing import Any

from pagecast.runtime.block_pool import BlockPool
from pagecast.runtime.request import Request
from pagecast.runtime.sampling_params import SamplingParams
from pagecast.runtime.scheduler import Scheduler, SchedulerConfig

BLOCK_SIZE = 16


def make_request(request_id: str, prompt: list[int], max_tokens: int = 100_000) -> Request:
    return Request(request_id, prompt, SamplingParams(max_tokens=max_tokens), eos_token_ids=frozenset({2}))


def test_scheduler_step_256_decodes(benchmark: Any) -> None:
    """schedule() + update_from_output() with 256 running requests, each ~512 tokens into decode."""
    num_seqs, context = 256, 512
    rounds = 200  # each round adds a token per request: contexts stay between 512 and ~712
    pool = BlockPool(num_blocks=num_seqs * ((context + rounds + 20) // BLOCK_SIZE + 1), block_size=BLOCK_SIZE)
    sched = Scheduler(SchedulerConfig(max_num_seqs=num_seqs, max_num_batched_tokens=8192), pool)
    for i in range(num_seqs):
        sched.add_request(make_request(str(i), [(i * 7 + j) % 30_000 + 3 for j in range(context)]))
    while any(r.num_computed_tokens < r.num_tokens - 1 for r in sched.running) or sched.waiting:
        out = sched.schedule()  # prefill everything first
        sched.update_from_output(out, {r.request_id: 5 for r in out.scheduled_requests})
    sampled = {str(i): 7 for i in range(num_seqs)}

    def step() -> None:
        out = sched.schedule()
        sched.update_from_output(out, sampled)

    benchmark.pedantic(step, rounds=rounds, warmup_rounds=5)
    assert sched.num_running == num_seqs and sched.num_preemptions == 0


def test_block_pool_allocate_free_32_blocks(benchmark: Any) -> None:
    """One allocate + free cycle of a 512-token request (32 blocks)."""
    pool = BlockPool(num_blocks=1024, block_size=BLOCK_SIZE)
    request = make_request("r", list(range(3, 3 + 32 * BLOCK_SIZE)))

    def cycle() -> None:
        pool.allocate_slots(request, request.num_tokens)
        pool.free(request)

    benchmark(cycle)
    assert pool.num_free_blocks == pool.num_blocks


def test_prefix_lookup_2048_tokens(benchmark: Any) -> None:
    """get_computed_blocks() for a 2,048-token prompt whose first 2,032 tokens are cached."""
    pool = BlockPool(num_blocks=1024, block_size=BLOCK_SIZE)
    prompt = [(7 * j) % 30_000 + 3 for j in range(2048)]
    first = make_request("first", prompt)
    pool.allocate_slots(first, first.num_tokens)
    first.num_computed_tokens = first.num_tokens
    pool.cache_full_blocks(first)
    pool.free(first)
    second = make_request("second", prompt)

    blocks, num_cached = benchmark(pool.get_computed_blocks, second)
    assert num_cached == 2048 - BLOCK_SIZE and len(blocks) == 127
