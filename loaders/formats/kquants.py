"""GGUF K-quant quantization (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K), bit-identical with ggml's reference quantizers
(quantize_row_q*_K_ref: what llama-quantize writes without an importance matrix), as gguf_quant.py is for the
legacy types: float rows in, GGUF bytes [rows, row bytes] out.

The quantizers are kquant_kernels.py, a line-by-line port of ggml's C: compiled by numba where it can run
(compiled.py), else run as plain Python over numpy float32 scalars, which gives the same bytes some thousand times
slower: work it would take more than a minute on is refused, saying to install numba.

Values that are not finite, and values beyond float16's range, are refused as gguf_quant.py refuses them: far beyond
it ggml's float32 sums overflow and it writes NaN scales or all-zero blocks, which load and then spoil every image.
A block whose fp16 scales still came out infinite or NaN is refused too."""

from __future__ import annotations

import math

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q

from ...errors import UnsupportedFormatError
from . import compiled, kquant_kernels
from .gguf_types import BY_TYPE, K_TYPES
from .quant_rows import NotQuantizable, check_peak, rows_and_out
from .steps import CHUNK_VALUES

# The plain path's pace (30-40 ms a block measured), and the most time it may be given for one conversion or tensor
PLAIN_SECONDS_PER_BLOCK = 0.035
PLAIN_SECONDS = 60


def _plain(qtype: Q, blocks: np.ndarray, out: np.ndarray) -> None:
    """The plain Python port of `qtype`'s quantizer over every block, on this thread (it holds the GIL)."""
    with np.errstate(all="ignore"):  # ggml's float32 arithmetic overflows on purpose (fp16 rounding, huge values)
        getattr(kquant_kernels, kquant_kernels.KERNELS[qtype.name])(blocks, out)


# Longer times as a person reads them: (seconds in the unit, its name), the largest first
_UNITS = ((86400, "days"), (3600, "hours"), (60, "minutes"), (1, "seconds"))


def check_pace(tensors) -> None:
    """Refuses, before anything is quantized, work that the plain path would take more than PLAIN_SECONDS on:
    `tensors` are (GGUF type, shape) pairs, those of the K types counted where their compiled quantizer cannot run."""
    slow = [(Q(qtype), math.prod(shape)) for qtype, shape in tensors if Q(qtype) in K_TYPES]
    blocks = sum(values // GGML_QUANT_SIZES[qtype][0] for qtype, values in slow
                 if compiled.kquant_path(qtype.name) == "python")
    seconds = blocks * PLAIN_SECONDS_PER_BLOCK
    if seconds <= PLAIN_SECONDS:
        return
    unit, name = next((unit, name) for unit, name in _UNITS if seconds >= unit)
    why = "numba cannot be imported" if compiled.kernel_module("kquant_kernels") is None else \
        "numba failed to compile them"
    raise UnsupportedFormatError(
        f"The compiled K-quant quantizers cannot run here ({why}; the log says why), and their plain Python port "
        f"would take about {seconds / unit:.0f} {name} for these {blocks} blocks. Install numba into the Python that "
        "runs the pack (pip install numba) and run it again.")


def _check_scales(qtype: Q, out: np.ndarray) -> None:
    """Refuses blocks whose fp16 scale fields are infinite or NaN (exponent bits all set)."""
    for at in BY_TYPE[qtype].scale_fields:
        if ((out[:, at + 1] & 0x7C) == 0x7C).any():
            raise NotQuantizable(f"its {qtype.name} scales are beyond float16's range (values too large)")


def quantize(values: torch.Tensor, qtype, *, out: torch.Tensor | None = None,
             threads: int | None = None) -> torch.Tensor:
    """The GGUF bytes of `values` (a float tensor on the CPU, any float dtype, last dimension the rows) in the K type
    `qtype`: uint8 [rows, row bytes], written into `out` where given (contiguous, of that shape), on `threads` threads
    (half the cores where not given). Raises
    NotQuantizable for values the type cannot hold (not finite, or beyond float16), ValueError for rows that do
    not hold whole blocks, and UnsupportedFormatError for work the plain path cannot keep pace with (check_pace)."""
    qtype = Q(qtype)
    if qtype not in K_TYPES:
        raise UnsupportedFormatError(f"The K-quant quantizer writes {', '.join(q.name for q in K_TYPES)}, "
                                     f"not {qtype.name}.")
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    rows, out = rows_and_out(values, qtype, out)
    check_pace([(qtype, rows.shape)])
    columns = rows.shape[1]
    step = max(1, CHUNK_VALUES["cpu"] // columns)  # a chunk converted to float32, checked, then spread over threads
    for start in range(0, rows.shape[0], step):
        chunk = rows[start : start + step].to(torch.float32).contiguous()
        check_peak(max(chunk.amax().item(), -chunk.amin().item()), limited=True)
        blocks, target = chunk.numpy().reshape(-1, block_size), out[start : start + step].numpy().reshape(-1, type_size)
        if not compiled.kquantize(qtype.name, blocks, target, threads):
            check_pace([(qtype, rows[start:].shape)])  # where the compiled kernel has just failed to compile
            _plain(qtype, blocks, target)
        _check_scales(qtype, target)
    return out
