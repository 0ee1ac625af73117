"""The sampling kernels (kernels/sampling.py) against their torch references, and the sampler's
kernel path against its reference path, through the Triton interpreter (fp32 and fp16 logits;
bf16 on a GPU: tests/test_sampling_gpu.py).

The exactness claim: on the same logits, cutoffs and noise keys, the race kernel picks the same
token as ``reference.race`` (with ``reference.keyed_exponential`` noise), ``count_ties`` and
``logprob_stats`` give the reference's counts and sums, and the sampler gives the same tokens,
logprobs and ranks whichever path it takes. Odd vocabulary sizes leave partial chunks; bf16-
rounded logits make the tie groups that truncation has to split."""

from __future__ import annotations

import math
import os

import pytest
import torch
from test_sampler import allowed_by_transformers, make_request

from pagecast.kernels import reference
from pagecast.runtime import truncation
from pagecast.runtime.sampler import sample
from pagecast.runtime.sampling_params import SamplingParams

# CPU tensors through the interpreter (conftest sets it where there is no GPU); on a GPU,
# tests/test_sampling_gpu.py runs the same comparisons in bf16.
pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="runs under the Triton interpreter")


def kernels():  # type: ignore[no-untyped-def]
    from pagecast.kernels import sampling

    return sampling


def tied_logits(rows: int, vocab: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Random logits rounded to bf16 (many equal values, as a bf16 model's), then ``dtype``."""
    generator = torch.Generator().manual_seed(seed)
    logits = (torch.randn(rows, vocab, generator=generator) * 3).to(torch.bfloat16)
    return logits.to(dtype)


def peaked_logits(rows: int, vocab: int, seed: int, dtype: torch.dtype) -> torch.Tensor:
    """bf16-rounded logits whose ~100 best tokens sit in two chunks (the fourth, in the first
    split, and the partial last one): the interpreter draws noise only in chunks that hold a kept
    token (~0.3 s per 1024-column chunk), so wide rows stay cheap to test."""
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=generator)
    for start in (3 * 1024, vocab - 40):
        logits[:, start : start + 40] = torch.randn(rows, 40, generator=generator) * 2 + 8
    return logits.to(torch.bfloat16).to(dtype)


def keys_for(rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    keys = torch.randint(-(2**63), 2**63 - 1, (rows,), generator=generator, dtype=torch.int64)
    offsets = torch.randint(0, 2**32, (rows,), generator=generator, dtype=torch.int64)
    return keys, offsets


def race_both(logits, temperature, cutoffs, min_p, keys, offsets, chunks):  # type: ignore[no-untyped-def]
    """(kernel tokens, reference tokens) on the same cutoffs and noise keys."""
    tie_counts = cutoffs.tie_counts
    if tie_counts is not None:  # counted per split: recount for this split size
        every = torch.ones(logits.shape[0], dtype=torch.bool)
        tie_counts = kernels().count_ties(logits, temperature, cutoffs.value, every, chunks=chunks)
    got = kernels().race(logits, temperature, cutoffs.value, cutoffs.token, cutoffs.tie_drop, tie_counts,
                         cutoffs.row_max, min_p, keys, offsets, chunks=chunks)  # fmt: skip
    noise = reference.keyed_exponential(keys, offsets, logits.shape[1])
    expected = reference.race(logits, temperature, cutoffs.value, cutoffs.token, cutoffs.tie_drop, cutoffs.row_max,
                              min_p, noise)  # fmt: skip
    return got, expected


@pytest.fixture
def kernel_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """Route the sampler's CPU tensors through the kernels (interpreted)."""
    monkeypatch.setattr(truncation, "use_kernels", lambda t: True)


# --- the race --------------------------------------------------------------------------------

# Per row: (temperature, top_k, top_p, min_p); top_k 0 = none.
RACE_ROWS = [
    (0.8, 50, 0.95, 0.0),  # the common setting
    (1.0, 1, 1.0, 0.0),
    (0.7, 5, 1.0, 0.0),  # top-k only
    (1.3, 40, 0.5, 0.0),
    (1.0, 20, 0.9, 0.05),  # with min-p
    (1.0, 0, 1.0, 0.2),  # min-p only: every token passes the cutoff
    (2.0, 0, 1.0, 0.0),  # temperature only
    (0.5, 64, 0.999, 0.0),
]


# Wide rows: truncated ones only (a row every token of which passes draws noise in every chunk).
WIDE_RACE_ROWS = [(0.8, 50, 0.95, 0.0), (0.7, 5, 1.0, 0.0), (1.0, 8, 0.6, 0.0), (1.0, 30, 1.0, 0.3)]


@pytest.mark.parametrize(
    "vocab,dtype,chunks,cases,seeds",
    [(1000, torch.float32, 1, RACE_ROWS, 2), (2500, torch.float16, 1, RACE_ROWS, 1),
     (32003, torch.float16, 8, WIDE_RACE_ROWS, 1), (49152, torch.float32, 2, WIDE_RACE_ROWS, 1)],
)  # fmt: skip
def test_race_kernel_matches_reference(vocab, dtype, chunks, cases, seeds, kernel_path) -> None:  # type: ignore[no-untyped-def]
    rows = len(cases)
    make = tied_logits if vocab < 4096 else peaked_logits
    logits = make(rows, vocab, seed=vocab, dtype=dtype)
    temperature = torch.tensor([r[0] for r in cases])
    min_p = torch.tensor([r[3] for r in cases])
    top_k = [r[1] if r[1] else vocab for r in cases]
    cutoffs = truncation.from_topk(logits, temperature, top_k, [r[2] for r in cases])
    for seed in range(seeds):
        keys, offsets = keys_for(rows, seed)
        got, expected = race_both(logits, temperature, cutoffs, min_p, keys, offsets, chunks)
        assert got.tolist() == expected.tolist()


def test_race_kernel_on_pre_masked_rows_and_negative_infinity() -> None:
    # The sorted path hands the race logits already divided and masked (-inf), temperature 1
    # and no cutoff; min_tokens masks also leave -inf in rows the cutoff does not cover.
    vocab = 2100
    logits = tied_logits(4, vocab, seed=5)
    logits[:, 100:1500] = float("-inf")
    logits[1, :] = float("-inf")
    logits[1, 1777] = 0.5  # the only finite token
    row_max = logits.amax(dim=1)
    cutoffs = truncation.Cutoffs.keep_all(row_max)
    keys, offsets = keys_for(4, 1)
    got, expected = race_both(logits, torch.ones(4), cutoffs, torch.tensor([0.0, 0.0, 0.1, 0.0]), keys, offsets, 1)
    assert got.tolist() == expected.tolist()
    assert got[1] == 1777 and bool(torch.isfinite(logits[torch.arange(4), got]).all())


# --- ties at the cutoff --------------------------------------------------------------------------


def tie_group_row(vocab: int, num_tied: int = 40) -> torch.Tensor:
    """Three tokens above a group of equal values spread over the whole row, the rest far
    below: with top_k 4 the group reaches far past the candidates."""
    logits = torch.full((vocab,), -6.0)
    logits[[17, vocab // 2, vocab - 3]] = torch.tensor([3.0, 2.5, 2.25])
    tied = torch.linspace(40, vocab - 40, num_tied).long()
    logits[tied] = 1.0
    return logits


@pytest.mark.parametrize("top_p", [1.0, 0.9, 0.6, 0.3])
def test_tie_group_past_the_candidates_drops_lowest_ids_first(top_p: float, kernel_path: None) -> None:
    vocab = 32003
    row = tie_group_row(vocab)
    tied = (row == 1.0).nonzero().flatten()
    # A second row with a larger top_k widens the candidates (K + 1 = 11): still not the group.
    logits = torch.stack([row, row])
    cutoffs = truncation.from_topk(logits, torch.ones(2), [4, 10], [top_p, top_p])
    keep = reference.truncation_keep(logits, cutoffs.value, cutoffs.token, cutoffs.tie_drop)
    expected = allowed_by_transformers(logits[:1], SamplingParams(top_k=4, top_p=top_p))[0]
    assert int(keep[0].sum()) == int(expected.sum()), "as many tokens as transformers keeps"
    kept_ties = keep[0, tied]
    # The dropped tokens of the group are its lowest ids.
    assert kept_ties.tolist() == sorted(kept_ties.tolist())
    ones = torch.ones(2)
    counts = kernels().count_ties(logits, ones, ones, torch.tensor([True, False]), chunks=1)
    assert counts.sum(dim=1).tolist() == [40, 0]


def test_race_kernel_drops_the_lowest_tied_ids(kernel_path: None) -> None:
    # Part of a group spread over five splits goes: the kernel places each split in the group
    # (tie_counts) and, with the same noise keys, samples what the reference samples.
    vocab, rows = 4100, 4
    logits = tie_group_row(vocab, num_tied=12).expand(rows, -1)
    cutoffs = truncation.from_topk(logits, torch.ones(rows), [4] * rows, [0.85] * rows)
    assert cutoffs.tie_drop.tolist() == [4] * rows and cutoffs.value.tolist() == [1.0] * rows
    keys, offsets = keys_for(rows, 5)
    got, want = race_both(logits, torch.ones(rows), cutoffs, torch.zeros(rows), keys, offsets, chunks=1)
    assert got.tolist() == want.tolist()
    keep = reference.truncation_keep(logits, cutoffs.value, cutoffs.token, cutoffs.tie_drop)
    assert keep[0, got].all()
    assert keep[0, (logits[0] == 1.0).nonzero().flatten()].tolist() == [False] * 4 + [True] * 8


def test_count_ties_kernel_matches_reference() -> None:
    logits = tied_logits(5, 5000, seed=3, dtype=torch.float16)
    temperature = torch.tensor([1.0, 0.8, 1.0, 0.7, 2.0])
    value = logits.float().topk(30, dim=1).values[:, 29] / temperature
    wanted = torch.tensor([True, True, False, True, True])
    for chunks in (1, 8):
        counts = kernels().count_ties(logits, temperature, value, wanted, chunks=chunks)
        assert counts.shape == (5, kernels().num_splits(5000, chunks))
        expected = reference.count_ties(logits, temperature, value).squeeze(1)
        assert counts.sum(dim=1).tolist() == torch.where(wanted, expected, 0).tolist()
    assert int(expected.max()) > 1, "bf16-rounded logits tie"


# --- logprobs --------------------------------------------------------------------------------


@pytest.mark.parametrize("vocab,dtype", [(1000, torch.float32), (32003, torch.float16), (49152, torch.float32)])
def test_logprob_stats_kernel_matches_reference(vocab: int, dtype: torch.dtype) -> None:
    logits = tied_logits(4, vocab, seed=7, dtype=dtype)
    logits[2, 5:900] = float("-inf")
    scored = logits.float()[torch.arange(4), torch.tensor([0, 17, 3, vocab - 1])]
    maxes, sums, greater = kernels().logprob_stats(logits, scored, chunks=1)
    ref_max, ref_sum, ref_greater = reference.logprob_stats(logits, scored)
    row_max = maxes.amax(dim=1, keepdim=True)
    assert torch.equal(row_max, ref_max)
    torch.testing.assert_close((sums * torch.exp(maxes - row_max)).sum(dim=1, keepdim=True), ref_sum, rtol=1e-5, atol=0)
    assert torch.equal(greater.sum(dim=1, keepdim=True), ref_greater)


# --- the sampler's kernel path against its reference path ------------------------------------

SAMPLER_CASES = [
    dict(temperature=0.0, logprobs=3),
    dict(temperature=0.8, top_k=50, top_p=0.95, logprobs=5),
    dict(temperature=0.7, top_k=5),
    dict(temperature=1.3, top_p=0.8),  # top-p only: the full sort, then the kernel race
    dict(temperature=1.0, min_p=0.1, logprobs=0),
    dict(temperature=0.9, top_k=20, top_p=0.9, min_p=0.05),
    dict(temperature=1.0),
    dict(temperature=0.0),
]


@pytest.mark.parametrize("vocab,dtype", [(1000, torch.float32), (2500, torch.float16)])
def test_sampler_kernel_path_matches_reference_path(vocab: int, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    # Seeded rows draw the same noise on both paths: same tokens; logprobs within 1e-5.
    logits = tied_logits(len(SAMPLER_CASES), vocab, seed=11, dtype=dtype)

    def run() -> tuple[list[int], list]:  # type: ignore[type-arg]
        requests = [make_request(index=i, seed=100 + i, **case) for i, case in enumerate(SAMPLER_CASES)]
        out = sample(logits, requests)
        return out.token_ids, out.logprobs

    ref_tokens, ref_logprobs = run()
    monkeypatch.setattr(truncation, "use_kernels", lambda t: True)
    tokens, logprobs = run()
    assert tokens == ref_tokens
    for entry, ref in zip(logprobs, ref_logprobs):
        assert (entry is None) == (ref is None)
        if entry is None:
            continue
        assert list(entry) == list(ref)
        for token in entry:
            assert entry[token].rank == ref[token].rank
            assert math.isclose(entry[token].logprob, ref[token].logprob, abs_tol=1e-5)
    exact = torch.log_softmax(logits.float(), dim=-1)
    for row, entry in enumerate(logprobs):
        for token, lp in (entry or {}).items():
            assert math.isclose(lp.logprob, float(exact[row, token]), abs_tol=1e-5)
    for row, case in enumerate(SAMPLER_CASES):
        allowed = allowed_by_transformers(logits[row : row + 1].float(), SamplingParams(**case))[0]
        assert allowed[tokens[row]], f"row {row} ({case}) picked a token transformers masks"


def test_sampler_kernel_path_mixed_rows_and_unseeded(kernel_path: None) -> None:
    # Greedy, unseeded and seeded rows in one batch: greedy rows are the argmax, seeded rows do
    # not depend on the rest of the batch, unseeded rows stay within their truncation.
    vocab = 2100
    logits = tied_logits(6, vocab, seed=13)
    cases = [dict(temperature=0.0), dict(temperature=0.8, top_k=50, top_p=0.95), dict(temperature=1.0, top_k=3),
             dict(temperature=0.8, top_k=50, top_p=0.95, seed=4), dict(temperature=0.0), dict(min_p=0.2)]  # fmt: skip
    requests = [make_request(index=i, **case) for i, case in enumerate(cases)]
    tokens = sample(logits, requests).token_ids
    assert tokens[0] == int(logits[0].argmax()) and tokens[4] == int(logits[4].argmax())
    alone = sample(logits[3:4], [make_request(index=3, **cases[3])]).token_ids
    assert alone == [tokens[3]]
    for row, case in enumerate(cases):
        params = SamplingParams(**{k: v for k, v in case.items() if k != "seed"})
        assert allowed_by_transformers(logits[row : row + 1], params)[0, tokens[row]]


# --- top_candidates ----------------------------------------------------------------------------


def awkward_rows(vocab: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows a threshold can get wrong: bf16-rounded (ties everywhere), flat (every column ties),
    mostly masked (fewer finite columns than candidates), signed zeros at the top, and a
    plateau of equal maxima wider than the candidates."""
    logits = tied_logits(7, vocab, seed=vocab, dtype=torch.float32)
    logits[1] = 0.5
    logits[2] = float("-inf")
    logits[2, torch.arange(3, vocab, vocab // 9)[:9]] = torch.arange(9, dtype=torch.float32)
    logits[3] = -logits[3].abs()
    logits[3, ::5] = -0.0
    logits[3, 2::5] = 0.0
    logits[4, ::7] = 9.0
    logits[5, -300:] = 20.0
    return logits.to(dtype)


# Each width (one candidate; the sampler's 51 and 100), capacity and dtype, in four runs rather
# than all twelve combinations: each run takes about 3 s on the interpreter.
@pytest.mark.parametrize(
    ("width", "capacity", "dtype"),
    [(1, 64 * 8, torch.float32), (51, 1024, torch.float16), (100, 64 * 8, torch.float16), (100, 1024, torch.float32)],
)
def test_top_candidates_are_topk(width: int, capacity: int, dtype: torch.dtype) -> None:
    vocab = 13_001
    logits = awkward_rows(vocab, dtype)
    assert kernels().top_candidates_apply(vocab, width, capacity)
    values, ids, block_max = kernels().top_candidates(logits, width, capacity)
    padded = torch.nn.functional.pad(logits.float(), (0, block_max.shape[1] * 128 - vocab), value=float("-inf"))
    assert torch.equal(block_max, padded.reshape(logits.shape[0], -1, 128).amax(dim=2))
    expected = logits.float().topk(width, dim=1).values
    assert values.dtype == torch.float32 and ids.dtype == torch.int64
    assert torch.equal(values, expected)
    for row in range(logits.shape[0]):
        assert len(set(ids[row].tolist())) == width, f"row {row}: a column twice"
        assert torch.equal(logits[row, ids[row]].float(), values[row]), f"row {row}: columns do not hold the values"


def test_top_candidates_exact_search_takes_the_lowest_tied_columns() -> None:
    # A flat row holds 13,001 candidates: past any capacity, so the per-row search picks them,
    # lowest columns first among equal values.
    logits = torch.zeros(2, 13_001)
    logits[1, 7] = 1.0
    values, ids, _ = kernels().top_candidates(logits, 51, capacity=256)
    assert ids[0].sort().values.tolist() == list(range(51))
    assert ids[1, 0] == 7 and sorted(ids[1, 1:].tolist()) == list(range(7)) + list(range(8, 51))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_sampler_kernel_path_with_threshold_candidates(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    # Small blocks and capacity, so a 2,500-column row takes the threshold path (with one flat,
    # exactly-searched row): the same tokens and logprobs as the reference path.
    monkeypatch.setattr(kernels(), "TOPK_BLOCK", 16)
    monkeypatch.setattr(kernels(), "CAPACITY", 256)
    vocab = 2500
    logits = tied_logits(len(SAMPLER_CASES), vocab, seed=12, dtype=dtype)
    logits[1] = 1.0
    assert kernels().top_candidates_apply(vocab, 51, 256)
    requests = lambda: [make_request(index=i, seed=100 + i, **case) for i, case in enumerate(SAMPLER_CASES)]  # noqa: E731
    expected = sample(logits, requests()).token_ids
    monkeypatch.setattr(truncation, "use_kernels", lambda t: True)
    calls = []
    original = kernels().top_candidates
    monkeypatch.setattr(kernels(), "top_candidates", lambda *a, **k: calls.append(1) or original(*a, **k))
    assert sample(logits, requests()).token_ids == expected
    assert calls, "the sampler did not use top_candidates"
