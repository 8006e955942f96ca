"""The GGUF types that store plain floats (F32, F16, BF16): read as a view of the bytes and a cast, written as
gguf-py writes them (a cast, round to nearest even). Values that are not finite, or beyond float16 in F16, are
refused: they would load and then spoil every image."""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType as Q

from .gguf_row import F16_MAX_BITS, FINITE_BITS, U32, GGUFType, check_peak, jit, magnitude, put


def _checked(b: torch.Tensor, limited: bool) -> torch.Tensor:
    check_peak(max(b.amax().item(), -b.amin().item()), limited)
    return b


def _f32(b, s):
    return [_checked(b, limited=False).view(torch.uint8)]


def _f16(b, s):
    return [_checked(b, limited=True).half().view(torch.uint8)]


def _bf16(b, s):
    # torch rounds finite values to nearest even exactly as ggml_compute_fp32_to_bf16 (NaN are refused first)
    return [_checked(b, limited=False).to(torch.bfloat16).view(torch.uint8)]


def _cast_kernel(bits_dtype, limit):
    """F16's (bits_dtype uint16) or BF16's (int16) quantizer, blocks of one value: every value cast to its 2-byte
    bits in one pass over memory, True where the largest magnitude is at most `limit` (bits). One loop that LLVM
    vectorizes: the check is a reduction beside the casts, so a bad value is found only at the end."""
    @jit(nogil=True)
    def cast(x, o):
        values, out = x.reshape(x.size), o.reshape(o.size).view(bits_dtype)
        peak = U32(0)
        for k in range(values.shape[0]):
            peak = max(peak, magnitude(values[k]))
            put(out, k, values[k])
        return peak <= limit

    return cast


ROWS = (
    GGUFType(Q.F32, 1, 4, float_dtype="float32", writer="gguf-py", write_torch=_f32),
    GGUFType(Q.F16, 1, 2, float_dtype="float16", writer="gguf-py", write_kernel=_cast_kernel(np.uint16, F16_MAX_BITS),
             write_torch=_f16),
    GGUFType(Q.BF16, 1, 2, float_dtype="bfloat16", writer="gguf-py",
             write_kernel=_cast_kernel(np.int16, FINITE_BITS), write_torch=_bf16),
)
