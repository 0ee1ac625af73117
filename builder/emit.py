"""Pass 8, emit: manifest with the hash of every file, the build report, and the final rename.

The artifact is assembled in a temporary directory beside the output and renamed into
place only at the end, so a failed build never leaves a half artifact behind.
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path
from typing import Any

from pagecast.builder import quant, shard, tune
from pagecast.builder.ir import BuildState
from pagecast.kernels import KERNEL_ABI
from pagecast.runtime.artifact import FORMAT_VERSION, MANIFEST, Manifest, TargetDevice, hash_tree


def versions() -> dict[str, str]:
    import torch
    import transformers

    from pagecast.runtime import __version__

    out = {"pagecast": __version__, "torch": torch.__version__, "transformers": transformers.__version__}
    try:
        import triton

        out["triton"] = triton.__version__
    except ImportError:
        out["triton"] = "not installed"
    return out


def _moe_dims(model: Any) -> dict[str, Any]:
    """A MoE model's expert shape (none for a dense model): experts, experts per token, each
    expert's intermediate size, and which layers are MoE blocks."""
    moe = model.moe
    if moe is None:
        return {}
    return {
        "num_experts": moe.num_experts,
        "num_experts_per_tok": moe.top_k,
        "moe_intermediate_size": moe.intermediate_size,
        "moe_layers": [layer.index for layer in model.layers if layer.mlp.kind == "moe"],
    }


def make_manifest(
    state: BuildState, files: dict[str, str], chunk_hashes: dict[str, list[str]] | None = None
) -> Manifest:
    model, plan, ckpt, opts = state.model, state.plan, state.checkpoint, state.options
    assert model is not None and plan is not None
    a = model.attention
    return Manifest(
        format_version=FORMAT_VERSION,
        name=ckpt.name,
        family=model.family,
        architecture=model.architecture,
        dims={
            "hidden_size": model.hidden_size,
            "num_layers": model.num_layers,
            "num_heads": a.num_heads,
            "num_kv_heads": a.num_kv_heads,
            "head_dim": a.head_dim,
            "intermediate_size": model.mlp.intermediate_size,
            "vocab_size": model.vocab_size,
            "num_parameters": plan.memory["num_parameters"],
            **_moe_dims(model),
        },
        dtype=plan.dtype,
        block_size=plan.block_size,
        tp=plan.tp,
        quant=plan.quant,
        max_model_len=plan.max_model_len,
        target=TargetDevice(
            kind=plan.device,
            name=plan.gpu_name,
            compute_capability=plan.compute_capability,
            tuned=bool(state.tuning and state.tuning.get("tuned")),
        ),
        eos_token_ids=list(ckpt.eos_token_ids),
        bos_token_id=ckpt.bos_token_id,
        versions=versions(),
        build_options={k: (str(v) if isinstance(v, Path) else v) for k, v in dataclasses.asdict(opts).items()},
        files=files,
        chunk_hashes=chunk_hashes or {},
        layout=shard.manifest_layout(model, plan.tp, plan.tensors, ckpt.dummy and plan.quantization is None, opts.seed),
        quantization=plan.quantization.as_dict() if plan.quantization is not None else None,
        kv_cache=plan.kv_cache.as_manifest() if plan.kv_cache is not None else {"dtype": plan.dtype},
        kernel_abi=KERNEL_ABI,
        speculative=state.speculative,
    )


def render_report(state: BuildState, manifest: Manifest) -> str:
    plan = state.plan
    assert plan is not None
    mem: dict[str, Any] = plan.memory
    image_text = getattr(state.checkpoint, "image_text", None)
    lines = [
        f"# {manifest.name}: pagecast engine report",
        "",
        f"- model: {manifest.architecture} ({manifest.family}), {mem['num_parameters']:,} parameters, {plan.dtype}"
        + (f"; the language model of a {image_text} checkpoint (text only)" if image_text else ""),
        f"- dims: {manifest.dims}",
        f"- target: {plan.device} / {plan.gpu_name}, compute capability {plan.compute_capability}, "
        f"tuned: {manifest.target.tuned}",
        f"- block size {plan.block_size}, max_model_len {plan.max_model_len}, tp {plan.tp}, quant {plan.quant}",
        f"- KV cache {manifest.kv_cache_dtype}",
        f"- weights {mem['weight_bytes'] / 2**20:,.1f} MiB; KV {mem['bytes_per_token'] / 1024:,.1f} KiB per token, "
        f"{mem['bytes_per_block'] / 2**20:,.2f} MiB per block, "
        f"{mem['bytes_per_seq_at_max_model_len'] / 2**30:,.2f} GiB per sequence of max_model_len {plan.max_model_len:,}",
        *shard.report_lines(manifest.layout),
        f"- weights: {manifest.layout['weights']}",
        f"- stop token ids: {manifest.eos_token_ids}",
        f"- tokenizer included: {state.report.get('has_tokenizer')}",
    ]
    if "moe_workspace_bytes" in mem:
        moe = state.model.moe  # type: ignore[union-attr]
        lines.append(
            f"- mixture of experts: {moe.num_experts} experts, top {moe.top_k}, each {moe.intermediate_size} wide"
            f"{f', a shared expert {moe.shared_expert_size} wide' if moe.shared_expert_size else ''}; MoE workspace "
            f"up to {max(mem['moe_workspace_bytes'].values()) / 2**20:,.1f} MiB (token bucket {max(mem['moe_workspace_bytes'], key=mem['moe_workspace_bytes'].get)})"
        )
    for note in state.report.get("plan_notes", []):
        lines.append(f"- note: {note}")
    lines += ["", "## Tuning", "", state.report.get("tuning_note", "")]
    rows = state.report.get("bandwidth_rows") or []
    if rows:
        lines += ["", "| kernel | bucket | config | time (us) | GB/s | fraction of copy bandwidth |", "|---|---|---|---|---|---|"]
        for r in rows:
            lines.append(
                f"| {r.get('kernel')} | {r.get('bucket')} | {r.get('config')} | {r.get('time_us') or 0:.1f} | "
                f"{r.get('gb_s') or 0:,.0f} | {r.get('fraction_of_copy') or 0:.0%} |"
            )
    if state.model is not None and state.model.moe is not None:
        lines += tune.moe_report_lines(state.tuning, tune.model_shapes(state))
    lines += quant.report_lines(state.tuning, plan.quantization, plan.tp)
    if mem["budgets"]:
        lines += ["", "## Memory plan", "", "| gpu_memory_utilization | KV blocks | tokens | seqs at max_model_len |",
                  "|---|---|---|---|"]
        for b in mem["budgets"]:
            lines.append(
                f"| {b['gpu_memory_utilization']} | {b['num_blocks']:,} | {b['max_tokens']:,} | "
                f"{b['max_seqs_at_max_model_len']:,} |"
            )
    return "\n".join(lines) + "\n"


def run(state: BuildState) -> BuildState:
    staging, output = state.staging_dir, state.output_dir
    assert staging is not None and output is not None
    # The report is hashed like every other file, so it is written first with a provisional manifest view.
    provisional = make_manifest(state, {})
    (staging / "report.md").write_text(render_report(state, provisional))
    manifest = make_manifest(state, *hash_tree(staging))
    (staging / MANIFEST).write_text(manifest.to_json())
    staging.chmod(0o755)  # mkdtemp made it private; an artifact is an ordinary directory
    if output.exists():
        old = output.with_name(f".{output.name}.old")
        shutil.rmtree(old, ignore_errors=True)
        output.rename(old)
        staging.rename(output)
        shutil.rmtree(old, ignore_errors=True)
    else:
        staging.rename(output)
    return dataclasses.replace(state, staging_dir=None)
