"""ggml's K-quant reference quantizers (quantize_row_q{2,3,4,5,6}_K_ref and the searches they call, from
ggml-quants.c), ported line by line: float32 blocks [n, 256] -> GGUF blocks [n, type size] uint8.

Every float operation is a float32 one in the C source's order (an int is converted where C converts it), so the
bytes equal ggml's for any input: ggml's own nearest_int (the 12582912.f trick, whatever its argument),
its own fp16 conversions, the byte truncations of its uint8 and int8 stores. The searches for each block's groups
(make_qx_quants, make_q3_quants, make_qkx2_quants) run side by side, a group a lane of one scratch array, each lane
C's operations in C's order, so that numba turns the loops over the lanes into vector instructions (no fast-math, no
fused multiply-add: every rounding as C's). The code is plain Python over numpy float32 scalars that numba also
compiles: kquants.py runs it compiled (compiled.py calls compile_all() below, on a copy of this module), or as it is
where numba cannot run (the same arithmetic, some thousand times slower). So it imports nothing of the pack and no
numba."""

from __future__ import annotations

import numpy as np

_F32 = np.float32
_U32 = np.uint32
_MAGIC = _F32(12582912.0)  # 1.5 * 2^23: adding it rounds a float32 to an integer, half to even
_GROUP_MAX_EPS = _F32(1e-15)
QK_K = 256
# The searches' scratch, one float32 array: a row of _LANES lanes per quantity, then [value, lane] planes of the
# values, their weights (w), w times the value (wx) and their codes. One array, at offsets known when compiled: the
# compiler sees that no two rows overlap, and runs the loops over the lanes as vector instructions.
_LANES = 16
(_LOW, _HIGH, _SUM_W, _SUM_X, _FIRST_LOW, _ISCALE, _SUM_L, _SUM_L2, _SUM_XL, _D, _SCALE, _MIN, _ERROR, _BEST_ERROR,
 _BEST_SCALE, _BEST_ISCALE, _BEST_LOW, _PEAK, _AMAX, _CHANGED) = range(0, 20 * _LANES, _LANES)
_XS, _WS, _WX, _LEVELS = range(20 * _LANES, (20 + 4 * 32) * _LANES, 32 * _LANES)
SCRATCH = (20 + 4 * 32) * _LANES


def _bits(f):
    return np.float32(f).view(np.uint32)


def _from_bits(b):
    return np.uint32(b).view(np.float32)


def _nearest_int(f):
    """ggml's nearest_int: the low 23 bits of f + 1.5 * 2^23, less 2^22."""
    return np.int32(_bits(f + _MAGIC) & _U32(0x7FFFFF)) - np.int32(0x400000)


def _fp16(f):
    """ggml_compute_fp32_to_fp16: float32 -> fp16 bits, round to nearest even (the float32 adder rounds)."""
    base = (abs(f) * _F32(2.0**112)) * _F32(2.0**-110)
    w = _bits(f)
    shl1 = _U32((w & _U32(0x7FFFFFFF)) << _U32(1))
    sign = _U32(w & _U32(0x80000000))
    bias = _U32(shl1 & _U32(0xFF000000))
    if bias < _U32(0x71000000):
        bias = _U32(0x71000000)
    base = _from_bits(_U32((bias >> _U32(1)) + _U32(0x07800000))) + base
    b = _bits(base)
    nonsign = _U32(((b >> _U32(13)) & _U32(0x7C00)) + (b & _U32(0x0FFF)))
    return (sign >> _U32(16)) | (_U32(0x7E00) if shl1 > _U32(0xFF000000) else nonsign)


def _fp32(h):
    """ggml_compute_fp16_to_fp32: fp16 bits -> float32 (exact)."""
    w = _U32(_U32(h) << _U32(16))
    sign = _U32(w & _U32(0x80000000))
    two_w = _U32((w & _U32(0x7FFFFFFF)) << _U32(1))
    normalized = _from_bits(_U32((two_w >> _U32(4)) + _U32(0xE0 << 23))) * _F32(2.0**-112)
    denormalized = _from_bits(_U32((two_w >> _U32(17)) | _U32(126 << 23))) - _F32(0.5)
    return _from_bits(sign | (_bits(denormalized) if two_w < _U32(1 << 27) else _bits(normalized)))


def _put_fp16(o, at, f):
    """f as a little-endian fp16 field at byte `at` of block o; returns the float32 the field holds."""
    h = _fp16(f)
    o[at], o[at + 1] = np.uint8(h & _U32(255)), np.uint8(h >> _U32(8))
    return _fp32(h)


def _i8(v):
    """An int stored in an int8_t and read back."""
    return ((np.int32(v) + 128) & 255) - 128


def _clamp(v, low, high):
    return max(low, min(high, v))


def _peaks(n, groups, x, s):
    """Each group's values into the XS plane; its first value of the largest magnitude (0 where all are 0) in PEAK,
    that magnitude in AMAX; w = x * x and wx = w * x in the WS and WX planes."""
    for g in range(groups):
        s[_PEAK + g], s[_AMAX + g] = _F32(0.0), _F32(0.0)
    for i in range(n):
        for g in range(groups):
            v = x[n * g + i]
            s[_XS + _LANES * i + g] = v
            s[_WS + _LANES * i + g] = v * v
            s[_WX + _LANES * i + g] = v * v * v
            larger = abs(v) > s[_AMAX + g]
            s[_PEAK + g] = v if larger else s[_PEAK + g]
            s[_AMAX + g] = abs(v) if larger else s[_AMAX + g]


def _qx_sums(n, groups, nmax, s):
    """make_qx_quants' sums for the scales in ISCALE: sum of wx * level in SUM_XL, of w * level * level in SUM_L2."""
    for g in range(groups):
        s[_SUM_XL + g], s[_SUM_L2 + g] = _F32(0.0), _F32(0.0)
    for i in range(n):
        for g in range(groups):
            level = _F32(_clamp(_nearest_int(s[_ISCALE + g] * s[_XS + _LANES * i + g]), -nmax, nmax - 1))
            s[_SUM_XL + g] += s[_WX + _LANES * i + g] * level
            s[_SUM_L2 + g] += s[_WS + _LANES * i + g] * level * level


def _make_qx_quants(n, groups, nmax, x, L, scales, s):
    """make_qx_quants(n, nmax, x, L, rmse_type=1, qw=NULL) for each of `groups` groups of n values (group g:
    x[n * g:n * g + n] and the same part of L): its scale in scales[g], its codes (nmax added) in L. The groups are
    searched side by side, a lane each, as in make_qkx2_quants."""
    _peaks(n, groups, x, s)
    for g in range(groups):
        s[_ISCALE + g] = s[_BEST_ISCALE + g] = _F32(-nmax) / s[_PEAK + g]
    _qx_sums(n, groups, nmax, s)
    for g in range(groups):
        sumlx, suml2 = s[_SUM_XL + g], s[_SUM_L2 + g]
        s[_SCALE + g] = sumlx / suml2 if suml2 != _F32(0.0) else _F32(0.0)
        s[_BEST_ERROR + g] = s[_SCALE + g] * sumlx
    for step in range(-9, 10):
        if step == 0:
            continue
        for g in range(groups):
            s[_ISCALE + g] = -(_F32(nmax) + _F32(0.1) * _F32(step)) / s[_PEAK + g]
        _qx_sums(n, groups, nmax, s)
        for g in range(groups):
            sumlx, suml2 = s[_SUM_XL + g], s[_SUM_L2 + g]
            better = (suml2 > _F32(0.0)) & (sumlx * sumlx > s[_BEST_ERROR + g] * suml2)
            scale = sumlx / suml2
            s[_SCALE + g] = scale if better else s[_SCALE + g]
            s[_BEST_ERROR + g] = scale * sumlx if better else s[_BEST_ERROR + g]
            s[_BEST_ISCALE + g] = s[_ISCALE + g] if better else s[_BEST_ISCALE + g]
    for g in range(groups):
        zero = s[_AMAX + g] < _GROUP_MAX_EPS
        scales[g] = _F32(0.0) if zero else s[_SCALE + g]
        for i in range(n):
            code = nmax + _clamp(_nearest_int(s[_BEST_ISCALE + g] * s[_XS + _LANES * i + g]), -nmax, nmax - 1)
            L[n * g + i] = 0 if zero else code


def _make_q3_quants(n, groups, nmax, x, L, scales, s):
    """make_q3_quants(n, nmax, x, L, do_rmse=true) for each of `groups` groups of n values, side by side as in
    make_qx_quants. A pass over a group that changes no code would change none again: C stops there, and a
    group that is done here passes again unchanged while the others go on."""
    _peaks(n, groups, x, s)
    for g in range(groups):
        s[_ISCALE + g] = _F32(-nmax) / s[_PEAK + g]
        s[_SUM_XL + g], s[_SUM_L2 + g] = _F32(0.0), _F32(0.0)
    for i in range(n):
        for g in range(groups):
            level = _F32(_clamp(_nearest_int(s[_ISCALE + g] * s[_XS + _LANES * i + g]), -nmax, nmax - 1))
            s[_LEVELS + _LANES * i + g] = level
            s[_SUM_XL + g] += s[_WX + _LANES * i + g] * level
            s[_SUM_L2 + g] += s[_WS + _LANES * i + g] * level * level
    for _ in range(5):
        for g in range(groups):
            s[_CHANGED + g] = _F32(0.0)
        for i in range(n):
            for g in range(groups):
                v, w, wx, li = s[_XS + _LANES * i + g], s[_WS + _LANES * i + g], s[_WX + _LANES * i + g], \
                    s[_LEVELS + _LANES * i + g]
                sumlx, suml2 = s[_SUM_XL + g], s[_SUM_L2 + g]
                slx = sumlx - wx * li
                sl2 = suml2 - w * li * li
                new_l = _F32(_clamp(_nearest_int(v * sl2 / slx), -nmax, nmax - 1))
                new_slx = slx + wx * new_l
                new_sl2 = sl2 + w * new_l * new_l
                take = ((slx > _F32(0.0)) & (new_l != li) & (new_sl2 > _F32(0.0))
                        & (new_slx * new_slx * suml2 > sumlx * sumlx * new_sl2))
                s[_LEVELS + _LANES * i + g] = new_l if take else li
                s[_SUM_XL + g] = new_slx if take else sumlx
                s[_SUM_L2 + g] = new_sl2 if take else suml2
                s[_CHANGED + g] += _F32(1.0) if take else _F32(0.0)
        changed = _F32(0.0)
        for g in range(groups):
            changed += s[_CHANGED + g]
        if changed == _F32(0.0):
            break
    for g in range(groups):
        zero = s[_AMAX + g] < _GROUP_MAX_EPS
        suml2 = s[_SUM_L2 + g]
        scales[g] = s[_SUM_XL + g] / suml2 if suml2 > _F32(0.0) and not zero else _F32(0.0)
        for i in range(n):
            code = nmax + np.int32(s[_LEVELS + _LANES * i + g])
            L[n * g + i] = 0 if zero else code


def _make_qkx2_quants(n, groups, nmax, x, weights, L, scales, mins, rmin, rdelta, nstep, use_mad, s):
    """make_qkx2_quants for each of `groups` groups of n values (group g: x[n * g:n * g + n] and the same part of
    weights and L): its scale in scales[g], the min to subtract in mins[g], its codes 0..nmax in L. The groups are
    searched side by side, a lane each (C's float32 operations in C's order in every lane), so that the loops over
    the lanes run as vector instructions; s is the scratch (SCRATCH values)."""
    for i in range(n):
        for g in range(groups):
            s[_XS + _LANES * i + g], s[_WS + _LANES * i + g] = x[n * g + i], weights[n * g + i]
    for g in range(groups):
        s[_LOW + g] = s[_HIGH + g] = s[_SUM_W + g] = s[_SUM_X + g] = _F32(0.0)
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
        low = _F32(0.0) if s[_LOW + g] > _F32(0.0) else s[_LOW + g]
        s[_LOW + g] = s[_FIRST_LOW + g] = s[_BEST_LOW + g] = low
        iscale = _F32(nmax) / (s[_HIGH + g] - low)  # a group of equal values divides by 0: answered at the end
        s[_BEST_ISCALE + g], s[_BEST_SCALE + g], s[_BEST_ERROR + g] = iscale, _F32(1.0) / iscale, _F32(0.0)
    for i in range(n):
        for g in range(groups):
            v = s[_XS + _LANES * i + g]
            level = _F32(_clamp(_nearest_int(s[_BEST_ISCALE + g] * (v - s[_LOW + g])), 0, nmax))
            diff = s[_BEST_SCALE + g] * level + s[_LOW + g] - v
            diff = abs(diff) if use_mad else diff * diff
            s[_BEST_ERROR + g] += s[_WS + _LANES * i + g] * diff
    for step in range(nstep + 1):
        for g in range(groups):
            s[_ISCALE + g] = (rmin + rdelta * _F32(step) + _F32(nmax)) / (s[_HIGH + g] - s[_LOW + g])
            s[_SUM_L + g], s[_SUM_L2 + g], s[_SUM_XL + g], s[_ERROR + g] = _F32(0.0), _F32(0.0), _F32(0.0), _F32(0.0)
        for i in range(n):
            for g in range(groups):
                v, w = s[_XS + _LANES * i + g], s[_WS + _LANES * i + g]
                level = _F32(_clamp(_nearest_int(s[_ISCALE + g] * (v - s[_LOW + g])), 0, nmax))
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
            s[_SCALE + g] = sum_xl / sum_l2 if least > _F32(0.0) else scale
            s[_MIN + g] = _F32(0.0) if least > _F32(0.0) else least
        for i in range(n):
            for g in range(groups):
                diff = s[_SCALE + g] * s[_LEVELS + _LANES * i + g] + s[_MIN + g] - s[_XS + _LANES * i + g]
                diff = abs(diff) if use_mad else diff * diff
                s[_ERROR + g] += s[_WS + _LANES * i + g] * diff
        for g in range(groups):
            better = (s[_D + g] > _F32(0.0)) & (s[_ERROR + g] < s[_BEST_ERROR + g])
            s[_BEST_ERROR + g] = s[_ERROR + g] if better else s[_BEST_ERROR + g]
            s[_BEST_SCALE + g] = s[_SCALE + g] if better else s[_BEST_SCALE + g]
            s[_BEST_ISCALE + g] = s[_ISCALE + g] if better else s[_BEST_ISCALE + g]
            s[_BEST_LOW + g] = s[_LOW + g] if better else s[_BEST_LOW + g]  # the min the winner's codes came from
            s[_LOW + g] = s[_MIN + g] if better else s[_LOW + g]
    for g in range(groups):
        flat = s[_HIGH + g] == s[_FIRST_LOW + g]
        scales[g] = _F32(0.0) if flat else s[_BEST_SCALE + g]
        mins[g] = -s[_FIRST_LOW + g] if flat else -s[_LOW + g]
        for i in range(n):
            code = _clamp(_nearest_int(s[_BEST_ISCALE + g] * (s[_XS + _LANES * i + g] - s[_BEST_LOW + g])), 0, nmax)
            L[n * g + i] = 0 if flat else code


def _pack_crumbs(o, at, L):
    """Four 2-bit codes a byte: byte at + j / 4 + k holds codes j + k, +32, +64, +96 (j = 0, 128; k < 32)."""
    for j in range(0, QK_K, 128):
        for k in range(32):
            o[at + j // 4 + k] = np.uint8(
                L[j + k] | (L[j + k + 32] << 2) | (L[j + k + 64] << 4) | (L[j + k + 96] << 6))


def q2_k(blocks, out):
    L, weights, scratch = np.empty(QK_K, np.int32), np.empty(QK_K, np.float32), np.empty(SCRATCH, np.float32)
    scales, mins = np.empty(16, np.float32), np.empty(16, np.float32)
    for i in range(blocks.shape[0]):
        x, o = blocks[i], out[i]
        max_scale, max_min = _F32(0.0), _F32(0.0)
        for k in range(QK_K):
            weights[k] = abs(x[k])
        _make_qkx2_quants(16, 16, 3, x, weights, L, scales, mins, _F32(-0.5), _F32(0.1), 15, True, scratch)
        for j in range(16):
            if scales[j] > max_scale:
                max_scale = scales[j]
            if mins[j] > max_min:
                max_min = mins[j]
        if max_scale > _F32(0.0):
            iscale = _F32(15.0) / max_scale
            for j in range(16):
                o[j] = np.uint8(_nearest_int(iscale * scales[j]) & 255)
            d = _put_fp16(o, 80, max_scale / _F32(15.0))
        else:
            for j in range(16):
                o[j] = 0
            d = _put_fp16(o, 80, _F32(0.0))
        if max_min > _F32(0.0):
            iscale = _F32(15.0) / max_min
            for j in range(16):
                o[j] = np.uint8((np.int32(o[j]) | (_nearest_int(iscale * mins[j]) << 4)) & 255)
            dmin = _put_fp16(o, 82, max_min / _F32(15.0))
        else:
            dmin = _put_fp16(o, 82, _F32(0.0))
        for j in range(16):
            dj = d * _F32(np.int32(o[j]) & 15)
            if dj == _F32(0.0):
                continue
            dm = dmin * _F32(np.int32(o[j]) >> 4)
            for ii in range(16):
                L[16 * j + ii] = _clamp(_nearest_int((x[16 * j + ii] + dm) / dj), 0, 3)
        _pack_crumbs(o, 16, L)


def _peak(scales):
    """Q3_K and Q6_K: the first of a block's 16 scales with the largest magnitude, and that magnitude (0, 0 where all
    are 0)."""
    peak, magnitude = _F32(0.0), _F32(0.0)
    for j in range(16):
        if abs(scales[j]) > magnitude:
            peak, magnitude = scales[j], abs(scales[j])
    return peak, magnitude


def q3_k(blocks, out):
    L, scales, scratch = np.empty(QK_K, np.int32), np.empty(16, np.float32), np.empty(SCRATCH, np.float32)
    for i in range(blocks.shape[0]):
        x, o = blocks[i], out[i]
        _make_q3_quants(16, 16, 4, x, L, scales, scratch)
        max_scale = _peak(scales)[0]
        for j in range(96, 108):
            o[j] = 0
        if max_scale != _F32(0.0):
            iscale = _F32(-32.0) / max_scale
            for j in range(16):
                ls = _clamp(_i8(_nearest_int(iscale * scales[j])), -32, 31) + 32
                if j < 8:
                    o[96 + j] = np.uint8(ls & 15)
                else:
                    o[96 + j - 8] = np.uint8(np.int32(o[96 + j - 8]) | ((ls & 15) << 4))
                ls >>= 4
                o[104 + j % 4] = np.uint8(np.int32(o[104 + j % 4]) | (ls << (2 * (j // 4))))
            d = _put_fp16(o, 108, _F32(1.0) / iscale)
        else:
            d = _put_fp16(o, 108, _F32(0.0))
        for j in range(16):
            sc = np.int32(o[96 + j]) & 15 if j < 8 else np.int32(o[96 + j - 8]) >> 4
            sc = (sc | (((np.int32(o[104 + j % 4]) >> (2 * (j // 4))) & 3) << 4)) - 32
            dj = d * _F32(sc)
            if dj == _F32(0.0):
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


def _q45_search(blocks, i, nmax, rmin, nstep, values, weights, L, scales, mins, scratch):
    """Q4_K and Q5_K's searches of blocks i and i + 1 side by side (16 groups of 32 values: a lane each), or of block
    i twice where it is the last: the values and their weights in `values` and `weights` [512], the scales and mins
    in scales[16] and mins[16] (block i's first), the codes in L[512]."""
    for h in range(2):
        x = blocks[min(i + h, blocks.shape[0] - 1)]
        for j in range(8):
            sum_x2 = _F32(0.0)
            for k in range(32):
                sum_x2 += x[32 * j + k] * x[32 * j + k]
            av_x = np.sqrt(sum_x2 / _F32(32.0))
            for k in range(32):
                values[QK_K * h + 32 * j + k] = x[32 * j + k]
                weights[QK_K * h + 32 * j + k] = av_x + abs(x[32 * j + k])
    _make_qkx2_quants(32, 16, nmax, values, weights, L, scales, mins, rmin, _F32(0.1), nstep, False, scratch)


def _q45_k(x, o, nmax, L, scales, mins):
    """Q4_K and Q5_K's common part once searched: d, dmin and the 6-bit scales and mins at o[0:16], the codes in L."""
    max_scale, max_min = _F32(0.0), _F32(0.0)
    for j in range(8):
        if scales[j] > max_scale:
            max_scale = scales[j]
        if mins[j] > max_min:
            max_min = mins[j]
    inv_scale = _F32(63.0) / max_scale if max_scale > _F32(0.0) else _F32(0.0)
    inv_min = _F32(63.0) / max_min if max_min > _F32(0.0) else _F32(0.0)
    for j in range(8):
        ls = min(63, _nearest_int(inv_scale * scales[j]) & 255)
        lm = min(63, _nearest_int(inv_min * mins[j]) & 255)
        if j < 4:
            o[4 + j], o[8 + j] = np.uint8(ls), np.uint8(lm)
        else:
            o[8 + j] = np.uint8((ls & 15) | ((lm & 15) << 4))
            o[j] = np.uint8(np.int32(o[j]) | ((ls >> 4) << 6))
            o[4 + j] = np.uint8(np.int32(o[4 + j]) | ((lm >> 4) << 6))
    d = _put_fp16(o, 0, max_scale / _F32(63.0))
    dmin = _put_fp16(o, 2, max_min / _F32(63.0))
    for j in range(8):
        if j < 4:  # get_scale_min_k4
            sc, m = np.int32(o[4 + j]) & 63, np.int32(o[8 + j]) & 63
        else:
            sc = (np.int32(o[8 + j]) & 15) | ((np.int32(o[j]) >> 6) << 4)
            m = (np.int32(o[8 + j]) >> 4) | ((np.int32(o[4 + j]) >> 6) << 4)
        dj = d * _F32(sc)
        if dj == _F32(0.0):
            continue
        dm = dmin * _F32(m)
        for ii in range(32):
            L[32 * j + ii] = _clamp(_nearest_int((x[32 * j + ii] + dm) / dj), 0, nmax)


def _q45_kernel(blocks, out, nmax, rmin, nstep):
    """Q4_K (nmax 15) and Q5_K (nmax 31): blocks searched two at a time (_q45_search), then each one's scales and codes
    (_q45_k) and its code bytes: Q4_K's codes n + k and n + k + 32 (n = 0, 64, ...) as the low and high nibble of byte
    16 + n / 2 + k; Q5_K's the same from byte 48, their fifth bits at bits n / 32 and n / 32 + 1 of qh byte 16 + k."""
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


def q4_k(blocks, out):
    _q45_kernel(blocks, out, 15, _F32(-1.0), 20)


def q5_k(blocks, out):
    _q45_kernel(blocks, out, 31, _F32(-0.5), 15)


def q6_k(blocks, out):
    L, scales, scratch = np.empty(QK_K, np.int32), np.empty(16, np.float32), np.empty(SCRATCH, np.float32)
    for i in range(blocks.shape[0]):
        x, o = blocks[i], out[i]
        _make_qx_quants(16, 16, 32, x, L, scales, scratch)
        max_scale, max_abs_scale = _peak(scales)
        if max_abs_scale < _GROUP_MAX_EPS:
            for k in range(o.shape[0]):
                o[k] = 0
            _put_fp16(o, 208, _F32(0.0))
            continue
        iscale = _F32(-128.0) / max_scale
        d = _put_fp16(o, 208, _F32(1.0) / iscale)
        for ib in range(16):
            o[192 + ib] = np.uint8(min(127, _nearest_int(iscale * scales[ib])) & 255)
        for j in range(16):
            dj = d * _F32(_i8(o[192 + j]))
            if dj == _F32(0.0):
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


# GGUF type name -> the function that quantizes its blocks
KERNELS = {"Q2_K": "q2_k", "Q3_K": "q3_k", "Q4_K": "q4_k", "Q5_K": "q5_k", "Q6_K": "q6_k"}
# Every function of this module, in the order they call each other (a callee compiled before its callers)
_FUNCTIONS = ("_bits", "_from_bits", "_nearest_int", "_fp16", "_fp32", "_put_fp16", "_i8", "_clamp", "_peaks",
              "_qx_sums", "_make_qx_quants", "_make_q3_quants", "_make_qkx2_quants", "_pack_crumbs", "_peak",
              "_q45_search", "_q45_k", "_q45_kernel", *KERNELS.values())


def compile_all(njit) -> list:
    """Replaces every function of this module (a copy of it loaded for this) by njit(function): they call each
    other through the module's names, so compiled code calls compiled code. Returns the kernels (KERNELS')."""
    for name in _FUNCTIONS:
        globals()[name] = njit(globals()[name])
    return [globals()[name] for name in KERNELS.values()]
