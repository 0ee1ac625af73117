"""Attention sinks (gpt-oss) in both paged attention kernels, against the torch reference (the
Triton interpreter without a GPU; bf16 on the GPU with ``-m gpu``).

A sink is one more logit per query head in every softmax: it takes probability and gives no
value. The decode kernel must add it once per (sequence, head) whatever the split count (in the
merge of a split context, where empty splits are common under a sliding window), the prefill
kernel once per row. Sinks of both signs and large magnitude: +8 puts most of the mass on the
sink, -8 almost none.
"""

from __future__ import annotations

import pytest
import torch
from test_kernels import close, paged_inputs

from pagecast.kernels import ops, reference
from pagecast.kernels.paged_decode_attention import paged_decode_attention
from pagecast.kernels.paged_prefill_attention import paged_prefill_attention


def sinks_for(num_heads: int, kind: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Per-head sink logits: "mixed" cycles through large and small values of both signs, "high"
    is +8 everywhere (most of each row's mass on the sink)."""
    if kind == "high":
        return torch.full((num_heads,), 8.0, dtype=dtype)
    values = [8.0, -8.0, 0.5, -2.0, 3.0, 0.0, -0.7, 5.0]
    return torch.tensor([values[h % len(values)] for h in range(num_heads)], dtype=dtype)


def ref(
    x: dict, scale: float, sinks: torch.Tensor | None, softcap: float = 0.0, window: int = 0
) -> torch.Tensor:
    return reference.paged_attention(
        x["q"], x["k_cache"], x["v_cache"], x["block_tables"], x["seq_lens"], x["query_start_loc"], scale,
        softcap=softcap, window=window, sinks=sinks,
    )  # fmt: skip


def test_reference_sinks_take_mass_and_give_no_value():
    """The reference is the definition: each row's output is the sink-free output times the
    probability the real keys keep, 1 - exp(sink) / (sum_k exp(s_k) + exp(sink))."""
    x = paged_inputs([9, 41, 30], [9, 13, 1], 4, 2, 16, 8, torch.float32)
    sinks = sinks_for(4, "mixed")
    scale = 0.3
    plain = ref(x, scale, None)
    with_sinks = ref(x, scale, sinks)
    # the log-sum-exp of each row's real scores, from the reference's own softmax pieces
    qsl, lens = x["query_start_loc"].tolist(), x["seq_lens"].tolist()
    for i, seq_len in enumerate(lens):
        k = reference.gather_kv(x["k_cache"], x["block_tables"][i], seq_len).float()
        for t in range(qsl[i], qsl[i + 1]):
            p = seq_len - (qsl[i + 1] - t)
            for h in range(4):
                lse = torch.logsumexp(k[h // 2, : p + 1] @ x["q"][t, h].float() * scale, 0)
                keep = 1.0 / (1.0 + torch.exp(sinks[h] - lse))
                torch.testing.assert_close(with_sinks[t, h], plain[t, h] * keep, atol=1e-5, rtol=1e-5)
    assert (with_sinks - plain).abs().max() > 1e-2  # the kernel checks below cannot pass without sinks


DECODE_CASES = [
    # (num_heads, num_kv_heads, head_dim, block_size, seq_lens, config, window, sinks)
    pytest.param(4, 4, 16, 8, [1, 9, 41], {"BLOCK_N": 16, "num_splits": 1}, 0, "mixed", id="mha-direct"),
    pytest.param(
        8, 2, 16, 8, [1, 9, 41], {"BLOCK_N": 16, "num_splits": 1}, 8, "high", id="group4-direct-window"
    ),
    pytest.param(
        9, 3, 32, 16, [1, 9, 41, 341], {"BLOCK_N": 32, "num_splits": 4}, 0, "mixed", id="group3-split4"
    ),
    pytest.param(
        8, 2, 16, 8, [341, 9, 100], {"BLOCK_N": 16, "num_splits": 8}, 0, "high", id="group4-split8-high"
    ),
    # a window of 2 tiles split 8 ways: most splits are empty and the sink still enters once
    pytest.param(
        8, 2, 16, 8, [341, 2, 100], {"BLOCK_N": 16, "num_splits": 8}, 20, "mixed", id="group4-split8-window"
    ),
    pytest.param(
        6, 2, 24, 8, [341, 64, 65], {"BLOCK_N": 32, "num_splits": 2}, 64, "mixed", id="odd-head-dim"
    ),
    # merged in the launch: the sink enters once, in the last split's merge
    pytest.param(
        8, 2, 16, 8, [341, 2, 100], {"BLOCK_N": 16, "num_splits": 8, "merge": 1}, 20, "mixed", id="merge-in-launch"
    ),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_dim,block_size,seq_lens,config,window,sinks", DECODE_CASES
)
def test_decode_with_sinks(
    num_heads, num_kv_heads, head_dim, block_size, seq_lens, config, window, sinks, dtype
):  # type: ignore[no-untyped-def]
    x = paged_inputs(seq_lens, [1] * len(seq_lens), num_heads, num_kv_heads, head_dim, block_size, dtype)
    scale = head_dim**-0.5
    s = sinks_for(num_heads, sinks)
    out = paged_decode_attention(
        **x, scale=scale, max_seq_len=max(seq_lens), config=config, window=window, sinks=s
    )
    close(out, ref(x, scale, s, window=window), dtype)


def test_decode_sinks_with_softcap_and_bf16_sinks():
    """Soft-capping caps the scores, not the sink; sinks stored in bf16 (the artifact's dtype for
    a bf16 model) are read as such."""
    x = paged_inputs([341, 9, 100], [1, 1, 1], 8, 2, 16, 8, torch.float32)
    s = sinks_for(8, "mixed", torch.bfloat16)
    for splits in (1, 4):
        out = paged_decode_attention(
            **x,
            scale=0.25,
            max_seq_len=341,
            config={"BLOCK_N": 16, "num_splits": splits},
            softcap=2.0,
            sinks=s,
        )
        close(out, ref(x, 0.25, s, softcap=2.0), torch.float32)


def test_decode_split_count_does_not_change_the_result():
    """The sink enters once per (sequence, head): 1, 2, 8 and 32 splits agree (32 splits of a
    341-token context leave some splits empty)."""
    x = paged_inputs([341, 200], [1, 1], 4, 2, 16, 8, torch.float32)
    s = sinks_for(4, "mixed")
    outs = [
        paged_decode_attention(
            **x, scale=0.25, max_seq_len=341, config={"BLOCK_N": 16, "num_splits": n}, sinks=s
        )
        for n in (1, 2, 8, 32)
    ]
    for out in outs[1:]:
        torch.testing.assert_close(out, outs[0], atol=1e-5, rtol=1e-5)
    close(outs[0], ref(x, 0.25, s), torch.float32)


PREFILL_CASES = [
    # (num_heads, num_kv_heads, head_dim, block_size, seq_lens, q_lens, config, window, sinks)
    pytest.param(
        4, 4, 16, 8, [9, 41, 17], [9, 41, 17], {"BLOCK_M": 16, "BLOCK_N": 16}, 0, "mixed", id="mha-no-prefix"
    ),
    pytest.param(
        9, 3, 32, 16, [50, 41, 9], [7, 1, 9], {"BLOCK_M": 32, "BLOCK_N": 16}, 0, "mixed", id="group3-prefix"
    ),
    pytest.param(
        8,
        2,
        16,
        8,
        [1, 90, 33],
        [1, 37, 20],
        {"BLOCK_M": 16, "BLOCK_N": 32},
        19,
        "high",
        id="group4-chunked-window",
    ),
    pytest.param(
        6, 2, 24, 8, [130, 70], [100, 70], {"BLOCK_M": 32, "BLOCK_N": 16}, 33, "mixed", id="odd-long-window"
    ),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_dim,block_size,seq_lens,q_lens,config,window,sinks", PREFILL_CASES
)
def test_prefill_with_sinks(
    num_heads, num_kv_heads, head_dim, block_size, seq_lens, q_lens, config, window, sinks, dtype
):  # type: ignore[no-untyped-def]
    x = paged_inputs(seq_lens, q_lens, num_heads, num_kv_heads, head_dim, block_size, dtype)
    scale = head_dim**-0.5
    s = sinks_for(num_heads, sinks)
    out = paged_prefill_attention(**x, scale=scale, config=config, window=window, sinks=s)
    close(out, ref(x, scale, s, window=window), dtype)


def test_sinks_must_be_one_logit_per_query_head():
    x = paged_inputs([9], [1], 4, 2, 16, 8, torch.float32)
    with pytest.raises(ValueError, match="num_heads"):
        paged_decode_attention(**x, scale=0.25, max_seq_len=9, sinks=torch.zeros(2))
    with pytest.raises(ValueError, match="float32"):
        paged_prefill_attention(**x, scale=0.25, sinks=torch.zeros(4, dtype=torch.int32))


def test_ops_pass_sinks_to_both_kernels(monkeypatch):
    """On a GPU (the Triton path, forced here) ops.paged_attention gives the layer's sinks to the
    decode kernel, the prefill kernel and both halves of a split mixed step."""
    monkeypatch.setattr(ops, "_triton", lambda x: True)
    s = sinks_for(4, "mixed")
    decode = paged_inputs([40, 9, 120], [1, 1, 1], 4, 2, 16, 8, torch.float32)
    out = ops.paged_attention(**decode, scale=0.2, max_query_len=1, max_seq_len=120, sinks=s, window=30)
    close(out, ref(decode, 0.2, s, window=30), torch.float32)
    seq_lens = [5 + i % 30 for i in range(64)] + [40, 9]
    x = paged_inputs(seq_lens, [1] * 64 + [40, 9], 4, 2, 16, 8, torch.float32)
    out = ops.paged_attention(**x, scale=0.2, max_query_len=40, max_seq_len=40, num_decodes=64, sinks=s)
    close(out, ref(x, 0.2, s), torch.float32)


def test_tuner_times_the_sinks_variant(monkeypatch):
    """A model with sinks is timed (and so compiled into the artifact) in the HAS_SINKS variants,
    with sinks in the model's dtype, one per query head of the rank."""
    from pagecast.kernels import paged_decode_attention, paged_prefill_attention, problems, tuning

    seen: list[tuple[str, object]] = []
    for module, name in (
        (paged_decode_attention, "paged_decode_attention"),
        (paged_prefill_attention, "paged_prefill_attention"),
    ):
        monkeypatch.setattr(
            module, name, lambda *a, sinks=None, _n=name, **k: seen.append((_n, None if sinks is None else
                                                                            (tuple(sinks.shape), sinks.dtype)))
        )  # fmt: skip
    for with_sinks in (True, False):
        shapes = tuning.ModelShapes(4, 2, 16, 64, 128, 8, "float16", 64, 4, attn_sinks=with_sinks)
        problems.make_problem(
            "paged_decode_attention", shapes, {"num_seqs": 2, "max_seq_len": 64}, "cpu"
        ).launch(None, 0)
        problems.make_problem("paged_prefill_attention", shapes, {"num_tokens": 16}, "cpu").launch(None, 0)
    sink = ((4,), torch.float16)
    assert seen == [
        ("paged_decode_attention", sink), ("paged_prefill_attention", sink),
        ("paged_decode_attention", None), ("paged_prefill_attention", None),
    ]  # fmt: skip


# -- the GPU twin: bf16 at gpt-oss-20b's attention shape (64 query / 8 KV heads, head_dim 64) ------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("window", [0, 128])
@pytest.mark.parametrize("splits", [1, 8])
def test_decode_with_sinks_bf16_gpu(window, splits):  # type: ignore[no-untyped-def]
    x = {
        k: v.cuda()
        for k, v in paged_inputs([1, 17, 700, 3000], [1] * 4, 64, 8, 64, 16, torch.bfloat16).items()
    }
    s = sinks_for(64, "mixed", torch.bfloat16).cuda()
    out = paged_decode_attention(
        **x,
        scale=0.125,
        max_seq_len=3000,
        config={"BLOCK_N": 64, "num_splits": splits},
        window=window,
        sinks=s,
    )
    expected = ref(x, 0.125, s, window=window)
    assert ((out.float() - expected.float()).norm() / expected.float().norm()).item() < 2e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("window", [0, 128])
def test_prefill_with_sinks_bf16_gpu(window):  # type: ignore[no-untyped-def]
    x = {
        k: v.cuda()
        for k, v in paged_inputs([300, 1000, 17], [300, 200, 1], 64, 8, 64, 16, torch.bfloat16).items()
    }
    s = sinks_for(64, "mixed", torch.bfloat16).cuda()
    out = paged_prefill_attention(**x, scale=0.125, window=window, sinks=s)
    expected = ref(x, 0.125, s, window=window)
    assert ((out.float() - expected.float()).norm() / expected.float().norm()).item() < 2e-2
