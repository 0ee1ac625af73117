"""engine-serve: bad input stops it with a clear message; SIGTERM drains (503 for new
requests, running ones finish or are aborted at --shutdown-timeout) and exits 0; JSON logs."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from click.testing import CliRunner
from server_support import start_engine_serve

from pagecast.runtime.cli import main


@pytest.fixture(autouse=True)
def _restore_logging(restore_root_logging):  # type: ignore[no-untyped-def]
    """main() installs its own root log handler; conftest puts it back after each test."""


def test_missing_artifact_is_a_clear_error(tmp_path):  # type: ignore[no-untyped-def]
    result = CliRunner().invoke(main, [str(tmp_path / "nope")])
    assert result.exit_code == 2
    assert "no such artifact directory" in result.output and "enginebuild" in result.output


def test_directory_that_is_not_an_artifact(tmp_path):  # type: ignore[no-untyped-def]
    result = CliRunner().invoke(main, [str(tmp_path)])
    assert result.exit_code == 2
    assert "manifest.json" in result.output and "enginebuild" in result.output


def test_served_model_names_must_match_artifacts(tmp_path):  # type: ignore[no-untyped-def]
    result = CliRunner().invoke(main, [str(tmp_path), "--served-model-name", "a", "--served-model-name", "b"])
    assert result.exit_code == 2
    assert "once per artifact" in result.output


def test_bad_option_values_are_usage_errors(tmp_path):  # type: ignore[no-untyped-def]
    for args in (
        ["--max-queue", "-1"],
        ["--gpu-memory-utilization", "1.5"],
        ["--log-format", "xml"],
        ["--max-request-bytes", "0"],
        ["--reasoning-parser", "r1"],
        ["--responses-store-size", "-1"],
    ):
        result = CliRunner().invoke(main, [str(tmp_path), *args])
        assert result.exit_code == 2, args


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _stream(url: str, body: dict, out: dict, first: threading.Event) -> None:  # type: ignore[type-arg]
    events = []
    with httpx.stream("POST", url, json=body, headers={"Authorization": "Bearer k"}, timeout=60) as r:
        out["status"] = r.status_code
        for line in r.iter_lines():
            if line:
                events.append(line)
                first.set()
    first.set()
    out["events"] = events


def test_sigterm_drains_then_exits_zero(tiny_artifact_factory, tmp_path):  # type: ignore[no-untyped-def]
    # --shutdown-timeout 10: long enough for the 4-token request to finish on an oversubscribed
    # machine (a loaded 2-core box ran this tiny model at 3 tokens/s per stream: 1 s and 30 tokens
    # failed there), and a long context so that the 8,000-token request is still running at the
    # timeout on any machine (seconds even at 1 ms a step).
    artifact = tiny_artifact_factory("llama", max_position_embeddings=8192)
    port = _free_port()
    exe = Path(sys.executable).with_name("engine-serve")
    cmd = [
        str(exe) if exe.exists() else sys.executable,
        *([] if exe.exists() else ["-m", "pagecast.runtime.cli"]),
        str(artifact),
        "--port",
        str(port),
        "--served-model-name",
        "tiny",
        "--kv-cache-memory",
        "16MiB",
        "--log-format",
        "json",
        "--shutdown-timeout",
        "10",
    ]
    log_path = tmp_path / "stderr.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            cmd, stdout=subprocess.DEVNULL, stderr=log, env={**os.environ, "PAGECAST_API_KEY": "k"}
        )
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, log_path.read_text()
            try:
                if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "engine-serve did not come up"
            time.sleep(0.2)
        # The API key comes from PAGECAST_API_KEY.
        assert httpx.post(f"{base}/v1/completions", json={"prompt": "x"}, timeout=30).status_code == 401

        url = f"{base}/v1/completions"
        long_out: dict = {}
        short_out: dict = {}
        long_first, short_first = threading.Event(), threading.Event()
        long_body = {
            "model": "tiny",
            "prompt": [5, 6, 7],
            "max_tokens": 8000,
            "ignore_eos": True,
            "stream": True,
        }
        short_body = {"model": "tiny", "prompt": [8, 9], "max_tokens": 4, "ignore_eos": True, "stream": True}
        threads = [
            threading.Thread(target=_stream, args=(url, long_body, long_out, long_first)),
            threading.Thread(target=_stream, args=(url, short_body, short_out, short_first)),
        ]
        threads[0].start()
        assert long_first.wait(30)
        threads[1].start()
        assert short_first.wait(30)

        proc.send_signal(signal.SIGTERM)
        # Draining: the listener stays up and answers 503, so clients can go elsewhere.
        time.sleep(0.2)
        r = httpx.post(
            url, json={"model": "tiny", "prompt": "x"}, headers={"Authorization": "Bearer k"}, timeout=30
        )
        assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down"
        assert httpx.get(f"{base}/health", timeout=30).status_code == 503

        for t in threads:
            t.join(60)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()

    def finish(out: dict) -> tuple[str | None, str]:  # type: ignore[type-arg]
        chunks = [json.loads(e[len("data: ") :]) for e in out["events"][:-1]]
        return chunks[-1]["choices"][0]["finish_reason"], out["events"][-1]

    assert short_out["status"] == long_out["status"] == 200
    assert finish(short_out) == ("length", "data: [DONE]")  # finished within the timeout
    assert finish(long_out) == ("abort", "data: [DONE]")  # cut at --shutdown-timeout, cleanly

    lines = []
    for raw in log_path.read_text().splitlines():
        try:
            lines.append(json.loads(raw))
        except ValueError:
            continue
    requests = [
        line for line in lines if line.get("message") == "request finished" and line.get("status") == 200
    ]
    by_tokens = {line["completion_tokens"]: line for line in requests}
    short = by_tokens.get(4) or pytest.fail(str(requests) + log_path.read_text()[-4000:])
    assert short["model"] == "tiny" and short["finish_reason"] == "length" and short["prompt_tokens"] == 2
    assert short["request_id"].startswith("cmpl-") and 0 <= short["ttft_s"] <= short["total_s"]
    assert any(line["finish_reason"] == "abort" for line in requests)
    assert any(line.get("logger", "").startswith("uvicorn") for line in lines)  # uvicorn logs as JSON too


def _start_engine_serve(artifact: Path, log_path: Path, *args: str) -> tuple[subprocess.Popen, str]:  # type: ignore[type-arg]
    """engine-serve (model name "tiny", JSON logs to ``log_path``) once /health answers 200."""
    serve_args = [str(artifact), "--served-model-name", "tiny", "--kv-cache-memory", "16MiB", "--log-format", "json"]
    return start_engine_serve([*serve_args, *args], log_path)


def test_second_sigterm_ends_streams_with_an_error_event(tiny_artifact_factory, tmp_path):  # type: ignore[no-untyped-def]
    """The second signal used to cut streams mid-response (no error, no [DONE]), log a
    CancelledError traceback per request and log them as status 200."""
    artifact = tiny_artifact_factory("llama", max_position_embeddings=2048)
    log_path = tmp_path / "stderr.log"
    proc, base = _start_engine_serve(artifact, log_path, "--shutdown-timeout", "60")
    try:
        url = f"{base}/v1/completions"
        stream_out: dict = {}
        stream_first = threading.Event()
        long_body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 2000, "ignore_eos": True}
        streamer = threading.Thread(
            target=_stream, args=(url, {**long_body, "stream": True}, stream_out, stream_first)
        )
        streamer.start()
        assert stream_first.wait(30)
        plain: dict = {}

        def non_streaming() -> None:
            r = httpx.post(url, json=long_body, timeout=60)
            plain.update(status=r.status_code, body=r.json())

        waiter = threading.Thread(target=non_streaming)
        waiter.start()
        time.sleep(0.5)

        proc.send_signal(signal.SIGTERM)  # drain: both keep running (timeout 60 s)
        time.sleep(0.5)
        assert proc.poll() is None
        proc.send_signal(signal.SIGTERM)  # now: end them
        streamer.join(30)
        waiter.join(30)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()

    assert stream_out["status"] == 200
    events = stream_out["events"]
    assert events[-1] == "data: [DONE]"
    error = json.loads(events[-2][len("data: ") :])["error"]
    assert error["code"] == "shutting_down" and error["type"] == "server_error"
    assert len(events) > 3  # it had streamed tokens before
    assert plain["status"] == 503 and plain["body"]["error"]["code"] == "shutting_down"

    text = log_path.read_text()
    assert "Traceback" not in text and "CancelledError" not in text, text[-3000:]
    finished = []
    for raw in text.splitlines():
        try:
            line = json.loads(raw)
        except ValueError:
            continue
        if line.get("message") == "request finished":
            finished.append(line)
    assert len(finished) == 2, finished
    assert all(line["status"] == 503 for line in finished), finished


def test_engine_options_reach_the_engines(tmp_path, monkeypatch):  # type: ignore[no-untyped-def]
    """The step-budget options are handed to every engine as given; the ones left unset are not
    (the engine's own defaults apply)."""
    from pagecast.runtime import cli

    seen: dict = {}  # type: ignore[type-arg]

    def load(artifacts, names, options):  # type: ignore[no-untyped-def]
        seen.update(options)
        raise SystemExit(3)

    monkeypatch.setattr(cli, "_load_engines", load)
    args = [str(tmp_path), "--max-num-prefill-tokens", "512", "--max-num-batched-tokens", "4096",
            "--scheduling-policy", "priority"]  # fmt: skip
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 3, result.output
    assert seen == {"max_num_prefill_tokens": 512, "max_num_batched_tokens": 4096, "scheduling_policy": "priority"}
    assert CliRunner().invoke(main, [str(tmp_path), "--max-num-prefill-tokens", "0"]).exit_code == 2
    assert CliRunner().invoke(main, [str(tmp_path), "--scheduling-policy", "lifo"]).exit_code == 2


def test_the_reasoning_parser_reaches_the_app(tmp_path, monkeypatch):  # type: ignore[no-untyped-def]
    from pagecast.runtime import cli
    from pagecast.runtime.server import app

    class Starting:
        def __init__(self) -> None:
            self.engines: list = []  # type: ignore[type-arg]

        def wait(self):  # type: ignore[no-untyped-def]
            return {}

    seen: dict = {}  # type: ignore[type-arg]

    def create(engines, **options):  # type: ignore[no-untyped-def]
        seen.update(options)
        raise SystemExit(3)

    monkeypatch.setattr(cli, "_load_engines", lambda *a: Starting())
    monkeypatch.setattr(app, "create_app", create)
    result = CliRunner().invoke(main, [str(tmp_path), "--reasoning-parser", "deepseek_r1", "--responses-store-size", "7"])
    assert result.exit_code == 3, result.output
    assert seen["reasoning_parser"] == "deepseek_r1" and seen["responses_store_size"] == 7


def test_the_step_budget_in_effect_is_logged_at_start(tiny_artifact_factory, tmp_path):  # type: ignore[no-untyped-def]
    """--max-num-prefill-tokens reaches the engine core, which reports the bound it schedules
    with; the server names it, with the step's token budget, when it starts serving."""
    artifact = tiny_artifact_factory("llama", max_position_embeddings=512)
    log_path = tmp_path / "stderr.log"
    args = ("--max-num-prefill-tokens", "7", "--max-num-seqs", "8")
    proc, base = _start_engine_serve(artifact, log_path, *args)
    try:
        assert httpx.get(f"{base}/health", timeout=10).status_code == 200
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    serving = [json.loads(raw)["message"] for raw in log_path.read_text().splitlines() if '"serving ' in raw]
    assert len(serving) == 1 and "a step computes up to 2048 tokens, at most 7 prompt tokens" in serving[0]


def test_the_start_up_line_names_the_cpu_cost_bound() -> None:
    """On the CPU the default bound is one of cost; the start-up line says how a token further
    into a prompt counts, not only the count."""
    from pagecast.runtime.cli import _prefill_bound_text
    from pagecast.runtime.engine_core import CPU_MAX_NUM_PREFILL_TOKENS, CPU_PREFILL_CONTEXT_WEIGHT

    text = _prefill_bound_text(CPU_MAX_NUM_PREFILL_TOKENS, CPU_PREFILL_CONTEXT_WEIGHT)
    assert text == f"at most {CPU_MAX_NUM_PREFILL_TOKENS} (one after c tokens of context counts 1 + c/1,024)"
    assert _prefill_bound_text(7, 0.0) == "at most 7"
    assert _prefill_bound_text(None, 0.0) == "any number of"
