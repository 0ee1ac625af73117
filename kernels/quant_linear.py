"""Linear methods: how a projection's weights are held and applied, chosen at build time.

The rendered model calls ``ops.linear(x, weight, bias, projection)`` for every projection
whatever the format; the artifact's model.py names its method once (``LINEAR = ...``) and
``LINEAR.create_weights`` turns the artifact's tensors into what ``ops.linear`` takes:

- ``DenseLinear``: the half-type ``[N, K]`` weight as it is (F.linear or the skinny GEMM);
- ``Int4Linear``: AWQ and GPTQ checkpoints, repacked by the builder (``builder/quant.py``)
  into one layout, held as an ``Int4LinearWeight`` and run by the W4A16 GEMM
  (``kernels/w4a16_gemm.py``) on the GPU, by the exact dequantized reference on the CPU.
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
        """Replace each ``P.qweight`` / ``P.scales`` / ``P.zeros`` [/ ``P.perm``] by ``P.weight``."""
        out = dict(weights)
        for name in [n for n in weights if n.endswith(".qweight")]:
            prefix = name[: -len(".qweight")]
            qweight, scales = out.pop(name), out.pop(prefix + ".scales")
            assert isinstance(qweight, torch.Tensor) and isinstance(scales, torch.Tensor)
            zeros, perm = out.pop(prefix + ".zeros"), out.pop(prefix + ".perm", None)
            out[prefix + ".weight"] = Int4LinearWeight(
                qweight,
                scales,
                zeros,
                perm,
                group_size=qweight.shape[0] * 8 // scales.shape[0],  # type: ignore[arg-type]
            )
        return out
