"""Sampling on a GPU (run with `pytest -m gpu` on the accelerator): the asynchronous engine
(penalties, logprobs, prompt logprobs, seeds and min_tokens computed on the device, CUDA graphs)
gives what the synchronous engine gives, and the keyed-noise kernel matches its reference at a
real vocabulary size."""

from __future__ import annotations

import pytest
import torch
from conftest import build_artifact
from test_async_scheduling import assert_same_outputs
from tiny_models import make_checkpoint

from pagecast.kernels import reference
from pagecast.runtime import LLM, SamplingParams

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

PROMPTS = [[1 + (i * 37 + j * 11) % 4000 for j in range(n)] for i, n in enumerate([5, 17, 33, 64, 100, 3, 250, 9])]


def test_keyed_noise_kernel_matches_reference_at_llama3_vocab() -> None:
    from pagecast.kernels.keyed_noise import keyed_exponential

    keys = torch.randint(-(2**63), 2**63 - 1, (512,), dtype=torch.int64)
    offsets = torch.randint(0, 2**32, (512,), dtype=torch.int64)
    got = keyed_exponential(keys.cuda(), offsets.cuda(), 128_256).cpu()
    expected = reference.keyed_exponential(keys[:8], offsets[:8], 128_256)
    torch.testing.assert_close(got[:8], expected, rtol=1e-6, atol=0)
    assert abs(float(got.mean()) - 1) < 1e-3


def test_async_engine_matches_sync_with_every_feature_on_gpu(tmp_path):  # type: ignore[no-untyped-def]
    ckpt = make_checkpoint(tmp_path / "ckpt", "llama", tokenizer=False)
    art = build_artifact(ckpt, tmp_path / "art", gpu="auto", dtype="float32", tune_budget_s=10.0)
    params = [
        SamplingParams(temperature=0.8, top_p=0.95, top_k=50, seed=i, max_tokens=24, ignore_eos=True,
                       logprobs=5 if i % 2 else None, prompt_logprobs=2 if i % 3 == 0 else None,
                       repetition_penalty=1.2 if i % 3 == 1 else 1.0, presence_penalty=0.5 if i % 4 == 0 else 0.0,
                       frequency_penalty=0.4 if i % 4 == 1 else 0.0, min_tokens=10 if i % 5 == 0 else 0,
                       stop_token_ids=[7] if i % 5 == 0 else [])
        for i in range(len(PROMPTS))
    ]
    outputs = []
    for mode in (False, True):
        llm = LLM(art, async_scheduling=mode, max_num_batched_tokens=512, max_num_seqs=8, kv_cache_memory="256MiB")
        assert llm.engine.runner.graphs is not None
        outputs.append(llm.generate(PROMPTS, params))
        assert llm.engine.block_pool.num_used_blocks == 0
        del llm
        torch.cuda.empty_cache()
    assert_same_outputs(outputs[1], outputs[0])
