"""The kernels written after the GPU-checked first wave, compiled for an H100/H200 (sm_90) here,
without a GPU: Triton lowers them to PTX and cubin on the CPU. The interpreter, which the other
CPU tests use, accepts things the compiler refuses (a non-constexpr module global read inside a
kernel, for one), so a kernel that passes them can still fail at its first GPU launch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from pagecast.kernels.tuning import KernelConfig

pytest.importorskip("triton")
# Compiling for sm_90 needs Triton's CUDA backend (it brings its own ptxas, no GPU or driver):
# skip, not fail, where this Triton lacks it.
pytest.importorskip("triton.backends.nvidia.compiler")

# Run in a child process: the test session runs Triton in interpreter mode (TRITON_INTERPRET=1),
# where @triton.jit functions cannot be compiled.
CHILD = textwrap.dedent(
    r"""
    import json, re, sys
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from pagecast.kernels import keyed_noise, paged_decode_attention, paged_prefill_attention, rotary_kv, sampling
    from pagecast.kernels import moe_route_kernel, w4a16_gemm, w4a16_gemv

    for job in sys.argv[1:]:  # each job's lines after a line '=== <kernel>'
        kernel, signature, constexprs, divisible, options = json.loads(job)
        print(f"=== {kernel}")
        fn = {"keyed_noise": keyed_noise._keyed_exponential_kernel,
              "w4a16_gemm": w4a16_gemm._w4a16_gemm_kernel,
              "dequantize": w4a16_gemm._dequantize_kernel, "w4a16_gemv": w4a16_gemv._w4a16_gemv_kernel,
              "rotary_kv": rotary_kv._rotary_kv_kernel,
              "paged_decode": paged_decode_attention._paged_decode_kernel,
              "decode_merge": paged_decode_attention._decode_merge_kernel,
              "paged_prefill": paged_prefill_attention._paged_prefill_kernel, "race": sampling._race_kernel,
              "count_ties": sampling._count_ties_kernel, "logprob_stats": sampling._logprob_stats_kernel,
              "block_max": sampling._block_max_kernel, "threshold": sampling._threshold_kernel,
              "collect": sampling._collect_kernel, "select": sampling._select_kernel,
              "moe_route": moe_route_kernel._route_kernel, "router_route": moe_route_kernel._router_route_kernel,
              "stage_blocks": paged_prefill_attention._stage_blocks_kernel}[kernel]
        sig = dict(signature, **{name: "constexpr" for name in constexprs})
        # the launcher's tt.divisibility=16 on the named arguments (16-byte aligned pointers, strides)
        attrs = {(fn.arg_names.index(name),): [["tt.divisibility", 16]] for name in divisible}
        src = ASTSource(fn, signature=sig, constexprs=constexprs, attrs=attrs)
        compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
        asm = compiled.asm
        print(sorted(asm))
        print(f"shared {compiled.metadata.shared}")  # bytes of shared memory a program needs
        print("ptx converts e4m3" if "e4m3" in asm.get("ptx", "") else "ptx without e4m3")
        # global -> shared copies by cache mode and bytes, e.g. "cp.async cg16", and byte-wise shared loads
        copies = re.findall(r"cp\.async\.(c[ag])\.shared\.global \[[^]]*\], \[[^]]*\], (0x[0-9a-f]+|\d+)",
                            asm["ptx"])
        print(" ".join(sorted({f"cp.async {mode}{int(size, 0)}" for mode, size in copies})))
        print(f"ex2 {len(re.findall(r'ex2[.]approx', asm['ptx']))}")  # exponentials on the multi-function unit
        print(f"byte shared loads {len(re.findall(r'ld[.]shared([.]v[24])?[.][bus]8[^0-9]', asm['ptx']))}")
    """
)


def compile_sm90(
    kernel: str,
    signature: dict[str, str],
    constexprs: dict[str, object],
    divisible: list[str] | None = None,
    options: dict[str, int] | None = None,
) -> str:
    """The child's output: the asm kinds, the shared memory a program needs ("shared <bytes>"),
    whether the PTX converts e4m3, its cp.async kinds, its count of ex2.approx instructions
    ("ex2 <n>") and of byte-wise shared loads, one line each."""
    return compile_sm90_batch([(kernel, signature, constexprs, divisible, options)])[0]


# compile_sm90's arguments: kernel, signature, constexprs, divisible, options
Sm90Job = tuple[str, dict[str, str], dict[str, object], list[str] | None, dict[str, int] | None]


def compile_sm90_batch(jobs: list[Sm90Job]) -> list[str]:
    """``compile_sm90``'s output for each job, compiled in one child process (Triton and the
    kernels imported once)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    args = [
        json.dumps([kernel, sig, consts, div or [], opts or {}]) for kernel, sig, consts, div, opts in jobs
    ]
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, *args],
        check=False, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    outputs: list[list[str]] = []
    for line in proc.stdout.splitlines():
        if line.startswith("=== "):
            outputs.append([])
        elif outputs:
            outputs[-1].append(line)
    assert len(outputs) == len(jobs), proc.stdout
    return ["".join(f"{line}\n" for line in out) for out in outputs]


def test_keyed_noise_kernel_compiles_for_sm90() -> None:
    from pagecast.kernels.reference import PHILOX_GROUP

    asm = compile_sm90(
        "keyed_noise",
        {"out_ptr": "*fp32", "keys_ptr": "*i64", "offsets_ptr": "*i64", "stride_out": "i32", "vocab": "i32"},
        {"GROUP": PHILOX_GROUP},
    )
    assert "cubin" in asm


@pytest.mark.parametrize("split_k", [1, 4])
@pytest.mark.parametrize("has_perm", [False, True])
def test_w4a16_gemm_kernel_compiles_for_sm90(split_k: int, has_perm: bool) -> None:
    asm = compile_sm90(
        "w4a16_gemm",
        {
            "x_ptr": "*bf16", "qw_ptr": "*i32", "s_ptr": "*bf16", "z_ptr": "*i8", "perm_ptr": "*i32",
            "b_ptr": "*bf16", "y_ptr": "*bf16" if split_k == 1 else "*fp32",
            "M": "i32", "N": "i32", "K": "i32", "stride_xm": "i32", "stride_ym": "i32", "stride_ys": "i32",
        },
        {
            "GROUP_SIZE": 128, "HAS_PERM": has_perm, "HAS_BIAS": False, "BLOCK_M": 16, "BLOCK_N": 64,
            "BLOCK_K": 128, "SPLIT_K": split_k, "K_ITERS": 8, "DOT_PRECISION": "tf32",
        },
    )  # fmt: skip
    assert "cubin" in asm


def _w4a16_launch(cfg: KernelConfig, m: int, n: int, k: int, g: int, x: str, scale: str) -> Sm90Job:
    """The tile kernel as w4a16_gemm launches ``cfg`` at this shape (with a bias, no perm): its
    split and K_ITERS rounding, the tt.divisibility=16 Triton gives to aligned pointers and to the
    int arguments divisible by 16."""
    from triton import cdiv

    bm, bn, bk, split = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"], cfg["SPLIT_K"]
    k_per_split = cdiv(cdiv(k, split), bk) * bk
    split = cdiv(k, k_per_split)
    ints = {"M": m, "N": n, "K": k, "stride_xm": k, "stride_ym": n, "stride_ys": 0 if split == 1 else m * n}
    signature = {
        "x_ptr": x, "qw_ptr": "*i32", "s_ptr": scale, "z_ptr": "*i8", "perm_ptr": "*i32", "b_ptr": x,
        "y_ptr": x if split == 1 else "*fp32", **{name: "i32" for name in ints},
    }  # fmt: skip
    divisible = [name for name in signature if name.endswith("_ptr")]
    divisible += [name for name, value in ints.items() if value % 16 == 0]
    constexprs: dict[str, object] = {
        "GROUP_SIZE": g, "HAS_PERM": False, "HAS_BIAS": split == 1, "BLOCK_M": bm, "BLOCK_N": bn,
        "BLOCK_K": bk, "SPLIT_K": split, "K_ITERS": k_per_split // bk,
        "DOT_PRECISION": "ieee" if x == "*fp32" else "tf32",
    }  # fmt: skip
    options = {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
    return ("w4a16_gemm", signature, constexprs, divisible, options)


def test_moe_route_kernel_compiles_for_sm90() -> None:
    """The routing kernel as route() launches it (kernels/moe_route_kernel.py) for Qwen3-30B-A3B,
    Mixtral (fp32 weights), gpt-oss (top-k then softmax) and the widest router it takes."""
    from pagecast.kernels import moe_route_kernel

    def job(e: int, k: int, logits: str, weights: str, topk: bool, renorm: bool, rnd: bool) -> Sm90Job:
        sig = {"logits_ptr": f"*{logits}", "weights_ptr": f"*{weights}", "ids_ptr": "*i64"}
        consts = {
            "E": e, "K": k, "TOPK_SOFTMAX": topk, "RENORMALIZE": renorm,
            "BLOCK_E": triton.next_power_of_2(e), "BLOCK_K": triton.next_power_of_2(k), "PRECISE_EXP": True,
            "ROUND_TO_LOGITS": rnd,
        }  # fmt: skip
        divisible = ["logits_ptr", "weights_ptr", "ids_ptr"]
        return "moe_route", sig, consts, divisible, {"num_warps": moe_route_kernel.num_warps(e)}

    triton = pytest.importorskip("triton")
    # ops.moe's launches (weights widened to fp32, rounded to bf16 first where the routing keeps
    # them in x's dtype), route()'s default one (bf16 weights), and the widest router it takes.
    outputs = compile_sm90_batch([
        job(128, 8, "bf16", "fp32", False, True, True),
        job(128, 8, "bf16", "bf16", False, True, False),
        job(8, 2, "bf16", "fp32", False, True, False),
        job(32, 4, "bf16", "fp32", True, False, True),
        job(moe_route_kernel.MAX_EXPERTS, moe_route_kernel.MAX_TOP_K, "fp32", "fp32", False, False, False),
    ])  # fmt: skip
    assert all("cubin" in asm for asm in outputs)


def test_fused_router_configs_with_fewer_warps_compile_for_sm90() -> None:
    """The fused router GEMV + routing (moe_route_kernel._router_route_kernel) at Qwen3-30B-A3B's
    router (128 experts top-8, hidden 2048, bf16, weights widened to fp32) and 16 tokens, the most
    it routes in its last program: every config of the space with fewer than 4 warps (their tl.dot
    on one or two warps, the routing's [16, 128] tile in their registers), and a 4-warp one."""
    from pagecast.kernels import moe_route_kernel, split_k

    triton = pytest.importorskip("triton")
    fused = [c for c in moe_route_kernel.FUSED_CONFIG_SPACE if moe_route_kernel.is_fused(c)]
    configs = [c for c in fused if c.num_warps < 4] + [fused[0]]
    assert len(configs) > 1
    e, k, h, t = 128, 8, 2048, 16
    sig = {"x_ptr": "*bf16", "w_ptr": "*bf16", "b_ptr": "*bf16", "part_ptr": "*fp32", "count_ptr": "*i32",
           "weights_ptr": "*fp32", "ids_ptr": "*i64", "res_ptr": "*bf16", "norm_w_ptr": "*bf16",
           "res_out_ptr": "*bf16", "normed_ptr": "*bf16", "eps": "fp32", "T": "i32", "H": "i32",
           "stride_xm": "i32", "STEPS": "i32"}  # fmt: skip
    jobs: list[Sm90Job] = []
    # each config plain, and the first two with the residual add and RMSNorm inside (NORM)
    for c, norm in [(c, False) for c in configs] + [(c, True) for c in configs[:2]]:
        split, _ = split_k.split_steps(triton.cdiv(h, c["BLOCK_H"]), c["SPLIT_H"])
        consts = {
            "E": e, "K": k, "TOPK_SOFTMAX": False, "RENORMALIZE": True, "HAS_BIAS": False,
            "BLOCK_T": moe_route_kernel.FUSED_MAX_TOKENS, "ROUTE_T": t, "BLOCK_X": c["BLOCK_X"],
            "BLOCK_H": c["BLOCK_H"], "SPLIT_H": split, "BLOCK_E": e, "BLOCK_K": k, "PRECISE_EXP": True,
            "ROUND_TO_LOGITS": True, "DOT_PRECISION": "tf32", "NORM": norm, "NORM_H": h,
            "NORM_CHUNK": min(h, 256 * c.num_warps), "PDL": False,
        }  # fmt: skip
        options = {"num_warps": c.num_warps, "num_stages": c.num_stages}
        jobs.append(("router_route", sig, consts, ["x_ptr", "w_ptr", "part_ptr", "weights_ptr", "ids_ptr"], options))
    outputs = compile_sm90_batch(jobs)
    assert all("cubin" in asm for asm in outputs), outputs


def test_w4a16_gemm_fp32_configs_fit_sm90_shared_memory() -> None:
    """fp32 activations (with the fp32 scales of an fp32 artifact, builder/quant.py): the launcher's
    default and every tile the tuner times fit an H100/H200's 232448 bytes of shared memory. At the
    fp32 int4 engine test's down projection (tests/test_quant_build.py, awq-g64-qwen2-bias: n 128,
    k 384, G 64) the default tile for 33-256 rows (64 x 64 x 128, 4 stages) needed 266240 on an
    H200 and the engine's warm-up failed; the tuner had timed it with fp16 scales (217088 bytes).
    Each compile also checks w4a16_gemm.shared_memory, which the launcher's default and the
    pruning go by, as an upper bound, on the bf16 default tile too (wgmma reads the activations
    in place: one more buffer of them)."""
    from concurrent.futures import ThreadPoolExecutor

    from pagecast.builder.quant import scale_dtype_for
    from pagecast.kernels import problems, w4a16_gemm
    from pagecast.kernels.tuning import ModelShapes

    n, k, g = 128, 384, 64
    types = {"*fp32": torch.float32, "*bf16": torch.bfloat16, "*fp16": torch.float16}
    launches: dict[tuple[str, str], tuple[KernelConfig, int, str, str]] = {}
    for dtype in ("float32", "bfloat16"):
        x = next(t for t, d in types.items() if d == getattr(torch, dtype))
        scale = next(t for t, d in types.items() if d == scale_dtype_for(dtype))  # the artifact's scales
        shapes = ModelShapes(2, 1, 64, n, k, 16, dtype, quant_group_size=g)
        for m in (49, 300):  # rows in the tuner's buckets 64 (the failing launch's) and 512
            dims = {"num_rows": m, "n": n, "k": k}
            configs = [problems.default_config("w4a16_gemm", shapes, dims)]
            if dtype == "float32":
                configs += problems.config_space("w4a16_gemm", shapes, dims)
            for cfg in configs:  # neither 49 nor 300 divisible by 16: one compile a config and dtype
                if not w4a16_gemm.is_dequant(cfg):
                    launches.setdefault((x, json.dumps(cfg.as_dict(), sort_keys=True)), (cfg, m, x, scale))
    jobs = [_w4a16_launch(cfg, m, n, k, g, x, scale) for cfg, m, x, scale in launches.values()]
    with ThreadPoolExecutor(2) as pool:  # two child processes
        outputs = [out for batch in pool.map(compile_sm90_batch, (jobs[::2], jobs[1::2])) for out in batch]
    shared = [int(next(ln for ln in out.splitlines() if ln.startswith("shared "))[7:]) for out in outputs]
    launched = [launches[key] for key in launches]
    launched = launched[::2] + launched[1::2]  # the outputs' order
    over = [(x, cfg.as_dict(), used) for (cfg, _, x, _), used in zip(launched, shared) if used > 232448]
    assert not over, over
    for (cfg, _, x, scale), used in zip(launched, shared):
        x_elt, scale_elt = types[x].itemsize, types[scale].itemsize
        assert w4a16_gemm.shared_memory(cfg, x_elt, scale_elt, g) >= used, (x, cfg.as_dict(), used)


def test_dequantize_kernel_compiles_for_sm90() -> None:
    asm = compile_sm90(
        "dequantize",
        {"qw_ptr": "*i32", "s_ptr": "*bf16", "z_ptr": "*i8", "w_ptr": "*bf16", "N": "i32", "K": "i32"},
        {"GROUP_SIZE": 128, "BLOCK_N": 64, "BLOCK_K": 64},
    )
    assert "cubin" in asm


@pytest.mark.parametrize(
    "split_k,has_perm,group_size,block_k,block_m",
    [(1, False, 128, 64, 1), (32, True, 128, 64, 2), (4, False, 32, 32, 4), (2, True, 576, 64, 8)],
)
def test_w4a16_gemv_kernel_compiles_for_sm90(
    split_k: int, has_perm: bool, group_size: int, block_k: int, block_m: int
) -> None:
    """The decode GEMV with its inline-PTX unpacking (the interpreter runs the plain expression
    instead), the ticket-counter split-K epilogue, one and several rows a program, and both
    per-step paths (the per-group algebra, and dequantizing first from 4 rows)."""
    asm = compile_sm90(
        "w4a16_gemv",
        {
            "x_ptr": "*bf16", "qw_ptr": "*i32", "s_ptr": "*fp16", "z_ptr": "*i8", "perm_ptr": "*i32",
            "b_ptr": "*bf16", "y_ptr": "*bf16", "part_ptr": "*fp32", "lock_ptr": "*i32",
            "M": "i32", "N": "i32", "K": "i32", "stride_xm": "i32", "stride_ym": "i32",
        },
        {
            "GROUP_SIZE": group_size, "HAS_PERM": has_perm, "HAS_BIAS": True, "BLOCK_N": 512,
            "BLOCK_K": block_k, "BLOCK_M": block_m, "SPLIT_K": split_k, "K_ITERS": 2,
            "DEQUANT_FIRST": block_m >= 4, "USE_ASM": True,
        },
    )  # fmt: skip
    assert "cubin" in asm


# The sampling kernels (kernels/sampling.py), with bf16 and fp32 logits.
@pytest.mark.parametrize("logits", ["*bf16", "*fp32"])
@pytest.mark.parametrize("ties,block_max", [(False, False), (True, False), (False, True), (True, True)])
def test_race_kernel_compiles_for_sm90(logits: str, ties: bool, block_max: bool) -> None:
    from pagecast.kernels.reference import PHILOX_GROUP
    from pagecast.kernels.sampling import CHUNK, TOPK_BLOCK

    asm = compile_sm90(
        "race",
        {
            "logits_ptr": logits, "temperature_ptr": "*fp32", "cut_value_ptr": "*fp32", "cut_token_ptr": "*i64",
            "tie_drop_ptr": "*i64", "tie_prefix_ptr": "*i32", "row_max_ptr": "*fp32", "min_p_ptr": "*fp32",
            "keys_ptr": "*i64", "offsets_ptr": "*i64", "block_max_ptr": "*fp32", "score_ptr": "*fp32",
            "token_ptr": "*i32", "stride_row": "i32", "vocab": "i32", "splits": "i32", "num_blocks": "i32",
        },
        {"GROUP": PHILOX_GROUP, "CHUNKS": 8, "TIES": ties, "PRECISE": True, "BLOCK_MAX": block_max,
         "MAX_PER_CHUNK": CHUNK // TOPK_BLOCK},
    )  # fmt: skip
    assert "cubin" in asm


# top_candidates' kernels (the block maxima, the threshold, the collecting pass, the exact search)
@pytest.mark.parametrize("logits,low_bit", [("*bf16", 16), ("*fp32", 0)])
def test_top_candidate_kernels_compile_for_sm90(logits: str, low_bit: int) -> None:
    from pagecast.kernels import sampling

    rows = {"stride_row": "i32", "vocab": "i32"}
    kernels = [
        ("block_max", {"logits_ptr": logits, "out_ptr": "*fp32", **rows, "num_blocks": "i32"},
         {"BLOCK": sampling.TOPK_BLOCK, "BLOCKS": sampling.TOPK_BLOCKS}),
        ("threshold", {"block_max_ptr": "*fp32", "threshold_ptr": "*fp32", "num_blocks": "i32", "width": "i32"},
         {"NUM_BLOCKS_PAD": 1024, "LOW_BIT": low_bit}),
        ("collect", {"logits_ptr": logits, "block_max_ptr": "*fp32", "threshold_ptr": "*fp32", "count_ptr": "*i32",
                     "values_ptr": "*fp32", "ids_ptr": "*i32", **rows, "num_blocks": "i32", "capacity": "i32"},
         {"BLOCK": sampling.TOPK_BLOCK, "BLOCKS": sampling.COLLECT_BLOCKS}),
        ("select", {"logits_ptr": logits, "count_ptr": "*i32", "values_ptr": "*fp32", "ids_ptr": "*i32", **rows,
                    "capacity": "i32", "width": "i32"},
         {"LOW_BIT": low_bit, "BLOCK": 1024}),
    ]  # fmt: skip
    for kernel, signature, constexprs in kernels:
        assert "cubin" in compile_sm90(kernel, signature, constexprs), kernel


# FP8 (e4m3) KV cache variants: the rotary kernel writes float8e4nv, the attention kernels read
# it and upcast to bf16 in registers (no fp8 tl.dot, so max_num_imprecise_acc does not apply).
_PAGED_STRIDES = ("stride_qt", "stride_qh", "stride_kb", "stride_kh", "stride_kt", "stride_vb", "stride_vh",
                  "stride_vt", "stride_bt", "stride_ot", "stride_oh")  # fmt: skip


def _paged_signature(cache: str) -> dict[str, str]:
    return {
        "q_ptr": "*bf16", "k_cache_ptr": cache, "v_cache_ptr": cache, "block_tables_ptr": "*i32",
        "seq_lens_ptr": "*i32", "query_start_loc_ptr": "*i32", "out_ptr": "*bf16",
    }  # fmt: skip


@pytest.mark.parametrize(
    "direct,fp8_words", [(True, True), (False, True), (False, False), (True, 2), (False, 2)]
)
def test_paged_decode_kernel_with_fp8_cache_compiles_for_sm90(direct: bool, fp8_words: bool | int) -> None:
    """The fp8 reads: int32 words unpacked in inline PTX (head_dim a power of two, the launcher's
    choice at every model shape we ship), fp8 values (other head_dims), and the pair
    read (FP8_WORDS 2: V's words unpacked by token pairs in inline PTX)."""
    sig = dict(
        _paged_signature("*fp8e4nv"), part_out_ptr="*fp32", part_lse_ptr="*fp32", qk_scale="fp32", v_scale="fp32",
        num_splits="i32", **{s: "i32" for s in _PAGED_STRIDES},
    )  # fmt: skip
    asm = compile_sm90(
        "paged_decode", sig,
        {"GROUP": 4, "GROUP_PAD": 16, "HEAD_DIM": 128, "HEAD_DIM_PAD": 128, "BLOCK_SIZE": 16, "BLOCK_N": 64,
         "DIRECT": direct, "FP8_WORDS": fp8_words, "USE_ASM": True, "DOT_PRECISION": "tf32"},
    )  # fmt: skip
    assert "cubin" in asm and "ptx converts e4m3" in asm


@pytest.mark.parametrize("cache", ["*bf16", "*fp8e4nv"])
def test_paged_decode_kernel_merging_in_its_launch_compiles_for_sm90(cache: str) -> None:
    """The in-launch merge (MERGE: the last split's ticket, then the merge of every split)."""
    sig = dict(
        _paged_signature(cache), part_out_ptr="*fp32", part_lse_ptr="*fp32", sinks_ptr="*fp32", count_ptr="*i32",
        qk_scale="fp32", v_scale="fp32", num_splits="i32", **{s: "i32" for s in _PAGED_STRIDES},
    )  # fmt: skip
    asm = compile_sm90(
        "paged_decode", sig,
        {"GROUP": 8, "GROUP_PAD": 16, "HEAD_DIM": 128, "HEAD_DIM_PAD": 128, "BLOCK_SIZE": 16, "BLOCK_N": 64,
         "DIRECT": False, "FP8_WORDS": 2 if cache == "*fp8e4nv" else 0, "USE_ASM": True, "DOT_PRECISION": "tf32",
         "HAS_SINKS": True, "MERGE": 16},
    )  # fmt: skip
    assert "cubin" in asm


def test_paged_decode_fp8_cache_streams_k_and_v_in_16_byte_copies() -> None:
    """The fp8 cache's K and V tiles reach shared memory in 16-byte cp.async.cg, as a bf16
    cache's do, and the dot reads none of them back a byte at a time. Read as fp8 values, V
    (its reduction axis is not the contiguous one) took 8-byte cp.async.ca and one ld.shared.u8
    per value, and the fp8 kernel ran at 62% of the bf16 kernel's bandwidth on an H200.
    The launch's specialisation: 16-divisible pointers and strides (benchmarks/decode_ptx.py
    counts every tuned variant)."""
    sig = dict(
        _paged_signature("*fp8e4nv"), part_out_ptr="*fp32", part_lse_ptr="*fp32", qk_scale="fp32", v_scale="fp32",
        num_splits="i32", **{s: "i32" for s in _PAGED_STRIDES},
    )  # fmt: skip
    divisible = [n for n in sig if n.endswith("_ptr") or (n.startswith("stride") and n != "stride_bt")]
    asm = compile_sm90(
        "paged_decode", sig,
        {"GROUP": 4, "GROUP_PAD": 16, "HEAD_DIM": 128, "HEAD_DIM_PAD": 128, "BLOCK_SIZE": 16, "BLOCK_N": 64,
         "DIRECT": False, "FP8_WORDS": True, "USE_ASM": True, "DOT_PRECISION": "tf32"},
        divisible=divisible, options={"num_warps": 4, "num_stages": 2},
    )  # fmt: skip
    lines = asm.splitlines()
    assert lines[-3] == "cp.async cg16", lines[-3]
    assert lines[-1] == "byte shared loads 0", lines[-1]


def test_paged_decode_fp8_pair_read_keeps_v_packed_in_shared_memory() -> None:
    """The pair read (FP8_WORDS 2) unpacks V straight into the PV dot's operand registers: its
    program needs the word read's shared memory less the unpacked fp16 V tile the word read stores
    for ldmatrix.trans (BLOCK_N x HEAD_DIM x 2 bytes), and K and V still arrive in 16-byte
    cp.async.cg with no byte-wise shared loads. Should a Triton upgrade stop hoisting the layout
    conversion to the int32 word tile, the fp16 tile comes back and this fails (benchmarks/
    decode_ptx.py --compare shows the loop's traffic per read). The launch's specialisation,
    64 tokens on 2 warps, 2 stages."""
    sig = dict(
        _paged_signature("*fp8e4nv"), part_out_ptr="*fp32", part_lse_ptr="*fp32", qk_scale="fp32",
        v_scale="fp32", num_splits="i32", **{s: "i32" for s in _PAGED_STRIDES},
    )  # fmt: skip
    divisible = [n for n in sig if n.endswith("_ptr") or (n.startswith("stride") and n != "stride_bt")]
    consts = {"GROUP": 4, "GROUP_PAD": 16, "HEAD_DIM": 128, "HEAD_DIM_PAD": 128, "BLOCK_SIZE": 16,
              "BLOCK_N": 64, "DIRECT": False, "USE_ASM": True, "DOT_PRECISION": "tf32"}  # fmt: skip
    opts = {"num_warps": 2, "num_stages": 2}
    words, pairs = compile_sm90_batch(
        [("paged_decode", sig, dict(consts, FP8_WORDS=read), divisible, opts) for read in (True, 2)]
    )
    shared = [
        int(next(x for x in out.splitlines() if x.startswith("shared ")).split()[1]) for out in (words, pairs)
    ]
    assert shared[0] - shared[1] == 64 * 128 * 2, shared
    lines = pairs.splitlines()
    assert "ptx converts e4m3" in pairs
    assert lines[-3] == "cp.async cg16", lines[-3]
    assert lines[-1] == "byte shared loads 0", lines[-1]


def test_paged_attention_with_sinks_compiles_for_sm90() -> None:
    """gpt-oss's sinks (HAS_SINKS, bf16 sinks as the artifact stores them): the decode kernel
    with and without its merge (DIRECT), the merge kernel, the prefill kernel with a window."""
    decode = dict(
        _paged_signature("*bf16"), part_out_ptr="*fp32", part_lse_ptr="*fp32", sinks_ptr="*bf16", qk_scale="fp32",
        v_scale="fp32", softcap="fp32", window="i32", num_splits="i32", **{s: "i32" for s in _PAGED_STRIDES},
    )  # fmt: skip
    prefill = dict(
        _paged_signature("*bf16"), sinks_ptr="*bf16", qk_scale="fp32", v_scale="fp32", softcap="fp32",
        window="i32", num_seqs="i32", **{s: "i32" for s in _PAGED_STRIDES},
    )  # fmt: skip
    merge = {"part_out_ptr": "*fp32", "part_lse_ptr": "*fp32", "query_start_loc_ptr": "*i32", "out_ptr": "*bf16",
             "sinks_ptr": "*bf16", "num_splits": "i32", "stride_ot": "i32", "stride_oh": "i32"}  # fmt: skip
    consts = {"GROUP": 8, "GROUP_PAD": 16, "HEAD_DIM": 64, "HEAD_DIM_PAD": 64, "BLOCK_SIZE": 16, "BLOCK_N": 64,
              "FP8_WORDS": False, "USE_ASM": True, "DOT_PRECISION": "tf32", "HAS_SINKS": True}  # fmt: skip
    outs = compile_sm90_batch(
        [
            ("paged_decode", decode, dict(consts, DIRECT=True, SLIDING=True), None, None),
            ("paged_decode", decode, dict(consts, DIRECT=False), None, None),
            ("decode_merge", merge, {"HEAD_DIM": 64, "HEAD_DIM_PAD": 64, "SPLIT_CHUNK": 16, "HAS_SINKS": True},
             None, None),
            ("paged_prefill", prefill, {"GROUP": 8, "GROUP_PAD": 8, "HEAD_DIM": 64, "HEAD_DIM_PAD": 64,
                                        "BLOCK_SIZE": 16, "BLOCK_M": 64, "BLOCK_N": 64, "DOT_PRECISION": "tf32",
                                        "SLIDING": True, "HAS_SINKS": True}, None, None),
        ]
    )  # fmt: skip
    assert all("cubin" in out for out in outs), outs


def test_paged_prefill_kernel_with_fp8_cache_compiles_for_sm90() -> None:
    sig = dict(
        _paged_signature("*fp8e4nv"), qk_scale="fp32", v_scale="fp32", num_seqs="i32",
        **{s: "i32" for s in _PAGED_STRIDES},
    )  # fmt: skip
    asm = compile_sm90(
        "paged_prefill", sig,
        {"GROUP": 4, "GROUP_PAD": 4, "HEAD_DIM": 128, "HEAD_DIM_PAD": 128, "BLOCK_SIZE": 16, "BLOCK_M": 64,
         "BLOCK_N": 64, "DOT_PRECISION": "tf32"},
    )  # fmt: skip
    assert "cubin" in asm and "ptx converts e4m3" in asm


def test_fp8_stage_compiles_for_sm90() -> None:
    """STAGE: the kernel converting an fp8 cache's blocks into the fp16 stage, and the prefill tile
    over that stage for a bf16 engine (an fp16 cache under bf16 queries: the dots in fp16, as over
    the fp8 cache), at the largest tile the tuner offers with it."""
    stage_sig = {
        "k_cache_ptr": "*fp8e4nv", "v_cache_ptr": "*fp8e4nv", "block_tables_ptr": "*i32", "seq_lens_ptr": "*i32",
        "k_out_ptr": "*fp16", "v_out_ptr": "*fp16", "max_blocks": "i32",
        **{s: "i32" for s in ("stride_kb", "stride_kh", "stride_kt", "stride_vb", "stride_vh", "stride_vt", "stride_bt")},
    }  # fmt: skip
    prefill_sig = dict(
        _paged_signature("*fp16"), qk_scale="fp32", v_scale="fp32", num_seqs="i32",
        **{s: "i32" for s in _PAGED_STRIDES},
    )  # fmt: skip
    outs = compile_sm90_batch(
        [
            ("stage_blocks", stage_sig, {"BLOCK_SIZE": 16, "HEAD_DIM": 128, "HEAD_DIM_PAD": 128}, None, None),
            ("paged_prefill", prefill_sig,
             {"GROUP": 4, "GROUP_PAD": 4, "HEAD_DIM": 128, "HEAD_DIM_PAD": 128, "BLOCK_SIZE": 128, "BLOCK_M": 128,
              "BLOCK_N": 128, "DOT_PRECISION": "tf32", "HEAVY_FIRST": True, "FOLD_SCALE": True,
              "PREFETCH_BLOCKS": True}, None, {"num_warps": 8, "num_stages": 3}),
        ]
    )  # fmt: skip
    assert all("cubin" in out for out in outs), outs
    assert "ptx converts e4m3" in outs[0]
    assert int(outs[1].split("shared ")[1].split()[0]) <= 232448


def test_paged_prefill_fp8_cache_streams_k_and_v_in_16_byte_copies() -> None:
    """The prefill kernel reads an fp8 cache as fp8 values and still copies K and V in 16-byte
    cp.async.cg with no byte-wise shared loads, unlike the decode kernel before its int32-word
    read: its tiles (BLOCK_M >= 64, 4 or 8 warps) run on sm_90's wgmma, so the pipeliner stages the
    fp8 tiles unswizzled for a 16-byte register load, and the upcast tiles are stored again in
    wgmma's own shared layout, which the instruction reads. Should a Triton upgrade stage them as
    an 8-bit dot operand again, this fails, and decode's word read is the remedy.
    The default config at the Llama-3-8B shape, with the launch's specialisation
    (benchmarks/prefill_ptx.py counts every tuned tile)."""
    sig = dict(
        _paged_signature("*fp8e4nv"), qk_scale="fp32", v_scale="fp32", num_seqs="i32",
        **{s: "i32" for s in _PAGED_STRIDES},
    )  # fmt: skip
    divisible = [n for n in sig if n.endswith("_ptr") or (n.startswith("stride") and n != "stride_bt")]
    asm = compile_sm90(
        "paged_prefill", sig,
        {"GROUP": 4, "GROUP_PAD": 4, "HEAD_DIM": 128, "HEAD_DIM_PAD": 128, "BLOCK_SIZE": 16, "BLOCK_M": 64,
         "BLOCK_N": 64, "DOT_PRECISION": "tf32"},
        divisible=divisible, options={"num_warps": 4, "num_stages": 2},
    )  # fmt: skip
    lines = asm.splitlines()
    assert "ptx converts e4m3" in asm
    assert lines[-3] == "cp.async cg16", lines[-3]
    assert lines[-1] == "byte shared loads 0", lines[-1]


@pytest.mark.parametrize(
    "cache,fp8,qk_norm",
    [("*fp8e4nv", True, False), ("*bf16", False, False), ("*bf16", False, True), ("*bf16", False, "after")],
)
def test_rotary_kv_kernel_compiles_for_sm90(cache: str, fp8: bool, qk_norm: bool | str) -> None:
    strides = ("stride_qt", "stride_qh", "stride_kt", "stride_kh", "stride_vt", "stride_vh", "stride_cos",
               "stride_kcb", "stride_kch", "stride_kct", "stride_vcb", "stride_vch", "stride_vct", "stride_ot",
               "stride_oh")  # fmt: skip
    sig = {
        "positions_ptr": "*i64", "q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "cos_sin_ptr": "*fp32",
        "k_cache_ptr": cache, "v_cache_ptr": cache, "slot_mapping_ptr": "*i64", "q_out_ptr": "*bf16",
        "q_norm_ptr": "*bf16", "k_norm_ptr": "*bf16", "norm_eps": "fp32",
        "k_inv_scale": "fp32", "v_inv_scale": "fp32", **{s: "i32" for s in strides},
    }  # fmt: skip
    asm = compile_sm90(
        "rotary_kv", sig,
        {"NUM_HEADS": 32, "NUM_KV_HEADS": 8, "HEADS_PAD": 32, "KV_HEADS_PAD": 8, "HEAD_DIM": 128,
         "HEAD_DIM_PAD": 128, "ROTARY_DIM": 128, "BLOCK_SIZE": 16, "KV_FP8": fp8, "QK_NORM": qk_norm is True,
         "QK_NORM_AFTER": qk_norm == "after"},
    )  # fmt: skip
    assert "cubin" in asm
    assert ("ptx converts e4m3" in asm) == fp8


def test_count_ties_and_logprob_stats_kernels_compile_for_sm90() -> None:
    asm = compile_sm90(
        "count_ties",
        {"logits_ptr": "*bf16", "temperature_ptr": "*fp32", "value_ptr": "*fp32", "wanted_ptr": "*i1",
         "counts_ptr": "*i32", "stride_row": "i32", "vocab": "i32", "splits": "i32"},
        {"BLOCK": 1024, "CHUNKS": 8},
    )  # fmt: skip
    assert "cubin" in asm
    asm = compile_sm90(
        "logprob_stats",
        {"logits_ptr": "*bf16", "scored_ptr": "*fp32", "max_ptr": "*fp32", "sum_ptr": "*fp32", "greater_ptr": "*i32",
         "stride_row": "i32", "vocab": "i32", "splits": "i32"},
        {"BLOCK": 1024, "CHUNKS": 8},
    )  # fmt: skip
    assert "cubin" in asm


def test_paged_prefill_launch_options_compile_for_sm90_and_fit_shared_memory() -> None:
    """Issue 32's prefill launch options at the Llama-3-8B shape, as the launch specialises them:
    the largest tile of the config space (128x128, 3 stages, every option) fits the 227 KiB of
    shared memory a program may take on an H100/H200, over a bf16 and an fp8 cache; and
    PREFETCH_BLOCKS is what lets a third stage buffer a third K/V tile (with the block-table read
    in the loop the pipeliner keeps two whatever num_stages says)."""
    from pagecast.kernels.paged_prefill_attention import OPTION_NAMES

    def job(
        cache: str, block_m: int, block_n: int, warps: int, stages: int, options: tuple[str, ...]
    ) -> Sm90Job:
        sig = dict(
            _paged_signature(cache), sinks_ptr="*bf16", qk_scale="fp32", v_scale="fp32", softcap="fp32",
            window="i32", num_seqs="i32", **{s: "i32" for s in _PAGED_STRIDES},
        )  # fmt: skip
        divisible = [n for n in sig if n.endswith("_ptr") or (n.startswith("stride") and n != "stride_bt")]
        consts = {"GROUP": 4, "GROUP_PAD": 4, "HEAD_DIM": 128, "HEAD_DIM_PAD": 128, "BLOCK_SIZE": 16,
                  "BLOCK_M": block_m, "BLOCK_N": block_n, "DOT_PRECISION": "tf32",
                  **{name: True for name in options}}  # fmt: skip
        return ("paged_prefill", sig, consts, divisible, {"num_warps": warps, "num_stages": stages})

    outs = compile_sm90_batch(
        [
            job("*bf16", 128, 128, 8, 3, OPTION_NAMES),
            job("*fp8e4nv", 128, 128, 8, 3, OPTION_NAMES),
            job("*bf16", 64, 64, 4, 3, ()),
            job("*bf16", 64, 64, 4, 3, ("PREFETCH_BLOCKS",)),
        ]
    )
    shared = [
        int(next(line for line in out.splitlines() if line.startswith("shared ")).split()[1]) for out in outs
    ]
    assert all("cubin" in out for out in outs), outs
    assert max(shared[:2]) <= 227 * 1024, shared
    tile = 64 * 128 * 2  # a 64-row Q tile, or one 64-key K or V tile, bf16
    # Q and three K and V buffers with the option only
    assert shared[2] < tile + 3 * 2 * tile <= shared[3], shared


def test_poly_exp2_moves_one_exponential_in_four_off_the_multi_function_unit() -> None:
    """POLY_EXP2 (issue 32): the prefill tile at the Llama-3-8B shape, as the tuner's long tiles
    launch it, compiles for sm_90 with its inline PTX, and a quarter of the softmax's ex2
    instructions are gone (computed on the FMA pipe instead), in the full-tile loop and the causal
    one alike; the shared memory is unchanged."""

    def job(poly: bool) -> Sm90Job:
        sig = dict(
            _paged_signature("*bf16"), sinks_ptr="*bf16", qk_scale="fp32", v_scale="fp32", softcap="fp32",
            window="i32", num_seqs="i32", **{s: "i32" for s in _PAGED_STRIDES},
        )  # fmt: skip
        divisible = [n for n in sig if n.endswith("_ptr") or (n.startswith("stride") and n != "stride_bt")]
        consts = {"GROUP": 4, "GROUP_PAD": 4, "HEAD_DIM": 128, "HEAD_DIM_PAD": 128, "BLOCK_SIZE": 128,
                  "BLOCK_M": 128, "BLOCK_N": 128, "DOT_PRECISION": "tf32", "HEAVY_FIRST": True,
                  "FOLD_SCALE": True, "PREFETCH_BLOCKS": True, "POLY_EXP2": poly}  # fmt: skip
        return ("paged_prefill", sig, consts, divisible, {"num_warps": 8, "num_stages": 3})

    plain, poly = compile_sm90_batch([job(False), job(True)])
    count = {name: int(next(ln for ln in out.splitlines() if ln.startswith("ex2 ")).split()[1])
             for name, out in (("plain", plain), ("poly", poly))}  # fmt: skip
    shared = [next(ln for ln in out.splitlines() if ln.startswith("shared ")) for out in (plain, poly)]
    assert "cubin" in poly and shared[0] == shared[1]
    # per thread: 64 scores of each of the two loops' tiles, and a rescale ex2 per row it holds
    tile = 128 * 128 // (8 * 32)
    assert count["plain"] - count["poly"] == 2 * tile // 4, count
