"""RMSNorm, and RMSNorm fused with the residual add that precedes it in every decoder layer.

One program per row. The sum of squares is accumulated in fp32; the normalised row is
rounded to the input dtype before the weight multiply, as the reference (and transformers)
do, so results match the reference bit for bit up to the order of the fp32 sum.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from pagecast.kernels import pdl
from pagecast.kernels.tuning import KernelConfig


@triton.jit
def _rms_norm_kernel(
    x_ptr,  # x: [num_tokens, hidden]
    residual_ptr,  # residual: [num_tokens, hidden] (read only when ADD_RESIDUAL)
    weight_ptr,  # weight: [hidden]
    out_ptr,  # out: [num_tokens, hidden]
    residual_out_ptr,  # residual_out: [num_tokens, hidden] = x + residual (when ADD_RESIDUAL)
    stride_x,
    stride_r,
    stride_o,
    stride_ro,
    hidden,
    eps,
    BLOCK: tl.constexpr,
    ADD_RESIDUAL: tl.constexpr,
    PDL: tl.constexpr = False,  # launched with programmatic dependent launch (kernels/pdl.py)
):
    if PDL:
        gdc_wait()  # before any memory access: the kernel before may still be running
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if ADD_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(residual_out_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + row * stride_ro + cols, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(xf * xf, 0) / hidden + eps)
    normed = (xf * rstd).to(x.dtype).to(tl.float32)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (w * normed).to(out_ptr.dtype.element_ty), mask=mask)


CONFIG_SPACE: list[KernelConfig] = [KernelConfig({}, num_warps=w, num_stages=1) for w in (4, 1, 2, 8, 16)]


def prune_configs(configs: list[KernelConfig], hidden: int) -> list[KernelConfig]:
    """Keep warp counts that leave every thread at least one 16-byte vector of the row."""
    block = triton.next_power_of_2(hidden)
    return [c for c in configs if c.num_warps * 32 * 8 <= max(block, 256)]


def default_config(hidden: int) -> KernelConfig:
    warps = 8 if hidden >= 4096 else 4
    return KernelConfig({}, num_warps=warps, num_stages=1)


def _check(x: torch.Tensor, weight: torch.Tensor) -> None:
    if x.dim() != 2 or weight.shape != (x.shape[1],):
        raise ValueError(
            f"x must be [num_tokens, hidden] and weight [hidden], got {tuple(x.shape)}, {tuple(weight.shape)}"
        )
    if x.stride(-1) != 1 or weight.stride(-1) != 1:
        raise ValueError("x and weight need a contiguous last dimension")


def _launch(x, residual, weight, out, residual_out, eps, config, add_residual) -> None:  # type: ignore[no-untyped-def]
    hidden = x.shape[1]
    cfg = KernelConfig.coerce(config) or default_config(hidden)
    _rms_norm_kernel[(x.shape[0],)](
        x, residual, weight, out, residual_out,
        x.stride(0), residual.stride(0), out.stride(0), residual_out.stride(0),
        hidden, eps,
        BLOCK=triton.next_power_of_2(hidden), ADD_RESIDUAL=add_residual,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl.launch_options(),
    )  # fmt: skip


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, config: Mapping[str, int] | None = None
) -> torch.Tensor:
    """x: [num_tokens, hidden] -> RMSNorm(x) * weight, in the dtype torch would give weight * x."""
    _check(x, weight)
    out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    if x.shape[0]:
        _launch(x, x, weight, out, out, eps, config, add_residual=False)
    return out


def fused_add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    config: Mapping[str, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """residual' = x + residual; returns (rms_norm(residual'), residual') as new tensors."""
    _check(x, weight)
    if residual.shape != x.shape or residual.stride(-1) != 1:
        raise ValueError(
            f"residual {tuple(residual.shape)} must match x {tuple(x.shape)} with a contiguous last dim"
        )
    sum_dtype = torch.promote_types(x.dtype, residual.dtype)
    residual_out = torch.empty(x.shape, dtype=sum_dtype, device=x.device)
    out = torch.empty(x.shape, dtype=torch.promote_types(sum_dtype, weight.dtype), device=x.device)
    if x.shape[0]:
        _launch(x, residual, weight, out, residual_out, eps, config, add_residual=True)
    return out, residual_out
