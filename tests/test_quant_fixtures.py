"""Checkpoints written by a real tool (auto-round 0.15.1: AutoGPTQ and AutoAWQ exports, committed
under tests/fixtures/quant/ by make_fixtures.py) read, built and served on the CPU in fp32.

Two checks that do not trust pagecast's reader: every dequantized weight lies within one
quantisation step of the fp16 weight it was made from (a wrong nibble order, zero offset or group
assignment is off by many steps), and the artifact's greedy tokens equal transformers running the
float model with those dequantized weights.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import build_artifact
from engine_utils import hf_greedy
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from pagecast.builder import quant
from pagecast.runtime import LLM, SamplingParams

FIXTURES = Path(__file__).parent / "fixtures" / "quant"
NAMES = ["autoround-gptq-g32-sym", "autoround-gptq-g64-asym", "autoround-awq-g128"]
PROMPTS = [[1, 50, 200, 7, 300, 11], [400, 3, 99], list(range(20, 60))]


def _modules(path: Path) -> list[str]:
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return sorted(k.removesuffix(".qweight") for k in f.keys() if k.endswith(".qweight"))


def _dequantized(name: str) -> dict[str, torch.Tensor]:
    """Projection weight name -> exact fp32 [N, K] dequantization of the fixture's tensors."""
    path = FIXTURES / name
    cfg = quant.read_checkpoint_config(path, None, dummy=False)
    assert cfg is not None
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        out = {}
        for module in _modules(path):
            u = quant.read_module(cfg, module, f.get_tensor)
            out[f"{module}.weight"] = quant.dequantize(u.q, u.z, u.s, u.g_idx).t()
    return out


@pytest.mark.parametrize("name", NAMES)
def test_dequantized_weights_are_within_one_step_of_the_float_weights(name):  # type: ignore[no-untyped-def]
    path = FIXTURES / name
    cfg = quant.read_checkpoint_config(path, None, dummy=False)
    assert cfg is not None
    modules = _modules(path)
    assert len(modules) == 3 * 7  # every projection of the 3 layers is quantised
    with (
        safe_open(str(path / "model.safetensors"), "pt") as f,
        safe_open(str(FIXTURES / "float" / "model.safetensors"), "pt") as fl,
    ):
        for module in modules:
            u = quant.read_module(cfg, module, f.get_tensor)
            deq = quant.dequantize(u.q, u.z, u.s, u.g_idx)  # [K, N]
            w = fl.get_tensor(f"{module}.weight").float().t()
            steps = (deq - w).abs() / u.s[u.g_idx].float()
            assert steps.max() <= 1.0 + 1e-3, f"{module}: {steps.max():.2f} quantisation steps off"
            assert steps.mean() < 0.35, module  # round to nearest: about a quarter of a step on average


@pytest.mark.parametrize("name", NAMES)
def test_greedy_tokens_equal_transformers_on_the_dequantized_fixture(name, tmp_path):  # type: ignore[no-untyped-def]
    artifact = build_artifact(FIXTURES / name, tmp_path / "engine", gpu="cpu")
    llm = LLM(artifact, max_num_seqs=4, max_num_batched_tokens=64)
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    hf = AutoModelForCausalLM.from_pretrained(str(FIXTURES / "float"), dtype=torch.float32).eval()
    state = hf.state_dict()
    with torch.no_grad():
        for weight, value in _dequantized(name).items():
            state[weight].copy_(value)
    for ids, out in zip(PROMPTS, outputs, strict=True):
        assert out.token_ids == hf_greedy(hf, ids, 10)
