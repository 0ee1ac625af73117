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


class TemplateRenderError(ValueError):
    """The chat template, or transformers' checks around it, refused the conversation: the
    caller's input, not a fault of the engine. ``param``: the request field at fault."""

    def __init__(self, message: str, param: str = "messages"):
        super().__init__(message)
        self.param = param


# Names a request's template kwargs may not take: apply_chat_template's own parameters and the
# variables transformers sets itself when it renders (messages, tools, documents, the generation
# prompt flag), which a kwarg of the same name would collide with.
RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "conversation", "conversations", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
        "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
        "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
    }
)  # fmt: skip


def _check_options(
    add_generation_prompt: bool, continue_final_message: bool, template_kwargs: Mapping[str, Any] | None
) -> None:
    """TemplateRenderError naming the problem with a render's options (and, as ``param``, the
    request field): ``continue_final_message`` with a generation prompt (the final message would
    be closed, then a new one opened), or a template kwarg that is not a string key or that names
    what the renderer sets itself."""
    if continue_final_message and add_generation_prompt:
        raise TemplateRenderError(
            "continue_final_message and add_generation_prompt cannot both be true: continuing the final "
            "message leaves it open, a generation prompt starts a new one; set add_generation_prompt to false",
            "continue_final_message",
        )
    for key in template_kwargs or {}:
        if not isinstance(key, str) or not key.isidentifier():
            raise TemplateRenderError(
                f"chat template kwargs need names a template can read, got {key!r}", "chat_template_kwargs"
            )
        if key in RESERVED_TEMPLATE_KWARGS:
            raise TemplateRenderError(
                f"chat template kwarg {key!r} is set by the renderer itself; use its own option", "chat_template_kwargs"
            )


def apply_template(
    tokenizer: Any,
    conversation: list[dict[str, Any]],
    *,
    chat_template: str | None = None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    tools: list[dict[str, Any]] | None = None,
    template_kwargs: Mapping[str, Any] | None = None,
) -> str:
    """The conversation rendered as text by ``chat_template`` or the tokenizer's own, as
    transformers renders it. ``continue_final_message``: the final message is left open (no
    end-of-turn after it) so the model continues it, as vLLM's option of that name does;
    ``template_kwargs``: more variables for the template (``enable_thinking`` for Qwen3's).
    TemplateRenderError (with the template's or transformers' reason, or _check_options')
    where it cannot be rendered."""
    _check_options(add_generation_prompt, continue_final_message, template_kwargs)
    try:
        text = tokenizer.apply_chat_template(
            conversation,
            tools=tools or None,
            chat_template=chat_template,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            **dict(template_kwargs or {}),
        )
    except jinja2.TemplateError as exc:
        raise TemplateRenderError(f"the chat template rejected the conversation: {exc}") from None
    except Exception as exc:
        if isinstance(exc, ValueError) and continue_final_message:
            # transformers' checks: the final message has text the rendered prompt ends with
            raise TemplateRenderError(f"the final message cannot be continued: {exc}") from None
        if not template_kwargs:
            raise
        # A kwarg that shadows what the template calls (namespace, range, raise_exception) breaks
        # it in ways Jinja does not report as a template error.
        kind = type(exc).__name__
        raise TemplateRenderError(
            f"the chat template failed with these chat template kwargs: {kind}: {exc}", "chat_template_kwargs"
        ) from None
    if not isinstance(text, str):  # some transformers versions return a list
        text = text[0]
    return text


def render(
    tokenizer: Any,
    conversation: list[dict[str, Any]],
    chat_template: str | None = None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    template_kwargs: Mapping[str, Any] | None = None,
    tools: list[dict[str, Any]] | None = None,
) -> list[int]:
    """Token ids of ``conversation`` rendered by ``chat_template`` or the tokenizer's own
    (``tools``: OpenAI function tools, passed to it as transformers passes them)."""
    if tokenizer is None:
        raise ValueError("this artifact has no tokenizer, so it cannot render a conversation")
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            "this artifact has no chat template: pass chat_template=..., or use generate() with a plain prompt"
        )
    text = apply_template(
        tokenizer,
        conversation,
        chat_template=chat_template,
        add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message,
        tools=tools,
        template_kwargs=template_kwargs,
    )
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])
