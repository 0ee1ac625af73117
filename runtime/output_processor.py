"""Turns per-step token updates into RequestOutputs: detokenizes, applies stop strings,
collects logprobs, and folds the n sequences of one request into one output.

Each request's ``output_kind`` says what its outputs hold. A DELTA output carries only what
the step added (new text, token ids and logprobs), so the work per step is the same at the
10th token and at the 10,000th: nothing here copies a sequence's history per step. A
FINAL_ONLY request gets one output, built once when it ends; a CUMULATIVE one gets a copy of
everything after every step (costs grow with the length: for callers that want snapshots).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any

from pagecast.runtime.detokenizer import IncrementalDetokenizer, decode_token
from pagecast.runtime.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from pagecast.runtime.request import Request, RequestStatus
from pagecast.runtime.sampling_params import RequestOutputKind


@dataclass
class ParentRequest:
    """A user request: its prompt, its n child sequences, and what its outputs have handed out
    so far (DELTA: the next output starts where these end)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    children: list[Request]
    detokenizers: dict[str, IncrementalDetokenizer | None] = field(default_factory=dict)
    # Per child: output tokens already in an output, and whether its end was reported.
    num_sent_tokens: dict[str, int] = field(default_factory=dict)
    sent_finished: set[str] = field(default_factory=set)
    prompt_logprobs_sent: bool = False

    @property
    def output_kind(self) -> RequestOutputKind:
        return self.children[0].sampling_params.output_kind

    @property
    def finished(self) -> bool:
        return all(c.is_finished for c in self.children)


class OutputProcessor:
    """Keeps the per-request state of the output side (detokenizers, what each output has
    handed out) and makes each step's RequestOutputs.

    ``records_prompt_logprobs``: append the prompt logprobs a step returns to the sequences.
    Off when the sequences are the engine core's own objects (one process): the core has
    appended them already, since it computes the next chunk's targets from them."""

    def __init__(self, tokenizer: Any | None, records_prompt_logprobs: bool = True):
        self.tokenizer = tokenizer
        self.records_prompt_logprobs = records_prompt_logprobs
        self.parents: dict[str, ParentRequest] = {}
        self.children: dict[str, Request] = {}
        # Sequences a stop string ended in ``process``, until ``remake_outputs`` records it (the
        # caller must first free them in the scheduler, which needs their running status).
        self._stopping: dict[str, Request] = {}

    def add(self, parent: ParentRequest) -> None:
        keep_text = parent.output_kind != RequestOutputKind.DELTA
        for child in parent.children:
            parent.detokenizers[child.request_id] = (
                IncrementalDetokenizer(self.tokenizer, child.prompt_token_ids, child.sampling_params, keep_text)
                if self.tokenizer is not None
                else None
            )
            parent.num_sent_tokens[child.request_id] = 0
            self.children[child.request_id] = child
        self.parents[parent.request_id] = parent

    def _annotate(self, entries: PositionLogprobs) -> PositionLogprobs:
        if self.tokenizer is not None:
            for token_id, lp in entries.items():
                if lp.decoded_token is None:
                    lp.decoded_token = decode_token(self.tokenizer, token_id)
        return entries

    def _feed_several(self, child: Request, detok: Any, num_new: int, stopped: list[str]) -> bool:
        """Feed all but the last of a sequence's several new tokens one by one; a stop string
        among them ends the sequence there (the tokens after it are dropped). True when it did;
        else the caller feeds the last token as usual."""
        ids = child.output_token_ids
        first = len(ids) - num_new
        for i in range(first, len(ids) - 1):
            stop = detok.update([ids[i]])
            if stop is None:
                continue
            drop = len(ids) - 1 - i
            if child.logprobs is not None and len(child.logprobs) == len(ids):
                for token_id, entry in zip(ids[-drop:], child.logprobs[-drop:]):
                    chosen = entry.get(token_id)
                    if chosen is not None:
                        child.cumulative_logprob -= chosen.logprob
                del child.logprobs[-drop:]
            del ids[-drop:]
            del child.all_token_ids[-drop:]
            child.stop_reason = stop
            if child.is_finished:
                child.status = RequestStatus.FINISHED_STOPPED
            else:
                stopped.append(child.request_id)
                self._stopping[child.request_id] = child
            return True
        return False

    def process(
        self,
        updated: list[Request],
        logprobs: dict[str, list[PositionLogprobs]],
        prompt_logprobs: dict[str, list[PositionLogprobs]],
        only_finished: bool = False,
        num_new_tokens: dict[str, int] | None = None,
    ) -> tuple[list[RequestOutput], list[str]]:
        """Returns the outputs of the parents touched this step, as their ``output_kind`` asks
        (with ``only_finished``, of the finished ones only, whatever the kind), and the ids of
        children that a stop string finished: the caller frees them in the scheduler, then
        calls ``remake_outputs``. The work is proportional to the step's new tokens.

        Each updated sequence got one new token (its last), or ``num_new_tokens[id]`` of them
        (speculative decoding); ``logprobs[id]`` holds one entry per new token. A stop string
        completed before the last of several new tokens drops the tokens after it."""
        touched: dict[str, ParentRequest] = {}
        stopped: list[str] = []
        for rid, entries in prompt_logprobs.items():
            child = self._child(rid)
            if child is not None and child.prompt_logprobs is not None:
                annotated = [self._annotate(e) for e in entries]
                if self.records_prompt_logprobs:
                    child.prompt_logprobs.extend(annotated)
                touched[child.parent_id] = self.parents[child.parent_id]
        for child in updated:
            parent = self.parents.get(child.parent_id)
            if parent is None:
                continue
            touched[parent.request_id] = parent
            num_new = num_new_tokens.get(child.request_id, 1) if num_new_tokens else 1
            if child.logprobs is not None and child.request_id in logprobs:
                new_ids = child.output_token_ids[-num_new:]
                for token_id, entry in zip(new_ids, logprobs[child.request_id]):
                    entry = self._annotate(entry)
                    child.logprobs.append(entry)
                    chosen = entry.get(token_id)
                    if chosen is not None:
                        child.cumulative_logprob += chosen.logprob
            detok = parent.detokenizers.get(child.request_id)
            if detok is None:
                continue
            if num_new > 1 and self._feed_several(child, detok, num_new, stopped):
                continue
            # A status of FINISHED_STOPPED here comes from a stop token (stop strings are found
            # below): its text is left out of the output.
            stop = detok.update(
                [child.output_token_ids[-1]],
                finished=child.is_finished,
                stop_terminated=child.status == RequestStatus.FINISHED_STOPPED,
            )
            if stop is not None and not child.is_finished:
                child.stop_reason = stop
                stopped.append(child.request_id)
                self._stopping[child.request_id] = child
            elif stop is not None:  # finished by length on the same token: the stop string wins
                child.stop_reason = stop
                child.status = RequestStatus.FINISHED_STOPPED
        outputs = []
        for parent in touched.values():
            if (only_finished or parent.output_kind == RequestOutputKind.FINAL_ONLY) and not self._finished(parent):
                continue
            out = self.make_output(parent)
            if out is not None:
                outputs.append(out)
        return outputs, stopped

    def live_sequences(self, parent_id: str) -> list[str] | None:
        """Ids of a request's unfinished sequences; None for an unknown or finished request."""
        parent = self.parents.get(parent_id)
        if parent is None:
            return None
        return [c.request_id for c in parent.children if not self._is_finished(c)]

    def abort(self, parent_id: str) -> RequestOutput:
        """Mark a request's unfinished sequences aborted; its final output."""
        parent = self.parents[parent_id]
        now = time.monotonic()
        for child in parent.children:
            if child.status == RequestStatus.FINISHED_ABORTED and child.metrics.finished_time is not None:
                self.finish(child)  # aborted by the caller's scheduler just now
            elif not self._is_finished(child):
                child.status = RequestStatus.FINISHED_ABORTED
                child.metrics.finished_time = now
                self.finish(child)
        out = self.make_output(parent)
        assert out is not None  # a finished request always has a last output
        return out

    def remake_outputs(self, outputs: list[RequestOutput], stopped: list[str]) -> list[RequestOutput]:
        """After ``process`` reported sequences ended by a stop string (and the caller freed
        them): mark them stopped where the caller has not. ``process``'s outputs already show
        them finished; they are returned as they are."""
        now = time.monotonic()
        for rid in stopped:
            child = self._stopping.pop(rid, None)
            if child is not None and not child.is_finished:
                child.status = RequestStatus.FINISHED_STOPPED
                child.metrics.finished_time = now
        return outputs

    def finish(self, child: Request) -> None:
        """A child finished outside the token path (abort): flush its text."""
        parent = self.parents.get(child.parent_id)
        if parent is None:
            return
        detok = parent.detokenizers.get(child.request_id)
        if detok is not None and child.status != RequestStatus.FINISHED_STOPPED:
            detok.update([], finished=True)

    def _child(self, request_id: str) -> Request | None:
        return self.children.get(request_id)

    def _is_finished(self, child: Request) -> bool:
        return child.is_finished or child.request_id in self._stopping

    def _finished(self, parent: ParentRequest) -> bool:
        return all(self._is_finished(c) for c in parent.children)

    def make_output(self, parent: ParentRequest) -> RequestOutput | None:
        """The parent's output now, as its ``output_kind`` asks; None for a DELTA request with
        nothing new. A finished parent is forgotten."""
        delta = parent.output_kind == RequestOutputKind.DELTA
        outputs = []
        now = time.monotonic()
        for child in parent.children:
            rid = child.request_id
            detok = parent.detokenizers.get(rid)
            stopping = rid in self._stopping
            done = child.is_finished or stopping
            finish_reason = "stop" if stopping else child.status.finish_reason
            if delta:
                sent = parent.num_sent_tokens[rid]
                num_tokens = len(child.output_token_ids)
                if num_tokens == sent and (not done or rid in parent.sent_finished):
                    continue  # nothing new for this choice
                parent.num_sent_tokens[rid] = num_tokens
                if done:
                    parent.sent_finished.add(rid)
                text = detok.take_new_text() if detok is not None else ""
                token_ids = child.output_token_ids[sent:]
                logprobs = child.logprobs[sent:] if child.logprobs is not None else None
            else:
                text = detok.text if detok is not None else ""
                token_ids = list(child.output_token_ids)
                logprobs = list(child.logprobs) if child.logprobs is not None else None
            outputs.append(
                CompletionOutput(
                    index=child.index,
                    text=text,
                    token_ids=token_ids,
                    finish_reason=finish_reason,
                    stop_reason=child.stop_reason if done else None,
                    logprobs=logprobs,
                    cumulative_logprob=child.cumulative_logprob if child.logprobs is not None else None,
                )
            )
        finished = self._finished(parent)
        first = parent.children[0]
        prompt_logprobs = first.prompt_logprobs
        if prompt_logprobs is not None:
            if not delta:
                prompt_logprobs = list(prompt_logprobs)
            elif parent.prompt_logprobs_sent or len(prompt_logprobs) < len(parent.prompt_token_ids):
                prompt_logprobs = None  # a delta carries them once, complete
            else:
                parent.prompt_logprobs_sent = True
        if delta and not outputs and not finished:
            return None
        if finished and first.metrics.finished_time is None:
            for child in parent.children:
                child.metrics.finished_time = now
        out = RequestOutput(
            request_id=parent.request_id,
            prompt=parent.prompt,
            prompt_token_ids=parent.prompt_token_ids,
            outputs=outputs,
            finished=finished,
            prompt_logprobs=prompt_logprobs,
            metrics=dataclasses.replace(first.metrics),
        )
        if finished:
            del self.parents[parent.request_id]
            for child in parent.children:
                self.children.pop(child.request_id, None)
        return out
