"""The fused-MoE kernels compiled for an H100/H200 (sm_90) without a GPU, as
tests/test_kernels_compile_sm90.py does for the others: the interpreter accepts kernels the
compiler refuses, and it does not say how much shared memory a tile needs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("triton")
pytest.importorskip("triton.backends.nvidia.compiler")

from pagecast.kernels import fused_moe, problems, tuning
from pagecast.kernels.tuning import KernelConfig, ModelShapes

CHILD = textwrap.dedent(
    """
    import json, sys
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from pagecast.kernels import fused_moe

    for job in sys.argv[1:]:
        kernel, signature, constexprs, divisible, options = json.loads(job)
        fn = {"gemm": fused_moe._moe_gemm_kernel, "gemv": fused_moe._moe_gemv_kernel,
              "align": fused_moe._moe_align_kernel, "scatter": fused_moe._moe_scatter_kernel,
              "gather_sum": fused_moe._moe_gather_sum_kernel}[kernel]
        sig = dict(signature, **{name: "constexpr" for name in constexprs})
        attrs = {(fn.arg_names.index(name),): [["tt.divisibility", 16]] for name in divisible}
        compiled = triton.compile(
            ASTSource(fn, signature=sig, constexprs=constexprs, attrs=attrs), target=GPUTarget("cuda", 90, 32),
            options=options,
        )
        print(json.dumps({"asm": sorted(compiled.asm), "shared": compiled.metadata.shared}))
    """
)


def compile_batch(jobs: list[tuple]) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, *(json.dumps(job) for job in jobs)],
        check=False, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


INTS = ("N", "K", "stride_am", "stride_we", "stride_wn", "stride_be", "stride_cm", "top_k")


def gemm_job(
    cfg: KernelConfig, gate_up: bool, bias: bool, activation: int = fused_moe.ACT_SILU, dtype: str = "*bf16"
) -> tuple:
    """_moe_gemm_kernel as fused_moe launches it in bf16 (Qwen3-30B-A3B's expert shape); a
    SPLIT_ACT config's gate_up launch writes [rows, 2I] without an activation."""
    h, i = 2048, 768
    n, k = (i, h) if gate_up else (h, i)
    if gate_up and cfg.params.get("SPLIT_ACT"):
        n, activation = 2 * i, 0
    ints = {"N": n, "K": k, "stride_am": k, "stride_we": (2 * i if gate_up else h) * k, "stride_wn": k,
            "stride_be": 2 * i if gate_up else h, "stride_cm": n, "top_k": 8}  # fmt: skip
    signature = {
        "a_ptr": dtype, "w_ptr": dtype, "b_ptr": dtype, "c_ptr": dtype, "sorted_ids_ptr": "*i32",
        "block_expert_ptr": "*i32", "weights_ptr": "*fp32", "num_pairs": "i32", "max_blocks": "i32",
        **{name: "i32" for name in ints},
    }  # fmt: skip
    divisible = [name for name in signature if name.endswith("_ptr")] + [
        n for n, v in ints.items() if v % 16 == 0
    ]
    constexprs = {
        "ACTIVATION": activation if gate_up else 0, "MUL_ROUTING_WEIGHT": not gate_up,
        "HAS_BIAS": bias, "ALPHA": 1.702, "LIMIT": 7.0, "BLOCK_M": cfg["BLOCK_M"], "BLOCK_N": cfg["BLOCK_N"],
        "BLOCK_K": cfg["BLOCK_K"], "GROUP_M": cfg["GROUP_M"], "DOT_PRECISION": "ieee" if dtype == "*fp32" else "tf32",
    }  # fmt: skip
    if cfg.params.get("TMA"):
        # both operands as tensor descriptors (the launcher's TMA=True)
        elt = dtype[1:]
        signature["a_ptr"] = f"tensordesc<{elt}[{cfg['BLOCK_M']}, {cfg['BLOCK_K']}]>"
        signature["w_ptr"] = f"tensordesc<{elt}[{cfg['BLOCK_N']}, {cfg['BLOCK_K']}]>"
        constexprs["TMA"] = True
        divisible = [name for name in divisible if name not in ("a_ptr", "w_ptr")]
    return (
        "gemm",
        signature,
        constexprs,
        divisible,
        {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages},
    )


def gemv_job(cfg: KernelConfig, gate_up: bool, bias: bool, activation: int = fused_moe.ACT_SILU) -> tuple:
    h, i = 2048, 768
    n, k = (i, h) if gate_up else (h, i)
    ints = {"N": n, "K": k, "stride_am": k, "stride_we": (2 * i if gate_up else h) * k, "stride_wn": k,
            "stride_be": 2 * i if gate_up else h, "stride_cm": n, "top_k": 8}  # fmt: skip
    signature = {"a_ptr": "*bf16", "w_ptr": "*bf16", "b_ptr": "*bf16", "c_ptr": "*bf16", "ids_ptr": "*i64",
                 "weights_ptr": "*fp32", **{name: "i32" for name in ints}, "out_ptr": "*bf16",
                 "count_ptr": "*i32"}  # fmt: skip
    divisible = [name for name in signature if name.endswith("_ptr")] + [
        n for n, v in ints.items() if v % 16 == 0
    ]
    constexprs = {
        "ACTIVATION": activation if gate_up else 0, "HAS_BIAS": bias, "ALPHA": 1.702, "LIMIT": 7.0,
        "BLOCK_N": cfg["BLOCK_N"], "BLOCK_K": cfg["BLOCK_K"],
    }  # fmt: skip
    return (
        "gemv",
        signature,
        constexprs,
        divisible,
        {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages},
    )


def test_fused_moe_kernels_compile_for_sm90_and_fit_shared_memory() -> None:
    """Every tile of the config space compiles for sm_90 as the gate_up launch at Qwen3-30B-A3B's
    shape (two weight tiles a step, SiLU fused); fused_moe.shared_memory (which the pruning goes
    by) bounds the shared memory each needs, and every tile the tuner times at some bucket fits
    232448 bytes. The down launch, the gpt-oss activation with biases and the GEMV path compile
    too, and so do the align kernels and GROUPED's gather sum."""
    shapes = ModelShapes(
        32, 4, 128, 2048, 6144, 16, "bfloat16", num_experts=128, top_k=8, moe_intermediate=768
    )
    tiles: dict[str, KernelConfig] = {}
    for _, dims in problems.buckets("fused_moe", shapes):
        for cfg in problems.config_space("fused_moe", shapes, dims):
            if "BLOCK_M" in cfg.params:
                tiles.setdefault(json.dumps(cfg.as_dict(), sort_keys=True), cfg)
    configs = [c for c in fused_moe.CONFIG_SPACE if "BLOCK_M" in c.params]
    timed = [json.dumps(c.as_dict(), sort_keys=True) in tiles for c in configs]
    assert sum(timed) >= len(configs) - 1  # all but the largest tile (over the limit) are timed
    jobs = [gemm_job(c, gate_up=True, bias=False) for c in configs]
    default = fused_moe.default_config(256, 8, 128, 2048, 768)
    gemv = fused_moe.default_config(1, 8, 128, 2048, 768)
    extra = [
        gemm_job(default, gate_up=False, bias=False),
        gemm_job(default, gate_up=True, bias=True, activation=fused_moe.ACT_SWIGLU_OAI),
        gemv_job(gemv, gate_up=True, bias=False),
        gemv_job(gemv, gate_up=False, bias=True),
        gemv_job(gemv, gate_up=True, bias=True, activation=fused_moe.ACT_SWIGLU_OAI),
        ("align", {"ids_ptr": "*i64", "sorted_ids_ptr": "*i32", "block_expert_ptr": "*i32", "cursor_ptr": "*i32",
                   "num_pairs": "i32", "num_experts": "i32", "max_blocks": "i32"},
         {"BLOCK_M": 64, "NUM_BINS": 128, "CHUNK": fused_moe.ALIGN_CHUNK, "BLOCKS_STEP": 64}, [], {"num_warps": 8}),
        ("scatter", {"ids_ptr": "*i64", "sorted_ids_ptr": "*i32", "cursor_ptr": "*i32", "num_pairs": "i32"},
         {"CHUNK": fused_moe.ALIGN_CHUNK}, [], {"num_warps": 4}),
        # GROUPED's weighted top-k sum of the grouped down product
        ("gather_sum", {"rows_ptr": "*bf16", "row_of_pair_ptr": "*i32", "weights_ptr": "*fp32", "out_ptr": "*bf16",
                        "N": "i32", "top_k": "i32"},
         {"BLOCK": fused_moe.TOPK_SUM_BLOCK}, ["rows_ptr", "out_ptr", "N"], {"num_warps": 4}),
    ]  # fmt: skip
    # fp32 (a GPU engine built in float32): the default tile at each token bucket's rows
    fp32 = {json.dumps(c.as_dict(), sort_keys=True): c for c in (
        fused_moe.default_config(t, 8, 128, 2048, 768, elt=4) for t in tuning.MOE_TOKEN_BUCKETS
    ) if "BLOCK_M" in c.params}  # fmt: skip
    fp32_configs = list(fp32.values())
    extra += [gemm_job(c, gate_up=True, bias=False, dtype="*fp32") for c in fp32_configs]
    all_jobs = jobs + extra
    with ThreadPoolExecutor(2) as pool:
        halves = list(pool.map(compile_batch, (all_jobs[::2], all_jobs[1::2])))
    results: list[dict] = [None] * len(all_jobs)  # type: ignore[list-item]
    results[::2], results[1::2] = halves[0], halves[1]
    assert all("cubin" in r["asm"] for r in results)
    for cfg, r in zip(fp32_configs, results[len(results) - len(fp32_configs) :]):
        assert r["shared"] <= fused_moe.SHARED_MEMORY_LIMIT, ("fp32", cfg.as_dict(), r["shared"])
        assert fused_moe.shared_memory(cfg, 4) >= r["shared"], ("fp32", cfg.as_dict(), r["shared"])
    for cfg, r, is_timed in zip(configs, results, timed):
        if is_timed:
            assert r["shared"] <= fused_moe.SHARED_MEMORY_LIMIT, (cfg.as_dict(), r["shared"])
        assert fused_moe.shared_memory(cfg, 2) >= r["shared"], (cfg.as_dict(), r["shared"])


ONE_LAUNCH_CHILD = textwrap.dedent(
    r"""
    import json, re, sys
    import torch
    from triton.runtime.jit import JITFunction
    sys.path.insert(0, sys.argv[1])
    from decode_ptx import compile_kernel  # the launch's own specialisation, for sm_90
    from pagecast.kernels import fused_moe

    launches = []
    def run(self, *args, grid, warmup, **kwargs):
        launches.append((self, args, kwargs))
    JITFunction.run = run

    bf16 = torch.bfloat16
    e, k, h, i = 128, 8, 2048, 768  # Qwen3-30B-A3B's experts
    w_gu, w_d = torch.randn(e, 2 * i, h, dtype=bf16), torch.randn(e, h, i, dtype=bf16)
    configs = fused_moe.ONE_LAUNCH_SPACE
    for cfg in configs:
        for t in (1, 16):
            weights, ids = torch.topk(torch.randn(t, e).softmax(-1), k)
            fused_moe.fused_moe(torch.randn(t, h, dtype=bf16), weights, ids, w_gu, w_d, config=cfg)
    load = re.compile(r"^\s*(@%p\d+\s+)?ld\.global")
    for (fn, args, kwargs), t in zip(launches, [1, 16] * len(configs)):
        warps, stages = kwargs.pop("num_warps"), kwargs.pop("num_stages")
        compiled = compile_kernel(fn, list(args), kwargs, warps, stages)
        lines = compiled.asm["ptx"].splitlines()
        wait = next(n for n, line in enumerate(lines) if "ld.global.gpu.acquire" in line)
        late = [line.strip() for line in lines[wait + 1 :] if load.match(line) and ".cg" not in line]
        print(json.dumps({"kernel": fn.__name__, "tokens": t, "config": kwargs.get("DOWN_BLOCK_N"),
                          "cubin": "cubin" in compiled.asm, "late_loads": late}))
    """
)


def test_one_launch_configs_compile_for_sm90_with_the_down_weights_read_before_the_wait() -> None:
    """Every ONE_LAUNCH config compiles for sm_90 as fused_moe launches it at Qwen3-30B-A3B's expert
    shape (1 and 16 tokens: the pair count is not specialised, so both are one kernel), and in the
    PTX every global load after the down programs' wait on their pair's flag (an acquire load) reads
    from L2 (``.cg``: the intermediate row and the pairs' partial rows): the down weight tile is in
    flight before the wait, which is what the single launch is for."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    bench = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
    proc = subprocess.run(
        [sys.executable, "-c", ONE_LAUNCH_CHILD, bench], env=env, capture_output=True, text=True, timeout=900, check=False
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(rows) == 2 * len(fused_moe.ONE_LAUNCH_SPACE)
    for row in rows:
        assert row["kernel"] == "_moe_gemv_one_launch_kernel" and row["cubin"], row
        assert row["late_loads"] == [], row
