"""The fused W4A16 MoE kernels compiled for an H100/H200 (sm_90) without a GPU, as
tests/test_fused_moe_compile_sm90.py does for the half-type ones: the interpreter accepts kernels
the compiler refuses. Every config of the space, gate_up (with an act-order perm) and down, in
bf16 at Qwen3-30B-A3B's expert shape, group size 128; each within sm_90's shared memory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton")
pytest.importorskip("triton.backends.nvidia.compiler")

from pagecast.kernels import fused_moe, fused_moe_w4a16
from pagecast.kernels.tuning import KernelConfig

CHILD = textwrap.dedent(
    """
    import json, sys
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from pagecast.kernels import fused_moe_w4a16

    for job in sys.argv[1:]:
        kernel, signature, constexprs, options = json.loads(job)
        fn = {"gemm": fused_moe_w4a16._moe_w4a16_gemm_kernel, "gemv": fused_moe_w4a16._moe_w4a16_gemv_kernel}[kernel]
        sig = dict(signature, **{name: "constexpr" for name in constexprs})
        attrs = {(fn.arg_names.index(name),): [["tt.divisibility", 16]] for name in signature if name.endswith("_ptr")}
        compiled = triton.compile(
            ASTSource(fn, signature=sig, constexprs=constexprs, attrs=attrs), target=GPUTarget("cuda", 90, 32),
            options=options,
        )
        print(json.dumps({"asm": sorted(compiled.asm), "shared": compiled.metadata.shared}))
    """
)

H, I, G = 2048, 768, 128
POINTERS = {"a_ptr": "*bf16", "qw_ptr": "*i32", "s_ptr": "*fp16", "z_ptr": "*i8", "perm_ptr": "*i32", "c_ptr": "*bf16"}


def job(cfg: KernelConfig, gate_up: bool, perm: bool) -> tuple:
    n, k = (I, H) if gate_up else (H, I)
    act = fused_moe.ACT_SILU if gate_up else fused_moe.ACT_NONE
    common = {"ACTIVATION": act, "HAS_PERM": perm, "GROUP": G, "ALPHA": 1.702, "LIMIT": 7.0,
              "BLOCK_N": cfg["BLOCK_N"], "BLOCK_K": cfg["BLOCK_K"]}  # fmt: skip
    ints = {"N": "i32", "K": "i32", "stride_am": "i32", "stride_cm": "i32", "top_k": "i32"}
    options = {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
    if fused_moe_w4a16.is_gemv(cfg):
        signature = {**POINTERS, "ids_ptr": "*i64", "weights_ptr": "*fp32", **ints}
        return ("gemv", signature, {**common, "PAIRS": bool(cfg.params.get("PAIRS"))}, options)
    signature = {**POINTERS, "sorted_ids_ptr": "*i32", "block_expert_ptr": "*i32", "weights_ptr": "*fp32",
                 "N": "i32", "K": "i32", "num_pairs": "i32", "max_blocks": "i32", "stride_am": "i32",
                 "stride_cm": "i32", "top_k": "i32"}  # fmt: skip
    constexprs = {**common, "MUL_ROUTING_WEIGHT": not gate_up, "BLOCK_M": cfg["BLOCK_M"], "GROUP_M": cfg["GROUP_M"],
                  "DOT_PRECISION": "tf32"}  # fmt: skip
    del n, k
    return ("gemm", signature, constexprs, options)


def test_kernels_compile_for_sm90():
    """Every config of the space: gate_up with an act-order perm, down without."""
    configs = [c for c in fused_moe_w4a16.CONFIG_SPACE if not fused_moe_w4a16.is_naive(c)]
    jobs = [job(c, gate_up, gate_up) for c in configs for gate_up in (True, False)]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, *(json.dumps(j) for j in jobs)],
        check=False, env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(results) == len(jobs)
    for result in results:
        assert "cubin" in result["asm"] or "ptx" in result["asm"]
        assert result["shared"] <= fused_moe.SHARED_MEMORY_LIMIT
