"""The paged prefill kernel's launch options (issue 32), against the torch reference on the Triton
interpreter, with 16-key tiles over cache blocks of 8 tokens (a block id per key) and of 16 (one per
tile): HEAVY_FIRST (programs in reverse order: every query tile must still be found by the
search over sequences, once), FOLD_SCALE (the softmax scale fused into the exp2 argument; with
a soft-cap it steps aside) and PREFETCH_BLOCKS (the full-tile loop's block ids read a tile ahead:
the first tile's before the loop, none past the loop's end) and LAZY_RESCALE (acc and l rescaled
only when some row's max grew by more than 2^8; off under a window). Batches of several sequences of different lengths, cached prefixes,
decode rows and an empty query, padded GQA groups, windows, sinks and an fp8 cache.
"""

from __future__ import annotations

import pytest
import torch
from test_kernels import close, paged_inputs
from test_kv_cache_fp8_kernels import _assert_matches_reference, _paged_fp8_inputs

from pagecast.kernels import paged_prefill_attention as ppa
from pagecast.kernels import reference
from pagecast.kernels.paged_prefill_attention import paged_prefill_attention

OPTIONS = [
    # the set the tuner times (ppa._OPTION_SETS), then every option at once
    pytest.param({"HEAVY_FIRST": 1, "FOLD_SCALE": 1, "PREFETCH_BLOCKS": 1}, id="tuned-set"),
    pytest.param({"HEAVY_FIRST": 1, "FOLD_SCALE": 1, "PREFETCH_BLOCKS": 1, "LAZY_RESCALE": 1}, id="all"),
]
ALL = {"HEAVY_FIRST": 1, "FOLD_SCALE": 1, "PREFETCH_BLOCKS": 1, "LAZY_RESCALE": 1}

CASES = [
    # (num_heads, num_kv_heads, head_dim, block_size, seq_lens, q_lens, tile)
    # chunked prefill: prefixes of 0..53 cached tokens, a decode row, an empty query, lengths spanning
    # one to six query tiles, so reversed ids cross sequence boundaries of every kind
    pytest.param(
        8,
        2,
        16,
        8,
        [90, 1, 33, 12, 61],
        [37, 1, 20, 0, 61],
        {"BLOCK_M": 16, "BLOCK_N": 32},
        id="group4-chunked",
    ),
    # group 3 padded to 4 rows a token; 8 tokens a tile
    pytest.param(
        9,
        3,
        32,
        16,
        [50, 41, 9, 130],
        [7, 41, 9, 77],
        {"BLOCK_M": 32, "BLOCK_N": 16},
        id="group3-prefix-mixed",
    ),
]


def ref(x: dict, scale: float, **kw: object) -> torch.Tensor:
    return reference.paged_attention(
        x["q"],
        x["k_cache"],
        x["v_cache"],
        x["block_tables"],
        x["seq_lens"],
        x["query_start_loc"],
        scale,
        **kw,
    )  # type: ignore[arg-type]


@pytest.mark.parametrize("options", OPTIONS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,block_size,seq_lens,q_lens,tile", CASES)
def test_prefill_options_match_reference(
    num_heads, num_kv_heads, head_dim, block_size, seq_lens, q_lens, tile, dtype, options
):  # type: ignore[no-untyped-def]
    x = paged_inputs(seq_lens, q_lens, num_heads, num_kv_heads, head_dim, block_size, dtype)
    scale = head_dim**-0.5
    # NaN-filled output: a query tile that no program reaches leaves NaN rows
    poison = torch.full_like(x["q"], float("nan"))
    out = paged_prefill_attention(**x, scale=scale, config={**tile, **options}, out=poison)
    close(out, ref(x, scale), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    "softcap,window,sinks",
    [
        pytest.param(0.0, 19, False, id="window"),
        pytest.param(0.0, 19, True, id="window-sinks"),
        pytest.param(1.5, 0, False, id="softcap"),  # FOLD_SCALE steps aside: the cap needs scaled scores
        pytest.param(1.5, 33, True, id="softcap-window-sinks"),
    ],
)
@pytest.mark.parametrize("block_size", [8, 16], ids=["tile-spans-blocks", "tile-in-one-block"])
def test_prefill_options_with_window_softcap_and_sinks(softcap, window, sinks, dtype, block_size):  # type: ignore[no-untyped-def]
    x = paged_inputs([90, 1, 33, 130], [37, 1, 20, 100], 8, 2, 16, block_size, dtype)
    scale = 16**-0.5
    s = torch.tensor([8.0, -8.0, 0.5, -2.0, 3.0, 0.0, -0.7, 5.0]) if sinks else None
    config = {"BLOCK_M": 16, "BLOCK_N": 16, **ALL}
    out = paged_prefill_attention(**x, scale=scale, config=config, softcap=softcap, window=window, sinks=s)
    close(out, ref(x, scale, softcap=softcap, window=window, sinks=s), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("sharpness", [1.0, 6.0])
def test_lazy_rescale_with_growing_maxima(sharpness, dtype):  # type: ignore[no-untyped-def]
    """Sharp scores (std ~9 in log2 units at 6x): row maxima grow by more than 8 in later tiles,
    so both the rescaling and the skipping iterations run, with p up to 2^8 in the second dot."""
    x = paged_inputs([130, 70, 9], [100, 70, 1], 8, 2, 16, 8, dtype)
    x["q"] = (x["q"].float() * sharpness).to(dtype)
    scale = 16**-0.5
    config = {"BLOCK_M": 16, "BLOCK_N": 16, "LAZY_RESCALE": 1, "FOLD_SCALE": 1}
    close(paged_prefill_attention(**x, scale=scale, config=config), ref(x, scale), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_prefill_options_over_an_fp8_cache(dtype):  # type: ignore[no-untyped-def]
    """The K scale rides in qk_scale, which FOLD_SCALE now applies in the exp2 FMA and the row max."""
    k_scale, v_scale = 0.02, 0.3
    x = _paged_fp8_inputs([50, 41, 9], [7, 41, 9], 9, 3, 32, 16, dtype, k_scale, v_scale)
    scale = 32**-0.5
    config = {"BLOCK_M": 32, "BLOCK_N": 16, **ALL}
    out = paged_prefill_attention(**x, scale=scale, config=config, k_scale=k_scale, v_scale=v_scale)
    _assert_matches_reference(out, x, scale, k_scale, v_scale, dtype)


def test_config_space_offers_each_option_and_prunes_for_large_heads():
    """The tuner can pick the options at the Llama shape; at head_dim 256 it keeps the tiles it had
    and drops those whose prefetched K/V stages would outgrow shared memory."""
    space = ppa.prune_configs(ppa.CONFIG_SPACE, 4, 128)
    kept = ("HEAVY_FIRST", "FOLD_SCALE", "PREFETCH_BLOCKS")  # the H200's winners (LAZY_RESCALE lost)
    assert any(all(c.params.get(name) for name in kept) for c in space)
    assert {(c["BLOCK_M"], c["BLOCK_N"], c.num_warps, c.num_stages) for c in space} >= {
        (128, 64, 8, 4), (128, 128, 8, 3)
    }  # fmt: skip
    big = ppa.prune_configs(ppa.CONFIG_SPACE, 4, 256)
    tiles = {
        (c["BLOCK_M"], c["BLOCK_N"], c.num_warps, c.num_stages, bool(c.params.get("PREFETCH_BLOCKS")))
        for c in big
    }
    assert (128, 64, 8, 3, False) in tiles and (64, 64, 4, 2, True) in tiles
    assert not tiles & {(128, 64, 8, 3, True), (64, 64, 4, 3, True), (128, 128, 8, 2, False)}
    # the launcher's default is unchanged: the first tile, options off (old tuning tables run as before)
    assert ppa.default_config(4, 128).as_dict() == {
        "BLOCK_M": 64,
        "BLOCK_N": 64,
        "num_warps": 4,
        "num_stages": 2,
    }


def test_prefill_benchmark_dry_run_agrees_with_the_default(capsys):  # type: ignore[no-untyped-def]
    """benchmarks/prefill_attention.py --dry-run (fp32 on the interpreter): every candidate, the
    options alone and together on each tile, writes every row and matches the default config's
    output; the longer length runs the pruned set, the default among it."""
    import json
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import prefill_attention

    prefill_attention.main(["--dry-run"])
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    cands = [r for r in rows if r["figure"] == "prefill_attention_candidate"]
    short = {r["name"] for r in cands if r["tokens"] == 40}
    assert {"64x64 w4 s2 -", "64x64 w4 s2 H", "64x64 w4 s2 F", "64x64 w4 s2 P", "64x64 w4 s2 R"} <= short
    assert any(r["tokens"] == 100 and r["name"] == "64x64 w4 s2 -" for r in cands)
    assert all(r["finite"] and r["max_abs_diff_vs_default"] < 1e-5 for r in cands), [
        (r["name"], r["max_abs_diff_vs_default"])
        for r in cands
        if not r["finite"] or r["max_abs_diff_vs_default"] >= 1e-5
    ]
