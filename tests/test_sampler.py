"""Sampler: greedy, warpers against transformers' own processors, penalties, seeds, logprobs."""

from __future__ import annotations

import math

import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from pagecast.kernels import reference
from pagecast.runtime import truncation
from pagecast.runtime.request import Request
from pagecast.runtime.sampler import (
    _apply_penalties,
    _sample_rows,
    _top_k_top_p_sorted,
    prompt_logprobs,
    sample,
)
from pagecast.runtime.sampling_params import SamplingParams

VOCAB = 97  # odd, not a power of two


def make_request(
    prompt: list[int] | None = None, output: list[int] | None = None, index: int = 0, **params
) -> Request:
    request = Request(f"r{index}", prompt or [1, 2, 3], SamplingParams(**params), index=index)
    for token in output or []:
        request.append_output_token(token)
    return request


def random_logits(rows: int, vocab: int = VOCAB, seed: int = 0, scale: float = 3.0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=generator) * scale


def truncated_from_topk(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """The logits with what truncation.from_topk's cutoffs drop set to -inf (temperature 1)."""
    cutoffs = truncation.from_topk(logits, torch.ones(logits.shape[0]), top_k, top_p)
    keep = reference.truncation_keep(logits, cutoffs.value, cutoffs.token, cutoffs.tie_drop)
    return logits.masked_fill(~keep, float("-inf"))


def allowed_by_transformers(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The tokens transformers' warpers leave unmasked, in the order generate() applies them."""
    if params.temperature == 0.0:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).bool()
    scores = logits.clone()
    ids = torch.zeros(logits.shape[0], 1, dtype=torch.long)
    scores = TemperatureLogitsWarper(float(params.temperature))(ids, scores)
    if params.top_k:
        scores = TopKLogitsWarper(params.top_k)(ids, scores)
    if params.top_p < 1.0:
        scores = TopPLogitsWarper(params.top_p)(ids, scores)
    if params.min_p > 0.0:
        scores = MinPLogitsWarper(params.min_p)(ids, scores)
    return scores > float("-inf")


# --- greedy ------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_is_argmax(dtype: torch.dtype) -> None:
    logits = random_logits(9).to(dtype)
    before = logits.clone()
    requests = [make_request(index=i, temperature=0.0) for i in range(9)]
    out = sample(logits, requests)
    assert out.token_ids == logits.float().argmax(-1).tolist()
    assert out.logprobs == [None] * 9
    assert torch.equal(logits, before), "the sampler must not modify the caller's logits"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logit_bias_moves_its_rows_only_and_keeps_min_tokens_masks(dtype: torch.dtype) -> None:
    """logit_bias adds to its own row's logits: -100 on the argmax takes the runner-up, +100 on any
    token picks it even at temperature 1; rows without a bias are as before; a stop token masked by
    min_tokens stays masked whatever its bias; logprobs are the raw logits' and the caller's logits
    are not modified."""
    logits = random_logits(4).to(dtype)
    before = logits.clone()
    top2 = logits.float().topk(2, dim=-1).indices
    eos = int(top2[3, 0])
    requests = [
        make_request(index=0, temperature=0.0, logit_bias={int(top2[0, 0]): -100.0}, logprobs=1),
        make_request(index=1, temperature=1.0, seed=5, logit_bias={7: 100.0}),
        make_request(index=2, temperature=0.0),
        make_request(index=3, temperature=0.0, min_tokens=2, stop_token_ids=[eos], logit_bias={eos: 100.0}),
    ]
    out = sample(logits, requests)
    assert out.token_ids[:3] == [int(top2[0, 1]), 7, int(logits[2].float().argmax())]
    assert out.token_ids[3] != eos
    raw = torch.log_softmax(logits[0].float(), dim=-1)[int(top2[0, 1])].item()
    assert out.logprobs[0] is not None
    assert out.logprobs[0][int(top2[0, 1])].logprob == pytest.approx(raw, abs=1e-4)
    assert torch.equal(logits, before)


def test_logit_bias_values_are_checked() -> None:
    assert SamplingParams(logit_bias={5: 3}).logit_bias == {5: 3.0}
    assert SamplingParams(logit_bias={}).logit_bias is None
    for bad in ({5: 100.5}, {5: float("nan")}, {-1: 1.0}, {"5": 1.0}, {True: 1.0}, [1, 2]):
        with pytest.raises(ValueError, match="^logit_bias"):
            SamplingParams(logit_bias=bad)  # type: ignore[arg-type]


def test_empty_batch_and_bad_shape() -> None:
    assert sample(torch.empty(0, VOCAB), []).token_ids == []
    with pytest.raises(ValueError, match="one row per request"):
        sample(torch.zeros(2, VOCAB), [make_request()])


# --- warpers against transformers --------------------------------------------------------------

WARPER_CASES = [
    dict(temperature=0.7, top_k=5),
    dict(temperature=1.0, top_k=1),
    dict(temperature=1.3, top_p=0.8),
    dict(temperature=0.5, top_p=0.3),
    dict(temperature=1.0, min_p=0.1),
    dict(temperature=1.8, min_p=0.3),
    dict(temperature=0.9, top_k=20, top_p=0.9, min_p=0.05),
    dict(temperature=1.0, top_k=40, top_p=0.5),
]


@pytest.mark.parametrize("case", WARPER_CASES, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_sampling_never_picks_a_token_transformers_masks(case: dict) -> None:
    params = SamplingParams(**case)
    logits = random_logits(16, seed=1)
    allowed = allowed_by_transformers(logits, params)
    requests = [make_request(index=i, **case) for i in range(16)]
    torch.manual_seed(0)
    for _ in range(40):
        out = sample(logits, requests)
        for row, token in enumerate(out.token_ids):
            assert allowed[row, token], f"row {row} picked masked token {token}"


def test_mixed_batch_rows_use_their_own_parameters() -> None:
    # One batch holding every case (and greedy rows): each row must obey its own warpers.
    cases = WARPER_CASES + [dict(temperature=0.0), dict(temperature=1.0)]
    logits = random_logits(len(cases), seed=2)
    requests = [make_request(index=i, **case) for i, case in enumerate(cases)]
    allowed = [
        allowed_by_transformers(logits[i : i + 1], SamplingParams(**case))[0] for i, case in enumerate(cases)
    ]
    torch.manual_seed(0)
    seen: list[set[int]] = [set() for _ in cases]
    for _ in range(60):
        for row, token in enumerate(sample(logits, requests).token_ids):
            assert allowed[row][token]
            seen[row].add(token)
    assert seen[len(cases) - 2] == {int(logits[len(cases) - 2].argmax())}
    assert len(seen[len(cases) - 1]) > 1, "an untruncated row should not collapse onto one token"


def test_truncation_keeps_the_exact_transformers_support() -> None:
    # Sample many times with a flat-ish distribution: the set of tokens seen is the whole
    # support transformers leaves (so we mask no more than it does either).
    params = dict(temperature=1.0, top_k=6, top_p=0.95)
    logits = random_logits(1, seed=3, scale=0.3)
    allowed = allowed_by_transformers(logits, SamplingParams(**params))[0]
    request = make_request(**params)
    torch.manual_seed(0)
    seen = {sample(logits, [request]).token_ids[0] for _ in range(400)}
    assert seen == set(allowed.nonzero().flatten().tolist())


@pytest.mark.parametrize("vocab", [VOCAB, 3000])
def test_truncation_from_topk_matches_the_full_sort_and_transformers(vocab: int) -> None:
    # Small top_k values take the topk path (no sort of the vocabulary): same masks.
    rows = 12
    logits = random_logits(rows, vocab=vocab, seed=13)
    top_k = [1, 2, 5, 5, 20, 40, 50, 50, 3, 8, 13, 50]
    top_p = [1.0, 0.5, 0.9, 1.0, 0.95, 0.3, 0.95, 0.99, 0.05, 0.8, 1.0, 0.6]
    fast = truncated_from_topk(logits, top_k, top_p)
    assert torch.equal(fast, _top_k_top_p_sorted(logits, top_k, top_p))
    for row, (k, p) in enumerate(zip(top_k, top_p)):
        params = SamplingParams(temperature=1.0, top_k=k, top_p=p)
        assert torch.equal(fast[row : row + 1] > float("-inf"), allowed_by_transformers(logits[row : row + 1], params))


def test_truncation_from_topk_keeps_ties_with_the_kth_value() -> None:
    # bf16 logits tie often: transformers' top-k keeps every token equal to the k-th value.
    logits = torch.full((2, 3000), -5.0)
    logits[:, :4] = torch.tensor([4.0, 3.0, 2.0, 1.0])
    logits[:, 1000:1010] = 1.0  # nine more ties with the 4th value, beyond the K best
    kept = truncated_from_topk(logits, [4, 4], [1.0, 0.9]) > float("-inf")
    assert kept[0].sum() == 14 and kept[0, 1000:1010].all()
    assert torch.equal(kept[0], allowed_by_transformers(logits[:1], SamplingParams(top_k=4))[0])
    # p = 0.9: the eleven 1.0 tokens come first in ascending order, ~0.024 of the mass each, so
    # the first four fall within 1 - p = 0.1 and go. Which four of the equal tokens is arbitrary
    # in transformers (sort order); here the lowest ids; how many is the same.
    expected = allowed_by_transformers(logits[1:], SamplingParams(top_k=4, top_p=0.9))[0]
    assert kept[1].sum() == expected.sum() == 10
    assert kept[1, :3].all() and expected[:3].all()
    assert kept[1].nonzero().flatten().tolist() == [0, 1, 2] + list(range(1003, 1010))


# --- penalties ---------------------------------------------------------------------------------


@pytest.mark.parametrize("penalty", [1.3, 0.7])
def test_repetition_penalty_matches_transformers(penalty: float) -> None:
    logits = random_logits(3, seed=4)
    prompts = [[5, 6, 7, 5], [0, 96], [10]]
    outputs = [[8, 8, 9], [], [11, 10, 50]]
    requests = [
        make_request(prompt, output, index=i, repetition_penalty=penalty)
        for i, (prompt, output) in enumerate(zip(prompts, outputs))
    ]
    ours = _apply_penalties(logits, requests)
    for row, (p, o) in enumerate(zip(prompts, outputs)):
        ids = torch.tensor([p + o])
        expected = RepetitionPenaltyLogitsProcessor(penalty)(ids, logits[row : row + 1].clone())
        torch.testing.assert_close(ours[row : row + 1], expected, rtol=0, atol=0)


def test_presence_and_frequency_follow_the_openai_formula() -> None:
    logits = random_logits(2, seed=5)
    prompt = [1, 2, 3, 4]  # prompt tokens must not count
    output = [4, 7, 7, 7, 9]
    requests = [
        make_request(prompt, output, index=0, presence_penalty=0.5, frequency_penalty=0.25),
        make_request(prompt, output, index=1, presence_penalty=-1.0, frequency_penalty=1.5),
    ]
    ours = _apply_penalties(logits, requests)
    for row, request in enumerate(requests):
        expected = logits[row].clone()
        params = request.sampling_params
        for token in set(output):
            count = output.count(token)
            expected[token] -= params.presence_penalty * (count > 0) + params.frequency_penalty * count
        torch.testing.assert_close(ours[row], expected)


def test_penalties_apply_to_greedy_rows_and_only_to_penalised_rows() -> None:
    logits = torch.zeros(2, VOCAB)
    logits[:, 10] = 5.0
    logits[:, 11] = 4.0
    requests = [
        make_request([10], [10, 10], index=0, temperature=0.0, frequency_penalty=1.0),
        make_request([10], [10, 10], index=1, temperature=0.0),
    ]
    assert sample(logits, requests).token_ids == [11, 10]


def test_penalties_ignore_ids_outside_the_logits_vocabulary() -> None:
    # The model's logits may be narrower than the tokenizer (or a prompt may hold odd ids).
    logits = random_logits(1, seed=11)
    request = make_request([VOCAB + 5, 4], [VOCAB, 4], repetition_penalty=1.5, frequency_penalty=1.0)
    ours = _apply_penalties(logits, [request])
    changed = (ours != logits).nonzero()[:, 1].tolist()
    assert changed == [4]


# --- seeds and the distribution ----------------------------------------------------------------


def generate(logits: torch.Tensor, requests: list[Request], steps: int) -> list[list[int]]:
    """Sample ``steps`` tokens per row with fixed logits, appending each to its request (the
    seeded noise is keyed by the index of the output token being sampled)."""
    streams: list[list[int]] = [[] for _ in requests]
    for _ in range(steps):
        for request, stream, token in zip(requests, streams, sample(logits, requests).token_ids):
            request.append_output_token(token)
            stream.append(token)
    return streams


def test_seeded_sampling_is_reproducible_and_batch_independent() -> None:
    logits = random_logits(6, seed=6, scale=1.0)

    def run(rows: list[int], **other) -> list[int]:  # type: ignore[no-untyped-def]
        requests = [
            make_request(index=0, temperature=1.0, seed=1234) if r == 0 else make_request(index=r, **other)
            for r in rows
        ]
        return generate(logits[rows], requests, 20)[rows.index(0)]

    alone = run([0])
    torch.manual_seed(99)  # the other rows' shared randomness must not matter
    assert run([0]) == alone
    assert run([3, 0, 5]) == alone
    assert run([2, 4, 1, 0]) == alone
    assert len(set(alone)) > 1
    # Truncation or a seed on another row must not change the seeded row either.
    assert run([0, 1], top_k=3, top_p=0.5) == alone
    assert run([1, 0], seed=99) == alone


def test_seeded_noise_depends_on_seed_choice_and_position_only() -> None:
    # The stream is a function of (seed, choice index, output position): a preempted request
    # that recomputes its tokens, or the asynchronous engine, draws the same noise.
    logits = random_logits(1, seed=12, scale=0.5)
    a = make_request(index=0, seed=3)
    b = make_request(index=0, seed=3)
    for token in [5, 6, 7]:
        b.append_output_token(token)
    first = generate(logits, [a], 6)[0]
    assert generate(logits, [b], 3)[0] == first[3:]
    assert generate(logits, [make_request(index=0, seed=4)], 6)[0] != first


def test_n_choices_with_one_seed_differ_but_repeat() -> None:
    logits = random_logits(1, seed=7, scale=0.5)
    streams = [generate(logits.expand(3, -1), [make_request(index=i, seed=5) for i in range(3)], 10) for _ in range(2)]
    assert streams[0] == streams[1]
    assert len({tuple(s) for s in streams[0]}) == 3


def test_seeded_sampling_matches_softmax() -> None:
    # Keyed noise gives the same distribution as the generator's: many seeds, one draw each.
    vocab = 6
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]])
    expected = torch.softmax(logits[0], -1)
    rows = 4000
    requests = [make_request(index=0, temperature=1.0, seed=s) for s in range(rows)]
    counts = torch.bincount(torch.tensor(sample(logits.expand(rows, -1), requests).token_ids), minlength=vocab).float()
    chi2 = float((((counts - rows * expected) ** 2) / (rows * expected)).sum())
    assert chi2 < 20.5, f"chi-square {chi2:.1f} over 5 degrees of freedom (p < 0.001)"


def test_unseeded_sampling_matches_softmax() -> None:
    vocab = 6
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]])
    expected = torch.softmax(logits[0], -1)
    rows = 2000
    requests = [make_request(index=i, temperature=1.0) for i in range(rows)]
    torch.manual_seed(0)
    counts = torch.zeros(vocab)
    for _ in range(10):
        tokens = torch.tensor(sample(logits.expand(rows, -1), requests).token_ids)
        counts += torch.bincount(tokens, minlength=vocab)
    total = counts.sum()
    chi2 = float((((counts - total * expected) ** 2) / (total * expected)).sum())
    assert chi2 < 20.5, f"chi-square {chi2:.1f} over 5 degrees of freedom (p < 0.001)"


def test_temperature_sharpens_and_flattens() -> None:
    logits = torch.tensor([[1.0, 0.0, -1.0, -2.0]])
    torch.manual_seed(0)
    for temperature, low, high in [(0.3, 0.93, 1.0), (2.0, 0.35, 0.55)]:
        requests = [make_request(index=i, temperature=temperature) for i in range(4000)]
        tokens = torch.tensor(sample(logits.expand(4000, -1), requests).token_ids)
        share = float((tokens == 0).float().mean())
        p0 = float(torch.softmax(logits[0] / temperature, -1)[0])
        assert low < share < high and abs(share - p0) < 0.03


def test_sample_rows_handles_masked_tokens_with_zero_noise() -> None:
    # A masked token (-inf) must never win, even if its exponential draw is tiny.
    logits = torch.full((64, VOCAB), float("-inf"))
    logits[:, 3] = 0.0
    requests = [make_request(index=i) for i in range(64)]
    assert _sample_rows(logits, requests).tolist() == [3] * 64


# --- logprobs ----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logprobs_are_raw_log_softmax_with_ranks(dtype: torch.dtype) -> None:
    logits = random_logits(4, seed=8).to(dtype)
    requests = [
        make_request(index=0, temperature=0.0, logprobs=5),
        make_request(index=1, temperature=0.5, top_k=3, logprobs=0),
        make_request(index=2, temperature=1.0, logprobs=None),
        make_request(index=3, temperature=1.0, repetition_penalty=1.9, presence_penalty=2.0, logprobs=2),
    ]
    torch.manual_seed(0)
    out = sample(logits, requests)
    reference = torch.log_softmax(logits.float(), -1)
    order = reference.argsort(-1, descending=True)
    assert out.logprobs[2] is None
    for row, k in [(0, 5), (1, 0), (3, 2)]:
        entry = out.logprobs[row]
        assert entry is not None
        token = out.token_ids[row]
        assert next(iter(entry)) == token, "the chosen token comes first"
        chosen_rank = int((order[row] == token).nonzero()) + 1
        assert entry[token].rank == chosen_rank
        top = order[row, :k].tolist()
        assert set(entry) == set(top) | {token}
        for tid, lp in entry.items():
            assert math.isclose(lp.logprob, float(reference[row, tid]), abs_tol=1e-5)
            assert lp.decoded_token is None
            if tid in top and tid != token:
                assert lp.rank == top.index(tid) + 1
    assert out.logprobs[0][out.token_ids[0]].rank == 1  # greedy picks rank 1


def test_prompt_logprobs() -> None:
    logits = random_logits(7, seed=9)
    targets = [5, 0, 96, 40, 40, 3, 12]
    reference = torch.log_softmax(logits, -1)
    for num_top in (0, 1, 4):
        entries = prompt_logprobs(logits, targets, num_top)
        assert len(entries) == len(targets)
        for j, (entry, target) in enumerate(zip(entries, targets)):
            assert next(iter(entry)) == target
            assert math.isclose(entry[target].logprob, float(reference[j, target]), abs_tol=1e-5)
            assert entry[target].rank == int((reference[j] > reference[j, target]).sum()) + 1
            top = reference[j].topk(num_top).indices.tolist() if num_top else []
            assert set(entry) == set(top) | {target}
            assert len(entry) <= num_top + 1
    with pytest.raises(ValueError):
        prompt_logprobs(logits, targets[:3], 1)


def test_prompt_logprobs_in_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    import pagecast.runtime.sampler as sampler_module

    logits = random_logits(11, seed=10)
    targets = list(range(11))
    whole = prompt_logprobs(logits, targets, 2)
    monkeypatch.setattr(sampler_module, "_PROMPT_LOGPROBS_CHUNK", 4)
    assert prompt_logprobs(logits, targets, 2) == whole


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_cuda_seeded_rows_masks_and_logprobs() -> None:
    vocab = 151_936
    logits = (torch.randn(256, vocab, device="cuda") * 3).to(torch.bfloat16)
    cases = [dict(temperature=0.0), dict(temperature=0.8, top_k=50, top_p=0.9, min_p=0.05, logprobs=5)]

    def requests_for(rows: int) -> list[Request]:
        return [make_request(index=i, seed=7 if i == 1 else None, **cases[i % 2]) for i in range(rows)]

    first = sample(logits, requests_for(256))
    again = sample(logits, requests_for(256))
    alone = sample(logits[1:2], [make_request(index=1, seed=7, **cases[1])])
    assert first.token_ids[1] == again.token_ids[1] == alone.token_ids[0]
    assert first.token_ids[::2] == logits[::2].float().argmax(-1).tolist()
    allowed = allowed_by_transformers(logits[1::2].float(), SamplingParams(**cases[1]))
    for row, token in enumerate(first.token_ids[1::2]):
        assert allowed[row, token]
    reference = torch.log_softmax(logits.float(), -1)
    entry = first.logprobs[1]
    assert entry is not None and len(entry) >= 5
    for token, lp in entry.items():
        assert math.isclose(lp.logprob, float(reference[1, token]), abs_tol=1e-4)
