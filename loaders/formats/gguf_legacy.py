"""The legacy GGUF types, blocks of 32 values with one fp16 scale (and a minimum in the _1 types): Q8_0, Q4_0, Q4_1,
Q5_0, Q5_1, and IQ4_NL (4-bit codes through a non-linear book). Each is read in gguf-py's float32 operations, in
torch and in the one-pass kernel; the first five are written as gguf.quants.quantize writes them, in the kernel and in
torch, but for a zero minimum or maximum, written +0 (numpy's give either sign), and a block whose inverse scale
overflows, whose codes are 0 (they decode to 0 all the same). Values that are not finite or beyond float16 are
refused: the reference would write NaN scales or infinities that spoil every image."""

from __future__ import annotations

import functools

import numpy as np
import torch
from gguf import GGMLQuantizationType as Q

from .gguf_row import (
    BYTE_LANES,
    F16_MAX_BITS,
    F32,
    NIBBLES,
    U32,
    GGUFType,
    ReadSteps,
    as_bytes,
    bits,
    block_reader,
    check_peak,
    f16,
    f16_field,
    from_bits,
    i8,
    jit,
    magnitude,
    put,
    side_by_side,
    times_d,
    to_fp16,
    unpack,
    words,
)

IQ4_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)  # kvalues_iq4nl in ggml

# --- reading, in torch --------------------------------------------------------------------------------------------


def _d(b):
    return (f16_field(b, 0),)


def _d_m(b):
    return f16_field(b, 0), f16_field(b, 2)


def _times_d_plus_m(v, d, m):
    v.mul_(d).add_(m)


@functools.cache
def _spread16(device: torch.device) -> torch.Tensor:
    """byte -> int64 whose byte k is 16 where bit k of the byte is set: Q5_0/Q5_1's fifth bits shifted into place."""
    bit = (np.arange(256, dtype=np.uint8)[:, None] >> np.arange(8, dtype=np.uint8)) & 1
    return torch.from_numpy((bit << 4).astype(np.uint8).view(np.int64).reshape(256)).to(device)


def _nibble_codes(at: int, offset: int, fifth_at: int = 0):
    """Q4_0/Q4_1/Q5_0/Q5_1's codes: the nibbles from byte `at`, with the fifth bits of the 32-bit field at `fifth_at`
    where it is given, less `offset` (then as int8)."""
    def codes(b):
        q = unpack(b[:, at : at + 16], 1, NIBBLES, 15)
        if fifth_at:
            qh = b[:, fifth_at : fifth_at + 4].reshape(-1).to(torch.int32)
            q = q.view(-1, 4).bitwise_or_(torch.index_select(_spread16(b.device), 0, qh).view(-1, 4))
        return as_bytes(q).sub_(offset).view(torch.int8) if offset else as_bytes(q)

    return codes


def iq4_pair_codes(qs: torch.Tensor) -> torch.Tensor:
    """IQ4 bytes [n, 16 * k] (k runs of 32 values: low nibbles first, then high ones) as the int32 index, first |
    second << 4, of every pair of neighbouring values in value order, four int16 words at a time in an int64."""
    n, short_lanes = qs.shape[0], 0x0001000100010001
    packed = words(qs, torch.int64).view(n, -1, 2)
    low, high = 0x000F * short_lanes, 0x00F0 * short_lanes
    stacked = torch.empty((2, *packed.shape), dtype=torch.int64, device=qs.device)
    torch.bitwise_and(packed, low, out=stacked[0]).bitwise_or_((packed >> 4).bitwise_and_(high))
    torch.bitwise_right_shift(packed, 4, out=stacked[1]).bitwise_and_(low)
    stacked[1].bitwise_or_((packed >> 8).bitwise_and_(high))
    return side_by_side(stacked).view(torch.int16).view(n, -1).to(torch.int32)


def _q8_0_codes(b):
    return b[:, 2:].view(torch.int8)


def _iq4_nl_codes(b):
    return iq4_pair_codes(b[:, 2:18])


# --- reading, kernel code -----------------------------------------------------------------------------------------


@jit(inline="always")
def _q8_0(b, o, w, halves):
    d = f16(b, 0, halves)
    for k in range(w):
        put(o, k, F32(i8(b[2 + k])) * d)


@jit(inline="always")
def _q4_0(b, o, w, halves):
    d = f16(b, 0, halves)
    for k in range(w):
        q = np.int32(b[2 + k])
        put(o, k, d * F32((q & 15) - 8))
        put(o, 16 + k, d * F32((q >> 4) - 8))


@jit(inline="always")
def _q4_1(b, o, w, halves):
    d, m = f16(b, 0, halves), f16(b, 2, halves)
    for k in range(w):
        q = np.int32(b[4 + k])
        put(o, k, d * F32(q & 15) + m)
        put(o, 16 + k, d * F32(q >> 4) + m)


@jit
def _u32(b, at):
    """The little-endian 32-bit field at byte `at`."""
    return U32(b[at]) | (U32(b[at + 1]) << U32(8)) | (U32(b[at + 2]) << U32(16)) | (U32(b[at + 3]) << U32(24))


@jit
def _bit16(field, k):
    """Bit k of a 32-bit field, as 16 or 0."""
    return np.int32((field >> U32(k)) & U32(1)) << 4


@jit(inline="always")
def _q5_0(b, o, w, halves):
    d, qh = f16(b, 0, halves), _u32(b, 2)
    for k in range(w):
        q = np.int32(b[6 + k])
        put(o, k, d * F32(((q & 15) | _bit16(qh, k)) - 16))
        put(o, 16 + k, d * F32(((q >> 4) | _bit16(qh, 16 + k)) - 16))


@jit(inline="always")
def _q5_1(b, o, w, halves):
    d, m, qh = f16(b, 0, halves), f16(b, 2, halves), _u32(b, 4)
    for k in range(w):
        q = np.int32(b[8 + k])
        put(o, k, d * F32((q & 15) | _bit16(qh, k)) + m)
        put(o, 16 + k, d * F32((q >> 4) | _bit16(qh, 16 + k)) + m)


# The IQ4 book as two int64 words of eight int8 values each: a shift picks a code's byte, and vectorizes (not a gather)
_IQ4_WORDS = tuple(int(w) for w in np.array(IQ4_VALUES, np.int8).view(np.int64))


@jit
def iq4(q):
    """The IQ4 value of code q (0-15), as float32."""
    word = np.int64(_IQ4_WORDS[1]) if q & 8 else np.int64(_IQ4_WORDS[0])
    return F32(i8((word >> ((q & 7) * 8)) & 255))


@jit(inline="always")
def _iq4_nl(b, o, w, halves):
    d = f16(b, 0, halves)
    for k in range(w):
        q = np.int32(b[2 + k])
        put(o, k, d * iq4(q & 15))
        put(o, 16 + k, d * iq4(q >> 4))


# --- writing, in torch ----------------------------------------------------------------------------------------
# Each works on a chunk of blocks in a Scratch's buffers and returns a block's fields as bytes, in the order of ggml's
# block_* structs; truncation is a cast (through int8: torch's cast to uint8 is not vectorised).


def _range(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each block's maximum and minimum ([n, 1]), once the chunk's values are checked (NaN spreads into the maximum)."""
    high, low = b.amax(dim=1, keepdim=True), b.amin(dim=1, keepdim=True)
    check_peak(max(high.max().item(), -low.min().item()), limited=True)
    return high, low


def _half_bytes(x: torch.Tensor) -> torch.Tensor:
    """float32 [n, 1] -> its float16 (round to nearest even, as numpy's astype) as 2 bytes [n, 2]."""
    return x.half().view(torch.uint8)


def _inverse(d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """1 / d, 0 where d is 0 (as the reference's np.where); and the blocks whose inverse overflowed, or None."""
    inverse = torch.div(1.0, d).masked_fill_(d == 0, 0.0)
    overflowed = torch.isinf(inverse).view(-1)
    return inverse, (overflowed if overflowed.any() else None)


def _zeroed(q: torch.Tensor, overflowed: torch.Tensor | None) -> torch.Tensor:
    if overflowed is not None:
        q[overflowed] = 0
    return q


def _signed_max(b: torch.Tensor, high: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
    """Per block, the value of largest magnitude with its sign, [n, 1]; on a tie of +m and -m the first (numpy's
    argmax)."""
    signed = torch.where(high >= -low, high, low)
    tied = (high == -low).view(-1).nonzero().view(-1)
    if tied.numel():
        rows = b.index_select(0, tied)
        signed[tied] = torch.gather(rows, 1, rows.abs().argmax(dim=1, keepdim=True))
    return signed


def _codes(s, values: torch.Tensor, scale: torch.Tensor, offset: float, top: int) -> torch.Tensor:
    """np.trunc(values * (1 / scale) + offset).astype(uint8).clip(0, top), as uint8 [n, 32] (a clamp, then a cast)."""
    inverse, overflowed = _inverse(scale)
    v = torch.mul(values, inverse, out=s.blocks(s.v, values.shape[0])).add_(offset).clamp_(0, top)
    q = s.codes[: v.numel()].view(v.shape)
    q.copy_(v)
    return _zeroed(q, overflowed).view(torch.uint8)


def _nibbles(q: torch.Tensor, masked: bool) -> torch.Tensor:
    """32 codes per block as 16 bytes: the first 16 in the low nibbles, the last 16 in the high ones (fifth bits
    masked off)."""
    low, high = q.view(torch.int64)[:, :2], q.view(torch.int64)[:, 2:]
    if masked:
        low, high = low & 0x0F * BYTE_LANES, high & 0x0F * BYTE_LANES
    return (low | (high << 4)).view(torch.uint8)


def _fifth_bit_field(q: torch.Tensor) -> torch.Tensor:
    """Bit 4 of each of a block's 32 codes as one little-endian 32-bit field, 4 bytes [n, 4]. Eight codes' 0/1 bits
    are eight bytes of an int64 word, bit 0 of byte k at bit 8k; shifting by 7k brings it to bit k, and three
    doubling steps OR every such shift in (no other bit lands below bit 8)."""
    field = (q >> 4).view(torch.int64)  # [n, 4]
    for shift in (7, 14, 28):
        field = field | (field >> shift)
    return (field & 0xFF).to(torch.uint8)


def _write_q8_0(b: torch.Tensor, s) -> list[torch.Tensor]:
    high, low = _range(b)
    d = torch.maximum(high, -low).add_(0.0).div_(127)  # |x|'s maximum, as the reference's: a zero is +0
    inverse, overflowed = _inverse(d)
    n = b.shape[0]
    v = torch.mul(b, inverse, out=s.blocks(s.v, n))
    # gguf-py's np_roundf, sign(v) * (floor(|v|) + floor(2 * (|v| - floor(|v|)))), is trunc(2v) - trunc(v): 2v is
    # exact, and floor(2a) = 2 floor(a) + floor(2 (a - floor(a))). Both truncations are casts (|2v| <= 254).
    twice, once = s.blocks(s.wide, n), s.blocks(s.narrow, n)
    twice.copy_(torch.mul(v, 2, out=s.blocks(s.x, n)))  # b is no longer read: x may hold it
    once.copy_(v)
    q = s.codes[: v.numel()].view(v.shape)
    q.copy_(twice.sub_(once))
    return [_half_bytes(d), _zeroed(q, overflowed).view(torch.uint8)]


def _write_nibbles(top: int, minimum: bool):
    """Codes up to `top` (15 or 31, with fifth bits between the header and the nibbles). Q4_0/Q5_0: d = the first value
    of largest magnitude / -half (half = (top + 1) / 2), codes trunc(x / d + half + 0.5). Q4_1/Q5_1 (`minimum`):
    d = (max - min) / top, m = min (a zero as +0), codes trunc((x - min) / d + 0.5)."""
    half = (top + 1) // 2

    def write(b: torch.Tensor, s) -> list[torch.Tensor]:
        high, low = _range(b)
        if minimum:
            high, low = high.add_(0.0), low.add_(0.0)
            d = (high - low).div_(top)
            shifted = torch.sub(b, low, out=s.blocks(s.x, b.shape[0]))  # in place where x holds b
            q, header = _codes(s, shifted, d, 0.5, top), [_half_bytes(d), _half_bytes(low)]
        else:
            d = _signed_max(b, high, low).div_(-half)
            q, header = _codes(s, b, d, half + 0.5, top), [_half_bytes(d)]
        return [*header, *([_fifth_bit_field(q)] if top == 31 else []), _nibbles(q, masked=top == 31)]

    return write


# --- writing, kernel code ---------------------------------------------------------------------------------------
# Each mirrors the torch functions above and returns False at a value not finite or beyond float16. The four block ops
# below are plain loops: numba_ops.py's vector versions replace them in the fast build.


@jit
def _flip(k):
    """int32 float32 bits <-> order keys: all but the sign flipped where it is set (-0 below +0); its own inverse."""
    return k ^ ((k >> 31) & np.int32(0x7FFFFFFF))


@jit
def block_range(x, i):
    """(block i's maximum, its minimum) as float32, found on the values' order keys."""
    high = low = _flip(np.int32(bits(x[i, 0])))
    for k in range(1, 32):
        key = _flip(np.int32(bits(x[i, k])))
        high, low = max(high, key), min(low, key)
    return from_bits(np.uint32(_flip(high))), from_bits(np.uint32(_flip(low)))


@jit
def block_peak(x, i):
    """(the bits of block i's largest magnitude, the lane of the first value with it): numpy's argmax of abs."""
    top, lane = magnitude(x[i, 0]), U32(0)
    for k in range(1, 32):
        if magnitude(x[i, k]) > top:
            top, lane = magnitude(x[i, k]), U32(k)
    return top, lane


@jit
def put_codes(x, i, o, inverse, low, top, minimum, at, fifth_at):
    """Block i's codes, as _codes, _nibbles and _fifth_bit_field write them: from byte `at` of o[i], their fifth bits
    at `fifth_at` (else 0); `minimum`: they count from `low`."""
    offset = F32(0.5) if minimum else F32((top + 1) // 2 + 0.5)
    fifth = U32(0)
    for k in range(16):
        first = min(max(np.int32(((x[i, k] - low) if minimum else x[i, k]) * inverse + offset), 0), top)
        second = min(max(np.int32(((x[i, k + 16] - low) if minimum else x[i, k + 16]) * inverse + offset), 0), top)
        o[i, at + k] = np.uint8((first & 15) | ((second & 15) << 4))
        fifth |= (U32((first >> 4) & 1) << U32(k)) | (U32((second >> 4) & 1) << U32(k + 16))
    if fifth_at:
        for j in range(4):
            o[i, fifth_at + j] = np.uint8((fifth >> U32(8 * j)) & U32(255))


@jit
def put_q8_0_codes(x, i, o, inverse):
    """Q8_0's codes of block i at o[i, 2:]: round half away from zero of v = x * inverse, trunc(2v) - trunc(v)."""
    for k in range(32):
        v = x[i, k] * inverse
        o[i, 2 + k] = np.uint8((np.int32(v + v) - np.int32(v)) & 255)


@jit
def _put_fp16(o, i, at, v):
    """v as a little-endian fp16 field at byte `at` of block i."""
    h = np.int32(to_fp16(v))
    o[i, at], o[i, at + 1] = np.uint8(h & 255), np.uint8(h >> 8)


@jit
def _zero_codes(o, i, at):
    for k in range(at, o.shape[1]):
        o[i, k] = 0


@jit
def _inverse_of(d):
    """1 / d, or 0 where d is 0."""
    return F32(1.0) / d if d != F32(0.0) else F32(0.0)


@jit(nogil=True)
def _quantize_q8_0(x, o):
    for i in range(x.shape[0]):
        top = block_peak(x, i)[0]
        if top > F16_MAX_BITS:
            return False
        d = from_bits(top) / F32(127.0)
        _put_fp16(o, i, 0, d)
        inverse = _inverse_of(d)
        if np.isinf(inverse):
            _zero_codes(o, i, 2)
            continue
        put_q8_0_codes(x, i, o, inverse)
    return True


def _nibble_kernel(top: int, minimum: bool, fifth_at: int, at: int):
    """_write_nibbles' kernel: codes at byte `at`, their fifth bits at `fifth_at` (else 0); compiled per type."""
    levels, divisor, header = F32(top), F32(-(top + 1) // 2), 4 if minimum else 2

    @jit(nogil=True)
    def quantize(x, o):
        for i in range(x.shape[0]):
            if minimum:
                high, low = block_range(x, i)
                if max(magnitude(high), magnitude(low)) > F16_MAX_BITS:
                    return False
                high, low = high + F32(0.0), low + F32(0.0)  # a zero as +0
                d = (high - low) / levels
            else:
                peak, lane = block_peak(x, i)
                if peak > F16_MAX_BITS:
                    return False
                d, low = x[i, lane] / divisor, F32(0.0)
            _put_fp16(o, i, 0, d)
            if minimum:
                _put_fp16(o, i, 2, low)
            inverse = _inverse_of(d)
            if np.isinf(inverse):
                _zero_codes(o, i, header)
                continue
            put_codes(x, i, o, inverse, low, top, minimum, at, fifth_at)
        return True

    return quantize


ROWS = (
    GGUFType(Q.Q8_0, 32, 34, (0,), read=ReadSteps(_d, _q8_0_codes, times_d), read_kernel=block_reader(_q8_0, 1),
             writer="gguf-py", write_kernel=_quantize_q8_0, write_torch=_write_q8_0),
    GGUFType(Q.Q4_0, 32, 18, (0,), read=ReadSteps(_d, _nibble_codes(2, 8), times_d), read_kernel=block_reader(_q4_0, 2),
             writer="gguf-py", write_kernel=_nibble_kernel(15, False, 0, 2), write_torch=_write_nibbles(15, False)),
    GGUFType(Q.Q4_1, 32, 20, (0, 2), read=ReadSteps(_d_m, _nibble_codes(4, 0), _times_d_plus_m),
             read_kernel=block_reader(_q4_1, 2), writer="gguf-py", write_kernel=_nibble_kernel(15, True, 0, 4),
             write_torch=_write_nibbles(15, True)),
    GGUFType(Q.Q5_0, 32, 22, (0,), read=ReadSteps(_d, _nibble_codes(6, 16, 2), times_d),
             read_kernel=block_reader(_q5_0, 2), writer="gguf-py", write_kernel=_nibble_kernel(31, False, 2, 6),
             write_torch=_write_nibbles(31, False)),
    GGUFType(Q.Q5_1, 32, 24, (0, 2), read=ReadSteps(_d_m, _nibble_codes(8, 0, 4), _times_d_plus_m),
             read_kernel=block_reader(_q5_1, 2), writer="gguf-py", write_kernel=_nibble_kernel(31, True, 4, 8),
             write_torch=_write_nibbles(31, True)),
    GGUFType(Q.IQ4_NL, 32, 18, (0,), read=ReadSteps(_d, _iq4_nl_codes, times_d, IQ4_VALUES),
             read_kernel=block_reader(_iq4_nl, 2)),
)
