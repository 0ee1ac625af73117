"""An engine's batch sizes default to what its artifact was built for: an artifact built with
`enginebuild --max-num-seqs N` (its memory plan, CUDA graph sizes and tuned batch buckets sized for
N) runs N sequences at once under LLM, AsyncEngine and engine-serve unless told otherwise, and its
step budget defaults to max(2048, N), the step the plan sizes activations for."""

from __future__ import annotations

import json

import pytest
from conftest import build_artifact

from pagecast.runtime import SamplingParams
from pagecast.runtime.artifact import DEFAULT_MAX_NUM_SEQS, DEFAULT_STEP_TOKENS
from pagecast.runtime.engine import LLMEngine
from pagecast.runtime.engine_core import EngineOptions


@pytest.fixture(scope="module")
def built_for_six(tiny_llama_checkpoint, tmp_path_factory):  # type: ignore[no-untyped-def]
    return build_artifact(tiny_llama_checkpoint, tmp_path_factory.mktemp("six") / "engine", max_num_seqs=6)


def test_the_options_left_unset_take_the_built_batch() -> None:
    assert EngineOptions().resolved(6) == EngineOptions(max_num_seqs=6, max_num_batched_tokens=DEFAULT_STEP_TOKENS)
    assert EngineOptions().resolved(4096).max_num_batched_tokens == 4096  # every running sequence decodes in a step
    given = EngineOptions(max_num_seqs=3, max_num_batched_tokens=64).resolved(6)
    assert (given.max_num_seqs, given.max_num_batched_tokens) == (3, 64)
    # A budget set alone is checked against the batch it is resolved with.
    with pytest.raises(ValueError, match=r"max_num_batched_tokens \(4\) must be at least max_num_seqs \(6\)"):
        EngineOptions(max_num_batched_tokens=4).resolved(6)
    with pytest.raises(ValueError, match="max_num_seqs must be positive"):
        EngineOptions(max_num_seqs=0)


def test_an_engine_runs_the_batch_its_artifact_was_built_for(built_for_six, tiny_llama_artifact) -> None:  # type: ignore[no-untyped-def]
    manifest = json.loads((built_for_six / "manifest.json").read_text())
    assert manifest["build_options"]["max_num_seqs"] == 6
    engine = LLMEngine(built_for_six, kv_cache_memory="16MiB")
    assert (engine.core.options.max_num_seqs, engine.core.options.max_num_batched_tokens) == (6, DEFAULT_STEP_TOKENS)
    for i in range(9):
        engine.add_request(f"r{i}", [5 + i, 6, 7], SamplingParams(max_tokens=4, ignore_eos=True, temperature=0))
    most = 0
    while engine.has_unfinished_requests():
        engine.step()
        most = max(most, len(engine.core.scheduler.running))
    assert most == 6  # not 9, and not the engine-wide 256
    # Told otherwise, it runs what it is told; the artifact built with enginebuild's default runs 256.
    assert LLMEngine(built_for_six, kv_cache_memory="16MiB", max_num_seqs=2).core.options.max_num_seqs == 2
    assert LLMEngine(tiny_llama_artifact, kv_cache_memory="16MiB").core.options.max_num_seqs == DEFAULT_MAX_NUM_SEQS


def test_a_served_engine_reports_the_built_batch(built_for_six) -> None:  # type: ignore[no-untyped-def]
    from server_support import make_engine

    engine = make_engine(built_for_six, kv_cache_memory="16MiB")
    try:
        assert engine.max_num_seqs == 6  # what engine-serve's queue and 429s count against
    finally:
        engine.shutdown()
    # A budget below the built batch is refused with its reason, though the check now runs in the core.
    with pytest.raises(ValueError, match=r"max_num_batched_tokens \(5\) must be at least max_num_seqs \(6\)"):
        make_engine(built_for_six, kv_cache_memory="16MiB", max_num_batched_tokens=5)
