"""Dense FP8 (W8A8) engines on a GPU (run with `pytest -m gpu` on the accelerator): the
llm-compressor fixtures (per-token, static and 1x128-group activations) built for the GPU, tuned
there, run the FP8 GEMM kernels (or torch._scaled_mm where the tuner kept it) in fp32 activations
with CUDA graphs, and give the greedy tokens of transformers running the dequantised weights with
the same activation quantisation (tests/test_fp8_build.py's reference), on the same GPU.

Unlike the CPU's exact emulation, Hopper's fp8 tensor cores add a dot's products at reduced
precision (kernels/fp8_gemm.py promotes every BLOCK_K), so a tiny random model's near ties can go
the other way: the first run (2026-12-05) had 3 of 3 prompts diverge for per-token activations,
each where the reference's top two were within NEAR_TIE. The second run (same day) put some prompts'
last-position logits within 1.1e-6 of the reference and others 0.17-0.27 away: a hidden state a few
ulps off the reference's (other summation orders upstream) sits at an e4m3 rounding midpoint and one
activation moves by a whole fp8 step (up to 1/8 of its size). So: every prompt's last-position
logits within FLIP_TOL (a few rounding flips, not a wrong kernel), at least one prompt of each
checkpoint within EXACT_TOL (where nothing flips the kernels compute the reference's arithmetic), and
greedy tokens equal up to a near tie."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import build_artifact
from engine_utils import engine_last_logits, near_tie_divergences
from test_fp8_build import FIXTURES, LLMC, MAX_TOKENS, NEAR_TIE, PROMPTS, reference_model

from pagecast.runtime import LLM, SamplingParams

pytestmark = pytest.mark.gpu

EXACT_TOL = 1e-4  # fp32 activations, no rounding flip: the reference's arithmetic
FLIP_TOL = 0.5  # logits of these tiny models are O(1); a wrong scale or layout moves them by more

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)


@pytest.mark.parametrize("name", list(LLMC))
def test_fp8_engine_greedy_tokens_equal_transformers_dequantised_on_gpu(name, tmp_path):  # type: ignore[no-untyped-def]
    art = build_artifact(FIXTURES / name, tmp_path / "art", gpu="auto", dtype="float32", tune_budget_s=10.0)
    manifest = json.loads((art / "manifest.json").read_text())
    assert manifest["target"]["kind"] == "cuda" and manifest["quant"] == "fp8"
    llm = LLM(art, max_num_seqs=4, max_num_batched_tokens=64, kv_cache_memory="256MiB")
    assert llm.engine.runner.graphs is not None
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    hf = reference_model(FIXTURES / name, LLMC[name][0]).cuda()
    diffs = []
    with torch.no_grad():
        for ids in PROMPTS:
            got = engine_last_logits(llm.engine, ids).float()
            ref = hf(torch.tensor([ids], device="cuda")).logits[0, -1]
            diffs.append((got - ref).abs().max().item())
            print(f"{name}: prompt of {len(ids)}: largest logit difference {diffs[-1]:.2e}")
    assert max(diffs) <= FLIP_TOL, (name, diffs)
    assert min(diffs) <= EXACT_TOL, (name, diffs)
    # A flip moves each logit by at most about what the prompts' logits moved (on the H100, 0.18-0.20
    # for the block-scaled checkpoint, where one token took another at a reference gap of 0.18), so it
    # can reorder only two tokens whose reference gap is under twice that.
    near_tie = max(NEAR_TIE, 2 * max(diffs))
    near_tie_divergences(hf, PROMPTS, [o.token_ids for o in outs], MAX_TOKENS, near_tie)
    assert llm.engine.block_pool.num_used_blocks == 0
    llm.engine.runner.close()
    del llm, hf
    torch.cuda.empty_cache()
