"""FP8 (W8A8) mixture-of-experts on the CPU, in fp32: ``--quant fp8`` on tiny Qwen3-MoE, Mixtral,
Qwen2-MoE, OLMoE, gpt-oss, Granite-MoE, GLM-4.5 and Llama 4 (its routing weight on the experts' input) checkpoints, and FP8 MoE checkpoints as published (the Qwen3 fine-grained block
format, compressed-tensors FP8_DYNAMIC per channel and FP8_BLOCK, written by tests/quant_writer.py), through
LLM against transformers; the fused FP8 MoE kernels (kernels/fused_moe_fp8.py) in Triton's
interpreter against the reference; the memory plan and the refusals.

The reference is transformers' model with every projection's and every expert's weight replaced
by its dequantised value (computed here from the checkpoint as the format documents it, not by
pagecast) and every projection's and expert's input fake-quantised (per token, or per 1x128 group
with block weights; quantise then dequantise), the experts' loop written here: the router (and
the shared-expert gate) stay in the float type. The artifact runs the exact CPU emulation, so
greedy tokens must agree.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch
from conftest import build_artifact
from engine_utils import engine_last_logits, hf_greedy, near_tie_divergences
from quant_writer import write_fp8
from safetensors import safe_open

from pagecast.kernels import problems, reference
from pagecast.kernels.tuning import KernelConfig, ModelShapes
from pagecast.runtime import LLM, SamplingParams
from pagecast.runtime.errors import BuildError

E4M3_MAX = 448.0
PROMPTS = [[1, 50, 200, 7, 300, 11], [400, 3, 99], list(range(20, 60))]
MAX_TOKENS = 8
NEAR_TIE = 0.2
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# checkpoint expert module -> (the stacked parameter, gate or up half or whole)
EXPERT_PARTS = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1), "down_proj": ("down_proj", None),
                "w1": ("gate_up_proj", 0), "w3": ("gate_up_proj", 1), "w2": ("down_proj", None)}  # fmt: skip
EXPERT = re.compile(r"model\.layers\.(\d+)\..*experts\.(\d+)\.(\w+)\.weight")


# ---------------------------------------------------------------------------- the reference


def fake_quant(x: torch.Tensor, activations: str) -> torch.Tensor:
    """x [.., K] quantised to e4m3 and back per row ("token") or per 1x128 group ("group")."""
    shape = x.shape
    x = x.reshape(-1, shape[-1]).float()
    if activations == "token":
        s = x.abs().amax(-1, keepdim=True).clamp_min(1e-12) / E4M3_MAX
    else:
        k = x.shape[1]
        pad = torch.nn.functional.pad(x, (0, -k % 128)).view(x.shape[0], -1, 128)
        s = (pad.abs().amax(-1, keepdim=True).clamp_min(1e-12) / E4M3_MAX).expand(-1, -1, 128).reshape(x.shape[0], -1)[:, :k]
    return ((x / s).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float() * s).reshape(shape)


def per_channel(w: torch.Tensor) -> torch.Tensor:
    """--quant fp8's weight, dequantised: each output row's amax / 448, e4m3, times the scale."""
    s = w.float().abs().amax(1, keepdim=True).clamp_min(1e-12) / E4M3_MAX
    return (w.float() / s).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float() * s


def per_block(w: torch.Tensor) -> torch.Tensor:
    """--quant fp8 --fp8-scheme block's weight, dequantised: each 128x128 block's amax / 448 (the
    test writer's fine-grained block format)."""
    from quant_writer import fp8_quantise

    return fp8_quantise(w, "fp8-block")[1]


# Granite-MoE's stacked experts, as the checkpoint names them -> as transformers' model does
GRANITE_STACKED = {"input_linear.weight": "experts.gate_up_proj", "output_linear.weight": "experts.down_proj"}


def quantised_modules(ckpt: Path, quantise=per_channel) -> dict[str, torch.Tensor]:  # type: ignore[no-untyped-def]
    """--quant fp8 on a float checkpoint: every projection and expert module, dequantised. gpt-oss
    stacks its experts as [E, in, out] (gate/up interleaved by column): each output column its own."""
    out = {}
    with safe_open(str(ckpt / "model.safetensors"), "pt") as f:
        for name in set(f.keys()):
            module = name.removesuffix(".weight")
            if name.endswith(".weight") and module.rpartition(".")[2] in LINEARS + ("w1", "w2", "w3"):
                out[name] = quantise(f.get_tensor(name))
            elif name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                out[name] = torch.stack([quantise(w.t()).t() for w in f.get_tensor(name)])
            elif name.endswith(tuple(GRANITE_STACKED)):  # [E, out, in]: under transformers' experts' names
                for suffix, param in GRANITE_STACKED.items():
                    name = name.replace(suffix, param)
                out[name] = torch.stack([quantise(w) for w in f.get_tensor(module + ".weight")])
    return out


def _experts_forward(experts: torch.nn.Module, activations: str):  # type: ignore[no-untyped-def]
    """transformers' experts loop with each expert's inputs fake-quantised (gate_up's and down's)."""

    def forward(hidden, top_k_index, top_k_weights):  # type: ignore[no-untyped-def]
        out = torch.zeros_like(hidden)
        for e in torch.unique(top_k_index).tolist():
            token, slot = torch.where(top_k_index == e)
            gate, up = torch.nn.functional.linear(fake_quant(hidden[token], activations), experts.gate_up_proj[e]).chunk(2, -1)
            h = torch.nn.functional.linear(fake_quant(experts.act_fn(gate) * up, activations), experts.down_proj[e])
            out.index_add_(0, token, h * top_k_weights[token, slot, None])
        return out

    return forward


def _gpt_oss_experts_forward(experts: torch.nn.Module, activations: str):  # type: ignore[no-untyped-def]
    """GptOssExperts' loop with each expert's inputs fake-quantised; biases and its clamped SwiGLU as transformers'."""

    def forward(hidden, router_indices, routing_weights):  # type: ignore[no-untyped-def]
        out = torch.zeros_like(hidden)
        for e in torch.unique(router_indices).tolist():
            token, slot = torch.where(router_indices == e)
            gate_up = fake_quant(hidden[token], activations) @ experts.gate_up_proj[e] + experts.gate_up_proj_bias[e]
            h = fake_quant(experts._apply_gate(gate_up), activations) @ experts.down_proj[e] + experts.down_proj_bias[e]
            out.index_add_(0, token, h * routing_weights[token, slot, None])
        return out

    return forward


def _llama4_experts_forward(experts: torch.nn.Module, activations: str):  # type: ignore[no-untyped-def]
    """Llama4TextExperts' batched experts (each expert's rows: every token's input scaled by its
    routing weight, zero where the expert was not chosen) with each expert's inputs fake-quantised."""

    def forward(hidden):  # type: ignore[no-untyped-def]
        rows = hidden.view(experts.num_experts, -1, experts.hidden_size)
        out = []
        for e in range(experts.num_experts):
            gate, up = (fake_quant(rows[e], activations) @ experts.gate_up_proj[e]).chunk(2, -1)
            out.append(fake_quant(experts.act_fn(gate) * up, activations) @ experts.down_proj[e])
        return torch.cat(out)

    return forward


def reference_model(
    ckpt: Path, weights: dict[str, torch.Tensor], activations: str, written: Path | None = None
) -> torch.nn.Module:
    """The float checkpoint with ``weights`` (checkpoint name -> dequantised fp32) put in place, and
    the unquantised tensors of ``written`` (a written FP8 checkpoint: bf16 there) too."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32).eval()
    if written is not None:
        state = hf.state_dict()
        with safe_open(str(written / "model.safetensors"), "pt") as f, torch.no_grad():
            for name in set(f.keys()):
                if name in state and name not in weights and f.get_slice(name).get_dtype() != "F8_E4M3":
                    state[name].copy_(f.get_tensor(name).float())
    experts = {int(n.split(".")[2]): m for n, m in hf.named_modules() if n.endswith("experts") and hasattr(m, "gate_up_proj")}
    with torch.no_grad():
        state = hf.state_dict()
        for name, w in weights.items():
            found = EXPERT.fullmatch(name)
            if name in state:
                state[name].copy_(w)
            elif found and found.group(3) in EXPERT_PARTS:
                layer, e, proj = int(found.group(1)), int(found.group(2)), found.group(3)
                param, half = EXPERT_PARTS[proj]
                target = getattr(experts[layer], param)[e]
                if type(experts[layer]).__name__ == "Llama4TextExperts":  # stacked inputs first: [H, 2I], [I, H]
                    target = target.t()
                target = target if half is None else target.chunk(2, 0)[half]
                target.copy_(w)
            else:
                hf.get_submodule(name.removesuffix(".weight")).weight.copy_(w)
    for name, module in hf.named_modules():
        if name.rpartition(".")[2] in LINEARS and ".experts." not in name:
            module.register_forward_pre_hook(lambda mod, args: (fake_quant(args[0], activations),))
    for module in experts.values():
        if type(module).__name__ == "Llama4TextExperts":
            module.forward = _llama4_experts_forward(module, activations)
            continue
        gpt_oss = hasattr(module, "gate_up_proj_bias")
        module.forward = (_gpt_oss_experts_forward if gpt_oss else _experts_forward)(module, activations)
    return hf


def _assert_greedy_parity(artifact: Path, hf: torch.nn.Module, logits_atol: float = 2e-3) -> None:
    llm = LLM(artifact, max_num_seqs=4, max_num_batched_tokens=64, kv_cache_memory="64MiB")
    try:
        outputs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
        logits = engine_last_logits(llm.engine, PROMPTS[2])
    finally:
        llm.engine.runner.close()
    # As tests/test_fp8_build.py: an activation within an fp32 rounding of an e4m3 boundary may
    # round the other way where sums run in another order (transformers' cached decode against
    # its own full forward too); a divergence is accepted only at a near tie of the reference.
    diverged = near_tie_divergences(hf, PROMPTS, [o.token_ids for o in outputs], MAX_TOKENS, NEAR_TIE)
    assert diverged <= 1, "more than one prompt diverged from the reference"
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPTS[2]])).logits[0, -1]
    torch.testing.assert_close(logits.cpu(), ref, atol=logits_atol, rtol=0)


# ---------------------------------------------------------------------------- --quant fp8 on float MoE checkpoints


@pytest.mark.parametrize(
    "family", ["qwen3_moe", "mixtral", "qwen2_moe", "olmoe", "gpt_oss", "granitemoe", "glm4_moe", "llama4"]
)
def test_quant_fp8_moe_greedy_tokens_equal_transformers_with_fp8_experts(family, tiny_checkpoint_factory, tmp_path):  # type: ignore[no-untyped-def]
    ckpt = tiny_checkpoint_factory(family)
    artifact = build_artifact(ckpt, tmp_path / "engine", gpu="cpu", quant="fp8")
    hf = reference_model(ckpt, quantised_modules(ckpt), "token")
    _assert_greedy_parity(artifact, hf)
    # the reference is not the float model: the fp8 experts move its logits
    from transformers import AutoModelForCausalLM

    float_model = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32).eval()
    with torch.no_grad():
        moved = float_model(torch.tensor([PROMPTS[2]])).logits[0, -1] - hf(torch.tensor([PROMPTS[2]])).logits[0, -1]
    assert moved.abs().max() > 1e-3
    with safe_open(str(artifact / "weights" / "rank0.safetensors"), "pt") as f:
        names = set(f.keys())
        layer = 1
        gu = f.get_tensor(f"layers.{layer}.experts.gate_up")
        assert gu.dtype == torch.float8_e4m3fn and f.get_tensor(f"layers.{layer}.experts.gate_up_scale").shape == gu.shape[:2]
        assert f.get_tensor(f"layers.{layer}.experts.down_scale").dtype == torch.float32
        assert f.get_tensor(f"layers.{layer}.router.weight").dtype == torch.float32  # the router stays float
        if family == "qwen2_moe":
            assert f.get_tensor(f"layers.{layer}.shared_expert.gate_up_proj.weight").dtype == torch.float8_e4m3fn
            assert f"layers.{layer}.shared_expert.gate_up_proj.weight_scale" in names
            assert f.get_tensor(f"layers.{layer}.shared_expert_gate.weight").dtype == torch.float32
    # The memory plan counts the fp8 experts at one byte an element: it equals the file's bytes.
    plan = json.loads((artifact / "memory_plan.json").read_text())
    raw = (artifact / "weights" / "rank0.safetensors").read_bytes()
    header = json.loads(raw[8 : 8 + int.from_bytes(raw[:8], "little")])
    header.pop("__metadata__", None)
    assert plan["weight_bytes"] == sum(v["data_offsets"][1] - v["data_offsets"][0] for v in header.values())


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe"])
def test_quant_fp8_block_scheme_moe_greedy_tokens_equal_transformers(family, tiny_checkpoint_factory, tmp_path):  # type: ignore[no-untyped-def]
    """--quant fp8 --fp8-scheme block on a float MoE checkpoint: experts and projections in 128x128
    weight blocks, activations per 1x128 group (the FP8 MoE kernels' block path). Hidden 160 and
    experts 144 wide: partial blocks and more than one activation group, as the written block
    checkpoint's test has them."""
    ckpt = tiny_checkpoint_factory(family, hidden_size=160, moe_intermediate_size=144, num_hidden_layers=2)
    artifact = build_artifact(ckpt, tmp_path / "engine", gpu="cpu", quant="fp8", fp8_scheme="block")
    assert json.loads((artifact / "manifest.json").read_text())["quantization"]["weights"] == "block"
    _assert_greedy_parity(artifact, reference_model(ckpt, quantised_modules(ckpt, per_block), "group"))


def test_quant_fp8_moe_tp2_greedy_tokens_equal_transformers(tiny_checkpoint_factory, tmp_path):  # type: ignore[no-untyped-def]
    """TP=2 on gloo (Qwen2-MoE: a dense layer, the gated shared expert): each rank holds half of every
    expert's intermediate rows with their scales (gate_up) and the whole per-channel scales of down;
    per-token scales of down's input are each rank's own (over its half), so the reference differs
    from the engine there by rounding: tokens up to near ties."""
    ckpt = tiny_checkpoint_factory("qwen2_moe")
    artifact = build_artifact(ckpt, tmp_path / "tp2", gpu="cpu", quant="fp8", tp=2)
    with safe_open(str(artifact / "weights" / "rank1.safetensors"), "pt") as f:
        assert f.get_tensor("layers.1.experts.gate_up").shape == (8, 32, 64)
        assert f.get_tensor("layers.1.experts.gate_up_scale").shape == (8, 32)
        assert f.get_tensor("layers.1.experts.down").shape == (8, 64, 16)
        assert f.get_tensor("layers.1.experts.down_scale").shape == (8, 64)
    with safe_open(str(artifact / "weights" / "rank0.safetensors"), "pt") as f0, safe_open(str(artifact / "weights" / "rank1.safetensors"), "pt") as f1:
        both = torch.cat([f0.get_tensor("layers.1.experts.gate_up")[:, 16:32], f1.get_tensor("layers.1.experts.gate_up")[:, 16:32]], 1)
    with safe_open(str(ckpt / "model.safetensors"), "pt") as f:  # expert 0's up rows, both halves
        up = f.get_tensor("model.layers.1.mlp.experts.0.up_proj.weight")
    s = up.abs().amax(1, keepdim=True) / E4M3_MAX
    assert torch.equal(both[0].view(torch.uint8), (up / s).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8))
    hf = reference_model(ckpt, quantised_modules(ckpt), "token")
    llm = LLM(artifact, max_num_batched_tokens=32, max_num_seqs=4, kv_cache_memory="4MiB")
    try:
        outputs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    finally:
        llm.engine.runner.close()
    diverged = near_tie_divergences(hf, PROMPTS, [o.token_ids for o in outputs], MAX_TOKENS, NEAR_TIE)
    assert len(PROMPTS) - diverged >= 2


def test_block_fp8_moe_checkpoint_tp2_greedy_tokens_equal_transformers(tiny_checkpoint_factory, tmp_path):  # type: ignore[no-untyped-def]
    """The fine-grained block format at TP=2 on gloo: each rank holds 128 of every expert's 256
    intermediate columns, so down's block scales are cut at a block boundary and its 1x128 activation
    groups are the same as at TP=1."""
    src = tiny_checkpoint_factory("qwen3_moe", hidden_size=256, head_dim=64, moe_intermediate_size=256, num_hidden_layers=2)
    ckpt, deq = _written(src, tmp_path / "block", "fp8-block")
    artifact = build_artifact(ckpt, tmp_path / "tp2", gpu="cpu", tp=2)
    with safe_open(str(artifact / "weights" / "rank1.safetensors"), "pt") as f:
        assert f.get_tensor("layers.0.experts.down_scale").shape == (8, 256, 1)
        assert f.get_tensor("layers.0.experts.gate_up_scale").shape == (8, 256, 2)
    with safe_open(str(ckpt / "model.safetensors"), "pt") as f, safe_open(str(artifact / "weights" / "rank1.safetensors"), "pt") as a:
        # rank 1's down scales of expert 3: the checkpoint's second column block, repeated over rows
        expected = f.get_tensor("model.layers.0.mlp.experts.3.down_proj.weight_scale_inv")[:, 1].repeat_interleave(128)
        assert torch.equal(a.get_tensor("layers.0.experts.down_scale")[3, :, 0], expected.float())
    hf = reference_model(src, deq, "group", ckpt)
    llm = LLM(artifact, max_num_batched_tokens=32, max_num_seqs=4, kv_cache_memory="4MiB")
    try:
        outputs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    finally:
        llm.engine.runner.close()
    mismatched = [ids[:4] for ids, out in zip(PROMPTS, outputs, strict=True) if out.token_ids != hf_greedy(hf, ids, MAX_TOKENS)]
    assert len(mismatched) <= 1, mismatched  # at most a near tie (see _assert_greedy_parity)


def test_dummy_fp8_moe_build_for_a_gpu_plans_fp8_experts_and_their_tuning(tmp_path, monkeypatch):  # type: ignore[no-untyped-def]
    """--load-format dummy --quant fp8 for an absent H200: the FP8 experts are drawn in the artifact
    layout, the memory plan counts them (and the FP8 kernel's workspace), and the tune pass would
    time fused_moe_fp8 (not the half-type fused_moe) at the model's expert shape."""
    from tiny_models import tiny_config

    from pagecast.builder import pipeline, tune

    ckpt = tmp_path / "config-only"
    ckpt.mkdir()
    tiny_config("qwen3_moe").save_pretrained(str(ckpt))
    seen: list[dict] = []  # type: ignore[type-arg]

    def tune_pass(state):  # type: ignore[no-untyped-def]
        seen.append(tune.model_shapes(state))
        return tune.run(state)

    monkeypatch.setattr(pipeline, "PASSES", [(n, tune_pass if n == "tune" else r) for n, r in pipeline.PASSES])
    art = build_artifact(ckpt, tmp_path / "art", gpu="h200", quant="fp8", load_format="dummy")
    shapes = tune.kernel_shapes(seen[0])
    assert shapes.fp8 == "channel-token" and shapes.num_experts == 8
    assert problems.buckets("fused_moe", shapes) == [] and problems.buckets("fused_moe_fp8", shapes)
    with safe_open(str(art / "weights" / "rank0.safetensors"), "pt") as f:
        assert f.get_tensor("layers.0.experts.down").dtype == torch.float8_e4m3fn
        assert f.get_tensor("layers.0.experts.down_scale").shape == (8, 64)
    plan = json.loads((art / "memory_plan.json").read_text())
    half = build_artifact(ckpt, tmp_path / "half", gpu="h200", load_format="dummy")
    half_plan = json.loads((half / "memory_plan.json").read_text())
    experts = 3 * 8 * 3 * 64 * 32  # layers x experts x (gate, up, down) x hidden x expert width
    # FP8: one byte an expert weight instead of two, plus an fp32 scale per expert row
    assert half_plan["weight_bytes"] - plan["weight_bytes"] >= experts - 3 * 8 * (2 * 32 + 64) * 4
    assert plan["moe_workspace_bytes"]["t2048"] > half_plan["moe_workspace_bytes"]["t2048"]  # + quantised activations


# ---------------------------------------------------------------------------- published FP8 MoE formats


def _written(src: Path, dst: Path, fmt: str) -> tuple[Path, dict[str, torch.Tensor]]:
    ckpt, deq = write_fp8(src, dst, fmt)
    if fmt == "fp8-block":  # the Qwen3 FP8 releases leave the routers unconverted
        config = json.loads((ckpt / "config.json").read_text())
        config["quantization_config"]["modules_to_not_convert"] += ["model.layers.0.mlp.gate", "model.layers.1.mlp.gate"]
        (ckpt / "config.json").write_text(json.dumps(config))
    return ckpt, deq


@pytest.mark.parametrize(("fmt", "activations"), [("fp8-block", "group"), ("ct-channel", "token"), ("ct-block", "group")])
def test_fp8_moe_checkpoint_greedy_tokens_equal_transformers_dequantised(fmt, activations, tiny_checkpoint_factory, tmp_path):  # type: ignore[no-untyped-def]
    src = tiny_checkpoint_factory("qwen3_moe", hidden_size=160, moe_intermediate_size=144, num_hidden_layers=2)
    ckpt, deq = _written(src, tmp_path / fmt, fmt)
    artifact = build_artifact(ckpt, tmp_path / "engine", gpu="cpu")
    manifest = json.loads((artifact / "manifest.json").read_text())
    assert manifest["quant"] == "fp8" and manifest["quantization"]["activations"] == activations
    with safe_open(str(artifact / "weights" / "rank0.safetensors"), "pt") as f:
        # block scales: [E, 2I, ceil(H/128)] (the 288 rows of gate and up, 160 columns: 2 blocks)
        assert f.get_tensor("layers.0.experts.gate_up_scale").shape == ((8, 288) if fmt == "ct-channel" else (8, 288, 2))
    _assert_greedy_parity(artifact, reference_model(src, deq, activations, ckpt))


def test_llama4_fp8_dynamic_checkpoint_greedy_tokens_equal_transformers_dequantised(tiny_checkpoint_factory, tmp_path):  # type: ignore[no-untyped-def]
    """Llama 4 as llm-compressor's FP8_DYNAMIC releases of Scout hold it: every projection and each
    expert (one module per expert, its stacks unpacked) per output channel, activations per token,
    the routers in bf16; its interleaved-RoPE q/k rows reordered with their scales at build."""
    from quant_writer import copy_without_weights
    from safetensors.torch import save_file

    src = tiny_checkpoint_factory("llama4")
    per_expert = tmp_path / "per-expert"
    tensors = copy_without_weights(src, per_expert)
    out = {}
    for name, t in tensors.items():
        if name.endswith("experts.gate_up_proj"):  # [E, H, 2I] -> each expert's gate and up Linear weights
            for e, w in enumerate(t):
                gate, up = w.t().chunk(2, 0)
                out[name.replace("gate_up_proj", f"{e}.gate_proj.weight")] = gate.contiguous()
                out[name.replace("gate_up_proj", f"{e}.up_proj.weight")] = up.contiguous()
        elif name.endswith("experts.down_proj"):  # [E, I, H] -> [H, I] each
            for e, w in enumerate(t):
                out[name.replace("down_proj", f"{e}.down_proj.weight")] = w.t().contiguous()
        else:
            out[name] = t
    save_file(out, str(per_expert / "model.safetensors"), metadata={"format": "pt"})
    ckpt, deq = write_fp8(per_expert, tmp_path / "ct-channel", "ct-channel")
    artifact = build_artifact(ckpt, tmp_path / "engine", gpu="cpu")
    manifest = json.loads((artifact / "manifest.json").read_text())
    assert manifest["quantization"]["source"] == "compressed-tensors" and manifest["quantization"]["activations"] == "token"
    with safe_open(str(artifact / "weights" / "rank0.safetensors"), "pt") as f:
        assert f.get_tensor("layers.1.experts.gate_up").dtype == torch.float8_e4m3fn
        assert f.get_tensor("layers.0.qkv_proj.weight").dtype == torch.float8_e4m3fn
    _assert_greedy_parity(artifact, reference_model(src, deq, "token", ckpt))


def test_glm4_moe_fp8_block_checkpoint_greedy_tokens_equal_transformers_dequantised(tiny_checkpoint_factory, tmp_path):  # type: ignore[no-untyped-def]
    """GLM-4.5's FP8 release format (128x128 weight blocks): its float router (fp32 here) and score
    bias read beside the FP8 experts, shared expert and dense first layer."""
    src = tiny_checkpoint_factory("glm4_moe", hidden_size=160, moe_intermediate_size=144, num_hidden_layers=2)
    ckpt, deq = _written(src, tmp_path / "fp8-block", "fp8-block")
    artifact = build_artifact(ckpt, tmp_path / "engine", gpu="cpu")
    with safe_open(str(artifact / "weights" / "rank0.safetensors"), "pt") as f:
        assert f.get_tensor("layers.1.experts.gate_up").dtype == torch.float8_e4m3fn
        assert f.get_tensor("layers.1.router.weight").dtype == f.get_tensor("layers.1.router.score_bias").dtype == torch.float32
    _assert_greedy_parity(artifact, reference_model(src, deq, "group", ckpt))


# ---------------------------------------------------------------------------- the kernels (interpreter)


def moe_fp8_inputs(t: int, e: int, k: int, h: int, i: int, block: bool, seed: int = 0):  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g) * 2
    quant = reference.quantize_fp8_groups if block else reference.quantize_fp8_rows

    def experts(n: int, kk: int) -> tuple[torch.Tensor, torch.Tensor]:
        pairs = [quant(torch.randn(n, kk, generator=g) * kk**-0.5) for _ in range(e)]
        return torch.stack([q for q, _ in pairs]), torch.stack([s for _, s in pairs])

    (w_gu, s_gu), (w_d, s_d) = experts(2 * i, h), experts(h, i)
    weights, ids = torch.topk(torch.randn(t, e, generator=g).softmax(-1), k)
    return x, weights, ids, w_gu, s_gu, w_d, s_d


GEMV = {"gemv": 1, "BLOCK_N": 16, "BLOCK_K": 64, "num_warps": 2, "num_stages": 1}
TILE = {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 64, "GROUP_M": 2}


@pytest.mark.parametrize("block", [False, True], ids=["channel", "block"])
@pytest.mark.parametrize(("t", "config"), [(1, GEMV), (3, GEMV), (3, TILE), (40, TILE), (40, None)])
def test_fused_moe_fp8_matches_the_reference_in_the_interpreter(t, config, block):  # type: ignore[no-untyped-def]
    from pagecast.kernels import fused_moe_fp8

    # hidden 160, intermediate 48: partial 128-column blocks in both projections
    x, weights, ids, w_gu, s_gu, w_d, s_d = moe_fp8_inputs(t, 8, 2, 160, 48, block)
    if block and config is GEMV:  # the GEMV's K step is a 1x128 activation group
        config = {**GEMV, "BLOCK_K": 128}
    out = fused_moe_fp8.fused_moe_fp8(x, weights, ids, w_gu, s_gu, w_d, s_d, config=config)
    expected = reference.fused_moe_fp8(x, weights, ids, w_gu, s_gu, w_d, s_d)
    # The same e4m3 values and scales (the interpreter's e4m3 casts are torch's: interpreter_fix);
    # only the order of fp32 sums differs.
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-5)
    # and the emulation is the W8A8 product: close to the float experts, not equal to them
    floats = [reference.dequantize_fp8(w.reshape(-1, w.shape[-1]), s.reshape(-1, *s.shape[2:])).view(w.shape) for w, s in ((w_gu, s_gu), (w_d, s_d))]
    dense = reference.fused_moe(x, weights, ids, *floats)
    assert 0 < (expected - dense).abs().max() < 0.05 * dense.abs().max()


@pytest.mark.parametrize(("t", "config"), [(3, GEMV), (40, TILE)])
def test_fused_moe_fp8_gpt_oss_experts_in_the_interpreter(t, config):  # type: ignore[no-untyped-def]
    """gpt-oss's experts: biases (added after the scales) and the clamped SwiGLU (a limit of 0.5 clamps)."""
    from pagecast.kernels import fused_moe_fp8

    x, weights, ids, w_gu, s_gu, w_d, s_d = moe_fp8_inputs(t, 8, 4, 160, 48, False)
    g = torch.Generator().manual_seed(7)
    b_gu, b_d = torch.randn(8, 96, generator=g), torch.randn(8, 160, generator=g)
    act = ("swiglu_oai", 1.702, 0.5)
    out = fused_moe_fp8.fused_moe_fp8(x, weights, ids, w_gu, s_gu, w_d, s_d, *act, config=config, b_gate_up=b_gu, b_down=b_d)
    expected = reference.fused_moe_fp8(x, weights, ids, w_gu, s_gu, w_d, s_d, *act, b_gate_up=b_gu, b_down=b_d)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-5)
    unbiased = reference.fused_moe_fp8(x, weights, ids, w_gu, s_gu, w_d, s_d, *act)
    assert (unbiased - expected).abs().max() > 0.1


def test_fp8_moe_engine_through_the_triton_kernels(tmp_path, monkeypatch):  # type: ignore[no-untyped-def]
    """The tiny Qwen3-MoE of tests/test_fused_moe_fp8_gpu.py's tuned fp32 engine test (hidden 256,
    8 experts top-2, --quant fp8), its GPU path run in the Triton interpreter with the launchers'
    default configs: the fused RMSNorm + quantisation before qkv, the FP8 GEMMs (o's K of 64 under
    BLOCK_K 128), the fused FP8 MoE. Teacher-forced logits of a 32-token prefill (the tile paths)
    and a decode step (the fused decode kernel, the MoE GEMV) against transformers with the same
    FP8 experts and activation quantisation, within the GPU test's bounds. An H100 found that engine
    off (top-1 0.817, mean 0.488 of the logits' spread) with its tuned table; this is what the CPU
    can check of it (not races, not num_warps). At a 120-token prefill: 1.0 and 0.0045, as the H200
    measured its tuned engine at 9c55d4d, on the machines this was written on; 0.975 and 0.024 on an
    AMD EPYC development machine (2026-12-07), where this engine's own CPU path gave the same
    (5e-6 from its Triton path) and its float build matched transformers' float model to 5e-6; at
    32 tokens and a decode step there, 1.0 and 0.007. This model's FP8 output is 1.5 of the logits'
    spread from its float output (random weights, hidden 256), so an activation an ulp from an e4m3
    boundary, which the BLAS of one machine rounds one way and another's the other, moves the
    logits that much; the bound allows it (the H100's fault was 0.488), and OpChecker checks every
    call of the GPU path tightly."""
    from kv_cache_support import logit_agreement, teacher_forced_logits
    from op_check import OP_TOLERANCE, OpChecker
    from tiny_models import make_checkpoint

    from pagecast.kernels import ops

    ckpt = make_checkpoint(tmp_path / "ckpt", "qwen3_moe", hidden_size=256, moe_intermediate_size=128, tokenizer=False)
    art = build_artifact(ckpt, tmp_path / "art", gpu="cpu", dtype="float32", quant="fp8")
    tokens = torch.randint(3, 4000, (33,), generator=torch.Generator().manual_seed(0)).tolist()
    with torch.no_grad():
        expected = reference_model(ckpt, quantised_modules(ckpt), "token")(torch.tensor([tokens])).logits[0].float()
    monkeypatch.setattr(ops, "_triton", lambda x: True)  # ops' GPU path, on the interpreter
    # a 32-token prefill (the tile paths), then one decode step (the interpreter takes ~8 s a step)
    with OpChecker(ops) as checker:  # each call against the reference path on its inputs too
        logits = teacher_forced_logits(art, tokens, 32).float()
    op, call, error = checker.worst()
    # 3.4e-7 at most here (the sums' order); the GPU test's bound, as op_check explains
    assert error <= OP_TOLERANCE, (op, call, checker.report(OP_TOLERANCE))
    got = logit_agreement(logits, expected)
    assert got["top1_agreement"] >= 0.95 and got["mean_rel_diff"] <= 0.05, got


def test_fused_moe_fp8_checks_shapes() -> None:
    from pagecast.kernels import fused_moe_fp8

    x, weights, ids, w_gu, s_gu, w_d, s_d = moe_fp8_inputs(3, 4, 2, 64, 32, False)
    with pytest.raises(ValueError, match="expert scales"):
        fused_moe_fp8.fused_moe_fp8(x, weights, ids, w_gu, s_gu[:, :10], w_d, s_d)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        fused_moe_fp8.fused_moe_fp8(x, weights, ids, w_gu.float(), s_gu, w_d, s_d)
    xb, wb, ib, gu_b, sgu_b, d_b, sd_b = moe_fp8_inputs(3, 4, 2, 64, 32, True)
    with pytest.raises(ValueError, match=r"BLOCK_K dividing 128 \(the GEMV path: equal to it\), got 64"):
        fused_moe_fp8.fused_moe_fp8(xb, wb, ib, gu_b, sgu_b, d_b, sd_b, config=GEMV)


# ---------------------------------------------------------------------------- the tuner's problems

QWEN3_30B = ModelShapes(
    32, 4, 128, 2048, 6144, 16, "bfloat16", num_experts=128, top_k=8, moe_intermediate=768, fp8="channel-token"
)


def test_fp8_moe_tuner_buckets_sizes_and_config_spaces() -> None:
    from pagecast.kernels import fused_moe

    assert problems.buckets("fused_moe", QWEN3_30B) == []  # FP8 experts: only the FP8 kernel runs
    assert problems.buckets("fused_moe_fp8", dataclasses.replace(QWEN3_30B, fp8="")) == []
    names = [b for b, _ in problems.buckets("fused_moe_fp8", QWEN3_30B)]
    assert names[0] == "t1" and "t256" in names and "t4096" in names
    expert = 3 * 2048 * 768  # e4m3: one byte a weight
    nbytes, flops = problems.problem_size("fused_moe_fp8", QWEN3_30B, {"num_tokens": 1})
    assert nbytes == 8 * (expert + 4 * (3 * 768 + 2048)) + 2 * 2048 * 2  # one token: its 8 experts
    assert flops == 2 * 8 * 3 * 2048 * 768
    block = dataclasses.replace(QWEN3_30B, fp8="block-group")
    nbytes, _ = problems.problem_size("fused_moe_fp8", block, {"num_tokens": 1})
    assert nbytes == 8 * (expert + 4 * (2 * 768 * 16 + 2048 * 6)) + 2 * 2048 * 2
    # experts narrower than 128 (tiny models) still find a config at every bucket
    tiny = ModelShapes(2, 1, 16, 64, 64, 16, "bfloat16", max_num_seqs=256, num_experts=8, top_k=2, moe_intermediate=32, fp8="block-group")
    for _, d in problems.buckets("fused_moe_fp8", tiny):
        assert problems.config_space("fused_moe_fp8", tiny, d), d
    for shapes in (QWEN3_30B, block):
        space = {b: problems.config_space("fused_moe_fp8", shapes, d) for b, d in problems.buckets("fused_moe_fp8", shapes)}
        # the naive per-expert FP8 loop only where no CUDA graph captures the bucket (past max_num_seqs)
        assert not any(fused_moe.is_naive(c) for c in space["t256"]) and any(fused_moe.is_naive(c) for c in space["t512"])
        assert any(fused_moe.is_gemv(c) for c in space["t1"])
        for b, d in problems.buckets("fused_moe_fp8", shapes):
            assert space[b], b
            default = problems.default_config("fused_moe_fp8", shapes, d)
            for c in [*space[b], default]:
                if not fused_moe.is_naive(c) and shapes is block:
                    assert c["BLOCK_K"] == 128 if fused_moe.is_gemv(c) else 128 % c["BLOCK_K"] == 0, (b, c)


@pytest.mark.parametrize("fp8", ["channel-token", "block-group"])
def test_fp8_moe_problem_launches_agree_in_the_interpreter(fp8):  # type: ignore[no-untyped-def]
    """The tuner's problem at a tiny shape: the default config, a tile and a GEMV give the same
    output, and the naive baseline (the dense FP8 GEMM per expert) too: its activation quantisation
    is fp8_gemm's cast (right in the interpreter with kernels/interpreter_fix.py's conversion)."""
    from pagecast.kernels import fused_moe

    shapes = ModelShapes(2, 1, 16, 160, 64, 16, "float32", max_num_seqs=4, num_experts=6, top_k=2, moe_intermediate=48, fp8=fp8)
    dims = {"num_tokens": 5}
    problem = problems.make_problem("fused_moe_fp8", shapes, dims, "cpu")
    assert problem.reference is not None
    default = problems.default_config("fused_moe_fp8", shapes, dims)
    gemv = {**GEMV, "BLOCK_K": 128} if fp8 == "block-group" else GEMV
    outs = [problem.launch(KernelConfig.coerce(c), 1) for c in (default, TILE, gemv)]
    for out in outs[1:]:
        torch.testing.assert_close(out, outs[0], atol=2e-5, rtol=1e-5)
    naive = problem.launch(fused_moe.NAIVE, 1)
    torch.testing.assert_close(naive, outs[0], atol=2e-5, rtol=1e-5)


# ---------------------------------------------------------------------------- refusals


def test_gpt_oss_fp8_checkpoint_is_refused_by_name(tiny_checkpoint_factory, tmp_path):  # type: ignore[no-untyped-def]
    """gpt-oss stacks its experts in one tensor: FP8 checkpoints of it are refused (--quant fp8 builds)."""
    ckpt, _ = write_fp8(tiny_checkpoint_factory("gpt_oss"), tmp_path / "block", "fp8-block")
    with pytest.raises(BuildError, match=r"GptOssForCausalLM: FP8 checkpoints of this MoE family .* --quant fp8"):
        build_artifact(ckpt, tmp_path / "e", gpu="cpu")


def test_static_input_scales_on_moe_experts_are_refused(tiny_checkpoint_factory, tmp_path):  # type: ignore[no-untyped-def]
    ckpt, _ = write_fp8(tiny_checkpoint_factory("qwen3_moe"), tmp_path / "modelopt", "modelopt")
    with pytest.raises(BuildError, match=r"static per-tensor input scales; pagecast's FP8 MoE experts quantise activations dynamically"):
        build_artifact(ckpt, tmp_path / "e", gpu="cpu")


def test_block_experts_tp_that_cuts_a_weight_block_is_refused(tiny_checkpoint_factory, tmp_path):  # type: ignore[no-untyped-def]
    # attention 4 x 64 = 256 (128 columns a rank: whole blocks); experts 144 wide: 72 a rank, not
    src = tiny_checkpoint_factory("qwen3_moe", hidden_size=256, head_dim=64, moe_intermediate_size=144, num_hidden_layers=1)
    ckpt, _ = write_fp8(src, tmp_path / "block", "fp8-block")
    with pytest.raises(BuildError, match=r"--tp 2: layers.0.experts.down cuts each expert's 144 intermediate columns into 72 per rank"):
        build_artifact(ckpt, tmp_path / "e", gpu="cpu", tp=2)


def test_fp8_moe_checkpoint_missing_an_expert_scale_is_refused_by_name(tiny_checkpoint_factory, tmp_path):  # type: ignore[no-untyped-def]
    from safetensors.torch import load_file, save_file

    ckpt, _ = write_fp8(tiny_checkpoint_factory("qwen3_moe"), tmp_path / "block", "fp8-block")
    tensors = load_file(str(ckpt / "model.safetensors"))
    del tensors["model.layers.1.mlp.experts.5.up_proj.weight_scale_inv"]
    save_file(tensors, str(ckpt / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(BuildError, match=r"no tensor 'model.layers.1.mlp.experts.5.up_proj.weight_scale_inv'"):
        build_artifact(ckpt, tmp_path / "e", gpu="cpu")
