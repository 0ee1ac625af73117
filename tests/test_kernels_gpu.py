"""Triton kernels against their references on the GPU, in bf16 at real model shapes.

Llama-3-8B (32 query / 8 KV heads, head_dim 128) and SmolLM2-135M (9 / 3, head_dim 64),
the ops.py dispatch with a tuning table, and a decode step's attention captured in a CUDA
graph and replayed on new block tables and lengths. Run with ``pytest -m gpu``.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

from pagecast.kernels import ops, reference, rope, tuning

LLAMA = {"num_heads": 32, "num_kv_heads": 8, "head_dim": 128}
SMOL = {"num_heads": 9, "num_kv_heads": 3, "head_dim": 64}
DT = torch.bfloat16


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    assert not actual.isnan().any(), "NaN in the output"
    return ((actual.float() - expected.float()).norm() / expected.float().norm()).item()


def paged_inputs(seq_lens, q_lens, num_heads, num_kv_heads, head_dim, block_size, seed=0):  # type: ignore[no-untyped-def]
    g = torch.Generator(device="cuda").manual_seed(seed)
    blocks = [-(-s // block_size) for s in seq_lens]
    pool = sum(blocks) + 5
    k_cache = torch.randn(pool, num_kv_heads, block_size, head_dim, generator=g, device="cuda", dtype=DT)
    v_cache = torch.randn(pool, num_kv_heads, block_size, head_dim, generator=g, device="cuda", dtype=DT)
    perm = torch.randperm(pool, generator=g, device="cuda")
    table = torch.full((len(seq_lens), max(blocks) + 3), pool - 1, dtype=torch.int32, device="cuda")
    used = 0
    for i, n in enumerate(blocks):
        table[i, :n] = perm[used : used + n]
        used += n
    qsl = torch.zeros(len(q_lens) + 1, dtype=torch.int32, device="cuda")
    qsl[1:] = torch.tensor(q_lens, device="cuda").cumsum(0)
    q = torch.randn(sum(q_lens), num_heads, head_dim, generator=g, device="cuda", dtype=DT)
    return {
        "q": q, "k_cache": k_cache, "v_cache": v_cache, "block_tables": table,
        "seq_lens": torch.tensor(seq_lens, dtype=torch.int32, device="cuda"), "query_start_loc": qsl,
    }  # fmt: skip


def ref_attention(x, scale):  # type: ignore[no-untyped-def]
    return reference.paged_attention(
        x["q"], x["k_cache"], x["v_cache"], x["block_tables"], x["seq_lens"], x["query_start_loc"], scale
    )


DECODE_LENS = [1, 17, 129, 2049, 4000, 9, 700, 3333]


@pytest.mark.parametrize("model", [LLAMA, SMOL], ids=["llama3-8b", "smollm2"])
@pytest.mark.parametrize("block_size", [16, 128])
@pytest.mark.parametrize(
    "config",
    [
        None,
        {"BLOCK_N": 64, "num_splits": 1, "num_warps": 4, "num_stages": 2},
        {"BLOCK_N": 32, "num_splits": 16, "num_warps": 4, "num_stages": 3},
        {"BLOCK_N": 32, "num_splits": 16, "num_warps": 4, "num_stages": 3, "merge": 1},
    ],
    ids=["default", "direct", "split16", "split16-merge-in-launch"],
)
def test_decode_attention(model, block_size, config):
    from pagecast.kernels.paged_decode_attention import paged_decode_attention

    x = paged_inputs(DECODE_LENS, [1] * len(DECODE_LENS), block_size=block_size, **model)
    scale = model["head_dim"] ** -0.5
    out = paged_decode_attention(**x, scale=scale, max_seq_len=max(DECODE_LENS), config=config)
    assert rel_err(out, ref_attention(x, scale)) < 1e-2


@pytest.mark.parametrize("model", [LLAMA, SMOL], ids=["llama3-8b", "smollm2"])
@pytest.mark.parametrize("block_size", [16, 128])
def test_prefill_attention_with_prefix_and_decode_rows(model, block_size):
    from pagecast.kernels.paged_prefill_attention import paged_prefill_attention

    seq_lens = [700, 1, 300, 2100, 33]
    q_lens = [700, 1, 77, 1, 20]  # a whole prompt, a first token, a chunk over a prefix, decode rows
    x = paged_inputs(seq_lens, q_lens, block_size=block_size, **model)
    scale = model["head_dim"] ** -0.5
    assert rel_err(paged_prefill_attention(**x, scale=scale), ref_attention(x, scale)) < 1e-2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("block_size", [16, 128])
def test_prefill_attention_every_tuned_config(block_size, dtype):
    """Every tile the tuner may pick at the Llama-3-8B shape, launch options included, against the
    reference; POLY_EXP2's (one exp2 in four by inline PTX on the FMA pipe) also against the same
    tile without it: the polynomial's 1e-4 relative error sits well inside the half-type rounding.
    Sharpened scores (q x 4) put most of each softmax's weight on a few keys."""
    from pagecast.kernels import paged_prefill_attention as ppa

    seq_lens = [700, 1, 300, 2100, 33]
    q_lens = [700, 1, 77, 1, 20]
    x = {k: v.to(dtype) if v.is_floating_point() else v
         for k, v in paged_inputs(seq_lens, q_lens, block_size=block_size, **LLAMA).items()}  # fmt: skip
    x["q"] = x["q"] * 4
    scale = LLAMA["head_dim"] ** -0.5
    expected = ref_attention(x, scale)
    space = ppa.prune_configs(ppa.CONFIG_SPACE, 4, LLAMA["head_dim"])
    assert any(c.params.get("POLY_EXP2") for c in space)
    for cfg in space:
        out = ppa.paged_prefill_attention(**x, scale=scale, config=cfg)
        assert rel_err(out, expected) < 1e-2, cfg
        if cfg.params.get("POLY_EXP2"):
            twin = {k: v for k, v in cfg.as_dict().items() if k != "POLY_EXP2"}
            assert rel_err(out, ppa.paged_prefill_attention(**x, scale=scale, config=twin)) < 5e-3, cfg


@pytest.mark.parametrize("qk_norm", [False, True], ids=["plain", "qk-norm"])
@pytest.mark.parametrize("model", [LLAMA, SMOL], ids=["llama3-8b", "smollm2"])
def test_rotary_and_write_kv(model, qk_norm):
    from pagecast.kernels.rotary_kv import rotary_and_write_kv

    h, kvh, d = model["num_heads"], model["num_kv_heads"], model["head_dim"]
    t, bs = 300, 16
    params = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}  # fmt: skip
    cos_sin = rope.cos_sin_cache(params, d, 16384).cuda()
    qkv = torch.randn(t, (h + 2 * kvh) * d, device="cuda", dtype=DT)
    q = qkv[:, : h * d].view(t, h, d)
    k = qkv[:, h * d : (h + kvh) * d].view(t, kvh, d)
    v = qkv[:, (h + kvh) * d :].view(t, kvh, d)
    positions = torch.randint(0, 16384, (t,), device="cuda")
    slots = torch.randperm(40 * bs, device="cuda")[:t]
    slots[::7] = -1
    k_cache = torch.randn(40, kvh, bs, d, device="cuda", dtype=DT)
    v_cache = torch.randn_like(k_cache)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    norms, q_in, k_in = {}, q, k
    if qk_norm:  # Qwen3's per-head q/k RMSNorm, in the same launch
        norms = {"q_norm": 1 + 0.3 * torch.randn(d, device="cuda", dtype=DT),
                 "k_norm": 1 + 0.3 * torch.randn(d, device="cuda", dtype=DT), "qk_norm_eps": 1e-6}  # fmt: skip
        q_in, k_in = reference.rms_norm(q, norms["q_norm"], 1e-6), reference.rms_norm(k, norms["k_norm"], 1e-6)
    q_ref = reference.rotary_and_write_kv(positions, q_in, k_in, v, cos_sin, k_ref, v_ref, slots)
    q_out = rotary_and_write_kv(positions, q, k, v, cos_sin, k_cache, v_cache, slots, **norms)
    torch.testing.assert_close(q_out, q_ref, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(k_cache, k_ref, atol=2e-2, rtol=2e-2)
    assert torch.equal(v_cache, v_ref)


@pytest.mark.parametrize("hidden,intermediate", [(4096, 14336), (576, 1536)])
def test_norms_and_activation(hidden, intermediate):
    from pagecast.kernels.activation import silu_and_mul
    from pagecast.kernels.rms_norm import fused_add_rms_norm, rms_norm

    x = torch.randn(77, hidden, device="cuda", dtype=DT)
    res = torch.randn_like(x)
    w = torch.randn(hidden, device="cuda", dtype=DT)
    torch.testing.assert_close(rms_norm(x, w, 1e-5), reference.rms_norm(x, w, 1e-5))
    out, new_res = fused_add_rms_norm(x, res, w, 1e-5)
    ref_out, ref_res = reference.fused_add_rms_norm(x, res, w, 1e-5)
    torch.testing.assert_close(out, ref_out)
    assert torch.equal(new_res, ref_res)
    gate_up = torch.randn(77, 2 * intermediate, device="cuda", dtype=DT)
    torch.testing.assert_close(silu_and_mul(gate_up), reference.silu_and_mul(gate_up))


def test_ops_dispatch_with_a_tuning_table():
    table = {
        "kernels": {
            "paged_decode_attention": {
                "8x8192": {"config": {"BLOCK_N": 128, "num_splits": 8, "num_warps": 8, "num_stages": 2}}
            },
            "paged_prefill_attention": {
                "t2048": {"config": {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 2}}
            },
            "rms_norm": {"t8": {"config": {"num_warps": 8, "num_stages": 1}}},
        }
    }
    ops.configure(table)
    split = ops.MIN_SPLIT_DECODES
    try:
        x = paged_inputs(DECODE_LENS, [1] * len(DECODE_LENS), block_size=16, **LLAMA)
        out = ops.paged_attention(**x, scale=0.088, max_query_len=1, max_seq_len=max(DECODE_LENS))
        assert rel_err(out, ref_attention(x, 0.088)) < 1e-2
        x = paged_inputs([900, 1000], [900, 1000], block_size=16, **LLAMA)
        out = ops.paged_attention(**x, scale=0.088, max_query_len=1000, max_seq_len=1000)
        assert rel_err(out, ref_attention(x, 0.088)) < 1e-2
        # A mixed step with the split on: 64 of its 67 leading decodes through the decode kernel.
        lens = [300 + 7 * i for i in range(67)] + [513, 200]
        x = paged_inputs(lens, [1] * 67 + [513, 50], block_size=16, **LLAMA)
        ops.MIN_SPLIT_DECODES = 64
        out = ops.paged_attention(**x, scale=0.088, max_query_len=513, max_seq_len=max(lens), num_decodes=67)
        assert rel_err(out, ref_attention(x, 0.088)) < 1e-2
        h = torch.randn(5, 4096, device="cuda", dtype=DT)
        w = torch.randn(4096, device="cuda", dtype=DT)
        torch.testing.assert_close(ops.rms_norm(h, w, 1e-5), reference.rms_norm(h, w, 1e-5))
        gate_up = torch.randn(5, 2 * 1536, device="cuda", dtype=DT)
        torch.testing.assert_close(ops.silu_and_mul(gate_up), reference.silu_and_mul(gate_up))
    finally:
        ops.configure(None)
        ops.MIN_SPLIT_DECODES = split


def test_decode_attention_in_a_cuda_graph():
    # Capture with one set of lengths and tables, replay with others: nothing may be baked in.
    batch, max_len, bs = 8, 4096, 16
    ops.configure(tuning.default_table(torch.cuda.get_device_name()))
    try:
        first = paged_inputs([max_len] * batch, [1] * batch, block_size=bs, **LLAMA)
        static = {k: v.clone() for k, v in first.items()}
        scale = 128**-0.5
        ops.paged_attention(**static, scale=scale, max_query_len=1, max_seq_len=max_len)  # warm up / compile
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = ops.paged_attention(**static, scale=scale, max_query_len=1, max_seq_len=max_len)
        for seed, lens in ((1, [1, 4096, 17, 300, 2049, 5, 4000, 64]), (2, [4096] * batch)):
            x = paged_inputs(lens, [1] * batch, block_size=bs, seed=seed, **LLAMA)
            static["q"].copy_(x["q"])
            static["seq_lens"].copy_(x["seq_lens"])
            static["block_tables"][:, : x["block_tables"].shape[1]].copy_(x["block_tables"])
            n = min(x["k_cache"].shape[0], static["k_cache"].shape[0])
            static["k_cache"][:n].copy_(x["k_cache"][:n])
            static["v_cache"][:n].copy_(x["v_cache"][:n])
            graph.replay()
            torch.cuda.synchronize()
            assert rel_err(out, ref_attention(static, scale)) < 1e-2
    finally:
        ops.configure(None)


def test_tune_smoke():
    shapes = tuning.ModelShapes(9, 3, 64, 576, 1536, 16, "bfloat16", 2048, 8)
    table = tuning.tune(["rms_norm", "paged_decode_attention", "skinny_gemm"], shapes, budget_s=20.0)
    decode = table["kernels"]["paged_decode_attention"]
    assert set(decode) == {"1x512", "1x2048", "8x512", "8x2048"}
    for entry in decode.values():
        assert entry["time_us"] > 0 and "num_splits" in entry["config"]
    rows = tuning.bandwidth_report(table, shapes, tuning.measure_copy_bandwidth(nbytes=1 << 28))
    assert {r["kernel"] for r in rows} == {"rms_norm", "paged_decode_attention", "skinny_gemm"}
    assert set(table["kernels"]["skinny_gemm"]) == {f"{p}.m{m}" for p in ("qkv", "o", "gate_up", "down") for m in (1, 2, 4, 8)}


@pytest.mark.parametrize("rows", [1, 5, 16])
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 4096), (4096, 14336), (960, 576)])
def test_skinny_gemm_every_config(rows, n, k):
    from pagecast.kernels import skinny_gemm as sg

    g = torch.Generator(device="cuda").manual_seed(rows)
    x = torch.randn(rows, k, device="cuda", dtype=DT, generator=g)
    w = torch.randn(n, k, device="cuda", dtype=DT, generator=g) * k**-0.5
    b = torch.randn(n, device="cuda", dtype=DT, generator=g)
    expected = torch.nn.functional.linear(x.float(), w.float(), b.float())
    configs = sg.prune_configs(sg.CONFIG_SPACE, n, k)
    assert len(configs) > 1
    for cfg in configs:
        assert rel_err(sg.skinny_gemm(x, w, b, cfg), expected) < 1e-2, cfg


@pytest.mark.parametrize("o_config", [{"torch": 1}, {"BLOCK_N": 16, "BLOCK_K": 256, "SPLIT_K": 4, "num_warps": 4, "num_stages": 4}])
def test_skinny_gemm_through_ops_in_a_cuda_graph(o_config):
    # The table picks the Triton kernel for qkv at batch 1 and cuBLAS (or the split-K kernel, which
    # reduces in its launch through the shared counters) for o; both replay in a graph, twice.
    cfg = {"BLOCK_N": 16, "BLOCK_K": 256, "num_warps": 4, "num_stages": 4}
    ops.configure({"kernels": {"skinny_gemm": {"qkv.m1": {"config": cfg}, "o.m1": {"config": o_config}}}})
    try:
        x = torch.randn(1, 4096, device="cuda", dtype=DT)
        w_qkv = torch.randn(6144, 4096, device="cuda", dtype=DT) * 4096**-0.5
        w_o = torch.randn(4096, 6144, device="cuda", dtype=DT) * 6144**-0.5
        ops.linear(ops.linear(x, w_qkv, None, "qkv"), w_o, None, "o")  # compile outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = ops.linear(ops.linear(x, w_qkv, None, "qkv"), w_o, None, "o")
        for _ in range(2):
            x.copy_(torch.randn(1, 4096, device="cuda", dtype=DT))
            graph.replay()
            torch.cuda.synchronize()
            expected = torch.nn.functional.linear(torch.nn.functional.linear(x.float(), w_qkv.float()), w_o.float())
            assert rel_err(out, expected) < 2e-2
    finally:
        ops.configure(None)
