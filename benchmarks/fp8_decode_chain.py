"""The FP8 decode GEMV at one row, per Llama-3-8B projection, as serving launches it, timed in a
CUDA graph: with the scale pass's loads a step ahead (fp8_gemm.PASS_AHEAD) and without, and against
the two-launch path the fusions replaced (GPU only).

    python benchmarks/fp8_decode_chain.py [--links 32] [--replays 20] [--only qkv,o,gate_up,down]

Paths, each a chain of ``--links`` launches captured in one graph, the weights cycling over enough
copies that they stream from memory, not L2 (as in a model, where each layer has its own):

  one_step     qkv and gate_up with the residual add and RMSNorm inside (fp8_skinny_norm_linear),
               o plain, down with SiLU(gate) * up inside (fp8_act_and_mul_linear): what runs now
               (fp8_gemm.PASS_AHEAD off: the scale pass one step at a time)
  ahead        the same launches with PASS_AHEAD on: the scale pass's loads a step ahead
  two_launch   the norm (fused_add_rms_norm) or silu_and_mul in a launch of its own, then the
               plain kernel of this tree: the path with PAGECAST_FUSE_NORM_DECODE=0 and
               PAGECAST_FUSE_ACT_QUANT_FP8=0

Configs: each projection's SKINNY config from the H100 build of 2026-12-06 (report.md) and the
launcher's default. Prints one JSON line per (projection, config, path): us a launch, and the
weight bytes' rate; ahead and one_step outputs are compared bitwise (the loads' order changes,
not the arithmetic).
"""

from __future__ import annotations

import argparse
import json
import math
from functools import partial

import torch

from pagecast.kernels import activation, fp8_gemm, reference, rms_norm
from pagecast.kernels.quant_linear import Fp8LinearWeight
from pagecast.kernels.tuning import KernelConfig

# (projection, N, K, what feeds it, the H100 build's m1 config)
PROJECTIONS = (
    ("qkv", 6144, 4096, "norm", {"SKINNY": 1, "BLOCK_N": 64, "BLOCK_K": 128, "SPLIT_K": 4, "num_warps": 4, "num_stages": 4}),
    ("o", 4096, 4096, "plain", {"SKINNY": 1, "BLOCK_N": 32, "BLOCK_K": 256, "num_warps": 4, "num_stages": 6}),
    ("gate_up", 28672, 4096, "norm", {"SKINNY": 1, "BLOCK_N": 64, "BLOCK_K": 256, "num_warps": 4, "num_stages": 3}),
    ("down", 4096, 14336, "silu", {"SKINNY": 1, "BLOCK_N": 64, "BLOCK_K": 128, "SPLIT_K": 4, "num_warps": 4, "num_stages": 4}),
)  # fmt: skip


def _served(ahead, feed, x, residual, norm_w, weights, cfg, i):  # type: ignore[no-untyped-def]
    """Link i as serving launches it, the scale pass's loads a step ahead or not."""
    before, fp8_gemm.PASS_AHEAD = fp8_gemm.PASS_AHEAD, ahead
    w = weights[i % len(weights)]
    try:
        if feed == "norm":
            return fp8_gemm.fp8_skinny_norm_linear(x, residual, norm_w, 1e-5, w, None, cfg)[0]
        if feed == "silu":
            return fp8_gemm.fp8_act_and_mul_linear(x, w, None, "silu", cfg)
        return fp8_gemm.fp8_linear(x, w, None, cfg)
    finally:
        fp8_gemm.PASS_AHEAD = before


def _two_launch(feed, x, residual, norm_w, weights, cfg, i):  # type: ignore[no-untyped-def]
    """Link i with the norm or the activation in a launch of its own, then the plain kernel."""
    w = weights[i % len(weights)]
    if feed == "norm":
        x = rms_norm.fused_add_rms_norm(x, residual, norm_w, 1e-5)[0]
    elif feed == "silu":
        x = activation.silu_and_mul(x)
    return fp8_gemm.fp8_linear(x, w, None, cfg)


def _time(fn, links: int, replays: int) -> float:  # type: ignore[no-untyped-def]
    """us a launch: ``links`` calls of fn(i) captured in one graph, its replays timed."""
    for i in range(links):  # compiled, and every buffer allocated, before capture
        fn(i)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(links):
            fn(i)
    for _ in range(3):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000.0 / (replays * links)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--links", type=int, default=32)
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--only", default="", help="comma-separated projections")
    args = ap.parse_args()
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    l2 = torch.cuda.get_device_properties(dev).L2_cache_size
    print(json.dumps({"machine": torch.cuda.get_device_name(dev), "torch": torch.__version__, "l2_bytes": l2}))
    for name, n, k, feed, tuned in PROJECTIONS:
        if args.only and name not in args.only.split(","):
            continue
        copies = max(2, math.ceil(4 * l2 / (n * k)))
        weights = [
            Fp8LinearWeight(*reference.quantize_fp8_rows(torch.randn(n, k, generator=g, device=dev) * 0.02), None, "token")
            for _ in range(copies)
        ]
        width = 2 * k if feed == "silu" else k
        x = torch.randn(1, width, generator=g, device=dev).to(torch.bfloat16)
        residual = torch.randn(1, k, generator=g, device=dev).to(torch.bfloat16)
        norm_w = (torch.rand(k, generator=g, device=dev) + 0.5).to(torch.bfloat16)
        default = fp8_gemm.default_config(1, n, k, False, torch.bfloat16)
        for label, cfg in (("tuned_h100", KernelConfig.coerce(tuned)), ("default", default)):
            inputs = (feed, x, residual, norm_w, weights, cfg)
            paths = (("one_step", partial(_served, False, *inputs)), ("ahead", partial(_served, True, *inputs)),
                     ("two_launch", partial(_two_launch, *inputs)))  # fmt: skip
            outs = {}
            for path, fn in paths:
                us = _time(fn, args.links, args.replays)
                outs[path] = fn(0)
                print(json.dumps({"projection": name, "config": label, "path": path, "us": round(us, 2),
                                  "gb_s": round(n * k / us / 1e3, 1), "params": str(cfg)}), flush=True)  # fmt: skip
            print(json.dumps({"projection": name, "config": label, "ahead_equals_one_step": bool(torch.equal(outs["ahead"], outs["one_step"]))}))


if __name__ == "__main__":
    main()
