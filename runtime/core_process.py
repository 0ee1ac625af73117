"""The engine-core process and the client the server holds for it.

Each served model runs its ``EngineCore`` (scheduler, block pool, model runner, sampler) in a
process of its own, so the step loop never shares a GIL with HTTP handling, tokenizing,
detokenizing or SSE framing. Two ZeroMQ PUSH/PULL sockets over IPC connect it to the server:
requests and aborts go in, and one ``StepOutputs`` message per engine step comes out with
every sequence's new tokens (``messages.py`` has the message types). The sockets are private
to the run (``ipc.py``: a 0700 directory and a per-run CURVE key pair handed over stdin).

``CoreClient`` (server side) starts the process, sends messages and receives them on a
thread of its own; a watchdog thread notices within ``LIVENESS_INTERVAL_S`` that the process
died or stopped answering, so that in-flight requests get an error instead of waiting forever.

The core ends only when its server says so (``Shutdown``) or dies: it ignores SIGINT and
SIGTERM (a signal to the process group drains through the server), checks every step that
its server is still its parent, and sends with a timeout so that a dead reader cannot block
it. Every way out closes its sockets and removes its temporary files.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import msgspec
import zmq

from pagecast.runtime import ipc, startup
from pagecast.runtime.kernel_cache import prime_triton, process_compiles
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
# Lazy graphs: an idle core captures its next decode graph only once it has been idle this long,
# so that a request arriving just after another (or just after /health) does not wait for a
# capture (about 36 ms for an 8B model on an H200: one eager forward and the capture).
LAZY_CAPTURE_QUIET_S = 0.05
EXIT_GRACE_S = 0.5  # after the core exits, how long its last message has to arrive before we say "died"
# How long a core may take to start (load, verify, capture graphs) before engine-serve gives up.
START_TIMEOUT_S = float(os.environ.get("PAGECAST_START_TIMEOUT", "900"))
SEND_TIMEOUT_MS = 1000  # a send blocked this long checks that the server is still there
FLUSH_S = 2.0  # the longest a core's last message (CoreFailed) may take to leave on exit


def idle_poll(graphs_pending: bool, idle_s: float) -> tuple[bool, int]:
    """What an idle core does next: (capture a lazy graph now, then ms to poll for messages).
    With graphs to capture it captures once idle for LAZY_CAPTURE_QUIET_S (after a poll of 0 ms
    finds no message), else polls until then; with none it polls IDLE_POLL_MS."""
    if not graphs_pending:
        return False, IDLE_POLL_MS
    quiet_left = LAZY_CAPTURE_QUIET_S - idle_s
    if quiet_left <= 0:
        return True, 0
    return False, max(1, int(quiet_left * 1000 + 0.999))


# -- the process side -------------------------------------------------------------------------


def _entry(position: PositionLogprobs) -> LogprobEntry:
    items = list(position.items())
    return LogprobEntry([t for t, _ in items], [lp.logprob for _, lp in items], [lp.rank for _, lp in items])


def position_logprobs(entry: LogprobEntry) -> PositionLogprobs:
    return {t: Logprob(lp, r) for t, lp, r in zip(entry.token_ids, entry.logprobs, entry.ranks)}


def step_updates(result: Any) -> list[SequenceUpdate]:
    """A core StepResult as wire updates: one per sequence that got a token or prompt logprobs."""
    updates = []
    num_new = result.num_new_tokens
    for req in result.updated:
        rid = req.request_id
        lp = result.logprobs.get(rid)
        plp = result.prompt_logprobs.get(rid)
        m = req.metrics
        n = num_new.get(rid, 1) if num_new else 1
        updates.append(
            SequenceUpdate(
                rid,
                [req.output_token_ids[-1]] if n == 1 else req.output_token_ids[-n:],
                int(req.status) if req.is_finished else 0,
                req.stop_reason if req.is_finished else None,
                None if lp is None else [_entry(e) for e in lp],
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


class ServerGone(Exception):
    """The server that started this core is gone: nobody will read its outputs."""


class CoreChannel:
    """The core's ends of its two sockets. Every send has a timeout: a send that cannot go out
    (the server died, or stopped reading and ZeroMQ's high-water mark was reached) checks that
    the server is still there, so a core never blocks for ever on a dead reader."""

    def __init__(self, input_addr: str, output_addr: str, secret: dict[str, Any], server_pid: int):
        self.server_pid = server_pid
        self.ctx = zmq.Context()
        self.inbox = ipc.connect(self.ctx, zmq.PULL, input_addr, secret, unbounded=True)  # see CoreClient
        self.outbox = ipc.connect(self.ctx, zmq.PUSH, output_addr, secret)
        self.outbox.setsockopt(zmq.SNDTIMEO, SEND_TIMEOUT_MS)
        self.encoder = msgspec.msgpack.Encoder()

    def server_alive(self) -> bool:
        return os.getppid() == self.server_pid  # we were re-parented: the server died

    def check_server(self) -> None:
        if not self.server_alive():
            raise ServerGone()

    def send(self, message: CoreMessage, patience_s: float | None = None) -> None:
        """Send ``message``, waiting as long as the server lives (or at most ``patience_s``)."""
        data = self.encoder.encode(message)
        deadline = None if patience_s is None else time.monotonic() + patience_s
        waited = 0
        while True:
            try:
                self.outbox.send(data, copy=False)
                return
            except zmq.Again:
                self.check_server()
                if deadline is not None and time.monotonic() > deadline:
                    raise
                waited += 1
                if waited in (1, 60):  # once, and once more if it lasts: not a line a second
                    logger.warning("the server has not read the engine's outputs for %d s", waited * SEND_TIMEOUT_MS // 1000)

    def close(self, flush_s: float) -> None:
        """Close both sockets, then the context. ``flush_s`` bounds how long a message already
        sent (a CoreFailed) may still take to leave; never for ever, so ``term`` cannot hang."""
        self.inbox.close(linger=0)
        self.outbox.close(linger=int(flush_s * 1000) if self.server_alive() else 0)
        self.ctx.term()


def _private_tempdir(run_dir: str) -> str:
    """A temporary directory for everything this process writes (the private copy of the
    artifact's Triton cache, Triton's own scratch files, TP workers' files): pointing
    ``tempfile`` and TMPDIR at it means one ``rmtree`` on the way out removes them all. It lies
    inside the run's directory, which the server removes when it stops, so a core killed
    outright (SIGKILL, the OOM killer) leaves nothing behind either."""
    path = tempfile.mkdtemp(prefix="core-tmp-", dir=run_dir)
    tempfile.tempdir = path
    os.environ["TMPDIR"] = path
    return path


def run_engine_core(
    artifact: str,
    options: dict[str, Any],
    input_addr: str,
    output_addr: str,
    log_setup: tuple[str, int],
    secret: dict[str, Any],
    spawned_at: float | None = None,
    server_pid: int | None = None,
) -> int:
    """The engine-core process: start the core, say ready, then loop over messages and steps.
    Returns the exit status. Every way out closes the sockets and removes the process's
    temporary files. ``spawned_at`` (the server's ``time.time()`` when it started this process)
    times the interpreter's own start for the start-up log. ``server_pid`` is the server's
    process id (default: our parent's now); from its death on the core lives at most
    ``ipc.PARENT_POLL_S`` more, wherever it is (the loop's own check runs only between steps,
    and a start-up holding the device's memory can last minutes)."""
    entered = time.time()
    server_pid = os.getppid() if server_pid is None else server_pid
    from pagecast.runtime.server.logs import configure_logging

    configure_logging(*log_setup)

    startup.begin("core").mark("spawn")
    # A signal to the whole process group (Ctrl-C in a terminal, systemd's stop) must reach only
    # the server, which drains its streams and then tells us to stop: we end when it says so or dies.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    run_dir = os.path.dirname(input_addr[len("ipc://"):])
    ipc.exit_with_parent(server_pid, [run_dir], "pagecast-core-server")
    tmp = _private_tempdir(run_dir)
    channel: CoreChannel | None = None
    flush_s = 0.0
    server_gone = False
    try:
        channel = CoreChannel(input_addr, output_addr, secret, server_pid)
        code = _serve(channel, artifact, options, entered, spawned_at)
        flush_s = FLUSH_S if code else 0.0  # let the CoreFailed reach the server
        return code
    except ServerGone:
        logger.warning("the server is gone: the engine core exits")
        server_gone = True
        return 0
    finally:
        if channel is not None:
            channel.close(flush_s)
        # The run's directory is the server's to remove; a dead server never will.
        shutil.rmtree(run_dir if server_gone else tmp, ignore_errors=True)


def core_options(options: dict[str, Any]) -> Any:
    """An engine-core process's EngineOptions: ``options`` as given, served online (requests
    arrive while others stream) unless they say otherwise. Every online engine - engine-serve's,
    and AsyncEngine's from Python - runs in such a process; LLM's engine never does."""
    from pagecast.runtime.engine_core import EngineOptions

    return EngineOptions(**{"online": True, **options})


def _serve(channel: CoreChannel, artifact: str, options: dict[str, Any], entered: float, spawned_at: float | None) -> int:
    decoder = msgspec.msgpack.Decoder(FrontEndMessage)
    # Every kernel the start-up and the serving compile (0 when the artifact's cache has them all).
    # The process's one recorder, made first, before Triton is imported (so it counts from here);
    # EngineCore's statistics read the same one.
    compiles = process_compiles()
    from pagecast.runtime.engine_core import EngineCore  # imports torch

    # Triton's own cache key, hashed while the artifact loads. Only once torch is imported: a
    # thread importing Triton while this one imports torch could deadlock on their module locks
    # were either to import the other.
    prime_triton(artifact)
    from pagecast.runtime.errors import ArtifactError

    startup.mark("import")
    import torch

    startup.warn_if_uncached(torch)
    # Where the seconds before the engine's own go: the interpreter and this module's imports,
    # then torch and the engine's (the core's clock starts after them).
    before_core = {"import": time.time() - entered}
    if spawned_at is not None:
        before_core = {"spawn": entered - spawned_at, **before_core}

    try:
        t0 = time.perf_counter()
        core = EngineCore(artifact, core_options(options), load_tokenizer=False)
        core.startup_s["total"] = time.perf_counter() - t0
        core.startup_s = {**before_core, **core.startup_s}
    except BaseException as exc:  # noqa: BLE001 - every failure to start is reported, then the process ends
        kind = "artifact" if isinstance(exc, ArtifactError) else "value" if isinstance(exc, ValueError) else "engine"
        message = str(exc) if kind != "engine" else f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
        channel.send(CoreFailed(kind, message), patience_s=FLUSH_S)
        return 2
    try:
        return _loop(channel, core, decoder, compiles)
    finally:
        with contextlib.suppress(Exception):
            core.runner.close()  # tensor-parallel workers stop with us, on every way out


def _log_first_loads(loads: list[dict[str, str]], seen: int) -> int:
    """Say which kernels a request launched for the first time in this process (loaded from the
    artifact's cache at that launch, a few ms each, paid by that request); returns the new count."""
    for spec in loads[seen:]:
        logger.info("triton: first use while serving, loaded from the cache: %s (%s; %s)",
                    spec["name"], spec["attrs"], spec["constants"])
    return len(loads)


def _loop(channel: CoreChannel, core: Any, decoder: Any, compiles: Any) -> int:
    from pagecast.runtime.engine_core import log_startup, relax_gc
    from pagecast.runtime.request import RequestStatus

    compiled_at_start = compiles.count
    core.startup_s["triton_compiles_at_start"] = compiled_at_start
    if compiled_at_start:
        logger.warning(
            "compiled %d Triton kernels at start (the artifact's cache missed them): %s",
            compiled_at_start, ", ".join(sorted(set(compiles.names))),
        )
    startup.mark("ready")
    log_startup(core.model_name, core.startup_s)
    loads_seen = len(compiles.loads)
    relax_gc(freeze=True)  # this process serves this one engine until it exits
    channel.send(
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
            max_num_batched_tokens=core.options.max_num_batched_tokens,
            max_num_prefill_tokens=core.max_num_prefill_tokens,
            prefill_context_weight=core.scheduler.config.prefill_context_weight,
        )
    )
    inbox = channel.inbox
    poller = zmq.Poller()
    poller.register(inbox, zmq.POLLIN)
    active_at = time.monotonic()  # the last step or message (idle_poll's quiet spell counts from it)
    try:
        while True:
            channel.check_server()  # every step, not only when idle: a busy orphan must end too
            busy = core.has_unfinished_requests()
            if not busy:
                capture, wait_ms = idle_poll(core.runner.lazy_graphs_pending, time.monotonic() - active_at)
                if capture and not poller.poll(0):
                    core.runner.capture_while_idle()
                    continue
                if not poller.poll(wait_ms):
                    continue
            active_at = time.monotonic()
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
                            msg.request_id, msg.prompt_token_ids, msg.params, msg.max_tokens, msg.arrival_time,
                            msg.priority,
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
                    channel.send(StepOutputs(step_updates(result), core.stats(), failed))
                    failed, sent = {}, True
                if len(compiles.loads) > loads_seen:
                    loads_seen = _log_first_loads(compiles.loads, loads_seen)
            if not sent and (aborted or failed):
                channel.send(StepOutputs([], core.stats(), failed))
    except ServerGone:
        raise
    except BaseException as exc:  # the loop died: say why, then end (the server fails in-flight requests)
        logger.exception("engine core loop failed")
        with contextlib.suppress(zmq.ZMQError, ServerGone):
            channel.send(CoreFailed("engine", f"{type(exc).__name__}: {exc}"), patience_s=FLUSH_S)
        return 1
    # A kernel compiled while serving means the artifact's triton_cache missed it: say so.
    logger.info(
        "triton: %d kernels compiled while serving%s", compiles.count - compiled_at_start,
        f" ({', '.join(sorted(set(compiles.names[compiled_at_start:])))})" if compiles.count > compiled_at_start else "",
    )
    return 0


# -- the server side --------------------------------------------------------------------------


class CoreClient:
    """Starts one engine-core process and talks to it over a private channel (``ipc``).

    ``send`` may be called from any thread. Received messages are decoded on a receiver thread
    and handed to ``on_message``; a frame that is not a valid message is logged and dropped. A
    watchdog thread of its own (so that it still runs if the receiver is stuck in a callback)
    turns every way the core can stop serving into one ``CoreFailed`` for ``on_message``: the
    process died, it stopped answering while requests were in flight, it did not start within
    ``start_timeout_s``, or the channel itself failed.
    """

    def __init__(
        self,
        artifact: str,
        options: dict[str, Any],
        on_message: Callable[[CoreMessage], None] | None = None,
        busy: Callable[[], bool] | None = None,
        hang_timeout_s: float = 120.0,
        start_timeout_s: float | None = None,
    ):
        # The callbacks may be attached later (``attach``): engine-serve starts every core before it
        # imports the rest of the server, so the cores' start-up overlaps that import.
        self._on_message = on_message or (lambda msg: None)
        self._busy = busy or (lambda: False)
        self._hang_timeout_s = hang_timeout_s
        self._start_timeout_s = START_TIMEOUT_S if start_timeout_s is None else start_timeout_s
        self._ctx = zmq.Context()
        self._channel = ipc.PrivateServer(self._ctx)
        # ``send`` runs on the server's event loop, so it must never wait for the core: no limit on
        # the messages queued for it, on either end (ZeroMQ's default high-water marks, 1,000
        # messages, blocked the loop, and every stream and /health with it, behind a burst of
        # requests arriving during one long step). The server's admission bounds the queue; a
        # core that stops taking messages is a hang, which the watchdog reports once requests
        # wait on it.
        self._to_core = self._channel.bind(zmq.PUSH, "in", unbounded=True)
        # Should a send still block (the channel failing), this long is a stuck core.
        self._to_core.setsockopt(zmq.SNDTIMEO, int(self._hang_timeout_s * 1000))
        self._from_core = self._channel.bind(zmq.PULL, "out")
        self._inbox_addr, self._outbox_addr = self._channel.address("in"), self._channel.address("out")
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(CoreMessage)
        self._send_lock = threading.Lock()
        self._fail_lock = threading.Lock()
        self._closing = False
        self._stopping = False  # we asked the core to stop: its exit is expected, not a failure
        self._closed = False
        self.failed: CoreFailed | None = None
        self._last_heard = time.monotonic()
        # A fresh interpreter running this module (not multiprocessing's spawn, which would import
        # the caller's __main__ again). Its arguments, the channel's secret among them, go through
        # its stdin: a command line and an environment are readable by every process of the user.
        spec = json.dumps(
            {
                "artifact": artifact,
                "options": options,
                "input_addr": self._inbox_addr,
                "output_addr": self._outbox_addr,
                "log_setup": _log_setup(),
                "secret": self._channel.peer_secret(),
                "spawned_at": time.time(),
                "server_pid": os.getpid(),
            }
        )
        self.name = f"pagecast-core-{os.path.basename(os.path.normpath(artifact))}"
        self.process = subprocess.Popen(
            [sys.executable, "-m", "pagecast.runtime.core_process", artifact], stdin=subprocess.PIPE
        )
        assert self.process.stdin is not None
        with self.process.stdin:
            try:
                self.process.stdin.write(spec.encode())
            except BrokenPipeError:
                pass  # it died at once: the watchdog reports its exit
        self._started = time.monotonic()
        self._ready = threading.Event()
        self.ready: CoreReady | None = None
        self._receiver = threading.Thread(target=self._receive, name=self.name + "-rx", daemon=True)
        self._receiver.start()
        self._watchdog = threading.Thread(target=self._watch, name=self.name + "-watchdog", daemon=True)
        self._watchdog.start()

    def attach(self, on_message: Callable[[CoreMessage], None], busy: Callable[[], bool]) -> None:
        self._on_message = on_message
        self._busy = busy

    def wait_ready(self, timeout: float | None = None) -> CoreReady | CoreFailed:
        if not self._ready.wait(timeout):
            raise TimeoutError(f"the engine core did not start within {timeout} s")
        return self.ready if self.ready is not None else self.failed  # type: ignore[return-value]

    def send(self, message: FrontEndMessage) -> None:
        """Queue ``message`` for the core, without waiting for it to read (the queue has no
        bound). Never raises: a channel that fails is reported through ``on_message`` like any
        failure, and the core killed."""
        data = self._encoder.encode(message)
        with self._send_lock:
            if self._closing or self.failed is not None:
                return
            try:
                self._to_core.send(data, copy=False)
                return
            except zmq.ZMQError as exc:  # zmq.Again: the core took nothing for hang_timeout_s
                reason = f"the engine core took no message for {self._hang_timeout_s:.0f} s ({exc}); it was killed"
        self._fail("engine", reason)
        self.process.kill()

    def is_alive(self) -> bool:
        return self.failed is None and self.process.poll() is None

    def shutdown(self, timeout: float = 10.0) -> None:
        """Ask the core to stop, wait for it (killing it past ``timeout``), release the sockets
        and the run's directory (idempotent)."""
        self._stopping = True
        if self.process.poll() is None:
            with self._send_lock:
                if not self._closing:
                    with contextlib.suppress(zmq.ZMQError):
                        self._to_core.send(self._encoder.encode(Shutdown()), zmq.NOBLOCK)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)
        with self._send_lock:
            self._closing = True
        self._receiver.join(2 * LIVENESS_INTERVAL_S + 1)
        self._watchdog.join(2 * LIVENESS_INTERVAL_S + 1)
        self._close_channel()

    def _close_channel(self) -> None:
        with self._send_lock:
            if self._closed or (threading.current_thread() is not self._receiver and self._receiver.is_alive()):
                return  # the receiver still uses its socket (a callback that blocks): it closes it
            self._closed = True
            self._closing = True
            self._to_core.close(linger=0)
            self._from_core.close(linger=0)
        self._channel.close()
        self._ctx.term()

    def _fail(self, kind: str, message: str) -> None:
        with self._fail_lock:
            if self.failed is not None:
                return
            self.failed = CoreFailed(kind, message)
        self._ready.set()
        try:
            self._on_message(self.failed)
        except Exception:  # the failure itself is recorded; is_alive() says so
            logger.exception("handling the engine core's failure failed")

    def _receive(self) -> None:
        """Decode what the core sends and hand it on; never ends silently."""
        try:
            self._receive_loop()
        except BaseException as exc:  # the channel is unusable: the engine is dead
            if not self._closing:
                logger.exception("the engine core's channel failed")
                self._fail("engine", f"the channel to the engine core failed: {type(exc).__name__}: {exc}")
                self.process.kill()
        finally:
            if self._closing:
                self._close_channel()

    def _receive_loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._from_core, zmq.POLLIN)
        while not self._closing:
            if not poller.poll(int(LIVENESS_INTERVAL_S * 1000)):
                continue
            frame = self._from_core.recv(copy=False)
            self._last_heard = time.monotonic()
            try:
                msg = self._decoder.decode(frame.buffer)
            except msgspec.DecodeError as exc:  # ValidationError included
                logger.error("dropped a malformed frame from the engine core (%d bytes): %s", len(frame.buffer), exc)
                continue
            if isinstance(msg, CoreReady):
                if self.ready is None and self.failed is None:
                    self.ready = msg
                    self._ready.set()
                continue
            if isinstance(msg, CoreFailed):
                self._fail(msg.kind, msg.message)
                continue
            try:
                self._on_message(msg)
            except Exception:  # one bad message must not stop every stream
                logger.exception("handling a message from the engine core failed; it was dropped")

    def _watch(self) -> None:
        """Notice, apart from the receiver, every way the core stops serving."""
        exited_at: float | None = None
        while not self._closing and self.failed is None:
            time.sleep(LIVENESS_INTERVAL_S)
            if self._closing or self._stopping or self.failed is not None:
                return
            now = time.monotonic()
            if self.process.poll() is not None:
                # Give the receiver a moment for what the core sent before it ended (its CoreFailed).
                exited_at = exited_at or now
                if now - exited_at >= EXIT_GRACE_S:
                    code = self.process.returncode
                    self._fail("engine", f"the engine-core process exited unexpectedly (exit code {code})")
                continue
            if not self._receiver.is_alive():
                self._fail("engine", "the receiver of the engine core's messages stopped")
                self.process.kill()
            elif not self._ready.is_set():
                if now - self._started > self._start_timeout_s:
                    limit = f"{self._start_timeout_s:g} s (PAGECAST_START_TIMEOUT)"
                    self._fail("engine", f"the engine core did not start within {limit}; it was killed")
                    self.process.kill()
            elif not self._busy():
                self._last_heard = now
            elif now - self._last_heard > self._hang_timeout_s:
                self._fail("engine", f"the engine core sent nothing for {self._hang_timeout_s:.0f} s; it was killed")
                self.process.kill()


def _log_setup() -> tuple[str, int]:
    """The server's log format and level, for the core's own log lines."""
    from pagecast.runtime.server.logs import JSONFormatter

    root = logging.getLogger()
    json_format = any(isinstance(h.formatter, JSONFormatter) for h in root.handlers)
    level = logging.getLogger("pagecast").getEffectiveLevel()
    return ("json" if json_format else "text", level)


__all__ = ["CoreClient", "EngineStats", "position_logprobs", "run_engine_core"]


def main() -> None:
    """``python -m pagecast.runtime.core_process ARTIFACT``, its arguments on stdin (one JSON
    document, then end of file; the artifact on the command line is only for ``ps``)."""
    spec = json.loads(sys.stdin.buffer.read())
    code = run_engine_core(
        spec["artifact"], spec["options"], spec["input_addr"], spec["output_addr"], tuple(spec["log_setup"]),
        spec["secret"], spec.get("spawned_at"), spec.get("server_pid"),
    )
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    # No interpreter teardown: a non-daemon thread (a grammar compile, a Triton helper) could keep
    # the process, and the memory it holds, alive after its server is gone.
    os._exit(code)


if __name__ == "__main__":
    main()
