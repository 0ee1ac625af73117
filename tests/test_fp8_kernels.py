"""The FP8 GEMM, activation quantisation and fused decode kernel (kernels/fp8_gemm.py) against the
pure-torch reference (kernels/reference.py): in Triton's interpreter on the CPU, compiled for sm_90
without a GPU, and on a GPU (marked gpu) also against torch._scaled_mm.

Triton 3.6's interpreter converts fp32 to e4m3 wrongly where rounding carries into the next
binade (124.3 becomes 64, not 128); kernels/interpreter_fix.py, which conftest applies, converts
with torch instead (round to nearest even, saturating), as the compiled kernel's
``cvt.rn.satfinite.e4m3x2.f32`` does (checked in the sm_90 PTX below), so on the CPU the
quantisation kernel's e4m3 values are checked bitwise too. The fused decode kernel quantises
inside the GEMM: in the interpreter it is checked against the reference on activations built so
that no conversion carries (written before that fix), against the two-launch path on random ones,
and fp8_linear end to end at the tiny Qwen3-MoE's shapes; on the GPU against the two-launch path at
Llama-3-8B's shapes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from pagecast.kernels import reference, split_k
from pagecast.kernels.quant_linear import Fp8LinearWeight

pytest.importorskip("triton")


def _weights(n: int, k: int, block: bool, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05
    return reference.quantize_fp8_groups(w) if block else reference.quantize_fp8_rows(w)


CASES = [  # (activations, m, n, k, config)
    ("token", 5, 72, 300, {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 128, "SPLIT_K": 1}),
    ("token", 3, 64, 384, {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 64, "SPLIT_K": 3}),
    ("static", 17, 40, 256, {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 128, "SPLIT_K": 1}),
    ("group", 5, 72, 300, {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 128, "SPLIT_K": 1}),
    ("group", 2, 40, 512, {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 64, "SPLIT_K": 2}),
]


@pytest.mark.parametrize(("activations", "m", "n", "k", "config"), CASES)
def test_fp8_gemm_matches_the_reference_in_the_interpreter(activations, m, n, k, config):  # type: ignore[no-untyped-def]
    from pagecast.kernels import fp8_gemm

    x = torch.randn(m, k, generator=torch.Generator().manual_seed(1)) * 3
    qw, sw = _weights(n, k, activations == "group")
    qx, sx = reference.quantize_fp8_activations(x, activations, torch.tensor([0.02]))
    bias = torch.randn(n)
    y = fp8_gemm.fp8_gemm(qx, sx, qw, sw, bias, torch.float32, config)
    ref = reference.fp8_gemm(qx, sx, qw, sw, bias, torch.float32)
    # Same products (exact in fp32), summed in another order.
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
    # And the emulation is the W8A8 product, not something else: close to the float one.
    wf = reference.dequantize_fp8(qw, sw)
    assert (ref - (x @ wf.t() + bias)).abs().max() < 0.1 * (x @ wf.t()).abs().max()


@pytest.mark.parametrize("activations", ["token", "group", "static"])
def test_activation_scales_match_the_reference_in_the_interpreter(activations):  # type: ignore[no-untyped-def]
    from pagecast.kernels import fp8_gemm

    x = torch.randn(6, 300, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16) * 5
    x[3] = 0  # a zero row: the scale is clamped, the values are 0
    q, s = fp8_gemm.quantize_activations(x, activations, torch.tensor([0.03]))
    rq, rs = reference.quantize_fp8_activations(x, activations, torch.tensor([0.03]))
    assert torch.equal(s, rs)
    assert q.dtype == torch.float8_e4m3fn and q.shape == rq.shape
    assert torch.equal(q.float(), rq.float())  # the e4m3 values too (interpreter_fix's conversion)
    assert torch.equal(q[3].float(), torch.zeros(300))


def test_activation_quantisation_is_bitwise_the_reference_in_the_interpreter() -> None:
    """The activation quantisation the dense FP8 GEMM and the fused MoE's tile path share gives the
    reference's bits: carries into the next binade, subnormals, saturation, and the sign of a value
    that rounds to zero (bits, not only values: -0 is 0x80)."""
    from pagecast.kernels import fp8_gemm

    x = torch.randn(9, 300, generator=torch.Generator().manual_seed(3)) * 3
    x[2] = 0
    # carries, subnormal, saturation, negatives that round to -0, and -0 itself
    x[4, :8] = torch.tensor([124.3, 1.9999, -15.9, 0.0005, 448.0, -600.0, -0.0001, -0.0])
    for acts in ("token", "group"):
        q, s = fp8_gemm.quantize_activations(x, acts)
        rq, rs = reference.quantize_fp8_activations(x, acts)
        assert torch.equal(s, rs) and torch.equal(q.view(torch.uint8), rq.view(torch.uint8)), acts


def test_the_interpreter_converts_to_and_from_e4m3_as_torch_does() -> None:
    """interpreter_fix (applied by conftest): in a kernel run by Triton's interpreter, fp32, fp16 and
    bf16 values round to e4m3 as torch rounds them (to nearest even, saturating at 448, NaN kept),
    including those whose rounding carries into the next binade (31.6 to 32: the unpatched
    interpreter gave 16), and e4m3 values widen exactly."""
    import triton
    import triton.language as tl

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the fix is for Triton's interpreter")

    @triton.jit
    def round_trip(x_ptr, q_ptr, y_ptr, n, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        mask = offs < n
        q = tl.load(x_ptr + offs, mask=mask).to(tl.float8e4nv)
        tl.store(q_ptr + offs, q, mask=mask)
        tl.store(y_ptr + offs, q.to(y_ptr.dtype.element_ty), mask=mask)

    special = [31.6, 124.7, -124.7, 15.5, 16.5, 17.0, 0.0, -0.0, 2.0**-9, 2.0**-10, 3 * 2.0**-10, 447.0, 460.0, 500.0,
               -1e6, float("inf"), float("nan")]  # fmt: skip
    values = torch.cat([torch.tensor(special), torch.randn(4000, generator=torch.Generator().manual_seed(0)) * 60])
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        x = values.to(dtype)
        q = torch.empty(x.shape, dtype=torch.float8_e4m3fn)
        y = torch.empty_like(x)
        round_trip[(1,)](x, q, y, x.numel(), BLOCK=triton.next_power_of_2(x.numel()))
        want = x.float().clamp(-448, 448).to(torch.float8_e4m3fn)
        assert torch.equal(q.view(torch.uint8), want.view(torch.uint8)), dtype
        assert torch.equal(y.float().nan_to_num(1234.0), want.float().nan_to_num(1234.0)), dtype  # NaN where NaN


def test_reference_block_scaling_scales_each_128_column_block_by_its_own_scales() -> None:
    """fp8_gemm's block path equals the dequantised product: sum over K of qx*sx[m, k//128] * qw*sw[n, k//128]."""
    qw, sw = _weights(24, 300, block=True)
    x = torch.randn(4, 300) * 2
    qx, sx = reference.quantize_fp8_groups(x)
    y = reference.fp8_gemm(qx, sx, qw, sw, None, torch.float32)
    xd = qx.double() * sx.double().repeat_interleave(128, 1)[:, :300]
    wd = qw.double() * sw.double().repeat_interleave(128, 1)[:, :300]
    torch.testing.assert_close(y.double(), xd @ wd.t(), rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------- the fused decode kernel

SKINNY = {"SKINNY": 1, "BLOCK_N": 32, "BLOCK_K": 128}


def _e4m3_rows(m: int, k: int, activations: str, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp32 x [m, k] whose quantisation the interpreter gets right, (x, its e4m3 values, the static
    scale). Each value is (v + d) * s: v an e4m3 value of magnitude 1..448, s a power of two per row
    (per 128-column group for "group", the fixed scale for "static"), d up to 0.45 of v's ulp, so
    x / s rounds to v without carrying into the next binade (d >= 0 where v is a power of two).
    Each row (group) holds one +-448 * s, so its amax / 448 is s exactly; a static row also holds
    values past 448 * s, which saturate; row 1 is zero (the MIN_AMAX clamp)."""
    g = torch.Generator().manual_seed(seed)
    mags = torch.tensor([2.0**e * (1 + f / 8) for e in range(9) for f in range(8)])
    mags = mags[mags <= 448]
    v = mags[torch.randint(len(mags), (m, k), generator=g)]
    ulp = 2.0 ** (torch.floor(torch.log2(v)) - 3)
    d = (torch.rand(m, k, generator=g) * 0.9 - 0.45) * ulp
    d = torch.where(v == 2.0 ** torch.log2(v).round(), d.abs(), d)
    d = torch.where(v == 448, -d.abs(), d)
    sign = torch.where(torch.rand(m, k, generator=g) < 0.5, -1.0, 1.0)
    if activations == "group":
        group = torch.arange(k) // 128
        v[:, torch.arange(0, k, 128)] = 448
        d[:, torch.arange(0, k, 128)] = 0
        s = 2.0 ** -torch.randint(0, 6, (m, group[-1] + 1), generator=g).float()
        s = s[:, group]
    elif activations == "token":
        v[:, 7], d[:, 7] = 448, 0
        s = 2.0 ** -torch.randint(0, 6, (m, 1), generator=g).float()
    else:
        s = torch.full((m, 1), 2.0**-5)
    x = sign * (v + d) * s
    q = sign * v
    if activations == "static":
        x[:, 3], x[:, 9] = 600 * 2.0**-5, -1e4 * 2.0**-5
        q[:, 3], q[:, 9] = 448, -448
    if m > 1:
        x[1], q[1] = 0, 0
    return x, q, torch.tensor([2.0**-5])


@pytest.mark.parametrize(
    ("activations", "m", "n", "k", "block_n", "block_k"),
    [
        ("token", 1, 72, 300, 32, 128),
        ("token", 5, 64, 512, 16, 256),
        ("token", 16, 40, 384, 64, 128),
        ("token", 1, 40, 2176, 16, 128),  # 17 steps: a second 16-step tile of the one row
        ("token", 2, 40, 1280, 32, 128),
        ("static", 3, 72, 256, 32, 256),
        ("static", 1, 32, 300, 16, 512),
        ("static", 4, 40, 1100, 32, 128),
        ("group", 7, 72, 300, 32, 128),
        ("group", 16, 48, 512, 16, 128),
    ],
)
def test_fused_decode_kernel_is_the_reference_where_the_interpreter_quantises_right(  # type: ignore[no-untyped-def]
    activations, m, n, k, block_n, block_k
):
    from pagecast.kernels import fp8_gemm

    x, q, inp = _e4m3_rows(m, k, activations, seed=m)
    qw, sw = _weights(n, k, activations == "group", seed=1)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(2))
    rq, _ = reference.quantize_fp8_activations(x, activations, inp)
    assert torch.equal(rq.float(), q)  # the construction quantises as intended
    cfg = {"SKINNY": 1, "BLOCK_N": block_n, "BLOCK_K": block_k}
    y = fp8_gemm.fp8_skinny_linear(x, qw, sw, activations, inp, bias, torch.float32, cfg)
    ref = reference.fp8_linear(x, qw, sw, activations, inp, bias)
    # The same e4m3 products (exact in fp32) and scales, summed in another order: a value rounded
    # the other way would move its output by ~1e-3 of the outputs' size.
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    if m > 1:
        assert torch.equal(y[1], bias)  # the zero row: scale clamped, values 0


@pytest.mark.parametrize("activations", ["token", "group", "static"])
@pytest.mark.parametrize(("m", "k"), [(1, 300), (1, 2200), (3, 1000), (6, 300), (16, 300)])
def test_fused_decode_kernel_matches_the_two_launch_path_in_the_interpreter(activations, m, k):  # type: ignore[no-untyped-def]
    """Random activations (rounding carries included): the fused kernel quantises as
    _quant_act_kernel does, so both paths agree even where the interpreter's conversion is off."""
    from pagecast.kernels import fp8_gemm

    n = 72
    x = (torch.randn(m, k + 20, generator=torch.Generator().manual_seed(m)) * 3)[:, 7 : 7 + k]  # rows k + 20 apart
    assert x.stride(0) == k + 20
    qw, sw = _weights(n, k, activations == "group")
    inp = torch.tensor([0.02])
    bias = torch.randn(n)
    y = fp8_gemm.fp8_skinny_linear(x, qw, sw, activations, inp, bias, torch.float32, SKINNY)
    qx, sx = fp8_gemm.quantize_activations(x, activations, inp)
    two = fp8_gemm.fp8_gemm(qx, sx, qw, sw, bias, torch.float32, {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 128, "SPLIT_K": 1})
    torch.testing.assert_close(y, two, rtol=1e-6, atol=1e-6 * two.abs().max().item())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_fused_decode_kernel_takes_and_returns_each_activation_dtype(dtype, monkeypatch):  # type: ignore[no-untyped-def]
    """fp8_linear runs the fused kernel for a SKINNY config, in and out in x's dtype (the e4m3 values
    times powers of two are exact in every one), without the separate quantisation launch."""
    from pagecast.kernels import fp8_gemm

    x, _, _ = _e4m3_rows(4, 256, "token", seed=5)
    x = (x.sign() * 2.0 ** torch.log2(x.abs()).round()).to(dtype)  # v + d -> a power of two: exact in fp16
    qw, sw = _weights(64, 256, block=False)
    weight = Fp8LinearWeight(qw, sw, None, "token")
    bias = torch.randn(64).to(dtype)
    called = []
    real = fp8_gemm.quantize_activations
    monkeypatch.setattr(fp8_gemm, "quantize_activations", lambda *a: called.append(a) or real(*a))
    y = fp8_gemm.fp8_linear(x, weight, bias, SKINNY)
    y_default = fp8_gemm.fp8_linear(x, weight, bias)  # untuned: the fused kernel up to 16 rows
    assert not called
    fp8_gemm.fp8_linear(x, weight, bias, {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 128, "SPLIT_K": 2})
    assert len(called) == 1  # the two-launch path does go through it
    assert y.dtype == dtype and y_default.dtype == dtype
    ref = reference.fp8_linear(x, qw, sw, "token", None, bias)
    torch.testing.assert_close(y, ref)
    torch.testing.assert_close(y_default, ref)


def test_skinny_configs_are_offered_up_to_16_rows_and_fall_back_past_them() -> None:
    from pagecast.kernels import fp8_gemm

    skinny = [c for c in fp8_gemm.CONFIG_SPACE if fp8_gemm.is_skinny(c)]
    split = [c for c in skinny if c.params.get("SPLIT_K", 1) > 1]
    assert 8 <= len(skinny) - len(split) <= 16 and 6 <= len(split) <= 12
    for m in (1, 16):
        kept = fp8_gemm.prune_configs(fp8_gemm.CONFIG_SPACE, m, 4096, 4096, False, torch.bfloat16)
        assert all(c in kept for c in skinny)
        block = [c for c in fp8_gemm.prune_configs(fp8_gemm.CONFIG_SPACE, m, 4096, 4096, True, torch.bfloat16) if fp8_gemm.is_skinny(c)]
        assert block and all(c["BLOCK_K"] == 128 for c in block)
        assert fp8_gemm.is_skinny(fp8_gemm.default_config(m, 4096, 4096, False, torch.bfloat16))
    assert not any(fp8_gemm.is_skinny(c) for c in fp8_gemm.prune_configs(fp8_gemm.CONFIG_SPACE, 17, 4096, 4096, False, torch.bfloat16))
    assert not fp8_gemm.is_skinny(fp8_gemm.default_config(17, 4096, 4096, False, torch.bfloat16))
    # A SKINNY entry met by more rows (or by fp8_gemm, whose x is quantised already) runs the tiles.
    x = torch.randn(20, 256, generator=torch.Generator().manual_seed(4))
    qw, sw = _weights(48, 256, block=False)
    y = fp8_gemm.fp8_linear(x, Fp8LinearWeight(qw, sw, None, "token"), None, SKINNY)
    qx, sx = fp8_gemm.quantize_activations(x, "token")
    torch.testing.assert_close(y, fp8_gemm.fp8_gemm(qx, sx, qw, sw, None, torch.float32, None), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(fp8_gemm.fp8_gemm(qx[:3], sx[:3], qw, sw, None, torch.float32, SKINNY), y[:3], rtol=1e-6, atol=1e-5)
    with pytest.raises(ValueError, match="BLOCK_K"):
        gw, gs = _weights(48, 256, block=True)
        fp8_gemm.fp8_skinny_linear(x[:2], gw, gs, "group", None, None, torch.float32, dict(SKINNY, BLOCK_K=256))


def _split(cfg: dict[str, int], split: int) -> dict[str, int]:
    return dict(cfg, SPLIT_K=split) if split > 1 else cfg


@pytest.fixture
def launches(monkeypatch):  # type: ignore[no-untyped-def]
    """(split, steps) of every fused launch, and the CPU's split-K counters fresh for the test."""
    from pagecast.kernels import fp8_gemm

    seen: list[tuple[int, int]] = []
    real = fp8_gemm._launch_skinny
    monkeypatch.setattr(split_k, "COUNTERS", {})
    monkeypatch.setattr(fp8_gemm, "_launch_skinny", lambda *a: seen.append((a[7], a[8])) or real(*a))
    return seen


def _cpu_counters() -> torch.Tensor:

    return split_k.COUNTERS[torch.device("cpu")]


SCHEMES = ("token", "group", "static")
_SPLIT_KS = [(1300, {2: 2, 3: 3, 4: 4}), (1024, {2: 2, 3: 3, 4: 4}), (384, {2: 2, 3: 3, 4: 3})]


# Every row count with every K, the activation schemes in turn: each pair of the three meets.
@pytest.mark.parametrize(
    ("activations", "m", "k", "splits"),
    [(SCHEMES[(i + j) % 3], m, k, splits) for i, m in enumerate([1, 3, 8, 16]) for j, (k, splits) in enumerate(_SPLIT_KS)],
)
def test_split_fused_decode_kernel_matches_the_unsplit_one_in_the_interpreter(activations, m, k, splits, launches):  # type: ignore[no-untyped-def]
    """SPLIT_K 2, 3 and 4 against SPLIT_K 1 (and the reference, on activations the interpreter
    quantises right): the same products and scales, the splits' fp32 partials added in another
    order. K = 1300 is 11 steps of 128 (6 + 5, 4 + 4 + 3, 3 + 3 + 3 + 2; a partial last step),
    1024 is 8 (3 + 3 + 2 for three splits), 384 is 3 steps: four splits would leave one without a
    step, so the launcher runs three. Row counts of 1, 3 and 8 put 16, 4 and 2 steps in one
    quantised tile, which a split of 2..6 steps cuts short. Each launch leaves the counters at zero."""
    from pagecast.kernels import fp8_gemm

    n = 72  # three column blocks of 32, the last partial
    x, q, inp = _e4m3_rows(m, k, activations, seed=m + k)
    qw, sw = _weights(n, k, activations == "group", seed=3)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(4))
    assert torch.equal(reference.quantize_fp8_activations(x, activations, inp)[0].float(), q)
    ref = reference.fp8_linear(x, qw, sw, activations, inp, bias)
    base = fp8_gemm.fp8_skinny_linear(x, qw, sw, activations, inp, bias, torch.float32, SKINNY)
    torch.testing.assert_close(base, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    for split, ran in splits.items():
        y = fp8_gemm.fp8_skinny_linear(x, qw, sw, activations, inp, bias, torch.float32, _split(SKINNY, split))
        assert launches[-1][0] == ran
        torch.testing.assert_close(y, base, rtol=1e-5, atol=1e-5 * base.abs().max().item(), msg=lambda s, sp=split: f"SPLIT_K {sp}: {s}")
        assert not _cpu_counters().any()
        if m > 1:
            assert torch.equal(y[1], bias)  # the zero row
    assert [sp for sp, _ in launches] == [1, *splits.values()]


@pytest.mark.parametrize(("k", "split", "steps"), [(300, 4, 1), (640, 4, 2), (640, 3, 2), (640, 2, 4)])
def test_split_fused_decode_kernel_takes_splits_without_a_step(k, split, steps, launches):  # type: ignore[no-untyped-def]
    """The kernel itself with a split past the last K step (which the launcher never sends: an
    empty partial, still counted): K = 300 is 3 steps over 4 splits of one, 640 is 5 steps over 4
    of two (the last split starts past the end), 3 of two and 2 of four (uneven, none empty)."""
    from pagecast.kernels import fp8_gemm

    m, n = 3, 40
    x, _, _ = _e4m3_rows(m, k, "token", seed=k)
    qw, sw = _weights(n, k, block=False, seed=5)
    bias = torch.randn(n)
    cfg = fp8_gemm.KernelConfig.coerce(_split(SKINNY, split))
    base = fp8_gemm.fp8_skinny_linear(x, qw, sw, "token", None, bias, torch.float32, SKINNY)
    y = torch.full((m, n), float("nan"))
    fp8_gemm._launch_skinny(x, qw, sw, sw, bias, y, 0, split, steps, cfg)
    torch.testing.assert_close(y, base, rtol=1e-5, atol=1e-5 * base.abs().max().item())
    assert not _cpu_counters().any()


def test_split_fused_decode_kernel_finishes_a_column_block_only_at_its_last_ticket(launches):  # type: ignore[no-untyped-def]
    """The interpreter runs the programs one after another, so the last to take a ticket is also the
    last to run; here column block 1's counter starts at -1, as if one of its programs were still
    to come: none of its programs draws ticket SPLIT_K - 1, so none writes its columns of y (they
    stay NaN) or resets its counter, while blocks 0 and 2 finish as usual. A kernel that let an
    earlier ticket sum the partials would write them."""
    from pagecast.kernels import fp8_gemm

    m, n, k, split = 2, 72, 1024, 4
    x, _, _ = _e4m3_rows(m, k, "token", seed=9)
    qw, sw = _weights(n, k, block=False, seed=9)
    cfg = fp8_gemm.KernelConfig.coerce(_split(SKINNY, split))
    base = fp8_gemm.fp8_skinny_linear(x, qw, sw, "token", None, None, torch.float32, SKINNY)
    counters = split_k.counters(torch.device("cpu"), 3, "test")
    counters[1] = -1
    y = torch.full((m, n), float("nan"))
    fp8_gemm._launch_skinny(x, qw, sw, sw, None, y, 0, split, 2, cfg)
    assert y[:, 32:64].isnan().all() and counters[1].item() == split - 1
    torch.testing.assert_close(y[:, :32], base[:, :32], rtol=1e-5, atol=1e-5 * base.abs().max().item())
    torch.testing.assert_close(y[:, 64:], base[:, 64:], rtol=1e-5, atol=1e-5 * base.abs().max().item())
    assert counters[0].item() == 0 and counters[2].item() == 0


def test_split_fused_launches_back_to_back_share_the_counters(launches):  # type: ignore[no-untyped-def]
    """Launches of different shapes, column tiles and splits one after another (as a model's
    projections run), each on counters the previous one left at zero: every result is right and
    the same result again bitwise. A counter left non-zero would let no program of that column
    block finish the next launch (its y stays NaN)."""
    from pagecast.kernels import fp8_gemm

    cases = [  # (activations, m, n, k, config)
        ("token", 3, 72, 1300, {"SKINNY": 1, "BLOCK_N": 32, "BLOCK_K": 128, "SPLIT_K": 4}),
        ("group", 1, 200, 1024, {"SKINNY": 1, "BLOCK_N": 64, "BLOCK_K": 128, "SPLIT_K": 2}),
        ("static", 16, 96, 1536, {"SKINNY": 1, "BLOCK_N": 16, "BLOCK_K": 256, "SPLIT_K": 3}),
    ]
    results = []
    for activations, m, n, k, cfg in cases * 2:
        x, _, inp = _e4m3_rows(m, k, activations, seed=n)
        qw, sw = _weights(n, k, activations == "group", seed=n)
        y = fp8_gemm.fp8_linear(x, Fp8LinearWeight(qw, sw, inp if activations == "static" else None, activations), None, cfg)
        ref = reference.fp8_linear(x, qw, sw, activations, inp, None)
        torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
        assert not _cpu_counters().any()
        results.append(y)
    assert [sp for sp, _ in launches] == [4, 2, 3] * 2
    for a, b in zip(results[:3], results[3:], strict=True):
        assert torch.equal(a, b)


def test_split_counters_grow_outside_capture_and_keep_the_outgrown_buffer(monkeypatch) -> None:  # type: ignore[no-untyped-def]

    monkeypatch.setattr(split_k, "COUNTERS", {})
    monkeypatch.setattr(split_k, "OUTGROWN", [])
    cpu = torch.device("cpu")
    first = split_k.counters(cpu, 10, "test")
    assert first.dtype == torch.int32 and first.numel() >= 1792 and not first.any()  # 28,672 columns / 16
    assert split_k.counters(cpu, first.numel(), "test") is first
    grown = split_k.counters(cpu, first.numel() + 1, "test")
    assert grown.numel() > first.numel() and split_k.OUTGROWN == [first]


def test_split_skinny_configs_keep_two_k_steps_a_split() -> None:
    from pagecast.kernels import fp8_gemm

    for k in (4096, 14336, 1024, 512):
        kept = [c for c in fp8_gemm.prune_configs(fp8_gemm.CONFIG_SPACE, 1, 4096, k, False, torch.bfloat16) if fp8_gemm.is_skinny(c)]
        for c in fp8_gemm.CONFIG_SPACE:
            if fp8_gemm.is_skinny(c) and c.params.get("SPLIT_K", 1) > 1:
                assert (c in kept) == (k // (c["BLOCK_K"] * c["SPLIT_K"]) >= 2), (k, c)
    # At Llama-3-8B's K every split config is kept; block scales keep the BLOCK_K 128 ones.
    kept = fp8_gemm.prune_configs(fp8_gemm.CONFIG_SPACE, 16, 4096, 4096, True, torch.bfloat16)
    block_split = [c for c in kept if fp8_gemm.is_skinny(c) and c.params.get("SPLIT_K", 1) > 1]
    assert block_split and all(c["BLOCK_K"] == 128 for c in block_split)
    assert fp8_gemm.default_config(1, 4096, 4096, False, torch.bfloat16).params.get("SPLIT_K", 1) == 1


# ---------------------------------------------------------------------------- sm_90 compile (no GPU)

CHILD = textwrap.dedent(
    """
    import json, re, subprocess, sys, tempfile
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    import triton.language as tl
    from pagecast.kernels import activation, fp8_gemm, rms_norm

    for job in sys.argv[1:]:
        name, sig, consts, divisible, options = json.loads(job)
        if "OUT_DTYPE" in consts:
            consts["OUT_DTYPE"] = getattr(tl, consts["OUT_DTYPE"])
        fn = {"gemm": fp8_gemm._fp8_gemm_kernel, "quant": fp8_gemm._quant_act_kernel,
              "skinny": fp8_gemm._fp8_skinny_kernel, "act_quant": activation._act_and_mul_fp8_kernel,
              "norm_quant": rms_norm._rms_norm_fp8_kernel}[name]
        attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in divisible}
        src = ASTSource(fn, signature=dict(sig, **{k: "constexpr" for k in consts}), constexprs=consts, attrs=attrs)
        c = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
        ptx = c.asm["ptx"]
        with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:  # registers and spills, as ptxas reports them
            f.write(ptx)
            f.flush()
            info = subprocess.run([knobs.nvidia.ptxas.path, "-v", "--gpu-name", "sm_90a", f.name, "-o", "/dev/null"],
                                  check=True, capture_output=True, text=True).stderr
        print(json.dumps({"cubin": "cubin" in c.asm, "shared": c.metadata.shared,
                          "regs": int(re.search(r"Used (\\d+) registers", info).group(1)),
                          "spills": int(re.search(r"(\\d+) bytes spill stores", info).group(1)),
                          "mma": sorted(set(re.findall(r"\\b(?:wg)?mma[.\\w]*", ptx))),
                          "cvt": sorted(set(re.findall(r"cvt[.\\w]*e4m3[.\\w]*", ptx))),
                          "sync": sorted(set(re.findall(r"\\b(?:atom|bar|fence|membar|ld\\.global\\.cg)[.\\w]*", ptx)))}))
    """
)

GEMM_SIG = {
    "a_ptr": "*fp8e4nv", "b_ptr": "*fp8e4nv", "as_ptr": "*fp32", "bs_ptr": "*fp32", "bias_ptr": "*bf16",
    "y_ptr": "*bf16", "M": "i32", "N": "i32", "K": "i32", "stride_ys": "i32",
}  # fmt: skip


def _compile(jobs: list[tuple[str, dict, dict, list[str], dict]]) -> list[dict]:  # type: ignore[type-arg]
    pytest.importorskip("triton.backends.nvidia.compiler")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, *[json.dumps(j) for j in jobs]],
        check=False, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def test_fp8_kernels_compile_for_sm90_with_wgmma_and_saturating_e4m3_conversion() -> None:
    def gemm(block_scaled: bool, bm: int, split: int, stages: int) -> tuple[str, dict, dict, list[str], dict]:  # type: ignore[type-arg]
        consts = {
            "BLOCK_SCALED": block_scaled, "STATIC_A": False, "HAS_BIAS": split == 1, "BLOCK_M": bm, "BLOCK_N": 128,
            "BLOCK_K": 128, "SPLIT_K": split, "K_ITERS": 32 // split, "GROUP_K": 128,
        }  # fmt: skip
        sig = dict(GEMM_SIG, y_ptr="*bf16" if split == 1 else "*fp32")
        return ("gemm", sig, consts, ["a_ptr", "b_ptr", "K", "N"], {"num_warps": 8 if bm == 128 else 4, "num_stages": stages})

    quant = (
        "quant",
        {"x_ptr": "*bf16", "q_ptr": "*fp8e4nv", "s_ptr": "*fp32", "K": "i32", "stride_xm": "i32"},
        {"MODE": 0, "GROUP_K": 128, "BLOCK": 1024, "NUM_BLOCKS": 4, "MIN_AMAX": 1e-12, "QMAX": 448.0},
        [],
        {"num_warps": 4},
    )
    group = (quant[0], quant[1], dict(quant[2], MODE=1), [], quant[4])
    out = _compile([gemm(False, 64, 1, 1), gemm(False, 64, 1, 3), gemm(True, 128, 1, 3), gemm(False, 16, 4, 4), quant, group])
    single, staged, block, decode, q_token, q_group = out
    for r in out:
        assert r["cubin"]
    # The prefill tiles run Hopper's fp8 wgmma; the loads are pipelined (shared memory per stage).
    assert any(i.startswith("wgmma") and "e4m3.e4m3" in i for i in single["mma"] + block["mma"])
    assert staged["shared"] >= 3 * single["shared"] - 1024
    # 16-row decode tiles are below wgmma's 64: Triton converts the e4m3 operands to fp16 in
    # registers (exact) and runs mma.sync; decode is bound by the weight bytes, which stay fp8.
    assert any(i.startswith("mma.sync") for i in decode["mma"]) and "cvt.rn.f16x2.e4m3x2" in decode["cvt"]
    # x / scale saturated to the e4m3 range and rounded to nearest even, as torch's cast of the clamped value.
    assert q_token["cvt"] == ["cvt.rn.satfinite.e4m3x2.f32"] and q_group["cvt"] == ["cvt.rn.satfinite.e4m3x2.f32"]


SKINNY_SIG = {
    "x_ptr": "*bf16", "w_ptr": "*fp8e4nv", "ws_ptr": "*fp32", "xs_ptr": "*fp32", "bias_ptr": "*bf16", "y_ptr": "*bf16",
    "part_ptr": "*fp32", "count_ptr": "*i32", "r_ptr": "*bf16", "g_ptr": "*bf16", "stream_ptr": "*bf16", "M": "i32",
    "N": "i32", "K": "i32", "stride_xm": "i32", "stride_rm": "i32", "STEPS": "i32", "eps": "fp32",
}  # fmt: skip


def test_fused_decode_kernel_compiles_for_sm90_in_every_config_without_spilling() -> None:
    """Every SKINNY config the tuner may time, in each activation mode (and with the residual add
    and RMSNorm inside, per token and per group, and with SiLU or GELU-tanh gating the input per
    token): e4m3 operands into mma.sync (16 rows, below
    wgmma's 64), the activations converted with the saturating round-to-nearest-even cvt in the
    kernel itself, within Hopper's 227 KB of shared memory per block and without register spills.
    The split configs take their ticket with an acq_rel atomic at GPU scope after a CTA barrier,
    and read the partials from L2 (ld.global.cg); unsplit ones have no atomic."""
    from pagecast.kernels import fp8_gemm

    jobs = []
    # (mode, NORM, ACT, rows): 1 row puts 16 steps in a tile, 16 rows one (the most registers live);
    # the 16-step tiles in the plain per-token mode and with the norm inside (the most code a step)
    for mode, norm, act, all_rows in ((0, 0, -1, (1, 16)), (1, 0, -1, (16,)), (2, 0, -1, (16,)), (0, 2, -1, (1, 16)),
                                      (1, 2, -1, (16,)), (0, 0, 0, (16,)), (0, 0, 1, (16,))):  # fmt: skip
        for cfg in fp8_gemm.prune_configs(fp8_gemm.CONFIG_SPACE, 16, 4096, 4096, mode == 1, torch.bfloat16):
            for rows in all_rows if fp8_gemm.is_skinny(cfg) else ():
                consts = {
                    "MODE": mode, "HAS_BIAS": mode == 2, "EVEN_K": True, "ROWS": rows, "BLOCK_M": 16,
                    "BLOCK_N": cfg["BLOCK_N"], "BLOCK_K": cfg["BLOCK_K"], "SPLIT_K": cfg.params.get("SPLIT_K", 1),
                    "GROUP_K": 128, "MIN_AMAX": 1e-12, "QMAX": 448.0, "NORM": norm, "ACT": act, "PASS_AHEAD": True,
                }  # fmt: skip
                options = {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
                jobs.append(("skinny", SKINNY_SIG, consts, ["x_ptr", "w_ptr", "K", "N", "stride_xm"], options))
    assert len(jobs) >= 48 and sum(j[2]["SPLIT_K"] > 1 for j in jobs) >= 24
    for job, r in zip(jobs, _compile(jobs), strict=True):
        assert r["cubin"], job
        assert any(i.startswith("mma.sync") for i in r["mma"]) and "cvt.rn.f16x2.e4m3x2" in r["cvt"], job
        assert "cvt.rn.satfinite.e4m3x2.f32" in r["cvt"], job
        # GELU's tanh (gate and up tiles, exp) at 16 rows in the 32 x 256 split tiles: 8 bytes spilled
        allowed = 8 if job[2]["ACT"] == 1 else 0
        assert 0 < r["shared"] <= 227 * 1024 and r["spills"] <= allowed and r["regs"] <= 255, (job, r)
        atomics = [i for i in r["sync"] if i.startswith("atom")]
        if job[2]["SPLIT_K"] == 1:
            assert not atomics, (job, r["sync"])
        else:
            assert any(".acq_rel" in i and ".gpu" in i and ".add" in i for i in atomics), (job, r["sync"])
            assert any(i.startswith("bar.sync") for i in r["sync"]) and any(i.startswith("ld.global.cg") for i in r["sync"]), (job, r["sync"])


def test_input_quantising_kernels_compile_for_sm90_without_spilling() -> None:
    """act_and_mul_fp8's kernel as its launcher launches it for bf16 rows of Llama-3-8B's 14,336
    (one pass, the row held in registers: 16,384 columns over 16 warps), half that (TP 2) and
    SmolLM2's 1,536 per token, and per 1x128 group and static scale; rms_norm_fp8's at hidden 4,096
    (each scheme), 576 per group and 8,192 (16 warps): no register spills, the saturating round-to-nearest-even
    e4m3 conversion."""
    from pagecast.kernels import activation

    sig = {"x_ptr": "*bf16", "q_ptr": "*fp8e4nv", "s_ptr": "*fp32", "stride_x": "i32", "d": "i32"}
    jobs = []
    for d, mode in ((14336, 0), (7168, 0), (1536, 0), (14336, 1), (14336, 2)):
        block = min(activation.FP8_ROW_BLOCK_MAX, 1 << (d - 1).bit_length()) if mode == 0 else 128
        warps = max(4, min(16, block // 1024)) if mode == 0 else 1
        consts = {"ACT": 0, "MODE": mode, "GROUP_K": 128, "BLOCK": block, "NUM_BLOCKS": -(-d // block),
                  "MIN_AMAX": 1e-12, "QMAX": 448.0}  # fmt: skip
        jobs.append(("act_quant", sig, consts, ["x_ptr", "q_ptr", "stride_x", "d"], {"num_warps": warps}))
    norm_sig = {"x_ptr": "*bf16", "residual_ptr": "*bf16", "weight_ptr": "*bf16", "q_ptr": "*fp8e4nv", "s_ptr": "*fp32",
                "residual_out_ptr": "*bf16", "stride_x": "i32", "stride_r": "i32", "stride_ro": "i32", "hidden": "i32",
                "eps": "fp32"}  # fmt: skip
    # (8,192 at 8 warps, 32 values a thread, spilled 4 bytes in this compile: 16 warps there)
    for hidden, mode, add, warps in ((4096, 0, True, 8), (4096, 1, True, 4), (4096, 2, False, 8), (576, 1, False, 4),
                                     (8192, 0, True, 16)):  # fmt: skip
        consts = {"BLOCK": max(128, 1 << (hidden - 1).bit_length()), "ADD_RESIDUAL": add, "OUT_DTYPE": "bfloat16",
                  "MODE": mode, "GROUP_K": 128, "MIN_AMAX": 1e-12, "QMAX": 448.0}  # fmt: skip
        jobs.append(("norm_quant", norm_sig, consts, ["x_ptr", "q_ptr", "stride_x", "hidden"], {"num_warps": warps}))
    for job, r in zip(jobs, _compile(jobs), strict=True):
        assert r["cubin"] and r["spills"] == 0, (job, r)
        assert r["cvt"] == ["cvt.rn.satfinite.e4m3x2.f32"], (job, r)


# ---------------------------------------------------------------------------- on the GPU


def _cuda() -> torch.device:
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("needs a GPU of compute capability 8.9 or newer")
    return torch.device("cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("activations", ["token", "group", "static"])
@pytest.mark.parametrize("m", [1, 7, 64, 300])
def test_gpu_activation_quantisation_is_bitwise_the_reference(activations, m):  # type: ignore[no-untyped-def]
    from pagecast.kernels import fp8_gemm

    dev = _cuda()
    x = (torch.randn(m, 4096 + 64, device=dev) * 3).to(torch.bfloat16)
    inp = torch.tensor([0.02], device=dev)
    q, s = fp8_gemm.quantize_activations(x, activations, inp)
    rq, rs = reference.quantize_fp8_activations(x, activations, inp)
    assert torch.equal(s, rs)
    assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8))


@pytest.mark.gpu
@pytest.mark.parametrize("activations", ["token", "group", "static"])
@pytest.mark.parametrize(("m", "d"), [(1, 14336), (64, 14336), (300, 7168), (17, 1536)])
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_gpu_activation_and_quantisation_in_one_launch_are_bitwise_the_two_launches(activations, m, d, activation):  # type: ignore[no-untyped-def]
    """activation.act_and_mul_fp8 in bf16 on the GPU: the bits and scales of the activation's
    launch then fp8_gemm.quantize_activations, at Llama-3-8B's intermediate (the row in one
    block), half of it (TP 2) and SmolLM2's."""
    from pagecast.kernels import activation as act_kernels
    from pagecast.kernels import fp8_gemm

    dev = _cuda()
    x = (torch.randn(m, 2 * d, device=dev) * 3).to(torch.bfloat16)
    inp = torch.tensor([0.02], device=dev)
    two = act_kernels.silu_and_mul(x) if activation == "silu" else act_kernels.gelu_tanh_and_mul(x)
    rq, rs = fp8_gemm.quantize_activations(two, activations, inp)
    q, s = act_kernels.act_and_mul_fp8(x, activation, activations, inp)
    assert torch.equal(s, rs)
    assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8))


@pytest.mark.gpu
@pytest.mark.parametrize("activations", ["token", "group", "static"])
@pytest.mark.parametrize(("m", "hidden"), [(17, 4096), (300, 2048), (64, 576)])
def test_gpu_norm_and_quantisation_in_one_launch_are_bitwise_the_two_launches(activations, m, hidden):  # type: ignore[no-untyped-def]
    """rms_norm.rms_norm_fp8 in bf16 on the GPU, with the residual add and without (layer 0): the
    bits, scales and residual stream of the norm's launch then fp8_gemm.quantize_activations, at
    Llama-3-8B's hidden, Qwen3-30B-A3B's and SmolLM2's (not a multiple of the 128-column group)."""
    dev = _cuda()
    x, r = ((torch.randn(m, hidden, device=dev) * 3).to(torch.bfloat16) for _ in range(2))
    w = torch.randn(hidden, device=dev).to(torch.bfloat16)
    _assert_norm_fp8_gives_the_two_launches(x, r, w, activations, torch.tensor([0.02], device=dev))


@pytest.mark.gpu
@pytest.mark.parametrize("activations", ["token", "group", "static"])
@pytest.mark.parametrize("hidden", [256, 576])
def test_gpu_norm_and_quantisation_in_one_launch_in_fp32_under_every_config(activations, hidden):  # type: ignore[no-untyped-def]
    """The same in fp32 (the tiny engines of the GPU parity tests) at 120 rows, under every config
    the tuner may give the norm at this hidden size (at 256 the pruned space keeps only one warp),
    as ops.norm_linear runs rms_norm_fp8 with the norm's tuned config: equal but for ulps (fp32's
    bounds in _assert_norm_fp8_gives_the_two_launches)."""
    from pagecast.kernels import rms_norm

    dev = _cuda()
    g = torch.Generator(device=dev).manual_seed(1)
    x, r = (torch.randn(120, hidden, generator=g, device=dev) * 3 for _ in range(2))
    w = torch.randn(hidden, generator=g, device=dev)
    configs = [None, *rms_norm.prune_configs(rms_norm.CONFIG_SPACE, hidden)]
    for cfg in configs:
        _assert_norm_fp8_gives_the_two_launches(x, r, w, activations, torch.tensor([0.02], device=dev), cfg)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("m", [120, 8, 1])
@pytest.mark.parametrize(("n", "k"), [(128, 256), (256, 64)], ids=["qkv", "o"])
def test_fp8_linear_in_fp32_under_every_config_at_the_tiny_moe_shapes(device, m, n, k):  # type: ignore[no-untyped-def]
    """fp32 rows through fp8_linear (activation quantisation, then the GEMM) under every config the
    tuner may give these buckets, at the dense projections of the tiny Qwen3-MoE whose tuned fp32
    engine an H100 found off (thirtieth session): qkv [128, 256], and o [256, 64], whose K of 64 is
    under most configs' BLOCK_K, so each K step is half masked; the other FP8 GPU tests run bf16 at K
    of 576 and more. On the CPU through the interpreter (its e4m3 conversion mended by
    interpreter_fix), on the GPU compiled."""
    from pagecast.kernels import fp8_gemm

    dev = _cuda() if device == "cuda" else torch.device("cpu")
    g = torch.Generator(device=dev).manual_seed(0)
    qw, sw = reference.quantize_fp8_rows(torch.randn(n, k, generator=g, device=dev) * 0.05)
    weight = Fp8LinearWeight(qw, sw, None, "token")
    x = torch.randn(m, k, generator=g, device=dev) * 3
    ref = reference.fp8_linear(x, qw, sw, "token")
    w, x_amax = reference.dequantize_fp8(qw, sw), x.abs().amax(1)
    configs = [None, *(c.as_dict() for c in fp8_gemm.prune_configs(fp8_gemm.CONFIG_SPACE, m, n, k, False, torch.float32))]
    for cfg in configs:
        y = fp8_gemm.fp8_linear(x, weight, None, cfg)
        # exact products summed in another order, and an activation the kernel's scale rounds to the
        # other e4m3 value now and then; a wrong scale, index or mask moves outputs by their own size
        _assert_close_but_for_a_few_e4m3_flips(y, ref, w, x_amax, f"config {cfg}")


def _gpu_configs(m: int, block: bool) -> list[dict[str, int] | None]:
    from pagecast.kernels import fp8_gemm

    configs: list[dict[str, int] | None] = [None]
    for cfg in fp8_gemm.prune_configs(fp8_gemm.CONFIG_SPACE, m, 4096, 4096, block, torch.bfloat16):
        configs.append(cfg.as_dict())
    return configs


@pytest.mark.gpu
@pytest.mark.parametrize("activations", ["token", "group", "static"])
@pytest.mark.parametrize(("m", "n", "k"), [(1, 6144, 4096), (16, 4096, 4096), (256, 28672, 4096), (2048, 4096, 14336), (5, 1000, 576)])
def test_gpu_fp8_gemm_matches_the_reference_for_every_config(activations, m, n, k):  # type: ignore[no-untyped-def]
    from pagecast.kernels import fp8_gemm

    dev = _cuda()
    block = activations == "group"
    g = torch.Generator(device=dev).manual_seed(0)
    w = torch.randn(n, k, generator=g, device=dev) * 0.02
    qw, sw = reference.quantize_fp8_groups(w) if block else reference.quantize_fp8_rows(w)
    weight = Fp8LinearWeight(qw, sw, torch.tensor([0.05], device=dev) if activations == "static" else None, activations)
    x = torch.randn(m, k, generator=g, device=dev).to(torch.bfloat16)
    bias = torch.randn(n, generator=g, device=dev).to(torch.bfloat16)
    ref = reference.fp8_linear(x, qw, sw, activations, weight.input_scale, bias).float()
    for cfg in _gpu_configs(m, block):
        y = fp8_gemm.fp8_linear(x, weight, bias, cfg).float()
        # bf16 output: one rounding of the same sum in another order, and Hopper's fp8 wgmma adds
        # its products in less than fp32 precision. At K = 14,336 that leaves ~1e-6 of the outputs
        # (those near zero) a few 1e-3 from the fp32 reference, as torch._scaled_mm's are (measured on
        # an H200): the absolute tolerance scales with the output's magnitude, far below a wrong scale
        # or index, which moves outputs by their own size.
        scale = ref.abs().max().item()
        atol = max(1e-3, 2e-3 * scale)
        if _fast_accumulation(cfg, m, n, k, block):
            # cuBLASLt's fast accumulation never promotes to fp32: 2.1e-3 (K 4,096) and 3.3e-3
            # (K 14,336) relative (Frobenius) from the exact sum on an H100, against bf16 rounding's
            # 1.7e-3 (benchmarks/fp8_fast_accum.py, forty-second session); its largest element errors
            # reach ~3e-3 of the largest output. Held to 6e-3 whole and 5e-3 of the largest output
            # per element: a wrong scale or index is off by the output's own size.
            assert ((y - ref).norm() / ref.norm()).item() < 6e-3, f"config {cfg}"
            atol = max(1e-3, 5e-3 * scale)
        torch.testing.assert_close(y, ref, rtol=1.6e-2, atol=atol, msg=f"config {cfg}")


def _fast_accumulation(cfg: dict[str, int] | None, m: int, n: int, k: int, block: bool) -> bool:
    """Whether ``cfg`` (None: the launcher's default) runs torch._scaled_mm with fast accumulation."""
    from pagecast.kernels import fp8_gemm
    from pagecast.kernels.tuning import KernelConfig

    chosen = KernelConfig.coerce(cfg) or fp8_gemm.default_config(m, n, k, block, torch.bfloat16)
    return fp8_gemm.is_scaled_mm(chosen) and bool(chosen.params.get("fast_accum")) and fp8_gemm.FAST_ACCUM


@pytest.mark.gpu
def test_gpu_fp8_gemm_agrees_with_torch_scaled_mm() -> None:
    from pagecast.kernels import fp8_gemm

    dev = _cuda()
    m, n, k = 64, 4096, 4096
    g = torch.Generator(device=dev).manual_seed(1)
    qw, sw = reference.quantize_fp8_rows(torch.randn(n, k, generator=g, device=dev) * 0.02)
    qx, sx = reference.quantize_fp8_rows(torch.randn(m, k, generator=g, device=dev))
    tile = fp8_gemm.fp8_gemm(qx, sx, qw, sw, None, torch.bfloat16, {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 128, "SPLIT_K": 1})
    scaled = torch._scaled_mm(qx, qw.t(), scale_a=sx[:, None], scale_b=sw[None, :], out_dtype=torch.bfloat16)
    via_config = fp8_gemm.fp8_gemm(qx, sx, qw, sw, None, torch.bfloat16, fp8_gemm.SCALED_MM)
    torch.testing.assert_close(tile.float(), scaled.float(), rtol=1.6e-2, atol=1e-3)
    assert torch.equal(via_config, scaled)


@pytest.mark.gpu
def test_gpu_fp8_linear_is_capture_safe() -> None:
    from pagecast.kernels import fp8_gemm

    dev = _cuda()
    qw, sw = reference.quantize_fp8_rows(torch.randn(1024, 512, device=dev) * 0.02)
    weight = Fp8LinearWeight(qw, sw, None, "token")
    x = torch.randn(8, 512, device=dev).to(torch.bfloat16)
    cfg = {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "SPLIT_K": 2}
    eager = fp8_gemm.fp8_linear(x, weight, None, cfg)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fp8_gemm.fp8_linear(x, weight, None, cfg)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)


def test_report_lists_each_bucket_with_the_scaled_mm_time_and_roofline_fraction() -> None:
    """report.md's FP8 table from a tuning table as the tuner writes it (no GPU needed)."""
    from pagecast.builder import fp8
    from pagecast.kernels.tuning import ModelShapes

    shapes = ModelShapes(num_heads=32, num_kv_heads=8, head_dim=128, hidden=4096, intermediate=14336, block_size=16,
                         fp8="channel-token")  # fmt: skip
    table = {
        "device": "NVIDIA H200", "copy_bandwidth_gbs": 4000.0,
        "shapes": {**shapes.__dict__, "dtype": "bfloat16", "kv_cache_dtype": "bfloat16"},
        "kernels": {"fp8_gemm": {
            "qkv.m1": {"config": {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "SPLIT_K": 4, "num_warps": 4, "num_stages": 4},
                       "time_us": 12.6, "reference_us": 14.0, "apart_us": 13.4,
                       "alternatives": [{"config": {"scaled_mm": 1, "num_warps": 0, "num_stages": 0}, "time_us": 14.0},
                                        {"config": {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 128, "SPLIT_K": 4}, "time_us": 13.1}]},
            "down.m8192": {"config": {"scaled_mm": 1, "num_warps": 0, "num_stages": 0}, "time_us": 900.0, "reference_us": 900.0,
                           "alternatives": [{"config": {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 128, "SPLIT_K": 1}, "time_us": 951.3},
                                            {"config": {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 128, "SPLIT_K": 1}, "time_us": 1003.0}]},
            "up.m16": {"config": {"scaled_mm": 1, "num_warps": 0, "num_stages": 0}, "time_us": 30.0, "reference_us": 30.0,
                       "pinned": True, "alternatives": []},
            "o.m1024": {"config": {"scaled_mm": 1, "fast_accum": 1, "num_warps": 0, "num_stages": 0}, "time_us": 28.9,
                        "reference_us": 31.2, "alternatives": [{"config": {"scaled_mm": 1, "num_warps": 0, "num_stages": 0}, "time_us": 31.2}]},
            "down.m1": {"config": {"SKINNY": 1, "BLOCK_N": 64, "BLOCK_K": 128, "SPLIT_K": 4, "num_warps": 4, "num_stages": 4},
                        "time_us": 29.9, "reference_us": 40.0, "apart_us": 28.1, "feed_apart": True, "alternatives": []},
        }},
    }  # fmt: skip
    cfg = fp8.read_config(None, "fp8")
    assert cfg is not None
    lines = fp8.report_lines(table, cfg)
    header = "| projection.rows | chosen | time (us) | best Triton tile (us) | reference (us) | roofline fraction | input apart (us) |"
    assert header in lines
    # qkv at one row moves 6144 x 4096 fp8 bytes (+ scales, rows): ~25.2 MB at 4 TB/s is 6.3 us of 12.6.
    # A Triton tile won: it is the best Triton time.
    assert any(line.startswith("| qkv.m1 | BLOCK_M=16") and line.endswith("| 12.6 | 12.6 | 14.0 | 0.50 | 13.4 |") for line in lines)
    # down at one row ran faster with its activation in a launch of its own: kept, and said so
    assert any(line.startswith("| down.m1 | SKINNY=1") and line.endswith("| 29.9 | 29.9 | 40.0 | 0.49 | 28.1 (kept) |") for line in lines)
    # down at 8192 rows: 2 * 8192 * 4096 * 14336 FLOPs at 1979 TFLOP/s is 486 us of 900. torch._scaled_mm
    # won: the fastest Triton alternative's time is shown beside it.
    assert "| down.m8192 | torch._scaled_mm | 900.0 | 951.3 | 900.0 | 0.54 | - |" in lines
    # No Triton config timed (a pinned bucket runs its config alone).
    assert any(line.startswith("| up.m16 | torch._scaled_mm | 30.0 | - | 30.0 |") for line in lines)
    # Fast accumulation won against the promoted reference: the report names it.
    assert any(line.startswith("| o.m1024 | torch._scaled_mm, fast accumulation | 28.9 | - | 31.2 |") for line in lines)


@pytest.mark.parametrize("fast", [False, True], ids=["promoted", "fast-accum"])
@pytest.mark.parametrize("activations", ["token", "static"])
def test_scaled_mm_config_computes_the_reference_product(activations, fast):  # type: ignore[no-untyped-def]
    """The tuner's {"scaled_mm": 1} choices (with and without fast accumulation) pass the scales
    as torch._scaled_mm wants them (rowwise [M, 1] x [1, N]; a static scale expanded to every
    row). torch runs it on the CPU too (where fast accumulation changes nothing)."""
    from pagecast.kernels import fp8_gemm

    qw, sw = _weights(64, 256, block=False)
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(3))
    qx, sx = reference.quantize_fp8_activations(x, activations, torch.tensor([0.01]))
    bias = torch.randn(64).to(torch.bfloat16)
    config = fp8_gemm.SCALED_MM_FAST if fast else fp8_gemm.SCALED_MM
    assert fp8_gemm.is_scaled_mm(config)
    y = fp8_gemm.fp8_gemm(qx, sx, qw, sw, bias, torch.bfloat16, config)
    ref = reference.fp8_gemm(qx, sx, qw, sw, bias, torch.float32)
    torch.testing.assert_close(y.float(), ref, rtol=1.6e-2, atol=1e-2)
    # fp16 output is not offered to it: the launcher falls back to the Triton tile.
    assert not fp8_gemm.scaled_mm_supported(5, 64, 256, False, torch.float16)


def _gpu_fp8_weight(n: int, k: int, activations: str, g: torch.Generator, dev: torch.device) -> Fp8LinearWeight:
    w = torch.randn(n, k, generator=g, device=dev) * 0.02
    qw, sw = reference.quantize_fp8_groups(w) if activations == "group" else reference.quantize_fp8_rows(w)
    return Fp8LinearWeight(qw, sw, torch.tensor([0.05], device=dev) if activations == "static" else None, activations)


@pytest.mark.gpu
@pytest.mark.parametrize("activations", ["token", "group", "static"])
@pytest.mark.parametrize(("n", "k"), [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)])
def test_gpu_fused_decode_kernel_matches_the_two_launch_path_in_every_config(activations, n, k):  # type: ignore[no-untyped-def]
    """Llama-3-8B's projections at 1, 4, 7 and 16 rows, every SKINNY config the tuner may pick,
    against quantize_activations + the tiled GEMM (SPLIT_K 1), both with fp32 output: the same
    e4m3 values and scales (the same arithmetic, compiled) and exact products, summed in another
    order (the tensor cores' fp32 chains within a step, then per step). One activation value
    rounded the other way typically moves its outputs by ~1e-4 of the largest output at K = 14,336
    (more at smaller K), a few times the tolerance; a wrong scale or index moves them by their size."""
    from pagecast.kernels import fp8_gemm

    dev = _cuda()
    g = torch.Generator(device=dev).manual_seed(3)
    weight = _gpu_fp8_weight(n, k, activations, g, dev)
    bias = torch.randn(n, generator=g, device=dev).to(torch.bfloat16)
    for m in (1, 4, 7, 16):
        x = (torch.randn(m, k, generator=g, device=dev) * 3).to(torch.bfloat16)
        qx, sx = fp8_gemm.quantize_activations(x, activations, weight.input_scale)
        tile = {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "SPLIT_K": 1}
        two = fp8_gemm.fp8_gemm(qx, sx, weight.weight, weight.weight_scale, bias, torch.float32, tile)
        two_bf16 = fp8_gemm.fp8_gemm(qx, sx, weight.weight, weight.weight_scale, bias, torch.bfloat16, tile).float()
        configs = [c for c in fp8_gemm.prune_configs(fp8_gemm.CONFIG_SPACE, m, n, k, activations == "group", torch.bfloat16)
                   if fp8_gemm.is_skinny(c)]  # fmt: skip
        assert configs
        for cfg in configs:
            y = fp8_gemm.fp8_skinny_linear(
                x, weight.weight, weight.weight_scale, activations, weight.input_scale, bias, torch.float32, cfg
            )
            atol = 3e-5 * two.abs().max().item()
            torch.testing.assert_close(y, two, rtol=1e-5, atol=atol, msg=lambda s, c=cfg, m=m: f"m={m} {c}: {s}")
            # Served as fp8_linear serves it: bf16 out, one rounding of nearly the same fp32 value.
            yb = fp8_gemm.fp8_linear(x, weight, bias, cfg).float()
            torch.testing.assert_close(yb, two_bf16, rtol=1.6e-2, atol=atol, msg=lambda s, c=cfg, m=m: f"m={m} {c}: {s}")


@pytest.mark.gpu
@pytest.mark.parametrize("activations", ["token", "group", "static"])
def test_gpu_fused_decode_kernel_is_capture_safe(activations):  # type: ignore[no-untyped-def]
    """Captured in a CUDA graph (no host syncs) and replayed on new rows in the captured buffer."""
    from pagecast.kernels import fp8_gemm

    dev = _cuda()
    g = torch.Generator(device=dev).manual_seed(4)
    weight = _gpu_fp8_weight(1024, 512, activations, g, dev)
    cfg = fp8_gemm.default_config(16, 1024, 512, activations == "group", torch.bfloat16)
    assert fp8_gemm.is_skinny(cfg)
    for m in (1, 16):
        x = torch.randn(m, 512, generator=g, device=dev).to(torch.bfloat16)
        fp8_gemm.fp8_linear(x, weight, None, cfg)  # compiled before capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fp8_gemm.fp8_linear(x, weight, None, cfg)
        x.copy_(torch.randn(m, 512, generator=g, device=dev).to(torch.bfloat16) * 4)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, fp8_gemm.fp8_linear(x, weight, None, cfg))


def _some_skinny_configs(m: int, n: int, k: int, block: bool) -> list:  # type: ignore[type-arg]
    """Two unsplit and two split SKINNY configs the tuner may time (each config a compile per
    variant: every one would take minutes of a GPU call)."""
    from pagecast.kernels import fp8_gemm

    configs = [c for c in fp8_gemm.prune_configs(fp8_gemm.CONFIG_SPACE, m, n, k, block, torch.bfloat16) if fp8_gemm.is_skinny(c)]
    unsplit = [c for c in configs if c.params.get("SPLIT_K", 1) == 1]
    split = [c for c in configs if c.params.get("SPLIT_K", 1) > 1]
    return unsplit[:1] + unsplit[-1:] + split[:1] + split[-1:]


def _assert_close_but_for_a_few_e4m3_flips(
    got: torch.Tensor, want: torch.Tensor, w: torch.Tensor, x_amax: torch.Tensor, what: str, flips: int = 3
) -> None:  # fmt: skip
    """got [M, N] against want, each row computed from activations that may differ in a few e4m3
    roundings: one activation j rounded to the neighbouring e4m3 value moves the row by c * W[:, j]
    (W [N, K] the dequantised weight), |c| at most an e4m3 step of the row's largest activation
    (x_amax [M]: 1/8 of it). Per row, up to ``flips`` such moves are found (the column that explains
    most of what is left, least squares) and taken off; every output must then be within 5e-4 of
    the largest and 1.6% of its own size (the bf16 output's rounding). A wrong rstd, weight or index
    moves the whole row along want, which no few columns explain. At a small K one flip moves most
    of a row past the tight bound (SmolLM2's 576 on an H100: 53 of 1,536 outputs), so counting the
    outputs outside is no test."""
    scale = want.abs().max().item()
    norms = w.pow(2).sum(0)  # [K]
    for row in range(got.shape[0]):
        left = got[row] - want[row]
        for _ in range(flips):
            if bool((left.abs() <= 5e-4 * scale + 1.6e-2 * want[row].abs()).all()):
                break
            coef = (w.t() @ left) / norms  # [K]: each column's least-squares share of what is left
            j = int(((coef * coef) * norms).argmax())
            assert abs(coef[j].item()) <= x_amax[row].item() / 8, f"{what}: row {row} moved by {coef[j].item()} along column {j}"
            left = left - coef[j] * w[:, j]
        outside = left.abs() > 5e-4 * scale + 1.6e-2 * want[row].abs()
        assert int(outside.sum()) == 0, f"{what}: row {row}: {int(outside.sum())} of {outside.numel()} outside after {flips} flips"


@pytest.mark.gpu
@pytest.mark.parametrize("activations", ["token", "group", "static"])
@pytest.mark.parametrize(("n", "k"), [(6144, 4096), (1536, 576)])
def test_gpu_norm_inside_the_fused_decode_kernel_matches_the_kernel_on_normalised_rows(activations, n, k):  # type: ignore[no-untyped-def]
    """Llama-3-8B's qkv (and one at SmolLM2's hidden size, 576) at 1, 3 and 16 rows in bf16, four
    SKINNY configs, with the residual add and without (layer 0): fp8_skinny_norm_linear against the
    same kernel without the norm on the rows normalised as reference.fp8_norm_linear does (in fp32),
    and the stream bitwise x + residual. The rstd differs from torch's in its last bits (another
    sum order, rsqrt.approx), which may round an activation to the other e4m3 value: up to three such
    flips a row are allowed (_assert_close_but_for_a_few_e4m3_flips); a wrong rstd, weight or index
    moves outputs by their size.
    Replayed in a CUDA graph on new rows, the same bits."""
    from pagecast.kernels import fp8_gemm

    dev = _cuda()
    g = torch.Generator(device=dev).manual_seed(5)
    weight = _gpu_fp8_weight(n, k, activations, g, dev)
    bias = torch.randn(n, generator=g, device=dev).to(torch.bfloat16)
    norm_w = (torch.rand(k, generator=g, device=dev) + 0.5).to(torch.bfloat16)
    w_deq = reference.dequantize_fp8(weight.weight, weight.weight_scale)
    for m in (1, 3, 16):
        x, r = ((torch.randn(m, k, generator=g, device=dev) * 3).to(torch.bfloat16) for _ in range(2))
        configs = _some_skinny_configs(m, n, k, activations == "group")
        assert configs
        for residual in (r, None):
            stream = x if residual is None else x + residual
            sf = stream.float()
            normed = (sf * norm_w.float()) * torch.rsqrt(sf.pow(2).mean(-1, keepdim=True) + 1e-6)
            for cfg in configs:
                y, got_stream = fp8_gemm.fp8_skinny_norm_linear(x, residual, norm_w, 1e-6, weight, bias, cfg)
                want = fp8_gemm.fp8_skinny_linear(
                    normed, weight.weight, weight.weight_scale, activations, weight.input_scale, bias, torch.bfloat16, cfg
                ).float()
                assert torch.equal(got_stream, stream)
                _assert_close_but_for_a_few_e4m3_flips(y.float(), want, w_deq, normed.abs().amax(-1), f"m={m} {cfg}")
    cfg = configs[0]
    y = fp8_gemm.fp8_skinny_norm_linear(x, r, norm_w, 1e-6, weight, bias, cfg)[0]  # compiled before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, out_stream = fp8_gemm.fp8_skinny_norm_linear(x, r, norm_w, 1e-6, weight, bias, cfg)
    x.copy_(torch.randn(x.shape, generator=g, device=dev).to(torch.bfloat16))
    graph.replay()
    torch.cuda.synchronize()
    want, want_stream = fp8_gemm.fp8_skinny_norm_linear(x, r, norm_w, 1e-6, weight, bias, cfg)
    assert torch.equal(out, want) and torch.equal(out_stream, want_stream) and not torch.equal(out, y)


@pytest.mark.gpu
@pytest.mark.parametrize(("activations", "activation"), [("token", "silu"), ("group", "silu"), ("static", "silu"), ("token", "gelu_tanh")])
@pytest.mark.parametrize(("n", "d"), [(4096, 14336), (576, 1536)])
def test_gpu_activation_inside_the_fused_decode_kernel_gives_the_two_launches_bits(activations, n, d, activation):  # type: ignore[no-untyped-def]
    """Llama-3-8B's and SmolLM2's down at 1, 5 and 16 rows in bf16, four SKINNY configs:
    fp8_act_and_mul_linear (the activation inside the fused decode kernel) has the bits of the
    activation's launch then the same kernel."""
    from pagecast.kernels import activation as act_kernels
    from pagecast.kernels import fp8_gemm

    dev = _cuda()
    g = torch.Generator(device=dev).manual_seed(6)
    weight = _gpu_fp8_weight(n, d, activations, g, dev)
    act = act_kernels.silu_and_mul if activation == "silu" else act_kernels.gelu_tanh_and_mul
    for m in (1, 5, 16):
        x = (torch.randn(m, 2 * d, generator=g, device=dev) * 3).to(torch.bfloat16)
        configs = _some_skinny_configs(m, n, d, activations == "group")
        assert configs
        for cfg in configs:
            y = fp8_gemm.fp8_act_and_mul_linear(x, weight, None, activation, cfg)
            assert torch.equal(y, fp8_gemm.fp8_linear(act(x), weight, None, cfg)), (m, cfg)


def _split_configs(m: int, n: int, k: int, activations: str) -> list:  # type: ignore[type-arg]
    from pagecast.kernels import fp8_gemm

    configs = fp8_gemm.prune_configs(fp8_gemm.CONFIG_SPACE, m, n, k, activations == "group", torch.bfloat16)
    return [c for c in configs if fp8_gemm.is_skinny(c) and c.params.get("SPLIT_K", 1) > 1]


@pytest.mark.gpu
@pytest.mark.parametrize("activations", ["token", "group", "static"])
@pytest.mark.parametrize(("n", "k"), [(4096, 14336), (4096, 4096), (6144, 4096)])
def test_gpu_split_fused_decode_kernel_matches_the_two_launch_path_and_repeats_bitwise(activations, n, k):  # type: ignore[no-untyped-def]
    """Every split SKINNY config the tuner may time at Llama-3-8B's narrow projections (down, o,
    qkv), 1 and 16 rows, fp32 out, against quantize_activations + the tiled GEMM (as the unsplit
    configs are checked above: the same e4m3 values and scales, summed in another order); run twice,
    bitwise the same (the partials are added in split order whichever program finishes last), and
    the counters are zero after. A program that summed the partials before the others had written
    them, or a counter left non-zero, would give wrong or uninitialised outputs here. ~12 compiled
    variants per activation mode and row count."""
    from pagecast.kernels import fp8_gemm

    dev = _cuda()
    g = torch.Generator(device=dev).manual_seed(5)
    weight = _gpu_fp8_weight(n, k, activations, g, dev)
    bias = torch.randn(n, generator=g, device=dev).to(torch.bfloat16)
    for m in (1, 16):
        x = (torch.randn(m, k, generator=g, device=dev) * 3).to(torch.bfloat16)
        qx, sx = fp8_gemm.quantize_activations(x, activations, weight.input_scale)
        tile = {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "SPLIT_K": 1}
        two = fp8_gemm.fp8_gemm(qx, sx, weight.weight, weight.weight_scale, bias, torch.float32, tile)
        configs = _split_configs(m, n, k, activations)
        assert len(configs) == (6 if activations == "group" else 12)
        for cfg in configs:
            args = (x, weight.weight, weight.weight_scale, activations, weight.input_scale, bias, torch.float32, cfg)
            y = fp8_gemm.fp8_skinny_linear(*args)
            again = fp8_gemm.fp8_skinny_linear(*args)
            torch.cuda.synchronize()
            atol = 3e-5 * two.abs().max().item()
            torch.testing.assert_close(y, two, rtol=1e-5, atol=atol, msg=lambda s, c=cfg, m=m: f"m={m} {c}: {s}")
            assert torch.equal(y, again), (m, cfg)
            assert not split_k.COUNTERS[x.device].any(), (m, cfg)


@pytest.mark.gpu
@pytest.mark.parametrize("activations", ["token", "group"])
def test_gpu_split_fused_decode_kernel_is_deterministic_over_many_runs(activations):  # type: ignore[no-untyped-def]
    """o_proj and down_proj at one row with the deepest splits, 50 runs each (which program of a
    column block finishes last varies from run to run): every output bitwise the first."""
    from pagecast.kernels import fp8_gemm

    dev = _cuda()
    g = torch.Generator(device=dev).manual_seed(6)
    for n, k, cfg in ((4096, 4096, {"SKINNY": 1, "BLOCK_N": 32, "BLOCK_K": 128, "SPLIT_K": 8}),
                      (4096, 14336, {"SKINNY": 1, "BLOCK_N": 64, "BLOCK_K": 128, "SPLIT_K": 8})):  # fmt: skip
        weight = _gpu_fp8_weight(n, k, activations, g, dev)
        x = (torch.randn(1, k, generator=g, device=dev) * 3).to(torch.bfloat16)
        runs = [fp8_gemm.fp8_skinny_linear(x, weight.weight, weight.weight_scale, activations, None, None, torch.float32, cfg)
                for _ in range(50)]  # fmt: skip
        torch.cuda.synchronize()
        assert all(torch.equal(r, runs[0]) for r in runs), (n, k)
        assert not split_k.COUNTERS[x.device].any()


@pytest.mark.gpu
@pytest.mark.parametrize("activations", ["token", "group", "static"])
def test_gpu_split_fused_decode_kernel_replays_in_a_cuda_graph(activations):  # type: ignore[no-untyped-def]
    """Two split launches back to back on the counters (qkv, then o, as a layer runs them),
    captured in one CUDA graph and replayed 8 times on new rows: each replay bitwise the eager
    result on the same rows, the counters zero after every replay."""
    from pagecast.kernels import fp8_gemm

    dev = _cuda()
    g = torch.Generator(device=dev).manual_seed(7)
    qkv = _gpu_fp8_weight(6144, 4096, activations, g, dev)
    o = _gpu_fp8_weight(4096, 4096, activations, g, dev)
    cfg_qkv = {"SKINNY": 1, "BLOCK_N": 64, "BLOCK_K": 128, "SPLIT_K": 2}
    cfg_o = {"SKINNY": 1, "BLOCK_N": 32, "BLOCK_K": 128, "SPLIT_K": 4}

    def layer(x: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return fp8_gemm.fp8_linear(x, qkv, None, cfg_qkv), fp8_gemm.fp8_linear(h, o, None, cfg_o)

    for m in (1, 16):
        x = torch.randn(m, 4096, generator=g, device=dev).to(torch.bfloat16)
        h = torch.randn(m, 4096, generator=g, device=dev).to(torch.bfloat16)
        layer(x, h)  # compiled, the counters allocated, before capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = layer(x, h)
        for _ in range(8):
            x.copy_(torch.randn(m, 4096, generator=g, device=dev).to(torch.bfloat16) * 4)
            h.copy_(torch.randn(m, 4096, generator=g, device=dev).to(torch.bfloat16))
            graph.replay()
            torch.cuda.synchronize()
            assert not split_k.COUNTERS[x.device].any()
            eager = layer(x, h)
            assert torch.equal(out[0], eager[0]) and torch.equal(out[1], eager[1])


def test_an_fp8_lm_head_is_tuned_as_fp8_gemm_buckets_after_the_projections() -> None:
    """--fp8-lm-head (ModelShapes.fp8_lm_head: the head's rows on this rank): "lm_head.m<rows>"
    buckets at every FP8 row bucket, [vocab rows, hidden], after all the projections' (a budget
    cuts them first); none without it. Their problem runs (no bias: the head has none) and the
    report's roofline fraction covers them."""
    from pagecast.builder import fp8
    from pagecast.kernels import problems
    from pagecast.kernels.tuning import FP8_ROW_BUCKETS, ModelShapes

    base = {"num_heads": 4, "num_kv_heads": 2, "head_dim": 16, "hidden": 64, "intermediate": 96, "block_size": 16,
            "dtype": "float16", "fp8": "channel-token", "biased": ("qkv", "o")}  # fmt: skip
    assert not any(b.startswith("lm_head") for b, _ in problems.buckets("fp8_gemm", ModelShapes(**base)))
    shapes = ModelShapes(**base, fp8_lm_head=255)
    names = [b for b, _ in problems.buckets("fp8_gemm", shapes)]
    head = [b for b in names if b.startswith("lm_head.")]
    assert head == [f"lm_head.m{m}" for m in FP8_ROW_BUCKETS] and names[-len(head) :] == head
    dims = dict(problems.buckets("fp8_gemm", shapes))["lm_head.m4"]
    assert (dims["n"], dims["k"]) == (255, 64)
    out = problems.make_problem("fp8_gemm", shapes, dims, "cpu").launch(None, 0)
    assert isinstance(out, torch.Tensor) and out.shape == (4, 255) and bool(torch.isfinite(out).all())
    table = {"device": "NVIDIA H200", "copy_bandwidth_gbs": 4000.0,
             "shapes": {**shapes.__dict__, "dtype": "float16", "kv_cache_dtype": "float16"}}  # fmt: skip
    # one row: 255 x 64 fp8 bytes and 255 fp32 scales (+ the row in and out) at 4 TB/s, over 10 us
    ideal_s = (255 * 64 + 255 * 4 + 64 * 2 + 255 * 2) / 4e12
    assert fp8.roofline_fraction(table, "lm_head.m1", 10.0) == pytest.approx(ideal_s / 1e-5, rel=0.05)


@pytest.mark.parametrize("activations", ["token", "group", "static"])
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.parametrize(("d", "row_block"), [(300, None), (1000, 256)])
def test_activation_and_quantisation_in_one_launch_give_the_two_launches_bits(activations, activation, d, row_block, monkeypatch):  # type: ignore[no-untyped-def]
    """activation.act_and_mul_fp8 (the gated activation and the FP8 quantisation of down's input
    in one launch) gives the bits and scales of silu_and_mul (or gelu_tanh_and_mul) then
    fp8_gemm.quantize_activations, per token with the row in one block and in two passes of
    256-column blocks (row_block), per 1x128 group, and with a static scale; a zero row gets the
    clamped scale and zeros."""
    from pagecast.kernels import activation as act_kernels
    from pagecast.kernels import fp8_gemm

    if row_block is not None:
        monkeypatch.setattr(act_kernels, "FP8_ROW_BLOCK_MAX", row_block)
    for dtype in (torch.float16, torch.float32):
        x = (torch.randn(5, 2 * d, generator=torch.Generator().manual_seed(3)) * 4).to(dtype)
        x[2] = 0
        inp = torch.tensor([0.05])
        two = act_kernels.silu_and_mul(x) if activation == "silu" else act_kernels.gelu_tanh_and_mul(x)
        rq, rs = fp8_gemm.quantize_activations(two, activations, inp)
        q, s = act_kernels.act_and_mul_fp8(x, activation, activations, inp)
        assert torch.equal(s, rs), dtype
        assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8)), dtype
        assert torch.equal(q[2].float(), torch.zeros(d))


def _count_launches(monkeypatch, module, name: str) -> list[str]:  # type: ignore[no-untyped-def]
    """The launches of module's jitted kernel ``name`` from now on (ops holds the launchers, so
    the kernel object, which they look up at each launch, is what is replaced)."""
    launched: list[str] = []
    kernel = getattr(module, name)

    class Count:
        def __getitem__(self, grid):  # type: ignore[no-untyped-def]
            launched.append(name)
            return kernel[grid]

    monkeypatch.setattr(module, name, Count())
    return launched


def test_fp8_down_projection_fuses_the_activation_into_the_quantisation_past_16_rows(monkeypatch):  # type: ignore[no-untyped-def]
    """ops' down projection of an FP8 MLP: past 16 rows (where fp8_linear would quantise in a
    launch of its own) the activation and the quantisation run as one launch, no [rows, d]
    intermediate is made, and the result has the bits of the two-launch path; up to 16 rows under
    a SKINNY config the fused decode kernel activates its input on the way in (no activation
    launch either), with the bits of the activation's launch then that kernel; where the tuner
    marked the bucket "feed_apart" (timed faster so), the activation's launch then that kernel."""
    from pagecast.kernels import activation as act_kernels
    from pagecast.kernels import fp8_gemm, ops

    d, n = 256, 64
    qw, sw = _weights(n, d, False)
    w = Fp8LinearWeight(qw, sw, None, "token")
    tile = {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 64, "SPLIT_K": 1}
    skinny = {"SKINNY": 1, "BLOCK_N": 32, "BLOCK_K": 128}
    x = (torch.randn(20, 2 * d, generator=torch.Generator().manual_seed(4)) * 2).to(torch.float16)
    expected = fp8_gemm.fp8_linear(act_kernels.silu_and_mul(x), w, None, tile)
    expected_4 = fp8_gemm.fp8_linear(act_kernels.silu_and_mul(x[:4]), w, None, skinny)

    calls = _count_launches(monkeypatch, act_kernels, "_silu_and_mul_kernel")
    monkeypatch.setattr(ops, "_triton", lambda x: True)  # ops' GPU path, on the interpreter
    table = ops.configure({"kernels": {"fp8_gemm": {"down.m32": {"config": tile}, "down.m4": {"config": skinny}}}})
    try:
        fused = ops.row_parallel_linear(x, w, None, "down", silu_and_mul_first=True)
        assert table.configs[("fp8_gemm", "down.m32")] is not None  # the table's entry was looked up
        assert calls == []  # no activation launch: fused into the quantisation
        assert torch.equal(fused, expected)
        assert torch.equal(ops.row_parallel_linear(x[:4], w, None, "down", silu_and_mul_first=True), expected_4)
        assert calls == []  # 4 rows: the SKINNY kernel activates and quantises its input itself
        monkeypatch.setattr(ops, "FUSE_ACT_QUANT_FP8", False)
        assert torch.equal(ops.row_parallel_linear(x[:4], w, None, "down", silu_and_mul_first=True), expected_4)
        assert calls == ["_silu_and_mul_kernel"]  # off: the activation's launch, then the kernel
        monkeypatch.setattr(ops, "FUSE_ACT_QUANT_FP8", True)
        calls.clear()
        # on, but the tuner timed this bucket faster with the activation in its own launch
        ops.configure({"kernels": {"fp8_gemm": {"down.m4": {"config": skinny, "apart_us": 9.0, "feed_apart": True}}}})
        assert torch.equal(ops.row_parallel_linear(x[:4], w, None, "down", silu_and_mul_first=True), expected_4)
        assert calls == ["_silu_and_mul_kernel"]
        monkeypatch.setattr(ops, "FEED_APART", False)  # PAGECAST_FEED_APART=0: the mark ignored, fused
        calls.clear()
        assert torch.equal(ops.row_parallel_linear(x[:4], w, None, "down", silu_and_mul_first=True), expected_4)
        assert calls == []
    finally:
        ops.configure()
    assert fp8_gemm.quantises_apart(20, d, w, x.dtype, tile)
    assert not fp8_gemm.quantises_apart(4, d, w, x.dtype, skinny)
    assert fp8_gemm.quantises_apart(17, d, w, x.dtype, skinny)
    with pytest.raises(ValueError, match="activation 'gelu'"):
        fp8_gemm.fp8_act_and_mul_linear(x[:4], w, None, "gelu", skinny)


@pytest.mark.parametrize("activations", ["token", "group", "static"])
@pytest.mark.parametrize("hidden", [64, 300, 576])
def test_norm_and_quantisation_in_one_launch_give_the_two_launches_bits(activations, hidden):  # type: ignore[no-untyped-def]
    """rms_norm.rms_norm_fp8 (a layer's norm with the FP8 quantisation of the projection's input in
    its launch) gives the bits of rms_norm (or fused_add_rms_norm) then
    fp8_gemm.quantize_activations, and the same residual stream; hidden sizes under one 128-group,
    not a multiple of it, and SmolLM2's."""
    for dtype in (torch.float16, torch.float32):
        g = torch.Generator().manual_seed(hidden)
        x, r = ((torch.randn(5, hidden, generator=g) * 3).to(dtype) for _ in range(2))
        w = torch.randn(hidden, generator=g).to(dtype)
        _assert_norm_fp8_gives_the_two_launches(x, r, w, activations, torch.tensor([0.05]))


def _assert_norm_fp8_gives_the_two_launches(x, r, w, activations: str, input_scale: torch.Tensor, config=None) -> None:  # type: ignore[no-untyped-def]
    """rms_norm_fp8 with the residual r and without (layer 0): the bits and scales of the norm's
    launch then quantize_activations, and the residual stream of the norm (both norms under
    ``config``, the tuner's choice for the bucket, as ops.norm_linear passes it).

    Bitwise for half types (the normalised rows rounded to x's dtype in both) and in the
    interpreter. fp32 rows on the GPU are not rounded, and the two compiled kernels' rows come out
    ulps apart (an H100: scales equal to the fourth digit, not bitwise), so there the scales are
    held to 4 ulps and the e4m3 values to equal but for the rare one that lands on the other side
    of a rounding boundary, one e4m3 step away."""
    from kv_cache_support import fp8_steps_apart

    from pagecast.kernels import fp8_gemm, rms_norm

    for residual in (None, r):
        if residual is None:
            normed, stream = rms_norm.rms_norm(x, w, 1e-6, config=config), x
        else:
            normed, stream = rms_norm.fused_add_rms_norm(x, residual, w, 1e-6, config=config)
        rq, rs = fp8_gemm.quantize_activations(normed, activations, input_scale)
        q, s, got_stream = rms_norm.rms_norm_fp8(x, residual, w, 1e-6, activations, input_scale, config)
        what = (x.dtype, residual is None, config)
        assert torch.equal(got_stream, stream), what
        if x.dtype != torch.float32 or not x.is_cuda:
            assert torch.equal(s, rs), what
            assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8)), what
            continue
        torch.testing.assert_close(s, rs, rtol=4 * 2.0**-23, atol=0, msg=lambda m: f"{what}: {m}")  # noqa: B023
        codes, want = q.view(torch.uint8).int(), rq.view(torch.uint8).int()
        apart = codes != want  # neighbours of one sign: one code apart, the sign bit the same
        steps = fp8_steps_apart(q, rq)
        assert bool((steps[apart] == 1).all()) and bool(((codes ^ want)[apart] & 0x80 == 0).all()), what
        assert int(apart.sum()) <= max(2, apart.numel() // 1000), (what, int(apart.sum()), apart.numel())


def test_fp8_norm_linear_quantises_in_the_norm_launch_past_16_rows(monkeypatch):  # type: ignore[no-untyped-def]
    """ops.norm_linear (a layer's norm and the projection it feeds): for an FP8 projection past 16
    rows the norm's launch quantises the projection's input (no normalised rows in the model's
    dtype, no quantisation launch), with the bits and the residual stream of the two-launch path;
    up to 16 rows under a SKINNY config, the fused decode kernel normalises as well (no norm
    launch: fp8_skinny_norm_linear's result and stream), or with PAGECAST_FUSE_NORM_DECODE=0, or
    where the tuner marked the bucket "feed_apart" (timed faster so), the norm then the fused
    decode kernel, as before."""
    from pagecast.kernels import fp8_gemm, ops, rms_norm

    hidden, n = 256, 64
    qw, sw = _weights(n, hidden, False)
    w = Fp8LinearWeight(qw, sw, None, "token")
    tile = {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 64, "SPLIT_K": 1}
    skinny = {"SKINNY": 1, "BLOCK_N": 32, "BLOCK_K": 128}
    g = torch.Generator().manual_seed(5)
    x, r = ((torch.randn(20, hidden, generator=g) * 2).to(torch.float16) for _ in range(2))
    norm_w = torch.randn(hidden, generator=g).to(torch.float16)
    normed, stream = rms_norm.fused_add_rms_norm(x, r, norm_w, 1e-6)
    expected = fp8_gemm.fp8_linear(normed, w, None, tile)
    expected_first = fp8_gemm.fp8_linear(rms_norm.rms_norm(x, norm_w, 1e-6), w, None, tile)
    normed4, stream4 = rms_norm.fused_add_rms_norm(x[:4], r[:4], norm_w, 1e-6)
    expected_4 = fp8_gemm.fp8_linear(normed4, w, None, skinny)

    launched = _count_launches(monkeypatch, fp8_gemm, "_quant_act_kernel")
    monkeypatch.setattr(ops, "_triton", lambda x: True)  # ops' GPU path, on the interpreter
    table = ops.configure({"kernels": {"fp8_gemm": {"qkv.m32": {"config": tile}, "qkv.m4": {"config": skinny}}}})
    try:
        y, got_stream = ops.norm_linear(x, r, norm_w, 1e-6, w, None, "qkv")
        assert table.configs[("fp8_gemm", "qkv.m32")] is not None  # the table's entry was looked up
        assert launched == []
        assert torch.equal(y, expected) and torch.equal(got_stream, stream)
        y, got_stream = ops.norm_linear(x, None, norm_w, 1e-6, w, None, "qkv")  # layer 0: the stream is x
        assert torch.equal(y, expected_first) and got_stream is x
        norms = _count_launches(monkeypatch, rms_norm, "_rms_norm_kernel")
        for res in (r[:4], None):
            y, got_stream = ops.norm_linear(x[:4], res, norm_w, 1e-6, w, None, "qkv")
            fused, _ = fp8_gemm.fp8_skinny_norm_linear(x[:4], res, norm_w, 1e-6, w, None, skinny)
            assert torch.equal(y, fused) and torch.equal(got_stream, stream4 if res is not None else x[:4])
        assert norms == [] and launched == []  # 4 rows: the SKINNY kernel normalises and quantises its input itself
        monkeypatch.setattr(ops, "FUSE_NORM_DECODE", False)
        y, got_stream = ops.norm_linear(x[:4], r[:4], norm_w, 1e-6, w, None, "qkv")
        assert torch.equal(y, expected_4) and torch.equal(got_stream, stream4)
        assert norms == ["_rms_norm_kernel"] and launched == []
        monkeypatch.setattr(ops, "FUSE_NORM_DECODE", True)
        norms.clear()
        # on, but the tuner timed this bucket faster with the norm in its own launch
        ops.configure({"kernels": {"fp8_gemm": {"qkv.m4": {"config": skinny, "apart_us": 9.0, "feed_apart": True}}}})
        y, got_stream = ops.norm_linear(x[:4], r[:4], norm_w, 1e-6, w, None, "qkv")
        assert torch.equal(y, expected_4) and torch.equal(got_stream, stream4)
        assert norms == ["_rms_norm_kernel"] and launched == []
    finally:
        ops.configure()


def _norm_rows(m: int, k: int, activations: str, residual: bool, seed: int):  # type: ignore[no-untyped-def]
    """(x, residual or None, norm weight, the stream, the normalised rows) for RMSNorm feeding an FP8
    projection, built so that every step is exact in fp32 and the interpreter quantises right: the
    norm weight g is a row of _e4m3_rows, each stream row is +-2^e (its own e, signs at random), so
    its rstd (eps 0) is 2^-e and the normalised row (s * g) * rstd is +-g exactly; x is the stream
    less a residual of multiples of 2^(e - 3)."""
    gen = torch.Generator().manual_seed(seed)
    g, _, _ = _e4m3_rows(1, k, activations, seed=seed)
    g = g[0]
    e = torch.randint(-3, 4, (m, 1), generator=gen).float()
    sign = torch.where(torch.rand(m, k, generator=gen) < 0.5, -1.0, 1.0)
    stream = sign * 2.0**e
    normed = sign * g
    if not residual:
        return stream, None, g, stream, normed
    r = torch.randint(-8, 9, (m, k), generator=gen).float() * 2.0 ** (e - 3)
    return stream - r, r, g, stream, normed


# Every shape with every scheme, with and without the residual in turn: each pair of the three meets.
@pytest.mark.parametrize(
    ("activations", "m", "k", "residual"),
    [(scheme, m, k, (i + a) % 2 == 1) for i, (m, k) in enumerate([(1, 300), (1, 2176), (3, 1024), (8, 384), (16, 300)])
     for a, scheme in enumerate(SCHEMES)],
)
def test_norm_inside_the_fused_decode_kernel_is_the_reference_on_exact_rows(activations, m, k, residual, launches):  # type: ignore[no-untyped-def]
    """fp8_gemm.fp8_skinny_norm_linear (the RMSNorm, with the residual add or without, inside the
    fused decode kernel) on rows whose normalisation is exact: the projection of the normalised
    rows as reference.fp8_linear computes it (so the norm, its weight, the rstd and the scales
    from them are each applied once and in the right place), the same as
    reference.fp8_norm_linear, unsplit and split in 2 and 3, and the stream x + residual exactly.
    One row puts 16 K steps in a quantised tile, 3 rows 4, 16 rows one."""
    from pagecast.kernels import fp8_gemm

    n = 72
    x, r, g, stream, normed = _norm_rows(m, k, activations, residual, seed=m + k)
    _, _, inp = _e4m3_rows(1, k, activations, seed=m + k)
    qw, sw = _weights(n, k, activations == "group", seed=6)
    w = Fp8LinearWeight(qw, sw, inp if activations == "static" else None, activations)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(7))
    ref = reference.fp8_linear(normed, qw, sw, activations, inp, bias)
    ref_fused, ref_stream = reference.fp8_norm_linear(x, r, g, 0.0, qw, sw, activations, inp, bias)
    torch.testing.assert_close(ref_fused, ref, rtol=1e-6, atol=1e-6 * ref.abs().max().item())
    assert torch.equal(ref_stream, stream)
    for split in (1, 2, 3):
        y, got_stream = fp8_gemm.fp8_skinny_norm_linear(x, r, g, 0.0, w, bias, _split(SKINNY, split))
        torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item(), msg=lambda s, sp=split: f"SPLIT_K {sp}: {s}")
        assert torch.equal(got_stream, stream)
        assert (got_stream is x) == (r is None)  # layer 0: the stream is x itself
        assert split == 1 or not _cpu_counters().any()
    assert [sp for sp, _ in launches] == [1, 2, 3]


def test_norm_inside_the_fused_decode_kernel_takes_eps_and_half_rows_and_refuses_what_it_cannot_run() -> None:
    """Random fp16 rows with eps, at SmolLM2's hidden size (4.5 steps of 128): the fused kernel
    without the norm on the rows reference.fp8_norm_linear normalises (the interpreter's e4m3
    conversion rounds some carrying values wrongly, the same in both, so not against the reference
    itself), that reference within the FP8 products' error of the float product, the stream
    bitwise x + residual; rows past 16, or a config that is not SKINNY, refused with the reason."""
    from pagecast.kernels import fp8_gemm

    gen = torch.Generator().manual_seed(11)
    m, k, n = 5, 576, 48
    x, r = ((torch.randn(m, k, generator=gen) * 2).to(torch.float16) for _ in range(2))
    g = (torch.rand(k, generator=gen) + 0.5).to(torch.float16)
    qw, sw = _weights(n, k, block=False, seed=8)
    w = Fp8LinearWeight(qw, sw, None, "token")
    y, stream = fp8_gemm.fp8_skinny_norm_linear(x, r, g, 1e-5, w, None, SKINNY)
    ref, ref_stream = reference.fp8_norm_linear(x, r, g, 1e-5, qw, sw, "token")
    assert y.dtype == torch.float16 and torch.equal(stream, ref_stream)
    sf = ref_stream.float()
    normed = (sf * g.float()) * torch.rsqrt(sf.pow(2).mean(-1, keepdim=True) + 1e-5)
    unfused = fp8_gemm.fp8_skinny_linear(normed, qw, sw, "token", None, None, torch.float32, SKINNY)
    torch.testing.assert_close(y.float(), unfused, rtol=1e-3, atol=1e-3 * unfused.abs().max().item())
    exact = normed @ reference.dequantize_fp8(qw, sw).t()
    assert (ref.float() - exact).abs().max() < 0.05 * exact.abs().max()
    with pytest.raises(ValueError, match="SKINNY"):
        fp8_gemm.fp8_skinny_norm_linear(torch.randn(17, k), None, g.float(), 1e-5, w, None, SKINNY)
    with pytest.raises(ValueError, match="SKINNY"):
        fp8_gemm.fp8_skinny_norm_linear(x, r, g, 1e-5, w, None, {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 64, "SPLIT_K": 1})


# Every scheme with both activations, the two shapes in turn: each pair of the three meets.
@pytest.mark.parametrize(
    ("activations", "activation", "m", "d"),
    [(scheme, activation, *[(1, 300), (16, 384)][(a + b) % 2]) for a, scheme in enumerate(SCHEMES)
     for b, activation in enumerate(["silu", "gelu_tanh"])],
)
def test_activation_inside_the_fused_decode_kernel_gives_the_two_launches_bits(activations, activation, m, d, launches):  # type: ignore[no-untyped-def]
    """fp8_gemm.fp8_act_and_mul_linear up to 16 rows under a SKINNY config (down at decode): the
    fused decode kernel applies act(gate) * up to its input on the way in, with the bits of the
    activation kernel's launch then the same fused kernel, unsplit and split in 2 and 3, in fp16
    and fp32 (the same rounded products in, the same quantisation and sums)."""
    from pagecast.kernels import activation as act_kernels
    from pagecast.kernels import fp8_gemm

    n = 72
    qw, sw = _weights(n, d, activations == "group", seed=9)
    w = Fp8LinearWeight(qw, sw, torch.tensor([0.05]) if activations == "static" else None, activations)
    act = act_kernels.silu_and_mul if activation == "silu" else act_kernels.gelu_tanh_and_mul
    for dtype in (torch.float16, torch.float32):
        x = (torch.randn(m, 2 * d, generator=torch.Generator().manual_seed(m + d)) * 3).to(dtype)
        bias = torch.randn(n, generator=torch.Generator().manual_seed(10)).to(dtype)
        for split in (1, 2, 3):
            cfg = _split(SKINNY, split)
            y = fp8_gemm.fp8_act_and_mul_linear(x, w, bias, activation, cfg)
            two = fp8_gemm.fp8_linear(act(x), w, bias, cfg)
            assert y.dtype == dtype and torch.equal(y, two), (dtype, split)
            assert split == 1 or not _cpu_counters().any()
    assert [sp for sp, _ in launches] == [1, 1, 2, 2, 3, 3] * 2  # the fused launch, then the two-launch path's kernel


@pytest.mark.parametrize("m", [1, 3, 16])
@pytest.mark.parametrize("feed", ["plain", "norm", "silu"])
def test_scale_pass_a_step_ahead_gives_the_bits_of_one_step_at_a_time(feed, m, monkeypatch):  # type: ignore[no-untyped-def]
    """The fused decode kernel's scale pass with its loads issued a step ahead (fp8_gemm.PASS_AHEAD;
    up to 8 rows, or x alone at 16) and one step at a time: the same outputs to the bit
    (and the same stream), plain, with the residual add and norm, and with SiLU gating, unsplit and
    split, over K that ends inside a step and with more pass steps than one."""
    from pagecast.kernels import fp8_gemm

    k, n = 1300, 48
    g = torch.Generator().manual_seed(m)
    qw, sw = _weights(n, k, False, seed=11)
    w = Fp8LinearWeight(qw, sw, None, "token")
    width = 2 * k if feed == "silu" else k
    x = torch.randn(m, width, generator=g) * 3
    r = torch.randn(m, k, generator=g)
    gamma = torch.rand(k, generator=g) + 0.5
    cfg = dict(SKINNY, BLOCK_K=64)  # 21 steps: two pass steps at one row, six at 3 rows

    def run(split):  # type: ignore[no-untyped-def]
        c = _split(cfg, split)
        if feed == "norm":
            return fp8_gemm.fp8_skinny_norm_linear(x, r, gamma, 1e-5, w, None, c)
        if feed == "silu":
            return (fp8_gemm.fp8_act_and_mul_linear(x, w, None, "silu", c),)
        return (fp8_gemm.fp8_linear(x, w, None, c),)

    for split in (1, 3):
        monkeypatch.setattr(fp8_gemm, "PASS_AHEAD", True)
        ahead = run(split)
        monkeypatch.setattr(fp8_gemm, "PASS_AHEAD", False)
        one_step = run(split)
        assert all(torch.equal(a, b) for a, b in zip(ahead, one_step, strict=True)), (feed, m, split)


def test_fp8_decode_problems_time_the_input_made_apart_as_serving_runs_it():  # type: ignore[no-untyped-def]
    """The tuner's "feed_apart" choice (kernels/tuning.py): each FP8 bucket of up to 16 rows whose
    input serving makes inside the fused decode kernel - qkv's and gate_up's norm, down's
    activation - also has an ``apart`` launch, the norm or the activation in a launch of its own
    and then the projection, which is what serving runs where the bucket is marked; o and the
    prefill buckets have none. Under a SKINNY config the two compute the same projection: down's
    with the same bits, the normed ones within the e4m3 rounding of rows normalised in fp32 inside and
    in the model's dtype apart."""
    from pagecast.kernels import fp8_gemm, problems, tuning

    shapes = tuning.ModelShapes(num_heads=4, num_kv_heads=2, head_dim=16, hidden=64, intermediate=96, block_size=16,
                                dtype="float16", max_num_seqs=16, fp8="channel-token", normed=("qkv", "gate_up"))  # fmt: skip
    skinny = tuning.KernelConfig({"SKINNY": 1, "BLOCK_N": 32, "BLOCK_K": 64}, num_warps=4, num_stages=2)
    seen = set()
    for bucket, dims in problems.buckets("fp8_gemm", shapes):
        problem = problems.make_problem("fp8_gemm", shapes, dims, "cpu")
        projection, m = tuning.PROJECTIONS[dims["projection"]], dims["num_rows"]
        made_inside = projection in ("qkv", "gate_up", "down") and m <= fp8_gemm.SKINNY_MAX_ROWS  # (ModelShapes.normed)
        assert (problem.apart is not None) == made_inside, bucket
        if not made_inside or m not in (1, 16):
            continue
        seen.add(projection)
        fused, apart = problem.launch(skinny, 0), problem.apart(skinny, 0)
        if projection == "down":
            assert torch.equal(fused, apart), bucket
        else:
            assert torch.equal(fused[1], apart[1]), bucket  # the residual stream, exactly
            # the norm's fp16 rows (apart) or fp32 ones (inside) round ~1% of activations to the other e4m3 value
            off = (fused[0].float() - apart[0].float()).norm() / apart[0].float().norm()
            assert off <= 0.03, (bucket, off)  # measured 0.0002-0.01; a lost norm or residual: ~1
            assert not torch.equal(apart[0], torch.zeros_like(apart[0]))
    assert seen == {"qkv", "gate_up", "down"}
