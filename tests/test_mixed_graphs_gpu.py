"""Mixed-step CUDA graphs on a GPU (run with `pytest -m gpu` on the accelerator): steps with
prompt tokens replayed from graph pieces give the tokens an engine without them gives, with
asynchronous scheduling, padded buckets and steps past the largest bucket (eager) in one run.
The CPU test (tests/test_mixed_graphs.py) checks the same with stand-in pieces; this one checks
that the pieces capture (no host sync, every kernel loaded by the warm-up) and replay."""

from __future__ import annotations

import pytest
import torch
from conftest import build_artifact
from tiny_models import make_checkpoint

from pagecast.runtime import LLM, SamplingParams
from pagecast.runtime.cuda_graphs import MixedGraphs

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

# 3 to 220 tokens (with 24 new ones within the tiny checkpoints' 256 positions: 300 was refused by
# gemma2's): with a 512-token budget and 8 sequences, steps mix decodes with prompt chunks of many
# sizes, up to the largest bucket.
PROMPTS = [[1 + (i * 37 + j * 11) % 4000 for j in range(n)] for i, n in enumerate([5, 17, 220, 64, 100, 3, 200, 9, 130, 40])]


@pytest.mark.parametrize(
    ("family", "dtype"), [("llama", "float32"), ("gemma2", "float32"), ("qwen3_moe", "float32"), ("llama", "bfloat16")]
)
def test_mixed_graphs_give_the_eager_tokens(tmp_path, family, dtype):  # type: ignore[no-untyped-def]
    ckpt = make_checkpoint(tmp_path / "ckpt", family, tokenizer=False)
    art = build_artifact(ckpt, tmp_path / "art", gpu="auto", dtype=dtype, tune_budget_s=10.0)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    options = {"max_num_batched_tokens": 512, "max_num_seqs": 8, "kv_cache_memory": "256MiB"}

    plain = LLM(art, **options)
    assert plain.engine.runner.mixed is None
    expected = [o.token_ids for o in plain.generate(PROMPTS, params, use_tqdm=False)]
    del plain

    llm = LLM(art, mixed_graphs=True, **options)
    mixed = llm.engine.runner.mixed
    assert mixed is not None and mixed.pending == 0
    every = [16, 32, 64, 128, 256, 384, 512]
    # A MoE model skips the buckets where the tuner kept the per-expert loop (it waits for the host).
    assert sorted(mixed.graphs) == (MixedGraphs.sizes_for(llm.engine.runner.model, every) if "moe" in family else every)
    steps: list[int] = []
    run = mixed.run
    mixed.run = lambda ids, *args: steps.append(ids.shape[0]) or run(ids, *args)  # type: ignore[method-assign]
    got = [o.token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    # bf16: the graphs pad a step's rows, which can change a GEMM's kernel and its rounding; the
    # first tokens must agree (as between a batch and single requests), fp32 every token.
    if dtype == "float32":
        assert got == expected
    else:
        assert [t[:4] for t in got] == [t[:4] for t in expected]
    assert any(n > 8 for n in steps), "no step with prompt tokens ran from the graph pieces"
    assert llm.engine.block_pool.num_used_blocks == 0
    del llm
    torch.cuda.empty_cache()
