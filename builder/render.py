"""Pass 6, render: the jinja2 template -> model.py for this model, rank layout and dtype."""

from __future__ import annotations

import dataclasses
from importlib import resources

import jinja2

from pagecast.builder import quant, shard
from pagecast.builder.ir import BuildState
from pagecast.builder.kv_cache import KVCachePlan

TEMPLATE = "model.py.j2"


def render_model(state: BuildState, rank: int = 0) -> str:
    from pagecast.runtime import __version__

    model, plan = state.model, state.plan
    assert model is not None and plan is not None
    a, mlp = model.attention, model.mlp
    layer = model.layers[0]
    per_rank = shard.plan_layout(model, plan.tp)  # every rank holds the same shapes: one file serves all
    kv = plan.kv_cache or KVCachePlan(plan.dtype, (1.0,) * model.num_layers, (1.0,) * model.num_layers)
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
        scale=repr(a.scale),
        rope_params=repr(a.rope.params),
        rotary_dim=a.rope.rotary_dim,
        max_positions=plan.max_model_len,
        input_norm_eps=repr(layer.input_norm_eps),
        post_attention_norm_eps=repr(layer.post_attention_norm_eps),
        final_norm_eps=repr(model.final_norm_eps),
        qk_norm=a.qk_norm,
        qk_norm_eps=repr(a.qk_norm_eps),
        qkv_bias=a.qkv_bias,
        o_bias=a.o_bias,
        mlp_bias=mlp.bias,
        tie_word_embeddings=model.tie_word_embeddings,
        linear_method=quant.linear_method_source(plan.quantization),
        kv_cache_dtype=kv.dtype,
        k_scales=repr(list(kv.k_scales)),
        v_scales=repr(list(kv.v_scales)),
    )


def run(state: BuildState) -> BuildState:
    return dataclasses.replace(state, model_py=render_model(state))
