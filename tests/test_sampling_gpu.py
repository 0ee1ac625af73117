"""Sampling on a GPU (run with `pytest -m gpu` on the accelerator): the asynchronous engine
(penalties, logprobs, prompt logprobs, seeds and min_tokens computed on the device, CUDA graphs)
gives what the synchronous engine gives, and the keyed-noise kernel matches its reference at a
real vocabulary size."""

from __future__ import annotations

import pytest
import torch
from conftest import build_artifact
from test_async_scheduling import assert_same_outputs
from tiny_models import make_checkpoint

from pagecast.kernels import reference
from pagecast.runtime import LLM, SamplingParams

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

PROMPTS = [[1 + (i * 37 + j * 11) % 4000 for j in range(n)] for i, n in enumerate([5, 17, 33, 64, 100, 3, 250, 9])]


def test_keyed_noise_kernel_matches_reference_at_llama3_vocab() -> None:
    from pagecast.kernels.keyed_noise import keyed_exponential

    keys = torch.randint(-(2**63), 2**63 - 1, (512,), dtype=torch.int64)
    offsets = torch.randint(0, 2**32, (512,), dtype=torch.int64)
    got = keyed_exponential(keys.cuda(), offsets.cuda(), 128_256).cpu()
    expected = reference.keyed_exponential(keys[:8], offsets[:8], 128_256)
    torch.testing.assert_close(got[:8], expected, rtol=1e-6, atol=0)
    assert abs(float(got.mean()) - 1) < 1e-3


def test_async_engine_matches_sync_with_every_feature_on_gpu(tmp_path):  # type: ignore[no-untyped-def]
    ckpt = make_checkpoint(tmp_path / "ckpt", "llama", tokenizer=False)
    art = build_artifact(ckpt, tmp_path / "art", gpu="auto", dtype="float32", tune_budget_s=10.0)
    params = [
        SamplingParams(temperature=0.8, top_p=0.95, top_k=50, seed=i, max_tokens=24, ignore_eos=True,
                       logprobs=5 if i % 2 else None, prompt_logprobs=2 if i % 3 == 0 else None,
                       repetition_penalty=1.2 if i % 3 == 1 else 1.0, presence_penalty=0.5 if i % 4 == 0 else 0.0,
                       frequency_penalty=0.4 if i % 4 == 1 else 0.0, min_tokens=10 if i % 5 == 0 else 0,
                       stop_token_ids=[7] if i % 5 == 0 else [])
        for i in range(len(PROMPTS))
    ]
    outputs = []
    for mode in (False, True):
        llm = LLM(art, async_scheduling=mode, max_num_batched_tokens=512, max_num_seqs=8, kv_cache_memory="256MiB")
        assert llm.engine.runner.graphs is not None
        outputs.append(llm.generate(PROMPTS, params))
        assert llm.engine.block_pool.num_used_blocks == 0
        del llm
        torch.cuda.empty_cache()
    assert_same_outputs(outputs[1], outputs[0])



def _steps_waiting_for_the_device(engine) -> list[str]:  # type: ignore[no-untyped-def]
    """Run ``engine`` to the end under torch's sync debug mode and return the Python stack of
    every operation that made the host wait for the device (a pageable copy, ``.item()``, a
    data-dependent shape...). The engine's one intended wait, for the previous step's sampled
    tokens, is a CUDA event wait, which the debug mode does not count."""
    import traceback
    import warnings

    found: list[str] = []

    def record(message, category, filename, lineno, file=None, line=None):  # type: ignore[no-untyped-def]
        if "called a synchronizing CUDA operation" in str(message):
            found.append(f"{message}\n" + "".join(traceback.format_stack(limit=12)[:-1]))

    original = warnings.showwarning
    warnings.showwarning = record
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = record
            while engine.has_unfinished_requests():
                engine.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
        warnings.showwarning = original
    return found


@pytest.fixture(scope="module")
def bf16_artifact(tmp_path_factory):  # type: ignore[no-untyped-def]
    tmp = tmp_path_factory.mktemp("bf16")
    ckpt = make_checkpoint(tmp / "ckpt", "llama", tokenizer=False)
    return build_artifact(ckpt, tmp / "art", gpu="auto", dtype="bfloat16", tune_budget_s=10.0)


@pytest.mark.parametrize("setting", ["greedy", "sampling", "every_feature"])
def test_asynchronous_steps_never_wait_for_the_device(bf16_artifact, setting: str) -> None:  # type: ignore[no-untyped-def]
    # Issue 14: every request runs under asynchronous scheduling, so nothing in a step may block
    # the host on the device: one hidden wait (a host scalar copied to the GPU, an .item()) lets
    # the GPU run dry every step, which costs end-to-end throughput that the sampler's own
    # timing does not show.
    from pagecast.runtime.engine import LLMEngine

    if setting == "greedy":
        params = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True) for _ in PROMPTS]
    elif setting == "sampling":
        params = [SamplingParams(temperature=0.8, top_p=0.95, top_k=50, max_tokens=24, ignore_eos=True) for _ in PROMPTS]
    else:
        params = [
            SamplingParams(temperature=0.8 if i % 4 else 0, top_p=0.95 if i % 2 else 1.0, top_k=50 if i % 3 else -1,
                           min_p=0.05 if i % 5 == 2 else 0.0, seed=i if i % 2 else None, max_tokens=24,
                           ignore_eos=True, logprobs=5 if i % 2 else None, prompt_logprobs=2 if i % 3 == 0 else None,
                           repetition_penalty=1.2 if i % 3 == 1 else 1.0, presence_penalty=0.5 if i % 4 == 0 else 0.0,
                           frequency_penalty=0.4 if i % 4 == 1 else 0.0, min_tokens=10 if i % 5 == 0 else 0,
                           stop_token_ids=[7] if i % 5 == 0 else [])
            for i in range(len(PROMPTS))
        ]  # fmt: skip
    engine = LLMEngine(bf16_artifact, async_scheduling=True, max_num_batched_tokens=512, max_num_seqs=8, kv_cache_memory="256MiB")
    # A first batch warms up everything a first call does once (allocator, cuBLAS handles,
    # Triton kernels' first launch).
    for i, (prompt, p) in enumerate(zip(PROMPTS, params)):
        engine.add_request(f"warm-up-{i}", prompt, p)
    while engine.has_unfinished_requests():
        engine.step()
    for i, (prompt, p) in enumerate(zip(PROMPTS, params)):
        engine.add_request(str(i), prompt, p)
    waits = _steps_waiting_for_the_device(engine)
    distinct = list(dict.fromkeys(waits))
    assert not waits, f"{len(waits)} host waits on the device, {len(distinct)} distinct:\n" + "\n".join(distinct[:4])
    assert engine.block_pool.num_used_blocks == 0


# --- the fused sampling kernels (kernels/sampling.py) in bf16 at Llama-3's vocabulary -----------

LLAMA3_VOCAB = 128_256


def _bf16_logits(rows: int, seed: int) -> torch.Tensor:
    generator = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(rows, LLAMA3_VOCAB, device="cuda", generator=generator) * 3).to(torch.bfloat16)


@pytest.mark.parametrize("batch", ["mixed", "ties"])
def test_race_kernel_matches_reference_in_bf16(batch: str) -> None:
    # The kernel's noise is the keyed-noise kernel's, bit for bit, and its exp and divisions are
    # torch's: same tokens as the torch reference on the same cutoffs and keys. "ties": top_k 50
    # with top_p from 0.9 to 0.99999, so some rows' cutoff falls inside a bf16 tie group at the
    # 50th value that reaches past the candidates.
    from pagecast.kernels import sampling
    from pagecast.kernels.keyed_noise import keyed_exponential
    from pagecast.runtime import truncation

    rows = 512
    logits = _bf16_logits(rows, 0)
    if batch == "mixed":
        settings = [(0.8, 50, 0.95, 0.0), (1.0, 1, 1.0, 0.0), (0.7, 5, 1.0, 0.0), (1.0, 20, 0.9, 0.05),
                    (1.0, 0, 1.0, 0.1), (1.5, 1000, 0.99, 0.0), (1.0, 4, 0.5, 0.0), (0.5, 64, 0.999, 0.0)]  # fmt: skip
        per_row = [settings[i % len(settings)] for i in range(rows)]
    else:
        per_row = [(1.0, 50, 1 - 10 ** (-1 - 4 * i / rows), 0.0) for i in range(rows)]
    temperature = torch.tensor([s[0] for s in per_row], device="cuda")
    min_p = torch.tensor([s[3] for s in per_row], device="cuda")
    top_k = [s[1] if s[1] else LLAMA3_VOCAB for s in per_row]
    cutoffs = truncation.from_topk(logits, temperature, top_k, [s[2] for s in per_row])
    keys = torch.randint(-(2**63), 2**63 - 1, (rows,), device="cuda")
    offsets = torch.randint(0, 2**32, (rows,), device="cuda")
    got = sampling.race(logits, temperature, cutoffs.value, cutoffs.token, cutoffs.tie_drop, cutoffs.tie_counts,
                        cutoffs.row_max, min_p, keys, offsets)  # fmt: skip
    noise = keyed_exponential(keys, offsets, LLAMA3_VOCAB)
    expected = reference.race(logits, temperature, cutoffs.value, cutoffs.token, cutoffs.tie_drop, cutoffs.row_max,
                              min_p, noise)  # fmt: skip
    assert got.tolist() == expected.tolist()
    every = torch.ones(rows, dtype=torch.bool, device="cuda")
    counts = sampling.count_ties(logits, temperature, cutoffs.value, every).sum(dim=1)
    assert counts.tolist() == reference.count_ties(logits, temperature, cutoffs.value).squeeze(1).tolist()
    if batch == "ties":
        assert int((cutoffs.tie_drop > 0).sum()) > 0, "no row dropped part of a tie group past the candidates"


def test_sampler_kernel_path_matches_its_reference_in_bf16(monkeypatch: pytest.MonkeyPatch) -> None:
    import math

    from pagecast.runtime import truncation
    from pagecast.runtime.request import Request
    from pagecast.runtime.sampler import sample

    logits = _bf16_logits(96, 1)
    cases = [dict(temperature=0.0, logprobs=5), dict(temperature=0.8, top_p=0.95, top_k=50, logprobs=5),
             dict(temperature=1.0, min_p=0.05), dict(temperature=1.3, top_p=0.8), dict(temperature=0.7, top_k=5),
             dict(temperature=1.0, logprobs=0)]  # fmt: skip

    def run():  # type: ignore[no-untyped-def]
        requests = [Request(f"r{i}", [1, 2], SamplingParams(seed=i, **cases[i % len(cases)]), index=i) for i in range(96)]
        return sample(logits, requests)

    new = run()
    monkeypatch.setattr(truncation, "use_kernels", lambda t: False)
    ref = run()
    assert new.token_ids == ref.token_ids
    exact = torch.log_softmax(logits.float(), dim=-1).cpu()
    for row, (entry, ref_entry) in enumerate(zip(new.logprobs, ref.logprobs)):
        if entry is None:
            assert ref_entry is None
            continue
        assert {t: lp.rank for t, lp in entry.items()} == {t: lp.rank for t, lp in ref_entry.items()}
        for token, lp in entry.items():
            assert math.isclose(lp.logprob, float(exact[row, token]), abs_tol=1e-5)
        chosen = new.token_ids[row]
        assert entry[chosen].rank == int((exact[row] > exact[row, chosen]).sum()) + 1
        k = cases[row % len(cases)]["logprobs"]
        others = [t for t in entry if t != chosen]
        assert len(others) in (k, k - 1)
        if k:  # the others are the k best (equal values may swap places)
            assert all(exact[row, t] >= exact[row].topk(k).values[-1] for t in others)


@pytest.mark.parametrize("width", [2, 51, 256])
def test_top_candidates_are_topk_in_bf16(width: int) -> None:
    # 512 bf16 rows at Llama-3's vocabulary and the rows a threshold can get wrong (flat, masked,
    # signed zeros, plateaus: the exact search): torch.topk's values, at columns that hold them.
    from test_sampling_kernels import awkward_rows

    from pagecast.kernels import sampling

    logits = torch.cat([_bf16_logits(512, 2), awkward_rows(LLAMA3_VOCAB, torch.bfloat16).cuda()])
    assert sampling.top_candidates_apply(LLAMA3_VOCAB, width, sampling.CAPACITY)
    values, ids, block_max = sampling.top_candidates(logits, width)
    padded = torch.nn.functional.pad(logits.float(), (0, block_max.shape[1] * 128 - LLAMA3_VOCAB), value=float("-inf"))
    assert torch.equal(block_max, padded.reshape(logits.shape[0], -1, 128).amax(dim=2))
    assert torch.equal(values, logits.topk(width, dim=1).values.float())
    assert torch.equal(logits.gather(1, ids).float(), values)
    assert bool((ids.sort(dim=1).values.diff(dim=1) > 0).all()), "a column twice in a row"
