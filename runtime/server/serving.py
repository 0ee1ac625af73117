"""What every generation endpoint shares: the served models, admission (429 when the queue
is full, 503 while draining), and ``GenerationRun``, which drives the engine requests of one
HTTP request, aborts them when the client leaves, and records metrics and the log line.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import math
import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from pagecast.runtime.outputs import Logprob, PositionLogprobs, RequestOutput
from pagecast.runtime.sampling_params import RequestOutputKind, SamplingParams
from pagecast.runtime.server import errors
from pagecast.runtime.server.errors import APIError
from pagecast.runtime.server.logs import log_request
from pagecast.runtime.server.metrics import RequestRecorder, ServerMetrics
from pagecast.runtime.server.reasoning import check_style as check_reasoning_style
from pagecast.runtime.server.responses_store import DEFAULT_STORE_SIZE, ResponseStore
from pagecast.runtime.server.sse import SSEResponse

T = TypeVar("T")

RETRY_AFTER_S = 1


@dataclass
class ServedModel:
    """One engine under the name clients use for it."""

    name: str
    engine: Any  # AsyncEngine
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def max_running(self) -> int:
        """Sequences the engine runs at once; beyond that they wait in its queue."""
        return int(self.engine.max_num_seqs)

    def tokenize(self, prompt: str) -> list[int]:
        """Token ids of a text prompt, exactly as the engine (and LLM.generate) tokenises it."""
        return list(self.engine.tokenize(prompt))

    @property
    def vocab_size(self) -> int:
        return int(self.engine.vocab_size)


class ServerState:
    """Everything the app keeps across requests: the models, the sequences admitted per model,
    the runs in flight (for draining) and the metrics. Only the event loop touches it, so it
    needs no locks."""

    def __init__(
        self,
        engines: Mapping[str, Any],
        api_key: str | None,
        max_queue: int,
        reasoning_parser: str | None = None,
        responses_store_size: int = DEFAULT_STORE_SIZE,
    ):
        if not engines:
            raise ValueError("engines must name at least one engine")
        if max_queue < 0:
            raise ValueError("max_queue must be >= 0")
        if reasoning_parser is not None:
            check_reasoning_style(reasoning_parser)
        self.reasoning_parser = reasoning_parser
        self.models = {name: ServedModel(name, engine) for name, engine in engines.items()}
        self.api_key = api_key
        self.max_queue = max_queue
        self.draining = False
        # Set by a second shutdown signal: open streams end at once with an error event.
        self.cutting = False
        self._in_flight: dict[str, int] = dict.fromkeys(engines, 0)
        self.runs: set[GenerationRun] = set()
        self.metrics = ServerMetrics(engines, lambda: dict(self._in_flight))
        self.responses = ResponseStore(responses_store_size)  # /v1/responses kept (store)
        self.background: dict[str, Any] = {}  # /v1/responses generating in the background (serving_responses.Background)

    def resolve(self, model: str | None) -> ServedModel:
        if model is None:
            if len(self.models) == 1:
                return next(iter(self.models.values()))
            raise errors.invalid_request(
                "`model` is required: this server serves " + ", ".join(sorted(self.models)) + ".",
                "model",
                "missing_required_parameter",
            )
        served = self.models.get(model)
        if served is None:
            raise errors.model_not_found(model)
        return served

    def max_request_seqs(self, model: ServedModel) -> int:
        """The most sequences one request may ask for: what the engine runs at once plus what
        may wait. A larger request could only be admitted by locking every other client out
        until it is done, so it is refused instead."""
        return model.max_running + self.max_queue

    def check_request_size(self, model: ServedModel, num_prompts: int, n: int) -> None:
        """400 ``too_many_sequences`` for a request that can never be admitted (safe from any
        thread: it reads only configuration)."""
        limit = self.max_request_seqs(model)
        if num_prompts * n > limit:
            raise errors.too_many_sequences(num_prompts * n, limit, num_prompts, n)

    def admit(self, model: ServedModel, num_seqs: int) -> None:
        """Reserve ``num_seqs`` sequences, or refuse: the engine runs ``max_running`` at once
        and ``max_queue`` more may wait. A request that could never fit is a 400 (it would
        starve everyone else while it runs); one that does not fit now is a 429."""
        if self.draining:
            raise errors.shutting_down()
        if not model.engine.is_alive():
            raise errors.engine_dead(model.name)
        limit = self.max_request_seqs(model)
        if num_seqs > limit:
            raise errors.too_many_sequences(num_seqs, limit)
        in_flight = self._in_flight[model.name]
        if in_flight + num_seqs > limit:
            raise errors.queue_full(RETRY_AFTER_S)
        self._in_flight[model.name] = in_flight + num_seqs

    def release(self, model: ServedModel, num_seqs: int) -> None:
        self._in_flight[model.name] -= num_seqs

    def abort_all(self) -> None:
        for run in list(self.runs):
            run.abort()


class ClientDisconnected(Exception):
    """The client went away before the response was complete."""


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def cancel_on_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await ``work`` unless the client disconnects first; then cancel it (which aborts the
    engine requests it drives) and raise ClientDisconnected."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    with contextlib.suppress(BaseException):
        await task
    raise ClientDisconnected


async def respond(
    request: Request,
    run: GenerationRun,
    stream: bool,
    make_stream: Callable[[], AsyncIterator[bytes]],
    make_body: Callable[[list[RequestOutput]], dict[str, Any]],
) -> Response:
    """Run ``run`` and answer: an SSE stream of ``make_stream()``, or the JSON body
    ``make_body(final outputs)``. The run is closed on every path (an error, a client
    gone, a stream never started), exactly once."""
    headers = {"X-Request-Id": run.request_id}

    async def start_and_collect() -> list[RequestOutput] | None:
        await run.start()
        return None if stream else await run.collect()

    try:
        finals = await cancel_on_disconnect(request, start_and_collect())
        if stream:
            return SSEResponse(
                make_stream(), on_close=lambda gone: run.close(499 if gone else None), headers=headers
            )
        body = make_body(finals)  # type: ignore[arg-type]
    except ClientDisconnected:
        await run.close(499)
        return Response(status_code=499)  # nobody reads it; 499 is what the log says
    except BaseException as exc:
        await run.close(exc.status_code if isinstance(exc, APIError) else 500)
        raise
    await run.close(200)
    return JSONResponse(body, headers=headers)


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class GenerationRun:
    """The engine requests (one per prompt) behind one HTTP request.

    ``start`` submits them all and waits for each one's first output, so that an engine
    error about the input (context too long, ...) becomes a 400 before any byte of a
    stream is sent. ``outputs`` then yields ``(prompt_index, RequestOutput)`` as the
    engine produces them, as ``params.output_kind`` asks: deltas for a stream (each output
    holds only what is new, so a step costs the same at any length), one final output
    otherwise. ``close`` always runs: it aborts whatever did not finish, releases the
    admission, records metrics and writes the request's log line.
    """

    def __init__(
        self,
        state: ServerState,
        model: ServedModel,
        request_id: str,
        endpoint: str,
        prompts: list[list[int]],
        params: SamplingParams,
        priority: int = 0,
    ):
        if priority != 0 and getattr(model.engine, "scheduling_policy", "fcfs") != "priority":
            raise errors.unsupported(
                "priority",
                f"model {model.name!r} serves requests first come, first served; leave priority at 0, or start "
                "engine-serve with --scheduling-policy priority",
            )
        self.state = state
        self.model = model
        self.priority = priority
        self.request_id = request_id
        self.endpoint = endpoint
        self.prompts = prompts
        self.params = params
        self.engine_ids = (
            [request_id] if len(prompts) == 1 else [f"{request_id}-{i}" for i in range(len(prompts))]
        )
        self.recorders: list[RequestRecorder] = [state.metrics.follow(model.name) for _ in prompts]
        # Per prompt, per choice: output tokens so far and the finish reason (outputs may be deltas).
        self._num_tokens: list[dict[int, int]] = [{} for _ in prompts]
        self._finish_reasons: list[dict[int, str | None]] = [{} for _ in prompts]
        self.num_seqs = len(prompts) * params.n
        self.start_time = time.monotonic()
        self._streams: list[AsyncIterator[RequestOutput]] = []
        self._first: list[RequestOutput] = []
        self._closed = False
        self._admitted = False
        self.status = 200  # what the client was answered; set by the endpoint on errors

    @property
    def last_outputs(self) -> list[RequestOutput | None]:
        return [r.last for r in self.recorders]

    def admit(self) -> None:
        """Reserve the run's sequences (429 when the queue is full, 503 while draining); ``start``
        does it if it has not been done. A run admitted is one the drain waits for."""
        if self._admitted:
            return
        self.state.admit(self.model, self.num_seqs)
        self._admitted = True
        self.state.runs.add(self)

    async def start(self) -> None:
        self.admit()
        engine = self.model.engine
        self._streams = [
            engine.generate(ids, self.params, request_id=rid, priority=self.priority)
            for ids, rid in zip(self.prompts, self.engine_ids, strict=True)
        ]
        try:
            if len(self._streams) == 1:
                self._first = [await _first_output(self._streams[0])]
            else:
                self._first = await _gather_cancelling([_first_output(s) for s in self._streams])
        except Exception as exc:
            raise errors.from_engine_error(exc, self.model.name) from exc
        for i, out in enumerate(self._first):
            self._note(i, out)

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        for i, out in enumerate(self._first):
            yield i, out
        pending = [i for i, out in enumerate(self._first) if not out.finished]
        try:
            if len(pending) == 1:
                i = pending[0]
                async for out in self._streams[i]:
                    self._note(i, out)
                    yield i, out
            elif pending:
                async for i, out in _merge({i: self._streams[i] for i in pending}):
                    self._note(i, out)
                    yield i, out
        except APIError:
            raise
        except Exception as exc:
            raise errors.from_engine_error(exc, self.model.name) from exc

    def _note(self, i: int, out: RequestOutput) -> None:
        """Count prompt ``i``'s tokens and finish reasons from an output (a delta or a whole)."""
        delta = self.params.output_kind == RequestOutputKind.DELTA
        counts, reasons = self._num_tokens[i], self._finish_reasons[i]
        for o in out.outputs:
            counts[o.index] = (counts.get(o.index, 0) if delta else 0) + len(o.token_ids)
            if o.finish_reason is not None:
                reasons[o.index] = o.finish_reason
        self.recorders[i].update(out, num_tokens=max(counts.values(), default=0))

    async def collect(self) -> list[RequestOutput]:
        """Run every engine request to its end; the final output of each prompt."""
        async for _ in self.outputs():
            pass
        finals = self.last_outputs
        if any(out is None or not out.finished for out in finals):
            # The engine stream ended without a finished output: it was aborted under us.
            raise errors.engine_dead(self.model.name, "a request ended without a result")
        return [out for out in finals if out is not None]

    def abort(self) -> None:
        for rid, out in zip(self.engine_ids, self.last_outputs, strict=True):
            if out is None or not out.finished:
                self.model.engine.abort(rid)

    async def close(self, status: int | None = None) -> None:
        """Idempotent. The bookkeeping is done before the first await, so that a cancelled
        caller cannot skip it."""
        if self._closed:
            return
        self._closed = True
        if status is not None:
            self.status = status
        self.abort()
        self.state.runs.discard(self)
        if self._admitted:
            self.state.release(self.model, self.num_seqs)
        reasons = []
        if self._admitted:  # a refused request never reached the engine: no engine metrics
            for recorder, choices in zip(self.recorders, self._finish_reasons, strict=True):
                got = [choices.get(j) for j in range(self.params.n)] if recorder.last is not None else None
                reason = _request_finish_reason(got, self.status)
                reasons.append(reason)
                recorder.finish(reason)
        self._log(self.status, reasons)
        for stream in self._streams:
            with contextlib.suppress(Exception):
                await stream.aclose()  # type: ignore[attr-defined]

    def _log(self, status: int, reasons: list[str]) -> None:
        finals = [out for out in self.last_outputs if out is not None]
        first_token_times = [
            out.metrics.first_token_time for out in finals if out.metrics and out.metrics.first_token_time
        ]
        arrivals = [out.metrics.arrival_time for out in finals if out.metrics]
        ttft = min(first_token_times) - min(arrivals) if first_token_times and arrivals else None
        log_request(
            request_id=self.request_id,
            model=self.model.name,
            endpoint=self.endpoint,
            status=status,
            prompt_tokens=sum(len(ids) for ids in self.prompts),
            completion_tokens=sum(sum(counts.values()) for counts in self._num_tokens),
            ttft_s=ttft,
            total_s=time.monotonic() - self.start_time,
            finish_reason=",".join(sorted(set(reasons))) or None,
        )


def _request_finish_reason(reasons: list[str | None] | None, status: int) -> str:
    """One reason per engine request from its choices' (None: no output): an error or abort
    of any choice wins."""
    if reasons is None:
        return "error" if status >= 500 else "abort"
    for worst in ("error", "abort"):
        if worst in reasons:
            return worst
    if any(r is None for r in reasons):
        return "error" if status >= 500 else "abort"
    return reasons[0] or "abort"


async def _first_output(stream: AsyncIterator[RequestOutput]) -> RequestOutput:
    try:
        return await stream.__anext__()
    except StopAsyncIteration:
        raise RuntimeError("the engine ended a request without any output") from None


async def _gather_cancelling(coros: list[Awaitable[T]]) -> list[T]:
    """Like asyncio.gather, but the first failure cancels the others."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    finally:
        for t in tasks:
            if not t.done():
                t.cancel()
    for t in tasks:
        if t.done() and not t.cancelled() and t.exception() is not None:
            await asyncio.gather(*tasks, return_exceptions=True)
            raise t.exception()  # type: ignore[misc]
    return [t.result() for t in tasks]


async def _merge(
    streams: dict[int, AsyncIterator[RequestOutput]],
) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several engine streams as their outputs arrive."""
    queue: asyncio.Queue[tuple[int, RequestOutput | None, BaseException | None]] = asyncio.Queue()

    async def pump(i: int, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            async for out in stream:
                queue.put_nowait((i, out, None))
        except Exception as exc:  # noqa: BLE001 - handed to the consumer, which raises it
            queue.put_nowait((i, None, exc))
            return
        queue.put_nowait((i, None, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in streams.items()]
    try:
        remaining = len(tasks)
        while remaining:
            i, out, exc = await queue.get()
            if exc is not None:
                raise exc
            if out is None:
                remaining -= 1
                continue
            yield i, out
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


# JSON has no -inf; -9999.0 is what vLLM and OpenAI clients already handle for "impossible".
MIN_LOGPROB = -9999.0


def clamp_logprob(value: float) -> float:
    return MIN_LOGPROB if math.isnan(value) or value < MIN_LOGPROB else value


class TokenTexts:
    """The text of single tokens (for logprobs), decoded once per id per request, and their bytes."""

    def __init__(self, tokenizer: Any):
        self._tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int, decoded: str | None = None) -> str:
        if decoded is not None:
            return decoded
        text = self._cache.get(token_id)
        if text is None:
            text = self._tokenizer.decode([token_id], skip_special_tokens=False)
            self._cache[token_id] = text
        return text

    def token_bytes(self, token_id: int, text: str) -> list[int]:
        """The token's own bytes (the chat logprobs' ``bytes``: a client joins them across tokens to
        rebuild a character split between tokens). A token holding part of a UTF-8 character decodes
        alone to U+FFFD, so its bytes are read from the vocabulary entry instead: byte-level BPE's
        byte-to-character map (GPT-2, Llama 3, Qwen, SmolLM) or SentencePiece's ``<0xNN>`` fallback."""
        if "\ufffd" in text:
            raw = raw_token_bytes(self._tokenizer.convert_ids_to_tokens(token_id))
            if raw is not None:
                return list(raw)
        return list(text.encode("utf-8"))

    def decode(self, token_ids: list[int]) -> str:
        return str(self._tokenizer.decode(token_ids, skip_special_tokens=False))


_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@functools.cache
def _byte_level_chars() -> dict[str, int]:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return {ch: b for b, ch in bytes_to_unicode().items()}


def raw_token_bytes(piece: Any) -> bytes | None:
    """The bytes a vocabulary entry stands for, where it is a byte-fallback piece or written in the
    byte-level alphabet; None for anything else (the caller keeps the decoded text's bytes)."""
    if not isinstance(piece, str) or not piece:
        return None
    if m := _BYTE_FALLBACK.fullmatch(piece):
        return bytes([int(m.group(1), 16)])
    chars = _byte_level_chars()
    if all(ch in chars for ch in piece):
        return bytes(chars[ch] for ch in piece)
    return None


def ranked_logprobs(position: PositionLogprobs, k: int, also: int | None = None) -> list[tuple[int, Logprob]]:
    """A position's (token id, logprob) pairs of rank k or better, best first, and token ``also``
    wherever it ranks (the token chosen or given there, as vLLM reports it)."""
    return [(tid, lp) for tid, lp in sorted(position.items(), key=lambda item: item[1].rank) if lp.rank <= k or tid == also]


def vllm_prompt_logprobs(out: RequestOutput, k: int, texts: TokenTexts) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's ``prompt_logprobs``: per prompt position, null for the first (it has no context),
    then token id (a string, as JSON keys are) -> ``{logprob, rank, decoded_token}`` for the
    prompt's token there and the k best."""
    positions = out.prompt_logprobs
    ids = out.prompt_token_ids
    if positions is None or len(positions) != len(ids):
        raise errors.internal_error("the engine returned no prompt logprobs")
    answer: list[dict[str, dict[str, Any]] | None] = [None]
    for i in range(1, len(ids)):
        position = positions[i]
        if position is None or ids[i] not in position:
            raise errors.internal_error(f"the engine returned no logprob for prompt position {i}")
        answer.append({
            str(tid): {"logprob": clamp_logprob(lp.logprob), "rank": lp.rank, "decoded_token": texts(tid, lp.decoded_token)}
            for tid, lp in ranked_logprobs(position, k, ids[i])
        })  # fmt: skip
    return answer


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def check_prompt_fits(
    model: ServedModel, prompt_ids: list[int], max_tokens: int | None, param: str, max_tokens_param: str = "max_tokens"
) -> None:
    """400 ``context_length_exceeded`` before the engine is involved, with the numbers
    (``max_tokens_param``: the endpoint's name for the length asked for)."""
    if not prompt_ids:
        raise errors.invalid_request("The prompt is empty (it has no tokens).", param)
    max_model_len = int(model.engine.max_model_len)
    needed = len(prompt_ids) + (max_tokens if max_tokens is not None else 1)
    if needed > max_model_len:
        if max_tokens is not None and len(prompt_ids) < max_model_len:
            param = max_tokens_param  # the prompt fits; the completion asked for is what does not
        wanted = f"{len(prompt_ids)} in the prompt" + (
            f", {max_tokens} for the completion"
            if max_tokens is not None
            else ", at least 1 for the completion"
        )
        raise errors.invalid_request(
            f"This model's maximum context length is {max_model_len} tokens; this request needs {needed} "
            f"({wanted}). Shorten the prompt or reduce {max_tokens_param}.",
            param,
            "context_length_exceeded",
        )
