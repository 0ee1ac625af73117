"""The sampler: turns one row of logits per request into the next token, and reports logprobs.

Everything is vectorised over the batch (the GPU engine samples 512 rows a step): per-row
parameters become ``[num_rows]`` tensors, greedy rows share one argmax, and the penalty and
truncation work only happens when some row asks for it. The only Python loops run over rows,
never over the vocabulary. A row of logits is read a few times, never copied unless masks or
penalties change it: truncation is a top-k of the row (``truncation.top_candidates``) plus
arithmetic on the candidates that yields a per-row cutoff (``truncation.py``), and one Triton
kernel applies temperature, the cutoff and min-p, draws the noise and runs the race as it
streams the row (``kernels/sampling.py``);
logprobs are one more streaming pass (max, sum of exponentials, rank) and a ``topk``. On the
CPU the same steps run their torch references (``kernels/reference.py``).

Semantics follow the references users compare against:

- logprobs are ``log_softmax`` of the raw logits in fp32, before penalties, temperature or
  truncation (what OpenAI and vLLM report);
- repetition penalty is transformers' ``RepetitionPenaltyLogitsProcessor`` over prompt and
  output tokens; presence / frequency penalties are OpenAI's formula over output tokens only;
- temperature, top-k, top-p and min-p are transformers' warpers of the same names, applied in
  that order, each to the output of the previous one.

Sampling is an exponential race: ``argmax(p / E)`` with ``E ~ Exp(1)`` and
``p = exp(x - max x)`` over the kept tokens picks token ``i`` with probability
``p[i] / sum(p)`` and needs no normalisation after masking (min-p compares ``p`` itself, the
probability relative to the most likely token's, with ``min_p``). Among tokens tied at a
truncation boundary the lowest ids are dropped first. A seeded row's noise is keyed: a pure
function of (the request's seed, the index of the output token being sampled, the column), the
stream of ``kernels/keyed_noise.py``, so a seeded request gives the same tokens whatever else is
in the batch, in either scheduling mode and after a preemption. On a GPU the race kernel draws
that noise itself, for unseeded rows from a key drawn on the device each step.

A request's ``logit_bias`` (OpenAI's: token id -> value in [-100, 100]) is added to its row
before the penalties, as vLLM applies it; logprobs stay those of the raw logits.

Until a request has ``min_tokens`` output tokens, its stop token ids and (unless
``ignore_eos``) the end-of-sequence ids are masked, as transformers' ``MinNewTokensLogitsProcessor``
does, so they cannot be sampled early. Logprobs still describe the raw distribution.

Two callers: ``sample`` (synchronous steps, everything back on the host at once; the reference)
and the model runner's asynchronous ``launch``, which calls ``sample_token_ids`` with the
penalty inputs it keeps on the device (``PenaltyState``) and ``logprob_tensors`` /
``prompt_logprob_tensors``, copies the results to the host behind an event and turns them into
entries one step later (``LogprobTensors.entries``). Both run the same tensor code, so both give
the same tokens and logprobs.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pagecast.kernels import reference
from pagecast.runtime import truncation
from pagecast.runtime.outputs import Logprob, PositionLogprobs
from pagecast.runtime.request import Request
from pagecast.runtime.transfer import to_device
from pagecast.runtime.truncation import Cutoffs

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


def sample(
    logits: torch.Tensor, requests: list[Request], token_bitmask: TokenBitmask | None = None
) -> SamplerOutput:
    """Pick the next token for each row of ``logits`` (``[num_rows, vocab]``, fp32 or bf16, any
    device); row ``i`` belongs to ``requests[i]``. Penalties are computed from the requests'
    token lists on the host. ``logits`` is not modified."""
    if logits.dim() != 2 or logits.shape[0] != len(requests):
        raise ValueError(
            f"logits must be [num_rows, vocab] with one row per request; got shape {tuple(logits.shape)} "
            f"for {len(requests)} requests"
        )
    if not requests:
        return SamplerOutput(token_ids=[], logprobs=[])
    token_ids = sample_token_ids(logits, requests, token_bitmask=token_bitmask)
    chosen = token_ids.tolist()
    logprobs: list[PositionLogprobs | None] = [None] * len(requests)
    computed = logprob_tensors(logits, token_ids, requests)
    if computed is not None:
        wanted, tensors = computed
        for i, entry in zip(wanted, tensors.entries([requests[i].sampling_params.logprobs or 0 for i in wanted])):
            logprobs[i] = entry
    return SamplerOutput(token_ids=chosen, logprobs=logprobs)


# The penalty inputs of some rows: (seen, counts), both [rows, vocab] on the logits' device.
# ``seen`` marks tokens of the prompt or the output (repetition penalty), ``counts`` holds how
# often each token is in the output (presence / frequency penalties).
PenaltyInputs = Callable[[list[Request], int, torch.device], tuple[torch.Tensor, torch.Tensor]]
# Structured output: (rows that are constrained, their xgrammar bitmask [len(rows), words] on the host).
TokenBitmask = tuple[list[int], torch.Tensor]


def sample_token_ids(
    logits: torch.Tensor,
    requests: list[Request],
    penalty_inputs: PenaltyInputs | None = None,
    token_bitmask: TokenBitmask | None = None,
) -> torch.Tensor:
    """The next token of each row, as a tensor on the logits' device: no host synchronisation,
    so the engine can plan the next step while this one runs.

    ``penalty_inputs(penalised_requests, vocab, device)`` gives the penalised rows' token sets; by
    default they are built from the requests' token lists (``host_penalty_inputs``). The
    asynchronous runner passes its device-side state instead, whose output tokens include those
    still pending (sampled by the step in flight).

    ``token_bitmask`` (structured output) rules out, on its rows only, every token its grammar
    does not allow next; the other rows are left exactly as they are."""
    device = logits.device
    # The logits are read as they are (bf16 values are exact in fp32, and the kernels and the
    # truncation work in fp32); only masks and penalties make an fp32 copy, since bf16 has too
    # few mantissa bits for penalties. Every step below is out of place, so the caller's logits
    # (and the raw logprobs) survive.
    work = _add_logit_bias(_mask_stop_tokens(logits, requests), requests)
    if token_bitmask is not None:
        from pagecast.runtime.structured_output import apply_bitmask

        constrained, bitmask = token_bitmask
        rows = to_device(constrained, device, torch.int64)
        work = work.float()
        masked = work[rows]  # a copy: masked in place, then put back out of place
        apply_bitmask(masked, bitmask)
        work = work.index_copy(0, rows, masked)

    penalised = [i for i, r in enumerate(requests) if r.sampling_params.has_penalties]
    if penalised:
        chosen = [requests[i] for i in penalised]
        seen, counts = (penalty_inputs or host_penalty_inputs)(chosen, work.shape[1], device)
        work = work.float()
        if len(penalised) == len(requests):
            work = _penalise(work, seen, counts, chosen)
        else:
            rows = to_device(penalised, device, torch.int64)
            work = work.index_copy(0, rows, _penalise(work[rows], seen, counts, chosen))

    sampled = [i for i, r in enumerate(requests) if r.sampling_params.temperature >= _SAMPLING_EPS]
    if len(sampled) == len(requests):
        return _sample_rows(work, requests)
    token_ids = work.argmax(dim=-1)  # greedy (the first of equal maxima, in any dtype)
    if sampled:
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
    targets = to_device(target_token_ids, logits.device, torch.int64)
    return prompt_logprob_tensors(logits, targets, num_top).entries([num_top] * len(target_token_ids))


def prompt_logprob_tensors(logits: torch.Tensor, targets: torch.Tensor, num_top: int) -> LogprobTensors:
    """``prompt_logprobs`` without leaving the device: ``logits[j]`` scores ``targets[j]``."""
    parts = [
        _logprob_tensors(logits[start : start + _PROMPT_LOGPROBS_CHUNK], targets[start : start + _PROMPT_LOGPROBS_CHUNK], num_top)
        for start in range(0, targets.shape[0], _PROMPT_LOGPROBS_CHUNK)
    ]
    if len(parts) == 1:
        return parts[0]
    return LogprobTensors(*(torch.cat(column) for column in zip(*(p.columns() for p in parts))))


# --- min_tokens ------------------------------------------------------------------------------


def _mask_stop_tokens(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """``-inf`` for the stop token ids (and end-of-sequence ids unless ``ignore_eos``) of rows
    whose request has fewer than ``min_tokens`` output tokens, counting those still pending
    (an fp32 copy; ``logits`` itself when no row needs it)."""
    rows: list[int] = []
    cols: list[int] = []
    vocab = logits.shape[1]
    for i, request in enumerate(requests):
        params = request.sampling_params
        if params.min_tokens and request.num_output_tokens + request.num_pending_tokens < params.min_tokens:
            stops = set(params.stop_token_ids)
            if not params.ignore_eos:
                stops |= request.eos_token_ids
            ids = [t for t in stops if 0 <= t < vocab]
            rows.extend([i] * len(ids))
            cols.extend(ids)
    if not rows:
        return logits
    index = (to_device(rows, logits.device, torch.int64), to_device(cols, logits.device, torch.int64))
    # The values are filled on the device: a tensor made from a host scalar would be a
    # pageable copy, which may wait for the step in flight.
    return logits.float().index_put(index, torch.full((len(rows),), float("-inf"), device=logits.device))


def _add_logit_bias(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """OpenAI's ``logit_bias``: each row's biases added to its logits (an fp32 copy; ``logits``
    itself when no row has one). A token masked to ``-inf`` stays masked."""
    rows: list[int] = []
    cols: list[int] = []
    values: list[float] = []
    vocab = logits.shape[1]
    for i, request in enumerate(requests):
        for token, value in (request.sampling_params.logit_bias or {}).items():
            if 0 <= token < vocab:  # (the engine refuses others when the request arrives)
                rows.append(i)
                cols.append(token)
                values.append(value)
    if not rows:
        return logits
    device = logits.device
    index = (to_device(rows, device, torch.int64), to_device(cols, device, torch.int64))
    return logits.float().index_put(index, to_device(values, device, torch.float32), accumulate=True)


# --- penalties -------------------------------------------------------------------------------

# Prompt token ids per request, cached on the device: the prompt never changes, and turning a
# long prompt into a tensor every step for every penalised row would dominate the step time.
_prompt_ids_cache: weakref.WeakKeyDictionary[Request, torch.Tensor] = weakref.WeakKeyDictionary()


def _prompt_ids(request: Request, device: torch.device) -> torch.Tensor:
    ids = _prompt_ids_cache.get(request)
    if ids is None or ids.device != device:
        ids = to_device(request.prompt_token_ids, device, torch.int64)
        _prompt_ids_cache[request] = ids
    return ids


def _row_index(lengths: list[int], device: torch.device) -> torch.Tensor:
    """Row i repeated lengths[i] times: the row of each entry of a flattened ragged batch."""
    return torch.repeat_interleave(
        torch.arange(len(lengths), device=device),
        to_device(lengths, device, torch.int64),
        output_size=sum(lengths),  # known on the host: no device sync to size the result
    )


def _token_counts(rows: torch.Tensor, tokens: torch.Tensor, num_rows: int, vocab: int) -> torch.Tensor:
    """``[num_rows, vocab]`` counts of each token per row. Ids outside the vocabulary land in a
    spare column that is dropped, rather than being filtered out with a device sync."""
    counts = torch.zeros(num_rows, vocab + 1, dtype=torch.float32, device=tokens.device)
    tokens = torch.where((tokens >= 0) & (tokens < vocab), tokens, vocab)
    counts.index_put_((rows, tokens), torch.ones_like(tokens, dtype=torch.float32), accumulate=True)
    return counts[:, :vocab]


def host_penalty_inputs(requests: list[Request], vocab: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(seen, counts) of ``requests`` from their token lists (known tokens only: the
    synchronous path, where nothing is pending)."""
    num_rows = len(requests)
    # All rows' output ids in one host-to-device copy (a tensor per row would be a copy per row).
    output_tokens = to_device(list(itertools.chain.from_iterable(r.output_token_ids for r in requests)), device, torch.int64)
    output_rows = _row_index([r.num_output_tokens for r in requests], device)
    counts = _token_counts(output_rows, output_tokens, num_rows, vocab)
    if not any(r.sampling_params.repetition_penalty != 1.0 for r in requests):
        return counts > 0, counts  # seen is only read by the repetition penalty
    rows = torch.cat([_row_index([r.num_prompt_tokens for r in requests], device), output_rows])
    tokens = torch.cat([_prompt_ids(r, device) for r in requests] + [output_tokens])
    return _token_counts(rows, tokens, num_rows, vocab) > 0, counts


def _apply_penalties(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """Repetition, then presence and frequency penalties, on ``[rows, vocab]`` fp32 logits,
    from the requests' token lists."""
    seen, counts = host_penalty_inputs(requests, logits.shape[1], logits.device)
    return _penalise(logits, seen, counts, requests)


def _penalise(logits: torch.Tensor, seen: torch.Tensor, counts: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """The penalty formulas, shared by both paths so they give the same floats."""
    device = logits.device
    params = [r.sampling_params for r in requests]
    if any(p.repetition_penalty != 1.0 for p in params):
        # HF semantics: every token seen in prompt or output, counted once; positive logits are
        # divided by the penalty and negative ones multiplied, so both move towards "less likely".
        penalty = to_device([p.repetition_penalty for p in params], device).unsqueeze(1)
        penalised = torch.where(logits < 0, logits * penalty, logits / penalty)
        logits = torch.where(seen, penalised, logits)

    if any(p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 for p in params):
        # OpenAI semantics: output tokens only; logit -= presence * (count > 0) + frequency * count.
        presence = to_device([p.presence_penalty for p in params], device).unsqueeze(1)
        frequency = to_device([p.frequency_penalty for p in params], device).unsqueeze(1)
        logits = logits - presence * (counts > 0).float() - frequency * counts
    return logits


# --- sampling --------------------------------------------------------------------------------

# With every row's top_k at most this, truncation starts from ``topk`` instead of a full sort of
# the vocabulary (a [512, 128k] sort costs several milliseconds of a ~30 ms decode step).
_TOP_K_FAST_MAX = 1024


def _sample_rows(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """Temperature, top-k, top-p, min-p, then an exponential race; every row samples.

    Truncation becomes a per-row cutoff (``truncation.from_topk``: a ``topk`` and arithmetic on
    the candidates), and the race applies it, temperature and min-p while it reads each row
    once (``race``). Rows that ask for top-p without top-k, or a top_k above
    ``_TOP_K_FAST_MAX``, take a full sort that masks a copy of their logits instead; in a batch
    that mixes both, only those rows are sorted."""
    vocab = logits.shape[1]
    device = logits.device
    params = [r.sampling_params for r in requests]
    sort = [(p.top_p < 1.0 and not 0 < p.top_k < vocab) or _TOP_K_FAST_MAX < p.top_k < vocab for p in params]
    if any(sort) and not all(sort):
        token_ids = torch.empty(len(requests), dtype=torch.int64, device=device)
        for part in ([i for i, s in enumerate(sort) if s], [i for i, s in enumerate(sort) if not s]):
            rows = to_device(part, device, torch.int64)
            token_ids.index_copy_(0, rows, _sample_rows(logits[rows], [requests[i] for i in part]))
        return token_ids
    per_row = to_device([[p.temperature, p.min_p] for p in params], device, torch.float32)
    temperature, min_p = per_row[:, 0], per_row[:, 1]

    top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    top_p = [p.top_p for p in params]
    truncated = [k < vocab or p < 1.0 for k, p in zip(top_k, top_p)]
    if not any(truncated):
        # max(logits / t) = max(logits) / t: the division is monotone and rounds the same.
        cutoffs = Cutoffs.keep_all(logits.amax(dim=1).float() / temperature)
    elif not any(sort):
        cutoffs = truncation.from_topk(logits, temperature, top_k, top_p)
    else:
        x = logits.float() / temperature[:, None]
        logits = _top_k_top_p_sorted(x, top_k, top_p)  # already divided: the race uses t = 1
        temperature = torch.ones_like(temperature)
        cutoffs = Cutoffs.keep_all(x.amax(dim=1))
    return _race(logits, temperature, cutoffs, min_p, requests)


def _race(
    logits: torch.Tensor, temperature: torch.Tensor, cutoffs: Cutoffs, min_p: torch.Tensor, requests: list[Request]
) -> torch.Tensor:
    """``reference.race`` on the truncated rows: in one kernel on a GPU, with every row's noise
    keyed (seeded rows by their seed, the others by a key drawn on the device each step, so
    nothing waits for the host); in torch elsewhere, where unseeded rows draw from torch's
    generator."""
    if truncation.use_kernels(logits):
        from pagecast.kernels.sampling import race

        keys, offsets = _noise_keys(requests, logits.device)
        return race(
            logits, temperature, cutoffs.value, cutoffs.token, cutoffs.tie_drop, cutoffs.tie_counts, cutoffs.row_max,
            min_p, keys, offsets, block_max=cutoffs.block_max,
        )  # fmt: skip
    noise = _exponential_noise(requests, logits)
    return reference.race(logits, temperature, cutoffs.value, cutoffs.token, cutoffs.tie_drop, cutoffs.row_max, min_p, noise)


def _noise_offsets(requests: list[Request]) -> list[int]:
    # The index of the output token being sampled: the same for a request whatever the batch,
    # the scheduling mode (pending tokens are sampled but not booked yet) or a preemption.
    return [r.num_output_tokens + r.num_pending_tokens for r in requests]


def _noise_keys(requests: list[Request], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's noise key and offset ([rows] int64): the seed's key and the output index for
    seeded rows, a fresh random key (from torch's generator on ``device``) for the others."""
    seeded = [i for i, r in enumerate(requests) if r.seed_key is not None]
    chosen = [requests[i] for i in seeded]
    if len(seeded) == len(requests):
        keys_offsets = to_device([[r.seed_key for r in chosen], _noise_offsets(chosen)], device, torch.int64)
        return keys_offsets[0], keys_offsets[1]
    keys = torch.empty(len(requests), dtype=torch.int64, device=device).random_()
    offsets = torch.zeros(len(requests), dtype=torch.int64, device=device)
    if seeded:
        rows_keys_offsets = to_device([seeded, [r.seed_key for r in chosen], _noise_offsets(chosen)], device, torch.int64)
        keys = keys.index_copy(0, rows_keys_offsets[0], rows_keys_offsets[1])
        offsets = offsets.index_copy(0, rows_keys_offsets[0], rows_keys_offsets[2])
    return keys, offsets


def _exponential_noise(requests: list[Request], like: torch.Tensor) -> torch.Tensor:
    """Exp(1) noise ``[rows, vocab]`` fp32 for ``like`` (the CPU path): the generator for
    unseeded rows, keyed noise for seeded rows (all of them at once)."""
    seeded = [i for i, r in enumerate(requests) if r.seed_key is not None]
    if not seeded:
        return torch.empty(like.shape, dtype=torch.float32, device=like.device).exponential_()
    device = like.device
    keys = to_device([requests[i].seed_key for i in seeded], device, torch.int64)
    offsets = to_device(_noise_offsets([requests[i] for i in seeded]), device, torch.int64)
    keyed = keyed_exponential(keys, offsets, like.shape[1])
    if len(seeded) == len(requests):
        return keyed
    noise = torch.empty(like.shape, dtype=torch.float32, device=device).exponential_()
    return noise.index_copy_(0, to_device(seeded, device, torch.int64), keyed)


def keyed_exponential(keys: torch.Tensor, offsets: torch.Tensor, vocab: int) -> torch.Tensor:
    """The Triton kernel on a GPU, its torch reference elsewhere (same stream, up to the last
    bit of the logarithm)."""
    if keys.is_cuda:
        from pagecast.kernels.keyed_noise import keyed_exponential as kernel

        return kernel(keys, offsets, vocab)
    return reference.keyed_exponential(keys, offsets, vocab)


def _top_k_top_p_sorted(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """TopKLogitsWarper then TopPLogitsWarper with per-row k and p, from one ascending sort.

    The ascending order is kept for top-p (as transformers sorts it) so the cumulative sums, and
    therefore the masks, are the same floats transformers computes. Top-k masks exactly the
    smallest values, so the sorted order also stays valid for the top-k-masked logits.
    """
    vocab = logits.shape[1]
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


# --- logprobs --------------------------------------------------------------------------------


@dataclass
class LogprobTensors:
    """Logprobs of some positions, as tensors (on the device until ``to_host``): the scored token
    of each row with its logprob and rank, and the row's best tokens. Rows may ask for fewer
    top tokens than were computed; ``entries`` trims."""

    token_ids: torch.Tensor  # [rows] int64: the sampled (or prompt) token
    logprobs: torch.Tensor  # [rows] fp32: its logprob
    ranks: torch.Tensor  # [rows] int64: 1 + the number of tokens strictly more likely
    top_logprobs: torch.Tensor  # [rows, k] fp32, best first
    top_ids: torch.Tensor  # [rows, k] int64

    def columns(self) -> tuple[torch.Tensor, ...]:
        return (self.token_ids, self.logprobs, self.ranks, self.top_logprobs, self.top_ids)

    def to_host(self) -> LogprobTensors:
        """Copies into pinned host memory, queued behind the step (non-blocking: the caller
        records an event after this and waits on it before reading). On the CPU, ``self``."""
        if not self.token_ids.is_cuda:
            return self

        def pinned(t: torch.Tensor) -> torch.Tensor:
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            return host.copy_(t, non_blocking=True)

        return LogprobTensors(*(pinned(t) for t in self.columns()))

    def entries(self, num_top: list[int]) -> list[PositionLogprobs]:
        """Row i: {token: its logprob and rank, then the num_top[i] best tokens (rank 1..k)}."""
        out: list[PositionLogprobs] = []
        for token, value, rank, values, ids, k in zip(
            self.token_ids.tolist(), self.logprobs.tolist(), self.ranks.tolist(),
            self.top_logprobs.tolist(), self.top_ids.tolist(), num_top,
        ):
            entry: PositionLogprobs = {token: Logprob(logprob=value, rank=rank)}
            for position, (top_value, top_id) in enumerate(zip(values[:k], ids[:k]), start=1):
                if top_id not in entry:
                    entry[top_id] = Logprob(logprob=top_value, rank=position)
            out.append(entry)
        return out


def logprob_tensors(
    logits: torch.Tensor, token_ids: torch.Tensor, requests: list[Request]
) -> tuple[list[int], LogprobTensors] | None:
    """The logprobs of the rows whose request asks for them (their row indices and tensors),
    computed on the raw logits; None when no row does."""
    wanted = [i for i, r in enumerate(requests) if r.sampling_params.logprobs is not None]
    if not wanted:
        return None
    num_top = max(requests[i].sampling_params.logprobs or 0 for i in wanted)
    if len(wanted) == len(requests):
        return wanted, _logprob_tensors(logits, token_ids, num_top)
    rows = to_device(wanted, logits.device, torch.int64)
    return wanted, _logprob_tensors(logits[rows], token_ids[rows], num_top)


def _logprob_tensors(logits: torch.Tensor, token_ids: torch.Tensor, num_top: int) -> LogprobTensors:
    """log_softmax's values without its tensor: one pass per row for the max, the sum of
    exponentials and the rank (a kernel on a GPU), then ``topk`` of the raw logits (the best
    logits are the best logprobs) and ``(logit - max) - log(sum)`` on the few values kept."""
    scored = logits.gather(1, token_ids.unsqueeze(1)).float()  # [rows, 1]
    if truncation.use_kernels(logits):
        from pagecast.kernels.sampling import logprob_stats

        maxes, sums, greater = logprob_stats(logits, scored.squeeze(1))
    else:
        maxes, sums, greater = reference.logprob_stats(logits, scored.squeeze(1))
    # The splits' partial sums, rescaled to the row's max.
    row_max = maxes.amax(dim=1, keepdim=True)
    log_total = torch.log((sums * torch.exp(maxes - row_max)).sum(dim=1, keepdim=True))
    chosen = (scored - row_max) - log_total
    # Rank = 1 + number of tokens strictly more likely, so ties share the better rank.
    ranks = greater.sum(dim=1, dtype=torch.int64) + 1
    top_values, top_ids = logits.topk(min(num_top, logits.shape[-1]), dim=-1)
    top_logprobs = (top_values.float() - row_max) - log_total
    return LogprobTensors(token_ids, chosen.squeeze(1), ranks, top_logprobs, top_ids)
