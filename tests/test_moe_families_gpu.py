"""MoE families end to end on a GPU (`pytest -m gpu`): fp32 engines of tiny Qwen3-MoE and
Qwen2-MoE checkpoints, built and tuned for the GPU (the fused-MoE Triton kernels, CUDA graphs),
give transformers' greedy tokens."""

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

# 1-token decodes (the GEMV path) up to 250-token prefills (the tile path)
# Within the tiny MoE checkpoints' 256 positions (prompt + 24 generated tokens).
PROMPTS = [[1 + (i * 37 + j * 11) % 4000 for j in range(n)] for i, n in enumerate([5, 17, 33, 64, 100, 3, 200, 9])]


# glm4_moe: its sigmoid routing runs in torch ops on the GPU too, inside the decode graphs; the
# rest: MiniMax-M2's bf16-logit sigmoid routing, GLM-4.5's routing under other attentions (dots1,
# EXAONE-MoE, Solar Open), ERNIE 4.5's softmax with a score bias, HunYuan's fp32-logit softmax;
# Llama 4's top-1 sigmoid routing on the experts' input, chunked attention (16-token chunks: the
# prompts cross them in both kernels) and the attention temperature (from position 7 on)
@pytest.mark.parametrize(
    "family",
    ["qwen3_moe", "qwen2_moe", "glm4_moe", "granitemoe", "minimax_m2", "dots1", "exaone_moe", "solar_open",
     "ernie4_5_moe", "hunyuan_moe", "llama4"],
)
def test_moe_fp32_greedy_matches_transformers_on_gpu(tmp_path, family):  # type: ignore[no-untyped-def]
    from transformers import AutoModelForCausalLM

    ckpt = make_checkpoint(tmp_path / "ckpt", family, tokenizer=False)
    art = build_artifact(ckpt, tmp_path / "art", gpu="auto", dtype="float32", tune_budget_s=20.0)
    manifest = json.loads((art / "manifest.json").read_text())
    assert manifest["target"]["kind"] == "cuda" and manifest["target"]["tuned"]
    tuning = json.loads((art / "tuning.json").read_text())
    assert "fused_moe" in json.dumps(tuning), "the fused-MoE kernel was not tuned"
    llm = LLM(art, max_num_batched_tokens=256, max_num_seqs=8, kv_cache_memory="256MiB")
    assert llm.engine.runner.graphs is not None
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    hf = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32).cuda().eval()
    mismatches = [i for i, (ids, out) in enumerate(zip(PROMPTS, outs)) if hf_greedy(hf, ids, 24) != out.token_ids]
    assert mismatches == []
    assert llm.engine.block_pool.num_used_blocks == 0
    del llm, hf
    torch.cuda.empty_cache()
