"""The FP8 fused-MoE kernels (kernels/fused_moe_fp8.py) compiled for an H100/H200 (sm_90) without a
GPU, as tests/test_fused_moe_compile_sm90.py does for the half-type ones: the interpreter accepts
kernels the compiler refuses, and does not say how much shared memory a tile needs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton")
pytest.importorskip("triton.backends.nvidia.compiler")

from pagecast.kernels import fused_moe, fused_moe_fp8, problems
from pagecast.kernels.tuning import KernelConfig, ModelShapes

CHILD = textwrap.dedent(
    """
    import json, sys
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from pagecast.kernels import fused_moe_fp8

    for job in sys.argv[1:]:
        kernel, signature, constexprs, divisible, options = json.loads(job)
        fn = {"gemm": fused_moe_fp8._moe_fp8_gemm_kernel, "gemv": fused_moe_fp8._moe_fp8_gemv_kernel}[kernel]
        sig = dict(signature, **{name: "constexpr" for name in constexprs})
        attrs = {(fn.arg_names.index(name),): [["tt.divisibility", 16]] for name in divisible}
        compiled = triton.compile(
            ASTSource(fn, signature=sig, constexprs=constexprs, attrs=attrs), target=GPUTarget("cuda", 90, 32),
            options=options,
        )
        print(json.dumps({"ptx": compiled.asm["ptx"], "shared": compiled.metadata.shared}))
    """
)

H, I = 2048, 768  # Qwen3-30B-A3B's expert shape


def compile_batch(jobs: list[tuple]) -> list[dict]:  # type: ignore[type-arg]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, *(json.dumps(job) for job in jobs)],
        check=False, env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def _ints(gate_up: bool) -> dict[str, int]:
    n, k = (I, H) if gate_up else (H, I)
    return {"N": n, "K": k, "stride_am": k, "stride_we": (2 * I if gate_up else H) * k, "stride_wn": k, "top_k": 8}


def gemm_job(cfg: KernelConfig, gate_up: bool, block: bool, bias: bool = False, act: int = fused_moe.ACT_SILU) -> tuple:  # type: ignore[type-arg]
    ints = _ints(gate_up)
    n_w = 2 * I if gate_up else H
    ints.update(stride_se=n_w * (-(-ints["K"] // 128) if block else 1), stride_be=n_w, stride_cm=ints["N"])
    signature = {
        "a_ptr": "*fp8e4nv", "as_ptr": "*fp32", "w_ptr": "*fp8e4nv", "ws_ptr": "*fp32", "b_ptr": "*bf16", "c_ptr": "*bf16",
        "sorted_ids_ptr": "*i32", "block_expert_ptr": "*i32", "weights_ptr": "*fp32",
        "N": "i32", "K": "i32", "num_pairs": "i32", "max_blocks": "i32",
        **{name: "i32" for name in ints if name not in ("N", "K")},
    }  # fmt: skip
    divisible = [s for s in signature if s.endswith("_ptr")] + [s for s, v in ints.items() if v % 16 == 0]
    constexprs = {
        "ACTIVATION": act if gate_up else 0, "MUL_ROUTING_WEIGHT": not gate_up, "BLOCK_SCALED": block, "HAS_BIAS": bias,
        "ALPHA": 1.702, "LIMIT": 7.0, "BLOCK_M": cfg["BLOCK_M"], "BLOCK_N": cfg["BLOCK_N"], "BLOCK_K": cfg["BLOCK_K"],
        "GROUP_M": cfg["GROUP_M"], "GROUP_K": 128,
    }  # fmt: skip
    return ("gemm", signature, constexprs, divisible, {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages})


def gemv_job(cfg: KernelConfig, gate_up: bool, block: bool, bias: bool = False, act: int = fused_moe.ACT_SILU) -> tuple:  # type: ignore[type-arg]
    ints = _ints(gate_up)
    n_w = 2 * I if gate_up else H
    kb = -(-ints["K"] // 128)
    ints.update(stride_se=n_w * (kb if block else 1), stride_be=n_w, stride_cm=ints["N"])
    signature = {
        "a_ptr": "*bf16", "w_ptr": "*fp8e4nv", "ws_ptr": "*fp32", "b_ptr": "*bf16", "c_ptr": "*bf16", "ids_ptr": "*i64",
        "weights_ptr": "*fp32", **{name: "i32" for name in ints},
    }  # fmt: skip
    divisible = [s for s in signature if s.endswith("_ptr")] + [s for s, v in ints.items() if v % 16 == 0]
    constexprs = {
        "ACTIVATION": act if gate_up else 0, "BLOCK_SCALED": block, "HAS_BIAS": bias, "ALPHA": 1.702, "LIMIT": 7.0,
        "BLOCK_N": cfg["BLOCK_N"], "BLOCK_K": cfg["BLOCK_K"], "GROUP_K": 128, "MIN_AMAX": 1e-12, "QMAX": 448.0,
    }  # fmt: skip
    return ("gemv", signature, constexprs, divisible, {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages})


def test_fp8_moe_kernels_compile_for_sm90_and_fit_shared_memory() -> None:
    """Every tile of the FP8 space compiles for sm_90 as the gate_up launch (two e4m3 weight tiles a
    step, SiLU fused); fused_moe.shared_memory at one byte an element (what prune_configs goes by)
    bounds the shared memory each needs; the tiles of 64 rows and more take fp8 wgmma. The down
    launch, block scales and the GEMV path compile too; the GEMV quantises its activations with the
    saturating e4m3 conversion (the tile path's inputs go through fp8_gemm.quantize_activations,
    compiled in tests/test_fp8_kernels.py)."""
    shapes = ModelShapes(32, 4, 128, H, 6144, 16, "bfloat16", num_experts=128, top_k=8, moe_intermediate=I, fp8="channel-token")
    timed = {
        json.dumps(c.as_dict(), sort_keys=True)
        for _, dims in problems.buckets("fused_moe_fp8", shapes)
        for c in problems.config_space("fused_moe_fp8", shapes, dims)
    }
    tiles = [c for c in fused_moe_fp8.CONFIG_SPACE if "BLOCK_M" in c.params]
    assert all(json.dumps(c.as_dict(), sort_keys=True) in timed for c in tiles)  # every tile is timed somewhere
    gemv = fused_moe_fp8.default_config(1, 8, 128, H, I, block=True)
    jobs = [gemm_job(c, gate_up=True, block=False) for c in tiles] + [
        gemm_job(tiles[0], gate_up=False, block=False),
        gemm_job(tiles[0], gate_up=True, block=True),
        gemm_job(tiles[-1], gate_up=False, block=True),
        gemv_job(gemv, gate_up=True, block=True),
        gemv_job(gemv, gate_up=False, block=True),
        gemv_job(fused_moe_fp8.default_config(1, 8, 128, H, I), gate_up=True, block=False),
        gemm_job(tiles[4], gate_up=True, block=False, bias=True, act=fused_moe.ACT_SWIGLU_OAI),  # gpt-oss
        gemm_job(tiles[4], gate_up=False, block=False, bias=True),
        gemv_job(gemv, gate_up=True, block=False, bias=True, act=fused_moe.ACT_SWIGLU_OAI),
        gemv_job(gemv, gate_up=False, block=False, bias=True),
    ]
    results = compile_batch(jobs)
    assert len(results) == len(jobs)
    for cfg, result in zip(tiles, results, strict=False):
        assert result["shared"] <= fused_moe.shared_memory(cfg, 1), (cfg.as_dict(), result["shared"])
        assert result["shared"] <= fused_moe.SHARED_MEMORY_LIMIT
        if cfg["BLOCK_M"] >= 64:
            assert "wgmma" in result["ptx"] and "e4m3" in result["ptx"], cfg.as_dict()
    for job, result in zip(jobs, results, strict=True):
        if job[0] == "gemv":
            assert "cvt.rn.satfinite.e4m3x2.f32" in result["ptx"], job[2]
