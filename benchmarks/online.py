"""Online serving through the HTTP server (PERFORMANCE.md W3, W5, engine-serve start-up), with
the same prompts through ``LLM.generate`` in the same run for the server/engine ratio.

    python benchmarks/online.py --out OUTDIR [--artifact ARTIFACT] [--phases start,W3,sat,W5,engine]
        [--rates 16,24,32,40] [--duration 20] [--prompt-len 512 --output-len 256]
    python benchmarks/online.py --base-url http://host:port/v1 --phases W3   # any OpenAI-compatible server

Without --artifact it builds the Llama-3-8B-shaped engine with random bf16 weights
(benchmarks/serving.py's config, max_model_len 4096) for the GPU present. Phases:

  start   engine-serve's start, --starts times (each a fresh engine-serve): seconds from the
          process start to /health 200 and to the first served token; that first request's TTFT
          against the steady-state TTFT (median of the next 10 single requests, sent once lazily
          captured CUDA graphs are all in: waited_for_lazy_graphs_s); Triton kernels
          compiled at start and while serving; the start-up timeline of both processes (each
          phase's end, from the log's "start-up" lines) and the weights' read rate. With --cold,
          the weight files are dropped from the page cache before each start, and read once with
          dd (dropped again after) for the disk's own sequential rate in the same run
  W3      Poisson arrivals at each --rates for --duration seconds, streamed completions of random
          token ids with EOS ignored: completed req/s, output tok/s, TTFT p50/p99, inter-token
          p50/p99 (gaps between streamed chunks), goodput; with --json-fractions, once per
          fraction, that share of the requests constrained to a JSON schema (issue 13's overhead:
          an array of --output-len bounded integers, so a constrained request also makes
          --output-len tokens), with the constrained and plain requests' figures also apart
  sat     --num-sat requests sent at once (saturation): output tok/s through the server
  W5      256 requests sharing a 2,048-token prefix plus 64 own tokens, output 128, Poisson at
          --w5-rate: TTFT p50 and prefix-cache hit rate, with the server's prefix cache and again
          on a server started with --no-prefix-caching
  engine  the sat prompts through LLM.generate at the same max_num_seqs and token budget (after
          the servers have stopped): the denominator of the server/engine ratio
  W8      long outputs (issue 33): --w8-seqs streams (256) of --w8-output tokens (8,192) each, sent
          at once, through the server, then the same prompts through LLM.generate in the same run
          (after the server has stopped): output tok/s of both and their ratio (target >= 0.9), the
          inter-token p50/p99 of the streams. A dummy engine built for it gets the context it needs.
          A CPU dry run: --artifact TINY --phases W8 --prompt-len 8 --w8-seqs 4 --w8-output 16
  W8server, W8engine   one side of W8 each (the same prompts), for two calls where one would not
          fit both: at 8,192 tokens each side takes over six minutes on one H200 with a bf16 KV
          cache (2.1 M tokens of KV against the 0.86 M it holds: it preempts throughout, and each
          step reads the whole cache). --kv-cache-dtype fp8 holds twice the tokens and reads half
          the bytes a token, for both sides in one call

The load comes from --client-procs processes (the generator must not be what saturates), each
sending its share of one arrival schedule. Prints a table and one JSON line per figure (also
in OUTDIR/online.jsonl).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import random
import re
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).parent))

RESULTS: list[dict] = []
MAX_NUM_SEQS = 256
MAX_NUM_BATCHED_TOKENS = 2048
W8_PHASES = {"W8", "W8server", "W8engine"}


def emit(out: Path | None, **row: object) -> None:
    RESULTS.append(row)
    line = json.dumps(row)
    print(line, flush=True)
    if out is not None:
        with open(out / "online.jsonl", "a") as f:
            f.write(line + "\n")


@dataclass
class Result:
    ok: bool = False
    ttft: float | None = None
    gaps: list[float] = field(default_factory=list)
    tokens: int = 0
    error: str | None = None  # why it failed: the HTTP status and body, or the exception
    constrained: bool = False  # the request had a response_format (--json-fractions)


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


async def one_request(client: httpx.AsyncClient, url: str, body: dict) -> Result:
    result = Result(constrained="response_format" in body)
    start = time.perf_counter()
    last = start
    try:
        async with client.stream("POST", url, json=body, timeout=900) as response:
            if response.status_code != 200:
                result.error = f"{response.status_code}: {(await response.aread())[:200]!r}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    result.tokens = chunk["usage"]["completion_tokens"]
                choices = chunk.get("choices")
                # A chunk carries this step's tokens: their ids (return_token_ids), or at least text.
                if not choices or not (choices[0].get("token_ids") or choices[0].get("text")):
                    continue
                now = time.perf_counter()
                if result.ttft is None:
                    result.ttft = now - start
                else:
                    result.gaps.append(now - last)
                last = now
        result.ok = True
    except httpx.HTTPError as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    return result


def _client_proc(args: tuple) -> list[Result]:
    """One load-generator process: its share of (offset s, body) pairs, sent at t0 + offset."""
    url, schedule, t0 = args

    async def run() -> list[Result]:
        limits = httpx.Limits(max_connections=10_000, max_keepalive_connections=10_000)
        async with httpx.AsyncClient(limits=limits) as client:
            tasks = []
            for offset, body in schedule:
                delay = t0 + offset - time.time()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(one_request(client, url, body)))
            return list(await asyncio.gather(*tasks))

    return asyncio.run(run())


def send_load(base_url: str, bodies: list[dict], offsets: list[float], procs: int) -> tuple[list[Result], float]:
    """Send ``bodies`` at ``offsets`` seconds from now from ``procs`` processes; (results, seconds
    from the first send to the last answer)."""
    schedule = list(zip(offsets, bodies))
    shares = [schedule[i::procs] for i in range(procs)]
    t0 = time.time() + 1.0  # every process is up before the first send
    with multiprocessing.get_context("fork").Pool(procs) as pool:
        parts = pool.map(_client_proc, [(f"{base_url}/completions", share, t0) for share in shares])
    elapsed = time.time() - t0
    return [r for part in parts for r in part], elapsed


def summarize(results: list[Result], elapsed: float, slo_ttft: float, slo_itl: float) -> dict:
    done = [r for r in results if r.ok and r.ttft is not None]
    ttfts = [r.ttft for r in done if r.ttft is not None]
    gaps = [g for r in done for g in r.gaps]
    good = [r for r in done if r.ttft <= slo_ttft and (percentile(r.gaps, 0.99) or 0) <= slo_itl]
    ms = lambda v: round(v * 1000, 1) if v is not None else None
    errors = [r.error for r in results if r.error]
    return {
        "sent": len(results),
        "failed": len(errors),
        "first_error": errors[0] if errors else None,
        "completed": len(done),
        "completed_req_s": round(len(done) / elapsed, 2),
        "output_tok_s": round(sum(r.tokens for r in done) / elapsed, 1),
        "ttft_p50_ms": ms(percentile(ttfts, 0.5)),
        "ttft_p99_ms": ms(percentile(ttfts, 0.99)),
        "itl_p50_ms": ms(statistics.median(gaps) if gaps else None),
        "itl_p99_ms": ms(percentile(gaps, 0.99)),
        "goodput_req_s": round(len(good) / elapsed, 2),
    }


def body(model: str, prompt: list[int], max_tokens: int, constrained: bool = False) -> dict:
    request = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,  # the dummy engine has no tokenizer: count tokens, not text
    }
    if constrained:
        # At least max_tokens integers: the grammar never lets the request end before its budget,
        # so constrained and plain requests make the same number of tokens (ignore_eos cannot be
        # combined with a response_format).
        schema = {"type": "object", "required": ["values"], "properties": {"values": {
            "type": "array", "minItems": max_tokens, "items": {"type": "integer", "minimum": 0, "maximum": 999}}}}
        del request["ignore_eos"]
        request["response_format"] = {"type": "json_schema", "json_schema": {"name": "values", "schema": schema}}
    return request


def bodies(model: str, prompts: list[list[int]], max_tokens: int, json_fraction: float) -> list[dict]:
    """One body per prompt, ``json_fraction`` of them (spread evenly) constrained to a schema."""
    return [body(model, p, max_tokens, int((i + 1) * json_fraction) > int(i * json_fraction))
            for i, p in enumerate(prompts)]


def summarize_by_kind(out: Path | None, results: list[Result], elapsed: float, args: argparse.Namespace,
                      **labels: object) -> None:
    """The phase's figures over all requests, then (when some were constrained) for the
    constrained and the plain requests apart."""
    emit(out, **labels, **summarize(results, elapsed, args.slo_ttft, args.slo_itl))
    if any(r.constrained for r in results):
        for kind, part in (("constrained", [r for r in results if r.constrained]),
                           ("plain", [r for r in results if not r.constrained])):
            emit(out, **labels, requests=kind, **summarize(part, elapsed, args.slo_ttft, args.slo_itl))


def poisson_offsets(n: int, rate: float, seed: int) -> list[float]:
    rng = random.Random(seed)
    t, offsets = 0.0, []
    for _ in range(n):
        offsets.append(t)
        t += rng.expovariate(rate)
    return offsets


def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1000, vocab) for _ in range(length)] for _ in range(n)]


class Server:
    """engine-serve in a subprocess on a free port; its log goes to ``log``."""

    def __init__(self, artifact: str, log: Path, extra: list[str], env: dict[str, str] | None = None):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.base = f"http://127.0.0.1:{self.port}"
        self.log = log
        self.extra = list(extra)
        self.start = time.perf_counter()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pagecast.runtime.cli", artifact, "--port", str(self.port),
             "--max-num-seqs", str(MAX_NUM_SEQS), "--max-num-batched-tokens", str(MAX_NUM_BATCHED_TOKENS),
             "--max-queue", "4096", *extra],
            stdout=subprocess.DEVNULL, stderr=open(log, "w"), env={**os.environ, **(env or {})},
        )

    def wait_healthy(self, timeout: float = 600) -> float:
        while time.perf_counter() - self.start < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"engine-serve exited with {self.proc.returncode}: see {self.log}")
            try:
                with urllib.request.urlopen(self.base + "/health", timeout=1) as r:
                    if r.status == 200:
                        return time.perf_counter() - self.start
            except OSError:
                pass
            time.sleep(0.02)
        raise RuntimeError("engine-serve did not become healthy")

    def model(self) -> str:
        return json.load(urllib.request.urlopen(self.base + "/v1/models"))["data"][0]["id"]

    def wait_lazy_graphs(self, timeout: float = 60) -> float | None:
        """Seconds waited for the core's lazily captured CUDA graphs to be all in (its log's "cuda
        graphs (lazy)" start-up mark); None where there is nothing to wait for: graphs captured
        before serving, none at all (a CPU engine, --no-cuda-graphs), or a log that never says."""
        if "--no-cuda-graphs" in self.extra or "--no-lazy-graphs" in self.extra:
            return None
        t = time.perf_counter()
        while time.perf_counter() - t < timeout:
            text = self.log.read_text()
            if "cuda graphs (lazy) at" in text:
                return time.perf_counter() - t
            if "cuda graphs at" in text or " on cuda" not in text:  # captured before serving, or no GPU
                return None
            time.sleep(0.02)
        return None

    def complete(self, model: str, prompt: list[int], max_tokens: int = 1) -> float:
        """A non-streamed request; seconds until its answer."""
        data = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True}).encode()
        req = urllib.request.Request(self.base + "/v1/completions", data=data, headers={"Content-Type": "application/json"})
        t = time.perf_counter()
        with urllib.request.urlopen(req, timeout=120) as r:
            json.load(r)
        return time.perf_counter() - t

    def metric(self, name: str) -> float:
        text = urllib.request.urlopen(self.base + "/metrics", timeout=10).read().decode()
        total = 0.0
        for line in text.splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                total += float(line.rsplit(" ", 1)[1])
        return total

    def stop(self) -> int:
        self.proc.terminate()
        try:
            return self.proc.wait(120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


def triton_compiles(log: Path) -> str:
    found = re.findall(r"triton: (\d+) kernels compiled while serving", log.read_text())
    return found[-1] if found else "not logged"


def phase_w5(out: Path | None, server: Server, model: str, args: argparse.Namespace, cached: bool) -> None:
    rng = random.Random(5)
    prefix = [rng.randrange(1000, args.vocab) for _ in range(args.w5_prefix)]
    prompts = [prefix + [rng.randrange(1000, args.vocab) for _ in range(args.w5_own)] for _ in range(256)]
    queries0 = server.metric("pagecast_prefix_cache_queries_total")
    hits0 = server.metric("pagecast_prefix_cache_hits_total")
    results, elapsed = send_load(server.base + "/v1", [body(model, p, args.w5_output) for p in prompts],
                                 poisson_offsets(len(prompts), args.w5_rate, 55), args.client_procs)
    queries = server.metric("pagecast_prefix_cache_queries_total") - queries0
    hits = server.metric("pagecast_prefix_cache_hits_total") - hits0
    row = summarize(results, elapsed, args.slo_ttft, args.slo_itl)
    emit(out, figure="W5", prefix_caching=cached, rate=args.w5_rate, hit_rate=round(hits / queries, 4) if queries else 0.0,
         **row)


def weight_files(artifact: str) -> list[Path]:
    return sorted((Path(artifact) / "weights").glob("*.safetensors"))


def drop_from_page_cache(files: list[Path]) -> None:
    """Evict the files' pages (clean pages of files we can open: no root needed)."""
    import os

    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def dd_read_rate(files: list[Path]) -> float:
    """GB/s of `dd` reading the files sequentially (from wherever their pages are now)."""
    total, t = 0, time.perf_counter()
    for path in files:
        subprocess.run(["dd", f"if={path}", "of=/dev/null", "bs=16M"], check=True, capture_output=True)
        total += path.stat().st_size
    return total / (time.perf_counter() - t) / 1e9


def torch_import() -> dict:
    """Seconds a fresh interpreter takes to import torch (the start's longest phase: 3.1-4.0 s of
    the core's on the H200 machine), and whether torch's bytecode is cached. Where it is not and
    cannot be written (PYTHONDONTWRITEBYTECODE, as on the H200 machine of 2026-12-03), every start
    compiles torch's Python source again, which a pip-installed image does not."""
    probe = (  # cached: the bytecode file Python looks for (PYTHONPYCACHEPREFIX honoured) exists
        "import importlib.util, os, sys, time; t = time.perf_counter(); import torch; "
        "print(time.perf_counter() - t, os.path.exists(importlib.util.cache_from_source(torch.__file__)), "
        "sys.dont_write_bytecode)"
    )
    runs = [subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout.split()
            for _ in range(3)]  # fmt: skip
    return dict(seconds=[round(float(r[0]), 2) for r in runs], bytecode_cached=runs[-1][1] == "True",
                dont_write_bytecode=runs[-1][2] == "True")


def phase_start(out: Path, artifact: str, args: argparse.Namespace) -> None:
    """engine-serve started --starts times: /health, first token, first and steady TTFT, compiles,
    the start-up timeline and the weights' read rate of each start (see the module's docstring)."""
    from pagecast.runtime.engine_core import PROFILE_WARM_UP_ENV
    from pagecast.runtime.startup import parse_log

    files = weight_files(artifact)
    weight_bytes = sum(f.stat().st_size for f in files)
    disk_gbs = None
    if args.cold and files:
        drop_from_page_cache(files)
        disk_gbs = round(dd_read_rate(files), 2)
    emit(out, figure="torch_import", **torch_import())
    rng = random.Random(7)
    for start in range(args.starts):
        if args.cold:
            drop_from_page_cache(files)
        log = out / f"engine_serve_start{start}.log"
        # This start's server alone (its core inherits the variable); later phases' are not profiled.
        profile = {PROFILE_WARM_UP_ENV: str((out / f"warm_up_profile_start{start}.txt").resolve())}
        server = Server(artifact, log, args.server_arg, profile if args.profile_warm_up else None)
        try:
            healthy = server.wait_healthy()
            model = args.model or server.model()
            first = server.complete(model, [rng.randrange(1000, args.vocab) for _ in range(args.prompt_len)])
            # Steady means with every graph in: lazy graphs are captured between requests at first,
            # and a request that arrives during a capture waits for it.
            graphs_waited = server.wait_lazy_graphs()
            steady = [server.complete(model, [rng.randrange(1000, args.vocab) for _ in range(args.prompt_len)])
                      for _ in range(10)]
        finally:
            status = server.stop()
        text = log.read_text()
        timeline = {f"{process} {phase}": at for process, phase, at in parse_log(text)}
        at_start = re.findall(r"compiled (\d+) Triton kernels at start", text)
        row = dict(start=start + 1, cold=bool(args.cold), health_s=round(healthy, 2),
                   first_token_s=round(healthy + first, 2), first_request_ttft_ms=round(first * 1000, 1),
                   steady_ttft_ms=round(statistics.median(steady) * 1000, 1),
                   waited_for_lazy_graphs_s=None if graphs_waited is None else round(graphs_waited, 2),
                   triton_compiles_at_start=int(at_start[-1]) if at_start else 0,
                   triton_compiles_while_serving=triton_compiles(log), exit_code=status, timeline=timeline)
        read = [timeline.get("core weights allocated"), timeline.get("core weights read, on the device")]
        if files and None not in read and read[1] > read[0]:
            row["weights_gbs"] = round(weight_bytes / (read[1] - read[0]) / 1e9, 2)
            if disk_gbs:
                row["dd_gbs"] = disk_gbs
                row["weights_vs_dd"] = round(row["weights_gbs"] / disk_gbs, 3)
        emit(out, figure="start", **row)
        print("  " + "\n  ".join(f"{at:7.2f} s  {name}" for name, at in sorted(timeline.items(), key=lambda x: x[1])))
    starts = [r for r in RESULTS if r.get("figure") == "start"]
    emit(out, figure="start_median", starts=len(starts),
         health_s=statistics.median(r["health_s"] for r in starts),
         first_token_s=statistics.median(r["first_token_s"] for r in starts))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--artifact", help="default: build the Llama-3-8B-shaped dummy engine (also when the path holds none)")
    ap.add_argument("--base-url", help="an already running OpenAI-compatible server (W3 only)")
    ap.add_argument("--model", help="model name (default: the server's first model)")
    ap.add_argument("--phases", default="start,W3,sat,W5,engine")
    ap.add_argument("--rates", default="16,24,32,40")
    ap.add_argument("--duration", type=float, default=20.0, help="seconds of arrivals per rate")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--num-sat", type=int, default=640)
    ap.add_argument("--w5-rate", type=float, default=16.0)
    ap.add_argument("--w5-prefix", type=int, default=2048, help="W5: tokens of the shared prefix")
    ap.add_argument("--w5-own", type=int, default=64, help="W5: tokens of each request's own part")
    ap.add_argument("--w5-output", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=32000, help="prompt token ids are drawn below this")
    ap.add_argument("--slo-ttft", type=float, default=0.5, help="goodput: seconds to first token at most")
    ap.add_argument("--slo-itl", type=float, default=0.05, help="goodput: p99 inter-token seconds at most")
    ap.add_argument("--client-procs", type=int, default=4)
    ap.add_argument("--json-fractions", default="0",
                    help="W3 and sat: shares of requests constrained to a JSON schema, e.g. 0,0.5 (needs a tokenizer)")
    ap.add_argument("--weights", choices=["random", "files"], default="random",
                    help="when building: random (dummy artifact, weights drawn at load) or files (read and hashed at start)")
    ap.add_argument("--server-arg", action="append", default=[], help="extra engine-serve argument")
    ap.add_argument("--starts", type=int, default=3, help="start: how many times engine-serve is started")
    ap.add_argument("--profile-warm-up", action="store_true",
                    help="start: the warm-up of each start under torch.profiler and cProfile, written to "
                    "OUT/warm_up_profile_startN.txt (its runs' seconds and loaded kernels, the busiest "
                    "operators and Python functions, the runs again unprofiled; it slows the start)")
    ap.add_argument("--cold", action="store_true",
                    help="start: drop the weight files from the page cache before each start (and time dd on them)")
    ap.add_argument("--tune-budget", type=float, default=90.0,
                    help="enginebuild --tune-budget of the artifact built here (W8 compares two runs of one "
                    "artifact: a short budget leaves time for its two 2M-token runs in one device call)")
    ap.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default="auto",
                    help="enginebuild --kv-cache-dtype of the artifact built here")
    ap.add_argument("--w8-seqs", type=int, default=256, help="W8: streams sent at once")
    ap.add_argument("--w8-output", type=int, default=8192, help="W8: output tokens of each")
    ap.add_argument("--w8-prompt-len", type=int, default=128, help="W8: prompt tokens of each")
    args = ap.parse_args()
    phases = set(args.phases.split(","))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
    if args.base_url:
        model = args.model or json.load(urllib.request.urlopen(args.base_url + "/models"))["data"][0]["id"]
        for rate in (float(r) for r in args.rates.split(",")):
            n = int(rate * args.duration)
            prompts = random_prompts(n, args.prompt_len, args.vocab, int(rate * 1000))
            results, elapsed = send_load(args.base_url, [body(model, p, args.output_len) for p in prompts],
                                         poisson_offsets(n, rate, int(rate)), args.client_procs)
            emit(args.out, figure="W3", rate=rate, **summarize(results, elapsed, args.slo_ttft, args.slo_itl))
        print_table()
        return
    out = args.out or Path("bench-out")
    out.mkdir(parents=True, exist_ok=True)
    artifact = args.artifact or str(out / "llama3-8b-dummy")
    if not (Path(artifact) / "manifest.json").is_file():
        import serving

        max_model_len = max(4096, args.w8_prompt_len + args.w8_output) if phases & W8_PHASES else 4096
        serving.build(out, Path(artifact), max_model_len, args.tune_budget, args.weights, args.kv_cache_dtype)
        args.vocab = 120000
    if "start" in phases:
        phase_start(out, artifact, args)
        if not phases - {"start"}:
            print_table()
            return
    w8_prompts = random_prompts(args.w8_seqs, args.w8_prompt_len, args.vocab, 8)
    if phases <= {"W8engine"}:
        w8_engine(out, artifact, w8_prompts, args)
        print_table()
        return
    server = Server(artifact, out / "engine_serve.log", args.server_arg)
    try:
        server.wait_healthy()
        model = args.model or server.model()
        rng = random.Random(7)
        server.complete(model, [rng.randrange(1000, args.vocab) for _ in range(args.prompt_len)])
        fractions = [float(f) for f in args.json_fractions.split(",")]
        if any(fractions):  # the core loads the tokenizer and compiles the schema for the first one
            send_load(server.base + "/v1", bodies(model, [[1000] * 8], args.output_len, 1.0), [0.0], 1)
        if "W3" in phases:
            for fraction in fractions:
                for rate in (float(r) for r in args.rates.split(",")):
                    n = int(rate * args.duration)
                    prompts = random_prompts(n, args.prompt_len, args.vocab, int(rate * 1000))
                    results, elapsed = send_load(server.base + "/v1", bodies(model, prompts, args.output_len, fraction),
                                                 poisson_offsets(n, rate, int(rate)), args.client_procs)
                    summarize_by_kind(out, results, elapsed, args, figure="W3", rate=rate, json_fraction=fraction)
        if "sat" in phases or "engine" in phases:
            sat_prompts = random_prompts(args.num_sat, args.prompt_len, args.vocab, 640)
        if "sat" in phases:
            for fraction in fractions:
                results, elapsed = send_load(server.base + "/v1", bodies(model, sat_prompts, args.output_len, fraction),
                                             [0.0] * len(sat_prompts), args.client_procs)
                summarize_by_kind(out, results, elapsed, args, figure="saturation_server", json_fraction=fraction)
        if "W5" in phases:
            phase_w5(out, server, model, args, cached=True)
        if phases & {"W8", "W8server"}:
            results, elapsed = send_load(server.base + "/v1", [body(model, p, args.w8_output) for p in w8_prompts],
                                         [0.0] * len(w8_prompts), args.client_procs)
            emit(out, figure="W8_server", seqs=args.w8_seqs, output_len=args.w8_output,
                 **summarize(results, elapsed, args.slo_ttft, args.slo_itl))
    finally:
        status = server.stop()
    emit(out, figure="server_exit", exit_code=status, triton_compiles_while_serving=triton_compiles(server.log))
    if "W5" in phases:
        server = Server(artifact, out / "engine_serve_nocache.log", [*args.server_arg, "--no-prefix-caching"])
        try:
            server.wait_healthy()
            phase_w5(out, server, server.model(), args, cached=False)
        finally:
            server.stop()
    llm = None
    if phases & {"engine", "W8", "W8engine"}:
        llm = engine(artifact)
    if phases & {"W8", "W8engine"}:
        w8_engine(out, artifact, w8_prompts, args, llm)
    if "engine" in phases:
        from pagecast.runtime import SamplingParams

        params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=0)
        t = time.perf_counter()
        outs = llm.generate(sat_prompts, params)
        secs = time.perf_counter() - t
        n = sum(len(o.token_ids) for o in outs)
        emit(out, figure="saturation_engine", completed_req_s=round(len(outs) / secs, 2),
             output_tok_s=round(n / secs, 1))
        server_row = next((r for r in RESULTS if r.get("figure") == "saturation_server"), None)
        if server_row:
            emit(out, figure="server_engine_ratio", value=round(server_row["output_tok_s"] / (n / secs), 3), target=0.9)
    print_table()


def engine(artifact: str) -> Any:
    from pagecast.runtime import LLM

    return LLM(artifact, max_num_seqs=MAX_NUM_SEQS, max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS)


def w8_engine(out: Path, artifact: str, prompts: list[list[int]], args: argparse.Namespace, llm: Any = None) -> None:
    """W8's engine side: the same prompts through LLM.generate, and the ratio to the server's
    figure when this run measured it."""
    from pagecast.runtime import SamplingParams

    llm = llm or engine(artifact)
    params = SamplingParams(max_tokens=args.w8_output, ignore_eos=True, temperature=0)
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    secs = time.perf_counter() - t
    n = sum(len(o.token_ids) for o in outs)
    emit(out, figure="W8_engine", seqs=args.w8_seqs, output_len=args.w8_output, output_tok_s=round(n / secs, 1))
    server_row = next((r for r in RESULTS if r.get("figure") == "W8_server"), None)
    if server_row:
        emit(out, figure="W8_server_engine_ratio", value=round(server_row["output_tok_s"] / (n / secs), 3), target=0.9)


def print_table() -> None:
    print("\n| figure | figures |\n|---|---|")
    for r in RESULTS:
        print(f"| {r['figure']} | {json.dumps({k: v for k, v in r.items() if k != 'figure'})} |")


if __name__ == "__main__":
    main()
