"""Long-context prefill buckets (issue 32). A chunk of a long prompt has every query tile read the
whole cached prefix, which is not what the plain prefill buckets time (sequences of 2,048 tokens, all
new). Models whose max_model_len passes PREFILL_SHORT_CONTEXT get '.c<context>' buckets, timed on
the last t tokens of one sequence of that context, and serving picks them by the step's longest
sequence; a table without them (built before) runs the plain bucket's config."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from pagecast.kernels import ops, paged_prefill_attention, problems, reference, tuning

LLAMA = {"num_heads": 32, "num_kv_heads": 8, "head_dim": 128, "hidden": 4096, "intermediate": 14336, "block_size": 16}


def test_bucket_names():
    assert tuning.prefill_bucket(300) == "t512"
    assert tuning.prefill_bucket(300, 8192) == "t512"  # up to the short context: the plain bucket
    assert tuning.prefill_bucket(8192, 8193) == "t8192.c32768"
    assert tuning.prefill_bucket(5000, 40000) == "t8192.c131072"
    assert tuning.prefill_bucket(100, 500_000) == "t128.c131072"  # clamped to the last bucket
    assert tuning.bucket_for("paged_prefill_attention", num_tokens=2000, max_seq_len=30000) == "t2048.c32768"


def test_a_long_context_model_is_tuned_at_its_contexts():
    short = tuning.ModelShapes(**LLAMA, max_model_len=8192)
    assert [b for b, _ in problems.buckets("paged_prefill_attention", short)] == ["t128", "t512", "t2048", "t8192"]
    long = tuning.ModelShapes(**LLAMA, max_model_len=40960)
    buckets = dict(problems.buckets("paged_prefill_attention", long))
    assert list(buckets) == ["t128", "t512", "t2048", "t8192"] + [
        f"t{t}.c{c}" for c in (32768, 131072) for t in (128, 512, 2048, 8192)
    ]
    assert buckets["t8192.c32768"] == {"num_tokens": 8192, "max_seq_len": 32768}
    assert buckets["t512.c131072"] == {"num_tokens": 512, "max_seq_len": 40960}  # capped at the model's
    # Every bucket name is the one serving computes for its dims.
    assert all(tuning.bucket_for("paged_prefill_attention", **d) == b for b, d in buckets.items())
    # Causal attention of the last t rows of a c-token sequence: each row at position p reads p + 1 keys.
    t, c, h, d = 8192, 32768, 32, 128
    nbytes, flops = problems.problem_size("paged_prefill_attention", long, buckets["t8192.c32768"])
    assert flops == 4 * h * d * t * (c - t) + 2 * h * d * t * t
    assert abs(flops - 4 * h * d * sum(range(c - t + 1, c + 1))) / flops < 1e-3
    assert nbytes == t * 2 * h * 2 * d + c * 2 * 8 * 2 * d  # q in and out, the prefix's K and V once


def test_the_problem_is_the_last_tokens_of_one_long_sequence(monkeypatch):  # type: ignore[no-untyped-def]
    shapes = tuning.ModelShapes(4, 2, 16, 64, 128, 16, "float32", max_model_len=9000)
    dims = dict(problems.buckets("paged_prefill_attention", shapes))["t128.c32768"]
    assert dims == {"num_tokens": 128, "max_seq_len": 9000}
    seen = {}

    def launch(q, k_cache, v_cache, table, seq_lens, qsl, scale, config=None, out=None, **kw):  # type: ignore[no-untyped-def]
        seen.update(q=q.shape, table=table.shape, seq_lens=seq_lens.tolist(), qsl=qsl.tolist(), blocks=table[0])
        return reference.paged_attention(q, k_cache, v_cache, table, seq_lens, qsl, scale)

    monkeypatch.setattr(paged_prefill_attention, "paged_prefill_attention", launch)
    out = problems.make_problem("paged_prefill_attention", shapes, dims, "cpu").launch(None, 0)
    assert seen["q"] == (128, 4, 16) and seen["seq_lens"] == [9000] and seen["qsl"] == [0, 128]
    assert seen["table"] == (1, -(-9000 // 16)) and len(set(seen["blocks"].tolist())) == seen["table"][1]
    assert out.shape == (128, 4, 16) and torch.isfinite(out).all()


def test_serving_picks_the_context_bucket_and_falls_back(monkeypatch):  # type: ignore[no-untyped-def]
    short_cfg = {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2}
    long_cfg = {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 3}
    used: list = []
    kernels = SimpleNamespace(prefill=lambda *a, **kw: used.append(a[7]), decode=None)
    monkeypatch.setattr(ops, "_kernels", lambda: kernels)
    monkeypatch.setattr(ops, "_triton", lambda x: True)
    q = torch.zeros(8192, 4, 16)

    def prefill(max_seq_len: int) -> dict:
        ops.paged_attention(q, None, None, None, torch.zeros(1), None, 0.25, max_query_len=8192, max_seq_len=max_seq_len)
        return used[-1].as_dict()

    table = {"kernels": {"paged_prefill_attention": {"t8192": {"config": short_cfg}, "t8192.c32768": {"config": long_cfg}}}}
    ops.configure(table)
    try:
        assert prefill(8192) == short_cfg
        assert prefill(20000) == long_cfg
        assert prefill(100_000) == short_cfg  # no c131072 entry: an older table's plain bucket
    finally:
        ops.configure(None)
