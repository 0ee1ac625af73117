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


def test_chat_continues_a_prefilled_final_message(llm: LLM) -> None:
    """continue_final_message leaves the assistant's opening words open, as transformers renders
    it (no end of turn after them, no new turn), and the reply is what comes after them."""
    conversation = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "My answer is"}]
    (out,) = llm.chat(
        conversation, GREEDY, add_generation_prompt=False, continue_final_message=True, use_tqdm=False
    )
    text = llm.tokenizer.apply_chat_template(conversation, tokenize=False, continue_final_message=True)
    assert out.prompt_token_ids == list(llm.tokenizer(text, add_special_tokens=False)["input_ids"])
    assert llm.tokenizer.decode(out.prompt_token_ids).endswith("<|im_start|>assistant\nMy answer is")
    (same,) = llm.generate([out.prompt_token_ids], GREEDY, use_tqdm=False)
    assert out.outputs[0].token_ids == same.outputs[0].token_ids
    # without it the assistant's turn is closed
    (closed,) = llm.chat(conversation, GREEDY, add_generation_prompt=False, use_tqdm=False)
    assert llm.tokenizer.decode(closed.prompt_token_ids).rstrip().endswith("My answer is<|im_end|>")


def test_chat_template_kwargs_reach_the_template(llm: LLM) -> None:
    template = (
        "{% for m in messages %}{{ m.content }}\n{% endfor %}"
        "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}"
    )
    conversation = [{"role": "user", "content": "Hi"}]
    (plain,) = llm.chat(conversation, GREEDY, chat_template=template, use_tqdm=False)
    (off,) = llm.chat(
        conversation, GREEDY, chat_template=template, chat_template_kwargs={"enable_thinking": False}, use_tqdm=False
    )
    assert llm.tokenizer.decode(plain.prompt_token_ids) == "Hi\n"
    assert llm.tokenizer.decode(off.prompt_token_ids) == "Hi\n<think></think>"


def test_chat_refuses_template_options_that_cannot_work(llm: LLM) -> None:
    conversation = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    with pytest.raises(ValueError, match="add_generation_prompt"):
        llm.chat(conversation, GREEDY, continue_final_message=True)  # the generation prompt is on by default
    with pytest.raises(ValueError, match="'tokenize' is set by the renderer"):
        llm.chat(conversation, GREEDY, chat_template_kwargs={"tokenize": True})
    # a template that drops the assistant's words leaves nothing to continue
    users_only = "{% for m in messages %}{% if m.role == 'user' %}{{ m.content }}{% endif %}{% endfor %}"
    with pytest.raises(ValueError, match="failed with these chat template kwargs: TypeError"):
        llm.chat(conversation, GREEDY, chat_template="{% set ns = namespace(n=0) %}x", chat_template_kwargs={"namespace": 1})
    with pytest.raises(ValueError, match="final message cannot be continued"):
        llm.chat(conversation, GREEDY, chat_template=users_only, add_generation_prompt=False, continue_final_message=True)


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


def test_generate_takes_vllm_prompt_dicts(llm: LLM) -> None:
    """vLLM's TextPrompt and TokensPrompt shapes, alone or mixed with plain prompts: the same
    outputs as the string and the token ids they hold."""
    ids = llm.tokenizer("The capital of France is", add_special_tokens=False)["input_ids"]
    plain = llm.generate(["Hello there", ids], GREEDY, use_tqdm=False)
    dicts = llm.generate([{"prompt": "Hello there"}, {"prompt_token_ids": ids}], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in dicts] == [o.outputs[0].token_ids for o in plain]
    assert dicts[1].prompt_token_ids == list(ids)
    (one,) = llm.generate({"prompt_token_ids": ids}, GREEDY, use_tqdm=False)
    assert one.outputs[0].token_ids == plain[1].outputs[0].token_ids
    with pytest.raises(ValueError, match="prompt 1: a prompt dict holds either"):
        llm.generate(["a", {"prompt": "b", "multi_modal_data": {}}], GREEDY, use_tqdm=False)


def test_chat_offers_tools_to_the_template(llm: LLM) -> None:
    template = (
        "{% if tools %}{% for t in tools %}[tool {{ t.function.name }}]{% endfor %}\n{% endif %}"
        "{% for m in messages %}{{ m.content }}\n{% endfor %}"
    )
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {}}}}]
    conversation = [{"role": "user", "content": "Weather?"}]
    (out,) = llm.chat(conversation, GREEDY, chat_template=template, tools=tools, use_tqdm=False)
    assert llm.tokenizer.decode(out.prompt_token_ids) == "[tool get_weather]Weather?\n"  # transformers renders with trim_blocks
    (plain,) = llm.chat(conversation, GREEDY, chat_template=template, use_tqdm=False)
    assert llm.tokenizer.decode(plain.prompt_token_ids) == "Weather?\n"
