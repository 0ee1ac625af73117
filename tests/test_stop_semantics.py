"""Stop semantics as vLLM's: the text of the token that stopped a sequence (end of sequence
with ``skip_special_tokens=False``, one of ``stop_token_ids``) is left out of the output, like a
stop string, unless ``include_stop_str_in_output``; and ``min_tokens`` holds a stop string back
exactly as it holds back end of sequence and stop ids (the stopping token comes after
``min_tokens`` others)."""

from __future__ import annotations

import json

import openai
import pytest
from engine_utils import PROMPTS
from server_support import make_engine, serve

from pagecast.runtime import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_llama_artifact):  # type: ignore[no-untyped-def]
    return LLM(tiny_llama_artifact, kv_cache_memory="16MiB", max_num_seqs=4)


def greedy(llm: LLM, prompt: str, max_tokens: int, **params):  # type: ignore[no-untyped-def]
    params.setdefault("ignore_eos", True)
    return llm.generate(prompt, SamplingParams(temperature=0, max_tokens=max_tokens, **params), use_tqdm=False)[0]


def a_fresh_token(tokens: list[int], start: int) -> int:
    """The first index from ``start`` whose token did not occur before it."""
    return next(i for i in range(start, len(tokens)) if tokens[i] not in tokens[:i])


def test_min_tokens_holds_back_a_stop_string_as_it_holds_back_eos(llm):  # type: ignore[no-untyped-def]
    # A prompt whose first greedy token has visible text: that text is the stop string.
    for prompt in PROMPTS:
        first = greedy(llm, prompt, 1)
        if first.text.strip() and "\ufffd" not in first.text:
            break
    else:
        pytest.skip("no prompt starts with a printable token")
    stop = first.text
    # Without min_tokens the first token is the stopping one: no text.
    out = greedy(llm, prompt, 8, stop=[stop])
    assert (len(out.token_ids), out.text, out.finish_reason) == (1, "", "stop")
    # min_tokens=1: that first token is one of the min_tokens, so it cannot stop the sequence
    # (end of sequence is masked there likewise); its text is output and a later token stops.
    out = greedy(llm, prompt, 8, stop=[stop], min_tokens=1)
    assert len(out.token_ids) >= 2, (out.token_ids, out.text)
    assert out.text.startswith(stop), (out.text, stop)


def test_stop_token_text_is_left_out_unless_asked_for(llm):  # type: ignore[no-untyped-def]
    free = greedy(llm, PROMPTS[0], 10)
    i = a_fresh_token(free.token_ids, 2)
    stop_id = free.token_ids[i]
    before, through = greedy(llm, PROMPTS[0], i), greedy(llm, PROMPTS[0], i + 1)
    for skip in (True, False):
        out = greedy(llm, PROMPTS[0], 10, stop_token_ids=[stop_id], skip_special_tokens=skip)
        assert out.token_ids == free.token_ids[: i + 1] and out.finish_reason == "stop"
        assert out.outputs[0].stop_reason == stop_id
        assert out.text == before.text
        out = greedy(
            llm, PROMPTS[0], 10, stop_token_ids=[stop_id], skip_special_tokens=skip, include_stop_str_in_output=True
        )
        assert out.text == through.text


def test_server_leaves_stop_token_text_out(tiny_llama_artifact, llm):  # type: ignore[no-untyped-def]
    free = greedy(llm, PROMPTS[1], 10)
    i = a_fresh_token(free.token_ids, 2)
    stop_id = free.token_ids[i]
    before, through = greedy(llm, PROMPTS[1], i).text, greedy(llm, PROMPTS[1], i + 1).text
    assert before != through
    engine = make_engine(tiny_llama_artifact, max_num_seqs=4, max_model_len=512)
    try:
        with serve({"tiny": engine}) as server:
            client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)
            common = dict(model="tiny", prompt=PROMPTS[1], max_tokens=10, temperature=0)
            for include, expected in ((False, before), (True, through)):
                extra = {"stop_token_ids": [stop_id], "ignore_eos": True, "include_stop_str_in_output": include}
                choice = client.completions.create(**common, extra_body=extra).choices[0]
                assert (choice.text, choice.finish_reason) == (expected, "stop")
                streamed = client.completions.create(**common, extra_body=extra, stream=True)
                assert "".join(c.choices[0].text for c in streamed if c.choices) == expected

            # A JSON answer ends on end of sequence (<|im_end|>): shown special tokens or not, the
            # content parses; asked for, the stop token's text follows the JSON.
            schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
                      "additionalProperties": False}  # fmt: skip
            response_format = {"type": "json_schema", "json_schema": {"name": "flag", "schema": schema}}
            messages = [{"role": "user", "content": "Is it ok?"}]
            for stream in (False, True):
                extra = {"skip_special_tokens": False}
                kwargs = dict(model="tiny", messages=messages, max_tokens=40, temperature=0,
                              response_format=response_format, extra_body=extra)  # fmt: skip
                if stream:
                    chunks = client.chat.completions.create(**kwargs, stream=True)
                    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
                else:
                    reply = client.chat.completions.create(**kwargs).choices[0]
                    assert reply.finish_reason == "stop"
                    content = reply.message.content
                assert isinstance(json.loads(content)["ok"], bool), content
            kwargs["extra_body"] = {"skip_special_tokens": False, "include_stop_str_in_output": True}
            content = client.chat.completions.create(**kwargs).choices[0].message.content
            assert content.endswith("<|im_end|>") and isinstance(json.loads(content.removesuffix("<|im_end|>")), dict)
    finally:
        engine.shutdown()
