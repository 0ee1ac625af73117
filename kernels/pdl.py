"""Programmatic dependent launch (PDL, sm_90 and later) between a decode step's kernels.

A kernel launched with PDL may start before the kernel ahead of it in the stream has finished,
as soon as every program of that kernel has run ``griddepcontrol.launch_dependents`` (``trigger``)
or exited; it must then run ``griddepcontrol.wait`` (``triton.language.extra.cuda.gdc_wait``),
which returns once that kernel has completed and its writes are visible, before it reads or
writes anything the step produces. What it may do before the wait is read memory nothing in the
step writes: the weights.

The W4A16 tensor-core decode kernel (kernels/w4a16_tcgemv.py) is launched so and loads its first
weights before it waits; the kernels that run right before a projection in a decoder layer
(RMSNorm, SiLU-and-mul, the decode attention and its merge) trigger their dependents when they
start. A trigger without a PDL launch after it does nothing, and the wait holds every write of
the step in stream order, so the results are those of plain launches. CUDA graphs capture the
dependency (programmatic edges).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents

ENABLED = True  # off: every kernel launched and run as before (benchmarks' A/B)


@functools.cache
def _capable(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device)[0] >= 9


def on(x: torch.Tensor) -> bool:
    """Whether kernels working on ``x`` use PDL: enabled, on a CUDA device of sm_90 or later,
    not in the Triton interpreter (which has no inline PTX)."""
    return (
        ENABLED
        and x.is_cuda
        and os.environ.get("TRITON_INTERPRET", "0") in ("", "0")
        and _capable(x.device)
    )


@triton.jit
def trigger(ON: tl.constexpr):
    """Lets the next kernel, if launched with PDL, start now (a constexpr ``ON``: ``on(x)``)."""
    if ON:
        gdc_launch_dependents()
