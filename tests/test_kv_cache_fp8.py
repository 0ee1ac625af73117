"""--kv-cache-dtype fp8 end to end on the CPU (the engine runs the torch reference kernels, which
store the cache in float8_e4m3fn exactly as the Triton kernels do): build, memory plan,
manifest, calibrated scales from the checkpoint, accuracy against the fp32-cache engine of
the same checkpoint, and the errors a user gets.

Accuracy. Tiny random checkpoints are chaotic (random weights amplify any perturbation), so
the bound is loose and stated relative to the spread of the logits: at every position of a
teacher-forced sequence (a 48-token prefill, then 16 decode steps) the largest logit
difference is at most ``MAX_REL_DIFF`` times the standard deviation of the fp32-cache
engine's logits, and the argmax agrees on at least ``MIN_TOP1`` of the positions. Greedy
agreement of generated tokens is reported, not required. (For orientation, measured on the
real SmolLM2-135M over a 131-token English paragraph: perplexity 7.3688 with the fp32 cache,
7.3704 with fp8 and scale 1.0; top-1 agreement 95%.)
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import build_artifact
from kv_cache_support import add_kv_scales, calibrated_scales, logit_agreement, teacher_forced_logits

MAX_REL_DIFF = 0.75
MIN_TOP1 = 0.8
PREFILL = 48
TOKENS = torch.randint(3, 49000, (PREFILL + 16,), generator=torch.Generator().manual_seed(0)).tolist()


@pytest.fixture(scope="module")
def fp8_artifacts(tmp_path_factory, tiny_checkpoint_factory):  # type: ignore[no-untyped-def]
    cache: dict[tuple, Path] = {}

    def make(family: str, checkpoint: Path | None = None, **options) -> Path:  # type: ignore[no-untyped-def]
        ckpt = checkpoint or tiny_checkpoint_factory(family)
        key = (str(ckpt), repr(sorted(options.items())))
        if key not in cache:
            cache[key] = build_artifact(ckpt, tmp_path_factory.mktemp(f"fp8-{family}") / "engine", **options)
        return cache[key]

    return make


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_fp8_cache_logits_close_to_fp32_cache(family, fp8_artifacts, tiny_artifact_factory, record_property):  # type: ignore[no-untyped-def]
    from pagecast.runtime import LLM, SamplingParams

    base = tiny_artifact_factory(family)
    fp8 = fp8_artifacts(family, kv_cache_dtype="fp8")
    agreement = logit_agreement(
        teacher_forced_logits(fp8, TOKENS, PREFILL), teacher_forced_logits(base, TOKENS, PREFILL)
    )
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    prompts = [TOKENS[:20], TOKENS[20:45]]
    ref = [o.token_ids for o in LLM(str(base)).generate(prompts, params, use_tqdm=False)]
    got = [o.token_ids for o in LLM(str(fp8)).generate(prompts, params, use_tqdm=False)]
    same = sum(next((i for i, (a, b) in enumerate(zip(r, g)) if a != b), len(r)) for r, g in zip(ref, got))
    agreement["greedy_tokens_equal_before_first_difference"] = same / sum(len(r) for r in ref)
    record_property("fp8_kv_agreement", agreement)
    print(f"{family}: fp8 KV cache vs fp32 cache: {agreement}")
    assert agreement["max_rel_diff"] <= MAX_REL_DIFF, agreement
    assert agreement["top1_agreement"] >= MIN_TOP1, agreement


def test_calibrated_scales_are_read_and_applied(
    tmp_path, tiny_checkpoint_factory, fp8_artifacts, tiny_artifact_factory
):  # type: ignore[no-untyped-def]
    """Scales in the checkpoint (llm-compressor names) land in the manifest and model.py and are
    what the cache is written and read with: calibrated ones (amax / 448 of the transformers
    model's K and V) keep the logits close; scales 1,000 times too small saturate every value
    and do not (so the bound above can fail)."""
    source = tiny_checkpoint_factory("llama")
    k_scales, v_scales = calibrated_scales(source, TOKENS)
    calibrated = tmp_path / "calibrated"
    shutil.copytree(source, calibrated)
    add_kv_scales(calibrated, k_scales, v_scales)
    art = fp8_artifacts("llama", calibrated, kv_cache_dtype="fp8")
    manifest = json.loads((art / "manifest.json").read_text())
    assert manifest["kv_cache"]["dtype"] == "float8_e4m3fn"
    assert manifest["kv_cache"]["scales_source"] == "checkpoint"
    assert manifest["kv_cache"]["k_scales"] == pytest.approx(k_scales, rel=1e-6)
    assert manifest["kv_cache"]["v_scales"] == pytest.approx(v_scales, rel=1e-6)
    assert f"K_SCALES = {manifest['kv_cache']['k_scales']!r}" in (art / "model.py").read_text()
    assert "calibrated scales" in (art / "report.md").read_text()

    base = teacher_forced_logits(tiny_artifact_factory("llama"), TOKENS, PREFILL)
    good = logit_agreement(teacher_forced_logits(art, TOKENS, PREFILL), base)
    assert good["max_rel_diff"] <= MAX_REL_DIFF and good["top1_agreement"] >= MIN_TOP1, good

    saturating = tmp_path / "saturating"
    shutil.copytree(source, saturating)
    add_kv_scales(saturating, [s / 1000 for s in k_scales], [s / 1000 for s in v_scales])
    bad = logit_agreement(
        teacher_forced_logits(fp8_artifacts("llama", saturating, kv_cache_dtype="fp8"), TOKENS, PREFILL), base
    )
    assert bad["max_rel_diff"] > MAX_REL_DIFF, bad


@pytest.mark.parametrize("style", ["modelopt", "kv_scale"])
def test_other_scale_names(style, tmp_path, tiny_checkpoint_factory):  # type: ignore[no-untyped-def]
    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoint_factory("llama"), ckpt)
    add_kv_scales(ckpt, [0.01, 0.02, 0.03], [0.04, 0.05, 0.06], style=style)
    art = build_artifact(ckpt, tmp_path / "engine", kv_cache_dtype="fp8_e4m3")
    kv = json.loads((art / "manifest.json").read_text())["kv_cache"]
    assert kv["k_scales"] == pytest.approx([0.01, 0.02, 0.03])
    # kv_scale: one scale for K and V
    assert kv["v_scales"] == pytest.approx([0.04, 0.05, 0.06] if style == "modelopt" else [0.01, 0.02, 0.03])


def test_scales_on_some_layers_only_are_refused(tmp_path, tiny_checkpoint_factory):  # type: ignore[no-untyped-def]
    from safetensors.torch import load_file, save_file

    from pagecast.runtime.errors import BuildError

    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoint_factory("llama"), ckpt)
    add_kv_scales(ckpt, [0.01, 0.02, 0.03], [0.04, 0.05, 0.06])
    tensors = load_file(str(ckpt / "model.safetensors"))
    del tensors["model.layers.2.self_attn.k_scale"]
    save_file(tensors, str(ckpt / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(BuildError, match=r"some layers but not for model\.layers\.2.*--kv-cache-dtype auto"):
        build_artifact(ckpt, tmp_path / "engine", kv_cache_dtype="fp8")
    # without fp8 the scales are not needed and not read
    build_artifact(ckpt, tmp_path / "engine2")


def test_memory_plan_holds_twice_the_tokens(fp8_artifacts):  # type: ignore[no-untyped-def]
    """A bf16 build for an H200 (planned here without one): the fp8 cache halves the bytes per
    token and block, and every memory budget holds twice the blocks (the weights stay bf16)."""
    plans = {}
    for kv in ("auto", "fp8"):
        art = fp8_artifacts("llama", gpu="h200", dtype="bfloat16", kv_cache_dtype=kv)
        plans[kv] = json.loads((art / "memory_plan.json").read_text())
    half, fp8 = plans["auto"], plans["fp8"]
    assert (half["kv_cache_dtype"], fp8["kv_cache_dtype"]) == ("bfloat16", "float8_e4m3fn")
    assert fp8["bytes_per_token"] * 2 == half["bytes_per_token"] == 2 * 3 * 2 * 16 * 2
    assert fp8["bytes_per_block"] * 2 == half["bytes_per_block"]
    assert fp8["weight_bytes"] == half["weight_bytes"]
    assert len(fp8["budgets"]) == len(half["budgets"]) > 0
    for a, b in zip(half["budgets"], fp8["budgets"]):
        assert a["kv_bytes"] == b["kv_bytes"]
        assert b["num_blocks"] in (2 * a["num_blocks"], 2 * a["num_blocks"] + 1)
        assert b["max_tokens"] >= 2 * a["max_tokens"]


def test_fp8_needs_ada_or_newer(tiny_checkpoint_factory, tmp_path):  # type: ignore[no-untyped-def]
    from pagecast.runtime.errors import BuildError

    with pytest.raises(
        BuildError, match=r"compute capability 8\.9 or newer.*a100 is 8\.0.*--kv-cache-dtype auto"
    ):
        build_artifact(tiny_checkpoint_factory("llama"), tmp_path / "a100", gpu="a100", kv_cache_dtype="fp8")


def test_manifest_and_runtime_round_trip(fp8_artifacts):  # type: ignore[no-untyped-def]
    from pagecast.runtime import LLM
    from pagecast.runtime.artifact import Manifest, load_manifest

    art = fp8_artifacts("llama", kv_cache_dtype="fp8")
    manifest = load_manifest(art)
    assert manifest.kv_cache_dtype == "float8_e4m3fn"
    assert manifest.kv_cache["k_scales"] == manifest.kv_cache["v_scales"] == [1.0, 1.0, 1.0]
    assert manifest.kv_cache["scales_source"] == "default"
    assert manifest.build_options["kv_cache_dtype"] == "fp8"
    assert Manifest.from_dict(json.loads(manifest.to_json())) == manifest
    # An artifact from before fp8 caches (no kv_cache entry) keeps its cache in the model's dtype.
    data = json.loads(manifest.to_json())
    del data["kv_cache"]
    assert Manifest.from_dict(data).kv_cache_dtype == manifest.dtype == "float32"

    llm = LLM(
        str(art), kv_cache_memory="1MiB", kv_cache_dtype="fp8"
    )  # naming the artifact's own dtype is fine
    cache = llm.engine.kv_cache
    assert cache.dtype == torch.float8_e4m3fn
    memory_plan = json.loads((art / "memory_plan.json").read_text())
    assert (
        cache[0, 0, 0].numel() * cache.element_size() * 2 * cache.shape[0] == memory_plan["bytes_per_block"]
    )
    assert cache.shape[2] == (1 << 20) // memory_plan["bytes_per_block"]


def test_bad_option_values_are_clear_errors(tiny_llama_artifact, fp8_artifacts, tiny_llama_checkpoint):  # type: ignore[no-untyped-def]
    from pagecast.builder.ir import BuildOptions
    from pagecast.runtime import LLM

    with pytest.raises(
        ValueError, match=r"--kv-cache-dtype must be one of auto, fp8, fp8_e4m3 \(got 'int8'\)"
    ):
        BuildOptions(model="x", kv_cache_dtype="int8")
    proc = subprocess.run(
        [sys.executable, "-m", "pagecast.builder.cli", "--model", str(tiny_llama_checkpoint), "--kv-cache-dtype", "fp9"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert proc.returncode == 2
    assert "--kv-cache-dtype" in proc.stderr and "fp8" in proc.stderr and "auto" in proc.stderr

    # The cache's dtype is the artifact's: asking the runtime for another one says how to get it.
    with pytest.raises(
        ValueError, match=r"KV cache is float32.*rebuild it with enginebuild --kv-cache-dtype fp8"
    ):
        LLM(str(tiny_llama_artifact), kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match=r"KV cache is float8_e4m3fn.*--kv-cache-dtype auto"):
        LLM(str(fp8_artifacts("llama", kv_cache_dtype="fp8")), kv_cache_dtype="float32")

    from pagecast.runtime.loader import load_artifact

    loaded = load_artifact(fp8_artifacts("llama", kv_cache_dtype="fp8"), load_tokenizer=False)
    with pytest.raises(ValueError, match="KV cache is torch.float8_e4m3fn"):
        loaded.model.bind_kv_cache(torch.zeros(3, 2, 4, 2, 16, 16))


def test_tensor_parallel_fp8_cache(fp8_artifacts):  # type: ignore[no-untyped-def]
    """TP=2 (gloo on the CPU): the worker allocates its KV cache in the artifact's fp8 dtype (it is
    told rank 0's) and the greedy tokens are TP=1's with the same fp8 cache."""
    from pagecast.runtime import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = [TOKENS[:9], TOKENS[9:40]]
    one = [o.token_ids for o in LLM(str(fp8_artifacts("llama", kv_cache_dtype="fp8"))).generate(prompts, params, use_tqdm=False)]
    llm = LLM(str(fp8_artifacts("llama", tp=2, kv_cache_dtype="fp8")), kv_cache_memory="1MiB")
    try:
        assert llm.engine.kv_cache.dtype == torch.float8_e4m3fn
        two = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    finally:
        llm.engine.runner.close()
    assert two == one


def test_llm_compressor_kv_cache_only_checkpoint(tmp_path, tiny_checkpoint_factory):  # type: ignore[no-untyped-def]
    """A checkpoint whose compressed-tensors quantization_config quantises only the KV cache
    (llm-compressor's kv_cache_scheme, no weight groups) builds: float weights, its scales used
    with --kv-cache-dtype fp8, a note pointing at the option without it. Other KV schemes and
    weight-quantised compressed-tensors checkpoints are refused."""
    from pagecast.runtime.errors import BuildError

    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoint_factory("llama"), ckpt)
    add_kv_scales(ckpt, [0.01, 0.02, 0.03], [0.04, 0.05, 0.06])
    config = json.loads((ckpt / "config.json").read_text())
    scheme = {"num_bits": 8, "type": "float", "strategy": "tensor", "symmetric": True, "dynamic": False}
    config["quantization_config"] = {
        "quant_method": "compressed-tensors", "config_groups": {}, "kv_cache_scheme": scheme,
        "format": "dense", "ignore": ["lm_head"], "quantization_status": "compressed",
    }  # fmt: skip
    (ckpt / "config.json").write_text(json.dumps(config))
    art = build_artifact(ckpt, tmp_path / "fp8", kv_cache_dtype="fp8")
    manifest = json.loads((art / "manifest.json").read_text())
    assert manifest["quant"] is None and manifest["kv_cache"]["k_scales"] == pytest.approx([0.01, 0.02, 0.03])
    plain = build_artifact(ckpt, tmp_path / "auto")
    assert "build with --kv-cache-dtype fp8 to use them" in (plain / "report.md").read_text()

    config["quantization_config"]["kv_cache_scheme"] = dict(scheme, type="int")
    (ckpt / "config.json").write_text(json.dumps(config))
    with pytest.raises(BuildError, match="not per-tensor 8-bit float"):
        build_artifact(ckpt, tmp_path / "int8", kv_cache_dtype="fp8")
    config["quantization_config"]["kv_cache_scheme"] = scheme
    config["quantization_config"]["config_groups"] = {"group_0": {"targets": ["Linear"]}}
    (ckpt / "config.json").write_text(json.dumps(config))
    with pytest.raises(BuildError, match="compressed-tensors"):
        build_artifact(ckpt, tmp_path / "w8", kv_cache_dtype="fp8")
