"""EAGLE-3 speculative decoding: a one-layer head drafts from the target's own hidden states.

What the head reads. The target's generated model copies, every forward, the residual stream
entering three of its layers (``Eagle3HeadConfig.aux_layer_ids``) of every token into a paged
per-slot buffer (``Model.bind_aux_hidden_states``): ``aux[j, slot]`` for the token at that KV-cache
slot, the same slot its K/V take. So whatever step computed a position (a prefill chunk, a decode
step that did not speculate, a verification pass), its features wait in the buffer at the
position's slot, and the head catches up later at no cost to the steps that did not speculate.
The buffer's bytes are counted in ``kv_bytes_per_block``, so the KV cache shrinks to make room.

What the head computes, at position ``i`` (its own rope position ``i``, its own one-layer paged
KV cache at the target's slot of ``i``, in the target's blocks):

    x_i = concat(input_layernorm(embed(t_{i+1})), hidden_norm(h_i))      # [2 * hidden]
    h_i = fc(aux_i)          for a position the target computed (aux_i: its three features)
    h_i = g_{i-1}            for a drafted position (the head's own pre-norm output before it)
    g_i = layer(x_i) + residual; logits_i = lm_head(norm(g_i)) -> a guess at t_{i+2}

A request with tokens t_0..t_{n-1} comes to ``propose`` with the target's K/V (and aux) for
positions 0..n-2. The head *catches up* over positions [its computed count, n - 1) with target
features (the last of them, n - 2, pairs aux_{n-2} with the last token t_{n-1} and drafts t_n),
then drafts t_{n+1}, ... one position at a time feeding back its own g. Of the catch-up rows only
the K/V matter, except for the last, so only the last runs the layer past its K/V write. Catch-up
positions are final (their inputs are verified tokens and target features); drafted positions'
K/V are overwritten by the next catch-up, which starts at n - 1.

Prefix caching: a block shared by two requests holds the same aux (it depends on the tokens up to
the position only), but the head's K/V at a block's last position pairs it with the next token,
which the two requests may not share; the later catch-up wins. Drafts may then be a little worse
for the other request; outputs never change (verification is lossless).

Greedy drafts only (argmax over the draft vocabulary, mapped to target ids by d2t): see
runtime/speculative.py for why that keeps every sampling mode exact.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from pagecast.kernels import ops
from pagecast.kernels.rope import cos_sin_cache
from pagecast.runtime.eagle3_head import Eagle3Head, Eagle3HeadConfig, read_eagle3_head
from pagecast.runtime.loader import zeros_kv_cache
from pagecast.runtime.request import Request
from pagecast.runtime.speculative import SpeculativeConfig, resolve_model_path

MAX_DRAFTS = 16  # SpeculativeConfig's bound on num_speculative_tokens: the rope table's headroom
# Catch-up positions per request per head pass: a long prompt's first catch-up (its features
# gathered at 3 * hidden per position, and the layer's activations) runs in chunks of this many.
CATCH_UP_CHUNK = 1024


class Eagle3Proposer:
    """Drafts with an EAGLE-3 head for the target artifact ``core.artifact``.

    Construction loads the head (either layout: runtime/eagle3_head.py) in the target's dtype on
    its device; the engine then reads ``kv_bytes_per_block`` before sizing the KV cache and calls
    ``bind_kv_cache(num_blocks)``, which allocates the head's KV cache and the aux buffer and binds
    the buffer into the target model. Bind before CUDA graphs are captured (a graph captured
    earlier does not copy the features). tp 1 only."""

    def __init__(self, config: SpeculativeConfig, core: Any):
        artifact = core.artifact
        if int(artifact.manifest.tp) != 1:
            raise ValueError(
                "speculative_config method eagle3 runs with tp 1 only (this artifact has tp "
                f"{artifact.manifest.tp})"
            )
        self.target = artifact.model
        if not hasattr(self.target, "bind_aux_hidden_states"):
            raise ValueError(
                f"the artifact {artifact.path} was built before EAGLE-3 support (its model.py cannot hand "
                "the head its hidden states): rebuild it with this pagecast's enginebuild"
            )
        path = resolve_model_path(config, artifact.path)
        head = read_eagle3_head(path, artifact.manifest.dims)
        self.config: Eagle3HeadConfig = head.config
        self.device: torch.device = artifact.device
        self.dtype: torch.dtype = artifact.dtype
        self.block_size = int(core.block_size)
        self._load(head)
        rope = self.config.rope or _target_rope(self.target)
        if rope is None:
            raise ValueError(
                f"EAGLE-3 head {path} names no rope parameters and the target has more than one rotary "
                "table: add rope_theta (and rope_scaling) to the head's config.json"
            )
        max_positions = int(core.max_model_len) + MAX_DRAFTS
        self.cos_sin_cache = cos_sin_cache(rope, self.config.head_dim, max_positions).to(self.device)
        c = self.config
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        # Per KV block: the head's K and V, and the target's features at each of its slots.
        self.kv_bytes_per_block = (
            self.block_size
            * itemsize
            * (2 * c.num_kv_heads * c.head_dim + len(c.aux_layer_ids) * c.target_hidden_size)
        )
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None
        self.aux: torch.Tensor | None = None
        # request id -> positions whose head K/V holds final (target-fed) values.
        self.num_computed: dict[str, int] = {}

    def _load(self, head: Eagle3Head) -> None:
        w = {k: v.to(self.device, self.dtype) for k, v in head.weights.items() if k != "d2t"}
        p = "midlayer."
        self.fc = w["fc.weight"]
        self.input_norm = w[p + "input_layernorm.weight"]
        self.hidden_norm = w[p + "hidden_norm.weight"]
        self.post_attn_norm = w[p + "post_attention_layernorm.weight"]
        self.w_qkv = torch.cat([w[p + f"self_attn.{x}_proj.weight"] for x in "qkv"])
        self.w_o = w[p + "self_attn.o_proj.weight"]
        self.w_gate_up = torch.cat([w[p + "mlp.gate_proj.weight"], w[p + "mlp.up_proj.weight"]])
        self.w_down = w[p + "mlp.down_proj.weight"]
        self.norm = w["norm.weight"]
        self.lm_head = w["lm_head.weight"]
        self.embed_tokens = (
            w["embed_tokens.weight"] if self.config.has_embedding else self.target.embed_tokens
        )
        self.draft_to_target = (torch.arange(self.config.draft_vocab_size) + head.weights["d2t"].long()).to(
            self.device
        )

    def bind_kv_cache(self, num_blocks: int) -> None:
        """Allocate the head's KV cache ([num_blocks, kv_heads, block_size, head_dim] each for K
        and V, indexed by the target's block ids) and the aux buffer, and bind the buffer into
        the target model."""
        c = self.config
        shape = (2, num_blocks, c.num_kv_heads, self.block_size, c.head_dim)
        kv = zeros_kv_cache(shape, self.dtype, self.device)
        self.k_cache, self.v_cache = kv[0], kv[1]
        num_slots = num_blocks * self.block_size
        self.aux = zeros_kv_cache(
            (len(c.aux_layer_ids), num_slots + 1, c.target_hidden_size), self.dtype, self.device
        )
        self.target.bind_aux_hidden_states(self.aux, list(c.aux_layer_ids))
        self.num_computed.clear()

    def drop(self, request_ids: set[str]) -> None:
        for rid in request_ids:
            self.num_computed.pop(rid, None)

    @torch.inference_mode()
    def propose(self, requests: list[Request], num_drafts: list[int]) -> list[list[int]]:
        if self.aux is None:
            raise RuntimeError("Eagle3Proposer.propose before bind_kv_cache")
        out: list[list[int]] = [[] for _ in requests]
        active = [i for i, k in enumerate(num_drafts) if k > 0]
        if not active:
            return out
        batch = [requests[i] for i in active]
        block_tables = self._block_tables(batch)
        # Catch-up over positions [start, n - 1) of each request, fed by the target's features.
        # The row at n - 2 (always included) pairs aux_{n-2} with the last token: the first draft.
        spans = []
        for r in batch:
            n = r.num_tokens
            spans.append((min(self.num_computed.get(r.request_id, 0), n - 2), n - 1))
            self.num_computed[r.request_id] = n - 1
        hidden, first = self._catch_up(batch, spans, block_tables)
        for j, i in enumerate(active):
            out[i].append(first[j])
        # Draft steps: one row per request that wants more, at the position after its last row,
        # fed by its last draft and its last row's pre-norm output.
        for step in range(1, max(num_drafts)):
            rows = [j for j, i in enumerate(active) if num_drafts[i] > step]
            index = torch.tensor(rows, device=self.device)
            lens = [spans[j][1] + step for j in rows]  # the context: up to and including this row
            pos = torch.tensor([n - 1 for n in lens], dtype=torch.int64, device=self.device)
            tables = block_tables[index]
            slots = self._slots(pos, tables, torch.ones(len(rows), dtype=torch.int64))
            q, residual = self._write_kv([out[active[j]][-1] for j in rows], hidden[index], pos, slots)
            new_hidden, drafts = self._draft(q, residual, tables, lens)
            hidden[index] = new_hidden
            for j, token in zip(rows, drafts):
                out[active[j]].append(token)
        return out

    def _catch_up(
        self, batch: list[Request], spans: list[tuple[int, int]], block_tables: torch.Tensor
    ) -> tuple[torch.Tensor, list[int]]:
        """The head over positions [start, end) of each request: K/V for every row, CATCH_UP_CHUNK
        rows per request at a time (a long prompt's features and activations stay bounded), and
        the rest of the layer only for each request's last row; returns that row's pre-norm
        output ([len(batch), hidden]) and its draft."""
        hidden = torch.empty((len(batch), self.config.hidden_size), dtype=self.dtype, device=self.device)
        drafts = [0] * len(batch)
        done = [s for s, _ in spans]
        while True:
            todo = [j for j, (_, end) in enumerate(spans) if done[j] < end]
            if not todo:
                return hidden, drafts
            positions: list[int] = []
            tokens: list[int] = []
            counts: list[int] = []
            finishing: list[int] = []  # requests whose last row is in this round
            last_rows: list[int] = []  # and that row's index among this round's rows
            for j in todo:
                a, b = done[j], min(done[j] + CATCH_UP_CHUNK, spans[j][1])
                positions.extend(range(a, b))
                tokens.extend(batch[j].all_token_ids[a + 1 : b + 1])
                counts.append(b - a)
                if b == spans[j][1]:
                    finishing.append(j)
                    last_rows.append(len(positions) - 1)
                done[j] = b
            pos = torch.tensor(positions, dtype=torch.int64, device=self.device)
            slots = self._slots(
                pos, block_tables[torch.tensor(todo, device=self.device)], torch.tensor(counts)
            )
            assert self.aux is not None
            aux = self.aux[:, slots].transpose(0, 1).reshape(len(positions), -1)  # [rows, 3 * target hidden]
            q, residual = self._write_kv(tokens, F.linear(aux, self.fc), pos, slots)
            if finishing:
                rows = torch.tensor(last_rows, device=self.device)
                index = torch.tensor(finishing, device=self.device)
                lens = [spans[j][1] for j in finishing]
                hidden[index], out = self._draft(q[rows], residual[rows], block_tables[index], lens)
                for j, token in zip(finishing, out):
                    drafts[j] = token

    def _block_tables(self, requests: list[Request]) -> torch.Tensor:
        width = max(len(r.block_ids) for r in requests)
        table = torch.zeros((len(requests), width), dtype=torch.int32)
        for i, r in enumerate(requests):
            table[i, : len(r.block_ids)] = torch.tensor(r.block_ids, dtype=torch.int32)
        return table.to(self.device)

    def _slots(
        self, positions: torch.Tensor, block_tables: torch.Tensor, counts: torch.Tensor
    ) -> torch.Tensor:
        """The cache slot of each row's position; the first counts[0] rows are block_tables[0]'s
        sequence's, the next counts[1] the next one's, and so on."""
        seq = torch.repeat_interleave(torch.arange(counts.numel()), counts).to(self.device)
        blocks = block_tables[seq, positions // self.block_size].long()
        return blocks * self.block_size + positions % self.block_size

    def _write_kv(
        self, tokens: list[int], hidden: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer up to its attention for a flat batch of rows (token, feature, position): their
        K/V written at ``slots``; returns their rotated queries and the residual stream."""
        c = self.config
        ids = torch.tensor(tokens, dtype=torch.int64, device=self.device)
        embeds = ops.rms_norm(F.embedding(ids, self.embed_tokens), self.input_norm, c.rms_norm_eps)
        if c.norm_before_residual:
            hidden = ops.rms_norm(hidden, self.hidden_norm, c.rms_norm_eps)
            residual = hidden
        else:
            residual = hidden
            hidden = ops.rms_norm(hidden, self.hidden_norm, c.rms_norm_eps)
        qkv = F.linear(torch.cat([embeds, hidden], dim=-1), self.w_qkv)
        q_size, kv_size = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        assert self.k_cache is not None and self.v_cache is not None
        q = ops.rotary_and_write_kv(
            positions, q.reshape(-1, c.num_heads, c.head_dim), k.reshape(-1, c.num_kv_heads, c.head_dim),
            v.reshape(-1, c.num_kv_heads, c.head_dim), self.cos_sin_cache, self.k_cache, self.v_cache, slots,
        )  # fmt: skip
        return q, residual

    def _draft(
        self, q: torch.Tensor, residual: torch.Tensor, block_tables: torch.Tensor, seq_lens: list[int]
    ) -> tuple[torch.Tensor, list[int]]:
        """The rest of the layer for one row per sequence (its last; K/V of the sequence's first
        seq_lens[i] positions in the cache): the rows' pre-norm outputs and greedy drafts, as
        target ids."""
        c = self.config
        n = len(seq_lens)
        lens = torch.tensor(seq_lens, dtype=torch.int32, device=self.device)
        starts = torch.arange(n + 1, dtype=torch.int32, device=self.device)
        attn = ops.paged_attention(
            q, self.k_cache, self.v_cache, block_tables, lens, starts, c.head_dim**-0.5, 1, max(seq_lens)
        )  # fmt: skip
        o = F.linear(attn.reshape(n, -1), self.w_o)
        x, residual = ops.fused_add_rms_norm(o, residual, self.post_attn_norm, c.rms_norm_eps)
        mlp = F.linear(ops.silu_and_mul(F.linear(x, self.w_gate_up)), self.w_down)
        normed, prenorm = ops.fused_add_rms_norm(mlp, residual, self.norm, c.rms_norm_eps)
        best = F.linear(normed, self.lm_head).argmax(dim=-1)
        return prenorm, self.draft_to_target[best].tolist()


def _target_rope(model: Any) -> dict[str, Any] | None:
    """The target's rotary parameters from its generated module (``ROPE``, where it has one
    table for every layer); None otherwise."""
    return type(model).__init__.__globals__.get("ROPE")  # type: ignore[no-any-return]
