"""The model code that runs is exactly the model.py bytes the manifest hashed (issue 11):
planted bytecode never runs, nothing is written into the artifact, and files the manifest
does not list are refused."""

from __future__ import annotations

import importlib.util
import json
import marshal
import shutil
import sys
from pathlib import Path

import pytest

from pagecast.runtime import LLM, SamplingParams
from pagecast.runtime.errors import ArtifactError
from pagecast.runtime.loader import import_model_module


@pytest.fixture()
def artifact(tiny_llama_artifact, tmp_path) -> Path:  # type: ignore[no-untyped-def]
    """A private copy of the tiny artifact (tests here change it)."""
    return Path(shutil.copytree(tiny_llama_artifact, tmp_path / "engine"))


def files_under(root: Path) -> set[str]:
    return {p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()}


def plant_bytecode(artifact: Path, marker: Path) -> Path:
    """A ``__pycache__/model.*.pyc`` whose header matches model.py's mtime and size (what
    Python's import checks), holding model.py plus code that writes ``marker``."""
    source_path = artifact / "model.py"
    source = source_path.read_text() + f"\nimport pathlib\npathlib.Path({str(marker)!r}).write_text('ran')\n"
    code = compile(source, str(source_path), "exec")
    stat = source_path.stat()
    header = importlib.util.MAGIC_NUMBER + (0).to_bytes(4, "little")
    header += (int(stat.st_mtime) & 0xFFFFFFFF).to_bytes(4, "little") + (stat.st_size & 0xFFFFFFFF).to_bytes(
        4, "little"
    )
    pyc = Path(importlib.util.cache_from_source(str(source_path)))
    pyc.parent.mkdir(exist_ok=True)
    pyc.write_bytes(header + marshal.dumps(code))
    return pyc


def test_planted_bytecode_is_refused_and_never_executed(artifact, tmp_path):  # type: ignore[no-untyped-def]
    marker = tmp_path / "planted-code-ran"
    plant_bytecode(artifact, marker)
    with pytest.raises(ArtifactError, match=r"not listed in the manifest: __pycache__/model\..*\.pyc.*rm -r"):
        LLM(artifact)
    assert not marker.exists()
    # Even past the listing check, the loader compiles the verified model.py, never the bytecode.
    module = import_model_module(artifact)
    assert hasattr(module, "Model")
    assert not marker.exists()


def test_nothing_is_written_into_the_artifact(artifact, monkeypatch):  # type: ignore[no-untyped-def]
    # As on a user's machine (CI may set PYTHONDONTWRITEBYTECODE): Python may write bytecode.
    monkeypatch.setattr(sys, "dont_write_bytecode", False)
    before = files_under(artifact)
    manifest = json.loads((artifact / "manifest.json").read_text())
    assert before == set(manifest["files"]) | {"manifest.json"}
    llm = LLM(artifact, kv_cache_memory="16MiB")
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2, temperature=0))
    assert len(out[0].outputs[0].token_ids) == 2
    assert files_under(artifact) == before  # no __pycache__, no Triton index, nothing
    # And it loads again, as a server restart would.
    LLM(artifact, kv_cache_memory="16MiB")


@pytest.mark.parametrize("extra", ["extra.py", "tokenizer/added.json", "weights/rank1.safetensors"])
def test_unlisted_file_is_refused(artifact, extra):  # type: ignore[no-untyped-def]
    (artifact / extra).write_text("{}")
    with pytest.raises(ArtifactError, match=rf"files not listed in the manifest: {extra}.*rebuild"):
        LLM(artifact)


def test_model_code_is_the_hashed_bytes(artifact):  # type: ignore[no-untyped-def]
    """The bytes executed are the bytes checked: a model.py changed after the artifact's files
    were verified is still refused when it is imported."""
    import_model_module(artifact)
    with open(artifact / "model.py", "a") as f:
        f.write("\nraise SystemExit('swapped')\n")
    with pytest.raises(ArtifactError, match=r"model\.py does not match the manifest"):
        import_model_module(artifact)
