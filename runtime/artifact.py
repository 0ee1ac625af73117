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
import logging
import os
import shlex
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path, PurePosixPath
from typing import Any

from pagecast.kernels import KERNEL_ABI, KERNEL_ABI_OLDEST
from pagecast.runtime.errors import ArtifactError

# The batch enginebuild plans, captures CUDA graphs and tunes for unless given --max-num-seqs, and
# so the batch an engine runs by default on an artifact that does not record its build's; and the
# least token budget of a step when the engine's options leave it unset: the memory plan sizes a
# step's activations for max(DEFAULT_STEP_TOKENS, max_num_seqs) tokens (builder/plan.py).
DEFAULT_MAX_NUM_SEQS = 256
DEFAULT_STEP_TOKENS = 2048

logger = logging.getLogger("pagecast.runtime")

# 2 added ``kernel_abi``. A format_version 1 manifest has none and is read as kernel ABI 1: the
# kernel API its model.py calls is the one ABI 1 names (the ABI was first counted there).
FORMAT_VERSION = 2
READABLE_FORMAT_VERSIONS = (1, 2)
MANIFEST = "manifest.json"
# Where enginebuild --speculative-config puts the drafter it builds or copies into an artifact.
SPECULATIVE_DIR = "speculative"


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
    # pagecast.kernels.KERNEL_ABI at build: the version of the kernel API the rendered model.py
    # calls (positionally). The runtime refuses another one: those calls would bind wrong
    # arguments or fail mid-request. 1 in format_version 1 artifacts, which did not record it.
    kernel_abi: int = 1
    # The speculative decoding the artifact serves with when LLM / engine-serve are given no
    # speculative_config (enginebuild --speculative-config): runtime/speculative.py's keys, with
    # ``model`` (draft_model, eagle3) relative to the artifact (SPECULATIVE_DIR, a nested
    # artifact or head directory whose files this manifest lists and hashes too). None (and
    # absent from manifest.json, which older runtimes then still read) when built without.
    speculative: dict[str, Any] | None = None

    @property
    def kv_cache_dtype(self) -> str:
        """The KV cache's dtype name (the artifact decides it; the runtime allocates this)."""
        return str(self.kv_cache.get("dtype", self.dtype))

    def to_json(self) -> str:
        data = asdict(self)
        if data["speculative"] is None:
            del data["speculative"]  # optional: an artifact built without it reads as before
        return json.dumps(data, indent=2, sort_keys=True)

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
    version = data.get("format_version") if isinstance(data, dict) else None
    if version not in READABLE_FORMAT_VERSIONS:
        raise ArtifactError(
            f"{root}: artifact format_version {version!r} is not supported by this pagecast "
            f"(it reads format_version {FORMAT_VERSION}, and 1); rebuild the artifact with this version's enginebuild"
        )
    if version == 1 and "kernel_abi" in data:
        raise ArtifactError(f"{path} is malformed (kernel_abi in a format_version 1 manifest); rebuild the artifact")
    try:
        manifest = Manifest.from_dict(data)
    except TypeError as e:
        raise ArtifactError(f"{path} is malformed ({e}); rebuild the artifact with enginebuild") from e
    check_file_names(root, manifest)
    check_versions(root, manifest)
    return manifest


def check_file_names(artifact_dir: str | os.PathLike[str], manifest: Manifest) -> None:
    """Every name the manifest lists (its files, and the drafter directory its ``speculative``
    names) is inside the artifact: a relative POSIX path with no ``..``, and (symlinks followed)
    still under the artifact directory. A manifest naming
    anything else is refused before any file is opened, hashed or read: it would make the
    runtime read (and print the digest of) a file outside the artifact."""
    root = Path(artifact_dir)
    real_root = root.resolve()
    names = set(manifest.files) | set(manifest.chunk_hashes)
    drafter = (manifest.speculative or {}).get("model")
    if drafter is not None:  # the drafter enginebuild put inside (``speculative/``): run from here, never from elsewhere
        names.add(drafter)
    for rel in sorted(names, key=str):
        if not isinstance(rel, str) or not _is_plain_relative(rel):
            raise ArtifactError(
                f"{root}: the manifest names the file {rel!r}, which is not a relative path inside the "
                "artifact (absolute, with '..' or a backslash). The manifest was altered; rebuild the "
                "artifact with enginebuild"
            )
        target = (root / rel).resolve()
        if not target.is_relative_to(real_root):
            raise ArtifactError(
                f"{root}: {rel} leads outside the artifact (to {target}, through a symbolic link). An "
                "artifact holds its files itself; replace the link with the file or rebuild the artifact"
            )


def _is_plain_relative(rel: str) -> bool:
    if not rel or "\\" in rel or "\x00" in rel or rel.startswith("/"):
        return False
    parts = PurePosixPath(rel).parts
    return not any(part in ("..", ".", "") for part in parts) and PurePosixPath(rel).as_posix() == rel


def installed_versions() -> dict[str, str]:
    """The versions of the libraries an artifact records, as installed here (from package
    metadata: nothing is imported)."""
    from pagecast.runtime import __version__

    out = {"pagecast": __version__}
    for name in ("torch", "triton", "transformers"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "not installed"
    return out


def rebuild_command(artifact_dir: str | os.PathLike[str], manifest: Manifest) -> str:
    """The enginebuild command line that rebuilds this artifact in place, from its build options."""
    opts = manifest.build_options
    args = ["enginebuild", "--model", str(opts.get("model", "MODEL"))]
    defaults = {"gpu": "auto", "tp": 1, "dtype": "auto", "quant": None, "block_size": 16, "max_model_len": None,
                "kv_cache_dtype": "auto", "load_format": "auto", "max_num_seqs": DEFAULT_MAX_NUM_SEQS}
    for key, default in defaults.items():
        value = opts.get(key, default)
        if value is not None and value != default:
            args += [f"--{key.replace('_', '-')}", str(value)]
    if opts.get("fp8_lm_head"):
        args.append("--fp8-lm-head")
    if opts.get("speculative_config"):
        args += ["--speculative-config", json.dumps(opts["speculative_config"], sort_keys=True)]
    args += ["--output", str(artifact_dir), "--force"]
    return shlex.join(args)


# Artifacts whose library differences were already reported by this process (one warning each).
_WARNED: set[tuple[str, str]] = set()


def check_versions(artifact_dir: str | os.PathLike[str], manifest: Manifest) -> None:
    """Compare what the artifact was built with to what is installed. A kernel ABI outside
    KERNEL_ABI_OLDEST..KERNEL_ABI is refused (the model code would call the kernels wrongly),
    with the command that rebuilds it; a different torch, transformers or (for GPU artifacts)
    triton is a warning, once per artifact and process: the artifact still runs, but its kernels
    were tuned and compiled against the other version, so speed (and, rarely, numerics) may differ."""
    if not KERNEL_ABI_OLDEST <= manifest.kernel_abi <= KERNEL_ABI:
        have = f"ABI {KERNEL_ABI}" if KERNEL_ABI_OLDEST == KERNEL_ABI else f"ABI {KERNEL_ABI} (and run {KERNEL_ABI_OLDEST}-{KERNEL_ABI})"
        raise ArtifactError(
            f"{artifact_dir}: built for kernel ABI {manifest.kernel_abi} (pagecast "
            f"{manifest.versions.get('pagecast', '?')}), but this pagecast's kernels have {have}: "
            "its model code calls kernels this version does not provide in that form. Rebuild it with this "
            f"pagecast: {rebuild_command(artifact_dir, manifest)}"
        )
    here = installed_versions()
    libraries = ("torch", "transformers") if manifest.target.kind == "cpu" else ("torch", "triton", "transformers")
    differ = [
        f"{name} {manifest.versions[name]} at build, {here[name]} here"
        for name in libraries
        if name in manifest.versions and _release(manifest.versions[name]) != _release(here[name])
    ]
    key = (str(Path(artifact_dir).resolve()), ";".join(differ))
    if differ and key not in _WARNED:
        _WARNED.add(key)
        logger.warning(
            "%s was built with other library versions than this machine has (%s). It runs, but its "
            "kernels were tuned and compiled for the build's versions; to rule that out, rebuild it here: %s",
            artifact_dir,
            "; ".join(differ),
            rebuild_command(artifact_dir, manifest),
        )


def _release(version: str) -> str:
    """``2.13.0+cpu`` -> ``2.13.0``: a local build tag is the same library release."""
    return version.split("+", 1)[0]


def verify_files(
    artifact_dir: str | os.PathLike[str], manifest: Manifest, include: Callable[[str], bool] = lambda rel: True
) -> None:
    """Check that every file the manifest lists (and ``include`` accepts) is present and
    unchanged. A file this user's earlier runs already verified, and that has not changed since
    (``HashCache``), is not hashed again."""
    root = Path(artifact_dir)
    check_file_names(root, manifest)
    cache = HashCache()
    for rel, expected in manifest.files.items():
        if not include(rel):
            continue
        path = root / rel
        if not path.is_file():
            raise ArtifactError(f"{root}: file {rel} listed in the manifest is missing; rebuild the artifact")
        identity = file_identity(path)
        if cache.verified(path, identity, expected):
            continue
        pieces = manifest.chunk_hashes.get(rel)
        if pieces:
            with ThreadPoolExecutor(min(len(pieces), os.cpu_count() or 1, 16)) as pool:
                offsets = [i * CHUNK_BYTES for i in range(len(pieces))]
                actual_pieces = list(pool.map(_sha256_range, [path] * len(pieces), offsets, [CHUNK_BYTES] * len(pieces)))
            size = path.stat().st_size
            if size > len(pieces) * CHUNK_BYTES or len(actual_pieces) != len(pieces):
                raise ArtifactError(
                    mismatch_message(f"{root}: file {rel}", size=size, expected_size=len(pieces) * CHUNK_BYTES)
                )
            for i, (got, want) in enumerate(zip(actual_pieces, pieces)):
                if got != want:
                    raise ArtifactError(mismatch_message(f"{root}: file {rel}", piece=i, size=size, chunk_bytes=CHUNK_BYTES))
        else:
            actual = sha256_file(path)
            if actual != expected:
                raise ArtifactError(
                    f"{root}: file {rel} does not match the manifest (sha256 {actual[:12]}… expected "
                    f"{expected[:12]}…): the artifact was modified or corrupted; rebuild it with enginebuild"
                )
        cache.remember(path, identity, expected)
    cache.save()


def mismatch_message(
    label: str, piece: int | None = None, size: int | None = None, expected_size: int | None = None,
    chunk_bytes: int = CHUNK_BYTES,
) -> str:
    """What a failed hash check can truly say. Only digests are stored, so the first byte that
    differs is not knowable; the first piece whose digest differs is, and it bounds it: the
    first changed byte lies in that piece (every earlier piece matched)."""
    if piece == 0 and size is not None and size <= chunk_bytes:
        where = (
            f"its sha256 differs; a file of up to {chunk_bytes:,} bytes is hashed as one piece, so the changed "
            f"bytes may lie anywhere in its {size:,}"
        )
    elif piece is not None:
        end = chunk_bytes * (piece + 1) if size is None else min(size, chunk_bytes * (piece + 1))
        where = (
            f"the first changed byte lies in bytes {piece * chunk_bytes:,} to {end - 1:,} (piece {piece} of "
            f"{chunk_bytes:,} bytes; all bytes before it match)"
        )
    else:
        where = f"it is {size:,} bytes, longer than the {expected_size:,} bytes the manifest's pieces cover"
    return f"{label} does not match the manifest ({where}): the artifact was modified or corrupted; rebuild it with enginebuild"


def file_identity(path: Path) -> tuple[int, ...]:
    """What changes whenever a file's bytes may have: device, inode, size, mtime and ctime (in
    ns). ctime is included because only the kernel sets it: restoring a file's mtime after
    writing it (``touch -d``, ``os.utime``) still changes its ctime."""
    st = os.stat(path)
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def hash_cache_path() -> Path:
    """``$PAGECAST_CACHE_DIR/verified.json``, else ``$XDG_CACHE_HOME/pagecast/`` or
    ``~/.cache/pagecast/``: outside every artifact (nothing is written into one)."""
    base = os.environ.get("PAGECAST_CACHE_DIR")
    if not base:
        base = str(Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pagecast")
    return Path(base) / "verified.json"


RACY_WINDOW_NS = 2_000_000_000


class HashCache:
    """Files this user's processes have hashed and found matching, so a restart does not hash
    15 GB of weights again: real path -> (file identity, sha256 it matched).

    A file counts as verified only if its identity (``file_identity``) is unchanged and the
    manifest still expects the same digest; anything else is hashed again. The cache is a
    small JSON file in the user's cache directory, private to the user (0600 in a 0700
    directory); an unreadable or corrupt cache is ignored and a read-only home disables it. It
    trusts the file system's metadata, as ``make`` and ``git status`` do: a change that keeps
    device, inode, size, mtime and ctime, which needs root, is not detected.
    """

    MAX_ENTRIES = 4096

    def __init__(self, path: Path | None = None):
        self.path = path or hash_cache_path()
        self._entries = self._read()
        self._mine: dict[str, dict[str, Any]] = {}  # recorded by this object, not yet saved

    def _read(self) -> dict[str, dict[str, Any]]:
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}
        files = data.get("files") if isinstance(data, dict) else None
        return files if isinstance(files, dict) else {}

    def verified(self, path: Path, identity: tuple[int, ...], sha256: str) -> bool:
        entry = self._entries.get(str(path.resolve()))
        return isinstance(entry, dict) and entry.get("identity") == list(identity) and entry.get("sha256") == sha256

    def remember(self, path: Path, identity: tuple[int, ...], sha256: str) -> None:
        """Record ``path`` as matching ``sha256``; ``identity`` is the one taken before it was
        read, and it is only recorded if the file still has it (not changed while hashed)."""
        try:
            if file_identity(path) != identity:
                return
        except OSError:
            return
        # "Racily clean" (as git calls it): file times tick coarsely (a few ms), so a write in
        # the same tick as the one the identity saw would leave it unchanged. A file changed
        # within the last RACY_WINDOW_NS is verified again next time rather than trusted.
        if time.time_ns() - max(identity[3], identity[4]) < RACY_WINDOW_NS:
            return
        entry = {"identity": list(identity), "sha256": sha256}
        self._entries[str(path.resolve())] = self._mine[str(path.resolve())] = entry

    def save(self) -> None:
        """Write this object's new entries, merged into the file as it is now (TP ranks and
        other processes save theirs at the same time), oldest entries dropped past
        MAX_ENTRIES."""
        if not self._mine:
            return
        entries = self._read()
        for key, entry in self._mine.items():
            entries.pop(key, None)
            entries[key] = entry  # newest last
        while len(entries) > self.MAX_ENTRIES:
            entries.pop(next(iter(entries)))
        try:
            self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.{id(self)}.tmp")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                json.dump({"files": entries}, f)
            os.replace(tmp, self.path)  # atomic: a concurrent reader sees the old or the new file
            self._entries, self._mine = entries, {}
        except OSError as e:
            logger.debug("hash cache %s not written: %s", self.path, e)


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
    """A weight file: the artifact's own, or a nested draft artifact's (whose own manifest, listed
    and hashed here, lists their hashes: loading the draft verifies them, in the background on a GPU)."""
    return rel.startswith(("weights/", f"{SPECULATIVE_DIR}/weights/"))
