"""The manifest as a contract (issue 33): the files it names stay inside the artifact, the
kernel ABI and library versions it records are compared with what is installed, a hash
mismatch says truly where the file changed, and files verified once (and unchanged) are not
hashed again on the next start."""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from pagecast.kernels import KERNEL_ABI
from pagecast.runtime import artifact
from pagecast.runtime.artifact import HashCache, load_manifest, verify_files
from pagecast.runtime.errors import ArtifactError
from pagecast.runtime.loader import open_weights
from pagecast.runtime.weights import load_safetensors


@pytest.fixture()
def engine_dir(tiny_llama_artifact, tmp_path, monkeypatch) -> Path:  # type: ignore[no-untyped-def]
    """A private copy of the tiny artifact, and a private hash cache."""
    monkeypatch.setenv("PAGECAST_CACHE_DIR", str(tmp_path / "cache"))
    # The copy was just written; files changed in the last 2 s are never trusted from the cache.
    monkeypatch.setattr(artifact, "RACY_WINDOW_NS", 0)
    return Path(shutil.copytree(tiny_llama_artifact, tmp_path / "engine"))


def edit_manifest(root: Path, change) -> dict:  # type: ignore[no-untyped-def,type-arg]
    data = json.loads((root / "manifest.json").read_text())
    change(data)
    (root / "manifest.json").write_text(json.dumps(data))
    return data  # type: ignore[no-any-return]


class HashSpy:
    """Records every path the artifact module hashes."""

    def __init__(self, monkeypatch):  # type: ignore[no-untyped-def]
        self.paths: list[str] = []
        for name in ("sha256_file", "hash_file"):
            real = getattr(artifact, name)
            monkeypatch.setattr(artifact, name, self._wrap(real))
        real_range = artifact._sha256_range
        monkeypatch.setattr(artifact, "_sha256_range", lambda p, o, n: (self.paths.append(str(p)), real_range(p, o, n))[1])

    def _wrap(self, real):  # type: ignore[no-untyped-def]
        def spy(path):  # type: ignore[no-untyped-def]
            self.paths.append(str(path))
            return real(path)

        return spy


# -- names confined to the artifact --------------------------------------------------------------


@pytest.mark.parametrize("name", ["ABSOLUTE", "../outside.txt", "tokenizer/../../outside.txt", "./model.py"])
def test_a_manifest_naming_a_file_outside_the_artifact_is_refused_unread(engine_dir, tmp_path, monkeypatch, name):  # type: ignore[no-untyped-def]
    outside = tmp_path / "outside.txt"
    outside.write_text("private data\n")
    name = str(outside) if name == "ABSOLUTE" else name
    edit_manifest(engine_dir, lambda m: m["files"].__setitem__(name, hashlib.sha256(b"x").hexdigest()))
    spy = HashSpy(monkeypatch)
    with pytest.raises(ArtifactError, match=r"not a relative path inside the artifact.*rebuild") as info:
        load_manifest(engine_dir)
    with pytest.raises(ArtifactError, match=r"not a relative path inside the artifact"):
        verify_files(engine_dir, artifact.Manifest.from_dict(json.loads((engine_dir / "manifest.json").read_text())))
    assert spy.paths == []  # nothing was hashed, the outside file least of all
    assert hashlib.sha256(outside.read_bytes()).hexdigest()[:12] not in str(info.value)


def test_a_symlink_leading_out_of_the_artifact_is_refused(engine_dir, tmp_path, monkeypatch):  # type: ignore[no-untyped-def]
    outside = tmp_path / "tuning.json"
    shutil.copy(engine_dir / "tuning.json", outside)  # same bytes: a hash check alone would pass
    (engine_dir / "tuning.json").unlink()
    (engine_dir / "tuning.json").symlink_to(outside)
    spy = HashSpy(monkeypatch)
    with pytest.raises(ArtifactError, match=r"tuning\.json leads outside the artifact .*symbolic link"):
        load_manifest(engine_dir)
    assert spy.paths == []


def test_a_symlink_inside_the_artifact_is_allowed(engine_dir):  # type: ignore[no-untyped-def]
    (engine_dir / "tuning.json").rename(engine_dir / "tokenizer" / "real-tuning")
    (engine_dir / "tuning.json").symlink_to(engine_dir / "tokenizer" / "real-tuning")
    load_manifest(engine_dir)  # no error: the link stays inside


# -- versions --------------------------------------------------------------------------------------


def test_the_build_records_the_kernel_abi(tiny_llama_artifact):  # type: ignore[no-untyped-def]
    data = json.loads((tiny_llama_artifact / "manifest.json").read_text())
    assert data["format_version"] == artifact.FORMAT_VERSION == 2
    assert data["kernel_abi"] == KERNEL_ABI
    assert isinstance(KERNEL_ABI, int)


def test_another_kernel_abi_is_refused_with_the_rebuild_command(engine_dir):  # type: ignore[no-untyped-def]
    edit_manifest(engine_dir, lambda m: m.__setitem__("kernel_abi", KERNEL_ABI + 1))
    with pytest.raises(ArtifactError) as info:
        load_manifest(engine_dir)
    message = str(info.value)
    assert f"kernel ABI {KERNEL_ABI + 1}" in message and f"have ABI {KERNEL_ABI}" in message
    build = json.loads((engine_dir / "manifest.json").read_text())["build_options"]
    assert f"enginebuild --model {build['model']}" in message
    assert f"--output {engine_dir} --force" in message


def test_an_older_kernel_abi_this_pagecast_still_runs_is_accepted(engine_dir):  # type: ignore[no-untyped-def]
    """ABI 2 only added arguments (the rotary kernel's q/k norms): model code built for ABI 1 calls
    the kernels as they still take them, so its artifacts load; one older than that is refused."""
    from pagecast.kernels import KERNEL_ABI_OLDEST

    assert KERNEL_ABI_OLDEST <= KERNEL_ABI
    edit_manifest(engine_dir, lambda m: m.__setitem__("kernel_abi", KERNEL_ABI_OLDEST))
    assert load_manifest(engine_dir).kernel_abi == KERNEL_ABI_OLDEST
    edit_manifest(engine_dir, lambda m: m.__setitem__("kernel_abi", KERNEL_ABI_OLDEST - 1))
    with pytest.raises(ArtifactError, match=f"kernel ABI {KERNEL_ABI_OLDEST - 1}"):
        load_manifest(engine_dir)


def test_a_format_version_1_artifact_reads_as_kernel_abi_1(engine_dir):  # type: ignore[no-untyped-def]
    def to_v1(m: dict) -> None:  # type: ignore[type-arg]
        m["format_version"] = 1
        del m["kernel_abi"]

    edit_manifest(engine_dir, to_v1)
    assert load_manifest(engine_dir).kernel_abi == 1
    edit_manifest(engine_dir, lambda m: m.__setitem__("kernel_abi", 1))
    with pytest.raises(ArtifactError, match="kernel_abi in a format_version 1 manifest"):
        load_manifest(engine_dir)


def test_other_library_versions_warn_once(engine_dir, caplog):  # type: ignore[no-untyped-def]
    edit_manifest(engine_dir, lambda m: m["versions"].update(torch="2.0.1", transformers="4.40.0"))
    with caplog.at_level(logging.WARNING, logger="pagecast.runtime"):
        load_manifest(engine_dir)
        load_manifest(engine_dir)
    warnings = [r.getMessage() for r in caplog.records if "other library versions" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert f"torch 2.0.1 at build, {torch.__version__.split('+')[0]}" in warnings[0]
    assert "transformers 4.40.0 at build" in warnings[0]
    assert "enginebuild --model" in warnings[0]


def test_same_versions_do_not_warn(engine_dir, caplog):  # type: ignore[no-untyped-def]
    with caplog.at_level(logging.WARNING, logger="pagecast.runtime"):
        load_manifest(engine_dir)
    assert not [r for r in caplog.records if "library versions" in r.getMessage()]


# -- a mismatch says where -------------------------------------------------------------------------


def test_a_corrupted_weight_file_names_the_piece_holding_the_first_changed_byte(tmp_path):  # type: ignore[no-untyped-def]
    path = tmp_path / "w.safetensors"
    save_file({"w": torch.arange(4096, dtype=torch.float32)}, str(path))
    data = bytearray(path.read_bytes())
    chunk = 1024
    pieces = [hashlib.sha256(data[i : i + chunk]).hexdigest() for i in range(0, len(data), chunk)]
    data[5000] ^= 0xFF
    data[9000] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(ArtifactError) as info:
        load_safetensors(path, torch.device("cpu"), chunk, pieces, label="w.safetensors")
    message = str(info.value)
    assert "first changed byte lies in bytes 4,096 to 5,119" in message, message
    assert "all bytes before it match" in message
    # A file of one piece: no bound to give, and the message does not pretend to one.
    whole = [hashlib.sha256(bytes(data)).hexdigest()[::-1]]  # any digest but the file's
    with pytest.raises(ArtifactError) as info:
        load_safetensors(path, torch.device("cpu"), len(data), whole, label="w.safetensors")
    message = str(info.value)
    assert f"may lie anywhere in its {len(data):,}" in message and "first changed byte" not in message, message


def test_verify_files_names_the_piece_too(engine_dir, monkeypatch):  # type: ignore[no-untyped-def]
    monkeypatch.setattr(artifact, "CHUNK_BYTES", 256)
    rel = "model.py"
    data = bytearray((engine_dir / rel).read_bytes())
    assert len(data) > 600
    pieces = [hashlib.sha256(data[i : i + 256]).hexdigest() for i in range(0, len(data), 256)]
    edit_manifest(engine_dir, lambda m: m["chunk_hashes"].__setitem__(rel, pieces))
    data[600] ^= 1
    (engine_dir / rel).write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match=r"model\.py does not match .* bytes 512 to 767 \(piece 2"):
        verify_files(engine_dir, load_manifest(engine_dir))


# -- verification cached per file identity -------------------------------------------------------


def test_verified_files_are_not_hashed_again_until_they_change(engine_dir, tmp_path, monkeypatch):  # type: ignore[no-untyped-def]
    manifest = load_manifest(engine_dir)
    spy = HashSpy(monkeypatch)
    verify_files(engine_dir, manifest)
    first = sorted(spy.paths)
    assert first and (engine_dir / "model.py").as_posix() in {Path(p).as_posix() for p in first}
    cache_file = artifact.hash_cache_path()
    assert cache_file.is_file() and not cache_file.is_relative_to(engine_dir)
    assert oct(cache_file.stat().st_mode & 0o777) == "0o600"
    spy.paths.clear()
    verify_files(engine_dir, manifest)  # a restart
    assert spy.paths == []
    # A file written in the last RACY_WINDOW_NS is hashed, but not trusted from the cache yet.
    monkeypatch.setattr(artifact, "RACY_WINDOW_NS", 10**18)
    fresh = HashCache(tmp_path / "another-cache.json")
    path = engine_dir / "tuning.json"
    fresh.remember(path, artifact.file_identity(path), manifest.files["tuning.json"])
    assert not fresh.verified(path, artifact.file_identity(path), manifest.files["tuning.json"])
    monkeypatch.setattr(artifact, "RACY_WINDOW_NS", 0)
    # A changed file is hashed again, and refused, even with its size and mtime put back.
    model_py = engine_dir / "model.py"
    stat = model_py.stat()
    source = model_py.read_bytes()
    model_py.write_bytes(source[:-2] + b"#\n")
    import os

    os.utime(model_py, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    with pytest.raises(ArtifactError, match=r"model\.py does not match the manifest"):
        verify_files(engine_dir, manifest)
    assert [Path(p).name for p in spy.paths] == ["model.py"]


def test_weights_verified_once_are_not_hashed_again(engine_dir, monkeypatch):  # type: ignore[no-untyped-def]
    from pagecast.runtime import weights

    hashed = []
    real_sha256 = hashlib.sha256

    class Counting:
        def __init__(self) -> None:
            self.inner = real_sha256()

        def update(self, data) -> None:  # type: ignore[no-untyped-def]
            hashed.append(len(data))
            self.inner.update(data)

        def hexdigest(self) -> str:
            return self.inner.hexdigest()

    monkeypatch.setattr(weights.hashlib, "sha256", Counting)
    # The fixture's weights may have been written within the racy window a moment ago (a file
    # changed in the last 2 s is hashed again, tested below); an artifact is normally older.
    monkeypatch.setattr(artifact, "RACY_WINDOW_NS", 0)
    manifest = load_manifest(engine_dir)
    tensors, fill = open_weights(engine_dir, torch.device("cpu"), 0, manifest)
    fill()
    size = (engine_dir / "weights" / "rank0.safetensors").stat().st_size
    assert sum(hashed) == size
    hashed.clear()
    again, fill = open_weights(engine_dir, torch.device("cpu"), 0, manifest)
    fill()
    assert sum(hashed) == 0  # checked before and unchanged: read, not hashed
    assert all(torch.equal(tensors[k], again[k]) for k in tensors)
    # A cache entry for another digest (the manifest changed) does not count.
    assert not HashCache().verified(
        engine_dir / "weights" / "rank0.safetensors",
        artifact.file_identity(engine_dir / "weights" / "rank0.safetensors"),
        "0" * 64,
    )


# -- enginebuild says when an artifact is untuned ------------------------------------------------


def test_enginebuild_says_on_the_console_that_a_gpu_artifact_built_without_its_gpu_is_untuned(  # type: ignore[no-untyped-def]
    tiny_llama_checkpoint, tmp_path, monkeypatch
):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)  # as on a machine without a GPU
    from click.testing import CliRunner

    from pagecast.builder.cli import main

    runner = CliRunner()
    out = tmp_path / "h200"
    result = runner.invoke(main, ["--model", str(tiny_llama_checkpoint), "--gpu", "h200", "--output", str(out), "--quiet"])
    assert result.exit_code == 0, result.output
    assert "is UNTUNED. No h200 GPU is present on this machine (it has no CUDA GPU)" in result.stderr
    assert "default configs shipped for the h200" in result.stderr
    assert f"--gpu h200 --output {out} --force" in result.stderr
    assert result.stdout.strip() == str(out)  # stdout stays the artifact path alone (scripts read it)



def test_a_cpu_artifact_gets_no_untuned_warning(tiny_llama_artifact):  # type: ignore[no-untyped-def]
    from pagecast.builder.cli import untuned_warning

    assert untuned_warning(tiny_llama_artifact) is None


def test_processes_saving_the_cache_at_once_keep_each_others_entries(tmp_path, monkeypatch):  # type: ignore[no-untyped-def]
    """TP ranks verify their own weight files and save at the same time: no entry is lost."""
    monkeypatch.setattr(artifact, "RACY_WINDOW_NS", 0)
    files = [tmp_path / "rank0", tmp_path / "rank1"]
    caches = [HashCache(tmp_path / "verified.json") for _ in files]  # both read the empty cache
    for cache, f in zip(caches, files):
        f.write_bytes(f.name.encode())
        cache.remember(f, artifact.file_identity(f), hashlib.sha256(f.name.encode()).hexdigest())
    for cache in caches:
        cache.save()
    merged = HashCache(tmp_path / "verified.json")
    for f in files:
        assert merged.verified(f, artifact.file_identity(f), hashlib.sha256(f.name.encode()).hexdigest())
