"""What crosses the boundary between the server (front end) and an engine-core process.

The front end sends ``AddRequest``, ``AbortRequests`` and ``Shutdown``; the core answers with
``CoreReady`` once at start-up (or ``CoreFailed``), then one ``StepOutputs`` per engine step
carrying every request's new tokens, and ``CoreFailed`` if its loop dies. Messages are msgspec
structs with a fixed schema, encoded as msgpack: no pickled objects cross the boundary, so a
message is cheap to encode and cannot run code when decoded.

Request ids here are the engine's *sequence* ids: a request with ``n`` choices becomes ``n``
sequences ``id#0 .. id#{n-1}`` (just ``id`` when n == 1), as ``LLMEngine`` names them.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from pagecast.runtime.errors import InvalidRequestError, PagecastError
from pagecast.runtime.sampling_params import SamplingParams


@dataclass
class EngineStats:
    """A snapshot for metrics and health: counts are totals since start."""

    num_running: int
    num_waiting: int
    num_kv_blocks_total: int
    num_kv_blocks_used: int
    kv_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    num_prompt_tokens: int
    num_generation_tokens: int
    # Triton kernels compiled in the engine's process since it was ready (its artifact's kernel
    # cache missed them: each compile stalls every running request, typically for a second or more).
    num_kernel_compiles: int = 0
    # Speculative decoding (zero without it): sequence-steps that verified drafts, drafts
    # verified, drafts accepted, tokens those sequence-steps produced, and seconds spent
    # proposing and verifying.
    spec_num_verified: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_num_emitted_tokens: int = 0
    spec_draft_seconds: float = 0.0
    spec_verify_seconds: float = 0.0


class AddRequest(msgspec.Struct, tag=True, array_like=True):
    """A validated request: the prompt is already token ids and ``max_tokens`` resolved."""

    request_id: str  # the parent id; the core names the n sequences after it
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int
    arrival_time: float  # time.monotonic() in the front end (the clock is shared by processes)
    priority: int = 0  # the "priority" scheduling policy's (lower first); checked by the front end


class AbortRequests(msgspec.Struct, tag=True, array_like=True):
    """Free these sequences (aborted by the client, or ended by a stop string the front end found)."""

    sequence_ids: list[str]


class Shutdown(msgspec.Struct, tag=True, array_like=True):
    """Stop the loop and exit."""


class LogprobEntry(msgspec.Struct, array_like=True):
    """One position's logprobs: parallel lists (the chosen token and the top alternatives)."""

    token_ids: list[int]
    logprobs: list[float]
    ranks: list[int]


class SequenceUpdate(msgspec.Struct, array_like=True, omit_defaults=True):
    """What one step did to one sequence."""

    sequence_id: str
    new_token_ids: list[int]
    status: int = 0  # RequestStatus value when the sequence finished this step, else 0
    stop_reason: int | None = None  # the stop token id that ended it
    logprobs: list[LogprobEntry] | None = None  # one entry per new token, if asked for
    prompt_logprobs: list[LogprobEntry] | None = None  # new prompt positions, if asked for
    first_scheduled_time: float | None = None  # sent once, with the first update
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache (with the first update)
    num_preemptions: int = 0


class RequestFailure(msgspec.Struct, array_like=True):
    """Why the core refused or ended a request. ``invalid``: the request itself is at fault (an
    ``InvalidRequestError``: HTTP 400 with ``param`` and ``code``), not the engine."""

    message: str
    invalid: bool = False
    param: str | None = None
    code: str | None = None

    @classmethod
    def of(cls, exc: BaseException) -> RequestFailure:
        if isinstance(exc, InvalidRequestError):
            return cls(exc.message, True, exc.param, exc.code)
        return cls(str(exc))

    def error(self) -> Exception:
        """The exception the request's stream raises."""
        return InvalidRequestError(self.message, self.param, self.code) if self.invalid else PagecastError(self.message)


class StepOutputs(msgspec.Struct, tag=True, array_like=True):
    """One engine step (or, when idle, only fresh statistics after aborts were applied)."""

    updates: list[SequenceUpdate]
    stats: EngineStats
    failed: dict[str, RequestFailure] = {}  # parent request id -> why the core refused or ended it


class CoreReady(msgspec.Struct, tag=True, array_like=True):
    """Start-up finished: what the front end needs to validate and route requests."""

    model_name: str
    max_model_len: int
    max_num_seqs: int
    vocab_size: int
    eos_token_ids: list[int]
    num_kv_blocks: int
    block_size: int
    device: str
    startup_s: dict[str, float]  # where the start-up time went (load, verify, graphs, warm-up)
    max_num_batched_tokens: int = 0  # the step's token budget
    max_num_prefill_tokens: int | None = None  # the step's prompt tokens, decodes aside (None: no own bound)
    prefill_context_weight: float = 0.0  # a prompt token after c of context counts 1 + c * this


class CoreFailed(msgspec.Struct, tag=True, array_like=True):
    """The core could not start, or its loop died: ``kind`` says which error to raise."""

    kind: str  # "artifact" | "value" | "engine"
    message: str


FrontEndMessage = AddRequest | AbortRequests | Shutdown
CoreMessage = StepOutputs | CoreReady | CoreFailed
