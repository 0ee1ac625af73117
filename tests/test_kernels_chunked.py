"""Chunked attention (Llama 4's chunked layers) in both paged attention kernels, against the torch
reference (the Triton interpreter without a GPU).

A query at position p sees the keys of its own chunk only: p // chunk * chunk <= k <= p, as
transformers' chunked causal mask has it. The reference is checked against that definition written
out (test_kernels_window_softcap.dense); the cases put chunk boundaries inside a query tile, between the kernels' key tiles, in a
cached prefix, and at a query that starts a chunk (it sees itself alone).
"""

from __future__ import annotations

import pytest
import torch
from test_kernels import close, paged_inputs
from test_kernels_window_softcap import dense

from pagecast.kernels import ops, reference
from pagecast.kernels.paged_decode_attention import paged_decode_attention
from pagecast.kernels.paged_prefill_attention import paged_prefill_attention


def ref(x: dict, scale: float, chunk: int) -> torch.Tensor:
    return reference.paged_attention(
        x["q"], x["k_cache"], x["v_cache"], x["block_tables"], x["seq_lens"], x["query_start_loc"], scale,
        chunk=chunk,
    )  # fmt: skip


@pytest.mark.parametrize("chunk", [4, 16, 23])
def test_reference_is_the_definition(chunk):
    x = paged_inputs([9, 41, 30], [9, 13, 1], 4, 2, 16, 8, torch.float32)
    torch.testing.assert_close(ref(x, 0.3, chunk), dense(x, 0.3, 0.0, 0, chunk), atol=1e-5, rtol=1e-5)
    decode = paged_inputs([9, 41, 32, 33], [1, 1, 1, 1], 4, 2, 16, 8, torch.float32)
    torch.testing.assert_close(ref(decode, 0.3, chunk), dense(decode, 0.3, 0.0, 0, chunk), atol=1e-5, rtol=1e-5)
    # the chunks change the result, so the kernel checks below cannot pass without them
    assert (ref(x, 0.3, chunk) - ref(x, 0.3, 0)).abs().max() > 1e-2


DECODE_CASES = [
    # (num_heads, num_kv_heads, head_dim, block_size, seq_lens, config, chunk)
    pytest.param(4, 4, 16, 8, [1, 9, 41, 17], {"BLOCK_N": 16, "num_splits": 1}, 8, id="direct"),
    pytest.param(9, 3, 64, 16, [1, 33, 64, 65, 341], {"BLOCK_N": 32, "num_splits": 4}, 32, id="group3-split4"),
    pytest.param(8, 2, 16, 8, [341, 9, 100, 129], {"BLOCK_N": 16, "num_splits": 8}, 128, id="group4-split8"),
    pytest.param(6, 2, 24, 8, [341, 64, 65], {"BLOCK_N": 32, "num_splits": 2, "merge": 1}, 20, id="odd-merge"),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,block_size,seq_lens,config,chunk", DECODE_CASES)
def test_decode_chunked(num_heads, num_kv_heads, head_dim, block_size, seq_lens, config, chunk, dtype):  # type: ignore[no-untyped-def]
    x = paged_inputs(seq_lens, [1] * len(seq_lens), num_heads, num_kv_heads, head_dim, block_size, dtype)
    scale = head_dim**-0.5
    out = paged_decode_attention(**x, scale=scale, max_seq_len=max(seq_lens), config=config, chunk=chunk)
    close(out, ref(x, scale, chunk), dtype)


PREFILL_CASES = [
    # (num_heads, num_kv_heads, head_dim, block_size, seq_lens, q_lens, config, chunk)
    pytest.param(4, 4, 16, 8, [9, 41, 17], [9, 41, 17], {"BLOCK_M": 16, "BLOCK_N": 16}, 8, id="mha"),
    pytest.param(9, 3, 64, 16, [50, 41, 9], [7, 1, 9], {"BLOCK_M": 32, "BLOCK_N": 16}, 5, id="group3-prefix"),
    pytest.param(8, 2, 16, 8, [1, 90, 33], [1, 37, 20], {"BLOCK_M": 16, "BLOCK_N": 32}, 19, id="group4-cached"),
    pytest.param(6, 2, 24, 8, [130, 70], [100, 70], {"BLOCK_M": 32, "BLOCK_N": 16}, 64, id="odd-long"),
    pytest.param(4, 2, 16, 8, [200], [200], {"BLOCK_M": 64, "BLOCK_N": 16}, 48, id="tile-spans-chunks"),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,block_size,seq_lens,q_lens,config,chunk", PREFILL_CASES)
def test_prefill_chunked(num_heads, num_kv_heads, head_dim, block_size, seq_lens, q_lens, config, chunk, dtype):  # type: ignore[no-untyped-def]
    x = paged_inputs(seq_lens, q_lens, num_heads, num_kv_heads, head_dim, block_size, dtype)
    scale = head_dim**-0.5
    out = paged_prefill_attention(**x, scale=scale, config=config, chunk=chunk)
    close(out, ref(x, scale, chunk), dtype)


def test_ops_pass_the_chunk_to_both_kernels(monkeypatch):
    """A mixed step split between the kernels gives each the layer's chunk."""
    monkeypatch.setattr(ops, "_triton", lambda x: True)
    seq_lens = [5 + i % 30 for i in range(64)] + [40, 9]
    x = paged_inputs(seq_lens, [1] * 64 + [40, 9], 4, 2, 16, 8, torch.float32)
    out = ops.paged_attention(**x, scale=0.2, max_query_len=40, max_seq_len=40, num_decodes=64, chunk=12)
    close(out, ref(x, 0.2, 12), torch.float32)


def test_a_window_and_a_chunk_together_are_refused():
    x = paged_inputs([9], [1], 4, 2, 16, 8, torch.float32)
    with pytest.raises(ValueError, match="not both"):
        paged_decode_attention(**x, scale=0.2, max_seq_len=9, window=4, chunk=8)
    with pytest.raises(ValueError, match="not both"):
        paged_prefill_attention(**x, scale=0.2, window=4, chunk=8)


def test_chunked_variants_are_compiled_at_every_config(monkeypatch):
    """compile_window_variants launches both attention kernels with the model's chunk (the CHUNKED
    constexpr variant) at each config serving can pick, as it does the sliding ones, so that an
    artifact of a chunked model compiles nothing while serving."""
    from pagecast.kernels import paged_decode_attention as decode_module
    from pagecast.kernels import paged_prefill_attention as prefill_module
    from pagecast.kernels import tuning

    seen: list[tuple[str, int, int]] = []
    for module, name in ((decode_module, "paged_decode_attention"), (prefill_module, "paged_prefill_attention")):

        def record(*a, window=0, chunk=0, config=None, _n=name, **k):  # type: ignore[no-untyped-def]
            seen.append((_n, window, chunk))

        monkeypatch.setattr(module, name, record)
    table = {"kernels": {"paged_decode_attention": {"1x512": {"config": {"BLOCK_N": 32, "num_splits": 1}}}}}
    shapes = tuning.ModelShapes(4, 2, 16, 64, 128, 8, "float32", 2048, 32, attn_chunk=256)
    launches = tuning.compile_window_variants(table, shapes, "cpu")
    assert launches == len(seen) > 0
    assert {(w, c) for _, w, c in seen} == {(0, 256)}
    assert {n for n, _, _ in seen} == {"paged_decode_attention", "paged_prefill_attention"}
    seen.clear()
    both = tuning.ModelShapes(4, 2, 16, 64, 128, 8, "float32", 2048, 32, attn_window=64, attn_chunk=256)
    assert tuning.compile_window_variants(table, both, "cpu") == 2 * launches
    assert {(w, c) for _, w, c in seen} == {(64, 0), (0, 256)}
