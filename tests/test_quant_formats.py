"""builder/quant.py: reading AWQ / GPTQ tensors, the exact dequantization, the repacked layout and
its tensor-parallel split, and the configs refused at build time (with messages naming why)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from quant_writer import Format, quantise

from pagecast.builder import quant
from pagecast.kernels import reference
from pagecast.runtime.errors import BuildError

FORMATS = [
    Format("awq", 32),
    Format("awq", 64),
    Format("awq", 128),
    Format("awq", -1),
    *[
        Format("gptq", g, sym=sym, desc_act=act, checkpoint_format=cf)
        for cf in ("gptq", "gptq_v2")
        for sym in (True, False)
        for act in (False, True)
        for g in (32, 128, -1)
    ],
]


def _cfg(fmt: Format) -> quant.QuantConfig:
    return quant.read_config(quant_config(fmt), None)  # type: ignore[return-value]


def quant_config(fmt: Format) -> dict:  # type: ignore[type-arg]
    from quant_writer import quantization_config

    return quantization_config(fmt)


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_reader_dequantizes_exactly_what_the_writer_packed(fmt):  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    w = torch.randn(72, 256) * 0.05  # [N, K] as nn.Linear.weight
    parts, deq = quantise(w, fmt, seed=3)
    cfg = _cfg(fmt)
    u = quant.read_module(cfg, "m", lambda name: parts[name.removeprefix("m.")] if name.removeprefix("m.") in parts
                          else (_ for _ in ()).throw(BuildError(name)))  # fmt: skip
    assert torch.equal(quant.dequantize(u.q, u.z, u.s, u.g_idx).t(), deq)
    # RTN is close to the float weights: a reader with a wrong nibble order would not be.
    assert (deq - w).abs().max() < 0.35 * w.abs().max()


@pytest.mark.parametrize("fmt", [f for f in FORMATS if f.method == "awq" or f.desc_act], ids=lambda f: f.name)
def test_repack_folds_act_order_and_fuses_along_n(fmt):  # type: ignore[no-untyped-def]
    torch.manual_seed(1)
    ws = [torch.randn(n, 128) * 0.05 for n in (64, 32, 32)]  # q, k, v of one input
    tensors: dict[str, torch.Tensor] = {}
    dense = []
    for name, w in zip("qkv", ws, strict=True):
        parts, deq = quantise(w, fmt, seed=7)  # same seed: q/k/v share one act-order permutation
        tensors.update({f"{name}.{p}": t for p, t in parts.items()})
        dense.append(deq)
    cfg = _cfg(fmt)
    packed = quant.repack_projection(cfg, "qkv_proj", ("q", "k", "v"), tensors.__getitem__, torch.float32)
    assert packed.qweight.shape == (16, 128) and packed.zeros.dtype == torch.int8
    assert (packed.perm is not None) == fmt.desc_act and packed.sections == (64, 32, 32)
    assert torch.equal(quant.dequantize_int4(packed), torch.cat(dense))
    # The kernel's reference on the permuted layout gives the float product.
    x = torch.randn(3, 128)
    y = reference.w4a16_linear(x, packed.qweight, packed.scales, packed.zeros, packed.perm, packed.group_size)
    torch.testing.assert_close(y, x @ torch.cat(dense).t(), atol=1e-5, rtol=1e-5)


def test_fused_parts_with_different_act_order_are_refused():
    fmt = Format("gptq", 32, sym=True, desc_act=True)
    tensors = {}
    for i, name in enumerate("qk"):
        parts, _ = quantise(torch.randn(32, 64), fmt, seed=i)
        tensors.update({f"{name}.{p}": t for p, t in parts.items()})
    with pytest.raises(BuildError, match="different act-order permutations"):
        quant.repack_projection(_cfg(fmt), "qkv_proj", ("q", "k"), tensors.__getitem__, torch.float16)


def _packed(fmt: Format, n: int, k: int, seed: int = 0) -> quant.Int4Weight:
    parts, _ = quantise(torch.randn(n, k) * 0.05, fmt, seed=seed)
    return quant.repack_projection(
        _cfg(fmt), "p", ("m",), lambda s: parts[s.removeprefix("m.")], torch.float32
    )


def _apply(s: quant.Int4Weight, xs: torch.Tensor) -> torch.Tensor:
    return reference.w4a16_linear(xs, s.qweight, s.scales, s.zeros, s.perm, s.group_size)


def test_split_int4_column_and_row_parallel_compose_to_the_whole():
    w = _packed(Format("awq", 32), 48, 256)
    x = torch.randn(2, 256)
    full = _apply(w, x)
    cols = torch.cat([_apply(quant.split_int4(w, 0, r, 2), x) for r in range(2)], dim=1)
    torch.testing.assert_close(cols, full)
    # A fused weight (q 32 | k 8 | v 8 columns) splits each section: rank r holds q_r | k_r | v_r.
    shards = [_apply(quant.split_int4(w, 0, r, 2, sections=(32, 8, 8)), x) for r in range(2)]
    q, k, v = full.split([32, 8, 8], dim=1)
    for r, shard in enumerate(shards):
        expected = torch.cat([part.chunk(2, dim=1)[r] for part in (q, k, v)], dim=1)
        torch.testing.assert_close(shard, expected)
    # KV heads replicated (more ranks than KV heads): both ranks take the whole k and v sections.
    fused = dataclasses.replace(w, sections=(32, 8, 8))
    for r in range(2):
        rep = quant.column_shard(fused, ((0, r, 2), None, None))
        assert rep.sections == (16, 8, 8)
        torch.testing.assert_close(_apply(rep, x), torch.cat([q.chunk(2, dim=1)[r], k, v], dim=1))
    rows = [quant.split_int4(w, 1, r, 4) for r in range(4)]
    assert all(s.perm is None and s.k == 64 and s.group_size == 32 for s in rows)  # contiguous whole groups
    torch.testing.assert_close(sum(_apply(s, x[:, r * 64 : (r + 1) * 64]) for r, s in enumerate(rows)), full,
                               atol=1e-5, rtol=1e-5)  # fmt: skip
    with pytest.raises(
        BuildError,
        match=r"--tp 16: layers.0.o_proj is row-parallel and 256 inputs / 16 ranks = 16 inputs per rank is not "
        r"a multiple of the quantisation group size 32",
    ):
        quant.split_int4(w, 1, 0, 16, name="layers.0.o_proj")


@pytest.mark.parametrize("count", [2, 4])
def test_act_order_row_split_holds_whole_groups_padded_with_zero_weights(count):  # type: ignore[no-untyped-def]
    """o_proj's act-order spreads every group over the ranks: each rank holds its own inputs of
    every group it touches, padded with zero weights, and the ranks' partial products sum to the
    whole product."""
    w = _packed(Format("gptq", 32, sym=False, desc_act=True), 48, 256)
    assert w.perm is not None
    x = torch.randn(3, 256)
    k_rank = 256 // count
    shards = [quant.split_int4(w, 1, r, count) for r in range(count)]
    assert len({s.qweight.shape for s in shards}) == 1  # one shape on every rank
    dense = quant.dequantize_int4(w)  # [N, K], original input order
    for r, s in enumerate(shards):
        assert s.group_size == 32 and s.k % 32 == 0 and s.perm is not None
        assert int(s.perm.min()) >= 0 and int(s.perm.max()) < k_rank  # the rank's own activations only
        local = quant.reference.dequantize_int4(s.qweight, s.scales, s.zeros, s.group_size)  # [N, K_local]
        # Each of the rank's activations is read by exactly one non-zero input, with the whole weight's
        # column; the padding is exactly zero.
        real = local.abs().sum(0) > 0
        assert sorted(s.perm[real].tolist()) == list(range(k_rank))
        torch.testing.assert_close(local[:, real], dense[:, r * k_rank + s.perm[real].long()], atol=0, rtol=0)
    total = sum(_apply(s, x[:, r * k_rank : (r + 1) * k_rank]) for r, s in enumerate(shards))
    torch.testing.assert_close(total, _apply(w, x), atol=1e-5, rtol=1e-5)


def test_per_channel_row_split_is_one_group_per_rank():
    w = _packed(Format("gptq", -1, sym=False, desc_act=True), 40, 192)
    x = torch.randn(2, 192)
    shards = [quant.split_int4(w, 1, r, 2) for r in range(2)]
    assert [s.group_size for s in shards] == [96, 96] and all(s.scales.shape == (1, 40) for s in shards)
    total = sum(_apply(s, x[:, r * 96 : (r + 1) * 96]) for r, s in enumerate(shards))
    torch.testing.assert_close(total, _apply(w, x), atol=1e-5, rtol=1e-5)
    with pytest.raises(BuildError, match=r"per-channel scales\) and 192 / 64 = 3 inputs per rank is not a multiple of 8"):
        quant.split_int4(w, 1, 0, 64, name="down")


def test_down_proj_act_order_folds_into_gate_up_output_order():
    """gate_up's columns renumbered by down_proj's act-order input order make the MLP's
    intermediate come out in the order down_proj's rows were sorted into: down_proj needs no perm."""
    fmt = Format("gptq", 32, sym=True, desc_act=True)
    gate, up, down = (torch.randn(n, k) * 0.05 for n, k in ((64, 96), (64, 96), (96, 64)))
    parts: dict[str, torch.Tensor] = {}
    for name, wt, seed in (("gate", gate, 1), ("up", up, 1), ("down", down, 2)):
        parts.update({f"{name}.{p}": t for p, t in quantise(wt, fmt, seed=seed)[0].items()})
    cfg = _cfg(fmt)
    gu = quant.repack_projection(cfg, "gate_up", ("gate", "up"), parts.__getitem__, torch.float32)
    dn = quant.repack_projection(cfg, "down", ("down",), parts.__getitem__, torch.float32)
    order = quant.input_order(cfg, "down", parts.__getitem__)
    assert order is not None and dn.perm is not None and torch.equal(order, dn.perm.long())
    x = torch.randn(5, 96)
    expected = _apply(dn, reference.silu_and_mul(_apply(gu, x)))
    folded = _apply(dataclasses.replace(dn, perm=None), reference.silu_and_mul(_apply(quant.permute_sections(gu, order), x)))
    torch.testing.assert_close(folded, expected, atol=1e-5, rtol=1e-5)


def test_unsorted_g_idx_without_desc_act_is_refused():
    fmt = Format("gptq", 32, sym=True, desc_act=True)
    parts, _ = quantise(torch.randn(32, 64), fmt, seed=5)
    cfg = dataclasses.replace(_cfg(fmt), desc_act=False)
    read = {f"m.{p}": t for p, t in parts.items()}.__getitem__
    with pytest.raises(BuildError, match="m.g_idx is not in group order although the quantization_config has desc_act: false"):
        quant.repack_projection(cfg, "p", ("m",), read, torch.float32)


@pytest.mark.parametrize(
    "config,requested,message",
    [
        ({"quant_method": "gptq", "bits": 3, "group_size": 128}, None, "3-bit"),
        ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, None, "'gemv' is not supported"),
        ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "exllama"}, None, "'exllama'"),
        ({"quant_method": "gptq", "bits": 4, "group_size": 128, "checkpoint_format": "marlin"}, None, "'marlin'"),
        ({"quant_method": "awq", "bits": 4, "group_size": 128, "modules_to_not_convert": ["mlp.down_proj"]}, None,
         r"modules_to_not_convert \['mlp.down_proj'\]"),
        ({"quant_method": "gptq", "bits": 4, "group_size": 128, "dynamic": {"-:.*down_proj": {}}}, None, "dynamic"),
        ({"quant_method": "gptq", "bits": 4, "group_size": 128, "lm_head": True}, None, "quantised LM head"),
        ({"quant_method": "gptq", "bits": 4, "group_size": 96}, None, "group size 96"),
        ({"quant_method": "fp8"}, None, "quant_method 'fp8'"),
        ({"quant_method": "awq", "bits": 4, "group_size": 128}, "gptq", "AWQ-quantised, not GPTQ"),
        (None, "awq", "has no quantization_config"),
    ],
)  # fmt: skip
def test_unsupported_configs_are_refused_by_name(config, requested, message):  # type: ignore[no-untyped-def]
    with pytest.raises(BuildError, match=message):
        quant.read_config(config, requested)


def test_configs_that_are_read():
    assert quant.read_config(None, None) is None
    awq = quant.read_config(
        {"quant_method": "awq", "bits": 4, "group_size": 64, "modules_to_not_convert": ["visual"]}, "awq"
    )
    assert awq == quant.QuantConfig("awq", 64, sym=False, desc_act=False, checkpoint_format="gemm")
    gptq = quant.read_config(
        {"quant_method": "gptq", "bits": 4, "group_size": -1, "desc_act": True, "sym": False}, None
    )
    assert gptq is not None and gptq.group_size_for(576) == 576 and gptq.desc_act and not gptq.sym
    dummy = quant.read_config(None, "gptq", dummy=True)
    assert dummy is not None and dummy.group_size == 128 and dummy.sym
