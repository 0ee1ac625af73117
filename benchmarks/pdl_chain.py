"""What programmatic dependent launch (PDL) would save a decode step: a chain of dependent
matrix-vector kernels inside one CUDA graph, launched plainly and with PDL (GPU only, sm_90+).

    python benchmarks/pdl_chain.py [--kernels 64] [--shapes o,qkv,down,norm] [--replays 50]

Why: at batch 1 a decode step is a chain of ~320 small kernels (Llama-3-8B; ~600 for
Qwen3-30B-A3B), each of which waits for the one before it to finish, drain and be replaced on
the multiprocessors. The build's tables time each kernel alone, so that gap is in no table: it is
the difference between W4 and the sum of its kernels (benchmarks/RESULTS.md, eleventh session:
FP8 W4 3.27 ms, FP8 GEMVs 2.32 ms of it at 72% of copy). With PDL (Hopper's griddepcontrol), a
kernel launched with the programmatic-serialisation attribute may start while the one before it
runs; it must execute ``griddepcontrol.wait`` (Triton: ``tl.extra.cuda.gdc_wait``) before it
touches what that kernel writes, and the wait returns once the earlier kernel has finished and its
writes are visible. A weight read does not depend on the previous kernel, so a GEMV may begin
streaming its weights before the wait.

Each link of the chain is y = W_i @ x (one row, bf16 weights [N, K], fp32 accumulation, bf16 out)
whose x is the previous link's y (the shapes alternate so that N of one is K of the next: a real
dependency, as in a model). Modes, each captured in its own CUDA graph:

  plain       no PDL: the baseline every engine step runs today
  wait        launched with PDL, ``gdc_wait`` first thing: only the launch and the programs'
              start overlap the previous kernel's tail
  prefetch    launched with PDL; the program loads its first weight tile, then waits, then loads x
  trigger     as prefetch, and ``gdc_launch_dependents`` once the program's loads are issued, so
              the next kernel's programs may be scheduled before this one's finish

Two more modes chain the engine's own bf16 decode GEMV (kernels/skinny_gemm.py, BLOCK_N 32,
BLOCK_K 256, one row) through its launcher, with kernels/pdl.py off and on:

  engine      skinny_gemm as an engine built without PAGECAST_PDL launches it
  engine_pdl  skinny_gemm as an engine built with PAGECAST_PDL=1 launches it (waits first)

Prints per mode and shape: us a link (graph replay time / links), the weight bytes' rate, and the
saving against plain (the engine modes: against engine). Every mode's output is checked against
plain's (the engine modes: against engine's), bitwise: the arithmetic is the same, only the
scheduling differs. The result says whether PDL in the decode kernels (kernels/pdl.py, opt-in at
build) pays, and whether fetching weights before the wait would add to it.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

# Llama-3-8B projections at batch 1 (N, K); "norm" is a tiny square link, the size of a norm's
# or a rotary kernel's work, where the launch gap is all there is.
SHAPES = {"o": (4096, 4096), "qkv": (6144, 4096), "down": (4096, 14336), "gate_up": (28672, 4096), "norm": (256, 256)}
MODES = ("plain", "wait", "prefetch", "trigger")
ENGINE_MODES = ("engine", "engine_pdl")


@triton.jit
def _gemv_kernel(
    x_ptr,  # [K] bf16: the previous link's output
    w_ptr,  # [N, K] bf16
    y_ptr,  # [N] bf16
    N,
    K,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,  # 0 plain, 1 wait first, 2 prefetch a weight tile then wait, 3 as 2 and trigger
):
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * K
    if PDL == 1:
        gdc_wait()
    # The first weight tile: independent of the previous kernel, so it may be read before the wait.
    w = tl.load(w_rows + offs_k[None, :], mask=n_ok[:, None] & (offs_k < K)[None, :], other=0.0)
    if PDL >= 2:
        gdc_wait()
    if PDL == 3:
        gdc_launch_dependents()
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + offs_k
        x = tl.load(x_ptr + ks, mask=ks < K, other=0.0).to(tl.float32)
        acc += tl.sum(w.to(tl.float32) * x[None, :], axis=1)
        nxt = ks + BLOCK_K
        w = tl.load(w_rows + nxt[None, :], mask=n_ok[:, None] & (nxt < K)[None, :], other=0.0)
    tl.store(y_ptr + offs_n, acc.to(y_ptr.dtype.element_ty), mask=n_ok)


def block_n_for(n: int, sms: int) -> int:
    """Columns a program: enough programs for every multiprocessor at least twice, 4..64."""
    bn = 64
    while bn > 4 and triton.cdiv(n, bn) < 2 * sms:
        bn //= 2
    return bn


def chain(links: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], mode: int, sms: int) -> None:
    for w, x, y in links:
        n, k = w.shape
        bn = block_n_for(n, sms)
        _gemv_kernel[(triton.cdiv(n, bn),)](
            x, w, y, n, k, BLOCK_N=bn, BLOCK_K=256, PDL=mode, num_warps=4, num_stages=1, launch_pdl=mode > 0
        )


def make_links(shape: tuple[int, int], count: int, device: torch.device) -> list:
    """count links whose x is the previous link's y: shapes (N, K) then (K, N) alternately."""
    n, k = shape
    gen = torch.Generator(device=device).manual_seed(0)
    x0 = torch.randn(k, device=device, dtype=torch.bfloat16, generator=gen)
    links, x = [], x0
    for i in range(count):
        rows, cols = (n, k) if i % 2 == 0 else (k, n)
        w = (torch.randn(rows, cols, device=device, dtype=torch.bfloat16, generator=gen) / cols**0.5).contiguous()
        y = torch.empty(rows, device=device, dtype=torch.bfloat16)
        links.append((w, x, y))
        x = y
    return links


def engine_chain(links: list, pdl_on: bool) -> torch.Tensor:
    """The links through the engine's skinny_gemm launcher; returns the last output."""
    from pagecast.kernels import pdl, skinny_gemm
    from pagecast.kernels.tuning import KernelConfig

    config = KernelConfig({"BLOCK_N": 32, "BLOCK_K": 256}, num_warps=4, num_stages=4)
    pdl.set_enabled(pdl_on)
    try:
        x = links[0][1]
        for w, _, _ in links:
            x = skinny_gemm.skinny_gemm(x.view(1, -1), w, None, config).view(-1)
        return x
    finally:
        pdl.set_enabled(False)


def time_mode(links: list, mode: int | str, sms: int, replays: int) -> tuple[float, torch.Tensor]:
    """Median us of one replay of the chain captured in a CUDA graph, and its last output."""
    if isinstance(mode, str):
        def run() -> torch.Tensor:
            return engine_chain(links, mode == "engine_pdl")
    else:
        def run() -> torch.Tensor:
            chain(links, mode, sms)
            return links[-1][2]
    run()  # compile and load outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        graph.capture_begin()
        out = run()
        graph.capture_end()
    torch.cuda.synchronize()
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)  # us
    times.sort()
    return times[len(times) // 2], out.clone()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kernels", type=int, default=64, help="links in the chain")
    ap.add_argument("--shapes", default="norm,o,qkv,down")
    ap.add_argument("--replays", type=int, default=50)
    args = ap.parse_args()
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
        sys.exit("pdl_chain.py needs an sm_90 or newer GPU (programmatic dependent launch)")
    device = torch.device("cuda")
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    rows = []
    for name in args.shapes.split(","):
        links = make_links(SHAPES[name], args.kernels, device)
        weight_bytes = sum(w.numel() * w.element_size() for w, _, _ in links)
        base, expected = None, None
        engine_base, engine_expected = None, None
        for mode, label in [*enumerate(MODES), *((m, m) for m in ENGINE_MODES)]:
            us, out = time_mode(links, mode, sms, args.replays)
            if expected is None:
                base, expected = us, out
            if label == "engine":  # the engine's own kernel: compared with itself without PDL
                engine_base, engine_expected = us, out
            same = bool(torch.equal(out, engine_expected if label.startswith("engine") else expected))
            row = {
                "shape": name, "mode": label, "us_per_link": round(us / args.kernels, 2),
                "weight_tb_s": round(weight_bytes / (us * 1e-6) / 1e12, 3),
                "saving_vs_plain": round(1 - us / (engine_base if label.startswith("engine") else base), 3),
                "output_equal_to_plain": same,
            }  # fmt: skip
            print(json.dumps(row), flush=True)
            rows.append(row)
        del links
        torch.cuda.empty_cache()
    print("\n| shape | mode | us a link | weight TB/s | saving vs plain | output = plain |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['shape']} | {r['mode']} | {r['us_per_link']} | {r['weight_tb_s']} | "
            f"{r['saving_vs_plain']:.1%} | {r['output_equal_to_plain']} |"
        )


if __name__ == "__main__":
    main()
