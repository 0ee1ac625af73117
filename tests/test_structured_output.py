"""Structured output (``response_format`` / ``SamplingParams.structured_output``) on a tiny random
model: whatever the model would say, the constrained output parses and validates, in both
scheduling modes, and unconstrained neighbours are unchanged."""

from __future__ import annotations

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
    for _ in range(3):
        engine.step()
    assert len(engine.core.grammar.matchers) == 2
    engine.abort_request(["a"])
    while engine.has_unfinished_requests():
        engine.step()
    assert not engine.core.grammar.matchers and engine.block_pool.num_used_blocks == 0


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
        grammar.add([request])
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
    grammar.add([done])
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
