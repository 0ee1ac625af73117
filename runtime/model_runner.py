"""The model runner: turns a scheduled step into one flat batch, runs the model, samples.

The batch lays each scheduled request's new tokens end to end (prefill chunks and decodes
mixed). For each token it computes the position and the cache slot it writes; for each
sequence its block table, context length and where its tokens start. Logits are computed
only for rows that need them: the last token of a request that reached its end (to sample)
and prompt positions whose logprobs were asked for.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from pagecast.runtime.cuda_graphs import DecodeGraphs
from pagecast.runtime.forward_context import ForwardContext
from pagecast.runtime.outputs import PositionLogprobs
from pagecast.runtime.request import Request
from pagecast.runtime.sampler import prompt_logprobs, sample
from pagecast.runtime.scheduler import SchedulerOutput


@dataclass
class RunnerOutput:
    sampled: dict[str, int] = field(default_factory=dict)  # request id -> new token
    logprobs: dict[str, PositionLogprobs] = field(default_factory=dict)  # request id -> the new token's logprobs
    prompt_logprobs: dict[str, list[PositionLogprobs]] = field(default_factory=dict)  # new prompt entries


@dataclass
class _Batch:
    input_ids: torch.Tensor
    positions: torch.Tensor
    ctx: ForwardContext
    sample_requests: list[Request]
    sample_rows: list[int]  # index into logits rows
    prompt_lp: list[tuple[Request, int, int]]  # (request, first logits row, number of rows)


class ModelRunner:
    """Runs the generated model on one device. Stateless between steps except for the model."""

    def __init__(self, model: Any, device: torch.device, block_size: int):
        self.model = model
        self.device = device
        self.block_size = block_size
        self.graphs: DecodeGraphs | None = None

    def capture_cuda_graphs(self, batch_sizes: list[int], max_model_len: int) -> float:
        """Capture decode graphs (GPU only); returns the seconds it took."""
        if self.device.type != "cuda" or not batch_sizes:
            return 0.0
        self.graphs = DecodeGraphs(self.model, self.device, batch_sizes, max_model_len, self.block_size)
        return self.graphs.capture()

    def prepare(self, out: SchedulerOutput) -> _Batch:
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        seq_lens: list[int] = []
        query_start_loc = [0]
        logits_rows: list[int] = []
        sample_requests: list[Request] = []
        sample_rows: list[int] = []
        prompt_lp: list[tuple[Request, int, int]] = []
        max_blocks = 1
        for req, n in zip(out.scheduled_requests, out.num_scheduled_tokens):
            start = req.num_computed_tokens
            end = start + n
            row0 = len(input_ids)
            if n == 1:
                input_ids.append(req.all_token_ids[start])
                positions.append(start)
            else:
                input_ids.extend(req.all_token_ids[start:end])
                positions.extend(range(start, end))
            block_ids = req.block_ids
            if n == 1:
                slots.append(block_ids[start // bs] * bs + start % bs)
            else:
                slots.extend(block_ids[p // bs] * bs + p % bs for p in range(start, end))
            seq_lens.append(end)
            query_start_loc.append(len(input_ids))
            max_blocks = max(max_blocks, len(block_ids))
            # Prompt logprobs: position p's logits score prompt token p + 1. Entries already recorded (e.g.
            # before a preemption) are not computed again.
            if req.prompt_logprobs is not None:
                first = max(start, len(req.prompt_logprobs) - 1)
                last = min(end, req.num_prompt_tokens - 1)
                if last > first:
                    prompt_lp.append((req, len(logits_rows), last - first))
                    logits_rows.extend(range(row0 + first - start, row0 + last - start))
            if end == req.num_tokens:
                sample_requests.append(req)
                sample_rows.append(len(logits_rows))
                logits_rows.append(row0 + n - 1)
        block_tables = torch.tensor(
            [r.block_ids + [0] * (max_blocks - len(r.block_ids)) for r in out.scheduled_requests], dtype=torch.int32
        )
        dev = self.device
        ctx = ForwardContext(
            slot_mapping=torch.tensor(slots, dtype=torch.int64).to(dev, non_blocking=True),
            block_tables=block_tables.to(dev, non_blocking=True),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32).to(dev, non_blocking=True),
            query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32).to(dev, non_blocking=True),
            max_query_len=max(out.num_scheduled_tokens),
            max_seq_len=max(seq_lens),
            logits_indices=torch.tensor(logits_rows, dtype=torch.int64).to(dev, non_blocking=True),
        )
        return _Batch(
            input_ids=torch.tensor(input_ids, dtype=torch.int64).to(dev, non_blocking=True),
            positions=torch.tensor(positions, dtype=torch.int64).to(dev, non_blocking=True),
            ctx=ctx,
            sample_requests=sample_requests,
            sample_rows=sample_rows,
            prompt_lp=prompt_lp,
        )

    def _use_graph(self, batch: _Batch, num_seqs: int) -> bool:
        # A graph computes logits for every row: usable when each row is one token that samples.
        return (
            self.graphs is not None
            and batch.ctx.max_query_len == 1
            and len(batch.sample_rows) == num_seqs
            and not batch.prompt_lp
            and self.graphs.can_run(num_seqs, batch.ctx.max_seq_len)
        )

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        batch = self.prepare(out)
        result = RunnerOutput()
        num_seqs = len(out.scheduled_requests)
        if self._use_graph(batch, num_seqs):
            assert self.graphs is not None
            ctx = batch.ctx
            hidden = self.graphs.run(
                batch.input_ids, batch.positions, ctx.slot_mapping, ctx.block_tables, ctx.seq_lens, ctx.max_seq_len
            )
            logits = self.model.compute_logits(hidden)
        else:
            hidden = self.model.forward(batch.input_ids, batch.positions, batch.ctx)
            if batch.ctx.logits_indices.numel() == 0:
                return result
            logits = self.model.compute_logits(hidden[batch.ctx.logits_indices])
        if batch.sample_requests:
            rows = torch.tensor(batch.sample_rows, device=logits.device)
            sampled = sample(logits[rows], batch.sample_requests)
            for req, token, lp in zip(batch.sample_requests, sampled.token_ids, sampled.logprobs):
                result.sampled[req.request_id] = token
                if lp is not None:
                    result.logprobs[req.request_id] = lp
        for req, row0, count in batch.prompt_lp:
            first_target = len(req.prompt_logprobs or [None])  # index of the first prompt token to score
            targets = req.prompt_token_ids[first_target : first_target + count]
            num_top = req.sampling_params.prompt_logprobs or 0
            result.prompt_logprobs[req.request_id] = prompt_logprobs(logits[row0 : row0 + count], targets, num_top)
        return result
