"""Request models of the OpenAI-compatible API and the limits shared by every endpoint.

Parsing is strict (a string where a number belongs is a 400, not a silent cast) and every
range is checked here, so an error names the parameter as the client spelled it.
``SamplingParams`` checks again, as a backstop; the two are kept in step by the constants
below.

Parameters OpenAI defines that this server does not implement are declared too, so that
using them gets a 400 that says so instead of being ignored. Unknown extra fields are
ignored, as vLLM does, so newer clients keep working; the log names each such field once.
"""

from __future__ import annotations

import logging
from typing import Any, Literal

from pydantic import ConfigDict, Field, ValidationError, field_validator

from pagecast.runtime.request import PRIORITY_LIMIT
from pagecast.runtime.sampling_params import SamplingParams, StructuredOutput, kept_tokens
from pagecast.runtime.server.errors import (
    APIError,
    from_sampling_value_error,
    from_validation_error,
    invalid_request,
    unsupported,
)
from pagecast.runtime.server.limits import RequestModel
from pagecast.runtime.server.tool_calls import (
    MessageToolCall,
    Tool,
    ToolChoice,
    check_tool_choice,
    check_tools,
)

# Shared field limits.
MAX_N = 128
MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 16
MAX_STOP_TOKEN_IDS = 64
MAX_PROMPTS = 1024  # prompts in one completions request (lm-eval batches several)
MIN_TEMPERATURE, MAX_TEMPERATURE = 0.0, 2.0
MIN_PENALTY, MAX_PENALTY = -2.0, 2.0
MAX_REPETITION_PENALTY = 2.0
# The engine derives one torch seed per choice as seed * 1_000_003 + index, which must stay
# inside a 64-bit integer; 32-bit seeds are what clients send in practice.
MIN_SEED, MAX_SEED = -(2**31), 2**32 - 1
DEFAULT_COMPLETION_MAX_TOKENS = 16

logger = logging.getLogger("pagecast.server")
_warned_extra: set[str] = set()  # ignored request fields the log has named (each once per process)
_MAX_WARNED_EXTRA = 256  # past this many names, no more: a client sending random names cannot grow it


# Every model below derives from RequestModel (limits.py): strict parsing, NaN and infinities
# refused by name ("must be a finite number") instead of failing a range check with a confusing
# message (NaN is neither <= 2 nor >= 0), and every integer inside int64.


class StreamOptions(RequestModel):
    """``include_usage``: a usage-only chunk before ``[DONE]``. ``continuous_usage_stats``:
    also the usage so far in every chunk (vLLM's extension)."""

    include_usage: bool = False
    continuous_usage_stats: bool = False


class StructuredOutputs(RequestModel):
    """vLLM's ``structured_outputs``: one of ``json``, ``json_object``, ``regex``, ``choice``,
    ``grammar``."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None


class _SamplingRequest(RequestModel):
    """Fields common to /v1/completions and /v1/chat/completions."""

    # Unknown top-level fields are kept aside (model_extra), unused, so the log can name them.
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float | None = Field(None, ge=MIN_TEMPERATURE, le=MAX_TEMPERATURE)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    seed: int | None = Field(None, ge=MIN_SEED, le=MAX_SEED)
    presence_penalty: float | None = Field(None, ge=MIN_PENALTY, le=MAX_PENALTY)
    frequency_penalty: float | None = Field(None, ge=MIN_PENALTY, le=MAX_PENALTY)
    repetition_penalty: float | None = Field(None, gt=0.0, le=MAX_REPETITION_PENALTY)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS)
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM's extension: also answer the prompt's and each choice's token ids.
    return_token_ids: bool = False
    # vLLM's structured output extensions (the older guided_* fields and the newer object).
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: StructuredOutputs | None = None
    # token id (a string of digits, as JSON keys are) -> a bias in [-100, 100] added to its logit
    logit_bias: dict[str, float] | None = None
    # vLLM's: every prompt position's logprob and the k best there (the first position: null),
    # answered as `prompt_logprobs`, on each choice of a completion and on a chat response.
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    # vLLM's: keep only the prompt's last k tokens (-1: as many as the context holds), so a long
    # document can be sent as it is; usage counts the tokens kept.
    truncate_prompt_tokens: int | None = Field(None, ge=-1)
    # vLLM's: a scheduling priority (lower is served first) for an engine started with
    # --scheduling-policy priority; under the default policy (first come, first served) only 0 is
    # accepted, as vLLM does (GenerationRun checks it against the model's engine).
    priority: int = Field(0, ge=-PRIORITY_LIMIT, le=PRIORITY_LIMIT)

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, value: str | list[str] | None) -> list[str] | None:
        if value is None:
            return None
        stops = [value] if isinstance(value, str) else value
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings")
        if any(not s for s in stops):
            raise ValueError("stop strings must not be empty")
        return stops

    @field_validator("truncate_prompt_tokens")
    @classmethod
    def _check_truncation(cls, value: int | None) -> int | None:
        if value == 0:
            raise ValueError("must be at least 1 (the tokens kept), or -1 for as many as the context holds")
        return value

    def kept_prompt_tokens(self, max_model_len: int) -> int | None:
        """How many of the prompt's last tokens ``truncate_prompt_tokens`` keeps (None: all)."""
        try:
            return kept_tokens(self.truncate_prompt_tokens, max_model_len)
        except ValueError as exc:
            raise invalid_request(f"{exc}.", "truncate_prompt_tokens") from None

    @field_validator("stop_token_ids")
    @classmethod
    def _check_stop_token_ids(cls, value: list[int] | None) -> list[int] | None:
        if value is not None and any(t < 0 for t in value):
            raise ValueError("token ids must be >= 0")
        return value

    def check_common(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise invalid_request("`stream_options` is only allowed when `stream` is true.", "stream_options")
        if self.prompt_logprobs is not None and self.stream:
            raise invalid_request("`prompt_logprobs` are not available when `stream` is true.", "prompt_logprobs")

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.continuous_usage_stats

    def structured_output(self) -> tuple[StructuredOutput | None, str]:
        """The request's output constraint and the parameter it came from: ``response_format``,
        a ``guided_*`` field or ``structured_outputs`` (at most one of them; 400 otherwise)."""
        sources: list[tuple[str, Any]] = []
        response_format = getattr(self, "response_format", None)
        if response_format is not None and response_format.get("type", "text") != "text":
            sources.append(("response_format", response_format))
        for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs"):
            if getattr(self, name) is not None:
                sources.append((name, getattr(self, name)))
        if not sources:
            return structured_output(response_format), "response_format"
        if len(sources) > 1:
            names = ", ".join(f"`{n}`" for n, _ in sources)
            raise invalid_request(f"Give at most one output constraint; this request has {names}.", sources[1][0])
        name, value = sources[0]
        if name == "response_format":
            return structured_output(value), name
        if name == "structured_outputs":
            given = {k: v for k, v in value.model_dump(by_alias=True).items() if v not in (None, False)}
            if len(given) != 1:
                raise invalid_request(
                    "`structured_outputs` takes exactly one of `json`, `json_object`, `regex`, `choice`, `grammar`.",
                    name,
                )
            kind, spec = next(iter(given.items()))
        else:
            kind, spec = name.removeprefix("guided_"), value
        try:
            if kind == "json_object":
                return StructuredOutput("json_object"), name
            if kind == "json":
                return StructuredOutput("json_schema", spec), name
            return StructuredOutput(kind, **{kind: spec}), name
        except ValueError as exc:
            reason = str(exc).removeprefix("structured_output ")
            code = "invalid_json_schema" if kind == "json" else "invalid_value"
            raise invalid_request(f"Invalid `{name}`: {reason}", name, code=code) from None

    def _sampling_params(
        self,
        max_tokens: int | None,
        logprobs: int | None,
        prompt_logprobs: int | None,
        rename: dict[str, str],
        forced: StructuredOutput | None = None,
        forced_by: str = "tool_choice",
    ) -> SamplingParams:
        constraint, source = self.structured_output()
        if forced is not None:
            if constraint is not None:
                raise invalid_request(f"`{source}` cannot be combined with `{forced_by}` {self._forced_name()}.", source)
            constraint, source = forced, forced_by
        kwargs: dict[str, Any] = {
            "n": self.n,
            "max_tokens": max_tokens,
            "min_tokens": self.min_tokens,
            "stop": list(self.stop or []),
            "stop_token_ids": list(self.stop_token_ids or []),
            "ignore_eos": self.ignore_eos,
            "include_stop_str_in_output": self.include_stop_str_in_output,
            "skip_special_tokens": self.skip_special_tokens,
            "logprobs": logprobs,
            "prompt_logprobs": prompt_logprobs,
            "seed": self.seed,
            "structured_output": constraint,
            "logit_bias": self._token_biases(),
        }
        # None means "the default": leave it to SamplingParams so there is one default per field.
        for name in (
            "temperature",
            "top_p",
            "top_k",
            "min_p",
            "presence_penalty",
            "frequency_penalty",
            "repetition_penalty",
        ):
            value = getattr(self, name)
            if value is not None:
                kwargs[name] = value
        try:
            return SamplingParams(**kwargs)
        except ValueError as exc:
            raise from_sampling_value_error(exc, {**rename, "structured_output": source}) from None

    def _token_biases(self) -> dict[int, float] | None:
        """``logit_bias`` with its keys as token ids (the range against the vocabulary is checked
        with the prompt, engine_core.check_prompt)."""
        if not self.logit_bias:
            return None
        biases = {}
        for key, value in self.logit_bias.items():
            token = key.strip()
            if not (token.isascii() and token.isdigit()) or int(token) >= 2**31:
                raise invalid_request(
                    f"`logit_bias` keys are token ids (strings of digits below 2^31), got {key[:40]!r}.", "logit_bias"
                )
            biases[int(token)] = value
        return biases

    def _forced_name(self) -> str:
        return "required or a named function"


class CompletionRequest(_SamplingRequest):
    """POST /v1/completions. ``prompt`` is a string, a list of strings, a list of token ids
    or a list of token-id lists (what lm-evaluation-harness sends)."""

    prompt: Any
    max_tokens: int | None = Field(DEFAULT_COMPLETION_MAX_TOKENS, ge=0)
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1)
    # As on chat (vLLM accepts it here too): JSON mode or a JSON schema.
    response_format: dict[str, Any] | None = None

    @field_validator("prompt")
    @classmethod
    def _check_prompt(cls, value: Any) -> list[str] | list[list[int]]:
        """Normalised to a list of prompts, each all-text or all-token-ids."""
        if value is None:
            raise ValueError("a prompt is required")
        if isinstance(value, str):
            return [value]
        if not isinstance(value, list) or not value:
            raise ValueError(
                "must be a string, a list of strings, a list of token ids or a list of such lists"
            )
        if all(_is_token_id(t) for t in value):
            return [list(value)]  # one prompt of token ids, however long (the context decides)
        if len(value) > MAX_PROMPTS:
            raise ValueError(f"at most {MAX_PROMPTS} prompts per request")
        if all(isinstance(p, str) for p in value):
            return list(value)
        if all(isinstance(p, list) and p and all(_is_token_id(t) for t in p) for p in value):
            return [list(p) for p in value]
        raise ValueError(
            "must be a string, a list of strings, a non-empty list of token ids (integers >= 0) "
            "or a list of such lists"
        )

    def check(self) -> None:
        self.check_common()
        if self.suffix:
            raise unsupported("suffix")
        if self.best_of is not None and self.best_of != self.n:
            if self.best_of < self.n:
                raise invalid_request("`best_of` must be greater than or equal to `n`.", "best_of")
            raise unsupported("best_of", "best_of > n is not implemented; use n")
        if self.max_tokens == 0 and not self.echo:
            raise invalid_request("`max_tokens` must be at least 1 unless `echo` is true.", "max_tokens")
        if self.stream and self.max_tokens == 0:
            raise invalid_request(
                "`max_tokens` 0 (scoring the prompt only) cannot be streamed.", "max_tokens"
            )

    @property
    def prompts(self) -> list[str] | list[list[int]]:
        return self.prompt  # type: ignore[no-any-return]

    def to_sampling_params(self, max_tokens: int | None) -> SamplingParams:
        wanted = [self.logprobs if self.echo else None, self.prompt_logprobs]  # echo's, vLLM's
        prompt_logprobs = max((k for k in wanted if k is not None), default=None)
        return self._sampling_params(max_tokens, self.logprobs, prompt_logprobs, {})


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


class TextPart(RequestModel):
    type: str
    text: str | None = None


class ChatMessage(RequestModel):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None  # assistant: the calls it made
    tool_call_id: str | None = None  # tool: the call this message answers

    def text(self, index: int) -> str:
        """The message's content as one string (text parts joined)."""
        where = f"messages[{index}]"
        if self.role == "function":
            raise unsupported(f"{where}.role", "role `function` (deprecated by OpenAI; use `tool` messages)")
        if self.tool_calls and self.role != "assistant":
            raise invalid_request(f"`{where}.tool_calls` is only allowed on `assistant` messages.", f"{where}.tool_calls")
        if self.role == "tool" and not self.tool_call_id:
            raise invalid_request(
                f"`{where}.tool_call_id` is required for role `tool`.", f"{where}.tool_call_id", "missing_required_parameter"
            )
        if self.content is None:
            if self.role == "assistant":
                return ""
            raise invalid_request(
                f"`{where}.content` is required for role `{self.role}`.", f"{where}.content"
            )
        if isinstance(self.content, str):
            return self.content
        texts = []
        for j, part in enumerate(self.content):
            if part.type != "text" or part.text is None:
                raise unsupported(
                    f"{where}.content[{j}].type", f"content part type `{part.type}` (text only)"
                )
            texts.append(part.text)
        return "".join(texts)


class ChatCompletionRequest(_SamplingRequest):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(..., min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    # vLLM's extensions: leave the final (assistant) message open so the model continues it (a
    # prefilled answer; add_generation_prompt must then be false), and more template variables
    # ({"enable_thinking": false} for Qwen3's template).
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None  # "auto" when tools are given, else "none"
    # False: at most one call (the grammar of a forced call allows one; "auto" reports the first).
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
    # Not implemented: refused with a 400 that says so.
    functions: list[Any] | None = None
    function_call: Any = None
    audio: Any = None
    prediction: Any = None

    def check(self) -> None:
        self.check_common()
        for name in ("functions", "audio", "prediction"):
            if getattr(self, name):
                raise unsupported(name, "use `tools`" if name == "functions" else "")
        if self.function_call not in (None, "none"):
            raise unsupported("function_call", "use `tool_choice`")
        if self.tools:
            check_tools(self.tools)
        check_tool_choice(self.tools, self.tool_choice)
        if self.top_logprobs is not None and not self.logprobs:
            raise invalid_request("`top_logprobs` requires `logprobs` to be true.", "top_logprobs")

    def to_sampling_params(self, max_tokens: int | None, forced: StructuredOutput | None = None) -> SamplingParams:
        """``forced``: the grammar of a forced tool call (tool_choice required or named)."""
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._sampling_params(max_tokens, logprobs, self.prompt_logprobs, {"logprobs": "top_logprobs"}, forced)

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


def structured_output(response_format: dict[str, Any] | None) -> StructuredOutput | None:
    """``response_format`` as the engine's ``StructuredOutput`` (None for plain text): a shape
    that is not OpenAI's, or a schema the grammar library cannot compile, is a 400 that says why
    (code ``invalid_json_schema`` for the schema). Runs in the request's worker thread: the
    schema check compiles a grammar (cached per schema)."""
    if response_format is None:
        return None
    spec = response_format.get("json_schema")
    return output_format(
        response_format.get("type", "text"),
        spec.get("schema") if isinstance(spec, dict) else None,
        "response_format",
        ("response_format", "response_format.json_schema.schema", "response_format"),
        '{"type": "json_schema", "json_schema": {"name": "...", "schema": {...}}}',
    )


def output_format(
    kind: Any, schema: Any, where: str, params: tuple[str, str, str], example: str
) -> StructuredOutput | None:
    """An output format (``type`` ``kind``: "text", "json_object" or "json_schema" with
    ``schema``) as a ``StructuredOutput``; ``where`` names it in messages, ``params`` are the
    parameters a 400 names for the type, the schema's shape and its compilation (chat's
    ``response_format``, the Responses API's ``text.format``), ``example`` the right shape."""
    type_param, schema_name, schema_param = params
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput("json_object")
    if kind != "json_schema":
        raise unsupported(type_param, f"type {kind!r}; use 'text', 'json_object' or 'json_schema'")
    if not isinstance(schema, dict):
        raise invalid_request(
            f"`{schema_name}` must be a JSON schema (an object), as in {example}.", schema_param, code="invalid_json_schema"
        )
    try:
        return StructuredOutput("json_schema", schema)
    except ValueError as exc:
        reason = str(exc).removeprefix("structured_output ")
        raise invalid_request(f"Invalid `{where}`: {reason}", schema_param, code="invalid_json_schema") from None


def parse_request(model_cls: type[_SamplingRequest], body: bytes) -> Any:
    """Parse and check a request body; every problem is an APIError (400)."""
    if not body.strip():
        raise invalid_request("The request body is empty; send a JSON object.", code="invalid_json")
    try:
        request = model_cls.model_validate_json(body)
    except ValidationError as exc:
        raise from_validation_error(exc) from None
    request.check()  # type: ignore[attr-defined]
    _log_ignored(model_cls.__name__, request.model_extra)
    return request


def _log_ignored(kind: str, extra: dict[str, Any] | None) -> None:
    """Name, once per process, each request field this server does not know and ignores (a
    client may rely on it: vLLM's extensions not implemented here, or a misspelt parameter)."""
    new = sorted(name[:64] for name in extra or () if name[:64] not in _warned_extra)
    if not new or len(_warned_extra) >= _MAX_WARNED_EXTRA:
        return
    _warned_extra.update(new)
    logger.warning("%s: ignored request field(s) this server does not implement: %s", kind, ", ".join(new))


__all__ = [
    "APIError",
    "ChatCompletionRequest",
    "ChatMessage",
    "CompletionRequest",
    "StreamOptions",
    "parse_request",
]
