"""POST /v1/responses (OpenAI's Responses API) through the official openai SDK, on a tiny random
Llama with the SmolLM2 tokenizer and a ChatML template with hermes tools. The reference for
what the model is asked and answers is /v1/chat/completions on the same conversation: a
response must hold the same tokens, split into OpenAI's output items. Streams are read through
the SDK's own event accumulator (``responses.stream``), which refuses out-of-order events."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import jsonschema
import openai
import pydantic
import pytest
from server_support import make_engine, metric, metric_samples, serve, wait_for

MODEL = "tiny"
TEMPLATE = Path(__file__).parent / "fixtures" / "chat_templates" / "hermes_tools.jinja"
WEATHER = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Oslo"]}, "days": {"type": "integer", "minimum": 1, "maximum": 5}},
    "required": ["city", "days"],
}
TOOLS = [{"type": "function", "name": "get_weather", "description": "Forecast.", "parameters": WEATHER}]
CHAT_TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Forecast.", "parameters": WEATHER}}]
THINK = r"<think>\n[a-z]{3,12}( [a-z]{2,8}){0,2}\n</think>\n\n[A-Z][a-z]{2,10}( [a-z]{2,8}){1,2}\."


@pytest.fixture(scope="module")
def server(tiny_llama_artifact):  # type: ignore[no-untyped-def]
    engine = make_engine(tiny_llama_artifact, max_num_seqs=4)
    engine.tokenizer.chat_template = TEMPLATE.read_text()
    with serve({MODEL: engine}, reasoning_parser="qwen3", responses_store_size=3) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):  # type: ignore[no-untyped-def]
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def test_a_response_is_the_chat_answer_to_the_same_conversation(client):  # type: ignore[no-untyped-def]
    resp = client.responses.create(
        model=MODEL, instructions="Be brief.", input="Name a city.", max_output_tokens=7, temperature=0,
        include=["message.output_text.logprobs"], top_logprobs=2,
    )  # fmt: skip
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a city."}],
        max_tokens=7, temperature=0, logprobs=True, top_logprobs=2,
    )  # fmt: skip
    choice = chat.choices[0]
    assert resp.id.startswith("resp_") and resp.object == "response" and resp.model == MODEL
    assert resp.instructions == "Be brief." and resp.max_output_tokens == 7 and resp.temperature == 0
    assert [item.type for item in resp.output] == ["message"]
    message = resp.output[0]
    assert message.id.startswith("msg_") and message.role == "assistant"
    assert resp.output_text == choice.message.content
    assert (resp.usage.input_tokens, resp.usage.output_tokens) == (chat.usage.prompt_tokens, chat.usage.completion_tokens)
    assert resp.usage.total_tokens == chat.usage.total_tokens and resp.usage.output_tokens_details.reasoning_tokens == 0
    # Cut by the length asked for: incomplete, as OpenAI reports it.
    assert choice.finish_reason == "length"
    assert resp.status == "incomplete" and resp.incomplete_details.reason == "max_output_tokens"
    assert message.status == "incomplete"
    logprobs = message.content[0].logprobs
    # The same tokens; values equal up to the float noise of a prefix-cached prompt (the second asked).
    assert [lp.token for lp in logprobs] == [lp.token for lp in choice.logprobs.content]
    assert [lp.logprob for lp in logprobs] == pytest.approx([lp.logprob for lp in choice.logprobs.content], abs=1e-4)
    assert all(len(lp.top_logprobs) == 2 for lp in logprobs)


def test_a_stream_adds_up_to_the_unstreamed_response(client):  # type: ignore[no-untyped-def]
    kwargs = {"model": MODEL, "input": "Count.", "max_output_tokens": 9, "temperature": 0}
    whole = client.responses.create(**kwargs)
    with client.responses.stream(**kwargs) as stream:
        events = list(stream)
    final = events[-1].response  # cut by the length: "response.incomplete" holds it, not "completed"
    assert final.output_text == whole.output_text and final.status == whole.status == "incomplete"
    assert final.usage.output_tokens == whole.usage.output_tokens == 9
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done", "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text
    assert events[0].response.status == "in_progress" and events[-1].response.id == events[0].response.id


def test_input_items_with_a_call_and_its_result_are_the_chat_conversation(client):  # type: ignore[no-untyped-def]
    args = '{"city": "Paris", "days": 2}'
    items = [
        {"role": "user", "content": [{"type": "input_text", "text": "Weather in Paris?"}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": args},
        {"type": "function_call_output", "call_id": "call_1", "output": "Sunny, 21 C."},
    ]
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": args}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 C."},
    ]
    resp = client.responses.create(model=MODEL, input=items, tools=TOOLS, tool_choice="none", max_output_tokens=5, temperature=0)
    chat = client.chat.completions.create(model=MODEL, messages=messages, tools=CHAT_TOOLS, tool_choice="none", max_tokens=5, temperature=0)
    assert resp.usage.input_tokens == chat.usage.prompt_tokens
    assert resp.output_text == chat.choices[0].message.content


def test_a_forced_call_is_a_function_call_item_streamed_and_not(client):  # type: ignore[no-untyped-def]
    kwargs = {
        "model": MODEL, "input": "Weather in Oslo?", "tools": TOOLS, "max_output_tokens": 60, "temperature": 0,
        "tool_choice": {"type": "function", "name": "get_weather"},
    }  # fmt: skip
    resp = client.responses.create(**kwargs)
    assert resp.status == "completed"
    calls = [item for item in resp.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and calls[0].call_id.startswith("call_")
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER)
    with client.responses.stream(**kwargs) as stream:
        events = list(stream)
        final = stream.get_final_response()
    streamed = [item for item in final.output if item.type == "function_call"]
    assert [(c.name, c.arguments) for c in streamed] == [(c.name, c.arguments) for c in calls]
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert deltas == calls[0].arguments and [e.arguments for e in done] == [calls[0].arguments]


def test_text_format_json_schema_constrains_the_answer(client):  # type: ignore[no-untyped-def]
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["n"], "additionalProperties": False}
    resp = client.responses.create(
        model=MODEL, input="A digit.", max_output_tokens=30, temperature=0,
        text={"format": {"type": "json_schema", "name": "digit", "schema": schema, "strict": True}},
    )  # fmt: skip
    assert resp.status == "completed"
    jsonschema.validate(json.loads(resp.output_text), schema)
    assert resp.text.format.type == "json_schema"
    # The SDK's parse helper sends a pydantic model's schema (strict) and reads the answer back into it.
    parsed = client.responses.parse(model=MODEL, input="A digit.", max_output_tokens=30, temperature=0, text_format=Digit)
    assert isinstance(parsed.output_parsed, Digit) and 0 <= parsed.output_parsed.n <= 9


class Digit(pydantic.BaseModel):
    n: int = pydantic.Field(ge=0, le=9)


def test_reasoning_is_an_item_before_the_message(client):  # type: ignore[no-untyped-def]
    kwargs = {"model": MODEL, "input": "A colour?", "max_output_tokens": 60, "temperature": 0, "extra_body": {"structured_outputs": {"regex": THINK}}}
    resp = client.responses.create(**kwargs)
    assert [item.type for item in resp.output] == ["reasoning", "message"]
    thought = resp.output[0].content[0].text
    assert thought and "<think>" not in thought and "</think>" not in resp.output_text
    assert 0 < resp.usage.output_tokens_details.reasoning_tokens < resp.usage.output_tokens
    with client.responses.stream(**kwargs) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == thought
    assert final.output_text == resp.output_text


def test_stored_responses_continue_and_can_be_fetched_and_deleted(client):  # type: ignore[no-untyped-def]
    first = client.responses.create(model=MODEL, input="Hello.", max_output_tokens=3, temperature=0)
    assert client.responses.retrieve(first.id).output_text == first.output_text
    second = client.responses.create(model=MODEL, previous_response_id=first.id, input="Again.", max_output_tokens=3, temperature=0)
    assert second.previous_response_id == first.id
    messages = [
        {"role": "user", "content": "Hello."},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "Again."},
    ]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=3, temperature=0)
    assert second.usage.input_tokens == chat.usage.prompt_tokens
    assert second.output_text == chat.choices[0].message.content
    # The input as items with ids, newest first by default, in pages.
    listed = client.responses.input_items.list(second.id)
    assert [(item.type, item.role, item.content[0].text) for item in listed.data] == [("message", "user", "Again.")]
    assert listed.data[0].id.startswith("msg_") and not listed.has_more
    items = [{"role": "user", "content": "One."}, {"role": "assistant", "content": "Two."}, {"role": "user", "content": "Three."}]
    third = client.responses.create(model=MODEL, input=items, max_output_tokens=1)
    page = client.responses.input_items.list(third.id, limit=2, order="asc")
    assert [item.content[0].text for item in page.data] == ["One.", "Two."] and page.has_more
    rest = client.responses.input_items.list(third.id, after=page.last_id, order="asc")
    assert [item.content[0].text for item in rest.data] == ["Three."] and not rest.has_more
    assert [item.content[0].text for item in client.responses.input_items.list(third.id).data] == ["Three.", "Two.", "One."]
    assert client.responses.delete(first.id) is None
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.BadRequestError) as info:  # its conversation is no longer complete
        client.responses.create(model=MODEL, previous_response_id=second.id, input="And?", max_output_tokens=3)
    assert info.value.body["param"] == "previous_response_id"
    unkept = client.responses.create(model=MODEL, input="Hi.", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unkept.id)
    # The store holds the newest three: older ones are forgotten.
    ids = [client.responses.create(model=MODEL, input="Hi.", max_output_tokens=1).id for _ in range(4)]
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(ids[0])
    assert client.responses.retrieve(ids[-1]).id == ids[-1]


def test_output_items_sent_back_as_input_continue_the_conversation(client):  # type: ignore[no-untyped-def]
    """What clients that keep their own history do (store false): the last response's output
    items, then the next message, as the next input: the same prompt as a chained response."""
    first = client.responses.create(model=MODEL, input="Hello.", max_output_tokens=3, temperature=0, store=False)
    history = [{"role": "user", "content": "Hello."}, *[item.model_dump(exclude_none=True) for item in first.output]]
    second = client.responses.create(
        model=MODEL, input=[*history, {"role": "user", "content": "Again."}], max_output_tokens=3, temperature=0, store=False
    )
    chained_from = client.responses.create(model=MODEL, input="Hello.", max_output_tokens=3, temperature=0)
    chained = client.responses.create(model=MODEL, previous_response_id=chained_from.id, input="Again.", max_output_tokens=3, temperature=0)
    assert (second.usage.input_tokens, second.output_text) == (chained.usage.input_tokens, chained.output_text)


@pytest.mark.parametrize(
    "kwargs, param",
    [
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"tools": [{"type": "function", "name": "bad name!"}]}, "tools[0].name"),
        ({"tools": [{"type": "function", "name": "f", "parameters": {"type": "strin"}}]}, "tools[0].parameters"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]}, "input[0].content[0].type"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
        ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id"),
        ({"input": []}, "input"),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input"),  # nothing left to render: was a 500
        ({"input": [{"role": "user", "content": "x", "id": 5}]}, "input[0].id"),
        ({"max_output_tokens": 10**6}, "max_output_tokens"),
        ({"background": True, "store": False}, "store"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
        ({"previous_response_id": "resp_unknown"}, "previous_response_id"),
        ({"extra_body": {"n": 2}}, "n"),
    ],
)
def test_bad_requests_are_a_400_naming_the_field(client, kwargs, param):  # type: ignore[no-untyped-def]
    kwargs = {"model": MODEL, "input": "Hi.", "max_output_tokens": 4, **kwargs}
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(**kwargs)
    assert info.value.status_code == 400 and info.value.body["param"] == param


def test_an_unknown_response_is_a_404(client):  # type: ignore[no-untyped-def]
    with pytest.raises(openai.NotFoundError) as info:
        client.responses.delete("resp_nothing")
    assert "resp_nothing" in info.value.body["message"]


def _kv_blocks_used(server) -> float:  # type: ignore[no-untyped-def]
    return metric(metric_samples(server.url), "pagecast_kv_cache_blocks_used", model_name=MODEL)


def test_a_client_leaving_a_stream_frees_its_blocks(server):  # type: ignore[no-untyped-def]
    body = {"model": MODEL, "input": "Go on.", "max_output_tokens": 400, "stream": True}
    with httpx.Client(timeout=30) as c, c.stream("POST", f"{server.url}/v1/responses", json={**body, "ignore_eos": True}) as r:
        lines = r.iter_lines()
        while "response.output_text.delta" not in next(lines):
            pass
        assert _kv_blocks_used(server) > 0  # mid-stream
    wait_for(lambda: _kv_blocks_used(server) == 0, timeout=10)  # aborted when the connection closed, long before 400 tokens


def test_the_store_is_bounded_by_bytes_as_well_as_by_count():  # type: ignore[no-untyped-def]
    """Long inputs kept with store must not grow the server's memory past the store's byte bound:
    the oldest are forgotten first, and a response larger than the bound is not kept at all."""
    from pagecast.runtime.server.protocol import ChatMessage
    from pagecast.runtime.server.responses_store import ResponseStore

    def put(store: ResponseStore, rid: str, chars: int, status: str = "completed") -> None:
        text = "x" * chars
        items = [{"type": "message", "role": "user", "content": text}]
        store.put(rid, {"id": rid, "status": status, "output": []}, None, [ChatMessage(role="user", content=text)], items)

    store = ResponseStore(capacity=100, max_bytes=10_000)
    for i in range(5):
        put(store, f"r{i}", 1_000)  # about 2 kB each (the items' and the conversation's copies of the text)
    kept = [f"r{i}" for i in range(5) if store.get(f"r{i}") is not None]
    assert kept == ["r1", "r2", "r3", "r4"] and store.nbytes <= 10_000
    put(store, "huge", 20_000)  # alone over the bound: not kept, nothing else forgotten for it
    assert store.get("huge") is None and store.get("r1") is not None
    before = store.nbytes
    assert store.delete("r4") and store.nbytes < before
    assert store.conversation("r3") is not None and store.conversation("r0") is None
    # A background response still generating is forgotten after every finished one older than it.
    store = ResponseStore(capacity=3)
    put(store, "running", 10, status="in_progress")
    for i in range(3):
        put(store, f"done{i}", 10)
    assert store.get("running") is not None and store.get("done0") is None and store.get("done2") is not None


def test_a_background_response_is_queued_then_polled_to_the_answer_in_place(client):  # type: ignore[no-untyped-def]
    kwargs = {"model": MODEL, "input": "Name a city.", "max_output_tokens": 7, "temperature": 0}
    queued = client.responses.create(**kwargs, background=True)
    assert queued.background and queued.status == "queued" and queued.output == [] and queued.usage is None
    items = client.responses.input_items.list(queued.id).data
    wait_for(lambda: client.responses.retrieve(queued.id).status not in ("queued", "in_progress"))
    # Its input items keep their ids through every status it was kept with.
    assert [item.id for item in client.responses.input_items.list(queued.id).data] == [item.id for item in items]
    done = client.responses.retrieve(queued.id)
    in_place = client.responses.create(**kwargs)
    assert done.background and not in_place.background
    assert (done.status, done.output_text, done.usage.output_tokens) == (
        in_place.status, in_place.output_text, in_place.usage.output_tokens
    )  # fmt: skip
    # Finished, it is a conversation to continue; cancelling it changes nothing.
    assert client.responses.cancel(done.id).status == done.status
    follow = client.responses.create(model=MODEL, previous_response_id=done.id, input="Again.", max_output_tokens=2)
    assert follow.usage.input_tokens > done.usage.input_tokens + done.usage.output_tokens


def test_cancelling_a_background_response_stops_it_and_frees_its_blocks(server, client):  # type: ignore[no-untyped-def]
    long = {"model": MODEL, "input": "Go on.", "max_output_tokens": 490, "background": True, "extra_body": {"ignore_eos": True}}
    running = client.responses.create(**long)
    wait_for(lambda: _kv_blocks_used(server) > 0)
    assert client.responses.retrieve(running.id).status in ("queued", "in_progress")
    # It cannot be continued before it has an answer.
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model=MODEL, previous_response_id=running.id, input="And?", max_output_tokens=2)
    assert info.value.body["param"] == "previous_response_id"
    cancelled = client.responses.cancel(running.id)
    assert cancelled.id == running.id and cancelled.status == "cancelled"
    wait_for(lambda: _kv_blocks_used(server) == 0, timeout=10)  # aborted long before 490 tokens
    assert client.responses.retrieve(running.id).status == "cancelled"
    with pytest.raises(openai.BadRequestError) as info:  # nor after: it has none
        client.responses.create(model=MODEL, previous_response_id=running.id, input="And?", max_output_tokens=2)
    assert "cancelled" in info.value.body["message"]
    # DELETE stops one that is still generating, too.
    doomed = client.responses.create(**long)
    wait_for(lambda: _kv_blocks_used(server) > 0)
    assert client.responses.delete(doomed.id) is None
    wait_for(lambda: _kv_blocks_used(server) == 0, timeout=10)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(doomed.id)


def test_only_background_responses_can_be_cancelled(client):  # type: ignore[no-untyped-def]
    answered = client.responses.create(model=MODEL, input="Hi.", max_output_tokens=2)
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.cancel(answered.id)
    assert "background" in info.value.body["message"]
    with pytest.raises(openai.NotFoundError):
        client.responses.cancel("resp_nothing")
    with pytest.raises(openai.BadRequestError) as info:  # nor have events to stream again
        client.responses.retrieve(answered.id, stream=True)
    assert info.value.body["param"] == "stream"


def test_a_background_stream_left_by_its_client_goes_on_and_can_be_followed_again(client):  # type: ignore[no-untyped-def]
    kwargs = {"model": MODEL, "input": "Go on.", "max_output_tokens": 300, "temperature": 0, "extra_body": {"ignore_eos": True}}
    first = []
    stream = client.responses.create(**kwargs, background=True, stream=True)
    for event in stream:
        first.append(event)
        if event.type == "response.output_text.delta" and len(first) >= 8:
            break
    stream.close()  # the client leaves
    created = first[0]
    assert created.type == "response.created" and created.response.status == "queued" and created.response.background
    assert [e.type for e in first[1:3]] == ["response.queued", "response.in_progress"]
    response_id = created.response.id
    # Followed again from where it was left (live, most likely: 300 tokens take a while here).
    rest = list(client.responses.retrieve(response_id, stream=True, starting_after=first[-1].sequence_number))
    events = first + rest
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[-1].type == "response.incomplete"  # it ran to its 300 tokens with nobody reading
    done = client.responses.retrieve(response_id)
    assert done.status == "incomplete" and done.usage.output_tokens == 300
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == done.output_text == client.responses.create(**kwargs).output_text
    # Finished, its events are replayed from the store.
    replay = list(client.responses.retrieve(response_id, stream=True, starting_after=2))
    assert [e.model_dump() for e in replay] == [e.model_dump() for e in events[3:]]


def test_truncation_auto_drops_the_oldest_turns_that_do_not_fit(server, client):  # type: ignore[no-untyped-def]
    """The prompt that does not fit the 512-token context loses its oldest whole turns, no more:
    the answer is the chat answer to the instructions and the turns kept."""
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma tau"
    turns = [[{"role": "user", "content": f"Turn {i}: {words}."}, {"role": "assistant", "content": f"Noted {i}: {words}."}]
             for i in range(8)]  # fmt: skip
    last = {"role": "user", "content": "Which turn came last?"}
    items = [m for turn in turns for m in turn] + [last]
    kwargs = {"model": MODEL, "instructions": "Be brief.", "input": items, "max_output_tokens": 20, "temperature": 0}
    with pytest.raises(openai.BadRequestError) as info:  # as it is, the conversation does not fit
        client.responses.create(**kwargs)
    assert info.value.body["code"] == "context_length_exceeded"
    resp = client.responses.create(**kwargs, truncation="auto")
    assert resp.truncation == "auto" and resp.status in ("completed", "incomplete")

    def prompt_tokens(messages: list[dict]) -> int:  # type: ignore[type-arg]
        body = {"model": MODEL, "messages": messages, "add_generation_prompt": True}
        return httpx.post(f"{server.url}/tokenize", json=body, timeout=30).json()["count"]

    system = [{"role": "system", "content": "Be brief."}]
    dropped = next(k for k in range(len(turns) + 1)
                   if prompt_tokens(system + [m for turn in turns[k:] for m in turn] + [last]) + 20 <= 512)  # fmt: skip
    assert 0 < dropped < len(turns)
    kept = system + [m for turn in turns[dropped:] for m in turn] + [last]
    chat = client.chat.completions.create(model=MODEL, messages=kept, max_tokens=20, temperature=0)
    assert (resp.usage.input_tokens, resp.output_text) == (chat.usage.prompt_tokens, chat.choices[0].message.content)
    # Its own last turn is never dropped: one that cannot fit alone is still a 400.
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(**dict(kwargs, input=f"{words} " * 60), truncation="auto")
    assert info.value.body["code"] == "context_length_exceeded"
