"""Host time of ``ModelRunner.prepare`` for a decode batch that keeps decoding (issue 33).

    python benchmarks/prepare_cost.py                  # 256 x 512 blocks and 64 x 128 blocks
    python benchmarks/prepare_cost.py --shape 1024x64 --steps 100
    python benchmarks/prepare_cost.py --baseline main   # main's prepare, for the before figures

Each request holds ``blocks`` blocks of 16 tokens (its context nearly fills them); every step
each one decodes a token, so one request in 16 crosses into a new block, as in serving. Only
``prepare`` is timed, on the CPU (no model), after a few warm-up steps; the first step (which
writes every request's whole table) is reported on its own. ``--old-expression`` also times the
padded-list construction the runner used before its persistent block tables, alone;
``--baseline REV`` times REV's ``runtime/model_runner.py`` (loaded from git) instead of this one.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
import types

import torch

from pagecast.runtime.model_runner import ModelRunner
from pagecast.runtime.request import Request
from pagecast.runtime.sampling_params import SamplingParams
from pagecast.runtime.scheduler import SchedulerOutput
from pagecast.runtime.transfer import to_device

BLOCK = 16


def decoding_requests(num_seqs: int, blocks: int) -> list[Request]:
    """Requests each one token from the end of its context of about ``blocks`` full blocks."""
    reqs = []
    context = blocks * BLOCK - BLOCK // 2 - 1  # room for half a block of decodes before a new block
    for i in range(num_seqs):
        r = Request(f"r{i}", list(range(context)), SamplingParams(max_tokens=1 << 20))
        r.num_computed_tokens = context - 1
        r.block_ids = list(range(i * (blocks + 64), i * (blocks + 64) + blocks))
        reqs.append(r)
    return reqs


def advance(reqs: list[Request]) -> None:
    """One decoded token each; a block more for those whose last block is full."""
    for r in reqs:
        r.num_computed_tokens += 1
        r.append_output_token(7)
        if len(r.block_ids) * BLOCK < r.num_computed_tokens + 1:
            r.block_ids.append(r.block_ids[-1] + 1)


def baseline_runner(rev: str) -> type:
    """The ModelRunner class of ``rev``'s runtime/model_runner.py."""
    source = subprocess.run(
        ["git", "show", f"{rev}:runtime/model_runner.py"], capture_output=True, text=True, check=True
    ).stdout
    module = types.ModuleType(f"model_runner_{rev}")
    sys.modules[module.__name__] = module  # dataclasses look their module up
    exec(compile(source, f"{rev}:runtime/model_runner.py", "exec"), module.__dict__)  # noqa: S102 (this repo's own code)
    return module.ModelRunner


def measure(num_seqs: int, blocks: int, steps: int, old_expression: bool, baseline: type | None = None) -> None:
    if baseline is not None:
        runner = baseline(None, torch.device("cpu"), BLOCK)
    else:  # sized as the engine sizes it (max_num_seqs, max_model_len), so no step grows its tables
        runner = ModelRunner(None, torch.device("cpu"), BLOCK, max_num_seqs=num_seqs, max_model_len=(blocks + 64) * BLOCK)
    reqs = decoding_requests(num_seqs, blocks)
    out = SchedulerOutput(reqs, [1] * num_seqs, num_seqs)
    t0 = time.perf_counter()
    runner.prepare(out)
    first = time.perf_counter() - t0
    advance(reqs)
    for _ in range(3):
        runner.prepare(out)
        advance(reqs)
    times, old = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        batch = runner.prepare(out)
        times.append(time.perf_counter() - t0)
        if old_expression:
            t0 = time.perf_counter()
            tables = [r.block_ids for r in reqs]
            width = max(len(t) for t in tables)
            padded = to_device([t + [0] * (width - len(t)) for t in tables], torch.device("cpu"), torch.int32)
            old.append(time.perf_counter() - t0)
            assert torch.equal(padded, batch.ctx.block_tables)
        advance(reqs)
    times.sort()
    line = (
        f"{num_seqs:5d} seqs x {blocks:4d} blocks: prepare median {1e3 * times[len(times) // 2]:.3f} ms, "
        f"min {1e3 * times[0]:.3f} ms (first step {1e3 * first:.2f} ms)"
    )
    if old:
        old.sort()
        line += f"; old padded-list tables alone: median {1e3 * old[len(old) // 2]:.3f} ms"
    print(line)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", action="append", help="SEQSxBLOCKS (default: 256x512 and 64x128)")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--old-expression", action="store_true")
    parser.add_argument("--baseline", metavar="REV", help="time REV's ModelRunner.prepare (e.g. main)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    baseline = baseline_runner(args.baseline) if args.baseline else None
    for shape in args.shape or ["256x512", "64x128"]:
        num_seqs, blocks = (int(x) for x in shape.split("x"))
        measure(num_seqs, blocks, args.steps, args.old_expression, baseline)


if __name__ == "__main__":
    main()
