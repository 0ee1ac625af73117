"""Speculative decoding: propose a few tokens cheaply, verify them in one target pass.

A decoding request is one token behind the target model: its last token has no K/V yet. With
speculation the engine asks a *proposer* for up to ``k`` draft tokens that may follow it, and
the scheduler gives the request ``1 + k`` tokens in one step: the last token and the drafts.
The target computes logits at all ``1 + k`` positions in one pass over its weights (the cost
of a decode step while the batch is small, which is the whole point), and the verifier walks
them left to right:

- at position ``j`` the target *samples* its own token ``t_j``, exactly as it would without
  speculation (same processing: penalties counting the drafts before ``j`` as output tokens,
  min_tokens, grammar masks, temperature, top-k/p, min-p, and for a seeded request the same
  keyed noise, indexed by the output position);
- draft ``d_j`` is accepted when ``t_j == d_j``; at the first mismatch ``t_j`` is the token
  emitted in its place and the rest is discarded; when every draft is accepted the token
  sampled after the last one (the "bonus" token) is emitted too.

Every proposer here proposes deterministic drafts (prompt lookup, the draft model's argmax, the
EAGLE head's argmax): the draft distribution ``q`` is one-hot at ``d_j``. The standard
accept/resample rule (accept with probability ``min(1, p(d)/q(d))``, else sample from
``norm(max(p - q, 0))``) then reads: accept ``d`` with probability ``p(d)``, else sample from
``p`` with ``d`` removed, which is exactly "sample ``t ~ p``; accept when ``t == d``, else emit
``t``". So the output distribution is the target's, token for token, at every temperature, and
a seeded request produces the very same tokens with speculation as without: its noise is keyed
by output position, not by step.

The rejected drafts' K/V was written into the cache past the request's computed tokens; it is
never read (attention reads up to the sequence length) and the next step overwrites it.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Protocol

from pagecast.runtime.request import Request

METHODS = ("ngram", "draft_model", "eagle3", "replay")

# Speculation is worth it while a step is bound by reading the weights: with few sequences a
# step of 1 + k tokens each costs about what a step of one token each costs. With many
# sequences the step is bound by compute and every rejected draft is wasted work, so above this
# many running requests the engine does not speculate (vLLM's ``disable_by_batch_size``).
# Measured (benchmarks/speculative.py --phases batch, H200, Llama-3-8B shape, k = 4): with
# every draft wrong, speculating costs 1.029x at 16 requests and 1.042x at 32 (1.009x at one),
# so 16 is the largest batch whose worst case stays within 3% (benchmarks/RESULTS.md).
DEFAULT_DISABLE_BY_BATCH_SIZE = 16


@dataclass(frozen=True)
class SpeculativeConfig:
    """What ``LLM(..., speculative_config={...})``, ``engine-serve --speculative-config`` and
    ``enginebuild --speculative-config`` take (vLLM's keys):

    - ``method``: ``ngram`` (prompt lookup), ``draft_model`` (``model``: a smaller artifact with
      the same tokenizer), ``eagle3`` (``model``: a directory with EAGLE-3 head weights in their
      published layout); ``replay`` is for benchmarks only (see ``ReplayProposer``);
    - ``num_speculative_tokens``: k, the drafts proposed per step;
    - ``prompt_lookup_max`` / ``prompt_lookup_min``: the n-gram lengths ``ngram`` matches;
    - ``disable_by_batch_size``: no speculation in a step with more running requests than this.
    """

    method: str
    num_speculative_tokens: int = 4
    model: str | None = None
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    disable_by_batch_size: int = DEFAULT_DISABLE_BY_BATCH_SIZE
    # replay only: the drafts' source (see ReplayProposer).
    replay: dict[str, Any] | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(
                f"speculative_config method {self.method!r} is not one of {', '.join(METHODS[:3])}"
            )
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= 16:
            raise ValueError(f"speculative_config num_speculative_tokens must be an integer in 1..16 (got {k!r})")
        if self.method == "ngram":
            lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
            if not (isinstance(lo, int) and isinstance(hi, int) and 1 <= lo <= hi):
                raise ValueError(
                    "speculative_config needs 1 <= prompt_lookup_min <= prompt_lookup_max "
                    f"(got {lo!r} and {hi!r})"
                )
        if self.method in ("draft_model", "eagle3") and not self.model:
            what = "a draft artifact" if self.method == "draft_model" else "a directory of EAGLE-3 head weights"
            raise ValueError(f"speculative_config method {self.method} needs model: {what}")
        b = self.disable_by_batch_size
        if not isinstance(b, int) or isinstance(b, bool) or b < 1:
            raise ValueError(f"speculative_config disable_by_batch_size must be a positive integer (got {b!r})")

    @classmethod
    def parse(cls, value: SpeculativeConfig | dict[str, Any] | str | None) -> SpeculativeConfig | None:
        """From a config, a dict or JSON text (the command lines' form); None stays None."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"speculative_config is not valid JSON: {exc}") from None
        if not isinstance(value, dict):
            raise ValueError("speculative_config must be a JSON object such as {\"method\": \"ngram\"}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(
                f"speculative_config has unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}"
            )
        if "method" not in value:
            raise ValueError("speculative_config needs a method: ngram, draft_model or eagle3")
        return cls(**value)

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "replay"}
        return {k: v for k, v in out.items() if v is not None}


class Proposer(Protocol):
    """Proposes draft tokens. ``propose`` is called at the start of a speculating step for the
    requests that decode in it: each has every token known (``all_token_ids``), the last one not
    yet computed by the target; ``num_drafts[i]`` is the most drafts request i may take (its
    blocks already hold positions up to its last token + that many)."""

    def propose(self, requests: list[Request], num_drafts: list[int]) -> list[list[int]]: ...

    def drop(self, request_ids: set[str]) -> None:
        """Forget finished or preempted requests (state kept per request, if any)."""
        ...


class NgramProposer:
    """Prompt lookup: find the longest suffix of the sequence (between ``prompt_lookup_min`` and
    ``prompt_lookup_max`` tokens) that occurred earlier in it, and propose the tokens that
    followed its most recent earlier occurrence (``ngram_lookup``'s answer). No weights, no
    device work.

    Each request keeps an index of its n-grams (n-gram -> where its latest occurrence ends),
    brought up to date with the tokens appended since the last step, so a step costs the new
    tokens times the n-gram lengths plus a few dictionary lookups, whatever the context: a scan
    of the sequence cost 1.7 ms per request at 8k tokens and 5.9 ms at 32k on the host, more
    than a decode step of the GPU for a handful of requests."""

    def __init__(self, config: SpeculativeConfig):
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max
        self._indexes: dict[str, _NgramIndex] = {}

    def propose(self, requests: list[Request], num_drafts: list[int]) -> list[list[int]]:
        out = []
        for request, k in zip(requests, num_drafts):
            index = self._indexes.get(request.request_id)
            if index is None:
                index = self._indexes[request.request_id] = _NgramIndex(self.min_n, self.max_n)
            out.append(index.lookup(request.all_token_ids, k) if k > 0 else [])
        return out

    def drop(self, request_ids: set[str]) -> None:
        for request_id in request_ids:
            self._indexes.pop(request_id, None)


class _NgramIndex:
    """One sequence's n-grams of ``min_n``..``max_n`` tokens -> the position where the latest
    occurrence ends, for occurrences ending before the sequence's last token (so the suffix
    itself is never its own match)."""

    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n
        self.ends: dict[tuple[int, ...], int] = {}
        self.indexed = 0  # n-grams ending at positions < indexed are in ``ends``

    def lookup(self, tokens: list[int], k: int) -> list[int]:
        last = len(tokens) - 1
        if self.indexed > last:  # the sequence was cut back (a stop string): start again
            self.ends.clear()
            self.indexed = 0
        ends = self.ends
        for n in range(self.min_n, self.max_n + 1):
            # The n-grams ending at positions first..last-1, in order (a later occurrence
            # overwrites an earlier one), built and stored in C by zip and dict.update.
            first = max(self.indexed, n - 1)
            if first < last:
                columns = [tokens[first - n + 1 + j : last - n + 1 + j] for j in range(n)]
                ends.update(zip(zip(*columns), range(first, last)))
        self.indexed = max(self.indexed, last)
        for n in range(min(self.max_n, last), self.min_n - 1, -1):
            end = ends.get(tuple(tokens[last - n + 1 :]))
            if end is not None:
                return tokens[end + 1 : end + 1 + k]
        return []


def ngram_lookup(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """Up to ``k`` tokens that followed the latest earlier occurrence of the longest suffix of
    ``tokens`` of ``min_n``..``max_n`` tokens; [] when none occurred before. A scan of the whole
    sequence: the definition ``NgramProposer``'s index answers incrementally."""
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = tokens[length - n :]
        first = suffix[0]
        # The latest earlier start: scan backwards from the last possible one (the suffix itself
        # starts at length - n and is not an earlier occurrence).
        start = length - n - 1
        while start >= 0:
            try:
                start = _rindex(tokens, first, start)
            except ValueError:
                break
            if tokens[start : start + n] == suffix:
                follow = tokens[start + n : start + n + k]
                if follow:
                    return follow
            start -= 1
    return []


def _rindex(tokens: list[int], value: int, last: int) -> int:
    """The largest i <= last with tokens[i] == value (ValueError when none)."""
    for i in range(last, -1, -1):
        if tokens[i] == value:
            return i
    raise ValueError(value)


class ReplayProposer:
    """For benchmarks and tests: drafts that agree with a known continuation a chosen fraction
    of the time, which measures the mechanism's cost and gain independently of any drafter.

    ``config.replay`` = ``{"continuations": {prompt key: token ids}, "p": 0.8, "seed": 0}``,
    where a prompt key is the prompt's token ids joined by ",". For a request whose prompt has
    a continuation (the target's own greedy output, from a run without speculation), each
    draft is the continuation's next token with probability ``p`` and a different token
    otherwise; other requests get no drafts. Costs no device work."""

    def __init__(self, config: SpeculativeConfig, vocab_size: int):
        replay = config.replay or {}
        self.continuations: dict[str, list[int]] = {
            str(key): list(value) for key, value in (replay.get("continuations") or {}).items()
        }
        self.p = float(replay.get("p", 1.0))
        if not 0.0 <= self.p <= 1.0:
            raise ValueError(f"speculative_config replay p must be in [0, 1] (got {self.p})")
        self.vocab_size = vocab_size
        self.rng = random.Random(int(replay.get("seed", 0)))

    @staticmethod
    def key(prompt_token_ids: list[int]) -> str:
        return ",".join(map(str, prompt_token_ids))

    def propose(self, requests: list[Request], num_drafts: list[int]) -> list[list[int]]:
        out: list[list[int]] = []
        for request, k in zip(requests, num_drafts):
            follow = self.continuations.get(self.key(request.prompt_token_ids))
            if follow is None or k <= 0:
                out.append([])
                continue
            done = request.num_output_tokens
            drafts = []
            for token in follow[done : done + k]:
                if self.rng.random() >= self.p:
                    token = (token + 1 + self.rng.randrange(self.vocab_size - 1)) % self.vocab_size
                drafts.append(token)
            out.append(drafts)
        return out

    def drop(self, request_ids: set[str]) -> None:
        pass


def make_proposer(config: SpeculativeConfig, core: Any) -> Proposer:
    """The proposer ``config`` names, for ``core`` (the EngineCore: its artifact, device, KV
    block pool and runner, which the draft model and the EAGLE head share)."""
    if config.method == "ngram":
        return NgramProposer(config)
    if config.method == "replay":
        return ReplayProposer(config, core.vocab_size)
    if config.method == "draft_model":
        from pagecast.runtime.spec_draft import DraftModelProposer

        return DraftModelProposer(config, core)
    if config.method == "eagle3":
        from pagecast.runtime.spec_eagle import Eagle3Proposer

        return Eagle3Proposer(config, core)
    raise ValueError(f"speculative_config method {config.method!r} is not supported")


def resolve_model_path(config: SpeculativeConfig, artifact_path: Path) -> Path:
    """The draft / head directory: as given, or relative to the artifact (where enginebuild
    puts the one it builds in: ``speculative/``)."""
    assert config.model is not None
    path = Path(config.model)
    if not path.is_absolute() and not path.exists() and (artifact_path / path).exists():
        return artifact_path / path
    return path
