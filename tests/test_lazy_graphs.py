"""Lazy graphs (`engine-serve --lazy-graphs`): the engine serves before its decode graphs are
captured, decode batches run eagerly until their graph is there, a decode step whose bucket has no
graph yet has it captured first (no capture before a step with prompt tokens: its TTFT would
wait), an idle engine captures the rest one piece (warm-up forward or capture) at a time, and the
tokens are the same as without graphs.

The CPU has no CUDA graphs: here a graph is a stand-in that replays by running the same forward
pass on the same persistent buffers (what a CUDA graph's replay computes), so everything around
it is the engine's own code: the capture plan, the padding of the buffers before each capture
(a capture between steps must not write the KV slots of the rows the last replay held), the
switch from eager steps to replays, padded batches.
"""

from __future__ import annotations

from typing import Any

import torch

from pagecast.runtime import LLM, SamplingParams
from pagecast.runtime.cuda_graphs import DecodeGraphs

PROMPTS = [[5 + i, 17 + 3 * i, 40 + i, 7, 99 + i][: 3 + i % 3] for i in range(4)]


class _Replay:
    def __init__(self, graphs: ReplayOnCPU, batch: int, context: int, out: torch.Tensor):
        self.graphs, self.batch, self.context, self.out = graphs, batch, context, out

    def replay(self) -> None:
        self.graphs.replays.append(self.batch)
        self.out.copy_(self.graphs._forward(self.batch, self.context))


class ReplayOnCPU(DecodeGraphs):
    """DecodeGraphs whose 'graphs' run eagerly on the buffers when replayed."""

    def __init__(self, *args: Any):
        super().__init__(*args)
        self.captures: list[int] = []
        self.replays: list[int] = []

    def _synchronize(self) -> None:
        pass

    def _capture_one(self, batch: int, context: int) -> tuple[Any, torch.Tensor]:
        self.captures.append(batch)
        out = self._forward(batch, context).clone()  # an output buffer of the right shape
        return _Replay(self, batch, context, out), out


def test_requests_are_served_while_graphs_are_captured_between_steps(tiny_llama_artifact) -> None:  # type: ignore[no-untyped-def]
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    eager = LLM(tiny_llama_artifact, max_num_seqs=4, async_scheduling=False)
    expected = [o.outputs[0].token_ids for o in eager.generate(PROMPTS, greedy, use_tqdm=False)]

    llm = LLM(tiny_llama_artifact, max_num_seqs=4, async_scheduling=False)
    runner = llm.engine.runner
    graphs = ReplayOnCPU(runner.model, runner.device, [1, 2, 4], llm.engine.max_model_len, llm.engine.block_size)
    runner.capture_lazily(graphs)
    assert graphs.pending == 3 and not graphs.captures  # nothing captured before serving

    # The engine serves at once: the first request runs eagerly while the first graphs are captured.
    first = llm.generate(PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True), use_tqdm=False)
    assert not graphs.captures  # not started: the engine starts capture once it is ready (after its warm-up)
    runner.start_lazy_capture()
    first = llm.generate(PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True), use_tqdm=False)
    assert first[0].outputs[0].token_ids == expected[0][:2]
    # The prefill step captured nothing; the decode step the graph of its own bucket, and ran it.
    assert graphs.captures == [1] and graphs.pending == 2
    assert graphs.replays == [1]

    outputs = llm.generate(PROMPTS, greedy, use_tqdm=False)
    assert graphs.captures == [1, 4] and graphs.pending == 1  # no step needed the graph of 2
    assert graphs.replays[1:] == [4] * 5  # the four prompts' five decode steps
    assert [o.outputs[0].token_ids for o in outputs] == expected
    # The rest while idle: a warm-up forward, then the capture.
    assert runner.capture_while_idle() and graphs.captures == [1, 4]
    assert not runner.capture_while_idle() and graphs.captures == [1, 4, 2]
    assert not runner.lazy_graphs_pending
    outputs = llm.generate(PROMPTS[:2], greedy, use_tqdm=False)
    assert graphs.captures == [1, 4, 2] and graphs.replays[6:] == [2] * 5
    assert [o.outputs[0].token_ids for o in outputs] == expected[:2]


def test_an_idle_engine_captures_its_graphs_without_waiting_for_requests(tiny_llama_artifact) -> None:  # type: ignore[no-untyped-def]
    """The engine-core process calls capture_while_idle when it has no request: one piece of a
    graph a call (its warm-up forward, then its capture), largest first, only once capture has
    started, so an idle server has all its graphs before traffic comes."""
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    eager = LLM(tiny_llama_artifact, max_num_seqs=4, async_scheduling=False)
    expected = [o.outputs[0].token_ids for o in eager.generate(PROMPTS, greedy, use_tqdm=False)]

    llm = LLM(tiny_llama_artifact, max_num_seqs=4, async_scheduling=False)
    runner = llm.engine.runner
    assert not runner.capture_while_idle()  # no lazy graphs at all: nothing to do
    graphs = ReplayOnCPU(runner.model, runner.device, [1, 2, 4], llm.engine.max_model_len, llm.engine.block_size)
    runner.capture_lazily(graphs)
    assert not runner.capture_while_idle() and not graphs.captures  # not started (before the warm-up)
    assert not runner.lazy_graphs_pending
    runner.start_lazy_capture()
    assert runner.lazy_graphs_pending
    progress = []
    while runner.capture_while_idle():
        progress.append((list(graphs.captures), sorted(graphs._warmed)))
    assert [c for c, _ in progress] == [[], [4], [4], [4, 2], [4, 2]]  # then the last capture: [4, 2, 1]
    assert [len(w) for _, w in progress] == [1, 1, 2, 2, 3]  # a warm-up before each capture
    assert graphs.captures == [4, 2, 1]
    assert not runner.lazy_graphs_pending
    assert not runner.capture_while_idle() and graphs.captures == [4, 2, 1]  # all there: nothing more

    outputs = llm.generate(PROMPTS, greedy, use_tqdm=False)
    assert graphs.captures == [4, 2, 1]  # no capture between the steps any more
    assert graphs.replays and set(graphs.replays) <= {1, 2, 4}
    assert [o.outputs[0].token_ids for o in outputs] == expected


def test_an_idle_core_captures_only_after_a_quiet_spell() -> None:
    """The engine-core process's idle step: with graphs to capture it waits for messages until the
    engine has been idle LAZY_CAPTURE_QUIET_S (a request arriving just after another, or just after
    /health, finds no capture running), then captures one graph per idle step; with none left it
    sleeps IDLE_POLL_MS between liveness checks."""
    from pagecast.runtime.core_process import IDLE_POLL_MS, LAZY_CAPTURE_QUIET_S, idle_poll

    assert idle_poll(False, 0.0) == (False, IDLE_POLL_MS)
    assert idle_poll(False, 10.0) == (False, IDLE_POLL_MS)
    capture, wait_ms = idle_poll(True, 0.0)
    assert not capture and wait_ms == round(LAZY_CAPTURE_QUIET_S * 1000)
    capture, wait_ms = idle_poll(True, LAZY_CAPTURE_QUIET_S * 0.9)
    assert not capture and 1 <= wait_ms <= LAZY_CAPTURE_QUIET_S * 1000 * 0.1 + 1
    assert idle_poll(True, LAZY_CAPTURE_QUIET_S) == (True, 0)
    assert idle_poll(True, 5.0) == (True, 0)
