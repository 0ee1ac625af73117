"""Fused W4A16 MoE benchmark (issue 27, int4 experts): the fused int4 kernels against the naive
per-expert loop of dense W4A16 GEMMs and against the bf16 fused-MoE kernel, one GPU, at the expert
shapes of Qwen3-30B-A3B (hidden 2048, 128 experts top-8, moe_intermediate 768) and Mixtral-8x7B
(hidden 4096, 8 experts top-2, intermediate 14336), group size 128, bf16 activations.

Inputs and launches are the build tuner's (kernels/problems.py, kernels "fused_moe_w4a16" and
"fused_moe"), timed as it times them (tuning.time_launches: the median of CUDA-graph replays).
For each token count: the naive int4 loop, the int4 kernel at its default config and at the best
config of the tuner's space (each checked against the naive loop first), and the bf16 kernel at
its default config. ``of_copy``: the int4 launch's bytes (visited experts' nibbles, scales, zeros,
the tokens) over copy bandwidth, divided by the time: how close decode comes to streaming weights.

    python benchmarks/moe_w4a16.py [--shapes qwen3-30b-a3b,mixtral-8x7b] [--tokens 1,4,16,64,256,4096]
                                   [--group 128] [--no-sweep] [--out DIR]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
from pathlib import Path

import torch
from moe import SHAPES, rel_err  # benchmarks/moe.py: the same expert shapes

from pagecast.kernels import fused_moe_w4a16, problems, tuning
from pagecast.kernels.tuning import KernelConfig


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--tokens", default="1,4,16,64,256,4096")
    ap.add_argument("--group", type=int, default=128)
    ap.add_argument("--no-sweep", action="store_true")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)

    def record(row: dict[str, object]) -> None:
        print(json.dumps(row), flush=True)
        if args.out:
            with open(args.out / "moe_w4a16.jsonl", "a") as f:
                f.write(json.dumps(row) + "\n")

    copy_gbs = tuning.measure_copy_bandwidth()
    record({"figure": "ceilings", "device": torch.cuda.get_device_name(), "copy_gb_s": round(copy_gbs, 1)})
    table = []
    for name in args.shapes.split(","):
        bf16 = SHAPES[name]
        int4 = dataclasses.replace(bf16, quant_group_size=args.group)
        for t in (int(v) for v in args.tokens.split(",")):
            dims = {"num_tokens": t}
            nbytes, _ = problems.problem_size("fused_moe_w4a16", int4, dims)
            problem = problems.make_problem("fused_moe_w4a16", int4, dims, "cuda")
            launches = problem.launches_per_sample()

            def time_cfg(cfg: KernelConfig | None, p: problems.Problem = problem, n: int = launches) -> float:
                return tuning.time_launches(functools.partial(p.launch, cfg), n, args.reps)

            naive_out = problem.launch(fused_moe_w4a16.NAIVE, 0)
            rows = [("int4_naive", time_cfg(fused_moe_w4a16.NAIVE), fused_moe_w4a16.NAIVE)]
            default = problems.default_config("fused_moe_w4a16", int4, dims)
            candidates = [default]
            if not args.no_sweep:
                candidates += [c for c in problems.config_space("fused_moe_w4a16", int4, dims) if not fused_moe_w4a16.is_naive(c)]
            timed = []
            for cfg in candidates:
                try:
                    err = rel_err(problem.launch(cfg, 0), naive_out)  # type: ignore[arg-type]
                    if err > 1e-2:
                        raise AssertionError(f"relative error {err:.3g} against the naive loop")
                    timed.append((time_cfg(cfg), cfg))
                except Exception as exc:  # noqa: BLE001 - reported, not fatal
                    record({"figure": "config_failed", "shape": name, "tokens": t, "config": cfg.as_dict(),
                            "error": f"{type(exc).__name__}: {str(exc)[:200]}"})  # fmt: skip
                    torch.cuda.synchronize()
            if timed and timed[0][1] is default:
                rows.append(("int4_default", *timed[0]))
            if timed:
                rows.append(("int4_best", *min(timed, key=lambda r: r[0])))
            del problem
            half = problems.make_problem("fused_moe", bf16, dims, "cuda")
            bf16_default = problems.default_config("fused_moe", bf16, dims)
            rows.append(("bf16_default", tuning.time_launches(functools.partial(half.launch, bf16_default),
                                                              half.launches_per_sample(), args.reps), bf16_default))  # fmt: skip
            del half
            torch.cuda.empty_cache()
            naive_us = rows[0][1]
            for variant, us, cfg in rows:
                row = {"figure": "fused_moe_w4a16", "shape": name, "tokens": t, "variant": variant,
                       "time_us": round(us, 2), "speedup_vs_int4_naive": round(naive_us / us, 3),
                       "of_copy": round(nbytes / (copy_gbs * 1e3) / us, 3) if variant.startswith("int4") else None,
                       "config": cfg.as_dict()}  # fmt: skip
                record(row)
                table.append(row)
    print(f"\ncopy {copy_gbs:.0f} GB/s")
    print(f"{'shape':<15}{'tokens':>7} {'variant':<14}{'time us':>10}{'x naive':>9}{'of copy':>9}")
    for r in table:
        frac = f"{r['of_copy']:.3f}" if r["of_copy"] is not None else "-"
        print(f"{r['shape']:<15}{r['tokens']:>7} {r['variant']:<14}{r['time_us']:>10.1f}"
              f"{r['speedup_vs_int4_naive']:>9.2f}{frac:>9}")  # fmt: skip


if __name__ == "__main__":
    main()
