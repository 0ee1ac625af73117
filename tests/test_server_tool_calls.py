"""Tool calling and vLLM's guided_* / structured_outputs fields through the server, driven by the
official openai SDK, on a tiny random Llama with the SmolLM2 tokenizer. Its own chat template has
no tool format, so the tests give it one of each family (tests/fixtures/chat_templates): the call
format is read off the template per request, so one server serves both.

A random model would never call a tool of its own accord; forced calls (``tool_choice``
``required`` or a named function) go through the grammar, and ``auto`` is exercised by forcing
the text of a call with ``guided_choice``, so its parsing is what is under test."""

from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest
from server_support import make_engine, serve

MODEL = "tiny"
TEMPLATES = Path(__file__).parent / "fixtures" / "chat_templates"
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]

# Small on purpose (the tools are written into every prompt): an enum, a bounded integer, a
# string with a pattern and a short array.
WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Oslo"]}, "days": {"type": "integer", "minimum": 1, "maximum": 5}},
    "required": ["city", "days"],
}
TIME_PARAMETERS = {
    "type": "object",
    "properties": {
        "zone": {"type": "string", "pattern": "^[A-Z]{3}$"},
        "offsets": {"type": "array", "items": {"type": "integer", "minimum": -9, "maximum": 9}, "maxItems": 2},
    },
    "required": ["zone", "offsets"],
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Forecast.", "parameters": WEATHER_PARAMETERS}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME_PARAMETERS}},
]
SCHEMAS = {"get_weather": WEATHER_PARAMETERS, "get_time": TIME_PARAMETERS}


@pytest.fixture(scope="module")
def server(tiny_llama_artifact):  # type: ignore[no-untyped-def]
    engine = make_engine(tiny_llama_artifact, max_num_seqs=4)
    with serve({MODEL: engine}) as srv:
        srv.engine = engine  # type: ignore[attr-defined]
        yield srv


@pytest.fixture(scope="module")
def client(server):  # type: ignore[no-untyped-def]
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


@contextmanager
def chat_template(server, name: str):  # type: ignore[no-untyped-def]
    """The served model's chat template replaced by tests/fixtures/chat_templates/``name``."""
    tokenizer = server.engine.tokenizer
    original = tokenizer.chat_template
    tokenizer.chat_template = (TEMPLATES / name).read_text()
    try:
        yield name
    finally:
        tokenizer.chat_template = original


@pytest.fixture(params=["hermes_tools.jinja", "llama3_tools.jinja"])
def family(request, server):  # type: ignore[no-untyped-def]
    """One family's chat template at a time."""
    with chat_template(server, request.param):
        yield request.param


def check_calls(calls, allowed: set[str]) -> None:  # type: ignore[no-untyped-def]
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in allowed
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def stream_calls(stream) -> tuple[str, list[tuple[str, str]], str | None]:  # type: ignore[no-untyped-def]
    """(content, [(name, arguments)], finish_reason) assembled from a stream's deltas."""
    content, calls, finish = "", {}, None
    for chunk in stream:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for call in choice.delta.tool_calls or []:
                if call.id is not None:
                    assert call.index not in calls and call.type == "function" and call.function.arguments == ""
                    calls[call.index] = [call.function.name, ""]
                else:
                    assert call.function.name is None
                    calls[call.index][1] += call.function.arguments
            finish = choice.finish_reason or finish
    return content, [(name, args) for name, args in calls.values()], finish


def test_a_named_function_is_called_with_valid_arguments_streamed_and_not(client, family):  # type: ignore[no-untyped-def]
    named = {"type": "function", "function": {"name": "get_weather"}}
    kwargs = {"model": MODEL, "messages": MESSAGES, "tools": TOOLS, "tool_choice": named, "max_tokens": 60, "temperature": 0}
    choice = client.chat.completions.create(**kwargs).choices[0]
    assert choice.finish_reason == "tool_calls"
    check_calls(choice.message.tool_calls, {"get_weather"})
    assert len(choice.message.tool_calls) == 1 and choice.message.content is None
    content, calls, finish = stream_calls(client.chat.completions.create(**kwargs, stream=True))
    assert finish == "tool_calls" and content == ""
    assert calls == [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]


def test_required_calls_one_of_the_tools(client, family):  # type: ignore[no-untyped-def]
    resp = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
        max_tokens=60, temperature=0.9, seed=4, n=2,
    )
    for choice in resp.choices:
        assert choice.finish_reason == "tool_calls"
        check_calls(choice.message.tool_calls, {"get_weather", "get_time"})
        assert len(choice.message.tool_calls) == 1
    # Parallel calls allowed: every complete call validates (the model may stop or run out).
    choice = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="required", max_tokens=60, temperature=0
    ).choices[0]
    calls = choice.message.tool_calls
    assert calls
    if choice.finish_reason == "length":
        calls = calls[:-1]
    else:
        assert choice.finish_reason == "tool_calls"
    for call in calls:
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


# What a model calling a tool writes (the llama3_json family's parsing is covered on literal
# strings in test_tool_calls.py; here the whole path through the server, once).
CALL_TEXT = 'Checking.\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>'


def test_auto_parses_a_call_the_model_writes(client):  # type: ignore[no-untyped-def]
    # The model's own template (SmolLM2's) has no tool format: the hermes fallback applies.
    kwargs = {"model": MODEL, "messages": MESSAGES, "tools": TOOLS, "max_tokens": 60, "temperature": 0, "extra_body": {"guided_choice": [CALL_TEXT]}}
    choice = client.chat.completions.create(**kwargs).choices[0]
    message = choice.message
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == [("get_time", {"zone": "CET"})]
    assert message.content == "Checking." and choice.finish_reason == "tool_calls"
    content, calls, finish = stream_calls(client.chat.completions.create(**kwargs, stream=True))
    assert (content, finish) == ("Checking.", "tool_calls")
    assert calls == [(c.function.name, c.function.arguments) for c in message.tool_calls]
    # tool_choice none: the same text is an ordinary answer.
    plain = client.chat.completions.create(**kwargs, tool_choice="none").choices[0]
    assert plain.message.content == CALL_TEXT and not plain.message.tool_calls and plain.finish_reason == "stop"


def test_a_conversation_with_calls_and_results_is_answered(client, server):  # type: ignore[no-untyped-def]
    messages = [
        *MESSAGES,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'}}],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 C."},
    ]
    with chat_template(server, "hermes_tools.jinja"):
        choice = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=4, temperature=0).choices[0]
        ids = httpx.post(f"{server.url}/tokenize", json={"model": MODEL, "messages": messages, "tools": TOOLS}).json()["tokens"]
    assert choice.finish_reason in ("length", "stop", "tool_calls")
    # What the template made of it (/tokenize renders as chat does): the tools, the call, the result.
    prompt = server.engine.tokenizer.decode(ids)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>' in prompt
    assert "<tool_response>\nSunny, 21 C.\n</tool_response>" in prompt and '"name": "get_time"' in prompt


@pytest.mark.parametrize(
    "extra, param, says",
    [
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "strin"}}}]}, "tools[0].function.parameters", "Unsupported type"),
        ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools[0].type", "function"),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name", "letters"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}, {"type": "function", "function": {"name": "f"}}]}, "tools[1].function.name", "Duplicate"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "`nope`"),
        ({"tool_choice": "required"}, "tool_choice", "requires `tools`"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", ""),
        (
            {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
            "response_format",
            "cannot be combined",
        ),
    ],
)
def test_bad_tools_are_a_400_naming_the_field(client, extra, param, says):  # type: ignore[no-untyped-def]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, extra_body=extra)
    error = info.value.body
    assert info.value.status_code == 400 and error["param"] == param, error
    assert says in error["message"]


def test_a_tool_message_needs_its_call_id(client):  # type: ignore[no-untyped-def]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=[*MESSAGES, {"role": "tool", "content": "x"}], max_tokens=4)
    assert info.value.body["param"] == "messages[1].tool_call_id"


@pytest.mark.parametrize(
    "extra, check",
    [
        ({"guided_regex": "(yes|no), [0-9]{2}"}, lambda t: __import__("re").fullmatch(r"(yes|no), [0-9]{2}", t)),
        ({"guided_choice": ["red", "green", "blue"]}, lambda t: t in ("red", "green", "blue")),
        ({"guided_grammar": 'root ::= "x=" [0-9] [0-9]?'}, lambda t: __import__("re").fullmatch(r"x=[0-9][0-9]?", t)),
        ({"structured_outputs": {"regex": "[a-c]{3}"}}, lambda t: __import__("re").fullmatch(r"[a-c]{3}", t)),
        ({"structured_outputs": {"choice": ["up", "down"]}}, lambda t: t in ("up", "down")),
    ],
)
def test_vllm_guided_fields_constrain_chat_and_completions(client, extra, check):  # type: ignore[no-untyped-def]
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=20, temperature=0.8, seed=2, extra_body=extra)
    assert chat.choices[0].finish_reason == "stop" and check(chat.choices[0].message.content)
    text = client.completions.create(model=MODEL, prompt="Answer:", max_tokens=20, temperature=0, extra_body=extra).choices[0]
    assert text.finish_reason == "stop" and check(text.text)


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"guided_regex": "a["}, "guided_regex"),
        ({"guided_grammar": "root ::= undefined_rule"}, "guided_grammar"),
        ({"guided_choice": []}, "guided_choice"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
        ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex"),
    ],
)
def test_bad_guided_fields_are_a_400(client, extra, param):  # type: ignore[no-untyped-def]
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="x", max_tokens=4, extra_body=extra)
    assert info.value.body["param"] == param, info.value.body
