"""Decode halves on a GPU (run with `pytest -m gpu` on the accelerator): decode graphs of 128 rows
captured as two 64-row halves on two streams (a fork and a join inside the graph) give the tokens
of an engine whose graphs run the whole batch. The CPU test (tests/test_decode_halves.py) checks
the halves' rows with stand-in graphs; this one checks that the fork and join capture (both
streams' kernels in one graph, the second stream's memory from the graph's pool) and replay."""

from __future__ import annotations

import pytest
import torch
from conftest import build_artifact
from tiny_models import make_checkpoint

from pagecast.runtime import LLM, SamplingParams

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

# 100 prompts of 3 to 40 tokens: their decode steps run 100 sequences in the 128-row graph.
PROMPTS = [[1 + (i * 37 + j * 11) % 4000 for j in range(3 + (i * 7) % 38)] for i in range(100)]


@pytest.mark.parametrize(("dtype", "carveout"), [("float32", 0), ("bfloat16", 0), ("float32", 32)])
def test_decode_halves_in_cuda_graphs_give_the_whole_batchs_tokens(tmp_path, dtype, carveout):  # type: ignore[no-untyped-def]
    ckpt = make_checkpoint(tmp_path / "ckpt", "llama", tokenizer=False)
    art = build_artifact(ckpt, tmp_path / "art", gpu="auto", dtype=dtype, tune_budget_s=10.0)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    options = {"max_num_seqs": 128, "kv_cache_memory": "256MiB"}

    plain = LLM(art, **options)
    assert plain.engine.runner.graphs is not None and plain.engine.runner.graphs.half(128) == 0
    expected = [o.token_ids for o in plain.generate(PROMPTS, params, use_tqdm=False)]
    del plain

    llm = LLM(art, decode_halves_from=64, decode_halves_carveout=carveout, **options)
    assert torch._C._get_sm_carveout_experimental() is None  # set only while the halves are captured
    graphs = llm.engine.runner.graphs
    assert graphs is not None and graphs.half(128) == 64 and graphs.half(32) == 0
    replayed: list[int] = []
    run = graphs.run
    graphs.run = lambda ids, *args: replayed.append(ids.shape[0]) or run(ids, *args)  # type: ignore[method-assign]
    got = [o.token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    # bf16: a 64-row GEMM may take another kernel than a 128-row one and round otherwise; the first
    # tokens must agree (as between a batch and single requests), fp32 every token.
    if dtype == "float32":
        assert got == expected
    else:
        assert [t[:4] for t in got] == [t[:4] for t in expected]
    assert any(n > 64 for n in replayed), "no decode step ran from a graph of halves"
    assert llm.engine.block_pool.num_used_blocks == 0
    del llm
    torch.cuda.empty_cache()
