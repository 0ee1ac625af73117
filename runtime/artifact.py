"""The engine artifact: the only contract between enginebuild and the runtime.

An artifact is a directory:

    manifest.json     this module's Manifest, with the sha256 of every other file
    model.py          model code rendered by the builder for this model and rank layout
    weights/rank{r}.safetensors
    tokenizer/        tokenizer files and chat template
    tuning.json       kernel -> shape bucket -> launch config
    memory_plan.json  KV bytes per block and blocks per memory budget
    report.md         human-readable build report

The builder writes it; the runtime reads it through ``load_manifest`` and ``verify_files``
and refuses anything it cannot run correctly, saying what to do instead.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from pagecast.runtime.errors import ArtifactError

FORMAT_VERSION = 1
MANIFEST = "manifest.json"


@dataclass(frozen=True)
class TargetDevice:
    """What the artifact was built (and tuned) for."""

    kind: str  # "cpu" or "cuda"
    name: str  # "cpu", "h200", ...
    compute_capability: tuple[int, int] | None = None  # CUDA only; the runtime refuses another one
    tuned: bool = False  # True when tuning ran on this GPU, False when a shipped default table was used


@dataclass(frozen=True)
class Manifest:
    """Everything the runtime needs to know about an artifact, and nothing it must infer."""

    format_version: int
    name: str
    family: str  # "llama", "qwen2", "qwen3", "mistral"
    architecture: str  # the HF architecture class the checkpoint declared
    dims: dict[str, Any]  # hidden_size, num_layers, num_heads, num_kv_heads, head_dim, vocab_size, ...
    dtype: str  # weights and activations dtype: "float32" | "float16" | "bfloat16" (the KV cache: kv_cache)
    block_size: int
    tp: int
    quant: str | None
    max_model_len: int
    target: TargetDevice
    eos_token_ids: list[int]  # every token id that ends generation (generation config + GGUF metadata)
    bos_token_id: int | None
    versions: dict[str, str]  # pagecast, torch, triton, transformers at build time
    build_options: dict[str, Any]
    files: dict[str, str] = field(default_factory=dict)  # relative path -> sha256
    # Files over CHUNK_BYTES also get the sha256 of each CHUNK_BYTES piece, so the runtime can
    # check 16 GB of weights on several cores at once instead of one (seconds off every start).
    chunk_hashes: dict[str, list[str]] = field(default_factory=dict)
    # Tensor-parallel layout (builder.shard): per-rank heads, KV heads and their replication, MLP
    # width, vocabulary rows; and "weights": "files" (weights/rank{r}.safetensors) or "random"
    # (--load-format dummy: drawn at load from "seed" + rank with the shapes in "tensors").
    # Empty in artifacts from before tensor parallelism: one rank, weights in files.
    layout: dict[str, Any] = field(default_factory=dict)

    @property
    def kv_heads_per_rank(self) -> int:
        """KV heads in one rank's cache (the KV cache of every rank has this shape)."""
        return int(self.layout.get("num_kv_heads", self.dims["num_kv_heads"]))

    @property
    def random_weights(self) -> bool:
        return self.layout.get("weights") == "random"
    # AWQ/GPTQ builds: method, bits, group_size (-1 per channel), sym, desc_act, checkpoint_format of
    # the source checkpoint; the weights are int4 in the one layout kernels/w4a16_gemm.py reads.
    quantization: dict[str, Any] | None = None
    # KV cache storage (builder.kv_cache): "dtype" (a torch dtype name: the model's, or
    # "float8_e4m3fn") and for fp8 the per-layer "k_scales" / "v_scales" (fp32; the cache holds
    # fp8(x / scale)) and "scales_source" ("checkpoint" or "default"). Empty in artifacts from
    # before fp8 KV caches: the cache is in ``dtype``.
    kv_cache: dict[str, Any] = field(default_factory=dict)

    @property
    def kv_cache_dtype(self) -> str:
        """The KV cache's dtype name (the artifact decides it; the runtime allocates this)."""
        return str(self.kv_cache.get("dtype", self.dtype))

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Manifest:
        data = dict(data)
        target = dict(data.pop("target"))
        if target.get("compute_capability") is not None:
            target["compute_capability"] = tuple(target["compute_capability"])
        return cls(target=TargetDevice(**target), **data)


CHUNK_BYTES = 1 << 30
_READ = 16 << 20


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_READ):
            digest.update(block)
    return digest.hexdigest()


def hash_file(path: Path) -> tuple[str, list[str] | None]:
    """sha256 of the whole file and, for files over CHUNK_BYTES, of each chunk (one read pass)."""
    whole = hashlib.sha256()
    chunks: list[str] = []
    piece = hashlib.sha256()
    in_piece = 0
    read = min(_READ, CHUNK_BYTES)  # both powers of two: a block never straddles two chunks
    with open(path, "rb") as f:
        while block := f.read(read):
            whole.update(block)
            piece.update(block)
            in_piece += len(block)
            if in_piece == CHUNK_BYTES:
                chunks.append(piece.hexdigest())
                piece, in_piece = hashlib.sha256(), 0
    if in_piece:
        chunks.append(piece.hexdigest())
    return whole.hexdigest(), chunks if len(chunks) > 1 else None


def _sha256_range(path: Path, offset: int, length: int) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        f.seek(offset)
        while length > 0 and (block := f.read(min(_READ, length))):
            digest.update(block)
            length -= len(block)
    return digest.hexdigest()


def hash_tree(root: Path) -> tuple[dict[str, str], dict[str, list[str]]]:
    """(sha256 of every file under root except the manifest, chunk hashes of the large ones),
    keyed by relative POSIX path."""
    files: dict[str, str] = {}
    chunks: dict[str, list[str]] = {}
    for dirpath, _, filenames in os.walk(root):
        for fn in sorted(filenames):
            path = Path(dirpath) / fn
            rel = path.relative_to(root).as_posix()
            if rel != MANIFEST:
                files[rel], pieces = hash_file(path)
                if pieces:
                    chunks[rel] = pieces
    return dict(sorted(files.items())), chunks


def load_manifest(artifact_dir: str | os.PathLike[str]) -> Manifest:
    root = Path(artifact_dir)
    path = root / MANIFEST
    if not root.is_dir():
        raise ArtifactError(f"{root} is not a directory: pass the directory enginebuild wrote (artifacts/NAME)")
    if not path.is_file():
        raise ArtifactError(f"{root} has no {MANIFEST}: it is not a pagecast artifact; build one with enginebuild")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ArtifactError(f"{path} is not valid JSON ({e}); rebuild the artifact with enginebuild") from e
    version = data.get("format_version")
    if version != FORMAT_VERSION:
        raise ArtifactError(
            f"{root}: artifact format_version {version!r} is not supported by this pagecast "
            f"(it reads format_version {FORMAT_VERSION}); rebuild the artifact with this version's enginebuild"
        )
    try:
        return Manifest.from_dict(data)
    except TypeError as e:
        raise ArtifactError(f"{path} is malformed ({e}); rebuild the artifact with enginebuild") from e


def verify_files(
    artifact_dir: str | os.PathLike[str], manifest: Manifest, include: Callable[[str], bool] = lambda rel: True
) -> None:
    """Check that every file the manifest lists (and ``include`` accepts) is present and unchanged."""
    root = Path(artifact_dir)
    for rel, expected in manifest.files.items():
        if not include(rel):
            continue
        path = root / rel
        if not path.is_file():
            raise ArtifactError(f"{root}: file {rel} listed in the manifest is missing; rebuild the artifact")
        pieces = manifest.chunk_hashes.get(rel)
        if pieces:
            with ThreadPoolExecutor(min(len(pieces), os.cpu_count() or 1, 16)) as pool:
                offsets = [i * CHUNK_BYTES for i in range(len(pieces))]
                actual_pieces = list(pool.map(_sha256_range, [path] * len(pieces), offsets, [CHUNK_BYTES] * len(pieces)))
            ok = actual_pieces == pieces and path.stat().st_size <= len(pieces) * CHUNK_BYTES
            actual = expected if ok else "chunk-mismatch"
        else:
            actual = sha256_file(path)
        if actual != expected:
            raise ArtifactError(
                f"{root}: file {rel} does not match the manifest (sha256 {actual[:12]}… expected "
                f"{expected[:12]}…): the artifact was modified or corrupted; rebuild it with enginebuild"
            )


def check_no_unlisted_files(artifact_dir: str | os.PathLike[str], manifest: Manifest) -> None:
    """Refuse an artifact holding files its manifest does not list.

    Nothing is written into an artifact after enginebuild hashed it (the runtime compiles
    model.py from its verified bytes and serves Triton's cache from a private copy), so an
    extra file means the directory was changed. It is refused rather than ignored: a file
    placed next to the hashed ones (bytecode that Python would prefer to model.py, a module
    that shadows an import) is how an artifact is swapped without changing a hashed file.
    """
    root = Path(artifact_dir)
    unlisted = []
    for dirpath, _, filenames in os.walk(root):
        for fn in filenames:
            rel = (Path(dirpath) / fn).relative_to(root).as_posix()
            if rel != MANIFEST and rel not in manifest.files:
                unlisted.append(rel)
    if not unlisted:
        return
    unlisted.sort()
    shown = ", ".join(unlisted[:5]) + (f" and {len(unlisted) - 5} more" if len(unlisted) > 5 else "")
    hint = ""
    if any(rel.split("/")[0] == "__pycache__" for rel in unlisted):
        hint = (
            f" (__pycache__ is bytecode an older pagecast let Python write there: delete it with "
            f"`rm -r {root / '__pycache__'}`)"
        )
    raise ArtifactError(
        f"{root}: files not listed in the manifest: {shown}{hint}. An artifact must hold exactly the "
        "files enginebuild wrote; remove the extra files or rebuild the artifact with enginebuild"
    )


def is_weight_file(rel: str) -> bool:
    return rel.startswith("weights/")
