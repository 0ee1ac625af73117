"""Load an artifact: check it, import its model code, map its weights onto the device.

No tracing, tuning or compiling happens here. Compiled Triton kernels travel inside the
artifact (triton_cache/) and Triton's cache is pointed there before any kernel loads.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import sys
import time
import types
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from pagecast.runtime import artifact, startup
from pagecast.runtime.artifact import (
    Manifest,
    check_no_unlisted_files,
    is_weight_file,
    load_manifest,
    verify_files,
)
from pagecast.runtime.errors import ArtifactError
from pagecast.runtime.kernel_cache import private_cache_copy

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
KV_CACHE_DTYPES = {**TORCH_DTYPES, "float8_e4m3fn": torch.float8_e4m3fn}


def zeros_kv_cache(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed KV cache; a one-byte (fp8) cache is made as uint8 and viewed as its dtype, so it
    does not depend on the device's fill kernels covering the fp8 types. On the CPU the memory
    comes zeroed from the operating system (calloc), page by page as it is first touched, instead
    of being written once here (a 1 GiB cache: 0.9 s of a 2-core machine's start)."""
    if device.type == "cpu":
        import numpy as np

        nbytes = math.prod(shape) * dtype.itemsize
        return torch.from_numpy(np.zeros(nbytes, dtype=np.uint8)).view(dtype).view(shape)
    if dtype.itemsize == 1:
        return torch.zeros(shape, dtype=torch.uint8, device=device).view(dtype)
    return torch.zeros(shape, dtype=dtype, device=device)


@dataclass
class LoadedArtifact:
    path: Path
    manifest: Manifest
    model: Any  # the generated Model
    tokenizer: Any | None  # transformers tokenizer; None for token-id-only artifacts
    device: torch.device
    dtype: torch.dtype
    memory_plan: dict[str, Any]
    kernels: Any  # pagecast.kernels.ops.KernelTable: this artifact's tuning table, activated per forward
    timings: dict[str, float] = field(default_factory=dict)  # seconds per load phase, for start-up logs
    # On a GPU the weights are read (and checked against the manifest's hashes) in the background
    # while the engine allocates its KV cache and captures its CUDA graphs; wait_verified() waits
    # for them and raises ArtifactError if they do not match. LLMEngine calls it before serving.
    weights_verified: Future[None] | None = None

    @property
    def kv_cache_dtype(self) -> torch.dtype:
        """The dtype the KV cache is allocated in (the artifact's choice; see Manifest.kv_cache)."""
        return KV_CACHE_DTYPES[self.manifest.kv_cache_dtype]

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
        raise ArtifactError(
            f"the artifact was built with --tp {manifest.tp} and needs {manifest.tp} GPUs, but "
            f"{torch.cuda.device_count()} are visible: make {manifest.tp} GPUs visible (CUDA_VISIBLE_DEVICES) "
            f"or rebuild it with a smaller --tp"
        )
    return torch.device("cuda", 0)


MODEL_FILE = "model.py"


def import_model_module(path: Path, manifest: Manifest | None = None) -> Any:
    """Run the artifact's model.py as a fresh module and return it.

    The file is read once; those bytes are checked against the manifest's sha256 and are the
    bytes compiled and executed. Python's import machinery is not used: it would prefer a
    ``__pycache__/model.*.pyc`` whose header matches model.py's mtime and size (bytecode
    nobody hashed) and would write bytecode into the artifact. Here no bytecode is read from
    or written to the artifact directory.
    """
    manifest = manifest if manifest is not None else load_manifest(path)
    source_path = path / MODEL_FILE
    expected = manifest.files.get(MODEL_FILE)
    if expected is None:
        raise ArtifactError(f"{path}: the manifest does not list {MODEL_FILE}; rebuild the artifact with enginebuild")
    try:
        source = source_path.read_bytes()
    except OSError as e:
        raise ArtifactError(f"{source_path} cannot be read ({e}); rebuild the artifact") from e
    actual = hashlib.sha256(source).hexdigest()
    if actual != expected:
        raise ArtifactError(
            f"{path}: file {MODEL_FILE} does not match the manifest (sha256 {actual[:12]}… expected "
            f"{expected[:12]}…): the artifact was modified or corrupted; rebuild it with enginebuild"
        )
    name = "pagecast_artifact_" + hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:12]
    module = types.ModuleType(name)
    module.__file__ = str(source_path)
    sys.modules[name] = module  # dataclasses and typing look their module up by name
    try:
        code = compile(source, str(source_path), "exec", dont_inherit=True)
        exec(code, module.__dict__)  # noqa: S102 - the verified model code of the artifact
    except Exception as e:
        sys.modules.pop(name, None)
        raise ArtifactError(f"{source_path} failed to import ({e}); rebuild the artifact with this pagecast") from e
    return module


def load_weights(
    path: Path, device: torch.device, rank: int = 0, manifest: Manifest | None = None
) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s weights on ``device``; with ``manifest``, checked against its hashes while
    they are read (each byte is read once, on all cores)."""
    tensors, fill = open_weights(path, device, rank, manifest)
    fill()
    return tensors


def open_weights(
    path: Path, device: torch.device, rank: int = 0, manifest: Manifest | None = None
) -> tuple[dict[str, torch.Tensor], Callable[[], None]]:
    """Rank ``rank``'s weight tensors, allocated on ``device``, and the ``fill`` that reads them
    in (see weights.open_safetensors)."""
    from pagecast.runtime.weights import open_safetensors

    rel = f"weights/rank{rank}.safetensors"
    file = path / rel
    hashes = None
    cache, identity = artifact.HashCache(), None
    if manifest is not None and rel in manifest.files:
        identity = artifact.file_identity(file) if file.is_file() else None
        if identity is None or not cache.verified(file, identity, manifest.files[rel]):
            hashes = manifest.chunk_hashes.get(rel) or [manifest.files[rel]]  # else: verified before, unchanged
    try:
        tensors, fill = open_safetensors(file, device, artifact.CHUNK_BYTES, hashes, label=f"{path}: file {rel}")
    except ArtifactError:
        raise
    except Exception as e:
        raise ArtifactError(f"{file} cannot be read ({e}); rebuild the artifact") from e

    def checked_fill() -> None:
        try:
            fill()
            if hashes is not None and identity is not None and manifest is not None:
                cache.remember(file, identity, manifest.files[rel])
                cache.save()
        except ArtifactError:
            raise
        except Exception as e:
            raise ArtifactError(f"{file} cannot be read ({e}); rebuild the artifact") from e

    return tensors, checked_fill


def random_weights(manifest: Manifest, device: torch.device, rank: int) -> dict[str, torch.Tensor]:
    """--load-format dummy: the rank's tensors drawn from the manifest's seed (norms are ones),
    on the device itself (70B-class shards take seconds there, minutes on a CPU)."""
    dtype = TORCH_DTYPES[manifest.dtype]
    gen = torch.Generator(device).manual_seed(int(manifest.layout.get("seed", 0)) + rank)
    out = {}
    for name, shape in manifest.layout["tensors"].items():
        if name.endswith("norm.weight"):
            out[name] = torch.ones(shape, dtype=dtype, device=device)
        else:
            out[name] = (torch.randn(shape, generator=gen, dtype=torch.float32, device=device) * 0.02).to(dtype)
    return out


def open_rank_weights(
    path: Path, manifest: Manifest, device: torch.device, rank: int, verify: bool = True
) -> tuple[dict[str, torch.Tensor], Callable[[], None]]:
    """Rank ``rank``'s weights and the ``fill`` that reads them in (open_weights; checked against
    the manifest's hashes with ``verify``), or random ones, already drawn, when the manifest says so."""
    if manifest.random_weights:
        return random_weights(manifest, device, rank), lambda: None
    return open_weights(path, device, rank, manifest if verify else None)


def rank_weights(path: Path, manifest: Manifest, device: torch.device, rank: int, verify: bool = True) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s weights, read in (or drawn)."""
    tensors, fill = open_rank_weights(path, manifest, device, rank, verify)
    fill()
    return tensors


def load_rank(artifact_dir: str | os.PathLike[str], rank: int, device: torch.device, verify: bool = True) -> Any:
    """A tensor-parallel worker's model: rank ``rank``'s weights (hashes checked while read)
    under the artifact's model code. Rank 0 (load_artifact) has checked the manifest and the
    device and pointed Triton at the artifact's kernels (inherited through the environment)."""

    path = Path(artifact_dir)
    manifest = load_manifest(path)
    configure_kernels(json.loads((path / "tuning.json").read_text()), device)
    module = import_model_module(path)
    return module.Model(rank_weights(path, manifest, device, rank, verify), device)


def configure_kernels(tuning: dict[str, Any], device: torch.device) -> Any:
    """Activate the artifact's kernel table (tuning.json) for ``device``: its configs; "pdl", built
    with programmatic dependent launch (kernels/pdl.py), whose kernel variants the artifact's Triton
    cache holds. Returns the ops.KernelTable."""
    from pagecast.kernels import ops

    return ops.configure(tuning.get("kernels"), use_triton=device.type == "cuda", pdl=bool(tuning.get("pdl")))


def load_artifact(
    artifact_dir: str | os.PathLike[str], verify_weights: bool = True, load_tokenizer: bool = True
) -> LoadedArtifact:
    """Check and load an artifact. With ``verify_weights`` the weight files are hashed in the
    background; call ``wait_verified()`` on the result before serving (LLMEngine does). An
    engine-core process needs no tokenizer (the server detokenizes): ``load_tokenizer=False``."""
    path = Path(artifact_dir)
    manifest = load_manifest(path)
    check_no_unlisted_files(path, manifest)
    verify_files(path, manifest, include=lambda rel: not is_weight_file(rel))
    for rel in manifest.files:
        if is_weight_file(rel) and not (path / rel).is_file():
            raise ArtifactError(f"{path}: file {rel} listed in the manifest is missing; rebuild the artifact")
    device = check_device(manifest)
    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    triton_cache = path / "triton_cache"
    if triton_cache.is_dir():
        os.environ["TRITON_CACHE_DIR"] = str(private_cache_copy(triton_cache))

    tuning = json.loads((path / "tuning.json").read_text())
    kernels = configure_kernels(tuning, device)
    module = import_model_module(path, manifest)
    check_kv_cache(path, manifest, module)
    timings["prepare"] = time.perf_counter() - t0
    startup.mark("model code")
    t0 = time.perf_counter()
    weights, fill = open_rank_weights(path, manifest, device, 0, verify_weights)
    startup.mark("weights allocated")

    def fill_and_stamp() -> None:
        fill()
        startup.mark("weights read, on the device")

    loading: Future[None] | None = None
    if device.type == "cuda":
        # The weights stream in while the engine sets up (KV cache, CUDA-graph captures, which
        # need the tensors' addresses, not their values); the engine waits for them before it
        # runs anything real. Model.__init__ therefore must not read weight values.
        loading = ThreadPoolExecutor(1, thread_name_prefix="pagecast-weights").submit(fill_and_stamp)
    else:
        fill_and_stamp()
    timings["weights"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    model = module.Model(weights, device)
    if manifest.tp > 1:
        from pagecast.runtime import parallel

        # The ModelRunner starts the other ranks from this (in whichever process runs it).
        model.tp_launch = parallel.TPLaunch(
            str(path.resolve()), manifest.tp, device.type, verify_weights, manifest.dtype, parallel.ALL_REDUCE
        )
    timings["model"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    tokenizer = load_artifact_tokenizer(path) if load_tokenizer else None
    timings["tokenizer"] = time.perf_counter() - t0
    return LoadedArtifact(
        path=path,
        manifest=manifest,
        model=model,
        tokenizer=tokenizer,
        device=device,
        dtype=TORCH_DTYPES[manifest.dtype],
        memory_plan=json.loads((path / "memory_plan.json").read_text()),
        kernels=kernels,
        timings=timings,
        weights_verified=loading,
    )


def check_kv_cache(path: Path, manifest: Manifest, module: Any) -> None:
    """The manifest's KV-cache dtype must be one this runtime allocates and the one the model code
    was rendered for (an fp8 cache needs Ada/Hopper or newer; check_device has matched the GPU)."""
    name = manifest.kv_cache_dtype
    if name not in KV_CACHE_DTYPES:
        raise ArtifactError(
            f"{path}: KV-cache dtype {name!r} is not supported by this pagecast (it supports "
            f"{', '.join(KV_CACHE_DTYPES)}); rebuild the artifact with this version's enginebuild"
        )
    rendered = getattr(module, "KV_CACHE_DTYPE", TORCH_DTYPES.get(manifest.dtype))
    if rendered != KV_CACHE_DTYPES[name]:
        raise ArtifactError(
            f"{path}: the manifest's KV cache ({name}) and model.py's ({rendered}) disagree; rebuild the artifact"
        )


# tokenizer_config.json's tokenizer_class values that name transformers' tokenizers-library class
# itself (PreTrainedTokenizerFast is an alias of it in transformers 5).
_TOKENIZERS_BACKEND = ("TokenizersBackend", "PreTrainedTokenizerFast")


def load_artifact_tokenizer(path: Path) -> Any | None:
    """The artifact's tokenizer (transformers), or None for a token-id-only artifact.

    When the tokenizer's config names transformers' tokenizers-library class, that class loads it
    directly: what AutoTokenizer would pick, without importing AutoTokenizer, whose model registry
    imports much of torch (torch._dynamo, torch.distributed.tensor): 3-4 s of CPU against ~1 s, on
    the server's path to /health."""
    folder = path / "tokenizer"
    if not folder.is_dir():
        return None
    try:
        config = json.loads((folder / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        config = {}
    if config.get("tokenizer_class") in _TOKENIZERS_BACKEND and "auto_map" not in config:
        try:
            from transformers.tokenization_utils_tokenizers import TokenizersBackend
        except ImportError:  # another transformers layout: the general way
            pass
        else:
            return TokenizersBackend.from_pretrained(str(folder))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))
