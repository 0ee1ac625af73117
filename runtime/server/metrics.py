"""Prometheus metrics of one server, in a registry of its own (two apps in one process, as in
the tests, never share or clash).

Two sources: per-request latencies and finish reasons, observed here as the server follows
each engine request; and engine-wide state and totals (running/waiting requests, KV blocks,
prefix cache, token, preemption and kernel-compile counts), read from ``engine.stats()`` at
scrape time so they are always current and count every request, also those of the Python API.

Every metric carries ``model_name`` (the served name) except the error counter, whose
request may name no valid model. Names are listed in README.md, section "Serving".
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pagecast.runtime.outputs import RequestOutput

PREFIX = "pagecast"

# fmt: off
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0)
_ITL_BUCKETS = (0.001, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4,
                0.5, 0.75, 1.0, 2.5, 5.0)
_E2E_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                60.0, 120.0, 240.0, 480.0)
_QUEUE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0,
                  160.0)
# fmt: on

FINISH_REASONS = ("stop", "length", "abort", "error")


class ServerMetrics:
    """The metrics of one app. ``engines`` maps served model names to engines; ``in_flight``
    returns the sequences the server has admitted per model (for the admission gauge)."""

    def __init__(self, engines: Mapping[str, Any], in_flight: Any = None):
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        self.requests = Counter(
            f"{PREFIX}_requests",
            "Finished engine requests (one per prompt), by finish reason.",
            ["model_name", "finish_reason"],
            registry=self.registry,
        )
        self.request_errors = Counter(
            f"{PREFIX}_request_errors",
            "Requests answered with an error, by HTTP status and error code.",
            ["status", "code"],
            registry=self.registry,
        )
        self.time_to_first_token = Histogram(
            f"{PREFIX}_time_to_first_token_seconds",
            "Arrival to first generated token.",
            labels,
            buckets=_TTFT_BUCKETS,
            registry=self.registry,
        )
        self.inter_token_latency = Histogram(
            f"{PREFIX}_inter_token_latency_seconds",
            "Time between consecutive generated tokens.",
            labels,
            buckets=_ITL_BUCKETS,
            registry=self.registry,
        )
        self.e2e_latency = Histogram(
            f"{PREFIX}_e2e_request_latency_seconds",
            "Arrival to finish of an engine request.",
            labels,
            buckets=_E2E_BUCKETS,
            registry=self.registry,
        )
        self.queue_time = Histogram(
            f"{PREFIX}_request_queue_time_seconds",
            "Arrival to first scheduled (time spent waiting).",
            labels,
            buckets=_QUEUE_BUCKETS,
            registry=self.registry,
        )
        for name in engines:
            for reason in FINISH_REASONS:
                self.requests.labels(name, reason)  # exported at 0 from the start, so rates work
        self.registry.register(_EngineCollector(engines, in_flight))

    def exposition(self) -> bytes:
        return generate_latest(self.registry)

    def follow(self, model_name: str) -> RequestRecorder:
        return RequestRecorder(self, model_name)


class RequestRecorder:
    """Follows one engine request's outputs (``update`` with each) and records its latencies
    and finish reason once (``finish``)."""

    def __init__(self, metrics: ServerMetrics, model_name: str):
        self._metrics = metrics
        self._model = model_name
        self._last_time: float | None = None
        self._num_tokens = 0
        self._done = False
        self.last: RequestOutput | None = None

    def update(self, out: RequestOutput, num_tokens: int | None = None) -> None:
        """``num_tokens``: the most output tokens of any choice so far, where ``out`` is a delta
        (default: counted in ``out``, a cumulative output)."""
        self.last = out
        if num_tokens is None:
            num_tokens = max((len(o.token_ids) for o in out.outputs), default=0)
        if num_tokens <= self._num_tokens:
            return
        m = out.metrics
        now = (
            m.last_token_time if m is not None and m.last_token_time is not None else None
        ) or time.monotonic()
        if self._last_time is not None and self._num_tokens > 0:
            new = num_tokens - self._num_tokens
            gap = max(0.0, now - self._last_time) / new
            for _ in range(new):
                self._metrics.inter_token_latency.labels(self._model).observe(gap)
        elif num_tokens > 1 and m is not None and m.first_token_time is not None and m.last_token_time is not None:
            # Several tokens in the first output seen (a request answered once, at its end): their
            # gaps on average, one observation per gap.
            gap = max(0.0, m.last_token_time - m.first_token_time) / (num_tokens - 1)
            for _ in range(num_tokens - 1):
                self._metrics.inter_token_latency.labels(self._model).observe(gap)
        self._last_time = now
        self._num_tokens = num_tokens

    def finish(self, finish_reason: str) -> None:
        if self._done:
            return
        self._done = True
        self._metrics.requests.labels(self._model, finish_reason).inc()
        m = self.last.metrics if self.last is not None else None
        if m is None:
            return
        if m.first_token_time is not None:
            self._metrics.time_to_first_token.labels(self._model).observe(m.first_token_time - m.arrival_time)
        if m.first_scheduled_time is not None:
            self._metrics.queue_time.labels(self._model).observe(m.first_scheduled_time - m.arrival_time)
        finished = m.finished_time if m.finished_time is not None else time.monotonic()
        self._metrics.e2e_latency.labels(self._model).observe(finished - m.arrival_time)


class _EngineCollector(Collector):
    """Engine state, read at scrape time. A dead engine's stats are skipped, not an error:
    /metrics keeps answering (with ``pagecast_engine_alive`` 0) while /health reports it."""

    def __init__(self, engines: Mapping[str, Any], in_flight: Any):
        self._engines = engines
        self._in_flight = in_flight

    def collect(self) -> Iterator[Metric]:
        def gauge(name: str, doc: str) -> GaugeMetricFamily:
            return GaugeMetricFamily(f"{PREFIX}_{name}", doc, labels=["model_name"])

        def counter(name: str, doc: str) -> CounterMetricFamily:
            return CounterMetricFamily(f"{PREFIX}_{name}", doc, labels=["model_name"])

        alive = gauge("engine_alive", "1 while the engine loop runs, else 0.")
        running = gauge("num_requests_running", "Sequences being generated.")
        waiting = gauge(
            "num_requests_waiting", "Sequences waiting to be scheduled (preempted ones included)."
        )
        in_flight = gauge(
            "server_sequences_in_flight", "Sequences the server has admitted and not yet finished."
        )
        blocks_used = gauge("kv_cache_blocks_used", "KV-cache blocks in use.")
        blocks_total = gauge("kv_cache_blocks_total", "KV-cache blocks in the pool.")
        usage = gauge("kv_cache_usage_ratio", "Fraction of KV-cache blocks in use (0 to 1).")
        hit_rate = gauge("prefix_cache_hit_rate", "Prefix-cache hits / queries (tokens) since start.")
        queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        prompt_tokens = counter("prompt_tokens", "Prompt tokens processed.")
        generation_tokens = counter("generation_tokens", "Tokens generated.")
        preemptions = counter("num_preemptions", "Sequences preempted (their KV blocks recomputed later).")
        compiles = counter(
            "kernel_compiles",
            "Triton kernels compiled while serving (the artifact's kernel cache missed them; each stalls the engine).",
        )
        spec_drafts = counter("spec_decode_num_draft_tokens", "Speculative decoding: draft tokens verified.")
        spec_accepted = counter("spec_decode_num_accepted_tokens", "Speculative decoding: draft tokens accepted.")
        spec_rate = gauge(
            "spec_decode_acceptance_rate", "Speculative decoding: accepted / verified draft tokens since start."
        )
        spec_length = gauge(
            "spec_decode_mean_accepted_length",
            "Speculative decoding: tokens per sequence per verifying step (accepted drafts + 1) since start.",
        )
        spec_draft_time = counter("spec_decode_draft_seconds", "Speculative decoding: seconds spent proposing drafts.")
        spec_verify_time = counter(
            "spec_decode_verify_seconds", "Speculative decoding: seconds spent in the steps that verify drafts."
        )
        admitted = self._in_flight() if self._in_flight is not None else {}
        for name, engine in self._engines.items():
            is_alive = bool(engine.is_alive())
            alive.add_metric([name], 1.0 if is_alive else 0.0)
            in_flight.add_metric([name], float(admitted.get(name, 0)))
            if not is_alive:
                continue  # a dead engine's state is whatever it was when it failed: not reported
            s = engine.stats()
            running.add_metric([name], s.num_running)
            waiting.add_metric([name], s.num_waiting)
            blocks_used.add_metric([name], s.num_kv_blocks_used)
            blocks_total.add_metric([name], s.num_kv_blocks_total)
            usage.add_metric([name], s.kv_usage)
            hit_rate.add_metric(
                [name], s.prefix_cache_hits / s.prefix_cache_queries if s.prefix_cache_queries else 0.0
            )
            queries.add_metric([name], s.prefix_cache_queries)
            hits.add_metric([name], s.prefix_cache_hits)
            prompt_tokens.add_metric([name], s.num_prompt_tokens)
            generation_tokens.add_metric([name], s.num_generation_tokens)
            preemptions.add_metric([name], s.num_preemptions)
            compiles.add_metric([name], s.num_kernel_compiles)
            spec_drafts.add_metric([name], s.spec_num_draft_tokens)
            spec_accepted.add_metric([name], s.spec_num_accepted_tokens)
            spec_rate.add_metric(
                [name], s.spec_num_accepted_tokens / s.spec_num_draft_tokens if s.spec_num_draft_tokens else 0.0
            )
            spec_length.add_metric([name], s.spec_num_emitted_tokens / s.spec_num_verified if s.spec_num_verified else 0.0)
            spec_draft_time.add_metric([name], s.spec_draft_seconds)
            spec_verify_time.add_metric([name], s.spec_verify_seconds)
        yield from (
            alive,
            running,
            waiting,
            in_flight,
            blocks_used,
            blocks_total,
            usage,
            hit_rate,
            queries,
            hits,
            prompt_tokens,
            generation_tokens,
            preemptions,
            compiles,
            spec_drafts,
            spec_accepted,
            spec_rate,
            spec_length,
            spec_draft_time,
            spec_verify_time,
        )
