"""ggml's own K-quant quantizers (quantize_row_q*_K_ref, what llama-quantize runs without an importance matrix),
the independent reference of the pack's (loaders/formats/gguf_k.py).

ggml-quants.c and the headers it includes come from llama-cpp-python's source distribution on PyPI (it vendors
llama.cpp) and are compiled alone, once, with the system C compiler into a shared library kept in the test
environment (.venv/ggml-reference/<version>/). Plain C semantics: -O2 without -march or fast-math flags, and no
fused multiply-add, so every float32 operation rounds where the C source has it. Nothing of it ships with the
pack. Without a C compiler or the network, `reference()` says why, for the tests to skip."""

from __future__ import annotations

import ctypes
import functools
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import numpy as np

VERSION = "0.3.36"
_SDIST = f"llama_cpp_python-{VERSION}"
_GGML = f"{_SDIST}/vendor/llama.cpp/ggml"
# The files the quantizers need: the C source, its headers, and the CPU backend's headers it includes.
_MEMBERS = ("include/", "src/ggml-quants.c", "src/ggml-quants.h", "src/ggml-common.h", "src/ggml-impl.h",
            "src/ggml-cpu/")
# Four ggml functions that ggml-quants.c references outside the quantizers it is built for.
_STUBS = """#include <stdlib.h>
#include "ggml.h"
void ggml_abort(const char * file, int line, const char * fmt, ...) { abort(); }
size_t ggml_row_size(enum ggml_type type, int64_t ne) { abort(); }
const char * ggml_type_name(enum ggml_type type) { abort(); }
size_t ggml_type_size(enum ggml_type type) { abort(); }
"""
# NDEBUG as ggml's release builds: its asserts are not part of what llama-quantize computes.
_FLAGS = ("-O2", "-shared", "-fPIC", "-std=gnu11", "-ffp-contract=off", "-DNDEBUG")
LIBRARY = Path(sys.prefix) / "ggml-reference" / VERSION / "libggml-quants-ref.so"
K_TYPES = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")


class Unavailable(RuntimeError):
    """The reference cannot be built here (no C compiler, no network); the message says which."""


def _download(into: Path) -> Path:
    done = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                           "--retries", "1", "--timeout", "30", f"llama-cpp-python=={VERSION}", "-d", str(into)],
                          capture_output=True, text=True, timeout=900)
    sdist = into / f"{_SDIST}.tar.gz"
    if done.returncode or not sdist.is_file():
        raise Unavailable(f"llama-cpp-python {VERSION}'s sdist could not be downloaded: {done.stderr.strip()[-400:]}")
    return sdist


def _extract(sdist: Path, into: Path) -> Path:
    """The ggml files of _MEMBERS (regular files only) under into/ggml."""
    wanted = tuple(f"{_GGML}/{member}" for member in _MEMBERS)
    with tarfile.open(sdist) as archive:
        members = [m for m in archive.getmembers() if m.isfile() and m.name.startswith(wanted)]
        archive.extractall(into, members=members, filter="data")
    return into / _GGML


def build() -> Path:
    """The reference library, built into LIBRARY where it is not there yet (under a fresh name first, so a build
    that fails or runs beside another leaves no half-written library)."""
    if LIBRARY.is_file():
        return LIBRARY
    compiler = shutil.which(os.environ.get("CC", "gcc")) or shutil.which("cc")
    if compiler is None:
        raise Unavailable("no C compiler (gcc or cc) to build ggml's reference quantizers")
    LIBRARY.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=LIBRARY.parent) as scratch:
        scratch = Path(scratch)
        ggml = _extract(_download(scratch), scratch)
        (scratch / "stubs.c").write_text(_STUBS)
        built = scratch / LIBRARY.name
        done = subprocess.run([compiler, *_FLAGS, f"-I{ggml / 'include'}", f"-I{ggml / 'src'}",
                               f"-I{ggml / 'src' / 'ggml-cpu'}", str(ggml / "src" / "ggml-quants.c"),
                               str(scratch / "stubs.c"), "-o", str(built), "-lm"],
                              capture_output=True, text=True, timeout=300)
        if done.returncode:
            raise Unavailable(f"ggml-quants.c did not compile with {compiler}: {done.stderr.strip()[-400:]}")
        os.replace(built, LIBRARY)
    return LIBRARY


def _function(type_name: str) -> str:
    return f"quantize_row_{type_name[:-1].lower()}K_ref"  # Q4_K: quantize_row_q4_K_ref


@functools.cache
def _library() -> ctypes.CDLL:
    library = ctypes.CDLL(str(build()))
    for name in K_TYPES:
        function = getattr(library, _function(name))
        function.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)
        function.restype = None
    return library


def reference(type_name: str, rows: np.ndarray, type_size: int) -> np.ndarray:
    """ggml's bytes of float32 `rows` [n, columns] in `type_name`: uint8 [n, columns / 256 * type_size]."""
    rows = np.ascontiguousarray(rows, dtype=np.float32)
    out = np.zeros((rows.shape[0], rows.shape[1] // 256 * type_size), np.uint8)
    function = getattr(_library(), _function(type_name))
    for x, y in zip(rows, out):
        function(x.ctypes.data, y.ctypes.data, x.size)
    return out
