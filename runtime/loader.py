"""Load an artifact: check it, import its model code, map its weights onto the device.

No tracing, tuning or compiling happens here. Compiled Triton kernels travel inside the
artifact (triton_cache/) and Triton's cache is pointed there before any kernel loads.
"""

from __future__ import annotations

import atexit
import hashlib
import importlib.util
import json
import os
import shutil
import sys
import tempfile
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pagecast.runtime.artifact import Manifest, is_weight_file, load_manifest, verify_files
from pagecast.runtime.errors import ArtifactError

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class LoadedArtifact:
    path: Path
    manifest: Manifest
    model: Any  # the generated Model
    tokenizer: Any | None  # transformers tokenizer; None for token-id-only artifacts
    device: torch.device
    dtype: torch.dtype
    memory_plan: dict[str, Any]
    # Weight files are hashed in a background thread while the rest of start-up runs (16 GB take
    # ~10 s to hash); the engine calls wait_verified() before it serves anything.
    weights_verified: Future[None] | None = None

    def wait_verified(self) -> None:
        if self.weights_verified is not None:
            self.weights_verified.result()
            self.weights_verified = None


def check_device(manifest: Manifest) -> torch.device:
    target = manifest.target
    if target.kind == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ArtifactError(
            f"this artifact was built for a {target.name} GPU but no CUDA GPU is available here; "
            f"rebuild it with enginebuild --gpu cpu to run on the CPU"
        )
    here = tuple(torch.cuda.get_device_capability(0))
    if target.compute_capability is not None and here != tuple(target.compute_capability):
        raise ArtifactError(
            f"this artifact was built for compute capability {tuple(target.compute_capability)} "
            f"({target.name}); this GPU ({torch.cuda.get_device_name(0)}) is {here}: rebuild it here with "
            f"enginebuild --gpu auto (or --gpu NAME for this GPU)"
        )
    if torch.cuda.device_count() < manifest.tp:
        raise ArtifactError(f"the artifact needs {manifest.tp} GPUs (tp={manifest.tp}); {torch.cuda.device_count()} visible")
    return torch.device("cuda", 0)


def import_model_module(path: Path) -> Any:
    source = path / "model.py"
    name = "pagecast_artifact_" + hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:12]
    spec = importlib.util.spec_from_file_location(name, source)
    if spec is None or spec.loader is None:
        raise ArtifactError(f"{source} cannot be imported")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        raise ArtifactError(f"{source} failed to import ({e}); rebuild the artifact with this pagecast") from e
    return module


def load_weights(path: Path, device: torch.device, rank: int = 0) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    file = path / "weights" / f"rank{rank}.safetensors"
    try:
        return load_file(str(file), device=str(device))
    except Exception as e:  # safetensors raises its own error types
        raise ArtifactError(f"{file} cannot be read ({e}); rebuild the artifact") from e


def load_artifact(artifact_dir: str | os.PathLike[str], verify_weights: bool = True) -> LoadedArtifact:
    """Check and load an artifact. With ``verify_weights`` the weight files are hashed in the
    background; call ``wait_verified()`` on the result before serving (LLMEngine does)."""
    path = Path(artifact_dir)
    manifest = load_manifest(path)
    verify_files(path, manifest, include=lambda rel: not is_weight_file(rel))
    for rel in manifest.files:
        if is_weight_file(rel) and not (path / rel).is_file():
            raise ArtifactError(f"{path}: file {rel} listed in the manifest is missing; rebuild the artifact")
    device = check_device(manifest)
    verified = None
    if verify_weights:
        verified = ThreadPoolExecutor(1, thread_name_prefix="pagecast-verify").submit(
            verify_files, path, manifest, is_weight_file
        )
    triton_cache = path / "triton_cache"
    if triton_cache.is_dir():
        # Triton rewrites index files in its cache when it loads kernels: serve from a private copy so
        # the artifact stays exactly as built (and its hashes keep matching).
        private = Path(tempfile.mkdtemp(prefix="pagecast-triton-"))
        shutil.copytree(triton_cache, private, dirs_exist_ok=True)
        atexit.register(shutil.rmtree, private, True)
        os.environ["TRITON_CACHE_DIR"] = str(private)

    from pagecast.kernels import ops

    tuning = json.loads((path / "tuning.json").read_text())
    ops.configure(tuning.get("kernels"), use_triton=device.type == "cuda")
    module = import_model_module(path)
    weights = load_weights(path, device)
    model = module.Model(weights, device)
    tokenizer = None
    if (path / "tokenizer").is_dir():
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(path / "tokenizer"))
    return LoadedArtifact(
        path=path,
        manifest=manifest,
        model=model,
        tokenizer=tokenizer,
        device=device,
        dtype=TORCH_DTYPES[manifest.dtype],
        memory_plan=json.loads((path / "memory_plan.json").read_text()),
        weights_verified=verified,
    )
