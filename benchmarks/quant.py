"""int4 against bf16 on one GPU, in the same run (issue 10): W4 inter-token latency and W1 throughput
of a Llama-3-8B-shaped engine with random weights, for bf16, AWQ-G128 and GPTQ-G128.

Each variant is built with --load-format dummy (``--quant awq|gptq`` gives random int4 weights
of group size 128, tuned on this GPU: the W4A16 GEMM per projection and row bucket against
dequantize + cuBLAS, with the bf16 cuBLAS time in report.md), then measured by
benchmarks/serving.py's W4 and W1 phases in a fresh process (one engine holds most of the GPU's
memory), so the figures are exactly the ones serving.py reports for bf16.

    python benchmarks/quant.py --out OUTDIR [--variants bf16,awq,gptq] [--tune-budget 240] [--phases W4,W1]
                               [--unfused-silu-down-too]

Artifacts are kept in OUTDIR and reused, so the variants can also be run one command at a time.
Prints a table at the end (with int4 / bf16 ratios against the issue's targets: W4 <= 0.45x,
W1 >= 0.9x) and one JSON line per figure (also in OUTDIR/quant.jsonl). The int4 engines fold
silu_and_mul into the down projection's decode kernel (kernels/ops.py FUSE_SILU_DOWN, the default);
--unfused-silu-down-too adds a row per int4 variant, "VARIANT-unfused-silu": the same artifact
measured again with FUSE_SILU_DOWN = False (the activation kernel, then the projection).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import variant_runs

VARIANTS = {"bf16": None, "awq": "awq", "gptq": "gptq"}


def weight_bytes(artifact: Path) -> int:
    return sum(f.stat().st_size for f in (artifact / "weights").glob("*.safetensors"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("bench-quant"))
    ap.add_argument("--variants", default="bf16,awq,gptq")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--tune-budget", type=float, default=240.0)
    ap.add_argument("--phases", default="W4,W1", help="serving.py phases to measure per variant")
    ap.add_argument("--unfused-silu-down-too", action="store_true",
                    help="also measure each int4 variant with kernels/ops.py FUSE_SILU_DOWN = False, same artifact")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    variants = variant_runs.chosen_variants(args.variants, VARIANTS)
    record = variant_runs.Recorder(args.out, "quant.jsonl")
    record.machine()
    results: dict[str, dict[str, object]] = {}
    for variant in variants:
        artifact = variant_runs.build(
            args.out, args.out / f"llama3-8b-{variant}", variant, record, args.max_model_len, args.tune_budget,
            quant=VARIANTS[variant],
        )
        record(variant=variant, figure="weight_bytes", value=weight_bytes(artifact))
        phases = set(args.phases.split(","))
        results[variant] = {r["figure"]: r["value"] for r in variant_runs.measure(args.out, variant, artifact, phases, record)}  # type: ignore[misc]
        if args.unfused_silu_down_too and VARIANTS[variant] is not None:
            setup = "from pagecast.kernels import ops; ops.FUSE_SILU_DOWN = False"
            unfused = f"{variant}-unfused-silu"
            results[unfused] = {r["figure"]: r["value"] for r in variant_runs.measure(args.out, unfused, artifact, phases, record, setup)}  # type: ignore[misc]

    # Ratios against bf16 from this run (or from an earlier run's quant.jsonl in the same OUTDIR).
    earlier = [
        json.loads(line) for line in (args.out / "quant.jsonl").read_text().splitlines() if line.strip()
    ]
    bf16 = {r["figure"]: r["value"] for r in earlier if r.get("variant") == "bf16"}
    print(
        "\n| variant | W4 inter-token (ms) | W4 / bf16 (target <= 0.45) | W1 (tok/s) | W1 / bf16 (target >= 0.9) |"
    )
    print("|---|---|---|---|---|")
    for variant, figures in results.items():
        w4, w1 = figures.get("W4_inter_token_latency_ms"), figures.get("W1_output_tok_s")
        b4, b1 = bf16.get("W4_inter_token_latency_ms"), bf16.get("W1_output_tok_s")
        r4 = f"{w4 / b4:.3f}" if isinstance(w4, float) and isinstance(b4, float) else "-"
        r1 = f"{w1 / b1:.3f}" if isinstance(w1, float) and isinstance(b1, float) else "-"
        print(f"| {variant} | {w4} | {r4} | {w1} | {r1} |")
        if variant != "bf16" and r4 != "-":
            record(variant=variant, figure="W4_ratio_to_bf16", value=float(r4), target="<= 0.45")
        if variant != "bf16" and r1 != "-":
            record(variant=variant, figure="W1_ratio_to_bf16", value=float(r1), target=">= 0.9")


if __name__ == "__main__":
    main()
