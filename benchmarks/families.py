"""Other model families beside Llama on one GPU (issues 28 and 27): Gemma-2-9B-, Qwen3-30B-A3B-
(MoE, 128 experts top-8), Mixtral-8x7B- (MoE, 8 experts top-2) and Llama-3-8B-shaped artifacts
with random bf16 weights (``--load-format dummy``), each built and tuned for the GPU present,
then W4 (one request, prompt 128, output 512: inter-token latency) and W1 (1,024 requests,
prompt 512, output 256, all at once: output tokens/s) of each, measured by benchmarks/serving.py's
phase_ours in a fresh process per engine (one engine holds most of the GPU's memory). Beside each W4 a roofline row: the bf16 weight bytes one decode step reads
(decode_weight_bytes; for MoE the active weights, the top-k experts a token visits) over the
copy bandwidth.

    python benchmarks/families.py --out OUTDIR [--models gemma2-9b,llama3-8b] [--tune-budget 20] [--phases W4,W1]
    python benchmarks/families.py --dry-run     # CPU: tiny versions of the configs, same code

Every figure is a JSON line (printed and appended to OUTDIR/families.jsonl); a table ends the run.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import variant_runs
from serving import LLAMA3_8B
from tp import COPY_GBS

from pagecast.runtime.artifact import load_manifest

# google/gemma-2-9b's config.json.
GEMMA2_9B: dict[str, Any] = {
    "architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "hidden_size": 3584, "intermediate_size": 14336,
    "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 256, "num_hidden_layers": 42,
    "vocab_size": 256000, "max_position_embeddings": 8192, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
    "hidden_activation": "gelu_pytorch_tanh", "hidden_act": "gelu_pytorch_tanh", "query_pre_attn_scalar": 256,
    "sliding_window": 4096, "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0, "attention_bias": False,
    "tie_word_embeddings": True, "bos_token_id": 2, "eos_token_id": 1, "pad_token_id": 0, "torch_dtype": "bfloat16",
}  # fmt: skip
# Qwen/Qwen3-30B-A3B's and mistralai/Mixtral-8x7B-v0.1's config.json (issue 27's shapes).
QWEN3_30B_A3B: dict[str, Any] = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 2048, "intermediate_size": 6144,
    "moe_intermediate_size": 768, "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4,
    "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1,
    "mlp_only_layers": [], "vocab_size": 151936, "max_position_embeddings": 40960, "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0, "tie_word_embeddings": False, "attention_bias": False, "use_sliding_window": False,
    "bos_token_id": 151643, "eos_token_id": 151645, "torch_dtype": "bfloat16",
}  # fmt: skip
MIXTRAL_8X7B: dict[str, Any] = {
    "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "num_local_experts": 8,
    "num_experts_per_tok": 2, "vocab_size": 32000, "max_position_embeddings": 32768, "rms_norm_eps": 1e-5,
    "rope_theta": 1000000.0, "sliding_window": None, "tie_word_embeddings": False, "bos_token_id": 1,
    "eos_token_id": 2, "torch_dtype": "bfloat16",
}  # fmt: skip
# meta-llama/Llama-4-Scout-17B-16E-Instruct's text_config, as its language model alone, with 8 of its 48
# layers (every one MoE: 16 experts, top-1, a shared expert) so that the bf16 weights (about 39 GB) fit
# an 80 GB card beside the KV cache; the W4 roofline counts this depth's active weights.
LLAMA4_SCOUT_8L: dict[str, Any] = {
    "architectures": ["Llama4ForCausalLM"], "model_type": "llama4_text", "hidden_size": 5120, "intermediate_size": 8192,
    "intermediate_size_mlp": 16384, "num_hidden_layers": 8, "num_attention_heads": 40, "num_key_value_heads": 8,
    "head_dim": 128, "num_local_experts": 16, "num_experts_per_tok": 1, "interleave_moe_layer_step": 1,
    "vocab_size": 202048, "max_position_embeddings": 10485760, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
    "rope_scaling": {"rope_type": "llama3", "factor": 16.0, "low_freq_factor": 1.0, "high_freq_factor": 1.0,
                     "original_max_position_embeddings": 8192},
    "attention_chunk_size": 8192, "use_qk_norm": True, "attn_temperature_tuning": True, "floor_scale": 8192,
    "attn_scale": 0.1, "no_rope_layer_interval": 4, "attention_bias": False, "tie_word_embeddings": False,
    "bos_token_id": 200000, "eos_token_id": [200001, 200007, 200008], "pad_token_id": 200018, "torch_dtype": "bfloat16",
}  # fmt: skip
MODELS = {"gemma2-9b": GEMMA2_9B, "llama3-8b": LLAMA3_8B, "qwen3-30b-a3b": QWEN3_30B_A3B,
          "mixtral-8x7b": MIXTRAL_8X7B, "llama4-scout-8l": LLAMA4_SCOUT_8L}  # fmt: skip
# The dry run's: the same families, tiny (the vocabulary stays above serving.random_prompts' ids;
# Gemma's window is shorter than a W4 request, so its sliding layers slide).
TINY = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "num_hidden_layers": 2, "vocab_size": 128256, "max_position_embeddings": 2048}  # fmt: skip
DRY_RUN = {
    "gemma2-9b": {**GEMMA2_9B, **TINY, "num_hidden_layers": 4, "query_pre_attn_scalar": 16, "sliding_window": 8},
    "llama3-8b": {**LLAMA3_8B, **TINY},
    "qwen3-30b-a3b": {**QWEN3_30B_A3B, **TINY, "moe_intermediate_size": 32, "num_experts": 16},
    "mixtral-8x7b": {**MIXTRAL_8X7B, **TINY},
    # 4 layers: the fourth without RoPE; 4-token chunks, so that the dry run's prompts cross them
    "llama4-scout-8l": {**LLAMA4_SCOUT_8L, **TINY, "num_hidden_layers": 4, "intermediate_size_mlp": 128, "bos_token_id": 1,
                        "eos_token_id": [2], "pad_token_id": 0,
                        "attention_chunk_size": 4, "rope_scaling": {**LLAMA4_SCOUT_8L["rope_scaling"],
                                                                    "original_max_position_embeddings": 64}},
}  # fmt: skip
DRY_RUN_SCALE = 1 / 32  # W1: 32 requests, prompt 16, output 8; W4: prompt 4, output 16


def moe_shape(cfg: dict[str, Any]) -> tuple[int, int, int, int] | None:
    """(experts, top-k, expert intermediate, MoE layers) of a Mixtral / Qwen3-MoE config, else None."""
    experts = cfg.get("num_local_experts") or cfg.get("num_experts")
    if not experts:
        return None
    inter = cfg.get("moe_intermediate_size") or cfg["intermediate_size"]
    step = cfg.get("decoder_sparse_step") or 1
    dense = set(cfg.get("mlp_only_layers") or [])
    layers = sum(1 for i in range(cfg["num_hidden_layers"]) if i not in dense and (i + 1) % step == 0)
    return int(experts), int(cfg["num_experts_per_tok"]), int(inter), layers


def decode_weight_bytes(artifact: Path, cfg: dict[str, Any]) -> int:
    """Bytes of bf16 weights one decode step of one sequence reads: the build's parameter count
    (memory plan) less an untied embedding table, of which a step reads one row (the lookup); tied,
    the table is read once, as the LM head. For a MoE model, the active weights: a token reads its
    top-k experts' gate, up and down projections a layer, not the other experts'."""
    num_parameters = int(load_manifest(artifact).dims["num_parameters"])
    h = cfg["hidden_size"]
    table = 0 if cfg.get("tie_word_embeddings") else cfg["vocab_size"] * h
    idle = 0
    if moe := moe_shape(cfg):
        experts, top_k, inter, layers = moe
        idle = (experts - top_k) * 3 * h * inter * layers
    return 2 * (num_parameters - table + h - idle)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("bench-families"))
    ap.add_argument("--models", default="gemma2-9b,llama3-8b")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--tune-budget", type=float, default=20.0)
    ap.add_argument("--phases", default="W4,W1", help="serving.py phases (W4, W1, W6)")
    ap.add_argument("--dry-run", action="store_true", help="CPU: tiny configs and W4 / W1, the same code")
    args = ap.parse_args()
    phases = set(args.phases.split(","))
    models = variant_runs.chosen_variants(args.models, MODELS)
    if args.dry_run:
        with tempfile.TemporaryDirectory() as tmp:
            run(Path(tmp), models, DRY_RUN, max_model_len=128, tune_budget=0.0, dry_run=True, phases=phases)
        return
    args.out.mkdir(parents=True, exist_ok=True)
    run(args.out, models, MODELS, args.max_model_len, args.tune_budget, dry_run=False, phases=phases)


def run(out: Path, models: list[str], configs: dict[str, dict[str, Any]], max_model_len: int, tune_budget: float,
        dry_run: bool, phases: set[str]) -> None:  # fmt: skip
    record = variant_runs.Recorder(out, "families.jsonl")
    if dry_run:
        record(figure="machine", value="cpu (dry run)", date=time.strftime("%Y-%m-%d"))
    else:
        record.machine()
    rows = []
    for name in models:
        cfg = configs[name]
        artifact = variant_runs.build(out, out / f"{name}-bf16", name, record, max_model_len, tune_budget, config=cfg,
                                      **({"gpu": "cpu"} if dry_run else {}))  # fmt: skip
        measured = variant_runs.measure(out, name, artifact, phases, record,
                                        scale=DRY_RUN_SCALE if dry_run else 1.0, llama_targets=name == "llama3-8b")  # fmt: skip
        figures = {r["figure"]: r for r in measured}
        # As benchmarks/tp.py: the build's own copy bandwidth (builder/tune.py measures it), else tp.COPY_GBS.
        measured_gbs = json.loads((artifact / "tuning.json").read_text()).get("copy_bandwidth_gbs") \
            if (artifact / "tuning.json").is_file() else None  # fmt: skip
        gbs = float(measured_gbs or COPY_GBS)
        weight_bytes = decode_weight_bytes(artifact, cfg)
        roofline_ms = weight_bytes / (gbs * 1e9) * 1000
        itl = figures.get("W4_inter_token_latency_ms", {}).get("value")
        rows.append(record(variant=name, figure="W4_roofline_ms", value=round(roofline_ms, 3), weight_bytes=weight_bytes,
                           copy_bandwidth_gbs=gbs,
                           bandwidth_source="the build's tuning.json (builder/tune.py, torch copy_)" if measured_gbs else
                           "benchmarks/tp.py COPY_GBS: H200 copy bandwidth measured 2026-11-30 (DESIGN.md)",
                           ratio_w4_to_roofline=round(itl / roofline_ms, 3) if isinstance(itl, (int, float)) else None))  # fmt: skip
        rows += measured
    print("\n| model | figure | value |\n|---|---|---|")
    for r in rows:
        if r["figure"] in ("W4_inter_token_latency_ms", "W4_roofline_ms", "W1_output_tok_s", "W6_output_tok_s",
                           "engine_failed"):
            print(f"| {r['variant']} | {r['figure']} | {r['value']} |")


if __name__ == "__main__":
    main()
