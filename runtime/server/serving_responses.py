"""POST /v1/responses (OpenAI's Responses API), and GET / DELETE /v1/responses/{id} and its input_items.

The request becomes a chat conversation (responses_protocol.py) rendered by the artifact's chat
template and generated as one prompt, so tools, ``text.format``, reasoning and sampling behave as
on /v1/chat/completions. The answer is a ``response`` object whose ``output`` holds items in the
order the model wrote them: a ``reasoning`` item (with a ``--reasoning-parser``), a ``message``
with one ``output_text`` part, and a ``function_call`` item per tool call. A response cut by
``max_output_tokens`` has status ``incomplete`` (``incomplete_details.reason``
"max_output_tokens").

Streamed, it is OpenAI's event sequence (``event:`` and ``data:`` lines, numbered by
``sequence_number``): ``response.created``, ``response.in_progress``, then per item
``response.output_item.added``, its content part's ``added``, the deltas
(``response.output_text.delta``, ``response.reasoning_text.delta``,
``response.function_call_arguments.delta``), their ``done`` events and
``response.output_item.done``, and last ``response.completed`` (or ``response.incomplete``) with
the whole response. An error after the stream has started is an ``error`` event followed by
``response.failed``.

``store`` (true unless the client says otherwise, as OpenAI's default) keeps the response in this
process's memory, the last ``ResponseStore.capacity`` of them: GET returns it, DELETE forgets it,
and ``previous_response_id`` continues its conversation (the earlier turns' input and output,
without their ``instructions``, as OpenAI does). A server restart or another replica does not
know it; clients that send the whole conversation as ``input`` (``store: false``) need nothing
kept.

``background`` (with ``store``): the answer is the response at once, status ``queued``; it is
generated after, as a request answered in place would be (admitted, or a 429, before that
answer), and becomes ``in_progress`` once its prompt is computed, then ``completed``,
``incomplete`` or ``failed`` (with its error). GET polls it; POST /v1/responses/{id}/cancel
aborts it (status ``cancelled``, its KV blocks freed), as does DELETE. A shutdown drains it as
any other request. With ``stream`` its events go into a log (``EventLog``) that the POST's
stream follows; a client that leaves it leaves the generation running, and GET
``?stream=true&starting_after=N`` follows the log again (from the store once it has ended).

Logprobs (``include: ["message.output_text.logprobs"]``, ``top_logprobs``) are those of every
generated token, on the message's text: with a reasoning parser or tool calls the message's text
is only part of what those tokens spell.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import anyio
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from pagecast.runtime.outputs import CompletionOutput, RequestOutput
from pagecast.runtime.sampling_params import SamplingParams
from pagecast.runtime.server import errors
from pagecast.runtime.server.chat import render_chat_prompt
from pagecast.runtime.server.errors import APIError
from pagecast.runtime.server.limits import check_text_size
from pagecast.runtime.server.protocol import ChatMessage, parse_request
from pagecast.runtime.server.reasoning import END as THINK_END
from pagecast.runtime.server.reasoning import ReasoningParser, end_token, split_reasoning
from pagecast.runtime.server.responses_protocol import ResponsesRequest, input_messages
from pagecast.runtime.server.responses_store import UNFINISHED
from pagecast.runtime.server.serving import (
    GenerationRun,
    ServedModel,
    ServerState,
    TokenTexts,
    check_prompt_fits,
    respond,
)
from pagecast.runtime.server.serving_chat import answer_deltas, logprob_entries, served_params
from pagecast.runtime.server.sse import SSEResponse, sse_named_event
from pagecast.runtime.server.tool_calls import ToolPlan, plan_tools
from pagecast.runtime.server.tool_parsers import ToolCallParser, parse_tool_calls

ENDPOINT = "/v1/responses"


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


# -- the request ----------------------------------------------------------------------------


@dataclasses.dataclass
class _Prepared:
    req: ResponsesRequest
    model: ServedModel
    response_id: str
    created_at: int
    prompt_ids: list[int]
    params: SamplingParams
    tools: ToolPlan | None
    own_input: list[ChatMessage]  # this request's input as messages (kept with the response)
    input_items: list[dict[str, Any]]  # and as items with ids, made once (GET .../input_items lists them)


async def create_response(request: Request, state: ServerState) -> Response:
    body = await request.body()
    # Parsing, templating and tokenizing cost time proportional to the request: off the event loop.
    prep = await anyio.to_thread.run_sync(_prepare, body, state)
    run = GenerationRun(state, prep.model, prep.response_id, ENDPOINT, [prep.prompt_ids], prep.params)
    texts = TokenTexts(prep.model.engine.tokenizer)
    if prep.req.background:
        return await _start_in_background(prep, run, texts, state)
    return await respond(
        request,
        run,
        prep.req.stream,
        lambda: _stream(prep, run, texts, state),
        lambda finals: _answer(prep, finals[0], texts, state),
    )


def _prepare(body: bytes, state: ServerState) -> _Prepared:
    req: ResponsesRequest = parse_request(ResponsesRequest, body)
    model = state.resolve(req.model)
    tokenizer = model.engine.tokenizer
    max_model_len = int(model.engine.max_model_len)
    history: list[ChatMessage] = []
    if req.previous_response_id is not None:
        found = state.responses.conversation(req.previous_response_id)
        if found is None:
            raise errors.invalid_request(
                f"Previous response with id '{req.previous_response_id}' not found (this server keeps its newest "
                f"stored responses in memory: at most {state.responses.capacity}, {state.responses.max_bytes >> 20} MiB). "
                "Send the whole conversation as `input`.",
                "previous_response_id",
                code="previous_response_not_found",
            )
        previous = state.responses.get(req.previous_response_id)
        if previous is not None and previous.get("status") not in ("completed", "incomplete"):
            # a background response still generating, or one that failed or was cancelled: no answer to continue
            wait = " (poll GET /v1/responses/{id} until it has finished)" if previous.get("status") in UNFINISHED else ""
            raise errors.invalid_request(
                f"Previous response with id '{req.previous_response_id}' is {previous.get('status')}: it has no "
                f"answer to continue{wait}.",
                "previous_response_id",
            )
        history = found
    own = input_messages(req.input)
    system = [ChatMessage(role="system", content=req.instructions)] if req.instructions is not None else []
    messages = system + history + own
    keep = req.kept_prompt_tokens(max_model_len)
    auto = req.truncation == "auto" and keep is None
    if tokenizer is not None and keep is None:
        # With truncation "auto" what is kept of the earlier turns is what fits: the size bound is on
        # this request's own input (the earlier turns come from the store, which bounds them).
        sized = system + own if auto else messages
        chars = sum(len(m.text(i)) for i, m in enumerate(sized))
        check_text_size(chars, tokenizer, max_model_len, "input")
    chat_template = getattr(tokenizer, "chat_template", None)
    tools = plan_tools(req.chat_tools(), req.chat_tool_choice(), req.parallel_tool_calls, chat_template)
    if tools is not None and tools.max_calls is None and req.max_tool_calls is not None:
        tools = dataclasses.replace(tools, max_calls=req.max_tool_calls)  # the plan's 1 stays where it says 1
    max_tokens = req.max_output_tokens

    def render(conversation: list[ChatMessage]) -> list[int]:
        return render_chat_prompt(tokenizer, system + conversation, True, tools.tools if tools else None, False, req.template_kwargs())

    if auto:
        prompt_ids = _fitting_prompt(history + own, render, max_model_len - (max_tokens or 1))
    else:
        prompt_ids = render(history + own)
    if keep is not None:
        prompt_ids = prompt_ids[-keep:]
    check_prompt_fits(model, prompt_ids, max_tokens, "input", "max_output_tokens")
    logprobs = (req.top_logprobs or 0) if req.wants_logprobs else None
    rename = {"logprobs": "top_logprobs", "max_tokens": "max_output_tokens"}
    params = req._sampling_params(max_tokens, logprobs, None, rename, tools.structured_output if tools else None)
    params = served_params(params, req, state, model, prompt_ids)
    items = _input_items(req.input)
    return _Prepared(req, model, _new_id("resp"), int(time.time()), prompt_ids, params, tools, own, items)


def _fitting_prompt(conversation: list[ChatMessage], render: Any, budget: int) -> list[int]:
    """``truncation: "auto"``: the prompt of ``conversation`` less as few of its oldest turns as
    make it at most ``budget`` tokens (a turn: a user message and what follows it up to the next;
    the instructions and the last turn are always kept, so a prompt that cannot fit even so is
    the usual 400). The prompt's length falls as turns are dropped: a binary search renders
    O(log turns) prompts."""
    starts = [i for i, m in enumerate(conversation) if m.role == "user"]
    cuts = [0] + [i for i in starts if i > 0]  # where the kept conversation may begin; the last: the last turn
    lo, hi = 0, len(cuts) - 1
    prompts: dict[int, list[int]] = {}

    def prompt(j: int) -> list[int]:
        if j not in prompts:
            prompts[j] = render(conversation[cuts[j] :])
        return prompts[j]

    if len(prompt(lo)) <= budget:
        return prompt(lo)
    while lo < hi:  # the fewest turns dropped that fit (hi: every earlier turn dropped)
        mid = (lo + hi) // 2
        if len(prompt(mid)) <= budget:
            hi = mid
        else:
            lo = mid + 1
    return prompt(hi)


# -- the response ---------------------------------------------------------------------------


def _body(
    prep: _Prepared,
    status: str,
    output: list[dict[str, Any]],
    usage: dict[str, Any] | None,
    incomplete: bool = False,
    error: APIError | None = None,
) -> dict[str, Any]:
    req, params = prep.req, prep.params
    return {
        "id": prep.response_id,
        "object": "response",
        "created_at": prep.created_at,
        "status": status,
        "completed_at": int(time.time()) if status == "completed" else None,
        "background": bool(req.background),
        "error": None if error is None else {"code": error.code, "message": error.message},
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "max_tool_calls": req.max_tool_calls,
        "metadata": req.metadata or {},
        "model": prep.model.name,
        "output": output,
        "parallel_tool_calls": req.parallel_tool_calls is not False,
        "previous_response_id": req.previous_response_id,
        "prompt_cache_key": req.prompt_cache_key,
        "reasoning": {"effort": (req.reasoning or {}).get("effort"), "summary": None},
        "safety_identifier": req.safety_identifier,
        "service_tier": "default",
        "store": req.store,
        "temperature": params.temperature,
        "text": req.text_config(),
        "tool_choice": req.tool_choice if req.tool_choice is not None else "auto",
        "tools": req.tools or [],
        "top_logprobs": req.top_logprobs or 0,
        "top_p": params.top_p,
        "truncation": req.truncation or "disabled",
        "usage": usage,
        "user": req.user,
    }


def _usage(prep: _Prepared, out: RequestOutput | None, output_ids: list[int], reasoning: bool) -> dict[str, Any]:
    cached = out.metrics.num_cached_tokens if out is not None and out.metrics is not None else 0
    n = len(output_ids)
    thinking = _thinking_tokens(prep, output_ids) if reasoning else 0
    return {
        "input_tokens": len(prep.prompt_ids),
        "input_tokens_details": {"cached_tokens": cached},
        "output_tokens": n,
        "output_tokens_details": {"reasoning_tokens": thinking},
        "total_tokens": len(prep.prompt_ids) + n,
    }


def _thinking_tokens(prep: _Prepared, output_ids: list[int]) -> int:
    """The output's tokens up to and including the one that completes "</think>"; all of them
    if the output stopped while thinking."""
    tokenizer = prep.model.engine.tokenizer
    if tokenizer is None:
        return len(output_ids)
    end = end_token(tokenizer)
    if end is not None:
        return output_ids.index(end) + 1 if end in output_ids else len(output_ids)
    # No single token for the tag: the shortest prefix whose text holds it (prefixes only grow).
    lo, hi = 1, len(output_ids)
    if THINK_END not in tokenizer.decode(output_ids, skip_special_tokens=False):
        return len(output_ids)
    while lo < hi:
        mid = (lo + hi) // 2
        if THINK_END in tokenizer.decode(output_ids[:mid], skip_special_tokens=False):
            hi = mid
        else:
            lo = mid + 1
    return lo


def _reasoning_item(text: str, status: str, item_id: str | None = None) -> dict[str, Any]:
    content = [{"type": "reasoning_text", "text": text}] if text else []
    return {"id": item_id or _new_id("rs"), "type": "reasoning", "summary": [], "content": content, "status": status}


def _message_item(text: str, status: str, logprobs: list[dict[str, Any]] | None, item_id: str | None = None) -> dict[str, Any]:
    part: dict[str, Any] = {"type": "output_text", "text": text, "annotations": []}
    if logprobs is not None:
        part["logprobs"] = logprobs
    return {"id": item_id or _new_id("msg"), "type": "message", "role": "assistant", "status": status, "content": [part]}


def _call_item(call_id: str, name: str, arguments: str, status: str, item_id: str | None = None) -> dict[str, Any]:
    return {
        "id": item_id or _new_id("fc"),
        "type": "function_call",
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def _assistant_turn(output: list[dict[str, Any]]) -> ChatMessage:
    """A response's output as the assistant message a later turn's prompt holds (its reasoning
    left out, as chat templates leave out earlier turns' thinking)."""
    text = "".join(p["text"] for item in output if item["type"] == "message" for p in item["content"])
    calls = [
        {"id": item["call_id"], "type": "function", "function": {"name": item["name"], "arguments": item["arguments"]}}
        for item in output
        if item["type"] == "function_call"
    ]
    return ChatMessage.model_validate({"role": "assistant", "content": text, **({"tool_calls": calls} if calls else {})})


def _keep(prep: _Prepared, state: ServerState, body: dict[str, Any]) -> None:
    if prep.req.store:
        turn = [*prep.own_input, _assistant_turn(body["output"])]
        state.responses.put(prep.response_id, body, prep.req.previous_response_id, turn, prep.input_items)


_ITEM_PREFIXES = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}


def _input_items(given: str | list[Any]) -> list[dict[str, Any]]:
    """A request's ``input`` as the items GET /v1/responses/{id}/input_items lists: each with its
    ``type`` and an ``id`` (the client's, else a new one), message contents as lists of parts."""
    if isinstance(given, str):
        given = [{"role": "user", "content": given}]
    items = []
    for raw in given:
        item = {"type": "message", **raw}
        if item["type"] == "message":
            if isinstance(item.get("content"), str):
                part = "output_text" if item.get("role") == "assistant" else "input_text"
                item["content"] = [{"type": part, "text": item["content"]}]
            item.setdefault("status", "completed")
        item.setdefault("id", _new_id(_ITEM_PREFIXES.get(item["type"], "item")))
        items.append(item)
    return items


def _answer(prep: _Prepared, out: RequestOutput, texts: TokenTexts, state: ServerState) -> dict[str, Any]:
    if state.cutting:
        raise errors.cut_by_shutdown()
    o: CompletionOutput = out.outputs[0]
    if o.finish_reason == "error":
        raise errors.internal_error("the engine failed while generating")
    reasoning, answer = None, o.text
    if state.reasoning_parser is not None:
        reasoning, answer = split_reasoning(o.text, state.reasoning_parser)
    calls: list[dict[str, Any]] = []
    if prep.tools is not None and answer is not None:
        answer, calls = parse_tool_calls(answer, prep.tools.format, prep.tools.max_calls)
    incomplete = o.finish_reason == "length"
    status = "incomplete" if incomplete else "completed"
    logprobs = None
    if prep.req.wants_logprobs:
        logprobs = logprob_entries(o, 0, len(o.token_ids), prep.req.top_logprobs or 0, texts)
    output: list[dict[str, Any]] = []
    if reasoning:
        output.append(_reasoning_item(reasoning, "completed"))
    if answer or (not calls and not reasoning):
        output.append(_message_item(answer or "", "completed", logprobs))
    output += [_call_item(c["id"], c["function"]["name"], c["function"]["arguments"], "completed") for c in calls]
    output[-1]["status"] = status  # the item being written when the output ended (as a stream closes it)
    body = _body(prep, status, output, _usage(prep, out, o.token_ids, reasoning is not None), incomplete)
    _keep(prep, state, body)
    return body


class _Events:
    """A stream's events in order: numbered, with the output items they open and close."""

    def __init__(self, prep: _Prepared):
        self.prep = prep
        self.seq = 0
        self.output: list[dict[str, Any]] = []  # items closed so far
        self.kind: str | None = None  # the open item's: "reasoning", "message", "function_call"
        self.item: dict[str, Any] = {}
        self.text = ""  # the open item's text, or its call's arguments
        self.logprobs: list[dict[str, Any]] = []  # every token's, for the message
        self.unsent: list[dict[str, Any]] = []  # not yet carried by a text delta

    def event(self, kind: str, **fields: Any) -> bytes:
        payload = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return sse_named_event(kind, payload)

    @property
    def index(self) -> int:
        return len(self.output)

    def _where(self) -> dict[str, Any]:
        return {"item_id": self.item["id"], "output_index": self.index}

    def open(self, kind: str, call: dict[str, Any] | None = None) -> list[bytes]:
        events = self.close("completed")
        self.kind, self.text = kind, ""
        if kind == "reasoning":
            self.item = _reasoning_item("", "in_progress")
            part = {"type": "reasoning_text", "text": ""}
        elif kind == "message":
            self.item = _message_item("", "in_progress", None)
            self.item["content"] = []
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        else:
            assert call is not None
            self.item = _call_item(call["id"], call["function"]["name"], "", "in_progress")
        events.append(self.event("response.output_item.added", output_index=self.index, item=dict(self.item)))
        if kind != "function_call":
            events.append(self.event("response.content_part.added", **self._where(), content_index=0, part=part))
        return events

    def reasoning(self, delta: str) -> list[bytes]:
        events = self.open("reasoning") if self.kind != "reasoning" else []
        self.text += delta
        return [*events, self.event("response.reasoning_text.delta", **self._where(), content_index=0, delta=delta)]

    def content(self, delta: str) -> list[bytes]:
        events = self.open("message") if self.kind != "message" else []
        self.text += delta
        logprobs, self.unsent = self.unsent, []
        return [*events, self.event("response.output_text.delta", **self._where(), content_index=0, delta=delta, logprobs=logprobs)]

    def call(self, delta: dict[str, Any]) -> list[bytes]:
        events = self.open("function_call", delta) if "id" in delta else []
        fragment = delta["function"].get("arguments") or ""
        if fragment and self.kind == "function_call":
            self.text += fragment
            events.append(self.event("response.function_call_arguments.delta", **self._where(), delta=fragment))
        return events

    def close(self, status: str) -> list[bytes]:
        if self.kind is None:
            return []
        where, text, events = self._where(), self.text, []
        if self.kind == "reasoning":
            item = _reasoning_item(text, status, self.item["id"])
            events.append(self.event("response.reasoning_text.done", **where, content_index=0, text=text))
            events.append(self.event("response.content_part.done", **where, content_index=0, part=item["content"][0] if text else {"type": "reasoning_text", "text": ""}))
        elif self.kind == "message":
            logprobs = self.logprobs if self.prep.req.wants_logprobs else None
            item = _message_item(text, status, logprobs, self.item["id"])
            events.append(self.event("response.output_text.done", **where, content_index=0, text=text, logprobs=logprobs or []))
            events.append(self.event("response.content_part.done", **where, content_index=0, part=item["content"][0]))
        else:
            item = _call_item(self.item["call_id"], self.item["name"], text, status, self.item["id"])
            events.append(self.event("response.function_call_arguments.done", **where, arguments=text, name=self.item["name"]))
        events.append(self.event("response.output_item.done", output_index=self.index, item=item))
        self.output.append(item)
        self.kind, self.item, self.text = None, {}, ""
        return events


async def _stream(
    prep: _Prepared, run: GenerationRun, texts: TokenTexts, state: ServerState, start: bool = False
) -> AsyncIterator[bytes]:
    """The response's events. ``start``: the run is started here (a background stream: its
    ``response.created`` says ``queued`` and ``response.queued`` follows; an error starting it
    is an ``error`` event); a background response's failure is kept as well."""
    ev = _Events(prep)
    yield ev.event("response.created", response=_body(prep, "queued" if start else "in_progress", [], None))
    if start:  # a background stream: waiting for its turn until run.start() returns
        yield ev.event("response.queued", response=_body(prep, "queued", [], None))
    thinker = ReasoningParser(state.reasoning_parser) if state.reasoning_parser is not None else None
    parser = ToolCallParser(prep.tools.format, prep.tools.max_calls) if prep.tools is not None else None
    output_ids: list[int] = []
    last: RequestOutput | None = None
    finish: str | None = None
    thought = False
    k = prep.req.top_logprobs or 0
    try:
        if start:
            await run.start()
            _keep_without_turn(prep, state, _body(prep, "in_progress", [], None))
        yield ev.event("response.in_progress", response=_body(prep, "in_progress", [], None))
        async for _, out in run.outputs():
            if state.cutting:
                raise errors.cut_by_shutdown()
            last = out
            for o in out.outputs:  # one choice; a delta of what is new
                if o.finish_reason == "error":
                    raise errors.internal_error("the engine failed while generating")
                output_ids += o.token_ids
                if prep.req.wants_logprobs and o.token_ids:
                    entries = logprob_entries(o, 0, len(o.token_ids), k, texts)
                    ev.logprobs += entries
                    ev.unsent += entries
                for d in answer_deltas(o.text, o.finished, thinker, parser):
                    if "reasoning_content" in d:
                        thought = True
                        for chunk in ev.reasoning(d["reasoning_content"]):
                            yield chunk
                    elif "content" in d:
                        for chunk in ev.content(d["content"]):
                            yield chunk
                    else:
                        for call in d["tool_calls"]:
                            for chunk in ev.call(call):
                                yield chunk
                if o.finished:
                    finish = o.finish_reason
        incomplete = finish == "length"
        status = "incomplete" if incomplete else "completed"
        for chunk in ev.close(status):
            yield chunk
        if not ev.output:  # nothing was written: an empty message, as an answer has
            for chunk in [*ev.open("message"), *ev.close(status)]:
                yield chunk
        body = _body(prep, status, ev.output, _usage(prep, last, output_ids, thought), incomplete)
        _keep(prep, state, body)
        yield ev.event("response.incomplete" if incomplete else "response.completed", response=body)
    except Exception as exc:  # noqa: BLE001 - an APIError, or a bug of ours: still end the stream with a message
        error = exc if isinstance(exc, APIError) else errors.internal_error(f"{type(exc).__name__}: {exc}")
        run.status = error.status_code
        yield ev.event("error", code=error.code, message=error.message, param=error.param)
        failed = _body(prep, "failed", ev.output, None, error=error)
        if prep.req.background:
            _keep_without_turn(prep, state, failed)
        yield ev.event("response.failed", response=failed)


# -- background ----------------------------------------------------------------------------


class EventLog:
    """A background stream's events (SSE frames, the i-th with ``sequence_number`` i) as they are
    made; readers start anywhere and follow it to its end."""

    def __init__(self) -> None:
        self.frames: list[bytes] = []
        self.done = False
        self._changed = asyncio.Event()

    def append(self, frame: bytes) -> None:
        self.frames.append(frame)
        self._wake()

    def close(self) -> None:
        self.done = True
        self._wake()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def follow(self, first: int) -> AsyncIterator[bytes]:
        i = first
        while True:
            while i < len(self.frames):
                yield self.frames[i]
                i += 1
            if self.done:
                return
            await self._changed.wait()  # only the event loop appends: nothing lands between the check and here


@dataclasses.dataclass(frozen=True)
class Background:
    """A background response generating: its task, and its event log if it is streamed."""

    task: asyncio.Task[Any]
    log: EventLog | None


async def _start_in_background(prep: _Prepared, run: GenerationRun, texts: TokenTexts, state: ServerState) -> Response:
    """Admit the run (a 429 or 503 now, as for a request answered in place), keep the response as
    ``queued`` and generate it in a task of its own. The answer is the queued response, or with
    ``stream`` its events as they come; a client that leaves the stream leaves the generation
    running (GET ``?stream=true&starting_after=N`` follows it again)."""
    try:
        run.admit()
    except BaseException as exc:
        await run.close(exc.status_code if isinstance(exc, APIError) else 500)
        raise
    queued = _body(prep, "queued", [], None)
    _keep_without_turn(prep, state, queued)
    log = EventLog() if prep.req.stream else None
    task = asyncio.ensure_future(_generate_in_background(prep, run, texts, state, log))
    state.background[prep.response_id] = Background(task, log)

    def done(task: asyncio.Task[Any]) -> None:
        state.background.pop(prep.response_id, None)
        if task.cancelled():  # cancelled before its first step: none of its code ran to end it
            _keep_without_turn(prep, state, _body(prep, "cancelled", [], None))
            if log is not None:
                log.close()
            asyncio.ensure_future(run.close(499))  # releases the admission before its first await

    task.add_done_callback(done)
    headers = {"X-Request-Id": prep.response_id}
    if log is not None:
        return SSEResponse(log.follow(0), headers=headers)
    return JSONResponse(queued, headers=headers)


def _keep_without_turn(prep: _Prepared, state: ServerState, body: dict[str, Any]) -> None:
    """A background response not (yet) answered: its input, and no turn a later one could continue."""
    state.responses.put(prep.response_id, body, prep.req.previous_response_id, [], prep.input_items)


async def _generate_in_background(
    prep: _Prepared, run: GenerationRun, texts: TokenTexts, state: ServerState, log: EventLog | None
) -> dict[str, Any] | None:
    """Run a background response to its end and keep each status it passes through (and, into
    ``log``, its events); the last kept body. Cancelled (POST .../cancel, DELETE), it aborts its
    engine request and ends ``cancelled`` instead of raising."""
    status = 500
    body: dict[str, Any] | None
    try:
        if log is None:
            await run.start()
            _keep_without_turn(prep, state, _body(prep, "in_progress", [], None))
            finals = await run.collect()
            body = _answer(prep, finals[0], texts, state)  # kept by _answer
        else:
            async for frame in _stream(prep, run, texts, state, start=True):  # keeps what it ends with
                log.append(frame)
            body = state.responses.get(prep.response_id)
        status = run.status if log is not None else 200
    except asyncio.CancelledError:
        status, body = 499, _body(prep, "cancelled", [], None)
        _keep_without_turn(prep, state, body)
    except Exception as exc:  # noqa: BLE001 - an APIError, or a bug of ours: the response still ends, failed
        error = exc if isinstance(exc, APIError) else errors.internal_error(f"{type(exc).__name__}: {exc}")
        status, body = error.status_code, _body(prep, "failed", [], None, error=error)
        _keep_without_turn(prep, state, body)
    finally:
        if log is not None:
            log.close()
            state.responses.keep_events(prep.response_id, log.frames)
        await run.close(status)
    return body


async def _stop_background(response_id: str, state: ServerState) -> dict[str, Any] | None:
    """Cancel a background response still generating; its final body (None if none runs)."""
    running = state.background.get(response_id)
    if running is None:
        return None
    running.task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        return await running.task
    return state.responses.get(response_id)  # it never ran: its done callback kept it cancelled


async def cancel_response(request: Request, state: ServerState) -> Response:
    """POST /v1/responses/{id}/cancel: stop a background response (status ``cancelled``). One
    that has already finished is answered as it is; one not made in the background is a 400."""
    response_id = request.path_params["response_id"]
    body = state.responses.get(response_id)
    if body is None and response_id not in state.background:
        raise _not_found(response_id)
    if body is not None and not body.get("background"):
        raise errors.invalid_request(
            f"Response '{response_id}' was not created with `background`: only background responses can be cancelled.",
            "response_id",
        )
    stopped = await _stop_background(response_id, state)
    body = state.responses.get(response_id) or stopped or body
    return JSONResponse(body)


# -- GET and DELETE -------------------------------------------------------------------------


def _not_found(response_id: str) -> APIError:
    return APIError(404, f"Response with id '{response_id}' not found.", param="response_id", code="not_found")


async def get_response(request: Request, state: ServerState) -> Response:
    """The stored response; with ``stream=true`` a background stream's events after
    ``starting_after`` (a sequence number; from the first without it), followed live while it is
    generating."""
    response_id = request.path_params["response_id"]
    query = request.query_params
    if query.get("stream", "false").lower() not in ("true", "1"):
        body = state.responses.get(response_id)
        if body is None:
            raise _not_found(response_id)
        return JSONResponse(body)
    try:
        first = int(query.get("starting_after", "-1")) + 1
    except ValueError:
        first = -1
    if first < 0:
        raise errors.invalid_request("`starting_after` must be a sequence number (an integer >= 0).", "starting_after")
    running = state.background.get(response_id)
    log = running.log if running is not None else None
    if log is not None:
        frames = log.follow(first)
    else:
        kept = state.responses.events(response_id)
        if kept is None:
            if state.responses.get(response_id) is None:
                raise _not_found(response_id)
            raise errors.invalid_request(
                f"Response '{response_id}' has no stream to follow: only a response created with `background` and "
                "`stream` has one, while the store keeps its events. GET it without `stream`.",
                "stream",
            )
        frames = _replay(kept[first:])
    return SSEResponse(frames, headers={"X-Request-Id": response_id})


async def _replay(frames: list[bytes]) -> AsyncIterator[bytes]:
    for frame in frames:
        yield frame


async def list_input_items(request: Request, state: ServerState) -> Response:
    """The stored response's input items, newest first unless ``order=asc``, ``limit`` (1-100,
    default 20) a page, ``after`` an item id to continue from."""
    response_id = request.path_params["response_id"]
    items = state.responses.input_items(response_id)
    if items is None:
        raise _not_found(response_id)
    query = request.query_params
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise errors.invalid_request(f"`order` must be 'asc' or 'desc', got {order!r}.", "order")
    try:
        limit = int(query.get("limit", "20"))
    except ValueError:
        limit = 0
    if not 1 <= limit <= 100:
        raise errors.invalid_request("`limit` must be an integer from 1 to 100.", "limit")
    ordered = items if order == "asc" else items[::-1]
    after = query.get("after")
    if after is not None:
        ids = [item["id"] for item in ordered]
        if after not in ids:
            raise errors.invalid_request(f"`after` names no input item of this response ({after!r}).", "after")
        ordered = ordered[ids.index(after) + 1 :]
    page = ordered[:limit]
    return JSONResponse({
        "object": "list",
        "data": page,
        "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None,
        "has_more": len(ordered) > limit,
    })  # fmt: skip


async def delete_response(request: Request, state: ServerState) -> Response:
    response_id = request.path_params["response_id"]
    stopped = await _stop_background(response_id, state)  # a background response still generating ends first
    if not state.responses.delete(response_id) and stopped is None:
        raise _not_found(response_id)
    return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})
