"""Steps with prompt tokens, eager against mixed-step CUDA graphs (runtime/cuda_graphs.py,
MixedGraphs), on one engine in one process.

    python benchmarks/mixed_graphs.py --out /tmp/mg [--artifact ART] [--cases 0x0+64,64x512+128] [--steps 60]

A case ``DxC+P`` keeps D requests decoding (C-token prompts, output long enough to last the case)
and adds one new P-token prompt (max_tokens 1) before every step, so each step is D decodes plus
one prompt prefilled whole: the shape of a step while a server streams to D clients and requests
keep arriving. Steps run as the engine runs them (scheduling, batch preparation, forward pass,
sampling, asynchronous scheduling on); the figure is wall time per step over ``--steps`` steps,
after a few warm-up steps. The engine's MixedGraphs object is swapped in and out between phases
(``runner.mixed``), alternating eager and graphs ``--rounds`` times per case, so both sides share
the artifact, the KV cache and the machine's state. A step of more tokens than the largest bucket
(512) runs eagerly either way.

Without --artifact it builds benchmarks/serving.py's Llama-3-8B-shaped dummy artifact in OUT.
One JSON line per figure goes to OUT/mixed_graphs.jsonl.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import torch


def parse_case(text: str) -> tuple[int, int, int]:
    decodes, rest = text.split("x")
    context, prompt = rest.split("+")
    return int(decodes), int(context), int(prompt)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def run_case(engine, case: tuple[int, int, int], steps: int, rounds: int, seed: int) -> dict[str, list[float]]:  # type: ignore[no-untyped-def]
    from pagecast.runtime.sampling_params import SamplingParams

    decodes, context, prompt = case
    runner = engine.runner
    mixed = runner.mixed
    rng = random.Random(seed)
    vocab = engine.vocab_size

    def tokens(n: int) -> list[int]:
        return [rng.randrange(10, vocab) for _ in range(n)]

    per_phase = steps + 4
    # Output enough to outlast the case whatever the prefill took (aborted at its end).
    long = SamplingParams(temperature=0.0, max_tokens=engine.core.max_model_len - context - 8, ignore_eos=True)
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    for i in range(decodes):
        engine.add_request(f"d{seed}-{i}", tokens(context), long)
    while engine.scheduler.num_waiting or any(r.num_output_tokens == 0 for r in engine.scheduler.running):
        engine.step(only_finished=True)  # every decoding request past its prefill
    times: dict[str, list[float]] = {"eager": [], "graphs": []}
    arrivals = 0
    for _ in range(rounds):
        for side in ("eager", "graphs"):
            runner.mixed = mixed if side == "graphs" else None
            for j in range(per_phase):
                if j == 4:  # after four warm-up steps
                    sync()
                    t0 = time.perf_counter()
                engine.add_request(f"p{seed}-{arrivals}", tokens(prompt), one)
                arrivals += 1
                engine.step(only_finished=True)
            sync()
            times[side].append((time.perf_counter() - t0) / steps)
    runner.mixed = mixed
    engine.abort_request([f"d{seed}-{i}" for i in range(decodes)])
    while engine.has_unfinished_requests():
        engine.step(only_finished=True)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("/tmp/pagecast-mixed-graphs"))
    ap.add_argument("--artifact", type=Path, help="default: build the Llama-3-8B-shaped dummy artifact in OUT")
    ap.add_argument("--tune-budget", type=float, default=60.0, help="seconds of kernel tuning when building")
    ap.add_argument(
        "--cases", default="0x0+32,0x0+128,0x0+480,16x512+48,64x512+64,64x512+192,128x512+128,256x512+128,32x2048+480",
        help="comma-separated DxC+P: D decoding requests of C-token prompts, one P-token prompt added a step",
    )
    ap.add_argument("--steps", type=int, default=60, help="timed steps per phase")
    ap.add_argument("--rounds", type=int, default=2, help="eager/graphs alternations per case")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    cases = [parse_case(c) for c in args.cases.split(",")]
    # The decoding requests' context grows through the prefill of all of them and every phase.
    max_context = max(c + d * c // 1024 for d, c, _ in cases) + 2 * args.rounds * (args.steps + 4) + 64
    max_model_len = 1 << (max_context - 1).bit_length()
    artifact = args.artifact
    if artifact is None:
        from serving import build  # benchmarks/serving.py, beside this file

        artifact = args.out / "llama3-8b-dummy"
        build(args.out, artifact, max(max_model_len, 8192), args.tune_budget)

    from pagecast.runtime.engine import LLMEngine

    max_seqs = max(d for d, _, _ in cases) + 8
    t0 = time.perf_counter()
    engine = LLMEngine(
        str(artifact), max_num_seqs=max_seqs, max_num_batched_tokens=max(1024, max_seqs), max_model_len=max_model_len,
        mixed_graphs=True, gpu_memory_utilization=0.9,
    )  # fmt: skip
    start_s = time.perf_counter() - t0
    if engine.runner.mixed is None:
        raise SystemExit("the engine has no mixed-step graphs (needs a GPU and a dense artifact built by this version)")
    timings = engine.runner.mixed.timings
    print(f"engine ready in {start_s:.1f} s; mixed graphs: warm-up {timings['warm_up_forwards']:.2f} s, "
          f"capture {timings['captures']:.2f} s")  # fmt: skip
    rows = []
    with open(args.out / "mixed_graphs.jsonl", "a") as log:
        log.write(json.dumps({"figure": "mixed_graphs_capture", **{k: round(v, 3) for k, v in timings.items()}}) + "\n")
        for i, case in enumerate(cases):
            times = run_case(engine, case, args.steps, args.rounds, seed=i)
            eager, graphs = statistics.median(times["eager"]), statistics.median(times["graphs"])
            row = {
                "figure": "mixed_step_ms", "case": "{}x{}+{}".format(*case), "tokens": case[0] + case[2],
                "eager_ms": round(eager * 1e3, 3), "graphs_ms": round(graphs * 1e3, 3),
                "ratio": round(graphs / eager, 3), "eager_rounds_ms": [round(t * 1e3, 3) for t in times["eager"]],
                "graphs_rounds_ms": [round(t * 1e3, 3) for t in times["graphs"]],
            }  # fmt: skip
            log.write(json.dumps(row) + "\n")
            log.flush()
            rows.append(row)
            print(json.dumps(row), flush=True)
    print("\n| case (decodes x context + prompt) | tokens a step | eager ms/step | graphs ms/step | graphs / eager |")
    print("| --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['case']} | {r['tokens']} | {r['eager_ms']:.2f} | {r['graphs_ms']:.2f} | {r['ratio']:.3f} |")


if __name__ == "__main__":
    main()
