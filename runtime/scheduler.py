"""Token-budget continuous batching: which requests run this step, and how many tokens each.

There are no prefill and decode phases. A request has ``num_tokens`` (prompt plus output so far)
and ``num_computed_tokens`` (tokens whose K/V are cached); each step hands every scheduled request
``num_scheduled_tokens`` more under a token budget. A decode is a request one token behind, a
prefill chunk is a request many tokens behind, and both share one batch. When KV blocks run out
the newest running request is preempted: its blocks are freed and it later recomputes all its
tokens (prefix cache hits make that cheap). The scheduler never looks at the model or the device.

Two policies order the queues (``SchedulerConfig.policy``, vLLM's ``--scheduling-policy``):
"fcfs" serves requests in arrival order; "priority" in order of ``Request.priority`` (lower
first), then arrival. Under "priority" the waiting queue is kept in that order and the running
one is put in it at the start of every step, so the request preempted when blocks run out is the
one of the lowest priority (the newest of those), and the one admitted next the one of the
highest. A waiting request never preempts a running one to get in, whatever their priorities
(decided: a preemption throws away the victim's computed K/V, and the running requests finish
or grow into a preemption soon enough); it is admitted first once blocks or a batch slot are free.
"""

from __future__ import annotations

import bisect
import itertools
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal

from pagecast.runtime.block_pool import BlockPool
from pagecast.runtime.request import Request, RequestStatus

POLICIES = ("fcfs", "priority")


@dataclass(frozen=True)
class SchedulerConfig:
    """Limits of one engine step.

    ``max_num_seqs`` bounds the batch (and the decode CUDA graphs); ``max_num_batched_tokens``
    bounds the tokens of one forward pass (activation memory, step latency); ``max_model_len``
    bounds a request's prompt plus output. ``max_num_prefill_tokens`` (None: no bound of its
    own) bounds a step's prompt tokens, decodes aside: where a prompt token costs so much that a
    step of max_num_batched_tokens of them would hold every running stream up for seconds (the
    CPU), prompts are prefilled in chunks that small while every running request still decodes.
    ``prefill_context_weight`` (w, 0: none) makes that bound one of cost: a prompt token after c
    tokens of context counts as 1 + c * w of it, so a chunk at the end of a long prompt, where
    each token attends to all before it, is smaller than one at its start (the CPU's).
    ``policy``: "fcfs" or "priority" (the module's docstring).
    """

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 4096
    max_model_len: int = 4096
    max_num_prefill_tokens: int | None = None
    prefill_context_weight: float = 0.0
    policy: Literal["fcfs", "priority"] = "fcfs"

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "max_num_prefill_tokens"):
            value = getattr(self, name)
            if value is None and name == "max_num_prefill_tokens":
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        if not self.prefill_context_weight >= 0.0:
            raise ValueError(f"prefill_context_weight must be >= 0, got {self.prefill_context_weight!r}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be at least max_num_seqs "
                f"({self.max_num_seqs}) so that every running request can decode in one step; "
                f"raise max_num_batched_tokens or lower max_num_seqs"
            )


@dataclass
class SchedulerOutput:
    """What the model runner computes this step. Valid until ``update_from_output`` is called
    with it: until then each scheduled request's ``num_computed_tokens`` and ``block_ids`` are
    the ones this step was planned with."""

    # Batch order: the runner lays out their tokens in this order. Request i computes tokens
    # all_token_ids[num_computed_tokens : num_computed_tokens + num_scheduled_tokens[i]].
    scheduled_requests: list[Request] = field(default_factory=list)
    num_scheduled_tokens: list[int] = field(default_factory=list)
    # Sum of num_scheduled_tokens: the size of the flat token batch.
    total_num_scheduled_tokens: int = 0
    # Requests preempted this step: their blocks are freed and their K/V is gone, so a runner
    # keeping per-request device state must drop it. They are back in the waiting queue.
    preempted_requests: list[Request] = field(default_factory=list)
    # Ids of requests that finished or were aborted since the previous step, for the same reason.
    finished_request_ids: set[str] = field(default_factory=set)
    # Speculative decoding: request id -> the draft tokens it verifies this step. Such a request
    # is scheduled 1 + len(drafts) tokens: its last known token, then the drafts.
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)

    @property
    def is_empty(self) -> bool:
        """Nothing to run (e.g. every request is waiting for blocks or there are none)."""
        return self.total_num_scheduled_tokens == 0


class Scheduler:
    """Decides each step's batch and keeps the running and waiting queues.

    Call ``schedule()``, run the model on its output, then ``update_from_output()`` with the
    sampled tokens, in that order, once per step. Under "fcfs" ``running`` is in admission order
    (the newest last, which is the one preempted first) and ``waiting`` in arrival order, with
    preempted requests put back at the front. Under "priority" both are in ``_order`` (highest
    priority first); a preempted request goes back to its place in it.
    """

    def __init__(self, config: SchedulerConfig, block_pool: BlockPool):
        self.config = config
        self.block_pool = block_pool
        self.running: list[Request] = []
        self.waiting: deque[Request] = deque()
        # Unfinished requests by id, for finish_requests().
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self._finished_request_ids: set[str] = set()
        self._by_priority = config.policy == "priority"
        self._arrivals = itertools.count()  # ties of priority and arrival time go to the first added

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_unfinished_requests(self) -> bool:
        return bool(self.running or self.waiting)

    def add_request(self, request: Request) -> None:
        """Queue a new request behind those already waiting."""
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        if request.num_tokens == 0:
            raise ValueError(f"request {request.request_id!r} has an empty prompt")
        if request.num_tokens > self.config.max_model_len:
            raise ValueError(
                f"request {request.request_id!r} has {request.num_tokens} prompt tokens, more than "
                f"max_model_len ({self.config.max_model_len})"
            )
        request.status = RequestStatus.WAITING
        request.arrival_order = next(self._arrivals)
        self.requests[request.request_id] = request
        if self._by_priority:
            bisect.insort(self.waiting, request, key=_order)
        else:
            self.waiting.append(request)

    def _prefill_tokens(self, prefill_budget: float, context: int) -> int:
        """How many prompt tokens after ``context`` tokens the rest of a step's prefill budget
        buys (SchedulerConfig.prefill_context_weight); at least one from a whole budget, so a
        prompt always advances."""
        per_token = 1.0 + context * self.config.prefill_context_weight
        n = int(prefill_budget / per_token)
        if n < 1 and prefill_budget >= (self.config.max_num_prefill_tokens or self.config.max_num_batched_tokens):
            return 1
        return n

    def _prefill_cost(self, num_tokens: int, context: int) -> float:
        return num_tokens * (1.0 + context * self.config.prefill_context_weight)

    def schedule(self) -> SchedulerOutput:
        """Plan one step: running requests first (in order), then waiting ones (FCFS)."""
        pool = self.block_pool
        budget = self.config.max_num_batched_tokens
        # Prompt tokens (chunks of more than one token) this step may still take, each weighted by
        # its context where prefill_context_weight says so; decodes aside.
        prefill_budget: float = self.config.max_num_prefill_tokens or budget
        scheduled: list[Request] = []
        counts: list[int] = []
        preempted: list[Request] = []
        spec: dict[str, list[int]] = {}
        running = self.running
        if self._by_priority:
            running.sort(key=_order)  # in order already but for last step's admissions

        i = 0
        while i < len(running) and budget > 0:
            request = running[i]
            # len(all_token_ids) rather than num_tokens: this loop runs for every request, every step.
            pending = request.num_pending_tokens
            if pending and request.length_reached(self.config.max_model_len, pending):
                i += 1  # its last token is being sampled: nothing more to compute
                continue
            num_new = min(len(request.all_token_ids) + pending - request.num_computed_tokens, budget)
            drafts = request.spec_token_ids
            if drafts and num_new == 1 and not pending:
                # A decode with drafts to verify: as many as the budget and the free blocks
                # allow (the engine allocated their slots when it asked for them); never a
                # preemption for a draft.
                drafts = drafts[: budget - 1]
                if drafts and pool.allocate_slots(request, 1 + len(drafts)):
                    spec[request.request_id] = drafts
                    scheduled.append(request)
                    counts.append(1 + len(drafts))
                    budget -= 1 + len(drafts)
                    i += 1
                    continue
            if num_new > 1:  # a prompt chunk, not a decode
                num_new = min(num_new, self._prefill_tokens(prefill_budget, request.num_computed_tokens))
            if num_new <= 0:  # nothing to compute until it gets a token (or no prefill budget left)
                i += 1
                continue
            while not pool.allocate_slots(request, num_new):
                # the newest (fcfs) or the last in priority order; never one already scheduled
                # (index >= i), all of which come before it in that order
                victim = running.pop()
                self._preempt(victim)
                preempted.append(victim)
                if victim is request:
                    break
            else:
                scheduled.append(request)
                counts.append(num_new)
                budget -= num_new
                if num_new > 1:
                    prefill_budget -= self._prefill_cost(num_new, request.num_computed_tokens)
                i += 1

        # After a preemption blocks are short: admitting anyone now would only thrash.
        if not preempted:
            max_num_seqs = self.config.max_num_seqs
            waiting = self.waiting
            while waiting and budget > 0 and len(running) < max_num_seqs:
                request = waiting[0]
                if request.num_pending_tokens:
                    break  # preempted while a token of its was being sampled: wait for it
                lead = request.prefill_after
                if lead is not None and not lead.is_finished and lead.num_computed_tokens < lead.num_prompt_tokens:
                    break  # a sibling still computing the prompt: its blocks are about to be cached
                computed_blocks: list[int]
                if _needs_prompt_logprobs(request):
                    # Cached positions are never run, so their logits (which score the prompt)
                    # would be missing: compute the whole prompt, cache what it produces.
                    computed_blocks, num_cached = [], 0
                else:
                    computed_blocks, num_cached = pool.get_computed_blocks(request)
                num_new = min(request.num_tokens - num_cached, budget, self._prefill_tokens(prefill_budget, num_cached))
                if num_new <= 0:
                    break  # no prompt tokens left for this step
                if not pool.allocate_slots(request, num_new, computed_blocks):
                    break  # nobody overtakes the head of the queue (the first come, or the highest priority)
                waiting.popleft()
                self._admit(request, num_cached)
                running.append(request)
                scheduled.append(request)
                counts.append(num_new)
                budget -= num_new
                prefill_budget -= self._prefill_cost(num_new, num_cached)

        finished_ids, self._finished_request_ids = self._finished_request_ids, set()
        return SchedulerOutput(
            scheduled_requests=scheduled,
            num_scheduled_tokens=counts,
            total_num_scheduled_tokens=self.config.max_num_batched_tokens - budget,
            preempted_requests=preempted,
            finished_request_ids=finished_ids,
            spec_token_ids=spec,
        )

    def update_from_output(self, output: SchedulerOutput, sampled_token_ids: dict[str, int]) -> list[Request]:
        """Advance the scheduled requests by what the runner computed and append sampled tokens
        (``mark_computed`` then ``add_sampled_tokens``: the synchronous step).

        ``sampled_token_ids`` maps request id to the token sampled for it. A token is taken only
        from a request whose computed tokens now reach ``num_tokens`` (a partial prefill chunk's
        sample is meaningless and ignored). Returns the requests that received a token, in batch
        order, finished ones included; finished requests have left ``running`` and their blocks
        are freed.
        """
        self.mark_computed(output)
        return self.add_sampled_tokens(output, sampled_token_ids)

    def mark_computed(self, output: SchedulerOutput) -> None:
        """The step is launched: its tokens count as computed, and each request it brings to its
        end has one more token pending (sampled on the device, not known here yet).

        With asynchronous scheduling the next step is planned before this one's tokens are
        known: a pending token is scheduled like a known one, and the runner takes its id from
        the device. ``add_sampled_tokens`` resolves the pending tokens once the step is done.
        """
        pool = self.block_pool
        running_status = RequestStatus.RUNNING
        spec = output.spec_token_ids
        for request, num_new in zip(output.scheduled_requests, output.num_scheduled_tokens):
            if request.status is not running_status:
                continue  # finished via finish_requests() after it was scheduled
            if spec and request.request_id in spec:
                # Only the known token counts as computed; the drafts' K/V counts once they are
                # accepted (add_sampled_tokens).
                num_new -= len(spec[request.request_id])
            request.num_computed_tokens += num_new
            if request.num_computed_tokens == len(request.all_token_ids) + request.num_pending_tokens:
                request.num_pending_tokens += 1
            pool.cache_full_blocks(request)

    def add_sampled_tokens(
        self,
        output: SchedulerOutput,
        sampled_token_ids: dict[str, int],
        spec_tokens: dict[str, list[int]] | None = None,
        num_new_tokens: dict[str, int] | None = None,
    ) -> list[Request]:
        """Resolve the tokens ``output``'s step sampled (it was passed to ``mark_computed``):
        append them, stop requests that are done, free their blocks. Returns the requests that
        received a token, in batch order, finished ones included.

        A request that verified drafts (``output.spec_token_ids``) gets its tokens from
        ``spec_tokens``: the accepted drafts, then the target's own token. The accepted drafts'
        K/V becomes computed; a stop (token or length) among them ends the request there and
        drops the rest. ``num_new_tokens`` (when given) receives how many tokens each such
        request got."""
        pool = self.block_pool
        max_model_len = self.config.max_model_len
        now = time.monotonic()
        running_status = RequestStatus.RUNNING
        updated: list[Request] = []
        any_finished = False
        for request in output.scheduled_requests:
            if not request.num_pending_tokens or request.status.finished:
                continue  # no token from this step (partial prefill), or aborted / stopped meanwhile
            tokens = spec_tokens.get(request.request_id) if spec_tokens else None
            if tokens is not None:
                request.num_pending_tokens -= 1
                request.num_computed_tokens += len(tokens) - 1  # the accepted drafts
                status = None
                count = 0
                for token_id in tokens:
                    request.append_output_token(token_id)
                    count += 1
                    status = request.check_stop(max_model_len)
                    if status is not None:
                        break
                if num_new_tokens is not None:
                    num_new_tokens[request.request_id] = count
                pool.cache_full_blocks(request)
            else:
                token_id = sampled_token_ids.get(request.request_id)
                if token_id is None:
                    continue  # its pending token comes from a later step (its last prefill chunk ran there)
                request.num_pending_tokens -= 1
                request.append_output_token(token_id)
                pool.cache_full_blocks(request)
                status = request.check_stop(max_model_len)
            metrics = request.metrics
            if metrics.first_token_time is None:
                metrics.first_token_time = now
            metrics.last_token_time = now
            if status is not None:
                preempted = request.status is not running_status
                request.status = status
                metrics.finished_time = now
                pool.free(request)
                del self.requests[request.request_id]
                self._finished_request_ids.add(request.request_id)
                if preempted:  # preempted while its last token was being sampled
                    self.waiting = deque(r for r in self.waiting if r is not request)
                else:
                    any_finished = True
            updated.append(request)
        if any_finished:
            self.running = [r for r in self.running if r.status is running_status]
        return updated

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> None:
        """End requests from outside the step (client abort, stop string): free their blocks and
        drop them from the queues. Unknown or already finished ids are ignored."""
        if not status.finished:
            raise ValueError(f"finish_requests needs a finished status, got {status.name}")
        if isinstance(request_ids, str):
            request_ids = (request_ids,)
        now = time.monotonic()
        any_running = any_waiting = False
        for request_id in request_ids:
            request = self.requests.pop(request_id, None)
            if request is None:
                continue
            if request.status == RequestStatus.RUNNING:
                any_running = True
            else:
                any_waiting = True
            request.status = status
            request.metrics.finished_time = now
            self.block_pool.free(request)
            self._finished_request_ids.add(request_id)
        # One pass per queue, however many requests were aborted at once.
        if any_running:
            self.running = [r for r in self.running if not r.status.finished]
        if any_waiting:
            self.waiting = deque(r for r in self.waiting if not r.status.finished)

    def _admit(self, request: Request, num_cached: int) -> None:
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = num_cached
        metrics = request.metrics
        if metrics.first_scheduled_time is None:
            # First admission: the prefix hit is what usage reports as cached prompt tokens.
            metrics.first_scheduled_time = time.monotonic()
            request.num_cached_tokens = num_cached
            metrics.num_cached_tokens = num_cached

    def _preempt(self, request: Request) -> None:
        self.block_pool.free(request)
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        request.status = RequestStatus.PREEMPTED
        request.metrics.num_preemptions += 1
        self.num_preemptions += 1
        if self._by_priority:
            bisect.insort(self.waiting, request, key=_order)
        else:
            self.waiting.appendleft(request)


def _order(request: Request) -> tuple[int, float, int]:
    """The "priority" policy's order: priority (lower first), then arrival."""
    return (request.priority, request.metrics.arrival_time, request.arrival_order)


def _needs_prompt_logprobs(request: Request) -> bool:
    """Whether prompt logprobs are asked for and not all recorded yet (the list holds one entry
    per prompt token, the first None, once complete)."""
    entries = request.prompt_logprobs
    return entries is not None and len(entries) < request.num_prompt_tokens
