"""The model runner: turns a scheduled step into one flat batch, runs the model, samples.

The batch lays each scheduled request's new tokens end to end (prefill chunks and decodes
mixed). For each token it computes the position and the cache slot it writes; for each
sequence its block table, context length and where its tokens start. Logits are computed
only for rows that need them: the last token of a request that reached its end (to sample)
and prompt positions whose logprobs were asked for.
"""

from __future__ import annotations

import logging
import time
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch

from pagecast.kernels import ops
from pagecast.runtime import startup
from pagecast.runtime.cuda_graphs import DecodeGraphs, MixedGraphs
from pagecast.runtime.forward_context import ForwardContext, leading_decodes
from pagecast.runtime.input_batch import BlockTables
from pagecast.runtime.outputs import PositionLogprobs
from pagecast.runtime.parallel import WorkerGroup
from pagecast.runtime.penalty_state import PenaltyState
from pagecast.runtime.request import Request
from pagecast.runtime.sampler import (
    LogprobTensors,
    logprob_tensors,
    prompt_logprob_tensors,
    prompt_logprobs,
    sample,
    sample_token_ids,
)
from pagecast.runtime.scheduler import SchedulerOutput
from pagecast.runtime.structured_output import GrammarState
from pagecast.runtime.transfer import to_device

logger = logging.getLogger("pagecast.engine")


@dataclass
class RunnerOutput:
    sampled: dict[str, int] = field(default_factory=dict)  # request id -> new token
    logprobs: dict[str, PositionLogprobs] = field(default_factory=dict)  # request id -> the new token's logprobs
    prompt_logprobs: dict[str, list[PositionLogprobs]] = field(default_factory=dict)  # new prompt entries
    # Speculative decoding: request id -> its tokens this step (the accepted drafts, then the
    # target's own token), and their logprobs when asked for (one entry per token).
    spec_tokens: dict[str, list[int]] = field(default_factory=dict)
    spec_logprobs: dict[str, list[PositionLogprobs]] = field(default_factory=dict)


@dataclass
class LaunchedStep:
    """A step whose sampling was queued on the device (asynchronous scheduling); ``collect``
    waits for it. ``token_ids`` stays on the device: the next step reads its decode inputs
    from there before this step's tokens reach the host. Logprobs travel like the tokens:
    computed in the step, copied to pinned memory before ``ready``, turned into entries by
    ``collect``."""

    scheduled: SchedulerOutput
    sample_requests: list[Request]
    rows: dict[str, int]  # request id -> row of token_ids
    token_ids: torch.Tensor | None  # [len(sample_requests)] on the device
    host_token_ids: torch.Tensor | None  # pinned copy, filled when ``ready`` fires
    ready: torch.cuda.Event | None
    # (rows of sample_requests that asked for logprobs, their logprobs; host copies on a GPU).
    logprobs: tuple[list[int], LogprobTensors] | None = None
    # (request id, number of top tokens, the new prompt entries' logprobs; host copies on a GPU).
    prompt_logprobs: list[tuple[str, int, LogprobTensors]] = field(default_factory=list)


@dataclass
class _LazyCapture:
    """Lazy graphs' progress: capturing once ``started``; steps and seconds spent on it."""

    started: bool
    since: float = 0.0
    for_steps: int = 0  # graphs captured for the decode step about to run
    seconds: float = 0.0


@dataclass
class _Batch:
    input_ids: torch.Tensor
    positions: torch.Tensor
    ctx: ForwardContext
    sample_requests: list[Request]
    sample_rows: list[int]  # index into logits rows
    # (request, first logits row, number of rows, first prompt position scored): logits row
    # row0 + j scores prompt token first + 1 + j.
    prompt_lp: list[tuple[Request, int, int, int]]
    # Speculative decoding: (request, first logits row, its drafts); logits rows row0..row0 +
    # len(drafts) are the positions of its last known token and of each draft.
    spec: list[tuple[Request, int, list[int]]] = field(default_factory=list)


class ModelRunner:
    """Runs the generated model on one device. Between steps it keeps the model and the running
    requests' block tables on the device (runtime/input_batch.py), sized by ``max_num_seqs`` and
    ``max_model_len`` when given (they grow past that)."""

    def __init__(
        self,
        model: Any,
        device: torch.device,
        block_size: int,
        kernels: Any = None,
        max_num_seqs: int = 64,
        max_model_len: int | None = None,
    ):
        self.model = model
        self.device = device
        self.block_size = block_size
        self.kernels = kernels  # the artifact's KernelTable, activated around each forward pass
        num_cols = -(-max_model_len // block_size) if max_model_len else 64
        self.block_tables = BlockTables(device, max_num_seqs, num_cols)
        self.graphs: DecodeGraphs | None = None
        self.mixed: MixedGraphs | None = None  # graphs of steps with prompt tokens (opt-in)
        self._lazy: _LazyCapture | None = None  # lazy graphs still to capture
        # Output token counts of penalised requests, for asynchronous steps (launch).
        self.penalties = PenaltyState()
        # Structured output: the engine core's grammar matchers (set by the core; None: none ever).
        self.grammar: GrammarState | None = None
        # Tensor parallelism: the other ranks' processes mirror every forward pass (runtime.parallel).
        self.workers: WorkerGroup | None = None
        launch = getattr(model, "tp_launch", None)
        if launch is not None:
            self.workers = WorkerGroup(launch, device, kernels)
            weakref.finalize(self, self.workers.close)

    def close(self) -> None:
        """Stop the tensor-parallel workers (if any); the runner cannot run steps afterwards."""
        if self.workers is not None:
            self.workers.close()

    def _sync_workers(self) -> WorkerGroup | None:
        if self.workers is not None and not self.workers.kv_cache_sent:
            self.workers.send_kv_cache(self.model.k_caches)
        return self.workers

    def _activate_kernels(self) -> None:
        if self.kernels is not None:
            ops.activate(self.kernels)

    def capture_cuda_graphs(
        self, batch_sizes: list[int], max_model_len: int, lazy: bool = False, mixed_sizes: list[int] | None = None
    ) -> float:
        """Capture decode graphs (GPU only); returns the seconds it took. ``lazy``: capture none
        now, but once ``start_lazy_capture`` is called (see ``capture_lazily``; the engine serves
        meanwhile, decode batches eagerly until their graph is there); tensor-parallel
        engines capture at once (their ranks capture in lockstep). ``mixed_sizes``: token buckets
        of graphs for steps with prompt tokens too (MixedGraphs; after the decode graphs, and not
        with tensor parallelism or a model without graph pieces, which run those steps eagerly)."""
        if self.device.type != "cuda" or not batch_sizes:
            return 0.0
        self._activate_kernels()
        workers = self._sync_workers()
        graphs = DecodeGraphs(self.model, self.device, batch_sizes, max_model_len, self.block_size)
        if mixed_sizes and workers is None and MixedGraphs.supports(self.model):
            fitting = MixedGraphs.sizes_for(self.model, mixed_sizes)
            if len(fitting) < len(mixed_sizes):
                logger.info(
                    "mixed-step CUDA graphs for %s tokens; steps of %s run eagerly (the MoE blocks wait for the host there)",
                    fitting, sorted(set(mixed_sizes) - set(fitting)),
                )  # fmt: skip
            if fitting:
                self.mixed = MixedGraphs(self.model, self.device, fitting)
        elif mixed_sizes:
            reason = "tensor parallelism" if workers else "an artifact built before them (rebuild it to have them)"
            logger.info("mixed-step CUDA graphs are not used: %s", reason)
        if lazy and workers is None:
            self.capture_lazily(graphs)
            return 0.0
        self.graphs = graphs
        if workers is None:
            seconds = self.graphs.capture()
            if self.mixed is not None:
                t0 = time.perf_counter()
                self._capture_mixed(everything=True)
                seconds += time.perf_counter() - t0
        else:
            workers.capture(self.graphs.batch_sizes, max_model_len, self.block_size)
            with workers.guard():
                seconds = self.graphs.capture()
        startup.mark("cuda graphs")
        return seconds

    def capture_lazily(self, graphs: DecodeGraphs) -> None:
        """Serve with ``graphs``, whose planned graphs are captured once ``start_lazy_capture`` is
        called: a decode step whose bucket has no graph has it captured first, an idle engine
        captures the rest (``capture_while_idle``); until its graph is there a decode batch runs
        eagerly."""
        self.graphs = graphs
        self._lazy = _LazyCapture(started=False)

    def start_lazy_capture(self) -> None:
        """Lazy graphs: from now on capture (the engine calls this once it serves, after its
        warm-up)."""
        if self._lazy is not None:
            self._lazy.started = True
            self._lazy.since = time.perf_counter()

    @property
    def lazy_graphs_pending(self) -> bool:
        """Lazy graphs: whether capture has started and graphs are still to capture."""
        return self._lazy is not None and self._lazy.started

    def capture_while_idle(self) -> bool:
        """Lazy graphs: one piece of the next graph's capture now, while no step runs: its eager
        warm-up forward, or its capture (the engine-core process calls this once it has been idle
        a moment, so an idle server finishes its graphs in about the time an eager start takes,
        and a request that arrives meanwhile waits for one piece at most). Returns whether graphs
        are still to capture."""
        lazy, graphs = self._lazy, self.graphs
        if lazy is None or not lazy.started or graphs is None:
            return False
        t0 = time.perf_counter()
        if graphs.pending:
            graphs.capture_next(split=True)
        elif self.mixed is not None:
            self._capture_mixed(everything=False)
        lazy.seconds += time.perf_counter() - t0
        self._lazy_progress()
        return self.lazy_graphs_pending

    def _capture_mixed(self, everything: bool) -> None:
        """Capture the mixed-step graphs (``everything``) or their next piece (an idle engine). If
        a capture fails (a piece that waits for the host, no memory left for the pool), they are
        turned off with a warning: steps with prompt tokens run eagerly, as without them."""
        mixed, graphs = self.mixed, self.graphs
        assert mixed is not None and graphs is not None
        mixed.pool = mixed.pool or graphs.pool  # their pieces keep nothing in it between replays
        try:
            if everything:
                mixed.capture()
            else:
                mixed.capture_next(split=True)
        except (RuntimeError, torch.cuda.OutOfMemoryError) as exc:
            logger.warning(
                "mixed-step CUDA graphs turned off, capturing them failed: %s; steps with prompt tokens run eagerly", exc
            )
            self.mixed = None

    def _capture_for_step(self, batch: _Batch) -> None:
        """Lazy graphs, before a decode step a graph could run: capture its bucket's graph first
        when it is not there yet (none before a step with prompt tokens: its TTFT would wait)."""
        lazy, graphs = self._lazy, self.graphs
        if lazy is None or not lazy.started or graphs is None or not self._graph_shaped(batch):
            return
        t0 = time.perf_counter()
        if graphs.capture_for(batch.input_ids.shape[0], batch.ctx.max_seq_len):
            lazy.for_steps += 1
        lazy.seconds += time.perf_counter() - t0
        self._lazy_progress()

    def _lazy_progress(self) -> None:
        lazy, graphs = self._lazy, self.graphs
        if lazy is None or graphs is None or graphs.pending or (self.mixed is not None and self.mixed.pending):
            return
        self._lazy = None
        t = graphs.timings
        logger.info(
            "captured %d decode CUDA graphs, %d of them for the step that needed them, %.2f s of capture over %.1f s "
            "of serving (eager warm-up %.2f s, of which %.2f s waiting for the device; capture %.2f s)",
            graphs.num_captured, lazy.for_steps, lazy.seconds, time.perf_counter() - lazy.since,
            t["warm_up_forwards"], t["warm_up_sync"], t["captures"],
        )  # fmt: skip
        if self.mixed is not None:
            m = self.mixed.timings
            logger.info(
                "mixed-step CUDA graphs: %d token buckets of %d pieces (eager warm-up %.2f s, capture %.2f s; part of the capture seconds "
                "above)", len(self.mixed.graphs), self.mixed.num_layers + 1, m["warm_up_forwards"], m["captures"],
            )  # fmt: skip
        startup.mark("cuda graphs (lazy)")

    def forget(self, out: SchedulerOutput) -> None:
        """Drop the state kept for the requests ``out`` reports finished or preempted: their
        block-table rows, a finished one's penalty counts. The engine calls it for every schedule,
        one with nothing to run too (its ids are reported once), before the step is prepared."""
        self.block_tables.release(out.finished_request_ids)
        self.block_tables.release(r.request_id for r in out.preempted_requests)
        self.penalties.drop(out.finished_request_ids)

    def prepare(self, out: SchedulerOutput, prev: LaunchedStep | None = None) -> _Batch:
        """The flat batch of a step. A decode whose input token is still pending (sampled by
        ``prev``, the step before, still on the device) reads it from ``prev.token_ids``."""
        bs = self.block_size
        tables = self.block_tables
        table_rows = tables.rows(out.scheduled_requests)  # each request's row of ``tables``
        from_prev: list[int] = []  # rows whose input id comes from prev
        prev_rows: list[int] = []
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        seq_lens: list[int] = []
        query_start_loc = [0]
        logits_rows: list[int] = []
        sample_requests: list[Request] = []
        sample_rows: list[int] = []
        prompt_lp: list[tuple[Request, int, int, int]] = []
        spec_drafts = out.spec_token_ids
        spec: list[tuple[Request, int, list[int]]] = []
        # A step of decodes and verifications only is laid out as a decode batch: each draft
        # position is a row of its own (one query token, attending to its context up to and
        # including itself, through the request's block table; every row's K/V is written
        # before any row attends), so it runs the tuned decode kernels and the decode CUDA
        # graphs. With a prompt chunk in the step, a verification is one multi-token query.
        decode_rows = bool(spec_drafts) and all(
            n == 1 or r.request_id in spec_drafts for r, n in zip(out.scheduled_requests, out.num_scheduled_tokens)
        )
        row_tables: list[int] | None = [] if decode_rows else None  # each decode row's row of ``tables``
        max_blocks = 1
        for req, n, table_row in zip(out.scheduled_requests, out.num_scheduled_tokens, table_rows):
            start = req.num_computed_tokens
            end = start + n
            row0 = len(input_ids)
            drafts = spec_drafts.get(req.request_id) if spec_drafts else None
            if drafts is not None:
                # The last known token and the drafts after it; every position is scored.
                input_ids.append(req.all_token_ids[start])
                input_ids.extend(drafts)
                positions.extend(range(start, end))
                block_ids = req.block_ids
                slots.extend(block_ids[p // bs] * bs + p % bs for p in range(start, end))
                if row_tables is not None:
                    seq_lens.extend(range(start + 1, end + 1))
                    query_start_loc.extend(range(row0 + 1, row0 + n + 1))
                    row_tables.extend([table_row] * n)
                else:
                    seq_lens.append(end)
                    query_start_loc.append(len(input_ids))
                max_blocks = max(max_blocks, len(block_ids))
                spec.append((req, len(logits_rows), drafts))
                logits_rows.extend(range(row0, row0 + n))
                continue
            if row_tables is not None:
                row_tables.append(table_row)
            if n == 1:
                known = req.all_token_ids
                if start < len(known):
                    input_ids.append(known[start])
                else:  # the pending token sampled by the previous step
                    if prev is None or req.request_id not in prev.rows:
                        raise RuntimeError(f"request {req.request_id!r}: its input token was never sampled")
                    from_prev.append(row0)
                    prev_rows.append(prev.rows[req.request_id])
                    input_ids.append(0)
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
                    prompt_lp.append((req, len(logits_rows), last - first, first))
                    logits_rows.extend(range(row0 + first - start, row0 + last - start))
            if end == len(req.all_token_ids) + req.num_pending_tokens:
                sample_requests.append(req)
                sample_rows.append(len(logits_rows))
                logits_rows.append(row0 + n - 1)
        def to_dev(values: list, dtype: torch.dtype) -> torch.Tensor:
            return to_device(values, self.device, dtype)

        max_query_len = 1 if decode_rows else max(out.num_scheduled_tokens)
        ctx = ForwardContext(
            slot_mapping=to_dev(slots, torch.int64),
            block_tables=tables.gather(row_tables if row_tables is not None else table_rows, max_blocks),
            seq_lens=to_dev(seq_lens, torch.int32),
            query_start_loc=to_dev(query_start_loc, torch.int32),
            max_query_len=max_query_len,
            max_seq_len=max(seq_lens),
            logits_indices=to_dev(logits_rows, torch.int64),
            # a decode-only step needs no count (and would walk its whole batch for it)
            num_decodes=leading_decodes(out.num_scheduled_tokens) if max_query_len > 1 else 0,
        )
        ids = to_dev(input_ids, torch.int64)
        if from_prev:
            assert prev is not None and prev.token_ids is not None
            ids[to_dev(from_prev, torch.int64)] = prev.token_ids[to_dev(prev_rows, torch.int64)]
        return _Batch(
            input_ids=ids,
            positions=to_dev(positions, torch.int64),
            ctx=ctx,
            sample_requests=sample_requests,
            sample_rows=sample_rows,
            prompt_lp=prompt_lp,
            spec=spec,
        )

    def _graph_shaped(self, batch: _Batch) -> bool:
        # A graph computes logits for every row: usable when each row is one token whose logits
        # are wanted (it samples, or it verifies a draft), in row order.
        num_rows = batch.input_ids.shape[0]
        return (
            batch.ctx.max_query_len == 1
            and len(batch.sample_rows) + sum(len(d) + 1 for _, _, d in batch.spec) == num_rows
            and not batch.prompt_lp
        )

    def _use_graph(self, batch: _Batch, num_seqs: int) -> bool:
        num_rows = batch.input_ids.shape[0]
        return (
            self.graphs is not None
            and self._graph_shaped(batch)
            and self.graphs.can_run(num_rows, batch.ctx.max_seq_len)
        )

    def _logits(self, batch: _Batch, num_seqs: int) -> torch.Tensor | None:
        """Forward pass (a decode graph when one fits) and the logits rows the step needs; with
        tensor parallelism every rank runs the same pass on the broadcast batch."""
        self._activate_kernels()
        if self._lazy is not None:
            self._capture_for_step(batch)
        use_graph = self._use_graph(batch, num_seqs)
        workers = self._sync_workers()
        if workers is None:
            return self._forward(batch, use_graph)
        workers.send_step(batch.input_ids, batch.positions, batch.ctx, use_graph)
        with workers.guard():
            return self._forward(batch, use_graph)

    def _forward(self, batch: _Batch, use_graph: bool) -> torch.Tensor | None:
        if use_graph:
            assert self.graphs is not None
            ctx = batch.ctx
            hidden = self.graphs.run(
                batch.input_ids, batch.positions, ctx.slot_mapping, ctx.block_tables, ctx.seq_lens, ctx.max_seq_len
            )
            return self.model.compute_logits(hidden)
        if self.mixed is not None and self.mixed.can_run(batch.input_ids.shape[0]):
            hidden = self.mixed.run(batch.input_ids, batch.positions, batch.ctx)
        else:
            hidden = self.model.forward(batch.input_ids, batch.positions, batch.ctx)
        if batch.ctx.logits_indices.numel() == 0:
            return None
        return self.model.compute_logits(hidden[batch.ctx.logits_indices])

    def _sampling_logits(self, logits: torch.Tensor, batch: _Batch) -> torch.Tensor:
        if len(batch.sample_rows) == logits.shape[0]:
            return logits  # every logits row samples, in order (decode steps)
        return logits[to_device(batch.sample_rows, logits.device, torch.int64)]

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        """Run a step and wait for it: every sampling feature (logprobs, penalties, prompt logprobs)."""
        batch = self.prepare(out)
        result = RunnerOutput()
        logits = self._logits(batch, len(out.scheduled_requests))
        if logits is None:
            return result
        if batch.sample_requests:
            bitmask = self.grammar.bitmask(batch.sample_requests) if self.grammar and self.grammar.active else None
            sampled = sample(self._sampling_logits(logits, batch), batch.sample_requests, bitmask)
            for req, token, lp in zip(batch.sample_requests, sampled.token_ids, sampled.logprobs):
                result.sampled[req.request_id] = token
                if lp is not None:
                    result.logprobs[req.request_id] = lp
        for req, row0, count, first in batch.prompt_lp:
            targets = req.prompt_token_ids[first + 1 : first + 1 + count]
            num_top = req.sampling_params.prompt_logprobs or 0
            result.prompt_logprobs[req.request_id] = prompt_logprobs(logits[row0 : row0 + count], targets, num_top)
        if batch.spec:
            self._verify(logits, batch.spec, result)
        return result

    def _verify(self, logits: torch.Tensor, spec: list[tuple[Request, int, list[int]]], result: RunnerOutput) -> None:
        """Speculative decoding's verification (runtime/speculative.py): the target samples its
        own token at every position of each request's drafts, as it would without them (the
        drafts before a position count as its output), and keeps the drafts up to the first
        that differs from the target's token, then that token."""
        rows: list[int] = []
        views: list[Any] = []
        for req, row0, drafts in spec:
            rows.extend(range(row0, row0 + len(drafts) + 1))
            views.extend(DraftPosition(req, drafts, j) for j in range(len(drafts) + 1))
        scored = logits[to_device(rows, logits.device, torch.int64)]
        bitmask = None
        if self.grammar is not None and self.grammar.active:
            bitmask = self.grammar.draft_bitmask(spec)
        sampled = sample(scored, views, bitmask)
        targets, entries = sampled.token_ids, sampled.logprobs
        i = 0
        for req, _, drafts in spec:
            tokens = []
            for j in range(len(drafts) + 1):
                tokens.append(targets[i + j])
                if j == len(drafts) or targets[i + j] != drafts[j]:
                    break
            result.spec_tokens[req.request_id] = tokens
            if req.sampling_params.logprobs is not None:
                result.spec_logprobs[req.request_id] = [e for e in entries[i : i + len(tokens)] if e is not None]
            i += len(drafts) + 1

    @torch.inference_mode()
    def launch(self, out: SchedulerOutput, prev: LaunchedStep | None) -> LaunchedStep:
        """Queue a step on the device and return without waiting for it (asynchronous
        scheduling): sampling, penalties (from ``self.penalties``), logprobs and prompt
        logprobs are all computed in the step; ``collect`` reads them."""
        if out.spec_token_ids:
            raise RuntimeError("a speculating step runs synchronously (execute), never launched")
        batch = self.prepare(out, prev)
        step = LaunchedStep(out, batch.sample_requests, {}, None, None, None)
        logits = self._logits(batch, len(out.scheduled_requests))
        if logits is None:
            return step
        if batch.sample_requests:
            sampling_logits = self._sampling_logits(logits, batch)
            bitmask = None
            if self.grammar is not None and self.grammar.active:
                # The forward pass is queued: wait for the previous step's tokens (only now, and
                # only for constrained requests), feed them to the matchers and mask this step's
                # rows while the device computes.
                bitmask = self.grammar.bitmask(batch.sample_requests, _pending_tokens(prev))
            step.token_ids = sample_token_ids(
                sampling_logits, batch.sample_requests, self.penalties.inputs, token_bitmask=bitmask
            )
            self.penalties.update(batch.sample_requests, step.token_ids)
            step.rows = {req.request_id: i for i, req in enumerate(batch.sample_requests)}
            step.logprobs = logprob_tensors(sampling_logits, step.token_ids, batch.sample_requests)
        for req, row0, count, first in batch.prompt_lp:
            targets = to_device(req.prompt_token_ids[first + 1 : first + 1 + count], logits.device, torch.int64)
            num_top = req.sampling_params.prompt_logprobs or 0
            step.prompt_logprobs.append(
                (req.request_id, num_top, prompt_logprob_tensors(logits[row0 : row0 + count], targets, num_top))
            )
        if self.device.type == "cuda":
            if step.token_ids is not None:
                step.host_token_ids = torch.empty(step.token_ids.shape, dtype=torch.int64, pin_memory=True)
                step.host_token_ids.copy_(step.token_ids, non_blocking=True)
            if step.logprobs is not None:
                step.logprobs = (step.logprobs[0], step.logprobs[1].to_host())
            step.prompt_logprobs = [(rid, k, tensors.to_host()) for rid, k, tensors in step.prompt_logprobs]
            step.ready = torch.cuda.Event()
            step.ready.record()
        return step

    def collect(self, step: LaunchedStep) -> RunnerOutput:
        """Wait for a launched step's results (only for them: later steps may still run)."""
        result = RunnerOutput()
        if step.ready is not None:
            step.ready.synchronize()
        if step.token_ids is not None:
            host = step.host_token_ids if step.host_token_ids is not None else step.token_ids
            tokens = host.tolist()
            result.sampled = {req.request_id: t for req, t in zip(step.sample_requests, tokens)}
        if step.logprobs is not None:
            rows, tensors = step.logprobs
            requests = [step.sample_requests[i] for i in rows]
            for req, entry in zip(requests, tensors.entries([r.sampling_params.logprobs or 0 for r in requests])):
                result.logprobs[req.request_id] = entry
        for rid, num_top, tensors in step.prompt_logprobs:
            result.prompt_logprobs[rid] = tensors.entries([num_top] * tensors.token_ids.shape[0])
        return result


class DraftPosition:
    """A request as seen from the position of its ``j``-th draft: the drafts before it count as
    output tokens. The sampler reads these attributes, so the target's token at that position is
    processed exactly as it would be once those drafts were accepted: penalties, min_tokens, and
    a seeded request's noise, keyed by the output position."""

    __slots__ = ("__weakref__", "num_output_tokens", "output_token_ids", "request")

    def __init__(self, request: Request, drafts: list[int], j: int):
        self.request = request
        self.output_token_ids = request.output_token_ids + drafts[:j] if j else request.output_token_ids
        self.num_output_tokens = len(self.output_token_ids)

    num_pending_tokens = 0

    def __getattr__(self, name: str) -> Any:  # sampling_params, prompt_token_ids, seed_key, ...
        return getattr(self.request, name)


def _pending_tokens(prev: LaunchedStep | None) -> Any:
    """Looks up a request's token sampled by ``prev`` (the step in flight), waiting for it on
    first use: what a constrained request's matcher needs before its next token is masked."""
    host: list[int] | None = None

    def token(request: Request) -> int:
        nonlocal host
        if prev is None or prev.token_ids is None or request.request_id not in prev.rows:
            raise RuntimeError(f"request {request.request_id!r}: its pending token was not sampled by the last step")
        if host is None:
            if prev.ready is not None:
                prev.ready.synchronize()
            tokens = prev.host_token_ids if prev.host_token_ids is not None else prev.token_ids
            host = tokens.tolist()
        return host[prev.rows[request.request_id]]

    return token
