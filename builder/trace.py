"""Pass 2, trace: run the HF model symbolically and record what each module really does.

The model is instantiated on the meta device (no weights, no memory) and exported with
torch.export; every graph node carries ``nn_module_stack``, so each aten op is attributed to
the innermost HF module it ran in. The lower pass matches these facts against the patterns
it supports, so the engine is built from what the code does, not from what the config says.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

from pagecast.builder.ir import BuildState
from pagecast.runtime.errors import BuildError

# Bookkeeping ops that say nothing about the computation.
_IGNORED = {"_assert_tensor_metadata", "getitem", "sym_size", "alias", "detach", "detach_", "lift_fresh_copy"}


@dataclass
class ModuleTrace:
    """The aten ops that ran directly inside one module (not inside its children)."""

    path: str
    type_name: str
    ops: list[str] = field(default_factory=list)
    linear_has_bias: bool | None = None  # for modules that call aten.linear
    scalar_adds: list[float] = field(default_factory=list)  # scalars added (an RMSNorm's eps, Gemma's 1 + w)
    scalar_muls: list[float] = field(default_factory=list)  # scalars multiplied in (Granite's multipliers)
    scalar_divs: list[float] = field(default_factory=list)  # scalars divided by (logit scaling, soft-caps)
    sdpa_kwargs: dict[str, Any] = field(default_factory=dict)
    clamps: list[tuple[Any, Any]] = field(default_factory=list)  # (min, max) of each clamp (OLMoE's clip_qkv)
    gelu_approximate: str | None = None  # "none" or "tanh", for modules that call aten.gelu
    # Plain attributes of the module that decide what its attention does but that the sdpa trace
    # cannot show: the window and soft-cap are passed to the attention function, which sdpa
    # ignores or turns into a mask built elsewhere (see RECORDED_ATTRIBUTES).
    attributes: dict[str, Any] = field(default_factory=dict)


@dataclass
class TraceSummary:
    modules: dict[str, ModuleTrace]  # in order of first execution

    def get(self, path: str) -> ModuleTrace | None:
        return self.modules.get(path)


# Module attributes recorded with the trace: the sliding window and logit soft-cap an attention
# passes to its attention function, whether it applies RoPE (SmolLM3), its layer type, the
# scale of a scaled embedding (Gemma).
RECORDED_ATTRIBUTES = (
    "sliding_window", "attn_logit_softcapping", "use_rope", "layer_type", "is_causal", "scaling", "scalar_embed_scale",
)  # fmt: skip


def _op_name(target: Any) -> str:
    name = getattr(target, "__name__", str(target))
    # "linear.default" -> "linear"; builtins such as getitem stay as they are
    return name.split(".")[0]


def trace_model(config: Any) -> TraceSummary:
    from transformers import AutoModelForCausalLM

    config = type(config).from_dict(config.to_dict())
    config._attn_implementation = "sdpa"
    rope = getattr(config, "rope_parameters", None)
    if isinstance(rope, dict) and rope.get("rope_type") in ("longrope", "dynamic"):
        # LongRoPE picks its factors from the longest position in the call (and "dynamic" rescales
        # past the cached length: HunYuan's NTK-alpha), a data-dependent branch that export cannot
        # trace; the rotary table is built from the config anyway (lower._rope, which refuses a
        # dynamic NTK rope other than HunYuan's fixed one), so the trace takes the default table.
        config.rope_parameters = {"rope_type": "default", "rope_theta": rope.get("rope_theta", 10000.0),
                                  "partial_rotary_factor": rope.get("partial_rotary_factor", 1.0)}
    with torch.device("meta"):
        try:
            model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
        except ValueError:
            # No sdpa path (gpt-oss: attention sinks): trace its eager attention, which lower reads
            # as the sink pattern.
            config._attn_implementation = "eager"
            model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    model.eval()
    ids = torch.zeros(1, 8, dtype=torch.long, device="meta")
    try:
        exported = torch.export.export(model, (ids,), kwargs={"use_cache": False}, strict=False)
    except Exception as e:  # export raises many error types; all mean the same thing here
        raise BuildError(f"tracing {type(model).__name__} with torch.export failed: {e}") from e

    modules: dict[str, ModuleTrace] = {}
    for node in exported.graph.nodes:
        if node.op != "call_function":
            continue
        stack = node.meta.get("nn_module_stack") or {}
        if not stack:
            continue
        path, type_ = list(stack.values())[-1]
        type_name = getattr(type_, "__name__", str(type_)).rsplit(".", 1)[-1]
        mod = modules.setdefault(path, ModuleTrace(path=path, type_name=type_name))
        op = _op_name(node.target)
        if op in _IGNORED:
            continue
        if op == "wrap_with_set_grad_enabled":
            op = "no_grad_region"  # rotary embedding tables are computed under no_grad
        mod.ops.append(op)
        if op == "linear":
            mod.linear_has_bias = len(node.args) > 2 and node.args[2] is not None
        elif op == "add" and len(node.args) == 2 and isinstance(node.args[1], (int, float)):
            mod.scalar_adds.append(float(node.args[1]))
        elif op == "mul" and len(node.args) == 2 and isinstance(node.args[1], (int, float)):
            mod.scalar_muls.append(float(node.args[1]))
        elif op == "div" and len(node.args) == 2 and isinstance(node.args[1], (int, float)):
            mod.scalar_divs.append(float(node.args[1]))
        elif op in ("clamp", "clamp_"):
            bounds = list(node.args[1:3]) + [None, None]
            mod.clamps.append((node.kwargs.get("min", bounds[0]), node.kwargs.get("max", bounds[1])))
        elif op == "gelu":
            mod.gelu_approximate = str(node.kwargs.get("approximate", "none"))
        elif op == "scaled_dot_product_attention":
            mod.sdpa_kwargs = {k: v for k, v in node.kwargs.items() if isinstance(v, (int, float, bool))}
    for path, module in model.named_modules():
        if path in modules:
            modules[path].attributes = {
                k: getattr(module, k)
                for k in RECORDED_ATTRIBUTES
                if hasattr(module, k) and isinstance(getattr(module, k), (int, float, bool, str, type(None)))
            }
            if isinstance(getattr(module, "sinks", None), torch.nn.Parameter):
                modules[path].attributes["sinks"] = True  # gpt-oss: a learned per-head sink logit
    return TraceSummary(modules=modules)


def run(state: BuildState) -> BuildState:
    return dataclasses.replace(state, trace=trace_model(state.checkpoint.config))
