"""Rotary embedding on q and k fused with writing this step's K (rotated) and V into the paged cache.

One program per token: it reads the token's cos/sin row once, rotates all its query and
key heads (GPT-NeoX rotate-half over the first rotary_dim features), writes the rotated q
to a new tensor and the rotated k and v to the token's cache slot (slot -1: not written).
Every rope variant (default, linear, llama3) is already folded into cos_sin_cache.
Like the reference (and transformers), cos and sin are rounded to q's dtype first; the
rotation itself is computed in fp32 and rounded once. An fp8 (e4m3fn) cache gets
fp8(x * (1 / scale)) with one K and one V scale per layer, saturated to +-448 (an
out-of-range value stays finite instead of becoming NaN). Models that RMS-normalise each q and
k head before rotary (Qwen3, Gemma 3) do it here too (``QK_NORM``), so the norms take no launches.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from pagecast.kernels import pdl
from pagecast.kernels.reference import FP8_DTYPE
from pagecast.kernels.tuning import KernelConfig

FP8_MAX: tl.constexpr = tl.constexpr(448.0)  # largest finite e4m3fn value (reference.FP8_MAX)


@triton.jit
def _rotate(
    x_ptr, heads, offs_d, partner, cos, sin, num_heads, norm_ptr, eps, HEAD_DIM: tl.constexpr, QK_NORM: tl.constexpr,
    QK_NORM_AFTER: tl.constexpr = False,
):  # fmt: skip
    # x_ptr points at one token's [num_heads, head_dim] rows (head stride applied by caller).
    mask = (heads < num_heads)[:, None] & (offs_d < HEAD_DIM)[None, :]
    x = tl.load(x_ptr + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
    x_partner = tl.load(x_ptr + partner[None, :], mask=mask, other=0.0).to(tl.float32)
    if QK_NORM:
        # Each head RMS-normalised first, as rms_norm computes it: fp32 over the head's features,
        # rounded to the input's dtype, times the weight, rounded again. A head's sum of squares is
        # the same over its features in either order, so the partners share the head's factor.
        dtype = x_ptr.dtype.element_ty
        rstd = tl.math.rsqrt(tl.sum(x * x, 1) / HEAD_DIM + eps)[:, None]
        d_ok = offs_d < HEAD_DIM
        w = tl.load(norm_ptr + offs_d, mask=d_ok, other=0.0).to(tl.float32)[None, :]
        w_partner = tl.load(norm_ptr + partner, mask=d_ok, other=0.0).to(tl.float32)[None, :]
        x = (w * (x * rstd).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
        x_partner = (w_partner * (x_partner * rstd).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    rotated = x * cos[None, :] + x_partner * sin[None, :]
    if QK_NORM_AFTER:
        # HunYuan: each rotated head RMS-normalised, as rms_norm on the rotary's output (in the
        # input's dtype) computes it, before it is stored or cached
        dtype = x_ptr.dtype.element_ty
        rotated = rotated.to(dtype).to(tl.float32)
        rstd = tl.math.rsqrt(tl.sum(rotated * rotated, 1) / HEAD_DIM + eps)[:, None]
        w = tl.load(norm_ptr + offs_d, mask=offs_d < HEAD_DIM, other=0.0).to(tl.float32)[None, :]
        rotated = (w * (rotated * rstd).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    return rotated, mask


@triton.jit
def _rotary_kv_kernel(
    positions_ptr,  # positions: [num_tokens] int64
    q_ptr,  # q: [num_tokens, num_heads, head_dim]
    k_ptr,  # k: [num_tokens, num_kv_heads, head_dim]
    v_ptr,  # v: [num_tokens, num_kv_heads, head_dim]
    cos_sin_ptr,  # cos_sin_cache: [max_positions, rotary_dim] fp32 (cos half, sin half)
    k_cache_ptr,  # k_cache: [num_blocks, num_kv_heads, block_size, head_dim]
    v_cache_ptr,  # v_cache: [num_blocks, num_kv_heads, block_size, head_dim]
    slot_mapping_ptr,  # slot_mapping: [num_tokens] int64, -1 = skip
    q_out_ptr,  # q_out: [num_tokens, num_heads, head_dim]
    q_norm_ptr,  # q_norm weight: [head_dim] (QK_NORM), else unused
    k_norm_ptr,  # k_norm weight: [head_dim] (QK_NORM), else unused
    norm_eps,  # the q/k norms' epsilon (QK_NORM)
    k_inv_scale,  # 1 / k_scale (fp8 cache; 1.0 otherwise)
    v_inv_scale,  # 1 / v_scale
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cos,
    stride_kcb,
    stride_kch,
    stride_kct,
    stride_vcb,
    stride_vch,
    stride_vct,
    stride_ot,
    stride_oh,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    KV_HEADS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    ROTARY_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    KV_FP8: tl.constexpr,  # the caches are float8e4nv: scale and saturate before the cast
    QK_NORM: tl.constexpr = False,  # RMSNorm each q and k head before rotating it (Qwen3, Gemma 3)
    QK_NORM_AFTER: tl.constexpr = False,  # RMSNorm each rotated q and k head (HunYuan)
    PDL: tl.constexpr = False,  # launched with programmatic dependent launch (kernels/pdl.py)
):
    if PDL:
        gdc_wait()  # before any memory access: the kernel before may still be running
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token)
    HALF: tl.constexpr = ROTARY_DIM // 2
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    rotated = offs_d < ROTARY_DIM
    first = offs_d < HALF
    # feature d pairs with d + half (first half, negated) or d - half (second half)
    partner = tl.where(rotated, tl.where(first, offs_d + HALF, offs_d - HALF), offs_d)
    freq = tl.where(first, offs_d, offs_d - HALF)
    cs_row = cos_sin_ptr + pos * stride_cos
    dtype = q_out_ptr.dtype.element_ty
    cos = tl.load(cs_row + freq, mask=rotated, other=1.0).to(dtype).to(tl.float32)
    sin = tl.load(cs_row + HALF + freq, mask=rotated, other=0.0).to(dtype).to(tl.float32)
    sin = tl.where(first, -sin, sin)
    sin = tl.where(rotated, sin, 0.0)

    heads = tl.arange(0, HEADS_PAD)
    q_rows = q_ptr + token * stride_qt + heads[:, None] * stride_qh
    q_rot, q_mask = _rotate(
        q_rows, heads, offs_d, partner, cos, sin, NUM_HEADS, q_norm_ptr, norm_eps, HEAD_DIM, QK_NORM, QK_NORM_AFTER
    )
    tl.store(
        q_out_ptr + token * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
        q_rot.to(dtype),
        mask=q_mask,
    )

    slot = tl.load(slot_mapping_ptr + token)
    if slot >= 0:
        block = slot // BLOCK_SIZE
        offset = slot % BLOCK_SIZE
        kv_heads = tl.arange(0, KV_HEADS_PAD)
        k_rows = k_ptr + token * stride_kt + kv_heads[:, None] * stride_kh
        k_rot, kv_mask = _rotate(
            k_rows, kv_heads, offs_d, partner, cos, sin, NUM_KV_HEADS, k_norm_ptr, norm_eps, HEAD_DIM, QK_NORM,
            QK_NORM_AFTER,
        )
        kc = (
            k_cache_ptr
            + block * stride_kcb
            + kv_heads[:, None] * stride_kch
            + offset * stride_kct
            + offs_d[None, :]
        )
        v = tl.load(v_ptr + token * stride_vt + kv_heads[:, None] * stride_vh + offs_d[None, :], mask=kv_mask)
        if KV_FP8:
            k_rot = tl.minimum(tl.maximum(k_rot * k_inv_scale, -FP8_MAX), FP8_MAX)
            v = tl.minimum(tl.maximum(v.to(tl.float32) * v_inv_scale, -FP8_MAX), FP8_MAX)
        tl.store(kc, k_rot.to(k_cache_ptr.dtype.element_ty), mask=kv_mask)
        vc = (
            v_cache_ptr
            + block * stride_vcb
            + kv_heads[:, None] * stride_vch
            + offset * stride_vct
            + offs_d[None, :]
        )
        tl.store(vc, v.to(v_cache_ptr.dtype.element_ty), mask=kv_mask)


CONFIG_SPACE: list[KernelConfig] = [KernelConfig({}, num_warps=w, num_stages=1) for w in (4, 1, 2, 8)]


def prune_configs(configs: list[KernelConfig], num_heads: int, head_dim: int) -> list[KernelConfig]:
    """Keep warp counts that have at least one 16-byte vector of q per thread."""
    elems = triton.next_power_of_2(num_heads) * triton.next_power_of_2(head_dim)
    return [c for c in configs if c.num_warps * 32 * 8 <= max(elems, 256)]


def default_config() -> KernelConfig:
    return CONFIG_SPACE[0]


def rotary_and_write_kv(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    config: Mapping[str, int] | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    q_norm: torch.Tensor | None = None,
    k_norm: torch.Tensor | None = None,
    qk_norm_eps: float = 0.0,
    qk_norm_after: bool = False,
) -> torch.Tensor:
    """Rotate q and k, write rotated k and v into the cache at slot_mapping; returns the rotated q.

    The caches are in q's dtype, or fp8 e4m3fn holding fp8(x / k_scale) and fp8(v / v_scale).
    With ``q_norm`` and ``k_norm`` ([head_dim] weights) each q and k head is RMS-normalised
    (``qk_norm_eps``) before it is rotated, in this launch: what ``rms_norm`` on each head and
    then this kernel compute, without the norms' launches or the copies of the strided q and k
    views they needed (four launches a layer). ``qk_norm_after``: the norms apply to each head once
    rotated instead (HunYuan), before k is cached."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    rotary_dim = cos_sin_cache.shape[-1]
    if k.shape != (num_tokens, num_kv_heads, head_dim) or v.shape != k.shape:
        raise ValueError(f"k {tuple(k.shape)} / v {tuple(v.shape)} do not match q {tuple(q.shape)}")
    if k_cache.shape[1] != num_kv_heads or k_cache.shape[3] != head_dim or v_cache.shape != k_cache.shape:
        raise ValueError(f"cache {tuple(k_cache.shape)} does not match k {tuple(k.shape)}")
    if rotary_dim % 2 or rotary_dim > head_dim:
        raise ValueError(f"rotary_dim {rotary_dim} must be even and at most head_dim {head_dim}")
    kv_fp8 = k_cache.dtype == FP8_DTYPE
    if v_cache.dtype != k_cache.dtype:
        raise ValueError(f"k_cache ({k_cache.dtype}) and v_cache ({v_cache.dtype}) must share a dtype")
    if not (k_scale > 0 and v_scale > 0):
        raise ValueError(f"k_scale {k_scale} and v_scale {v_scale} must be positive")
    if cos_sin_cache.dtype != torch.float32 or cos_sin_cache.stride(-1) != 1:
        raise ValueError("cos_sin_cache must be contiguous fp32 [max_positions, rotary_dim]")
    for name, t in (("q", q), ("k", k), ("v", v), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} needs a contiguous last (head_dim) dimension")
    if slot_mapping.shape[0] != num_tokens or positions.shape[0] != num_tokens:
        raise ValueError("positions and slot_mapping need one entry per token")
    if (q_norm is None) != (k_norm is None):
        raise ValueError("q_norm and k_norm go together")
    if q_norm is not None and (q_norm.shape != (head_dim,) or k_norm.shape != (head_dim,)):  # type: ignore[union-attr]
        raise ValueError(f"q_norm {tuple(q_norm.shape)} / k_norm {tuple(k_norm.shape)} must be [head_dim] ({head_dim})")  # type: ignore[union-attr]
    positions = positions.to(torch.int64)
    slot_mapping = slot_mapping.to(torch.int64)
    q_out = torch.empty((num_tokens, num_heads, head_dim), dtype=q.dtype, device=q.device)
    if num_tokens == 0:
        return q_out
    cfg = KernelConfig.coerce(config) or default_config()
    _rotary_kv_kernel[(num_tokens,)](
        positions, q, k, v, cos_sin_cache, k_cache, v_cache, slot_mapping, q_out,
        q_out if q_norm is None else q_norm, q_out if k_norm is None else k_norm, qk_norm_eps, 1.0 / k_scale, 1.0 / v_scale,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        cos_sin_cache.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        q_out.stride(0), q_out.stride(1),
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads,
        HEADS_PAD=triton.next_power_of_2(num_heads), KV_HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM=head_dim, HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
        ROTARY_DIM=rotary_dim, BLOCK_SIZE=k_cache.shape[2], KV_FP8=kv_fp8,
        QK_NORM=q_norm is not None and not qk_norm_after, QK_NORM_AFTER=q_norm is not None and qk_norm_after,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl.launch_options(),
    )  # fmt: skip
    return q_out
