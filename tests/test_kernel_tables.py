"""Kernel configuration belongs to one engine, not to the process: two engines in one process
each run their forward passes with their own artifact's tuning table."""

from __future__ import annotations

from pagecast.kernels import ops
from pagecast.runtime import LLM, SamplingParams


def test_each_engine_runs_with_its_own_kernel_table(tiny_artifact_factory):  # type: ignore[no-untyped-def]
    a = LLM(tiny_artifact_factory("llama"), kv_cache_memory="16MiB")
    b = LLM(tiny_artifact_factory("qwen2"), kv_cache_memory="16MiB")  # loaded last: its table was installed last
    tables = {id(a): a.engine.artifact.kernels, id(b): b.engine.artifact.kernels}
    assert tables[id(a)] is not tables[id(b)]
    seen: dict[int, list[object]] = {id(a): [], id(b): []}
    def record_tables(llm: LLM) -> None:
        model = llm.engine.runner.model
        forward = model.forward

        def recording(*args, **kwargs):  # type: ignore[no-untyped-def]
            seen[id(llm)].append(ops._active)
            return forward(*args, **kwargs)

        model.forward = recording

    record_tables(a)
    record_tables(b)
    params = SamplingParams(max_tokens=3, temperature=0)
    a.generate([[5, 6, 7]], params)
    b.generate([[5, 6, 7]], params)
    a.generate([[8, 9]], params)
    assert seen[id(a)] and all(t is tables[id(a)] for t in seen[id(a)])
    assert seen[id(b)] and all(t is tables[id(b)] for t in seen[id(b)])
