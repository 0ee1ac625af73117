"""The CPU's step budget: left unset, a CPU engine computes at most CPU_MAX_NUM_BATCHED_TOKENS
tokens per step, so a long prompt is prefilled in chunks while the running streams go on
decoding (one token each, every step) instead of waiting for the whole prompt; a GPU keeps
its budget."""

from __future__ import annotations

from pagecast.runtime import SamplingParams
from pagecast.runtime.engine import LLMEngine
from pagecast.runtime.engine_core import (
    CPU_MAX_NUM_BATCHED_TOKENS,
    GPU_MAX_NUM_BATCHED_TOKENS,
    default_max_num_batched_tokens,
)


def test_default_budget_by_device() -> None:
    assert default_max_num_batched_tokens("cuda", 256) == GPU_MAX_NUM_BATCHED_TOKENS == 2048
    assert default_max_num_batched_tokens("cpu", 8) == CPU_MAX_NUM_BATCHED_TOKENS < GPU_MAX_NUM_BATCHED_TOKENS
    # Every running request decodes in every step, whatever the budget.
    assert default_max_num_batched_tokens("cpu", 4 * CPU_MAX_NUM_BATCHED_TOKENS) == 4 * CPU_MAX_NUM_BATCHED_TOKENS


def test_a_long_prompt_is_chunked_while_a_stream_decodes(tiny_llama_artifact):  # type: ignore[no-untyped-def]
    engine = LLMEngine(tiny_llama_artifact, kv_cache_memory="16MiB", max_num_seqs=8)
    budget = engine.scheduler.config.max_num_batched_tokens
    assert budget == CPU_MAX_NUM_BATCHED_TOKENS
    long_len = min(engine.max_model_len - 8, 2 * budget + 100)
    assert long_len > budget  # the tiny model's context holds a prompt longer than one step
    steps: list[dict[str, int]] = []
    schedule = engine.scheduler.schedule

    def recording_schedule():  # type: ignore[no-untyped-def]
        out = schedule()
        steps.append({r.request_id: n for r, n in zip(out.scheduled_requests, out.num_scheduled_tokens)})
        return out

    engine.scheduler.schedule = recording_schedule  # type: ignore[method-assign]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    engine.add_request("stream", [5, 6, 7, 8], params)
    for _ in range(3):  # the stream is decoding
        engine.step()
    engine.add_request("long", [(7 * i) % 4000 + 10 for i in range(long_len)], SamplingParams(max_tokens=2))
    tokens_before = len(engine.scheduler.requests["stream"].output_token_ids)
    prefill_steps = []
    while engine.scheduler.requests.get("long") is not None and not engine.scheduler.requests["long"].output_token_ids:
        engine.step()
        prefill_steps.append(steps[-1])
    stream = engine.scheduler.requests["stream"]
    # The prompt took several steps, each within the budget, and the stream got a token in
    # every one of them (a decode of one token, scheduled before the prefill chunk).
    assert len(prefill_steps) >= 2, prefill_steps
    assert sum(s["long"] for s in prefill_steps) == long_len
    for s in prefill_steps:
        assert s["stream"] == 1 and sum(s.values()) <= budget, s
    assert len(stream.output_token_ids) == tokens_before + len(prefill_steps)
    while engine.has_unfinished_requests():
        engine.step()
