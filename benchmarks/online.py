"""W3: online serving through the HTTP server, Poisson arrivals, streaming.

    python benchmarks/online.py --artifact ARTIFACT --rates 1,4,16 --duration 60 \
        [--prompt-len 512 --output-len 256] [--base-url http://host:port/v1 --model NAME]

Starts `engine-serve` on the artifact (unless --base-url points at a running server, e.g.
`transformers serve --continuous-batching` as the baseline), then for each rate sends requests
with exponential inter-arrival times for --duration seconds, each a streamed completion of
random token ids with EOS ignored, and measures per request the time to first token and the
gaps between streamed chunks (a chunk is one token unless text was held back); tokens are
counted from the final usage chunk. Prints one table row and one JSON line per rate: completed req/s, output
tok/s, TTFT p50/p99, inter-token latency p50/p99, and goodput (requests with TTFT <= --slo-ttft
and inter-token p99 <= --slo-itl, per second).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field

import httpx


@dataclass
class Result:
    ok: bool = False
    ttft: float | None = None
    gaps: list[float] = field(default_factory=list)
    tokens: int = 0


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


async def one_request(client: httpx.AsyncClient, url: str, body: dict) -> Result:
    result = Result()
    start = time.perf_counter()
    last = start
    try:
        async with client.stream("POST", url, json=body, timeout=600) as response:
            if response.status_code != 200:
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    result.tokens = chunk["usage"]["completion_tokens"]
                if not chunk.get("choices") or not chunk["choices"][0].get("text"):
                    continue
                now = time.perf_counter()
                if result.ttft is None:
                    result.ttft = now - start
                else:
                    result.gaps.append(now - last)
                last = now
        result.ok = True
    except httpx.HTTPError:
        pass
    return result


async def run_rate(base_url: str, model: str, rate: float, args: argparse.Namespace) -> dict:
    rng = random.Random(int(rate * 1000))
    url = f"{base_url}/completions"
    tasks = []
    limits = httpx.Limits(max_connections=10_000, max_keepalive_connections=10_000)
    async with httpx.AsyncClient(limits=limits) as client:
        start = time.perf_counter()
        while time.perf_counter() - start < args.duration:
            body = {
                "model": model,
                "prompt": [rng.randrange(1000, args.vocab) for _ in range(args.prompt_len)],
                "max_tokens": args.output_len,
                "ignore_eos": True,
                "temperature": 0,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            tasks.append(asyncio.create_task(one_request(client, url, body)))
            await asyncio.sleep(rng.expovariate(rate))
        sent_for = time.perf_counter() - start
        results = await asyncio.gather(*tasks)
        elapsed = time.perf_counter() - start
    done = [r for r in results if r.ok and r.ttft is not None]
    ttfts = [r.ttft for r in done if r.ttft is not None]
    gaps = [g for r in done for g in r.gaps]
    good = [r for r in done if r.ttft <= args.slo_ttft and (percentile(r.gaps, 0.99) or 0) <= args.slo_itl]
    ms = lambda v: round(v * 1000, 1) if v is not None else None  # noqa: E731
    return {
        "rate": rate,
        "sent": len(results),
        "completed": len(done),
        "sent_for_s": round(sent_for, 1),
        "completed_req_s": round(len(done) / elapsed, 2),
        "output_tok_s": round(sum(r.tokens for r in done) / elapsed, 1),
        "ttft_p50_ms": ms(percentile(ttfts, 0.5)),
        "ttft_p99_ms": ms(percentile(ttfts, 0.99)),
        "itl_p50_ms": ms(statistics.median(gaps) if gaps else None),
        "itl_p99_ms": ms(percentile(gaps, 0.99)),
        "goodput_req_s": round(len(good) / elapsed, 2),
    }


def start_server(artifact: str, extra: list[str]) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "pagecast.runtime.cli", artifact, "--port", str(port), *extra],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    base = f"http://127.0.0.1:{port}"
    for _ in range(600):
        if proc.poll() is not None:
            raise RuntimeError(f"engine-serve exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(base + "/health", timeout=1) as r:
                if r.status == 200:
                    return proc, base + "/v1"
        except OSError:
            time.sleep(0.5)
    proc.kill()
    raise RuntimeError("engine-serve did not become healthy in 300 s")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--artifact")
    ap.add_argument("--base-url", help="an already running OpenAI-compatible server, e.g. http://127.0.0.1:8000/v1")
    ap.add_argument("--model", help="model name (default: the server's first model)")
    ap.add_argument("--rates", default="1,4,16")
    ap.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals per rate")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=32000, help="prompt token ids are drawn below this")
    ap.add_argument("--slo-ttft", type=float, default=0.5, help="goodput: seconds to first token at most")
    ap.add_argument("--slo-itl", type=float, default=0.05, help="goodput: p99 inter-token seconds at most")
    ap.add_argument("--server-arg", action="append", default=[], help="extra engine-serve argument")
    args = ap.parse_args()
    proc = None
    base_url = args.base_url
    if base_url is None:
        if not args.artifact:
            ap.error("give --artifact or --base-url")
        proc, base_url = start_server(args.artifact, args.server_arg)
    try:
        model = args.model or json.load(urllib.request.urlopen(base_url + "/models"))["data"][0]["id"]
        rows = []
        for rate in (float(r) for r in args.rates.split(",")):
            row = asyncio.run(run_rate(base_url, model, rate, args))
            rows.append(row)
            print(json.dumps({"benchmark": "W3", **row}), flush=True)
        print("\n| rate | completed req/s | output tok/s | TTFT p50 / p99 (ms) | inter-token p50 / p99 (ms) | goodput req/s |")
        print("|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['rate']} | {r['completed_req_s']} | {r['output_tok_s']} | {r['ttft_p50_ms']} / {r['ttft_p99_ms']} "
                  f"| {r['itl_p50_ms']} / {r['itl_p99_ms']} | {r['goodput_req_s']} |")
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(60)


if __name__ == "__main__":
    main()
