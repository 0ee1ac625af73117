"""Every config of the build tuner's space on the tuner's own problem for one kernel and bucket,
timed as the build times them (kernels/tuning.py time_launches: the launches captured in a CUDA graph,
median of the replays), with each config's failure printed instead of skipped. For when a built
table keeps a config the benchmarks say is not the fastest.

    python benchmarks/tuner_problem.py --kernel paged_prefill_attention --buckets t8192,t8192.c32768
        [--model llama3.1-8b] [--max-model-len 131072] [--reps 5]
    python benchmarks/tuner_problem.py --kernel fp8_gemm --fp8 channel-token --buckets qkv.m1,o.m1,gate_up.m1,down.m1
    python benchmarks/tuner_problem.py --model qwen3-30b-a3b --kernel skinny_gemm --buckets o.m1,qkv.m1
    python benchmarks/tuner_problem.py --model qwen3-30b-a3b --kernel moe_router --buckets t1,t4,t16
    python benchmarks/tuner_problem.py --model qwen3-30b-a3b --kernel fused_moe --buckets t1,t2,t4
    python benchmarks/tuner_problem.py --dry-run     # tiny shapes on the CPU interpreter: every config launches once

Shapes (--model): llama3.1-8b (the default: 32 query heads over 8 KV heads, head_dim 128, hidden
4096, intermediate 14336) or qwen3-30b-a3b (32 over 4, head_dim 128, hidden 2048, 128 experts
top-8 of 768, renormalised, weights in bf16), bf16, block size 16. One JSON line per config: time,
TFLOP/s (the problem's FLOPs), GB/s (its bytes), and whether it is the launcher's default.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys

import torch

from pagecast.kernels.interpreter_fix import interpreter_index_fix

LLAMA31_8B = dict(num_heads=32, num_kv_heads=8, head_dim=128, hidden=4096, intermediate=14336, block_size=16)
QWEN3_30B_A3B = dict(
    num_heads=32, num_kv_heads=4, head_dim=128, hidden=2048, intermediate=6144, block_size=16, num_experts=128,
    top_k=8, moe_intermediate=768, moe_renormalize=True, moe_weights_in_x_dtype=True, head_qk_norm=True,
)  # fmt: skip
MODELS = {"llama3.1-8b": LLAMA31_8B, "qwen3-30b-a3b": QWEN3_30B_A3B}
TINY = dict(num_heads=4, num_kv_heads=2, head_dim=16, hidden=64, intermediate=128, block_size=16)
TINY_MOE = dict(TINY, num_experts=8, top_k=2, moe_intermediate=32, moe_renormalize=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kernel", default="paged_prefill_attention")
    ap.add_argument("--buckets", default="t8192,t8192.c32768", help="bucket names of the tuner's (problems.buckets)")
    ap.add_argument("--max-model-len", type=int, default=131072)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--fp8", default="", help="FP8 projections, e.g. channel-token (for --kernel fp8_gemm)")
    ap.add_argument("--model", choices=sorted(MODELS), default="llama3.1-8b")
    ap.add_argument("--dry-run", action="store_true")
    args = ap.parse_args()
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"
        interpreter_index_fix()
    from pagecast.kernels import problems, tuning

    moe = "num_experts" in MODELS[args.model]
    dims_of = dict((TINY_MOE if moe else TINY) if args.dry_run else MODELS[args.model])
    shapes = tuning.ModelShapes(
        **dims_of, dtype="float32" if args.dry_run else "bfloat16",
        max_model_len=9000 if args.dry_run else args.max_model_len, fp8=args.fp8,
    )  # fmt: skip
    device = "cpu" if args.dry_run else "cuda"
    known = dict(problems.buckets(args.kernel, shapes))
    for bucket in args.buckets.split(","):
        if bucket not in known:
            sys.exit(f"{args.kernel} has no bucket {bucket!r} at these shapes; it has {', '.join(known)}")
        dims = known[bucket]
        problem = problems.make_problem(args.kernel, shapes, dims, device, seed=0)
        default = problems.default_config(args.kernel, shapes, dims)
        for cfg in problems.config_space(args.kernel, shapes, dims):
            row = {"kernel": args.kernel, "bucket": bucket, "dims": dims, "config": cfg.as_dict(), "default": cfg == default}
            try:
                if args.dry_run:
                    problem.launch(cfg, 0)
                else:
                    us = tuning.time_launches(functools.partial(problem.launch, cfg), problem.launches_per_sample(), args.reps)
                    row.update(us=round(us, 2), tflops=round(problem.flops / us / 1e6, 1), gb_s=round(problem.bytes / us / 1e3, 1))
            except Exception as exc:  # noqa: BLE001 - the point is to see which configs fail, and why
                row["failed"] = f"{type(exc).__name__}: {str(exc)[:300]}"
                if not args.dry_run:
                    torch.cuda.synchronize()
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
