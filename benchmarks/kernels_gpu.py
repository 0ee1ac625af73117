"""The kernel work of one GPU session: ceilings, tuning, baseline, and the K1 table.

    python benchmarks/kernels_gpu.py tune --out DIR [--budget 150]
        copy bandwidth; tune every kernel at Llama-3-8B shapes (DIR/tuning_<gpu>.json);
        bandwidth report (DIR/report.json); torch SDPA on contiguous KV as the K1 baseline
    python benchmarks/kernels_gpu.py summary --k1 k1.json [--report DIR/report.json]
        the K1 table (markdown) from pytest-benchmark's JSON of test_bench_paged_attention.py
    python benchmarks/kernels_gpu.py guess --gpu h100 --sms 132
        a shipped default table from the launchers' heuristics ("tuned": false), for a GPU
        nobody has tuned on yet

The device run (benchmarks/RESULTS.md, section K1) chains: pytest -m gpu
tests/test_kernels_gpu.py; this script's `tune`; the K1 pytest-benchmark suite with
PAGECAST_TUNING pointing at the new table; `summary`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from pagecast.kernels import problems, tuning

LLAMA3_8B = tuning.ModelShapes(
    num_heads=32, num_kv_heads=8, head_dim=128, hidden=4096, intermediate=14336, block_size=16,
    dtype="bfloat16", max_model_len=32768, max_num_seqs=256,
)  # fmt: skip


def log(msg: str) -> None:
    print(msg, flush=True)


def sdpa_baseline(shapes: tuning.ModelShapes, copy_gbs: float) -> list[dict]:
    """torch SDPA (GQA) on contiguous KV for a few K1 shapes: what an unpaged kernel reaches."""
    rows = []
    for batch, ctx in ((64, 2048), (128, 2048), (256, 8192), (1, 32768)):
        h, kvh, d = shapes.num_heads, shapes.num_kv_heads, shapes.head_dim
        q = torch.randn(batch, h, 1, d, device="cuda", dtype=torch.bfloat16)
        kv = torch.randn(2, batch, kvh, ctx, d, device="cuda", dtype=torch.bfloat16)

        def sdpa(i: int, q: torch.Tensor = q, kv: torch.Tensor = kv) -> torch.Tensor:
            return torch.nn.functional.scaled_dot_product_attention(q, kv[0], kv[1], enable_gqa=True)

        try:
            t_us = tuning.time_launches(sdpa, 1, reps=20)
        except Exception as exc:  # noqa: BLE001
            log(f"sdpa {batch}x{ctx}: {type(exc).__name__}: {exc}")
            continue
        nbytes, _ = problems.problem_size(
            "paged_decode_attention", shapes, {"num_seqs": batch, "max_seq_len": ctx}
        )
        gbs = nbytes / (t_us * 1e-6) / 1e9
        rows.append({"case": f"{batch}x{ctx}", "time_us": round(t_us, 2), "gb_s": round(gbs, 1),
                     "fraction_of_copy": round(gbs / copy_gbs, 3)})  # fmt: skip
    torch.cuda.empty_cache()
    return rows


def cmd_tune(args: argparse.Namespace) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = torch.cuda.get_device_name()
    log(f"device {name}, torch {torch.__version__}, sms {tuning.num_sms()}")
    copy_gbs = statistics.median(tuning.measure_copy_bandwidth() for _ in range(3))
    log(f"copy bandwidth {copy_gbs:.0f} GB/s (read + write)")
    t0 = time.monotonic()
    table = tuning.tune(list(tuning.KERNELS), LLAMA3_8B, budget_s=args.budget, log=log)
    table["copy_bandwidth_gbs"] = round(copy_gbs, 1)
    log(f"tuning took {time.monotonic() - t0:.1f} s")
    (out / f"tuning_{tuning.gpu_key(name)}.json").write_text(json.dumps(table, indent=1))
    rows = tuning.bandwidth_report(table, LLAMA3_8B, copy_gbs)
    baseline = sdpa_baseline(LLAMA3_8B, copy_gbs)
    (out / "report.json").write_text(
        json.dumps({"copy_gbs": copy_gbs, "rows": rows, "sdpa": baseline}, indent=1)
    )
    log("\nkernel                   bucket      time_us     GB/s  copy%  TFLOP/s  config")
    for r in rows:
        tf = f"{r['tflop_s']:7.1f}" if r["tflop_s"] else "      -"
        log(
            f"{r['kernel']:24s} {r['bucket']:10s} {r['time_us']:9.2f} {r['gb_s']:8.0f} {r['fraction_of_copy']:6.1%} {tf}  {r['config']}"
        )
    for b in baseline:
        log(
            f"sdpa (contiguous KV)     {b['case']:10s} {b['time_us']:9.2f} {b['gb_s']:8.0f} {b['fraction_of_copy']:6.1%}"
        )


def cmd_summary(args: argparse.Namespace) -> None:
    data = json.loads(Path(args.k1).read_text())
    copy = None
    lines = ["| batch x context | KV + q/out (MiB) | time (us) | GB/s | % of copy | config (BLOCK_N, splits, warps, stages) |",
             "| --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    for bench in data["benchmarks"]:
        e = bench["extra_info"]
        copy = e["copy_gb_s"]
        c = e["config"]
        cfg = (
            f"{c['BLOCK_N']}, {c['num_splits']}, {c['num_warps']}, {c['num_stages']}"
            if isinstance(c, dict)
            else c
        )
        case = bench["name"].split("[")[-1].rstrip("]")
        lines.append(f"| {case} | {e['bytes'] / 2**20:.1f} | {e['time_us']:.1f} | {e['gb_s']:.0f} | "
                     f"{e['fraction_of_copy']:.1%} | {cfg} |")  # fmt: skip
    print(f"copy bandwidth (same session): {copy} GB/s")
    print("\n".join(lines))
    if args.report and Path(args.report).is_file():
        for b in json.loads(Path(args.report).read_text()).get("sdpa", []):
            print(
                f"sdpa contiguous {b['case']}: {b['time_us']} us, {b['gb_s']} GB/s, {b['fraction_of_copy']:.1%}"
            )


def cmd_guess(args: argparse.Namespace) -> None:
    shapes = LLAMA3_8B
    kernels: dict[str, dict] = {}
    for kernel in tuning.KERNELS:
        entries = kernels.setdefault(kernel, {})
        for bucket, dims in problems.buckets(kernel, shapes):
            if kernel == "paged_decode_attention":
                from pagecast.kernels.paged_decode_attention import default_config

                cfg = default_config(dims["num_seqs"], dims["max_seq_len"], shapes.num_kv_heads, args.sms)
            else:
                cfg = problems.default_config(kernel, shapes, dims)
            entries[bucket] = {"config": cfg.as_dict(), "time_us": None, "alternatives": [], "tuned": False}
    table = {
        "kernels": kernels,
        "device": args.gpu,
        "tuned": False,
        "note": "guessed from the launchers' heuristics for Llama-3-8B shapes; not measured on this GPU",
        "shapes": {**shapes.__dict__},
    }
    path = Path(args.out or Path(tuning.__file__).parent / "tuning_defaults" / f"{args.gpu}.json")
    path.write_text(json.dumps(table, indent=1) + "\n")
    print(f"wrote {path}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("tune")
    p.add_argument("--out", required=True)
    p.add_argument("--budget", type=float, default=150.0)
    p.set_defaults(fn=cmd_tune)
    p = sub.add_parser("summary")
    p.add_argument("--k1", required=True)
    p.add_argument("--report")
    p.set_defaults(fn=cmd_summary)
    p = sub.add_parser("guess")
    p.add_argument("--gpu", required=True)
    p.add_argument("--sms", type=int, required=True)
    p.add_argument("--out")
    p.set_defaults(fn=cmd_guess)
    args = parser.parse_args(argv)
    args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
