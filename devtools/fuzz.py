"""Mutation fuzzing of every parser and loader entry point, from the pack's own tiny fixtures.

Each target (TARGETS) is one entry point run on model files and folders rebuilt from the tiny/ factory's
output: weights become sparse files (headers real, tensor data a hole), and vocabularies are cut to the 1000
specials and a few hundred ranks so a tokenizer builds in milliseconds. Input `i` of seed `s` is one mutation
(or a short stack) of one file of one of those trees, chosen by random.Random(f"{target}/{s}/{i}"): it is
reproducible from (target, seed, index) alone. Mutations are structure-aware (a JSON value at a random path
retyped, made huge or deeply nested; safetensors header lengths and entries; GGUF counts, values, vocabulary
arrays and tensor dims, types and offsets), raw (bit flips, interesting integers, byte insertions and
deletions, truncation) or of the file's kind (a folder, a FIFO or a symlink loop where the file was).

The oracle: an input passes when the entry point returns normally or raises the pack's Flux2DevError.
Anything else fails: another exception (BaseException included, such as the tokenizers library's
PanicException), more than --cpu seconds of CPU, blocking (a hang without CPU use), a peak memory growth over
256 MiB plus 4x the input's size, an error text quoting a file outside the model folder, or an index naming
shards outside it. Inputs run in forked worker processes that live until one fails, so a hang or a blowup
never takes the harness down.

    python -m comfyui_flux2dev.devtools fuzz                     # quick mode: 2,000 inputs per target
    python -m comfyui_flux2dev.devtools fuzz --long              # 20,000 inputs per target
    python -m comfyui_flux2dev.devtools fuzz --target gguf-reader --seed 7 --index 123   # one input, traceback
"""

from __future__ import annotations

import argparse
import base64
import copy
import ctypes
import json
import math
import multiprocessing
import os
import random
import re
import resource
import shutil
import signal
import struct
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any, Callable

QUICK_INPUTS = 2000
LONG_INPUTS = 20000
MAX_FILE = 1 << 40  # the largest (sparse) file an input is written as
CPU_LIMIT_S = 5.0  # refusing a damaged file should take well under a second
WALL_LIMIT_S = 120.0  # even on a loaded machine
BLOCKED_S = 3.0  # this long asleep without using CPU is a hang (a FIFO opened, a lock never released)
MEMORY_SLACK = 256 << 20  # allowed peak growth: this plus MEMORY_PER_BYTE x the input's size
MEMORY_PER_BYTE = 4
ADDRESS_SPACE_MARGIN = 3 << 30  # RLIMIT_AS over a worker's start: a hard stop before the machine runs out
OUT_ENV = "FLUX2DEV_FUZZ_OUT"
N_RANKS = 300  # BPE ranks kept in the cut vocabularies (the 256 bytes and the first merges)
CANARY = b"CANARY!!"  # the first bytes of a file beside each tree, outside every model folder
# What an error text may never hold: the canary's or /etc/passwd's first bytes, as text or as a number.
LEAKS = ("CANARY!!", str(int.from_bytes(CANARY, "little")), "root:x:", str(int.from_bytes(b"root:x:0", "little")))
PROMPT = "a red fox [INST] <s> in the snow"


# ------------------------------------------------------------------------------------------- file contents


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
        data = "\n".join(json.dumps(v, ensure_ascii=False) for v in self.values).encode("utf-8", "surrogatepass") + b"\n"
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


# ------------------------------------------------------------------------------------------- mutations

INTERESTING_INTS = (0, 1, -1, 2, 3, 7, 32, 255, 256, 1000, 65535, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**53 + 1,
                    2**62, 2**63 - 1, 2**63, 2**64 - 1, 2**64, -(2**63), 10**5, 10**6, 10**7, 10**100)
INTERESTING_FLOATS = (0.5, -0.0, 1e308, -1e308, 1e-308, math.inf, -math.inf, math.nan, 1e9, 3.0)
INTERESTING_STRINGS = (
    "", "0", "-1", "1e308", "Infinity", "NaN", "null", "true", "gpt2", "llama", "mistral3", "flux", "BF16", "U8",
    "../canary", "../../canary", "../../../canary", "../../../../canary", "/etc/passwd", "/proc/self/environ",
    "../../../../../../../../etc/passwd", ".", "..", "a\nb", "\u202eevil.safetensors", "\ud800", "\x00", "<s>",
    "[INST]", "x" * 4096, "model.safetensors", "diffusion_pytorch_model.safetensors",
)
DEEP, BLOAT = "@@deep@@", "@@bloat@@"  # stand for a deeply nested and a huge value in serialised JSON


def _json_value(rng: random.Random, depth: int = 0) -> Any:
    kind = rng.randrange(8)
    if kind == 0:
        return rng.choice(INTERESTING_INTS)
    if kind == 1:
        return rng.choice(INTERESTING_FLOATS)
    if kind == 2:
        return rng.choice(INTERESTING_STRINGS)
    if kind == 3:
        return None
    if kind == 4:
        return rng.random() < 0.5
    if kind == 5 and depth < 2:
        return [_json_value(rng, depth + 1) for _ in range(rng.randrange(4))]
    if kind == 6 and depth < 2:
        return {rng.choice(("a", "dtype", "shape", "rank", "token_bytes", "weight_map")): _json_value(rng, depth + 1)}
    return {}


def _retyped(value: Any, rng: random.Random) -> Any:
    """The same value in another JSON type: string <-> number <-> array <-> object <-> null."""
    forms = [str(value) if not isinstance(value, str) else value + "x", [value], {"value": value}, None]
    if isinstance(value, str):
        try:
            forms.append(float(value))
        except ValueError:
            forms.append(len(value))
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        forms += [float(value) if isinstance(value, int) else int(value) if math.isfinite(value) else 0, value == 0]
    elif isinstance(value, (list, dict)):
        forms += [len(value), json.dumps(value)[:100]]
    return rng.choice(forms)


def _walk(doc: Any, rng: random.Random, stop: float = 0.3) -> list:
    """A random path into `doc`: every level is as likely a stop as the leaves, so top fields get hit."""
    path, node = [], doc
    while isinstance(node, (dict, list)) and node and (not path or rng.random() > stop):
        key = rng.choice(list(node)) if isinstance(node, dict) else rng.randrange(len(node))
        path.append(key)
        node = node[key]
    return path


def _get(doc, path):
    for key in path:
        doc = doc[key]
    return doc


def mutate_json(doc: Any, rng: random.Random, notes: list[str]) -> tuple[Any, str]:
    """A copy of `doc` changed at a random path, and the text to write (with deep or huge values spliced)."""
    doc = copy.deepcopy(doc)
    path = _walk(doc, rng)
    old = _get(doc, path)
    op = rng.choice(("retype", "number", "string", "value", "delete", "insert", "empty", "deep", "repeat",
                     "number", "retype", "value"))
    splice = None
    if op == "retype":
        new = _retyped(old, rng)
    elif op == "number":
        new = rng.choice(INTERESTING_INTS + INTERESTING_FLOATS)
    elif op == "string":
        new = rng.choice(INTERESTING_STRINGS)
    elif op == "value":
        new = _json_value(rng)
    elif op == "empty":
        new = type(old)() if isinstance(old, (dict, list, str)) else []
    elif op == "repeat":
        new = [old] * rng.choice((2, 100, 10000)) if not isinstance(old, (dict, list)) or len(json.dumps(old)) < 2000 else [old, old]
    elif op == "deep":
        new, splice = DEEP, (DEEP, rng.choice((64, 1000, 100000)))
    elif op == "delete" and path:
        parent = _get(doc, path[:-1])
        del parent[path[-1]]
        notes.append(f"json: delete {_show_path(path)}")
        return doc, json.dumps(doc, allow_nan=True)
    else:  # insert into the container at the path (or next to the value)
        container = old if isinstance(old, (dict, list)) else _get(doc, path[:-1]) if path else None
        if isinstance(container, dict):
            container[rng.choice(("__metadata__", "x", "0", "weight_map", "special_tokens", "", "\u202e"))] = _json_value(rng)
        elif isinstance(container, list):
            container.insert(rng.randrange(len(container) + 1), _json_value(rng))
        notes.append(f"json: insert into {_show_path(path)}")
        return doc, json.dumps(doc, allow_nan=True)
    if rng.random() < 0.01:
        new, splice = BLOAT, (BLOAT, rng.choice((32, 48, 64)) << 20)
    if path:
        _get(doc, path[:-1])[path[-1]] = new
    else:
        doc = new
    text = json.dumps(doc, allow_nan=True)
    notes.append(f"json: {op} {_show_path(path)} = {str(new)[:80]!r}" + (f" ({splice[1]})" if splice else ""))
    if splice is not None:
        marker, n = splice
        if marker == DEEP:
            filler = "[" * n + "0" + "]" * n
        else:  # empty objects: what costs a JSON parser the most per byte
            filler = "[" + "{}," * (n // 3) + "{}]"
        text = text.replace(json.dumps(marker), filler, 1)
    return doc, text


def _show_path(path: list) -> str:
    return "/" + "/".join(str(p) for p in path)


ODD_LINES = ("", "\ufeff\"x\"", '"a\u2028b"', '"a\u2029b"', '"\\ud800"', '"\\udfff\\ud800"', "\r", "[" * 64 + "]" * 64,
             "null", "5", '{"prompt": "x"}', '"x', "\x00", '"[INST] <s> <pad> [IMG]"', " " * 10000)


def mutate_lines(model: JsonLines, rng: random.Random, notes: list[str]) -> RawFile:
    """A prompts file with one line's JSON mutated, an odd line inserted, or a line repeated many times."""
    lines = [json.dumps(v, ensure_ascii=False) for v in model.values]
    at = rng.randrange(len(lines))
    op = rng.choice(("json", "json", "odd", "repeat"))
    if op == "json":
        _, lines[at] = mutate_json(model.values[at], rng, notes)
    elif op == "odd":
        lines.insert(at, rng.choice(ODD_LINES))
        notes.append(f"lines: odd line {lines[at][:40]!r} at {at}")
    else:
        lines[at:at + 1] = [lines[at]] * rng.choice((100, 10000))
        notes.append(f"lines: line {at} repeated")
    return RawFile("\n".join(lines).encode("utf-8", "surrogatepass"))


def mutate_safetensors(model: Safetensors, rng: random.Random, notes: list[str]) -> Safetensors:
    model = Safetensors(copy.deepcopy(model.header), model.data, model.data_size, model.length)
    op = rng.choice(("length", "json", "json", "entry", "entry", "entry", "metadata"))
    names = [n for n in model.header if n != "__metadata__"]
    if op == "length":
        text_len = len(json.dumps(model.header).encode())
        model.length = rng.choice((0, 1, 2, text_len - 1, text_len + 1, text_len + 8, model.data_size, 2**63,
                                   2**64 - 1, (100 << 20) + 1, rng.choice(INTERESTING_INTS)))
        notes.append(f"safetensors: header length = {model.length}")
    elif op == "metadata":
        model.header["__metadata__"] = rng.choice(({"format": rng.choice(INTERESTING_INTS)}, [], "pt", None,
                                                   {"a": {"b": 1}}, _json_value(rng)))
        notes.append(f"safetensors: __metadata__ = {str(model.header['__metadata__'])[:60]}")
    elif op == "entry" and names:
        name = rng.choice(names)
        entry = model.header[name]
        what = rng.choice(("dtype", "shape", "data_offsets", "delete"))
        if not isinstance(entry, dict):
            entry = model.header[name] = {}
        if what == "dtype":
            entry["dtype"] = rng.choice(("BF16", "F16", "F32", "F64", "U8", "I64", "F8_E4M3", "F8_E5M2", "F4",
                                         "Q4_K", "", "bf16", 7, None, ["BF16"]))
        elif what == "shape":
            shape = list(entry.get("shape") or [1])
            choice = rng.randrange(5)
            if choice == 0 and shape:
                shape[rng.randrange(len(shape))] = rng.choice(INTERESTING_INTS + INTERESTING_FLOATS + ("3", None))
            elif choice == 1:
                shape.append(rng.choice((1, 0, 2)))
            elif choice == 2:
                shape = shape[:-1]
            elif choice == 3:
                shape = rng.choice(([], [0], [[1]], [2**63, 2**63], [-1, -1], "1,2"))
            else:
                shape = shape[::-1]
            entry["shape"] = shape
        elif what == "data_offsets":
            offsets = entry.get("data_offsets")
            ok = isinstance(offsets, list) and len(offsets) >= 2 and all(type(o) is int for o in offsets[:2])
            start, end = offsets[:2] if ok else (0, 0)
            entry["data_offsets"] = rng.choice(([end, start], [start, 2**64], [-1, end], [start], [start, end, 1],
                                                "0,1", [start + 1, end + 1], [1.5, end], [start, math.inf],
                                                [0, model.data_size + 1], [start, start]))
        else:
            entry.pop(rng.choice(("dtype", "shape", "data_offsets")), None)
        notes.append(f"safetensors: {name} {what} -> {str(entry)[:100]}")
    else:
        model.header, model.text = mutate_json(model.header, rng, notes)
    return model


def _g_random_value(rng: random.Random) -> tuple[int, Any]:
    vtype = rng.choice((0, 4, 5, 6, 7, 10, 11, 12, G_STRING, G_STRING, G_ARRAY, G_ARRAY, 13, 2**32 - 1))
    if vtype == G_STRING:
        return vtype, rng.choice(INTERESTING_STRINGS + (b"\xff\xfe", b"\xc3"))
    if vtype == G_ARRAY:
        itype = rng.choice((0, 4, 6, G_STRING, G_ARRAY, 13))
        items = [] if itype in (G_ARRAY, 13) else [rng.choice(INTERESTING_INTS) if itype != G_STRING else "x"
                                                  for _ in range(rng.randrange(4))]
        return vtype, GArray(itype, items, rng.choice((None, None, 0, 2**63, 2**64 - 1, 5)))
    if vtype in (6, 12):
        return vtype, rng.choice(INTERESTING_FLOATS + (1.0, 0.0))
    return vtype, rng.choice(INTERESTING_INTS)


def mutate_gguf(model: Gguf, rng: random.Random, notes: list[str]) -> Gguf:
    model = copy.copy(model)
    model.kvs = [list(kv) for kv in model.kvs]
    model.tensors = [[t[0], list(t[1]), t[2], t[3]] for t in model.tensors]
    arch = next((v for k, _, v in model.kvs if k == "general.architecture" and isinstance(v, str)), "flux")
    op = rng.choice(("version", "count", "kv", "kv", "kv-type", "kv-delete", "kv-add", "kv-add", "array", "array",
                     "vocab", "vocab", "bloat", "tensor-dims", "tensor-dims", "tensor-type", "tensor-offset",
                     "tensor-offset", "tensor-name", "tensor-delete"))
    if op == "version":
        model.version = rng.choice((0, 1, 2, 3, 4, 0x03000000, 2**32 - 1))
        notes.append(f"gguf: version {model.version}")
    elif op == "count":
        which = rng.choice(("n_tensors", "n_kv"))
        actual = len(model.tensors if which == "n_tensors" else model.kvs)
        setattr(model, which, rng.choice((0, actual - 1, actual + 1, 2**63, 2**64 - 1, 2**32, 10**6)))
        notes.append(f"gguf: {which} = {getattr(model, which)}")
    elif op in ("kv", "kv-type", "kv-delete") and model.kvs:
        favoured = [kv for kv in model.kvs if kv[0].startswith(("tokenizer.", "general.", arch))]
        kv = rng.choice(favoured if favoured and rng.random() < 0.7 else model.kvs)
        if op == "kv":
            kv[1], kv[2] = _g_random_value(rng)
        elif op == "kv-type":
            kv[1] = rng.choice((0, 4, 6, 7, 10, 12, G_STRING, G_ARRAY, 13))
            if kv[1] == G_ARRAY and not isinstance(kv[2], GArray):
                kv[2] = GArray(G_STRING if isinstance(kv[2], str) else 4, [kv[2]])
            elif kv[1] != G_ARRAY and isinstance(kv[2], GArray):
                kv[2] = kv[2].items[0] if kv[2].items else 0
        else:
            model.kvs.remove(kv)
        notes.append(f"gguf: {op} {kv[0]} -> type {kv[1]} {str(kv[2])[:60]}")
    elif op == "kv-add":
        key = rng.choice(("general.alignment", "general.architecture", f"{arch}.attention.head_count",
                          f"{arch}.attention.head_count_kv", f"{arch}.rope.freq_base", "tokenizer.ggml.model",
                          "tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "x"))
        vtype, value = _g_random_value(rng)
        if key == "general.alignment" and rng.random() < 0.5:
            vtype, value = 4, rng.choice((0, 1, 3, 7, 64, 2**31, 2**32 - 1))
        existing = next((kv for kv in model.kvs if kv[0] == key), None)
        if existing is not None and rng.random() < 0.7:
            existing[1], existing[2] = vtype, value
        else:
            model.kvs.append([key, vtype, value])
        notes.append(f"gguf: set {key} = type {vtype} {str(value)[:60]}")
    elif op in ("array", "vocab"):
        arrays = [kv for kv in model.kvs if isinstance(kv[2], GArray)]
        vocab = [kv for kv in arrays if kv[0] in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type")]
        pool = vocab if op == "vocab" and vocab else arrays
        if pool:
            kv = rng.choice(pool)
            kv[2] = array = GArray(kv[2].itype, list(kv[2].items), kv[2].count)
            how = rng.randrange(7)
            if how == 0:
                array.count = rng.choice((0, len(array.items) + 1, len(array.items) - 1, 2**63, 2**64 - 1, 2**40))
            elif how == 1 and array.items:
                i = rng.randrange(min(len(array.items), rng.choice((20, 1100, len(array.items)))))
                array.items[i] = (rng.choice(INTERESTING_STRINGS + (b"\xff", "Ġ", array.items[0]))
                                  if array.itype == G_STRING else rng.choice(INTERESTING_INTS))
            elif how == 2:
                array.items = array.items[: rng.randrange(len(array.items) + 1)]
            elif how == 3 and array.items:
                i = rng.randrange(len(array.items))
                array.items[i:i] = array.items[i : i + rng.choice((1, 10, 500))]
            elif how == 4:
                array.itype = rng.choice((0, 4, 6, 7, 10, G_STRING, G_ARRAY, 13))
                if array.itype == G_STRING:
                    array.items = [str(x) for x in array.items]
                elif array.itype in (G_ARRAY, 13):
                    array.items = []
                else:
                    array.items = [len(x) if isinstance(x, (str, bytes)) else x for x in array.items]
            elif how == 5 and array.itype == G_STRING:  # every token a prefix of the next: the merge builder's worst case
                array.items[1000:] = ["a" * (k + 1) for k in range(len(array.items) - 1000)]
            else:
                rng.shuffle(array.items)
            notes.append(f"gguf: {kv[0]} array change {how} (count {array.count}, {len(array.items)} items)")
    elif op == "bloat":
        size = rng.choice((64, 1024, 48 << 20, 64 << 20))
        kind = rng.choice(("strings", "arrays", "deep"))
        if kind == "strings":
            value = GArray(G_STRING, [], size // 8, bytes(size // 8 * 8))
        elif kind == "arrays":
            value = GArray(G_ARRAY, [], size // 12, struct.pack("<IQ", 0, 0) * (size // 12))
        else:  # arrays of one array, nested `depth` deep, the innermost empty
            depth = rng.choice((9, 100, 10000))
            value = GArray(G_ARRAY, [], 1, struct.pack("<IQ", G_ARRAY, 1) * (depth - 2) + struct.pack("<IQ", 0, 0))
        model.kvs.append([rng.choice(("x.bloat", "tokenizer.ggml.merges")), G_ARRAY, value])
        notes.append(f"gguf: add {kind} bloat ({size} bytes)")
    elif op.startswith("tensor") and model.tensors:
        tensor = rng.choice(model.tensors)
        if op == "tensor-dims":
            dims = tensor[1]
            how = rng.randrange(4)
            if how == 0 and dims:
                dims[rng.randrange(len(dims))] = rng.choice((0, 1, 2**63, 2**64 - 1, 2**32, dims[0] * 2, dims[0] - 1, 31))
            elif how == 1:
                dims.append(rng.choice((1, 2, 0)))
            elif how == 2 and dims:
                dims.pop()
            else:
                tensor[1] = [1] * rng.choice((0, 5, 1000))
        elif op == "tensor-type":
            tensor[2] = rng.choice((*range(0, 42), 2**31, 2**32 - 1))
        elif op == "tensor-offset":
            other = rng.choice(model.tensors)
            tensor[3] = rng.choice((tensor[3] + 1, tensor[3] + 32, other[3], 2**63, 2**64 - 1, model.data_size,
                                    model.data_size + 32, 0))
        elif op == "tensor-name":
            tensor[0] = rng.choice((rng.choice(model.tensors)[0], "", b"\xff\xfe", f"model.diffusion_model.{tensor[0]!s}",
                                    "x" * 70000, "tekken_model"))
        else:
            model.tensors.remove(tensor)
        notes.append(f"gguf: {op} {tensor[0]!r:.60} -> dims {tensor[1][:6]} type {tensor[2]} offset {tensor[3]}")
    return model


def mutate_bytes(spec: FileSpec, rng: random.Random, notes: list[str]) -> FileSpec:
    """Raw damage to the first chunk (the header) and the size."""
    (first_offset, data), *rest = spec.chunks
    data = bytearray(data)
    size = spec.size
    op = rng.choice(("flip", "flip", "byte", "u64", "u32", "insert", "delete", "truncate", "truncate", "extend", "splice"))
    head = min(len(data), 4096)
    pos = rng.randrange(len(data)) if data and rng.random() < 0.5 else rng.randrange(max(1, head))
    if op == "flip" and data:
        for _ in range(rng.choice((1, 1, 2, 4, 8))):
            i = rng.randrange(len(data)) if rng.random() < 0.5 else rng.randrange(max(1, head))
            data[i] ^= 1 << rng.randrange(8)
    elif op == "byte" and data:
        data[pos % len(data)] = rng.choice((0, 0xFF, 0x7F, 0x80, 0x20, 0x22, 0x7B, 0x5B, 0x30))
    elif op in ("u64", "u32") and len(data) >= 8:
        width = 8 if op == "u64" else 4
        if rng.random() < 0.5:
            pos = rng.randrange(0, min(len(data), 64) - width + 1) // 4 * 4
        pos = min(pos, len(data) - width)
        value = rng.choice(INTERESTING_INTS) & ((1 << (8 * width)) - 1)
        data[pos : pos + width] = value.to_bytes(width, "little")
    elif op == "insert":
        data[pos:pos] = bytes(rng.randrange(256) for _ in range(rng.choice((1, 4, 16))))
        size += len(data) - len(spec.chunks[0][1])
    elif op == "delete" and data:
        n = rng.choice((1, 4, 64))
        del data[pos : pos + n]
        size -= min(n, len(spec.chunks[0][1]) - pos)
    elif op == "truncate":
        size = rng.randrange(0, len(data) + 1) if rng.random() < 0.6 else rng.randrange(0, size + 1)
    elif op == "extend":
        size += rng.choice((1, 7, 4096, 1 << 20))
    elif data:
        n = rng.choice((8, 64, 512))
        piece = data[pos : pos + n]
        at = rng.randrange(len(data))
        data[at:at] = piece
        size += len(piece)
    notes.append(f"bytes: {op} at {pos} (size {size})")
    return FileSpec(((first_offset, bytes(data)), *rest), max(size, 0))


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


# ------------------------------------------------------------------------------------------- seed trees


@dataclass
class Tree:
    """Files rebuilt from one tiny fixture, the entry the target is called with, and which files it mutates."""

    name: str
    files: dict[str, Any]  # relative path -> JsonDoc | RawFile | Safetensors | Gguf
    entry: str  # relative path given to the target ("" : the tree's root folder)
    mutable: tuple[str, ...]
    run: Callable[[Path], str | None]  # None when the result is sound; else what is wrong with it
    specs: dict[str, FileSpec] = field(default_factory=dict)

    def spec(self, rel: str) -> FileSpec:
        """The file as the fixture has it (computed once)."""
        if rel not in self.specs:
            self.specs[rel] = self.files[rel].spec()
        return self.specs[rel]


def _cut_tekken(data: bytes, listed: bool = False) -> bytes:
    """tekken.json with its 1000 specials and only the first N_RANKS ranks (optionally with a special_tokens
    list, as files of version v7+ have)."""
    doc = json.loads(data)
    doc["vocab"] = doc["vocab"][:N_RANKS]
    config = doc["config"]
    config["default_vocab_size"] = config["default_num_special_tokens"] + N_RANKS
    config["num_vocab_tokens"] = N_RANKS
    doc.pop("image", None)
    if listed:
        from ..tokenizers.vocab import V3_SPECIAL_TOKENS

        config["version"] = "v11"
        doc["special_tokens"] = [{"rank": i, "token_str": s, "is_control": True} for i, s in enumerate(V3_SPECIAL_TOKENS)]
    return json.dumps(doc).encode()


class Fixtures:
    """The tiny fixtures under `root`, read into seed trees on request."""

    def __init__(self, root: Path):
        self.root = root
        from ..tokenizers.ladder import bundled_tekken_path

        self.tekken = _cut_tekken(bundled_tekken_path().read_bytes())
        self.tekken_listed = _cut_tekken(bundled_tekken_path().read_bytes(), listed=True)

    def model(self, rel: str) -> Any:
        path = self.root / rel
        if path.name == "tekken.json":
            return JsonDoc(json.loads(self.tekken))
        if path.suffix == ".json":
            return JsonDoc(json.loads(path.read_bytes()))
        if path.suffix == ".safetensors":
            return Safetensors.read(path, {"tekken_model": self.tekken})
        if path.suffix == ".gguf":
            return self._gguf(path)
        return RawFile(path.read_bytes())

    def _gguf(self, path: Path) -> Gguf:
        from ..tokenizers.vocab import byte_level_string

        vocab = json.loads(self.tekken)
        n_special = vocab["config"]["default_num_special_tokens"]
        ranks = [base64.b64decode(e["token_bytes"]) for e in vocab["vocab"]]
        from ..tokenizers.vocab import V3_SPECIAL_TOKENS

        specials = [*V3_SPECIAL_TOKENS, *(f"<SPECIAL_{i}>" for i in range(len(V3_SPECIAL_TOKENS), n_special))]
        tokens = GArray(G_STRING, specials + [byte_level_string(r) for r in ranks])
        types = GArray(5, [3] * n_special + [1] * len(ranks))
        f16 = struct.pack(f"<{len(self.tekken)}e", *self.tekken)
        return Gguf.read(path, {"tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types,
                                "tokenizer.ggml.merges": GArray(G_STRING, [])}, {"tekken_model": (1, f16)})

    def cache_tree(self) -> Tree:
        """A conditioning cache folder as the cache writes it (its tag, two entries, a fingerprint index and the
        lock), with a file of the user's beside them that it must leave alone."""
        from ..loaders.cache.store import ConditioningCache

        folder = Path(tempfile.mkdtemp(prefix="fuzz-cache-"))
        cache = ConditioningCache(folder)
        for i, key in enumerate(CACHE_KEYS):
            cache.put(key, {"cond": _full((1, 4, 32), float(i))})
        cache.remember_fingerprint(CACHE_SIGNATURE, "f" * 64)
        files: dict[str, Any] = {p.name: RawFile(p.read_bytes()) for p in folder.iterdir()}
        files[CACHE_FINGERPRINTS] = JsonDoc(json.loads(files[CACHE_FINGERPRINTS].data))
        files[USER_FILE] = RawFile(b"a user's model file, which no cache operation may touch\n" * 64)
        shutil.rmtree(folder)
        return Tree("cache", files, "", tuple(sorted(n for n in files if n != USER_FILE)), run_cache_folder)

    def tree(self, name: str, rel: str, run: Callable[[Path], str | None], *, files: tuple[str, ...] = (),
             mutable: tuple[str, ...] | None = None, entry: str | None = None) -> Tree:
        """A tree of the fixture `rel` (a file, or a folder's `files`, all of them by default)."""
        base = self.root / rel
        if base.is_file():
            return Tree(name, {base.name: self.model(rel)}, entry or base.name, (base.name,), run)
        names = files or tuple(sorted(str(p.relative_to(base)) for p in base.rglob("*") if p.is_file()))
        models = {n: self.model(f"{rel}/{n}") for n in names}
        return Tree(name, models, entry if entry is not None else "", mutable or names, run)


# ------------------------------------------------------------------------------------------- targets
# Each run function gets the path to call the entry point with and returns None, or the problem with a
# result that returned normally. Imports are inside: the worker pays for them once, before its first input.


def run_gguf_reader(path: Path) -> None:
    from ..loaders.formats.gguf_file import open_gguf

    with open_gguf(path) as gguf:
        for tensor in gguf.tensors.values():
            tensor.data  # every view can be made


def run_safetensors_header(path: Path) -> None:
    from ..loaders.formats.safetensors_file import read_header

    read_header(str(path))


def _outside(folder: Path, found) -> str | None:
    root = folder.resolve()
    escaped = [str(p) for p in found if not Path(p).resolve().is_relative_to(root)]
    return f"names file(s) outside the model folder: {escaped[:3]}" if escaped else None


def run_shards(weights: str) -> Callable[[Path], str | None]:
    def run(folder: Path) -> str | None:
        from ..loaders.formats.files import shards

        return _outside(folder, shards(folder, weights))

    return run


def run_part_files(folder: Path) -> str | None:
    from ..loaders.formats.files import part_files

    return _outside(folder, part_files(folder, "transformer", "Choose another."))


def _encode(resolution) -> None:
    from ..tokenizers import prompt_ids

    resolution.tokenizer.encode(PROMPT)
    prompt_ids(resolution.tokenizer, PROMPT, "reference")


def run_tekken_ladder(folder: Path) -> None:
    from ..tokenizers import resolve_tokenizer

    _encode(resolve_tokenizer([folder]))


def run_gguf_vocab(path: Path) -> None:
    from ..loaders.formats.gguf_file import open_gguf
    from ..tokenizers import resolve_tokenizer

    with open_gguf(path) as gguf:
        metadata = gguf.metadata
    _encode(resolve_tokenizer(gguf_metadata=metadata))


def run_pipeline_class(folder: Path) -> None:
    from ..loaders.models.pipeline import holds_variant, pipeline_class

    pipeline_class(folder)
    holds_variant(folder, "dev")


def run_plan_encoder(path: Path) -> None:
    from ..loaders.models.encoder import plan_encoder

    plan_encoder(str(path))


def run_inspect(path: Path) -> None:
    from ..loaders.models.inspect import inspect_path

    json.dumps(inspect_path(path))


def run_encoder(path: Path) -> None:
    from ..loaders.models.encoder import load_encoder

    loaded = load_encoder(str(path))
    _encode(loaded.tokenizer)


def run_transformer(path: Path) -> None:
    from ..loaders.models.transformer import load_transformer

    load_transformer(path)


def run_gguf_transformer(path: Path) -> None:
    from ..loaders.models.gguf_transformer import load_gguf_transformer

    load_gguf_transformer(path)


def run_pipeline(folder: Path) -> None:
    from ..loaders.models.pipeline import describe_pipeline, dev_encoder_folder

    describe_pipeline(folder)
    dev_encoder_folder(folder)


def run_prompts_file(path: Path) -> None:
    from ..loaders.formats.files import read_prompts
    from ..tokenizers import prompt_ids, resolve_tokenizer

    tokenizer = resolve_tokenizer().tokenizer  # the bundled vocabulary, built once per worker
    for prompt in dict.fromkeys(read_prompts(path)):  # each distinct prompt: a repeated line costs its reading only
        prompt_ids(tokenizer, prompt, "reference")


USER_FILE = "flux2-dev.safetensors"
CACHE_SIGNATURE = "s" * 64
CACHE_FINGERPRINTS = "fingerprints.json"


def _cache_keys():
    from ..loaders.cache.keys import ConditioningKey

    return [ConditioningKey(weights="0" * 64, layout="comfy-single-file", formats=(("bf16", 3),), settings=(),
                            vocabulary=str(i), padding="reference", tokens=(((1, 1.0),),), dtype="torch.float32",
                            device="cpu", layers=(10, 20, 30), host="fuzz") for i in range(2)]


CACHE_KEYS = _cache_keys()


def _full(shape, value):
    import torch

    return torch.full(shape, value)


def _regular_files(folder: Path) -> dict[str, bytes]:
    """The folder's regular files (not following links, opening nothing else), by name."""
    import stat as stat_

    out = {}
    for item in os.scandir(folder):
        if stat_.S_ISREG(item.stat(follow_symlinks=False).st_mode):
            with open(item.path, "rb") as f:
                out[item.name] = f.read()
    return out


def run_cache_folder(folder: Path) -> str | None:
    """Every cache operation on the folder: open, list, read, look up, prune, store, remember, evict to
    nothing. The user's file must come through byte-identical; the folder is then put back as it was."""
    from ..loaders.cache.store import ConditioningCache

    before = _regular_files(folder)
    try:
        cache = ConditioningCache(folder)
        for entry in cache.entries():
            cache.read(entry)
        cache.known_fingerprint(CACHE_SIGNATURE)
        for key in CACHE_KEYS:
            cache.get(key)
        cache.others()
        cache.prune()
        cache.put(CACHE_KEYS[0], {"cond": _full((1, 2, 8), 7.0)})
        cache.remember_fingerprint("r" * 64, "e" * 64)
        cache.evict(0)
    finally:
        after = _regular_files(folder)
        for name in after.keys() - before.keys():  # what the operations wrote goes again
            os.unlink(folder / name)
        for name, data in before.items():
            if after.get(name) != data:
                (folder / name).unlink(missing_ok=True)
                (folder / name).write_bytes(data)
    if after.get(USER_FILE) != before.get(USER_FILE):
        return f"the user's file {USER_FILE} beside the cache was changed or deleted"
    return None


TE, DM, UNET, DIFF = "text_encoders", "diffusion_models", "unet", "diffusers"
DEV_PIPELINE = f"{DIFF}/flux2-dev-tiny-pipeline"
PIPELINE_FILES = ("model_index.json", "transformer/config.json", "text_encoder/config.json",
                  "transformer/diffusion_pytorch_model.safetensors.index.json",
                  *(f"transformer/diffusion_pytorch_model-0000{i}-of-00009.safetensors" for i in range(1, 10)))
DEV_DIFFUSERS = f"{DM}/flux2-dev-tiny-diffusers"
DIFFUSERS_INDEX = "diffusion_pytorch_model.safetensors.index.json"
HF_INDEX = "model.safetensors.index.json"


def _trees(target: str, fx: Fixtures) -> list[Tree]:
    t = fx.tree
    if target == "gguf-reader":
        return [t(n, f"{UNET}/flux2-dev-tiny-{n}.gguf", run_gguf_reader) for n in ("Q4_K", "Q8_0")] + [
            t(n, f"{TE}/{n}.gguf", run_gguf_reader) for n in ("mistral3-q4_k", "cow-f16")]
    if target == "safetensors-header":
        return [t(n, f"{DM}/{n}.safetensors", run_safetensors_header) for n in ("flux2-dev-tiny", "flux2-dev-tiny-fp8-weight_scale")] + [
            t(n, f"{TE}/{n}.safetensors", run_safetensors_header) for n in ("mistral_3_small_flux2_bf16", "mistral_3_small_flux2_fp4_mixed")]
    if target == "shard-index":
        return [t("diffusers-shards", DEV_DIFFUSERS, run_shards("diffusion_pytorch_model.safetensors"), mutable=(DIFFUSERS_INDEX,)),
                t("transformer-part", DEV_DIFFUSERS, run_part_files, mutable=(DIFFUSERS_INDEX,)),
                t("hf-shards", f"{TE}/hf-mistral3", run_shards("model.safetensors"), mutable=(HF_INDEX,))]
    if target == "tekken-ladder":
        plain = Tree("tekken-v3", {"tekken.json": JsonDoc(json.loads(fx.tekken))}, "", ("tekken.json",), run_tekken_ladder)
        listed = Tree("tekken-v11", {"tekken.json": JsonDoc(json.loads(fx.tekken_listed))}, "", ("tekken.json",), run_tekken_ladder)
        return [plain, listed]
    if target == "gguf-vocab":
        return [t("mistral3-q4_k", f"{TE}/mistral3-q4_k.gguf", run_gguf_vocab)]
    if target == "configs":
        return [t("model_index", DEV_PIPELINE, run_pipeline_class, files=("model_index.json",)),
                t("params", f"{TE}/native", run_plan_encoder, mutable=("params.json",)),
                t("standalone-config", f"{TE}/standalone", run_plan_encoder, mutable=("config.json",)),
                t("hf-config", f"{TE}/hf-mistral3", run_plan_encoder, mutable=("config.json",))]
    if target == "inspect":
        return [t("transformer", f"{DM}/flux2-dev-tiny.safetensors", run_inspect),
                t("diffusers-transformer", DEV_DIFFUSERS, run_inspect),
                t("gguf-transformer", f"{UNET}/flux2-dev-tiny-Q4_K.gguf", run_inspect),
                t("vae", "vae/flux2-ae.safetensors", run_inspect),
                t("encoder", f"{TE}/mistral_3_small_flux2_bf16.safetensors", run_inspect),
                t("gguf-encoder", f"{TE}/mistral3-q4_0.gguf", run_inspect),
                t("pipeline", DEV_PIPELINE, run_inspect, files=PIPELINE_FILES)]
    if target == "encoder":
        return [t(n, f"{TE}/{n}.safetensors", run_encoder) for n in ("mistral_3_small_flux2_bf16", "mistral_3_small_flux2_fp8_channel")] + [
            t(n, f"{TE}/{n}.gguf", run_encoder) for n in ("mistral3-q4_k", "cow-f16", "llama-q8_0")] + [
            t(n, f"{TE}/{n}", run_encoder) for n in ("native", "standalone", "hf-mistral3")]
    if target == "transformer":
        return [t(n, f"{DM}/{n}.safetensors", run_transformer) for n in ("flux2-dev-tiny", "flux2-dev-tiny-fp8-scale_weight")] + [
            t("diffusers", DEV_DIFFUSERS, run_transformer)]
    if target == "gguf-transformer":
        return [t(n, f"{UNET}/{n}.gguf", run_gguf_transformer) for n in ("flux2-dev-tiny-Q4_K", "flux2-dev-tiny-Q8_0", "flux2-klein-4b-tiny-Q8_0")]
    if target == "pipeline":
        return [t("dev-pipeline", DEV_PIPELINE, run_pipeline, files=PIPELINE_FILES)]
    if target == "cache-folder":
        return [fx.cache_tree()]
    if target == "prompts-file":
        prompts = JsonLines([PROMPT, "a lighthouse at dusk, 35mm", "東京の夜景", "x" * 3000, "line\u2028break"])
        return [Tree("prompts", {"prompts.jsonl": prompts}, "prompts.jsonl", ("prompts.jsonl",), run_prompts_file)]
    raise KeyError(target)


# target -> what it calls
TARGETS = {
    "gguf-reader": "loaders.gguf_file.open_gguf (header, metadata, tensor table, every tensor view)",
    "safetensors-header": "loaders.safetensors_file.read_header",
    "shard-index": "loaders.files.shards and part_files on a sharded folder's index",
    "tekken-ladder": "tokenizers.resolve_tokenizer on a folder with tekken.json, then prompt_ids",
    "gguf-vocab": "open_gguf, then resolve_tokenizer with the GGUF's tokenizer.ggml.* metadata, then prompt_ids",
    "configs": "model_index.json (pipeline_class), params.json and config.json (plan_encoder)",
    "inspect": "loaders.inspect.inspect_path on each kind of model",
    "encoder": "loaders.encoder.load_encoder on each encoder layout, then prompt_ids",
    "transformer": "loaders.transformer.load_transformer (BFL file, scaled fp8, diffusers folder)",
    "gguf-transformer": "loaders.gguf_transformer.load_gguf_transformer",
    "pipeline": "loaders.pipeline.describe_pipeline and dev_encoder_folder",
    "cache-folder": "loaders.conditioning_cache: open, list, read, get, prune, put, remember, evict (a user's file beside)",
    "prompts-file": "loaders.files.read_prompts, then prompt_ids of each prompt",
}
LADDER_TARGETS = ("tekken-ladder", "gguf-vocab", "inspect", "encoder", "prompts-file")


# ------------------------------------------------------------------------------------------- one input


@dataclass
class Case:
    tree: Tree
    rel: str  # the file changed
    notes: list[str]
    spec: FileSpec | None = None  # its new content, or
    kind: str | None = None  # its new kind (FILE_KINDS)


def make_case(target: str, trees: list[Tree], seed: int, index: int) -> Case:
    """Input `index` of `seed`: index < 0 is tree -1-index unchanged (the seed itself)."""
    if index < 0:
        tree = trees[-1 - index]
        return Case(tree, tree.mutable[0], ["unchanged"], tree.spec(tree.mutable[0]))
    rng = random.Random(f"{target}/{seed}/{index}")
    tree = rng.choice(trees)
    rel = rng.choice(tree.mutable)
    model = tree.files[rel]
    notes: list[str] = []
    if rng.random() < 0.01:
        kind = rng.choice(FILE_KINDS)
        return Case(tree, rel, [f"file kind: {kind}"], kind=kind)
    structured = not isinstance(model, RawFile) and rng.random() < 0.65
    if structured:
        value, text = getattr(model, "value", None), None
        for _ in range(rng.choice((1, 1, 1, 2, 3))):
            if isinstance(model, Gguf):
                model = mutate_gguf(model, rng, notes)
            elif isinstance(model, Safetensors) and model.text is None:
                model = mutate_safetensors(model, rng, notes)
            elif isinstance(model, JsonDoc):
                value, text = mutate_json(value, rng, notes)
            elif isinstance(model, JsonLines):
                model = mutate_lines(model, rng, notes)
        if text is not None:
            model = RawFile(text.encode("utf-8", "surrogatepass"))
    spec = model.spec()
    if not structured or rng.random() < 0.15:
        for _ in range(rng.choice((1, 1, 2, 4))):
            spec = mutate_bytes(spec, rng, notes)
    return Case(tree, rel, notes, spec)


def _memory() -> tuple[int, int]:
    """(current, peak) resident memory of this process, bytes."""
    status = Path("/proc/self/status").read_text()
    rss, hwm = (int(re.search(rf"{k}:\s+(\d+)", status)[1]) << 10 for k in ("VmRSS", "VmHWM"))
    return rss, hwm


def _site(exc: BaseException) -> str:
    """Where the exception was raised: the pack's innermost frame, and the innermost frame if elsewhere."""
    pack = str(Path(__file__).resolve().parents[1])
    frames = traceback.extract_tb(exc.__traceback__)
    own = [f for f in frames if os.path.realpath(f.filename).startswith(pack) and "devtools" not in f.filename]
    parts = []
    if own:
        f = own[-1]
        parts.append(f"{os.path.relpath(os.path.realpath(f.filename), pack)}:{f.lineno} ({f.name})")
    if frames and (not own or frames[-1] is not own[-1]):
        f = frames[-1]
        name = f.filename.split("site-packages/")[-1] if "site-packages/" in f.filename else os.path.basename(f.filename)
        parts.append(f"{name}:{f.lineno} ({f.name})")
    return " > ".join(parts) or "?"


def run_case(case: Case, root: Path, stamp: int, started: Callable[[], None] = lambda: None) -> dict:
    """Apply the case under `root` (the tree's copy), call the target, restore; the verdict as a dict."""
    from ..errors import Flux2DevError

    tree_root = root / case.tree.name
    path = tree_root / case.rel
    if case.kind is not None:
        write_kind(path, case.kind)
    else:
        case.spec.write(path)
        # A distinct mtime per input: caches keyed on (path, mtime, size) never mistake one input for another.
        os.utime(path, ns=(stamp, stamp))
    size = case.spec.written if case.spec is not None else 0
    try:
        Path("/proc/self/clear_refs").write_text("5")  # the peak (VmHWM) restarts from here
    except OSError:
        pass  # a kernel without it: the peak is the worker's, still bounded by RLIMIT_AS
    before, _ = _memory()
    cpu = time.process_time()
    verdict: dict = {"ok": True}
    started()
    try:
        problem = case.tree.run(tree_root / case.tree.entry)
        if problem:
            verdict = {"ok": False, "kind": "wrong result", "type": "-", "message": problem, "site": case.tree.name}
    except Flux2DevError as e:
        text = str(e)
        leak = next((m for m in LEAKS if m in text), None)
        if leak:
            verdict = {"ok": False, "kind": "leak", "type": type(e).__name__, "message": text[:400],
                       "site": f"the error text quotes a file outside the model folder ({leak!r})"}
    except KeyboardInterrupt:
        raise
    except BaseException as e:  # noqa: BLE001 - the tokenizers library's PanicException is a BaseException
        verdict = {"ok": False, "kind": "exception", "type": f"{type(e).__module__}.{type(e).__qualname__}".removeprefix("builtins."),
                   "message": " ".join(str(e).split())[:400], "site": _site(e)}
    _, peak = _memory()
    growth = peak - before
    verdict["cpu_s"] = time.process_time() - cpu
    verdict["peak_mib"] = growth >> 20
    if verdict["ok"] and growth > MEMORY_SLACK + MEMORY_PER_BYTE * size:
        verdict = {**verdict, "ok": False, "kind": "memory", "type": "-", "site": case.tree.name,
                   "message": f"peak memory grew by {growth >> 20} MiB for a {size >> 20} MiB input"}
    # Back to the seed for the next input.
    case.tree.spec(case.rel).write(path)
    os.utime(path, ns=(1, 1))
    return verdict


# ------------------------------------------------------------------------------------------- workers


def _write_tree(tree: Tree, root: Path) -> None:
    for rel in tree.files:
        path = root / tree.name / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        tree.spec(rel).write(path)
        os.utime(path, ns=(1, 1))


def _worker(conn, target: str, trees: list[Tree], seed: int, root: Path) -> None:
    try:
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: the worker dies with the harness
        if "torch" in sys.modules:  # imported by prepare(), before the fork
            sys.modules["torch"].set_num_threads(1)
        root.mkdir(parents=True, exist_ok=True)
        (root / "canary").write_bytes(CANARY + b" a file outside every model folder\n")
        for tree in trees:
            _write_tree(tree, root)
        if target in LADDER_TARGETS:
            # Fixed costs of the worker, not of the input that first reaches them: the bundled vocabulary (the
            # ladder's last local rung, built once per process) and transformers' tokenizer modules.
            import transformers

            from ..tokenizers import resolve_tokenizer

            resolve_tokenizer()
            for probe in ("AutoProcessor", "AutoTokenizer", "PreTrainedTokenizerFast"):
                getattr(transformers, probe)
        soft, hard = resource.getrlimit(resource.RLIMIT_AS)
        size = int(re.search(r"VmSize:\s+(\d+)", Path("/proc/self/status").read_text())[1]) << 10
        limit = size + ADDRESS_SPACE_MARGIN
        resource.setrlimit(resource.RLIMIT_AS, (limit if hard == resource.RLIM_INFINITY else min(limit, hard), hard))
        conn.send("ready")
        while True:
            index = conn.recv()
            if index is None:
                break
            try:
                case = make_case(target, trees, seed, index)
            except Exception as e:  # a bug of the harness: reported, never mistaken for the pack's
                conn.send({"ok": False, "kind": "harness error", "type": type(e).__name__, "message": str(e)[:300],
                           "site": _site(e)})
                continue
            conn.send(run_case(case, root, 10**9 + index + 2, lambda: conn.send("started")))
    except (EOFError, KeyboardInterrupt):
        pass
    finally:
        os._exit(0)


def _cpu_seconds(pid: int) -> tuple[float, str]:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0, "?"
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"), fields[0]


@dataclass
class Worker:
    process: Any
    conn: Any
    index: int | None = None
    running: bool = False  # the input is written and the entry point runs: the limits apply from here
    started: float = 0.0
    cpu0: float = 0.0
    idle_since: float = 0.0
    idle_cpu: float = 0.0


@dataclass
class Report:
    target: str
    seed: int
    inputs: int
    seconds: float = 0.0
    failures: list[dict] = field(default_factory=list)

    def groups(self) -> dict[tuple[str, str, str], list[dict]]:
        out: dict = {}
        for f in self.failures:
            out.setdefault((f["kind"], f["type"], f["site"]), []).append(f)
        return out

    def summary(self) -> str:
        lines = [f"{self.target}: {self.inputs} inputs (seed {self.seed}) in {self.seconds:.0f} s, "
                 f"{len(self.failures)} failure(s)"]
        for (kind, exc, site), found in sorted(self.groups().items(), key=lambda kv: -len(kv[1])):
            first = found[0]
            lines.append(f"  {len(found):5d} x {kind}: {exc} at {site}: {first['message'][:200]}")
            lines.append(f"          e.g. index {first['index']} ({first['tree']}/{first['file']}: "
                         f"{'; '.join(first['notes'])[:200]}) input: {first.get('saved', '-')}")
        return "\n".join(lines)


class Fuzzer:
    def __init__(self, target: str, trees: list[Tree], seed: int, out: Path, jobs: int, cpu_limit: float,
                 log: Callable[[str], None] = print):
        self.target, self.seed, self.out, self.jobs, self.cpu_limit, self.log = target, seed, out, jobs, cpu_limit, log
        self.trees = trees
        self.scratch = Path(tempfile.mkdtemp(prefix=f"fuzz-{target}-"))
        self.workers: list[Worker | None] = [None] * jobs
        self.context = multiprocessing.get_context("fork")

    def _start(self, slot: int) -> Worker:
        parent, child = self.context.Pipe()
        root = self.scratch / f"w{slot}-{time.monotonic_ns()}"
        process = self.context.Process(target=_worker, args=(child, self.target, self.trees, self.seed, root), daemon=True)
        process.start()
        child.close()
        if not parent.poll(120) or parent.recv() != "ready":
            raise RuntimeError(f"fuzz worker for {self.target} did not start")
        worker = Worker(process, parent)
        self.workers[slot] = worker
        return worker

    def _stop(self, slot: int) -> None:
        worker = self.workers[slot]
        if worker is not None:
            worker.process.kill()
            worker.process.join()
            worker.conn.close()
            self.workers[slot] = None

    def _record(self, report: Report, index: int, verdict: dict) -> None:
        failure = {"target": self.target, "seed": self.seed, "index": index, "tree": "?", "file": "?", "notes": [],
                   "saved": "", **verdict}
        if verdict["kind"] != "harness error":
            case = make_case(self.target, self.trees, self.seed, index)
            failure.update(tree=case.tree.name, file=case.rel, notes=case.notes)
            folder = self.out / f"{self.target}-seed{self.seed}-{index if index >= 0 else 'unchanged' + str(-1 - index)}"
            failure["saved"] = str(save_input(case, folder, failure))
        report.failures.append(failure)
        self.log(f"FAIL {self.target} seed {self.seed} index {index}: {verdict['kind']} {verdict['type']}: "
                 f"{verdict['message'][:300]} [{verdict['site']}] input: {failure['saved']}")

    def run(self, indices) -> Report:
        indices = list(indices)
        report = Report(self.target, self.seed, sum(1 for i in indices if i >= 0))
        start = time.monotonic()
        pending = list(reversed(indices))
        try:
            while pending or any(w is not None and w.index is not None for w in self.workers):
                for slot in range(self.jobs):
                    worker = self.workers[slot]
                    if pending and (worker is None or worker.index is None):
                        worker = worker or self._start(slot)
                        worker.index, worker.running = pending.pop(), False
                        worker.started = worker.idle_since = time.monotonic()
                        worker.cpu0 = worker.idle_cpu = _cpu_seconds(worker.process.pid)[0]
                        worker.conn.send(worker.index)
                busy = [w.conn for w in self.workers if w is not None and w.index is not None]
                ready = wait(busy, timeout=0.25)
                now = time.monotonic()
                for slot in range(self.jobs):
                    worker = self.workers[slot]
                    if worker is None or worker.index is None:
                        continue
                    if worker.conn in ready:
                        try:
                            verdict = worker.conn.recv()
                            if verdict == "started":  # the input is written: its time starts now
                                worker.running = True
                                worker.started = worker.idle_since = now
                                worker.cpu0 = worker.idle_cpu = _cpu_seconds(worker.process.pid)[0]
                                continue
                        except (EOFError, OSError):
                            code = worker.process.join(1) or worker.process.exitcode
                            verdict = {"ok": False, "kind": "crash", "type": f"exit {code}", "site": "worker",
                                       "message": "the worker process died (a signal such as SIGBUS/SIGSEGV, or the OOM killer)"}
                        index, worker.index = worker.index, None
                        if not verdict["ok"]:
                            self._stop(slot)
                            self._record(report, index, verdict)
                        continue
                    cpu, state = _cpu_seconds(worker.process.pid)
                    if cpu - worker.idle_cpu > 0.05:
                        worker.idle_since, worker.idle_cpu = now, cpu
                    problem = None
                    # Writing a huge input costs the harness, not the entry point: only the wall clock bounds it.
                    if worker.running and cpu - worker.cpu0 > self.cpu_limit:
                        problem = ("slow", f"more than {self.cpu_limit:g} s of CPU")
                    elif now - worker.started > WALL_LIMIT_S:
                        problem = ("hang", f"no answer after {WALL_LIMIT_S:g} s")
                    elif worker.running and state in ("S", "D") and now - worker.idle_since > BLOCKED_S:
                        problem = ("hang", f"blocked for {BLOCKED_S:g} s without using CPU")
                    if problem:
                        index = worker.index
                        self._stop(slot)
                        self._record(report, index, {"ok": False, "kind": problem[0], "type": "-", "site": "-",
                                                     "message": problem[1]})
        finally:
            for slot in range(self.jobs):
                if self.workers[slot] is not None:
                    self.workers[slot].conn.send(None)
                self._stop(slot)
            shutil.rmtree(self.scratch, ignore_errors=True)
        report.seconds = time.monotonic() - start
        return report


def save_input(case: Case, folder: Path, verdict: dict) -> Path:
    """The input as a file (the changed file at its place in the tree) and what happened, under `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / case.tree.name / case.rel
    path.parent.mkdir(parents=True, exist_ok=True)
    if case.kind is None:
        case.spec.write(path)
    (folder / "failure.json").write_text(json.dumps({**verdict, "rebuild": "the other files of the tree are the "
                                                     "tiny fixture's, rebuilt by devtools/fuzz.py"}, indent=1, default=str))
    return path


def fuzz_target(target: str, fixtures: Fixtures | list[Tree], *, inputs: int, seed: int, out: Path, jobs: int = 2,
                cpu_limit: float = CPU_LIMIT_S, log: Callable[[str], None] = print) -> Report:
    """Every seed tree unchanged (each must pass), then `inputs` mutated inputs. `fixtures` may also be the
    trees themselves (the tests' own)."""
    trees = _trees(target, fixtures) if isinstance(fixtures, Fixtures) else fixtures
    fuzzer = Fuzzer(target, trees, seed, out, jobs, cpu_limit, log)
    return fuzzer.run([-1 - k for k in range(len(trees))] + list(range(inputs)))


def reproduce(target: str, fixtures: Fixtures, seed: int, index: int, out: Path) -> int:
    """One input in this process, its traceback shown; the input is written under `out`."""
    trees = _trees(target, fixtures)
    case = make_case(target, trees, seed, index)
    root = Path(tempfile.mkdtemp(prefix="fuzz-one-"))
    (root / "canary").write_bytes(CANARY + b"\n")
    for tree in trees:
        _write_tree(tree, root)
    print(f"{target} seed {seed} index {index}: {case.tree.name}/{case.rel}: {'; '.join(case.notes)}")
    from ..errors import Flux2DevError

    tree_root = root / case.tree.name
    if case.kind:
        write_kind(tree_root / case.rel, case.kind)
    else:
        case.spec.write(tree_root / case.rel)
    try:
        problem = case.tree.run(tree_root / case.tree.entry)
        print(f"returned normally{': ' + problem if problem else ''}")
    except Flux2DevError as e:
        print(f"refused with {type(e).__name__}: {e}")
    except BaseException:  # noqa: BLE001
        traceback.print_exc()
    print("input:", save_input(case, out / f"{target}-seed{seed}-{index}", {"notes": case.notes}))
    shutil.rmtree(root, ignore_errors=True)
    return 0


def prepare(fixtures: str | None) -> Fixtures:
    """The process's setup before any worker forks: tiny models known, tokenizers single-threaded, the
    bundled tokenizer built once (every worker inherits it), the loaders imported."""
    from .tiny.geometry import test_models_env

    os.environ.update(test_models_env())
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    os.environ["RAYON_NUM_THREADS"] = "1"
    os.environ["HF_HUB_OFFLINE"] = "1"
    if fixtures is None:
        from . import tiny

        fixtures = tempfile.mkdtemp(prefix="fuzz-tiny-")
        print(f"writing the tiny fixtures to {fixtures} (pass --fixtures to reuse them)")
        tiny.write_all(fixtures)
    from ..loaders.models import encoder, gguf_transformer, inspect, pipeline, transformer
    from ..tokenizers import resolve_tokenizer

    resolve_tokenizer()
    return Fixtures(Path(fixtures))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m comfyui_flux2dev.devtools fuzz", description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", action="append", choices=sorted(TARGETS), help="repeatable; default: all")
    parser.add_argument("--inputs", type=int, default=QUICK_INPUTS, help=f"per target (default {QUICK_INPUTS})")
    parser.add_argument("--long", action="store_true", help=f"{LONG_INPUTS} inputs per target")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--index", type=int, help="run this one input in this process and show its traceback")
    parser.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1))
    parser.add_argument("--cpu", type=float, default=CPU_LIMIT_S, help="CPU seconds one input may take")
    parser.add_argument("--fixtures", help="a folder written by the dev tools' `tiny` (default: write one to a temp dir)")
    parser.add_argument("--out", help=f"where failing inputs go (default ${OUT_ENV} or a temp dir)")
    parser.add_argument("--json", help="write the reports here as JSON")
    args = parser.parse_args(argv)
    out = Path(args.out or os.environ.get(OUT_ENV) or tempfile.mkdtemp(prefix="flux2dev-fuzz-"))
    fixtures = prepare(args.fixtures)
    targets = args.target or list(TARGETS)
    if args.index is not None:
        return reproduce(targets[0], fixtures, args.seed, args.index, out)
    inputs = LONG_INPUTS if args.long else args.inputs
    reports = []
    for target in targets:
        report = fuzz_target(target, fixtures, inputs=inputs, seed=args.seed, out=out, jobs=args.jobs, cpu_limit=args.cpu)
        print(report.summary(), flush=True)
        reports.append(report)
    if args.json:
        Path(args.json).write_text(json.dumps([r.__dict__ for r in reports], indent=1, default=str))
    total = sum(len(r.failures) for r in reports)
    print(f"{len(reports)} target(s), {sum(r.inputs for r in reports)} inputs, {total} failure(s); inputs under {out}")
    return 1 if total else 0

