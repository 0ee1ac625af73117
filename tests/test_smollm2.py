"""The embedded default model end to end: enginebuild --model smollm2-135m, then generation
that equals transformers on the same converted checkpoint."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from engine_utils import hf_greedy
from transformers import AutoModelForCausalLM

from pagecast.runtime import LLM, SamplingParams

pytestmark = pytest.mark.slow

PROMPTS = ["The quick brown fox", "我喜欢吃北京烤鸭，因为", "def add(a, b):", "The meaning of life is"]
IM_END = 2  # <|im_end|>: the GGUF's and generation config's EOS


@pytest.fixture(scope="module")
def llm(smollm2_artifact):  # type: ignore[no-untyped-def]
    return LLM(smollm2_artifact, max_num_batched_tokens=256)


@pytest.fixture(scope="module")
def hf_model(smollm2_checkpoint):  # type: ignore[no-untyped-def]
    model = AutoModelForCausalLM.from_pretrained(str(smollm2_checkpoint), dtype=torch.float32)
    return model.eval()


def test_manifest_records_the_embedded_model(smollm2_artifact):  # type: ignore[no-untyped-def]
    manifest = json.loads((smollm2_artifact / "manifest.json").read_text())
    assert manifest["name"] == "smollm2-135m"
    assert manifest["family"] == "llama"
    assert manifest["dims"]["num_heads"] == 9 and manifest["dims"]["num_kv_heads"] == 3
    assert manifest["eos_token_ids"] == [IM_END]
    assert (smollm2_artifact / "tokenizer" / "chat_template.jinja").is_file()


def test_greedy_matches_transformers(llm, hf_model):  # type: ignore[no-untyped-def]
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=32))
    for prompt, out in zip(PROMPTS, outputs):
        ids = llm.tokenizer.encode(prompt, add_special_tokens=False)
        assert out.token_ids == hf_greedy(hf_model, ids, 32, eos_token_id=IM_END), prompt
    assert all("\ufffd" not in out.text for out in outputs)


def test_chat_answers_paris_and_stops_at_im_end(llm):  # type: ignore[no-untyped-def]
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = llm.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=64))[0]
    assert "Paris" in out.text
    assert out.finish_reason == "stop"
    assert out.token_ids[-1] == IM_END
    assert "<|im_end|>" not in out.text and "<|im_start|>" not in out.text


def test_enginebuild_cli_builds_the_alias(tmp_path, smollm2_checkpoint):  # type: ignore[no-untyped-def]
    out = tmp_path / "smol"
    proc = subprocess.run(
        [sys.executable, "-m", "pagecast.builder.cli", "--model", "smollm2-135m", "--output", str(out), "--quiet"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(out.resolve())
    files = json.loads((out / "manifest.json").read_text())["files"]
    assert {"model.py", "weights/rank0.safetensors", "tuning.json", "memory_plan.json", "report.md"} <= set(files)
    assert not list(tmp_path.glob(".smol.tmp-*")), "the staging directory was left behind"
