"""How an engine-core process ends: only when its server says so or dies, and never leaving
anything behind.

A core whose server was killed while it was busy must exit by itself (within seconds: it holds
the device's memory); a core that failed to start or whose loop failed must exit and leave no
temporary files (its private copy of the artifact's Triton cache among them); and a signal to
the whole process group of engine-serve (systemd's stop, Ctrl-C in a terminal) must drain the
in-flight streams exactly as a signal to the server alone does.

Temporary files are counted in a TMPDIR of the test's own, which the processes inherit.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import pytest
from server_support import make_engine, wait_for
from test_engine_process import faulty_artifact

from pagecast.runtime.core_process import CoreClient
from pagecast.runtime.messages import CoreFailed


def _rehash(artifact: Path, rel: str) -> None:
    manifest = json.loads((artifact / "manifest.json").read_text())
    manifest["files"][rel] = hashlib.sha256((artifact / rel).read_bytes()).hexdigest()
    (artifact / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True))


def with_triton_cache(artifact: Path) -> Path:
    """Give ``artifact`` a (listed) Triton cache, so that the core makes its private copy in /tmp
    as it does on a GPU."""
    rel = "triton_cache/abc/__grp__kernel.json"
    (artifact / rel).parent.mkdir(parents=True)
    (artifact / rel).write_text(json.dumps({"child_paths": {"kernel.json": "/gone/kernel.json"}}))
    _rehash(artifact, rel)
    return artifact


@pytest.fixture
def private_tmp(tmp_path, monkeypatch):  # type: ignore[no-untyped-def]
    """A TMPDIR of this test's own, for this process and every child."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    return tmp


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    stat = Path(f"/proc/{pid}/stat")  # a zombie (exited, not yet reaped) counts as gone
    try:
        return stat.read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def leftovers(tmp: Path, prefix: str = "pagecast-") -> list[str]:
    return sorted(p.name for p in tmp.iterdir() if p.name.startswith(prefix))


def run_files(tmp: Path) -> list[str]:
    """Everything under the one run directory in ``tmp`` (the core keeps its files there)."""
    (run,) = [p for p in tmp.iterdir() if p.name.startswith("pagecast-run-")]
    assert leftovers(tmp) == [run.name]
    return sorted(str(p.relative_to(run)) for p in run.rglob("*"))


def kill_and_wait_for_core(server: subprocess.Popen[str], core_pid: int) -> None:
    """SIGKILL the server; its core must be gone within 10 s."""
    server.kill()
    server.wait()
    start = time.monotonic()
    wait_for(lambda: gone(core_pid), timeout=10)
    assert time.monotonic() - start < 10


ORPHAN_SERVER = """
import asyncio, sys
from pagecast.runtime import AsyncEngine
from pagecast.runtime.sampling_params import SamplingParams

engine = AsyncEngine.from_artifact(sys.argv[1], kv_cache_memory="16MiB")

async def one(i):
    params = SamplingParams(max_tokens=engine.max_model_len - 8, temperature=1.0, ignore_eos=True)
    async for out in engine.generate([5, 6, 7], params):
        if i == 0 and len(out.outputs[0].token_ids) == 3:
            print(engine._client.process.pid, flush=True)  # busy now: the test kills us

async def main():
    await asyncio.gather(*(one(i) for i in range(8)))
    print("finished before the test killed us", flush=True)

asyncio.run(main())
"""


def test_a_busy_core_whose_server_is_killed_exits_within_10_s(tiny_llama_artifact, tmp_path, private_tmp):  # type: ignore[no-untyped-def]
    artifact = with_triton_cache(shutil.copytree(tiny_llama_artifact, tmp_path / "art"))
    server = subprocess.Popen(
        [sys.executable, "-c", ORPHAN_SERVER, str(artifact)], stdout=subprocess.PIPE, text=True
    )
    try:
        line = server.stdout.readline()  # type: ignore[union-attr]
        core_pid = int(line)
        kill_and_wait_for_core(server, core_pid)  # mid-generation: 8 streams of ~500 tokens still running
    finally:
        if server.poll() is None:
            server.kill()
    # The core removed its temporary files (the Triton cache copy too) and, its server being
    # dead, the run's directory with the sockets.
    wait_for(lambda: leftovers(private_tmp) == [], timeout=5)


STARTING_SERVER = """
import sys, time
from pagecast.runtime.core_process import CoreClient

client = CoreClient(sys.argv[1], {"kv_cache_memory": "16MiB"})
print(client.process.pid, flush=True)
time.sleep(600)  # the test kills us while the core loads
"""

SLOW_LOAD = """
import os as _os, time as _time
open(_os.environ["PAGECAST_TEST_LOADING"], "w").close()
_time.sleep(120)  # a load that takes minutes (a large artifact, graph capture)
"""


def test_a_core_whose_server_is_killed_while_it_starts_exits_within_10_s(tiny_llama_artifact, tmp_path, private_tmp, monkeypatch):  # type: ignore[no-untyped-def]
    """The loop checks its server between steps; a core still loading the artifact (minutes on a
    large model, holding device memory) must notice its server's death too."""
    artifact = shutil.copytree(tiny_llama_artifact, tmp_path / "art")
    (artifact / "model.py").write_text((artifact / "model.py").read_text() + SLOW_LOAD)
    _rehash(artifact, "model.py")
    loading = tmp_path / "loading"
    monkeypatch.setenv("PAGECAST_TEST_LOADING", str(loading))
    server = subprocess.Popen([sys.executable, "-c", STARTING_SERVER, str(artifact)], stdout=subprocess.PIPE, text=True)
    core_pid = None
    try:
        core_pid = int(server.stdout.readline())  # type: ignore[union-attr]
        wait_for(loading.exists, timeout=120)  # the core is inside the artifact's load
        kill_and_wait_for_core(server, core_pid)
    finally:
        if server.poll() is None:
            server.kill()
        if core_pid is not None and not gone(core_pid):
            os.kill(core_pid, signal.SIGKILL)
    wait_for(lambda: leftovers(private_tmp) == [], timeout=5)  # the run's directory went with it


def test_a_core_that_fails_to_start_exits_and_leaves_no_temp_files(tiny_llama_artifact, tmp_path, private_tmp):  # type: ignore[no-untyped-def]
    artifact = with_triton_cache(shutil.copytree(tiny_llama_artifact, tmp_path / "art"))
    weights = artifact / "weights" / "rank0.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0xFF
    weights.write_bytes(bytes(data))
    client = CoreClient(str(artifact), {"kv_cache_memory": "16MiB"})
    try:
        result = client.wait_ready(60)
        assert isinstance(result, CoreFailed) and result.kind == "artifact", result
        assert "does not match the manifest" in result.message
        assert client.process.wait(timeout=10) == 2  # by itself: nobody asked it to stop
        assert run_files(private_tmp) == ["in", "out", "owner"]  # its temporary files are gone
    finally:
        client.shutdown(timeout=5)
    assert leftovers(private_tmp) == []  # and the server's side removed the run's directory


def test_a_core_whose_loop_fails_exits_and_leaves_no_temp_files(tiny_llama_artifact, tmp_path, private_tmp):  # type: ignore[no-untyped-def]
    import asyncio

    from pagecast.runtime.errors import EngineDeadError
    from pagecast.runtime.sampling_params import SamplingParams

    artifact = with_triton_cache(faulty_artifact(tiny_llama_artifact, tmp_path / "art", after=3))
    engine = make_engine(artifact)
    try:

        async def run() -> None:
            async for _ in engine.generate([5, 6, 7], SamplingParams(max_tokens=50, ignore_eos=True)):
                pass

        with pytest.raises(EngineDeadError, match="simulated device failure"):
            asyncio.run(run())
        assert engine._client.process.wait(timeout=10) == 1
        assert run_files(private_tmp) == ["in", "out", "owner"]
    finally:
        engine.shutdown()
    assert leftovers(private_tmp) == []


# -- a signal to engine-serve's whole process group --------------------------------------------


def _start_in_own_group(artifact: Path, log: Path) -> tuple[subprocess.Popen[bytes], str]:
    """engine-serve as the leader of a process group of its own (as under systemd or a shell),
    so the test can signal the group without signalling itself."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    from server_support import engine_serve_command

    proc = subprocess.Popen(
        [*engine_serve_command(), str(artifact), "--served-model-name", "tiny", "--kv-cache-memory", "16MiB", "--port", str(port),
         "--shutdown-timeout", "120"],  # a slow CI machine still drains: a timeout would abort the streams
        stdout=subprocess.DEVNULL, stderr=log.open("wb"), start_new_session=True,
    )
    base = f"http://127.0.0.1:{port}"

    def up() -> bool:
        assert proc.poll() is None, log.read_text()
        try:
            return httpx.get(f"{base}/health", timeout=1).status_code == 200
        except httpx.TransportError:
            return False

    wait_for(up, timeout=120, interval=0.2)
    return proc, base


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_to_the_process_group_lets_in_flight_streams_finish(sig, tiny_llama_artifact, tmp_path):  # type: ignore[no-untyped-def]
    proc, base = _start_in_own_group(tiny_llama_artifact, tmp_path / "serve.log")
    num_streams, max_tokens = 4, 40
    started = threading.Barrier(num_streams + 1)
    events: dict[int, list[str]] = {}

    def stream(i: int) -> None:
        body = {"model": "tiny", "prompt": [5, 6, 7 + i], "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
        lines = []
        with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=60) as r:
            it = (line for line in r.iter_lines() if line)
            lines.append(next(it))
            started.wait()
            lines.extend(it)
        events[i] = lines

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(num_streams)]
    try:
        for t in threads:
            t.start()
        started.wait(timeout=60)
        os.killpg(proc.pid, sig)  # every process of the group: the server and its engine core
        for t in threads:
            t.join(60)
        assert proc.wait(timeout=60) == 0, (tmp_path / "serve.log").read_text()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    log = (tmp_path / "serve.log").read_text()
    for i in range(num_streams):
        lines = events[i]
        assert lines[-1] == "data: [DONE]", (lines[-3:], log)
        chunks = [json.loads(line[len("data: "):]) for line in lines[:-1]]
        assert all("error" not in c for c in chunks), (chunks[-2:], log)
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert len([c for c in chunks if c["choices"] and c["choices"][0]["text"] is not None]) >= 1
    assert "exited unexpectedly" not in log


def test_a_core_that_does_not_start_in_time_is_killed_and_reported(tiny_llama_artifact, private_tmp):  # type: ignore[no-untyped-def]
    """Start-up has a deadline: a core stuck loading (a hung file system, a wedged device)
    becomes an error engine-serve exits on, not a server that waits for ever."""
    client = CoreClient(str(tiny_llama_artifact), {"kv_cache_memory": "16MiB"}, start_timeout_s=0.3)
    try:
        result = client.wait_ready(30)
        assert isinstance(result, CoreFailed) and "did not start within 0.3 s" in result.message
        assert client.process.wait(timeout=10) == -signal.SIGKILL
    finally:
        client.shutdown(timeout=5)
    assert leftovers(private_tmp) == []


def test_sending_to_a_core_busy_in_a_long_step_never_blocks_the_server(tiny_llama_artifact, private_tmp):  # type: ignore[no-untyped-def]
    """``CoreClient.send`` runs on the server's event loop: a burst of messages while the core is
    inside one long step (a CPU prefill, a graph capture) must queue, not stall every stream and
    /health until the core reads. Past ZeroMQ's default high-water mark (1,000 messages) the
    send blocked, up to hang_timeout_s, and then the core was killed as hung."""
    from pagecast.runtime.messages import AbortRequests

    client = CoreClient(str(tiny_llama_artifact), {"kv_cache_memory": "16MiB"}, hang_timeout_s=3.0)
    try:
        assert not isinstance(client.wait_ready(120), CoreFailed)
        os.kill(client.process.pid, signal.SIGSTOP)  # a step that does not return for now
        try:
            start = time.monotonic()
            for i in range(20_000):
                client.send(AbortRequests([f"r{i}"]))
            elapsed = time.monotonic() - start
        finally:
            os.kill(client.process.pid, signal.SIGCONT)
        assert elapsed < 2.0, elapsed
        assert client.failed is None and client.is_alive()
    finally:
        client.shutdown(timeout=10)
