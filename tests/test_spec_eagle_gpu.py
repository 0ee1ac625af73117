"""EAGLE-3 speculative decoding on a GPU (bf16, the target's decode CUDA graphs captured with the
feature copy bound): greedy outputs equal those without speculation, token for token, with a
random head and with the echo head, whose drafts the target accepts."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from eagle3_heads import checkpoint_embedding, make_echo_head, make_head

from pagecast.runtime.llm import LLM
from pagecast.runtime.sampling_params import SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]

PROMPTS = [[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7], [11, 12, 13, 11, 12, 13, 11, 12], list(range(20, 60))]
PARAMS = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
BUILD = {"gpu": "auto", "dtype": "bfloat16", "tune_budget_s": 10.0}


@pytest.fixture(scope="module")
def artifact(tmp_path_factory, tiny_llama_checkpoint: Path) -> Path:  # type: ignore[no-untyped-def]
    from conftest import build_artifact

    return build_artifact(tiny_llama_checkpoint, tmp_path_factory.mktemp("spec-eagle-gpu") / "art", **BUILD)


@pytest.fixture(scope="module")
def plain(artifact: Path) -> list[list[int]]:
    """The greedy outputs without speculation (its engine freed before the speculating one starts)."""
    base = LLM(str(artifact), kv_cache_memory="256MiB")
    ref = [o.outputs[0].token_ids for o in base.generate(PROMPTS, PARAMS, use_tqdm=False)]
    del base
    torch.cuda.empty_cache()
    return ref


@pytest.mark.parametrize("kind", ["random", "echo"])
def test_greedy_outputs_with_an_eagle3_head_equal_those_without(
    artifact: Path, tiny_llama_checkpoint: Path, plain: list[list[int]], tmp_path: Path, kind: str
) -> None:
    head = (
        make_echo_head(tmp_path / "echo", checkpoint_embedding(tiny_llama_checkpoint))
        if kind == "echo"
        else make_head(tmp_path / "random", seed=21)
    )
    spec = LLM(str(artifact), kv_cache_memory="256MiB",
               speculative_config={"method": "eagle3", "model": str(head), "num_speculative_tokens": 3})  # fmt: skip
    core = spec.engine.core
    # CUDA graphs on: the decode graphs were captured after the head bound its feature buffer.
    assert core.runner.graphs is not None and core.runner.graphs.num_captured > 0
    out = [o.outputs[0].token_ids for o in spec.generate(PROMPTS, PARAMS, use_tqdm=False)]
    assert out == plain
    stats = core.spec_stats
    assert stats.num_draft_tokens > 0
    if kind == "echo":
        # The tiny random target's greedy outputs run into repeats, which the echo head drafts.
        assert stats.num_accepted_tokens > 0
