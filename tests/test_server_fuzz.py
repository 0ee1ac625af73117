"""Property-based fuzzing of the request schema (issue 11): whatever JSON a client sends to
/v1/completions or /v1/chat/completions, the answer is never a 5xx, every error is
OpenAI-shaped with a code, and every success is a complete response (a stream ends with
``data: [DONE]``). Small engine and few examples, so it stays quick in CI."""

from __future__ import annotations

import json
import math
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from server_support import make_engine, metric, metric_samples, serve, wait_for

MODEL = "tiny"

# Any JSON value, NaN and infinities included (Python's json writes them as NaN/Infinity,
# which lenient parsers accept).
json_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
)
json_values = st.recursive(
    json_scalars,
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=12,
)

small_ints = st.integers(min_value=-2, max_value=6)
floats = st.one_of(
    st.floats(min_value=-3, max_value=3), st.sampled_from([math.nan, math.inf, -math.inf, 0.0, 1.0])
)
token_ids = st.lists(st.integers(min_value=-1, max_value=60000), min_size=0, max_size=6)
prompts = st.one_of(
    st.text(max_size=40),
    st.lists(st.text(max_size=20), max_size=5),
    token_ids,
    st.lists(token_ids, max_size=5),
    json_values,
)
messages = st.one_of(
    st.lists(
        st.fixed_dictionaries(
            {
                "role": st.sampled_from(["system", "developer", "user", "assistant", "tool", "wizard"]),
                "content": st.one_of(
                    st.text(max_size=30),
                    st.none(),
                    st.lists(
                        st.fixed_dictionaries(
                            {"type": st.sampled_from(["text", "image_url"]), "text": st.text(max_size=10)}
                        ),
                        max_size=2,
                    ),
                    json_values,
                ),
            }
        ),
        max_size=4,
    ),
    json_values,
)
stops = st.one_of(st.text(max_size=4), st.lists(st.text(max_size=4), max_size=3), json_values)
stream_options = st.one_of(
    st.fixed_dictionaries(
        {}, optional={"include_usage": st.booleans(), "continuous_usage_stats": st.booleans()}
    ),
    json_values,
)


def maybe(strategy: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Mostly a plausible value, sometimes any JSON at all."""
    return st.one_of(strategy, strategy, strategy, json_values)


COMMON = {
    "model": maybe(st.sampled_from([MODEL, "other"])),
    "n": maybe(st.integers(min_value=-1, max_value=20)),
    "temperature": maybe(floats),
    "top_p": maybe(floats),
    "top_k": maybe(small_ints),
    "min_p": maybe(floats),
    "seed": maybe(st.integers(min_value=-(2**40), max_value=2**40)),
    "presence_penalty": maybe(floats),
    "frequency_penalty": maybe(floats),
    "repetition_penalty": maybe(floats),
    "stop": maybe(stops),
    "stop_token_ids": maybe(token_ids),
    "ignore_eos": maybe(st.booleans()),
    "min_tokens": maybe(small_ints),
    "include_stop_str_in_output": maybe(st.booleans()),
    "skip_special_tokens": maybe(st.booleans()),
    "stream": maybe(st.booleans()),
    "stream_options": maybe(stream_options),
    "user": maybe(st.text(max_size=5)),
    "return_token_ids": maybe(st.booleans()),
    "logit_bias": maybe(st.dictionaries(st.text(max_size=3), floats, max_size=2)),
}
completion_bodies = st.fixed_dictionaries(
    {"prompt": prompts},
    optional={
        **COMMON,
        "max_tokens": maybe(small_ints),
        "echo": maybe(st.booleans()),
        "logprobs": maybe(small_ints),
        "suffix": maybe(st.text(max_size=3)),
        "best_of": maybe(small_ints),
    },
)
chat_bodies = st.fixed_dictionaries(
    {"messages": messages},
    optional={
        **COMMON,
        "max_tokens": maybe(small_ints),
        "max_completion_tokens": maybe(small_ints),
        "logprobs": maybe(st.booleans()),
        "top_logprobs": maybe(small_ints),
        "add_generation_prompt": maybe(st.booleans()),
        "continue_final_message": maybe(st.booleans()),
        "chat_template_kwargs": maybe(st.dictionaries(st.text(max_size=8), json_values, max_size=2)),
        "tools": maybe(st.lists(json_values, max_size=1)),
        "tool_choice": json_values,
        "response_format": maybe(st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object"])})),
    },
)
# Now and then the body is not a request object at all.
raw_bodies = st.one_of(json_values.map(lambda v: json.dumps(v).encode()), st.binary(max_size=40))


@pytest.fixture(scope="module")
def server(tiny_llama_artifact):  # type: ignore[no-untyped-def]
    engine = make_engine(tiny_llama_artifact, max_num_seqs=4, max_model_len=128)
    with serve({MODEL: engine}, max_queue=12) as srv:
        yield srv
    # Not leaked: every fuzzed request gave its blocks back.


def check_answer(r: httpx.Response, stream_lines: list[str] | None) -> None:
    assert r.status_code < 500, r.text if stream_lines is None else stream_lines
    if r.status_code >= 400:
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}
        assert isinstance(err["message"], str) and err["message"]
        assert isinstance(err["code"], str) and err["code"], err
        return
    assert r.status_code == 200
    if stream_lines is not None:
        assert stream_lines[-1] == "data: [DONE]"
        for line in stream_lines[:-1]:
            payload = json.loads(line[len("data: ") :])
            assert "error" not in payload, payload
    else:
        assert r.json()["choices"]


def send(server, path: str, content: bytes) -> None:  # type: ignore[no-untyped-def]
    headers = {"Content-Type": "application/json"}
    with httpx.stream("POST", f"{server.url}{path}", content=content, headers=headers, timeout=60) as r:
        if r.headers.get("content-type", "").startswith("text/event-stream"):
            check_answer(r, [line for line in r.iter_lines() if line])
        else:
            r.read()
            check_answer(r, None)


FUZZ = settings(
    max_examples=40,
    deadline=None,
    database=None,  # writes nothing into the repository
    suppress_health_check=[
        HealthCheck.function_scoped_fixture,
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
    ],
)


@FUZZ
@given(body=completion_bodies)
def test_fuzz_completions(server, body):  # type: ignore[no-untyped-def]
    send(server, "/v1/completions", json.dumps(body).encode())


@FUZZ
@given(body=chat_bodies)
def test_fuzz_chat_completions(server, body):  # type: ignore[no-untyped-def]
    send(server, "/v1/chat/completions", json.dumps(body).encode())


@settings(FUZZ, max_examples=20)
@given(content=raw_bodies, path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]))
def test_fuzz_raw_bodies(server, content, path):  # type: ignore[no-untyped-def]
    send(server, path, content)


def test_fuzzing_left_no_blocks_in_use(server):  # type: ignore[no-untyped-def]
    wait_for(
        lambda: metric(metric_samples(server.url), "pagecast_kv_cache_blocks_used", model_name=MODEL) == 0,
        timeout=30,
    )
    assert metric(metric_samples(server.url), "pagecast_server_sequences_in_flight", model_name=MODEL) == 0
