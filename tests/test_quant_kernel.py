"""The W4A16 GEMM (kernels/w4a16_gemm.py) against its pure-torch reference, through the Triton
interpreter on the CPU (fp32 and fp16; bf16 tl.dot is wrong in the interpreter) and in bf16 on
a GPU; and the kernels compiled for sm_90 here, without a GPU, so a kernel the interpreter
accepts but the compiler rejects fails CI."""

from __future__ import annotations

import pytest
import torch

from pagecast.kernels import reference, split_k, w4a16_gemm, w4a16_gemv, w4a16_tcgemv
from pagecast.kernels.tuning import KernelConfig


def _weights(n: int, k: int, g: int, perm: bool, seed: int = 0, device: str = "cpu"):  # type: ignore[no-untyped-def]
    gen = torch.Generator().manual_seed(seed)
    qweight = torch.randint(-(2**31), 2**31 - 1, (k // 8, n), generator=gen, dtype=torch.int32)
    scales = (torch.rand(k // g, n, generator=gen) * 0.02 + 0.001).half()
    zeros = torch.randint(0, 16, (k // g, n), generator=gen, dtype=torch.int8)
    p = torch.randperm(k, generator=gen).to(torch.int32) if perm else None
    moved = [t.to(device) if t is not None else None for t in (qweight, scales, zeros, p)]
    return moved


def _cfg(bm: int, bn: int, bk: int, split: int) -> KernelConfig:
    return KernelConfig(
        {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": split}, num_warps=4, num_stages=2
    )


# (M, N, K, group size, act-order perm, config): K = 576 is SmolLM2's hidden size (not a multiple
# of 128), N = 40 / 72 / 24 leave partial column tiles, G = K is per-channel.
CASES = [
    (1, 40, 576, 64, False, _cfg(16, 32, 64, 1)),
    (3, 72, 576, 32, True, _cfg(16, 32, 128, 3)),  # BLOCK_K spans 4 groups; last split partial
    (9, 24, 256, 128, False, _cfg(16, 16, 128, 2)),
    (41, 48, 384, 128, True, _cfg(32, 32, 64, 1)),
    (5, 40, 576, 576, False, _cfg(16, 16, 128, 2)),  # per channel, K % BLOCK_K != 0
    (17, 16, 192, 64, False, None),  # the launcher's default config
]


@pytest.mark.parametrize("dtype,atol,rtol", [(torch.float32, 1e-4, 1e-4), (torch.float16, 2e-2, 1e-2)])
@pytest.mark.parametrize("m,n,k,g,perm,cfg", CASES)
def test_w4a16_gemm_matches_reference(m, n, k, g, perm, cfg, dtype, atol, rtol):  # type: ignore[no-untyped-def]
    qweight, scales, zeros, p = _weights(n, k, g, perm)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(m, k, generator=gen).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype)
    y = w4a16_gemm.w4a16_gemm(x, qweight, scales, zeros, p, g, bias, cfg)
    ref = reference.w4a16_linear(x.float(), qweight, scales, zeros, p, g, bias.float())
    assert y.dtype == dtype and y.shape == (m, n)
    torch.testing.assert_close(y.float(), ref, atol=atol * ref.abs().max().item(), rtol=rtol)


# The decode GEMV (kernels/w4a16_gemv.py): (M, N, K, G, perm, bias, (BLOCK_N, BLOCK_K, SPLIT_K)).
# K = 576 is not a multiple of 128; N = 40 / 72 / 104 / 24 leave partial column tiles; the
# launcher rounds the splits to whole steps (576 / 4 -> 3 splits of 192 at G = 64).
GEMV_CASES = [
    (1, 40, 576, 64, False, True, (32, 32, 4)),  # a group is 2 steps; 3 splits
    (3, 72, 576, 32, True, False, (64, 64, 2)),  # G < BLOCK_K: scales per packed row
    (8, 24, 256, 128, False, True, (16, 32, 1)),  # no split: stored directly
    (1, 40, 576, 576, True, True, (32, 128, 2)),  # per channel, 576 % 128 != 0
    (3, 40, 512, 128, True, True, (32, 64, 8)),  # 8 splits of one step each
    (2, 40, 576, 64, False, True, None),  # the launcher's default for 2 rows is the GEMV
]


# fp32: the GEMV's sums run ~11 bits above the product (t ~ sum x' + sum x * q / 128, see
# kernels/w4a16_gemv.py), so fp32 activations match to ~1e-4 of the largest output, below fp16's
# rounding and far below bf16's; half-type activations are as tight as the tl.dot kernel's.
@pytest.mark.parametrize("dtype,atol,rtol", [(torch.float32, 1e-3, 1e-3), (torch.float16, 2e-2, 1e-2)])
@pytest.mark.parametrize("m,n,k,g,perm,bias,tile", GEMV_CASES)
def test_w4a16_gemv_matches_reference(m, n, k, g, perm, bias, tile, dtype, atol, rtol):  # type: ignore[no-untyped-def]
    qweight, scales, zeros, p = _weights(n, k, g, perm, seed=m + n)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(m, k, generator=gen).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype) if bias else None
    cfg = w4a16_gemv.make_config(*tile, num_warps=2) if tile else None
    if cfg is None:
        assert w4a16_gemv.is_gemv(w4a16_gemm.default_config(m, n, k))
    y = w4a16_gemm.w4a16_gemm(x, qweight, scales, zeros, p, g, b, cfg)
    ref = reference.w4a16_linear(x.float(), qweight, scales, zeros, p, g, b.float() if bias else None)
    assert y.dtype == dtype and y.shape == (m, n)
    torch.testing.assert_close(y.float(), ref, atol=atol * ref.abs().max().item(), rtol=rtol)


# Several rows a program (kernels/w4a16_gemv.py: BLOCK_M): each weight unpacked once for every
# row; from 4 rows dequantized first. (M, N, K, G, perm, bias, (BLOCK_N, BLOCK_K, SPLIT_K, BLOCK_M)).
GEMV_ROW_BLOCK_CASES = [
    (1, 40, 576, 64, True, True, (32, 64, 2, 8)),  # one row: the per-group algebra
    (3, 72, 576, 32, True, False, (64, 64, 2, 8)),  # 3 rows in a block of 4 (dequantized first)
    (8, 40, 576, 576, False, True, (32, 128, 1, 8)),  # per channel, K % 128 != 0, 8 rows, no split
    (8, 24, 256, 128, True, True, (16, 32, 2, 8)),  # act-order, split 2 x 8 rows
    (5, 40, 256, 64, False, False, (32, 64, 4, 2)),  # blocks of 2 rows (3 blocks, the last partial)
]


@pytest.mark.parametrize("dtype,atol,rtol", [(torch.float32, 1e-3, 1e-3), (torch.float16, 2e-2, 1e-2)])
@pytest.mark.parametrize("m,n,k,g,perm,bias,tile", GEMV_ROW_BLOCK_CASES)
def test_w4a16_gemv_row_blocks_match_reference(m, n, k, g, perm, bias, tile, dtype, atol, rtol):  # type: ignore[no-untyped-def]
    qweight, scales, zeros, p = _weights(n, k, g, perm, seed=m + n + 7)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(m, k, generator=gen).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype) if bias else None
    bn, bk, split, bm = tile
    cfg = w4a16_gemv.make_config(bn, bk, split, num_warps=2, block_m=bm)
    y = w4a16_gemm.w4a16_gemm(x, qweight, scales, zeros, p, g, b, cfg)
    ref = reference.w4a16_linear(x.float(), qweight, scales, zeros, p, g, b.float() if bias else None)
    assert y.dtype == dtype and y.shape == (m, n)
    torch.testing.assert_close(y.float(), ref, atol=atol * ref.abs().max().item(), rtol=rtol)


def test_w4a16_gemv_dequantizes_exactly_with_fp32_scales():
    """From 4 rows the weight is (q - z) * s per weight: with fp32 scales through an exact
    v * 2048 - (2048 + z) and one rounding by s, as the reference dequantizes."""
    qweight, scales, zeros, _ = _weights(24, 256, 64, False, seed=9)
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(6))
    cfg = w4a16_gemv.make_config(16, 64, 1, num_warps=2, block_m=8)
    y = w4a16_gemm.w4a16_gemm(x, qweight, scales.float(), zeros, None, 64, None, cfg)
    ref = reference.w4a16_linear(x, qweight, scales.float(), zeros, None, 64)
    torch.testing.assert_close(y, ref, atol=1e-5 * ref.abs().max().item(), rtol=1e-5)


def test_w4a16_gemv_split_k_is_deterministic_and_leaves_counters_at_zero():
    """The last program of a tile adds the partials in split order: a second launch reuses the
    counters (reset by the first) and gives the same bits."""
    qweight, scales, zeros, _ = _weights(40, 512, 64, False)  # a partial second tile; a group a split
    x = torch.randn(2, 512)
    cfg = w4a16_gemv.make_config(32, 32, 8, num_warps=2)
    first = w4a16_gemm.w4a16_gemm(x, qweight, scales, zeros, None, 64, None, cfg)
    assert not split_k.COUNTERS[x.device].any()
    second = w4a16_gemm.w4a16_gemm(x, qweight, scales, zeros, None, 64, None, cfg)
    assert torch.equal(first, second)
    ref = reference.w4a16_linear(x, qweight, scales, zeros, None, 64)
    torch.testing.assert_close(first, ref, atol=1e-3 * ref.abs().max().item(), rtol=1e-3)


def test_w4a16_gemv_refuses_group_sizes_not_divisible_by_8():
    qweight, scales, zeros, _ = _weights(16, 48, 12, False)
    with pytest.raises(ValueError, match="divisible by 8"):
        w4a16_gemm.w4a16_gemm(
            torch.randn(1, 48), qweight, scales, zeros, None, 12, None, w4a16_gemv.make_config(16, 16, 1, 2)
        )


def test_dequantize_path_matches_reference():
    qweight, scales, zeros, p = _weights(40, 576, 64, True)
    x = torch.randn(5, 576)
    y = w4a16_gemm.w4a16_gemm(x, qweight, scales, zeros, p, 64, None, w4a16_gemm.DEQUANT)
    torch.testing.assert_close(
        y, reference.w4a16_linear(x, qweight, scales, zeros, p, 64), atol=1e-4, rtol=1e-4
    )
    w = w4a16_gemm.dequantize(qweight, scales, zeros, 64, torch.float32)
    assert torch.equal(w, reference.dequantize_int4(qweight, scales, zeros, 64))


@pytest.mark.parametrize(
    "cfg",
    [_cfg(16, 32, 64, 2), w4a16_gemv.make_config(32, 32, 2, num_warps=2), w4a16_gemm.DEQUANT],
    ids=["tile-split-k", "gemv", "dequant"],
)
def test_a_perm_may_read_fewer_columns_than_the_weight_has_inputs(cfg):  # type: ignore[no-untyped-def]
    """A row-parallel act-order shard (builder/quant.py row_layout) holds more inputs than its
    rank has activations: the perm maps its K = 256 inputs onto x's 192 columns (padding reads
    column 0 with a zero weight). Every path takes K from the weight, not from x."""
    qweight, scales, zeros, _ = _weights(40, 256, 64, False, seed=3)
    gen = torch.Generator().manual_seed(4)
    perm = torch.randint(0, 192, (256,), generator=gen).to(torch.int32)
    x = torch.randn(3, 192, generator=gen)
    y = w4a16_gemm.w4a16_gemm(x, qweight, scales, zeros, perm, 64, None, cfg)
    ref = reference.w4a16_linear(x, qweight, scales, zeros, perm, 64)
    assert y.shape == (3, 40)
    torch.testing.assert_close(y, ref, atol=1e-3 * ref.abs().max().item(), rtol=1e-3)


def test_launcher_refuses_mismatched_shapes():
    qweight, scales, zeros, _ = _weights(40, 576, 64, False)
    with pytest.raises(ValueError, match="qweight must be int32"):
        w4a16_gemm.w4a16_gemm(torch.randn(2, 512), qweight, scales, zeros, None, 64)
    with pytest.raises(ValueError, match="scales/zeros must be"):
        w4a16_gemm.w4a16_gemm(torch.randn(2, 576), qweight, scales, zeros, None, 32)
    with pytest.raises(ValueError, match="zeros must be int8"):
        w4a16_gemm.w4a16_gemm(torch.randn(2, 576), qweight, scales, zeros.to(torch.int32), None, 64)


def test_prune_keeps_dequant_and_fitting_tiles():
    decode = w4a16_gemm.prune_configs(w4a16_gemm.CONFIG_SPACE, 1, 6144, 4096)
    prefill = w4a16_gemm.prune_configs(w4a16_gemm.CONFIG_SPACE, 2048, 6144, 4096)
    assert w4a16_gemm.DEQUANT in decode and w4a16_gemm.DEQUANT in prefill
    gemv = [c for c in decode if w4a16_gemv.is_gemv(c)]
    # The GEMV first (a tie keeps it), few enough to time at every small bucket, splits that
    # give every multiprocessor a program and hold whole outer steps (K / 64 at most).
    assert gemv and decode[: len(gemv)] == gemv and len(gemv) <= 14
    assert all(-(-6144 // c["BLOCK_N"]) * c["SPLIT_K"] >= 132 and c["SPLIT_K"] <= 4096 // 64 for c in gemv)
    # The narrow tiles also reach several programs a multiprocessor (the H200's fastest at 1 row);
    # no launch is timed twice (at 4 rows BLOCK_K 64 and 32 both step 32).
    narrow = [c for c in gemv if (c["BLOCK_N"], c["BLOCK_K"], c.num_warps) in w4a16_gemv.NARROW_TILES]
    assert max(-(-6144 // c["BLOCK_N"]) * c["SPLIT_K"] for c in narrow) >= 4 * 132
    four_rows = w4a16_gemm.gemv_configs(4, 6144, 4096)
    assert not any(c["BLOCK_N"] == 512 and c["BLOCK_K"] == 32 and c.num_warps == 2 for c in four_rows)
    assert not any(
        w4a16_gemv.is_gemv(c) for c in w4a16_gemm.prune_configs(w4a16_gemm.CONFIG_SPACE, 16, 6144, 4096)
    )
    assert not any(w4a16_gemv.is_gemv(c) for c in prefill)
    decode = [c for c in decode if not w4a16_gemv.is_gemv(c)]
    assert all(c["BLOCK_M"] == 16 for c in decode if not w4a16_gemm.is_dequant(c))
    assert all(c["BLOCK_M"] >= 64 for c in prefill if not w4a16_gemm.is_dequant(c))
    assert any(c["SPLIT_K"] > 1 for c in decode if not w4a16_gemm.is_dequant(c))
    small_k = w4a16_gemm.prune_configs(w4a16_gemm.CONFIG_SPACE, 1, 64, 64)
    assert all(c["BLOCK_K"] <= 64 and c["SPLIT_K"] == 1 for c in small_k if not w4a16_gemm.is_dequant(c))


def _is_tile(config: KernelConfig) -> bool:
    """A tl.dot tile of _w4a16_gemm_kernel (not the dequant path, the GEMV or the tensor-core kernel)."""
    return not (w4a16_gemm.is_dequant(config) or w4a16_gemv.is_gemv(config) or w4a16_tcgemv.is_tcgemv(config))


def test_default_config_fits_shared_memory_with_the_half_defaults_unchanged():
    """The tile default fits SHARED_MEMORY_LIMIT for the activations' and scales' element sizes:
    fp32 with fp32 scales and a group size not a multiple of BLOCK_K pipelines 3 deep from 33 rows
    (64 x 64 x 128 needs 266240 bytes at 4 stages: the fp32 int4 engine test's failure on an H200);
    half types keep the measured 4-stage tiles at every group size."""
    shapes = [(5, 128, 384), (17, 128, 384), (33, 128, 384), (49, 6144, 4096), (256, 1728, 576)]
    for m, n, k in [*shapes, (40, 64, 192)]:
        bm = 16 if m <= 16 else (32 if m <= 32 else 64)
        bk = 128 if k >= 256 else 64
        for g in (32, 64, 128, k):
            half = w4a16_gemm.default_config(m, n, k, x_elt=2, scale_elt=2, group_size=g)
            assert half == w4a16_gemm.default_config(m, n, k), (m, n, k, g)
            tile = (half["BLOCK_M"], half["BLOCK_N"], half["BLOCK_K"], half.num_warps, half.num_stages)
            assert tile == (bm, 64, bk, 4, 4)
            fp32 = w4a16_gemm.default_config(m, n, k, x_elt=4, scale_elt=4, group_size=g)
            assert fp32.params == half.params and fp32.num_warps == 4
            assert w4a16_gemm.shared_memory(fp32, 4, 4, g) <= w4a16_gemm.SHARED_MEMORY_LIMIT
            per_input_scales = g % bk != 0
            assert fp32.num_stages == (3 if per_input_scales and bm == 64 and bk == 128 else 4), (m, n, k, g)
    assert w4a16_gemm.shared_memory(w4a16_gemm.default_config(49, 128, 384), 4, 4, 64) == 266240


def test_prune_drops_tiles_over_shared_memory(monkeypatch):  # type: ignore[no-untyped-def]
    """fp32 tiles over SHARED_MEMORY_LIMIT are not timed (the tuner would only see them fail);
    half types lose only the 128 x 128 x 128 tile with groups smaller than its BLOCK_K (245760
    bytes in bf16 on sm_90: it cannot run either)."""
    shapes = [(49, 128, 384), (300, 128, 384), (64, 6144, 4096), (2048, 6144, 4096)]
    sizes = [(4, 4, 64), (4, 4, 128), (4, 2, 64), (2, 2, 64), (2, 2, 128)]
    kept = {(s, z): w4a16_gemm.prune_configs(w4a16_gemm.CONFIG_SPACE, *s, x_elt=z[0], scale_elt=z[1],
                                               group_size=z[2]) for s in shapes for z in sizes}  # fmt: skip
    monkeypatch.setattr(w4a16_gemm, "SHARED_MEMORY_LIMIT", 1 << 30)
    for (shape, (x_elt, scale_elt, g)), configs in kept.items():
        unlimited = w4a16_gemm.prune_configs(
            w4a16_gemm.CONFIG_SPACE, *shape, x_elt=x_elt, scale_elt=scale_elt, group_size=g
        )
        dropped = [c for c in unlimited if c not in configs]
        assert configs == [c for c in unlimited if c not in dropped]
        assert all(w4a16_gemm.shared_memory(c, x_elt, scale_elt, g) > 232448 for c in dropped)
        tile_configs = [c for c in configs if _is_tile(c)]
        assert all(w4a16_gemm.shared_memory(c, x_elt, scale_elt, g) <= 232448 for c in tile_configs)
        tiles = {(c["BLOCK_M"], c["BLOCK_N"], c["BLOCK_K"]) for c in dropped}
        if x_elt == 2:
            assert tiles <= ({(128, 128, 128)} if g < 128 else set()), (shape, g, tiles)
        elif g == 64 and scale_elt == 4 and shape[0] == 49:
            assert tiles == {(64, 64, 128), (64, 128, 128)}, tiles  # the failing shape's


def test_tuning_problem_scales_are_the_artifacts():
    """The tuner times the W4A16 kernels with scales of the artifact's dtype (fp32 in an fp32
    artifact): with fp16 ones an fp32 tile compiled to 217088 bytes of shared memory while tuning
    and to 266240, over an H200's limit, in the engine. Its default and pruning size tiles the same."""
    from pagecast.builder.quant import scale_dtype_for
    from pagecast.kernels import problems
    from pagecast.kernels.tuning import ModelShapes

    for dtype in ("float32", "bfloat16", "float16"):
        shapes = ModelShapes(2, 1, 64, 128, 192, 16, dtype, quant_group_size=64)
        assert problems.w4a16_scale_dtype(shapes) == scale_dtype_for(dtype)
        elt, scale_elt = shapes.torch_dtype.itemsize, scale_dtype_for(dtype).itemsize
        for m in (49, 100):
            dims = {"num_rows": m, "n": 128, "k": 384}
            assert problems.default_config("w4a16_gemm", shapes, dims) == w4a16_gemm.default_config(
                m, 128, 384, x_elt=elt, scale_elt=scale_elt, group_size=64
            )
            tiles = [c for c in problems.config_space("w4a16_gemm", shapes, dims) if _is_tile(c)]
            assert tiles and all(w4a16_gemm.shared_memory(c, elt, scale_elt, 64) <= 232448 for c in tiles)


def test_tuner_times_the_down_projection_as_serving_runs_it(monkeypatch):  # type: ignore[no-untyped-def]
    """With kernels/ops.py FUSE_SILU_DOWN (the default) the tuner times each down bucket from
    gate_up rows [m, 2 * intermediate] through the fused entry point (silu_and_mul folded into the
    configs that can fold it), its reference with the activation kernel before cuBLAS, and marks
    the entry "fused_silu" (serving fuses only marked buckets, whose fused kernels the tuning
    compiled into the artifact); the other projections, and down with the flag off, as before."""
    from pagecast.kernels import activation, ops, problems
    from pagecast.kernels.tuning import ModelShapes

    calls: list[tuple[str, tuple[int, ...]]] = []
    monkeypatch.setattr(w4a16_gemm, "w4a16_silu_and_mul_gemm", lambda x, *a, **k: calls.append(("fused", tuple(x.shape))))
    monkeypatch.setattr(w4a16_gemm, "w4a16_gemm", lambda x, *a, **k: calls.append(("gemm", tuple(x.shape))))
    monkeypatch.setattr(activation, "silu_and_mul", lambda x, *a, **k: calls.append(("silu", tuple(x.shape))) or x[:, : x.shape[1] // 2])
    shapes = ModelShapes(2, 1, 64, 128, 192, 16, "float16", quant_group_size=64)
    dims = dict(problems.buckets("w4a16_gemm", shapes))
    cfg = w4a16_tcgemv.make_config(32, 64, 2, num_warps=2, sub_zeros=True)

    def timed(bucket: str) -> tuple[dict[str, bool], list[tuple[str, tuple[int, ...]]]]:
        calls.clear()
        problem = problems.make_problem("w4a16_gemm", shapes, dims[bucket], "cpu")
        problem.launch(cfg, 0)
        assert problem.reference is not None
        problem.reference(None, 0)
        return problem.marks, list(calls)

    assert ops.FUSE_SILU_DOWN
    assert timed("down.m4") == ({"fused_silu": True}, [("fused", (4, 384)), ("silu", (4, 384))])
    assert timed("gate_up.m4") == ({}, [("gemm", (4, 128))])
    monkeypatch.setattr(ops, "FUSE_SILU_DOWN", False)
    assert timed("down.m4") == ({}, [("gemm", (4, 192))])


def test_tuner_reaches_every_projections_decode_buckets_before_larger_ones():
    """The tuner takes buckets in order until its budget runs out: every projection's small row
    buckets (decode, where the int4 kernels' configs differ most) come before any larger bucket."""
    from pagecast.kernels import problems
    from pagecast.kernels.tuning import PROJECTIONS, ModelShapes

    shapes = ModelShapes(32, 8, 128, 4096, 14336, 16, "bfloat16", quant_group_size=128)
    order = [dims["num_rows"] for _, dims in problems.buckets("w4a16_gemm", shapes)]
    assert order == sorted(order)
    first = [name for name, _ in problems.buckets("w4a16_gemm", shapes)][: 2 * len(PROJECTIONS)]
    assert first == [f"{p}.m{m}" for m in (1, 2) for p in PROJECTIONS]


def compile_for_sm90() -> None:
    """Compile (not run) both kernels for an H100/H200 with Triton's bundled ptxas."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    signature = {
        "x_ptr": "*bf16", "qw_ptr": "*i32", "s_ptr": "*fp16", "z_ptr": "*i8", "perm_ptr": "*i32", "b_ptr": "*bf16",
        "y_ptr": "*fp32", "M": "i32", "N": "i32", "K": "i32", "stride_xm": "i32", "stride_ym": "i32",
        "stride_ys": "i32", **{c: "constexpr" for c in (
            "GROUP_SIZE", "HAS_PERM", "HAS_BIAS", "BLOCK_M", "BLOCK_N", "BLOCK_K", "SPLIT_K", "K_ITERS", "DOT_PRECISION"
        )},
    }  # fmt: skip
    for bm, bn, bk, split, g, perm in (
        (16, 64, 128, 4, 128, True),
        (128, 256, 64, 1, 64, False),
        (64, 128, 128, 1, 32, False),
    ):
        constants = {"GROUP_SIZE": g, "HAS_PERM": perm, "HAS_BIAS": split == 1, "BLOCK_M": bm, "BLOCK_N": bn,
                     "BLOCK_K": bk, "SPLIT_K": split, "K_ITERS": 8, "DOT_PRECISION": "tf32"}  # fmt: skip
        kernel = compile(
            ASTSource(w4a16_gemm._w4a16_gemm_kernel, signature, constants),
            target=GPUTarget("cuda", 90, 32),
            options={"num_warps": 8 if bm == 128 else 4, "num_stages": 3},
        )
        assert kernel.asm["cubin"]
    dq_sig = {"qw_ptr": "*i32", "s_ptr": "*fp16", "z_ptr": "*i8", "w_ptr": "*bf16", "N": "i32", "K": "i32",
              "GROUP_SIZE": "constexpr", "BLOCK_N": "constexpr", "BLOCK_K": "constexpr"}  # fmt: skip
    dq = compile(
        ASTSource(w4a16_gemm._dequantize_kernel, dq_sig, {"GROUP_SIZE": 64, "BLOCK_N": 64, "BLOCK_K": 64}),
        target=GPUTarget("cuda", 90, 32),
    )
    assert dq.asm["cubin"]


def test_kernels_compile_for_sm90():
    """The real compiler (not the interpreter, which accepts more) builds the kernels for sm_90,
    in a process without TRITON_INTERPRET; skipped where this triton has no ptxas."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    import triton

    if not list(Path(triton.__file__).parent.glob("backends/nvidia/bin/ptxas*")):
        pytest.skip("this triton build has no ptxas")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-c", "import test_quant_kernel as t; t.compile_for_sm90()"],
        check=False, cwd=Path(__file__).parent, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("m", [1, 2, 4, 7, 16, 64, 300, 2048])
@pytest.mark.parametrize("n,k,g", [(6144, 4096, 128), (4096, 14336, 128), (1728, 576, 64), (1536, 576, 32)])
def test_w4a16_gemm_bf16_on_gpu(m, n, k, g):  # type: ignore[no-untyped-def]
    """bf16 at Llama-3-8B and SmolLM2 shapes, every config the tuner may pick (the GEMV's with
    its inline PTX up to 8 rows), with bias and act-order, against the reference."""
    from pagecast.kernels import problems
    from pagecast.kernels.tuning import ModelShapes

    qweight, scales, zeros, _ = _weights(n, k, g, False, device="cuda")
    perm = torch.randperm(k, device="cuda").to(torch.int32)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    ref = reference.w4a16_linear(x.float(), qweight, scales, zeros, perm, g, bias.float())
    shapes = ModelShapes(32, 8, 128, k, n // 2, 16, "bfloat16", quant_group_size=g)
    configs = problems.config_space("w4a16_gemm", shapes, {"num_rows": m, "n": n, "k": k}) + [None]
    for cfg in configs:
        y = w4a16_gemm.w4a16_gemm(x, qweight, scales, zeros, perm, g, bias, cfg)
        torch.testing.assert_close(
            y.float(), ref, atol=2e-2 * ref.abs().max().item(), rtol=2e-2, msg=str(cfg)
        )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("m", [1, 3, 8, 49, 300])
@pytest.mark.parametrize("n,k,g", [(256, 128, 64), (128, 384, 64), (1728, 576, 64), (6144, 4096, 128)])
def test_w4a16_gemm_fp32_on_gpu(m, n, k, g):  # type: ignore[no-untyped-def]
    """fp32 activations and scales on the GPU, every config the tuner may pick (the CUDA-core GEMV
    with its inline PTX, the tl.dot tiles in ieee precision, dequantize + cuBLAS) and the default,
    against the reference to the CPU tests' fp32 tolerance: the path of the fp32 int4 engine test
    (test_quant_build.py::test_int4_greedy_matches_transformers_on_gpu; its tiny model's
    projections first), whose down projection (n 128, k 384) failed on an H200 with the default
    tile out of shared memory at 33-64 rows."""
    from pagecast.kernels import problems
    from pagecast.kernels.tuning import ModelShapes

    shapes = ModelShapes(4, 2, 32, k, n // 2, 16, "float32", quant_group_size=g)
    qweight, scales, zeros, _ = _weights(n, k, g, False, device="cuda")
    scales = scales.to(problems.w4a16_scale_dtype(shapes))  # fp32, as an fp32 artifact has them
    x = torch.randn(m, k, device="cuda", dtype=torch.float32)
    bias = torch.randn(n, device="cuda", dtype=torch.float32)
    configs = problems.config_space("w4a16_gemm", shapes, {"num_rows": m, "n": n, "k": k}) + [None]
    # Without a perm too (AWQ, as in the failing engine): with one the compiled tiles need less
    # shared memory (sm_90, fp32, 64 x 64 x 128, G 64, 4 stages: 111104 bytes, 266240 without).
    for perm in (None, torch.randperm(k, device="cuda").to(torch.int32)):
        ref = reference.w4a16_linear(x, qweight, scales, zeros, perm, g, bias)
        for cfg in configs:
            y = w4a16_gemm.w4a16_gemm(x, qweight, scales, zeros, perm, g, bias, cfg)
            torch.testing.assert_close(y, ref, atol=1e-3 * ref.abs().max().item(), rtol=1e-3, msg=str(cfg))
