"""4-bit weight formats (AWQ "gemm", GPTQ v1/v2): the checkpoint rules, their exact dequantization,
and the one layout the W4A16 kernel reads.

Every format rule lives here, beside its reference dequantizer:

- which ``quantization_config`` a build accepts (``read_config``), refusing with a message that
  names what is unsupported (3-bit, exllama/marlin-only formats, ``modules_to_not_convert`` or
  ``dynamic`` entries that would leave a fused projection half quantised, a quantised LM head);
- how each format packs its nibbles (``unpack_awq``, ``unpack_gptq``) and the exact fp32
  dequantization W[k, n] = (q[k, n] - z[g(k), n]) * s[g(k), n] (``dequantize``);
- the repacked artifact layout (``Int4Weight``), written once at build time so serving repacks
  nothing:

      qweight  int32 [K / 8, N]   nibble i of row r is input 8r + i (of the permuted input order)
      scales   half  [K / G, N]   the checkpoint's fp16 scales (fp32 for fp32 artifacts)
      zeros    int8  [K / G, N]   zero points 0..15, unpacked (symmetric GPTQ holds 8)
      perm     int32 [K]          act-order only: kernel input k reads activation column perm[k]

  Input k of the (permuted) order belongs to group k // G, so a K-tile reads one group's
  scales. GPTQ act-order (``desc_act``) is folded in by sorting the inputs by ``g_idx``.
- how that layout splits for tensor parallelism (``column_shard``, ``row_layout``,
  ``row_shard``): column-parallel (qkv, gate_up) along N, each fused section on its own as the
  half-type heads are cut (KV heads replicated where the degree exceeds them); row-parallel
  (o_proj, down_proj) along K in whole groups only, a split that would cut a group refused by
  name. Act-order is folded in before the split: down_proj's input order becomes gate_up's
  output order (the intermediate channels are renumbered, so down_proj needs no perm and each
  rank's K slice is whole groups, at any degree); o_proj's inputs are attention heads, which
  cannot be renumbered across ranks, so each rank holds, for every group its heads touch, its
  own members of that group padded with zero weights to the group size (``row_layout``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from pagecast.builder import fp8, quant_moe  # quant_moe: MoE experts, built on this module's rules
from pagecast.kernels import reference
from pagecast.kernels.quant_linear import scale_dtype_for
from pagecast.runtime.errors import BuildError

METHODS = ("awq", "gptq")
GROUP_SIZES = (32, 64, 128, 256, -1)  # -1: one group per output channel (per-channel scales)
# AWQ "gemm" interleaves the 8 columns of a word: nibble i holds column 8j + AWQ_ORDER[i].
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
AWQ_INVERSE = tuple(AWQ_ORDER.index(c) for c in range(8))  # column c is nibble AWQ_INVERSE[c]
# The projections the engine runs through the W4A16 GEMM (checkpoint module names within a layer).
QUANTISED_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Artifact projection -> the checkpoint modules it is fused from.
FUSED = {
    "qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "o_proj": ("self_attn.o_proj",),
    "gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    "down_proj": ("mlp.down_proj",),
}
PARTS = ("qweight", "scales", "zeros", "perm")


@dataclass(frozen=True)
class QuantConfig:
    """A checkpoint's 4-bit quantisation as the build understands it (recorded in the manifest).

    ``group_size`` is the checkpoint's value (-1 = per channel); ``group_size_for(K)`` is the
    group length along an input dimension of K.
    """

    method: str  # "awq" or "gptq"
    group_size: int
    sym: bool  # GPTQ symmetric (zero 8); AWQ is always asymmetric (zero points stored)
    desc_act: bool  # GPTQ act-order: inputs were quantised in a permuted order, g_idx unsorted
    checkpoint_format: str  # "gemm" (AWQ), "gptq" (v1, zeros stored minus one) or "gptq_v2"
    bits: int = 4

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"quantisation method {self.method!r} is not one of {METHODS}")
        if self.bits != 4:
            raise ValueError(f"{self.bits}-bit weights are not supported; only 4-bit AWQ/GPTQ")
        if self.group_size not in GROUP_SIZES:
            raise ValueError(f"group size {self.group_size} is not supported (supported: {GROUP_SIZES})")
        expected = ("gemm",) if self.method == "awq" else ("gptq", "gptq_v2")
        if self.checkpoint_format not in expected:
            raise ValueError(f"{self.method} format {self.checkpoint_format!r} is not one of {expected}")

    def group_size_for(self, k: int) -> int:
        return k if self.group_size == -1 else self.group_size

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# ---------------------------------------------------------------------------- reading the config


def read_config(
    quantization_config: dict[str, Any] | None, requested: str | None, dummy: bool = False
) -> QuantConfig | None:
    """The checkpoint's quantisation, checked against ``--quant``.

    A checkpoint without ``quantization_config`` builds in the float path unless ``--quant`` asks
    for one, which is refused (or, with ``--load-format dummy``, gives random int4 weights of
    group size 128). A checkpoint with one builds quantised; ``--quant`` must then agree.
    """
    if not quantization_config:
        if requested is None:
            return None
        if dummy:
            return QuantConfig(
                method=requested,
                group_size=128,
                sym=requested == "gptq",
                desc_act=False,
                checkpoint_format="gemm" if requested == "awq" else "gptq",
            )
        raise BuildError(
            f"--quant {requested}: the checkpoint has no quantization_config, it is not {requested.upper()}-"
            f"quantised; quantise it first (AutoAWQ, GPTQModel, AutoRound) or drop --quant to build it in "
            f"its float type"
        )
    qc = dict(quantization_config)
    method = str(qc.get("quant_method", "<none>")).lower()
    if method not in METHODS:
        raise BuildError(
            f"the checkpoint's quantization_config has quant_method {method!r}; pagecast builds only "
            f"4-bit AWQ ('awq') and GPTQ ('gptq') checkpoints"
        )
    if requested is not None and requested != method:
        raise BuildError(
            f"--quant {requested}: the checkpoint is {method.upper()}-quantised, not {requested.upper()}; "
            f"pass --quant {method} or leave --quant out (it is read from the checkpoint)"
        )
    bits = int(qc.get("bits", qc.get("w_bit", 4)))
    if bits != 4:
        raise BuildError(f"the checkpoint is {bits}-bit {method.upper()}; only 4-bit weights are supported")
    group_size = int(qc.get("group_size", qc.get("q_group_size", 128)))
    if group_size not in GROUP_SIZES:
        raise BuildError(
            f"{method.upper()} group size {group_size} is not supported (supported: 32, 64, 128, 256 and -1 "
            f"for per-channel)"
        )
    if method == "awq":
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm":
            raise BuildError(
                f"AWQ version {version!r} is not supported: only the 'gemm' layout is read (re-export the "
                f"checkpoint with version='gemm'; 'gemv', 'exllama', 'marlin' and 'ipex' are not)"
            )
        if not qc.get("zero_point", True):
            raise BuildError("AWQ without zero points (zero_point: false) is not supported")
        fmt, sym, desc_act = "gemm", False, False
    else:
        fmt = str(qc.get("checkpoint_format", "gptq")).lower()
        if fmt not in ("gptq", "gptq_v2"):
            raise BuildError(
                f"GPTQ checkpoint_format {fmt!r} is not supported (only 'gptq' and 'gptq_v2'; 'marlin', "
                f"'bitblas' and exllama-only layouts are not)"
            )
        sym, desc_act = bool(qc.get("sym", True)), bool(qc.get("desc_act", False))
        if qc.get("lm_head"):
            raise BuildError(
                "the checkpoint quantises lm_head (lm_head: true); a quantised LM head is not supported"
            )
        if qc.get("dynamic"):
            raise BuildError(
                f"GPTQ 'dynamic' per-module overrides are not supported ({sorted(qc['dynamic'])}): every "
                f"projection must share one quantisation"
            )
    skipped = [str(m) for m in (qc.get("modules_to_not_convert") or [])]
    # MoE routers (AutoAWQ lists "gate") stay in the half type anyway; they block nothing.
    routers = ("gate", "router", "shared_expert_gate")
    blocking = [m for m in skipped if m.rpartition(".")[2] not in routers and any(m.endswith(p) or f"{p}." in m or m in p for p in QUANTISED_MODULES)]
    if blocking:
        raise BuildError(
            f"modules_to_not_convert {blocking} leave decoder projections unquantised; pagecast fuses "
            f"q/k/v and gate/up into one quantised GEMM each and cannot honour that (quantise every "
            f"projection)"
        )
    return QuantConfig(
        method=method, group_size=group_size, sym=sym, desc_act=desc_act, checkpoint_format=fmt
    )


# ---------------------------------------------------------------------------- unpacking and dequantizing


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """int32 [..., W] -> int16 [..., W, 8]: nibble i of each word (bits 4i..4i+3)."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=packed.device)
    return ((packed.to(torch.int32)[..., None] >> shifts) & 0xF).to(torch.int16)


def unpack_awq(qweight: torch.Tensor, qzeros: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """AWQ gemm qweight [K, N/8], qzeros [K/G, N/8] -> q [K, N], z [K/G, N] (int16, 0..15)."""
    inverse = torch.tensor(AWQ_INVERSE, device=qweight.device)

    def unpack(packed: torch.Tensor) -> torch.Tensor:
        nib = _nibbles(packed)[..., inverse]  # [rows, N/8, 8], column c of each word at position c
        return nib.reshape(packed.shape[0], -1)

    return unpack(qweight), unpack(qzeros)


def unpack_gptq(qweight: torch.Tensor, qzeros: torch.Tensor, v2: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """GPTQ qweight [K/8, N], qzeros [groups, N/8] -> q [K, N], z [groups, N] (int16, 0..15).
    v1 stores each zero minus one (symmetric files hold 7 for 8)."""
    q = _nibbles(qweight).permute(0, 2, 1).reshape(-1, qweight.shape[1])  # row 8r + i is nibble i of row r
    z = _nibbles(qzeros).reshape(qzeros.shape[0], -1)
    if not v2:
        z = (z + 1) & 0xF
    return q, z


def dequantize(q: torch.Tensor, z: torch.Tensor, s: torch.Tensor, g_idx: torch.Tensor) -> torch.Tensor:
    """The exact reference: W[k, n] = (q[k, n] - z[g_idx[k], n]) * s[g_idx[k], n] in fp32, [K, N]
    (the transpose of nn.Linear.weight). fp32 holds every product of a 4-bit integer and an fp16
    scale exactly, so this is the checkpoint's value, not an approximation of it."""
    g = g_idx.long()
    return (q.float() - z[g].float()) * s[g].float()


@dataclass(frozen=True)
class Int4Weight:
    """One projection in the artifact layout (module docstring): what the W4A16 kernel reads."""

    qweight: torch.Tensor  # int32 [K / 8, N]
    scales: torch.Tensor  # [K / G, N]
    zeros: torch.Tensor  # int8 [K / G, N]
    perm: torch.Tensor | None  # int32 [K] (act-order) or None
    # Widths of the fused parts along N (q, k, v / gate, up), for a column-parallel split; None = one part.
    sections: tuple[int, ...] | None = None

    @property
    def k(self) -> int:
        return self.qweight.shape[0] * 8

    @property
    def n(self) -> int:
        return self.qweight.shape[1]

    @property
    def group_size(self) -> int:
        return self.k // self.scales.shape[0]

    def tensors(self) -> dict[str, torch.Tensor]:
        out = {"qweight": self.qweight, "scales": self.scales, "zeros": self.zeros}
        if self.perm is not None:
            out["perm"] = self.perm
        return out


def pack_int4(
    q: torch.Tensor, z: torch.Tensor, s: torch.Tensor, perm: torch.Tensor | None, scale_dtype: torch.dtype
) -> Int4Weight:
    """q [K, N] (already in the permuted input order), z/s [K/G, N] -> the artifact layout."""
    k, n = q.shape
    if k % 8:
        raise BuildError(f"input dimension {k} is not a multiple of 8; it cannot hold packed int4 rows")
    shifts = torch.arange(0, 32, 4, dtype=torch.int64)
    words = (q.to(torch.int64).view(k // 8, 8, n) << shifts[None, :, None]).sum(1)  # 0 .. 2**32 - 1
    qweight = torch.where(words < 2**31, words, words - 2**32).to(torch.int32)
    return Int4Weight(
        qweight=qweight.contiguous(),
        scales=s.to(scale_dtype).contiguous(),
        zeros=z.to(torch.int8).contiguous(),
        perm=None if perm is None else perm.to(torch.int32).contiguous(),
    )


def dequantize_int4(w: Int4Weight) -> torch.Tensor:
    """Exact fp32 [N, K] (nn.Linear.weight, original input order) of an artifact-layout weight."""
    wt = reference.dequantize_int4(w.qweight, w.scales, w.zeros, w.group_size)  # [N, K (permuted)]
    if w.perm is not None:
        dense = torch.empty_like(wt)
        dense[:, w.perm.long()] = wt
        wt = dense
    return wt.contiguous()


# ---------------------------------------------------------------------------- one projection from the checkpoint


@dataclass(frozen=True)
class Unpacked:
    """One checkpoint module unpacked: q [K, N], z and s [groups, N], g_idx [K] (group of each input)."""

    q: torch.Tensor
    z: torch.Tensor
    s: torch.Tensor
    g_idx: torch.Tensor


def module_tensor_names(cfg: QuantConfig, module: str) -> tuple[str, ...]:
    names = (f"{module}.qweight", f"{module}.qzeros", f"{module}.scales")
    return names + ((f"{module}.g_idx",) if cfg.method == "gptq" else ())


def expected_shapes(cfg: QuantConfig, module: str, k: int, n: int) -> dict[str, tuple[int, ...]]:
    groups = k // cfg.group_size_for(k)
    if cfg.method == "awq":
        return {
            f"{module}.qweight": (k, n // 8),
            f"{module}.qzeros": (groups, n // 8),
            f"{module}.scales": (groups, n),
        }
    return {
        f"{module}.qweight": (k // 8, n),
        f"{module}.qzeros": (groups, n // 8),
        f"{module}.scales": (groups, n),
        f"{module}.g_idx": (k,),
    }


def check_module(cfg: QuantConfig, module: str, k: int, n: int, shapes: dict[str, tuple[int, ...]]) -> None:
    """The checkpoint holds this module quantised in ``cfg``'s format with the IR's [K -> N] shape."""
    g = cfg.group_size_for(k)
    if k % g or k % 8 or n % 8:
        raise BuildError(
            f"{module}: in {k} / out {n} features do not fit {cfg.method.upper()} group size {cfg.group_size} "
            f"(K must be a multiple of the group size and of 8, N of 8)"
        )
    if f"{module}.weight" in shapes and f"{module}.qweight" not in shapes:
        raise BuildError(
            f"{module} is stored unquantised ({module}.weight) in a {cfg.method.upper()} checkpoint; "
            f"mixed quantised/float projections are not supported"
        )
    for name, shape in expected_shapes(cfg, module, k, n).items():
        if name == f"{module}.g_idx" and name not in shapes:
            continue  # GPTQ files without act-order may omit g_idx: groups are then k // G
        if name not in shapes:
            raise BuildError(f"the {cfg.method.upper()} checkpoint has no tensor {name!r}; is it complete?")
        if tuple(shapes[name]) != shape:
            raise BuildError(
                f"{name} has shape {tuple(shapes[name])}, expected {shape} for a {k} -> {n} projection in "
                f"{cfg.method.upper()} ({cfg.checkpoint_format}) with group size {cfg.group_size}"
            )


def read_module(cfg: QuantConfig, module: str, read: Any) -> Unpacked:
    """Unpack one checkpoint module; ``read(name)`` returns a checkpoint tensor."""
    qweight, qzeros, scales = read(f"{module}.qweight"), read(f"{module}.qzeros"), read(f"{module}.scales")
    if cfg.method == "awq":
        q, z = unpack_awq(qweight, qzeros)
        g_idx = None
    else:
        q, z = unpack_gptq(qweight, qzeros, v2=cfg.checkpoint_format == "gptq_v2")
        try:
            g_idx = read(f"{module}.g_idx")
        except BuildError:
            g_idx = None
    k = q.shape[0]
    if g_idx is None:
        g_idx = torch.arange(k, dtype=torch.int32) // cfg.group_size_for(k)
    if not torch.isfinite(scales).all():
        raise BuildError(f"{module}.scales contain NaN or inf; the checkpoint is corrupt")
    if g_idx.min() < 0 or g_idx.max() >= scales.shape[0]:
        raise BuildError(
            f"{module}.g_idx names groups outside 0..{scales.shape[0] - 1}; the checkpoint is corrupt"
        )
    return Unpacked(q=q, z=z, s=scales, g_idx=g_idx.to(torch.int64))


def act_order_perm(module: str, g_idx: torch.Tensor, group_size: int) -> torch.Tensor | None:
    """The input order that makes groups contiguous (None when g_idx already is k // G).
    Sorted by g_idx, input k must fall in group k // G: every group has G members."""
    k = g_idx.shape[0]
    plain = torch.arange(k) // group_size
    if torch.equal(g_idx, plain):
        return None
    perm = torch.sort(g_idx, stable=True).indices
    if not torch.equal(g_idx[perm], plain):
        raise BuildError(
            f"{module}.g_idx does not assign {group_size} inputs to each group; this act-order layout "
            f"cannot be made contiguous"
        )
    return perm


def repack_projection(
    cfg: QuantConfig, artifact_name: str, modules: tuple[str, ...], read: Any, scale_dtype: torch.dtype
) -> Int4Weight:
    """Fuse checkpoint modules that share an input (q/k/v, gate/up) along N into one artifact weight,
    with the act-order permutation folded in (the fused parts must share it)."""
    parts = [read_module(cfg, m, read) for m in modules]
    k = parts[0].q.shape[0]
    group = cfg.group_size_for(k)
    perms = [act_order_perm(m, p.g_idx, group) for m, p in zip(modules, parts, strict=True)]
    perm = perms[0]
    for m, p in zip(modules[1:], perms[1:], strict=True):
        if (p is None) != (perm is None) or (p is not None and perm is not None and not torch.equal(p, perm)):
            raise BuildError(
                f"{artifact_name}: {modules[0]} and {m} use different act-order permutations; they share "
                f"one input and are fused into one GEMM, which needs the same input order"
            )
    if perm is not None and not cfg.desc_act:
        raise BuildError(_unsorted_g_idx(modules[0]))
    qs = [p.q if perm is None else p.q[perm] for p in parts]
    q = torch.cat(qs, dim=1)
    z = torch.cat([p.z for p in parts], dim=1)
    s = torch.cat([p.s for p in parts], dim=1)
    if cfg.desc_act and perm is None:
        perm = torch.arange(k)  # the layout planned a perm tensor; act-order that sorted to identity
    packed = pack_int4(q, z, s, perm, scale_dtype)
    return dataclasses.replace(packed, sections=tuple(p.q.shape[1] for p in parts))


def _unsorted_g_idx(module: str) -> str:
    return (
        f"{module}.g_idx is not in group order although the quantization_config has desc_act: false; "
        f"the checkpoint is act-order: set desc_act: true in its quantization_config"
    )


def input_order(cfg: QuantConfig, module: str, read: Any) -> torch.Tensor | None:
    """The act-order input order of a checkpoint module (``act_order_perm`` of its g_idx, exactly
    what ``repack_projection`` folds in), read from g_idx alone; None without act-order."""
    if cfg.method != "gptq":
        return None
    try:
        g_idx = read(f"{module}.g_idx")
    except BuildError:
        return None  # GPTQ files without act-order may omit g_idx
    k = g_idx.shape[0]
    perm = act_order_perm(module, g_idx.to(torch.int64), cfg.group_size_for(k))
    if perm is not None and not cfg.desc_act:
        raise BuildError(_unsorted_g_idx(module))
    return perm


def random_int4(
    cfg: QuantConfig, k: int, n: int, scale_dtype: torch.dtype, gen: torch.Generator
) -> Int4Weight:
    """Random weights in the artifact layout (``--load-format dummy``): uniform nibbles, zeros 8
    (symmetric) or uniform, scales that give weights of about 0.02 standard deviation."""
    device = gen.device
    g = cfg.group_size_for(k)
    qweight = torch.randint(-(2**31), 2**31 - 1, (k // 8, n), generator=gen, dtype=torch.int32, device=device)
    if cfg.sym:
        zeros = torch.full((k // g, n), 8, dtype=torch.int8, device=device)
    else:
        zeros = torch.randint(4, 12, (k // g, n), generator=gen, dtype=torch.int8, device=device)
    scales = (torch.rand((k // g, n), generator=gen, device=device) * 0.004 + 0.002).to(scale_dtype)
    perm = torch.arange(k, dtype=torch.int32) if cfg.desc_act else None
    return Int4Weight(qweight.cpu(), scales.cpu(), zeros.cpu(), perm)


# ---------------------------------------------------------------------------- tensor parallelism

Cut = tuple[int, int, int] | None  # as builder.shard: (dim, index, count) of the float [N, K] weight


def unpack_rows(qweight: torch.Tensor) -> torch.Tensor:
    """Artifact-layout int32 [K / 8, N] -> int16 [K, N]: row k holds input k's nibbles."""
    return _nibbles(qweight).permute(0, 2, 1).reshape(-1, qweight.shape[1])


def column_shard(w: Int4Weight, cuts: tuple[Cut, ...]) -> Int4Weight:
    """Column-parallel (qkv, gate_up): the output columns one rank computes.

    ``cuts`` holds one entry per fused section (q, k, v / gate, up), as builder.shard cuts the
    float weight's sources: (0, index, count) takes piece ``index`` of ``count`` equal pieces of
    the section (replicated KV heads: several ranks take the same piece), None all of it. The
    inputs, and with them the act-order perm, stay whole."""
    sections = w.sections or (w.n,)
    if len(cuts) != len(sections) or sum(sections) != w.n:
        raise BuildError(f"internal: cuts {cuts} do not match the output sections {sections} of {w.n} columns")
    cols, widths, start = [], [], 0
    for n, cut in zip(sections, cuts, strict=True):
        lo, hi = start, start + n
        if cut is not None:
            dim, index, count = cut
            if dim != 0:
                raise ValueError(f"a column-parallel cut splits dim 0 (output features), got {cut}")
            if n % count:
                raise BuildError(f"an output section of {n} columns does not split into {count} equal pieces")
            lo, hi = start + index * (n // count), start + (index + 1) * (n // count)
        cols.append(torch.arange(lo, hi))
        widths.append(hi - lo)
        start += n
    idx = torch.cat(cols)
    return Int4Weight(
        w.qweight[:, idx].contiguous(), w.scales[:, idx].contiguous(), w.zeros[:, idx].contiguous(), w.perm,
        tuple(widths),
    )  # fmt: skip


def permute_sections(w: Int4Weight, order: torch.Tensor) -> Int4Weight:
    """The output columns of every section (gate, up) renumbered: new column j of a section is
    its old column ``order[j]``. gate_up takes down_proj's act-order input order this way, so
    the intermediate activations come out in the order down_proj's rows were sorted into."""
    sections = w.sections or (w.n,)
    if any(n != order.shape[0] for n in sections):
        raise BuildError(f"internal: an order of {order.shape[0]} does not fit output sections {sections}")
    idx = torch.cat([start + order.long() for start in (sum(sections[:i]) for i in range(len(sections)))])
    return Int4Weight(
        w.qweight[:, idx].contiguous(), w.scales[:, idx].contiguous(), w.zeros[:, idx].contiguous(), w.perm,
        w.sections,
    )  # fmt: skip


@dataclass(frozen=True)
class RowShard:
    """The inputs one rank holds of a row-parallel weight, as whole groups.

    ``slots[j]``: the whole weight's input (in its permuted order) that local input j is, -1 for
    padding (a zero weight); ``groups[g]``: the whole weight's group local group g is, -1 for a
    group of padding only; ``group_size``: the local group length (the checkpoint's, or K / tp
    for per-channel weights)."""

    slots: torch.Tensor  # int64 [K_local]
    groups: torch.Tensor  # int64 [K_local / group_size]
    group_size: int

    @property
    def padded(self) -> int:
        return int((self.slots < 0).sum())


def row_layout(perm: torch.Tensor | None, k: int, group: int, count: int, name: str) -> list[RowShard]:
    """Every rank's ``RowShard`` of a row-parallel weight with ``k`` inputs in groups of ``group``
    (``group == k``: per channel, or one group spanning every input, which is the same) split
    ``count`` ways. Rank r computes activations
    [r k / count, (r + 1) k / count) (the column-parallel layer before it made them); kernel input
    i reads activation ``perm[i]`` (None: i).

    Without act-order rank r holds its contiguous k / count inputs, which must be whole groups
    (else a BuildError naming ``name``, the sizes and the group size). With act-order a group's
    inputs are spread over the ranks: rank r holds, for each group it has inputs of, those
    inputs padded with zero weights to the group size, and every rank is padded to the same
    number of groups (one model.py serves all ranks)."""
    if k % count:
        raise BuildError(
            f"--tp {count}: {name} is row-parallel and its {k} inputs do not split into {count} equal slices"
        )
    k_rank = k // count
    if group == k:  # per channel: every input shares the scales, so a slice is one group of k / count
        if k_rank % 8:
            raise BuildError(
                f"--tp {count}: {name} is row-parallel (per-channel scales) and {k} / {count} = {k_rank} inputs per "
                f"rank is not a multiple of 8 (packed int4 words); choose a --tp for which {k} / tp is one"
            )
    elif k_rank % group:
        raise BuildError(
            f"--tp {count}: {name} is row-parallel and {k} inputs / {count} ranks = {k_rank} inputs per rank is "
            f"not a multiple of the quantisation group size {group}: a rank's slice would cut a group. Choose a "
            f"--tp for which {k} / tp is a multiple of {group}, or build with --tp 1"
        )
    # The rank whose activation each input reads.
    owner = (torch.arange(k) if perm is None else perm.long()) // k_rank
    if group == k:
        one = torch.zeros(1, dtype=torch.int64)
        return [RowShard(torch.nonzero(owner == r).flatten(), one, k_rank) for r in range(count)]
    held = []
    for r in range(count):
        pos = torch.nonzero(owner == r).flatten()  # ascending, so its groups are consecutive
        touched, sizes = torch.unique_consecutive(pos // group, return_counts=True)
        held.append((pos, touched, sizes))
    width = max(len(touched) for _, touched, _ in held)
    out = []
    for pos, touched, sizes in held:
        local = torch.repeat_interleave(torch.arange(len(touched)), sizes)  # each input's local group
        first = torch.cumsum(sizes, 0) - sizes
        slots = torch.full((width * group,), -1, dtype=torch.int64)
        slots[local * group + torch.arange(len(pos)) - first[local]] = pos
        groups = torch.full((width,), -1, dtype=torch.int64)
        groups[: len(touched)] = touched
        out.append(RowShard(slots, groups, group))
    return out


def row_shard(w: Int4Weight, layout: RowShard, index: int, k_rank: int) -> Int4Weight:
    """Rank ``index``'s part of a row-parallel weight as ``layout`` says: its inputs' nibbles,
    its groups' scales and zeros, padding with the group's zero point as nibble (weight exactly
    0; fully padded groups get scale 0), and the perm re-based to the rank's own activations
    (padding reads activation 0). A contiguous slice of whole groups is cut from the packed rows
    as it is, with no perm when the weight has none."""
    member = layout.slots >= 0
    own = torch.arange(index * k_rank, (index + 1) * k_rank)
    if bool(member.all()) and torch.equal(layout.slots, own):  # whole groups in place: slice the packed rows
        rows = slice(index * k_rank // 8, (index + 1) * k_rank // 8)
        groups = layout.groups
        perm = None if w.perm is None else (w.perm[own].long() - index * k_rank).to(torch.int32)
        if perm is not None and bool(((perm < 0) | (perm >= k_rank)).any()):
            raise BuildError("internal: a row-parallel shard reads another rank's activations")
        return Int4Weight(
            w.qweight[rows].contiguous(), w.scales[groups].contiguous(), w.zeros[groups].contiguous(),
            None if perm is None else perm.contiguous(),
        )  # fmt: skip
    src = layout.slots.clamp_min(0)
    real = (layout.groups >= 0)[:, None]
    zeros = torch.where(real, w.zeros[layout.groups.clamp_min(0)], torch.zeros((), dtype=w.zeros.dtype))
    scales = torch.where(real, w.scales[layout.groups.clamp_min(0)], torch.zeros((), dtype=w.scales.dtype))
    local_group = torch.arange(layout.slots.shape[0]) // layout.group_size
    q = torch.where(member[:, None], unpack_rows(w.qweight)[src], zeros[local_group].to(torch.int16))
    act = (torch.arange(w.k) if w.perm is None else w.perm.long())[src] - index * k_rank
    if bool(((act < 0) | (act >= k_rank))[member].any()):
        raise BuildError("internal: a row-parallel shard reads another rank's activations")
    return pack_int4(q, zeros, scales, torch.where(member, act, 0), w.scales.dtype)


def split_int4(
    w: Int4Weight, dim: int, index: int, count: int, sections: tuple[int, ...] | None = None, name: str = "weight"
) -> Int4Weight:
    """Rank ``index`` of ``count``'s shard of an artifact-layout weight (a whole one).

    dim 0 (column-parallel: qkv, gate_up): every output section (``sections`` or the weight's
    own: q, k, v widths; gate, up widths) split ``count`` ways, the rank's pieces concatenated,
    as the half-type layout splits them (``column_shard``). dim 1 (row-parallel: o, down): the
    inputs whose activations rank ``index`` computes, in whole groups (``row_layout``)."""
    if dim == 0:
        sections = sections or w.sections or (w.n,)
        return column_shard(dataclasses.replace(w, sections=sections), tuple((0, index, count) for _ in sections))
    if dim != 1:
        raise ValueError(f"dim must be 0 (N) or 1 (K), got {dim}")
    layout = row_layout(w.perm, w.k, w.group_size, count, name)[index]
    return row_shard(w, layout, index, w.k // count)


# ---------------------------------------------------------------------------- the build's hooks


def is_projection(t: Any) -> bool:
    """A float-layout projection weight (``layers.i.qkv_proj.weight`` ...): what becomes int4 parts."""
    base, _, leaf = t.name.rpartition(".")
    return leaf == "weight" and base.rpartition(".")[2] in FUSED


def _row_cut(t: Any) -> tuple[int, int] | None:
    """(index, count) of a row-parallel TensorPlan's input split, None when its inputs are whole."""
    cut = t.source_cuts[0] if t.source_cuts else None
    return None if cut is None or cut[0] != 1 else (cut[1], cut[2])


def plan_tensors(
    tensors: list[Any], cfg: QuantConfig, dtype: str, read: Any = None
) -> tuple[list[Any], list[str]]:
    """Replace each projection weight of the float layout (already cut per rank by builder.shard)
    by its artifact-layout parts, and the notes report.md gets.

    ``tensors`` are builder.ir.TensorPlans; a projection ``layers.i.qkv_proj.weight`` of (per-rank)
    shape [N, K] from sources ``model.layers.i.self_attn.{q,k,v}_proj.weight`` becomes
    ``layers.i.qkv_proj.{qweight,scales,zeros[,perm]}`` whose sources are the checkpoint modules,
    keeping the float plan's cuts. A row-parallel projection's parts hold the rank's whole groups
    (``row_layout``; refused where a slice would cut a group); o_proj's act-order layout is read
    from the checkpoint's g_idx (``read``; None for dummy weights). down_proj holds no perm: its
    act-order is folded into gate_up's output order. Embedding, norms, biases and the LM head stay
    as they are (half type). An FP8 build's parts are planned by builder/fp8.py."""
    if fp8.is_fp8(cfg):
        return fp8.plan_tensors(tensors, cfg, read)
    out: list[Any] = []
    scale_dtype = str(scale_dtype_for(dtype)).removeprefix("torch.")
    layouts: dict[str, list[RowShard]] = {}
    padded: list[tuple[int, int, int]] = []  # per padded o_proj: (degree, inputs per rank, inputs held)
    row_parallel = 0
    for t in tensors:
        if quant_moe.is_expert_stack(t):  # MoE experts: stacked int4 parts (builder/quant_moe.py)
            out += quant_moe.plan_parts(t, cfg, dtype)
            continue
        if not is_projection(t):
            out.append(t)
            continue
        base = t.name.rpartition(".")[0]
        proj = base.rpartition(".")[2]
        modules = tuple(s.removesuffix(".weight") for s in t.sources)
        n, k = t.shape
        row = _row_cut(t)
        if row is not None:
            index, count = row
            if base not in layouts:
                whole = k * count
                order = input_order(cfg, modules[0], read) if read is not None and proj == "o_proj" else None
                name = f"{base} ({modules[0]})"
                layouts[base] = row_layout(order, whole, cfg.group_size_for(whole), count, name)
                row_parallel += proj == "o_proj"
                if layouts[base][0].slots.shape[0] > k:
                    padded.append((count, k, layouts[base][0].slots.shape[0]))
            layout = layouts[base][index]
            k_local, groups = layout.slots.shape[0], layout.groups.shape[0]
        else:
            g = cfg.group_size_for(k)
            if k % g or k % 8:
                raise BuildError(
                    f"{base}: {k} inputs do not hold whole {cfg.method.upper()} groups of {g} (K must be a "
                    f"multiple of the group size and of 8)"
                )
            k_local, groups = k, k // g
        shapes = {
            "qweight": ((k_local // 8, n), "int32"),
            "scales": ((groups, n), scale_dtype),
            "zeros": ((groups, n), "int8"),
        }
        if cfg.desc_act and proj != "down_proj":
            shapes["perm"] = ((k_local,), "int32")
        for part, (shape, part_dtype) in shapes.items():
            out.append(
                dataclasses.replace(t, name=f"{base}.{part}", sources=modules, shape=shape, dtype=part_dtype)
            )
    notes = []
    if padded:
        count, per_rank = padded[0][0], padded[0][1]
        held = sorted({h for _, _, h in padded})
        inputs = str(held[0]) if len(held) == 1 else f"{held[0]} to {held[-1]}"
        notes.append(
            f"act-order o_proj at --tp {count}: its quantisation groups' inputs are spread over the ranks' heads, "
            f"so in {len(padded)} of {row_parallel} layers each rank's {per_rank} inputs are padded with zero "
            f"weights to whole groups of {cfg.group_size}: {inputs} "
            f"inputs per rank (up to {held[-1] / per_rank:.2f}x that projection's weight and time per rank)"
        )
    return out, notes


def check_tensors(tensors: list[Any], cfg: QuantConfig, shapes: dict[str, tuple[int, ...]]) -> None:
    """Every projection's checkpoint modules exist in ``cfg``'s format with the planned [N, K]
    (the whole float layout, before any tensor-parallel cut)."""
    if fp8.is_fp8(cfg):
        return fp8.check_tensors(tensors, cfg, shapes)
    quant_moe.check_experts(tensors, cfg, shapes)
    for t in tensors:
        if is_projection(t):
            n_total, k = t.shape
            # The fused parts' N are read from the checkpoint (q and k/v differ); their sum must match.
            n_sum = 0
            for source in t.sources:
                module = source.removesuffix(".weight")
                scales = shapes.get(f"{module}.scales")
                if scales is None:
                    raise BuildError(f"the {cfg.method.upper()} checkpoint has no tensor '{module}.scales'")
                check_module(cfg, module, k, scales[-1], shapes)
                n_sum += scales[-1]
            if n_sum != n_total:
                raise BuildError(f"{', '.join(t.sources)} give {n_sum} output columns, expected {n_total}")


def is_quant_part(t: Any) -> bool:
    if quant_moe.is_expert_part(t):
        return True
    return t.name.rpartition(".")[2] in PARTS and t.name.rpartition(".")[0].rpartition(".")[2] in FUSED


def is_quantised(t: Any) -> bool:
    """A float-layout tensor an AWQ/GPTQ build takes from int4 modules: a projection or MoE experts."""
    return is_projection(t) or quant_moe.is_expert_stack(t)


def projection_dims(model: Any) -> dict[str, tuple[int, int, tuple[int, ...] | None]]:
    """Artifact projection -> (N, K, fused sections) of the whole model (builder.ir.ModelIR)."""
    a, inter, h = model.attention, model.mlp.intermediate_size, model.hidden_size
    q, kv = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
    out: dict[str, tuple[int, int, tuple[int, ...] | None]] = {}
    for layer in model.layers:
        o = f"layers.{layer.index}"
        out[f"{o}.qkv_proj"] = (q + 2 * kv, h, (q, kv, kv))
        out[f"{o}.o_proj"] = (h, q, None)
        out[f"{o}.gate_up_proj"] = (2 * inter, h, (inter, inter))
        out[f"{o}.down_proj"] = (h, inter, None)
        shared = getattr(layer.mlp, "shared_expert_size", 0)
        if shared:  # Qwen2-MoE's shared expert, quantised like a dense MLP
            out[f"{o}.shared_expert.gate_up_proj"] = (2 * shared, h, (shared, shared))
            out[f"{o}.shared_expert.down_proj"] = (h, shared, None)
    return out


class Int4Materialiser:
    """Repacks each projection once and hands out every rank's parts in the planned order.

    pack writes the ranks' files side by side, tensor by tensor, so a projection's parts for all
    ranks are consecutive: one whole repacked projection and its per-rank shards are held at
    once. gate_up's output columns (and bias) take down_proj's act-order input order; down_proj
    drops its perm (its rows are already in that order)."""

    def __init__(
        self, cfg: QuantConfig, read: Any, dtype: str, gen: torch.Generator | None, model: Any = None
    ):
        self.cfg, self.read, self.gen = cfg, read, gen
        self.dtype = dtype
        self.scale_dtype = scale_dtype_for(dtype)
        self.dims = projection_dims(model) if model is not None else {}
        self._base: str | None = None
        self._weight: Int4Weight | None = None
        self._shards: dict[int, Int4Weight] = {}
        self._layouts: list[RowShard] | None = None
        self._orders: dict[str, torch.Tensor | None] = {}
        self._experts = quant_moe.ExpertsMaterialiser(cfg, read, dtype, gen)

    def handles(self, t: Any) -> bool:
        """Whether pack takes ``t`` from here: the int4 parts, and gate_up's bias (reordered)."""
        return is_quant_part(t) or (self.gen is None and t.name.endswith(".gate_up_proj.bias"))

    def __call__(self, t: Any) -> torch.Tensor:
        if quant_moe.is_expert_part(t):
            return self._experts(t)
        base, _, part = t.name.rpartition(".")
        if part == "bias":
            return self._bias(t)
        if base != self._base:
            self._base, self._weight, self._shards, self._layouts = base, self._whole(base, t), {}, None
        shard = self._shards.get(t.rank)
        if shard is None:
            assert self._weight is not None
            shard = self._shards[t.rank] = self._shard(base, self._weight, t)
        tensors = shard.tensors()
        if part not in tensors:
            raise BuildError(f"internal: {base} has no {part} (planned {t.shape})")
        return tensors[part]

    def _mlp_order(self, mlp_module: str) -> torch.Tensor | None:
        """down_proj's act-order input order for the MLP holding ``mlp_module`` (gate or up)."""
        prefix = mlp_module.rpartition(".")[0]
        if prefix not in self._orders:
            self._orders = {prefix: input_order(self.cfg, f"{prefix}.down_proj", self.read)}
        return self._orders[prefix]

    def _whole(self, base: str, t: Any) -> Int4Weight:
        proj = base.rpartition(".")[2]
        if self.gen is not None:
            n, k, sections = self.dims[base]
            drawn = random_int4(self.cfg, k, n, self.scale_dtype, self.gen)
            return dataclasses.replace(drawn, sections=sections)
        w = repack_projection(self.cfg, base, t.sources, self.read, self.scale_dtype)
        if proj == "gate_up_proj":
            order = self._mlp_order(t.sources[0])
            if order is not None:
                w = permute_sections(w, order)
        elif proj == "down_proj":
            w = dataclasses.replace(w, perm=None)  # its rows are in the order gate_up now computes
        return w

    def _shard(self, base: str, w: Int4Weight, t: Any) -> Int4Weight:
        cuts = tuple(t.source_cuts)
        if all(c is None for c in cuts):
            return w
        row = _row_cut(t)
        if row is None:
            return column_shard(w, cuts)
        index, count = row
        if self._layouts is None:
            self._layouts = row_layout(w.perm, w.k, w.group_size, count, f"{base} ({t.sources[0]})")
        return row_shard(w, self._layouts[index], index, w.k // count)

    def _bias(self, t: Any) -> torch.Tensor:
        from pagecast.builder import shard

        order = self._mlp_order(t.sources[0].removesuffix(".bias"))
        prepare = None if order is None else (lambda bias: bias[order])
        return shard.rank_tensor(self.read, t, getattr(torch, self.dtype), prepare)


def Materialiser(cfg: Any, read: Any, dtype: str, gen: torch.Generator | None, model: Any = None) -> Any:
    """What pack takes the quantised parts from: int4 (``Int4Materialiser``) or FP8 (builder/fp8.py)."""
    if fp8.is_fp8(cfg):
        return fp8.Materialiser(cfg, read, gen, model, dtype)
    return Int4Materialiser(cfg, read, dtype, gen, model)


def weight_bytes(tensors: list[Any], dtype_bytes: int) -> int:
    """Bytes of the planned tensors (quantised parts at their own element size)."""
    sizes = {"int32": 4, "int8": 1, "float16": 2, "bfloat16": 2, "float32": 4, "float8_e4m3fn": 1}
    total = 0
    for t in tensors:
        n = 1
        for s in t.shape:
            n *= s
        total += n * (sizes[t.dtype] if getattr(t, "dtype", None) else dtype_bytes)
    return total


def read_checkpoint_config(
    path: Any, requested: str | None, dummy: bool, keep_module: Callable[[str], bool] | None = None
) -> QuantConfig | None:
    """``read_config`` on the checkpoint directory: ``quantization_config`` in config.json, or the
    separate quantize_config.json / quant_config.json older AutoGPTQ / AutoAWQ releases wrote, or
    ModelOpt's hf_quant_config.json (``{"producer": ..., "quantization": {"quant_algo": ...}}``,
    read as ``quant_method: modelopt``). ``keep_module`` (an image-text checkpoint's): the entries
    of its lists of unquantised modules it keeps, the rest naming modules never built."""
    import json
    from pathlib import Path

    root = Path(path)
    qc = json.loads((root / "config.json").read_text()).get("quantization_config")
    if not qc:
        for name in ("quantize_config.json", "quant_config.json", "hf_quant_config.json"):
            if (root / name).is_file():
                try:
                    qc = json.loads((root / name).read_text())
                except json.JSONDecodeError as e:
                    raise BuildError(f"{root / name} is not valid JSON ({e}); fix or delete it") from e
                default = {"quant_config.json": "awq", "quantize_config.json": "gptq"}.get(name, "modelopt")
                qc.setdefault("quant_method", default)
                break
    if qc and keep_module is not None:
        qc = _modules_kept(qc, keep_module)
    from pagecast.builder import kv_cache

    if kv_cache.is_kv_cache_only(qc) or fp8.is_modelopt_kv_cache_only(qc):
        qc = None  # float weights; the KV scales are read by --kv-cache-dtype fp8
    if str((qc or {}).get("quant_method", "")).lower() == "mxfp4":
        qc = None  # gpt-oss's MXFP4 experts: the loader dequantises them to bf16 (load._index_mxfp4)
    if requested == "fp8" or str((qc or {}).get("quant_method", "")).lower() in fp8.FP8_METHODS:
        return fp8.read_config(qc, requested)
    return read_config(qc, requested, dummy)


_MODULE_LISTS = ("ignore", "modules_to_not_convert", "ignored_layers", "exclude_modules")


def _modules_kept(qc: dict[str, Any], keep: Callable[[str], bool]) -> dict[str, Any]:
    """``qc`` with its module lists (ModelOpt's under ``quantization`` too) holding what ``keep`` keeps."""
    out = {k: [m for m in v if keep(str(m))] if k in _MODULE_LISTS and isinstance(v, list) else v for k, v in qc.items()}
    if isinstance(qc.get("quantization"), dict):
        out["quantization"] = _modules_kept(qc["quantization"], keep)
    return out


def linear_method_source(cfg: QuantConfig | None) -> str:
    """The model template's ``LINEAR = ...`` (kernels/quant_linear.py) for this build."""
    if cfg is None:
        return "quant_linear.DenseLinear()"
    if fp8.is_fp8(cfg):
        return fp8.linear_method_source(cfg)
    return f"quant_linear.Int4Linear(method={cfg.method!r}, group_size={cfg.group_size})"


def report_lines(tuning: dict[str, Any] | None, cfg: QuantConfig | None, tp: int = 1) -> list[str]:
    """report.md's section for an int4 build: the format, how the ranks split it, and per
    projection and row bucket the W4A16 choice (Triton tile or dequantize + cuBLAS), its time and
    the half-type cuBLAS time."""
    if cfg is None:
        return []
    if fp8.is_fp8(cfg):
        return fp8.report_lines(tuning, cfg, tp)
    g = "per channel" if cfg.group_size == -1 else f"group size {cfg.group_size}"
    lines = [
        "",
        "## Quantisation",
        "",
        (
            f"{cfg.method.upper()} ({cfg.checkpoint_format}), 4-bit, {g}, "
            f"{'symmetric' if cfg.sym else 'asymmetric'}{', act-order folded into the layout' if cfg.desc_act else ''}; "
            f"embedding and LM head in the half type."
        ),
    ]
    if tp > 1:
        lines += [
            "",
            f"Tensor parallel ({tp} ranks): qkv_proj and gate_up_proj int4 weights split by output columns "
            f"(each fused part on its own, as the heads), o_proj and down_proj by inputs in whole "
            f"{'per-channel slices' if cfg.group_size == -1 else f'groups of {cfg.group_size}'}"
            + (
                "; down_proj's act-order is folded into gate_up_proj's output order, o_proj's is kept per rank"
                if cfg.desc_act
                else ""
            )
            + ".",
        ]
    if ((tuning or {}).get("kernels") or {}).get("fused_moe_w4a16"):
        lines += ["", "MoE experts: int4 (the fused W4A16 MoE kernel: its tuning is in the Mixture of experts section), router in the half type."]
    entries = ((tuning or {}).get("kernels") or {}).get("w4a16_gemm") or {}
    if not entries:
        return lines + [
            "",
            "W4A16 GEMM not tuned here (CPU artifact or no GPU present): launcher defaults apply.",
        ]
    lines += [
        "",
        "| projection.rows | chosen | time (us) | bf16 cuBLAS (us) | int4 / bf16 |",
        "|---|---|---|---|---|",
    ]
    for bucket, entry in entries.items():
        config = entry.get("config") or {}
        tile = ", ".join(f"{k}={v}" for k, v in config.items())
        chosen = "dequantize + cuBLAS" if config.get("dequant") else tile
        t, ref = entry.get("time_us"), entry.get("reference_us")
        ratio = f"{t / ref:.2f}" if t and ref else "-"
        lines.append(f"| {bucket} | {chosen} | {t or 0:.1f} | {ref or 0:.1f} | {ratio} |")
    return lines
