"""The sampler alone on one GPU: the fused kernels against the sampler's previous torch code.

Random bf16 logits of the decode step the end-to-end benchmark runs (512 rows, Llama-3's 128,256
columns), one request per row, timed with CUDA events for:

  greedy        temperature 0
  sampling      temperature 0.8, top-p 0.95, top-k 50
  seeded        the same, seeded per request
  min_p         temperature 1.0, min-p 0.05 (no top-k: every token passes the cutoff)
  logprobs5     logprobs 5 of the sampled tokens (the logprob part alone)
  sampling+lp5  sampling and logprobs 5, as a decode step with logprobs runs them

"old" is the sampler as it was before kernels/sampling.py (kept below, verbatim in its torch
operations: an fp32 copy, temperature, topk-based masks over the full vocabulary, softmax, a
noise tensor, a divide, an argmax; log_softmax, gather, a comparison and topk for logprobs);
"new" is ``runtime.sampler`` as the engine calls it (``sample_token_ids``, ``logprob_tensors``).

Before timing it checks the new path against its torch reference on the GPU (the sampler with
``truncation.use_kernels`` off): seeded tokens identical, logprobs within 1e-5 of log_softmax,
ranks identical.

    python benchmarks/sampler_micro.py [--rows 512] [--vocab 128256] [--iters 50] [--out DIR]

Prints a table and one JSON line per figure (also to OUT/sampler_micro.jsonl with --out).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from pagecast.runtime import truncation
from pagecast.runtime.request import Request
from pagecast.runtime.sampler import logprob_tensors, sample_token_ids
from pagecast.runtime.sampling_params import SamplingParams

# --- the previous sampler (commit a326d39), for the "old" column -------------------------------


def _old_noise(requests: list[Request], like: torch.Tensor) -> torch.Tensor:
    from pagecast.kernels.keyed_noise import keyed_exponential

    seeded = [i for i, r in enumerate(requests) if r.seed_key is not None]
    if not seeded:
        return torch.empty_like(like).exponential_()
    keys = torch.tensor([requests[i].seed_key for i in seeded], device=like.device)
    offsets = torch.tensor([requests[i].num_output_tokens for i in seeded], device=like.device)
    keyed = keyed_exponential(keys, offsets, like.shape[1])
    if len(seeded) == len(requests):
        return keyed
    noise = torch.empty_like(like).exponential_()
    return noise.index_copy_(0, torch.tensor(seeded, device=like.device), keyed)


def _old_top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    device = logits.device
    k = torch.tensor(top_k, device=device).unsqueeze(1)
    top_values, top_ids = logits.topk(max(top_k), dim=-1)
    kth_value = top_values.gather(1, k - 1)
    remove_top = top_values < kth_value
    remove = logits < kth_value
    if any(p < 1.0 for p in top_p):
        outside = (logits == kth_value).sum(dim=-1, keepdim=True) - (top_values == kth_value).sum(dim=-1, keepdim=True)
        values = torch.cat([kth_value, top_values.masked_fill(remove_top, float("-inf")).flip(1)], dim=1)
        weights = torch.cat([outside.float(), torch.ones_like(top_values)], dim=1)
        probs = weights * torch.exp(values - top_values[:, :1])
        cumulative = (probs / probs.sum(dim=-1, keepdim=True)).cumsum(dim=-1)
        p = torch.tensor(top_p, device=device).unsqueeze(1)
        nucleus_out = cumulative <= (1 - p)
        remove_top = remove_top | nucleus_out[:, 1:].flip(1)
        q = cumulative[:, :1] / outside.clamp_min(1)
        num_out = torch.minimum(torch.floor((1 - p) / q.clamp_min(torch.finfo(torch.float32).tiny)), outside.float())
        tied = (logits == kth_value).scatter(1, top_ids, False)
        remove = remove | (tied & (tied.cumsum(dim=-1, dtype=torch.int32) <= num_out))
    remove_top[:, 0] = False
    remove = remove.scatter(1, top_ids, remove_top)
    return logits.masked_fill(remove, float("-inf"))


def old_sample_token_ids(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    work = logits.float()
    token_ids = work.argmax(dim=-1)
    params = [r.sampling_params for r in requests]
    if params[0].temperature == 0:
        return token_ids  # the benchmark's batches are all greedy or all sampled
    vocab = work.shape[1]
    temperature = torch.tensor([p.temperature for p in params], device=work.device).unsqueeze(1)
    work = work / temperature
    top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    top_p = [p.top_p for p in params]
    if any(k < vocab for k in top_k) or any(p < 1.0 for p in top_p):
        work = _old_top_k_top_p(work, top_k, top_p)  # the benchmark's top_k are all <= 1024
    probs = work.softmax(dim=-1)
    min_p = [p.min_p for p in params]
    if any(m > 0.0 for m in min_p):
        threshold = torch.tensor(min_p, device=work.device).unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
        probs = probs.masked_fill(probs < threshold, 0.0)
    noise = _old_noise(requests, probs)
    noise.clamp_min_(torch.finfo(torch.float32).tiny)
    return (probs / noise).argmax(dim=-1)


def old_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, num_top: int) -> tuple[torch.Tensor, ...]:
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = logprobs.gather(1, token_ids.unsqueeze(1))
    ranks = (logprobs > chosen).sum(dim=-1) + 1
    top_values, top_ids = logprobs.topk(min(num_top, logprobs.shape[-1]), dim=-1)
    return chosen.squeeze(1), ranks, top_values, top_ids


# --- the benchmark ---------------------------------------------------------------------------

SAMPLED = {"temperature": 0.8, "top_p": 0.95, "top_k": 50}


def requests_for(setting: str, rows: int) -> list[Request]:
    def params(i: int) -> SamplingParams:
        if setting == "greedy":
            return SamplingParams(temperature=0.0)
        if setting == "seeded":
            return SamplingParams(seed=i, **SAMPLED)
        if setting == "min_p":
            return SamplingParams(temperature=1.0, min_p=0.05)
        return SamplingParams(logprobs=5 if "lp" in setting or "logprobs" in setting else None, **SAMPLED)

    return [Request(f"r{i}", [1, 2, 3], params(i), index=i) for i in range(rows)]


def time_it(fn, iters: int) -> tuple[float, float]:  # type: ignore[no-untyped-def]
    """(device ms per call from CUDA events over back-to-back calls, host ms per call)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    host = time.perf_counter()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    host = (time.perf_counter() - host) * 1e3 / iters
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters, host


def check(logits: torch.Tensor, rows: int) -> dict[str, object]:
    """The new path against its torch reference on this GPU, and logprobs against log_softmax."""
    requests = requests_for("seeded", rows)
    mixed = [Request(f"m{i}", [1], SamplingParams(seed=i, **p), index=i) for i, p in enumerate(
        [dict(temperature=0.0), SAMPLED, dict(temperature=1.0, min_p=0.05), dict(temperature=0.7, top_k=5),
         dict(temperature=1.0, top_k=200, top_p=0.5), dict(temperature=1.0)] * (rows // 6))]  # fmt: skip
    result: dict[str, object] = {}
    for name, reqs in (("seeded", requests), ("mixed", mixed)):
        new = sample_token_ids(logits[: len(reqs)], reqs)
        original = truncation.use_kernels
        truncation.use_kernels = lambda t: False  # type: ignore[assignment]
        try:
            ref = sample_token_ids(logits[: len(reqs)], reqs)
        finally:
            truncation.use_kernels = original  # type: ignore[assignment]
        result[f"{name}_tokens_equal_reference"] = int((new == ref).sum())
        result[f"{name}_rows"] = len(reqs)
    tokens = sample_token_ids(logits, requests)
    _, lp = logprob_tensors(logits, tokens, requests_for("logprobs5", rows))  # type: ignore[misc]
    exact = torch.log_softmax(logits.float(), dim=-1)
    chosen = exact.gather(1, tokens.unsqueeze(1))
    result["max_logprob_diff"] = float(max((lp.logprobs - chosen.squeeze(1)).abs().max(),
                                           (lp.top_logprobs - exact.topk(5, dim=-1).values).abs().max()))  # fmt: skip
    result["ranks_equal"] = int((lp.ranks == (exact > chosen).sum(dim=-1) + 1).sum())
    return result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=128_256)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    torch.manual_seed(0)
    # Scaled so that the top 50 span a few units, as a language model's logits do; bf16 rounding
    # makes ties at the cutoff common.
    logits = (torch.randn(args.rows, args.vocab, device="cuda") * 3).to(torch.bfloat16)
    lines: list[dict[str, object]] = []

    def emit(**row: object) -> None:
        lines.append(row)
        print(json.dumps(row), flush=True)
        if args.out is not None:
            args.out.mkdir(parents=True, exist_ok=True)
            with open(args.out / "sampler_micro.jsonl", "a") as f:
                f.write(json.dumps(row) + "\n")

    emit(figure="machine", value=torch.cuda.get_device_name(0), torch=torch.__version__, rows=args.rows,
         vocab=args.vocab)  # fmt: skip
    emit(figure="check", **check(logits, args.rows))

    sampled = sample_token_ids(logits, requests_for("sampling", args.rows))
    cases = {
        "greedy": (lambda r: lambda: old_sample_token_ids(logits, r), lambda r: lambda: sample_token_ids(logits, r)),
        "sampling": (lambda r: lambda: old_sample_token_ids(logits, r), lambda r: lambda: sample_token_ids(logits, r)),
        "seeded": (lambda r: lambda: old_sample_token_ids(logits, r), lambda r: lambda: sample_token_ids(logits, r)),
        "min_p": (lambda r: lambda: old_sample_token_ids(logits, r), lambda r: lambda: sample_token_ids(logits, r)),
        "logprobs5": (lambda r: lambda: old_logprobs(logits, sampled, 5),
                      lambda r: lambda: logprob_tensors(logits, sampled, r)),
        "sampling+lp5": (lambda r: lambda: old_logprobs(logits, old_sample_token_ids(logits, r), 5),
                         lambda r: lambda: logprob_tensors(logits, sample_token_ids(logits, r), r)),
    }  # fmt: skip
    table = []
    for setting, (old, new) in cases.items():
        reqs = requests_for(setting, args.rows)
        old_ms, old_host = time_it(old(reqs), args.iters)
        new_ms, new_host = time_it(new(reqs), args.iters)
        emit(figure=f"{setting}_ms", old=round(old_ms, 4), new=round(new_ms, 4), speedup=round(old_ms / new_ms, 2),
             old_host_ms=round(old_host, 4), new_host_ms=round(new_host, 4))  # fmt: skip
        table.append((setting, old_ms, new_ms, old_host, new_host))

    print(f"\n[{args.rows}, {args.vocab}] bf16 logits, {args.iters} calls each, CUDA events (ms per call)")
    print("| setting | old ms | new ms | speedup | old host ms | new host ms |")
    print("|---|---|---|---|---|---|")
    for setting, old_ms, new_ms, old_host, new_host in table:
        print(f"| {setting} | {old_ms:.3f} | {new_ms:.3f} | {old_ms / new_ms:.1f}x | {old_host:.3f} | {new_host:.3f} |")
    print("\ncheck:", lines[1])


if __name__ == "__main__":
    main()
