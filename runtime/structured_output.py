"""Constrained decoding (``response_format``): grammars, matchers and token bitmasks (xgrammar).

A request with ``SamplingParams.structured_output`` gets a grammar matcher in the engine core.
Before each of its tokens is sampled, the matcher writes the set of tokens that keep the output
valid into a bitmask row (on the host); the sampler sets every other token's logit to ``-inf``
on those rows only, and the matcher then accepts the token that was sampled. Unconstrained rows
are never touched, so their tokens are the same as without a constrained neighbour.

Asynchronous scheduling launches step N+1 before step N's tokens reach the host, but a matcher
must see token N before it can mask token N+1. The runner therefore queues step N+1's forward
pass first, then (only when the step samples a constrained request) waits for step N's tokens
(the engine waits for them right after the launch anyway), feeds them to the matchers, fills
the bitmask while the device runs the forward pass, and queues the sampling behind it. The cost
is the host's mask work on the step's critical path when it is longer than the forward pass.

Grammars are compiled in the engine core, once per distinct schema (the compiled grammars are
cached), on a thread pool of their own: a constrained request whose grammar is not compiled yet
waits outside the scheduler while every other request keeps running, and joins the batch once
its grammar is ready. The tokenizer information xgrammar needs is built on that pool too, from
the artifact's tokenizer, when the first constrained request arrives, so a server that never
sees one pays nothing at start.
Schemas are checked without a tokenizer where the request is made (``check_json_schema``), so a
schema the library cannot compile is refused there with the library's reason.
"""

from __future__ import annotations

import functools
import json
import os
import re
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from pagecast.runtime.request import Request

# xgrammar's messages start with "[hh:mm:ss] /project/cpp/file.cc:123: "; users need the rest.
_LOCATION = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*")
# The JSON the grammars allow: compact (no free whitespace), so that a model cannot fill its
# budget with blanks between tokens, which the default "any whitespace" grammar allows.
_COMPILE_OPTIONS: dict[str, Any] = {"any_whitespace": False}
# json_object: any object, with any keys.
_ANY_OBJECT = '{"type":"object"}'
_CACHE_SIZE = 512  # compiled grammars kept in the engine core
# xgrammar (0.2.9) writes the characters of a string with minLength / maxLength as the class
# below, which lets the control characters U+0000-U+001F other than CR and LF through raw; JSON
# requires them escaped, so such an output fails json.loads (seen: a vertical tab in a name with
# "maxLength": 12). Its unbounded strings already exclude them. Every JSON-schema grammar is
# rewritten with the class JSON allows unescaped.
_LOOSE_STRING_CHARS = r'[^\"\\\r\n]'
_JSON_STRING_CHARS = r'[^\0-\x1f\"\\]'


def json_schema_ebnf(schema: str, strict_mode: bool = True) -> str:
    """The EBNF of xgrammar's grammar for ``schema`` (JSON text), compact, with every string
    character class admitting only what JSON allows unescaped."""
    import xgrammar

    text = str(xgrammar.Grammar.from_json_schema(schema, strict_mode=strict_mode, **_COMPILE_OPTIONS))
    return text.replace(_LOOSE_STRING_CHARS, _JSON_STRING_CHARS)


GrammarKey = tuple[str, str | None]  # StructuredOutput.key: the type and the constraint as text
# Threads xgrammar's BatchGrammarMatcher fills a step's mask rows with: half the cores (the
# engine loop and the grammar compiles need the rest), at most 8 (a step's constrained rows
# take well under a millisecond each; more threads cost more to wake than they save).
DEFAULT_FILL_THREADS = min(8, max(1, (os.cpu_count() or 2) // 2))


def _reason(exc: BaseException) -> str:
    lines = [line for line in str(exc).strip().splitlines() if line.strip()]
    text = _LOCATION.sub("", lines[0] if lines else type(exc).__name__)
    return text.replace("Check failed: (error.empty()) is false: ", "")


def _check(what: str, compile_grammar: Callable[[], Any]) -> None:
    """Raise ``ValueError("structured_output the WHAT cannot be compiled: ...")`` when xgrammar
    refuses it; the library reports every problem as RuntimeError, so any exception counts."""
    try:
        compile_grammar()
    except Exception as exc:  # noqa: BLE001
        raise ValueError(f"structured_output the {what} cannot be compiled: {_reason(exc)}") from None


@functools.lru_cache(maxsize=256)
def check_json_schema(schema: str) -> None:
    """Raise ``ValueError("structured_output ...")`` when xgrammar cannot compile ``schema`` (JSON
    text); cached, so a schema sent again costs a dictionary look-up."""
    import xgrammar

    _check("JSON schema", lambda: xgrammar.Grammar.from_json_schema(schema, **_COMPILE_OPTIONS))


@functools.lru_cache(maxsize=256)
def check_regex(pattern: str) -> None:
    """Raise ``ValueError("structured_output ...")`` when xgrammar cannot compile ``pattern``."""
    import xgrammar

    _check("regex", lambda: xgrammar.Grammar.from_regex(pattern))


@functools.lru_cache(maxsize=256)
def check_grammar(ebnf: str) -> None:
    """Raise ``ValueError("structured_output ...")`` when xgrammar cannot parse ``ebnf``."""
    import xgrammar

    _check("grammar", lambda: xgrammar.Grammar.from_ebnf(ebnf))


_EBNF_ESCAPES = {"\\": "\\\\", '"': '\\"', "\n": "\\n", "\r": "\\r", "\t": "\\t"}


def ebnf_literal(text: str) -> str:
    """``text`` as a quoted string of xgrammar's EBNF."""
    out = []
    for ch in text:
        if ch in _EBNF_ESCAPES:
            out.append(_EBNF_ESCAPES[ch])
        elif ord(ch) < 0x20:
            out.append(f"\\x{ord(ch):02x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def choice_grammar(choices: list[str] | tuple[str, ...]) -> str:
    """An EBNF grammar whose only sentences are ``choices`` (vLLM's ``guided_choice``)."""
    return "root ::= " + " | ".join(ebnf_literal(c) for c in choices)


class _Constrained:
    """One constrained sequence: its matcher, how many of its output tokens it has seen, and the
    token that starts the constraint while it has not come yet (``SamplingParams.
    structured_output_after``: the output is free, and the matcher not fed, up to and including
    that token)."""

    __slots__ = ("fed", "matcher", "request", "waiting_for")

    def __init__(self, request: Request, matcher: Any):
        self.request = request
        self.matcher = matcher
        self.fed = 0
        self.waiting_for: int | None = request.sampling_params.structured_output_after

    def take(self, tokens: list[int]) -> None:
        """Feed the sequence's next output tokens: to the matcher once the constraint has started."""
        for token in tokens:
            if self.waiting_for is not None:
                if token == self.waiting_for:
                    self.waiting_for = None
                continue
            # Every token was sampled under this matcher's mask, so it is accepted; a stop
            # token ends the matcher, and the request with it.
            self.matcher.accept_token(token)
        self.fed += len(tokens)


class GrammarState:
    """The engine core's matchers, one per live constrained sequence, and the compiler.

    Grammars compile on a small thread pool of their own, never on the engine loop's thread:
    ``prepare`` returns a future of the compiled grammar (done at once when it is cached), the
    core holds the request back until that future is done, then ``collect`` gives the grammar
    and ``add`` the request's matchers. The compiler itself (the artifact's tokenizer, loaded
    by ``tokenizer_source``, and xgrammar's tokenizer information) is built on that pool too,
    by the first compile: the engine-core process loads no tokenizer at start, and the step
    loop never waits for one. xgrammar's compiles release the GIL, so the loop runs on beside
    them (loading the tokenizer is Python: it shares the GIL with the loop, in slices).

    Thread use: everything but ``_compile`` (and the compiler it builds) runs on the engine
    loop's thread; the cache and the table of compiles in progress are that thread's alone.
    """

    def __init__(
        self,
        tokenizer_source: Callable[[], Any],
        vocab_size: int,
        eos_token_ids: frozenset[int],
        fill_threads: int = DEFAULT_FILL_THREADS,
        compile_threads: int = 2,
    ):
        self._tokenizer_source = tokenizer_source
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self._compiler: Any = None
        # Taken by the compile threads: the compiler is built once, whichever compile needs it first.
        self._lock = threading.Lock()
        self.matchers: dict[str, _Constrained] = {}
        self._bitmask: torch.Tensor | None = None  # [rows, words] int32 on the host, reused
        self.fill_threads = fill_threads
        self._batch_matcher: Any = None  # xgrammar.BatchGrammarMatcher, made on the first mask
        self._compiled: OrderedDict[GrammarKey, Any] = OrderedDict()
        self.compile_threads = compile_threads
        self._pool: ThreadPoolExecutor | None = None  # made on the first compile
        # Compiles in progress (or done and not yet moved into the cache), one per distinct key:
        # requests with the same schema that arrive while it compiles share it.
        self.compiling: dict[GrammarKey, Future[Any]] = {}
        self.num_compiled = 0

    @property
    def active(self) -> bool:
        return bool(self.matchers)

    def compiler(self) -> Any:
        with self._lock:
            if self._compiler is None:
                import xgrammar

                tokenizer = self._tokenizer_source()
                if tokenizer is None:
                    raise ValueError("structured_output needs the artifact's tokenizer, and this artifact has none")
                info = xgrammar.TokenizerInfo.from_huggingface(
                    tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.eos_token_ids or None
                )
                self._compiler = xgrammar.GrammarCompiler(info, max_threads=2)
            return self._compiler

    def prepare(self, key: GrammarKey) -> Future[Any]:
        """A future of the compiled grammar of a ``StructuredOutput.key``: already done when it is
        cached, else the compile in progress for that key, or a new one on the compile pool.
        Its exception, when it fails, is ``ValueError("structured_output ...")``."""
        self.poll()
        compiled = self._compiled.get(key)
        if compiled is not None:
            self._compiled.move_to_end(key)
            done: Future[Any] = Future()
            done.set_result(compiled)
            return done
        future = self.compiling.get(key)
        if future is None:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.compile_threads, thread_name_prefix="pagecast-grammar")
            future = self.compiling[key] = self._pool.submit(self._compile, key)
        return future

    def poll(self) -> None:
        """Move finished compiles into the cache (failed or cancelled ones are only forgotten:
        their requests read the error from the future they hold)."""
        for key, future in list(self.compiling.items()):
            if future.done():
                del self.compiling[key]
                if not future.cancelled() and future.exception() is None:
                    self._remember(key, future.result())

    def collect(self, key: GrammarKey, future: Future[Any]) -> Any:
        """The compiled grammar of a done ``prepare(key)`` future (``ValueError`` when it failed)."""
        self.poll()
        return future.result()

    def forget(self, key: GrammarKey, future: Future[Any]) -> None:
        """No request waits for ``future`` any more: cancel its compile when it has not started
        (one that has runs to its end, and its grammar is cached for the next request)."""
        if self.compiling.get(key) is future and future.cancel():
            del self.compiling[key]

    def compile(self, key: GrammarKey) -> Any:
        """The compiled grammar of a ``StructuredOutput.key``, waiting for it: compiled once per
        distinct schema, the most recently used ``_CACHE_SIZE`` kept."""
        future = self.prepare(key)
        futures.wait([future])
        return self.collect(key, future)

    def _remember(self, key: GrammarKey, compiled: Any) -> None:
        self._compiled[key] = compiled
        self._compiled.move_to_end(key)
        if len(self._compiled) > _CACHE_SIZE:
            self._compiled.popitem(last=False)

    def _compile(self, key: GrammarKey) -> Any:
        """Runs on the compile pool."""
        kind, schema = key
        with self._lock:
            self.num_compiled += 1
        try:
            compiler = self.compiler()
            if kind == "regex":
                return compiler.compile_regex(schema)
            if kind == "choice":
                return compiler.compile_grammar(choice_grammar(json.loads(schema or "[]")))
            if kind == "grammar":
                return compiler.compile_grammar(schema)
            return compiler.compile_grammar(
                json_schema_ebnf(_ANY_OBJECT if kind == "json_object" else schema or "", strict_mode=kind != "json_object")
            )
        except ValueError:
            raise
        except Exception as exc:  # noqa: BLE001 - compile errors are the schema's
            what = {"regex": "regex", "choice": "choice", "grammar": "grammar"}.get(kind, "JSON schema")
            raise ValueError(f"structured_output the {what} cannot be compiled: {_reason(exc)}") from None

    def add(self, requests: list[Request], compiled: Any) -> None:
        """Give each sequence of one request a matcher of its ``compiled`` grammar."""
        import xgrammar

        for request in requests:
            self.matchers[request.request_id] = _Constrained(request, xgrammar.GrammarMatcher(compiled))

    def drop(self, request_ids: list[str] | set[str]) -> None:
        for request_id in request_ids:
            self.matchers.pop(request_id, None)

    def bitmask(
        self, requests: list[Request], pending_token: Callable[[Request], int] | None = None
    ) -> tuple[list[int], torch.Tensor] | None:
        """(rows of ``requests`` that are constrained, their bitmask ``[len(rows), words]`` on the
        host), or None when none is. Each matcher first accepts the output tokens it has not
        seen: those on the request, then the one still pending (sampled by the step in flight,
        given by ``pending_token``)."""
        import xgrammar

        rows: list[int] = []
        states: list[_Constrained] = []
        for i, request in enumerate(requests):
            state = self.matchers.get(request.request_id)
            if state is not None and state.request is request:
                rows.append(i)
                states.append(state)
        if not rows:
            return None
        shape = xgrammar.get_bitmask_shape(len(rows), self.vocab_size)
        if self._bitmask is None or self._bitmask.shape[0] < shape[0]:
            self._bitmask = xgrammar.allocate_token_bitmask(max(shape[0], 8), self.vocab_size)
        bitmask = self._bitmask[: shape[0]]
        live: list[Any] = []  # the matchers that still mask, and their rows of ``bitmask``
        live_rows: list[int] = []
        for j, state in enumerate(states):
            request = state.request
            tokens = request.output_token_ids[state.fed :]
            if request.num_pending_tokens:
                if pending_token is None:
                    raise RuntimeError(f"request {request.request_id!r}: its pending token is not known")
                tokens = [*tokens, pending_token(request)]
            state.take(tokens)
            if state.waiting_for is not None:
                bitmask[j].fill_(-1)  # before the constraint starts: every token allowed
            elif state.matcher.is_terminated():
                # It accepted its stop token in the step in flight: the request ends when that
                # token is booked, and what this step samples for it is never used.
                bitmask[j].fill_(-1)
            else:
                live.append(state.matcher)
                live_rows.append(j)
        if live:
            # Every row at once, on xgrammar's threads with the GIL released: the same masks as
            # filling the rows one by one with each matcher's fill_next_token_bitmask.
            if self._batch_matcher is None:
                self._batch_matcher = xgrammar.BatchGrammarMatcher(max_threads=self.fill_threads)
            self._batch_matcher.batch_fill_next_token_bitmask(live, bitmask, live_rows)
        return rows, bitmask


    def draft_bitmask(self, spec: list[tuple[Request, int, list[int]]]) -> tuple[list[int], torch.Tensor] | None:
        """The masks of a speculating step's positions (speculative decoding): for each request,
        its ``len(drafts) + 1`` positions in turn, as ``bitmask`` lays out rows (rows counted over
        every request's positions, constrained or not). Position ``j`` is masked as if drafts
        ``0..j-1`` had been accepted: the matcher accepts them one by one, then rolls back. A
        draft the grammar rejects can never be the target's token at its position, so
        verification stops there; the positions after it are left unmasked (never used)."""
        import xgrammar

        rows: list[int] = []
        plan: list[tuple[_Constrained, list[int]]] = []
        offset = 0
        for request, _, drafts in spec:
            state = self.matchers.get(request.request_id)
            if state is not None and state.request is request:
                rows.extend(range(offset, offset + len(drafts) + 1))
                plan.append((state, drafts))
            offset += len(drafts) + 1
        if not rows:
            return None
        bitmask = xgrammar.allocate_token_bitmask(len(rows), self.vocab_size)
        row = 0
        for state, drafts in plan:
            request = state.request
            state.take(request.output_token_ids[state.fed :])
            matcher = state.matcher
            accepted = 0
            waiting = state.waiting_for  # the drafts before the starting token are free too
            for j in range(len(drafts) + 1):
                if waiting is not None:
                    bitmask[row + j].fill_(-1)
                    if j < len(drafts) and drafts[j] == waiting:
                        waiting = None
                    continue
                if matcher.is_terminated():
                    bitmask[row + j :].narrow(0, 0, len(drafts) + 1 - j).fill_(-1)
                    break
                matcher.fill_next_token_bitmask(bitmask, row + j)
                if j == len(drafts):
                    break
                if not matcher.accept_token(drafts[j]):
                    bitmask[row + j + 1 :].narrow(0, 0, len(drafts) - j).fill_(-1)
                    break
                accepted += 1
            if accepted:
                matcher.rollback(accepted)
            row += len(drafts) + 1
        return rows, bitmask


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """``-inf`` in place for the tokens ``bitmask`` (one row per row of ``logits``) rules out."""
    import xgrammar

    if logits.device.type == "cpu":
        # Its C++ kernel: the default on the CPU compiles a torch function on first use (slow).
        xgrammar.apply_token_bitmask_inplace(logits, bitmask, backend="cpu")
        return
    xgrammar.apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True))


def tokenizer_loader(artifact_path: Path, loaded: Any) -> Callable[[], Any]:
    """The artifact's tokenizer: the one already loaded, or loaded from disk on first call."""
    from pagecast.runtime.loader import load_artifact_tokenizer

    return lambda: loaded if loaded is not None else load_artifact_tokenizer(Path(artifact_path))
