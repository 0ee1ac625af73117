"""Reasoning content: a thinking model's ``<think> ... </think>`` text apart from its answer, as
vLLM's ``--reasoning-parser`` reports it (``reasoning_content`` beside ``content`` in a chat
message, and in stream deltas).

Two styles, by where the thinking starts:

- ``qwen3``: the output thinks only if it opens with ``<think>`` (Qwen3 with thinking on; with
  ``chat_template_kwargs: {"enable_thinking": false}`` the template writes an empty think block
  into the prompt, and the whole output is the answer).
- ``deepseek_r1``: the output is thinking from its first token up to ``</think>`` (the template
  opens the block in the prompt, as DeepSeek-R1's and Qwen3-Thinking-2507's do); a leading
  ``<think>`` is dropped too.

The tags are not part of either text; whitespace between the tags and the text they enclose, and
between ``</think>`` and the answer, is dropped. An output that ends before ``</think>`` (cut by
``max_tokens``) is all reasoning and has no content. The parser gives the same texts whether it
reads the output whole or in pieces, so a stream's deltas add up to the answer of the same
request unstreamed.
"""

from __future__ import annotations

from typing import Any

from pagecast.runtime.server.tool_parsers import partial_marker

START, END = "<think>", "</think>"
STYLES = {"qwen3": False, "deepseek_r1": True}  # style -> the output thinks from its first token
_WHITESPACE = " \t\r\n"

_OPENING, _THINKING, _CLOSED, _ANSWER = range(4)


class ReasoningParser:
    """One choice's output in pieces -> deltas ``{"reasoning_content": ...}`` and
    ``{"content": ...}``, in order. Not thread-safe; one per choice."""

    def __init__(self, style: str):
        check_style(style)
        self._thinks_first = STYLES[style]
        self._state = _OPENING
        self._buf = ""  # text not yet decided: a possible start of a tag, or trailing whitespace

    def feed(self, text: str) -> list[dict[str, Any]]:
        self._buf += text
        return self._run(final=False)

    def finish(self) -> list[dict[str, Any]]:
        return self._run(final=True)

    def _run(self, final: bool) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if self._state == _OPENING:
            lead = self._buf.lstrip(_WHITESPACE)
            if START.startswith(lead) and not final:
                return events  # may still become "<think>"
            if lead.startswith(START):
                self._buf = lead[len(START) :].lstrip(_WHITESPACE)
                self._state = _THINKING
            else:
                self._state = _THINKING if self._thinks_first else _ANSWER
                if self._thinks_first:
                    self._buf = lead
        if self._state == _THINKING:
            at = self._buf.find(END)
            if at >= 0:
                self._emit(events, "reasoning_content", self._buf[:at].rstrip(_WHITESPACE))
                self._buf = self._buf[at + len(END) :]
                self._state = _CLOSED
            else:
                # Hold back a tail that may begin "</think>", and trailing whitespace (dropped if
                # the tag follows it).
                keep = 0 if final else partial_marker(self._buf, END)
                text = self._buf[: len(self._buf) - keep]
                body = text.rstrip(_WHITESPACE)
                self._emit(events, "reasoning_content", body)
                self._buf = "" if final else text[len(body) :] + self._buf[len(text) :]
                return events
        if self._state == _CLOSED:
            self._buf = self._buf.lstrip(_WHITESPACE)
            if not self._buf:
                return events
            self._state = _ANSWER
        if self._state == _ANSWER:
            self._emit(events, "content", self._buf)
            self._buf = ""
        return events

    def _emit(self, events: list[dict[str, Any]], key: str, text: str) -> None:
        if not text:
            return
        if events and key in events[-1]:
            events[-1][key] += text
        else:
            events.append({key: text})


def check_style(style: str) -> None:
    if style not in STYLES:
        raise ValueError(f"unknown reasoning parser {style!r}; choose from {', '.join(sorted(STYLES))}")


def split_reasoning(text: str, style: str) -> tuple[str | None, str | None]:
    """(reasoning, content) of a whole output; None where a part is empty."""
    parser = ReasoningParser(style)
    deltas = parser.feed(text) + parser.finish()
    reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
    content = "".join(d.get("content", "") for d in deltas)
    return reasoning or None, content or None


def constraint_start(tokenizer: Any, prompt_ids: list[int]) -> int | None:
    """The token after which a thinking request's structured output starts (its ``</think>``), as
    vLLM constrains only the answer; None where the constraint covers the whole output: the
    vocabulary has no single ``</think>`` token (the grammar then constrains the thinking too), or
    the prompt already holds one (thinking was closed by the template, as Qwen3's does with
    ``enable_thinking: false``; templates drop earlier turns' reasoning, so an end tag in the prompt
    is this turn's)."""
    end = end_token(tokenizer)
    return None if end is None or end in prompt_ids else end


def end_token(tokenizer: Any) -> int | None:
    """The vocabulary's single ``</think>`` token; None where the tag is spelt by several."""
    end = tokenizer.convert_tokens_to_ids(END)
    if not isinstance(end, int) or end < 0 or tokenizer.convert_ids_to_tokens(end) != END:
        return None
    return end
