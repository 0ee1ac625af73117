"""Linear methods: how a projection's weights are held and applied, chosen at build time.

The rendered model calls ``ops.linear(x, weight, bias, projection)`` for every projection
whatever the format; the artifact's model.py names its method once (``LINEAR = ...``) and
``LINEAR.create_weights`` turns the artifact's tensors into what ``ops.linear`` takes:

- ``DenseLinear``: the half-type ``[N, K]`` weight as it is (F.linear or the skinny GEMM);
- ``Int4Linear``: AWQ and GPTQ checkpoints, repacked by the builder (``builder/quant.py``)
  into one layout, held as an ``Int4LinearWeight`` and run by the W4A16 GEMM
  (``kernels/w4a16_gemm.py``) on the GPU, by the exact dequantized reference on the CPU;
- ``Fp8Linear``: FP8 (W8A8, e4m3) weights with per-channel or 128x128-block scales
  (``builder/fp8.py``), held as an ``Fp8LinearWeight`` and run by the FP8 GEMM
  (``kernels/fp8_gemm.py``, or ``torch._scaled_mm`` where the tuner found it faster) on the GPU,
  by the exact emulation (``reference.fp8_linear``) on the CPU.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pagecast.kernels import reference

INT4_PARTS = ("qweight", "scales", "zeros", "perm")


def scale_dtype_for(dtype: str) -> torch.dtype:
    """The int4 scales' dtype in an artifact of activation dtype ``dtype``: fp32 artifacts keep fp32
    scales; half artifacts keep the checkpoint's fp16 scales (bf16 would round them). The builder
    stores them so (builder/quant.py) and the tuner times the kernels with them (kernels/problems.py):
    their size moves the W4A16 tiles' shared memory."""
    return torch.float32 if dtype == "float32" else torch.float16


@dataclass
class Int4LinearWeight:
    """One projection's int4 weight in the kernel's layout (see kernels/w4a16_gemm.py)."""

    qweight: torch.Tensor  # int32 [K / 8, N]
    scales: torch.Tensor  # [K / G, N]
    zeros: torch.Tensor  # int8 [K / G, N]
    perm: torch.Tensor | None  # int32 [K], act-order only
    group_size: int
    # The CPU path keeps the dequantized weight (per dtype) instead of unpacking it every call.
    _dense: dict[torch.dtype, torch.Tensor] = field(default_factory=dict, repr=False)

    @property
    def shape(self) -> tuple[int, int]:
        """[N, K], as nn.Linear.weight."""
        return self.qweight.shape[1], self.qweight.shape[0] * 8

    def dense(self, dtype: torch.dtype) -> torch.Tensor:
        """[N, K] in ``dtype``, input order permuted as the weight is (exact in fp32)."""
        if dtype not in self._dense:
            w = reference.dequantize_int4(self.qweight, self.scales, self.zeros, self.group_size)
            self._dense[dtype] = w.to(dtype).contiguous()
        return self._dense[dtype]


@dataclass
class Int4ExpertsWeight:
    """A MoE layer's experts of one projection (gate_up or down) in the int4 layout stacked over
    the experts (kernels/fused_moe_w4a16.py): each expert's slice is an ``Int4LinearWeight``."""

    qweight: torch.Tensor  # int32 [E, K / 8, N]
    scales: torch.Tensor  # [E, K / G, N]
    zeros: torch.Tensor  # int8 [E, K / G, N]
    perm: torch.Tensor | None  # int32 [E, K], act-order gate_up only
    group_size: int
    # The CPU path keeps the dequantized experts (per dtype) instead of unpacking them every call.
    _dense: dict[torch.dtype, torch.Tensor] = field(default_factory=dict, repr=False)

    @property
    def shape(self) -> tuple[int, int, int]:
        """[E, N, K], as the half-type experts' tensor."""
        return self.qweight.shape[0], self.qweight.shape[2], self.qweight.shape[1] * 8

    def expert(self, e: int) -> Int4LinearWeight:
        return Int4LinearWeight(
            self.qweight[e], self.scales[e], self.zeros[e], None if self.perm is None else self.perm[e], self.group_size
        )

    def dense(self, dtype: torch.dtype) -> torch.Tensor:
        """[E, N, K] in ``dtype`` in the original input order (the perm undone; exact in fp32)."""
        if dtype not in self._dense:
            e, n, k = self.shape
            w = torch.empty((e, n, k), dtype=torch.float32, device=self.qweight.device)
            for i in range(e):
                wi = reference.dequantize_int4(self.qweight[i], self.scales[i], self.zeros[i], self.group_size)
                if self.perm is None:
                    w[i] = wi
                else:
                    w[i][:, self.perm[i].long()] = wi
            self._dense[dtype] = w.to(dtype).contiguous()
        return self._dense[dtype]


class DenseLinear:
    """Half-type weights: nothing to convert."""

    def create_weights(self, weights: dict[str, object]) -> dict[str, object]:
        return weights


@dataclass(frozen=True)
class Int4Linear:
    """4-bit weights with per-group scales and zero points (``method`` is the checkpoint's format,
    kept for the reader: the artifact layout is the same for both)."""

    method: str  # "awq" or "gptq"
    group_size: int  # the checkpoint's group size; -1 = per channel (a group of K)

    def create_weights(self, weights: dict[str, object]) -> dict[str, object]:
        """Replace each ``P.qweight`` / ``P.scales`` / ``P.zeros`` [/ ``P.perm``] by ``P.weight``;
        MoE experts' stacked parts (``layers.i.experts.gate_up.qweight`` [E, K / 8, N] ...) by one
        ``Int4ExpertsWeight`` under ``P`` itself, where the half-type experts' tensor would be."""
        out = dict(weights)
        for name in [n for n in weights if n.endswith(".qweight")]:
            prefix = name[: -len(".qweight")]
            qweight, scales = out.pop(name), out.pop(prefix + ".scales")
            assert isinstance(qweight, torch.Tensor) and isinstance(scales, torch.Tensor)
            zeros, perm = out.pop(prefix + ".zeros"), out.pop(prefix + ".perm", None)
            if qweight.dim() == 3:
                out[prefix] = Int4ExpertsWeight(
                    qweight, scales, zeros, perm, group_size=qweight.shape[1] * 8 // scales.shape[1]  # type: ignore[arg-type]
                )
                continue
            out[prefix + ".weight"] = Int4LinearWeight(
                qweight,
                scales,
                zeros,
                perm,
                group_size=qweight.shape[0] * 8 // scales.shape[0],  # type: ignore[arg-type]
            )
        return out


FP8_PARTS = ("weight", "weight_scale", "input_scale")


@dataclass
class Fp8LinearWeight:
    """One projection's FP8 weight (builder/fp8.py's layout): e4m3 ``weight`` [N, K] and fp32
    ``weight_scale`` [N] (per channel) or [N, ceil(K / 128)] (128-column blocks); ``activations``
    says how the input is quantised ("token", "group" or "static" with ``input_scale``)."""

    weight: torch.Tensor  # float8_e4m3fn [N, K]
    weight_scale: torch.Tensor  # float32 [N] or [N, KB]
    input_scale: torch.Tensor | None  # float32 [1], static activations only
    activations: str
    # The CPU path keeps the fp8 values as fp32 (exact) instead of converting them every call.
    _float: torch.Tensor | None = field(default=None, repr=False)

    @property
    def shape(self) -> tuple[int, int]:
        return self.weight.shape[0], self.weight.shape[1]

    @property
    def block(self) -> bool:
        return self.weight_scale.dim() == 2

    def as_float(self) -> torch.Tensor:
        if self._float is None:
            self._float = self.weight.float()
        return self._float


@dataclass
class Fp8ExpertsWeight:
    """A MoE layer's stacked FP8 experts (builder/fp8.py's expert parts; kernels/fused_moe_fp8.py):
    e4m3 ``weight`` [E, N, K] and fp32 ``weight_scale`` [E, N] (per channel, activations per token)
    or [E, N, ceil(K / 128)] (128-column blocks, activations per 1x128 group)."""

    weight: torch.Tensor  # float8_e4m3fn [E, N, K]
    weight_scale: torch.Tensor  # float32 [E, N] or [E, N, KB]
    _float: torch.Tensor | None = field(default=None, repr=False)  # the CPU path's fp32 copy (exact)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.weight.shape)

    def as_float(self) -> torch.Tensor:
        if self._float is None:
            self._float = self.weight.float()
        return self._float


EXPERT_PARTS = ("experts.gate_up", "experts.down")


@dataclass(frozen=True)
class Fp8Linear:
    """FP8 weights: ``weights`` "channel" or "block", ``activations`` "token", "group" or "static"."""

    weights: str
    activations: str

    def create_weights(self, weights: dict[str, object]) -> dict[str, object]:
        """Replace each ``P.weight`` (fp8) / ``P.weight_scale`` [/ ``P.input_scale``] by one ``P.weight``."""
        out = dict(weights)
        for name in [n for n in weights if n.endswith(".weight_scale")]:
            prefix = name[: -len(".weight_scale")]
            w, scale = out.pop(prefix + ".weight"), out.pop(name)
            inp = out.pop(prefix + ".input_scale", None)
            assert isinstance(w, torch.Tensor) and isinstance(scale, torch.Tensor)
            assert inp is None or isinstance(inp, torch.Tensor)
            out[prefix + ".weight"] = Fp8LinearWeight(w, scale, inp, self.activations)
        for name in [n for n in weights if n.endswith(tuple(f"{p}_scale" for p in EXPERT_PARTS))]:
            prefix = name.removesuffix("_scale")  # MoE experts: P and P_scale -> one P
            w, scale = out.pop(prefix), out.pop(name)
            assert isinstance(w, torch.Tensor) and isinstance(scale, torch.Tensor)
            out[prefix] = Fp8ExpertsWeight(w, scale)
        return out
