"""The reasoning parser (runtime/server/reasoning.py): a thinking model's text apart from its
answer, the same whole or streamed in pieces of any size."""

from __future__ import annotations

import pytest

from pagecast.runtime.server.reasoning import ReasoningParser, split_reasoning

CASES = [
    # (style, output, reasoning, content)
    ("qwen3", "<think>\nThe user asks for a colour.\n</think>\n\nBlue.", "The user asks for a colour.", "Blue."),
    ("qwen3", "Blue.", None, "Blue."),  # thinking off: all answer
    ("qwen3", "  Blue, not <think>red</think>.", None, "  Blue, not <think>red</think>."),  # a tag later is text
    ("qwen3", "<think>\n\n</think>\n\nBlue.", None, "Blue."),  # an empty block
    ("qwen3", "<think>\nStill thinking when max_tokens ca", "Still thinking when max_tokens ca", None),
    ("qwen3", "<thin", None, "<thin"),  # ended where a tag might have begun: text
    ("qwen3", "<think>a</thinking>b</think>c", "a</thinking>b", "c"),
    ("qwen3", "<think>line one\n\nline two\n</think>x", "line one\n\nline two", "x"),
    ("deepseek_r1", "The user asks.\n</think>\n\nBlue.", "The user asks.", "Blue."),
    ("deepseek_r1", "<think>\nThe user asks.\n</think>Blue.", "The user asks.", "Blue."),
    ("deepseek_r1", "Cut before the end", "Cut before the end", None),
    ("deepseek_r1", "</think>Blue.", None, "Blue."),
]


@pytest.mark.parametrize(("style", "output", "reasoning", "content"), CASES)
def test_reasoning_and_content_are_the_same_whole_and_streamed(style, output, reasoning, content):  # type: ignore[no-untyped-def]
    assert split_reasoning(output, style) == (reasoning, content)
    for piece in (1, 2, 3, 7, len(output)):
        parser = ReasoningParser(style)
        deltas = []
        for i in range(0, len(output), piece):
            deltas += parser.feed(output[i : i + piece])
        deltas += parser.finish()
        assert all(len(d) == 1 and next(iter(d.values())) for d in deltas), deltas  # no empty deltas
        got_reasoning = "".join(d.get("reasoning_content", "") for d in deltas) or None
        got_content = "".join(d.get("content", "") for d in deltas) or None
        assert (got_reasoning, got_content) == (reasoning, content), piece
        kinds = [next(iter(d)) for d in deltas]
        assert kinds == sorted(kinds, key=lambda k: k == "content")  # all reasoning comes first


def test_reasoning_streams_before_the_block_closes() -> None:
    parser = ReasoningParser("qwen3")
    assert parser.feed("<think>") == []
    assert parser.feed("\nFirst, ") == [{"reasoning_content": "First,"}]  # the blank waits for what follows
    assert parser.feed("the colour</") == [{"reasoning_content": " the colour"}]  # "</" may open the end tag
    assert parser.feed("think>\n\nBlue") == [{"content": "Blue"}]


def test_an_unknown_style_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown reasoning parser 'nope'; choose from deepseek_r1, qwen3"):
        ReasoningParser("nope")


def test_the_constraint_starts_after_a_single_end_of_thinking_token_the_prompt_does_not_close() -> None:
    """constraint_start: the id of ``</think>`` when the vocabulary has it as one token and the
    prompt has not closed the thinking itself (Qwen3's template with enable_thinking false does);
    None otherwise, and then the grammar constrains the whole output."""
    from tiny_models import tokenizer_dir
    from transformers import AutoTokenizer

    from pagecast.runtime.server.reasoning import constraint_start

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir())
    assert constraint_start(tokenizer, [1, 2, 3]) is None  # SmolLM2 has no "</think>" token
    tokenizer.add_tokens(["<think>", "</think>"])
    end = tokenizer.convert_tokens_to_ids("</think>")
    opened = tokenizer.encode("<|im_start|>assistant\n", add_special_tokens=False)
    closed = tokenizer.encode("<|im_start|>assistant\n<think>\n\n</think>\n\n", add_special_tokens=False)
    assert constraint_start(tokenizer, opened) == end
    assert constraint_start(tokenizer, closed) is None
