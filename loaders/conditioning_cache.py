"""The conditioning cache: a prompt's conditioning, encoded once, kept on disk and served again without the
encoder's weights.

An entry is a safetensors file named by the hash of its key. The key (`conditioning_key`) is everything that
changes the numbers: the content hash of the weights the encoder keeps, their layout and formats, the
tokenizer's vocabulary, the token ids (template and padding mode included), the compute dtype and device
class, the encoder layers read, the host's version and ENCODING_VERSION below. Each entry stores its own key
and a checksum of its tensor bytes, so a damaged, truncated or foreign file is a miss, never wrong numbers.

Several processes may share one folder: entries are written under a temporary name in the folder and renamed
into place (atomic on one file system), readers never see half a file, and the eviction pass (least
recently used first, by the mtime a hit touches) holds an flock and tolerates files that vanish under it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import secrets
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import Flux2DevError
from ..validate import parse_json
from .safetensors_file import SafetensorsFiles

try:
    import fcntl
except ImportError:  # Windows: msvcrt's byte-range lock instead
    fcntl = None
    import msvcrt

# Raise when the pack's encoding math changes (template, masking, layer choice ...): old entries then miss.
ENCODING_VERSION = 1
CACHE_DIR_ENV = "FLUX2DEV_CACHE_DIR"
DEFAULT_MAX_BYTES = 20 * 2**30
SUFFIX = ".safetensors"
TEMP_SUFFIX = ".tmp"
LOCK_FILE = ".lock"
FINGERPRINTS = "fingerprints.json"  # stat signature of an encoder's files -> content hash of its kept weights
_FINGERPRINTS_KEPT = 256
_STALE_TEMP_S = 3600  # a temporary file this old belongs to a writer that died
_KEY_META = "flux2dev_key"
_CHECKSUM_META = "flux2dev_checksum"
WEIGHT_FILES = (".safetensors", ".gguf")


def _tensor_bytes(t: torch.Tensor):
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()


def tensors_digest(tensors: dict[str, torch.Tensor]) -> str:
    """sha256 over the tensors' names, dtypes, shapes and bytes, in name order."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name]
        h.update(json.dumps([name, str(t.dtype), list(t.shape)]).encode())
        h.update(_tensor_bytes(t))
    return h.hexdigest()


def conditioning_key(**parts) -> dict:
    """The key of one conditioning: the parts given (all JSON values) and ENCODING_VERSION."""
    return {"encoding_version": ENCODING_VERSION, **parts}


def key_name(key: dict) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()


def weight_files(path: str) -> list[str]:
    """The weight files of an encoder file or folder (every one below a folder), whose stat signature stands
    for its content in the fingerprint index."""
    if os.path.isfile(path):
        return [path]
    found = []
    # Linked files count (os.stat follows them, as in the Hugging Face cache); linked folders are not walked,
    # so a folder that links back into itself cannot multiply the walk.
    for root, _, names in os.walk(path):
        found += [os.path.join(root, n) for n in names if n.endswith(WEIGHT_FILES)]
    return sorted(found)


def stat_signature(path: str) -> str:
    """Size, mtime and inode of each weight file: changes whenever a file is replaced or rewritten."""
    stats = []
    for f in weight_files(path):
        s = os.stat(f)
        stats.append([os.path.relpath(f, path) if f != path else "", s.st_size, s.st_mtime_ns, s.st_ino, s.st_dev])
    return hashlib.sha256(json.dumps(stats).encode()).hexdigest()


@dataclass(frozen=True)
class Entry:
    path: Path
    bytes: int
    last_used: float  # mtime, touched on every hit


class ConditioningCache:
    """One cache folder. `get` and `put` never raise for a damaged entry or a racing process: the worst is a
    miss. A failure to write (a full disk, a read-only folder) is the caller's to report."""

    def __init__(self, folder: str | os.PathLike, max_bytes: int = DEFAULT_MAX_BYTES):
        self.folder = Path(folder)
        self.max_bytes = max_bytes

    def path_of(self, key: dict) -> Path:
        return self.folder / (key_name(key) + SUFFIX)

    # --- entries ---------------------------------------------------------------------------------------

    def get(self, key: dict) -> dict[str, torch.Tensor] | None:
        """The tensors stored under `key`, or None (absent, damaged, or another key's file)."""
        path = self.path_of(key)
        if not path.exists():
            return None
        try:  # the pack's own checked reader: whatever is wrong with the file is its error, and a miss
            files = SafetensorsFiles([str(path)])
            if files.metadata.get(_KEY_META) != json.dumps(key, sort_keys=True):
                return None
            tensors = {name: files.read(name) for name in files.infos}
        except Flux2DevError:
            return None
        if files.metadata.get(_CHECKSUM_META) != tensors_digest(tensors):  # damaged, or replaced while read
            return None
        with contextlib.suppress(OSError):  # LRU: a hit is a use
            os.utime(path)
        return tensors

    def put(self, key: dict, tensors: dict[str, torch.Tensor]) -> Path:
        """Store `tensors` under `key` atomically (replacing a damaged entry), then evict down to max_bytes."""
        from safetensors.torch import save

        self.folder.mkdir(parents=True, exist_ok=True)
        tensors = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
        meta = {_KEY_META: json.dumps(key, sort_keys=True), _CHECKSUM_META: tensors_digest(tensors)}
        path = self.path_of(key)
        temp = path.with_name(f".{path.stem}.{os.getpid()}.{secrets.token_hex(4)}{TEMP_SUFFIX}")
        try:
            with open(temp, "wb") as f:
                f.write(save(tensors, metadata=meta))
                f.flush()
                os.fsync(f.fileno())
            os.replace(temp, path)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.remove(temp)
        self.evict()
        return path

    def entries(self) -> list[Entry]:
        """The entries, least recently used first; files that vanish while listed are left out."""
        found = []
        for p in self.folder.glob("*" + SUFFIX):
            with contextlib.suppress(FileNotFoundError):
                s = p.stat()
                found.append(Entry(p, s.st_size, s.st_mtime))
        return sorted(found, key=lambda e: e.last_used)

    def describe(self, entry: Entry) -> dict | None:
        """An entry's stored key, or None when the file is not a readable entry."""
        try:
            key = parse_json(SafetensorsFiles([str(entry.path)]).metadata[_KEY_META], str(entry.path), "config")
        except (Flux2DevError, KeyError):
            return None
        return key if isinstance(key, dict) else None

    def evict(self, max_bytes: int | None = None) -> list[Path]:
        """Delete least recently used entries until the folder holds at most max_bytes (default: the cache's
        limit), and temporary files left by writers that died. Returns what was deleted."""
        limit = self.max_bytes if max_bytes is None else max_bytes
        removed = []
        with self.locked():
            now = time.time()
            for temp in self.folder.glob(".*" + TEMP_SUFFIX):
                with contextlib.suppress(FileNotFoundError):
                    if now - temp.stat().st_mtime > _STALE_TEMP_S:
                        temp.unlink()
            entries = self.entries()
            total = sum(e.bytes for e in entries)
            for e in entries:
                if total <= limit:
                    break
                with contextlib.suppress(FileNotFoundError):
                    e.path.unlink()
                    removed.append(e.path)
                total -= e.bytes
        return removed

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """The folder's lock, held by one process at a time (eviction and the fingerprint index)."""
        self.folder.mkdir(parents=True, exist_ok=True)
        with open(self.folder / LOCK_FILE, "a+") as f:
            _lock(f.fileno())
            try:
                yield
            finally:
                _unlock(f.fileno())

    # --- weights fingerprints ----------------------------------------------------------------------------

    def known_fingerprint(self, signature: str) -> str | None:
        return self._fingerprints().get(signature)

    def remember_fingerprint(self, signature: str, fingerprint: str) -> None:
        with self.locked():
            index = self._fingerprints()
            index.pop(signature, None)
            index[signature] = fingerprint  # newest last: the oldest go first
            kept = dict(list(index.items())[-_FINGERPRINTS_KEPT:])
            temp = self.folder / f".{FINGERPRINTS}.{os.getpid()}{TEMP_SUFFIX}"
            temp.write_text(json.dumps(kept))
            os.replace(temp, self.folder / FINGERPRINTS)

    def _fingerprints(self) -> dict[str, str]:
        path = self.folder / FINGERPRINTS
        try:
            index = parse_json(path.read_bytes(), str(path), "config")
        except (OSError, Flux2DevError):  # absent or damaged: fingerprints are hashed again
            return {}
        return {k: v for k, v in index.items() if isinstance(v, str)} if isinstance(index, dict) else {}


def _lock(fd: int) -> None:
    if fcntl is not None:
        fcntl.flock(fd, fcntl.LOCK_EX)
        return
    os.lseek(fd, 0, os.SEEK_SET)  # msvcrt locks bytes from the current position: always the first one
    while True:  # msvcrt gives up after 10 s of waiting; keep waiting as flock does
        try:
            msvcrt.locking(fd, msvcrt.LK_LOCK, 1)
            return
        except OSError:
            continue


def _unlock(fd: int) -> None:
    if fcntl is not None:
        fcntl.flock(fd, fcntl.LOCK_UN)
    else:
        os.lseek(fd, 0, os.SEEK_SET)
        msvcrt.locking(fd, msvcrt.LK_UNLCK, 1)


def weights_fingerprint(cache: ConditioningCache, path: str, state_dict) -> str:
    """The content hash of an encoder's kept weights: from the cache's index when its files are unchanged,
    else hashed from `state_dict()` (called only then: it may read the weights) and remembered."""
    signature = stat_signature(path)
    known = cache.known_fingerprint(signature)
    if known is None:
        known = tensors_digest(state_dict())
        cache.remember_fingerprint(signature, known)
    return known
