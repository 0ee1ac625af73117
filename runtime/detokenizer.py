"""Incremental detokenization: token ids in, text that is safe to show out, stop strings found.

Decoding the whole output again at every step costs O(length) per token and O(length^2) per
request. Instead each step decodes a small window of ids twice: the ids already shown since the
last commit point (the "prefix" window) and the same window plus the new ids. The new text is
the difference. A window is needed rather than the new ids alone because tokenizers decode
differently at the start of a string (SentencePiece drops the leading space of the first
piece) and because byte-level pieces only make characters together. The idea is the one vLLM
and text-generation-inference use; the code is ours.

Text is held back in two cases, and released as soon as the reason goes away:

- the window ends in U+FFFD: a multi-byte UTF-8 character split across byte-level tokens is
  not complete yet (the next token usually completes it);
- the end of the text could be the start of a stop string.

So ``text`` only grows and never has to be taken back, which is what streaming clients need.
"""

from __future__ import annotations

import functools
from typing import Any

from pagecast.runtime.sampling_params import SamplingParams

# How many prompt tokens are decoded as left context for the first output tokens, so that the
# first output token decodes as a continuation (keeping its leading space) rather than as the
# start of a text. A few are enough to start at a character boundary in practice.
_PROMPT_CONTEXT_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Turns one request's output ids into text, a few ids at a time, and finds stop strings.

    ``text`` holds the output text that is safe to show: it never ends in half a character,
    never holds a stop string (unless ``include_stop_str_in_output``) nor text that could still
    become one, and only grows. It is final once ``update`` returned a stop string or was
    called with ``finished=True``.
    """

    def __init__(
        self, tokenizer: Any, prompt_token_ids: list[int], params: SamplingParams, keep_text: bool = True
    ):
        self.tokenizer = tokenizer
        self.params = params
        # Released text: all of it (``text``, joined when read) unless ``keep_text`` is False (a
        # stream of deltas needs only ``take_new_text``), and what ``take_new_text`` has not
        # handed out yet. Pieces, not one string grown with +=, which would copy the whole text
        # at every token.
        self._keep_text = keep_text
        self._parts: list[str] = []
        self._fresh: list[str] = []
        # The stop string that ended the request, once one has.
        self.stop_string: str | None = None
        self.num_output_tokens = 0
        self._finished = False
        # Window of ids still needed for decoding: ids[:read] were shown (ids[:prefix] only as
        # context for the decoder), ids[read:] wait for a character to complete.
        self._ids: list[int] = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._prefix_text = self._decode(self._ids)
        # Decoded output text not yet moved to ``text``: a possible start of a stop string.
        self._pending = ""
        self._stops = params.stop
        self._max_stop_len = max((len(s) for s in self._stops), default=0)

    @property
    def finished(self) -> bool:
        return self._finished

    @property
    def text(self) -> str:
        """All the text released so far (costs a join of the pieces since the last read)."""
        if not self._keep_text:
            raise RuntimeError("this detokenizer keeps no text (keep_text=False): use take_new_text()")
        if len(self._parts) > 1:
            self._parts[:] = ["".join(self._parts)]
        return self._parts[0] if self._parts else ""

    def take_new_text(self) -> str:
        """The text released since the last call (what a stream of deltas sends next)."""
        if not self._fresh:
            return ""
        new = self._fresh[0] if len(self._fresh) == 1 else "".join(self._fresh)
        self._fresh.clear()
        return new

    def _release(self, text: str) -> None:
        if text:
            if self._keep_text:
                self._parts.append(text)
            self._fresh.append(text)

    def update(self, new_token_ids: list[int], finished: bool = False, stop_terminated: bool = False) -> str | None:
        """Add the next output ids. Returns the stop string that matched (the request must then
        finish; ``text`` is cut before it, or after it with ``include_stop_str_in_output``, and
        ids after it are ignored), else None. ``finished=True`` (eos, length, abort) releases
        everything held back, a trailing incomplete character included.

        ``stop_terminated``: the last id is the stop token that ended the sequence (end of
        sequence, or one of ``stop_token_ids``). Like a stop string, its text is left out unless
        ``include_stop_str_in_output`` (so a JSON answer that ends on ``<|im_end|>`` with
        ``skip_special_tokens=False`` still parses); it is still one of the output's ids.
        """
        if self._finished:
            return None
        skip_last = stop_terminated and bool(new_token_ids) and not self.params.include_stop_str_in_output
        for i, token_id in enumerate(new_token_ids):
            self.num_output_tokens += 1
            if skip_last and i == len(new_token_ids) - 1:
                finished = True
                break
            self._ids.append(token_id)
            stop = self._advance(self._step())
            if stop is not None:
                return stop
        if finished:
            # No more ids will come: show the rest even if it ends in an incomplete character.
            stop = self._advance(self._step(flush=True))
            if stop is None:
                self._release(self._pending)
                self._pending = ""
            self._finished = True
            return stop
        return None

    def _step(self, flush: bool = False) -> str:
        """The new text the window's unread ids complete ("" while a character is still open)."""
        if self._read_offset == len(self._ids):
            return ""
        new_text = self._decode(self._ids[self._prefix_offset :])
        if len(new_text) <= len(self._prefix_text) or (new_text.endswith(_REPLACEMENT_CHAR) and not flush):
            return ""
        delta = new_text[len(self._prefix_text) :]
        # The ids just read become the next window's context; older ids are no longer needed.
        del self._ids[: self._read_offset]
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._prefix_text = self._decode(self._ids)
        return delta

    def _advance(self, delta: str) -> str | None:
        """Append decoded text, then either stop at a stop string or release what is safe."""
        self._pending += delta
        if not self._stops:
            self._release(self._pending)
            self._pending = ""
            return None
        # As for eos and stop ids (Request.check_stop), the token that completes a stop string is
        # not one of the min_tokens: it must come after them.
        if delta and self.num_output_tokens > self.params.min_tokens:
            match = self._find_stop()
            if match is not None:
                start, stop = match
                end = start + len(stop) if self.params.include_stop_str_in_output else start
                self._release(self._pending[:end])
                self._pending = ""
                self.stop_string = stop
                self._finished = True
                return stop
        keep = self._partial_stop_length()
        if keep < len(self._pending):
            self._release(self._pending[: len(self._pending) - keep])
            self._pending = self._pending[len(self._pending) - keep :]
        return None

    def _find_stop(self) -> tuple[int, str] | None:
        """The earliest stop string in the pending text (ties: the shortest, which would have
        completed first). Text already in ``text`` can hold none: it was released only once no
        stop string could start in it."""
        best: tuple[int, str] | None = None
        for stop in self._stops:
            start = self._pending.find(stop)
            if start >= 0 and (best is None or (start, len(stop)) < (best[0], len(best[1]))):
                best = (start, stop)
        return best

    def _partial_stop_length(self) -> int:
        """Length of the longest end of the pending text that is a proper prefix of a stop
        string: that much must wait for the next ids."""
        pending = self._pending
        longest = 0
        for stop in self._stops:
            for length in range(min(len(stop) - 1, len(pending)), longest, -1):
                if pending.endswith(stop[:length]):
                    longest = length
                    break
        return longest

    def _decode(self, ids: list[int]) -> str:
        # No clean-up of tokenization spaces: it rewrites text across a window boundary
        # differently from a whole decode, and transformers skips it for BPE anyway.
        return self.tokenizer.decode(
            ids, skip_special_tokens=self.params.skip_special_tokens, clean_up_tokenization_spaces=False
        )


@functools.lru_cache(maxsize=1 << 18)
def decode_token(tokenizer: Any, token_id: int) -> str:
    """The text of one token on its own, for logprobs' ``decoded_token``.

    Decoded alone, so a byte-level piece of a multi-byte character shows as U+FFFD, the way
    the tokenizer decodes it; special tokens are shown (a client asking for logprobs wants to
    see ``<|im_end|>``). Cached: logprobs ask for the same few thousand tokens over and over.
    """
    return tokenizer.decode([token_id], skip_special_tokens=False, clean_up_tokenization_spaces=False)
