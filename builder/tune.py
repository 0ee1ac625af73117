"""Pass 5, tune: pick each kernel's launch config for this GPU, block size and model shape.

On the target GPU the kernels' config spaces are timed (pagecast.kernels.tuning) with the
Triton cache pointed into the artifact, so the compiled kernels ship with it and serving
compiles nothing. Without the target GPU the shipped default table for that GPU is used and
the artifact is marked untuned. CPU artifacts run the torch reference and need no table.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from pagecast.builder import shard
from pagecast.builder.ir import BuildState
from pagecast.runtime.errors import BuildError

TRITON_CACHE_SUBDIR = "triton_cache"


def model_shapes(state: BuildState) -> dict[str, Any]:
    model, plan = state.model, state.plan
    assert model is not None and plan is not None
    a = model.attention
    per_rank = shard.plan_layout(model, plan.tp)  # kernels run one rank's share
    return {
        "num_heads": per_rank.num_heads,
        "num_kv_heads": per_rank.num_kv_heads,
        "head_dim": a.head_dim,
        "hidden": model.hidden_size,
        "intermediate": per_rank.intermediate_size,
        "block_size": plan.block_size,
        "dtype": plan.dtype,
        "max_model_len": plan.max_model_len,
        "max_num_seqs": plan.max_num_seqs,
        "quant_group_size": plan.quantization.group_size if plan.quantization is not None else 0,
        # The attention kernels and the KV write are tuned on caches of the artifact's KV dtype.
        "kv_cache_dtype": plan.kv_cache.dtype if plan.kv_cache is not None else None,
        "o_proj_inputs": o_proj_inputs(plan, per_rank.num_heads * a.head_dim),
        "attn_softcap": max((layer.attention.logit_softcap or 0.0) for layer in model.layers),
        "activation": model.dense_mlp.activation if model.dense_mlp is not None else "silu",  # MoE-only: no dense MLP
        # MoE blocks: the fused-MoE kernel is tuned per token bucket at one rank's expert width.
        "num_experts": model.moe.num_experts if model.moe is not None else 0,
        "top_k": model.moe.top_k if model.moe is not None else 0,
        "moe_intermediate": per_rank.moe_intermediate_size,
    }


def o_proj_inputs(plan: Any, q_size: int) -> int:
    """o_proj's int4 inputs on one rank (the widest layer's) when an act-order shard is padded to
    whole groups (builder/quant.py, row_layout), else 0: the rank's ``q_size`` query columns."""
    widest = max(
        (t.shape[0] * 8 for t in shard.rank_tensors(plan.tensors, 0) if t.name.endswith(".o_proj.qweight")),
        default=q_size,
    )
    return 0 if widest == q_size else widest


def tune_in_subprocess(shapes: dict[str, Any], budget_s: float, cache_dir: Path) -> tuple[dict[str, Any], list[Any]]:
    """Tune in a fresh process whose Triton cache is the artifact's: a kernel this process
    already compiled (an earlier build, a test) would otherwise be served from memory and never
    written into the artifact, and the server would compile it at start-up."""
    env = dict(os.environ, TRITON_CACHE_DIR=str(cache_dir))
    cmd = [sys.executable, "-m", "pagecast.builder.tune", json.dumps(shapes), str(budget_s)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise BuildError(f"kernel tuning failed on this GPU:\n{proc.stderr[-3000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    return result["table"], result["rows"]


def _tune_main(shapes_json: str, budget_s: str) -> None:
    from pagecast.kernels import tuning

    shapes = tuning.ModelShapes(**json.loads(shapes_json))
    kernels = tuning.KERNELS + (tuning.MOE_KERNELS if shapes.num_experts else ())  # fused MoE for MoE models
    table = tuning.tune(kernels, shapes, budget_s=float(budget_s), device="cuda")
    copy_gbs = tuning.measure_copy_bandwidth("cuda")
    table["copy_bandwidth_gbs"] = round(copy_gbs, 1)
    rows = tuning.bandwidth_report(table, shapes, copy_gbs)
    _compile_untuned_kernels()
    print(json.dumps({"table": table, "rows": rows}))


def _compile_untuned_kernels() -> None:
    """Kernels with nothing to tune still go into the artifact's Triton cache, so serving
    compiles nothing: the seeded-sampling noise (kernels/keyed_noise.py), the sampler's kernels
    and xgrammar's grammar mask kernel."""
    import torch

    from pagecast.kernels.keyed_noise import keyed_exponential

    from pagecast.runtime.request import Request
    from pagecast.runtime.sampler import sample
    from pagecast.runtime.sampling_params import SamplingParams

    zeros = torch.zeros(2, dtype=torch.int64, device="cuda")
    for vocab in (4096, 4097):
        keyed_exponential(zeros, zeros, vocab)
    # The sampler's kernels (kernels/sampling.py: race, tie counts, logprob statistics), run the
    # way the engine runs them: bf16 logits, and fp32 ones (penalties, min_tokens and grammars
    # make an fp32 copy), rows that sample with truncation, seeded rows, min-p, logprobs.
    settings = [
        SamplingParams(temperature=0.0, logprobs=2),
        SamplingParams(temperature=0.8, top_p=0.95, top_k=50, seed=1),
        SamplingParams(temperature=1.0, top_p=0.9),
        SamplingParams(temperature=1.0, min_p=0.05, logprobs=1),
    ]
    # Triton specialises the vocabulary (and the row stride) and the sampler's programs per row on
    # "equals 1" and "divisible by 16": these widths cover every combination.
    for vocab in (4096, 4097, 49152, 49153, 131072, 131071):
        for dtype in (torch.bfloat16, torch.float32):
            for rows in (1, 3):
                requests = [Request(f"r{i}", [1, 2, 3], settings[i % len(settings)]) for i in range(rows * 4)]
                sample(torch.randn(len(requests), vocab, device="cuda").to(dtype), requests)
                sample(torch.randn(rows, vocab, device="cuda").to(dtype), requests[1 : rows + 1])
    compile_grammar_mask_kernels("cuda")
    torch.cuda.synchronize()


# xgrammar's kernel that masks a grammar's tokens (apply_token_bitmask_inplace_kernel) is
# specialised by Triton on its row count (1, a multiple of 16, any other), and on the vocabulary
# (also the logits' row stride) and the bitmask's row stride (ceil(vocab / 32) words), each
# divisible by 16 or not. These widths give the four combinations of the last two
# (16 | vocab, 16 | words): yes yes, yes no, no no, no yes.
GRAMMAR_MASK_VOCABS = (49152, 32000, 49153, 49151)
GRAMMAR_MASK_ROWS = (1, 3, 16)


def compile_grammar_mask_kernels(device: str) -> None:
    """Run xgrammar's mask kernel the way the sampler runs it, at every specialisation, so that
    it goes into the artifact's Triton cache (serving would compile it at the first constrained
    requests otherwise). Through the sampler itself: it masks an fp32 copy of the constrained
    rows, whatever the logits' dtype (the engine's are fp32; bf16 ones are run too, in case).
    Nothing to do without xgrammar (structured output then refuses every request)."""
    try:
        import xgrammar
    except ImportError:
        return
    import torch

    from pagecast.runtime.request import Request
    from pagecast.runtime.sampler import sample_token_ids
    from pagecast.runtime.sampling_params import SamplingParams

    greedy = SamplingParams(temperature=0.0)
    for vocab in GRAMMAR_MASK_VOCABS:
        for rows in GRAMMAR_MASK_ROWS:
            requests = [Request(f"r{i}", [1, 2, 3], greedy) for i in range(rows + 1)]
            bitmask = xgrammar.allocate_token_bitmask(rows, vocab)  # every token allowed
            for dtype in (torch.float32, torch.bfloat16):
                logits = torch.randn(rows + 1, vocab, device=device).to(dtype)
                # Every row but the first is constrained: the kernel sees ``rows`` rows.
                sample_token_ids(logits, requests, token_bitmask=(list(range(1, rows + 1)), bitmask))


def budget_note(table: dict[str, Any], budget_s: float) -> str:
    """The report's words for buckets the tuning budget cut off (empty when none was)."""
    from pagecast.kernels import tuning

    cut = tuning.untuned_buckets(table)
    if not cut:
        return ""
    total = sum(len(entries) for entries in table["kernels"].values())
    count = sum(len(buckets) for buckets in cut.values())
    where = "; ".join(f"{kernel}: {', '.join(buckets)}" for kernel, buckets in cut.items())
    return (
        f". The {budget_s:.0f} s budget ran out before {count} of {total} buckets, which keep the "
        f"launcher's default config untimed against the others ({where}); rebuild with a larger "
        f"--tune-budget to tune them"
    )


def run(state: BuildState) -> BuildState:
    plan = state.plan
    assert plan is not None and state.staging_dir is not None
    report = dict(state.report)
    if plan.device == "cpu":
        table: dict[str, Any] = {"device": "cpu", "tuned": False, "kernels": {}}
        report["tuning_note"] = "CPU artifact: the torch reference kernels run; nothing to tune"
        return dataclasses.replace(state, tuning=table, report=report)

    from pagecast.kernels import tuning

    if report.get("gpu_present"):
        table, rows = tune_in_subprocess(
            model_shapes(state), state.options.tune_budget_s, state.staging_dir / TRITON_CACHE_SUBDIR
        )
        copy_gbs = table["copy_bandwidth_gbs"]
        report["bandwidth_rows"] = rows
        report["tuning_note"] = (
            f"tuned on this {plan.gpu_name} within {state.options.tune_budget_s:.0f} s; "
            f"measured copy bandwidth {copy_gbs:,.0f} GB/s"
        ) + budget_note(table, state.options.tune_budget_s)
    else:
        table = tuning.default_table(plan.gpu_name) or {"device": plan.gpu_name, "tuned": False, "kernels": {}}
        table = dict(table, tuned=False)
        report["tuning_note"] = (
            f"no {plan.gpu_name} present: the shipped default table for {plan.gpu_name} is used "
            f"(artifact marked untuned; rebuild on the GPU to tune)"
        )
    return dataclasses.replace(state, tuning=table, report=report)


if __name__ == "__main__":
    _tune_main(*sys.argv[1:3])
