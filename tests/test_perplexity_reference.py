"""The reference of benchmarks/perplexity.py's ``--reference dequant``: its own exact dequantization
of an int4 checkpoint into an fp32 transformers model. Checked against the format writer's exact
dequantization (every format it writes, act-order included) and against pagecast's reader on the
checkpoints the real tool wrote, so the perplexity parity is not measured against a wrong reference.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from quant_writer import Format, write
from safetensors.torch import load_file
from tiny_models import make_checkpoint

from pagecast.builder import quant

sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))
from perplexity import dequantize_checkpoint

FIXTURES = Path(__file__).parent / "fixtures" / "quant"
FORMATS = [
    Format("awq", group_size=32),
    Format("gptq", group_size=32, sym=True, desc_act=True),
    Format("gptq", group_size=64, sym=False, checkpoint_format="gptq_v2"),
]


@pytest.fixture(scope="module")
def float_dir(tmp_path_factory):  # type: ignore[no-untyped-def]
    path = tmp_path_factory.mktemp("ppl-ref") / "float"
    make_checkpoint(path, "llama", seed=3, tokenizer=False, vocab_size=256, hidden_size=128,
                    intermediate_size=192, num_attention_heads=4, num_key_value_heads=2, head_dim=32)  # fmt: skip
    return path


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_dequantized_checkpoint_equals_the_format_writers(float_dir, tmp_path, fmt):  # type: ignore[no-untyped-def]
    qdir, expected_dir = write(float_dir, tmp_path / fmt.name, fmt)
    out = dequantize_checkpoint(qdir, tmp_path / "deq")
    got, expected = load_file(str(out / "model.safetensors")), load_file(str(expected_dir / "model.safetensors"))
    assert "quantization_config" not in (out / "config.json").read_text()
    assert {k for k in expected if k.endswith("_proj.weight")} <= set(got) <= set(expected)
    for name, t in got.items():
        torch.testing.assert_close(t, expected[name].float(), rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("name", ["autoround-gptq-g64-asym", "autoround-awq-g128"])
def test_dequantized_real_tool_checkpoint_equals_pagecasts_reader(tmp_path, name):  # type: ignore[no-untyped-def]
    src = FIXTURES / name
    got = load_file(str(dequantize_checkpoint(src, tmp_path / "deq") / "model.safetensors"))
    cfg = quant.read_checkpoint_config(src, None, dummy=False)
    assert cfg is not None
    raw = load_file(str(src / "model.safetensors"))
    modules = sorted(k.removesuffix(".qweight") for k in raw if k.endswith(".qweight"))
    assert modules
    for module in modules:
        u = quant.read_module(cfg, module, raw.__getitem__)
        torch.testing.assert_close(got[f"{module}.weight"], quant.dequantize(u.q, u.z, u.s, u.g_idx).t().float())
