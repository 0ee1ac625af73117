"""The front end's cost per engine step (issue 33): what the server's output side does with one
``StepOutputs`` message (every sequence's new token): mirror the token, detokenize, apply stop
strings, make the step's RequestOutputs. No model, no GPU: the CPU time of the output side
alone, at several output lengths, so a cost that grows with the length shows.

    python benchmarks/frontend_cost.py [--seqs 256] [--lengths 512,2048,8192] [--kinds delta,cumulative]
        [--logprobs 0] [--steps 20]

Each sequence is first grown to the length (its token list, its logprobs and its text set
directly, as many steps would have left them), then ``--steps`` steps of one token per sequence
are timed; the median step is reported, in ms of wall time and of this process's CPU time
(the latter holds on a machine shared with other work). Kinds: ``delta`` is what engine-serve's streams
use (each output holds only the step's new text and tokens), ``final`` what non-streaming
requests and LLM.generate use, ``cumulative`` a copy of everything per step (what every
request got before issue 33). Runs against older trees too (kinds they lack are skipped).
Prints one JSON line per figure. Informative, not a gate.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from typing import Any


def load_tokenizer(path: str | None) -> Any:
    from transformers import AutoTokenizer

    if path:
        return AutoTokenizer.from_pretrained(path)
    from pagecast.builder.load import resolve_model_path

    return AutoTokenizer.from_pretrained(str(resolve_model_path("smollm2-135m")))


def run(
    tokenizer: Any, kind: str, num_seqs: int, length: int, logprobs: int | None, steps: int, seed: int
) -> tuple[float, float]:
    """(median wall ms, median CPU ms) of one step."""
    from pagecast.runtime.output_processor import OutputProcessor, ParentRequest
    from pagecast.runtime.outputs import Logprob
    from pagecast.runtime.request import Request, RequestStatus
    from pagecast.runtime.sampling_params import SamplingParams

    extra: dict[str, Any] = {}
    if kind != "cumulative":
        from pagecast.runtime.sampling_params import RequestOutputKind

        extra["output_kind"] = RequestOutputKind.DELTA if kind == "delta" else RequestOutputKind.FINAL_ONLY
    rng = random.Random(seed)
    # Ordinary English tokens, so the detokenizer does its usual work (no stop strings).
    vocab = tokenizer.encode(
        "the quick brown fox jumps over the lazy dog while a model writes a long answer about "
        "streaming servers, tokens, caches and the cost of every step of an engine",
        add_special_tokens=False,
    )
    params = SamplingParams(max_tokens=length + steps + 8, logprobs=logprobs, **extra)
    op = OutputProcessor(tokenizer)
    children = []
    for i in range(num_seqs):
        prompt = [rng.choice(vocab) for _ in range(32)]
        child = Request(f"r{i}", prompt, params, max_tokens=params.max_tokens)
        child.status = RequestStatus.RUNNING
        op.add(ParentRequest(f"r{i}", None, prompt, [child]))
        # Grown to ``length`` tokens as earlier steps would have left it.
        history = [rng.choice(vocab) for _ in range(length)]
        child.output_token_ids.extend(history)
        child.all_token_ids.extend(history)
        if child.logprobs is not None:
            child.logprobs.extend({t: Logprob(-1.0, 1, None)} for t in history)
        parent = op.parents[f"r{i}"]
        detok = parent.detokenizers[child.request_id]
        text = tokenizer.decode(history[:64]) * (length // 64)
        if hasattr(detok, "_parts"):
            if detok._keep_text:
                detok._parts.append(text)
        else:
            detok.text = text  # trees before issue 33 keep one string
        if hasattr(parent, "num_sent_tokens"):
            parent.num_sent_tokens[child.request_id] = length
        children.append(child)

    times, cpu_times = [], []
    for _ in range(steps):
        new = {c.request_id: rng.choice(vocab) for c in children}
        start, cpu_start = time.perf_counter(), time.process_time()
        # What AsyncEngine._handle does with one StepOutputs message.
        updated = []
        lps = {}
        for child in children:
            token = new[child.request_id]
            child.append_output_token(token)
            if child.logprobs is not None:
                lps[child.request_id] = [{token: Logprob(-0.5, 1)}]
            updated.append(child)
        outputs, stopped = op.process(updated, lps, {})
        if stopped:
            op.remake_outputs(outputs, stopped)
        times.append(time.perf_counter() - start)
        cpu_times.append(time.process_time() - cpu_start)
    return statistics.median(times) * 1000, statistics.median(cpu_times) * 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqs", type=int, default=256)
    ap.add_argument("--lengths", default="512,2048,8192")
    ap.add_argument("--kinds", default="delta,final,cumulative")
    ap.add_argument("--logprobs", type=int, default=None, help="top logprobs per token (default: none asked)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--tokenizer", default=None, help="a tokenizer directory (default: the embedded SmolLM2's)")
    args = ap.parse_args()
    tokenizer = load_tokenizer(args.tokenizer)
    for kind in args.kinds.split(","):
        for length in (int(n) for n in args.lengths.split(",")):
            try:
                ms, cpu_ms = run(tokenizer, kind, args.seqs, length, args.logprobs, args.steps, seed=0)
            except ImportError:
                print(json.dumps({"figure": "frontend_step_ms", "kind": kind, "skipped": "not in this tree"}))
                break
            print(json.dumps({"figure": "frontend_step_ms", "kind": kind, "seqs": args.seqs, "output_tokens": length,
                              "logprobs": args.logprobs, "ms": round(ms, 2), "cpu_ms": round(cpu_ms, 2)}), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
