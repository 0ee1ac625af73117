"""Server-Sent Events, framed exactly as OpenAI frames them: one ``data: <json>\\n\\n`` event
per chunk, compact JSON, and a final ``data: [DONE]\\n\\n`` (the Responses API names each event on an ``event:``
line too, and ends with its ``response.completed`` event, no ``[DONE]``). This module is the only place
that knows the framing, and the only place that knows how to stop a stream whose client left.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

DONE = b"data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def sse_event(payload: dict[str, Any]) -> bytes:
    """One SSE event carrying ``payload`` as compact JSON (the separators OpenAI uses)."""
    return b"data: " + json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


def sse_named_event(name: str, payload: dict[str, Any]) -> bytes:
    """An SSE event with an ``event:`` line, as the Responses API frames its events (the
    payload's ``type`` repeats the name; clients read either)."""
    return b"event: " + name.encode() + b"\n" + sse_event(payload)


class SSEResponse(StreamingResponse):
    """A text/event-stream response that always watches for the client going away.

    Starlette only listens for ``http.disconnect`` under ASGI spec < 2.4 and otherwise waits
    for a failed ``send``, which never comes while the engine is still prefilling; here the
    body iterator is cancelled as soon as the client disconnects, on every server, so the
    request is aborted and its KV blocks are freed within one engine step.
    """

    media_type = "text/event-stream"

    def __init__(
        self,
        content: Any,
        on_close: Callable[[bool], Awaitable[None]] | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(content, headers={**SSE_HEADERS, **(headers or {})})
        # Runs once the response is over, whatever happened, with True if the client left
        # first; the generator's own ``finally`` would not run if it was never started.
        self._on_close = on_close
        self._disconnected = False
        self._completed = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as task_group:

                async def stream_then_stop() -> None:
                    try:
                        await self.stream_response(send)
                        self._completed = True
                    except OSError:
                        self._disconnected = True
                    task_group.cancel_scope.cancel()

                async def watch_disconnect() -> None:
                    await self.listen_for_disconnect(receive)
                    # Servers also report http.disconnect once the response is complete.
                    self._disconnected = not self._completed
                    task_group.cancel_scope.cancel()

                task_group.start_soon(stream_then_stop)
                task_group.start_soon(watch_disconnect)
        finally:
            with anyio.CancelScope(shield=True):
                aclose = getattr(self.body_iterator, "aclose", None)
                if aclose is not None:
                    await aclose()
                if self._on_close is not None:
                    await self._on_close(self._disconnected)
