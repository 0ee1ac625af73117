"""Helpers for the conveniences tests (no tests here)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

# The tiny Llama with a generation config that samples from the top token only (so sampling
# is greedy whatever the temperature) and stops at 7 new tokens.
SAMPLING_DEFAULTS = {"do_sample": True, "temperature": 0.9, "top_k": 1, "max_new_tokens": 7}
_built: dict[Path, Path] = {}


def defaults_artifact(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Built once per test session (the LLM and the server tests share it)."""
    from conftest import build_artifact

    if checkpoint not in _built:
        copy = tmp_path_factory.mktemp("gen-config-ckpt") / "ckpt"
        shutil.copytree(checkpoint, copy)
        config = json.loads((copy / "generation_config.json").read_text())
        config.update(SAMPLING_DEFAULTS)
        (copy / "generation_config.json").write_text(json.dumps(config))
        _built[checkpoint] = build_artifact(copy, tmp_path_factory.mktemp("gen-config-art") / "engine")
    return _built[checkpoint]
