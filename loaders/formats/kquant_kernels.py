"""ggml's K-quant reference quantizers (quantize_row_q{2,3,4,5,6}_K_ref and the searches they call, from
ggml-quants.c), ported line by line: float32 blocks [n, 256] -> GGUF blocks [n, type size] uint8.

Every float operation is a float32 one in the C source's order (an int is converted where C converts it), so the
bytes equal ggml's for any input: ggml's own nearest_int (the 12582912.f trick, whatever its argument),
its own fp16 conversions, the byte truncations of its uint8 and int8 stores. The code is plain Python over numpy
float32 scalars that numba also compiles: kquants.py runs it compiled (compile_all() below, on a copy of this module),
or as it is where numba cannot run (the same arithmetic, some thousand times slower). So it imports nothing of the
pack and no numba."""

from __future__ import annotations

import numpy as np

_F32 = np.float32
_U32 = np.uint32
_MAGIC = _F32(12582912.0)  # 1.5 * 2^23: adding it rounds a float32 to an integer, half to even
_GROUP_MAX_EPS = _F32(1e-15)
QK_K = 256


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


def _peak(n, x):
    """The first value of x[:n] with the largest magnitude (0 where all are 0), and that magnitude."""
    peak, amax = _F32(0.0), _F32(0.0)
    for i in range(n):
        ax = abs(x[i])
        if ax > amax:
            amax, peak = ax, x[i]
    return peak, amax


def _make_qx_quants(n, nmax, x, L):
    """make_qx_quants(n, nmax, x, L, rmse_type=1, qw=NULL): the scale; codes in L, nmax added."""
    peak, amax = _peak(n, x)
    if amax < _GROUP_MAX_EPS:
        for i in range(n):
            L[i] = 0
        return _F32(0.0)
    iscale = _F32(-nmax) / peak
    sumlx, suml2 = _F32(0.0), _F32(0.0)
    for i in range(n):
        l = _clamp(_nearest_int(iscale * x[i]), -nmax, nmax - 1)
        L[i] = l + nmax
        w = x[i] * x[i]
        sumlx += w * x[i] * _F32(l)
        suml2 += w * _F32(l) * _F32(l)
    scale = sumlx / suml2 if suml2 != _F32(0.0) else _F32(0.0)
    best = scale * sumlx
    for step in range(-9, 10):
        if step == 0:
            continue
        iscale = -(_F32(nmax) + _F32(0.1) * _F32(step)) / peak
        sumlx, suml2 = _F32(0.0), _F32(0.0)
        for i in range(n):
            l = _clamp(_nearest_int(iscale * x[i]), -nmax, nmax - 1)
            w = x[i] * x[i]
            sumlx += w * x[i] * _F32(l)
            suml2 += w * _F32(l) * _F32(l)
        if suml2 > _F32(0.0) and sumlx * sumlx > best * suml2:
            for i in range(n):
                L[i] = nmax + _clamp(_nearest_int(iscale * x[i]), -nmax, nmax - 1)
            scale = sumlx / suml2
            best = scale * sumlx
    return scale


def _make_q3_quants(n, nmax, x, L):
    """make_q3_quants(n, nmax, x, L, do_rmse=true): the scale; codes in L, nmax added."""
    peak, amax = _peak(n, x)
    if amax < _GROUP_MAX_EPS:
        for i in range(n):
            L[i] = 0
        return _F32(0.0)
    iscale = _F32(-nmax) / peak
    sumlx, suml2 = _F32(0.0), _F32(0.0)
    for i in range(n):
        l = _clamp(_nearest_int(iscale * x[i]), -nmax, nmax - 1)
        L[i] = l
        w = x[i] * x[i]
        sumlx += w * x[i] * _F32(l)
        suml2 += w * _F32(l) * _F32(l)
    for _ in range(5):
        changed = 0
        for i in range(n):
            w = x[i] * x[i]
            slx = sumlx - w * x[i] * _F32(L[i])
            if slx > _F32(0.0):
                sl2 = suml2 - w * _F32(L[i]) * _F32(L[i])
                new_l = _clamp(_nearest_int(x[i] * sl2 / slx), -nmax, nmax - 1)
                if new_l != L[i]:
                    slx += w * x[i] * _F32(new_l)
                    sl2 += w * _F32(new_l) * _F32(new_l)
                    if sl2 > _F32(0.0) and slx * slx * suml2 > sumlx * sumlx * sl2:
                        L[i] = new_l
                        sumlx, suml2 = slx, sl2
                        changed += 1
        if changed == 0:
            break
    for i in range(n):
        L[i] += nmax
    return sumlx / suml2 if suml2 > _F32(0.0) else _F32(0.0)


def _make_qkx2_quants(n, nmax, x, weights, L, Laux, rmin, rdelta, nstep, use_mad):
    """make_qkx2_quants: (the scale, the min to subtract); codes 0..nmax in L."""
    low, high = x[0], x[0]
    sum_w = weights[0]
    sum_x = sum_w * x[0]
    for i in range(1, n):
        if x[i] < low:
            low = x[i]
        if x[i] > high:
            high = x[i]
        w = weights[i]
        sum_w += w
        sum_x += w * x[i]
    if low > _F32(0.0):
        low = _F32(0.0)
    if high == low:
        for i in range(n):
            L[i] = 0
        return _F32(0.0), -low
    iscale = _F32(nmax) / (high - low)
    scale = _F32(1.0) / iscale
    best_error = _F32(0.0)
    for i in range(n):
        L[i] = _clamp(_nearest_int(iscale * (x[i] - low)), 0, nmax)
        diff = scale * _F32(L[i]) + low - x[i]
        diff = abs(diff) if use_mad else diff * diff
        best_error += weights[i] * diff
    for step in range(nstep + 1):
        iscale = (rmin + rdelta * _F32(step) + _F32(nmax)) / (high - low)
        sum_l, sum_l2, sum_xl = _F32(0.0), _F32(0.0), _F32(0.0)
        for i in range(n):
            l = _clamp(_nearest_int(iscale * (x[i] - low)), 0, nmax)
            Laux[i] = l
            w = weights[i]
            sum_l += w * _F32(l)
            sum_l2 += w * _F32(l) * _F32(l)
            sum_xl += w * _F32(l) * x[i]
        D = sum_w * sum_l2 - sum_l * sum_l
        if D > _F32(0.0):
            this_scale = (sum_w * sum_xl - sum_x * sum_l) / D
            this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D
            if this_min > _F32(0.0):
                this_min = _F32(0.0)
                this_scale = sum_xl / sum_l2
            cur_error = _F32(0.0)
            for i in range(n):
                diff = this_scale * _F32(Laux[i]) + this_min - x[i]
                diff = abs(diff) if use_mad else diff * diff
                cur_error += weights[i] * diff
            if cur_error < best_error:
                for i in range(n):
                    L[i] = Laux[i]
                best_error = cur_error
                scale, low = this_scale, this_min
    return scale, -low


def _pack_crumbs(o, at, L):
    """Four 2-bit codes a byte: byte at + j / 4 + l holds codes j + l, +32, +64, +96 (j = 0, 128; l < 32)."""
    for j in range(0, QK_K, 128):
        for l in range(32):
            o[at + j // 4 + l] = np.uint8(
                L[j + l] | (L[j + l + 32] << 2) | (L[j + l + 64] << 4) | (L[j + l + 96] << 6))


def q2_k(blocks, out):
    L, Laux = np.empty(QK_K, np.int32), np.empty(16, np.int32)
    weights, scales, mins = np.empty(16, np.float32), np.empty(16, np.float32), np.empty(16, np.float32)
    for i in range(blocks.shape[0]):
        x, o = blocks[i], out[i]
        max_scale, max_min = _F32(0.0), _F32(0.0)
        for j in range(16):
            for l in range(16):
                weights[l] = abs(x[16 * j + l])
            scales[j], mins[j] = _make_qkx2_quants(16, 3, x[16 * j:16 * j + 16], weights, L[16 * j:16 * j + 16],
                                                   Laux, _F32(-0.5), _F32(0.1), 15, True)
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


def q3_k(blocks, out):
    L, scales = np.empty(QK_K, np.int32), np.empty(16, np.float32)
    for i in range(blocks.shape[0]):
        x, o = blocks[i], out[i]
        max_scale, amax = _F32(0.0), _F32(0.0)
        for j in range(16):
            scales[j] = _make_q3_quants(16, 4, x[16 * j:16 * j + 16], L[16 * j:16 * j + 16])
            scale = abs(scales[j])
            if scale > amax:
                amax, max_scale = scale, scales[j]
        for j in range(96, 108):
            o[j] = 0
        if max_scale != _F32(0.0):
            iscale = _F32(-32.0) / max_scale
            for j in range(16):
                l = _clamp(_i8(_nearest_int(iscale * scales[j])), -32, 31) + 32
                if j < 8:
                    o[96 + j] = np.uint8(l & 15)
                else:
                    o[96 + j - 8] = np.uint8(np.int32(o[96 + j - 8]) | ((l & 15) << 4))
                l >>= 4
                o[104 + j % 4] = np.uint8(np.int32(o[104 + j % 4]) | (l << (2 * (j // 4))))
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
            o[m] = 0
        for j in range(QK_K):
            if L[j] > 3:
                o[j % 32] = np.uint8(np.int32(o[j % 32]) | (1 << (j // 32)))
                L[j] -= 4
        _pack_crumbs(o, 32, L)


def _q45_k(x, o, nmax, rmin, nstep, L, Laux, weights, scales, mins):
    """Q4_K and Q5_K's common part: d, dmin and the 6-bit scales and mins at o[0:16], the codes in L."""
    max_scale, max_min = _F32(0.0), _F32(0.0)
    for j in range(8):
        sum_x2 = _F32(0.0)
        for l in range(32):
            sum_x2 += x[32 * j + l] * x[32 * j + l]
        av_x = np.sqrt(sum_x2 / _F32(32.0))
        for l in range(32):
            weights[l] = av_x + abs(x[32 * j + l])
        scales[j], mins[j] = _make_qkx2_quants(32, nmax, x[32 * j:32 * j + 32], weights, L[32 * j:32 * j + 32],
                                               Laux, rmin, _F32(0.1), nstep, False)
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


def q4_k(blocks, out):
    L, Laux = np.empty(QK_K, np.int32), np.empty(32, np.int32)
    weights, scales, mins = np.empty(32, np.float32), np.empty(8, np.float32), np.empty(8, np.float32)
    for i in range(blocks.shape[0]):
        o = out[i]
        _q45_k(blocks[i], o, 15, _F32(-1.0), 20, L, Laux, weights, scales, mins)
        for j in range(0, QK_K, 64):
            for l in range(32):
                o[16 + j // 2 + l] = np.uint8(L[j + l] | (L[j + l + 32] << 4))


def q5_k(blocks, out):
    L, Laux = np.empty(QK_K, np.int32), np.empty(32, np.int32)
    weights, scales, mins = np.empty(32, np.float32), np.empty(8, np.float32), np.empty(8, np.float32)
    for i in range(blocks.shape[0]):
        o = out[i]
        _q45_k(blocks[i], o, 31, _F32(-0.5), 15, L, Laux, weights, scales, mins)
        # the fifth bit of codes n + j and n + j + 32 (n = 0, 64, ...) at bits n / 32 and n / 32 + 1 of qh byte j
        for j in range(32):
            o[16 + j] = 0
        for n in range(0, QK_K, 64):
            for j in range(32):
                l1, l2 = L[n + j], L[n + j + 32]
                qh = np.int32(o[16 + j])
                if l1 > 15:
                    l1 -= 16
                    qh |= 1 << (n // 32)
                if l2 > 15:
                    l2 -= 16
                    qh |= 2 << (n // 32)
                o[16 + j] = np.uint8(qh)
                o[48 + n // 2 + j] = np.uint8(l1 | (l2 << 4))


def q6_k(blocks, out):
    L, scales = np.empty(QK_K, np.int32), np.empty(16, np.float32)
    for i in range(blocks.shape[0]):
        x, o = blocks[i], out[i]
        max_scale, max_abs_scale = _F32(0.0), _F32(0.0)
        for ib in range(16):
            scale = _make_qx_quants(16, 32, x[16 * ib:16 * ib + 16], L[16 * ib:16 * ib + 16])
            scales[ib] = scale
            if abs(scale) > max_abs_scale:
                max_abs_scale, max_scale = abs(scale), scale
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
        # ql: low nibbles of codes j + l (+32) and, in the high nibble, j + l + 64 (+96); qh: their bits 4-5
        for j in range(0, QK_K, 128):
            for l in range(32):
                o[j // 2 + l] = np.uint8((L[j + l] & 15) | ((L[j + l + 64] & 15) << 4))
                o[j // 2 + l + 32] = np.uint8((L[j + l + 32] & 15) | ((L[j + l + 96] & 15) << 4))
                o[128 + j // 4 + l] = np.uint8((L[j + l] >> 4) | ((L[j + l + 32] >> 4) << 2)
                                               | ((L[j + l + 64] >> 4) << 4) | ((L[j + l + 96] >> 4) << 6))


# GGUF type name -> the function that quantizes its blocks
KERNELS = {"Q2_K": "q2_k", "Q3_K": "q3_k", "Q4_K": "q4_k", "Q5_K": "q5_k", "Q6_K": "q6_k"}
# Every function of this module, in the order they call each other (a callee compiled before its callers)
_FUNCTIONS = ("_bits", "_from_bits", "_nearest_int", "_fp16", "_fp32", "_put_fp16", "_i8", "_clamp", "_peak",
              "_make_qx_quants", "_make_q3_quants", "_make_qkx2_quants", "_pack_crumbs", "_q45_k", *KERNELS.values())


def compile_all(njit) -> None:
    """Replaces every function of this module (a copy of it loaded for this) by njit(function): they call each
    other through the module's names, so compiled code calls compiled code."""
    for name in _FUNCTIONS:
        globals()[name] = njit(globals()[name])
