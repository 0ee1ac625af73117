"""POST /v1/completions: text completion, also the scoring interface lm-evaluation-harness's
``local-completions`` uses (token-id prompts, ``echo``, ``logprobs``, ``max_tokens`` 0 or 1).

Choices are numbered ``prompt_index * n + choice_index``, as OpenAI numbers them for a list
of prompts.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import anyio
from starlette.requests import Request
from starlette.responses import Response

from pagecast.runtime import generation_config
from pagecast.runtime.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from pagecast.runtime.sampling_params import RequestOutputKind, SamplingParams
from pagecast.runtime.server import errors
from pagecast.runtime.server.errors import APIError
from pagecast.runtime.server.limits import check_text_size
from pagecast.runtime.server.protocol import CompletionRequest, parse_request
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

ENDPOINT = "/v1/completions"


async def create_completion(request: Request, state: ServerState) -> Response:
    body = await request.body()
    # Parsing and tokenizing cost time proportional to the request: off the event loop, so
    # /health and running streams keep their pace whatever one request sends.
    req, model, prompt_ids, prompt_texts, score_only, params = await anyio.to_thread.run_sync(
        _prepare, body, state
    )
    run = GenerationRun(state, model, new_request_id("cmpl"), ENDPOINT, prompt_ids, params, req.priority)
    created = int(time.time())
    texts = TokenTexts(model.engine.tokenizer)
    return await respond(
        request,
        run,
        req.stream,
        lambda: _stream(req, run, model.name, created, prompt_texts, texts, state),
        lambda finals: _response(req, run, model.name, created, finals, prompt_texts, texts, score_only, state),
    )


def _prepare(
    body: bytes, state: ServerState
) -> tuple[CompletionRequest, ServedModel, list[list[int]], list[str | None], bool, SamplingParams]:
    """Everything before the engine: parse, check the request's size, tokenize, check that
    each prompt fits. Runs in a worker thread; touches no shared mutable state."""
    req: CompletionRequest = parse_request(CompletionRequest, body)
    model = state.resolve(req.model)
    state.check_request_size(model, len(req.prompts), req.n)
    # max_tokens 0 with echo scores the prompt only: generate one token (the engine needs
    # one step to compute prompt logprobs) and leave it out of the answer.
    score_only = req.max_tokens == 0
    max_tokens = 1 if score_only else req.max_tokens
    prompt_ids, prompt_texts = _tokenize_prompts(req, model)
    for ids in prompt_ids:
        check_prompt_fits(model, ids, max_tokens, "prompt")
    params = req.to_sampling_params(max_tokens)
    if params.structured_output is not None and model.engine.tokenizer is None:
        # The grammar's vocabulary comes from the tokenizer: a token-id-only artifact has none.
        raise errors.unsupported("response_format", "this model's artifact has no tokenizer")
    params = generation_config.for_request(params, req, model.engine, [len(ids) for ids in prompt_ids])  # checkpoint defaults
    # A stream sends what is new at each step; an answer is built once, at the end.
    params = dataclasses.replace(params, output_kind=RequestOutputKind.DELTA if req.stream else RequestOutputKind.FINAL_ONLY)
    return req, model, prompt_ids, prompt_texts, score_only, params


def _tokenize_prompts(req: CompletionRequest, model: ServedModel) -> tuple[list[list[int]], list[str | None]]:
    """Token ids of every prompt and, for text prompts, the text (echoed as sent). A text
    too long to fit the context whatever its tokens is refused before it is tokenized."""
    ids: list[list[int]] = []
    texts: list[str | None] = []
    vocab_size = model.vocab_size
    max_model_len = int(model.engine.max_model_len)
    keep = req.kept_prompt_tokens(max_model_len)
    for prompt in req.prompts:
        if isinstance(prompt, str):
            tokenizer = model.engine.tokenizer
            if tokenizer is not None and keep is None:  # a truncated text is bounded by the body's size
                check_text_size(len(prompt), tokenizer, max_model_len, "prompt")
            prompt_ids = model.tokenize(prompt)
            cut = keep is not None and len(prompt_ids) > keep
            ids.append(prompt_ids[-keep:] if cut else prompt_ids)
            texts.append(None if cut else prompt)  # echo: the text of the tokens kept
        else:
            bad = next((t for t in prompt if t >= vocab_size), None)
            if bad is not None:
                raise errors.invalid_request(
                    f"Token id {bad} in `prompt` is out of range: the vocabulary has {vocab_size} tokens.",
                    "prompt",
                    "invalid_token_id",
                )
            ids.append(list(prompt[-keep:]) if keep is not None else list(prompt))
            texts.append(None)
    return ids, texts


@dataclass
class _LegacyLogprobs:
    """The completions API's logprobs object: four parallel lists, one entry per token."""

    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]

    @classmethod
    def empty(cls) -> _LegacyLogprobs:
        return cls([], [], [], [])

    def as_dict(self) -> dict[str, Any]:
        return {
            "tokens": self.tokens,
            "token_logprobs": self.token_logprobs,
            "top_logprobs": self.top_logprobs,
            "text_offset": self.text_offset,
        }

    def add(self, texts: TokenTexts, token_id: int, position: PositionLogprobs, k: int, offset: int) -> int:
        """Append one token; returns the text offset of the next one."""
        chosen = position.get(token_id)
        if chosen is None:
            raise errors.internal_error(f"the engine returned no logprob for token {token_id}")
        text = texts(token_id, chosen.decoded_token)
        self.tokens.append(text)
        self.token_logprobs.append(clamp_logprob(chosen.logprob))
        # The top k by rank plus the chosen token (as vLLM does), so a client can always
        # compare the chosen logprob with the best one (lm-eval's is_greedy check).
        top: dict[str, float] = {}
        for tid, lp in ranked_logprobs(position, k, token_id):
            top.setdefault(texts(tid, lp.decoded_token), clamp_logprob(lp.logprob))
        self.top_logprobs.append(top)
        self.text_offset.append(offset)
        return offset + len(text)

    def add_first_prompt_token(self, texts: TokenTexts, token_id: int) -> int:
        # The first prompt token has no context, hence no logprob: OpenAI and vLLM answer
        # null there. lm-eval reads top_logprobs as dicts (DESIGN.md: dicts, never null), so
        # the first token is reported as given: log-probability 0.0 (probability 1) and a
        # one-entry dict that agrees with it. Summing token_logprobs over the prompt then
        # gives the log-likelihood of the rest, and `logprob == max(top.values())` holds.
        text = texts(token_id)
        self.tokens.append(text)
        self.token_logprobs.append(0.0)
        self.top_logprobs.append({text: 0.0})
        self.text_offset.append(0)
        return len(text)


def _prompt_logprobs(out: RequestOutput, k: int, texts: TokenTexts) -> _LegacyLogprobs:
    """Logprobs of the echoed prompt, one entry per prompt token."""
    result = _LegacyLogprobs.empty()
    ids = out.prompt_token_ids
    positions = out.prompt_logprobs
    if positions is None or len(positions) != len(ids):
        raise errors.internal_error("the engine returned no prompt logprobs for an echo request")
    offset = result.add_first_prompt_token(texts, ids[0])
    for i in range(1, len(ids)):
        position = positions[i]
        if position is None:
            raise errors.internal_error(f"the engine returned no logprob for prompt position {i}")
        offset = result.add(texts, ids[i], position, k, offset)
    return result


def _echo_text(out: RequestOutput, prompt_text: str | None, texts: TokenTexts) -> str:
    if prompt_text is not None:
        return prompt_text
    return texts.decode(out.prompt_token_ids)


def _response(
    req: CompletionRequest,
    run: GenerationRun,
    model_name: str,
    created: int,
    finals: list[RequestOutput],
    prompt_texts: list[str | None],
    texts: TokenTexts,
    score_only: bool,
    state: ServerState,
) -> dict[str, Any]:
    if state.cutting:
        raise errors.cut_by_shutdown()  # the outputs were cut short by the second signal
    choices = []
    num_prompt_tokens = num_completion_tokens = 0
    for i, out in enumerate(finals):
        num_prompt_tokens += len(out.prompt_token_ids)
        echo = _echo_text(out, prompt_texts[i], texts) if req.echo else ""
        prompt_logprobs = None if req.prompt_logprobs is None else vllm_prompt_logprobs(out, req.prompt_logprobs, texts)
        for o in sorted(out.outputs, key=lambda o: o.index):
            if o.finish_reason == "error":
                raise errors.internal_error("the engine failed while generating")
            token_ids = [] if score_only else o.token_ids
            num_completion_tokens += len(token_ids)
            logprobs = None
            if req.logprobs is not None:
                logprobs = _prompt_logprobs(out, req.logprobs, texts) if req.echo else _LegacyLogprobs.empty()
                offset = len(echo)  # completion tokens are offsets into the echoed text + completion
                for j, tid in enumerate(token_ids):
                    offset = logprobs.add(texts, tid, _position(o, j), req.logprobs, offset)
            choice: dict[str, Any] = {
                "index": i * req.n + o.index,
                "text": echo + ("" if score_only else o.text),
                "logprobs": None if logprobs is None else logprobs.as_dict(),
                "finish_reason": o.finish_reason,
            }
            if prompt_logprobs is not None:
                choice["prompt_logprobs"] = prompt_logprobs
            if req.return_token_ids:
                choice["prompt_token_ids"] = out.prompt_token_ids
                choice["token_ids"] = token_ids
            choices.append(choice)
    return {
        "id": run.request_id,
        "object": "text_completion",
        "created": created,
        "model": model_name,
        "choices": choices,
        "usage": usage(num_prompt_tokens, num_completion_tokens),
    }


def _position(o: CompletionOutput, j: int) -> PositionLogprobs:
    if o.logprobs is None or j >= len(o.logprobs):
        raise errors.internal_error("the engine returned fewer logprobs than tokens")
    return o.logprobs[j]


@dataclass
class _ChoiceState:
    """What has been streamed of one choice so far."""

    num_tokens: int = 0
    offset: int = 0  # text offset of the next token, for logprobs
    started: bool = False
    finished: bool = False


async def _stream(
    req: CompletionRequest,
    run: GenerationRun,
    model_name: str,
    created: int,
    prompt_texts: list[str | None],
    texts: TokenTexts,
    state: ServerState,
) -> AsyncIterator[bytes]:
    def chunk(
        index: int,
        text: str,
        logprobs: _LegacyLogprobs | None,
        finish_reason: str | None,
        token_ids: list[int],
    ) -> bytes:
        choice: dict[str, Any] = {
            "index": index,
            "text": text,
            "logprobs": None if logprobs is None else logprobs.as_dict(),
            "finish_reason": finish_reason,
        }
        if req.return_token_ids:
            choice["token_ids"] = token_ids
        payload: dict[str, Any] = {
            "id": run.request_id,
            "object": "text_completion",
            "created": created,
            "model": model_name,
            "choices": [choice],
        }
        if req.continuous_usage:
            payload["usage"] = usage(
                sum(prompt_tokens.values()), sum(st.num_tokens for st in states.values())
            )
        elif req.include_usage:
            payload["usage"] = None
        return sse_event(payload)

    states: dict[int, _ChoiceState] = {}
    prompt_tokens: dict[int, int] = {}
    # Per prompt, the output that carried its prompt logprobs (a delta carries them once, whole).
    with_prompt_logprobs: dict[int, RequestOutput] = {}
    try:
        async for i, out in run.outputs():
            if state.cutting:
                raise errors.cut_by_shutdown()
            prompt_tokens[i] = len(out.prompt_token_ids)
            if out.prompt_logprobs is not None:
                with_prompt_logprobs[i] = out
            for o in out.outputs:  # deltas: what is new of each choice that advanced
                if o.finish_reason == "error":
                    raise errors.internal_error("the engine failed while generating")
                index = i * req.n + o.index
                st = states.setdefault(index, _ChoiceState())
                if st.finished:
                    continue
                prefix = ""
                logprobs = _LegacyLogprobs.empty() if req.logprobs is not None else None
                if not st.started:
                    st.started = True
                    if req.echo:
                        prefix = _echo_text(out, prompt_texts[i], texts)
                        if logprobs is not None:
                            logprobs = _prompt_logprobs(with_prompt_logprobs.get(i, out), req.logprobs or 0, texts)
                        st.offset = len(prefix)
                delta = o.text
                if logprobs is not None:
                    for j in range(len(o.token_ids)):
                        st.offset = logprobs.add(texts, o.token_ids[j], _position(o, j), req.logprobs or 0, st.offset)
                new_ids = o.token_ids
                st.num_tokens += len(new_ids)
                if o.finished:
                    st.finished = True
                    yield chunk(index, prefix + delta, logprobs, o.finish_reason, new_ids)
                elif prefix or delta or (new_ids and (logprobs is not None or req.return_token_ids)):
                    yield chunk(index, prefix + delta, logprobs, None, new_ids)
        if req.include_usage:
            completion_tokens = sum(st.num_tokens for st in states.values())
            yield sse_event(
                {
                    "id": run.request_id,
                    "object": "text_completion",
                    "created": created,
                    "model": model_name,
                    "choices": [],
                    "usage": usage(sum(prompt_tokens.values()), completion_tokens),
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
