"""The LM head hands the sampler its logits in the model's dtype (kernel ABI 8: ops.lm_head
widen=False), not an fp32 copy: a bf16 engine's tokens, logprobs and prompt logprobs are exactly
those it gave with the copy, in both scheduling modes, and the model code of an older artifact
(no widen argument) still gets fp32."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import build_artifact
from tiny_models import make_checkpoint

from pagecast.kernels import ops
from pagecast.runtime import LLM, SamplingParams


@pytest.fixture(scope="module")
def bf16_artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("bf16-logits")
    return build_artifact(make_checkpoint(tmp / "ckpt", "llama", tokenizer=False), tmp / "art", dtype="bfloat16")


def _params() -> list[SamplingParams]:
    return [
        SamplingParams(temperature=0.0, max_tokens=6, logprobs=3, prompt_logprobs=2),
        SamplingParams(temperature=0.8, top_k=5, top_p=0.9, seed=1, max_tokens=6, logprobs=1),
        SamplingParams(temperature=0.7, min_p=0.05, seed=2, max_tokens=6),
        SamplingParams(temperature=0.5, seed=3, presence_penalty=0.5, repetition_penalty=1.2, max_tokens=6, logprobs=2),
        SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[5], max_tokens=6),
    ]


def _run(artifact: Path, async_scheduling: bool) -> list[tuple]:
    llm = LLM(artifact, async_scheduling=async_scheduling)
    outs = llm.generate([[1, 2, 3, 4], [7, 8, 9], [10, 11], [12, 13, 14, 15], [16]], _params(), use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs, o.prompt_logprobs) for o in outs]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_bf16_logits_give_what_the_fp32_copy_gave(
    bf16_artifact: Path, async_scheduling: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[torch.dtype] = []
    lm_head = ops.lm_head

    def recording(*args, **kwargs):  # type: ignore[no-untyped-def]
        out = lm_head(*args, **kwargs)
        seen.append(out.dtype)
        return out

    monkeypatch.setattr(ops, "lm_head", recording)
    served = _run(bf16_artifact, async_scheduling)
    assert seen and set(seen) == {torch.bfloat16}  # the model code asks for its own dtype
    monkeypatch.setattr(ops, "lm_head", lambda *args, **kwargs: lm_head(*args, **{**kwargs, "widen": True}))
    widened = _run(bf16_artifact, async_scheduling)
    assert served == widened


def test_model_code_without_widen_still_gets_fp32() -> None:
    hidden = torch.randn(3, 8).to(torch.bfloat16)
    weight = torch.randn(12, 8).to(torch.bfloat16)  # a padded head: 10 of 12 rows are the vocabulary
    old = ops.lm_head(hidden, weight, 10)
    new = ops.lm_head(hidden, weight, 10, widen=False)
    assert old.dtype == torch.float32 and new.dtype == torch.bfloat16
    assert new.shape == old.shape == (3, 10)
    assert torch.equal(new.float(), old)
