"""The engine core in its own process: what the server does when that process fails.

A fault inside a step (an exception in the model, as a CUDA error would raise) and a core
process that is killed outright must both end every in-flight request with an error (an error
event and [DONE] in a stream, a 503 otherwise), turn /health to 503, and never hang; and
engine-serve then exits with status 1 so that its supervisor restarts it.

The faults are planted in a copy of a real artifact: its model.py gets a wrapper that raises
after a number of forward passes, and the manifest is re-hashed, as a builder would write it.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
from server_support import make_engine, serve, start_engine_serve, wait_for

MODEL = "tiny"

FAULT = '''

# -- planted by tests/test_engine_process.py: a device failure after {after} forward passes --
_pagecast_real_forward = Model.forward
_pagecast_forward_calls = [0]


def _pagecast_failing_forward(self, *args, **kwargs):
    _pagecast_forward_calls[0] += 1
    if _pagecast_forward_calls[0] > {after}:
        raise RuntimeError("simulated device failure")
    return _pagecast_real_forward(self, *args, **kwargs)


Model.forward = _pagecast_failing_forward
'''


def faulty_artifact(src: Path, dst: Path, after: int) -> Path:
    """A copy of ``src`` whose model fails after ``after`` forward passes, its manifest re-hashed."""
    shutil.copytree(src, dst)
    model = dst / "model.py"
    model.write_text(model.read_text() + FAULT.format(after=after))
    manifest = json.loads((dst / "manifest.json").read_text())
    manifest["files"]["model.py"] = hashlib.sha256(model.read_bytes()).hexdigest()
    (dst / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True))
    return dst


def stream_events(url: str, body: dict) -> list[str]:
    with httpx.stream("POST", url, json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200
        return [line for line in r.iter_lines() if line]


def assert_details_only_in_the_log(message: str, caplog, detail: str = "simulated device failure") -> None:  # type: ignore[no-untyped-def]
    """A client learns that the engine failed and an id to quote; the failure's own text (an
    exception, a traceback, paths) is in the server's log under that id, not in the answer."""
    assert detail not in message and "Traceback" not in message, message
    match = re.search(r"error id (err-[0-9a-f]{16})", message)
    assert match is not None, message
    logged = [r.getMessage() for r in caplog.records if match.group(1) in r.getMessage()]
    assert logged and detail in logged[0], logged


def assert_engine_dead(server_url: str, engine) -> None:  # type: ignore[no-untyped-def]
    wait_for(lambda: not engine.is_alive(), timeout=10)
    health = httpx.get(f"{server_url}/health", timeout=10)
    assert health.status_code == 503 and health.json()["status"] == "error"
    r = httpx.post(f"{server_url}/v1/completions", json={"model": MODEL, "prompt": [5, 6]}, timeout=10)
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
    with pytest.raises(openai.InternalServerError):
        openai.OpenAI(base_url=f"{server_url}/v1", api_key="x", max_retries=0).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}]
        )
    assert 'pagecast_engine_alive{model_name="tiny"} 0.0' in httpx.get(f"{server_url}/metrics", timeout=10).text


def test_a_fault_inside_a_step_ends_every_request_with_an_error(tiny_llama_artifact, tmp_path, caplog):  # type: ignore[no-untyped-def]
    engine = make_engine(faulty_artifact(tiny_llama_artifact, tmp_path / "faulty", after=3))
    with serve({MODEL: engine}) as server:
        body = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 100, "ignore_eos": True}
        start = time.monotonic()
        events = stream_events(f"{server.url}/v1/completions", body)
        assert events[-1] == "data: [DONE]"
        err = json.loads(events[-2][len("data: ") :])["error"]
        assert err["type"] == "server_error" and err["code"] == "engine_dead"
        assert_details_only_in_the_log(err["message"], caplog)
        assert time.monotonic() - start < 30
        assert_engine_dead(server.url, engine)


def test_a_fault_during_a_non_streamed_request_is_a_503(tiny_llama_artifact, tmp_path, caplog):  # type: ignore[no-untyped-def]
    engine = make_engine(faulty_artifact(tiny_llama_artifact, tmp_path / "faulty", after=5))
    with serve({MODEL: engine}) as server:
        r = httpx.post(
            f"{server.url}/v1/completions",
            json={"model": MODEL, "prompt": [5, 6], "max_tokens": 400, "ignore_eos": True},
            timeout=60,
        )
        assert r.status_code == 503, r.text
        err = r.json()["error"]
        assert err["code"] == "engine_dead"
        assert_details_only_in_the_log(err["message"], caplog)


def test_a_killed_engine_process_ends_streams_with_an_error(tiny_llama_artifact, caplog):  # type: ignore[no-untyped-def]
    engine = make_engine(tiny_llama_artifact)
    with serve({MODEL: engine}) as server:
        url = f"{server.url}/v1/completions"
        body = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 400, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", url, json=body, timeout=60) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            first = next(line for line in lines if line)
            assert first.startswith("data: {")
            os.kill(engine._client.process.pid, signal.SIGKILL)  # the core dies mid-stream
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]"
        err = json.loads(rest[-2][len("data: ") :])["error"]
        assert err["code"] == "engine_dead"
        assert_details_only_in_the_log(err["message"], caplog, "exited unexpectedly")
        assert_engine_dead(server.url, engine)


def test_engine_serve_exits_with_status_1_when_its_engine_dies(tiny_llama_artifact, tmp_path):  # type: ignore[no-untyped-def]
    artifact = faulty_artifact(tiny_llama_artifact, tmp_path / "faulty", after=2)
    log = tmp_path / "serve.log"
    proc, base = start_engine_serve(
        [str(artifact), "--served-model-name", MODEL, "--kv-cache-memory", "16MiB"], log
    )
    try:
        r = httpx.post(
            f"{base}/v1/completions", json={"model": MODEL, "prompt": [5, 6], "max_tokens": 50, "ignore_eos": True},
            timeout=60,
        )
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
        assert proc.wait(timeout=60) == 1, log.read_text()
        assert "supervisor restarts the server" in log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_the_core_exits_when_its_server_is_killed(tiny_llama_artifact):  # type: ignore[no-untyped-def]
    """No orphan: a core whose server died (SIGKILL, no shutdown message) ends by itself."""
    code = (
        "import sys, time\n"
        "from pagecast.runtime import AsyncEngine\n"
        f"e = AsyncEngine.from_artifact({str(tiny_llama_artifact)!r}, kv_cache_memory='16MiB')\n"
        "print(e._client.process.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    server = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        core_pid = int(server.stdout.readline())  # type: ignore[union-attr]
    finally:
        server.kill()
        server.wait()

    def core_gone() -> bool:
        try:
            os.kill(core_pid, 0)
        except ProcessLookupError:
            return True
        # A zombie (exited, not yet reaped by init) counts as gone.
        stat = Path(f"/proc/{core_pid}/stat")
        return not stat.exists() or stat.read_text().split()[2] == "Z"

    wait_for(core_gone, timeout=30)
