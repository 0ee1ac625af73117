"""Nothing a request can reach is compiled at serve time: every Triton kernel variant the sampler
launches while an engine serves is one that enginebuild compiled into the artifact.

On the H200 an 8B engine compiled four sampler kernels at every start (_block_max_kernel,
_collect_kernel, _race_kernel, _threshold_kernel): the build ran the sampler at a few made-up
vocabulary widths, and Triton specialises integer arguments on "divisible by 16", so Llama-3's
128,256-token vocabulary (1,002 blocks of 128 columns) was a variant the build never ran.

Without a GPU nothing compiles, so this checks the same thing through the key Triton compiles
by: each launch's arguments go through Triton's own binder (the function a JITFunction builds to
specialise its arguments; with a GPU, a new key is a compile). The engine serves every sampling
feature on a tiny artifact whose vocabulary is neither a multiple of 16 nor has a multiple of 16
blocks, with the sampler routed through the kernel launchers; the build's sampler pass
(builder/tune.py, compile_sampler_kernels) runs the same way; the served keys must be among the
built ones. The launches themselves are replaced by filling the kernels' outputs with ones (token 1, one
tie, a logsumexp of 0, ...): which kernels run, and with what arguments, depends only on the
requests, never on kernel results.
tests/test_startup_gpu.py::test_serving_every_sampling_feature_compiles_nothing checks on the
GPU, with Triton's compile listener, that a built artifact then serves with 0 compiles.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("triton")

from triton.backends.compiler import BaseBackend  # noqa: E402
from triton.runtime.jit import JITFunction, create_function_from_signature  # noqa: E402

from pagecast.kernels import sampling  # noqa: E402

VOCAB = 3001  # 3001 % 16 = 9; cdiv(3001, 128) = 24 blocks, 24 % 16 = 8: like Llama-3's 128,256 / 1,002

# Each sampler kernel's outputs (filled with ones instead of computed) by argument name.
OUTPUTS = {
    "_race_kernel": ("score_ptr", "token_ptr"),
    "_count_ties_kernel": ("counts_ptr",),
    "_logprob_stats_kernel": ("max_ptr", "sum_ptr", "greater_ptr"),
    "_block_max_kernel": ("out_ptr",),
    "_threshold_kernel": ("threshold_ptr",),
    "_collect_kernel": ("count_ptr", "values_ptr", "ids_ptr"),
    "_select_kernel": ("values_ptr", "ids_ptr"),
}


class _Recorded:
    """Stands in for one @triton.jit kernel: ``kernel[grid](*args, **kwargs)`` adds the key Triton
    would compile the launch under to ``keys`` and fills the kernel's outputs with ones."""

    def __init__(self, name: str, kernel: Any, keys: set[tuple]):
        fn = getattr(kernel, "fn", kernel)  # the Python function (interpreter mode wraps it)
        options = getattr(kernel, "kwargs", None)
        if options is None:  # a JITFunction: its own switches
            options = {"do_not_specialize": [p.name for p in kernel.params if p.do_not_specialize],
                       "do_not_specialize_on_alignment": [p.name for p in kernel.params
                                                          if p.do_not_specialize_on_alignment]}  # fmt: skip
        jit = JITFunction(
            fn,
            do_not_specialize=options.get("do_not_specialize"),
            do_not_specialize_on_alignment=options.get("do_not_specialize_on_alignment"),
        )
        self.binder = create_function_from_signature(jit.signature, jit.params, BaseBackend)
        self.names = [p.name for p in jit.params]
        self.name, self.keys = name, keys

    def __getitem__(self, grid: Any) -> Any:
        def launch(*args: Any, **kwargs: Any) -> None:
            bound, specialization, options = self.binder(*args, **kwargs)
            self.keys.add((self.name, tuple(map(tuple, specialization)), tuple(sorted(options.items()))))
            for name in OUTPUTS.get(self.name, ()):  # a kernel not listed: its outputs are left as they are
                bound[name].fill_(1)

        return launch


@pytest.fixture
def record_launches(monkeypatch: pytest.MonkeyPatch) -> set[tuple]:
    """The keys of every sampler-kernel launch from here on (CPU tensors routed to the kernels)."""
    from pagecast.runtime import sampler, truncation

    keys: set[tuple] = set()
    monkeypatch.setattr(truncation, "use_kernels", lambda t: True)
    monkeypatch.setattr(sampler.truncation, "use_kernels", lambda t: True)
    for name in OUTPUTS:
        monkeypatch.setattr(sampling, name, _Recorded(name, getattr(sampling, name), keys))
    return keys


def built_keys(keys: set[tuple], vocab: int, logits_stride: int, dtype: torch.dtype | None = None) -> set[tuple]:
    from pagecast.builder import tune

    keys.clear()
    tune.compile_sampler_kernels("cpu", vocab, logits_stride, dtype)
    built = set(keys)
    keys.clear()
    return built


def every_feature() -> list[tuple[list[int], Any]]:
    """(prompt, params) for every sampling feature a request can ask for."""
    from pagecast.runtime.sampling_params import SamplingParams

    def p(**kw: Any) -> Any:
        return SamplingParams(max_tokens=3, ignore_eos=True, **kw)

    settings = [
        p(temperature=0.0),
        p(temperature=0.0, logprobs=5),
        p(temperature=0.0, prompt_logprobs=2),
        p(temperature=0.0, prompt_logprobs=0, logprobs=0),
        p(temperature=0.7),
        p(temperature=0.8, top_k=7),
        p(temperature=0.8, top_k=20, top_p=0.9),
        p(temperature=0.8, top_k=1500),
        p(temperature=1.0, top_p=0.8),
        p(temperature=1.0, top_k=10, top_p=0.5, min_p=0.1, seed=7),
        p(temperature=1.0, min_p=0.2),
        p(temperature=1.0, seed=11, n=2),
        p(temperature=0.9, n=3, top_k=5, logprobs=1),
        p(temperature=1.0, presence_penalty=0.5),
        p(temperature=0.0, frequency_penalty=0.4, repetition_penalty=1.3, logprobs=2),
        p(temperature=0.5, min_tokens=2, stop_token_ids=[5]),
    ]
    return [([10 + i, 20 + i, 30 + i, 40 + i, 50 + i][: 2 + i % 4], s) for i, s in enumerate(settings)]


@pytest.fixture(scope="module")
def odd_vocab_artifact(tiny_artifact_factory) -> Path:  # type: ignore[no-untyped-def]
    return tiny_artifact_factory("llama", vocab_size=VOCAB)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_served_sampler_variants_are_among_the_built_ones(
    odd_vocab_artifact: Path, record_launches: set[tuple], async_scheduling: bool
) -> None:
    from pagecast.runtime import LLM

    built = built_keys(record_launches, VOCAB, VOCAB)
    llm = LLM(odd_vocab_artifact, async_scheduling=async_scheduling, max_num_seqs=32)
    requests = every_feature()
    # All at once (batches mixing the features), then each alone (one-row batches).
    llm.generate([prompt for prompt, _ in requests], [params for _, params in requests], use_tqdm=False)
    for prompt, params in requests:
        llm.generate([prompt], params, use_tqdm=False)
    served = set(record_launches)
    assert {key[0] for key in served} == set(OUTPUTS)  # every kernel was reached
    missing = served - built
    assert not missing, f"{len(missing)} served variants the build does not compile, e.g. {sorted(missing)[0]}"


def test_the_build_covers_a_padded_vocabulary(record_launches: set[tuple]) -> None:
    """A tensor-parallel LM head pads the vocabulary to a multiple of the degree and the sampler
    reads [rows, vocab] views of the gathered logits: their row stride is the padded width. The
    build's sampler pass takes it from the plan (model_shapes) and covers it; the variants for
    another vocabulary are different ones, so compiling a fixed list of widths cannot do."""
    from pagecast.runtime.request import Request
    from pagecast.runtime.sampler import sample
    from pagecast.runtime.sampling_params import SamplingParams

    built = built_keys(record_launches, VOCAB, VOCAB + 1)  # tp=2: 1501 rows per rank
    logits = torch.randn(2, VOCAB + 1)[:, :VOCAB]
    params = SamplingParams(temperature=0.8, top_k=9, top_p=0.9, logprobs=1)
    sample(logits, [Request("a", [1, 2], params), Request("b", [1, 2], params)])
    served = set(record_launches)
    assert served and served <= built
    assert not served <= built_keys(record_launches, 4096, 4096)


def test_the_build_covers_logits_in_the_models_dtype(record_launches: set[tuple]) -> None:
    """A bf16 model's LM head hands the sampler bf16 logits (ops.lm_head widen=False): a pointer
    of another dtype is another variant, so the build's sampler pass runs in the model's dtype as
    well as in fp32 (the masked and penalised copies)."""
    from pagecast.runtime.request import Request
    from pagecast.runtime.sampler import prompt_logprob_tensors, sample
    from pagecast.runtime.sampling_params import SamplingParams

    built = built_keys(record_launches, VOCAB, VOCAB, torch.bfloat16)
    logits = (torch.randn(3, VOCAB) * 3).to(torch.bfloat16)
    sampled = SamplingParams(temperature=0.8, top_k=9, top_p=0.9, logprobs=1)
    penalised = SamplingParams(temperature=0.7, presence_penalty=0.5, logprobs=2)
    greedy = SamplingParams(temperature=0.0, logprobs=3)
    sample(logits, [Request("a", [1, 2], sampled), Request("b", [1, 2], penalised), Request("c", [1, 2], greedy)])
    prompt_logprob_tensors(logits[1:3], torch.zeros(2, dtype=torch.int64), 2)
    served = set(record_launches)
    assert served and served <= built
    fp32_only = built_keys(record_launches, VOCAB, VOCAB)
    assert not served <= fp32_only
