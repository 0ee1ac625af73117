"""EngineCore: the part of the engine that owns the device. add_request / finish / step.

It holds the model, the KV cache, the block pool, the scheduler and the model runner, and
knows nothing about text: a step returns the sequences that received tokens (and their
logprobs). ``LLMEngine`` puts an output processor (detokenizer, stop strings, n-way
folding) on top of it in one process; ``core_process`` runs it alone in an engine-core
process and sends each step's tokens to the server, which detokenizes there.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import gc
import logging
import os
import re
import time
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from pagecast.runtime.artifact import DEFAULT_MAX_NUM_SEQS, DEFAULT_STEP_TOKENS
from pagecast.runtime.block_pool import BlockPool
from pagecast.runtime.cuda_graphs import mixed_graph_sizes
from pagecast.runtime.errors import InvalidRequestError
from pagecast.runtime.kernel_cache import process_compiles
from pagecast.runtime.loader import LoadedArtifact, load_artifact, zeros_kv_cache
from pagecast.runtime.messages import EngineStats
from pagecast.runtime.model_runner import LaunchedStep, ModelRunner, RunnerOutput
from pagecast.runtime.outputs import PositionLogprobs
from pagecast.runtime.request import PRIORITY_LIMIT, Request, RequestStatus
from pagecast.runtime.sampling_params import SamplingParams
from pagecast.runtime.scheduler import POLICIES, Scheduler, SchedulerConfig, SchedulerOutput
from pagecast.runtime.speculative import SpeculativeConfig, make_proposer
from pagecast.runtime.structured_output import GrammarKey, GrammarState, tokenizer_loader

logger = logging.getLogger("pagecast.engine")

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "KI": 2**10, "MI": 2**20, "GI": 2**30, "TI": 2**40}


def parse_size(value: int | str) -> int:
    """'512MiB' / '2GB' / 1048576 -> bytes."""
    if isinstance(value, int):
        return value
    m = _SIZE.match(value)
    if not m:
        raise ValueError(f"kv_cache_memory {value!r} is not a size such as 512MiB or 2GB")
    unit = (m.group(2) or "").upper().rstrip("B")
    return int(float(m.group(1)) * _UNITS[unit])


# On the CPU a prompt token costs far more than on a GPU, and more the longer its context: with
# the embedded SmolLM2-135M, 2048-token chunks of a 7.8k-token prompt held every running stream
# up to 23 s between two tokens (issue 33). Measured on the 2-core development machine in CPU
# time, one torch thread (what engine-serve gives a core there: cores - 1), with
# benchmarks/cpu_step_budget.py: a chunk of 32-128 tokens costs about 2.9 ms a token at the start
# of a prompt and 14-20 ms a token after 6,144 tokens of context, so about 2.3 us more per token of
# context: a token after c tokens costs about (1 + c / 1,260) tokens at the start. A flat bound of
# 128 tokens a step therefore still cost about 2.2 s at 7.8k (1.8 s median and 5.2 s largest gaps
# between a stream's tokens through engine-serve, on a loaded machine). So on the CPU the bound is
# one of cost: 256 start-of-prompt tokens (0.75 s), a token after c tokens of context counting as
# 1 + c / 1,024 of them (a little more than measured): about 30 tokens a step at 7.8k, also about
# 0.7 s. A prompt then costs a few more steps, not more work (the work is per token).
CPU_MAX_NUM_PREFILL_TOKENS = 256
CPU_PREFILL_CONTEXT_WEIGHT = 1 / 1024

# A GPU engine serving online (requests arriving while others stream: AsyncEngine, engine-serve)
# takes at most this many prompt tokens a step. Measured on one H200 (Llama-3-8B shape, 512-token
# prompts, 256 output tokens, Poisson 32 req/s; 2026-12-03): with only the 2,048-token step budget
# the inter-token p99 was 52.6 ms and TTFT p50/p99 74.7/364.8 ms; at 1,024, 34.6 ms and 55.2/278.0
# ms, at the same throughput; at 512, 36.4 ms, but TTFT 114.9/402.8 ms and a doubled inter-token p50.
ONLINE_MAX_NUM_PREFILL_TOKENS = 1024


def default_max_num_prefill_tokens(device_type: str, online: bool = False) -> int | None:
    """The bound on a step's prompt tokens when the options leave it unset: on the CPU, small
    enough to bound a step's time; on a GPU serving online, ONLINE_MAX_NUM_PREFILL_TOKENS, which
    bounds the gap between a stream's tokens while prompts arrive; offline (LLM) none:
    max_num_batched_tokens alone bounds the step, for throughput."""
    if device_type == "cpu":
        return CPU_MAX_NUM_PREFILL_TOKENS
    return ONLINE_MAX_NUM_PREFILL_TOKENS if online else None


# Where the warm-up's seconds go (issue 30: on an H200 it is the start's critical path, 1.7-2.5 s
# for a few thousand tokens of work): set to a file path, the warm-up runs under torch.profiler and
# cProfile and writes there each run's seconds and the kernels it loaded, whether the compile
# recorder is installed, the busiest operators by host and by device time, the Python functions by
# cumulative time, then each run's seconds again (run a second time, unprofiled).
PROFILE_WARM_UP_ENV = "PAGECAST_PROFILE_WARM_UP"


@contextlib.contextmanager
def _warm_up_profile(path: str | None, each: list[WarmUpRun]) -> Iterator[None]:
    if not path:
        yield
        return
    import cProfile
    import io
    import pstats

    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    python = cProfile.Profile()
    with profile(activities=activities) as prof:
        python.enable()
        try:
            yield
        finally:
            python.disable()
    averages = prof.key_averages()
    lines = [run.line() for run in each]
    lines.append(_triton_listener_state())
    lines.append(averages.table(sort_by="cpu_time_total", row_limit=40))
    if torch.cuda.is_available():
        lines.append(averages.table(sort_by="device_time_total", row_limit=40))
    # The host's Python side, which the operator tables do not show (Triton's launches and loads,
    # the scheduler, the model code): the functions with the most time under them.
    text = io.StringIO()
    pstats.Stats(python, stream=text).sort_stats("cumulative").print_stats(60)
    lines.append(text.getvalue())
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    logger.info("warm-up profile written to %s", path)


def _triton_listener_state() -> str:
    """Whether this process's compile recorder is Triton's listener (the profile's kernel counts
    depend on it)."""
    import sys

    if "triton" not in sys.modules:
        return "triton: not imported"
    from triton import knobs

    recorder = process_compiles()
    return (
        f"triton: compile listener {knobs.compilation.listener!r} (calls the recorder: {recorder.installed}); "
        f"recorded {recorder.count} compiles, "
        f"{len(recorder.loads)} loads; TRITON_CACHE_DIR {os.environ.get('TRITON_CACHE_DIR')}"
    )


@dataclass
class WarmUpRun:
    """One warm-up request, start to finish: its phase, prompt tokens, wall seconds and the Triton
    kernels it loaded from the artifact's cache (names; a first launch in this process)."""

    phase: str
    tokens: int
    seconds: float
    loaded: list[str]

    def line(self) -> str:
        names = ", ".join(f"{n} x{c}" if c > 1 else n for n, c in collections.Counter(self.loaded).items())
        return (
            f"{self.phase} {self.tokens} prompt tokens: {self.seconds * 1e3:.1f} ms, "
            f"{len(self.loaded)} kernels loaded" + (f" ({names})" if names else "")
        )


@dataclass(frozen=True)
class EngineOptions:
    """Run-time options; what the artifact fixed (dtype, block size, ...) is not here."""

    # Sequences running at once. Default: what the artifact was built for (enginebuild
    # --max-num-seqs: its memory plan, its CUDA graphs and its tuned batch buckets), 256 for an
    # artifact that does not say.
    max_num_seqs: int | None = None
    # Tokens one step computes. Default: max(2048, max_num_seqs), the step the memory plan sizes
    # activations for.
    max_num_batched_tokens: int | None = None
    # Prompt tokens one step may compute, decodes aside (chunked prefill). Default
    # (default_max_num_prefill_tokens): CPU_MAX_NUM_PREFILL_TOKENS on the CPU, which bounds a
    # step's time, hence the gap between a running stream's tokens, while a long prompt is
    # prefilled; ONLINE_MAX_NUM_PREFILL_TOKENS on a GPU serving online; else no bound of its own.
    max_num_prefill_tokens: int | None = None
    # Requests arrive while others stream: set by the engine-core process, which runs every
    # AsyncEngine's and engine-serve's engine (core_process.core_options); LLM's engine is offline.
    # Only the default of max_num_prefill_tokens depends on it.
    online: bool = False
    max_model_len: int | None = None  # at most the artifact's
    kv_cache_memory: int | str | None = None  # bytes for the KV cache; default: from gpu_memory_utilization
    # Fraction of the GPU's memory this engine may use in all (weights, activations, graphs, KV
    # cache). Engines that share a GPU each get their own fraction (engine-serve splits it).
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    verify_weights: bool = True  # hash weight files on load
    cuda_graphs: bool = True  # capture decode graphs at start-up (GPU only)
    # Capture them after the engine is ready instead (a decode step captures its own bucket first, an
    # idle engine the rest): it serves sooner, decode batches eagerly until their graph is there
    # (runtime/cuda_graphs.py). Default: on when
    # serving online (engine-serve, AsyncEngine), where start-up time is what a user waits for;
    # off for LLM, whose first batch would run eagerly.
    lazy_graphs: bool | None = None
    # CUDA graphs for steps with prompt tokens as well (runtime/cuda_graphs.py, MixedGraphs): the
    # layers between attention calls replay per token bucket (up to 512 tokens), attention runs
    # eagerly. Off by default until it has been measured on a GPU. Not with tensor parallelism.
    mixed_graphs: bool = False
    # Plan step N+1 while step N runs on the device (default: on for GPUs), for every request:
    # logprobs, prompt logprobs and penalties are computed on the device too.
    async_scheduling: bool | None = None
    # Run a prefill and a few decode steps before serving, so that the first request finds every
    # kernel loaded and every lazily made buffer made (default: on for GPUs).
    warm_up: bool | None = None
    # The KV cache's dtype is fixed at build time (enginebuild --kv-cache-dtype); None or "auto"
    # takes the artifact's. Anything else must name the artifact's ("fp8" for an fp8 build), else
    # the engine refuses to start and says how to rebuild.
    kv_cache_dtype: str | None = None
    # The order requests are served in (runtime/scheduler.py): "fcfs", first come first served, or
    # "priority", by each request's ``priority`` (lower first), then arrival. Under "fcfs" a
    # request with a priority other than 0 is refused, as vLLM refuses it.
    scheduling_policy: str = "fcfs"
    # Speculative decoding (runtime/speculative.py): a dict or JSON text such as {"method":
    # "ngram", "num_speculative_tokens": 4}; None takes the artifact's (enginebuild
    # --speculative-config), "off" turns the artifact's off.
    speculative_config: dict[str, Any] | str | None = None

    def __post_init__(self) -> None:
        if self.max_num_seqs is not None and self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be positive (got {self.max_num_seqs})")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be positive (got {self.max_num_batched_tokens})")
        if self.max_num_prefill_tokens is not None and self.max_num_prefill_tokens < 1:
            raise ValueError(f"max_num_prefill_tokens must be positive (got {self.max_num_prefill_tokens})")
        if self.max_num_seqs is not None and self.max_num_batched_tokens is not None:
            self._check_step_fits(self.max_num_seqs, self.max_num_batched_tokens)
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1] (got {self.gpu_memory_utilization})")
        if self.kv_cache_memory is not None and parse_size(self.kv_cache_memory) <= 0:
            raise ValueError("kv_cache_memory must be positive")
        if self.scheduling_policy not in POLICIES:
            raise ValueError(f"scheduling_policy must be one of {', '.join(POLICIES)} (got {self.scheduling_policy!r})")
        if self.speculative_config != "off":
            SpeculativeConfig.parse(self.speculative_config)  # a bad config fails here, with its reason

    @staticmethod
    def _check_step_fits(max_num_seqs: int, max_num_batched_tokens: int) -> None:
        if max_num_batched_tokens < max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({max_num_batched_tokens}) must be at least max_num_seqs "
                f"({max_num_seqs}), so every running request can decode in one step"
            )

    def resolved(self, built_max_num_seqs: int) -> EngineOptions:
        """These options with the batch sizes left unset filled in: max_num_seqs from the artifact
        (``built_max_num_seqs``, what it was built for), max_num_batched_tokens as max(2048,
        max_num_seqs)."""
        seqs = self.max_num_seqs if self.max_num_seqs is not None else built_max_num_seqs
        tokens = self.max_num_batched_tokens if self.max_num_batched_tokens is not None else max(DEFAULT_STEP_TOKENS, seqs)
        self._check_step_fits(seqs, tokens)
        return dataclasses.replace(self, max_num_seqs=seqs, max_num_batched_tokens=tokens)

    @property
    def lazy_graphs_on(self) -> bool:
        """Whether CUDA graphs are captured between steps after start-up (see lazy_graphs)."""
        return self.online if self.lazy_graphs is None else self.lazy_graphs


@dataclass
class StepResult:
    """The tokens one device step produced: the sequences that received tokens (in batch
    order, finished ones included) and the logprobs asked for. A sequence got one new token
    (its last), or ``num_new_tokens[id]`` of them when it verified drafts (speculative
    decoding); ``logprobs[id]`` holds one entry per new token."""

    updated: list[Request] = field(default_factory=list)
    logprobs: dict[str, list[PositionLogprobs]] = field(default_factory=dict)
    prompt_logprobs: dict[str, list[PositionLogprobs]] = field(default_factory=dict)
    num_new_tokens: dict[str, int] = field(default_factory=dict)


@dataclass
class SpecStats:
    """Speculative decoding's counters since start (the engine log and /metrics)."""

    num_steps: int = 0  # steps that verified drafts
    num_verified: int = 0  # (sequence, step) pairs that verified drafts
    num_draft_tokens: int = 0  # drafts verified
    num_accepted_tokens: int = 0  # drafts accepted
    num_emitted_tokens: int = 0  # tokens those sequences got (accepted drafts + the target's own)
    draft_s: float = 0.0  # time proposing
    verify_s: float = 0.0  # time of the verifying steps (target forward + verification)


@dataclass
class _AwaitingGrammar:
    """A constrained request whose grammar is compiling: its sequences (those not aborted), not
    yet in the scheduler."""

    key: GrammarKey
    future: futures.Future[Any]
    children: list[Request]


# How long a step that has nothing to run but requests waiting for their grammar waits for one of
# the compiles to end: it returns as soon as one does, and the engine-core loop reads new
# messages between two waits, so a request arriving meanwhile is held up by at most this.
GRAMMAR_WAIT_S = 0.002

CPU_DEFAULT_KV_BYTES = 1 << 30
_KV_DTYPE_NAMES = {"fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "bf16": "bfloat16", "fp16": "float16",
                   "half": "float16", "fp32": "float32"}  # fmt: skip


def check_kv_cache_option(asked: str | None, artifact_dtype: str) -> None:
    """A kv_cache_dtype engine option other than the artifact's is refused: the cache's dtype is
    compiled into the artifact (its kernels, its scales, its memory plan), never switched at serve time."""
    if asked is None or asked.lower() == "auto":
        return
    name = _KV_DTYPE_NAMES.get(asked.lower(), asked.lower().removeprefix("torch."))
    if name != artifact_dtype:
        flag = "fp8" if name == "float8_e4m3fn" else "auto"
        raise ValueError(
            f"kv_cache_dtype {asked!r}: this artifact's KV cache is {artifact_dtype}, fixed when it was built; "
            f"rebuild it with enginebuild --kv-cache-dtype {flag} (or leave kv_cache_dtype out to use the artifact's)"
        )


class EngineCore:
    """Owns the model, the KV cache, the scheduler and the sequences. Not thread-safe: one
    thread calls add_request / finish / step."""

    def __init__(
        self, artifact: str | os.PathLike[str] | LoadedArtifact, options: EngineOptions, load_tokenizer: bool = True
    ):
        self.options = options
        self.startup_s: dict[str, float] = {}
        t0 = time.perf_counter()
        self.artifact = artifact if isinstance(artifact, LoadedArtifact) else load_artifact(
            artifact, verify_weights=options.verify_weights, load_tokenizer=load_tokenizer
        )
        self.startup_s["load"] = time.perf_counter() - t0
        self.startup_s.update({f"load.{k}": v for k, v in self.artifact.timings.items()})
        if process_compiles().ensure_installed():
            # The recorder is made before Triton is imported and installs itself at that import;
            # it did not here, so compiles before this point (none should happen) went uncounted.
            logger.warning("Triton's compile listener was not installed at its import; installed now")
        manifest = self.artifact.manifest
        built = int(manifest.build_options.get("max_num_seqs") or DEFAULT_MAX_NUM_SEQS)
        self.options = options = options.resolved(built)
        if options.max_num_seqs > built and self.artifact.device.type == "cuda":
            logger.warning(
                "max_num_seqs %d is more than the %d this artifact was built for: decode batches above %d run "
                "without CUDA graphs, on kernel configs tuned for smaller batches, and its memory plan did not "
                "count them; rebuild with `enginebuild --max-num-seqs %d` to plan and tune for them",
                options.max_num_seqs, built, built, options.max_num_seqs,
            )  # fmt: skip
        self.model_name = manifest.name
        self.block_size = manifest.block_size
        self.eos_token_ids = frozenset(manifest.eos_token_ids)
        self.vocab_size = int(manifest.dims["vocab_size"])
        if options.max_model_len is not None and options.max_model_len > manifest.max_model_len:
            # Positions past the artifact's context were never planned (memory plan, rope tables,
            # tuned buckets): refuse instead of capping silently.
            raise ValueError(
                f"max_model_len {options.max_model_len} is longer than this artifact's {manifest.max_model_len}; "
                f"rebuild it with `enginebuild --max-model-len {options.max_model_len}` (up to the model's "
                "max_position_embeddings) or ask for at most the artifact's"
            )
        self.max_model_len = options.max_model_len or manifest.max_model_len
        check_kv_cache_option(options.kv_cache_dtype, manifest.kv_cache_dtype)

        # Speculative decoding: the proposer comes first, since a draft model's or a head's own
        # KV cache shares the target's blocks and so counts in their size.
        self.speculative = speculative_config(
            options.speculative_config, getattr(manifest, "speculative", None), self.artifact.path
        )
        self.spec_stats = SpecStats()
        self.proposer = make_proposer(self.speculative, self) if self.speculative is not None else None
        num_blocks = self._num_kv_blocks()
        if num_blocks * self.block_size < self.max_model_len:
            raise ValueError(
                f"the KV cache holds {num_blocks * self.block_size} tokens ({num_blocks} blocks), fewer than "
                f"max_model_len {self.max_model_len}: give more KV memory (kv_cache_memory / "
                f"gpu_memory_utilization) or a smaller max_model_len"
            )
        dims = manifest.dims
        self.kv_cache = zeros_kv_cache(
            (dims["num_layers"], 2, num_blocks, manifest.kv_heads_per_rank, self.block_size, dims["head_dim"]),
            self.artifact.kv_cache_dtype,
            self.artifact.device,
        )
        self.artifact.model.bind_kv_cache(self.kv_cache)
        if self.proposer is not None and hasattr(self.proposer, "bind_kv_cache"):
            self.proposer.bind_kv_cache(num_blocks)
        self.block_pool = BlockPool(num_blocks, self.block_size, options.enable_prefix_caching)
        self.max_num_prefill_tokens = options.max_num_prefill_tokens or default_max_num_prefill_tokens(
            self.artifact.device.type, options.online
        )
        # The CPU's default bound is one of cost (see CPU_PREFILL_CONTEXT_WEIGHT); one given in
        # the options is a plain token count.
        cpu_default = options.max_num_prefill_tokens is None and self.artifact.device.type == "cpu"
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=options.max_num_seqs,
                max_num_batched_tokens=max(options.max_num_batched_tokens, 1),
                max_num_prefill_tokens=self.max_num_prefill_tokens,
                max_model_len=self.max_model_len,
                prefill_context_weight=CPU_PREFILL_CONTEXT_WEIGHT if cpu_default else 0.0,
                policy=options.scheduling_policy,  # type: ignore[arg-type]
            ),
            self.block_pool,
        )
        self.runner = ModelRunner(
            self.artifact.model,
            self.artifact.device,
            self.block_size,
            self.artifact.kernels,
            max_num_seqs=options.max_num_seqs,
            max_model_len=self.max_model_len,
        )
        # Structured output: nothing is loaded or compiled until a constrained request arrives.
        self.grammar = GrammarState(
            tokenizer_loader(self.artifact.path, self.artifact.tokenizer), self.vocab_size, self.eos_token_ids
        )
        self.runner.grammar = self.grammar
        if options.cuda_graphs:
            # The plan's batch sizes, up to this engine's max_num_seqs; larger decode batches run eagerly.
            planned = self.artifact.memory_plan.get("cuda_graph_batch_sizes") or [1]
            sizes = [b for b in planned if b <= options.max_num_seqs]
            mixed = mixed_graph_sizes(options.max_num_batched_tokens) if options.mixed_graphs else []
            self.startup_s["cuda_graphs"] = self.runner.capture_cuda_graphs(
                sizes, self.max_model_len, options.lazy_graphs_on, mixed_sizes=mixed
            )
            graphs = getattr(self.runner, "graphs", None)
            self.startup_s.update({f"cuda_graphs.{k}": v for k, v in getattr(graphs, "timings", {}).items()})
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        is_gpu = self.artifact.device.type == "cuda"
        self.async_scheduling = is_gpu if options.async_scheduling is None else options.async_scheduling
        self._inflight: LaunchedStep | None = None  # launched, tokens not collected yet
        self._parents: dict[str, list[Request]] = {}  # parent id -> its sequences, while one runs
        # Constrained requests whose grammar compiles (parent id -> them, in arrival order), and
        # those whose grammar failed to compile since the caller last asked (take_failed).
        self._awaiting_grammar: dict[str, _AwaitingGrammar] = {}
        self._failed: dict[str, InvalidRequestError] = {}
        if options.warm_up if options.warm_up is not None else is_gpu:
            # While the weights still stream in (on a GPU): the warm-up's outputs are thrown away,
            # and what it is for - each kernel loaded from the artifact's cache, cuBLAS's
            # workspaces, the sampler's buffers - needs the tensors, not their values (which are
            # zeros until read, so every value stays finite). Measured on one H200, 8B: the
            # warm-up took 2.2 s after a 1.0 s read; now they overlap.
            t0 = time.perf_counter()
            self.warm_up()
            self.startup_s["warm_up"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        self.artifact.wait_verified()  # the weights are in, and are what was built
        self.startup_s["weights_wait"] = time.perf_counter() - t0
        self.runner.start_lazy_capture()  # lazy graphs: captured from here on, by the steps that need them and while idle
        # From here on a compile is one the artifact's cache and the warm-up did not cover.
        self._compiles = process_compiles()
        self._compiles_when_ready = self._compiles.count
        relax_gc()

    def _num_kv_blocks(self) -> int:
        bytes_per_block = int(self.artifact.memory_plan["bytes_per_block"])
        bytes_per_block += int(getattr(self.proposer, "kv_bytes_per_block", 0))
        if self.options.kv_cache_memory is not None:
            budget = parse_size(self.options.kv_cache_memory)
        elif self.artifact.device.type == "cuda":
            # This engine's own share of the GPU, whatever other engines on it hold: its fraction
            # of the total, less what it holds already (weights), less room for activations; and
            # never more than is free now.
            device = self.artifact.device
            free, total = torch.cuda.mem_get_info(device)
            reserve = int(self.artifact.memory_plan.get("activation_bytes", 1 << 30))
            own = torch.cuda.memory_reserved(device)
            budget = min(int(total * self.options.gpu_memory_utilization) - own, free) - reserve
        else:
            needed = self.options.max_num_seqs * self.max_model_len * bytes_per_block // self.block_size
            budget = min(CPU_DEFAULT_KV_BYTES, max(needed, bytes_per_block))
        return max(0, budget // bytes_per_block)

    # -- requests ---------------------------------------------------------------------------

    def check_prompt(self, ids: list[int], params: SamplingParams) -> int:
        """Check token ids against the vocabulary and the context; returns the resolved max_tokens."""
        return check_prompt(ids, params, self.vocab_size, self.max_model_len)

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        max_tokens: int,
        arrival_time: float | None = None,
        priority: int = 0,
    ) -> list[Request]:
        """Queue a checked request as its n sequences; returns them."""
        if request_id in self._parents:
            raise InvalidRequestError(f"request id {request_id!r} is already running", param="request_id")
        check_priority(priority, self.options.scheduling_policy)
        children = new_sequences(
            request_id, prompt_token_ids, params, self.eos_token_ids, max_tokens, arrival_time, priority
        )
        if self.options.enable_prefix_caching and params.prompt_logprobs is None:
            for child in children[1:]:  # the siblings share the first one's prompt blocks
                child.prefill_after = children[0]
        if params.structured_output is not None:
            key = params.structured_output.key
            future = self.grammar.prepare(key)  # done at once when the grammar is cached
            if not future.done():
                # It compiles on the grammar pool: the request waits outside the scheduler, and
                # the steps admit it once its grammar is ready (_admit_compiled).
                self._awaiting_grammar[request_id] = _AwaitingGrammar(key, future, children)
                self._parents[request_id] = children
                return children
            self._add_matchers(children, key, future)  # raises InvalidRequestError
        self._parents[request_id] = children
        self._schedule(children)
        return children

    def _add_matchers(self, children: list[Request], key: GrammarKey, future: futures.Future[Any]) -> None:
        try:
            self.grammar.add(children, self.grammar.collect(key, future))
        except ValueError as exc:
            raise InvalidRequestError(str(exc), param="response_format", code="invalid_json_schema") from None

    def _schedule(self, children: list[Request]) -> None:
        self.num_prompt_tokens += len(children[0].prompt_token_ids)
        for child in children:
            self.scheduler.add_request(child)

    def _admit_compiled(self) -> None:
        """Schedule the requests whose grammar has compiled since the last step (in arrival order),
        and end those whose grammar failed with their error (``take_failed``). Never blocks."""
        for parent_id, waiting in list(self._awaiting_grammar.items()):
            if not waiting.future.done():
                continue
            del self._awaiting_grammar[parent_id]
            try:
                self._add_matchers(waiting.children, waiting.key, waiting.future)
            except InvalidRequestError as exc:
                now = time.monotonic()
                for child in waiting.children:
                    child.status = RequestStatus.FINISHED_ERROR
                    child.metrics.finished_time = now
                self._failed[parent_id] = exc
                self._parents.pop(parent_id, None)
                continue
            self._schedule(waiting.children)
        self.grammar.poll()  # compiles nobody waits for any more (aborted) go into the cache

    def take_failed(self) -> dict[str, InvalidRequestError]:
        """The requests (parent id -> why) that ended with an error since the last call, outside
        add_request: a grammar that failed to compile in the background. They hold nothing."""
        failed, self._failed = self._failed, {}
        return failed

    def finish(self, sequence_ids: list[str], status: RequestStatus) -> None:
        """End sequences outside the token path (abort, a stop string found by the caller);
        unknown or finished ids are ignored."""
        if self._awaiting_grammar:
            self._finish_awaiting(sequence_ids, status)
        self.scheduler.finish_requests(sequence_ids, status)
        if self.grammar.active:
            self.grammar.drop(sequence_ids)
        for sid in sequence_ids:
            parent_id = sid.split("#", 1)[0]
            children = self._parents.get(parent_id)
            if children is not None and all(c.is_finished for c in children):
                del self._parents[parent_id]

    def _finish_awaiting(self, sequence_ids: list[str], status: RequestStatus) -> None:
        """End sequences still waiting for their grammar (the scheduler has never seen them: they
        hold no block and no matcher). A compile nobody waits for any more is cancelled when it
        has not started."""
        now = time.monotonic()
        ending = set(sequence_ids)
        # Matched on the sequences' own ids: a caller's request id may itself contain "#".
        for parent_id, waiting in list(self._awaiting_grammar.items()):
            if not any(child.request_id in ending for child in waiting.children):
                continue
            for child in waiting.children:
                if child.request_id in ending:
                    child.status = status
                    child.metrics.finished_time = now
            waiting.children = [c for c in waiting.children if not c.is_finished]
            if not waiting.children:
                del self._awaiting_grammar[parent_id]
                if not any(w.future is waiting.future for w in self._awaiting_grammar.values()):
                    self.grammar.forget(waiting.key, waiting.future)

    def has_unfinished_requests(self) -> bool:
        return (
            self.scheduler.has_unfinished_requests() or self._inflight is not None or bool(self._awaiting_grammar)
        )

    # -- the step ---------------------------------------------------------------------------

    def step(self) -> list[StepResult]:
        """Run one step; returns what the device produced (usually one result; none when a
        step only ran prefill chunks).

        With asynchronous scheduling a step launches step N on the device, then waits for step
        N-1 and returns its tokens: the host plans and books while the device computes.

        Constrained requests whose grammar has compiled join the scheduler first. A step that
        finds a grammar that failed to compile does nothing else: it returns no result, and the
        caller reports the failure (``take_failed``) before stepping on."""
        if self._awaiting_grammar:
            if not self.scheduler.has_unfinished_requests() and self._inflight is None:
                # Nothing else to run: wait for a compile to end, briefly (no hot loop, and the
                # engine-core loop reads its messages between two waits).
                futures.wait(
                    [w.future for w in self._awaiting_grammar.values()],
                    timeout=GRAMMAR_WAIT_S,
                    return_when=futures.FIRST_COMPLETED,
                )
            self._admit_compiled()
            if self._failed:
                return []
        if self.proposer is not None and self._ready_to_speculate():
            return self._speculative_step()
        if self.async_scheduling:
            scheduled = self.scheduler.schedule()
            self._drop_request_state(scheduled)
            launched = None
            if scheduled.total_num_scheduled_tokens:
                launched = self.runner.launch(scheduled, self._inflight)
                self.scheduler.mark_computed(scheduled)
            results = self._collect_inflight()
            self._inflight = launched
            if launched is not None and not self.scheduler.has_unfinished_requests():
                # Everything it computed belongs to requests that have just finished (a stop
                # token or string): wait for it now, so the engine is idle when it says so.
                results += self._collect_inflight()
            return results
        results = self._collect_inflight()  # nothing in flight in synchronous mode
        scheduled = self.scheduler.schedule()
        self._drop_request_state(scheduled)
        if scheduled.total_num_scheduled_tokens == 0:
            return results
        output = self.runner.execute(scheduled)
        self.scheduler.mark_computed(scheduled)
        return results + [self._book(scheduled, output)]

    # -- speculative decoding (runtime/speculative.py) ----------------------------------------

    def _speculative_step(self) -> list[StepResult]:
        """A synchronous step in which the decoding requests verify drafts: the step in flight
        (if any) is collected first, so every request's tokens are known to the proposer."""
        results = self._collect_inflight()
        stats = self.spec_stats
        t0 = time.perf_counter()
        proposed = self._propose()
        t1 = time.perf_counter()
        scheduled = self.scheduler.schedule()
        for request in proposed:
            request.spec_token_ids = []  # those scheduled are in scheduled.spec_token_ids
        self._drop_request_state(scheduled)
        if scheduled.total_num_scheduled_tokens == 0:
            return results
        output = self.runner.execute(scheduled)
        self.scheduler.mark_computed(scheduled)
        results.append(self._book(scheduled, output))
        if scheduled.spec_token_ids:
            stats.draft_s += t1 - t0
            stats.verify_s += time.perf_counter() - t1
            stats.num_steps += 1
        return results

    def _ready_to_speculate(self) -> bool:
        """Whether this step speculates: a batch small enough (``disable_by_batch_size``) with a
        running request that is not pausing. Counts every pausing request's pause down by a step."""
        assert self.speculative is not None
        running = self.scheduler.running
        if not 0 < len(running) <= self.speculative.disable_by_batch_size:
            return False
        ready = False
        for request in running:
            if request.spec_skip:
                request.spec_skip -= 1
            else:
                ready = True
        return ready

    def _propose(self) -> list[Request]:
        """Ask the proposer for drafts for every running request that decodes next (one token
        behind, nothing pending) and has room for them: tokens left before max_tokens and
        max_model_len (verifying k drafts yields up to k + 1 tokens), and free blocks for their
        positions (a draft never preempts anyone). A request that got no drafts, or whose drafts
        were all rejected, several steps in a row pauses (``_missed``), so a drafter that does not
        predict this text costs little: a step where no request may speculate is an ordinary
        one (asynchronous, CUDA graphs)."""
        assert self.speculative is not None and self.proposer is not None
        k = self.speculative.num_speculative_tokens
        pool = self.block_pool
        max_model_len = self.max_model_len
        requests: list[Request] = []
        counts: list[int] = []
        for request in self.scheduler.running:
            if request.num_pending_tokens or request.num_computed_tokens != len(request.all_token_ids) - 1:
                continue
            if request.spec_skip:
                continue
            room = min(k, request.max_tokens - request.num_output_tokens - 1, max_model_len - request.num_tokens - 1)
            if room > 0 and pool.allocate_slots(request, 1 + room):
                requests.append(request)
                counts.append(room)
        if not requests:
            return []
        for request, drafts, room in zip(requests, self.proposer.propose(requests, counts), counts):
            request.spec_token_ids = list(drafts[:room])
            if not drafts:
                _missed(request)
        return requests

    def set_speculative(self, config: SpeculativeConfig | dict[str, Any] | str | None) -> None:
        """Switch speculative decoding while no request runs (benchmarks compare settings on one
        engine): to a method without weights of its own (ngram, replay), or off (None)."""
        config = SpeculativeConfig.parse(config)
        if self.has_unfinished_requests():
            raise RuntimeError("set_speculative needs an idle engine")
        if config is not None and config.method not in ("ngram", "replay"):
            raise ValueError(f"set_speculative cannot load {config.method}'s weights: start an engine with it")
        self.speculative = config
        self.proposer = make_proposer(config, self) if config is not None else None
        self.spec_stats = SpecStats()

    def _drop_request_state(self, scheduled: SchedulerOutput) -> None:
        """The runner's and the proposer's state of the requests that finished or were preempted
        (every schedule, including one with nothing to run: its ids are reported only once)."""
        self.runner.forget(scheduled)
        if self.proposer is not None and (scheduled.finished_request_ids or scheduled.preempted_requests):
            self.proposer.drop(scheduled.finished_request_ids | {r.request_id for r in scheduled.preempted_requests})

    def _book_speculation(self, scheduled: SchedulerOutput, output: RunnerOutput) -> None:
        """Count the step's drafts and their acceptance; pause the requests that keep missing."""
        stats = self.spec_stats
        for request_id, drafts in scheduled.spec_token_ids.items():
            tokens = output.spec_tokens.get(request_id)
            if tokens is None:
                continue
            accepted = len(tokens) - 1
            stats.num_verified += 1
            stats.num_draft_tokens += len(drafts)
            stats.num_accepted_tokens += accepted
            stats.num_emitted_tokens += len(tokens)
            request = self.scheduler.requests.get(request_id)
            if request is None:
                continue  # finished this step
            if accepted:
                request.spec_misses = 0
            else:
                _missed(request)

    def _collect_inflight(self) -> list[StepResult]:
        inflight, self._inflight = self._inflight, None
        if inflight is None:
            return []
        return [self._book(inflight.scheduled, self.runner.collect(inflight))]

    def _book(self, scheduled: SchedulerOutput, output: RunnerOutput) -> StepResult:
        for request in scheduled.scheduled_requests if output.prompt_logprobs else ():
            entries = output.prompt_logprobs.get(request.request_id)
            if entries and request.prompt_logprobs is not None:
                # The next chunk's targets start where these end (and a preempted request
                # does not compute them again).
                request.prompt_logprobs.extend(entries)
        num_new: dict[str, int] = {}
        if scheduled.spec_token_ids:
            updated = self.scheduler.add_sampled_tokens(scheduled, output.sampled, output.spec_tokens, num_new)
            self._book_speculation(scheduled, output)
            self.num_generation_tokens += len(updated) + sum(num_new.values()) - len(num_new)
        else:
            updated = self.scheduler.add_sampled_tokens(scheduled, output.sampled)
            self.num_generation_tokens += len(updated)
        for request in updated:
            if request.is_finished:
                if self.grammar.active:
                    self.grammar.drop([request.request_id])
                children = self._parents.get(request.parent_id)
                if children is not None and all(c.is_finished for c in children):
                    del self._parents[request.parent_id]
        logprobs = {rid: [entry] for rid, entry in output.logprobs.items()} if output.logprobs else {}
        for rid, entries in output.spec_logprobs.items():
            logprobs[rid] = entries[: num_new.get(rid, 1)]
        if num_new:
            num_new = {rid: n for rid, n in num_new.items() if n > 1}
        return StepResult(updated, logprobs, output.prompt_logprobs, num_new)

    def warm_up(self) -> None:
        """Run a throw-away prefill of every size class the kernels are tuned for (each may use
        its own kernel), then a few decode steps, then each of the sampler's paths, and forget it all: the first real request
        finds every kernel loaded, cuBLAS's workspaces made and the sampler's buffers
        allocated. Statistics and the prefix cache are reset afterwards."""
        from pagecast.kernels.tuning import PREFILL_TOKEN_BUCKETS, TOKEN_BUCKETS

        budget = min(self.options.max_num_batched_tokens, self.max_model_len - 4)
        sizes = sorted({n for n in (*TOKEN_BUCKETS, *PREFILL_TOKEN_BUCKETS) if n <= budget} | {max(1, budget)})
        # Two tokens: the prefill, then one decode step at the prompt's context bucket.
        greedy = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
        # The sampler's other paths: seeded sampling with truncation, and logprobs with penalties.
        sampled = SamplingParams(max_tokens=3, temperature=1.0, top_p=0.9, top_k=50, min_p=0.01, seed=0, ignore_eos=True)
        scored = SamplingParams(max_tokens=3, temperature=0.0, logprobs=2, presence_penalty=0.5, ignore_eos=True)
        # And plain sampling (temperature only, unseeded): what an OpenAI client sends by default.
        plain = SamplingParams(max_tokens=3, temperature=1.0, ignore_eos=True)
        phases = {
            "sizes": [(n, greedy) for n in sizes],
            "sampler": [(min(64, budget), p) for p in (sampled, scored, plain)],
        }
        # Where the warm-up's time goes (start-up log): the size classes, the sampler's paths, and
        # how many kernels Triton loaded from the artifact's cache on the way (and before it).
        loads = process_compiles().loads
        loaded, i = len(loads), 0
        self.startup_s["warm_up.kernels_loaded_before"] = loaded
        each: list[WarmUpRun] = []

        def run_all(label: str = "") -> None:
            nonlocal i
            for phase, runs in phases.items():
                for num_tokens, params in runs:
                    t0, before = time.perf_counter(), len(loads)
                    # Distinct ids per run, so no prompt is a prefix-cache hit on an earlier one.
                    ids = [(i * 7919 + j) % self.vocab_size for j in range(1, num_tokens + 1)]
                    self.add_request(f"pagecast-warm-up-{i}", ids, params, max_tokens=params.max_tokens)
                    while self.has_unfinished_requests():
                        self.step()
                    i += 1
                    names = [spec["name"] for spec in loads[before:]]
                    each.append(WarmUpRun(label + phase, num_tokens, time.perf_counter() - t0, names))

        profile_path = os.environ.get(PROFILE_WARM_UP_ENV)
        with _warm_up_profile(profile_path, each):
            run_all()
        for phase in phases:
            self.startup_s[f"warm_up.{phase}"] = sum(run.seconds for run in each if run.phase == phase)
        self.startup_s["warm_up.kernels_loaded"] = len(loads) - loaded
        if profile_path:
            # The same runs again, unprofiled: what a run costs once everything it needs is loaded,
            # against its first time above (the start's own cost).
            first = len(each)
            run_all("again ")
            with open(profile_path, "a") as f:
                f.write("\n".join(run.line() for run in each[first:]) + "\n")
        self.block_pool.reset_prefix_cache()
        self.block_pool.num_prefix_queries = self.block_pool.num_prefix_hits = 0
        self.scheduler.num_preemptions = 0
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.spec_stats = SpecStats()

    def stats(self) -> EngineStats:
        pool = self.block_pool
        spec = self.spec_stats
        return EngineStats(
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            num_kv_blocks_total=pool.num_blocks,
            num_kv_blocks_used=pool.num_used_blocks,
            kv_usage=pool.usage,
            prefix_cache_queries=pool.num_prefix_queries,
            prefix_cache_hits=pool.num_prefix_hits,
            num_preemptions=self.scheduler.num_preemptions,
            num_prompt_tokens=self.num_prompt_tokens,
            num_generation_tokens=self.num_generation_tokens,
            num_kernel_compiles=self._compiles.count - self._compiles_when_ready,
            spec_num_verified=spec.num_verified,
            spec_num_draft_tokens=spec.num_draft_tokens,
            spec_num_accepted_tokens=spec.num_accepted_tokens,
            spec_num_emitted_tokens=spec.num_emitted_tokens,
            spec_draft_seconds=spec.draft_s,
            spec_verify_seconds=spec.verify_s,
        )


# A request whose drafts were all rejected this many verifying steps in a row stops speculating
# for 2, 4, ... steps (at most SPEC_MAX_PAUSE), then tries again.
SPEC_MISSES_BEFORE_PAUSE = 3
SPEC_MAX_PAUSE = 32


def _missed(request: Request) -> None:
    """A step in which the request's drafts were all rejected, or it got none: after
    SPEC_MISSES_BEFORE_PAUSE of them in a row it pauses for 2, 4, ... steps (at most
    SPEC_MAX_PAUSE) before it speculates again; an accepted draft ends the streak."""
    request.spec_misses += 1
    if request.spec_misses >= SPEC_MISSES_BEFORE_PAUSE:
        request.spec_skip = min(2 ** (request.spec_misses - SPEC_MISSES_BEFORE_PAUSE + 1), SPEC_MAX_PAUSE)


def speculative_config(option: Any, built_in: Any, artifact_path: Path | None = None) -> SpeculativeConfig | None:
    """The engine's speculative decoding: the option when given ("off": none), else the
    artifact's own (enginebuild --speculative-config), else none. The artifact's own drafter
    is the one inside it (``artifact_path`` / its name; artifact.check_file_names confines the
    name), whatever the working directory holds."""
    if option == "off":
        return None
    if option is not None:
        return SpeculativeConfig.parse(option)
    if not built_in:
        return None
    if artifact_path is not None and built_in.get("model") is not None:
        built_in = {**built_in, "model": str(Path(artifact_path) / built_in["model"])}
    return SpeculativeConfig.parse(built_in)


def new_sequences(
    request_id: str,
    prompt_token_ids: list[int],
    params: SamplingParams,
    eos_token_ids: frozenset[int],
    max_tokens: int,
    arrival_time: float | None,
    priority: int = 0,
) -> list[Request]:
    """The n sequences of a request, named ``id`` (n == 1) or ``id#i``; the server's output side
    makes the same ones to mirror the core's."""
    return [
        Request(
            request_id if params.n == 1 else f"{request_id}#{i}",
            prompt_token_ids,
            params,
            eos_token_ids=eos_token_ids,
            max_tokens=max_tokens,
            parent_id=request_id,
            index=i,
            arrival_time=arrival_time,
            priority=priority,
        )
        for i in range(params.n)
    ]


def check_priority(priority: int, policy: str) -> None:
    """Refuse a priority the engine's scheduling policy cannot honour (InvalidRequestError,
    param "priority"): any but 0 under "fcfs", as vLLM does, and any past 64 bits."""
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise InvalidRequestError(f"priority must be an integer, got {priority!r}", param="priority")
    if priority != 0 and policy != "priority":
        raise InvalidRequestError(
            f"priority {priority} needs priority scheduling; this engine serves first come, first served "
            "(start it with --scheduling-policy priority, or leave priority at 0)",
            param="priority",
        )
    if not -PRIORITY_LIMIT <= priority <= PRIORITY_LIMIT:
        raise InvalidRequestError(f"priority must be within +-(2**63 - 1), got {priority}", param="priority")


def check_prompt(ids: list[int], params: SamplingParams, vocab_size: int, max_model_len: int) -> int:
    """Check a prompt's token ids against the vocabulary and the context (InvalidRequestError
    names the problem); returns the resolved max_tokens."""
    if not ids:
        raise InvalidRequestError("the prompt is empty", param="prompt", code="empty_prompt")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequestError(
            f"token id {bad[0]} is out of range for this model's vocabulary of {vocab_size}",
            param="prompt",
            code="invalid_token_id",
        )
    bad = [t for t in params.logit_bias or () if t >= vocab_size]
    if bad:
        raise InvalidRequestError(
            f"logit_bias names token id {bad[0]}, out of range for this model's vocabulary of {vocab_size}",
            param="logit_bias",
            code="invalid_token_id",
        )
    return resolve_max_tokens(len(ids), params, max_model_len)


def resolve_max_tokens(num_prompt_tokens: int, params: SamplingParams, max_model_len: int) -> int:
    """max_tokens as asked (or the rest of the context), checked against the context length."""
    n = num_prompt_tokens
    if n >= max_model_len:
        raise InvalidRequestError(
            f"this model's maximum context length is {max_model_len} tokens, but the prompt has {n} tokens",
            param="prompt",
            code="context_length_exceeded",
        )
    max_tokens = params.max_tokens if params.max_tokens is not None else max_model_len - n
    if n + max_tokens > max_model_len:
        raise InvalidRequestError(
            f"this model's maximum context length is {max_model_len} tokens; the prompt has {n} tokens "
            f"and {max_tokens} were requested for the completion ({n + max_tokens} in all): reduce the "
            f"prompt or max_tokens",
            param="max_tokens",
            code="context_length_exceeded",
        )
    return max_tokens


def log_startup(name: str, startup_s: dict[str, Any]) -> None:
    logger.info(
        "engine %s started (seconds, counts): %s", name, " ".join(f"{k}={v:.2f}" for k, v in startup_s.items())
    )


# Python's cyclic garbage collector runs a young-generation pass every 700 net allocations, and
# every so often a full pass over every live object. A decode step of 512 requests allocates
# thousands of objects (outputs, logprob entries: 6 per request with logprobs 5), so the
# collector ran several times per step and its full passes walked everything the engine holds;
# measured on the host, building a step's logprobs for 512 requests took 5.5 ms per step with
# the default thresholds and 1.8 ms with the young threshold at 50,000. Under asynchronous
# scheduling that host time is the step's time once it exceeds the GPU's.
GC_GEN0_THRESHOLD = 50_000


def relax_gc(freeze: bool = False) -> None:
    """Raise the collector's young-generation threshold to ``GC_GEN0_THRESHOLD`` (never lower
    it), and with ``freeze`` move every object alive now (the model, tokenizer, modules) to
    the permanent generation, which full passes skip: for a process that serves one engine
    for its whole life (the engine-core process), not for a user's process that may build
    several engines, whose frozen garbage would never be collected."""
    gen0, gen1, gen2 = gc.get_threshold()
    if 0 < gen0 < GC_GEN0_THRESHOLD:
        gc.set_threshold(GC_GEN0_THRESHOLD, gen1, gen2)
    if freeze:
        gc.collect()
        gc.freeze()
