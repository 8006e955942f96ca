"""numba's side of the kernels: the ops the kernel code calls (gguf_row.py's, gguf_legacy.py's block ops), compiled for
what they stand for: bit casts, the conversion of a float32 to the output dtype (`put`: the output array's type picks
it, rounding to nearest even as torch's cast), and a legacy block's 32 values worked on as one vector, in LLVM IR.
kernels.py binds OPS over the plain versions of these names (the VECTOR ones only in the fast build). No float
operation is fused (no fast-math); indexes are trusted (kernels.py checks the sizes). It imports nothing of the pack."""

from __future__ import annotations

import platform

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils, config
from numba.extending import intrinsic, overload

_U32 = np.uint32
_F32 = np.float32


def _hardware_fp16() -> bool:
    """Whether the compiled code may convert float32 to fp16 with the CPU's own instruction: x86 with F16C (numba
    compiles for the host CPU unless told another) or 64-bit ARM; elsewhere LLVM would call a function the JIT lacks."""
    machine = platform.machine().lower()
    if machine in ("arm64", "aarch64"):
        return True
    if machine not in ("x86_64", "amd64") or config.CPU_NAME not in (None, "host"):
        return False
    from llvmlite import binding

    return bool(binding.get_host_cpu_features().get("f16c", False))


HARDWARE_FP16 = _hardware_fp16()


def _cast(result, argument, build):
    """An intrinsic that converts one value: build(builder, value) emits its IR."""
    @intrinsic
    def cast(typingctx, x):
        def codegen(context, builder, signature, args):
            return build(builder, args[0])

        return result(argument), codegen

    return cast


# A float32's bits as uint32 and back (bitcasts); float32 -> fp16 bits by the CPU's instruction (LLVM's fptrunc);
# bfloat16 bits (int16) -> float32
_bits = _cast(types.uint32, types.float32, lambda builder, x: builder.bitcast(x, ir.IntType(32)))
_from_bits = _cast(types.float32, types.uint32, lambda builder, x: builder.bitcast(x, ir.FloatType()))
_fp16_by_cpu = _cast(types.uint16, types.float32,
                     lambda builder, x: builder.bitcast(builder.fptrunc(x, ir.HalfType()), ir.IntType(16)))
_from_bf16 = _cast(types.float32, types.int16, lambda builder, x: builder.bitcast(
    builder.shl(builder.zext(x, ir.IntType(32)), ir.Constant(ir.IntType(32), 16)), ir.FloatType()))


@njit
def _fp16_by_ops(f):
    """float32 -> fp16 bits (the scaling trick of the FP16 library: the float32 adder does the rounding)."""
    base = (abs(f) * _F32(2.0**112)) * _F32(2.0**-110)
    w = _bits(f)
    shl1 = _U32(w + w)
    sign = _U32(w >> _U32(16)) & _U32(0x8000)
    bias = max(shl1 & _U32(0xFF000000), _U32(0x71000000))
    base = _from_bits(_U32((bias >> _U32(1)) + _U32(0x07800000))) + base
    b = _bits(base)
    nonsign = _U32(((b >> _U32(13)) & _U32(0x7C00)) + (b & _U32(0x0FFF)))
    return np.uint16(sign | (nonsign if shl1 <= _U32(0xFF000000) else _U32(0x7E00)))


_to_fp16 = _fp16_by_cpu if HARDWARE_FP16 else _fp16_by_ops


@njit
def _bf16(f):
    """float32 -> bfloat16 bits (torch's rule); NaN stays NaN."""
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
    elif out.dtype == types.uint16:
        def put(out, i, v):
            out[i] = _to_fp16(v)
    elif out.dtype == types.int16:
        def put(out, i, v):
            out[i] = _bf16(v)
    else:
        return None
    return put


@njit(nogil=True)
def convert(values, out):
    """float32 values into `out` (one of the output array types): the conversion kernels.py checks against torch's."""
    for i in range(values.shape[0]):
        _put(out, i, values[i])


@njit(nogil=True)
def widen_bf16(bits, out):
    """bfloat16 bits [n, m] (int16) -> float32 out [n, m], exactly; both C-contiguous, read as one run."""
    values, wide = bits.reshape(bits.size), out.reshape(out.size)
    for k in range(values.shape[0]):
        wide[k] = _from_bf16(values[k])


# --- a legacy block's 32 values as one vector -----------------------------------------------------------------
# numba's loops over 32 values are vectorized at LLVM's whim, their integer work widened to 64 bits; these write LLVM's
# vector operations directly, the float32 ones those of the scalar code lane by lane.

_BLOCK = 32  # values per block of the legacy types (kernels.py checks that each row is one block)
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
    """(block i's maximum, its minimum) as float32: reductions of the values' integer order keys."""
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
    """(the bits of block i's largest magnitude, the lane of the first value with it, as numpy's argmax of abs): an
    integer reduction of the magnitudes' bits, then the first set bit of their comparison with it."""
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


@intrinsic(prefer_literal=True)
def _put_codes(typingctx, x, i, o, inverse, low, top, minimum, at, fifth_at):
    """gguf_legacy.put_codes (the plain loops are its reference) as one vector: `top`, `minimum`, `at` and
    `fifth_at` are constants of the kernel that calls it."""
    literal = (isinstance(top, types.IntegerLiteral) and isinstance(minimum, types.BooleanLiteral)
               and isinstance(at, types.IntegerLiteral) and isinstance(fifth_at, types.IntegerLiteral))
    if not (literal and _rows(x, types.float32) and _rows(o, types.uint8)):
        return None
    most, from_minimum = top.literal_value, minimum.literal_value
    offset = 0.5 if from_minimum else (most + 1) // 2 + 0.5

    def codegen(context, builder, signature, args):
        values = _values(context, builder, signature, args)
        if from_minimum:
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
                      _at(context, builder, o_type, args[2], args[1], at.literal_value, _I8, 16), align=1)
        if fifth_at.literal_value:
            fifth = builder.bitcast(builder.icmp_signed(">", codes, _splat(ir.Constant(_I32, 15))), _I32)
            field = builder.bitcast(_at(context, builder, o_type, args[2], args[1], fifth_at.literal_value, _I8, 4),
                                    ir.PointerType(_I32))
            builder.store(fifth, field, align=1)
        return context.get_dummy_value()

    return types.void(x, types.intp, o, types.float32, types.float32, top, minimum, at, fifth_at), codegen


@intrinsic
def _put_q8_0_codes(typingctx, x, i, o, inverse):
    """gguf_legacy.put_q8_0_codes as one vector."""
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


# The kernel code's ops by name -> what they are compiled as; VECTOR: those bound only in the fast build
OPS = {"bits": _bits, "from_bits": _from_bits, "put": _put, "to_fp16": _to_fp16, "block_range": _block_range,
       "block_peak": _block_peak, "put_codes": _put_codes, "put_q8_0_codes": _put_q8_0_codes}
VECTOR = ("block_range", "block_peak", "put_codes", "put_q8_0_codes")
