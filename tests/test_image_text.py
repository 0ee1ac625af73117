"""Image-text checkpoints whose language model pagecast builds (builder/families.IMAGE_TEXT:
Gemma 3 4B-27B, Mistral Small 3.x, Qwen2.5-VL, Qwen3-VL, Qwen3-VL-MoE, LLaVA, Llama 4): tiny random
checkpoints in the hub's layout build as their text-only architecture and give the image-text
model's own greedy tokens and last-position logits for text prompts (Qwen's M-RoPE included),
fp32 on the CPU; the vision tower is not read."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import build_artifact
from engine_utils import engine_last_logits, hf_greedy
from tiny_models import IMAGE_TEXT_FAMILIES, copy_tokenizer, make_image_text_checkpoint

from pagecast.runtime import LLM, SamplingParams
from pagecast.runtime.errors import BuildError

PROMPTS = ["Hello, my name is", " ".join(str(i) for i in range(40))]  # the second is past Gemma's 8-token windows
MAX_TOKENS = 12


def _image_text_model(checkpoint: Path):  # type: ignore[no-untyped-def]
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(
        str(checkpoint), dtype=torch.float32, attn_implementation="eager"
    ).eval()


def _rename_tensors(src: Path, dst: Path, rename, change=lambda k, v: v) -> None:  # type: ignore[no-untyped-def]
    """A copy of checkpoint ``src`` whose weights file names each tensor ``rename(name)`` and holds
    ``change(name, tensor)``."""
    from quant_writer import copy_without_weights
    from safetensors.torch import save_file

    tensors = copy_without_weights(src, dst)
    save_file({rename(k): change(k, v).contiguous() for k, v in tensors.items()}, str(dst / "model.safetensors"),
              metadata={"format": "pt"})  # fmt: skip


@pytest.mark.parametrize("family", list(IMAGE_TEXT_FAMILIES))
def test_image_text_language_model_matches_transformers(family, tmp_path):  # type: ignore[no-untyped-def]
    ckpt = make_image_text_checkpoint(tmp_path / "ckpt", family)
    if family == "gemma3":  # the tensors as transformers names them in memory (model.language_model.*)
        renamed = tmp_path / "renamed"
        _rename_tensors(ckpt, renamed, lambda k: f"model.{k.replace('.model.', '.', 1)}" if k.startswith("language_model.") else f"model.{k}")
        # Stop tokens named by the outer config only (Gemma 3's [1, 106]), no generation_config.json
        config = json.loads((renamed / "config.json").read_text())
        (renamed / "config.json").write_text(json.dumps({**config, "eos_token_id": [2, 49150]}))
        (renamed / "generation_config.json").unlink(missing_ok=True)
        build_from = renamed
    elif family == "qwen2":  # config.json as Qwen2.5-VL's releases have it: flat, no text_config
        build_from = tmp_path / "flat"
        _rename_tensors(ckpt, build_from, lambda k: k)
        config = json.loads((ckpt / "config.json").read_text())
        text = config.pop("text_config")
        rope = text.pop("rope_parameters")
        flat = {**text, **config, "rope_scaling": {"type": "mrope", "mrope_section": rope["mrope_section"]},
                "rope_theta": rope["rope_theta"]}  # fmt: skip
        (build_from / "config.json").write_text(json.dumps(flat))
    else:  # as published (Mistral 3 with an LM head of its own: language_model.lm_head.weight)
        build_from = ckpt
    if family == "mistral":  # its chat template with the processor's files only, as some releases keep it
        template = (ckpt / "chat_template.jinja").read_text()
        (ckpt / "chat_template.jinja").unlink()
        (ckpt / "chat_template.json").write_text(json.dumps({"chat_template": template}))
    art = build_artifact(build_from, tmp_path / "art")
    manifest = json.loads((art / "manifest.json").read_text())
    text_arch = {"gemma3": "Gemma3ForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM", "llama": "LlamaForCausalLM",
                 "llama4": "Llama4ForCausalLM", "ministral3": "Ministral3ForCausalLM"}[family]  # fmt: skip
    assert manifest["architecture"] == text_arch
    if family == "gemma3":
        assert 49150 in manifest["eos_token_ids"]
    assert f"the language model of a {IMAGE_TEXT_FAMILIES[family]} checkpoint" in (art / "report.md").read_text()

    llm = LLM(art, max_num_batched_tokens=64, max_num_seqs=4)
    tok = llm.tokenizer
    if family == "mistral":
        assert tok.chat_template == template
        messages = [{"role": "user", "content": "Hi"}]
        chat = llm.chat(messages, SamplingParams(temperature=0, max_tokens=2))[0]
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert chat.prompt_token_ids == tok.encode(text, add_special_tokens=False)
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    hf = _image_text_model(ckpt)
    for prompt, out in zip(PROMPTS, outputs, strict=True):
        ids = tok.encode(prompt, add_special_tokens=False)
        assert out.token_ids == hf_greedy(hf, ids, MAX_TOKENS), prompt
        with torch.no_grad():
            ref = hf(input_ids=torch.tensor([ids])).logits[0, -1]
        torch.testing.assert_close(engine_last_logits(llm.engine, ids), ref, atol=1e-4, rtol=0)
    if family == "qwen3_moe":  # Qwen3-VL-MoE's expert stacks as transformers holds them, outputs first
        held = tmp_path / "held"
        _rename_tensors(ckpt, held, lambda k: k, lambda k, v: v.transpose(1, 2) if ".experts." in k else v)
        engine = LLM(build_artifact(held, tmp_path / "art_held"), max_num_seqs=1).engine
        torch.testing.assert_close(engine_last_logits(engine, ids), ref, atol=1e-4, rtol=0)


def test_image_text_checkpoints_that_cannot_build_say_why(tmp_path):  # type: ignore[no-untyped-def]
    ckpt = make_image_text_checkpoint(tmp_path / "ckpt", "mistral")
    # Only the vision tower's tensors: no language model to build
    vision_only = tmp_path / "vision_only"
    vision_only.mkdir()
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(ckpt / "model.safetensors"))
    save_file({k: v for k, v in tensors.items() if k.startswith("vision_tower.")}, str(vision_only / "model.safetensors"))
    (vision_only / "config.json").write_text((ckpt / "config.json").read_text())
    with pytest.raises(BuildError, match="without its language model's tensors"):
        build_artifact(vision_only, tmp_path / "a1")
    # A text model's config under an image-text architecture
    config = json.loads((ckpt / "config.json").read_text())
    (vision_only / "config.json").write_text(json.dumps({**config["text_config"], "architectures": config["architectures"]}))
    with pytest.raises(BuildError, match="names Mistral3ForConditionalGeneration but is a MistralConfig, with no language"):
        build_artifact(vision_only, tmp_path / "a3")
    # A LLaVA whose language model pagecast does not build
    llava = {"architectures": ["LlavaForConditionalGeneration"], "model_type": "llava", "text_config": {"model_type": "gpt_neox"}}
    (vision_only / "config.json").write_text(json.dumps(llava))
    with pytest.raises(BuildError, match="language model is a 'gpt_neox' model .GPTNeoXForCausalLM., which pagecast does not build"):
        build_artifact(vision_only, tmp_path / "a4")
    # Qwen3-VL-MoE expert stacks of two layouts at once
    moe = make_image_text_checkpoint(tmp_path / "moe", "qwen3_moe")
    _rename_tensors(moe, tmp_path / "mixed", lambda k: k, lambda k, v: v.transpose(1, 2) if k.endswith("down_proj") else v)
    with pytest.raises(BuildError, match="are not a pair of expert stacks for hidden size 64"):
        build_artifact(tmp_path / "mixed", tmp_path / "a5")
    # An int4 image-text checkpoint: refused, pointing at the bf16 one
    config["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemm"}
    (ckpt / "config.json").write_text(json.dumps(config))
    with pytest.raises(BuildError, match="awq-quantised Mistral3ForConditionalGeneration checkpoint.*bf16 and FP8.*--quant fp8"):
        build_artifact(ckpt, tmp_path / "a2")


@pytest.mark.parametrize(
    ("family", "fmt", "source", "arch"),
    [("mistral", "ct-channel", "compressed-tensors", "MistralForCausalLM"),  # FP8_DYNAMIC
     ("ministral3", "fp8-tensor-static", "fp8", "Ministral3ForCausalLM")],  # Ministral 3's releases
)  # fmt: skip
def test_fp8_image_text_checkpoint_builds_as_its_fp8_language_model(family, fmt, source, arch, tmp_path):  # type: ignore[no-untyped-def]
    """An FP8 Mistral 3 checkpoint (compressed-tensors FP8_DYNAMIC; Ministral 3's per-tensor
    static format), vision tower in bf16 and named in its list of unquantised modules (one of its
    projections by name, as some releases list them), builds as the FP8 language model it holds: the
    same logits, to the bit, as the text-only FP8 checkpoint of the same tensors."""
    from quant_writer import write_fp8
    from safetensors.torch import load_file, save_file

    ckpt = make_image_text_checkpoint(tmp_path / "ckpt", family)
    config = json.loads((ckpt / "config.json").read_text())
    tensors = load_file(str(ckpt / "model.safetensors"))
    # The language model alone, as a text checkpoint, quantised by the test writer
    text = tmp_path / "text"
    text.mkdir()
    save_file({k.removeprefix("language_model."): v for k, v in tensors.items() if k.startswith("language_model.")},
              str(text / "model.safetensors"), metadata={"format": "pt"})  # fmt: skip
    (text / "config.json").write_text(json.dumps({**config["text_config"], "architectures": [arch]}))
    copy_tokenizer(text)
    text_fp8, _ = write_fp8(text, tmp_path / "text_fp8", fmt)
    # The same tensors under the image-text names, beside the bf16 vision tower
    image_text = tmp_path / "image_text_fp8"
    _rename_tensors(ckpt, image_text, lambda k: k)
    quantised = load_file(str(text_fp8 / "model.safetensors"))
    vision = {k: v.to(torch.bfloat16) for k, v in tensors.items() if not k.startswith("language_model.")}
    save_file({**vision, **{f"language_model.{k}": v for k, v in quantised.items()}}, str(image_text / "model.safetensors"),
              metadata={"format": "pt"})  # fmt: skip
    qc = json.loads((text_fp8 / "config.json").read_text())["quantization_config"]
    if fmt == "ct-channel":
        qc["ignore"] += ["re:vision_tower.*", "vision_tower.transformer.layers.0.attention.q_proj", "multi_modal_projector.linear_1"]
    else:
        qc["modules_to_not_convert"] += ["vision_tower", "vision_tower.transformer.layers.0.attention.q_proj", "multi_modal_projector"]
    (image_text / "config.json").write_text(json.dumps({**config, "quantization_config": qc, "dtype": "bfloat16"}))

    prompts = [[1, 504, 3458, 22, 333, 17], list(range(100, 140))]
    engines = [LLM(build_artifact(c, tmp_path / f"art{i}"), max_num_seqs=2).engine for i, c in enumerate((text_fp8, image_text))]
    for ids in prompts:
        ours, theirs = (engine_last_logits(e, ids) for e in engines)
        assert torch.equal(ours, theirs)
    manifest = json.loads((tmp_path / "art1" / "manifest.json").read_text())
    assert manifest["architecture"] == arch and manifest["quantization"]["source"] == source
