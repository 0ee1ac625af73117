"""Speculative decoding (runtime/speculative.py) on the CPU: lossless against the same engine
without it (greedy token for token, seeded sampling token for token, unseeded sampling in
distribution), with stop strings, preemption, logprobs, penalties and grammars, and served
through the OpenAI SDK with its counters in /metrics."""

from __future__ import annotations

import collections
from pathlib import Path

import pytest
import torch

from pagecast.runtime.llm import LLM
from pagecast.runtime.model_runner import ModelRunner
from pagecast.runtime.sampling_params import SamplingParams, StructuredOutput
from pagecast.runtime.speculative import ReplayProposer, SpeculativeConfig, ngram_lookup

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}

# Prompts whose greedy continuations repeat (the tiny random model loops quickly), so prompt
# lookup finds matches and drafts are accepted and rejected both.
PROMPTS = [
    [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7],
    [11, 12, 13, 11, 12, 13, 11, 12],
    list(range(20, 40)),
    [300, 301, 302, 303, 300, 301],
]


def tokens(outputs) -> list[list[int]]:  # type: ignore[no-untyped-def]
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def base(tiny_llama_artifact: Path) -> LLM:
    return LLM(str(tiny_llama_artifact))


@pytest.fixture(scope="module")
def ngram(tiny_llama_artifact: Path) -> LLM:
    return LLM(str(tiny_llama_artifact), speculative_config=NGRAM)


# -- the proposers and the config ---------------------------------------------------------------


def test_ngram_lookup_takes_the_longest_suffix_and_its_latest_earlier_occurrence() -> None:
    assert ngram_lookup([1, 2, 3, 4, 1, 2], 1, 3, 3) == [3, 4, 1]
    # [1, 2] occurred at 0 and 3: the latest one's continuation wins.
    assert ngram_lookup([1, 2, 9, 1, 2, 7, 1, 2], 2, 2, 3) == [7, 1, 2]
    # The 3-gram [8, 1, 2] beats the more recent 2-gram match.
    assert ngram_lookup([8, 1, 2, 5, 1, 2, 6, 8, 1, 2], 2, 3, 2) == [5, 1]
    assert ngram_lookup([1, 2, 3, 4], 1, 3, 3) == []  # nothing repeats
    assert ngram_lookup([4, 4], 2, 3, 3) == []  # shorter than prompt_lookup_min + 1
    assert ngram_lookup([7, 7, 7], 1, 1, 4) == [7]  # continuation cut at the sequence's end


@pytest.mark.parametrize(
    "config, message",
    [
        ({"method": "medusa"}, "not one of ngram, draft_model, eagle3"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"method": "ngram", "prompt_lookup_min": 3, "prompt_lookup_max": 2}, "prompt_lookup_min"),
        ({"method": "draft_model"}, "needs model"),
        ({"method": "ngram", "k": 4}, "unknown key(s) k"),
        ({"num_speculative_tokens": 4}, "needs a method"),
        ("{not json", "not valid JSON"),
    ],
)
def test_a_bad_config_says_what_is_wrong(tiny_llama_artifact: Path, config, message: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        SpeculativeConfig.parse(config)
    with pytest.raises(ValueError, match="num_speculative_tokens|method|prompt_lookup|model|key|JSON"):
        LLM(str(tiny_llama_artifact), speculative_config=config)


# -- greedy: token for token --------------------------------------------------------------------


def test_greedy_ngram_equals_no_speculation_and_accepts_drafts(base: LLM, ngram: LLM) -> None:
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, logprobs=2)
    ref = base.generate(PROMPTS, params)
    before = ngram.engine.core.spec_stats.num_accepted_tokens
    out = ngram.generate(PROMPTS, params)
    assert tokens(out) == tokens(ref)
    stats = ngram.engine.core.spec_stats
    assert stats.num_accepted_tokens > before, "prompt lookup found nothing to accept: the test proves nothing"
    for o, r in zip(out, ref):
        # The target's logprobs, one entry per token, as without speculation.
        lp, rp = o.outputs[0].logprobs, r.outputs[0].logprobs
        assert len(lp) == len(rp) == 40
        for a, b in zip(lp, rp):
            assert a.keys() == b.keys()
            for t in a:
                assert a[t].logprob == pytest.approx(b[t].logprob, abs=2e-4)
        assert o.outputs[0].cumulative_logprob == pytest.approx(r.outputs[0].cumulative_logprob, abs=5e-3)
        assert o.outputs[0].finish_reason == "length"


def test_stop_strings_and_stop_tokens_inside_accepted_drafts_end_the_output_there(base: LLM, ngram: LLM) -> None:
    tokenizer = base.engine.tokenizer
    free = base.generate(PROMPTS, SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))
    for prompt, full in zip(PROMPTS, tokens(free)):
        # A stop token and a stop string from the middle of the greedy output: the output ends
        # where it would without speculation, though the step that finds it got several tokens.
        stop_id = full[17]
        text = tokenizer.decode(full[10:14])
        for params in (
            SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, stop_token_ids=[stop_id]),
            SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, stop=[text]),
            SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, stop=[text], include_stop_str_in_output=True),
        ):
            (r,) = base.generate([prompt], params)
            (o,) = ngram.generate([prompt], params)
            assert o.outputs[0].token_ids == r.outputs[0].token_ids
            assert o.outputs[0].text == r.outputs[0].text
            assert (o.outputs[0].finish_reason, o.outputs[0].stop_reason) == (
                r.outputs[0].finish_reason,
                r.outputs[0].stop_reason,
            )


def test_max_tokens_is_never_exceeded(base: LLM, ngram: LLM) -> None:
    for max_tokens in (1, 2, 3, 5, 6):
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        assert tokens(ngram.generate(PROMPTS, params)) == tokens(base.generate(PROMPTS, params))


def test_greedy_with_preemption_equals_no_speculation(tiny_llama_artifact: Path, base: LLM) -> None:
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    prompts = [p * 3 for p in PROMPTS] * 3
    ref = base.generate(prompts, params)
    # 12 blocks for 12 sequences of ~90 tokens (6 blocks each): requests are preempted and recomputed.
    block = base.engine.core.artifact.memory_plan["bytes_per_block"]
    tight = LLM(str(tiny_llama_artifact), speculative_config=NGRAM, kv_cache_memory=12 * block, max_model_len=128)
    out = tight.generate(prompts, params)
    assert tight.engine.core.scheduler.num_preemptions > 0
    assert tight.engine.core.spec_stats.num_accepted_tokens > 0
    assert tokens(out) == tokens(ref)


def test_n_and_prefix_caching_with_speculation(base: LLM, ngram: LLM) -> None:
    params = SamplingParams(n=3, max_tokens=20, temperature=0.0, ignore_eos=True)
    ref = base.generate(PROMPTS[:2] * 2, params)
    out = ngram.generate(PROMPTS[:2] * 2, params)
    assert [[c.token_ids for c in o.outputs] for o in out] == [[c.token_ids for c in r.outputs] for r in ref]


# -- sampling -----------------------------------------------------------------------------------


def test_seeded_sampling_gives_the_same_tokens_with_and_without_speculation(base: LLM, ngram: LLM) -> None:
    """The target samples each position with the noise of that output position, so a seeded
    request's tokens do not depend on how many drafts each step verified."""
    params = [
        SamplingParams(max_tokens=32, temperature=0.3, top_k=8, seed=11, ignore_eos=True),
        SamplingParams(max_tokens=32, temperature=0.4, top_p=0.9, seed=12, ignore_eos=True, presence_penalty=0.1),
        SamplingParams(max_tokens=32, temperature=0.3, min_p=0.1, seed=13, ignore_eos=True, repetition_penalty=1.05),
        SamplingParams(max_tokens=32, temperature=0.2, seed=14, ignore_eos=True, frequency_penalty=0.1, min_tokens=8),
    ]
    ref = base.generate(PROMPTS, params)
    before = ngram.engine.core.spec_stats.num_accepted_tokens
    out = ngram.generate(PROMPTS, params)
    assert tokens(out) == tokens(ref)
    assert ngram.engine.core.spec_stats.num_accepted_tokens > before


@pytest.fixture(scope="module")
def small_vocab_artifact(tiny_artifact_factory) -> Path:  # type: ignore[no-untyped-def]
    return tiny_artifact_factory("llama", vocab_size=64, tokenizer=False)


def _sample_counts(llm: LLM, prompt: list[int], n: int, params: SamplingParams) -> collections.Counter:
    torch.manual_seed(1234)
    counts: collections.Counter = collections.Counter()
    for out in llm.generate([prompt] * n, params, use_tqdm=False):
        counts[tuple(out.outputs[0].token_ids)] += 1
    return counts


def _chi_square_p(a: collections.Counter, b: collections.Counter) -> float:
    """Two-sample chi-square test of homogeneity (categories seen in either sample); the
    p-value from the regularised upper incomplete gamma function."""
    keys = sorted(set(a) | set(b))
    na, nb = sum(a.values()), sum(b.values())
    stat = 0.0
    for k in keys:
        total = a[k] + b[k]
        ea, eb = total * na / (na + nb), total * nb / (na + nb)
        stat += (a[k] - ea) ** 2 / ea + (b[k] - eb) ** 2 / eb
    df = max(len(keys) - 1, 1)
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(stat / 2, dtype=torch.float64)))


def test_sampled_tokens_keep_the_targets_distribution(small_vocab_artifact: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Unseeded sampling over a small vocabulary: the distribution of (token 1, 2, 3) with drafts
    (the target's greedy continuation, so most are plausible and many accepted) matches the one
    without, by a chi-square test; the same test rejects a verifier that skips the correction
    (accepting every draft)."""
    prompt = [3, 9, 27, 17]
    params = SamplingParams(max_tokens=3, temperature=1.0, top_k=4, ignore_eos=True)
    base = LLM(str(small_vocab_artifact), max_num_seqs=256)
    greedy = base.generate([prompt], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))[0].outputs[0].token_ids
    replay = {
        "method": "replay",
        "num_speculative_tokens": 2,
        "disable_by_batch_size": 4096,
        "replay": {"continuations": {ReplayProposer.key(prompt): greedy}, "p": 1.0},
    }
    spec = LLM(str(small_vocab_artifact), max_num_seqs=256, speculative_config=replay)
    n = 2000
    without = _sample_counts(base, prompt, n, params)
    with_spec = _sample_counts(spec, prompt, n, params)
    stats = spec.engine.core.spec_stats
    assert stats.num_draft_tokens >= n and 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert _chi_square_p(without, with_spec) > 1e-4, (without.most_common(5), with_spec.most_common(5))

    def accept_every_draft(self, logits, spec_rows, result):  # type: ignore[no-untyped-def]
        original(self, logits, spec_rows, result)
        for req, _, drafts in spec_rows:
            result.spec_tokens[req.request_id] = list(drafts) + result.spec_tokens[req.request_id][-1:]

    original = ModelRunner._verify
    monkeypatch.setattr(ModelRunner, "_verify", accept_every_draft)
    broken = _sample_counts(spec, prompt, n, params)
    assert _chi_square_p(without, broken) < 1e-6


# -- the drafts' quality only changes the speed ---------------------------------------------------


def test_replay_drafts_all_right_or_all_wrong_give_the_same_tokens(tiny_llama_artifact: Path, base: LLM) -> None:
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    ref = tokens(base.generate(PROMPTS, params))
    continuations = {ReplayProposer.key(p): t for p, t in zip(PROMPTS, ref)}
    for p, expect_rate in ((1.0, 1.0), (0.0, 0.0)):
        config = {"method": "replay", "num_speculative_tokens": 3, "replay": {"continuations": continuations, "p": p}}
        llm = LLM(str(tiny_llama_artifact), speculative_config=config)
        assert tokens(llm.generate(PROMPTS, params)) == ref
        stats = llm.engine.core.spec_stats
        assert stats.num_accepted_tokens / stats.num_draft_tokens == pytest.approx(expect_rate)
        if p == 0.0:
            # Rejected outright again and again: those requests pause, so far fewer drafts were
            # verified than one per token.
            assert stats.num_verified < 4 * 24 / 2
        else:
            assert stats.num_emitted_tokens / stats.num_verified > 3.0


def test_a_grammar_constrains_every_draft_position(base: LLM, ngram: LLM) -> None:
    prompts = [[5, 6, 7, 5, 6, 7, 5], [40, 41, 40, 41]]
    for so in (
        StructuredOutput(type="choice", choice=("alpha beta alpha beta alpha", "gamma")),
        StructuredOutput(type="regex", regex="(ab){3,12}"),
    ):
        params = SamplingParams(max_tokens=24, temperature=0.0, structured_output=so)
        ref = base.generate(prompts, params)
        before = ngram.engine.core.spec_stats.num_draft_tokens
        out = ngram.generate(prompts, params)
        assert [o.outputs[0].text for o in out] == [r.outputs[0].text for r in ref]
        assert tokens(out) == tokens(ref)
        assert ngram.engine.core.spec_stats.num_draft_tokens > before, "no draft was verified under the grammar"


# -- served --------------------------------------------------------------------------------------


def test_engine_serve_with_speculation_through_the_openai_sdk(tiny_llama_artifact: Path, base: LLM, tmp_path: Path) -> None:
    """`engine-serve --speculative-config JSON` (the command, in its own process): the OpenAI SDK
    gets the output it gets without speculation, streamed and not, and /metrics shows drafts,
    acceptances and the acceptance rate."""
    import json

    openai = pytest.importorskip("openai")
    from server_support import metric, metric_samples, start_engine_serve

    prompt = "one two three one two three one two three one two"
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    expected = base.generate([prompt], params)[0].outputs[0].text
    proc, url = start_engine_serve(
        [str(tiny_llama_artifact), "--speculative-config", json.dumps(NGRAM), "--kv-cache-memory", "16MiB"],
        tmp_path / "serve.log",
    )
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x")
        model = client.models.list().data[0].id
        kwargs = {"model": model, "prompt": prompt, "max_tokens": 32, "temperature": 0.0, "extra_body": {"ignore_eos": True}}
        done = client.completions.create(**kwargs)
        assert done.choices[0].text == expected
        assert done.usage.completion_tokens == 32
        streamed = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kwargs) if c.choices)
        assert streamed == expected
        # A stop string inside a step's accepted drafts: the text ends before it, as without drafts.
        full = base.generate([prompt], params)[0].outputs[0]
        stop = base.engine.tokenizer.decode(full.token_ids[12:15])
        (want,) = base.generate([prompt], SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True, stop=[stop]))
        stopped = client.completions.create(**kwargs, stop=[stop])
        assert (stopped.choices[0].text, stopped.choices[0].finish_reason) == (want.outputs[0].text, "stop")
        assert stopped.usage.completion_tokens == len(want.outputs[0].token_ids)
        chunks = list(client.completions.create(stream=True, **kwargs, stop=[stop]))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == want.outputs[0].text
        samples = metric_samples(url)
        drafts = metric(samples, "pagecast_spec_decode_num_draft_tokens_total", model_name=model)
        accepted = metric(samples, "pagecast_spec_decode_num_accepted_tokens_total", model_name=model)
        assert drafts > 0 and accepted > 0
        assert metric(samples, "pagecast_spec_decode_acceptance_rate", model_name=model) == pytest.approx(accepted / drafts)
        assert metric(samples, "pagecast_spec_decode_mean_accepted_length", model_name=model) > 1.0
    finally:
        proc.terminate()
        proc.wait(30)


def test_engine_serve_refuses_a_bad_speculative_config_before_loading(tiny_llama_artifact: Path) -> None:
    import subprocess

    from server_support import engine_serve_command

    proc = subprocess.run(
        [*engine_serve_command(), str(tiny_llama_artifact), "--speculative-config", '{"method": "ngram", "k": 4}'],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert proc.returncode != 0
    assert "--speculative-config" in proc.stderr and "unknown key(s) k" in proc.stderr


def test_draft_masks_follow_the_grammar_through_the_drafts_and_leave_the_matcher_as_it_was(ngram: LLM) -> None:
    """Position j is masked as if drafts 0..j-1 were accepted; a draft the grammar refuses ends
    the masking there (its position cannot produce it, so verification stops); afterwards the
    matcher is where it was (the drafts are not accepted until verified)."""
    import xgrammar

    from pagecast.runtime.request import Request

    core = ngram.engine.core
    tokenizer = ngram.engine.tokenizer
    so = StructuredOutput(type="regex", regex="(ab){1,3}c")
    request = Request("masked", [1, 2, 3], SamplingParams(max_tokens=8, structured_output=so))
    core.grammar.add([request], core.grammar.collect(so.key, core.grammar.prepare(so.key)))
    try:
        ab, c = tokenizer.convert_tokens_to_ids(["ab", "c"])
        assert None not in (ab, c)

        def allowed(mask, row: int, token: int) -> bool:  # type: ignore[no-untyped-def]
            return bool((int(mask[row, token // 32]) >> (token % 32)) & 1)

        rows, mask = core.grammar.draft_bitmask([(request, 0, [ab, ab, ab, ab])])
        assert rows == [0, 1, 2, 3, 4]
        assert allowed(mask, 0, ab) and not allowed(mask, 0, c)  # "c" needs an "ab" first
        assert allowed(mask, 1, ab) and allowed(mask, 1, c)
        assert not allowed(mask, 3, ab) and allowed(mask, 3, c)  # three "ab" at most
        assert bool((mask[4] == -1).all())  # the 4th "ab" was refused: nothing masked after it
        # The matcher has not moved: a fresh mask of the request's next token is row 0's.
        state = core.grammar.matchers["masked"]
        fresh = xgrammar.allocate_token_bitmask(1, core.vocab_size)
        state.matcher.fill_next_token_bitmask(fresh, 0)
        assert torch.equal(fresh[0], mask[0])
    finally:
        core.grammar.drop(["masked"])


def test_draft_masks_leave_the_drafts_free_up_to_the_token_that_starts_the_constraint(ngram: LLM) -> None:
    """structured_output_after: the positions up to and including the starting token's draft are
    unmasked, the grammar masks the ones after it from its start; nothing is committed (the
    request still waits for that token until it is verified)."""
    from pagecast.runtime.request import Request

    core = ngram.engine.core
    ab, c, x = ngram.engine.tokenizer.convert_tokens_to_ids(["ab", "c", "x"])
    so = StructuredOutput(type="regex", regex="(ab){1,3}c")
    params = SamplingParams(max_tokens=8, structured_output=so, structured_output_after=x)
    request = Request("later", [1, 2, 3], params)
    core.grammar.add([request], core.grammar.collect(so.key, core.grammar.prepare(so.key)))
    try:

        def allowed(mask, row: int, token: int) -> bool:  # type: ignore[no-untyped-def]
            return bool((int(mask[row, token // 32]) >> (token % 32)) & 1)

        rows, mask = core.grammar.draft_bitmask([(request, 0, [c, x, ab, c])])
        assert rows == [0, 1, 2, 3, 4]
        assert bool((mask[0] == -1).all()) and bool((mask[1] == -1).all())  # before and at "x": free
        assert allowed(mask, 2, ab) and not allowed(mask, 2, c)  # the grammar from its start
        assert allowed(mask, 3, ab) and allowed(mask, 3, c)
        assert not allowed(mask, 4, ab)  # "abc" is complete
        assert core.grammar.matchers["later"].waiting_for == x  # the drafts are not verified yet
        with torch.inference_mode():  # as the runner calls it (its buffer may be an inference tensor)
            rows, mask = core.grammar.bitmask([request])
        assert rows == [0] and bool((mask[0] == -1).all())
    finally:
        core.grammar.drop(["later"])
