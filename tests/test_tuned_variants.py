"""The build times, and so compiles into the artifact, each projection's GEMM in the variant serving
launches: with a bias where the model's projection has one (Qwen2's qkv) and, for GPTQ act-order
int4 weights, with the input perm every projection but down carries. Triton compiles a kernel per
constexpr, and HAS_BIAS / HAS_PERM are constexprs: before, the tuner launched every projection
without either, so an act-order or biased model compiled its GEMMs while serving (on the H200, at
74f99cb, a tiny fp32 act-order Qwen3-MoE's warm-up was still compiling its qkv projection's
``_w4a16_gemm_kernel`` when its test's 140 s ran out)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from pagecast.builder import pipeline, tune
from pagecast.builder.ir import BuildOptions
from pagecast.kernels import fp8_gemm, problems, skinny_gemm, tuning, w4a16_gemm

DIMS = {
    "num_heads": 4,
    "num_kv_heads": 2,
    "head_dim": 64,
    "hidden": 256,
    "intermediate": 512,
    "block_size": 16,
}


def _record(monkeypatch, module, name: str, perm_at: int | None, bias_at: int) -> list[tuple[bool, bool]]:  # type: ignore[no-untyped-def]
    """Replace module.name with a recorder of (perm given, bias given) per call."""
    calls: list[tuple[bool, bool]] = []

    def recorder(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append((perm_at is not None and args[perm_at] is not None, args[bias_at] is not None))

    monkeypatch.setattr(module, name, recorder)
    return calls


def _launches(kernel: str, shapes: tuning.ModelShapes, calls: list[tuple[bool, bool]]) -> dict[str, set]:
    """{projection: {(perm, bias), ...}} over every bucket of ``kernel``'s tuning problems."""
    seen: dict[str, set] = {}
    for bucket, dims in problems.buckets(kernel, shapes):
        before = len(calls)
        problems.make_problem(kernel, shapes, dims, "cpu").launch(None, 0)
        assert len(calls) == before + 1, bucket
        seen.setdefault(tuning.PROJECTIONS[dims["projection"]], set()).add(calls[-1])
    return seen


def _build(checkpoint: Path, output: Path, monkeypatch) -> tuple[Path, dict]:  # type: ignore[no-untyped-def]
    """A CPU build of ``checkpoint``, and the model_shapes its tune pass would hand the tuner."""
    seen: list[dict] = []

    def tune_pass(state):  # type: ignore[no-untyped-def]
        seen.append(tune.model_shapes(state))
        return tune.run(state)

    monkeypatch.setattr(
        pipeline, "PASSES", [(n, tune_pass if n == "tune" else r) for n, r in pipeline.PASSES]
    )
    art = pipeline.build(
        BuildOptions(model=str(checkpoint), output=output, gpu="cpu", force=True, quiet=True)
    )
    return Path(art), seen[-1]


def test_int4_problems_launch_the_perm_and_bias_the_model_has(monkeypatch):  # type: ignore[no-untyped-def]
    shapes = tuning.ModelShapes(
        **DIMS, dtype="float32", quant_group_size=32, biased=("qkv",), int4_act_order=True
    )
    calls = _record(monkeypatch, w4a16_gemm, "w4a16_gemm", 4, 6)
    fused = _record(monkeypatch, w4a16_gemm, "w4a16_silu_and_mul_gemm", 4, 6)
    seen: dict[str, set] = {}
    for bucket, dims in problems.buckets("w4a16_gemm", shapes):
        problems.make_problem("w4a16_gemm", shapes, dims, "cpu").launch(None, 0)
        projection = tuning.PROJECTIONS[dims["projection"]]
        made = (fused if projection == "down" else calls).pop()  # down is timed with its SiLU folded in
        assert not calls and not fused, bucket
        seen.setdefault(projection, set()).add(made)
    # down: no perm (act-order renumbers its inputs at build), no bias
    assert seen == {
        "qkv": {(True, True)},
        "o": {(True, False)},
        "gate_up": {(True, False)},
        "down": {(False, False)},
    }


@pytest.mark.parametrize("kernel", ["skinny_gemm", "fp8_gemm"])
def test_half_and_fp8_problems_launch_the_bias_the_model_has(kernel, monkeypatch):  # type: ignore[no-untyped-def]
    extra = {"fp8": "channel-token"} if kernel == "fp8_gemm" else {}
    shapes = tuning.ModelShapes(**DIMS, dtype="float32", biased=("qkv", "o"), **extra)
    module, name = (fp8_gemm, "fp8_linear") if kernel == "fp8_gemm" else (skinny_gemm, "skinny_gemm")
    calls = _record(monkeypatch, module, name, None, 2)
    if kernel == "fp8_gemm":  # down past 16 rows: its activation and quantisation in one launch, then the GEMM
        monkeypatch.setattr(fp8_gemm, "fp8_act_and_mul_linear", lambda *a, **k: calls.append((False, a[2] is not None)))
    seen = _launches(kernel, shapes, calls)
    assert seen == {
        "qkv": {(False, True)},
        "o": {(False, True)},
        "gate_up": {(False, False)},
        "down": {(False, False)},
    }


def test_the_build_tells_the_tuner_which_projections_have_a_bias_and_a_perm(
    tiny_checkpoint_factory, tmp_path, monkeypatch
):  # type: ignore[no-untyped-def]
    """model_shapes for a Qwen2 (qkv bias) GPTQ act-order checkpoint, checked against the artifact
    the same build writes: a perm on exactly the projections int4_act_order says, a bias on exactly
    those ``biased`` names; a Llama in AWQ has neither."""
    from quant_writer import Format, write

    built, seen = {}, {}
    for family, fmt in (("qwen2", Format("gptq", 32, sym=True, desc_act=True)), ("llama", Format("awq", 32))):
        ckpt, _ = write(tiny_checkpoint_factory(family), tmp_path / family, fmt)
        built[family], seen[family] = _build(ckpt, tmp_path / f"{family}-art", monkeypatch)
    qwen2, llama = seen["qwen2"], seen["llama"]
    assert (qwen2["biased"], qwen2["int4_act_order"]) == (["qkv"], True)
    assert (llama["biased"], llama["int4_act_order"]) == ([], False)
    assert tune.kernel_shapes(qwen2).biased == ("qkv",)  # as the tune subprocess reads the JSON

    for family, shapes in (("qwen2", qwen2), ("llama", llama)):
        names = set()
        for f in sorted((built[family] / "weights").glob("*.safetensors")):
            with safe_open(str(f), "pt") as st:
                names |= set(st.keys())
        layer0 = {n.split(".", 2)[2] for n in names if n.startswith("layers.0.")}
        for proj in tuning.PROJECTIONS:
            has_perm = f"{proj}_proj.perm" in layer0
            has_bias = f"{proj}_proj.bias" in layer0
            assert has_perm == (shapes["int4_act_order"] and proj != "down"), (family, proj, sorted(layer0))
            assert has_bias == (proj in shapes["biased"]), (family, proj, sorted(layer0))


def test_rotary_problem_launches_the_models_rotary_width(monkeypatch):  # type: ignore[no-untyped-def]
    """A partial-rotary model (Phi-4-mini rotates 0.75 of each head) runs the rotary kernel with
    ROTARY_DIM = its cos/sin cache's width: the tuner's launches use that width, not head_dim."""
    from pagecast.kernels import rotary_kv

    widths: list[int] = []
    monkeypatch.setattr(
        rotary_kv, "rotary_and_write_kv", lambda *args, **kwargs: widths.append(args[4].shape[-1])
    )
    for rotary_dim, expected in ((48, 48), (0, 64)):
        shapes = tuning.ModelShapes(**DIMS, dtype="float32", rotary_dim=rotary_dim)
        widths.clear()
        for _, dims in problems.buckets("rotary_kv", shapes):
            problems.make_problem("rotary_kv", shapes, dims, "cpu").launch(None, 0)
        assert widths and set(widths) == {expected}


def test_the_build_tells_the_tuner_the_rotary_width(tiny_checkpoint_factory, tmp_path, monkeypatch):  # type: ignore[no-untyped-def]
    art, shapes = _build(
        tiny_checkpoint_factory("llama", partial_rotary_factor=0.5), tmp_path / "art", monkeypatch
    )
    head_dim = shapes["head_dim"]
    assert shapes["rotary_dim"] == head_dim // 2
    assert f"ROTARY_DIM = {head_dim // 2}\n" in (art / "model.py").read_text()  # what the model launches with


def test_q_k_norms_are_compiled_at_their_own_widths(monkeypatch):  # type: ignore[no-untyped-def]
    """Whole-projection q/k norms (OLMo 2) run rms_norm at the q and k widths, not at hidden:
    another BLOCK. compile_norm_variants launches each width with every config serving can pick:
    those in the table's rms_norm entries and the launcher's default there."""
    from pagecast.kernels import rms_norm

    launched: list[tuple[int, int]] = []
    monkeypatch.setattr(
        rms_norm, "rms_norm", lambda x, w, eps, config: launched.append((x.shape[1], config.num_warps))
    )
    table = {
        "kernels": {
            "rms_norm": {
                "t1": {"config": {"num_warps": 8, "num_stages": 1}},
                "t64": {"num_warps": 16, "num_stages": 1},
            }
        }
    }
    shapes = tuning.ModelShapes(**DIMS, dtype="float32", qk_norm_widths=(64, 256, 128))
    assert tuning.compile_norm_variants(table, shapes, "cpu") == len(launched)
    default = {w: rms_norm.default_config(w).num_warps for w in (64, 256, 128)}
    assert set(launched) == {(w, n) for w in (64, 256, 128) for n in (8, 16, default[w])}
    launched.clear()
    assert tuning.compile_norm_variants(table, tuning.ModelShapes(**DIMS), "cpu") == 0 and not launched


def test_fp8_builds_compile_the_norm_and_activation_that_quantise_for_the_projections(monkeypatch):  # type: ignore[no-untyped-def]
    """An FP8 build's FP8 projections past 16 rows get their input quantised by the norm's launch
    (ops.norm_linear) or the gated activation's (fp8_gemm.fp8_act_and_mul_linear), kernels no tuning
    problem times: compile_fp8_input_variants launches the norm with every config serving can pick
    for rms_norm (layer 0, no residual) and fused_add_rms_norm, and the activation, in the build's
    activation scheme, and down's input quantisation alone (PAGECAST_FUSE_ACT_QUANT_FP8=0); nothing
    for a half-type build."""
    from pagecast.kernels import activation, rms_norm

    norms: list[tuple[bool, str, int]] = []
    acts: list[tuple[str, str, int]] = []
    monkeypatch.setattr(
        rms_norm, "rms_norm_fp8",
        lambda x, res, w, eps, acts_, scale, cfg: norms.append((res is not None, acts_, cfg.num_warps)),
    )  # fmt: skip
    monkeypatch.setattr(activation, "act_and_mul_fp8", lambda x, act, acts_, scale: acts.append((act, acts_, x.shape[1])))
    monkeypatch.setattr(fp8_gemm, "quantize_activations", lambda x, acts_, scale: acts.append(("none", acts_, x.shape[1])))
    plain: list[tuple[int, int, bool]] = []
    monkeypatch.setattr(fp8_gemm, "fp8_linear", lambda x, w, bias, cfg: plain.append((w.weight.shape[0], x.shape[0], fp8_gemm.is_skinny(cfg))))
    tile = {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 128, "SPLIT_K": 1}
    table = {"kernels": {"rms_norm": {"t1": {"config": {"num_warps": 2, "num_stages": 1}}},
                         "fused_add_rms_norm": {"t1": {"config": {"num_warps": 16, "num_stages": 1}}},
                         "fp8_gemm": {"qkv.m4": {"config": tile}}}}  # fmt: skip
    shapes = tuning.ModelShapes(**DIMS, dtype="float32", fp8="channel-token", activation="gelu_tanh", normed=("qkv",))
    assert tuning.compile_fp8_input_variants(table, shapes, "cpu") == len(norms) + len(acts) + len(plain)
    # and, for a server with the decode fusions off, the fused decode kernel alone at qkv's (normed)
    # and down's (activated) SKINNY buckets (qkv.m4's tile quantises apart: none there)
    qkv_n = (DIMS["num_heads"] + 2 * DIMS["num_kv_heads"]) * DIMS["head_dim"]
    expected = [(qkv_n, m, True) for m in (1, 2, 8, 16, 15)] + [(DIMS["hidden"], m, True) for m in (1, 2, 4, 8, 16, 15)]
    assert plain == expected
    default = rms_norm.default_config(DIMS["hidden"]).num_warps
    assert set(norms) == {(False, "token", 2), (False, "token", default), (True, "token", 16), (True, "token", default)}
    # the activation with the quantisation, and the quantisation alone (a server with the fusion off)
    assert acts == [("gelu_tanh", "token", 2 * DIMS["intermediate"]), ("none", "token", DIMS["intermediate"])]
    norms.clear()
    acts.clear()
    plain.clear()
    assert tuning.compile_fp8_input_variants(table, tuning.ModelShapes(**DIMS), "cpu") == 0 and not norms and not acts and not plain


@pytest.mark.parametrize("family", ["qwen3", "olmo2", "llama"])
def test_the_build_tells_the_tuner_its_q_k_norm_widths(
    family, tiny_checkpoint_factory, tmp_path, monkeypatch
):  # type: ignore[no-untyped-def]
    _, s = _build(tiny_checkpoint_factory(family), tmp_path / "art", monkeypatch)
    expected = {
        "qwen3": [],  # each head: inside the rotary kernel
        "olmo2": [s["num_heads"] * s["head_dim"], s["num_kv_heads"] * s["head_dim"]],  # q and k whole
        "llama": [],
    }
    assert s["qk_norm_widths"] == expected[family]
    assert s["head_qk_norm"] == (family == "qwen3")


def test_the_rotary_problem_launches_the_q_k_norm_variant_a_qwen3_runs(monkeypatch):  # type: ignore[no-untyped-def]
    """A model with per-head q/k norms launches the rotary kernel with them (its QK_NORM variant):
    the tuner times and compiles that variant, not the plain one serving would never launch."""
    from pagecast.kernels import rotary_kv

    seen: list[bool] = []
    monkeypatch.setattr(
        rotary_kv, "rotary_and_write_kv", lambda *args, **kwargs: seen.append(kwargs.get("q_norm") is not None)
    )
    for flag in (True, False):
        seen.clear()
        shapes = tuning.ModelShapes(**DIMS, dtype="float32", head_qk_norm=flag)
        for _, dims in problems.buckets("rotary_kv", shapes):
            problems.make_problem("rotary_kv", shapes, dims, "cpu").launch(None, 0)
        assert seen and set(seen) == {flag}


def test_row_parallel_projections_add_their_bias_after_the_all_reduce() -> None:
    """At tp > 1, o and down run their GEMMs without the bias (ops.row_parallel_linear adds it once,
    after the sum): the tuner must time them without one there, and with one at tp 1."""
    from types import SimpleNamespace

    attention = SimpleNamespace(qkv_bias=True, o_bias=True)
    model = SimpleNamespace(
        layers=[SimpleNamespace(attention=attention)] * 2, dense_mlp=SimpleNamespace(bias=True)
    )
    assert tune.biased_projections(model, 1) == ["qkv", "o", "gate_up", "down"]
    assert tune.biased_projections(model, 2) == ["qkv", "gate_up"]
    plain = SimpleNamespace(
        layers=[SimpleNamespace(attention=SimpleNamespace(qkv_bias=False, o_bias=False))], dense_mlp=None
    )
    assert tune.biased_projections(plain, 1) == []


def test_the_tuner_is_told_which_projections_a_norm_feeds() -> None:
    """qkv where a layer normalises the attention's input, gate_up where a dense MLP's input is
    normalised (ops.norm_linear): not for post-norm layers (OLMo 2) or a MoE block, whose norm runs in
    the router's launch."""
    from types import SimpleNamespace

    def layer(attn_in: bool, mlp_in: bool, kind: str = "dense") -> SimpleNamespace:
        norm = SimpleNamespace(eps=1e-6)
        return SimpleNamespace(attn_in_norm=norm if attn_in else None, mlp_in_norm=norm if mlp_in else None, mlp=SimpleNamespace(kind=kind))

    assert tune.normed_projections(SimpleNamespace(layers=[layer(True, True)] * 2)) == ["qkv", "gate_up"]
    assert tune.normed_projections(SimpleNamespace(layers=[layer(False, False)] * 2)) == []
    assert tune.normed_projections(SimpleNamespace(layers=[layer(True, True, "moe")] * 2)) == ["qkv"]
    assert tune.normed_projections(SimpleNamespace(layers=[layer(True, True), layer(True, True, "moe")])) == ["qkv", "gate_up"]


@pytest.mark.parametrize("kernel", ["w4a16_gemm", "fp8_gemm"])
def test_a_row_bucket_compiles_the_variant_its_served_rows_launch(monkeypatch, kernel):  # type: ignore[no-untyped-def]
    """A GEMM bucket of 32 rows serves 17 to 32 rows, and Triton compiles a variant for a row count
    divisible by 16 and one for the others: the tuner's launches (timed, and Problem.variants) must
    hold the key of every served row count, for each config it times."""
    from test_startup_compiles import _Recorded

    module, name = (w4a16_gemm, "_w4a16_gemm_kernel") if kernel == "w4a16_gemm" else (fp8_gemm, "_fp8_gemm_kernel")
    keys: set[tuple] = set()
    monkeypatch.setattr(module, name, _Recorded(name, getattr(module, name), keys))
    extra = {"quant_group_size": 32, "biased": ("qkv",), "int4_act_order": True} if kernel == "w4a16_gemm" else {"fp8": "channel-token"}
    shapes = tuning.ModelShapes(**DIMS, dtype="bfloat16", **extra)
    dims = dict(problems.buckets(kernel, shapes))["qkv.m32"]
    problem = problems.make_problem(kernel, shapes, dims, "cpu")
    tiles = [c for c in problems.config_space(kernel, shapes, dims) if c.params.get("BLOCK_M") == 32]
    assert tiles and problem.variants is not None
    for cfg in tiles:  # what tuning.tune runs for each config it times
        problem.launch(cfg, 0)
        problem.variants(cfg)
    built, served = set(keys), set()
    for cfg in tiles:
        for rows in (17, 20, 31, 32):
            keys.clear()
            problem_rows = problems.make_problem(kernel, shapes, {**dims, "num_rows": rows}, "cpu")
            problem_rows.launch(cfg, 0)
            served |= keys
    assert served and served <= built, served - built


def test_a_moe_token_bucket_compiles_the_variant_every_served_count_launches(monkeypatch):  # type: ignore[no-untyped-def]
    """The fused-MoE tile path's pair and block counts follow the token count: every token count
    a bucket serves (17-32 at the 32 bucket) must launch the kernels' variant the tuner's launch at
    the bucket's own count compiled."""
    from test_startup_compiles import _Recorded

    from pagecast.kernels import fused_moe

    keys: set[tuple] = set()
    for name in ("_moe_align_kernel", "_moe_scatter_kernel", "_moe_gemm_kernel"):
        monkeypatch.setattr(fused_moe, name, _Recorded(name, getattr(fused_moe, name), keys))
    shapes = tuning.ModelShapes(**DIMS, dtype="bfloat16", num_experts=16, top_k=4, moe_intermediate=128)
    tiles = [
        c for c in problems.config_space("fused_moe", shapes, {"num_tokens": 32})
        if "BLOCK_M" in c.params and not c.params.get("SPLIT_ACT")
    ]  # fmt: skip
    assert tiles
    h, i, e = shapes.hidden, shapes.moe_intermediate, shapes.num_experts
    w_gate_up, w_down = torch.randn(e, 2 * i, h, dtype=torch.bfloat16), torch.randn(e, h, i, dtype=torch.bfloat16)

    def launch(t: int, cfg) -> set[tuple]:  # type: ignore[no-untyped-def]
        keys.clear()
        ids = torch.stack([torch.randperm(e)[: shapes.top_k] for _ in range(t)])
        weights = torch.rand(t, shapes.top_k).softmax(-1)
        fused_moe.fused_moe(torch.randn(t, h, dtype=torch.bfloat16), weights, ids, w_gate_up, w_down, config=cfg)
        return set(keys)

    for cfg in tiles:
        built = launch(32, cfg)
        assert {k[0] for k in built} == {"_moe_align_kernel", "_moe_scatter_kernel", "_moe_gemm_kernel"}
        for t in (17, 18, 23, 31):
            served = launch(t, cfg)
            assert served <= built, (cfg.as_dict(), t, served - built)


def test_an_fp8_normed_decode_bucket_compiles_the_variants_serving_launches(monkeypatch):  # type: ignore[no-untyped-def]
    """An FP8 qkv or gate_up fed by a layer's norm (ModelShapes.normed) runs, up to 16 rows under a
    SKINNY config, the fused decode kernel with the norm inside (ops.norm_linear), with the residual
    and, in layer 0, without: the tuner's launches of each config it times (the problem, and
    Problem.variants) hold the key of every launch serving makes for the rows a bucket serves (3-4
    at 4, 9-16 at 16), and a tile config's launches go through the norm that quantises for it."""
    from test_startup_compiles import _Recorded

    from pagecast.kernels import reference, rms_norm
    from pagecast.kernels.quant_linear import Fp8LinearWeight

    keys: set[tuple] = set()
    monkeypatch.setattr(fp8_gemm, "_fp8_skinny_kernel", _Recorded("_fp8_skinny_kernel", fp8_gemm._fp8_skinny_kernel, keys))
    norms: list[bool] = []
    real_norm = rms_norm.rms_norm_fp8
    monkeypatch.setattr(rms_norm, "rms_norm_fp8", lambda x, res, *a, **k: norms.append(res is not None) or real_norm(x, res, *a, **k))
    shapes = tuning.ModelShapes(**DIMS, dtype="bfloat16", fp8="channel-token", normed=("qkv", "gate_up"), biased=("qkv",))
    for bucket, served_rows in (("qkv.m4", (3, 4)), ("gate_up.m16", (9, 15, 16))):
        dims = dict(problems.buckets("fp8_gemm", shapes))[bucket]
        problem = problems.make_problem("fp8_gemm", shapes, dims, "cpu")
        space = problems.config_space("fp8_gemm", shapes, dims)
        skinny = [c for c in space if fp8_gemm.is_skinny(c)][:3]
        assert skinny and problem.variants is not None
        keys.clear()
        for cfg in skinny:  # what tuning.tune runs for each config it times
            problem.launch(cfg, 0)
            problem.variants(cfg)
        built, served = set(keys), set()
        n, k = dims["n"], dims["k"]
        w = Fp8LinearWeight(*reference.quantize_fp8_rows(torch.randn(n, k)), None, "token")
        bias = torch.zeros(n, dtype=torch.bfloat16) if bucket.startswith("qkv") else None
        g = torch.ones(k, dtype=torch.bfloat16)
        for cfg in skinny:
            for rows in served_rows:
                x = torch.randn(rows, k, dtype=torch.bfloat16)
                for residual in (None, torch.randn(rows, k, dtype=torch.bfloat16)):
                    keys.clear()
                    fp8_gemm.fp8_skinny_norm_linear(x, residual, g, 1e-6, w, bias, cfg)
                    served |= keys
        assert served and served <= built, (bucket, served - built)
        keys.clear()
        fp8_gemm.fp8_skinny_linear(x, w.weight, w.weight_scale, "token", None, bias, torch.bfloat16, skinny[0])
        assert keys and not keys & served  # the norm's are variants of their own, which the plain launches do not compile
        norms.clear()
        tile = next(c for c in space if not fp8_gemm.is_skinny(c) and not fp8_gemm.is_scaled_mm(c))
        problem.launch(tile, 0)
        problem.variants(tile)
        assert norms[0] is True and False in norms  # the stream's norm, and layer 0's
