"""Tensor-parallel sharding: which slice of every weight each rank holds.

The plan pass calls ``plan_layout`` (is the degree possible, and what does one rank hold)
and ``shard_tensors`` (one TensorPlan per rank and tensor, each naming the slice of every
checkpoint tensor it is cut from). The pack pass cuts with ``cut_source``. The rules:

- column-parallel (output rows split): the fused ``qkv_proj`` (query heads split; KV heads
  split when ``num_kv_heads >= tp``, else each KV head replicated on ``tp // num_kv_heads``
  consecutive ranks), the fused ``gate_up_proj`` (gate and up each split, so every rank's
  half-and-half layout is what ``silu_and_mul`` expects), and their biases alike;
- row-parallel (input columns split, an all-reduce after): ``o_proj`` and ``down_proj``;
  their biases stay whole on every rank and are added once, after the all-reduce;
- vocab-parallel: the embedding and the LM head are split by vocabulary rows (padded with
  zero rows up to a multiple of tp). Llama-3's LM head alone is 1-2 GiB: replicated, every
  decode step on every rank would read all of it; split, each rank reads its share and the
  [rows, vocab / tp] logits are gathered (a few MB at decode batch sizes);
- MoE experts (kernels/moe_routing.py's rule): every rank holds every expert and a slice of
  each expert's intermediate dimension: ``experts.gate_up`` [E, 2I, H] cut like a fused
  gate_up (each expert's gate and up rows), ``experts.down`` [E, H, I] by its input columns;
  each rank's MoE output is a partial sum, all-reduced once (ops.moe); gpt-oss's gate_up
  biases are cut with their rows, its down bias is held by rank 0 (zeros elsewhere: it is scaled
  by the routing weight, so it cannot be added after the sum); its sinks are cut with the query
  heads. Qwen2-MoE's shared
  expert is cut like a dense MLP; the router and the shared expert's gate are whole;
- everything else (norms, Qwen3's per-head q/k norms) is whole on every rank.

Every rank's shard of a tensor has the same shape, so one rendered model.py serves all
ranks. AWQ/GPTQ builds cut the float layout here too; builder/quant.py then turns each rank's
projection into int4 parts that keep these cuts (column-parallel: per-section output columns;
row-parallel: the rank's inputs, in whole quantisation groups); int4 MoE experts keep the
experts' cuts the same way, per expert (builder/quant_moe.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from pagecast.builder.ir import ModelIR, TensorPlan
from pagecast.runtime.errors import BuildError

Cut = tuple[int, int, int] | None  # (dim, index, count): take piece ``index`` of ``count``; None = whole


@dataclass(frozen=True)
class ShardLayout:
    """What one rank holds, recorded in the manifest as ``layout``; the same on every rank."""

    tp: int
    num_heads: int  # query heads per rank
    num_kv_heads: int  # KV heads per rank (1 when replicated)
    kv_head_replicas: int  # ranks holding each KV head: 1 when split, tp // num_kv_heads when replicated
    intermediate_size: int  # MLP width per rank
    vocab_size: int  # the model's vocabulary (logits are sliced back to it)
    vocab_per_rank: int  # embedding / LM head rows per rank, padding included
    embedding: str = "vocab-parallel"  # "vocab-parallel" or "whole" (tp == 1)
    moe_intermediate_size: int = 0  # each expert's intermediate size per rank (0: a dense model)

    def __post_init__(self) -> None:
        if self.tp < 1:
            raise ValueError(f"tp must be positive (got {self.tp})")

    def to_manifest(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def plan_layout(model: ModelIR, tp: int) -> ShardLayout:
    """The per-rank dimensions at degree ``tp``; a degree that cannot split the model is a BuildError."""
    a, inter = model.attention, model.mlp.intermediate_size
    if tp < 1:
        raise BuildError(f"--tp {tp}: the tensor-parallel degree must be at least 1")
    if a.num_heads % tp:
        raise BuildError(
            f"--tp {tp} cannot split this model's {a.num_heads} query heads ({a.num_kv_heads} KV heads): "
            f"choose a degree that divides {a.num_heads}"
        )
    if a.num_kv_heads % tp and tp % a.num_kv_heads:
        raise BuildError(
            f"--tp {tp} cannot split this model's {a.num_kv_heads} KV heads ({a.num_heads} query heads): the "
            f"degree must divide {a.num_kv_heads} or be a multiple of it (KV heads are then replicated)"
        )
    if inter % tp:
        raise BuildError(f"--tp {tp} does not divide the MLP's intermediate size {inter}")
    moe = model.moe
    if moe is not None and (moe.intermediate_size % tp or moe.shared_expert_size % tp):
        raise BuildError(
            f"--tp {tp} does not divide the experts' intermediate size {moe.intermediate_size}"
            + (f" or the shared expert's {moe.shared_expert_size}" if moe.shared_expert_size else "")
        )
    kv_replicas = max(1, tp // a.num_kv_heads)
    return ShardLayout(
        tp=tp,
        num_heads=a.num_heads // tp,
        num_kv_heads=max(1, a.num_kv_heads // tp),
        kv_head_replicas=kv_replicas,
        intermediate_size=inter // tp,
        vocab_size=model.vocab_size,
        vocab_per_rank=-(-model.vocab_size // tp),
        embedding="vocab-parallel" if tp > 1 else "whole",
        moe_intermediate_size=moe.intermediate_size // tp if moe is not None else 0,
    )


def _source_cuts(
    name: str, t: TensorPlan, rank: int, layout: ShardLayout, num_kv_heads: int, projection_norms: bool = False
) -> tuple[Cut, ...]:
    """One cut per source of tensor ``name`` for ``rank``. ``projection_norms``: the q/k norms'
    weights span the whole projections (OLMo 2, MiniMax-M2), so they are cut with the heads."""
    tp = layout.tp
    whole: tuple[Cut, ...] = (None,) * len(t.sources)
    if tp == 1:
        return whole
    leaf = name.split(".", 2)[-1] if name.startswith("layers.") else name
    kv: Cut = (0, rank, tp) if layout.kv_head_replicas == 1 else (0, rank // layout.kv_head_replicas, num_kv_heads)
    if leaf in ("qkv_proj.weight", "qkv_proj.bias"):
        return ((0, rank, tp), kv, kv)
    if projection_norms and leaf == "q_norm.weight":
        return ((0, rank, tp),)
    if projection_norms and leaf == "k_norm.weight":
        return (kv,)
    if leaf in ("gate_up_proj.weight", "gate_up_proj.bias", "shared_expert.gate_up_proj.weight", "experts.gate_up"):
        return ((0, rank, tp),) * len(t.sources)  # each (expert's) gate and up rows
    if leaf == "experts.down":
        return ((1, rank, tp),) * len(t.sources)
    if leaf == "experts.gate_up_bias":
        return ((0, rank, tp),) * len(t.sources)
    if leaf == "experts.down_bias":  # added once, scaled by the routing weight: rank 0 holds it, the others zeros
        return (None if rank == 0 else ZEROS,) * len(t.sources)
    if leaf == "sinks":  # one per query head, cut with the heads
        return ((0, rank, tp),)
    if leaf in ("o_proj.weight", "down_proj.weight", "shared_expert.down_proj.weight"):
        return ((1, rank, tp),)
    if leaf in ("embed_tokens.weight", "lm_head.weight"):
        return ((0, rank, tp),)
    return whole  # norms, row-parallel biases (added after the all-reduce)


def _shard_shape(t: TensorPlan, cuts: tuple[Cut, ...], layout: ShardLayout, model: ModelIR) -> tuple[int, ...]:
    if all(c is None for c in cuts):
        return t.shape
    if t.name in ("embed_tokens.weight", "lm_head.weight"):
        return (layout.vocab_per_rank, *t.shape[1:])
    if cuts[0] == ZEROS:
        return t.shape
    if t.stack:  # experts: [E, 2I / tp, H] or [E, H, I / tp], biases [E, 2I / tp]
        dim = cuts[0][0] + 1  # type: ignore[index]
        return tuple(n // layout.tp if d == dim else n for d, n in enumerate(t.shape))
    if cuts[0] is not None and cuts[0][0] == 1:  # row-parallel: input columns split
        return (t.shape[0], t.shape[1] // layout.tp)
    if t.name.split(".", 2)[-1].startswith("qkv_proj"):
        return ((layout.num_heads + 2 * layout.num_kv_heads) * model.attention.head_dim, *t.shape[1:])
    if t.name.split(".", 2)[-1] == "k_norm.weight":  # a projection's: its rank's (possibly replicated) heads
        return (layout.num_kv_heads * model.attention.head_dim,)
    return (t.shape[0] // layout.tp, *t.shape[1:])  # gate_up: both halves split alike


def shard_tensors(tensors: list[TensorPlan], model: ModelIR, layout: ShardLayout) -> list[TensorPlan]:
    """The artifact's tensors, one copy per rank with its cuts and per-rank shape (rank-major)."""
    if layout.tp == 1:
        return list(tensors)
    out = []
    a, norms = model.attention, model.qk_norms
    projection_norms = bool(norms.qk_norm and norms.qk_norm_kind == "projection")
    for rank in range(layout.tp):
        for t in tensors:
            cuts = _source_cuts(t.name, t, rank, layout, a.num_kv_heads, projection_norms)
            out.append(dataclasses.replace(t, rank=rank, shape=_shard_shape(t, cuts, layout, model), source_cuts=cuts))
    return out


# A cut that keeps the shape and holds zeros: a bias that one rank adds for all (gpt-oss's b_down).
ZEROS: Cut = (0, 0, 0)


def cut_source(tensor: torch.Tensor, cut: Cut) -> torch.Tensor:
    """Piece ``index`` of ``count`` equal pieces along ``dim``; pieces are ceil(size / count) long
    and the last is padded with zeros (only the vocabulary ever needs it). ``ZEROS``: zeros of the
    tensor's shape."""
    if cut is None:
        return tensor
    if cut == ZEROS:
        return torch.zeros_like(tensor)
    dim, index, count = cut
    size = tensor.shape[dim]
    piece = -(-size // count)
    part = tensor.narrow(dim, min(index * piece, size), max(0, min(piece, size - index * piece)))
    if part.shape[dim] < piece:
        pad_shape = list(part.shape)
        pad_shape[dim] = piece - part.shape[dim]
        part = torch.cat([part, part.new_zeros(pad_shape)], dim=dim)
    return part.contiguous()


_ROWS = "#rows="


def row_range(name: str, start: int, stop: int) -> str:
    """A source naming rows [start, stop) of checkpoint tensor ``name``: a part of a projection the
    checkpoint stores fused (Phi-3's qkv_proj and gate_up_proj), cut per rank like a whole tensor."""
    return f"{name}{_ROWS}{start}:{stop}"


_DEINTERLEAVE = "#deinterleave="


def deinterleaved(source: str, head_dim: int, rotary_dim: int) -> str:
    """``source`` (q or k rows, or their bias or norm) read with each head's rotary dims reordered
    from adjacent pairs (0, 1), (2, 3), ... to halves (0, r/2), (1, r/2 + 1), ... (RopeSpec.interleaved)."""
    return f"{source}{_DEINTERLEAVE}{head_dim}:{rotary_dim}"


def deinterleave_rows(tensor: torch.Tensor, head_dim: int, rotary_dim: int) -> torch.Tensor:
    """Rows (dim 0) of whole heads of ``head_dim``: in each, the first ``rotary_dim`` rows from pair
    order to half order (even rows first, then odd); the rest stay where they are."""
    if tensor.shape[0] % head_dim or rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
        raise BuildError(
            f"cannot reorder {tensor.shape[0]} rows as heads of {head_dim} with {rotary_dim} rotary dims"
        )
    order = list(range(0, rotary_dim, 2)) + list(range(1, rotary_dim, 2)) + list(range(rotary_dim, head_dim))
    index = torch.tensor(order) + torch.arange(0, tensor.shape[0], head_dim)[:, None]
    return tensor.index_select(0, index.reshape(-1))


def without_deinterleave(source: str) -> str:
    return source.split(_DEINTERLEAVE, 1)[0]


def deinterleave_dims(source: str) -> tuple[int, int] | None:
    """(head_dim, rotary_dim) of a ``deinterleaved`` source, None for any other."""
    if _DEINTERLEAVE not in source:
        return None
    head_dim, rotary_dim = source.split(_DEINTERLEAVE, 1)[1].split(":")
    return int(head_dim), int(rotary_dim)


def parse_source(source: str) -> tuple[str, tuple[int, int] | None]:
    """A TensorPlan source -> (checkpoint tensor name, its row range or None for all of it)."""
    source = without_deinterleave(source)
    if _EXPERT in source:
        return source.split(_EXPERT, 1)[0], None
    if _ROWS not in source:
        return source, None
    name, rows = source.split(_ROWS, 1)
    start, stop = rows.split(":")
    return name, (int(start), int(stop))


_EXPERT = "#expert="
# How one expert's piece is read from a tensor that stacks all experts (gpt-oss): x is tensor[e].
_EXPERT_PARTS = {
    "gate": lambda x: x[..., 0::2].transpose(-1, -2) if x.dim() == 2 else x[0::2],  # [H, 2I] -> [I, H]; bias [2I] -> [I]
    "up": lambda x: x[..., 1::2].transpose(-1, -2) if x.dim() == 2 else x[1::2],
    "t": lambda x: x.transpose(-1, -2),  # down [I, H] -> [H, I]
    # Granite-MoE's [2I, H]: the first half of the rows (gate) and the second (up)
    "rows0": lambda x: x[: x.shape[0] // 2],
    "rows1": lambda x: x[x.shape[0] // 2 :],
    "": lambda x: x,
}


def expert_source(name: str, expert: int, part: str = "") -> str:
    """A source naming expert ``expert``'s piece of checkpoint tensor ``name`` that stacks every
    expert on dim 0 (gpt-oss): its gate or up columns (interleaved in the checkpoint) as rows,
    its transpose ("t"), or itself ("")."""
    return f"{name}{_EXPERT}{expert}:{part}"


def expert_source_shape(source: str, base_shape: tuple[int, ...]) -> tuple[int, ...]:
    part = source.split(_EXPERT, 1)[1].split(":", 1)[1]
    shape = base_shape[1:]
    if part in ("gate", "up"):
        return (shape[1] // 2, shape[0]) if len(shape) == 2 else (shape[0] // 2,)
    if part in ("rows0", "rows1"):
        return (shape[0] // 2, *shape[1:])
    return tuple(reversed(shape)) if part == "t" else shape


_last_read: dict[str, torch.Tensor] = {}


def read_source(read: Any, source: str) -> torch.Tensor:
    if (dims := deinterleave_dims(source)) is not None:
        return deinterleave_rows(read_source(read, without_deinterleave(source)), *dims)
    if _EXPERT in source:
        name, rest = source.split(_EXPERT, 1)
        expert, part = rest.split(":", 1)
        if name not in _last_read:  # an expert stack is read once for all its experts' pieces
            _last_read.clear()
            _last_read[name] = read(name)
        return _EXPERT_PARTS[part](_last_read[name][int(expert)]).contiguous()
    name, rows = parse_source(source)
    tensor = read(name)
    return tensor if rows is None else tensor[rows[0] : rows[1]]


def _not_fp8(x: torch.Tensor, t: TensorPlan) -> torch.Tensor:
    """``x``, or a BuildError where it is FP8: its values mean nothing without their scales, which
    only builder/fp8.py reads (and float8 tensors have no isfinite)."""
    if str(x.dtype).startswith("torch.float8"):
        raise BuildError(
            f"checkpoint tensor(s) {', '.join(t.sources)} (the artifact's {t.name}) are "
            f"{str(x.dtype).removeprefix('torch.')}: pagecast reads FP8 weights only for the decoder projections "
            f"and MoE experts (and the LM head) of an FP8 checkpoint whose quantization_config (or ModelOpt "
            f"hf_quant_config.json) names its scheme; store this tensor in bf16/fp16, or build from the float "
            f"checkpoint"
        )
    return x


def rank_tensor(read: Any, t: TensorPlan, dtype: torch.dtype, prepare: Any = None) -> torch.Tensor:
    """A planned tensor's values on its rank: each checkpoint source (``read`` by name, passed
    through ``prepare`` if given) cut as planned, the pieces concatenated along dim 0, checked
    finite, offset (TensorPlan.offset, added in fp32) and cast to ``dtype``."""
    cuts = t.source_cuts or (None,) * len(t.sources)
    sources = (_not_fp8(read_source(read, src), t) for src in t.sources)
    parts = [cut_source(x if prepare is None else prepare(x), cut) for x, cut in zip(sources, cuts, strict=True)]
    if t.stack:  # MoE experts: each group of ``stack`` parts is one expert
        groups = [parts[i : i + t.stack] for i in range(0, len(parts), t.stack)]
        tensor = torch.stack([g[0] if len(g) == 1 else torch.cat(g, dim=0) for g in groups])
    else:
        tensor = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
    if not torch.isfinite(tensor).all():
        raise BuildError(f"checkpoint tensor(s) {', '.join(t.sources)} contain NaN or inf; the checkpoint is corrupt")
    if t.offset:
        tensor = tensor.float() + t.offset
    return tensor.to(dtype)


def rank_tensors(tensors: tuple[TensorPlan, ...] | list[TensorPlan], rank: int) -> list[TensorPlan]:
    return [t for t in tensors if t.rank == rank]


STORED_BYTES = {"int32": 4, "int8": 1, "float16": 2, "bfloat16": 2, "float32": 4, "float8_e4m3fn": 1}  # TensorPlan.dtype


def rank_weight_bytes(tensors: tuple[TensorPlan, ...] | list[TensorPlan], elt: int) -> int:
    """Bytes of rank 0's weights (every rank holds the same amount); ``elt`` per element of the
    plan's dtype, int4 parts at their own stored size."""
    total = 0
    for t in rank_tensors(tensors, 0):
        n = 1
        for s in t.shape:
            n *= s
        total += n * (STORED_BYTES[t.dtype] if t.dtype else elt)
    return total


def per_rank_memory(
    plan: dict[str, Any], layout: ShardLayout, tensors: list[TensorPlan], elt: int
) -> dict[str, Any]:
    """The memory plan of one rank: its weights, its KV heads, the KV blocks that fit beside them.

    ``plan`` is the whole-model plan; num_parameters stays the model's. Activations keep the
    whole-model estimate (the gathered logits are full width on every rank)."""
    if layout.tp == 1:
        return plan
    out = dict(plan)
    global_kv_heads = layout.num_kv_heads * layout.tp // layout.kv_head_replicas
    out["bytes_per_token"] = plan["bytes_per_token"] * layout.num_kv_heads // global_kv_heads
    out["bytes_per_block"] = out["bytes_per_token"] * plan["block_size"]
    out["bytes_per_seq_at_max_model_len"] = out["bytes_per_token"] * plan["max_model_len"]
    out["weight_bytes"] = rank_weight_bytes(tensors, elt)
    out["tp"] = layout.tp
    out["per_rank"] = True
    budgets = []
    for b in plan["budgets"]:
        kv = int(plan["device_memory_bytes"] * b["gpu_memory_utilization"]) - out["weight_bytes"] - plan["activation_bytes"]
        blocks = max(0, kv // out["bytes_per_block"])
        budgets.append(
            dict(
                b,
                kv_bytes=max(0, kv),
                num_blocks=blocks,
                max_tokens=blocks * plan["block_size"],
                max_seqs_at_max_model_len=blocks * plan["block_size"] // plan["max_model_len"],
            )
        )
    out["budgets"] = budgets
    return out


def manifest_layout(model: ModelIR, tp: int, tensors: tuple[TensorPlan, ...], dummy: bool, seed: int) -> dict[str, Any]:
    """The manifest's ``layout``: the degree, what each rank holds, and where the weights come from
    ("files": weights/rank{r}.safetensors; "random": drawn at load from ``seed`` + rank, with the
    per-rank tensor shapes listed here because no file carries them)."""
    out = plan_layout(model, tp).to_manifest()
    out["weights"] = "random" if dummy else "files"
    if dummy:
        out["seed"] = seed
        out["tensors"] = {t.name: list(t.shape) for t in rank_tensors(tensors, 0)}
    return out


def report_lines(layout: dict[str, Any]) -> list[str]:
    if layout.get("tp", 1) == 1:
        return []
    kv = f"{layout['num_kv_heads']} KV heads"
    if layout["kv_head_replicas"] > 1:
        kv += f" (each replicated on {layout['kv_head_replicas']} ranks)"
    line = (
        f"- tensor parallel: {layout['tp']} ranks, each with {layout['num_heads']} query heads, {kv}, MLP width "
        f"{layout['intermediate_size']}, {layout['vocab_per_rank']} vocabulary rows ({layout['embedding']} embedding "
        f"and LM head); memory figures are per rank"
    )
    if layout.get("moe_intermediate_size"):
        line += f"; every expert on every rank, {layout['moe_intermediate_size']} of each expert's intermediate columns"
    return [line]
