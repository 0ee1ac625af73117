"""enginebuild conveniences: --model as a model id from the local Hugging Face cache (offline),
progress shown for every pass, the checkpoint's sampling defaults recorded in the artifact,
and packaging that installs without setuptools warnings."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from click.testing import CliRunner

from pagecast.builder.cli import main as enginebuild
from pagecast.builder.pipeline import PASSES

ROOT = Path(__file__).resolve().parents[1]
COMMIT = "0123456789abcdef0123456789abcdef01234567"
GENERATION_CONFIG = {
    "bos_token_id": 1,
    "eos_token_id": 2,
    "do_sample": True,
    "temperature": 0.7,
    "top_k": 1,
    "top_p": 0.95,
    "repetition_penalty": 1.05,
    "max_new_tokens": 7,
}


def make_hf_cache(cache: Path, checkpoint: Path, repo_id: str, generation_config: dict | None = None) -> Path:  # type: ignore[type-arg]
    """A Hugging Face hub cache (HF_HUB_CACHE layout) holding ``checkpoint`` as ``repo_id``."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / COMMIT
    shutil.copytree(checkpoint, snapshot)
    if generation_config is not None:
        (snapshot / "generation_config.json").write_text(json.dumps(generation_config))
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    return snapshot


@pytest.fixture
def hf_cache(tmp_path: Path, tiny_llama_checkpoint: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    import huggingface_hub.constants

    cache = tmp_path / "hub"
    make_hf_cache(cache, tiny_llama_checkpoint, "testorg/tiny-llama", GENERATION_CONFIG)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


def test_build_from_a_cached_hub_id_shows_every_pass(hf_cache: Path, tmp_path: Path) -> None:
    output = tmp_path / "artifact"
    result = CliRunner().invoke(enginebuild, ["--model", "testorg/tiny-llama", "--gpu", "cpu", "--output", str(output)])
    assert result.exit_code == 0, result.output
    assert Path(result.stdout.strip().splitlines()[-1]) == output.resolve()
    # Each pass is announced when it starts (what it does) and timed when it ends.
    for index, (name, _) in enumerate(PASSES, start=1):
        assert f"[{index}/{len(PASSES)}] {name}: " in result.stderr, name
        assert any(line.split()[:1] == [name] and line.rstrip().endswith(" s") for line in result.stderr.splitlines())
    manifest = json.loads((output / "manifest.json").read_text())
    assert manifest["name"] == "tiny-llama"  # the repository's name, not the snapshot's hash
    # The checkpoint's sampling defaults, under SamplingParams' names, hashed like every file.
    recorded = json.loads((output / "generation_config.json").read_text())
    assert recorded["sampling_defaults"] == {
        "temperature": 0.7,
        "top_k": 1,
        "top_p": 0.95,
        "repetition_penalty": 1.05,
        "max_tokens": 7,
    }
    assert "generation_config.json" in manifest["files"]


def test_quiet_build_prints_no_progress(hf_cache: Path, tmp_path: Path) -> None:
    result = CliRunner().invoke(
        enginebuild, ["--model", "testorg/tiny-llama", "--gpu", "cpu", "--output", str(tmp_path / "a"), "--quiet"]
    )
    assert result.exit_code == 0, result.output
    assert result.stderr == ""


def test_hub_id_not_in_the_cache_is_a_clear_error(hf_cache: Path, tmp_path: Path) -> None:
    result = CliRunner().invoke(enginebuild, ["--model", "testorg/not-downloaded", "--output", str(tmp_path / "x")])
    assert result.exit_code == 2
    assert "not in the local Hugging Face cache" in result.stderr
    assert "hf download testorg/not-downloaded" in result.stderr


def test_hub_id_resolves_to_its_snapshot_and_a_revision(hf_cache: Path) -> None:
    from pagecast.builder.load import resolve_model_path

    snapshot = hf_cache / "models--testorg--tiny-llama" / "snapshots" / COMMIT
    assert resolve_model_path("testorg/tiny-llama") == snapshot
    assert resolve_model_path(f"testorg/tiny-llama@{COMMIT}") == snapshot


def test_partly_cached_repository_is_refused(hf_cache: Path, tmp_path: Path) -> None:
    from pagecast.builder.load import resolve_model_path
    from pagecast.runtime.errors import BuildError

    readme_only = tmp_path / "readme-only"
    readme_only.mkdir()
    (readme_only / "README.md").write_text("a model card, no weights")
    make_hf_cache(hf_cache, readme_only, "testorg/readme-only")
    with pytest.raises(BuildError, match="no config.json"):
        resolve_model_path("testorg/readme-only")


def test_out_of_range_generation_config_values_are_set_aside() -> None:
    from pagecast.runtime.generation_config import from_hf

    recorded = from_hf({"temperature": 5.0, "top_p": 0.9, "max_new_tokens": 0, "do_sample": True})
    assert recorded["sampling_defaults"] == {"top_p": 0.9}
    assert set(recorded["ignored"]) == {"temperature", "max_new_tokens"}


def test_wheel_builds_without_setuptools_warnings(tmp_path: Path) -> None:
    """The wheel (what pip builds) carries the kernels' default tuning tables and the model
    template, and setuptools says nothing about the package layout (it used to print ~40
    warnings about pagecast.kernels.tuning_defaults)."""
    source = tmp_path / "src"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    for name in ("builder", "runtime", "kernels", "templates"):
        shutil.copytree(ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
    code = (
        "import sys; from setuptools import build_meta; "
        f"print(build_meta.build_wheel({str(tmp_path / 'dist')!r}))"
    )
    (tmp_path / "dist").mkdir()
    proc = subprocess.run(
        [sys.executable, "-W", "always", "-c", code], cwd=source, capture_output=True, text=True, timeout=300, check=False
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    warnings = [line for line in proc.stderr.splitlines() if "Warning" in line]
    assert warnings == [], "\n".join(warnings)
    wheel = tmp_path / "dist" / proc.stdout.strip().splitlines()[-1]
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
    tables = {p.name for p in (ROOT / "kernels" / "tuning_defaults").glob("*.json")}
    assert tables and {f"pagecast/kernels/tuning_defaults/{t}" for t in tables} <= names
    assert "pagecast/templates/model.py.j2" in names
    assert "pagecast/runtime/server/app.py" in names
