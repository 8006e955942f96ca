"""Where file content becomes values the pack trusts: every file is checked to be a regular file of a sane
size before it is opened, every JSON document is bounded in size and depth, and every field the pack uses
is checked against a small declaration (type, range, length) before any code computes with it. Files come
from strangers and half-finished downloads; what fails here fails with the pack's error, naming the file,
the field and what was expected, and never quotes the content of a file that is not a model file."""

from __future__ import annotations

import contextlib
import errno
import functools
import json
import math
import os
import re
import stat
import traceback
import warnings
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path, PureWindowsPath
from typing import TYPE_CHECKING, Any

from ...errors import CorruptFileError, ModelNotFoundError, TooManyOpenFilesError

if TYPE_CHECKING:
    import torch

MiB = 1 << 20

# The largest JSON document of each kind the pack reads. Real files are far smaller (a FLUX.2 config is
# under 2 KiB, a shard index under 200 KiB, the Tekken vocabulary about 15 MiB); the bounds keep a damaged
# or hostile file from costing gigabytes of parsed objects.
JSON_LIMITS = {
    "config": 1 * MiB,  # config.json, params.json, model_index.json, scheduler and other part configs
    "index": 16 * MiB,  # <weights>.index.json
    "vocabulary": 64 * MiB,  # tekken.json, tokenizer.json
    "header": 16 * MiB,  # a safetensors header
    "prompt": 1 * MiB,  # one line of a prompts file (a JSON string)
}
# The most strings and containers (objects, lists) a document of each kind may hold: each costs tens of bytes
# once parsed however short it is in the file, so a file of "{}" or "" is refused before it is parsed. Real
# files hold far fewer (a Tekken vocabulary about 750k, a FLUX.2 safetensors header about 8k).
JSON_VALUES = {"config": 1 << 16, "index": 1 << 20, "vocabulary": 1 << 22, "header": 1 << 19, "prompt": 1 << 16}
MAX_DEPTH = 32  # real files nest 4 deep at most
# A JSON string, escapes included: what is removed to leave a document's skeleton of brackets and numbers.
# An unterminated one runs to the end: every match attempt succeeds, so the scan stays linear. Only texts
# within JSON_VALUES are scanned, so its pieces are bounded too.
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*(?:"|\\?\Z)', re.S)


def regular_file(path: str | os.PathLike, what: str = "file") -> Path:
    """`path` as a Path once it is known to be a regular file: a directory, FIFO, device or symlink loop
    named like a model file is refused before anything opens it (opening a FIFO would block forever)."""
    path = Path(path)
    try:
        mode = os.stat(path).st_mode
    except OSError as e:
        raise _unopenable(path, what, e) from None
    except ValueError:
        raise _bad_name(path, what) from None
    _check_regular(path, mode, what)
    return path


def _unopenable(path: Path, what: str, e: OSError, follow_links: bool = True) -> Exception:
    if (out_of_files := too_many_open_files(e, path, what)) is not None:
        return out_of_files
    if isinstance(e, FileNotFoundError):
        return ModelNotFoundError(f"{path}: the {what} is not there.")
    if e.errno == errno.ELOOP and not follow_links:
        return CorruptFileError(f"{path}: the {what} is a link, and links are not followed there.")
    # a symlink loop, a name too long, no permission
    return CorruptFileError(f"{path}: the {what} cannot be opened ({e.strerror}).")


def too_many_open_files(e: BaseException, path: str | os.PathLike | None, what: str = "file") -> Exception | None:
    """The pack's error for an OSError that says the process (EMFILE) or the system (ENFILE) has run out of open
    files, else None: the file is fine, and "cannot be read" would send the user to download it again."""
    if not isinstance(e, OSError) or e.errno not in (errno.EMFILE, errno.ENFILE):
        return None
    where = f"A {what}" if path is None else f"{path}: the {what}"
    if e.errno == errno.ENFILE:
        return TooManyOpenFilesError(
            f"{where} cannot be opened: the system has as many files open as it allows. The file itself is fine. Close "
            "programs that hold many files, or raise the system's limit (fs.file-max on Linux, kern.maxfiles on "
            "macOS)."
        )
    return TooManyOpenFilesError(
        f"{where} cannot be opened: this process has as many files open as its limit allows{_open_files_limit()}. "
        "The file itself is fine. Start ComfyUI (or flux2dev) with a higher limit of open files: `ulimit -n 4096` in "
        "the shell that starts it (macOS and Linux), or LimitNOFILE=4096 in its service file."
    )


def _open_files_limit() -> str:
    try:
        import resource  # not on Windows
    except ImportError:
        return ""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return f" ({soft})"


def _bad_name(path: Path, what: str) -> Exception:  # a NUL or a lone surrogate: no file system has such a name
    return CorruptFileError(f"{ascii(str(path))} cannot be a file name; the {what} was named by a damaged file.")


def _check_regular(path: Path, mode: int, what: str) -> None:
    if not stat.S_ISREG(mode):
        kind = "a folder" if stat.S_ISDIR(mode) else "not a regular file (a pipe, device or socket)"
        raise CorruptFileError(f"{path} is {kind}, but a {what} was expected there. Choose the file itself.")


# Opening never blocks (a FIFO opens at once, then is refused by what it is) and, where asked, never
# follows a link at the last name; elsewhere (Windows) these flags do not exist and are not needed.
_OPEN_FLAGS = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0) | getattr(os, "O_CLOEXEC", 0)
NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


@contextlib.contextmanager
def open_regular(path: str | os.PathLike, what: str = "file", *, follow_links: bool = True):
    """(the open file, its size) of a regular file. What is checked is the file opened, not a name looked at
    before, so nothing swapped in between is read. Opening never blocks (a FIFO opens at once and is then
    refused by what it is); follow_links=False refuses a link at the last name (for files the pack writes)."""
    path = Path(path)
    if not follow_links and os.name == "nt" and os.path.islink(path):  # Windows has no O_NOFOLLOW
        raise CorruptFileError(f"{path}: the {what} is a link, and links are not followed there.")
    try:
        fd = os.open(path, _OPEN_FLAGS | (0 if follow_links else NOFOLLOW))
    except OSError as e:
        raise _unopenable(path, what, e, follow_links) from None
    except ValueError:
        raise _bad_name(path, what) from None
    try:
        s = os.fstat(fd)
        _check_regular(path, s.st_mode, what)
    except BaseException:
        os.close(fd)
        raise
    with open(fd, "rb", buffering=0) as f, reading(path, what):
        yield f, s.st_size


def read_bounded(path: str | os.PathLike, limit: int, what: str = "file", *, follow_links: bool = True) -> bytes:
    """The bytes of a regular file of at most `limit` bytes (open_regular); one that grows while it is read is
    still cut at the limit."""
    with open_regular(path, what, follow_links=follow_links) as (f, size):
        if size > limit:
            raise CorruptFileError(
                f"{path} is {size} bytes, more than any real {what} ({limit} at most); it is damaged or not the "
                "file it is named as."
            )
        data = f.read(limit + 1)
    if len(data) > limit:
        raise CorruptFileError(f"{path} grew past {limit} bytes while it was read; no real {what} is that large.")
    return data


@contextlib.contextmanager
def reading(path: str | os.PathLike, what: str = "file") -> Iterator[None]:
    """Around the opening and reading of a checked file: a read that fails (no permission, a disk error, a
    file shrunk under the reader) is the pack's error, not an OSError."""
    try:
        yield
    except OSError as e:
        raise too_many_open_files(e, path, what) or CorruptFileError(
            f"{path}: the {what} cannot be read ({e.strerror or type(e).__name__}).") from None


# --- maps: one per file in use ---------------------------------------------------------------------------------

# The one map of each file in use, by the file's identity (file_identity), shared by every reader of it in the
# process. Weakly held: a map, and the one descriptor it keeps open, go with the last tensor viewing it, so a loaded
# model holds one open file per file and a released one none.
_MAPS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def file_identity(file) -> tuple[int, int]:
    """What tells an open file from another one put at its name later: its device and inode. (A file written in
    place keeps them: a tensor it no longer holds is refused by its size, mapped_bytes.)"""
    s = os.fstat(file.fileno())
    return s.st_dev, s.st_ino


def map_file(path: str | os.PathLike, identity: tuple[int, int], end: int, what: str):
    """The one map (an mmap) of the file `identity` names, found at `path`, covering at least its first `end`
    bytes: shared with every other reader of the file while it lives (_MAPS), else made. The file at `path` must
    still be the one of `identity` (the one whose header was read).

    Read-only and shared, so nothing written can reach the file, and the kernel charges no commit for it whatever
    the file's size (it refuses a writable private map of a file larger than the memory). Python's map keeps a
    descriptor of its own: the one open file a file in use costs."""
    import mmap

    mapped = _MAPS.get(identity)
    if mapped is not None and len(mapped) >= end:
        return mapped
    with open_regular(path, what) as (f, size):
        if file_identity(f) != identity:
            raise CorruptFileError(f"{path} was replaced by another file after its header was read; what the header "
                                   "says of its tensors may not hold for the new one. Load it again.")
        if size < end:
            raise _cut(path)
        mapped = _MAPS[identity] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    return mapped


def _cut(path: str | os.PathLike) -> CorruptFileError:
    return CorruptFileError(f"{path} ended inside a tensor: it was cut after its header was read. Download it again.")


def mapped_bytes(mapped, path: str | os.PathLike, start: int, end: int, what: str) -> torch.Tensor:
    """Bytes start..end of a file's map (map_file) as a uint8 tensor viewing it; the map stays open while the view
    (or any tensor viewing it) lives.

    The file's size is checked first, through the map's own descriptor: a map touched past the file's end kills the
    process (SIGBUS), so a file cut after its header was read ends in the pack's error here. A file cut later, while
    its tensors are in use, still does: nothing short of copying the weights can prevent it on Linux and macOS
    (neither locks a file against truncation), and it takes a tool writing into the very file in use (downloads and
    the pack's own writers make a fresh file and rename it, which leaves the mapped one whole). Windows refuses to
    cut a mapped file.

    torch has no read-only tensors: the view is handed over as writable, its warning silenced. A write into it
    cannot reach the file (the page is read-only: the process would stop on a protection fault); none is made: the
    pack's layers patch copies of their weights (host/ops.py), and the host's LoRA patching replaces or casts
    weights (ComfyUI 0.33 maps its own model files read-only the same way)."""
    import numpy as np
    import torch

    with reading(path, what):
        size = mapped.size()
    if size < end:
        raise _cut(path)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "The given NumPy array is not writable")
        # Through numpy, whose buffer export keeps the map open (it cannot be closed) under a live view.
        return torch.from_numpy(np.frombuffer(mapped, np.uint8, end - start, start))


_MADV_WILLNEED = 3  # Linux's and macOS's value


@functools.cache
def _madvise():
    """libc's madvise, where there is one (not on Windows): None elsewhere."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        function = libc.madvise
    except (OSError, AttributeError, TypeError):
        return None
    function.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    return function


def prefetch(tensors) -> None:
    """Ask the system to read the file pages behind `tensors` (views of a map_file map) ahead of their use, without
    waiting: where a file is larger than the memory, the next layer is read from the disk while this one computes.
    A tensor of the process's own memory (or a system without madvise) is left as it is: the advice only reads."""
    import mmap

    madvise = _madvise()
    if madvise is None:
        return
    page = mmap.PAGESIZE
    for t in tensors:
        if t.device.type != "cpu" or not t.numel():
            continue
        start = t.data_ptr() - t.data_ptr() % page
        madvise(start, t.data_ptr() + t.numel() * t.element_size() - start, _MADV_WILLNEED)


def released_on_error(load):
    """`load` (a function that reads tensors), made to let go of what it read the moment it fails: the locals of the
    calls its error passed through are cleared, so the tensors read so far, and the maps of their files, go at once
    even while the error is kept (ComfyUI keeps a failed node's error, and the frames in it, until the next prompt)."""

    @functools.wraps(load)
    def releasing(*args, **kwargs):
        try:
            return load(*args, **kwargs)
        except BaseException as e:
            error = e
            while error is not None:  # and the errors it was raised from, whose frames may be others
                traceback.clear_frames(error.__traceback__)
                error = error.__context__
            raise

    return releasing


def inside(folder: str | os.PathLike, name: str, what: str) -> Path:
    """The file `name` (as written in an index or a config) within `folder`: a name that is absolute or
    climbs out with ".." is refused without opening anything, and without quoting anything of it. The check
    is on the name: links the user keeps in the folder (the Hugging Face cache keeps a snapshot's files as
    links into its blobs/ folder) are followed, and what they lead to must still be a regular file."""
    folder = Path(folder)
    if not isinstance(name, str) or not name or "\x00" in name or os.path.isabs(name) \
            or ".." in re.split(r"[\\/]", name) or PureWindowsPath(name).anchor:
        raise CorruptFileError(
            f"{folder}: the {what} names a file outside the model folder; the file is damaged or hostile, and the "
            "pack reads nothing outside the folder it was given."
        )
    return folder / name


def _most_values(data: bytes) -> int:
    """At least as many as the strings, objects and lists of a JSON text: half its quotes and its opening
    brackets (those inside strings too), counted without allocating anything."""
    return data.count(b'"') // 2 + data.count(b"{") + data.count(b"[")


def _deepest(data: bytes) -> int:
    """The deepest nesting of a JSON text, from its brackets outside strings, without parsing it. For a text
    that is not JSON the figure means nothing; the parse then fails anyway."""
    import numpy as np

    codes = np.frombuffer(_JSON_STRING.sub(b"", data), np.uint8)
    brackets = codes[np.isin(codes, np.frombuffer(b"{[]}", np.uint8))]
    steps = np.where((brackets == ord("{")) | (brackets == ord("[")), np.int8(1), np.int8(-1))
    return int(np.cumsum(steps, dtype=np.int32).max(initial=0))


def parse_json(data: bytes | str, where: str, kind: str, object_pairs_hook=None) -> Any:
    """One JSON document of a known kind, bounded in size, values and depth before it is parsed, non-finite
    numbers refused.
    `object_pairs_hook` (json's) may check each object as soon as it is parsed and raise the pack's error,
    so a document of a million bad entries fails at the first instead of after building them all."""
    if len(data) > JSON_LIMITS[kind]:
        raise CorruptFileError(
            f"{where} is {len(data)} bytes, more than any real {kind} file ({JSON_LIMITS[kind]} at most); "
            "it is damaged or not the file it is named as."
        )
    raw = data.encode("utf-8", "surrogatepass") if isinstance(data, str) else data
    if _most_values(raw) > JSON_VALUES[kind]:
        raise CorruptFileError(
            f"{where} holds more strings, objects and lists than any real {kind} file ({JSON_VALUES[kind]} at "
            "most); it is damaged or not the file it is named as."
        )
    if _deepest(raw) > MAX_DEPTH:
        raise CorruptFileError(f"{where} nests deeper than {MAX_DEPTH} levels; no real {kind} file does. "
                               "Download it again.")
    try:
        value = json.loads(data, parse_constant=_refuse_constant, object_pairs_hook=object_pairs_hook)
    except UnicodeDecodeError as e:  # its own text would quote the file's bytes
        raise CorruptFileError(f"{where} is not UTF-8 text (byte {e.start} is not); download it again.") from None
    except ValueError as e:
        raise CorruptFileError(f"{where} is not valid JSON ({e}); download it again.") from None
    return value


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not a number JSON allows")


def read_json_file(path: str | os.PathLike, kind: str = "config") -> Any:
    """A JSON file of a known kind, read only if it is a regular file within the kind's size bound."""
    return parse_json(read_bounded(path, JSON_LIMITS[kind], f"{kind} file"), str(path), kind)


@dataclass(frozen=True)
class Field:
    """What one field must be: its JSON type, an inclusive range for numbers, a length bound for strings,
    lists and objects, whether it must be present, and for an object the fields it holds."""

    kind: type | tuple[type, ...]
    lo: float | None = None
    hi: float | None = None
    max_len: int | None = None
    required: bool = True
    fields: dict[str, Field] | None = None  # for an object: the declarations of its own fields


NULL = type(None)  # for Field kinds: real files write null for many unset fields
_TYPE_NAMES = {
    int: "an integer", float: "a number", str: "a string", bool: "true or false", list: "a list", dict: "an object",
    NULL: "null",
}


def describe(value: Any) -> str:
    """A value in a few words, never more than 40 characters of its own text."""
    if value is None:
        return "null"
    if isinstance(value, (bool, int, float)):
        return repr(value)
    if isinstance(value, str):
        return f"a string of {len(value)} characters" if len(value) > 40 else repr(value)
    return f"{_TYPE_NAMES.get(type(value), type(value).__name__)} of {len(value)} items"


def _matches(value: Any, kind) -> bool:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if isinstance(value, bool):
        return bool in kinds
    if isinstance(value, int) and float in kinds:
        return True
    return isinstance(value, kinds)


def check_field(value: Any, field: Field, where: str, name: str) -> Any:
    """`value` if it is what `field` declares; otherwise the pack's error naming the file and field."""
    kinds = field.kind if isinstance(field.kind, tuple) else (field.kind,)
    expected = " or ".join(_TYPE_NAMES.get(k, k.__name__) for k in kinds)
    if field.lo is not None or field.hi is not None:
        expected += f" from {'-inf' if field.lo is None else field.lo} to {'inf' if field.hi is None else field.hi}"
    if field.max_len is not None:
        expected += f" of at most {field.max_len} items"
    ok = _matches(value, field.kind)
    if ok and isinstance(value, (int, float)) and not isinstance(value, bool):
        # integers are compared exactly: one of 400 digits has no float (math.isfinite would overflow)
        ok = (isinstance(value, int) or math.isfinite(value)) and (field.lo is None or value >= field.lo) \
            and (field.hi is None or value <= field.hi)
    if ok and field.max_len is not None and isinstance(value, (str, list, dict)):
        ok = len(value) <= field.max_len
    if not ok:
        raise CorruptFileError(
            f"{where}: {name} is {describe(value)}, expected {expected}. The file is damaged or not a FLUX.2 "
            "file; download it again."
        )
    if field.fields is not None and isinstance(value, dict):
        checked(value, field.fields, where, f"{name}.")
    return value


def checked(document: Any, fields: dict[str, Field], where: str, prefix: str = "") -> dict:
    """The fields of a JSON object (or GGUF metadata) that `fields` declares, each checked; a document that
    is not an object, or lacks a required field, is the pack's error. Undeclared fields are left as they are.
    `prefix` names the object within its file ("text_config.")."""
    if not isinstance(document, dict):
        what = f"{where}: {prefix.rstrip('.')} is" if prefix else f"{where} holds"
        raise CorruptFileError(f"{what} {describe(document)}, expected a JSON object; download it again.")
    for name, field in fields.items():
        if name in document:
            check_field(document[name], field, where, prefix + name)
        elif field.required:
            raise CorruptFileError(f"{where} lacks {prefix}{name}, which every such file has; download it again.")
    return document
