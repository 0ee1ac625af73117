"""Benchmark W7, long context (issue 32): a Llama-3.1-8B-shaped engine (random bf16 weights,
--load-format dummy, llama3 rope, max_model_len 131072) on one GPU, against ceilings measured in
the same run.

  ceilings  bf16 matmul peak (torch, 8192^3) and device copy bandwidth (torch copy_ of 2 GiB)
  TTFT      one request of 8k, 32k and 128k prompt tokens (chunked prefill, no prefix cache),
            against its compute bound: (linear FLOPs + causal attention FLOPs) / matmul peak
  ITL       inter-token latency of 1 sequence at 128k context (the 128k request above, decoding
            on) and of 16 sequences at --batch-context tokens each (16 x 128k does not fit one
            H200: 16 GiB of bf16 KV each), against the roofline (weight bytes + KV bytes read per
            step) / copy bandwidth
  kernels   paged prefill attention alone (one sequence, every length, causal) as a fraction of the
            matmul peak, and paged decode attention alone (1 x 128k, 16 x batch-context) as a
            fraction of copy bandwidth; each the best of its tuner's config space

Each of these for the bf16 KV cache and, unless --skip-fp8, for an fp8 (e4m3) KV cache (a second
artifact). One JSON line per figure (also appended to OUT/long_context.jsonl), then a table.

    python benchmarks/long_context.py --out /tmp/w7 [--lengths 8192,32768,131072] [--skip-fp8]
        [--artifact DIR] [--artifact-fp8 DIR] [--tune-budget 300] [--block-size 128]
    python benchmarks/long_context.py --dry-run      # a tiny config on the CPU: the code paths only

Counting. Linear FLOPs per prompt token: 2 x the parameters of every layer's projections (the
LM head once per request, for the last token; the embedding is a lookup). Causal attention FLOPs
of a prompt of L tokens: 4 x layers x heads x head_dim x L(L+1)/2 (QK^T and PV). Bytes read per
decode step: every weight but the embedding table, plus every running sequence's whole KV.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from pagecast.kernels.interpreter_fix import interpreter_index_fix

LLAMA31_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
    "vocab_size": 128256, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
    "bos_token_id": 128000, "eos_token_id": 128001, "torch_dtype": "bfloat16",
    "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
}  # fmt: skip
# --dry-run: the same code on a tiny model, on the CPU (Triton kernels through the interpreter).
TINY = dict(
    LLAMA31_8B, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, vocab_size=1024, max_position_embeddings=1024, torch_dtype="float32",
    bos_token_id=1, eos_token_id=2,
    rope_parameters=dict(LLAMA31_8B["rope_parameters"], original_max_position_embeddings=128),
)  # fmt: skip
BLOCK = 16
RESULTS: list[dict] = []


class Run:
    def __init__(self, out: Path, dry_run: bool):
        self.out, self.dry_run = out, dry_run
        self.cuda = torch.cuda.is_available() and not dry_run
        self.device = "cuda" if self.cuda else "cpu"

    def emit(self, **row: object) -> None:
        RESULTS.append(row)
        line = json.dumps(row)
        print(line, flush=True)
        with open(self.out / "long_context.jsonl", "a") as f:
            f.write(line + "\n")

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def median_ms(self, fn, reps: int) -> float:  # type: ignore[no-untyped-def]
        """Median milliseconds of fn() after one warm-up call (CUDA events on the GPU)."""
        fn()
        self.sync()
        times = []
        for _ in range(reps):
            if self.cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1000)
        return statistics.median(times)


# ---------------------------------------------------------------------------------------------
# counting


def linear_params_per_token(cfg: dict) -> int:
    """Parameters of one token's projections through every layer (no embedding, no LM head)."""
    h, inter, hd = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    return cfg["num_hidden_layers"] * ((q + 2 * kv) * h + q * h + 3 * inter * h)


def prefill_flops(cfg: dict, length: int) -> tuple[float, float]:
    """(linear, causal attention) FLOPs of prefilling one prompt of ``length`` tokens."""
    linear = 2.0 * linear_params_per_token(cfg) * length + 2.0 * cfg["vocab_size"] * cfg["hidden_size"]
    return linear, attention_flops(cfg, length) * cfg["num_hidden_layers"]


def attention_flops(cfg: dict, length: int) -> float:
    """One layer's causal attention FLOPs over a prompt of ``length`` tokens."""
    return 4.0 * cfg["num_attention_heads"] * cfg["head_dim"] * length * (length + 1) / 2


def kv_bytes_per_token(cfg: dict, kv: str, elt: int) -> int:
    return (
        2
        * cfg["num_hidden_layers"]
        * cfg["num_key_value_heads"]
        * cfg["head_dim"]
        * (1 if kv == "fp8" else elt)
    )


def decode_weight_bytes(cfg: dict, elt: int) -> int:
    """Weights a decode step reads: every projection, the norms and the LM head (not the embedding table)."""
    h = cfg["hidden_size"]
    norms = (2 * cfg["num_hidden_layers"] + 1) * h
    return elt * (linear_params_per_token(cfg) + cfg["vocab_size"] * h + norms)


# ---------------------------------------------------------------------------------------------
# ceilings


def matmul_peak(run: Run, dtype: torch.dtype, tries: int = 3) -> float:
    """Matmul FLOP/s measured now: 8192^3 on the GPU (256^3 on the CPU), the best of ``tries``
    medians of 20 (3). One median moved by up to 5% within a run (the sixteenth session saw 775.6
    TFLOP/s at a run's start and 738.2 at its end), and every ratio to the compute bound moves
    with it; the best of a few is the stricter ceiling."""
    n = 8192 if run.cuda else 256
    a = torch.randn(n, n, device=run.device, dtype=dtype)
    b = torch.randn(n, n, device=run.device, dtype=dtype)
    ms = min(run.median_ms(lambda: a @ b, 20 if run.cuda else 3) for _ in range(max(1, tries)))
    return 2.0 * n**3 / (ms / 1000)


def ceilings(run: Run, elt_dtype: torch.dtype) -> tuple[float, float]:
    """(matmul peak in FLOP/s, copy bandwidth in bytes/s) measured now."""
    peak = matmul_peak(run, elt_dtype)
    size = (2 << 30) if run.cuda else (16 << 20)
    src = torch.empty(size, dtype=torch.uint8, device=run.device)
    dst = torch.empty_like(src)
    ms = run.median_ms(lambda: dst.copy_(src), 20 if run.cuda else 3)
    copy = 2.0 * size / (ms / 1000)  # read + write
    run.emit(
        figure="matmul_peak_tflops", value=round(peak / 1e12, 1), dtype=str(elt_dtype).replace("torch.", "")
    )
    run.emit(figure="copy_bandwidth_gb_s", value=round(copy / 1e9, 1))
    return peak, copy


# ---------------------------------------------------------------------------------------------
# engine: TTFT and inter-token latency


def build_artifact(
    run: Run, cfg: dict, kv: str, max_model_len: int, tune_budget: float, tune_first: str = "", block: int = BLOCK
) -> Path:
    from pagecast.builder.ir import BuildOptions
    from pagecast.builder.pipeline import build

    cfg_dir = run.out / "llama31-8b-config"
    cfg_dir.mkdir(parents=True, exist_ok=True)
    (cfg_dir / "config.json").write_text(json.dumps(cfg))
    artifact = run.out / f"engine-{kv}"
    start = time.perf_counter()
    build(
        BuildOptions(
            model=str(cfg_dir), output=artifact, gpu="cpu" if run.dry_run else "auto", load_format="dummy",
            max_model_len=max_model_len, kv_cache_dtype="fp8" if kv == "fp8" else "auto", max_num_seqs=16,
            tune_budget_s=tune_budget, tune_first=tune_first, force=True, quiet=True, block_size=block,
        ),
        log=lambda line: print("  build", line, flush=True),
    )  # fmt: skip
    plan = json.loads((artifact / "memory_plan.json").read_text())
    run.emit(
        figure="enginebuild_seconds", kv=kv, value=round(time.perf_counter() - start, 1),
        kv_bytes_per_token=plan["bytes_per_token"], kv_bytes_per_seq_at_max_model_len=plan.get("bytes_per_seq_at_max_model_len"),
        seqs_at_max_model_len_at_0_9={b["gpu_memory_utilization"]: b["max_seqs_at_max_model_len"] for b in plan["budgets"]}.get(0.9),
    )  # fmt: skip
    return artifact


def prefill_table(run: Run, artifact: Path, kv: str) -> None:
    """What the TTFTs ran with: the prefill-attention config the build kept per bucket (the long-context
    ones included), and each kernel's buckets the tuning budget cut off (those kept the launcher's
    default untimed against the rest)."""
    from pagecast.kernels.tuning import untuned_buckets

    path = artifact / "tuning.json"
    if not path.is_file():
        return
    table = json.loads(path.read_text())
    entries = (table.get("kernels") or {}).get("paged_prefill_attention", {})
    run.emit(
        figure="prefill_attention_table", kv=kv,
        value={bucket: dict(e.get("config") or {}, time_us=e.get("time_us"), tuned=e.get("tuned")) for bucket, e in entries.items()},
        untuned=untuned_buckets(table),
    )  # fmt: skip


def random_prompts(vocab: int, n: int, length: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (length,), generator=g).tolist() for _ in range(n)]


def drive(run: Run, engine, prompts: list[list[int]], decode_steps: int) -> tuple[float, float]:  # type: ignore[no-untyped-def]
    """Admits the prompts together and steps the engine until every one has its first token, then
    ``decode_steps`` more steps (each a decode step of the whole batch), then aborts them.
    Returns (seconds to the last first token, mean seconds of those decode steps); under
    continuous batching the early prompts decode while the later ones prefill, so only steps after
    the last first token are counted."""
    from pagecast.runtime.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=None, ignore_eos=True, temperature=0)  # the rest of the context
    ids = [engine.add_request(None, p, params) for p in prompts]
    run.sync()
    start = time.perf_counter()
    started: set[str] = set()
    ttft = 0.0
    try:
        while len(started) < len(ids):
            for o in engine.step():
                assert not o.finished, "a benchmark request finished early"
                if o.outputs[0].token_ids:
                    started.add(o.request_id)
        run.sync()
        ttft = time.perf_counter() - start
        for _ in range(decode_steps):  # no syncs between steps: async scheduling overlaps them
            for o in engine.step():
                assert not o.finished, "a benchmark request finished early"
        run.sync()
        per_step = (time.perf_counter() - start - ttft) / max(decode_steps, 1)
    finally:
        engine.abort_request(ids)
        while engine.has_unfinished_requests():
            engine.step()
    return ttft, per_step


def open_engine(run: Run, artifact: Path, cfg: dict, max_num_seqs: int, chunk: int):  # type: ignore[no-untyped-def]
    """The benchmark's engine over ``artifact``: no prefix cache, the model's whole context, 92% of
    the GPU's memory (64 MiB of KV on the CPU)."""
    from pagecast.runtime.engine import LLMEngine

    options = {"gpu_memory_utilization": 0.92} if run.cuda else {"kv_cache_memory": "64MiB"}
    return LLMEngine(
        artifact, max_num_seqs=max_num_seqs, max_num_batched_tokens=chunk, enable_prefix_caching=False,
        max_model_len=cfg["max_position_embeddings"], **options,
    )  # fmt: skip


def engine_figures(
    run: Run, artifact: Path, cfg: dict, kv: str, lengths: list[int], batch: int, batch_context: int,
    decode_tokens: int, chunk: int, peak: float, copy: float,
) -> None:  # fmt: skip
    elt = 2 if run.cuda else 4
    longest = max(lengths)
    start = time.perf_counter()
    engine = open_engine(run, artifact, cfg, batch, chunk)
    kv_tokens = engine.block_pool.num_blocks * engine.block_size
    run.emit(
        figure="engine_init_seconds", kv=kv, value=round(time.perf_counter() - start, 1), kv_tokens=kv_tokens
    )
    drive(run, engine, random_prompts(cfg["vocab_size"], 2, 300, seed=99), 3)  # warm-up
    weights = decode_weight_bytes(cfg, elt)
    per_token = kv_bytes_per_token(cfg, kv, elt)

    for length in lengths:
        prompt_len = length - decode_tokens - 4 if length == longest else length
        ttft, itl = drive(run, engine, random_prompts(cfg["vocab_size"], 1, prompt_len, seed=length),
                          decode_tokens if length == longest else 1)  # fmt: skip
        linear, attn = prefill_flops(cfg, prompt_len)
        bound = (linear + attn) / peak
        run.emit(
            figure="ttft_s", kv=kv, prompt_tokens=prompt_len, value=round(ttft, 4), compute_bound_s=round(bound, 4),
            ratio_to_bound=round(ttft / bound, 3), linear_tflop=round(linear / 1e12, 2), attention_tflop=round(attn / 1e12, 2),
            chunk_tokens=chunk, target="<= 1.5x bound at 32k and 128k",
        )  # fmt: skip
        if length == longest:
            context = prompt_len + decode_tokens // 2  # mean context over the decode steps
            roof = (weights + per_token * context) / copy
            run.emit(
                figure="inter_token_latency_ms", kv=kv, seqs=1, context=context, value=round(itl * 1000, 3),
                roofline_ms=round(roof * 1000, 3), ratio_to_roofline=round(itl / roof, 3),
                weight_gb=round(weights / 1e9, 2), kv_gb_per_step=round(per_token * context / 1e9, 2),
                target="<= 1.3x roofline at 1 x 128k",
            )  # fmt: skip

    fits = kv_tokens // batch - 2 * engine.block_size
    # the early prompts decode while the later ones prefill: leave them room to
    ctx = (
        min(batch_context, fits, cfg["max_position_embeddings"])
        - 4 * decode_tokens
        - batch * batch_context // chunk
    )
    _, itl = drive(run, engine, random_prompts(cfg["vocab_size"], batch, ctx, seed=7), decode_tokens)
    context = ctx + decode_tokens // 2
    roof = (weights + batch * per_token * context) / copy
    run.emit(
        figure="inter_token_latency_ms", kv=kv, seqs=batch, context=context, value=round(itl * 1000, 3),
        roofline_ms=round(roof * 1000, 3), ratio_to_roofline=round(itl / roof, 3),
        kv_gb_per_step=round(batch * per_token * context / 1e9, 2),
        note=f"{batch} x {cfg['max_position_embeddings']} needs {batch * per_token * cfg['max_position_embeddings'] / 2**30:.0f} GiB "
        f"of KV; the cache holds {kv_tokens} tokens",
    )  # fmt: skip
    del engine
    if run.cuda:
        torch.cuda.empty_cache()


def chunk_sweep(
    run: Run, artifact: Path, cfg: dict, kv: str, lengths: list[int], chunks: list[int], rounds: int, peak: float
) -> None:
    """TTFT of one prompt per length under each prefill chunk size, in one engine, the chunk sizes
    alternated over ``rounds`` rounds (so drift over the run falls on all of them alike). The engine
    is made with max_num_batched_tokens = the largest chunk; each run bounds a step's prompt tokens
    with the scheduler's max_num_prefill_tokens, which is what a chunk is cut to."""
    from dataclasses import replace

    engine = open_engine(run, artifact, cfg, 1, max(chunks))
    drive(run, engine, random_prompts(cfg["vocab_size"], 1, 300, seed=99), 3)  # warm-up
    scheduler = engine.core.scheduler
    for r in range(rounds):
        for chunk in chunks:
            scheduler.config = replace(scheduler.config, max_num_prefill_tokens=chunk)
            for length in lengths:
                length = min(length, cfg["max_position_embeddings"] - 8)  # room for the one output token
                ttft, _ = drive(run, engine, random_prompts(cfg["vocab_size"], 1, length, seed=length), 1)
                linear, attn = prefill_flops(cfg, length)
                bound = (linear + attn) / peak
                run.emit(
                    figure="ttft_chunk_sweep_s", kv=kv, round=r, chunk_tokens=chunk, prompt_tokens=length,
                    value=round(ttft, 4), ratio_to_bound=round(ttft / bound, 3),
                )  # fmt: skip
    del engine
    if run.cuda:
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------
# kernels alone


def kernel_inputs(run: Run, cfg: dict, kv: str, seqs: int, context: int, q_len: int, block: int = BLOCK) -> dict:
    g = torch.Generator(device=run.device).manual_seed(0)
    heads, kv_heads, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    dtype = torch.bfloat16 if run.cuda else torch.float32
    blocks = -(-context // block)
    pool = seqs * blocks + 1
    cache_dtype = torch.float8_e4m3fn if kv == "fp8" else dtype

    def cache() -> torch.Tensor:
        x = torch.randn((pool, kv_heads, block, hd), generator=g, device=run.device, dtype=dtype)
        return (x * 0.5).to(cache_dtype)

    perm = torch.randperm(pool - 1, device=run.device, generator=g).to(torch.int32)
    table = perm[: seqs * blocks].reshape(seqs, blocks).contiguous()
    qsl = torch.arange(0, (seqs + 1) * q_len, q_len, dtype=torch.int32, device=run.device)
    q = torch.randn((seqs * q_len, heads, hd), generator=g, device=run.device, dtype=dtype)
    return {
        "q": q, "k_cache": cache(), "v_cache": cache(), "block_tables": table, "query_start_loc": qsl,
        "seq_lens": torch.full((seqs,), context, dtype=torch.int32, device=run.device), "out": torch.empty_like(q),
    }  # fmt: skip


def model_shapes(cfg: dict, kv: str, run: Run, block: int = BLOCK):  # type: ignore[no-untyped-def]
    from pagecast.kernels import tuning

    return tuning.ModelShapes(
        num_heads=cfg["num_attention_heads"], num_kv_heads=cfg["num_key_value_heads"], head_dim=cfg["head_dim"],
        hidden=cfg["hidden_size"], intermediate=cfg["intermediate_size"], block_size=block,
        dtype="bfloat16" if run.cuda else "float32", max_model_len=cfg["max_position_embeddings"], max_num_seqs=16,
        kv_cache_dtype="float8_e4m3fn" if kv == "fp8" else None,
    )  # fmt: skip


def best_of(run: Run, fn, configs: list, reps: int, graph: bool = False) -> tuple[float, object]:  # type: ignore[no-untyped-def]
    """(ms, config) of the fastest config; ``graph``: timed captured in a CUDA graph on the GPU
    (tuning.time_launches, as the engine runs decode), so the launcher's host time stays out of
    the events (it is most of a decode launch's tens of us when timed eagerly)."""
    from pagecast.kernels import tuning

    def ms(cfg):  # type: ignore[no-untyped-def]
        if graph and run.cuda:
            return tuning.time_launches(lambda i: fn(cfg), 4, reps=reps) / 1000
        return run.median_ms(lambda: fn(cfg), reps)

    timed = []
    for cfg in configs:
        try:
            timed.append((ms(cfg), cfg))
        except Exception as exc:  # noqa: BLE001 - e.g. out of shared memory: that config cannot run here
            print(f"  skipped {cfg.as_dict()}: {type(exc).__name__}", flush=True)
            run.sync()
    if not timed:
        raise RuntimeError("no config of this kernel ran at this shape")
    return min(timed, key=lambda t: t[0])


def kernel_figures(
    run: Run, cfg: dict, kv: str, lengths: list[int], batch: int, batch_context: int, peak: float, copy: float,
    block: int = BLOCK,
) -> None:
    from pagecast.kernels import paged_decode_attention as dec
    from pagecast.kernels import paged_prefill_attention as pre
    from pagecast.kernels import problems

    shapes = model_shapes(cfg, kv, run, block)
    hd = cfg["head_dim"]
    configs_pre = problems.config_space("paged_prefill_attention", shapes, {"num_tokens": max(lengths)})
    if run.dry_run:
        configs_pre = configs_pre[:1]
    for length in lengths:
        x = kernel_inputs(run, cfg, kv, 1, length, length, block)

        def prefill(c, x=x):  # type: ignore[no-untyped-def]
            return pre.paged_prefill_attention(
                x["q"], x["k_cache"], x["v_cache"], x["block_tables"], x["seq_lens"], x["query_start_loc"], hd**-0.5,
                config=c, out=x["out"],
            )  # fmt: skip

        ms, best = best_of(run, prefill, configs_pre, 3 if length > 65536 or run.dry_run else 5)
        flops = attention_flops(cfg, length)
        run.emit(
            figure="prefill_attention_fraction_of_peak", kv=kv, tokens=length, value=round(flops / (ms / 1000) / peak, 3),
            ms=round(ms, 3), tflops=round(flops / (ms / 1000) / 1e12, 1), config=best.as_dict(),
            target=">= 0.60 at 32k",
        )  # fmt: skip
        del x
    kv_elt = 1 if kv == "fp8" else (2 if run.cuda else 4)
    for seqs, context in ((1, max(lengths)), (batch, min(batch_context, max(lengths)))):
        x = kernel_inputs(run, cfg, kv, seqs, context, 1, block)
        configs = problems.config_space(
            "paged_decode_attention", shapes, {"num_seqs": seqs, "max_seq_len": context}
        )
        if run.dry_run:
            configs = configs[:1]

        def decode(c, x=x, context=context):  # type: ignore[no-untyped-def]
            return dec.paged_decode_attention(
                x["q"], x["k_cache"], x["v_cache"], x["block_tables"], x["seq_lens"], x["query_start_loc"], hd**-0.5,
                context, config=c, out=x["out"],
            )  # fmt: skip

        ms, best = best_of(run, decode, configs, 3 if run.dry_run else 10, graph=True)
        nbytes = seqs * context * 2 * cfg["num_key_value_heads"] * hd * kv_elt  # one layer's K and V
        run.emit(
            figure="decode_attention_fraction_of_copy", kv=kv, seqs=seqs, context=context,
            value=round(nbytes / (ms / 1000) / copy, 3), us=round(ms * 1000, 1),
            gb_s=round(nbytes / (ms / 1000) / 1e9, 1), config=best.as_dict(),
        )  # fmt: skip
        del x
    if run.cuda:
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------


def table() -> str:
    lines = ["| figure | KV | shape | value | bound / roofline | ratio |", "|---|---|---|---|---|---|"]
    for r in RESULTS:
        f = r["figure"]
        if f == "ttft_s":
            lines.append(
                f"| TTFT | {r['kv']} | 1 x {r['prompt_tokens']} | {r['value']} s | {r['compute_bound_s']} s | {r['ratio_to_bound']}x |"
            )
        elif f == "inter_token_latency_ms":
            lines.append(
                f"| inter-token | {r['kv']} | {r['seqs']} x {r['context']} | {r['value']} ms | {r['roofline_ms']} ms | {r['ratio_to_roofline']}x |"
            )
        elif f == "prefill_attention_fraction_of_peak":
            lines.append(
                f"| prefill attention alone | {r['kv']} | 1 x {r['tokens']} | {r['ms']} ms, {r['tflops']} TFLOP/s | peak | {r['value']:.0%} |"
            )
        elif f == "decode_attention_fraction_of_copy":
            lines.append(
                f"| decode attention alone | {r['kv']} | {r['seqs']} x {r['context']} | {r['us']} us, {r['gb_s']} GB/s | copy | {r['value']:.0%} |"
            )
    return "\n".join(lines)  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])  # fmt: skip
    ap.add_argument("--out", type=Path, default=Path("/tmp/pagecast-w7"), help="work and result directory")
    ap.add_argument(
        "--lengths",
        default="8192,32768,131072",
        help="prompt lengths for TTFT and prefill attention; the longest also gives 1-sequence inter-token latency",
    )
    ap.add_argument("--batch", type=int, default=16, help="sequences for the batched inter-token figure")
    ap.add_argument(
        "--batch-context",
        type=int,
        default=32768,
        help="context of each of --batch sequences (capped at what the KV cache holds)",
    )
    ap.add_argument(
        "--decode-tokens",
        type=int,
        default=32,
        help="decode steps timed for the inter-token figures (their mean: no sync between steps)",
    )
    ap.add_argument("--chunk", type=int, default=8192, help="max_num_batched_tokens (prefill chunk)")
    ap.add_argument(
        "--chunk-sweep", default="",
        help="comma-separated chunk sizes: instead of the engine figures, TTFT at --lengths under each "
        "(alternated, --sweep-rounds rounds)",
    )  # fmt: skip
    ap.add_argument("--sweep-rounds", type=int, default=2, help="rounds of --chunk-sweep")
    ap.add_argument("--skip-fp8", action="store_true", help="bf16 KV cache only")
    ap.add_argument(
        "--block-size", type=int, default=BLOCK,
        help="KV-cache block size of the artifacts and kernel inputs",
    )  # fmt: skip
    ap.add_argument("--skip-engine", action="store_true", help="kernels and ceilings only")
    ap.add_argument("--skip-kernels", action="store_true", help="engine figures and ceilings only")
    ap.add_argument(
        "--kernel-kv", default="bf16,fp8",
        help="the KV dtypes whose attention kernels are timed alone (the others: engine figures only)",
    )  # fmt: skip
    ap.add_argument(
        "--artifact", type=Path, help="a bf16-KV artifact already built (max_model_len >= the longest length)"
    )
    ap.add_argument("--artifact-fp8", type=Path, help="the same with an fp8 KV cache")
    ap.add_argument(
        "--tune-budget",
        type=float,
        default=300.0,
        help="enginebuild --tune-budget for the artifacts built here (enginebuild's default: at 20 s the "
        "decode buckets used it up and no prefill bucket was tuned; the run reports the buckets it cut)",
    )
    ap.add_argument(
        "--tune-first",
        default="paged_prefill_attention,paged_decode_attention",
        help="enginebuild --tune-first: the attention kernels, which set W7's figures, are tuned before "
        "the rest, so the budget cuts off the others (the report lists what it cut)",
    )
    ap.add_argument(
        "--dry-run",
        action="store_true",
        help="a tiny model on the CPU (Triton interpreter): checks the code paths, measures nothing",
    )
    args = ap.parse_args(argv)  # fmt: skip

    if args.dry_run:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        interpreter_index_fix()
        cfg = TINY
        lengths, batch, batch_context = [256, 512], 2, 256
        args.decode_tokens, args.chunk, args.skip_fp8 = 4, 128, True  # fp8 KV needs a GPU
    else:
        if not torch.cuda.is_available():
            sys.exit("long_context.py: no CUDA GPU here; use --dry-run to check the code paths on the CPU")
        cfg = LLAMA31_8B
        lengths = sorted(int(v) for v in args.lengths.split(","))
        batch, batch_context = args.batch, args.batch_context
    cfg = dict(cfg, max_position_embeddings=max(cfg["max_position_embeddings"], max(lengths)))
    args.out.mkdir(parents=True, exist_ok=True)
    run = Run(args.out, args.dry_run)
    print(f"{torch.cuda.get_device_name() if run.cuda else 'cpu'}, torch {torch.__version__}", flush=True)
    t0 = time.perf_counter()
    mm_dtype = torch.bfloat16 if run.cuda else torch.float32
    peak, copy = ceilings(run, mm_dtype)
    if run.cuda:
        torch.cuda.empty_cache()  # the engine sizes its KV cache from the free memory
    for kv in ["bf16"] + ([] if args.skip_fp8 else ["fp8"]):
        if not args.skip_kernels and kv in args.kernel_kv.split(","):
            kernel_figures(run, cfg, kv, lengths, batch, batch_context, peak, copy, args.block_size)
        if not args.skip_engine:
            given = args.artifact_fp8 if kv == "fp8" else args.artifact
            artifact = given or build_artifact(
                run, cfg, kv, cfg["max_position_embeddings"], args.tune_budget, args.tune_first, args.block_size
            )
            prefill_table(run, artifact, kv)
            if args.chunk_sweep:
                chunks = [int(v) for v in args.chunk_sweep.split(",")]
                chunk_sweep(run, artifact, cfg, kv, lengths, chunks, args.sweep_rounds, peak)
                print(f"  {kv} done at {time.perf_counter() - t0:.0f} s", flush=True)
                continue
            engine_figures(
                run,
                artifact,
                cfg,
                kv,
                lengths,
                batch,
                batch_context,
                args.decode_tokens,
                args.chunk,
                peak,
                copy,
            )
        print(f"  {kv} done at {time.perf_counter() - t0:.0f} s", flush=True)
    # The peak again at the end: its spread over a run (745-787 TFLOP/s across one session's
    # calls) moves every ratio above; the start's figure is the one they use.
    run.emit(figure="matmul_peak_tflops_at_end", value=round(matmul_peak(run, mm_dtype) / 1e12, 1))
    print()
    print(table())
    run.emit(figure="total_seconds", value=round(time.perf_counter() - t0, 1))


if __name__ == "__main__":
    main()
