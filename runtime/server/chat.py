"""Chat prompts: the artifact's chat template, rendered as transformers renders it."""

from __future__ import annotations

from typing import Any

from pagecast.runtime.chat_prompts import TemplateRenderError, apply_template
from pagecast.runtime.server.errors import APIError, invalid_request
from pagecast.runtime.server.protocol import ChatMessage
from pagecast.runtime.server.tool_calls import template_tool_calls
from pagecast.runtime.tokenization import encode_text


def render_chat_prompt(
    tokenizer: Any,
    messages: list[ChatMessage],
    add_generation_prompt: bool = True,
    tools: list[dict[str, Any]] | None = None,
    continue_final_message: bool = False,
    template_kwargs: dict[str, Any] | None = None,
) -> list[int]:
    """Token ids of the conversation rendered by the tokenizer's chat template, with ``tools``
    (OpenAI function tools) passed to it as transformers passes them; a template that does not
    read ``tools`` leaves them out. ``continue_final_message`` and ``template_kwargs``
    (``chat_template_kwargs``): as in chat_prompts.apply_template; options it refuses are 400s
    naming their field.

    The rendered text is tokenised without special tokens: the template writes its own BOS
    and turn markers, and adding them again would double the BOS.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise APIError(
            400,
            "This model has no chat template, so /v1/chat/completions cannot format a conversation; "
            "use /v1/completions with a plain prompt.",
            param="messages",
            code="no_chat_template",
        )
    conversation = [_template_message(m, i) for i, m in enumerate(messages)]
    try:
        text = apply_template(
            tokenizer,
            conversation,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            tools=tools,
            template_kwargs=template_kwargs,
        )
    except TemplateRenderError as exc:
        # Templates reject conversations they cannot format (e.g. roles that do not alternate), a
        # final message the template rewrites cannot be continued, and some options cannot work.
        reason = str(exc)
        raise invalid_request(reason[:1].upper() + reason[1:], exc.param) from None
    return encode_text(tokenizer, text)


def _template_message(message: ChatMessage, index: int) -> dict[str, Any]:
    """One message as chat templates read it: tool calls with their arguments decoded, tool
    results with the id of the call they answer."""
    out: dict[str, Any] = {
        "role": "system" if message.role == "developer" else message.role,
        "content": message.text(index),
    }
    if message.tool_calls:
        out["tool_calls"] = template_tool_calls(message.tool_calls)
    if message.role == "tool":
        out["tool_call_id"] = message.tool_call_id
        if message.name:
            out["name"] = message.name
    return out
