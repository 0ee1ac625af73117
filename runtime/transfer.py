"""Small host lists to the device without waiting for it."""

from __future__ import annotations

import torch


def to_device(values: list, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A tensor of ``values`` (a list, nested for 2-D) on ``device``. On a GPU it goes through
    pinned memory with a non-blocking copy: a copy from pageable memory may wait for the work
    queued on the device, which would stall the host while a step runs (asynchronous scheduling
    prepares and samples the next step before the last one has finished)."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)
