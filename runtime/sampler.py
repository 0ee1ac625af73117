"""The sampler: turns one row of logits per request into the next token, and reports logprobs.

Everything is vectorised over the batch (the GPU engine samples 256 rows a step): per-row
parameters become ``[num_rows, 1]`` tensors, greedy rows share one argmax, and the penalty and
truncation work (one sort of the sampled rows) only happens when some row asks for it. The only
Python loops run over rows, never over the vocabulary.

Semantics follow the references users compare against:

- logprobs are ``log_softmax`` of the raw logits in fp32, before penalties, temperature or
  truncation (what OpenAI and vLLM report);
- repetition penalty is transformers' ``RepetitionPenaltyLogitsProcessor`` over prompt and
  output tokens; presence / frequency penalties are OpenAI's formula over output tokens only;
- temperature, top-k, top-p and min-p are transformers' warpers of the same names, applied in
  that order, each to the output of the previous one.

Sampling is an exponential race: ``argmax(probs / E)`` with ``E ~ Exp(1)`` picks token ``i``
with probability ``probs[i] / sum(probs)``, needs no normalisation after masking, and lets each
seeded row draw its noise from its own generator, so a seeded request gives the same tokens
whatever else is in the batch.
"""

from __future__ import annotations

import itertools
import weakref
from dataclasses import dataclass

import torch

from pagecast.runtime.outputs import Logprob, PositionLogprobs
from pagecast.runtime.request import Request
from pagecast.runtime.transfer import to_device

# Temperatures below this are treated as greedy: dividing logits by ~0 overflows to inf/nan.
_SAMPLING_EPS = 1e-5
# prompt_logprobs works on this many positions at a time, so a long prompt never materialises a
# [prompt_len, vocab] fp32 tensor at once (8k x 150k x 4 B would be ~5 GB).
_PROMPT_LOGPROBS_CHUNK = 512


@dataclass
class SamplerOutput:
    """The result of one sampling step, one entry per row of the logits, in request order.

    Plain Python values (already on the host), so the engine can append them to requests
    without touching the device again.
    """

    # The chosen next token of each row.
    token_ids: list[int]
    # Per row: the chosen token (with its 1-based rank under the raw distribution) followed by
    # the top ``sampling_params.logprobs`` tokens (ranks 1..k); None when the request did not
    # ask for logprobs. ``decoded_token`` is left None: the engine, which owns the tokenizer,
    # fills it in.
    logprobs: list[PositionLogprobs | None]


def sample(logits: torch.Tensor, requests: list[Request]) -> SamplerOutput:
    """Pick the next token for each row of ``logits`` (``[num_rows, vocab]``, fp32 or bf16, any
    device); row ``i`` belongs to ``requests[i]``.

    ``logits`` is not modified. A seeded request's ``generator`` is moved to the logits' device
    on first use (re-seeded from its initial seed), so seeded noise is drawn where the logits
    live instead of being generated on the host and copied over.
    """
    if logits.dim() != 2 or logits.shape[0] != len(requests):
        raise ValueError(
            f"logits must be [num_rows, vocab] with one row per request; got shape {tuple(logits.shape)} "
            f"for {len(requests)} requests"
        )
    if not requests:
        return SamplerOutput(token_ids=[], logprobs=[])
    token_ids = sample_token_ids(logits, requests)
    chosen = token_ids.tolist()
    logprobs: list[PositionLogprobs | None] = [None] * len(requests)
    wanted = [i for i, r in enumerate(requests) if r.sampling_params.logprobs is not None]
    if wanted:
        rows = torch.tensor(wanted, device=logits.device)
        num_top = [requests[i].sampling_params.logprobs or 0 for i in wanted]
        entries = _position_logprobs(logits[rows], token_ids[rows], max(num_top))
        for i, k, entry in zip(wanted, num_top, entries):
            logprobs[i] = _trim(entry, k)
    return SamplerOutput(token_ids=chosen, logprobs=logprobs)


def sample_token_ids(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """The next token of each row, as a tensor on the logits' device: no host synchronisation,
    so the engine can plan the next step while this one runs."""
    device = logits.device
    # Work in fp32: bf16 has too few mantissa bits for top-p cumulative sums and penalties.
    # Every step below is out of place, so the caller's logits (and the raw logprobs) survive.
    work = logits.float()

    penalised = [i for i, r in enumerate(requests) if r.sampling_params.has_penalties]
    if penalised:
        rows = torch.tensor(penalised, device=device)
        work = work.index_copy(0, rows, _apply_penalties(work[rows], [requests[i] for i in penalised]))

    token_ids = work.argmax(dim=-1)
    sampled = [i for i, r in enumerate(requests) if r.sampling_params.temperature >= _SAMPLING_EPS]
    if sampled:
        if len(sampled) == len(requests):
            token_ids = _sample_rows(work, requests)
        else:
            rows = to_device(sampled, device)
            picked = _sample_rows(work[rows], [requests[i] for i in sampled])
            token_ids = token_ids.index_copy(0, rows, picked)
    return token_ids


def prompt_logprobs(
    logits: torch.Tensor, target_token_ids: list[int], num_top: int
) -> list[PositionLogprobs]:
    """Logprobs of a prompt (``echo`` / ``prompt_logprobs``): ``logits[j]`` is the model's
    prediction for ``target_token_ids[j]``.

    Each entry holds the target token (with its rank) followed by the ``num_top`` best tokens,
    like ``SamplerOutput.logprobs``. Works in chunks so a long prompt stays within memory.
    """
    if logits.dim() != 2 or logits.shape[0] != len(target_token_ids):
        raise ValueError(
            f"logits must be [num_positions, vocab] with one row per target token; got shape "
            f"{tuple(logits.shape)} for {len(target_token_ids)} targets"
        )
    out: list[PositionLogprobs] = []
    targets = torch.tensor(target_token_ids, dtype=torch.long, device=logits.device)
    for start in range(0, len(target_token_ids), _PROMPT_LOGPROBS_CHUNK):
        end = start + _PROMPT_LOGPROBS_CHUNK
        out.extend(_position_logprobs(logits[start:end], targets[start:end], num_top))
    return out


# --- penalties -------------------------------------------------------------------------------

# Prompt token ids per request, cached on the device: the prompt never changes, and turning a
# long prompt into a tensor every step for every penalised row would dominate the step time.
_prompt_ids_cache: weakref.WeakKeyDictionary[Request, torch.Tensor] = weakref.WeakKeyDictionary()


def _prompt_ids(request: Request, device: torch.device) -> torch.Tensor:
    ids = _prompt_ids_cache.get(request)
    if ids is None or ids.device != device:
        ids = torch.tensor(request.prompt_token_ids, dtype=torch.long, device=device)
        _prompt_ids_cache[request] = ids
    return ids


def _row_index(lengths: list[int], device: torch.device) -> torch.Tensor:
    """Row i repeated lengths[i] times: the row of each entry of a flattened ragged batch."""
    return torch.repeat_interleave(
        torch.arange(len(lengths), device=device),
        torch.tensor(lengths, device=device),
        output_size=sum(lengths),  # known on the host: no device sync to size the result
    )


def _token_counts(rows: torch.Tensor, tokens: torch.Tensor, num_rows: int, vocab: int) -> torch.Tensor:
    """``[num_rows, vocab]`` counts of each token per row. Ids outside the vocabulary land in a
    spare column that is dropped, rather than being filtered out with a device sync."""
    counts = torch.zeros(num_rows, vocab + 1, dtype=torch.float32, device=tokens.device)
    tokens = torch.where((tokens >= 0) & (tokens < vocab), tokens, vocab)
    counts.index_put_((rows, tokens), torch.ones_like(tokens, dtype=torch.float32), accumulate=True)
    return counts[:, :vocab]


def _apply_penalties(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """Repetition, then presence and frequency penalties, on ``[rows, vocab]`` fp32 logits."""
    num_rows, vocab = logits.shape
    device = logits.device
    params = [r.sampling_params for r in requests]
    # All rows' output ids in one host-to-device copy (a tensor per row would be a copy per row).
    output_tokens = torch.tensor(
        list(itertools.chain.from_iterable(r.output_token_ids for r in requests)), dtype=torch.long
    ).to(device)
    output_rows = _row_index([r.num_output_tokens for r in requests], device)

    if any(p.repetition_penalty != 1.0 for p in params):
        # HF semantics: every token seen in prompt or output, counted once; positive logits are
        # divided by the penalty and negative ones multiplied, so both move towards "less likely".
        rows = torch.cat([_row_index([r.num_prompt_tokens for r in requests], device), output_rows])
        tokens = torch.cat([_prompt_ids(r, device) for r in requests] + [output_tokens])
        seen = _token_counts(rows, tokens, num_rows, vocab) > 0
        penalty = torch.tensor([p.repetition_penalty for p in params], device=device).unsqueeze(1)
        penalised = torch.where(logits < 0, logits * penalty, logits / penalty)
        logits = torch.where(seen, penalised, logits)

    if any(p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 for p in params):
        # OpenAI semantics: output tokens only; logit -= presence * (count > 0) + frequency * count.
        counts = _token_counts(output_rows, output_tokens, num_rows, vocab)
        presence = torch.tensor([p.presence_penalty for p in params], device=device).unsqueeze(1)
        frequency = torch.tensor([p.frequency_penalty for p in params], device=device).unsqueeze(1)
        logits = logits - presence * (counts > 0).float() - frequency * counts
    return logits


# --- sampling --------------------------------------------------------------------------------


def _sample_rows(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """Temperature, top-k, top-p, min-p, then an exponential race; every row samples."""
    num_rows, vocab = logits.shape
    device = logits.device
    params = [r.sampling_params for r in requests]

    temperature = to_device([p.temperature for p in params], device).unsqueeze(1)
    logits = logits / temperature

    top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    top_p = [p.top_p for p in params]
    if any(k < vocab for k in top_k) or any(p < 1.0 for p in top_p):
        logits = _top_k_top_p(logits, top_k, top_p)

    probs = logits.softmax(dim=-1)
    min_p = [p.min_p for p in params]
    if any(m > 0.0 for m in min_p):
        # MinPLogitsWarper: drop tokens below min_p x the top probability (after temperature).
        # The top token always survives since min_p <= 1. No renormalisation: the race below is
        # invariant to scaling a row.
        threshold = to_device(min_p, device).unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
        probs = probs.masked_fill(probs < threshold, 0.0)

    noise = torch.empty_like(probs).exponential_()
    for i, request in enumerate(requests):
        if request.generator is not None:
            noise[i].exponential_(generator=_generator_on(request, device))
    # An exponential draw of exactly 0 would turn a masked token's 0 / 0 into nan, which argmax
    # would pick; the tiny floor keeps masked tokens at 0 and changes nothing else.
    noise.clamp_min_(torch.finfo(torch.float32).tiny)
    return (probs / noise).argmax(dim=-1)


def _top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """TopKLogitsWarper then TopPLogitsWarper with per-row k and p, from one ascending sort.

    The ascending order is kept for top-p (as transformers sorts it) so the cumulative sums, and
    therefore the masks, are the same floats transformers computes. Top-k masks exactly the
    smallest values, so the sorted order also stays valid for the top-k-masked logits.
    """
    num_rows, vocab = logits.shape
    device = logits.device
    sorted_logits, sorted_ids = logits.sort(dim=-1, descending=False)
    # The k-th largest value sits at ascending position vocab - k; ties with it are kept.
    kth_position = to_device([vocab - k for k in top_k], device).unsqueeze(1)
    kth_value = sorted_logits.gather(1, kth_position)
    remove = sorted_logits < kth_value

    p = to_device(top_p, device).unsqueeze(1)
    cumulative = sorted_logits.masked_fill(remove, float("-inf")).softmax(dim=-1).cumsum(dim=-1)
    # Rows with p = 1 only lose tokens of probability exactly 0, which can never be sampled.
    remove |= cumulative <= (1 - p)
    remove[:, -1] = False  # always keep the most likely token
    remove = remove.scatter(1, sorted_ids, remove)
    return logits.masked_fill(remove, float("-inf"))


def _generator_on(request: Request, device: torch.device) -> torch.Generator:
    """The request's generator, on ``device``. Request makes a host generator (so the CPU
    engine needs nothing more); on first use on another device it is replaced by one there
    with the same seed, which starts the same logical stream since nothing was drawn yet."""
    generator = request.generator
    assert generator is not None  # callers only ask for seeded rows
    if generator.device != device:
        moved = torch.Generator(device=device)
        moved.manual_seed(generator.initial_seed())
        request.generator = moved
        generator = moved
    return generator


# --- logprobs --------------------------------------------------------------------------------


def _position_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, num_top: int) -> list[PositionLogprobs]:
    """For each row: {token: its logprob and rank, then the num_top best tokens (rank 1..k)}."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = logprobs.gather(1, token_ids.unsqueeze(1))
    # Rank = 1 + number of tokens strictly more likely, so ties share the better rank.
    ranks = (logprobs > chosen).sum(dim=-1) + 1
    top_values, top_ids = logprobs.topk(min(num_top, logprobs.shape[-1]), dim=-1)

    entries: list[PositionLogprobs] = []
    for token, value, rank, values, ids in zip(
        token_ids.tolist(), chosen.squeeze(1).tolist(), ranks.tolist(), top_values.tolist(), top_ids.tolist()
    ):
        entry: PositionLogprobs = {token: Logprob(logprob=value, rank=rank)}
        for position, (top_value, top_id) in enumerate(zip(values, ids), start=1):
            if top_id not in entry:
                entry[top_id] = Logprob(logprob=top_value, rank=position)
        entries.append(entry)
    return entries


def _trim(entry: PositionLogprobs, num_top: int) -> PositionLogprobs:
    """Keep the chosen token (first) and the tokens ranked 1..num_top: a batch computes the
    largest k any row asked for, and each row gets its own k back."""
    items = list(entry.items())
    return dict(items[:1] + [(t, lp) for t, lp in items[1:] if lp.rank <= num_top])
