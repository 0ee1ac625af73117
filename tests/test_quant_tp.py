"""AWQ / GPTQ artifacts built with --tp 2, run on the CPU (gloo) against transformers.

Tiny random checkpoints are quantised by tests/quant_writer.py; each TP=2 engine (rank 0 plus a
spawned worker, each on its own int4 shard through the torch reference path) must give the
greedy tokens transformers gives on the exact dequantization of the same checkpoint. The cases
cover column-parallel q/k/v with KV heads split and with one KV head replicated on both ranks,
row-parallel o_proj / down_proj in whole groups, GPTQ act-order (down_proj's order folded into
gate_up's output columns and bias; o_proj's shards padded to whole groups), biases, and a split
that would cut a group, refused at build.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import build_artifact
from engine_utils import hf_greedy
from quant_writer import Format, write
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from pagecast.runtime import LLM, SamplingParams
from pagecast.runtime.artifact import load_manifest
from pagecast.runtime.errors import BuildError

# hidden 128 and q 4 x 32 = 128: o_proj has 64 inputs per rank at TP=2, down_proj 384 / 2 = 192;
# groups of 32 and 64 divide both.
SHAPE = {"hidden_size": 128, "intermediate_size": 384, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32}
PROMPTS = [[1, 504, 3458, 22, 333, 17], [5, 6, 7], list(range(100, 140))]
MAX_TOKENS = 10
ENGINE = {"max_num_seqs": 4, "max_num_batched_tokens": 64}

CASES = {
    # 2 KV heads: one per rank; qwen2's q/k/v biases cut with their heads.
    "awq-g64-qwen2-bias": ("qwen2", {}, Format("awq", 64)),
    # Act-order: o_proj's groups spread over both ranks' heads (padded shards), down_proj's order
    # folded into gate_up's output columns and their biases.
    "gptq-g64-sym-actorder-mlp-bias": ("llama", {"mlp_bias": True}, Format("gptq", 64, sym=True, desc_act=True)),
    # No act-order; one KV head, replicated on both ranks; q/k/v/o biases.
    "gptq_v2-g32-asym-one-kv-replicated": (
        "llama", {"num_key_value_heads": 1, "attention_bias": True}, Format("gptq", 32, checkpoint_format="gptq_v2"),
    ),
    # Per channel (one group of K): a row-parallel slice is one group of K / 2 with the same scales.
    "gptq-perchannel-asym-actorder": ("llama", {}, Format("gptq", -1, sym=False, desc_act=True)),
}  # fmt: skip


def _with_random_biases(src: Path, dst: Path) -> Path:
    """A copy of a float checkpoint whose biases are random (transformers initialises them to zero,
    which would hide a bias cut or reordered wrongly)."""
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    gen = torch.Generator().manual_seed(7)
    for name, t in tensors.items():
        if name.endswith(".bias"):
            tensors[name] = torch.randn(t.shape, generator=gen) * 0.3
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="module")
def quantised_tp2(tiny_checkpoint_factory, tmp_path_factory):  # type: ignore[no-untyped-def]
    """case -> (quantised checkpoint, its exact dequantization, its TP=2 artifact)."""
    made: dict[str, tuple[Path, Path, Path]] = {}

    def make(case: str) -> tuple[Path, Path, Path]:
        if case not in made:
            family, overrides, fmt = CASES[case]
            root = tmp_path_factory.mktemp(f"qtp-{case}")
            src = _with_random_biases(tiny_checkpoint_factory(family, **{**SHAPE, **overrides}), root / "float")
            ckpt, deq = write(src, root / case, fmt)
            made[case] = (ckpt, deq, build_artifact(ckpt, root / "engine", gpu="cpu", tp=2))
        return made[case]

    return make


def _generate(artifact: Path, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    llm = LLM(artifact, **ENGINE)
    try:
        workers = llm.engine.runner.workers
        assert (workers is not None and len(workers.procs) == 1) == (load_manifest(artifact).tp == 2)
        outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    finally:
        llm.engine.runner.close()
    return [o.token_ids for o in outputs]


@pytest.mark.parametrize("case", list(CASES))
def test_tp2_int4_greedy_tokens_equal_transformers_on_the_exact_dequantization(case, quantised_tp2):  # type: ignore[no-untyped-def]
    _, deq, artifact = quantised_tp2(case)
    tokens = _generate(artifact, PROMPTS, MAX_TOKENS)
    hf = AutoModelForCausalLM.from_pretrained(str(deq), dtype=torch.float32).eval()
    for ids, out in zip(PROMPTS, tokens, strict=True):
        assert out == hf_greedy(hf, ids, MAX_TOKENS)


def test_tp2_act_order_matches_its_tp1_build(quantised_tp2, tmp_path):  # type: ignore[no-untyped-def]
    ckpt, _, tp2 = quantised_tp2("gptq-g64-sym-actorder-mlp-bias")
    tp1 = build_artifact(ckpt, tmp_path / "tp1", gpu="cpu")
    assert _generate(tp2, PROMPTS, MAX_TOKENS) == _generate(tp1, PROMPTS, MAX_TOKENS)


def test_tp2_of_a_real_tool_checkpoint_matches_its_tp1_build(tmp_path):  # type: ignore[no-untyped-def]
    """auto-round's GPTQ export (tests/fixtures/quant; its TP=1 build equals transformers in
    test_quant_fixtures.py) gives the same greedy tokens at TP=2."""
    fixture = Path(__file__).parent / "fixtures" / "quant" / "autoround-gptq-g64-asym"
    tp2 = build_artifact(fixture, tmp_path / "tp2", gpu="cpu", tp=2)
    tp1 = build_artifact(fixture, tmp_path / "tp1", gpu="cpu")
    prompts = [[1, 50, 200, 7, 300, 11], [400, 3, 99], list(range(20, 60))]  # its vocabulary is 512
    assert _generate(tp2, prompts, MAX_TOKENS) == _generate(tp1, prompts, MAX_TOKENS)


def _shapes(artifact: Path, rank: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    with safe_open(str(artifact / "weights" / f"rank{rank}.safetensors"), "pt") as f:
        return {k: (tuple(f.get_slice(k).get_shape()), f.get_tensor(k).dtype) for k in f.keys()}  # noqa: SIM118


def test_tp2_int4_artifact_holds_each_ranks_groups(quantised_tp2):  # type: ignore[no-untyped-def]
    _, _, artifact = quantised_tp2("gptq-g64-sym-actorder-mlp-bias")
    manifest = load_manifest(artifact)
    assert manifest.tp == 2 and manifest.quant == "gptq" and manifest.quantization["desc_act"]
    assert manifest.layout["num_heads"] == 2 and manifest.layout["num_kv_heads"] == 1
    assert manifest.layout["intermediate_size"] == 192 and manifest.layout["weights"] == "files"
    shapes = [_shapes(artifact, r) for r in (0, 1)]
    assert shapes[0] == shapes[1]
    s = shapes[0]
    # Column-parallel: all 128 inputs (and their act-order perm), this rank's 2 query + 1 KV head.
    assert s["layers.0.qkv_proj.qweight"] == ((128 // 8, (2 + 2 * 1) * 32), torch.int32)
    assert s["layers.0.qkv_proj.perm"] == ((128,), torch.int32)
    assert s["layers.0.gate_up_proj.qweight"] == ((128 // 8, 2 * 192), torch.int32)
    assert s["layers.0.gate_up_proj.bias"][0] == (2 * 192,)
    # Row-parallel down_proj: 192 inputs = 3 whole groups of 64, in gate_up's (folded) order: no perm.
    assert s["layers.0.down_proj.qweight"] == ((192 // 8, 128), torch.int32)
    assert s["layers.0.down_proj.scales"][0] == (3, 128) and "layers.0.down_proj.perm" not in s
    assert s["layers.0.down_proj.bias"][0] == (128,)  # whole, added after the all-reduce
    # Row-parallel o_proj: each rank's 64 inputs (its 2 heads) hold members of both act-order groups of
    # 64, so each rank holds both groups, padded with zero weights: 128 inputs, a perm into its 64.
    assert s["layers.0.o_proj.qweight"] == ((128 // 8, 128), torch.int32)
    assert s["layers.0.o_proj.scales"][0] == (2, 128) and s["layers.0.o_proj.perm"][0] == (128,)
    with safe_open(str(artifact / "weights" / "rank1.safetensors"), "pt") as f:
        perm = f.get_tensor("layers.0.o_proj.perm")
    assert int(perm.min()) >= 0 and int(perm.max()) < 64  # rank 1 reads only its own heads' outputs
    # Memory plan: one rank's bytes, int4 parts at their own size.
    plan = json.loads((artifact / "memory_plan.json").read_text())
    header = json.loads((artifact / "weights" / "rank0.safetensors").read_bytes()[8 : 8 + int.from_bytes(
        (artifact / "weights" / "rank0.safetensors").read_bytes()[:8], "little")])  # fmt: skip
    header.pop("__metadata__", None)
    assert plan["tp"] == 2 and plan["weight_bytes"] == sum(v["data_offsets"][1] - v["data_offsets"][0] for v in header.values())
    report = (artifact / "report.md").read_text()
    assert "tensor parallel: 2 ranks" in report and "GPTQ (gptq), 4-bit, group size 64" in report
    assert "Tensor parallel (2 ranks): qkv_proj and gate_up_proj int4 weights split by output columns" in report
    assert "act-order o_proj at --tp 2" in report and "in 3 of 3 layers each rank's 64 inputs are padded" in report


@pytest.mark.parametrize(
    "shape,group,tp,message",
    [
        (SHAPE, 64, 4,
         r"--tp 4: layers.0.o_proj \(model.layers.0.self_attn.o_proj\) is row-parallel and 128 inputs / 4 ranks = 32 "
         r"inputs per rank is not a multiple of the quantisation group size 64"),
        ({**SHAPE, "hidden_size": 256, "head_dim": 64}, 128, 2,
         r"--tp 2: layers.0.down_proj \(model.layers.0.mlp.down_proj\) is row-parallel and 384 inputs / 2 ranks = "
         r"192 inputs per rank is not a multiple of the quantisation group size 128"),
    ],
)  # fmt: skip
def test_tp_that_would_cut_a_group_is_refused_at_build(shape, group, tp, message, tiny_checkpoint_factory, tmp_path):  # type: ignore[no-untyped-def]
    ckpt, _ = write(tiny_checkpoint_factory("llama", **shape), tmp_path / "q", Format("gptq", group, sym=True))
    with pytest.raises(BuildError, match=message):
        build_artifact(ckpt, tmp_path / "cut", gpu="cpu", tp=tp)
    assert not (tmp_path / "cut").exists()
    build_artifact(ckpt, tmp_path / "tp1", gpu="cpu")  # the same checkpoint builds at --tp 1


def test_dummy_int4_weights_with_tp2(tmp_path):  # type: ignore[no-untyped-def]
    from tiny_models import tiny_config

    config_dir = tmp_path / "config-only"  # groups of 128: o_proj 256 / 2 and down_proj 512 / 2 hold whole ones
    tiny_config("llama", **{**SHAPE, "hidden_size": 256, "head_dim": 64, "intermediate_size": 512}).save_pretrained(
        str(config_dir)
    )
    artifact = build_artifact(config_dir, tmp_path / "engine", gpu="cpu", load_format="dummy", quant="gptq", tp=2)
    manifest = load_manifest(artifact)
    assert manifest.tp == 2 and manifest.quantization["group_size"] == 128 and not manifest.random_weights
    shapes = [_shapes(artifact, r) for r in (0, 1)]
    assert shapes[0] == shapes[1]
    assert shapes[0]["layers.1.o_proj.qweight"] == ((128 // 8, 256), torch.int32)
    assert shapes[0]["layers.1.down_proj.scales"] == ((2, 256), torch.float32)
    assert shapes[0]["layers.1.qkv_proj.qweight"] == ((256 // 8, (2 + 2 * 1) * 64), torch.int32)
    tokens = _generate(artifact, [[1, 2, 3]], 4)
    assert len(tokens[0]) == 4
