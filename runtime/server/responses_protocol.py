"""The request side of POST /v1/responses (OpenAI's Responses API): its body, and its input
items as the chat messages the chat template renders.

A Responses request is a chat request in other clothes: ``instructions`` is a system message,
``input`` is a string (one user message) or a list of items (messages with text parts, earlier
``function_call`` items and the ``function_call_output`` items that answer them), ``tools`` are
function tools written flat (``{"type": "function", "name": ...}``), ``text.format`` is the
output constraint, ``max_output_tokens`` the length. Everything here turns it into the chat
endpoint's pieces (``ChatMessage``, ``Tool``, the tool choice, a ``StructuredOutput``), so the
prompt, the tool-call grammar and the parsing are the chat endpoint's own. Errors name the
parameter as a Responses client spelled it (``input[2].content[0].type``).

What is refused with a 400 that says so: tools other than functions (web search, file search,
MCP, ...), images, files and audio in the input, ``item_reference`` items, ``background`` without
``store``, ``conversation`` and ``prompt`` templates.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import Field, ValidationError

from pagecast.runtime.sampling_params import StructuredOutput
from pagecast.runtime.server.errors import APIError, invalid_request, unsupported
from pagecast.runtime.server.protocol import MAX_LOGPROBS, ChatMessage, _SamplingRequest, output_format
from pagecast.runtime.server.tool_calls import (
    FunctionDefinition,
    FunctionName,
    NamedToolChoice,
    Tool,
    check_tool_choice,
    check_tools,
)

LOGPROBS_INCLUDE = "message.output_text.logprobs"
_TEXT_PARTS = ("input_text", "output_text", "text", "summary_text", "reasoning_text")
_ROLES = ("user", "assistant", "system", "developer")


class ResponsesRequest(_SamplingRequest):
    """POST /v1/responses. Besides OpenAI's fields, the sampling extensions every endpoint
    takes (``top_k``, ``min_p``, ``repetition_penalty``, ``seed``, ``stop``, ...) apply."""

    input: str | list[Any]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_tool_calls: int | None = Field(None, ge=1)
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    include: list[str] | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    truncation: Literal["auto", "disabled"] | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    # vLLM's extension, as on chat: more chat-template variables.
    chat_template_kwargs: dict[str, Any] | None = None
    # Answer at once (status "queued") and generate after; GET polls it, POST .../cancel stops it.
    background: bool | None = None
    # Not implemented: refused with a 400 that says so.
    conversation: Any = None
    prompt: Any = None

    def check(self) -> None:
        self.check_common()
        if self.n != 1:
            raise unsupported("n", "a response has one output; send several requests for several answers")
        if self.background and not self.store:
            # OpenAI's rule too: a background response is only ever read back from the store.
            raise invalid_request("`background` responses must be stored: leave `store` true.", "store")
        for name in ("conversation", "prompt"):
            if getattr(self, name) is not None:
                raise unsupported(name, "send the conversation as `input` (or chain with `previous_response_id`)")
        for name in ("prompt_logprobs", "return_token_ids"):
            if getattr(self, name):
                raise unsupported(name, "not answered on /v1/responses; use /v1/chat/completions")
        if self.metadata is not None and len(self.metadata) > 16:
            raise invalid_request("`metadata` holds at most 16 keys.", "metadata")
        if self.reasoning is not None:
            effort = self.reasoning.get("effort")
            if effort is not None and not isinstance(effort, str):
                raise invalid_request("`reasoning.effort` must be a string.", "reasoning.effort")

    # -- the pieces of a chat request ------------------------------------------------------

    @property
    def wants_logprobs(self) -> bool:
        return LOGPROBS_INCLUDE in (self.include or []) or self.top_logprobs is not None

    def chat_tools(self) -> list[Tool] | None:
        """``tools`` as the chat endpoint's function tools (400 for any other kind of tool)."""
        if not self.tools:
            check_tool_choice(None, self.chat_tool_choice())  # "required" needs tools
            return None
        tools = []
        for i, raw in enumerate(self.tools):
            where = f"tools[{i}]"
            if not isinstance(raw, dict):
                raise invalid_request(f"`{where}` must be an object.", where)
            kind = raw.get("type")
            if kind != "function":
                raise unsupported(f"{where}.type", f"tool type {kind!r}; only `function` tools are served")
            spec = {k: raw[k] for k in ("name", "description", "parameters", "strict") if raw.get(k) is not None}
            try:
                function = FunctionDefinition.model_validate(spec)
            except ValidationError as exc:
                error = exc.errors()[0]
                field = ".".join(str(p) for p in error["loc"])
                raise invalid_request(f"Invalid `{where}.{field}`: {error['msg']}.", f"{where}.{field}") from None
            tools.append(Tool(type="function", function=function))
        try:
            check_tools(tools)
            check_tool_choice(tools, self.chat_tool_choice())
        except APIError as exc:
            raise _renamed(exc) from None
        return tools

    def chat_tool_choice(self) -> Any:
        """``tool_choice`` as the chat endpoint's: "none", "auto", "required" or a named function."""
        choice = self.tool_choice
        if choice is None or choice in ("none", "auto", "required"):
            return choice
        if isinstance(choice, str):
            raise invalid_request(
                f"`tool_choice` must be 'none', 'auto', 'required' or a function, got {choice!r}.", "tool_choice"
            )
        if choice.get("type") != "function":
            raise unsupported("tool_choice", f"type {choice.get('type')!r}; name a function or use 'auto'/'required'")
        name = choice.get("name")
        if not isinstance(name, str):
            raise invalid_request("`tool_choice.name` must name a function in `tools`.", "tool_choice.name")
        return NamedToolChoice(type="function", function=FunctionName(name=name))

    def template_kwargs(self) -> dict[str, Any] | None:
        """Chat-template variables: ``chat_template_kwargs``, and ``reasoning.effort`` as
        ``reasoning_effort`` (the variable gpt-oss's template reads; others ignore it)."""
        kwargs = dict(self.chat_template_kwargs or {})
        effort = (self.reasoning or {}).get("effort")
        if effort is not None:
            kwargs.setdefault("reasoning_effort", effort)
        return kwargs or None

    def structured_output(self) -> tuple[StructuredOutput | None, str]:
        """``text.format`` (or one of vLLM's guided fields: at most one constraint)."""
        constraint, source = super().structured_output()
        fmt = self._text_format()
        if fmt is None:
            return constraint, source
        if constraint is not None:
            raise invalid_request(f"Give at most one output constraint; this request has `text.format` and `{source}`.", source)
        return fmt, "text.format"

    def _text_format(self) -> StructuredOutput | None:
        fmt = (self.text or {}).get("format")
        if fmt is None:
            return None
        if not isinstance(fmt, dict):
            raise invalid_request("`text.format` must be an object such as {\"type\": \"text\"}.", "text.format")
        return output_format(
            fmt.get("type", "text"),
            fmt.get("schema"),
            "text.format.schema",
            ("text.format.type", "text.format.schema", "text.format.schema"),
            '{"type": "json_schema", "name": "...", "schema": {...}}',
        )

    def text_config(self) -> dict[str, Any]:
        """``text`` as the response echoes it."""
        fmt = (self.text or {}).get("format") or {"type": "text"}
        return {"format": fmt, "verbosity": (self.text or {}).get("verbosity", "medium")}


def _renamed(exc: APIError) -> APIError:
    """A chat-side error about a tool, with the parameter named as Responses spells it
    (``tools[0].parameters``, not ``tools[0].function.parameters``)."""
    if exc.param and ".function." in exc.param:
        param = exc.param.replace(".function.", ".")
        return APIError(exc.status_code, exc.message.replace(exc.param, param), param=param, code=exc.code)
    return exc


def input_messages(items: str | list[Any]) -> list[ChatMessage]:
    """``input`` as chat messages, in order (instructions not included)."""
    if isinstance(items, str):
        return [ChatMessage(role="user", content=items)]
    if not items:
        raise invalid_request("`input` must not be an empty list.", "input")
    messages: list[ChatMessage] = []
    names: dict[str, str] = {}  # call_id -> the function called, for the tool message answering it
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise invalid_request(f"`{where}` must be an object (a message or an item).", where)
        if "id" in item and not isinstance(item["id"], str):  # listed back by GET .../input_items
            raise invalid_request(f"`{where}.id` must be a string.", f"{where}.id")
        kind = item.get("type", "message")
        if kind == "message":
            messages.append(_message(item, where))
        elif kind == "function_call":
            call_id, name, arguments = (_string(item, key, where) for key in ("call_id", "name", "arguments"))
            names[call_id] = name
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
            last = messages[-1] if messages else None
            if last is not None and last.role == "assistant":  # one turn: its text, then its calls
                calls = [c.model_dump() for c in last.tool_calls or []]
                messages[-1] = ChatMessage.model_validate({**last.model_dump(), "tool_calls": [*calls, call]})
            else:
                messages.append(ChatMessage.model_validate({"role": "assistant", "content": None, "tool_calls": [call]}))
        elif kind == "function_call_output":
            call_id = _string(item, "call_id", where)
            output = item.get("output")
            text = output if isinstance(output, str) else _parts_text(output, f"{where}.output")
            message: dict[str, Any] = {"role": "tool", "content": text, "tool_call_id": call_id}
            if call_id in names:
                message["name"] = names[call_id]
            messages.append(ChatMessage.model_validate(message))
        elif kind == "reasoning":
            continue  # earlier turns' thinking: chat templates leave it out of the prompt
        else:
            raise unsupported(f"{where}.type", f"input item type {kind!r} (messages, function_call and function_call_output are served)")
    if not messages:
        raise invalid_request("`input` holds no message, function call or call output (reasoning items are left out).", "input")
    return messages


def _message(item: dict[str, Any], where: str) -> ChatMessage:
    role = item.get("role")
    if role not in _ROLES:
        raise invalid_request(f"`{where}.role` must be one of {', '.join(_ROLES)}; got {role!r}.", f"{where}.role")
    content = item.get("content")
    text = content if isinstance(content, str) else _parts_text(content, f"{where}.content")
    return ChatMessage(role=role, content=text)


def _parts_text(parts: Any, where: str) -> str:
    """The text of a content list (text parts only: images, files and audio are refused)."""
    if not isinstance(parts, list):
        raise invalid_request(f"`{where}` must be a string or a list of content parts.", where)
    texts = []
    for j, part in enumerate(parts):
        if not isinstance(part, dict):
            raise invalid_request(f"`{where}[{j}]` must be an object.", f"{where}[{j}]")
        kind = part.get("type")
        if kind == "refusal":
            texts.append(_string(part, "refusal", f"{where}[{j}]"))
        elif kind in _TEXT_PARTS:
            texts.append(_string(part, "text", f"{where}[{j}]"))
        else:
            raise unsupported(f"{where}[{j}].type", f"content part type {kind!r} (text only)")
    return "".join(texts)


def _string(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if isinstance(value, dict) and key == "arguments":  # some clients send the object itself
        return json.dumps(value, ensure_ascii=False)
    if not isinstance(value, str):
        raise invalid_request(f"`{where}.{key}` is required (a string).", f"{where}.{key}", "missing_required_parameter")
    return value
