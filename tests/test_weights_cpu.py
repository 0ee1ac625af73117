"""Weight files read on the CPU straight into the tensors' memory (no read buffer), hashed while
read: the tensors hold the file's values, whatever their offsets, and the hash check still
refuses a changed file."""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

import pytest
import torch

from pagecast.runtime import weights
from pagecast.runtime.errors import ArtifactError


def write_safetensors(path: Path, parts: list[tuple[str, torch.Tensor]]) -> None:
    """A safetensors file with the tensors packed back to back, unpadded: an fp32 tensor after a
    3-byte one starts at an offset its dtype cannot be viewed at."""
    names = {torch.uint8: "U8", torch.float32: "F32", torch.bfloat16: "BF16", torch.int64: "I64"}
    header, blobs, offset = {}, [], 0
    for name, t in parts:
        raw = t.contiguous().view(torch.uint8).reshape(-1).numpy().tobytes()
        header[name] = {"dtype": names[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + b"".join(blobs))


@pytest.mark.parametrize("block_bytes", [7, 1 << 20])  # many blocks (the header's split too), one
def test_cpu_read_in_place_gives_the_files_tensors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                    block_bytes: int) -> None:  # fmt: skip
    monkeypatch.setattr(weights, "BLOCK_BYTES", block_bytes)
    # f is read in place (a view of the file's bytes), b, c and d through the copy path.
    parts = [("f", torch.randn(2, 3)), ("a", torch.arange(3, dtype=torch.uint8)), ("b", torch.randn(5, 7)),
             ("c", torch.randn(4, 2).to(torch.bfloat16)), ("d", torch.arange(6, dtype=torch.int64)),
             ("e", torch.randn(0, 3))]  # fmt: skip
    path = tmp_path / "w.safetensors"
    write_safetensors(path, parts)
    size = path.stat().st_size
    chunk = 64  # several hash pieces, as the manifest lists them for large files
    hashes = [hashlib.sha256(path.read_bytes()[i : i + chunk]).hexdigest() for i in range(0, size, chunk)]
    got = weights.load_safetensors(path, torch.device("cpu"), chunk, hashes)
    for name, t in parts:
        assert got[name].dtype == t.dtype and torch.equal(got[name], t), name
    changed = bytearray(path.read_bytes())
    changed[-5] ^= 1
    path.write_bytes(bytes(changed))
    with pytest.raises(ArtifactError, match="does not match the manifest"):
        weights.load_safetensors(path, torch.device("cpu"), chunk, hashes)
