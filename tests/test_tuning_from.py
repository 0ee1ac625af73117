"""enginebuild --tuning-from: a build that keeps another build's kernel configs instead of choosing
anew, so two artifacts of the same shapes on the same GPU model run the same kernels (the tuner
itself runs on a GPU; here its choice on fake timings, the checks on the table reused, and the
build's refusals on the CPU)."""

from __future__ import annotations

import dataclasses
import json
import types
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from conftest import build_artifact
from tiny_models import make_checkpoint

from pagecast.builder import tune as tune_pass
from pagecast.builder.cli import main as enginebuild
from pagecast.kernels import problems, tuning
from pagecast.runtime.errors import BuildError

SHAPES = tuning.ModelShapes(9, 3, 64, 576, 1536, 16)


def _fake_tuner(monkeypatch: pytest.MonkeyPatch, speed: dict[str, float]) -> None:
    """silu_and_mul's real config space on a fake problem whose configs take speed[repr] us (10 else)."""
    problem = types.SimpleNamespace(launches_per_sample=lambda: 1, launch=lambda cfg, i: torch.ones(4),
                                    reference=None, marks={}, variants=None, apart=None)  # fmt: skip
    monkeypatch.setattr(problems, "make_problem", lambda *args, **kwargs: problem)
    monkeypatch.setattr(
        tuning, "time_launches", lambda launch, launches, reps: speed.get(repr(launch.args[0].as_dict()), 10.0)
    )
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "fake GPU")


def test_pinned_buckets_keep_the_reused_config_and_the_others_are_tuned(monkeypatch: pytest.MonkeyPatch) -> None:
    buckets = [b for b, _ in problems.buckets("silu_and_mul", SHAPES)]
    configs = problems.config_space("silu_and_mul", SHAPES, dict(problems.buckets("silu_and_mul", SHAPES))[buckets[0]])
    fast, slow = configs[1], configs[2]
    _fake_tuner(monkeypatch, {repr(fast.as_dict()): 1.0, repr(slow.as_dict()): 7.0})
    first = tuning.tune(["silu_and_mul"], SHAPES, budget_s=1e9, device="cpu")
    assert all(e["config"] == fast.as_dict() for e in first["kernels"]["silu_and_mul"].values())
    # Another build's table that chose the slow config at the first bucket and lacks the second.
    reused = json.loads(json.dumps(first))
    reused["kernels"]["silu_and_mul"] = {buckets[0]: {"config": slow.as_dict(), "time_us": 7.0, "tuned": True}}
    table = tuning.tune(["silu_and_mul"], SHAPES, budget_s=1e9, device="cpu", pinned=reused)
    entries = table["kernels"]["silu_and_mul"]
    assert entries[buckets[0]]["config"] == slow.as_dict() and entries[buckets[0]]["pinned"] is True
    assert entries[buckets[0]]["tuned"] is True and entries[buckets[0]]["alternatives"] == []
    assert entries[buckets[1]]["config"] == fast.as_dict() and "pinned" not in entries[buckets[1]]
    note = tune_pass.pinned_note(table, Path("a/tuning.json"))
    assert f"1 of {len(entries)} buckets reused from a/tuning.json" in note


def test_a_table_of_other_shapes_or_another_gpu_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_tuner(monkeypatch, {})
    table = tuning.tune(["silu_and_mul"], SHAPES, budget_s=1e9, device="cpu")
    table = json.loads(json.dumps(table))  # as read back from tuning.json
    assert tuning.check_pinned(table, SHAPES, "fake GPU") == table["kernels"]
    with pytest.raises(ValueError, match="tuned on a 'fake GPU', and this GPU is a 'NVIDIA H100'"):
        tuning.check_pinned(table, SHAPES, "NVIDIA H100")
    other = tuning.ModelShapes(9, 3, 64, 576, 2048, 16)
    with pytest.raises(ValueError, match="other model shapes: intermediate 1536 \\(this build: 2048\\)"):
        tuning.tune(["silu_and_mul"], other, budget_s=1e9, device="cpu", pinned=table)
    with pytest.raises(ValueError, match="not a tuning table"):
        tuning.check_pinned({"kernels": {}}, SHAPES, "fake GPU")
    # A table written before --fp8-lm-head existed (no such field) is still of these shapes.
    older = {**table, "shapes": {k: v for k, v in table["shapes"].items() if k != "fp8_lm_head"}}
    assert tuning.check_pinned(older, SHAPES, "fake GPU") == table["kernels"]
    # An FP8 LM head adds buckets of its own, so a table without its buckets serves a build with it.
    head = tuning.ModelShapes(9, 3, 64, 576, 1536, 16, fp8_lm_head=512)
    assert tuning.check_pinned(older, head, "fake GPU") == table["kernels"]
    # A table written before the router's fields existed (the "moe_router" buckets) serves a MoE
    # build whatever its routing; one that has them must agree.
    moe = tuning.ModelShapes(9, 3, 64, 576, 1536, 16, num_experts=8, top_k=2, moe_intermediate=64,
                             moe_renormalize=True, moe_router_bias=True)  # fmt: skip
    moe_table = {**table, "shapes": tuning.table_shapes(moe)}
    before = {**moe_table, "shapes": {k: v for k, v in moe_table["shapes"].items() if k not in tuning.ROUTER_FIELDS}}
    assert tuning.check_pinned(before, moe, "fake GPU") == table["kernels"]
    assert tuning.check_pinned(moe_table, moe, "fake GPU") == table["kernels"]
    other_routing = dataclasses.replace(moe, moe_scoring="topk_softmax")
    with pytest.raises(ValueError, match="moe_scoring 'softmax_topk' \\(this build: 'topk_softmax'\\)"):
        tuning.check_pinned(moe_table, other_routing, "fake GPU")


def test_the_table_is_read_from_an_artifact_directory_or_a_file_and_bad_ones_are_build_errors(tmp_path: Path) -> None:
    art = tmp_path / "art"
    art.mkdir()
    table = {"device": "fake GPU", "shapes": {}, "kernels": {"rms_norm": {"t1": {"config": {}}}}}
    (art / "tuning.json").write_text(json.dumps(table))
    assert tune_pass.pinned_table(art) == (art / "tuning.json", table)
    assert tune_pass.pinned_table(art / "tuning.json")[1] == table
    with pytest.raises(BuildError, match="does not exist"):
        tune_pass.pinned_table(tmp_path / "nowhere")
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(BuildError, match="not a readable JSON tuning table"):
        tune_pass.pinned_table(tmp_path / "bad.json")
    (tmp_path / "cpu.json").write_text(json.dumps({"device": "cpu", "tuned": False, "kernels": {}}))
    with pytest.raises(BuildError, match="holds no tuned kernels"):
        tune_pass.pinned_table(tmp_path / "cpu.json")


def test_the_table_path_reaches_the_tuner_subprocess(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """_tune_main (the subprocess a GPU build runs) reads the table and hands it to tuning.tune."""
    handed = []

    class Stop(Exception):
        pass

    def fake_tune(kernels, shapes, budget_s, device, pinned=None, log=None):  # type: ignore[no-untyped-def]
        handed.append(pinned)
        raise Stop

    monkeypatch.setattr(tuning, "tune", fake_tune)
    (tmp_path / "t.json").write_text(json.dumps({"kernels": {"rms_norm": {}}}))
    shapes = {"num_heads": 4, "num_kv_heads": 2, "head_dim": 16, "hidden": 64, "intermediate": 128, "block_size": 16}
    with pytest.raises(Stop):
        tune_pass._tune_main(json.dumps(shapes), "12", "", str(tmp_path / "t.json"))
    with pytest.raises(Stop):
        tune_pass._tune_main(json.dumps(shapes), "12", "", "")
    assert handed == [{"kernels": {"rms_norm": {}}}, None]


def test_a_build_without_the_gpu_refuses_tuning_from(tmp_path: Path) -> None:
    ckpt = make_checkpoint(tmp_path / "ckpt", "llama", tokenizer=False)
    (tmp_path / "t.json").write_text(json.dumps({"device": "NVIDIA H200", "kernels": {"rms_norm": {}}}))
    with pytest.raises(BuildError, match="a CPU artifact runs the torch reference kernels"):
        build_artifact(ckpt, tmp_path / "cpu", gpu="cpu", tuning_from=tmp_path / "t.json")
    if not torch.cuda.is_available():
        with pytest.raises(BuildError, match="no .* present; the configs it names are compiled on the GPU"):
            build_artifact(ckpt, tmp_path / "h200", gpu="h200", tuning_from=tmp_path / "t.json")
    result = CliRunner().invoke(enginebuild, ["--model", str(ckpt), "--gpu", "cpu", "--tuning-from", str(tmp_path / "x")])
    assert result.exit_code == 2 and "--tuning-from" in result.output
