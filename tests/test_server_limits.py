"""One request cannot hurt the others (issue 11): bodies over the limit get 413 before they
are parsed, a text prompt that cannot fit the context is refused without tokenizing it, a
request that could never be admitted is a 400 that states the limit, a client that gives up
frees the engine for the next one at once, and tokenizing happens off the event loop, so
/health and running streams keep their pace. Also: ``continuous_usage_stats``."""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest
from server_support import make_engine, metric, metric_samples, serve, wait_for

from pagecast.runtime.server import serving_chat
from pagecast.runtime.server.limits import max_prompt_chars

MODEL = "tiny"
MAX_NUM_SEQS, MAX_QUEUE = 4, 12
CAPACITY = MAX_NUM_SEQS + MAX_QUEUE
MAX_BYTES = 64 * 1024


@pytest.fixture(scope="module")
def engine(tiny_llama_artifact):  # type: ignore[no-untyped-def]
    return make_engine(tiny_llama_artifact, max_num_seqs=MAX_NUM_SEQS, max_model_len=256)


@pytest.fixture(scope="module")
def server(engine):  # type: ignore[no-untyped-def]
    with serve({MODEL: engine}, max_queue=MAX_QUEUE, max_request_bytes=MAX_BYTES) as srv:
        yield srv


def post(server, path: str, body: dict, timeout: float = 60) -> httpx.Response:  # type: ignore[no-untyped-def,type-arg]
    return httpx.post(f"{server.url}{path}", json=body, timeout=timeout)


def in_flight(server) -> float:  # type: ignore[no-untyped-def]
    return metric(metric_samples(server.url), "pagecast_server_sequences_in_flight", model_name=MODEL)


def error_of(r: httpx.Response, status: int, code: str) -> dict:  # type: ignore[type-arg]
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == code, err
    return err  # type: ignore[no-any-return]


# -- body size ----------------------------------------------------------------------------------


def test_body_over_the_limit_is_413(server):  # type: ignore[no-untyped-def]
    big = {"model": MODEL, "prompt": "a" * MAX_BYTES, "max_tokens": 1}
    err = error_of(post(server, "/v1/completions", big), 413, "request_too_large")
    assert f"{MAX_BYTES:,}" in err["message"] and err["type"] == "invalid_request_error"

    # A chunked upload declares no length: the bytes are counted as they arrive.
    def chunks():  # type: ignore[no-untyped-def]
        yield b'{"model": "tiny", "max_tokens": 1, "prompt": "'
        for _ in range(MAX_BYTES // 4096 + 2):
            yield b"b" * 4096
        yield b'"}'

    r = httpx.post(
        f"{server.url}/v1/chat/completions",
        content=chunks(),
        headers={"Content-Type": "application/json"},
        timeout=60,
    )
    assert "content-length" not in r.request.headers
    error_of(r, 413, "request_too_large")
    samples = metric_samples(server.url)
    assert metric(samples, "pagecast_request_errors_total", status="413", code="request_too_large") >= 2
    # Under the limit is served as before.
    assert (
        post(server, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 1}).status_code == 200
    )


# -- prompt size --------------------------------------------------------------------------------


def test_text_prompt_that_cannot_fit_is_refused_without_tokenizing(server, engine, monkeypatch):  # type: ignore[no-untyped-def]
    calls = []
    real = engine.tokenize
    monkeypatch.setattr(engine, "tokenize", lambda text: calls.append(len(text)) or real(text))
    limit = max_prompt_chars(engine.tokenizer, engine.max_model_len)
    assert limit < MAX_BYTES - 200  # the body limit does not decide this test
    err = error_of(
        post(server, "/v1/completions", {"model": MODEL, "prompt": "x" * (limit + 1), "max_tokens": 1}),
        400,
        "context_length_exceeded",
    )
    assert "characters" in err["message"] and "256" in err["message"]
    assert calls == []  # never tokenized

    rendered = []
    real_render = serving_chat.render_chat_prompt
    monkeypatch.setattr(serving_chat, "render_chat_prompt", lambda *a: rendered.append(1) or real_render(*a))
    messages = [
        {"role": "user", "content": "y" * (limit // 2 + 1)},
        {"role": "user", "content": "z" * (limit // 2 + 1)},
    ]
    error_of(
        post(server, "/v1/chat/completions", {"model": MODEL, "messages": messages}),
        400,
        "context_length_exceeded",
    )
    assert rendered == []
    # A prompt under the bound is tokenized and checked exactly, as before.
    error_of(
        post(server, "/v1/completions", {"model": MODEL, "prompt": "word " * 300, "max_tokens": 1}),
        400,
        "context_length_exceeded",
    )
    assert len(calls) == 1


# -- sequences per request and fair admission ---------------------------------------------------


def test_request_that_can_never_be_admitted_is_400_with_the_limit(server):  # type: ignore[no-untyped-def]
    """It used to be admitted whenever nothing else was in flight, locking every other
    client out (429) for as long as it ran."""
    err = error_of(
        post(server, "/v1/completions", {"model": MODEL, "prompt": ["hi"] * 4, "n": 5, "max_tokens": 1}),
        400,
        "too_many_sequences",
    )
    assert str(CAPACITY) in err["message"] and "20" in err["message"] and err["param"] == "prompt"
    chat = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "n": CAPACITY + 1,
        "max_tokens": 1,
    }
    err = error_of(post(server, "/v1/chat/completions", chat), 400, "too_many_sequences")
    assert err["param"] == "n"
    assert in_flight(server) == 0
    # Exactly the limit is admitted.
    r = post(
        server, "/v1/completions", {"model": MODEL, "prompt": ["hi"] * 4, "n": CAPACITY // 4, "max_tokens": 1}
    )
    assert r.status_code == 200 and len(r.json()["choices"]) == CAPACITY


def test_after_a_client_gives_up_the_next_request_is_served_at_once(server):  # type: ignore[no-untyped-def]
    wait_for(lambda: in_flight(server) == 0)
    body = json.dumps(
        {"model": MODEL, "prompt": [[5, 6, 7]] * 4, "n": CAPACITY // 4, "max_tokens": 240, "ignore_eos": True}
    ).encode()
    raw = (
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body
    sock = socket.create_connection(("127.0.0.1", server.port))
    try:
        sock.sendall(raw)
        wait_for(lambda: in_flight(server) == CAPACITY, timeout=30)
        # While it runs, everyone else is told to come back (the queue is full).
        r = post(server, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 1})
        error_of(r, 429, "queue_full")
    finally:
        sock.close()  # the client gives up
    start = time.monotonic()
    wait_for(lambda: in_flight(server) == 0, timeout=10)
    r = post(server, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 1})
    assert r.status_code == 200, r.text
    assert time.monotonic() - start < 5  # its aborted sequences left the engine queue at once
    wait_for(
        lambda: metric(metric_samples(server.url), "pagecast_kv_cache_blocks_used", model_name=MODEL) == 0,
        timeout=10,
    )


# -- nothing blocks the event loop ----------------------------------------------------------------


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
def test_slow_tokenizing_does_not_stall_health_or_a_running_stream(server, engine, monkeypatch, endpoint):  # type: ignore[no-untyped-def]
    """A request whose tokenizing takes 5 s (a huge prompt) used to hold the event loop for
    those 5 s: /health timed out and running streams got no token. The bounds below leave
    room for a loaded machine (tokens come every few hundred ms there) but not for a stall."""
    slow_s = 5.0
    if endpoint == "/v1/completions":
        real = engine.tokenize

        def slow_tokenize(text):  # type: ignore[no-untyped-def]
            time.sleep(slow_s)
            return real(text)

        monkeypatch.setattr(engine, "tokenize", slow_tokenize)
        slow_body = {"model": MODEL, "prompt": "a huge prompt", "max_tokens": 1}
    else:
        real_render = serving_chat.render_chat_prompt

        def slow_render(*args):  # type: ignore[no-untyped-def]
            time.sleep(slow_s)
            return real_render(*args)

        monkeypatch.setattr(serving_chat, "render_chat_prompt", slow_render)
        slow_body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": "a huge prompt"}],
            "max_tokens": 1,
        }

    event_times: list[float] = []
    stream_ended: list[float] = []
    stream_started = threading.Event()

    def stream() -> None:
        body = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 240, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line:
                    event_times.append(time.monotonic())
                    stream_started.set()
        stream_ended.append(time.monotonic())

    streamer = threading.Thread(target=stream, daemon=True)
    streamer.start()
    assert stream_started.wait(30)
    slow_result: dict[str, int] = {}
    slow = threading.Thread(
        target=lambda: slow_result.update(status=post(server, endpoint, slow_body).status_code), daemon=True
    )
    t0 = time.monotonic()
    slow.start()
    health_s = []
    while slow.is_alive() and time.monotonic() - t0 < 30:
        start = time.monotonic()
        assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
        health_s.append(time.monotonic() - start)
        time.sleep(0.05)
    t1 = time.monotonic()
    slow.join(30)
    streamer.join(60)
    assert slow_result["status"] == 200
    assert t1 - t0 >= slow_s  # the slow request really took that long
    assert max(health_s) < slow_s / 2, health_s
    # Until the slow request is done, or the stream if a fast machine finished it before that.
    end = min([t1, *stream_ended])
    during = [t for t in event_times if t0 <= t <= end]
    gaps = [b - a for a, b in zip([t0, *during], [*during, end], strict=True)]
    assert max(gaps) < slow_s / 2, gaps  # the stream kept producing tokens meanwhile


# -- stream_options.continuous_usage_stats --------------------------------------------------------


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
def test_continuous_usage_stats_puts_usage_in_every_chunk(server, endpoint):  # type: ignore[no-untyped-def]
    body = {
        "model": MODEL,
        "max_tokens": 6,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    if endpoint == "/v1/completions":
        body["prompt"] = [5, 6, 7]
    else:
        body["messages"] = [{"role": "user", "content": "hi"}]
    with httpx.stream("POST", f"{server.url}{endpoint}", json=body, timeout=60) as r:
        assert r.status_code == 200
        events = [line for line in r.iter_lines() if line]
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e[len("data: ") :]) for e in events[:-1]]
    usages = [c["usage"] for c in chunks]
    assert all(u is not None for u in usages), usages
    prompt_tokens = usages[-1]["prompt_tokens"]
    assert all(u["prompt_tokens"] == prompt_tokens for u in usages)
    completion = [u["completion_tokens"] for u in usages]
    assert completion == sorted(completion) and completion[-1] == 6
    assert all(u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"] for u in usages)
    assert chunks[-1]["choices"] == []  # the final usage-only chunk, as with include_usage alone
