"""Selective safetensors reading: the header alone tells names, dtypes and shapes, so the loader can
identify a checkpoint and decide what to read before touching any tensor data."""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass

import torch

from ..errors import CorruptFileError, UnsupportedFormatError

_MAX_HEADER = 100 * 1024 * 1024


# Each safetensors dtype: its plain name (packed formats are told apart by loaders/quant.py) and torch dtype.
DTYPES = {
    "BF16": ("bf16", torch.bfloat16),
    "F16": ("fp16", torch.float16),
    "F32": ("fp32", torch.float32),
    "F64": ("fp64", torch.float64),
    "F8_E4M3": ("float8_e4m3fn", torch.float8_e4m3fn),
    "F8_E5M2": ("float8_e5m2", torch.float8_e5m2),
    "U8": ("uint8", torch.uint8),
    "I8": ("int8", torch.int8),
    "I32": ("int32", torch.int32),
    "I64": ("int64", torch.int64),
    "BOOL": ("bool", torch.bool),
}


@dataclass(frozen=True)
class TensorInfo:
    dtype: str  # the safetensors spelling: "BF16", "F8_E4M3", "U8", ...
    shape: tuple[int, ...]
    start: int = 0  # byte range in the file
    end: int = 0

    @property
    def plain(self) -> str:
        """The dtype's plain name ("bf16", "uint8"); see loaders/quant.py for what a packed weight is."""
        return DTYPES[self.dtype][0] if self.dtype in DTYPES else self.dtype.lower()

    @property
    def nbytes(self) -> int:
        return self.end - self.start


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
    if not isinstance(header, dict):
        raise CorruptFileError(f"{path}: the safetensors header is not a JSON object; the file is damaged.")
    metadata = header.pop("__metadata__", None) or {}
    data_start = 8 + length
    tensors = {}
    for name, entry in header.items():
        try:
            if not (isinstance(entry["data_offsets"], list) and isinstance(entry["shape"], list)):
                raise TypeError("data_offsets and shape must be lists")
            start, end = (int(o) for o in entry["data_offsets"])
            shape = tuple(int(d) for d in entry["shape"])
            if min(shape, default=0) < 0:
                raise ValueError("negative dimension")
        except (KeyError, TypeError, ValueError) as e:
            raise CorruptFileError(
                f"{path}: the header entry of tensor {name} is malformed ({type(e).__name__}: {e}); the file is "
                "damaged. Download it again."
            ) from None
        if not 0 <= start <= end <= size - data_start:
            raise CorruptFileError(f"{path}: tensor {name} points outside the file; the file is truncated or damaged.")
        dtype = DTYPES.get(entry["dtype"], (None, None))[1]
        if dtype is not None and math.prod(shape) * dtype.itemsize != end - start:
            raise CorruptFileError(
                f"{path}: tensor {name} ({entry['dtype']} {list(shape)}) does not fill its {end - start} bytes; "
                "the file is damaged. Download it again."
            )
        tensors[name] = TensorInfo(entry["dtype"], shape, data_start + start, data_start + end)
    return tensors, metadata


class SafetensorsFiles:
    """One or more shards read as one checkpoint. A tensor is read on request, exactly its own bytes, into
    memory of its own: nothing else of the file is read (no read-ahead) or kept mapped, so what a load costs
    in reads and memory is what it keeps."""

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

    def read(self, name: str) -> torch.Tensor:
        info, path = self.infos[name], self._where[name]
        if info.dtype not in DTYPES:
            raise UnsupportedFormatError(
                f"{path}: tensor {name} is stored as {info.dtype}, a type the pack does not read."
            )
        out = torch.empty(info.nbytes, dtype=torch.uint8)
        with open(path, "rb", buffering=0) as f:
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(f.fileno(), info.start, info.nbytes, os.POSIX_FADV_RANDOM)
            f.seek(info.start)
            if f.readinto(out.numpy()) != info.nbytes:
                raise CorruptFileError(f"{path} ended inside tensor {name}; the file is truncated. Download it again.")
        return out.view(DTYPES[info.dtype][1]).reshape(info.shape)
