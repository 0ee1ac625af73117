"""Tool calling on /v1/chat/completions, the output side: the model's text parsed into
OpenAI ``tool_calls``, incrementally, so that a stream and a whole answer come from the same code.

``ToolCallParser.feed`` takes the text as it is generated and returns OpenAI chat deltas:
``{"content": ...}`` for text outside calls, and for each call first ``{"tool_calls": [{index,
id, type, function: {name, arguments: ""}}]}`` then ``{"tool_calls": [{index, function:
{arguments: fragment}}]}`` as the arguments arrive. A non-streamed answer feeds the whole text
at once and reads ``content`` and ``tool_calls``; the arguments are the model's own text of the
arguments object (not re-encoded), so streamed and whole answers agree character for character.

What is held back while undecided: the tail of the text that could be the start of a call marker
(``<tool_call>``, ``<|python_tag|>``), the start of a call until its header ``{"name": "...",
"arguments": `` is complete, and whitespace that may turn out to lie next to a call (dropped
then, so ``content`` is the text around calls without the blank lines that separate them).

A call whose text does not start with that header (keys in another order, arguments as a string)
is held whole until it ends and then decoded as JSON; if that fails it is given back as content
with its markers, so malformed output is never lost. A call cut short (``max_tokens``) keeps the
arguments generated so far; ``finish_reason`` then stays ``"length"``.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from pagecast.runtime.server.tool_calls import HERMES, LLAMA3_JSON

_HERMES_BEGIN, _HERMES_END = "<tool_call>", "</tool_call>"
_PYTHON_TAG = "<|python_tag|>"
_ARGUMENT_KEYS = ("arguments", "parameters")
_WHITESPACE = " \t\r\n"

# Parser states.
_TEXT = "text"  # outside calls
_HEAD = "head"  # after a call's start, until its header is decided
_ARGS = "args"  # inside the arguments object (streamed)
_TAIL = "tail"  # after the arguments, until the call's object closes
_CLOSE = "close"  # hermes: after the call's object, until </tool_call>
_NEXT = "next"  # llama3_json: after a call, another call or text
_WHOLE = "whole"  # a call held whole (no streamable header), decoded when it ends


@dataclass
class ParsedToolCall:
    id: str
    name: str
    arguments: str  # JSON text, as the model wrote it

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


class _Need(Exception):
    """The text so far is a prefix of what is expected: wait for more."""


class _No(Exception):
    """The text cannot be what is expected."""


def _skip_ws(s: str, i: int) -> int:
    while i < len(s) and s[i] in _WHITESPACE:
        i += 1
    return i


def _literal(s: str, i: int, text: str) -> int:
    if s.startswith(text, i):
        return i + len(text)
    if text.startswith(s[i:]):
        raise _Need
    raise _No


def _string(s: str, i: int) -> tuple[str, int]:
    """The JSON string starting at ``s[i]`` and the index after it."""
    i = _literal(s, i, '"')
    j = i
    while j < len(s):
        if s[j] == "\\":
            j += 2
            continue
        if s[j] == '"':
            try:
                return json.loads(s[i - 1 : j + 1]), j + 1
            except ValueError:
                raise _No from None
        j += 1
    raise _Need


def _member(s: str, i: int) -> tuple[str, int]:
    """``"key"`` then ``:``; returns the key and the index of the value (whitespace skipped)."""
    key, i = _string(s, _skip_ws(s, i))
    i = _literal(s, _skip_ws(s, i), ":")
    return key, _skip_ws(s, i)


def _header(s: str) -> tuple[str, int]:
    """A call's streamable header: ``{["type": "function", ]"name": "...", "arguments": `` (or
    ``"parameters"``) followed by ``{``. Returns the name and the index of that ``{``; raises
    ``_Need`` or ``_No``."""
    i = _literal(s, _skip_ws(s, 0), "{")
    key, i = _member(s, i)
    if key == "type":
        value, i = _string(s, i)
        if value != "function":
            raise _No
        i = _literal(s, _skip_ws(s, i), ",")
        key, i = _member(s, i)
    if key != "name":
        raise _No
    name, i = _string(s, i)
    i = _literal(s, _skip_ws(s, i), ",")
    key, i = _member(s, i)
    if key not in _ARGUMENT_KEYS:
        raise _No
    _literal(s, i, "{")
    return name, i


def _decode_call(obj: Any) -> tuple[str, str] | None:
    """(name, arguments JSON) of a decoded call object, or None if it is not one."""
    if not isinstance(obj, dict) or obj.get("type", "function") != "function":
        return None
    name = obj.get("name")
    arguments = next((obj[k] for k in _ARGUMENT_KEYS if k in obj), {})
    if not isinstance(name, str) or not name or not isinstance(arguments, (dict, str)):
        return None
    return name, arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)


def _decode_calls(text: str, separated: bool) -> list[tuple[str, str]] | None:
    """Every call in ``text`` (one JSON object, or with ``separated`` several, each followed by an
    optional ``;``), or None when any part is not a call."""
    decoder = json.JSONDecoder()
    calls = []
    i = _skip_ws(text, 0)
    while i < len(text):
        try:
            obj, i = decoder.raw_decode(text, i)
        except ValueError:
            return None
        call = _decode_call(obj)
        if call is None:
            return None
        calls.append(call)
        i = _skip_ws(text, i)
        if not separated:
            break
        if text.startswith(";", i):
            i = _skip_ws(text, i + 1)
    if i < len(text):
        return None
    return calls or None


def partial_marker(s: str, marker: str) -> int:
    """Length of the longest tail of ``s`` that is a proper prefix of ``marker``."""
    for n in range(min(len(s), len(marker) - 1), 0, -1):
        if marker.startswith(s[-n:]):
            return n
    return 0


class ToolCallParser:
    """Parses one choice's text in call format ``fmt`` (``HERMES`` or ``LLAMA3_JSON``). At most
    ``max_calls`` calls are reported (later ones are parsed and left out: the client asked for
    one). Not thread-safe; one per choice."""

    def __init__(self, fmt: str, max_calls: int | None = None):
        if fmt not in (HERMES, LLAMA3_JSON):
            raise ValueError(f"unknown tool call format {fmt!r}")
        self.fmt = fmt
        self.max_calls = max_calls
        self.calls: list[ParsedToolCall] = []
        self._content: list[str] = []
        self._events: list[dict[str, Any]] = []
        self._buf = ""
        self._state = _TEXT
        self._started = False  # any text other than whitespace seen (llama3_json: calls only lead)
        self._ws = ""  # trailing whitespace of the content, held back
        self._after_call = False  # strip the whitespace that follows a call
        self._marker = ""  # the text that opened the current call (given back if it is not one)
        self._level = 0  # JSON nesting inside the current call object
        self._in_string = False
        self._escape = False

    # -- public --------------------------------------------------------------------------------

    def feed(self, text: str) -> list[dict[str, Any]]:
        """The deltas that ``text`` (the next piece of the output) decides."""
        self._buf += text
        self._run(final=False)
        return self._take()

    def finish(self) -> list[dict[str, Any]]:
        """The deltas still held back, once the output has ended."""
        self._run(final=True)
        if not self.calls and self._ws:
            self._emit_content_raw(self._ws)  # no call: the answer is the text, as generated
        self._ws = ""
        return self._take()

    @property
    def content(self) -> str | None:
        text = "".join(self._content)
        return text if text else None

    @property
    def tool_calls(self) -> list[dict[str, Any]]:
        return [c.to_openai() for c in self.calls[: self.max_calls]]

    # -- events --------------------------------------------------------------------------------

    def _take(self) -> list[dict[str, Any]]:
        events, self._events = self._events, []
        return events

    def _emit_content_raw(self, text: str) -> None:
        self._content.append(text)
        if self._events and "content" in self._events[-1]:
            self._events[-1]["content"] += text
        else:
            self._events.append({"content": text})

    def _text(self, text: str) -> None:
        """Text outside calls: whitespace next to a call is dropped, the rest is content."""
        if self._after_call:
            text = text.lstrip(_WHITESPACE)
            if not text:
                return
            self._after_call = False
        full = self._ws + text
        kept = full.rstrip(_WHITESPACE)
        self._ws = full[len(kept) :]
        if kept:
            self._started = True
            self._emit_content_raw(kept)

    def _reported(self) -> bool:
        return self.max_calls is None or len(self.calls) <= self.max_calls

    def _begin_call(self, name: str) -> None:
        self._ws = ""
        self._after_call = True
        self._started = True
        call = ParsedToolCall(f"call_{uuid.uuid4().hex[:24]}", name, "")
        self.calls.append(call)
        if self._reported():
            head = {"index": len(self.calls) - 1, "id": call.id, "type": "function"}
            self._events.append({"tool_calls": [{**head, "function": {"name": name, "arguments": ""}}]})

    def _arguments(self, fragment: str) -> None:
        if not fragment:
            return
        self.calls[-1].arguments += fragment
        if not self._reported():
            return
        index = len(self.calls) - 1
        last = self._events[-1] if self._events else None
        if last and "tool_calls" in last and last["tool_calls"][0]["index"] == index and "id" not in last["tool_calls"][0]:
            last["tool_calls"][0]["function"]["arguments"] += fragment
        else:
            self._events.append({"tool_calls": [{"index": index, "function": {"arguments": fragment}}]})

    # -- the state machine ---------------------------------------------------------------------

    def _start_call(self, marker: str, rest: str) -> None:
        self._marker, self._buf, self._state = marker, rest, _HEAD

    def _run(self, final: bool) -> None:
        step = {
            _TEXT: self._on_text,
            _HEAD: self._on_head,
            _ARGS: self._on_args,
            _TAIL: self._on_tail,
            _CLOSE: self._on_close,
            _NEXT: self._on_next,
            _WHOLE: self._on_whole,
        }
        while step[self._state](final):
            pass

    def _on_text(self, final: bool) -> bool:
        buf = self._buf
        if self.fmt == LLAMA3_JSON and not self._started:
            lead = buf[: len(buf) - len(buf.lstrip(_WHITESPACE))]
            rest = buf[len(lead) :]
            if not rest:
                if final:
                    self._buf = ""
                    self._text(buf)
                return False
            if rest.startswith("{"):
                self._start_call(lead, rest)
                return True
            if not rest.startswith(_PYTHON_TAG) and not (_PYTHON_TAG.startswith(rest) and not final):
                self._started = True  # an ordinary answer: calls may still follow a python tag
        marker = _HERMES_BEGIN if self.fmt == HERMES else _PYTHON_TAG
        at = buf.find(marker)
        if at >= 0:
            self._text(buf[:at])
            self._start_call(marker, buf[at + len(marker) :])
            return True
        keep = 0 if final else partial_marker(buf, marker)
        self._text(buf[: len(buf) - keep])
        self._buf = buf[len(buf) - keep :]
        return False

    def _on_head(self, final: bool) -> bool:
        try:
            name, at = _header(self._buf)
        except _Need:
            if not final:
                return False
            self._state = _WHOLE
            return True
        except _No:
            self._state = _WHOLE
            return True
        self._begin_call(name)
        self._buf = self._buf[at:]
        self._level, self._in_string, self._escape = 1, False, False
        self._state = _ARGS
        return True

    def _scan(self, s: str, stop_level: int) -> int | None:
        """Follow the JSON in ``s`` from the saved state; the index just past the bracket that
        brings the nesting back to ``stop_level``, or None when ``s`` ends first."""
        for j, ch in enumerate(s):
            if self._in_string:
                if self._escape:
                    self._escape = False
                elif ch == "\\":
                    self._escape = True
                elif ch == '"':
                    self._in_string = False
            elif ch == '"':
                self._in_string = True
            elif ch in "{[":
                self._level += 1
            elif ch in "}]":
                self._level -= 1
                if self._level <= stop_level:
                    return j + 1
        return None

    def _on_args(self, final: bool) -> bool:
        end = self._scan(self._buf, 1)
        if end is None:
            self._arguments(self._buf)
            self._buf = ""
            return False  # at the end of the output: the call keeps what it has
        self._arguments(self._buf[:end])
        self._buf = self._buf[end:]
        self._state = _TAIL
        return True

    def _on_tail(self, final: bool) -> bool:
        buf = self._buf
        limit = buf.find(_HERMES_END) if self.fmt == HERMES else -1
        end = self._scan(buf[: limit if limit >= 0 else len(buf)], 0)
        if end is None and limit >= 0 and not self._in_string:
            end = limit  # the call's object was left unclosed before </tool_call>
        elif end is None and limit >= 0:
            end = self._scan(buf[limit:], 0)  # "</tool_call>" inside a string: go on
            end = None if end is None else end + limit
        if end is None:
            self._buf = ""
            return False
        self._buf = buf[end:]
        self._state = _CLOSE if self.fmt == HERMES else _NEXT
        return True

    def _on_close(self, final: bool) -> bool:
        at = self._buf.find(_HERMES_END)
        if at >= 0:
            self._buf = self._buf[at + len(_HERMES_END) :]
            self._state = _TEXT
            return True
        if final:  # no closing marker: what follows the call is text
            buf, self._buf = self._buf, ""
            self._state = _TEXT
            rest = buf.lstrip(_WHITESPACE)
            if rest and _HERMES_END.startswith(rest):
                return False  # the output ended inside the closing marker (max_tokens): not text
            self._text(buf)
        return False

    def _on_next(self, final: bool) -> bool:
        rest = self._buf.lstrip(_WHITESPACE)
        if rest.startswith(";"):
            rest = rest[1:].lstrip(_WHITESPACE)
        if not rest:
            self._buf = ""
            return False
        if rest.startswith("{"):
            self._start_call("", rest)
            return True
        if rest.startswith(_PYTHON_TAG):
            self._start_call(_PYTHON_TAG, rest[len(_PYTHON_TAG) :])
            return True
        if _PYTHON_TAG.startswith(rest) and not final:
            self._buf = rest
            return False
        self._buf = rest
        self._state = _TEXT
        return True

    def _on_whole(self, final: bool) -> bool:
        buf = self._buf
        if self.fmt == HERMES:
            # The call ends at the first "</tool_call>" after which its text decodes (an earlier
            # one may lie inside a string); when none does, at the first one, once the output ends.
            ends = [i for i in range(len(buf)) if buf.startswith(_HERMES_END, i)]
            at = next((i for i in ends if _decode_calls(buf[:i], separated=False)), -1)
            if at < 0 and not final:
                return False
            if at < 0 and ends:
                at = ends[0]
            body, rest, closer = (buf[:at], buf[at + len(_HERMES_END) :], _HERMES_END) if at >= 0 else (buf, "", "")
        else:
            if not final:
                return False
            body, rest, closer = buf, "", ""
        calls = _decode_calls(body, separated=self.fmt == LLAMA3_JSON)
        if calls is None:
            self._text(self._marker + body + closer)  # not a call: the model's text, markers and all
        else:
            for name, arguments in calls:
                self._begin_call(name)
                self._arguments(arguments)
        self._buf = rest
        self._state = _TEXT
        return True


def finish_reason_with_calls(finish_reason: str | None) -> str | None:
    """A choice that made calls and stopped on its own ends with ``"tool_calls"``, as OpenAI's
    do; one cut by ``max_tokens`` keeps ``"length"``."""
    return "tool_calls" if finish_reason == "stop" else finish_reason


def parse_tool_calls(text: str, fmt: str, max_calls: int | None = None) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, tool_calls) of a whole output: what a non-streamed answer carries."""
    parser = ToolCallParser(fmt, max_calls)
    parser.feed(text)
    parser.finish()
    return parser.content, parser.tool_calls
