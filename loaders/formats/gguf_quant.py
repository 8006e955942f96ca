"""GGUF quantization in torch, bit-identical with gguf-py's numpy reference (gguf.quants.quantize) for the legacy
types the pack writes: F32, F16, BF16, Q8_0, Q5_1, Q5_0, Q4_1, Q4_0. The K types (Q2_K to Q6_K) go to kquants.py,
bit-identical with ggml's own reference quantizers.

Each type's kernel does the reference's float32 operations in the same order (a division where it divides,
truncation where it truncates, its own round-half-away-from-zero for Q8_0), so the blocks agree to the bit.
Speed: on the CPU, numba's one-pass kernels (compiled.py) quantize float32 or bfloat16 values block by block, reading
each value once, on a bounded number of threads (steps.py). Where they cannot run (no numba, another
input dtype), the torch kernels here work on cache-sized chunks of rows, each op over a whole chunk of blocks.

Values that are not finite, and values a float16 field cannot hold, are refused: the reference would write
NaN scales or infinities that load and then spoil every image."""

from __future__ import annotations

import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q

from ...errors import UnsupportedFormatError
from . import compiled
from .gguf_types import K_TYPES, WRITE_TYPES
from .kquants import quantize as quantize_k
from .quant_rows import (
    check_peak,
    rows_and_out,
)
from .steps import CHUNK_VALUES, few_threads

# Rows are quantized a chunk at a time (steps.CHUNK_VALUES) in scratch buffers made once per call and reused by every
# chunk: each op writes into a buffer that is already there, so no op pays for fresh memory (a new 4 MiB tensor per op
# costs more in page faults than the arithmetic), and chunks stay cache-resident. Every step is chosen for the
# fewest passes over a chunk: the blocks' maximum and minimum serve the checks and every scale, truncation is a
# cast to an integer type (float to int8 and int16 are vectorised; float to uint8 is not, so codes go through
# int8), and Q8_0's rounding is an identity of integers (below).


class _Scratch:
    """Float32 and integer buffers of one chunk, reused by every chunk of a call."""

    def __init__(self, values: int, block_size: int):
        self.x, self.v = torch.empty(values), torch.empty(values)
        self.wide, self.narrow = torch.empty(values, dtype=torch.int16), torch.empty(values, dtype=torch.int16)
        self.codes = torch.empty(values, dtype=torch.int8)
        self.block_size = block_size

    def blocks(self, buffer: torch.Tensor, n: int) -> torch.Tensor:
        return buffer[: n * self.block_size].view(n, self.block_size)


def _range(b: torch.Tensor, limited: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Each block's maximum and minimum ([n, 1]), the chunk refused first if it holds values the type cannot:
    not finite (NaN spreads into the maximum), or beyond a float16 field where the type has one (`limited`)."""
    high, low = b.amax(dim=1, keepdim=True), b.amin(dim=1, keepdim=True)
    check_peak(max(high.max().item(), -low.min().item()), limited)
    return high, low


def _half_bytes(x: torch.Tensor) -> torch.Tensor:
    """float32 [n, 1] -> its float16 (round to nearest even, as numpy's astype) as 2 bytes [n, 2]."""
    return x.half().view(torch.uint8)


def _inverse(d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """1 / d, and 0 where d is 0 (the reference's np.where(d == 0, 0, 1 / d)); and the blocks whose inverse
    overflowed (a scale below 2^-128, which float16 stores as 0), or None. There the reference casts infinities
    and NaN to integers, which x86 makes 0: such blocks get codes 0 (any codes decode to 0 under a scale of 0)."""
    inverse = torch.div(1.0, d).masked_fill_(d == 0, 0.0)
    overflowed = torch.isinf(inverse).view(-1)
    return inverse, (overflowed if overflowed.any() else None)


def _zero_codes(q: torch.Tensor, overflowed: torch.Tensor | None) -> torch.Tensor:
    if overflowed is not None:
        q[overflowed] = 0
    return q


def _signed_max(b: torch.Tensor, high: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
    """Per block, the value of largest magnitude with its sign, [n, 1]; on a tie of magnitudes the first one
    (numpy's argmax), whose sign matters where +m and -m (or +0 and -0) are both in the block. argmax over
    short rows is slow in torch, so it runs on the tied blocks alone."""
    signed = torch.where(high >= -low, high, low)
    tied = (high == -low).view(-1).nonzero().view(-1)
    if tied.numel():
        rows = b.index_select(0, tied)
        signed[tied] = torch.gather(rows, 1, rows.abs().argmax(dim=1, keepdim=True))
    return signed


def _codes(s: _Scratch, values: torch.Tensor, scale: torch.Tensor, offset: float, top: int) -> torch.Tensor:
    """np.trunc(values * (1 / scale) + offset).astype(uint8).clip(0, top), as uint8 [n, block size]: the cast
    truncates, and clamping first changes nothing the clip would not (every value below 0 or above `top` ends
    there)."""
    inverse, overflowed = _inverse(scale)
    v = torch.mul(values, inverse, out=s.blocks(s.v, values.shape[0])).add_(offset).clamp_(0, top)
    q = s.codes[: v.numel()].view(v.shape)
    q.copy_(v)
    return _zero_codes(q, overflowed).view(torch.uint8)


_LOW_NIBBLES = 0x0F0F0F0F0F0F0F0F


def _nibbles(q: torch.Tensor, masked: bool) -> torch.Tensor:
    """32 codes per block as 16 bytes: the first 16 in the low nibbles, the last 16 in the high ones (their
    fifth bits masked off where they have one), worked on eight codes at a time as int64 words."""
    words = q.view(torch.int64)  # [n, 4]
    low, high = words[:, :2], words[:, 2:]
    if masked:
        low, high = low & _LOW_NIBBLES, high & _LOW_NIBBLES
    return (low | (high << 4)).view(torch.uint8)


def _fifth_bits(q: torch.Tensor) -> torch.Tensor:
    """Bit 4 of each of a block's 32 codes as one little-endian 32-bit field, 4 bytes [n, 4]. Eight codes' 0/1
    bits are eight bytes of an int64 word, bit 0 of byte k at bit 8k; shifting by 7k brings it to bit k, and
    three doubling steps OR every such shift in (no other bit lands below bit 8)."""
    words = (q >> 4).view(torch.int64)  # [n, 4]
    for shift in (7, 14, 28):
        words = words | (words >> shift)
    return (words & 0xFF).to(torch.uint8)


def _q8_0(b: torch.Tensor, s: _Scratch) -> list[torch.Tensor]:
    high, low = _range(b, limited=True)
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
    return [_half_bytes(d), _zero_codes(q, overflowed).view(torch.uint8)]


def _q4_0(b: torch.Tensor, s: _Scratch) -> list[torch.Tensor]:
    d = _signed_max(b, *_range(b, limited=True)).div_(-8)
    return [_half_bytes(d), _nibbles(_codes(s, b, d, 8.5, 15), masked=False)]


def _q5_0(b: torch.Tensor, s: _Scratch) -> list[torch.Tensor]:
    d = _signed_max(b, *_range(b, limited=True)).div_(-16)
    q = _codes(s, b, d, 16.5, 31)
    return [_half_bytes(d), _fifth_bits(q), _nibbles(q, masked=True)]


def _min_max(b: torch.Tensor, s: _Scratch, levels: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(d, min, codes): Q4_1 and Q5_1's scale over `levels` steps up from the block's minimum. A zero minimum or
    maximum is +0: where a block holds both +0 and -0, numpy's vectorised min and max return either, by lane
    order; the sign of a zero changes no decoded value."""
    high, low = _range(b, limited=True)
    high, low = high.add_(0.0), low.add_(0.0)
    d = (high - low).div_(levels)
    shifted = torch.sub(b, low, out=s.blocks(s.x, b.shape[0]))  # in place where x holds b
    return d, low, _codes(s, shifted, d, 0.5, levels)


def _q4_1(b: torch.Tensor, s: _Scratch) -> list[torch.Tensor]:
    d, low, q = _min_max(b, s, 15)
    return [_half_bytes(d), _half_bytes(low), _nibbles(q, masked=False)]


def _q5_1(b: torch.Tensor, s: _Scratch) -> list[torch.Tensor]:
    d, low, q = _min_max(b, s, 31)
    return [_half_bytes(d), _half_bytes(low), _fifth_bits(q), _nibbles(q, masked=True)]


def _whole(b: torch.Tensor, limited: bool) -> None:
    check_peak(max(b.amax().item(), -b.amin().item()), limited)


def _bf16(b: torch.Tensor, s: _Scratch) -> list[torch.Tensor]:
    # torch rounds finite values to nearest even exactly as ggml_compute_fp32_to_bf16 (NaN are refused first)
    _whole(b, limited=False)
    return [b.to(torch.bfloat16).view(torch.uint8)]


def _f16(b: torch.Tensor, s: _Scratch) -> list[torch.Tensor]:
    _whole(b, limited=True)
    return [b.half().view(torch.uint8)]


def _f32(b: torch.Tensor, s: _Scratch) -> list[torch.Tensor]:
    _whole(b, limited=False)
    return [b.view(torch.uint8)]


# Type -> its block kernel: float32 blocks [n, block size] -> the fields of each block, in the order ggml's
# block_* structs lay them out, as bytes [n, field size].
_KERNELS = {
    Q.F32: _f32,
    Q.F16: _f16,
    Q.BF16: _bf16,
    Q.Q8_0: _q8_0,
    Q.Q5_1: _q5_1,
    Q.Q5_0: _q5_0,
    Q.Q4_1: _q4_1,
    Q.Q4_0: _q4_0,
}


def write_types() -> str:
    return ", ".join(q.name for q in WRITE_TYPES)


def quantize(values: torch.Tensor, qtype, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """The GGUF bytes of `values` (a float tensor on the CPU, any float dtype, last dimension the rows) in
    `qtype`: uint8 [rows, row bytes], written into `out` where given (contiguous, of that shape). Raises
    NotQuantizable for values the type cannot hold, and ValueError for rows that do not hold whole blocks or an
    `out` of another shape."""
    qtype = Q(qtype)
    if qtype in K_TYPES:
        return quantize_k(values, qtype, out=out)
    if qtype not in _KERNELS:
        raise UnsupportedFormatError(f"The pack writes GGUF types {write_types()}, not {qtype.name}.")
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    rows, out = rows_and_out(values, qtype, out)
    columns = rows.shape[1]
    if rows.is_contiguous() and compiled.gguf_quantize(qtype.name, rows.view(-1, block_size), out.view(-1, type_size)):
        return out
    kernel = _KERNELS[qtype]
    step = max(1, CHUNK_VALUES["cpu"] // columns)
    scratch = _Scratch(min(step, rows.shape[0]) * columns, block_size)
    with few_threads(torch.device("cpu")):
        for start in range(0, rows.shape[0], step):
            part = rows[start : start + step]
            if part.dtype == torch.float32 and part.is_contiguous():
                chunk = part
            else:
                chunk = scratch.x[: part.numel()].view(part.shape)
                chunk.copy_(part)
            blocks = chunk.view(-1, block_size)
            target = out[start : start + step].view(-1, type_size)
            torch.cat(kernel(blocks, scratch), dim=1, out=target)
    return out
