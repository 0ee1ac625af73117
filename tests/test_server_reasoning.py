"""engine-serve --reasoning-parser: a thinking model's <think> text as ``reasoning_content`` beside
the answer, unstreamed and streamed, through the openai SDK. The tiny random model is made to
write a think block by a regex constraint, so its output has the shape a thinking model's has."""

from __future__ import annotations

from typing import Any

import openai
import pytest
from server_support import make_engine, serve

from pagecast.runtime.server.reasoning import split_reasoning

THINK = r"<think>\n[a-z]{3,12}( [a-z]{2,8}){0,3}\n</think>\n\n[A-Z][a-z]{2,10}( [a-z]{2,8}){1,3}\."
MESSAGES = [{"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def server(tiny_llama_artifact):  # type: ignore[no-untyped-def]
    engine = make_engine(tiny_llama_artifact)
    with serve({"tiny": engine}, reasoning_parser="qwen3") as running:
        yield running


@pytest.fixture(scope="module")
def client(server):  # type: ignore[no-untyped-def]
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)


def _ask(client: openai.OpenAI, regex: str, **kwargs: Any) -> Any:
    return client.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        max_tokens=60,
        temperature=0,
        extra_body={"structured_outputs": {"regex": regex}, "return_token_ids": True},
        **kwargs,
    )


def test_reasoning_is_reported_apart_from_the_answer(client, server) -> None:  # type: ignore[no-untyped-def]
    reply = _ask(client, THINK)
    choice = reply.choices[0]
    tokenizer = server.server.config.app.state.server.models["tiny"].engine.tokenizer
    raw = tokenizer.decode(choice.model_extra["token_ids"], skip_special_tokens=True)
    assert raw.startswith("<think>\n") and "\n</think>\n\n" in raw  # what the model wrote
    reasoning, content = split_reasoning(raw, "qwen3")
    assert reasoning and content
    assert choice.message.model_extra["reasoning_content"] == reasoning
    assert choice.message.content == content
    assert "<think>" not in content and "</think>" not in reasoning


def test_streamed_reasoning_and_answer_add_up_to_the_unstreamed_reply(client) -> None:  # type: ignore[no-untyped-def]
    whole = _ask(client, THINK).choices[0].message
    chunks = list(_ask(client, THINK, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    reasoning = "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas)
    content = "".join(d.content or "" for d in deltas)
    assert reasoning == whole.model_extra["reasoning_content"]
    assert content == whole.content
    first_content = next(i for i, d in enumerate(deltas) if d.content)
    assert all(not (d.model_extra or {}).get("reasoning_content") for d in deltas[first_content:])


def test_an_answer_without_a_think_block_is_all_content(client) -> None:  # type: ignore[no-untyped-def]
    message = _ask(client, r"[A-Z][a-z]{2,10}( [a-z]{2,8}){1,3}\.").choices[0].message
    assert message.content and message.model_extra["reasoning_content"] is None


def test_tool_calls_are_read_from_the_answer_after_the_reasoning(client) -> None:  # type: ignore[no-untyped-def]
    tools = [{"type": "function", "function": {"name": "paint", "parameters": {"type": "object"}}}]
    regex = r'<think>\n[a-z]{3,12}\n</think>\n\n<tool_call>\n\{"name": "paint", "arguments": \{\}\}\n</tool_call>'
    for stream in (False, True):
        reply = _ask(client, regex, tools=tools, stream=stream)
        if stream:
            deltas = [c.choices[0].delta for c in reply if c.choices]
            reasoning = "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas)
            calls = [call for d in deltas for call in d.tool_calls or []]
            assert reasoning and [c.function.name for c in calls if c.function.name] == ["paint"]
            assert not "".join(d.content or "" for d in deltas)
        else:
            message = reply.choices[0].message
            assert message.model_extra["reasoning_content"] and message.content is None
            assert [c.function.name for c in message.tool_calls] == ["paint"]
            assert reply.choices[0].finish_reason == "tool_calls"


def test_an_unknown_reasoning_parser_is_refused() -> None:
    from pagecast.runtime.server.app import create_app

    with pytest.raises(ValueError, match="unknown reasoning parser 'r1'; choose from deepseek_r1, qwen3"):
        create_app({"tiny": object()}, reasoning_parser="r1", manage_engines=False)
