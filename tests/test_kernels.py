"""Triton kernels against their pure-torch references, on the CPU through the Triton interpreter.

Shapes are tiny and odd on purpose (group sizes 1/3/4, seq_lens that are not multiples of
the block size, several sequences of different lengths in one launch, cached prefixes,
slot -1). bf16 is checked on the GPU only (tests/test_kernels_gpu.py): the interpreter's
bf16 tl.dot is wrong.
"""

from __future__ import annotations

import functools
import json
import os
import types

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="CPU kernel tests run under the Triton interpreter"
)

triton = pytest.importorskip("triton")

from pagecast.kernels import ops, reference, rope, tuning
from pagecast.kernels.activation import silu_and_mul
from pagecast.kernels.paged_decode_attention import paged_decode_attention
from pagecast.kernels.paged_prefill_attention import paged_prefill_attention
from pagecast.kernels.rms_norm import fused_add_rms_norm, rms_norm
from pagecast.kernels.rotary_kv import rotary_and_write_kv
from pagecast.kernels.skinny_gemm import skinny_gemm

TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 1e-2)}


def close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(actual.float(), expected.float(), atol=atol, rtol=rtol)


def paged_inputs(
    seq_lens: list[int], q_lens: list[int], num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
    dtype: torch.dtype, seed: int = 0,
) -> dict:  # fmt: skip
    """Random caches with each sequence's blocks scattered through a pool, plus spare columns in the table."""
    g = torch.Generator().manual_seed(seed)
    blocks = [-(-s // block_size) for s in seq_lens]
    pool = sum(blocks) + 3
    k_cache = torch.randn(pool, num_kv_heads, block_size, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(pool, num_kv_heads, block_size, head_dim, generator=g).to(dtype)
    perm = torch.randperm(pool, generator=g)
    table = torch.full((len(seq_lens), max(blocks) + 2), 7, dtype=torch.int32)  # junk past the end
    used = 0
    for i, n in enumerate(blocks):
        table[i, :n] = perm[used : used + n]
        used += n
    qsl = torch.tensor([0, *np.cumsum(q_lens).tolist()], dtype=torch.int32)
    q = torch.randn(int(qsl[-1]), num_heads, head_dim, generator=g).to(dtype)
    return {
        "q": q, "k_cache": k_cache, "v_cache": v_cache, "block_tables": table,
        "seq_lens": torch.tensor(seq_lens, dtype=torch.int32), "query_start_loc": qsl,
    }  # fmt: skip


def ref_attention(x: dict, scale: float) -> torch.Tensor:
    return reference.paged_attention(
        x["q"], x["k_cache"], x["v_cache"], x["block_tables"], x["seq_lens"], x["query_start_loc"], scale
    )


# ---------------------------------------------------------------------------- decode attention

DECODE_CASES = [
    # (num_heads, num_kv_heads, head_dim, block_size, seq_lens, config)
    pytest.param(4, 4, 16, 8, [1, 9, 41], {"BLOCK_N": 16, "num_splits": 1}, id="mha-direct"),
    pytest.param(9, 3, 64, 16, [1, 9, 41, 341], {"BLOCK_N": 32, "num_splits": 4}, id="group3-split4"),
    pytest.param(8, 2, 16, 8, [341, 9], {"BLOCK_N": 16, "num_splits": 8}, id="group4-split8"),
    # a 16-key tile is one 32-token block's first or second half: one block id a tile
    pytest.param(8, 2, 16, 32, [1, 9, 41, 341], {"BLOCK_N": 16, "num_splits": 4}, id="tile-in-one-block"),
    # the last split of each sequence and KV head merges in the same launch (an empty split too:
    # 41 tokens in 16-token tiles give the fourth split nothing)
    pytest.param(9, 3, 64, 16, [1, 9, 41, 341], {"BLOCK_N": 16, "num_splits": 4, "merge": 1}, id="merge-in-launch"),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,block_size,seq_lens,config", DECODE_CASES)
def test_decode_attention(num_heads, num_kv_heads, head_dim, block_size, seq_lens, config, dtype):
    x = paged_inputs(seq_lens, [1] * len(seq_lens), num_heads, num_kv_heads, head_dim, block_size, dtype)
    scale = head_dim**-0.5
    out = paged_decode_attention(**x, scale=scale, max_seq_len=max(seq_lens), config=config)
    close(out, ref_attention(x, scale), dtype)


def test_decode_attention_skips_slots_without_a_query():
    # A padded batch slot (query length 0) writes nothing; the other rows are unaffected.
    x = paged_inputs([9, 41, 17], [1, 0, 1], 4, 2, 16, 8, torch.float32)
    poison = torch.full_like(x["q"], float("nan"))
    out = paged_decode_attention(
        **x, scale=0.25, max_seq_len=41, config={"BLOCK_N": 16, "num_splits": 2}, out=poison
    )
    close(out, ref_attention(x, 0.25), torch.float32)


def test_decode_attention_merged_in_launch_leaves_its_counters_at_zero():
    # The in-launch merge's tickets reset themselves: two launches in a row (as graph replays run)
    # both merge, a padded slot (no query) takes no ticket, and every counter is 0 afterwards.
    from pagecast.kernels import split_k

    x = paged_inputs([9, 41, 17], [1, 0, 1], 8, 2, 16, 8, torch.float32)
    cfg = {"BLOCK_N": 8, "num_splits": 3, "merge": 1}
    for _ in range(2):
        poison = torch.full_like(x["q"], float("nan"))
        out = paged_decode_attention(**x, scale=0.25, max_seq_len=41, config=cfg, out=poison)
        close(out, ref_attention(x, 0.25), torch.float32)
    assert int(split_k.COUNTERS[torch.device("cpu")].abs().sum()) == 0


def test_decode_attention_default_config():
    x = paged_inputs([5, 70], [1, 1], 4, 1, 16, 16, torch.float32)
    close(paged_decode_attention(**x, scale=0.3, max_seq_len=70), ref_attention(x, 0.3), torch.float32)


# ---------------------------------------------------------------------------- prefill attention

PREFILL_CASES = [
    # (num_heads, num_kv_heads, head_dim, block_size, seq_lens, q_lens, config)
    pytest.param(4, 4, 16, 8, [9, 41, 17], [9, 41, 17], {"BLOCK_M": 16, "BLOCK_N": 16}, id="mha-prefill"),
    pytest.param(
        9, 3, 64, 16, [50, 41, 9], [7, 1, 9], {"BLOCK_M": 32, "BLOCK_N": 16}, id="group3-prefix-mixed"
    ),
    pytest.param(8, 2, 16, 8, [1, 90, 33], [1, 37, 20], {"BLOCK_M": 16, "BLOCK_N": 32}, id="group4-chunked"),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,block_size,seq_lens,q_lens,config", PREFILL_CASES)
def test_prefill_attention(num_heads, num_kv_heads, head_dim, block_size, seq_lens, q_lens, config, dtype):
    x = paged_inputs(seq_lens, q_lens, num_heads, num_kv_heads, head_dim, block_size, dtype)
    scale = head_dim**-0.5
    out = paged_prefill_attention(**x, scale=scale, config=config)
    close(out, ref_attention(x, scale), dtype)


def test_prefill_attention_empty_query_and_default_config():
    x = paged_inputs([12, 30, 5], [4, 0, 5], 6, 2, 16, 8, torch.float32)
    poison = torch.full_like(x["q"], float("nan"))
    close(paged_prefill_attention(**x, scale=0.2, out=poison), ref_attention(x, 0.2), torch.float32)


# ---------------------------------------------------------------------------- rotary + KV write


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rotary_dim,rope_type,qk_norm", [(16, "default", False), (8, "llama3", False),
                                                          (16, "default", True), (8, "llama3", True),
                                                          (16, "default", "after"), (8, "llama3", "after")])  # fmt: skip
def test_rotary_and_write_kv(dtype, rotary_dim, rope_type, qk_norm):
    """Rotary on q and k and the K/V write, against the reference; with q/k norms (Qwen3's and
    Gemma 3's per-head RMSNorm, fused into the same launch) against rms_norm on each head first,
    partial rotary included (the unrotated features are normalised too); "after": HunYuan's, on
    each head once rotated, the cached k normalised too."""
    num_tokens, num_heads, num_kv_heads, head_dim, block_size = 7, 6, 2, 16, 8
    g = torch.Generator().manual_seed(1)
    params = {"rope_type": rope_type, "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 16}  # fmt: skip
    cos_sin = rope.cos_sin_cache(params, rotary_dim, 64)
    positions = torch.randint(0, 64, (num_tokens,), generator=g)
    # q, k, v as views of one fused qkv projection (strided, as the model passes them)
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=g).to(dtype)
    q = qkv[:, : num_heads * head_dim].view(num_tokens, num_heads, head_dim)
    k = qkv[:, num_heads * head_dim : (num_heads + num_kv_heads) * head_dim].view(
        num_tokens, num_kv_heads, head_dim
    )
    v = qkv[:, (num_heads + num_kv_heads) * head_dim :].view(num_tokens, num_kv_heads, head_dim)
    slots = torch.tensor([3, 9, -1, 0, 17, 30, -1])
    k_cache = torch.randn(5, num_kv_heads, block_size, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(5, num_kv_heads, block_size, head_dim, generator=g).to(dtype)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    norms = {}
    q_in, k_in = q, k
    if qk_norm:
        norms = {"q_norm": (1 + 0.3 * torch.randn(head_dim, generator=g)).to(dtype),
                 "k_norm": (1 + 0.3 * torch.randn(head_dim, generator=g)).to(dtype), "qk_norm_eps": 1e-6}  # fmt: skip
        if qk_norm != "after":
            q_in = reference.rms_norm(q, norms["q_norm"], 1e-6)
            k_in = reference.rms_norm(k, norms["k_norm"], 1e-6)
        # the scale must matter: rows far from unit RMS
        assert (q.float().pow(2).mean(-1) - 1).abs().max() > 0.2
    if qk_norm == "after":
        norms["qk_norm_after"] = True
        q_rot, k_rot = reference.rotary_embedding(positions, q, k, cos_sin)
        q_ref = reference.rms_norm(q_rot, norms["q_norm"], 1e-6)
        reference.write_kv(reference.rms_norm(k_rot, norms["k_norm"], 1e-6), v, k_ref, v_ref, slots)
    else:
        q_ref = reference.rotary_and_write_kv(positions, q_in, k_in, v, cos_sin, k_ref, v_ref, slots)
    q_out = rotary_and_write_kv(positions, q, k, v, cos_sin, k_cache, v_cache, slots, **norms)
    close(q_out, q_ref, dtype)
    close(k_cache, k_ref, dtype)  # slot -1 rows untouched: the random cache contents must still match
    torch.testing.assert_close(v_cache, v_ref, atol=0, rtol=0)


# ---------------------------------------------------------------------------- norms and activation


@pytest.mark.parametrize("dtype,weight_dtype", [(torch.float32, torch.float32), (torch.float16, torch.float16),
                                                (torch.float16, torch.float32)])  # fmt: skip
@pytest.mark.parametrize("hidden", [40, 576])
def test_rms_norm(dtype, weight_dtype, hidden):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(5, hidden, generator=g).to(dtype)
    residual = torch.randn(5, hidden, generator=g).to(dtype)
    w = torch.randn(hidden, generator=g).to(weight_dtype)
    out = rms_norm(x, w, 1e-6)
    expected = reference.rms_norm(x, w, 1e-6)
    assert out.dtype == expected.dtype
    close(out, expected, dtype)
    out, new_residual = fused_add_rms_norm(x, residual, w, 1e-6)
    expected, expected_residual = reference.fused_add_rms_norm(x, residual, w, 1e-6)
    assert out.dtype == expected.dtype and new_residual.dtype == expected_residual.dtype
    close(out, expected, dtype)
    torch.testing.assert_close(new_residual, expected_residual, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("d,config", [(40, {"BLOCK": 16, "num_warps": 1}), (100, None)])
def test_silu_and_mul(dtype, d, config):
    x = torch.randn(3, 2 * d, generator=torch.Generator().manual_seed(3)).to(dtype)
    close(silu_and_mul(x, config), reference.silu_and_mul(x), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows", [1, 3, 16])
@pytest.mark.parametrize("n,k,bias", [(40, 64, False), (48, 96, True)])
def test_skinny_gemm(dtype, rows, n, k, bias):
    g = torch.Generator().manual_seed(rows * n)
    x = torch.randn(rows, k, generator=g).to(dtype)
    w = (torch.randn(n, k, generator=g) * k**-0.5).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    config = {"BLOCK_N": 16, "BLOCK_K": 32, "num_warps": 4, "num_stages": 2}
    out = skinny_gemm(x, w, b, config)
    assert out.shape == (rows, n) and out.dtype == dtype
    close(out, torch.nn.functional.linear(x.float(), w.float(), None if b is None else b.float()).to(dtype), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows", [1, 5])
@pytest.mark.parametrize("split,k", [(2, 128), (3, 160), (4, 96), (8, 64)])
def test_skinny_gemm_split_k_sums_the_splits_in_the_launch(dtype, rows, split, k):
    """K split over programs per column block, the last one of each adding the partials: the same
    product as unsplit (and as F.linear), with the bias once; splits that would get no K step are
    not launched (k 96 at BLOCK_K 16 is 6 steps: 4 splits become 3 of 2); the counters end at 0."""
    from pagecast.kernels import split_k

    g = torch.Generator().manual_seed(rows * k + split)
    n = 40
    x = torch.randn(rows, k, generator=g).to(dtype)
    w = (torch.randn(n, k, generator=g) * k**-0.5).to(dtype)
    b = torch.randn(n, generator=g).to(dtype)
    config = {"BLOCK_N": 16, "BLOCK_K": 16, "SPLIT_K": split, "num_warps": 4, "num_stages": 2}
    out = skinny_gemm(x, w, b, config)
    expected = torch.nn.functional.linear(x.float(), w.float(), b.float()).to(dtype)
    close(out, expected, dtype)
    unsplit = skinny_gemm(x, w, b, {"BLOCK_N": 16, "BLOCK_K": 16, "num_warps": 4, "num_stages": 2})
    close(out, unsplit, dtype)
    assert int(split_k.counters(x.device, 4, "test").abs().sum()) == 0


def test_skinny_gemm_split_configs_are_kept_for_narrow_projections_only():
    from pagecast.kernels import skinny_gemm as sg

    def splits(n, k):
        return {sg.split_of(c) for c in sg.prune_configs(sg.CONFIG_SPACE, n, k)}

    # Qwen3-30B-A3B's o (N 2048, K 4096): 128 column blocks of 16, split up to 8
    assert splits(2048, 4096) >= {1, 2, 4, 8}
    # Llama-3-8B's gate_up (N 28672): a program a multiprocessor many times over without splitting
    assert splits(28672, 4096) == {1}
    # every split gets two K steps or more: K 1024 is 8 steps of 128, so four splits at most
    assert max(splits(2048, 1024)) == 4


def test_skinny_gemm_falls_back_to_torch():
    x, w = torch.randn(2, 48), torch.randn(24, 48)
    expected = torch.nn.functional.linear(x, w)
    # torch chosen by the table, no config, a K the tile does not divide, too many rows
    for config in ({"torch": 1}, None, {"BLOCK_N": 16, "BLOCK_K": 32}):
        torch.testing.assert_close(skinny_gemm(x, w, None, config), expected)
    big = torch.randn(17, 48)
    torch.testing.assert_close(skinny_gemm(big, w, None, {"BLOCK_N": 16, "BLOCK_K": 16}), torch.nn.functional.linear(big, w))


# ---------------------------------------------------------------------------- dispatch and tuning tables


@pytest.mark.parametrize("cache", ["float32", "fp8"])
def test_mixed_batch_decodes_then_prefill_matches_reference(cache):
    """A mixed step split in two launches (decode kernel for the leading one-token sequences,
    prefill kernel for the rest, one output) equals attention over the whole batch."""
    seq_lens = [33, 1, 70, 17, 40, 9]
    q_lens = [1, 1, 1, 17, 5, 9]  # three decodes, a whole prompt, a chunk with a cached prefix, a prompt
    x = paged_inputs(seq_lens, q_lens, 8, 2, 32, 8, torch.float32)
    k_scale = v_scale = 1.0
    if cache == "fp8":
        k_scale, v_scale = 0.05, 0.03
        x["k_cache"] = (x["k_cache"] / k_scale).to(torch.float8_e4m3fn)
        x["v_cache"] = (x["v_cache"] / v_scale).to(torch.float8_e4m3fn)
    expected = reference.paged_attention(
        x["q"], x["k_cache"], x["v_cache"], x["block_tables"], x["seq_lens"], x["query_start_loc"], 0.2,
        k_scale, v_scale,
    )  # fmt: skip
    out = ops.decodes_then_prefill(**x, scale=0.2, max_seq_len=70, num_decodes=3, k_scale=k_scale, v_scale=v_scale)
    close(out, expected, torch.float32)


def test_mixed_step_split_keeps_every_kernel_argument_aligned(monkeypatch):
    """Triton specializes pointer arguments on 16-byte alignment, and the artifact's kernel cache
    holds the aligned variants: a split at 67 decodes would hand the prefill kernel seq_lens[67:]
    (an int32 slice off by 12 bytes), a variant compiled while serving. The split point is rounded
    down to a multiple of 16 (64 here; the other 3 decodes go to the prefill kernel), every
    tensor the kernels get is aligned, and the output is attention over the whole batch. The
    split is on by default (from 64 decodes); with it off the prefill kernel takes every row."""
    launches = []

    def recorder(name):  # type: ignore[no-untyped-def]
        def launch(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, *rest, out=None,
                   k_scale=1.0, v_scale=1.0, softcap=0.0, window=0, sinks=None, chunk=0):  # type: ignore[no-untyped-def]
            tensors = (q, block_tables, seq_lens, query_start_loc, out)
            launches.append((name, seq_lens.shape[0], [t.data_ptr() % 16 for t in tensors if t is not None]))
            y = reference.paged_attention(
                q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, k_scale, v_scale
            )
            return y if out is None else out.copy_(y)

        return launch

    monkeypatch.setattr(ops, "_triton", lambda x: True)
    kernels = types.SimpleNamespace(decode=recorder("decode"), prefill=recorder("prefill"))
    monkeypatch.setattr(ops, "_kernels", lambda: kernels)
    seq_lens = [5 + i % 11 for i in range(67)] + [40, 9]
    x = paged_inputs(seq_lens, [1] * 67 + [40, 9], 8, 2, 32, 8, torch.float32)
    expected = reference.paged_attention(
        x["q"], x["k_cache"], x["v_cache"], x["block_tables"], x["seq_lens"], x["query_start_loc"], 0.2
    )
    out = ops.paged_attention(**x, scale=0.2, max_query_len=40, max_seq_len=40, num_decodes=67)
    assert [(name, n) for name, n, _ in launches] == [("decode", 64), ("prefill", 5)]
    assert all(offset == 0 for _, _, offsets in launches for offset in offsets), launches
    close(out, expected, torch.float32)
    launches.clear()
    out = ops.paged_attention(**x, scale=0.2, max_query_len=40, max_seq_len=40, num_decodes=63)
    assert [(name, n) for name, n, _ in launches] == [("prefill", 69)]  # 63 rounds down to 48 < 64
    launches.clear()
    monkeypatch.setattr(ops, "MIN_SPLIT_DECODES", None)
    out = ops.paged_attention(**x, scale=0.2, max_query_len=40, max_seq_len=40, num_decodes=67)
    assert [(name, n) for name, n, _ in launches] == [("prefill", 69)]
    close(out, expected, torch.float32)


def test_down_projection_takes_gate_up_and_fuses_silu_only_where_asked(monkeypatch):
    """The rendered model hands the down projection gate_up (silu_and_mul_first): on the CPU that is
    silu_and_mul then the projection, as before; on the GPU an int4 weight goes to the fused
    entry point only where its bucket's table entry was timed fused ("fused_silu", so the fused
    kernel is in the artifact) with a config that can fuse (a prefill-sized config keeps the tuned
    activation kernel), and with FUSE_SILU_DOWN (on by default); a dense weight never."""
    from pagecast.kernels.quant_linear import Int4LinearWeight

    gen = torch.Generator().manual_seed(0)
    gate_up = torch.randn(3, 2 * 64, generator=gen)
    w = torch.randn(32, 64, generator=gen)
    expected = torch.nn.functional.linear(reference.silu_and_mul(gate_up), w)
    torch.testing.assert_close(ops.row_parallel_linear(gate_up, w, None, "down", silu_and_mul_first=True), expected)

    calls = []
    kernels = types.SimpleNamespace(
        silu_and_mul=lambda x, cfg: calls.append("silu_and_mul") or reference.silu_and_mul(x),
        w4a16_gemm=lambda x, *args: calls.append("w4a16_gemm") or x[:, :1],
        w4a16_silu_and_mul_gemm=lambda x, *args: calls.append("fused") or x[:, :1],
        fuses_silu_and_mul=lambda cfg: cfg.params.get("SUB_ZEROS") == 1,
        skinny_gemm=lambda x, weight, bias, cfg: calls.append("skinny_gemm") or x[:, :1],
    )
    monkeypatch.setattr(ops, "_triton", lambda x: True)
    monkeypatch.setattr(ops, "_kernels", lambda: kernels)
    int4 = Int4LinearWeight(torch.zeros(8, 32, dtype=torch.int32), torch.ones(1, 32), torch.zeros(1, 32, dtype=torch.int8),
                            None, 64)  # fmt: skip
    sub_zeros = {"tcgemv": 1, "BLOCK_N": 256, "BLOCK_K": 128, "SPLIT_K": 4, "SUB_ZEROS": 1}

    def down(entry):  # type: ignore[no-untyped-def]
        calls.clear()
        ops.activate(ops.KernelTable({"w4a16_gemm": {"down.m4": entry}} if entry else None))
        ops.row_parallel_linear(gate_up, int4, None, "down", silu_and_mul_first=True)
        return calls

    previous = ops._active
    try:
        assert ops.FUSE_SILU_DOWN
        assert down({"config": sub_zeros, "fused_silu": True}) == ["fused"]
        # not timed fused (a table written before, or tuned with the flag off): not fused
        assert down({"config": sub_zeros}) == ["silu_and_mul", "w4a16_gemm"]
        assert down(None) == ["silu_and_mul", "w4a16_gemm"]
        # a config that cannot fuse keeps the activation kernel
        assert down({"config": {"dequant": 1}, "fused_silu": True}) == ["silu_and_mul", "w4a16_gemm"]
        monkeypatch.setattr(ops, "FUSE_SILU_DOWN", False)
        assert down({"config": sub_zeros, "fused_silu": True}) == ["silu_and_mul", "w4a16_gemm"]
        monkeypatch.setattr(ops, "FUSE_SILU_DOWN", True)
        calls.clear()
        ops.row_parallel_linear(gate_up, w, None, "down", silu_and_mul_first=True)
        assert calls == ["silu_and_mul", "skinny_gemm"]
    finally:
        ops.activate(previous)


def test_leading_decodes_counts_the_one_token_prefix():
    from pagecast.runtime.forward_context import leading_decodes

    assert leading_decodes([1, 1, 1, 512, 1]) == 3
    assert leading_decodes([512, 1, 1]) == 0
    assert leading_decodes([1, 1]) == 2 and leading_decodes([]) == 0


def test_ops_use_the_reference_on_cpu(monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("a Triton launcher was called for CPU tensors")

    monkeypatch.setattr(ops, "_kernels", fail)
    x = paged_inputs([9, 20], [1, 1], 4, 2, 16, 8, torch.float32)
    out = ops.paged_attention(**x, scale=0.25, max_query_len=1, max_seq_len=20)
    torch.testing.assert_close(out, ref_attention(x, 0.25))
    h = torch.randn(2, 32)
    torch.testing.assert_close(
        ops.rms_norm(h, torch.ones(32), 1e-6), reference.rms_norm(h, torch.ones(32), 1e-6)
    )
    w = torch.randn(8, 32)
    torch.testing.assert_close(ops.linear(h, w, None, "qkv"), torch.nn.functional.linear(h, w))


def test_buckets_and_lookup():
    assert tuning.decode_bucket(1, 1) == "1x512"
    assert tuning.decode_bucket(40, 1000) == "64x2048"
    assert tuning.decode_bucket(300, 1000) == "512x2048"
    assert tuning.decode_bucket(5000, 100_000) == "1024x131072"
    assert tuning.decode_bucket(1, 40_000) == "1x131072" and tuning.decode_bucket(1, 500_000) == "1x131072"
    assert tuning.token_bucket(3) == "t8" and tuning.token_bucket(20_000) == "t16384"
    assert tuning.prefill_bucket(300) == "t512"
    assert tuning.skinny_bucket("qkv", 1) == "qkv.m1" and tuning.skinny_bucket("down", 3) == "down.m4"
    assert tuning.skinny_bucket("o", 40) == "o.m16"
    cfg = {"BLOCK_N": 64, "num_splits": 4, "num_warps": 4, "num_stages": 2}
    table = {
        "kernels": {"paged_decode_attention": {"64x2048": {"config": cfg, "time_us": 1.0}}},
        "tuned": True,
    }
    assert tuning.lookup(table, "paged_decode_attention", "64x2048") == cfg
    assert tuning.lookup(table["kernels"], "paged_decode_attention", "64x2048") == cfg
    assert tuning.lookup(table, "paged_decode_attention", "1x512") is None
    kc = tuning.KernelConfig.coerce(cfg)
    assert kc is not None and kc["num_splits"] == 4 and kc.num_warps == 4 and kc.as_dict() == cfg
    ops.configure(table)
    try:
        assert ops._config("paged_decode_attention", "64x2048") == kc
        assert ops._config("paged_decode_attention", "8x512") is None
        # A table built before the 512 and 1024 batch buckets: a 1024-sequence batch runs the
        # largest tuned batch's config at its context, not the launcher's untuned default.
        assert tuning.decode_fallback_buckets("1024x2048")[:2] == ["512x2048", "256x2048"]
        assert ops.decode_attention_config(1000, 1500) == kc
        assert ops._config("paged_decode_attention", "1024x512") is None
        # A table built before the 131072 context bucket: a 100k context runs its batch's 32k
        # config (here the nearest is 64x2048's, two contexts down), not the untuned default.
        assert tuning.decode_fallback_buckets("8x131072")[:3] == ["1x131072", "8x32768", "1x32768"]
        assert ops.decode_attention_config(64, 100_000) == kc
    finally:
        ops.configure(None)


def test_shipped_tables_and_report():
    assert tuning.gpu_key("NVIDIA H200") == "h200" and tuning.gpu_key("NVIDIA A100-SXM4-80GB") == "a100"
    assert tuning.default_table("NVIDIA GeForce GT 710") is None
    shapes = tuning.ModelShapes(32, 8, 128, 4096, 14336, 16, "bfloat16", 8192, 256)
    for gpu in ("NVIDIA H200", "NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB", "NVIDIA L40S"):
        table = tuning.default_table(gpu)
        assert table is not None and set(table["kernels"]) == set(tuning.KERNELS), gpu
        entry = table["kernels"]["paged_decode_attention"]["64x2048"]
        assert {"BLOCK_N", "num_splits", "num_warps", "num_stages"} <= set(entry["config"])
    rows = tuning.bandwidth_report(tuning.default_table("h200"), shapes, 4262.0)
    decode = {r["bucket"]: r for r in rows if r["kernel"] == "paged_decode_attention"}
    if decode:  # measured tables carry times
        row = decode["64x2048"]
        assert row["bytes"] == 64 * 2048 * 2 * 8 * 128 * 2 + 2 * 64 * 32 * 128 * 2
        assert 0 < row["fraction_of_copy"] < 1.5


def test_skinny_gemm_buckets_and_configs():
    from pagecast.kernels import problems
    from pagecast.kernels import skinny_gemm as sg

    shapes = tuning.ModelShapes(32, 8, 128, 4096, 14336, 16, "bfloat16", 8192, 4)
    buckets = dict(problems.buckets("skinny_gemm", shapes))
    assert list(buckets) == [f"{p}.m{m}" for p in ("qkv", "o", "gate_up", "down") for m in (1, 2, 4)]
    assert (buckets["qkv.m1"]["n"], buckets["qkv.m1"]["k"]) == (6144, 4096)
    assert (buckets["down.m4"]["n"], buckets["down.m4"]["k"]) == (4096, 14336)
    assert problems.problem_size("skinny_gemm", shapes, buckets["o.m1"])[0] == (4096 * 4096 + 2 * 4096) * 2
    configs = problems.config_space("skinny_gemm", shapes, buckets["o.m1"])
    assert configs[0] == sg.TORCH and len(configs) > 1  # cuBLAS is always a candidate
    assert all(4096 % c["BLOCK_K"] == 0 and 4096 // c["BLOCK_N"] >= 128 or c["BLOCK_N"] == 16 for c in configs[1:])
    assert problems.default_config("skinny_gemm", shapes, buckets["o.m1"]) == sg.TORCH


def test_config_spaces_prune():
    from pagecast.kernels import paged_decode_attention as dec

    small = dec.prune_configs(dec.CONFIG_SPACE, 1, 32768, 8, 132)
    large = dec.prune_configs(dec.CONFIG_SPACE, 256, 8192, 8, 132)
    assert max(c["num_splits"] for c in small) == 64
    # an fp8 cache's programs unpack every byte: one long sequence may split 128 ways
    assert max(c["num_splits"] for c in dec.prune_configs(dec.FP8_CONFIG_SPACE, 1, 131072, 8, 132)) == 128
    assert max(c["num_splits"] for c in dec.prune_configs(dec.FP8_CONFIG_SPACE, 16, 32768, 8, 132)) == 32
    assert {c["num_splits"] for c in large} == {1, 2}
    # the in-launch merge is timed at small batches only, and never without a split
    assert any(c.params.get("merge") for c in small)
    assert not any(c.params.get("merge") for c in large)
    assert all(c["num_splits"] > 1 for c in dec.CONFIG_SPACE + dec.FP8_CONFIG_SPACE if c.params.get("merge"))
    assert dec.default_config(256, 8192, 8, 132)["num_splits"] == 1
    assert dec.default_config(1, 32768, 8, 132)["num_splits"] >= 32
    with pytest.raises(ValueError):
        tuning.ModelShapes(9, 2, 64, 576, 1536, 16)
    with pytest.raises(ValueError):
        tuning.tune(["no_such_kernel"], tuning.ModelShapes(9, 3, 64, 576, 1536, 16), 1.0, "cpu")


def test_buckets_the_budget_cut_off_are_not_called_tuned(monkeypatch):  # type: ignore[no-untyped-def]
    """Once the tuning budget is spent the remaining buckets keep the launcher's default: the
    table must say so (tuned False, budget_spent) and the build report name them, rather than
    call a config timed alone 'tuned'. A fake clock: every timed config takes one second."""
    import types

    from pagecast.builder.tune import budget_note
    from pagecast.kernels import problems

    clock = [0.0]

    def timed(launch, launches, reps):  # type: ignore[no-untyped-def]
        clock[0] += 1.0
        return 10.0

    problem = types.SimpleNamespace(launches_per_sample=lambda: 1, launch=lambda cfg, i: None, reference=None,
                                    marks={"timed_as": "fake"}, variants=None, apart=None)  # fmt: skip
    monkeypatch.setattr(tuning, "time", types.SimpleNamespace(monotonic=lambda: clock[0]))
    monkeypatch.setattr(tuning, "time_launches", timed)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "fake GPU")
    monkeypatch.setattr(problems, "make_problem", lambda *args, **kwargs: problem)
    shapes = tuning.ModelShapes(9, 3, 64, 576, 1536, 16)
    table = tuning.tune(["rms_norm"], shapes, budget_s=2.5, device="cpu")
    entries = table["kernels"]["rms_norm"]
    first, *rest = entries.values()
    assert first["tuned"] and "budget_spent" not in first  # 3 configs timed, the budget ran out during it
    assert rest and all(not e["tuned"] and e["budget_spent"] for e in rest)
    assert all(e["timed_as"] == "fake" for e in entries.values())  # the problem's marks, in every entry
    default = problems.default_config("rms_norm", shapes, {}).as_dict()
    assert all(e["config"] == default for e in rest)
    assert tuning.untuned_buckets(table) == {"rms_norm": list(entries)[1:]}
    note = budget_note(table, 2.5)
    assert f"before {len(rest)} of {len(entries)} buckets" in note and "t64" in note and "--tune-budget" in note
    assert budget_note({"kernels": {"rms_norm": {"t8": first}}}, 2.5) == ""


def test_the_build_report_says_where_the_tuning_time_went(monkeypatch):  # type: ignore[no-untyped-def]
    """The tuner splits each kernel's time into first launches (where Triton compiles a config),
    timing, making problems and the rest, and the report names the kernels longest first: what a
    budget that ran out was spent on. A fake clock: a config's first launch takes 2 s the first
    time (a compile), timing 1 s, the half-type reference 0.5 s."""
    import types

    from pagecast.builder.tune import time_note
    from pagecast.kernels import problems

    clock = [0.0]
    compiled: set[str] = set()

    def launch(cfg, i):  # type: ignore[no-untyped-def]
        key = repr(cfg.as_dict()) + repr((cfg.num_warps, cfg.num_stages))
        if key not in compiled:
            compiled.add(key)
            clock[0] += 2.0

    def timed(launch, launches, reps):  # type: ignore[no-untyped-def]
        clock[0] += 1.0 if launch.args[0] is not None else 0.5
        return 10.0

    problem = types.SimpleNamespace(launches_per_sample=lambda: 1, launch=launch, reference=lambda cfg, i: None,
                                    marks={}, variants=None, apart=None)  # fmt: skip
    monkeypatch.setattr(tuning, "time", types.SimpleNamespace(monotonic=lambda: clock[0]))
    monkeypatch.setattr(tuning, "time_launches", timed)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "fake GPU")
    monkeypatch.setattr(problems, "make_problem", lambda *args, **kwargs: problem)
    shapes = tuning.ModelShapes(9, 3, 64, 576, 1536, 16)
    table = tuning.tune(["rms_norm", "silu_and_mul"], shapes, budget_s=1e9, device="cpu")
    for kernel in ("rms_norm", "silu_and_mul"):
        entries = table["kernels"][kernel]
        spaces = [problems.config_space(kernel, shapes, d) for _, d in problems.buckets(kernel, shapes)]
        distinct = {repr(c.as_dict()) + repr((c.num_warps, c.num_stages)) for space in spaces for c in space}
        spent = table["tune_seconds"][kernel]
        assert spent["timing"] == sum(len(space) for space in spaces) * 1.0
        assert spent["other"] == len(entries) * 0.5
        assert spent["first_launches"] == 2.0 * len(distinct)  # each config compiled once, then loaded
    note = time_note(table)
    longest = max(table["tune_seconds"], key=lambda k: sum(table["tune_seconds"][k].values()))
    assert note.startswith(f". Tuning time by kernel: {longest} ") and "first launches, which compile" in note
    assert time_note({"kernels": {}}) == ""


def test_the_tuner_refuses_a_config_whose_output_differs_from_the_defaults(monkeypatch):  # type: ignore[no-untyped-def]
    """A config a compiler gets wrong on the GPU being built for (a dropped K tile, a NaN) must
    never be kept for being fast: the tuner compares each config's output with the bucket's first
    (the launcher's default) and times only those that agree; the table lists the others and the
    build report names them. A config off by rounding only (what another summation order gives)
    is not refused. Fake kernels: "wrong" is fastest, "nan" next, "rounded" faster than the default."""
    from pagecast.builder.tune import rejected_note
    from pagecast.kernels import problems

    shapes = tuning.ModelShapes(9, 3, 64, 576, 1536, 16)
    right = torch.linspace(-3.0, 3.0, 64).reshape(8, 8)
    default = problems.default_config("silu_and_mul", shapes, {"num_tokens": 8})
    # Each config of the space stands for one behaviour, assigned in order after the default.
    others = [c for c in problems.config_space("silu_and_mul", shapes, {"num_tokens": 8}) if c != default]
    behaviour = {repr(c.as_dict()): kind for c, kind in zip(others, ("wrong", "nan", "rounded"), strict=False)}
    assert len(behaviour) == 3, "the silu_and_mul space needs three configs besides the default for this test"
    speed = {"wrong": 1.0, "nan": 2.0, "rounded": 5.0, None: 10.0}

    def kind(cfg):  # type: ignore[no-untyped-def]
        return behaviour.get(repr(cfg.as_dict()))  # as_dict holds num_warps and num_stages too

    def launch(cfg, i):  # type: ignore[no-untyped-def]
        out = right.clone()
        if kind(cfg) == "wrong":
            out[:, 4:] = 0.0  # half the columns never written
        elif kind(cfg) == "nan":
            out[3, 3] = float("nan")
        elif kind(cfg) == "rounded":
            out = out.to(torch.bfloat16).float() * (1 + 2**-9)
        return out, out[:1]

    problem = types.SimpleNamespace(launches_per_sample=lambda: 1, launch=launch, reference=None, marks={}, variants=None, apart=None)
    monkeypatch.setattr(tuning, "time_launches", lambda launch, launches, reps: speed[kind(launch.args[0])])
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "fake GPU")
    monkeypatch.setattr(problems, "make_problem", lambda *args, **kwargs: problem)
    logged: list[str] = []
    table = tuning.tune(["silu_and_mul"], shapes, budget_s=1e9, device="cpu", log=logged.append)
    for bucket, entry in table["kernels"]["silu_and_mul"].items():
        kept = [entry["config"]] + [a["config"] for a in entry["alternatives"]]
        assert {kind(tuning.KernelConfig.coerce(c)) for c in kept} <= {"rounded", None}, bucket
    entry = table["kernels"]["silu_and_mul"]["t8"]
    refused = {kind(tuning.KernelConfig.coerce(r["config"])): r["error"] for r in entry["rejected"]}
    assert set(refused) == {"nan", "wrong"}
    assert refused["wrong"] > tuning.DISAGREEMENT_TOLERANCE and refused["nan"] is None
    json.dumps(table, allow_nan=False)  # tuning.json stays strict JSON
    assert entry["time_us"] == speed["rounded"]  # the fastest config that agrees
    assert any("REJECTED" in line for line in logged)
    note = rejected_note(table)
    assert "were not used" in note and "silu_and_mul t8" in note and "NaN/inf" in note and "off by" in note
    assert rejected_note({"kernels": {"silu_and_mul": {"t8": {"config": {}}}}}) == ""


def test_the_tuner_times_the_default_where_the_pruned_space_leaves_it_out(monkeypatch):  # type: ignore[no-untyped-def]
    """The tiny Qwen3-MoE of the GPU parity test: at one token fused_moe's default is the per-pair
    GEMV with BLOCK_K 32 (the smaller reduction, 32), which no config of the pruned space is, so
    the build failed with "no config of fused_moe ran at bucket t1". The launcher's default runs at
    every shape: the tuner times it first whatever the space holds. The real problem, on the CPU
    interpreter, fp32."""
    from pagecast.kernels import problems

    shapes = tuning.ModelShapes(
        num_heads=4, num_kv_heads=2, head_dim=16, hidden=64, intermediate=96, block_size=16, dtype="float32",
        max_model_len=256, max_num_seqs=8, num_experts=8, top_k=2, moe_intermediate=32,
    )  # fmt: skip
    dims = dict(problems.buckets("fused_moe", shapes))["t1"]
    default = problems.default_config("fused_moe", shapes, dims)
    assert default not in problems.config_space("fused_moe", shapes, dims)
    monkeypatch.setattr(problems, "buckets", lambda kernel, shapes: [("t1", dims)])
    monkeypatch.setattr(tuning, "time_launches", lambda launch, launches, reps: 5.0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "fake GPU")
    table = tuning.tune(["fused_moe"], shapes, budget_s=1e9, device="cpu")
    entry = table["kernels"]["fused_moe"]["t1"]
    assert entry["config"] == default.as_dict() and entry["time_us"] == 5.0


def test_the_tuner_marks_a_bucket_whose_input_made_apart_was_faster(monkeypatch):  # type: ignore[no-untyped-def]
    """Problem.apart (an FP8 decode bucket with its norm or activation in a launch of its own, not in
    the fused decode kernel): timed once, with the bucket's best config. The entry records its time,
    and the "feed_apart" mark that serving follows (kernels/ops.py) only where it beat the best by
    TIE_TOLERANCE; a launch that fails leaves the bucket fused and unmarked."""
    from pagecast.kernels import problems

    shapes = tuning.ModelShapes(9, 3, 64, 576, 1536, 16)
    dims = dict(problems.buckets("silu_and_mul", shapes))["t8"]
    monkeypatch.setattr(problems, "buckets", lambda kernel, shapes: [("t8", dims)])
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "fake GPU")
    best = 10.0
    given: list[object] = []

    def tuned_with(apart_us):  # type: ignore[no-untyped-def]
        def apart(cfg, i):  # type: ignore[no-untyped-def]
            given.append(cfg)
            if apart_us is None:
                raise RuntimeError("out of resources")
            return torch.ones(2)

        problem = types.SimpleNamespace(launches_per_sample=lambda: 1, launch=lambda cfg, i: torch.ones(2), reference=None,
                                        marks={}, variants=None, apart=apart)  # fmt: skip

        def timed(launch, launches, reps):  # type: ignore[no-untyped-def]
            if launch.func is apart:
                launch(0)
                return apart_us
            return best

        monkeypatch.setattr(problems, "make_problem", lambda *args, **kwargs: problem)
        monkeypatch.setattr(tuning, "time_launches", timed)
        given.clear()
        return tuning.tune(["silu_and_mul"], shapes, budget_s=1e9, device="cpu")["kernels"]["silu_and_mul"]["t8"]

    entry = tuned_with(best * (1 - 2 * tuning.TIE_TOLERANCE))
    assert entry["feed_apart"] is True and entry["apart_us"] == pytest.approx(best * (1 - 2 * tuning.TIE_TOLERANCE))
    assert [tuning.KernelConfig.coerce(c).as_dict() for c in given] == [entry["config"]]  # with the chosen config
    entry = tuned_with(best * (1 - tuning.TIE_TOLERANCE / 2))  # faster, but within the tie tolerance
    assert "feed_apart" not in entry and entry["apart_us"] == pytest.approx(best * (1 - tuning.TIE_TOLERANCE / 2))
    entry = tuned_with(None)  # the launch fails
    assert "feed_apart" not in entry and "apart_us" not in entry and entry["time_us"] == best


def test_output_disagreement_allows_rounding_and_refuses_wrong_values() -> None:
    ref = [torch.randn(16, 32, generator=torch.Generator().manual_seed(0))]
    assert tuning.output_disagreement([ref[0].to(torch.bfloat16).float()], ref) is None  # bf16 rounding
    assert tuning.output_disagreement([ref[0] * 1.05], ref) is not None  # 5% off
    shifted = ref[0].clone()
    shifted[0, 0] += 0.1 * ref[0].abs().max()
    assert tuning.output_disagreement([shifted], ref) == pytest.approx(0.1, rel=1e-3)  # one element off is enough
    nan = ref[0].clone()
    nan[1, 1] = float("nan")
    assert tuning.output_disagreement([nan], ref) == float("inf")
    assert tuning.output_disagreement([nan], [nan]) is None  # NaN where the default has one too: not compared
    assert tuning.output_disagreement([ref[0][:8]], ref) == float("inf")  # shapes
    ids = [torch.tensor([3, 1, 2])]
    assert tuning.output_disagreement([torch.tensor([3, 1, 2])], ids) is None
    assert tuning.output_disagreement([torch.tensor([3, 2, 1])], ids) == float("inf")  # integers: exact


_AGREEMENT_SHAPES = {"num_heads": 4, "num_kv_heads": 2, "head_dim": 64, "hidden": 256, "intermediate": 512, "block_size": 16,
                     "dtype": "float16", "max_model_len": 1024, "max_num_seqs": 8}  # fmt: skip


@pytest.mark.parametrize(
    ("kernel", "extra"),
    [
        ("paged_decode_attention", {}),
        ("paged_prefill_attention", {}),
        ("rotary_kv", {}),
        ("rotary_kv", {"head_qk_norm": True}),
        ("fused_add_rms_norm", {}),
        ("silu_and_mul", {}),
        ("skinny_gemm", {}),
        ("w4a16_gemm", {"quant_group_size": 128}),
        ("fp8_gemm", {"fp8": "channel-token"}),
        ("fp8_gemm", {"fp8": "channel-token", "normed": ("qkv",)}),  # the norm inside the fused decode kernel
        ("fused_moe", {"num_experts": 4, "top_k": 2, "moe_intermediate": 128}),
        ("fused_moe_w4a16", {"num_experts": 4, "top_k": 2, "moe_intermediate": 128, "quant_group_size": 128}),
        ("fused_moe_fp8", {"num_experts": 4, "top_k": 2, "moe_intermediate": 128, "fp8": "channel-token"}),
    ],
)
def test_every_config_of_a_real_problem_agrees_with_the_default(kernel, extra) -> None:  # type: ignore[no-untyped-def]
    """The tuner's agreement check must not refuse a sound config: on the interpreter (fp16, where
    its dots are right) the first four configs of each kernel's space compute its first bucket's
    problem as the default does, within the tolerance, and the problem's outputs are fully written."""
    from pagecast.kernels import problems

    shapes = tuning.ModelShapes(**_AGREEMENT_SHAPES, **extra)
    bucket, dims = problems.buckets(kernel, shapes)[0]
    problem = problems.make_problem(kernel, shapes, dims, "cpu", seed=0)
    default = problems.default_config(kernel, shapes, dims)
    configs = [c for c in problems.config_space(kernel, shapes, dims) if c != default][:4]
    baseline = [t.clone() for t in tuning._output_tensors(problem.launch(default, 0))]
    assert baseline and all(bool(torch.isfinite(t.float()).all()) for t in baseline), bucket
    assert configs
    for cfg in configs:
        got = tuning._output_tensors(problem.launch(cfg, 0))
        assert tuning.output_disagreement(got, baseline) is None, (bucket, cfg.as_dict())


def test_precompile_compiles_every_config_without_launching_a_kernel(monkeypatch):  # type: ignore[no-untyped-def]
    """PAGECAST_TUNE_COMPILE_THREADS: before a bucket is timed, each config's launch runs once with
    Triton's launches turned into compiles (JITFunction.run with warmup=True, in Triton's
    AsyncCompileMode), variants too; a config whose launch fails is left to the timing loop; and
    launches outside it run as before. (On the CPU Triton's run is a stand-in: there is no driver.)"""
    from triton.runtime.jit import JITFunction

    runs: list[tuple[str, bool]] = []

    def fake_run(self, *args, grid, warmup, **kwargs):  # type: ignore[no-untyped-def]
        runs.append((self.fn.__name__, warmup))

    monkeypatch.setattr(JITFunction, "run", fake_run)

    def kernel_a(x):  # type: ignore[no-untyped-def]
        pass

    def kernel_b(x):  # type: ignore[no-untyped-def]
        pass

    a, b = JITFunction(kernel_a), JITFunction(kernel_b)

    def launch(cfg, i):  # type: ignore[no-untyped-def]
        if cfg["BLOCK"] == 3:
            raise RuntimeError("out of resources")
        a[(1,)](torch.zeros(1))

    problem = types.SimpleNamespace(launch=launch, variants=lambda cfg: b[(1,)](torch.zeros(1)))
    configs = [tuning.KernelConfig({"BLOCK": n}, num_warps=4, num_stages=2) for n in (1, 2, 3)]
    assert tuning.precompile(problem, configs, threads=2) == 2
    assert runs == [("kernel_a", True), ("kernel_b", True)] * 2  # compiled, none launched
    runs.clear()
    launch(configs[0], 0)
    assert runs == [("kernel_a", False)]  # outside precompile: a launch

    # once the budget is spent: each bucket left made and its default's launch compiled, in one go
    runs.clear()
    made: list[int] = []

    def make(n):  # type: ignore[no-untyped-def]
        made.append(n)
        return problem, tuning.KernelConfig({"BLOCK": n}, num_warps=4, num_stages=2)

    assert tuning.precompile_defaults([functools.partial(make, n) for n in (1, 3, 2)], threads=2) == 2
    assert made == [1, 3, 2] and runs == [("kernel_a", True), ("kernel_b", True)] * 2


def test_the_tuner_precompiles_each_bucket_it_times_in_full(monkeypatch):  # type: ignore[no-untyped-def]
    """With compile threads, every bucket the budget leaves whole is precompiled with the configs
    it times, before the first is timed, and that time counts as first launches; a bucket the
    budget cut (default and previous winner only) is not. By default min(8, usable CPUs) threads on
    a GPU, none on the CPU; 0 or 1 compiles one at a time. A fake clock."""
    from pagecast.kernels import problems

    clock = [0.0]
    order: list[str] = []

    def timed(launch, launches, reps):  # type: ignore[no-untyped-def]
        order.append("time")
        clock[0] += 1.0
        return 10.0

    def precompile(problem, configs, threads):  # type: ignore[no-untyped-def]
        order.append(f"precompile {len(configs)} x{threads}")
        clock[0] += 0.25
        return len(configs)

    def precompile_defaults(make, threads):  # type: ignore[no-untyped-def]
        made = [m() for m in make]
        order.append(f"defaults {len(made)} x{threads}")
        clock[0] += 0.5
        return len(made)

    problem = types.SimpleNamespace(launches_per_sample=lambda: 1, launch=lambda cfg, i: None, reference=None,
                                    marks={}, variants=None, apart=None)  # fmt: skip
    monkeypatch.setattr(tuning, "time", types.SimpleNamespace(monotonic=lambda: clock[0]))
    monkeypatch.setattr(tuning, "time_launches", timed)
    monkeypatch.setattr(tuning, "precompile", precompile)
    monkeypatch.setattr(tuning, "precompile_defaults", precompile_defaults)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "fake GPU")
    monkeypatch.setattr(problems, "make_problem", lambda *args, **kwargs: problem)
    shapes = tuning.ModelShapes(9, 3, 64, 576, 1536, 16)
    monkeypatch.delenv(tuning.COMPILE_THREADS_ENV, raising=False)
    monkeypatch.setattr(tuning.os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    assert tuning.compile_threads("cuda") == 8
    monkeypatch.setattr(tuning.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    assert tuning.compile_threads("cuda") == 2
    assert tuning.compile_threads("cpu") == 0  # the interpreter compiles nothing
    monkeypatch.setenv(tuning.COMPILE_THREADS_ENV, "0")
    table = tuning.tune(["rms_norm"], shapes, budget_s=1e9, device="cpu")
    assert table["compile_threads"] == 0 and not any(o.startswith("precompile") for o in order)

    monkeypatch.setenv(tuning.COMPILE_THREADS_ENV, "4")
    order.clear()
    table = tuning.tune(["rms_norm"], shapes, budget_s=2.5, device="cpu")
    entries = table["kernels"]["rms_norm"]
    first_space = problems.config_space("rms_norm", shapes, dict(problems.buckets("rms_norm", shapes))[next(iter(entries))])
    assert table["compile_threads"] == 4
    assert order[0] == f"precompile {len(first_space)} x4" and order[1] == "time"
    assert sum(o.startswith("precompile") for o in order) == 1  # the cut buckets time their default alone
    # ... whose compiles ran at once, before the first of them: every bucket after the timed one
    cut = [b for b, e in entries.items() if e.get("budget_spent")]
    assert cut == list(entries)[1:] and cut
    assert order.count(f"defaults {len(cut)} x4") == 1, order
    assert order[order.index(f"defaults {len(cut)} x4") + 1 :] == ["time"] * len(cut), order
    assert table["tune_seconds"]["rms_norm"]["first_launches"] == 0.75

    monkeypatch.setenv(tuning.COMPILE_THREADS_ENV, "many")
    with pytest.raises(ValueError, match="PAGECAST_TUNE_COMPILE_THREADS"):
        tuning.tune(["rms_norm"], shapes, budget_s=1.0, device="cpu")


def test_the_tuner_launches_each_timed_configs_other_variants(monkeypatch):  # type: ignore[no-untyped-def]
    """Problem.variants (a row bucket's rows not divisible by 16) runs once with every config the
    tuner times, so each config that can win has that variant compiled into the artifact."""
    import types

    from pagecast.kernels import problems

    timed_configs: list = []
    variant_configs: list = []

    def timed(launch, launches, reps):  # type: ignore[no-untyped-def]
        timed_configs.append(launch.args[0])
        return 10.0

    problem = types.SimpleNamespace(launches_per_sample=lambda: 1, launch=lambda cfg, i: None, reference=None,
                                    marks={}, variants=variant_configs.append, apart=None)  # fmt: skip
    monkeypatch.setattr(tuning, "time_launches", timed)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "fake GPU")
    monkeypatch.setattr(problems, "make_problem", lambda *args, **kwargs: problem)
    tuning.tune(["rms_norm"], tuning.ModelShapes(9, 3, 64, 576, 1536, 16), budget_s=60.0, device="cpu")
    assert len(timed_configs) > len(tuning.TOKEN_BUCKETS) and variant_configs == timed_configs


def test_a_bucket_the_budget_cut_off_keeps_the_previous_winner_when_it_is_faster(monkeypatch):  # type: ignore[no-untyped-def]
    """After the budget is spent a bucket times the launcher's default and the config the last
    tuned bucket kept, and keeps the faster (an FP8 build's untuned 16-row default was ~3x slower
    than the 1-row winner); while the budget lasts the default is timed first, so a bucket cut
    short still has it. A fake clock: every timed config takes one second."""
    import types

    from pagecast.kernels import problems

    shapes = tuning.ModelShapes(9, 3, 64, 576, 1536, 16)
    space = problems.config_space("rms_norm", shapes, {})
    default = problems.default_config("rms_norm", shapes, {})
    fast = next(c for c in space if c != default)
    clock = [0.0]
    timed_configs: list[list] = []  # type: ignore[type-arg]

    def timed(launch, launches, reps):  # type: ignore[no-untyped-def]
        clock[0] += 1.0
        cfg = launch.args[0]
        timed_configs[-1].append(cfg)
        return 5.0 if cfg == fast else 20.0

    def make_problem(*args, **kwargs):  # type: ignore[no-untyped-def]
        timed_configs.append([])
        return types.SimpleNamespace(launches_per_sample=lambda: 1, launch=lambda cfg, i: None, reference=None, marks={},
                                     variants=None, apart=None)  # fmt: skip

    monkeypatch.setattr(tuning, "time", types.SimpleNamespace(monotonic=lambda: clock[0]))
    monkeypatch.setattr(tuning, "time_launches", timed)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "fake GPU")
    monkeypatch.setattr(problems, "make_problem", make_problem)
    table = tuning.tune(["rms_norm"], shapes, budget_s=len(space) - 0.5, device="cpu")
    first, *rest = table["kernels"]["rms_norm"].values()
    assert timed_configs[0][0] == default  # the default first
    assert first["tuned"] and first["config"] == fast.as_dict()
    assert rest and all(e["budget_spent"] and not e["tuned"] for e in rest)
    assert all(e["config"] == fast.as_dict() and e["time_us"] == 5.0 for e in rest), (rest, timed_configs)
    assert all(timed == [default, fast] for timed in timed_configs[1:])
