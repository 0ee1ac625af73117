"""What the paged prefill kernel compiles to on an H100/H200 (sm_90), without a GPU.

    python benchmarks/prefill_ptx.py [--caches bf16,fp8,fp16,fp32] [--arch 90]
                                     [--variants 64x64x4x2,...] [--options PREFETCH_BLOCKS,...]
                                     [--dump DIR] [--json FILE]

The prefill counterpart of benchmarks/decode_ptx.py, whose compile routine and counters it uses
(see that file for what each count means): kernels/paged_prefill_attention.py's
_paged_prefill_kernel compiled for sm_90 on the CPU at every tile the tuner times (_VARIANTS:
BLOCK_M, BLOCK_N, warps, stages; at this shape prune_configs keeps them all), for each KV-cache
dtype at the Llama-3-8B prefill shape (32 query heads over 8 KV heads, head_dim 128, KV block
size 16; q bf16 for a bf16 or fp8 cache; a 2048-token prompt, the t2048 bucket), with the
launch's specialisation (16-divisible pointers and strides; num_seqs and stride_bt not
specialised). --arch 89 compiles for Ada (L40S), the other GPU an fp8 cache is built for.

The kernel has two K/V tile loops: the tiles every row of the query tile sees in full, then the
causal tiles along the diagonal. The counts are for the first loop's body (one tile; most of a
long prompt's keys), in brackets where it differs for the whole kernel.

What it shows (triton 3.6): on sm_90 every tuned tile runs its dots on wgmma, and an fp8 cache's
K and V tiles copy in 16-byte cp.async.cg, are read back in 16-byte ld.shared, upcast, and stored
again in wgmma's shared layout: none of the decode kernel's 8-byte copies and byte-wise shared
reads of V (that came from mma.sync's 8-bit dot-operand staging), so the int32-word read changes
nothing there. On sm_89 (mma.sync) the fp8 tiles do take 8-byte cp.async.ca and ld.shared.u8.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton

# decode_ptx refuses to run under TRITON_INTERPRET (it compiles for the GPU); its directory is
# this script's, on sys.path when run as a script.
sys.path.insert(0, str(Path(__file__).resolve().parent))
import decode_ptx  # noqa: E402

from pagecast.kernels import paged_prefill_attention as ppa  # noqa: E402

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = (
    decode_ptx.NUM_HEADS, decode_ptx.NUM_KV_HEADS, decode_ptx.HEAD_DIM, decode_ptx.BLOCK_SIZE,
)  # fmt: skip
NUM_TOKENS = 2048  # one 2048-token prompt (the t2048 bucket's problem)


def launch_args(
    q_dtype: torch.dtype, cache_dtype: torch.dtype, block_size: int = BLOCK_SIZE
) -> tuple[list, dict]:
    """The positional arguments and constexprs paged_prefill_attention() passes at this shape
    (tiny CPU tensors stand in for the pointers: only their dtype and 16-byte alignment matter;
    strides come from meta tensors of the real shapes)."""
    q = torch.empty((NUM_TOKENS, NUM_HEADS, HEAD_DIM), dtype=q_dtype, device="meta")
    cache = torch.empty((4096, NUM_KV_HEADS, block_size, HEAD_DIM), dtype=cache_dtype, device="meta")
    tables = torch.empty((1, NUM_TOKENS // block_size), dtype=torch.int32, device="meta")

    def ptr(dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(16, dtype=dtype)

    args = [
        ptr(q_dtype), ptr(cache_dtype), ptr(cache_dtype), ptr(torch.int32), ptr(torch.int32),
        ptr(torch.int32), ptr(q_dtype), ptr(q_dtype), 0.125 * ppa._LOG2E, 1.0, 0.0, 0, 1,
        q.stride(0), q.stride(1), *cache.stride()[:3], *cache.stride()[:3], tables.stride(0),
        q.stride(0), q.stride(1),
    ]  # fmt: skip
    group = NUM_HEADS // NUM_KV_HEADS
    constexprs = {
        "GROUP": group, "GROUP_PAD": triton.next_power_of_2(group), "HEAD_DIM": HEAD_DIM,
        "HEAD_DIM_PAD": HEAD_DIM, "BLOCK_SIZE": block_size,
        "DOT_PRECISION": "ieee" if q_dtype == torch.float32 else "tf32",
    }  # fmt: skip
    return args, constexprs


def analyse(
    cache: str, block_m: int, block_n: int, warps: int, stages: int, dump: Path | None, arch: int = 90,
    options: tuple[str, ...] = (), block_size: int = BLOCK_SIZE,
) -> dict[str, object]:  # fmt: skip
    q_dtype, cache_dtype = decode_ptx.CACHES[cache]
    args, constexprs = launch_args(q_dtype, cache_dtype, block_size)
    constexprs.update(BLOCK_M=block_m, BLOCK_N=block_n, **{name: True for name in options})
    target = decode_ptx.GPUTarget("cuda", arch, 32)
    kernel = decode_ptx.compile_kernel(ppa._paged_prefill_kernel, args, constexprs, warps, stages, target)
    arch_tag = f"_sm{arch}" if arch != 90 else ""
    name = f"{cache}_b{block_size}_m{block_m}_n{block_n}_w{warps}_s{stages}{arch_tag}"
    name += "".join(f"_{o.lower()}" for o in options)
    return {
        "variant": name, "cache": cache, "BLOCK_M": block_m, "BLOCK_N": block_n, "num_warps": warps,
        "num_stages": stages, **decode_ptx.kernel_stats(kernel, name, dump, loop=0),
    }  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--caches", default="bf16,fp8", help="comma-separated of " + ",".join(decode_ptx.CACHES))
    ap.add_argument("--variants", default="", help="e.g. 64x64x4x2,128x64x8x2 (default: every tuned variant)")
    ap.add_argument(
        "--arch", type=int, default=90,
        help="compute capability x10 (89: Ada, e.g. L40S, the other fp8-cache target: no wgmma)",
    )  # fmt: skip
    ap.add_argument(
        "--options", default="",
        help="launch options switched on, comma-separated of " + ",".join(ppa.OPTION_NAMES),
    )  # fmt: skip
    ap.add_argument("--block-size", type=int, default=BLOCK_SIZE, help="KV-cache block size in tokens")
    ap.add_argument("--dump", type=Path, help="write each variant's TTGIR and PTX here")
    ap.add_argument("--json", type=Path, help="write the counts as JSON")
    args = ap.parse_args()
    group = NUM_HEADS // NUM_KV_HEADS
    variants = [*dict.fromkeys((c["BLOCK_M"], c["BLOCK_N"], c.num_warps, c.num_stages)
                for c in ppa.prune_configs(ppa.CONFIG_SPACE, group, HEAD_DIM))]  # fmt: skip
    if args.variants:
        variants = [tuple(int(x) for x in v.split("x")) for v in args.variants.split(",")]
    print(
        f"triton {triton.__version__}, sm_{args.arch}, Llama-3-8B prefill shape; "
        "counts: full-tile loop body [whole kernel]"
    )
    rows = []
    for cache in args.caches.split(","):
        for block_m, block_n, warps, stages in variants:
            opts = tuple(o for o in args.options.split(",") if o)
            r = analyse(cache, block_m, block_n, warps, stages, args.dump, args.arch, opts, args.block_size)
            decode_ptx.print_row(r)
            rows.append(r)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
