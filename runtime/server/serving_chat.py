"""POST /v1/chat/completions: the conversation rendered by the artifact's chat template,
generated as one prompt, answered (or streamed) in OpenAI's chat format."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator
from typing import Any

import anyio
from starlette.requests import Request
from starlette.responses import Response

from pagecast.runtime import generation_config
from pagecast.runtime.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from pagecast.runtime.sampling_params import RequestOutputKind, SamplingParams
from pagecast.runtime.server import errors
from pagecast.runtime.server.chat import render_chat_prompt
from pagecast.runtime.server.errors import APIError
from pagecast.runtime.server.limits import check_text_size
from pagecast.runtime.server.protocol import ChatCompletionRequest, parse_request
from pagecast.runtime.server.reasoning import ReasoningParser, constraint_start, split_reasoning
from pagecast.runtime.server.serving import (
    GenerationRun,
    ServedModel,
    ServerState,
    TokenTexts,
    check_prompt_fits,
    clamp_logprob,
    new_request_id,
    ranked_logprobs,
    respond,
    usage,
    vllm_prompt_logprobs,
)
from pagecast.runtime.server.sse import DONE, sse_event
from pagecast.runtime.server.tool_calls import ToolPlan, plan_tools
from pagecast.runtime.server.tool_parsers import ToolCallParser, finish_reason_with_calls, parse_tool_calls

ENDPOINT = "/v1/chat/completions"


async def create_chat_completion(request: Request, state: ServerState) -> Response:
    body = await request.body()
    # Parsing, templating and tokenizing cost time proportional to the request: off the event
    # loop, so /health and running streams keep their pace whatever one request sends.
    req, model, prompt_ids, params, tools = await anyio.to_thread.run_sync(_prepare, body, state)
    run = GenerationRun(state, model, new_request_id("chatcmpl"), ENDPOINT, [prompt_ids], params, req.priority)
    created = int(time.time())
    texts = TokenTexts(model.engine.tokenizer)
    return await respond(
        request,
        run,
        req.stream,
        lambda: _stream(req, run, model.name, created, texts, state, tools),
        lambda finals: _response(req, run, model.name, created, finals[0], texts, state, tools),
    )


def _prepare(
    body: bytes, state: ServerState
) -> tuple[ChatCompletionRequest, ServedModel, list[int], SamplingParams, ToolPlan | None]:
    """Everything before the engine, in a worker thread (touches no shared mutable state)."""
    req: ChatCompletionRequest = parse_request(ChatCompletionRequest, body)
    model = state.resolve(req.model)
    state.check_request_size(model, 1, req.n)
    tokenizer = model.engine.tokenizer
    keep = req.kept_prompt_tokens(int(model.engine.max_model_len))
    if tokenizer is not None and keep is None:  # a truncated prompt is bounded by the body's size
        # The template writes every message's text into the prompt: if the texts alone are too
        # long for the context, refuse before rendering and tokenizing them.
        chars = sum(len(m.text(i)) for i, m in enumerate(req.messages))
        check_text_size(chars, tokenizer, int(model.engine.max_model_len), "messages")
    tools = plan_tools(req.tools, req.tool_choice, req.parallel_tool_calls, getattr(tokenizer, "chat_template", None))
    prompt_ids = render_chat_prompt(
        tokenizer,
        req.messages,
        req.add_generation_prompt,
        tools.tools if tools else None,
        req.continue_final_message,
        req.chat_template_kwargs,
    )
    if keep is not None:
        prompt_ids = prompt_ids[-keep:]  # the rendered prompt's last tokens, as vLLM keeps them
    max_tokens = req.requested_max_tokens
    check_prompt_fits(model, prompt_ids, max_tokens, "messages")
    params = req.to_sampling_params(max_tokens, tools.structured_output if tools else None)
    return req, model, prompt_ids, served_params(params, req, state, model, prompt_ids), tools


def served_params(
    params: SamplingParams, req: Any, state: ServerState, model: ServedModel, prompt_ids: list[int]
) -> SamplingParams:
    """A chat-style request's sampling parameters as the engine gets them: a constraint on the
    answer only (after ``</think>``) with a reasoning parser, the checkpoint's defaults for what
    the request left out, and deltas for a stream."""
    tokenizer = model.engine.tokenizer
    if state.reasoning_parser is not None and params.structured_output is not None and tokenizer is not None:
        # The answer is constrained, not the thinking before it (as vLLM does with a reasoning parser).
        after = constraint_start(tokenizer, prompt_ids)
        if after is not None:
            params = dataclasses.replace(params, structured_output_after=after)
    params = generation_config.for_request(params, req, model.engine, [len(prompt_ids)])  # checkpoint defaults
    # A stream sends what is new at each step; an answer is built once, at the end.
    return dataclasses.replace(params, output_kind=RequestOutputKind.DELTA if req.stream else RequestOutputKind.FINAL_ONLY)


def answer_deltas(
    text: str, finished: bool, thinker: ReasoningParser | None, parser: ToolCallParser | None
) -> list[dict[str, Any]]:
    """A choice's new text as deltas in order: ``reasoning_content`` (with a reasoning parser),
    ``content`` and ``tool_calls`` (with tools: calls are read from the answer only)."""
    deltas = [{"content": text}] if text else []
    if thinker is not None:
        deltas = thinker.feed(text) + (thinker.finish() if finished else [])
    if parser is not None:
        answer = "".join(d.get("content", "") for d in deltas)
        deltas = [d for d in deltas if "reasoning_content" in d] + parser.feed(answer)
        deltas += parser.finish() if finished else []
    return deltas


def logprob_entries(
    o: CompletionOutput, start: int, stop: int, k: int, texts: TokenTexts
) -> list[dict[str, Any]]:
    """Chat logprobs of tokens ``start:stop``: each with its ``top_logprobs`` (the k best)."""
    entries = []
    for j in range(start, stop):
        if o.logprobs is None or j >= len(o.logprobs):
            raise errors.internal_error("the engine returned fewer logprobs than tokens")
        position: PositionLogprobs = o.logprobs[j]
        token_id = o.token_ids[j]
        chosen = position.get(token_id)
        if chosen is None:
            raise errors.internal_error(f"the engine returned no logprob for token {token_id}")
        top = [_token_logprob(texts, tid, lp.decoded_token, lp.logprob) for tid, lp in ranked_logprobs(position, k)]
        entries.append({**_token_logprob(texts, token_id, chosen.decoded_token, chosen.logprob), "top_logprobs": top[:k]})
    return entries


def _token_logprob(texts: TokenTexts, token_id: int, decoded: str | None, logprob: float) -> dict[str, Any]:
    text = texts(token_id, decoded)
    return {"token": text, "logprob": clamp_logprob(logprob), "bytes": texts.token_bytes(token_id, text)}


def _response(
    req: ChatCompletionRequest,
    run: GenerationRun,
    model_name: str,
    created: int,
    out: RequestOutput,
    texts: TokenTexts,
    state: ServerState,
    tools: ToolPlan | None,
) -> dict[str, Any]:
    if state.cutting:
        raise errors.cut_by_shutdown()  # the outputs were cut short by the second signal
    choices = []
    for o in sorted(out.outputs, key=lambda o: o.index):
        if o.finish_reason == "error":
            raise errors.internal_error("the engine failed while generating")
        logprobs = None
        if req.logprobs:
            logprobs = {
                "content": logprob_entries(o, 0, len(o.token_ids), req.top_logprobs or 0, texts),
                "refusal": None,
            }
        message: dict[str, Any] = {"role": "assistant", "content": o.text, "refusal": None}
        answer = o.text
        if state.reasoning_parser is not None:
            reasoning, answer = split_reasoning(o.text, state.reasoning_parser)
            message.update(content=answer, reasoning_content=reasoning)
        finish_reason = o.finish_reason
        if tools is not None and answer is not None:
            content, calls = parse_tool_calls(answer, tools.format, tools.max_calls)
            if calls:
                message.update(content=content, tool_calls=calls)
                finish_reason = finish_reason_with_calls(finish_reason)
        choice: dict[str, Any] = {
            "index": o.index,
            "message": message,
            "logprobs": logprobs,
            "finish_reason": finish_reason,
        }
        if req.return_token_ids:
            choice["token_ids"] = o.token_ids
        choices.append(choice)
    body: dict[str, Any] = {
        "id": run.request_id,
        "object": "chat.completion",
        "created": created,
        "model": model_name,
        "choices": choices,
        "usage": usage(len(out.prompt_token_ids), sum(len(o.token_ids) for o in out.outputs)),
    }
    if req.return_token_ids:
        body["prompt_token_ids"] = out.prompt_token_ids
    if req.prompt_logprobs is not None:
        body["prompt_logprobs"] = vllm_prompt_logprobs(out, req.prompt_logprobs, texts)
    return body


async def _stream(
    req: ChatCompletionRequest,
    run: GenerationRun,
    model_name: str,
    created: int,
    texts: TokenTexts,
    state: ServerState,
    tools: ToolPlan | None,
) -> AsyncIterator[bytes]:
    """OpenAI's chunk sequence per choice: a first delta with the role, content (and, with
    tools, tool-call) deltas, then an empty delta carrying ``finish_reason``; a usage-only chunk
    last when asked."""

    def chunk(
        index: int,
        delta: dict[str, Any],
        logprobs: Any,
        finish_reason: str | None,
        token_ids: list[int] | None = None,
    ) -> bytes:
        choice: dict[str, Any] = {
            "index": index,
            "delta": delta,
            "logprobs": logprobs,
            "finish_reason": finish_reason,
        }
        if req.return_token_ids and token_ids is not None:
            choice["token_ids"] = token_ids
        payload: dict[str, Any] = {
            "id": run.request_id,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model_name,
            "choices": [choice],
        }
        if req.continuous_usage:
            payload["usage"] = usage(prompt_tokens, sum(num_tokens.values()))
        elif req.include_usage:
            payload["usage"] = None
        return sse_event(payload)

    num_tokens: dict[int, int] = {}
    finished: set[int] = set()
    parsers: dict[int, ToolCallParser] = {}
    thinking: dict[int, ReasoningParser] = {}
    prompt_tokens = 0
    k = req.top_logprobs or 0
    try:
        async for _, out in run.outputs():
            if state.cutting:
                raise errors.cut_by_shutdown()
            prompt_tokens = len(out.prompt_token_ids)
            for o in out.outputs:  # deltas: what is new of each choice that advanced
                if o.finish_reason == "error":
                    raise errors.internal_error("the engine failed while generating")
                index = o.index
                if index in finished:
                    continue
                if index not in num_tokens:
                    num_tokens[index] = 0
                    yield chunk(index, {"role": "assistant", "content": ""}, None, None)
                delta = o.text
                logprobs = None
                if req.logprobs and o.token_ids:
                    logprobs = {"content": logprob_entries(o, 0, len(o.token_ids), k, texts), "refusal": None}
                new_ids = o.token_ids
                num_tokens[index] += len(new_ids)
                thinker = parser = None
                if state.reasoning_parser is not None:
                    thinker = thinking.setdefault(index, ReasoningParser(state.reasoning_parser))
                if tools is not None:
                    parser = parsers.setdefault(index, ToolCallParser(tools.format, tools.max_calls))
                deltas = answer_deltas(delta, o.finished, thinker, parser)
                if not deltas and (logprobs is not None or (new_ids and req.return_token_ids)):
                    deltas = [{"content": ""}]
                for j, d in enumerate(deltas):
                    yield chunk(index, d, logprobs if j == 0 else None, None, new_ids if j == 0 else None)
                if o.finished:
                    finished.add(index)
                    reason = o.finish_reason
                    if index in parsers and parsers[index].tool_calls:
                        reason = finish_reason_with_calls(reason)
                    yield chunk(index, {}, None, reason)
        if req.include_usage:
            yield sse_event(
                {
                    "id": run.request_id,
                    "object": "chat.completion.chunk",
                    "created": created,
                    "model": model_name,
                    "choices": [],
                    "usage": usage(prompt_tokens, sum(num_tokens.values())),
                }
            )
    except APIError as exc:
        run.status = exc.status_code
        yield sse_event(exc.body())
    except Exception as exc:  # noqa: BLE001 - a bug of ours: still end the stream with a message
        error = errors.internal_error(f"{type(exc).__name__}: {exc}")
        run.status = error.status_code
        yield sse_event(error.body())
    yield DONE
