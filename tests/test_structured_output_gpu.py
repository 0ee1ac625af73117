"""Structured output on a GPU (run with `pytest -m gpu` on the accelerator): CUDA graphs, the
asynchronous engine (the in-flight token fed to the matcher after the forward pass is queued)
and xgrammar's bitmask kernel on the device. Constrained outputs validate and are the same in
both scheduling modes (the same batches, so the same tokens)."""

from __future__ import annotations

import pytest
import torch
from conftest import build_artifact
from test_structured_output import PERSON, PROMPTS, Person
from tiny_models import make_checkpoint

from pagecast.runtime import LLM, SamplingParams

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)


def test_structured_output_on_gpu_in_both_modes(tmp_path):  # type: ignore[no-untyped-def]
    ckpt = make_checkpoint(tmp_path / "ckpt", "llama")
    art = build_artifact(ckpt, tmp_path / "art", gpu="auto", dtype="float32", tune_budget_s=10.0)
    plain = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    constrained = [
        SamplingParams(max_tokens=200, temperature=0.0, structured_output=PERSON),
        SamplingParams(max_tokens=200, temperature=0.9, seed=5, structured_output=PERSON),
    ]
    prompts = PROMPTS * 4
    params = [plain if i % 2 == 0 else constrained[(i // 2) % 2] for i in range(len(prompts))]
    results = []
    for mode in (False, True):
        llm = LLM(art, async_scheduling=mode, max_num_seqs=16, kv_cache_memory="256MiB")
        assert llm.engine.runner.graphs is not None
        mixed = llm.generate(prompts, params)
        # (Unconstrained neighbours against a run without constrained ones is the CPU test's: on a
        # GPU a different batch size may pick another GEMM algorithm, so greedy ties may differ.)
        for out in mixed[1::2]:
            assert out.outputs[0].finish_reason == "stop", out.outputs[0].text
            Person.model_validate_json(out.outputs[0].text)
        results.append([o.outputs[0].token_ids for o in mixed])
        assert llm.engine.block_pool.num_used_blocks == 0
        del llm
        torch.cuda.empty_cache()
    assert results[0] == results[1]
