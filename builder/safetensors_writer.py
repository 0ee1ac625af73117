"""Write a .safetensors file one tensor at a time, so a build never holds all weights at once.

The format is an 8-byte little-endian header length, a JSON header of name -> dtype, shape
and byte offsets, then the raw tensor bytes in header order. The header is computed up
front from the planned shapes; tensors are then streamed in that order.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import BinaryIO

import torch

_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.int32: "I32", torch.int8: "I8",
           torch.float8_e4m3fn: "F8_E4M3"}


class StreamingSafetensorsWriter:
    def __init__(self, path: Path, layout: list[tuple[str, tuple[int, ...], torch.dtype]]):
        self.path = path
        self.layout = layout
        header: dict[str, object] = {}
        offset = 0
        for name, shape, dtype in layout:
            n = dtype.itemsize
            for s in shape:
                n *= s
            header[name] = {"dtype": _DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + n]}
            offset += n
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # keep the data 8-byte aligned
        self._header = raw
        self._next = 0
        self._file: BinaryIO | None = None

    def __enter__(self) -> StreamingSafetensorsWriter:
        self._file = open(self.path, "wb")
        self._file.write(struct.pack("<Q", len(self._header)))
        self._file.write(self._header)
        return self

    def write(self, name: str, tensor: torch.Tensor) -> None:
        expected_name, shape, dtype = self.layout[self._next]
        if name != expected_name or tuple(tensor.shape) != shape or tensor.dtype != dtype:
            raise ValueError(f"tensor {name} {tuple(tensor.shape)} {tensor.dtype} does not match the planned "
                             f"{expected_name} {shape} {dtype}")
        assert self._file is not None
        data = tensor.detach().contiguous().cpu()
        self._file.write(data.view(torch.uint8).numpy().tobytes() if data.numel() else b"")
        self._next += 1

    def __exit__(self, *exc: object) -> None:
        assert self._file is not None
        self._file.close()
        if exc[0] is None and self._next != len(self.layout):
            raise ValueError(f"{self.path}: {len(self.layout) - self._next} planned tensors were never written")
