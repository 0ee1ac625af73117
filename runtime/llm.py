"""LLM: offline batch generation, the Python API most users start with.

    from pagecast.runtime import LLM, SamplingParams
    llm = LLM("artifacts/smollm2-135m")
    outputs = llm.generate(["Hello"], SamplingParams(max_tokens=32, temperature=0))
    print(outputs[0].text)
    replies = llm.chat([{"role": "user", "content": "Hi"}], SamplingParams(max_tokens=32))

Without SamplingParams, the checkpoint's own sampling defaults (its generation_config.json,
recorded in the artifact) apply; ``get_default_sampling_params`` shows them.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

from pagecast.runtime import chat_prompts, generation_config
from pagecast.runtime.engine import LLMEngine
from pagecast.runtime.engine_core import check_priority
from pagecast.runtime.outputs import RequestOutput
from pagecast.runtime.progress import GenerateProgress
from pagecast.runtime.sampling_params import SamplingParams

Prompt = str | list[int] | Mapping[str, Any]  # a text, token ids, {"prompt": ...} or {"prompt_token_ids": ...}


def _prompt_of(prompt: Prompt, index: int) -> str | list[int]:
    """A prompt as the engine takes it: vLLM's prompt dicts unwrapped."""
    if not isinstance(prompt, Mapping):
        return prompt
    keys = set(prompt)
    if keys == {"prompt"}:
        return prompt["prompt"]
    if keys == {"prompt_token_ids"}:
        return list(prompt["prompt_token_ids"])
    raise ValueError(
        f"prompt {index}: a prompt dict holds either 'prompt' (a string) or 'prompt_token_ids' (token ids), "
        f"and nothing else; got keys {sorted(keys)}"
    )


class LLM:
    """Loads an artifact once; ``generate`` runs a batch through continuous batching and
    returns one RequestOutput per prompt, in prompt order."""

    def __init__(self, artifact: str | os.PathLike[str], **engine_options: Any):
        self.engine = LLMEngine(artifact, **engine_options)

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What ``generate`` and ``chat`` use when given no SamplingParams: the checkpoint's
        generation_config.json values where it has them, SamplingParams' defaults elsewhere."""
        return generation_config.default_sampling_params(generation_config.engine_defaults(self.engine))

    def chat(
        self,
        messages: Sequence[Mapping[str, Any]] | Sequence[Sequence[Mapping[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of ``{"role", "content"}`` dicts) or to
        a list of conversations, each rendered with the artifact's chat template (or
        ``chat_template``, a Jinja template string) exactly as engine-serve renders
        /v1/chat/completions. One RequestOutput per conversation, in order.
        ``continue_final_message``: the final message (an assistant's opening words) is left
        open and the reply continues it (``add_generation_prompt=False`` with it);
        ``chat_template_kwargs``: more variables for the template, e.g. ``{"enable_thinking":
        False}`` for Qwen3's; ``tools``: OpenAI function tools (``{"type": "function", "function":
        {...}}``) for templates that offer them to the model (the reply's calls are in its text, in
        the template's format)."""
        conversations = chat_prompts.as_conversations(messages)
        prompts = [
            chat_prompts.render(
                self.tokenizer, c, chat_template, add_generation_prompt, continue_final_message, chat_template_kwargs,
                [dict(t) for t in tools] if tools else None,
            )
            for c in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """One RequestOutput per prompt, in prompt order. A prompt is a string, a list of token
        ids, or (as vLLM's TextPrompt and TokensPrompt) ``{"prompt": str}`` or
        ``{"prompt_token_ids": [int, ...]}``. ``use_tqdm``: show a progress bar (prompts
        finished, tokens per second) on stderr while the batch runs. ``priority``: one per
        prompt, for an engine made with ``scheduling_policy="priority"`` (lower is served first)."""
        if isinstance(prompts, (str, Mapping)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = [_prompt_of(p, i) for i, p in enumerate(prompts)]  # type: ignore[union-attr]
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params = (
            [sampling_params] * len(prompts) if isinstance(sampling_params, SamplingParams) else list(sampling_params)
        )
        if len(params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params)} sampling params")
        priorities = [0] * len(prompts) if priority is None else list(priority)
        if len(priorities) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(priorities)} priorities")
        # Validate everything first, so a bad prompt fails the call before any work starts.
        for p in priorities:
            check_priority(p, self.engine.options.scheduling_policy)
        validated = [self.engine.validate(p, sp) for p, sp in zip(prompts, params)]
        ids = [
            self.engine.add_request(None, p, sp, validated=v, priority=pr)
            for p, sp, v, pr in zip(prompts, params, validated, priorities)
        ]
        finished: dict[str, RequestOutput] = {}
        progress = GenerateProgress(len(ids), enabled=use_tqdm)
        try:
            while len(finished) < len(ids):
                for out in self.engine.step(only_finished=True):
                    if out.finished:
                        finished[out.request_id] = out
                        progress.update(out)
                if not self.engine.has_unfinished_requests() and len(finished) < len(ids):
                    raise RuntimeError("the engine has no work left but some requests did not finish")
        except BaseException:
            self.engine.abort_request([i for i in ids if i not in finished])
            raise
        finally:
            progress.close()
        return [finished[i] for i in ids]
