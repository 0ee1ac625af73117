"""Where a decode step's time goes: host regions and the top device kernels.

    python benchmarks/profile_step.py --artifact ARTIFACT --batch 1024 --context 512 --steps 8

Fills the engine with ``batch`` requests of ``context`` random prompt tokens, runs their prefill,
then times ``steps`` decode steps region by region (schedule, batch preparation + forward + logits
+ sampling, bookkeeping and outputs), and profiles the same steps with torch.profiler to list the
kernels by total device time. Runs on the CPU too (host regions only are meaningful there).
"""

from __future__ import annotations

import argparse
import random
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--artifact", required=True)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--top", type=int, default=15)
    args = ap.parse_args()

    from pagecast.runtime.engine import LLMEngine
    from pagecast.runtime.sampling_params import SamplingParams

    engine = LLMEngine(
        args.artifact,
        max_num_seqs=args.batch,
        max_num_batched_tokens=max(8192, args.batch),
        max_model_len=args.context + 4 * args.steps + 8,
    )
    vocab = engine.vocab_size
    rng = random.Random(0)
    params = SamplingParams(max_tokens=4 * args.steps + 4, ignore_eos=True, temperature=0)
    for i in range(args.batch):
        engine.add_request(f"p{i}", [rng.randrange(10, vocab) for _ in range(args.context)], params)
    while any(r.num_output_tokens == 0 for r in engine.scheduler.running) or engine.scheduler.num_waiting:
        engine.step(only_finished=True)  # prefill everything first
    cuda = torch.cuda.is_available()

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    regions = {"schedule": 0.0, "execute": 0.0, "update": 0.0, "outputs": 0.0}
    for _ in range(2):  # warm-up decode steps
        engine.step(only_finished=True)
    for _ in range(args.steps):
        t0 = time.perf_counter()
        scheduled = engine.scheduler.schedule()
        t1 = time.perf_counter()
        result = engine.runner.execute(scheduled)  # ends with the sampled tokens on the host: synced
        sync()
        t2 = time.perf_counter()
        updated = engine.scheduler.update_from_output(scheduled, result.sampled)
        t3 = time.perf_counter()
        engine.output_processor.process(updated, result.logprobs, result.prompt_logprobs, only_finished=True)
        t4 = time.perf_counter()
        for name, dt in zip(regions, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
            regions[name] += dt
    total = sum(regions.values())
    print(f"decode step, batch {args.batch}, context ~{args.context}: {total / args.steps * 1e3:.2f} ms")
    for name, dt in regions.items():
        print(f"  {name:<9} {dt / args.steps * 1e3:8.3f} ms  {dt / total:6.1%}")

    activities = [torch.profiler.ProfilerActivity.CPU]
    if cuda:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(args.steps):
            engine.step(only_finished=True)
        sync()
    key = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    print(prof.key_averages().table(sort_by=key, row_limit=args.top, max_name_column_width=60))


if __name__ == "__main__":
    main()
