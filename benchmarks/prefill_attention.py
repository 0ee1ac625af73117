"""Paged prefill attention alone at long contexts (issue 32): every candidate tile x launch option of
kernels/paged_prefill_attention.py, timed as benchmarks/long_context.py times "prefill attention
alone", against the bf16 matmul peak measured the same way, in one run of a few minutes.

    python benchmarks/prefill_attention.py [--lengths 8192,32768,131072] [--quick] [--kv bf16|fp8]
        [--keep 6] [--budget 210] [--jsonl FILE] [--only "128x128 w8 s3 HFP;..."]
    python benchmarks/prefill_attention.py --dry-run   # a tiny shape on the CPU interpreter: code paths only

Shape: Llama-3.1-8B (32 query heads over 8 KV heads, head_dim 128), bf16 q, block size 16 (--block-size), one
sequence whose whole prompt is one launch (causal, no cached prefix), its blocks shuffled through
the pool (long_context.kernel_inputs). FLOPs: 4 x heads x head_dim x L(L+1)/2 (QK^T and PV of the
causal half; long_context.attention_flops). Peak: torch bf16 8192^3 matmul, the best of three medians of 20.

Candidates: every tile of the tuner's space (_VARIANTS and _LONG_VARIANTS: BLOCK_M, BLOCK_N, warps,
stages) with the launch options off ("-") and all on ("HFPR"), the default tile with each option
alone ("H": HEAVY_FIRST, "F": FOLD_SCALE, "P": PREFETCH_BLOCKS, "R": LAZY_RESCALE), six likely
tiles with "HFP" (R's effect) and three with "HF" (P's, which is what lets deeper stages buffer
more K/V), so each option's effect reads off the table. Every
candidate runs at the lengths up to 32k; at longer ones only the --keep fastest at the last shorter
length, plus the default, run (fewer repeats there: a 128k launch takes ~0.4 s). Each candidate's
output is compared with the default config's (max abs diff: tiles of another BLOCK_N sum in
another order and FOLD_SCALE rounds once less, so expect bf16-rounding-sized differences).

Timing: one warm-up launch (which compiles), then the median of N launches by CUDA events. A
candidate that cannot launch (shared memory) is reported as skipped; one whose output is not
finite (the output starts as NaN) or differs by more than DIFF_FLAG is marked in the table. Prints a table per length,
fastest first, and one JSON line per row (also to --jsonl).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

# long_context's inputs and counting, so both benchmarks measure the same thing (this script's
# directory is on sys.path when run as a script).
sys.path.insert(0, str(Path(__file__).resolve().parent))
import long_context as lc

# Launch options by letter: H HEAVY_FIRST, F FOLD_SCALE, P PREFETCH_BLOCKS, R LAZY_RESCALE,
# E POLY_EXP2 ("-": none).
LETTERS = {"H": "HEAVY_FIRST", "F": "FOLD_SCALE", "P": "PREFETCH_BLOCKS", "R": "LAZY_RESCALE", "E": "POLY_EXP2"}
QUICK_TILES = [
    (64, 64, 4, 2),
    (64, 64, 4, 3),
    (128, 64, 8, 3),
    (128, 64, 8, 4),
    (128, 128, 8, 2),
    (128, 128, 8, 3),
    (64, 32, 4, 3),
]
# A difference from the default's output past this is flagged in the table (bf16 outputs of ~N(0, 0.1)
# differ by a few 1e-3 between tile shapes, which sum the keys in another order).
DIFF_FLAG = 3e-2
# tiles also run with H and F but not P (P's own effect; it is the one that changes the pipeline)
HF_TILES = [(64, 64, 4, 2), (128, 64, 8, 3), (128, 128, 8, 2)]


def options(letters: str) -> dict[str, int]:
    return {LETTERS[c]: 1 for c in letters if c != "-"}


def candidates(quick: bool, group: int, head_dim: int) -> list[tuple[str, dict]]:
    """(name, config dict) for each candidate; the first is the launcher's default config."""
    from pagecast.kernels import paged_prefill_attention as ppa

    default = ppa.default_config(group, head_dim)
    tiles = QUICK_TILES if quick else list(dict.fromkeys(ppa._VARIANTS + ppa._LONG_VARIANTS + QUICK_TILES))
    d_tile = (default["BLOCK_M"], default["BLOCK_N"], default.num_warps, default.num_stages)
    wanted = [(d_tile, "-")] + [(d_tile, c) for c in LETTERS]
    wanted += [(t, "HF") for t in HF_TILES]
    wanted += [(t, opts) for t in tiles for opts in ("-", "HFPR")]
    wanted += [(t, "HFP") for t in QUICK_TILES]
    wanted += [(t, "HFPE") for t in ppa._POLY_TILES]
    out: dict[str, dict] = {}
    for tile, opts in wanted:
        m, n, w, s = tile
        cfg = ppa.KernelConfig({"BLOCK_M": m, "BLOCK_N": n, **options(opts)}, num_warps=w, num_stages=s)
        if ppa.prune_configs([cfg], group, head_dim):
            out.setdefault(name_of(tile, opts), cfg.as_dict())
    return list(out.items())


def name_of(tile: tuple[int, int, int, int], opts: str) -> str:
    m, n, w, s = tile
    return f"{m}x{n} w{w} s{s} {opts}"


def reps_for(length: int, quick: bool, cuda: bool) -> int:
    if not cuda:
        return 1
    if length > 65536:
        return 2 if quick else 3
    if length > 16384:
        return 5 if quick else 8
    return 10 if quick else 20


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1],
    )  # fmt: skip
    ap.add_argument("--lengths", default="8192,32768,131072", help="prompt lengths (one sequence each)")
    ap.add_argument("--quick", action="store_true", help="fewer tiles and repeats")
    ap.add_argument(
        "--kv", default="bf16", choices=["bf16", "fp8"], help="KV-cache dtype (fp8: e4m3, scale 1)"
    )
    ap.add_argument("--keep", type=int, default=6, help="candidates (besides the default) run past 32k")
    ap.add_argument(
        "--budget", type=float, default=210.0,
        help="seconds: past this, lengths not yet started run the default and the best so far only",
    )  # fmt: skip
    ap.add_argument("--jsonl", type=Path, help="also append the JSON lines here")
    ap.add_argument("--block-size", type=int, default=lc.BLOCK, help="KV-cache block size in tokens")
    ap.add_argument(
        "--only", help="candidate names to run, ';'-separated (e.g. '128x128 w8 s3 HFP'); the default runs too"
    )
    ap.add_argument(
        "--dry-run", action="store_true", help="a tiny shape on the CPU interpreter: measures nothing"
    )
    args = ap.parse_args(argv)

    if args.dry_run:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        lc.interpreter_index_fix()
        cfg = dict(lc.TINY, num_attention_heads=8, num_key_value_heads=2)  # group 4, head_dim 16
        lengths = [40, 100]
        args.kv = "bf16"
    else:
        if not torch.cuda.is_available():
            sys.exit(
                "prefill_attention.py: no CUDA GPU here; use --dry-run to check the code paths on the CPU"
            )
        cfg = lc.LLAMA31_8B
        lengths = sorted(int(v) for v in args.lengths.split(","))
    from pagecast.kernels import paged_prefill_attention as ppa

    run = lc.Run(Path("."), args.dry_run)  # emit() is not used: nothing is written there
    cuda = run.cuda
    t0 = time.perf_counter()
    heads, kv_heads, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    group = heads // kv_heads
    print(
        f"{torch.cuda.get_device_name() if cuda else 'cpu (interpreter)'}, torch {torch.__version__}, "
        f"{heads}/{kv_heads} heads, head_dim {hd}, KV {args.kv}",
        flush=True,
    )
    peak = lc.matmul_peak(run, torch.bfloat16 if cuda else torch.float32)
    print(f"matmul peak {peak / 1e12:.1f} TFLOP/s ({time.perf_counter() - t0:.0f} s)", flush=True)
    cands = candidates(args.quick or args.dry_run, group, hd)
    default_name = cands[0][0]
    if args.only:
        wanted = {name.strip() for name in args.only.split(";")}
        unknown = wanted - {name for name, _ in cands}
        if unknown:
            sys.exit(f"prefill_attention.py: no candidate named {sorted(unknown)}; names look like '128x64 w8 s3 HFP'")
        cands = [c for c in cands if c[0] in wanted or c[0] == default_name]
    rows: list[dict] = []
    lines: list[str] = []

    def emit(row: dict) -> None:
        line = json.dumps(row)
        print(line, flush=True)
        lines.append(line)

    emit({"figure": "matmul_peak_tflops", "value": round(peak / 1e12, 1)})
    previous: list[dict] = []
    prune_above = 32768 if cuda else 64  # the dry run's second length takes the pruned path
    for length in lengths:
        if length > prune_above and previous:
            ranked = [r["name"] for r in sorted(previous, key=lambda r: r["ms"])]
            keep = {default_name, *ranked[: args.keep]}
            if time.perf_counter() - t0 > args.budget:
                keep = {default_name, *ranked[:1]}
            todo = [c for c in cands if c[0] in keep]
        elif time.perf_counter() - t0 > args.budget and previous:
            ranked = [r["name"] for r in sorted(previous, key=lambda r: r["ms"])]
            todo = [c for c in cands if c[0] in {default_name, *ranked[:2]}]
        else:
            todo = cands
        x = lc.kernel_inputs(run, cfg, args.kv, 1, length, length, args.block_size)
        flops = lc.attention_flops(cfg, length)
        reps = reps_for(length, args.quick, cuda)
        baseline = None
        this: list[dict] = []
        for name, c in todo:

            def launch(c=c, x=x):  # type: ignore[no-untyped-def]
                return ppa.paged_prefill_attention(
                    x["q"], x["k_cache"], x["v_cache"], x["block_tables"], x["seq_lens"], x["query_start_loc"],
                    hd**-0.5, config=c, out=x["out"],
                )  # fmt: skip

            t_c = time.perf_counter()
            x["out"].fill_(float("nan"))  # rows a candidate leaves unwritten show as non-finite
            try:
                ms = run.median_ms(launch, reps)
            except Exception as exc:  # noqa: BLE001 - e.g. out of shared memory: it cannot run here
                print(f"  {length} {name}: skipped ({type(exc).__name__}: {str(exc)[:120]})", flush=True)
                if cuda:
                    torch.cuda.synchronize()
                continue
            out = x["out"]
            if baseline is None:  # the default runs first
                baseline = out.clone()
                diff = 0.0
            else:
                diff = (out.float() - baseline.float()).abs().max().item()
            row = {
                "figure": "prefill_attention_candidate", "kv": args.kv, "tokens": length, "name": name,
                "config": c, "ms": round(ms, 4), "tflops": round(flops / (ms / 1000) / 1e12, 1),
                "fraction_of_peak": round(flops / (ms / 1000) / peak, 4), "max_abs_diff_vs_default": diff,
                "finite": bool(torch.isfinite(out).all().item()), "reps": reps,
                "seconds": round(time.perf_counter() - t_c, 1),
            }  # fmt: skip
            emit(row)
            this.append(row)
        del x, baseline
        if cuda:
            torch.cuda.empty_cache()
        rows += this
        previous = this
        print(f"  {length} done at {time.perf_counter() - t0:.0f} s", flush=True)

    print()
    for length in lengths:
        these = sorted((r for r in rows if r["tokens"] == length), key=lambda r: r["ms"])
        if not these:
            continue
        base = next((r for r in these if r["name"] == default_name), None)
        print(f"1 x {length} tokens, KV {args.kv} (default: {default_name})")
        print("| candidate | ms | TFLOP/s | % of peak | vs default | max abs diff |")
        print("|---|---|---|---|---|---|")
        for r in these:
            speed = f"{base['ms'] / r['ms']:.3f}x" if base else "-"
            print(
                f"| {r['name']} | {r['ms']:.3f} | {r['tflops']} | {r['fraction_of_peak']:.1%} | {speed} "
                f"| {r['max_abs_diff_vs_default']:.3g}{'' if r['finite'] else ' NON-FINITE'}"
                f"{' CHECK' if r['max_abs_diff_vs_default'] > DIFF_FLAG else ''} |"
            )
        print()
    for length in lengths:
        these = sorted((r for r in rows if r["tokens"] == length), key=lambda r: r["ms"])
        base = next((r for r in these if r["name"] == default_name), None)
        if these and base:
            best = these[0]
            print(
                f"best at {length}: {best['name']} {best['tflops']} TFLOP/s ({best['fraction_of_peak']:.1%} of peak), "
                f"default {base['tflops']} ({base['fraction_of_peak']:.1%}), {base['ms'] / best['ms']:.3f}x"
            )
    emit({"figure": "total_seconds", "value": round(time.perf_counter() - t0, 1)})
    if args.jsonl:
        with open(args.jsonl, "a") as f:
            f.write("".join(line + "\n" for line in lines))


if __name__ == "__main__":
    main()
