"""The fused gated activation + FP8 per-token quantisation (kernels/activation.py's
``_act_and_mul_fp8_kernel``, token mode) at other column blocks and warp counts than the fixed
choice ``act_and_mul_fp8`` launches (the whole row held at once: 16,384 columns and 16 warps for
Llama-3-8B's 14,336), at the row counts of W1's and W6's steps. Every config's output is checked
bit for bit against the fixed choice's before it is timed; the table gives microseconds a launch
and the bytes moved (x read once, e4m3 and scales written) as a share of the copy bandwidth.

    python benchmarks/act_quant_configs.py [--d 14336] [--rows 1,64,256,512,1024,4096,8192]

One GPU with FP8 (sm_89+). Times: CUDA-graph replays of 20 launches, median of 10 (kernels.tuning).
"""

from __future__ import annotations

import argparse

import torch
import triton

from pagecast.kernels import activation, fp8_gemm, reference
from pagecast.kernels.tuning import time_launches

# (columns a pass step, warps); a block under the row's width is the kernel's two-pass form
CONFIGS = [(16384, 16), (16384, 8), (16384, 32), (8192, 8), (8192, 16), (4096, 4), (4096, 8), (2048, 4)]


def launch(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor, block: int, warps: int) -> None:
    d = x.shape[1] // 2
    activation._act_and_mul_fp8_kernel[(x.shape[0],)](
        x, q, s, x.stride(0), d, ACT=0, MODE=0, GROUP_K=fp8_gemm.GROUP, BLOCK=block,
        NUM_BLOCKS=triton.cdiv(d, block), MIN_AMAX=reference.FP8_MIN_AMAX, QMAX=fp8_gemm.FP8_MAX, num_warps=warps,
    )  # fmt: skip


def copy_gbs() -> float:
    a = torch.empty(1 << 28, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    us = time_launches(lambda i: b.copy_(a), 5)
    return 2 * a.numel() / us / 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--d", type=int, default=14336)
    ap.add_argument("--rows", default="1,64,256,512,1024,4096,8192")
    args = ap.parse_args()
    torch.manual_seed(0)
    d = args.d
    bw = copy_gbs()
    print(f"{torch.cuda.get_device_name()}, d {d}, copy {bw:.0f} GB/s")
    configs = [(b, w) for b, w in CONFIGS if b <= max(512, triton.next_power_of_2(d))]
    print("| rows | " + " | ".join(f"{b}/{w}w" for b, w in configs) + " |")
    print("|---|" + "---|" * len(configs))
    for m in [int(r) for r in args.rows.split(",")]:
        x = torch.randn(m, 2 * d, device="cuda", dtype=torch.bfloat16)
        q_ref, s_ref = activation.act_and_mul_fp8(x, "silu", "token")
        moved = x.numel() * 2 + m * d + m * 4
        cells = []
        for block, warps in configs:
            q = torch.empty_like(q_ref)
            s = torch.empty_like(s_ref)
            try:
                launch(x, q, s, block, warps)
            except Exception as e:  # noqa: BLE001 - a config that does not compile is reported, not fatal
                cells.append(f"error {type(e).__name__}")
                continue
            torch.cuda.synchronize()
            if not (torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(s, s_ref)):
                cells.append("DIFFERS")
                continue
            us = time_launches(lambda i, x=x, q=q, s=s, b=block, w=warps: launch(x, q, s, b, w), 20)
            cells.append(f"{us:.1f} us ({moved / us / 1e3 / bw:.0%})")
        print(f"| {m} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
