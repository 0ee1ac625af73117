"""builder/quant.py: reading AWQ / GPTQ tensors, the exact dequantization, the repacked layout and
its tensor-parallel split, and the configs refused at build time (with messages naming why)."""

from __future__ import annotations

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


def test_split_int4_column_and_row_parallel_compose_to_the_whole():
    w = _packed(Format("awq", 32), 48, 256)
    x = torch.randn(2, 256)
    full = reference.w4a16_linear(x, w.qweight, w.scales, w.zeros, w.perm, w.group_size)

    def apply(s: quant.Int4Weight, xs: torch.Tensor) -> torch.Tensor:
        return reference.w4a16_linear(xs, s.qweight, s.scales, s.zeros, s.perm, s.group_size)

    cols = torch.cat([apply(quant.split_int4(w, 0, r, 2), x) for r in range(2)], dim=1)
    torch.testing.assert_close(cols, full)
    # A fused weight (q 32 | k 8 | v 8 columns) splits each section: rank r holds q_r | k_r | v_r.
    shards = [apply(quant.split_int4(w, 0, r, 2, sections=(32, 8, 8)), x) for r in range(2)]
    q, k, v = full.split([32, 8, 8], dim=1)
    for r, shard in enumerate(shards):
        expected = torch.cat([part.chunk(2, dim=1)[r] for part in (q, k, v)], dim=1)
        torch.testing.assert_close(shard, expected)
    rows = sum(apply(quant.split_int4(w, 1, r, 4), x[:, r * 64 : (r + 1) * 64]) for r in range(4))
    torch.testing.assert_close(rows, full, atol=1e-5, rtol=1e-5)
    with pytest.raises(BuildError, match="would cut a quantisation group"):
        quant.split_int4(w, 1, 0, 16)  # 16 inputs per rank < group of 32
    actorder = _packed(Format("gptq", 32, sym=True, desc_act=True), 48, 256)
    with pytest.raises(BuildError, match="act-order permutation mixes inputs"):
        quant.split_int4(actorder, 1, 0, 2)


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
