"""Ticket counters for the split-K kernels that reduce in their own launch (kernels/w4a16_gemv.py's
split kernels, kernels/fp8_gemm.py's fused decode kernel).

Every program of a split column block stores its partial sums, then takes a ticket (an atomic add
on the block's counter); the program drawing the last ticket adds the partials and sets the counter
back to 0. The kernels of a device share one int32 buffer: launches on one stream run one after
another, so each finds every counter at zero; launches that could overlap, on concurrent streams
of one device, would need counters of their own (the engine runs one stream a device). The buffer
grows only outside CUDA-graph capture: a captured graph holds its address, so an outgrown buffer
stays allocated, not freed.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

COUNTERS: dict[torch.device, torch.Tensor] = {}
OUTGROWN: list[torch.Tensor] = []


def counters(device: torch.device, size: int, kernel: str) -> torch.Tensor:
    """The device's counters, at least ``size`` of them, zero between launches; ``kernel`` names
    the caller in the error raised when they would have to grow during CUDA-graph capture."""
    buffer = COUNTERS.get(device)
    if buffer is None or buffer.numel() < size:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"{kernel}: the split-K counters must be allocated before CUDA-graph capture; "
                "run it eagerly once first (the runtime's warm-up forward does)"
            )
        if buffer is not None:
            OUTGROWN.append(buffer)
        buffer = torch.zeros(max(size, 4096), dtype=torch.int32, device=device)
        COUNTERS[device] = buffer
    return buffer


def available(device: torch.device, size: int) -> bool:
    """Whether ``counters(device, size, ...)`` can serve now: the buffer holds ``size`` counters
    already, or may still grow (no CUDA-graph capture is running)."""
    buffer = COUNTERS.get(device)
    if buffer is not None and buffer.numel() >= size:
        return True
    return not (device.type == "cuda" and torch.cuda.is_current_stream_capturing())


def split_steps(num_steps: int, wanted: int) -> tuple[int, int]:
    """(splits, steps each) for ``num_steps`` K steps split ``wanted`` ways, fewer splits where
    the last would get no step: every split has at least one."""
    steps = -(-num_steps // max(1, min(wanted, num_steps)))
    return -(-num_steps // steps), steps


def partials(device: torch.device, split: int, rows: int, cols: int, blocks: int, kernel: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A split launch's workspace: fp32 partials [split, rows, cols], per launch from the caching
    allocator (no host sync; inside a capture, from the graph's pool; the kernel writes every
    element before it reads it), and the device's counters, ``blocks`` of them at least."""
    return torch.empty((split, rows, cols), dtype=torch.float32, device=device), counters(device, blocks, kernel)


@triton.jit
def last_to_arrive(counter, arrivals):
    """Called by each of ``arrivals`` programs sharing ``counter`` once its partial results are
    stored: whether this program is the last to get here. A CTA barrier first (every thread's stores
    ordered before the ticket), then one ticket, an atomic add acq_rel at GPU scope: the earlier
    programs' stores happen-before the last program's loads (which read from L2, ``.cg``)."""
    tl.debug_barrier()
    return tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == arrivals - 1


@triton.jit
def reset(counter):
    """The last program, done with the partials: the counter back to 0 for the next launch."""
    tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")
