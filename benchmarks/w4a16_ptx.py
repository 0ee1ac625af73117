"""What the W4A16 decode GEMV compiles to on an H100/H200 (sm_90), without a GPU.

    python benchmarks/w4a16_ptx.py [--rows 1,2,4,8] [--groups 128] [--projections qkv,o,gate_up,down]
                                   [--dump DIR] [--json FILE]

For each Llama-3-8B projection (qkv 4096->6144, o 4096->4096, gate_up 4096->28672, down
14336->4096), row count and group size, every config the tuner times for the GEMV
(w4a16_gemm.gemv_configs, plus w4a16_gemv.default_config) is put through the real launcher
(kernels/w4a16_gemv.py: w4a16_gemv) on meta tensors, and the launch it would make is compiled
for sm_90 with Triton's bundled ptxas: same constexprs, same specialisation of the arguments
(16-divisible pointers, N, K and strides carry tt.divisibility=16, M == 1 becomes a constant),
so this is the code a GPU launch runs (the launcher's USE_ASM is forced on: on meta tensors it
would pick the interpreter's plain expression).

Printed per compiled kernel (one kernel can serve several projections: Triton does not
specialise N, and the row count only as 1 or not):

  loop      the main loop's SASS body (the innermost backward branch around the weight FFMAs),
            the K steps it covers (ptxas may unroll the K loop) and its trip count per program;
            "unrolled" when ptxas removed the loop (the whole kernel is counted then)
  instr/w   the loop body's SASS instructions per weight a thread reads in it: lane-instructions
            per weight, against the H200's budget of ~4 (128 lane-instructions a clock per
            multiprocessor over ~33 int4 weights a clock)
  ops       the body's instructions by class (FFMA, LOP3, SHF/shift, IMAD/IADD address math,
            LDG by width, conversions, ...)
  ldg       PTX global loads in the loop by bytes a thread (ldg16 = ld.global.v4.b32), and
            cvt64 (64-bit address arithmetic in PTX)
  regs      registers a thread, and SPILL with the stack frame's bytes where ptxas spilled

Static evidence only: instruction counts, not time. Whether the kernel reaches the copy
bandwidth also depends on bytes in flight per multiprocessor (warps x outstanding loads),
which only a GPU run measures (benchmarks/w4a16_micro.py).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections import Counter
from pathlib import Path

if os.environ.get("TRITON_INTERPRET"):
    sys.exit("w4a16_ptx.py compiles for the GPU: run it without TRITON_INTERPRET")

import torch  # noqa: E402
import triton  # noqa: E402
from decode_ptx import (  # noqa: E402  (PTX counting, compiling as the launcher does, cuobjdump readers)
    compile_kernel,
    count_ptx,
    cuobjdump,
    instructions,
    resources,
)

from pagecast.kernels import w4a16_gemm, w4a16_gemv  # noqa: E402

# name -> (N, K), as benchmarks/w4a16_micro.py
PROJECTIONS = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


class _Launch:
    """Stands in for the kernel in the launcher: records the grid, arguments and options."""

    def __getitem__(self, grid):  # type: ignore[no-untyped-def]
        self.grid = grid
        return self

    def __call__(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        self.args, self.kwargs = args, kwargs


def record_launch(  # type: ignore[no-untyped-def]
    module, kernel: str, m: int, n: int, k: int, g: int, dtype: torch.dtype, scale_dtype: torch.dtype, cfg,
    perm: bool = False, bias: bool = False,
) -> _Launch:
    """The launch a W4A16 launcher (``module``'s, of the same name) would make at this shape, on
    meta tensors: its kernel ``module.<kernel>`` is swapped for a recorder while it runs."""
    meta = {"device": "meta"}
    x = torch.empty((m, k), dtype=dtype, **meta)
    qweight = torch.empty((k // 8, n), dtype=torch.int32, **meta)
    scales = torch.empty((k // g, n), dtype=scale_dtype, **meta)
    zeros = torch.empty((k // g, n), dtype=torch.int8, **meta)
    p = torch.empty((k,), dtype=torch.int32, **meta) if perm else None
    b = torch.empty((n,), dtype=dtype, **meta) if bias else None
    rec, real = _Launch(), getattr(module, kernel)
    setattr(module, kernel, rec)
    try:
        getattr(module, module.__name__.rsplit(".", 1)[-1])(x, qweight, scales, zeros, p, g, b, cfg)
    finally:
        setattr(module, kernel, real)
    return rec


def launch_of(m: int, n: int, k: int, g: int, cfg, perm: bool = False, bias: bool = False) -> _Launch:  # type: ignore[no-untyped-def]
    """The launch w4a16_gemv would make for bf16 activations at this shape (meta tensors)."""
    return record_launch(
        w4a16_gemv, "_w4a16_gemv_kernel", m, n, k, g, torch.bfloat16, torch.float16, cfg, perm, bias
    )


def compile_launch(rec: _Launch, fn=None):  # type: ignore[no-untyped-def]
    """triton.compile of the recorded launch as the JIT launcher would specialise it
    (decode_ptx.compile_kernel). ``fn``: the kernel the launch was recorded for (the GEMV's by
    default); its USE_ASM is forced on."""
    fn = fn or w4a16_gemv._w4a16_gemv_kernel
    kwargs = dict(rec.kwargs)
    warps, stages = kwargs.pop("num_warps"), kwargs.pop("num_stages")
    return compile_kernel(fn, rec.args, dict(kwargs, USE_ASM=True), warps, stages)


# ---------------------------------------------------------------------------- SASS

def _opcode(text: str) -> str:
    return re.sub(r"^@!?U?P\w+\s+", "", text).split()[0]


def _op_class(op: str) -> str:
    """Coarse classes: what the per-weight budget is spent on."""
    base = op.split(".")[0]
    if base == "LDG":
        return op  # with its width (LDG.E.128, LDG.E.U16, ...)
    if base in ("FFMA", "FMUL", "FADD", "LOP3", "SHF", "IMAD", "IADD3", "LEA", "PRMT", "ISETP", "SEL",
                "STG", "BAR", "ATOMG", "HADD2", "HFMA2", "HMUL2"):
        return base
    if base in ("LDL", "STL"):
        return "SPILL:" + base
    if base in ("F2F", "F2FP", "I2F", "F2I", "I2FP"):
        return "cvt"
    if base in ("MOV", "UMOV", "S2R", "S2UR", "CS2R", "LDC", "ULDC", "R2UR"):
        return "mov"
    if base.startswith("U"):
        return "uniform"
    return "other"


def sass_stats(cubin: bytes) -> dict[str, object]:
    """Registers, spills and the main loop: the innermost backward-branch span holding the most
    FFMAs (the weight multiply-adds), its instructions by class."""
    res, sass = cuobjdump(cubin)
    regs, stack = resources(res)
    instrs = instructions(sass)
    index = {addr: i for i, (addr, _) in enumerate(instrs)}
    loops = []
    for i, (addr, text) in enumerate(instrs):
        m = re.search(r"\bBRA\s+(?:`\()?(0x[0-9a-f]+)", text)
        if m and int(m.group(1), 16) < addr and int(m.group(1), 16) in index:
            lo = index[int(m.group(1), 16)]
            loops.append((sum(_opcode(t) == "FFMA" for _, t in instrs[lo : i + 1]), lo, i))
    body_all = [t for _, t in instrs if not _opcode(t).startswith(("NOP", "EXIT", "BRA"))]
    total_ffma = sum(_opcode(t) == "FFMA" for t in body_all)
    loop = None
    if loops:
        ffma, lo, hi = max(loops, key=lambda x: (x[0], -(x[2] - x[1])))
        if ffma >= total_ffma / 2:  # the loop holds the bulk of the work
            loop = (lo, hi)
    body = [t for _, t in instrs[loop[0] : loop[1] + 1]] if loop else body_all
    ops = Counter(_op_class(_opcode(t)) for t in body)
    return {
        "regs": regs, "stack_bytes": stack, "looped": loop is not None, "body": len(body),
        "ops": dict(sorted(ops.items())), "kernel_sass": len(body_all),
    }  # fmt: skip


def ptx_loop(lines: list[str]) -> tuple[int, int] | None:
    """[first, last] line of the PTX loop holding the most fma.rn.f32 (the K loop), or None."""
    labels = {m.group(1): i for i, line in enumerate(lines) if (m := re.match(r"^(\$L__BB\d+_\d+):", line))}
    best = None
    for i, line in enumerate(lines):
        m = re.search(r"\bbra(?:\.uni)?\s+(\$L__BB\d+_\d+);", line)
        if m and labels.get(m.group(1), i) < i:
            lo = labels[m.group(1)]
            n = sum("fma.rn.f32" in x for x in lines[lo:i])
            if best is None or n > best[0]:
                best = (n, lo, i)
    return (best[1], best[2]) if best else None


# ---------------------------------------------------------------------------- report


def analyse(m: int, n: int, k: int, g: int, cfg, dump: Path | None = None, perm: bool = False) -> dict[str, object]:  # type: ignore[no-untyped-def]
    rec = launch_of(m, n, k, g, cfg, perm=perm)
    kw = rec.kwargs
    kernel = compile_launch(rec)
    ptx = kernel.asm["ptx"].splitlines()
    span = ptx_loop(ptx)
    ptx_body = ptx[span[0] : span[1] + 1] if span else ptx
    stats = sass_stats(kernel.asm["cubin"])
    threads = 32 * kw["num_warps"]
    step_k = kw["BLOCK_K"] * kw.get("INNER", 1)  # inputs a K-loop iteration covers
    w_step = step_k * kw["BLOCK_N"] // threads  # weights a thread reads per iteration
    rows_prog = kw.get("BLOCK_M", 1)  # rows a program computes (the original kernel: one)
    # ptxas may unroll the K loop: how many iterations the body covers, from its FFMAs (one per
    # weight and row; the per-group algebra adds a few, which the rounding absorbs).
    ffma = stats["ops"].get("FFMA", 0)
    iters = kw["K_ITERS"]
    if stats["looped"]:
        # dequantizing first adds one FFMA a weight
        unroll = max(1, round(ffma / (w_step * (rows_prog + int(bool(kw.get("DEQUANT_FIRST")))))))
        weights = w_step * unroll
    else:
        unroll = iters
        weights = w_step * iters
    ldg_ptx = count_ptx(ptx_body)
    name = (
        f"K{k}_G{g}_M{'1' if m == 1 else 'x'}{'' if rows_prog == 1 else f'_R{rows_prog}'}"
        f"_n{kw['BLOCK_N']}_k{step_k}_w{kw['num_warps']}_s{kw['SPLIT_K']}_i{iters}"
        + ("_perm" if perm else "")
    )
    if dump is not None:
        dump.mkdir(parents=True, exist_ok=True)
        (dump / f"{name}.ptx").write_text(kernel.asm["ptx"])
        (dump / f"{name}.sass").write_text(cuobjdump(kernel.asm["cubin"])[1])
    return {
        "kernel": name, "m": m, "n": n, "k": k, "g": g, "grid": list(rec.grid), "config": cfg.as_dict(),
        "rows_per_program": rows_prog, "k_iters": iters, "unroll": unroll, "weights_per_body": weights,
        "instr_per_weight": stats["body"] / weights, "ptx_loop": dict(ldg_ptx), **stats,
    }  # fmt: skip


def configs_for(m: int, n: int, k: int) -> list:  # type: ignore[type-arg]
    out = w4a16_gemm.gemv_configs(m, n, k) + [w4a16_gemv.default_config(m, n, k)]
    return list({json.dumps(c.as_dict(), sort_keys=True): c for c in out}.values())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,2,4,8")
    ap.add_argument("--groups", default="128")
    ap.add_argument("--projections", default="gate_up,down,qkv,o")
    ap.add_argument("--perm", action="store_true", help="compile the act-order (perm) variant")
    ap.add_argument("--dump", type=Path, help="write each kernel's PTX and SASS here")
    ap.add_argument("--json", type=Path, help="write the rows as JSON")
    args = ap.parse_args()
    print(f"triton {triton.__version__}, sm_90; instr/w = loop SASS per weight a thread reads (budget ~4)")
    cache: dict[str, dict] = {}  # type: ignore[type-arg]
    rows = []
    for proj in args.projections.split(","):
        n, k = PROJECTIONS[proj]
        for g in (int(x) for x in args.groups.split(",")):
            for m in (int(x) for x in args.rows.split(",")):
                best = None
                for cfg in configs_for(m, n, k):
                    key = json.dumps([m == 1, k, g, args.perm, launch_of(m, n, k, g, cfg, args.perm).kwargs], sort_keys=True)
                    if key not in cache:
                        cache[key] = analyse(m, n, k, g, cfg, args.dump, args.perm)
                    r = dict(cache[key], projection=proj, m=m, n=n, grid=list(launch_of(m, n, k, g, cfg, args.perm).grid))
                    rows.append(r)
                    # the weight is read once per program row-block: per weight of the matrix
                    r["instr_per_matrix_weight"] = r["instr_per_weight"] * -(-m // r["rows_per_program"])
                    spill = f" SPILL {r['stack_bytes']}B" if r["stack_bytes"] else ""
                    ops = " ".join(f"{o}:{c}" for o, c in r["ops"].items())
                    loop = f"body {r['body']} x{r['k_iters'] // r['unroll'] if r['looped'] else 0} trips" + (
                        f" (unroll {r['unroll']})" if r["looped"] and r["unroll"] > 1 else "" if r["looped"] else " unrolled"
                    )
                    print(
                        f"{proj:<8} m={m} grid={r['grid']} {r['kernel']:<44} regs {r['regs']}{spill} {loop} "
                        f"instr/w {r['instr_per_weight']:.2f} per matrix weight {r['instr_per_matrix_weight']:.2f}\n"
                        f"      ptx {dict(sorted(r['ptx_loop'].items()))}  sass {ops}",
                        flush=True,
                    )
                    if best is None or r["instr_per_matrix_weight"] < best["instr_per_matrix_weight"]:
                        best = r
    print("\nsummary: fewest loop instructions per matrix weight over the tuner's configs")
    print(f"{'projection':<10}" + "".join(f"{'m=' + x:>10}" for x in args.rows.split(",")))
    for proj in args.projections.split(","):
        line = f"{proj:<10}"
        for m in (int(x) for x in args.rows.split(",")):
            vals = [r["instr_per_matrix_weight"] for r in rows if r["projection"] == proj and r["m"] == m]
            line += f"{min(vals):>10.2f}"
        print(line)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
