"""Kernel launch configs, shape buckets and the autotuner that fills the artifact's tuning table.

The table maps kernel name -> shape bucket -> the config that won on the target GPU:

    {"kernels": {"paged_decode_attention": {"64x2048": {"config": {...}, "time_us": 41.2,
                                                        "alternatives": [...]}}},
     "device": "NVIDIA H200", "tuned": true}

The runtime looks a config up by bucket (``decode_bucket`` / ``token_bucket``) on every call,
so the lookup is a bisect plus a dict access. Tuning is deterministic up to timing noise:
fixed seeds, the median of repeats, and a config only displaces an earlier one in the space
when it is faster by more than ``TIE_TOLERANCE``. Every config written into the table has
been launched during tuning, so a TRITON_CACHE_DIR captured then holds every kernel the
runtime will run for those buckets. A config is timed only if its output agrees with the
bucket's first config's (the launcher's default): one that a compiler gets wrong on this GPU
is refused and listed in the entry's ``rejected``, never kept for being fast.

This module imports triton lazily: the CPU runtime imports the bucket functions without it.
"""

from __future__ import annotations

import bisect
import functools
import json
import os
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

# Shape buckets. A shape maps to the smallest bucket at least as large (clamped to the last).
# Batches past 256 have buckets of their own: an fp8 cache's best decode config there differs from
# 256 sequences' (benchmarks/RESULTS.md: 1024 x 768 464 us against 478 us at the 256 bucket's).
# An engine only tunes the buckets up to its max_num_seqs; a table without a batch's bucket
# (an older artifact) falls back to its largest smaller one (decode_fallback_buckets).
DECODE_BATCH_BUCKETS = (1, 8, 32, 64, 128, 256, 512, 1024)
# The 131072 context bucket (issue 32): a 128k sequence's best split count is not a 32k one's (an
# fp8 cache on an H200: 128 splits at 128k, 64 at 32k). Only models past 32k tune it; a table
# without it (built before) falls back to the same batch at the largest smaller context.
DECODE_CONTEXT_BUCKETS = (512, 2048, 8192, 32768, 131072)
TOKEN_BUCKETS = (8, 64, 256, 1024, 4096, 16384)
PREFILL_TOKEN_BUCKETS = (128, 512, 2048, 8192)
# Prefill steps whose longest sequence passes PREFILL_SHORT_CONTEXT (chunked prefill of a long
# prompt: every query tile reads the whole prefix) have buckets of their own, tuned at the
# context (capped at the model's max_model_len). The plain t-buckets are timed on sequences of
# 2,048 tokens, where 64x64 tiles won; one whole 32k prompt ran fastest with 128x128 ones
# (benchmarks/RESULTS.md, issue 32). A table without one falls back to the plain bucket.
PREFILL_SHORT_CONTEXT = 8192
PREFILL_CONTEXT_BUCKETS = (32768, 131072)
SKINNY_ROW_BUCKETS = (1, 2, 4, 8, 16)  # decode batches whose projections may leave cuBLAS
PROJECTIONS = ("qkv", "o", "gate_up", "down")
# Rows of an int4 projection (decode batches to prefill chunks): the W4A16 GEMM's buckets.
W4A16_ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 8192)
# Tokens through a MoE block (decode batches to prefill chunks): the fused-MoE kernel's buckets.
MOE_TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)

KERNELS = (
    "paged_decode_attention",
    "paged_prefill_attention",
    "rotary_kv",
    "rms_norm",
    "fused_add_rms_norm",
    "silu_and_mul",
    "skinny_gemm",
    "w4a16_gemm",
    "fp8_gemm",
)
# Kernels only MoE models have: a build tunes them where its model's ModelShapes has experts
# (``tune(KERNELS + MOE_KERNELS, ...)``); shipped tables for dense models need no entry.
EXPERT_KERNELS = ("fused_moe", "fused_moe_w4a16", "fused_moe_fp8")  # half-type, int4 (AWQ/GPTQ) and FP8 experts
# ... and the router: its GEMV and the routing as one launch at decode buckets, or F.linear and the
# routing kernel (kernels/moe_route_kernel.py).
MOE_KERNELS = (*EXPERT_KERNELS, "moe_router")

TIE_TOLERANCE = 0.02  # a later config must beat the best so far by 2% to take its place
_DEFAULTS_DIR = Path(__file__).parent / "tuning_defaults"


@dataclass(frozen=True)
class KernelConfig:
    """One launch configuration: tunable kernel parameters plus num_warps / num_stages.

    ``params`` holds the kernel's block sizes and launch-time knobs (e.g. BLOCK_N,
    num_splits); it is read with ``cfg["BLOCK_N"]``. ``as_dict`` / ``coerce`` convert to and
    from the JSON form stored in tuning.json.
    """

    params: Mapping[str, int] = field(default_factory=dict)
    num_warps: int = 4
    num_stages: int = 2

    def __getitem__(self, key: str) -> int:
        return self.params[key]

    def as_dict(self) -> dict[str, int]:
        return {**dict(self.params), "num_warps": self.num_warps, "num_stages": self.num_stages}

    @classmethod
    def coerce(cls, config: Mapping[str, Any] | KernelConfig | None) -> KernelConfig | None:
        """A KernelConfig from a table entry's dict (or None / a KernelConfig, passed through)."""
        if config is None or isinstance(config, KernelConfig):
            return config
        params = {k: int(v) for k, v in config.items() if k not in ("num_warps", "num_stages")}
        return cls(params, int(config.get("num_warps", 4)), int(config.get("num_stages", 2)))


@dataclass(frozen=True)
class ModelShapes:
    """The model dimensions the kernels are tuned for (one tensor-parallel rank's share)."""

    num_heads: int  # query heads on this rank
    num_kv_heads: int  # KV heads on this rank
    head_dim: int
    hidden: int
    intermediate: int  # the MLP's intermediate size on this rank (silu_and_mul's output width)
    block_size: int  # KV-cache block size in tokens
    dtype: str | torch.dtype = "bfloat16"  # activation and KV-cache dtype
    max_model_len: int = 8192  # longest context: context buckets beyond it are not tuned
    max_num_seqs: int = 256  # largest decode batch: batch buckets beyond it are not tuned
    quant_group_size: int = 0  # int4 projections' group size (-1 per channel); 0 = half-type weights
    kv_cache_dtype: str | None = None  # the KV cache's dtype when not ``dtype`` ("float8_e4m3fn")
    # o_proj's int4 inputs on this rank when not num_heads * head_dim: an act-order checkpoint's
    # row-parallel shard padded to whole groups (builder/quant.py, row_layout); 0 = not padded.
    o_proj_inputs: int = 0
    # MoE blocks (0 for a dense model): experts, experts a token visits, each expert's
    # intermediate size on this rank (tensor parallelism cuts it, kernels/moe_routing.py).
    num_experts: int = 0
    top_k: int = 0
    moe_intermediate: int = 0
    # The experts' activation and biases (gpt-oss: "swiglu_oai" with its alpha and limit, biases on
    # gate_up and down): constexprs of the fused-MoE kernel, so they are timed, and compiled into the
    # artifact, in the variant the model runs.
    moe_activation: str = "silu"
    moe_alpha: float = 1.702
    moe_limit: float = 7.0
    moe_bias: bool = False
    # The router's bias (gpt-oss) and routing (kernels/moe_routing.MoeRouting's fields but top_k):
    # the fused router kernel's constexprs ("moe_router"), timed and compiled in the model's variant.
    moe_router_bias: bool = False
    moe_scoring: str = "softmax_topk"
    moe_renormalize: bool = False
    moe_weights_in_x_dtype: bool = False
    # Gemma 2's attention-logit soft-cap (0: none): the attention kernels are timed, and compiled into
    # the artifact, in the variant the model runs. Sliding windows are not timed: a sliding layer
    # reads at most its window, the full layers beside it are the larger work (attn_window below).
    attn_softcap: float = 0.0
    # gpt-oss's attention sinks (one logit per query head in every layer): timed, and compiled into
    # the artifact, in the HAS_SINKS variants the model runs (random sinks stand in for its own).
    attn_sinks: bool = False
    # A sliding window of the model's sliding layers (0: none). Not timed (see attn_softcap), but
    # compile_window_variants launches every attention config the table holds with it, so that the
    # SLIDING variants are in the artifact too.
    attn_window: int = 0
    # The attention chunk of the model's chunked layers (Llama 4; 0: none): their CHUNKED variants
    # are compiled as the SLIDING ones are (compile_window_variants), not timed.
    attn_chunk: int = 0
    activation: str = "silu"  # the gated MLP's activation: "gelu_tanh" times that kernel instead
    # FP8 (W8A8) projections: "<weights>-<activations>" of builder/fp8.py ("channel-token",
    # "channel-static", "block-group"); "" = not FP8.
    fp8: str = ""
    # The LM head's vocabulary rows on this rank when it is FP8 too (enginebuild --fp8-lm-head): its
    # fp8_gemm buckets ("lm_head.m<rows>") are tuned after the projections'; 0 = a half-type head.
    fp8_lm_head: int = 0
    # Projections (of PROJECTIONS) whose GEMM adds a bias (Qwen2's qkv; gpt-oss's qkv and o, but
    # not o at tp > 1, which adds it after the all-reduce): timed, and compiled into the artifact,
    # in the HAS_BIAS variant serving launches (builder/tune.biased_projections).
    biased: tuple[str, ...] = ()
    # Projections (qkv, gate_up) whose input a layer's RMSNorm makes in the same ops call
    # (ops.norm_linear: pre-norm layers): an FP8 one is timed with that norm, as serving runs it
    # (builder/tune.normed_projections).
    normed: tuple[str, ...] = ()
    # GPTQ act-order int4 weights: every projection but down reads its inputs through a perm
    # (builder/quant.py), so those are timed and compiled in their HAS_PERM variant.
    int4_act_order: bool = False
    # The rotated dimensions of each head when not all of them (partial_rotary_factor, Phi-4-mini's
    # 0.75): the rotary kernel's ROTARY_DIM constexpr; 0 = head_dim.
    rotary_dim: int = 0
    # The row widths of the model's q/k RMSNorms that run as rms_norm on this rank: the q and k
    # projections' widths normalising them whole (OLMo2, OLMoE); () otherwise (per-head norms run
    # in the rotary kernel: head_qk_norm). rms_norm's BLOCK is a constexpr: compile_norm_variants
    # compiles them.
    qk_norm_widths: tuple[int, ...] = ()
    # Each q and k head RMS-normalised inside the rotary kernel (Qwen3, Gemma 3: the QK_NORM variant
    # serving launches, so it is the one timed and compiled into the artifact).
    head_qk_norm: bool = False
    # ... applied to the rotated heads (HunYuan's, Llama 4's: the QK_NORM_AFTER variant), and some
    # layers without q/k norms (Llama 4's no-RoPE layers: the rotary kernel's plain variant is
    # compiled beside the timed one, Problem.variants).
    head_qk_norm_after: bool = False
    rotary_without_norm: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "biased", tuple(self.biased))  # JSON lists from the tune subprocess
        object.__setattr__(self, "normed", tuple(self.normed))
        object.__setattr__(self, "qk_norm_widths", tuple(self.qk_norm_widths))
        if self.rotary_dim < 0 or self.rotary_dim % 2 or self.rotary_dim > self.head_dim:
            raise ValueError(f"rotary_dim must be 0 (all of head_dim) or even and at most {self.head_dim}, got {self.rotary_dim}")
        for field_name in ("biased", "normed"):
            unknown = set(getattr(self, field_name)) - set(PROJECTIONS)
            if unknown:
                raise ValueError(f"{field_name} names projections {sorted(unknown)}, not among {PROJECTIONS}")
        if self.num_heads <= 0 or self.num_kv_heads <= 0 or self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads {self.num_heads} must be a positive multiple of num_kv_heads {self.num_kv_heads}"
            )
        if self.attn_window < 0:
            raise ValueError(f"attn_window must be 0 (no sliding layers) or a window, got {self.attn_window}")
        if self.attn_chunk < 0:
            raise ValueError(f"attn_chunk must be 0 (no chunked layers) or a chunk size, got {self.attn_chunk}")
        for name in ("head_dim", "hidden", "intermediate", "block_size", "max_model_len", "max_num_seqs"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        torch_dtype(self.dtype)
        if self.num_experts and not (1 <= self.top_k <= self.num_experts and self.moe_intermediate > 0):
            raise ValueError(
                f"a MoE model needs 1 <= top_k <= num_experts ({self.top_k}, {self.num_experts}) and a positive "
                f"moe_intermediate ({self.moe_intermediate})"
            )
        if self.kv_cache_dtype is not None and torch_dtype(self.kv_cache_dtype) not in (
            torch_dtype(self.dtype), torch.float8_e4m3fn
        ):
            raise ValueError(f"kv_cache_dtype must be the model's dtype or float8_e4m3fn (got {self.kv_cache_dtype!r})")

    @property
    def torch_dtype(self) -> torch.dtype:
        return torch_dtype(self.dtype)

    @property
    def kv_torch_dtype(self) -> torch.dtype:
        """The KV cache's dtype (the model's unless an fp8 cache was asked for)."""
        return torch_dtype(self.kv_cache_dtype or self.dtype)


_DTYPE_ALIASES = {
    "bf16": "bfloat16",
    "fp16": "float16",
    "half": "float16",
    "fp32": "float32",
    "float": "float32",
}


def torch_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    name = str(dtype).removeprefix("torch.")
    name = _DTYPE_ALIASES.get(name, name)
    value = getattr(torch, name, None)
    if not isinstance(value, torch.dtype):
        raise ValueError(f"unknown dtype {dtype!r}")  # noqa: TRY004 - a bad value, not a bad type
    return value


# ---------------------------------------------------------------------------- buckets


def _ceil_bucket(buckets: tuple[int, ...], value: int) -> int:
    i = bisect.bisect_left(buckets, value)
    return buckets[min(i, len(buckets) - 1)]


def decode_bucket(num_seqs: int, max_seq_len: int) -> str:
    """'<batch>x<context>' for the decode kernel, e.g. decode_bucket(40, 1000) == '64x2048'."""
    return (
        f"{_ceil_bucket(DECODE_BATCH_BUCKETS, num_seqs)}x{_ceil_bucket(DECODE_CONTEXT_BUCKETS, max_seq_len)}"
    )


def decode_fallback_buckets(bucket: str) -> list[str]:
    """Where a tuning table lacks ``bucket`` (built before its batch or context bucket existed),
    its nearest tuned neighbours in order: the same context at smaller batches, largest first,
    then each smaller context, largest first, at the same batch and then the smaller ones."""
    batch, context = (int(v) for v in bucket.split("x"))
    batches = [b for b in reversed(DECODE_BATCH_BUCKETS) if b <= batch]
    contexts = [c for c in reversed(DECODE_CONTEXT_BUCKETS) if c <= context]
    return [f"{b}x{c}" for c in contexts for b in batches if (b, c) != (batch, context)]


def token_bucket(num_tokens: int) -> str:
    """'t<tokens>' for the per-token kernels (norms, activation, rotary)."""
    return f"t{_ceil_bucket(TOKEN_BUCKETS, num_tokens)}"


def prefill_bucket(num_tokens: int, max_seq_len: int = 0) -> str:
    """'t<tokens>' for the prefill attention kernel (all query tokens of the batch), with
    '.c<context>' where the batch's longest sequence passes PREFILL_SHORT_CONTEXT tokens, e.g.
    prefill_bucket(8192, 20000) == 't8192.c32768'."""
    tokens = f"t{_ceil_bucket(PREFILL_TOKEN_BUCKETS, num_tokens)}"
    if max_seq_len <= PREFILL_SHORT_CONTEXT:
        return tokens
    return f"{tokens}.c{_ceil_bucket(PREFILL_CONTEXT_BUCKETS, max_seq_len)}"


def skinny_bucket(projection: str, num_rows: int) -> str:
    """'<projection>.m<rows>' for the skinny GEMM, e.g. skinny_bucket('qkv', 3) == 'qkv.m4'."""
    return f"{projection}.m{_ceil_bucket(SKINNY_ROW_BUCKETS, num_rows)}"


def w4a16_bucket(projection: str, num_rows: int) -> str:
    """'<projection>.m<rows>' for the W4A16 GEMM, e.g. w4a16_bucket('down', 100) == 'down.m128'."""
    return f"{projection}.m{_ceil_bucket(W4A16_ROW_BUCKETS, num_rows)}"


def moe_bucket(num_tokens: int) -> str:
    """'t<tokens>' for the fused-MoE kernel, e.g. moe_bucket(3) == 't4'."""
    return f"t{_ceil_bucket(MOE_TOKEN_BUCKETS, num_tokens)}"


# The FP8 GEMM's row buckets: the W4A16 ones (decode sizes, then prefill chunks).
FP8_ROW_BUCKETS = W4A16_ROW_BUCKETS


def fp8_bucket(projection: str, num_rows: int) -> str:
    """'<projection>.m<rows>' for the FP8 GEMM, e.g. fp8_bucket('qkv', 3) == 'qkv.m4'."""
    return f"{projection}.m{_ceil_bucket(FP8_ROW_BUCKETS, num_rows)}"


def projection_dims(shapes: ModelShapes) -> dict[str, tuple[int, int]]:
    """(out features N, in features K) of each projection of one layer on this rank."""
    q = shapes.num_heads * shapes.head_dim
    kv = shapes.num_kv_heads * shapes.head_dim
    return {
        "qkv": (q + 2 * kv, shapes.hidden),
        "o": (shapes.hidden, shapes.o_proj_inputs or q),
        "gate_up": (2 * shapes.intermediate, shapes.hidden),
        "down": (shapes.hidden, shapes.intermediate),
    }


def bucket_for(kernel: str, **dims: int) -> str:
    if kernel == "paged_decode_attention":
        return decode_bucket(dims["num_seqs"], dims["max_seq_len"])
    if kernel == "paged_prefill_attention":
        return prefill_bucket(dims["num_tokens"], dims.get("max_seq_len", 0))
    return token_bucket(dims["num_tokens"])


def lookup(table: Mapping[str, Any] | None, kernel: str, bucket: str) -> dict[str, int] | None:
    """The config dict for (kernel, bucket) from a tuning table, or None when it has none.

    Accepts the whole table ({"kernels": ...}) or its "kernels" part, and entries that are
    either {"config": {...}, ...} or a bare config dict.
    """
    entry = table_entry(table, kernel, bucket)
    if entry is None:
        return None
    config = entry.get("config", entry)
    return dict(config) if isinstance(config, Mapping) else None


def table_entry(table: Mapping[str, Any] | None, kernel: str, bucket: str) -> Mapping[str, Any] | None:
    """The (kernel, bucket) entry of a tuning table as written (``lookup``'s table forms), or None."""
    if not table:
        return None
    kernels = table.get("kernels", table)
    entry = kernels.get(kernel, {}).get(bucket) if isinstance(kernels, Mapping) else None
    return entry if isinstance(entry, Mapping) else None


@functools.cache
def _device_sms(index: int) -> int:
    return int(torch.cuda.get_device_properties(index).multi_processor_count)


def num_sms(device: torch.device | int | None = None) -> int:
    """Multiprocessors of the current (or given) CUDA device; 132 (an H100/H200) without one."""
    if not torch.cuda.is_available():
        return 132
    if device is None:
        index = torch.cuda.current_device()
    else:
        index = device if isinstance(device, int) else (torch.device(device).index or 0)
    return _device_sms(index)


# ---------------------------------------------------------------------------- timing


def time_launches(launch: Callable[[int], object], launches: int, reps: int = 10) -> float:
    """Median microseconds per launch of ``launch(i)`` for i in range(launches).

    The launches are captured in one CUDA graph (as the runtime runs decode steps) and each
    of ``reps`` replays is timed with CUDA events; without a capture it times them eagerly.
    """
    launch(0)  # compile and warm up
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            for i in range(launches):
                launch(i)
        run: Callable[[], object] = graph.replay
    except Exception:  # noqa: BLE001 - a launch that cannot be captured is still timed
        torch.cuda.synchronize()

        def run() -> object:
            return [launch(i) for i in range(launches)]

    run()
    torch.cuda.synchronize()
    samples = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / launches)
    del graph
    return statistics.median(samples)


def _median_event_seconds(fn: Callable[[], object], reps: int) -> float:
    """Seconds of one ``fn()`` on the device (after one untimed call): the median of ``reps``,
    each timed alone with CUDA events."""
    fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / 1e3)
    return statistics.median(samples)


def measure_copy_bandwidth(
    device: torch.device | str = "cuda", nbytes: int = 2 << 30, reps: int = 10
) -> float:
    """Device-to-device copy bandwidth in GB/s, counting bytes read plus bytes written."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    return 2 * nbytes / _median_event_seconds(lambda: dst.copy_(src), reps) / 1e9


def measure_matmul_tflops(device: torch.device | str = "cuda", n: int = 8192, reps: int = 10) -> float:
    """The bf16 matmul rate in TFLOP/s: an n x n x n torch.mm (cuBLAS), the median of ``reps``."""
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    return 2 * n**3 / _median_event_seconds(lambda: torch.mm(a, b), reps) / 1e12


# ---------------------------------------------------------------------------- tuning

MAX_TUNE_KV_BYTES = 8 << 30  # larger decode buckets reuse the config of a smaller context
ALTERNATIVES_KEPT = 5

# Compiling a bucket's configs at once, in threads, before timing them one by one. Tuning is
# compile-bound: an FP8 build on an H200 spent 90 of fp8_gemm's 107 s in first launches (where
# Triton compiles) and 3.7 s timing. With 8 compile threads the same build's fp8_gemm took 41.7 s
# and the 100 s budget tuned every bucket, where it had cut 79 of them (benchmarks/RESULTS.md,
# tenth and eleventh sessions). Default: min(8, the CPUs this process may use); set
# PAGECAST_TUNE_COMPILE_THREADS=N to choose (0 or 1: one at a time).
COMPILE_THREADS_ENV = "PAGECAST_TUNE_COMPILE_THREADS"
DEFAULT_COMPILE_THREADS = 8
_COMPILE_ONLY: Any = None  # contextvars.ContextVar[bool], made with the hook below


def compile_threads(device: torch.device | str = "cuda") -> int:
    """Threads that compile a bucket's configs ahead of their timing (COMPILE_THREADS_ENV, else
    min(DEFAULT_COMPILE_THREADS, usable CPUs) on a GPU; else none: Triton's interpreter, on the
    CPU, compiles nothing)."""
    value = os.environ.get(COMPILE_THREADS_ENV, "").strip()
    if not value:
        if torch.device(device).type != "cuda":
            return 0
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        return min(DEFAULT_COMPILE_THREADS, cpus)
    try:
        return max(0, int(value))
    except ValueError:
        raise ValueError(f"{COMPILE_THREADS_ENV} must be a whole number of threads, got {value!r}") from None


def _install_compile_only_hook() -> None:
    """Make Triton's launches compile without running while _COMPILE_ONLY is set (in this
    context only): JITFunction.run with warmup=True, which Triton's own JITFunction.warmup uses."""
    global _COMPILE_ONLY
    import contextvars

    from triton.runtime.jit import JITFunction

    if _COMPILE_ONLY is None:
        _COMPILE_ONLY = contextvars.ContextVar("pagecast_tune_compile_only", default=False)
    if getattr(JITFunction.run, "_pagecast_compile_only", False):
        return
    original = JITFunction.run

    def run(self: Any, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> Any:
        return original(self, *args, grid=grid, warmup=warmup or _COMPILE_ONLY.get(), **kwargs)

    run._pagecast_compile_only = True  # type: ignore[attr-defined]
    JITFunction.run = run  # type: ignore[method-assign]


def precompile(problem: Any, configs: list[KernelConfig], threads: int) -> int:
    """Compile every Triton kernel that ``problem.launch`` (and ``problem.variants``) would
    launch for each of ``configs``, in ``threads`` threads at once (Triton's AsyncCompileMode),
    launching none of them. The launcher's own torch operations still run (on the uninitialised
    outputs of the kernels not launched: no launcher reads a device value on the host). A config
    that fails here is left to the timing loop, which meets and reports the same error. Returns
    the configs whose launch ran through."""
    return _compile_only([functools.partial(_launch_with_variants, problem, cfg) for cfg in configs], threads)


def precompile_defaults(make: list[Callable[[], tuple[Any, KernelConfig]]], threads: int) -> int:
    """Once the budget has run out, the buckets left each still compile their default (serving
    must find it in the artifact's cache): compile them all at once, in ``threads`` threads, rather
    than one bucket after another. ``make``: for each bucket, a function making its problem and
    default config (each problem is dropped once its launch, and its variants', have handed Triton
    their compiles).
    Returns the launches that ran through."""
    return _compile_only([lambda m=m: _launch_with_variants(*m()) for m in make], threads)


def _launch_with_variants(problem: Any, cfg: KernelConfig) -> None:
    """``problem``'s launch at ``cfg``, and the variants serving may launch beside it."""
    problem.launch(cfg, 0)
    if problem.variants is not None:
        problem.variants(cfg)


def _compile_only(launches: list[Callable[[], None]], threads: int) -> int:
    """Run ``launches`` with every Triton launch turned into a compile, ``threads`` compiles at a
    time; returns how many ran through (a failure is left to the launch that meets it later)."""
    from concurrent.futures import ThreadPoolExecutor

    from triton.runtime._async_compile import AsyncCompileMode

    _install_compile_only_hook()
    failed = 0
    token = _COMPILE_ONLY.set(True)
    try:
        with (
            ThreadPoolExecutor(threads, thread_name_prefix="pagecast-compile") as pool,
            AsyncCompileMode(pool, ignore_errors=True),
        ):
            for launch in launches:
                try:
                    launch()
                except Exception:  # noqa: BLE001 - the timing loop meets and reports the same error
                    failed += 1
    finally:
        _COMPILE_ONLY.reset(token)
    return len(launches) - failed


ROUTER_FIELDS = ("moe_router_bias", "moe_scoring", "moe_renormalize", "moe_weights_in_x_dtype")


def table_shapes(shapes: ModelShapes) -> dict[str, Any]:
    """A table's ``shapes``: the ModelShapes fields as JSON has them, dtypes by name."""
    fields = {
        **shapes.__dict__,
        "dtype": str(shapes.torch_dtype).removeprefix("torch."),
        "kv_cache_dtype": str(shapes.kv_torch_dtype).removeprefix("torch."),
    }
    return json.loads(json.dumps(fields))  # tuples as lists, as a table read back has them


def check_pinned(table: Mapping[str, Any], shapes: ModelShapes, device_name: str) -> dict[str, Any]:
    """The kernels of ``table`` (another build's tuning.json) for ``tune(pinned=...)``, after
    checking that it was tuned for these shapes on this GPU model: a config chosen for other shapes
    or another GPU may not even run here. ValueError says what differs."""
    if not isinstance(table.get("kernels"), Mapping) or not isinstance(table.get("shapes"), Mapping):
        raise ValueError("not a tuning table (tuning.json of a GPU build): it has no 'kernels' or 'shapes'")  # noqa: TRY004 - a file's content
    if table.get("device") != device_name:
        raise ValueError(f"it was tuned on a {table.get('device')!r}, and this GPU is a {device_name!r}")
    ours, theirs = table_shapes(shapes), table["shapes"]
    # An FP8 LM head only adds buckets of its own ("lm_head.m<rows>"): the projections' are the same
    # problems with or without it, so a build with --fp8-lm-head may reuse a table without (or one
    # written before the field existed), and back. The router's fields only shape the "moe_router"
    # buckets, which a table written before they existed lacks (tuned afresh when reused).
    differ = sorted(
        k for k in set(ours) | set(theirs)
        if ours.get(k) != theirs.get(k) and k != "fp8_lm_head" and not (k in ROUTER_FIELDS and k not in theirs)
    )  # fmt: skip
    if differ:
        what = ", ".join(f"{k} {theirs.get(k)!r} (this build: {ours.get(k)!r})" for k in differ[:6])
        raise ValueError(f"it was tuned for other model shapes: {what}")
    return {k: v for k, v in table["kernels"].items() if isinstance(v, Mapping)}


def tune(
    kernel_names: list[str] | tuple[str, ...],
    shapes: ModelShapes,
    budget_s: float,
    device: torch.device | str = "cuda",
    reps: int = 10,
    log: Callable[[str], None] | None = None,
    pinned: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Time each kernel's config space over its shape buckets on ``device`` and keep the winners.

    ``pinned``: another table of the same shapes and GPU (``check_pinned``), whose configs are
    kept instead of choosing anew (enginebuild --tuning-from): each of its buckets runs its
    config alone, compiled and timed here, marked ``pinned``; buckets it lacks are tuned as usual.

    Returns a JSON-able table (see the module docstring). Each entry holds the winning
    config, its median time, ``alternatives`` (the next fastest configs and their times) and
    ``tuned`` (False when the budget ran out first and the launcher's default was kept, or
    when the entry was derived from a smaller bucket), and ``budget_spent`` where the budget
    had run out before the bucket began (only the default was timed; ``untuned_buckets``
    counts them), and ``rejected`` where configs computed a different result from the first
    config's (``output_disagreement``; ``error`` None for a NaN/inf or a wrong shape) and were
    not timed. Every config in the table has been launched on ``device``, so its compiled
    kernel is in TRITON_CACHE_DIR.
    """
    from pagecast.kernels import pdl, problems

    unknown = [k for k in kernel_names if k not in KERNELS + MOE_KERNELS]
    if unknown:
        raise ValueError(f"unknown kernels {unknown}; known: {KERNELS + MOE_KERNELS}")
    device = torch.device(device)
    threads = compile_threads(device)
    deadline = time.monotonic() + budget_s
    device_name = torch.cuda.get_device_name(device)
    pinned_kernels = check_pinned(pinned, shapes, device_name) if pinned else {}
    table: dict[str, Any] = {
        "kernels": {},
        "device": device_name,
        "tuned": True,
        "shapes": table_shapes(shapes),
        "versions": {"torch": torch.__version__, "triton": _triton_version()},
        "compile_threads": threads,
        # The decode kernels compiled and timed with programmatic dependent launch (kernels/pdl.py,
        # PAGECAST_PDL=1 at build); serving launches them the same way.
        "pdl": pdl.enabled(),
    }
    if pdl.enabled():
        pdl.check_device(device)
    # Where the time goes, per kernel (seconds): making each bucket's problem, each config's first
    # launch (Triton compiles its kernel there, or loads it from the cache), timing, and the rest
    # (the half-type reference, the variants compiled beside a config).
    seconds: dict[str, dict[str, float]] = {}
    table["tune_seconds"] = seconds
    for kernel in kernel_names:
        entries: dict[str, Any] = {}
        table["kernels"][kernel] = entries
        spent = seconds.setdefault(kernel, {"problems": 0.0, "first_launches": 0.0, "timing": 0.0, "other": 0.0})
        pinned_here = pinned_kernels.get(kernel) or {}
        rest_compiled = False  # the defaults of the buckets past the deadline, compiled at once
        kernel_buckets = list(problems.buckets(kernel, shapes))
        for index, (bucket, dims) in enumerate(kernel_buckets):
            if threads > 1 and not rest_compiled and bucket not in pinned_here and time.monotonic() > deadline:
                rest_compiled = True
                t0 = time.monotonic()
                rest = [
                    functools.partial(_problem_and_default, kernel, shapes, d, device)
                    for b, d in kernel_buckets[index:]
                    if b not in pinned_here and not _over_tuning_kv(kernel, shapes, d)
                ]
                if log:
                    log(f"{kernel}: the budget is spent; compiling the defaults of its {len(rest)} buckets left")
                precompile_defaults(rest, threads)
                if device.type == "cuda":
                    torch.cuda.synchronize()
                spent["first_launches"] += time.monotonic() - t0
            if _over_tuning_kv(kernel, shapes, dims):
                smaller = [b for b, d in kernel_buckets if d["num_seqs"] == dims["num_seqs"] and b in entries]
                if smaller:
                    entries[bucket] = {
                        "config": entries[smaller[-1]]["config"],
                        "time_us": None,
                        "alternatives": [],
                        "tuned": False,
                        "derived_from": smaller[-1],
                    }
                    continue
            t0 = time.monotonic()
            problem, default = _problem_and_default(kernel, shapes, dims, device)
            spent["problems"] += time.monotonic() - t0
            launches = problem.launches_per_sample()
            results: list[tuple[float, int, KernelConfig]] = []
            configs = problems.config_space(kernel, shapes, dims)
            source = pinned_here.get(bucket)
            budget_spent = source is None and time.monotonic() > deadline
            if source is not None:
                configs = [KernelConfig.coerce(source["config"])]  # type: ignore[list-item]
            elif budget_spent:
                # Only the launcher's default is timed (and compiled into the cache), and the
                # previous bucket's winner where this bucket can run it: neighbouring buckets
                # mostly share a winner, and a default can be far off (an FP8 build with a 45 s
                # budget on an H200 kept a 95 us default for gate_up at 16 rows, where the 1-row
                # bucket's winner took 34 us at 1 row; its 16-row time was not measured).
                previous = _previous_winner(entries, configs)
                configs = [default] + ([previous] if previous is not None and previous != default else [])
            else:
                # The default first: a bucket the budget cuts short has at least it, and so does one
                # whose pruned space leaves it out (the launcher's default runs at every shape: the
                # tiny Qwen3-MoE's per-pair decode GEMV, BLOCK_K 32, is in no space).
                configs = [default] + [c for c in configs if c != default]
            if log:
                log(f"{kernel} {bucket}: {len(configs)} configs")
            if threads > 1 and not budget_spent and len(configs) > 1:  # (a pinned bucket has one)
                t0 = time.monotonic()
                precompile(problem, configs, threads)
                if device.type == "cuda":
                    torch.cuda.synchronize()
                spent["first_launches"] += time.monotonic() - t0
            baseline: list[torch.Tensor] | None = None  # the first config's outputs (the default's)
            rejected: list[dict[str, Any]] = []
            for order, cfg in enumerate(configs):
                t0 = time.monotonic()
                if log:
                    log(f"{kernel} {bucket} {cfg.as_dict()}")
                try:
                    out = problem.launch(cfg, 0)  # compiled (or loaded) here; time_launches warms up again
                    if device.type == "cuda":
                        torch.cuda.synchronize()
                    outputs = _output_tensors(out)
                    if baseline is None:
                        baseline = [t.detach().clone() for t in outputs]
                    else:
                        error = output_disagreement(outputs, baseline)
                        if error is not None:
                            # error None: a NaN/inf where the default has a number, or another shape
                            finite = error != float("inf")
                            rejected.append({"config": cfg.as_dict(), "error": round(error, 4) if finite else None})
                            if log:
                                log(f"{kernel} {bucket} {cfg.as_dict()}: REJECTED, its output differs from the "
                                    f"first config's by {error:.3g} of the largest value")
                            spent["first_launches"] += time.monotonic() - t0
                            continue
                    t1 = time.monotonic()
                    t_us = time_launches(functools.partial(problem.launch, cfg), launches, reps)
                except Exception as exc:  # noqa: BLE001 - e.g. out of shared memory: skip this config
                    if log:
                        log(f"{kernel} {bucket} {cfg.as_dict()}: {type(exc).__name__}: {str(exc)[:120]}")
                    torch.cuda.synchronize()
                    spent["first_launches"] += time.monotonic() - t0
                    continue
                spent["first_launches"] += t1 - t0
                spent["timing"] += time.monotonic() - t1
                results.append((t_us, order, cfg))
                if problem.variants is not None:
                    t0 = time.monotonic()
                    problem.variants(cfg)
                    spent["other"] += time.monotonic() - t0
                if time.monotonic() > deadline and results and not budget_spent:
                    break
            if not results:
                pin = f" (its config pinned by the table reused: {source['config']})" if source is not None else ""
                raise RuntimeError(f"no config of {kernel} ran at bucket {bucket}{pin}")
            best = results[0]
            for r in results[1:]:
                if r[0] < best[0] * (1 - TIE_TOLERANCE):
                    best = r
            others = sorted((r for r in results if r is not best), key=lambda r: (r[0], r[1]))
            entries[bucket] = {
                "config": best[2].as_dict(),
                "time_us": round(best[0], 2),
                "alternatives": [
                    {"config": c.as_dict(), "time_us": round(t, 2)} for t, _, c in others[:ALTERNATIVES_KEPT]
                ],
                "tuned": not budget_spent and (len(results) > 1 or len(configs) == 1),
            }
            if source is not None:
                entries[bucket]["tuned"] = bool(source.get("tuned", False))  # as chosen where it was timed
                entries[bucket]["pinned"] = True
            if budget_spent:
                entries[bucket]["budget_spent"] = True
            if rejected:
                entries[bucket]["rejected"] = rejected
            entries[bucket].update(problem.marks)
            if problem.apart is not None and not budget_spent:
                t0 = time.monotonic()
                entries[bucket].update(_time_apart(problem, best, launches, reps, log))
                spent["other"] += time.monotonic() - t0
            if problem.reference is not None:  # the half-type baseline, for the report (never chosen)
                t0 = time.monotonic()
                entries[bucket]["reference_us"] = round(
                    time_launches(functools.partial(problem.reference, None), launches, reps), 2
                )
                spent["other"] += time.monotonic() - t0
            if log:
                log(f"{kernel} {bucket}: {best[0]:.2f} us {best[2].as_dict()} ({len(results)} configs)")
        seconds[kernel] = {k: round(v, 2) for k, v in spent.items()}
    return table


def _time_apart(
    problem: Any, best: tuple[float, int, KernelConfig], launches: int, reps: int, log: Callable[[str], None] | None
) -> dict[str, Any]:
    """The bucket's work with the projection's input made in a launch of its own (Problem.apart), timed
    with the best config: its time, and the "feed_apart" mark where it beats the best by
    TIE_TOLERANCE (serving then runs the bucket that way, kernels/ops.py). A launch that fails
    leaves the bucket as tuned."""
    try:
        apart_us = time_launches(functools.partial(problem.apart, best[2]), launches, reps)
    except Exception as exc:  # noqa: BLE001 - the fused form stays
        if log:
            log(f"{problem.kernel} {problem.bucket} apart: {type(exc).__name__}: {str(exc)[:120]}")
        return {}
    marks: dict[str, Any] = {"apart_us": round(apart_us, 2)}
    if apart_us < best[0] * (1 - TIE_TOLERANCE):
        marks["feed_apart"] = True
    if log:
        log(f"{problem.kernel} {problem.bucket}: input made apart {apart_us:.2f} us" + (" (kept)" if "feed_apart" in marks else ""))
    return marks


def _problem_and_default(kernel: str, shapes: ModelShapes, dims: dict[str, int], device: torch.device) -> tuple[Any, KernelConfig]:
    """A bucket's problem (seeded) and its launcher's default config."""
    from pagecast.kernels import problems

    torch.manual_seed(0)
    return problems.make_problem(kernel, shapes, dims, device, seed=0), problems.default_config(kernel, shapes, dims)


def _over_tuning_kv(kernel: str, shapes: ModelShapes, dims: dict[str, int]) -> bool:
    """A decode-attention bucket whose KV is past MAX_TUNE_KV_BYTES (it takes a smaller context's
    config where one with its batch was tuned)."""
    from pagecast.kernels import problems

    return kernel == "paged_decode_attention" and problems.kv_bytes(shapes, dims) > MAX_TUNE_KV_BYTES


# How far a config's output may stray from the bucket's first config's (the launcher's default,
# timed first) before the tuner refuses it: the largest difference over the largest magnitude of
# the first config's output. Configs of one kernel compute the same thing and differ in the order
# of their sums and where they round (half-type outputs: 2^-9 of a value; fp32 sums in another
# order: far less), so 2% lets every legitimate difference through, and catches a miscompiled or
# wrongly masked config (a missing K tile, a dropped split, a wrong column block: tens of percent,
# or NaN where the first has a number) before it is timed, let alone kept.
DISAGREEMENT_TOLERANCE = 0.02


def _output_tensors(out: object) -> list[torch.Tensor]:
    """The tensors a problem's launch returned (one, or a tuple of them; none for a kernel that
    returns nothing)."""
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [t for t in out if isinstance(t, torch.Tensor)]
    return []


def output_disagreement(outputs: list[torch.Tensor], baseline: list[torch.Tensor]) -> float | None:
    """None when ``outputs`` match ``baseline`` (same shapes; within DISAGREEMENT_TOLERANCE of its
    largest magnitude wherever the baseline is finite, and finite there too), else the largest
    relative difference (inf for a shape mismatch or a NaN/inf where the baseline has a number)."""
    if len(outputs) != len(baseline):
        return float("inf")
    worst = 0.0
    for got, ref in zip(outputs, baseline, strict=True):
        if got.shape != ref.shape:
            return float("inf")
        if ref.dtype in (torch.int32, torch.int64, torch.bool):
            if not torch.equal(got, ref):
                return float("inf")
            continue
        ref32, got32 = ref.float(), got.float()
        finite = torch.isfinite(ref32)
        if not bool(torch.isfinite(got32[finite]).all()):
            return float("inf")
        if not bool(finite.any()):
            continue
        scale = float(ref32[finite].abs().max())
        diff = float((got32[finite] - ref32[finite]).abs().max())
        worst = max(worst, diff / scale if scale > 0 else diff)
    return worst if worst > DISAGREEMENT_TOLERANCE else None


def _previous_winner(entries: Mapping[str, Any], configs: list[KernelConfig]) -> KernelConfig | None:
    """The config the last tuned bucket of this kernel kept, if it is in ``configs`` (this
    bucket's space: a config of a smaller bucket may not fit a larger one)."""
    for entry in reversed(list(entries.values())):
        if entry.get("budget_spent") or entry.get("derived_from"):
            continue
        winner = KernelConfig.coerce(entry["config"])
        return winner if winner in configs else None
    return None


def _servable_configs(
    table: Mapping[str, Any], kernel: str, defaults: list[KernelConfig | None]
) -> list[KernelConfig]:
    """Every distinct config serving can launch ``kernel`` with: those of its table entries, and
    ``defaults`` (the launcher's, where a lookup finds none), each once."""
    entries = table.get("kernels", {}).get(kernel, {})
    configs: dict[tuple, KernelConfig] = {}
    for cfg in [*(KernelConfig.coerce(lookup(table, kernel, b)) for b in entries), *defaults]:
        if cfg is not None:
            configs.setdefault((tuple(sorted(cfg.params.items())), cfg.num_warps, cfg.num_stages), cfg)
    return list(configs.values())


def compile_window_variants(table: Mapping[str, Any], shapes: ModelShapes, device: torch.device | str) -> int:
    """Launch both attention kernels with ``shapes.attn_window`` (and with ``shapes.attn_chunk``)
    at every config a layer can run them with (each in the tuning table for them, and each
    bucket's launcher default), once, so that their SLIDING (CHUNKED) variants (constexprs) are
    compiled into TRITON_CACHE_DIR beside the timed full-attention ones. The window is not a
    specialised argument, so one window covers every window. Returns the number of launches (0 for
    a model without sliding or chunked layers)."""
    from pagecast.kernels import problems

    masks = [m for m in ({"window": shapes.attn_window}, {"chunk": shapes.attn_chunk}) if next(iter(m.values()))]
    launches = 0
    for kernel in ("paged_decode_attention", "paged_prefill_attention"):
        buckets = problems.buckets(kernel, shapes)
        if not buckets or not masks:
            continue
        defaults = [problems.default_config(kernel, shapes, dims) for _, dims in buckets]
        configs = _servable_configs(table, kernel, defaults)
        for mask in masks:
            # the smallest bucket's inputs: every config's variant, at the least cost
            problem = problems.make_problem(kernel, shapes, buckets[0][1], device, seed=0, **mask)
            for cfg in configs:
                problem.launch(cfg, 0)
                launches += 1
    return launches


def compile_norm_variants(table: Mapping[str, Any], shapes: ModelShapes, device: torch.device | str) -> int:
    """Launch rms_norm at each of ``shapes.qk_norm_widths`` with every config serving can pick for
    it (each in the table's rms_norm entries, whose buckets the q/k norms look up by their own row
    counts, and the launcher's default at that width), once, so that those BLOCK variants are
    compiled into TRITON_CACHE_DIR beside the timed hidden-width ones. Returns the launches."""
    from pagecast.kernels import rms_norm

    launches = 0
    for width in shapes.qk_norm_widths:
        x = torch.randn((16, width), device=device, dtype=shapes.torch_dtype)
        weight = torch.ones((width,), device=device, dtype=shapes.torch_dtype)
        for cfg in _servable_configs(table, "rms_norm", [rms_norm.default_config(width)]):
            rms_norm.rms_norm(x, weight, 1e-6, config=cfg)
            launches += 1
    return launches


def compile_fp8_input_variants(table: Mapping[str, Any], shapes: ModelShapes, device: torch.device | str) -> int:
    """For an FP8 build (``shapes.fp8``): launch the kernels that quantise an FP8 projection's input
    in the launch that makes it, where ops runs them (more than 16 rows: ops.norm_linear,
    fp8_gemm.fp8_act_and_mul_linear) - the norm with every config serving can pick for rms_norm
    (layer 0) and fused_add_rms_norm (the rest), and the gated activation - once each, so that
    they are in TRITON_CACHE_DIR whatever the tuning budget reached. Returns the launches."""
    from pagecast.kernels import activation, fp8_gemm, rms_norm

    if not shapes.fp8:
        return 0
    activations = shapes.fp8.partition("-")[2]
    dtype, h, launches = shapes.torch_dtype, shapes.hidden, 0
    x, residual = (torch.randn((32, h), device=device, dtype=dtype) for _ in range(2))
    weight = torch.ones((h,), device=device, dtype=dtype)
    scale = torch.ones((1,), device=device)
    for kernel, res in (("rms_norm", None), ("fused_add_rms_norm", residual)):
        for cfg in _servable_configs(table, kernel, [rms_norm.default_config(h)]):
            rms_norm.rms_norm_fp8(x, res, weight, 1e-6, activations, scale, cfg)
            launches += 1
    if shapes.activation in ("silu", "gelu_tanh"):
        gate_up = torch.randn((32, 2 * shapes.intermediate), device=device, dtype=dtype)
        activation.act_and_mul_fp8(gate_up, shapes.activation, activations, scale)
        # and the separate quantisation of down's input, for a server with the fusion off
        # (PAGECAST_FUSE_ACT_QUANT_FP8=0, the same-artifact comparison): no compile while it serves
        fp8_gemm.quantize_activations(gate_up[:, : shapes.intermediate], activations, scale)
        launches += 2
    return launches + _compile_fp8_decode_unfused(table, shapes, device)


def _compile_fp8_decode_unfused(table: Mapping[str, Any], shapes: ModelShapes, device: torch.device | str) -> int:
    """For a server with the decode fusions off (PAGECAST_FUSE_NORM_DECODE=0: the norm before
    qkv and gate_up in its own launch; PAGECAST_FUSE_ACT_QUANT_FP8=0: down's activation), the
    same-artifact comparison: the fused decode kernel without its norm or activation (what the
    tuner times in their place, ModelShapes.normed and the gated down) at each such bucket of 1-16
    rows whose config is SKINNY, at its rows (and one fewer at 16). Returns the launches."""
    from pagecast.kernels import fp8_gemm, problems

    if not shapes.fp8:
        return 0
    launches = 0
    dims = dict(problems.buckets("fp8_gemm", shapes))
    fused = [*shapes.normed, *(("down",) if shapes.activation in ("silu", "gelu_tanh") else ())]
    for projection in fused:
        n, k = projection_dims(shapes)[projection]
        weight = None
        bias = torch.zeros((n,), device=device, dtype=shapes.torch_dtype) if projection in shapes.biased else None
        for m in (b for b in FP8_ROW_BUCKETS if b <= fp8_gemm.SKINNY_MAX_ROWS):
            bucket = fp8_bucket(projection, m)
            cfg = KernelConfig.coerce(lookup(table, "fp8_gemm", bucket)) or problems.default_config("fp8_gemm", shapes, dims[bucket])
            if not fp8_gemm.is_skinny(cfg):
                continue
            if weight is None:
                weight = problems.random_fp8_weight(shapes, n, k, device)
            for rows in (m, m - 1) if m % 16 == 0 else (m,):
                x = torch.randn((rows, k), device=device, dtype=shapes.torch_dtype)
                fp8_gemm.fp8_linear(x, weight, bias, cfg)
                launches += 1
    return launches


def compile_router_norm_variants(table: Mapping[str, Any], shapes: ModelShapes, device: torch.device | str) -> int:
    """Launch the fused router with the residual add and RMSNorm inside (NORM, what
    ops.add_norm_moe runs where the table fuses the router) at each "moe_router" bucket whose
    config is fused, at the bucket's token count (the ROUTE_T variant it serves), once, so that
    those variants go into TRITON_CACHE_DIR beside the timed ones. Returns the launches."""
    from pagecast.kernels import moe_route_kernel
    from pagecast.kernels.moe_routing import MoeRouting, weights_dtype

    entries = table.get("kernels", {}).get("moe_router", {})
    launches = 0
    e, h, dtype = shapes.num_experts, shapes.hidden, shapes.torch_dtype
    routing = MoeRouting(
        shapes.top_k, scoring=shapes.moe_scoring, renormalize=shapes.moe_renormalize,
        weights_in_x_dtype=shapes.moe_weights_in_x_dtype,
    )  # fmt: skip
    for bucket in entries:
        cfg = KernelConfig.coerce(lookup(table, "moe_router", bucket))
        t = int(bucket.lstrip("t"))
        if not moe_route_kernel.runs_fused(cfg, t, e, shapes.top_k):
            continue
        hidden, residual = (torch.randn((t, h), device=device, dtype=dtype) for _ in range(2))
        router = torch.randn((e, h), device=device, dtype=dtype)
        bias = torch.zeros((e,), device=device, dtype=dtype) if shapes.moe_router_bias else None
        moe_route_kernel.add_norm_router_route(
            hidden, residual, torch.ones((h,), device=device, dtype=dtype), 1e-6, router, bias, shapes.top_k,
            routing.scoring, routing.renormalize, weights_dtype(routing, dtype), True, cfg,  # type: ignore[arg-type]
        )  # fmt: skip
        launches += 1
    return launches


def untuned_buckets(table: Mapping[str, Any]) -> dict[str, list[str]]:
    """Kernel -> the buckets whose tuning the budget cut off (``budget_spent``: the launcher's
    default config was kept untimed against the others)."""
    out: dict[str, list[str]] = {}
    for kernel, entries in (table.get("kernels") or {}).items():
        cut = [bucket for bucket, entry in entries.items() if entry.get("budget_spent")]
        if cut:
            out[kernel] = cut
    return out


def _triton_version() -> str:
    try:
        import triton

        return str(triton.__version__)
    except ImportError:
        return "none"


# ---------------------------------------------------------------------------- shipped tables and reports


def gpu_key(gpu_name: str) -> str:
    """'NVIDIA H200' -> 'h200', 'NVIDIA A100-SXM4-80GB' -> 'a100', 'h100' -> 'h100'."""
    name = gpu_name.lower().replace("nvidia", " ").replace("-", " ").replace("_", " ")
    for token in name.split():
        if any(ch.isdigit() for ch in token):
            return token
    return name.strip()


def default_table(gpu_name: str) -> dict[str, Any] | None:
    """The shipped table for a GPU (kernels/tuning_defaults/<gpu>.json), or None when there is none.

    A shipped table's "tuned" says whether it was measured on that GPU (true) or is a guess.
    """
    path = _DEFAULTS_DIR / f"{gpu_key(gpu_name)}.json"
    if not path.is_file():
        return None
    with path.open() as f:
        table: dict[str, Any] = json.load(f)
    return table


def bandwidth_report(
    table: Mapping[str, Any], shapes: ModelShapes, copy_bandwidth_gbs: float
) -> list[dict[str, Any]]:
    """One row per kernel and bucket: time, bytes moved, achieved GB/s and its fraction of copy
    bandwidth (and TFLOP/s for attention), for the artifact's report.md."""
    from pagecast.kernels import problems

    rows = []
    for kernel, entries in table.get("kernels", {}).items():
        dims_by_bucket = dict(problems.buckets(kernel, shapes))
        for bucket, entry in entries.items():
            t_us = entry.get("time_us")
            if bucket not in dims_by_bucket or not t_us:
                continue
            nbytes, flops = problems.problem_size(kernel, shapes, dims_by_bucket[bucket])
            gbs = nbytes / (t_us * 1e-6) / 1e9
            rows.append(
                {
                    "kernel": kernel,
                    "bucket": bucket,
                    "time_us": t_us,
                    "bytes": nbytes,
                    "gb_s": round(gbs, 1),
                    "fraction_of_copy": round(gbs / copy_bandwidth_gbs, 3) if copy_bandwidth_gbs else None,
                    "tflop_s": round(flops / (t_us * 1e-6) / 1e12, 1) if flops else None,
                    "config": entry.get("config"),
                }
            )
    return rows
