"""Test helpers that reach into the engine: logits of a prompt, the transformers reference."""

from __future__ import annotations

import torch

from pagecast.runtime.engine import LLMEngine
from pagecast.runtime.request import Request
from pagecast.runtime.sampling_params import SamplingParams
from pagecast.runtime.scheduler import SchedulerOutput

# Text prompts of mixed lengths and scripts, for engine tests that compare runs with each other.
PROMPTS = [
    "The history of the Roman empire begins with",
    "In computer science, a hash table is",
    "My favourite recipe for pancakes needs",
    "一个关于猫的故事：",
    "Rain, wind and",
    "List of prime numbers: 2, 3, 5, 7,",
]


def engine_last_logits(engine: LLMEngine, token_ids: list[int]) -> torch.Tensor:
    """Prefill token_ids through the paged engine and return the last position's logits."""
    req = Request("logits-probe", token_ids, SamplingParams(max_tokens=1))
    assert engine.block_pool.allocate_slots(req, len(token_ids))
    try:
        out = SchedulerOutput([req], [len(token_ids)], len(token_ids))
        batch = engine.runner.prepare(out)
        with torch.inference_mode():
            hidden = engine.runner.model.forward(batch.input_ids, batch.positions, batch.ctx)
            return engine.runner.model.compute_logits(hidden[-1:])[0]
    finally:
        engine.block_pool.free(req)


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int, eos_token_id=None) -> list[int]:  # type: ignore[no-untyped-def]
    kwargs = {"eos_token_id": eos_token_id} if eos_token_id is not None else {"min_new_tokens": max_new_tokens}
    out = model.generate(
        torch.tensor([prompt_ids], device=model.device), max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0, **kwargs
    )
    return out[0, len(prompt_ids) :].tolist()


def near_tie_divergences(  # type: ignore[no-untyped-def]
    hf, prompts: list[list[int]], tokens: list[list[int]], max_tokens: int, near_tie: float
) -> int:
    """How many prompts' greedy ``tokens`` differ from ``hf``'s, asserting that each differs first
    where the reference's best logit is within ``near_tie`` of the token taken (a rounding can flip
    a near tie; nothing else may), after which that prompt is not compared further."""
    diverged = 0
    for ids, out in zip(prompts, tokens, strict=True):
        ref = hf_greedy(hf, ids, max_tokens)
        if out == ref:
            continue
        i = next(j for j, (a, b) in enumerate(zip(out, ref, strict=True)) if a != b)
        with torch.no_grad():
            step = hf(torch.tensor([ids + ref[:i]], device=hf.device)).logits[0, -1]
        gap = float(step[ref[i]] - step[out[i]])
        assert gap < near_tie, f"prompt {ids[:4]}...: token {i} is {out[i]}, not {ref[i]} (logit gap {gap:.3f})"
        diverged += 1
    return diverged


def assert_graphs_match_eager(  # type: ignore[no-untyped-def]
    artifact, prompts: list[list[int]], max_tokens: int, kv_dtype: torch.dtype | None = None
) -> None:
    """GPU tests: greedy tokens with CUDA graphs equal an eager engine's on the same artifact
    (and the graph engine's KV cache holds ``kv_dtype``, where given)."""
    from pagecast.runtime import LLM

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    graphs = LLM(artifact, kv_cache_memory="256MiB", max_num_seqs=8)
    assert graphs.engine.runner.graphs is not None
    assert kv_dtype is None or graphs.engine.kv_cache.dtype == kv_dtype
    with_graphs = [o.token_ids for o in graphs.generate(prompts, params, use_tqdm=False)]
    del graphs
    eager = LLM(artifact, kv_cache_memory="256MiB", max_num_seqs=8, cuda_graphs=False)
    assert with_graphs == [o.token_ids for o in eager.generate(prompts, params, use_tqdm=False)]
    del eager
    torch.cuda.empty_cache()
