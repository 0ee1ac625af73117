"""L2 prefetch of the o projection's weights while a small decode step's attention runs:
experimental, off unless an artifact is built with it (``PAGECAST_L2_PREFETCH=1 enginebuild ...``
on an sm_90 or newer GPU).

At one to a few rows, a decode step reads weights from memory only in its projections; between
the qkv projection and the o projection (rotary and KV write, the attention and its merge: 6-8 us
a layer on an H200) the memory system idles, and the o projection then streams 16-32 MiB at
42-68% of copy bandwidth (benchmarks/RESULTS.md). Here, right after the qkv projection, a side
stream forked from the step's stream (a branch of the CUDA graph when captured) launches
``_l2_prefetch_kernel`` over the o weight's tensors: each lane of a one-warp program issues one
``cp.async.bulk.prefetch.L2`` of SUB_BYTES, a hint the copy engine serves while the attention runs;
nothing waits for the data and no result changes. The branch joins the step's stream before the
attention, inside the same layer method, so each piece of a piecewise-captured step stays whole.

Whether it pays is measured by benchmarks/l2_prefetch.py (the mechanism) and by W4 with an artifact
built with and without it. The choice is made at build, recorded in the tuning table
(``"l2_prefetch": true``; the build compiles the kernel into the artifact's Triton cache) and
restored by the runtime (``ops.configure(..., l2_prefetch=...)``), so serving compiles nothing.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from pagecast.kernels import build_env

ENV = "PAGECAST_L2_PREFETCH"
MAX_ROWS = 16  # steps of more rows read each weight for many rows: no prefetch
SUB_BYTES = 16 << 10  # bytes one lane asks for (a multiple of 16, as cp.async.bulk requires)
LANES = 32  # lanes a program (one warp)

_side: dict[torch.device, torch.cuda.Stream] = {}
_forked: set[torch.device] = set()


# requested(), enabled(), set_enabled(on) and check_device() as kernels/build_env.py's Option has them
OPTION = build_env.Option(ENV, "the bulk L2 prefetch")
requested, enabled, set_enabled, check_device = (
    OPTION.requested,
    OPTION.enabled,
    OPTION.set_enabled,
    OPTION.check_device,
)


def tensors_of(weight: Any) -> list[torch.Tensor]:
    """The tensors a projection's weight holds (a tensor, or a quant_linear weight's fields)."""
    if isinstance(weight, torch.Tensor):
        return [weight]
    if dataclasses.is_dataclass(weight) and not isinstance(weight, type):
        return [t for f in dataclasses.fields(weight) for t in tensors_of(getattr(weight, f.name))]
    if isinstance(weight, (tuple, list)):
        return [t for w in weight for t in tensors_of(w)]
    return []


def _prefetchable(t: torch.Tensor) -> bool:
    return t.is_cuda and t.is_contiguous() and t.data_ptr() % 16 == 0 and t.numel() * t.element_size() >= 16


def fork(num_rows: int, *weights: Any) -> None:
    """Prefetch ``weights``' tensors into L2 from the device's side stream, after the work queued
    so far on the current stream; a no-op when off, past MAX_ROWS rows, or on the CPU."""
    if not OPTION.on or num_rows > MAX_ROWS:
        return
    tensors = [t for w in weights for t in tensors_of(w) if _prefetchable(t)]
    if not tensors:
        return
    device = tensors[0].device
    side = _side.get(device)
    if side is None:
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "l2_prefetch: the side stream must be made before CUDA-graph capture; "
                "run a step of at most MAX_ROWS rows eagerly first (the runtime's warm-up forward does)"
            )
        side = _side[device] = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for t in tensors:
            launch(t)
    _forked.add(device)


def join() -> None:
    """The current stream waits for the prefetch launches forked since the last join. Those only
    issue the hints, and the data should keep arriving after they end (the PTX ISA gives the bulk
    prefetch no completion to wait for); benchmarks/l2_prefetch.py's ``bulk_early`` checks that."""
    for device in list(_forked):
        torch.cuda.current_stream(device).wait_stream(_side[device])
        _forked.discard(device)


def launch(t: torch.Tensor) -> None:
    """The prefetch of ``t``'s bytes (contiguous, 16-byte aligned) on the current stream."""
    import triton

    flat = t.view(-1).view(torch.uint8)
    nbytes = flat.numel() - flat.numel() % 16
    _kernel()[(triton.cdiv(nbytes, LANES * SUB_BYTES),)](
        flat, nbytes, SUB=SUB_BYTES, LANES=LANES, num_warps=1
    )


def warm(device: torch.device) -> None:
    """Launch the kernel once (the build: its compiled code goes into TRITON_CACHE_DIR)."""
    launch(torch.zeros(4096, dtype=torch.uint8, device=device))
    torch.cuda.synchronize(device)


_KERNEL: Any = None


def _kernel() -> Any:
    """The Triton kernel, defined on first use (the CPU runtime never imports Triton)."""
    global _KERNEL
    if _KERNEL is None:
        import triton
        import triton.language as tl

        @triton.jit
        def _l2_prefetch_kernel(base_ptr, nbytes, SUB: tl.constexpr, LANES: tl.constexpr):
            # Program p: bytes [p * LANES * SUB, (p + 1) * LANES * SUB) of base_ptr, SUB a lane;
            # a lane past nbytes issues nothing (the predicate).
            start = tl.program_id(0).to(tl.int64) * (LANES * SUB) + tl.arange(0, LANES).to(tl.int64) * SUB
            size = tl.minimum(tl.maximum(nbytes - start, 0), SUB).to(tl.int32)
            tl.inline_asm_elementwise(
                """
                {
                .reg .pred p;
                setp.ne.u32 p, $2, 0;
                @p cp.async.bulk.prefetch.L2.global [$1], $2;
                mov.u32 $0, 0;
                }
                """,
                "=r,l,r",
                [base_ptr + start, size],
                dtype=tl.int32,
                is_pure=False,
                pack=1,
            )

        _KERNEL = _l2_prefetch_kernel
    return _KERNEL
