"""Programmatic dependent launch (PDL) for the kernels of a decode step: experimental, off unless
an artifact is built with it (``PAGECAST_PDL=1 enginebuild ...`` on an sm_90 or newer GPU).

A batch-1 decode step is a chain of a few hundred small kernels, each waiting for the one before
it to finish before its own programs are put on the multiprocessors. A kernel launched with PDL
(the programmatic-serialisation launch attribute; Triton's ``launch_pdl``) may be put there while
the kernel before it is still finishing. Such a kernel must wait (``griddepcontrol.wait``, Triton's
``gdc_wait``) before it reads anything the earlier kernel writes or writes anything it reads; the
wait returns once that kernel has completed and its writes are visible.

Every kernel that takes part does that wait as its first statement, before any memory access
(``if PDL: gdc_wait()``; tests/test_pdl.py compiles each for sm_90 and checks that no global
load, store or atomic comes before the wait). So the only overlap is the launch and the programs'
start with the end of the kernel before: correct whatever runs before or after (a kernel without
PDL, torch's, cuBLAS's, waits for full completion as always). Participating: RMSNorm (with and
without the residual add), the bf16 and FP8 skinny GEMMs, rotary + KV write, paged decode
attention and its merge, the gated activations, and a bf16 MoE layer's decode path (the
routing kernel, the expert GEMVs, the top-k sum).

Whether it pays was not measured when this was written (benchmarks/pdl_chain.py measures the
mechanism on a chain of GEMVs; W4 with an artifact built with and without it measures the step).
The choice is made at build, recorded in the tuning table (``"pdl": true``; the artifact's Triton
cache holds the PDL variants the tuner compiled) and restored by the runtime from the table
(``ops.configure(..., pdl=...)``), so serving compiles nothing either way.
"""

from __future__ import annotations

import os
from typing import Any

ENV = "PAGECAST_PDL"

_enabled = False  # the launchers' setting in this process (the build's: from ENV; serving: from the table)


def requested(strict: bool = True) -> bool:
    """Whether this build was asked for PDL (ENV=1); ``strict``: a value other than 1 or 0 is an
    error (else it reads as off)."""
    value = os.environ.get(ENV, "").strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if strict and value not in ("", "0", "false", "no", "off"):
        raise ValueError(f"{ENV} must be 1 or 0, got {value!r}")
    return False


def enabled() -> bool:
    return _enabled


def set_enabled(on: bool) -> None:
    """Launch the participating kernels with PDL from now on (or not)."""
    global _enabled
    _enabled = bool(on)


def check_device(device: Any = "cuda") -> None:
    """Refuse PDL on a GPU before sm_90, which has no griddepcontrol."""
    import torch

    major, minor = torch.cuda.get_device_capability(device)
    if major < 9:
        raise RuntimeError(
            f"{ENV}=1: programmatic dependent launch needs an sm_90 or newer GPU, this one is sm_{major}{minor}; "
            f"build without {ENV}"
        )


def launch_options() -> dict[str, Any]:
    """Keyword arguments a participating kernel's launch adds: the kernel's ``PDL`` constexpr and
    Triton's ``launch_pdl`` when PDL is on; nothing when it is off (the kernels default to PDL=False)."""
    return {"PDL": True, "launch_pdl": True} if _enabled else {}


_enabled = requested(strict=False)
