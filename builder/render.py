"""Pass 6, render: the jinja2 template -> model.py for this model, rank layout and dtype."""

from __future__ import annotations

import dataclasses
from importlib import resources

import jinja2

from pagecast.builder import quant, shard
from pagecast.builder.ir import BuildState, MoeSpec
from pagecast.builder.kv_cache import KVCachePlan
from pagecast.runtime.errors import BuildError

TEMPLATE = "model.py.j2"


def render_model(state: BuildState, rank: int = 0) -> str:
    from pagecast.runtime import __version__

    model, plan = state.model, state.plan
    assert model is not None and plan is not None
    a, mlp, moe = model.attention, model.mlp, model.moe
    layer = model.layers[0]
    per_rank = shard.plan_layout(model, plan.tp)  # every rank holds the same shapes: one file serves all
    kv = plan.kv_cache or KVCachePlan(plan.dtype, (1.0,) * model.num_layers, (1.0,) * model.num_layers)
    # Distinct rotary tables (None: a no-RoPE layer) and each layer's; most models have one.
    ropes: list[dict | None] = []
    rope_of_layer = []
    for spec in model.layers:
        params = spec.attention.rope.params if spec.attention.rope is not None else None
        if params not in ropes:
            ropes.append(params)
        rope_of_layer.append(ropes.index(params))
    rotary_dim = next((s.attention.rope.rotary_dim for s in model.layers if s.attention.rope is not None), a.head_dim)
    longrope = [r for r in ropes if r is not None and r.get("rope_type") == "longrope"]
    if longrope and len(ropes) > 1:
        raise BuildError("LongRoPE beside another rotary variant in one model is not supported")
    attention = [
        (s.attention.scale, s.attention.sliding_window or 0, s.attention.logit_softcap or 0.0, s.attention.attention_chunk or 0)
        for s in model.layers
    ]
    uniform = all(x == (a.scale, 0, 0.0, 0) for x in attention)
    norms = model.qk_norms  # the q/k norms of every layer that has them
    temperatures = {s.attention.query_temperature for s in model.layers} - {None}
    if len(temperatures) > 1:
        raise BuildError(f"layers with different query temperatures ({sorted(map(str, temperatures))}) are not supported")
    temperature = temperatures.pop() if temperatures else None
    source = resources.files("pagecast.templates").joinpath(TEMPLATE).read_text()
    env = jinja2.Environment(undefined=jinja2.StrictUndefined, keep_trailing_newline=True)
    return env.from_string(source).render(
        name=state.checkpoint.name,
        architecture=model.architecture,
        family=model.family,
        pagecast_version=__version__,
        num_layers=model.num_layers,
        hidden_size=model.hidden_size,
        num_heads=per_rank.num_heads,
        num_kv_heads=per_rank.num_kv_heads,
        head_dim=a.head_dim,
        intermediate_size=mlp.intermediate_size,
        activation=mlp.activation,
        vocab_size=model.vocab_size,
        dtype=plan.dtype,
        tp=plan.tp,
        rank=rank,
        q_width=a.num_heads * a.head_dim,
        k_width=a.num_kv_heads * a.head_dim,
        kv_head_replicas=per_rank.kv_head_replicas,
        uniform_attention=uniform,
        scale=repr(a.scale),
        scales=repr([x[0] for x in attention]),
        windows=repr([x[1] for x in attention]),
        softcaps=repr([x[2] for x in attention]),
        chunked=any(x[3] for x in attention),
        chunks=repr([x[3] for x in attention]),
        temperature=temperature,
        temperature_layers=repr([s.attention.query_temperature is not None for s in model.layers]),
        single_rope=len(ropes) == 1 and ropes[0] is not None,
        rope_params=repr(ropes[0]),
        ropes=repr(ropes),
        rope_of_layer=repr(rope_of_layer),
        longrope=bool(longrope),
        original_max_positions=longrope[0]["original_max_position_embeddings"] if longrope else 0,
        rotary_dim=rotary_dim,
        max_positions=plan.max_model_len,
        attn_in_norm=layer.attn_in_norm is not None,
        attn_out_norm=layer.attn_out_norm is not None,
        mlp_in_norm=layer.mlp_in_norm is not None,
        mlp_out_norm=layer.mlp_out_norm is not None,
        input_norm_eps=repr(layer.input_norm_eps),
        attn_out_norm_eps=repr(layer.attn_out_norm.eps if layer.attn_out_norm else 0.0),
        post_attention_norm_eps=repr(layer.post_attention_norm_eps),
        mlp_out_norm_eps=repr(layer.mlp_out_norm.eps if layer.mlp_out_norm else 0.0),
        final_norm_eps=repr(model.final_norm_eps),
        residual_multiplier=layer.residual_multiplier,
        embedding_multiplier=model.embedding_multiplier,
        embedding_multiplier_in_dtype=model.embedding_multiplier_in_dtype,
        logits_divisor=model.logits_divisor,
        final_logit_softcap=model.final_logit_softcap or 0.0,
        qk_norm=norms.qk_norm,
        qk_norm_kind=norms.qk_norm_kind,
        qk_norm_after_rope=norms.qk_norm_after_rope,
        qk_norm_eps=repr(norms.qk_norm_eps),
        qk_norm_weight=norms.qk_norm_weight,
        qk_norm_per_layer=not all(model.qk_norm_layers) and norms.qk_norm,
        qk_norm_layers=repr(model.qk_norm_layers),
        clip_qkv=repr(a.clip_qkv) if a.clip_qkv else None,
        has_moe=moe is not None,
        sinks=a.sinks,
        all_moe=all(s.mlp.kind == "moe" for s in model.layers),
        moe_layers=repr([s.mlp.kind == "moe" for s in model.layers]),
        moe_routing=_moe_routing(moe),
        moe_activation=_moe_activation(moe),
        moe_num_experts=moe.num_experts if moe else 0,
        moe_top_k=moe.top_k if moe else 0,
        moe_intermediate_size=per_rank.moe_intermediate_size,
        router_bias=bool(moe and moe.router_bias),
        score_bias=bool(moe and moe.score_bias),
        expert_bias=bool(moe and moe.expert_bias),
        shared_expert=bool(moe and moe.shared_expert_size),
        shared_expert_gate=bool(moe and moe.shared_expert_gate),
        qkv_bias=a.qkv_bias,
        o_bias=a.o_bias,
        mlp_bias=mlp.bias,
        tie_word_embeddings=model.tie_word_embeddings,
        linear_method=quant.linear_method_source(plan.quantization),
        kv_cache_dtype=kv.dtype,
        k_scales=repr(list(kv.k_scales)),
        v_scales=repr(list(kv.v_scales)),
    )


def _moe_routing(moe: MoeSpec | None) -> str:
    if moe is None:
        return ""
    groups = ""
    if moe.scoring == "sigmoid_group":
        groups = (
            f", n_group={moe.n_group}, topk_group={moe.topk_group}, scale={moe.routed_scale!r}, "
            f"fp32_logits={moe.router_fp32}"
        )
    elif moe.scoring == "softmax_bias":
        groups = f", fp32_logits={moe.router_fp32}, norm_min={moe.norm_min!r}"
    elif moe.router_fp32:  # HunYuan's fp32 router
        groups = ", fp32_logits=True"
    if moe.weights_on_input:  # Llama 4
        groups += ", weights_on_input=True"
    return (
        f"MoeRouting(top_k={moe.top_k}, scoring={moe.scoring!r}, renormalize={moe.renormalize}, "
        f"weights_in_x_dtype={moe.weights_in_x_dtype}{groups})"
    )


def _moe_activation(moe: MoeSpec | None) -> str:
    if moe is None:
        return ""
    return f"MoeActivation({moe.activation!r}, alpha={moe.alpha!r}, limit={moe.limit!r})"


def run(state: BuildState) -> BuildState:
    return dataclasses.replace(state, model_py=render_model(state))
