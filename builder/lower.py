"""Pass 3, lower: read the trace into a per-layer description made of parts.

The family table (builder/families.py) says which module plays which role; the trace says
what each one does: the norm kind (RMSNorm with w or 1 + w), the activation, biases, the
attention's scale, whether it rotates (no-RoPE layers), its window and logit soft-cap, the
residual, embedding and logit multipliers, the final soft-cap. Every module the trace saw
must be claimed by a role and contain only the ops that role allows. Anything else stops
the build with the module and the op named: an engine that silently skipped an op would
generate wrong text.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from pagecast.builder.families import FAMILIES, FamilyParts, supported_list
from pagecast.builder.ir import (
    AttentionSpec,
    BuildState,
    LayerSpec,
    MlpSpec,
    ModelIR,
    MoeSpec,
    NormSpec,
    QueryTemperature,
    RopeSpec,
)
from pagecast.builder.trace import ModuleTrace, TraceSummary
from pagecast.kernels.rope import SUPPORTED_ROPE_TYPES
from pagecast.runtime.errors import BuildError

_RMSNORM_OPS = {"to", "pow", "mean", "add", "rsqrt", "mul", "type_as"}
_ATTENTION_CORE_OPS = {
    "view", "transpose", "unsqueeze", "mul", "slice", "neg", "cat", "add", "expand", "reshape",
    "scaled_dot_product_attention", "contiguous", "to", "clamp_",
    "repeat_interleave", "stack", "flatten",  # RoPE on adjacent pairs (GLM, Helium, ERNIE 4.5)
    "dropout",  # Seed-OSS's residual dropout: the trace runs in eval mode, where it is the identity
}  # fmt: skip
# Llama 4's attention: RoPE on adjacent pairs as complex multiplies; on its no-RoPE layers the
# queries scaled by log1p(floor((p + 1) / floor_scale)) * attn_scale + 1 (attention temperature),
# on Ministral 3's every layer by 1 + beta * log(1 + floor(p / original_context)) (ir.QueryTemperature).
_COMPLEX_ROPE_OPS = {"view_as_complex", "view_as_real", "type_as"}
_TEMPERATURE_OPS = {"arange", "div", "floor", "log1p", "log"}
# gpt-oss's eager attention with sinks: scores by matmul, the per-head sink logit concatenated as
# one more column, softmax, the sink column dropped; its rotary splits halves with chunk.
_SINK_ATTENTION_OPS = {
    "view", "transpose", "unsqueeze", "chunk", "mul", "sub", "add", "cat", "expand", "reshape", "matmul", "max",
    "softmax", "slice", "dropout", "to", "contiguous",
}  # fmt: skip
# A sparse-MoE block (transformers 5): the block reshapes and, with a shared expert, gates and adds
# it; the router scores, takes the top k and may renormalise; the experts module sorts the
# (token, expert) pairs, runs a grouped GEMM per projection and sums each token's rows.
_MOE_BLOCK_OPS = {"view", "reshape", "to", "sigmoid", "mul", "add"}  # to: ERNIE 4.5's cast back to x's dtype
# Llama 4's: x repeated once a top-k slot, scaled by the routing weights (every expert's, zero but the
# chosen one's), its experts' outputs summed and the shared expert's added
_WEIGHTS_ON_INPUT_BLOCK_OPS = ["reshape", "repeat", "transpose", "reshape", "mul", "reshape", "sum", "add_"]
_TOPK_SIGMOID_ROUTER_OPS = ["linear", "topk", "full_like", "scatter_", "sigmoid"]
_BATCHED_EXPERTS_OPS = ["view", "bmm", "chunk", "mul", "bmm", "view"]  # Llama 4's: every expert on its rows
_MOE_ROUTER_OPS = {"reshape", "view", "linear", "to", "type_as", "softmax", "topk", "sum", "div", "div_"}
# DeepSeek-V3's routing (GLM-4.5), in transformers' order, reshapes and casts aside: fp32 logits,
# sigmoid scores, the biased scores' best two per group summed, the best groups kept (a mask),
# the top-k of the rest, the unbiased scores gathered, renormalised or not, scaled.
# MiniMax-M2's has no groups and no scale (and no 1e-20 in its renormalisation).
_SHAPE_OPS = ("view", "reshape", "to", "float", "unsqueeze", "expand")
_SIGMOID_CHOICE = ["linear", "sigmoid", "add", "topk", "sum", "topk", "zeros_like", "scatter_", "bitwise_not",
                   "masked_fill", "topk", "gather"]  # fmt: skip
_MOE_SIGMOID_ROUTER_OPS = (*_SHAPE_OPS, *_SIGMOID_CHOICE, "div_", "mul")


# ERNIE 4.5's: fp32 logits, softmax, the top-k of the biased probabilities (moe_statics adds the
# bias), the unbiased ones gathered and renormalised (the sum clamped below).
_SOFTMAX_BIAS_ROUTER_OPS = ["linear", "softmax", "topk", "gather", "sum", "clamp", "div"]


def _sigmoid_router_ops(routing: Any) -> list[str]:
    if routing.fp32_logits:  # GLM-4.5 (its groups' ops run even with one group)
        return [*_SIGMOID_CHOICE, *(["sum", "add", "div_"] if routing.renormalize else []), "mul"]
    return ["linear", "sigmoid", "add", "topk", "gather", "sum", "div_"]


_MOE_EXPERTS_OPS = {
    "reshape", "view", "sort", "floor_divide", "index", "to", "histc", "cumsum", "ge", "unsqueeze", "clamp_",
    "masked_fill_", "masked_fill", "transpose", "grouped_mm_fallback", "_grouped_mm", "chunk", "mul", "empty_like",
    "arange", "index_put_", "sum",
}  # fmt: skip
# gpt-oss's experts add biases and apply the clamped SwiGLU inline.
_MOE_EXPERTS_OPS_OAI = _MOE_EXPERTS_OPS | {"add_", "slice", "clamp", "sigmoid", "add"}
# The decoder stack module builds position ids and the causal / sliding-window masks (the runtime
# builds its own); the only op it may apply to the hidden states is a scalar multiply (Granite's
# embedding multiplier).
_DECODER_STACK_OPS = {
    "arange", "add", "sub", "unsqueeze", "slice", "diff", "ne", "eq", "le", "lt", "ge", "gt", "cumsum",
    "new_ones", "to", "__and__", "__or__", "index", "expand", "mul", "where",
    "zeros", "floor_divide",  # chunked-attention masks (Llama 4)
}  # fmt: skip
# The HF rotary module only builds its cos/sin table (the engine builds its own from the config);
# depending on the transformers version those ops are traced inside a no_grad region or inline.
_ROTARY_TABLE_OPS = {
    "no_grad_region", "unsqueeze", "expand", "to", "_to_copy", "float", "matmul", "bmm", "transpose", "cat",
    "cos", "sin", "mul", "view", "reshape", "slice", "contiguous", "clone", "autocast", "_set_grad_enabled",
}  # fmt: skip


def _unsupported(mod: ModuleTrace, op: str, role: str) -> BuildError:
    return BuildError(
        f"unsupported op {op!r} in module {mod.path} ({mod.type_name}), matched as {role}: "
        f"pagecast has no lowering for it and cannot build this model correctly "
        f"(supported families: {supported_list()})"
    )


class _Matcher:
    def __init__(self, trace: TraceSummary):
        self.trace = trace
        self.claimed: set[str] = set()

    def take(self, path: str, role: str, required: bool = True) -> ModuleTrace | None:
        mod = self.trace.get(path)
        if mod is None:
            if required:
                raise BuildError(f"expected module {path} ({role}) was not found in the traced model")
            return None
        self.claimed.add(path)
        return mod

    def only(self, mod: ModuleTrace, allowed: set[str], role: str) -> None:
        for op in mod.ops:
            if op not in allowed:
                raise _unsupported(mod, op, role)

    def rmsnorm(self, path: str, required: bool = True) -> NormSpec | None:
        """x * rsqrt(mean(x^2) + eps) * w, or Gemma's x * rsqrt(...) * (1 + w)."""
        mod = self.take(path, "RMSNorm", required)
        if mod is None:
            return None
        self.only(mod, _RMSNORM_OPS, "RMSNorm")
        adds = mod.scalar_adds
        plain = len(adds) == 1 and mod.ops.count("add") == 1
        offset = len(adds) == 2 and adds[1] == 1.0 and mod.ops.count("add") == 2  # (1 + w)
        if "rsqrt" not in mod.ops or not (plain or offset):
            raise BuildError(
                f"module {path} ({mod.type_name}) is neither x * rsqrt(mean(x^2) + eps) * w nor its (1 + w) "
                f"variant (ops {mod.ops}); this norm variant is not supported"
            )
        return NormSpec(hf_name=f"{path}.weight", eps=adds[0], weight_offset=1.0 if offset else 0.0)

    def l2norm(self, path: str) -> NormSpec | None:
        """Llama 4's weightless q/k norm, x * rsqrt(mean(x^2) + eps), one module called on q and on
        k; None where the layer has none."""
        mod = self.take(path, "L2 norm", required=False)
        if mod is None:
            return None
        once = ["to", "pow", "mean", "add", "rsqrt", "mul", "type_as"]
        calls = len(mod.ops) // len(once)
        if calls not in (1, 2) or mod.ops != once * calls or len(set(mod.scalar_adds)) != 1:
            raise BuildError(f"module {path} ({mod.type_name}) is not x * rsqrt(mean(x^2) + eps) (ops {mod.ops}); not supported")
        return NormSpec(hf_name="", eps=mod.scalar_adds[0])

    def linear(self, path: str) -> bool:
        mod = self.take(path, "linear projection")
        assert mod is not None
        self.only(mod, {"linear"}, "linear projection")
        return bool(mod.linear_has_bias)


def _number_list(v: Any) -> bool:
    return isinstance(v, (list, tuple)) and all(isinstance(x, (int, float)) for x in v)


def _config_layer_type(config: Any, i: int) -> str | None:
    """config.layer_types[i] ("sliding_attention", "full_attention", ...), None where the config has none."""
    types = getattr(config, "layer_types", None)
    return str(types[i]) if isinstance(types, (list, tuple)) and i < len(types) else None


def _rope(config: Any, head_dim: int, layer_type: str | None = None) -> RopeSpec:
    params = dict(getattr(config, "rope_parameters", None) or {})
    per_type = {k: v for k, v in params.items() if isinstance(v, dict)}
    if per_type:  # Gemma 3, OLMo 3: one set of parameters per layer type
        if layer_type not in per_type:
            raise BuildError(
                f"rope_parameters has one set per layer type ({', '.join(sorted(per_type))}) and the layer's type "
                f"{layer_type!r} is not among them; not supported"
            )
        params = dict(per_type[layer_type])
    if "rope_theta" not in params:
        params["rope_theta"] = getattr(config, "rope_theta", 10000.0)
    rope_type = params.get("rope_type", params.get("type", "default"))
    arch = (getattr(config, "architectures", None) or [""])[0]
    if rope_type == "dynamic" and params.get("alpha") and arch.startswith("HunYuan"):
        # HunYuan's "dynamic" with alpha is a fixed NTK-alpha base (its rotary module computes it once):
        # theta * alpha ** (head_dim / (head_dim - 2)), the default rotation otherwise
        alpha = float(params["alpha"])
        params = {k: v for k, v in params.items() if k not in ("alpha", "factor", "type")}
        params["rope_theta"] = float(params["rope_theta"]) * alpha ** (head_dim / (head_dim - 2))
        rope_type = "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise BuildError(f"rope_type {rope_type!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})")
    params["rope_type"] = rope_type
    if rope_type in ("yarn", "longrope"):
        # the ratio of the context lengths stands in for a missing factor (Phi-3)
        params.setdefault("max_position_embeddings", int(getattr(config, "max_position_embeddings", 2048)))
        original = getattr(config, "original_max_position_embeddings", None)
        if original is not None:
            params.setdefault("original_max_position_embeddings", int(original))
        if "original_max_position_embeddings" not in params:
            raise BuildError(f"rope_type {rope_type!r} without original_max_position_embeddings; not supported")
        if rope_type == "yarn" and params.get("factor") is None:
            params["factor"] = params["max_position_embeddings"] / params["original_max_position_embeddings"]
    partial = float(params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0) or 1.0))
    clean = {k: (list(v) if _number_list(v) else v) for k, v in params.items() if isinstance(v, (int, float, str)) or _number_list(v)}
    return RopeSpec(rope_type=rope_type, params=clean, rotary_dim=int(head_dim * partial))


def _context_limit(config: Any, layers: list[LayerSpec]) -> int:
    """The longest context the model serves: config.max_position_embeddings, or with yarn
    original_max_position_embeddings x factor where that is longer, as vLLM derives it. Qwen's
    docs enable 128k by adding yarn (factor 4 over 32,768) and leave max_position_embeddings at
    40,960 (Qwen3) or 32,768 (Qwen2.5); the rope itself only reads factor and the original length."""
    limit = int(getattr(config, "max_position_embeddings", 2048))
    for layer in layers:
        rope = layer.attention.rope
        if rope is not None and rope.rope_type == "yarn":
            limit = max(limit, yarn_context(rope.params))
    return limit


def yarn_context(params: dict[str, Any]) -> int:
    """original_max_position_embeddings x factor of a yarn rope's parameters (as _rope fills them)."""
    return int(params["original_max_position_embeddings"] * params["factor"])


def _logits(mod: ModuleTrace) -> tuple[float, float | None]:
    """The causal-LM wrapper's ops on the logits -> (divisor, final soft-cap)."""
    if mod.ops == []:
        return 1.0, None
    if mod.ops == ["div"] and len(mod.scalar_divs) == 1:  # Granite: logits / logits_scaling
        return mod.scalar_divs[0], None
    if mod.ops == ["div", "tanh", "mul"] and mod.scalar_divs == mod.scalar_muls and len(mod.scalar_divs) == 1:
        return 1.0, mod.scalar_divs[0]  # Gemma 2: cap * tanh(logits / cap)
    op = next((o for o in mod.ops if o not in ("div", "tanh", "mul")), mod.ops[0])
    raise _unsupported(mod, op, "causal LM head (logit scaling or soft-capping)")


def lower(trace: TraceSummary, config: Any, family: str, architecture: str) -> ModelIR:
    parts = FAMILIES.get(architecture)
    if parts is None:
        raise BuildError(f"architecture {architecture!r} has no lowering (supported families: {supported_list()})")
    m = _Matcher(trace)
    num_heads = config.num_attention_heads
    num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
    if num_heads % num_kv_heads:
        raise BuildError(f"num_attention_heads {num_heads} is not a multiple of num_key_value_heads {num_kv_heads}")

    embed = m.take("model.embed_tokens", "token embedding")
    assert embed is not None
    embedding_multiplier, in_dtype = 1.0, False
    if embed.ops == ["embedding", "to", "mul"] and "scalar_embed_scale" in embed.attributes:
        # Gemma: the embedding times sqrt(hidden), that scale first rounded to the model's dtype
        embedding_multiplier, in_dtype = float(embed.attributes["scalar_embed_scale"]), True
    else:
        m.only(embed, {"embedding"}, "token embedding")
    stack = m.take("model", "decoder stack")
    assert stack is not None
    m.only(stack, _DECODER_STACK_OPS, "decoder stack (position ids and masks)")
    if stack.ops.count("mul") != len(stack.scalar_muls) or len(stack.scalar_muls) > 1:
        raise _unsupported(stack, "mul", "decoder stack (only a scalar embedding multiplier is supported)")
    if stack.scalar_muls:
        if embedding_multiplier != 1.0:
            raise _unsupported(stack, "mul", "decoder stack (a second embedding multiplier)")
        embedding_multiplier = stack.scalar_muls[0]  # Granite's embedding_multiplier
    wrapper = m.take("", "causal LM wrapper")
    assert wrapper is not None
    logits_divisor, final_softcap = _logits(wrapper)
    rotary = m.take("model.rotary_emb", "rotary table", required=False)
    if rotary is not None:
        m.only(rotary, _ROTARY_TABLE_OPS, "rotary table")

    layers = [_layer(m, config, parts, i, num_heads, num_kv_heads, head_dim) for i in range(config.num_hidden_layers)]

    final_norm = m.rmsnorm("model.norm")
    assert final_norm is not None
    tied = bool(getattr(config, "tie_word_embeddings", False))
    head = m.take("lm_head", "LM head")
    assert head is not None
    m.only(head, {"linear"}, "LM head")
    if head.linear_has_bias:
        raise BuildError("lm_head has a bias; not supported")

    unclaimed = [p for p in trace.modules if p not in m.claimed]
    if unclaimed:
        mod = trace.modules[unclaimed[0]]
        raise BuildError(
            f"module {mod.path} ({mod.type_name}, ops {mod.ops}) is not part of any supported pattern; "
            f"pagecast cannot build this model (supported families: {supported_list()})"
        )
    first = layers[0]
    for layer in layers[1:]:
        # Dense and MoE layers may mix (Qwen2-MoE's mlp_only_layers); each kind must agree with its own.
        like = next(x for x in layers if x.mlp.kind == layer.mlp.kind)
        same = (
            layer.attention.shape_key() == first.attention.shape_key()
            and layer.mlp == like.mlp
            and layer.placement() == first.placement()
            and layer.residual_multiplier == first.residual_multiplier
        )
        if not same:
            raise BuildError(
                f"layer {layer.index} differs in shape, norms or MLP from layer 0; heterogeneous layers are not supported"
            )
    if len({layer.attention.qk_norm_key() for layer in layers} - {None}) > 1:
        raise BuildError("the layers' q/k norms differ in kind, eps or placement; not supported")
    rotary_dims = {layer.attention.rope.rotary_dim for layer in layers if layer.attention.rope is not None}
    if len(rotary_dims) > 1:
        raise BuildError(f"layers rotate different numbers of dimensions ({sorted(rotary_dims)}); not supported")

    return ModelIR(
        family=family,
        architecture=architecture,
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        layers=tuple(layers),
        final_norm=final_norm,
        tie_word_embeddings=tied,
        embed_name="model.embed_tokens.weight",
        lm_head_name=None if tied else "lm_head.weight",
        max_position_embeddings=_context_limit(config, layers),
        embedding_multiplier=embedding_multiplier,
        embedding_multiplier_in_dtype=in_dtype,
        logits_divisor=logits_divisor,
        final_logit_softcap=final_softcap,
    )


def _layer(
    m: _Matcher, config: Any, parts: FamilyParts, i: int, num_heads: int, num_kv_heads: int, head_dim: int
) -> LayerSpec:
    p = f"model.layers.{i}"
    layer = m.take(p, "decoder layer")
    assert layer is not None
    residual_multiplier = 1.0
    if layer.ops == ["mul", "add", "mul", "add"] and len(set(layer.scalar_muls)) == 1 and len(layer.scalar_muls) == 2:
        residual_multiplier = layer.scalar_muls[0]  # Granite: residual + branch * multiplier
    elif [op for op in layer.ops if op != "view"] != ["add", "add"]:  # (Llama 4 views the MLP's output)
        raise BuildError(
            f"decoder layer {p} ({layer.type_name}) is not two residual branches (ops {layer.ops}); not supported"
        )
    norms = {
        role: (m.rmsnorm(f"{p}.{name}") if name is not None else None)
        for role, name in (
            ("attn_in_norm", parts.attn_in_norm),
            ("attn_out_norm", parts.attn_out_norm),
            ("mlp_in_norm", parts.mlp_in_norm),
            ("mlp_out_norm", parts.mlp_out_norm),
        )
    }
    for name in parts.identities:
        mod = m.take(f"{p}.{name}", "identity at inference (dropout)")
        assert mod is not None
        m.only(mod, {"dropout"}, "identity at inference (dropout)")

    attn = f"{p}.self_attn"
    biases = [m.linear(f"{attn}.{name}") for name in parts.qkv]
    o_bias = m.linear(f"{attn}.o_proj")
    if len(set(biases)) != 1:
        raise BuildError(f"{attn}: q/k/v projections disagree on bias; not supported")
    if parts.qk_norm_weightless:  # Llama 4: one weightless module normalises q and k
        q_norm = k_norm = m.l2norm(f"{attn}.{parts.qk_norm_names[0]}")
    else:
        q_norm = m.rmsnorm(f"{attn}.{parts.qk_norm_names[0]}", required=False)
        k_norm = m.rmsnorm(f"{attn}.{parts.qk_norm_names[1]}", required=False)
    if (q_norm is None) != (k_norm is None):
        raise BuildError(f"{attn} has a norm on only one of q and k; not supported")
    if q_norm is not None and k_norm is not None and (q_norm.eps, q_norm.weight_offset) != (k_norm.eps, k_norm.weight_offset):
        raise BuildError(f"{attn}: the q and k norms differ in eps or kind; not supported")
    core = m.take(attn, "attention core")
    assert core is not None
    sinks = bool(core.attributes.get("sinks"))
    temperature = None  # Llama 4's no-RoPE layers', Ministral 3's (lower._temperature)
    if sinks:
        m.only(core, _SINK_ATTENTION_OPS, "attention with sinks")
        if not {"matmul", "cat", "softmax", "max"} <= set(core.ops) or "scaling" not in core.attributes:
            raise BuildError(f"{attn} ({core.type_name}) has sinks but is not the sink attention pattern; not supported")
        clip_qkv = None
        rotates = "chunk" in core.ops  # gpt-oss rotates halves split by chunk (the same rotation as rotate_half)
        scale = float(core.attributes["scaling"])
    else:
        temperature = _temperature(core, config)
        extra = (_COMPLEX_ROPE_OPS if parts.complex_rope else set()) | (_TEMPERATURE_OPS if temperature else set())
        m.only(core, _ATTENTION_CORE_OPS | extra, "attention")
        clip_qkv = _clip_qkv(core, parts)
        if "scaled_dot_product_attention" not in core.ops:
            raise BuildError(f"{attn} ({core.type_name}) is not scaled-dot-product attention")
        rotates = "neg" in core.ops or "view_as_complex" in core.ops
        scale = float(core.sdpa_kwargs.get("scale", head_dim**-0.5))
    if temperature is not None and (temperature.kind == "llama4") == rotates:
        raise BuildError(
            f"{attn}: a {temperature.kind} query temperature on a {'RoPE' if rotates else 'no-RoPE'} layer; not supported "
            f"(Llama 4 has it on its no-RoPE layers, Ministral 3 after RoPE)"
        )
    if core.attributes.get("is_causal") is False:
        raise BuildError(f"{attn} ({core.type_name}) is bidirectional attention; only causal decoders are supported")
    if "use_rope" in core.attributes and bool(core.attributes["use_rope"]) != rotates:
        raise BuildError(f"{attn}: use_rope={core.attributes['use_rope']} but the trace says otherwise; not supported")
    window = None
    if parts.window_source == "layer":
        window = core.attributes.get("sliding_window")
    elif parts.window_source == "config":
        window = getattr(config, "sliding_window", None)
    elif parts.window_source == "layer_types":
        configured = _config_layer_type(config, i)
        if configured is None:
            raise BuildError(f"{attn}: the family's windows come from config.layer_types, which has no entry for layer {i}")
        window = getattr(config, "sliding_window", None) if configured == "sliding_attention" else None
    softcap = core.attributes.get("attn_logit_softcapping")
    layer_type = core.attributes.get("layer_type")
    if not isinstance(layer_type, str):  # OLMo 3's attention keeps it as attention_type: the config has it
        layer_type = _config_layer_type(config, i)
    chunk = None
    if _config_layer_type(config, i) == "chunked_attention":  # Llama 4: its RoPE layers
        chunk = getattr(config, "attention_chunk_size", None)
        if not chunk or window:
            raise BuildError(f"{attn}: a chunked-attention layer without attention_chunk_size, or with a window; not supported")
    rope = _rope(config, head_dim, layer_type) if rotates else None
    if rope is not None and "view_as_complex" in core.ops:  # Llama 4: pairs of adjacent dims as complex numbers
        rope = dataclasses.replace(rope, interleaved=True)
    if rope is not None and "repeat_interleave" in core.ops:
        # cos/sin repeated per adjacent pair: the GPT-J rotation, built by reordering q and k rows
        if not {"stack", "flatten"} <= set(core.ops):
            raise BuildError(f"{attn} ({core.type_name}) repeats its rotary table but is not the adjacent-pair rotation")
        rope = dataclasses.replace(rope, interleaved=True)

    mlp_path = f"{p}.{parts.moe_module}" if parts.moe_block is not None else f"{p}.mlp"
    if m.trace.get(mlp_path) is None:
        mlp_path = f"{p}.mlp"
    if m.trace.get(f"{mlp_path}.experts") is not None:
        mlp_spec: MlpSpec | MoeSpec = _moe(m, config, parts, mlp_path)
    else:
        mlp_spec = _dense_mlp(m, config, parts, mlp_path)
    return LayerSpec(
        index=i,
        hf_prefix=p,
        attention=AttentionSpec(
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            qkv_bias=biases[0],
            o_bias=o_bias,
            qk_norm=q_norm is not None,
            qk_norm_eps=q_norm.eps if q_norm is not None else None,
            scale=scale,
            rope=rope,
            qk_norm_kind=parts.qk_norm_kind if q_norm is not None else None,
            qk_norm_offset=q_norm.weight_offset if q_norm is not None else 0.0,
            qk_norm_after_rope=q_norm is not None and parts.qk_norm_after_rope,
            qk_norm_names=parts.qk_norm_names,
            sliding_window=int(window) if window else None,
            logit_softcap=float(softcap) if softcap else None,
            fused_qkv_name=parts.qkv[0] if len(parts.qkv) == 1 else None,
            clip_qkv=clip_qkv,
            sinks=sinks,
            qk_norm_weight=not parts.qk_norm_weightless,
            attention_chunk=int(chunk) if chunk else None,
            query_temperature=temperature,
        ),
        mlp=mlp_spec,
        residual_multiplier=residual_multiplier,
        **norms,  # type: ignore[arg-type]
    )


def _temperature(core: ModuleTrace, config: Any) -> QueryTemperature | None:
    """The queries' position-dependent scale, None where the layer has none: Llama 4's attention
    temperature (log1p(floor((p + 1) / floor_scale)) * attn_scale + 1, its no-RoPE layers) or
    Ministral 3's llama_4_scaling (1 + beta * log(1 + floor(p / original_max_position_embeddings)),
    after RoPE). Anything else that scales queries by position is refused, with what the trace saw."""
    if "log1p" in core.ops:
        kind = "llama4"
        divisor, multiplier = getattr(config, "floor_scale", None), getattr(config, "attn_scale", None)
        settings = f"floor_scale {divisor}, attn_scale {multiplier}"
        enabled = bool(getattr(config, "attn_temperature_tuning", False))
    elif "log" in core.ops and "floor" in core.ops:
        kind = "llama_4_scaling"
        rope = getattr(config, "rope_parameters", None) or {}
        divisor, multiplier = rope.get("original_max_position_embeddings"), rope.get("llama_4_scaling_beta")
        settings = f"rope_parameters original_max_position_embeddings {divisor}, llama_4_scaling_beta {multiplier}"
        enabled = True
    else:
        return None
    if (
        not enabled or divisor is None or multiplier is None or not float(divisor) > 0
        or core.scalar_divs != [float(divisor)] or core.scalar_muls != [float(multiplier)]
    ):  # fmt: skip
        raise BuildError(
            f"{core.path} ({core.type_name}) scales its queries by position (ops {core.ops}, divides by "
            f"{core.scalar_divs}, multiplies by {core.scalar_muls}) other than as the {kind} query temperature "
            f"({settings}); not supported"
        )
    return QueryTemperature(kind, float(divisor), float(multiplier))


def _clip_qkv(core: ModuleTrace, parts: FamilyParts) -> float | None:
    """OLMoE's clip_qkv: q, k and v each clamped to [-c, c] after the q/k norms."""
    if not core.clamps:
        return None
    bounds = {(lo, hi) for lo, hi in core.clamps}
    if len(core.clamps) != 3 or len(bounds) != 1:
        raise _unsupported(core, "clamp_", "attention (only q, k and v clamped alike, as clip_qkv does)")
    lo, hi = bounds.pop()
    if not isinstance(hi, (int, float)) or lo != -hi or hi <= 0 or parts.qk_norm_kind != "projection":
        raise _unsupported(core, "clamp_", "attention (clip_qkv after whole-projection q/k norms)")
    return float(hi)


def _dense_mlp(m: _Matcher, config: Any, parts: FamilyParts, mlp_path: str) -> MlpSpec:
    mlp_biases = [m.linear(f"{mlp_path}.{name}") for name in parts.gate_up]
    down_bias = m.linear(f"{mlp_path}.down_proj")
    if len({*mlp_biases, down_bias}) != 1:
        raise BuildError(f"{mlp_path}: gate/up/down projections disagree on bias; not supported")
    mlp = m.take(mlp_path, "gated MLP")
    assert mlp is not None
    # dropout: Seed-OSS's on the MLP's output, the identity in the eval-mode trace
    m.only(mlp, {"mul", "chunk", "dropout"} if len(parts.gate_up) == 1 else {"mul", "dropout"}, "gated MLP")
    act = m.take(f"{mlp_path}.{parts.activation_module}", "MLP activation")
    assert act is not None
    activation = None
    if act.ops == ["silu"]:
        activation = "silu"
    elif act.ops == ["gelu"]:
        activation = "gelu_tanh" if act.gelu_approximate == "tanh" else "gelu"
    if activation is None:
        raise _unsupported(act, act.ops[0] if act.ops else "<none>", "MLP activation (SiLU, GELU, GELU-tanh)")
    # Llama 4's dense layers: intermediate_size_mlp (its intermediate_size is each expert's)
    dense_size = getattr(config, "intermediate_size_mlp", None) or getattr(config, "intermediate_size", None)
    return MlpSpec(
        intermediate_size=int(dense_size),
        activation=activation,
        bias=down_bias,
        fused_gate_up_name=parts.gate_up[0] if len(parts.gate_up) == 1 else None,
        module=mlp_path.rsplit(".", 1)[-1],
    )


def _moe(m: _Matcher, config: Any, parts: FamilyParts, mlp_path: str) -> MoeSpec:
    """A sparse-MoE block: routing and activation as kernels/moe_routing.py has them for the family
    (checked against what the router's trace does), the experts' and the shared expert's shapes."""
    from pagecast.kernels.moe_routing import moe_spec, num_experts, shared_expert_size

    if parts.moe_block is None:
        raise BuildError(f"{mlp_path} is a mixture-of-experts block, which pagecast does not build for this family")
    block = m.take(mlp_path, "MoE block")
    assert block is not None
    arch = (config.architectures or [""])[0]
    try:
        routing, act = moe_spec(arch, config.to_dict())
    except ValueError as e:  # a routing the kernels do not take (Llama 4's with top_k > 1)
        raise BuildError(f"{mlp_path}: {e}; not supported") from e
    if routing.weights_on_input:
        if block.ops != _WEIGHTS_ON_INPUT_BLOCK_OPS:
            raise BuildError(
                f"{mlp_path} ({block.type_name}, ops {block.ops}) does not weigh its experts' inputs and add a shared "
                f"expert as {arch} is expected to (ops {_WEIGHTS_ON_INPUT_BLOCK_OPS}); not supported"
            )
    else:
        m.only(block, _MOE_BLOCK_OPS, "MoE block")
    router = m.take(f"{mlp_path}.{parts.moe_router}", "MoE router")
    assert router is not None
    child = parts.moe_router_weight
    if child is not None and child.startswith(f"{parts.moe_router}.") and m.trace.get(f"{mlp_path}.{child}") is not None:
        # the router's GEMV in a child module (HunYuan's gate.wg): a bias-free linear, its logits the router's
        gemv = m.take(f"{mlp_path}.{child}", "MoE router's linear")
        assert gemv is not None
        if gemv.ops != ["linear"] or gemv.linear_has_bias or "linear" in router.ops:
            raise BuildError(f"{mlp_path}.{child} ({gemv.type_name}, ops {gemv.ops}) is not the router's bias-free linear")
    if routing.scoring == "softmax_bias":  # ERNIE 4.5: its score bias added in a child module
        statics = m.take(f"{mlp_path}.{parts.moe_router}.moe_statics", "MoE router's score bias")
        core = [op for op in router.ops if op not in _SHAPE_OPS]
        if statics is None or statics.ops != ["squeeze", "add"] or core != _SOFTMAX_BIAS_ROUTER_OPS:
            raise BuildError(
                f"{mlp_path}.{parts.moe_router} ({router.type_name}, ops {router.ops}) does not route as {arch} is "
                f"expected to (fp32 softmax, a biased top-{routing.top_k} choice, renormalised: ops "
                f"{_SOFTMAX_BIAS_ROUTER_OPS} and a moe_statics module adding the bias); not supported"
            )
    elif routing.scoring == "sigmoid_group":
        m.only(router, set(_MOE_SIGMOID_ROUTER_OPS), "MoE router (sigmoid scores, expert groups, top-k)")
        expected = _sigmoid_router_ops(routing)
        if [op for op in router.ops if op not in _SHAPE_OPS] != expected:
            raise BuildError(
                f"{mlp_path}.{parts.moe_router} ({router.type_name}, ops {router.ops}) does not route as {arch} is "
                f"expected to (sigmoid scores, a biased choice among expert groups, top-{routing.top_k}, "
                f"renormalise={routing.renormalize}: ops {expected}); not supported"
            )
    elif routing.scoring == "topk_sigmoid":
        if [op for op in router.ops if op != "to"] != _TOPK_SIGMOID_ROUTER_OPS:
            raise BuildError(
                f"{mlp_path}.{parts.moe_router} ({router.type_name}, ops {router.ops}) does not route as {arch} is "
                f"expected to (the top-{routing.top_k} logits, their sigmoid: ops {_TOPK_SIGMOID_ROUTER_OPS}); not supported"
            )
    else:
        m.only(router, _MOE_ROUTER_OPS, "MoE router (softmax, top-k, renormalisation)")
    if routing.scoring == "softmax_topk":
        renormalises = "sum" in router.ops and any(op in router.ops for op in ("div", "div_"))
        if "softmax" not in router.ops or router.ops.index("softmax") > router.ops.index("topk") or renormalises != routing.renormalize:
            raise BuildError(
                f"{mlp_path}.{parts.moe_router} ({router.type_name}, ops {router.ops}) does not route as "
                f"{arch} is expected to (softmax, top-{routing.top_k}, renormalise={routing.renormalize}); not supported"
            )
    elif routing.scoring == "topk_softmax" and [op for op in router.ops if op not in ("to", "type_as")] != [
        "linear", "topk", "softmax"
    ]:
        raise BuildError(
            f"{mlp_path}.{parts.moe_router} ({router.type_name}, ops {router.ops}) does not route as {arch} is "
            f"expected to (top-{routing.top_k} of the logits, then softmax); not supported"
        )
    router_bias = bool(router.linear_has_bias)
    experts = m.take(f"{mlp_path}.experts", "MoE experts")
    assert experts is not None
    stacked = expert_bias = False
    if act.kind == "silu":
        if experts.ops != _BATCHED_EXPERTS_OPS:  # (Llama 4's: every expert run on its rows by bmm)
            m.only(experts, _MOE_EXPERTS_OPS, "MoE experts (grouped gated MLPs)")
        expert_act = m.take(f"{mlp_path}.experts.act_fn", "MoE experts' activation")
        assert expert_act is not None
        if expert_act.ops != ["silu"]:
            raise _unsupported(expert_act, expert_act.ops[0] if expert_act.ops else "<none>", "MoE experts' activation (SiLU)")
    else:  # gpt-oss: biases, gate clamped above and up to +-limit, gate * sigmoid(alpha * gate) * (up + 1)
        # alpha and limit as the code has them (transformers 5 fixes them at 1.702 and 7.0 whatever the
        # config's swiglu_limit says); the integer clamp is the experts' index bookkeeping.
        m.only(experts, _MOE_EXPERTS_OPS_OAI, "MoE experts (clamped SwiGLU with biases)")
        value_clamps = [c for c in experts.clamps if any(isinstance(b, float) for b in c)]
        limits = {abs(float(b)) for pair in value_clamps for b in pair if b is not None}
        pattern = value_clamps[:1] == [(None, next(iter(limits), None))] and len(value_clamps) == 2
        if len(experts.scalar_muls) != 1 or experts.scalar_adds != [1.0] or len(limits) != 1 or not pattern:
            raise BuildError(
                f"{mlp_path}.experts ({experts.type_name}) is not the clamped SwiGLU (alpha {experts.scalar_muls}, "
                f"clamps {experts.clamps}); not supported"
            )
        act = dataclasses.replace(act, alpha=experts.scalar_muls[0], limit=limits.pop())
        stacked = expert_bias = True
    shared_size, shared_gate = 0, False
    shared_path = f"{mlp_path}.{parts.moe_shared_expert}"
    if m.trace.get(shared_path) is not None:
        shared = _dense_mlp(m, config, parts, shared_path)
        if shared.bias or shared.activation != "silu":
            raise BuildError(f"{shared_path} has biases or a non-SiLU activation; not supported")
        shared_size = shared_expert_size(arch, config.to_dict())
        if m.trace.get(f"{mlp_path}.shared_expert_gate") is not None:
            if m.linear(f"{mlp_path}.shared_expert_gate"):
                raise BuildError(f"{mlp_path}.shared_expert_gate has a bias; not supported")
            shared_gate = True
        # (a block weighing its experts' inputs is one fixed pattern, checked above)
        if not routing.weights_on_input and (block.ops.count("add") != 1 or block.ops.count("sigmoid") != int(shared_gate)):
            raise _unsupported(block, "add", "MoE block (experts plus an optionally gated shared expert)")
    elif routing.weights_on_input:
        raise BuildError(f"{mlp_path} ({block.type_name}) has no shared expert at {shared_path}; not supported")
    elif set(block.ops) - {"view", "reshape", "to"}:
        raise _unsupported(block, next(op for op in block.ops if op not in ("view", "reshape", "to")), "MoE block")
    inter = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
    return MoeSpec(
        num_experts=num_experts(config.to_dict()),
        top_k=routing.top_k,
        intermediate_size=int(inter),
        scoring=routing.scoring,
        renormalize=routing.renormalize,
        weights_in_x_dtype=routing.weights_in_x_dtype,
        activation=act.kind,
        alpha=act.alpha,
        limit=act.limit,
        router_bias=router_bias,
        n_group=routing.n_group,
        topk_group=routing.topk_group,
        routed_scale=routing.scale,
        router_fp32=routing.fp32_logits,
        weights_on_input=routing.weights_on_input,
        norm_min=routing.norm_min,
        score_bias=routing.scoring in ("sigmoid_group", "softmax_bias"),
        score_bias_name=f"{parts.moe_block}.{parts.moe_score_bias}",
        expert_bias=expert_bias,
        stacked=stacked or bool(parts.moe_stacked),
        stacked_names=tuple(f"{parts.moe_block}.{name}" for name in parts.moe_stacked),
        shared_expert_size=shared_size,
        shared_expert_gate=shared_gate,
        router_name=f"{parts.moe_block}.{parts.moe_router_weight or parts.moe_router}",
        experts_name=f"{parts.moe_block}.experts",
        expert_projections=parts.moe_expert_projections,
        shared_expert_name=f"{parts.moe_block}.{parts.moe_shared_expert}",
    )


def run(state: BuildState) -> BuildState:
    ckpt = state.checkpoint
    arch = (ckpt.config.architectures or [type(ckpt.config).__name__])[0]
    model = lower(state.trace, ckpt.config, ckpt.family, arch)
    return dataclasses.replace(state, model=model)
