"""The pack's own GGUF reader: header, metadata and tensor table parsed once, with direct reads over a
memory map, and tensors handed out as zero-copy uint8 views of the mapped file.

gguf.GGUFReader walks every metadata array element by element (8-12 s for a Mistral-sized tokenizer
header); here numeric arrays are one numpy view and string arrays one walk over their length prefixes
plus a single bulk UTF-8 decode. Every count, length and offset is checked against the file size and
against what real files hold before it is used, so a truncated or hostile file raises CorruptFileError
quickly and in bounded memory. The metadata values the pack computes with are declared once
(METADATA_FIELDS) and checked here, so every consumer can trust their types and ranges.
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from ...errors import CorruptFileError, UnsupportedFormatError
from .validate import Field, check_field, file_identity, map_file, mapped_bytes, open_regular

if TYPE_CHECKING:  # for the annotations only: torch and gguf are imported where they are used
    import torch
    from gguf import GGMLQuantizationType

_MAGIC = b"GGUF"
_START_BYTES = 24  # magic, version, tensor count, metadata count
_VERSIONS = (2, 3)
_DEFAULT_ALIGNMENT = 32
_ALIGNMENTS = (8, 1 << 16)  # the spec asks for a multiple of 8; real files use 32
_MAX_DIMS = 4  # GGML_MAX_DIMS

# What real files hold, with wide margins; anything beyond is damage or hostility, refused before it is
# materialised. A Mistral-Small GGUF has ~40 metadata keys, 131072 tokens, ~270k merges, no nested arrays
# and a few hundred tensors; a FLUX.2 transformer about 1,500 tensors.
_MAX_KEYS = 1 << 16
_MAX_TENSORS = 1 << 17
_MAX_NAME = 1 << 16  # bytes of a key or tensor name (the spec's bound)
_MAX_STRING = 16 << 20  # bytes of one string value (chat templates are tens of KiB)
_MAX_ARRAY_ITEMS = 1 << 21  # items of one array
_MAX_ARRAY_DEPTH = 2  # an array of arrays at most
# Strings the metadata may turn into, over all keys: each costs ~60 bytes however short it is in the file,
# so their number is bounded, not only the file size. Nested arrays cost a parse call and a numpy array
# each, and real files have none: a few thousand at most.
_MAX_STRINGS = 1 << 21
_MAX_NESTED_ARRAYS = 1 << 12

# GGUF value type -> numpy dtype of its scalar (little-endian), per the GGUF spec.
_SCALARS = {
    0: np.dtype("<u1"), 1: np.dtype("<i1"), 2: np.dtype("<u2"), 3: np.dtype("<i2"),
    4: np.dtype("<u4"), 5: np.dtype("<i4"), 6: np.dtype("<f4"), 7: np.dtype("?"),
    10: np.dtype("<u8"), 11: np.dtype("<i8"), 12: np.dtype("<f8"),
}
_STRING, _ARRAY = 8, 9

_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_SEPARATOR = 0xFF  # never valid in UTF-8, so it can split one bulk decode into the array's strings

_parse_count = 0


def parse_count() -> int:
    """How many GGUF headers this process has parsed (a load must parse each file exactly once)."""
    return _parse_count


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    qtype: GGMLQuantizationType
    shape: tuple[int, ...]  # torch order: GGUF stores dims innermost first
    offset: int  # absolute byte offset in the file
    nbytes: int
    _file: GGUFFile = field(repr=False, compare=False)

    @property
    def data(self) -> torch.Tensor:
        """The raw bytes, a zero-copy uint8 view of the mapped file."""
        return self._file._bytes(self.offset, self.nbytes)


class GGUFFile:
    """One parsed GGUF file. Each tensor read is a view of the file's one map (validate.map_file), of this very file
    (not of whatever is at its name later); the file stays open, once, while any view lives."""

    def __init__(self, path: str, identity: tuple, metadata: dict, tensors: dict[str, GGUFTensor]):
        self.path = path
        self.metadata = metadata
        self.tensors = tensors
        self._identity = identity  # validate.file_identity of the file parsed
        self._closed = False

    @property
    def architecture(self) -> str | None:
        return self.metadata.get("general.architecture")

    def _bytes(self, offset: int, nbytes: int) -> torch.Tensor:
        if self._closed:
            raise ValueError(f"{self.path} is closed.")
        mapped = map_file(self.path, self._identity, offset + nbytes, "GGUF file")
        return mapped_bytes(mapped, self.path, offset, offset + nbytes, "GGUF file")

    def close(self) -> None:
        """No more tensors are read through this object; those read earlier keep the file's map while they live."""
        self._closed = True

    def __enter__(self) -> GGUFFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _Cursor:
    """Bounds-checked little-endian reads over the mapped bytes."""

    def __init__(self, path: str, buf, size: int | None = None):
        self.path = path
        self.buf = buf
        self.size = len(buf) if size is None else size  # of the file, when buf holds only its first bytes
        self.pos = 0
        self.made = {"strings": 0, "nested arrays": 0}  # materialised so far, over all keys

    def charge(self, n: int, kind: str, limit: int, what: str) -> None:
        self.made[kind] += n
        if self.made[kind] > limit:
            raise self.fail(f"{what} takes the metadata past {limit} {kind}, more than any real file holds")

    def fail(self, problem: str) -> CorruptFileError:
        return CorruptFileError(
            f"{self.path} is not a readable GGUF file: {problem} (at byte {self.pos} of {self.size}). "
            "The file is truncated or damaged; download it again."
        )

    def need(self, n: int, what: str) -> None:
        if n > self.size - self.pos:
            raise self.fail(f"{what} needs {n} bytes but only {self.size - self.pos} remain")

    def u32(self, what: str) -> int:
        self.need(4, what)
        (v,) = _U32.unpack_from(self.buf, self.pos)
        self.pos += 4
        return v

    def u64(self, what: str) -> int:
        self.need(8, what)
        (v,) = _U64.unpack_from(self.buf, self.pos)
        self.pos += 8
        return v

    def string(self, what: str, limit: int = _MAX_STRING) -> str:
        n = self.u64(what)
        if n > limit:
            raise self.fail(f"{what} claims {n} bytes, more than any real file holds ({limit} at most)")
        self.need(n, what)
        raw = self.buf[self.pos : self.pos + n]
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise self.fail(f"{what} is not valid UTF-8") from None

    def value(self, vtype: int, what: str, depth: int = 0):
        if vtype == _STRING:
            return self.string(what)
        if vtype == _ARRAY:
            return self.array(what, depth)
        dtype = _SCALARS.get(vtype)
        if dtype is None:
            raise self.fail(f"{what} has unknown value type {vtype}")
        self.need(dtype.itemsize, what)
        v = np.frombuffer(self.buf, dtype, 1, self.pos)[0].item()
        self.pos += dtype.itemsize
        return v

    def array(self, what: str, depth: int):
        if depth >= _MAX_ARRAY_DEPTH:
            raise self.fail(f"{what} nests arrays more than {_MAX_ARRAY_DEPTH} deep")
        itype = self.u32(what)
        count = self.u64(what)
        if count > _MAX_ARRAY_ITEMS:
            raise self.fail(f"{what} claims {count} items, more than any real file holds ({_MAX_ARRAY_ITEMS} at most)")
        if itype == _STRING:
            return self.string_array(count, what)
        dtype = _SCALARS.get(itype)
        if dtype is not None:
            self.need(count * dtype.itemsize, f"{what} ({count} items)")
            # A copy, so no numpy view pins the map open.
            values = np.frombuffer(self.buf, dtype, count, self.pos).copy()
            self.pos += count * dtype.itemsize
            return values
        if itype == _ARRAY:
            self.need(count * 12, f"{what} ({count} nested arrays)")  # each holds at least a type and a count
            self.charge(count, "nested arrays", _MAX_NESTED_ARRAYS, what)
            return [self.array(what, depth + 1) for _ in range(count)]
        raise self.fail(f"{what} is an array of unknown value type {itype}")

    def string_array(self, count: int, what: str) -> list[str]:
        self.need(count * 8, f"{what} ({count} strings)")
        self.charge(count, "strings", _MAX_STRINGS, what)
        if count == 0:
            return []
        # Walk the length prefixes (each one decides where the next starts), then decode every string
        # at once: the bytes are joined with 0xFF, which UTF-8 never contains, and split after decoding.
        buf, size, start = self.buf, self.size, self.pos
        unpack = _U64.unpack_from
        prefixes = np.zeros(count, dtype=np.int64)  # 8 bytes an item, not a Python int's 36
        starts = memoryview(prefixes)
        pos = start
        for i in range(count):
            if pos + 8 > size:
                self.pos = pos
                raise self.fail(f"{what} is cut short after {i} of {count} strings")
            starts[i] = pos
            pos += 8 + unpack(buf, pos)[0]
        if pos > size:
            self.pos = int(prefixes[-1])
            raise self.fail(f"{what}: string {count - 1} runs past the end of the file")
        region = np.frombuffer(buf, np.uint8, pos - start, start).copy()
        rel = prefixes - start
        region[rel[1:]] = _SEPARATOR
        keep = np.ones(region.size, dtype=bool)
        for i in range(8):  # per byte of the prefix: one index array of `count`, not eight
            keep[rel + i] = False
        keep[rel[1:]] = True
        text = region[keep].tobytes().decode("utf-8", "surrogateescape")
        strings = text.split("\udcff")
        # Any other escaped byte (or a stray 0xFF) means invalid UTF-8 inside a string.
        if len(strings) != count or not _is_clean(text):
            self.pos = start
            raise self.fail(f"{what} holds strings that are not valid UTF-8")
        self.pos = pos
        return strings


def _is_clean(text: str) -> bool:
    try:
        text.replace("\udcff", "").encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


# The metadata the pack computes with ("{arch}." is general.architecture's prefix, checked for the
# architectures the caller reads settings of). Every key is optional here (its reader says what a missing one
# means); present ones must be what the spec says they are.
_ARCH = "{arch}."
METADATA_FIELDS: dict[str, Field] = {
    "general.architecture": Field(str, max_len=64, required=False),
    "general.alignment": Field(int, lo=_ALIGNMENTS[0], hi=_ALIGNMENTS[1], required=False),
    _ARCH + "block_count": Field(int, lo=1, hi=1024, required=False),
    _ARCH + "context_length": Field(int, lo=1, hi=1 << 32, required=False),
    _ARCH + "embedding_length": Field(int, lo=1, hi=1 << 20, required=False),
    _ARCH + "feed_forward_length": Field(int, lo=1, hi=1 << 22, required=False),
    _ARCH + "attention.head_count": Field(int, lo=1, hi=1024, required=False),
    _ARCH + "attention.head_count_kv": Field(int, lo=1, hi=1024, required=False),
    _ARCH + "attention.key_length": Field(int, lo=1, hi=1 << 16, required=False),
    _ARCH + "attention.layer_norm_rms_epsilon": Field(float, lo=0, hi=1, required=False),
    _ARCH + "rope.freq_base": Field(float, lo=1, hi=1e12, required=False),
    "tokenizer.ggml.model": Field(str, max_len=64, required=False),
    "tokenizer.ggml.pre": Field(str, max_len=64, required=False),
}
# Arrays the pack reads: their element kind ("string" or "integer"); tokenizer.ggml.token_type must match
# the tokens in length.
METADATA_ARRAYS = {"tokenizer.ggml.tokens": "string", "tokenizer.ggml.merges": "string",
                   "tokenizer.ggml.token_type": "integer"}


def check_metadata(path: str, metadata: dict, architectures: frozenset[str] = frozenset()) -> None:
    """Refuse metadata whose declared keys hold the wrong kind of value (an array where a number belongs,
    a head count of 0, a float alignment, token types that are strings ...). The "{arch}." settings are
    checked only for the `architectures` whose settings the caller reads."""
    where = f"{path} (GGUF metadata)"
    for template, spec in METADATA_FIELDS.items():  # general.architecture first: the other keys start with it
        arch = metadata.get("general.architecture")
        if template.startswith(_ARCH) and arch not in architectures:
            continue  # another model's settings: the caller reads none of them (it names the model instead)
        key = template.format(arch=arch)
        if key in metadata:
            check_field(metadata[key], spec, where, key)
    for key, kind in METADATA_ARRAYS.items():
        value = metadata.get(key)
        if value is None:
            continue
        if kind == "string":
            ok = isinstance(value, list) and all(isinstance(item, str) for item in value)
        else:
            ok = isinstance(value, np.ndarray) and value.dtype.kind in "iu"
        if not ok:
            raise CorruptFileError(f"{where}: {key} is not an array of {kind}s; the file is damaged, "
                                   "download it again.")
    tokens, types = metadata.get("tokenizer.ggml.tokens"), metadata.get("tokenizer.ggml.token_type")
    if tokens is not None and types is not None and len(tokens) != len(types):
        raise CorruptFileError(f"{where}: {len(tokens)} tokens but {len(types)} token types; download the file again.")


def open_gguf(path: str | os.PathLike, architectures: frozenset[str] = frozenset()) -> GGUFFile:
    """Parse one GGUF file's header, metadata and tensor table (once) over a memory map; the settings of
    `architectures` (those the caller reads) are checked too."""
    global _parse_count
    path = os.fspath(path)
    with open_regular(path, "GGUF file") as (f, size):
        if size < _START_BYTES:
            raise CorruptFileError(f"{path} is too short to be a GGUF file ({size} bytes).")
        identity = file_identity(f)
        # The header is parsed over a map of its own, closed once parsed (or refused), even while a refusal and the
        # frames that saw the map are kept. Read-only: it costs no commit, whatever the file's size.
        header = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        metadata, tensors = _parse(path, header)
        check_metadata(path, metadata, architectures)
    finally:
        header.close()  # the metadata holds copies, no views of it
    _parse_count += 1
    gfile = GGUFFile(path, identity, metadata, {})
    gfile.tensors.update(
        (name, GGUFTensor(name, qtype, shape, offset, nbytes, gfile))
        for name, (qtype, shape, offset, nbytes) in tensors.items()
    )
    return gfile


def check_start(path: str | os.PathLike) -> None:
    """The checks of a GGUF file's first bytes (magic, version, counts against its size), without mapping or
    parsing the rest: what the command line asks before it imports torch, so a bad file is refused at once."""
    path = os.fspath(path)
    with open_regular(path, "GGUF file") as (f, size):
        head = f.read(_START_BYTES)
    if size < _START_BYTES:
        raise CorruptFileError(f"{path} is too short to be a GGUF file ({size} bytes).")
    _start(_Cursor(path, head, size))


def _start(cur: _Cursor) -> tuple[int, int]:
    """(tensor count, metadata count) from the file's first bytes, each checked."""
    if cur.buf[:4] != _MAGIC:
        raise CorruptFileError(f"{cur.path} is not a GGUF file (it does not start with 'GGUF').")
    cur.pos = 4
    version = cur.u32("version")
    if version & 0xFFFF == 0 and version:
        raise UnsupportedFormatError(f"{cur.path} is a big-endian GGUF file; only little-endian files are supported.")
    if version not in _VERSIONS:
        raise UnsupportedFormatError(f"{cur.path} is GGUF version {version}; supported versions are {_VERSIONS}.")
    n_tensors = cur.u64("tensor count")
    n_kv = cur.u64("metadata count")
    # Each entry takes at least 12 (key/value) or 24 (tensor) bytes: larger counts cannot fit the file.
    if n_kv * 13 > cur.size - cur.pos or n_kv > _MAX_KEYS:
        raise cur.fail(f"it claims {n_kv} metadata entries, more than the file can hold or any real file has")
    if n_tensors * 24 > cur.size - cur.pos or n_tensors > _MAX_TENSORS:
        raise cur.fail(f"it claims {n_tensors} tensors, more than the file can hold or any real file has")
    return n_tensors, n_kv


def _parse(path: str, buf: mmap.mmap):
    from gguf import GGML_QUANT_SIZES

    cur = _Cursor(path, buf)
    n_tensors, n_kv = _start(cur)

    metadata: dict = {}
    for _ in range(n_kv):
        key = cur.string("metadata key", _MAX_NAME)
        if key in metadata:
            raise cur.fail(f"metadata key {key!r} appears twice")
        metadata[key] = cur.value(cur.u32(f"type of {key!r}"), repr(key))

    infos = []
    for _ in range(n_tensors):
        name = cur.string("tensor name", _MAX_NAME)
        n_dims = cur.u32(f"dims of tensor {name!r}")
        if not 1 <= n_dims <= _MAX_DIMS:
            raise cur.fail(f"tensor {name!r} claims {n_dims} dimensions (1 to {_MAX_DIMS})")
        dims = [cur.u64(f"dims of tensor {name!r}") for _ in range(n_dims)]
        if 0 in dims:
            raise cur.fail(f"tensor {name!r} has a dimension of 0 ({dims})")
        raw_type = cur.u32(f"type of tensor {name!r}")
        offset = cur.u64(f"offset of tensor {name!r}")
        infos.append((name, dims, raw_type, offset))

    alignment = metadata.get("general.alignment", _DEFAULT_ALIGNMENT)
    check_field(alignment, METADATA_FIELDS["general.alignment"], f"{path} (GGUF metadata)", "general.alignment")
    if alignment & (alignment - 1):
        raise cur.fail(f"general.alignment is {alignment}, not a power of two")
    data_start = -(-cur.pos // alignment) * alignment

    tensors: dict = {}
    for name, dims, raw_type, offset in infos:
        if name in tensors:
            raise cur.fail(f"tensor {name!r} appears twice")
        qtype = _quant_type(path, name, raw_type)
        block_size, type_size = GGML_QUANT_SIZES[qtype]
        n_elements = 1
        for d in dims:
            n_elements *= d
        row = dims[0] if dims else 1
        if row % block_size:
            raise cur.fail(f"tensor {name!r} ({qtype.name}) has rows of {row}, not a multiple of its block size "
                           f"{block_size}")
        nbytes = n_elements // block_size * type_size
        if offset % alignment:
            raise cur.fail(f"tensor {name!r} starts at offset {offset}, not a multiple of the alignment {alignment}")
        start = data_start + offset
        if start + nbytes > cur.size:
            raise cur.fail(f"tensor {name!r} ({nbytes} bytes at {start}) runs past the end of the file")
        tensors[name] = (qtype, tuple(reversed(dims)), start, nbytes)

    spans = sorted((start, start + nbytes, name) for name, (_, _, start, nbytes) in tensors.items())
    for (_, end, first), (start, _, second) in zip(spans, spans[1:]):
        if start < end:
            raise cur.fail(f"tensors {first!r} and {second!r} overlap")
    return metadata, tensors


def _quant_type(path: str, name: str, raw_type: int) -> GGMLQuantizationType:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        qtype = GGMLQuantizationType(raw_type)
    except ValueError:
        qtype = None
    if qtype is None or qtype not in GGML_QUANT_SIZES:
        from .gguf_types import read_types

        raise UnsupportedFormatError(
            f"{path}: tensor {name!r} has quantization type {raw_type}, which this version of the pack "
            "(and of the gguf library) does not know. Update the gguf package, or use a file quantized "
            f"with a type the pack reads: {read_types()}."
        )
    return qtype
