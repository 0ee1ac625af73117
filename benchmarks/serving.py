"""End-to-end GPU benchmarks (PERFORMANCE.md W1, W2, W4 and engine start-up) with the
transformers baseline timed in the same run, on the same weights.

Builds a Llama-3-8B-shaped engine with random bf16 weights (--load-format dummy) for the GPU
present, then:

  start   engine-serve on the artifact: seconds from process start to the first served token,
          and how many Triton kernels were compiled at start and while serving (the core logs both)
  base    transformers generate on the same weights: one static batch of 256 (ISL 512 / OSL 256),
          and one static batch of 64 of W2's requests (useful tokens)
  W1      1,024 requests, prompt 512 random tokens, 256 output tokens, all at once
  W2      256 requests, prompt 512, output uniform in 16..512 (useful output tokens/s)
  W4      one request, prompt 128, output 512: inter-token latency
  W6      512 requests, prompt 128, output 1,024 (decode-heavy), all at once (not in the default
          phases; benchmarks/kvcache.py runs it for the bf16 and fp8 KV caches)

    python benchmarks/serving.py --out OUTDIR [--phases start,base,W1,W2,W4]

Prints a table at the end and one JSON line per figure (also written to OUTDIR/serving.jsonl).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import torch

LLAMA3_8B = dict(
    architectures=["LlamaForCausalLM"],
    model_type="llama",
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    vocab_size=128256,
    max_position_embeddings=8192,
    rope_theta=500000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    bos_token_id=128000,
    eos_token_id=128001,
    torch_dtype="bfloat16",
)

RESULTS: list[dict] = []


def emit(out: Path, **row: object) -> None:
    RESULTS.append(row)
    line = json.dumps(row)
    print(line, flush=True)
    with open(out / "serving.jsonl", "a") as f:
        f.write(line + "\n")


def random_checkpoint(cfg_dir: Path, config: dict, shard_bytes: int = 5 << 30) -> None:
    """A Hugging Face Llama checkpoint of random bf16 weights (safetensors shards, as
    save_pretrained writes them): an artifact built from it carries weight files that
    engine-serve reads and hashes at start, as a real model's would."""
    from safetensors.torch import save_file

    h, inter, layers = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]
    q = config["num_attention_heads"] * config["head_dim"]
    kv = config["num_key_value_heads"] * config["head_dim"]
    shapes = {"model.embed_tokens.weight": (config["vocab_size"], h)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
            p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
            p + "mlp.down_proj.weight": (h, inter),
        })
    shapes.update({"model.norm.weight": (h,), "lm_head.weight": (config["vocab_size"], h)})
    gen = torch.Generator("cuda").manual_seed(0)
    shard: dict[str, torch.Tensor] = {}
    size, index = 0, 0
    for name, shape in shapes.items():
        if name.endswith("norm.weight"):
            t = torch.ones(shape, dtype=torch.bfloat16)
        else:
            t = (torch.randn(shape, generator=gen, device="cuda") * 0.02).to(torch.bfloat16).cpu()
        shard[name] = t
        size += t.numel() * 2
        if size >= shard_bytes or name == "lm_head.weight":
            index += 1
            save_file(shard, str(cfg_dir / f"model-{index:05d}.safetensors"), metadata={"format": "pt"})
            shard, size = {}, 0


def build(
    out: Path, artifact: Path, max_model_len: int, tune_budget: float, weights: str = "random", kv_cache_dtype: str = "auto",
    tuning_from: Path | None = None,
) -> None:  # fmt: skip
    """The Llama-3-8B-shaped artifact; weights "random": --load-format dummy (drawn at load, no
    weight files), "files": built from a random checkpoint on disk (start-up reads and hashes);
    ``kv_cache_dtype`` and ``tuning_from`` as enginebuild's --kv-cache-dtype and --tuning-from."""
    from pagecast.builder.ir import BuildOptions
    from pagecast.builder.pipeline import build as run_build

    if (artifact / "manifest.json").is_file():
        return
    cfg_dir = out / f"llama3-8b-config-{weights}"
    cfg_dir.mkdir(parents=True, exist_ok=True)
    # A context past Llama-3-8B's 8,192 (W8's 128 + 8,192 tokens) as Llama-3.1-8B has it: the same
    # shape with a longer position table (the dummy weights make the rope variant irrelevant here).
    config = dict(LLAMA3_8B, max_position_embeddings=max(LLAMA3_8B["max_position_embeddings"], max_model_len))
    (cfg_dir / "config.json").write_text(json.dumps(config))
    start = time.perf_counter()
    if weights == "files":
        random_checkpoint(cfg_dir, config)
        emit(out, figure="random_checkpoint_seconds", value=round(time.perf_counter() - start, 1))
        start = time.perf_counter()
    run_build(
        BuildOptions(model=str(cfg_dir), output=artifact, gpu="auto", load_format="dummy" if weights == "random" else "auto",
                     max_model_len=max_model_len, tune_budget_s=tune_budget, force=True, quiet=True, max_num_seqs=1024,
                     kv_cache_dtype=kv_cache_dtype, tuning_from=tuning_from),
        log=lambda line: print("  build", line, flush=True),
    )
    emit(out, figure="enginebuild_seconds", value=round(time.perf_counter() - start, 1))


def random_prompts(n: int, length: int, seed: int, vocab_size: int = 128256) -> list[list[int]]:
    """Random token ids in [1000, min(120000, vocab_size)): Llama-3's prompts stay what they were,
    a smaller vocabulary (Mixtral's 32,000) gets ids it has."""
    rng = random.Random(seed)
    return [[rng.randrange(1000, min(120000, vocab_size)) for _ in range(length)] for _ in range(n)]


def phase_start(out: Path, artifact: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    start = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-m", "pagecast.runtime.cli", str(artifact), "--port", str(port), "--max-num-seqs", "256"],
        stdout=subprocess.DEVNULL, stderr=open(out / "engine_serve.log", "w"),
    )
    body = json.dumps({"model": "llama3-8b-config", "prompt": [1000, 2000, 3000], "max_tokens": 1}).encode()
    first_token = None
    try:
        while time.perf_counter() - start < 300 and proc.poll() is None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                    if r.status != 200:
                        raise OSError
                models = json.load(urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=5))
                name = models["data"][0]["id"]
                body = json.dumps({"model": name, "prompt": [1000, 2000, 3000], "max_tokens": 1}).encode()
                req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                             headers={"Content-Type": "application/json"})
                with urllib.request.urlopen(req, timeout=60) as r:
                    json.load(r)
                first_token = time.perf_counter() - start
                break
            except OSError:
                time.sleep(0.1)
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
    log = (out / "engine_serve.log").read_text()
    at_start = re.findall(r"triton_compiles_at_start=(\d+)", log)
    serving = re.findall(r"triton: (\d+) kernels compiled while serving", log)
    emit(out, figure="engine_serve_first_token_seconds", value=round(first_token, 2) if first_token else None,
         target="<= 10", triton_compiles_at_start=at_start[-1] if at_start else "not logged",
         triton_compiles_while_serving=serving[-1] if serving else "not logged", exit_code=proc.returncode)


def hf_model_from_artifact(artifact: Path):  # type: ignore[no-untyped-def]
    """transformers' Llama with the artifact's weights (split back out of the fused layout)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**{k: v for k, v in LLAMA3_8B.items() if k not in ("architectures", "model_type")})
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    from pagecast.runtime.artifact import load_manifest
    from pagecast.runtime.loader import rank_weights

    # Dummy artifacts carry no weight files: the runtime draws the same seeded weights the engine uses.
    w = rank_weights(artifact, load_manifest(artifact), torch.device("cuda"), 0)
    q, kv = 32 * 128, 8 * 128
    sd = {"model.embed_tokens.weight": w.pop("embed_tokens.weight"), "model.norm.weight": w.pop("norm.weight"),
          "lm_head.weight": w.pop("lm_head.weight")}
    for i in range(32):
        p, o = f"model.layers.{i}", f"layers.{i}"
        qkv = w.pop(f"{o}.qkv_proj.weight")
        sd[f"{p}.self_attn.q_proj.weight"], sd[f"{p}.self_attn.k_proj.weight"], sd[f"{p}.self_attn.v_proj.weight"] = (
            qkv[:q], qkv[q : q + kv], qkv[q + kv :])
        gu = w.pop(f"{o}.gate_up_proj.weight")
        sd[f"{p}.mlp.gate_proj.weight"], sd[f"{p}.mlp.up_proj.weight"] = gu[:14336], gu[14336:]
        sd[f"{p}.mlp.down_proj.weight"] = w.pop(f"{o}.down_proj.weight")
        sd[f"{p}.self_attn.o_proj.weight"] = w.pop(f"{o}.o_proj.weight")
        sd[f"{p}.input_layernorm.weight"] = w.pop(f"{o}.input_norm.weight")
        sd[f"{p}.post_attention_layernorm.weight"] = w.pop(f"{o}.post_attn_norm.weight")
    model.load_state_dict(sd, assign=True, strict=True)
    model.model.rotary_emb = type(model.model.rotary_emb)(cfg, device="cuda")
    return model.eval()


def hf_generate(model, prompts: list[list[int]], new_tokens: int) -> float:  # type: ignore[no-untyped-def]
    ids = torch.tensor(prompts, device="cuda")
    torch.cuda.synchronize()
    start = time.perf_counter()
    with torch.inference_mode():
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                       min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    torch.cuda.synchronize()
    return time.perf_counter() - start


def w2_lengths() -> list[int]:
    rng = random.Random(2)
    return [rng.randint(16, 512) for _ in range(256)]


def phase_base(out: Path, artifact: Path) -> None:
    model = hf_model_from_artifact(artifact)
    hf_generate(model, random_prompts(4, 512, 9), 8)  # warm-up
    secs = hf_generate(model, random_prompts(256, 512, 1), 256)
    emit(out, figure="transformers_static_b256_tok_s", value=round(256 * 256 / secs, 1), seconds=round(secs, 1),
         published_baseline=2757)
    lengths = w2_lengths()[:64]
    secs = hf_generate(model, random_prompts(256, 512, 2)[:64], max(lengths))
    emit(out, figure="transformers_static_b64_w2_useful_tok_s", value=round(sum(lengths) / secs, 1),
         seconds=round(secs, 1), published_baseline=611)
    del model
    torch.cuda.empty_cache()


def run_engine(engine, prompts, params_list, sample_kv: bool = False, only_finished: bool = True):  # type: ignore[no-untyped-def]
    """Drive the engine; returns (seconds, outputs by id, first-token times, peak KV use stats)."""
    for i, (p, sp) in enumerate(zip(prompts, params_list)):
        engine.add_request(f"r{i}", p, sp)
    start = time.perf_counter()
    done: dict[str, object] = {}
    first: dict[str, float] = {}
    kv_samples = []
    steps = 0
    while engine.has_unfinished_requests():
        for o in engine.step(only_finished=only_finished):
            if o.request_id not in first and o.outputs[0].token_ids:
                first[o.request_id] = time.perf_counter() - start
            if o.finished:
                done[o.request_id] = o
        steps += 1
        if sample_kv and steps % 16 == 0:
            pool = engine.block_pool
            used = pool.num_used_blocks
            live = sum(r.num_computed_tokens for r in engine.scheduler.running)
            if used:
                kv_samples.append((live / (used * pool.block_size), pool.usage))
    if torch.cuda.is_available():  # (a CPU dry run has none)
        torch.cuda.synchronize()
    return time.perf_counter() - start, done, first, kv_samples, steps


def phase_ours(
    out: Path, artifact: Path, phases: set[str], scale: float = 1.0, llama_targets: bool = True, mixed_graphs: bool = False,
    max_num_batched_tokens: int = 8192,
) -> None:  # fmt: skip
    """The in-process engine's phases. Each row also says how many Triton kernels compiled during
    it (``triton_compiles``, the artifact's cache missed them; a compile takes seconds, so a
    nonzero count explains a slow figure). ``scale`` < 1 shrinks W1's and W4's request counts and
    lengths and the engine's batch (a CPU dry run); ``llama_targets``: the rows carry
    PERFORMANCE.md's Llama-3-8B targets and roofline (off for another model); ``mixed_graphs``: the
    engine replays steps with prompt tokens from CUDA graphs too (EngineOptions.mixed_graphs);
    ``max_num_batched_tokens``: the engine's token budget a step."""
    from pagecast.runtime.artifact import load_manifest
    from pagecast.runtime.engine import LLMEngine
    from pagecast.runtime.kernel_cache import process_compiles
    from pagecast.runtime.sampling_params import SamplingParams

    def sized(size: int) -> int:
        return max(int(size * scale), 2)

    vocab_size = int(load_manifest(artifact).dims["vocab_size"])

    def prompts(n: int, length: int, seed: int) -> list[list[int]]:
        return random_prompts(n, length, seed, vocab_size)

    compiles = process_compiles()
    start = time.perf_counter()
    engine = LLMEngine(
        artifact, max_num_seqs=sized(1024), max_num_batched_tokens=sized(max_num_batched_tokens),
        gpu_memory_utilization=0.92, mixed_graphs=mixed_graphs,
    )  # fmt: skip
    emit(out, figure="engine_init_seconds", value=round(time.perf_counter() - start, 1),
         kv_blocks=engine.block_pool.num_blocks, kv_tokens=engine.block_pool.num_blocks * engine.block_size,
         triton_compiles=compiles.count, mixed_graphs=mixed_graphs, max_num_batched_tokens=sized(max_num_batched_tokens),
         **({"compiled": sorted(set(compiles.names))} if compiles.count else {}))  # fmt: skip
    run_engine(engine, prompts(8, 64, 5), [SamplingParams(max_tokens=8, ignore_eos=True)] * 8)  # warm-up
    seen = compiles.count

    def record(**row: object) -> None:
        """emit, with the kernels compiled since the last row."""
        nonlocal seen
        new = compiles.names[seen:]
        seen = compiles.count
        emit(out, **row, triton_compiles=len(new), **({"compiled": sorted(set(new))} if new else {}))

    if "W4" in phases:
        secs, done, first, _, _ = run_engine(engine, prompts(1, sized(128), 4), [SamplingParams(max_tokens=sized(512), ignore_eos=True, temperature=0)],
                                             only_finished=False)
        itl = (secs - first["r0"]) / (sized(512) - 1) * 1000
        record(figure="W4_inter_token_latency_ms", value=round(itl, 3), ttft_ms=round(first["r0"] * 1000, 1),
               **({"target": "<= 4.5", "roofline_ms": 3.79} if llama_targets else {}))
    if "W1" in phases:
        params = [SamplingParams(max_tokens=sized(256), ignore_eos=True, temperature=0)] * sized(1024)
        secs, done, _, kv, steps = run_engine(engine, prompts(sized(1024), sized(512), 1), params, sample_kv=True)
        n_out = sum(len(o.outputs[0].token_ids) for o in done.values())
        record(figure="W1_output_tok_s", value=round(n_out / secs, 1), seconds=round(secs, 1), steps=steps,
               output_tokens=n_out, **({"target": ">= 11500"} if llama_targets else {}),
               kv_live_fraction_min=round(min(k[0] for k in kv), 4) if kv else None,
               kv_live_fraction_median=round(sorted(k[0] for k in kv)[len(kv) // 2], 4) if kv else None,
               preemptions=engine.scheduler.num_preemptions)
    if "W6" in phases:
        params = [SamplingParams(max_tokens=1024, ignore_eos=True, temperature=0)] * 512
        secs, done, _, kv, steps = run_engine(engine, prompts(512, 128, 6), params, sample_kv=True)
        n = sum(len(o.outputs[0].token_ids) for o in done.values())
        record(figure="W6_output_tok_s", value=round(n / secs, 1), seconds=round(secs, 1), steps=steps,
               output_tokens=n, target=">= 24000", preemptions=engine.scheduler.num_preemptions,
               kv_use_max=round(max(k[1] for k in kv), 4) if kv else None)
    if "W2" in phases:
        lengths = w2_lengths()
        params = [SamplingParams(max_tokens=n, ignore_eos=True, temperature=0) for n in lengths]
        secs, done, _, _, steps = run_engine(engine, prompts(256, 512, 2), params)
        n = sum(len(o.outputs[0].token_ids) for o in done.values())
        assert n == sum(lengths)
        record(figure="W2_useful_tok_s", value=round(n / secs, 1), seconds=round(secs, 1), steps=steps)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("bench-out"))
    ap.add_argument("--artifact", type=Path, default=None)
    ap.add_argument("--phases", default="start,base,W4,W1,W2")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--tune-budget", type=float, default=90.0)
    ap.add_argument("--weights", choices=["random", "files"], default="random",
                    help="random: dummy artifact (weights drawn at load); files: built from a random checkpoint")
    ap.add_argument("--mixed-graphs", action="store_true", help="the engine phases with mixed-step CUDA graphs on")
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192, help="the engine phases' token budget a step")
    ap.add_argument("--tuning-from", type=Path, default=None,
                    help="build with another artifact's kernel configs (enginebuild --tuning-from): an A/B of a build option")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    artifact = args.artifact or args.out / "llama3-8b-dummy"
    phases = set(args.phases.split(","))
    emit(args.out, figure="machine", value=torch.cuda.get_device_name(0), torch=torch.__version__,
         date=time.strftime("%Y-%m-%d"), commit=os.environ.get("PAGECAST_COMMIT", "unknown"))
    build(args.out, artifact, args.max_model_len, args.tune_budget, args.weights, tuning_from=args.tuning_from)
    for name, fn in (("start", lambda: phase_start(args.out, artifact)), ("base", lambda: phase_base(args.out, artifact))):
        if name in phases:
            try:
                fn()
            except Exception as e:  # keep going: one failed phase must not cost the others
                emit(args.out, figure=f"{name}_failed", value=f"{type(e).__name__}: {e}")
    if phases & {"W1", "W2", "W4", "W6"}:
        try:
            phase_ours(
                args.out, artifact, phases, mixed_graphs=args.mixed_graphs, max_num_batched_tokens=args.max_num_batched_tokens
            )
        except Exception as e:
            import traceback

            traceback.print_exc()
            emit(args.out, figure="engine_failed", value=f"{type(e).__name__}: {e}")
    print("\n| figure | value | details |\n|---|---|---|")
    for r in RESULTS:
        details = {k: v for k, v in r.items() if k not in ("figure", "value")}
        print(f"| {r['figure']} | {r['value']} | {details} |")


if __name__ == "__main__":
    main()
