"""What the tensor-core W4A16 decode kernel compiles to on an H100/H200 (sm_90), without a GPU.

    python benchmarks/w4a16_tcgemv_ptx.py [--rows 1,4,8,16] [--dtypes fp16,bf16] [--groups 128]
        [--projection o] [--tiles 256x4,128x2,512x4,512x8] [--stages 1] [--split 2|tuner]
        [--variants] [--sub-zeros] [--order] [--dump DIR] [--json FILE]

For each row count, activation dtype, group size and tile (BLOCK_N x warps, BLOCK_K 128 capped
by the group), the launch kernels/w4a16_tcgemv.py's launcher makes for a Llama-3-8B projection
(o: 4096 -> 4096 by default) is recorded on meta tensors and compiled for sm_90 with Triton's
bundled ptxas, specialised as a GPU launch would be (benchmarks/w4a16_ptx.py's machinery; the
inline-PTX unpacking forced on). ``--variants`` adds, at the first tile, the alternatives the
kernel keeps for this comparison: the weight as the mma's B operand, the other pairing order of
the unpacked nibbles, the sums of x inside the main loop, and the zero points subtracted in the
unpacking (SUB_ZEROS: no sums of x at all); ``--sub-zeros`` compiles every tile with SUB_ZEROS
too. ``--split tuner``: each tile at the splits w4a16_gemm.tcgemv_configs gives it at this shape.

Printed per kernel, for the main loop (the innermost backward branch around the mma; one
iteration is one chunk: CHUNK inputs by BLOCK_N columns):

  instr/w   the loop's SASS instructions per weight a thread covers (BLOCK_N * CHUNK / threads
            weights an iteration); the CUDA-core GEMV spends ~3.6 (benchmarks/w4a16_ptx.py), and
            an H200 multiprocessor can afford ~3.5 at the copy bandwidth (128 lane-instructions a
            clock over ~36 int4 weights a clock)
  smem B/w  shared-memory bytes a thread stores (STS, STSM, LDGSTS) and loads (LDS, LDSM) in the
            loop, per weight
  regs      registers a thread, and SPILL with the stack frame's bytes where ptxas spilled
  mma       mma.sync (HMMA) or wgmma (HGMMA) instructions in the loop
  ops       the loop's instructions by class
  cvt       the TTGIR's layout conversions and shared-memory staging (convert_layout, local_alloc,
            async_copy) by the tensor they move: the weight should move as its packed int32 tile
  bars      BAR instructions in the whole kernel, and the global loads (LDG; LDGSTS at two
            stages) a program issues before its first one, of those before the split-K
            reduction's ticket (its partials' loads come after)
  order     (``--order``) the whole kernel's global loads, shared-memory stores and loads,
            barriers, mma, atomics and stores in program order, repeats counted (LDGx8), the
            chunk loop's back branch as BRA<-address: whether a program's loads wait on each
            other's layout conversions (a barrier between two LDG does: the STS before it
            needs the first load's data)

Static evidence only: instruction and byte counts, not time. Whether the kernel streams at the
copy bandwidth (latency, bytes in flight, bank conflicts, the barriers' stalls) only a GPU run
tells.
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
    sys.exit("w4a16_tcgemv_ptx.py compiles for the GPU: run it without TRITON_INTERPRET")

import torch
import triton
import w4a16_ptx as gemv_ptx  # launch recording, compilation, SASS parsing

from pagecast.kernels import w4a16_tcgemv

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
VARIANTS = {
    "w-as-b": {"w_as_a": False},
    "pair-order1": {"pair_order": 1},
    "sums-in-loop": {"sums_first": False},
    "sub-zeros": {"sub_zeros": True},
}


def launch_of(
    m: int, n: int, k: int, g: int, dtype: torch.dtype, cfg, perm: bool = False
) -> gemv_ptx._Launch:  # type: ignore[no-untyped-def]
    return gemv_ptx.record_launch(w4a16_tcgemv, "_tcgemv_kernel", m, n, k, g, dtype, dtype, cfg, perm)


def _shared_bytes(op: str) -> int:
    """Bytes a thread moves with one shared-memory instruction (or cp.async)."""
    if op.startswith(("LDSM", "STSM")):
        return 4 * (4 if ".4" in op else 2 if ".2" in op else 1)
    m = re.search(r"\.(128|64|U16|S16|U8|S8)\b", op)
    return {"128": 16, "64": 8, "U16": 2, "S16": 2, "U8": 1, "S8": 1}[m.group(1)] if m else 4


def _op_class(op: str) -> str:
    base = op.split(".")[0]
    if base in ("HMMA", "HGMMA", "WARPGROUP", "LDS", "LDSM", "STS", "STSM", "LDGSTS", "SHFL", "PRMT", "MOV"):
        return base
    if base == "IMAD" and op.startswith("IMAD.MOV"):
        return "MOV"
    return gemv_ptx._op_class(op)


def loop_stats(cubin: bytes) -> dict[str, object]:
    """The innermost backward-branch span holding an mma: its instructions by class and its
    shared-memory traffic; registers and spills."""
    res, sass = gemv_ptx.cuobjdump(cubin)
    regs, stack = gemv_ptx.resources(res)
    instrs = gemv_ptx.instructions(sass)
    index = {addr: i for i, (addr, _) in enumerate(instrs)}
    best = None
    for i, (addr, text) in enumerate(instrs):
        m = re.search(r"\bBRA\s+(?:`\()?(0x[0-9a-f]+)", text)
        if m and int(m.group(1), 16) < addr and int(m.group(1), 16) in index:
            lo = index[int(m.group(1), 16)]
            has_mma = any(gemv_ptx._opcode(t).startswith(("HMMA", "HGMMA")) for _, t in instrs[lo : i + 1])
            if has_mma and (best is None or i - lo < best[1] - best[0]):
                best = (lo, i)
    # no such loop: ptxas unrolled the chunk loop (count the whole kernel: an overestimate)
    span = instrs[best[0] : best[1] + 1] if best else instrs
    body = [gemv_ptx._opcode(t) for _, t in span if not gemv_ptx._opcode(t).startswith(("EXIT", "BRA"))]
    stored = sum(_shared_bytes(o) for o in body if o.startswith(("STS", "STSM", "LDGSTS")))
    loaded = sum(_shared_bytes(o) for o in body if o.startswith(("LDS", "LDSM")))
    ops = Counter(_op_class(o) for o in body if not o.startswith("NOP"))
    return {"regs": regs, "stack_bytes": stack, "body": sum(ops.values()), "ops": dict(sorted(ops.items())),
            "smem_store": stored, "smem_load": loaded, "looped": best is not None}  # fmt: skip


_ORDER_OPS = ("LDG", "LDGSTS", "STS", "STSM", "LDS", "LDSM", "BAR", "HMMA", "HGMMA", "ATOMG", "STG", "EXIT")
_ORDER_OPS += ("LDL", "STL")  # spills


def program_order(cubin: bytes) -> dict[str, object]:
    """BAR count of the whole kernel, the LDG before the first BAR and before the first ATOMG (the
    split-K ticket; the reduction's loads come after it), and the condensed order of the memory,
    barrier and mma instructions (``--order``)."""
    instrs = gemv_ptx.instructions(gemv_ptx.cuobjdump(cubin)[1])
    seq: list[str] = []
    for addr, text in instrs:
        op = gemv_ptx._opcode(text)
        base = op.split(".")[0]
        if base == "BRA":
            m = re.search(r"\bBRA\s+(?:`\()?(0x[0-9a-f]+)", text)
            if m and int(m.group(1), 16) < addr:
                seq.append(f"BRA<-{m.group(1)}")
            continue
        if base in _ORDER_OPS:
            keep = base in ("LDG", "STG", "HMMA", "ATOMG")  # with the width; the rest by name
            seq.append(op.replace("LDG.E", "LDG").replace("STG.E", "STG") if keep else base)
    bars = seq.count("BAR")
    first_bar = seq.index("BAR") if "BAR" in seq else len(seq)
    ticket = next((i for i, o in enumerate(seq) if o.startswith("ATOMG")), len(seq))
    condensed: list[str] = []
    for op in seq:
        if condensed and condensed[-1].split("x")[0] == op and not op.startswith("BRA"):
            n = condensed[-1].partition("x")[2]
            condensed[-1] = f"{op}x{int(n or 1) + 1}"
        else:
            condensed.append(op)
    return {
        "bars": bars, "ldg_before_bar": sum(o.startswith("LDG") for o in seq[:first_bar]),
        "ldg_before_ticket": sum(o.startswith("LDG") for o in seq[:ticket]), "order": " ".join(condensed),
    }  # fmt: skip


def conversions(ttgir: str) -> list[str]:
    """The TTGIR's layout conversions and shared-memory staging, as 'op shape dtype' (deduplicated,
    in order)."""
    out: list[str] = []
    pattern = r"ttg\.(convert_layout|local_alloc|async_copy_global_to_local) %[^:]*: \(?tensor<([0-9x]+)x(?:!tt\.ptr<)?(\w+)"
    for m in re.finditer(pattern, ttgir):
        item = f"{m.group(1)} {m.group(2)} {m.group(3)}"
        if item not in out:
            out.append(item)
    return out


def analyse(m: int, n: int, k: int, g: int, dtype: str, cfg, dump: Path | None = None) -> dict[str, object]:  # type: ignore[no-untyped-def]
    rec = launch_of(m, n, k, g, DTYPES[dtype], cfg)
    kw = rec.kwargs
    kernel = gemv_ptx.compile_launch(rec, w4a16_tcgemv._tcgemv_kernel)
    stats = loop_stats(kernel.asm["cubin"])
    threads = 32 * kw["num_warps"]
    weights = kw["BLOCK_N"] * kw["CHUNK"] / threads  # a loop iteration's weights a thread
    ops = stats["ops"]
    mma = ops.get("HMMA", 0) + ops.get("HGMMA", 0)
    # ptxas may unroll the chunk loop: iterations in the body, from the mma count (mma.sync
    # m16n8k16 per warp, or wgmma m64nNk16 issued by every warp of a warpgroup)
    if ops.get("HGMMA"):
        per_iter = kw["BLOCK_N"] // (64 * max(1, kw["num_warps"] // 4)) * kw["CHUNK"] // 16
    else:
        per_iter = kw["BLOCK_N"] // (16 * kw["num_warps"]) * -(-kw["BLOCK_M"] // 8) * kw["CHUNK"] // 16
    if not kw["W_AS_A"] and not ops.get("HGMMA"):  # the x rows as the mma's m16, the weight as n8 tiles
        per_iter = kw["BLOCK_N"] // (8 * kw["num_warps"]) * kw["CHUNK"] // 16
    unroll = max(1, round(mma / per_iter)) if per_iter else 1
    if not stats["looped"]:
        unroll = kw["CHUNKS"]
    weights *= unroll
    tag = ("" if kw["W_AS_A"] else "_w-as-b") + ("_sub-zeros" if kw.get("SUB_ZEROS") else "")
    tag += "" if kw["SUMS_FIRST"] or kw.get("SUB_ZEROS") else "_sums-in-loop"
    tag += f"_pair-order{kw['PAIR_ORDER']}" if "PAIR_ORDER" in cfg.params else ""  # else the launcher's
    name = (
        f"{dtype}_K{k}_G{g}_R{kw['BLOCK_M']}_n{kw['BLOCK_N']}_k{kw['BLOCK_K']}_c{kw['CHUNK']}_w{kw['num_warps']}"
        f"_s{kw['num_stages']}_split{kw['SPLIT_K']}{tag}"
    )
    if dump is not None:
        dump.mkdir(parents=True, exist_ok=True)
        for key in ("ttgir", "ptx"):
            (dump / f"{name}.{key}").write_text(kernel.asm[key])
        (dump / f"{name}.sass").write_text(gemv_ptx.cuobjdump(kernel.asm["cubin"])[1])
    return {
        "kernel": name, "m": m, "n": n, "k": k, "g": g, "dtype": dtype, "config": cfg.as_dict(),
        "grid": list(rec.grid), "unroll": unroll, "weights_per_body": weights,
        "instr_per_weight": stats["body"] / weights, "smem_store_per_weight": stats["smem_store"] / weights,
        "smem_load_per_weight": stats["smem_load"] / weights, "mma": mma, "shared_alloc": kernel.metadata.shared,
        "conversions": conversions(kernel.asm["ttgir"]), **stats, **program_order(kernel.asm["cubin"]),
    }  # fmt: skip


def splits_of(spec: str, m: int, n: int, k: int, bn: int, warps: int) -> list[int]:
    """--split: numbers, or 'tuner': the splits w4a16_gemm.tcgemv_configs gives this tile (at one
    stage) at this shape, on an H200's 132 multiprocessors."""
    if spec != "tuner":
        return [int(v) for v in spec.split(",")]
    from pagecast.kernels import w4a16_gemm

    configs = w4a16_gemm.tcgemv_configs(m, n, k, 132)
    return sorted({c["SPLIT_K"] for c in configs if (c["BLOCK_N"], c.num_warps) == (bn, warps)}) or [2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,4,8,16")
    ap.add_argument("--dtypes", default="fp16,bf16")
    ap.add_argument("--groups", default="128")
    ap.add_argument("--projection", default="o", choices=sorted(gemv_ptx.PROJECTIONS))
    ap.add_argument(
        "--tiles", default="256x4,128x2,512x4,512x8", help="BLOCK_N x num_warps (the first for --variants)"
    )
    ap.add_argument("--stages", default="1")
    ap.add_argument(
        "--split",
        default="2",
        help="SPLIT_K, a list, or 'tuner' (few chunks a split: ptxas unrolls the chunk loop)",
    )
    ap.add_argument("--variants", action="store_true", help="also the kernel's alternatives (first tile)")
    ap.add_argument("--sub-zeros", action="store_true", help="every tile also with SUB_ZEROS")
    ap.add_argument("--order", action="store_true", help="print each kernel's condensed SASS order")
    ap.add_argument("--dump", type=Path, help="write each kernel's TTGIR, PTX and SASS here")
    ap.add_argument("--json", type=Path, help="write the rows as JSON")
    args = ap.parse_args()
    n, k = gemv_ptx.PROJECTIONS[args.projection]
    tiles = [tuple(int(v) for v in t.split("x")) for t in args.tiles.split(",")]
    print(
        f"triton {triton.__version__}, sm_90, {args.projection} {k} -> {n}; instr/w: the loop's SASS per weight a "
        "thread covers (GEMV ~3.6); smem: shared bytes stored / loaded per weight"
    )
    rows = []
    for dtype in args.dtypes.split(","):
        for g in (int(v) for v in args.groups.split(",")):
            for m in (int(v) for v in args.rows.split(",")):
                runs = []
                for bn, w in tiles:
                    for split in splits_of(args.split, m, n, k, bn, w):
                        for st in (int(v) for v in args.stages.split(",")):
                            runs.append((bn, w, st, split, {}))
                            if args.sub_zeros:
                                runs.append((bn, w, st, split, {"sub_zeros": True}))
                        if args.variants and (bn, w) == tiles[0]:
                            runs += [(bn, w, 1, split, opts) for opts in VARIANTS.values()]
                runs = list({json.dumps(r, sort_keys=True): r for r in runs}.values())
                for bn, w, st, split, opts in runs:
                    cfg = w4a16_tcgemv.make_config(bn, 128, split, w, st, **opts)
                    try:
                        r = analyse(m, n, k, g, dtype, cfg, args.dump)
                    except Exception as e:  # noqa: BLE001  (a Triton failure is a result too)
                        print(
                            f"{dtype} m={m:<2} G={g} n{bn} w{w} s{st} {opts}: FAILED {type(e).__name__}: {str(e)[:200]}"
                        )
                        continue
                    rows.append(r)
                    spill = f" SPILL {r['stack_bytes']}B" if r["stack_bytes"] else ""
                    ops = " ".join(f"{o}:{c}" for o, c in r["ops"].items())
                    print(
                        f"{r['kernel']:<58} instr/w {r['instr_per_weight']:.2f}  smem {r['smem_store_per_weight']:.2f}"
                        f"/{r['smem_load_per_weight']:.2f} B/w  regs {r['regs']}{spill}  mma {r['mma']}"
                        f" (body {r['body']}, {'unroll ' + str(r['unroll']) if r['looped'] else 'loop unrolled: whole kernel'},"
                        f" alloc {r['shared_alloc']} B)\n"
                        f"      sass {ops}\n      cvt  {'; '.join(r['conversions'])}\n"
                        f"      bars {r['bars']}; LDG before the first: {r['ldg_before_bar']}"
                        f" of {r['ldg_before_ticket']}"
                        + (f"\n      order {r['order']}" if args.order else ""),
                        flush=True,
                    )
    print("\nsummary: instr/w (smem stored+loaded B/w) per tile; rows in columns")
    ms = args.rows.split(",")
    print(f"{'kernel':<34}" + "".join(f"{'m=' + v:>16}" for v in ms))

    def key_of(r):  # type: ignore[no-untyped-def]
        return re.sub(r"_R\d+", "", r["kernel"])

    keys = {key_of(r): None for r in rows}
    for key in keys:
        line = f"{key.replace(f'_K{k}', ''):<34}"
        for v in ms:
            hit = [r for r in rows if key_of(r) == key and r["m"] == int(v)]
            line += (
                f"{hit[0]['instr_per_weight']:>8.2f} ({hit[0]['smem_store_per_weight'] + hit[0]['smem_load_per_weight']:.2f})"
                if hit
                else f"{'-':>16}"
            )
        print(line)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
