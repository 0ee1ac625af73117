"""kernels/l2_prefetch.py's kernel compiled for an H100/H200 (sm_90) without a GPU:
ptxas accepts the bulk L2 prefetch, each lane issues one (predicated off past the end), and the
kernel neither loads nor stores anything itself."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton.backends.nvidia.compiler")

CHILD = textwrap.dedent(
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from pagecast.kernels import l2_prefetch

    sig = {"base_ptr": "*u8", "nbytes": "i64", "SUB": "constexpr", "LANES": "constexpr"}
    compiled = triton.compile(
        ASTSource(l2_prefetch._kernel(), signature=sig, constexprs={"SUB": l2_prefetch.SUB_BYTES, "LANES": l2_prefetch.LANES}),
        target=GPUTarget("cuda", 90, 32), options={"num_warps": 1},
    )
    assert "cubin" in compiled.asm
    print(compiled.asm["ptx"])
    """
)


def test_the_prefetch_kernel_compiles_for_sm90_to_one_predicated_bulk_prefetch_a_lane() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-c", CHILD],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line.strip() for line in proc.stdout.splitlines()]
    assert sum("cp.async.bulk.prefetch.L2.global" in line for line in lines) == 1
    assert any(line.startswith("@p cp.async.bulk.prefetch.L2.global") for line in lines)  # predicated
    body = [line for line in lines if line.startswith(("ld.global", "st.global", "atom."))]
    assert body == [], body
