"""SmolLM2-135M on the CPU: pagecast's LLM.generate against transformers' generate, same run.

16 requests with outputs of 8..128 tokens (EOS ignored, so every request generates its full
length). transformers runs them as one left-padded static batch, generating up to the
longest; the figure is useful (requested) output tokens per second for both.

    python benchmarks/cpu_generate.py [--artifact artifacts/smollm2-135m]

Prints a table and one JSON line. Informative, not a gate.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--artifact", default="artifacts/smollm2-135m")
    ap.add_argument("--num-requests", type=int, default=16)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from transformers import AutoModelForCausalLM

    from pagecast.builder.load import resolve_model_path
    from pagecast.runtime import LLM, SamplingParams

    artifact = Path(args.artifact)
    if not (artifact / "manifest.json").is_file():
        subprocess.run(
            [sys.executable, "-m", "pagecast.builder.cli", "--model", "smollm2-135m", "--gpu", "cpu",
             "--output", str(artifact), "--quiet", "--force"],
            check=True,
        )
    rng = random.Random(0)
    topics = ["the ocean", "a robot", "Paris", "music", "mathematics", "a forest", "coffee", "the moon"]
    prompts = [f"Write a few sentences about {topics[i % len(topics)]} number {i}." for i in range(args.num_requests)]
    lengths = [8 + (120 * i) // max(1, args.num_requests - 1) for i in range(args.num_requests)]
    rng.shuffle(lengths)
    useful = sum(lengths)

    llm = LLM(artifact)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
    llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4))  # warm-up
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    ours_s = time.perf_counter() - start
    assert [len(o.token_ids) for o in outputs] == lengths

    tok = llm.tokenizer
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    hf = AutoModelForCausalLM.from_pretrained(str(resolve_model_path("smollm2-135m")), dtype=torch.float32).eval()
    batch = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    with torch.inference_mode():
        hf.generate(**batch, max_new_tokens=4, do_sample=False, pad_token_id=tok.pad_token_id)  # warm-up
        start = time.perf_counter()
        hf.generate(**batch, max_new_tokens=max(lengths), min_new_tokens=max(lengths), do_sample=False,
                    pad_token_id=tok.pad_token_id)
        hf_s = time.perf_counter() - start

    rows = [("pagecast LLM.generate", ours_s, useful / ours_s), ("transformers generate (static batch)", hf_s, useful / hf_s)]
    print(f"{'system':<40} {'seconds':>8} {'useful tok/s':>13}")
    for name, s, tps in rows:
        print(f"{name:<40} {s:>8.2f} {tps:>13.1f}")
    print(f"ratio pagecast / transformers: {hf_s / ours_s:.2f}x")
    print(json.dumps({"benchmark": "cpu_generate", "requests": args.num_requests, "useful_tokens": useful,
                      "threads": args.threads, "pagecast_s": round(ours_s, 3), "transformers_s": round(hf_s, 3),
                      "ratio": round(hf_s / ours_s, 3)}))


if __name__ == "__main__":
    main()
