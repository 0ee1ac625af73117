"""The engine end to end on a GPU (run with `pytest -m gpu` on the accelerator): Triton kernels,
tuning at build time, CUDA graphs; tiny models in fp32 give transformers' greedy tokens."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import build_artifact
from engine_utils import hf_greedy
from tiny_models import make_checkpoint

from pagecast.runtime import LLM, SamplingParams

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

PROMPTS = [[1 + (i * 37 + j * 11) % 4000 for j in range(n)] for i, n in enumerate([5, 17, 33, 64, 100, 3, 250, 9])]


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_fp32_greedy_matches_transformers_on_gpu(tmp_path, family):  # type: ignore[no-untyped-def]
    from transformers import AutoModelForCausalLM

    ckpt = make_checkpoint(tmp_path / "ckpt", family, tokenizer=False)
    art = build_artifact(ckpt, tmp_path / "art", gpu="auto", dtype="float32", tune_budget_s=10.0)
    manifest = json.loads((art / "manifest.json").read_text())
    assert manifest["target"]["kind"] == "cuda" and manifest["target"]["tuned"]
    assert (art / "triton_cache").is_dir()
    llm = LLM(art, max_num_batched_tokens=128, max_num_seqs=8, kv_cache_memory="256MiB")
    assert llm.engine.runner.graphs is not None
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    hf = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32).cuda().eval()
    mismatches = 0
    for ids, out in zip(PROMPTS, outs):
        ref = hf_greedy(hf, ids, 24)
        mismatches += ref != out.token_ids
    # tf32 is off for fp32 matmuls in both, so the paths agree token for token.
    assert mismatches == 0
    assert llm.engine.block_pool.num_used_blocks == 0
    del llm, hf
    torch.cuda.empty_cache()


def test_bf16_batch_is_consistent_with_single_requests(tmp_path):  # type: ignore[no-untyped-def]
    ckpt = make_checkpoint(tmp_path / "ckpt", "llama", tokenizer=False)
    art = build_artifact(ckpt, tmp_path / "art", gpu="auto", dtype="bfloat16", tune_budget_s=10.0)
    llm = LLM(art, max_num_batched_tokens=256, max_num_seqs=16, kv_cache_memory="256MiB")
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    batched = llm.generate(PROMPTS, params)
    alone = [llm.generate([p], params)[0] for p in PROMPTS[:3]]
    # bf16 batching changes reduction order; the first tokens must agree.
    for a, b in zip(alone, batched):
        assert a.token_ids[:4] == b.token_ids[:4]


def test_smollm2_fp32_greedy_matches_transformers_on_gpu(tmp_path, smollm2_checkpoint):  # type: ignore[no-untyped-def]
    """The embedded default model, built for the GPU in fp32 (tuned Triton kernels, CUDA graphs),
    gives transformers' greedy tokens on the same converted checkpoint, up to its EOS."""
    from transformers import AutoModelForCausalLM

    art = build_artifact("smollm2-135m", tmp_path / "art", gpu="auto", dtype="float32", tune_budget_s=20.0)
    llm = LLM(art, max_num_batched_tokens=256, max_num_seqs=8, kv_cache_memory="512MiB")
    assert llm.engine.runner.graphs is not None
    prompts = ["The quick brown fox", "我喜欢吃北京烤鸭，因为", "def add(a, b):", "The meaning of life is"]
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    prompts.append(llm.tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True))
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=48))
    hf = AutoModelForCausalLM.from_pretrained(str(smollm2_checkpoint), dtype=torch.float32).cuda().eval()
    for prompt, out in zip(prompts, outs):
        ids = llm.tokenizer.encode(prompt, add_special_tokens=False)
        assert out.token_ids == hf_greedy(hf, ids, 48, eos_token_id=2), prompt
    assert "Paris" in outs[-1].text and outs[-1].finish_reason == "stop"
    del llm, hf
    torch.cuda.empty_cache()
