"""The builder's passes and what they write into the artifact."""

from __future__ import annotations

import json

from conftest import build_artifact

from pagecast.builder.ir import BuildOptions
from pagecast.builder.pipeline import PASSES, build


def test_artifact_layout_and_plan(tiny_llama_artifact):  # type: ignore[no-untyped-def]
    art = tiny_llama_artifact
    manifest = json.loads((art / "manifest.json").read_text())
    plan = json.loads((art / "memory_plan.json").read_text())
    dims = manifest["dims"]
    assert (dims["num_layers"], dims["num_heads"], dims["num_kv_heads"], dims["head_dim"]) == (3, 6, 2, 16)
    # K and V, every layer, fp32 on the CPU
    assert plan["bytes_per_token"] == 2 * 3 * 2 * 16 * 4
    assert plan["bytes_per_block"] == plan["bytes_per_token"] * manifest["block_size"]
    assert plan["cuda_graph_batch_sizes"][0] == 1 and plan["cuda_graph_batch_sizes"][-1] == 256
    assert manifest["target"] == {"kind": "cpu", "name": "cpu", "compute_capability": None, "tuned": False}
    assert set(manifest["files"]) == {
        p.relative_to(art).as_posix() for p in art.rglob("*") if p.is_file() and p.name != "manifest.json"
    }
    model_py = (art / "model.py").read_text()
    assert "NUM_KV_HEADS = 2" in model_py and "QK_NORM_EPS" not in model_py  # llama: no q/k norm
    assert "# Tuning" not in model_py and "## Tuning" in (art / "report.md").read_text()


def test_qwen3_renders_qk_norm_and_qwen2_bias(tiny_artifact_factory):  # type: ignore[no-untyped-def]
    qwen3 = (tiny_artifact_factory("qwen3") / "model.py").read_text()
    # per-head q/k norms: inside the rotary kernel's launch, not rms_norm launches of their own
    assert "QK_NORM_EPS" in qwen3 and "q_norm=q_norm, k_norm=k_norm, qk_norm_eps=QK_NORM_EPS" in qwen3
    assert "ops.rms_norm(q" not in qwen3
    qwen2 = (tiny_artifact_factory("qwen2") / "model.py").read_text()
    assert 'weights[p + "qkv_proj.bias"]' in qwen2


def test_dump_ir_after_each_pass(tmp_path, tiny_llama_checkpoint):  # type: ignore[no-untyped-def]
    dump = tmp_path / "ir"
    build(BuildOptions(model=str(tiny_llama_checkpoint), output=tmp_path / "art", quiet=True), dump_ir=dump)
    names = sorted(p.name for p in dump.iterdir())
    assert names == [f"{i:02d}-{name}.json" for i, (name, _) in enumerate(PASSES)]
    lowered = json.loads((dump / "02-lower.json").read_text())
    assert lowered["model"]["layers"][0]["attention"]["num_kv_heads"] == 2
    planned = json.loads((dump / "03-plan.json").read_text())
    assert any(t.startswith("layers.0.qkv_proj.weight <- model.layers.0.self_attn.q_proj.weight+")
               for t in planned["plan"]["tensors"])


def test_rebuild_is_reproducible(tmp_path, tiny_llama_checkpoint):  # type: ignore[no-untyped-def]
    a = json.loads((build_artifact(tiny_llama_checkpoint, tmp_path / "a") / "manifest.json").read_text())
    b = json.loads((build_artifact(tiny_llama_checkpoint, tmp_path / "b") / "manifest.json").read_text())
    assert a["files"] == b["files"]  # same checkpoint, same options: byte-identical artifact files
