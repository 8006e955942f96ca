"""The files of a fuzzing input: a file as written (FileSpec: chunks at offsets, the rest a hole), and the
models of each format an input is mutated in (JSON documents and lines, safetensors, GGUF, raw bytes), and
the kinds a file may be replaced by (a folder, a FIFO, a link loop ...)."""

from __future__ import annotations

import json
import math
import os
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MAX_FILE = 1 << 40  # the largest (sparse) file an input is written as


@dataclass(frozen=True)
class FileSpec:
    """A file as written: byte chunks at offsets, the rest zeros (a hole), `size` bytes in all."""

    chunks: tuple[tuple[int, bytes], ...]
    size: int

    @property
    def written(self) -> int:
        """Bytes the file has on disk: a mutated size past what file systems hold is cut to that (the
        header's claims beyond it stay claims, which the readers must refuse)."""
        return min(self.size, MAX_FILE)

    def write(self, path: Path) -> None:
        # A new inode each time: a map still open on the previous content never sees this one.
        if path.is_symlink() or path.exists():
            _remove(path)
        with open(path, "wb") as f:
            for offset, data in self.chunks:
                if offset < self.written:
                    f.seek(offset)
                    f.write(data[: self.written - offset])
            f.truncate(self.written)

    def bytes(self) -> bytes:
        out = bytearray(self.written)
        for offset, data in self.chunks:
            piece = data[: max(0, self.written - offset)]
            out[offset : offset + len(piece)] = piece
        return bytes(out)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink()


class JsonDoc:
    def __init__(self, value: Any):
        self.value = value

    def spec(self) -> FileSpec:
        data = json.dumps(self.value).encode()
        return FileSpec(((0, data),), len(data))


class JsonLines:
    """A prompts file: one JSON value a line."""

    def __init__(self, values: list):
        self.values = values

    def spec(self) -> FileSpec:
        data = "\n".join(json.dumps(v, ensure_ascii=False)
                         for v in self.values).encode("utf-8", "surrogatepass") + b"\n"
        return FileSpec(((0, data),), len(data))


class RawFile:
    def __init__(self, data: bytes):
        self.data = data

    def spec(self) -> FileSpec:
        return FileSpec(((0, self.data),), len(self.data))


# safetensors: 8-byte header length, the JSON header, then the data (a hole but for the tensors in `data`).


class Safetensors:
    def __init__(self, header: dict, data: dict[str, bytes], data_size: int, length: int | None = None):
        self.header, self.data, self.data_size, self.length = header, data, data_size, length
        self.text: str | None = None  # the header as written, when a mutation spliced a value into it

    @classmethod
    def read(cls, path: Path, replace: dict[str, bytes] | None = None) -> Safetensors:
        """The file's header; tensors named in `replace` get that content (as U8), the others stay a hole."""
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
        replace = replace or {}
        out, offset = {}, 0
        for name, entry in header.items():
            if name == "__metadata__":
                out[name] = entry
                continue
            nbytes = entry["data_offsets"][1] - entry["data_offsets"][0]
            if name in replace:
                entry = {"dtype": "U8", "shape": [len(replace[name])]}
                nbytes = len(replace[name])
            out[name] = {**entry, "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
        return cls(out, replace, offset)

    def spec(self) -> FileSpec:
        text = (self.text or json.dumps(self.header, allow_nan=True)).encode("utf-8", "surrogatepass")
        text += b" " * (-len(text) % 8)
        start = 8 + len(text)
        length = len(text) if self.length is None else self.length
        chunks = [(0, struct.pack("<Q", length & (2**64 - 1)) + text)]
        for name, data in self.data.items():
            entry = self.header.get(name)
            offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
            if isinstance(offsets, list) and offsets and isinstance(offsets[0], int) and 0 <= offsets[0] < 2**40:
                chunks.append((start + offsets[0], data))
        return FileSpec(tuple(chunks), start + self.data_size)


# GGUF: value types per the spec, and the struct format of each scalar.
G_STRING, G_ARRAY = 8, 9
G_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


@dataclass
class GArray:
    itype: int
    items: list
    count: int | None = None  # a count that differs from len(items): a hostile header
    raw: bytes | None = None  # the items already encoded (the huge arrays, which would take seconds item by item)


@dataclass
class Gguf:
    version: int
    kvs: list[list]  # [key, value type, value]
    tensors: list[list]  # [name, dims (innermost first), ggml type, offset]
    data: dict[str, bytes]  # tensors with real content; the others are a hole
    data_size: int
    n_tensors: int | None = None  # counts that differ from the lists: a hostile header
    n_kv: int | None = None

    @classmethod
    def read(cls, path: Path, replace_kv: dict[str, GArray], replace_tensor: dict[str, tuple[int, bytes]]) -> Gguf:
        """The file's header, some metadata arrays and tensors replaced (tensor: (ggml type, content)), the
        tensors laid out again, in order, at the file's alignment."""
        buf = path.read_bytes()
        pos = 4
        version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, pos)
        pos += 20

        def string():
            nonlocal pos
            (n,) = struct.unpack_from("<Q", buf, pos)
            pos += 8 + n
            return buf[pos - n : pos].decode()

        def value(vtype):
            nonlocal pos
            if vtype == G_STRING:
                return string()
            if vtype == G_ARRAY:
                itype, count = struct.unpack_from("<IQ", buf, pos)
                pos += 12
                return GArray(itype, [value(itype) for _ in range(count)])
            fmt = "<" + G_FORMATS[vtype]
            (v,) = struct.unpack_from(fmt, buf, pos)
            pos += struct.calcsize(fmt)
            return v

        kvs = []
        for _ in range(n_kv):
            key = string()
            (vtype,) = struct.unpack_from("<I", buf, pos)
            pos += 4
            stored = value(vtype)
            kvs.append([key, vtype, replace_kv.get(key, stored)])
        tensors = []
        for _ in range(n_tensors):
            name = string()
            (n_dims,) = struct.unpack_from("<I", buf, pos)
            dims = list(struct.unpack_from(f"<{n_dims}Q", buf, pos + 4))
            ggml_type, _ = struct.unpack_from("<IQ", buf, pos + 4 + 8 * n_dims)
            pos += 4 + 8 * n_dims + 12
            if name in replace_tensor:
                ggml_type, data = replace_tensor[name]
                dims = [len(data) // _ggml_nbytes(ggml_type, [1])]
            tensors.append([name, dims, ggml_type, 0])
        alignment = next((v for k, _, v in kvs if k == "general.alignment"), 32)
        offset, data = 0, {}
        for tensor in tensors:
            tensor[3] = offset
            offset += -(-_ggml_nbytes(tensor[2], tensor[1]) // alignment) * alignment
            if tensor[0] in replace_tensor:
                data[tensor[0]] = replace_tensor[tensor[0]][1]
        return cls(version, kvs, tensors, data, offset)

    def spec(self) -> FileSpec:
        out = [struct.pack("<IIQQ", 0x46554747, self.version & 0xFFFFFFFF, _u64(self.n_tensors, len(self.tensors)),
                           _u64(self.n_kv, len(self.kvs)))]
        for key, vtype, value in self.kvs:
            out += [_g_string(key), struct.pack("<I", vtype & 0xFFFFFFFF), _g_value(vtype, value)]
        for name, dims, ggml_type, offset in self.tensors:
            out += [_g_string(name), struct.pack("<I", len(dims)), b"".join(struct.pack("<Q", _u64(d)) for d in dims),
                    struct.pack("<IQ", ggml_type & 0xFFFFFFFF, _u64(offset))]
        header = b"".join(out)
        alignment = next((v for k, t, v in self.kvs if k == "general.alignment" and t == 4), 32)
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            alignment = 32
        start = -(-len(header) // alignment) * alignment
        chunks = [(0, header)]
        for name, _, _, offset in self.tensors:
            if name in self.data and 0 <= offset < 2**40:
                chunks.append((start + offset, self.data[name]))
        return FileSpec(tuple(chunks), start + self.data_size)


def _ggml_nbytes(ggml_type: int, dims: list[int]) -> int:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    block, size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    return math.prod(dims) // block * size


def _u64(value: int | None, default: int = 0) -> int:
    return (default if value is None else int(value)) & (2**64 - 1)


def _g_string(value: str | bytes) -> bytes:
    data = value if isinstance(value, bytes) else value.encode("utf-8", "surrogatepass")
    return struct.pack("<Q", len(data)) + data


def _g_value(vtype: int, value: Any) -> bytes:
    if vtype == G_STRING:
        return _g_string(value if isinstance(value, (str, bytes)) else str(value))
    if vtype == G_ARRAY:
        if not isinstance(value, GArray):
            value = GArray(G_STRING, [str(value)])
        head = struct.pack("<IQ", value.itype & 0xFFFFFFFF, _u64(value.count, len(value.items)))
        if value.raw is not None:
            return head + value.raw
        fmt = G_FORMATS.get(value.itype)
        if fmt is not None:
            try:
                return head + struct.pack(f"<{len(value.items)}{fmt}", *value.items)
            except (struct.error, TypeError):
                pass
        return head + b"".join(_g_value(value.itype, item) for item in value.items)
    fmt = G_FORMATS.get(vtype)
    if fmt is None:
        return b""  # an unknown type has no encoding: the reader must refuse the type itself
    return struct.pack("<" + fmt, _scalar(fmt, value))


def _scalar(fmt: str, value: Any):
    """`value` as something struct packs in `fmt`: integers wrap, floats overflow to infinity."""
    if fmt in "fd":
        try:
            v = float(value)
        except (TypeError, ValueError, OverflowError):
            v = math.inf
        return v if fmt == "d" or not math.isfinite(v) or abs(v) < 3.4e38 else math.copysign(math.inf, v)
    if fmt == "?":
        return bool(value)
    try:
        v = int(value)
    except (TypeError, ValueError, OverflowError):
        v = 0
    bits = struct.calcsize(fmt) * 8
    v &= (1 << bits) - 1
    return v - (1 << bits) if fmt.islower() and v >= 1 << (bits - 1) else v


FILE_KINDS = ("folder", "fifo", "symlink-loop", "dangling-symlink", "empty")


def write_kind(path: Path, kind: str) -> None:
    if path.is_symlink() or path.exists():
        _remove(path)
    if kind == "folder":
        path.mkdir()
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "symlink-loop":
        path.symlink_to(path.name)
    elif kind == "dangling-symlink":
        path.symlink_to(path.name + ".missing")
    else:
        path.write_bytes(b"")
