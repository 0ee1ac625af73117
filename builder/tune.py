"""Pass 5, tune: pick each kernel's launch config for this GPU, block size and model shape.

On the target GPU the kernels' config spaces are timed (pagecast.kernels.tuning) with the
Triton cache pointed into the artifact, so the compiled kernels ship with it and serving
compiles nothing. Without the target GPU the shipped default table for that GPU is used and
the artifact is marked untuned. CPU artifacts run the torch reference and need no table.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pagecast.builder import shard
from pagecast.builder.ir import BuildState
from pagecast.runtime.errors import BuildError

if TYPE_CHECKING:
    import torch

TRITON_CACHE_SUBDIR = "triton_cache"


def model_shapes(state: BuildState) -> dict[str, Any]:
    model, plan = state.model, state.plan
    assert model is not None and plan is not None
    a, norms = model.attention, model.qk_norms
    head_norms = bool(norms.qk_norm and norms.qk_norm_kind != "projection")  # in the rotary kernel's launch
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
        # FP8 projections (builder/fp8.py): the fp8_gemm problems' scale layout, "" otherwise.
        "fp8": f"{plan.quantization.weights}-{plan.quantization.activations}" if plan.quant == "fp8" else "",
        # --fp8-lm-head: the head's vocabulary rows on this rank, tuned as fp8_gemm "lm_head" buckets
        "fp8_lm_head": per_rank.vocab_per_rank if plan.quant == "fp8" and plan.quantization.lm_head else 0,
        # The attention kernels and the KV write are tuned on caches of the artifact's KV dtype.
        "kv_cache_dtype": plan.kv_cache.dtype if plan.kv_cache is not None else None,
        "o_proj_inputs": o_proj_inputs(plan, per_rank.num_heads * a.head_dim),
        # The logits the sampler reads: [rows, vocab_size] views of [rows, logits_stride] (the
        # vocab-parallel LM head's rows, padded to a multiple of tp, gathered).
        "vocab_size": model.vocab_size,
        "logits_stride": per_rank.vocab_per_rank * plan.tp,
        "attn_softcap": max((layer.attention.logit_softcap or 0.0) for layer in model.layers),
        "attn_sinks": any(layer.attention.sinks for layer in model.layers),  # gpt-oss: HAS_SINKS variants
        # sliding layers: their SLIDING variants are compiled too (tuning.compile_window_variants)
        "attn_window": max((layer.attention.sliding_window or 0) for layer in model.layers),
        # chunked layers (Llama 4): their CHUNKED variants likewise
        "attn_chunk": max((layer.attention.attention_chunk or 0) for layer in model.layers),
        "activation": model.dense_mlp.activation if model.dense_mlp is not None else "silu",  # MoE-only: no dense MLP
        "biased": biased_projections(model, plan.tp),
        "normed": normed_projections(model),
        "qk_norm_widths": qk_norm_widths(norms, per_rank),
        "head_qk_norm": head_norms,
        "head_qk_norm_after": head_norms and norms.qk_norm_after_rope,
        "rotary_without_norm": head_norms and not all(model.qk_norm_layers),
        "rotary_dim": next((s.attention.rope.rotary_dim for s in model.layers if s.attention.rope is not None), 0),
        "int4_act_order": bool(plan.quantization is not None and getattr(plan.quantization, "desc_act", False)),
        # MoE blocks: the fused-MoE kernel is tuned per token bucket at one rank's expert width.
        "num_experts": model.moe.num_experts if model.moe is not None else 0,
        "top_k": model.moe.top_k if model.moe is not None else 0,
        "moe_intermediate": per_rank.moe_intermediate_size,
        **moe_variant(model.moe),
        # The routing kernel's switches (kernels/moe_route_kernel.py), which ModelShapes (the tuned
        # kernels') does not hold: compiled untuned, at num_experts / top_k / dtype above.
        "moe_routing": moe_routing_fields(model.moe),
    }


def qk_norm_widths(attention: Any, per_rank: Any) -> list[int]:
    """The row widths the q/k RMSNorms run rms_norm at on one rank (templates/model.py.j2): the q
    and k projections whole (``qk_norm_kind`` "projection"); none for per-head norms, which run
    inside the rotary kernel (``head_qk_norm``)."""
    if not attention.qk_norm or attention.qk_norm_kind != "projection":
        return []
    return [per_rank.num_heads * attention.head_dim, per_rank.num_kv_heads * attention.head_dim]


def biased_projections(model: Any, tp: int) -> list[str]:
    """The projections (tuning.PROJECTIONS) whose GEMM adds a bias: those with one in any layer,
    less, at tp > 1, the row-parallel o and down (kernels/ops.row_parallel_linear adds their bias
    after the all-reduce, so their GEMMs run without one)."""
    attention = [layer.attention for layer in model.layers]
    mlp = model.dense_mlp is not None and model.dense_mlp.bias
    flags = {
        "qkv": any(a.qkv_bias for a in attention),
        "o": tp == 1 and any(a.o_bias for a in attention),
        "gate_up": mlp,
        "down": tp == 1 and mlp,
    }
    return [name for name, on in flags.items() if on]


def normed_projections(model: Any) -> list[str]:
    """The projections (tuning.PROJECTIONS) whose input a layer's RMSNorm makes in the same ops
    call (templates/model.py.j2's ops.norm_linear): qkv in pre-norm layers, gate_up in those whose
    dense MLP has its norm on the input (a MoE block's norm runs in the router's launch)."""
    flags = {
        "qkv": any(layer.attn_in_norm is not None for layer in model.layers),
        "gate_up": any(layer.mlp_in_norm is not None and layer.mlp.kind == "dense" for layer in model.layers),
    }
    return [name for name, on in flags.items() if on]


def moe_routing_fields(moe: Any) -> dict[str, Any] | None:
    """A MoE model's routing (kernels/moe_routing.MoeRouting's fields but top_k), None without MoE."""
    if moe is None:
        return None
    fields = ("scoring", "renormalize", "weights_in_x_dtype")
    out = {name: getattr(moe, name) for name in fields}
    if moe.router_fp32 and moe.scoring == "softmax_topk":  # HunYuan: the kernel routes fp32 logits
        out["fp32_logits"] = True
    return out


def moe_variant(moe: Any) -> dict[str, Any]:
    """The fused-MoE and fused-router kernels' constexprs a MoE model fixes (its experts' activation
    and biases, its router's bias and routing), so that the tuner times, and compiles into the
    artifact, the variants the model runs."""
    if moe is None:
        return {}
    return {
        "moe_activation": moe.activation, "moe_alpha": moe.alpha, "moe_limit": moe.limit, "moe_bias": moe.expert_bias,
        "moe_router_bias": moe.router_bias, "moe_scoring": moe.scoring, "moe_renormalize": moe.renormalize,
        "moe_weights_in_x_dtype": moe.weights_in_x_dtype,
    }  # fmt: skip


def o_proj_inputs(plan: Any, q_size: int) -> int:
    """o_proj's int4 inputs on one rank (the widest layer's) when an act-order shard is padded to
    whole groups (builder/quant.py, row_layout), else 0: the rank's ``q_size`` query columns."""
    widest = max(
        (t.shape[0] * 8 for t in shard.rank_tensors(plan.tensors, 0) if t.name.endswith(".o_proj.qweight")),
        default=q_size,
    )
    return 0 if widest == q_size else widest


def tune_in_subprocess(
    shapes: dict[str, Any], budget_s: float, cache_dir: Path, first: tuple[str, ...] = (), pinned: Path | None = None
) -> tuple[dict[str, Any], list[Any]]:
    """Tune in a fresh process whose Triton cache is the artifact's: a kernel this process
    already compiled (an earlier build, a test) would otherwise be served from memory and never
    written into the artifact, and the server would compile it at start-up. ``first``: kernels
    tuned before the others (kernel_order); ``pinned``: a tuning.json whose configs are kept
    (pinned_table, tuning.tune)."""
    env = dict(os.environ, TRITON_CACHE_DIR=str(cache_dir))
    cmd = [sys.executable, "-m", "pagecast.builder.tune", json.dumps(shapes), str(budget_s), ",".join(first),
           str(pinned or "")]  # fmt: skip
    stall_s = float(os.environ.get("PAGECAST_TUNE_STALL_S", TUNE_STALL_S))
    rc, out, err = run_watched(cmd, env, stall_s, "kernel tuning")
    if rc != 0:
        raise BuildError(f"kernel tuning failed on this GPU:\n{err[-3000:]}")
    result = json.loads(out.strip().splitlines()[-1])
    return result["table"], result["rows"]


# The tuner reports each bucket as it begins and ends (and each config it refuses or that fails);
# a bucket's compiles and timing take seconds to a minute. Silence this long means a launch that
# never returns (a kernel that hangs the GPU), which no budget would end.
TUNE_STALL_S = 600.0


def run_watched(cmd: list[str], env: dict[str, str], stall_s: float, what: str) -> tuple[int, str, str]:
    """Run ``cmd``, its stdout and stderr to temporary files (no pipe to fill), and end it if its
    stderr stays silent for ``stall_s`` seconds: a BuildError then names the last lines it wrote
    (for the tuner: the kernel, bucket and config it was on). Returns (exit code, stdout, stderr)."""
    with tempfile.TemporaryFile("w+", errors="replace") as out, tempfile.TemporaryFile("w+", errors="replace") as err:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=err, text=True)
        seen, quiet_since = 0, time.monotonic()
        while proc.poll() is None:
            time.sleep(min(1.0, stall_s / 10))
            size = os.fstat(err.fileno()).st_size
            if size != seen:
                seen, quiet_since = size, time.monotonic()
            elif time.monotonic() - quiet_since > stall_s:
                proc.kill()
                proc.wait()
                err.seek(0)
                tail = "\n".join(err.read().splitlines()[-20:])
                raise BuildError(
                    f"{what} made no progress for {stall_s:.0f} s and was stopped (a kernel launch that never "
                    f"returned?). The last it reported:\n{tail}\nRebuild with the config it names left out "
                    "(--tuning-from a table that pins the bucket), or report it with these lines."
                )
        out.seek(0)
        err.seek(0)
        return proc.returncode, out.read(), err.read()


def kernel_order(has_experts: bool, first: tuple[str, ...] = ()) -> tuple[str, ...]:
    """The order the tuner takes the kernels in: ``first`` (enginebuild --tune-first), then a MoE
    model's expert kernels, which carry most of its step (Qwen3-30B-A3B at one token: 1.8 of 4.3
    ms; measured 2026-12-03), then the rest. A budget that runs out leaves the kernels after it
    at their defaults."""
    from pagecast.kernels import tuning

    usual = (tuning.MOE_KERNELS if has_experts else ()) + tuning.KERNELS
    return tuple(first) + tuple(k for k in usual if k not in first)


def pinned_table(path: Path) -> tuple[Path, dict[str, Any]]:
    """--tuning-from's table: ``path`` itself or, for an artifact directory, its tuning.json; read
    and parsed here, so a wrong path is a BuildError before anything is built on the GPU."""
    file = path / "tuning.json" if path.is_dir() else path
    try:
        table = json.loads(file.read_text())
    except FileNotFoundError:
        raise BuildError(f"--tuning-from: {file} does not exist (give an artifact directory or its tuning.json)") from None
    except (OSError, ValueError) as err:
        raise BuildError(f"--tuning-from: {file} is not a readable JSON tuning table ({err})") from None
    if not isinstance(table, dict) or not table.get("kernels"):
        raise BuildError(f"--tuning-from: {file} holds no tuned kernels (a CPU or untuned artifact's table?)")
    return file, table


# model_shapes' fields that ModelShapes (the tuned kernels' shapes) does not hold: the sampler's
# shapes, and the routing kernel's switches (compiled untuned).
NOT_KERNEL_SHAPES = ("vocab_size", "logits_stride", "moe_routing")


def kernel_shapes(fields: dict[str, Any]) -> Any:
    """The tuning.ModelShapes of ``model_shapes``' fields (those in NOT_KERNEL_SHAPES left out)."""
    from pagecast.kernels import tuning

    return tuning.ModelShapes(**{k: v for k, v in fields.items() if k not in NOT_KERNEL_SHAPES})


def _progress(line: str) -> None:
    """The tuner's progress, on stderr: tune_in_subprocess's watchdog reads it as a heartbeat."""
    print(line, file=sys.stderr, flush=True)


def _tune_main(shapes_json: str, budget_s: str, first: str = "", pinned: str = "") -> None:
    from pagecast.kernels import tuning

    fields = json.loads(shapes_json)
    vocab, logits_stride, routing = (fields.get(k) for k in NOT_KERNEL_SHAPES)
    shapes = kernel_shapes(fields)
    kernels = kernel_order(bool(shapes.num_experts), tuple(k for k in first.split(",") if k))
    source = json.loads(Path(pinned).read_text()) if pinned else None
    try:
        table = tuning.tune(kernels, shapes, budget_s=float(budget_s), device="cuda", pinned=source, log=_progress)
    except ValueError as err:  # check_pinned: the table reused is for other shapes or another GPU
        if not pinned:
            raise
        sys.exit(f"--tuning-from {pinned}: {err}")
    _progress("compiling the tuned kernels' other variants, measuring copy bandwidth, compiling the untuned kernels")
    tuning.compile_window_variants(table, shapes, "cuda")
    tuning.compile_norm_variants(table, shapes, "cuda")
    tuning.compile_fp8_input_variants(table, shapes, "cuda")
    if shapes.num_experts:
        tuning.compile_router_norm_variants(table, shapes, "cuda")
    copy_gbs = tuning.measure_copy_bandwidth("cuda")
    table["copy_bandwidth_gbs"] = round(copy_gbs, 1)
    if shapes.num_experts:  # the MoE buckets' compute bound, for report.md (moe_report_lines)
        table["matmul_tflops"] = round(tuning.measure_matmul_tflops("cuda"), 1)
    rows = tuning.bandwidth_report(table, shapes, copy_gbs)
    moe = None
    if shapes.num_experts and routing:
        moe = (shapes.num_experts, shapes.top_k, routing, shapes.torch_dtype)
    _compile_untuned_kernels(vocab, logits_stride, moe, shapes.torch_dtype)
    print(json.dumps({"table": table, "rows": rows}))


def _compile_untuned_kernels(
    vocab: int | None = None,
    logits_stride: int | None = None,
    moe: tuple[Any, ...] | None = None,
    dtype: torch.dtype | None = None,
) -> None:
    """Kernels with nothing to tune still go into the artifact's Triton cache, so serving
    compiles nothing: the seeded-sampling noise (kernels/keyed_noise.py), the sampler's kernels
    (at this model's vocabulary and dtype, ``compile_sampler_kernels``), xgrammar's grammar mask kernel and,
    for a MoE model (``moe``: its experts, top-k, routing fields and dtype), the routing kernel
    (``compile_route_kernel``)."""
    import torch

    from pagecast.kernels.keyed_noise import keyed_exponential

    zeros = torch.zeros(2, dtype=torch.int64, device="cuda")
    for width in (4096, 4097):
        keyed_exponential(zeros, zeros, width)
    if vocab is not None:
        compile_sampler_kernels("cuda", vocab, logits_stride or vocab, dtype)
    compile_grammar_mask_kernels("cuda")
    if moe is not None:
        compile_route_kernel("cuda", *moe)
    torch.cuda.synchronize()


ROUTE_ROWS = (1, 3, 16, 17)  # token rows: the kernel has no integer argument, one variant serves all


def compile_route_kernel(
    device: str, num_experts: int, top_k: int, routing: dict[str, Any], dtype: torch.dtype
) -> None:
    """Run the MoE routing kernel (kernels/moe_route_kernel.py) as ops.moe runs it, at this model's
    experts, top-k, routing and activation dtype, so that its one variant goes into the artifact's
    Triton cache. Its launches take no integer argument (the row stride is the constexpr E) and
    fresh, aligned tensors, so the rows here stand for every batch a server runs;
    tests/test_moe_route_kernel.py checks through Triton's binder that served launches are among
    these. Nothing to do where the kernel does not take the router (the torch path routes)."""
    import torch

    from pagecast.kernels import moe_route_kernel
    from pagecast.kernels.moe_routing import MoeRouting, route

    if not moe_route_kernel.supported(num_experts, top_k) or routing.get("scoring") not in moe_route_kernel.SCORINGS:
        return
    spec = MoeRouting(top_k, **routing)
    generator = torch.Generator(device).manual_seed(0)
    hidden = 64  # the router's GEMV is F.linear's; the kernel sees only [rows, num_experts] logits
    router = torch.randn(num_experts, hidden, generator=generator, device=device).to(dtype)
    for rows in ROUTE_ROWS:
        x = torch.randn(rows, hidden, generator=generator, device=device).to(dtype)
        route(x, router, None, spec, use_kernel=True, widen=True)  # as ops.moe on a GPU


def sampler_settings(vocab: int) -> list[Any]:
    """One SamplingParams per way the sampler can treat a row: greedy, temperature alone, top-k
    through the threshold kernels (with and without top-p, whose tie groups may reach past the
    candidates), top-k beyond them and top-p alone (a full sort), min-p, seeds, penalties,
    min_tokens, logprobs."""
    from pagecast.runtime.sampling_params import SamplingParams

    # A top_k the threshold kernels take at this vocabulary (kernels.sampling.top_candidates_apply).
    small_k = max(1, min(50, vocab // 128 - 1))
    return [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.0, logprobs=2),
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=0.8, top_k=small_k),
        SamplingParams(temperature=0.8, top_k=small_k, top_p=0.95, seed=1),
        SamplingParams(temperature=1.0, top_k=min(vocab - 1, 2000)),
        SamplingParams(temperature=1.0, top_p=0.9),
        SamplingParams(temperature=1.0, min_p=0.05, logprobs=1),
        SamplingParams(temperature=1.0, seed=3),
        SamplingParams(temperature=0.9, presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.2, logprobs=1),
        SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[3]),
    ]


def compile_sampler_kernels(device: str, vocab: int, logits_stride: int, dtype: torch.dtype | None = None) -> None:
    """Run the sampler's kernels the way a server launches them, at this model's vocabulary, so
    that every variant Triton can compile for them goes into the artifact's cache.

    Triton specialises each launch on its integer arguments (equal to 1, divisible by 16) and
    its pointers' alignment; the launchers keep the per-row pointers out of it
    (kernels/sampling.py), and the integers follow from the vocabulary and the logits' row
    stride, fixed by the artifact. What is left varies with the request: the features (which
    kernels run, and their constexpr switches), one row or several, the logits as the LM head
    returns them (a view of a padded [rows, logits_stride] tensor when the vocabulary is
    padded) or as a copy (rows picked, masked or penalised), the prompt-logprob chunks' first
    row, logits with ties (integer-valued ones: top-p's tie groups), and the logits' dtype: the
    model's (``dtype``: the LM head returns it, ops.lm_head widen=False) and fp32 (the masked and
    penalised copies, and the scaled logits of Gemma 2 or Granite). Each combination runs here;
    tests/test_startup_compiles.py checks on the CPU that a served engine launches no variant
    outside them."""
    import torch

    from pagecast.runtime.request import Request
    from pagecast.runtime.sampler import logprob_tensors, prompt_logprob_tensors, sample_token_ids

    settings = sampler_settings(vocab)
    generator = torch.Generator(device).manual_seed(0)

    def logits(rows: int, ties: bool, padded: bool, dtype: torch.dtype) -> torch.Tensor:
        full = torch.randn(rows, logits_stride, generator=generator, device=device) * 3
        full = (full.round() if ties else full).to(dtype)
        view = full[:, :vocab]  # what ops.lm_head returns
        return view if padded else view.contiguous()

    for logits_dtype, padded in itertools.product(dict.fromkeys((dtype or torch.float32, torch.float32)), (True, False)):
        for ties in (False, True):
            for rows in (1, 3):
                for i, params in enumerate(settings):
                    # The setting alone, and beside a greedy and a sampled row (mixed batches).
                    batch = [params] if rows == 1 else [params, settings[0], settings[4]]
                    requests = [Request(f"r{i}-{j}", [1, 2, 3], p) for j, p in enumerate(batch)]
                    x = logits(rows, ties, padded, logits_dtype)
                    token_ids = sample_token_ids(x, requests)
                    logprob_tensors(x, token_ids, requests)
            # Prompt logprobs on a row slice of the logits, starting at an even and an odd row.
            for first in (0, 1):
                x = logits(first + 3, ties, padded, logits_dtype)
                targets = torch.zeros(3, dtype=torch.int64, device=device)
                prompt_logprob_tensors(x[first : first + 3], targets, 2)
        if torch.device(device).type == "cuda":
            for rows in (1, 3):
                compile_race_switches(logits(rows, False, padded, logits_dtype))


def compile_race_switches(logits: torch.Tensor) -> None:
    """The race kernel at each combination of its data-driven switches: TIES (some row drops
    part of a tie group at its cutoff) and BLOCK_MAX (the top-k candidates' block maxima are
    there). Which combination a sampled batch takes follows from the logits' values, so the
    sampling runs above need not reach every one; launched directly, each is compiled whatever
    the data. (The H200's misses of `_race_kernel` at every start were in the kernel's own key,
    which followed the order kernels were first launched in: see kernels/keyed_noise.py.)"""
    import torch
    import triton

    from pagecast.kernels import sampling

    rows, vocab = logits.shape
    device = logits.device

    def per_row(value: float, dtype: torch.dtype) -> torch.Tensor:
        return torch.full((rows,), value, dtype=dtype, device=device)

    row_max = logits.float().max(dim=1).values
    block_max = row_max[:, None].expand(rows, triton.cdiv(vocab, sampling.TOPK_BLOCK)).contiguous()
    tie_counts = torch.zeros(rows, sampling.num_splits(vocab), dtype=torch.int32, device=device)
    for ties in (False, True):
        for with_block_max in (False, True):
            sampling.race(
                logits, per_row(1.0, torch.float32), per_row(float("-inf"), torch.float32), per_row(0, torch.int64),
                per_row(0, torch.int64), tie_counts if ties else None, row_max,
                per_row(0.0, torch.float32), per_row(0, torch.int64), per_row(0, torch.int64),
                block_max=block_max if with_block_max else None,
            )  # fmt: skip


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


def rejected_note(table: dict[str, Any]) -> str:
    """The report's words for configs the tuner refused because their output disagreed with the
    bucket's first config's (kernels/tuning.output_disagreement; empty when none was): on a sound
    compiler there are none, so each is worth a look (and a Triton bug report)."""
    found = [
        f"{kernel} {bucket} {entry['config']} "
        + ("(NaN/inf or a wrong shape)" if entry.get("error") is None else f"(off by {entry['error']:.3g})")
        for kernel, entries in table.get("kernels", {}).items()
        for bucket, row in entries.items()
        for entry in row.get("rejected", ())
    ]
    if not found:
        return ""
    shown = "; ".join(found[:8]) + (f"; and {len(found) - 8} more" if len(found) > 8 else "")
    return (
        f". {len(found)} config(s) computed a different result from their bucket's default config on this "
        f"GPU and were not used: {shown}"
    )


def pinned_note(table: dict[str, Any], source: Path | None) -> str:
    """The report's words for --tuning-from: how many buckets kept the reused table's configs."""
    if source is None:
        return ""
    entries = [e for kernel in table.get("kernels", {}).values() for e in kernel.values()]
    kept = sum(1 for e in entries if e.get("pinned"))
    return f". Kernel configs of {kept} of {len(entries)} buckets reused from {source} (--tuning-from), the rest tuned here"


def moe_report_lines(table: dict[str, Any] | None, shapes_fields: dict[str, Any]) -> list[str]:
    """report.md's section on the fused-MoE kernel of a MoE build: per token bucket the tuner's
    choice (a fused config, or the per-expert loop of cuBLAS GEMMs it times against), its time, the
    loop's, and how close the choice comes to the bucket's bound: the weight-streaming bound (the
    visited experts' weights and the tokens at the measured copy bandwidth) where that is the
    longer, as at decode buckets, else the compute bound (the matmul FLOPs at the measured bf16
    matmul peak), as at prefill buckets (kernels/problems.moe_bound). Empty for a dense model and
    where nothing was tuned."""
    from pagecast.kernels import problems, tuning

    kernels = (table or {}).get("kernels") or {}
    found = [(k, kernels[k]) for k in tuning.EXPERT_KERNELS if kernels.get(k)]
    if not found:
        return []
    shapes = kernel_shapes(shapes_fields)
    copy_gbs, peak = (table or {}).get("copy_bandwidth_gbs"), (table or {}).get("matmul_tflops")
    lines = [
        "",
        "## Mixture of experts",
        "",
        f"{shapes.num_experts} experts, top {shapes.top_k}, each {shapes.moe_intermediate} wide on this rank. Per token "
        "bucket: the tuner's choice, its time, the per-expert loop of cuBLAS GEMMs it was timed against, and the "
        "fraction of the bucket's bound the choice reaches: the weight-streaming bound (the visited experts' weights "
        f"and the tokens at {copy_gbs or 0:,.0f} GB/s, the copy bandwidth measured here) where that is the longer, "
        f"else the compute bound (its matmul FLOPs at {peak or 0:,.0f} TFLOP/s, a bf16 torch.mm measured here"
        + ("; FP8 tensor cores run about twice that" if found[0][0] == "fused_moe_fp8" else "")
        + ").",
        "",
        "| kernel | tokens | chosen | time (us) | per-expert loop (us) | chosen / loop | bound | fraction of bound |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for kernel, entries in found:
        dims_by_bucket = dict(problems.buckets(kernel, shapes))
        for bucket, entry in entries.items():
            config = entry.get("config") or {}
            chosen = "per-expert loop" if config.get("naive") else ", ".join(f"{k}={v}" for k, v in config.items())
            t, ref = entry.get("time_us"), entry.get("reference_us")
            ratio = f"{t / ref:.2f}" if t and ref else "-"
            bound, fraction = "-", "-"
            if t and copy_gbs and peak and bucket in dims_by_bucket:
                b = problems.moe_bound(shapes, dims_by_bucket[bucket], t, copy_gbs, peak, kernel)
                bound, fraction = f"{b['bound']} ({b['bound_us']:.2f} us)", f"{b['fraction']:.1%}"
            tokens = bucket.removeprefix("t")
            lines.append(f"| {kernel} | {tokens} | {chosen} | {t or 0:.1f} | {ref or 0:.1f} | {ratio} | {bound} | {fraction} |")
    return lines


def time_note(table: dict[str, Any]) -> str:
    """The report's words for where the tuning time went, per kernel, longest first (empty for
    a table without the tuner's timings): first launches are where Triton compiles a config."""
    seconds = table.get("tune_seconds") or {}
    parts = []
    for kernel, spent in sorted(seconds.items(), key=lambda item: -sum(item[1].values())):
        total = sum(spent.values())
        if total >= 0.05:
            parts.append(
                f"{kernel} {total:.1f} s (first launches, which compile: {spent.get('first_launches', 0.0):.1f}; "
                f"timing {spent.get('timing', 0.0):.1f}; problems {spent.get('problems', 0.0):.1f}; "
                f"other {spent.get('other', 0.0):.1f})"
            )
    threads = table.get("compile_threads") or 0
    how = f" (configs compiled {threads} at a time)" if threads > 1 else ""
    return f". Tuning time by kernel{how}: " + "; ".join(parts) if parts else ""


def run(state: BuildState) -> BuildState:
    plan = state.plan
    assert plan is not None and state.staging_dir is not None
    report = dict(state.report)
    if plan.device == "cpu":
        if state.options.tuning_from is not None:
            raise BuildError("--tuning-from reuses GPU kernel configs; a CPU artifact runs the torch reference kernels")
        table: dict[str, Any] = {"device": "cpu", "tuned": False, "kernels": {}}
        report["tuning_note"] = "CPU artifact: the torch reference kernels run; nothing to tune"
        return dataclasses.replace(state, tuning=table, report=report)

    from pagecast.kernels import pdl, tuning

    try:
        pdl_requested = pdl.requested()
    except ValueError as err:
        raise BuildError(str(err)) from None
    pinned = None
    if state.options.tuning_from is not None:
        pinned, _ = pinned_table(Path(state.options.tuning_from))
        if not report.get("gpu_present"):
            raise BuildError(
                f"--tuning-from {state.options.tuning_from}: no {plan.gpu_name} present; the configs it names are "
                "compiled on the GPU, so build there (or leave --tuning-from out for an untuned artifact)"
            )
    if report.get("gpu_present"):
        table, rows = tune_in_subprocess(
            model_shapes(state),
            state.options.tune_budget_s,
            state.staging_dir / TRITON_CACHE_SUBDIR,
            state.options.tune_first,
            pinned,
        )
        copy_gbs = table["copy_bandwidth_gbs"]
        report["bandwidth_rows"] = rows
        report["tuning_note"] = (
            f"tuned on this {plan.gpu_name} within {state.options.tune_budget_s:.0f} s; "
            f"measured copy bandwidth {copy_gbs:,.0f} GB/s"
        ) + pinned_note(table, pinned) + budget_note(table, state.options.tune_budget_s) + rejected_note(table) + time_note(table)
        if table.get("pdl"):
            report["tuning_note"] += (
                f". Decode kernels launch with programmatic dependent launch ({pdl.ENV}=1, experimental)"
            )
    else:
        table = tuning.default_table(plan.gpu_name) or {"device": plan.gpu_name, "tuned": False, "kernels": {}}
        table = dict(table, tuned=False)
        report["tuning_note"] = (
            f"no {plan.gpu_name} present: the shipped default table for {plan.gpu_name} is used "
            f"(artifact marked untuned; rebuild on the GPU to tune)"
        ) + (f"; {pdl.ENV}=1 ignored: programmatic dependent launch is built on the GPU" if pdl_requested else "")
    return dataclasses.replace(state, tuning=table, report=report)


if __name__ == "__main__":
    _tune_main(*sys.argv[1:5])
