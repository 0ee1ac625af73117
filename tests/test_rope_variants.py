"""The rotary tables of YaRN and LongRoPE (kernels/rope.py) against transformers' own
computation of the same configs: inverse frequencies and the attention factor on cos / sin."""

from __future__ import annotations

import pytest
import torch

from pagecast.builder.lower import _rope
from pagecast.kernels import rope


def _hf(config, seq_len=None):  # type: ignore[no-untyped-def]
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    kind = config.rope_parameters["rope_type"]
    return ROPE_INIT_FUNCTIONS[kind](config, "cpu", seq_len=seq_len)


def _llama(rope_parameters, **extra):  # type: ignore[no-untyped-def]
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=64, num_attention_heads=4, head_dim=16, max_position_embeddings=4096,
        rope_parameters=rope_parameters, **extra,
    )  # fmt: skip


@pytest.mark.parametrize(
    "params",
    [
        {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 1024},
        {"rope_type": "yarn", "rope_theta": 1e6, "factor": 8.0, "original_max_position_embeddings": 512,
         "beta_fast": 16, "beta_slow": 2, "mscale": 1.0, "mscale_all_dim": 0.5},
    ],
)  # fmt: skip
def test_yarn_matches_transformers(params):
    config = _llama(params)
    spec = _rope(config, 16)
    inv_freq, factor = _hf(config)
    torch.testing.assert_close(rope.inv_frequencies(spec.params, 16), inv_freq, atol=0, rtol=1e-6)
    assert rope.attention_factor(spec.params) == pytest.approx(factor, rel=1e-12)
    table = rope.cos_sin_cache(spec.params, 16, 64)
    angles = torch.arange(64.0)[:, None] * inv_freq[None, :]
    torch.testing.assert_close(table[:, :8], angles.cos() * factor, atol=1e-6, rtol=0)


def test_longrope_matches_transformers_both_halves():
    from transformers import Phi3Config

    config = Phi3Config(
        hidden_size=64, num_attention_heads=4, max_position_embeddings=256, original_max_position_embeddings=32,
        pad_token_id=0,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                         "short_factor": [1.0 + 0.1 * i for i in range(8)], "long_factor": [1.0 + 2.0 * i for i in range(8)]},
    )  # fmt: skip
    spec = _rope(config, 16)
    short, factor = _hf(config)
    long, _ = _hf(config, seq_len=33)
    assert not torch.equal(short, long)
    assert rope.attention_factor(spec.params) == pytest.approx(factor, rel=1e-12) and factor > 1
    table = rope.cos_sin_cache(spec.params, 16, 40)
    assert table.shape == (80, 16)  # the short factors' rows, then the long ones'
    positions = torch.arange(40.0)[:, None]
    torch.testing.assert_close(table[:40, 8:], (positions * short).sin() * factor, atol=1e-6, rtol=0)
    torch.testing.assert_close(table[40:, 8:], (positions * long).sin() * factor, atol=1e-6, rtol=0)


def test_longrope_positions_pick_the_half_by_sequence_length():
    # three sequences: a decode at context 33 (long), a prefill of 5 at 20 (short), one of 2 at 40
    positions = torch.tensor([32, 15, 16, 17, 18, 19, 38, 39, 0])  # the last row pads a graph batch
    seq_lens = torch.tensor([33, 20, 40], dtype=torch.int32)
    qsl = torch.tensor([0, 1, 6, 8], dtype=torch.int32)
    rows = rope.longrope_positions(positions, seq_lens, qsl, 32, 100)
    assert rows.tolist() == [132, 15, 16, 17, 18, 19, 138, 139, 100]


def test_no_rope_table_is_the_identity():
    table = rope.cos_sin_cache(None, 16, 10)
    assert torch.equal(table[:, :8], torch.ones(10, 8)) and torch.equal(table[:, 8:], torch.zeros(10, 8))


def test_query_temperature_tables_are_transformers_scales_to_the_bit():
    """Both query temperatures (builder/ir.QueryTemperature) at every position of a 64k context:
    Llama 4's, as its attention computes it (fp32 positions), and Ministral 3's llama_4_scaling,
    its function of integer positions; each kind's formula on the other's settings differs."""
    from transformers.models.ministral3.modeling_ministral3 import get_llama_4_attn_scale

    n = 65536
    positions = torch.arange(n)
    llama4 = torch.log1p(torch.floor((positions.float() + 1.0) / 8192)) * 0.1 + 1.0  # Llama4TextAttention's
    ministral = get_llama_4_attn_scale(positions[None], 0.1, 16384).reshape(n)
    assert torch.equal(rope.query_temperature_table("llama4", 8192.0, 0.1, n), llama4)
    assert torch.equal(rope.query_temperature_table("llama_4_scaling", 16384.0, 0.1, n), ministral)
    assert not torch.equal(rope.query_temperature_table("llama4", 16384.0, 0.1, n), ministral)
    with pytest.raises(ValueError, match="unknown query temperature 'other'"):
        rope.query_temperature_table("other", 1.0, 0.1, n)
