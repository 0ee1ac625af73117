"""Serial bounds of the throughput workloads (W1, W6): what one GPU can reach when each step runs
its matmuls at the matmul peak and then reads its KV at copy bandwidth, one after the other.

PERFORMANCE.md gives W1 a compute bound and W6 a memory bound, each on its own. A step of one CUDA
stream does both, in turn: the projections of a batch of hundreds of rows are compute-bound (a
weight byte serves that many rows, past the H200's ridge of 783e12 / 4.26e12 = 184 FLOP/byte) and
the decode attention that follows is bound by the KV it reads. Without running the two at once
(two half-batches on two streams, say), an output token costs at least the sum:

    matmul FLOPs / peak  +  KV bytes read / copy bandwidth

per output token, with the prompt tokens' matmuls shared out over the output tokens. The weights'
own reads hide under the matmuls at these batch sizes and are not counted; nor is prefill
attention (under 1% of W1's FLOPs at 512 tokens).

    python benchmarks/bounds.py [--peak-tflops 783] [--copy-gbs 4262] [--measured W1=10922,W6=20348]

The defaults are the H200 ceilings in PERFORMANCE.md and the Llama-3-8B shape. --kv-bytes 1 is the
FP8 KV cache; --matmul-speedup 2 the FP8 weights' doubled tensor-core rate (an upper limit).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

WORKLOADS = {"W1": (512, 256), "W6": (128, 1024)}  # prompt tokens, output tokens per request


@dataclass(frozen=True)
class Shape:
    layers: int = 32
    hidden: int = 4096
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    intermediate: int = 14336
    vocab: int = 128256

    def layer_params(self) -> int:
        q_o = 2 * self.hidden * self.heads * self.head_dim
        k_v = 2 * self.hidden * self.kv_heads * self.head_dim
        return q_o + k_v + 3 * self.hidden * self.intermediate

    def kv_bytes_per_token(self, element_bytes: float) -> float:
        return 2 * self.layers * self.kv_heads * self.head_dim * element_bytes


def serial_bound(
    shape: Shape, prompt: int, output: int, peak_flops: float, copy_bps: float, kv_bytes: float
) -> dict[str, float]:
    """Output tokens/s of one request mix at the serial bound, with its two parts in us per token."""
    body = 2 * shape.layers * shape.layer_params()  # FLOPs of one token through the layers
    head = 2 * shape.hidden * shape.vocab  # the LM head: the last prompt token and every output token
    flops_per_output = (prompt * body + output * (body + head)) / output
    # A decode step at context c reads c tokens of KV; the output tokens see prompt .. prompt + output - 1.
    mean_context = prompt + (output - 1) / 2
    matmul_us = flops_per_output / peak_flops * 1e6
    kv_us = mean_context * shape.kv_bytes_per_token(kv_bytes) / copy_bps * 1e6
    return {"matmul_us": matmul_us, "kv_us": kv_us, "tok_s": 1e6 / (matmul_us + kv_us)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--peak-tflops", type=float, default=783.0, help="bf16 matmul peak measured on the GPU")
    ap.add_argument(
        "--copy-gbs", type=float, default=4262.0, help="device copy bandwidth measured on the GPU"
    )
    ap.add_argument("--kv-bytes", type=float, default=2.0, help="bytes per KV element: 2 bf16, 1 fp8")
    ap.add_argument(
        "--matmul-speedup", type=float, default=1.0, help="2 for FP8 weights at twice the bf16 rate"
    )
    ap.add_argument("--measured", default="", help="W1=tok/s,W6=tok/s to set against the bounds")
    args = ap.parse_args()
    measured = {k: float(v) for k, v in (item.split("=") for item in args.measured.split(",") if item)}
    shape = Shape()
    peak = args.peak_tflops * 1e12 * args.matmul_speedup
    print(
        "| workload | matmul us / token | KV us / token | serial bound tok/s | measured | measured / bound |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    for name, (prompt, output) in WORKLOADS.items():
        b = serial_bound(shape, prompt, output, peak, args.copy_gbs * 1e9, args.kv_bytes)
        got = measured.get(name)
        ratio = f"{got / b['tok_s']:.1%}" if got else "-"
        print(
            f"| {name} | {b['matmul_us']:.1f} | {b['kv_us']:.1f} | {b['tok_s']:,.0f} | {f'{got:,.0f}' if got else '-'} | {ratio} |"
        )


if __name__ == "__main__":
    main()
