"""The pack's compiled CPU kernels, in one place: numba_kernels.py (the one-pass dequantizers of GGUF, fp8 and NVFP4,
and the legacy GGUF quantizers) and kquant_kernels.py (ggml's K-quant quantizers). Each call says whether its kernel
ran; where it could not (numba missing or unusable, a kernel that failed to compile, a GPU tensor, another dtype), the
caller runs its reference path (torch, or the K quantizers' plain Python), which gives the same bits.

A kernel source is loaded on the first CPU call that needs it, not with the pack, under a name holding a digest of
its source (load_by_digest), its machine code kept on disk (kernel_cache.py). A source that cannot be loaded leaves
its kernels to the reference path, and a kernel that cannot be compiled leaves its type there: each with one log
line, never a failed load. The kernels run in runs of rows on one thread pool (_by_rows). The one-pass kernels'
conversions to fp16 and bfloat16 are checked once per process against torch's own cast on the values where
conversions differ (halfway cases, subnormals, overflow, infinities): a machine where they disagree keeps the
torch path for that dtype, with a warning. NaN payloads are not compared: torch's own CPU cast gives different
NaN bits in its vectorized and scalar loops.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import logging
import sys
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from .steps import cpu_threads

log = logging.getLogger(__name__)

# Output dtype -> how its bits are handed to the kernels (numba has no fp16 or bfloat16 arrays).
_VIEWS = {torch.float32: torch.float32, torch.float16: torch.uint16, torch.bfloat16: torch.int16}
# A kernel module's name in sys.modules: this, its source's stem and a digest of its source
MODULE_PREFIX = "flux2dev_"


def load_by_digest(source: Path, kernels):
    """The module at `source` (which imports nothing of the pack), in sys.modules under MODULE_PREFIX, its stem and a
    digest of its source, executed once per process; kernels(module) returns the numba dispatchers whose machine code
    is kept on disk (kernel_cache.py), compiling them first where the module leaves that to its loader.

    numba's cached machine code records the name of the module it was compiled in and imports that name again
    when a later process loads it, while ComfyUI names a custom node's modules by the folder's path and the
    command line names them comfyui_flux2dev. Under this name the cache serves every process, whatever the pack's
    folder is called or wherever it has moved."""
    name = f"{MODULE_PREFIX}{source.stem}_{hashlib.sha256(source.read_bytes()).hexdigest()[:16]}"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, source)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        try:
            from .kernel_cache import keep_on_disk  # imports numba: on first use, not with the pack

            spec.loader.exec_module(module)
            keep_on_disk(kernels(module), source, name)
        except BaseException:
            del sys.modules[name]
            raise
    return sys.modules[name]


def _compile_kquants(module) -> list:
    from numba import njit

    # the GIL released while a kernel runs; a float division by zero gives C's infinity or NaN (the searches divide
    # where C's never reach), not an error
    return module.compile_all(njit(nogil=True, error_model="numpy"))


# Kernel source -> (what its kernels are and the path that stands in for them, as the log names them; its numba
# dispatchers, compiled where the source leaves that to its loader)
_SOURCES = {
    "numba_kernels": ("The one-pass CPU dequantizers and GGUF quantizers", "slower torch path",
                      lambda module: module.CACHED),
    "kquant_kernels": ("The compiled K-quant quantizers", "far slower plain Python path", _compile_kquants),
}


@functools.cache
def kernel_module(stem: str):
    """The kernel source `stem` (of _SOURCES) loaded, or None (with the reason logged once) where numba cannot be
    imported."""
    what, fallback, dispatchers = _SOURCES[stem]
    try:
        return load_by_digest(Path(__file__).with_name(stem + ".py"), dispatchers)
    except Exception as e:  # a missing numba, or one built for another numpy: the reference path gives the same bits
        log.warning("%s need numba (%s: %s); the %s is used.", what, type(e).__name__, e, fallback)
        return None


def _kernels():
    """numba_kernels loaded, or None."""
    return kernel_module("numba_kernels")


def _edge_values() -> np.ndarray:
    """float32 values on every side of fp16's and bfloat16's rounding and range limits: every sign and
    exponent with mantissas at a tie for every number of dropped bits (13 for fp16's normals, up to 23
    for its subnormals, 16 for bfloat16), one below and one above it, and the mantissa extremes."""
    high = np.arange(1 << 9, dtype=np.uint32) << 23  # sign and exponent
    ties = [(1 << (n - 1)) | odd << n for n in range(13, 24) for odd in (0, 1)]
    low = np.array(sorted({m + e for m in ties for e in (-1, 0, 1)} | {0, 1, 0x7FFFFF}), np.uint32) & 0x7FFFFF
    return (high[:, None] | low[None, :]).reshape(-1).view(np.float32)


@functools.cache
def _converts(dtype: torch.dtype) -> bool:
    """Whether the kernels' conversion to `dtype` equals torch's on the edge values (NaN: both NaN)."""
    kernels = _kernels()
    values = torch.from_numpy(_edge_values())
    want = values.to(dtype)
    got = torch.empty_like(want)
    try:
        kernels.convert(values.numpy(), got.view(_VIEWS[dtype]).numpy())
    except Exception as e:  # a failed compilation: the torch path still works
        log.warning("The one-pass CPU dequantizers could not be compiled for %s (%s: %s); the torch path is used.",
                    dtype, type(e).__name__, e)
        return False
    nan = torch.isnan(want)
    same = torch.equal(torch.isnan(got), nan) and torch.equal(got[~nan].view(_VIEWS[dtype]),
                                                              want[~nan].view(_VIEWS[dtype]))
    if not same:
        log.warning("The one-pass CPU dequantizers convert to %s unlike torch on this machine; the torch path is "
                    "used.", dtype)
    return same


def path(device: torch.device, dtype: torch.dtype) -> str:
    """Which dequantizer runs on this device for this output dtype: "numba" or "torch"."""
    return "numba" if _runs(torch.device(device), dtype) else "torch"


def _runs(device: torch.device, dtype: torch.dtype) -> bool:
    if device.type != "cpu" or dtype not in _VIEWS or _kernels() is None:
        return False
    return dtype == torch.float32 or _converts(dtype)


@functools.cache
def _pool(threads: int) -> ThreadPoolExecutor:
    """The kernels' pool of `threads` threads: in practice one pool, as every caller runs on cpu_threads() threads
    or on its own thread alone."""
    return ThreadPoolExecutor(threads, thread_name_prefix="flux2dev-kernels")


def _by_rows(rows: int, run, threads: int) -> None:
    """run(first, stop) over all rows: at once on one thread, or on `threads` threads in runs of rows (four per
    thread) that each thread takes as it comes free, so that a thread the scheduler parks holds up little.
    The kernels release the GIL. Every run has ended when this returns or raises."""
    if threads == 1 or rows < 2 * threads:
        run(0, rows)
        return
    step = -(-rows // (4 * threads))
    done = [_pool(threads).submit(run, first, min(first + step, rows)) for first in range(0, rows, step)]
    wait(done)
    for future in done:
        future.result()


# Kernels ("Q4_K dequantization", "Q6_K quantization", "fp8", ...) that failed to compile in this process: their
# types take the reference path.
_FAILED: set[str] = set()


def _ran(name: str, rows: int, run, threads: int | None = None) -> bool:
    """run(first, stop) over all rows (_by_rows, on `threads` threads, half the cores where not given) with the kernel
    `name`; False where that kernel cannot be compiled here (logged once), so that the caller's reference path writes
    the whole output instead. (A cache entry that cannot be read or written costs a compilation, not the kernel:
    kernel_cache.py.)"""
    if name in _FAILED:
        return False
    try:
        _by_rows(rows, run, threads or cpu_threads())
    except Exception as e:  # a failed compilation: the reference path gives the same bits
        _FAILED.add(name)
        log.warning("The compiled CPU kernel for %s could not be compiled (%s: %s); its reference path is used.",
                    name, type(e).__name__, e)
        return False
    return True


def _out(out: torch.Tensor, width: int) -> np.ndarray:
    return out.view(_VIEWS[out.dtype]).view(-1, width).numpy()


@functools.cache
def _halves() -> np.ndarray:
    """fp16 bits -> float32, by numpy (the reference's own conversion)."""
    return np.arange(1 << 16, dtype=np.uint16).view(np.float16).astype(np.float32)


def gguf(type_name: str, blocks: torch.Tensor, out: torch.Tensor) -> bool:
    """GGUF blocks [n, type size] (uint8, contiguous) into `out` (n * block size values, contiguous), if the
    one-pass kernel runs here; False leaves `out` untouched."""
    if not _runs(blocks.device, out.dtype) or type_name not in _kernels().GGUF:
        return False
    kernel, b, o, halves = (_kernels().GGUF[type_name], blocks.numpy(), _out(out, out.numel() // blocks.shape[0]),
                            _halves())
    return _ran(f"{type_name} dequantization", b.shape[0],
                lambda first, stop: kernel(b[first:stop], o[first:stop], halves))


# The conversion a quantizer's fields are written with, where it is not fp16 (every block type's scales, F16's values)
_WRITTEN_AS = {"BF16": torch.bfloat16}


def gguf_quantize(type_name: str, blocks: torch.Tensor, out: torch.Tensor) -> bool:
    """float32 or bfloat16 blocks [n, block size] quantized into `out` (uint8 [n, type size]), both contiguous,
    if the one-pass kernel runs here and every value fits the type; False: not run, or a value that does not
    fit (the torch path then refuses it, saying why), with `out` incomplete."""
    kernels = _kernels() if blocks.device.type == "cpu" else None
    if kernels is None or type_name not in kernels.QUANTIZE or blocks.dtype not in (torch.float32, torch.bfloat16) \
            or not (blocks.is_contiguous() and out.is_contiguous()) \
            or not _converts(_WRITTEN_AS.get(type_name, torch.float16)):
        return False
    if tuple(blocks.shape) != (out.shape[0], GGML_QUANT_SIZES[GGMLQuantizationType[type_name]][0]) \
            or out.shape[1] != GGML_QUANT_SIZES[GGMLQuantizationType[type_name]][1] or out.dtype != torch.uint8:
        raise ValueError(f"{type_name} blocks {list(blocks.shape)} do not match out {list(out.shape)} {out.dtype}")
    b = blocks.view(_VIEWS[blocks.dtype]).numpy()
    kernel, o, fits = kernels.QUANTIZE[type_name], out.numpy(), []
    if blocks.dtype == torch.bfloat16:
        kernel = _widening(kernel, kernels.widen_bf16)
    ran = _ran(f"{type_name} quantization", b.shape[0],
               lambda first, stop: fits.append(kernel(b[first:stop], o[first:stop])))
    return ran and all(fits)


# bfloat16 values widened at a time: 256 KiB of float32 per thread, quantized while still in the core's cache.
# The vector kernels reading bfloat16 themselves ran at half this speed on the machines measured.
_WIDENED_VALUES = 1 << 16


def _widening(kernel, widen):
    """`kernel` for blocks of bfloat16 bits: each run of blocks widened (exactly) to float32 first."""
    def run(x: np.ndarray, o: np.ndarray) -> bool:
        step = max(1, _WIDENED_VALUES // x.shape[1])
        scratch = np.empty((min(len(x), step), x.shape[1]), np.float32)
        for first in range(0, len(x), step):
            part, values = x[first : first + step], scratch[: min(step, len(x) - first)]
            widen(part, values)
            if not kernel(values, o[first : first + step]):
                return False
        return True

    return run


@functools.cache
def _fp8_book(dtype: torch.dtype) -> np.ndarray:
    """fp8 byte -> its float32 value, by torch's cast."""
    return torch.arange(256, dtype=torch.uint8).view(dtype).to(torch.float32).numpy()


def fp8(codes: torch.Tensor, fp8_dtype: torch.dtype, scale: torch.Tensor, out: torch.Tensor) -> bool:
    """float32(codes read as `fp8_dtype`) * scale (float32, one value or one per row of codes [rows, n]) into
    `out`; False: not run."""
    if not _runs(codes.device, out.dtype):
        return False
    kernel, book = _kernels().fp8, _fp8_book(fp8_dtype)
    c, s, o = codes.contiguous().numpy(), scale.reshape(-1).contiguous().numpy(), _out(out, codes.shape[1])
    return _ran("fp8", c.shape[0],
                lambda first, stop: kernel(c[first:stop], s if s.shape[0] == 1 else s[first:stop], o[first:stop], book))


def nvfp4(packed: torch.Tensor, tiled_scales: torch.Tensor, tensor_scale: torch.Tensor, e2m1: tuple,
          out: torch.Tensor) -> bool:
    """NVFP4 into `out` (packed_dequant.dequantize_nvfp4 has checked the sizes); False: not run."""
    if not _runs(packed.device, out.dtype):
        return False
    tiled = tiled_scales.contiguous().view(torch.uint8).reshape(-1).numpy()
    scale = tensor_scale.to(torch.float32).reshape(1).numpy()
    kernel, book, values = _kernels().nvfp4, _fp8_book(tiled_scales.dtype), np.array(e2m1, np.float32)
    p, o = packed.contiguous().numpy(), _out(out, packed.shape[1] * 2)
    return _ran("NVFP4", p.shape[0],
                lambda first, stop: kernel(p[first:stop], tiled, scale, o[first:stop], book, values, first))


def kquant_path(type_name: str) -> str:
    """Which K-quant quantizer runs for `type_name` here: "numba" or "python"."""
    return "python" if f"{type_name} quantization" in _FAILED or kernel_module("kquant_kernels") is None else "numba"


def kquantize(type_name: str, blocks: np.ndarray, out: np.ndarray, threads: int | None = None) -> bool:
    """float32 blocks [n, 256] quantized into `out` (uint8 [n, type size]) by the compiled K-quant kernel of
    `type_name`, on `threads` threads (half the cores where not given); False: not run, `out` incomplete."""
    if kquant_path(type_name) != "numba":
        return False
    module = kernel_module("kquant_kernels")
    kernel = getattr(module, module.KERNELS[type_name])
    return _ran(f"{type_name} quantization", blocks.shape[0],
                lambda first, stop: kernel(blocks[first:stop], out[first:stop]), threads)
