"""The persistent block tables (runtime/input_batch.py): every step's gathered table equals the
padded lists the runner used to build, whatever requests come, grow, are preempted and resumed,
finish or are aborted; rows are recycled; capacity errors say what is wrong."""

from __future__ import annotations

import random

import pytest
import torch

from pagecast.runtime.input_batch import BlockTables
from pagecast.runtime.model_runner import ModelRunner
from pagecast.runtime.request import Request, RequestStatus
from pagecast.runtime.sampling_params import SamplingParams
from pagecast.runtime.scheduler import SchedulerOutput

CPU = torch.device("cpu")


def padded(requests: list[Request], width: int) -> torch.Tensor:
    return torch.tensor([r.block_ids + [0] * (width - len(r.block_ids)) for r in requests], dtype=torch.int32)


def running(request_id: str, blocks: list[int]) -> Request:
    r = Request(request_id, [1, 2, 3], SamplingParams(max_tokens=8))
    r.status = RequestStatus.RUNNING
    r.block_ids = list(blocks)
    return r


def step(tables: BlockTables, requests: list[Request]) -> torch.Tensor:
    width = max([1] + [len(r.block_ids) for r in requests])
    return tables.gather(tables.rows(requests), width)


@pytest.mark.parametrize("seed", range(6))
def test_random_lifecycles_match_padded_lists(seed: int) -> None:
    rng = random.Random(seed)
    # Small initial capacity, so rows and columns grow on the way; some releases go unreported.
    tables = BlockTables(CPU, num_rows=2, num_cols=2)
    live: list[Request] = []  # running
    preempted: list[Request] = []
    next_id = 0
    next_block = 1
    peak = 1  # the most requests running at once
    for _ in range(300):
        released: list[str] = []
        for _ in range(rng.randint(0, 3)):
            op = rng.random()
            if op < 0.3 or not live:  # admit: a fresh id, or the id of one that finished
                rid = f"r{next_id}" if rng.random() < 0.8 or next_id == 0 else f"r{rng.randrange(next_id)}"
                if any(r.request_id == rid for r in live + preempted):
                    rid = f"r{next_id}"
                next_id += 1
                n = rng.randint(0, 12)
                live.append(running(rid, range(next_block, next_block + n)))
                next_block += n
            elif op < 0.45:  # preempt: blocks freed (the list replaced), back later with others
                r = live.pop(rng.randrange(len(live)))
                r.block_ids, r.status = [], RequestStatus.PREEMPTED
                preempted.append(r)
                if rng.random() < 0.8:
                    released.append(r.request_id)
            elif op < 0.6:  # finish or abort
                r = live.pop(rng.randrange(len(live)))
                r.block_ids = []
                r.status = rng.choice([RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_ABORTED])
                if rng.random() < 0.8:
                    released.append(r.request_id)
            elif op < 0.65:  # shrunk in place (not what the block pool does, but handled)
                r = rng.choice(live)
                del r.block_ids[rng.randint(0, len(r.block_ids)) :]
        if preempted and rng.random() < 0.3:  # resume, with new blocks
            r = preempted.pop(0)
            n = rng.randint(1, 12)
            r.block_ids, r.status = list(range(next_block, next_block + n)), RequestStatus.RUNNING
            next_block += n
            live.append(r)
        for r in live:  # decodes and prefill chunks: blocks appended in place
            if rng.random() < 0.3:
                n = rng.randint(1, 5)
                r.block_ids.extend(range(next_block, next_block + n))
                next_block += n
        tables.release(released)
        scheduled = rng.sample(live, rng.randint(1, len(live))) if live else []
        if not scheduled:
            continue
        got = step(tables, scheduled)
        width = max([1] + [len(r.block_ids) for r in scheduled])
        assert torch.equal(got, padded(scheduled, width))
        peak = max(peak, len(live))
    # Rows of requests no longer running are reclaimed before the table grows.
    assert tables.table.shape[0] <= 2 * peak


def test_decode_rows_repeat_a_requests_row() -> None:
    tables = BlockTables(CPU)
    a, b = running("a", [5, 6, 7]), running("b", [9])
    ra, rb = tables.rows([a, b])
    got = tables.gather([ra, ra, ra, rb, rb], 3)
    assert torch.equal(got, padded([a, a, a, b, b], 3))


def test_rows_are_recycled() -> None:
    tables = BlockTables(CPU, num_rows=4, num_cols=4)
    for i in range(100):
        r = running(f"r{i}", [i + 1] * (i % 4 + 1))
        assert torch.equal(step(tables, [r]), padded([r], len(r.block_ids)))
        tables.release([r.request_id])
    assert tables.table.shape == (4, 4)
    assert tables.num_used_rows == 0


def test_a_recycled_row_is_zero_past_its_blocks() -> None:
    tables = BlockTables(CPU, num_rows=1, num_cols=8)
    long = running("long", range(1, 9))
    step(tables, [long])
    tables.release(["long"])
    short, other = running("short", [3]), running("other", range(10, 18))
    assert torch.equal(step(tables, [short, other]), padded([short, other], 8))


def test_unreported_finished_rows_are_reclaimed_before_growing() -> None:
    tables = BlockTables(CPU, num_rows=2, num_cols=4)
    a, b = running("a", [1]), running("b", [2])
    step(tables, [a, b])
    a.status = RequestStatus.FINISHED_ABORTED  # never reported through release()
    c = running("c", [3, 4])
    assert torch.equal(step(tables, [b, c]), padded([b, c], 2))
    assert tables.table.shape[0] == 2


def test_a_gathered_table_is_not_changed_by_later_steps() -> None:
    tables = BlockTables(CPU)
    a = running("a", [1, 2])
    first = step(tables, [a])
    a.block_ids.append(3)
    tables.release(["a"])
    step(tables, [running("b", [7, 8, 9])])
    assert first.tolist() == [[1, 2]]


def test_capacity_errors() -> None:
    tables = BlockTables(CPU, num_rows=1, num_cols=2, max_rows=2, max_cols=4)
    with pytest.raises(ValueError, match=r"holds 5 blocks, more than the block tables' max_cols \(4"):
        tables.rows([running("wide", range(1, 6))])
    tables = BlockTables(CPU, num_rows=1, num_cols=2, max_rows=2, max_cols=4)
    with pytest.raises(RuntimeError, match=r"block tables are full: 2 running requests hold rows \(max_rows 2\)"):
        tables.rows([running(f"r{i}", [i + 1]) for i in range(3)])


def test_prepare_block_tables_match_padded_lists() -> None:
    """The runner's step tables (a mixed step, then a decode step verifying drafts laid out one
    row per position), across steps that add blocks, preempt and finish."""
    bs = 4
    runner = ModelRunner(model=None, device=CPU, block_size=bs, max_num_seqs=2, max_model_len=32)

    def req(rid: str, num_tokens: int) -> Request:
        r = Request(rid, list(range(num_tokens)), SamplingParams(max_tokens=64))
        r.status = RequestStatus.RUNNING
        r.block_ids = list(range(100 * len(rid) + num_tokens, 100 * len(rid) + num_tokens + -(-num_tokens // bs)))
        return r

    a, b, c = req("a", 9), req("bb", 3), req("ccc", 14)
    a.num_computed_tokens, c.num_computed_tokens = 8, 13
    batch = runner.prepare(SchedulerOutput([a, b, c], [1, 3, 1], 5))
    assert torch.equal(batch.ctx.block_tables, padded([a, b, c], 4))
    # b finished; a verifies two drafts (one row per position), c decodes into a new block.
    b.status, b.block_ids = RequestStatus.FINISHED_STOPPED, []
    a.block_ids.append(999)
    c.all_token_ids.append(5)
    c.num_computed_tokens = 14
    c.block_ids.append(998)
    out = SchedulerOutput([a, c], [3, 1], 4, finished_request_ids={"bb"}, spec_token_ids={"a": [1, 2]})
    runner.forget(out)  # as the engine does for every schedule
    batch = runner.prepare(out)
    assert torch.equal(batch.ctx.block_tables, padded([a, a, a, c], 5))
    # c preempted; a resumed elsewhere after its own preemption.
    a.block_ids = [7, 8, 9]
    a.num_computed_tokens = 8
    out = SchedulerOutput([a], [1], 1, preempted_requests=[c])
    runner.forget(out)
    batch = runner.prepare(out)
    assert torch.equal(batch.ctx.block_tables, padded([a], 3))
    assert runner.block_tables.num_used_rows == 1


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_the_engine_gives_rows_back(tiny_llama_artifact, async_scheduling):  # type: ignore[no-untyped-def]
    """Preemptions (12 blocks for six ~40-token sequences), an abort and finishes: the table never
    outgrows max_num_seqs, and a step with nothing to run drops what the last one left."""
    import json

    from engine_utils import PROMPTS

    from pagecast.runtime.engine import LLMEngine

    block_bytes = json.loads((tiny_llama_artifact / "memory_plan.json").read_text())["bytes_per_block"]
    engine = LLMEngine(
        tiny_llama_artifact,
        async_scheduling=async_scheduling,
        kv_cache_memory=12 * block_bytes,
        max_model_len=64,
        max_num_seqs=4,
        enable_prefix_caching=False,
    )
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, repetition_penalty=1.2)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt, params)
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
        if steps == 6:
            engine.abort_request(["r1"])
        assert engine.runner.block_tables.table.shape[0] == 4
    assert engine.scheduler.num_preemptions > 0
    engine.step()  # nothing to run: the last finished ids are reported, and forgotten
    assert engine.runner.block_tables.num_used_rows == 0
    assert not engine.runner.penalties.rows
