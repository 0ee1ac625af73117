"""Rotary-embedding tables: inverse frequencies for each supported rope variant, and the
cos/sin cache the rotary kernels index by position.

The math follows the published definitions (and transformers' implementation of them, which
is our reference): default, linear scaling, Llama 3 frequency smoothing, YaRN (NTK-by-parts
interpolation with an attention factor) and LongRoPE (per-frequency short and long factors,
the long ones used once a sequence is longer than the original context).
"""

from __future__ import annotations

import math
from typing import Any

import torch

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")


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
    if rope_type == "yarn":
        return _yarn_inv_frequencies(rope, rotary_dim, base)
    if rope_type == "longrope":
        return _longrope_inv_frequencies(rope, rotary_dim, base, long=False)
    return inv_freq


def _base_frequencies(rotary_dim: int, base: float) -> torch.Tensor:
    # base ** (2i / d) in fp32, as transformers computes it for the variants below
    return base ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim)


def _yarn_inv_frequencies(rope: dict[str, Any], rotary_dim: int, base: float) -> torch.Tensor:
    """YaRN: the low frequencies interpolated by ``factor``, the high ones kept, a linear ramp
    between the dimensions that turn beta_fast and beta_slow times over the original context."""
    factor = float(rope["factor"])
    old_len = float(rope["original_max_position_embeddings"])
    beta_fast = float(rope.get("beta_fast") or 32)
    beta_slow = float(rope.get("beta_slow") or 1)

    def dim_of(rotations: float) -> float:
        return (rotary_dim * math.log(old_len / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = dim_of(beta_fast), dim_of(beta_slow)
    if rope.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001  # a zero-width ramp would divide by zero
    ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (keep the frequency), 0: interpolate (divide by factor)
    freqs = _base_frequencies(rotary_dim, base)
    return (1.0 / (factor * freqs)) * (1 - keep) + (1.0 / freqs) * keep


def _longrope_inv_frequencies(rope: dict[str, Any], rotary_dim: int, base: float, long: bool) -> torch.Tensor:
    factors = torch.tensor(rope["long_factor" if long else "short_factor"], dtype=torch.float32)
    if factors.shape != (rotary_dim // 2,):
        raise ValueError(f"longrope factors have {factors.numel()} entries, expected {rotary_dim // 2}")
    return 1.0 / (factors * _base_frequencies(rotary_dim, base))


def attention_factor(rope: dict[str, Any]) -> float:
    """The factor YaRN and LongRoPE multiply cos and sin by (1.0 for the other variants)."""
    rope_type = rope.get("rope_type", "default")
    if rope_type not in ("yarn", "longrope"):
        return 1.0
    if rope.get("attention_factor") is not None:
        return float(rope["attention_factor"])
    old_len = float(rope["original_max_position_embeddings"])
    factor = rope.get("factor")
    if factor is None:  # Phi-3 states the ratio of its context lengths instead
        factor = float(rope["max_position_embeddings"]) / old_len
    factor = float(factor)
    if factor <= 1.0:
        return 1.0
    if rope_type == "longrope":
        return math.sqrt(1 + math.log(factor) / math.log(old_len))

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if rope.get("mscale") and rope.get("mscale_all_dim"):
        return mscale(factor, float(rope["mscale"])) / mscale(factor, float(rope["mscale_all_dim"]))
    return mscale(factor)


def _table(inv_freq: torch.Tensor, max_positions: int, scale: float) -> torch.Tensor:
    positions = torch.arange(max_positions, dtype=torch.float32)
    angles = positions[:, None] * inv_freq[None, :]
    return torch.cat((angles.cos() * scale, angles.sin() * scale), dim=-1)


def cos_sin_cache(rope: dict[str, Any] | None, rotary_dim: int, max_positions: int) -> torch.Tensor:
    """[max_positions, rotary_dim] fp32: cos of each angle in the first half, sin in the second.

    ``rope`` None (a no-RoPE layer, SmolLM3) gives cos 1 and sin 0: the rotary kernel then writes
    K unchanged, exactly. LongRoPE gives [2 * max_positions, rotary_dim]: the short factors' rows,
    then the long factors' (``longrope_positions`` picks the half)."""
    if rope is None:
        return torch.cat((torch.ones(max_positions, rotary_dim // 2), torch.zeros(max_positions, rotary_dim // 2)), -1)
    scale = attention_factor(rope)
    if rope.get("rope_type") == "longrope":
        base = float(rope["rope_theta"])
        short = _longrope_inv_frequencies(rope, rotary_dim, base, long=False)
        long = _longrope_inv_frequencies(rope, rotary_dim, base, long=True)
        return torch.cat((_table(short, max_positions, scale), _table(long, max_positions, scale)))
    return _table(inv_frequencies(rope, rotary_dim), max_positions, scale)


def query_temperature_table(kind: str, divisor: float, multiplier: float, max_positions: int) -> torch.Tensor:
    """[max_positions] fp32: the query scale at each position (builder/ir.QueryTemperature), each
    kind computed as transformers computes it, so the values are its bits:

    - "llama4": log1p(floor((p + 1) / divisor)) * multiplier + 1, from float positions;
    - "llama_4_scaling": 1 + multiplier * log(1 + floor(p / divisor)), from integer positions."""
    if kind == "llama4":
        p = torch.arange(max_positions, dtype=torch.float32)
        return torch.log1p(torch.floor((p + 1.0) / divisor)) * multiplier + 1.0
    if kind == "llama_4_scaling":
        p = torch.arange(max_positions, dtype=torch.int64)
        return 1 + multiplier * torch.log(1 + torch.floor(p / divisor))
    raise ValueError(f"unknown query temperature {kind!r}")


def longrope_positions(
    positions: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    original_max_positions: int,
    max_positions: int,
) -> torch.Tensor:
    """Rows of a LongRoPE cos_sin_cache: a token of a sequence whose context (this step's tokens
    included) is longer than the original context reads the long factors' half.

    transformers picks the factors per forward call from the longest position in it, so a prompt
    longer than the original context is rotated with the long factors throughout, and a shorter one
    with the short factors until generation passes the original length (the K already cached keep
    theirs). Per sequence this is the same rule, whatever else shares the batch; only a prompt
    longer than the original context prefilled in several chunks differs (its first chunks take
    the short factors). Capture-safe: no host syncs.
    positions: [num_tokens]; seq_lens: [num_seqs]; query_start_loc: [num_seqs + 1]."""
    tokens = torch.arange(positions.shape[0], device=positions.device, dtype=query_start_loc.dtype)
    seq = torch.searchsorted(query_start_loc[1:], tokens, right=True).clamp_(max=seq_lens.shape[0] - 1)
    is_long = seq_lens[seq] > original_max_positions
    return positions + is_long.to(positions.dtype) * max_positions
