"""Speculative decoding on a GPU (bf16, CUDA graphs and asynchronous scheduling on for the
steps that do not speculate): greedy and seeded outputs equal those without it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pagecast.runtime.llm import LLM
from pagecast.runtime.sampling_params import SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]

PROMPTS = [[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7], [11, 12, 13, 11, 12, 13, 11, 12], list(range(20, 60))]


@pytest.fixture(scope="module")
def artifact(tmp_path_factory, tiny_checkpoint_factory) -> Path:  # type: ignore[no-untyped-def]
    from conftest import build_artifact

    ckpt = tiny_checkpoint_factory("llama")
    return build_artifact(ckpt, tmp_path_factory.mktemp("spec-gpu") / "art", gpu="auto", dtype="bfloat16", tune_budget_s=10.0)


def test_greedy_and_seeded_outputs_equal_those_without_speculation(artifact: Path) -> None:
    params = [
        SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True, logprobs=1),
        SamplingParams(max_tokens=64, temperature=0.3, top_k=8, seed=3, ignore_eos=True),
        SamplingParams(max_tokens=64, temperature=0.5, top_p=0.9, seed=4, ignore_eos=True, presence_penalty=0.2),
    ]
    base = LLM(str(artifact), kv_cache_memory="256MiB")
    ref = base.generate(PROMPTS, params)
    del base
    torch.cuda.empty_cache()
    spec = LLM(str(artifact), kv_cache_memory="256MiB",
               speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1})  # fmt: skip
    out = spec.generate(PROMPTS, params)
    assert [o.outputs[0].token_ids for o in out] == [r.outputs[0].token_ids for r in ref]
    assert spec.engine.core.spec_stats.num_accepted_tokens > 0
    # Verifying steps run kernels the build compiled (decode rows, the sampler on k + 1 rows a
    # request): nothing compiled while serving.
    assert spec.engine.stats().num_kernel_compiles == 0
    for a, b in zip(out[0].outputs[0].logprobs, ref[0].outputs[0].logprobs):
        for t in a:
            assert a[t].logprob == pytest.approx(b[t].logprob, abs=0.05)
