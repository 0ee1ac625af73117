"""Read an artifact's weight file onto the device once, checking its hashes on the way.

A safetensors file is a JSON header followed by the tensors' bytes. Instead of mapping it and
copying tensor by tensor (one synchronous host-to-device copy each, and a second full read of
the file to hash it), the file is cut into the manifest's hash chunks and each chunk is read
by its own thread: into pinned host buffers, hashed there, and copied asynchronously into the
destination tensors, which were allocated on the device up front. Reading, hashing and
copying run on all cores at once and every byte is read once, so a 16 GB model loads in
roughly the time the page cache or the disk takes to deliver it.
"""

from __future__ import annotations

import bisect
import contextlib
import hashlib
import json
import os
import struct
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import BinaryIO

import torch

from pagecast.runtime.errors import ArtifactError

_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
BLOCK_BYTES = 32 << 20  # one read into a host buffer; each worker holds two


class _Slot:
    """Where one tensor's bytes go: ``view`` (a flat byte view of the device tensor) receives
    file bytes [begin, end)."""

    __slots__ = ("begin", "end", "view")

    def __init__(self, begin: int, end: int, view: torch.Tensor):
        self.begin, self.end, self.view = begin, end, view


def _read_exactly(f: BinaryIO, view: memoryview, path: Path) -> None:
    """Fill ``view`` from ``f`` (a read may return fewer bytes); a file that ends first is an
    artifact to rebuild."""
    got = 0
    while got < len(view):
        r = f.readinto(view[got:])
        if not r:
            raise ArtifactError(f"{path} ended early; rebuild the artifact")
        got += r


def read_header(path: Path) -> tuple[int, dict]:
    """(offset of the first tensor byte, header) of a safetensors file."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ArtifactError(f"{path} is not a safetensors file (too short); rebuild the artifact")
        (size,) = struct.unpack("<Q", raw)
        try:
            header = json.loads(f.read(size))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ArtifactError(f"{path} has a malformed safetensors header ({e}); rebuild the artifact") from e
    return 8 + size, header


def load_safetensors(
    path: Path,
    device: torch.device,
    chunk_bytes: int,
    chunk_hashes: list[str] | None,
    num_threads: int | None = None,
    label: str | None = None,
) -> dict[str, torch.Tensor]:
    """The tensors of ``path`` on ``device``. With ``chunk_hashes`` (the sha256 of each
    ``chunk_bytes`` piece of the file, as the manifest lists them) every piece is checked as it
    is read, and a mismatch raises ArtifactError before the tensors are returned."""
    tensors, fill = open_safetensors(path, device, chunk_bytes, chunk_hashes, num_threads, label)
    fill()
    return tensors


def open_safetensors(
    path: Path,
    device: torch.device,
    chunk_bytes: int,
    chunk_hashes: list[str] | None,
    num_threads: int | None = None,
    label: str | None = None,
) -> tuple[dict[str, torch.Tensor], Callable[[], None]]:
    """Allocate the tensors of ``path`` on ``device`` (their contents undefined) and return them
    with ``fill``, which reads, checks and copies the bytes into them (raising ArtifactError on a
    hash mismatch). ``fill`` may run in another thread while the tensors' addresses are used,
    e.g. captured into CUDA graphs: only their values are not ready until it returns."""
    data_start, header = read_header(path)
    header.pop("__metadata__", None)
    file_size = path.stat().st_size
    tensors: dict[str, torch.Tensor] = {}
    slots: list[_Slot] = []
    cuda = device.type == "cuda"
    # On the CPU the file's tensor bytes are read straight into one buffer the tensors are views
    # of (no second copy out of a read buffer); a tensor whose offset does not suit its dtype's
    # alignment gets its own memory and is copied like a device tensor.
    data = None if cuda else torch.empty(max(0, file_size - data_start), dtype=torch.uint8)
    for name, info in header.items():
        dtype = _DTYPES.get(info.get("dtype"))
        if dtype is None:
            raise ArtifactError(f"{path}: tensor {name} has dtype {info.get('dtype')!r}, which pagecast cannot load")
        begin, end = (data_start + int(o) for o in info["data_offsets"])
        numel = 1
        for size in info["shape"]:
            numel *= int(size)
        if numel * dtype.itemsize != end - begin or end > file_size or begin < data_start:
            raise ArtifactError(f"{path}: tensor {name} does not match its byte range; rebuild the artifact")
        if data is not None and (begin - data_start) % dtype.itemsize == 0:
            tensors[name] = data[begin - data_start : end - data_start].view(dtype).view(info["shape"])
            continue
        tensor = torch.empty(info["shape"], dtype=dtype, device=device)
        tensors[name] = tensor
        if end > begin:
            slots.append(_Slot(begin, end, tensor.reshape(-1).view(torch.uint8)))
    slots.sort(key=lambda s: s.begin)
    starts = [s.begin for s in slots]
    num_chunks = max(1, -(-file_size // chunk_bytes))
    label = label or str(path)
    if chunk_hashes is not None and len(chunk_hashes) != num_chunks:
        raise ArtifactError(
            f"{label} does not match the manifest ({num_chunks} pieces of {chunk_bytes} bytes, the manifest "
            f"lists {len(chunk_hashes)}): the artifact was modified or corrupted; rebuild it with enginebuild"
        )

    def load_chunk(index: int) -> str:
        if data is not None:
            return read_chunk_in_place(index)
        begin = index * chunk_bytes
        end = min(file_size, begin + chunk_bytes)
        digest = hashlib.sha256()
        stream = torch.cuda.Stream(device) if cuda else None
        buffers = [torch.empty(min(BLOCK_BYTES, end - begin), dtype=torch.uint8, pin_memory=cuda) for _ in range(2)]
        done: list[torch.cuda.Event | None] = [None, None]
        with open(path, "rb", buffering=0) as f:
            f.seek(begin)
            pos, k = begin, 0
            while pos < end:
                n = min(BLOCK_BYTES, end - pos)
                if done[k] is not None:
                    done[k].synchronize()  # type: ignore[union-attr]  # its last copies have left it
                buf = buffers[k][:n]
                view = memoryview(buf.numpy())
                _read_exactly(f, view, path)
                if chunk_hashes is not None:  # nothing to compare with: skip the sha256
                    digest.update(view)
                _scatter(slots, starts, pos, pos + n, buf, stream)
                if cuda:
                    event = torch.cuda.Event()
                    event.record(stream)
                    done[k] = event
                pos += n
                k ^= 1
        if stream is not None:
            stream.synchronize()
        return digest.hexdigest()

    def read_chunk_in_place(index: int) -> str:
        """The CPU: the chunk's bytes read into ``data`` (the header's into a scratch buffer),
        each block hashed on a second thread while the next one is read (both release the GIL)."""
        begin = index * chunk_bytes
        end = min(file_size, begin + chunk_bytes)
        digest = hashlib.sha256()
        assert data is not None
        whole = memoryview(data.numpy())
        with open(path, "rb", buffering=0) as f, ThreadPoolExecutor(1, thread_name_prefix="pagecast-hash") as hasher:
            f.seek(begin)
            pos, hashing = begin, None
            while pos < end:
                n = min(BLOCK_BYTES, end - pos, data_start - pos if pos < data_start else BLOCK_BYTES)
                view = memoryview(bytearray(n)) if pos < data_start else whole[pos - data_start : pos - data_start + n]
                _read_exactly(f, view, path)
                if slots:
                    _scatter(slots, starts, pos, pos + n, torch.frombuffer(view, dtype=torch.uint8), None)
                if chunk_hashes is not None:  # nothing to compare with (verified before): skip the sha256
                    if hashing is not None:
                        hashing.result()
                    hashing = hasher.submit(digest.update, view)
                pos += n
            if hashing is not None:
                hashing.result()
        return digest.hexdigest()

    def fill() -> None:
        workers = min(num_chunks, num_threads or min(16, os.cpu_count() or 1))
        with ThreadPoolExecutor(workers, thread_name_prefix="pagecast-load") as pool:
            actual = list(pool.map(load_chunk, range(num_chunks)))
        if chunk_hashes is not None and actual != chunk_hashes:
            from pagecast.runtime.artifact import mismatch_message

            bad = next(i for i, (a, b) in enumerate(zip(actual, chunk_hashes)) if a != b)
            raise ArtifactError(mismatch_message(label, piece=bad, size=file_size, chunk_bytes=chunk_bytes))

    return tensors, fill


def _scatter(
    slots: list[_Slot], starts: list[int], lo: int, hi: int, buf: torch.Tensor, stream: torch.cuda.Stream | None
) -> None:
    """Copy file bytes [lo, hi), held in ``buf``, into every tensor they belong to."""
    i = max(0, bisect.bisect_right(starts, lo) - 1)
    with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
        while i < len(slots) and slots[i].begin < hi:
            slot = slots[i]
            a, b = max(lo, slot.begin), min(hi, slot.end)
            if a < b:
                slot.view[a - slot.begin : b - slot.begin].copy_(buf[a - lo : b - lo], non_blocking=stream is not None)
            i += 1
