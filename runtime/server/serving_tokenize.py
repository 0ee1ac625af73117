"""POST /tokenize and POST /detokenize, shaped as vLLM's: what a prompt costs in tokens, and
what token ids read as, with the served model's own tokenizer.

    POST /tokenize    {"model", "prompt"} or {"model", "messages", "add_generation_prompt",
                      "continue_final_message", "chat_template_kwargs", "tools"}
                      -> {"count", "max_model_len", "tokens", "token_strs"}
    POST /detokenize  {"model", "tokens"} -> {"prompt"}

A plain prompt is tokenised as /v1/completions tokenises it (no special tokens added unless
``add_special_tokens`` is true); messages are rendered as /v1/chat/completions renders them.
"""

from __future__ import annotations

from typing import Any

import anyio
import msgspec
from pydantic import BaseModel, Field, ValidationError, model_validator
from starlette.requests import Request
from starlette.responses import Response

from pagecast.runtime.server import errors
from pagecast.runtime.server.chat import render_chat_prompt
from pagecast.runtime.server.limits import RequestModel
from pagecast.runtime.server.protocol import ChatMessage
from pagecast.runtime.server.serving import ServedModel, ServerState
from pagecast.runtime.server.tool_calls import Tool
from pagecast.runtime.tokenization import encode_text

# 4 Mi characters of text, in `prompt` or across `messages`: more is a mistake, not a prompt.
# /tokenize answers counts past max_model_len (that is what a client asks it to learn), so the
# generation endpoints' context-based bound (limits.check_text_size) does not apply here.
MAX_TOKENIZE_CHARS = 1 << 22


class TokenizeRequest(RequestModel):
    model: str | None = None
    prompt: str | None = Field(None, max_length=MAX_TOKENIZE_CHARS)
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # with messages, as in chat requests
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Tool] | None = None  # with messages: rendered as chat requests render them
    add_special_tokens: bool = False
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of `prompt` or `messages`")
        if self.messages is not None and not self.messages:
            raise ValueError("`messages` must not be empty")
        return self


def _message_chars(messages: list[ChatMessage]) -> int:
    total = 0
    for message in messages:
        if isinstance(message.content, str):
            total += len(message.content)
        elif message.content is not None:
            total += sum(len(part.text or "") for part in message.content)
    return total


class DetokenizeRequest(RequestModel):
    model: str | None = None
    tokens: list[int] = Field(..., max_length=1 << 20)


def _parse(model_cls: type[BaseModel], body: bytes) -> Any:
    if not body.strip():
        raise errors.invalid_request("The request body is empty; send a JSON object.", code="invalid_json")
    try:
        return model_cls.model_validate_json(body)
    except ValidationError as exc:
        raise errors.from_validation_error(exc) from None


def _tokenizer(model: ServedModel) -> Any:
    tokenizer = model.engine.tokenizer
    if tokenizer is None:
        raise errors.invalid_request(
            f"Model `{model.name}` has no tokenizer (its artifact was built without one).", "model"
        )
    return tokenizer


async def tokenize(request: Request, state: ServerState) -> Response:
    # Parsing, tokenizing and rendering the answer are proportional to the input (4 Mi
    # characters took seconds), so they run in a worker thread: the event loop keeps serving
    # /health and the running streams meanwhile, as for the generation endpoints.
    body = await request.body()
    return await anyio.to_thread.run_sync(_tokenize, body, state)


def _tokenize(body: bytes, state: ServerState) -> Response:
    req: TokenizeRequest = _parse(TokenizeRequest, body)
    model = state.resolve(req.model)
    tokenizer = _tokenizer(model)
    if req.messages is not None:
        # The same bound as a plain prompt (the body limit, --max-request-bytes, caps both too).
        if _message_chars(req.messages) > MAX_TOKENIZE_CHARS:
            raise errors.invalid_request(
                f"`messages` hold more than {MAX_TOKENIZE_CHARS:,} characters of text, the most "
                "/tokenize takes in one request. Tokenize them in parts.",
                "messages",
            )
        tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
        ids = render_chat_prompt(
            tokenizer, req.messages, req.add_generation_prompt, tools, req.continue_final_message, req.chat_template_kwargs
        )
    else:
        ids = encode_text(tokenizer, req.prompt, req.add_special_tokens)
    body_out: dict[str, Any] = {
        "count": len(ids),
        "max_model_len": int(model.engine.max_model_len),
        "tokens": ids,
        "token_strs": tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None,
    }
    return _json_response(body_out)


async def detokenize(request: Request, state: ServerState) -> Response:
    body = await request.body()
    return await anyio.to_thread.run_sync(_detokenize, body, state)


def _detokenize(body: bytes, state: ServerState) -> Response:
    req: DetokenizeRequest = _parse(DetokenizeRequest, body)
    model = state.resolve(req.model)
    tokenizer = _tokenizer(model)
    vocab_size = int(model.engine.vocab_size)
    for i, token in enumerate(req.tokens):
        if not 0 <= token < vocab_size:
            raise errors.invalid_request(
                f"`tokens[{i}]` is {token}, not a token id of this model (0 to {vocab_size - 1}).",
                f"tokens[{i}]",
                "invalid_value",
            )
    return _json_response({"prompt": tokenizer.decode(req.tokens)})


def _json_response(content: dict[str, Any]) -> Response:
    # Rendered here, in the worker thread, and with msgspec: the stdlib encoder holds the GIL
    # for the whole call (0.13 s for the ~1M ids of 4 Mi characters, a stall of the event
    # loop), msgspec takes 8 ms for them. The bytes are the same JSON as JSONResponse's.
    return Response(msgspec.json.encode(content), media_type="application/json")
