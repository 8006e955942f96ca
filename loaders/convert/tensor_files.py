"""Tensor files written in a stream: the layout (header and every tensor's place) is fixed from names, dtypes
and shapes before any weight is read, then each tensor's bytes are written at its place as they are made, in
whatever order and in as many pieces as the maker likes, so a conversion holds one tensor at a time. The same
input gives the same bytes: names are laid out in a fixed order and headers are written deterministically.

Two formats: safetensors (ComfyUI's single files) and GGUF (llama.cpp's container, as FLUX.2 GGUFs use it)."""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from typing import BinaryIO

import torch

from ..formats.gguf_types import check_pace, check_peak, quantize, quantized_buffer, type_of
from ..formats.kernels import chunks
from ..formats.safetensors_file import SAFETENSORS_DTYPES

GGUF_ALIGNMENT = 32  # gguf-py's and llama.cpp's default
_GGUF_VERSION = 3


@dataclass(frozen=True)
class Place:
    offset: int  # in the file
    nbytes: int


class TensorFile:
    """Writes a planned file: `header` at the start, each tensor's bytes at its place (`write`, any order, in
    pieces), and `finish` checks that every byte of every tensor was written before the file is published."""

    def __init__(self, f: BinaryIO, header: bytes, places: dict[str, Place], size: int):
        self._f, self.places, self.size = f, places, size
        self._written = dict.fromkeys(places, 0)
        f.seek(0)
        f.write(header)

    def write(self, name: str, data: torch.Tensor, at: int = 0) -> None:
        """The bytes of `data` (a CPU tensor of any dtype, written as laid out in memory) at byte `at` of
        tensor `name`."""
        raw = data.detach().contiguous().reshape(-1).view(torch.uint8)
        place = self.places[name]
        if at < 0 or at + raw.numel() > place.nbytes:
            raise ValueError(f"{raw.numel()} bytes at {at} do not fit tensor {name} ({place.nbytes} bytes)")
        self._f.seek(place.offset + at)
        self._f.write(memoryview(raw.numpy()))
        self._written[name] += raw.numel()

    def finish(self) -> None:
        short = [name for name, place in self.places.items() if self._written[name] != place.nbytes]
        if short:
            raise RuntimeError(f"{len(short)} tensor(s) were not written in full (e.g. {short[0]})")
        self._f.truncate(self.size)  # the padding after the last tensor


def _nbytes(dtype: torch.dtype, shape) -> int:
    n = dtype.itemsize
    for s in shape:
        n *= s
    return n


def safetensors_file(f: BinaryIO, tensors: dict[str, tuple[torch.dtype, tuple[int, ...]]],
                     metadata: dict[str, str] | None = None) -> TensorFile:
    """A safetensors file of `tensors` ({name: (dtype, shape)}), laid out widest dtype first, then by name, so
    every tensor starts at a multiple of its element size (as safetensors' own writer lays them out)."""
    order = sorted(tensors, key=lambda n: (-tensors[n][0].itemsize, n))
    header: dict = {"__metadata__": dict(sorted(metadata.items()))} if metadata else {}
    places, at = {}, 0
    for name in order:
        dtype, shape = tensors[name]
        nbytes = _nbytes(dtype, shape)
        header[name] = {"dtype": SAFETENSORS_DTYPES[str(dtype)], "shape": list(shape),
                        "data_offsets": [at, at + nbytes]}
        places[name] = at, nbytes
        at += nbytes
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as safetensors pads it
    start = 8 + len(text)
    return TensorFile(f, struct.pack("<Q", len(text)) + text,
                      {n: Place(start + o, size) for n, (o, size) in places.items()}, start + at)


def _gguf_string(text: str) -> bytes:
    raw = text.encode()
    return struct.pack("<Q", len(raw)) + raw


_GGUF_SCALARS = {"UINT32": "<I", "INT32": "<i", "FLOAT32": "<f", "BOOL": "<?"}  # GGUFValueType name -> its packing


def _gguf_value(vtype, value) -> bytes:
    """One metadata value; an ARRAY's value is (element type, items)."""
    from gguf import GGUFValueType as V

    if vtype == V.STRING:
        return _gguf_string(value)
    if vtype == V.ARRAY:
        itype, items = value
        return struct.pack("<IQ", int(itype), len(items)) + b"".join(_gguf_value(itype, item) for item in items)
    if vtype.name in _GGUF_SCALARS:
        return struct.pack(_GGUF_SCALARS[vtype.name], value)
    raise ValueError(f"GGUF value type {vtype!r} is not one the pack writes")


def gguf_file(f: BinaryIO, metadata: list[tuple[str, object, object]],
              tensors: dict[str, tuple[object, tuple[int, ...], int]]) -> TensorFile:
    """A GGUF (version 3) file of `metadata` ([(key, GGUFValueType, value)], in order; an array's value is (element
    type, items)) and `tensors` ({name: (GGMLQuantizationType, torch shape, bytes)}, in the order given), each
    tensor's data aligned to 32 bytes; refused first where the quantizers cannot keep pace (check_pace)."""
    check_pace((qtype, shape) for qtype, shape, _ in tensors.values())
    head = [b"GGUF", struct.pack("<IQQ", _GGUF_VERSION, len(tensors), len(metadata))]
    for key, vtype, value in metadata:
        head += [_gguf_string(key), struct.pack("<I", int(vtype)), _gguf_value(vtype, value)]
    places, at = {}, 0
    for name, (qtype, shape, nbytes) in tensors.items():
        dims = tuple(reversed(shape))  # GGUF stores the innermost dimension first
        head += [_gguf_string(name), struct.pack(f"<I{len(dims)}Q", len(dims), *dims),
                 struct.pack("<IQ", int(qtype), at)]
        places[name] = at, nbytes
        at += nbytes + (-nbytes % GGUF_ALIGNMENT)
    header = b"".join(head)
    header += b"\0" * (-len(header) % GGUF_ALIGNMENT)
    start = len(header)
    return TensorFile(f, header, {n: Place(start + o, size) for n, (o, size) in places.items()}, start + at)


_ROW_VALUES = 1 << 24  # values quantized and written at a time, so no full-size output is held


def write_quantized(file: TensorFile, name: str, values: torch.Tensor, qtype) -> None:
    """`values` quantized as `qtype` (a GGMLQuantizationType) in chunks of rows, each written at its place in the
    GGUF `file`; NotQuantizable where a value does not fit the type."""
    row = type_of(qtype)
    if values.dtype == torch.float64 and values.numel():  # before the quantizer's float32 cast makes 1e300 infinite
        check_peak(max(values.amax().item(), -values.amin().item()), limited=row.limited)
    rows = values.reshape(-1, values.shape[-1] if values.dim() else 1)
    parts = chunks(rows.shape[0], rows.shape[1], values=_ROW_VALUES)
    # one output buffer for every chunk: fresh memory per chunk costs more in page faults than quantizing it
    buffer = quantized_buffer(row, parts[0].stop if parts else 0, rows.shape[1])
    for part in parts:
        file.write(name, quantize(rows[part], row, out=buffer[: part.stop - part.start]),
                   at=part.start * row.row_bytes(rows.shape[1]))
