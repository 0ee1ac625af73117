"""Penalty inputs kept on the device, for asynchronous scheduling.

Presence, frequency and repetition penalties need each request's output tokens, including the
token the step in flight is sampling, which the host does not know yet. So the model runner
keeps them where they are made: one row per penalised request in ``counts`` (how often each
token is in the output) and ``prompt_seen`` (the prompt's tokens, for the repetition penalty).
A step reads its rows (``inputs``) and adds the tokens it sampled (``update``), all queued on
the device; the host only hands out rows. The synchronous path builds the same tensors from the
token lists (``sampler.host_penalty_inputs``), which is the reference the tests compare with.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from pagecast.runtime.request import Request
from pagecast.runtime.transfer import to_device

_MIN_ROWS = 8


class PenaltyState:
    """Rows of penalty inputs, one per live penalised request, grown on demand.

    A request gets a row the first time it samples with penalties, keeps it through
    preemptions (its output tokens stay valid: only its K/V is dropped), and gives it back when
    it finishes (``drop`` with the scheduler's finished ids, or found finished when rows run
    out). Rows are recycled in stream order: a step still in flight finishes its update of an
    old row before a later step clears it for a new request.
    """

    def __init__(self) -> None:
        self.device = torch.device("cpu")  # the logits' device, set on first use
        self.vocab = 0
        self.counts: torch.Tensor | None = None  # [rows, vocab] fp32: output token counts
        self.prompt_seen: torch.Tensor | None = None  # [rows, vocab] bool: tokens of the prompt
        self.rows: dict[str, tuple[Request, int]] = {}  # request id -> (request, row)
        self.free: list[int] = []

    @property
    def num_rows(self) -> int:
        return 0 if self.counts is None else self.counts.shape[0]

    def drop(self, request_ids: Iterable[str]) -> None:
        """Give back the rows of requests that finished (unknown ids are ignored)."""
        for request_id in request_ids:
            entry = self.rows.pop(request_id, None)
            if entry is not None:
                self.free.append(entry[1])

    def inputs(self, requests: list[Request], vocab: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(seen, counts) ``[len(requests), vocab]`` for these requests, in order (the
        ``sampler.PenaltyInputs`` contract)."""
        if self.vocab != vocab or self.device != device:
            if self.rows:
                raise ValueError(f"logits changed from {self.vocab} columns on {self.device} to {vocab} on {device}")
            self.vocab, self.device, self.counts, self.prompt_seen, self.free = vocab, device, None, None, []
        rows = to_device([self._row(r) for r in requests], self.device, torch.int64)
        assert self.counts is not None and self.prompt_seen is not None
        counts = self.counts[rows]
        return self.prompt_seen[rows] | (counts > 0), counts

    def update(self, requests: list[Request], token_ids: torch.Tensor) -> None:
        """Count the tokens just sampled for ``requests`` (``token_ids[i]`` for ``requests[i]``;
        rows without penalties are skipped)."""
        picked = [i for i, r in enumerate(requests) if r.sampling_params.has_penalties]
        if not picked or self.counts is None:
            return
        rows = to_device([self.rows[requests[i].request_id][1] for i in picked], self.device, torch.int64)
        tokens = token_ids if len(picked) == len(requests) else token_ids[to_device(picked, self.device, torch.int64)]
        # Each row appears once, so a plain indexed add is exact.
        self.counts[rows, tokens] += 1.0

    def _row(self, request: Request) -> int:
        entry = self.rows.get(request.request_id)
        if entry is not None and entry[0] is request:
            return entry[1]
        if entry is not None:  # the id was reused by a new request before the old one's row was dropped
            self.free.append(entry[1])
        if request.num_pending_tokens:
            # Its pending token was sampled without a row, so it is counted nowhere: cannot
            # happen, since every penalised sample goes through inputs() and update().
            raise RuntimeError(f"request {request.request_id!r} has pending tokens but no penalty row")
        row = self._take_row()
        self.rows[request.request_id] = (request, row)
        assert self.counts is not None and self.prompt_seen is not None
        self.counts[row].zero_()
        self.prompt_seen[row].zero_()
        prompt = [t for t in set(request.prompt_token_ids) if 0 <= t < self.vocab]
        if prompt:
            ids = to_device(prompt, self.device, torch.int64)
            self.prompt_seen[row].index_fill_(0, ids, True)
        output = [t for t in request.output_token_ids if 0 <= t < self.vocab]
        if output:  # e.g. rows given back when a request was preempted (not done today)
            ids = to_device(output, self.device, torch.int64)
            self.counts[row].index_put_((ids,), torch.ones(len(output), device=self.device), accumulate=True)
        return row

    def _take_row(self) -> int:
        if not self.free:
            # Rows of requests that finished without a drop (their finished ids reached no
            # launched step) before growing.
            for request_id in [rid for rid, (r, _) in self.rows.items() if r.is_finished]:
                self.free.append(self.rows.pop(request_id)[1])
        if not self.free:
            self._grow()
        return self.free.pop()

    def _grow(self) -> None:
        old = self.num_rows
        new = max(_MIN_ROWS, 2 * old)
        counts = torch.zeros(new, self.vocab, dtype=torch.float32, device=self.device)
        seen = torch.zeros(new, self.vocab, dtype=torch.bool, device=self.device)
        if self.counts is not None and self.prompt_seen is not None:
            counts[:old] = self.counts
            seen[:old] = self.prompt_seen
        self.counts, self.prompt_seen = counts, seen
        self.free.extend(range(new - 1, old - 1, -1))
