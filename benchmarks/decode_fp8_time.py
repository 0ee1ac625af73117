"""Time the paged decode kernel with a bf16 and an fp8 (e4m3) KV cache on one GPU.

    python benchmarks/decode_fp8_time.py [--cases 128x512,256x2048] [--reps 20] [--all] [--json FILE]
                                         [--kernels bf16,fp8-bytes,fp8-words,fp8-pairs]
                                         [--block-size 16] [--more-splits 128,256]

Llama-3-8B decode shapes (32 query heads over 8 KV heads, head_dim 128, KV block size 16 or
--block-size, q bf16). --more-splits adds split counts past the tuner's (MAX_SPLITS) to every
space, for one sequence or a few at long context, where the split count sets the programs.
For each case, four kernels on the same inputs in one process:

  bf16        a bf16 cache
  fp8-bytes   an fp8 cache read as fp8 values (FP8_WORDS=False): the kernel before the fp8 cache
              was read as int32 words (its sm_90 PTX is that kernel's, instruction for
              instruction: benchmarks/decode_ptx.py --fp8-bytes); the launcher still takes this
              path for head_dims that are not a power of two
  fp8-words   an fp8 cache read as int32 words (the launcher's read outside the tuner)
  fp8-pairs   the pair read (config fp8_words 2: V unpacked by token pairs straight into the PV
              dot's operand layout; paged_decode_attention.FP8_PAIR_CONFIGS). Each config's
              output is first compared with the word read's on the same inputs; a config that
              differs is reported and not timed.

The fp8 kernels time the tuner's fp8 space (problems.config_space at the bucket) split by read:
its word and byte configs (fp8-bytes forces the byte path on all of them, fp8-words runs them as
the launcher does) and its pair configs; bf16 the bf16 space. Each config is timed as the tuner
times it (tuning.time_launches: the launches captured in a CUDA graph over rotating block tables
in a pool larger than L2, CUDA events, median of --reps replays); the best config's time is
reported with GB/s (problems.problem_size: K/V read + q read + out written, per launch) and its
fraction of the device-to-device copy bandwidth measured in the same run. --all prints every
config's time.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

import torch

from pagecast.kernels import paged_decode_attention as pda
from pagecast.kernels import problems, tuning

BLOCK_SIZE = 16  # --block-size
MAX_MODEL_LEN = 32768  # raised to the longest --cases context


def shapes(kv_cache_dtype: str | None) -> tuning.ModelShapes:
    return tuning.ModelShapes(
        num_heads=32, num_kv_heads=8, head_dim=128, hidden=4096, intermediate=14336, block_size=BLOCK_SIZE,
        dtype="bfloat16", max_model_len=MAX_MODEL_LEN, max_num_seqs=256, kv_cache_dtype=kv_cache_dtype,
    )  # fmt: skip


def add_splits(splits: list[int]) -> None:
    """Every config space also at these split counts (and MAX_SPLITS raised to the largest)."""
    pda.MAX_SPLITS = max([pda.MAX_SPLITS, *splits])

    def more(space: list[tuning.KernelConfig]) -> list[tuning.KernelConfig]:
        tiles = {tuple(sorted((k, v) for k, v in c.as_dict().items() if k != "num_splits")): c for c in space}
        return space + [
            tuning.KernelConfig({**c.params, "num_splits": n}, num_warps=c.num_warps, num_stages=c.num_stages)
            for c in tiles.values()
            for n in splits
        ]

    pda.CONFIG_SPACE = more(pda.CONFIG_SPACE)
    pda.FP8_CONFIG_SPACE = more(pda.FP8_CONFIG_SPACE)
    pda.FP8_PAIR_CONFIGS = [c for c in pda.FP8_CONFIG_SPACE if c["fp8_words"] == 2]


class _FP8BytePath:
    """Stands in for the jitted decode kernel: each launch with FP8_WORDS=False (the fp8 byte
    read), all else as the launcher passes it."""

    def __init__(self, kernel: Callable) -> None:
        self.kernel = kernel

    def __getitem__(self, grid: tuple[int, ...]) -> Callable:
        launch = self.kernel[grid]
        return lambda *args, **kwargs: launch(*args, **dict(kwargs, FP8_WORDS=False))


@contextmanager
def fp8_byte_path():
    original = pda._paged_decode_kernel
    pda._paged_decode_kernel = _FP8BytePath(original)
    try:
        yield
    finally:
        pda._paged_decode_kernel = original


@contextmanager
def fp8_space(configs: list[tuning.KernelConfig]):
    """The fp8 tuning space replaced by ``configs`` (problems.config_space reads it per call)."""
    original = pda.FP8_CONFIG_SPACE
    pda.FP8_CONFIG_SPACE = configs
    try:
        yield
    finally:
        pda.FP8_CONFIG_SPACE = original


# The word read the pair read's outputs are checked against (a tuner config, GPU-tested).
WORD_READ = tuning.KernelConfig({"BLOCK_N": 64, "num_splits": 1}, num_warps=4, num_stages=2)


def same_as_word_read(problem: problems.Problem, cfg: tuning.KernelConfig) -> float | None:
    """None when cfg's output on input set 0 matches the word read's (bf16 outputs, fp32
    accumulation in both: the tiles and splits change only the order of the sums), else the
    largest difference."""
    ref = problem.launch(WORD_READ, 0).float().clone()  # type: ignore[union-attr]
    out = problem.launch(cfg, 0).float()  # type: ignore[union-attr]
    torch.cuda.synchronize()
    err = (out - ref).abs().max().item()
    ok = bool(torch.isfinite(out).all()) and err <= 1e-2 + 1e-2 * ref.abs().max().item()
    return None if ok else err


def time_case(kv: str, batch: int, context: int, reps: int) -> list[tuple[float, tuning.KernelConfig]]:
    """(microseconds per launch, config) for every config the tuner would time, fastest first
    (fp8-pairs: the pair read's configs, pruned alike; a config whose output differs from the word
    read's is printed and left out)."""
    sh = shapes("float8_e4m3fn" if kv.startswith("fp8") else None)
    dims = {"num_seqs": batch, "max_seq_len": context}
    problem = problems.make_problem("paged_decode_attention", sh, dims, "cuda")
    launches = problem.launches_per_sample()
    results = []
    reads = [c for c in pda.FP8_CONFIG_SPACE if c["fp8_words"] != 2]
    with fp8_space(pda.FP8_PAIR_CONFIGS if kv == "fp8-pairs" else reads):
        space = problems.config_space("paged_decode_attention", sh, dims)
    for cfg in space:
        if kv == "fp8-pairs" and (err := same_as_word_read(problem, cfg)) is not None:
            print(f"{batch}x{context} fp8-pairs {cfg.as_dict()}: WRONG OUTPUT (max difference {err:.3g})")
            continue

        def launch(i: int, cfg: tuning.KernelConfig = cfg, problem: problems.Problem = problem) -> object:
            return problem.launch(cfg, i)

        if kv == "fp8-bytes":
            with fp8_byte_path():
                t_us = tuning.time_launches(launch, launches, reps=reps)
        else:
            t_us = tuning.time_launches(launch, launches, reps=reps)
        results.append((t_us, cfg))
    del problem
    torch.cuda.empty_cache()
    return sorted(results, key=lambda r: r[0])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default="128x512,256x2048", help="batch x context, comma-separated")
    ap.add_argument("--kernels", default="bf16,fp8-bytes,fp8-words,fp8-pairs")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--all", action="store_true", help="print every config's time")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--block-size", type=int, default=16, help="KV-cache block size in tokens")
    ap.add_argument("--more-splits", default="", help="split counts to add to the spaces, e.g. 128,256")
    args = ap.parse_args()
    global BLOCK_SIZE, MAX_MODEL_LEN
    BLOCK_SIZE = args.block_size
    MAX_MODEL_LEN = max([MAX_MODEL_LEN] + [int(c.split("x")[1]) for c in args.cases.split(",")])
    if args.more_splits:
        add_splits([int(n) for n in args.more_splits.split(",")])

    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, sms {tuning.num_sms()}", flush=True)
    copy_gbs = statistics.median(tuning.measure_copy_bandwidth() for _ in range(3))
    print(f"copy bandwidth {copy_gbs:.0f} GB/s (read + write)", flush=True)
    rows = []
    for case in args.cases.split(","):
        batch, context = (int(x) for x in case.split("x"))
        for kv in args.kernels.split(","):
            results = time_case(kv, batch, context, args.reps)
            nbytes, _ = problems.problem_size(
                "paged_decode_attention", shapes("float8_e4m3fn" if kv.startswith("fp8") else None),
                {"num_seqs": batch, "max_seq_len": context},
            )  # fmt: skip
            if not results:
                print(f"{case:>9} {kv:<10} no config gave the word read's output", flush=True)
                rows.append({"case": case, "kernel": kv, "time_us": None, "configs_timed": 0})
                continue
            t_us, cfg = results[0]
            gbs = nbytes / (t_us * 1e-6) / 1e9
            row = {
                "case": case, "kernel": kv, "time_us": round(t_us, 2), "gb_s": round(gbs, 1),
                "fraction_of_copy": round(gbs / copy_gbs, 3), "config": cfg.as_dict(),
                "configs_timed": len(results),
            }  # fmt: skip
            rows.append(row)
            print(
                f"{case:>9} {kv:<10} {t_us:8.1f} us {gbs:7.0f} GB/s ({gbs / copy_gbs:4.0%} of copy)"
                f"  best of {len(results)}: {cfg.as_dict()}",
                flush=True,
            )
            if args.all:
                for t, c in results:
                    print(f"{'':>20} {t:8.1f} us  {c.as_dict()}")
    print("\n| batch x context | " + " | ".join(args.kernels.split(",")) + " |")
    print("|---|" + "---|" * len(args.kernels.split(",")))
    for case in args.cases.split(","):
        cells = [
            f"{r['time_us']:.1f} us, {r['gb_s']:,.0f} GB/s" if r["time_us"] else "failed"
            for r in rows
            if r["case"] == case
        ]
        print(f"| {case} | " + " | ".join(cells) + " |")
    if args.json:
        args.json.write_text(json.dumps({"copy_bandwidth_gbs": round(copy_gbs, 1), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
