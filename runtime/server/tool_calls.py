"""Tool calling on /v1/chat/completions, the request side: the ``tools`` and ``tool_choice``
models, which call format the model speaks, and the grammar that forces a call.

Two call formats are supported, named after the families that use them:

- ``hermes``: each call is ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``,
  calls separated by a newline, text allowed around them (Qwen2.5, Qwen3, Hermes, SmolLM3 and
  many fine-tunes);
- ``llama3_json``: the whole answer is ``{"name": ..., "parameters": {...}}``, optionally after
  ``<|python_tag|>``, several calls separated by ``; `` (Llama 3.1, 3.2, 3.3).

The format is read off the chat template (``tool_format``): a template that writes
``<tool_call>`` is hermes; one with Llama's ``<|python_tag|>`` or ``ipython`` role is
llama3_json; any other template falls back to hermes, the most widely trained format (its
markers also make it the one least likely to be mistaken for an ordinary answer).

``tool_choice: "required"`` and a named function are enforced by a grammar in the call format
(``call_grammar``), so the model can only write well-formed calls whose arguments match the
function's ``parameters`` schema; ``"auto"`` generates freely and the output is parsed
(runtime/server/tool_parsers.py).
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import field_validator

from pagecast.runtime.sampling_params import StructuredOutput
from pagecast.runtime.server.errors import APIError, invalid_request
from pagecast.runtime.server.limits import RequestModel

HERMES = "hermes"
LLAMA3_JSON = "llama3_json"
TOOL_FORMATS = (HERMES, LLAMA3_JSON)

# OpenAI's rule for function names.
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


class FunctionDefinition(RequestModel):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; none: the function takes no arguments
    strict: bool | None = None  # the grammar is always strict where it applies

    @field_validator("name")
    @classmethod
    def _check_name(cls, value: str) -> str:
        if not _NAME.match(value):
            raise ValueError("must be 1 to 64 letters, digits, underscores or dashes")
        return value


class Tool(RequestModel):
    """One entry of ``tools``: only function tools exist in the chat API."""

    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(RequestModel):
    name: str


class NamedToolChoice(RequestModel):
    """``tool_choice: {"type": "function", "function": {"name": ...}}``."""

    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class FunctionCall(RequestModel):
    name: str
    # A JSON string in OpenAI's API; an object is accepted too (some clients send one).
    arguments: str | dict[str, Any]


class MessageToolCall(RequestModel):
    """An earlier call in an assistant message of the conversation."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


def check_tools(tools: list[Tool]) -> None:
    """Names are unique and every ``parameters`` is a schema the grammar library compiles (400
    naming the tool otherwise), whatever ``tool_choice`` says: a function the server could not
    constrain is refused when it is declared, not when it is first forced."""
    from pagecast.runtime.structured_output import check_json_schema

    seen: set[str] = set()
    for i, tool in enumerate(tools):
        name = tool.function.name
        if name in seen:
            raise invalid_request(f"Duplicate function name `{name}` in `tools`.", f"tools[{i}].function.name")
        seen.add(name)
        parameters = tool.function.parameters
        if parameters is None:
            continue
        try:
            check_json_schema(json.dumps(parameters, sort_keys=True, separators=(",", ":")))
        except ValueError as exc:
            reason = str(exc).removeprefix("structured_output ")
            raise invalid_request(
                f"Invalid schema for function `{name}`: {reason}",
                f"tools[{i}].function.parameters",
                code="invalid_function_parameters",
            ) from None


def check_tool_choice(tools: list[Tool] | None, tool_choice: Any) -> None:
    """``required`` and a named function need ``tools``; the name must be one of them."""
    if tool_choice is None or tool_choice in ("none", "auto"):
        return
    if not tools:
        raise invalid_request("`tool_choice` other than `none` or `auto` requires `tools`.", "tool_choice")
    if isinstance(tool_choice, NamedToolChoice):
        names = [t.function.name for t in tools]
        if tool_choice.function.name not in names:
            raise invalid_request(
                f"`tool_choice` names the function `{tool_choice.function.name}`, which is not in `tools` "
                f"({', '.join(names)}).",
                "tool_choice",
            )


def tool_format(chat_template: Any) -> str:
    """The call format of a chat template (see the module's docstring for the rule)."""
    if isinstance(chat_template, dict):  # named templates: transformers uses "tool_use" for tools
        chat_template = chat_template.get("tool_use") or chat_template.get("default") or ""
    text = chat_template if isinstance(chat_template, str) else ""
    if "<tool_call>" in text:
        return HERMES
    if "<|python_tag|>" in text or "ipython" in text:
        return LLAMA3_JSON
    return HERMES


@dataclass(frozen=True)
class ToolPlan:
    """What ``tools``/``tool_choice`` do to one chat request; None of it when there are no tools
    or ``tool_choice`` is ``none``."""

    tools: list[dict[str, Any]]  # passed to the chat template (``apply_chat_template(tools=...)``)
    format: str  # HERMES or LLAMA3_JSON: how the output is parsed (and the grammar, if any)
    max_calls: int | None  # 1 when parallel_tool_calls is false or a function is named
    # The grammar that forces a call (tool_choice required or named), else None.
    structured_output: StructuredOutput | None


def plan_tools(
    tools: list[Tool] | None, tool_choice: Any, parallel_tool_calls: bool | None, chat_template: Any
) -> ToolPlan | None:
    if not tools or tool_choice == "none":
        return None
    fmt = tool_format(chat_template)
    named = tool_choice.function.name if isinstance(tool_choice, NamedToolChoice) else None
    single = named is not None or parallel_tool_calls is False
    structured = None
    if named is not None or tool_choice == "required":
        forced = [t for t in tools if named is None or t.function.name == named]
        specs = json.dumps(
            [[t.function.name, t.function.parameters or _NO_PARAMETERS] for t in forced],
            sort_keys=True,
            separators=(",", ":"),
        )
        structured = StructuredOutput("grammar", grammar=call_grammar(fmt, specs, not single))
    return ToolPlan(
        tools=[t.model_dump(exclude_none=True) for t in tools],
        format=fmt,
        max_calls=1 if single else None,
        structured_output=structured,
    )


@functools.lru_cache(maxsize=128)
def call_grammar(fmt: str, specs: str, parallel: bool) -> str:
    """EBNF text of the grammar that admits only calls in format ``fmt`` of the functions in
    ``specs`` (JSON ``[[name, parameters schema], ...]``): one call, or one or more when
    ``parallel``. The JSON is compact with OpenAI's separators (``", "``, ``": "``), the form
    both families are trained on, and no free whitespace, so a call cannot stall on blanks.
    Cached: one build per distinct set of tools."""
    import xgrammar

    from pagecast.runtime.structured_output import json_schema_ebnf

    key = "arguments" if fmt == HERMES else "parameters"
    calls = [
        {
            "type": "object",
            "properties": {"name": {"const": name}, key: parameters},
            "required": ["name", key],
            "additionalProperties": False,
        }
        for name, parameters in json.loads(specs)
    ]
    schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
    try:
        call = json_schema_ebnf(json.dumps(schema))
    except Exception as exc:  # noqa: BLE001 - every schema problem is a RuntimeError there
        raise APIError(400, f"The tools' schemas cannot be combined into a grammar: {exc}", param="tools") from None
    content = {"type": "grammar", "grammar": call}
    if fmt == HERMES:
        fmt_tag: dict[str, Any] = {
            "type": "tags_with_separator",
            "tags": [{"type": "tag", "begin": "<tool_call>\n", "content": content, "end": "\n</tool_call>"}],
            "separator": "\n",
            "at_least_one": True,
            "stop_after_first": not parallel,
        }
    else:
        more = {"type": "sequence", "elements": [{"type": "const_string", "value": "; "}, content]}
        fmt_tag = {"type": "sequence", "elements": [content, {"type": "star", "content": more}]} if parallel else content
    tag = {"type": "structural_tag", "format": fmt_tag}
    return str(xgrammar.Grammar.from_structural_tag(json.dumps(tag)))


def template_tool_calls(calls: list[MessageToolCall]) -> list[dict[str, Any]]:
    """An assistant message's ``tool_calls`` as chat templates read them: templates write
    ``arguments | tojson``, so JSON arguments are passed as the object they encode (as
    transformers documents); arguments that are not a JSON object stay the string sent."""
    out = []
    for call in calls:
        arguments: Any = call.function.arguments
        if isinstance(arguments, str):
            try:
                decoded = json.loads(arguments)
            except ValueError:
                decoded = None
            if isinstance(decoded, dict):
                arguments = decoded
        out.append({"id": call.id, "type": "function", "function": {"name": call.function.name, "arguments": arguments}})
    return out
