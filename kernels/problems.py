"""Kernel problems: random inputs at one shape bucket, the bytes and FLOPs each launch needs, and
the config space and default config that apply there.

The tuner, the K1 benchmark and the GPU tests share these, so a config is timed on exactly
the launch the runtime will make (same dtypes, strides and specialisations, hence the
same compiled kernels in TRITON_CACHE_DIR). Attention problems place K/V in randomly chosen
blocks of a pool of at least ``COLD_BYTES`` and rotate through several block tables, so
the KV a timed launch reads is not sitting in L2 from the launch before (in a real decode
step every layer reads its own cache).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from pagecast.kernels import (
    activation,
    fp8_gemm,
    fused_moe,
    fused_moe_fp8,
    fused_moe_w4a16,
    moe_route_kernel,
    paged_decode_attention,
    paged_prefill_attention,
    reference,
    rms_norm,
    rotary_kv,
    skinny_gemm,
    w4a16_gemm,
    w4a16_tcgemv,
)
from pagecast.kernels.quant_linear import Fp8LinearWeight, scale_dtype_for
from pagecast.kernels.tuning import (
    DECODE_BATCH_BUCKETS,
    DECODE_CONTEXT_BUCKETS,
    EXPERT_KERNELS,
    FP8_ROW_BUCKETS,
    MOE_TOKEN_BUCKETS,
    PREFILL_CONTEXT_BUCKETS,
    PREFILL_SHORT_CONTEXT,
    PREFILL_TOKEN_BUCKETS,
    PROJECTIONS,
    SKINNY_ROW_BUCKETS,
    TOKEN_BUCKETS,
    W4A16_ROW_BUCKETS,
    KernelConfig,
    ModelShapes,
    num_sms,
    prefill_bucket,
    projection_dims,
)

COLD_BYTES = 256 << 20  # about 4x the H100/H200 L2
MAX_LAUNCHES = 64
PREFILL_SEQ_LEN = 2048  # prefill buckets are sequences of this many tokens (or fewer)
LM_HEAD = len(PROJECTIONS)  # an fp8_gemm bucket's "projection" index for the FP8 LM head (--fp8-lm-head)


@dataclass
class Problem:
    """One kernel at one shape: ``launch(config, i)`` runs it on input set ``i % num_sets``."""

    kernel: str
    bucket: str
    launch: Callable[[KernelConfig | None, int], object]
    num_sets: int  # distinct input sets; a timed sample launches at least this many
    bytes: int  # fewest bytes one launch must move through device memory
    flops: int  # matmul FLOPs of one launch (attention), 0 for elementwise kernels
    # The half-type baseline the kernel replaces (the W4A16 GEMM's bf16 cuBLAS GEMM), timed for the report.
    reference: Callable[[KernelConfig | None, int], object] | None = None
    # Recorded in the bucket's table entry: how it was timed (the down projection's "fused_silu").
    marks: dict[str, Any] = field(default_factory=dict)
    # Launched once, untimed, with each config the bucket times: the kernel's other specialisations
    # serving launches at this bucket. Triton compiles a variant per integer argument divisible by
    # 16 or not; a GEMM bucket of 32 rows is timed at 32 and serves 17-32, so without this a
    # config chosen there compiled while serving (on the H200, a GPTQ act-order Qwen2's qkv at 20
    # rows: `_w4a16_gemm_kernel` with BLOCK_M 32). Not do_not_specialize, as the fused-MoE kernels'
    # counts are: the decode GEMVs of these buckets keep their specialisation for a single row.
    variants: Callable[[KernelConfig | None], object] | None = None
    # The same work with the projection's input made (normalised, activated) in a launch of its own
    # before the GEMM: the FP8 decode kernel's norm or activation taken out of it. Timed once, with
    # the bucket's best config; where it beats that config by TIE_TOLERANCE the entry is marked
    # "feed_apart" and serving runs the bucket so (kernels/ops.py).
    apart: Callable[[KernelConfig | None, int], object] | None = None

    def launches_per_sample(self, est_bandwidth: float = 3e12) -> int:
        """Launches per timed sample: every input set, and at least ~100 us of work."""
        est_s = max(self.bytes / est_bandwidth, 2e-6)
        return max(self.num_sets, min(MAX_LAUNCHES, math.ceil(100e-6 / est_s)))


# ---------------------------------------------------------------------------- buckets and sizes


def buckets(kernel: str, shapes: ModelShapes) -> list[tuple[str, dict[str, int]]]:
    """The (bucket name, dims) a kernel is tuned over for this model: up to max_num_seqs /
    max_model_len (the first bucket covering each), every token bucket otherwise."""

    def upto(values: tuple[int, ...], limit: int) -> tuple[int, ...]:
        kept = tuple(v for v in values if v < limit)
        return kept + tuple(v for v in values if v >= limit)[:1]

    if kernel == "paged_decode_attention":
        # the last context bucket is timed at max_model_len where that is shorter (a 40k model's
        # 131072 bucket serves contexts up to 40k)
        return [
            (f"{b}x{c}", {"num_seqs": b, "max_seq_len": min(c, shapes.max_model_len)})
            for b in upto(DECODE_BATCH_BUCKETS, shapes.max_num_seqs)
            for c in upto(DECODE_CONTEXT_BUCKETS, shapes.max_model_len)
        ]
    if kernel == "paged_prefill_attention":
        # Long contexts (the model allows them): the last t tokens of one sequence of the context
        # bucket's length, or of max_model_len where that is shorter.
        long = [
            (prefill_bucket(t, c), {"num_tokens": t, "max_seq_len": min(c, shapes.max_model_len)})
            for c in upto(PREFILL_CONTEXT_BUCKETS, shapes.max_model_len) if shapes.max_model_len > PREFILL_SHORT_CONTEXT
            for t in PREFILL_TOKEN_BUCKETS
        ]  # fmt: skip
        return [(f"t{t}", {"num_tokens": t}) for t in PREFILL_TOKEN_BUCKETS] + long
    if kernel == "w4a16_gemm":
        if not shapes.quant_group_size:
            return []
        nk = projection_dims(shapes)
        # Row counts outermost: a tuning budget that runs out leaves the largest buckets (whose
        # default, dequantize + cuBLAS, is the usual winner there) at the default, not whole
        # projections' decode buckets (a 60 s budget once stopped at qkv.m32, so o, gate_up and
        # down ran their defaults at 1-16 rows too).
        return [
            (f"{name}.m{m}", {"projection": i, "n": nk[name][0], "k": nk[name][1], "num_rows": m})
            for m in W4A16_ROW_BUCKETS
            for i, name in enumerate(PROJECTIONS)
        ]
    if kernel == "fp8_gemm":
        if not shapes.fp8:
            return []
        nk = projection_dims(shapes)
        out = [
            (f"{name}.m{m}", {"projection": i, "n": nk[name][0], "k": nk[name][1], "num_rows": m})
            for m in FP8_ROW_BUCKETS
            for i, name in enumerate(PROJECTIONS)
        ]
        if shapes.fp8_lm_head:  # last (a budget cuts it first): the head runs on the sampled rows only,
            # but on every bucket's worth of them with prompt logprobs or speculative verification
            out += [
                (f"lm_head.m{m}", {"projection": LM_HEAD, "n": shapes.fp8_lm_head, "k": shapes.hidden, "num_rows": m})
                for m in FP8_ROW_BUCKETS
            ]
        return out
    if kernel == "skinny_gemm":
        if shapes.quant_group_size or shapes.fp8:
            return []  # the projections are int4 / fp8: the skinny GEMM never runs
        nk = projection_dims(shapes)
        return [
            (f"{name}.m{m}", {"projection": i, "n": nk[name][0], "k": nk[name][1], "num_rows": m})
            for i, name in enumerate(PROJECTIONS)
            for m in upto(SKINNY_ROW_BUCKETS, shapes.max_num_seqs)
        ]
    if kernel == "moe_router":  # decode buckets the fused router takes (up to max_num_seqs)
        if not (shapes.num_experts and moe_route_kernel.fused_supported(1, shapes.num_experts, shapes.top_k)):
            return []
        if shapes.moe_scoring not in moe_route_kernel.SCORINGS:  # routed in torch ops (moe_routing.route)
            return []
        sizes = upto(tuple(t for t in MOE_TOKEN_BUCKETS if t <= moe_route_kernel.FUSED_MAX_TOKENS), shapes.max_num_seqs)
        return [(f"t{t}", {"num_tokens": t}) for t in sizes]
    if kernel in EXPERT_KERNELS:  # one of them runs a build's experts: FP8, int4 (AWQ/GPTQ) or half-type
        experts = "fused_moe_fp8" if shapes.fp8 else "fused_moe_w4a16" if shapes.quant_group_size else "fused_moe"
        return [(f"t{t}", {"num_tokens": t}) for t in MOE_TOKEN_BUCKETS] if shapes.num_experts and kernel == experts else []
    return [(f"t{t}", {"num_tokens": t}) for t in TOKEN_BUCKETS]


def _elt(shapes: ModelShapes) -> int:
    return torch.empty((), dtype=shapes.torch_dtype).element_size()


def _kv_elt(shapes: ModelShapes) -> int:
    return torch.empty((), dtype=shapes.kv_torch_dtype).element_size()


def kv_bytes(shapes: ModelShapes, dims: dict[str, int]) -> int:
    """Bytes of K and V a decode bucket reads (the pool a tuning problem has to allocate)."""
    return dims["num_seqs"] * dims["max_seq_len"] * 2 * shapes.num_kv_heads * shapes.head_dim * _kv_elt(shapes)


def random_cache(shape: tuple[int, ...], shapes: ModelShapes, generator: torch.Generator, device: torch.device) -> torch.Tensor:
    """A random K or V cache in the KV dtype (an fp8 cache holds N(0, 1) values, as with scale 1)."""
    x = torch.randn(shape, generator=generator, device=device, dtype=shapes.torch_dtype)
    return x.to(shapes.kv_torch_dtype)


def problem_size(kernel: str, shapes: ModelShapes, dims: dict[str, int]) -> tuple[int, int]:
    """(bytes, flops) of one launch at a bucket: each input read once, each output written once."""
    e, kv_e = _elt(shapes), _kv_elt(shapes)
    h, kvh, d = shapes.num_heads, shapes.num_kv_heads, shapes.head_dim
    if kernel == "paged_decode_attention":
        b, c = dims["num_seqs"], dims["max_seq_len"]
        return b * c * 2 * kvh * d * kv_e + 2 * b * h * d * e, 4 * b * h * c * d
    if kernel == "skinny_gemm":  # the weight once, the rows in and out
        m, n, k = dims["num_rows"], dims["n"], dims["k"]
        return (n * k + m * k + m * n) * e, 0
    if kernel == "fp8_gemm":  # fp8 weight and its fp32 scales once; the rows in (half), quantised, out
        m, n, k = dims["num_rows"], dims["n"], dims["k"]
        scales = n * 4 * (-(-k // fp8_gemm.GROUP) if shapes.fp8.startswith("block") else 1)
        # down: gate_up's rows, activated in the launch; a normed projection: the rows and the
        # residual in, the stream out (its norm, in the launch, or in one beside a tile's)
        rows_in = 2 * k if _fp8_gated_down(shapes, dims) else 3 * k if _fp8_normed(shapes, dims) else k
        return n * k + scales + (m * rows_in + m * n) * e, 2 * m * n * k
    if kernel == "w4a16_gemm":  # packed weight, fp16 scales, int8 zeros once; the rows in and out
        m, n, k = dims["num_rows"], dims["n"], dims["k"]
        groups = k // _group_size(shapes, k)
        return n * k // 2 + 3 * groups * n + (m * k + m * n) * e, 2 * m * n * k

    t = dims["num_tokens"]
    if kernel == "fused_moe":  # the visited experts' weights once, the tokens in and out
        h, i = shapes.hidden, shapes.moe_intermediate
        return moe_visited_experts(shapes, t) * 3 * h * i * e + 2 * t * h * e, 2 * t * shapes.top_k * 3 * h * i
    if kernel == "fused_moe_w4a16":  # the visited experts' packed weights, scales and zeros once
        h, i = shapes.hidden, shapes.moe_intermediate
        groups = 2 * i * (h // _group_size(shapes, h)) + h * (i // _group_size(shapes, i))
        per_expert = 3 * h * i // 2 + groups * (w4a16_scale_dtype(shapes).itemsize + 1)
        return moe_visited_experts(shapes, t) * per_expert + 2 * t * h * e, 2 * t * shapes.top_k * 3 * h * i
    if kernel == "fused_moe_fp8":  # the visited experts' e4m3 weights and fp32 scales once, the tokens in and out
        h, i = shapes.hidden, shapes.moe_intermediate
        scales = 4 * (2 * i * -(-h // fp8_gemm.GROUP) + h * -(-i // fp8_gemm.GROUP) if _fp8_block(shapes) else 3 * i + h)
        return moe_visited_experts(shapes, t) * (3 * h * i + scales) + 2 * t * h * e, 2 * t * shapes.top_k * 3 * h * i
    if kernel == "moe_router":  # the router's weight once, the tokens in, the weights and ids out
        e, k = shapes.num_experts, shapes.top_k
        return (e + t) * shapes.hidden * _elt(shapes) + t * k * (4 + 8), 2 * t * e * shapes.hidden
    if kernel == "paged_prefill_attention":
        if context := dims.get("max_seq_len"):  # the last t tokens of one sequence: the prefix all, themselves causally
            return t * 2 * h * e * d + context * 2 * kvh * kv_e * d, 4 * h * d * t * (context - t) + 2 * h * d * t * t
        n = min(t, PREFILL_SEQ_LEN)
        seqs = max(1, t // n)
        return seqs * n * (2 * h * e + 2 * kvh * kv_e) * d, seqs * 2 * h * d * n * n  # causal: half of 4*h*d*n*n
    if kernel == "rotary_kv":  # q in and out, k and v in, k and v written to the cache
        return t * ((2 * h + 2 * kvh) * e + 2 * kvh * kv_e) * d, 0
    if kernel == "rms_norm":
        return 2 * t * shapes.hidden * e, 0
    if kernel == "fused_add_rms_norm":
        return 4 * t * shapes.hidden * e, 0
    if kernel == "silu_and_mul":
        return 3 * t * shapes.intermediate * e, 0
    raise ValueError(f"unknown kernel {kernel!r}")


# ---------------------------------------------------------------------------- config spaces


def config_space(kernel: str, shapes: ModelShapes, dims: dict[str, int]) -> list[KernelConfig]:
    """The pruned configs to time for a kernel at a bucket, in preference order."""
    if kernel == "paged_decode_attention":
        m = paged_decode_attention
        space = m.FP8_CONFIG_SPACE if shapes.kv_torch_dtype == torch.float8_e4m3fn else m.CONFIG_SPACE
        return m.prune_configs(space, dims["num_seqs"], dims["max_seq_len"], shapes.num_kv_heads, num_sms())
    if kernel == "paged_prefill_attention":
        m2 = paged_prefill_attention
        space = m2.CONFIG_SPACE
        if shapes.kv_torch_dtype == torch.float8_e4m3fn and dims.get("max_seq_len"):
            space = space + m2.STAGE_TILES  # long contexts over an fp8 cache: staged in fp16 too
        return m2.prune_configs(space, shapes.num_heads // shapes.num_kv_heads, shapes.head_dim)
    if kernel == "rotary_kv":
        return rotary_kv.prune_configs(rotary_kv.CONFIG_SPACE, shapes.num_heads, shapes.head_dim)
    if kernel in ("rms_norm", "fused_add_rms_norm"):
        return rms_norm.prune_configs(rms_norm.CONFIG_SPACE, shapes.hidden)
    if kernel == "silu_and_mul":
        return activation.prune_configs(activation.CONFIG_SPACE, shapes.intermediate)
    if kernel == "skinny_gemm":
        return skinny_gemm.prune_configs(skinny_gemm.CONFIG_SPACE, dims["n"], dims["k"])
    if kernel == "fused_moe":
        return fused_moe.prune_configs(
            fused_moe.config_space(), dims["num_tokens"], shapes.top_k, shapes.num_experts, shapes.hidden,
            shapes.moe_intermediate, elt=_elt(shapes), allow_naive=dims["num_tokens"] > shapes.max_num_seqs,
            grouped=fused_moe.grouped_supported(shapes.torch_dtype),
        )  # fmt: skip
    if kernel == "moe_router":
        return moe_route_kernel.prune_configs(moe_route_kernel.FUSED_CONFIG_SPACE, shapes.num_experts, shapes.hidden)
    if kernel == "fused_moe_w4a16":
        return fused_moe_w4a16.prune_configs(
            fused_moe_w4a16.CONFIG_SPACE, dims["num_tokens"], shapes.top_k, shapes.num_experts, shapes.hidden,
            shapes.moe_intermediate, _moe_min_group(shapes), elt=_elt(shapes),
            allow_naive=dims["num_tokens"] > shapes.max_num_seqs,
        )  # fmt: skip
    if kernel == "fused_moe_fp8":
        return fused_moe_fp8.prune_configs(
            fused_moe_fp8.CONFIG_SPACE, dims["num_tokens"], shapes.top_k, shapes.num_experts, shapes.hidden,
            shapes.moe_intermediate, block=_fp8_block(shapes), allow_naive=dims["num_tokens"] > shapes.max_num_seqs,
        )  # fmt: skip
    if kernel == "fp8_gemm":
        return fp8_gemm.prune_configs(
            fp8_gemm.CONFIG_SPACE, dims["num_rows"], dims["n"], dims["k"], _fp8_block(shapes), shapes.torch_dtype
        )
    if kernel == "w4a16_gemm":
        return w4a16_gemm.prune_configs(
            w4a16_gemm.CONFIG_SPACE, dims["num_rows"], dims["n"], dims["k"], num_sms(),
            tc=_w4a16_tc(shapes, dims), **_w4a16_sizes(shapes, dims),
        )  # fmt: skip
    raise ValueError(f"unknown kernel {kernel!r}")


def default_config(kernel: str, shapes: ModelShapes, dims: dict[str, int]) -> KernelConfig:
    """The config a launcher picks by itself for this bucket (what runs when the table lacks it)."""
    if kernel == "paged_decode_attention":
        return paged_decode_attention.default_config(
            dims["num_seqs"], dims["max_seq_len"], shapes.num_kv_heads
        )
    if kernel == "paged_prefill_attention":
        return paged_prefill_attention.default_config(
            shapes.num_heads // shapes.num_kv_heads, shapes.head_dim
        )
    if kernel == "rotary_kv":
        return rotary_kv.default_config()
    if kernel in ("rms_norm", "fused_add_rms_norm"):
        return rms_norm.default_config(shapes.hidden)
    if kernel == "silu_and_mul":
        return activation.default_config()
    if kernel == "skinny_gemm":
        return skinny_gemm.TORCH
    if kernel == "fused_moe":
        return fused_moe.default_config(
            dims["num_tokens"], shapes.top_k, shapes.num_experts, shapes.hidden, shapes.moe_intermediate, num_sms(),
            _elt(shapes),
        )
    if kernel == "moe_router":
        return moe_route_kernel.UNFUSED  # F.linear and the routing kernel, as before the fused router
    if kernel == "fused_moe_w4a16":
        return fused_moe_w4a16.default_config(
            dims["num_tokens"], shapes.top_k, shapes.num_experts, shapes.hidden, shapes.moe_intermediate,
            _moe_min_group(shapes), num_sms(), _elt(shapes),
        )  # fmt: skip
    if kernel == "fused_moe_fp8":
        return fused_moe_fp8.default_config(
            dims["num_tokens"], shapes.top_k, shapes.num_experts, shapes.hidden, shapes.moe_intermediate, num_sms(),
            _fp8_block(shapes),
        )
    if kernel == "fp8_gemm":
        return fp8_gemm.default_config(
            dims["num_rows"], dims["n"], dims["k"], _fp8_block(shapes), shapes.torch_dtype, num_sms()
        )
    if kernel == "w4a16_gemm":
        return w4a16_gemm.default_config(
            dims["num_rows"], dims["n"], dims["k"], num_sms(),
            tc=_w4a16_tc(shapes, dims), **_w4a16_sizes(shapes, dims),
        )  # fmt: skip
    raise ValueError(f"unknown kernel {kernel!r}")


def _fp8_block(shapes: ModelShapes) -> bool:
    return shapes.fp8.startswith("block")


def _fp8_gated_down(shapes: ModelShapes, dims: dict[str, int]) -> bool:
    """Whether this fp8_gemm bucket is the down projection, whose input serving activates on the way
    in (ops' silu_and_mul_first: fp8_gemm.fp8_act_and_mul_linear)."""
    return dims["projection"] == PROJECTIONS.index("down") and shapes.activation in ("silu", "gelu_tanh")


def random_fp8_weight(
    shapes: ModelShapes, n: int, k: int, device: torch.device | str, generator: torch.Generator | None = None
) -> Fp8LinearWeight:
    """A random [n, k] FP8 projection in the build's scheme (builder/fp8.py's artifact layout)."""
    activations = shapes.fp8.partition("-")[2]
    w = torch.randn((n, k), generator=generator, device=device) * 0.02
    q, s = reference.quantize_fp8_groups(w) if _fp8_block(shapes) else reference.quantize_fp8_rows(w)
    inp = torch.tensor([0.05], device=device) if activations == "static" else None
    return Fp8LinearWeight(q, s, inp, activations)


def _fp8_normed(shapes: ModelShapes, dims: dict[str, int]) -> bool:
    """Whether this fp8_gemm bucket is a projection whose input serving normalises in the same ops
    call (ops.norm_linear: the RMSNorm inside the fused decode kernel, or in the launch that
    quantises for a tile), so that the tuner times the norm with each config."""
    return dims["projection"] != LM_HEAD and PROJECTIONS[dims["projection"]] in shapes.normed


def _group_size(shapes: ModelShapes, k: int) -> int:
    return k if shapes.quant_group_size == -1 else shapes.quant_group_size


def _w4a16_tc(shapes: ModelShapes, dims: dict[str, int]) -> bool:
    """Whether the W4A16 launcher may take the tensor-core decode kernel for this projection."""
    return w4a16_tcgemv.supports(shapes.torch_dtype, _group_size(shapes, dims["k"]))


def w4a16_scale_dtype(shapes: ModelShapes) -> torch.dtype:
    """The int4 scales' dtype in an artifact of this activation dtype (quant_linear.scale_dtype_for,
    the builder's rule). The tuner's problem uses it: the scales' element size changes the kernels'
    shared memory (an fp32 tile that fit with fp16 scales while tuning needed 266240 bytes with the
    artifact's fp32 ones on an H200)."""
    return scale_dtype_for(str(shapes.torch_dtype).removeprefix("torch."))


def _w4a16_sizes(shapes: ModelShapes, dims: dict[str, int]) -> dict[str, int]:
    """What the W4A16 launcher sizes its tiles' shared memory by (w4a16_gemm.shared_memory), as
    the runtime's launch has it: the activations' and scales' element sizes, the group size."""
    return {
        "x_elt": _elt(shapes),
        "scale_elt": w4a16_scale_dtype(shapes).itemsize,
        "group_size": _group_size(shapes, dims["k"]),
    }


# ---------------------------------------------------------------------------- inputs


def random_block_tables(
    num_seqs: int, blocks_per_seq: int, num_blocks: int, generator: torch.Generator, device: torch.device
) -> torch.Tensor:
    """[num_seqs, blocks_per_seq] int32 of distinct blocks drawn at random from a pool."""
    need = num_seqs * blocks_per_seq
    perm = torch.randperm(num_blocks, generator=generator)[:need]
    return perm.view(num_seqs, blocks_per_seq).to(device=device, dtype=torch.int32)


def decode_inputs(
    shapes: ModelShapes,
    num_seqs: int,
    context: int,
    device: torch.device | str,
    seed: int = 0,
    num_sets: int | None = None,
) -> dict[str, object]:
    """Random decode inputs: one query per sequence, every sequence `context` tokens long,
    K/V in random blocks of a pool of at least COLD_BYTES, ``num_sets`` block tables."""
    device = torch.device(device)
    dtype = shapes.torch_dtype
    g = torch.Generator().manual_seed(seed)
    bs, kvh, d = shapes.block_size, shapes.num_kv_heads, shapes.head_dim
    bytes_per_token = 2 * kvh * d * _kv_elt(shapes)
    kv_bytes = num_seqs * context * bytes_per_token
    if num_sets is None:
        num_sets = max(1, min(MAX_LAUNCHES, math.ceil(COLD_BYTES / kv_bytes)))
    blocks_per_seq = math.ceil(context / bs)
    pool_blocks = max(num_seqs * blocks_per_seq, math.ceil(COLD_BYTES / (bs * bytes_per_token))) + 1
    dg = torch.Generator(device=device).manual_seed(seed)
    k_cache = random_cache((pool_blocks, kvh, bs, d), shapes, dg, device)
    v_cache = random_cache((pool_blocks, kvh, bs, d), shapes, dg, device)
    tables = [random_block_tables(num_seqs, blocks_per_seq, pool_blocks, g, device) for _ in range(num_sets)]
    q = torch.randn((num_seqs, shapes.num_heads, d), generator=dg, device=device, dtype=dtype)
    return {
        "q": q,
        "k_cache": k_cache,
        "v_cache": v_cache,
        "block_tables": tables,
        "seq_lens": torch.full((num_seqs,), context, dtype=torch.int32, device=device),
        "query_start_loc": torch.arange(num_seqs + 1, dtype=torch.int32, device=device),
        "out": torch.empty_like(q),
        "scale": d**-0.5,
        "max_seq_len": context,
    }


def attn_sinks(shapes: ModelShapes, device: torch.device, seed: int = 0) -> torch.Tensor | None:
    """Per-head sink logits for the attention problems of a model with sinks (None without), in
    the model's dtype as the artifact stores them (builder/plan.py), so that the timed launches are
    the variants the model's layers launch (Triton specialises on the pointer's dtype)."""
    if not shapes.attn_sinks:
        return None
    g = torch.Generator(device=device).manual_seed(seed + 1)
    return torch.randn((shapes.num_heads,), generator=g, device=device).to(shapes.torch_dtype)


def make_problem(
    kernel: str, shapes: ModelShapes, dims: dict[str, int], device: torch.device | str, seed: int = 0,
    window: int = 0, chunk: int = 0,
) -> Problem:  # fmt: skip
    """Random inputs on ``device`` for one kernel at one bucket, and how to launch it. ``window``
    (``chunk``) > 0 launches the attention kernels as a sliding (chunked) layer runs them
    (tuning.compile_window_variants)."""
    device = torch.device(device)
    dtype = shapes.torch_dtype
    nbytes, flops = problem_size(kernel, shapes, dims)
    bucket = next(name for name, dm in buckets(kernel, shapes) + [("?", dims)] if dm == dims)
    dg = torch.Generator(device=device).manual_seed(seed)
    h, kvh, d = shapes.num_heads, shapes.num_kv_heads, shapes.head_dim

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=dg, device=device, dtype=dtype)

    if kernel == "paged_decode_attention":
        x = decode_inputs(shapes, dims["num_seqs"], dims["max_seq_len"], device, seed)
        tables: list[torch.Tensor] = x["block_tables"]  # type: ignore[assignment]
        sinks = attn_sinks(shapes, device, seed)

        def decode(cfg: KernelConfig | None, i: int) -> object:
            return paged_decode_attention.paged_decode_attention(
                x["q"], x["k_cache"], x["v_cache"], tables[i % len(tables)], x["seq_lens"],  # type: ignore[arg-type]
                x["query_start_loc"], x["scale"], x["max_seq_len"], config=cfg, out=x["out"],  # type: ignore[arg-type]
                softcap=shapes.attn_softcap, window=window, sinks=sinks, chunk=chunk,
            )  # fmt: skip

        return Problem(kernel, bucket, decode, len(tables), nbytes, flops)

    if kernel == "skinny_gemm":
        m, n, k = dims["num_rows"], dims["n"], dims["k"]
        # Several weights, so a launch reads its weight from memory, not from the last launch's L2.
        num_sets = max(1, min(MAX_LAUNCHES, math.ceil(COLD_BYTES / (n * k * _elt(shapes)))))
        weights = [randn(n, k) * k**-0.5 for _ in range(num_sets)]
        rows = randn(m, k)
        bias = _bias(shapes, dims, n, device, dg)

        def gemm(cfg: KernelConfig | None, i: int) -> object:
            return skinny_gemm.skinny_gemm(rows, weights[i % num_sets], bias, config=cfg)

        # The 16-row bucket serves 9-15 rows too: M not divisible by 16, another compiled variant.
        return Problem(
            kernel, bucket, gemm, num_sets, nbytes, flops,
            variants=_fewer_rows(m, lambda cfg: skinny_gemm.skinny_gemm(rows[: m - 1], weights[0], bias, config=cfg)),
        )  # fmt: skip

    if kernel == "w4a16_gemm":
        return _w4a16_problem(shapes, dims, bucket, device, dg, nbytes, flops)
    if kernel == "fp8_gemm":
        return _fp8_problem(shapes, dims, bucket, device, dg, nbytes, flops)

    if kernel == "fused_moe":
        return _moe_problem(shapes, dims, bucket, device, dg, nbytes, flops)
    if kernel == "moe_router":
        return _router_problem(shapes, dims, bucket, device, dg, nbytes, flops)
    if kernel == "fused_moe_w4a16":
        return _moe_w4a16_problem(shapes, dims, bucket, device, dg, nbytes, flops)
    if kernel == "fused_moe_fp8":
        return _moe_fp8_problem(shapes, dims, bucket, device, dg, nbytes, flops)

    t = dims["num_tokens"]
    if kernel == "paged_prefill_attention":
        # Sequences of n tokens, all new; or (a long-context bucket) one sequence of `context`
        # tokens whose last t are new.
        context = dims.get("max_seq_len")
        n = t if context else min(t, PREFILL_SEQ_LEN)
        seqs = 1 if context else max(1, t // n)
        seq_len = context or n
        blocks_per_seq = math.ceil(seq_len / shapes.block_size)
        num_blocks = seqs * blocks_per_seq
        k_cache = random_cache((num_blocks, kvh, shapes.block_size, d), shapes, dg, device)
        v_cache = random_cache((num_blocks, kvh, shapes.block_size, d), shapes, dg, device)
        g = torch.Generator().manual_seed(seed)
        table = random_block_tables(seqs, blocks_per_seq, num_blocks, g, device)
        q = randn(seqs * n, h, d)
        seq_lens = torch.full((seqs,), seq_len, dtype=torch.int32, device=device)
        qsl = torch.arange(0, seqs * n + 1, n, dtype=torch.int32, device=device)
        out = torch.empty_like(q)
        sinks = attn_sinks(shapes, device, seed)

        def prefill(cfg: KernelConfig | None, i: int) -> object:
            return paged_prefill_attention.paged_prefill_attention(
                q, k_cache, v_cache, table, seq_lens, qsl, d**-0.5, config=cfg, out=out, softcap=shapes.attn_softcap,
                window=window, sinks=sinks, chunk=chunk,
            )

        return Problem(kernel, bucket, prefill, 1, nbytes, flops)

    if kernel == "rotary_kv":
        from pagecast.kernels import rope

        max_pos = max(shapes.max_model_len, t)
        rotary_dim = shapes.rotary_dim or d  # ROTARY_DIM, a constexpr: the model's (partial) width
        cos_sin = rope.cos_sin_cache({"rope_type": "default", "rope_theta": 500000.0}, rotary_dim, max_pos).to(device)
        qkv = randn(t, (h + 2 * kvh) * d)  # q, k, v as views of one fused projection, as the model has them
        q = qkv[:, : h * d].view(t, h, d)
        k = qkv[:, h * d : (h + kvh) * d].view(t, kvh, d)
        v = qkv[:, (h + kvh) * d :].view(t, kvh, d)
        num_blocks = math.ceil(t / shapes.block_size) + 1
        k_cache = random_cache((num_blocks, kvh, shapes.block_size, d), shapes, dg, device)
        v_cache = random_cache((num_blocks, kvh, shapes.block_size, d), shapes, dg, device)
        positions = torch.randint(0, max_pos, (t,), generator=dg, device=device)
        slots = torch.randperm(num_blocks * shapes.block_size, generator=dg, device=device)[:t]

        norms: dict[str, object] = {}
        if shapes.head_qk_norm:  # the QK_NORM (QK_NORM_AFTER) variant the model launches
            norms = {"q_norm": 1.0 + 0.1 * randn(d), "k_norm": 1.0 + 0.1 * randn(d), "qk_norm_eps": 1e-6,
                     "qk_norm_after": shapes.head_qk_norm_after}  # fmt: skip

        def rotary(cfg: KernelConfig | None, i: int) -> object:
            return rotary_kv.rotary_and_write_kv(
                positions, q, k, v, cos_sin, k_cache, v_cache, slots, config=cfg, **norms
            )

        def plain(cfg: KernelConfig | None) -> object:  # the layers without q/k norms (Llama 4's no-RoPE ones)
            return rotary_kv.rotary_and_write_kv(positions, q, k, v, cos_sin, k_cache, v_cache, slots, config=cfg)

        return Problem(kernel, bucket, rotary, 1, nbytes, flops, variants=plain if shapes.rotary_without_norm else None)

    if kernel in ("rms_norm", "fused_add_rms_norm"):
        x, res, w = randn(t, shapes.hidden), randn(t, shapes.hidden), randn(shapes.hidden)
        if kernel == "rms_norm":
            return Problem(
                kernel, bucket, lambda cfg, i: rms_norm.rms_norm(x, w, 1e-5, config=cfg), 1, nbytes, 0
            )
        return Problem(
            kernel,
            bucket,
            lambda cfg, i: rms_norm.fused_add_rms_norm(x, res, w, 1e-5, config=cfg),
            1,
            nbytes,
            0,
        )

    if kernel == "silu_and_mul":
        x = randn(t, 2 * shapes.intermediate)
        act = activation.gelu_tanh_and_mul if shapes.activation == "gelu_tanh" else activation.silu_and_mul
        return Problem(kernel, bucket, lambda cfg, i: act(x, config=cfg), 1, nbytes, 0)

    raise ValueError(f"unknown kernel {kernel!r}")


def _bias(
    shapes: ModelShapes, dims: dict[str, int], n: int, device: torch.device, dg: torch.Generator
) -> torch.Tensor | None:
    """The projection's bias (in the model's dtype, as the artifact stores it) where the model's
    has one (ModelShapes.biased): the GEMM kernels' HAS_BIAS variant is what serving launches."""
    if dims["projection"] == LM_HEAD or PROJECTIONS[dims["projection"]] not in shapes.biased:
        return None
    return torch.randn((n,), generator=dg, device=device, dtype=shapes.torch_dtype) * 0.02


def _w4a16_problem(
    shapes: ModelShapes, dims: dict[str, int], bucket: str, device: torch.device, dg: torch.Generator,
    nbytes: int, flops: int,
) -> Problem:  # fmt: skip
    """Random int4 weights of one projection (several, so each launch reads its weight from memory),
    and as the reference the same projection's half-type weights through F.linear (cuBLAS). The
    down projection is timed as the engine runs it (kernels/ops.py FUSE_SILU_DOWN): from gate_up,
    silu_and_mul folded into the configs that can fold it (w4a16_tcgemv.fuses_silu_and_mul), run
    before the projection by the others and by the reference; so the table weighs what serving
    runs, the fused kernels it picks are compiled into the artifact, and its entry is marked
    "fused_silu" (serving folds the activation only into buckets so marked)."""
    from pagecast.kernels import ops

    m, n, k = dims["num_rows"], dims["n"], dims["k"]
    fused_down = ops.FUSE_SILU_DOWN and "projection" in dims and PROJECTIONS[dims["projection"]] == "down"
    dtype = shapes.torch_dtype
    g = _group_size(shapes, k)
    num_sets = max(1, min(MAX_LAUNCHES, math.ceil(COLD_BYTES / (n * k // 2))))
    weights = []
    for _ in range(num_sets):
        qweight = torch.randint(-(2**31), 2**31 - 1, (k // 8, n), generator=dg, device=device, dtype=torch.int32)
        scales = torch.rand((k // g, n), generator=dg, device=device) * 0.004 + 0.002
        scales = scales.to(w4a16_scale_dtype(shapes))  # the artifact's (fp32 in fp32 ones)
        zeros = torch.randint(0, 16, (k // g, n), generator=dg, device=device, dtype=torch.int8)
        weights.append((qweight, scales, zeros))
    rows = torch.randn((m, 2 * k if fused_down else k), generator=dg, device=device, dtype=dtype)
    bias = _bias(shapes, dims, n, device, dg)
    # act-order: the artifact's perm (builder/quant.py; every projection but down), as a shuffle
    has_perm = shapes.int4_act_order and PROJECTIONS[dims["projection"]] != "down"
    perm = torch.randperm(k, generator=dg, device=device).to(torch.int32) if has_perm else None

    def run(x: torch.Tensor, cfg: KernelConfig | None, i: int) -> object:
        qweight, scales, zeros = weights[i % num_sets]
        if fused_down:
            return w4a16_gemm.w4a16_silu_and_mul_gemm(x, qweight, scales, zeros, perm, g, bias, config=cfg)
        return w4a16_gemm.w4a16_gemm(x, qweight, scales, zeros, perm, g, bias, config=cfg)

    def gemm(cfg: KernelConfig | None, i: int) -> object:
        return run(rows, cfg, i)

    dense_sets = max(1, min(MAX_LAUNCHES, math.ceil(COLD_BYTES / (n * k * _elt(shapes)))))
    dense = [torch.randn((n, k), generator=dg, device=device, dtype=dtype) for _ in range(dense_sets)]

    def half_gemm(cfg: KernelConfig | None, i: int) -> object:
        x = activation.silu_and_mul(rows) if fused_down else rows
        return torch.nn.functional.linear(x, dense[i % dense_sets], bias)

    marks = {"fused_silu": True} if fused_down else {}
    return Problem(
        "w4a16_gemm", bucket, gemm, num_sets, nbytes, flops, reference=half_gemm, marks=marks,
        variants=_fewer_rows(m, lambda cfg: run(rows[: m - 1], cfg, 0)),
    )  # fmt: skip


def _fewer_rows(m: int, launch: Callable[[KernelConfig | None], object]) -> Callable[[KernelConfig | None], object] | None:
    """A row bucket's other variant (Problem.variants): ``launch`` runs m - 1 rows, which serving
    launches as "not divisible by 16" where m, the bucket's rows, is."""
    return launch if m % 16 == 0 else None


# ---------------------------------------------------------------------------- mixture of experts


MOE_ROUTINGS = 8  # routings a fused-MoE problem rotates through


def moe_topk_ids(shapes: ModelShapes, num_tokens: int, seed: int = 0) -> torch.Tensor:
    """[num_tokens, top_k] int64 (CPU): the experts the tuner's tokens visit, a softmax router's
    top-k over random logits (every expert equally likely, as a balanced router makes them).
    Deterministic, so problem_size counts the same visited experts the problem launches."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn((num_tokens, shapes.num_experts), generator=g)
    return torch.topk(logits, shapes.top_k, dim=-1).indices


def moe_visited_experts(shapes: ModelShapes, num_tokens: int) -> int:
    """Experts a launch of the tuner's problem visits, the mean over its MOE_ROUTINGS routings
    (rounded down): the weights a launch must read."""
    counts = [int(moe_topk_ids(shapes, num_tokens, seed).unique().numel()) for seed in range(MOE_ROUTINGS)]
    return sum(counts) // len(counts)


def moe_bound(
    shapes: ModelShapes, dims: dict[str, int], time_us: float, copy_gbs: float, peak_tflops: float,
    kernel: str = "fused_moe",
) -> dict[str, Any]:
    """What bounds a fused-MoE bucket and how close ``time_us`` comes: the weight-streaming bound
    (the visited experts' weights and the tokens at ``copy_gbs``) or the compute bound (its
    matmul FLOPs at ``peak_tflops``), whichever is longer; decode buckets are weight-bound,
    prefill buckets compute-bound. ``fraction``: bound time / measured time."""
    nbytes, flops = problem_size(kernel, shapes, dims)
    weights_us = nbytes / (copy_gbs * 1e3)
    compute_us = flops / (peak_tflops * 1e6)
    bound, bound_us = ("weights", weights_us) if weights_us >= compute_us else ("compute", compute_us)
    return {
        "bound": bound,
        "bound_us": round(bound_us, 2),
        "fraction": round(bound_us / time_us, 3),
        "tb_s": round(nbytes / (time_us * 1e-6) / 1e12, 3),
        "tflop_s": round(flops / (time_us * 1e-6) / 1e12, 1),
    }


def _moe_routings(shapes: ModelShapes, t: int, device: torch.device) -> list[tuple[torch.Tensor, list[tuple]]]:
    """MOE_ROUTINGS routings of ``moe_topk_ids``: (topk_ids on ``device``, the naive loop's (expert,
    token rows, slots) of every visited expert), the visits found here once, so that the timed loop
    needs no host sync."""
    routings = []
    for seed in range(MOE_ROUTINGS):
        ids_cpu = moe_topk_ids(shapes, t, seed)
        visits = [(ex, *(v.to(device) for v in torch.where(ids_cpu == ex))) for ex in ids_cpu.unique().tolist()]
        routings.append((ids_cpu.to(device), visits))
    return routings


def _naive_loop(
    x: torch.Tensor, topk_weights: torch.Tensor, visits: list[tuple], act: tuple,
    gate_up: Callable[[int, torch.Tensor], torch.Tensor], down: Callable[[int, torch.Tensor], torch.Tensor],
) -> torch.Tensor:  # fmt: skip
    """The tuner's per-expert baseline over ``_moe_routings``' visits: each visited expert's rows
    through ``gate_up(e, rows)``, the activation (``act``: the model's name, alpha and limit), then
    ``down(e, rows)``, weighted and added into the output in x's dtype."""
    out = torch.zeros_like(x)
    for ex, token, slot in visits:
        y = gate_up(ex, x[token])
        y = activation.silu_and_mul(y) if act[0] == "silu" else reference.moe_activation(y, *act)
        out.index_add_(0, token, (down(ex, y) * topk_weights[token, slot, None]).to(x.dtype))
    return out


def _moe_problem(
    shapes: ModelShapes, dims: dict[str, int], bucket: str, device: torch.device, dg: torch.Generator,
    nbytes: int, flops: int,
) -> Problem:  # fmt: skip
    """Random experts (several sets where one is smaller than COLD_BYTES, so a launch reads its
    weights from memory) and MOE_ROUTINGS of ``moe_topk_ids``'s routings; the fused kernel at a
    config, and as the baseline (a candidate where the bucket is never captured, and the
    reference) the per-expert loop of cuBLAS GEMMs. The loop's token lists are found once here, not in the timed launch, so
    it needs no host sync (a CUDA graph captures it) and its time is the GEMMs' and the gathers'
    alone: a baseline that flatters the loop (at run time it finds them every call)."""
    t, k = dims["num_tokens"], shapes.top_k
    h, i, e = shapes.hidden, shapes.moe_intermediate, shapes.num_experts
    dtype = shapes.torch_dtype
    expert_bytes = e * 3 * h * i * _elt(shapes)
    num_sets = max(1, min(MAX_LAUNCHES, math.ceil(COLD_BYTES / expert_bytes)))
    sets = [
        (
            (torch.randn((e, 2 * i, h), generator=dg, device=device, dtype=dtype) * h**-0.5),
            (torch.randn((e, h, i), generator=dg, device=device, dtype=dtype) * i**-0.5),
        )
        for _ in range(num_sets)
    ]
    # gpt-oss's expert biases ([E, 2I] and [E, H], in the model's dtype as the artifact stores them)
    b_gate_up = torch.randn((e, 2 * i), generator=dg, device=device, dtype=dtype) if shapes.moe_bias else None
    b_down = torch.randn((e, h), generator=dg, device=device, dtype=dtype) if shapes.moe_bias else None
    act = (shapes.moe_activation, shapes.moe_alpha, shapes.moe_limit)
    x = torch.randn((t, h), generator=dg, device=device, dtype=dtype)
    topk_weights = torch.rand((t, k), generator=dg, device=device).softmax(-1)
    routings = _moe_routings(shapes, t, device)

    def naive(i_set: int) -> torch.Tensor:
        w_gate_up, w_down = sets[i_set % num_sets]
        return _naive_loop(
            x, topk_weights, routings[i_set % MOE_ROUTINGS][1], act,
            lambda ex, rows: torch.nn.functional.linear(rows, w_gate_up[ex], None if b_gate_up is None else b_gate_up[ex]),
            lambda ex, rows: torch.nn.functional.linear(rows, w_down[ex], None if b_down is None else b_down[ex]),
        )  # fmt: skip

    def launch(cfg: KernelConfig | None, i_set: int) -> object:
        if fused_moe.is_naive(cfg):
            return naive(i_set)
        w_gate_up, w_down = sets[i_set % num_sets]
        topk_ids = routings[i_set % MOE_ROUTINGS][0]
        return fused_moe.fused_moe(
            x, topk_weights, topk_ids, w_gate_up, w_down, b_gate_up, b_down, *act, config=cfg
        )

    # A sample launches every routing (consecutive launches visit different experts, so little of
    # a launch's weights is still in L2 from the one before) and every weight set.
    sets_per_sample = max(num_sets, MOE_ROUTINGS)
    return Problem(
        "fused_moe", bucket, launch, sets_per_sample, nbytes, flops, reference=lambda cfg, i_set: naive(i_set)
    )


def _router_problem(
    shapes: ModelShapes, dims: dict[str, int], bucket: str, device: torch.device, dg: torch.Generator, nbytes: int,
    flops: int,
) -> Problem:  # fmt: skip
    """The router of one MoE layer at a decode bucket, as ops.moe runs it on a GPU (``route`` with
    the kernel, widened weights), the unfused path or the fused router by the config. Inputs and
    weights hold small integers, so every sum of products is exact in fp32 whatever the order: the
    two paths' logits, hence their routings, are bit for bit the same and the tuner's output check
    compares like with like (on real activations the paths may differ by a rounding step of the
    logits). Several router weights, so a launch reads its router from memory, as a decode step
    does after the layer's experts have streamed through L2."""
    from pagecast.kernels.moe_routing import MoeRouting, route

    t, e, hidden = dims["num_tokens"], shapes.num_experts, shapes.hidden
    dtype = shapes.torch_dtype
    routing = MoeRouting(
        shapes.top_k, scoring=shapes.moe_scoring, renormalize=shapes.moe_renormalize,
        weights_in_x_dtype=shapes.moe_weights_in_x_dtype,
    )  # fmt: skip

    def ints(*shape: int) -> torch.Tensor:
        return torch.randint(-2, 3, shape, generator=dg, device=device).to(dtype)

    num_sets = max(1, min(MAX_LAUNCHES, math.ceil(COLD_BYTES / (e * hidden * _elt(shapes)))))
    routers = [ints(e, hidden) for _ in range(num_sets)]
    bias = ints(e) if shapes.moe_router_bias else None
    x = ints(t, hidden)

    def launch(cfg: KernelConfig | None, i: int) -> object:
        return route(x, routers[i % num_sets], bias, routing, use_kernel=True, widen=True, config=cfg)

    return Problem("moe_router", bucket, launch, num_sets, nbytes, flops)


def _moe_min_group(shapes: ModelShapes) -> int:
    """The smaller quantisation group of the int4 experts' two projections (gate_up: K = hidden,
    down: K = the rank's intermediate)."""
    return min(_group_size(shapes, shapes.hidden), _group_size(shapes, shapes.moe_intermediate))


def _moe_w4a16_problem(
    shapes: ModelShapes, dims: dict[str, int], bucket: str, device: torch.device, dg: torch.Generator,
    nbytes: int, flops: int,
) -> Problem:  # fmt: skip
    """Random int4 experts in the artifact's stacked layout (several sets where one is smaller than
    COLD_BYTES) and MOE_ROUTINGS of ``moe_topk_ids``'s routings; the fused W4A16 MoE kernel at a
    config, and as the baseline (a candidate where the bucket is never captured, and the
    reference) the per-expert loop of dense W4A16 GEMMs at their default configs, its token lists
    found once here (as _moe_problem's loop: no host sync in the timed launch)."""
    from pagecast.kernels.quant_linear import Int4ExpertsWeight

    t, k = dims["num_tokens"], shapes.top_k
    h, i, e = shapes.hidden, shapes.moe_intermediate, shapes.num_experts
    dtype, scale_dtype = shapes.torch_dtype, w4a16_scale_dtype(shapes)

    def experts(n: int, kk: int) -> Int4ExpertsWeight:
        g = _group_size(shapes, kk)
        qweight = torch.randint(-(2**31), 2**31 - 1, (e, kk // 8, n), generator=dg, device=device, dtype=torch.int32)
        scales = (torch.rand((e, kk // g, n), generator=dg, device=device) * 0.004 + 0.002).to(scale_dtype)
        zeros = torch.randint(0, 16, (e, kk // g, n), generator=dg, device=device, dtype=torch.int8)
        return Int4ExpertsWeight(qweight, scales, zeros, None, g)

    num_sets = max(1, min(MAX_LAUNCHES, math.ceil(COLD_BYTES / (e * 3 * h * i // 2))))
    sets = [(experts(2 * i, h), experts(h, i)) for _ in range(num_sets)]
    x = torch.randn((t, h), generator=dg, device=device, dtype=dtype)
    topk_weights = torch.rand((t, k), generator=dg, device=device).softmax(-1)
    routings = _moe_routings(shapes, t, device)

    def int4(w: Int4ExpertsWeight) -> Callable[[int, torch.Tensor], torch.Tensor]:
        def gemm(ex: int, rows: torch.Tensor) -> torch.Tensor:
            one = w.expert(ex)
            return w4a16_gemm.w4a16_gemm(rows, one.qweight, one.scales, one.zeros, None, one.group_size)

        return gemm

    def naive(i_set: int) -> torch.Tensor:
        w_gate_up, w_down = sets[i_set % num_sets]
        return _naive_loop(x, topk_weights, routings[i_set % MOE_ROUTINGS][1], ("silu",), int4(w_gate_up), int4(w_down))

    def launch(cfg: KernelConfig | None, i_set: int) -> object:
        if fused_moe_w4a16.is_naive(cfg):
            return naive(i_set)
        w_gate_up, w_down = sets[i_set % num_sets]
        return fused_moe_w4a16.fused_moe_w4a16(
            x, topk_weights, routings[i_set % MOE_ROUTINGS][0], w_gate_up, w_down, config=cfg
        )

    return Problem(
        "fused_moe_w4a16", bucket, launch, max(num_sets, MOE_ROUTINGS), nbytes, flops,
        reference=lambda cfg, i_set: naive(i_set),
    )  # fmt: skip


def _moe_fp8_problem(
    shapes: ModelShapes, dims: dict[str, int], bucket: str, device: torch.device, dg: torch.Generator,
    nbytes: int, flops: int,
) -> Problem:  # fmt: skip
    """_moe_problem with FP8 experts in the artifact layout (per-channel or 128x128-block scales,
    as shapes.fp8 says): the fused FP8 kernels at a config, and as the baseline (a candidate where
    the bucket is never captured, and the reference) the per-expert loop of the dense FP8 GEMM at
    its launcher's default (torch._scaled_mm from 64 rows where it runs), its token lists found
    here, not in the timed launch, as in _moe_problem."""
    from pagecast.kernels.quant_linear import Fp8LinearWeight

    t, k = dims["num_tokens"], shapes.top_k
    h, i, e = shapes.hidden, shapes.moe_intermediate, shapes.num_experts
    dtype = shapes.torch_dtype
    block = _fp8_block(shapes)
    acts = "group" if block else "token"
    quant = reference.quantize_fp8_groups if block else reference.quantize_fp8_rows
    num_sets = max(1, min(MAX_LAUNCHES, math.ceil(COLD_BYTES / (e * 3 * h * i))))

    def experts(n: int, kk: int) -> tuple[torch.Tensor, torch.Tensor]:
        pairs = [quant(torch.randn((n, kk), generator=dg, device=device) * kk**-0.5) for _ in range(e)]
        return torch.stack([q for q, _ in pairs]), torch.stack([s for _, s in pairs])

    sets = [(*experts(2 * i, h), *experts(h, i)) for _ in range(num_sets)]
    # gpt-oss's expert biases ([E, 2I] and [E, H], in the model's dtype as the artifact stores them)
    b_gu = torch.randn((e, 2 * i), generator=dg, device=device, dtype=dtype) if shapes.moe_bias else None
    b_d = torch.randn((e, h), generator=dg, device=device, dtype=dtype) if shapes.moe_bias else None
    act = (shapes.moe_activation, shapes.moe_alpha, shapes.moe_limit)
    x = torch.randn((t, h), generator=dg, device=device, dtype=dtype)
    topk_weights = torch.rand((t, k), generator=dg, device=device).softmax(-1)
    routings = _moe_routings(shapes, t, device)

    def naive(i_set: int) -> torch.Tensor:
        w_gu, s_gu, w_d, s_d = sets[i_set % num_sets]
        return _naive_loop(
            x, topk_weights, routings[i_set % MOE_ROUTINGS][1], act,
            lambda ex, rows: fp8_gemm.fp8_linear(rows, Fp8LinearWeight(w_gu[ex], s_gu[ex], None, acts), None if b_gu is None else b_gu[ex]),
            lambda ex, rows: fp8_gemm.fp8_linear(rows, Fp8LinearWeight(w_d[ex], s_d[ex], None, acts), None if b_d is None else b_d[ex]),
        )  # fmt: skip

    def launch(cfg: KernelConfig | None, i_set: int) -> object:
        if fused_moe.is_naive(cfg):
            return naive(i_set)
        topk_ids = routings[i_set % MOE_ROUTINGS][0]
        return fused_moe_fp8.fused_moe_fp8(
            x, topk_weights, topk_ids, *sets[i_set % num_sets], *act, config=cfg, b_gate_up=b_gu, b_down=b_d
        )

    sets_per_sample = max(num_sets, MOE_ROUTINGS)
    return Problem(
        "fused_moe_fp8", bucket, launch, sets_per_sample, nbytes, flops, reference=lambda cfg, i_set: naive(i_set)
    )


def _fp8_problem(
    shapes: ModelShapes, dims: dict[str, int], bucket: str, device: torch.device, dg: torch.Generator,
    nbytes: int, flops: int,
) -> Problem:  # fmt: skip
    """Random FP8 weights of one projection in the artifact layout (several, so each launch reads
    its weight from memory), launched as serving launches them: the activation quantisation, then
    the GEMM (or torch._scaled_mm, the {"scaled_mm": 1} config); down with its input activated on
    the way in (``_fp8_gated_down``). The reference, timed for the
    report, is torch._scaled_mm with rowwise scales where it runs (bf16, per-channel weights), else
    the half-type F.linear of the same shape."""
    m, n, k = dims["num_rows"], dims["n"], dims["k"]
    dtype = shapes.torch_dtype
    block = _fp8_block(shapes)
    num_sets = max(1, min(MAX_LAUNCHES, math.ceil(COLD_BYTES / (n * k))))
    weights = [random_fp8_weight(shapes, n, k, device, dg) for _ in range(num_sets)]
    bias = _bias(shapes, dims, n, device, dg)
    variants: Callable[[KernelConfig | None], object] | None = None  # else the bucket's fewer rows
    if _fp8_gated_down(shapes, dims):
        # down as ops runs it: gate_up's rows activated on the way in, in the launch that quantises
        # them for a tile (or torch._scaled_mm), or inside the fused decode kernel (SKINNY configs)
        rows = torch.randn((m, 2 * k), generator=dg, device=device, dtype=dtype)

        def linear(x: torch.Tensor, w: Fp8LinearWeight, cfg: KernelConfig | None) -> object:
            return fp8_gemm.fp8_act_and_mul_linear(x, w, bias, shapes.activation, cfg)

        def feed_apart(x: torch.Tensor, w: Fp8LinearWeight, cfg: KernelConfig | None) -> object:
            act = activation.silu_and_mul if shapes.activation == "silu" else activation.gelu_tanh_and_mul
            return fp8_gemm.fp8_linear(act(x), w, bias, cfg)

    elif _fp8_normed(shapes, dims):
        # qkv / gate_up as ops.norm_linear runs them: the residual add and RMSNorm inside the fused
        # decode kernel, or in the launch that quantises the input for a tile (rms_norm_fp8); the
        # variants run layer 0's (no residual) too
        from pagecast.kernels import rms_norm

        rows = torch.randn((m, k), generator=dg, device=device, dtype=dtype)
        residual = torch.randn((m, k), generator=dg, device=device, dtype=dtype)
        norm_weight = torch.rand((k,), generator=dg, device=device).to(dtype) + 0.5

        def norm_linear(x: torch.Tensor, w: Fp8LinearWeight, cfg: KernelConfig | None, first: bool) -> object:
            res = None if first else residual[: x.shape[0]]
            if fp8_gemm.quantises_apart(x.shape[0], k, w, dtype, cfg):
                qx, sx, stream = rms_norm.rms_norm_fp8(x, res, norm_weight, 1e-6, w.activations, w.input_scale)
                return fp8_gemm.fp8_gemm_quantised(qx, sx, w, bias, dtype, cfg), stream
            return fp8_gemm.fp8_skinny_norm_linear(x, res, norm_weight, 1e-6, w, bias, cfg)

        def variants(cfg: KernelConfig | None) -> object:  # layer 0's (no residual), and 15 rows at 16
            for x in (rows, rows[: m - 1]) if m % 16 == 0 else (rows,):
                norm_linear(x, weights[0], cfg, True)
            return None if m % 16 else norm_linear(rows[: m - 1], weights[0], cfg, False)

        def linear(x: torch.Tensor, w: Fp8LinearWeight, cfg: KernelConfig | None) -> object:
            return norm_linear(x, w, cfg, False)

        def feed_apart(x: torch.Tensor, w: Fp8LinearWeight, cfg: KernelConfig | None) -> object:
            normed, stream = rms_norm.fused_add_rms_norm(x, residual[: x.shape[0]], norm_weight, 1e-6)
            return fp8_gemm.fp8_linear(normed, w, bias, cfg), stream

    else:
        rows = torch.randn((m, k), generator=dg, device=device, dtype=dtype)
        feed_apart = None

        def linear(x: torch.Tensor, w: Fp8LinearWeight, cfg: KernelConfig | None) -> object:
            return fp8_gemm.fp8_linear(x, w, bias, cfg)

    def gemm(cfg: KernelConfig | None, i: int) -> object:
        return linear(rows, weights[i % num_sets], cfg)

    def fewer(cfg: KernelConfig | None) -> object:
        return linear(rows[: m - 1], weights[0], cfg)

    if fp8_gemm.scaled_mm_supported(m, n, k, block, dtype):

        def reference_gemm(cfg: KernelConfig | None, i: int) -> object:
            return linear(rows, weights[i % num_sets], fp8_gemm.SCALED_MM)

    else:
        dense_sets = max(1, min(MAX_LAUNCHES, math.ceil(COLD_BYTES / (n * k * _elt(shapes)))))
        dense = [torch.randn((n, k), generator=dg, device=device, dtype=dtype) for _ in range(dense_sets)]

        def reference_gemm(cfg: KernelConfig | None, i: int) -> object:
            return torch.nn.functional.linear(rows[:, :k], dense[i % dense_sets], bias)

    apart = None
    if feed_apart is not None and m <= fp8_gemm.SKINNY_MAX_ROWS:
        # where the fused decode kernel may take the norm or the activation in: the two launches it replaces
        def apart(cfg: KernelConfig | None, i: int) -> object:
            return feed_apart(rows, weights[i % num_sets], cfg)

    if variants is None:
        variants = _fewer_rows(m, fewer)
    return Problem(
        "fp8_gemm", bucket, gemm, num_sets, nbytes, flops, reference=reference_gemm, variants=variants, apart=apart
    )
