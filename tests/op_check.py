"""Every call an engine's forward pass makes to kernels/ops.py, run twice on the same inputs: the
reference path (torch) on copies, then the Triton path on the inputs themselves, whose result the
pass carries on with. Each call's output, and any input either path writes (the KV cache), is
compared as ||got - want|| / ||want|| over the whole tensor.

Why a GPU engine test needs it: with FP8 activations an engine cannot be held to transformers'
emulation much closer than the format's own rounding. Hopper's FP8 tensor cores accumulate in
reduced precision (an H100 put the fp32 FP8 GEMMs of a tiny Qwen3-MoE 1.3e-4 from the reference), an
activation that close to an e4m3 boundary rounds the other way, and each such flip, up to 1/8 of
the value, flips more at the next quantisation: that engine ended a third of the way from the
emulation to the unquantised model (tests/test_fused_moe_fp8_gpu.py). Op by op, on the same
inputs, nothing compounds, and a wrong kernel stands out by orders of magnitude.

Used by tests/test_fused_moe_fp8_gpu.py and benchmarks/ops_check.py."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from typing_extensions import Self

# Every call within this of the reference on the same inputs, in fp32 engines. Measured: 1.3e-4 at
# most on an H100 (the FP8 GEMMs: Hopper's FP8 tensor cores accumulate in reduced precision), 3.4e-7
# elsewhere and in the CPU interpreter. Above those because the two paths' norms come out ulps apart
# and an activation x_j that close to an e4m3 boundary rounds to the neighbouring value, a step of up
# to |x_j| / 8: at one row that moves the output by up to |x_j| / (8 ||x||), about 2e-2 for the
# largest of 256 Gaussian activations. A wrong scale, tile, mask or expert moves an output by the
# size of what it gets wrong.
OP_TOLERANCE = 5e-2

OPS = ("norm_linear", "linear", "row_parallel_linear", "rotary_and_write_kv", "paged_attention", "fused_add_rms_norm",
       "rms_norm", "add_norm_moe", "moe", "lm_head", "embedding")  # fmt: skip


def _clone(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, (list, tuple)):
        return type(value)(_clone(v) for v in value)
    if isinstance(value, dict):
        return {k: _clone(v) for k, v in value.items()}
    return value


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    return []


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    if got.shape != want.shape:
        return float("inf")
    g, w = got.float(), want.float()
    return float((g - w).norm() / w.norm().clamp_min(1e-30))


class OpChecker:
    """While open (``with OpChecker(ops) as checker:``), each of OPS in the module ``ops`` runs both
    paths; ``rows`` holds (op, rows, output error, written-input error) per call. An op called from
    inside another is checked as part of it."""

    def __init__(self, ops: Any) -> None:
        self.ops = ops
        self.triton_on = True
        self.depth = 0
        self.rows: list[tuple[str, int, float, float]] = []
        self.originals = {name: getattr(ops, name) for name in OPS if hasattr(ops, name)}
        self.plain_triton = ops._triton
        ops._triton = lambda x: self.triton_on and self.plain_triton(x)
        for name, fn in self.originals.items():
            setattr(ops, name, self._wrap(name, fn))

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for name, fn in self.originals.items():
            setattr(self.ops, name, fn)
        self.ops._triton = self.plain_triton

    def _wrap(self, name: str, fn: Any) -> Any:
        def checked(*args: Any, **kwargs: Any) -> Any:
            if self.depth:
                return fn(*args, **kwargs)
            self.depth += 1
            try:
                ref_args, ref_kwargs = _clone(args), _clone(kwargs)
                self.triton_on = False
                want = fn(*ref_args, **ref_kwargs)
                self.triton_on = True
                got = fn(*args, **kwargs)
            finally:
                self.triton_on = True
                self.depth -= 1
            out = max((relative_error(g, w) for g, w in zip(_tensors(got), _tensors(want), strict=False)), default=0.0)
            written = max(
                (relative_error(g, w) for g, w in zip(_tensors((args, kwargs)), _tensors((ref_args, ref_kwargs)), strict=False)),
                default=0.0,
            )  # fmt: skip
            rows = args[0].shape[0] if args and isinstance(args[0], torch.Tensor) else 0
            self.rows.append((name, rows, out, written))
            return got

        return checked

    def worst(self) -> tuple[str, int, float]:
        """(op, call index, error) of the call furthest from its reference."""
        errors = [(name, i, max(out, written)) for i, (name, _, out, written) in enumerate(self.rows)]
        return max(errors, key=lambda e: e[2], default=("", -1, 0.0))

    def report(self, threshold: float) -> str:
        lines, first = [], None
        for i, (name, rows, out, written) in enumerate(self.rows):
            flag = "  <-- past the threshold" if max(out, written) > threshold else ""
            if flag and first is None:
                first = i
            lines.append(f"  {i:4d} {name:20s} rows={rows:5d} output {out:.3e}  written inputs {written:.3e}{flag}")
        if first is None:
            lines.append(f"  every call within {threshold:g}")
        else:
            lines.append(f"  FIRST PAST {threshold:g}: call {first}, {self.rows[first][0]}")
        return "\n".join(lines)
