"""CUDA graphs for decode steps: the whole forward pass of a decode batch replays as one
graph, so a step costs one launch instead of a few hundred and no Python runs per layer.

Graphs are captured for the batch sizes the artifact's plan lists (up to the engine's
max_num_seqs) and for context-length buckets (the attention kernel's split count depends on the
context bucket): all at start-up, or (lazy graphs) once the engine serves: a decode step whose
bucket has no graph yet has it captured first, and an idle engine captures the rest; decode
batches run eagerly until their graph is there. A batch is padded up
to the next captured size: padding rows write no KV (slot -1) and attend to nothing (length 0).

Steps with prompt tokens (MixedGraphs, opt-in: ``engine-serve --mixed-graphs``) replay the layers
between attention calls as graphs per token bucket, and run each attention eagerly between them.
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

# Below max_model_len (which always has its graphs). 32768 matches the decode kernel's tuned context
# buckets past 8k (tuning.DECODE_CONTEXT_BUCKETS): a 128k model's 8k-32k contexts replay a graph
# with the 32k bucket's split count, not the 128k bucket's. Graphs whose configs agree are shared.
CONTEXT_BUCKETS = (2048, 8192, 32768)


class _GraphSet:
    """What DecodeGraphs and MixedGraphs share: a plan captured piece by piece (``capture_next``),
    each graph recorded on a side stream into one memory pool."""

    device: torch.device
    pool: Any = None
    _stream: torch.cuda.Stream | None = None

    def capture_next(self, split: bool = False) -> bool:
        raise NotImplementedError

    def _log_capture(self, seconds: float) -> None:
        raise NotImplementedError

    @torch.inference_mode()
    def capture(self) -> float:
        """Capture everything planned now; returns the seconds it took."""
        start = time.perf_counter()
        while self.capture_next():
            pass
        self._synchronize()
        elapsed = time.perf_counter() - start
        self._log_capture(elapsed)
        return elapsed

    def _synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def _record(self, fn: Any) -> tuple[Any, Any]:
        """Record ``fn()`` as a graph; returns the graph and what ``fn`` returned (its output
        buffers, which later replays overwrite)."""
        if self._stream is None:
            # capture_begin/capture_end on a side stream rather than the torch.cuda.graph context:
            # that one empties the allocator's cache before every capture, which made each capture
            # free and re-allocate the warm-up's memory (0.16 s a graph for Llama-3-8B).
            self._stream = torch.cuda.Stream(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(self._stream):
            # thread_local: the weights may still be streaming in on other threads (their
            # copies and event waits would break a global-mode capture).
            graph.capture_begin(pool=self.pool, capture_error_mode="thread_local")
            try:
                out = fn()
            finally:
                graph.capture_end()
        if self.pool is None:
            self.pool = graph.pool()
        return graph, out


class DecodeGraphs(_GraphSet):
    """Captured decode graphs over persistent input buffers; ``run`` fills the buffers and replays."""

    def __init__(self, model: Any, device: torch.device, batch_sizes: list[int], max_model_len: int, block_size: int):
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
        # The (batch, context) buckets to capture, largest first, so the shared memory pool is
        # sized by the first capture.
        self._plan = [(b, c) for c in reversed(self.contexts) for b in reversed(self.batch_sizes)]
        self._by_config: dict[tuple[int, str], tuple[int, int]] = {}
        self._warmed: set[tuple[int, int]] = set()  # buckets whose warm-up forward has run
        self.num_captured = 0
        # warm_up_sync: of the warm-up forwards, the time spent waiting for the device.
        self.timings = {"warm_up_forwards": 0.0, "warm_up_sync": 0.0, "captures": 0.0}

    def _forward(self, batch: int, context: int) -> torch.Tensor:
        """The forward pass of the buffers' first ``batch`` rows for ``context``."""
        # The LM head stays outside the graph: one large GEMM gains nothing from replay, and a
        # [batch, vocab] fp32 output per captured graph would cost gigabytes.
        ctx = ForwardContext(
            slot_mapping=self.slot_mapping[:batch],
            block_tables=self.block_tables[:batch],
            seq_lens=self.seq_lens[:batch],
            query_start_loc=self.query_start_loc[: batch + 1],
            max_query_len=1,
            max_seq_len=context,
            logits_indices=self.logits_indices[:batch],
        )
        return self.model.forward(self.input_ids[:batch], self.positions[:batch], ctx)

    def _log_capture(self, elapsed: float) -> None:
        t = self.timings
        logger.info(
            "captured %d decode CUDA graphs for %d (batch, context) buckets in %.1f s (eager warm-up %.1f s of which "
            "%.1f s waiting for the device, capture %.1f s)",
            self.num_captured, len(self.graphs), elapsed, t["warm_up_forwards"], t["warm_up_sync"], t["captures"],
        )

    def _config_key(self, batch: int, context: int) -> tuple[int, str]:
        """What a decode graph of this bucket depends on besides its batch: the attention kernel's
        launch config."""
        return batch, repr(ops.decode_attention_config(batch, context))

    @property
    def pending(self) -> int:
        """(batch, context) buckets planned and not captured yet (0: every graph is there)."""
        return len(self._plan)

    def _shared(self, batch: int, context: int) -> bool:
        """A decode graph depends on the context bucket only through the attention kernel's
        launch config: contexts whose configs agree share one graph. True (and the bucket maps to
        the graph captured already) when ``(batch, context)`` needs no capture of its own."""
        same = self._by_config.get(self._config_key(batch, context))
        if same is None:
            return False
        self.graphs[(batch, context)] = self.graphs[same]
        self.outputs[(batch, context)] = self.outputs[same]
        return True

    @torch.inference_mode()
    def capture_next(self, split: bool = False) -> bool:
        """Capture the next planned graph (buckets whose graph would be the same as one captured
        already share it on the way); False when nothing was left to capture. Each graph is one
        eager forward (the warm-up) and one capture; ``split`` (an idle engine between steps)
        does only one of the two a call, so a request that arrives meanwhile waits for the shorter
        of them."""
        while self._plan:
            batch, context = self._plan[0]
            if self._shared(batch, context):
                self._plan.pop(0)
                continue
            if (batch, context) not in self._warmed:
                self._warm_up(batch, context)
                if split:
                    return True
            self._plan.pop(0)
            self._capture(batch, context)
            return True
        return False

    @torch.inference_mode()
    def capture_for(self, num_seqs: int, max_seq_len: int) -> bool:
        """Lazy graphs, before a decode step: capture the graph of the step's own bucket if it is
        planned and not there yet (the step then replays it); True when it captured one."""
        if num_seqs > self.max_batch or max_seq_len > self.contexts[-1]:
            return False
        bucket = self._bucket(num_seqs, max_seq_len)
        if bucket in self.graphs or bucket not in self._plan:
            return False
        self._plan.remove(bucket)
        if self._shared(*bucket):
            return False
        if bucket not in self._warmed:
            self._warm_up(*bucket)
        self._capture(*bucket)
        return True

    def _pad(self, lo: int, hi: int) -> None:
        """Rows [lo, hi) as padding: no KV write (slot -1), an empty context."""
        self.slot_mapping[lo:hi].fill_(-1)
        self.seq_lens[lo:hi].zero_()
        self.input_ids[lo:hi].zero_()
        self.positions[lo:hi].zero_()

    def _warm_up(self, batch: int, context: int) -> None:
        """The eager forward before a capture: the kernels of that batch size and context bucket
        are loaded (and cuBLAS has chosen its algorithms) before they are recorded."""
        # Padding rows only: between steps (lazy graphs) the buffers hold the last replay's real
        # rows, whose KV slots the warm-up's eager forward must not write.
        self._pad(0, batch)
        t0 = time.perf_counter()
        self._forward(batch, context)
        t_launched = time.perf_counter()
        self._synchronize()
        t1 = time.perf_counter()
        self.timings["warm_up_forwards"] += t1 - t0
        self.timings["warm_up_sync"] += t1 - t_launched
        self._warmed.add((batch, context))

    def _capture(self, batch: int, context: int) -> None:
        t0 = time.perf_counter()
        graph, out = self._capture_one(batch, context)
        self.timings["captures"] += time.perf_counter() - t0
        self.graphs[(batch, context)] = graph
        self.outputs[(batch, context)] = out
        self._by_config[self._config_key(batch, context)] = (batch, context)
        self.num_captured = len(self._by_config)

    def _capture_one(self, batch: int, context: int) -> tuple[Any, torch.Tensor]:
        """Record one graph of ``batch`` rows for ``context`` (after its warm-up); returns the
        graph and its output buffer."""
        return self._record(lambda: self._forward(batch, context))

    def can_run(self, num_seqs: int, max_seq_len: int) -> bool:
        if num_seqs > self.max_batch or max_seq_len > self.contexts[-1]:
            return False
        return self._bucket(num_seqs, max_seq_len) in self.graphs  # not yet captured: eager

    def _bucket(self, num_seqs: int, max_seq_len: int) -> tuple[int, int]:
        batch = self.batch_sizes[bisect.bisect_left(self.batch_sizes, num_seqs)]
        return batch, self.contexts[bisect.bisect_left(self.contexts, max_seq_len)]

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
        batch, context = self._bucket(n, max_seq_len)
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(slot_mapping)
        self.seq_lens[:n].copy_(seq_lens)
        width = block_tables.shape[1]
        self.block_tables[:n, :width].copy_(block_tables)
        if batch > n:
            self._pad(n, batch)
        self.graphs[(batch, context)].replay()
        return self.outputs[(batch, context)][:n]


# Token counts a step with prompt tokens is padded to for MixedGraphs. The reasoning, not yet
# measured: up to a few hundred tokens an 8B model's projections are bound by their weight reads
# (about 4 ms a step on an H200), so padding costs little there, while the step's ~300 eager
# launches cost host time of the same order; past 512 the kernels' time grows with the tokens,
# asynchronous scheduling hides the launches behind it, and padding would cost compute.
# Capped at the engine's step budget.
MIXED_TOKEN_BUCKETS = (16, 32, 64, 128, 256, 384, 512)


def mixed_graph_sizes(max_num_batched_tokens: int) -> list[int]:
    """MixedGraphs' token buckets for an engine whose steps take up to ``max_num_batched_tokens``."""
    top = min(max_num_batched_tokens, MIXED_TOKEN_BUCKETS[-1])
    return [s for s in MIXED_TOKEN_BUCKETS if s < top] + [top]


class MixedGraphs(_GraphSet):
    """CUDA graphs for steps with prompt tokens (prefill chunks, alone or beside decodes), which
    DecodeGraphs cannot take: the model between its attention calls is captured per token-count
    bucket, and attention runs eagerly between the pieces with the step's own metadata (its
    kernels and their grids follow how the step's tokens fall into sequences, which a graph could
    not). A bucket is ``num_layers + 1`` graphs: the embedding and layer 0 up to its attention;
    each layer from its attention's output up to the next layer's attention; the last layer's
    rest and the final norm (the generated model's ``embed`` / ``before_attention`` /
    ``after_attention`` / ``final_norm``).

    The pieces talk through persistent buffers: the token inputs, q (a piece's output, attention's
    input), attention's output, the residual stream, the final hidden states. A step of n tokens
    is padded to its bucket: padding rows write no KV (slot -1) and attention skips them (it runs
    over the first n rows only); their rows of the buffers hold finite leftovers, and every piece
    computes each row from that row alone (a MoE block's padding rows join expert groups, not
    other rows' sums), so they never reach a real row. A MoE model's buckets are those where its
    MoE blocks do not take the loop that waits for the host (``Model.pieces_fit``).
    """

    SPLIT_PIECES = 8  # pieces captured a call by an idle engine (capture_next(split=True))

    def __init__(self, model: Any, device: torch.device, token_sizes: list[int]):
        self.model = model
        self.device = device
        self.sizes = sorted(token_sizes)
        self.num_layers = len(model.layers)
        n = self.sizes[-1]
        dtype = model.embed_tokens.dtype
        heads, head_dim = model.Q_SHAPE
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.q = torch.zeros((n, heads, head_dim), dtype=dtype, device=device)
        self.attn = torch.zeros((n, heads, head_dim), dtype=dtype, device=device)
        self.residual = torch.zeros((n, model.HIDDEN_SIZE), dtype=dtype, device=device)
        self.hidden = torch.zeros((n, model.HIDDEN_SIZE), dtype=dtype, device=device)
        self.graphs: dict[int, list[Any]] = {}  # token bucket -> its pieces, in order
        self.pool = None
        self._plan = list(reversed(self.sizes))  # largest first: the shared pool is sized by it
        self._warmed: set[int] = set()
        self._partial: dict[int, list[Any]] = {}  # a bucket's pieces captured so far (split capture)
        self.timings = {"warm_up_forwards": 0.0, "captures": 0.0}

    @staticmethod
    def supports(model: Any) -> bool:
        """Whether ``model`` (generated code) comes in graph pieces: models rendered by this version
        (artifacts built before have one ``forward``)."""
        return bool(getattr(model, "GRAPH_PIECES", False))

    @staticmethod
    def sizes_for(model: Any, token_sizes: list[int]) -> list[int]:
        """The buckets of ``token_sizes`` whose pieces ``model`` can have captured (under the
        active kernel table, whose configs decide it for a MoE model)."""
        return [n for n in token_sizes if model.pieces_fit(n)]

    # -- the pieces --------------------------------------------------------------------------

    def _piece(self, k: int, n: int) -> None:
        """Piece ``k`` of bucket ``n``, over the first n rows of the buffers."""
        m = self.model
        if k == 0:
            hidden, residual = m.embed(self.input_ids[:n]), None
        else:
            hidden, residual = m.after_attention(k - 1, self.attn[:n], self.residual[:n])
        if k == self.num_layers:
            self.hidden[:n].copy_(m.final_norm(hidden, residual))
            return
        q, residual = m.before_attention(k, hidden, residual, self.positions[:n], self.slot_mapping[:n])
        self.q[:n].copy_(q)
        self.residual[:n].copy_(residual)

    def _pad(self, lo: int, hi: int) -> None:
        """Rows [lo, hi) as padding: no KV write (slot -1)."""
        self.slot_mapping[lo:hi].fill_(-1)
        self.input_ids[lo:hi].zero_()
        self.positions[lo:hi].zero_()

    # -- capture -----------------------------------------------------------------------------

    @property
    def pending(self) -> int:
        """Buckets planned and not captured yet."""
        return len(self._plan)

    def _log_capture(self, elapsed: float) -> None:
        logger.info(
            "captured mixed-step CUDA graphs for %d token buckets (%d pieces each) in %.1f s",
            len(self.graphs), self.num_layers + 1, elapsed,
        )  # fmt: skip

    @torch.inference_mode()
    def capture_next(self, split: bool = False) -> bool:
        """Capture the next planned bucket: its eager warm-up (the pieces run once, so every kernel
        is loaded before it is recorded), then its pieces. ``split`` (an idle engine between steps)
        does the warm-up or up to SPLIT_PIECES captures a call, so a request that arrives meanwhile
        waits for about one layer's worth of a decode graph's capture. False when nothing was left
        to capture."""
        if not self._plan:
            return False
        n = self._plan[0]
        if n not in self._warmed:
            self._warm_up(n)
            if split:
                return True
        pieces = self._partial.setdefault(n, [])
        t0 = time.perf_counter()
        while len(pieces) <= self.num_layers:
            pieces.append(self._capture_one(len(pieces), n))
            if split and len(pieces) % self.SPLIT_PIECES == 0:
                break
        self.timings["captures"] += time.perf_counter() - t0
        if len(pieces) == self.num_layers + 1:
            self.graphs[n] = self._partial.pop(n)
            self._plan.pop(0)
        return True

    def _warm_up(self, n: int) -> None:
        # Padding rows only: the warm-up before a capture must not write the KV slots the last
        # step's real rows held.
        self._pad(0, n)
        t0 = time.perf_counter()
        for k in range(self.num_layers + 1):
            self._piece(k, n)
        self._synchronize()
        self.timings["warm_up_forwards"] += time.perf_counter() - t0
        self._warmed.add(n)

    def _capture_one(self, k: int, n: int) -> Any:
        """Record piece ``k`` of bucket ``n`` (after the bucket's warm-up); returns the graph."""
        graph, _ = self._record(lambda: self._piece(k, n))
        return graph

    # -- replay ------------------------------------------------------------------------------

    def can_run(self, num_tokens: int) -> bool:
        if num_tokens > self.sizes[-1]:
            return False
        return self._bucket(num_tokens) in self.graphs  # not captured yet: eager

    def _bucket(self, num_tokens: int) -> int:
        return self.sizes[bisect.bisect_left(self.sizes, num_tokens)]

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """One step (inputs on the device, ``ctx`` the step's own metadata); returns the final
        hidden states [num_tokens, hidden] (valid until the next run)."""
        n = input_ids.shape[0]
        size = self._bucket(n)
        m = self.model
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(m.rope_positions(positions, ctx))
        self.slot_mapping[:n].copy_(ctx.slot_mapping)
        if size > n:
            self._pad(n, size)
        pieces = self.graphs[size]
        pieces[0].replay()
        for i in range(self.num_layers):
            m.attention(i, self.q[:n], ctx, out=self.attn[:n])
            pieces[i + 1].replay()
        return self.hidden[:n]
