"""Stress suite for engine-serve (issue 11): many concurrent streams, clients that leave,
and abusive requests, on the embedded SmolLM2 model on the CPU. Not part of `make test`.

    make stress                      # builds artifacts/smollm2-135m first if needed
    python benchmarks/stress.py --artifact artifacts/smollm2-135m [--streams 1000] [--time-limit 900]

It starts `engine-serve` on 127.0.0.1 (loopback only) and runs two phases:

1. ``--streams`` concurrent streamed completions; ``--disconnect`` of them (20%) close their
   connection after a random number of chunks (0-3).
2. The abusive requests of issue 11 mixed with another wave of streams: a 50 MB body, a
   chunked body over the limit, a text prompt of several MB, 131,072 sequences in one
   request, a request of the queue's full size whose client gives up, NaN and other bad
   values, and garbage bodies.

Meanwhile /health is probed every 100 ms. Then it waits for the server to settle and reads
/metrics. Printed: streams, disconnects, lost (a stream that was not cut by its client but
did not end with all its tokens and ``data: [DONE]``), leaked KV blocks and sequences still
admitted once everything is over, 5xx answers, /health p50/p99/max, the server's peak RSS,
and one JSON line with the same figures. Exits 1 if anything was lost or leaked or a 5xx
was seen.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

MODEL = "smollm2"


@dataclass
class Tally:
    streams: int = 0
    disconnects: int = 0
    completed: int = 0
    lost: int = 0
    refused_429: int = 0  # streams told to retry (the queue was full); not lost, not served
    server_errors: int = 0  # 5xx answers, from any request
    statuses: dict[int, int] = field(default_factory=dict)
    abusive: dict[str, str] = field(default_factory=dict)  # name -> "status code/error code (seconds)"
    lost_examples: list[str] = field(default_factory=list)

    def saw(self, status: int) -> None:
        self.statuses[status] = self.statuses.get(status, 0) + 1
        if status >= 500:
            self.server_errors += 1


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def percentile(values: list[float], q: float) -> float:
    if not values:
        return math.nan
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def process_tree(pid: int) -> list[int]:
    """``pid`` and its descendants (the engine cores run in child processes), Linux only."""
    pids = [pid]
    for tid in os.listdir(f"/proc/{pid}/task") if os.path.isdir(f"/proc/{pid}/task") else []:
        try:
            children = Path(f"/proc/{pid}/task/{tid}/children").read_text().split()
        except OSError:
            continue
        for child in children:
            pids += process_tree(int(child))
    return pids


def peak_rss_mib(pids: list[int]) -> float:
    """The sum of the processes' peak resident sets (VmHWM), Linux only."""
    total = 0.0
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    total += int(line.split()[1]) / 1024
        except OSError:
            pass
    return total or math.nan


async def one_stream(
    client: httpx.AsyncClient, url: str, i: int, max_tokens: int, leave_after: int | None, tally: Tally
) -> None:
    """One streamed completion. ``leave_after``: close the connection after that many chunks
    (a client that gives up); None: read to the end and check it is complete."""
    tally.streams += 1
    body = {
        "model": MODEL,
        "prompt": f"Request {i}: write a short note about the number {i}.",
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0.8,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    try:
        async with client.stream("POST", url, json=body) as r:
            tally.saw(r.status_code)
            if r.status_code == 429:
                tally.refused_429 += 1
                await r.aread()
                return
            if r.status_code != 200:
                text = (await r.aread()).decode(errors="replace")
                tally.lost += 1
                tally.lost_examples.append(f"status {r.status_code}: {text[:200]}")
                return
            chunks = 0
            done = False
            tokens = None
            async for line in r.aiter_lines():
                if not line:
                    continue
                if leave_after is not None and chunks >= leave_after:
                    tally.disconnects += 1
                    return  # leaving the context closes the connection mid-stream
                chunks += 1
                if line == "data: [DONE]":
                    done = True
                    continue
                payload = json.loads(line[len("data: ") :])
                if "error" in payload:
                    tally.lost += 1
                    tally.lost_examples.append(f"error event: {payload['error']}")
                    return
                if payload.get("usage"):
                    tokens = payload["usage"]["completion_tokens"]
            # A client meant to leave may have got everything before it could.
            if done and (leave_after is not None or tokens == max_tokens):
                tally.completed += 1
            else:
                tally.lost += 1
                tally.lost_examples.append(f"incomplete: done={done} tokens={tokens}")
    except httpx.HTTPError as exc:
        tally.lost += 1
        tally.lost_examples.append(f"{type(exc).__name__}: {exc}")


def probe_health(base: str, stop: threading.Event, latencies: list[float], failures: list[str]) -> None:
    """GET /health every 100 ms, in its own thread with its own client, so that the load
    generator's event loop (JSON of 1,000 streams, a 50 MB body) does not delay the probes."""
    with httpx.Client(timeout=10) as client:
        while not stop.is_set():
            start = time.perf_counter()
            try:
                r = client.get(f"{base}/health")
                if r.status_code != 200:
                    failures.append(f"status {r.status_code}")
            except httpx.HTTPError as exc:
                failures.append(type(exc).__name__)
            latencies.append(time.perf_counter() - start)
            stop.wait(0.1)


async def abusive(client: httpx.AsyncClient, base: str, max_model_len: int, tally: Tally) -> None:
    """The requests of issue 11 that used to stall or lock out the server; each must get a
    prompt 4xx and no 5xx."""

    async def call(name: str, path: str = "/v1/completions", **kwargs: object) -> None:
        start = time.perf_counter()
        try:
            r = await client.post(f"{base}{path}", timeout=120, **kwargs)  # type: ignore[arg-type]
            tally.saw(r.status_code)
            try:
                code = r.json().get("error", {}).get("code")
            except ValueError:
                code = None
            tally.abusive[name] = f"{r.status_code} {code} ({time.perf_counter() - start:.1f} s)"
        except httpx.HTTPError as exc:
            tally.abusive[name] = f"{type(exc).__name__} ({time.perf_counter() - start:.1f} s)"

    def chunked_body() -> object:
        async def gen():  # type: ignore[no-untyped-def]
            yield b'{"model": "smollm2", "prompt": "'
            for _ in range(16 * 1024):
                yield b"x" * 1024
            yield b'"}'

        return gen()

    huge_text = "word " * (1_400_000)  # 7 MB: under the body limit, far over any context
    await asyncio.gather(
        call(
            "50 MB body",
            content=b'{"prompt": "' + b"a" * (50 << 20) + b'"}',
            headers={"Content-Type": "application/json"},
        ),
        call("16 MB chunked body", content=chunked_body(), headers={"Content-Type": "application/json"}),
        call("7 MB text prompt", json={"model": MODEL, "prompt": huge_text, "max_tokens": 1}),
        call("131072 sequences", json={"model": MODEL, "prompt": ["hi"] * 1024, "n": 128, "max_tokens": 1}),
        call(
            "temperature NaN",
            content=b'{"prompt": "hi", "temperature": NaN}',
            headers={"Content-Type": "application/json"},
        ),
        call(
            "stream_options without stream", json={"prompt": "hi", "stream_options": {"include_usage": True}}
        ),
        call("empty prompt", json={"prompt": ""}),
        call("token id out of range", json={"prompt": [10**9]}),
        call("max_tokens 0 without echo", json={"prompt": "hi", "max_tokens": 0}),
        call("max_tokens over the context", json={"prompt": "hi", "max_tokens": max_model_len * 2}),
        call("not JSON", content=b"\x00\xff{{", headers={"Content-Type": "application/json"}),
        call("JSON array", json=[1, 2, 3]),
        call(
            "chat: 20000 messages",
            "/v1/chat/completions",
            json={"model": MODEL, "messages": [{"role": "user", "content": "hi " * 20}] * 20000},
        ),
    )


async def give_up_then_tiny(client: httpx.AsyncClient, base: str, capacity: int, tally: Tally) -> None:
    """A request of the queue's full size whose client gives up after a second: its sequences
    must leave at once, so that the next tiny request is served promptly."""
    url = f"{base}/v1/completions"
    body = {
        "model": MODEL,
        "prompt": ["hi"] * 8,
        "n": max(1, capacity // 8),
        "max_tokens": 64,
        "ignore_eos": True,
    }
    try:
        await client.post(url, json=body, timeout=1.0)
    except httpx.TimeoutException:
        pass
    start = time.perf_counter()
    deadline = start + 60
    status = None
    while time.perf_counter() < deadline:
        r = await client.post(url, json={"model": MODEL, "prompt": "hi", "max_tokens": 1}, timeout=60)
        status = r.status_code
        if status != 429:
            tally.saw(status)
            break
        await asyncio.sleep(0.2)
    tally.abusive["tiny request after a full-queue client left"] = (
        f"{status} ({time.perf_counter() - start:.1f} s)"
    )


async def settle(base: str, timeout: float) -> tuple[float, float]:
    """KV blocks in use and sequences admitted once every request is over (both must be 0)."""
    deadline = time.monotonic() + timeout
    used = in_flight = math.nan
    async with httpx.AsyncClient(timeout=30) as client:
        while time.monotonic() < deadline:
            text = (await client.get(f"{base}/metrics")).text
            used = in_flight = math.nan
            for line in text.splitlines():
                if line.startswith("pagecast_kv_cache_blocks_used{"):
                    used = float(line.rsplit(" ", 1)[1])
                elif line.startswith("pagecast_server_sequences_in_flight{"):
                    in_flight = float(line.rsplit(" ", 1)[1])
            if used == 0 and in_flight == 0:
                break
            await asyncio.sleep(0.5)
    return used, in_flight


async def run(args: argparse.Namespace, base: str, max_model_len: int, capacity: int) -> dict:
    rng = random.Random(args.seed)
    tally = Tally()
    stop = threading.Event()
    health: list[float] = []
    health_failures: list[str] = []
    prober = threading.Thread(target=probe_health, args=(base, stop, health, health_failures), daemon=True)
    prober.start()
    limits = httpx.Limits(max_connections=args.streams * 2, max_keepalive_connections=args.streams * 2)
    url = f"{base}/v1/completions"
    started = time.perf_counter()
    async with httpx.AsyncClient(limits=limits, timeout=args.time_limit) as client:

        def wave(n: int, offset: int) -> list:  # type: ignore[type-arg]
            return [
                one_stream(
                    client,
                    url,
                    offset + i,
                    args.max_tokens,
                    rng.randint(0, 3) if rng.random() < args.disconnect else None,
                    tally,
                )
                for i in range(n)
            ]

        await asyncio.gather(*wave(args.streams, 0))
        phase1 = time.perf_counter() - started
        await asyncio.gather(
            *wave(args.abuse_streams, args.streams),
            abusive(client, base, max_model_len, tally),
        )
        await give_up_then_tiny(client, base, capacity, tally)
    stop.set()
    prober.join(30)
    used, in_flight = await settle(base, 60)
    return {
        "streams": tally.streams,
        "disconnects": tally.disconnects,
        "completed": tally.completed,
        "refused_429": tally.refused_429,
        "lost": tally.lost,
        "leaked_blocks": used,
        "leaked_sequences": in_flight,
        "5xx": tally.server_errors,
        "health_probes": len(health),
        "health_failures": len(health_failures),
        "health_p50_ms": percentile(health, 0.5) * 1000,
        "health_p99_ms": percentile(health, 0.99) * 1000,
        "health_max_ms": max(health, default=math.nan) * 1000,
        "phase1_s": phase1,
        "total_s": time.perf_counter() - started,
        "statuses": {str(k): v for k, v in sorted(tally.statuses.items())},
        "abusive": tally.abusive,
        "lost_examples": tally.lost_examples[:5],
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--artifact", default="artifacts/smollm2-135m")
    parser.add_argument("--streams", type=int, default=1000)
    parser.add_argument(
        "--abuse-streams", type=int, default=200, help="streams running alongside the abusive requests"
    )
    parser.add_argument(
        "--disconnect", type=float, default=0.2, help="fraction of streams whose client leaves"
    )
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-queue", type=int, default=1024)
    parser.add_argument(
        "--time-limit", type=float, default=1200, help="seconds; the run is stopped after that"
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    artifact = Path(args.artifact)
    if not (artifact / "manifest.json").is_file():
        sys.exit(f"{artifact} is not an artifact: run `make build-default` (or enginebuild) first")
    port = free_port()
    exe = Path(sys.executable).with_name("engine-serve")
    cmd = [
        *([str(exe)] if exe.exists() else [sys.executable, "-m", "pagecast.runtime.cli"]),
        str(artifact),
        "--host", "127.0.0.1",
        "--port", str(port),
        "--served-model-name", MODEL,
        "--max-num-seqs", str(args.max_num_seqs),
        "--max-queue", str(args.max_queue),
        "--log-level", "warning",
    ]  # fmt: skip
    fd, log_name = tempfile.mkstemp(prefix="pagecast-stress-", suffix=".log")
    with os.fdopen(fd, "wb") as log:
        server = subprocess.Popen(cmd, stdout=log, stderr=log)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            if server.poll() is not None:
                sys.exit(f"engine-serve exited with {server.returncode}; log: {log_name}")
            try:
                if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                sys.exit(f"engine-serve did not come up in 300 s; log: {log_name}")
            time.sleep(0.5)
        card = httpx.get(f"{base}/v1/models", timeout=30).json()["data"][0]
        capacity = args.max_num_seqs + args.max_queue
        figures = asyncio.run(
            asyncio.wait_for(run(args, base, card["max_model_len"], capacity), args.time_limit)
        )
        tree = process_tree(server.pid)
        figures["peak_rss_mib"] = peak_rss_mib(tree)
        figures["processes"] = len(tree)
    except asyncio.TimeoutError:
        sys.exit(f"the stress run did not finish in --time-limit {args.time_limit:.0f} s; log: {log_name}")
    finally:
        if server.poll() is None:
            server.send_signal(signal.SIGTERM)
            try:
                server.wait(60)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()
    log_text = Path(log_name).read_text(errors="replace")
    figures["tracebacks_in_log"] = log_text.count("Traceback")
    os.unlink(log_name)

    rows = [
        ("streams", figures["streams"]),
        ("disconnects (client left)", figures["disconnects"]),
        ("completed", figures["completed"]),
        ("refused 429 (queue full)", figures["refused_429"]),
        ("lost", figures["lost"]),
        ("leaked KV blocks", figures["leaked_blocks"]),
        ("leaked admitted sequences", figures["leaked_sequences"]),
        ("5xx", figures["5xx"]),
        ("/health probes (failed)", f"{figures['health_probes']} ({figures['health_failures']})"),
        (
            "/health p50 / p99 / max ms",
            f"{figures['health_p50_ms']:.1f} / {figures['health_p99_ms']:.1f} / {figures['health_max_ms']:.1f}",
        ),
        ("server peak RSS MiB (all processes)", f"{figures['peak_rss_mib']:.0f} ({figures['processes']})"),
        ("phase 1 / total s", f"{figures['phase1_s']:.1f} / {figures['total_s']:.1f}"),
        ("tracebacks in server log", figures["tracebacks_in_log"]),
    ]
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")
    print("abusive requests:")
    for name, result in figures["abusive"].items():
        print(f"  {name:<45} {result}")
    if figures["lost_examples"]:
        print("lost, e.g.:", *figures["lost_examples"], sep="\n  ")
    print(json.dumps({"figure": "stress", **figures}))
    bad = figures["lost"] or figures["leaked_blocks"] or figures["leaked_sequences"] or figures["5xx"]
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
