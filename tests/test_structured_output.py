"""Structured output (``response_format`` / ``SamplingParams.structured_output``) on a tiny random
model: whatever the model would say, the constrained output parses and validates, in both
scheduling modes, and unconstrained neighbours are unchanged."""

from __future__ import annotations

import dataclasses
import json
from typing import Literal

import pytest
from pydantic import BaseModel, Field

from pagecast.runtime.llm import LLM
from pagecast.runtime.sampling_params import SamplingParams, StructuredOutput

PROMPTS = ["The weather today is", "Once upon a time", "def main():", "1, 2, 3,"]


class Address(BaseModel):
    zip_code: int = Field(ge=10000, le=99999)
    country: Literal["FR", "DE", "US"]


class Person(BaseModel):
    """Nested object, array, enum, integer with bounds, boolean: no free strings, so a random model
    cannot run out of tokens inside one, and the grammar must complete within max_tokens."""

    age: int = Field(ge=0, le=120)
    active: bool
    role: Literal["admin", "user", "guest"]
    address: Address
    scores: list[Literal[1, 2, 3]] = Field(max_length=3)


PERSON = StructuredOutput("json_schema", Person.model_json_schema())


def test_json_schema_outputs_validate_in_both_scheduling_modes(tiny_llama_artifact):  # type: ignore[no-untyped-def]
    # Sampled (seeded, so both modes draw the same tokens); greedy ones are in the next test.
    params = SamplingParams(max_tokens=200, temperature=1.0, seed=3, structured_output=PERSON)
    outputs = {}
    for async_scheduling in (False, True):
        llm = LLM(tiny_llama_artifact, async_scheduling=async_scheduling)
        outs = llm.generate(PROMPTS[:1], params)
        for out in outs:
            choice = out.outputs[0]
            assert choice.finish_reason == "stop", choice.text
            Person.model_validate_json(choice.text)  # raises when it does not validate
        outputs[async_scheduling] = [o.outputs[0].token_ids for o in outs]
        # The same schema again (an equal dict, keys in another order): compiled once per engine.
        again = StructuredOutput("json_schema", dict(reversed(list(Person.model_json_schema().items()))))
        llm.generate(PROMPTS[1], SamplingParams(max_tokens=2, structured_output=again))
        assert llm.engine.core.grammar.num_compiled == 1
    assert outputs[True] == outputs[False]


def test_an_unconstrained_neighbour_gets_the_same_greedy_tokens(tiny_llama_artifact):  # type: ignore[no-untyped-def]
    plain = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    constrained = SamplingParams(max_tokens=200, temperature=0.0, structured_output=PERSON)
    for async_scheduling in (False, True):
        llm = LLM(tiny_llama_artifact, async_scheduling=async_scheduling)
        alone = llm.generate([PROMPTS[0], PROMPTS[2]], plain)
        mixed = llm.generate(PROMPTS, [plain, constrained, plain, constrained])
        assert [o.outputs[0].token_ids for o in alone] == [mixed[0].outputs[0].token_ids, mixed[2].outputs[0].token_ids]
        for out in (mixed[1], mixed[3]):
            Person.model_validate_json(out.outputs[0].text)
        assert not llm.engine.core.grammar.matchers  # every finished request's matcher is gone


def test_the_constraint_can_start_after_a_token(tiny_llama_artifact):  # type: ignore[no-untyped-def]
    """structured_output_after (a thinking model's end-of-thinking token): the output runs free,
    as unconstrained greedy decoding does, up to and including that token; the grammar governs
    what follows, in both scheduling modes."""
    import re

    regex = StructuredOutput("regex", regex="[A-Z]{2,6}")
    plain = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    for async_scheduling in (False, True):
        llm = LLM(tiny_llama_artifact, async_scheduling=async_scheduling)
        free = llm.generate(PROMPTS[0], plain, use_tqdm=False)[0].outputs[0].token_ids
        at = next(j for j in range(2, len(free)) if free[j] not in free[:j])  # a token first seen at j >= 2
        after = SamplingParams(max_tokens=24, temperature=0.0, structured_output=regex, structured_output_after=free[at])
        out = llm.generate(PROMPTS[0], after, use_tqdm=False)[0].outputs[0]
        assert out.token_ids[: at + 1] == free[: at + 1]  # unmasked through the starting token
        answer = llm.tokenizer.decode(out.token_ids[at + 1 :], skip_special_tokens=True)
        assert re.fullmatch("[A-Z]{2,6}", answer), answer
        assert out.finish_reason == "stop"
        whole = llm.generate(PROMPTS[0], dataclasses.replace(after, structured_output_after=None), use_tqdm=False)
        assert re.fullmatch("[A-Z]{2,6}", whole[0].outputs[0].text)  # without it: constrained from the start
        assert not llm.engine.core.grammar.matchers


def test_json_object_mode_gives_an_object(tiny_llama_artifact):  # type: ignore[no-untyped-def]
    llm = LLM(tiny_llama_artifact, async_scheduling=True)
    params = SamplingParams(max_tokens=64, temperature=0.0, n=2, structured_output=StructuredOutput("json_object"))
    out = llm.generate(PROMPTS[1], params)
    for choice in out[0].outputs:
        assert choice.text.startswith("{")
        # Free keys and values: a random model may still be inside a string after 64 tokens.
        if choice.finish_reason == "stop":
            assert isinstance(json.loads(choice.text), dict)
        else:
            assert choice.finish_reason == "length"


@pytest.mark.parametrize(
    "schema, reason",
    [
        ({"type": "strin"}, "Unsupported type"),
        ({"type": "integer", "minimum": 5, "maximum": 2}, "minimum greater than maximum"),
        ({"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}, "nowhere"),
    ],
)
def test_a_schema_the_library_cannot_compile_is_refused(schema, reason):  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match=reason) as info:
        StructuredOutput("json_schema", schema)
    assert str(info.value).startswith("structured_output ")


def test_options_that_would_outrun_the_grammar_are_refused():  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match="ignore_eos"):
        SamplingParams(ignore_eos=True, structured_output=StructuredOutput())
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=2, structured_output=StructuredOutput())
    with pytest.raises(ValueError, match="type"):
        StructuredOutput("xml")
    with pytest.raises(ValueError, match="regex must be"):
        StructuredOutput("regex")
    with pytest.raises(ValueError, match="takes no json_schema"):
        StructuredOutput("choice", {"type": "object"}, choice=["a"])
    with pytest.raises(ValueError, match="regex cannot be compiled: .*Unclosed"):
        StructuredOutput("regex", regex="a[")
    with pytest.raises(ValueError, match="grammar cannot be compiled: .*not defined"):
        StructuredOutput("grammar", grammar="root ::= missing")
    assert StructuredOutput("choice", choice=["a", "b"]).key == ("choice", '["a", "b"]')
    with pytest.raises(ValueError, match="structured_output_after must be a token id, with a structured_output"):
        SamplingParams(structured_output_after=5)
    with pytest.raises(ValueError, match="structured_output_after must be a token id"):
        SamplingParams(structured_output=StructuredOutput(), structured_output_after=-1)


def test_constrained_requests_survive_preemption(tiny_llama_artifact):  # type: ignore[no-untyped-def]
    # A preempted request recomputes its tokens; its matcher keeps the tokens it has accepted and
    # must carry on as if nothing happened (seeded noise: the same tokens as without preemption).
    from test_paging import llm_block_bytes

    flags = StructuredOutput(
        "json_schema",
        {"type": "object", "properties": {"flags": {"type": "array", "items": {"type": "boolean"},
                                                   "minItems": 12, "maxItems": 12}}, "required": ["flags"]},
    )
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=60, structured_output=flags) for i in range(4)]
    options = {"kv_cache_memory": 10 * llm_block_bytes(tiny_llama_artifact), "max_model_len": 80, "enable_prefix_caching": False}
    alone = LLM(tiny_llama_artifact, async_scheduling=False).generate(PROMPTS, params)
    llm = LLM(tiny_llama_artifact, async_scheduling=True, **options)  # the harder mode: pending tokens
    got = llm.generate(PROMPTS, params)
    assert llm.engine.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in alone]
    for out in got:
        assert out.outputs[0].finish_reason == "stop"
        assert len(json.loads(out.outputs[0].text)["flags"]) == 12


def test_an_aborted_constrained_request_leaves_no_matcher(tiny_llama_artifact):  # type: ignore[no-untyped-def]
    from pagecast.runtime.engine import LLMEngine

    engine = LLMEngine(tiny_llama_artifact, async_scheduling=True, kv_cache_memory="16MiB")
    engine.add_request("a", PROMPTS[0], SamplingParams(max_tokens=50, n=2, structured_output=PERSON))
    while not engine.core.grammar.matchers:  # its grammar compiles in the background
        engine.step()
    for _ in range(3):
        engine.step()
    assert len(engine.core.grammar.matchers) == 2
    engine.abort_request(["a"])
    while engine.has_unfinished_requests():
        engine.step()
    assert not engine.core.grammar.matchers and engine.block_pool.num_used_blocks == 0


@pytest.mark.parametrize(
    "string_schema", [{"type": "string", "maxLength": 12}, {"type": "string", "minLength": 1}, {"type": "string"}]
)
def test_strings_never_admit_a_raw_control_character(string_schema):  # type: ignore[no-untyped-def]
    # JSON strings may not hold U+0000-U+001F unescaped: json.loads refuses them. xgrammar's
    # strings with length bounds let them through (a random SmolLM2-shaped model wrote a
    # vertical tab into a "maxLength": 12 name on the GPU); every token whose text holds one
    # must be ruled out inside a string, while ordinary text stays allowed.
    import xgrammar
    from tiny_models import tokenizer_dir
    from transformers import AutoTokenizer

    from pagecast.runtime.structured_output import json_schema_ebnf

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir())
    vocab = len(tokenizer)
    info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab)
    schema = {"type": "object", "properties": {"name": string_schema}, "required": ["name"]}
    compiled = xgrammar.GrammarCompiler(info).compile_grammar(json_schema_ebnf(json.dumps(schema)))
    matcher = xgrammar.GrammarMatcher(compiled)
    assert matcher.accept_string('{"name": "')
    bitmask = xgrammar.allocate_token_bitmask(1, vocab)
    matcher.fill_next_token_bitmask(bitmask)
    words = bitmask[0].tolist()

    def allowed(token: int) -> bool:
        return bool((words[token // 32] >> (token % 32)) & 1)

    special = set(tokenizer.all_special_ids)
    control = [t for t in range(vocab) if t not in special and any(ord(c) < 0x20 for c in tokenizer.decode([t]))]
    assert control, "the tokenizer has tokens with control characters"
    assert [t for t in control if allowed(t)] == []
    assert allowed(tokenizer.convert_tokens_to_ids("hello"))


@pytest.fixture(scope="module")
def smol_tokenizer():  # type: ignore[no-untyped-def]
    from tiny_models import tokenizer_dir
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tokenizer_dir()))


def _allowed(bitmask_row, vocab: int) -> list[int]:  # type: ignore[no-untyped-def]
    import torch

    bits = (bitmask_row.unsqueeze(1) >> torch.arange(32, dtype=torch.int32)) & 1
    return [t for t in bits.flatten().nonzero().flatten().tolist() if t < vocab]


def test_batched_masks_are_the_serial_masks(smol_tokenizer):  # type: ignore[no-untyped-def]
    """The bitmask filled for a whole step at once (xgrammar's BatchGrammarMatcher, on several
    threads) is, row for row, what each matcher's own fill_next_token_bitmask gives: matchers of
    different grammars at different points, one that has ended (all tokens allowed: its row is
    never used), one whose last token is still pending, and an unconstrained row in between."""
    import random

    import torch
    import xgrammar

    from pagecast.runtime.request import Request
    from pagecast.runtime.structured_output import GrammarState

    vocab, eos = 49152, 2
    grammar = GrammarState(lambda: smol_tokenizer, vocab, frozenset({eos}), fill_threads=3)
    constraints = [
        PERSON,
        StructuredOutput("json_schema", {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}),
        StructuredOutput("regex", regex="[a-z]{2,6}@[a-z]{2,5}\\.(com|org)"),
        StructuredOutput("choice", choice=["yes", "no"]),
        StructuredOutput("json_object"),
    ]
    rng = random.Random(7)
    requests, advanced = [], []
    scratch = xgrammar.allocate_token_bitmask(1, vocab)
    for i in range(10):
        so = constraints[i % len(constraints)]
        request = Request(f"r{i}", [1, 2, 3], SamplingParams(max_tokens=64, structured_output=so), frozenset({eos}))
        grammar.add([request], grammar.compile(so.key))
        # Walk a matcher of the same grammar i tokens along allowed tokens (random ones).
        walker = xgrammar.GrammarMatcher(grammar.compile(so.key))
        tokens: list[int] = []
        for _ in range(i):
            walker.fill_next_token_bitmask(scratch, 0)
            token = rng.choice(_allowed(scratch[0], vocab))
            tokens.append(token)
            walker.accept_token(token)
            if walker.is_terminated():
                break
        for token in tokens:
            request.append_output_token(token)
        advanced.append(tokens)
        requests.append(request)
    # "yes" and the stop token: the choice matcher has ended.
    done = Request("ended", [1], SamplingParams(max_tokens=8, structured_output=constraints[3]), frozenset({eos}))
    grammar.add([done], grammar.compile(constraints[3].key))
    for token in [*smol_tokenizer.encode("yes", add_special_tokens=False), eos]:
        done.append_output_token(token)
    # Its last token sampled by the step in flight (asynchronous scheduling), not on the request yet.
    pending = requests[6]
    pending_token = pending.output_token_ids.pop()
    pending.all_token_ids.pop()
    pending.num_pending_tokens = 1
    plain = Request("plain", [1, 2], SamplingParams(max_tokens=8), frozenset({eos}))
    batch = [*requests[:5], plain, *requests[5:], done]

    rows, batched = grammar.bitmask(batch, lambda r: pending_token)

    assert rows == [i for i, r in enumerate(batch) if r is not plain]
    serial = xgrammar.allocate_token_bitmask(len(rows), vocab)
    for j, row in enumerate(rows):
        request = batch[row]
        matcher = xgrammar.GrammarMatcher(grammar.compile(request.sampling_params.structured_output.key))
        tokens = [*request.output_token_ids, *([pending_token] if request is pending else [])]
        for token in tokens:
            assert matcher.accept_token(token)
        if matcher.is_terminated():
            serial[j].fill_(-1)
        else:
            matcher.fill_next_token_bitmask(serial, j)
    assert torch.equal(batched, serial)
    assert torch.all(batched[-1] == -1)  # the ended matcher's row
    assert len({tuple(row.tolist()) for row in batched}) >= 6  # the rows really are in different states


class _GatedCompiles:
    """Every grammar compile waits until ``gate`` is set (at most 20 s): a compile as slow as the
    test wants. ``started`` lists the keys whose compile began."""

    def __init__(self) -> None:
        import threading

        self.gate = threading.Event()
        self.started: list = []


@pytest.fixture
def gated_compiles(monkeypatch):  # type: ignore[no-untyped-def]
    from pagecast.runtime.structured_output import GrammarState

    gated = _GatedCompiles()
    original = GrammarState._compile

    def slow_compile(self, key):  # type: ignore[no-untyped-def]
        gated.started.append(key)
        assert gated.gate.wait(20), "the gate was never opened"
        return original(self, key)

    monkeypatch.setattr(GrammarState, "_compile", slow_compile)
    yield gated
    gated.gate.set()  # a compile still waiting ends now, not in 20 s


def _run(engine, request_id, prompt, params):  # type: ignore[no-untyped-def]
    """``engine`` runs one more request to its end; its final output."""
    engine.add_request(request_id, prompt, params)
    while True:
        for out in engine.step():
            if out.request_id == request_id and out.finished:
                return out


PLAIN = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_slow_grammar_compile_holds_up_no_other_request(tiny_llama_artifact, gated_compiles, async_scheduling):  # type: ignore[no-untyped-def]
    import time

    from pagecast.runtime.engine import LLMEngine
    from pagecast.runtime.engine_core import GRAMMAR_WAIT_S

    engine = LLMEngine(tiny_llama_artifact, async_scheduling=async_scheduling, kv_cache_memory="16MiB")
    constrained = SamplingParams(max_tokens=200, temperature=0.0, structured_output=PERSON)
    engine.add_request("c", PROMPTS[1], constrained)  # returns at once: its grammar compiles aside
    engine.add_request("p", PROMPTS[0], PLAIN)
    done = {}
    while "p" not in done:
        done.update((o.request_id, o) for o in engine.step() if o.finished)
    # The unconstrained request has all its tokens; the constrained one is still compiling, and
    # waits outside the scheduler.
    assert gated_compiles.started == [PERSON.key] and not gated_compiles.gate.is_set()
    assert engine.has_unfinished_requests() and not engine.scheduler.has_unfinished_requests()
    assert not engine.core.grammar.matchers
    # With nothing else to do, a step waits for the compile (briefly) instead of spinning.
    steps, start = 0, time.monotonic()
    while time.monotonic() - start < 0.1:
        assert engine.step() == []
        steps += 1
    assert steps <= 0.1 / GRAMMAR_WAIT_S + 2
    gated_compiles.gate.set()
    while engine.has_unfinished_requests():
        done.update((o.request_id, o) for o in engine.step() if o.finished)
    got = done["c"].outputs[0]
    assert got.finish_reason == "stop"
    Person.model_validate_json(got.text)
    # Both are what they would have been alone (greedy); the grammar was compiled once.
    assert done["p"].outputs[0].token_ids == _run(engine, "p-alone", PROMPTS[0], PLAIN).outputs[0].token_ids
    assert got.token_ids == _run(engine, "c-alone", PROMPTS[1], constrained).outputs[0].token_ids
    assert engine.core.grammar.num_compiled == 1 and not engine.core.grammar.compiling


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_aborting_requests_whose_grammar_compiles_leaves_nothing(tiny_llama_artifact, gated_compiles, async_scheduling):  # type: ignore[no-untyped-def]
    from concurrent import futures

    from pagecast.runtime.engine import LLMEngine

    engine = LLMEngine(tiny_llama_artifact, async_scheduling=async_scheduling, kv_cache_memory="16MiB")
    grammar = engine.core.grammar
    grammar.compile_threads = 1  # the second grammar's compile queues behind the first
    word = StructuredOutput("regex", regex="[a-z]{3,8}")
    engine.add_request("a", PROMPTS[0], SamplingParams(max_tokens=50, n=2, structured_output=PERSON))
    engine.add_request("b", PROMPTS[1], SamplingParams(max_tokens=50, structured_output=word))
    engine.add_request("p", PROMPTS[2], PLAIN)
    for _ in range(3):
        engine.step()
    running, queued = grammar.compiling[PERSON.key], grammar.compiling[word.key]
    aborted = engine.abort_request(["a", "b"])
    assert [c.finish_reason for o in aborted for c in o.outputs] == ["abort", "abort", "abort"]
    # Nobody waits for the queued compile: it is cancelled; the running one runs to its end.
    assert queued.cancelled() and list(grammar.compiling) == [PERSON.key]
    while engine.has_unfinished_requests():  # until the unconstrained request ends: nothing else is left
        engine.step()
    assert engine.num_unfinished() == 0 and not engine.scheduler.has_unfinished_requests()
    assert not grammar.matchers and engine.block_pool.num_used_blocks == 0
    gated_compiles.gate.set()
    futures.wait([running])
    grammar.poll()
    # The finished compile is cached (not compiled again for the next request with that schema).
    assert not grammar.compiling and gated_compiles.started == [PERSON.key]
    out = _run(engine, "again", PROMPTS[0], SamplingParams(max_tokens=200, temperature=0.0, structured_output=PERSON))
    Person.model_validate_json(out.outputs[0].text)
    assert grammar.num_compiled == 1


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_grammar_that_fails_to_compile_in_the_background_ends_its_request(tiny_llama_artifact, gated_compiles, monkeypatch, async_scheduling):  # type: ignore[no-untyped-def]
    from pagecast.runtime.engine import LLMEngine
    from pagecast.runtime.errors import InvalidRequestError
    from pagecast.runtime.structured_output import GrammarState

    class Refusing:  # xgrammar's compiler, refusing every grammar the way it does
        def compile_grammar(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            raise RuntimeError("[10:42:00] /project/cpp/grammar_compiler.cc:712: this schema is not for us")

    monkeypatch.setattr(GrammarState, "compiler", lambda self: Refusing())
    engine = LLMEngine(tiny_llama_artifact, async_scheduling=async_scheduling, kv_cache_memory="16MiB")
    engine.add_request("bad", PROMPTS[1], SamplingParams(max_tokens=50, n=2, structured_output=PERSON))
    engine.add_request("p", PROMPTS[0], PLAIN)
    for _ in range(2):
        engine.step()
    gated_compiles.gate.set()  # the compile goes on, and fails
    errors, done = [], {}
    while engine.has_unfinished_requests():
        try:
            done.update((o.request_id, o) for o in engine.step() if o.finished)
        except InvalidRequestError as exc:
            errors.append(exc)
    assert len(errors) == 1
    assert errors[0].param == "response_format" and errors[0].code == "invalid_json_schema"
    assert str(errors[0]) == "request 'bad': structured_output the JSON schema cannot be compiled: this schema is not for us"
    assert list(done) == ["p"] and done["p"].outputs[0].token_ids == _run(engine, "p-alone", PROMPTS[0], PLAIN).outputs[0].token_ids
    assert engine.num_unfinished() == 0 and not engine.core.grammar.matchers and not engine.core.grammar.compiling
    assert engine.block_pool.num_used_blocks == 0
