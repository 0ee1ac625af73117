"""Bad input gets a specific error that says what is wrong and what to do."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
from conftest import build_artifact
from safetensors.torch import load_file, save_file
from tiny_models import make_checkpoint

from pagecast.builder.ir import BuildOptions
from pagecast.runtime import LLM, SamplingParams
from pagecast.runtime.errors import ArtifactError, BuildError, InvalidRequestError


def test_unsupported_architecture(tmp_path, tiny_llama_checkpoint):  # type: ignore[no-untyped-def]
    ckpt = tmp_path / "gpt2"
    shutil.copytree(tiny_llama_checkpoint, ckpt)
    config = json.loads((ckpt / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (ckpt / "config.json").write_text(json.dumps(config))
    with pytest.raises(BuildError, match=r"architecture 'GPT2LMHeadModel' is not supported; supported architectures: ") as err:
        build_artifact(ckpt, tmp_path / "out")
    listed = str(err.value).split("supported architectures: ", 1)[1]
    assert {"LlamaForCausalLM", "Gemma2ForCausalLM", "Qwen3MoeForCausalLM"} <= set(listed.replace(",", " ").split())
    assert not (tmp_path / "out").exists()


def test_unsupported_op_names_module_and_op(tmp_path):  # type: ignore[no-untyped-def]
    ckpt = make_checkpoint(tmp_path / "relu", "llama", hidden_act="relu")
    with pytest.raises(BuildError, match=r"unsupported op 'relu' in module model\.layers\.0\.mlp\.act_fn"):
        build_artifact(ckpt, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert not list(tmp_path.glob(".out.tmp-*")), "a failed build left its staging directory"


def test_missing_weight_shard(tmp_path, tiny_llama_checkpoint):  # type: ignore[no-untyped-def]
    ckpt = tmp_path / "sharded"
    shutil.copytree(tiny_llama_checkpoint, ckpt)
    tensors = load_file(str(ckpt / "model.safetensors"))
    names = sorted(tensors)
    (ckpt / "model.safetensors").unlink()
    half = len(names) // 2
    save_file({n: tensors[n] for n in names[:half]}, str(ckpt / "model-00001-of-00002.safetensors"))
    weight_map = {n: "model-00001-of-00002.safetensors" for n in names[:half]}
    weight_map |= {n: "model-00002-of-00002.safetensors" for n in names[half:]}
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(BuildError, match=r"weights file model-00002-of-00002\.safetensors listed in "
                                         r"model\.safetensors\.index\.json is missing"):
        build_artifact(ckpt, tmp_path / "out")


def test_sharded_checkpoint_builds(tmp_path, tiny_llama_checkpoint):  # type: ignore[no-untyped-def]
    ckpt = tmp_path / "sharded"
    shutil.copytree(tiny_llama_checkpoint, ckpt)
    tensors = load_file(str(ckpt / "model.safetensors"))
    names = sorted(tensors)
    (ckpt / "model.safetensors").unlink()
    files = {}
    for i, chunk in enumerate((names[::2], names[1::2])):
        fn = f"model-0000{i + 1}-of-00002.safetensors"
        save_file({n: tensors[n] for n in chunk}, str(ckpt / fn))
        files |= {n: fn for n in chunk}
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"weight_map": files}))
    sharded = LLM(build_artifact(ckpt, tmp_path / "out"))
    whole = LLM(build_artifact(tiny_llama_checkpoint, tmp_path / "whole"))
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    assert sharded.generate("Hi there", params)[0].token_ids == whole.generate("Hi there", params)[0].token_ids


def test_corrupt_weight_file(tmp_path, tiny_llama_checkpoint):  # type: ignore[no-untyped-def]
    ckpt = tmp_path / "corrupt"
    shutil.copytree(tiny_llama_checkpoint, ckpt)
    data = (ckpt / "model.safetensors").read_bytes()
    (ckpt / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(BuildError, match=r"model\.safetensors cannot be read .* corrupt or truncated"):
        build_artifact(ckpt, tmp_path / "out")


def test_missing_weights_entirely(tmp_path, tiny_llama_checkpoint):  # type: ignore[no-untyped-def]
    ckpt = tmp_path / "noweights"
    shutil.copytree(tiny_llama_checkpoint, ckpt)
    (ckpt / "model.safetensors").unlink()
    with pytest.raises(BuildError, match=r"has no \*\.safetensors weights .* --load-format dummy"):
        build_artifact(ckpt, tmp_path / "out")


def test_changed_artifact_file_is_refused(tmp_path, tiny_llama_checkpoint):  # type: ignore[no-untyped-def]
    art = build_artifact(tiny_llama_checkpoint, tmp_path / "art")
    with open(art / "model.py", "a") as f:
        f.write("\n# edited\n")
    with pytest.raises(ArtifactError, match=r"file model\.py does not match the manifest .* rebuild it"):
        LLM(art)


def test_unknown_format_version_is_refused(tmp_path, tiny_llama_checkpoint):  # type: ignore[no-untyped-def]
    art = build_artifact(tiny_llama_checkpoint, tmp_path / "art")
    manifest = json.loads((art / "manifest.json").read_text())
    manifest["format_version"] = 99
    (art / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError, match=r"format_version 99 is not supported .* reads format_version 2, and 1"):
        LLM(art)


def test_not_an_artifact(tmp_path):  # type: ignore[no-untyped-def]
    with pytest.raises(ArtifactError, match=r"has no manifest\.json: it is not a pagecast artifact"):
        LLM(tmp_path)


def test_gpu_artifact_on_a_cpu_machine(tmp_path, tiny_llama_checkpoint):  # type: ignore[no-untyped-def]
    pytest.importorskip("triton")
    import torch

    if torch.cuda.is_available():
        pytest.skip("needs a machine without a GPU")
    art = build_artifact(tiny_llama_checkpoint, tmp_path / "art", gpu="h200")
    manifest = json.loads((art / "manifest.json").read_text())
    assert manifest["target"] == {"kind": "cuda", "name": "h200", "compute_capability": [9, 0], "tuned": False}
    assert manifest["dtype"] == "bfloat16"
    with pytest.raises(ArtifactError, match=r"built for a h200 GPU but no CUDA GPU is available here; rebuild it with "
                                            r"enginebuild --gpu cpu"):
        LLM(art)


def test_max_model_len_above_the_artifacts_is_refused(tiny_llama_artifact):  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match=r"max_model_len 100000 is longer than this artifact's 512; rebuild it with "
                                          r"`enginebuild --max-model-len 100000`"):
        LLM(tiny_llama_artifact, max_model_len=100_000)


def test_prompt_longer_than_max_model_len(tiny_llama_artifact):  # type: ignore[no-untyped-def]
    llm = LLM(tiny_llama_artifact, max_model_len=32)
    with pytest.raises(InvalidRequestError, match=r"maximum context length is 32 tokens, but the prompt has \d+") as e:
        llm.generate(" ".join(["word"] * 40), SamplingParams(max_tokens=4))
    assert e.value.code == "context_length_exceeded"
    with pytest.raises(InvalidRequestError, match=r"requested for the completion") as e:
        llm.generate("short prompt", SamplingParams(max_tokens=100))
    assert e.value.code == "context_length_exceeded" and e.value.param == "max_tokens"
    with pytest.raises(InvalidRequestError, match=r"out of range for this model's vocabulary"):
        llm.generate([[1, 2, 10**9]], SamplingParams(max_tokens=1))
    assert llm.engine.num_unfinished() == 0


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"temperature": -1.0}, r"temperature must be in \[0, 2\]"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
        ({"top_k": -5}, r"top_k must be -1, 0 or a positive integer"),
        ({"max_tokens": 0}, r"max_tokens must be a positive integer"),
        ({"n": 0}, r"n must be an integer in \[1, 128\]"),
        ({"repetition_penalty": 0.0}, r"repetition_penalty must be in \(0, 2\]"),
        ({"presence_penalty": 5.0}, r"presence_penalty must be in \[-2, 2\]"),
        ({"logprobs": 50}, r"logprobs must be in \[0, 20\]"),
        ({"stop": [""]}, r"stop must be non-empty strings"),
    ],
)
def test_nonsense_sampling_values(kwargs, message):  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"tp": 0}, r"--tp must be at least 1 \(got 0\)"),
        ({"block_size": 12}, r"--block-size must be one of 8, 16, 32, 64, 128"),
        ({"dtype": "int8"}, r"--dtype must be auto, float32, float16 or bfloat16"),
    ],
)
def test_bad_build_options(kwargs, message):  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match=message):
        BuildOptions(model="x", **kwargs)


def test_enginebuild_cli_reports_errors(tmp_path):  # type: ignore[no-untyped-def]
    proc = subprocess.run(
        [sys.executable, "-m", "pagecast.builder.cli", "--model", str(tmp_path / "nope"), "--quiet"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "enginebuild: error: --model" in proc.stderr and "no such file or directory" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_existing_output_needs_force(tmp_path, tiny_llama_checkpoint):  # type: ignore[no-untyped-def]
    from pagecast.builder.pipeline import build

    out = tmp_path / "art"
    build_artifact(tiny_llama_checkpoint, out)
    with pytest.raises(BuildError, match=r"already exists; pass --force"):
        build(BuildOptions(model=str(tiny_llama_checkpoint), output=out, quiet=True))


def test_changed_weights_are_refused(tmp_path, tiny_llama_checkpoint):  # type: ignore[no-untyped-def]
    art = build_artifact(tiny_llama_checkpoint, tmp_path / "art")
    weights = art / "weights" / "rank0.safetensors"
    data = bytearray(weights.read_bytes())
    data[-5] ^= 0xFF  # inside the last tensor's data: the file still loads, but it is not what was built
    weights.write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match=r"file weights/rank0\.safetensors does not match the manifest"):
        LLM(art)


def test_changed_weights_are_refused_by_chunk_hashes(tmp_path, tiny_llama_checkpoint, monkeypatch):  # type: ignore[no-untyped-def]
    import pagecast.runtime.artifact as artifact

    monkeypatch.setattr(artifact, "CHUNK_BYTES", 1 << 22)  # 4 MiB chunks: the tiny weights get several
    art = build_artifact(tiny_llama_checkpoint, tmp_path / "art")
    manifest = json.loads((art / "manifest.json").read_text())
    assert len(manifest["chunk_hashes"]["weights/rank0.safetensors"]) >= 3
    LLM(art)  # unchanged: verifies chunk by chunk and loads
    weights = art / "weights" / "rank0.safetensors"
    data = bytearray(weights.read_bytes())
    data[(1 << 22) + 100] ^= 0x01  # one bit in the second chunk
    weights.write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match=r"file weights/rank0\.safetensors does not match the manifest"):
        LLM(art)
