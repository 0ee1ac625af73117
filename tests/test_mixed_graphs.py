"""Mixed-step graphs (`engine-serve --mixed-graphs`, runtime/cuda_graphs.py MixedGraphs): a step
with prompt tokens replays the layers between attention calls from graphs captured per token
bucket, and runs attention eagerly between them with the step's own metadata.

The CPU has no CUDA graphs: here a piece is a stand-in that replays by running the same code on
the same persistent buffers (what a CUDA graph's replay computes), so everything around it is the
engine's own: the model's pieces, the buffers they pass, the padding of a step to its bucket (no
KV written for padding rows, attention over the real rows only), the choice between pieces and an
eager forward. The tokens must be an eager engine's, for families whose layers differ in what
sits between their attention calls.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from pagecast.runtime import LLM, SamplingParams
from pagecast.runtime.cuda_graphs import MixedGraphs, mixed_graph_sizes

# Prompts of 3 to 40 tokens: with a budget of 24 tokens a step most steps mix decodes with a
# prompt chunk, and their token counts fall in and between the buckets.
PROMPTS = [[(7 + 13 * i + 29 * j) % 3000 + 3 for j in range(n)] for i, n in enumerate([3, 40, 9, 17, 5, 26])]


class _Piece:
    def __init__(self, graphs: MixedOnCPU, k: int, n: int):
        self.graphs, self.k, self.n = graphs, k, n

    def replay(self) -> None:
        self.graphs.replays.append((self.k, self.n))
        self.graphs._piece(self.k, self.n)


class MixedOnCPU(MixedGraphs):
    """MixedGraphs whose pieces run eagerly on the buffers when replayed."""

    def __init__(self, *args: Any):
        super().__init__(*args)
        self.replays: list[tuple[int, int]] = []
        self.steps: list[int] = []  # token count of each step run from the pieces
        self.mixed_steps = 0  # of them, steps with a prompt chunk beside decodes

    def _synchronize(self) -> None:
        pass

    def _capture_one(self, k: int, n: int) -> Any:
        return _Piece(self, k, n)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: Any) -> torch.Tensor:
        self.steps.append(input_ids.shape[0])
        self.mixed_steps += ctx.max_query_len > 1 and ctx.num_decodes > 0
        return super().run(input_ids, positions, ctx)


def _generate(llm: LLM) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]


@pytest.mark.parametrize("family", ["llama", "gemma2", "olmo2", "phi3", "granite", "qwen2_moe", "gpt_oss"])
def test_mixed_steps_from_pieces_give_the_eager_tokens(family, tiny_artifact_factory) -> None:  # type: ignore[no-untyped-def]
    # llama: input norms, SiLU; gemma2: sliding windows, soft-caps, norms after attention and MLP,
    # GELU; olmo2: no input norm (the stream itself enters q/k/v), q/k norms over the projection;
    # phi3: LongRoPE, whose positions follow each sequence's length; granite: multipliers;
    # qwen2_moe: a dense first layer, then MoE blocks with a gated shared expert; gpt_oss: MoE with
    # router and expert biases, attention sinks, alternating sliding windows.
    art = tiny_artifact_factory(family)
    options = {"max_num_seqs": 4, "max_num_batched_tokens": 32, "async_scheduling": False}
    expected = _generate(LLM(art, **options))

    llm = LLM(art, **options)
    runner = llm.engine.runner
    assert MixedGraphs.supports(runner.model)
    mixed = MixedOnCPU(runner.model, runner.device, [16, 24])  # a step of 25-32 tokens runs eagerly
    mixed.capture()
    assert mixed.pending == 0 and sorted(mixed.graphs) == [16, 24]
    runner.mixed = mixed
    eager_steps: list[int] = []
    forward = runner.model.forward
    runner.model.forward = lambda ids, *args: eager_steps.append(ids.shape[0]) or forward(ids, *args)
    assert _generate(llm) == expected

    assert mixed.mixed_steps, "no step with a prompt chunk beside decodes ran from the pieces"
    assert any(n not in (16, 24) for n in mixed.steps)  # padded to their bucket
    assert eager_steps and min(eager_steps) > 24  # only the steps past the largest bucket ran eagerly
    num_layers = len(runner.model.layers)
    # Each step replays every piece of its bucket once, in order.
    pieces = num_layers + 1
    assert len(mixed.replays) == len(mixed.steps) * pieces
    for i, n in enumerate(mixed.steps):
        bucket = 16 if n <= 16 else 24
        assert mixed.replays[i * pieces : (i + 1) * pieces] == [(k, bucket) for k in range(pieces)]
    assert llm.engine.block_pool.num_used_blocks == 0


def test_a_padded_step_writes_the_kv_an_eager_step_writes(tiny_llama_artifact) -> None:  # type: ignore[no-untyped-def]
    params = SamplingParams(temperature=0.0, max_tokens=1)
    eager = LLM(tiny_llama_artifact, max_num_seqs=4, async_scheduling=False)
    eager.generate([PROMPTS[2]], params, use_tqdm=False)

    llm = LLM(tiny_llama_artifact, max_num_seqs=4, async_scheduling=False)
    runner = llm.engine.runner
    mixed = MixedOnCPU(runner.model, runner.device, [32])
    mixed.capture()
    runner.mixed = mixed
    llm.generate([PROMPTS[2]], params, use_tqdm=False)
    assert mixed.steps == [9]  # one 9-token step, padded to 32
    # The padding rows wrote nothing (slot -1): the same slots hold K/V as in the eager engine's
    # cache, the same values up to the rounding of a 32-row matmul against a 9-row one.
    written = (llm.engine.kv_cache != 0).any(dim=-1)
    assert written.sum().item() == 9 * 2 * 2 * len(runner.model.layers)  # 9 tokens' K and V, 2 KV heads, every layer
    assert torch.equal(written, (eager.engine.kv_cache != 0).any(dim=-1))
    torch.testing.assert_close(llm.engine.kv_cache, eager.engine.kv_cache, rtol=1e-5, atol=1e-5)


def test_bucket_sizes_follow_the_step_budget() -> None:
    assert mixed_graph_sizes(8192) == [16, 32, 64, 128, 256, 384, 512]
    assert mixed_graph_sizes(512) == [16, 32, 64, 128, 256, 384, 512]
    assert mixed_graph_sizes(100) == [16, 32, 64, 100]


def test_moe_buckets_where_the_experts_wait_for_the_host_run_eagerly(tiny_artifact_factory, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from pagecast.kernels import fused_moe, ops
    from pagecast.kernels.tuning import moe_bucket

    moe = LLM(tiny_artifact_factory("qwen2_moe"), max_num_seqs=4, async_scheduling=False).engine.runner.model
    dense = LLM(tiny_artifact_factory("llama"), max_num_seqs=4, async_scheduling=False).engine.runner.model
    assert MixedGraphs.supports(moe) and MixedGraphs.supports(dense)
    sizes = [16, 256, 512]
    assert MixedGraphs.sizes_for(moe, sizes) == sizes  # untuned: the fused kernels everywhere
    # A table that keeps the naive per-expert loop (it syncs with the host) at the 512-token bucket.
    naive_at = moe_bucket(512)
    monkeypatch.setattr(ops, "_config", lambda kernel, bucket: fused_moe.NAIVE if bucket == naive_at else None)
    assert moe_bucket(256) != naive_at
    assert MixedGraphs.sizes_for(moe, sizes) == [16, 256]
    assert MixedGraphs.sizes_for(dense, sizes) == sizes


def test_an_idle_engine_captures_the_mixed_pieces_after_the_decode_graphs(tiny_llama_artifact) -> None:  # type: ignore[no-untyped-def]
    from test_lazy_graphs import ReplayOnCPU

    llm = LLM(tiny_llama_artifact, max_num_seqs=4, max_num_batched_tokens=32, async_scheduling=False)
    runner = llm.engine.runner
    runner.capture_lazily(ReplayOnCPU(runner.model, runner.device, [4], llm.engine.max_model_len, llm.engine.block_size))
    mixed = MixedOnCPU(runner.model, runner.device, [16, 32])
    mixed.SPLIT_PIECES = 2  # the tiny model has 3 layers: 4 pieces a bucket, two calls
    runner.mixed = mixed
    runner.start_lazy_capture()
    # Before their pieces are there, steps with prompt tokens run eagerly.
    llm.generate([PROMPTS[2]], SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
    assert not mixed.steps
    calls = 0
    while runner.capture_while_idle():
        calls += 1
    # One call the decode graph's warm-up, one its capture; per bucket one warm-up and two of pieces.
    assert calls + 1 == 2 + 2 * 3
    assert mixed.pending == 0 and sorted(mixed.graphs) == [16, 32] and not runner.lazy_graphs_pending
    assert all(len(pieces) == 4 for pieces in mixed.graphs.values())
    llm.generate([PROMPTS[2]], SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
    assert mixed.steps == [9]


@pytest.mark.parametrize("method", ["ngram", "eagle3"])
def test_speculative_steps_from_pieces_draft_and_accept_as_eager_ones(method, tiny_llama_artifact, tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    # Verification steps beside prompt chunks run from the pieces; EAGLE-3's head reads the
    # hidden states the pieces copy for each token's slot (padding rows: the spare row).
    from eagle3_heads import make_head

    if method == "eagle3":
        config = {"method": "eagle3", "model": str(make_head(tmp_path / "head", seed=21)), "num_speculative_tokens": 3}
    else:
        config = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2}
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6], [40 + i % 7 for i in range(40)], [9, 8, 9, 8, 9]]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    options = {"max_num_batched_tokens": 32, "max_num_seqs": 4, "speculative_config": config}

    def run(pieces: bool) -> tuple[list[list[int]], list[list[int]], int]:
        drafts: list[list[int]] = []
        llm = LLM(tiny_llama_artifact, **options)
        proposer = llm.engine.core.proposer
        propose = proposer.propose
        monkeypatch.setattr(proposer, "propose", lambda reqs, n: drafts.extend(out := propose(reqs, n)) or out)
        if pieces:
            runner = llm.engine.runner
            runner.mixed = MixedOnCPU(runner.model, runner.device, [16, 32])
            runner.mixed.capture()
        out = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        if pieces:
            assert runner.mixed.steps, "no step ran from the pieces"
        return out, drafts, llm.engine.core.stats().spec_num_accepted_tokens

    eager = run(pieces=False)
    assert eager[1], "nothing was drafted"
    assert run(pieces=True) == eager


def test_engine_serve_passes_mixed_graphs_to_each_engine(tmp_path, monkeypatch, restore_root_logging) -> None:  # type: ignore[no-untyped-def]
    from click.testing import CliRunner

    from pagecast.runtime import cli
    from pagecast.runtime.engine_core import EngineOptions

    seen: list[dict] = []

    def load_engines(artifacts, names, options):  # type: ignore[no-untyped-def]
        seen.append(dict(options))
        raise SystemExit(3)

    monkeypatch.setattr(cli, "_load_engines", load_engines)
    for flag, expected in (("--mixed-graphs", True), ("--no-mixed-graphs", False), (None, None)):
        args = [str(tmp_path)] + ([flag] if flag else [])
        assert CliRunner().invoke(cli.main, args).exit_code == 3
        assert seen[-1].get("mixed_graphs") == expected
    assert EngineOptions().mixed_graphs is False  # off unless asked for
    assert EngineOptions(**seen[0]).mixed_graphs is True


def test_a_failed_capture_turns_the_mixed_graphs_off_and_steps_run_eagerly(tiny_llama_artifact, caplog) -> None:  # type: ignore[no-untyped-def]
    from test_lazy_graphs import ReplayOnCPU

    class FailingCapture(MixedOnCPU):
        def _capture_one(self, k: int, n: int) -> Any:
            if k == 2:
                raise RuntimeError("operation not permitted when stream is capturing")
            return super()._capture_one(k, n)

    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    options = {"max_num_seqs": 4, "max_num_batched_tokens": 32, "async_scheduling": False}
    expected = [o.outputs[0].token_ids for o in LLM(tiny_llama_artifact, **options).generate(PROMPTS[:3], params, use_tqdm=False)]

    llm = LLM(tiny_llama_artifact, **options)
    runner = llm.engine.runner
    runner.capture_lazily(ReplayOnCPU(runner.model, runner.device, [4], llm.engine.max_model_len, llm.engine.block_size))
    runner.mixed = FailingCapture(runner.model, runner.device, [16])
    runner.start_lazy_capture()
    while runner.capture_while_idle():
        pass
    assert runner.mixed is None and not runner.lazy_graphs_pending
    assert "mixed-step CUDA graphs turned off" in caplog.text
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:3], params, use_tqdm=False)] == expected
