"""Per-request sampling parameters, validated where they are made."""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass, field
from typing import Any

STRUCTURED_OUTPUT_TYPES = ("json_object", "json_schema", "regex", "choice", "grammar")


class RequestOutputKind(enum.IntEnum):
    """What each ``RequestOutput`` of a request holds (vLLM's names and meanings).

    - ``CUMULATIVE``: everything so far, after every step (each output copies the whole
      output: its cost per step grows with the output's length);
    - ``DELTA``: only what is new since the previous output of the request: the text, token
      ids and logprobs of the choices that advanced (cost per step independent of the length;
      what streaming servers use); prompt logprobs come once, complete;
    - ``FINAL_ONLY``: one output, when the request has finished (``LLM.generate`` and
      non-streaming requests).
    """

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass(frozen=True)
class StructuredOutput:
    """Constrain the output (``response_format``, vLLM's ``guided_*`` fields, tool calls).

    ``type`` says which of the other fields holds the constraint:

    - ``"json_object"``: any JSON object (no other field);
    - ``"json_schema"``: ``json_schema``, the schema, as a dict or JSON text;
    - ``"regex"``: ``regex``, a regular expression the whole output matches;
    - ``"choice"``: ``choice``, the output is exactly one of these strings;
    - ``"grammar"``: ``grammar``, an EBNF grammar in xgrammar's dialect (rule ``root``).

    The constraint is kept in a canonical text form (a schema as JSON with sorted keys), which is
    also the key of the engine's cache of compiled grammars, and checked here with the grammar
    library, so one it cannot compile is a ``ValueError`` that says why before the request
    reaches the engine.
    """

    type: str = "json_object"
    json_schema: Any = None  # dict or JSON text; stored as canonical JSON text
    regex: str | None = None
    choice: tuple[str, ...] | None = None  # any sequence of strings; stored as a tuple
    grammar: str | None = None

    def __post_init__(self) -> None:
        _check(self.type in STRUCTURED_OUTPUT_TYPES, "structured_output", f"type must be one of {', '.join(STRUCTURED_OUTPUT_TYPES)}")
        for name in ("json_schema", "regex", "choice", "grammar"):
            if name != self.type:
                _check(getattr(self, name) is None, "structured_output", f"type {self.type} takes no {name}")
        from pagecast.runtime import structured_output as grammars

        if self.type == "json_object":
            return
        if self.type == "regex":
            _check(isinstance(self.regex, str) and bool(self.regex), "structured_output", "regex must be a non-empty string")
            grammars.check_regex(self.regex)
            return
        if self.type == "grammar":
            _check(isinstance(self.grammar, str) and bool(self.grammar.strip()), "structured_output", "grammar must be a non-empty string")
            grammars.check_grammar(self.grammar)
            return
        if self.type == "choice":
            choice = self.choice
            _check(
                isinstance(choice, (list, tuple)) and bool(choice) and all(isinstance(c, str) and c for c in choice),
                "structured_output",
                "choice must be a non-empty list of non-empty strings",
            )
            object.__setattr__(self, "choice", tuple(choice))  # type: ignore[arg-type]
            return
        schema = self.json_schema
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as exc:
                raise ValueError(f"structured_output json_schema is not valid JSON: {exc}") from None
        _check(isinstance(schema, dict), "structured_output", "json_schema must be a JSON object (a schema)")
        object.__setattr__(self, "json_schema", json.dumps(schema, sort_keys=True, separators=(",", ":")))
        grammars.check_json_schema(self.json_schema)  # ValueError("structured_output ...") naming the problem

    @property
    def key(self) -> tuple[str, str | None]:
        """What identifies the compiled grammar: the type and the constraint as text."""
        if self.type == "choice":
            return (self.type, json.dumps(list(self.choice or ())))
        return (self.type, {"json_schema": self.json_schema, "regex": self.regex, "grammar": self.grammar}.get(self.type))


@dataclass
class SamplingParams:
    """How to pick each next token and when to stop.

    Checked in ``__post_init__``: a bad value raises ``ValueError`` whose message starts with
    the field name, which the server turns into a 400 naming that ``param``.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = 16  # None: up to the context length
    min_tokens: int = 0  # until this many output tokens exist, eos and stop_token_ids are masked
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None  # number of top logprobs per generated token; 0 = only the chosen
    prompt_logprobs: int | None = None  # same for prompt tokens (echo)
    skip_special_tokens: bool = True
    # JSON mode, a JSON schema, a regex, a choice or a grammar: a grammar masks the tokens that would break it.
    structured_output: StructuredOutput | None = None
    # A thinking model's end-of-thinking token (Qwen3's "</think>"): the structured output
    # constrains only the tokens after it, as vLLM's does with a reasoning parser; None: all of them.
    structured_output_after: int | None = None
    # OpenAI's logit_bias: token id -> a value in [-100, 100] added to that token's logit before the
    # penalties, temperature and truncation (logprobs still describe the model's own distribution).
    logit_bias: dict[int, float] | None = None
    # vLLM's: keep only the prompt's last k tokens (-1: as many as the context holds); the front
    # end truncates when it tokenizes (``truncated_prompt``), so the output's prompt_token_ids are
    # the tokens kept, while its prompt text stays the one given, as in vLLM.
    truncate_prompt_tokens: int | None = None
    # What the request's outputs hold (the front end's business; the engine core ignores it).
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)
        if self.top_k == -1:
            self.top_k = 0
        _check(isinstance(self.n, int) and 1 <= self.n <= 128, "n", "must be an integer in [1, 128]")
        _check(0.0 <= self.temperature <= 2.0, "temperature", "must be in [0, 2]")
        _check(0.0 < self.top_p <= 1.0, "top_p", "must be in (0, 1]")
        _check(isinstance(self.top_k, int) and self.top_k >= 0, "top_k", "must be -1, 0 or a positive integer")
        _check(0.0 <= self.min_p <= 1.0, "min_p", "must be in [0, 1]")
        _check(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", "must be in [-2, 2]")
        _check(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", "must be in [-2, 2]")
        _check(0.0 < self.repetition_penalty <= 2.0, "repetition_penalty", "must be in (0, 2]")
        _check(
            self.max_tokens is None or (isinstance(self.max_tokens, int) and self.max_tokens >= 1),
            "max_tokens",
            "must be a positive integer",
        )
        _check(isinstance(self.min_tokens, int) and self.min_tokens >= 0, "min_tokens", "must be >= 0")
        _check(
            self.max_tokens is None or self.min_tokens <= self.max_tokens,
            "min_tokens",
            f"must be at most max_tokens ({self.max_tokens}), got {self.min_tokens}",
        )
        _check(all(isinstance(s, str) and s for s in self.stop), "stop", "must be non-empty strings")
        _check(len(self.stop) <= 16, "stop", "at most 16 stop strings")
        _check(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids), "stop_token_ids", "must be token ids")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _check(value is None or (isinstance(value, int) and 0 <= value <= 20), name, "must be in [0, 20]")
        _check(self.seed is None or isinstance(self.seed, int), "seed", "must be an integer")
        k = self.truncate_prompt_tokens
        _check(
            k is None or (isinstance(k, int) and not isinstance(k, bool) and (k >= 1 or k == -1)),
            "truncate_prompt_tokens", "must be a positive integer (the tokens kept), or -1 for as many as the context holds",
        )  # fmt: skip
        if self.logit_bias is not None:
            _check(isinstance(self.logit_bias, dict), "logit_bias", "must map token ids to numbers")
            _check(
                all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.logit_bias),
                "logit_bias", "keys must be token ids",
            )  # fmt: skip
            _check(
                all(isinstance(v, (int, float)) and not isinstance(v, bool) and -100.0 <= v <= 100.0
                    for v in self.logit_bias.values()),
                "logit_bias", "values must be numbers in [-100, 100]",
            )  # fmt: skip
            self.logit_bias = {t: float(v) for t, v in self.logit_bias.items()} or None
        _check(isinstance(self.output_kind, RequestOutputKind), "output_kind", "must be a RequestOutputKind")
        if self.structured_output is not None:
            _check(isinstance(self.structured_output, StructuredOutput), "structured_output", "must be a StructuredOutput")
            # The grammar ends the output with an end-of-sequence token once the JSON is complete:
            # both options would make it continue past that, where every token is masked.
            _check(not self.ignore_eos, "structured_output", "cannot be combined with ignore_eos")
            _check(self.min_tokens == 0, "structured_output", "cannot be combined with min_tokens")
        if self.structured_output_after is not None:
            _check(
                isinstance(self.structured_output_after, int) and not isinstance(self.structured_output_after, bool)
                and self.structured_output_after >= 0 and self.structured_output is not None,
                "structured_output_after", "must be a token id, with a structured_output",
            )  # fmt: skip

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0


def kept_tokens(k: int | None, max_model_len: int) -> int | None:
    """How many of a prompt's last tokens ``truncate_prompt_tokens`` = ``k`` keeps (None: all;
    -1: ``max_model_len``). A k past the context is a ``ValueError`` naming the field, as it
    could never be served."""
    if k is None:
        return None
    _check(
        k <= max_model_len, "truncate_prompt_tokens",
        f"is {k}, more than this model's maximum context length ({max_model_len} tokens)",
    )  # fmt: skip
    return max_model_len if k == -1 else k


def truncated_prompt(ids: list[int], params: SamplingParams, max_model_len: int) -> list[int]:
    """The prompt's token ids that ``params.truncate_prompt_tokens`` keeps: its last k (all of
    them when it has fewer; see ``kept_tokens``)."""
    keep = kept_tokens(params.truncate_prompt_tokens, max_model_len)
    return ids[-keep:] if keep is not None and len(ids) > keep else ids


def _check(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise ValueError(f"{name} {message}")
