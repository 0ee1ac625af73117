"""Pass 3, lower: match the trace against the decoder patterns the engine implements.

Every module the trace saw must be claimed by a role (embedding, RMSNorm, q/k/v/o
projection, rotary attention core, gated MLP, ...) and contain only the ops that role
allows. Anything else stops the build with the module and the op named: an engine that
silently skipped an op would generate wrong text.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from pagecast.builder.ir import AttentionSpec, BuildState, LayerSpec, MlpSpec, ModelIR, RopeSpec
from pagecast.builder.trace import ModuleTrace, TraceSummary
from pagecast.kernels.rope import SUPPORTED_ROPE_TYPES
from pagecast.runtime.errors import BuildError

_RMSNORM_OPS = {"to", "pow", "mean", "add", "rsqrt", "mul"}
_ATTENTION_CORE_OPS = {
    "view", "transpose", "unsqueeze", "mul", "slice", "neg", "cat", "add", "expand", "reshape",
    "scaled_dot_product_attention", "contiguous", "to",
}  # fmt: skip
_ACTIVATIONS = {"silu": "silu"}
# The HF rotary module only builds its cos/sin table (the engine builds its own from the config);
# depending on the transformers version those ops are traced inside a no_grad region or inline.
_ROTARY_TABLE_OPS = {
    "no_grad_region", "unsqueeze", "expand", "to", "_to_copy", "float", "matmul", "bmm", "transpose", "cat",
    "cos", "sin", "mul", "view", "reshape", "slice", "contiguous", "clone", "autocast", "_set_grad_enabled",
}  # fmt: skip


def _unsupported(mod: ModuleTrace, op: str, role: str) -> BuildError:
    return BuildError(
        f"unsupported op {op!r} in module {mod.path} ({mod.type_name}), matched as {role}: "
        f"pagecast cannot build this model correctly"
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

    def rmsnorm(self, path: str, required: bool = True) -> float | None:
        mod = self.take(path, "RMSNorm", required)
        if mod is None:
            return None
        self.only(mod, _RMSNORM_OPS, "RMSNorm")
        if "rsqrt" not in mod.ops or len(mod.scalar_adds) != 1 or mod.ops.count("add") != 1:
            raise BuildError(
                f"module {path} ({mod.type_name}) is not a plain RMSNorm x * rsqrt(mean(x^2) + eps) * w "
                f"(ops {mod.ops}); this norm variant is not supported"
            )
        return mod.scalar_adds[0]

    def linear(self, path: str) -> bool:
        mod = self.take(path, "linear projection")
        assert mod is not None
        self.only(mod, {"linear"}, "linear projection")
        return bool(mod.linear_has_bias)


def _rope(config: Any, head_dim: int) -> RopeSpec:
    params = dict(getattr(config, "rope_parameters", None) or {})
    if "rope_theta" not in params:
        params["rope_theta"] = getattr(config, "rope_theta", 10000.0)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise BuildError(f"rope_type {rope_type!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})")
    params["rope_type"] = rope_type
    partial = float(params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0) or 1.0))
    clean = {k: v for k, v in params.items() if isinstance(v, (int, float, str))}
    return RopeSpec(rope_type=rope_type, params=clean, rotary_dim=int(head_dim * partial))


def lower(trace: TraceSummary, config: Any, family: str, architecture: str) -> ModelIR:
    m = _Matcher(trace)
    num_heads = config.num_attention_heads
    num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
    if num_heads % num_kv_heads:
        raise BuildError(f"num_attention_heads {num_heads} is not a multiple of num_key_value_heads {num_kv_heads}")
    rope = _rope(config, head_dim)

    embed = m.take("model.embed_tokens", "token embedding")
    assert embed is not None
    m.only(embed, {"embedding"}, "token embedding")
    m.take("model", "decoder stack")  # position ids and the causal mask: the runtime builds its own
    m.take("", "causal LM wrapper")
    rotary = m.take("model.rotary_emb", "rotary table", required=False)
    if rotary is not None:
        m.only(rotary, _ROTARY_TABLE_OPS, "rotary table")

    layers = []
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}"
        layer = m.take(p, "decoder layer")
        assert layer is not None
        if layer.ops != ["add", "add"]:
            raise BuildError(f"decoder layer {p} ({layer.type_name}) is not pre-norm residual (ops {layer.ops})")
        input_eps = m.rmsnorm(f"{p}.input_layernorm")
        post_eps = m.rmsnorm(f"{p}.post_attention_layernorm")
        q_bias = m.linear(f"{p}.self_attn.q_proj")
        k_bias = m.linear(f"{p}.self_attn.k_proj")
        v_bias = m.linear(f"{p}.self_attn.v_proj")
        o_bias = m.linear(f"{p}.self_attn.o_proj")
        if not q_bias == k_bias == v_bias:
            raise BuildError(f"{p}.self_attn: q/k/v projections disagree on bias; not supported")
        q_norm_eps = m.rmsnorm(f"{p}.self_attn.q_norm", required=False)
        k_norm_eps = m.rmsnorm(f"{p}.self_attn.k_norm", required=False)
        if (q_norm_eps is None) != (k_norm_eps is None):
            raise BuildError(f"{p}.self_attn has a norm on only one of q and k; not supported")
        core = m.take(f"{p}.self_attn", "attention core")
        assert core is not None
        m.only(core, _ATTENTION_CORE_OPS, "rotary attention")
        if "scaled_dot_product_attention" not in core.ops or "neg" not in core.ops:
            raise BuildError(f"{p}.self_attn ({core.type_name}) is not rotary scaled-dot-product attention")
        scale = float(core.sdpa_kwargs.get("scale", head_dim**-0.5))

        gate_bias = m.linear(f"{p}.mlp.gate_proj")
        m.linear(f"{p}.mlp.up_proj")
        m.linear(f"{p}.mlp.down_proj")
        mlp = m.take(f"{p}.mlp", "gated MLP")
        assert mlp is not None
        m.only(mlp, {"mul"}, "gated MLP")
        act = m.take(f"{p}.mlp.act_fn", "MLP activation")
        assert act is not None
        if len(act.ops) != 1 or act.ops[0] not in _ACTIVATIONS:
            raise _unsupported(act, act.ops[0] if act.ops else "<none>", "MLP activation (only SiLU is supported)")

        layers.append(
            LayerSpec(
                index=i,
                hf_prefix=p,
                input_norm_eps=float(input_eps),  # type: ignore[arg-type]
                attention=AttentionSpec(
                    num_heads=num_heads,
                    num_kv_heads=num_kv_heads,
                    head_dim=head_dim,
                    qkv_bias=q_bias,
                    o_bias=o_bias,
                    qk_norm=q_norm_eps is not None,
                    qk_norm_eps=q_norm_eps,
                    scale=scale,
                    rope=rope,
                ),
                post_attention_norm_eps=float(post_eps),  # type: ignore[arg-type]
                mlp=MlpSpec(config.intermediate_size, _ACTIVATIONS[act.ops[0]], gate_bias),
            )
        )

    final_eps = m.rmsnorm("model.norm")
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
            f"pagecast cannot build this model"
        )
    first = layers[0]
    for layer in layers[1:]:
        if (layer.attention, layer.mlp) != (first.attention, first.mlp):
            raise BuildError(f"layer {layer.index} differs in shape from layer 0; heterogeneous layers are not supported")

    return ModelIR(
        family=family,
        architecture=architecture,
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        layers=tuple(layers),
        final_norm_eps=float(final_eps),  # type: ignore[arg-type]
        tie_word_embeddings=tied,
        embed_name="model.embed_tokens.weight",
        final_norm_name="model.norm.weight",
        lm_head_name=None if tied else "lm_head.weight",
        max_position_embeddings=int(getattr(config, "max_position_embeddings", 2048)),
    )


def run(state: BuildState) -> BuildState:
    ckpt = state.checkpoint
    arch = (ckpt.config.architectures or [type(ckpt.config).__name__])[0]
    model = lower(state.trace, ckpt.config, ckpt.family, arch)
    return dataclasses.replace(state, model=model)
