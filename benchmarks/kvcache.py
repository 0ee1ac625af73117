"""FP8 KV cache against the bf16 KV cache on one GPU, in the same run (issue 10): W1 and W6 of a
Llama-3-8B-shaped engine with random bf16 weights, built twice (--kv-cache-dtype auto and fp8).

Each variant is built with --load-format dummy and a short tune budget (the decode and prefill
attention kernels are tuned first, on caches of the variant's KV dtype), then measured by
benchmarks/serving.py's W1 and W6 phases in a fresh process (one engine holds most of the GPU's
memory), so the figures are exactly the ones serving.py reports.

    python benchmarks/kvcache.py --out OUTDIR [--variants bf16,fp8] [--tune-budget 60] [--split-decodes off|N]

About 7-8 minutes on an H200 with the defaults (two builds of ~1.5 min, two engines of ~2 min).
Artifacts are kept in OUTDIR and reused. Prints a table at the end (fp8 / bf16 ratios and the
issue's targets: W6 >= 24,000 and W1 >= 11,500 output tok/s with the fp8 cache) and one JSON
line per figure (also in OUTDIR/kvcache.jsonl). --split-decodes off|N adds a row per variant,
"VARIANT+split-off" or "VARIANT+splitN": the same artifact measured again with mixed steps not split,
or split from N leading decodes (kernels/ops.py MIN_SPLIT_DECODES, 64 by default). Every row's
figures carry the Triton kernels compiled during them.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import variant_runs

VARIANTS = {"bf16": "auto", "fp8": "fp8"}
TARGETS = {"W1_output_tok_s": 11500.0, "W6_output_tok_s": 24000.0}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("bench-kvcache"))
    ap.add_argument("--variants", default="bf16,fp8")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--tune-budget", type=float, default=60.0)
    ap.add_argument(
        "--split-decodes", default=None, metavar="off|N",
        help="also measure each variant, on the same artifact, with mixed steps not split (off) or their "
             "leading decodes split off to the decode kernel from N of them (kernels/ops.py MIN_SPLIT_DECODES, "
             "64 by default)",
    )  # fmt: skip
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    variants = variant_runs.chosen_variants(args.variants, VARIANTS)
    record = variant_runs.Recorder(args.out, "kvcache.jsonl")
    record.machine()
    results: dict[str, dict[str, object]] = {}
    started = time.perf_counter()
    for variant in variants:
        artifact = variant_runs.build(
            args.out, args.out / f"llama3-8b-kv-{variant}", variant, record, args.max_model_len, args.tune_budget,
            kv_cache_dtype=VARIANTS[variant],
        )
        plan = json.loads((artifact / "memory_plan.json").read_text())
        record(variant=variant, figure="kv_bytes_per_token", value=plan["bytes_per_token"],
               kv_cache_dtype=plan.get("kv_cache_dtype"))  # fmt: skip
        results[variant] = {r["figure"]: r for r in variant_runs.measure(args.out, variant, artifact, {"W1", "W6"}, record)}  # type: ignore[misc]
        if args.split_decodes is not None:
            split_from = None if args.split_decodes == "off" else int(args.split_decodes)
            setup = f"from pagecast.kernels import ops; ops.MIN_SPLIT_DECODES = {split_from}"
            split = f"{variant}+split{'-off' if split_from is None else split_from}"
            results[split] = {r["figure"]: r for r in variant_runs.measure(args.out, split, artifact, {"W1", "W6"}, record, setup)}  # type: ignore[misc]
    record(figure="total_seconds", value=round(time.perf_counter() - started, 1))

    def value(variant: str, figure: str) -> float | None:
        v = results.get(variant, {}).get(figure, {}).get("value")  # type: ignore[union-attr]
        return v if isinstance(v, (int, float)) else None

    print("\n| KV cache | KV tokens | W1 (tok/s) | W1 / bf16 | W6 (tok/s) | W6 / bf16 | W1 >= 11,500 | W6 >= 24,000 |")
    print("|---|---|---|---|---|---|---|---|")
    for variant, figures in results.items():
        init = figures.get("engine_init_seconds", {})
        row = [variant, f"{init.get('kv_tokens', '-'):,}" if isinstance(init.get("kv_tokens"), int) else "-"]
        for figure in ("W1_output_tok_s", "W6_output_tok_s"):
            ours, base = value(variant, figure), value("bf16", figure)
            ratio = ours / base if ours and base else None
            row += [f"{ours:,.0f}" if ours else "-", f"{ratio:.3f}" if ratio else "-"]
            if ratio and variant != "bf16":
                record(variant=variant, figure=f"{figure.split('_')[0]}_ratio_to_bf16_kv", value=round(ratio, 4))
        row += [("yes" if (value(variant, f) or 0) >= t else "no") for f, t in TARGETS.items()]
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
