"""Text to token ids: what transformers' ``tokenizer.encode(text, add_special_tokens=...)``
returns, without holding the GIL for a long text.

The server tokenizes in worker threads so that its event loop keeps answering /health and
the running streams; that only helps while the thread lets go of the GIL. transformers'
``encode`` runs the Rust ``encode_batch`` (which releases the GIL), but it also builds an
``Encoding`` with a string and an offset pair per token, and dropping that object frees them
all under the GIL: 0.13 s for the ~1M tokens of 4 Mi characters, on top of converting the
ids and the attention mask to lists. ``encode_batch_fast`` runs the same pipeline
(normalizer, pre-tokenizer, model, post-processor) without tracking offsets: its ``Encoding``
drops in ~1 ms, and the whole call takes half the time.
"""

from __future__ import annotations

from typing import Any

__all__ = ["encode_text"]


def encode_text(tokenizer: Any, text: str, add_special_tokens: bool = False) -> list[int]:
    """``tokenizer.encode(text, add_special_tokens=add_special_tokens)`` as a ``list[int]``.

    A transformers tokenizer backed by the ``tokenizers`` library, used with its stock
    ``encode`` and with neither truncation nor padding set on its backend, is run through
    ``encode_batch_fast`` as transformers would run ``encode_batch``: the same ids. Any
    other tokenizer (a Python one, a subclass with its own encoding, a backend with
    truncation or padding configured) is called as it is."""
    backend = _fast_backend(tokenizer)
    if backend is None:
        return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))
    # transformers sets this from split_special_tokens before each call; so do we.
    split_special = bool(getattr(tokenizer, "split_special_tokens", False))
    if backend.encode_special_tokens != split_special:
        backend.encode_special_tokens = split_special
    (encoding,) = backend.encode_batch_fast([text], add_special_tokens=add_special_tokens)
    return encoding.ids  # type: ignore[no-any-return]


def _fast_backend(tokenizer: Any) -> Any | None:
    try:
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:  # transformers without the tokenizers backend module
        return None
    if not isinstance(tokenizer, TokenizersBackend):
        return None
    cls = type(tokenizer)
    # A subclass that encodes in its own way (a prefix space, a legacy mode) keeps it.
    if any(
        getattr(cls, name) is not getattr(TokenizersBackend, name)
        for name in ("encode", "_encode_plus", "__call__")
    ):
        return None
    backend = getattr(tokenizer, "_tokenizer", None)
    if backend is None or not hasattr(backend, "encode_batch_fast"):
        return None  # tokenizers older than 0.20
    if backend.truncation is not None or backend.padding is not None:
        return None  # transformers would reset them for encode; leave that to it
    return backend
