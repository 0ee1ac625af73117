"""AsyncEngine: the server's side of an engine whose core runs in a process of its own.

The core (scheduler, model runner, sampler) steps in an engine-core process
(``core_process.py``) and sends one message per step with every sequence's new token ids.
This side owns everything about text: it validates and tokenizes requests, mirrors each
request's sequences, detokenizes their tokens, applies stop strings (telling the core to
free a sequence a stop string ended), folds the n choices of a request into one
``RequestOutput`` and hands it to the request's async stream. It all runs on the event loop
that calls ``generate``, so it shares nothing with the step loop but the socket.

A consumer that stops iterating (client disconnect, cancellation) aborts its request, which
frees its KV blocks within one step. When the core process dies or stops answering, every
waiting request gets ``EngineDeadError`` and ``is_alive()`` turns False.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from pagecast.runtime import generation_config
from pagecast.runtime.artifact import load_manifest
from pagecast.runtime.core_process import CoreClient, position_logprobs
from pagecast.runtime.engine import tokenize_prompt, truncate_prompt
from pagecast.runtime.engine_core import EngineOptions, check_priority, check_prompt, new_sequences
from pagecast.runtime.errors import ArtifactError, EngineDeadError, PagecastError
from pagecast.runtime.loader import load_artifact_tokenizer
from pagecast.runtime.messages import (
    AbortRequests,
    AddRequest,
    CoreFailed,
    CoreMessage,
    EngineStats,
    StepOutputs,
)
from pagecast.runtime.output_processor import OutputProcessor, ParentRequest
from pagecast.runtime.outputs import PositionLogprobs, RequestOutput, merge_deltas
from pagecast.runtime.request import Request, RequestStatus
from pagecast.runtime.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger("pagecast.engine")


class _Stream:
    __slots__ = ("loop", "queue")

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()

    def put(self, item: RequestOutput | BaseException) -> None:
        self.queue.put_nowait(item)  # always called on the stream's own loop


class AsyncEngine:
    """One served model: an engine-core process and the output side of its requests.

    ``AsyncEngine(artifact, **options)`` starts the core process (or takes ``client``, one
    already started with the same options) and returns at once, so several engines start in
    parallel; ``wait_ready()`` blocks until it serves, raising what stopped it
    (``ArtifactError``, ``ValueError``). ``from_artifact`` does both.
    """

    def __init__(self, artifact: str | os.PathLike[str], client: CoreClient | None = None, **options: Any):
        # A bad option fails here, not in the child process.
        self.scheduling_policy = EngineOptions(**options).scheduling_policy
        self.artifact_path = Path(artifact)
        manifest = load_manifest(self.artifact_path)  # raises ArtifactError for a bad artifact
        self._model_name = manifest.name
        self.generation_defaults = generation_config.load_defaults(self.artifact_path)
        self._streams: dict[str, _Stream] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._error: BaseException | None = None
        self._stats: EngineStats | None = None
        if client is None:
            client = CoreClient(str(self.artifact_path), options)
        client.attach(self._on_message, busy=lambda: bool(self._streams))
        self._client = client
        # Loaded while the core starts: the core itself never needs the tokenizer.
        self._tokenizer = load_artifact_tokenizer(self.artifact_path)
        self.output_processor = OutputProcessor(self._tokenizer)
        self._ready: Any = None

    @classmethod
    def from_artifact(cls, artifact: str | os.PathLike[str], **options: Any) -> AsyncEngine:
        engine = cls(artifact, **options)
        engine.wait_ready()
        return engine

    def wait_ready(self, timeout: float | None = None) -> AsyncEngine:
        result = self._client.wait_ready(timeout)
        if isinstance(result, CoreFailed):
            self._client.shutdown(timeout=5)
            if result.kind == "artifact":
                raise ArtifactError(result.message)
            if result.kind == "value":
                raise ValueError(result.message)
            raise EngineDeadError(f"the engine for {self._model_name} failed to start: {result.message}")
        self._ready = result
        self.eos_token_ids = frozenset(result.eos_token_ids)
        return self

    # What the server reads.
    @property
    def model_name(self) -> str:
        return self._model_name

    @property
    def tokenizer(self) -> Any:
        return self._tokenizer

    @property
    def max_model_len(self) -> int:
        return int(self._ready.max_model_len)

    @property
    def vocab_size(self) -> int:
        return int(self._ready.vocab_size)

    @property
    def max_num_seqs(self) -> int:
        return int(self._ready.max_num_seqs)

    @property
    def startup_info(self) -> Any:
        """What the core reported when it became ready (device, KV blocks, start-up seconds)."""
        return self._ready

    def tokenize(self, prompt: str) -> list[int]:
        """Token ids of a text prompt exactly as generate() tokenizes it (no special tokens added)."""
        return tokenize_prompt(self._tokenizer, prompt)[1]

    def validate(self, prompt: str | list[int], params: SamplingParams) -> tuple[str | None, list[int], int]:
        text, ids = tokenize_prompt(self._tokenizer, prompt)
        ids = truncate_prompt(ids, params, self.max_model_len)
        return text, ids, check_prompt(ids, params, self.vocab_size, self.max_model_len)

    def start(self) -> None:
        """The core runs from construction on; kept so servers can start engines uniformly."""

    def shutdown(self, timeout: float | None = 10.0) -> None:
        self._client.shutdown(timeout if timeout is not None else 10.0)

    def is_alive(self) -> bool:
        return self._ready is not None and self._error is None and self._client.is_alive()

    def num_unfinished(self) -> int:
        return len(self._streams)

    def stats(self) -> EngineStats:
        """The core's statistics as of its last message (sent every step and after aborts)."""
        if self._stats is None:
            num_blocks = int(self._ready.num_kv_blocks) if self._ready is not None else 0
            return EngineStats(0, 0, num_blocks, 0, 0.0, 0, 0, 0, 0, 0)
        return self._stats

    def abort(self, request_id: str) -> None:
        """Abort a request (unknown or finished ids are ignored); call on the event loop."""
        live = self.output_processor.live_sequences(request_id)
        if live is None:
            return
        output = self.output_processor.abort(request_id)
        if live and self._error is None:
            self._client.send(AbortRequests(live))
        self._deliver(output)

    async def generate(
        self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None, priority: int = 0
    ) -> AsyncIterator[RequestOutput]:
        """Outputs of one request as ``params.output_kind`` asks (cumulative by default; deltas
        that a slow consumer missed arrive merged into one); the last has ``finished`` set.
        ``priority``: under the "priority" scheduling policy, lower is served first."""
        if not self.is_alive():
            raise EngineDeadError(
                f"the engine for {self.model_name} is not running" + (f" (it failed: {self._error})" if self._error else ""),
                getattr(self._error, "error_id", None),
            )
        text, ids, max_tokens = self.validate(prompt, params)  # raises InvalidRequestError before anything is queued
        check_priority(priority, self.scheduling_policy)
        request_id = request_id or f"cmpl-{uuid.uuid4().hex}"
        if request_id in self._streams:
            raise PagecastError(f"request id {request_id} is already in use")
        loop = asyncio.get_running_loop()
        self._loop = loop
        stream = _Stream(loop)
        arrival = time.monotonic()
        children = new_sequences(request_id, ids, params, self.eos_token_ids, max_tokens, arrival, priority)
        self._streams[request_id] = stream
        self.output_processor.add(ParentRequest(request_id, text, ids, children))
        self._client.send(AddRequest(request_id, ids, params, max_tokens, arrival, priority))
        delta = params.output_kind == RequestOutputKind.DELTA
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                # When the consumer lags: of cumulative outputs only the newest matters; deltas
                # are merged into one. A failure queued behind outputs is raised after them: the
                # tokens made before it still reach the client (a stream starts with them, then
                # ends with the error, rather than being refused).
                behind: list[RequestOutput] = []
                failure: BaseException | None = None
                while not stream.queue.empty() and isinstance(item, RequestOutput) and not item.finished:
                    following = stream.queue.get_nowait()
                    if isinstance(following, BaseException):
                        failure = following
                        break
                    behind.append(item)
                    item = following
                if behind and delta and isinstance(item, RequestOutput):
                    item = merge_deltas([*behind, item])
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if failure is not None:
                    finished = True
                    raise failure
                if finished:
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    # -- messages from the core (the receiver thread hands them to the event loop) --------------

    def _on_message(self, msg: CoreMessage) -> None:
        if isinstance(msg, StepOutputs):
            self._stats = msg.stats  # read by /metrics from any thread: one reference swap
            if not msg.updates and not msg.failed:
                return
        loop = self._loop
        if loop is None or loop.is_closed():
            if isinstance(msg, CoreFailed):
                self._error = self._dead(msg)
            return
        try:
            loop.call_soon_threadsafe(self._handle, msg)
        except RuntimeError:  # the loop closed meanwhile: nobody waits for these outputs
            if isinstance(msg, CoreFailed):
                self._error = self._dead(msg)

    def _dead(self, failure: CoreFailed) -> EngineDeadError:
        """The error every request of a failed engine gets, its details logged once under an id
        (the server gives clients that id, not the details: they can hold paths, tracebacks,
        another request's data)."""
        error_id = f"err-{uuid.uuid4().hex[:16]}"
        logger.error("engine %s failed (error id %s): %s", self.model_name, error_id, failure.message)
        return EngineDeadError(f"the engine failed: {failure.message}", error_id)

    def _handle(self, msg: CoreMessage) -> None:
        if isinstance(msg, CoreFailed):
            self._fail_all(msg)
            return
        assert isinstance(msg, StepOutputs)
        op = self.output_processor
        for request_id, why in msg.failed.items():
            if op.live_sequences(request_id) is not None:
                op.abort(request_id)
            stream = self._streams.get(request_id)
            if stream is not None:
                stream.put(why.error())
        now = time.monotonic()
        updated: list[Request] = []
        logprobs: dict[str, list[PositionLogprobs]] = {}
        prompt_logprobs: dict[str, list[PositionLogprobs]] = {}
        num_new: dict[str, int] = {}  # sequences with several new tokens (speculative decoding)
        seen: set[str] = set()
        for update in msg.updates:
            child = op.children.get(update.sequence_id)
            if child is None or child.is_finished:
                continue  # aborted here, or ended by a stop string: the core learns it a step later
            if update.sequence_id in seen:  # two tokens of one sequence in one message: one at a time
                self._process(updated, logprobs, prompt_logprobs, num_new)
                updated, logprobs, prompt_logprobs, num_new, seen = [], {}, {}, {}, set()
            seen.add(update.sequence_id)
            metrics = child.metrics
            metrics.first_scheduled_time = update.first_scheduled_time
            metrics.num_cached_tokens = update.num_cached_tokens
            metrics.num_preemptions = update.num_preemptions
            if update.prompt_logprobs:
                prompt_logprobs[child.request_id] = [position_logprobs(e) for e in update.prompt_logprobs]
            if not update.new_token_ids:
                continue
            for token_id in update.new_token_ids:
                child.append_output_token(token_id)
            if len(update.new_token_ids) > 1:
                num_new[child.request_id] = len(update.new_token_ids)
            if metrics.first_token_time is None:
                metrics.first_token_time = now
            metrics.last_token_time = now
            if update.status:
                child.status = RequestStatus(update.status)
                child.stop_reason = update.stop_reason
                metrics.finished_time = now
            if update.logprobs:
                logprobs[child.request_id] = [position_logprobs(e) for e in update.logprobs]
            updated.append(child)
        self._process(updated, logprobs, prompt_logprobs, num_new)

    def _process(
        self,
        updated: list[Request],
        logprobs: dict[str, list[PositionLogprobs]],
        prompt_logprobs: dict[str, list[PositionLogprobs]],
        num_new: dict[str, int],
    ) -> None:
        if not updated and not prompt_logprobs:
            return
        op = self.output_processor
        outputs, stopped = op.process(updated, logprobs, prompt_logprobs, num_new_tokens=num_new)
        if stopped:
            self._client.send(AbortRequests(stopped))
            outputs = op.remake_outputs(outputs, stopped)
        for out in outputs:
            self._deliver(out)

    def _deliver(self, out: RequestOutput) -> None:
        stream = self._streams.get(out.request_id)
        if stream is not None:
            stream.put(out)

    def _fail_all(self, failure: CoreFailed) -> None:
        self._error = self._dead(failure)
        op = self.output_processor
        for request_id in list(op.parents):
            parent = op.parents[request_id]
            for child in parent.children:
                if not child.is_finished:
                    child.status = RequestStatus.FINISHED_ERROR
            op.make_output(parent)  # forgets it
        for stream in list(self._streams.values()):
            stream.put(self._error)
