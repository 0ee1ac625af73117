"""Pass 4, plan: dtype, device, context length, the artifact's tensor layout and the memory plan.

The tensor layout fuses q/k/v into one ``qkv_proj`` and gate/up into one ``gate_up_proj``
(one GEMM each instead of three and two). Every tensor records the checkpoint tensors it is
made of and, for tensor parallelism, the shard it holds (builder/shard.py); with tp=1 each
tensor is whole on rank 0. An AWQ/GPTQ build plans the float layout, cuts it per rank, then
turns each rank's projections into int4 parts (builder/quant.py).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from pagecast.builder import fp8, kv_cache, quant, shard
from pagecast.builder.families import FAMILIES
from pagecast.builder.ir import BuildState, LayerSpec, ModelIR, MoeSpec, NormSpec, Plan, TensorPlan
from pagecast.builder.lower import yarn_context
from pagecast.runtime.artifact import DEFAULT_STEP_TOKENS
from pagecast.runtime.errors import BuildError

# Known build targets: compute capability and memory, used when the GPU is not present.
GPUS: dict[str, dict[str, Any]] = {
    "h200": {"compute_capability": (9, 0), "memory_bytes": 143_771 * 2**20},
    "h100": {"compute_capability": (9, 0), "memory_bytes": 81_559 * 2**20},
    "a100": {"compute_capability": (8, 0), "memory_bytes": 81_920 * 2**20},
    "l40s": {"compute_capability": (8, 9), "memory_bytes": 46_068 * 2**20},
}
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
# Decode batch sizes that get a CUDA graph (up to --max-num-seqs); a batch is padded up to the next one.
GRAPH_BATCH_SIZES = (
    1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512, 640, 768, 896, 1024,
)  # fmt: skip
MEMORY_FRACTIONS = (0.5, 0.7, 0.8, 0.85, 0.9, 0.95)


def gpu_short_name(device_name: str) -> str:
    """'NVIDIA H200' -> 'h200'; unknown GPUs keep a lower-case slug of their name."""
    lowered = device_name.lower()
    for short in GPUS:
        if short in lowered.replace(" ", ""):
            return short
    return lowered.replace("nvidia", "").strip().replace(" ", "-")


def resolve_target(gpu: str) -> tuple[str, str, tuple[int, int] | None, bool]:
    """--gpu -> (device, gpu name, compute capability, whether that GPU is present here)."""
    present = torch.cuda.is_available()
    here = gpu_short_name(torch.cuda.get_device_name(0)) if present else None
    if gpu == "cpu" or (gpu == "auto" and not present):
        return "cpu", "cpu", None, True
    if gpu == "auto":
        gpu = here  # type: ignore[assignment]
    gpu = gpu.lower()
    if gpu == here:
        return "cuda", gpu, tuple(torch.cuda.get_device_capability(0)), True  # type: ignore[return-value]
    if gpu not in GPUS:
        raise BuildError(f"--gpu {gpu}: unknown GPU; give auto, cpu or one of {', '.join(GPUS)}")
    return "cuda", gpu, GPUS[gpu]["compute_capability"], False


def resolve_dtype(option: str, device: str, config: Any) -> str:
    if option != "auto":
        if device == "cpu" and option == "bfloat16":
            return option  # slow but correct on CPU
        return option
    if device == "cpu":
        return "float32"
    declared = str(getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or "bfloat16")
    declared = declared.replace("torch.", "")
    return declared if declared in ("float16", "bfloat16") else "bfloat16"


def _norm(name: str, norm: NormSpec, shape: tuple[int, ...]) -> TensorPlan:
    return TensorPlan(name, (norm.hf_name,), shape, offset=norm.weight_offset)


# The artifact's names of a layer's norms by role. The two pre-norms keep the names the first
# (Llama-only) layout gave them: "post_attn_norm" is the MLP's input norm there.
NORM_NAMES = {
    "attn_in_norm": "input_norm",
    "attn_out_norm": "attn_out_norm",
    "mlp_in_norm": "post_attn_norm",
    "mlp_out_norm": "mlp_out_norm",
}


def _sections(fused: str | None, names: list[str], sizes: list[int]) -> tuple[str, ...]:
    """The sources of a fused artifact tensor: one checkpoint tensor per part, or row ranges of one
    tensor the checkpoint already fused (Phi-3), so that TP cuts each part alike."""
    if fused is None:
        return tuple(names)
    out, start = [], 0
    for size in sizes:
        out.append(shard.row_range(fused, start, start + size))
        start += size
    return tuple(out)


def tensor_layout(model: ModelIR) -> list[TensorPlan]:
    a, h = model.attention, model.hidden_size
    q_out, kv_out = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
    tensors = [TensorPlan("embed_tokens.weight", (model.embed_name,), (model.vocab_size, h))]
    for layer in model.layers:
        p, o = layer.hf_prefix, f"layers.{layer.index}"
        attn = f"{p}.self_attn"
        qkv_fused = f"{attn}.{a.fused_qkv_name}.weight" if a.fused_qkv_name else None
        rope = layer.attention.rope

        def qk(sources: tuple[str, ...], rope: Any = rope) -> tuple[str, ...]:
            """q and k rows (the first sources) in the kernels' rotary order."""
            if rope is None or not rope.interleaved:
                return sources
            reorder = [shard.deinterleaved(src, a.head_dim, rope.rotary_dim) for src in sources[:2]]
            return (*reorder, *sources[2:])
        if layer.attn_in_norm is not None:
            tensors.append(_norm(f"{o}.input_norm.weight", layer.attn_in_norm, (h,)))
        tensors.append(
            TensorPlan(
                f"{o}.qkv_proj.weight",
                qk(_sections(qkv_fused, [f"{attn}.{x}_proj.weight" for x in "qkv"], [q_out, kv_out, kv_out])),
                (q_out + 2 * kv_out, h),
            )
        )
        if a.qkv_bias:
            tensors.append(
                TensorPlan(
                    f"{o}.qkv_proj.bias",
                    qk(
                        _sections(
                            qkv_fused and qkv_fused.replace(".weight", ".bias"),
                            [f"{attn}.{x}_proj.bias" for x in "qkv"],
                            [q_out, kv_out, kv_out],
                        )
                    ),
                    (q_out + 2 * kv_out,),
                )
            )
        la = layer.attention
        if la.qk_norm and la.qk_norm_weight:  # (Llama 4's weightless norms: the model code's ones)
            q_shape, k_shape = ((a.head_dim,), (a.head_dim,)) if la.qk_norm_kind == "head" else ((q_out,), (kv_out,))
            q_norm, k_norm = qk(tuple(f"{attn}.{name}.weight" for name in la.qk_norm_names))
            tensors += [
                TensorPlan(f"{o}.q_norm.weight", (q_norm,), q_shape, offset=la.qk_norm_offset),
                TensorPlan(f"{o}.k_norm.weight", (k_norm,), k_shape, offset=la.qk_norm_offset),
            ]
        tensors.append(TensorPlan(f"{o}.o_proj.weight", (f"{attn}.o_proj.weight",), (h, q_out)))
        if a.o_bias:
            tensors.append(TensorPlan(f"{o}.o_proj.bias", (f"{attn}.o_proj.bias",), (h,)))
        if layer.attention.sinks:
            tensors.append(TensorPlan(f"{o}.sinks", (f"{attn}.sinks",), (a.num_heads,)))
        if layer.attn_out_norm is not None:
            tensors.append(_norm(f"{o}.attn_out_norm.weight", layer.attn_out_norm, (h,)))
        if layer.mlp_in_norm is not None:
            tensors.append(_norm(f"{o}.post_attn_norm.weight", layer.mlp_in_norm, (h,)))
        if isinstance(layer.mlp, MoeSpec):
            tensors += moe_tensors(layer, layer.mlp, h)
            if layer.mlp_out_norm is not None:
                tensors.append(_norm(f"{o}.mlp_out_norm.weight", layer.mlp_out_norm, (h,)))
            continue
        mlp = layer.mlp
        inter, m = mlp.intermediate_size, f"{p}.{mlp.module}"
        gu_fused = f"{m}.{mlp.fused_gate_up_name}.weight" if mlp.fused_gate_up_name else None
        tensors += [
            TensorPlan(
                f"{o}.gate_up_proj.weight",
                _sections(gu_fused, [f"{m}.gate_proj.weight", f"{m}.up_proj.weight"], [inter, inter]),
                (2 * inter, h),
            ),
            TensorPlan(f"{o}.down_proj.weight", (f"{m}.down_proj.weight",), (h, inter)),
        ]
        if mlp.bias:
            tensors += [
                TensorPlan(
                    f"{o}.gate_up_proj.bias",
                    _sections(
                        gu_fused and gu_fused.replace(".weight", ".bias"),
                        [f"{m}.gate_proj.bias", f"{m}.up_proj.bias"],
                        [inter, inter],
                    ),
                    (2 * inter,),
                ),
                TensorPlan(f"{o}.down_proj.bias", (f"{m}.down_proj.bias",), (h,)),
            ]
        if layer.mlp_out_norm is not None:
            tensors.append(_norm(f"{o}.mlp_out_norm.weight", layer.mlp_out_norm, (h,)))
    tensors.append(_norm("norm.weight", model.final_norm, (h,)))
    if model.lm_head_name is not None:
        tensors.append(TensorPlan("lm_head.weight", (model.lm_head_name,), (model.vocab_size, h)))
    return tensors


def moe_tensors(layer: LayerSpec, moe: MoeSpec, h: int) -> list[TensorPlan]:
    """A MoE layer's tensors in kernels/moe_routing.py's layout: the router, the experts stacked
    (experts.gate_up [E, 2I, H]: each expert's gate rows then up rows; experts.down [E, H, I]) and
    Qwen2-MoE's shared expert as a dense MLP (shared_expert.gate_up_proj, .down_proj) with its gate."""
    p, o = layer.hf_prefix, f"layers.{layer.index}"
    e, inter = moe.num_experts, moe.intermediate_size
    gate, up, down = moe.expert_projections
    ex = f"{p}.{moe.experts_name}"
    # A router whose logits are fp32 (GLM-4.5's, ERNIE 4.5's, HunYuan's: x and the weight cast up, as
    # transformers does) has its weight stored in fp32, so that no step casts it.
    router_dtype = "float32" if moe.router_fp32 else None
    tensors = [TensorPlan(f"{o}.router.weight", (f"{p}.{moe.router_name}.weight",), (e, h), dtype=router_dtype)]
    if moe.router_bias:
        tensors.append(TensorPlan(f"{o}.router.bias", (f"{p}.{moe.router_name}.bias",), (e,)))
    if moe.score_bias:  # sigmoid_group's and softmax_bias's bias for the choice (route's router_bias there)
        bias = f"{p}.{moe.score_bias_name}"
        shape = (1, e) if moe.scoring == "softmax_bias" else (e,)  # ERNIE 4.5 keeps it [1, E]
        tensors.append(TensorPlan(f"{o}.router.score_bias", (bias,), shape, dtype="float32"))  # fp32 as transformers keeps it
    if moe.stacked_names:  # Granite-MoE: our layout already, [E, 2I, H] and [E, H, I]
        x, (gate_up_name, down_name) = shard.expert_source, moe.stacked_names
        gu = f"{p}.{gate_up_name}.weight"
        tensors += [
            TensorPlan(f"{o}.experts.gate_up", tuple(x(gu, i, g) for i in range(e) for g in ("rows0", "rows1")),
                       (e, 2 * inter, h), stack=2),
            TensorPlan(f"{o}.experts.down", tuple(x(f"{p}.{down_name}.weight", i) for i in range(e)),
                       (e, h, inter), stack=1),
        ]  # fmt: skip
        return tensors
    if moe.stacked:  # gpt-oss: [E, H, 2I] gate/up interleaved by column, [E, I, H] down, their biases
        x = shard.expert_source
        tensors += [
            TensorPlan(f"{o}.experts.gate_up", tuple(x(f"{ex}.gate_up_proj", i, g) for i in range(e) for g in ("gate", "up")),
                       (e, 2 * inter, h), stack=2),
            TensorPlan(f"{o}.experts.down", tuple(x(f"{ex}.down_proj", i, "t") for i in range(e)), (e, h, inter), stack=1),
            TensorPlan(f"{o}.experts.gate_up_bias",
                       tuple(x(f"{ex}.gate_up_proj_bias", i, g) for i in range(e) for g in ("gate", "up")),
                       (e, 2 * inter), stack=2),
            TensorPlan(f"{o}.experts.down_bias", tuple(x(f"{ex}.down_proj_bias", i) for i in range(e)), (e, h), stack=1),
        ]  # fmt: skip
        return tensors
    gate_up = tuple(f"{ex}.{i}.{name}.weight" for i in range(e) for name in (gate, up))
    tensors += [
        TensorPlan(f"{o}.experts.gate_up", gate_up, (e, 2 * inter, h), stack=2),
        TensorPlan(f"{o}.experts.down", tuple(f"{ex}.{i}.{down}.weight" for i in range(e)), (e, h, inter), stack=1),
    ]
    if moe.shared_expert_size:
        s, se = moe.shared_expert_size, f"{p}.{moe.shared_expert_name}"
        tensors += [
            TensorPlan(f"{o}.shared_expert.gate_up_proj.weight", (f"{se}.gate_proj.weight", f"{se}.up_proj.weight"), (2 * s, h)),
            TensorPlan(f"{o}.shared_expert.down_proj.weight", (f"{se}.down_proj.weight",), (h, s)),
        ]
        if moe.shared_expert_gate:
            tensors.append(TensorPlan(f"{o}.shared_expert_gate.weight", (f"{se}_gate.weight",), (1, h)))
    return tensors


def check_shapes(tensors: list[TensorPlan], shapes: dict[str, tuple[int, ...]]) -> None:
    """Every source tensor must exist with the shape the IR expects (sources concatenate on dim 0)."""
    for t in tensors:
        if t.stack:  # each group of sources is one expert's [rows, ...] slice of the stacked tensor
            t = dataclasses.replace(t, shape=(t.shape[0] * t.shape[1], *t.shape[2:]), stack=0)
        rows = 0
        for src in map(shard.without_deinterleave, t.sources):
            base, rows_of = shard.parse_source(src)
            if base not in shapes:
                raise BuildError(f"checkpoint is missing tensor {base!r} (needed for {t.name}); is it complete?")
            shape = shapes[base]
            if src != base and rows_of is None:  # one expert's piece of a stacked tensor (gpt-oss)
                shape = shard.expert_source_shape(src, shape)
            if rows_of is not None:
                if rows_of[1] > shape[0]:
                    raise BuildError(f"tensor {base!r} has {shape[0]} rows, expected at least {rows_of[1]} for {t.name}")
                shape = (rows_of[1] - rows_of[0], *shape[1:])
            if tuple(shape[1:]) != tuple(t.shape[1:]):
                raise BuildError(f"tensor {src!r} has shape {list(shape)}, expected [*, {', '.join(map(str, t.shape[1:]))}]")
            rows += shape[0] if shape else 0
        if rows != t.shape[0]:
            raise BuildError(f"tensors {', '.join(t.sources)} give {rows} rows, expected {t.shape[0]} for {t.name}")


def memory_plan(
    model: ModelIR, dtype: str, block_size: int, max_model_len: int, max_num_seqs: int, memory_bytes: int | None,
    weight_bytes: int | None = None, kv_cache_dtype: str | None = None, tp: int = 1, moe_fp8: str = "",
) -> dict[str, Any]:
    """``kv_cache_dtype``: the KV cache's dtype when not the model's (fp8: one byte per element);
    ``moe_fp8``: the FP8 experts' weight scales ("channel" / "block"), "" for half-type experts."""
    a = model.attention
    elt = DTYPE_BYTES[dtype]
    kv_dtype = kv_cache_dtype or dtype
    kv_elt = 1 if kv_dtype == kv_cache.FP8 else DTYPE_BYTES[kv_dtype]
    bytes_per_token = 2 * model.num_layers * a.num_kv_heads * a.head_dim * kv_elt  # K and V, every layer
    bytes_per_block = bytes_per_token * block_size
    n_params = sum(_numel(t.shape) for t in tensor_layout(model))
    weight_bytes = n_params * elt if weight_bytes is None else weight_bytes  # int4 builds pass their own
    # Activations of the largest step: logits in fp32 plus the MLP's widest intermediates, with slack for
    # the allocator and CUDA graph pools.
    max_batched_tokens = max(DEFAULT_STEP_TOKENS, max_num_seqs)  # the engine's default step budget
    activation_bytes = max_batched_tokens * (
        4 * model.vocab_size // 8 + elt * (4 * model.mlp.intermediate_size + 6 * model.hidden_size)
    ) + (512 << 20)
    moe_workspace: dict[str, int] = {}
    if model.moe is not None:
        moe_workspace = moe_workspace_bytes(model, elt, max_batched_tokens, tp, moe_fp8)
        activation_bytes += max(moe_workspace.values())
    stage = prefill_stage_bytes(model, dtype, kv_dtype, block_size, max_model_len, tp)
    activation_bytes += stage
    plan: dict[str, Any] = {
        "kv_cache_dtype": kv_dtype,
        "bytes_per_token": bytes_per_token,
        "bytes_per_block": bytes_per_block,
        "block_size": block_size,
        "weight_bytes": weight_bytes,
        "num_parameters": n_params,
        "activation_bytes": activation_bytes,
        "max_model_len": max_model_len,
        "bytes_per_seq_at_max_model_len": bytes_per_token * max_model_len,  # one sequence filling the context
        "cuda_graph_batch_sizes": [b for b in GRAPH_BATCH_SIZES if b < max_num_seqs] + [max_num_seqs],
        "device_memory_bytes": memory_bytes,
        "budgets": [],
    }
    if moe_workspace:
        plan["moe_workspace_bytes"] = moe_workspace  # per token bucket; the largest is in activation_bytes
    if stage:
        plan["prefill_stage_bytes"] = stage  # in activation_bytes
    windowed = [layer.index for layer in model.layers if layer.attention.sliding_window]
    if windowed:
        plan["sliding_window_layers"] = {
            "layers": windowed,
            "windows": sorted({int(model.layers[i].attention.sliding_window or 0) for i in windowed}),
            # Blocks that fall out of a layer's window are not freed: the block table is shared by all
            # layers, so the figures above count every layer at the full context.
            "kv_blocks": "all kept",
        }
    if memory_bytes:
        for fraction in MEMORY_FRACTIONS:
            kv = int(memory_bytes * fraction) - weight_bytes - activation_bytes
            blocks = max(0, kv // bytes_per_block)
            plan["budgets"].append(
                {
                    "gpu_memory_utilization": fraction,
                    "kv_bytes": max(0, kv),
                    "num_blocks": blocks,
                    "max_tokens": blocks * block_size,
                    "max_seqs_at_max_model_len": blocks * block_size // max_model_len,
                }
            )
    return plan


def prefill_stage_bytes(
    model: ModelIR, dtype: str, kv_dtype: str, block_size: int, max_model_len: int, tp: int
) -> int:
    """The fp16 stage an fp8 cache's long-context prefill may be read through (the tuner's STAGE
    option, kernels/paged_prefill_attention.py): one sequence's K and V at max_model_len, on one
    rank, for one layer at a time. Zero without an fp8 cache or long-context buckets."""
    from pagecast.kernels import paged_prefill_attention
    from pagecast.kernels.tuning import PREFILL_SHORT_CONTEXT, torch_dtype

    if kv_dtype != kv_cache.FP8 or max_model_len <= PREFILL_SHORT_CONTEXT:
        return 0
    a = model.attention
    heads = -(-a.num_kv_heads // tp)
    return paged_prefill_attention.stage_bytes(max_model_len, heads, a.head_dim, block_size, torch_dtype(dtype))


def moe_workspace_bytes(model: ModelIR, elt: int, max_batched_tokens: int, tp: int, fp8_weights: str = "") -> dict[str, int]:
    """The fused-MoE call's own buffers (fused_moe.workspace_bytes) at each token bucket up to the
    largest step, on one rank (experts' intermediate cut by tp), for whichever kernel the tuner
    may pick there: the default config, the naive loop or the widest tiles. Layers run one after
    another, so one layer's workspace is the model's."""
    from pagecast.kernels import fused_moe, fused_moe_fp8
    from pagecast.kernels.tuning import MOE_TOKEN_BUCKETS, KernelConfig

    moe = model.moe
    assert moe is not None
    h, i, k, e = model.hidden_size, moe.intermediate_size // tp, moe.top_k, moe.num_experts
    naive = KernelConfig({"naive": 1}, 4, 1)
    widest = KernelConfig({"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8}, 8, 3)
    # the most a tile allocates: the [rows, 2I] product (SPLIT_ACT) and the gathered tokens (TMA)
    widest_tma = KernelConfig(
        {"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64, "GROUP_M": 8, "SPLIT_ACT": 1, "TMA": 1}, 8, 4
    )
    block = fp8_weights == "block"
    out = {}
    buckets = [b for b in MOE_TOKEN_BUCKETS if b < max_batched_tokens] + [max_batched_tokens]
    for t in buckets:
        if fp8_weights:  # FP8 experts: their launcher's buffers, the quantised activations too
            configs = (fused_moe_fp8.default_config(t, k, e, h, i, block=block), naive, widest)
            out[f"t{t}"] = max(fused_moe_fp8.workspace_bytes(t, k, e, h, i, elt, c, block) for c in configs)
        else:
            configs = (fused_moe.default_config(t, k, e, h, i), naive, widest, widest_tma)
            if fused_moe.GROUPED in fused_moe.CONFIG_SPACE:  # counted once the tuner may pick it
                configs += (fused_moe.GROUPED,)
            out[f"t{t}"] = max(fused_moe.workspace_bytes(t, k, e, h, i, elt, c) for c in configs)
    return out


def check_fits(plan: dict[str, Any], model: ModelIR) -> None:
    """Refuse a build whose weights and largest step do not fit the GPU at the highest
    --gpu-memory-utilization a server can ask for, with the numbers."""
    total = plan.get("device_memory_bytes")
    if not total:
        return
    usable = int(total * MEMORY_FRACTIONS[-1])
    need = plan["weight_bytes"] + plan["activation_bytes"] + plan["bytes_per_block"]
    if need > usable:
        gib = 2**30
        moe = ""
        if "moe_workspace_bytes" in plan:
            moe = f" (of which the MoE workspace at its largest bucket {max(plan['moe_workspace_bytes'].values()) / gib:.2f} GiB)"
        per_rank = " per rank" if plan.get("per_rank") else ""
        raise BuildError(
            f"{model.architecture} does not fit this GPU{per_rank}: weights {plan['weight_bytes'] / gib:.2f} GiB "
            f"({plan['num_parameters']:,} parameters) + activations {plan['activation_bytes'] / gib:.2f} GiB{moe} "
            f"+ one KV block need {need / gib:.2f} GiB, but {MEMORY_FRACTIONS[-1]:.0%} of the GPU's "
            f"{total / gib:.1f} GiB is {usable / gib:.2f} GiB; build with a larger --tp, a smaller --max-num-seqs "
            f"or --quant"
        )


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _context_limit_text(model: ModelIR, config: Any) -> str:
    """The model's context limit (lower._context_limit) and where it comes from, for a refusal."""
    yarn = next(
        (x.attention.rope.params for x in model.layers if x.attention.rope and x.attention.rope.rope_type == "yarn"),
        None,
    )
    limit = model.max_position_embeddings
    if yarn is None:
        return f"the model's max_position_embeddings {limit}"
    mpe = int(getattr(config, "max_position_embeddings", 0) or 0)
    return (
        f"the model's context limit {limit}, the larger of max_position_embeddings {mpe} and yarn's "
        f"original_max_position_embeddings {yarn['original_max_position_embeddings']} x factor {yarn['factor']} "
        f"= {yarn_context(yarn)}"
    )


def run(state: BuildState) -> BuildState:
    opts, ckpt, model = state.options, state.checkpoint, state.model
    assert model is not None
    device, gpu_name, cc, present = resolve_target(opts.gpu)
    dtype = resolve_dtype(opts.dtype, device, ckpt.config)
    max_len = opts.max_model_len or model.max_position_embeddings
    if opts.max_model_len and opts.max_model_len > model.max_position_embeddings:
        raise BuildError(f"--max-model-len {opts.max_model_len} exceeds {_context_limit_text(model, ckpt.config)}")
    notes = []
    window = getattr(ckpt.config, "sliding_window", None)
    if FAMILIES[model.architecture].window_source != "cap":
        # the kernels honour each layer's window; every block of a sliding layer is kept
        if any(layer.attention.sliding_window for layer in model.layers):
            notes.append("sliding-window layers keep every KV block of their sequence (none is freed early)")
    elif getattr(ckpt.config, "use_sliding_window", True) and isinstance(window, int) and window < max_len:
        # Within the window sliding-window attention equals full attention; beyond it we would be wrong.
        notes.append(f"max_model_len capped from {max_len} to the sliding window {window}")
        max_len = window
    tensors = tensor_layout(model)
    if opts.fp8_scheme is not None:
        ckpt.quant = fp8.with_scheme(ckpt.quant, opts.fp8_scheme)
    if opts.fp8_lm_head:
        ckpt.quant = fp8.with_lm_head(ckpt.quant, model)
    if fp8.is_fp8(ckpt.quant) and model.moe is not None:  # FP8 experts (builder/fp8.py, kernels/fused_moe_fp8.py)
        fp8.check_moe(ckpt.quant, model.moe, model.architecture)
    elif ckpt.quant is not None and model.moe is not None and model.moe.stacked:
        raise BuildError(
            f"{model.architecture}: {ckpt.quant.method.upper()} builds of this mixture-of-experts model are not "
            f"supported (int4 AWQ/GPTQ experts are, one module per expert, SiLU experts without biases); build the "
            f"half-type checkpoint"
        )
    # FP8 rows (from a float checkpoint, or an FP8 one's with their per-row scales) reorder as float ones do
    if ckpt.quant is not None and not fp8.is_fp8(ckpt.quant) and any(x.attention.rope and x.attention.rope.interleaved for x in model.layers):
        raise BuildError(
            f"{model.architecture} rotates adjacent pairs of dims (interleaved RoPE), which pagecast builds by "
            f"reordering the q and k rows of float or FP8 weights; {ckpt.quant.method.upper()} checkpoints of it "
            f"are not supported (build the bf16 checkpoint, with --quant fp8 for FP8 weights)"
        )
    if ckpt.quant is not None and (model.attention.fused_qkv_name or model.mlp.fused_gate_up_name):
        raise BuildError(
            f"{model.architecture} keeps q/k/v or gate/up fused in one checkpoint tensor; AWQ/GPTQ builds of "
            f"such checkpoints are not supported"
        )
    if not ckpt.dummy:
        if ckpt.quant is not None:  # the projections are AWQ/GPTQ modules, checked in their format
            quant.check_tensors(tensors, ckpt.quant, ckpt.tensor_shapes)
        check_shapes([t for t in tensors if ckpt.quant is None or not quant.is_quantised(t)], ckpt.tensor_shapes)
    layout = shard.plan_layout(model, opts.tp)
    tensors = shard.shard_tensors(tensors, model, layout)
    if ckpt.quant is not None:  # each rank's projections become int4 parts (builder/quant.py)
        tensors, quant_notes = quant.plan_tensors(tensors, ckpt.quant, dtype, None if ckpt.dummy else ckpt.tensor)
        notes += quant_notes
    kv_plan, kv_notes = kv_cache.plan_kv_cache(
        opts.kv_cache_dtype, dtype, device, cc, gpu_name, ckpt, model.num_layers, [layer.hf_prefix for layer in model.layers]
    )
    notes += kv_notes
    memory_bytes = None
    if device == "cuda":
        memory_bytes = torch.cuda.get_device_properties(0).total_memory if present else GPUS[gpu_name]["memory_bytes"]
    plan = Plan(
        dtype=dtype,
        device=device,
        gpu_name=gpu_name,
        compute_capability=cc,
        block_size=opts.block_size,
        tp=opts.tp,
        quant=ckpt.quant.method if ckpt.quant is not None else None,
        max_model_len=max_len,
        max_num_seqs=opts.max_num_seqs,
        tensors=tuple(tensors),
        memory=shard.per_rank_memory(
            memory_plan(
                model, dtype, opts.block_size, max_len, opts.max_num_seqs, memory_bytes,
                weight_bytes=quant.weight_bytes(tensors, DTYPE_BYTES[dtype]) if ckpt.quant is not None else None,
                kv_cache_dtype=kv_plan.dtype, tp=opts.tp,
                moe_fp8=ckpt.quant.weights if fp8.is_fp8(ckpt.quant) else "",
            ),
            layout, tensors, DTYPE_BYTES[dtype],
        ),
        quantization=ckpt.quant,
        kv_cache=kv_plan,
    )
    if model.moe is not None:
        check_fits(plan.memory, model)
    report = dict(state.report)
    report["plan_notes"] = notes
    report["gpu_present"] = present
    return dataclasses.replace(state, plan=plan, report=report)
