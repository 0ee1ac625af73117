"""Would two half-batches on two CUDA streams beat one batch on one stream? (issue 33's W6 lead)

bf16 W6's target (24,000 tok/s) is 98.6% of its serial bound: a decode step runs its matmuls
(compute-bound at 512 rows) and then its attention (bound by the KV it reads) one after the
other. Only running one half-batch's attention while the other half's matmuls run can pass that
bound. Before building that into the engine, this measures what the GPU gives, on the engine's
own kernels at Llama-3-8B's shapes (dummy weights, one GPU):

    one     ``--layers`` layers of [qkv, o, gate_up, down GEMMs at ``--batch`` rows (cuBLAS, as
            ops.linear runs them from 17 rows up), then paged decode attention over ``--batch``
            sequences of ``--context`` tokens (the launcher's default config)], one stream
    two     the same work as two half-batches, each its own chain of those layers on its own
            stream, the second chain starting with its attention so that the chains' phases are
            offset; both captured in one CUDA graph (a fork and a join), as a decode graph would be
    parts   the GEMMs alone and the attention alone at the full batch (one stream), for the
            serial sum

With ``--carveouts C,...`` (NanoFlow's idea: the two kinds of work side by side on disjoint SMs
rather than each filling the GPU in turn), for each C, the GEMMs target all but C of the SMs
(cuBLASLt's SM count target, torch's ``_set_sm_carveout_experimental``), so that the other
half-batch's attention, which is bound by memory rather than by its SMs, runs on the C left:

    gemms_C   the GEMMs alone at the full batch under the carve-out: what it costs them
    two_C     ``two`` with every GEMM under the carve-out
    split_C   ``two_C`` with each chain's GEMMs and attention on streams of their own, the GEMM
              streams at a higher priority, so that freed SMs go to waiting GEMM blocks first
              (timed in a graph and eagerly: graphs may not keep stream priorities)

Each is captured in a CUDA graph and replayed (tuning.time_launches, as the tuner times kernels);
the median of ``--reps`` replays, timed with CUDA events. ``one / two`` above 1 is what overlap gives; the issue needs about 1.14x on the step.

    python benchmarks/overlap.py [--batch 512] [--context 640] [--layers 8] [--reps 20] [--out DIR]
                                 [--carveouts 0,16,32,48] [--blas cublas|cublaslt]
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

import torch

from pagecast.kernels import problems, tuning
from pagecast.kernels.tuning import ModelShapes

HIDDEN, INTERMEDIATE, HEADS, KV_HEADS, HEAD_DIM = 4096, 14336, 32, 8, 128


def shapes(batch: int, context: int) -> ModelShapes:
    return ModelShapes(
        HEADS, KV_HEADS, HEAD_DIM, HIDDEN, INTERMEDIATE, 16, "bfloat16", max_model_len=max(2048, context),
        max_num_seqs=batch,
    )  # fmt: skip


class Half:
    """One (half-)batch: its activations, the shared weights, and its attention problem."""

    def __init__(self, rows: int, context: int, weights: dict[str, torch.Tensor], seed: int):
        g = torch.Generator(device="cuda").manual_seed(seed)
        self.x = torch.randn(rows, HIDDEN, device="cuda", dtype=torch.bfloat16, generator=g)
        self.inter = torch.randn(rows, INTERMEDIATE, device="cuda", dtype=torch.bfloat16, generator=g)
        self.w = weights
        s = shapes(rows, context)
        dims = {"num_seqs": rows, "max_seq_len": context}
        self.attn = problems.make_problem("paged_decode_attention", s, dims, "cuda", seed=seed)
        self.attn_cfg = problems.default_config("paged_decode_attention", s, dims)
        self.calls = 0

    def gemms(self, carveout: int | None = None) -> None:
        if carveout is not None:
            torch._C._set_sm_carveout_experimental(carveout)  # read when each matmul is launched
        try:
            self._gemms()
        finally:
            if carveout is not None:
                torch._C._set_sm_carveout_experimental(None)

    def _gemms(self) -> None:
        torch.mm(self.x, self.w["qkv"].T)
        torch.mm(self.x, self.w["o"].T)
        torch.mm(self.x, self.w["gate_up"].T)
        torch.mm(self.inter, self.w["down"].T)

    def attention(self) -> None:
        self.attn.launch(self.attn_cfg, self.calls)  # rotates block tables: KV not left in L2
        self.calls += 1


def eager_us(fn: Callable[[], None], reps: int) -> float:
    """Median microseconds of ``fn()`` launched eagerly (stream priorities as the streams have them)."""
    return tuning._median_event_seconds(fn, reps) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--context", type=int, default=640, help="tokens of every sequence (W6's mean is 640)")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--carveouts", default="", help="comma-separated SM counts the GEMMs leave free (0 = the target set to every SM)")
    ap.add_argument("--blas", choices=("default", "cublas", "cublaslt"), default="default",
                    help="torch's preferred BLAS library (the carve-out is a cuBLASLt attribute)")
    args = ap.parse_args()
    if args.blas != "default":
        torch.backends.cuda.preferred_blas_library(args.blas)
    g = torch.Generator(device="cuda").manual_seed(0)
    sizes = {"qkv": (6144, HIDDEN), "o": (HIDDEN, HIDDEN), "gate_up": (2 * INTERMEDIATE, HIDDEN), "down": (HIDDEN, INTERMEDIATE)}
    weights = {
        name: torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g) * k**-0.5 for name, (n, k) in sizes.items()
    }  # fmt: skip
    whole = Half(args.batch, args.context, weights, seed=1)
    a = Half(args.batch // 2, args.context, weights, seed=2)
    b = Half(args.batch - args.batch // 2, args.context, weights, seed=3)

    def one() -> None:
        for _ in range(args.layers):
            whole.gemms()
            whole.attention()

    def gemms_only() -> None:
        for _ in range(args.layers):
            whole.gemms()

    def attention_only() -> None:
        for _ in range(args.layers):
            whole.attention()

    side = torch.cuda.Stream()

    def two() -> None:
        main_stream = torch.cuda.current_stream()
        side.wait_stream(main_stream)  # fork
        for _ in range(args.layers):
            a.gemms()
            a.attention()
        with torch.cuda.stream(side):
            for _ in range(args.layers):
                b.attention()
                b.gemms()
        main_stream.wait_stream(side)  # join

    def carved(c: int) -> dict[str, Callable[[], None]]:
        def gemms_c() -> None:
            for _ in range(args.layers):
                whole.gemms(c)

        def two_c() -> None:
            main_stream = torch.cuda.current_stream()
            side.wait_stream(main_stream)
            for _ in range(args.layers):
                a.gemms(c)
                a.attention()
            with torch.cuda.stream(side):
                for _ in range(args.layers):
                    b.attention()
                    b.gemms(c)
            main_stream.wait_stream(side)

        def split_c() -> None:
            main_stream = torch.cuda.current_stream()
            for s in streams:
                s.wait_stream(main_stream)
            for half, (g, at), attention_first in ((a, streams[0:2], False), (b, streams[2:4], True)):
                for i in range(2 * args.layers):
                    attention_now = (i % 2 == 0) == attention_first
                    stream, other = (at, g) if attention_now else (g, at)
                    if i:
                        stream.wait_stream(other)  # the chain's previous kernel
                    with torch.cuda.stream(stream):
                        half.attention() if attention_now else half.gemms(c)
            for s in streams:
                main_stream.wait_stream(s)

        return {f"gemms_{c}": gemms_c, f"two_{c}": two_c, f"split_{c}": split_c}

    # [A's GEMMs, A's attention, B's GEMMs, B's attention]: a lower number is a higher priority,
    # and torch maps one past the device's range to its end
    streams = [torch.cuda.Stream(priority=p) for p in (-100, 0, -100, 0)]
    fns: dict[str, Callable[[], None]] = {"one": one, "two": two, "gemms": gemms_only, "attention": attention_only}
    for c in [int(x) for x in args.carveouts.split(",") if x.strip()]:
        fns.update(carved(c))
    rows = {}
    for name, fn in fns.items():
        rows[name] = tuning.time_launches(lambda _i, fn=fn: fn(), 1, args.reps)  # one graph of fn
        if name.startswith("split_"):
            rows[name + "_eager"] = eager_us(fn, args.reps)
    result = {
        "device": torch.cuda.get_device_name(),
        "blas": args.blas,
        "batch": args.batch,
        "context": args.context,
        "layers": args.layers,
        **{f"{k}_us": round(v, 1) for k, v in rows.items()},
        "one_over_two": round(rows["one"] / rows["two"], 3),
        **{f"one_over_{k}": round(rows["one"] / v, 3) for k, v in rows.items() if k.startswith(("two_", "split_"))},
        "serial_sum_over_one": round((rows["gemms"] + rows["attention"]) / rows["one"], 3),
        "attention_share": round(rows["attention"] / (rows["gemms"] + rows["attention"]), 3),
    }
    print(json.dumps(result))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        with open(args.out / "overlap.jsonl", "a") as f:
            f.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
