"""Pure-torch reference for every kernel.

These are the definitions the Triton kernels are tested against, and the kernels the
engine runs on a machine without a GPU. They favour clarity over speed, but avoid
per-token Python loops so the CPU engine stays usable.

Layouts shared with the Triton kernels and the runtime:
    hidden / activations        [num_tokens, hidden]
    q                           [num_tokens, num_heads, head_dim]
    k, v                        [num_tokens, num_kv_heads, head_dim]
    k_cache, v_cache            [num_blocks, num_kv_heads, block_size, head_dim]
    slot_mapping                [num_tokens] int64, slot = block_id * block_size + offset, -1 = skip
    block_tables                [num_seqs, max_blocks_per_seq] int32
    seq_lens                    [num_seqs] int32, context length including this step's tokens
    query_start_loc             [num_seqs + 1] int32, prefix sums of the query lengths
    cos_sin_cache               [max_positions, rotary_dim], cos in the first half, sin in the second
    k_scale, v_scale            floats: an fp8 (e4m3fn) cache holds fp8(x / scale), read back as fp8 * scale;
                                1.0 (and unused) for a cache in the model's own dtype
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension, computed in fp32 and scaled in x's dtype (as HF does)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """residual' = x + residual; returns (rms_norm(residual'), residual')."""
    new_residual = x + residual
    return rms_norm(new_residual, weight, eps), new_residual


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [num_tokens, 2 * d] holding (gate, up) -> silu(gate) * up: [num_tokens, d]."""
    d = x.shape[-1] // 2
    return torch.nn.functional.silu(x[..., :d]) * x[..., d:]


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [num_tokens, 2 * d] holding (gate, up) -> gelu_tanh(gate) * up (Gemma's gated MLP)."""
    d = x.shape[-1] // 2
    return torch.nn.functional.gelu(x[..., :d], approximate="tanh") * x[..., d:]


def gelu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [num_tokens, 2 * d] holding (gate, up) -> gelu(gate) * up, the exact (erf) GELU."""
    d = x.shape[-1] // 2
    return torch.nn.functional.gelu(x[..., :d]) * x[..., d:]


ACTIVATIONS = {"silu": silu_and_mul, "gelu_tanh": gelu_tanh_and_mul, "gelu": gelu_and_mul}


def soft_cap(x: torch.Tensor, cap: float) -> torch.Tensor:
    """cap * tanh(x / cap): Gemma 2's attention-logit and final-logit soft-capping (0: none)."""
    return x if not cap else torch.tanh(x / cap) * cap


def _rotate_neox(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [num_tokens, heads, rotary_dim]; cos/sin: [num_tokens, 1, rotary_dim // 2]
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def rotary_embedding(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate the first rotary_dim features of q and k (GPT-NeoX / HF Llama 'rotate_half' style).

    Returns new tensors; q: [num_tokens, num_heads, head_dim], k: [num_tokens, num_kv_heads, head_dim].
    """
    rotary_dim = cos_sin_cache.shape[-1]
    cs = cos_sin_cache[positions].to(q.dtype)  # [num_tokens, rotary_dim]
    cos, sin = cs[:, None, : rotary_dim // 2], cs[:, None, rotary_dim // 2 :]

    def apply(x: torch.Tensor) -> torch.Tensor:
        if rotary_dim == x.shape[-1]:
            return _rotate_neox(x, cos, sin)
        return torch.cat((_rotate_neox(x[..., :rotary_dim], cos, sin), x[..., rotary_dim:]), dim=-1)

    return apply(q), apply(k)


FP8_DTYPE = torch.float8_e4m3fn  # OCP e4m3 without infinities (Triton's tl.float8e4nv)
FP8_MAX = 448.0  # its largest finite value: stored values saturate here


def quantize_kv(x: torch.Tensor, cache_dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """x as the cache stores it: cast to a half/fp32 cache's dtype; for an fp8 cache
    fp8(x / scale) in fp32 (as x * fp32(1 / scale), the kernel's multiply), saturated to +-448
    rather than overflowing to NaN."""
    if cache_dtype != FP8_DTYPE:
        return x.to(cache_dtype)
    inv = torch.tensor(1.0 / scale, dtype=torch.float32, device=x.device)
    return (x.float() * inv).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def _bytes(cache: torch.Tensor) -> torch.Tensor:
    """An fp8 cache as uint8 for indexing (gathers and scatters copy bytes; not every device's
    index kernels take the fp8 types), any other cache as itself."""
    return cache.view(torch.uint8) if cache.dtype == FP8_DTYPE else cache


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Scatter this step's K/V into the paged cache; tokens with slot -1 are not written."""
    block_size = k_cache.shape[2]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    blocks, offsets = slots // block_size, slots % block_size
    _bytes(k_cache)[blocks, :, offsets] = _bytes(quantize_kv(k[keep], k_cache.dtype, k_scale))
    _bytes(v_cache)[blocks, :, offsets] = _bytes(quantize_kv(v[keep], v_cache.dtype, v_scale))


def rotary_and_write_kv(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Rotate q and k, write rotated k and v into the cache; returns the rotated q."""
    q, k = rotary_embedding(positions, q, k, cos_sin_cache)
    write_kv(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    return q


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Read one sequence's first seq_len cached tokens: [num_kv_heads, seq_len, head_dim]."""
    block_size = cache.shape[2]
    num_blocks = (seq_len + block_size - 1) // block_size
    blocks = _bytes(cache)[block_table[:num_blocks].long()].view(cache.dtype)  # [n, kv_heads, block_size, head_dim]
    return blocks.transpose(0, 1).reshape(cache.shape[1], num_blocks * block_size, -1)[:, :seq_len]


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    softcap: float = 0.0,
    window: int = 0,
    sinks: torch.Tensor | None = None,
    chunk: int = 0,
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its whole paged context.

    Sequence i owns query rows query_start_loc[i]:query_start_loc[i+1]; they are the last
    tokens of its context of seq_lens[i] tokens, whose K/V are already in the cache. One
    query row sees every cached token up to and including its own position. Decode
    (one query per sequence), prefill and prefill over a cached prefix are all this one
    function. An fp8 cache is read as fp8 * scale: the K scale multiplies the scores, the V
    scale the output (as the kernels fold them). ``softcap`` > 0 soft-caps the scaled scores
    (cap * tanh(s / cap), before the causal mask); ``window`` > 0 lets a query at position p see
    only keys at positions p - window < k <= p (sliding-window attention, as transformers masks
    it); ``chunk`` > 0 only keys of its own chunk, p // chunk * chunk <= k <= p (Llama 4's chunked
    attention, as transformers masks it). ``sinks`` [num_heads] (gpt-oss) adds exp(sink) of each head to its softmax's denominator:
    a column of logits that takes probability and gives no value. Returns [num_tokens, num_heads,
    head_dim] in q's dtype.
    """
    num_heads, num_kv_heads = q.shape[1], k_cache.shape[1]
    group = num_heads // num_kv_heads
    if q.shape[0] == seq_lens.shape[0]:  # one query per sequence: decode, batched over sequences
        return paged_decode_attention(
            q, k_cache, v_cache, block_tables, seq_lens, scale, k_scale, v_scale, softcap, window, sinks, chunk
        )
    out = torch.empty_like(q)
    head_dim = q.shape[2]
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    for i, seq_len in enumerate(lens):
        q_start, q_end = starts[i], starts[i + 1]
        q_len = q_end - q_start
        if q_len == 0:
            continue
        k = gather_kv(k_cache, block_tables[i], seq_len).float()  # [kv_heads, seq_len, head_dim]
        v = gather_kv(v_cache, block_tables[i], seq_len).float()
        # Head h reads KV head h // group. The group's query rows are stacked on one KV head's
        # rows, so K and V are read as they are, not copied once per query head.
        qi = q[q_start:q_end].float().view(q_len, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)
        qi = qi.reshape(num_kv_heads, group * q_len, head_dim)  # [kv_heads, group * q_len, head_dim]
        scores = soft_cap(torch.matmul(qi, k.transpose(1, 2)) * (scale * k_scale), softcap)
        scores = scores.view(num_kv_heads, group, q_len, seq_len)
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)[:, None]
        k_pos = torch.arange(seq_len, device=q.device)[None, :]
        hidden = k_pos > q_pos
        if window:
            hidden |= k_pos <= q_pos - window
        if chunk:
            hidden |= k_pos < q_pos // chunk * chunk
        scores.masked_fill_(hidden, float("-inf"))
        probs = _softmax_with_sinks(scores, None if sinks is None else sinks.float().view(num_kv_heads, group, 1, 1))
        o = torch.matmul(probs.view(num_kv_heads, group * q_len, seq_len), v) * v_scale
        out[q_start:q_end] = o.view(num_kv_heads, group, q_len, head_dim).permute(2, 0, 1, 3).reshape(q_len, num_heads, head_dim).to(q.dtype)
    return out


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    softcap: float = 0.0,
    window: int = 0,
    sinks: torch.Tensor | None = None,
    chunk: int = 0,
) -> torch.Tensor:
    """paged_attention for one query token per sequence (the last of its context), all sequences
    in one batched gather and matmul instead of a loop: this is the CPU engine's decode path."""
    num_seqs, num_heads, head_dim = q.shape
    _, num_kv_heads, block_size, _ = k_cache.shape
    group = num_heads // num_kv_heads
    max_len = int(seq_lens.max())
    num_blocks = (max_len + block_size - 1) // block_size
    table = block_tables[:, :num_blocks].long()

    def gather(cache: torch.Tensor) -> torch.Tensor:
        # [num_seqs, num_blocks, kv_heads, block_size, head_dim] -> [num_seqs, kv_heads, tokens, head_dim]
        blocks = _bytes(cache)[table].view(cache.dtype).transpose(1, 2)
        return blocks.reshape(num_seqs, num_kv_heads, num_blocks * block_size, head_dim).float()

    k, v = gather(k_cache), gather(v_cache)
    qg = q.float().view(num_seqs, num_kv_heads, group, head_dim)
    scores = soft_cap(torch.matmul(qg, k.transpose(2, 3)) * (scale * k_scale), softcap)  # [seqs, kv_heads, group, tokens]
    k_pos = torch.arange(num_blocks * block_size, device=q.device)[None, :]
    valid = k_pos < seq_lens[:, None]
    if window:  # the query sits at seq_len - 1
        valid &= k_pos >= seq_lens[:, None] - window
    if chunk:  # the query's chunk
        valid &= k_pos >= (seq_lens[:, None] - 1) // chunk * chunk
    scores.masked_fill_(~valid[:, None, None, :], float("-inf"))
    probs = _softmax_with_sinks(scores, None if sinks is None else sinks.float().view(1, num_kv_heads, group, 1))
    return (torch.matmul(probs, v) * v_scale).view(num_seqs, num_heads, head_dim).to(q.dtype)


def _softmax_with_sinks(scores: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """softmax over the last dim, with one more logit per row (``sinks``, broadcast to [..., 1])
    in the denominator when given (its probability is dropped)."""
    if sinks is None:
        return torch.softmax(scores, dim=-1)
    combined = torch.cat((scores, sinks.expand(*scores.shape[:-1], 1)), dim=-1)
    return torch.softmax(combined, dim=-1)[..., :-1]


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The skinny GEMM's reference: y = x @ weight.T + bias."""
    return torch.nn.functional.linear(x, weight, bias)


def dequantize_int4(
    qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int
) -> torch.Tensor:
    """The W4A16 kernel's weight layout -> fp32 [N, K] (nn.Linear.weight, permuted input order).

    qweight int32 [K/8, N] holds input 8r + i in nibble i of row r; scales and int8 zeros are
    [K/G, N]; W[k, n] = (q[k, n] - zeros[k // G, n]) * scales[k // G, n], exact in fp32."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=qweight.device)
    q = ((qweight[:, None, :] >> shifts[None, :, None]) & 0xF).reshape(-1, qweight.shape[1])  # [K, N]
    groups = torch.arange(q.shape[0], device=q.device) // group_size
    w = (q.float() - zeros.float()[groups]) * scales.float()[groups]
    return w.t()


def w4a16_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    perm: torch.Tensor | None,
    group_size: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """The W4A16 GEMM's reference: x (columns in the weight's input order) @ dequant(W).T + bias,
    the weight rounded to x's dtype as the kernel feeds it to the tensor cores."""
    if perm is not None:
        x = x.index_select(1, perm.long())
    return linear(x, dequantize_int4(qweight, scales, zeros, group_size).to(x.dtype), bias)


# --- FP8 weights and activations (W8A8, e4m3) --------------------------------------------------
#
# The FP8 GEMM's definition. Values are OCP e4m3 (float8_e4m3fn, largest 448). A dynamic scale is
# amax / 448 (amax clamped to FP8_MIN_AMAX so a zero row divides by something); x / scale is
# saturated to +-448 and rounded to nearest even by the cast. The product of two e4m3 values is
# exact in fp32, so the emulation below (fp32 matmul of the fp8 values, then the scales) is the
# kernel's arithmetic up to the order of the fp32 sums.

FP8_MIN_AMAX = 1e-12
FP8_GROUP = 128  # the block format's 128x128 weight blocks and 1x128 activation groups


def _amax_scale(amax: torch.Tensor) -> torch.Tensor:
    """max(amax, FP8_MIN_AMAX) / 448, divided exactly on every device: torch on CUDA divides by a
    Python number as a multiply by its reciprocal, an ulp off now and then (and so, now and then,
    were the e4m3 values of the GPU's bitwise tests); a tensor divisor is a true division, as are
    the kernels' div_rn."""
    return amax.clamp_min(FP8_MIN_AMAX) / amax.new_tensor(FP8_MAX)


fp8_amax_scale = _amax_scale  # for the builder's weight blocks (builder/fp8.quantise_weight_blocks)


def _to_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (x / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def quantize_fp8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[M, K] -> (e4m3 [M, K], fp32 [M]): one scale per row (activation token, weight channel)."""
    xf = x.float()
    scale = _amax_scale(xf.abs().amax(-1))
    return _to_fp8(xf, scale[:, None]), scale


def quantize_fp8_groups(x: torch.Tensor, group: int = FP8_GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """[M, K] -> (e4m3 [M, K], fp32 [M, ceil(K / group)]): one scale per row and ``group`` columns
    (the last group may be partial)."""
    xf = x.float()
    m, k = xf.shape
    groups = -(-k // group)
    padded = torch.nn.functional.pad(xf.abs(), (0, groups * group - k)).view(m, groups, group)
    scale = _amax_scale(padded.amax(-1))
    return _to_fp8(xf, scale.repeat_interleave(group, dim=1)[:, :k]), scale


def quantize_fp8_static(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """[M, K] -> e4m3 [M, K] with a fixed per-tensor scale (a checkpoint's ``input_scale``)."""
    return _to_fp8(x.float(), scale.float().reshape(()))


def quantize_fp8_activations(
    x: torch.Tensor, activations: str, input_scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The activation side of the FP8 GEMM: (e4m3 [M, K], fp32 scale [M] / [M, KB] / [1])."""
    if activations == "token":
        return quantize_fp8_rows(x)
    if activations == "group":
        return quantize_fp8_groups(x)
    if activations == "static":
        assert input_scale is not None
        return quantize_fp8_static(x, input_scale), input_scale.float().reshape(1)
    raise ValueError(f"unknown fp8 activation scheme {activations!r}")


def fp8_gemm(
    qx: torch.Tensor,
    x_scale: torch.Tensor,
    qw: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    qw_float: torch.Tensor | None = None,
) -> torch.Tensor:
    """y = (qx @ qw.T) scaled, + bias, in ``out_dtype``. qx e4m3 [M, K] with x_scale fp32 [M]
    (per token) or [1] (static); qw e4m3 [N, K] with w_scale fp32 [N] (per channel). Block
    scaling: x_scale [M, KB] and w_scale [N, KB] (groups of 128 along K), each K block's partial
    product scaled by its two scales. ``qw_float`` is qw as fp32, when the caller keeps it."""
    wf = qw.float() if qw_float is None else qw_float
    xf = qx.float()
    if w_scale.dim() == 2:
        k = qx.shape[1]
        acc = torch.zeros(qx.shape[0], qw.shape[0], dtype=torch.float32, device=qx.device)
        for b in range(w_scale.shape[1]):
            lo, hi = b * FP8_GROUP, min(k, (b + 1) * FP8_GROUP)
            acc += (xf[:, lo:hi] @ wf[:, lo:hi].t()) * x_scale[:, b, None] * w_scale[None, :, b]
    else:
        acc = (xf @ wf.t()) * x_scale.reshape(-1, 1) * w_scale[None, :]  # [M, 1] per token, [1, 1] static
    if bias is not None:
        acc = acc + bias.float()
    return acc.to(out_dtype)


def fp8_linear(
    x: torch.Tensor,
    qw: torch.Tensor,
    w_scale: torch.Tensor,
    activations: str,
    input_scale: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    qw_float: torch.Tensor | None = None,
) -> torch.Tensor:
    """The W8A8 linear's exact emulation: quantise x as ``activations`` says, then ``fp8_gemm``."""
    qx, xs = quantize_fp8_activations(x, activations, input_scale)
    return fp8_gemm(qx, xs, qw, w_scale, bias, x.dtype, qw_float)


def fp8_norm_linear(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    qw: torch.Tensor,
    w_scale: torch.Tensor,
    activations: str,
    input_scale: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm feeding an FP8 linear, as the fused decode kernel computes it
    (fp8_gemm.fp8_skinny_norm_linear): the stream x (+ residual, rounded to x's dtype), each row
    times rsqrt(mean of squares + eps) in fp32 and the norm weight, not rounded to x's dtype before
    the quantisation (rms_norm rounds twice, so the unfused path differs by those roundings).
    Returns (y in x's dtype, the stream)."""
    stream = x if residual is None else x + residual
    sf = stream.float()
    rstd = torch.rsqrt(sf.pow(2).mean(-1, keepdim=True) + eps)
    normed = (sf * norm_weight.float()) * rstd
    qx, xs = quantize_fp8_activations(normed, activations, input_scale)
    return fp8_gemm(qx, xs, qw, w_scale, bias, x.dtype), stream


def dequantize_fp8(qw: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """An artifact FP8 weight -> fp32 [N, K]: weight x scale (per channel, or per row and 128-column block)."""
    wf = qw.float()
    if w_scale.dim() == 2:
        return wf * w_scale.repeat_interleave(FP8_GROUP, dim=1)[:, : qw.shape[1]]
    return wf * w_scale[:, None]


# --- keyed noise (seeded sampling) -----------------------------------------------------------

# Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC'11).
PHILOX_M0, PHILOX_M1 = 0xD2511F53, 0xCD9E8D57
PHILOX_W0, PHILOX_W1 = 0x9E3779B9, 0xBB67AE85
# One Philox call makes four words: the words of call j of a block of 4 * PHILOX_GROUP columns
# go to columns j, j + G, j + 2G and j + 3G of that block. Part of the stream's definition (the
# kernel's block is exactly one such group), so it must never change: seeded outputs would.
PHILOX_GROUP = 256


def philox4x32(counter: list[np.ndarray], key: list[np.ndarray], rounds: int = 10) -> list[np.ndarray]:
    """Philox4x32 on uint32 arrays (broadcast together). NumPy rather than torch: torch's CPU
    shifts and xors on integer tensors are two orders of magnitude slower, and uint32
    arithmetic wraps in NumPy as it does on the GPU."""
    c0, c1, c2, c3 = (np.asarray(c, dtype=np.uint32) for c in counter)
    k0, k1 = (np.asarray(k, dtype=np.uint32) for k in key)
    with np.errstate(over="ignore"):
        for r in range(rounds):
            if r:
                k0, k1 = k0 + np.uint32(PHILOX_W0), k1 + np.uint32(PHILOX_W1)
            p0 = c0.astype(np.uint64) * np.uint64(PHILOX_M0)
            p1 = c2.astype(np.uint64) * np.uint64(PHILOX_M1)
            hi0, lo0 = (p0 >> np.uint64(32)).astype(np.uint32), p0.astype(np.uint32)
            hi1, lo1 = (p1 >> np.uint64(32)).astype(np.uint32), p1.astype(np.uint32)
            c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return [c0, c1, c2, c3]


def keyed_exponential(keys: torch.Tensor, offsets: torch.Tensor, vocab: int) -> torch.Tensor:
    """Exp(1) noise ``[rows, vocab]`` fp32, a pure function of (row key, row offset, column):
    the reference of kernels/keyed_noise.py.

    keys: [rows] int64, a 64-bit key per row (the seed); offsets: [rows] int64 in [0, 2**32),
    e.g. the index of the output token being sampled. Column v of a row is word v // G % 4 of
    Philox4x32-10 with key (key low, key high) and counter (block * G + v % G, offset, 0, 0),
    block = v // (4 G), G = PHILOX_GROUP. The word's top 23 bits give u = (2 w + 1) / 2**24 in
    (0, 1), exactly representable, so the noise -log(u) is finite and positive.
    """
    rows = keys.shape[0]
    key = keys.detach().cpu().numpy().astype(np.uint64)
    offset = offsets.detach().cpu().numpy().astype(np.uint32)[:, None]
    num_blocks = -(-vocab // (4 * PHILOX_GROUP))
    calls = np.arange(num_blocks * PHILOX_GROUP, dtype=np.uint32)[None, :]
    zero = np.zeros((rows, 1), dtype=np.uint32)
    k0 = (key & np.uint64(0xFFFFFFFF)).astype(np.uint32)[:, None]
    k1 = (key >> np.uint64(32)).astype(np.uint32)[:, None]
    words = np.stack(np.broadcast_arrays(*philox4x32([calls, offset, zero, zero], [k0, k1])))
    # [4, rows, blocks * G] -> [rows, blocks, 4, G]: word l of call (b, j) is column b*4G + l*G + j.
    words = words.reshape(4, rows, num_blocks, PHILOX_GROUP).transpose(1, 2, 0, 3).reshape(rows, -1)[:, :vocab]
    u = ((words >> np.uint32(9)) * np.uint32(2) + np.uint32(1)).astype(np.float32) * np.float32(2.0**-24)
    return torch.from_numpy(-np.log(u)).to(keys.device)


# --- sampling and logprobs (kernels/sampling.py) ---------------------------------------------


def truncation_keep(x: torch.Tensor, cut_value: torch.Tensor, cut_token: torch.Tensor, tie_drop: torch.Tensor) -> torch.Tensor:
    """The tokens a per-row truncation cutoff keeps (``[rows, vocab]`` bool), on ``x`` (the
    logits after temperature): a token is kept when its ``x`` is above ``cut_value``, or equal to
    it, with an id of at least ``cut_token`` and at least ``tie_drop`` tokens of that value
    before it (those tied at the cutoff go lowest id first). ``cut_value`` -inf keeps every token.
    Per-row arguments are ``[rows]``."""
    at = x == cut_value[:, None]
    ids = torch.arange(x.shape[1], device=x.device)
    tie_index = at.cumsum(dim=1) - at.long()  # tokens of the cutoff value at lower ids
    return (x > cut_value[:, None]) | (at & (ids >= cut_token[:, None]) & (tie_index >= tie_drop[:, None]))


def race(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    cut_value: torch.Tensor,
    cut_token: torch.Tensor,
    tie_drop: torch.Tensor,
    row_max: torch.Tensor,
    min_p: torch.Tensor,
    noise: torch.Tensor,
) -> torch.Tensor:
    """The sampled token of each row ([rows] int64): an exponential race ``argmax(p / noise)``.

    ``x = logits / temperature`` (fp32), ``p = exp(x - row_max)`` for the tokens
    ``truncation_keep`` keeps and whose ``p`` is at least ``min_p`` (min-p: ``p`` is the
    probability relative to the most likely token's), none for the others; ``noise`` is
    ``[rows, vocab]`` Exp(1), e.g. ``keyed_exponential``. Equal scores go to the lowest id.
    Per-row arguments are ``[rows]``."""
    x = logits.float() / temperature[:, None]
    p = torch.exp(x - row_max[:, None])
    keep = truncation_keep(x, cut_value, cut_token, tie_drop) & (p >= min_p[:, None])
    # A draw of exactly 0 (torch's generator can make one) would turn 0 / 0 into nan.
    score = torch.where(keep, p / noise.clamp_min(torch.finfo(torch.float32).tiny), -1.0)
    return score.argmax(dim=1)


def count_ties(logits: torch.Tensor, temperature: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """``[rows, 1]`` int32: how many tokens of each row have ``logits / temperature == value``."""
    x = logits.float() / temperature[:, None]
    return (x == value[:, None]).sum(dim=1, keepdim=True, dtype=torch.int32)


def logprob_stats(logits: torch.Tensor, scored: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``[rows, 1]`` each: the max logit, ``sum(exp(logit - max))`` and the number of logits
    strictly greater than ``scored`` ([rows] fp32, the scored token's logit). The logprob of a
    token is ``(logit - max) - log(sum)``, its rank ``1 + greater``."""
    x = logits.float()
    m = x.amax(dim=1, keepdim=True)
    total = torch.exp(x - m).sum(dim=1, keepdim=True)
    greater = (x > scored[:, None]).sum(dim=1, keepdim=True, dtype=torch.int32)
    return m, total, greater


# ---------------------------------------------------------------------------- mixture of experts
# Expert weights in kernels/moe_routing.py's layout: w_gate_up [E, 2I, H] (gate rows, then up rows),
# w_down [E, H, I], biases b_gate_up [E, 2I] / b_down [E, H] or None.


def moe_activation(gate_up: torch.Tensor, kind: str = "silu", alpha: float = 1.702, limit: float = 7.0) -> torch.Tensor:
    """gate_up [rows, 2I] ([gate | up]) -> [rows, I]: silu(gate) * up, or gpt-oss's clamped SwiGLU
    (``swiglu_oai``: gate clamped above at ``limit``, up to +-``limit``, gate * sigmoid(alpha *
    gate) * (up + 1)), in gate_up's dtype as transformers computes them."""
    gate, up = gate_up.chunk(2, dim=-1)
    if kind == "silu":
        return torch.nn.functional.silu(gate) * up
    if kind == "swiglu_oai":
        gate = gate.clamp(max=limit)
        up = up.clamp(min=-limit, max=limit)
        return (up + 1) * (gate * torch.sigmoid(gate * alpha))
    raise ValueError(f"unknown MoE activation {kind!r}")


def fused_moe(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    b_gate_up: torch.Tensor | None = None,
    b_down: torch.Tensor | None = None,
    activation: str = "silu",
    alpha: float = 1.702,
    limit: float = 7.0,
) -> torch.Tensor:
    """The experts of a MoE block: x [T, H], topk_weights [T, k], topk_ids [T, k] -> [T, H] in x's
    dtype, sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(x[t]). A loop over the experts the
    tokens visit, as transformers' experts modules run: each expert's rows through its two
    projections (F.linear: cuBLAS on a GPU), scaled by the routing weight (in fp32 where the
    weights are fp32) and added into the output in x's dtype. It syncs with the host (the
    visited experts), so it is never captured in a CUDA graph."""
    return expert_loop(
        x, topk_weights, topk_ids,
        lambda e, rows: linear(rows, w_gate_up[e], None if b_gate_up is None else b_gate_up[e]),
        lambda e, rows: linear(rows, w_down[e], None if b_down is None else b_down[e]),
        activation, alpha, limit,
    )  # fmt: skip


def expert_loop(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    gate_up: Callable[[int, torch.Tensor], torch.Tensor],
    down: Callable[[int, torch.Tensor], torch.Tensor],
    activation: str = "silu",
    alpha: float = 1.702,
    limit: float = 7.0,
) -> torch.Tensor:
    """The per-expert loop every MoE baseline and reference runs, whatever the experts' format:
    for each expert the tokens visit, its rows through ``gate_up(e, rows)``, the activation, then
    ``down(e, rows)`` (each projection with its bias), scaled by the routing weight and added into
    the output in x's dtype. Syncs with the host (the visited experts)."""
    out = torch.zeros_like(x)
    for e in torch.unique(topk_ids.reshape(-1)).tolist():
        token, slot = torch.where(topk_ids == e)
        h = down(e, moe_activation(gate_up(e, x[token]), activation, alpha, limit))
        out.index_add_(0, token, (h * topk_weights[token, slot, None]).to(x.dtype))
    return out


def fused_moe_fp8(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w_gate_up: torch.Tensor,
    s_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    s_down: torch.Tensor,
    activation: str = "silu",
    alpha: float = 1.702,
    limit: float = 7.0,
    floats: tuple[torch.Tensor, torch.Tensor] | None = None,
    b_gate_up: torch.Tensor | None = None,
    b_down: torch.Tensor | None = None,
) -> torch.Tensor:
    """``fused_moe`` with FP8 experts (kernels/fused_moe_fp8.py's layout: e4m3 [E, 2I, H] / [E, H, I]
    with fp32 scales [E, N] per channel or [E, N, KB] per 128-column block): each expert's rows
    through ``fp8_linear`` twice (activations quantised per token, or per 1x128 group with block
    scales; the product, plus gpt-oss's expert biases after the scales, in x's dtype), the activation
    between in x's dtype. ``floats``: the e4m3 weights as fp32, when the caller keeps them (the CPU
    engine)."""
    acts = "group" if s_gate_up.dim() == 3 else "token"

    def project(w: torch.Tensor, s: torch.Tensor, b: torch.Tensor | None, i: int) -> Callable[[int, torch.Tensor], torch.Tensor]:
        return lambda e, rows: fp8_linear(
            rows, w[e], s[e], acts, bias=None if b is None else b[e], qw_float=None if floats is None else floats[i][e]
        )

    return expert_loop(
        x, topk_weights, topk_ids, project(w_gate_up, s_gate_up, b_gate_up, 0), project(w_down, s_down, b_down, 1),
        activation, alpha, limit,
    )  # fmt: skip


def moe_align_by_expert(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The fused-MoE tile path's layout (kernels/fused_moe.py): topk_ids [T, k] -> (sorted_ids
    int32 [max_blocks * block_m]: the pair ids p = t * k + j grouped by expert in pair order,
    each expert's run padded to a multiple of block_m with P = T * k; block_expert int32
    [max_blocks]: each block's expert, -1 past the used blocks), max_blocks = cdiv(P, block_m) +
    min(E, P). Device ops only (no host sync)."""
    flat = topk_ids.reshape(-1)
    p = flat.numel()
    nb = -(-p // block_m) + min(num_experts, p)
    dev = flat.device
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    firsts = torch.cumsum(counts, 0) - counts  # each expert's first position in the unpadded order
    order = torch.sort(flat, stable=True).indices  # pair ids by expert
    sorted_e = flat[order]
    dest = (ends - padded)[sorted_e] + torch.arange(p, device=dev) - firsts[sorted_e]
    sorted_ids = torch.full((nb * block_m,), p, dtype=torch.int32, device=dev)
    sorted_ids[dest] = order.to(torch.int32)
    block_expert = torch.searchsorted(ends, torch.arange(nb, device=dev) * block_m, right=True)
    return sorted_ids, torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
