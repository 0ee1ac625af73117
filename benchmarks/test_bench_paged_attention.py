"""K1: paged decode attention, GQA 32/8, head_dim 128, block 16, bf16 (Llama-3-8B shapes).

Batch x context from 1 x 512 to 256 x 8k, plus 1 x 32k. Each case places the KV in random
blocks of a pool of at least 256 MiB and rotates through several block tables, so the
timed launches read KV from device memory, not from L2. The launches are captured in a
CUDA graph, as the runtime runs decode steps. pytest-benchmark times graph replays
(wall clock, synchronised); extra_info carries the CUDA-event median per launch, the
achieved GB/s (bytes = KV read + q read + out written) and its fraction of the copy
bandwidth measured in the same session.

The config per bucket comes from the tuning table in $PAGECAST_TUNING (a tuning.json), else
the shipped table for this GPU, else the launcher's default.

    pytest benchmarks/test_bench_paged_attention.py --benchmark-json k1.json
"""

from __future__ import annotations

import json
import os

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="K1 needs a CUDA GPU")

from pagecast.kernels import problems, tuning

SHAPES = tuning.ModelShapes(
    num_heads=32, num_kv_heads=8, head_dim=128, hidden=4096, intermediate=14336, block_size=16,
    dtype="bfloat16", max_model_len=32768, max_num_seqs=256,
)  # fmt: skip
CASES = [(b, c) for c in (512, 2048, 8192) for b in (1, 8, 32, 64, 128, 256)] + [(1, 32768)]


@pytest.fixture(scope="module")
def copy_bandwidth_gbs() -> float:
    return tuning.measure_copy_bandwidth()


@pytest.fixture(scope="module")
def table() -> dict | None:
    path = os.environ.get("PAGECAST_TUNING")
    if path:
        with open(path) as f:
            return json.load(f)  # type: ignore[no-any-return]
    return tuning.default_table(torch.cuda.get_device_name())


@pytest.mark.parametrize("batch,context", CASES, ids=[f"{b}x{c}" for b, c in CASES])
def test_k1_paged_decode(benchmark, batch, context, copy_bandwidth_gbs, table):  # type: ignore[no-untyped-def]
    dims = {"num_seqs": batch, "max_seq_len": context}
    config = tuning.KernelConfig.coerce(
        tuning.lookup(table, "paged_decode_attention", tuning.decode_bucket(batch, context))
    )
    problem = problems.make_problem("paged_decode_attention", SHAPES, dims, "cuda", seed=0)
    launches = problem.launches_per_sample()
    nbytes = problem.bytes

    def launch(i: int) -> object:
        return problem.launch(config, i)

    t_us = tuning.time_launches(launch, launches, reps=20)

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(launches):
            launch(i)

    def replay() -> None:
        graph.replay()
        torch.cuda.synchronize()

    benchmark.pedantic(replay, rounds=10, iterations=1, warmup_rounds=2)
    gbs = nbytes / (t_us * 1e-6) / 1e9
    benchmark.extra_info.update(
        {
            "launches_per_round": launches,
            "time_us": round(t_us, 2),
            "bytes": nbytes,
            "gb_s": round(gbs, 1),
            "copy_gb_s": round(copy_bandwidth_gbs, 1),
            "fraction_of_copy": round(gbs / copy_bandwidth_gbs, 3),
            "config": config.as_dict() if config else "launcher default",
        }
    )
    print(f"\nK1 {batch}x{context}: {t_us:.1f} us, {gbs:.0f} GB/s = {gbs / copy_bandwidth_gbs:.1%} of copy")
