"""A GGUF type's row (GGUFType): its block and the functions that read and write it, as ggml's type_traits rows
carry theirs, and what those functions share. The rows live beside their functions, one module per family
(gguf_float.py, gguf_legacy.py, gguf_k.py); gguf_types.py collects them and dispatches.

Kernel code is plain Python marked @jit, which kernels.py compiles with numba where numba runs, binding the ops below
(bits, put, ...) to numba_ops.py's; their plain versions keep the pack working without it."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch
from gguf import GGMLQuantizationType as Q

F32, U32 = np.float32, np.uint32
F16_MAX_BITS = U32(0x477FE000)  # the bits of 65504, float16's largest finite value
FINITE_BITS = U32(0x7F7FFFFF)  # the bits of float32's largest finite value


class ReadSteps(NamedTuple):
    """A type's torch dequantizer, in the reference's float32 operations and order: scales(blocks) -> every block's
    scales; codes(blocks) -> the codes [n, block values]; apply(v, *scales) -> the arithmetic on a chunk, in place;
    book: the values the codes stand for (IQ4's non-linear levels)."""

    scales: Callable
    codes: Callable
    apply: Callable
    book: tuple[int, ...] | None = None


@dataclass(frozen=True)
class GGUFType:
    """A GGUF type: its block (values and bytes, as gguf's GGML_QUANT_SIZES), and its functions. Every dequantizer
    equals gguf-py's numpy one bit for bit; every quantizer equals its `writer`'s."""

    qtype: Q
    block_values: int
    block_bytes: int
    scale_fields: tuple[int, ...] = ()  # byte offsets of its blocks' fp16 scales (d, then dmin where it has one)
    float_dtype: str | None = None  # a plain float type: its bytes are values of this torch dtype
    read: ReadSteps | None = None  # its torch dequantizer, on any device
    read_kernel: Callable | None = None  # kernel code: its one-pass dequantizer on the CPU (block_reader)
    writer: str | None = None  # where the pack writes it: whose quantizer its bytes equal
    # kernel code: float32 blocks [n, block values] -> bytes [n, block bytes]; False at a value the type cannot hold
    write_kernel: Callable | None = None
    # where write_kernel cannot be compiled: (float32 blocks, Scratch) -> the blocks' fields as bytes (else the kernel
    # code runs as plain Python)
    write_torch: Callable | None = None
    fallback: str | None = None  # the type llama.cpp writes where a tensor's rows do not hold whole blocks

    @property
    def name(self) -> str:
        return self.qtype.name

    @property
    def limited(self) -> bool:
        """Whether a float16 field holds its values or scales (F32 and BF16 hold any finite float32)."""
        return self.float_dtype == "float16" or bool(self.scale_fields)

    def row_bytes(self, columns: int) -> int:
        """Bytes of one row of `columns` values."""
        return columns // self.block_values * self.block_bytes

    def fits(self, shape) -> bool:
        """Whether a tensor of `shape` (torch order) can be stored in this type: its rows hold whole blocks."""
        return bool(shape) and shape[-1] % self.block_values == 0

    def nbytes(self, shape) -> int:
        return self.row_bytes(shape[-1]) * math.prod(shape[:-1])


class NotQuantizable(ValueError):
    """The values cannot be written in the asked type (not finite, beyond a float16 field, or beyond float32)."""


def check_peak(peak: float, limited: bool) -> None:
    """Refuses values of largest magnitude `peak` that are not finite, or beyond float16 where the type has a float16
    field (`limited`), else beyond float32."""
    if not math.isfinite(peak):
        raise NotQuantizable("it holds NaN or infinite values")
    top, name = (65504.0, "float16") if limited else (float(np.finfo(np.float32).max), "float32")
    if peak > top:
        raise NotQuantizable(f"it holds values up to {peak:g}, beyond {name}'s {top:g}")


# --- kernel code --------------------------------------------------------------------------------------------


def jit(function=None, **options):
    """Marks kernel code: plain Python that kernels.py compiles with numba's njit(**options) where numba runs."""
    def mark(f):
        f.jit_options = options
        return f

    return mark(function) if function is not None else mark


def bits(f):
    """A float32's bits as uint32."""
    return U32(F32(f).view(U32))


def from_bits(b):
    """uint32 bits as the float32 they encode."""
    return U32(b).view(F32)


def put(out, i, v):
    """out[i] = v, converted to the dtype `out` stands for (float32, fp16 or bfloat16 bits: numba_ops.py)."""
    out[i] = v


def to_fp16(f):
    """A float32 as fp16 bits, rounded to nearest even."""
    return U32(F32(f).astype(np.float16).view(np.uint16))


@jit
def magnitude(v):
    """A float32's magnitude as its bits, which order magnitudes (NaN and infinities beyond every finite one)."""
    return bits(v) & U32(0x7FFFFFFF)


@jit
def f16(b, at, halves):
    """The fp16 field at byte `at` of block `b` as float32, by numpy's conversion (the table `halves`)."""
    return halves[U32(b[at]) | (U32(b[at + 1]) << U32(8))]


@jit
def i8(byte):
    """A byte read as a signed int8."""
    x = np.int32(byte)
    return x - ((x & 128) << 1)


# LLVM vectorizes an inner loop whose trip count it cannot know (one of 16 it knows is unrolled and stays scalar) and
# whose stores lie at fixed distances: so a block function's inner loops run over w values, read from the output's
# shape, with literal offsets.


def block_reader(block, loops: int):
    """A type's one-pass dequantizer from the kernel code of one block, block(b, o, w, halves): b its bytes, o its
    values, w = its values // `loops` (the inner loops' trips)."""
    @jit(nogil=True)
    def dequantize_blocks(blocks, out, halves):
        w = out.shape[1] // loops
        for i in range(blocks.shape[0]):
            block(blocks[i], out[i], w, halves)

    return dequantize_blocks


# --- torch code shared by the families' ReadSteps ----------------------------------------------------------------

NIBBLES = (0, 4)
CRUMBS = (0, 2, 4, 6)
BYTE_LANES = 0x0101010101010101  # a per-byte mask repeated over the eight bytes of an int64


def f16_field(blocks: torch.Tensor, byte: int) -> torch.Tensor:
    """The fp16 field at a byte offset of every block, as float32 [n, 1]."""
    return blocks.view(torch.float16)[:, byte // 2 : byte // 2 + 1].float()


def words(field: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A byte field [n, w] copied to fresh (aligned, contiguous) memory and read as wider integers."""
    packed = torch.empty(field.shape, dtype=torch.uint8, device=field.device)
    packed.copy_(field)
    return packed.view(dtype)


def unpack(field: torch.Tensor, groups: int, shifts: tuple[int, ...], mask: int) -> torch.Tensor:
    """Bit fields of a byte field [n, groups * width] as int64 words [n, groups, len(shifts), width / 8] whose bytes
    are (byte >> shift) & mask, in the reference's order of codes."""
    n = field.shape[0]
    packed = words(field, torch.int64).view(n, groups, -1)
    stacked = torch.empty((len(shifts), *packed.shape), dtype=torch.int64, device=field.device)
    for i, shift in enumerate(shifts):
        torch.bitwise_right_shift(packed, shift, out=stacked[i]).bitwise_and_(mask * BYTE_LANES)
    return side_by_side(stacked)


@functools.lru_cache(maxsize=64)
def _gather_order(rows: int, k: int, device: torch.device) -> torch.Tensor:
    """Row order that turns k stacked results [k, rows, w] into [rows, k, w]."""
    return (torch.arange(k, device=device) * rows + torch.arange(rows, device=device)[:, None]).view(-1)


def side_by_side(stacked: torch.Tensor) -> torch.Tensor:
    """k results [k, n, groups, w] (each computed in one contiguous pass) as [n, groups, k, w], by one row gather."""
    k, n, groups, w = stacked.shape
    order = _gather_order(n * groups, k, stacked.device)
    return torch.index_select(stacked.view(-1, w), 0, order).view(n, groups, k, w)


def nibble_pairs(book: torch.Tensor, high_first: bool = False) -> torch.Tensor:
    """byte -> the float32 values of its two 4-bit codes through `book` (16 values), the low nibble's first unless
    `high_first`, side by side in one float64 slot: one gather yields two neighbouring values."""
    codes = torch.arange(256, device=book.device)
    low, high = book[codes & 0x0F], book[codes >> 4]
    return torch.stack((high, low) if high_first else (low, high), dim=1).view(torch.float64).reshape(256)


@functools.cache
def nibble_book(values: tuple[float, ...], device: torch.device, high_first: bool = False) -> torch.Tensor:
    """nibble_pairs of a constant book, made on the CPU once per device."""
    return nibble_pairs(torch.tensor(values, dtype=torch.float32, device="cpu"), high_first).to(device)


def as_bytes(packed: torch.Tensor) -> torch.Tensor:
    return packed.view(torch.uint8).view(packed.shape[0], -1)


def times_d(v, d):
    v.mul_(d)


# --- torch code shared by the families' write_torch ---------------------------------------------------------------


class Scratch:
    """Float32 and integer buffers of one chunk of values, reused by every chunk of a call (no page faults)."""

    def __init__(self, values: int, block_values: int):
        self.x, self.v = torch.empty(values), torch.empty(values)
        self.wide, self.narrow = torch.empty(values, dtype=torch.int16), torch.empty(values, dtype=torch.int16)
        self.codes = torch.empty(values, dtype=torch.int8)
        self.block_values = block_values

    def blocks(self, buffer: torch.Tensor, n: int) -> torch.Tensor:
        return buffer[: n * self.block_values].view(n, self.block_values)
