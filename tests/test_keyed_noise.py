"""Keyed noise for seeded sampling (kernels/keyed_noise.py) and the device-side penalty rows
(runtime/penalty_state.py): the kernel against its reference, the reference against Philox's
published answers, and the row bookkeeping that asynchronous penalties rely on."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from pagecast.kernels import reference
from pagecast.runtime.penalty_state import PenaltyState
from pagecast.runtime.request import Request
from pagecast.runtime.sampler import host_penalty_inputs
from pagecast.runtime.sampling_params import SamplingParams

# Random123's known-answer vectors for Philox4x32-10: (counter, key, output).
PHILOX_KAT = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


@pytest.mark.parametrize("counter,key,expected", PHILOX_KAT)
def test_reference_philox_matches_the_published_answers(counter, key, expected) -> None:  # type: ignore[no-untyped-def]
    words = reference.philox4x32([np.uint32(c) for c in counter], [np.uint32(k) for k in key])
    assert tuple(int(w) for w in words) == expected


KEYS = torch.tensor([0, 1, -1, 2**62 + 12345, -(2**63)])
OFFSETS = torch.tensor([0, 3, 2**32 - 1, 17, 5])


@pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="the kernel runs on a GPU or under the Triton interpreter",
)
@pytest.mark.parametrize("vocab", [9, 1024, 1500, 2 * 1024 + 41])
def test_kernel_matches_reference(vocab: int) -> None:
    from pagecast.kernels.keyed_noise import keyed_exponential

    device = "cuda" if torch.cuda.is_available() else "cpu"
    got = keyed_exponential(KEYS.to(device), OFFSETS.to(device), vocab).cpu()
    expected = reference.keyed_exponential(KEYS, OFFSETS, vocab)
    # The Philox words are exact; only the logarithm may differ in its last bit on a GPU.
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=0)


def test_noise_is_a_function_of_key_offset_and_column_only() -> None:
    full = reference.keyed_exponential(KEYS, OFFSETS, 3000)
    # A narrower vocabulary is a prefix; a row alone gives the same values as in a batch.
    assert torch.equal(reference.keyed_exponential(KEYS, OFFSETS, 1100), full[:, :1100])
    assert torch.equal(reference.keyed_exponential(KEYS[2:3], OFFSETS[2:3], 3000), full[2:3])
    # Another offset (the next output position) or key gives other noise.
    assert not torch.equal(reference.keyed_exponential(KEYS, OFFSETS + 1, 3000), full)
    assert (full > 0).all() and torch.isfinite(full).all()


def test_noise_is_exponential() -> None:
    noise = reference.keyed_exponential(torch.arange(64), torch.zeros(64, dtype=torch.int64), 4096).flatten()
    # Exp(1): mean 1, variance 1, P(E > 1) = 1/e, and no correlation between neighbours.
    assert abs(float(noise.mean()) - 1) < 0.01
    assert abs(float(noise.var()) - 1) < 0.03
    assert abs(float((noise > 1).float().mean()) - np.exp(-1)) < 0.005
    assert abs(float(torch.corrcoef(torch.stack([noise[:-1], noise[1:]]))[0, 1])) < 0.01


# --- penalty rows --------------------------------------------------------------------------


def penalised(rid: str, prompt: list[int], **params) -> Request:  # type: ignore[no-untyped-def]
    return Request(rid, prompt, SamplingParams(repetition_penalty=1.2, **params))


def test_penalty_rows_follow_sampled_tokens_like_the_token_lists() -> None:
    vocab = 20
    state = PenaltyState()
    requests = [penalised("a", [1, 2, 2, 30]), penalised("b", [5]), penalised("c", [0], frequency_penalty=1.0)]
    rng = torch.Generator().manual_seed(0)
    for _ in range(6):
        seen, counts = state.inputs(requests, vocab, torch.device("cpu"))
        ref_seen, ref_counts = host_penalty_inputs(requests, vocab, torch.device("cpu"))
        assert torch.equal(seen, ref_seen) and torch.equal(counts, ref_counts)
        tokens = torch.randint(0, vocab, (3,), generator=rng)
        state.update(requests, tokens)
        for request, token in zip(requests, tokens.tolist()):
            request.append_output_token(token)
    assert state.num_rows == 8  # the first allocation


def test_penalty_rows_are_reused_and_reset() -> None:
    state = PenaltyState()
    cpu = torch.device("cpu")
    first = [penalised(f"r{i}", [i]) for i in range(8)]
    state.inputs(first, 10, cpu)
    state.update(first, torch.full((8,), 9))
    state.drop(["r0", "r1"])
    first[2].status = first[2].status.FINISHED_ABORTED  # finished, never dropped: reclaimed when rows run out
    fresh = [penalised(f"n{i}", [3]) for i in range(3)] + [penalised("r3", [4])]  # r3: an id reused by a new request
    seen, counts = state.inputs(fresh, 10, cpu)
    assert state.num_rows == 8
    assert counts.sum() == 0  # none inherits the old rows' counts
    assert seen[:3, 3].all() and seen[:3].sum() == 3 and seen[3, 4] and seen[3].sum() == 1
    more = [penalised(f"m{i}", [1]) for i in range(3)]
    state.inputs(more, 10, cpu)
    assert state.num_rows == 16  # grown, with the live rows kept
    seen, counts = state.inputs(first[4:], 10, cpu)
    assert (counts[:, 9] == 1).all() and counts.sum() == 4
