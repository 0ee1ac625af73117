"""Speculative decoding with a draft model: a smaller artifact of the same tokenizer proposes
the next ``k`` tokens greedily, and the target verifies them in one pass (runtime/speculative.py).

The draft runs on the target's device beside it, with its own weights, its own kernel table and
its own KV cache, laid out like the target's and with exactly as many blocks: the target's
block tables index it directly (a request's block ``b`` holds the draft's K/V of positions
``b * block_size ..`` as it holds the target's), so there is no second block pool, and every
block the core allocates for a request's tokens and drafts has room for the draft's K/V too.

Per request the proposer remembers how far the draft's K/V is known to be right: ``computed``
positions of ``all_token_ids``, plus the drafts it fed back after them (``provisional``). A
step's ``propose``:

1. catches up: one flat ragged batch (like ModelRunner.prepare's) over every request's
   positions ``[computed, num_tokens)`` (split into forwards of at most
   ``max_num_batched_tokens`` tokens), logits only at each request's last known token; their
   argmax is draft 1. The whole catch-up runs in this step, so the first speculating step after
   a long prompt also runs the draft over that prompt (a fraction of the target's prefill, but
   on the CPU more than the engine's per-step prompt budget: spreading it over steps would
   return no drafts meanwhile, which the core counts as misses and backs off from);
2. decodes ``k - 1`` times more, one token per request that wants more: draft ``j`` goes in at
   position ``num_tokens - 1 + j`` and draft ``j + 1`` comes out.

After it, positions ``< num_tokens`` hold the known tokens' K/V (``computed = num_tokens``) and
positions ``num_tokens ..`` the K/V of drafts 1..k-1, which the target may reject. They are not
thrown away: K/V at position ``p`` depends only on the tokens at ``0..p``, so at the next
propose every provisional position whose draft turned out to be the token now known there (an
accepted draft) is still right and is not computed again; the first one that differs and
everything after it is. In the usual step (some drafts accepted, then the target's own token)
the catch-up is then one token per request, a decode.

What does *not* count as computed: the target's prefix-cache hits (a cached block's draft K/V
may never have been written, or belong to a block since reused), so a new request's draft
starts at position 0; and a preempted request, whose blocks are gone (``drop`` forgets it).
Stale draft K/V can only lower the acceptance rate, never change an output: verification keeps
the target's tokens whatever is proposed.

On a GPU (with the engine's cuda_graphs option) the decode steps replay CUDA graphs captured
when the cache is bound, for the draft plan's batch sizes up to the most requests that
speculate at once; the catch-up runs eagerly. Tensor-parallel targets or drafts are not
supported yet.
"""

from __future__ import annotations

import logging
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from pagecast.kernels import ops
from pagecast.runtime.artifact import MANIFEST, SPECULATIVE_DIR
from pagecast.runtime.cuda_graphs import DecodeGraphs
from pagecast.runtime.forward_context import ForwardContext
from pagecast.runtime.kernel_cache import relink_groups
from pagecast.runtime.loader import LoadedArtifact, load_artifact, zeros_kv_cache
from pagecast.runtime.request import Request
from pagecast.runtime.speculative import SpeculativeConfig, resolve_model_path
from pagecast.runtime.transfer import to_device

logger = logging.getLogger("pagecast.engine")

TOKENIZER_FILE = "tokenizer/tokenizer.json"
_TP_UNSUPPORTED = (
    "speculative decoding with a draft model is not supported yet with tensor parallelism "
    "(target tp {target}, draft tp {draft}); build both with --tp 1, or use method ngram"
)


@dataclass
class _DraftState:
    """How far one request's draft K/V is right: positions ``< computed`` hold the K/V of its
    known tokens; positions ``computed + i`` that of ``provisional[i]``, a draft fed back in the
    last propose (right only if that draft was accepted)."""

    computed: int = 0
    provisional: list[int] = field(default_factory=list)


@dataclass
class _Segment:
    """Positions ``start..end`` of one request in a catch-up forward; ``row``: its index in the
    propose call's active requests, whose draft 1 comes from this segment when ``final``."""

    request: Request
    row: int
    start: int
    end: int
    final: bool


class DraftModelProposer:
    """Proposes each request's greedy continuation under a draft model (method ``draft_model``).

    Built by the core before it sizes the KV cache: ``kv_bytes_per_block`` is what the draft's
    cache adds per block, and ``bind_kv_cache(num_blocks)`` allocates that cache once the number
    of blocks is known. ``propose`` may be called only after it."""

    graph_class: type[DecodeGraphs] = DecodeGraphs  # the decode graphs' maker (tests: a CPU stand-in)

    def __init__(self, config: SpeculativeConfig, core: Any):
        self.num_speculative_tokens = config.num_speculative_tokens
        if core.artifact.manifest.tp > 1:  # checked again with the draft's in check_draft; here before loading it
            raise ValueError(_TP_UNSUPPORTED.format(target=core.artifact.manifest.tp, draft="not loaded"))
        path = draft_path(config, Path(core.artifact.path))
        self.artifact = _load_draft(path, core)
        check_draft(self.artifact, core)
        manifest = self.artifact.manifest
        self.model = self.artifact.model
        self.device = self.artifact.device
        self.block_size = manifest.block_size
        self.max_num_batched_tokens = max(1, int(core.options.max_num_batched_tokens))
        self.max_model_len = int(core.max_model_len)
        # Decode graphs (GPU): no step speculates for more requests than this.
        self.graphs: DecodeGraphs | None = None
        self._graph_batch_limit = (
            min(int(core.options.max_num_seqs), config.disable_by_batch_size)
            if self.device.type == "cuda" and core.options.cuda_graphs
            else 0
        )
        # What the draft's KV cache costs per block, for the core's memory plan (the draft's own
        # memory plan: its layers, KV heads, head size and KV dtype).
        self.kv_bytes_per_block = int(self.artifact.memory_plan["bytes_per_block"])
        self.kv_cache: torch.Tensor | None = None
        self._states: dict[str, _DraftState] = {}
        logger.info(
            "speculative decoding with draft model %s (%s, %d layers, %s) from %s: up to %d drafts a step, "
            "%d bytes of draft KV per block",
            manifest.name, manifest.family, manifest.dims["num_layers"], manifest.dtype, path,
            self.num_speculative_tokens, self.kv_bytes_per_block,
        )  # fmt: skip

    # -- set-up -----------------------------------------------------------------------------

    def bind_kv_cache(self, num_blocks: int) -> None:
        """Allocate the draft's KV cache with the target's ``num_blocks`` blocks (so the target's
        block ids index it) and wait for the draft's weights (read in the background on a GPU)."""
        manifest = self.artifact.manifest
        dims = manifest.dims
        self.kv_cache = zeros_kv_cache(
            (dims["num_layers"], 2, num_blocks, manifest.kv_heads_per_rank, self.block_size, dims["head_dim"]),
            self.artifact.kv_cache_dtype,
            self.device,
        )
        self.model.bind_kv_cache(self.kv_cache)
        self.artifact.wait_verified()
        self._states.clear()  # a new cache holds nothing
        if self._graph_batch_limit:
            planned = self.artifact.memory_plan.get("cuda_graph_batch_sizes") or [1]
            sizes = [b for b in planned if b <= self._graph_batch_limit] or [1]
            ops.activate(self.artifact.kernels)  # the graphs replay the draft's kernel configs
            self.graphs = self.graph_class(self.model, self.device, sizes, self.max_model_len, self.block_size)
            self.graphs.capture()

    def drop(self, request_ids: set[str]) -> None:
        """Forget finished or preempted requests: a preempted one starts again from position 0."""
        for request_id in request_ids:
            self._states.pop(request_id, None)

    # -- proposing --------------------------------------------------------------------------

    @torch.inference_mode()
    def propose(self, requests: list[Request], num_drafts: list[int]) -> list[list[int]]:
        """Up to ``num_drafts[i]`` greedy draft tokens for each request (see the module's doc)."""
        if self.kv_cache is None:
            raise RuntimeError("DraftModelProposer.bind_kv_cache must be called before propose")
        drafts: list[list[int]] = [[] for _ in requests]
        active = [i for i, k in enumerate(num_drafts) if k > 0]
        if not active:
            return drafts
        ops.activate(self.artifact.kernels)  # the draft's tuned configs (the target's runner re-activates its own)
        reqs = [requests[i] for i in active]
        wanted = [min(num_drafts[i], self.num_speculative_tokens) for i in active]
        lengths = [len(r.all_token_ids) for r in reqs]
        starts = [self._start(r, n) for r, n in zip(reqs, lengths)]

        firsts = self._catch_up(reqs, starts, lengths)
        tokens = firsts  # the last draft of each active request, fed back in the next decode
        for row, token in enumerate(firsts):
            drafts[active[row]].append(token)
        for j in range(1, max(wanted)):
            rows = [row for row in range(len(reqs)) if wanted[row] > j]
            positions = [lengths[row] - 1 + j for row in rows]
            out = self._decode([reqs[row] for row in rows], [tokens[row] for row in rows], positions)
            for row, token in zip(rows, out):
                tokens[row] = token
                drafts[active[row]].append(token)

        for row, request in enumerate(reqs):
            # Drafts 1..m-1 went in at positions n..n+m-2; the last one never did.
            self._states[request.request_id] = _DraftState(lengths[row], drafts[active[row]][:-1])
        return drafts

    def _start(self, request: Request, num_tokens: int) -> int:
        """The first position whose draft K/V must be computed: after the known-right ones and
        the accepted provisional ones, and never past the last token (its logits give draft 1)."""
        state = self._states.get(request.request_id)
        if state is None:
            return 0
        start = min(state.computed, num_tokens)
        known = request.all_token_ids
        for token in state.provisional:
            if start >= num_tokens or known[start] != token:
                break
            start += 1
        return min(start, num_tokens - 1)

    def _catch_up(self, requests: list[Request], starts: list[int], lengths: list[int]) -> list[int]:
        """Compute positions ``starts[i]..lengths[i]`` of each request, at most
        ``max_num_batched_tokens`` per forward; returns each request's argmax after its last token."""
        first_tokens = [0] * len(requests)
        batch: list[_Segment] = []
        room = self.max_num_batched_tokens
        for row, (request, start, end) in enumerate(zip(requests, starts, lengths)):
            while start < end:
                take = min(room, end - start)
                batch.append(_Segment(request, row, start, start + take, start + take == end))
                start += take
                room -= take
                if room == 0:
                    self._run_segments(batch, first_tokens)
                    batch, room = [], self.max_num_batched_tokens
        if batch:
            self._run_segments(batch, first_tokens)
        return first_tokens

    def _run_segments(self, segments: list[_Segment], first_tokens: list[int]) -> None:
        input_ids: list[int] = []
        positions: list[int] = []
        query_lens: list[int] = []
        logits_rows: list[int] = []
        for seg in segments:
            input_ids.extend(seg.request.all_token_ids[seg.start : seg.end])
            positions.extend(range(seg.start, seg.end))
            query_lens.append(seg.end - seg.start)
            if seg.final:
                logits_rows.append(len(input_ids) - 1)
        argmax = self._forward(
            [seg.request for seg in segments], input_ids, positions, query_lens, [seg.end for seg in segments], logits_rows
        )
        finals = [seg.row for seg in segments if seg.final]
        for row, token in zip(finals, argmax):
            first_tokens[row] = token

    def _decode(self, requests: list[Request], tokens: list[int], positions: list[int]) -> list[int]:
        """One decode step: ``tokens[i]`` at ``positions[i]``; returns each request's argmax after it."""
        n = len(requests)
        return self._forward(requests, tokens, positions, [1] * n, [p + 1 for p in positions], list(range(n)), True)

    def _forward(
        self,
        requests: list[Request],
        input_ids: list[int],
        positions: list[int],
        query_lens: list[int],
        seq_lens: list[int],
        logits_rows: list[int],
        decode: bool = False,
    ) -> list[int]:
        """One forward of the draft over a flat batch (sequence i: ``query_lens[i]`` tokens ending
        at context length ``seq_lens[i]``); the argmax at each of ``logits_rows``. A ``decode``
        batch (one token per sequence, logits for each) replays a CUDA graph when one fits."""
        bs = self.block_size
        slots: list[int] = []
        query_start_loc = [0]
        offset = 0
        for request, q, end in zip(requests, query_lens, seq_lens):
            block_ids = request.block_ids
            for p in positions[offset : offset + q]:
                slots.append(block_ids[p // bs] * bs + p % bs)
            offset += q
            query_start_loc.append(offset)
        max_blocks = max(len(r.block_ids) for r in requests)
        block_tables = [r.block_ids + [0] * (max_blocks - len(r.block_ids)) for r in requests]
        max_query_len = max(query_lens)
        num_decodes = 0
        if max_query_len > 1:  # a decode-only batch needs no count (as ModelRunner.prepare)
            while num_decodes < len(query_lens) and query_lens[num_decodes] == 1:
                num_decodes += 1
        device = self.device
        ctx = ForwardContext(
            slot_mapping=to_device(slots, device, torch.int64),
            block_tables=to_device(block_tables, device, torch.int32),
            seq_lens=to_device(seq_lens, device, torch.int32),
            query_start_loc=to_device(query_start_loc, device, torch.int32),
            max_query_len=max_query_len,
            max_seq_len=max(seq_lens),
            logits_indices=to_device(logits_rows, device, torch.int64),
            num_decodes=num_decodes,
        )
        ids, pos = to_device(input_ids, device, torch.int64), to_device(positions, device, torch.int64)
        graphs = self.graphs
        if decode and graphs is not None and max_blocks <= graphs.max_blocks and graphs.can_run(len(requests), ctx.max_seq_len):
            hidden = graphs.run(ids, pos, ctx.slot_mapping, ctx.block_tables, ctx.seq_lens, ctx.max_seq_len)
            logits = self.model.compute_logits(hidden)  # every row: one per sequence
        else:
            hidden = self.model.forward(ids, pos, ctx)
            if not logits_rows:
                return []
            logits = self.model.compute_logits(hidden[ctx.logits_indices])
        return logits.argmax(dim=-1).tolist()


def draft_path(config: SpeculativeConfig, artifact_path: Path) -> Path:
    """The draft artifact's directory. The name enginebuild records for the draft it nests
    (``speculative``) is the target artifact's own ``speculative/`` whatever the working
    directory holds; any other name resolves as ``resolve_model_path`` says."""
    nested = artifact_path / SPECULATIVE_DIR
    if config.model == SPECULATIVE_DIR and (nested / MANIFEST).is_file():
        return nested
    return resolve_model_path(config, artifact_path)


def _load_draft(path: Path, core: Any) -> LoadedArtifact:
    """Load the draft artifact (no tokenizer: the target's serves) on the target's device.

    Loading points Triton's cache at a private copy of the draft's compiled kernels; the target's
    kernels were in the copy made when it loaded. The draft's kernels are merged into that copy
    and Triton pointed back at it, so both models' kernels load without compiling."""
    if not path.is_dir():
        raise ValueError(
            f"speculative_config model {str(path)!r} is not a directory: give a draft artifact built with "
            "enginebuild (an absolute path, or one relative to the target artifact)"
        )
    # The target's private copy, if it shipped kernels (else the variable is the user's own, or unset).
    target_cache = os.environ.get("TRITON_CACHE_DIR") if (Path(core.artifact.path) / "triton_cache").is_dir() else None
    verify = bool(getattr(core.options, "verify_weights", True))
    draft = load_artifact(path, verify_weights=verify, load_tokenizer=False)
    draft_cache = os.environ.get("TRITON_CACHE_DIR")
    if target_cache and draft_cache and draft_cache != target_cache:
        shutil.copytree(draft_cache, target_cache, dirs_exist_ok=True)
        relink_groups(Path(target_cache))
        os.environ["TRITON_CACHE_DIR"] = target_cache
    return draft


def check_draft(draft: LoadedArtifact, core: Any) -> None:
    """Refuse a draft the proposer cannot pair with the target, saying what to do."""
    target = core.artifact.manifest
    ours = draft.manifest
    where = f"draft model {draft.path}"
    if target.tp > 1 or ours.tp > 1:
        raise ValueError(f"{where}: " + _TP_UNSUPPORTED.format(target=target.tp, draft=ours.tp))
    target_vocab, draft_vocab = int(target.dims["vocab_size"]), int(ours.dims["vocab_size"])
    if draft_vocab != target_vocab:
        raise ValueError(
            f"{where}: its vocabulary has {draft_vocab} tokens and the target's {target_vocab}; a draft must "
            "share the target's tokenizer and vocabulary: pick a smaller model of the same family"
        )
    target_tok, draft_tok = target.files.get(TOKENIZER_FILE), ours.files.get(TOKENIZER_FILE)
    if target_tok and draft_tok and target_tok != draft_tok:
        raise ValueError(
            f"{where}: its tokenizer (tokenizer.json) differs from the target's; a draft must use the same "
            "tokenizer, token for token: pick a smaller model of the same family"
        )
    if ours.block_size != target.block_size:
        raise ValueError(
            f"{where}: it was built with --block-size {ours.block_size} and the target with "
            f"{target.block_size}; the draft shares the target's block tables: rebuild it with "
            f"enginebuild --block-size {target.block_size}"
        )
    if draft.device != core.artifact.device:
        raise ValueError(
            f"{where}: it runs on {draft.device} ({ours.target.name}) and the target on "
            f"{core.artifact.device} ({target.target.name}); rebuild it with the target's --gpu"
        )
    max_model_len = int(getattr(core, "max_model_len", target.max_model_len))
    if ours.max_model_len < max_model_len:
        raise ValueError(
            f"{where}: its max_model_len {ours.max_model_len} is shorter than the engine's {max_model_len}; "
            f"rebuild it with enginebuild --max-model-len {max_model_len}"
        )
