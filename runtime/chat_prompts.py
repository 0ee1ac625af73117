"""Conversations -> prompt token ids for ``LLM.chat``, rendered the way engine-serve renders
/v1/chat/completions (runtime/server/chat.py): the chat template writes the special tokens,
so the rendered text is tokenised without adding any."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jinja2


def as_conversations(
    messages: Sequence[Mapping[str, Any]] | Sequence[Sequence[Mapping[str, Any]]],
) -> list[list[dict[str, Any]]]:
    """One conversation (a list of message dicts) or a list of them -> a list of them."""
    if isinstance(messages, Mapping) or not isinstance(messages, Sequence) or isinstance(messages, str):
        raise TypeError("messages must be a list of {'role': ..., 'content': ...} dicts, or a list of such lists")
    items = list(messages)
    if not items:
        raise ValueError("messages is empty: give at least one message")
    if all(isinstance(m, Mapping) for m in items):
        conversations = [items]
    elif all(isinstance(c, Sequence) and not isinstance(c, str) for c in items):
        conversations = [list(c) for c in items]
    else:
        raise ValueError("messages must be a list of message dicts, or a list of such lists, not a mix")
    for i, conversation in enumerate(conversations):
        if not conversation:
            raise ValueError(f"conversation {i} is empty: give at least one message")
        for j, m in enumerate(conversation):
            if not isinstance(m, Mapping) or "role" not in m or "content" not in m:
                raise ValueError(f"conversation {i}, message {j}: needs 'role' and 'content' ({m!r})")
    return [[dict(m) for m in c] for c in conversations]


def render(
    tokenizer: Any,
    conversation: list[dict[str, Any]],
    chat_template: str | None = None,
    add_generation_prompt: bool = True,
) -> list[int]:
    """Token ids of ``conversation`` rendered by ``chat_template`` or the tokenizer's own."""
    if tokenizer is None:
        raise ValueError("this artifact has no tokenizer, so it cannot render a conversation")
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            "this artifact has no chat template: pass chat_template=..., or use generate() with a plain prompt"
        )
    try:
        text = tokenizer.apply_chat_template(
            conversation, chat_template=chat_template, tokenize=False, add_generation_prompt=add_generation_prompt
        )
    except jinja2.TemplateError as exc:
        raise ValueError(f"the chat template rejected the conversation: {exc}") from None
    if not isinstance(text, str):  # some transformers versions return a list
        text = text[0]
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])
