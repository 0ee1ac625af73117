"""LLMEngine: the synchronous core. add_request / abort_request / step.

One step: the scheduler picks tokens under the budget, the model runner runs them and
samples, the scheduler books the new tokens, the output processor makes RequestOutputs.
LLM (offline batches) and AsyncEngine (the server) both drive this class.
"""

from __future__ import annotations

import itertools
import os
import re
from dataclasses import dataclass
from typing import Any

import torch

from pagecast.runtime.block_pool import BlockPool
from pagecast.runtime.errors import InvalidRequestError
from pagecast.runtime.loader import LoadedArtifact, load_artifact
from pagecast.runtime.model_runner import LaunchedStep, ModelRunner, RunnerOutput
from pagecast.runtime.output_processor import OutputProcessor, ParentRequest
from pagecast.runtime.outputs import RequestOutput
from pagecast.runtime.request import Request, RequestStatus
from pagecast.runtime.sampling_params import SamplingParams
from pagecast.runtime.scheduler import Scheduler, SchedulerConfig, SchedulerOutput

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


@dataclass(frozen=True)
class EngineOptions:
    """Run-time options; what the artifact fixed (dtype, block size, ...) is not here."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # at most the artifact's
    kv_cache_memory: int | str | None = None  # bytes for the KV cache; default: from gpu_memory_utilization
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    verify_weights: bool = True  # hash weight files on load (slow for large models)
    cuda_graphs: bool = True  # capture decode graphs at start-up (GPU only)
    # Plan step N+1 while step N runs on the device (default: on for GPUs). Steps with requests
    # that ask for logprobs, prompt logprobs or penalties run synchronously.
    async_scheduling: bool | None = None

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be positive (got {self.max_num_seqs})")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be positive (got {self.max_num_batched_tokens})")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be at least max_num_seqs "
                f"({self.max_num_seqs}), so every running request can decode in one step"
            )
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1] (got {self.gpu_memory_utilization})")
        if self.kv_cache_memory is not None and parse_size(self.kv_cache_memory) <= 0:
            raise ValueError("kv_cache_memory must be positive")


@dataclass
class EngineStats:
    """A snapshot for metrics and health: counts are totals since start."""

    num_running: int
    num_waiting: int
    num_kv_blocks_total: int
    num_kv_blocks_used: int
    kv_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    num_prompt_tokens: int
    num_generation_tokens: int


CPU_DEFAULT_KV_BYTES = 1 << 30


class LLMEngine:
    """Owns the model, the KV cache, the scheduler and the per-request state. Not thread-safe:
    one thread calls add_request / abort_request / step (AsyncEngine makes sure of that)."""

    def __init__(self, artifact: str | os.PathLike[str] | LoadedArtifact, **options: Any):
        self.options = EngineOptions(**options)
        self.artifact = artifact if isinstance(artifact, LoadedArtifact) else load_artifact(
            artifact, verify_weights=self.options.verify_weights
        )
        manifest = self.artifact.manifest
        self.model_name = manifest.name
        self.tokenizer = self.artifact.tokenizer
        self.block_size = manifest.block_size
        self.eos_token_ids = frozenset(manifest.eos_token_ids)
        self.vocab_size = int(manifest.dims["vocab_size"])
        self.max_model_len = min(manifest.max_model_len, self.options.max_model_len or manifest.max_model_len)

        num_blocks = self._num_kv_blocks()
        if num_blocks * self.block_size < self.max_model_len:
            raise ValueError(
                f"the KV cache holds {num_blocks * self.block_size} tokens ({num_blocks} blocks), fewer than "
                f"max_model_len {self.max_model_len}: give more KV memory (kv_cache_memory / "
                f"gpu_memory_utilization) or a smaller max_model_len"
            )
        dims = manifest.dims
        self.kv_cache = torch.zeros(
            (dims["num_layers"], 2, num_blocks, dims["num_kv_heads"], self.block_size, dims["head_dim"]),
            dtype=self.artifact.dtype,
            device=self.artifact.device,
        )
        self.artifact.model.bind_kv_cache(self.kv_cache)
        self.block_pool = BlockPool(num_blocks, self.block_size, self.options.enable_prefix_caching)
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=self.options.max_num_seqs,
                max_num_batched_tokens=max(self.options.max_num_batched_tokens, 1),
                max_model_len=self.max_model_len,
            ),
            self.block_pool,
        )
        self.runner = ModelRunner(self.artifact.model, self.artifact.device, self.block_size)
        if self.options.cuda_graphs:
            # The plan's batch sizes, up to this engine's max_num_seqs; larger decode batches run eagerly.
            planned = self.artifact.memory_plan.get("cuda_graph_batch_sizes") or [1]
            sizes = [b for b in planned if b <= self.options.max_num_seqs]
            self.runner.capture_cuda_graphs(sizes, self.max_model_len)
        self.artifact.wait_verified()  # refuse a modified artifact before serving anything
        self.output_processor = OutputProcessor(self.tokenizer)
        self._ids = itertools.count()
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        async_default = self.artifact.device.type == "cuda"
        self.async_scheduling = async_default if self.options.async_scheduling is None else self.options.async_scheduling
        self._inflight: LaunchedStep | None = None  # launched, tokens not collected yet
        self._host_sampling: set[str] = set()  # parents whose sampling needs the host (synchronous steps)

    def _num_kv_blocks(self) -> int:
        bytes_per_block = int(self.artifact.memory_plan["bytes_per_block"])
        if self.options.kv_cache_memory is not None:
            budget = parse_size(self.options.kv_cache_memory)
        elif self.artifact.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.artifact.device)
            used = total - free
            reserve = int(self.artifact.memory_plan.get("activation_bytes", 1 << 30))
            budget = int(total * self.options.gpu_memory_utilization) - used - reserve
        else:
            needed = self.options.max_num_seqs * self.max_model_len * bytes_per_block // self.block_size
            budget = min(CPU_DEFAULT_KV_BYTES, max(needed, bytes_per_block))
        return max(0, budget // bytes_per_block)

    # -- requests ---------------------------------------------------------------------------

    def tokenize(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError(
                    "this artifact has no tokenizer: send the prompt as token ids", param="prompt"
                )
            return prompt, list(self.tokenizer.encode(prompt, add_special_tokens=False))
        if not isinstance(prompt, (list, tuple)) or not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise InvalidRequestError("prompt must be a string or a list of token ids", param="prompt")
        bad = [t for t in prompt if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequestError(
                f"token id {bad[0]} is out of range for this model's vocabulary of {self.vocab_size}", param="prompt"
            )
        return None, list(prompt)

    def validate(self, prompt: str | list[int], params: SamplingParams) -> tuple[str | None, list[int], int]:
        """Tokenize and check a request without touching engine state (safe from any thread).

        Returns (prompt text, prompt token ids, resolved max_tokens)."""
        text, ids = self.tokenize(prompt)
        if not ids:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        n = len(ids)
        if n >= self.max_model_len:
            raise InvalidRequestError(
                f"this model's maximum context length is {self.max_model_len} tokens, but the prompt has {n} tokens",
                param="prompt",
                code="context_length_exceeded",
            )
        max_tokens = params.max_tokens if params.max_tokens is not None else self.max_model_len - n
        if n + max_tokens > self.max_model_len:
            raise InvalidRequestError(
                f"this model's maximum context length is {self.max_model_len} tokens; the prompt has {n} tokens "
                f"and {max_tokens} were requested for the completion ({n + max_tokens} in all): reduce the "
                f"prompt or max_tokens",
                param="max_tokens",
                code="context_length_exceeded",
            )
        return text, ids, max_tokens

    def add_request(
        self,
        request_id: str | None,
        prompt: str | list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
        validated: tuple[str | None, list[int], int] | None = None,
    ) -> str:
        text, ids, max_tokens = validated or self.validate(prompt, params)
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self.output_processor.parents:
            raise InvalidRequestError(f"request id {request_id!r} is already running", param="request_id")
        children = [
            Request(
                request_id if params.n == 1 else f"{request_id}#{i}",
                ids,
                params,
                eos_token_ids=self.eos_token_ids,
                max_tokens=max_tokens,
                parent_id=request_id,
                index=i,
                arrival_time=arrival_time,
            )
            for i in range(params.n)
        ]
        if self.options.enable_prefix_caching and params.prompt_logprobs is None:
            for child in children[1:]:  # the siblings share the first one's prompt blocks
                child.prefill_after = children[0]
        self.output_processor.add(ParentRequest(request_id, text, ids, children))
        if params.logprobs is not None or params.prompt_logprobs is not None or params.has_penalties:
            self._host_sampling.add(request_id)
        self.num_prompt_tokens += len(ids)
        for child in children:
            self.scheduler.add_request(child)
        return request_id

    def abort_request(self, request_ids: list[str]) -> list[RequestOutput]:
        """Abort requests (unknown or finished ids are ignored); returns their final outputs."""
        outputs = []
        for rid in request_ids:
            parent = self.output_processor.parents.get(rid)
            if parent is None:
                continue
            live = [c for c in parent.children if not c.is_finished]
            self.scheduler.finish_requests([c.request_id for c in live], RequestStatus.FINISHED_ABORTED)
            for child in live:
                child.status = RequestStatus.FINISHED_ABORTED
                self.output_processor.finish(child)
            outputs.append(self.output_processor.make_output(parent))
        return outputs

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or self._inflight is not None

    def num_unfinished(self) -> int:
        return len(self.output_processor.parents)

    # -- the step ---------------------------------------------------------------------------

    def step(self, only_finished: bool = False) -> list[RequestOutput]:
        """Run one step; returns the outputs of the requests it advanced (with ``only_finished``,
        of those it finished).

        With asynchronous scheduling a step launches step N on the device, then waits for step
        N-1 and returns its outputs: the host plans and books while the device computes."""
        if self.async_scheduling and not self._needs_host_sampling():
            scheduled = self.scheduler.schedule()
            launched = None
            if scheduled.total_num_scheduled_tokens:
                launched = self.runner.launch(scheduled, self._inflight)
                self.scheduler.mark_computed(scheduled)
            outputs = self._collect_inflight(only_finished)
            self._inflight = launched
            if launched is not None and not self.scheduler.has_unfinished_requests():
                # Everything it computed belongs to requests that have just finished (a stop
                # token or string): wait for it now, so the engine is idle when it says so.
                outputs += self._collect_inflight(only_finished)
            return outputs
        outputs = self._collect_inflight(only_finished)  # leaving asynchronous mode
        scheduled = self.scheduler.schedule()
        if scheduled.total_num_scheduled_tokens == 0:
            return outputs
        result = self.runner.execute(scheduled)
        self.scheduler.mark_computed(scheduled)
        return outputs + self._book(scheduled, result, only_finished)

    def _needs_host_sampling(self) -> bool:
        if self._host_sampling:
            self._host_sampling.intersection_update(self.output_processor.parents)
        return bool(self._host_sampling)

    def _collect_inflight(self, only_finished: bool) -> list[RequestOutput]:
        inflight, self._inflight = self._inflight, None
        if inflight is None:
            return []
        return self._book(inflight.scheduled, self.runner.collect(inflight), only_finished)

    def _book(self, scheduled: SchedulerOutput, result: RunnerOutput, only_finished: bool) -> list[RequestOutput]:
        """Append a finished step's tokens to its requests and make their outputs."""
        updated = self.scheduler.add_sampled_tokens(scheduled, result.sampled)
        self.num_generation_tokens += len(updated)
        outputs, stopped = self.output_processor.process(
            updated, result.logprobs, result.prompt_logprobs, only_finished=only_finished
        )
        if stopped:
            self.scheduler.finish_requests(stopped, RequestStatus.FINISHED_STOPPED)
            touched = {self.output_processor.children[rid].parent_id for rid in stopped}
            outputs = [o for o in outputs if o.request_id not in touched]
            for pid in touched:
                parent = self.output_processor.parents.get(pid)
                if parent is not None:
                    outputs.append(self.output_processor.make_output(parent))
        return outputs

    def stats(self) -> EngineStats:
        pool = self.block_pool
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
        )
