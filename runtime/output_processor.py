"""Turns per-step token updates into RequestOutputs: detokenizes, applies stop strings,
collects logprobs, and folds the n sequences of one request into one output."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any

from pagecast.runtime.detokenizer import IncrementalDetokenizer, decode_token
from pagecast.runtime.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from pagecast.runtime.request import Request, RequestStatus


@dataclass
class ParentRequest:
    """A user request: its prompt and its n child sequences."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    children: list[Request]
    detokenizers: dict[str, IncrementalDetokenizer | None] = field(default_factory=dict)

    @property
    def finished(self) -> bool:
        return all(c.is_finished for c in self.children)


class OutputProcessor:
    """``records_prompt_logprobs``: append the prompt logprobs a step returns to the sequences.
    Off when the sequences are the engine core's own objects (one process): the core has
    appended them already, since it computes the next chunk's targets from them."""

    def __init__(self, tokenizer: Any | None, records_prompt_logprobs: bool = True):
        self.tokenizer = tokenizer
        self.records_prompt_logprobs = records_prompt_logprobs
        self.parents: dict[str, ParentRequest] = {}
        self.children: dict[str, Request] = {}

    def add(self, parent: ParentRequest) -> None:
        for child in parent.children:
            parent.detokenizers[child.request_id] = (
                IncrementalDetokenizer(self.tokenizer, child.prompt_token_ids, child.sampling_params)
                if self.tokenizer is not None
                else None
            )
            self.children[child.request_id] = child
        self.parents[parent.request_id] = parent

    def _annotate(self, entries: PositionLogprobs) -> PositionLogprobs:
        if self.tokenizer is not None:
            for token_id, lp in entries.items():
                if lp.decoded_token is None:
                    lp.decoded_token = decode_token(self.tokenizer, token_id)
        return entries

    def process(
        self,
        updated: list[Request],
        logprobs: dict[str, PositionLogprobs],
        prompt_logprobs: dict[str, list[PositionLogprobs]],
        only_finished: bool = False,
    ) -> tuple[list[RequestOutput], list[str]]:
        """Returns the outputs of every parent touched this step (only the finished ones with
        ``only_finished``: offline batches need no intermediate outputs, and building them costs
        a copy of every sequence every step) and the ids of children that a stop string finished
        (the engine must release them in the scheduler)."""
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
            if child.logprobs is not None and child.request_id in logprobs:
                entry = self._annotate(logprobs[child.request_id])
                child.logprobs.append(entry)
                chosen = entry.get(child.output_token_ids[-1])
                if chosen is not None:
                    child.cumulative_logprob += chosen.logprob
            detok = parent.detokenizers.get(child.request_id)
            if detok is None:
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
            elif stop is not None:  # finished by length on the same token: the stop string wins
                child.stop_reason = stop
                child.status = RequestStatus.FINISHED_STOPPED
        parents = [p for p in touched.values() if p.finished] if only_finished else touched.values()
        return [self.make_output(p) for p in parents], stopped

    def live_sequences(self, parent_id: str) -> list[str] | None:
        """Ids of a request's unfinished sequences; None for an unknown or finished request."""
        parent = self.parents.get(parent_id)
        if parent is None:
            return None
        return [c.request_id for c in parent.children if not c.is_finished]

    def abort(self, parent_id: str) -> RequestOutput:
        """Mark a request's unfinished sequences aborted; its final output."""
        parent = self.parents[parent_id]
        now = time.monotonic()
        for child in parent.children:
            if child.status == RequestStatus.FINISHED_ABORTED and child.metrics.finished_time is not None:
                self.finish(child)  # aborted by the caller's scheduler just now
            elif not child.is_finished:
                child.status = RequestStatus.FINISHED_ABORTED
                child.metrics.finished_time = now
                self.finish(child)
        return self.make_output(parent)

    def remake_outputs(self, outputs: list[RequestOutput], stopped: list[str]) -> list[RequestOutput]:
        """After ``process`` reported sequences ended by a stop string: mark them stopped (where
        the caller has not) and replace their requests' outputs with up-to-date ones."""
        now = time.monotonic()
        touched = set()
        for rid in stopped:
            child = self.children[rid]
            if not child.is_finished:
                child.status = RequestStatus.FINISHED_STOPPED
                child.metrics.finished_time = now
            touched.add(child.parent_id)
        outputs = [o for o in outputs if o.request_id not in touched]
        for pid in touched:
            parent = self.parents.get(pid)
            if parent is not None:
                outputs.append(self.make_output(parent))
        return outputs

    def finish(self, child: Request) -> None:
        """A child finished outside the token path (stop string, abort): flush its text."""
        parent = self.parents.get(child.parent_id)
        if parent is None:
            return
        detok = parent.detokenizers.get(child.request_id)
        if detok is not None and child.status != RequestStatus.FINISHED_STOPPED:
            detok.update([], finished=True)

    def _child(self, request_id: str) -> Request | None:
        return self.children.get(request_id)

    def make_output(self, parent: ParentRequest) -> RequestOutput:
        outputs = []
        now = time.monotonic()
        for child in parent.children:
            detok = parent.detokenizers.get(child.request_id)
            outputs.append(
                CompletionOutput(
                    index=child.index,
                    text=detok.text if detok is not None else "",
                    token_ids=list(child.output_token_ids),
                    finish_reason=child.status.finish_reason,
                    stop_reason=child.stop_reason,
                    logprobs=list(child.logprobs) if child.logprobs is not None else None,
                    cumulative_logprob=child.cumulative_logprob if child.logprobs is not None else None,
                )
            )
        finished = parent.finished
        first = parent.children[0]
        if finished and first.metrics.finished_time is None:
            for child in parent.children:
                child.metrics.finished_time = now
        out = RequestOutput(
            request_id=parent.request_id,
            prompt=parent.prompt,
            prompt_token_ids=parent.prompt_token_ids,
            outputs=outputs,
            finished=finished,
            prompt_logprobs=list(first.prompt_logprobs) if first.prompt_logprobs is not None else None,
            metrics=dataclasses.replace(first.metrics),
        )
        if finished:
            del self.parents[parent.request_id]
            for child in parent.children:
                self.children.pop(child.request_id, None)
        return out
