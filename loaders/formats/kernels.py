"""How the quantizers and dequantizers run: in chunks of rows (`chunks`); by the compiled kernels where numba runs, on
torch's threads (`cpu_threads`); else by a reference path that gives the same bits, on half the cores (`few_threads`),
with one log line (docs/dequantization.md: Why numba, Fallback).

Kernel code (gguf_row.jit) is compiled on its first CPU call, in a copy of its module's globals with numba_ops.py's
ops bound, under a name holding a digest of the formats' sources, its machine code kept on disk (kernel_cache.py)."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import logging
import os
import sys
import threading
import types
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path

import numpy as np
import torch

log = logging.getLogger(__name__)

# Values per chunk: on the CPU a float32 scratch that fits the L3 cache; on a GPU a bound on the temporary memory.
# Every block is worked on alone, so the chunks change no byte.
CHUNK_VALUES = {"cpu": 1 << 20, "cuda": 1 << 24}


def chunks(rows: int, width: int, device: str = "cpu", values: int | None = None) -> list[slice]:
    """The rows of a [rows, width] tensor in chunks of about `values` (else CHUNK_VALUES), at least one row each."""
    step = max(1, (values or CHUNK_VALUES.get(device, CHUNK_VALUES["cuda"])) // width)
    return [slice(start, min(start + step, rows)) for start in range(0, rows, step)]


def cpu_threads() -> int:
    """How many threads the compiled kernels run on: torch's (all the cores unless the host or the user set fewer), as
    its matmuls. A step takes its runs of rows as threads come free (`run`), so a thread the system parks delays it by
    one run."""
    return max(1, torch.get_num_threads())


@contextlib.contextmanager
def few_threads(device: torch.device):
    """Torch's intra-op threads bounded to half the cores inside the block, on the CPU: the reference paths take
    hundreds of short parallel steps, each ending when its slowest thread does, and a parked thread stalls every one."""
    threads = torch.get_num_threads()
    bounded = min(threads, max(1, (os.cpu_count() or 1) // 2))
    if device.type != "cpu" or bounded == threads:
        yield
        return
    torch.set_num_threads(bounded)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def output(out: torch.Tensor | None, shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`out` checked to be a contiguous tensor of this shape, dtype and device, or a new one."""
    shape = tuple(int(s) for s in shape)
    if out is None:
        return torch.empty(shape, dtype=dtype, device=device)
    if tuple(out.shape) != shape or out.dtype != dtype or out.device != device or not out.is_contiguous():
        raise ValueError(
            f"out must be a contiguous {dtype} tensor of shape {list(shape)} on {device}, "
            f"not {out.dtype} {list(out.shape)} on {out.device}"
        )
    return out


def fill_by_rows(values: torch.Tensor, fill: Callable[[slice, torch.Tensor], None]) -> None:
    """Writes `values` ([rows, width]) chunk by chunk: fill(rows, v) puts those rows' float32 values into v."""
    rows, width = values.shape
    parts = chunks(rows, width, values.device.type)
    direct = values.dtype == torch.float32
    scratch = None if direct else torch.empty((parts[0].stop if parts else 0, width), device=values.device)
    for part in parts:
        v = values[part] if direct else scratch[: part.stop - part.start]
        fill(part, v)
        if not direct:
            values[part].copy_(v)


# --- the compiled kernels -----------------------------------------------------------------------------------------

# A compiled module's name: this, its source's stem and a digest of the formats' sources
MODULE_PREFIX = "flux2dev_"
# Output dtype -> how its bits are handed to the kernels (numba has no fp16 or bfloat16 arrays)
VIEWS = {torch.float32: torch.float32, torch.float16: torch.uint16, torch.bfloat16: torch.int16}
_FORMATS = Path(__file__).parent


@functools.cache
def _digest() -> str:
    """A digest of every source in this folder, where all kernel code and what it calls lives."""
    sources = sorted(_FORMATS.glob("*.py"))
    return hashlib.sha256(b"".join(p.name.encode() + p.read_bytes() for p in sources)).hexdigest()[:16]


@functools.cache
def numba_ops():
    """numba_ops.py loaded (under its own name), or None (logged once) where numba cannot be imported."""
    try:
        from .kernel_cache import keep_on_disk  # imports numba: on first use, not with the pack

        name = f"{MODULE_PREFIX}numba_ops_{_digest()}"
        if name not in sys.modules:
            spec = importlib.util.spec_from_file_location(name, _FORMATS / "numba_ops.py")
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            sys.modules[name] = module
            keep_on_disk((module.convert, module.widen_bf16), _digest())
        return sys.modules[name]
    except Exception as e:  # a missing numba, or one built for another numpy: the reference paths give the same bits
        log.warning("The compiled CPU kernels need numba (%s: %s); the slower reference paths (torch, or the kernel "
                    "code as plain Python where a type has no torch quantizer) are used.", type(e).__name__, e)
        return None


def _is_kernel_code(value) -> bool:
    return isinstance(value, types.FunctionType) and hasattr(value, "jit_options")


_NAMESPACES: dict[tuple[str, bool], dict] = {}
_COMPILED: dict[tuple[Callable, bool], object] = {}
_COMPILING = threading.RLock()  # one thread builds the namespaces and dispatchers at a time


def _namespace(module: str, vector: bool) -> dict:
    """The globals the kernel code of `module` is compiled in: a copy of the module's, its kernel code compiled and
    numba_ops' OPS bound (the VECTOR ones only where `vector`)."""
    if (module, vector) not in _NAMESPACES:
        name = f"{MODULE_PREFIX}{module.rpartition('.')[2]}_{_digest()}{'' if vector else '_loops'}"
        copy = types.ModuleType(name)
        copy.__dict__.update({k: v for k, v in vars(sys.modules[module]).items() if k not in ("__name__", "__spec__")})
        sys.modules[name] = copy
        ops = numba_ops()
        _NAMESPACES[module, vector] = namespace = copy.__dict__
        for key, value in list(namespace.items()):
            if _is_kernel_code(value) and not (key in ops.OPS and (vector or key not in ops.VECTOR)):
                namespace[key] = compiled(value, vector)
        namespace.update({k: v for k, v in ops.OPS.items() if k in namespace and (vector or k not in ops.VECTOR)})
    return _NAMESPACES[module, vector]


def compiled(code: Callable, vector: bool = True):
    """Kernel code as a numba dispatcher (compiled at its first call); without `vector`, with the plain loops the
    vector ops replace (their reference in the tests and the bench)."""
    with _COMPILING:
        if (code, vector) not in _COMPILED:
            from numba import njit

            home = _namespace(code.__module__, vector)
            cells = tuple(types.CellType(compiled(c.cell_contents, vector) if _is_kernel_code(c.cell_contents)
                                         else c.cell_contents) for c in code.__closure__ or ())
            function = types.FunctionType(code.__code__, home, code.__name__, code.__defaults__, cells)
            _COMPILED[code, vector] = njit(**code.jit_options)(function)
        return _COMPILED[code, vector]


def _edge_values() -> np.ndarray:
    """float32 values on every side of fp16's and bfloat16's rounding and range limits, for every sign and exponent."""
    high = np.arange(1 << 9, dtype=np.uint32) << 23  # sign and exponent
    ties = [(1 << (n - 1)) | odd << n for n in range(13, 24) for odd in (0, 1)]
    low = np.array(sorted({m + e for m in ties for e in (-1, 0, 1)} | {0, 1, 0x7FFFFF}), np.uint32) & 0x7FFFFF
    return (high[:, None] | low[None, :]).reshape(-1).view(np.float32)


@functools.cache
def _converts(dtype: torch.dtype) -> bool:
    """Whether the kernels' conversion to `dtype` equals torch's on the edge values (NaN: both NaN)."""
    values = torch.from_numpy(_edge_values())
    want = values.to(dtype)
    got = torch.empty_like(want)
    try:
        numba_ops().convert(values.numpy(), got.view(VIEWS[dtype]).numpy())
    except Exception as e:  # a failed compilation: the torch path still works
        log.warning("The compiled CPU kernels could not be compiled for %s (%s: %s); the torch path is used.",
                    dtype, type(e).__name__, e)
        return False
    nan = torch.isnan(want)
    bits = VIEWS[dtype]
    same = torch.equal(torch.isnan(got), nan) and torch.equal(got[~nan].view(bits), want[~nan].view(bits))
    if not same:
        log.warning("The compiled CPU kernels convert to %s unlike torch on this machine; the torch path is used.",
                    dtype)
    return same


def _runs(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether compiled kernels can write `dtype` on `device`."""
    if device.type != "cpu" or dtype not in VIEWS or numba_ops() is None:
        return False
    return dtype == torch.float32 or _converts(dtype)


def path(device, dtype: torch.dtype) -> str:
    """Which dequantizers run on this device for this output dtype: "numba" or "torch"."""
    return "numba" if _runs(torch.device(device), dtype) else "torch"


# Kernels ("Q8_0 dequantization", "fp8", ...) that failed to compile in this process: their reference paths serve
_FAILED: set[str] = set()


def kernel(code: Callable | None, name: str, device: torch.device, dtype: torch.dtype):
    """The compiled kernel of `code` (named `name` in the log) where it can write `dtype` on `device`, else None."""
    if code is None or name in _FAILED or not _runs(device, dtype):
        return None
    return _entry(code)


@functools.cache
def _entry(code: Callable):
    """A kernel called from Python: compiled, its machine code kept on disk."""
    from .kernel_cache import keep_on_disk

    dispatcher = compiled(code)
    keep_on_disk((dispatcher,), _digest())
    return dispatcher


def forget() -> None:
    """Drops every loaded and compiled kernel: the next call loads them again."""
    for cached in (numba_ops, _converts, _entry):
        cached.cache_clear()
    _NAMESPACES.clear()
    _COMPILED.clear()


@functools.cache
def _pool(threads: int) -> ThreadPoolExecutor:
    """The kernels' pool of `threads` threads."""
    return ThreadPoolExecutor(threads, thread_name_prefix="flux2dev-kernels")


def run(name: str, rows: int, work: Callable[[int, int], object], threads: int | None = None) -> bool:
    """work(first, stop) over all rows by the kernel `name`, on `threads` threads (else cpu_threads()) in runs of rows,
    four per thread, each taken as a thread comes free. False where that kernel cannot be compiled (logged once)."""
    if name in _FAILED:
        return False
    threads = threads or cpu_threads()
    try:
        if threads == 1 or rows < 2 * threads:
            work(0, rows)
        else:
            runs = chunks(rows, 1, values=-(-rows // (4 * threads)))
            done = [_pool(threads).submit(work, part.start, part.stop) for part in runs]
            wait(done)
            for future in done:
                future.result()
    except Exception as e:  # a failed compilation: the reference path gives the same bits
        _FAILED.add(name)
        log.warning("The compiled CPU kernel for %s could not be compiled (%s: %s); its reference path is used.",
                    name, type(e).__name__, e)
        return False
    return True


def array(out: torch.Tensor, width: int) -> np.ndarray:
    """`out` as the numpy array of rows of `width` values the kernels write (VIEWS)."""
    return out.view(VIEWS[out.dtype]).view(-1, width).numpy()


@functools.cache
def halves() -> np.ndarray:
    """fp16 bits -> float32, by numpy (gguf-py's own conversion)."""
    return np.arange(1 << 16, dtype=np.uint16).view(np.float16).astype(np.float32)


def dequantize(row, blocks: torch.Tensor, out: torch.Tensor) -> bool:
    """GGUF blocks [n, block bytes] into `out` by the row's one-pass kernel, where it runs here; else False."""
    dispatcher = kernel(row.read_kernel, f"{row.name} dequantization", blocks.device, out.dtype)
    if dispatcher is None:
        return False
    b, o, h = blocks.numpy(), array(out, out.numel() // blocks.shape[0]), halves()
    return run(f"{row.name} dequantization", len(b), lambda first, stop: dispatcher(b[first:stop], o[first:stop], h))


def write_path(row) -> str:
    """Which quantizer writes `row` here: "numba", else its reference path, "torch" or "python"."""
    if kernel(row.write_kernel, f"{row.name} quantization", torch.device("cpu"), _written_as(row)) is not None:
        return "numba"
    return "torch" if row.write_torch else "python"


def _written_as(row) -> torch.dtype:
    """The conversion a row's quantizer writes its fields with: BF16's values bfloat16, every other field fp16."""
    return torch.bfloat16 if row.float_dtype == "bfloat16" else torch.float16


# bfloat16 values widened to float32 at a time (256 KiB a thread), quantized while still in the core's cache
_WIDENED_VALUES = 1 << 16


def _widening(quantize, widen):
    """`quantize` for blocks of bfloat16 bits: each run of blocks widened (exactly) to float32 first."""
    def run_widened(x: np.ndarray, o: np.ndarray) -> bool:
        scratch = np.empty((min(len(x), max(1, _WIDENED_VALUES // x.shape[1])), x.shape[1]), np.float32)
        for part in chunks(len(x), x.shape[1], values=_WIDENED_VALUES):
            values = scratch[: part.stop - part.start]
            widen(x[part], values)
            if not quantize(values, o[part]):
                return False
        return True

    return run_widened


def quantize(row, values: torch.Tensor, out: torch.Tensor, threads: int | None = None) -> bool | None:
    """Rows of `values` ([n, columns], any float dtype, on the CPU) quantized into `out` (uint8 [n, row bytes]) by the
    row's compiled kernel: True; False at a value the type cannot hold; None where the kernel cannot run here."""
    name = f"{row.name} quantization"
    dispatcher = kernel(row.write_kernel, name, values.device, _written_as(row))
    if dispatcher is None:
        return None
    whole = values.dtype in (torch.float32, torch.bfloat16) and values.is_contiguous()
    parts = [slice(0, values.shape[0])] if whole else chunks(values.shape[0], values.shape[1])
    scratch = None if whole else torch.empty((parts[0].stop if parts else 0, values.shape[1]))
    fits = []
    for part in parts:
        v = values[part] if whole else scratch[: part.stop - part.start].copy_(values[part])
        b = v.view(VIEWS[v.dtype]).numpy().reshape(-1, row.block_values)
        o = out[part].numpy().reshape(-1, row.block_bytes)
        quantize_blocks = _widening(dispatcher, numba_ops().widen_bf16) if v.dtype == torch.bfloat16 else dispatcher
        if not run(name, b.shape[0], lambda first, stop: fits.append(quantize_blocks(b[first:stop], o[first:stop])),
                   threads):
            return None
        if not all(fits):
            return False
    return True
