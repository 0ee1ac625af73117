"""Helpers for the server tests (no tests here): a real uvicorn server on 127.0.0.1 in a
thread, the reference model, and small HTTP utilities."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import torch

# Small on purpose: the tiny model needs a few MiB, and the disconnect/load tests want a pool
# whose usage is easy to read.
KV_CACHE_MEMORY = "16MiB"


def make_engine(artifact: Path, **options: Any) -> Any:
    from pagecast.runtime import AsyncEngine

    options.setdefault("kv_cache_memory", KV_CACHE_MEMORY)
    return AsyncEngine.from_artifact(artifact, **options)


class ServerThread:
    """uvicorn serving ``app`` on a free port of 127.0.0.1, in a daemon thread."""

    def __init__(self, app: Any):
        import uvicorn

        # IPPROTO_TCP named, as getaddrinfo names it for engine-serve's own socket: asyncio turns
        # on TCP_NODELAY only for sockets whose proto says TCP, and without it a keep-alive
        # client waits ~40 ms (Nagle against delayed ACKs) for each response's body.
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self.port = self._sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False))
        self._thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self._sock]}, daemon=True)

    def start(self) -> ServerThread:
        self._thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the test server did not start")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self._thread.join(30)
        self._sock.close()


@contextmanager
def serve(engines: Mapping[str, Any], **app_options: Any) -> Iterator[ServerThread]:
    from pagecast.runtime.server.app import create_app

    server = ServerThread(create_app(engines, **app_options)).start()
    try:
        yield server
    finally:
        server.stop()


def metric_samples(base_url: str, headers: Mapping[str, str] | None = None) -> dict[tuple[str, tuple], float]:
    """/metrics parsed with prometheus_client's parser: (sample name, sorted labels) -> value."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{base_url}/metrics", headers=dict(headers or {}), timeout=30).text
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def metric(samples: Mapping[tuple[str, tuple], float], name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def wait_for(predicate: Any, timeout: float = 30.0, interval: float = 0.05) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(interval)


class ReferenceModel:
    """transformers' model on the checkpoint the artifact was built from, in fp32."""

    def __init__(self, checkpoint: Path):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32).eval()

    @torch.no_grad()
    def logits(self, token_ids: list[int]) -> torch.Tensor:
        """``[len(token_ids), vocab]``: row j predicts token j + 1."""
        return self.model(torch.tensor([token_ids])).logits[0].float()

    def logprobs(self, token_ids: list[int]) -> torch.Tensor:
        return torch.log_softmax(self.logits(token_ids), dim=-1)

    @torch.no_grad()
    def greedy(self, prompt: list[int], max_tokens: int, processors: list[Any]) -> list[int]:
        """Greedy decoding with transformers' logits processors applied at each step."""
        ids = list(prompt)
        out = []
        for _ in range(max_tokens):
            scores = self.logits(ids)[-1:].clone()
            input_ids = torch.tensor([ids])
            for proc in processors:
                scores = proc(input_ids, scores)
            token = int(scores.argmax(-1))
            out.append(token)
            ids.append(token)
        return out


def engine_serve_command() -> list[str]:
    """The engine-serve command of this interpreter's environment (its script, else the module)."""
    import sys

    exe = Path(sys.executable).with_name("engine-serve")
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "pagecast.runtime.cli"]


def start_engine_serve(args: list[str], log: Path, env: Mapping[str, str] | None = None) -> tuple[Any, str]:
    """engine-serve with ``args`` in a subprocess on a free port, stderr to ``log``; returns
    (process, base URL) once /health answers 200 (fails the test if it exits or takes 120 s)."""
    import os
    import subprocess

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [*engine_serve_command(), *args, "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=open(log, "wb"),
        env={**os.environ, **(env or {})},
    )
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        if proc.poll() is not None:
            raise AssertionError(f"engine-serve exited with {proc.returncode}:\n{log.read_text()}")
        try:
            if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                return proc, base
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError("engine-serve did not come up in 120 s")
        time.sleep(0.2)


def assert_served_greedy_matches(
    artifact: Path, prompts: list[str], max_tokens: int, reference: Callable[[], Any], log: Path,
    decode: Callable[..., list[int]] | None = None,
) -> None:
    """Serve ``artifact`` with engine-serve in a subprocess (at most 32 batched tokens and 8
    sequences, so long prompts prefill in chunks), send ``prompts`` as token ids (the artifact's
    tokenizer, no special tokens) in one /v1/completions request (temperature 0, ``max_tokens``,
    ignore_eos), stop the server, and assert that each choice's text is the decoded greedy output
    of ``reference()`` (a transformers model, loaded only after the server is gone), decoded by
    ``decode(model, ids, max_tokens)`` (default: transformers' generate)."""
    from engine_utils import hf_greedy
    from transformers import AutoTokenizer

    proc, base = start_engine_serve(
        [str(artifact), "--max-num-batched-tokens", "32", "--max-num-seqs", "8"], log
    )
    try:
        tok = AutoTokenizer.from_pretrained(str(artifact / "tokenizer"))
        prompt_ids = [tok.encode(p, add_special_tokens=False) for p in prompts]
        model = httpx.get(f"{base}/v1/models", timeout=30).json()["data"][0]["id"]
        greedy = {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
        body = {"model": model, "prompt": prompt_ids, **greedy}
        reply = httpx.post(f"{base}/v1/completions", json=body, timeout=120)
        assert reply.status_code == 200, reply.text
        texts = [c["text"] for c in sorted(reply.json()["choices"], key=lambda c: c["index"])]
    finally:
        proc.terminate()
        proc.wait(30)
    hf = reference()
    for ids, text in zip(prompt_ids, texts, strict=True):
        assert text == tok.decode((decode or hf_greedy)(hf, ids, max_tokens), skip_special_tokens=True)
