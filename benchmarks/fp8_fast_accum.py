"""cuBLASLt's FP8 fast accumulation against its default (promotion to fp32 every few K steps):
the time of torch._scaled_mm both ways for Llama-3-8B's projections at the row counts of W1 and
W6 steps, and each way's error against the exact fp32 emulation of the same quantised GEMM
(kernels/reference.fp8_gemm), so speed and accuracy are read side by side.

    python benchmarks/fp8_fast_accum.py [--rows 512,1024,8192]

One GPU with FP8 tensor cores (sm_89+). Times are CUDA-graph replays of 20 launches, median of 5.
"""

from __future__ import annotations

import argparse

import torch

from pagecast.kernels import reference
from pagecast.kernels.tuning import time_launches

# Llama-3-8B: qkv, o, gate_up, down as (N, K).
PROJECTIONS = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="512,1024,8192")
    args = ap.parse_args()
    torch.manual_seed(0)
    print("| projection | rows | default us | fast us | fast / default | TFLOP/s default / fast | rel. error default | rel. error fast |")
    print("|---|---|---|---|---|---|---|---|")
    for name, (n, k) in PROJECTIONS.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        qw, ws = reference.quantize_fp8_rows(w)  # per output channel
        for m in [int(r) for r in args.rows.split(",")]:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            qx, xs = reference.quantize_fp8_rows(x)
            exact = reference.fp8_gemm(qx, xs, qw, ws, None, torch.float32)
            sa, sb = xs.reshape(m, 1), ws.reshape(1, n)

            def run(fast: bool, qx=qx, sa=sa, sb=sb, qw=qw) -> torch.Tensor:  # type: ignore[no-untyped-def]
                return torch._scaled_mm(qx, qw.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16, use_fast_accum=fast)

            errors = []
            for fast in (False, True):
                y = run(fast).float()
                errors.append(((y - exact).norm() / exact.norm()).item())
            # the tuner's timing: 20 launches captured in a CUDA graph, median of 5 replays, us a launch
            t_default, t_fast = (time_launches(lambda _, fast=fast: run(fast), 20, reps=5) for fast in (False, True))
            flops = 2.0 * m * n * k
            print(
                f"| {name} | {m} | {t_default:.1f} | {t_fast:.1f} | {t_fast / t_default:.3f} | "
                f"{flops / t_default / 1e6:.0f} / {flops / t_fast / 1e6:.0f} | {errors[0]:.2e} | {errors[1]:.2e} |"
            )


if __name__ == "__main__":
    main()
