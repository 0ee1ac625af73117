"""Keyed exponential noise for seeded sampling: one launch for every seeded row of a step.

A seeded request must get the same tokens whatever else is in the batch and however often it
is run. Drawing each row's noise from its own ``torch.Generator`` costs a kernel launch per
row per step; here the noise is a pure function of (row key, row offset, column), computed by
a counter-based generator (Philox4x32-10) in one launch: the key is the request's seed, the
offset is the index of the output token being sampled. ``reference.keyed_exponential`` defines
the stream (which Philox word lands in which column) and is what the CPU runs.

One program per (row, block of 4 * PHILOX_GROUP columns): PHILOX_GROUP Philox calls, each
making four words, stored as four contiguous slices of the block.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagecast.kernels.reference import PHILOX_GROUP, PHILOX_M0, PHILOX_M1, PHILOX_W0, PHILOX_W1

# A compiled kernel may read module globals only when they are constexprs.
_M0, _M1 = tl.constexpr(PHILOX_M0), tl.constexpr(PHILOX_M1)
_W0, _W1 = tl.constexpr(PHILOX_W0), tl.constexpr(PHILOX_W1)


@triton.jit
def philox4x32_10(c0, c1, k0, k1, GROUP: tl.constexpr):
    """Philox4x32-10 of the counters (c0, c1, 0, 0) ([GROUP] uint32 each) under the key (k0, k1):
    four [GROUP] uint32 words, ``reference.keyed_exponential``'s stream. Shared by this module's
    kernel and the sampler's race, which draws the same noise in place."""
    c2 = tl.zeros([GROUP], dtype=tl.uint32)
    c3 = tl.zeros([GROUP], dtype=tl.uint32)
    m0 = tl.full([GROUP], _M0, tl.uint32)
    m1 = tl.full([GROUP], _M1, tl.uint32)
    for r in tl.static_range(10):
        if r > 0:
            k0 = k0 + _W0
            k1 = k1 + _W1
        hi0 = tl.umulhi(m0, c0)
        lo0 = m0 * c0
        hi1 = tl.umulhi(m1, c2)
        lo1 = m1 * c2
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return c0, c1, c2, c3


# Triton (3.6) folds the constexpr globals a helper reads (_M0.._W1 above) into a caller's cache
# key only when the helper's own key was computed before the caller's; so the keys of this
# module's kernel and of the sampler's race kernel followed the order in which a process first
# launched them. The build's tuner launched the noise kernel first and a server the race kernel
# first, so every H200 server compiled _race_kernel at start (tests/test_kernel_cache.py checks the
# keys against that order). Computing the helper's key here, before any caller can exist, gives
# every process the same keys.
if hasattr(philox4x32_10, "cache_key"):  # a JITFunction (Triton's interpreter wraps it otherwise)
    philox4x32_10.cache_key  # noqa: B018


@triton.jit
def _keyed_exponential_kernel(
    out_ptr,  # out: [rows, vocab] fp32
    keys_ptr,  # keys: [rows, 2] int64, the key's low and high 32 bits
    offsets_ptr,  # offsets: [rows] int64 in [0, 2**32)
    stride_out,
    vocab,
    GROUP: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1)
    j = tl.arange(0, GROUP)
    k0 = tl.load(keys_ptr + row * 2).to(tl.uint32)
    k1 = tl.load(keys_ptr + row * 2 + 1).to(tl.uint32)
    c0 = (block * GROUP + j).to(tl.uint32)
    c1 = tl.zeros([GROUP], dtype=tl.uint32) + tl.load(offsets_ptr + row).to(tl.uint32)
    c0, c1, c2, c3 = philox4x32_10(c0, c1, k0, k1, GROUP)
    base = out_ptr + row * stride_out + block * 4 * GROUP + j
    limit = vocab - block * 4 * GROUP
    _store_exponential(base, c0, j < limit)
    _store_exponential(base + GROUP, c1, j + GROUP < limit)
    _store_exponential(base + 2 * GROUP, c2, j + 2 * GROUP < limit)
    _store_exponential(base + 3 * GROUP, c3, j + 3 * GROUP < limit)


@triton.jit
def _store_exponential(ptrs, word, mask):
    # u = (2 * top23 + 1) / 2**24: in (0, 1) and exact in fp32, so -log(u) is finite and > 0.
    u = ((word >> 9) * 2 + 1).to(tl.float32) * 5.9604644775390625e-08
    tl.store(ptrs, -tl.log(u), mask=mask)


def keyed_exponential(keys: torch.Tensor, offsets: torch.Tensor, vocab: int) -> torch.Tensor:
    """Exp(1) noise ``[rows, vocab]`` fp32 on the keys' device; see ``reference.keyed_exponential``."""
    if keys.dim() != 1 or offsets.shape != keys.shape:
        raise ValueError(f"keys and offsets must be [rows]; got {tuple(keys.shape)} and {tuple(offsets.shape)}")
    rows = keys.shape[0]
    out = torch.empty(rows, vocab, dtype=torch.float32, device=keys.device)
    if rows == 0 or vocab == 0:
        return out
    keys = keys.long()
    halves = torch.stack([keys & 0xFFFFFFFF, (keys >> 32) & 0xFFFFFFFF], dim=1).contiguous()
    grid = (rows, triton.cdiv(vocab, 4 * PHILOX_GROUP))
    _keyed_exponential_kernel[grid](out, halves, offsets.long().contiguous(), out.stride(0), vocab, GROUP=PHILOX_GROUP)
    return out
