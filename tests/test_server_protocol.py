"""The server's pure parts, without a server: request parsing and its limits, error shapes,
SSE framing, JSON log lines."""

from __future__ import annotations

import json
import logging

import pytest

from pagecast.runtime.errors import EngineDeadError, InvalidRequestError
from pagecast.runtime.server import errors
from pagecast.runtime.server.errors import APIError
from pagecast.runtime.server.logs import JSONFormatter, log_request, request_logger
from pagecast.runtime.server.protocol import ChatCompletionRequest, CompletionRequest, parse_request
from pagecast.runtime.server.sse import DONE, sse_event


def parse(cls, body: dict):  # type: ignore[no-untyped-def]
    return parse_request(cls, json.dumps(body).encode())


def test_sse_framing_is_openais():
    assert sse_event({"a": 1, "b": [1, 2], "c": None}) == b'data: {"a":1,"b":[1,2],"c":null}\n\n'
    assert sse_event({"t": "é\n"}) == 'data: {"t":"é\\n"}\n\n'.encode()
    assert DONE == b"data: [DONE]\n\n"


@pytest.mark.parametrize(
    "prompt, want",
    [
        ("hi", ["hi"]),
        (["a", "b"], ["a", "b"]),
        ([1, 2, 3], [[1, 2, 3]]),
        ([[1, 2], [3]], [[1, 2], [3]]),
        ("", [""]),
        (list(range(3000)), [list(range(3000))]),  # one long prompt of ids is one prompt, not 3000
    ],
)
def test_prompt_forms_are_normalised(prompt, want):  # type: ignore[no-untyped-def]
    assert parse(CompletionRequest, {"prompt": prompt}).prompts == want


def test_sampling_params_from_a_completion_request():
    req = parse(
        CompletionRequest,
        {
            "prompt": "x",
            "temperature": 0,
            "top_k": -1,
            "stop": "END",
            "n": 2,
            "seed": 5,
            "echo": True,
            "logprobs": 2,
            "max_tokens": 7,
        },
    )
    params = req.to_sampling_params(req.max_tokens)
    assert (params.temperature, params.top_k, params.stop, params.n, params.seed) == (0.0, 0, ["END"], 2, 5)
    assert (params.logprobs, params.prompt_logprobs, params.max_tokens) == (2, 2, 7)
    # Unset fields take SamplingParams' own defaults.
    params = parse(CompletionRequest, {"prompt": "x"}).to_sampling_params(16)
    assert (params.temperature, params.top_p, params.repetition_penalty, params.logprobs) == (
        1.0,
        1.0,
        1.0,
        None,
    )


def test_chat_request_maps_logprobs_and_max_tokens():
    req = parse(
        ChatCompletionRequest,
        {
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
            ],
            "logprobs": True,
            "top_logprobs": 4,
            "max_tokens": 9,
            "max_completion_tokens": 5,
        },
    )
    assert req.messages[0].text(0) == "ab"
    assert req.requested_max_tokens == 5
    assert req.to_sampling_params(5).logprobs == 4
    assert (
        parse(ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}], "logprobs": True})
        .to_sampling_params(None)
        .logprobs
        == 0
    )


def test_unknown_fields_are_ignored_and_the_log_names_each_once(caplog):  # type: ignore[no-untyped-def]
    # A field this server does not know (a vLLM extension not implemented here, a misspelling)
    # changes nothing; the operator learns of it once, not on every request.
    with caplog.at_level(logging.WARNING, logger="pagecast.server"):
        req = parse(CompletionRequest, {"prompt": "x", "some_future_field": {"a": 1}, "user": "u1", "temprature": 0})
        again = parse(CompletionRequest, {"prompt": "x", "some_future_field": 2, "temprature": 0})
        chat = parse(ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}], "temprature": 0})
    assert req.user == "u1"
    assert req.to_sampling_params(4) == again.to_sampling_params(4) == parse(CompletionRequest, {"prompt": "x"}).to_sampling_params(4)
    assert chat.to_sampling_params(4).temperature == parse(
        ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}]}
    ).to_sampling_params(4).temperature
    named = [r.getMessage() for r in caplog.records if "ignored request field" in r.getMessage()]
    assert len(named) == 1 and "some_future_field" in named[0] and "temprature" in named[0]


def test_errors_name_the_param_as_the_client_spelled_it():
    with pytest.raises(APIError) as info:
        parse(
            ChatCompletionRequest,
            {"messages": [{"role": "user", "content": "x"}, {"role": "user", "content": 1}]},
        )
    assert info.value.param == "messages[1].content" and info.value.status_code == 400
    # SamplingParams' own check, renamed to the chat API's name.
    err = errors.from_sampling_value_error(
        ValueError("logprobs must be in [0, 20]"), {"logprobs": "top_logprobs"}
    )
    assert (err.param, err.status_code) == ("top_logprobs", 400)
    assert "must be in [0, 20]" in err.message


def test_engine_errors_map_to_statuses():
    e = errors.from_engine_error(InvalidRequestError("too long", "prompt", "context_length_exceeded"), "m")
    assert (e.status_code, e.param, e.code, e.type) == (
        400,
        "prompt",
        "context_length_exceeded",
        "invalid_request_error",
    )
    e = errors.from_engine_error(EngineDeadError("boom", "err-0123456789abcdef"), "m")
    assert (e.status_code, e.code, e.type) == (503, "engine_dead", "server_error")
    # The failure's text stays in the log, under the id the client gets (issue 33).
    assert "boom" not in e.message and "`m`" in e.message and "error id err-0123456789abcdef" in e.message
    e = errors.from_engine_error(RuntimeError("bug"), "m")
    # A fault of ours: the client gets an id to quote, never the exception's text (issue 33).
    assert (e.status_code, e.type) == (500, "server_error") and "bug" not in e.message
    assert "request id err-" in e.message and e.headers["X-Request-Id"] in e.message
    # A bare ValueError from inside the engine is a bug too, not the request's fault: it was a 400
    # that showed its text.
    e = errors.from_engine_error(ValueError("cannot reshape tensor of 0 elements"), "m")
    assert (e.status_code, e.type) == (500, "server_error") and "reshape" not in e.message


def test_error_body_shape_and_headers():
    e = errors.queue_full(3)
    assert e.body() == {
        "error": {"message": e.message, "type": "rate_limit_error", "param": None, "code": "queue_full"}
    }
    r = e.response()
    assert r.status_code == 429 and r.headers["retry-after"] == "3"


def test_json_log_line_has_the_fields():
    records = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    handler = Keep()
    request_logger.addHandler(handler)
    old_level = request_logger.level
    request_logger.setLevel(logging.INFO)
    try:
        log_request(
            request_id="cmpl-1",
            model="m",
            endpoint="/v1/completions",
            status=200,
            prompt_tokens=3,
            completion_tokens=4,
            ttft_s=0.0123456789,
            total_s=0.5,
            finish_reason="stop",
        )
    finally:
        request_logger.removeHandler(handler)
        request_logger.setLevel(old_level)
    line = json.loads(JSONFormatter().format(records[0]))
    assert line["message"] == "request finished" and line["level"] == "info"
    keys = (
        "request_id",
        "model",
        "prompt_tokens",
        "completion_tokens",
        "ttft_s",
        "total_s",
        "finish_reason",
        "status",
    )
    assert {k: line[k] for k in keys} == {
        "request_id": "cmpl-1",
        "model": "m",
        "prompt_tokens": 3,
        "completion_tokens": 4,
        "ttft_s": 0.012346,
        "total_s": 0.5,
        "finish_reason": "stop",
        "status": 200,
    }
    text = records[0].getMessage()
    assert "request_id=cmpl-1" in text and "finish_reason=stop" in text and "ttft_s=0.012346" in text
