"""One-pass kernels, compiled by numba on first use (no compiler needed on the user's machine) and cached on disk
(kernel_cache.py). Dequantization: each packed byte is read once and each value written once, in the output dtype,
straight into the destination; the torch path (gguf_dequant.py, packed_dequant.py) does the same float32 operations in
several passes over memory: unpack, widen, scale, cast. GGUF quantization (the last GGUF section): each value read
once, each block written once, where the torch path (gguf_quant.py) makes a pass per op.

Every kernel mirrors gguf's numpy reference (gguf.quants) operation by operation in float32 (no fused
multiply-add: numba compiles without fast-math flags, so LLVM keeps each rounding), then converts to the
output dtype with round-to-nearest-even, as torch's cast does. Outputs are passed as float32 arrays, as
uint16 arrays (fp16 bits) or as int16 arrays (bfloat16 bits): the array type picks the conversion when the
kernel is compiled. Only compiled.py loads this module, under a name of its own (the cached code records it), and only
when a CPU dequantization or quantization asks for it; so it imports nothing of the pack.

The kernels trust their inputs: numba does not check indexes, so compiled.py checks every size first.
"""

from __future__ import annotations

import platform
from types import FunctionType

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils, config
from numba.extending import intrinsic, overload

_U32 = np.uint32
_F32 = np.float32
# The kernels called from Python: compiled.py keeps their machine code on disk (kernel_cache.py), compiled once per
# machine.
CACHED = []


def _kernel(function):
    """njit for a kernel called from Python, listed in CACHED; the GIL released while it runs."""
    kernel = njit(nogil=True)(function)
    CACHED.append(kernel)
    return kernel


def _hardware_fp16() -> bool:
    """Whether the compiled code may convert float32 to fp16 with the CPU's own instruction: x86 with F16C
    (numba compiles for the host CPU unless told another) or any 64-bit ARM. Elsewhere LLVM would call a
    runtime function the JIT does not provide, so the conversion is done with integer and float32 ops."""
    machine = platform.machine().lower()
    if machine in ("arm64", "aarch64"):
        return True
    if machine not in ("x86_64", "amd64") or config.CPU_NAME not in (None, "host"):
        return False
    from llvmlite import binding

    return bool(binding.get_host_cpu_features().get("f16c", False))


HARDWARE_FP16 = _hardware_fp16()


@intrinsic
def _bits(typingctx, x):
    """A float32's bits as uint32 (a bitcast)."""
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))

    return types.uint32(types.float32), codegen


@intrinsic
def _from_bits(typingctx, x):
    """uint32 bits as the float32 they encode (a bitcast)."""
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())

    return types.float32(types.uint32), codegen


@intrinsic
def _fp16_by_cpu(typingctx, x):
    """float32 -> fp16 bits, round to nearest even, by the CPU's conversion instruction (LLVM's fptrunc)."""
    def codegen(context, builder, signature, args):
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))

    return types.uint16(types.float32), codegen


@njit
def _fp16_by_ops(f):
    """float32 -> fp16 bits, round to nearest even, overflow to inf, subnormals exact (the scaling trick of
    the FP16 library: the float32 adder does the rounding)."""
    base = (abs(f) * _F32(2.0**112)) * _F32(2.0**-110)
    w = _bits(f)
    shl1 = _U32(w + w)
    sign = _U32(w >> _U32(16)) & _U32(0x8000)
    bias = max(shl1 & _U32(0xFF000000), _U32(0x71000000))
    base = _from_bits(_U32((bias >> _U32(1)) + _U32(0x07800000))) + base
    b = _bits(base)
    nonsign = _U32(((b >> _U32(13)) & _U32(0x7C00)) + (b & _U32(0x0FFF)))
    return np.uint16(sign | (nonsign if shl1 <= _U32(0xFF000000) else _U32(0x7E00)))


@njit
def _bf16(f):
    """float32 -> bfloat16 bits, round to nearest even (torch's rule); NaN stays NaN."""
    w = _bits(f)
    if f != f:
        return np.int16(0x7FC0)
    return np.int16(_U32(w + _U32(0x7FFF) + ((w >> _U32(16)) & _U32(1))) >> _U32(16))


def _put(out, i, v):
    """out[i] = v converted to the dtype `out` stands for (compiled per array type, see the module doc)."""


@overload(_put)
def _put_typed(out, i, v):
    if out.dtype == types.float32:
        def put(out, i, v):
            out[i] = v
    elif out.dtype == types.uint16 and HARDWARE_FP16:
        def put(out, i, v):
            out[i] = _fp16_by_cpu(v)
    elif out.dtype == types.uint16:
        def put(out, i, v):
            out[i] = _fp16_by_ops(v)
    elif out.dtype == types.int16:
        def put(out, i, v):
            out[i] = _bf16(v)
    else:
        return None
    return put


@_kernel
def convert(values, out):
    """float32 values into `out` (one of the output array types): the conversion, checked once per process
    against torch's cast (compiled.py)."""
    for i in range(values.shape[0]):
        _put(out, i, values[i])


@njit
def _f16(b, at, halves):
    """The fp16 field at byte `at` of block `b` as float32, by numpy's own conversion (the 65536-entry
    table `halves`), so even NaN payloads match the reference's."""
    return halves[_U32(b[at]) | (_U32(b[at + 1]) << _U32(8))]


@njit
def _i8(byte):
    """A byte read as a signed int8."""
    x = np.int32(byte)
    return x - ((x & 128) << 1)


# --- GGUF: blocks [n, type size] uint8 -> out [n, block size]; halves: fp16 bits -> float32 -------------
# numba runs LLVM's loop vectorizer only. An inner loop gets vectorized when LLVM cannot count its trips
# (a loop of 16 it can count is unrolled first, and the unrolled code stays scalar) and when its stores lie
# at fixed distances from each other. So every inner loop runs over w = 16 or 32 values read from the
# output's shape, while its indexes use literal offsets: 3-7x the speed of the same code with w literal.


def _gguf(loops):
    """A type's kernel from the function that dequantizes one of its blocks, block(b, o, w, halves): b its bytes, o
    its values, w = the block's values // `loops` (the inner loops' trips, from the output's shape as above). The
    block function is inlined into the one loop over the blocks; `loops` is a constant of the kernel (a closure)."""
    def wrap(function):
        block = njit(inline="always")(function)

        @_kernel
        def kernel(blocks, out, halves):
            w = out.shape[1] // loops
            for i in range(blocks.shape[0]):
                block(blocks[i], out[i], w, halves)

        return kernel

    return wrap


@_gguf(1)
def q8_0(b, o, w, halves):
    d = _f16(b, 0, halves)
    for k in range(w):
        _put(o, k, _F32(_i8(b[2 + k])) * d)


@_gguf(2)
def q4_0(b, o, w, halves):
    d = _f16(b, 0, halves)
    for k in range(w):
        q = np.int32(b[2 + k])
        _put(o, k, d * _F32((q & 15) - 8))
        _put(o, 16 + k, d * _F32((q >> 4) - 8))


@_gguf(2)
def q4_1(b, o, w, halves):
    d, m = _f16(b, 0, halves), _f16(b, 2, halves)
    for k in range(w):
        q = np.int32(b[4 + k])
        _put(o, k, d * _F32(q & 15) + m)
        _put(o, 16 + k, d * _F32(q >> 4) + m)


@njit
def _u32(b, at):
    """The little-endian 32-bit field at byte `at`."""
    return _U32(b[at]) | (_U32(b[at + 1]) << _U32(8)) | (_U32(b[at + 2]) << _U32(16)) | (_U32(b[at + 3]) << _U32(24))


@njit
def _bit16(field, k):
    """Bit k of a 32-bit field, as 16 or 0."""
    return np.int32((field >> _U32(k)) & _U32(1)) << 4


@_gguf(2)
def q5_0(b, o, w, halves):
    d, qh = _f16(b, 0, halves), _u32(b, 2)
    for k in range(w):
        q = np.int32(b[6 + k])
        _put(o, k, d * _F32(((q & 15) | _bit16(qh, k)) - 16))
        _put(o, 16 + k, d * _F32(((q >> 4) | _bit16(qh, 16 + k)) - 16))


@_gguf(2)
def q5_1(b, o, w, halves):
    d, m, qh = _f16(b, 0, halves), _f16(b, 2, halves), _u32(b, 4)
    for k in range(w):
        q = np.int32(b[8 + k])
        _put(o, k, d * _F32((q & 15) | _bit16(qh, k)) + m)
        _put(o, 16 + k, d * _F32((q >> 4) | _bit16(qh, 16 + k)) + m)


@_gguf(16)
def q2_k(b, o, w, halves):
    d, dmin = _f16(b, 80, halves), _f16(b, 82, halves)
    # value at + k (at = h * 128 + j * 32, k < 32): crumb j of byte 16 + h * 32 + k; the scale and min
    # of its 16 are the nibbles of byte value // 16
    for h in range(2):
        for j in range(4):
            at, qs, shift = h * 128 + j * 32, 16 + h * 32, 2 * j
            s0, s1 = np.int32(b[at >> 4]), np.int32(b[(at >> 4) + 1])
            d0, m0 = d * _F32(s0 & 15), dmin * _F32(s0 >> 4)
            d1, m1 = d * _F32(s1 & 15), dmin * _F32(s1 >> 4)
            for k in range(w):
                _put(o, at + k, d0 * _F32((np.int32(b[qs + k]) >> shift) & 3) - m0)
                _put(o, at + 16 + k, d1 * _F32((np.int32(b[qs + 16 + k]) >> shift) & 3) - m1)


@njit
def _q3_k_scale(b, s, d):
    """Q3_K: d * scale s, from nibble s // 8 of byte 96 + s % 8 and crumb s // 4 of byte 104 + s % 4, minus 32."""
    low = (np.int32(b[96 + (s & 7)]) >> (4 * (s >> 3))) & 15
    high = (np.int32(b[104 + (s & 3)]) >> (2 * (s >> 2))) & 3
    return d * _F32(_i8(low | (high << 4)) - 32)


@_gguf(16)
def q3_k(b, o, w, halves):
    d = _f16(b, 108, halves)
    # value at + k (at = h * 128 + j * 32, k < 32): crumb j of byte 32 + h * 32 + k, minus 4 unless
    # bit h * 4 + j of hmask byte k is set; scale value // 16
    for h in range(2):
        for j in range(4):
            at, qs, shift, hshift = h * 128 + j * 32, 32 + h * 32, 2 * j, h * 4 + j
            d0, d1 = _q3_k_scale(b, at >> 4, d), _q3_k_scale(b, (at >> 4) + 1, d)
            for k in range(w):
                q = (np.int32(b[qs + k]) >> shift) & 3
                q -= (((np.int32(b[k]) >> hshift) & 1) ^ 1) << 2
                _put(o, at + k, d0 * _F32(q))
                q = (np.int32(b[qs + 16 + k]) >> shift) & 3
                q -= (((np.int32(b[16 + k]) >> hshift) & 1) ^ 1) << 2
                _put(o, at + 16 + k, d1 * _F32(q))


@njit
def _k4_scales(b, j, d, dmin):
    """Q4_K/Q5_K: d * scale and dmin * min of sub-block j, from their 6-bit fields in bytes 4-15."""
    if j < 4:
        sc, mn = np.int32(b[4 + j]) & 63, np.int32(b[8 + j]) & 63
    else:
        md = np.int32(b[8 + j])
        sc = (md & 15) | ((np.int32(b[j]) >> 2) & 48)
        mn = (md >> 4) | ((np.int32(b[4 + j]) >> 2) & 48)
    return d * _F32(sc), dmin * _F32(mn)


@njit(inline="always")
def _k4(b, o, w, halves, qs, fifth):
    """Q4_K (fifth False) and Q5_K: value g * 64 + k is the low nibble of byte qs + g * 32 + k, value g * 64 + 32 + k
    its high nibble; Q5_K's fifth bit of value v is bit v // 32 of qh byte 16 + v % 32. `fifth` is a constant of the
    caller, so Q4_K's code has no trace of it."""
    d, dmin = _f16(b, 0, halves), _f16(b, 2, halves)
    for g in range(4):
        d0, m0 = _k4_scales(b, 2 * g, d, dmin)
        d1, m1 = _k4_scales(b, 2 * g + 1, d, dmin)
        for k in range(w):
            q = np.int32(b[qs + g * 32 + k])
            qh = np.int32(b[16 + k]) >> (2 * g) if fifth else np.int32(0)
            _put(o, g * 64 + k, d0 * _F32((q & 15) | ((qh & 1) << 4)) - m0)
            _put(o, g * 64 + 32 + k, d1 * _F32((q >> 4) | ((qh & 2) << 3)) - m1)


@_gguf(8)
def q4_k(b, o, w, halves):
    _k4(b, o, w, halves, 16, False)


@_gguf(8)
def q5_k(b, o, w, halves):
    _k4(b, o, w, halves, 48, True)


@_gguf(16)
def q6_k(b, o, w, halves):
    d = _f16(b, 208, halves)
    # value at + k (at = h * 128 + j * 32, k < 32): nibble j // 2 of ql byte h * 64 + (j % 2) * 32 + k,
    # crumb j of qh byte 128 + h * 32 + k as bits 4-5, minus 32; scale: int8 byte 192 + value // 16
    for h in range(2):
        for j in range(4):
            at, ql, qh = h * 128 + j * 32, h * 64 + (j & 1) * 32, 128 + h * 32
            lshift, hshift = 4 * (j >> 1), 2 * j
            d0, d1 = d * _F32(_i8(b[192 + (at >> 4)])), d * _F32(_i8(b[193 + (at >> 4)]))
            for k in range(w):
                q = ((np.int32(b[ql + k]) >> lshift) & 15) | (((np.int32(b[qh + k]) >> hshift) & 3) << 4)
                _put(o, at + k, d0 * _F32(q - 32))
                q = ((np.int32(b[ql + 16 + k]) >> lshift) & 15) | (((np.int32(b[qh + 16 + k]) >> hshift) & 3) << 4)
                _put(o, at + 16 + k, d1 * _F32(q - 32))


# The IQ4 code book (kvalues_iq4nl in ggml) as two int64 words of eight int8 values each: a code's value is
# one byte of one word, picked by shifts that vectorize, where a table lookup would be a gather (1.4x slower).
_IQ4_WORDS = tuple(int(w) for w in np.array(
    (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113), np.int8).view(np.int64))


@njit
def _iq4(q):
    """The IQ4 value of code q (0-15), as float32."""
    word = np.int64(_IQ4_WORDS[1]) if q & 8 else np.int64(_IQ4_WORDS[0])
    return _F32(_i8((word >> ((q & 7) * 8)) & 255))


@_gguf(2)
def iq4_nl(b, o, w, halves):
    d = _f16(b, 0, halves)
    for k in range(w):
        q = np.int32(b[2 + k])
        _put(o, k, d * _iq4(q & 15))
        _put(o, 16 + k, d * _iq4(q >> 4))


@_gguf(16)
def iq4_xs(b, o, w, halves):
    d = _f16(b, 0, halves)
    high = np.int32(b[2]) | (np.int32(b[3]) << 8)
    # sub-block j: scale from nibble j % 2 of byte 4 + j // 2 and crumb j of bytes 2-3, minus 32;
    # value j * 32 + k: low nibble of byte 8 + j * 16 + k (k < 16), high nibble for k >= 16
    for j in range(8):
        low = (np.int32(b[4 + (j >> 1)]) >> (4 * (j & 1))) & 15
        dl = d * _F32(_i8(low | (((high >> (2 * j)) & 3) << 4)) - 32)
        for k in range(w):
            q = np.int32(b[8 + j * 16 + k])
            _put(o, j * 32 + k, dl * _iq4(q & 15))
            _put(o, j * 32 + 16 + k, dl * _iq4(q >> 4))


# GGUF type name -> kernel
GGUF = {
    "Q8_0": q8_0, "Q4_0": q4_0, "Q4_1": q4_1, "Q5_0": q5_0, "Q5_1": q5_1, "Q2_K": q2_k, "Q3_K": q3_k,
    "Q4_K": q4_k, "Q5_K": q5_k, "Q6_K": q6_k, "IQ4_NL": iq4_nl, "IQ4_XS": iq4_xs,
}


# --- GGUF quantization: float32 blocks [n, block size] -> out [n, type size] uint8 --------------------------
# Each kernel mirrors gguf-py's numpy quantizer (gguf.quants.quantize) operation by operation in float32, as the
# torch path (gguf_quant.py) does, with its refinements: a zero minimum or maximum is written +0, and a block
# whose inverse scale overflows gets codes 0 (what the reference's cast of infinities gives on x86). A kernel
# returns False as soon as it meets a value that is not finite or beyond float16 (out is then incomplete):
# the torch path runs that chunk again and refuses it, naming why.
#
# A block's 32 values are worked on as one vector (the intrinsics below write LLVM's vector operations
# directly: its largest magnitude, or its range, as reductions of integer keys, its codes lane by lane, Q5's
# fifth bits as one comparison's mask), where numba's loops over 16 or 32 values were vectorized or not at
# LLVM's whim and their integer work widened to 64 bits. The float32 operations are the scalar ones, lane by
# lane (no fast-math, so every rounding stays where the reference has it). bfloat16 blocks are widened to
# float32 (widen_bf16) a run at a time before they are quantized (compiled.py). F16 and BF16 (blocks of one
# value) are one loop of casts that LLVM vectorizes itself.

# float32 -> fp16 bits, round to nearest even: the CPU's instruction where it has one (see _put)
_to_fp16 = _fp16_by_cpu if HARDWARE_FP16 else _fp16_by_ops
_BLOCK = 32  # values per block of the block types (compiled.py checks that each row is one block)
_F16_MAX_BITS = _U32(0x477FE000)  # 65504, float16's largest finite value
_FINITE_BITS = _U32(0x7F7FFFFF)  # float32's largest finite value
_I32, _I8 = ir.IntType(32), ir.IntType(8)


def _splat(constant, count=_BLOCK):
    return ir.Constant(ir.VectorType(constant.type, count), [constant.constant] * count)


def _broadcast(builder, value, count=_BLOCK):
    """A value known at run time in every lane."""
    vector = ir.VectorType(value.type, count)
    one = builder.insert_element(ir.Constant(vector, ir.Undefined), value, ir.Constant(_I32, 0))
    return builder.shuffle_vector(one, one, ir.Constant(ir.VectorType(_I32, count), [0] * count))


def _at(context, builder, array_type, array, i, at, element, count):
    """A pointer to `count` values (IR type `element`) from [i, at] of a 2-D array whose rows are contiguous."""
    model = context.data_model_manager[array_type]
    data = builder.extract_value(array, model.get_field_position("data"))
    row_stride = builder.extract_value(builder.extract_value(array, model.get_field_position("strides")), 0)
    offset = builder.add(builder.mul(i, row_stride), ir.Constant(row_stride.type, at * array_type.dtype.bitwidth // 8))
    return builder.bitcast(builder.gep(builder.bitcast(data, ir.PointerType(_I8)), [offset]),
                           ir.PointerType(ir.VectorType(element, count)))


def _values(context, builder, signature, args):
    """Block i (args[1]) of the float32 array args[0], as <32 x float>."""
    return builder.load(_at(context, builder, signature.args[0], args[0], args[1], 0, ir.FloatType(), _BLOCK), align=4)


def _rows(array, dtype) -> bool:
    """Whether a kernel argument's type is a C-contiguous 2-D array of `dtype` (what _at reads and writes)."""
    return isinstance(array, types.Array) and array.dtype == dtype and array.ndim == 2 and array.layout == "C"


def _reduce(builder, name, vector):
    kind = vector.type
    function = cgutils.get_or_insert_function(builder.module, ir.FunctionType(kind.element, [kind]),
                                              f"llvm.vector.reduce.{name}.v{kind.count}i{kind.element.width}")
    return builder.call(function, [vector])


def _flip(builder, bits):
    """The bits other than the sign flipped where the sign is set: int32 keys that order float32 values as they
    compare (-0 below +0; NaN beyond the infinity of its sign), and back."""
    sign, rest = ir.Constant(_I32, 31), ir.Constant(_I32, 0x7FFFFFFF)
    if isinstance(bits.type, ir.VectorType):
        sign, rest = _splat(sign), _splat(rest)
    return builder.xor(bits, builder.and_(builder.ashr(bits, sign), rest))


@intrinsic
def _block_range(typingctx, x, i):
    """(block i's maximum, its minimum) as float32: reductions of the values' order keys, which LLVM may reorder
    (it may not reorder float ones)."""
    if not _rows(x, types.float32):
        return None

    def codegen(context, builder, signature, args):
        keys = _flip(builder, builder.bitcast(_values(context, builder, signature, args), ir.VectorType(_I32, _BLOCK)))
        ends = [builder.bitcast(_flip(builder, _reduce(builder, name, keys)), ir.FloatType())
                for name in ("smax", "smin")]
        return context.make_tuple(builder, signature.return_type, ends)

    return types.UniTuple(types.float32, 2)(x, types.intp), codegen


@intrinsic
def _block_peak(typingctx, x, i):
    """(the bits of block i's largest magnitude, the lane of the first value with it): one integer reduction of
    the magnitudes' bits (which order them as numpy's abs does), and the first set bit of their comparison with
    it, so the lane is numpy's argmax of abs. NaN and infinities have magnitudes beyond every finite one."""
    if not _rows(x, types.float32):
        return None

    def codegen(context, builder, signature, args):
        bits = builder.bitcast(_values(context, builder, signature, args), ir.VectorType(_I32, _BLOCK))
        magnitudes = builder.and_(bits, _splat(ir.Constant(_I32, 0x7FFFFFFF)))
        top = _reduce(builder, "umax", magnitudes)
        first = builder.bitcast(builder.icmp_unsigned("==", magnitudes, _broadcast(builder, top)), _I32)
        cttz = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_I32, [_I32, ir.IntType(1)]),
                                              "llvm.cttz.i32")
        lane = builder.call(cttz, [first, ir.Constant(ir.IntType(1), 1)])
        return context.make_tuple(builder, signature.return_type, [top, lane])

    return types.Tuple((types.uint32, types.uint32))(x, types.intp), codegen


# The code layouts of the 4- and 5-bit types, by (largest code, whether codes count from the minimum): (first code
# byte, the fifth bits' 32-bit field or None, what is added before truncating)
_CODES = {(15, False): (2, None, 8.5), (31, False): (6, 2, 16.5), (15, True): (4, None, 0.5), (31, True): (8, 4, 0.5)}


@intrinsic(prefer_literal=True)
def _put_codes(typingctx, x, i, o, inverse, low, top, minimum):
    """Block i's codes at o[i]: trunc(x * inverse + offset), or trunc((x - low) * inverse + offset) where they
    count from the minimum, clipped to 0..top; code k in the low nibble of code byte k, code 16 + k in its high
    nibble; where there are fifth bits, bit 4 of code k at bit k of a little-endian 32-bit field. `top` and
    `minimum` are constants (_CODES) of the kernel that calls it."""
    if not (_rows(x, types.float32) and _rows(o, types.uint8) and isinstance(top, types.IntegerLiteral)
            and isinstance(minimum, types.BooleanLiteral)):
        return None
    most = top.literal_value
    at, fifth_at, offset = _CODES[most, minimum.literal_value]

    def codegen(context, builder, signature, args):
        values = _values(context, builder, signature, args)
        if minimum.literal_value:
            values = builder.fsub(values, _broadcast(builder, args[4]))
        scaled = builder.fadd(builder.fmul(values, _broadcast(builder, args[3])),
                              _splat(ir.Constant(ir.FloatType(), offset)))
        codes = builder.fptosi(scaled, ir.VectorType(_I32, _BLOCK))
        for below, bound in (("<", 0), (">", most)):
            bound = _splat(ir.Constant(_I32, bound))
            codes = builder.select(builder.icmp_signed(below, codes, bound), bound, codes)
        halves = [builder.shuffle_vector(codes, codes,
                                         ir.Constant(ir.VectorType(_I32, 16), list(range(first, first + 16))))
                  for first in (0, 16)]
        nibble, four = _splat(ir.Constant(_I32, 15), 16), _splat(ir.Constant(_I32, 4), 16)
        packed = builder.or_(builder.and_(halves[0], nibble), builder.shl(builder.and_(halves[1], nibble), four))
        o_type = signature.args[2]
        builder.store(builder.trunc(packed, ir.VectorType(_I8, 16)),
                      _at(context, builder, o_type, args[2], args[1], at, _I8, 16), align=1)
        if fifth_at is not None:
            fifth = builder.bitcast(builder.icmp_signed(">", codes, _splat(ir.Constant(_I32, 15))), _I32)
            field = builder.bitcast(_at(context, builder, o_type, args[2], args[1], fifth_at, _I8, 4),
                                    ir.PointerType(_I32))
            builder.store(fifth, field, align=1)
        return context.get_dummy_value()

    return types.void(x, types.intp, o, types.float32, types.float32, top, minimum), codegen


@intrinsic
def _put_q8_0_codes(typingctx, x, i, o, inverse):
    """Q8_0's codes of block i at o[i, 2:]: the reference's round half away from zero of v = x * inverse,
    sign(v) * (floor(|v|) + floor(2 (|v| - floor(|v|)))), which is trunc(2v) - trunc(v) (2v is exact; |v| <= 127)."""
    if not (_rows(x, types.float32) and _rows(o, types.uint8)):
        return None

    def codegen(context, builder, signature, args):
        v = builder.fmul(_values(context, builder, signature, args), _broadcast(builder, args[3]))
        whole = ir.VectorType(_I32, _BLOCK)
        codes = builder.sub(builder.fptosi(builder.fadd(v, v), whole), builder.fptosi(v, whole))
        target = _at(context, builder, signature.args[2], args[2], args[1], 2, _I8, _BLOCK)
        builder.store(builder.trunc(codes, ir.VectorType(_I8, _BLOCK)), target, align=1)
        return context.get_dummy_value()

    return types.void(x, types.intp, o, types.float32), codegen


@njit
def _magnitude(v):
    return _bits(v) & _U32(0x7FFFFFFF)


@njit
def _put_fp16(o, i, at, v):
    """v as a little-endian fp16 field at byte `at` of block i."""
    h = np.int32(_to_fp16(v))
    o[i, at], o[i, at + 1] = np.uint8(h & 255), np.uint8(h >> 8)


@njit
def _zero_codes(o, i, at):
    for k in range(at, o.shape[1]):
        o[i, k] = 0


@njit
def _inverse(d):
    """1 / d, or 0 where d is 0 (the reference's np.where(d == 0, 0, 1 / d))."""
    return _F32(1.0) / d if d != _F32(0.0) else _F32(0.0)


@_kernel
def quantize_q8_0(x, o):
    for i in range(x.shape[0]):
        top = _block_peak(x, i)[0]
        if top > _F16_MAX_BITS:
            return False
        d = _from_bits(top) / _F32(127.0)
        _put_fp16(o, i, 0, d)
        inverse = _inverse(d)
        if np.isinf(inverse):
            _zero_codes(o, i, 2)
            continue
        _put_q8_0_codes(x, i, o, inverse)
    return True


def _signed_kernel(half: int):
    """The Q4_0 (half 8) or Q5_0 (half 16) kernel: d = the first value of largest magnitude / -half, codes
    trunc(x / d + half + 0.5) up to 2 half - 1; Q5_0's fifth bits between d and the code bytes. numba takes the
    closure's values as constants, so each kernel is compiled for its own type."""
    top, divisor = 2 * half - 1, _F32(-half)

    @_kernel
    def kernel(x, o):
        for i in range(x.shape[0]):
            peak, lane = _block_peak(x, i)
            if peak > _F16_MAX_BITS:
                return False
            d = x[i, lane] / divisor
            _put_fp16(o, i, 0, d)
            inverse = _inverse(d)
            if np.isinf(inverse):
                _zero_codes(o, i, 2)
                continue
            _put_codes(x, i, o, inverse, _F32(0.0), top, False)
        return True

    return kernel


def _min_max_kernel(top: int):
    """The Q4_1 (top 15) or Q5_1 (top 31) kernel: d = (max - min) / top, m = min, codes
    trunc((x - min) / d + 0.5); the codes laid out as _signed_kernel's, after d and m."""
    levels = _F32(top)

    @_kernel
    def kernel(x, o):
        for i in range(x.shape[0]):
            high, low = _block_range(x, i)
            # the larger magnitude of the two ends: above _F16_MAX_BITS where any value is not finite or beyond fp16
            if max(_magnitude(high), _magnitude(low)) > _F16_MAX_BITS:
                return False
            high, low = high + _F32(0.0), low + _F32(0.0)  # a zero as +0 (numpy's min and max give either)
            d = (high - low) / levels
            _put_fp16(o, i, 0, d)
            _put_fp16(o, i, 2, low)
            inverse = _inverse(d)
            if np.isinf(inverse):
                _zero_codes(o, i, 4)
                continue
            _put_codes(x, i, o, inverse, low, top, True)
        return True

    return kernel


@intrinsic
def _from_bf16(typingctx, h):
    """bfloat16 bits (int16) -> float32."""
    def codegen(context, builder, signature, args):
        wide = builder.shl(builder.zext(args[0], _I32), ir.Constant(_I32, 16))
        return builder.bitcast(wide, ir.FloatType())

    return types.float32(types.int16), codegen


@_kernel
def widen_bf16(bits, out):
    """bfloat16 bits [n, m] (int16) -> float32 out [n, m], exactly; both C-contiguous, read as one run."""
    values, wide = bits.reshape(bits.size), out.reshape(out.size)
    for k in range(values.shape[0]):
        wide[k] = _from_bf16(values[k])


def _cast_kernel(bits_dtype, limit):
    """The F16 (bits_dtype uint16) or BF16 (int16) kernel, blocks of one value: every value cast to its 2-byte
    bits (_put) in one pass over memory, True where the largest magnitude is at most `limit` (bits). One loop
    that LLVM vectorizes: the check is a reduction beside the casts, so a bad value is found only at the end
    (the torch path then refuses it)."""
    @_kernel
    def kernel(x, o):
        values, bits = x.reshape(x.size), o.reshape(o.size).view(bits_dtype)
        peak = _U32(0)
        for k in range(values.shape[0]):
            peak = max(peak, _magnitude(values[k]))
            _put(bits, k, values[k])
        return peak <= limit

    return kernel


# GGUF type name -> quantization kernel (float32 blocks)
QUANTIZE = {"F16": _cast_kernel(np.uint16, _F16_MAX_BITS), "BF16": _cast_kernel(np.int16, _FINITE_BITS),
            "Q8_0": quantize_q8_0, "Q5_1": _min_max_kernel(31), "Q5_0": _signed_kernel(16),
            "Q4_1": _min_max_kernel(15), "Q4_0": _signed_kernel(8)}


# The same block kernels with plain numba loops in place of the vector intrinsics: the reference they are
# measured against (`bench`: they stay only while at least 1.3x faster) and compared with bit for bit (tests).
# Each is the kernel's own code compiled again with these loops bound to the intrinsics' names; uncached, since
# its cache key would be the vector kernel's.
@njit
def _key(v):
    """A float32's order key: _flip of its bits, as int32."""
    bits = np.int32(_bits(v))
    return bits ^ ((bits >> 31) & np.int32(0x7FFFFFFF))


@njit
def _value(key):
    """The float32 of an order key (_flip is its own inverse)."""
    return _from_bits(np.uint32(key ^ ((key >> 31) & np.int32(0x7FFFFFFF))))


@njit
def _block_range_loop(x, i):
    high = low = _key(x[i, 0])
    for k in range(1, _BLOCK):
        key = _key(x[i, k])
        high, low = max(high, key), min(low, key)
    return _value(high), _value(low)


@njit
def _block_peak_loop(x, i):
    top, lane = _magnitude(x[i, 0]), _U32(0)
    for k in range(1, _BLOCK):
        if _magnitude(x[i, k]) > top:
            top, lane = _magnitude(x[i, k]), _U32(k)
    return top, lane


def _put_codes_loop(x, i, o, inverse, low, top, minimum):
    """_put_codes as a loop over the block's halves."""


@overload(_put_codes_loop, prefer_literal=True)
def _put_codes_loop_typed(x, i, o, inverse, low, top, minimum):
    at, fifth_at, offset = _CODES[top.literal_value, minimum.literal_value]
    most, from_minimum, offset, fifth = top.literal_value, minimum.literal_value, _F32(offset), fifth_at is not None

    @njit
    def code(v, inverse, low):
        return min(max(np.int32(((v - low) if from_minimum else v) * inverse + offset), 0), most)

    def put(x, i, o, inverse, low, top, minimum):
        fifth_bits = _U32(0)
        for k in range(_BLOCK // 2):
            first, second = code(x[i, k], inverse, low), code(x[i, k + 16], inverse, low)
            o[i, at + k] = np.uint8((first & 15) | ((second & 15) << 4))
            if fifth:
                fifth_bits |= (_U32((first >> 4) & 1) << _U32(k)) | (_U32((second >> 4) & 1) << _U32(k + 16))
        if fifth:
            for j in range(4):
                o[i, fifth_at + j] = np.uint8((fifth_bits >> _U32(8 * j)) & _U32(255))

    return put


@njit
def _put_q8_0_codes_loop(x, i, o, inverse):
    for k in range(_BLOCK):
        v = x[i, k] * inverse
        o[i, 2 + k] = np.uint8((np.int32(v + v) - np.int32(v)) & 255)


_LOOPS = {"_block_range": _block_range_loop, "_block_peak": _block_peak_loop, "_put_codes": _put_codes_loop,
          "_put_q8_0_codes": _put_q8_0_codes_loop}


def _with_loops(kernel):
    f = kernel.py_func
    code = FunctionType(f.__code__, {**f.__globals__, **_LOOPS}, f.__name__, f.__defaults__, f.__closure__)
    return njit(nogil=True)(code)


LOOP_QUANTIZE = {name: _with_loops(kernel) for name, kernel in QUANTIZE.items() if name not in ("F16", "BF16")}


# --- scaled fp8 and NVFP4 ---------------------------------------------------------------------------------


@_kernel
def fp8(codes, scales, out, book):
    """out[r, c] = book[codes[r, c]] * scales[r] (scales of length 1: one for every row); book: fp8 byte ->
    float32."""
    per_row = scales.shape[0] > 1
    for r in range(codes.shape[0]):
        s = scales[r if per_row else 0]
        c, o = codes[r], out[r]
        for k in range(c.shape[0]):
            _put(o, k, book[c[k]] * s)


@_kernel
def nvfp4(packed, tiled, tensor_scale, out, book, e2m1, first_row):
    """E2M1 value * (book[block scale] * tensor_scale[0]), the even element in the high nibble; the block
    scales in cuBLAS' 128x4 tiling (tiled: its bytes, [roundup(rows, 128) * roundup(blocks, 4)]), where
    row r and block c sit in tile (r // 128, c // 4) at (r % 32) * 16 + (r // 32 % 4) * 4 + c % 4.
    packed and out are the weight's rows from first_row on."""
    col_tiles = (packed.shape[1] // 8 + 3) // 4
    ts = tensor_scale[0]
    for i in range(packed.shape[0]):
        p, o, r = packed[i], out[i], first_row + i
        row_at = (r >> 7) * col_tiles * 512 + (r & 31) * 16 + ((r >> 5) & 3) * 4
        for c in range(packed.shape[1] // 8):
            s = book[tiled[row_at + (c >> 2) * 512 + (c & 3)]] * ts
            for k in range(8):
                q = np.int32(p[c * 8 + k])
                _put(o, c * 16 + 2 * k, e2m1[q >> 4] * s)
                _put(o, c * 16 + 2 * k + 1, e2m1[q & 15] * s)
