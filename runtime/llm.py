"""LLM: offline batch generation, the Python API most users start with.

    from pagecast.runtime import LLM, SamplingParams
    llm = LLM("artifacts/smollm2-135m")
    outputs = llm.generate(["Hello"], SamplingParams(max_tokens=32, temperature=0))
    print(outputs[0].text)
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from pagecast.runtime.engine import LLMEngine
from pagecast.runtime.outputs import RequestOutput
from pagecast.runtime.sampling_params import SamplingParams


class LLM:
    """Loads an artifact once; ``generate`` runs a batch through continuous batching and
    returns one RequestOutput per prompt, in prompt order."""

    def __init__(self, artifact: str | os.PathLike[str], **engine_options: Any):
        self.engine = LLMEngine(artifact, **engine_options)

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: str | list[int] | Sequence[str | list[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)  # type: ignore[arg-type]
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = (
            [sampling_params] * len(prompts) if isinstance(sampling_params, SamplingParams) else list(sampling_params)
        )
        if len(params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params)} sampling params")
        # Validate everything first, so a bad prompt fails the call before any work starts.
        validated = [self.engine.validate(p, sp) for p, sp in zip(prompts, params)]
        ids = [
            self.engine.add_request(None, p, sp, validated=v) for p, sp, v in zip(prompts, params, validated)
        ]
        finished: dict[str, RequestOutput] = {}
        try:
            while len(finished) < len(ids):
                for out in self.engine.step(only_finished=True):
                    if out.finished:
                        finished[out.request_id] = out
                if not self.engine.has_unfinished_requests() and len(finished) < len(ids):
                    raise RuntimeError("the engine has no work left but some requests did not finish")
        except BaseException:
            self.engine.abort_request([i for i in ids if i not in finished])
            raise
        return [finished[i] for i in ids]
