"""Rotary-embedding tables: inverse frequencies for each supported rope variant, and the
cos/sin cache the rotary kernels index by position.

The math follows the published definitions (and transformers' implementation of them, which
is our reference): default, linear scaling and Llama 3 frequency smoothing.
"""

from __future__ import annotations

import math
from typing import Any

import torch

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def inv_frequencies(rope: dict[str, Any], rotary_dim: int) -> torch.Tensor:
    """Inverse frequencies [rotary_dim // 2] in fp32 for a rope parameter dict.

    rope holds ``rope_type``, ``rope_theta`` and the variant's own keys.
    """
    rope_type = rope.get("rope_type", "default")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope_type {rope_type!r} is not supported (supported: {SUPPORTED_ROPE_TYPES})")
    base = float(rope["rope_theta"])
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    inv_freq = 1.0 / (base**exponents)
    if rope_type == "linear":
        return inv_freq / float(rope["factor"])
    if rope_type == "llama3":
        factor = float(rope["factor"])
        low, high = float(rope["low_freq_factor"]), float(rope["high_freq_factor"])
        old_len = float(rope["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
        return torch.where(is_medium, smoothed, scaled)
    return inv_freq


def cos_sin_cache(rope: dict[str, Any], rotary_dim: int, max_positions: int) -> torch.Tensor:
    """[max_positions, rotary_dim] fp32: cos of each angle in the first half, sin in the second."""
    inv_freq = inv_frequencies(rope, rotary_dim)
    positions = torch.arange(max_positions, dtype=torch.float32)
    angles = positions[:, None] * inv_freq[None, :]
    return torch.cat((angles.cos(), angles.sin()), dim=-1)
