"""LLMEngine: the engine in one process. add_request / abort_request / step.

One step: the core (scheduler, model runner, sampler) runs the device work and books the new
tokens; the output processor detokenizes them, applies stop strings and makes
RequestOutputs. ``LLM`` (offline batches) drives this class in the caller's process; the
server runs ``EngineCore`` in an engine-core process of its own and does the output side
itself (``AsyncEngine``).
"""

from __future__ import annotations

import itertools
import os
from typing import Any

from pagecast.runtime import generation_config
from pagecast.runtime.engine_core import EngineCore, EngineOptions, StepResult, parse_size
from pagecast.runtime.errors import InvalidRequestError
from pagecast.runtime.loader import LoadedArtifact
from pagecast.runtime.messages import EngineStats
from pagecast.runtime.output_processor import OutputProcessor, ParentRequest
from pagecast.runtime.outputs import RequestOutput
from pagecast.runtime.request import RequestStatus
from pagecast.runtime.sampling_params import SamplingParams, truncated_prompt
from pagecast.runtime.tokenization import encode_text

__all__ = ["EngineOptions", "EngineStats", "LLMEngine", "parse_size", "tokenize_prompt", "truncate_prompt"]


def truncate_prompt(ids: list[int], params: SamplingParams, max_model_len: int) -> list[int]:
    """The prompt tokens a request keeps under its ``truncate_prompt_tokens`` (a bad value is an
    ``InvalidRequestError`` naming the field)."""
    try:
        return truncated_prompt(ids, params, max_model_len)
    except ValueError as exc:
        raise InvalidRequestError(str(exc), param="truncate_prompt_tokens") from None


def tokenize_prompt(tokenizer: Any | None, prompt: str | list[int]) -> tuple[str | None, list[int]]:
    """(text, token ids) of a prompt given as text or as token ids (no special tokens added)."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise InvalidRequestError(
                "this artifact has no tokenizer: send the prompt as token ids", param="prompt"
            )
        return prompt, encode_text(tokenizer, prompt)
    if not isinstance(prompt, (list, tuple)) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in prompt
    ):
        raise InvalidRequestError("prompt must be a string or a list of token ids", param="prompt")
    return None, list(prompt)


class LLMEngine:
    """The core and the output processor in the caller's process. Not thread-safe: one thread
    calls add_request / abort_request / step."""

    def __init__(self, artifact: str | os.PathLike[str] | LoadedArtifact, **options: Any):
        self.core = EngineCore(artifact, EngineOptions(**options))
        self.options = self.core.options
        self.artifact = self.core.artifact
        self.model_name = self.core.model_name
        self.tokenizer = self.artifact.tokenizer
        self.generation_defaults = generation_config.load_defaults(self.artifact.path)
        self.block_size = self.core.block_size
        self.eos_token_ids = self.core.eos_token_ids
        self.vocab_size = self.core.vocab_size
        self.max_model_len = self.core.max_model_len
        self.output_processor = OutputProcessor(self.tokenizer, records_prompt_logprobs=False)
        self._ids = itertools.count()

    # The core's parts, for tests and benchmarks that look inside.
    @property
    def block_pool(self):  # type: ignore[no-untyped-def]
        return self.core.block_pool

    @property
    def scheduler(self):  # type: ignore[no-untyped-def]
        return self.core.scheduler

    @property
    def runner(self):  # type: ignore[no-untyped-def]
        return self.core.runner

    @property
    def kv_cache(self):  # type: ignore[no-untyped-def]
        return self.core.kv_cache

    @property
    def async_scheduling(self) -> bool:
        return self.core.async_scheduling

    # -- requests ---------------------------------------------------------------------------

    def tokenize(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        return tokenize_prompt(self.tokenizer, prompt)

    def validate(self, prompt: str | list[int], params: SamplingParams) -> tuple[str | None, list[int], int]:
        """Tokenize and check a request without touching engine state (safe from any thread).

        Returns (prompt text, prompt token ids, resolved max_tokens)."""
        text, ids = self.tokenize(prompt)
        ids = truncate_prompt(ids, params, self.max_model_len)
        return text, ids, self.core.check_prompt(ids, params)

    def add_request(
        self,
        request_id: str | None,
        prompt: str | list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
        validated: tuple[str | None, list[int], int] | None = None,
        priority: int = 0,
    ) -> str:
        """Queue a request; returns its id. ``priority``: under the "priority" scheduling policy
        (EngineOptions.scheduling_policy), lower is served first; under "fcfs" only 0."""
        text, ids, max_tokens = validated or self.validate(prompt, params)
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self.output_processor.parents:
            raise InvalidRequestError(f"request id {request_id!r} is already running", param="request_id")
        children = self.core.add_request(request_id, ids, params, max_tokens, arrival_time, priority)
        self.output_processor.add(ParentRequest(request_id, text, ids, children))
        return request_id

    def abort_request(self, request_ids: list[str]) -> list[RequestOutput]:
        """Abort requests (unknown or finished ids are ignored); returns their final outputs."""
        outputs = []
        for rid in request_ids:
            live = self.output_processor.live_sequences(rid)
            if live is None:
                continue
            self.core.finish(live, RequestStatus.FINISHED_ABORTED)
            outputs.append(self.output_processor.abort(rid))
        return outputs

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    def num_unfinished(self) -> int:
        return len(self.output_processor.parents)

    # -- the step ---------------------------------------------------------------------------

    def step(self, only_finished: bool = False) -> list[RequestOutput]:
        """Run one step; returns the outputs of the requests it advanced (with ``only_finished``,
        of those it finished).

        A constrained request's grammar compiles in the background (add_request returns at
        once, unless the compile is already over): when it fails, the request is ended and
        forgotten, and the step that finds it raises ``InvalidRequestError`` (param
        ``response_format``, code ``invalid_json_schema``), its message naming the request. Such
        a step does nothing else; the other requests go on at the next one."""
        outputs: list[RequestOutput] = []
        results = self.core.step()
        failed = self.core.take_failed()
        if failed:
            assert not results  # the core's step stops at a failure, before any device work
            for request_id in failed:
                parent = self.output_processor.parents.get(request_id)
                if parent is not None:
                    self.output_processor.make_output(parent)  # every sequence has ended: forgets it
            first = next(iter(failed.values()))
            message = "; ".join(f"request {request_id!r}: {exc.message}" for request_id, exc in failed.items())
            raise InvalidRequestError(message, param=first.param, code=first.code)
        for result in results:
            outputs += self._process(result, only_finished)
        return outputs

    def _process(self, result: StepResult, only_finished: bool) -> list[RequestOutput]:
        outputs, stopped = self.output_processor.process(
            result.updated, result.logprobs, result.prompt_logprobs, only_finished=only_finished,
            num_new_tokens=result.num_new_tokens,
        )
        if stopped:
            self.core.finish(stopped, RequestStatus.FINISHED_STOPPED)
            outputs = self.output_processor.remake_outputs(outputs, stopped)
        return outputs

    def stats(self) -> EngineStats:
        return self.core.stats()
