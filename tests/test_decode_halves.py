"""Decode halves (`engine-serve --decode-halves-from N`, runtime/cuda_graphs.py): a decode graph of
at least N rows runs its batch as two half-batches, each its own forward pass (on its own stream on
a GPU), and gives the whole batch's tokens.

The CPU has no CUDA graphs or streams: as in tests/test_lazy_graphs.py a graph is a stand-in that
replays by running the same forward passes on the same persistent buffers, so what is tested is
the engine's own code around them: each half's rows, block tables, slots and query offsets,
padding rows in the second half, and which batches split. tests/test_decode_halves_gpu.py runs the
two streams inside real graphs."""

from __future__ import annotations

import pytest
import torch
from click.testing import CliRunner
from test_lazy_graphs import ReplayOnCPU

from pagecast.runtime import LLM, SamplingParams
from pagecast.runtime import cli as serve_cli
from pagecast.runtime.cuda_graphs import MIN_HALF_ROWS, DecodeGraphs
from pagecast.runtime.engine_core import EngineOptions

# 70 prompts of 3 to 9 tokens: their decode steps run 70 sequences, padded to the 72-row graph.
PROMPTS = [[(11 + 7 * i + 13 * j) % 2000 + 3 for j in range(3 + i % 7)] for i in range(70)]


def test_decode_halves_give_the_whole_batchs_tokens(tiny_llama_artifact) -> None:  # type: ignore[no-untyped-def]
    greedy = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    options = {"max_num_seqs": 72, "max_num_batched_tokens": 512, "async_scheduling": False}
    expected = [o.outputs[0].token_ids for o in LLM(tiny_llama_artifact, **options).generate(PROMPTS, greedy, use_tqdm=False)]

    llm = LLM(tiny_llama_artifact, **options)
    runner = llm.engine.runner
    graphs = ReplayOnCPU(runner.model, runner.device, [8, 72], llm.engine.max_model_len, llm.engine.block_size, 64)
    assert graphs.half(72) == 36 and graphs.half(8) == 0  # 8 rows: below 64, whole
    runner.capture_lazily(graphs)
    runner.start_lazy_capture()
    calls: list[tuple[int, list[int]]] = []  # each forward's rows and its query offsets
    forward = runner.model.forward

    def spy(ids, positions, ctx):  # type: ignore[no-untyped-def]
        calls.append((ids.shape[0], ctx.query_start_loc.tolist()))
        return forward(ids, positions, ctx)

    runner.model.forward = spy
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy, use_tqdm=False)]
    assert got == expected
    assert graphs.replays and set(graphs.replays) == {72}  # every decode step: 70 sequences in the 72-row graph
    halves = [c for c in calls if c[0] == 36]
    assert len(halves) >= 2 * len(graphs.replays)  # each replay ran two halves (and the capture, its own)
    assert all(offsets == list(range(37)) for _, offsets in halves)  # each half's offsets start at 0
    assert not any(n == 72 for n, _ in calls)  # the 72-row batch never ran whole
    assert llm.engine.block_pool.num_used_blocks == 0


def test_halves_read_and_write_their_own_rows(tiny_llama_artifact) -> None:  # type: ignore[no-untyped-def]
    """One decode batch of 64 rows (the last 4 padding: no slot, empty context) through the
    forward of the halves and of the whole batch: the same hidden states, row for row."""
    llm = LLM(tiny_llama_artifact, max_num_seqs=64, async_scheduling=False)
    runner, bs = llm.engine.runner, llm.engine.block_size
    kv = runner.model.k_caches[0]
    g = torch.Generator().manual_seed(0)
    for cache in runner.model.k_caches + runner.model.v_caches:
        cache.copy_(torch.randn(cache.shape, generator=g).to(cache.dtype))
    per_seq = 3  # blocks
    assert kv.shape[0] >= 64 * per_seq
    outs = []
    for halves_from in (0, 64):
        graphs = DecodeGraphs(runner.model, runner.device, [64], llm.engine.max_model_len, bs, halves_from)
        lens = torch.randint(1, per_seq * bs, (64,), generator=torch.Generator().manual_seed(1))
        lens[60:] = 0
        graphs.seq_lens[:64].copy_(lens)
        graphs.positions[:64].copy_((lens - 1).clamp(min=0))
        graphs.input_ids[:64].copy_(torch.randint(3, 2000, (64,), generator=torch.Generator().manual_seed(2)))
        tables = torch.arange(64 * per_seq, dtype=torch.int32).view(64, per_seq)
        graphs.block_tables[:64, :per_seq].copy_(tables)
        last = (lens - 1).clamp(min=0)
        slots = tables[torch.arange(64), last // bs].long() * bs + last % bs
        graphs.slot_mapping[:64].copy_(torch.where(lens > 0, slots, -1))
        with torch.inference_mode():
            outs.append(graphs._forward(64, llm.engine.max_model_len).clone())
    torch.testing.assert_close(outs[1][:60], outs[0][:60], atol=1e-5, rtol=1e-5)


def test_decode_halves_options_are_checked() -> None:
    assert MIN_HALF_ROWS == serve_cli._MIN_DECODE_HALVES // 2
    EngineOptions(decode_halves_from=0)
    EngineOptions(decode_halves_from=2 * MIN_HALF_ROWS)
    with pytest.raises(ValueError, match="decode_halves_from must be 0 .off. or at least 64"):
        EngineOptions(decode_halves_from=32)
    EngineOptions(decode_halves_from=64, decode_halves_carveout=32)
    with pytest.raises(ValueError, match="decode_halves_carveout .* needs decode_halves_from"):
        EngineOptions(decode_halves_carveout=32)
    with pytest.raises(ValueError, match="at least 64 rows"):
        DecodeGraphs(None, torch.device("cpu"), [64], 128, 16, halves_from=48)
    result = CliRunner().invoke(serve_cli.main, ["/nonexistent-artifact", "--decode-halves-from", "32"])
    assert result.exit_code != 0
    assert "--decode-halves-from must be 0 (off) or at least 64" in result.output
