"""OpenAI-shaped errors: every failure the server reports is one ``APIError`` rendered as
``{"error": {"message", "type", "param", "code"}}`` with the matching HTTP status.

User input never reaches a 500: validation failures (pydantic, ``SamplingParams``, the
engine's ``InvalidRequestError``) are all turned into 400s here, naming the parameter.
"""

from __future__ import annotations

import logging
import math
import sys
import uuid
from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError
from starlette.responses import JSONResponse

from pagecast.runtime.errors import EngineDeadError, InvalidRequestError

logger = logging.getLogger("pagecast.server")

_STATUS_CODES = {
    400: "invalid_value",
    401: "invalid_api_key",
    404: "not_found",
    405: "method_not_allowed",
    413: "request_too_large",
    429: "queue_full",
    500: "internal_error",
    503: "unavailable",
}


class APIError(Exception):
    """An error answered to the client as is. ``type`` follows OpenAI's vocabulary:
    ``invalid_request_error`` (4xx caused by the request), ``authentication_error``,
    ``rate_limit_error``, ``server_error``."""

    def __init__(
        self,
        status_code: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ):
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.type = type
        self.param = param
        # Clients branch on the code; an error raised without one still gets the status's.
        self.code = code if code is not None else _STATUS_CODES.get(status_code, "error")
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status_code, headers=self.headers)


def invalid_request(message: str, param: str | None = None, code: str = "invalid_value") -> APIError:
    """A 400. Every 4xx carries a ``code`` clients can branch on; ``invalid_value`` is the
    generic one (as OpenAI uses it), more specific ones are passed where they exist."""
    return APIError(400, message, param=param, code=code)


def body_too_large(limit: int) -> APIError:
    return APIError(
        413,
        f"The request body is larger than this server accepts ({limit:,} bytes; engine-serve "
        "--max-request-bytes). Send fewer or shorter prompts per request.",
        code="request_too_large",
    )


def too_many_sequences(num_seqs: int, limit: int, num_prompts: int | None = None, n: int | None = None) -> APIError:
    detail = f" ({num_prompts} prompt(s) x n={n})" if num_prompts is not None else ""
    return APIError(
        400,
        f"This request asks for {num_seqs} sequences{detail}; this server takes at most {limit} per "
        "request (--max-num-seqs + --max-queue). Split it into smaller requests.",
        param=("n" if num_prompts == 1 else "prompt") if num_prompts is not None else None,
        code="too_many_sequences",
    )


def unsupported(param: str, detail: str = "") -> APIError:
    message = f"The parameter `{param}` is not supported by this server" + (f": {detail}" if detail else ".")
    return APIError(400, message, param=param, code="unsupported_parameter")


def model_not_found(model: str) -> APIError:
    return APIError(404, f"The model `{model}` does not exist.", param="model", code="model_not_found")


def unauthorized(message: str) -> APIError:
    return APIError(401, message, type="authentication_error", code="invalid_api_key")


def queue_full(retry_after_s: int) -> APIError:
    return APIError(
        429,
        "The server is at capacity (too many requests waiting); retry later.",
        type="rate_limit_error",
        code="queue_full",
        headers={"Retry-After": str(retry_after_s)},
    )


def shutting_down() -> APIError:
    return APIError(
        503,
        "The server is shutting down and no longer accepts requests.",
        type="server_error",
        code="shutting_down",
    )


def cut_by_shutdown() -> APIError:
    return APIError(
        503,
        "The server was told to stop at once (a second signal) and cut this response short.",
        type="server_error",
        code="shutting_down",
    )


def engine_dead(model: str, detail: str = "", error_id: str | None = None) -> APIError:
    """A 503: the engine has stopped. ``detail`` is the server's own words; an engine failure's
    details stay in the log under ``error_id``, which the client gets to quote."""
    message = f"The engine serving `{model}` has stopped" + (f": {detail}" if detail else "")
    if error_id is not None:
        message += f" (error id {error_id}); the server's log has the details under this id"
    return APIError(503, message + ".", type="server_error", code="engine_dead")


def internal_error(detail: str, request_id: str | None = None) -> APIError:
    """A 500 for a fault of the server's own. ``detail`` goes to the server's log only (at
    ERROR, with the traceback when called while handling an exception), never to the
    client: exception text can hold paths, library internals or another request's data.
    The client gets a generic message and an id to quote, which the log line carries too."""
    request_id = request_id or f"err-{uuid.uuid4().hex[:16]}"
    logger.error("internal error (request id %s): %s", request_id, detail, exc_info=sys.exc_info()[0] is not None)
    return APIError(
        500,
        f"Internal server error (request id {request_id}); the server's log has the details under this id.",
        type="server_error",
        code="internal_error",
        headers={"X-Request-Id": request_id},
    )


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "json-or-python"}


def _param_from_loc(loc: tuple[int | str, ...]) -> tuple[str | None, bool]:
    """``("messages", 0, "content")`` -> ``messages[0].content``. Pydantic puts the union
    member it tried into ``loc`` (``"str"``, ``"list[TextPart]"``); the path stops there, and
    the second value says so."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in _TYPE_TAGS or "[" in part or "-" in part:
            return out or None, True
        else:
            out += f".{part}" if out else str(part)
    return out or None, False


def from_validation_error(exc: ValidationError) -> APIError:
    """The first pydantic error, as a 400 that names the parameter and says what was wrong."""
    err = exc.errors(include_url=False)[0]
    if err["type"] == "json_invalid":
        return invalid_request(f"The request body is not valid JSON: {err['msg']}", code="invalid_json")
    loc = tuple(err.get("loc", ()))
    param, in_union = _param_from_loc(loc)
    if err["type"] == "model_type" and not loc:
        return invalid_request("The request body must be a JSON object.", code="invalid_json")
    if err["type"] == "finite_number" or _is_non_finite(err.get("input")):
        # NaN fails every range check, so pydantic would say "should be <= 2": name the real problem.
        return invalid_request(
            f"Invalid value for `{param}`: must be a finite number (got {err.get('input')!r}).",
            param=param,
            code="invalid_value",
        )
    msg = err["msg"]
    msg = msg.removeprefix("Value error, ")
    if in_union:
        msg = f"wrong type ({msg[:1].lower() + msg[1:]}, or one of the other accepted types)"
    code = "missing_required_parameter" if err["type"] == "missing" else "invalid_value"
    return invalid_request(f"Invalid value for `{param}`: {msg}", param=param, code=code)


def _is_non_finite(value: Any) -> bool:
    return isinstance(value, float) and not math.isfinite(value)


def from_sampling_value_error(exc: ValueError, rename: Mapping[str, str] | None = None) -> APIError:
    """SamplingParams raises ``ValueError("<field> <message>")``; the field is renamed to the
    API's parameter name where they differ (chat's ``top_logprobs`` is ``logprobs`` there)."""
    text = str(exc)
    field, _, rest = text.partition(" ")
    param = (rename or {}).get(field, field)
    return invalid_request(f"Invalid value for `{param}`: {rest or text}", param=param, code="invalid_value")


def from_engine_error(exc: BaseException, model: str) -> APIError:
    """Errors the engine raises while admitting or running a request."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, InvalidRequestError):
        return invalid_request(exc.message, param=exc.param, code=exc.code or "invalid_value")
    if isinstance(exc, EngineDeadError):
        return engine_dead(model, "it failed" if exc.error_id else "", exc.error_id)
    # Anything else is ours, a bare ValueError included: the engine marks the request's own faults
    # as InvalidRequestError, so a ValueError reaching here is a bug, not a 400 with its text.
    return internal_error(f"{type(exc).__name__}: {exc}")
