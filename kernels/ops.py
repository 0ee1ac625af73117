"""The kernel entry points the generated model code calls.

Each op runs the Triton kernel when its tensors are on a CUDA device (with the launch
config from the artifact's tuning table, or the launcher's own default for a shape bucket
the table lacks) and the pure-torch reference otherwise. The dispatch is a bucket bisect
and a dict lookup per call; the launchers never sync with the host, so decode steps can be
captured in CUDA graphs. Triton is imported only on the first CUDA call, so the CPU
runtime does not need it.
"""

from __future__ import annotations

import functools
import os
from types import SimpleNamespace
from typing import Any

import torch

from pagecast.kernels import pdl, reference
from pagecast.kernels.quant_linear import (
    Fp8ExpertsWeight,
    Fp8LinearWeight,
    Int4ExpertsWeight,
    Int4LinearWeight,
)
from pagecast.kernels.tuning import (
    SKINNY_ROW_BUCKETS,
    KernelConfig,
    decode_bucket,
    decode_fallback_buckets,
    fp8_bucket,
    lookup,
    prefill_bucket,
    skinny_bucket,
    table_entry,
    token_bucket,
    w4a16_bucket,
)


class KernelTable:
    """One engine's kernel configuration: its artifact's tuning table (kernel name -> shape
    bucket -> launch config) and whether Triton runs at all (not for CPU artifacts). Engines
    in one process each keep their own table and ``activate`` it around their forward passes
    (and their CUDA-graph captures, which freeze the configs in force)."""

    def __init__(self, tuning: dict[str, Any] | None = None, use_triton: bool = True, pdl: bool = False):
        self.tuning = dict(tuning or {})
        self.use_triton = use_triton
        # Launch the decode kernels with programmatic dependent launch (kernels/pdl.py): the
        # artifact's table says whether it was built so (its Triton cache holds those variants).
        self.pdl = pdl and use_triton
        self.configs: dict[tuple[str, str], KernelConfig | None] = {}
        # Tensor parallelism of the engine (set by runtime.parallel): its collectives run only
        # while its table is active, so a one-rank engine beside it in the process runs none.
        self.tp_rank = 0
        self.tp_size = 1
        self.tp_symm: tuple[torch.Tensor, str] | None = None  # (symmetric buffer, group name) or NCCL only


_active = KernelTable()


def configure(tuning: dict[str, Any] | None = None, use_triton: bool = True, pdl: bool = False) -> KernelTable:
    """Make and activate a table; ``use_triton=False`` forces the torch reference; ``pdl``: the
    artifact was built with programmatic dependent launch (tuning.json's "pdl").

    ``tuning`` is the whole tuning.json ({"kernels": {...}, ...}) or its "kernels" part.
    """
    table = KernelTable(tuning, use_triton, pdl)
    activate(table)
    return table


def activate(table: KernelTable) -> None:
    """Use ``table`` for the ops called from now on (the model runner calls this before every
    forward pass, so two engines in one process never use each other's configs)."""
    global _active
    _active = table
    pdl.set_enabled(table.pdl)


def _triton(x: torch.Tensor) -> bool:
    return _active.use_triton and x.is_cuda


def _config(kernel: str, bucket: str) -> KernelConfig | None:
    key = (kernel, bucket)
    table = _active
    try:
        return table.configs[key]
    except KeyError:
        found = lookup(table.tuning, kernel, bucket)
        if found is None and kernel == "paged_decode_attention":
            found = next(
                (c for b in decode_fallback_buckets(bucket) if (c := lookup(table.tuning, kernel, b)) is not None),
                None,
            )
        if found is None and kernel == "paged_prefill_attention" and "." in bucket:
            found = lookup(table.tuning, kernel, bucket.split(".")[0])  # a table from before its context buckets
        cfg = table.configs[key] = KernelConfig.coerce(found)
        return cfg


def decode_attention_config(num_seqs: int, max_seq_len: int) -> KernelConfig | None:
    """The decode-attention launch config the active table picks for this batch and context
    (None: the launcher's default). Decode CUDA graphs whose configs agree are one graph."""
    return _config("paged_decode_attention", decode_bucket(num_seqs, max_seq_len))


@functools.cache
def _kernels() -> SimpleNamespace:
    from pagecast.kernels import (
        activation,
        fp8_gemm,
        paged_decode_attention,
        paged_prefill_attention,
        rms_norm,
        rotary_kv,
        skinny_gemm,
        w4a16_gemm,
        w4a16_tcgemv,
    )

    return SimpleNamespace(
        skinny_gemm=skinny_gemm.skinny_gemm,
        fp8_linear=fp8_gemm.fp8_linear,
        fp8_quantises_apart=fp8_gemm.quantises_apart,
        fp8_gemm_quantised=fp8_gemm.fp8_gemm_quantised,
        fp8_skinny_norm_linear=fp8_gemm.fp8_skinny_norm_linear,
        rms_norm_fp8=rms_norm.rms_norm_fp8,
        fp8_act_and_mul_linear=fp8_gemm.fp8_act_and_mul_linear,
        w4a16_gemm=w4a16_gemm.w4a16_gemm,
        w4a16_silu_and_mul_gemm=w4a16_gemm.w4a16_silu_and_mul_gemm,
        fuses_silu_and_mul=w4a16_tcgemv.fuses_silu_and_mul,
        decode=paged_decode_attention.paged_decode_attention,
        prefill=paged_prefill_attention.paged_prefill_attention,
        rotary=rotary_kv.rotary_and_write_kv,
        rms_norm=rms_norm.rms_norm,
        fused_add_rms_norm=rms_norm.fused_add_rms_norm,
        silu_and_mul=activation.silu_and_mul,
        gelu_tanh_and_mul=activation.gelu_tanh_and_mul,
    )


def linear(
    x: torch.Tensor, weight: torch.Tensor | Int4LinearWeight | Fp8LinearWeight, bias: torch.Tensor | None, projection: str
) -> torch.Tensor:
    """A layer's projection (qkv, o, gate_up, down): F.linear, except for decode batches of up
    to 16 rows where the tuning table chose the skinny GEMM kernel for this projection (the
    launcher itself falls back to F.linear for other batches and for the table's torch choice).
    An int4 weight (quant_linear.Int4Linear) runs the W4A16 GEMM with the table's config for
    this projection and row bucket (dequantize + cuBLAS where that won). An FP8 weight
    (quant_linear.Fp8Linear) quantises x and runs the FP8 GEMM, or torch._scaled_mm where the
    table chose it; on the CPU the exact emulation (reference.fp8_linear)."""
    if isinstance(weight, Int4LinearWeight):
        return _int4_linear(x, weight, bias, projection)
    if isinstance(weight, Fp8LinearWeight):
        return _fp8_linear(x, weight, bias, projection)
    if not _triton(x) or x.shape[0] > SKINNY_ROW_BUCKETS[-1]:
        return reference.linear(x, weight, bias)
    cfg = _config("skinny_gemm", skinny_bucket(projection, x.shape[0]))
    return _kernels().skinny_gemm(x, weight, bias, cfg)  # type: ignore[no-any-return]


def _int4_linear(x: torch.Tensor, w: Int4LinearWeight, bias: torch.Tensor | None, projection: str) -> torch.Tensor:
    if not _triton(x):
        xp = x if w.perm is None else x.index_select(-1, w.perm.long())
        return reference.linear(xp, w.dense(x.dtype), bias)
    cfg = _config("w4a16_gemm", w4a16_bucket(projection, x.shape[0]))
    return _kernels().w4a16_gemm(x, w.qweight, w.scales, w.zeros, w.perm, w.group_size, bias, cfg)  # type: ignore[no-any-return]


def _fp8_linear(x: torch.Tensor, w: Fp8LinearWeight, bias: torch.Tensor | None, projection: str) -> torch.Tensor:
    if not _triton(x):
        return reference.fp8_linear(x, w.weight, w.weight_scale, w.activations, w.input_scale, bias, w.as_float())
    cfg = _config("fp8_gemm", fp8_bucket(projection, x.shape[0]))
    return _kernels().fp8_linear(x, w, bias, cfg)  # type: ignore[no-any-return]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension; x may have extra leading dims. (Per-head q/k norms run
    inside rotary_and_write_kv.)"""
    if not _triton(x):
        return reference.rms_norm(x, weight, eps)
    rows = x.reshape(-1, x.shape[-1])
    out = _kernels().rms_norm(rows, weight, eps, _config("rms_norm", token_bucket(rows.shape[0])))
    return out.view(x.shape)  # type: ignore[no-any-return]


def sharded_projection_norms(
    q: torch.Tensor, k: torch.Tensor, q_norm: torch.Tensor, k_norm: torch.Tensor, eps: float,
    q_width: int, k_width: int, kv_head_replicas: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """``rms_norm`` of q and of k over their whole projections (``q_width`` and ``k_width`` wide)
    when this rank holds only its heads' columns (q [T, q_width / tp], k [T, its KV heads], norm
    weights cut alike): each row's sums of squares are summed over the ranks in one all-reduce,
    a KV head held by ``kv_head_replicas`` ranks counted once. Torch ops on every device: two
    small row-wise passes and a [T, 2] all-reduce a layer."""
    qf, kf = q.float(), k.float()
    sums = torch.stack((qf.pow(2).sum(-1), kf.pow(2).sum(-1) / kv_head_replicas), dim=-1)
    all_reduce(sums)
    q = q_norm * (qf * torch.rsqrt(sums[:, :1] / q_width + eps)).to(q.dtype)
    k = k_norm * (kf * torch.rsqrt(sums[:, 1:] / k_width + eps)).to(k.dtype)
    return q, k


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    if not _triton(x):
        return reference.fused_add_rms_norm(x, residual, weight, eps)
    cfg = _config("fused_add_rms_norm", token_bucket(x.shape[0]))
    return _kernels().fused_add_rms_norm(x, residual, weight, eps, cfg)  # type: ignore[no-any-return]


def norm_linear(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor | Int4LinearWeight | Fp8LinearWeight,
    bias: torch.Tensor | None,
    projection: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's norm and the column-parallel projection it feeds (qkv, gate_up): x joins the
    residual stream (``residual`` None: x is the stream), is RMS-normalised and projected. Returns
    (the projection's output, the stream). An FP8 projection that would quantise its input in a
    launch of its own (fp8_gemm.quantises_apart) gets it quantised by the norm's launch
    (rms_norm.rms_norm_fp8: the same bits, no [rows, hidden] normalised rows in memory); one that
    quantises inside its own launch (the fused decode kernel, up to 16 rows) normalises there too
    (fp8_gemm.fp8_skinny_norm_linear: no norm launch), unless the tuner found the norm's own launch
    faster at this bucket (``_feed_apart``)."""
    if isinstance(weight, Fp8LinearWeight) and _triton(x) and not _feed_apart(bucket := fp8_bucket(projection, x.shape[0])):
        cfg = _config("fp8_gemm", bucket)
        kernels = _kernels()
        apart = kernels.fp8_quantises_apart(x.shape[0], x.shape[1], weight, x.dtype, cfg)
        if apart and FUSE_ACT_QUANT_FP8:
            bucket = token_bucket(x.shape[0])
            norm_cfg = _config("rms_norm" if residual is None else "fused_add_rms_norm", bucket)
            qx, sx, stream = kernels.rms_norm_fp8(x, residual, norm_weight, eps, weight.activations, weight.input_scale, norm_cfg)
            return kernels.fp8_gemm_quantised(qx, sx, weight, bias, x.dtype, cfg), stream
        if not apart and FUSE_NORM_DECODE:
            return kernels.fp8_skinny_norm_linear(x, residual, norm_weight, eps, weight, bias, cfg)  # type: ignore[no-any-return]
    if residual is None:
        normed, stream = rms_norm(x, norm_weight, eps), x
    else:
        normed, stream = fused_add_rms_norm(x, residual, norm_weight, eps)
    return linear(normed, weight, bias, projection), stream


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    if not _triton(x):
        return reference.silu_and_mul(x)
    return _kernels().silu_and_mul(x, _config("silu_and_mul", token_bucket(x.shape[0])))  # type: ignore[no-any-return]


def act_and_mul(x: torch.Tensor, activation: str) -> torch.Tensor:
    """The gated MLP's activation on the fused gate_up: act(gate) * up for "silu", "gelu_tanh"
    (Gemma) or "gelu" (exact erf GELU: the torch reference, no kernel of its own yet)."""
    if activation == "silu":
        return silu_and_mul(x)
    if activation == "gelu_tanh" and _triton(x):
        # the SiLU kernel's configs suit it (same loads and stores); both run under the "silu_and_mul" table key
        return _kernels().gelu_tanh_and_mul(x, _config("silu_and_mul", token_bucket(x.shape[0])))  # type: ignore[no-any-return]
    return reference.ACTIVATIONS[activation](x)


def rotary_and_write_kv(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    q_norm: torch.Tensor | None = None,
    k_norm: torch.Tensor | None = None,
    qk_norm_eps: float = 0.0,
    qk_norm_after: bool = False,
) -> torch.Tensor:
    """Rotary on q and k, this step's K/V written to the cache (fp8 caches: x / scale, saturated).
    With ``q_norm`` / ``k_norm`` ([head_dim]), each q and k head is RMS-normalised first (Qwen3's
    and Gemma 3's per-head norms), in the same launch on a GPU (kernel ABI 2); with
    ``qk_norm_after`` once rotated instead (HunYuan's; kernel ABI 9)."""
    if not _triton(q):
        if q_norm is not None and qk_norm_after:
            q, k = reference.rotary_embedding(positions, q, k, cos_sin_cache)
            q, k = reference.rms_norm(q, q_norm, qk_norm_eps), reference.rms_norm(k, k_norm, qk_norm_eps)
            reference.write_kv(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
            return q
        if q_norm is not None:
            q, k = reference.rms_norm(q, q_norm, qk_norm_eps), reference.rms_norm(k, k_norm, qk_norm_eps)
        return reference.rotary_and_write_kv(
            positions, q, k, v, cos_sin_cache, k_cache, v_cache, slot_mapping, k_scale, v_scale
        )
    cfg = _config("rotary_kv", token_bucket(q.shape[0]))
    return _kernels().rotary(  # type: ignore[no-any-return]
        positions, q, k, v, cos_sin_cache, k_cache, v_cache, slot_mapping, cfg, k_scale=k_scale, v_scale=v_scale,
        q_norm=q_norm, k_norm=k_norm, qk_norm_eps=qk_norm_eps, qk_norm_after=qk_norm_after,
    )  # fmt: skip


def prefetch_to_l2(num_rows: int, *weights: Any) -> None:
    """Kernel ABI 5's L2 prefetch of the o projection, removed (it was no faster end to end):
    artifacts built at ABI 5 still call it, and it does nothing."""


def join_prefetch() -> None:
    """The other half of ABI 5's removed prefetch (``prefetch_to_l2``): does nothing."""


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    max_query_len: int,
    max_seq_len: int,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    num_decodes: int = 0,
    softcap: float = 0.0,
    window: int = 0,
    sinks: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    chunk: int = 0,
) -> torch.Tensor:
    """Decode batches (max_query_len == 1) take the split-context decode kernel; prefill and
    chunked prefill the prefill kernel. A mixed batch whose first ``num_decodes`` sequences have
    one query token each may run them through the decode kernel and the rest through the prefill
    kernel (from MIN_SPLIT_DECODES of them: see there); else the prefill kernel takes every
    row. An fp8 cache is read as fp8 * k_scale / v_scale. ``softcap`` > 0 soft-caps the scores
    (Gemma 2), ``window`` > 0 is the layer's sliding window, ``sinks`` [num_heads] gpt-oss's
    per-head sink logits (each adds exp(sink) to its head's softmax denominator): both kernels
    take them on a GPU (the decode kernel adds each once, in its merge of the splits), the
    reference on the CPU. ``out`` (q's shape and dtype): written instead of a new tensor.
    ``chunk`` > 0 (kernel ABI 10) is the layer's attention chunk (Llama 4): a query at position p
    sees the keys p // chunk * chunk..p, its own chunk's, only."""
    if not _triton(q):
        result = reference.paged_attention(
            q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, k_scale, v_scale, softcap, window,
            sinks, chunk,
        )  # fmt: skip
        return result if out is None else out.copy_(result)
    split = num_decodes - num_decodes % SPLIT_ALIGN
    if max_query_len > 1 and MIN_SPLIT_DECODES is not None and MIN_SPLIT_DECODES <= split < seq_lens.shape[0]:
        return decodes_then_prefill(
            q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, max_seq_len, split,
            k_scale, v_scale, softcap, window, sinks, out, chunk,
        )  # fmt: skip
    if max_query_len == 1:
        cfg = _config("paged_decode_attention", decode_bucket(seq_lens.shape[0], max_seq_len))
        return _kernels().decode(  # type: ignore[no-any-return]
            q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, max_seq_len, cfg, out=out,
            k_scale=k_scale, v_scale=v_scale, softcap=softcap, window=window, sinks=sinks, chunk=chunk,
        )  # fmt: skip
    cfg = _config("paged_prefill_attention", prefill_bucket(q.shape[0], max_seq_len))
    return _kernels().prefill(  # type: ignore[no-any-return]
        q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, cfg, out=out, k_scale=k_scale,
        v_scale=v_scale, softcap=softcap, window=window, sinks=sinks, chunk=chunk,
    )


# A mixed step's decode rows through the prefill kernel cost it more than the decode kernel does:
# one H200, Llama-3-8B attention, each kernel at its best config (benchmarks/mixed_attention.py,
# benchmarks/RESULTS.md), 1000 decodes at 600 tokens + 14 prompts of 512 took 1002 us in the prefill
# kernel against 537 us split with an fp8 cache (878 against 742 bf16); at 64 decodes 250 against
# 215 fp8, 207 against 213 bf16 (the split's second launch is not free).
#
# End to end the split as first merged (at exactly num_decodes, threshold 64) made W1 slower: fp8
# KV, one H200, the same artifact in the same run, 9,207 output tok/s split against 11,443 not
# (benchmarks/RESULTS.md, ninth session). The prefill kernel's seq_lens[d:] is 16-byte aligned
# only when d is a multiple of 4, and Triton specializes pointer arguments on that alignment, so
# most mixed steps launched a variant the artifact's triton_cache (compiled from aligned tensors)
# did not hold, compiled while serving. The split point is rounded down to a multiple of
# SPLIT_ALIGN so every sliced argument stays aligned (the few decodes past it go to the prefill
# kernel). Measured so (benchmarks/kvcache.py --split-decodes 64, one H200, same artifacts, tenth
# session): fp8 W1 11,928 against 11,523 without the split, bf16 10,992 against 10,903; W6 equal
# (24,312 / 24,324 fp8); no kernel compiled while serving in any of them.
MIN_SPLIT_DECODES: int | None = 64
SPLIT_ALIGN = 16


def decodes_then_prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    max_seq_len: int,
    num_decodes: int,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    softcap: float = 0.0,
    window: int = 0,
    sinks: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    chunk: int = 0,
) -> torch.Tensor:
    """Attention of a mixed batch whose first ``num_decodes`` sequences have one query token each
    (query rows 0..num_decodes - 1): the decode kernel over those, the prefill kernel over the
    rest, into one output (``out`` when given)."""
    d = num_decodes
    out = torch.empty_like(q) if out is None else out
    kernels = _kernels()
    kernels.decode(
        q[:d], k_cache, v_cache, block_tables[:d], seq_lens[:d], query_start_loc[: d + 1], scale, max_seq_len,
        _config("paged_decode_attention", decode_bucket(d, max_seq_len)), out=out[:d],
        k_scale=k_scale, v_scale=v_scale, softcap=softcap, window=window, sinks=sinks, chunk=chunk,
    )  # fmt: skip
    kernels.prefill(
        q[d:], k_cache, v_cache, block_tables[d:], seq_lens[d:], query_start_loc[d:] - d, scale,
        _config("paged_prefill_attention", prefill_bucket(q.shape[0] - d, max_seq_len)), out=out[d:],
        k_scale=k_scale, v_scale=v_scale, softcap=softcap, window=window, sinks=sinks, chunk=chunk,
    )  # fmt: skip
    return out


# -- tensor parallelism ------------------------------------------------------------------------
# The layers of a tensor-parallel model (STYLE 17): each holds its own shard (the builder cut
# it) and does its collective here, so the generated model reads the same at any degree. With
# one rank (the default) every collective is skipped.


def active() -> KernelTable:
    """The table in force (a runner without a table of its own runs under it)."""
    return _active


def set_tensor_parallel(
    table: KernelTable, rank: int, size: int, symmetric: tuple[torch.Tensor, str] | None = None
) -> None:
    """Make ``table``'s engine rank ``rank`` of ``size`` (the default torch.distributed group);
    ``symmetric``: a symmetric-memory buffer and its group for small all-reduces (runtime.parallel)."""
    table.tp_rank, table.tp_size, table.tp_symm = rank, size, symmetric


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum ``x`` over the ranks, in place (NCCL's all-reduce is captured in decode CUDA graphs)."""
    if _active.tp_size > 1:
        symm = _active.tp_symm
        if symm is not None and x.dtype == symm[0].dtype and x.numel() <= symm[0].numel() and x.is_contiguous():
            # One-shot: each rank stages its part in its symmetric buffer and sums every peer's.
            staged = symm[0][: x.numel()]
            staged.copy_(x.view(-1))
            torch.ops.symm_mem.one_shot_all_reduce_out(staged, "sum", symm[1], x.view(-1))
            return x
        import torch.distributed as dist

        dist.all_reduce(x)
    return x


def row_parallel_linear(
    x: torch.Tensor,
    weight: torch.Tensor | Int4LinearWeight | Fp8LinearWeight,
    bias: torch.Tensor | None,
    projection: str,
    silu_and_mul_first: bool = False,
    activation: str = "silu",
) -> torch.Tensor:
    """o_proj / down_proj: each rank multiplies its input columns; the partial sums are
    all-reduced and the (whole, replicated) bias is added once, after the sum.
    ``silu_and_mul_first``: x is gate_up [rows, 2 * d] and the projection's input act(gate) * up,
    act being ``activation`` (act_and_mul; the name says SiLU, the default, for older callers)."""
    if _active.tp_size == 1:
        return _linear_of(x, weight, bias, projection, silu_and_mul_first, activation)
    out = all_reduce(_linear_of(x, weight, None, projection, silu_and_mul_first, activation))
    return out if bias is None else out + bias


# silu_and_mul folded into the int4 down projection's decode kernel (it computes the activation as
# it loads x: one launch and no [rows, d] intermediate a layer) where the table's config for the
# bucket allows it (w4a16_tcgemv.fuses_silu_and_mul); the values are the unfused ones either way.
# The tuner times the down buckets the same way (kernels/problems.py) and marks their entries
# "fused_silu", so the fused kernels are in the artifact; an entry without the mark (written
# before, or tuned with this off) keeps the kernels it was tuned and compiled with. On an H200,
# AWQ-G128 Llama-3-8B W4: 2.676 ms against 2.724 without (same artifact and run, eleventh session).
FUSE_SILU_DOWN = True

# The per-token (or group, or static) quantisation of an FP8 projection's input inside the launch
# that makes the input, where the projection would quantise in a launch of its own (more than 16
# rows, or a tile config): the gated activation before down (fp8_gemm.fp8_act_and_mul_linear) and
# the norm before qkv and gate_up (norm_linear); the same bits as the two launches
# (tests/test_fp8_kernels.py). Up to 16 rows under a SKINNY config, down's fused decode kernel
# (which quantises its input itself) activates it on the way in instead: no activation launch, the
# same bits. PAGECAST_FUSE_ACT_QUANT_FP8=0 in a serving process turns it off, for the
# same-artifact comparison (benchmarks/gpu_queue.py; on an H100 with the norm's below, W4 4.062 ms
# on and 4.053 off: no gain and no loss, benchmarks/RESULTS.md, twenty-ninth session).
FUSE_ACT_QUANT_FP8 = os.environ.get("PAGECAST_FUSE_ACT_QUANT_FP8", "1") != "0"
# The RMSNorm (and the residual add before it) inside the fused FP8 decode kernel that quantises
# its output, up to 16 rows (norm_linear, fp8_gemm.fp8_skinny_norm_linear): one launch a layer's
# qkv and gate_up instead of two. (The half-type skinny kernel with the norm inside, tried in the
# twenty-eighth session, held 200-255 registers and spilled, against 40-80 without: not built.)
# PAGECAST_FUSE_NORM_DECODE=0 in a serving process turns it off, for the same-artifact comparison
# (benchmarks/gpu_queue.py; timed with the activation's above).
FUSE_NORM_DECODE = os.environ.get("PAGECAST_FUSE_NORM_DECODE", "1") != "0"
# The tuner's "feed_apart" marks (_feed_apart) followed; PAGECAST_FEED_APART=0 in a serving process
# ignores them, every bucket fused as above, for the same-artifact comparison (benchmarks/gpu_queue.py).
FEED_APART = os.environ.get("PAGECAST_FEED_APART", "1") != "0"


def _feed_apart(bucket: str) -> bool:
    """Whether the tuner timed this FP8 bucket faster with its input made (normalised, activated) in
    a launch of its own than inside the fused decode kernel (the entry's "feed_apart" mark,
    kernels/tuning.py): on an H100 the down projection's activation inside the one-row kernel cost
    1.7 us over its own launch (29.86 against 28.14 us), qkv's norm saved 0.8 (benchmarks/RESULTS.md,
    thirtieth session). Its kernels are in the artifact either way (tuning.compile_fp8_input_variants)."""
    return FEED_APART and _marked("fp8_gemm", bucket, "feed_apart")


def _marked(kernel: str, bucket: str, mark: str) -> bool:
    """Whether the active table's (kernel, bucket) entry carries ``mark`` (how the tuner timed it)."""
    return bool((table_entry(_active.tuning, kernel, bucket) or {}).get(mark, False))


def _linear_of(
    x: torch.Tensor,
    weight: torch.Tensor | Int4LinearWeight | Fp8LinearWeight,
    bias: torch.Tensor | None,
    projection: str,
    silu_and_mul_first: bool,
    activation: str = "silu",
) -> torch.Tensor:
    if not silu_and_mul_first:
        return linear(x, weight, bias, projection)
    fp8_fused = FUSE_ACT_QUANT_FP8 and isinstance(weight, Fp8LinearWeight) and activation in ("silu", "gelu_tanh")
    if fp8_fused and _triton(x) and not _feed_apart(bucket := fp8_bucket(projection, x.shape[0])):
        # the activation in the launch that quantises down's input (fp8_gemm.fp8_act_and_mul_linear):
        # the quantising kernel's, or up to 16 rows the fused decode GEMV's
        cfg = _config("fp8_gemm", bucket)
        return _kernels().fp8_act_and_mul_linear(x, weight, bias, activation, cfg)  # type: ignore[no-any-return]
    if activation != "silu":
        return linear(act_and_mul(x, activation), weight, bias, projection)
    if FUSE_SILU_DOWN and isinstance(weight, Int4LinearWeight) and _triton(x):
        bucket = w4a16_bucket(projection, x.shape[0])
        cfg = _config("w4a16_gemm", bucket)
        timed_fused = _marked("w4a16_gemm", bucket, "fused_silu")
        # a config that cannot fuse (prefill-sized buckets) keeps the tuned activation below
        if timed_fused and cfg is not None and _kernels().fuses_silu_and_mul(cfg):
            return _kernels().w4a16_silu_and_mul_gemm(  # type: ignore[no-any-return]
                x, weight.qweight, weight.scales, weight.zeros, weight.perm, weight.group_size, bias, cfg
            )
    return linear(silu_and_mul(x), weight, bias, projection)


def embedding(input_ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Vocab-parallel embedding: rank r holds rows [r * rows, (r + 1) * rows); ids outside give
    zeros and the all-reduce fills in every row from the rank that holds it."""
    if _active.tp_size == 1:
        return torch.nn.functional.embedding(input_ids, weight)
    rows = weight.shape[0]
    local = input_ids - _active.tp_rank * rows
    outside = (local < 0) | (local >= rows)
    out = torch.nn.functional.embedding(local.clamp(0, rows - 1), weight)
    return all_reduce(out.masked_fill_(outside.unsqueeze(-1), 0))


def lm_head(
    hidden: torch.Tensor, weight: torch.Tensor | Fp8LinearWeight, vocab_size: int, *, widen: bool = True
) -> torch.Tensor:
    """hidden: [rows, hidden] -> logits [rows, vocab_size]: fp32, or with ``widen=False`` in
    hidden's dtype as the GEMM wrote them (a view of [rows, padded vocabulary] when the head is
    padded). Vocab-parallel: each rank computes its vocabulary rows' logits, all ranks gather
    them (padding rows are cut off). An FP8 head (enginebuild --fp8-lm-head) runs as an FP8
    projection, its bucket "lm_head".

    Model code since kernel ABI 8 asks for ``widen=False`` where nothing scales the logits: a
    bf16 GEMM's output holds only bf16 values, so an fp32 copy adds no precision, and at
    512-1,024 rows of a 128k vocabulary it cost a 213-338 us kernel a step (0.22 s of bf16 W6's
    26.2 s in its H200 profile). The sampler reads either dtype; what needs more mantissa
    (penalties, masks, logprobs' sums) works in fp32 on what it touches. Older model code gets
    fp32, as it was built for."""
    if isinstance(weight, Fp8LinearWeight):
        logits = _fp8_linear(hidden, weight, None, "lm_head")
    else:
        logits = torch.nn.functional.linear(hidden, weight)
    if _active.tp_size > 1:
        import torch.distributed as dist

        parts = [torch.empty_like(logits) for _ in range(_active.tp_size)]
        dist.all_gather(parts, logits.contiguous())
        logits = torch.cat(parts, dim=-1)
    logits = logits[:, :vocab_size]
    return logits.float() if widen else logits


# -- mixture of experts ------------------------------------------------------------------------

from pagecast.kernels.moe_routing import (
    KERNEL_SCORINGS,
    SILU,
    MoeActivation,
    MoeRouting,
    SharedExpert,
    route,
    weights_dtype,
)
from pagecast.kernels.tuning import moe_bucket


def moe(
    x: torch.Tensor,
    router_weight: torch.Tensor,
    router_bias: torch.Tensor | None,
    w_gate_up: torch.Tensor | Int4ExpertsWeight | Fp8ExpertsWeight,
    w_down: torch.Tensor | Int4ExpertsWeight | Fp8ExpertsWeight,
    b_gate_up: torch.Tensor | None = None,
    b_down: torch.Tensor | None = None,
    *,
    routing: MoeRouting,
    activation: MoeActivation = SILU,
    shared_expert: SharedExpert | None = None,
) -> torch.Tensor:
    """A MoE block: x [T, H] -> [T, H] in x's dtype. The router (router_weight [E, H], router_bias
    [E] or None) picks each token's experts as ``routing`` says (kernels/moe_routing.py, in fp32
    where transformers routes in fp32), the experts (moe_routing's layout; on a tensor-parallel
    rank its ``shard_experts`` share) run fused (kernels/fused_moe.py, the tuning table's config
    for the token bucket) on a GPU and as reference.fused_moe's per-expert loop otherwise, and
    the shared expert where there is one (Qwen2-MoE: sigmoid(x @ gate.T) * mlp(x)) is added. FP8
    experts (quant_linear.Fp8ExpertsWeight) run kernels/fused_moe_fp8.py, or its exact emulation.
    With tensor parallelism each rank's partial sum is all-reduced once."""
    # On a GPU: routed in one launch (kernels/moe_route_kernel.py), the weights as the fp32 fused_moe reads.
    kernels = _triton(x)
    # Decode batches may run the router GEMV and the routing as one launch (the table's choice).
    router_cfg = _config("moe_router", moe_bucket(x.shape[0])) if kernels else None
    topk_weights, topk_ids = route(
        x, router_weight, router_bias, routing, use_kernel=kernels, widen=kernels, config=router_cfg
    )
    routed_x = None
    if routing.weights_on_input:  # Llama 4 (top-1): the expert's input is x times the weight, in x's dtype
        routed_x = x * topk_weights.to(x.dtype)
        topk_weights = torch.ones_like(topk_weights)
    return _moe_experts(
        x, topk_weights, topk_ids, w_gate_up, w_down, b_gate_up, b_down, activation, shared_expert, routed_x
    )


def add_norm_moe(
    hidden: torch.Tensor,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    router_weight: torch.Tensor,
    router_bias: torch.Tensor | None,
    w_gate_up: torch.Tensor | Int4ExpertsWeight | Fp8ExpertsWeight,
    w_down: torch.Tensor | Int4ExpertsWeight | Fp8ExpertsWeight,
    b_gate_up: torch.Tensor | None = None,
    b_down: torch.Tensor | None = None,
    *,
    routing: MoeRouting,
    activation: MoeActivation = SILU,
    shared_expert: SharedExpert | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``fused_add_rms_norm`` then ``moe``: residual' = hidden + residual, returns
    (moe(RMSNorm(residual') * norm_weight, ...), residual'). Where the tuning table runs the fused
    router at this token bucket (decode batches), the add and the norm run inside the router's
    launch (moe_route_kernel.add_norm_router_route), one launch a layer fewer; elsewhere the norm
    kernel runs first."""
    if _triton(hidden):
        from pagecast.kernels import moe_route_kernel as mrk

        router_cfg = _config("moe_router", moe_bucket(hidden.shape[0]))
        if routing.scoring not in KERNEL_SCORINGS or routing.fp32_logits:  # not the fused router's GEMV
            router_cfg = None
        if mrk.runs_fused(router_cfg, hidden.shape[0], router_weight.shape[0], routing.top_k) and mrk.norm_fusable(
            hidden, residual, norm_weight, router_weight
        ):
            x, residual, topk_weights, topk_ids = mrk.add_norm_router_route(
                hidden, residual, norm_weight, eps, router_weight, router_bias, routing.top_k, routing.scoring,
                routing.renormalize, weights_dtype(routing, hidden.dtype), True, router_cfg,  # type: ignore[arg-type]
            )  # fmt: skip
            out = _moe_experts(
                x, topk_weights, topk_ids, w_gate_up, w_down, b_gate_up, b_down, activation, shared_expert
            )
            return out, residual
    x, residual = fused_add_rms_norm(hidden, residual, norm_weight, eps)
    out = moe(
        x, router_weight, router_bias, w_gate_up, w_down, b_gate_up, b_down,
        routing=routing, activation=activation, shared_expert=shared_expert,
    )  # fmt: skip
    return out, residual


def _moe_experts(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w_gate_up: torch.Tensor | Int4ExpertsWeight | Fp8ExpertsWeight,
    w_down: torch.Tensor | Int4ExpertsWeight | Fp8ExpertsWeight,
    b_gate_up: torch.Tensor | None,
    b_down: torch.Tensor | None,
    activation: MoeActivation,
    shared_expert: SharedExpert | None,
    routed_x: torch.Tensor | None = None,
) -> torch.Tensor:
    """``moe`` from its routing: the routed experts (on ``routed_x`` where given: Llama 4's inputs
    scaled by their weights), the shared expert (on x), the all-reduce."""
    act = activation
    shared_x, x = x, (x if routed_x is None else routed_x)
    # A bucket past the decode graphs' batches may run the naive loop (it syncs with the host);
    # the tuner offers it nowhere else (kernels/problems.py).
    if isinstance(w_gate_up, Int4ExpertsWeight):  # AWQ/GPTQ experts (kernels/fused_moe_w4a16.py)
        out = _int4_moe(x, topk_weights, topk_ids, w_gate_up, w_down, act)
    elif isinstance(w_gate_up, Fp8ExpertsWeight) and isinstance(w_down, Fp8ExpertsWeight):
        out = _fp8_moe(x, topk_weights, topk_ids, w_gate_up, w_down, act, b_gate_up, b_down)
    elif _triton(x):
        cfg = _config("fused_moe", moe_bucket(x.shape[0]))
        out = _moe_kernel()(
            x, topk_weights, topk_ids, w_gate_up, w_down, b_gate_up, b_down, act.kind, act.alpha, act.limit, cfg
        )
    else:
        out = reference.fused_moe(
            x, topk_weights, topk_ids, w_gate_up, w_down, b_gate_up, b_down, act.kind, act.alpha, act.limit
        )
    if shared_expert is not None:
        gate_up = linear(shared_x, shared_expert.w_gate_up, None, "shared_gate_up")  # column-parallel
        shared = linear(silu_and_mul(gate_up), shared_expert.w_down, None, "shared_down")  # row-parallel, summed below
        if shared_expert.gate is not None:
            shared = torch.sigmoid(torch.nn.functional.linear(shared_x, shared_expert.gate)) * shared
        out = out + shared
    return all_reduce(out)


def moe_stays_on_device(num_tokens: int, w_gate_up: torch.Tensor | Int4ExpertsWeight | Fp8ExpertsWeight) -> bool:
    """Whether ``moe`` over ``num_tokens`` rows of these experts runs without waiting for the host,
    so a CUDA graph can hold it: every path but the naive per-expert loop, which the tuner may
    keep at buckets past the decode graphs' batches."""
    from pagecast.kernels import fused_moe

    if isinstance(w_gate_up, Int4ExpertsWeight):
        kernel = "fused_moe_w4a16"
    elif isinstance(w_gate_up, Fp8ExpertsWeight):
        kernel = "fused_moe_fp8"
    else:
        kernel = "fused_moe"
    return not fused_moe.is_naive(_config(kernel, moe_bucket(num_tokens)))


def _int4_moe(
    x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, w_gate_up: Int4ExpertsWeight,
    w_down: Int4ExpertsWeight, act: MoeActivation,
) -> torch.Tensor:  # fmt: skip
    """int4 experts: the fused W4A16 MoE kernels with the table's config for the token bucket on a
    GPU; on the CPU the experts dequantised exactly (kept per dtype) through the reference loop."""
    if not _triton(x):
        return reference.fused_moe(
            x, topk_weights, topk_ids, w_gate_up.dense(x.dtype), w_down.dense(x.dtype), None, None,
            act.kind, act.alpha, act.limit,
        )  # fmt: skip
    from pagecast.kernels import fused_moe_w4a16

    cfg = _config("fused_moe_w4a16", moe_bucket(x.shape[0]))
    return fused_moe_w4a16.fused_moe_w4a16(
        x, topk_weights, topk_ids, w_gate_up, w_down, act.kind, act.alpha, act.limit, cfg
    )


def _fp8_moe(
    x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, w_gate_up: Fp8ExpertsWeight,
    w_down: Fp8ExpertsWeight, act: MoeActivation, b_gate_up: torch.Tensor | None, b_down: torch.Tensor | None,
) -> torch.Tensor:  # fmt: skip
    """FP8 experts (kernels/fused_moe_fp8.py, the table's "fused_moe_fp8" config for the token
    bucket) on a GPU; the exact emulation (reference.fused_moe_fp8) otherwise."""
    args = (x, topk_weights, topk_ids, w_gate_up.weight, w_gate_up.weight_scale, w_down.weight, w_down.weight_scale)
    if not _triton(x):
        floats = (w_gate_up.as_float(), w_down.as_float())
        return reference.fused_moe_fp8(*args, act.kind, act.alpha, act.limit, floats, b_gate_up, b_down)
    from pagecast.kernels import fused_moe_fp8

    cfg = _config("fused_moe_fp8", moe_bucket(x.shape[0]))
    return fused_moe_fp8.fused_moe_fp8(*args, act.kind, act.alpha, act.limit, cfg, b_gate_up, b_down)  # type: ignore[no-any-return]


@functools.cache
def _moe_kernel() -> Any:
    from pagecast.kernels import fused_moe

    return fused_moe.fused_moe
