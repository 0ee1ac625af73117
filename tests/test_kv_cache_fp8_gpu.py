"""FP8 (e4m3fn) KV cache on the GPU (run with ``pytest -m gpu``): the bf16 kernels over fp8 caches
at Llama-3-8B and SmolLM2 shapes against the torch reference (every pruned decode config,
split and direct), the rotary kernel's fp8 write, tuning on fp8 caches, and engines built with
--kv-cache-dtype fp8: teacher-forced logits against the model-dtype cache, CUDA graphs giving
the eager tokens, and SmolLM2's perplexity change (printed)."""

from __future__ import annotations

import json
import math

import pytest
import torch
from conftest import build_artifact
from engine_utils import assert_graphs_match_eager
from kv_cache_support import logit_agreement, teacher_forced_logits
from tiny_models import make_checkpoint

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

from test_kernels_gpu import DT, LLAMA, SMOL, rel_err  # the half-cache GPU tests' shapes and measure

from pagecast.kernels import reference, rope, tuning
from pagecast.kernels.reference import FP8_DTYPE, quantize_kv


def fp8_paged_inputs(
    seq_lens, q_lens, num_heads, num_kv_heads, head_dim, block_size, k_scale, v_scale, seed=0
):  # type: ignore[no-untyped-def]
    g = torch.Generator(device="cuda").manual_seed(seed)
    blocks = [-(-s // block_size) for s in seq_lens]
    pool = sum(blocks) + 5
    shape = (pool, num_kv_heads, block_size, head_dim)
    k_cache = quantize_kv(torch.randn(shape, generator=g, device="cuda") * 40 * k_scale, FP8_DTYPE, k_scale)
    v_cache = quantize_kv(torch.randn(shape, generator=g, device="cuda") * 40 * v_scale, FP8_DTYPE, v_scale)
    perm = torch.randperm(pool, generator=g, device="cuda")
    table = torch.full((len(seq_lens), max(blocks) + 3), pool - 1, dtype=torch.int32, device="cuda")
    used = 0
    for i, n in enumerate(blocks):
        table[i, :n] = perm[used : used + n]
        used += n
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    q = torch.randn(int(qsl[-1]), num_heads, head_dim, generator=g, device="cuda", dtype=DT)
    return {
        "q": q, "k_cache": k_cache, "v_cache": v_cache, "block_tables": table,
        "seq_lens": torch.tensor(seq_lens, dtype=torch.int32, device="cuda"), "query_start_loc": qsl,
    }  # fmt: skip


def ref(x: dict, scale: float, k_scale: float, v_scale: float) -> torch.Tensor:
    return reference.paged_attention(
        x["q"], x["k_cache"], x["v_cache"], x["block_tables"], x["seq_lens"], x["query_start_loc"], scale,
        k_scale, v_scale,
    )  # fmt: skip


@pytest.mark.parametrize("shape", [LLAMA, SMOL], ids=["llama3-8b", "smollm2"])
def test_decode_every_config_over_fp8(shape):  # type: ignore[no-untyped-def]
    from pagecast.kernels import paged_decode_attention as dec

    k_scale, v_scale = 0.02, 0.05
    seq_lens = [1, 17, 300, 2049, 4000]
    x = fp8_paged_inputs(
        seq_lens, [1] * len(seq_lens), **shape, block_size=16, k_scale=k_scale, v_scale=v_scale
    )
    scale = shape["head_dim"] ** -0.5
    expected = ref(x, scale, k_scale, v_scale)
    configs = dec.prune_configs(
        dec.FP8_CONFIG_SPACE, len(seq_lens), max(seq_lens), shape["num_kv_heads"],
        tuning.num_sms(),
    )  # what the tuner times over an fp8 cache: the pair, word and byte reads, one- to four-warp variants
    assert {c["num_splits"] for c in configs} > {1} and {c.num_warps for c in configs} >= {1, 2, 4}
    assert {c.params.get("fp8_words", 1) for c in configs} == {0, 1, 2}
    for cfg in configs:
        out = dec.paged_decode_attention(**x, scale=scale, max_seq_len=max(seq_lens), config=cfg,
                                         k_scale=k_scale, v_scale=v_scale)  # fmt: skip
        assert rel_err(out, expected) < 1e-2, cfg


@pytest.mark.parametrize("shape", [LLAMA, SMOL], ids=["llama3-8b", "smollm2"])
def test_prefill_every_config_over_fp8(shape):  # type: ignore[no-untyped-def]
    from pagecast.kernels import paged_prefill_attention as pre

    k_scale, v_scale = 0.03, 0.01
    x = fp8_paged_inputs(
        [700, 33, 2048], [300, 33, 1], **shape, block_size=16, k_scale=k_scale, v_scale=v_scale
    )
    scale = shape["head_dim"] ** -0.5
    expected = ref(x, scale, k_scale, v_scale)
    group = shape["num_heads"] // shape["num_kv_heads"]
    for cfg in pre.prune_configs(pre.CONFIG_SPACE, group, shape["head_dim"]):
        out = pre.paged_prefill_attention(**x, scale=scale, config=cfg, k_scale=k_scale, v_scale=v_scale)
        assert rel_err(out, expected) < 1e-2, cfg
    # STAGE: one sequence (a 1,500-token prefix, 548 new) through the fp16 stage, the same bits as
    # the tile reading the fp8 cache
    x = fp8_paged_inputs([2048], [548], **shape, block_size=16, k_scale=k_scale, v_scale=v_scale)
    expected = ref(x, scale, k_scale, v_scale)
    for cfg in pre.prune_configs(pre.STAGE_TILES, group, shape["head_dim"]):
        out = pre.paged_prefill_attention(**x, scale=scale, config=cfg, k_scale=k_scale, v_scale=v_scale)
        assert rel_err(out, expected) < 1e-2, cfg
        direct = {k: v for k, v in cfg.as_dict().items() if k != "STAGE"}
        assert torch.equal(out, pre.paged_prefill_attention(**x, scale=scale, config=direct, k_scale=k_scale, v_scale=v_scale)), cfg


def test_rotary_fp8_write_matches_reference():
    from pagecast.kernels.rotary_kv import rotary_and_write_kv

    t, h, kvh, d, bs = 300, 32, 8, 128, 16
    g = torch.Generator(device="cuda").manual_seed(3)
    cos_sin = rope.cos_sin_cache({"rope_type": "default", "rope_theta": 500000.0}, d, 4096).cuda()
    positions = torch.randint(0, 4096, (t,), generator=g, device="cuda")
    qkv = torch.randn(t, (h + 2 * kvh) * d, generator=g, device="cuda").to(DT) * 8
    q, k, v = (
        qkv[:, : h * d].view(t, h, d),
        qkv[:, h * d : (h + kvh) * d].view(t, kvh, d),
        qkv[:, (h + kvh) * d :].view(t, kvh, d),
    )
    slots = torch.randperm(40 * bs, generator=g, device="cuda")[:t]
    caches = [torch.zeros(40, kvh, bs, d, dtype=FP8_DTYPE, device="cuda") for _ in range(4)]
    k_scale, v_scale = 0.01, 0.02  # |x| / scale reaches 448: saturation is exercised
    reference.rotary_and_write_kv(positions, q, k, v, cos_sin, caches[0], caches[1], slots, k_scale, v_scale)
    rotary_and_write_kv(
        positions, q, k, v, cos_sin, caches[2], caches[3], slots, k_scale=k_scale, v_scale=v_scale
    )
    # V: a scaled copy, rounded to nearest even by both (cvt.rn and torch): the same codes, allowing
    # one code on a rare tie should the device round differently
    differ = caches[3].view(torch.uint8) != caches[1].view(torch.uint8)
    assert float(differ.float().mean()) < 1e-3
    assert rel_err(caches[3].float(), caches[1].float()) < 1e-3
    assert (caches[3].float().abs() == 448).any() and torch.isfinite(caches[2].float()).all()
    # K: rotated in fp32 by the kernel, in bf16 by the reference
    assert rel_err(caches[2].float(), caches[0].float()) < 2e-2


def test_tune_on_fp8_cache():
    shapes = tuning.ModelShapes(9, 3, 64, 576, 1536, 16, "bfloat16", 2048, 8, kv_cache_dtype="float8_e4m3fn")
    table = tuning.tune(
        ["paged_decode_attention", "paged_prefill_attention", "rotary_kv"], shapes, budget_s=30.0
    )
    assert table["shapes"]["kv_cache_dtype"] == "float8_e4m3fn"
    assert set(table["kernels"]["paged_decode_attention"]) == {"1x512", "1x2048", "8x512", "8x2048"}
    assert all(e["time_us"] > 0 for e in table["kernels"]["paged_prefill_attention"].values())


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_fp8_engine_on_gpu(tmp_path, family):  # type: ignore[no-untyped-def]
    ckpt = make_checkpoint(tmp_path / "ckpt", family, tokenizer=False)
    base = build_artifact(ckpt, tmp_path / "base", gpu="auto", dtype="bfloat16", tune_budget_s=10.0)
    fp8 = build_artifact(
        ckpt, tmp_path / "fp8", gpu="auto", dtype="bfloat16", tune_budget_s=10.0, kv_cache_dtype="fp8"
    )
    manifest = json.loads((fp8 / "manifest.json").read_text())
    assert manifest["kv_cache"]["dtype"] == "float8_e4m3fn" and manifest["target"]["tuned"]
    tokens = torch.randint(3, 49000, (200,), generator=torch.Generator().manual_seed(0)).tolist()
    agreement = logit_agreement(
        teacher_forced_logits(fp8, tokens, 160), teacher_forced_logits(base, tokens, 160)
    )
    print(f"{family} bf16: fp8 KV vs bf16 KV: {agreement}")
    assert agreement["max_rel_diff"] <= 0.75 and agreement["top1_agreement"] >= 0.8, agreement
    assert_graphs_match_eager(fp8, [tokens[:n] for n in (5, 40, 130)], 32, kv_dtype=FP8_DTYPE)


PARAGRAPH = (
    "Every spring the village by the lake held a market where farmers sold the first vegetables of the "
    "year. Children ran between the stalls while their parents argued about the price of onions and the "
    "weather of the coming summer. An old clockmaker set up his table near the fountain each year, and "
    "people brought him watches that had stopped during the winter. He opened each one carefully, cleaned "
    "the tiny gears with a soft brush and explained to the owners why the spring had lost its strength. "
    "In the afternoon a band played songs that everyone knew, and the baker handed out bread that was "
    "still warm from the oven. When the sun went down behind the hills, the lanterns were lit one by one, "
    "and the market slowly turned into a festival that lasted until midnight. The next morning the square "
    "was empty again, except for the pigeons looking for crumbs between the stones."
)


def test_smollm2_perplexity_with_fp8_cache(tmp_path, smollm2_checkpoint):  # type: ignore[no-untyped-def]
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(smollm2_checkpoint))
    ids = tok(PARAGRAPH)["input_ids"]
    results = {}
    for kv in ("auto", "fp8"):
        art = build_artifact(smollm2_checkpoint, tmp_path / kv, gpu="auto", dtype="bfloat16", tune_budget_s=20.0,
                             kv_cache_dtype=kv)  # fmt: skip
        logits = teacher_forced_logits(art, ids, len(ids) // 2)  # half prefill, half decode steps
        nll = -torch.log_softmax(logits[:-1], -1).gather(1, torch.tensor(ids[1:])[:, None]).mean()
        results[kv] = math.exp(float(nll))
    change = results["fp8"] / results["auto"] - 1
    print(
        f"SmolLM2 bf16 perplexity: bf16 KV {results['auto']:.4f}, fp8 KV {results['fp8']:.4f} ({change:+.2%})"
    )
    assert abs(change) < 0.02
