"""CUDA graphs for decode steps: the whole forward pass of a decode batch replays as one
graph, so a step costs one launch instead of a few hundred and no Python runs per layer.

Graphs are captured at start-up for the batch sizes the artifact's plan lists (up to the
engine's max_num_seqs) and for context-length buckets (the
attention kernel's split count depends on the context bucket). A batch is padded up to the
next captured size: padding rows write no KV (slot -1) and attend to nothing (length 0).
"""

from __future__ import annotations

import bisect
import logging
import time
from typing import Any

import torch

from pagecast.kernels import ops
from pagecast.runtime.forward_context import ForwardContext

logger = logging.getLogger("pagecast.engine")

CONTEXT_BUCKETS = (2048, 8192)


class DecodeGraphs:
    """Captured decode graphs over persistent input buffers; ``run`` fills the buffers and replays."""

    def __init__(
        self, model: Any, device: torch.device, batch_sizes: list[int], max_model_len: int, block_size: int
    ):
        self.model = model
        self.device = device
        self.batch_sizes = sorted(batch_sizes) or [1]
        self.contexts = sorted({c for c in CONTEXT_BUCKETS if c < max_model_len} | {max_model_len})
        self.max_batch = self.batch_sizes[-1]
        self.max_blocks = (max_model_len + block_size - 1) // block_size
        n = self.max_batch
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.block_tables = torch.zeros((n, self.max_blocks), dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(n, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.logits_indices = torch.arange(n, dtype=torch.int64, device=device)
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[int, int], torch.Tensor] = {}
        self.pool = None

    def _forward(self, batch: int, context: int) -> torch.Tensor:
        ctx = ForwardContext(
            slot_mapping=self.slot_mapping[:batch],
            block_tables=self.block_tables[:batch],
            seq_lens=self.seq_lens[:batch],
            query_start_loc=self.query_start_loc[: batch + 1],
            max_query_len=1,
            max_seq_len=context,
            logits_indices=self.logits_indices[:batch],
        )
        # The LM head stays outside the graph: one large GEMM gains nothing from replay, and a
        # [batch, vocab] fp32 output per captured graph would cost gigabytes.
        return self.model.forward(self.input_ids[:batch], self.positions[:batch], ctx)

    @torch.inference_mode()
    def capture(self) -> float:
        start = time.perf_counter()
        # capture_begin/capture_end on a side stream rather than the torch.cuda.graph context:
        # that one empties the allocator's cache before every capture, which made each capture
        # free and re-allocate the warm-up's memory (0.16 s a graph for Llama-3-8B).
        stream = torch.cuda.Stream(self.device)
        # A decode graph depends on the context bucket only through the attention kernel's launch
        # config: contexts whose configs agree share one graph.
        by_config: dict[tuple[int, str], tuple[int, int]] = {}
        warm_s = sync_s = capture_s = 0.0
        # Largest first, so the shared memory pool is sized once.
        for context in reversed(self.contexts):
            for batch in reversed(self.batch_sizes):
                key = (batch, repr(ops.decode_attention_config(batch, context)))
                same = by_config.get(key)
                if same is not None:
                    self.graphs[(batch, context)] = self.graphs[same]
                    self.outputs[(batch, context)] = self.outputs[same]
                    continue
                t0 = time.perf_counter()
                self._forward(batch, context)  # warm-up: kernel selection, allocator
                t_launched = time.perf_counter()
                torch.cuda.synchronize(self.device)
                t1 = time.perf_counter()
                sync_s += t1 - t_launched
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.stream(stream):
                    # thread_local: the weights may still be streaming in on other threads (their
                    # copies and event waits would break a global-mode capture).
                    graph.capture_begin(pool=self.pool, capture_error_mode="thread_local")
                    try:
                        out = self._forward(batch, context)
                    finally:
                        graph.capture_end()
                capture_s += time.perf_counter() - t1
                warm_s += t1 - t0
                if self.pool is None:
                    self.pool = graph.pool()
                self.graphs[(batch, context)] = graph
                self.outputs[(batch, context)] = out
                by_config[key] = (batch, context)
        torch.cuda.synchronize(self.device)
        self.num_captured = len(by_config)
        # warm_up_sync: of the warm-up forwards, the time spent waiting for the device.
        self.timings = {"warm_up_forwards": warm_s, "warm_up_sync": sync_s, "captures": capture_s}
        elapsed = time.perf_counter() - start
        logger.info(
            "captured %d decode CUDA graphs for %d (batch, context) buckets in %.1f s (eager warm-up %.1f s of which "
            "%.1f s waiting for the device, capture %.1f s)",
            self.num_captured, len(self.graphs), elapsed, warm_s, sync_s, capture_s,
        )
        return elapsed

    def can_run(self, num_seqs: int, max_seq_len: int) -> bool:
        return num_seqs <= self.max_batch and max_seq_len <= self.contexts[-1]

    def run(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        max_seq_len: int,
    ) -> torch.Tensor:
        """All inputs on the device, one row per sequence; returns the final hidden states
        [num_seqs, hidden] (valid until the next replay)."""
        n = input_ids.shape[0]
        batch = self.batch_sizes[bisect.bisect_left(self.batch_sizes, n)]
        context = self.contexts[bisect.bisect_left(self.contexts, max_seq_len)]
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(slot_mapping)
        self.seq_lens[:n].copy_(seq_lens)
        width = block_tables.shape[1]
        self.block_tables[:n, :width].copy_(block_tables)
        if batch > n:  # padding rows: no KV write, empty context
            self.slot_mapping[n:batch].fill_(-1)
            self.seq_lens[n:batch].zero_()
            self.input_ids[n:batch].zero_()
            self.positions[n:batch].zero_()
        self.graphs[(batch, context)].replay()
        return self.outputs[(batch, context)][:n]
