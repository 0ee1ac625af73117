"""Speculative decoding with a draft model on a GPU (bf16; the draft's decode steps replay its
own CUDA graphs): greedy outputs equal those without it, and a draft that is the target itself
has its drafts accepted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pagecast.runtime.llm import LLM
from pagecast.runtime.sampling_params import SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]

PROMPTS = [[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7], [11, 12, 13, 11, 12, 13, 11, 12], list(range(20, 60))]


@pytest.fixture(scope="module")
def artifact(tmp_path_factory, tiny_checkpoint_factory) -> Path:  # type: ignore[no-untyped-def]
    """The tiny target with itself nested as its draft (built by enginebuild --speculative-config)."""
    from conftest import build_artifact

    ckpt = tiny_checkpoint_factory("llama")
    config = {"method": "draft_model", "model": str(ckpt), "num_speculative_tokens": 3}
    return build_artifact(ckpt, tmp_path_factory.mktemp("spec-draft-gpu") / "art", gpu="auto", dtype="bfloat16",
                          tune_budget_s=10.0, speculative_config=json.dumps(config))  # fmt: skip


def test_greedy_outputs_with_the_nested_draft_equal_those_without(artifact: Path) -> None:
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    base = LLM(str(artifact), kv_cache_memory="256MiB", speculative_config="off")
    ref = [o.outputs[0].token_ids for o in base.generate(PROMPTS, params)]
    del base
    torch.cuda.empty_cache()
    spec = LLM(str(artifact), kv_cache_memory="256MiB")  # the artifact's own draft
    proposer = spec.engine.core.proposer
    assert proposer is not None and proposer.graphs is not None and proposer.graphs.num_captured > 0
    assert [o.outputs[0].token_ids for o in spec.generate(PROMPTS, params)] == ref
    stats = spec.engine.core.spec_stats
    # The draft is the target: bf16 rounding may differ between its catch-up and the target's
    # verification, but nearly every draft is the target's token.
    assert stats.num_accepted_tokens > 0.8 * stats.num_draft_tokens > 0
