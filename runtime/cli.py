"""engine-serve: serve one or more engine artifacts behind the OpenAI-compatible API.

    engine-serve artifacts/llama3-8b --port 8000
    engine-serve artifacts/a artifacts/b --served-model-name a --served-model-name b

SIGTERM (or Ctrl-C) drains: new requests get 503, running ones finish (at most
--shutdown-timeout seconds, then they are aborted), and the process exits 0. A second
signal ends the open requests at once (streams get an error event and ``data: [DONE]``,
the others a 503) and exits; a third exits without waiting for them.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import threading
from pathlib import Path
from types import FrameType
from typing import Any

import click

from pagecast.runtime.server.options import DEFAULT_MAX_REQUEST_BYTES

logger = logging.getLogger("pagecast.server")

# Left unset, an engine option takes the engine's own default (EngineOptions).
_ENGINE_OPTIONS = (
    "max_num_seqs",
    "max_num_batched_tokens",
    "max_num_prefill_tokens",
    "gpu_memory_utilization",
    "kv_cache_memory",
    "max_model_len",
    "async_scheduling",
    "cuda_graphs",
    "lazy_graphs",
    "mixed_graphs",
    "speculative_config",
    "scheduling_policy",
)


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("artifacts", nargs=-1, required=True, type=click.Path(path_type=Path))
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind (0.0.0.0 for all).")
@click.option("--port", default=8000, show_default=True, type=click.IntRange(0, 65535), help="Port to bind.")
@click.option(
    "--api-key",
    envvar="PAGECAST_API_KEY",
    default=None,
    help="Require `Authorization: Bearer KEY` on /v1 routes (also from PAGECAST_API_KEY).",
)
@click.option(
    "--served-model-name",
    "served_model_names",
    multiple=True,
    help="Name clients use in `model`; once per artifact, in order (default: the artifact's name).",
)
@click.option(
    "--max-num-seqs",
    type=click.IntRange(min=1),
    default=None,
    help="Most sequences running at once, per engine [default: what the artifact was built for, enginebuild --max-num-seqs].",
)
@click.option(
    "--max-num-batched-tokens",
    type=click.IntRange(min=1),
    default=None,
    help="Token budget of one engine step [default: max(2048, max-num-seqs)].",
)
@click.option(
    "--max-num-prefill-tokens",
    type=click.IntRange(min=1),
    default=None,
    help="Prompt tokens one step may compute beside the running streams' decodes (chunked prefill): lower "
    "bounds the gap between a stream's tokens while prompts arrive, at some cost to time to first token "
    "[engine default: 1024 on a GPU, 128 on the CPU].",
)
@click.option(
    "--gpu-memory-utilization",
    type=click.FloatRange(0.0, 1.0, min_open=True),
    default=None,
    help="Fraction of GPU memory the engine may use; the KV cache gets what is left [default: 0.9].",
)
@click.option(
    "--kv-cache-memory",
    default=None,
    help="KV-cache size such as 512MiB or 4GB (instead of --gpu-memory-utilization).",
)
@click.option(
    "--max-model-len",
    type=click.IntRange(min=1),
    default=None,
    help="Cap on prompt + output tokens (at most the artifact's).",
)
@click.option("--no-prefix-caching", is_flag=True, help="Do not reuse KV blocks of common prompt prefixes.")
@click.option(
    "--async-scheduling/--no-async-scheduling",
    default=None,
    help="Plan the next step while the device runs the current one [default: on for GPUs].",
)
@click.option(
    "--cuda-graphs/--no-cuda-graphs",
    default=None,
    help="Replay decode steps from CUDA graphs; --no-cuda-graphs runs eagerly (debugging, profiling) [default: on].",
)
@click.option(
    "--lazy-graphs/--no-lazy-graphs",
    default=None,
    help="Serve as soon as the weights are loaded and capture the CUDA graphs between steps afterwards "
    "(decode runs eagerly until its graph is there) [default: on].",
)
@click.option(
    "--mixed-graphs/--no-mixed-graphs",
    default=None,
    help="Replay steps with prompt tokens (up to 512 tokens) from CUDA graphs too, attention eagerly between "
    "the layers' graphs; one GPU, no tensor parallelism [default: off].",
)
@click.option(
    "--speculative-config",
    default=None,
    help='Speculative decoding as JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\' '
    '(methods: ngram, draft_model, eagle3); "off" disables the one built into the artifact [default: the artifact\'s].',
)
@click.option(
    "--scheduling-policy",
    type=click.Choice(["fcfs", "priority"]),
    default=None,
    help="The order requests are served in: fcfs (first come, first served) or priority (a request's "
    "`priority`, lower first, then arrival; the lowest is preempted first when KV blocks run out) [default: fcfs].",
)
@click.option(
    "--chat-template",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=None,
    help="Jinja chat template file used instead of the artifact's (every served model).",
)
@click.option(
    "--reasoning-parser",
    type=click.Choice(["qwen3", "deepseek_r1"]),
    default=None,
    help="Report a thinking model's <think> text as reasoning_content beside content (as vLLM's option): qwen3 "
    "when outputs open with <think>, deepseek_r1 when the template opens it in the prompt [default: off].",
)
@click.option("--ssl-keyfile", type=click.Path(exists=True, dir_okay=False), default=None, help="TLS private key (PEM).")
@click.option("--ssl-certfile", type=click.Path(exists=True, dir_okay=False), default=None, help="TLS certificate (PEM).")
@click.option(
    "--ssl-ca-certs",
    type=click.Path(exists=True, dir_okay=False),
    default=None,
    help="CA bundle to verify client certificates with (mutual TLS; clients must then present one).",
)
@click.option(
    "--allowed-origins",
    "allowed_origins",
    multiple=True,
    help="Origin browsers may call from (CORS), e.g. https://app.example.com or *; repeat or comma-separate.",
)
@click.option("--allowed-methods", multiple=True, help="HTTP methods allowed cross-origin [default: *].")
@click.option("--allowed-headers", multiple=True, help="Request headers allowed cross-origin [default: *].")
@click.option("--allow-credentials", is_flag=True, help="Let cross-origin requests carry credentials.")
@click.option(
    "--max-queue",
    default=256,
    show_default=True,
    type=click.IntRange(min=0),
    help="Sequences that may wait for a slot, per model, beyond --max-num-seqs; more get 429.",
)
@click.option(
    "--responses-store-size",
    default=1024,
    show_default=True,
    type=click.IntRange(min=0),
    help="Responses (/v1/responses with store) kept in memory for GET and previous_response_id (at most 256 MiB "
    "of them); 0 keeps none.",
)
@click.option(
    "--max-request-bytes",
    default=DEFAULT_MAX_REQUEST_BYTES,
    show_default=True,
    type=click.IntRange(min=1),
    help="Largest request body accepted; larger ones get 413 before they are parsed.",
)
@click.option(
    "--shutdown-timeout",
    default=30.0,
    show_default=True,
    type=click.FloatRange(min=0.0),
    help="Seconds running requests get to finish after SIGTERM before they are aborted.",
)
@click.option(
    "--log-format",
    type=click.Choice(["text", "json"]),
    default="text",
    show_default=True,
    help="Log lines as text or as one JSON object each.",
)
@click.option(
    "--log-level", type=click.Choice(["debug", "info", "warning", "error"]), default="info", show_default=True
)
def main(
    artifacts: tuple[Path, ...],
    host: str,
    port: int,
    api_key: str | None,
    served_model_names: tuple[str, ...],
    no_prefix_caching: bool,
    max_queue: int,
    responses_store_size: int,
    max_request_bytes: int,
    shutdown_timeout: float,
    log_format: str,
    log_level: str,
    chat_template: Path | None,
    reasoning_parser: str | None,
    ssl_keyfile: str | None,
    ssl_certfile: str | None,
    ssl_ca_certs: str | None,
    allowed_origins: tuple[str, ...],
    allowed_methods: tuple[str, ...],
    allowed_headers: tuple[str, ...],
    allow_credentials: bool,
    **engine_kwargs: Any,
) -> None:
    """Serve engine ARTIFACTS (directories written by enginebuild) over the OpenAI API."""
    from pagecast.runtime import startup
    from pagecast.runtime.server.logs import configure_logging

    log_config = configure_logging(log_format, getattr(logging, log_level.upper()))
    startup.begin("server").mark("imports")
    from pagecast.runtime.server.options import open_without_key_warning

    exposed = open_without_key_warning(host, api_key)  # whatever starts it: the image's entrypoint, a unit, a shell
    if exposed is not None:
        logger.warning(exposed)
    if served_model_names and len(served_model_names) != len(artifacts):
        _fail(
            f"--served-model-name was given {len(served_model_names)} time(s) for {len(artifacts)} "
            "artifact(s): give it once per artifact, in the same order"
        )
    if bool(ssl_keyfile) != bool(ssl_certfile):
        _fail("TLS needs both --ssl-keyfile and --ssl-certfile")
    if ssl_ca_certs and not ssl_certfile:
        _fail("--ssl-ca-certs (client certificates) needs TLS: give --ssl-keyfile and --ssl-certfile too")
    from pagecast.runtime.server.options import check_cors

    spec = engine_kwargs.get("speculative_config")
    if spec is not None and spec != "off":
        from pagecast.runtime.speculative import SpeculativeConfig

        try:
            SpeculativeConfig.parse(spec)
        except ValueError as exc:
            _fail(f"--speculative-config: {exc}")
    try:  # before any engine loads: a refused combination fails in a second
        check_cors(_split_list(allowed_origins), allow_credentials)
    except ValueError as exc:
        _fail(str(exc))
    template = _read_chat_template(chat_template)
    options = {k: v for k, v in engine_kwargs.items() if k in _ENGINE_OPTIONS and v is not None}
    if no_prefix_caching:
        options["enable_prefix_caching"] = False
    starting = _load_engines(artifacts, served_model_names, options)

    # The front end starts while the cores import torch and load their weights.
    import ssl

    import uvicorn

    from pagecast.runtime.server.app import add_cors, create_app, server_state

    startup.mark("http server imports")

    def warm_front_end() -> None:
        for engine in starting.engines:
            _warm_templates(engine)
        startup.mark("chat templates")
        _warm_grammar_compiler()
        startup.mark("grammar compiler")

    # Beside the wait for the cores (on a GPU they take the longest), done before serving.
    warming = threading.Thread(target=warm_front_end, name="pagecast-warm-front-end", daemon=True)
    warming.start()
    engines = starting.wait()
    warming.join()
    if template is not None:
        from pagecast.runtime.server.chat_template import use_chat_template

        try:
            use_chat_template(engines, template)
        except ValueError as exc:
            _fail(f"--chat-template: {exc}")
    app = create_app(
        engines,
        api_key=api_key or None,
        max_queue=max_queue,
        max_request_bytes=max_request_bytes,
        reasoning_parser=reasoning_parser,
        responses_store_size=responses_store_size,
    )
    origins = _split_list(allowed_origins)
    if origins:
        add_cors(
            app,
            origins,
            _split_list(allowed_methods) or ["*"],
            _split_list(allowed_headers) or ["*"],
            allow_credentials,
        )
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_config=log_config,
        access_log=False,  # the request log line replaces it
        timeout_graceful_shutdown=5,  # after our own drain, only to flush responses
        ssl_keyfile=ssl_keyfile,
        ssl_certfile=ssl_certfile,
        ssl_ca_certs=ssl_ca_certs,
        ssl_cert_reqs=ssl.CERT_REQUIRED if ssl_ca_certs else ssl.CERT_NONE,
    )
    server = _DrainingServer(config, lambda: server_state(app), shutdown_timeout)
    server.watch_engines = engines
    server.run()
    if getattr(server.server, "exit_status", 0):
        sys.exit(server.server.exit_status)
    if not server.started:
        sys.exit(1)


def _read_chat_template(path: Path | None) -> str | None:
    """--chat-template, read and checked before any engine loads (a typo fails in a second)."""
    if path is None:
        return None
    from pagecast.runtime.server.chat_template import read_chat_template

    try:
        return read_chat_template(path)
    except ValueError as exc:
        _fail(f"--chat-template: {exc}")
    return None


def _split_list(values: tuple[str, ...]) -> list[str]:
    """Repeated and comma-separated option values, flattened."""
    return [item.strip() for value in values for item in value.split(",") if item.strip()]


def _fail(message: str) -> None:
    click.echo(f"engine-serve: error: {message}", err=True)
    sys.exit(2)


def _load_engines(
    artifacts: tuple[Path, ...], names: tuple[str, ...], options: dict[str, Any]
) -> _StartingEngines:
    """Start one engine-core process per artifact, all at once, and load each one's front end
    (tokenizer) while they start; ``wait()`` on the result waits until each serves."""
    # Light imports only until the cores are started: their start-up (imports, CUDA, weights)
    # then overlaps this process importing torch and the server.
    from pagecast.runtime import startup
    from pagecast.runtime.artifact import load_manifest
    from pagecast.runtime.core_process import CoreClient
    from pagecast.runtime.errors import ArtifactError

    for path in artifacts:
        if not path.exists():
            _fail(
                f"{path}: no such artifact directory "
                f"(build one with `enginebuild --model ... --output {path}`)"
            )
    # In a thread: the kernel may block while it queues the reads of a large file.
    threading.Thread(target=lambda: [_read_ahead(path) for path in artifacts], name="pagecast-read-ahead",
                     daemon=True).start()  # fmt: skip
    per_engine = [dict(options) for _ in artifacts]
    try:
        on_gpu = [i for i, path in enumerate(artifacts) if load_manifest(path).target.kind != "cpu"]
    except ArtifactError as exc:
        _fail(f"cannot load {exc}")
    if len(on_gpu) < len(artifacts):
        _leave_a_core_to_the_server()
    if len(on_gpu) > 1 and "kv_cache_memory" not in options:
        # Engines sharing the GPU each get an explicit, equal share of it, whichever starts first.
        share = options.get("gpu_memory_utilization", 0.9) / len(on_gpu)
        for i in on_gpu:
            per_engine[i]["gpu_memory_utilization"] = share
        logger.info("%d GPU engines share the GPU: each may use %.0f%% of its memory", len(on_gpu), 100 * share)
    clients = []
    for path, engine_options in zip(artifacts, per_engine):
        logger.info("loading %s", path)
        clients.append(CoreClient(str(path), engine_options))
    startup.mark("cores spawned")
    from pagecast.runtime import AsyncEngine

    starting = _StartingEngines(artifacts, names, clients)
    for path, engine_options, client in zip(artifacts, per_engine, clients):
        try:
            starting.engines.append(AsyncEngine(path, client=client, **engine_options))
        except Exception as exc:  # noqa: BLE001 - every failure to start ends engine-serve with its message
            starting.fail(path, exc)
    startup.mark("tokenizers")
    return starting


def _leave_a_core_to_the_server() -> None:
    """CPU engines: each core process computes with one thread fewer than there are cores (at
    least one; OMP_NUM_THREADS, when set, is left as it is), so that this process (HTTP,
    tokenizing, detokenizing) never takes a core from under a compute thread. A parallel region
    waits for its slowest thread: with as many threads as cores, the server's work stalls every
    op of the step. Measured on a 2-core machine under load: a 4-token SmolLM2 forward pass took
    9-12 s with two threads and 0.4 s with one."""
    if "OMP_NUM_THREADS" in os.environ:
        return
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    os.environ["OMP_NUM_THREADS"] = str(max(1, cores - 1))  # inherited by the cores started next


def _read_ahead(artifact: Path) -> None:
    """Ask the kernel to start reading the artifact's weight files into the page cache now, in
    the background: on a cold cache the disk then works while the cores import torch and
    initialise the GPU, before they ask for the bytes (a no-op for pages already cached)."""
    if not hasattr(os, "posix_fadvise"):
        return
    for file in sorted((artifact / "weights").glob("*.safetensors")):
        try:
            fd = os.open(file, os.O_RDONLY)
        except OSError:
            continue  # the load says what is wrong with it
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
        except OSError:
            pass
        finally:
            os.close(fd)


class _StartingEngines:
    """Engines whose cores are starting (their front ends loaded); ``wait`` for them to serve."""

    def __init__(self, artifacts: tuple[Path, ...], names: tuple[str, ...], clients: list[Any]):
        self.artifacts = artifacts
        self.names = names
        self.clients = clients
        self.engines: list[Any] = []

    def stop(self) -> None:
        for engine in self.engines:
            engine.shutdown(timeout=5)
        for client in self.clients[len(self.engines):]:
            client.shutdown(timeout=5)

    def fail(self, path: Path, exc: Exception) -> None:
        from pagecast.runtime.errors import ArtifactError

        self.stop()
        if isinstance(exc, ArtifactError):
            _fail(f"cannot load {path}: {exc}")
        if isinstance(exc, ValueError):
            _fail(f"cannot start the engine for {path}: {exc}")
        _fail(f"the engine for {path} failed to start: {exc}")

    def wait(self) -> dict[str, Any]:
        """Wait until every core serves, then run one request through each; returns them by name."""
        from pagecast.runtime import startup

        engines: dict[str, Any] = {}
        for i, (path, engine) in enumerate(zip(self.artifacts, self.engines)):
            try:
                engine.wait_ready()
                startup.mark(f"core ready ({engine.model_name})")
                _warm_front_end(engine)
                startup.mark(f"first request ({engine.model_name})")
            except Exception as exc:  # noqa: BLE001 - every failure to start ends engine-serve with its message
                self.fail(path, exc)
            name = self.names[i] if self.names else engine.model_name
            if name in engines:
                self.stop()
                _fail(f"two artifacts are both served as `{name}`: give --served-model-name once per artifact")
            engines[name] = engine
            info = engine.startup_info
            kv_tokens = info.num_kv_blocks * info.block_size
            logger.info(
                "serving %s as `%s` on %s: KV cache %d blocks of %d (%d tokens), %d sequences of the full "
                "%d-token context at once, up to %d running; a step computes up to %d tokens, %s prompt "
                "tokens; started in %.1f s (%s)",
                path,
                name,
                info.device,
                info.num_kv_blocks,
                info.block_size,
                kv_tokens,
                kv_tokens // engine.max_model_len,
                engine.max_model_len,
                engine.max_num_seqs,
                info.max_num_batched_tokens,
                _prefill_bound_text(info.max_num_prefill_tokens, info.prefill_context_weight),
                info.startup_s.get("total", 0.0),
                " ".join(f"{k}={v:.2f}" for k, v in info.startup_s.items() if k != "total"),
            )
        return engines


def _prefill_bound_text(max_prefill: int | None, context_weight: float) -> str:
    """The start-up line's words for a step's bound on prompt tokens."""
    if not max_prefill:
        return "any number of"
    if context_weight > 0:
        return f"at most {max_prefill} (one after c tokens of context counts 1 + c/{1 / context_weight:,.0f})"
    return f"at most {max_prefill}"


def _warm_templates(engine: Any) -> None:
    """Render the chat template once (transformers compiles the Jinja on first use, 0.1-0.5 s),
    while the core starts, so the first chat request does not pay for it."""
    tokenizer = engine.tokenizer
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        return
    try:
        tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    except Exception:  # a template that fails here fails its requests with their own message
        logger.debug("the chat template of %s failed to render at start", engine.model_name, exc_info=True)


def _warm_grammar_compiler() -> None:
    """Import xgrammar and compile one small schema (the server checks every request's schema
    with it: the first import costs ~0.5 s), while the cores start. Nothing without xgrammar."""
    try:
        from pagecast.runtime.structured_output import check_json_schema
    except ImportError:
        return
    try:
        check_json_schema('{"type": "object"}')
    except (ImportError, ValueError):
        pass


def _warm_front_end(engine: Any) -> None:
    """One short request through the server's side of the engine (validation, the output
    processor, the detokenizer), so that /health turns 200 only when the first real request
    runs at steady-state speed. One token: the core's own warm-up (on a GPU) has run its decode
    steps, and on a CPU a decode step would add its second or so to the start."""
    import anyio.to_thread

    from pagecast.runtime import generation_config
    from pagecast.runtime.sampling_params import SamplingParams

    async def run() -> None:
        async for _ in engine.generate([1, 2, 3, 4], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)):
            pass
        # The handlers prepare requests in anyio's worker threads: its asyncio backend is imported
        # at the first use (70 ms on the H200 host, measured as the first request's extra TTFT).
        await anyio.to_thread.run_sync(generation_config.engine_defaults, engine)

    asyncio.run(run())


async def _exit_when_an_engine_dies(engines: dict[str, Any], server: Any, grace_s: float = 1.0) -> None:
    """An engine that died is not restarted in place: its in-flight requests get an error, /health
    says 503, and after ``grace_s`` (for those errors to reach their clients) the server exits
    with status 1, so that its supervisor (systemd, Kubernetes) starts a fresh one."""
    while not server.should_exit:
        dead = [name for name, engine in engines.items() if not engine.is_alive()]
        if dead:
            logger.error("engine(s) %s died: exiting with status 1 so that a supervisor restarts the server", dead)
            await asyncio.sleep(grace_s)
            server.exit_status = 1
            server.should_exit = True
            return
        await asyncio.sleep(0.25)


class _DrainingServer:
    """uvicorn's Server with pagecast's shutdown: on the first SIGTERM/SIGINT stop admitting,
    wait for running requests (bounded), then let uvicorn close; exit status 0.

    uvicorn's own handler would close the listening socket at once (so new clients get
    connection refused instead of a 503 they can retry elsewhere) and re-raise the signal
    after shutdown (so the exit status would be 143, not 0).
    """

    def __init__(self, config: Any, get_state: Any, shutdown_timeout: float):
        import uvicorn

        outer = self

        class Server(uvicorn.Server):
            async def serve(self, sockets: Any = None) -> None:
                outer.loop = asyncio.get_running_loop()
                watcher = None
                if outer.watch_engines:
                    watcher = outer.loop.create_task(_exit_when_an_engine_dies(outer.watch_engines, self))
                await super().serve(sockets)
                if watcher is not None:
                    watcher.cancel()

            async def startup(self, sockets: Any = None) -> None:
                await super().startup(sockets)
                if self.started:
                    from pagecast.runtime import startup

                    startup.mark("listening")  # /health answers 200 from here

            def handle_exit(self, sig: int, frame: FrameType | None) -> None:
                outer.on_signal(sig)

        self.server = Server(config)
        self.get_state = get_state
        self.shutdown_timeout = shutdown_timeout
        self.loop: asyncio.AbstractEventLoop | None = None
        self.draining = False
        self.watch_engines: dict[str, Any] = {}  # served engines: one dying ends the server (status 1)
        self.cutting = False

    @property
    def started(self) -> bool:
        return bool(self.server.started)

    def run(self) -> None:
        self.server.run()

    def on_signal(self, sig: int) -> None:
        if self.loop is None:  # not serving yet: nothing to drain
            self.server.should_exit = True
            self.server.force_exit = True
            return
        if self.cutting:  # a third signal: stop without waiting for anything
            self.server.should_exit = True
            self.server.force_exit = True
            return
        if self.draining:
            self.cutting = True
            logger.info("received %s again: ending open requests now", signal.Signals(sig).name)
            self.loop.call_soon_threadsafe(lambda: self.loop.create_task(self._cut()))  # type: ignore[union-attr]
            return
        self.draining = True
        logger.info(
            "received %s: draining (up to %.0f s), new requests get 503",
            signal.Signals(sig).name,
            self.shutdown_timeout,
        )
        self.loop.call_soon_threadsafe(lambda: self.loop.create_task(self._drain()))  # type: ignore[union-attr]

    async def _drain(self) -> None:
        from pagecast.runtime.server.app import drain

        try:
            await drain(self.get_state(), self.shutdown_timeout)
        finally:
            self.server.should_exit = True

    async def _cut(self) -> None:
        """The second signal: end every open response now, with an error event and ``[DONE]``
        for streams and a 503 for the others, then let uvicorn close. Cancelling them instead
        (uvicorn's force exit) would cut streams mid-event, log their requests as 200 and
        print a CancelledError traceback for each."""
        from pagecast.runtime.server.app import cut

        try:
            await cut(self.get_state())
        finally:
            self.server.should_exit = True


if __name__ == "__main__":
    main()
