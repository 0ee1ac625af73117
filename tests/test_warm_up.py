"""The warm-up (on by default for GPU artifacts; asked for here on the CPU): it runs every size
class and sampler path once before serving, then leaves no trace a user could see - the same
tokens, statistics and prefix cache as an engine that never warmed up - and, with
PAGECAST_PROFILE_WARM_UP, says where its seconds went."""

from __future__ import annotations

import pytest

from pagecast.runtime import SamplingParams
from pagecast.runtime.engine import LLMEngine
from pagecast.runtime.engine_core import PROFILE_WARM_UP_ENV

PROMPTS = [[5, 6, 7, 8, 9], [11, 12, 13]]


def _generate(engine: LLMEngine) -> list[list[int]]:
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt, params)
    done: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
    return [done[f"r{i}"] for i in range(len(PROMPTS))]


def test_warm_up_leaves_no_trace(tiny_llama_artifact, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.delenv(PROFILE_WARM_UP_ENV, raising=False)
    cold = LLMEngine(tiny_llama_artifact, warm_up=False)
    assert "warm_up.sizes" not in cold.core.startup_s
    warm = LLMEngine(tiny_llama_artifact, warm_up=True)
    core = warm.core
    assert core.startup_s["warm_up.sizes"] > 0 and core.startup_s["warm_up.sampler"] > 0
    assert core.num_prompt_tokens == core.num_generation_tokens == 0
    assert core.block_pool.num_prefix_queries == core.block_pool.num_prefix_hits == 0
    assert not core.has_unfinished_requests()
    assert _generate(warm) == _generate(cold)
    assert core.block_pool.num_prefix_hits == 0  # no warm-up prompt was left in the prefix cache


def test_warm_up_profile_names_every_run(tiny_llama_artifact, tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "warm_up.txt"
    monkeypatch.setenv(PROFILE_WARM_UP_ENV, str(path))
    engine = LLMEngine(tiny_llama_artifact, warm_up=True)
    assert engine.core.num_prompt_tokens == 0 and not engine.core.has_unfinished_requests()
    text = path.read_text()
    runs = [line for line in text.splitlines() if " prompt tokens: " in line]
    # The size classes up to the step budget (the tiny model's 512-token context), then the
    # sampler's three paths.
    budget = min(engine.core.options.max_num_batched_tokens, engine.core.max_model_len - 4)
    sizes = [int(line.split()[1]) for line in runs if line.startswith("sizes ")]
    assert sizes == sorted(sizes) and sizes[-1] == budget and len(sizes) >= 4
    assert sum(line.startswith("sampler ") for line in runs) == 3
    # Each run says how many kernels it loaded (none on the CPU: Triton does not run there), and
    # the same runs follow again, unprofiled, for their cost once everything is loaded.
    assert all(line.endswith(" 0 kernels loaded") for line in runs)
    again = [line.removeprefix("again ") for line in runs if line.startswith("again ")]
    first = [line for line in runs if not line.startswith("again ")]
    assert [line.split(":")[0] for line in again] == [line.split(":")[0] for line in first]
    assert "Self CPU" in text  # the profiler's operator table
    assert "Ordered by: cumulative time" in text  # the Python side's (cProfile)
