"""Outputs as deltas (issue 33): what crosses from the core is the step's new tokens, and what the
front end hands a DELTA stream is only what is new, so the work of a step does not grow with
the length of the outputs; FINAL_ONLY requests get one output, at the end."""

from __future__ import annotations

import asyncio
import tracemalloc
import types

import msgspec
import pytest
from transformers import AutoTokenizer

from pagecast.runtime.async_engine import AsyncEngine
from pagecast.runtime.core_process import step_updates
from pagecast.runtime.engine_core import StepResult
from pagecast.runtime.messages import EngineStats, StepOutputs
from pagecast.runtime.output_processor import OutputProcessor, ParentRequest
from pagecast.runtime.outputs import CompletionOutput, Logprob, RequestOutput, merge_deltas
from pagecast.runtime.request import Request, RequestStatus
from pagecast.runtime.sampling_params import RequestOutputKind, SamplingParams

TEXT = (
    "Streaming servers send each client what is new: a few characters, a token id, its "
    "log-probability. Copying the whole answer at every step would cost more the longer it gets. "
) * 3


@pytest.fixture(scope="module")
def tokenizer():  # type: ignore[no-untyped-def]
    from tiny_models import tokenizer_dir

    return AutoTokenizer.from_pretrained(str(tokenizer_dir()))


class CharTokenizer:
    """Token i is the letter chr(97 + i % 26): decoding costs nothing, so what is measured is
    the output processor's own work."""

    def decode(self, ids, skip_special_tokens=True, clean_up_tokenization_spaces=False):  # type: ignore[no-untyped-def]
        return "".join(chr(97 + i % 26) for i in ids)


def start(op: OutputProcessor, rid: str, prompt: list[int], params: SamplingParams) -> list[Request]:
    children = [
        Request(rid if params.n == 1 else f"{rid}#{i}", prompt, params, parent_id=rid, index=i,
                max_tokens=params.max_tokens)  # fmt: skip
        for i in range(params.n)
    ]
    for child in children:
        child.status = RequestStatus.RUNNING
    op.add(ParentRequest(rid, None, prompt, children))
    return children


def step(op: OutputProcessor, tokens: dict[Request, int], final: bool = False) -> list[RequestOutput]:
    """One engine step as the server's front end sees it: each sequence gets one token."""
    logprobs = {}
    for child, token in tokens.items():
        child.append_output_token(token)
        if final:
            child.status = RequestStatus.FINISHED_LENGTH
        if child.logprobs is not None:
            logprobs[child.request_id] = [{token: Logprob(-0.25, 1)}]
    outputs, stopped = op.process(list(tokens), logprobs, {})
    return op.remake_outputs(outputs, stopped)


def test_delta_outputs_hold_only_the_new_text_tokens_and_logprobs(tokenizer) -> None:  # type: ignore[no-untyped-def]
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    prompt = tokenizer.encode("Tell me:", add_special_tokens=False)
    op = OutputProcessor(tokenizer)
    kinds = (RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE, RequestOutputKind.FINAL_ONLY)
    seqs = {
        kind: start(op, kind.name, prompt, SamplingParams(n=2, max_tokens=len(ids), logprobs=0, output_kind=kind))
        for kind in kinds
    }
    got: dict[RequestOutputKind, list[RequestOutput]] = {kind: [] for kind in kinds}
    for j, token in enumerate(ids):
        last = j == len(ids) - 1
        # Choice 1 of each request advances only on even steps (n > 1: a delta names the choices that moved).
        tokens = {c: token for kind in kinds for c in seqs[kind] if c.index == 0 or j % 2 == 0 or last}
        for out in step(op, tokens, final=last):
            got[RequestOutputKind[out.request_id]].append(out)

    deltas = got[RequestOutputKind.DELTA]
    assert len(deltas) == len(ids) and deltas[-1].finished and not any(d.finished for d in deltas[:-1])
    for j, out in enumerate(deltas):
        moved = [0] if j % 2 and j != len(ids) - 1 else [0, 1]
        assert [o.index for o in out.outputs] == moved
        for o in out.outputs:
            # Exactly the step's token and its logprob, never the history.
            assert o.token_ids == [ids[j]] and o.logprobs is not None and len(o.logprobs) == 1
    whole = tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    final_cumulative = got[RequestOutputKind.CUMULATIVE][-1]
    assert final_cumulative.outputs[0].text == whole
    assert "".join(o.text for out in deltas for o in out.outputs if o.index == 0) == whole
    assert [t for out in deltas for o in out.outputs if o.index == 0 for t in o.token_ids] == ids
    # All that DELTA handed out is the output once; CUMULATIVE copied it at every step.
    handed_out = sum(len(o.token_ids) for out in deltas for o in out.outputs)
    assert handed_out == len(ids) + len(ids[::2]) + (len(ids) % 2 == 0)
    assert sum(len(o.token_ids) for out in got[RequestOutputKind.CUMULATIVE] for o in out.outputs) > len(ids) ** 2 / 2
    # FINAL_ONLY: one output, at the end, whole.
    (final,) = got[RequestOutputKind.FINAL_ONLY]
    assert final.finished and final.outputs[0].text == whole and final.outputs[0].token_ids == ids
    assert final.outputs[0].finish_reason == "length" and len(final.outputs[0].logprobs or ()) == len(ids)
    assert not op.parents and not op.children


def test_merged_deltas_equal_the_steps_they_replace() -> None:
    def out(index: int, text: str, ids: list[int], finished: bool = False) -> RequestOutput:
        completion = CompletionOutput(index, text, ids, "stop" if finished else None, logprobs=[{i: Logprob(-1.0, 1)} for i in ids])
        return RequestOutput("r", None, [1], [completion], finished)

    merged = merge_deltas([out(0, "ab", [1]), out(1, "x", [7]), out(0, "c", [2, 3]), out(0, "d", [4], finished=True)])
    assert merged.finished
    by_index = {o.index: o for o in merged.outputs}
    assert (by_index[0].text, by_index[0].token_ids, by_index[0].finish_reason) == ("abcd", [1, 2, 3, 4], "stop")
    assert len(by_index[0].logprobs or ()) == 4 and (by_index[1].text, by_index[1].token_ids) == ("x", [7])


def bytes_allocated_per_step(op: OutputProcessor, children: list[Request], steps: int) -> float:
    """Python memory allocated during a step (tracemalloc's peak above the start), averaged."""
    total = 0
    for i in range(steps):
        tokens = {c: (i * 7 + c.index) % 26 for c in children}
        tracemalloc.start()
        base = tracemalloc.get_traced_memory()[0]
        outputs = step(op, tokens)
        total += tracemalloc.get_traced_memory()[1] - base
        tracemalloc.stop()
        del outputs
    return total / steps


def test_a_steps_work_does_not_grow_with_the_output_length() -> None:
    """Structural, not timed: a DELTA step at 4,000 output tokens allocates no more than one at
    200 (a copy of the history per step, as before issue 33, would allocate ~40 times more)."""
    op = OutputProcessor(CharTokenizer())
    params = SamplingParams(max_tokens=10_000, logprobs=1, stop=["zzz"], output_kind=RequestOutputKind.DELTA)
    children = [c for i in range(8) for c in start(op, f"r{i}", [1, 2, 3], params)]
    grown = 0
    per_step = {}
    for length in (200, 4000):
        while grown < length:
            step(op, {c: (grown * 5 + 3) % 26 for c in children})
            grown += 1
        per_step[length] = bytes_allocated_per_step(op, children, 16)
        grown += 16
    assert per_step[4000] < 1.3 * per_step[200] + 1024, per_step
    # What crosses from the core per step does not grow either: the new token, not the output.
    sizes = []
    for child in children[:1]:
        result = StepResult([child], {child.request_id: [{5: Logprob(-0.1, 1)}]}, {})
        sizes.append(len(msgspec.msgpack.encode(StepOutputs(step_updates(result), EngineStats(0, 0, 1, 0, 0.0, 0, 0, 0, 0, 0)))))
        child.output_token_ids.extend([5] * 5000)
        sizes.append(len(msgspec.msgpack.encode(StepOutputs(step_updates(result), EngineStats(0, 0, 1, 0, 0.0, 0, 0, 0, 0, 0)))))
    assert sizes[0] == sizes[1], sizes


class _QueuedEngine(AsyncEngine):
    """generate() over queues this test fills: no core process, nothing sent."""

    def __init__(self) -> None:  # noqa: D107 - no core: the attributes generate() reads
        self._model_name, self._error, self._streams, self.eos_token_ids = "m", None, {}, frozenset()
        self.scheduling_policy = "fcfs"
        self.output_processor = types.SimpleNamespace(add=lambda parent: None)
        self._client = types.SimpleNamespace(send=lambda message: None)
        self.aborted: list[str] = []

    def is_alive(self) -> bool:
        return True

    def validate(self, prompt, params):  # type: ignore[no-untyped-def]
        return None, list(prompt), params.max_tokens

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)


@pytest.mark.parametrize("kind", [RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE])
def test_outputs_queued_before_a_failure_reach_a_lagging_consumer_first(kind) -> None:  # type: ignore[no-untyped-def]
    """The core made three tokens, then failed, before the consumer (the server, whose first
    output decides a stream's status) read any of them: it gets the tokens, then the error. It
    used to get the error alone (in CI a stream answered 503 instead of 200 and its tokens)."""

    def out(ids: list[int]) -> RequestOutput:
        return RequestOutput("r", None, [1], [CompletionOutput(0, "x" * len(ids), ids, None)], False)

    async def run() -> tuple[list[RequestOutput], BaseException | None]:
        engine = _QueuedEngine()
        stream = engine.generate([1, 2], SamplingParams(max_tokens=8, output_kind=kind), request_id="r")
        first = asyncio.ensure_future(stream.__anext__())
        await asyncio.sleep(0)  # generate() has queued its request and waits for outputs
        queue = engine._streams["r"].queue
        for ids in ([5], [6], [7]) if kind == RequestOutputKind.DELTA else ([5], [5, 6], [5, 6, 7]):
            queue.put_nowait(out(ids))
        queue.put_nowait(RuntimeError("simulated device failure"))
        got = [await first]
        try:
            async for o in stream:
                got.append(o)
        except RuntimeError as exc:
            return got, exc
        return got, None

    got, error = asyncio.run(run())
    assert [o.outputs[0].token_ids for o in got] == [[5, 6, 7]]  # merged deltas, or the newest whole
    assert isinstance(error, RuntimeError) and "simulated" in str(error)
