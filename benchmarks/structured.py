"""Overhead of structured output (issue 13) on one GPU, in one run.

Builds (or reuses) the embedded SmolLM2-135M engine (a real tokenizer, which the grammar
needs; a small model is the worst case: the host's mask work is large next to its steps), then
runs the same requests (prompt 256 random tokens, 128 output tokens, ``max_num_seqs`` 256)
three times under asynchronous scheduling:

  plain      no request constrained (ignore_eos: every request makes 128 tokens)
  half_json  every other request constrained to a JSON schema of 100 bounded integers (longer
             than 128 tokens: it never completes, so it also makes 128 tokens), the rest plain
  all_json   every request constrained

and reports output tokens/s, engine steps, and the mean and p99 step time (one ``step()`` call,
which under asynchronous scheduling is one launched step plus the previous one's read-back).
The target of issue 13 is <= 10% throughput loss at 50% constrained requests. Before timing,
32 requests with a small schema and room to finish are checked: every output must be valid
JSON of that schema, in both scheduling modes.

    python benchmarks/structured.py --out OUTDIR [--artifact DIR | --model NAME_OR_CHECKPOINT_DIR]

Prints a table at the end and one JSON line per figure (also written to OUTDIR/structured.jsonl).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import torch

NUM_REQUESTS, PROMPT_LEN, OUTPUT_LEN = 256, 256, 128
LONG_SCHEMA = {
    "type": "object",
    "properties": {
        "values": {
            "type": "array",
            "items": {"type": "integer", "minimum": 0, "maximum": 999},
            "minItems": 100,
            "maxItems": 100,
        }
    },
    "required": ["values"],
}
SMALL_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "ok"],
}
RESULTS: list[dict] = []


def emit(out: Path, **row: object) -> None:
    RESULTS.append(row)
    line = json.dumps(row)
    print(line, flush=True)
    with open(out / "structured.jsonl", "a") as f:
        f.write(line + "\n")


def random_prompts(n: int, length: int, seed: int, vocab: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab) for _ in range(length)] for _ in range(n)]


def check_outputs(out: Path, artifact: Path) -> None:
    from pagecast.runtime.llm import LLM
    from pagecast.runtime.sampling_params import SamplingParams, StructuredOutput

    so = StructuredOutput("json_schema", SMALL_SCHEMA)
    prompts = [f"Describe person number {i} as JSON:" for i in range(32)]
    params = [SamplingParams(max_tokens=256, temperature=0.7 if i % 2 else 0.0, seed=i, structured_output=so)
              for i in range(len(prompts))]
    for mode in (False, True):
        llm = LLM(str(artifact), async_scheduling=mode, max_num_seqs=32)
        outs = llm.generate(prompts, params, use_tqdm=False)
        valid = stopped = 0
        for o in outs:
            choice = o.outputs[0]
            stopped += choice.finish_reason == "stop"
            try:
                value = json.loads(choice.text)
                valid += set(value) == set(SMALL_SCHEMA["required"]) and 0 <= value["age"] <= 120
            except ValueError:
                pass
        emit(out, figure="valid_json", async_scheduling=mode, valid=valid, stopped=stopped, of=len(prompts))
        del llm
        torch.cuda.empty_cache()


def run(out: Path, artifact: Path, setting: str) -> dict[str, float]:
    from pagecast.runtime.engine import LLMEngine
    from pagecast.runtime.sampling_params import SamplingParams, StructuredOutput

    engine = LLMEngine(str(artifact), max_num_seqs=NUM_REQUESTS, async_scheduling=True, enable_prefix_caching=False)
    so = StructuredOutput("json_schema", LONG_SCHEMA)
    plain = SamplingParams(temperature=0.0, max_tokens=OUTPUT_LEN, ignore_eos=True)
    constrained = SamplingParams(temperature=0.0, max_tokens=OUTPUT_LEN, structured_output=so)
    every = {"plain": 0, "half_json": 2, "all_json": 1}[setting]
    params = [constrained if every and i % every == 0 else plain for i in range(NUM_REQUESTS)]
    prompts = random_prompts(NUM_REQUESTS, PROMPT_LEN, 1, engine.vocab_size)
    # Warm-up: every code path once (the grammar compiled, the bitmask kernel loaded).
    for i, p in enumerate(random_prompts(8, 32, 2, engine.vocab_size)):
        engine.add_request(f"w{i}", p, constrained if i % 2 else plain)
    while engine.has_unfinished_requests():
        engine.step()
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(f"r{i}", p, sp)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    step_times: list[float] = []
    tokens = 0
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        for o in engine.step(only_finished=True):
            tokens += len(o.outputs[0].token_ids)
        step_times.append(time.perf_counter() - t0)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    secs = time.perf_counter() - start
    step_times.sort()
    row = {
        "output_tok_s": round(tokens / secs, 1),
        "seconds": round(secs, 2),
        "tokens": tokens,
        "steps": len(step_times),
        "step_ms_mean": round(1e3 * statistics.mean(step_times), 3),
        "step_ms_p99": round(1e3 * step_times[int(0.99 * (len(step_times) - 1))], 3),
    }
    emit(out, figure=f"{setting}_throughput", **row)
    del engine
    torch.cuda.empty_cache()
    return row


def main() -> None:
    global NUM_REQUESTS, OUTPUT_LEN, PROMPT_LEN
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--artifact", type=Path, default=None, help="an artifact with a tokenizer (default: build --model)")
    ap.add_argument("--model", default="smollm2-135m", help="what to build when no --artifact: a name or checkpoint dir")
    ap.add_argument("--num-requests", type=int, default=NUM_REQUESTS, help="smaller for a CPU smoke run")
    ap.add_argument("--output-len", type=int, default=OUTPUT_LEN)
    ap.add_argument("--prompt-len", type=int, default=PROMPT_LEN)
    args = ap.parse_args()
    NUM_REQUESTS, OUTPUT_LEN, PROMPT_LEN = args.num_requests, args.output_len, args.prompt_len
    args.out.mkdir(parents=True, exist_ok=True)
    artifact = args.artifact
    if artifact is None:
        from pagecast.builder.ir import BuildOptions
        from pagecast.builder.pipeline import build

        artifact = args.out / Path(args.model).name
        if not (artifact / "manifest.json").exists():
            build(BuildOptions(model=args.model, output=artifact, force=True, quiet=True))
    check_outputs(args.out, artifact)
    table = {setting: run(args.out, artifact, setting) for setting in ("plain", "half_json", "all_json")}
    base = table["plain"]["output_tok_s"]
    print(f"\n{'setting':<10} {'tok/s':>10} {'vs plain':>9} {'steps':>6} {'step ms':>8} {'p99 ms':>8}")
    for setting, row in table.items():
        loss = 100.0 * (row["output_tok_s"] / base - 1.0)
        print(f"{setting:<10} {row['output_tok_s']:>10.1f} {loss:>+8.1f}% {row['steps']:>6} "
              f"{row['step_ms_mean']:>8.3f} {row['step_ms_p99']:>8.3f}")
        emit(args.out, figure=f"{setting}_vs_plain_pct", value=round(loss, 2), target="half_json >= -10%")


if __name__ == "__main__":
    main()
