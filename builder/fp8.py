"""FP8 weights and activations (W8A8, OCP e4m3): the checkpoint rules, the build-time quantisation
of half-type weights, and the one artifact layout the FP8 GEMM reads.

Formats read (``read_config``; anything else is refused by name):

- ``--quant fp8`` on a float checkpoint: e4m3 weights with one fp32 scale per output channel,
  computed here (amax / 448); activations quantised per token at run time. No calibration.
- compressed-tensors ``float-quantized`` (llm-compressor): weights per ``channel`` or per
  ``tensor`` with static per-tensor activations (``input_scale``) or dynamic per-``token`` ones;
  ``block`` weights of [128, 128] with dynamic 1x128 ``group`` activations (FP8_BLOCK).
- ModelOpt FP8 (``quant_method: modelopt``, ``quant_algo: FP8``): per-tensor weight and static
  per-tensor input scales; its settings from config.json or, where that has none, ModelOpt's
  hf_quant_config.json (``{"producer": ..., "quantization": {"quant_algo": ..., "exclude_modules": ...}}``).
- the fine-grained block format of the Qwen3 / DeepSeek FP8 releases (``quant_method: fp8``,
  ``weight_block_size: [128, 128]``, ``weight_scale_inv``, dynamic 1x128 activation groups), and
  its per-tensor form in Mistral's FP8 releases (Ministral 3: no ``weight_block_size``,
  ``activation_scheme: static``, one ``weight_scale_inv`` and one ``activation_scale`` a module).

Artifact layout, per projection ``P`` (qkv_proj, o_proj, gate_up_proj, down_proj):

    P.weight        float8_e4m3fn [N, K]      the checkpoint's fp8 values, fused along N
    P.weight_scale  float32 [N]               "channel": W[n, k] = weight[n, k] * scale[n]
                    float32 [N, ceil(K/128)]  "block": W[n, k] = weight[n, k] * scale[n, k // 128]
    P.input_scale   float32 [1]               "static" activations only

MoE experts (kernels/fused_moe_fp8.py), per layer, stacked as the half-type ones (builder/plan.py
``moe_tensors``): each expert's gate/up/down module quantised or converted as a projection is,
the router (and Qwen2-MoE's shared-expert gate) left in the half type, the shared expert a dense
FP8 MLP (``shared_expert.gate_up_proj`` / ``.down_proj`` as above):

    experts.gate_up        float8_e4m3fn [E, 2I, H]
    experts.gate_up_scale  float32 [E, 2I] (channel) or [E, 2I, ceil(H/128)] (block, repeated over rows)
    experts.down           float8_e4m3fn [E, H, I]
    experts.down_scale     float32 [E, H] or [E, H, ceil(I/128)]

Experts take dynamic activations only (per token, or per 1x128 group with block weights):
checkpoints with static input scales are refused for MoE models (``check_moe``), as are FP8
checkpoints of gpt-oss (its experts stacked in one tensor); ``--quant fp8`` on gpt-oss quantises
each expert's de-interleaved gate/up rows and its down rows, its biases stay in the half type.

Per-tensor weight scales become per-channel ones (each output channel repeats its tensor's
scale): exact, no requantisation, and q/k/v (gate/up) with different per-tensor scales fuse
without loss. Block scales are stored repeated over the 128 output rows of their block (1/32
of the fp8 bytes more than [N/128, K/128]), so fused sections and tensor-parallel column cuts
need not fall on 128-row boundaries; a row-parallel cut must fall on a 128-column boundary.
Static input scales of fused projections (q/k/v, gate/up: one input) are equal when calibrated on
the same data; where a checkpoint's differ the largest is kept (no activation clips that did not
before) and report.md says so.

An LM head the checkpoint stores in FP8 (lm_head left out of its ignore list) is dequantised at
build into the half type (``dequantise_head``; report.md notes it), or with --fp8-lm-head kept as
it is. Any other FP8 tensor reaching the plain path is refused by builder/shard.py.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from pagecast.builder import shard
from pagecast.kernels import reference
from pagecast.runtime.errors import BuildError

FP8_MAX = 448.0
BLOCK = 128
PARTS = ("weight", "weight_scale", "input_scale")
FUSED = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
DECODER_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class Fp8Config:
    """An FP8 (W8A8) build as the builder understands it; recorded in the manifest.

    ``source``: "build" (quantised here from half-type weights), "compressed-tensors", "modelopt"
    or "fp8" (transformers' fine-grained format: ``weight_scale_inv``, blocks or per tensor).
    ``weights``: "channel" or "block" (the artifact's scale layout; per-tensor checkpoints are held
    per channel). ``activations``:
    "token" (dynamic per token), "group" (dynamic per 1x128 group) or "static" (``input_scale``).
    """

    source: str
    weights: str
    activations: str
    checkpoint_weights: str  # what the checkpoint holds: "channel", "tensor" or "block"
    method: str = "fp8"
    block_size: int = 0  # 128 for block weights / group activations
    group_size: int = 0  # no int4 groups (the W4A16 tuner keys on this)
    # enginebuild --fp8-lm-head: the LM head quantised at build as a projection is (per output
    # channel, activations per token; ``with_lm_head``); False keeps it in the half type.
    lm_head: bool = False

    def __post_init__(self) -> None:
        if (self.weights, self.activations) not in (("channel", "token"), ("channel", "static"), ("block", "group")):
            raise ValueError(f"unsupported fp8 scheme: {self.weights} weights with {self.activations} activations")

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @property
    def scale_name(self) -> str:
        """A checkpoint module's weight scale: the fine-grained format's ``weight_scale_inv``
        (a multiplier despite its name, as transformers reads it), the others' ``weight_scale``."""
        return "weight_scale_inv" if self.source == "fp8" else "weight_scale"

    @property
    def input_scale_name(self) -> str:
        """A checkpoint module's static activation scale: the fine-grained format's
        ``activation_scale`` (Mistral's per-tensor releases), the others' ``input_scale``."""
        return "activation_scale" if self.source == "fp8" else "input_scale"

    def describe(self) -> str:
        acts = {
            "token": "activations quantised per token at run time",
            "group": "activations quantised per 1x128 group at run time",
            "static": "activations quantised with the checkpoint's static per-tensor input scale",
        }[self.activations]
        weights = {
            "channel": "per-output-channel weight scales",
            "tensor": "per-tensor weight scales (held per channel)",
            "block": "128x128 weight blocks",
        }[self.checkpoint_weights]
        origin = "quantised at build from the half-type weights" if self.source == "build" else f"{self.source} checkpoint"
        if self.lm_head:
            head = "embedding in the half type; LM head FP8 (--fp8-lm-head: per-channel scales computed at build)"
        else:
            head = "embedding and LM head in the half type"
        return f"FP8 e4m3 W8A8 ({origin}): {weights}, {acts}; {head}."


def is_fp8(cfg: Any) -> bool:
    return isinstance(cfg, Fp8Config)


def with_lm_head(cfg: Any, model: Any) -> Fp8Config:
    """``cfg`` with an FP8 LM head (enginebuild --fp8-lm-head), or a BuildError saying why not.

    The head is quantised at build from its half-type weight (FP8 checkpoints leave it out), per
    output channel, and its input quantised per token like the projections': so the build must be
    per-channel weights with per-token activations. A head tied to the embedding is refused (it
    would need an FP8 copy of the embedding matrix beside the half-type one the lookup reads)."""
    if not is_fp8(cfg):
        raise BuildError(
            "--fp8-lm-head quantises the LM head of an FP8 build: add --quant fp8 (or build an FP8 checkpoint)"
        )
    if (cfg.weights, cfg.activations) != ("channel", "token"):
        raise BuildError(
            f"--fp8-lm-head needs per-channel weights with per-token activations (--quant fp8 on a float "
            f"checkpoint, or an FP8_DYNAMIC one); this checkpoint is {cfg.checkpoint_weights} weights with "
            f"{cfg.activations} activations: build without --fp8-lm-head"
        )
    if model.lm_head_name is None:
        raise BuildError(
            f"--fp8-lm-head: {model.architecture} ties its LM head to the embedding (tie_word_embeddings), so the "
            f"head has no weight of its own to quantise; build without --fp8-lm-head"
        )
    return dataclasses.replace(cfg, lm_head=True)


def with_scheme(cfg: Any, scheme: str) -> Fp8Config:
    """``cfg`` for enginebuild --fp8-scheme: a float checkpoint quantised at build (--quant fp8) per
    output channel with per-token activations ("channel", the default) or in 128x128 weight blocks
    with 1x128 activation groups ("block"); an FP8 checkpoint keeps its own scheme, so naming
    another is refused, as is the option without an FP8 build."""
    if not is_fp8(cfg):
        raise BuildError("--fp8-scheme chooses how --quant fp8 quantises a float checkpoint: add --quant fp8")
    if cfg.source == "build":
        return _BUILD_BLOCK if scheme == "block" else _BUILD
    if cfg.weights != scheme:
        raise BuildError(
            f"--fp8-scheme {scheme}: the checkpoint is already FP8 ({cfg.source}: {cfg.checkpoint_weights} weights, "
            f"{cfg.activations} activations), built as it is; drop --fp8-scheme"
        )
    return cfg


def is_lm_head(t: Any) -> bool:
    """The LM head's weight or, once planned FP8, its scale."""
    return t.name in ("lm_head.weight", "lm_head.weight_scale")


def head_config(cfg: Fp8Config) -> Fp8Config:
    """How an LM head the FP8 checkpoint itself stores in FP8 is read (``read_module``): in the
    checkpoint's weight layout, with no static input scale required (the head runs in the half
    type, or with --fp8-lm-head per token; it has no calibrated input of its own to keep)."""
    return dataclasses.replace(cfg, activations="token") if cfg.activations == "static" else cfg


def dequantise_head(cfg: Fp8Config, w: torch.Tensor, read: Any, dtype: torch.dtype) -> torch.Tensor:
    """The checkpoint's FP8 LM head ``w`` in ``dtype``: its values times their scales (per tensor,
    per channel or per 128x128 block, read as the projections' are)."""
    q, scale, _ = read_module(head_config(cfg), "lm_head", lambda name: w if name == "lm_head.weight" else read(name))
    out = torch.empty(q.shape, dtype=dtype)
    for i in range(0, q.shape[0], 4096):  # in row chunks: an fp32 copy of a 128k-row head is GBs
        out[i : i + 4096] = reference.dequantize_fp8(q[i : i + 4096], scale[i : i + 4096]).to(dtype)
    return out


def stores_fp8_head(cfg: Fp8Config, read: Any) -> bool:
    """Whether the FP8 checkpoint quantised its LM head too (its scale is there: ignore /
    exclude_modules / modules_to_not_convert left lm_head out of their list)."""
    if cfg.source == "build":
        return False
    try:
        read(f"lm_head.{cfg.scale_name}")
    except BuildError:
        return False
    return True


# ---------------------------------------------------------------------------- reading the config

_BUILD = Fp8Config(source="build", weights="channel", activations="token", checkpoint_weights="channel")
_BUILD_BLOCK = Fp8Config(source="build", weights="block", activations="group", checkpoint_weights="block", block_size=BLOCK)


def _check_ignored(names: list[str], key: str) -> None:
    blocking = [
        m for m in names
        if any(m.endswith((p, f"{p}$")) or f"{p}." in m for p in DECODER_PROJECTIONS)
        or m in ("Linear", "re:.*")
    ]  # fmt: skip
    if blocking:
        raise BuildError(
            f"the FP8 checkpoint's {key} {blocking} leaves decoder projections unquantised; pagecast fuses "
            f"q/k/v and gate/up into one FP8 GEMM each and quantises every projection (lm_head may be left out)"
        )


def _compressed_tensors(qc: dict[str, Any]) -> Fp8Config:
    fmt = str(qc.get("format", "")).lower()
    groups = qc.get("config_groups") or {}
    if fmt not in ("float-quantized", "naive-quantized") or not groups:
        raise BuildError(
            f"compressed-tensors format {fmt!r} with config_groups {sorted(groups)} is not supported: pagecast reads "
            f"FP8 'float-quantized' checkpoints (llm-compressor FP8, FP8_DYNAMIC, FP8_BLOCK) only"
        )
    if len(groups) != 1:
        raise BuildError(
            f"compressed-tensors config_groups {sorted(groups)}: one scheme for every Linear is supported, not "
            f"{len(groups)} (mixed-precision checkpoints are not)"
        )
    group = next(iter(groups.values()))
    w, a = group.get("weights") or {}, group.get("input_activations")
    targets = group.get("targets") or []
    if targets and "Linear" not in targets and not any("proj" in str(t) for t in targets):
        raise BuildError(f"compressed-tensors targets {targets}: expected 'Linear'")
    found = (
        f"weights {w.get('type')} {w.get('num_bits')}-bit {w.get('strategy')}"
        + (f" {w.get('block_structure')}" if w.get("block_structure") else "")
        + ("; no activation quantisation" if not a else f"; activations {a.get('type')} {a.get('num_bits')}-bit "
           f"{a.get('strategy')} {'dynamic' if a.get('dynamic') else 'static'}")
    )  # fmt: skip
    refuse = BuildError(
        f"compressed-tensors scheme not supported ({found}); pagecast reads FP8 e4m3 W8A8: channel weights with "
        f"dynamic token or static tensor activations, tensor weights with static tensor or dynamic token "
        f"activations, [128, 128] block weights with dynamic 1x128 group activations (weight-only FP8 and int "
        f"schemes are not)"
    )
    if w.get("type") != "float" or int(w.get("num_bits", 0)) != 8 or not w.get("symmetric", True) or w.get("dynamic"):
        raise refuse
    if not a or a.get("type") != "float" or int(a.get("num_bits", 0)) != 8 or not a.get("symmetric", True):
        raise refuse
    ws, as_, dynamic = str(w.get("strategy")), str(a.get("strategy")), bool(a.get("dynamic"))
    _check_ignored([str(m) for m in qc.get("ignore") or []], "ignore list")
    if ws in ("channel", "tensor") and as_ == "token" and dynamic:
        return Fp8Config("compressed-tensors", "channel", "token", ws)
    if ws in ("channel", "tensor") and as_ == "tensor" and not dynamic:
        return Fp8Config("compressed-tensors", "channel", "static", ws)
    if ws == "block" and list(w.get("block_structure") or []) == [BLOCK, BLOCK] and as_ == "group" and dynamic:
        if int(a.get("group_size") or 0) != BLOCK:
            raise refuse
        return Fp8Config("compressed-tensors", "block", "group", "block", block_size=BLOCK)
    raise refuse


def _modelopt_section(qc: dict[str, Any]) -> dict[str, Any]:
    """The ModelOpt settings: hf_quant_config.json (and some config.json exports) nest them under
    ``quantization``; others put ``quant_algo`` / ``exclude_modules`` beside ``quant_method``."""
    nested = qc.get("quantization")
    return nested if isinstance(nested, dict) else qc


def is_modelopt_kv_cache_only(qc: dict[str, Any] | None) -> bool:
    """A ModelOpt config that quantises the KV cache and no weights (``quant_algo`` null,
    ``kv_cache_quant_algo`` set): the weights are in the float type, so it builds as an ordinary
    checkpoint (its KV scales are read by --kv-cache-dtype fp8)."""
    if not qc or str(qc.get("quant_method", "")).lower() != "modelopt":
        return False
    section = _modelopt_section(qc)
    return not section.get("quant_algo") and bool(section.get("kv_cache_quant_algo"))


def _modelopt(qc: dict[str, Any]) -> Fp8Config:
    section = _modelopt_section(qc)
    algo = str(section.get("quant_algo") or "")
    if algo.upper() != "FP8":
        raise BuildError(
            f"ModelOpt quant_algo {algo!r} is not supported: pagecast reads ModelOpt 'FP8' (per-tensor) checkpoints "
            f"only (NVFP4, INT4_AWQ, W4A8 and FP8_PB_WO are not)"
        )
    excluded = section.get("exclude_modules") or section.get("ignore") or []
    _check_ignored([str(m) for m in excluded], "exclude_modules")
    return Fp8Config("modelopt", "channel", "static", "tensor")


def _fine_grained(qc: dict[str, Any]) -> Fp8Config:
    block = list(qc.get("weight_block_size") or [])
    scheme = str(qc.get("activation_scheme", "dynamic")).lower()
    fmt = str(qc.get("fmt", "e4m3")).lower()
    if fmt != "e4m3":
        raise BuildError(f"quant_method fp8 with fmt {fmt!r} is not supported (only e4m3)")
    if block == [BLOCK, BLOCK] and scheme == "dynamic":
        cfg = Fp8Config("fp8", "block", "group", "block", block_size=BLOCK)
    elif not block and scheme == "static":  # Mistral's FP8 releases (Ministral 3): a weight and an input scale a module
        cfg = Fp8Config("fp8", "channel", "static", "tensor")
    else:
        raise BuildError(
            f"quant_method fp8 with weight_block_size {block or None} and activation_scheme {scheme!r} is not "
            f"supported: pagecast reads the [128, 128] block format with dynamic activations, and per-tensor "
            f"weights (no weight_block_size) with static activations (weight_scale_inv, activation_scale)"
        )
    _check_ignored([str(m) for m in qc.get("modules_to_not_convert") or []], "modules_to_not_convert")
    return cfg


FP8_METHODS = ("compressed-tensors", "modelopt", "fp8")


def read_config(qc: dict[str, Any] | None, requested: str | None) -> Fp8Config | None:
    """The FP8 build for this checkpoint, or None when it is not FP8 and ``--quant fp8`` was not
    asked. A float checkpoint with ``--quant fp8`` is quantised at build; an FP8 checkpoint builds
    FP8 whether or not ``--quant fp8`` is given; ``--quant awq/gptq`` on an FP8 checkpoint, or
    ``--quant fp8`` on an int4 one, is refused naming what the checkpoint holds."""
    if not qc:
        return _BUILD if requested == "fp8" else None
    method = str(qc.get("quant_method", "<none>")).lower()
    if method not in FP8_METHODS:
        if requested == "fp8":
            raise BuildError(
                f"--quant fp8: the checkpoint is already quantised (quant_method {method!r}); pagecast quantises "
                f"only float checkpoints to FP8. Build it as it is (drop --quant) or start from the float weights"
            )
        return None
    cfg = {"compressed-tensors": _compressed_tensors, "modelopt": _modelopt, "fp8": _fine_grained}[method](qc)
    if requested is not None and requested != "fp8":
        raise BuildError(
            f"--quant {requested}: the checkpoint is FP8-quantised ({method}, {cfg.checkpoint_weights} weights, "
            f"{cfg.activations} activations), not {requested.upper()}; pass --quant fp8 or leave --quant out"
        )
    return cfg


# ---------------------------------------------------------------------------- one module to the artifact layout


def quantise_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Half/fp32 [N, K] -> (e4m3 [N, K], fp32 [N]): per output channel, scale = amax / 448."""
    return reference.quantize_fp8_rows(w.float())


def quantise_weight_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Half/fp32 [N, K] -> (e4m3 [N, K], fp32 [N, ceil(K / 128)]): a scale (amax / 448) per 128 x
    128 block (the last ones partial), in the artifact's layout: each block's scale on each of its
    rows, as read_module holds a block checkpoint's."""
    wf = w.float()
    n, k = wf.shape
    nb, kb = -(-n // BLOCK), -(-k // BLOCK)
    padded = torch.nn.functional.pad(wf.abs(), (0, kb * BLOCK - k, 0, nb * BLOCK - n)).view(nb, BLOCK, kb, BLOCK)
    blocks = reference.fp8_amax_scale(padded.amax(dim=(1, 3)))  # [nb, kb]
    rows = blocks.repeat_interleave(BLOCK, dim=0)[:n]  # [N, kb]
    q = (wf / rows.repeat_interleave(BLOCK, dim=1)[:, :k]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, rows.contiguous()


def _scale_tensor(module: str, kind: str, read: Any) -> torch.Tensor:
    try:
        s = read(f"{module}.{kind}")
    except BuildError as e:
        raise BuildError(f"the FP8 checkpoint has no tensor '{module}.{kind}'; is it complete?") from e
    s = s.float()
    if not torch.isfinite(s).all() or bool((s < 0).any()):
        raise BuildError(f"{module}.{kind} holds NaN, inf or negative scales; the checkpoint is corrupt")
    return s


def read_module(cfg: Fp8Config, module: str, read: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """One checkpoint module -> (e4m3 weight [N, K], artifact scale, input scale or None).

    The artifact scale is fp32 [N] (channel) or [N, ceil(K / 128)] (block, repeated over rows)."""
    w = read(f"{module}.weight")
    if cfg.source == "build":
        if w.dtype == torch.float8_e4m3fn:
            raise BuildError(f"{module}.weight is already fp8 but the checkpoint has no FP8 quantization_config")
        if not torch.isfinite(w).all():
            raise BuildError(f"{module}.weight contains NaN or inf; the checkpoint is corrupt")
        q, s = quantise_weight_blocks(w) if cfg.weights == "block" else quantise_weight(w)
        return q, s, None
    if w.dtype != torch.float8_e4m3fn:
        raise BuildError(
            f"{module}.weight is {str(w.dtype).removeprefix('torch.')}, not float8_e4m3fn, in an FP8 "
            f"({cfg.source}) checkpoint; mixed float/FP8 projections are not supported"
        )
    n, k = w.shape
    if cfg.checkpoint_weights == "block":
        s = _scale_tensor(module, cfg.scale_name, read)
        nb, kb = -(-n // BLOCK), -(-k // BLOCK)
        if tuple(s.shape) != (nb, kb):
            raise BuildError(f"{module} block scales have shape {tuple(s.shape)}, expected {(nb, kb)} for [{n}, {k}]")
        scale = s.repeat_interleave(BLOCK, dim=0)[:n].contiguous()
    else:
        s = _scale_tensor(module, cfg.scale_name, read)
        if s.numel() == 1:
            scale = s.reshape(()).expand(n).contiguous()
        elif s.numel() == n:
            scale = s.reshape(n).contiguous()
        else:
            raise BuildError(f"{module}.{cfg.scale_name} has shape {tuple(s.shape)}; expected one scale or {n} (per channel)")
    input_scale = None
    if cfg.activations == "static":
        name = cfg.input_scale_name
        input_scale = _scale_tensor(module, name, read).reshape(-1)
        if input_scale.numel() != 1:
            raise BuildError(f"{module}.{name} has {input_scale.numel()} values; a static per-tensor scale is one")
        if float(input_scale) <= 0:
            raise BuildError(f"{module}.{name} is {float(input_scale)}; the checkpoint is corrupt")
    return w, scale, input_scale


def random_module(cfg: Fp8Config, n: int, k: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Random weights of about 0.02 standard deviation in the artifact layout (--load-format dummy)."""
    w = torch.randn((n, k), generator=gen, device=gen.device) * 0.02
    if cfg.weights == "block":  # every row its own scale per 128-column block: a valid block layout
        wq, s = reference.quantize_fp8_groups(w)
        return wq.cpu(), s.cpu(), None
    wq, s = reference.quantize_fp8_rows(w)
    inp = torch.tensor([0.02], dtype=torch.float32) if cfg.activations == "static" else None
    return wq.cpu(), s.cpu(), inp


# ---------------------------------------------------------------------------- the build's hooks

Cut = tuple[int, int, int] | None
EXPERTS = ("experts.gate_up", "experts.down")  # the stacked expert tensors of a MoE layer


def check_moe(cfg: Fp8Config, moe: Any, architecture: str) -> None:
    """Refuse the MoE models whose experts the FP8 MoE kernels cannot run."""
    if moe.stacked and cfg.source != "build":
        raise BuildError(
            f"{architecture}: FP8 checkpoints of this MoE family (experts stacked in one tensor) are not supported; "
            f"build the half-type checkpoint with --quant fp8"
        )
    if cfg.activations == "static":
        raise BuildError(
            f"{architecture}: the FP8 checkpoint ({cfg.source}) has static per-tensor input scales; pagecast's "
            f"FP8 MoE experts quantise activations dynamically (per token or per 1x128 group): use a dynamic "
            f"scheme (FP8_DYNAMIC, FP8_BLOCK) or --quant fp8 on the half-type checkpoint"
        )


def is_experts(t: Any) -> bool:
    """A MoE layer's stacked expert weight (``layers.i.experts.gate_up`` / ``.down``)."""
    return t.name.split(".", 2)[-1] in EXPERTS


def is_expert_part(t: Any) -> bool:
    return t.name.split(".", 2)[-1] in EXPERTS + tuple(f"{e}_scale" for e in EXPERTS)


def _expert_parts(t: Any, cfg: Fp8Config) -> list[Any]:
    """An expert stack [E, N, K] (one rank's) -> its e4m3 weight and fp32 scale parts."""
    e, n, k = t.shape
    row = _row_cut(t)
    if cfg.weights == "block" and row is not None and k % BLOCK:
        raise BuildError(
            f"--tp {row[1]}: {t.name} cuts each expert's {k * row[1]} intermediate columns into {k} per rank, not a "
            f"multiple of the 128-column weight block; choose a --tp for which it is"
        )
    scale = (e, n) if cfg.weights == "channel" else (e, n, -(-k // BLOCK))
    return [
        dataclasses.replace(t, dtype="float8_e4m3fn"),
        dataclasses.replace(t, name=f"{t.name}_scale", shape=scale, dtype="float32"),
    ]


def is_projection(t: Any) -> bool:
    base, _, leaf = t.name.rpartition(".")
    return leaf == "weight" and base.rpartition(".")[2] in FUSED


def is_part(t: Any) -> bool:
    base, _, leaf = t.name.rpartition(".")
    return leaf in PARTS and base.rpartition(".")[2] in FUSED


def _row_cut(t: Any) -> tuple[int, int] | None:
    cut = t.source_cuts[0] if t.source_cuts else None
    return None if cut is None or cut[0] != 1 else (cut[1], cut[2])


def plan_tensors(tensors: list[Any], cfg: Fp8Config, read: Any = None) -> tuple[list[Any], list[str]]:
    """Replace each projection weight of the (per-rank) float layout by its FP8 parts, with the
    same sources and cuts; embedding, norms, biases and LM head stay in the half type. With
    static activations the fused modules' input scales are read (``read``; None for dummy
    weights) and a note says where they differ (the largest is used)."""
    out: list[Any] = []
    notes: list[str] = []
    for t in tensors:
        if is_experts(t):
            out += _expert_parts(t, cfg)
            continue
        if t.name == "lm_head.weight" and t.rank == 0 and read is not None and stores_fp8_head(cfg, read):
            notes.append(
                "lm_head: the checkpoint stores the LM head in FP8 (lm_head is not in its ignore list); "
                + (
                    "--fp8-lm-head runs it FP8 with the checkpoint's values and scales, its input per token"
                    if cfg.lm_head
                    else "it is dequantised at build (fp8 x scale) into the half type and runs as a half-type "
                    "head (--fp8-lm-head keeps it FP8, for per-channel checkpoints with dynamic activations)"
                )
            )
        if not (is_projection(t) or (cfg.lm_head and is_lm_head(t))):
            out.append(t)
            continue
        base = t.name.rpartition(".")[0]
        if cfg.activations == "static" and read is not None and len(t.sources) > 1 and t.rank == 0:
            statics = [
                float(read(f"{shard.without_deinterleave(s).removesuffix('.weight')}.{cfg.input_scale_name}").float().reshape(-1)[0])
                for s in t.sources
            ]
            if max(statics) != min(statics):
                notes.append(
                    f"{base}: the fused modules' static input scales differ "
                    f"({', '.join(f'{v:.6g}' for v in statics)}); their shared input uses the largest"
                )
        n, k = t.shape
        row = _row_cut(t)
        if cfg.weights == "block" and row is not None and k % BLOCK:
            raise BuildError(
                f"--tp {row[1]}: {base} is row-parallel and its {k} inputs per rank are not a multiple of the "
                f"128-column weight block: a rank's slice would cut a block; choose a --tp for which it is"
            )
        shapes: dict[str, tuple[tuple[int, ...], str]] = {"weight": ((n, k), "float8_e4m3fn")}
        shapes["weight_scale"] = ((n,), "float32") if cfg.weights == "channel" else ((n, -(-k // BLOCK)), "float32")
        if cfg.activations == "static":
            shapes["input_scale"] = ((1,), "float32")
        for part, (shape, dtype) in shapes.items():
            out.append(dataclasses.replace(t, name=f"{base}.{part}", shape=shape, dtype=dtype))
    return out, notes


def check_tensors(tensors: list[Any], cfg: Fp8Config, shapes: dict[str, tuple[int, ...]]) -> None:
    """Every projection's checkpoint modules exist with the planned [N, K] (and, for an FP8
    checkpoint, their scales)."""
    for t in tensors:
        if is_experts(t) and cfg.source != "build":  # shapes: plan.check_shapes; here the scales
            name = cfg.scale_name
            for source in t.sources:
                if f"{source.removesuffix('.weight')}.{name}" not in shapes:
                    raise BuildError(f"the FP8 ({cfg.source}) checkpoint has no tensor '{source.removesuffix('.weight')}.{name}'")
        if not is_projection(t):
            continue
        n_total, k = t.shape
        n_sum = 0
        for source in t.sources:
            source = shard.without_deinterleave(source)  # (interleaved RoPE's q/k rows, reordered: same shape)
            module = source.removesuffix(".weight")
            shape = shapes.get(source)
            if shape is None:
                raise BuildError(f"the checkpoint has no tensor '{source}'")
            if len(shape) != 2 or shape[1] != k:
                raise BuildError(f"{source} has shape {tuple(shape)}, expected [*, {k}]")
            if cfg.source != "build":
                if f"{module}.{cfg.scale_name}" not in shapes:
                    raise BuildError(f"the FP8 ({cfg.source}) checkpoint has no tensor '{module}.{cfg.scale_name}'")
                if cfg.activations == "static" and f"{module}.{cfg.input_scale_name}" not in shapes:
                    raise BuildError(
                        f"the FP8 ({cfg.source}) checkpoint has static activations but no '{module}.{cfg.input_scale_name}'"
                    )
            n_sum += shape[0]
        if n_sum != n_total:
            raise BuildError(f"{', '.join(t.sources)} give {n_sum} output rows, expected {n_total}")


def _cut(x: torch.Tensor, cut: Cut, kind: str) -> torch.Tensor:
    """Cut one source's artifact part as builder.shard cuts its float weight [N, K]: the weight
    as it is, a scale along N with its rows; a row-parallel (K) cut keeps per-channel scales whole
    and takes the rank's 128-column blocks of block scales (plan_tensors checked they align)."""
    from pagecast.builder import shard

    if cut is None or (kind == "weight_scale" and cut[0] == 1 and x.dim() == 1):
        return x
    return shard.cut_source(x, cut)


class Materialiser:
    """Converts each projection's checkpoint modules (or quantises the float ones) once and hands
    every rank its cut of the parts, in the planned order."""

    def __init__(
        self, cfg: Fp8Config, read: Any, gen: torch.Generator | None, model: Any = None, dtype: str = "bfloat16"
    ):
        self.cfg, self.read, self.gen, self.dtype = cfg, read, gen, getattr(torch, dtype)
        self.dims = _projection_dims(model) if model is not None else {}
        self._base: str | None = None
        self._modules: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]] = []
        self._head: torch.Tensor | None = None  # an FP8 checkpoint head dequantised, for every rank's cut

    def handles(self, t: Any) -> bool:
        if self.cfg.lm_head and is_lm_head(t):
            return True
        if t.name == "lm_head.weight" and self.cfg.source != "build" and self.gen is None:
            return True  # the half-type head of an FP8 checkpoint, which may store it in FP8 too
        self._head = None
        return is_part(t) or is_expert_part(t)

    def __call__(self, t: Any) -> torch.Tensor:
        if is_expert_part(t):
            return self._experts(t)
        if t.name == "lm_head.weight" and not self.cfg.lm_head:
            return self._half_head(t)
        base, _, part = t.name.rpartition(".")
        if base != self._base:
            self._base, self._modules = base, self._whole(base, t)
        cuts = tuple(t.source_cuts) or (None,) * len(self._modules)
        if part == "input_scale":
            scales = [m[2] for m in self._modules]
            assert all(s is not None for s in scales)
            return torch.stack([s.reshape(()) for s in scales if s is not None]).amax().reshape(1).float()
        index = 0 if part == "weight" else 1
        pieces = [_cut(m[index], cut, part) for m, cut in zip(self._modules, cuts, strict=True)]
        out = pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=0)
        return out.contiguous()

    def _experts(self, t: Any) -> torch.Tensor:
        """A rank's expert stack or its scales: every expert's modules converted once (per layer),
        each cut as planned, the groups of ``stack`` modules concatenated, the experts stacked."""
        base = t.name.removesuffix("_scale")
        scale = t.name != base
        if base != self._base:
            if self.gen is not None:
                e, n, k = self.dims[base]
                modules = [random_module(self.cfg, n // t.stack, k, self.gen) for _ in range(e * t.stack)]
            else:  # each expert's module (gpt-oss, quantised here: its piece of the stacked tensor)
                modules = [_source_module(self.cfg, s, self.read) for s in t.sources]
            self._base, self._modules = base, modules
        cuts = tuple(t.source_cuts) or (None,) * len(self._modules)
        pieces = [_cut(m[1] if scale else m[0], c, "weight_scale" if scale else "weight") for m, c in zip(self._modules, cuts, strict=True)]
        groups = [pieces[i : i + t.stack] for i in range(0, len(pieces), t.stack)]
        return torch.stack([g[0] if len(g) == 1 else torch.cat(g, dim=0) for g in groups]).contiguous()

    def _half_head(self, t: Any) -> torch.Tensor:
        """A rank's cut of the LM head in the half type: an FP8 one dequantised once (for all ranks)."""
        head = self._head if self._head is not None else self.read("lm_head.weight")
        if head.dtype == torch.float8_e4m3fn:
            head = self._head = dequantise_head(self.cfg, head, self.read, self.dtype)
        return shard.rank_tensor(lambda _: head, t, self.dtype)

    def _whole(self, base: str, t: Any) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]:
        # The LM head (--fp8-lm-head) is quantised here from its half-type weight whatever the
        # checkpoint's projections are (FP8 checkpoints mostly leave it out of their quantisation);
        # one the checkpoint stores in FP8 keeps its values and scales.
        cfg = _BUILD if base == "lm_head" else self.cfg
        if self.gen is not None:
            widths = self.dims[base]
            return [random_module(cfg, n, widths[1], self.gen) for n in widths[0]]
        if base == "lm_head":
            w = self.read("lm_head.weight")
            if w.dtype == torch.float8_e4m3fn:
                return [read_module(head_config(self.cfg), base, lambda n: w if n == "lm_head.weight" else self.read(n))]
            return [read_module(cfg, base, lambda n: w if n == "lm_head.weight" else self.read(n))]
        return [_source_module(cfg, s, self.read) for s in t.sources]


def _source_module(cfg: Fp8Config, source: str, read: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """read_module of the module a plan source names. Quantised here (``cfg.source`` "build"): its
    weight read as planned (interleaved RoPE's q/k rows reordered, an expert's piece of a stack),
    then rounded. From an FP8 checkpoint: interleaved RoPE's q/k rows (shard.deinterleaved) reordered
    with their per-row scales (the artifact's channel and block scales are per row; a per-tensor
    input scale is unchanged)."""
    module = shard.without_deinterleave(source).removesuffix(".weight")
    if cfg.source == "build":
        return read_module(cfg, module, lambda _: shard.read_source(read, source))
    q, scale, input_scale = read_module(cfg, module, read)
    if (dims := shard.deinterleave_dims(source)) is not None:
        q = shard.deinterleave_rows(q.view(torch.uint8), *dims).view(q.dtype)
        scale = shard.deinterleave_rows(scale, *dims)
    return q, scale, input_scale


def _projection_dims(model: Any) -> dict[str, tuple[tuple[int, ...], int]]:
    """Artifact projection -> (output widths of its fused modules, K) for the whole model."""
    a, inter, h = model.attention, model.mlp.intermediate_size, model.hidden_size
    q, kv = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
    out: dict[str, tuple[tuple[int, ...], int]] = {"lm_head": ((model.vocab_size,), h)}
    for layer in model.layers:
        o = f"layers.{layer.index}"
        out[f"{o}.qkv_proj"] = ((q, kv, kv), h)
        out[f"{o}.o_proj"] = ((h,), q)
        out[f"{o}.gate_up_proj"] = ((inter, inter), h)
        out[f"{o}.down_proj"] = ((h,), inter)
        moe = layer.mlp if getattr(layer.mlp, "kind", "") == "moe" else None
        if moe is not None:  # whole-model [E, N, K] of the expert stacks; the shared expert's widths
            e, i = moe.num_experts, moe.intermediate_size
            out[f"{o}.experts.gate_up"] = (e, 2 * i, h)  # type: ignore[assignment]
            out[f"{o}.experts.down"] = (e, h, i)  # type: ignore[assignment]
            if moe.shared_expert_size:
                out[f"{o}.shared_expert.gate_up_proj"] = ((moe.shared_expert_size,) * 2, h)
                out[f"{o}.shared_expert.down_proj"] = ((h,), moe.shared_expert_size)
    return out


def linear_method_source(cfg: Fp8Config) -> str:
    return f"quant_linear.Fp8Linear(weights={cfg.weights!r}, activations={cfg.activations!r})"


def report_lines(tuning: dict[str, Any] | None, cfg: Fp8Config, tp: int = 1) -> list[str]:
    lines = ["", "## Quantisation", "", cfg.describe()]
    if tp > 1:
        lines += [
            "",
            f"Tensor parallel ({tp} ranks): the FP8 weights are cut as the half-type ones, each scale with its rows "
            f"(qkv_proj, gate_up_proj) or, for o_proj and down_proj, kept whole per channel"
            + (" / cut at its 128-column blocks" if cfg.weights == "block" else "")
            + (
                "; per-token activation scales of o_proj and down_proj are each rank's own (over its input slice)"
                if cfg.activations == "token"
                else ""
            )
            + ".",
        ]
    entries = ((tuning or {}).get("kernels") or {}).get("fp8_gemm") or {}
    if not entries:
        return lines + ["", "FP8 GEMM not tuned here (CPU artifact or no GPU present): launcher defaults apply."]
    block = cfg.weights == "block"
    lines += [
        "",
        "Reference: torch._scaled_mm (rowwise scales, fp32 promotion) where it runs"
        + (", else (block scales) the half-type F.linear of the same shape" if block else "")
        + ". Roofline fraction: the larger of the weight-and-rows bytes at the measured copy bandwidth and"
        " the FLOPs at the GPU's dense FP8 peak, over the chosen time. Best Triton tile: the fastest Triton"
        " config timed (the chosen one unless torch._scaled_mm won; '-' where none was, e.g. a pinned or"
        " budget-cut bucket). Input apart: qkv and gate_up with their norm, down with its activation, in a"
        " launch of their own before the chosen config, where the fused decode kernel would take them in;"
        " 'kept' where that was faster and serving runs it so.",
        "",
        "| projection.rows | chosen | time (us) | best Triton tile (us) | reference (us) | roofline fraction | input apart (us) |",
        "|---|---|---|---|---|---|---|",
    ]
    for bucket, entry in entries.items():
        config = entry.get("config") or {}
        chosen = ", ".join(f"{k}={v}" for k, v in config.items())
        if config.get("scaled_mm"):
            chosen = "torch._scaled_mm" + (", fast accumulation" if config.get("fast_accum") else "")
        t, ref = entry.get("time_us"), entry.get("reference_us")
        frac = roofline_fraction(tuning or {}, bucket, t)
        tile = best_triton_us(entry)
        apart = entry.get("apart_us")
        apart_text = "-" if apart is None else f"{apart:.1f}" + (" (kept)" if entry.get("feed_apart") else "")
        lines.append(
            f"| {bucket} | {chosen} | {t or 0:.1f} | {'-' if tile is None else f'{tile:.1f}'} | {ref or 0:.1f} | "
            f"{'-' if frac is None else f'{frac:.2f}'} | {apart_text} |"
        )
    return lines


def best_triton_us(entry: dict[str, Any]) -> float | None:
    """The fastest Triton config's time in a tuning entry: the chosen config's where it is a Triton
    tile, else the fastest of the ``alternatives`` the tuner kept (sorted by time; all of them
    Triton tiles when torch._scaled_mm won) that is one; None where no Triton config was timed."""
    timed = [(entry.get("config") or {}, entry.get("time_us"))]
    timed += [(a.get("config") or {}, a.get("time_us")) for a in entry.get("alternatives") or []]
    times = [float(t) for c, t in timed if not c.get("scaled_mm") and t is not None]
    return min(times) if times else None


# Dense FP8 tensor-core peak (FLOP/s) of the GPUs the tuner knows, from the vendors' data sheets (SXM).
FP8_PEAK_FLOPS = {"h100": 1979e12, "h200": 1979e12}


def roofline_fraction(tuning: dict[str, Any], bucket: str, time_us: float | None) -> float | None:
    """The bucket's roofline time (its bytes at the table's measured copy bandwidth, or its FLOPs at
    the GPU's FP8 peak, whichever is longer) over ``time_us``; None where a figure is missing."""
    from pagecast.kernels import problems
    from pagecast.kernels import tuning as kernel_tuning

    copy_gbs = tuning.get("copy_bandwidth_gbs")
    if not time_us or not copy_gbs or not tuning.get("shapes"):
        return None
    shapes = kernel_tuning.ModelShapes(**tuning["shapes"])
    dims = dict(problems.buckets("fp8_gemm", shapes)).get(bucket)
    if dims is None:
        return None
    nbytes, flops = problems.problem_size("fp8_gemm", shapes, dims)
    peak = FP8_PEAK_FLOPS.get(kernel_tuning.gpu_key(str(tuning.get("device", ""))))
    ideal_s = max(nbytes / (copy_gbs * 1e9), flops / peak if peak else 0.0)
    return ideal_s / (time_us * 1e-6)
