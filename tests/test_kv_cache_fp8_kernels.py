"""FP8 (e4m3fn) KV cache: the Triton kernels against the pure-torch reference through the Triton
interpreter, and the reference's own definition (quantisation, saturation, scales).

The interpreter loads and stores float8e4nv, but its float -> fp8 rounding is wrong (no carry
into the exponent): kernels/interpreter_fix.py (applied by conftest) converts with torch, which
rounds to nearest even as the GPU's cvt.rn does (tests/test_kernels_compile_sm90.py compiles the
kernels for sm_90, and the GPU tests check them on the device); bf16
is left to the GPU tests (the interpreter's bf16 tl.dot is wrong), so the attention kernels
run with fp32 and fp16 queries over fp8 caches.
"""

from __future__ import annotations

import os

import pytest
import torch
import triton
import triton.language as tl
from kv_cache_support import fp8_steps_apart

from pagecast.kernels import reference, rope
from pagecast.kernels.paged_decode_attention import (
    _e4m3_pairs_to_f16,
    _e4m3_words_to_f16,
    _pair_read_to_dims,
    pair_read_dims,
)
from pagecast.kernels.reference import FP8_DTYPE, FP8_MAX, quantize_kv

# --------------------------------------------------------------------------- the reference


def test_quantize_kv_is_fp8_of_x_over_scale_saturated():
    x = torch.tensor([0.0, 0.3, -1.7, 100.0, -2000.0, 5000.0])
    q = quantize_kv(x, FP8_DTYPE, 2.0)
    assert q.dtype == FP8_DTYPE
    # in range: round-to-nearest fp8 of x / 2; out of range: +-448, never NaN
    expected = torch.tensor([0.0, 0.15, -0.85, 50.0, -FP8_MAX, FP8_MAX]).to(FP8_DTYPE)
    assert torch.equal(q.float(), expected.float())
    assert torch.isfinite(q.float()).all()
    # read back as fp8 * scale: within half an fp8 step (2**-4 relative) of x where x is in range
    back = q.float() * 2.0
    torch.testing.assert_close(back[:4], x[:4], atol=0, rtol=2**-4)
    # a half-type cache is a plain cast
    assert torch.equal(quantize_kv(x, torch.float16, 2.0), x.half())


def test_reference_attention_reads_fp8_as_value_times_scale():
    # The fp8 path with scales equals attention over the dequantised cache (fp8 * scale) in fp32.
    g = torch.Generator().manual_seed(0)
    num_blocks, kvh, bs, d = 6, 2, 8, 16
    k = torch.randn(num_blocks, kvh, bs, d, generator=g) * 3
    v = torch.randn(num_blocks, kvh, bs, d, generator=g) * 3
    k_scale, v_scale = 0.7, 1.9
    k8, v8 = quantize_kv(k, FP8_DTYPE, k_scale), quantize_kv(v, FP8_DTYPE, v_scale)
    q = torch.randn(5, 4, d, generator=g)
    tables = torch.tensor([[4, 1, 0], [2, 5, 3]], dtype=torch.int32)
    seq_lens = torch.tensor([19, 3], dtype=torch.int32)
    for qsl in (torch.tensor([0, 4, 5], dtype=torch.int32), None):  # prefill-shaped and decode
        rows = q if qsl is not None else q[:2]
        qsl = qsl if qsl is not None else torch.tensor([0, 1, 2], dtype=torch.int32)
        out = reference.paged_attention(rows, k8, v8, tables, seq_lens, qsl, 0.25, k_scale, v_scale)
        expected = reference.paged_attention(
            rows, k8.float() * k_scale, v8.float() * v_scale, tables, seq_lens, qsl, 0.25
        )
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


# --------------------------------------------------------------------------- the Triton kernels

interpreted = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="CPU kernel tests run under the Triton interpreter"
)


def _paged_fp8_inputs(
    seq_lens, q_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, k_scale, v_scale
):  # type: ignore[no-untyped-def]
    from test_kernels import paged_inputs

    x = paged_inputs(seq_lens, q_lens, num_heads, num_kv_heads, head_dim, block_size, dtype)
    # values spread over the fp8 range (some saturate): the scale is what brings them back
    x["k_cache"] = quantize_kv(x["k_cache"].float() * 40 * k_scale, FP8_DTYPE, k_scale)
    x["v_cache"] = quantize_kv(x["v_cache"].float() * 40 * v_scale, FP8_DTYPE, v_scale)
    return x


TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (3e-3, 1e-2)}


def _assert_matches_reference(out, x, scale, k_scale, v_scale, dtype) -> None:  # type: ignore[no-untyped-def]
    """``out`` equals the torch reference's attention over the same fp8 cache, within TOL[dtype]."""
    expected = reference.paged_attention(
        x["q"], x["k_cache"], x["v_cache"], x["block_tables"], x["seq_lens"], x["query_start_loc"], scale,
        k_scale, v_scale,
    )  # fmt: skip
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(out.float(), expected.float(), atol=atol, rtol=rtol)


PAIRS = {"fp8_words": 2}


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_dim,block_size,seq_lens,config",
    [
        pytest.param(4, 4, 16, 8, [1, 9, 41], {"BLOCK_N": 16, "num_splits": 1}, id="mha-direct"),
        pytest.param(9, 3, 64, 16, [1, 9, 41, 341], {"BLOCK_N": 32, "num_splits": 4}, id="group3-split4"),
        # head_dim 24 pads to 32: the cache is read as fp8 values, not as int32 words
        pytest.param(6, 2, 24, 8, [1, 9, 41], {"BLOCK_N": 16, "num_splits": 2}, id="head-dim-24-byte-path"),
        # the tuner's byte read at a head_dim the word read could take
        pytest.param(
            9, 3, 64, 16, [1, 9, 41, 341], {"BLOCK_N": 32, "num_splits": 4, "fp8_words": 0}, id="config-byte-path"
        ),
        # the pair read (fp8_words 2, the tuner's usual pick): V unpacked by token pairs in the PV dot's column
        # order; odd lengths leave a pair half masked, splits leave tiles empty
        pytest.param(4, 4, 16, 8, [1, 9, 41], dict(PAIRS, BLOCK_N=16, num_splits=1), id="pairs-mha-direct"),
        pytest.param(9, 3, 64, 16, [1, 9, 41, 341], dict(PAIRS, BLOCK_N=32, num_splits=4), id="pairs-split"),
        pytest.param(8, 2, 128, 16, [3, 17, 64, 95], dict(PAIRS, BLOCK_N=64, num_splits=2), id="pairs-d128"),
        pytest.param(6, 2, 32, 1, [5, 33], dict(PAIRS, BLOCK_N=16, num_splits=2), id="pairs-block-size-1"),
        # head_dim 24 is not read as words: the pair read's config falls back to the byte read
        pytest.param(6, 2, 24, 8, [1, 9, 41], dict(PAIRS, BLOCK_N=16, num_splits=2), id="pairs-head-dim-24"),
        # tiles inside one cache block (one block id a tile), by each read
        pytest.param(9, 3, 64, 32, [1, 9, 41, 341], {"BLOCK_N": 16, "num_splits": 4}, id="words-tile-in-block"),
        pytest.param(8, 2, 128, 64, [3, 17, 64, 95], dict(PAIRS, BLOCK_N=32, num_splits=2), id="pairs-tile-in-block"),
        pytest.param(6, 2, 24, 16, [1, 9, 41], {"BLOCK_N": 16, "num_splits": 2}, id="bytes-tile-in-block"),
        # an fp8 cache's largest split count (one long sequence): past the tiles a short context has,
        # most splits read nothing and the merge skips them
        # (one KV head, two sequences: 256 programs in the interpreter)
        pytest.param(2, 1, 32, 16, [2100, 9], dict(PAIRS, BLOCK_N=16, num_splits=128), id="pairs-split128"),
        # the merge in the launch (FP8_MERGE_CONFIGS), at the odd head_dim's padded width too
        pytest.param(8, 2, 128, 16, [3, 17, 64, 95], dict(PAIRS, BLOCK_N=16, num_splits=4, merge=1), id="pairs-merge"),
        pytest.param(6, 2, 24, 8, [1, 9, 41], {"BLOCK_N": 16, "num_splits": 2, "merge": 1}, id="bytes-merge-d24"),
    ],
)
def test_decode_attention_fp8_cache(num_heads, num_kv_heads, head_dim, block_size, seq_lens, config, dtype):  # type: ignore[no-untyped-def]
    from pagecast.kernels.paged_decode_attention import paged_decode_attention

    k_scale, v_scale = 0.013, 0.05
    x = _paged_fp8_inputs(seq_lens, [1] * len(seq_lens), num_heads, num_kv_heads, head_dim, block_size, dtype,
                          k_scale, v_scale)  # fmt: skip
    scale = head_dim**-0.5
    out = paged_decode_attention(
        **x, scale=scale, max_seq_len=max(seq_lens), config=config, k_scale=k_scale, v_scale=v_scale
    )
    _assert_matches_reference(out, x, scale, k_scale, v_scale, dtype)
    assert out.dtype == dtype


@triton.jit
def _unpack_fp8_words(x_ptr, out_ptr, ROWS: tl.constexpr, COLS: tl.constexpr):
    rows = tl.arange(0, ROWS)[:, None]
    words_ptr = x_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
    words = tl.load(words_ptr + rows * (COLS // 4) + tl.arange(0, COLS // 4)[None, :])
    tl.store(out_ptr + rows * COLS + tl.arange(0, COLS)[None, :], _e4m3_words_to_f16(words, False))


@interpreted
def test_decode_unpacks_fp8_words_in_order_and_exactly() -> None:
    """The decode kernel reads an fp8 cache as int32 words: every e4m3 byte, at each of a word's
    four positions, comes back as torch's fp16 of it, in its own column (the interpreter's
    shift-and-convert path; the GPU's inline-PTX path runs in the GPU tests)."""
    codes = torch.arange(256, dtype=torch.uint8)
    for shift in range(4):  # each byte value at every position in its word
        x = torch.roll(codes, shift).view(FP8_DTYPE).reshape(16, 16).contiguous()
        out = torch.empty(16, 16, dtype=torch.float16)
        _unpack_fp8_words[(1,)](x, out, ROWS=16, COLS=16)
        expected = x.to(torch.float16)
        same = (out.view(torch.int16) == expected.view(torch.int16)) | (out.isnan() & expected.isnan())
        assert bool(same.all()), x.view(torch.uint8)[~same]


@triton.jit
def _unpack_fp8_pairs(x_ptr, out_ptr, back_ptr, ROWS: tl.constexpr, COLS: tl.constexpr):
    rows = tl.arange(0, ROWS)[:, None]
    words_ptr = x_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
    words = tl.load(words_ptr + rows * (COLS // 4) + tl.arange(0, COLS // 4)[None, :])
    v = _e4m3_pairs_to_f16(words, False)
    tl.store(out_ptr + rows * COLS + tl.arange(0, COLS)[None, :], v)
    tl.store(back_ptr + rows * COLS + tl.arange(0, COLS)[None, :], _pair_read_to_dims(v))


@interpreted
@pytest.mark.parametrize("cols", [16, 128])
def test_decode_pair_read_unpacks_v_in_the_dot_column_order(cols: int) -> None:
    """The pair read's unpacking (the interpreter's path; the GPU's prmt + cvt path runs in the GPU
    tests): row n is token n, column c head dim pair_read_dims[c], every e4m3 code exact, and
    _pair_read_to_dims (applied to the PV accumulator) puts the columns back in head-dim order."""
    codes = torch.arange(256, dtype=torch.uint8)
    dims = torch.tensor(pair_read_dims(cols))
    assert sorted(dims.tolist()) == list(range(cols))
    rows = 256 * 4 // cols
    for shift in range(4):  # each byte value at every position in its word
        x = torch.roll(codes.repeat(4), shift).view(FP8_DTYPE).reshape(rows, cols).contiguous()
        out = torch.empty(rows, cols, dtype=torch.float16)
        back = torch.empty(rows, cols, dtype=torch.float16)
        _unpack_fp8_pairs[(1,)](x, out, back, ROWS=rows, COLS=cols)
        for got, expected in ((out, x.to(torch.float16)[:, dims]), (back, x.to(torch.float16))):
            same = (got.view(torch.int16) == expected.view(torch.int16)) | (got.isnan() & expected.isnan())
            assert bool(same.all()), x.view(torch.uint8)[~same]


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_dim,block_size,seq_lens,q_lens,config",
    [
        pytest.param(4, 4, 16, 8, [9, 41, 17], [9, 41, 17], {"BLOCK_M": 16, "BLOCK_N": 16}, id="mha-prefill"),
        pytest.param(
            9, 3, 64, 16, [50, 41, 9], [7, 1, 9], {"BLOCK_M": 32, "BLOCK_N": 16}, id="group3-prefix-mixed"
        ),
    ],
)
def test_prefill_attention_fp8_cache(
    num_heads, num_kv_heads, head_dim, block_size, seq_lens, q_lens, config, dtype
):  # type: ignore[no-untyped-def]
    from pagecast.kernels.paged_prefill_attention import paged_prefill_attention

    k_scale, v_scale = 0.02, 0.3
    x = _paged_fp8_inputs(
        seq_lens, q_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, k_scale, v_scale
    )
    scale = head_dim**-0.5
    out = paged_prefill_attention(**x, scale=scale, config=config, k_scale=k_scale, v_scale=v_scale)
    _assert_matches_reference(out, x, scale, k_scale, v_scale, dtype)


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_attention_sinks_over_an_fp8_cache(dtype):  # type: ignore[no-untyped-def]
    """gpt-oss's sinks with an fp8 cache: the V scale multiplies the sink-normalised output in the
    decode kernel's direct path, its merge (pair read, split) and the prefill kernel."""
    from pagecast.kernels.paged_decode_attention import paged_decode_attention
    from pagecast.kernels.paged_prefill_attention import paged_prefill_attention

    k_scale, v_scale = 0.013, 0.05
    sinks = torch.tensor([6.0, -3.0, 0.5, 8.0, -8.0, 1.0, 2.0, 0.0])

    def expected(x, scale):  # type: ignore[no-untyped-def]
        return reference.paged_attention(
            x["q"], x["k_cache"], x["v_cache"], x["block_tables"], x["seq_lens"], x["query_start_loc"], scale,
            k_scale, v_scale, sinks=sinks,
        )  # fmt: skip

    atol, rtol = TOL[dtype]
    x = _paged_fp8_inputs([1, 41, 341], [1, 1, 1], 8, 2, 32, 16, dtype, k_scale, v_scale)
    for config in ({"BLOCK_N": 16, "num_splits": 1}, dict(PAIRS, BLOCK_N=32, num_splits=4)):
        out = paged_decode_attention(
            **x, scale=0.2, max_seq_len=341, config=config, k_scale=k_scale, v_scale=v_scale, sinks=sinks
        )
        torch.testing.assert_close(out.float(), expected(x, 0.2).float(), atol=atol, rtol=rtol)
    x = _paged_fp8_inputs([50, 9], [20, 9], 8, 2, 32, 16, dtype, k_scale, v_scale)
    out = paged_prefill_attention(
        **x, scale=0.2, config={"BLOCK_M": 16, "BLOCK_N": 16}, k_scale=k_scale, v_scale=v_scale, sinks=sinks
    )
    torch.testing.assert_close(out.float(), expected(x, 0.2).float(), atol=atol, rtol=rtol)


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("k_scale,v_scale", [(1.0, 1.0), (0.02, 0.37)])
def test_rotary_writes_fp8_cache(dtype, k_scale, v_scale):  # type: ignore[no-untyped-def]
    from pagecast.kernels.rotary_kv import rotary_and_write_kv

    num_tokens, num_heads, num_kv_heads, head_dim, block_size = 7, 6, 2, 16, 8
    g = torch.Generator().manual_seed(1)
    cos_sin = rope.cos_sin_cache({"rope_type": "default", "rope_theta": 10000.0}, head_dim, 64)
    positions = torch.randint(0, 64, (num_tokens,), generator=g)
    # values up to ~100x the scale: many saturate at 448 when the scale is small
    qkv = (torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=g) * 6).to(dtype)
    q = qkv[:, : num_heads * head_dim].view(num_tokens, num_heads, head_dim)
    k = qkv[:, num_heads * head_dim : (num_heads + num_kv_heads) * head_dim].view(
        num_tokens, num_kv_heads, head_dim
    )
    v = qkv[:, (num_heads + num_kv_heads) * head_dim :].view(num_tokens, num_kv_heads, head_dim)
    slots = torch.tensor([3, 9, -1, 0, 17, 30, -1])
    k_cache = quantize_kv(torch.randn(5, num_kv_heads, block_size, head_dim, generator=g), FP8_DTYPE)
    v_cache = quantize_kv(torch.randn(5, num_kv_heads, block_size, head_dim, generator=g), FP8_DTYPE)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    q_ref = reference.rotary_and_write_kv(positions, q, k, v, cos_sin, k_ref, v_ref, slots, k_scale, v_scale)
    q_out = rotary_and_write_kv(
        positions, q, k, v, cos_sin, k_cache, v_cache, slots, k_scale=k_scale, v_scale=v_scale
    )
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(q_out.float(), q_ref.float(), atol=atol, rtol=rtol)
    assert k_cache.dtype == v_cache.dtype == FP8_DTYPE
    assert torch.isfinite(k_cache.float()).all() and torch.isfinite(v_cache.float()).all()
    # V is a scaled copy: the same fp8 codes. K went through the rotation, which the kernel
    # computes in fp32 and the reference in q's dtype: in fp32 at most one fp8 code apart, and
    # rarely; in fp16 the reference's own rounding (2**-11 of |k|) can move a small value by a
    # few codes, so the dequantised values are compared within that plus one fp8 step.
    assert torch.equal(v_cache.view(torch.uint8), v_ref.view(torch.uint8))
    if dtype == torch.float32:
        steps = fp8_steps_apart(k_cache, k_ref)
        assert int(steps.max()) <= 1
        assert float((steps > 0).float().mean()) < 0.005
    else:
        torch.testing.assert_close(
            k_cache.float() * k_scale, k_ref.float() * k_scale, rtol=2**-3, atol=float(k.abs().max()) * 2**-9
        )
    if k_scale < 1.0:
        assert (k_cache.float().abs() == FP8_MAX).any()  # the saturating case was exercised


# --------------------------------------------------------------------------- tuning problems


def test_tuning_problems_use_the_kv_cache_dtype():
    """The tuner times the attention kernels and the KV write on caches of the artifact's KV dtype,
    and the report's bandwidth counts fp8 bytes: half a bf16 cache's."""
    from pagecast.kernels import problems, tuning

    half = tuning.ModelShapes(32, 8, 128, 4096, 14336, 16, "bfloat16", 8192, 256)
    fp8 = tuning.ModelShapes(
        32, 8, 128, 4096, 14336, 16, "bfloat16", 8192, 256, kv_cache_dtype="float8_e4m3fn"
    )
    assert fp8.kv_torch_dtype == FP8_DTYPE and half.kv_torch_dtype == torch.bfloat16
    dims = {"num_seqs": 64, "max_seq_len": 2048}
    kv = 64 * 2048 * 2 * 8 * 128
    assert problems.problem_size("paged_decode_attention", fp8, dims)[0] == kv + 2 * 64 * 32 * 128 * 2
    assert problems.problem_size("paged_decode_attention", half, dims)[0] == 2 * kv + 2 * 64 * 32 * 128 * 2
    assert problems.kv_bytes(fp8, dims) * 2 == problems.kv_bytes(half, dims)
    # an fp8 cache's decode tuning times the pair, word and byte reads; a bf16 one none of them
    reads = {c.params.get("fp8_words", 1) for c in problems.config_space("paged_decode_attention", fp8, dims)}
    assert reads == {0, 1, 2}
    assert all("fp8_words" not in c.params for c in problems.config_space("paged_decode_attention", half, dims))
    x = problems.decode_inputs(
        tuning.ModelShapes(4, 2, 16, 64, 128, 8, "float32", kv_cache_dtype="float8_e4m3fn"), 2, 40, "cpu"
    )
    assert x["k_cache"].dtype == x["v_cache"].dtype == FP8_DTYPE and x["q"].dtype == torch.float32
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        tuning.ModelShapes(32, 8, 128, 4096, 14336, 16, "bfloat16", kv_cache_dtype="float16")


# --------------------------------------------------------------------------- the fp16 stage (STAGE)


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    "block_size,config",
    [
        pytest.param(16, {"BLOCK_M": 32, "BLOCK_N": 16}, id="block16"),
        pytest.param(32, {"BLOCK_M": 32, "BLOCK_N": 16, "HEAVY_FIRST": 1, "PREFETCH_BLOCKS": 1}, id="tile-in-block"),
    ],
)
def test_prefill_over_the_stage_is_the_direct_read(monkeypatch, block_size, config, dtype):  # type: ignore[no-untyped-def]
    """STAGE converts one sequence's fp8 blocks into a stage once, then runs the tile over it: the
    same values and the same dots as the tile reading the fp8 cache, so the same bits, and the
    reference's attention. A batch of two sequences is not staged (the tile reads the cache)."""
    from pagecast.kernels import paged_prefill_attention as m

    staged = []
    stage_cache = m.stage_cache
    monkeypatch.setattr(m, "stage_cache", lambda *a: staged.append(a[2].shape) or stage_cache(*a))
    k_scale, v_scale = 0.02, 0.3
    scale = 64**-0.5
    # one sequence: a 200-token prefix, 41 new tokens (chunked prefill at a long context)
    x = _paged_fp8_inputs([241], [41], 9, 3, 64, block_size, dtype, k_scale, v_scale)
    direct = m.paged_prefill_attention(**x, scale=scale, config=config, k_scale=k_scale, v_scale=v_scale)
    out = m.paged_prefill_attention(**x, scale=scale, config={**config, "STAGE": 1}, k_scale=k_scale, v_scale=v_scale)
    assert staged == [x["block_tables"].shape]
    assert torch.equal(out, direct)
    _assert_matches_reference(out, x, scale, k_scale, v_scale, dtype)
    # two sequences: the same tile over the cache
    x = _paged_fp8_inputs([241, 50], [41, 7], 9, 3, 64, block_size, dtype, k_scale, v_scale)
    out = m.paged_prefill_attention(**x, scale=scale, config={**config, "STAGE": 1}, k_scale=k_scale, v_scale=v_scale)
    assert len(staged) == 1
    _assert_matches_reference(out, x, scale, k_scale, v_scale, dtype)


@interpreted
def test_stage_holds_each_sequences_blocks_in_order():  # type: ignore[no-untyped-def]
    """stage_cache: row s * max_blocks + j of the stage is sequence s's j-th block, converted
    exactly (every e4m3 value is an fp16 value), for each block the sequence has."""
    from pagecast.kernels.paged_prefill_attention import stage_cache, stage_dtype

    x = _paged_fp8_inputs([70, 9], [70, 9], 4, 2, 24, 16, torch.float16, 0.5, 0.5)
    k_stage, v_stage, table = stage_cache(
        x["k_cache"], x["v_cache"], x["block_tables"], x["seq_lens"], stage_dtype(torch.bfloat16)
    )
    num_seqs, max_blocks = x["block_tables"].shape
    assert k_stage.dtype == torch.float16 and k_stage.shape == (num_seqs * max_blocks, 2, 16, 24)
    assert torch.equal(table, torch.arange(num_seqs * max_blocks, dtype=torch.int32).view(num_seqs, max_blocks))
    for s, n in enumerate([70, 9]):
        for j in range(-(-n // 16)):
            block = int(x["block_tables"][s, j])
            row = s * max_blocks + j
            assert torch.equal(k_stage[row], x["k_cache"][block].to(torch.float16))
            assert torch.equal(v_stage[row], x["v_cache"][block].to(torch.float16))


def test_stage_is_timed_at_long_contexts_of_an_fp8_cache_and_counted_in_the_plan():
    """The tuner offers STAGE only in an fp8 cache's long-context prefill buckets, and the memory plan
    of an fp8-KV artifact with such buckets reserves one sequence's stage at max_model_len."""
    from pagecast.builder.plan import prefill_stage_bytes
    from pagecast.kernels import problems, tuning

    def shapes(kv: str, max_model_len: int) -> tuning.ModelShapes:
        return tuning.ModelShapes(
            32, 8, 128, 4096, 14336, 16, "bfloat16", max_model_len, 256, kv_cache_dtype=kv
        )

    def staged(s: tuning.ModelShapes) -> dict[str, bool]:
        return {
            b: any(c.params.get("STAGE") for c in problems.config_space("paged_prefill_attention", s, d))
            for b, d in problems.buckets("paged_prefill_attention", s)
        }

    fp8 = staged(shapes("float8_e4m3fn", 131072))
    assert fp8["t8192.c131072"] and fp8["t2048.c32768"] and not fp8["t8192"]
    assert not any(staged(shapes("bfloat16", 131072)).values())

    class Attention:
        num_kv_heads, head_dim = 8, 128

    class Model:
        attention = Attention()

    # K and V of 131,072 tokens x 8 heads x 128 in fp16, on one rank; half on each of two
    assert prefill_stage_bytes(Model(), "bfloat16", "float8_e4m3fn", 16, 131072, 1) == 2 * 131072 * 8 * 128 * 2
    assert prefill_stage_bytes(Model(), "bfloat16", "float8_e4m3fn", 16, 131072, 2) == 131072 * 8 * 128 * 2
    assert prefill_stage_bytes(Model(), "bfloat16", "bfloat16", 16, 131072, 1) == 0
    assert prefill_stage_bytes(Model(), "bfloat16", "float8_e4m3fn", 16, 8192, 1) == 0
