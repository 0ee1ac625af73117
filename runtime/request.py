"""A request inside the engine: its tokens, its progress and its blocks."""

from __future__ import annotations

import enum
import time

from pagecast.runtime.outputs import PositionLogprobs, RequestMetrics
from pagecast.runtime.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    """Ordered so that ``status >= RequestStatus.FINISHED_STOPPED`` means finished."""

    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_ERROR = enum.auto()

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


PRIORITY_LIMIT = 2**63 - 1  # a priority travels to the engine core as a signed 64-bit integer


class Request:
    """One sequence being generated.

    The request owns its token ids and its block table (``block_ids``); the block pool owns
    the blocks themselves. ``num_computed_tokens`` counts tokens whose K/V are in the cache;
    the scheduler hands out ``num_tokens - num_computed_tokens`` more over the next steps.
    A request with n > 1 is split by the engine into n of these, sharing ``parent_id``.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_ids: frozenset[int] = frozenset(),
        max_tokens: int | None = None,
        parent_id: str | None = None,
        index: int = 0,
        arrival_time: float | None = None,
        priority: int = 0,
    ):
        self.request_id = request_id
        self.parent_id = parent_id if parent_id is not None else request_id
        self.index = index  # which of the parent's n choices this is
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_ids = eos_token_ids
        # Resolved by the engine from max_tokens and max_model_len.
        self.max_tokens = max_tokens if max_tokens is not None else sampling_params.max_tokens or 1
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0
        # Tokens sampled by a step still running on the device (asynchronous scheduling): they
        # count as the request's tokens for scheduling, and join all_token_ids once known.
        self.num_pending_tokens = 0
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.block_ids: list[int] = []
        # Chained hashes of this request's full blocks, filled by the block pool.
        self.block_hashes: list[int] = []
        self.metrics = RequestMetrics(arrival_time=arrival_time or time.monotonic())
        # The "priority" scheduling policy's order: lower first, then arrival (scheduler._order);
        # arrival_order is set by the scheduler when it queues the request.
        self.priority = priority
        self.arrival_order = 0
        self.num_cached_tokens = 0
        # For the 2nd..nth choice of an n > 1 request: the first choice, whose prompt blocks this
        # one reuses from the prefix cache; it is admitted once that prompt is computed.
        self.prefill_after: Request | None = None
        # The key of a seeded request's noise (kernels/keyed_noise.py), as a signed 64-bit value
        # so it fits an int64 tensor. Each of the n choices gets its own stream, reproducible
        # from (seed, index); the sampler adds the index of the output token being sampled.
        self.seed_key: int | None = None
        if sampling_params.seed is not None:
            key = (sampling_params.seed * 1_000_003 + index) % 2**64
            self.seed_key = key - 2**64 if key >= 2**63 else key
        self.logprobs: list[PositionLogprobs] | None = [] if sampling_params.logprobs is not None else None
        self.prompt_logprobs: list[PositionLogprobs | None] | None = (
            [None] if sampling_params.prompt_logprobs is not None else None
        )
        self.cumulative_logprob = 0.0
        # Speculative decoding: the draft tokens proposed for the next step (set by the engine
        # just before it schedules a speculating step; the scheduler takes what fits), and the
        # back-off of a request whose drafts keep being rejected (EngineCore._propose).
        self.spec_token_ids: list[int] = []
        self.spec_misses = 0
        self.spec_skip = 0

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def check_stop(self, max_model_len: int) -> RequestStatus | None:
        """The finished status the last appended token causes, if any (stop strings are
        checked later, on text, by the detokenizer)."""
        params = self.sampling_params
        last = self.output_token_ids[-1]
        # The stopping token comes after min_tokens others (the sampler masks it until then; a
        # stop string is held to the same count by the detokenizer).
        if self.num_output_tokens > params.min_tokens:
            if not params.ignore_eos and last in self.eos_token_ids:
                self.stop_reason = None
                return RequestStatus.FINISHED_STOPPED
            if last in params.stop_token_ids:
                self.stop_reason = last
                return RequestStatus.FINISHED_STOPPED
        if self.length_reached(max_model_len):
            return RequestStatus.FINISHED_LENGTH
        return None

    def length_reached(self, max_model_len: int, extra_tokens: int = 0) -> bool:
        """Whether max_tokens or max_model_len is reached with ``extra_tokens`` more tokens
        (e.g. the pending ones, sampled by a step still running)."""
        return (
            len(self.output_token_ids) + extra_tokens >= self.max_tokens
            or len(self.all_token_ids) + extra_tokens >= max_model_len
        )

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, blocks={self.block_ids})"
        )
