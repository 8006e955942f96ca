"""Selective safetensors reading: the header alone tells names, dtypes and shapes, so the loader can
identify a checkpoint and decide what to read before touching any tensor data."""

from __future__ import annotations

import math
import os
import struct
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ...errors import CorruptFileError, UnsupportedFormatError
from .validate import (
    JSON_LIMITS,
    describe,
    file_identity,
    map_file,
    mapped_bytes,
    open_regular,
    parse_json,
    reading,
)

if TYPE_CHECKING:  # for the annotations only: torch is imported where tensors are read
    import torch

# Each safetensors dtype: its plain name (packed formats are told apart by packing.py), its size in bytes
# and its torch dtype's name. torch is imported only to read tensors, so headers are checked without it.
DTYPES = {
    "BF16": ("bf16", 2, "bfloat16"),
    "F16": ("fp16", 2, "float16"),
    "F32": ("fp32", 4, "float32"),
    "F64": ("fp64", 8, "float64"),
    "F8_E4M3": ("float8_e4m3fn", 1, "float8_e4m3fn"),
    "F8_E5M2": ("float8_e5m2", 1, "float8_e5m2"),
    "F8_E8M0": ("float8_e8m0fnu", 1, "float8_e8m0fnu"),  # MXFP8's block scales, as torch saves them
    "U8": ("uint8", 1, "uint8"),
    "I8": ("int8", 1, "int8"),
    "I32": ("int32", 4, "int32"),
    "I64": ("int64", 8, "int64"),
    "BOOL": ("bool", 1, "bool"),
}


# torch dtype (as str() spells it) -> safetensors dtype name: the table read the other way
SAFETENSORS_DTYPES = {f"torch.{torch_name}": name for name, (_, _, torch_name) in DTYPES.items()}
FLOATS = frozenset(name for name in DTYPES if name.startswith(("F", "BF")))  # safetensors names its floats F*, BF*


def torch_dtype(dtype: str):
    """The torch dtype of a safetensors dtype name, or None for one the pack does not read."""
    import torch

    return getattr(torch, DTYPES[dtype][2]) if dtype in DTYPES else None


@dataclass(frozen=True)
class TensorInfo:
    dtype: str  # the safetensors spelling: "BF16", "F8_E4M3", "U8", ...
    shape: tuple[int, ...]
    start: int = 0  # byte range in the file
    end: int = 0

    @property
    def plain(self) -> str:
        """The dtype's plain name ("bf16", "uint8"); see packing.py for what a packed weight is."""
        return DTYPES[self.dtype][0] if self.dtype in DTYPES else self.dtype.lower()

    @property
    def nbytes(self) -> int:
        return self.end - self.start


# What real headers hold, with wide margins; anything beyond is damage or hostility.
_MAX_RANK = 8  # real tensors have at most 5 dimensions
_MAX_NAME = 1024  # characters of a tensor name (real ones are under 200)
_ENTRY_KEYS = frozenset(("dtype", "shape", "data_offsets"))


def _entry_reader(path: str, data_start: int, data_size: int):
    """json's object_pairs_hook for a safetensors header: each tensor entry becomes a TensorInfo as soon as it is
    parsed, or the pack's error at the first bad one, so a damaged header costs little more than its own size.
    Objects of strings (the metadata) are let through once; the header object is the one holding entries."""
    metadata_seen = 0

    def bad(problem: str) -> CorruptFileError:  # the entry's name is not known until its header object is
        return CorruptFileError(f"{path}: a tensor entry of the header {problem}; the file is damaged. "
                                "Download it again.")

    def hook(pairs: list[tuple[str, object]]):
        nonlocal metadata_seen
        names = Counter(name for name, _ in pairs)
        twice = sorted(name for name, count in names.items() if count > 1)
        if twice:  # json keeps the last silently: which tensor a name means would be the reader's guess
            raise CorruptFileError(f"{path}: the safetensors header names {describe(twice[0])} more than once; the "
                                   "file is damaged or was written wrongly. Download it again.")
        values = [v for _, v in pairs]
        if any(isinstance(v, (TensorInfo, dict)) for v in values):
            return dict(pairs)  # the header itself (what it holds is checked in read_header)
        if all(isinstance(v, str) for v in values):
            metadata_seen += 1
            if metadata_seen > 1:
                raise CorruptFileError(f"{path}: the safetensors header holds objects that are no tensor entries; "
                                       "the file is damaged.")
            return dict(pairs)
        entry = dict(pairs)
        if not _ENTRY_KEYS <= entry.keys():
            raise bad(f"lacks {', '.join(sorted(_ENTRY_KEYS - entry.keys()))}")
        dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
        if not isinstance(dtype, str) or not 0 < len(dtype) <= 16:
            raise bad(f"has dtype {describe(dtype)}, not a type name")
        if not (isinstance(shape, list) and len(shape) <= _MAX_RANK and all(_is_size(d) for d in shape)):
            raise bad(f"has shape {describe(shape)}, not a list of at most {_MAX_RANK} sizes")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_size(o) for o in offsets)):
            raise bad(f"has data_offsets {describe(offsets)}, not two byte offsets")
        start, end = offsets
        if not start <= end <= data_size:
            raise bad(f"points outside the file (bytes {start} to {end} of {data_size})")
        count = math.prod(shape)  # exact: Python integers do not overflow
        if dtype in DTYPES:
            fits = count * DTYPES[dtype][1] == end - start
        else:  # a type the pack does not read: every real type takes at least a bit per element
            fits = count <= 8 * (end - start)
        if not fits:
            raise bad(f"({dtype} {describe(shape)}) does not fill its {end - start} bytes")
        return TensorInfo(dtype, tuple(shape), data_start + start, data_start + end)

    return hook


def _is_size(value) -> bool:
    return type(value) is int and 0 <= value < 1 << 62


def _header_bytes(path: str, follow_links: bool = True) -> tuple[bytes, int, tuple]:
    """The JSON header of a safetensors file, its length checked against the file and the bound first, the file's
    size, and its identity (validate.file_identity: the tensors are mapped from this very file)."""
    with open_regular(path, "safetensors file", follow_links=follow_links) as (f, size):
        identity = file_identity(f)
        raw = f.read(8)
        if len(raw) < 8:
            raise CorruptFileError(f"{path} is too short to be a safetensors file ({size} bytes).")
        (length,) = struct.unpack("<Q", raw)
        # The length is not quoted: in a file that is no safetensors file those are 8 bytes of someone's text.
        if length > min(JSON_LIMITS["header"], size - 8):
            raise CorruptFileError(
                f"{path} is not a readable safetensors file: its first 8 bytes give no header length that fits in "
                f"the file ({size} bytes) and in {JSON_LIMITS['header']} bytes. It may be truncated or not a "
                "safetensors file at all; download it again."
            )
        data = f.read(length)
    if len(data) < length:
        raise CorruptFileError(f"{path} ended inside its safetensors header; the file is truncated. Download it again.")
    return data, size, identity


def read_header(path: str) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """{name: TensorInfo} and the string metadata of one .safetensors file."""
    header, metadata, _ = _read_header(str(path))
    return header, metadata


def _read_header(path: str) -> tuple[dict[str, TensorInfo], dict[str, str], tuple]:
    data, size, identity = _header_bytes(path)
    length = len(data)
    data_start = 8 + length
    where = f"{path} (safetensors header)"
    header = parse_json(data, where, "header", _entry_reader(path, data_start, size - data_start))
    if not isinstance(header, dict):
        raise CorruptFileError(f"{path}: the safetensors header is {describe(header)}, not a JSON object; "
                               "the file is damaged.")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise CorruptFileError(f"{path}: the safetensors __metadata__ is not an object of strings; "
                               "the file is damaged.")
    for name, info in header.items():
        if not isinstance(info, TensorInfo):
            raise CorruptFileError(
                f"{path}: the header entry {describe(name)} is {describe(info)}, not a tensor's dtype, shape and "
                "data_offsets; the file is damaged. Download it again."
            )
        if len(name) > _MAX_NAME:
            raise CorruptFileError(f"{path}: a tensor name is {len(name)} characters long; the file is damaged.")
    return header, metadata, identity


def read_metadata(path: str, *, follow_links: bool = True) -> dict[str, str]:
    """The string metadata of a safetensors file, from its header alone: its tensor entries are not checked
    against the data, so a file cut short still tells what it is."""
    data, _, _ = _header_bytes(str(path), follow_links)
    header = parse_json(data, f"{path} (safetensors header)", "header")
    metadata = header.get("__metadata__") if isinstance(header, dict) else None
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise CorruptFileError(f"{path}: the safetensors header holds no __metadata__ object of strings.")
    return metadata


class SafetensorsFiles:
    """One or more shards read as one checkpoint. A tensor is read on request, exactly its own bytes: `read`
    into memory of its own (nothing else of the file is read or kept), `view` as a view of the mapped file,
    which is how model weights are held: their pages are the page cache's, read as the model runs and given
    back under memory pressure, so a model costs the process no memory of its own whatever the file's size."""

    def __init__(self, paths: list[str]):
        self.paths = [str(p) for p in paths]
        self.infos: dict[str, TensorInfo] = {}
        self.metadata: dict[str, str] = {}
        self._where: dict[str, str] = {}
        self._identities: dict[str, tuple] = {}  # path -> the file whose header was read (validate.file_identity)
        for path in self.paths:
            infos, metadata, self._identities[path] = _read_header(path)
            self.metadata.update(metadata)
            for name, info in infos.items():
                if name in self.infos:
                    raise CorruptFileError(
                        f"Both {self._where[name]} and {path} hold tensor {describe(name)}; shards of one model never "
                        "share a tensor. A file of another model or download is in the folder; remove it."
                    )
                self.infos[name] = info
                self._where[name] = path

    def read(self, name: str) -> torch.Tensor:
        info = self._readable(name)
        import torch

        out = torch.empty(info.nbytes, dtype=torch.uint8)
        self._read_into(name, out.numpy())
        return out.view(torch_dtype(info.dtype)).reshape(info.shape)

    def view(self, name: str) -> torch.Tensor:
        """Tensor `name` as a view of the file's one read-only map (validate.map_file), shared by all its tensors:
        the file stays open, once, while any of them lives."""
        info = self._readable(name)
        if info.start % DTYPES[info.dtype][1] or not info.nbytes:  # torch views need aligned elements
            return self.read(name)
        path = self._where[name]
        mapped = map_file(path, self._identities[path], info.end, "safetensors file")
        data = mapped_bytes(mapped, path, info.start, info.end, "safetensors file")
        return data.view(torch_dtype(info.dtype)).reshape(info.shape)

    def read_bytes(self, name: str) -> bytes:
        """A tensor's stored bytes, without torch (for the few values read before it is imported)."""
        out = bytearray(self._readable(name).nbytes)
        self._read_into(name, out)
        return bytes(out)

    def _readable(self, name: str) -> TensorInfo:
        """The entry of tensor `name`, refused where its type is none the pack reads."""
        info = self.infos[name]
        if info.dtype not in DTYPES:
            raise UnsupportedFormatError(
                f"{self._where[name]}: tensor {name} is stored as {info.dtype}, a type the pack does not read."
            )
        return info

    def _read_into(self, name: str, buffer) -> None:
        info, path = self.infos[name], self._where[name]
        with reading(path, "safetensors file"), open(path, "rb", buffering=0) as f:
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(f.fileno(), info.start, info.nbytes, os.POSIX_FADV_RANDOM)
            f.seek(info.start)
            if f.readinto(buffer) != info.nbytes:
                raise CorruptFileError(f"{path} ended inside tensor {name}; the file is truncated. Download it again.")
