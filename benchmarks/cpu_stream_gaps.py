"""How long a running stream waits between two tokens on the CPU while a long prompt is
prefilled (issue 33: the gap should stay under 3 s on the embedded model): one stream decodes,
then a prompt of --prompt-tokens arrives; every engine step until that prompt has its first
token is one gap of the stream. One torch thread, what engine-serve gives an engine core on a
2-core machine (cores - 1).

    python benchmarks/cpu_stream_gaps.py ARTIFACT                                 # the CPU default bound
    python benchmarks/cpu_stream_gaps.py ARTIFACT --max-num-prefill-tokens 128    # a flat bound, for comparison

Prints the prompt's prefill time and steps, and the gaps' median, p99 and largest (wall) and
the largest step's CPU time (this process's: other processes' load does not count in it).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("artifact")
    ap.add_argument("--prompt-tokens", type=int, default=7800)
    ap.add_argument("--max-num-prefill-tokens", type=int, default=None, help="a flat bound (default: the CPU's own)")
    args = ap.parse_args(argv)

    torch.set_num_threads(1)
    from pagecast.runtime import SamplingParams
    from pagecast.runtime.engine import LLMEngine

    options = {} if args.max_num_prefill_tokens is None else {"max_num_prefill_tokens": args.max_num_prefill_tokens}
    engine = LLMEngine(args.artifact, kv_cache_memory="1GiB", max_num_seqs=8, **options)
    config = engine.scheduler.config
    label = f"bound {config.max_num_prefill_tokens}, context weight {config.prefill_context_weight:.6f}"
    engine.add_request("stream", [5, 6, 7, 8], SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True))
    for _ in range(3):
        engine.step()
    rng = random.Random(0)
    prompt = [rng.randrange(100, 40000) for _ in range(args.prompt_tokens)]
    engine.add_request("long", prompt, SamplingParams(max_tokens=1))
    gaps, cpu = [], []
    start = time.perf_counter()
    while "long" in engine.scheduler.requests:
        wall, used = time.perf_counter(), time.process_time()
        engine.step()
        gaps.append(time.perf_counter() - wall)
        cpu.append(time.process_time() - used)
    total = time.perf_counter() - start
    q = statistics.quantiles(gaps, n=100)
    print(
        f"{label}: prefill of {args.prompt_tokens} tokens {total:.1f} s in {len(gaps)} steps; gaps p50 {q[49]:.2f} "
        f"p99 {q[98]:.2f} max {max(gaps):.2f} s; largest step's CPU {max(cpu):.2f} s",
        flush=True,
    )


if __name__ == "__main__":
    main()
