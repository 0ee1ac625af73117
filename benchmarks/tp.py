"""Tensor-parallel benchmarks on two GPUs (issue 9), in one command that fits 10 minutes on
two H200s:

  8B-tp1   Llama-3-8B shape, TP=1: W4 (one request, prompt 128, output 512: inter-token
           latency) and W1 (1,024 requests, prompt 512, output 256: output tokens/s)
  8B-tp2   the same at TP=2 (done when W4 <= 0.65x TP=1 and W1 >= 1.6x TP=1)
  70B-tp2  Llama-3-70B shape, TP=2: enginebuild seconds, engine-serve start (first served
           token), W4 against its roofline ((weights / 2) / copy bandwidth per GPU) and W1
           against its compute bound (2 x parameters FLOPs per processed token on 2 GPUs)
  8B-tp2-symm  8B-tp2 with PAGECAST_TP_ALLREDUCE=symm_mem (the experimental one-shot
           symmetric-memory all-reduce instead of NCCL for messages up to 8 MiB); last, so the
           deadline drops it first

    python benchmarks/tp.py --out OUTDIR [--configs 8B-tp1,8B-tp2,70B-tp2,8B-tp2-symm]
                            [--w1-requests 1024] [--w1-requests-70b 512]

Weights are random (--load-format dummy: the artifacts hold no weight files). Each
configuration runs in a process of its own (one tensor-parallel engine per process, and the
GPUs' memory is returned between them). Prints a table at the end and one JSON line per
figure (also appended to OUTDIR/tp.jsonl). Engine phases reuse benchmarks/serving.py.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from serving import LLAMA3_8B, phase_start, random_prompts, run_engine

LLAMA3_70B = dict(
    LLAMA3_8B, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
    num_key_value_heads=8,
)
SHAPES = {"8B": LLAMA3_8B, "70B": LLAMA3_70B}
COPY_GBS = 4262.0  # H200 copy bandwidth measured 2026-11-30 (DESIGN.md); the build's own figure wins
MATMUL_TFLOPS = 783.0  # H200 bf16 dense matmul, measured the same day
MAX_MODEL_LEN = 2048
CONFIGS = ("8B-tp1", "8B-tp2", "70B-tp2", "8B-tp2-symm")


def emit(out: Path, **row: object) -> None:
    line = json.dumps(row)
    print(line, flush=True)
    with open(out / "tp.jsonl", "a") as f:
        f.write(line + "\n")


def build(out: Path, shape: str, tp: int, tune_budget: float) -> Path:
    from pagecast.builder.ir import BuildOptions
    from pagecast.builder.pipeline import build as run_build

    artifact = out / f"llama3-{shape.lower()}-tp{tp}"
    if (artifact / "manifest.json").is_file():
        return artifact
    cfg_dir = out / f"llama3-{shape.lower()}-config"
    cfg_dir.mkdir(parents=True, exist_ok=True)
    (cfg_dir / "config.json").write_text(json.dumps(SHAPES[shape]))
    start = time.perf_counter()
    run_build(
        BuildOptions(model=str(cfg_dir), output=artifact, gpu="auto", load_format="dummy", tp=tp,
                     max_model_len=MAX_MODEL_LEN, tune_budget_s=tune_budget, force=True, quiet=True,
                     max_num_seqs=1024),
        log=lambda line: print(f"  build {shape} tp{tp}", line, flush=True),
    )
    emit(out, config=f"{shape}-tp{tp}", figure="enginebuild_seconds", value=round(time.perf_counter() - start, 1),
         artifact_bytes=sum(f.stat().st_size for f in artifact.rglob("*") if f.is_file()))
    return artifact


def run_config(out: Path, config: str, w1_requests: int, tune_budget: float, serve_start: bool) -> None:
    """One configuration in this process: build, (serve start), engine, W4, W1."""
    import torch

    from pagecast.runtime.artifact import load_manifest
    from pagecast.runtime.engine import LLMEngine
    from pagecast.runtime.sampling_params import SamplingParams

    shape, tp = config.split("-tp")[0], int(config.split("-tp")[1].split("-")[0])
    artifact = build(out, shape, tp, tune_budget)
    manifest = load_manifest(artifact)
    tuning = json.loads((artifact / "tuning.json").read_text())
    copy_gbs = float(tuning.get("copy_bandwidth_gbs") or COPY_GBS)
    params = int(manifest.dims["num_parameters"])
    if serve_start:
        phase_start(out, artifact)  # emits engine_serve_first_token_seconds into serving.jsonl
        rows = [json.loads(line) for line in (out / "serving.jsonl").read_text().splitlines()]
        last = [r for r in rows if r["figure"] == "engine_serve_first_token_seconds"][-1]
        emit(out, config=config, figure="engine_serve_first_token_seconds", value=last["value"],
             triton_compiles_at_start=last.get("triton_compiles_at_start"), exit_code=last.get("exit_code"))
    start = time.perf_counter()
    engine = LLMEngine(artifact, max_num_seqs=1024, max_num_batched_tokens=8192, gpu_memory_utilization=0.9)
    emit(out, config=config, figure="engine_init_seconds", value=round(time.perf_counter() - start, 1),
         kv_blocks=engine.block_pool.num_blocks, kv_tokens=engine.block_pool.num_blocks * engine.block_size)
    try:
        run_engine(engine, random_prompts(8, 64, 5), [SamplingParams(max_tokens=8, ignore_eos=True)] * 8)  # warm-up
        secs, _, first, _, _ = run_engine(
            engine, random_prompts(1, 128, 4), [SamplingParams(max_tokens=512, ignore_eos=True, temperature=0)],
            only_finished=False,
        )
        itl = (secs - first["r0"]) / 511 * 1000
        roofline_ms = params * 2 / tp / (copy_gbs * 1e9) * 1000  # bf16 weights of one rank read once per token
        emit(out, config=config, figure="W4_inter_token_latency_ms", value=round(itl, 3),
             ttft_ms=round(first["r0"] * 1000, 1), roofline_ms=round(roofline_ms, 2),
             fraction_of_roofline=round(roofline_ms / itl, 3))
        sp = [SamplingParams(max_tokens=256, ignore_eos=True, temperature=0)] * w1_requests
        secs, done, _, _, steps = run_engine(engine, random_prompts(w1_requests, 512, 1), sp)
        n = sum(len(o.outputs[0].token_ids) for o in done.values())
        processed = w1_requests * (512 + 256)
        compute_bound_s = processed * 2 * params / (tp * MATMUL_TFLOPS * 1e12)
        emit(out, config=config, figure="W1_output_tok_s", value=round(n / secs, 1), seconds=round(secs, 1),
             steps=steps, requests=w1_requests, preemptions=engine.scheduler.num_preemptions,
             compute_bound_output_tok_s=round(n / compute_bound_s, 1),
             fraction_of_compute_bound=round(compute_bound_s / secs, 3))
    finally:
        engine.runner.close()
        torch.cuda.synchronize()


def summary(out: Path) -> None:
    rows = [json.loads(line) for line in (out / "tp.jsonl").read_text().splitlines()] if (out / "tp.jsonl").is_file() else []
    by = {(r.get("config"), r["figure"]): r for r in rows}
    for fig, better, target in (("W4_inter_token_latency_ms", "lower", 0.65), ("W1_output_tok_s", "higher", 1.6)):
        for variant in ("8B-tp2", "8B-tp2-symm"):
            one, two = by.get(("8B-tp1", fig)), by.get((variant, fig))
            if one and two and one["value"] and two["value"]:
                ratio = two["value"] / one["value"]
                ok = ratio <= target if better == "lower" else ratio >= target
                emit(out, config=variant, figure=f"{fig}_over_tp1", value=round(ratio, 3),
                     target=f"{'<=' if better == 'lower' else '>='} {target}", met=ok)
    w4 = by.get(("70B-tp2", "W4_inter_token_latency_ms"))
    if w4:
        emit(out, config="70B-tp2", figure="W4_target_20ms", value=w4["value"], met=w4["value"] <= 20)
    rows = [json.loads(line) for line in (out / "tp.jsonl").read_text().splitlines()]
    print("\n| config | figure | value | details |\n|---|---|---|---|")
    for r in rows:
        details = {k: v for k, v in r.items() if k not in ("config", "figure", "value")}
        print(f"| {r.get('config')} | {r['figure']} | {r['value']} | {details} |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("bench-tp"))
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--w1-requests", type=int, default=1024)
    ap.add_argument("--w1-requests-70b", type=int, default=512, help="W1 requests for the 70B shape (time)")
    ap.add_argument("--tune-budget", type=float, default=40.0)
    ap.add_argument("--deadline-s", type=float, default=570.0, help="stop starting configurations after this")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # internal: run one configuration here
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.one:
        run_config(args.out, args.one, args.w1_requests, args.tune_budget, serve_start=args.one.startswith("70B"))
        return
    import torch

    emit(args.out, config="-", figure="machine", value=torch.cuda.get_device_name(0),
         gpus=torch.cuda.device_count(), torch=torch.__version__, date=time.strftime("%Y-%m-%d"),
         commit=os.environ.get("PAGECAST_COMMIT", "unknown"))
    start = time.monotonic()
    for config in args.configs.split(","):
        left = args.deadline_s - (time.monotonic() - start)
        if left < 30:
            emit(args.out, config=config, figure="skipped", value="out of time")
            continue
        requests = args.w1_requests_70b if config.startswith("70B") else args.w1_requests
        cmd = [sys.executable, __file__, "--out", str(args.out), "--one", config,
               "--w1-requests", str(requests), "--tune-budget", str(args.tune_budget)]
        env = dict(os.environ, PAGECAST_TP_ALLREDUCE="symm_mem" if config.endswith("-symm") else "nccl")
        try:
            proc = subprocess.run(cmd, timeout=left, check=False, env=env)
            if proc.returncode:
                emit(args.out, config=config, figure="failed", value=f"exit code {proc.returncode}")
        except subprocess.TimeoutExpired:
            emit(args.out, config=config, figure="failed", value="timed out (deadline)")
    summary(args.out)


if __name__ == "__main__":
    main()
