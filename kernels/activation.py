"""Gated activations on the fused gate_up projection: silu(gate) * up (Llama and most
families) and gelu_tanh(gate) * up (Gemma).

The grid is (rows, column blocks). The activation is computed in fp32 and rounded to the input
dtype before the multiply, as torch does for the reference's two separate ops. Both share one
kernel (ACT picks the activation) and one config space.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from pagecast.kernels import pdl
from pagecast.kernels.fp8_gemm import _quantise_rows, _scale_of
from pagecast.kernels.gated import ACT_CODES
from pagecast.kernels.gated import gated_product as _gated
from pagecast.kernels.tuning import KernelConfig


@triton.jit
def _silu_and_mul_kernel(
    x_ptr,  # x: [num_tokens, 2 * d] holding (gate, up)
    out_ptr,  # out: [num_tokens, d]
    stride_x,
    stride_o,
    d,
    BLOCK: tl.constexpr,
    ACT: tl.constexpr,  # 0: silu, 1: gelu with the tanh approximation
    PDL: tl.constexpr = False,  # launched with programmatic dependent launch (kernels/pdl.py)
):
    if PDL:
        gdc_wait()  # before any memory access: the kernel before may still be running
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    y = _gated(x_ptr + row * stride_x, cols, mask, d, ACT)
    tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _act_and_mul_fp8_kernel(
    x_ptr,  # x: [num_tokens, 2 * d] holding (gate, up)
    q_ptr,  # float8e4nv [num_tokens, d]
    s_ptr,  # fp32 scales: [num_tokens] (token), [num_tokens, cdiv(d, GROUP_K)] (group), the static [1] (read)
    stride_x,
    d,
    ACT: tl.constexpr,  # 0: silu, 1: gelu with the tanh approximation
    MODE: tl.constexpr,  # 0 token, 1 group of GROUP_K, 2 static (kernels/fp8_gemm.py's modes)
    GROUP_K: tl.constexpr,
    BLOCK: tl.constexpr,  # MODE 0: columns a pass step (the whole row where NUM_BLOCKS is 1); else GROUP_K
    NUM_BLOCKS: tl.constexpr,  # MODE 0: cdiv(d, BLOCK)
    MIN_AMAX: tl.constexpr,
    QMAX: tl.constexpr,
):
    # act(gate) * up rounded to x's dtype (what the unfused kernel stores), then quantised to e4m3
    # with fp8_gemm._quant_act_kernel's arithmetic (its _scale_of and _quantise_rows): the same bits
    # as the two launches, one read of x and no [num_tokens, d] intermediate in x's dtype.
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    q_row = q_ptr + row * d
    dtype = x_ptr.dtype.element_ty
    fp8 = q_ptr.dtype.element_ty
    if MODE == 0 and NUM_BLOCKS == 1:
        cols = tl.arange(0, BLOCK)
        ok = cols < d
        y = _gated(x_row, cols, ok, d, ACT).to(dtype).to(tl.float32)
        scale = _scale_of(tl.max(tl.abs(y), axis=0), MIN_AMAX, QMAX)
        tl.store(s_ptr + row, scale)
        tl.store(q_row + cols, _quantise_rows(y, scale, QMAX, fp8), mask=ok)
    elif MODE == 0:
        # two passes over the row: the amax, then the quantisation (the second reads x from L2)
        amax = tl.zeros((BLOCK,), dtype=tl.float32)
        for i in range(NUM_BLOCKS):
            cols = i * BLOCK + tl.arange(0, BLOCK)
            amax = tl.maximum(amax, tl.abs(_gated(x_row, cols, cols < d, d, ACT).to(dtype).to(tl.float32)))
        scale = _scale_of(tl.max(amax, axis=0), MIN_AMAX, QMAX)
        tl.store(s_ptr + row, scale)
        for i in range(NUM_BLOCKS):
            cols = i * BLOCK + tl.arange(0, BLOCK)
            ok = cols < d
            y = _gated(x_row, cols, ok, d, ACT).to(dtype).to(tl.float32)
            tl.store(q_row + cols, _quantise_rows(y, scale, QMAX, fp8), mask=ok)
    else:
        g = tl.program_id(1)
        cols = g * GROUP_K + tl.arange(0, GROUP_K)
        ok = cols < d
        y = _gated(x_row, cols, ok, d, ACT).to(dtype).to(tl.float32)
        if MODE == 1:
            scale = _scale_of(tl.max(tl.abs(y), axis=0), MIN_AMAX, QMAX)
            tl.store(s_ptr + row * tl.cdiv(d, GROUP_K) + g, scale)
        else:
            scale = tl.load(s_ptr).to(tl.float32)
        tl.store(q_row + cols, _quantise_rows(y, scale, QMAX, fp8), mask=ok)


CONFIG_SPACE: list[KernelConfig] = [
    KernelConfig({"BLOCK": b}, num_warps=w, num_stages=1)
    for (b, w) in ((1024, 4), (512, 2), (2048, 4), (2048, 8), (4096, 8), (1024, 8))
]


def prune_configs(configs: list[KernelConfig], d: int) -> list[KernelConfig]:
    """Drop column blocks far wider than a row, and warp counts with under 4 elements per thread."""
    limit = max(512, triton.next_power_of_2(d))
    return [c for c in configs if c["BLOCK"] <= limit and c["BLOCK"] >= c.num_warps * 32 * 4]


def default_config() -> KernelConfig:
    return CONFIG_SPACE[0]


def silu_and_mul(x: torch.Tensor, config: Mapping[str, int] | None = None) -> torch.Tensor:
    """x: [num_tokens, 2 * d] holding (gate, up) -> silu(gate) * up: [num_tokens, d]."""
    return _act_and_mul(x, config, 0)


def gelu_tanh_and_mul(x: torch.Tensor, config: Mapping[str, int] | None = None) -> torch.Tensor:
    """x: [num_tokens, 2 * d] holding (gate, up) -> gelu_tanh(gate) * up: [num_tokens, d]."""
    return _act_and_mul(x, config, 1)


def _act_and_mul(x: torch.Tensor, config: Mapping[str, int] | None, act: int) -> torch.Tensor:
    if x.dim() != 2 or x.shape[1] % 2 or x.stride(-1) != 1:
        raise ValueError(f"x must be [num_tokens, 2 * d] with a contiguous last dim, got {tuple(x.shape)}")
    num_tokens, d = x.shape[0], x.shape[1] // 2
    out = torch.empty((num_tokens, d), dtype=x.dtype, device=x.device)
    if num_tokens == 0:
        return out
    cfg = KernelConfig.coerce(config) or default_config()
    block = cfg["BLOCK"]
    _silu_and_mul_kernel[(num_tokens, triton.cdiv(d, block))](
        x, out, x.stride(0), out.stride(0), d, BLOCK=block, ACT=act, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **pdl.launch_options(),
    )
    return out


FP8_ROW_BLOCK_MAX = 16384  # token scales: a row up to this wide is read once, held in registers


def act_and_mul_fp8(
    x: torch.Tensor, activation: str, activations: str, input_scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [num_tokens, 2 * d] holding (gate, up) -> act(gate) * up quantised to e4m3 for an FP8
    projection: (e4m3 [num_tokens, d], fp32 scales [num_tokens] / [num_tokens, cdiv(d, 128)] / the
    static [1]), the bits of ``fp8_gemm.quantize_activations(silu_and_mul(x), ...)`` (or
    gelu_tanh_and_mul) in one launch. ``activation``: "silu" or "gelu_tanh"; ``activations``:
    "token", "group" or "static" (the weight's activation scheme)."""
    from pagecast.kernels import fp8_gemm, reference

    if x.dim() != 2 or x.shape[1] % 2 or x.stride(-1) != 1:
        raise ValueError(f"x must be [num_tokens, 2 * d] with a contiguous last dim, got {tuple(x.shape)}")
    act = ACT_CODES[activation]
    m, d = x.shape[0], x.shape[1] // 2
    q = torch.empty((m, d), dtype=torch.float8_e4m3fn, device=x.device)
    group = fp8_gemm.GROUP
    if activations == "token":
        s = torch.empty((m,), dtype=torch.float32, device=x.device)
        block = min(FP8_ROW_BLOCK_MAX, triton.next_power_of_2(d))
        grid: tuple[int, ...] = (m,)
        mode, warps = 0, max(4, min(16, block // 1024))
    elif activations in ("group", "static"):
        if activations == "group":
            s = torch.empty((m, triton.cdiv(d, group)), dtype=torch.float32, device=x.device)
        else:
            assert input_scale is not None
            s = input_scale.float().reshape(1)
        block = group
        grid, mode, warps = (m, triton.cdiv(d, group)), (1 if activations == "group" else 2), 1
    else:
        raise ValueError(f"unknown fp8 activation scheme {activations!r}")
    if m:
        _act_and_mul_fp8_kernel[grid](
            x, q, s, x.stride(0), d, ACT=act, MODE=mode, GROUP_K=group, BLOCK=block,
            NUM_BLOCKS=triton.cdiv(d, block), MIN_AMAX=reference.FP8_MIN_AMAX, QMAX=fp8_gemm.FP8_MAX, num_warps=warps,
        )  # fmt: skip
    return q, s
