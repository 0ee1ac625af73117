"""Helpers for the FP8 KV-cache tests (CPU and GPU): teacher-forced logits of an artifact and
checkpoints that carry calibrated KV scales, and how far apart two e4m3 tensors are."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch


def fp8_steps_apart(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many e4m3 codes apart two e4m3 tensors are, element by element (a code is sign |
    magnitude, so of one sign the codes are ordered; across signs the two magnitudes add up)."""
    ai, bi = a.view(torch.uint8).int(), b.view(torch.uint8).int()
    mag = (ai & 0x7F) - (bi & 0x7F)
    return torch.where((ai >> 7) == (bi >> 7), mag.abs(), (ai & 0x7F) + (bi & 0x7F))


def teacher_forced_logits(artifact: Path, tokens: list[int], prefill_len: int) -> torch.Tensor:
    """fp32 logits [len(tokens), vocab] of one sequence: a prefill of the first ``prefill_len``
    tokens (prefill attention), then one decode step per remaining token (decode attention),
    every step fed the given token, so two engines are compared on identical contexts."""
    from pagecast.kernels import ops
    from pagecast.runtime.forward_context import ForwardContext
    from pagecast.runtime.loader import load_artifact

    art = load_artifact(artifact, load_tokenizer=False)
    art.wait_verified()
    dev, m = art.device, art.manifest
    bs = m.block_size
    num_blocks = math.ceil(len(tokens) / bs) + 1
    kv = torch.zeros(
        (m.dims["num_layers"], 2, num_blocks, m.kv_heads_per_rank, bs, m.dims["head_dim"]),
        dtype=art.kv_cache_dtype, device=dev,
    )  # fmt: skip
    art.model.bind_kv_cache(kv)
    ops.activate(art.kernels)
    table = torch.arange(num_blocks, dtype=torch.int32, device=dev)[None]
    ids = torch.tensor(tokens, dtype=torch.int64, device=dev)

    def step(start: int, end: int) -> torch.Tensor:
        n = end - start
        ctx = ForwardContext(
            slot_mapping=torch.arange(start, end, dtype=torch.int64, device=dev),
            block_tables=table,
            seq_lens=torch.tensor([end], dtype=torch.int32, device=dev),
            query_start_loc=torch.tensor([0, n], dtype=torch.int32, device=dev),
            max_query_len=n,
            max_seq_len=end,
            logits_indices=torch.arange(n, dtype=torch.int64, device=dev),
        )
        positions = torch.arange(start, end, dtype=torch.int64, device=dev)
        hidden = art.model.forward(ids[start:end], positions, ctx)
        return art.model.compute_logits(hidden).float()

    rows = [step(0, prefill_len)]
    rows += [step(t, t + 1) for t in range(prefill_len, len(tokens))]
    return torch.cat(rows).cpu()


def logit_agreement(test: torch.Tensor, base: torch.Tensor) -> dict[str, float]:
    """How close ``test``'s logits are to ``base``'s: the largest difference relative to the
    spread of the base logits, and the fraction of positions with the same argmax."""
    diff = (test - base).abs().max(dim=-1).values
    spread = base.std(dim=-1)
    return {
        "max_rel_diff": float((diff / spread).max()),
        "mean_rel_diff": float((diff / spread).mean()),
        "top1_agreement": float((test.argmax(-1) == base.argmax(-1)).float().mean()),
    }


def add_kv_scales(
    checkpoint: Path, k_scales: list[float], v_scales: list[float], style: str = "compressed-tensors"
) -> None:
    """Write per-layer KV scales into ``checkpoint``'s safetensors the way a calibration tool does:
    ``compressed-tensors`` (llm-compressor: self_attn.k_scale / v_scale), ``modelopt``
    (self_attn.k_proj.k_scale / v_proj.v_scale) or ``kv_scale`` (one self_attn.kv_scale; K's used)."""
    from safetensors.torch import load_file, save_file

    file = checkpoint / "model.safetensors"
    tensors = load_file(str(file))
    config = json.loads((checkpoint / "config.json").read_text())
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}.self_attn"
        k, v = torch.tensor(k_scales[i], dtype=torch.float32), torch.tensor(v_scales[i], dtype=torch.float32)
        if style == "compressed-tensors":
            tensors[f"{p}.k_scale"], tensors[f"{p}.v_scale"] = k, v
        elif style == "modelopt":
            tensors[f"{p}.k_proj.k_scale"], tensors[f"{p}.v_proj.v_scale"] = k.reshape(1), v.reshape(1)
        elif style == "kv_scale":
            tensors[f"{p}.kv_scale"] = k
        else:
            raise ValueError(style)
    save_file(tensors, str(file), metadata={"format": "pt"})


def calibrated_scales(checkpoint: Path, token_ids: list[int]) -> tuple[list[float], list[float]]:
    """Per-layer amax(K after rotary) / 448 and amax(V) / 448 of the transformers model over
    ``token_ids``: what a calibration tool computes for a per-tensor e4m3 KV cache."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32)
    with torch.no_grad():
        out = model(torch.tensor([token_ids]), use_cache=True)
    cache = out.past_key_values
    k_scales, v_scales = [], []
    for layer in range(model.config.num_hidden_layers):
        keys, values = _layer_kv(cache, layer)
        k_scales.append(float(keys.abs().max()) / 448.0)
        v_scales.append(float(values.abs().max()) / 448.0)
    return k_scales, v_scales


def _layer_kv(cache, layer: int) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[no-untyped-def]
    if hasattr(cache, "layers"):
        return cache.layers[layer].keys, cache.layers[layer].values
    return cache.key_cache[layer], cache.value_cache[layer]
