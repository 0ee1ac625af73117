"""AsyncEngine: the engine loop in its own thread, with an async stream per request.

The step loop never runs on the event loop, so HTTP handling stays responsive while the
model runs. Requests and aborts cross into the loop thread through queues; outputs come
back through ``loop.call_soon_threadsafe``. A consumer that stops iterating (client
disconnect, cancellation) aborts its request, which frees its KV blocks within one step.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import threading
import uuid
from collections.abc import AsyncIterator
from typing import Any

from pagecast.runtime.engine import EngineStats, LLMEngine
from pagecast.runtime.errors import EngineDeadError, PagecastError
from pagecast.runtime.outputs import RequestOutput
from pagecast.runtime.sampling_params import SamplingParams

logger = logging.getLogger("pagecast.engine")


class _Stream:
    __slots__ = ("loop", "queue")

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()

    def put(self, item: RequestOutput | BaseException) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


class AsyncEngine:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._streams: dict[str, _Stream] = {}
        self._adds: collections.deque[tuple[str, Any, SamplingParams, Any]] = collections.deque()
        self._aborts: collections.deque[str] = collections.deque()
        self._wakeup = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    @classmethod
    def from_artifact(cls, artifact: str | os.PathLike[str], **options: Any) -> AsyncEngine:
        return cls(LLMEngine(artifact, **options))

    # What the server reads.
    @property
    def model_name(self) -> str:
        return self.engine.model_name

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self.engine.eos_token_ids

    @property
    def vocab_size(self) -> int:
        return self.engine.vocab_size

    @property
    def max_num_seqs(self) -> int:
        return self.engine.options.max_num_seqs

    def tokenize(self, prompt: str) -> list[int]:
        """Token ids of a text prompt exactly as generate() tokenizes it (no special tokens added)."""
        return self.engine.tokenize(prompt)[1]

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=f"pagecast-engine-{self.model_name}", daemon=True)
            self._thread.start()

    def shutdown(self, timeout: float | None = 10.0) -> None:
        self._stop.set()
        self._wakeup.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self._error is None

    def num_unfinished(self) -> int:
        return len(self._streams)

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def abort(self, request_id: str) -> None:
        self._aborts.append(request_id)
        self._wakeup.set()

    async def generate(
        self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Cumulative outputs of one request; the last has ``finished`` set."""
        if not self.is_alive():
            raise EngineDeadError(f"the engine for {self.model_name} is not running" + (
                f" (it failed: {self._error})" if self._error else ""))
        validated = self.engine.validate(prompt, params)  # raises InvalidRequestError before anything is queued
        request_id = request_id or f"cmpl-{uuid.uuid4().hex}"
        stream = _Stream(asyncio.get_running_loop())
        if request_id in self._streams:
            raise PagecastError(f"request id {request_id} is already in use")
        self._streams[request_id] = stream
        self._adds.append((request_id, prompt, params, validated))
        self._wakeup.set()
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                # Outputs are cumulative: when the consumer lags, only the newest one matters.
                while not stream.queue.empty() and isinstance(item, RequestOutput) and not item.finished:
                    item = stream.queue.get_nowait()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    # -- the loop thread ----------------------------------------------------------------------

    def _deliver(self, out: RequestOutput) -> None:
        stream = self._streams.get(out.request_id)
        if stream is not None:
            stream.put(out)

    def _drain_inputs(self) -> None:
        while self._aborts:
            for out in self.engine.abort_request([self._aborts.popleft()]):
                self._deliver(out)
        while self._adds:
            request_id, prompt, params, validated = self._adds.popleft()
            if request_id not in self._streams:
                continue  # its consumer went away before the request reached the engine
            try:
                self.engine.add_request(request_id, prompt, params, validated=validated)
            except PagecastError as e:
                self._streams[request_id].put(e)

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._wakeup.clear()
                self._drain_inputs()
                if not self.engine.has_unfinished_requests():
                    self._wakeup.wait(0.5)
                    continue
                for out in self.engine.step():
                    self._deliver(out)
        except BaseException as e:  # the loop must report any failure to every waiting request
            logger.exception("engine loop failed")
            self._error = e
            dead = EngineDeadError(f"the engine failed: {type(e).__name__}: {e}")
            for stream in list(self._streams.values()):
                stream.put(dead)
