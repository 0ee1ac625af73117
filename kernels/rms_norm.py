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
from pagecast.kernels.fp8_gemm import _quantise_rows, _scale_of
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
    y = _normalise(x_ptr, residual_ptr, weight_ptr, residual_out_ptr, row, cols, mask, stride_x, stride_r, stride_ro,
                   hidden, eps, ADD_RESIDUAL)  # fmt: skip
    tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _normalise(
    x_ptr, residual_ptr, weight_ptr, residual_out_ptr, row, cols, mask, stride_x, stride_r, stride_ro, hidden, eps,
    ADD_RESIDUAL: tl.constexpr,
):  # fmt: skip
    # One row: x (+ residual, stored), normalised in fp32, rounded to its dtype, times the weight in
    # fp32 (the caller rounds the product to its output's dtype).
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if ADD_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(residual_out_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + row * stride_ro + cols, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(xf * xf, 0) / hidden + eps)
    normed = (xf * rstd).to(x.dtype).to(tl.float32)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    return w * normed


@triton.jit
def _rms_norm_fp8_kernel(
    x_ptr,  # x: [num_tokens, hidden]
    residual_ptr,  # residual: [num_tokens, hidden] (read only when ADD_RESIDUAL)
    weight_ptr,  # weight: [hidden]
    q_ptr,  # float8e4nv [num_tokens, hidden]: the normalised rows quantised
    s_ptr,  # fp32 scales: [num_tokens] (token), [num_tokens, cdiv(hidden, GROUP_K)] (group), the static [1] (read)
    residual_out_ptr,  # residual_out: [num_tokens, hidden] = x + residual (when ADD_RESIDUAL)
    stride_x,
    stride_r,
    stride_ro,
    hidden,
    eps,
    BLOCK: tl.constexpr,  # next_power_of_2(hidden), at least GROUP_K
    ADD_RESIDUAL: tl.constexpr,
    OUT_DTYPE: tl.constexpr,  # the dtype rms_norm would return (the rows are rounded to it first)
    MODE: tl.constexpr,  # 0 token, 1 group of GROUP_K, 2 static (kernels/fp8_gemm.py's modes)
    GROUP_K: tl.constexpr,
    MIN_AMAX: tl.constexpr,
    QMAX: tl.constexpr,
):
    # The norm as _rms_norm_kernel computes it, rounded to its output dtype, then quantised to e4m3
    # with fp8_gemm._quant_act_kernel's arithmetic (its _scale_of and _quantise_rows): the bits of
    # the two launches, the row read once.
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    y = _normalise(x_ptr, residual_ptr, weight_ptr, residual_out_ptr, row, cols, mask, stride_x, stride_r, stride_ro,
                   hidden, eps, ADD_RESIDUAL)  # fmt: skip
    y = y.to(OUT_DTYPE).to(tl.float32)
    fp8 = q_ptr.dtype.element_ty
    if MODE == 0:
        scale = _scale_of(tl.max(tl.abs(y), axis=0), MIN_AMAX, QMAX)
        tl.store(s_ptr + row, scale)
        q = _quantise_rows(y, scale, QMAX, fp8)
    elif MODE == 1:
        # a scale per GROUP_K columns: the row as [groups, GROUP_K] (padding columns are 0)
        groups: tl.constexpr = BLOCK // GROUP_K
        y_groups = tl.reshape(y, (groups, GROUP_K))
        scales = _scale_of(tl.max(tl.abs(y_groups), axis=1), MIN_AMAX, QMAX)  # [groups]
        offs_g = tl.arange(0, groups)
        tl.store(s_ptr + row * tl.cdiv(hidden, GROUP_K) + offs_g, scales, mask=offs_g * GROUP_K < hidden)
        q = tl.reshape(_quantise_rows(y_groups, scales[:, None], QMAX, fp8), (BLOCK,))
    else:
        q = _quantise_rows(y, tl.load(s_ptr).to(tl.float32), QMAX, fp8)
    tl.store(q_ptr + row * hidden + cols, q, mask=mask)


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


def rms_norm_fp8(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    activations: str,
    input_scale: torch.Tensor | None = None,
    config: Mapping[str, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The norm an FP8 projection's input comes from, quantised for it in the same launch: returns
    (e4m3 rows, fp32 scales as fp8_gemm.quantize_activations gives them for ``activations``
    ("token", "group" or "static"), the residual stream: x + residual, or x where ``residual`` is
    None), with the bits of ``quantize_activations(rms_norm(...))`` (or of fused_add_rms_norm's)."""
    from pagecast.kernels import fp8_gemm, reference

    _check(x, weight)
    m, hidden = x.shape
    add = residual is not None
    if add:
        assert residual is not None
        if residual.shape != x.shape or residual.stride(-1) != 1:
            raise ValueError(f"residual {tuple(residual.shape)} must match x {tuple(x.shape)} with a contiguous last dim")
        residual_out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, residual.dtype), device=x.device)
        out_dtype = torch.promote_types(residual_out.dtype, weight.dtype)
    else:
        residual_out = x
        out_dtype = torch.promote_types(x.dtype, weight.dtype)
    group = fp8_gemm.GROUP
    q = torch.empty((m, hidden), dtype=torch.float8_e4m3fn, device=x.device)
    mode = {"token": 0, "group": 1, "static": 2}[activations]
    if mode == 0:
        s = torch.empty((m,), dtype=torch.float32, device=x.device)
    elif mode == 1:
        s = torch.empty((m, triton.cdiv(hidden, group)), dtype=torch.float32, device=x.device)
    else:
        assert input_scale is not None
        s = input_scale.float().reshape(1)
    if m:
        cfg = KernelConfig.coerce(config) or default_config(hidden)
        r = residual if residual is not None else x
        _rms_norm_fp8_kernel[(m,)](
            x, r, weight, q, s, residual_out, x.stride(0), r.stride(0), residual_out.stride(0), hidden, eps,
            BLOCK=max(triton.next_power_of_2(hidden), group), ADD_RESIDUAL=add, OUT_DTYPE=_TL_DTYPES[out_dtype],
            MODE=mode, GROUP_K=group, MIN_AMAX=reference.FP8_MIN_AMAX, QMAX=fp8_gemm.FP8_MAX,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )  # fmt: skip
    return q, s, residual_out


_TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}
