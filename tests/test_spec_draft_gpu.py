"""Speculative decoding with a draft model on a GPU (the draft's decode steps replay its own CUDA
graphs): greedy outputs equal those without it, and a draft that is the target itself has its
drafts accepted. In float32 the outputs are token for token those without speculation. In bf16 a
verifying step computes a position in a batch of another shape than a decode step does (cuBLAS
picks its kernel by row count), so the two can part at a near-tie, and only there (as in
tests/test_spec_eagle_gpu.py): an H100 parted them in the thirty-sixth session, where the H200
had not."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pagecast.runtime.llm import LLM
from pagecast.runtime.sampling_params import SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]

PROMPTS = [[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7], [11, 12, 13, 11, 12, 13, 11, 12], list(range(20, 60))]
# A bf16 position whose two best logprobs are closer than this is a near-tie (a bf16 logit's
# rounding step at magnitude 4-8 is 1/32).
NEAR_TIE = 0.07


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def artifact(request, tmp_path_factory, tiny_checkpoint_factory) -> tuple[Path, str]:  # type: ignore[no-untyped-def]
    """The tiny target with itself nested as its draft (built by enginebuild --speculative-config)."""
    from conftest import build_artifact

    ckpt = tiny_checkpoint_factory("llama")
    config = {"method": "draft_model", "model": str(ckpt), "num_speculative_tokens": 3}
    out = tmp_path_factory.mktemp(f"spec-draft-gpu-{request.param}") / "art"
    art = build_artifact(ckpt, out, gpu="auto", dtype=request.param, tune_budget_s=10.0,
                         speculative_config=json.dumps(config))  # fmt: skip
    return art, request.param


def test_greedy_outputs_with_the_nested_draft_equal_those_without(artifact: tuple[Path, str]) -> None:
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    base = LLM(str(artifact[0]), kv_cache_memory="256MiB", speculative_config="off")
    # Each position's two best logprobs too (see NEAR_TIE).
    outs = base.generate(PROMPTS, SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True, logprobs=2))
    ref = [o.outputs[0].token_ids for o in outs]
    gaps = [[_top2_gap(position) for position in o.outputs[0].logprobs] for o in outs]
    del base
    torch.cuda.empty_cache()
    spec = LLM(str(artifact[0]), kv_cache_memory="256MiB")  # the artifact's own draft
    proposer = spec.engine.core.proposer
    assert proposer is not None and proposer.graphs is not None and proposer.graphs.num_captured > 0
    got = [o.outputs[0].token_ids for o in spec.generate(PROMPTS, params)]
    if artifact[1] == "float32":
        assert got == ref
    else:
        for out, want, gap in zip(got, ref, gaps):
            first = next((i for i, (a, b) in enumerate(zip(out, want)) if a != b), None)
            assert first is None or gap[first] < NEAR_TIE, (first, gap[first] if first is not None else None)
    stats = spec.engine.core.spec_stats
    # The draft is the target: bf16 rounding may differ between its catch-up and the target's
    # verification, but nearly every draft is the target's token.
    assert stats.num_accepted_tokens > 0.8 * stats.num_draft_tokens > 0


def _top2_gap(position: dict) -> float:  # type: ignore[type-arg]
    best, second = sorted(position.values(), key=lambda entry: entry.rank)[:2]
    return best.logprob - second.logprob
