"""The pure-torch reference kernels against plain dense computations (they are the CPU engine's
kernels and the yardstick of the Triton ones, so they get their own check)."""

from __future__ import annotations

import math

import pytest
import torch

from pagecast.kernels import reference


def _paged_cache(kv: list[torch.Tensor], block_size: int, num_blocks: int, seed: int):  # type: ignore[no-untyped-def]
    """Scatter each sequence's dense K (or V) [kv_heads, len, dim] into shuffled blocks."""
    g = torch.Generator().manual_seed(seed)
    kv_heads, dim = kv[0].shape[0], kv[0].shape[2]
    cache = torch.randn(num_blocks, kv_heads, block_size, dim, generator=g)  # garbage where unused
    free = torch.randperm(num_blocks, generator=g).tolist()
    max_blocks = max(math.ceil(x.shape[1] / block_size) for x in kv)
    tables = torch.zeros(len(kv), max_blocks, dtype=torch.int32)
    for i, x in enumerate(kv):
        for b in range(math.ceil(x.shape[1] / block_size)):
            blk = free.pop()
            tables[i, b] = blk
            chunk = x[:, b * block_size : (b + 1) * block_size]
            cache[blk, :, : chunk.shape[1]] = chunk
    return cache, tables


def _dense(q, k, v, scale):  # type: ignore[no-untyped-def]
    # q: [q_len, heads, dim], k/v: [kv_heads, len, dim]; causal over the last q_len positions
    group = q.shape[1] // k.shape[0]
    k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
    s = torch.einsum("qhd,hkd->hqk", q, k) * scale
    q_len, n = q.shape[0], k.shape[1]
    mask = torch.arange(n)[None, :] > torch.arange(n - q_len, n)[:, None]
    s = s.masked_fill(mask, float("-inf"))
    return torch.einsum("hqk,hkd->qhd", s.softmax(-1), v)


@pytest.mark.parametrize("heads, kv_heads, dim, block", [(6, 2, 16, 16), (9, 3, 8, 8), (4, 4, 32, 16)])
@pytest.mark.parametrize("q_lens", [[1, 1, 1], [5, 1, 17]])
def test_paged_attention_matches_dense(heads, kv_heads, dim, block, q_lens):  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(heads * 100 + dim + len(q_lens) + sum(q_lens))
    seq_lens = [41, 9, 77]
    ks = [torch.randn(kv_heads, n, dim, generator=g) for n in seq_lens]
    vs = [torch.randn(kv_heads, n, dim, generator=g) for n in seq_lens]
    qs = [torch.randn(ql, heads, dim, generator=g) for ql in q_lens]
    k_cache, tables = _paged_cache(ks, block, 40, seed=1)
    v_cache, _ = _paged_cache(vs, block, 40, seed=1)  # same seed: the same block assignment
    qsl = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32)
    out = reference.paged_attention(
        torch.cat(qs), k_cache, v_cache, tables, torch.tensor(seq_lens, dtype=torch.int32), qsl, dim**-0.5
    )
    expected = torch.cat([_dense(q, k, v, dim**-0.5) for q, k, v in zip(qs, ks, vs)])
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_write_kv_skips_padding_slots():  # type: ignore[no-untyped-def]
    k_cache = torch.zeros(4, 2, 8, 4)
    v_cache = torch.zeros(4, 2, 8, 4)
    k = torch.randn(3, 2, 4)
    v = torch.randn(3, 2, 4)
    reference.write_kv(k, v, k_cache, v_cache, torch.tensor([9, -1, 31]))
    torch.testing.assert_close(k_cache[1, :, 1], k[0])
    torch.testing.assert_close(v_cache[3, :, 7], v[2])
    assert k_cache.count_nonzero() == 2 * 2 * 4
