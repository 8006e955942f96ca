"""GGUF dequantization, bit-exact with gguf's numpy reference (gguf.quants.dequantize) in float32 before the
cast to the requested dtype: on the CPU by the one-pass kernels (compiled.py) where numba runs, otherwise in
torch, on the device the raw blocks live on.

Each type's torch kernel does the reference's float32 operations, in the same order, so the values agree to
the bit. Speed on the CPU comes from unpacking bit fields eight bytes at a time (int64 shifts and masks
act on eight packed bytes at once, as no bit crosses a byte boundary after masking), and from doing the
float32 arithmetic in cache-sized chunks on a bounded number of threads (steps.py) written
straight into the output. Types without a kernel here fall back to the numpy reference with a warning.
"""

from __future__ import annotations

import functools
import logging
import math

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q

from ...errors import CorruptFileError, UnsupportedFormatError
from . import compiled, gguf_types
from .gguf_types import BY_TYPE, READ_TYPES
from .steps import few_threads, fill_by_rows, output

log = logging.getLogger(__name__)

_NIBBLES = (0, 4)
_CRUMBS = (0, 2, 4, 6)
_BITS = tuple(range(8))
_BYTE_LANES = 0x0101010101010101  # a per-byte mask repeated over the eight bytes of an int64
_SHORT_LANES = 0x0001000100010001  # a per-int16 mask repeated over the four int16 lanes of an int64

# The IQ4 non-linear code book (kvalues_iq4nl in ggml).
_IQ4_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


@functools.cache
def _pair_book(values: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """byte -> the float32 values of its low and high nibble, side by side in one float64 slot: one
    gather then yields two neighbouring values."""
    book = np.array(values, dtype=np.float32)
    pairs = np.stack((np.tile(book, 16), np.repeat(book, 16)), axis=1)
    return torch.from_numpy(pairs.view(np.float64).reshape(256)).to(device)


@functools.cache
def _spread16(device: torch.device) -> torch.Tensor:
    """byte -> int64 whose byte k is 16 where bit k of the byte is set: Q5_0/Q5_1's fifth bits (bit j
    of the 32-bit field belongs to value j), already shifted into place."""
    bits = (np.arange(256, dtype=np.uint8)[:, None] >> np.arange(8, dtype=np.uint8)) & 1
    return torch.from_numpy((bits << 4).astype(np.uint8).view(np.int64).reshape(256)).to(device)


def _words(field: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A byte field [n, w] copied to fresh (aligned, contiguous) memory and read as wider integers."""
    packed = torch.empty(field.shape, dtype=torch.uint8, device=field.device)
    packed.copy_(field)
    return packed.view(dtype)


@functools.lru_cache(maxsize=64)
def _gather_order(rows: int, k: int, device: torch.device) -> torch.Tensor:
    """Row order that turns k stacked results [k, rows, w] into [rows, k, w]."""
    return (torch.arange(k, device=device) * rows + torch.arange(rows, device=device)[:, None]).view(-1)


def _unpack(field: torch.Tensor, groups: int, shifts: tuple[int, ...], mask: int) -> torch.Tensor:
    """Bit fields of a byte field [n, groups * width] as int64 words [n, groups, len(shifts), width / 8]
    whose bytes are (byte >> shift) & mask: the order in which the reference lays out its codes."""
    n = field.shape[0]
    words = _words(field, torch.int64).view(n, groups, -1)
    stacked = torch.empty((len(shifts), *words.shape), dtype=torch.int64, device=field.device)
    for i, shift in enumerate(shifts):
        torch.bitwise_right_shift(words, shift, out=stacked[i]).bitwise_and_(mask * _BYTE_LANES)
    return _side_by_side(stacked)


def _side_by_side(stacked: torch.Tensor) -> torch.Tensor:
    """k results [k, n, groups, w] (each computed in one contiguous pass) as [n, groups, k, w], by one
    row gather: much cheaper than writing each result's short rows into place."""
    k, n, groups, w = stacked.shape
    order = _gather_order(n * groups, k, stacked.device)
    return torch.index_select(stacked.view(-1, w), 0, order).view(n, groups, k, w)


def _as_bytes(words: torch.Tensor) -> torch.Tensor:
    return words.view(torch.uint8).view(words.shape[0], -1)


def _f16(blocks: torch.Tensor, byte: int) -> torch.Tensor:
    """The fp16 field at a byte offset of every block, as float32 [n, 1]."""
    return blocks.view(torch.float16)[:, byte // 2 : byte // 2 + 1].float()


def _signed6(low: torch.Tensor, high: torch.Tensor) -> torch.Tensor:
    """6-bit scales from 4 low and 2 high bits per byte, minus 32, as float32."""
    return ((low | (high << 4)).view(torch.int8) - 32).float()


# Each quant type is three steps, all mirroring the reference's float32 operations:
# - scales: every block's scale fields as float32 per-block tensors, once per tensor (few values, so
#   whole-tensor ops are cheapest);
# - codes: the integer code of every value of a run of blocks, [n, block_size] int8/uint8, offsets
#   applied (byte work, done in large runs so that per-op overhead stays small);
# - apply: the float32 arithmetic on the codes of a cache-sized chunk, in place, given its scales' rows.


def _d(b):
    return (_f16(b, 0),)


def _d_m(b):
    return _f16(b, 0), _f16(b, 2)


def _times_d(v, d):
    v.mul_(d)


def _times_d_plus_m(v, d, m):
    v.mul_(d).add_(m)


def _q8_0_codes(b):
    return b[:, 2:].view(torch.int8)


def _q4_0_codes(b):
    return _as_bytes(_unpack(b[:, 2:18], 1, _NIBBLES, 15)).sub_(8).view(torch.int8)


def _q4_1_codes(b):
    return _as_bytes(_unpack(b[:, 4:20], 1, _NIBBLES, 15))


def _fifth_bits(qh: torch.Tensor) -> torch.Tensor:
    """Q5_0/Q5_1's 32-bit high-bit field [n, 4] as int64 words [n, 4] holding 16 where the bit is set."""
    idx = qh.reshape(-1).to(torch.int32)
    return torch.index_select(_spread16(qh.device), 0, idx).view(qh.shape[0], 4)


def _q5_0_codes(b):
    q = _unpack(b[:, 6:22], 1, _NIBBLES, 15).view(-1, 4).bitwise_or_(_fifth_bits(b[:, 2:6]))
    return _as_bytes(q).sub_(16).view(torch.int8)


def _q5_1_codes(b):
    return _as_bytes(_unpack(b[:, 8:24], 1, _NIBBLES, 15).view(-1, 4).bitwise_or_(_fifth_bits(b[:, 4:8])))


def _q2_k_scales(b):
    n = b.shape[0]
    sc = _words(b[:, 0:16], torch.uint8)
    return (_f16(b, 80) * (sc & 15).float()).view(n, 16, 1), (_f16(b, 82) * (sc >> 4).float()).view(n, 16, 1)


def _q2_k_codes(b):
    return _as_bytes(_unpack(b[:, 16:80], 2, _CRUMBS, 3))


def _times_dl_minus_ml16(v, dl, ml):
    v.view(-1, 16, 16).mul_(dl).sub_(ml)


def _times_dl16(v, dl):
    v.view(-1, 16, 16).mul_(dl)


def _q3_k_scales(b):
    n = b.shape[0]
    low = _as_bytes(_unpack(b[:, 96:104], 1, _NIBBLES, 15))
    high = _words(b[:, 104:108], torch.int32)
    high = torch.cat([(high >> s) & 0x03030303 for s in _CRUMBS], dim=1).view(torch.uint8)
    return ((_f16(b, 108) * _signed6(low, high)).view(n, 16, 1),)


def _q3_k_codes(b):
    n = b.shape[0]
    # value = low two bits - 4, unless the hmask bit is set: (low | hbit << 2) - 4 as int8
    q = _unpack(b[:, 32:96], 2, _CRUMBS, 3).view(n, -1)
    q.bitwise_or_(_unpack(b[:, 0:32], 1, _BITS, 1).view(n, -1).bitwise_left_shift_(2))
    return _as_bytes(q).sub_(4).view(torch.int8)


def _k4_scales(b):
    """Q4_K/Q5_K: d and dmin, then eight 6-bit scales and mins packed into 12 bytes (three little-endian
    words: low bits of the first four scales, of the first four mins, and the low nibbles of the last
    four of each with their top bits in the first two words), as d * scale and dmin * min, [n, 8, 1]
    each. The 16-byte headers are transposed once into four contiguous rows of words, so every
    following op is a plain vectorized pass."""
    n = b.shape[0]
    head = torch.empty((4, n), dtype=torch.int32, device=b.device)
    head.copy_(b.view(torch.int32)[:, 0:4].t())
    d_dmin = head[0].view(torch.float16).view(n, 2, 1).float()
    w0, w1, w2 = head[1], head[2], head[3]
    sc_mn = torch.stack(
        (
            w0 & 0x3F3F3F3F,
            (w2 & 0x0F0F0F0F) | ((w0 >> 2) & 0x30303030),
            w1 & 0x3F3F3F3F,
            ((w2 >> 4) & 0x0F0F0F0F) | ((w1 >> 2) & 0x30303030),
        ),
        dim=1,
    )
    # [2, n, 8]: d * scales and dmin * mins each contiguous, which halves the cost of applying them
    scaled = torch.empty((2, n, 8), device=b.device)
    torch.mul(d_dmin.transpose(0, 1), sc_mn.view(torch.uint8).view(n, 2, 8).transpose(0, 1), out=scaled)
    return scaled[0].unsqueeze(-1), scaled[1].unsqueeze(-1)


def _times_dl_minus_dm8(v, dl, dm):
    v.view(-1, 8, 32).mul_(dl).sub_(dm)


def _times_dl8(v, dl):
    v.view(-1, 8, 32).mul_(dl)


def _q4_k_codes(b):
    return _as_bytes(_unpack(b[:, 16:144], 4, _NIBBLES, 15))


def _q5_k_codes(b):
    # Sub-block j = 2g + s takes the low (s=0) or high (s=1) nibbles of qs group g, and bit j of each
    # qh byte as its fifth bit: with qh shifted right by 2g, that is bit 0 (s=0) or bit 1 (s=1).
    n = b.shape[0]
    qs = _words(b[:, 48:176], torch.int64).view(n, 4, 4)
    qh = _words(b[:, 16:48], torch.int64).view(n, 1, 4)
    qh = torch.cat([qh >> 2 * g for g in range(4)], dim=1)
    stacked = torch.empty((2, n, 4, 4), dtype=torch.int64, device=b.device)
    torch.bitwise_and(qs, 0x0F * _BYTE_LANES, out=stacked[0]).bitwise_or_((qh & _BYTE_LANES) << 4)
    torch.bitwise_right_shift(qs, 4, out=stacked[1]).bitwise_and_(0x0F * _BYTE_LANES)
    stacked[1].bitwise_or_((qh << 3) & (0x10 * _BYTE_LANES))
    return _as_bytes(_side_by_side(stacked))


def _q6_k_scales(b):
    return ((_f16(b, 208) * b[:, 192:208].view(torch.int8).float()).view(-1, 16, 1),)


def _q6_k_codes(b):
    # Each half of 128 values: value s * 64 + w is nibble s of ql byte w, with crumb 2s + w // 32 of qh
    # byte w % 32 as bits 4-5. Shifting the upper 32 qh bytes' copy right by 2 leaves crumb 2s of
    # "qh byte w" at bits 4s.
    n = b.shape[0]
    ql = _words(b[:, 0:128], torch.int64).view(n, 2, 8)
    qh = _words(b[:, 128:192], torch.int64).view(n, 2, 4)
    qh = torch.cat((qh, qh >> 2), dim=2)
    stacked = torch.empty((2, n, 2, 8), dtype=torch.int64, device=b.device)
    torch.bitwise_and(ql, 0x0F * _BYTE_LANES, out=stacked[0]).bitwise_or_((qh & (0x03 * _BYTE_LANES)) << 4)
    torch.bitwise_right_shift(ql, 4, out=stacked[1]).bitwise_and_(0x0F * _BYTE_LANES)
    stacked[1].bitwise_or_(qh & (0x30 * _BYTE_LANES))
    return _as_bytes(_side_by_side(stacked)).sub_(32).view(torch.int8)


def _iq4_pair_codes(qs: torch.Tensor) -> torch.Tensor:
    """IQ4 bytes [n, 16 * k] (k runs of 32 values: low nibbles first, then high ones) as the int32 index
    of every pair of neighbouring values, in value order: for the int16 word of bytes 2i and 2i+1, the
    low pair is their low nibbles and the high pair their high nibbles, each index = first | second << 4.
    Four int16 words are worked on at once in an int64, as in _unpack."""
    n = qs.shape[0]
    words = _words(qs, torch.int64).view(n, -1, 2)
    low, high = 0x000F * _SHORT_LANES, 0x00F0 * _SHORT_LANES
    stacked = torch.empty((2, *words.shape), dtype=torch.int64, device=qs.device)
    torch.bitwise_and(words, low, out=stacked[0]).bitwise_or_((words >> 4).bitwise_and_(high))
    torch.bitwise_right_shift(words, 4, out=stacked[1]).bitwise_and_(low)
    stacked[1].bitwise_or_((words >> 8).bitwise_and_(high))
    return _side_by_side(stacked).view(torch.int16).view(n, -1).to(torch.int32)


def _iq4_nl_codes(b):
    return _iq4_pair_codes(b[:, 2:18])


def _iq4_xs_scales(b):
    n = b.shape[0]
    # 4-bit low parts, two per byte, low nibble first; 2-bit high parts, eight in a little-endian uint16
    low = _words(b[:, 4:8], torch.uint8)
    low = torch.stack((low & 15, low >> 4), dim=2).view(n, 8)
    high = _words(b[:, 2:4], torch.int16).int() & 0xFFFF
    high = ((high >> torch.arange(0, 16, 2, dtype=torch.int32, device=b.device)) & 3).to(torch.uint8)
    return ((_f16(b, 0) * _signed6(low, high)).view(n, 8, 1),)


def _iq4_xs_codes(b):
    return _iq4_pair_codes(b[:, 8:136])


# Quant type -> (scales, codes, apply, code book): the code book, where there is one, maps codes to
# values (IQ4's non-linear levels); otherwise the codes are the values.
_KERNELS = {
    Q.Q8_0: (_d, _q8_0_codes, _times_d, None),
    Q.Q4_0: (_d, _q4_0_codes, _times_d, None),
    Q.Q4_1: (_d_m, _q4_1_codes, _times_d_plus_m, None),
    Q.Q5_0: (_d, _q5_0_codes, _times_d, None),
    Q.Q5_1: (_d_m, _q5_1_codes, _times_d_plus_m, None),
    Q.Q2_K: (_q2_k_scales, _q2_k_codes, _times_dl_minus_ml16, None),
    Q.Q3_K: (_q3_k_scales, _q3_k_codes, _times_dl16, None),
    Q.Q4_K: (_k4_scales, _q4_k_codes, _times_dl_minus_dm8, None),
    Q.Q5_K: (_k4_scales, _q5_k_codes, _times_dl_minus_dm8, None),
    Q.Q6_K: (_q6_k_scales, _q6_k_codes, _times_dl16, None),
    Q.IQ4_NL: (_d, _iq4_nl_codes, _times_d, _IQ4_VALUES),
    Q.IQ4_XS: (_iq4_xs_scales, _iq4_xs_codes, _times_dl8, _IQ4_VALUES),
}
# Types stored as plain floats: a view and a cast.
FLOAT_TYPES = {qtype: getattr(torch, BY_TYPE[qtype].float_dtype) for qtype in gguf_types.FLOAT_TYPES}


def read_types() -> str:
    """The GGUF types the pack dequantizes itself, as the errors list them."""
    return ", ".join(q.name for q in READ_TYPES)

_warned: set[Q] = set()


def dequantize(
    data: torch.Tensor, qtype, shape, dtype: torch.dtype = torch.float16, *, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Values of a GGUF tensor from its raw bytes (uint8, on CPU or GPU), shaped `shape` (torch order).
    `out`, a contiguous tensor of that shape, dtype and device, receives them instead of a new tensor:
    callers that dequantize at every forward reuse one buffer and skip the page faults of fresh memory."""
    qtype = Q(qtype)
    shape = tuple(int(s) for s in shape)
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    n_values = math.prod(shape)
    data = data.reshape(-1)
    if n_values % block_size or data.numel() != n_values // block_size * type_size:
        raise CorruptFileError(
            f"{data.numel()} bytes of {qtype.name} data cannot hold a tensor of shape {list(shape)} "
            f"(blocks of {block_size} values in {type_size} bytes)."
        )
    out = output(out, shape, dtype, data.device)
    if data.storage_offset() % 8:
        data = data.clone()  # fields are read as fp16 and int64 views, which need aligned memory
    if qtype in FLOAT_TYPES:
        return out.copy_(data.view(FLOAT_TYPES[qtype]).view(shape))
    if qtype not in _KERNELS:
        return out.copy_(_numpy_fallback(data, qtype, shape))
    blocks = data.view(-1, type_size)
    if compiled.gguf(qtype.name, blocks, out):
        return out
    scales, codes, apply, code_book = _KERNELS[qtype]
    book = None if code_book is None else _pair_book(code_book, data.device)

    def fill(rows: slice, v: torch.Tensor) -> None:
        chunk = codes(blocks[rows])
        if book is None:
            v.copy_(chunk)
        else:
            torch.index_select(book, 0, chunk.view(-1), out=v.view(torch.float64).view(-1))
        apply(v, *(s[rows] for s in per_block))

    with few_threads(data.device):
        per_block = scales(blocks)
        fill_by_rows(out.view(-1, block_size), fill)
    return out


def _numpy_fallback(data: torch.Tensor, qtype: Q, shape: tuple[int, ...]) -> torch.Tensor:
    from gguf.quants import dequantize as reference

    raw = data.cpu().numpy().reshape(-1, GGML_QUANT_SIZES[qtype][1])
    try:
        values = reference(raw, qtype)
    except NotImplementedError:
        raise UnsupportedFormatError(
            f"GGUF tensors of type {qtype.name} cannot be dequantized (neither the pack nor the gguf "
            f"library reads them). Use a file quantized with a type the pack reads: {read_types()}."
        ) from None
    if qtype not in _warned:
        _warned.add(qtype)
        log.warning("GGUF %s tensors are dequantized by gguf's numpy code on the CPU (slow).", qtype.name)
    return torch.from_numpy(values).reshape(shape).to(data.device)
