"""Does Triton 3.6's Hopper warp specialisation speed up flash attention? (issue 32's lead)

A toy forward kernel, not pagecast's: one K/V tile per TMA descriptor load (contiguous K and V,
as a paged cache of block size >= BLOCK_N would give), non-causal, bf16, head_dim 128, no GQA;
timed with ``tl.range(..., warp_specialize=True)`` (Triton's Hopper pass splits the loop into
producer and consumer warps only at num_warps=4, and only with TMA loads: compiled for sm_90 on
the CPU, the cp.async gathers of kernels/paged_prefill_attention.py stay unsplit) against the same
loop without it, against the bf16 matmul peak of the same run.

    python benchmarks/attention_ws_probe.py [--queries 8192] [--keys 32768] [--heads 32]
"""

from __future__ import annotations

import argparse
import json

import torch
import triton
import triton.language as tl


@triton.jit
def _attn_tma(q_ptr, k_ptr, v_ptr, o_ptr, n_q, n_keys, qk_scale, WS: tl.constexpr, BLOCK_M: tl.constexpr,
              BLOCK_N: tl.constexpr, D: tl.constexpr):  # fmt: skip
    head = tl.program_id(1)
    row0 = head * n_q + tl.program_id(0) * BLOCK_M
    q_desc = tl.make_tensor_descriptor(q_ptr, [n_q * tl.num_programs(1), D], [D, 1], [BLOCK_M, D])
    k_desc = tl.make_tensor_descriptor(k_ptr, [n_keys * tl.num_programs(1), D], [D, 1], [BLOCK_N, D])
    v_desc = tl.make_tensor_descriptor(v_ptr, [n_keys * tl.num_programs(1), D], [D, 1], [BLOCK_N, D])
    q = q_desc.load([row0, 0])
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    base = head * n_keys
    for start in tl.range(0, n_keys, BLOCK_N, warp_specialize=WS):
        k = k_desc.load([base + start, 0])
        s = tl.dot(q, k.T)
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        p = tl.exp2(s * qk_scale - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = v_desc.load([base + start, 0])
        acc = acc * alpha[:, None] + tl.dot(p.to(tl.bfloat16), v)
        m_i = m_new
    o_desc = tl.make_tensor_descriptor(o_ptr, [n_q * tl.num_programs(1), D], [D, 1], [BLOCK_M, D])
    o_desc.store([row0, 0], (acc / l_i[:, None]).to(tl.bfloat16))


def _ms(fn, reps: int = 10) -> float:  # type: ignore[no-untyped-def]
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--queries", type=int, default=8192)
    ap.add_argument("--keys", type=int, default=32768)
    ap.add_argument("--heads", type=int, default=32)
    args = ap.parse_args()
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    d, h, m, n = 128, args.heads, args.queries, args.keys
    g = torch.Generator("cuda").manual_seed(0)
    q = torch.randn(h * m, d, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(h * n, d, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(h * n, d, device="cuda", dtype=torch.bfloat16, generator=g)
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16, generator=g)
    peak = 2 * 8192**3 / (_ms(lambda: a @ a, 20) * 1e-3)
    flops = 4 * h * m * n * d
    scale = d**-0.5 * 1.4426950408889634
    ref = None
    for ws, warps, block_n, stages in [(False, 8, 128, 2), (False, 8, 128, 3), (False, 4, 128, 2), (False, 8, 64, 3),
                                        (True, 4, 128, 2), (True, 4, 128, 3), (True, 4, 64, 2), (True, 4, 64, 3)]:  # fmt: skip
        out = torch.empty_like(q)

        def run(ws=ws, warps=warps, block_n=block_n, stages=stages, out=out):  # type: ignore[no-untyped-def]
            _attn_tma[(m // 128, h)](q, k, v, out, m, n, scale, WS=ws, BLOCK_M=128, BLOCK_N=block_n, D=d,
                                     num_warps=warps, num_stages=stages)  # fmt: skip

        try:
            ms = _ms(run)
        except Exception as e:  # noqa: BLE001 - a variant that does not compile or launch is reported
            print(json.dumps({"ws": ws, "warps": warps, "block_n": block_n, "stages": stages, "error": str(e)[:200]}))
            continue
        if ref is None:
            ref = out.float()
        diff = (out.float() - ref).abs().max().item()
        print(json.dumps({"ws": ws, "warps": warps, "block_n": block_n, "stages": stages, "ms": round(ms, 3),
                          "tflops": round(flops / ms / 1e9, 1), "fraction_of_peak": round(flops / ms / 1e-3 / peak, 3),
                          "max_abs_diff_vs_first": diff}), flush=True)  # fmt: skip
    print(json.dumps({"matmul_peak_tflops": round(peak / 1e12, 1), "queries": m, "keys": n, "heads": h}))


if __name__ == "__main__":
    main()
