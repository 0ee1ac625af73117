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
    def __init__(self, tokenizer: Any | None):
        self.tokenizer = tokenizer
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
                child.prompt_logprobs.extend(self._annotate(e) for e in entries)
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
            stop = detok.update([child.output_token_ids[-1]], finished=child.is_finished)
            if stop is not None and not child.is_finished:
                child.stop_reason = stop
                stopped.append(child.request_id)
            elif stop is not None:  # finished by length on the same token: the stop string wins
                child.stop_reason = stop
                child.status = RequestStatus.FINISHED_STOPPED
        parents = [p for p in touched.values() if p.finished] if only_finished else touched.values()
        return [self.make_output(p) for p in parents], stopped

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
