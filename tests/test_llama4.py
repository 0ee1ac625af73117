"""Llama 4's parts that its end-to-end checks (test_moe_families.py's "llama4" case, test_image_text.py's
Llama4ForConditionalGeneration) cannot single out: the MoE block whose routing weight scales the
expert's input against transformers' own block, the rendered model's per-layer parts, the experts'
stacks in the artifact, a TP=2 build on gloo, and the refusal of top-k routing on the input."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import build_artifact
from tiny_models import make_checkpoint, tiny_config

from pagecast.kernels import ops
from pagecast.kernels.moe_routing import MoeRouting, moe_spec, route_torch
from pagecast.runtime.errors import BuildError


def _hf_block():  # type: ignore[no-untyped-def]
    from transformers.models.llama4.modeling_llama4 import Llama4TextMoe

    torch.manual_seed(0)
    block = Llama4TextMoe(tiny_config("llama4")).eval()
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.3)
    return block


def _engine_weights(block):  # type: ignore[no-untyped-def]
    """The block's weights in the engine's layout (kernels/moe_routing.py)."""
    from pagecast.kernels.moe_routing import SharedExpert

    gate_up = block.experts.gate_up_proj.detach().transpose(1, 2).contiguous()  # [E, 2I, H]: gate rows, then up
    down = block.experts.down_proj.detach().transpose(1, 2).contiguous()  # [E, H, I]
    s = block.shared_expert
    shared = SharedExpert(torch.cat((s.gate_proj.weight, s.up_proj.weight)).detach(), s.down_proj.weight.detach())
    return block.router.weight.detach(), gate_up, down, shared


def test_moe_block_weighs_the_experts_input_as_transformers_does():
    block = _hf_block()
    x = torch.randn(37, block.hidden_dim, generator=torch.Generator().manual_seed(1)) * 2
    with torch.no_grad():
        expected, _ = block(x)
    routing, act = moe_spec("Llama4ForCausalLM", tiny_config("llama4").to_dict())
    assert routing == MoeRouting(1, scoring="topk_sigmoid", weights_in_x_dtype=True, weights_on_input=True)
    router, gate_up, down, shared = _engine_weights(block)
    out = ops.moe(x, router, None, gate_up, down, routing=routing, activation=act, shared_expert=shared)
    # (2.3e-5 at most, with two BLAS threads; the weights on the outputs move it by over 1e-2)
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)
    # the same weights applied to the experts' outputs instead give another block
    on_output = MoeRouting(1, scoring="topk_sigmoid", weights_in_x_dtype=True)
    moved = ops.moe(x, router, None, gate_up, down, routing=on_output, activation=act, shared_expert=shared)
    assert (moved - expected).abs().max() > 1e-2


def test_topk_sigmoid_routing_is_the_sigmoid_of_the_top_logits():
    logits = torch.tensor([[0.5, -1.0, 2.0, 0.0], [-3.0, -2.0, -4.0, -2.5]])
    weights, ids = route_torch(logits, MoeRouting(1, scoring="topk_sigmoid", weights_in_x_dtype=True))
    assert ids.tolist() == [[2], [1]]
    torch.testing.assert_close(weights, torch.sigmoid(torch.tensor([[2.0], [-2.0]])))
    with pytest.raises(ValueError, match="top_k 1"):
        MoeRouting(2, scoring="topk_sigmoid", weights_on_input=True)


def test_rendered_model_and_artifact(tiny_artifact_factory, tiny_checkpoint_factory):  # type: ignore[no-untyped-def]
    """Layers 0-2 chunked (16 tokens) with weightless q/k norms, layer 3 neither, with the temperature;
    layers 1 and 3 MoE; the experts' [E, H, 2I] / [E, I, H] stacks stored as [E, 2I, H] / [E, H, I]."""
    from safetensors import safe_open

    art = tiny_artifact_factory("llama4")
    model_py = (art / "model.py").read_text()
    for line in (
        "CHUNKS = [16, 16, 16, 0]",
        "TEMPERATURE = ('llama4', 8.0, 0.5)",
        "TEMPERATURE_LAYERS = [False, False, False, True]",
        "QK_NORM_LAYERS = [True, True, True, False]",
        "MOE_LAYERS = [False, True, False, True]",
        "weights_on_input=True",
        "ROPE_OF_LAYER = [0, 0, 0, 1]",
    ):
        assert line in model_py, line
    with safe_open(str(art / "weights" / "rank0.safetensors"), "pt") as f:
        names = set(f.keys())
        gate_up, down = f.get_tensor("layers.1.experts.gate_up"), f.get_tensor("layers.1.experts.down")
        assert tuple(f.get_slice("layers.0.gate_up_proj.weight").get_shape()) == (2 * 96, 64)  # intermediate_size_mlp
    assert not any("q_norm" in n or "k_norm" in n for n in names)  # weightless: the model code's ones
    with safe_open(str(tiny_checkpoint_factory("llama4") / "model.safetensors"), "pt") as c:
        stacked = c.get_tensor("model.layers.1.feed_forward.experts.gate_up_proj")  # [E, H, 2I]
        stacked_down = c.get_tensor("model.layers.1.feed_forward.experts.down_proj")  # [E, I, H]
    torch.testing.assert_close(gate_up, stacked.transpose(1, 2))
    torch.testing.assert_close(down, stacked_down.transpose(1, 2))
    manifest = json.loads((art / "manifest.json").read_text())
    assert manifest["architecture"] == "Llama4ForCausalLM" and manifest["family"] == "llama4"


def test_tp2_matches_transformers(tiny_checkpoint_factory, tmp_path):  # type: ignore[no-untyped-def]
    """TP=2 on gloo: each rank two of the four query heads (and one KV head), half of every expert's,
    the shared expert's and the dense layers' intermediate columns."""
    from test_moe_families import assert_tp_greedy_matches

    ckpt = tiny_checkpoint_factory("llama4")
    assert_tp_greedy_matches(build_artifact(ckpt, tmp_path / "tp2", tp=2), ckpt)


def test_top2_routing_on_the_input_is_refused(tmp_path):
    ckpt = make_checkpoint(tmp_path / "ckpt", "llama4", tokenizer=False, num_experts_per_tok=2)
    with pytest.raises(BuildError, match="top_k 1"):
        build_artifact(ckpt, tmp_path / "art")


def test_tuner_compiles_the_rotary_variants_the_layers_launch(tiny_checkpoint_factory, tmp_path, monkeypatch):  # type: ignore[no-untyped-def]
    """Llama 4's RoPE layers launch the rotary kernel with their q/k norms after the rotation
    (QK_NORM_AFTER), its no-RoPE layer without norms: the build tells the tuner both, its rotary
    problems time the first and compile the second (Problem.variants), and the chunked attention
    variants are compiled at the model's chunk, so serving compiles none of them."""
    from test_tuned_variants import _build

    from pagecast.builder import tune
    from pagecast.kernels import problems, rotary_kv

    _, shapes = _build(tiny_checkpoint_factory("llama4"), tmp_path / "art", monkeypatch)
    assert (shapes["head_qk_norm"], shapes["head_qk_norm_after"], shapes["rotary_without_norm"]) == (True, True, True)
    assert shapes["attn_chunk"] == 16 and shapes["attn_window"] == 0
    seen: list[tuple[bool, bool]] = []
    monkeypatch.setattr(
        rotary_kv, "rotary_and_write_kv",
        lambda *a, q_norm=None, qk_norm_after=False, **k: seen.append((q_norm is not None, qk_norm_after)),
    )  # fmt: skip
    kernel_shapes = tune.kernel_shapes(shapes)
    for _, dims in problems.buckets("rotary_kv", kernel_shapes)[:2]:
        problem = problems.make_problem("rotary_kv", kernel_shapes, dims, "cpu")
        problem.launch(None, 0)
        assert problem.variants is not None
        problem.variants(None)
    assert seen == [(True, True), (False, False)] * 2


def test_a_config_transformers_rejects_is_a_build_error_naming_the_field(tmp_path):
    """A config.json field of the wrong type (Llama 4's attn_temperature_tuning as a number, as
    early Llama 4 configs had it) is a BuildError naming the field, not a traceback."""
    ckpt = make_checkpoint(tmp_path / "ckpt", "llama4", tokenizer=False)
    config = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**config, "attn_temperature_tuning": 4}))
    with pytest.raises(BuildError, match="cannot read .*config.json as a Llama4ForCausalLM config.*attn_temperature_tuning"):
        build_artifact(ckpt, tmp_path / "art")
