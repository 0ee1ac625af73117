"""Host time of the model runner's batch preparation (pytest-benchmark).

Each engine step turns the scheduled requests into flat tensors before the GPU can start;
at a decode batch of 1,024 this is on the critical path of every step.
"""

from __future__ import annotations

import pytest
import torch

from pagecast.runtime.model_runner import ModelRunner
from pagecast.runtime.request import Request
from pagecast.runtime.sampling_params import SamplingParams
from pagecast.runtime.scheduler import SchedulerOutput

BLOCK = 16


def _decode_batch(num_seqs: int, context: int) -> SchedulerOutput:
    reqs = []
    for i in range(num_seqs):
        r = Request(f"r{i}", list(range(context)), SamplingParams(max_tokens=256))
        r.num_computed_tokens = context - 1
        r.block_ids = list(range(i * (context // BLOCK + 1), (i + 1) * (context // BLOCK + 1)))
        reqs.append(r)
    return SchedulerOutput(reqs, [1] * num_seqs, num_seqs)


@pytest.mark.parametrize("num_seqs", [256, 1024])
def test_prepare_decode_batch(benchmark, num_seqs):  # type: ignore[no-untyped-def]
    runner = ModelRunner(model=None, device=torch.device("cpu"), block_size=BLOCK)
    out = _decode_batch(num_seqs, 640)
    batch = benchmark(runner.prepare, out)
    assert batch.input_ids.shape == (num_seqs,)
    assert batch.ctx.block_tables.shape == (num_seqs, 640 // BLOCK + 1)


def test_prepare_prefill_chunks(benchmark):  # type: ignore[no-untyped-def]
    runner = ModelRunner(model=None, device=torch.device("cpu"), block_size=BLOCK)
    reqs = []
    for i in range(16):
        r = Request(f"p{i}", list(range(512)), SamplingParams(max_tokens=256))
        r.block_ids = list(range(i * 32, (i + 1) * 32))
        reqs.append(r)
    out = SchedulerOutput(reqs, [512] * 16, 8192)
    batch = benchmark(runner.prepare, out)
    assert batch.input_ids.shape == (8192,)
