"""The K GGUF types, super-blocks of 256 values in sub-blocks with 4- to 8-bit scales (Q2_K to Q6_K), and IQ4_XS
(IQ4's book in the same frame). Each is read in gguf-py's float32 operations, in torch and in the one-pass kernel; the
Q*_K types are written as ggml writes them without an importance matrix (quantize_row_q*_K_ref of ggml-quants.c), by
a port of its C that does every float operation in float32 in C's order, so the bytes equal ggml's for any input. A
block's groups are searched side by side, a group a lane of one scratch array, so that numba vectorizes the loops.
Values not finite or beyond float16, and blocks whose fp16 scales came out infinite or NaN, are refused."""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType as Q

from .gguf_legacy import IQ4_VALUES, iq4, iq4_pair_codes
from .gguf_row import (
    BYTE_LANES,
    CRUMBS,
    F16_MAX_BITS,
    F32,
    NIBBLES,
    U32,
    GGUFType,
    ReadSteps,
    as_bytes,
    bits,
    block_reader,
    f16,
    f16_field,
    from_bits,
    i8,
    jit,
    magnitude,
    put,
    side_by_side,
    to_fp16,
    unpack,
    words,
)

# --- reading, in torch --------------------------------------------------------------------------------------------


def _signed6(low: torch.Tensor, high: torch.Tensor) -> torch.Tensor:
    """6-bit scales from 4 low and 2 high bits per byte, minus 32, as float32."""
    return ((low | (high << 4)).view(torch.int8) - 32).float()


def _by_groups(groups: int):
    """The `apply` of a type with `groups` scales a block: values times their scale, less their min where it has one."""
    def apply(v, dl, *ml):
        v = v.view(-1, groups, QK_K // groups).mul_(dl)
        if ml:
            v.sub_(ml[0])

    return apply


def _q2_k_scales(b):
    n = b.shape[0]
    sc = words(b[:, 0:16], torch.uint8)
    return (f16_field(b, 80) * (sc & 15).float()).view(n, 16, 1), (f16_field(b, 82) * (sc >> 4).float()).view(n, 16, 1)


def _q2_k_codes(b):
    return as_bytes(unpack(b[:, 16:80], 2, CRUMBS, 3))


def _q3_k_scales(b):
    n = b.shape[0]
    low = as_bytes(unpack(b[:, 96:104], 1, NIBBLES, 15))
    high = words(b[:, 104:108], torch.int32)
    high = torch.cat([(high >> s) & 0x03030303 for s in CRUMBS], dim=1).view(torch.uint8)
    return ((f16_field(b, 108) * _signed6(low, high)).view(n, 16, 1),)


def _q3_k_codes(b):
    n = b.shape[0]
    # value = low two bits - 4, unless the hmask bit is set: (low | hbit << 2) - 4 as int8
    q = unpack(b[:, 32:96], 2, CRUMBS, 3).view(n, -1)
    q.bitwise_or_(unpack(b[:, 0:32], 1, tuple(range(8)), 1).view(n, -1).bitwise_left_shift_(2))
    return as_bytes(q).sub_(4).view(torch.int8)


def _k4_scales(b):
    """Q4_K/Q5_K: d * scale and dmin * min of each sub-block (as _k4_scale_min reads them), [n, 8, 1] each."""
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
    scaled = torch.empty((2, n, 8), device=b.device)
    torch.mul(d_dmin.transpose(0, 1), sc_mn.view(torch.uint8).view(n, 2, 8).transpose(0, 1), out=scaled)
    return scaled[0].unsqueeze(-1), scaled[1].unsqueeze(-1)


def _q4_k_codes(b):
    return as_bytes(unpack(b[:, 16:144], 4, NIBBLES, 15))


def _q5_k_codes(b):
    # Sub-block j = 2g + s takes the low (s=0) or high (s=1) nibbles of qs group g, and bit j of each qh byte as its
    # fifth bit: with qh shifted right by 2g, that is bit 0 (s=0) or bit 1 (s=1).
    n = b.shape[0]
    qs = words(b[:, 48:176], torch.int64).view(n, 4, 4)
    qh = words(b[:, 16:48], torch.int64).view(n, 1, 4)
    qh = torch.cat([qh >> 2 * g for g in range(4)], dim=1)
    stacked = torch.empty((2, n, 4, 4), dtype=torch.int64, device=b.device)
    torch.bitwise_and(qs, 0x0F * BYTE_LANES, out=stacked[0]).bitwise_or_((qh & BYTE_LANES) << 4)
    torch.bitwise_right_shift(qs, 4, out=stacked[1]).bitwise_and_(0x0F * BYTE_LANES)
    stacked[1].bitwise_or_((qh << 3) & (0x10 * BYTE_LANES))
    return as_bytes(side_by_side(stacked))


def _q6_k_scales(b):
    return ((f16_field(b, 208) * b[:, 192:208].view(torch.int8).float()).view(-1, 16, 1),)


def _q6_k_codes(b):
    # Each half of 128 values: value s * 64 + w is nibble s of ql byte w, with crumb 2s + w // 32 of qh byte w % 32 as
    # bits 4-5. Shifting the upper 32 qh bytes' copy right by 2 leaves crumb 2s of "qh byte w" at bits 4s.
    n = b.shape[0]
    ql = words(b[:, 0:128], torch.int64).view(n, 2, 8)
    qh = words(b[:, 128:192], torch.int64).view(n, 2, 4)
    qh = torch.cat((qh, qh >> 2), dim=2)
    stacked = torch.empty((2, n, 2, 8), dtype=torch.int64, device=b.device)
    torch.bitwise_and(ql, 0x0F * BYTE_LANES, out=stacked[0]).bitwise_or_((qh & (0x03 * BYTE_LANES)) << 4)
    torch.bitwise_right_shift(ql, 4, out=stacked[1]).bitwise_and_(0x0F * BYTE_LANES)
    stacked[1].bitwise_or_(qh & (0x30 * BYTE_LANES))
    return as_bytes(side_by_side(stacked)).sub_(32).view(torch.int8)


def _iq4_xs_scales(b):
    n = b.shape[0]
    # 4-bit low parts, two per byte, low nibble first; 2-bit high parts, eight in a little-endian uint16
    low = words(b[:, 4:8], torch.uint8)
    low = torch.stack((low & 15, low >> 4), dim=2).view(n, 8)
    high = words(b[:, 2:4], torch.int16).int() & 0xFFFF
    high = ((high >> torch.arange(0, 16, 2, dtype=torch.int32, device=b.device)) & 3).to(torch.uint8)
    return ((f16_field(b, 0) * _signed6(low, high)).view(n, 8, 1),)


def _iq4_xs_codes(b):
    return iq4_pair_codes(b[:, 8:136])


# --- reading, kernel code -----------------------------------------------------------------------------------------


@jit(inline="always")
def _q2_k(b, o, w, halves):
    d, dmin = f16(b, 80, halves), f16(b, 82, halves)
    # value at + k (at = h * 128 + j * 32, k < 32): crumb j of byte 16 + h * 32 + k; the scale and min of its 16 are
    # the nibbles of byte value // 16
    for h in range(2):
        for j in range(4):
            at, qs, shift = h * 128 + j * 32, 16 + h * 32, 2 * j
            s0, s1 = np.int32(b[at >> 4]), np.int32(b[(at >> 4) + 1])
            d0, m0 = d * F32(s0 & 15), dmin * F32(s0 >> 4)
            d1, m1 = d * F32(s1 & 15), dmin * F32(s1 >> 4)
            for k in range(w):
                put(o, at + k, d0 * F32((np.int32(b[qs + k]) >> shift) & 3) - m0)
                put(o, at + 16 + k, d1 * F32((np.int32(b[qs + 16 + k]) >> shift) & 3) - m1)


@jit
def _q3_k_scale(b, s, d):
    """Q3_K: d * scale s, from nibble s // 8 of byte 96 + s % 8 and crumb s // 4 of byte 104 + s % 4, minus 32."""
    low = (np.int32(b[96 + (s & 7)]) >> (4 * (s >> 3))) & 15
    high = (np.int32(b[104 + (s & 3)]) >> (2 * (s >> 2))) & 3
    return d * F32(i8(low | (high << 4)) - 32)


@jit(inline="always")
def _q3_k(b, o, w, halves):
    d = f16(b, 108, halves)
    # value at + k (at = h * 128 + j * 32, k < 32): crumb j of byte 32 + h * 32 + k, minus 4 unless bit h * 4 + j of
    # hmask byte k is set; scale value // 16
    for h in range(2):
        for j in range(4):
            at, qs, shift, hshift = h * 128 + j * 32, 32 + h * 32, 2 * j, h * 4 + j
            d0, d1 = _q3_k_scale(b, at >> 4, d), _q3_k_scale(b, (at >> 4) + 1, d)
            for k in range(w):
                q = (np.int32(b[qs + k]) >> shift) & 3
                q -= (((np.int32(b[k]) >> hshift) & 1) ^ 1) << 2
                put(o, at + k, d0 * F32(q))
                q = (np.int32(b[qs + 16 + k]) >> shift) & 3
                q -= (((np.int32(b[16 + k]) >> hshift) & 1) ^ 1) << 2
                put(o, at + 16 + k, d1 * F32(q))


@jit
def _k4_scale_min(b, j, d, dmin):
    """Q4_K/Q5_K: d * scale and dmin * min of sub-block j, from their 6-bit fields in bytes 4-15."""
    if j < 4:
        sc, mn = np.int32(b[4 + j]) & 63, np.int32(b[8 + j]) & 63
    else:
        md = np.int32(b[8 + j])
        sc = (md & 15) | ((np.int32(b[j]) >> 2) & 48)
        mn = (md >> 4) | ((np.int32(b[4 + j]) >> 2) & 48)
    return d * F32(sc), dmin * F32(mn)


@jit(inline="always")
def _k4(b, o, w, halves, qs, fifth):
    """Q4_K (fifth False) and Q5_K: value g * 64 + k is the low nibble of byte qs + g * 32 + k, value g * 64 + 32 + k
    its high nibble; Q5_K's fifth bit of value v is bit v // 32 of qh byte 16 + v % 32 (`fifth`: a constant)."""
    d, dmin = f16(b, 0, halves), f16(b, 2, halves)
    for g in range(4):
        d0, m0 = _k4_scale_min(b, 2 * g, d, dmin)
        d1, m1 = _k4_scale_min(b, 2 * g + 1, d, dmin)
        for k in range(w):
            q = np.int32(b[qs + g * 32 + k])
            qh = np.int32(b[16 + k]) >> (2 * g) if fifth else np.int32(0)
            put(o, g * 64 + k, d0 * F32((q & 15) | ((qh & 1) << 4)) - m0)
            put(o, g * 64 + 32 + k, d1 * F32((q >> 4) | ((qh & 2) << 3)) - m1)


@jit(inline="always")
def _q4_k(b, o, w, halves):
    _k4(b, o, w, halves, 16, False)


@jit(inline="always")
def _q5_k(b, o, w, halves):
    _k4(b, o, w, halves, 48, True)


@jit(inline="always")
def _q6_k(b, o, w, halves):
    d = f16(b, 208, halves)
    # value at + k (at = h * 128 + j * 32, k < 32): nibble j // 2 of ql byte h * 64 + (j % 2) * 32 + k, crumb j of qh
    # byte 128 + h * 32 + k as bits 4-5, minus 32; scale: int8 byte 192 + value // 16
    for h in range(2):
        for j in range(4):
            at, ql, qh = h * 128 + j * 32, h * 64 + (j & 1) * 32, 128 + h * 32
            lshift, hshift = 4 * (j >> 1), 2 * j
            d0, d1 = d * F32(i8(b[192 + (at >> 4)])), d * F32(i8(b[193 + (at >> 4)]))
            for k in range(w):
                q = ((np.int32(b[ql + k]) >> lshift) & 15) | (((np.int32(b[qh + k]) >> hshift) & 3) << 4)
                put(o, at + k, d0 * F32(q - 32))
                q = ((np.int32(b[ql + 16 + k]) >> lshift) & 15) | (((np.int32(b[qh + 16 + k]) >> hshift) & 3) << 4)
                put(o, at + 16 + k, d1 * F32(q - 32))


@jit(inline="always")
def _iq4_xs(b, o, w, halves):
    d = f16(b, 0, halves)
    high = np.int32(b[2]) | (np.int32(b[3]) << 8)
    # sub-block j: scale from nibble j % 2 of byte 4 + j // 2 and crumb j of bytes 2-3, minus 32; value j * 32 + k:
    # low nibble of byte 8 + j * 16 + k (k < 16), high nibble for k >= 16
    for j in range(8):
        low = (np.int32(b[4 + (j >> 1)]) >> (4 * (j & 1))) & 15
        dl = d * F32(i8(low | (((high >> (2 * j)) & 3) << 4)) - 32)
        for k in range(w):
            q = np.int32(b[8 + j * 16 + k])
            put(o, j * 32 + k, dl * iq4(q & 15))
            put(o, j * 32 + 16 + k, dl * iq4(q >> 4))


# --- writing: ggml's reference quantizers, ported (kernel code) ----------------------------------------------------

# the port's functions: the GIL released; a division by zero gives C's infinity or NaN, not an error
_ggml = jit(nogil=True, error_model="numpy")

_MAGIC = F32(12582912.0)  # 1.5 * 2^23: adding it rounds a float32 to an integer, half to even
_GROUP_MAX_EPS = F32(1e-15)
QK_K = 256
# The searches' scratch, one float32 array at offsets known when compiled (so no two rows can overlap, and the loops
# over the lanes vectorize): a row of _LANES lanes per quantity, then [value, lane] planes of x, w, wx and codes.
_LANES = 16
(_LOW, _HIGH, _SUM_W, _SUM_X, _FIRST_LOW, _ISCALE, _SUM_L, _SUM_L2, _SUM_XL, _D, _SCALE, _MIN, _ERROR, _BEST_ERROR,
 _BEST_SCALE, _BEST_ISCALE, _BEST_LOW, _PEAK, _AMAX, _CHANGED) = range(0, 20 * _LANES, _LANES)
_XS, _WS, _WX, _LEVELS = range(20 * _LANES, (20 + 4 * 32) * _LANES, 32 * _LANES)
SCRATCH = (20 + 4 * 32) * _LANES


@_ggml
def _nearest_int(f):
    """ggml's nearest_int: the low 23 bits of f + 1.5 * 2^23, less 2^22."""
    return np.int32(bits(f + _MAGIC) & U32(0x7FFFFF)) - np.int32(0x400000)


@_ggml
def _fp32(h):
    """ggml_compute_fp16_to_fp32: fp16 bits -> float32 (exact)."""
    w = U32(U32(h) << U32(16))
    sign = U32(w & U32(0x80000000))
    two_w = U32((w & U32(0x7FFFFFFF)) << U32(1))
    normalized = from_bits(U32((two_w >> U32(4)) + U32(0xE0 << 23))) * F32(2.0**-112)
    denormalized = from_bits(U32((two_w >> U32(17)) | U32(126 << 23))) - F32(0.5)
    return from_bits(sign | (bits(denormalized) if two_w < U32(1 << 27) else bits(normalized)))


@_ggml
def _put_fp16(o, at, f):
    """f as a little-endian fp16 field at byte `at` of block o; returns the float32 the field holds."""
    h = to_fp16(f)
    o[at], o[at + 1] = np.uint8(h & U32(255)), np.uint8(h >> U32(8))
    return _fp32(h)


@_ggml
def _i8(v):
    """An int stored in an int8_t and read back."""
    return ((np.int32(v) + 128) & 255) - 128


@_ggml
def _clamp(v, low, high):
    return max(low, min(high, v))


@_ggml
def _peaks(n, groups, x, s):
    """Each group's values, w = x * x and wx = w * x into their planes; its first value of the largest magnitude (0
    where all are 0) in PEAK, that magnitude in AMAX."""
    for g in range(groups):
        s[_PEAK + g], s[_AMAX + g] = F32(0.0), F32(0.0)
    for i in range(n):
        for g in range(groups):
            v = x[n * g + i]
            s[_XS + _LANES * i + g] = v
            s[_WS + _LANES * i + g] = v * v
            s[_WX + _LANES * i + g] = v * v * v
            larger = abs(v) > s[_AMAX + g]
            s[_PEAK + g] = v if larger else s[_PEAK + g]
            s[_AMAX + g] = abs(v) if larger else s[_AMAX + g]


@_ggml
def _qx_sums(n, groups, nmax, s):
    """make_qx_quants' sums for the scales in ISCALE: sum of wx * level in SUM_XL, of w * level * level in SUM_L2."""
    for g in range(groups):
        s[_SUM_XL + g], s[_SUM_L2 + g] = F32(0.0), F32(0.0)
    for i in range(n):
        for g in range(groups):
            level = F32(_clamp(_nearest_int(s[_ISCALE + g] * s[_XS + _LANES * i + g]), -nmax, nmax - 1))
            s[_SUM_XL + g] += s[_WX + _LANES * i + g] * level
            s[_SUM_L2 + g] += s[_WS + _LANES * i + g] * level * level


@_ggml
def _make_qx_quants(n, groups, nmax, x, L, scales, s):
    """make_qx_quants(n, nmax, x, L, rmse_type=1, qw=NULL) for `groups` groups of n values side by side (group g:
    x[n * g:n * g + n] and the same part of L): its scale in scales[g], its codes (nmax added) in L."""
    _peaks(n, groups, x, s)
    for g in range(groups):
        s[_ISCALE + g] = s[_BEST_ISCALE + g] = F32(-nmax) / s[_PEAK + g]
    _qx_sums(n, groups, nmax, s)
    for g in range(groups):
        sumlx, suml2 = s[_SUM_XL + g], s[_SUM_L2 + g]
        s[_SCALE + g] = sumlx / suml2 if suml2 != F32(0.0) else F32(0.0)
        s[_BEST_ERROR + g] = s[_SCALE + g] * sumlx
    for step in range(-9, 10):
        if step == 0:
            continue
        for g in range(groups):
            s[_ISCALE + g] = -(F32(nmax) + F32(0.1) * F32(step)) / s[_PEAK + g]
        _qx_sums(n, groups, nmax, s)
        for g in range(groups):
            sumlx, suml2 = s[_SUM_XL + g], s[_SUM_L2 + g]
            better = (suml2 > F32(0.0)) & (sumlx * sumlx > s[_BEST_ERROR + g] * suml2)
            scale = sumlx / suml2
            s[_SCALE + g] = scale if better else s[_SCALE + g]
            s[_BEST_ERROR + g] = scale * sumlx if better else s[_BEST_ERROR + g]
            s[_BEST_ISCALE + g] = s[_ISCALE + g] if better else s[_BEST_ISCALE + g]
    for g in range(groups):
        zero = s[_AMAX + g] < _GROUP_MAX_EPS
        scales[g] = F32(0.0) if zero else s[_SCALE + g]
        for i in range(n):
            code = nmax + _clamp(_nearest_int(s[_BEST_ISCALE + g] * s[_XS + _LANES * i + g]), -nmax, nmax - 1)
            L[n * g + i] = 0 if zero else code


@_ggml
def _make_q3_quants(n, groups, nmax, x, L, scales, s):
    """make_q3_quants(n, nmax, x, L, do_rmse=true) for `groups` groups side by side, as make_qx_quants. A group whose
    pass changed no code (where C stops) passes again unchanged while the others go on."""
    _peaks(n, groups, x, s)
    for g in range(groups):
        s[_ISCALE + g] = F32(-nmax) / s[_PEAK + g]
        s[_SUM_XL + g], s[_SUM_L2 + g] = F32(0.0), F32(0.0)
    for i in range(n):
        for g in range(groups):
            level = F32(_clamp(_nearest_int(s[_ISCALE + g] * s[_XS + _LANES * i + g]), -nmax, nmax - 1))
            s[_LEVELS + _LANES * i + g] = level
            s[_SUM_XL + g] += s[_WX + _LANES * i + g] * level
            s[_SUM_L2 + g] += s[_WS + _LANES * i + g] * level * level
    for _ in range(5):
        for g in range(groups):
            s[_CHANGED + g] = F32(0.0)
        for i in range(n):
            for g in range(groups):
                v, w, wx, li = s[_XS + _LANES * i + g], s[_WS + _LANES * i + g], s[_WX + _LANES * i + g], \
                    s[_LEVELS + _LANES * i + g]
                sumlx, suml2 = s[_SUM_XL + g], s[_SUM_L2 + g]
                slx = sumlx - wx * li
                sl2 = suml2 - w * li * li
                new_l = F32(_clamp(_nearest_int(v * sl2 / slx), -nmax, nmax - 1))
                new_slx = slx + wx * new_l
                new_sl2 = sl2 + w * new_l * new_l
                take = ((slx > F32(0.0)) & (new_l != li) & (new_sl2 > F32(0.0))
                        & (new_slx * new_slx * suml2 > sumlx * sumlx * new_sl2))
                s[_LEVELS + _LANES * i + g] = new_l if take else li
                s[_SUM_XL + g] = new_slx if take else sumlx
                s[_SUM_L2 + g] = new_sl2 if take else suml2
                s[_CHANGED + g] += F32(1.0) if take else F32(0.0)
        changed = F32(0.0)
        for g in range(groups):
            changed += s[_CHANGED + g]
        if changed == F32(0.0):
            break
    for g in range(groups):
        zero = s[_AMAX + g] < _GROUP_MAX_EPS
        suml2 = s[_SUM_L2 + g]
        scales[g] = s[_SUM_XL + g] / suml2 if suml2 > F32(0.0) and not zero else F32(0.0)
        for i in range(n):
            code = nmax + np.int32(s[_LEVELS + _LANES * i + g])
            L[n * g + i] = 0 if zero else code


@_ggml
def _make_qkx2_quants(n, groups, nmax, x, weights, L, scales, mins, rmin, rdelta, nstep, use_mad, s):
    """make_qkx2_quants for `groups` groups side by side, as make_qx_quants; the min to subtract in mins[g]."""
    for i in range(n):
        for g in range(groups):
            s[_XS + _LANES * i + g], s[_WS + _LANES * i + g] = x[n * g + i], weights[n * g + i]
    for g in range(groups):
        s[_LOW + g], s[_HIGH + g], s[_SUM_W + g] = s[_XS + g], s[_XS + g], s[_WS + g]
        s[_SUM_X + g] = s[_SUM_W + g] * s[_XS + g]
    for i in range(1, n):
        for g in range(groups):
            v, w = s[_XS + _LANES * i + g], s[_WS + _LANES * i + g]
            s[_LOW + g] = v if v < s[_LOW + g] else s[_LOW + g]
            s[_HIGH + g] = v if v > s[_HIGH + g] else s[_HIGH + g]
            s[_SUM_W + g] += w
            s[_SUM_X + g] += w * v
    for g in range(groups):
        low = F32(0.0) if s[_LOW + g] > F32(0.0) else s[_LOW + g]
        s[_LOW + g] = s[_FIRST_LOW + g] = s[_BEST_LOW + g] = low
        iscale = F32(nmax) / (s[_HIGH + g] - low)  # a group of equal values divides by 0: answered at the end
        s[_BEST_ISCALE + g], s[_BEST_SCALE + g], s[_BEST_ERROR + g] = iscale, F32(1.0) / iscale, F32(0.0)
    for i in range(n):
        for g in range(groups):
            v = s[_XS + _LANES * i + g]
            level = F32(_clamp(_nearest_int(s[_BEST_ISCALE + g] * (v - s[_LOW + g])), 0, nmax))
            diff = s[_BEST_SCALE + g] * level + s[_LOW + g] - v
            diff = abs(diff) if use_mad else diff * diff
            s[_BEST_ERROR + g] += s[_WS + _LANES * i + g] * diff
    for step in range(nstep + 1):
        for g in range(groups):
            s[_ISCALE + g] = (rmin + rdelta * F32(step) + F32(nmax)) / (s[_HIGH + g] - s[_LOW + g])
            s[_SUM_L + g], s[_SUM_L2 + g], s[_SUM_XL + g], s[_ERROR + g] = F32(0.0), F32(0.0), F32(0.0), F32(0.0)
        for i in range(n):
            for g in range(groups):
                v, w = s[_XS + _LANES * i + g], s[_WS + _LANES * i + g]
                level = F32(_clamp(_nearest_int(s[_ISCALE + g] * (v - s[_LOW + g])), 0, nmax))
                s[_LEVELS + _LANES * i + g] = level
                s[_SUM_L + g] += w * level
                s[_SUM_L2 + g] += w * level * level
                s[_SUM_XL + g] += w * level * v
        for g in range(groups):
            sum_w, sum_x = s[_SUM_W + g], s[_SUM_X + g]
            sum_l, sum_l2, sum_xl = s[_SUM_L + g], s[_SUM_L2 + g], s[_SUM_XL + g]
            D = s[_D + g] = sum_w * sum_l2 - sum_l * sum_l
            scale = (sum_w * sum_xl - sum_x * sum_l) / D  # used only where D > 0
            least = (sum_l2 * sum_x - sum_l * sum_xl) / D
            s[_SCALE + g] = sum_xl / sum_l2 if least > F32(0.0) else scale
            s[_MIN + g] = F32(0.0) if least > F32(0.0) else least
        for i in range(n):
            for g in range(groups):
                diff = s[_SCALE + g] * s[_LEVELS + _LANES * i + g] + s[_MIN + g] - s[_XS + _LANES * i + g]
                diff = abs(diff) if use_mad else diff * diff
                s[_ERROR + g] += s[_WS + _LANES * i + g] * diff
        for g in range(groups):
            better = (s[_D + g] > F32(0.0)) & (s[_ERROR + g] < s[_BEST_ERROR + g])
            s[_BEST_ERROR + g] = s[_ERROR + g] if better else s[_BEST_ERROR + g]
            s[_BEST_SCALE + g] = s[_SCALE + g] if better else s[_BEST_SCALE + g]
            s[_BEST_ISCALE + g] = s[_ISCALE + g] if better else s[_BEST_ISCALE + g]
            s[_BEST_LOW + g] = s[_LOW + g] if better else s[_BEST_LOW + g]  # the min the winner's codes came from
            s[_LOW + g] = s[_MIN + g] if better else s[_LOW + g]
    for g in range(groups):
        flat = s[_HIGH + g] == s[_FIRST_LOW + g]
        scales[g] = F32(0.0) if flat else s[_BEST_SCALE + g]
        mins[g] = -s[_FIRST_LOW + g] if flat else -s[_LOW + g]
        for i in range(n):
            code = _clamp(_nearest_int(s[_BEST_ISCALE + g] * (s[_XS + _LANES * i + g] - s[_BEST_LOW + g])), 0, nmax)
            L[n * g + i] = 0 if flat else code


@_ggml
def _pack_crumbs(o, at, L):
    """Four 2-bit codes a byte: byte at + j / 4 + k holds codes j + k, +32, +64, +96 (j = 0, 128; k < 32)."""
    for j in range(0, QK_K, 128):
        for k in range(32):
            o[at + j // 4 + k] = np.uint8(
                L[j + k] | (L[j + k + 32] << 2) | (L[j + k + 64] << 4) | (L[j + k + 96] << 6))


@_ggml
def _largest(values):
    """The largest of `values`, 0 where none is above 0."""
    top = F32(0.0)
    for j in range(values.shape[0]):
        if values[j] > top:
            top = values[j]
    return top


@_ggml
def _peak(scales):
    """Q3_K and Q6_K: the first of 16 scales with the largest magnitude, and that magnitude (0, 0 where all are 0)."""
    peak, magnitude = F32(0.0), F32(0.0)
    for j in range(16):
        if abs(scales[j]) > magnitude:
            peak, magnitude = scales[j], abs(scales[j])
    return peak, magnitude


@_ggml
def q2_k(blocks, out):
    L, weights, scratch = np.empty(QK_K, np.int32), np.empty(QK_K, np.float32), np.empty(SCRATCH, np.float32)
    scales, mins = np.empty(16, np.float32), np.empty(16, np.float32)
    for i in range(blocks.shape[0]):
        x, o = blocks[i], out[i]
        for k in range(QK_K):
            weights[k] = abs(x[k])
        _make_qkx2_quants(16, 16, 3, x, weights, L, scales, mins, F32(-0.5), F32(0.1), 15, True, scratch)
        max_scale, max_min = _largest(scales), _largest(mins)
        if max_scale > F32(0.0):
            iscale = F32(15.0) / max_scale
            for j in range(16):
                o[j] = np.uint8(_nearest_int(iscale * scales[j]) & 255)
            d = _put_fp16(o, 80, max_scale / F32(15.0))
        else:
            for j in range(16):
                o[j] = 0
            d = _put_fp16(o, 80, F32(0.0))
        if max_min > F32(0.0):
            iscale = F32(15.0) / max_min
            for j in range(16):
                o[j] = np.uint8((np.int32(o[j]) | (_nearest_int(iscale * mins[j]) << 4)) & 255)
            dmin = _put_fp16(o, 82, max_min / F32(15.0))
        else:
            dmin = _put_fp16(o, 82, F32(0.0))
        for j in range(16):
            dj = d * F32(np.int32(o[j]) & 15)
            if dj == F32(0.0):
                continue
            dm = dmin * F32(np.int32(o[j]) >> 4)
            for ii in range(16):
                L[16 * j + ii] = _clamp(_nearest_int((x[16 * j + ii] + dm) / dj), 0, 3)
        _pack_crumbs(o, 16, L)


@_ggml
def q3_k(blocks, out):
    L, scales, scratch = np.empty(QK_K, np.int32), np.empty(16, np.float32), np.empty(SCRATCH, np.float32)
    for i in range(blocks.shape[0]):
        x, o = blocks[i], out[i]
        _make_q3_quants(16, 16, 4, x, L, scales, scratch)
        max_scale = _peak(scales)[0]
        for j in range(96, 108):
            o[j] = 0
        if max_scale != F32(0.0):
            iscale = F32(-32.0) / max_scale
            for j in range(16):
                ls = _clamp(_i8(_nearest_int(iscale * scales[j])), -32, 31) + 32
                if j < 8:
                    o[96 + j] = np.uint8(ls & 15)
                else:
                    o[96 + j - 8] = np.uint8(np.int32(o[96 + j - 8]) | ((ls & 15) << 4))
                ls >>= 4
                o[104 + j % 4] = np.uint8(np.int32(o[104 + j % 4]) | (ls << (2 * (j // 4))))
            d = _put_fp16(o, 108, F32(1.0) / iscale)
        else:
            d = _put_fp16(o, 108, F32(0.0))
        for j in range(16):
            dj = _q3_k_scale(o, j, d)
            if dj == F32(0.0):
                continue
            for ii in range(16):
                L[16 * j + ii] = _clamp(_nearest_int(x[16 * j + ii] / dj), -4, 3) + 4
        # the third bit of code j at bit j / 32 of hmask byte j % 32
        for m in range(32):
            hmask = 0
            for k in range(8):
                hmask |= (L[32 * k + m] >> 2) << k
                L[32 * k + m] &= 3
            o[m] = np.uint8(hmask)
        _pack_crumbs(o, 32, L)


@_ggml
def _q45_search(blocks, i, nmax, rmin, nstep, values, weights, L, scales, mins, scratch):
    """Q4_K and Q5_K's searches of blocks i and i + 1 (or i twice, the last) side by side, block i's results first."""
    for h in range(2):
        x = blocks[min(i + h, blocks.shape[0] - 1)]
        for j in range(8):
            sum_x2 = F32(0.0)
            for k in range(32):
                sum_x2 += x[32 * j + k] * x[32 * j + k]
            av_x = np.sqrt(sum_x2 / F32(32.0))
            for k in range(32):
                values[QK_K * h + 32 * j + k] = x[32 * j + k]
                weights[QK_K * h + 32 * j + k] = av_x + abs(x[32 * j + k])
    _make_qkx2_quants(32, 16, nmax, values, weights, L, scales, mins, rmin, F32(0.1), nstep, False, scratch)


@_ggml
def _q45_k(x, o, nmax, L, scales, mins):
    """Q4_K and Q5_K's common part once searched: d, dmin and the 6-bit scales and mins at o[0:16], the codes in L."""
    max_scale, max_min = _largest(scales), _largest(mins)
    inv_scale = F32(63.0) / max_scale if max_scale > F32(0.0) else F32(0.0)
    inv_min = F32(63.0) / max_min if max_min > F32(0.0) else F32(0.0)
    for j in range(8):
        ls = min(63, _nearest_int(inv_scale * scales[j]) & 255)
        lm = min(63, _nearest_int(inv_min * mins[j]) & 255)
        if j < 4:
            o[4 + j], o[8 + j] = np.uint8(ls), np.uint8(lm)
        else:
            o[8 + j] = np.uint8((ls & 15) | ((lm & 15) << 4))
            o[j] = np.uint8(np.int32(o[j]) | ((ls >> 4) << 6))
            o[4 + j] = np.uint8(np.int32(o[4 + j]) | ((lm >> 4) << 6))
    d = _put_fp16(o, 0, max_scale / F32(63.0))
    dmin = _put_fp16(o, 2, max_min / F32(63.0))
    for j in range(8):
        dj, dm = _k4_scale_min(o, j, d, dmin)
        if dj == F32(0.0):
            continue
        for ii in range(32):
            L[32 * j + ii] = _clamp(_nearest_int((x[32 * j + ii] + dm) / dj), 0, nmax)


@_ggml
def _q45_kernel(blocks, out, nmax, rmin, nstep):
    """Q4_K (nmax 15) and Q5_K (nmax 31): blocks searched two at a time, then written one by one, as _k4 reads them."""
    codes, values = np.empty(2 * QK_K, np.int32), np.empty(2 * QK_K, np.float32)
    weights = np.empty(2 * QK_K, np.float32)
    scales, mins, scratch = np.empty(16, np.float32), np.empty(16, np.float32), np.empty(SCRATCH, np.float32)
    qs = 16 if nmax == 15 else 48
    for b in range(blocks.shape[0]):
        if b % 2 == 0:
            _q45_search(blocks, b, nmax, rmin, nstep, values, weights, codes, scales, mins, scratch)
        h, o = b % 2, out[b]
        L = codes[QK_K * h:QK_K * h + QK_K]
        _q45_k(blocks[b], o, nmax, L, scales[8 * h:8 * h + 8], mins[8 * h:8 * h + 8])
        for k in range(32):
            qh = 0
            for n in range(0, QK_K, 64):
                l1, l2 = L[n + k], L[n + k + 32]
                qh |= ((l1 >> 4) << (n // 32)) | ((l2 >> 4) << (n // 32 + 1))
                o[qs + n // 2 + k] = np.uint8((l1 & 15) | ((l2 & 15) << 4))
            if nmax == 31:
                o[16 + k] = np.uint8(qh)


@_ggml
def q4_k(blocks, out):
    _q45_kernel(blocks, out, 15, F32(-1.0), 20)


@_ggml
def q5_k(blocks, out):
    _q45_kernel(blocks, out, 31, F32(-0.5), 15)


@_ggml
def q6_k(blocks, out):
    L, scales, scratch = np.empty(QK_K, np.int32), np.empty(16, np.float32), np.empty(SCRATCH, np.float32)
    for i in range(blocks.shape[0]):
        x, o = blocks[i], out[i]
        _make_qx_quants(16, 16, 32, x, L, scales, scratch)
        max_scale, max_abs_scale = _peak(scales)
        if max_abs_scale < _GROUP_MAX_EPS:
            for k in range(o.shape[0]):
                o[k] = 0
            _put_fp16(o, 208, F32(0.0))
            continue
        iscale = F32(-128.0) / max_scale
        d = _put_fp16(o, 208, F32(1.0) / iscale)
        for ib in range(16):
            o[192 + ib] = np.uint8(min(127, _nearest_int(iscale * scales[ib])) & 255)
        for j in range(16):
            dj = d * F32(_i8(o[192 + j]))
            if dj == F32(0.0):
                continue
            for ii in range(16):
                L[16 * j + ii] = _clamp(_nearest_int(x[16 * j + ii] / dj), -32, 31) + 32
        # ql: low nibbles of codes j + k (+32) and, in the high nibble, j + k + 64 (+96); qh: their bits 4-5
        for j in range(0, QK_K, 128):
            for k in range(32):
                o[j // 2 + k] = np.uint8((L[j + k] & 15) | ((L[j + k + 64] & 15) << 4))
                o[j // 2 + k + 32] = np.uint8((L[j + k + 32] & 15) | ((L[j + k + 96] & 15) << 4))
                o[128 + j // 4 + k] = np.uint8((L[j + k] >> 4) | ((L[j + k + 32] >> 4) << 2)
                                               | ((L[j + k + 64] >> 4) << 4) | ((L[j + k + 96] >> 4) << 6))


def _checked(quantize, scale_fields: tuple[int, ...]):
    """The port's quantizer, False at a value not finite or beyond float16, or an fp16 scale written infinite or NaN."""
    @_ggml
    def checked(x, o):
        for i in range(x.shape[0]):
            for k in range(QK_K):
                if magnitude(x[i, k]) > F16_MAX_BITS:
                    return False
        quantize(x, o)
        for i in range(o.shape[0]):
            for at in scale_fields:
                if o[i, at + 1] & 0x7C == 0x7C:
                    return False
        return True

    return checked


def _row(qtype, block_bytes, scale_fields, read, read_block, loops, quantize=None, fallback=None):
    return GGUFType(qtype, QK_K, block_bytes, scale_fields, read=read, read_kernel=block_reader(read_block, loops),
                    writer="ggml" if quantize else None,
                    write_kernel=quantize and _checked(quantize, scale_fields), fallback=fallback)


# (type, block bytes, fp16 scale fields, torch dequantizer, block kernel and its loops, ggml's quantizer, and the
# 32-value type llama.cpp falls back to where rows do not hold whole blocks: its tensor_type_fallback)
ROWS = (
    _row(Q.Q2_K, 84, (80, 82), ReadSteps(_q2_k_scales, _q2_k_codes, _by_groups(16)), _q2_k, 16, q2_k, "Q4_0"),
    _row(Q.Q3_K, 110, (108,), ReadSteps(_q3_k_scales, _q3_k_codes, _by_groups(16)), _q3_k, 16, q3_k, "Q4_0"),
    _row(Q.Q4_K, 144, (0, 2), ReadSteps(_k4_scales, _q4_k_codes, _by_groups(8)), _q4_k, 8, q4_k, "Q5_0"),
    _row(Q.Q5_K, 176, (0, 2), ReadSteps(_k4_scales, _q5_k_codes, _by_groups(8)), _q5_k, 8, q5_k, "Q5_1"),
    _row(Q.Q6_K, 210, (208,), ReadSteps(_q6_k_scales, _q6_k_codes, _by_groups(16)), _q6_k, 16, q6_k, "Q8_0"),
    _row(Q.IQ4_XS, 136, (0,), ReadSteps(_iq4_xs_scales, _iq4_xs_codes, _by_groups(8), IQ4_VALUES), _iq4_xs, 16),
)
