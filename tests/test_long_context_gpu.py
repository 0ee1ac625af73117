"""Long context on a GPU (issue 32; run with `pytest -m gpu` on the accelerator): fp32 artifacts
of the tiny llama3-scaled Llama and the yarn Qwen3 of tests/test_long_context.py, with a 32k
context, built and tuned on the GPU (Triton kernels, CUDA graphs), give transformers' greedy
tokens on the same GPU for prompts of 20k and 32k tokens prefilled in 4096-token chunks."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import build_artifact
from engine_utils import hf_greedy
from test_long_context import CASES, SMALL, sharpened_checkpoint

from pagecast.runtime import LLM, SamplingParams

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

CONTEXT = 32768
MAX_TOKENS = 16


@pytest.mark.parametrize("case", list(CASES))
def test_32k_context_fp32_greedy_matches_transformers_on_gpu(tmp_path, case):  # type: ignore[no-untyped-def]
    from transformers import AutoModelForCausalLM

    family, rope = CASES[case]
    overrides = dict(SMALL, max_position_embeddings=CONTEXT, **rope)
    ckpt = sharpened_checkpoint(tmp_path / "ckpt", family, tokenizer=False, **overrides)
    art = build_artifact(ckpt, tmp_path / "art", gpu="auto", dtype="float32", tune_budget_s=10.0)
    manifest = json.loads((art / "manifest.json").read_text())
    assert manifest["target"]["kind"] == "cuda" and manifest["max_model_len"] == CONTEXT
    llm = LLM(art, max_num_batched_tokens=4096, max_num_seqs=4, kv_cache_memory="1GiB")
    assert llm.engine.runner.graphs is not None
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 49152, (n,), generator=g).tolist() for n in (20000, CONTEXT - MAX_TOKENS)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    hf = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32, attn_implementation="sdpa")
    hf = hf.cuda().eval()
    for ids, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(hf, ids, MAX_TOKENS), f"prompt of {len(ids)} tokens"
    assert llm.engine.block_pool.num_used_blocks == 0
    del llm, hf
    torch.cuda.empty_cache()
