"""Shared fixtures: tiny random checkpoints and the artifacts enginebuild makes of them.

Kernel tests run the Triton kernels through the interpreter when no GPU is present.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import pytest
import torch

from pagecast.kernels.interpreter_fix import interpreter_index_fix

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

if os.environ.get("TRITON_INTERPRET") == "1":
    interpreter_index_fix()

# Each pytest-xdist worker computes with its share of the cores, and so do the engine cores and
# servers it starts (OMP_NUM_THREADS, inherited): two workers of two threads each on CI's two
# cores wait for each other in every parallel region. Measured there: smollm2's greedy parity
# test took 113 s beside parity tests with two threads a worker, 11.5 s with one.
_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
_cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
_threads = int(os.environ.get("PAGECAST_TEST_THREADS", max(1, min(2, _cores // _workers))))
torch.set_num_threads(_threads)
if _workers > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(_threads))
sys.path.insert(0, str(Path(__file__).parent))

from tiny_models import make_checkpoint, smollm2_dir  # noqa: E402


def build_artifact(checkpoint: Path | str, output: Path, **options) -> Path:  # type: ignore[no-untyped-def]
    from pagecast.builder.ir import BuildOptions
    from pagecast.builder.pipeline import build

    return build(BuildOptions(model=str(checkpoint), output=output, force=True, quiet=True, **options))


def cuda_workspace_bytes(call):  # type: ignore[no-untyped-def]
    """(call's result, the peak bytes it requested from the caching allocator beyond what was held
    before, less its result's): the allocator's requested-bytes counters, not its allocated ones,
    which count whole cached blocks (a reused block up to 1 MiB larger than the request is not
    split) and so exceed what the code asked for."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_stats()["requested_bytes.all.current"]
    torch.cuda.reset_peak_memory_stats()
    out = call()
    torch.cuda.synchronize()
    peak = torch.cuda.memory_stats()["requested_bytes.all.peak"]
    return out, peak - base - out.numel() * out.element_size()


@pytest.fixture(scope="session")
def tiny_checkpoint_factory(tmp_path_factory):  # type: ignore[no-untyped-def]
    cache: dict[tuple, Path] = {}

    def make(family: str = "llama", **overrides) -> Path:  # type: ignore[no-untyped-def]
        key = (family, repr(sorted(overrides.items(), key=str)))
        if key not in cache:
            path = tmp_path_factory.mktemp(f"ckpt-{family}")
            cache[key] = make_checkpoint(path, family, **overrides)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def tiny_artifact_factory(tmp_path_factory, tiny_checkpoint_factory):  # type: ignore[no-untyped-def]
    cache: dict[tuple, Path] = {}

    def make(family: str = "llama", **overrides) -> Path:  # type: ignore[no-untyped-def]
        key = (family, repr(sorted(overrides.items(), key=str)))
        if key not in cache:
            ckpt = tiny_checkpoint_factory(family, **overrides)
            cache[key] = build_artifact(ckpt, tmp_path_factory.mktemp(f"art-{family}") / "engine")
        return cache[key]

    return make


@pytest.fixture(scope="session")
def tiny_llama_checkpoint(tiny_checkpoint_factory) -> Path:  # type: ignore[no-untyped-def]
    return tiny_checkpoint_factory("llama")


@pytest.fixture(scope="session")
def tiny_llama_artifact(tiny_artifact_factory) -> Path:  # type: ignore[no-untyped-def]
    """A tiny random Llama (6 query / 2 KV heads of 16, 3 layers) with the SmolLM2 tokenizer."""
    return tiny_artifact_factory("llama")


@pytest.fixture(scope="session")
def smollm2_checkpoint() -> Path:
    """The embedded default model as an HF directory (converted from its GGUF once, then cached)."""
    return smollm2_dir()


@pytest.fixture(scope="session")
def smollm2_artifact(tmp_path_factory, smollm2_checkpoint) -> Path:  # type: ignore[no-untyped-def]
    return build_artifact("smollm2-135m", tmp_path_factory.mktemp("art-smollm2") / "smollm2-135m")


@pytest.fixture(autouse=True)
def every_block_is_free_after_the_test(monkeypatch):  # type: ignore[no-untyped-def]
    """After every test, every LLM it created holds no KV block and no request (a leak of
    blocks would slowly starve a long-running server)."""
    from pagecast.runtime.llm import LLM

    created: list = []
    original = LLM.__init__

    def tracking_init(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        original(self, *args, **kwargs)
        created.append(self)

    monkeypatch.setattr(LLM, "__init__", tracking_init)
    yield
    for llm in created:
        engine = llm.engine
        assert engine.block_pool.num_used_blocks == 0, "KV blocks still in use after the test"
        assert not engine.has_unfinished_requests(), "requests left unfinished after the test"


@pytest.fixture
def restore_root_logging():  # type: ignore[no-untyped-def]
    """engine-serve's main() installs its own root log handler (on CliRunner's stderr, closed
    afterwards): put the root logger back as it was."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
