"""Parity with transformers: tiny random checkpoints of each family, fp32 on the CPU.

8 prompts of different lengths in one generate call must give exactly transformers' greedy
tokens, and the last position's logits must agree within 1e-4.
"""

from __future__ import annotations

import pytest
import torch
from engine_utils import engine_last_logits, hf_greedy
from transformers import AutoModelForCausalLM

from pagecast.runtime import LLM, SamplingParams

PROMPTS = [
    "Hello, my name is",
    "The capital of France is",
    "一二三四五六七八九十",
    "def fib(n):\n    return",
    "a",
    "Once upon a time in a land far, far away, there lived a very old king who",
    " ".join(str(i) for i in range(40)),
    "What is",
]
MAX_TOKENS = 20

CASES = {
    "llama": {},
    "qwen2": {},
    "qwen3": {},
    "mistral": {},
    "llama3-rope": {
        "rope_parameters": {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        }
    },
    "untied-bias": {"tie_word_embeddings": False, "attention_bias": True, "mlp_bias": True},
}


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_tokens_and_logits_match_transformers(case, tiny_checkpoint_factory, tiny_artifact_factory):
    family = case if case in ("llama", "qwen2", "qwen3", "mistral") else "llama"
    overrides = CASES[case]
    ckpt = tiny_checkpoint_factory(family, **overrides)
    llm = LLM(tiny_artifact_factory(family, **overrides), max_num_batched_tokens=64, max_num_seqs=8)
    tok = llm.tokenizer
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))

    hf = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32)
    hf.eval()
    for prompt, out in zip(PROMPTS, outputs):
        ids = tok.encode(prompt, add_special_tokens=False)
        assert out.prompt_token_ids == ids
        assert out.token_ids == hf_greedy(hf, ids, MAX_TOKENS), prompt
        assert out.finish_reason == "length"
        assert out.text == tok.decode(out.token_ids, skip_special_tokens=True)

    for prompt in PROMPTS[:4]:
        ids = tok.encode(prompt, add_special_tokens=False)
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0, -1]
        ours = engine_last_logits(llm.engine, ids)
        torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)
    assert llm.engine.block_pool.num_used_blocks == 0
