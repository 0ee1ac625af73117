"""Top-k and top-p truncation as a per-row cutoff, worked out on the row's top-k candidates.

Masking a ``[rows, vocab]`` tensor costs several full passes (compare, cumsum, scatter, fill);
here truncation only decides, per row, a cutoff that ``kernels/sampling.py``'s race applies as
it streams the row once (``reference.truncation_keep`` defines it on a full row):

- top-k keeps every token whose ``x = logits / temperature`` is at least the k-th largest ``x``
  (ties with it included, as transformers' ``TopKLogitsWarper`` does);
- top-p then drops kept tokens from the least likely up while the dropped mass, over the kept
  mass, stays within ``1 - top_p`` (``TopPLogitsWarper``), keeping the most likely token. Among
  equal values the lowest ids go first.

Everything is decided on ``topk(K + 1)`` (``K`` the batch's largest top_k; on a GPU
``top_candidates`` finds the same values without a ``torch.topk`` over the vocabulary): the
tokens above the k-th value are all among the candidates. Only the tokens tied with the k-th value may
reach past them (bf16 logits tie often); for those rows the tie group is counted on the full
row (``count_ties``, one pass of those rows only) and the top-p mass of the group is its count
times one token's, as in a sort where the group sits together. Which of the group's tokens go
is the lowest ids, wherever they are in the row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagecast.kernels import reference
from pagecast.runtime.transfer import to_device


def use_kernels(t: torch.Tensor) -> bool:
    """Whether the sampler runs the Triton kernels on ``t`` (on a GPU) rather than the torch
    references (the CPU engine). One place, so a test can route CPU tensors through the
    kernels under the Triton interpreter."""
    return t.is_cuda


@dataclass
class Cutoffs:
    """What truncation keeps of each row, in ``x = logits / temperature``: see
    ``reference.truncation_keep``. A row whose ``value`` is -inf keeps every token."""

    value: torch.Tensor  # [rows] fp32: tokens with a smaller x are dropped
    token: torch.Tensor  # [rows] int64: tokens at ``value`` with a lower id are dropped too
    tie_drop: torch.Tensor  # [rows] int64: and so are the first tie_drop tokens at ``value``
    # [rows, splits] int32: tokens at ``value`` per split of the row (count_ties), which the
    # race needs to place its splits within the tie group; None when no row drops part of it.
    tie_counts: torch.Tensor | None
    row_max: torch.Tensor  # [rows] fp32: max of x, for p = exp(x - row_max)
    # [rows, blocks] fp32: the raw logits' max per kernels.sampling.TOPK_BLOCK columns, which the
    # race reads instead of the chunks it can skip; None where the candidates came from topk.
    block_max: torch.Tensor | None = None

    @classmethod
    def keep_all(cls, row_max: torch.Tensor) -> Cutoffs:
        rows = row_max.shape[0]
        zeros = torch.zeros(rows, dtype=torch.int64, device=row_max.device)
        return cls(torch.full((rows,), float("-inf"), device=row_max.device), zeros, zeros, None, row_max)


def count_ties(logits: torch.Tensor, temperature: torch.Tensor, value: torch.Tensor, wanted: torch.Tensor) -> torch.Tensor:
    """``[rows, splits]`` counts of ``logits / temperature == value`` (the kernel skips rows not
    ``wanted``; the reference counts every row in one split)."""
    if use_kernels(logits):
        from pagecast.kernels.sampling import count_ties as kernel

        return kernel(logits, temperature, value, wanted)
    return reference.count_ties(logits, temperature, value)


def top_candidates(logits: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The ``width`` largest logits of each row, descending, their columns, and block maxima for
    the race (or None): the threshold kernels on a GPU (``kernels.sampling.top_candidates``),
    ``torch.topk`` elsewhere. Which of equal values at the last place are chosen is
    unspecified; ``from_topk`` does not depend on it."""
    if use_kernels(logits):
        from pagecast.kernels.sampling import top_candidates as kernel

        return kernel(logits, width)
    values, ids = logits.topk(width, dim=1)
    return values, ids, None


def from_topk(logits: torch.Tensor, temperature: torch.Tensor, top_k: list[int], top_p: list[float]) -> Cutoffs:
    """The cutoffs of ``logits`` (``[rows, vocab]``, any float dtype, not modified) under
    ``temperature`` ([rows] fp32 on its device) and per-row ``top_k`` (``vocab`` = none) and
    ``top_p``. Every row with ``top_p < 1`` must have a top_k; the largest top_k decides the
    candidates' width, so keep it small (the sampler sends rows with a top_k above 1024 to a
    full sort instead)."""
    vocab = logits.shape[1]
    device = logits.device
    limited = [k < vocab for k in top_k]
    if any(p < 1.0 and not lim for p, lim in zip(top_p, limited)):
        raise ValueError("from_topk needs a top_k on every row with top_p < 1")
    width = max((k for k, lim in zip(top_k, limited) if lim), default=0) + 1  # <= vocab
    raw, ids, block_max = top_candidates(logits, width)  # [rows, K + 1], descending
    # The same division as the full row's in the race, so the values compare equal.
    x = raw.float() / temperature[:, None]
    row_max = x[:, 0]
    per_row = to_device([[min(k, width) - 1, int(not lim)] for k, lim in zip(top_k, limited)], device, torch.int64)
    kth = x.gather(1, per_row[:, :1])  # [rows, 1]: the k-th largest x
    unlimited = per_row[:, 1].bool()
    if all(p >= 1.0 for p in top_p):
        value = torch.where(unlimited, float("-inf"), kth.squeeze(1))
        zeros = torch.zeros_like(per_row[:, 0])
        return Cutoffs(value, zeros, zeros, None, row_max, block_max)

    at = x == kth  # [rows, K + 1]: candidates tied with the k-th value
    # The tie group may reach past the candidates only if the last candidate is in it.
    overflow = at[:, -1] & ~unlimited
    tie_counts = count_ties(logits, temperature, kth.squeeze(1), overflow)
    num_tied = torch.where(overflow, tie_counts.sum(dim=1), at.sum(dim=1)).unsqueeze(1)  # [rows, 1] int64

    # The candidates above the k-th value in ascending (x, id) order, after the others (-inf).
    above = x.masked_fill(x <= kth, float("-inf"))
    by_id = ids.argsort(dim=1)
    above, above_ids = above.gather(1, by_id), ids.gather(1, by_id)
    above, order = above.sort(dim=1, stable=True)
    above_ids = above_ids.gather(1, order)
    is_above = above > float("-inf")

    # Ascending mass: the tie group (its count times one token's), then each token above it.
    values = torch.cat([kth, above], dim=1)
    weights = torch.cat([num_tied.float(), is_above.float()], dim=1)
    probs = weights * torch.exp(values - row_max[:, None])
    cumulative = (probs / probs.sum(dim=1, keepdim=True)).cumsum(dim=1)
    p = to_device(top_p, device, torch.float32).unsqueeze(1)
    # Rows with p = 1 only lose tokens of probability exactly 0, which can never be sampled.
    out = cumulative[:, 1:] <= 1 - p
    out[:, -1] = False  # the most likely token stays
    # The group's tokens j = 1..n sit at cumulative j * q: the first (1 - p) / q of them go.
    q = cumulative[:, :1] / num_tied.clamp_min(1)
    tie_drop = torch.minimum(torch.floor((1 - p) / q.clamp_min(torch.finfo(torch.float32).tiny)), num_tied.float()).long()
    has_above = is_above[:, -1:]
    tie_drop = torch.where(has_above, tie_drop, torch.minimum(tie_drop, num_tied - 1))  # the most likely stays
    group_gone = (tie_drop >= num_tied).squeeze(1)

    # The group gone: the cutoff is the first token above it that top-p keeps.
    first = (is_above & ~out).int().argmax(dim=1, keepdim=True)
    value_above, token_above = above.gather(1, first).squeeze(1), above_ids.gather(1, first).squeeze(1)
    # Part of the group kept, all of it among the candidates: the first kept tie's id.
    tied_ids = ids.masked_fill(~at, vocab).sort(dim=1).values
    token_tied = tied_ids.gather(1, tie_drop.clamp(max=width - 1)).squeeze(1)
    value = torch.where(unlimited, float("-inf"), torch.where(group_gone, value_above, kth.squeeze(1)))
    token = torch.where(group_gone, token_above, torch.where(overflow, 0, token_tied)).masked_fill(unlimited, 0)
    # A group reaching past the candidates is dropped by count, lowest ids first, in the race.
    tie_drop = torch.where(overflow & ~group_gone, tie_drop.squeeze(1), 0)
    return Cutoffs(value, token, tie_drop, tie_counts, row_max, block_max)
