"""Tool calling without a server: the call parsers on literal model outputs of both families
(whole and streamed character by character, which must agree), the call format read off chat
templates, the grammars that force a call (checked with xgrammar's matcher on literal strings),
and conversations with tool calls and tool results rendered through a chat template."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pagecast.runtime.server.tool_calls import (
    HERMES,
    LLAMA3_JSON,
    Tool,
    call_grammar,
    plan_tools,
    tool_format,
)
from pagecast.runtime.server.tool_parsers import ToolCallParser, parse_tool_calls

TEMPLATES = Path(__file__).parent / "fixtures" / "chat_templates"


def calls_of(text: str, fmt: str, max_calls: int | None = None) -> tuple[str | None, list[tuple[str, str]]]:
    content, calls = parse_tool_calls(text, fmt, max_calls)
    return content, [(c["function"]["name"], c["function"]["arguments"]) for c in calls]


def streamed(text: str, fmt: str, piece: int = 1) -> tuple[str | None, list[tuple[str, str]], list[dict]]:
    """The deltas of ``text`` fed ``piece`` characters at a time, assembled as a client would."""
    parser = ToolCallParser(fmt)
    deltas = []
    for i in range(0, len(text), piece):
        deltas += parser.feed(text[i : i + piece])
    deltas += parser.finish()
    content = "".join(d.get("content", "") for d in deltas) or None
    calls: dict[int, list[str]] = {}
    for d in deltas:
        for call in d.get("tool_calls", []):
            if "id" in call:
                assert call["type"] == "function" and call["function"]["arguments"] == ""
                assert call["index"] == len(calls) and call["id"].startswith("call_")
                calls[call["index"]] = [call["function"]["name"], ""]
            else:
                assert set(call) == {"index", "function"} and set(call["function"]) == {"arguments"}
                calls[call["index"]][1] += call["function"]["arguments"]
    return content, [(name, args) for name, args in calls.values()], deltas


HERMES_CASES = [
    # (output, content, calls)
    (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>',
        None,
        [("get_weather", '{"city": "Paris", "unit": "c"}')],
    ),
    (
        ('Let me look.\n<tool_call>\n{"name": "a", "arguments": {"x": [1, {"y": "}{"}]}}\n</tool_call>\n'
        '<tool_call>\n{"name": "b", "arguments": {}}\n</tool_call>'),
        "Let me look.",
        [("a", '{"x": [1, {"y": "}{"}]}'), ("b", "{}")],
    ),
    # Keys in another order: decoded whole, arguments re-encoded.
    ('<tool_call>\n{"arguments": {"q": "a</tool_call>b"}, "name": "s"}\n</tool_call>', None, [("s", '{"q": "a</tool_call>b"}')]),
    # Not a call: the text, markers and all, stays content.
    ("<tool_call>\nnot json\n</tool_call> done", "<tool_call>\nnot json\n</tool_call> done", []),
    ('<tool_call>\n{"city": "Paris"}\n</tool_call>', '<tool_call>\n{"city": "Paris"}\n</tool_call>', []),
    ("An ordinary answer with < and <tool and a trailing blank \n", "An ordinary answer with < and <tool and a trailing blank \n", []),
    # Cut short by max_tokens: the call keeps what was generated.
    ('<tool_call>\n{"name": "f", "arguments": {"text": "unfinish', None, [("f", '{"text": "unfinish')]),
    # Cut inside the closing marker: the part of the marker is not the model's answer.
    ('<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_c', None, [("f", '{"a": 1}')]),
    ('<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n<', None, [("f", '{"a": 1}')]),
    # ... but other text after an unclosed call is.
    ('<tool_call>\n{"name": "f", "arguments": {"a": 1}}\nDone.', "Done.", [("f", '{"a": 1}')]),
]

LLAMA_CASES = [
    ('{"name": "get_weather", "parameters": {"city": "Paris"}}', None, [("get_weather", '{"city": "Paris"}')]),
    (
        '<|python_tag|>{"type": "function", "name": "a", "parameters": {"s": "x;y"}}; {"name": "b", "parameters": {}}',
        None,
        [("a", '{"s": "x;y"}'), ("b", "{}")],
    ),
    ('\n{"parameters": {"n": 1}, "name": "a"}', None, [("a", '{"n": 1}')]),
    # JSON that is not a call, text before a brace, malformed JSON: content, as generated.
    ('{"answer": 42}', '{"answer": 42}', []),
    ('Sure: {"name": "a", "parameters": {}}', 'Sure: {"name": "a", "parameters": {}}', []),
    ('{"name": "a", "parameters": {"n": 1}', None, [("a", '{"n": 1}')]),  # outer brace cut off
    ('{"name": "a" "parameters"}', '{"name": "a" "parameters"}', []),
    ("Paris is sunny.", "Paris is sunny.", []),
]


@pytest.mark.parametrize("fmt, output, content, calls", [(HERMES, *c) for c in HERMES_CASES] + [(LLAMA3_JSON, *c) for c in LLAMA_CASES])
def test_outputs_parse_the_same_whole_and_streamed(fmt, output, content, calls):  # type: ignore[no-untyped-def]
    assert calls_of(output, fmt) == (content, calls)
    for piece in (1, 3, len(output)):
        got_content, got_calls, _ = streamed(output, fmt, piece)
        assert (got_content, got_calls) == (content, calls), piece
    for _, arguments in calls:
        if not arguments.endswith("unfinish"):
            json.loads(arguments)


def test_text_before_a_call_streams_before_the_call_is_decided():  # type: ignore[no-untyped-def]
    parser = ToolCallParser(HERMES)
    assert parser.feed("Checking the weather <tool") == [{"content": "Checking the weather"}]
    assert parser.feed("_call>\n{\"name\": \"get_") == []  # the header is not complete yet
    head = parser.feed('weather", "arguments": {"ci')
    assert head[0]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": ""}
    assert head[1] == {"tool_calls": [{"index": 0, "function": {"arguments": '{"ci'}}]}
    assert parser.feed('ty": "Paris"}}\n</tool_call>') == [{"tool_calls": [{"index": 0, "function": {"arguments": 'ty": "Paris"}'}}]}]
    assert parser.finish() == []
    assert parser.content == "Checking the weather"


def test_at_most_max_calls_are_reported():  # type: ignore[no-untyped-def]
    output = '{"name": "a", "parameters": {}}; {"name": "b", "parameters": {}}'
    assert calls_of(output, LLAMA3_JSON, max_calls=1) == (None, [("a", "{}")])


@pytest.mark.parametrize(
    "template, fmt",
    [
        ("hermes_tools.jinja", HERMES),
        ("llama3_tools.jinja", LLAMA3_JSON),
        (None, HERMES),  # no template: the documented fallback
    ],
)
def test_the_call_format_is_read_off_the_chat_template(template, fmt):  # type: ignore[no-untyped-def]
    text = (TEMPLATES / template).read_text() if template else None
    assert tool_format(text) == fmt
    assert tool_format({"default": "x", "tool_use": text or ""}) == fmt


WEATHER = Tool.model_validate(
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 8}, "days": {"type": "integer", "minimum": 1, "maximum": 3}},
                "required": ["city", "days"],
            },
        },
    }
)
CLOCK = Tool.model_validate({"type": "function", "function": {"name": "get_time"}})


@pytest.fixture(scope="module")
def compiler(smollm2_checkpoint):  # type: ignore[no-untyped-def]
    import xgrammar
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_checkpoint))
    info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer), stop_token_ids=[2])
    return xgrammar.GrammarCompiler(info)


def _accepts(grammar: str, text: str, compiler) -> bool:  # type: ignore[no-untyped-def]
    import xgrammar

    matcher = xgrammar.GrammarMatcher(compiler.compile_grammar(grammar))
    return bool(matcher.accept_string(text)) and bool(matcher.accept_token(2))  # complete, then the stop token


@pytest.mark.parametrize(
    "fmt, choice, parallel, text, ok",
    [
        (HERMES, "get_weather", False, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}\n</tool_call>', True),
        (HERMES, "get_weather", False, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 9}}\n</tool_call>', False),
        (HERMES, "get_weather", False, '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>', False),
        (HERMES, "required", True, '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", "days": 1}}\n</tool_call>', True),
        (HERMES, "required", False, '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>', False),
        (HERMES, "required", True, "I will not call anything.", False),
        (LLAMA3_JSON, "get_weather", False, '{"name": "get_weather", "parameters": {"city": "Oslo", "days": 3}}', True),
        (LLAMA3_JSON, "required", True, '{"name": "get_time", "parameters": {}}; {"name": "get_weather", "parameters": {"city": "A", "days": 1}}', True),
        (LLAMA3_JSON, "required", False, '{"name": "get_time", "parameters": {}}; {"name": "get_time", "parameters": {}}', False),
        (LLAMA3_JSON, "required", True, '{"name": "get_weather", "parameters": {"city": "Oslo"}}', False),  # days missing
    ],
)
def test_forced_calls_admit_only_calls_matching_the_schema(fmt, choice, parallel, text, ok, compiler):  # type: ignore[no-untyped-def]
    template = (TEMPLATES / ("hermes_tools.jinja" if fmt == HERMES else "llama3_tools.jinja")).read_text()
    tool_choice = choice if choice == "required" else {"type": "function", "function": {"name": choice}}
    from pagecast.runtime.server.tool_calls import NamedToolChoice

    if isinstance(tool_choice, dict):
        tool_choice = NamedToolChoice.model_validate(tool_choice)
    plan = plan_tools([WEATHER, CLOCK], tool_choice, parallel, template)
    assert plan is not None and plan.format == fmt and plan.structured_output is not None
    assert _accepts(plan.structured_output.grammar, text, compiler) == ok
    if ok:  # and what the grammar admits parses back into those calls
        content, calls = parse_tool_calls(text, fmt)
        assert content is None and len(calls) == text.count('"name"')


def test_auto_and_none_add_no_grammar():  # type: ignore[no-untyped-def]
    plan = plan_tools([WEATHER], "auto", None, None)
    assert plan is not None and plan.structured_output is None and plan.max_calls is None
    assert plan.tools[0]["function"]["name"] == "get_weather"
    assert plan_tools([WEATHER], "none", None, None) is None
    assert plan_tools([WEATHER], None, False, None).max_calls == 1  # type: ignore[union-attr]


def test_the_same_tools_build_their_grammar_once():  # type: ignore[no-untyped-def]
    call_grammar.cache_clear()
    for _ in range(3):
        plan_tools([WEATHER, CLOCK], "required", None, None)
    assert call_grammar.cache_info().misses == 1


@pytest.mark.parametrize("template, expected", [
    ("hermes_tools.jinja", ['<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>', "<tool_response>\n{\"temp\": 21}\n</tool_response>", '"name": "get_weather"']),
    ("llama3_tools.jinja", ['{"name": "get_weather", "parameters": {"city": "Paris"}}<|eom_id|>', "ipython<|end_header_id|>\n\n{\"temp\": 21}", '"name": "get_weather"']),
])
def test_tool_calls_and_tool_results_render_through_the_template(template, expected, smollm2_checkpoint):  # type: ignore[no-untyped-def]
    from transformers import AutoTokenizer

    from pagecast.runtime.server.chat import render_chat_prompt
    from pagecast.runtime.server.protocol import ChatMessage

    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_checkpoint))
    tokenizer.chat_template = (TEMPLATES / template).read_text()
    messages = [
        ChatMessage.model_validate(m)
        for m in [
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
        ]
    ]
    plan = plan_tools([WEATHER], "auto", None, tokenizer.chat_template)
    assert plan is not None
    text = tokenizer.decode(render_chat_prompt(tokenizer, messages, True, plan.tools))
    for piece in expected:
        assert piece in text, (piece, text)
