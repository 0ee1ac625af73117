"""Request limits that protect the server from a single request: the body size (413, checked
before anything is parsed), the size of a text prompt (400 before it is tokenized), and the
range of every integer a request carries (``RequestModel``, the base of every request model).

Both exist because the work they prevent is proportional to the input and happens before
the engine sees the request: a 50 MB prompt used to be read, parsed and tokenized in full
(minutes of CPU, gigabytes of memory) only to be refused as too long afterwards.
"""

from __future__ import annotations

import weakref
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pagecast.runtime.server import errors
from pagecast.runtime.server.options import DEFAULT_MAX_REQUEST_BYTES


class BodyLimitMiddleware:
    """Refuse request bodies over ``max_bytes`` with a 413, before they are read in full.

    The declared ``Content-Length`` is checked on the first read, and the bytes actually
    received are counted while the body streams in (chunked uploads declare no length). The
    limit is raised as an ``APIError`` from ``receive``, so the endpoint answers it in the
    usual error shape and counts it in the metrics; a route that never reads its body never
    pays for it.
    """

    def __init__(self, app: ASGIApp, max_bytes: int = DEFAULT_MAX_REQUEST_BYTES):
        if max_bytes < 1:
            raise ValueError("max_bytes must be >= 1")
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.max_bytes
        declared = _content_length(scope)
        received = 0

        async def limited_receive() -> Message:
            nonlocal received
            if declared is not None and declared > limit:
                raise errors.body_too_large(limit)
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise errors.body_too_large(limit)
            return message

        await self.app(scope, limited_receive, send)


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


# JSON integers have no size; the engine's do. A value past int64 raised OverflowError deep in
# torch (top_k) or msgspec (stop_token_ids, min_tokens) and became a 500.
MIN_INT, MAX_INT = -(2**63), 2**63 - 1


class RequestModel(BaseModel):
    """Base of every request body model: strict types (a string where a number belongs is a
    400, not a silent cast), NaN and infinities refused by name, unknown fields ignored (as
    vLLM does, so newer clients keep working), and every integer, in any field and at any
    depth of its lists, inside a signed 64-bit range, so no number a client sends can
    overflow where the engine converts it. Fields with their own tighter bounds keep them;
    this is the floor under all of them, including fields added later."""

    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)

    @field_validator("*", mode="after")
    @classmethod
    def _integers_fit_int64(cls, value: Any, info: ValidationInfo) -> Any:
        found = _out_of_range_int(value)
        if found is not None:
            where, number = found
            raise ValueError(
                f"{info.field_name}{where} is {number}, outside the integers this server accepts "
                f"({MIN_INT} to {MAX_INT})"
            )
        return value


def _out_of_range_int(value: Any, where: str = "") -> tuple[str, int] | None:
    """(index path, value) of the first integer outside int64 in ``value`` and its lists.
    Nested request models check their own fields; dicts (JSON schemas, tool parameters) are
    data passed on as JSON, never converted to a machine integer, so they are left alone."""
    if isinstance(value, int) and not isinstance(value, bool):
        return (where, value) if not MIN_INT <= value <= MAX_INT else None
    if isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            found = _out_of_range_int(item, f"{where}[{i}]")
            if found is not None:
                return found
    return None


# tokenizer -> the most characters one token can stand for (computed once per tokenizer).
_CHARS_PER_TOKEN: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
# Normalizers (NFKC, whitespace folding) can make the text the model sees shorter than the text
# sent; the bound is only used to refuse, so it is kept loose by this factor.
_SAFETY = 2


def max_chars_per_token(tokenizer: Any) -> int:
    """An upper bound on the characters of text one token covers: the longest vocabulary
    entry. Byte-level BPE vocabularies spell each byte as one character and SentencePiece
    ones spell the text itself, so in both a token covers at most ``len(entry)`` characters
    of the input."""
    try:
        return _CHARS_PER_TOKEN[tokenizer]
    except (KeyError, TypeError):
        pass
    vocab = tokenizer.get_vocab()
    longest = max((len(entry) for entry in vocab), default=1)
    try:
        _CHARS_PER_TOKEN[tokenizer] = max(1, longest)
    except TypeError:  # not weak-referenceable: compute again next time
        pass
    return max(1, longest)


def max_prompt_chars(tokenizer: Any, max_model_len: int) -> int:
    """A text prompt longer than this has at least ``max_model_len`` tokens, so it can never
    fit the context: it is refused without tokenizing it."""
    return max_model_len * max_chars_per_token(tokenizer) * _SAFETY


def check_text_size(num_chars: int, tokenizer: Any, max_model_len: int, param: str) -> None:
    """400 ``context_length_exceeded`` for a text of ``num_chars`` characters that cannot fit
    ``max_model_len`` tokens, decided from its length alone (no tokenizing)."""
    limit = max_prompt_chars(tokenizer, max_model_len)
    if num_chars > limit:
        raise errors.invalid_request(
            f"This model's maximum context length is {max_model_len} tokens; this prompt has "
            f"{num_chars:,} characters, which is more than {max_model_len} tokens of this vocabulary "
            f"can spell (at most {limit:,} characters). Shorten the prompt.",
            param,
            "context_length_exceeded",
        )
