"""Every error the server answers: status code and OpenAI-shaped body, against a real server
(with an API key, and a small engine so the queue can be filled), and through the SDK's
exception classes. Also: an engine whose loop dies answers 503, never a hung connection."""

from __future__ import annotations

import threading

import httpx
import openai
import pytest
from server_support import make_engine, metric, metric_samples, serve, wait_for

MODEL = "tiny"
KEY = "sk-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server(tiny_llama_artifact):  # type: ignore[no-untyped-def]
    engine = make_engine(tiny_llama_artifact, max_num_seqs=2, max_model_len=256)
    with serve({MODEL: engine}, api_key=KEY, max_queue=1) as srv:
        yield srv


def post(server, path: str, body=None, content: bytes | None = None, headers=None) -> httpx.Response:  # type: ignore[no-untyped-def]
    return httpx.post(
        f"{server.url}{path}",
        json=body,
        content=content,
        headers=AUTH if headers is None else headers,
        timeout=60,
    )


def assert_error(
    r: httpx.Response,
    status: int,
    type_: str,
    param: str | None = None,
    code: str | None = None,
    says: str = "",
) -> dict:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    body = r.json()
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == type_
    assert err["param"] == param
    # Every 4xx and 5xx carries a machine-readable code (clients branch on it).
    assert isinstance(err["code"], str) and err["code"], err
    if code is not None:
        assert err["code"] == code
    assert isinstance(err["message"], str) and err["message"]
    assert says.lower() in err["message"].lower()
    return err


def test_api_key(server):  # type: ignore[no-untyped-def]
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 1}
    assert_error(
        post(server, "/v1/completions", body, headers={}),
        401,
        "authentication_error",
        code="invalid_api_key",
        says="missing",
    )
    assert_error(
        post(server, "/v1/completions", body, headers={"Authorization": "Bearer nope"}),
        401,
        "authentication_error",
        code="invalid_api_key",
        says="incorrect",
    )
    assert_error(httpx.get(f"{server.url}/v1/models"), 401, "authentication_error")
    assert post(server, "/v1/completions", body).status_code == 200
    # Probes and scrapers need no key.
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.get(f"{server.url}/metrics").status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0).models.list()


@pytest.mark.parametrize(
    "body, param, says",
    [
        ({"model": MODEL, "prompt": "hi", "temperature": "hot"}, "temperature", "valid number"),
        ({"model": MODEL, "prompt": "hi", "temperature": 2.5}, "temperature", "less than or equal to 2"),
        ({"model": MODEL, "prompt": "hi", "top_p": 0}, "top_p", "greater than 0"),
        ({"model": MODEL, "prompt": "hi", "top_k": -2}, "top_k", ""),
        ({"model": MODEL, "prompt": "hi", "min_p": 1.5}, "min_p", ""),
        ({"model": MODEL, "prompt": "hi", "n": 0}, "n", ""),
        ({"model": MODEL, "prompt": "hi", "n": True}, "n", "integer"),
        ({"model": MODEL, "prompt": "hi", "max_tokens": -1}, "max_tokens", ""),
        ({"model": MODEL, "prompt": "hi", "max_tokens": "ten"}, "max_tokens", ""),
        ({"model": MODEL, "prompt": "hi", "max_tokens": 0}, "max_tokens", "echo"),
        ({"model": MODEL, "prompt": "hi", "logprobs": 21}, "logprobs", ""),
        ({"model": MODEL, "prompt": "hi", "presence_penalty": -3}, "presence_penalty", ""),
        ({"model": MODEL, "prompt": "hi", "frequency_penalty": 2.1}, "frequency_penalty", ""),
        ({"model": MODEL, "prompt": "hi", "repetition_penalty": 0}, "repetition_penalty", ""),
        ({"model": MODEL, "prompt": "hi", "seed": 2**70}, "seed", ""),
        ({"model": MODEL, "prompt": "hi", "stop": 5}, "stop", "wrong type"),
        ({"model": MODEL, "prompt": "hi", "stop": [""]}, "stop", "empty"),
        ({"model": MODEL, "prompt": "hi", "stop": ["s"] * 17}, "stop", "at most 16"),
        ({"model": MODEL, "prompt": "hi", "stop_token_ids": [-1]}, "stop_token_ids", ""),
        ({"model": MODEL, "prompt": "hi", "stream": "yes"}, "stream", ""),
        (
            {"model": MODEL, "prompt": "hi", "stream_options": {"include_usage": True}},
            "stream_options",
            "stream",
        ),
        ({"model": MODEL}, "prompt", "required"),
        ({"model": MODEL, "prompt": []}, "prompt", ""),
        ({"model": MODEL, "prompt": [1, "a"]}, "prompt", ""),
        ({"model": MODEL, "prompt": [[1, 2], []]}, "prompt", ""),
        ({"model": MODEL, "prompt": [1, -5]}, "prompt", ""),
        ({"model": MODEL, "prompt": [10**9]}, "prompt", "out of range"),
        ({"model": 5, "prompt": "hi"}, "model", ""),
    ],
)
def test_completions_bad_values_are_400_naming_the_param(server, body, param, says):  # type: ignore[no-untyped-def]
    assert_error(post(server, "/v1/completions", body), 400, "invalid_request_error", param=param, says=says)


@pytest.mark.parametrize(
    "body, param, says",
    [
        ({"model": MODEL}, "messages", "required"),
        ({"model": MODEL, "messages": []}, "messages", ""),
        ({"model": MODEL, "messages": "hi"}, "messages", ""),
        ({"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role", ""),
        ({"model": MODEL, "messages": [{"role": "user", "content": 3}]}, "messages[0].content", ""),
        ({"model": MODEL, "messages": [{"role": "user"}]}, "messages[0].content", "required"),
        (
            {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2},
            "top_logprobs",
            "logprobs",
        ),
        (
            {
                "model": MODEL,
                "messages": [{"role": "user", "content": "hi"}],
                "logprobs": True,
                "top_logprobs": 30,
            },
            "top_logprobs",
            "",
        ),
        (
            {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0},
            "max_completion_tokens",
            "",
        ),
    ],
)
def test_chat_bad_values_are_400_naming_the_param(server, body, param, says):  # type: ignore[no-untyped-def]
    assert_error(
        post(server, "/v1/chat/completions", body), 400, "invalid_request_error", param=param, says=says
    )


@pytest.mark.parametrize(
    "body, param, code",
    [
        ({"model": MODEL, "prompt": [[1, 2], [10**9]]}, "prompt", "invalid_token_id"),
        ({"model": MODEL, "prompt": "", "max_tokens": 1}, "prompt", "invalid_value"),
        ({"model": MODEL, "prompt": "hi", "stream_options": {"include_usage": True}}, "stream_options", "invalid_value"),
        ({"model": MODEL, "prompt": "hi", "max_tokens": 0}, "max_tokens", "invalid_value"),
    ],
)
def test_errors_that_had_no_code(server, body, param, code):  # type: ignore[no-untyped-def]
    """These four answered ``code: null`` (issue 11)."""
    assert_error(post(server, "/v1/completions", body), 400, "invalid_request_error", param=param, code=code)


@pytest.mark.parametrize("name", ["temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty"])
@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity", "1e999"])
def test_non_finite_numbers_are_named(server, name, literal):  # type: ignore[no-untyped-def]
    """NaN fails every range check, so it used to be answered "should be <= 2"; it is named."""
    content = f'{{"model": "{MODEL}", "prompt": "hi", "max_tokens": 1, "{name}": {literal}}}'.encode()
    r = post(server, "/v1/completions", content=content, headers={**AUTH, "Content-Type": "application/json"})
    err = assert_error(r, 400, "invalid_request_error", param=name, code="invalid_value", says="finite number")
    assert "<=" not in err["message"] and ">=" not in err["message"]
    chat = (
        f'{{"model": "{MODEL}", "messages": [{{"role": "user", "content": "hi"}}], "{name}": {literal}}}'
    ).encode()
    r = post(server, "/v1/chat/completions", content=chat, headers={**AUTH, "Content-Type": "application/json"})
    assert_error(r, 400, "invalid_request_error", param=name, code="invalid_value", says="finite number")


@pytest.mark.parametrize(
    "bias, says",
    [
        ({"hello": 5}, "token ids"),
        ({"-3": 5}, "token ids"),
        ({"99999999999999999999999": 5}, "token ids"),
        ({"50": 101}, "[-100, 100]"),
        ({"50": -100.5}, "[-100, 100]"),
        ({"1000000": 1}, "out of range"),
    ],
)
def test_bad_logit_bias_is_a_400_naming_it(server, bias, says):  # type: ignore[no-untyped-def]
    """A key that is not a token id of the model, or a value outside OpenAI's range, is a 400 with
    param logit_bias, on both endpoints; a good one is served."""
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 1, "logit_bias": bias}
    assert_error(post(server, "/v1/completions", body), 400, "invalid_request_error", param="logit_bias", says=says)
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "logit_bias": bias}
    assert_error(post(server, "/v1/chat/completions", chat), 400, "invalid_request_error", param="logit_bias", says=says)
    ok = {"model": MODEL, "prompt": "hi", "max_tokens": 1, "logit_bias": {"50": 2.5}}
    assert post(server, "/v1/completions", ok).status_code == 200


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/completions", {"model": MODEL, "prompt": "hi", "suffix": "tail"}, "suffix"),
        ("/v1/completions", {"model": MODEL, "prompt": "hi", "best_of": 3}, "best_of"),
        ("/v1/completions", {"model": MODEL, "prompt": "hi", "priority": -1}, "priority"),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "priority": 5}, "priority"),
        (
            "/v1/chat/completions",
            {
                "model": MODEL,
                "messages": [{"role": "user", "content": "hi"}],
                "functions": [{"name": "f"}],
            },
            "functions",
        ),
        (
            "/v1/chat/completions",
            {
                "model": MODEL,
                "messages": [{"role": "user", "content": "hi"}],
                "response_format": {"type": "regex", "regex": "a+"},
            },
            "response_format",
        ),
        (
            "/v1/chat/completions",
            {"model": MODEL, "messages": [{"role": "function", "name": "f", "content": "x"}]},
            "messages[0].role",
        ),
        (
            "/v1/chat/completions",
            {
                "model": MODEL,
                "messages": [
                    {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}
                ],
            },
            "messages[0].content[0].type",
        ),
    ],
)
def test_unsupported_parameters_say_so(server, path, body, param):  # type: ignore[no-untyped-def]
    assert_error(
        post(server, path, body),
        400,
        "invalid_request_error",
        param=param,
        code="unsupported_parameter",
        says="not supported",
    )


def test_the_default_priority_is_accepted(server):  # type: ignore[no-untyped-def]
    r = post(server, "/v1/completions", {"model": MODEL, "prompt": "hi", "priority": 0, "max_tokens": 2})
    assert r.status_code == 200, r.text


def test_best_of_equal_to_n_is_accepted(server):  # type: ignore[no-untyped-def]
    r = post(
        server, "/v1/completions", {"model": MODEL, "prompt": "hi", "best_of": 2, "n": 2, "max_tokens": 2}
    )
    assert r.status_code == 200 and len(r.json()["choices"]) == 2


@pytest.mark.parametrize(
    "content, says",
    [
        (b"{not json", "not valid json"),
        (b"", "empty"),
        (b"[1, 2]", "json object"),
        (b'"just a string"', "json object"),
    ],
)
def test_malformed_json(server, content, says):  # type: ignore[no-untyped-def]
    r = post(server, "/v1/completions", content=content, headers={**AUTH, "Content-Type": "application/json"})
    assert_error(r, 400, "invalid_request_error", param=None, says=says)


def test_context_length_exceeded(server):  # type: ignore[no-untyped-def]
    # max_model_len is 256 here.
    err = assert_error(
        post(server, "/v1/completions", {"model": MODEL, "prompt": [5] * 200, "max_tokens": 100}),
        400,
        "invalid_request_error",
        param="max_tokens",
        code="context_length_exceeded",
        says="256",
    )
    assert "300" in err["message"]
    assert_error(
        post(server, "/v1/completions", {"model": MODEL, "prompt": [5] * 300}),
        400,
        "invalid_request_error",
        param="prompt",
        code="context_length_exceeded",
    )
    assert_error(
        post(
            server,
            "/v1/completions",
            {"model": MODEL, "prompt": [5] * 200, "max_tokens": 100, "stream": True},
        ),
        400,
        "invalid_request_error",
        param="max_tokens",
        code="context_length_exceeded",
    )
    long_chat = {"model": MODEL, "messages": [{"role": "user", "content": "word " * 400}]}
    assert_error(
        post(server, "/v1/chat/completions", long_chat),
        400,
        "invalid_request_error",
        param="messages",
        code="context_length_exceeded",
    )
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=[5] * 200, max_tokens=100)
    assert info.value.code == "context_length_exceeded"


def test_unknown_model_is_404(server):  # type: ignore[no-untyped-def]
    err = assert_error(
        post(server, "/v1/completions", {"model": "gpt-5", "prompt": "hi"}),
        404,
        "invalid_request_error",
        param="model",
        code="model_not_found",
        says="gpt-5",
    )
    assert "does not exist" in err["message"]
    assert_error(
        post(
            server, "/v1/chat/completions", {"model": "nope", "messages": [{"role": "user", "content": "x"}]}
        ),
        404,
        "invalid_request_error",
        param="model",
        code="model_not_found",
    )
    assert_error(
        httpx.get(f"{server.url}/v1/models/nope", headers=AUTH),
        404,
        "invalid_request_error",
        param="model",
        code="model_not_found",
    )
    with pytest.raises(openai.NotFoundError):
        openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0).completions.create(
            model="nope", prompt="x"
        )


def test_unknown_route_and_method(server):  # type: ignore[no-untyped-def]
    assert_error(
        httpx.get(f"{server.url}/v1/nothing", headers=AUTH), 404, "invalid_request_error", code="not_found"
    )
    assert_error(httpx.get(f"{server.url}/v1/completions", headers=AUTH), 405, "invalid_request_error")


def test_queue_full_is_429_with_retry_after(server):  # type: ignore[no-untyped-def]
    """max_num_seqs=2 and max_queue=1: three long streams fill the engine and its queue; the
    fourth request is refused, and admitted again once they are gone."""
    body = {"model": MODEL, "prompt": [7, 8, 9], "max_tokens": 250, "ignore_eos": True, "stream": True}
    stop = threading.Event()

    def hold_stream() -> None:
        with (
            httpx.Client(timeout=60) as c,
            c.stream("POST", f"{server.url}/v1/completions", json=body, headers=AUTH) as r,
        ):
            assert r.status_code == 200
            stop.wait(60)  # read nothing more; leaving closes the connection

    threads = [threading.Thread(target=hold_stream, daemon=True) for _ in range(3)]
    for t in threads:
        t.start()
    try:
        wait_for(
            lambda: (
                metric(metric_samples(server.url), "pagecast_server_sequences_in_flight", model_name=MODEL)
                == 3
            )
        )
        r = post(server, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 1})
        assert_error(r, 429, "rate_limit_error", code="queue_full")
        assert int(r.headers["Retry-After"]) >= 1
        with pytest.raises(openai.RateLimitError):
            openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0).completions.create(
                model=MODEL, prompt="hi", max_tokens=1
            )
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    # The streams' clients left: their sequences are released and requests are admitted again.
    wait_for(
        lambda: (
            metric(metric_samples(server.url), "pagecast_server_sequences_in_flight", model_name=MODEL) == 0
        )
    )
    assert (
        post(server, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 1}).status_code == 200
    )

