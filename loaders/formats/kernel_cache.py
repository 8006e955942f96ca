"""The on-disk cache of the compiled kernels' machine code (kernels.py), in place of numba's cache=True, which trusts
its files (docs/dequantization.md: Why numba). An entry is checked (its digest, then the kernel and signature it was
written for) before numba sees it; one that fails is compiled again and rewritten, one that cannot be written is
skipped. numba's private parts it uses: a dispatcher's cache slot and its interface (NullCache), and a compiled
result's _reduce and _rebuild, as numba's own cache calls them."""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import pickle
import sys
import tempfile
import uuid
from pathlib import Path

import numba
from llvmlite import binding
from numba.core import compiler, config
from numba.core.caching import NullCache
from numba.core.dispatcher import Dispatcher
from numba.core.serialize import dumps
from numba.misc.appdirs import AppDirs

log = logging.getLogger(__name__)

# What every entry starts with, followed by the SHA-256 of the rest: numba's pickle of (key, compiled code)
_MAGIC = b"flux2dev numba kernel 1\n"


def _bases() -> tuple[str, ...]:
    """Where the folder may go, in the order tried."""
    return (*([config.CACHE_DIR] if config.CACHE_DIR else []), str(Path(__file__).with_name("__pycache__")),
            AppDirs(appname="numba", appauthor=False).user_cache_dir)


@functools.cache
def folder(digest: str) -> Path | None:
    """The cache folder of the kernels compiled from sources of `digest`, or None (logged once) where none can be
    written."""
    stamp = "\n".join((digest, numba.__version__, sys.version, binding.get_host_cpu_name(),
                       binding.get_host_cpu_features().flatten()))
    name = f"flux2dev-kernels-{hashlib.sha256(stamp.encode()).hexdigest()[:16]}"
    for base in _bases():
        try:
            path = Path(base) / name
            path.mkdir(parents=True, exist_ok=True)
            tempfile.TemporaryFile(dir=path).close()
            return path
        except OSError:
            continue
    log.warning("No folder can be written for the compiled kernels (tried %s); they are compiled again in every "
                "process, which takes seconds to a minute.", ", ".join(_bases()))
    return None


def keep_on_disk(kernels, digest: str) -> None:
    """Each numba dispatcher in `kernels` (compiled from sources of `digest`) loads and saves its code in this cache."""
    where = folder(digest)
    for kernel in kernels:
        kernel._cache = KernelCache(kernel.py_func, where)


def _closure_value(value):
    """A value a kernel closes over, as its key holds it: a numba function by its name and code (numba's pickle of a
    dispatcher differs between processes), a constant as it is."""
    if isinstance(value, Dispatcher):
        code = value.py_func.__code__
        return value.py_func.__qualname__, code.co_code, repr(code.co_consts)
    return value


class KernelCache(NullCache):
    """One kernel's entries, one file per signature (numba's cache interface: load_overload before compiling,
    save_overload after)."""

    def __init__(self, py_func, where: Path | None):
        self._py_func, self._folder = py_func, where
        closure = tuple(_closure_value(cell.cell_contents) for cell in py_func.__closure__ or ())
        self._code = (py_func.__qualname__, hashlib.sha256(py_func.__code__.co_code).hexdigest(),
                      hashlib.sha256(dumps(closure) if closure else b"").hexdigest())

    @property
    def cache_path(self):
        return str(self._folder)

    def _key(self, sig, codegen) -> tuple:
        return (*self._code, repr(sig), codegen.magic_tuple())

    def _path(self, key: tuple) -> Path:
        digest = hashlib.sha256(repr(key).encode()).hexdigest()[:32]
        return self._folder / f"{self._py_func.__name__}-{digest}.nbk"

    def load_overload(self, sig, target_context):
        """The compiled code of `sig`, or None where there is no entry or it fails a check (then it is rewritten)."""
        if self._folder is None:
            return None
        target_context.refresh()
        key = self._key(sig, target_context.codegen())
        path = self._path(key)
        try:
            data = path.read_bytes()
        except OSError:
            return None
        body = data[len(_MAGIC) + 32 :]
        try:
            if not data.startswith(_MAGIC) or data[len(_MAGIC) : len(_MAGIC) + 32] != hashlib.sha256(body).digest():
                raise ValueError("damaged")
            stored_key, payload = pickle.loads(body)
            if stored_key != key:
                raise ValueError(f"written for {stored_key[0]} {stored_key[3]}")
            return compiler.CompileResult._rebuild(target_context, *payload)
        except Exception as e:  # whatever the entry holds, the kernel compiles again
            log.info("The compiled kernel entry %s cannot be used (%s: %s); the kernel is compiled again.",
                     path, type(e).__name__, e)
            return None

    def save_overload(self, sig, cres):
        """Writes the entry of `sig` under a fresh name, then renames it onto the entry's; where that fails, the
        kernel compiled in memory runs all the same."""
        if self._folder is None or cres.library.has_dynamic_globals or any(not x.can_cache for x in cres.lifted):
            return
        key = self._key(sig, cres.codegen)
        body = dumps((key, cres._reduce()))
        path = self._path(key)
        fresh = path.with_name(f"{path.name}.{uuid.uuid4().hex[:16]}.tmp")
        try:
            f = open(fresh, "xb")
        except OSError as e:
            _unsaved(self._folder, e)
            return
        try:
            with f:
                f.write(_MAGIC + hashlib.sha256(body).digest() + body)
            os.replace(fresh, path)
        except BaseException as e:
            fresh.unlink(missing_ok=True)  # the pack's own file, created above
            if not isinstance(e, OSError):
                raise
            _unsaved(self._folder, e)


# Folders that a kernel could not be saved in (logged once each)
_UNSAVED: set[Path] = set()


def _unsaved(where: Path, error: OSError) -> None:
    if where in _UNSAVED:
        return
    _UNSAVED.add(where)
    log.warning("Compiled kernels could not be saved in %s (%s); they are compiled again in the next process, which "
                "takes seconds to a minute.", where, error.strerror or error)
