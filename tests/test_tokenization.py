"""encode_text gives transformers' encode ids, token for token (the SmolLM2 tokenizer, as the
tiny artifacts carry it), and falls back to encode where its fast path would not be the same."""

from __future__ import annotations

import random

import pytest
from tiny_models import tokenizer_dir

from pagecast.runtime.loader import load_artifact_tokenizer
from pagecast.runtime.tokenization import _fast_backend, encode_text


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):  # type: ignore[no-untyped-def]
    # Loaded as the server loads an artifact's tokenizer (its tokenizer/ folder).
    artifact = tmp_path_factory.mktemp("artifact")
    (artifact / "tokenizer").symlink_to(tokenizer_dir())
    return load_artifact_tokenizer(artifact)


def _mixed_text(num_chars: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    pieces = [
        "The quick brown fox jumps over the lazy dog. ",
        "1234567890 ",
        "  \t\n\n   ",
        "héllo wörld — ünïcode ",
        "日本語のテキスト、中文文本。",
        "emoji 🙂🚀 ",
        "<|im_start|>user\nhi<|im_end|>\n",
        "<|endoftext|>",
        "def f(x):\n    return x ** 2\n",
        "\u200b\u00a0\r\n",
        "don't won't I'll we've ",
    ]
    out: list[str] = []
    size = 0
    while size < num_chars:
        piece = rng.choice(pieces) if rng.random() < 0.8 else chr(rng.randrange(32, 0x2FFF))
        out.append(piece)
        size += len(piece)
    return "".join(out)[:num_chars]


def test_the_tokenizer_takes_the_fast_path(tokenizer) -> None:  # type: ignore[no-untyped-def]
    assert _fast_backend(tokenizer) is not None


@pytest.mark.parametrize("add_special_tokens", [False, True])
@pytest.mark.parametrize(
    "text", ["", " ", "Hello world", "  leading", "<|im_start|>", "\n\n\n", "a" * 5000, "9" * 1001]
)
def test_same_ids_as_encode(tokenizer, text: str, add_special_tokens: bool) -> None:  # type: ignore[no-untyped-def]
    expected = tokenizer.encode(text, add_special_tokens=add_special_tokens)
    assert encode_text(tokenizer, text, add_special_tokens) == expected


def test_same_ids_as_encode_on_a_long_mixed_text(tokenizer) -> None:  # type: ignore[no-untyped-def]
    text = _mixed_text(1 << 18)
    ids = encode_text(tokenizer, text)
    assert isinstance(ids, list) and len(ids) > 50_000
    assert ids == tokenizer.encode(text, add_special_tokens=False)
    assert ids == tokenizer(text, add_special_tokens=False)["input_ids"]  # as chat prompts were tokenized


def test_split_special_tokens_is_honoured(tokenizer) -> None:  # type: ignore[no-untyped-def]
    text = "<|im_start|>user<|im_end|>"
    tokenizer.split_special_tokens = True
    try:
        split = encode_text(tokenizer, text)
        assert split == tokenizer.encode(text, add_special_tokens=False)
    finally:
        tokenizer.split_special_tokens = False
    whole = encode_text(tokenizer, text)
    assert whole == tokenizer.encode(text, add_special_tokens=False) and len(whole) < len(split)


def test_truncation_on_the_backend_falls_back_to_encode(tokenizer) -> None:  # type: ignore[no-untyped-def]
    tokenizer.backend_tokenizer.enable_truncation(max_length=3)
    try:
        assert _fast_backend(tokenizer) is None
        text = "one two three four five six"
        assert encode_text(tokenizer, text) == tokenizer.encode(text, add_special_tokens=False)
        assert len(encode_text(tokenizer, text)) > 3  # encode resets the backend's truncation
    finally:
        tokenizer.backend_tokenizer.no_truncation()


def test_a_subclass_with_its_own_encode_falls_back(tokenizer) -> None:  # type: ignore[no-untyped-def]
    class Prefixed(type(tokenizer)):  # type: ignore[misc]
        def encode(self, text, **kwargs):  # type: ignore[no-untyped-def]
            return [7, *super().encode(text, **kwargs)]

    prefixed = Prefixed.__new__(Prefixed)
    prefixed.__dict__.update(tokenizer.__dict__)
    assert _fast_backend(prefixed) is None
    assert encode_text(prefixed, "Hello")[0] == 7
