"""Two artifacts in one server, 64 concurrent streaming clients, and clients that leave
mid-request: their KV blocks are freed (read through /metrics, as an operator would)."""

from __future__ import annotations

import asyncio
import socket
import time

import httpx
import openai
import pytest
from server_support import make_engine, metric, metric_samples, serve, wait_for

from pagecast.runtime import LLM, SamplingParams

LLAMA, QWEN = "tiny-llama", "tiny-qwen"


@pytest.fixture(scope="module")
def artifacts(tiny_llama_artifact, tiny_artifact_factory):  # type: ignore[no-untyped-def]
    return {LLAMA: tiny_llama_artifact, QWEN: tiny_artifact_factory("qwen2")}


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def server(artifacts, request):  # type: ignore[no-untyped-def]
    # Every test runs against both engine loops: synchronous steps (the CPU default) and
    # asynchronous scheduling (the GPU default), where a step is in flight while the last is booked.
    engines = {
        name: make_engine(path, max_num_seqs=64, async_scheduling=request.param) for name, path in artifacts.items()
    }
    with serve(engines) as srv:
        yield srv


def blocks_used(server, model: str = LLAMA) -> float:  # type: ignore[no-untyped-def]
    return metric(metric_samples(server.url), "pagecast_kv_cache_blocks_used", model_name=model)


def aborted(server, model: str = LLAMA) -> float:  # type: ignore[no-untyped-def]
    return metric(
        metric_samples(server.url), "pagecast_requests_total", model_name=model, finish_reason="abort"
    )


def test_two_artifacts_answer_under_their_own_names(server, artifacts):  # type: ignore[no-untyped-def]
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
    assert sorted(m.id for m in client.models.list().data) == [LLAMA, QWEN]
    prompt = "The meaning of life is"
    texts = {}
    for name, path in artifacts.items():
        expected = LLM(path, kv_cache_memory="16MiB").generate(
            [prompt], SamplingParams(temperature=0, max_tokens=8)
        )
        resp = client.completions.create(model=name, prompt=prompt, max_tokens=8, temperature=0)
        assert resp.model == name
        assert resp.choices[0].text == expected[0].text
        texts[name] = resp.choices[0].text
    assert texts[LLAMA] != texts[QWEN]  # different weights, really two engines
    samples = metric_samples(server.url)
    for name in (LLAMA, QWEN):
        assert metric(samples, "pagecast_requests_total", model_name=name, finish_reason="length") >= 1
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="tiny", prompt=prompt)
    # Without `model`, a server of several models cannot guess.
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "x"}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "model"


def test_64_concurrent_streaming_clients(server, artifacts):  # type: ignore[no-untyped-def]
    prompts = [f"Request number {i} says" for i in range(64)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    expected = [o.text for o in LLM(artifacts[LLAMA], kv_cache_memory="16MiB").generate(prompts, params)]
    before = metric_samples(server.url)

    async def main() -> list[tuple[str, str | None, int]]:
        client = openai.AsyncOpenAI(
            base_url=f"{server.url}/v1",
            api_key="x",
            max_retries=0,
            timeout=120,
            http_client=openai.DefaultAsyncHttpxClient(limits=httpx.Limits(max_connections=64)),
        )

        async def one(prompt: str) -> tuple[str, str | None, int]:
            stream = await client.completions.create(
                model=LLAMA,
                prompt=prompt,
                max_tokens=16,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": True},
            )
            text, reason, used = "", None, -1
            async for chunk in stream:
                if chunk.choices:
                    text += chunk.choices[0].text
                    reason = chunk.choices[0].finish_reason or reason
                if chunk.usage:
                    used = chunk.usage.completion_tokens
            return text, reason, used

        try:
            return await asyncio.gather(*(one(p) for p in prompts))
        finally:
            await client.close()

    results = asyncio.run(main())
    assert [r[0] for r in results] == expected
    assert all(r[1] == "length" and r[2] == 16 for r in results)
    after = metric_samples(server.url)
    labels = {"model_name": LLAMA}
    assert (
        metric(after, "pagecast_requests_total", finish_reason="length", **labels)
        == metric(before, "pagecast_requests_total", finish_reason="length", **labels) + 64
    )
    assert (
        metric(after, "pagecast_generation_tokens_total", **labels)
        == metric(before, "pagecast_generation_tokens_total", **labels) + 64 * 16
    )
    assert metric(after, "pagecast_kv_cache_blocks_used", **labels) == 0
    assert metric(after, "pagecast_num_requests_running", **labels) == 0


LONG = {"model": LLAMA, "prompt": [11, 12, 13, 14], "max_tokens": 480, "ignore_eos": True}


def test_streaming_client_disconnect_frees_blocks(server):  # type: ignore[no-untyped-def]
    wait_for(lambda: blocks_used(server) == 0)
    before = aborted(server)
    with (
        httpx.Client(timeout=30) as c,
        c.stream("POST", f"{server.url}/v1/completions", json={**LONG, "stream": True}) as r,
    ):
        lines = r.iter_lines()
        for _ in range(3):
            next(lines)
        assert blocks_used(server) > 0  # mid-stream
    # The connection is closed: the request is aborted and its blocks are back.
    wait_for(lambda: blocks_used(server) == 0, timeout=10)
    wait_for(lambda: aborted(server) == before + 1, timeout=10)


def test_non_streaming_client_disconnect_frees_blocks(server):  # type: ignore[no-untyped-def]
    wait_for(lambda: blocks_used(server) == 0)
    before = aborted(server)
    body = httpx.Request("POST", f"{server.url}/v1/completions", json=LONG)
    raw = (
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body.content)}\r\n\r\n"
    ).encode() + body.content
    sock = socket.create_connection(("127.0.0.1", server.port))
    try:
        sock.sendall(raw)
        wait_for(lambda: blocks_used(server) > 0, timeout=10)
    finally:
        sock.close()  # leave before the answer
    start = time.monotonic()
    wait_for(lambda: blocks_used(server) == 0, timeout=10)
    wait_for(lambda: aborted(server) == before + 1, timeout=10)
    assert time.monotonic() - start < 5  # long before the 480 tokens would have been done


def test_metrics_parse_and_name_every_documented_family(server):  # type: ignore[no-untyped-def]
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{server.url}/metrics", timeout=30).text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    expected = {
        "pagecast_requests": "counter",
        "pagecast_request_errors": "counter",
        "pagecast_time_to_first_token_seconds": "histogram",
        "pagecast_inter_token_latency_seconds": "histogram",
        "pagecast_e2e_request_latency_seconds": "histogram",
        "pagecast_request_queue_time_seconds": "histogram",
        "pagecast_engine_alive": "gauge",
        "pagecast_num_requests_running": "gauge",
        "pagecast_num_requests_waiting": "gauge",
        "pagecast_server_sequences_in_flight": "gauge",
        "pagecast_kv_cache_blocks_used": "gauge",
        "pagecast_kv_cache_blocks_total": "gauge",
        "pagecast_kv_cache_usage_ratio": "gauge",
        "pagecast_prefix_cache_hit_rate": "gauge",
        "pagecast_prefix_cache_queries": "counter",
        "pagecast_prefix_cache_hits": "counter",
        "pagecast_prompt_tokens": "counter",
        "pagecast_generation_tokens": "counter",
        "pagecast_num_preemptions": "counter",
        "pagecast_kernel_compiles": "counter",
    }
    for name, kind in expected.items():
        assert name in families, name
        assert families[name].type == kind, name
    # Every family is documented in the README's Serving section.
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    docs = (root / "README.md").read_text()
    if "## Serving" not in docs:
        docs = (root / "runtime" / "server" / "README_SECTION.md").read_text()
    for name in families:
        if name.startswith("pagecast_") and not name.endswith("_created"):  # _created: per-series start time
            assert name in docs, f"{name} is not documented"
