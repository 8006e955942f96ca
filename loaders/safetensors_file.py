"""Selective safetensors reading: the header alone tells names, dtypes and shapes, so the loader can
identify a checkpoint and decide what to read before touching any tensor data."""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass

import torch

from ..errors import CorruptFileError

_MAX_HEADER = 100 * 1024 * 1024


# Each safetensors dtype: (the format the pack reports for a weight stored so, bytes per element).
DTYPES = {
    "BF16": ("bf16", 2),
    "F16": ("fp16", 2),
    "F32": ("fp32", 4),
    "F64": ("fp64", 8),
    "F8_E4M3": ("fp8-scaled", 1),
    "F8_E5M2": ("fp8-scaled", 1),
    "U8": ("nvfp4", 1),  # packed two E2M1 values a byte; no other uint8 weights occur in these models
    "I8": ("int8", 1),
    "I32": ("int32", 4),
    "I64": ("int64", 8),
}


@dataclass(frozen=True)
class TensorInfo:
    dtype: str  # the safetensors spelling: "BF16", "F8_E4M3", "U8", ...
    shape: tuple[int, ...]

    @property
    def format(self) -> str:
        return DTYPES.get(self.dtype, (self.dtype.lower(), 1))[0]

    @property
    def nbytes(self) -> int:
        count = DTYPES.get(self.dtype, ("", 1))[1]
        for d in self.shape:
            count *= d
        return count


def read_header(path: str) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """{name: TensorInfo} and the string metadata of one .safetensors file."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise CorruptFileError(f"{path} is too short to be a safetensors file ({size} bytes).")
        (length,) = struct.unpack("<Q", raw)
        if length > min(_MAX_HEADER, size - 8):
            raise CorruptFileError(
                f"{path} is not a readable safetensors file (header length {length}, file size {size}); "
                "it may be truncated or not a safetensors file at all. Download it again."
            )
        try:
            header = json.loads(f.read(length))
        except ValueError as e:
            raise CorruptFileError(f"{path}: the safetensors header is not valid JSON ({e}).") from None
    metadata = header.pop("__metadata__", None) or {}
    tensors = {}
    for name, entry in header.items():
        start, end = entry["data_offsets"]
        if not 0 <= start <= end <= size - 8 - length:
            raise CorruptFileError(f"{path}: tensor {name} points outside the file; the file is truncated or damaged.")
        tensors[name] = TensorInfo(entry["dtype"], tuple(entry["shape"]))
    return tensors, metadata


class SafetensorsFiles:
    """One or more shards read as one checkpoint; tensors are read only on request."""

    def __init__(self, paths: list[str]):
        self.infos: dict[str, TensorInfo] = {}
        self.metadata: dict[str, str] = {}
        self._where: dict[str, str] = {}
        for path in paths:
            infos, metadata = read_header(path)
            self.metadata.update(metadata)
            for name, info in infos.items():
                self.infos[name] = info
                self._where[name] = path
        self._handles = {}

    def read(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        path = self._where[name]
        if path not in self._handles:
            self._handles[path] = safe_open(path, framework="pt", device="cpu")
        return self._handles[path].get_tensor(name)
