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

    With the request's ``output_kind`` CUMULATIVE or FINAL_ONLY, ``text``, ``token_ids`` and
    ``logprobs`` hold all output so far; with DELTA, only what is new since the request's
    previous output (append them in order to get the whole). ``text`` never ends in half a
    UTF-8 character and never holds a stop string or text that could still become one; it is
    final once ``finish_reason`` is set.
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
    """The state of one request after an engine step (or, with DELTA outputs, what the step
    added: ``outputs`` then holds only the choices that advanced). Safe to read once handed
    out: the engine builds a new one per step and never mutates one it has returned."""

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


def merge_deltas(deltas: list[RequestOutput]) -> RequestOutput:
    """Several consecutive DELTA outputs of one request as one (for a consumer that fell behind):
    each choice's pieces concatenated, the last output's state (finished, metrics) kept. Costs
    the size of the deltas, not of the whole output."""
    if len(deltas) == 1:
        return deltas[0]
    by_index: dict[int, list[CompletionOutput]] = {}
    prompt_logprobs = None
    for delta in deltas:
        prompt_logprobs = prompt_logprobs if delta.prompt_logprobs is None else delta.prompt_logprobs
        for o in delta.outputs:
            by_index.setdefault(o.index, []).append(o)
    outputs = []
    for index, pieces in by_index.items():
        last = pieces[-1]
        logprobs = None if last.logprobs is None else [p for o in pieces for p in o.logprobs or ()]
        outputs.append(
            CompletionOutput(
                index=index,
                text="".join(o.text for o in pieces),
                token_ids=[t for o in pieces for t in o.token_ids],
                finish_reason=last.finish_reason,
                stop_reason=last.stop_reason,
                logprobs=logprobs,
                cumulative_logprob=last.cumulative_logprob,
            )
        )
    last_output = deltas[-1]
    return RequestOutput(
        request_id=last_output.request_id,
        prompt=last_output.prompt,
        prompt_token_ids=last_output.prompt_token_ids,
        outputs=outputs,
        finished=last_output.finished,
        prompt_logprobs=prompt_logprobs,
        metrics=last_output.metrics,
    )
