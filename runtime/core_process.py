"""The engine-core process and the client the server holds for it.

Each served model runs its ``EngineCore`` (scheduler, block pool, model runner, sampler) in a
process of its own, so the step loop never shares a GIL with HTTP handling, tokenizing,
detokenizing or SSE framing. Two ZeroMQ PUSH/PULL sockets over IPC connect it to the server:
requests and aborts go in, and one ``StepOutputs`` message per engine step comes out with
every sequence's new tokens (``messages.py`` has the message types).

``CoreClient`` (server side) starts the process, sends messages and receives them on a
thread of its own, which notices within ``LIVENESS_INTERVAL_S`` that the process died or
stopped answering, so that in-flight requests get an error instead of waiting forever.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import uuid
from collections.abc import Callable
from typing import Any

import msgspec
import zmq

from pagecast.runtime.kernel_cache import process_compiles
from pagecast.runtime.messages import (
    AbortRequests,
    AddRequest,
    CoreFailed,
    CoreMessage,
    CoreReady,
    EngineStats,
    FrontEndMessage,
    LogprobEntry,
    RequestFailure,
    SequenceUpdate,
    Shutdown,
    StepOutputs,
)
from pagecast.runtime.outputs import Logprob, PositionLogprobs

logger = logging.getLogger("pagecast.engine")

LIVENESS_INTERVAL_S = 0.2  # how often the receiver checks that the process is still there
IDLE_POLL_MS = 1000  # an idle core wakes this often to check that its server is still there


# -- the process side -------------------------------------------------------------------------


def _entry(position: PositionLogprobs) -> LogprobEntry:
    items = list(position.items())
    return LogprobEntry([t for t, _ in items], [lp.logprob for _, lp in items], [lp.rank for _, lp in items])


def position_logprobs(entry: LogprobEntry) -> PositionLogprobs:
    return {t: Logprob(lp, r) for t, lp, r in zip(entry.token_ids, entry.logprobs, entry.ranks)}


def step_updates(result: Any) -> list[SequenceUpdate]:
    """A core StepResult as wire updates: one per sequence that got a token or prompt logprobs."""
    updates = []
    for req in result.updated:
        rid = req.request_id
        lp = result.logprobs.get(rid)
        plp = result.prompt_logprobs.get(rid)
        m = req.metrics
        updates.append(
            SequenceUpdate(
                rid,
                [req.output_token_ids[-1]],
                int(req.status) if req.is_finished else 0,
                req.stop_reason if req.is_finished else None,
                None if lp is None else [_entry(lp)],
                None if plp is None else [_entry(p) for p in plp],
                m.first_scheduled_time,
                m.num_cached_tokens,
                m.num_preemptions,
            )
        )
    got_token = {req.request_id for req in result.updated}
    for rid, plp in result.prompt_logprobs.items():
        if rid not in got_token:  # a prompt chunk that sampled nothing
            updates.append(SequenceUpdate(rid, [], prompt_logprobs=[_entry(p) for p in plp]))
    return updates


def run_engine_core(
    artifact: str,
    options: dict[str, Any],
    input_addr: str,
    output_addr: str,
    log_setup: tuple[str, int],
    spawned_at: float | None = None,
) -> None:
    """The engine-core process: start the core, say ready, then loop over messages and steps.
    ``spawned_at`` (the server's ``time.time()`` when it started this process) times the
    interpreter's own start for the start-up log."""
    entered = time.time()
    from pagecast.runtime.server.logs import configure_logging

    configure_logging(*log_setup)
    from pagecast.runtime import startup

    startup.begin("core").mark("spawn")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the server drains, then stops us
    server_pid = os.getppid()
    ctx = zmq.Context()
    inbox = ctx.socket(zmq.PULL)
    inbox.connect(input_addr)
    outbox = ctx.socket(zmq.PUSH)
    outbox.setsockopt(zmq.LINGER, 5000)
    outbox.connect(output_addr)
    encoder = msgspec.msgpack.Encoder()
    decoder = msgspec.msgpack.Decoder(FrontEndMessage)

    from pagecast.runtime.engine_core import EngineCore, EngineOptions, log_startup, relax_gc
    from pagecast.runtime.errors import ArtifactError
    from pagecast.runtime.request import RequestStatus

    startup.mark("import")
    # Where the seconds before the engine's own go: the interpreter and this module's imports,
    # then torch and the engine's (the core's clock starts after them).
    before_core = {"import": time.time() - entered}
    if spawned_at is not None:
        before_core = {"spawn": entered - spawned_at, **before_core}

    # Every kernel the start-up and the serving compile (0 when the artifact's cache has them all).
    # The process's one recorder, made here first (so it counts from here); EngineCore's statistics
    # read the same one.
    compiles = process_compiles()
    try:
        t0 = time.perf_counter()
        core = EngineCore(artifact, EngineOptions(**options), load_tokenizer=False)
        core.startup_s["total"] = time.perf_counter() - t0
        core.startup_s = {**before_core, **core.startup_s}
    except BaseException as exc:  # noqa: BLE001 - every failure to start is reported, then the process ends
        kind = "artifact" if isinstance(exc, ArtifactError) else "value" if isinstance(exc, ValueError) else "engine"
        message = str(exc) if kind != "engine" else f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
        outbox.send(encoder.encode(CoreFailed(kind, message)))
        outbox.close()
        ctx.term()
        os._exit(2)
    compiled_at_start = compiles.count
    core.startup_s["triton_compiles_at_start"] = compiled_at_start
    if compiled_at_start:
        logger.warning(
            "compiled %d Triton kernels at start (the artifact's cache missed them): %s",
            compiled_at_start, ", ".join(sorted(set(compiles.names))),
        )
    startup.mark("ready")
    log_startup(core.model_name, core.startup_s)
    relax_gc(freeze=True)  # this process serves this one engine until it exits
    outbox.send(
        encoder.encode(
            CoreReady(
                model_name=core.model_name,
                max_model_len=core.max_model_len,
                max_num_seqs=core.options.max_num_seqs,
                vocab_size=core.vocab_size,
                eos_token_ids=sorted(core.eos_token_ids),
                num_kv_blocks=core.block_pool.num_blocks,
                block_size=core.block_size,
                device=str(core.artifact.device),
                startup_s=core.startup_s,
            )
        )
    )
    poller = zmq.Poller()
    poller.register(inbox, zmq.POLLIN)
    try:
        while True:
            busy = core.has_unfinished_requests()
            if not busy and not poller.poll(IDLE_POLL_MS):
                if os.getppid() != server_pid:
                    break  # the server is gone: nobody will read our outputs
                continue
            failed: dict[str, RequestFailure] = {}
            aborted: list[str] = []
            stop = False
            while True:  # every message waiting now, without blocking
                try:
                    frame = inbox.recv(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                msg = decoder.decode(frame.buffer)
                if isinstance(msg, AddRequest):
                    try:
                        core.add_request(
                            msg.request_id, msg.prompt_token_ids, msg.params, msg.max_tokens, msg.arrival_time
                        )
                    except Exception as exc:  # noqa: BLE001 - the request fails, the engine goes on
                        failed[msg.request_id] = RequestFailure.of(exc)
                elif isinstance(msg, AbortRequests):
                    aborted.extend(msg.sequence_ids)
                else:
                    stop = True
            if aborted:  # one pass over the queues for a storm of disconnects, not one per message
                core.finish(aborted, RequestStatus.FINISHED_ABORTED)
            if stop:
                break
            sent = False
            if core.has_unfinished_requests():
                results = core.step()
                # Requests whose grammar failed to compile in the background end like those that
                # add_request refused: with their error, in this step's message.
                failed.update((rid, RequestFailure.of(exc)) for rid, exc in core.take_failed().items())
                for result in results:
                    outbox.send(encoder.encode(StepOutputs(step_updates(result), core.stats(), failed)))
                    failed, sent = {}, True
            if not sent and (aborted or failed):
                outbox.send(encoder.encode(StepOutputs([], core.stats(), failed)))
    except BaseException as exc:  # the loop died: say why, then end (the server fails in-flight requests)
        logger.exception("engine core loop failed")
        try:
            outbox.send(encoder.encode(CoreFailed("engine", f"{type(exc).__name__}: {exc}")), zmq.NOBLOCK)
        except zmq.ZMQError:
            pass
        outbox.close()
        ctx.term()
        os._exit(1)
    # A kernel compiled while serving means the artifact's triton_cache missed it: say so.
    logger.info(
        "triton: %d kernels compiled while serving%s", compiles.count - compiled_at_start,
        f" ({', '.join(sorted(set(compiles.names[compiled_at_start:])))})" if compiles.count > compiled_at_start else "",
    )
    outbox.close()
    inbox.close()
    ctx.term()


# -- the server side --------------------------------------------------------------------------


class CoreClient:
    """Starts one engine-core process and talks to it.

    ``send`` may be called from any thread. Received messages are decoded on a receiver thread
    and handed to ``on_message``; when the process dies or stops answering while requests are
    in flight, ``on_message`` gets a ``CoreFailed``.
    """

    def __init__(
        self,
        artifact: str,
        options: dict[str, Any],
        on_message: Callable[[CoreMessage], None] | None = None,
        busy: Callable[[], bool] | None = None,
        hang_timeout_s: float = 120.0,
    ):
        # The callbacks may be attached later (``attach``): engine-serve starts every core before it
        # imports the rest of the server, so the cores' start-up overlaps that import.
        self._on_message = on_message or (lambda msg: None)
        self._busy = busy or (lambda: False)
        self._hang_timeout_s = hang_timeout_s
        base = os.path.join(tempfile.gettempdir(), f"pagecast-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        self._ctx = zmq.Context()
        self._inbox_addr, self._outbox_addr = f"ipc://{base}-in", f"ipc://{base}-out"
        self._to_core = self._ctx.socket(zmq.PUSH)
        self._to_core.setsockopt(zmq.LINGER, 0)
        self._to_core.bind(self._inbox_addr)
        self._from_core = self._ctx.socket(zmq.PULL)
        self._from_core.bind(self._outbox_addr)
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(CoreMessage)
        self._send_lock = threading.Lock()
        self._closing = False
        self.failed: CoreFailed | None = None
        # A fresh interpreter running this module (not multiprocessing's spawn, which would import
        # the caller's __main__ again): its arguments are one JSON document on the command line.
        args = json.dumps(
            {
                "artifact": artifact,
                "options": options,
                "input_addr": self._inbox_addr,
                "output_addr": self._outbox_addr,
                "log_setup": _log_setup(),
                "spawned_at": time.time(),
            }
        )
        self.name = f"pagecast-core-{os.path.basename(os.path.normpath(artifact))}"
        self.process = subprocess.Popen([sys.executable, "-m", "pagecast.runtime.core_process", args])
        self._ready = threading.Event()
        self.ready: CoreReady | None = None
        self._receiver = threading.Thread(target=self._receive, name=self.name + "-rx", daemon=True)
        self._receiver.start()

    def attach(self, on_message: Callable[[CoreMessage], None], busy: Callable[[], bool]) -> None:
        self._on_message = on_message
        self._busy = busy

    def wait_ready(self, timeout: float | None = None) -> CoreReady | CoreFailed:
        if not self._ready.wait(timeout):
            raise TimeoutError(f"the engine core did not start within {timeout} s")
        return self.ready if self.ready is not None else self.failed  # type: ignore[return-value]

    def send(self, message: FrontEndMessage) -> None:
        data = self._encoder.encode(message)
        with self._send_lock:
            if not self._closing:
                self._to_core.send(data, copy=False)

    def is_alive(self) -> bool:
        return self.failed is None and self.process.poll() is None

    def shutdown(self, timeout: float = 10.0) -> None:
        """Ask the core to stop, wait for it (killing it past ``timeout``), release the sockets."""
        if self.process.poll() is None:
            with self._send_lock:
                if not self._closing:
                    self._to_core.send(self._encoder.encode(Shutdown()))
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)
        with self._send_lock:
            self._closing = True
        self._receiver.join(2 * LIVENESS_INTERVAL_S + 1)
        for path in (self._inbox_addr, self._outbox_addr):
            try:
                os.unlink(path[len("ipc://"):])
            except OSError:
                pass

    def _fail(self, kind: str, message: str) -> None:
        if self.failed is None:
            self.failed = CoreFailed(kind, message)
            self._ready.set()
            self._on_message(self.failed)

    def _receive(self) -> None:
        poller = zmq.Poller()
        poller.register(self._from_core, zmq.POLLIN)
        last_heard = time.monotonic()
        while True:
            if self._closing and not poller.poll(0):
                break
            if not poller.poll(int(LIVENESS_INTERVAL_S * 1000)):
                if self._closing:
                    break
                if self.process.poll() is not None:
                    if self.failed is None:
                        self._fail(
                            "engine",
                            f"the engine-core process exited unexpectedly (exit code {self.process.returncode})",
                        )
                    break
                if self._ready.is_set() and self._busy() and time.monotonic() - last_heard > self._hang_timeout_s:
                    self._fail("engine", f"the engine core sent nothing for {self._hang_timeout_s:.0f} s; it was killed")
                    self.process.kill()
                    break
                if not self._busy():
                    last_heard = time.monotonic()
                continue
            last_heard = time.monotonic()
            frame = self._from_core.recv(copy=False)
            msg = self._decoder.decode(frame.buffer)
            if isinstance(msg, CoreReady):
                self.ready = msg
                self._ready.set()
                continue
            if isinstance(msg, CoreFailed):
                self._fail(msg.kind, msg.message)
                continue
            self._on_message(msg)
        self._from_core.close(linger=0)
        with self._send_lock:
            self._closing = True
            self._to_core.close(linger=0)
        self._ctx.term()


def _log_setup() -> tuple[str, int]:
    """The server's log format and level, for the core's own log lines."""
    from pagecast.runtime.server.logs import JSONFormatter

    root = logging.getLogger()
    json_format = any(isinstance(h.formatter, JSONFormatter) for h in root.handlers)
    level = logging.getLogger("pagecast").getEffectiveLevel()
    return ("json" if json_format else "text", level)


__all__ = ["CoreClient", "EngineStats", "position_logprobs", "run_engine_core"]


if __name__ == "__main__":
    _args = json.loads(sys.argv[1])
    run_engine_core(
        _args["artifact"], _args["options"], _args["input_addr"], _args["output_addr"], tuple(_args["log_setup"]),
        _args.get("spawned_at"),
    )
