"""The rows a GGUF quantizer fills, and the values it refuses: shared by the legacy types' quantizer
(gguf_quant.py) and the K types' (kquants.py)."""

from __future__ import annotations

import math

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q

from .steps import output

_F16_MAX = 65504.0
_F32_MAX = float(np.finfo(np.float32).max)
UNLIMITED = (Q.F32, Q.BF16)  # the types without a float16 field: they hold any finite float32


class NotQuantizable(ValueError):
    """The values cannot be written in the asked type (not finite, beyond a float16 field, or beyond float32)."""


def check_peak(peak: float, limited: bool) -> None:
    """Refuse values of largest magnitude `peak` that are not finite, beyond float16 where the type has a float16
    field (`limited`), or beyond float32 (float64 values, which the quantizers' float32 cast would make infinite)."""
    if not math.isfinite(peak):
        raise NotQuantizable("it holds NaN or infinite values")
    top, name = (_F16_MAX, "float16") if limited else (_F32_MAX, "float32")
    if peak > top:
        raise NotQuantizable(f"it holds values up to {peak:g}, beyond {name}'s {top:g}")


def row_bytes(qtype, columns: int) -> int:
    """Bytes of one row of `columns` values in `qtype`."""
    block_size, type_size = GGML_QUANT_SIZES[Q(qtype)]
    return columns // block_size * type_size


def quantized_buffer(qtype, rows: int, columns: int) -> torch.Tensor:
    """Room for `rows` rows of `columns` values in `qtype`: uint8 [rows, row bytes], uninitialized. numpy allocates
    it because numpy asks Linux for huge pages on large arrays (madvise) and torch does not: the kernels stream
    their output, and into 4 KiB pages they lost 15-25% of their speed to address translation."""
    return torch.from_numpy(np.empty((rows, row_bytes(qtype, columns)), np.uint8))


def fits(qtype, shape) -> bool:
    """Whether a tensor of `shape` (torch order) can be stored in `qtype`: its rows hold whole blocks."""
    return shape[-1] % GGML_QUANT_SIZES[Q(qtype)][0] == 0 if shape else False


def rows_and_out(values: torch.Tensor, qtype: Q, out: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """`values` as rows [n, columns] (the last dimension), and the uint8 [n, row bytes] they are quantized into:
    `out` where given (checked to be of that shape), else a new buffer; ValueError for rows of part blocks."""
    block_size = GGML_QUANT_SIZES[qtype][0]
    columns = values.shape[-1] if values.dim() else 1
    if columns % block_size:
        raise ValueError(f"rows of {columns} values do not hold whole {qtype.name} blocks of {block_size}")
    rows = values.reshape(-1, columns)
    shape = (rows.shape[0], row_bytes(qtype, columns))
    return rows, (quantized_buffer(qtype, *rows.shape) if out is None
                  else output(out, shape, torch.uint8, torch.device("cpu")))


def quantized_nbytes(qtype, shape) -> int:
    return row_bytes(qtype, shape[-1]) * math.prod(shape[:-1])
