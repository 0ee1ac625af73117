"""The channel between a server and its engine core is private, and its receiver never dies
silently.

Another process of the same user that knows the socket paths (they are no secret: they are
in the server's memory and in /proc) must neither receive requests nor inject messages
(forged outputs that become a user's tokens, a forged failure that kills the engine). A frame
that is not a valid message is logged and dropped; an error the receiver cannot recover from
marks the engine dead; and the watchdog still notices a dead core while the receiver is stuck.
"""

from __future__ import annotations

import asyncio
import os
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import msgspec
import pytest
import zmq
from server_support import make_engine, wait_for

from pagecast.runtime import ipc
from pagecast.runtime.errors import EngineDeadError
from pagecast.runtime.messages import (
    AddRequest,
    EngineStats,
    StepOutputs,
)
from pagecast.runtime.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)

# The intruder: a second process of the same user with the socket paths, trying every way in
# that needs no secret: plain sockets, and CURVE with a key pair of its own.
INTRUDER = """
import sys, time, zmq, msgspec
from pagecast.runtime.messages import CoreFailed, EngineStats, SequenceUpdate, StepOutputs

inbox, outbox = sys.argv[1], sys.argv[2]
ctx = zmq.Context()
stolen = []
thieves, forgers = [], []
for curve in (False, True):
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    for s in (pull, push):
        s.linger = 0
        if curve:
            server_public, _ = zmq.curve_keypair()  # a guess: the real one is never shown
            s.curve_serverkey = server_public
            s.curve_publickey, s.curve_secretkey = zmq.curve_keypair()
    pull.connect(inbox)
    push.connect(outbox)
    thieves.append(pull)
    forgers.append(push)
stats = EngineStats(0, 0, 1, 0, 0.0, 0, 0, 0, 0, 0)
forged = [
    msgspec.msgpack.encode(StepOutputs([SequenceUpdate("victim", [13, 13, 13], 1)], stats)),
    msgspec.msgpack.encode(CoreFailed("engine", "forged failure")),
]
print("ready", flush=True)
deadline = time.monotonic() + float(sys.argv[3])
while time.monotonic() < deadline:
    for push in forgers:
        for frame in forged:
            try:
                push.send(frame, zmq.NOBLOCK)
            except zmq.Again:
                pass
    for pull in thieves:
        while pull.poll(0):
            stolen.append(pull.recv())
    time.sleep(0.02)
print("stolen", len(stolen), flush=True)
"""


@pytest.fixture(scope="module")
def engine(tiny_llama_artifact):  # type: ignore[no-untyped-def]
    """One engine for the tests that leave it alive (each starts in seconds, not none)."""
    engine = make_engine(tiny_llama_artifact)
    yield engine
    engine.shutdown()


def _generate(engine, request_id: str) -> list[int]:  # type: ignore[no-untyped-def]
    async def run() -> list[int]:
        async def one() -> list[int]:
            async for out in engine.generate([5, 6, 7], GREEDY, request_id=request_id):
                last = out
            return list(last.outputs[0].token_ids)

        return await asyncio.wait_for(one(), timeout=60)

    return asyncio.run(run())


def test_another_process_of_the_user_can_neither_receive_nor_inject(engine):  # type: ignore[no-untyped-def]
    client = engine._client
    expected = _generate(engine, "warm")
    intruder = subprocess.Popen(
        [sys.executable, "-c", INTRUDER, client._inbox_addr, client._outbox_addr, "6"],
        stdout=subprocess.PIPE, text=True,
    )
    try:
        assert intruder.stdout.readline().strip() == "ready"  # type: ignore[union-attr]
        time.sleep(1.0)  # its connections are up (or refused)
        got = [_generate(engine, "victim") for _ in range(3)]  # while it forges and listens
        out, _ = intruder.communicate(timeout=60)
    finally:
        if intruder.poll() is None:
            intruder.kill()
    assert out.split() == ["stolen", "0"]  # not one request reached it
    assert got == [expected] * 3  # no forged token became a user's
    assert engine.is_alive() and client.failed is None  # the forged CoreFailed changed nothing


def test_the_sockets_and_the_secret_are_not_where_others_look(engine):  # type: ignore[no-untyped-def]
    client = engine._client
    run_dir = Path(client._inbox_addr[len("ipc://"):]).parent
    assert stat.S_IMODE(run_dir.stat().st_mode) == 0o700 and run_dir.stat().st_uid == os.getuid()
    secret = client._channel.peer_secret()
    pid = client.process.pid
    for key in [v for k, v in secret.items() if k in ("secret", "password", "server_public")]:
        assert key.encode() not in Path(f"/proc/{pid}/cmdline").read_bytes()
        assert key.encode() not in Path(f"/proc/{pid}/environ").read_bytes()


def test_a_malformed_frame_is_dropped_and_the_engine_serves_on(engine, caplog):  # type: ignore[no-untyped-def]
    client = engine._client
    ctx = zmq.Context()
    # A peer holding the secret (as a buggy core would be) sends what no core should.
    push = ipc.connect(ctx, zmq.PUSH, client._outbox_addr, client._channel.peer_secret())
    try:
        expected = _generate(engine, "a")
        push.send(b"\x93\xa5bogus\x01" + b"\x00" * 11)  # 19 bytes of nonsense
        push.send(msgspec.msgpack.encode(AddRequest("x", [1], GREEDY, 1, 0.0)))  # a message of the wrong side
        push.send(msgspec.msgpack.encode(StepOutputs([], EngineStats(0, 0, 1, 0, 0.0, 0, 0, 0, 0, 0))))
        wait_for(lambda: sum("dropped a malformed frame" in r.getMessage() for r in caplog.records) >= 2, timeout=10)
        assert _generate(engine, "b") == expected
        assert engine.is_alive()
    finally:
        push.close(0)
        ctx.term()


def test_a_receiver_that_cannot_go_on_marks_the_engine_dead(tiny_llama_artifact):  # type: ignore[no-untyped-def]
    engine = make_engine(tiny_llama_artifact)
    client = engine._client

    class Broken:
        def decode(self, data: object) -> object:
            raise RuntimeError("the channel is unusable")

    try:
        client._decoder = Broken()

        async def run() -> None:
            async for _ in engine.generate([5, 6, 7], SamplingParams(max_tokens=50, ignore_eos=True)):
                pass

        with pytest.raises(EngineDeadError, match="channel to the engine core failed"):
            asyncio.run(asyncio.wait_for(run(), timeout=60))
        assert not engine.is_alive()
        wait_for(lambda: client.process.poll() is not None, timeout=10)  # and the core was stopped
    finally:
        engine.shutdown()


def test_the_watchdog_notices_a_dead_core_while_the_receiver_is_stuck(tiny_llama_artifact):  # type: ignore[no-untyped-def]
    engine = make_engine(tiny_llama_artifact)
    client = engine._client
    stuck, release = threading.Event(), threading.Event()

    def on_message(msg: object) -> None:
        if isinstance(msg, StepOutputs):
            stuck.set()
            release.wait(60)  # a callback that blocks: the receiver thread goes nowhere

    try:
        client.attach(on_message, busy=lambda: True)
        client.send(AddRequest("r", [5, 6, 7], GREEDY, 8, time.monotonic()))
        assert stuck.wait(30)
        os.kill(client.process.pid, signal.SIGKILL)
        wait_for(lambda: client.failed is not None, timeout=5)
        assert "exited unexpectedly" in client.failed.message  # type: ignore[union-attr]
        assert not engine.is_alive()
    finally:
        release.set()
        engine.shutdown()


def test_forged_messages_never_reach_the_engine_on_a_curve_less_libzmq(monkeypatch, tmp_path):  # type: ignore[no-untyped-def]
    """Where libzmq lacks CURVE the per-run password still keeps strangers out."""
    monkeypatch.setattr(zmq, "has", lambda feature: feature != "curve")
    ctx = zmq.Context()
    server = ipc.PrivateServer(ctx)
    pull = server.bind(zmq.PULL, "out")
    other = zmq.Context()
    stranger = other.socket(zmq.PUSH)
    stranger.linger = 0
    stranger.plain_username, stranger.plain_password = b"core", b"guess"
    stranger.connect(server.address("out"))
    peer = ipc.connect(other, zmq.PUSH, server.address("out"), server.peer_secret())
    try:
        assert server.mechanism == "plain"
        stranger.send(b"forged")  # queued on its side, never admitted to ours
        peer.send(b"genuine")
        assert pull.poll(5000) and pull.recv() == b"genuine"
        assert not pull.poll(500)
    finally:
        for s in (stranger, peer):
            s.close(0)
        pull.close()
        server.close()
        other.term()
        ctx.term()


def test_a_new_server_removes_the_run_directories_of_killed_servers(tmp_path, monkeypatch):  # type: ignore[no-untyped-def]
    """A server killed outright (SIGKILL, the OOM killer) cannot remove its run directory, which
    holds its cores' copies of the artifacts' Triton caches: the next server of the user does.
    Live servers' directories, and directories that name no owner, are left alone."""
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()

    def run_dir(name: str, owner: str | None) -> Path:
        path = tmp_path / name
        (path / "core-tmp-x").mkdir(parents=True)
        (path / "core-tmp-x" / "kernel.cubin").write_bytes(b"\0" * 1024)
        if owner is not None:
            (path / ipc.OWNER).write_text(owner)
        return path

    killed = run_dir("pagecast-run-killed", f"{dead.pid} ")
    reused = run_dir("pagecast-run-reused", f"{os.getpid()} 1")  # our pid, but another start time
    live = run_dir("pagecast-run-live", f"{os.getpid()} {ipc._start_time(os.getpid())}")
    unowned = run_dir("pagecast-run-unowned", None)
    other = run_dir("pagecast-tp-x", f"{dead.pid} ")  # not a run directory
    ctx = zmq.Context()
    server = ipc.PrivateServer(ctx)
    try:
        assert not killed.exists() and not reused.exists()
        assert live.exists() and unowned.exists() and other.exists()
        mine = Path(server.dir)
        assert (mine / ipc.OWNER).read_text().split()[0] == str(os.getpid())
        assert ipc.sweep_stale_runs("pagecast-run-") == []  # a live server's directory stays
        assert mine.exists()
    finally:
        server.close()
        ctx.term()
