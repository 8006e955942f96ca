"""The conditioning cache's folder: a prompt's conditioning, encoded once, kept on disk and served again without
the encoder's weights.

An entry is a safetensors file named by the hash of its key (keys.py: everything that changes the numbers; a
key is any object with a `to_json()`). Each entry stores its key and a checksum of key and tensors, so a
damaged, truncated or foreign file is a miss, never wrong numbers. With FLUX2DEV_CACHE_SECRET set the checksum
is an HMAC: entries written without the secret are misses, so a shared folder cannot be poisoned by someone
who lacks it.

The folder is the cache's own, and the cache touches nothing else in it:
- it is refused when it holds files the cache did not write (a models folder, say), unless it carries the
  cache's CACHEDIR.TAG, and even then only the cache's own names are ever written or deleted;
- eviction deletes an entry only after proving the cache wrote it (its name is the hash of the key stored
  inside it), and a temporary file only once its writer is gone (it no longer holds its lock);
- every file is written under a fresh, unpredictable name created exclusively (never through a link) and
  renamed into place, so readers never see half a file and a link planted at any name is replaced, never
  written through;
- every file is read through the bounded reader, opened without following links and without blocking;
- a folder that cannot be written (read-only, full) still serves hits: stores are skipped with one warning,
  and the weights' fingerprint is kept in memory for the process;
- its lock is waited for a bounded time only; a lock file that is not a regular file is left alone.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import hmac
import json
import logging
import os
import re
import secrets
import stat
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from ...errors import CacheError, Flux2DevError
from ..formats.safetensors_file import SafetensorsFiles, read_metadata
from ..formats.validate import NOFOLLOW, parse_json, read_bounded, too_many_open_files

try:
    import fcntl
except ImportError:  # Windows: msvcrt's byte-range lock instead
    fcntl = None
    import msvcrt

CACHE_DIR_ENV = "FLUX2DEV_CACHE_DIR"
SECRET_ENV = "FLUX2DEV_CACHE_SECRET"
DEFAULT_MAX_BYTES = 20 * 2**30
MAX_ENTRY_BYTES = 1 << 30  # a batch of 8 full-length float32 conditionings is 252 MiB
INDEX_LIMIT = 1 << 20  # the fingerprint index holds at most _FINGERPRINTS_KEPT short lines
LOCK_WAIT_S = 10.0  # a lock held longer is someone else's problem: skip what needed it, this time
_FINGERPRINTS_KEPT = 256

# The names the cache owns in its folder; it creates, replaces and deletes only these.
SUFFIX = ".safetensors"
ENTRY_NAME = re.compile(r"[0-9a-f]{64}\.safetensors")
TEMP_NAME = re.compile(r"\.(?:[0-9a-f]{64}|fingerprints|tag)\.[0-9a-f]{32}\.tmp")
FINGERPRINTS = "fingerprints.json"  # stat signature of an encoder's files -> content hash of its kept weights
LOCK_FILE = ".lock"
# https://bford.info/cachedir/: backup tools skip the folder, and it marks the folder as the cache's
TAG = "CACHEDIR.TAG"
TAG_SIGNATURE = b"Signature: 8a477f597d28d172789f06886806bc55"
TAG_TEXT = TAG_SIGNATURE + (
    b"\n# This folder is a conditioning cache of ComfyUI-Flux2Dev (FLUX.2 [dev] text encoder).\n"
    b"# Its entries can be deleted at any time; they are encoded again when needed.\n"
    b"# For information about cache directory tags see https://bford.info/cachedir/\n"
)
OWN_NAMES = (FINGERPRINTS, LOCK_FILE, TAG)
# What file managers leave in any folder they show: neither the cache's nor a reason to refuse the folder.
OS_LITTER = frozenset({".DS_Store", "Thumbs.db", "desktop.ini", ".directory"})
_KEY_META = "flux2dev_key"
_CHECKSUM_META = "flux2dev_checksum"

# Files are created exclusively (O_EXCL: whatever is at the name, a link included, makes it fail) and opened
# without following a link at the last name and without blocking (a pipe opens at once, then is refused).
_FLAGS = NOFOLLOW | getattr(os, "O_BINARY", 0) | getattr(os, "O_CLOEXEC", 0)
_CREATE = os.O_CREAT | os.O_EXCL | _FLAGS
_OPEN_EXISTING = getattr(os, "O_NONBLOCK", 0) | _FLAGS

# Per process: folders that could not be written (warned about once), and the fingerprints this process
# computed or read, which stand in for an index the folder cannot hold.
_UNWRITABLE: dict[str, int] = {}
_WARNED: set[tuple[str, str]] = set()
_KNOWN_FINGERPRINTS: dict[str, str] = {}


def key_name(key_json: str) -> str:
    return hashlib.sha256(key_json.encode()).hexdigest()


def _tensor_bytes(t):
    import torch

    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()


class ContentDigest:
    """sha256 over tensors' names, dtypes, shapes and bytes, fed one tensor at a time in name order (a name out of
    order is refused: the digest would not be tensors_digest's)."""

    def __init__(self):
        self._h = hashlib.sha256()
        self._last: str | None = None

    def add(self, name: str, t) -> None:
        if self._last is not None and name <= self._last:
            raise ValueError(f"tensor {name!r} comes after {self._last!r}; feed tensors in name order")
        self._last = name
        self._h.update(json.dumps([name, str(t.dtype), list(t.shape)]).encode())
        self._h.update(_tensor_bytes(t))

    def hexdigest(self) -> str:
        return self._h.hexdigest()


def tensors_digest(tensors: dict) -> str:
    """sha256 over the tensors' names, dtypes, shapes and bytes, in name order."""
    digest = ContentDigest()
    for name in sorted(tensors):
        digest.add(name, tensors[name])
    return digest.hexdigest()


def _secret() -> bytes | None:
    secret = os.environ.get(SECRET_ENV, "")
    return secret.encode() if secret else None


def _seal(message: bytes) -> str:
    """A checksum of `message`: keyed (HMAC) when the secret is set, so only its holders can make one."""
    secret = _secret()
    if secret is not None:
        return "hmac-sha256:" + hmac.new(secret, message, "sha256").hexdigest()
    return "sha256:" + hashlib.sha256(message).hexdigest()


def _sealed(seal, message: bytes) -> bool:
    return isinstance(seal, str) and hmac.compare_digest(seal, _seal(message))


def _entry_seal_message(key_json: str, tensors: dict) -> bytes:
    # The key is sealed with the tensors: another prompt's valid tensors copied under this key's name fail.
    return key_json.encode() + b"\0" + tensors_digest(tensors).encode()


# --- the weights' stat signature --------------------------------------------------------------------------


def stat_signature(base: str, files) -> str:
    """Size, mtime and inode of each weight file the encoder reads (names relative to `base`): changes
    whenever one is replaced or rewritten."""
    stats = []
    folder = base if os.path.isdir(base) else os.path.dirname(base)
    for f in sorted(files):
        s = os.stat(f)
        stats.append([os.path.relpath(f, folder), s.st_size, s.st_mtime_ns, s.st_ino, s.st_dev])
    return hashlib.sha256(json.dumps(stats).encode()).hexdigest()


# --- the folder -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Entry:
    path: Path
    bytes: int
    last_used: float  # mtime, touched on every hit
    key_json: str = field(repr=False)
    inode: tuple[int, int] = field(repr=False)  # (st_dev, st_ino) when it was proved the cache's


def _owned(name: str) -> bool:
    return name in OWN_NAMES or ENTRY_NAME.fullmatch(name) is not None or TEMP_NAME.fullmatch(name) is not None


def _regular(path: Path) -> os.stat_result | None:
    """The stat of `path` itself when it is a regular file (a link, folder or pipe there: None)."""
    try:
        s = os.lstat(path)
    except OSError:
        return None
    return s if stat.S_ISREG(s.st_mode) else None


class ConditioningCache:
    """One cache folder. `get` and `put` never raise for a damaged entry, a racing process, or a folder that
    cannot be written: the worst is a miss, or a store skipped with a warning. Opening a folder that holds
    files the cache did not write raises CacheError."""

    def __init__(self, folder: str | os.PathLike, max_bytes: int = DEFAULT_MAX_BYTES):
        self.folder = Path(folder)
        self.max_bytes = max_bytes
        self._made = False  # the folder and its tag are there
        self._check_folder()

    def _check_folder(self) -> None:
        try:
            names = os.listdir(self.folder)
        except FileNotFoundError:
            return  # made on the first store
        except NotADirectoryError:
            raise CacheError(f"{self.folder} is a file, not a folder; the conditioning cache needs a folder of its "
                             "own.") from None
        except OSError as e:
            raise too_many_open_files(e, self.folder, "conditioning cache folder") or CacheError(
                f"{self.folder} cannot be read as the conditioning cache folder ({e.strerror}).") from None
        foreign = sorted(n for n in names if not _owned(n) and n not in OS_LITTER)
        if foreign and not self._tagged():
            shown = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
            raise CacheError(
                f"{self.folder} holds files the conditioning cache did not write ({shown}), so it is not used as a "
                "cache: a cache deletes old entries to stay within its size, and this pack never touches files it "
                "did not write. Give the cache a new or empty folder of its own (or leave the cache input empty "
                "for the default one)."
            )
        self._warn_if_shared()

    def _tagged(self) -> bool:
        try:
            return read_bounded(self.folder / TAG, 4096, "cache tag", follow_links=False).startswith(TAG_SIGNATURE)
        except Flux2DevError:
            return False

    def _warn_if_shared(self) -> None:
        if os.name != "posix" or _secret() is not None:
            return
        try:
            s = os.stat(self.folder)
        except OSError:
            return
        if s.st_mode & (stat.S_IWGRP | stat.S_IWOTH) or s.st_uid != os.geteuid():
            self._warn_once(
                "shared",
                "FLUX.2 [dev] conditioning cache: %s can be written by other users, and anyone who can write it can "
                "change the conditioning it serves. Make it writable by you alone, or set %s to the same secret in "
                "every ComfyUI that shares it.", self.folder, SECRET_ENV,
            )

    def _warn_once(self, what: str, message: str, *args) -> None:
        if (str(self.folder), what) not in _WARNED:
            _WARNED.add((str(self.folder), what))
            logging.warning(message, *args)

    @property
    def read_only(self) -> bool:
        return str(self.folder) in _UNWRITABLE

    def _cannot_write(self, e: OSError) -> None:
        """A store or index write failed: say so once; a folder that cannot be written is not tried again."""
        if e.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
            _UNWRITABLE[str(self.folder)] = e.errno
            self._warn_once("read-only", "FLUX.2 [dev] conditioning cache: %s cannot be written (%s); it is used "
                            "read-only: prompts it holds are served, new ones are not stored.", self.folder, e.strerror)
        else:
            self._warn_once(f"write {e.errno}", "FLUX.2 [dev] conditioning cache: could not store in %s (%s); "
                            "prompts it holds are still served.", self.folder, e.strerror or e)

    def path_of(self, key) -> Path:
        return self.folder / (key_name(key.to_json()) + SUFFIX)

    # --- entries ---------------------------------------------------------------------------------------

    def get(self, key) -> dict | None:
        """The tensors stored under `key`, or None (absent, damaged, another key's file, or not a file)."""
        key_json = key.to_json()
        path = self.folder / (key_name(key_json) + SUFFIX)
        tensors = self._load(path, key_json)
        if tensors is not None:
            # LRU: a hit is a use. Of the entry itself: where utime can be told not to follow a link, it is.
            with contextlib.suppress(OSError):
                os.utime(path, follow_symlinks=os.utime not in os.supports_follow_symlinks)
        return tensors

    def read(self, entry: Entry) -> dict | None:
        """An entry's tensors, or None when they no longer match its seal (damaged, or sealed with another
        secret)."""
        return self._load(entry.path, entry.key_json)

    def _load(self, path: Path, key_json: str) -> dict | None:
        s = _regular(path)
        if s is None or s.st_size > MAX_ENTRY_BYTES:
            return None
        try:  # the pack's own checked reader: whatever is wrong with the file is its error, and a miss
            files = SafetensorsFiles([str(path)])
            if files.metadata.get(_KEY_META) != key_json:
                return None
            tensors = {name: files.read(name) for name in files.infos}
        except Flux2DevError:
            return None
        if not _sealed(files.metadata.get(_CHECKSUM_META), _entry_seal_message(key_json, tensors)):
            return None  # damaged, replaced while read, or sealed without (or with another) secret
        return tensors

    def put(self, key, tensors: dict) -> Path | None:
        """Store `tensors` under `key` (replacing a damaged entry), then evict down to max_bytes. None when the
        folder cannot take it (read-only, full: warned about once)."""
        if self.read_only:
            return None
        from safetensors.torch import save

        key_json = key.to_json()
        tensors = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
        meta = {_KEY_META: key_json, _CHECKSUM_META: _seal(_entry_seal_message(key_json, tensors))}
        name = key_name(key_json)
        try:
            self._make_folder()
            self._write(name + SUFFIX, name, lambda: save(tensors, metadata=meta))
        except OSError as e:
            self._cannot_write(e)
            return None
        self.evict()
        return self.folder / (name + SUFFIX)

    def _make_folder(self) -> None:
        if self._made:
            return
        self.folder.mkdir(parents=True, exist_ok=True)
        if not self._tagged():
            # The tag only marks the folder; a folder where it cannot be written (a folder is at its name)
            # still takes entries, and one that takes nothing fails at the entry.
            with contextlib.suppress(OSError):
                self._write(TAG, "tag", lambda: TAG_TEXT)
        self._made = True

    def _write(self, name: str, stem: str, content) -> None:
        """`content()`'s bytes at `name`, through a fresh temporary file renamed into place."""
        fd, temp = _fresh(self.folder, stem)
        try:
            with open(fd, "wb", closefd=False) as f:
                f.write(content())
                f.flush()
                os.fsync(f.fileno())
            os.replace(temp, self.folder / name)  # replaces a link or file at the name, never writes through it
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(temp)
            raise
        finally:
            os.close(fd)  # its lock goes with it, once the file is in place

    def entries(self) -> list[Entry]:
        """The cache's own entries, least recently used first: regular files whose name is the hash of the key
        stored in them. Anything else (a folder, a link, a pipe, someone else's file) is not one."""
        found = []
        try:
            listing = list(os.scandir(self.folder))
        except OSError:
            return []
        for item in listing:
            if ENTRY_NAME.fullmatch(item.name) is None:
                continue
            path = Path(item.path)
            s = _regular(path)
            if s is None or s.st_size > MAX_ENTRY_BYTES:
                continue
            try:
                key_json = read_metadata(path, follow_links=False).get(_KEY_META)
            except Flux2DevError:
                continue
            if isinstance(key_json, str) and key_name(key_json) + SUFFIX == item.name:
                found.append(Entry(path, s.st_size, s.st_mtime, key_json, (s.st_dev, s.st_ino)))
        return sorted(found, key=lambda e: e.last_used)

    def others(self) -> list[str]:
        """Names in the folder that are neither entries nor the cache's own files: what it leaves alone."""
        with contextlib.suppress(OSError):
            entries = {e.path.name for e in self.entries()}
            return sorted(n for n in os.listdir(self.folder) if n not in entries and n not in OWN_NAMES
                          and TEMP_NAME.fullmatch(n) is None and n not in OS_LITTER)
        return []

    def _delete(self, entry: Entry) -> bool:
        """Delete an entry if the file at its name is still the one proved the cache's."""
        s = _regular(entry.path)
        if s is None or (s.st_dev, s.st_ino) != entry.inode:
            return False
        try:
            entry.path.unlink()
        except FileNotFoundError:
            return False
        except OSError as e:
            self._cannot_write(e)
            return False
        return True

    def prune(self) -> list[Path]:
        """Delete the entries whose tensors no longer match their seal (damaged, or sealed with another
        secret); returns what was deleted."""
        return [e.path for e in self.entries() if self.read(e) is None and self._delete(e)]

    def evict(self, max_bytes: int | None = None) -> list[Path]:
        """Delete least recently used entries until the folder's entries and live temporary files take at most
        max_bytes (default: the cache's limit), and the temporary files of writers that are gone. Returns what
        was deleted."""
        limit = self.max_bytes if max_bytes is None else max_bytes
        removed: list[Path] = []
        with self._locked() as held:
            if held is False or self.read_only:
                return removed
            total = 0
            for temp in self._temps():
                live = _live_writer_bytes(temp)
                if live is None:
                    removed.append(temp)
                else:
                    total += live
            entries = self.entries()
            total += sum(e.bytes for e in entries)
            for e in entries:
                if total <= limit:
                    break
                if self._delete(e):
                    removed.append(e.path)
                    total -= e.bytes
        return removed

    def _temps(self) -> list[Path]:
        with contextlib.suppress(OSError):
            return [self.folder / n for n in os.listdir(self.folder) if TEMP_NAME.fullmatch(n)]
        return []

    @contextlib.contextmanager
    def _locked(self) -> Iterator[bool | None]:
        """The folder's lock: yields True when held, False when another process kept it past LOCK_WAIT_S, and
        None when there is no regular lock file to hold (a link, folder or pipe is at its name, or the folder
        cannot be written); the caller then goes on without it."""
        fd = _open_lock(self.folder / LOCK_FILE)
        if fd is None:
            yield None
            return
        try:
            deadline = time.monotonic() + LOCK_WAIT_S
            held = _try_lock(fd)
            while not held and time.monotonic() < deadline:
                time.sleep(0.05)
                held = _try_lock(fd)
            try:
                yield held
            finally:
                if held:
                    _unlock(fd)
        finally:
            os.close(fd)

    # --- weights fingerprints ----------------------------------------------------------------------------

    def known_fingerprint(self, signature: str) -> str | None:
        return _KNOWN_FINGERPRINTS.get(signature) or self._read_index().get(signature)

    def remember_fingerprint(self, signature: str, fingerprint: str) -> None:
        """Record a fingerprint in memory for this process, and in the folder's index where it can be written."""
        _KNOWN_FINGERPRINTS[signature] = fingerprint
        if self.read_only:
            return
        try:
            self._make_folder()
            with self._locked() as held:
                if held is False:
                    return
                index = self._read_index()
                index.pop(signature, None)
                index[signature] = fingerprint  # newest last: the oldest go first
                kept = dict(list(index.items())[-_FINGERPRINTS_KEPT:])
                self._write(FINGERPRINTS, "fingerprints", lambda: _index_text(kept))
        except OSError as e:
            self._cannot_write(e)

    def _read_index(self) -> dict[str, str]:
        """The folder's fingerprint index; empty when absent, damaged, not a regular file, or (with the secret
        set) not sealed with it."""
        path = self.folder / FINGERPRINTS
        try:
            doc = parse_json(read_bounded(path, INDEX_LIMIT, "fingerprint index", follow_links=False), str(path),
                             "config")
        except Flux2DevError:
            return {}
        index = doc.get("fingerprints") if isinstance(doc, dict) else None
        if not isinstance(index, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in index.items()):
            return {}
        if _secret() is not None and not _sealed(doc.get("seal"), _index_message(index)):
            return {}
        return index


def _index_message(index: dict[str, str]) -> bytes:
    return json.dumps(list(index.items())).encode()


def _index_text(index: dict[str, str]) -> bytes:
    return json.dumps({"fingerprints": index, "seal": _seal(_index_message(index))}).encode()


def _fresh(folder: Path, stem: str) -> tuple[int, Path]:
    """A new, locked file in `folder` under an unpredictable name, created exclusively (a link or anything
    else already at the name makes creation fail, and another name is drawn)."""
    for _ in range(16):
        temp = folder / f".{stem}.{secrets.token_hex(16)}.tmp"
        try:
            fd = os.open(temp, os.O_WRONLY | _CREATE, 0o644)
        except FileExistsError:
            continue
        # Locked at once, so that eviction knows a live writer; a temporary file deleted before that (by an
        # eviction that found it unlocked) is given up for another.
        if _try_lock(fd) and os.fstat(fd).st_nlink > 0:
            return fd, temp
        os.close(fd)
    raise OSError(errno.EEXIST, "no fresh temporary file name could be created")


def _live_writer_bytes(path: Path) -> int | None:
    """The size of a temporary file whose writer still holds its lock; a writer that is gone (killed
    mid-write) left it unlocked, and it is deleted: None. A name that is no regular file counts 0."""
    try:
        fd = os.open(path, os.O_RDONLY | _OPEN_EXISTING)
    except OSError:
        return 0
    try:
        s = os.fstat(fd)
        if not stat.S_ISREG(s.st_mode):
            return 0
        if not _try_lock(fd):
            return s.st_size
        now = _regular(path)
        if now is None or (now.st_dev, now.st_ino) != (s.st_dev, s.st_ino):
            return 0  # replaced or renamed meanwhile: not this file any more
        try:
            path.unlink()
        except OSError:
            return 0
        return None
    finally:
        os.close(fd)


def _open_lock(path: Path) -> int | None:
    """The lock file, created exclusively if absent; None when what is at its name is not a regular file or
    it cannot be opened for writing."""
    try:
        fd = os.open(path, os.O_RDWR | _CREATE, 0o644)
    except FileExistsError:
        try:
            fd = os.open(path, os.O_RDWR | _OPEN_EXISTING)
        except OSError:
            return None
    except OSError:
        return None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        return None
    return fd


def _try_lock(fd: int) -> bool:
    """Take the exclusive lock without waiting: False only when another holder has it (a file system without
    locks counts as free)."""
    try:
        if fcntl is not None:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        else:
            os.lseek(fd, 0, os.SEEK_SET)  # msvcrt locks bytes from the current position: always the first one
            msvcrt.locking(fd, msvcrt.LK_NBLCK, 1)
    except OSError as e:
        return e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES, errno.EDEADLK)
    return True


def _unlock(fd: int) -> None:
    with contextlib.suppress(OSError):
        if fcntl is not None:
            fcntl.flock(fd, fcntl.LOCK_UN)
        else:
            os.lseek(fd, 0, os.SEEK_SET)
            msvcrt.locking(fd, msvcrt.LK_UNLCK, 1)


def weights_fingerprint(cache: ConditioningCache, signature: str, state_dict) -> str:
    """The content hash of an encoder's kept weights: from memory or the cache's index when its files are
    unchanged, else hashed from `state_dict()` (called only then: it may read the weights) and remembered."""
    known = cache.known_fingerprint(signature)
    if known is None:
        known = tensors_digest(state_dict())
        cache.remember_fingerprint(signature, known)
    return known
