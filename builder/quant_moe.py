"""AWQ/GPTQ mixture-of-experts experts: how the checkpoint's per-expert int4 modules become the stacked
int4 layout kernels/fused_moe_w4a16.py reads.

AutoAWQ and GPTQModel quantise each expert's ``gate_proj`` / ``up_proj`` / ``down_proj`` (Mixtral:
``w1`` / ``w3`` / ``w2``) as a dense projection (qweight / qzeros / scales, GPTQ g_idx) and keep the
router (``mlp.gate``) and Qwen2-MoE's ``shared_expert_gate`` in the half type; the shared expert's
projections are quantised like a dense MLP's and take builder/quant.py's dense path. Here:

- ``check_experts``: every expert's modules exist in the format with the IR's shapes; a quantised
  router (or shared-expert gate) is refused by name;
- ``plan_parts``: one rank's ``experts.gate_up`` [E, 2I, H] / ``experts.down`` [E, H, I] float plan
  becomes ``.qweight`` [E, K / 8, N], ``.scales`` / ``.zeros`` [E, K / G, N] (and, act-order,
  gate_up's ``.perm`` [E, H]), keeping the plan's cuts;
- ``ExpertsMaterialiser``: each expert repacked by quant.repack_projection (gate and up fused, as
  the half-type path fuses them), down_proj's act-order folded into that expert's gate_up output
  order (quant.permute_sections, as for a dense MLP: down holds no perm), cut per rank (gate_up by
  output columns, down by inputs in whole groups: quant.column_shard / row_layout / row_shard) and
  stacked.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from pagecast.builder import quant
from pagecast.kernels.quant_linear import scale_dtype_for
from pagecast.runtime.errors import BuildError

STACKS = ("experts.gate_up", "experts.down")
# Half-type modules beside the experts: a checkpoint that quantised one of them is refused.
HALF_MODULES = ("router.weight", "shared_expert_gate.weight")


def is_expert_stack(t: Any) -> bool:
    """A float-layout stacked experts weight (``layers.i.experts.gate_up`` / ``.down``)."""
    return bool(t.stack) and t.name.split(".", 2)[-1] in STACKS


def is_expert_part(t: Any) -> bool:
    base, _, part = t.name.rpartition(".")
    return part in quant.PARTS and base.split(".", 2)[-1] in STACKS


def _experts(t: Any) -> list[tuple[str, ...]]:
    """Each expert's checkpoint modules (gate, up / down) of a stacked plan."""
    modules = [s.removesuffix(".weight") for s in t.sources]
    return [tuple(modules[i : i + t.stack]) for i in range(0, len(modules), t.stack)]


def _cut_count(t: Any) -> int:
    cut = t.source_cuts[0] if t.source_cuts else None
    return 1 if cut is None else cut[2]


def check_experts(tensors: list[Any], cfg: quant.QuantConfig, shapes: dict[str, tuple[int, ...]]) -> None:
    """The whole (uncut) float plan's experts exist in ``cfg``'s format; the router is half type."""
    for t in tensors:
        leaf = t.name.split(".", 2)[-1]
        if leaf in HALF_MODULES:
            module = t.sources[0].removesuffix(".weight")
            if f"{module}.qweight" in shapes:
                raise BuildError(
                    f"{module} (the MoE {'router' if leaf.startswith('router') else 'shared expert gate'}) is "
                    f"{cfg.method.upper()}-quantised in this checkpoint; pagecast runs it in the half type, as "
                    f"AutoAWQ and GPTQModel leave it: re-quantise with it in modules_to_not_convert"
                )
        if not is_expert_stack(t):
            continue
        e, n, k = t.shape
        if len(t.sources) != e * t.stack or any(not s.endswith(".weight") for s in t.sources):
            raise BuildError(
                f"{t.name}: AWQ/GPTQ experts must be stored one module per expert (gpt-oss's stacked experts are "
                f"not supported quantised)"
            )
        for modules in _experts(t):
            for module in modules:
                quant.check_module(cfg, module, k, n // t.stack, shapes)


def plan_parts(t: Any, cfg: quant.QuantConfig, dtype: str) -> list[Any]:
    """One rank's int4 parts of a stacked experts plan (module docstring), its cuts kept."""
    e, n, k = t.shape
    scale_dtype = str(scale_dtype_for(dtype)).removeprefix("torch.")
    gate_up = t.name.endswith("gate_up")
    groups = _local_groups(t, cfg)
    shapes = {
        "qweight": ((e, k // 8, n), "int32"),
        "scales": ((e, groups, n), scale_dtype),
        "zeros": ((e, groups, n), "int8"),
    }
    if gate_up and cfg.desc_act:
        shapes["perm"] = ((e, k), "int32")
    return [
        dataclasses.replace(t, name=f"{t.name}.{part}", sources=t.sources, shape=shape, dtype=part_dtype)
        for part, (shape, part_dtype) in shapes.items()
    ]


def _local_groups(t: Any, cfg: quant.QuantConfig) -> int:
    """Quantisation groups along one rank's K of a stacked experts plan (gate_up's K is whole;
    down's is the rank's slice, which must hold whole groups: refused by name otherwise)."""
    k = t.shape[2]
    if t.name.endswith("gate_up"):
        if k % cfg.group_size_for(k) or k % 8:
            raise BuildError(f"{t.name}: {k} inputs do not hold whole groups of {cfg.group_size} and of 8")
        return k // cfg.group_size_for(k)
    count = _cut_count(t)
    whole = k * count
    layout = quant.row_layout(None, whole, cfg.group_size_for(whole), count, f"{t.name} ({t.sources[0]})")[0]
    return int(layout.groups.shape[0])


def _stack(weights: list[quant.Int4Weight], perm: bool) -> dict[str, torch.Tensor]:
    out = {
        "qweight": torch.stack([w.qweight for w in weights]),
        "scales": torch.stack([w.scales for w in weights]),
        "zeros": torch.stack([w.zeros for w in weights]),
    }
    if perm:
        out["perm"] = torch.stack([w.perm if w.perm is not None else torch.arange(w.k, dtype=torch.int32) for w in weights])
    return out


class ExpertsMaterialiser:
    """Repacks one layer's experts of one projection once (all ranks' parts of it are written one
    after another by pack) and hands out each rank's stacked parts."""

    def __init__(self, cfg: quant.QuantConfig, read: Any, dtype: str, gen: torch.Generator | None):
        self.cfg, self.read, self.gen = cfg, read, gen
        self.scale_dtype = scale_dtype_for(dtype)
        self._base: str | None = None
        self._whole: list[quant.Int4Weight] = []
        self._ranks: dict[int, dict[str, torch.Tensor]] = {}

    def __call__(self, t: Any) -> torch.Tensor:
        base, _, part = t.name.rpartition(".")
        if base != self._base:
            self._base, self._ranks = base, {}
            self._whole = [] if self.gen is not None else self._repack(base, t)
        if t.rank not in self._ranks:
            self._ranks[t.rank] = self._rank(base, t)
        return self._ranks[t.rank][part]

    def _repack(self, base: str, t: Any) -> list[quant.Int4Weight]:
        out = []
        for modules in _experts(t):
            w = quant.repack_projection(self.cfg, base, modules, self.read, self.scale_dtype)
            if base.endswith("gate_up"):
                down = modules[0].rpartition(".")[0] + "." + _down_name(modules[0])
                order = quant.input_order(self.cfg, down, self.read)
                if order is not None:
                    w = quant.permute_sections(w, order)
            else:
                w = dataclasses.replace(w, perm=None)  # rows in the order its gate_up now computes
            out.append(w)
        return out

    def _rank(self, base: str, t: Any) -> dict[str, torch.Tensor]:
        gate_up = base.endswith("gate_up")
        e = t.shape[0]
        if self.gen is not None:  # --load-format dummy: random experts of this rank's shape
            if not t.name.endswith(".qweight"):
                raise BuildError(f"internal: {t.name} drawn before its qweight")
            _, k8, n = t.shape
            groups = _local_groups(dataclasses.replace(t, name=base, shape=(e, n, k8 * 8)), self.cfg)
            whole_groups = groups * self.cfg.group_size_for(k8 * 8) == k8 * 8
            cfg = self.cfg if whole_groups else dataclasses.replace(self.cfg, group_size=-1)  # one group a rank
            drawn = [quant.random_int4(cfg, k8 * 8, n, self.scale_dtype, self.gen) for _ in range(e)]
            return _stack(drawn, gate_up and self.cfg.desc_act)
        cuts_per_expert = t.source_cuts or (None,) * len(t.sources)
        held = []
        for i, w in enumerate(self._whole):
            cuts = tuple(cuts_per_expert[i * t.stack : (i + 1) * t.stack])
            if all(c is None for c in cuts):
                held.append(w)
            elif gate_up:
                held.append(quant.column_shard(w, cuts))
            else:
                index, count = cuts[0][1], cuts[0][2]  # type: ignore[index]
                layout = quant.row_layout(None, w.k, w.group_size, count, f"{base} ({t.sources[i]})")[index]
                held.append(quant.row_shard(w, layout, index, w.k // count))
        return _stack(held, gate_up and self.cfg.desc_act)


# The down projection beside an expert's gate projection (builder/families.py's moe_expert_projections).
_DOWN_OF_GATE = {"gate_proj": "down_proj", "w1": "w2"}


def _down_name(gate_module: str) -> str:
    leaf = gate_module.rpartition(".")[2]
    if leaf not in _DOWN_OF_GATE:
        raise BuildError(f"internal: no down projection known beside the expert projection {gate_module}")
    return _DOWN_OF_GATE[leaf]
