"""min_tokens: end-of-sequence and stop token ids are masked until it is reached (so they never
appear early in the output), in both scheduling modes; min_tokens > max_tokens is refused."""

from __future__ import annotations

import httpx
import pytest
import torch
from engine_utils import PROMPTS
from server_support import make_engine, serve

from pagecast.runtime import LLM, SamplingParams
from pagecast.runtime.request import Request
from pagecast.runtime.sampler import sample

EOS = 7
STOP = 9


def request_with(outputs: int, pending: int = 0, **params) -> Request:  # type: ignore[no-untyped-def]
    request = Request("r", [1, 2], SamplingParams(temperature=0, max_tokens=20, **params), eos_token_ids=frozenset({EOS}))
    for _ in range(outputs):
        request.append_output_token(3)
    request.num_pending_tokens = pending
    return request


def test_eos_and_stop_ids_are_masked_until_min_tokens() -> None:
    logits = torch.zeros(1, 16)
    logits[0, EOS] = 5.0
    logits[0, STOP] = 4.0
    logits[0, 11] = 3.0
    for outputs, pending, expected in [(0, 0, 11), (2, 0, 11), (2, 1, EOS), (3, 0, EOS)]:
        # Tokens sampled by a step still in flight count towards min_tokens.
        request = request_with(outputs, pending, min_tokens=3, stop_token_ids=[STOP])
        out = sample(logits, [request])
        assert out.token_ids == [expected], (outputs, pending)
    # ignore_eos: end-of-sequence does not stop the request, so it is not masked either.
    assert sample(logits, [request_with(0, min_tokens=3, stop_token_ids=[STOP], ignore_eos=True)]).token_ids == [EOS]
    # Logprobs still describe the raw distribution.
    out = sample(logits, [request_with(0, min_tokens=3, logprobs=1)])
    entry = out.logprobs[0]
    assert out.token_ids == [STOP] and entry is not None and list(entry) == [STOP, EOS]
    assert (entry[STOP].rank, entry[EOS].rank) == (2, 1)


def test_min_tokens_above_max_tokens_is_refused() -> None:
    with pytest.raises(ValueError, match="^min_tokens must be at most max_tokens"):
        SamplingParams(min_tokens=5, max_tokens=4)
    SamplingParams(min_tokens=4, max_tokens=4)
    SamplingParams(min_tokens=500, max_tokens=None)  # up to the context length: checked by the engine's length


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_eos_never_appears_before_min_tokens(tiny_llama_artifact, async_scheduling):  # type: ignore[no-untyped-def]
    llm = LLM(tiny_llama_artifact, async_scheduling=async_scheduling)
    free = llm.generate(PROMPTS[:2], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    eos, stop = free[0].token_ids[2], free[1].token_ids[1]
    llm.engine.core.eos_token_ids = frozenset({eos})  # what the model emits at step 3 ends the sequence
    params = [SamplingParams(temperature=0, max_tokens=12, min_tokens=6),
              SamplingParams(temperature=0, max_tokens=12, min_tokens=6, stop_token_ids=[stop])]
    got = llm.generate(PROMPTS[:2], params)
    for out, banned in zip(got, (eos, stop)):
        tokens = out.token_ids
        assert banned not in tokens[:6], tokens
        # Past min_tokens the token stops the request again (the last token, if it appears).
        assert banned not in tokens[6:-1]
        assert len(tokens) >= 6
    if async_scheduling:
        sync = LLM(tiny_llama_artifact, async_scheduling=False)
        sync.engine.core.eos_token_ids = frozenset({eos})
        assert [o.token_ids for o in sync.generate(PROMPTS[:2], params)] == [o.token_ids for o in got]


def test_server_answers_400_for_min_tokens_above_max_tokens(tiny_llama_artifact):  # type: ignore[no-untyped-def]
    engine = make_engine(tiny_llama_artifact, max_num_seqs=2, max_model_len=256)
    with serve({"tiny": engine}) as server:
        for path, body in [
            ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "min_tokens": 5}),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "min_tokens": 5}),
        ]:
            r = httpx.post(f"{server.url}{path}", json={"model": "tiny", **body}, timeout=60)
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", "min_tokens", "invalid_value")
            assert "max_tokens" in error["message"]
