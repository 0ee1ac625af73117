"""FP8 weights (W8A8) against bf16 on one GPU, in the same run (issue 29): W1, W6 and W4 of a
Llama-3-8B-shaped engine with random weights, for bf16, ``--quant fp8`` (per-channel e4m3 weights,
per-token activations) and ``--quant fp8`` with the FP8 KV cache (W6 only by default); on request
(``--variants``) with an FP8 LM head too, or ``--fp8-scheme block`` (``fp8block``).

Each variant is built with --load-format dummy (``--quant fp8`` draws random e4m3 weights with
per-channel scales at build, in the artifact layout; the FP8 GEMM is tuned on this GPU per
projection and row bucket against torch._scaled_mm, both times in report.md), then measured by
benchmarks/serving.py's phases in a fresh process (one engine holds most of the GPU's memory), so
the figures are exactly the ones serving.py reports for bf16.

    python benchmarks/fp8.py --out OUTDIR [--variants bf16,fp8,fp8+fp8kv,fp8+fp8head,fp8block] [--tune-budget 240]
                             [--phases W1,W6,W4] [--kv-phases W6]
    python benchmarks/fp8.py --dry-run        # CPU: a tiny config through the same build options

Artifacts are kept in OUTDIR and reused. Prints a table (fp8 / bf16 ratios against the issue's
targets: W1 >= 1.4x, W6 >= 1.3x, W4 <= 0.62x; with the FP8 KV cache W6 >= 28,000 tok/s) and one JSON
line per figure (also in OUTDIR/fp8.jsonl). --dry-run builds a tiny Llama config (random weights)
for every variant on the CPU, generates a few tokens from each and prints them: it checks the
variants' build options and the script, not speed.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

# Each variant tunes its own projections' GEMMs first (enginebuild --tune-first), then decode
# attention: a budget short of a full tune cuts off the kernels these figures depend on least.
BF16_FIRST = ("skinny_gemm", "paged_decode_attention")
FP8_FIRST = ("fp8_gemm", *BF16_FIRST)
VARIANTS: dict[str, dict[str, Any]] = {
    "bf16": {"tune_first": BF16_FIRST},
    "fp8": {"quant": "fp8", "tune_first": FP8_FIRST},
    "fp8+fp8kv": {"quant": "fp8", "kv_cache_dtype": "fp8", "tune_first": FP8_FIRST},
    # enginebuild --fp8-lm-head; built with the fp8 variant's kernel configs where that artifact is
    # in OUTDIR (--tuning-from), so the two differ in the LM head alone
    "fp8+fp8head": {"quant": "fp8", "fp8_lm_head": True, "tune_first": FP8_FIRST},
    # enginebuild --fp8-scheme block: 128x128 weight blocks, activations per 1x128 group
    "fp8block": {"quant": "fp8", "fp8_scheme": "block", "tune_first": FP8_FIRST},
}
TARGETS = {  # figure -> (comparison, value): ratios to bf16, or absolute
    "W1_output_tok_s": (">=", 1.4),
    "W6_output_tok_s": (">=", 1.3),
    "W4_inter_token_latency_ms": ("<=", 0.62),
}
KV_W6_TARGET = 28000.0


def dry_run() -> None:
    """Every variant's build options on a tiny random Llama config, on the CPU."""
    from pagecast.builder.ir import BuildOptions
    from pagecast.builder.pipeline import build
    from pagecast.runtime import LLM, SamplingParams

    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256, "intermediate_size": 512,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "num_hidden_layers": 2,
        "vocab_size": 1024, "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    }  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        cfg_dir = Path(tmp) / "config"
        cfg_dir.mkdir()
        (cfg_dir / "config.json").write_text(json.dumps(config))
        for variant, options in VARIANTS.items():
            artifact = build(BuildOptions(model=str(cfg_dir), output=Path(tmp) / variant, gpu="cpu", load_format="dummy",
                                          force=True, quiet=True, **options))  # fmt: skip
            manifest = json.loads((artifact / "manifest.json").read_text())
            llm = LLM(artifact, max_num_seqs=4, max_num_batched_tokens=64)
            out = llm.generate([[1, 5, 9, 13]], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
            weights = sum(f.stat().st_size for f in (artifact / "weights").glob("*.safetensors"))
            print(json.dumps({"variant": variant, "quant": manifest["quant"], "kv_cache": manifest["kv_cache"]["dtype"],
                              "weight_file_bytes": weights, "tokens": out[0].token_ids}))  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("bench-fp8"))
    ap.add_argument("--variants", default="bf16,fp8,fp8+fp8kv")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--tune-budget", type=float, default=240.0)
    ap.add_argument("--phases", default="W1,W6,W4", help="serving.py phases for bf16 and fp8")
    ap.add_argument("--kv-phases", default="W6", help="serving.py phases for fp8+fp8kv")
    ap.add_argument("--dry-run", action="store_true", help="CPU: build and run every variant on a tiny config")
    args = ap.parse_args()
    if args.dry_run:
        dry_run()
        return
    import variant_runs

    args.out.mkdir(parents=True, exist_ok=True)
    variants = variant_runs.chosen_variants(args.variants, VARIANTS)
    record = variant_runs.Recorder(args.out, "fp8.jsonl")
    record.machine()
    results: dict[str, dict[str, object]] = {}
    for variant in variants:
        options = dict(VARIANTS[variant])
        if variant == "fp8+fp8head" and (args.out / "llama3-8b-fp8" / "tuning.json").is_file():
            options["tuning_from"] = args.out / "llama3-8b-fp8"
        artifact = variant_runs.build(
            args.out, args.out / f"llama3-8b-{variant}", variant, record, args.max_model_len, args.tune_budget,
            **options,
        )
        record(variant=variant, figure="weight_bytes",
               value=sum(f.stat().st_size for f in (artifact / "weights").glob("*.safetensors")))  # fmt: skip
        phases = set((args.kv_phases if variant == "fp8+fp8kv" else args.phases).split(","))
        rows = variant_runs.measure(args.out, variant, artifact, phases, record)
        results[variant] = {str(r["figure"]): r["value"] for r in rows}

    earlier = [json.loads(line) for line in (args.out / "fp8.jsonl").read_text().splitlines() if line.strip()]
    bf16 = {r["figure"]: r["value"] for r in earlier if r.get("variant") == "bf16"}
    print("\n| variant | W1 (tok/s) | W1 / bf16 (>= 1.4) | W6 (tok/s) | W6 / bf16 (>= 1.3) | W4 (ms) | W4 / bf16 (<= 0.62) |")
    print("|---|---|---|---|---|---|---|")
    for variant, figures in results.items():
        cells = []
        for figure, (op, target) in TARGETS.items():
            value, base = figures.get(figure), bf16.get(figure)
            ratio = value / base if isinstance(value, float) and isinstance(base, float) and base else None
            cells += [str(value if value is not None else "-"), f"{ratio:.3f}" if ratio else "-"]
            if variant != "bf16" and ratio:
                record(variant=variant, figure=f"{figure}_ratio_to_bf16", value=round(ratio, 3), target=f"{op} {target}")
        print(f"| {variant} | " + " | ".join(cells) + " |")
    w6 = results.get("fp8+fp8kv", {}).get("W6_output_tok_s")
    if isinstance(w6, float):
        print(f"\nfp8+fp8kv W6: {w6} tok/s (target >= {KV_W6_TARGET:,.0f})")


if __name__ == "__main__":
    main()
