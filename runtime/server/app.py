"""The Starlette application: routes, API-key check, error rendering, lifespan and draining.

    app = create_app({"llama": engine}, api_key=None, max_queue=256)
    uvicorn.run(app)

The engines' loops run in their own threads (``engine.start()`` in the lifespan), so the
event loop only parses requests and moves outputs; nothing here blocks it for long.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from typing import Any

import anyio
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from pagecast.runtime import __version__
from pagecast.runtime.errors import EngineDeadError, InvalidRequestError
from pagecast.runtime.server import errors
from pagecast.runtime.server.errors import APIError
from pagecast.runtime.server.limits import BodyLimitMiddleware
from pagecast.runtime.server.options import DEFAULT_MAX_REQUEST_BYTES, check_cors
from pagecast.runtime.server.responses_store import DEFAULT_STORE_SIZE
from pagecast.runtime.server.serving import ServerState
from pagecast.runtime.server.serving_chat import create_chat_completion
from pagecast.runtime.server.serving_completions import create_completion
from pagecast.runtime.server.serving_responses import (
    cancel_response,
    create_response,
    delete_response,
    get_response,
    list_input_items,
)
from pagecast.runtime.server.serving_tokenize import detokenize, tokenize

logger = logging.getLogger("pagecast.server")

Handler = Callable[[Request, ServerState], Awaitable[Response]]


def create_app(
    engines: Mapping[str, Any],
    api_key: str | None = None,
    max_queue: int = 256,
    *,
    manage_engines: bool = True,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    reasoning_parser: str | None = None,
    responses_store_size: int = DEFAULT_STORE_SIZE,
) -> Starlette:
    """An app serving ``engines`` (served model name -> AsyncEngine).

    ``api_key``: when set, every /v1 route needs ``Authorization: Bearer <api_key>``
    (/health, /version and /metrics stay open for probes and scrapers).
    ``max_queue``: sequences that may wait for a slot, per model, beyond the engine's
    ``max_num_seqs`` running ones; more get 429 with Retry-After.
    ``manage_engines``: start the engines when the app starts and shut them down when it
    stops (turn off to share engines between apps).
    ``max_request_bytes``: larger request bodies get 413 before they are parsed.
    ``reasoning_parser``: report a thinking model's ``<think>`` text as ``reasoning_content``
    (runtime/server/reasoning.py's styles: "qwen3", "deepseek_r1").
    ``responses_store_size``: /v1/responses kept in memory for GET /v1/responses/{id} and
    ``previous_response_id`` (the newest; 0 keeps none).
    """
    state = ServerState(engines, api_key, max_queue, reasoning_parser, responses_store_size)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        if manage_engines:
            for engine in engines.values():
                if not engine.is_alive():
                    engine.start()
        try:
            yield
        finally:
            if manage_engines:
                for engine in engines.values():
                    await anyio.to_thread.run_sync(engine.shutdown)  # joins the loop thread

    routes = [
        Route("/v1/completions", _api(state, create_completion), methods=["POST"]),
        Route("/v1/chat/completions", _api(state, create_chat_completion), methods=["POST"]),
        Route("/v1/responses", _api(state, create_response), methods=["POST"]),
        Route("/v1/responses/{response_id}", _api(state, get_response), methods=["GET"]),
        Route("/v1/responses/{response_id}", _api(state, delete_response), methods=["DELETE"]),
        Route("/v1/responses/{response_id}/input_items", _api(state, list_input_items), methods=["GET"]),
        Route("/v1/responses/{response_id}/cancel", _api(state, cancel_response), methods=["POST"]),
        Route("/v1/models", _api(state, _list_models), methods=["GET"]),
        Route("/v1/models/{model:path}", _api(state, _get_model), methods=["GET"]),
        Route("/tokenize", _api(state, tokenize), methods=["POST"]),
        Route("/detokenize", _api(state, detokenize), methods=["POST"]),
        Route("/health", _open(state, _health), methods=["GET"]),
        Route("/version", _open(state, _version), methods=["GET"]),
        Route("/metrics", _open(state, _metrics), methods=["GET"]),
    ]
    app = Starlette(
        routes=routes,
        lifespan=lifespan,
        exception_handlers={HTTPException: _http_exception},
        middleware=[Middleware(BodyLimitMiddleware, max_bytes=max_request_bytes)],
    )
    app.state.server = state
    return app


def add_cors(
    app: Starlette,
    allowed_origins: Sequence[str],
    allowed_methods: Sequence[str] = ("*",),
    allowed_headers: Sequence[str] = ("*",),
    allow_credentials: bool = False,
) -> None:
    """Let browsers on ``allowed_origins`` call the API (CORS). Call before the app starts.
    Preflight (OPTIONS) requests are answered by the middleware, before the API-key check,
    as browsers send them without credentials. Raises ``ValueError`` for a combination
    ``check_cors`` refuses."""
    from starlette.middleware.cors import CORSMiddleware

    check_cors(allowed_origins, allow_credentials)

    app.add_middleware(
        CORSMiddleware,
        allow_origins=list(allowed_origins),
        allow_methods=list(allowed_methods),
        allow_headers=list(allowed_headers),
        allow_credentials=allow_credentials,
    )


def server_state(app: Starlette) -> ServerState:
    state: ServerState = app.state.server
    return state


async def drain(state: ServerState, timeout_s: float, grace_s: float = 5.0) -> None:
    """Stop admitting (503), wait up to ``timeout_s`` for running requests to finish, then
    abort what is left and give its responses ``grace_s`` to end cleanly."""
    state.draining = True
    deadline = time.monotonic() + timeout_s
    while state.runs and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    if state.runs:
        logger.warning("shutdown timeout reached: aborting %d request(s)", len(state.runs))
        state.abort_all()
        deadline = time.monotonic() + grace_s
        while state.runs and time.monotonic() < deadline:
            await asyncio.sleep(0.05)


async def cut(state: ServerState, grace_s: float = 5.0) -> None:
    """Stop now (the second signal): every open stream ends with an error event and
    ``data: [DONE]``, every waiting non-streaming request gets a 503, and their engine
    requests are aborted; returns when they have all answered (at most ``grace_s``)."""
    state.draining = True
    state.cutting = True
    state.abort_all()
    deadline = time.monotonic() + grace_s
    while state.runs and time.monotonic() < deadline:
        await asyncio.sleep(0.02)


def _check_api_key(state: ServerState, request: Request) -> None:
    if state.api_key is None:
        return
    header = request.headers.get("authorization")
    if not header:
        raise errors.unauthorized("Missing API key: send `Authorization: Bearer <key>`.")
    scheme, _, key = header.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(key.strip().encode(), state.api_key.encode()):
        raise errors.unauthorized("Incorrect API key provided.")


def _error_response(state: ServerState, exc: APIError) -> Response:
    state.metrics.request_errors.labels(str(exc.status_code), exc.code or exc.type).inc()
    return exc.response()


def _api(state: ServerState, handler: Handler) -> Callable[[Request], Awaitable[Response]]:
    """A /v1 endpoint: API key checked, every failure answered in OpenAI's error shape."""

    async def endpoint(request: Request) -> Response:
        try:
            _check_api_key(state, request)
            return await handler(request, state)
        except APIError as exc:
            if state.cutting and exc.status_code >= 500:
                exc = errors.cut_by_shutdown()  # aborted by the second signal, not an engine fault
            return _error_response(state, exc)
        except (InvalidRequestError, EngineDeadError) as exc:
            return _error_response(state, errors.from_engine_error(exc, "the requested model"))
        except Exception as exc:  # noqa: BLE001 - a fault of ours, answered as a 500
            # Logged at ERROR with the traceback by internal_error; the client sees only an id.
            detail = f"unhandled {type(exc).__name__} in {request.method} {request.url.path}: {exc}"
            return _error_response(state, errors.internal_error(detail))

    return endpoint


def _open(state: ServerState, handler: Handler) -> Callable[[Request], Awaitable[Response]]:
    async def endpoint(request: Request) -> Response:
        return await handler(request, state)

    return endpoint


async def _http_exception(request: Request, exc: Exception) -> Response:
    """Unknown routes and wrong methods, in the same error shape as everything else."""
    status = getattr(exc, "status_code", 500)
    if status == 404:
        return APIError(
            404, f"Unknown route {request.method} {request.url.path}.", code="not_found"
        ).response()
    if status == 405:
        return APIError(
            405, f"Method {request.method} is not allowed on {request.url.path}.", code="method_not_allowed"
        ).response()
    return APIError(status, str(getattr(exc, "detail", exc))).response()


def _model_card(state: ServerState, name: str) -> dict[str, Any]:
    model = state.models[name]
    return {
        "id": name,
        "object": "model",
        "created": model.created,
        "owned_by": "pagecast",
        "max_model_len": int(model.engine.max_model_len),
    }


async def _list_models(request: Request, state: ServerState) -> Response:
    return JSONResponse({"object": "list", "data": [_model_card(state, name) for name in state.models]})


async def _get_model(request: Request, state: ServerState) -> Response:
    name = request.path_params["model"]
    state.resolve(name)
    return JSONResponse(_model_card(state, name))


async def _health(request: Request, state: ServerState) -> Response:
    dead = [name for name, m in state.models.items() if not m.engine.is_alive()]
    if dead:
        return JSONResponse({"status": "error", "dead_engines": dead}, status_code=503)
    if state.draining:
        return JSONResponse({"status": "draining"}, status_code=503)
    return JSONResponse({"status": "ok"})


async def _version(request: Request, state: ServerState) -> Response:
    return JSONResponse({"version": __version__})


async def _metrics(request: Request, state: ServerState) -> Response:
    return Response(state.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)
