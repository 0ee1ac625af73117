"""What the engine hands back to callers: per-request outputs, built incrementally."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    """One token's log-probability under the model's raw distribution (before penalties,
    temperature or truncation), its 1-based rank, and its text."""

    logprob: float
    rank: int
    decoded_token: str | None = None


# One position: token id -> Logprob. Holds the chosen token plus the top-k alternatives.
PositionLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    """One generated sequence of a request (a request with n > 1 has n of them).

    Everything is cumulative: ``text`` and ``token_ids`` hold all output so far. ``text`` never
    ends in half a UTF-8 character and never holds a stop string or text that could still
    become one; it is final once ``finish_reason`` is set.
    """

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" | None while running
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    logprobs: list[PositionLogprobs] | None = None
    cumulative_logprob: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Timestamps (time.monotonic()) of one request's life, for latency metrics and logs."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    num_preemptions: int = 0


@dataclass
class RequestOutput:
    """The state of one request after an engine step. Safe to read once handed out: the
    engine builds a new one per step and never mutates one it has returned."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: list[PositionLogprobs | None] | None = None  # first entry None (no context)
    metrics: RequestMetrics | None = None

    # Shortcuts to the first (usually only) sequence.
    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason
