"""The OpenAI-compatible server against a real uvicorn server on 127.0.0.1, driven by the
official openai SDK (sync and async) and raw HTTP; results checked against LLM.generate and
against transformers' reference model."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest
import torch
from server_support import ReferenceModel, make_engine, metric, metric_samples, serve
from transformers import MinPLogitsWarper, RepetitionPenaltyLogitsProcessor, SequenceBiasLogitsProcessor

from pagecast.runtime import LLM, SamplingParams
from pagecast.runtime.errors import InvalidRequestError
from pagecast.runtime.server.sse import DONE

MODEL = "tiny"
PROMPTS = ["The quick brown fox", "Once upon a time", "In 1492, Columbus"]


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def server(tiny_llama_artifact, request):  # type: ignore[no-untyped-def]
    # A small token budget: prompts longer than 32 tokens are prefilled in chunks, as long ones
    # are in production, and every result must still match LLM.generate's (synchronous steps),
    # also with asynchronous scheduling (the GPU default).
    engine = make_engine(tiny_llama_artifact, max_num_seqs=32, max_num_batched_tokens=32, async_scheduling=request.param)
    with serve({MODEL: engine}) as srv:
        srv.engine = engine  # for the tests of its Python API
        yield srv


@pytest.fixture(scope="module")
def llm(tiny_llama_artifact):  # type: ignore[no-untyped-def]
    return LLM(tiny_llama_artifact, kv_cache_memory="16MiB")


@pytest.fixture(scope="module")
def reference(tiny_llama_checkpoint):  # type: ignore[no-untyped-def]
    return ReferenceModel(tiny_llama_checkpoint)


@pytest.fixture(scope="module")
def client(server):  # type: ignore[no-untyped-def]
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def aclient_factory(server):  # type: ignore[no-untyped-def]
    # One client per event loop: httpx's async pool is bound to the loop that made it.
    return lambda: openai.AsyncOpenAI(
        base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60
    )


def greedy(max_tokens: int, **kwargs) -> SamplingParams:  # type: ignore[no-untyped-def]
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kwargs)


def chat_ids(llm: LLM, messages: list[dict[str, str]]) -> list[int]:
    tok = llm.tokenizer
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return list(tok(text, add_special_tokens=False)["input_ids"])


def prompt_ids(llm: LLM, prompt: str) -> list[int]:
    return list(llm.engine.tokenize(prompt)[1])


# -- completions and chat, sync and async, streamed and not --------------------------------------


def test_completions_sync_match_llm_generate(client, llm):  # type: ignore[no-untyped-def]
    expected = llm.generate(PROMPTS, greedy(12))
    resp = client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=12, temperature=0)
    assert resp.object == "text_completion" and resp.model == MODEL and resp.id.startswith("cmpl-")
    assert [c.index for c in resp.choices] == [0, 1, 2]
    assert [c.text for c in resp.choices] == [o.text for o in expected]
    assert [c.finish_reason for c in resp.choices] == [o.finish_reason for o in expected]
    assert resp.usage.prompt_tokens == sum(len(o.prompt_token_ids) for o in expected)
    assert resp.usage.completion_tokens == sum(len(o.token_ids) for o in expected)
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens


def test_completions_sync_stream_matches_and_reports_usage(client, llm):  # type: ignore[no-untyped-def]
    expected = llm.generate([PROMPTS[0]], greedy(20))[0]
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt=PROMPTS[0],
            max_tokens=20,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    choice_chunks = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].text for c in choice_chunks) == expected.text
    assert [c.choices[0].finish_reason for c in choice_chunks][-1] == expected.finish_reason
    assert all(c.choices[0].finish_reason is None for c in choice_chunks[:-1])
    assert all(c.usage is None for c in choice_chunks)
    last = chunks[-1]
    assert last.choices == []
    assert last.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert last.usage.completion_tokens == len(expected.token_ids)
    assert last.usage.total_tokens == len(expected.prompt_token_ids) + len(expected.token_ids)


def test_chat_sync_and_stream_match_llm_generate(client, llm):  # type: ignore[no-untyped-def]
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Say something."},
    ]
    ids = chat_ids(llm, messages)
    expected = llm.generate([ids], greedy(16))[0]

    resp = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0)
    assert resp.object == "chat.completion" and resp.id.startswith("chatcmpl-")
    assert resp.choices[0].message.role == "assistant"
    assert resp.choices[0].message.content == expected.text
    assert resp.choices[0].finish_reason == expected.finish_reason
    assert resp.usage.prompt_tokens == len(ids)
    assert resp.usage.completion_tokens == len(expected.token_ids)

    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_completion_tokens=16,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    choice_chunks = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].delta.content or "" for c in choice_chunks) == expected.text
    assert choice_chunks[-1].choices[0].finish_reason == expected.finish_reason
    assert all(c.choices[0].finish_reason is None for c in choice_chunks[:-1])
    assert chunks[-1].usage.prompt_tokens == len(ids)
    assert chunks[-1].usage.completion_tokens == len(expected.token_ids)


def test_async_client_streaming_and_not(aclient_factory, llm):  # type: ignore[no-untyped-def]
    expected = llm.generate(PROMPTS, greedy(10))
    messages = [{"role": "user", "content": "Hello!"}]
    chat_expected = llm.generate([chat_ids(llm, messages)], greedy(10))[0]

    async def main():  # type: ignore[no-untyped-def]
        aclient = aclient_factory()

        async def complete(prompt: str) -> str:
            resp = await aclient.completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0)
            return resp.choices[0].text

        async def complete_stream(prompt: str) -> str:
            stream = await aclient.completions.create(
                model=MODEL, prompt=prompt, max_tokens=10, temperature=0, stream=True
            )
            return "".join([c.choices[0].text async for c in stream])

        async def chat(stream: bool) -> str:
            if not stream:
                resp = await aclient.chat.completions.create(
                    model=MODEL, messages=messages, max_tokens=10, temperature=0
                )
                return resp.choices[0].message.content or ""
            chunks = await aclient.chat.completions.create(
                model=MODEL, messages=messages, max_tokens=10, temperature=0, stream=True
            )
            return "".join([c.choices[0].delta.content or "" async for c in chunks if c.choices])

        results = await asyncio.gather(
            *(complete(p) for p in PROMPTS), *(complete_stream(p) for p in PROMPTS), chat(False), chat(True)
        )
        await aclient.close()
        return results

    results = asyncio.run(main())
    texts = [o.text for o in expected]
    assert results[:3] == texts and results[3:6] == texts
    assert results[6:] == [chat_expected.text, chat_expected.text]


# -- exact bytes on the wire ----------------------------------------------------------------------


def test_exact_sse_bytes(server, llm):  # type: ignore[no-untyped-def]
    """A one-token stream has a deterministic chunk sequence: check every byte."""
    messages = [{"role": "user", "content": "Hi"}]
    ids = chat_ids(llm, messages)
    expected = llm.generate([ids], greedy(1))[0]
    body = {
        "model": MODEL,
        "messages": messages,
        "max_tokens": 1,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = b"".join(r.iter_bytes())
    first = json.loads(raw.split(b"\n\n")[0][len(b"data: ") :])
    rid, created = first["id"], first["created"]
    head = f'"id":"{rid}","object":"chat.completion.chunk","created":{created},"model":"{MODEL}"'
    content = json.dumps(expected.text, ensure_ascii=False)
    n_prompt, n_out = len(ids), len(expected.token_ids)
    want = (
        f'data: {{{head},"choices":[{{"index":0,"delta":{{"role":"assistant","content":""}},"logprobs":null,'
        f'"finish_reason":null}}],"usage":null}}\n\n'
        f'data: {{{head},"choices":[{{"index":0,"delta":{{"content":{content}}},"logprobs":null,'
        f'"finish_reason":null}}],"usage":null}}\n\n'
        f'data: {{{head},"choices":[{{"index":0,"delta":{{}},"logprobs":null,"finish_reason":"length"}}],'
        f'"usage":null}}\n\n'
        f'data: {{{head},"choices":[],"usage":{{"prompt_tokens":{n_prompt},"completion_tokens":{n_out},'
        f'"total_tokens":{n_prompt + n_out}}}}}\n\n'
        "data: [DONE]\n\n"
    ).encode()
    assert raw == want

    # The completions endpoint: one chunk carrying the text and the finish reason, then [DONE].
    expected = llm.generate([PROMPTS[1]], greedy(1))[0]
    body = {"model": MODEL, "prompt": PROMPTS[1], "max_tokens": 1, "temperature": 0, "stream": True}
    raw = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).content
    first = json.loads(raw.split(b"\n\n")[0][len(b"data: ") :])
    text = json.dumps(expected.text, ensure_ascii=False)
    want = (
        f'data: {{"id":"{first["id"]}","object":"text_completion","created":{first["created"]},'
        f'"model":"{MODEL}","choices":[{{"index":0,"text":{text},"logprobs":null,"finish_reason":"length"}}]}}'
        "\n\n"
    ).encode() + DONE
    assert raw == want


# -- stop strings -----------------------------------------------------------------------------


def _stream_text(client, **kwargs) -> tuple[str, str | None]:  # type: ignore[no-untyped-def]
    text, reason = "", None
    for c in client.completions.create(stream=True, **kwargs):
        text += c.choices[0].text
        reason = c.choices[0].finish_reason or reason
    return text, reason


def test_stop_strings_streamed_and_not(client, llm):  # type: ignore[no-untyped-def]
    prompt = PROMPTS[2]
    full = llm.generate([prompt], greedy(24, ignore_eos=True))[0]
    tok = llm.tokenizer
    pieces = [tok.decode(full.token_ids[: i + 1]) for i in range(len(full.token_ids))]
    # A stop string that spans two tokens: the end of one token's text and the start of the next.
    k = next(
        i
        for i in range(3, len(pieces) - 1)
        if len(pieces[i]) - len(pieces[i - 1]) >= 2 and len(pieces[i + 1]) - len(pieces[i]) >= 2
    )
    boundary = len(pieces[k])
    spanning = full.text[boundary - 2 : boundary + 2]
    assert len(spanning) == 4
    cases = [
        [spanning],  # spans two tokens
        ["\x00never\x00", spanning, full.text[-3:]],  # several: the earliest match wins
        [full.text[:3]],  # matches at the very start
    ]
    for stops in cases:
        cut = min(full.text.find(s) for s in stops if s in full.text)
        want = full.text[:cut]
        kwargs = {
            "model": MODEL,
            "prompt": prompt,
            "max_tokens": 24,
            "temperature": 0,
            "stop": stops,
            "extra_body": {"ignore_eos": True},
        }
        resp = client.completions.create(**kwargs)
        assert resp.choices[0].text == want
        assert resp.choices[0].finish_reason == "stop"
        streamed, reason = _stream_text(client, **kwargs)
        assert streamed == want and reason == "stop"
        for s in stops:
            assert s not in resp.choices[0].text and s not in streamed
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=5, temperature=0, stop=["\x00"]
    )
    assert chat.choices[0].finish_reason in ("stop", "length")


# -- n, seeds ------------------------------------------------------------------------------------


def test_n3_with_seed_is_reproducible_streamed_and_not(client):  # type: ignore[no-untyped-def]
    kwargs = {
        "model": MODEL,
        "prompt": PROMPTS[0],
        "max_tokens": 12,
        "temperature": 1.0,
        "n": 3,
        "seed": 1234,
    }
    first = client.completions.create(**kwargs)
    second = client.completions.create(**kwargs)
    assert [c.index for c in first.choices] == [0, 1, 2]
    texts = [c.text for c in first.choices]
    assert texts == [c.text for c in second.choices]
    assert len(set(texts)) > 1, "three seeded choices should not all be the same sample"
    streamed = ["", "", ""]
    finished = [None, None, None]
    for chunk in client.completions.create(stream=True, **kwargs):
        for c in chunk.choices:
            streamed[c.index] += c.text
            finished[c.index] = c.finish_reason or finished[c.index]
    assert streamed == texts
    assert finished == [c.finish_reason for c in first.choices]
    assert first.usage.completion_tokens == 36

    chat_kwargs = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 8,
        "temperature": 1.0,
        "n": 3,
        "seed": 7,
    }
    a = client.chat.completions.create(**chat_kwargs)
    b = client.chat.completions.create(**chat_kwargs)
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
    streamed = ["", "", ""]
    roles = set()
    for chunk in client.chat.completions.create(stream=True, **chat_kwargs):
        for c in chunk.choices:
            streamed[c.index] += c.delta.content or ""
            if c.delta.role:
                roles.add(c.index)
    assert roles == {0, 1, 2}
    assert streamed == [c.message.content for c in a.choices]


# -- logprobs against the reference model --------------------------------------------------------


def test_completion_logprobs_match_reference(client, reference):  # type: ignore[no-untyped-def]
    ids = [1, 504, 2812, 28, 99, 7, 3000]
    resp = client.completions.create(
        model=MODEL,
        prompt=ids,
        max_tokens=6,
        temperature=0,
        logprobs=5,
        extra_body={"return_token_ids": True},
    )
    choice = resp.choices[0]
    out_ids = choice.model_extra["token_ids"]
    ref = reference.logprobs(ids + out_ids)
    lp = choice.logprobs
    assert (
        len(lp.token_logprobs)
        == len(out_ids)
        == len(lp.top_logprobs)
        == len(lp.tokens)
        == len(lp.text_offset)
    )
    for j, tok in enumerate(out_ids):
        row = ref[len(ids) - 1 + j]
        assert tok == int(row.argmax())  # greedy
        assert lp.token_logprobs[j] == pytest.approx(float(row[tok]), abs=1e-4)
        top = torch.topk(row, 5)
        assert sorted(lp.top_logprobs[j].values(), reverse=True) == pytest.approx(
            top.values.tolist(), abs=1e-4
        )
    assert lp.text_offset[0] == 0
    assert "".join(lp.tokens) == choice.text


def test_echo_prompt_logprobs_lm_eval_shape(client, reference):  # type: ignore[no-untyped-def]
    """What lm-evaluation-harness's local-completions sends for loglikelihood: several token-id
    prompts, echo, logprobs=1, max_tokens=1, temperature=0. Each choice has prompt length + 1
    entries, top_logprobs are dicts (never null), and values match the reference."""
    prompts = [[1, 504, 2812, 28, 99], [1, 77, 3000, 12], [9, 8, 7, 6, 5, 4]]
    resp = httpx.post(
        f"{client.base_url}completions",
        json={
            "model": MODEL,
            "prompt": prompts,
            "echo": True,
            "logprobs": 1,
            "max_tokens": 1,
            "temperature": 0,
            "seed": 1234,
            "return_token_ids": True,
        },
        timeout=60,
    ).json()
    assert [c["index"] for c in resp["choices"]] == [0, 1, 2]
    for ids, choice in zip(prompts, resp["choices"], strict=True):
        lp = choice["logprobs"]
        gen = choice["token_ids"]
        assert len(gen) == 1
        for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
            assert len(lp[key]) == len(ids) + 1, key
        assert all(isinstance(t, dict) and t for t in lp["top_logprobs"])
        assert all(isinstance(v, float) for v in lp["token_logprobs"])
        assert lp["token_logprobs"][0] == 0.0  # the first token is given (see serving_completions)
        ref = reference.logprobs(ids + gen)
        for i, tok in enumerate(ids[1:] + gen, start=1):
            assert lp["token_logprobs"][i] == pytest.approx(float(ref[i - 1, tok]), abs=1e-4)
            # lm-eval's is_greedy: the token's logprob against the best of top_logprobs
            assert max(lp["top_logprobs"][i].values()) == pytest.approx(float(ref[i - 1].max()), abs=1e-4)
        # lm-eval's slice [ctxlen:-1] works on these lists
        assert sum(lp["token_logprobs"][1:-1]) == pytest.approx(
            sum(float(ref[i - 1, ids[i]]) for i in range(1, len(ids))), abs=1e-3
        )
    assert resp["usage"]["prompt_tokens"] == sum(map(len, prompts))
    assert resp["usage"]["completion_tokens"] == 3

    # max_tokens=0 scores the prompt only: prompt-length entries and no completion tokens.
    resp = httpx.post(
        f"{client.base_url}completions",
        json={
            "model": MODEL,
            "prompt": prompts[0],
            "echo": True,
            "logprobs": 0,
            "max_tokens": 0,
            "temperature": 0,
        },
        timeout=60,
    ).json()
    assert len(resp["choices"][0]["logprobs"]["token_logprobs"]) == len(prompts[0])
    assert resp["usage"]["completion_tokens"] == 0


def _check_prompt_logprobs(answer, ids: list[int], k: int, reference) -> None:  # type: ignore[no-untyped-def]
    """vLLM's prompt_logprobs against transformers: null first, then the prompt token's logprob
    and rank and the k best, keyed by token id."""
    assert answer[0] is None and len(answer) == len(ids)
    ref = reference.logprobs(ids)
    for i in range(1, len(ids)):
        row, entry = ref[i - 1], answer[i]
        mine = entry[str(ids[i])]
        assert mine["logprob"] == pytest.approx(float(row[ids[i]]), abs=1e-4)
        # 1-based rank, by the reference (within its rounding: a vocabulary holds near-ties)
        value = float(row[ids[i]])
        assert 1 + int((row > value + 1e-4).sum()) <= mine["rank"] <= 1 + int((row > value - 1e-4).sum())
        best = torch.topk(row, k)
        for tid, value in zip(best.indices.tolist(), best.values.tolist(), strict=True):
            assert entry[str(tid)]["logprob"] == pytest.approx(value, abs=1e-4)
        assert set(entry) <= {str(t) for t in best.indices.tolist()} | {str(ids[i])}
        assert all(isinstance(e["decoded_token"], str) for e in entry.values())


def test_vllm_prompt_logprobs_match_reference(client, llm, reference):  # type: ignore[no-untyped-def]
    # vLLM's prompt_logprobs extension (scoring a prompt through chat, or without echo's
    # legacy lists): per choice on completions, once per response on chat.
    ids = prompt_ids(llm, PROMPTS[2])
    resp = client.completions.create(
        model=MODEL, prompt=PROMPTS[2], max_tokens=2, n=2, temperature=0, extra_body={"prompt_logprobs": 3}
    )
    for choice in resp.choices:
        _check_prompt_logprobs(choice.model_extra["prompt_logprobs"], ids, 3, reference)
    messages = [{"role": "user", "content": "Count to three."}]
    resp = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=2, temperature=0, extra_body={"prompt_logprobs": 0}
    )
    _check_prompt_logprobs(resp.model_extra["prompt_logprobs"], chat_ids(llm, messages), 0, reference)
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt="x", stream=True, extra_body={"prompt_logprobs": 1})
    assert err.value.body["param"] == "prompt_logprobs"


def test_echo_of_a_text_prompt(client, llm):  # type: ignore[no-untyped-def]
    expected = llm.generate([PROMPTS[0]], greedy(5))[0]
    resp = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=5, temperature=0, echo=True)
    assert resp.choices[0].text == PROMPTS[0] + expected.text
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model=MODEL, prompt=PROMPTS[0], max_tokens=5, temperature=0, echo=True, stream=True
        )
    )
    assert streamed == PROMPTS[0] + expected.text


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(client, llm):  # type: ignore[no-untyped-def]
    # vLLM's truncate_prompt_tokens: the prompt's last k tokens are what the model sees (and what
    # usage counts and echo repeats), for text, token-id and chat prompts alike.
    max_model_len = int(llm.engine.max_model_len)
    text = " ".join(PROMPTS) + " and the lazy dog slept"
    ids = prompt_ids(llm, text)
    k = 6
    assert len(ids) > k
    expected = llm.generate([ids[-k:]], greedy(8))[0]
    for prompt in (text, ids):
        resp = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=8, temperature=0, echo=True,
            extra_body={"truncate_prompt_tokens": k},
        )  # fmt: skip
        assert resp.usage.prompt_tokens == k
        assert resp.choices[0].text == llm.tokenizer.decode(ids[-k:]) + expected.text
    # A text longer than the context is served once truncated, not refused.
    long_text = "the quick brown fox " * (max_model_len // 2)
    assert len(prompt_ids(llm, long_text)) > max_model_len
    resp = client.completions.create(
        model=MODEL, prompt=long_text, max_tokens=2, temperature=0, extra_body={"truncate_prompt_tokens": k}
    )
    assert resp.usage.prompt_tokens == k
    messages = [{"role": "user", "content": "Count to three, then tell me a story."}]
    chat = chat_ids(llm, messages)
    expected_chat = llm.generate([chat[-k:]], greedy(8))[0]
    resp = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=8, temperature=0, extra_body={"truncate_prompt_tokens": k}
    )
    assert resp.usage.prompt_tokens == k
    assert resp.choices[0].message.content == expected_chat.text
    for bad in (0, -2, max_model_len + 1):
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(model=MODEL, prompt=text, max_tokens=2, extra_body={"truncate_prompt_tokens": bad})
        assert err.value.body["param"] == "truncate_prompt_tokens"


def test_sampling_params_truncate_prompt_tokens(server, llm):  # type: ignore[no-untyped-def]
    # The same option for Python API users (vLLM's SamplingParams.truncate_prompt_tokens): LLM
    # and AsyncEngine see only the prompt's last k tokens; the output's prompt_token_ids are the
    # tokens kept, its prompt the text given.
    max_model_len = int(llm.engine.max_model_len)
    text = " ".join(PROMPTS) + " and the lazy dog slept"
    ids = prompt_ids(llm, text)
    k = 6
    expected = llm.generate([ids[-k:]], greedy(8))[0]
    for prompt in (text, ids):
        out = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0, truncate_prompt_tokens=k))[0]
        assert out.prompt_token_ids == ids[-k:]
        assert out.outputs[0].token_ids == expected.outputs[0].token_ids
        assert out.prompt == (text if prompt is text else None)
    # -1 keeps as many as the context holds: a prompt that fits is unchanged.
    out = llm.generate([text], SamplingParams(max_tokens=8, temperature=0.0, truncate_prompt_tokens=-1))[0]
    assert out.prompt_token_ids == ids
    long_text = "the quick brown fox " * (max_model_len // 2)
    out = llm.generate([long_text], SamplingParams(max_tokens=2, temperature=0.0, truncate_prompt_tokens=k))[0]
    assert out.prompt_token_ids == prompt_ids(llm, long_text)[-k:]
    # The server's engine (AsyncEngine) checks a request the same way before it is queued.
    _, kept, _ = server.engine.validate(text, SamplingParams(max_tokens=8, truncate_prompt_tokens=k))
    assert kept == ids[-k:]
    for bad in (0, -2, True):
        with pytest.raises(ValueError, match="truncate_prompt_tokens"):
            SamplingParams(truncate_prompt_tokens=bad)
    too_long = SamplingParams(max_tokens=2, truncate_prompt_tokens=max_model_len + 1)
    for validate in (llm.engine.validate, server.engine.validate):
        with pytest.raises(InvalidRequestError) as err:
            validate(text, too_long)
        assert err.value.param == "truncate_prompt_tokens"


def test_echo_logprobs_of_a_long_prompt_streamed_and_not(client):  # type: ignore[no-untyped-def]
    """A prompt prefilled in several chunks (the server's budget is 32 tokens): streamed and
    non-streamed answers carry the same echo, logprobs and text."""
    ids = [(7 * i + 3) % 5000 + 10 for i in range(100)]
    kwargs = {"model": MODEL, "prompt": ids, "echo": True, "logprobs": 2, "max_tokens": 4, "temperature": 0}
    whole = client.completions.create(**kwargs)
    choice = whole.choices[0]
    assert len(choice.logprobs.token_logprobs) == len(ids) + 4
    text, token_logprobs, top, tokens = "", [], [], []
    for chunk in client.completions.create(stream=True, **kwargs):
        c = chunk.choices[0]
        text += c.text
        if c.logprobs:
            token_logprobs += c.logprobs.token_logprobs
            top += c.logprobs.top_logprobs
            tokens += c.logprobs.tokens
    assert text == choice.text
    assert tokens == choice.logprobs.tokens
    assert token_logprobs == pytest.approx(choice.logprobs.token_logprobs, abs=1e-6)
    assert [sorted(t) for t in top] == [sorted(t) for t in choice.logprobs.top_logprobs]


def test_chat_logprobs_match_reference(client, llm, reference):  # type: ignore[no-untyped-def]
    messages = [{"role": "user", "content": "Count to three."}]
    ids = chat_ids(llm, messages)
    resp = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        extra_body={"return_token_ids": True},
    )
    out_ids = resp.choices[0].model_extra["token_ids"]
    ref = reference.logprobs(ids + out_ids)
    content = resp.choices[0].logprobs.content
    assert len(content) == len(out_ids)
    for j, entry in enumerate(content):
        row = ref[len(ids) - 1 + j]
        assert entry.logprob == pytest.approx(float(row[out_ids[j]]), abs=1e-4)
        assert len(entry.top_logprobs) == 3
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(
            torch.topk(row, 3).values.tolist(), abs=1e-4
        )
        if "\ufffd" not in entry.token:  # a whole character (part of one: the test below)
            assert bytes(entry.bytes) == entry.token.encode()
    streamed = []
    for chunk in client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        stream=True,
    ):
        if chunk.choices and chunk.choices[0].logprobs:
            streamed += [e.logprob for e in chunk.choices[0].logprobs.content]
    # The streamed request runs again (its prompt from the prefix cache, in other step shapes), so
    # fp32 sums may differ by an ulp or two (1e-6 failed once at -7.3, by 1.4e-6); a logprob given
    # to the wrong token or position differs by far more.
    assert streamed == pytest.approx([e.logprob for e in content], abs=1e-5)


@pytest.mark.parametrize("text", ["\U0001f600", "\u4e16\u754c"], ids=["emoji", "cjk"])
def test_chat_logprob_bytes_rebuild_a_character_split_between_tokens(client, llm, text):  # type: ignore[no-untyped-def]
    # OpenAI's `bytes` let a client rebuild characters whose UTF-8 bytes span tokens. Each such
    # token decodes alone to U+FFFD, whose own bytes (EF BF BD) rebuild nothing: the server must
    # give the token's bytes. logit_bias makes the tiny random model choose each piece in turn.
    pieces = llm.tokenizer.encode(text, add_special_tokens=False)
    partial = [t for t in pieces if "\ufffd" in llm.tokenizer.decode([t])]
    assert partial, f"the tokenizer encodes {text!r} whole ({pieces}); the test needs a split"
    joined = b""
    for token_id in pieces:
        resp = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=1,
            temperature=0,
            logprobs=True,
            logit_bias={str(token_id): 100},
            extra_body={"return_token_ids": True},
        )
        assert resp.choices[0].model_extra["token_ids"] == [token_id]
        joined += bytes(resp.choices[0].logprobs.content[0].bytes)
    assert joined.decode("utf-8") == text


def test_token_bytes_of_sentencepiece_byte_fallback_pieces():
    # Mistral, Gemma and Llama 2 tokenizers write a character they have no piece for as one
    # "<0xNN>" piece a byte; those decode alone to U+FFFD too.
    from pagecast.runtime.server.serving import raw_token_bytes

    pieces = [f"<0x{b:02X}>" for b in "\u4e16".encode()]
    assert b"".join(raw_token_bytes(p) for p in pieces).decode() == "\u4e16"
    assert raw_token_bytes("\u2581hello") is None  # a SentencePiece word: its text's bytes are kept
    assert raw_token_bytes("\u0120hi") == b" hi"  # byte-level BPE's space


# -- penalties and min_p against transformers' processors ----------------------------------------


class _OpenAIPenalties:
    """OpenAI's presence / frequency penalties over the generated tokens, as a transformers
    logits processor (transformers has none of its own)."""

    def __init__(self, prompt_len: int, presence: float, frequency: float):
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        counts = torch.bincount(input_ids[0, self.prompt_len :], minlength=scores.shape[-1]).float()
        return scores - self.presence * (counts > 0).float() - self.frequency * counts


@pytest.mark.parametrize(
    "penalties",
    [
        {"repetition_penalty": 1.8},
        {"presence_penalty": 1.5},
        {"frequency_penalty": 1.2},
        {"presence_penalty": 0.5, "frequency_penalty": 0.7, "repetition_penalty": 1.3},
    ],
)
def test_penalties_match_transformers_processors(client, reference, penalties):  # type: ignore[no-untyped-def]
    ids = [1, 42, 42, 42, 3000, 3000, 17]
    resp = client.completions.create(
        model=MODEL,
        prompt=ids,
        max_tokens=16,
        temperature=0,
        extra_body={"return_token_ids": True, "ignore_eos": True, **penalties},
    )
    got = resp.choices[0].model_extra["token_ids"]
    processors = []
    if "repetition_penalty" in penalties:
        processors.append(RepetitionPenaltyLogitsProcessor(penalties["repetition_penalty"]))
    if "presence_penalty" in penalties or "frequency_penalty" in penalties:
        processors.append(
            _OpenAIPenalties(
                len(ids), penalties.get("presence_penalty", 0.0), penalties.get("frequency_penalty", 0.0)
            )
        )
    assert got == reference.greedy(ids, 16, processors)
    plain = client.completions.create(
        model=MODEL,
        prompt=ids,
        max_tokens=16,
        temperature=0,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )
    assert plain.choices[0].model_extra["token_ids"] == reference.greedy(ids, 16, [])


def test_logit_bias_matches_transformers_sequence_bias(client, reference):  # type: ignore[no-untyped-def]
    """OpenAI's logit_bias (token id strings -> [-100, 100]) through the SDK: greedy tokens as
    transformers' SequenceBiasLogitsProcessor of one-token sequences gives them, added before the
    repetition penalty (vLLM's order); a +100 bias makes that token the answer, while its reported
    logprob is still the model's own (logprobs describe the raw distribution)."""
    ids = [1, 42, 42, 42, 3000, 3000, 17]
    bias = {"3000": 8.0, "42": -100, "17": 5.5}
    resp = client.completions.create(
        model=MODEL, prompt=ids, max_tokens=12, temperature=0, logit_bias=bias,
        extra_body={"return_token_ids": True, "ignore_eos": True, "repetition_penalty": 1.3},
    )  # fmt: skip
    processors = [
        SequenceBiasLogitsProcessor([[[int(t)], float(b)] for t, b in bias.items()]),
        RepetitionPenaltyLogitsProcessor(1.3),
    ]
    got = resp.choices[0].model_extra["token_ids"]
    assert got == reference.greedy(ids, 12, processors)
    assert got != reference.greedy(ids, 12, [RepetitionPenaltyLogitsProcessor(1.3)])  # the bias mattered
    forced = client.completions.create(
        model=MODEL, prompt=ids, max_tokens=3, temperature=0.8, seed=1, logit_bias={"977": 100}, logprobs=0,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )  # fmt: skip
    choice = forced.choices[0]
    assert choice.model_extra["token_ids"] == [977, 977, 977]
    raw = torch.log_softmax(reference.logits(ids)[-1].float(), dim=-1)[977].item()
    assert choice.logprobs.token_logprobs[0] == pytest.approx(raw, abs=1e-3)
    assert raw < -1.0  # far from the biased distribution's ~0


def test_min_p_samples_only_what_transformers_allows(client, reference):  # type: ignore[no-untyped-def]
    ids = [1, 504, 2812, 28]
    min_p = 0.2
    resp = client.completions.create(
        model=MODEL,
        prompt=ids,
        max_tokens=8,
        temperature=1.0,
        n=6,
        seed=3,
        extra_body={"return_token_ids": True, "min_p": min_p},
    )
    warper = MinPLogitsWarper(min_p)
    for choice in resp.choices:
        seq = list(ids)
        for tok in choice.model_extra["token_ids"]:
            scores = warper(torch.tensor([seq]), reference.logits(seq)[-1:].clone())
            assert torch.isfinite(scores[0, tok]), f"token {tok} is outside min_p's allowed set"
            seq.append(tok)


# -- the rest of the surface ---------------------------------------------------------------------


def test_models_version_health(client, server):  # type: ignore[no-untyped-def]
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
    from pagecast.runtime import __version__

    assert httpx.get(f"{server.url}/version").json()["version"] == __version__


def test_model_may_be_omitted_with_one_model(server):  # type: ignore[no-untyped-def]
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=60)
    assert r.status_code == 200 and r.json()["model"] == MODEL


def test_metrics_move_and_request_log_line(client, server, caplog):  # type: ignore[no-untyped-def]
    before = metric_samples(server.url)
    with caplog.at_level("INFO", logger="pagecast.server.requests"):
        resp = client.completions.create(
            model=MODEL, prompt=PROMPTS[0], max_tokens=5, temperature=0, extra_body={"ignore_eos": True}
        )
    after = metric_samples(server.url)
    labels = {"model_name": MODEL}
    assert (
        metric(after, "pagecast_requests_total", finish_reason="length", **labels)
        == metric(before, "pagecast_requests_total", finish_reason="length", **labels) + 1
    )
    for name, delta in [
        ("pagecast_prompt_tokens_total", resp.usage.prompt_tokens),
        ("pagecast_generation_tokens_total", 5),
    ]:
        assert metric(after, name, **labels) == metric(before, name, **labels) + delta
    for hist in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds"):
        name = f"pagecast_{hist}_count"
        assert metric(after, name, **labels) == metric(before, name, **labels) + 1
    itl = "pagecast_inter_token_latency_seconds_count"
    assert metric(after, itl, **labels) >= metric(before, itl, **labels) + 1
    assert metric(after, "pagecast_kv_cache_blocks_total", **labels) > 0
    assert metric(after, "pagecast_engine_alive", **labels) == 1

    records = [r for r in caplog.records if getattr(r, "request_id", None) == resp.id]
    assert len(records) == 1
    rec = records[0]
    assert (rec.model, rec.prompt_tokens, rec.completion_tokens, rec.finish_reason, rec.status) == (
        MODEL,
        resp.usage.prompt_tokens,
        5,
        "length",
        200,
    )
    assert rec.ttft_s is not None and 0 <= rec.ttft_s <= rec.total_s
