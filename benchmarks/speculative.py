"""Speculative decoding on one GPU (issue 31), everything in one run and one engine: a
Llama-3-8B-shaped engine with random weights (``--load-format dummy``), its W4 without
speculation, then W4 with drafts that agree with the target a chosen fraction of the time, then
W1 and W6 with speculation enabled against disabled.

The drafts come from the ``replay`` proposer: the target's own greedy output of the same request,
recorded by the run without speculation, each draft token kept with probability p and replaced
by another token otherwise. That measures the mechanism's cost and gain (scheduling 1 + k
tokens, the verifying forward pass, the verification and the bookkeeping) independently of any
drafter's quality or cost: p = 1 is the best case, p = 0 the worst.

    python benchmarks/speculative.py --out OUTDIR [--ks 2,4,6] [--ps 1,0.8,0.6,0] [--phases W4,W1,W6]
    python benchmarks/speculative.py --dry-run     # CPU: a tiny config through the same code

Every figure is a JSON line (printed and appended to OUTDIR/speculative.jsonl); a table of W4
ratios against the issue's targets (p = 1, k = 4: <= 0.4x; p = 0: <= 1.1x) and of W1 / W6 with
speculation against without (>= 0.97x) ends the run. ``p0_no_backoff`` rows turn the per-request
back-off (runtime/engine_core.py: a request whose drafts are rejected outright three steps in a
row pauses) off, so they show the mechanism's raw cost.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

W4_PROMPT, W4_OUTPUT = 128, 512


def w4(engine: Any, prompt: list[int], params: Any) -> tuple[float, list[int]]:
    """Inter-token latency (ms) of one request, after its first token; and its tokens."""
    engine.add_request("w4", prompt, params)
    start = time.perf_counter()
    first = None
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if first is None and out.outputs[0].token_ids:
                first = time.perf_counter()
            if out.finished:
                tokens = out.outputs[0].token_ids
    _sync()
    end = time.perf_counter()
    assert first is not None and len(tokens) == W4_OUTPUT, len(tokens)
    return (end - first) / (W4_OUTPUT - 1) * 1000, tokens


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def throughput(engine: Any, n: int, prompt_len: int, output_len: int, seed: int) -> float:
    from serving import random_prompts

    from pagecast.runtime.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0)
    for i, prompt in enumerate(random_prompts(n, prompt_len, seed)):
        engine.add_request(f"t{i}", prompt, params)
    start = time.perf_counter()
    tokens = 0
    while engine.has_unfinished_requests():
        for out in engine.step(only_finished=True):
            tokens += len(out.outputs[0].token_ids)
    _sync()
    assert tokens == n * output_len
    return tokens / (time.perf_counter() - start)


def run(engine: Any, record: Any, ks: list[int], ps: list[float], phases: set[str], scale: dict[str, int]) -> None:
    from serving import random_prompts

    from pagecast.runtime import engine_core
    from pagecast.runtime.sampling_params import SamplingParams
    from pagecast.runtime.speculative import ReplayProposer

    core = engine.core
    greedy = SamplingParams(max_tokens=W4_OUTPUT, ignore_eos=True, temperature=0)
    prompt = random_prompts(1, W4_PROMPT, 4)[0]
    if "W4" in phases:
        w4(engine, prompt, greedy)  # warm-up
        base_ms, reference = w4(engine, prompt, greedy)
        record(figure="W4_inter_token_latency_ms", speculation="off", value=round(base_ms, 3))
        continuation = {ReplayProposer.key(prompt): reference}
        rows = [(k, p, True) for k in ks for p in ps] + [(4, 0.0, False)]
        for k, p, backoff in rows:
            core.set_speculative({"method": "replay", "num_speculative_tokens": k,
                                  "replay": {"continuations": continuation, "p": p, "seed": 0}})  # fmt: skip
            saved = engine_core.SPEC_MISSES_BEFORE_PAUSE
            if not backoff:
                engine_core.SPEC_MISSES_BEFORE_PAUSE = 1 << 30
            try:
                ms, tokens = w4(engine, prompt, greedy)
            finally:
                engine_core.SPEC_MISSES_BEFORE_PAUSE = saved
            stats = core.spec_stats
            record(figure="W4_inter_token_latency_ms", speculation="replay" if backoff else "replay_no_backoff",
                   k=k, p=p, value=round(ms, 3), ratio_to_off=round(ms / base_ms, 3), same_tokens=tokens == reference,
                   acceptance=round(stats.num_accepted_tokens / max(stats.num_draft_tokens, 1), 3),
                   tokens_per_verify=round(stats.num_emitted_tokens / max(stats.num_verified, 1), 2),
                   verify_steps=stats.num_steps, verify_ms_per_step=round(stats.verify_s / max(stats.num_steps, 1) * 1000, 3))  # fmt: skip
        core.set_speculative(None)
    for name, (n, prompt_len, output_len, seed) in (("W1", (scale["W1"], 512, 256, 1)), ("W6", (scale["W6"], 128, 1024, 6))):
        if name not in phases:
            continue
        figures = {}
        for setting in ("off", "ngram"):
            core.set_speculative({"method": "ngram", "num_speculative_tokens": 4} if setting == "ngram" else None)
            figures[setting] = throughput(engine, n, prompt_len, output_len, seed)
            record(figure=f"{name}_output_tok_s", speculation=setting, value=round(figures[setting], 1),
                   verify_steps=core.spec_stats.num_steps)  # fmt: skip
        record(figure=f"{name}_ratio_spec_to_off", value=round(figures["ngram"] / figures["off"], 3), target=">= 0.97")
        core.set_speculative(None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("bench-speculative"))
    ap.add_argument("--ks", default="2,4,6")
    ap.add_argument("--ps", default="1,0.8,0.6,0")
    ap.add_argument("--phases", default="W4,W1,W6")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--tune-budget", type=float, default=60.0)
    ap.add_argument("--dry-run", action="store_true", help="CPU: a tiny random Llama through the same code")
    args = ap.parse_args()
    ks = [int(k) for k in args.ks.split(",")]
    ps = [float(p) for p in args.ps.split(",")]
    phases = set(args.phases.split(","))
    from pagecast.runtime.engine import LLMEngine

    if args.dry_run:
        global W4_OUTPUT
        W4_OUTPUT = 24
        from pagecast.builder.ir import BuildOptions
        from pagecast.builder.pipeline import build

        config = {
            "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_hidden_layers": 2,
            "vocab_size": 130000, "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
            "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False, "torch_dtype": "float32",
        }  # fmt: skip
        with tempfile.TemporaryDirectory() as tmp:
            (Path(tmp) / "config.json").write_text(json.dumps(config))
            artifact = build(BuildOptions(model=tmp, output=Path(tmp) / "art", gpu="cpu", load_format="dummy",
                                          force=True, quiet=True))  # fmt: skip
            engine = LLMEngine(artifact, max_num_seqs=16, max_num_batched_tokens=256)
            run(engine, lambda **row: print(json.dumps(row)), ks, ps, phases, {"W1": 4, "W6": 4})
        return
    import variant_runs

    args.out.mkdir(parents=True, exist_ok=True)
    record = variant_runs.Recorder(args.out, "speculative.jsonl")
    record.machine()
    artifact = variant_runs.build(args.out, args.out / "llama3-8b-bf16", "bf16", record, args.max_model_len, args.tune_budget)
    start = time.perf_counter()
    engine = LLMEngine(artifact, max_num_seqs=1024, max_num_batched_tokens=8192, gpu_memory_utilization=0.92)
    record(figure="engine_init_seconds", value=round(time.perf_counter() - start, 1))
    run(engine, record, ks, ps, phases, {"W1": 1024, "W6": 512})


if __name__ == "__main__":
    main()
