"""W4A16 GEMM micro-benchmark at the Llama-3-8B projection shapes (issue 10: the int4 decode path).

For each projection (qkv K=4096 N=6144, o 4096x4096, gate_up 4096x28672, down 14336x4096),
group size (128, 64) and row count (1, 2, 4, 8, 16, 64), times on one GPU:

- ``gemm``: the tl.dot kernel of kernels/w4a16_gemm.py, best of its configs the tuner would try;
- ``gemv``: the CUDA-core GEMV of kernels/w4a16_gemv.py, best of its configs (up to 8 rows; the
  tuner now times it only where the tensor-core kernel cannot run);
- ``tcgemv``: the tensor-core decode kernel of kernels/w4a16_tcgemv.py (up to 16 rows) without
  SUB_ZEROS (the kernel before the ninth session), best of the tuner's tiles
  (w4a16_gemm.tcgemv_configs) and a few more (``tcgemv_configs``);
- ``tcgemv_sub_zeros``: the same tiles with the zero points subtracted in the unpacking (the
  kernel's SUB_ZEROS: no per-chunk sums of x, a program's loads issued together; what the tuner
  times since it won here);
- ``tcgemv_prefetch``: SUB_ZEROS with the next chunk (PREFETCH 1) or the one after (2) of each
  program's split prefetched into L2 when a chunk starts (the tuner times PREFETCH 1 from 4 rows,
  w4a16_gemm.PREFETCH_MIN_ROWS, since it won there in the eleventh session);
- ``dequant``: dequantize the weight then cuBLAS (what the tuner may pick for prefill);
- ``bf16``: torch.nn.functional.linear on bf16 weights of the same shape (cuBLAS).

Each figure is the median over replays of a CUDA graph of many launches (kernels/tuning.py's
``time_launches``, as the build's tuner times them), rotating through enough weight copies
that every launch reads its weight from memory rather than L2. GB/s counts the weight bytes
(int4 + fp16 scales + int8 zeros; bf16 for cuBLAS) over the time. Every variant's best config
is checked against the pure-torch reference first.

    python benchmarks/w4a16_micro.py [--out DIR] [--rows 1,2,4,8,16,64] [--groups 128,64]
                                     [--projections qkv,o,gate_up,down] [--variants tcgemv_sub_zeros,...]

One JSON line per figure (also in DIR/w4a16_micro.jsonl), a table at the end, and per group size
the decode-step sum over the four projections at each row count (what W4 inter-token latency
pays per layer) with its ratio to bf16.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import os
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch

from pagecast.kernels import reference, tuning, w4a16_gemm, w4a16_gemv, w4a16_tcgemv

PROJECTIONS = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
INT4_VARIANTS = ("gemm", "gemv", "tcgemv", "tcgemv_sub_zeros", "tcgemv_prefetch", "dequant")
COLD_BYTES = 512 << 20  # weight copies a sample rotates through: ~10x the H200's L2
MAX_SETS = 64


def record(out: Path | None, row: dict[str, object]) -> None:
    line = json.dumps(row)
    print(line, flush=True)
    if out is not None:
        with open(out / "w4a16_micro.jsonl", "a") as f:
            f.write(line + "\n")


def int4_weights(n: int, k: int, g: int, sets: int, gen: torch.Generator) -> list[tuple[torch.Tensor, ...]]:
    out = []
    for _ in range(sets):
        qweight = torch.randint(
            -(2**31), 2**31 - 1, (k // 8, n), generator=gen, device="cuda", dtype=torch.int32
        )
        scales = (torch.rand((k // g, n), generator=gen, device="cuda") * 0.004 + 0.002).half()
        zeros = torch.randint(0, 16, (k // g, n), generator=gen, device="cuda", dtype=torch.int8)
        out.append((qweight, scales, zeros))
    return out


def tcgemv_configs(m: int, n: int, k: int, sms: int) -> list[tuning.KernelConfig]:
    """The tensor-core kernel's candidates: the tuner's, and tiles of 512 columns on 8 warps and
    128 on 2 warps at two stages (benchmarks/w4a16_tcgemv_ptx.py's table) at its splits."""
    out = w4a16_gemm.tcgemv_configs(m, n, k, sms)
    for c in list(out):
        if (c["BLOCK_N"], c.num_warps, c.num_stages) == (512, 4, 1):
            out.append(w4a16_tcgemv.make_config(512, 128, c["SPLIT_K"], 8, 1))
        if (c["BLOCK_N"], c.num_warps, c.num_stages) == (128, 2, 1):
            out.append(w4a16_tcgemv.make_config(128, 128, c["SPLIT_K"], 2, 2))
    return list({json.dumps(c.as_dict()): c for c in out}.values())


def run_int4(
    x: torch.Tensor, q: torch.Tensor, s: torch.Tensor, z: torch.Tensor, g: int, cfg: tuning.KernelConfig
) -> torch.Tensor:
    """One launch of the int4 path a config names."""
    return w4a16_gemm.w4a16_gemm(x, q, s, z, None, g, None, cfg)


def candidates(m: int, n: int, k: int, sms: int) -> dict[str, list[tuning.KernelConfig]]:
    """The configs each int4 variant is timed over at this shape (the tuner's, plus the GEMV's
    untuned default)."""
    space = w4a16_gemm.prune_configs(w4a16_gemm.CONFIG_SPACE, m, n, k, sms)
    out = {
        "gemm": [c for c in space if not w4a16_gemv.is_gemv(c) and not w4a16_gemm.is_dequant(c)],
        "dequant": [w4a16_gemm.DEQUANT],
    }
    if m <= w4a16_gemm.GEMV_MAX_ROWS:
        gemv = w4a16_gemm.gemv_configs(m, n, k, sms) + [w4a16_gemv.default_config(m, n, k, sms)]
        out["gemv"] = list({json.dumps(c.as_dict()): c for c in gemv}.values())
    if m <= w4a16_gemm.TCGEMV_MAX_ROWS:
        # the tuner's tiles without its PREFETCH candidates: each variant below sets its own keys
        tc = [c for c in tcgemv_configs(m, n, k, sms) if "PREFETCH" not in c.params]
        out["tcgemv"] = [
            tuning.KernelConfig({p: v for p, v in c.params.items() if p != "SUB_ZEROS"}, c.num_warps, c.num_stages)
            for c in tc
        ]
        out["tcgemv_sub_zeros"] = [
            tuning.KernelConfig({**c.params, "SUB_ZEROS": 1}, c.num_warps, c.num_stages) for c in tc
        ]
        out["tcgemv_prefetch"] = [
            tuning.KernelConfig({**c.params, "SUB_ZEROS": 1, "PREFETCH": d}, c.num_warps, c.num_stages)
            for c in tc
            for d in (1, 2)
        ]
    return out


def _compile(task: tuple[int, int, int, int, dict[str, int]]) -> str:
    """One launch in a worker process: compiles the kernel into the shared Triton disk cache."""
    n, k, g, m, cfg = task
    x = torch.zeros((m, k), device="cuda", dtype=torch.bfloat16)
    q = torch.zeros((k // 8, n), device="cuda", dtype=torch.int32)
    s = torch.ones((k // g, n), device="cuda", dtype=torch.float16)
    z = torch.zeros((k // g, n), device="cuda", dtype=torch.int8)
    try:
        run_int4(x, q, s, z, g, tuning.KernelConfig.coerce(cfg))
        torch.cuda.synchronize()
    except Exception as exc:  # noqa: BLE001 - timed (and reported) again in the main process
        return f"{type(exc).__name__}: {str(exc)[:80]}"
    return ""


def precompile(names: list[str], groups: list[int], rows: list[int], sms: int, jobs: int, chosen: set[str]) -> None:
    """Compile every kernel the sweep launches in ``jobs`` processes first: one at a time in the
    main process the compiles alone would take several minutes. Triton specialises the row
    count only as 1, a multiple of 16 or other, and N (a multiple of 16 here) not at all, so
    one launch per (K, G, row class, config) covers the sweep."""
    tasks: dict[tuple[object, ...], tuple[int, int, int, int, dict[str, int]]] = {}
    for name in names:
        n, k = PROJECTIONS[name]
        for g in groups:
            for m in rows:
                row_class = 1 if m == 1 else (16 if m % 16 == 0 else 2)
                for variant, configs in candidates(m, n, k, sms).items():
                    if variant not in chosen:
                        continue
                    # the tensor-core kernel's rows a program are a constexpr (a power of two)
                    rc = min(1 << (m - 1).bit_length(), 16) if variant.startswith("tcgemv") else row_class
                    for cfg in configs:
                        key = (k, g, rc, json.dumps(cfg.as_dict()))
                        tasks.setdefault(key, (n, k, g, m, cfg.as_dict()))
    start = time.perf_counter()
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(jobs, mp_context=ctx) as pool:
        failed = [err for err in pool.map(_compile, tasks.values(), chunksize=1) if err]
    print(f"compiled {len(tasks)} kernels in {time.perf_counter() - start:.0f} s with {jobs} processes"
          f"{f' ({len(failed)} failed: {failed[0]})' if failed else ''}", flush=True)  # fmt: skip


def time_dense(x: torch.Tensor, dense: list[torch.Tensor]) -> float:
    """cuBLAS on bf16 weights of the same shape: median microseconds a launch."""

    def launch(i: int) -> object:
        return torch.nn.functional.linear(x, dense[i % len(dense)])

    return tuning.time_launches(launch, max(len(dense), 16), reps=10)


def best(
    configs: list[tuning.KernelConfig], x: torch.Tensor, weights: list[tuple[torch.Tensor, ...]], g: int
) -> tuple[float, tuning.KernelConfig | None]:
    """Fastest config (median microseconds a launch), after checking it against the reference."""
    results = []
    for cfg in configs:
        try:

            def launch(i: int, cfg: tuning.KernelConfig = cfg) -> object:
                q, s, z = weights[i % len(weights)]
                return run_int4(x, q, s, z, g, cfg)

            results.append((tuning.time_launches(launch, max(len(weights), 16), reps=10), cfg))
        except Exception as exc:  # noqa: BLE001 - e.g. out of shared memory: report and skip
            print(f"  skipped {cfg.as_dict()}: {type(exc).__name__}: {str(exc)[:100]}", flush=True)
            torch.cuda.synchronize()
    if not results:
        return math.nan, None
    t_us, cfg = min(results, key=lambda r: r[0])
    q, s, z = weights[0]
    y = run_int4(x, q, s, z, g, cfg).float()
    ref = reference.w4a16_linear(x.float(), q, s, z, None, g)
    torch.testing.assert_close(y, ref, atol=2e-2 * ref.abs().max().item(), rtol=2e-2, msg=str(cfg))
    return t_us, cfg


def summarize(
    table: list[dict[str, object]],
    names: list[str],
    groups: list[int],
    rows_list: list[int],
    out: Path | None,
) -> None:
    """The markdown table, and the decode-step sums over the four projections."""
    print(
        "\n| projection | G | rows | gemm us (GB/s) | gemv us (GB/s) | tcgemv us (GB/s) "
        "| tcgemv sub-zeros us (GB/s) | tcgemv prefetch us (GB/s) | dequant us | bf16 us (GB/s) | best int4 / bf16 |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    by_key: dict[tuple[str, int, int], dict[str, dict[str, object]]] = {}
    for r in table:
        by_key.setdefault((str(r["projection"]), int(r["group_size"]), int(r["rows"])), {})[
            str(r["variant"])
        ] = r  # type: ignore[call-overload]
    for (name, g, m), v in by_key.items():

        def cell(key: str, v: dict[str, dict[str, object]] = v) -> str:
            r = v.get(key)
            return f"{r['time_us']} ({r['gb_s']})" if r else "-"

        int4 = min(float(v[key]["time_us"]) for key in INT4_VARIANTS if key in v)  # type: ignore[arg-type]
        print(f"| {name} | {g} | {m} | {cell('gemm')} | {cell('gemv')} | {cell('tcgemv')} | {cell('tcgemv_sub_zeros')} | {cell('tcgemv_prefetch')} | {cell('dequant')} | {cell('bf16')} | "
              f"{int4 / float(v['bf16']['time_us']):.3f} |")  # type: ignore[arg-type]  # fmt: skip
    # A decode step's four projections of one layer, best int4 path each, against bf16.
    if set(names) == set(PROJECTIONS):
        for g in groups:
            for m in rows_list:
                keys = [(p, g, m) for p in names]
                int4 = sum(
                    min(float(by_key[key][v]["time_us"]) for v in INT4_VARIANTS if v in by_key[key])
                    for key in keys
                )  # type: ignore[arg-type]
                bf16 = sum(float(by_key[key]["bf16"]["time_us"]) for key in keys)  # type: ignore[arg-type]
                gemv = sum(float(by_key[key]["gemv"]["time_us"]) for key in keys if "gemv" in by_key[key])  # type: ignore[arg-type]
                tc = sum(float(by_key[key]["tcgemv"]["time_us"]) for key in keys if "tcgemv" in by_key[key])  # type: ignore[arg-type]
                tc_sz = sum(
                    float(by_key[key]["tcgemv_sub_zeros"]["time_us"])
                    for key in keys
                    if "tcgemv_sub_zeros" in by_key[key]
                )  # type: ignore[arg-type]
                tc_pf = sum(
                    float(by_key[key]["tcgemv_prefetch"]["time_us"])
                    for key in keys
                    if "tcgemv_prefetch" in by_key[key]
                )  # type: ignore[arg-type]
                record(out, {"figure": "layer_projections_us", "group_size": g, "rows": m,
                                  "best_int4_us": round(int4, 2), "gemv_us": round(gemv, 2) if gemv else None,
                                  "tcgemv_us": round(tc, 2) if tc else None,
                                  "tcgemv_sub_zeros_us": round(tc_sz, 2) if tc_sz else None,
                                  "tcgemv_prefetch_us": round(tc_pf, 2) if tc_pf else None,
                                  "bf16_us": round(bf16, 2), "ratio_to_bf16": round(int4 / bf16, 3)})  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--rows", default="1,2,4,8,16,64")
    ap.add_argument("--groups", default="128,64")
    ap.add_argument("--projections", default=",".join(PROJECTIONS))
    ap.add_argument("--variants", default=",".join(INT4_VARIANTS), help="int4 variants to time (bf16 always)")
    ap.add_argument("--jobs", type=int, default=min(12, os.cpu_count() or 1), help="compile processes")
    args = ap.parse_args()
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
    rows_list = [int(r) for r in args.rows.split(",")]
    groups = [int(g) for g in args.groups.split(",")]
    names = [p for p in args.projections.split(",") if p]
    chosen = set(args.variants.split(","))
    if chosen - set(INT4_VARIANTS):
        ap.error(f"unknown variants {sorted(chosen - set(INT4_VARIANTS))}; known: {', '.join(INT4_VARIANTS)}")
    sms = tuning.num_sms()
    record(args.out, {"figure": "machine", "gpu": torch.cuda.get_device_name(0), "sms": sms,
                      "torch": torch.__version__, "date": time.strftime("%Y-%m-%d %H:%M")})  # fmt: skip
    start = time.perf_counter()
    if args.jobs > 1:
        precompile(names, groups, rows_list, sms, args.jobs, chosen)
    gen = torch.Generator(device="cuda").manual_seed(0)
    table: list[dict[str, object]] = []
    for name in names:
        n, k = PROJECTIONS[name]
        dense_sets = max(1, min(MAX_SETS, math.ceil(COLD_BYTES / (n * k * 2))))
        dense = [
            torch.randn((n, k), generator=gen, device="cuda", dtype=torch.bfloat16) for _ in range(dense_sets)
        ]
        for g in groups:
            int4_bytes = n * k // 2 + 3 * (k // g) * n
            sets = max(1, min(MAX_SETS, math.ceil(COLD_BYTES / int4_bytes)))
            weights = int4_weights(n, k, g, sets, gen)
            for m in rows_list:
                x = torch.randn((m, k), generator=gen, device="cuda", dtype=torch.bfloat16)
                bf16_us = time_dense(x, dense)
                variants: dict[str, tuple[float, tuning.KernelConfig | None]] = {
                    variant: best(configs, x, weights, g)
                    for variant, configs in candidates(m, n, k, sms).items()
                    if variant in chosen
                }
                variants["bf16"] = (bf16_us, None)
                for variant, (t_us, cfg) in variants.items():
                    nbytes = n * k * 2 if variant == "bf16" else int4_bytes
                    row = {
                        "projection": name, "n": n, "k": k, "group_size": g, "rows": m, "variant": variant,
                        "time_us": round(t_us, 2), "weight_bytes": nbytes,
                        "gb_s": round(nbytes / (t_us * 1e-6) / 1e9, 1), "ratio_to_bf16": round(t_us / bf16_us, 3),
                        "config": cfg.as_dict() if cfg is not None else None,
                    }  # fmt: skip
                    record(args.out, row)
                    table.append(row)
            del weights
        del dense
        torch.cuda.empty_cache()

    summarize(table, names, groups, rows_list, args.out)
    record(args.out, {"figure": "elapsed_s", "value": round(time.perf_counter() - start, 1)})


if __name__ == "__main__":
    main()
