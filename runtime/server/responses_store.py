"""The responses /v1/responses keeps (``store``): for GET /v1/responses/{id} and for
``previous_response_id``, which continues a kept response's conversation."""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import threading
from typing import Any

from pagecast.runtime.server.protocol import ChatMessage

DEFAULT_STORE_SIZE = 1024  # engine-serve --responses-store-size
# What the kept responses may hold in all (their bodies, input items and conversation text, as
# JSON): a request body may be 8 MiB, so the count alone would let clients that store long inputs
# grow the server's memory by gigabytes. The oldest go first past either bound.
DEFAULT_STORE_BYTES = 256 << 20
UNFINISHED = ("queued", "in_progress")  # a background response's statuses while it generates

logger = logging.getLogger("pagecast.server")


@dataclasses.dataclass(frozen=True)
class _Stored:
    body: dict[str, Any]
    previous: str | None  # the response this one continued
    turn: list[ChatMessage]  # this request's input messages, then its answer as an assistant message
    input_items: list[dict[str, Any]]  # the request's input as items with ids (GET .../input_items)
    nbytes: int  # its size as JSON (and its events'), for the store's byte bound
    events: list[bytes] | None = None  # a background stream's SSE frames, for GET ?stream=true


class ResponseStore:
    """The last ``capacity`` stored responses of this process, holding at most ``max_bytes`` in
    all (as JSON), oldest forgotten first (background responses still generating last). Written on the event loop, read by request threads: a
    lock guards it."""

    def __init__(self, capacity: int = DEFAULT_STORE_SIZE, max_bytes: int = DEFAULT_STORE_BYTES):
        if capacity < 0 or max_bytes < 0:
            raise ValueError("capacity and max_bytes must be >= 0")
        self.capacity = capacity
        self.max_bytes = max_bytes
        self.nbytes = 0
        self._items: collections.OrderedDict[str, _Stored] = collections.OrderedDict()
        self._lock = threading.Lock()

    def put(
        self,
        response_id: str,
        body: dict[str, Any],
        previous: str | None,
        turn: list[ChatMessage],
        input_items: list[dict[str, Any]],
    ) -> None:
        if self.capacity == 0:
            return
        texts = [m.content if isinstance(m.content, str) else "" for m in turn]
        nbytes = sum(len(json.dumps(x, ensure_ascii=False)) for x in (body, input_items, texts))
        if nbytes > self.max_bytes:
            logger.warning("response %s not kept: %d bytes, over the store's %d", response_id, nbytes, self.max_bytes)
            return
        with self._lock:
            old = self._items.pop(response_id, None)
            self.nbytes -= old.nbytes if old is not None else 0
            self._items[response_id] = _Stored(body, previous, turn, input_items, nbytes)
            self.nbytes += nbytes
            self._evict()

    def _evict(self) -> None:
        while len(self._items) > self.capacity or self.nbytes > self.max_bytes:
            # The oldest finished response goes first: a background response still generating
            # can be read back nowhere else (there are at most as many as the server admits).
            victim = next((k for k, v in self._items.items() if v.body.get("status") not in UNFINISHED), None)
            self.nbytes -= self._items.pop(victim if victim is not None else next(iter(self._items))).nbytes

    def keep_events(self, response_id: str, frames: list[bytes]) -> None:
        """Keep a finished background stream's events with its response (if it is kept and they fit)."""
        size = sum(len(f) for f in frames)
        with self._lock:
            item = self._items.get(response_id)
            if item is None:
                return
            if item.nbytes + size > self.max_bytes:
                logger.warning("the events of response %s not kept: %d bytes, over the store's %d", response_id,
                               item.nbytes + size, self.max_bytes)  # fmt: skip
                return
            self._items[response_id] = dataclasses.replace(item, events=list(frames), nbytes=item.nbytes + size)
            self.nbytes += size
            self._evict()

    def events(self, response_id: str) -> list[bytes] | None:
        with self._lock:
            item = self._items.get(response_id)
        return None if item is None else item.events

    def get(self, response_id: str) -> dict[str, Any] | None:
        with self._lock:
            item = self._items.get(response_id)
        return None if item is None else item.body

    def input_items(self, response_id: str) -> list[dict[str, Any]] | None:
        with self._lock:
            item = self._items.get(response_id)
        return None if item is None else item.input_items

    def delete(self, response_id: str) -> bool:
        with self._lock:
            item = self._items.pop(response_id, None)
            self.nbytes -= item.nbytes if item is not None else 0
        return item is not None

    def conversation(self, response_id: str) -> list[ChatMessage] | None:
        """Every turn up to and including ``response_id``'s, oldest first; None if it, or any
        response it continued, is not kept (the conversation could not be complete)."""
        turns: list[list[ChatMessage]] = []
        seen: set[str] = set()
        with self._lock:
            current: str | None = response_id
            while current is not None:
                item = self._items.get(current)
                if item is None or current in seen:
                    return None
                seen.add(current)
                turns.append(item.turn)
                current = item.previous
        return [m for turn in reversed(turns) for m in turn]
