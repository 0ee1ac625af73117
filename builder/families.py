"""The model families pagecast builds, as table entries: architecture -> the parts it uses.

The lower pass reads everything it can from the trace (which norms exist and their kind, the
activation, biases, the attention scale, soft-caps and multipliers, which layers skip RoPE);
what the trace cannot say is the role of each module, because transformers' names do not
tell it: Llama's ``post_attention_layernorm`` normalises the MLP's input, Gemma 2's and
OLMo 2's the attention's output. A family that only recombines supported parts is one entry
here plus a test (README, "Adding a model").
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class FamilyParts:
    """Where a family's parts sit, by module name under ``model.layers.N``."""

    family: str  # short name recorded in the manifest
    # Norms of a layer, by role; None where the family has none in that place.
    attn_in_norm: str | None = "input_layernorm"  # on the attention's input (pre-norm)
    attn_out_norm: str | None = None  # on the attention's output, before the residual add (post-norm)
    mlp_in_norm: str | None = "post_attention_layernorm"
    mlp_out_norm: str | None = None
    # Projections under self_attn / mlp: three (q, k, v) and two (gate, up), or one fused tensor.
    qkv: tuple[str, ...] = ("q_proj", "k_proj", "v_proj")
    gate_up: tuple[str, ...] = ("gate_proj", "up_proj")
    activation_module: str = "act_fn"
    # What q_norm / k_norm normalise when a layer has them: "head" (over head_dim, per head) or
    # "projection" (over the whole q / k projection output).
    qk_norm_kind: str = "head"
    # The q/k norms' modules under self_attn, and whether they apply to the rotated heads (HunYuan:
    # "query_layernorm" / "key_layernorm", after RoPE) rather than before it.
    qk_norm_names: tuple[str, str] = ("q_norm", "k_norm")
    qk_norm_after_rope: bool = False
    # Llama 4: one module without a weight normalises q and k (an L2 norm), on some layers only
    qk_norm_weightless: bool = False
    # Llama 4: RoPE on adjacent pairs computed as complex multiplies (lower reads it as interleaved)
    complex_rope: bool = False
    # Where sliding windows come from: "layer" (each attention module's own window, honoured by the
    # kernels), "config" (config.sliding_window on every layer, honoured), "layer_types"
    # (config.sliding_window on the layers config.layer_types calls "sliding_attention", honoured),
    # or "cap" (the context is capped to the window, within which sliding-window attention equals
    # full attention).
    window_source: str = "cap"
    # Per-layer modules that are identities at inference (dropout), claimed without a role.
    identities: tuple[str, ...] = ()
    # What this family's builds do not support, for the README's table and refusals.
    not_supported: str = ""
    # MoE families: where the checkpoint keeps a sparse block (transformers 5 names the module "mlp"
    # whatever the checkpoint says; Mixtral's checkpoints say "block_sparse_moe"), its router, and
    # each expert's gate / up / down projections.
    moe_block: str | None = None
    moe_router: str = "gate"
    moe_expert_projections: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    # Where transformers 5 has the sparse block in the trace (Granite-MoE keeps "block_sparse_moe").
    moe_module: str = "mlp"
    # The router's weight in the checkpoint, under moe_block, where it is not moe_router's own
    # (Granite-MoE: "router.layer.weight").
    moe_router_weight: str | None = None
    # Experts stacked in two tensors under moe_block in kernels/moe_routing.py's own layout,
    # [E, 2I, H] (gate rows, then up rows) and [E, H, I] (Granite-MoE's input_linear and
    # output_linear), instead of one module per expert; () where they are not.
    moe_stacked: tuple[str, ...] = ()
    # Experts stacked one tensor a projection, gate columns then up columns (Llama 4's gate_up_proj
    # [E, H, 2I] and down_proj [E, I, H]): read per expert (builder/load.py, expert_views) as
    # ``{experts}.{e}.gate_proj`` / ``up_proj`` / ``down_proj``.
    moe_stacked_halves: bool = False
    # The shared expert's module under the sparse block (GLM-4.5: "shared_experts").
    moe_shared_expert: str = "shared_expert"
    # sigmoid_group routing's score bias, under the sparse block in the checkpoint.
    moe_score_bias: str = "gate.e_score_correction_bias"


_GEMMA_NORMS = {
    "attn_out_norm": "post_attention_layernorm",
    "mlp_in_norm": "pre_feedforward_layernorm",
    "mlp_out_norm": "post_feedforward_layernorm",
}

# OLMo 2 / 3 and EXAONE 4: norms on each branch's output only (no input norms)
_POST_NORMS = {
    "attn_in_norm": None,
    "attn_out_norm": "post_attention_layernorm",
    "mlp_in_norm": None,
    "mlp_out_norm": "post_feedforward_layernorm",
}

FAMILIES: dict[str, FamilyParts] = {
    "LlamaForCausalLM": FamilyParts("llama"),
    "MistralForCausalLM": FamilyParts(
        "mistral", not_supported="contexts beyond the sliding window (capped to it)"
    ),
    "Qwen2ForCausalLM": FamilyParts(
        "qwen2", not_supported="use_sliding_window (context capped to the window)"
    ),
    "Qwen3ForCausalLM": FamilyParts("qwen3"),
    # Mistral's parts (YaRN RoPE as published) with each rotated query scaled by
    # 1 + beta * log(1 + floor(p / original context)) (rope_parameters.llama_4_scaling_beta)
    "Ministral3ForCausalLM": FamilyParts(
        "ministral3", not_supported="contexts beyond a configured sliding window (capped to it)"
    ),
    "Gemma2ForCausalLM": FamilyParts("gemma2", window_source="layer", **_GEMMA_NORMS),  # type: ignore[arg-type]
    "Gemma3ForCausalLM": FamilyParts(
        "gemma3",
        window_source="layer",
        not_supported="images (Gemma3ForConditionalGeneration builds its language model alone)",
        **_GEMMA_NORMS,  # type: ignore[arg-type]
    ),
    "Phi3ForCausalLM": FamilyParts(
        "phi3",
        qkv=("qkv_proj",),
        gate_up=("gate_up_proj",),
        activation_module="activation_fn",
        window_source="config",
        identities=("resid_attn_dropout", "resid_mlp_dropout"),
        not_supported="AWQ/GPTQ (fused checkpoint projections); a long prompt prefilled in chunks takes LongRoPE's short factors for its first chunks",
    ),
    "Olmo2ForCausalLM": FamilyParts(
        "olmo2",
        qk_norm_kind="projection",
        **_POST_NORMS,  # type: ignore[arg-type]
    ),
    "GraniteForCausalLM": FamilyParts("granite"),
    # DeepSeek-V3's routing (sigmoid scores, a score bias for the choice, expert groups) with
    # GLM-4's attention (q/k/v biases, half-rotary on split halves, optional q/k norms per head)
    "Glm4MoeForCausalLM": FamilyParts(
        "glm4_moe", moe_block="mlp", moe_shared_expert="shared_experts",
        not_supported="GPTQ checkpoints (not tested); its multi-token-prediction layer (not read)",
    ),
    # DeepSeek-V3's routing, as GLM-4.5's, with Qwen3's attention (per-head q/k norms, windows on the
    # layers layer_types names)
    "Dots1ForCausalLM": FamilyParts(
        "dots1", moe_block="mlp", moe_shared_expert="shared_experts", window_source="layer",
        not_supported="AWQ/GPTQ and FP8 checkpoints (not tested)",
    ),
    # EXAONE 4.0's attention (per-head q/k norms, windows on the layers layer_types names and no RoPE
    # on the others) in pre-norm layers, DeepSeek-V3's routing (the score bias on the block in the
    # checkpoint), dense and sparse layers by mlp_layer_types
    "ExaoneMoeForCausalLM": FamilyParts(
        "exaone_moe", moe_block="mlp", moe_shared_expert="shared_experts", moe_score_bias="e_score_correction_bias",
        window_source="layer_types", not_supported="AWQ/GPTQ and FP8 checkpoints (not tested)",
    ),
    # Llama's attention, DeepSeek-V3's routing
    "SolarOpenForCausalLM": FamilyParts(
        "solar_open", moe_block="mlp", moe_shared_expert="shared_experts",
        not_supported="AWQ/GPTQ and FP8 checkpoints (not tested)",
    ),
    # ERNIE 4.5's dense parts (RoPE on adjacent pairs) with MoE layers from moe_layer_start_index,
    # routed by softmax with a score bias for the choice (moe_statics), and shared experts
    "Ernie4_5_MoeForCausalLM": FamilyParts(
        "ernie4_5_moe", moe_block="mlp", moe_shared_expert="shared_experts",
        moe_score_bias="moe_statics.e_score_correction_bias",
        not_supported="AWQ/GPTQ (RoPE on adjacent pairs); the vision-language model (Ernie4_5_VLMoe)",
    ),
    # Mixtral's checkpoint names, the sigmoid routing's score bias on the block, q/k norms over the
    # whole projection, half-rotary heads
    "MiniMaxM2ForCausalLM": FamilyParts(
        "minimax_m2", moe_block="block_sparse_moe", moe_expert_projections=("w1", "w3", "w2"),
        moe_score_bias="e_score_correction_bias", qk_norm_kind="projection",
        not_supported="AWQ/GPTQ and FP8 checkpoints (not tested)",
    ),
    # HunYuan dense's attention; MoE blocks with a shared MLP and an fp32 router (its child wg)
    "HunYuanMoEV1ForCausalLM": FamilyParts(
        "hunyuan_moe", moe_block="mlp", moe_router_weight="gate.wg", moe_shared_expert="shared_mlp",
        qk_norm_names=("query_layernorm", "key_layernorm"), qk_norm_after_rope=True,
        not_supported="a top-k or expert count that differs between layers; AWQ/GPTQ and FP8 checkpoints (not tested)",
    ),
    "GraniteMoeForCausalLM": FamilyParts(
        "granitemoe", moe_block="block_sparse_moe", moe_module="block_sparse_moe", moe_router="router",
        moe_router_weight="router.layer", moe_stacked=("input_linear", "output_linear"),
        not_supported="AWQ/GPTQ and FP8 checkpoints (experts stacked in one tensor); --quant fp8 builds from bf16 are",
    ),
    "MixtralForCausalLM": FamilyParts(
        "mixtral", moe_block="block_sparse_moe", moe_expert_projections=("w1", "w3", "w2"),
        not_supported="contexts beyond a configured sliding window (capped to it)",
    ),  # fmt: skip
    "Qwen2MoeForCausalLM": FamilyParts(
        "qwen2_moe", moe_block="mlp", not_supported="use_sliding_window (context capped to the window)"
    ),
    "Qwen3MoeForCausalLM": FamilyParts("qwen3_moe", moe_block="mlp"),
    "OlmoeForCausalLM": FamilyParts(
        "olmoe", moe_block="mlp", qk_norm_kind="projection",
    ),  # fmt: skip
    "SmolLM3ForCausalLM": FamilyParts("smollm3", window_source="layer"),
    "GemmaForCausalLM": FamilyParts("gemma"),
    "Olmo3ForCausalLM": FamilyParts(
        "olmo3",
        qk_norm_kind="projection",
        window_source="layer",
        **_POST_NORMS,  # type: ignore[arg-type]
    ),
    # RoPE on adjacent pairs of dims (lower sets RopeSpec.interleaved; the build reorders q/k rows).
    "GlmForCausalLM": FamilyParts("glm", gate_up=("gate_up_proj",), activation_module="activation_fn"),
    "Glm4ForCausalLM": FamilyParts(
        "glm4",
        attn_out_norm="post_self_attn_layernorm",
        mlp_out_norm="post_mlp_layernorm",
        gate_up=("gate_up_proj",),
        activation_module="activation_fn",
        not_supported="AWQ/GPTQ (fused gate_up in the checkpoint)",
    ),
    "HeliumForCausalLM": FamilyParts("helium"),
    "Ernie4_5ForCausalLM": FamilyParts("ernie4_5"),
    "SeedOssForCausalLM": FamilyParts("seed_oss"),
    # Llama's parts with per-head q/k norms on the rotated heads and an NTK-alpha RoPE base
    "HunYuanDenseV1ForCausalLM": FamilyParts(
        "hunyuan_dense", qk_norm_names=("query_layernorm", "key_layernorm"), qk_norm_after_rope=True
    ),
    "Exaone4ForCausalLM": FamilyParts(
        "exaone4",
        window_source="layer_types",  # its attention keeps config.sliding_window on every layer
        **_POST_NORMS,  # type: ignore[arg-type]
    ),
    # Llama 4 (Scout, Maverick): RoPE on adjacent pairs with chunked attention and weightless q/k norms
    # on three layers in four, no RoPE and a position-dependent query temperature on the fourth;
    # top-1 sigmoid routing whose weight scales the expert's input, a shared expert, MoE and dense
    # layers interleaved (interleave_moe_layer_step), its experts stacked [E, H, 2I] / [E, I, H]
    "Llama4ForCausalLM": FamilyParts(
        "llama4", moe_block="feed_forward", moe_module="feed_forward", moe_router="router",
        qk_norm_names=("qk_norm", "qk_norm"), qk_norm_after_rope=True, qk_norm_weightless=True, complex_rope=True,
        moe_stacked_halves=True, activation_module="activation_fn",
        not_supported="images (Llama4ForConditionalGeneration builds its language model alone); AWQ/GPTQ (RoPE on adjacent pairs); Meta's fbgemm_fp8 checkpoints",
    ),
    "GptOssForCausalLM": FamilyParts(
        "gpt_oss", moe_block="mlp", moe_router="router", window_source="layer",
        not_supported="MXFP4 kernels (its MXFP4 checkpoints are dequantised to bf16 at build, or to FP8 with --quant fp8)",
    ),  # fmt: skip
}

# Image-text checkpoints whose language model builds alone (text in, text out; the vision tower
# and projector are not read): the architecture -> its language model's. Their config.json nests
# the language model's config under text_config, their weights its tensors under
# language_model.model.* / language_model.lm_head.* (or model.language_model.*, as transformers
# names them in memory; Qwen2.5-VL's at the top, model.*, beside visual.*). Qwen's M-RoPE gives
# each of its three sections a text token's one position, so text alone is rotated by plain RoPE.
IMAGE_TEXT: dict[str, str | None] = {
    "Gemma3ForConditionalGeneration": "Gemma3ForCausalLM",  # Gemma 3 4B-27B
    # its text_config's own: Mistral Small 3.1 / 3.2 (Mistral), Ministral 3 (a ministral3 text_config)
    "Mistral3ForConditionalGeneration": None,
    "Qwen2_5_VLForConditionalGeneration": "Qwen2ForCausalLM",  # Qwen2.5-VL
    "Qwen3VLForConditionalGeneration": "Qwen3ForCausalLM",  # Qwen3-VL (dense)
    "Qwen3VLMoeForConditionalGeneration": "Qwen3MoeForCausalLM",  # Qwen3-VL-MoE (experts stacked a projection)
    "Llama4ForConditionalGeneration": "Llama4ForCausalLM",  # Llama 4 Scout / Maverick
    "LlavaForConditionalGeneration": None,  # its text_config's own (LLaVA 1.5: Llama; Pixtral 12B: Mistral)
}

# Architectures refused with a pointer to what can be built instead.
REFUSED: dict[str, str] = {
    "DeepseekV3ForCausalLM": (
        "DeepSeek-V3's multi-head latent attention (MLA: compressed KV with a decoupled RoPE key) has no "
        "lowering or kernels in pagecast, nor its grouped top-k routing with expert bias correction"
    ),
    "DeepseekV2ForCausalLM": (
        "DeepSeek-V2's multi-head latent attention (MLA: compressed KV with a decoupled RoPE key) has no "
        "lowering or kernels in pagecast, nor its grouped top-k routing"
    ),
}


def supported_list() -> str:
    return ", ".join(sorted([*FAMILIES, *IMAGE_TEXT]))
