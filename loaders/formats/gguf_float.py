"""The GGUF types that store plain floats (F32, F16, BF16): read as a view of the bytes and a cast, written as
gguf-py writes them (a cast, round to nearest even). Values not finite, or beyond float16 in F16, are refused."""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType as Q

from .gguf_row import F16_MAX_BITS, FINITE_BITS, U32, GGUFType, check_peak, jit, magnitude, put


def _cast(dtype: torch.dtype, limited: bool):
    """A type's write_torch: the values checked, then cast (for bfloat16, torch rounds finite values to nearest even
    exactly as ggml_compute_fp32_to_bf16)."""
    def write(b, s):
        check_peak(max(b.amax().item(), -b.amin().item()), limited)
        return [b.to(dtype).view(torch.uint8)]

    return write


def _cast_kernel(bits_dtype, limit):
    """F16's (bits_dtype uint16) or BF16's (int16) quantizer: every value cast in one loop that LLVM vectorizes, the
    check a reduction beside the casts: True where the largest magnitude is at most `limit` (bits)."""
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
    GGUFType(Q.F32, 1, 4, float_dtype="float32", writer="gguf-py", write_torch=_cast(torch.float32, False)),
    GGUFType(Q.F16, 1, 2, float_dtype="float16", writer="gguf-py", write_kernel=_cast_kernel(np.uint16, F16_MAX_BITS),
             write_torch=_cast(torch.float16, True)),
    GGUFType(Q.BF16, 1, 2, float_dtype="bfloat16", writer="gguf-py",
             write_kernel=_cast_kernel(np.int16, FINITE_BITS), write_torch=_cast(torch.bfloat16, False)),
)
