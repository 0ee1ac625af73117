"""``response_format`` through engine-serve (its engine-core process loads the tokenizer for the
grammar only when the first constrained request arrives), driven by the official openai SDK:
JSON mode and JSON schemas on chat and completions, streamed and not, and bad schemas."""

from __future__ import annotations

import json
from typing import Literal

import httpx
import openai
import pytest
from pydantic import BaseModel, Field
from server_support import start_engine_serve

MODEL = "tiny"


class Item(BaseModel):
    kind: Literal["book", "pen", "cup"]
    count: int = Field(ge=1, le=5)


class Order(BaseModel):
    """Nested objects, an array, enums, bounded integers and a boolean: no free strings, so the
    grammar completes well within max_tokens whatever a random model prefers."""

    priority: Literal["low", "high"]
    paid: bool
    items: list[Item] = Field(min_length=1, max_length=2)
    total: int = Field(ge=0, le=1000)


ORDER_FORMAT = {
    "type": "json_schema",
    "json_schema": {"name": "order", "schema": Order.model_json_schema(), "strict": True},
}


@pytest.fixture(scope="module")
def server(tiny_llama_artifact, tmp_path_factory):  # type: ignore[no-untyped-def]
    log = tmp_path_factory.mktemp("structured") / "serve.log"
    proc, base = start_engine_serve(
        [str(tiny_llama_artifact), "--served-model-name", MODEL, "--kv-cache-memory", "16MiB", "--async-scheduling"],
        log,
    )
    try:
        yield base
    finally:
        proc.terminate()
        proc.wait(timeout=60)


@pytest.fixture(scope="module")
def client(server):  # type: ignore[no-untyped-def]
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=120)


MESSAGES = [{"role": "user", "content": "Order two books."}]


def test_chat_json_schema_validates_streamed_and_not(client):  # type: ignore[no-untyped-def]
    resp = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=150, temperature=0.8, seed=1, n=2, response_format=ORDER_FORMAT
    )
    for choice in resp.choices:
        assert choice.finish_reason == "stop", choice.message.content
        Order.model_validate_json(choice.message.content)
    stream = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=150, temperature=0, response_format=ORDER_FORMAT, stream=True
    )
    text, finish = "", None
    for chunk in stream:
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
    assert finish == "stop"
    Order.model_validate_json(text)


def test_the_sdk_parse_helper_gets_a_pydantic_object(client):  # type: ignore[no-untyped-def]
    class Flags(BaseModel):
        ok: bool
        level: Literal["a", "b", "c"]

    resp = client.chat.completions.parse(model=MODEL, messages=MESSAGES, max_tokens=60, temperature=0, response_format=Flags)
    choice = resp.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, Flags)


def test_completions_json_schema_and_json_object(client):  # type: ignore[no-untyped-def]
    resp = client.completions.create(
        model=MODEL, prompt=["An order:", "Another:"], max_tokens=150, temperature=0, extra_body={"response_format": ORDER_FORMAT}
    )
    for choice in resp.choices:
        assert choice.finish_reason == "stop"
        Order.model_validate_json(choice.text)
    stream = client.completions.create(
        model=MODEL, prompt="An order:", max_tokens=150, temperature=0, stream=True,
        extra_body={"response_format": ORDER_FORMAT},
    )
    text = "".join(c.choices[0].text for c in stream if c.choices)
    Order.model_validate_json(text)
    obj = client.completions.create(
        model=MODEL, prompt="JSON:", max_tokens=48, temperature=0, extra_body={"response_format": {"type": "json_object"}}
    ).choices[0]
    assert obj.text.startswith("{")
    # Free keys and strings: a random model may still be inside one when max_tokens runs out.
    if obj.finish_reason == "stop":
        assert isinstance(json.loads(obj.text), dict)
    else:
        assert obj.finish_reason == "length"


def test_an_unconstrained_request_is_unchanged_beside_constrained_ones(client, server):  # type: ignore[no-untyped-def]
    plain = {"model": MODEL, "prompt": "The weather today is", "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    alone = httpx.post(f"{server}/v1/completions", json=plain, timeout=120).json()["choices"][0]["text"]
    import concurrent.futures

    constrained = {**plain, "prompt": "An order:", "max_tokens": 150, "ignore_eos": False, "response_format": ORDER_FORMAT}
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(httpx.post, f"{server}/v1/completions", json=body, timeout=120) for body in (constrained, plain, constrained)]
        results = [f.result().json()["choices"][0]["text"] for f in futures]
    assert results[1] == alone
    Order.model_validate_json(results[0])


@pytest.mark.parametrize(
    "response_format, reason",
    [
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}, "Unsupported type"),
        (
            {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "integer", "minimum": 3, "maximum": 1}}},
            "minimum greater than maximum",
        ),
        ({"type": "json_schema", "json_schema": {"name": "x"}}, "must be a JSON schema"),
    ],
)
def test_a_schema_that_cannot_be_compiled_is_a_400_that_says_why(client, response_format, reason):  # type: ignore[no-untyped-def]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, response_format=response_format)
    error = info.value.body
    assert info.value.status_code == 400
    assert error["code"] == "invalid_json_schema" and error["param"] == "response_format"
    assert reason in error["message"]


def test_an_unknown_response_format_type_is_a_400(client):  # type: ignore[no-untyped-def]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, response_format={"type": "regex"})
    assert info.value.body["param"] == "response_format"


def test_options_the_grammar_cannot_honour_are_a_400_naming_response_format(client):  # type: ignore[no-untyped-def]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=8, response_format={"type": "json_object"},
            extra_body={"ignore_eos": True},
        )
    assert info.value.body["param"] == "response_format" and "ignore_eos" in info.value.body["message"]


# Planted in the engine core (its model.py, which only the core process runs): grammar compiles
# that wait for the test's word (schemas titled "slow-grammar": the compile writes
# compile-started beside model.py, then waits until the test writes compile-gate there) or fail
# there (titled "broken-grammar"), although the server's own check, which compiles without the
# tokenizer, accepts both.
GATE_TIMEOUT_S = 120.0
PLANTED = f'''

# -- planted by tests/test_server_structured_output.py: gated and failing grammar compiles --
import pathlib as _planted_pathlib
import time as _planted_time

from pagecast.runtime import structured_output as _planted_so

_planted_compile = _planted_so.GrammarState._compile
_planted_here = _planted_pathlib.Path(__file__).parent


def _planted_slow_compile(self, key):
    if '"slow-grammar"' in (key[1] or ""):
        (_planted_here / "compile-started").touch()
        deadline = _planted_time.monotonic() + {GATE_TIMEOUT_S}
        while not (_planted_here / "compile-gate").exists() and _planted_time.monotonic() < deadline:
            _planted_time.sleep(0.01)
    if '"broken-grammar"' in (key[1] or ""):
        raise ValueError("structured_output the JSON schema cannot be compiled: planted failure")
    return _planted_compile(self, key)


_planted_so.GrammarState._compile = _planted_slow_compile
'''


def planted_artifact(src, dst):  # type: ignore[no-untyped-def]
    """A copy of ``src`` whose engine core compiles grammars as PLANTED says, its manifest re-hashed."""
    import hashlib
    import shutil

    shutil.copytree(src, dst)
    model = dst / "model.py"
    model.write_text(model.read_text() + PLANTED)
    manifest = json.loads((dst / "manifest.json").read_text())
    manifest["files"]["model.py"] = hashlib.sha256(model.read_bytes()).hexdigest()
    (dst / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True))
    return dst


def _titled(title: str) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "order", "schema": {**Order.model_json_schema(), "title": title}}}


def test_a_slow_grammar_compile_in_the_core_holds_up_no_other_request(tiny_llama_artifact, tmp_path):  # type: ignore[no-untyped-def]
    import concurrent.futures
    import time

    from server_support import make_engine, serve

    planted = planted_artifact(tiny_llama_artifact, tmp_path / "planted")
    engine = make_engine(planted, async_scheduling=True)
    try:
        with serve({MODEL: engine}) as server:
            url = f"{server.url}/v1/completions"

            def post(body):  # type: ignore[no-untyped-def]
                return httpx.post(url, json=body, timeout=2 * GATE_TIMEOUT_S)

            plain = {"model": MODEL, "prompt": "The weather today is", "max_tokens": 24, "temperature": 0, "ignore_eos": True}
            constrained = {"model": MODEL, "prompt": "An order:", "max_tokens": 150, "temperature": 0,
                           "response_format": _titled("slow-grammar")}  # fmt: skip
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                slow = pool.submit(post, constrained)
                deadline = time.monotonic() + 60
                while not (planted / "compile-started").exists():
                    assert time.monotonic() < deadline and not slow.done(), "the grammar compile never started"
                    time.sleep(0.01)
                # The core compiles the grammar (held there until the gate opens) and serves the
                # unconstrained request meanwhile; a core that waited for the compile would answer
                # it only after GATE_TIMEOUT_S, past this request's timeout.
                plain_r = httpx.post(url, json=plain, timeout=GATE_TIMEOUT_S / 2)
                assert plain_r.status_code == 200 and not slow.done()
                (planted / "compile-gate").touch()
                slow_r = slow.result()
            assert slow_r.status_code == 200 and slow_r.json()["choices"][0]["finish_reason"] == "stop"
            Order.model_validate_json(slow_r.json()["choices"][0]["text"])
            alone = post(plain).json()["choices"][0]["text"]
            assert plain_r.json()["choices"][0]["text"] == alone

            # A grammar that fails to compile in the core ends its request with a 400 that names
            # response_format and says why (the user's schema is at fault, not the server); the
            # engine serves on.
            broken = post({**constrained, "response_format": _titled("broken-grammar")})
            assert broken.status_code == 400, broken.text
            error = broken.json()["error"]
            assert "planted failure" in error["message"] and error["param"] == "response_format", error
            assert post(plain).json()["choices"][0]["text"] == alone
    finally:
        engine.shutdown()
