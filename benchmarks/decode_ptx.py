"""What the paged decode kernel compiles to on an H100/H200 (sm_90), without a GPU.

    python benchmarks/decode_ptx.py [--caches bf16,fp8,fp16,fp32] [--direct] [--fp8-bytes]
                                    [--variants 64x4x2,...] [--dump DIR] [--json FILE]

Compiles kernels/paged_decode_attention.py's _paged_decode_kernel for sm_90 on the CPU (Triton
lowers to PTX and, with its bundled ptxas, to a cubin) at every kernel variant the tuner times
(_VARIANTS: BLOCK_N, warps, stages), for each KV-cache dtype at the Llama-3-8B decode shape (32
query heads over 8 KV heads, head_dim 128, KV block size 16; q bf16 for a bf16 or fp8 cache).
The arguments are specialised as the runtime's launch specialises them (16-divisible pointers and
strides carry tt.divisibility=16; num_splits and stride_bt are not specialised), so this is the
code a launch on the GPU runs. Printed per variant, for the main loop body (one K/V tile; the
pipelined prologue is left out) and, in brackets where it differs, for the whole kernel:

  cp.async     global->shared copies by cache mode and bytes (cg16 = cp.async.cg 16 bytes,
               ca8 = cp.async.ca 8 bytes, ...)
  ld.global    register loads by bytes per thread (v4.b32 = 16, ...)
  ld.shared    shared loads by bytes (b8 = 1) and ldmatrix (lds16 = ldmatrix .x4 / .x4.trans)
  cvt64        PTX cvt to or from a 64-bit integer (address arithmetic widened to 64 bits)
  e4m3         cvt.rn.f16x2.e4m3x2 (one per two fp8 values)
  f16>bf16     cvt.bf16.f16 (one per value)
  mma, wgmma   mma.sync, wgmma.mma_async (sm_90's warpgroup MMA, whose B operand is read from
               shared memory by the instruction: no ldmatrix)
  SASS         from the cubin (cuobjdump): the loop's instruction count, registers, and the
               shared memory the launch allocates (metadata.shared)

This is static evidence: instruction counts, not time. Counts per tile can be compared across
variants with the same BLOCK_N and warps; a tile holds BLOCK_N x 128 K and V values.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

if os.environ.get("TRITON_INTERPRET"):
    sys.exit("decode_ptx.py compiles for the GPU: run it without TRITON_INTERPRET")

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.backends.nvidia.compiler import CUDABackend  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.runtime.jit import native_specialize_impl  # noqa: E402

from pagecast.kernels import paged_decode_attention as pda  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
# Llama-3-8B decode: 32 query heads over 8 KV heads, head_dim 128, KV block size 16.
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
# cache name -> (q dtype, cache dtype)
CACHES = {
    "bf16": (torch.bfloat16, torch.bfloat16),
    "fp8": (torch.bfloat16, torch.float8_e4m3fn),
    "fp16": (torch.float16, torch.float16),
    "fp32": (torch.float32, torch.float32),
}


def launch_args(
    q_dtype: torch.dtype, cache_dtype: torch.dtype, direct: bool, fp8_bytes: bool = False
) -> tuple[list, dict]:
    """The positional arguments and constexprs paged_decode_attention() passes for a batch of 128
    sequences at this shape (tiny CPU tensors stand in for the pointers: only their dtype and
    16-byte alignment matter; strides come from meta tensors of the real shapes)."""
    num_seqs, max_blocks = 128, 128
    q = torch.empty((num_seqs, NUM_HEADS, HEAD_DIM), dtype=q_dtype, device="meta")
    cache = torch.empty((4096, NUM_KV_HEADS, BLOCK_SIZE, HEAD_DIM), dtype=cache_dtype, device="meta")
    tables = torch.empty((num_seqs, max_blocks), dtype=torch.int32, device="meta")

    def ptr(dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(16, dtype=dtype)

    args = [
        ptr(q_dtype), ptr(cache_dtype), ptr(cache_dtype), ptr(torch.int32), ptr(torch.int32),
        ptr(torch.int32), ptr(q_dtype), ptr(torch.float32), ptr(torch.float32),
        0.125 * pda._LOG2E, 1.0, 1 if direct else 4,
        q.stride(0), q.stride(1), *cache.stride()[:3], *cache.stride()[:3], tables.stride(0),
        q.stride(0), q.stride(1),
    ]  # fmt: skip
    group = NUM_HEADS // NUM_KV_HEADS
    constexprs = {
        "GROUP": group, "GROUP_PAD": max(16, triton.next_power_of_2(group)), "HEAD_DIM": HEAD_DIM,
        "HEAD_DIM_PAD": HEAD_DIM, "BLOCK_SIZE": BLOCK_SIZE, "DIRECT": direct,
        # the launcher's choice at this shape: an fp8 cache read as int32 words, unpacked in PTX
        "FP8_WORDS": cache_dtype == torch.float8_e4m3fn and not fp8_bytes, "USE_ASM": True,
        "DOT_PRECISION": "ieee" if q_dtype == torch.float32 else "tf32",
    }  # fmt: skip
    return args, constexprs


def compile_kernel(fn, args: list, constexprs: dict, warps: int, stages: int, target: GPUTarget = TARGET):
    """triton.compile of a jitted kernel for sm_90 (or target) with the signature and
    tt.divisibility attributes the JIT launcher derives from these arguments (its own
    specialisation routine). benchmarks/prefill_ptx.py compiles the prefill kernel through this too."""
    constexprs = dict(constexprs)
    signature, attrs = {}, {}
    for i, (name, value) in enumerate(zip(fn.arg_names, args)):
        specialize = i not in fn.do_not_specialize
        ty, spec = native_specialize_impl(CUDABackend, value, False, specialize, True)
        if ty == "constexpr":  # an int equal to 1 becomes a constant, as at launch
            constexprs[name] = spec
        signature[name] = ty
        if isinstance(spec, str) and spec:
            attrs[(i,)] = CUDABackend.parse_attr(spec)
    for name in constexprs:
        signature[name] = "constexpr"
    src = ASTSource(fn, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=target, options={"num_warps": warps, "num_stages": stages})


def compile_variant(cache: str, block_n: int, warps: int, stages: int, direct: bool, fp8_bytes: bool = False):
    """The decode kernel as a launch at this shape compiles it."""
    q_dtype, cache_dtype = CACHES[cache]
    args, constexprs = launch_args(q_dtype, cache_dtype, direct, fp8_bytes)
    return compile_kernel(pda._paged_decode_kernel, args, dict(constexprs, BLOCK_N=block_n), warps, stages)


# ---------------------------------------------------------------------------- PTX counting

_CP_ASYNC = re.compile(
    r"cp\.async\.(ca|cg)\.shared\.global(?:\.[a-z0-9]+)*\s*\[[^\]]*\],\s*\[[^\]]*\],\s*(0x[0-9a-f]+|\d+)"
)
_LD = re.compile(r"\bld\.(global|shared)((?:\.[a-z0-9]+)*)\s")
_LDMATRIX = re.compile(r"\bldmatrix\.sync\.aligned\.m8n8\.(x[124])(\.trans)?")
_CVT = re.compile(r"\bcvt((?:\.[a-z0-9]+)+)\s")
_BITS = re.compile(r"\.[bsuf](8|16|32|64)$")


def _load_bytes(suffixes: str) -> int:
    parts = suffixes.split(".")[1:]
    vec = next((int(p[1:]) for p in parts if re.fullmatch(r"v[248]", p)), 1)
    bits = next((int(m.group(1)) for p in parts if (m := _BITS.search("." + p))), 32)
    return vec * bits // 8


def _pick_loop(spans: list[tuple[int, int]], loop: int | None) -> tuple[int, int] | None:
    """The shortest span (loop=None), or the loop-th in program order of the spans that hold no
    other (the innermost loops: the prefill kernel has two tile loops, one after the other)."""
    if not spans:
        return None
    if loop is None:
        return min(spans, key=lambda s: s[1] - s[0])
    inner = sorted(s for s in spans if not any(t != s and s[0] <= t[0] and t[1] <= s[1] for t in spans))
    return inner[loop]


def main_loop(lines: list[str], loop: int | None = None) -> tuple[int, int]:
    """[first, last] line of the loop that holds the softmax's ex2 (the K/V tile loop; its body
    is one pipelined tile): the shortest span from a label to a backward branch to it (loop:
    see _pick_loop)."""
    labels = {m.group(1): i for i, line in enumerate(lines) if (m := re.match(r"^(\$L__BB\d+_\d+):", line))}
    spans = []
    for i, line in enumerate(lines):
        m = re.search(r"\bbra(?:\.uni)?\s+(\$L__BB\d+_\d+);", line)
        if m and labels.get(m.group(1), i) < i:
            lo = labels[m.group(1)]
            if any("ex2.approx" in x for x in lines[lo:i]):
                spans.append((lo, i))
    return _pick_loop(spans, loop) or (0, len(lines) - 1)


def count_ptx(lines: list[str]) -> Counter:
    c: Counter = Counter()
    for line in lines:
        if m := _CP_ASYNC.search(line):
            c[f"cp.{m.group(1)}{int(m.group(2), 0)}"] += 1
        elif m := _LD.search(line):
            c[f"{'ldg' if m.group(1) == 'global' else 'lds'}{_load_bytes(m.group(2))}"] += 1
        elif m := _LDMATRIX.search(line):
            c[f"ldmatrix.{m.group(1)}{m.group(2) or ''}"] += 1
        elif m := _CVT.search(line):
            types = m.group(1).split(".")
            if any(t in ("u64", "s64") for t in types):
                c["cvt64"] += 1
            if "e4m3x2" in types:
                c["e4m3"] += 1
            if types[1:] == ["bf16", "f16"]:  # an fp16 value rounded to bf16 (one per value)
                c["f16>bf16"] += 1
        if "mma.sync" in line:
            c["mma"] += 1
        elif "wgmma.mma_async" in line:  # sm_90's warpgroup MMA: its B operand is read from shared memory
            c["wgmma"] += 1
    return c


# ---------------------------------------------------------------------------- SASS


def _tool(name: str) -> str:
    return str(Path(triton.backends.nvidia.__file__).parent / "bin" / name)


def cuobjdump(cubin: bytes) -> tuple[str, str]:
    """(cuobjdump -res-usage, cuobjdump -sass) of a cubin."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        res, sass = (
            subprocess.run([_tool("cuobjdump"), flag, f.name], capture_output=True, text=True, check=True).stdout
            for flag in ("-res-usage", "-sass")
        )
    return res, sass


def resources(res: str) -> tuple[int | None, int | None]:
    """(registers a thread, stack-frame bytes) from cuobjdump -res-usage. ptxas's spills land in
    the stack frame (STACK); the LOCAL field stays 0 for them."""
    regs = int(m.group(1)) if (m := re.search(r"REG:(\d+)", res)) else None
    stack = int(m.group(1)) if (m := re.search(r"STACK:(\d+)", res)) else None
    return regs, stack


_INSTR = re.compile(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")


def instructions(sass: str) -> list[tuple[int, str]]:
    """(address, instruction text) of every SASS instruction in a listing."""
    return [(int(m.group(1), 16), m.group(2)) for line in sass.splitlines() if (m := _INSTR.match(line))]


def sass_stats(cubin: bytes, loop: int | None = None) -> dict[str, object]:
    """Registers and the main loop's SASS instruction count and memory ops (cuobjdump; loop: see
    _pick_loop)."""
    res, sass = cuobjdump(cubin)
    regs, spill = resources(res)
    instrs = instructions(sass)
    index = {addr: i for i, (addr, _) in enumerate(instrs)}
    spans = []  # backward branches' spans that hold the softmax's MUFU.EX2
    for i, (addr, text) in enumerate(instrs):
        m = re.search(r"\bBRA\s+(0x[0-9a-f]+)", text)
        if m and int(m.group(1), 16) < addr and int(m.group(1), 16) in index:
            lo = index[int(m.group(1), 16)]
            if any("MUFU.EX2" in t for _, t in instrs[lo:i]):
                spans.append((lo, i))
    loop = _pick_loop(spans, loop)
    body = [t for _, t in instrs[loop[0]:loop[1] + 1]] if loop else []
    ops: Counter = Counter()
    for t in body:
        op = re.sub(r"^@!?U?P\w+\s+", "", t).split()[0]
        if op.startswith(("LDGSTS", "LDG", "LDS", "LDSM", "STS", "HGMMA")) or op.startswith("F2FP.F16.E4M3"):
            ops[op] += 1
    return {"regs": regs, "stack_bytes": spill, "loop_sass": len(body), "loop_ops": dict(sorted(ops.items()))}


# ---------------------------------------------------------------------------- report


def analyse(
    cache: str, block_n: int, warps: int, stages: int, direct: bool, dump: Path | None,
    fp8_bytes: bool = False,
) -> dict[str, object]:
    kernel = compile_variant(cache, block_n, warps, stages, direct, fp8_bytes)
    bytes_tag = "_bytes" if fp8_bytes and cache == "fp8" else ""
    name = f"{cache}{bytes_tag}_n{block_n}_w{warps}_s{stages}{'_direct' if direct else ''}"
    return {
        "variant": name, "cache": cache, "BLOCK_N": block_n, "num_warps": warps, "num_stages": stages,
        "direct": direct, **kernel_stats(kernel, name, dump),
    }  # fmt: skip


def kernel_stats(kernel, name: str, dump: Path | None, loop: int | None = None) -> dict[str, object]:
    """PTX counts of the main loop (loop: see _pick_loop) and the whole kernel, shared memory, and
    the SASS stats of a compiled kernel (its TTGIR and PTX written to dump/name.* when dump is given)."""
    ptx = kernel.asm["ptx"].splitlines()
    lo, hi = main_loop(ptx, loop)
    if dump is not None:
        dump.mkdir(parents=True, exist_ok=True)
        for ext in ("ttgir", "ptx"):
            (dump / f"{name}.{ext}").write_text(kernel.asm[ext])
    return {
        "loop": dict(count_ptx(ptx[lo:hi + 1])), "kernel": dict(count_ptx(ptx)),
        "shared_bytes": kernel.metadata.shared, **sass_stats(kernel.asm["cubin"], loop),
    }  # fmt: skip


def _fmt(loop: dict, whole: dict, keys: list[str]) -> str:
    out = []
    for k in keys:
        a, b = loop.get(k, 0), whole.get(k, 0)
        if a or b:
            out.append(f"{k}:{a}" + (f"[{b}]" if b != a else ""))
    return " ".join(out)


def print_row(r: dict) -> None:
    loop, whole = r["loop"], r["kernel"]
    keys = sorted(set(loop) | set(whole))
    cp = [k for k in keys if k.startswith("cp.")]
    ldg = [k for k in keys if k.startswith("ldg")]
    lds = [k for k in keys if k.startswith(("lds", "ldmatrix"))]
    spill = f"  SPILLS {r['stack_bytes']} B stack" if r["stack_bytes"] else ""
    head = f"{r['variant']:<26} regs {r['regs']:>3}  smem {r['shared_bytes']:>6}"
    head += f"  loop SASS {r['loop_sass']:>5}"
    print(head + spill)
    print(f"    cp.async  {_fmt(loop, whole, cp)}")
    print(f"    ld.global {_fmt(loop, whole, ldg)}   ld.shared {_fmt(loop, whole, lds)}")
    other = _fmt(loop, whole, ["cvt64", "e4m3", "f16>bf16", "mma", "wgmma"])
    print(f"    {other}   SASS loop {r['loop_ops']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--caches", default="bf16,fp8", help="comma-separated of " + ",".join(CACHES))
    ap.add_argument("--direct", action="store_true", help="the num_splits == 1 variant (default: split)")
    ap.add_argument("--variants", default="", help="e.g. 64x4x2,128x4x2 (default: every tuned variant)")
    ap.add_argument(
        "--fp8-bytes", action="store_true",
        help="compile the fp8 cache's byte path (FP8_WORDS=False: the launcher's for other head_dims)",
    )  # fmt: skip
    ap.add_argument("--dump", type=Path, help="write each variant's TTGIR and PTX here")
    ap.add_argument("--json", type=Path, help="write the counts as JSON")
    args = ap.parse_args()
    variants = pda._VARIANTS
    if args.variants:
        variants = [tuple(int(x) for x in v.split("x")) for v in args.variants.split(",")]
    print(f"triton {triton.__version__}, sm_90, Llama-3-8B decode shape; counts: loop body [whole kernel]")
    rows = []
    for cache in args.caches.split(","):
        for block_n, warps, stages in variants:
            r = analyse(cache, block_n, warps, stages, args.direct, args.dump, args.fp8_bytes)
            print_row(r)
            rows.append(r)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
