"""Does prefetching a projection's weights into L2 while a batch-1 decode step's attention runs make
that projection faster? The mechanism alone, before any engine wiring (as benchmarks/pdl_chain.py
did for PDL).

At one row a decode step's weight reads stop during rotary + KV write, the attention and its merge
(6-8 us a layer on an H200, RESULTS.md's profiles): the memory system idles. The o projection runs
right after, streaming 16-32 MiB at 42-68% of copy bandwidth (ramp-up and tail). If its weights were
already in L2 (50 MiB on H100/H200), it would read them from there.

The chain, one CUDA graph, ``--layers`` layers each with its own cold weights (x 48 MiB + 32 MiB at
Llama-3-8B's shape, so nothing stays in L2 from one replay to the next):

    qkv GEMV (1 row)  ->  a spin kernel of each ``--windows`` us (torch.cuda._sleep: no memory traffic,
    standing in for rotary, attention and merge)  ->  o GEMV (1 row)

timed per layer (median of graph replays), in four modes (tuning.time_launches):

    plain       as above
    bulk        after the qkv GEMV, a side stream (forked in the graph) runs kernels/l2_prefetch.py's
                kernel over the layer's o weight: ``cp.async.bulk.prefetch.L2`` (sm_90), one per lane
                for --sub-kib KiB, so a few programs issue the whole matrix and return; the copy
                engine fills L2 while the spin kernel runs. The branch joins before the o GEMV.
    bulk_early  the same, joined before the spin kernel, as the engine does (l2_prefetch.fork/join
                within the layer's part before attention): as fast as ``bulk`` only if the prefetch
                kernel returns before its data has arrived
    read        the same side stream reads the o weight (a torch sum over it: every SM's loads),
                joined before the o GEMV, for contrast

and ``hot``: the o GEMV alone, its weight read just before (an upper bound on what a prefetch can give).

    python benchmarks/l2_prefetch.py [--shapes llama3-8b,qwen3-30b-a3b] [--windows 0,3,6,10]
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from pagecast.kernels import l2_prefetch
from pagecast.kernels.tuning import time_launches

SHAPES = {
    # name: (hidden, qkv rows, o input)
    "llama3-8b": (4096, 6144, 4096),
    "qwen3-30b-a3b": (2048, 5120, 4096),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="llama3-8b,qwen3-30b-a3b")
    ap.add_argument("--windows", default="0,3,6,10", help="the attention stand-in's length, us")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--sub-kib", type=int, default=16, help="bytes a lane prefetches, KiB")
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    # the spin kernel counts clock cycles: cycles a microsecond, measured
    torch.cuda._sleep(1000)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(20_000_000)
    end.record()
    end.synchronize()
    khz = 20_000_000 / start.elapsed_time(end)  # cycles a millisecond
    side = torch.cuda.Stream()
    l2_prefetch.SUB_BYTES = args.sub_kib << 10
    print(json.dumps({"figure": "machine", "device": torch.cuda.get_device_name(), "torch": torch.__version__,
                      "sm_clock_khz": khz}))  # fmt: skip
    for name in args.shapes.split(","):
        run_shape(name, args, side, khz)
        torch.cuda.empty_cache()


def run_shape(name: str, args: argparse.Namespace, side: torch.cuda.Stream, khz: float) -> None:
    """Every window and mode at one shape, then the o GEMV cold and hot; one JSON line each."""
    dev, dt = torch.device("cuda"), torch.bfloat16
    hidden, qkv_rows, o_in = SHAPES[name]
    w_qkv = [torch.randn(qkv_rows, hidden, dtype=dt, device=dev) * 0.02 for _ in range(args.layers)]
    w_o = [torch.randn(hidden, o_in, dtype=dt, device=dev) * 0.02 for _ in range(args.layers)]
    x = torch.randn(1, hidden, dtype=dt, device=dev)
    a = torch.randn(1, o_in, dtype=dt, device=dev)
    outs = [torch.empty(1, hidden, dtype=dt, device=dev) for _ in range(args.layers)]

    def chain(mode: str, cycles: int) -> None:
        cur = torch.cuda.current_stream()
        for layer in range(args.layers):
            F.linear(x, w_qkv[layer])
            if mode != "plain":
                side.wait_stream(cur)
                with torch.cuda.stream(side):
                    if mode.startswith("bulk"):
                        l2_prefetch.launch(w_o[layer])
                    else:
                        w_o[layer].sum()
                if mode == "bulk_early":
                    cur.wait_stream(side)
            if cycles:
                torch.cuda._sleep(cycles)
            if mode != "plain":
                cur.wait_stream(side)
            torch.mm(a, w_o[layer].t(), out=outs[layer])

    def o_only(hot: bool) -> None:
        for layer in range(args.layers):
            if hot:
                w_o[layer].sum()  # the weight into L2 just before
            torch.mm(a, w_o[layer].t(), out=outs[layer])

    # time_launches times eagerly what it cannot capture: the side stream and the spin must capture
    # here, or the figures would be eager ones
    chain("bulk", 1000)
    with torch.cuda.graph(torch.cuda.CUDAGraph()):
        chain("bulk", 1000)
    ref = None
    for window in (float(v) for v in args.windows.split(",")):
        cycles = int(window * khz / 1000)
        row: dict[str, object] = {
            "figure": "l2_prefetch",
            "shape": name,
            "window_us": window,
            "layers": args.layers,
        }
        for mode in ("plain", "bulk", "bulk_early", "read"):
            us = (
                time_launches(lambda _, mode=mode, cycles=cycles: chain(mode, cycles), 1, args.reps)
                / args.layers
            )
            row[f"{mode}_us_per_layer"] = round(us, 2)
            got = torch.stack(outs)
            if ref is None:
                ref = got.clone()
            assert torch.equal(got, ref), f"{mode}: the o outputs changed"  # a prefetch changes no result
        row["bulk_saves_us"] = round(float(row["plain_us_per_layer"]) - float(row["bulk_us_per_layer"]), 2)  # type: ignore[arg-type]
        print(json.dumps(row), flush=True)

    cold = time_launches(lambda _: o_only(False), 1, args.reps) / args.layers
    both = time_launches(lambda _: o_only(True), 1, args.reps) / args.layers
    read = time_launches(lambda _: [w.sum() for w in w_o], 1, args.reps) / args.layers
    print(json.dumps({"figure": "o_gemv", "shape": name, "cold_us": round(cold, 2), "hot_us": round(both - read, 2),
                      "read_us": round(read, 2), "o_mib": round(w_o[0].numel() * 2 / 2**20, 1)}), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
