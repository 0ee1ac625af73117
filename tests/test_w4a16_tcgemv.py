"""The tensor-core W4A16 decode kernel (kernels/w4a16_tcgemv.py) against the pure-torch
reference, through the Triton interpreter on the CPU, and compiled for sm_90 here without a GPU.

The interpreter's bf16 tl.dot is wrong, so bf16 runs its dot in fp32 there (DOT_FP32: the magic
values 128 + q and bf16 activations are exact in fp32); the bf16 unpacking is still the one under
test. The reference is exact (fp32 weights, fp32 products of the activations as given), so the
checks are tight: the output's rounding to fp16 / bf16 (rtol) plus ~1e-4 of the largest output
for the kernel's fp32 cancellation (acc carries the magic bias, ~1024 sum x for fp16)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from pagecast.kernels import reference, split_k, w4a16_gemm, w4a16_gemv, w4a16_tcgemv


def _weights(n: int, k: int, g: int, perm: bool, seed: int = 0):  # type: ignore[no-untyped-def]
    gen = torch.Generator().manual_seed(seed)
    qweight = torch.randint(-(2**31), 2**31 - 1, (k // 8, n), generator=gen, dtype=torch.int32)
    scales = (torch.rand(k // g, n, generator=gen) * 0.02 + 0.001).half()
    zeros = torch.randint(0, 16, (k // g, n), generator=gen, dtype=torch.int8)
    p = torch.randperm(k, generator=gen).to(torch.int32) if perm else None
    return qweight, scales, zeros, p


RTOL = {torch.float16: 2**-10, torch.bfloat16: 2**-7}  # twice the output's rounding


def _check(m, n, k, g, perm, bias, cfg, dtype, seed=0):  # type: ignore[no-untyped-def]
    qweight, scales, zeros, p = _weights(n, k, g, perm, seed=seed + m + n)
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(m, k, generator=gen).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype) if bias else None
    y = w4a16_tcgemv.w4a16_tcgemv(x, qweight, scales, zeros, p, g, b, cfg)
    ref = reference.w4a16_linear(x.float(), qweight, scales, zeros, p, g, b.float() if bias else None)
    assert y.dtype == dtype and y.shape == (m, n)
    torch.testing.assert_close(y.float(), ref, atol=1e-4 * ref.abs().max().item(), rtol=RTOL[dtype])
    return y


# (M, N, K, G, act-order perm, bias, (BLOCK_N, BLOCK_K, SPLIT_K)). K = 576 is SmolLM2's hidden
# size; N = 40 / 72 / 100 leave a partial column tile; the launcher takes the largest split
# dividing K / chunk (576 / 64 = 9 chunks: 3 splits of 3 when 4 are asked).
CASES = [
    (1, 40, 576, 64, False, True, (32, 64, 4)),
    (3, 72, 576, 32, True, False, (64, 64, 2)),  # the group is the step and the chunk
    (8, 100, 576, 64, True, True, (64, 128, 1)),  # BLOCK_K capped by the group; no split
    (16, 64, 576, 32, False, True, (32, 32, 9)),  # 18 chunks of 32, 9 splits
    (1, 72, 4096, 128, True, True, (64, 128, 8)),
    (16, 40, 4096, 128, False, False, (32, 128, 1)),
    (8, 48, 1024, 1024, False, True, (32, 128, 2)),  # per channel: chunks of MAX_CHUNK in one group
]


@pytest.mark.parametrize("m,n,k,g,perm,bias,tile", CASES)
def test_tcgemv_fp16_matches_reference(m, n, k, g, perm, bias, tile):  # type: ignore[no-untyped-def]
    _check(m, n, k, g, perm, bias, w4a16_tcgemv.make_config(*tile, num_warps=2), torch.float16)


@pytest.mark.parametrize("m,n,k,g,perm,bias,tile", [CASES[0], CASES[1], CASES[4], CASES[6]])
def test_tcgemv_bf16_unpacking_matches_reference(m, n, k, g, perm, bias, tile):  # type: ignore[no-untyped-def]
    _check(m, n, k, g, perm, bias, w4a16_tcgemv.make_config(*tile, num_warps=2), torch.bfloat16)


# The variants the static counts compare are correct too: the per-chunk sums of x inside the
# loop, the weight as the mma's B operand, and the other pairing order of the unpacked nibbles.
@pytest.mark.parametrize(
    "options",
    [{"sums_first": False}, {"w_as_a": False}, {"pair_order": 1}],
    ids=["sums-in-loop", "w-as-b", "order-1"],
)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_tcgemv_variants_match_reference(options, dtype):  # type: ignore[no-untyped-def]
    for m, n, k, g, perm, bias, tile in (CASES[1], CASES[4]):
        _check(m, n, k, g, perm, bias, w4a16_tcgemv.make_config(*tile, num_warps=2, **options), dtype)


# SUB_ZEROS: the zero points subtracted in the unpacking ((BIAS + q) - (BIAS + z) = q - z exactly
# in fp16 and bf16), no sums of x, every case of the default kernel in both half types (the
# interpreter runs the bf16 dot in fp32 as above; the bf16 unpacking and subtraction are the ones
# under test), and with the other operand orientation and pairing order.
@pytest.mark.parametrize("m,n,k,g,perm,bias,tile", CASES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_tcgemv_sub_zeros_matches_reference(m, n, k, g, perm, bias, tile, dtype):  # type: ignore[no-untyped-def]
    _check(m, n, k, g, perm, bias, w4a16_tcgemv.make_config(*tile, num_warps=2, sub_zeros=True), dtype)


@pytest.mark.parametrize("options", [{"w_as_a": False}, {"pair_order": 1}], ids=["w-as-b", "order-1"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_tcgemv_sub_zeros_variants_match_reference(options, dtype):  # type: ignore[no-untyped-def]
    for m, n, k, g, perm, bias, tile in (CASES[1], CASES[4], CASES[6]):
        cfg = w4a16_tcgemv.make_config(*tile, num_warps=2, sub_zeros=True, **options)
        _check(m, n, k, g, perm, bias, cfg, dtype)


# PREFETCH (chunk c + 1 or c + 2 of a split prefetched into L2 when chunk c starts) changes no
# arithmetic; the interpreter skips the prefetch itself (inline PTX) but runs the loop around it.
@pytest.mark.parametrize("prefetch", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_tcgemv_prefetch_matches_reference(prefetch, dtype):  # type: ignore[no-untyped-def]
    for m, n, k, g, perm, bias, tile in (CASES[0], CASES[4], CASES[6]):
        cfg = w4a16_tcgemv.make_config(*tile, num_warps=2, sub_zeros=True, prefetch=prefetch)
        _check(m, n, k, g, perm, bias, cfg, dtype)


# silu_and_mul folded into the kernel's x loads: the same activations as kernels/activation.py's
# kernel gives (bitwise: the same expression, rounded the same way), so the same output as the
# unfused pair; with act-order (x gathered through the perm from both halves) and a split.
@pytest.mark.parametrize("m,n,k,g,perm,bias,tile", [CASES[0], CASES[1], CASES[4], CASES[6]])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_tcgemv_fused_silu_and_mul_equals_the_activation_kernel_then_the_gemv(m, n, k, g, perm, bias, tile, dtype):  # type: ignore[no-untyped-def]
    from pagecast.kernels import activation

    qweight, scales, zeros, p = _weights(n, k, g, perm, seed=m + n)
    gen = torch.Generator().manual_seed(3)
    gate_up = (torch.randn(m, 2 * k, generator=gen) * 3).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype) if bias else None
    cfg = w4a16_tcgemv.make_config(*tile, num_warps=2, sub_zeros=True)
    fused = w4a16_tcgemv.w4a16_tcgemv(gate_up, qweight, scales, zeros, p, g, b, cfg, silu_and_mul=True)
    x = activation.silu_and_mul(gate_up)
    assert torch.equal(fused, w4a16_tcgemv.w4a16_tcgemv(x, qweight, scales, zeros, p, g, b, cfg))
    ref = reference.w4a16_linear(x.float(), qweight, scales, zeros, p, g, b.float() if bias else None)
    torch.testing.assert_close(fused.float(), ref, atol=1e-4 * ref.abs().max().item(), rtol=RTOL[dtype])


def test_silu_and_mul_gemm_fuses_only_into_sub_zeros_tensor_core_configs():
    """w4a16_gemm's entry point: a SUB_ZEROS tensor-core config computes the activation in the
    kernel; any other config (the sums' kernel, the GEMV) runs activation.py's kernel first, and
    the tensor-core launcher refuses to fuse into a config that cannot."""
    from pagecast.kernels import activation

    qweight, scales, zeros, _ = _weights(40, 576, 64, False)
    gate_up = torch.randn(2, 2 * 576, generator=torch.Generator().manual_seed(5)).half()
    unfused = activation.silu_and_mul(gate_up)
    for cfg in (
        w4a16_tcgemv.make_config(32, 64, 4, num_warps=2, sub_zeros=True),
        w4a16_tcgemv.make_config(32, 64, 4, num_warps=2),
        w4a16_gemv.default_config(2, 40, 576),
    ):
        got = w4a16_gemm.w4a16_silu_and_mul_gemm(gate_up, qweight, scales, zeros, None, 64, None, cfg)
        assert torch.equal(got, w4a16_gemm.w4a16_gemm(unfused, qweight, scales, zeros, None, 64, None, cfg)), cfg
    with pytest.raises(ValueError, match="SUB_ZEROS"):
        w4a16_tcgemv.w4a16_tcgemv(
            gate_up, qweight, scales, zeros, None, 64, None, w4a16_tcgemv.make_config(32, 64, 4), silu_and_mul=True
        )


def test_prefetch_is_a_sub_zeros_option_the_tuner_times_from_four_rows():
    """PREFETCH needs SUB_ZEROS; the untuned default never prefetches; the tuner times it (on the
    128-column tile, at both its splits) from PREFETCH_MIN_ROWS rows, where it won on an H200, and
    not at 1-2 rows, where it lost at every projection."""
    with pytest.raises(ValueError, match="sub_zeros"):
        w4a16_tcgemv.make_config(256, 128, 4, prefetch=1)
    assert "PREFETCH" not in w4a16_tcgemv.default_config(1, 28672, 4096).params
    for m in (1, 2, 4, 8, 16):
        prefetching = [c for c in w4a16_gemm.tcgemv_configs(m, 28672, 4096) if c.params.get("PREFETCH")]
        if m < w4a16_gemm.PREFETCH_MIN_ROWS:
            assert not prefetching, m
        else:
            assert len(prefetching) == 2, (m, prefetching)
            assert all(c.params["BLOCK_N"] == 128 and c.num_warps == 2 and c.params["SUB_ZEROS"] == 1 for c in prefetching)


def test_tcgemv_default_and_tuner_candidates_subtract_zeros_and_old_tables_keep_their_kernel():
    """The untuned default and every tensor-core candidate the tuner times use SUB_ZEROS (it won at
    every shape timed); a config without the key (a table an older build wrote) names the sums'
    kernel, so such an artifact runs the kernel it was tuned with."""
    assert "SUB_ZEROS" not in w4a16_tcgemv.make_config(256, 128, 8).params
    assert w4a16_tcgemv.default_config(1, 4096, 4096)["SUB_ZEROS"] == 1
    for m in (1, 4, 8, 16):
        assert all(c["SUB_ZEROS"] == 1 for c in w4a16_gemm.tcgemv_configs(m, 6144, 4096))
    assert w4a16_tcgemv.make_config(256, 128, 8, sub_zeros=True)["SUB_ZEROS"] == 1


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_tcgemv_sub_zeros_extreme_zero_points_and_large_activations(dtype):  # type: ignore[no-untyped-def]
    """Zero points 0 and 15 (the words' halves BIAS and BIAS + 15; fp16's 64 + z for odd nibbles
    too), activations of a few hundred, rows past 16 (two row blocks) and a split."""
    qweight, scales, _, _ = _weights(72, 1024, 128, False, seed=8)
    zeros = torch.zeros(1024 // 128, 72, dtype=torch.int8)
    zeros[:, ::2] = 15
    x = (torch.randn(19, 1024, generator=torch.Generator().manual_seed(9)) * 300).to(dtype)
    cfg = w4a16_tcgemv.make_config(32, 128, 4, num_warps=2, sub_zeros=True)
    y = w4a16_tcgemv.w4a16_tcgemv(x, qweight, scales, zeros, None, 128, None, cfg)
    ref = reference.w4a16_linear(x.float(), qweight, scales, zeros, None, 128)
    torch.testing.assert_close(y.float(), ref, atol=1e-4 * ref.abs().max().item(), rtol=RTOL[dtype])


def test_tcgemv_rows_past_16_take_several_row_blocks():
    _check(19, 40, 576, 64, True, True, w4a16_tcgemv.make_config(32, 64, 3, num_warps=2), torch.float16)


def test_tcgemv_large_activations_keep_their_precision():
    """The magic bias rides in the fp32 accumulator (1024 x for fp16): activations of a few
    hundred must not lose the result to cancellation."""
    qweight, scales, zeros, _ = _weights(40, 1024, 128, False, seed=5)
    x = (torch.randn(2, 1024, generator=torch.Generator().manual_seed(6)) * 300).half()
    cfg = w4a16_tcgemv.make_config(32, 128, 2, num_warps=2)
    y = w4a16_tcgemv.w4a16_tcgemv(x, qweight, scales, zeros, None, 128, None, cfg)
    ref = reference.w4a16_linear(x.float(), qweight, scales, zeros, None, 128)
    torch.testing.assert_close(y.float(), ref, atol=1e-4 * ref.abs().max().item(), rtol=RTOL[torch.float16])


def test_tcgemv_split_k_is_deterministic_and_leaves_counters_at_zero():
    qweight, scales, zeros, _ = _weights(72, 1024, 64, False)
    x = torch.randn(2, 1024).half()
    cfg = w4a16_tcgemv.make_config(32, 64, 8, num_warps=2)
    first = w4a16_tcgemv.w4a16_tcgemv(x, qweight, scales, zeros, None, 64, None, cfg)
    assert not split_k.COUNTERS[x.device].any()
    second = w4a16_tcgemv.w4a16_tcgemv(x, qweight, scales, zeros, None, 64, None, cfg)
    assert torch.equal(first, second)


@pytest.mark.parametrize("sub_zeros", [False, True])
def test_tcgemv_reads_a_perm_narrower_than_k(sub_zeros: bool):  # type: ignore[no-untyped-def]
    """A row-parallel act-order shard: K = 256 inputs over x's 192 columns (builder/quant.py)."""
    qweight, scales, zeros, _ = _weights(40, 256, 64, False, seed=3)
    gen = torch.Generator().manual_seed(4)
    perm = torch.randint(0, 192, (256,), generator=gen).to(torch.int32)
    x = torch.randn(3, 192, generator=gen).half()
    y = w4a16_tcgemv.w4a16_tcgemv(
        x, qweight, scales, zeros, perm, 64, None, w4a16_tcgemv.make_config(32, 64, 2, sub_zeros=sub_zeros)
    )
    ref = reference.w4a16_linear(x.float(), qweight, scales, zeros, perm, 64)
    torch.testing.assert_close(y.float(), ref, atol=1e-4 * ref.abs().max().item(), rtol=RTOL[torch.float16])


def test_launch_shape_covers_k_with_whole_chunks():
    cfg = w4a16_tcgemv.make_config(256, 128, 64)
    assert w4a16_tcgemv.launch_shape(4096, 128, cfg) == (128, 128, 32, 1)
    assert w4a16_tcgemv.launch_shape(14336, 128, cfg) == (128, 128, 56, 2)  # 112 chunks
    assert w4a16_tcgemv.launch_shape(576, 64, cfg) == (64, 64, 9, 1)
    assert w4a16_tcgemv.launch_shape(4096, 4096, cfg) == (128, 256, 16, 1)  # per channel
    for k, g in ((4096, 128), (14336, 128), (576, 32), (576, 576), (1024, 1024)):
        step, chunk, split, chunks = w4a16_tcgemv.launch_shape(k, g, cfg)
        assert g % chunk == 0 and chunk % step == 0 and split * chunks * chunk == k


def test_tcgemv_default_config_runs():
    cfg = w4a16_tcgemv.default_config(2, 40, 576)
    assert cfg["BLOCK_N"] == 256 and cfg.num_warps == 4
    _check(2, 40, 576, 64, False, True, cfg, torch.float16)
    big = w4a16_tcgemv.default_config(1, 4096, 4096)
    assert 16 * big["SPLIT_K"] >= 2 * 132
    # 3-8 rows: the 128-column tile on 2 warps, at the split the H200's tuner picked for it at
    # Llama-3-8B's o (4 rows: 16), gate_up (4 and 8 rows: 2) and down (16)
    narrow = {(m, n, k): w4a16_tcgemv.default_config(m, n, k) for m in (3, 4, 8) for n, k in
              ((4096, 4096), (28672, 4096), (4096, 14336))}  # fmt: skip
    assert all(c["BLOCK_N"] == 128 and c.num_warps == 2 for c in narrow.values())
    assert [narrow[(4, 4096, 4096)]["SPLIT_K"], narrow[(8, 28672, 4096)]["SPLIT_K"], narrow[(8, 4096, 14336)]["SPLIT_K"]] == [16, 2, 16]
    assert w4a16_tcgemv.default_config(16, 4096, 4096)["BLOCK_N"] == 256


# ---------------------------------------------------------------- wired into the W4A16 launcher


@pytest.mark.parametrize("sub_zeros", [False, True])
def test_w4a16_gemm_runs_a_tensor_core_config(sub_zeros: bool):  # type: ignore[no-untyped-def]
    """The table's config names the kernel: w4a16_gemm dispatches it (with act-order and bias;
    benchmarks/w4a16_micro.py times SUB_ZEROS through it)."""
    m, n, k, g = 3, 72, 576, 64
    qweight, scales, zeros, p = _weights(n, k, g, True, seed=3)
    x, b = torch.randn(m, k).half(), torch.randn(n).half()
    cfg = w4a16_tcgemv.make_config(32, 64, 3, num_warps=2, sub_zeros=sub_zeros)
    y = w4a16_gemm.w4a16_gemm(x, qweight, scales, zeros, p, g, b, cfg)
    ref = reference.w4a16_linear(x.float(), qweight, scales, zeros, p, g, b.float())
    torch.testing.assert_close(y.float(), ref, atol=1e-4 * ref.abs().max().item(), rtol=RTOL[torch.float16])


def test_tuner_times_the_tensor_core_kernel_for_half_decode_rows():
    """bf16/fp16 decode buckets up to 16 rows time the tensor-core kernel first (its default is
    the first candidate, so a tie keeps it) and not the CUDA-core GEMV it beat everywhere; fp32
    and groups not divisible by 32 keep the GEMV; prefill buckets time neither."""
    from pagecast.kernels import problems
    from pagecast.kernels.tuning import ModelShapes

    def space(dtype: str, g: int, m: int) -> list:  # type: ignore[type-arg]
        shapes = ModelShapes(32, 8, 128, 4096, 7168, 16, dtype, quant_group_size=g)
        return problems.config_space("w4a16_gemm", shapes, {"num_rows": m, "n": 6144, "k": 4096})

    for m in (1, 4, 8, 16):
        configs = space("bfloat16", 128, m)
        tc = [c for c in configs if w4a16_tcgemv.is_tcgemv(c)]
        assert configs[: len(tc)] == tc and 3 <= len(tc) <= 10
        assert tc[0] == w4a16_tcgemv.default_config(m, 6144, 4096, problems.num_sms())
        assert not any(w4a16_gemv.is_gemv(c) for c in configs)
        # every multiprocessor gets a program, and no two candidates are the same launch
        assert all(-(-6144 // c["BLOCK_N"]) * c["SPLIT_K"] >= min(132, problems.num_sms()) for c in tc)
        assert len({json.dumps(c.as_dict(), sort_keys=True) for c in tc}) == len(tc)
    assert not any(w4a16_tcgemv.is_tcgemv(c) for c in space("bfloat16", 128, 32))
    assert any(w4a16_tcgemv.is_tcgemv(c) for c in space("float16", -1, 1))  # per channel: a group of K
    for dtype, g in (("float32", 128), ("bfloat16", 16)):
        configs = space(dtype, g, 1)
        assert not any(w4a16_tcgemv.is_tcgemv(c) for c in configs) and any(w4a16_gemv.is_gemv(c) for c in configs)


def test_untuned_default_is_the_tensor_core_kernel_up_to_16_half_rows():
    from pagecast.kernels import problems
    from pagecast.kernels.tuning import ModelShapes

    def default(dtype: str, g: int, m: int):  # type: ignore[no-untyped-def]
        shapes = ModelShapes(32, 8, 128, 4096, 7168, 16, dtype, quant_group_size=g)
        return problems.default_config("w4a16_gemm", shapes, {"num_rows": m, "n": 6144, "k": 4096})

    assert all(w4a16_tcgemv.is_tcgemv(default("bfloat16", 128, m)) for m in (1, 2, 5, 8, 9, 16))
    assert not w4a16_tcgemv.is_tcgemv(default("bfloat16", 128, 17))
    assert w4a16_gemv.is_gemv(default("float32", 128, 1)) and w4a16_gemv.is_gemv(default("float16", 16, 1))
    # the launcher's own default (no table) on the CPU keeps the GEMV: the interpreter is not a GPU
    assert not w4a16_tcgemv.is_tcgemv(w4a16_gemm.default_config(1, 6144, 4096))


def test_tcgemv_refuses_fp32_activations_and_small_groups():
    qweight, scales, zeros, _ = _weights(16, 64, 16, False)
    cfg = w4a16_tcgemv.make_config(16, 16, 1)
    with pytest.raises(ValueError, match="fp16 or bf16"):
        w4a16_tcgemv.w4a16_tcgemv(torch.randn(1, 64), qweight, scales, zeros, None, 16, None, cfg)
    qweight, scales, zeros, _ = _weights(16, 64, 16, False)
    with pytest.raises(ValueError, match="divisible by 32"):
        w4a16_tcgemv.w4a16_tcgemv(torch.randn(1, 64).half(), qweight, scales, zeros, None, 16, None, cfg)


# ---------------------------------------------------------------- sm_90, compiled without a GPU

# A child process: the session runs Triton in interpreter mode, where kernels cannot compile.
CHILD = textwrap.dedent(
    """
    import json, re, sys
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from pagecast.kernels import w4a16_tcgemv

    signature, constexprs, options = json.loads(sys.argv[1])
    fn = w4a16_tcgemv._tcgemv_kernel
    sig = dict(signature, **{name: "constexpr" for name in constexprs})
    divisible = [n for n in signature if n.endswith("_ptr") or n in ("N", "K", "stride_xm", "stride_ym")]
    attrs = {(fn.arg_names.index(name),): [["tt.divisibility", 16]] for name in divisible}
    kernel = triton.compile(ASTSource(fn, signature=sig, constexprs=constexprs, attrs=attrs),
                            target=GPUTarget("cuda", 90, 32), options=options)
    ttgir, ptx = kernel.asm["ttgir"], kernel.asm["ptx"]
    # convert_layout and local_alloc (shared-memory staging) by the element type they move
    moved = sorted({m.group(1) for m in re.finditer(
        r"(?:convert_layout|local_alloc|async_copy_global_to_local) %[^:]*: \\(?(?:tensor|!tt\\.ptr)<[0-9x]*x(\\w+)", ttgir)})
    # the unpacked 16-bit weight tile converted or staged in shared memory (either orientation)
    bn, bk = constexprs["BLOCK_N"], constexprs["BLOCK_K"]
    w16 = len(re.findall(rf"(?:convert_layout|local_alloc).*tensor<(?:{bn}x{bk}|{bk}x{bn})xb?f16", ttgir))
    # global loads before the first barrier (in PTX order: ptxas may still sink one) and barriers
    first = ptx.split("bar.sync")[0]
    print(json.dumps({"cubin": bool(kernel.asm["cubin"]), "mma": ptx.count("mma.sync") + ptx.count("wgmma.mma_async"),
                      "magic": ptx.count("0x64006400") + ptx.count("0x43004300"), "moved": moved, "w16": w16,
                      "ld_before_bar": first.count("ld.global"), "bars": ptx.count("bar.sync"),
                      "prefetch": ptx.count("prefetch.global.L2")}))
    """
)


def _compile_sm90(dtype: str, constexprs: dict[str, object], options: dict[str, int]) -> dict[str, object]:
    pytest.importorskip("triton.backends.nvidia.compiler")
    signature = {
        "x_ptr": dtype, "qw_ptr": "*i32", "s_ptr": dtype, "z_ptr": "*i8", "perm_ptr": "*i32", "b_ptr": dtype,
        "y_ptr": dtype, "part_ptr": "*fp32", "lock_ptr": "*i32", "sums_ptr": "*fp32",
        "M": "i32", "N": "i32", "K": "i32", "stride_xm": "i32", "stride_ym": "i32",
    }  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps([signature, constexprs, options])],
        check=False, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


SUB_ZEROS = {"SUB_ZEROS": 1, "SUMS_FIRST": False}  # as the launcher passes it


def _constexprs(**overrides) -> dict[str, object]:  # type: ignore[no-untyped-def]
    base = {
        "GROUP_SIZE": 128, "HAS_PERM": False, "HAS_BIAS": True, "BLOCK_M": 1, "BLOCK_N": 256, "BLOCK_K": 128,
        "CHUNK": 128, "SPLIT_K": 8, "CHUNKS": 4, "EVEN_N": True, "SUMS_FIRST": True, "SUMS_BLOCK": 4,
        "W_AS_A": True, "DOT_FP32": False, "USE_ASM": True,
    }  # fmt: skip
    out = {**base, **overrides}
    if "PAIR_ORDER" not in out:  # the launcher's choice
        cfg = w4a16_tcgemv.make_config(
            out["BLOCK_N"], out["BLOCK_K"], out["SPLIT_K"], num_warps=4, sub_zeros=bool(out.get("SUB_ZEROS"))
        )
        out["PAIR_ORDER"] = w4a16_tcgemv.pair_order(out["BLOCK_K"], out["BLOCK_M"], out["W_AS_A"], cfg)
    return out


@pytest.mark.parametrize(
    "dtype,overrides",
    [
        ("*fp16", {}),
        ("*bf16", {"BLOCK_M": 16, "HAS_PERM": True, "SPLIT_K": 1, "EVEN_N": False}),
        ("*fp16", {"BLOCK_M": 8, "GROUP_SIZE": 32, "BLOCK_K": 32, "CHUNK": 32, "SUMS_FIRST": False}),
        ("*bf16", {"BLOCK_M": 4, "GROUP_SIZE": 4096, "CHUNK": 256, "W_AS_A": False}),
        ("*fp16", {"BLOCK_M": 16, "GROUP_SIZE": 32, "BLOCK_K": 32, "CHUNK": 32, "HAS_PERM": True}),
        ("*fp16", {**SUB_ZEROS}),
        ("*bf16", {**SUB_ZEROS, "BLOCK_M": 16, "HAS_PERM": True, "SPLIT_K": 1, "EVEN_N": False}),
        ("*fp16", {**SUB_ZEROS, "BLOCK_M": 8, "GROUP_SIZE": 32, "BLOCK_K": 32, "CHUNK": 32}),
        ("*bf16", {**SUB_ZEROS, "BLOCK_M": 4, "GROUP_SIZE": 4096, "CHUNK": 256, "W_AS_A": False}),
        ("*bf16", {**SUB_ZEROS, "GROUP_SIZE": 64, "BLOCK_K": 64, "CHUNK": 64}),
        ("*bf16", {**SUB_ZEROS, "ACT_UP": 14336, "HAS_PERM": True}),
    ],
    ids=[
        "fp16-1row-split",
        "bf16-16rows-perm",
        "fp16-8rows-g32-sums-in-loop",
        "bf16-w-as-b-per-channel",
        "fp16-16rows-g32-wgmma",
        "fp16-1row-split-sub-zeros",
        "bf16-16rows-perm-sub-zeros",
        "fp16-8rows-g32-sub-zeros",
        "bf16-w-as-b-per-channel-sub-zeros",
        "bf16-1row-g64-sub-zeros",
        "bf16-1row-perm-sub-zeros-fused-silu",
    ],
)
def test_tcgemv_compiles_for_sm90(dtype: str, overrides: dict[str, object]) -> None:
    """The inline-PTX unpacking (the interpreter runs the plain expression instead), mma.sync, and
    the weight reaching the mma's registers as unpacked int32: the only layout conversion or
    shared-memory staging of a 16-bit tensor allowed is the activations' (their tile is
    [BLOCK_M, BLOCK_K], small), never the dequantized weight tile."""
    info = _compile_sm90(dtype, _constexprs(**overrides), {"num_warps": 4, "num_stages": 1})
    assert info["cubin"] and info["mma"] > 0 and info["magic"] > 0
    assert "i32" in info["moved"] and info["w16"] == 0, info


def test_tcgemv_prefetch_compiles_to_l2_prefetches_and_keeps_the_packed_tile() -> None:
    """PREFETCH on sm_90: the prefetches are there (the words', the scales' and the zero points'
    lines: three prefetch instructions in the PTX, six at a distance of 2, whose first chunk
    also prefetches chunk 1), none without it, and the weight still crosses shared memory as its
    packed int32 tile (the prefetch adds no layout conversion to the weight's chain)."""
    options = {"num_warps": 4, "num_stages": 1}
    plain = _compile_sm90("*bf16", _constexprs(**SUB_ZEROS), options)
    one = _compile_sm90("*bf16", _constexprs(**SUB_ZEROS, PREFETCH=1), options)
    two = _compile_sm90("*bf16", _constexprs(**SUB_ZEROS, PREFETCH=2), options)
    assert plain["prefetch"] == 0 and one["prefetch"] == 3 and two["prefetch"] == 6, (plain, one, two)
    for info in (one, two):
        assert info["cubin"] and info["w16"] == 0 and "i32" in info["moved"], info


def test_tcgemv_weight_tile_crosses_shared_memory_packed() -> None:
    """Triton hoists the dot-operand conversion above the unpacking (tl.join / permute / reshape)
    to the int32 load only when every k' a thread holds in the mma operand comes from words it
    holds whole: with the other pairing order (the control) the unpacked 16-bit tile is converted
    through shared memory, 4 bytes a weight. Should a Triton upgrade stop the hoisting, the first
    assertion fails (as test_tcgemv_compiles_for_sm90 does)."""
    options = {"num_warps": 4, "num_stages": 1}
    assert _compile_sm90("*fp16", _constexprs(), options)["w16"] == 0
    assert _compile_sm90("*fp16", _constexprs(PAIR_ORDER=1), options)["w16"] > 0


def test_tcgemv_sub_zeros_issues_a_chunks_loads_before_its_first_barrier() -> None:
    """The default kernel's first global load (the sums' pass over x) is followed by a barrier
    before the packed words are loaded; with SUB_ZEROS every load of a chunk (the scales, zero
    points, x and the 8 vector loads of the packed words at 256 columns on 4 warps) comes before
    the first bar.sync in the PTX (ptxas may still schedule the scales' load after the words'
    shared-memory store: benchmarks/w4a16_tcgemv_ptx.py --order shows the SASS), and the kernel
    has fewer barriers."""
    options = {"num_warps": 4, "num_stages": 1}
    default = _compile_sm90("*fp16", _constexprs(), options)
    sub = _compile_sm90("*fp16", _constexprs(**SUB_ZEROS), options)
    assert default["ld_before_bar"] == 1
    assert sub["ld_before_bar"] == 8 + 3, sub
    assert sub["bars"] < default["bars"], (sub, default)


# ---------------------------------------------------------------- on a GPU (not run yet)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 8, 16])
@pytest.mark.parametrize("n,k,g", [(6144, 4096, 128), (4096, 14336, 128), (1728, 576, 64), (1536, 576, 32)])
def test_tcgemv_on_gpu(m, n, k, g, dtype):  # type: ignore[no-untyped-def]
    """The inline-PTX unpacking, mma.sync (up to 8 rows) and wgmma (16 rows on 4 or 8 warps), the
    sums' scratch and the split-K tickets at Llama-3-8B and SmolLM2 shapes, with act-order and
    bias, every tile and stage count benchmarks/w4a16_micro.py times, against the reference; and
    the fp32 accumulator's cancellation checked tighter than the repo's 2e-2 (the bias rides in
    it: ~1024 x sum for fp16). SUB_ZEROS (its inline-PTX subtraction) at each tile too, and with PREFETCH
    (its L2 prefetches: addresses clamped inside the tensors) at two."""
    qweight, scales, zeros, _ = _weights(n, k, g, False)
    qweight, scales, zeros = qweight.cuda(), scales.cuda(), zeros.cuda()
    perm = torch.randperm(k, device="cuda").to(torch.int32)
    gen = torch.Generator(device="cuda").manual_seed(7)
    x = torch.randn(m, k, generator=gen, device="cuda").to(dtype)
    bias = torch.randn(n, generator=gen, device="cuda").to(dtype)
    ref = reference.w4a16_linear(x.float(), qweight, scales, zeros, perm, g, bias.float())
    configs = [w4a16_tcgemv.default_config(m, n, k)] + [
        w4a16_tcgemv.make_config(bn, 128, split, warps, stages)
        for bn, warps in ((256, 4), (128, 2), (512, 4), (512, 8))
        for split in (1, 8)
        for stages in (1, 2)
    ]
    configs += [
        w4a16_tcgemv.make_config(bn, 128, split, warps, stages, sub_zeros=True)
        for bn, warps, stages in ((256, 4, 1), (256, 4, 2), (128, 2, 1), (512, 4, 1), (512, 8, 1))
        for split in (1, 8)
    ]
    configs += [
        w4a16_tcgemv.make_config(bn, 128, split, warps, 1, sub_zeros=True, prefetch=d)
        for bn, warps in ((256, 4), (128, 2))
        for split in (1, 8)
        for d in (1, 2)
    ]
    for cfg in configs:
        y = w4a16_tcgemv.w4a16_tcgemv(x, qweight, scales, zeros, perm, g, bias, cfg)
        torch.testing.assert_close(
            y.float(), ref, atol=1e-3 * ref.abs().max().item(), rtol=RTOL[dtype], msg=str(cfg.as_dict())
        )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("m", [1, 8, 16])
def test_fused_silu_and_mul_on_gpu(m):  # type: ignore[no-untyped-def]
    """The activation computed in the kernel's loads against activation.py's kernel then the same
    launch, at Llama-3-8B's down projection (bf16, G 128, act-order), tuner tiles and PREFETCH:
    equal to within one bf16 rounding of the output (the same expression; ptxas may contract
    it differently in the two kernels)."""
    from pagecast.kernels import activation

    n, k, g = 4096, 14336, 128
    qweight, scales, zeros, _ = _weights(n, k, g, False)
    qweight, scales, zeros = qweight.cuda(), scales.cuda(), zeros.cuda()
    perm = torch.randperm(k, device="cuda").to(torch.int32)
    gate_up = (torch.randn(m, 2 * k, generator=torch.Generator(device="cuda").manual_seed(3), device="cuda") * 3).bfloat16()
    x = activation.silu_and_mul(gate_up)
    configs = [c for c in w4a16_gemm.tcgemv_configs(m, n, k)] + [
        w4a16_tcgemv.make_config(256, 128, 8, 4, 1, sub_zeros=True, prefetch=1)
    ]
    for cfg in configs:
        fused = w4a16_tcgemv.w4a16_tcgemv(gate_up, qweight, scales, zeros, perm, g, None, cfg, silu_and_mul=True)
        plain = w4a16_tcgemv.w4a16_tcgemv(x, qweight, scales, zeros, perm, g, None, cfg)
        torch.testing.assert_close(fused.float(), plain.float(), atol=0, rtol=2**-7, msg=str(cfg.as_dict()))


def test_micro_benchmark_variants_keep_their_own_keys():
    """benchmarks/w4a16_micro.py's variants stay what their names say now that the tuner's
    candidates include PREFETCH ones (from 4 rows): the sums' kernel has neither SUB_ZEROS nor
    PREFETCH, SUB_ZEROS has no PREFETCH, and every PREFETCH candidate has both."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))
    import w4a16_micro

    for m in (1, 8):
        out = w4a16_micro.candidates(m, 28672, 4096, 132)
        assert out["tcgemv"] and all("SUB_ZEROS" not in c.params and "PREFETCH" not in c.params for c in out["tcgemv"])
        assert out["tcgemv_sub_zeros"] and all(
            c.params["SUB_ZEROS"] == 1 and "PREFETCH" not in c.params for c in out["tcgemv_sub_zeros"]
        )
        assert out["tcgemv_prefetch"] and all(
            c.params["SUB_ZEROS"] == 1 and c.params["PREFETCH"] in (1, 2) for c in out["tcgemv_prefetch"]
        )
