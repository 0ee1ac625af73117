"""Where the time goes: host regions of a decode step, and device time by kernel class.

    python benchmarks/profile_step.py --artifact ARTIFACT --batch 1024 --context 512 --steps 8
    python benchmarks/profile_step.py --artifact ARTIFACT --mode run --batch 1024 --context 512 --output 256

``--sampling`` picks the requests' settings (greedy, the default; sampling; logprobs5;
rep_penalty: benchmarks/sampling.py's rows). ``--mode step`` (default) fills the engine with ``batch`` requests of ``context`` random prompt
tokens, runs their prefill, then times ``steps`` decode steps region by region (schedule, batch
preparation + forward + logits + sampling, bookkeeping, outputs) and profiles the same steps.

``--mode run`` runs a whole workload (``batch`` requests, ``context`` prompt tokens, ``output``
generated tokens each, all submitted at once) twice: once timed without the profiler, once under
torch.profiler. It prints device time per kernel class (GEMM, decode attention, prefill attention,
norms, rotary + KV write, activation, other), the GPU idle time (wall time minus kernel time), and
the GEMMs' achieved TFLOP/s against the matmul FLOPs the workload needs.

Both print the top kernels by device time. Runs on the CPU too (host regions only are meaningful).
"""

from __future__ import annotations

import argparse
import random
import time
from collections import defaultdict

import torch

CLASSES = (
    ("activation quantisation", ("quant_act",)),  # FP8: a launch of its own (the fused ones count as norm / activation)
    ("decode attention", ("paged_decode", "decode_merge")),
    ("prefill attention", ("paged_prefill",)),
    ("rotary + KV write", ("rotary_kv",)),
    ("norm", ("rms_norm",)),
    ("activation", ("silu_and_mul", "act_and_mul")),
    ("gemm", ("gemm", "gemv", "fp8_skinny", "nvjet", "cutlass", "xmma", "cublas", "sm90_", "sm80_")),
)


def kernel_class(name: str) -> str:
    low = name.lower()
    for cls, keys in CLASSES:
        if any(k in low for k in keys):
            return cls
    return "other"


def device_time_by_class(prof: torch.profiler.profile) -> tuple[dict[str, float], list[tuple[str, float, int]]]:
    """Seconds of device time per kernel class, and (name, seconds, calls) per kernel."""
    per_class: dict[str, float] = defaultdict(float)
    per_kernel: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for ev in prof.events():
        if ev.device_type != torch.autograd.DeviceType.CUDA:
            continue
        us = ev.device_time_total if hasattr(ev, "device_time_total") else ev.cuda_time_total
        per_class[kernel_class(ev.name)] += us * 1e-6
        per_kernel[ev.name][0] += us * 1e-6
        per_kernel[ev.name][1] += 1
    kernels = sorted(((n, t, int(c)) for n, (t, c) in per_kernel.items()), key=lambda x: -x[1])
    return dict(per_class), kernels


def matmul_flops_per_token(dims: dict) -> float:
    """2 x the parameters of one token's projections (LM head excluded)."""
    h, i, layers = dims["hidden_size"], dims["intermediate_size"], dims["num_layers"]
    q = dims["num_heads"] * dims["head_dim"]
    kv = dims["num_kv_heads"] * dims["head_dim"]
    per_layer = h * (q + 2 * kv) + q * h + 2 * h * i + i * h
    return 2.0 * per_layer * layers


def print_classes(per_class: dict[str, float], wall: float, steps: int, gemm_flops: float | None) -> None:
    busy = sum(per_class.values())
    print("\n| class | device s | per step ms | share of wall | notes |\n|---|---|---|---|---|")
    for cls in [c for c, _ in CLASSES] + ["other"]:
        t = per_class.get(cls, 0.0)
        note = ""
        if cls == "gemm" and gemm_flops and t:
            note = f"{gemm_flops / t / 1e12:.0f} TFLOP/s achieved"
        print(f"| {cls} | {t:.3f} | {t / steps * 1e3:.3f} | {t / wall:.1%} | {note} |")
    idle = max(0.0, wall - busy)
    print(f"| GPU idle (wall - kernels) | {idle:.3f} | {idle / steps * 1e3:.3f} | {idle / wall:.1%} | |")
    print(f"| wall | {wall:.3f} | {wall / steps * 1e3:.3f} | 100% | {steps} steps |")


def print_top(kernels: list[tuple[str, float, int]], top: int) -> None:
    print("\n| kernel | device s | calls | mean us |\n|---|---|---|---|")
    for name, t, calls in kernels[:top]:
        print(f"| {name[:90]} | {t:.4f} | {calls} | {t / calls * 1e6:.1f} |")


def make_engine(args: argparse.Namespace, max_model_len: int, **options):  # type: ignore[no-untyped-def]
    from pagecast.runtime.engine import LLMEngine

    return LLMEngine(
        args.artifact,
        max_num_seqs=args.batch,
        max_num_batched_tokens=max(args.max_num_batched_tokens, args.batch),
        max_model_len=max_model_len,
        **({"gpu_memory_utilization": 0.92} if torch.cuda.is_available() else {}),
        **options,
    )


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


# --sampling: the requests' settings (benchmarks/sampling.py's rows).
SAMPLING = {
    "greedy": {"temperature": 0.0},
    "sampling": {"temperature": 0.8, "top_p": 0.95, "top_k": 50},
    "logprobs5": {"temperature": 0.8, "top_p": 0.95, "top_k": 50, "logprobs": 5},
    "rep_penalty": {"temperature": 0.8, "top_p": 0.95, "top_k": 50, "repetition_penalty": 1.1},
}
SETTING = "greedy"


def add_requests(engine, n: int, context: int, max_tokens: int, seed: int) -> None:  # type: ignore[no-untyped-def]
    from pagecast.runtime.sampling_params import SamplingParams

    rng = random.Random(seed)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, **SAMPLING[SETTING])
    for i in range(n):
        engine.add_request(f"s{seed}-{i}", [rng.randrange(10, engine.vocab_size) for _ in range(context)], params)


def activities() -> list[torch.profiler.ProfilerActivity]:
    acts = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    return acts


def mode_step(args: argparse.Namespace) -> None:
    # The regions are timed one after the other, so the step must be synchronous (on a GPU the
    # default is asynchronous: the next step's host work would overlap this one's device work).
    engine = make_engine(args, args.context + 4 * args.steps + 8, async_scheduling=False)
    add_requests(engine, args.batch, args.context, 4 * args.steps + 4, 0)
    while any(r.num_output_tokens == 0 for r in engine.scheduler.running) or engine.scheduler.num_waiting:
        engine.step(only_finished=True)  # prefill everything first
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
        logprobs = {rid: [entry] for rid, entry in result.logprobs.items()}
        engine.output_processor.process(updated, logprobs, result.prompt_logprobs, only_finished=True)
        t4 = time.perf_counter()
        for name, dt in zip(regions, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
            regions[name] += dt
    total = sum(regions.values())
    print(f"decode step, batch {args.batch}, context ~{args.context}: {total / args.steps * 1e3:.3f} ms")
    for name, dt in regions.items():
        print(f"  {name:<9} {dt / args.steps * 1e3:8.3f} ms  {dt / total:6.1%}")

    sync()
    t0 = time.perf_counter()
    with torch.profiler.profile(activities=activities()) as prof:
        for _ in range(args.steps):
            engine.step(only_finished=True)
        sync()
    wall = time.perf_counter() - t0
    per_class, kernels = device_time_by_class(prof)
    if per_class:
        print_classes(per_class, wall, args.steps, None)
        print_top(kernels, args.top)
    else:
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top))
    engine.abort_request(list(engine.output_processor.parents))


def mode_run(args: argparse.Namespace) -> None:
    engine = make_engine(args, args.context + args.output + 8)
    dims = engine.artifact.manifest.dims
    add_requests(engine, 8, min(64, args.context), 8, 99)  # warm-up
    while engine.has_unfinished_requests():
        engine.step(only_finished=True)

    def run(seed: int) -> tuple[float, int]:
        add_requests(engine, args.batch, args.context, args.output, seed)
        sync()
        t0 = time.perf_counter()
        steps = 0
        while engine.has_unfinished_requests():
            engine.step(only_finished=True)
            steps += 1
        sync()
        return time.perf_counter() - t0, steps

    wall, steps = run(1)
    out_tokens = args.batch * args.output
    print(f"run: {args.batch} x ({args.context} prompt + {args.output} output): {wall:.2f} s, {steps} steps, "
          f"{out_tokens / wall:.0f} output tok/s")
    with torch.profiler.profile(activities=activities()) as prof:
        wall_p, steps_p = run(2)
    print(f"under the profiler: {wall_p:.2f} s, {steps_p} steps")
    per_class, kernels = device_time_by_class(prof)
    tokens = args.batch * (args.context + args.output - 1)
    flops = tokens * matmul_flops_per_token(dims) + out_tokens * 2.0 * dims["hidden_size"] * dims["vocab_size"]
    # Device times from the profiled run, idle from the unprofiled wall (the profiler slows the host).
    print_classes(per_class, wall, steps, flops)
    print_top(kernels, args.top)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--artifact", required=True)
    ap.add_argument("--mode", choices=("step", "run"), default="step")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--output", type=int, default=256)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--sampling", choices=sorted(SAMPLING), default="greedy", help="the requests' sampling settings")
    args = ap.parse_args()
    global SETTING
    SETTING = args.sampling
    (mode_run if args.mode == "run" else mode_step)(args)


if __name__ == "__main__":
    main()
