"""Programmatic dependent launch (kernels/pdl.py, experimental, built with PAGECAST_PDL=1): with it
on, every participating kernel's launch asks for PDL, and each of those kernels, compiled for an
H100/H200 (sm_90) here without a GPU, waits (griddepcontrol.wait) before its first global memory
access: a kernel that read or wrote memory before the wait could race the kernel before it. With it
off, the launches are as they were. The choice travels from the build's tuning table to serving."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("triton.backends.nvidia.compiler")

# Run in a child process: the test session runs Triton in interpreter mode (TRITON_INTERPRET=1),
# where kernels cannot be compiled. The child calls the real launchers on CPU tensors with every
# launch intercepted (nothing runs), then compiles each intercepted launch for sm_90 with the
# launcher's own arguments, constexprs and options, the JIT's specialisation of them included
# (benchmarks/decode_ptx.py's compile_kernel).
CHILD = textwrap.dedent(
    r"""
    import json, re, sys
    import torch
    from triton.runtime.jit import JITFunction
    sys.path.insert(0, sys.argv[2])
    from decode_ptx import compile_kernel  # the launch's own specialisation, for sm_90
    from pagecast.kernels import activation, fp8_gemm, fused_moe, moe_route_kernel, paged_decode_attention, pdl
    from pagecast.kernels import rms_norm, rotary_kv, skinny_gemm
    from pagecast.kernels.tuning import KernelConfig

    pdl.set_enabled(sys.argv[1] == "on")
    launches = []
    def run(self, *args, grid, warmup, **kwargs):
        launches.append((self, args, kwargs))
    JITFunction.run = run

    bf16, t = torch.bfloat16, torch.tensor
    x = torch.randn(2, 4096, dtype=bf16)
    w = torch.randn(4096, dtype=bf16)
    rms_norm.rms_norm(x, w, 1e-6, KernelConfig({}, num_warps=8, num_stages=1))
    rms_norm.fused_add_rms_norm(x, x.clone(), w, 1e-6, KernelConfig({}, num_warps=8, num_stages=1))
    skinny_gemm.skinny_gemm(x, torch.randn(512, 4096, dtype=bf16), None,
                            KernelConfig({"BLOCK_N": 64, "BLOCK_K": 128}, num_warps=4, num_stages=4))
    skinny_gemm.skinny_gemm(x, torch.randn(512, 4096, dtype=bf16), None,
                            KernelConfig({"BLOCK_N": 16, "BLOCK_K": 256, "SPLIT_K": 4}, num_warps=4, num_stages=4))
    weight = torch.randn(512, 4096).to(torch.float8_e4m3fn)
    fp8_gemm.fp8_skinny_linear(x, weight, torch.ones(512), "token", None, None, bf16,
                               KernelConfig({"SKINNY": 1, "BLOCK_N": 64, "BLOCK_K": 128, "SPLIT_K": 4}, num_warps=4, num_stages=4))
    activation.silu_and_mul(torch.randn(2, 2 * 1024, dtype=bf16))
    heads, kv_heads, d, block = 32, 8, 128, 16
    q, k, v = torch.randn(2, heads, d, dtype=bf16), torch.randn(2, kv_heads, d, dtype=bf16), torch.randn(2, kv_heads, d, dtype=bf16)
    k_cache, v_cache = torch.zeros(8, kv_heads, block, d, dtype=bf16), torch.zeros(8, kv_heads, block, d, dtype=bf16)
    rotary_kv.rotary_and_write_kv(t([5, 9]), q, k, v, torch.randn(64, d), k_cache, v_cache, t([3, 40]))
    paged_decode_attention.paged_decode_attention(
        q, k_cache, v_cache, t([[0, 1], [2, 3]], dtype=torch.int32), t([6, 10], dtype=torch.int32),
        t([0, 1, 2], dtype=torch.int32), d ** -0.5, 32, KernelConfig({"BLOCK_N": 64, "num_splits": 4}, num_warps=4, num_stages=2))
    experts, top_k, hidden, inter = 8, 2, 256, 128
    weights, ids = moe_route_kernel.route_logits(torch.randn(2, experts, dtype=bf16), top_k, "softmax_topk", True,
                                                 torch.float32, widen=True)
    moe_route_kernel.router_route(torch.randn(2, 2048, dtype=bf16), torch.randn(128, 2048, dtype=bf16), None, 8,
                                  "softmax_topk", True, bf16, True,
                                  KernelConfig({"BLOCK_X": 16, "BLOCK_H": 128, "SPLIT_H": 4}, num_warps=4, num_stages=3))
    ids = t([[0, 3], [5, 3]])
    fused_moe.fused_moe(torch.randn(2, hidden, dtype=bf16), weights, ids,
                        torch.randn(experts, 2 * inter, hidden, dtype=bf16), torch.randn(experts, hidden, inter, dtype=bf16),
                        config=KernelConfig({"gemv": 1, "BLOCK_N": 32, "BLOCK_K": 128, "DOWN_PER_PAIR": 1}, num_warps=4, num_stages=2))
    fused_moe.fused_moe(torch.randn(2, hidden, dtype=bf16), weights, ids,
                        torch.randn(experts, 2 * inter, hidden, dtype=bf16), torch.randn(experts, hidden, inter, dtype=bf16),
                        config=KernelConfig({"gemv": 1, "BLOCK_N": 8, "BLOCK_K": 128, "DOWN_PER_PAIR": 1, "TOPK_TICKET": 1,
                                             "DOWN_BLOCK_N": 32, "DOWN_BLOCK_K": 64, "DOWN_WARPS": 4}, num_warps=2, num_stages=1))
    fused_moe.fused_moe(torch.randn(2, hidden, dtype=bf16), weights, ids,
                        torch.randn(experts, 2 * inter, hidden, dtype=bf16), torch.randn(experts, hidden, inter, dtype=bf16),
                        config=KernelConfig({"gemv": 1, "DOT": 1, "BLOCK_N": 32, "BLOCK_K": 128, "DOWN_PER_PAIR": 1,
                                             "TOPK_TICKET": 1}, num_warps=4, num_stages=3))
    fused_moe.fused_moe(torch.randn(2, hidden, dtype=bf16), weights, ids,
                        torch.randn(experts, 2 * inter, hidden, dtype=bf16), torch.randn(experts, hidden, inter, dtype=bf16),
                        config=KernelConfig({"gemv": 1, "ONE_LAUNCH": 1, "DOT": 1, "BLOCK_N": 16, "BLOCK_K": 128,
                                             "DOWN_BLOCK_N": 16, "DOWN_PER_PAIR": 1, "TOPK_TICKET": 1}, num_warps=4, num_stages=4))

    memory = re.compile(r"^\s*(@%p\d+\s+)?(ld\.global|st\.global|atom\.|red\.|cp\.async\.|ldmatrix|cp\.reduce|ld\.volatile\.global)")
    for fn, args, kwargs in launches:
        warps, stages = kwargs.pop("num_warps"), kwargs.pop("num_stages", 3)
        options = {"launch_pdl": kwargs.pop("launch_pdl")} if "launch_pdl" in kwargs else {}
        compiled = compile_kernel(fn, list(args), kwargs, warps, stages, **options)
        lines = compiled.asm["ptx"].splitlines()
        waits = [i for i, line in enumerate(lines) if "griddepcontrol.wait" in line]
        accesses = [i for i, line in enumerate(lines) if memory.match(line)]
        print(json.dumps({"kernel": fn.__name__, "pdl_kwarg": kwargs.get("PDL", False),
                          "launch_pdl": options.get("launch_pdl", False), "metadata_pdl": compiled.metadata.launch_pdl,
                          "first_wait": waits[0] if waits else None, "first_access": accesses[0] if accesses else None,
                          "accesses": len(accesses)}))
    """
)

KERNELS = {
    "_rms_norm_kernel": 2,  # rms_norm and fused_add_rms_norm
    "_skinny_gemm_kernel": 2,  # unsplit and split-K
    "_fp8_skinny_kernel": 1,
    "_silu_and_mul_kernel": 1,
    "_rotary_kv_kernel": 1,
    "_paged_decode_kernel": 1,
    "_decode_merge_kernel": 1,
    "_route_kernel": 1,  # MoE decode: routing (or the router GEMV with it), the expert GEMVs (gate_up, down per pair), the top-k sum
    "_router_route_kernel": 1,
    "_moe_gemv_kernel": 6,  # gate_up and down, three times: then the top k summed in the down launch
    #                         (TOPK_TICKET), then also through tl.dot (DOT)
    "_moe_topk_sum_kernel": 1,
    "_moe_gemv_one_launch_kernel": 1,  # gate_up, down and the top-k sum in one launch (ONE_LAUNCH)
}


def _compile_launches(mode: str) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, mode, str(Path(__file__).parent.parent / "benchmarks")], env=env, capture_output=True, text=True, timeout=600, check=False
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def test_pdl_kernels_wait_before_any_memory_access_when_compiled_for_sm90() -> None:
    launches = _compile_launches("on")
    assert sorted({r["kernel"] for r in launches}) == sorted(KERNELS)
    for kernel, count in KERNELS.items():
        assert sum(r["kernel"] == kernel for r in launches) == count
    for r in launches:
        assert r["pdl_kwarg"] and r["launch_pdl"] and r["metadata_pdl"], r
        assert r["accesses"] > 0, r  # the pattern finds the kernel's memory accesses
        assert r["first_wait"] is not None and r["first_wait"] < r["first_access"], r


def test_without_pdl_the_kernels_neither_wait_nor_ask_for_it() -> None:
    launches = _compile_launches("off")
    assert sorted({r["kernel"] for r in launches}) == sorted(KERNELS)
    for r in launches:
        assert not r["pdl_kwarg"] and not r["launch_pdl"] and not r["metadata_pdl"], r
        assert r["first_wait"] is None and r["accesses"] > 0, r


def test_the_tuning_table_carries_pdl_to_serving(monkeypatch: pytest.MonkeyPatch) -> None:
    """ops.configure(..., pdl=...) (the loader passes the table's "pdl") switches the launchers, and
    activating another engine's table switches them back; PAGECAST_PDL accepts 1 and 0 only."""
    from pagecast.kernels import ops, pdl

    monkeypatch.setattr(pdl, "_enabled", False)
    with_pdl = ops.configure({}, use_triton=True, pdl=True)
    assert pdl.enabled() and pdl.launch_options() == {"PDL": True, "launch_pdl": True}
    without = ops.configure({}, use_triton=True)
    assert not pdl.enabled() and pdl.launch_options() == {}
    ops.activate(with_pdl)
    assert pdl.enabled()
    ops.activate(without)
    assert not pdl.enabled()

    monkeypatch.setenv(pdl.ENV, "1")
    assert pdl.requested()
    monkeypatch.setenv(pdl.ENV, "0")
    assert not pdl.requested()
    monkeypatch.setenv(pdl.ENV, "maybe")
    with pytest.raises(ValueError, match="PAGECAST_PDL"):
        pdl.requested()
    assert not pdl.requested(strict=False)


def test_a_build_without_the_gpu_says_pdl_is_ignored_and_refuses_a_bad_value(
    tmp_path: Path, tiny_llama_checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An untuned build (no GPU) asked for PDL says in its report that the option was not built,
    records it off, and a value other than 1 or 0 stops the build naming the variable."""
    import torch
    from conftest import build_artifact

    from pagecast.runtime.errors import BuildError

    if torch.cuda.is_available():
        pytest.skip("needs a machine without a GPU")
    monkeypatch.setenv("PAGECAST_PDL", "1")
    art = build_artifact(tiny_llama_checkpoint, tmp_path / "art", gpu="h200", load_format="dummy")
    assert "PAGECAST_PDL=1 ignored: programmatic dependent launch is built on the GPU" in (art / "report.md").read_text()
    assert not json.loads((art / "tuning.json").read_text()).get("pdl")
    monkeypatch.setenv("PAGECAST_PDL", "maybe")
    with pytest.raises(BuildError, match="PAGECAST_PDL must be 1 or 0"):
        build_artifact(tiny_llama_checkpoint, tmp_path / "bad", gpu="h200", load_format="dummy")
