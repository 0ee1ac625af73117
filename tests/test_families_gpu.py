"""The families built from parts on a GPU (run with `pytest -m gpu` on the accelerator): fp32
artifacts tuned on the GPU, Triton kernels (windows, soft-caps, GELU-tanh) and CUDA graphs, give
transformers' greedy tokens on the same GPU."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import build_artifact
from engine_utils import hf_greedy
from test_families import hf_cached_greedy
from tiny_models import PART_FAMILIES, make_checkpoint

from pagecast.runtime import LLM, SamplingParams

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

# Lengths past Gemma's 8-token windows and Phi-3's 32-token original context (20 + 24 crosses it),
# all within the tiny checkpoints' 256 positions.
PROMPTS = [
    [1 + (i * 37 + j * 11) % 4000 for j in range(n)] for i, n in enumerate([5, 20, 33, 64, 100, 3, 200, 9])
]


@pytest.mark.parametrize("family", PART_FAMILIES)
def test_family_fp32_greedy_matches_transformers_on_gpu(tmp_path, family):  # type: ignore[no-untyped-def]
    from transformers import AutoModelForCausalLM

    ckpt = make_checkpoint(tmp_path / "ckpt", family, tokenizer=False)
    art = build_artifact(ckpt, tmp_path / "art", gpu="auto", dtype="float32", tune_budget_s=10.0)
    manifest = json.loads((art / "manifest.json").read_text())
    assert manifest["target"]["kind"] == "cuda" and manifest["target"]["tuned"]
    # Phi-3 without chunked prefill: see test_families.family_llm
    budget = 2048 if family == "phi3" else 128
    llm = LLM(art, max_num_batched_tokens=budget, max_num_seqs=8, kv_cache_memory="256MiB")
    assert llm.engine.runner.graphs is not None
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    hf = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32, attn_implementation="eager")
    hf = hf.cuda().eval()
    greedy = hf_cached_greedy if family == "phi3" else hf_greedy
    mismatches = [
        i for i, (ids, out) in enumerate(zip(PROMPTS, outs)) if greedy(hf, ids, 24) != out.token_ids
    ]
    assert mismatches == []
    assert llm.engine.block_pool.num_used_blocks == 0
    del llm, hf
    torch.cuda.empty_cache()
