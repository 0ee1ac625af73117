"""The server's safe edges (issue 33): /tokenize and /detokenize off the event loop, integers
past int64 in any field are 400s naming the field (never 500s), 500s carry no internal text
but an id the server's log repeats with the traceback, and CORS '*' with credentials is
refused at start."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
from server_support import make_engine, serve
from starlette.applications import Starlette

from pagecast.runtime.server import serving_tokenize
from pagecast.runtime.server.app import add_cors

MODEL = "tiny"
HUGE = 10**30


@pytest.fixture(scope="module")
def server(tiny_llama_artifact):  # type: ignore[no-untyped-def]
    engine = make_engine(tiny_llama_artifact, max_num_seqs=4, max_model_len=256)
    with serve({MODEL: engine}) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):  # type: ignore[no-untyped-def]
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)


# -- /tokenize and /detokenize do not hold the event loop ----------------------------------------


def _health_latencies_while(server, post, settle: float = 0.3) -> tuple[list[float], float, httpx.Response]:  # type: ignore[no-untyped-def]
    """Probe /health every 25 ms from one keep-alive client while ``post()`` runs in a thread,
    from ``settle`` seconds after it starts: the probes' latencies, how long ``post`` took,
    and its answer.

    A latency counts from when its probe was due, not from when this thread got round to
    sending it: the server runs in this process, so a thread holding the GIL stalls the
    prober as it stalls the event loop, and a prober that only timed what it sent would
    never see the stall (an outside prober, firing on time, would)."""
    result: dict[str, httpx.Response] = {}
    worker = threading.Thread(target=lambda: result.update(r=post()), daemon=True)
    latencies = []
    with httpx.Client(base_url=server.url, timeout=60) as probe:
        probe.get("/health")  # connected before the clock starts
        started = time.monotonic()
        worker.start()
        due = started + settle  # e.g. let the body arrive and the tokenizing start
        while worker.is_alive():
            time.sleep(max(0.0, due - time.monotonic()))
            assert probe.get("/health").status_code == 200
            latencies.append(time.monotonic() - due)
            due += 0.025
        worker.join()
    return latencies, time.monotonic() - started, result["r"]


def _p99(latencies: list[float]) -> float:
    ordered = sorted(latencies)
    return ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]


def test_health_answers_promptly_while_a_huge_tokenize_runs(server):  # type: ignore[no-untyped-def]
    """Issue 33: /health p99 <= 100 ms while a 4 Mi-character /tokenize runs.

    Tokenizing already ran in a worker thread, but the thread held the GIL in long C calls,
    and the event loop waited on each: transformers' encode drops a Rust Encoding with a
    string and offsets per token (0.13 s for these ~0.93M tokens) after converting its ids
    and mask to lists (0.02-0.04 s each), and JSONResponse's json.dumps of the ids took
    0.13 s. Now the text goes through encode_batch_fast (the same ids; the GIL is held only
    to list them, ~25 ms) and msgspec renders the answer in the worker (8 ms). Measured on
    this 2-core machine shared with other jobs (load 3-4), probes due every 25 ms: p99 of
    the new code 7-34 ms, the slowest probe 42 ms; the old code's p99 185-300 ms, its
    slowest 230-325 ms (and the old test's own probes added 20-50 ms each: httpx.get builds
    an SSL context per call, and the test server's socket lacked TCP_NODELAY).
    """
    text = "The quick brown fox jumps over the lazy dog. " * ((4 << 20) // 45)
    latencies, tokenize_s, r = _health_latencies_while(
        server,
        lambda: httpx.post(f"{server.url}/tokenize", json={"model": MODEL, "prompt": text}, timeout=300),
    )
    assert r.status_code == 200, r.text[:500]
    body = r.json()
    assert body["count"] == len(body["tokens"]) > 500_000
    assert body["tokens"][10:20] == body["tokens"][20:30]  # the sentence is 10 tokens, again and again
    assert len(latencies) >= 5, (tokenize_s, latencies)  # answered again and again while it ran
    assert _p99(latencies) <= 0.1, (tokenize_s, len(latencies), sorted(latencies)[-10:])


def test_health_answers_promptly_while_a_huge_completion_prompt_is_refused(server):  # type: ignore[no-untyped-def]
    """The generation endpoints bound a text prompt by the context (limits.check_text_size):
    4 Mi characters cannot fit 256 tokens, so it is refused from its length, untokenized,
    and /health does not notice (when a context is long enough to take it, it is tokenized
    by the same encode_text as /tokenize)."""
    text = "The quick brown fox jumps over the lazy dog. " * ((4 << 20) // 45)
    body = {"model": MODEL, "prompt": text, "max_tokens": 1}
    latencies, _, r = _health_latencies_while(
        server, lambda: httpx.post(f"{server.url}/v1/completions", json=body, timeout=300), settle=0.0
    )
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text[:300]
    assert latencies and _p99(latencies) <= 0.1, latencies


def test_tokenize_limits(server):  # type: ignore[no-untyped-def]
    big = "a" * ((4 << 20) + 1)
    r = httpx.post(
        f"{server.url}/tokenize",
        json={"model": MODEL, "messages": [{"role": "user", "content": big}]},
        timeout=60,
    )
    assert r.status_code == 400, r.text[:300]
    assert r.json()["error"]["param"] == "messages"
    r = httpx.post(f"{server.url}/tokenize", json={"model": MODEL, "prompt": big}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    # And the ordinary answers still come back, from the worker thread.
    r = httpx.post(f"{server.url}/tokenize", json={"model": MODEL, "prompt": "Hello world"}, timeout=60)
    tokens = r.json()["tokens"]
    assert r.json()["count"] == len(tokens) > 0
    r = httpx.post(f"{server.url}/detokenize", json={"model": MODEL, "tokens": tokens}, timeout=60)
    assert r.json() == {"prompt": "Hello world"}


# -- integers past int64 -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("top_k", HUGE),
        ("stop_token_ids", [HUGE]),
        ("min_tokens", HUGE),
        ("max_tokens", HUGE),
        ("prompt", [5, 6, HUGE]),
        ("seed", HUGE),
    ],
)
def test_out_of_range_integer_is_a_400_naming_the_field_completions(client, field, value):  # type: ignore[no-untyped-def]
    body = {"prompt": [5, 6, 7], "max_tokens": 2, field: value}
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=body.pop("prompt"), extra_body=body)
    err = info.value
    assert err.status_code == 400
    assert err.param == field, err.body
    assert err.type == "invalid_request_error"
    assert field in err.message


@pytest.mark.parametrize(
    ("field", "value"),
    [("top_k", HUGE), ("stop_token_ids", [1, HUGE]), ("max_completion_tokens", HUGE), ("top_k", -HUGE)],
)
def test_out_of_range_integer_is_a_400_naming_the_field_chat(client, field, value):  # type: ignore[no-untyped-def]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2, extra_body={field: value}
        )
    assert info.value.status_code == 400
    assert info.value.param == field, info.value.body


def test_out_of_range_integer_error_shape_on_the_wire(server):  # type: ignore[no-untyped-def]
    r = httpx.post(
        f"{server.url}/v1/completions",
        json={"model": MODEL, "prompt": "hi", "max_tokens": 1, "stop_token_ids": [3, HUGE]},
        timeout=60,
    )
    assert r.status_code == 400
    assert r.json() == {
        "error": {
            "message": r.json()["error"]["message"],
            "type": "invalid_request_error",
            "param": "stop_token_ids",
            "code": "invalid_value",
        }
    }
    assert "stop_token_ids[1]" in r.json()["error"]["message"]
    # The largest int64 itself is not refused by this floor (other bounds may still apply).
    r = httpx.post(
        f"{server.url}/v1/completions",
        json={"model": MODEL, "prompt": [5, 6], "max_tokens": 1, "top_k": 2**63 - 1},
        timeout=60,
    )
    assert r.status_code == 200, r.text


# -- 500s ----------------------------------------------------------------------------------------


def test_internal_error_hides_its_text_and_logs_it_with_the_traceback(server, monkeypatch, caplog):  # type: ignore[no-untyped-def]
    secret = "/srv/secret/path token=hunter2"

    def broken(model):  # type: ignore[no-untyped-def]
        raise RuntimeError(secret)

    monkeypatch.setattr(serving_tokenize, "_tokenizer", broken)
    with caplog.at_level(logging.ERROR, logger="pagecast.server"):
        r = httpx.post(f"{server.url}/tokenize", json={"model": MODEL, "prompt": "hi"}, timeout=60)
    assert r.status_code == 500
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert (err["type"], err["code"]) == ("server_error", "internal_error")
    assert "hunter2" not in r.text and "RuntimeError" not in r.text and "secret" not in r.text
    request_id = r.headers["x-request-id"]
    assert request_id in err["message"]
    records = [rec for rec in caplog.records if request_id in rec.getMessage()]
    assert records, [rec.getMessage() for rec in caplog.records]
    assert records[0].levelno == logging.ERROR
    assert "hunter2" in records[0].getMessage()
    assert records[0].exc_info is not None and records[0].exc_info[0] is RuntimeError


# -- CORS ----------------------------------------------------------------------------------------


def test_cors_any_origin_with_credentials_is_refused(tiny_llama_artifact, tmp_path):  # type: ignore[no-untyped-def]
    app = Starlette()
    with pytest.raises(ValueError, match="cannot be combined with --allow-credentials"):
        add_cors(app, ["*"], allow_credentials=True)
    add_cors(app, ["https://app.example.com"], allow_credentials=True)  # a listed origin is fine
    add_cors(app, ["*"], allow_credentials=False)
    # engine-serve refuses it at start, before loading anything, with the reason.
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "pagecast.runtime.cli", str(tiny_llama_artifact), "--allowed-origins", "*",
         "--allow-credentials"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 2, proc.stderr
    assert "--allowed-origins '*' cannot be combined with --allow-credentials" in proc.stderr
    assert "List the origins" in proc.stderr
    assert time.monotonic() - started < 60


# -- listening beyond the machine without a key ----------------------------------------------------


def test_serving_beyond_loopback_without_a_key_is_warned_about(tiny_llama_artifact):  # type: ignore[no-untyped-def]
    from pagecast.runtime.server.options import open_without_key_warning

    for host in ("127.0.0.1", "127.0.0.2", "::1", "[::1]", "localhost"):
        assert open_without_key_warning(host, None) is None, host
    for host in ("0.0.0.0", "::", "192.168.1.20", "my-host.internal"):
        warning = open_without_key_warning(host, None)
        assert warning is not None and "WITHOUT an API key" in warning and "--api-key" in warning, host
        assert open_without_key_warning(host, "k") is None  # a key: nothing to warn about
        assert open_without_key_warning(host, "") is not None  # an empty key is no key
    assert "all interfaces" in (open_without_key_warning("0.0.0.0", None) or "")
    # engine-serve itself says so on start, however it was started (not only the image's
    # entrypoint): here the start then stops at a refused option, before loading anything.
    proc = subprocess.run(
        [sys.executable, "-m", "pagecast.runtime.cli", str(tiny_llama_artifact), "--host", "0.0.0.0",
         "--allowed-origins", "*", "--allow-credentials"],
        capture_output=True, text=True, timeout=120, check=False, env={**os.environ, "PAGECAST_API_KEY": ""},
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert "serving on 0.0.0.0 (all interfaces) WITHOUT an API key" in proc.stderr
