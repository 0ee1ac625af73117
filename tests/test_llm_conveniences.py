"""LLM conveniences: the progress bar of generate, chat() with the artifact's chat template
(or another), and default sampling from the checkpoint's generation_config.json."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import conveniences_support
import pytest

from pagecast.runtime import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=4)


@pytest.fixture(scope="module")
def llm(tiny_llama_artifact: Path) -> LLM:
    return LLM(tiny_llama_artifact, kv_cache_memory="16MiB")


@pytest.fixture(scope="module")
def defaults_artifact(tiny_llama_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return conveniences_support.defaults_artifact(tiny_llama_checkpoint, tmp_path_factory)


def test_progress_bar_counts_prompts_on_stderr(llm: LLM, capsys: pytest.CaptureFixture[str]) -> None:
    outputs = llm.generate(["a", "b", "c"], GREEDY)
    err = capsys.readouterr().err
    assert len(outputs) == 3
    assert "Processed prompts" in err and "3/3" in err
    assert "output:" in err and "tok/s" in err


def test_progress_bar_can_be_turned_off(llm: LLM, capsys: pytest.CaptureFixture[str]) -> None:
    with_bar = llm.generate(["a", "b"], GREEDY)
    capsys.readouterr()
    without = llm.generate(["a", "b"], GREEDY, use_tqdm=False)
    assert capsys.readouterr().err == ""
    assert [o.outputs[0].token_ids for o in without] == [o.outputs[0].token_ids for o in with_bar]


def _rendered(tokenizer: Any, conversation: list[dict[str, str]], template: str | None = None) -> list[int]:
    text = tokenizer.apply_chat_template(
        conversation, chat_template=template, tokenize=False, add_generation_prompt=True
    )
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def test_chat_renders_with_the_artifact_template_and_generates(llm: LLM) -> None:
    conversation = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
    (out,) = llm.chat(conversation, GREEDY, use_tqdm=False)
    expected = _rendered(llm.tokenizer, conversation)
    assert out.prompt_token_ids == expected
    assert "<|im_start|>assistant" in llm.tokenizer.decode(expected)  # the generation prompt is there
    (same,) = llm.generate([expected], GREEDY, use_tqdm=False)
    assert out.outputs[0].token_ids == same.outputs[0].token_ids


def test_chat_with_several_conversations_keeps_their_order(llm: LLM) -> None:
    conversations = [[{"role": "user", "content": "one"}], [{"role": "user", "content": "two, longer"}]]
    outputs = llm.chat(conversations, GREEDY, use_tqdm=False)
    assert [o.prompt_token_ids for o in outputs] == [_rendered(llm.tokenizer, c) for c in conversations]


def test_chat_with_another_template(llm: LLM) -> None:
    template = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}"
    (out,) = llm.chat([{"role": "user", "content": "Hi"}], GREEDY, chat_template=template, use_tqdm=False)
    assert llm.tokenizer.decode(out.prompt_token_ids) == "[user] Hi\n[assistant]"


def test_chat_rejects_malformed_messages(llm: LLM) -> None:
    with pytest.raises(ValueError, match="role"):
        llm.chat([{"content": "no role"}], GREEDY)
    with pytest.raises(ValueError, match="empty"):
        llm.chat([], GREEDY)
    with pytest.raises(TypeError):
        llm.chat("hello", GREEDY)  # type: ignore[arg-type]


def test_generation_config_gives_the_defaults(defaults_artifact: Path) -> None:
    llm = LLM(defaults_artifact, kv_cache_memory="16MiB")
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.top_k, defaults.max_tokens) == (0.9, 1, 7)
    assert defaults.top_p == SamplingParams().top_p  # not in the config: pagecast's default
    (out,) = llm.generate(["The capital of France is"], use_tqdm=False)
    # top_k 1 samples the most likely token: the greedy continuation, 7 tokens long.
    (greedy,) = llm.generate(["The capital of France is"], SamplingParams(temperature=0.0, max_tokens=7), use_tqdm=False)
    assert out.outputs[0].token_ids == greedy.outputs[0].token_ids
    assert len(out.outputs[0].token_ids) == 7 or out.outputs[0].finish_reason == "stop"
    # Explicit SamplingParams win over the artifact's defaults.
    (short,) = llm.generate(["The capital of France is"], SamplingParams(max_tokens=2), use_tqdm=False)
    assert len(short.outputs[0].token_ids) <= 2


def test_artifacts_without_recorded_defaults_keep_pagecast_defaults(llm: LLM, tiny_llama_artifact: Path) -> None:
    recorded = json.loads((tiny_llama_artifact / "generation_config.json").read_text())
    assert recorded["sampling_defaults"] == {}  # tiny_models' checkpoint ships no sampling keys
    assert llm.get_default_sampling_params() == SamplingParams()
