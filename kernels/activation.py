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
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + d + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    if ACT == 0:
        act = g / (1.0 + tl.exp(-g))
    else:
        # 0.5 g (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3))), tanh(z) = 1 - 2 / (exp(2z) + 1): exp
        # overflowing to inf gives tanh 1, exactly as it should, so no clamp is needed
        z = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        act = 0.5 * g * (2.0 - 2.0 / (tl.exp(2.0 * z) + 1.0))
    act = act.to(gate.dtype).to(tl.float32)
    tl.store(
        out_ptr + row * stride_o + cols, (act * up.to(tl.float32)).to(out_ptr.dtype.element_ty), mask=mask
    )


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
