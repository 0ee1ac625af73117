"""How fast this machine's CPU compiles the tuner's kernel configs for sm_90: one after another, in
threads, and in processes (issue 29: an FP8 build's 100 s tuning budget covered 28 of its 96
buckets; the build report's "tuning time by kernel" says how much of it went to first launches,
where Triton compiles).

    python benchmarks/tune_compile.py [--workers 8] [--configs 16]

Compiles --configs distinct variants of the paged decode kernel (benchmarks/decode_ptx.py's
launch at the Llama-3-8B shape: BLOCK_N x warps x stages x cache dtype), no GPU needed, each mode
in a fresh interpreter with an empty Triton cache, and prints one JSON line per mode: seconds in
all, per config, and the speed-up over one at a time. Threads gain only where Triton releases the
GIL (its MLIR passes and LLVM run in C++; ptxas is a subprocess); processes always can.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

VARIANTS = [
    (cache, block_n, warps, stages)
    for cache in ("bf16", "fp16", "fp8", "fp32")
    for block_n in (16, 32, 64)
    for warps, stages in ((4, 2), (4, 3), (8, 2))
]


def compile_one(variant: tuple[str, int, int, int]) -> float:
    sys.path.insert(0, str(HERE))
    import decode_ptx

    cache, block_n, warps, stages = variant
    t = time.perf_counter()
    decode_ptx.compile_variant(cache, block_n, warps, stages, False)
    return time.perf_counter() - t


def run_mode(mode: str, workers: int, count: int) -> float:
    """Seconds to compile the first ``count`` variants in ``mode`` (in this fresh process)."""
    import concurrent.futures as cf
    import multiprocessing

    compile_one(VARIANTS[-1])  # imports and Triton's first-compile set-up, outside the timing
    variants = VARIANTS[:count]
    t = time.perf_counter()
    if mode == "serial":
        for v in variants:
            compile_one(v)
    elif mode == "threads":
        with cf.ThreadPoolExecutor(workers) as pool:
            list(pool.map(compile_one, variants))
    else:
        with cf.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
            list(pool.map(compile_one, [VARIANTS[-1]] * workers))  # start the workers first
            t = time.perf_counter()
            list(pool.map(compile_one, variants))
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", type=int, default=min(8, os.cpu_count() or 1))
    ap.add_argument("--configs", type=int, default=16)
    ap.add_argument("--mode", help=argparse.SUPPRESS)  # internal: one mode, in this process
    args = ap.parse_args()
    count = min(args.configs, len(VARIANTS) - 1)
    if args.mode:
        print(json.dumps({"seconds": run_mode(args.mode, args.workers, count)}))
        return
    serial = None
    for mode in ("serial", "threads", "processes"):
        with tempfile.TemporaryDirectory() as cache:
            env = dict(os.environ, TRITON_CACHE_DIR=cache)
            env.pop("TRITON_INTERPRET", None)
            out = subprocess.run([sys.executable, __file__, "--mode", mode, "--workers", str(args.workers),
                                  "--configs", str(count)], env=env, capture_output=True, text=True, check=True)  # fmt: skip
        seconds = json.loads(out.stdout.strip().splitlines()[-1])["seconds"]
        serial = serial or seconds
        print(json.dumps({"mode": mode, "workers": 1 if mode == "serial" else args.workers, "configs": count,
                          "seconds": round(seconds, 2), "per_config_s": round(seconds / count, 3),
                          "speedup": round(serial / seconds, 2), "cpus": os.cpu_count()}))  # fmt: skip


if __name__ == "__main__":
    main()
