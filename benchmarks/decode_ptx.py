"""What the paged decode kernel compiles to on an H100/H200 (sm_90), without a GPU.

    python benchmarks/decode_ptx.py [--caches bf16,fp8,fp16,fp32] [--direct] [--fp8-bytes]
                                    [--fp8-read words|bytes|pairs] [--compare]
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

An fp8 cache is compiled with the word read (the launcher's default), or as --fp8-read says:
bytes (= --fp8-bytes) or pairs (the pair read, config fp8_words 2).

--compare compiles bf16 and the three fp8 reads at each variant (default: 32 and 64 tokens on 1,
2 and 4 warps, 2 and 3 stages) and prints a table per 64-token tile: registers, spilled bytes,
shared memory a program allocates, programs an SM holds (occupancy rule), the loop's SASS
instructions per thread and warp instructions for the program, its shared loads, stores,
ldmatrix and stmatrix per thread as count (bytes), its global-to-shared copies by size and its
e4m3 conversions. Then, per variant, the loop's TTGIR traffic between registers and shared
memory (local_load / local_alloc of a tensor / convert_layout, by shape and layout: where an
unpacked tile crosses shared memory) and a model of the shared-memory wavefronts of its loads,
stores and copies in blocked or linear layouts (shared_wavefronts: bank conflicts show as more
wavefronts than bytes / 128).

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


# an fp8 cache's read (the launcher's config key fp8_words) -> the kernel's FP8_WORDS
FP8_READS = {"words": True, "bytes": False, "pairs": 2}


def launch_args(
    q_dtype: torch.dtype, cache_dtype: torch.dtype, direct: bool, fp8_bytes: bool = False, fp8_read: str = ""
) -> tuple[list, dict]:
    """The positional arguments and constexprs paged_decode_attention() passes for a batch of 128
    sequences at this shape (tiny CPU tensors stand in for the pointers: only their dtype and
    16-byte alignment matter; strides come from meta tensors of the real shapes). An fp8 cache is
    read as fp8_read says (FP8_READS; fp8_bytes: "bytes"; default "words", the launcher's)."""
    read = fp8_read or ("bytes" if fp8_bytes else "words")
    num_seqs, max_blocks = 128, 128
    q = torch.empty((num_seqs, NUM_HEADS, HEAD_DIM), dtype=q_dtype, device="meta")
    cache = torch.empty((4096, NUM_KV_HEADS, BLOCK_SIZE, HEAD_DIM), dtype=cache_dtype, device="meta")
    tables = torch.empty((num_seqs, max_blocks), dtype=torch.int32, device="meta")

    def ptr(dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(16, dtype=dtype)

    args = [
        ptr(q_dtype), ptr(cache_dtype), ptr(cache_dtype), ptr(torch.int32), ptr(torch.int32),
        ptr(torch.int32), ptr(q_dtype), ptr(torch.float32), ptr(torch.float32), ptr(q_dtype), ptr(torch.int32),
        0.125 * pda._LOG2E, 1.0, 0.0, 0, 1 if direct else 4,
        q.stride(0), q.stride(1), *cache.stride()[:3], *cache.stride()[:3], tables.stride(0),
        q.stride(0), q.stride(1),
    ]  # fmt: skip
    group = NUM_HEADS // NUM_KV_HEADS
    constexprs = {
        "GROUP": group, "GROUP_PAD": max(16, triton.next_power_of_2(group)), "HEAD_DIM": HEAD_DIM,
        "HEAD_DIM_PAD": HEAD_DIM, "BLOCK_SIZE": BLOCK_SIZE, "DIRECT": direct,
        # the launcher's default at this shape: an fp8 cache read as int32 words, unpacked in PTX
        "FP8_WORDS": FP8_READS[read] if cache_dtype == torch.float8_e4m3fn else False, "USE_ASM": True,
        "DOT_PRECISION": "ieee" if q_dtype == torch.float32 else "tf32",
    }  # fmt: skip
    return args, constexprs


def compile_kernel(fn, args: list, constexprs: dict, warps: int, stages: int, target: GPUTarget = TARGET, **options):
    """triton.compile of a jitted kernel for sm_90 (or target) with the signature and
    tt.divisibility attributes the JIT launcher derives from these arguments (its own
    specialisation routine); defaulted parameters left out take their defaults; ``options``: more
    compile options (e.g. launch_pdl). benchmarks/prefill_ptx.py compiles the prefill kernel through
    this too, tests/test_pdl.py the launches it intercepts."""
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
    for i, name in enumerate(fn.arg_names):  # defaulted parameters the launch leaves out
        if name not in signature:
            signature[name] = "constexpr"
            constexprs[name] = fn.params[i].default
    src = ASTSource(fn, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=target, options={"num_warps": warps, "num_stages": stages, **options})


def compile_variant(
    cache: str, block_n: int, warps: int, stages: int, direct: bool, fp8_bytes: bool = False,
    fp8_read: str = "",
):  # fmt: skip
    """The decode kernel as a launch at this shape compiles it."""
    q_dtype, cache_dtype = CACHES[cache]
    args, constexprs = launch_args(q_dtype, cache_dtype, direct, fp8_bytes, fp8_read)
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


# ---------------------------------------------------------------------------- TTGIR: the loop's layout
# conversions and an estimate of its shared-memory wavefronts


def _ttgir_loop_lines(ttgir: str) -> list[str]:
    """The body of the scf.for that holds a tt.dot (the K/V tile loop), by indentation."""
    lines = ttgir.splitlines()
    for i, line in enumerate(lines):
        if "scf.for" in line:
            indent = len(line) - len(line.lstrip())
            body = []
            for nxt in lines[i + 1:]:
                if nxt.strip() and len(nxt) - len(nxt.lstrip()) <= indent:
                    break
                body.append(nxt)
            if any("tt.dot " in b for b in body):
                return body
    return []


_CONVERT = re.compile(
    r"ttg\.convert_layout %\S+ : tensor<([0-9x]+x\w+), (#\w+)[^>]*>+ -> tensor<[0-9x]+x\w+, (#[\w.]+)"
)
_LOCAL_ALLOC = re.compile(r"ttg\.local_alloc %\S+ : \(tensor<([0-9x]+x\w+), (#\w+)")
_LOCAL_LOAD = re.compile(
    r"ttg\.local_load .*memdesc<([0-9x]+x\w+), (#\w+),.* -> tensor<[0-9x]+x\w+, (#[\w.]+)"
)


def ttgir_loop(ttgir: str) -> list[str]:
    """The tile loop's register <-> shared traffic and layout conversions, as 'op shape layouts'
    (local_load: shared -> registers; local_alloc of a tensor: registers -> shared; convert_layout;
    the operands of a dot come through 'dot_op' layouts)."""
    out = []
    for line in _ttgir_loop_lines(ttgir):
        if m := _CONVERT.search(line):
            out.append(f"convert {m.group(1)} {m.group(2)}->{m.group(3)}")
        elif m := _LOCAL_ALLOC.search(line):
            out.append(f"store {m.group(1)} {m.group(2)}")
        elif m := _LOCAL_LOAD.search(line):
            dst = "dot_op" if "dot_op" in line.split("->")[-1] else m.group(3)
            out.append(f"load {m.group(1)} {m.group(2)}->{dst}")
    return out


def _layout_defs(ttgir: str) -> dict[str, str]:
    defs = re.finditer(r"^(#\w+) = (#ttg\.\w+<\{.*\}>)$", ttgir, re.MULTILINE)
    return {m.group(1): m.group(2) for m in defs}


def _ints(text: str, key: str) -> list[int]:
    m = re.search(key + r" = \[([0-9, ]*)\]", text)
    return [int(x) for x in m.group(1).split(",")] if m and m.group(1).strip() else []


def _register_layout(text: str, shape: list[int]) -> dict[str, list[list[int]]] | None:
    """Bases (register, lane, warp) of a blocked or linear layout: each a coordinate per tensor dim."""
    if text.startswith("#ttg.linear"):
        return {
            k: [list(map(int, b.split(","))) for b in re.findall(r"\[([0-9, ]+)\]", m.group(1))]
            for k in ("register", "lane", "warp")
            if (m := re.search(k + r" = \[((?:\[[0-9, ]+\](?:, )?)*)\]", text))
        }
    if not text.startswith("#ttg.blocked"):
        return None
    keys = ("sizePerThread", "threadsPerWarp", "warpsPerCTA", "order")
    spt, tpw, wpc, order = (_ints(text, k) for k in keys)
    rank = len(shape)
    bases: dict[str, list[list[int]]] = {"register": [], "lane": [], "warp": []}
    covered = [1] * rank

    def add(kind: str, dim: int, count: int) -> None:
        for _ in range(count.bit_length() - 1):
            b = [0] * rank
            b[dim] = covered[dim] if covered[dim] < shape[dim] else 0  # past the shape: broadcast
            bases[kind].append(b)
            covered[dim] *= 2

    for kind, sizes in (("register", spt), ("lane", tpw), ("warp", wpc)):
        for d in order:
            add(kind, d, sizes[d])
    for d in order:  # repetitions to cover the shape
        while covered[d] < shape[d]:
            add("register", d, 2)
    return bases


def _shared_offset(text: str, shape: list[int]):
    """coords -> element offset of a swizzled_shared layout (2D), or None for other encodings."""
    if not text.startswith("#ttg.swizzled_shared") or len(shape) != 2:
        return None
    vec, per, mx = (int(re.search(k + r" = (\d+)", text).group(1)) for k in ("vec", "perPhase", "maxPhase"))
    fast = _ints(text, "order")[0]
    slow = 1 - fast

    def offset(c: list[int]) -> int:
        row, col = c[slow], c[fast]
        phase = (row // per) % mx
        return row * shape[fast] + ((col // vec) ^ phase) * vec + col % vec

    return offset


def _xor(a: list[int], b: list[int]) -> list[int]:
    return [x ^ y for x, y in zip(a, b)]


def _wavefronts(addrs: list[list[int]]) -> int:
    """Shared-memory wavefronts of one warp instruction: per lane the 4-byte words it touches. A
    request of 8 (16) bytes a lane is served a half (quarter) warp at a time; within each part,
    the most distinct words any bank holds."""
    per_lane = max(len(a) for a in addrs)
    group = 32 // max(1, per_lane)  # lanes served together: 32, 16 or 8
    total = 0
    for g in range(0, 32, group):
        banks: dict[int, set[int]] = {}
        for a in addrs[g:g + group]:
            for word in a:
                banks.setdefault(word % 32, set()).add(word)
        total += max((len(v) for v in banks.values()), default=0)
    return total


def _simulate(reg_text: str, shared_text: str, shape: list[int], elem_bytes: int, warps: int):
    """(bytes a lane moves per instruction, instructions and wavefronts per warp) of moving a
    tensor between registers in reg_text's layout and shared memory in shared_text's, each lane
    moving the widest vector (up to 16 bytes) of registers that are contiguous in shared memory."""
    layout, offset = _register_layout(reg_text, shape), _shared_offset(shared_text, shape)
    if layout is None or offset is None:
        return None
    zero = [0] * len(shape)

    def coords(reg: int, lane: int, warp: int) -> list[int]:
        c = zero
        for kind, idx in (("register", reg), ("lane", lane), ("warp", warp)):
            for bit, b in enumerate(layout.get(kind, [])):
                if idx >> bit & 1:
                    c = _xor(c, b)
        return c

    regs = layout["register"]
    # vector: register bases (any order) at element offsets 1, 2, 4, ... from the lane's first
    vec_bits: list[int] = []
    while (1 << len(vec_bits)) * elem_bytes < 16:
        want = 1 << len(vec_bits)
        hit = next(
            (i for i, b in enumerate(regs) if i not in vec_bits and offset(b) - offset(zero) == want), None
        )
        firsts = [coords(0, lane, 0) for lane in range(32)]
        if hit is None or any(offset(_xor(b, regs[hit])) != offset(b) + want for b in firsts):
            break
        vec_bits.append(hit)
    rest = [i for i in range(len(regs)) if i not in vec_bits]
    vec_bytes = (1 << len(vec_bits)) * elem_bytes
    instrs = 1 << len(rest)
    waves = []
    for warp in range(warps):
        w = 0
        for r in range(instrs):
            reg = sum(1 << rest[j] for j in range(len(rest)) if r >> j & 1)
            addrs = []
            for lane in range(32):
                start = offset(coords(reg, lane, warp)) * elem_bytes
                addrs.append(sorted({(start + b) // 4 for b in range(0, vec_bytes, 1)}))
            w += _wavefronts(addrs)
        waves.append(w)
    return vec_bytes, instrs, max(waves)


_ELEM = {"i32": 4, "f32": 4, "f16": 2, "bf16": 2, "i8": 1, "f8E4M3FN": 1, "i16": 2}


def shared_wavefronts(ttgir: str, warps: int) -> list[str]:
    """For each copy into shared memory (cp.async), shared load into registers and register store
    to shared memory in the tile loop whose register layout is blocked or linear, labelled by its
    operand's name (k, v, ...): the bytes a lane moves per instruction, instructions and wavefronts
    per warp (a wavefront serves up to 128 bytes; more than bytes / 128 means bank conflicts). A
    model, not the lowering: Triton may move a layout through ldmatrix instead (the fp8 word read's
    K tile: 8 ldmatrix.x4 where this counts 32 4-byte loads, the same wavefronts when conflict-free).
    Dot-operand and mma layouts (ldmatrix / stmatrix) are not simulated: Triton swizzles those
    tiles for them."""
    defs = _layout_defs(ttgir)
    out = []
    for line in _ttgir_loop_lines(ttgir):
        name = m.group(1) if (m := re.search(r"= ttg\.\w+ %([a-z]+)", line)) else "?"
        if "async_copy_global_to_local" in line:
            m = re.search(r"tensor<([0-9x]+)x!tt\.ptr<(\w+)>, (#\w+)> -> <[0-9x]+x\w+, (#\w+)", line)
            kind = "cp.async"
        elif "ttg.local_load" in line:
            m = re.search(r"memdesc<([0-9x]+)x(\w+), (#\w+),.* -> tensor<[0-9x]+x\w+, (#[\w]+)>", line)
            kind = "load"
            if m:  # (shape, dtype, register layout, shared layout)
                m = [None, m.group(1), m.group(2), m.group(4), m.group(3)]
        elif re.search(r"ttg\.local_alloc %\S+ :", line):
            m = re.search(r"tensor<([0-9x]+)x(\w+), (#\w+)>\) -> !ttg\.memdesc<[0-9x]+x\w+, (#\w+)", line)
            kind = "store"
        else:
            continue
        if not m:
            continue
        shape_s, dtype, reg, shared = m[1], m[2], m[3], m[4]
        shape = [int(x) for x in shape_s.split("x")]
        res = _simulate(defs.get(reg, ""), defs.get(shared, ""), shape, _ELEM.get(dtype, 4), warps)
        label = f"{kind} {name} {shape_s}x{dtype}"
        if res is None:
            out.append(f"{label}: not simulated ({reg} {shared})")
        else:
            vec_bytes, n, w = res
            out.append(f"{label}: {vec_bytes} B x {n}, {w} wavefronts (min {n * vec_bytes * 32 // 128})")
    return out


# ---------------------------------------------------------------------------- report


def analyse(
    cache: str, block_n: int, warps: int, stages: int, direct: bool, dump: Path | None,
    fp8_bytes: bool = False, fp8_read: str = "",
) -> dict[str, object]:
    kernel = compile_variant(cache, block_n, warps, stages, direct, fp8_bytes, fp8_read)
    read = fp8_read or ("bytes" if fp8_bytes else "words")
    read_tag = f"_{read}" if read != "words" and cache == "fp8" else ""
    name = f"{cache}{read_tag}_n{block_n}_w{warps}_s{stages}{'_direct' if direct else ''}"
    return {
        "variant": name, "cache": cache, "BLOCK_N": block_n, "num_warps": warps, "num_stages": stages,
        "direct": direct, **({"fp8_read": read} if cache == "fp8" else {}),
        **kernel_stats(kernel, name, dump), "ttgir_loop": ttgir_loop(kernel.asm["ttgir"]),
        "banks": shared_wavefronts(kernel.asm["ttgir"], warps),
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


def _sass_bytes(op: str) -> int:
    """Bytes a thread moves with one SASS shared-memory or async-copy instruction."""
    if op.startswith(("LDSM", "STSM")):
        return {"4": 16, "2": 8}.get(op.rsplit(".", 1)[-1], 4)
    if m := re.search(r"\.(64|128)\b", op):
        return int(m.group(1)) // 8
    if re.search(r"\.[US]8\b", op):
        return 1
    if re.search(r"\.[US]16\b", op):
        return 2
    return 4


def programs_per_sm(regs: int, warps: int, shared: int) -> int:
    """Programs an sm_90 multiprocessor holds at once (the occupancy calculator's rule: 64K registers
    allocated 256 a warp, 228 KB of shared memory with 1 KB reserved a program, 64 warps, 32
    programs)."""
    per_warp = -(-regs * 32 // 256) * 256
    return min(65536 // (per_warp * warps), 233472 // (shared + 1024), 64 // warps, 32)


def compare_row(r: dict) -> dict[str, object]:
    """A variant's loop per 64-token tile: per thread (SASS instructions; shared loads, stores and
    ldmatrix / stmatrix as count (bytes); global-to-shared copies) and for all the program's warps
    (warp instructions issued)."""
    scale = 64 / r["BLOCK_N"]
    ops = r["loop_ops"]

    def group(prefixes: tuple[str, ...], exclude: tuple[str, ...] = ()) -> str:
        sel = {k: v for k, v in ops.items() if k.startswith(prefixes) and not k.startswith(exclude)}
        n = sum(sel.values()) * scale
        b = sum(v * _sass_bytes(k) for k, v in sel.items()) * scale
        return f"{n:g} ({b:g} B)" if n else "0"

    copies = Counter()
    for k, v in ops.items():
        if k.startswith("LDGSTS"):
            copies[_sass_bytes(k if "." in k[7:] else k + ".32")] += v * scale
    return {
        "variant": f"{r['BLOCK_N']}x{r['num_warps']}x{r['num_stages']}",
        "kv": r["cache"] + (f" {r['fp8_read']}" if "fp8_read" in r else ""),
        "regs": r["regs"], "spill": r["stack_bytes"] or 0, "smem": r["shared_bytes"],
        "progs/SM": programs_per_sm(r["regs"], r["num_warps"], r["shared_bytes"]),
        "sass": round(r["loop_sass"] * scale), "warp_instr": round(r["loop_sass"] * scale * r["num_warps"]),
        "LDS": group(("LDS",), ("LDSM",)), "STS": group(("STS",), ("STSM",)), "LDSM": group(("LDSM",)),
        "STSM": group(("STSM",)), "cp.async": " ".join(f"{n:g}x{b}B" for b, n in sorted(copies.items())),
        "e4m3": round(r["loop"].get("e4m3", 0) * scale),
    }  # fmt: skip


def print_compare(rows: list[dict]) -> None:
    keys = ["variant", "kv", "regs", "spill", "smem", "progs/SM", "sass", "warp_instr", "LDS", "STS", "LDSM",
            "STSM", "cp.async", "e4m3"]  # fmt: skip
    print("| " + " | ".join(keys) + " |")
    print("|" + "---|" * len(keys))
    for r in rows:
        c = compare_row(r)
        print("| " + " | ".join(str(c[k]) for k in keys) + " |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--caches", default="bf16,fp8", help="comma-separated of " + ",".join(CACHES))
    ap.add_argument("--direct", action="store_true", help="the num_splits == 1 variant (default: split)")
    ap.add_argument("--variants", default="", help="e.g. 64x4x2,128x4x2 (default: every tuned variant)")
    ap.add_argument(
        "--fp8-bytes", action="store_true",
        help="compile the fp8 cache's byte path (FP8_WORDS=False: the launcher's for other head_dims)",
    )  # fmt: skip
    ap.add_argument(
        "--fp8-read", choices=list(FP8_READS), default="",
        help="an fp8 cache's read: words (default), bytes (= --fp8-bytes), pairs (fp8_words 2)",
    )  # fmt: skip
    ap.add_argument(
        "--compare", action="store_true",
        help="bf16 and the three fp8 reads at each variant (default 32/64 tokens x 1/2/4 warps x 2/3 stages):"
        " a table per 64-token tile, then each variant's TTGIR loop traffic and shared-memory estimate",
    )  # fmt: skip
    ap.add_argument("--dump", type=Path, help="write each variant's TTGIR and PTX here")
    ap.add_argument("--json", type=Path, help="write the counts as JSON")
    args = ap.parse_args()
    variants = pda._VARIANTS
    if args.compare:
        variants = [(n, w, st) for n in (32, 64) for w in (1, 2, 4) for st in (2, 3)]
    if args.variants:
        variants = [tuple(int(x) for x in v.split("x")) for v in args.variants.split(",")]
    print(f"triton {triton.__version__}, sm_90, Llama-3-8B decode shape; counts: loop body [whole kernel]")
    rows = []
    if args.compare:
        kinds = [("bf16", ""), ("fp8", "words"), ("fp8", "bytes"), ("fp8", "pairs")]
        for block_n, warps, stages in variants:
            for cache, read in kinds:
                rows.append(analyse(cache, block_n, warps, stages, args.direct, args.dump, fp8_read=read))
        print("\nper 64-token tile: per thread (count (bytes)), warp_instr for all the program's warps\n")
        print_compare(rows)
        print()
        for r in rows:
            print(f"{r['variant']}: {'; '.join(r['ttgir_loop'])}")
            for line in r["banks"]:
                print(f"    {line}")
    else:
        for cache in args.caches.split(","):
            for block_n, warps, stages in variants:
                r = analyse(
                    cache, block_n, warps, stages, args.direct, args.dump, args.fp8_bytes, args.fp8_read
                )
                print_row(r)
                rows.append(r)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
