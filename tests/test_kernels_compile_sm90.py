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

pytest.importorskip("triton")

# Run in a child process: the test session runs Triton in interpreter mode (TRITON_INTERPRET=1),
# where @triton.jit functions cannot be compiled.
CHILD = textwrap.dedent(
    """
    import json, sys
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from pagecast.kernels import keyed_noise, sampling, w4a16_gemm

    kernel, signature, constexprs = json.loads(sys.argv[1])
    fn = {"keyed_noise": keyed_noise._keyed_exponential_kernel, "w4a16_gemm": w4a16_gemm._w4a16_gemm_kernel,
          "dequantize": w4a16_gemm._dequantize_kernel, "race": sampling._race_kernel,
          "count_ties": sampling._count_ties_kernel, "logprob_stats": sampling._logprob_stats_kernel}[kernel]
    sig = dict(signature, **{name: "constexpr" for name in constexprs})
    asm = triton.compile(ASTSource(fn, signature=sig, constexprs=constexprs), target=GPUTarget("cuda", 90, 32)).asm
    print(sorted(asm))
    """
)


def compile_sm90(kernel: str, signature: dict[str, str], constexprs: dict[str, object]) -> str:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps([kernel, signature, constexprs])],
        env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


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


def test_dequantize_kernel_compiles_for_sm90() -> None:
    asm = compile_sm90(
        "dequantize",
        {"qw_ptr": "*i32", "s_ptr": "*bf16", "z_ptr": "*i8", "w_ptr": "*bf16", "N": "i32", "K": "i32"},
        {"GROUP_SIZE": 128, "BLOCK_N": 64, "BLOCK_K": 64},
    )
    assert "cubin" in asm


# The sampling kernels (kernels/sampling.py), with bf16 and fp32 logits.
@pytest.mark.parametrize("logits", ["*bf16", "*fp32"])
@pytest.mark.parametrize("ties", [False, True])
def test_race_kernel_compiles_for_sm90(logits: str, ties: bool) -> None:
    from pagecast.kernels.reference import PHILOX_GROUP

    asm = compile_sm90(
        "race",
        {
            "logits_ptr": logits, "temperature_ptr": "*fp32", "cut_value_ptr": "*fp32", "cut_token_ptr": "*i64",
            "tie_drop_ptr": "*i64", "tie_prefix_ptr": "*i32", "row_max_ptr": "*fp32", "min_p_ptr": "*fp32",
            "keys_ptr": "*i64", "offsets_ptr": "*i64", "score_ptr": "*fp32", "token_ptr": "*i32",
            "stride_row": "i32", "vocab": "i32", "splits": "i32",
        },
        {"GROUP": PHILOX_GROUP, "CHUNKS": 8, "TIES": ties, "PRECISE": True},
    )  # fmt: skip
    assert "cubin" in asm


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
