"""Sliding-window and soft-capped attention (Gemma 2/3) in both paged attention kernels, and the
GELU-tanh gated activation, against the torch reference (the Triton interpreter without a GPU).

The reference itself is checked against a dense masked softmax written out here, so the
kernels are held to the definition transformers uses: a query at position p sees keys
p - window < k <= p, and the scaled scores s become cap * tanh(s / cap) before the mask.
"""

from __future__ import annotations

import pytest
import torch
from test_kernels import close, paged_inputs

from pagecast.kernels import ops, reference
from pagecast.kernels.activation import gelu_tanh_and_mul
from pagecast.kernels.paged_decode_attention import paged_decode_attention
from pagecast.kernels.paged_prefill_attention import paged_prefill_attention


def ref(x: dict, scale: float, softcap: float, window: int) -> torch.Tensor:
    return reference.paged_attention(
        x["q"], x["k_cache"], x["v_cache"], x["block_tables"], x["seq_lens"], x["query_start_loc"], scale,
        softcap=softcap, window=window,
    )  # fmt: skip


def dense(x: dict, scale: float, softcap: float, window: int, chunk: int = 0) -> torch.Tensor:
    """The definition, one sequence and head at a time, from the gathered cache: a row at p sees
    keys p - window < k <= p (``window``) or those of its own ``chunk`` (tests/test_kernels_chunked.py)."""
    out = torch.empty_like(x["q"], dtype=torch.float32)
    qsl, lens = x["query_start_loc"].tolist(), x["seq_lens"].tolist()
    group = x["q"].shape[1] // x["k_cache"].shape[1]
    for i, seq_len in enumerate(lens):
        k = reference.gather_kv(x["k_cache"], x["block_tables"][i], seq_len).float()
        v = reference.gather_kv(x["v_cache"], x["block_tables"][i], seq_len).float()
        for t in range(qsl[i], qsl[i + 1]):
            p = seq_len - (qsl[i + 1] - t)  # this row's position
            for h in range(x["q"].shape[1]):
                s = k[h // group] @ x["q"][t, h].float() * scale
                if softcap:
                    s = softcap * torch.tanh(s / softcap)
                pos = torch.arange(seq_len)
                hidden = pos > p
                if window:
                    hidden |= pos <= p - window
                if chunk:
                    hidden |= pos // chunk != p // chunk
                s[hidden] = float("-inf")
                out[t, h] = torch.softmax(s, 0) @ v[h // group]
    return out


@pytest.mark.parametrize("softcap,window", [(0.0, 5), (1.5, 0), (2.0, 17)])
def test_reference_is_the_definition(softcap, window):
    x = paged_inputs([9, 41, 30], [9, 13, 1], 4, 2, 16, 8, torch.float32)
    torch.testing.assert_close(
        ref(x, 0.3, softcap, window), dense(x, 0.3, softcap, window), atol=1e-5, rtol=1e-5
    )
    decode = paged_inputs([9, 41, 30], [1, 1, 1], 4, 2, 16, 8, torch.float32)
    torch.testing.assert_close(
        ref(decode, 0.3, softcap, window), dense(decode, 0.3, softcap, window), atol=1e-5, rtol=1e-5
    )
    # the parts change the result, so the kernel checks below cannot pass without them
    assert (ref(x, 0.3, softcap, window) - ref(x, 0.3, 0.0, 0)).abs().max() > 1e-2


DECODE_CASES = [
    # (num_heads, num_kv_heads, head_dim, block_size, seq_lens, config, softcap, window)
    pytest.param(4, 4, 16, 8, [1, 9, 41], {"BLOCK_N": 16, "num_splits": 1}, 2.0, 8, id="direct-both"),
    pytest.param(
        9, 3, 64, 16, [1, 9, 41, 341], {"BLOCK_N": 32, "num_splits": 4}, 0.0, 37, id="group3-split4-window"
    ),
    pytest.param(
        8, 2, 16, 8, [341, 9, 100], {"BLOCK_N": 16, "num_splits": 8}, 1.5, 0, id="group4-split8-softcap"
    ),
    pytest.param(
        6, 2, 24, 8, [341, 64, 65], {"BLOCK_N": 32, "num_splits": 2}, 3.0, 64, id="odd-head-dim-window-64"
    ),
    pytest.param(
        6, 2, 24, 8, [341, 64, 65], {"BLOCK_N": 32, "num_splits": 2, "merge": 1}, 3.0, 64, id="odd-head-dim-merge"
    ),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_dim,block_size,seq_lens,config,softcap,window", DECODE_CASES
)
def test_decode_window_and_softcap(
    num_heads, num_kv_heads, head_dim, block_size, seq_lens, config, softcap, window, dtype
):  # type: ignore[no-untyped-def]
    x = paged_inputs(seq_lens, [1] * len(seq_lens), num_heads, num_kv_heads, head_dim, block_size, dtype)
    scale = head_dim**-0.5
    out = paged_decode_attention(
        **x, scale=scale, max_seq_len=max(seq_lens), config=config, softcap=softcap, window=window
    )
    close(out, ref(x, scale, softcap, window), dtype)


PREFILL_CASES = [
    # (num_heads, num_kv_heads, head_dim, block_size, seq_lens, q_lens, config, softcap, window)
    pytest.param(
        4, 4, 16, 8, [9, 41, 17], [9, 41, 17], {"BLOCK_M": 16, "BLOCK_N": 16}, 2.0, 8, id="mha-both"
    ),
    pytest.param(
        9,
        3,
        64,
        16,
        [50, 41, 9],
        [7, 1, 9],
        {"BLOCK_M": 32, "BLOCK_N": 16},
        0.0,
        5,
        id="group3-prefix-window5",
    ),
    pytest.param(
        8,
        2,
        16,
        8,
        [1, 90, 33],
        [1, 37, 20],
        {"BLOCK_M": 16, "BLOCK_N": 32},
        1.5,
        19,
        id="group4-chunked-both",
    ),
    pytest.param(
        6, 2, 24, 8, [130, 70], [100, 70], {"BLOCK_M": 32, "BLOCK_N": 16}, 0.0, 33, id="odd-long-window"
    ),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_dim,block_size,seq_lens,q_lens,config,softcap,window", PREFILL_CASES
)
def test_prefill_window_and_softcap(
    num_heads, num_kv_heads, head_dim, block_size, seq_lens, q_lens, config, softcap, window, dtype
):  # type: ignore[no-untyped-def]
    x = paged_inputs(seq_lens, q_lens, num_heads, num_kv_heads, head_dim, block_size, dtype)
    scale = head_dim**-0.5
    out = paged_prefill_attention(**x, scale=scale, config=config, softcap=softcap, window=window)
    close(out, ref(x, scale, softcap, window), dtype)


def test_ops_pass_window_and_softcap_to_both_kernels(monkeypatch):
    """A mixed step split between the kernels gives each the layer's window and soft-cap."""
    monkeypatch.setattr(ops, "_triton", lambda x: True)
    seq_lens = [5 + i % 30 for i in range(64)] + [40, 9]
    x = paged_inputs(seq_lens, [1] * 64 + [40, 9], 4, 2, 16, 8, torch.float32)
    out = ops.paged_attention(
        **x, scale=0.2, max_query_len=40, max_seq_len=40, num_decodes=64, softcap=2.0, window=7
    )
    close(out, ref(x, 0.2, 2.0, 7), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("d,config", [(40, {"BLOCK": 16, "num_warps": 1}), (100, None)])
def test_gelu_tanh_and_mul(dtype, d, config):
    x = (torch.randn(5, 2 * d, generator=torch.Generator().manual_seed(3)) * 4).to(dtype)
    x[0, :4] = torch.tensor([30.0, -30.0, 0.0, 1e-3])  # saturated tanh both ways, zero, tiny
    close(gelu_tanh_and_mul(x, config), reference.gelu_tanh_and_mul(x), dtype)


def test_tuner_times_the_models_soft_cap_and_activation(monkeypatch):
    """The tune pass times (and so compiles into the artifact) the variants the model runs."""
    from pagecast.kernels import activation, paged_decode_attention, paged_prefill_attention, problems, tuning

    seen: list[tuple[str, object]] = []
    for module, name in (
        (paged_decode_attention, "paged_decode_attention"),
        (paged_prefill_attention, "paged_prefill_attention"),
    ):
        monkeypatch.setattr(module, name, lambda *a, softcap=0.0, _n=name, **k: seen.append((_n, softcap)))
    monkeypatch.setattr(
        activation, "gelu_tanh_and_mul", lambda x, config=None: seen.append(("gelu_tanh", None))
    )
    shapes = tuning.ModelShapes(
        4, 2, 16, 64, 128, 8, "float32", 64, 4, attn_softcap=50.0, activation="gelu_tanh"
    )
    for kernel, dims in (
        ("paged_decode_attention", {"num_seqs": 2, "max_seq_len": 64}),
        ("paged_prefill_attention", {"num_tokens": 16}),
        ("silu_and_mul", {"num_tokens": 16}),
    ):
        problems.make_problem(kernel, shapes, dims, "cpu").launch(None, 0)
    assert seen == [("paged_decode_attention", 50.0), ("paged_prefill_attention", 50.0), ("gelu_tanh", None)]


def test_sliding_variants_are_compiled_at_every_config(monkeypatch):
    """The tuner times full attention only; compile_window_variants then launches both attention
    kernels with the model's window at each config the table holds and each bucket's default, so
    the SLIDING variants are in the artifact's Triton cache too (serving compiles nothing)."""
    from pagecast.kernels import paged_decode_attention, paged_prefill_attention, problems, tuning

    seen: list[tuple[str, int, tuple]] = []
    for module, name in (
        (paged_decode_attention, "paged_decode_attention"),
        (paged_prefill_attention, "paged_prefill_attention"),
    ):

        def record(*a, window=0, config=None, _n=name, **k):  # type: ignore[no-untyped-def]
            seen.append((_n, window, tuple(sorted(config.as_dict().items()))))

        monkeypatch.setattr(module, name, record)
    decode_a = {"BLOCK_N": 32, "num_splits": 1, "num_warps": 2, "num_stages": 3}
    decode_b = {"BLOCK_N": 64, "num_splits": 8, "num_warps": 4, "num_stages": 2}
    prefill_a = {"BLOCK_M": 32, "BLOCK_N": 16, "num_warps": 4, "num_stages": 2}
    table = {
        "kernels": {
            "paged_decode_attention": {"1x512": {"config": decode_a}, "8x2048": {"config": decode_b},
                                       "32x2048": {"config": decode_b}},
            "paged_prefill_attention": {"128": {"config": prefill_a}},
        }
    }  # fmt: skip
    shapes = tuning.ModelShapes(4, 2, 16, 64, 128, 8, "float32", 2048, 32, attn_window=128)
    launches = tuning.compile_window_variants(table, shapes, "cpu")
    assert launches == len(seen) and {w for _, w, _ in seen} == {128}
    launched = {(n, c) for n, _, c in seen}
    expected = {("paged_decode_attention", tuple(sorted(c.items()))) for c in (decode_a, decode_b)}
    expected |= {("paged_prefill_attention", tuple(sorted(prefill_a.items())))}
    for kernel in ("paged_decode_attention", "paged_prefill_attention"):
        for _, dims in problems.buckets(kernel, shapes):
            expected.add((kernel, tuple(sorted(problems.default_config(kernel, shapes, dims).as_dict().items()))))
    assert launched == expected and len(seen) == len(launched)  # each config once
    seen.clear()
    no_window = tuning.ModelShapes(4, 2, 16, 64, 128, 8, "float32", 2048, 32)
    assert tuning.compile_window_variants(table, no_window, "cpu") == 0 and not seen
