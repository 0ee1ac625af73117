"""The gated MLP's activation, act(gate) * up, as one Triton helper: the activation kernels
(kernels/activation.py) and the FP8 decode kernel that applies it to its input on the way in
(kernels/fp8_gemm.py, ACT) compute it the same way, so their results agree to the bit."""

from __future__ import annotations

import triton
import triton.language as tl

ACT_CODES = {"silu": 0, "gelu_tanh": 1}  # the activations gated_product computes: its ACT constexpr


@triton.jit
def gated_load(x_row, cols, mask, d):
    # the (gate, up) halves of one row of x at the columns ``cols``, as loaded: gated_apply's inputs
    # (a caller may issue the next columns' loads before it applies the activation to these)
    gate = tl.load(x_row + cols, mask=mask, other=0.0)
    up = tl.load(x_row + d + cols, mask=mask, other=0.0)
    return gate, up


@triton.jit
def gated_apply(gate, up, ACT: tl.constexpr):
    # act(gate) * up in fp32: the activation in fp32, rounded to x's dtype before the multiply, as
    # torch's two ops round it
    g = gate.to(tl.float32)
    if ACT == 0:
        act = g / (1.0 + tl.exp(-g))
    else:
        # 0.5 g (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3))), tanh(z) = 1 - 2 / (exp(2z) + 1): exp
        # overflowing to inf gives tanh 1, exactly as it should, so no clamp is needed
        z = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        act = 0.5 * g * (2.0 - 2.0 / (tl.exp(2.0 * z) + 1.0))
    act = act.to(gate.dtype).to(tl.float32)
    return act * up.to(tl.float32)


@triton.jit
def gated_product(x_row, cols, mask, d, ACT: tl.constexpr):
    # act(gate) * up in fp32 for the columns ``cols`` of one row of x (gate, up)
    gate, up = gated_load(x_row, cols, mask, d)
    return gated_apply(gate, up, ACT)
