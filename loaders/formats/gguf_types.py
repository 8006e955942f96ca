"""The GGUF types the pack reads and writes: the families' rows in one table, in the order the docs and the errors
list them, the lists of types derived from it, and the dispatch of a tensor to its row's functions: the compiled
kernel on the CPU where it runs (kernels.py), else the row's reference path, with the same bits (gguf-py's numpy
dequantizer, with a warning, for a type gguf knows and no row reads)."""

from __future__ import annotations

import logging
import math

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q

from ...errors import CorruptFileError, UnsupportedFormatError
from . import gguf_float, gguf_k, gguf_legacy, kernels
from .gguf_row import GGUFType, NotQuantizable, Scratch, check_peak, nibble_book

log = logging.getLogger(__name__)

TYPES = (*gguf_float.ROWS, *gguf_legacy.ROWS, *gguf_k.ROWS)
BY_TYPE = {row.qtype: row for row in TYPES}
READ_TYPES = tuple(BY_TYPE)
FLOAT_TYPES = tuple(row.qtype for row in TYPES if row.float_dtype)
QUANTIZED_TYPES = tuple(row.qtype for row in TYPES if not row.float_dtype)
WRITE_TYPES = tuple(row.qtype for row in TYPES if row.writer)
LEGACY_TYPES = tuple(row.qtype for row in TYPES if row.writer == "gguf-py")  # written as gguf-py writes them
K_TYPES = tuple(row.qtype for row in TYPES if row.writer == "ggml")  # written as ggml's reference quantizers do


def type_of(qtype) -> GGUFType:
    """The row of a GGUF type (a row, its GGMLQuantizationType or its number), one without functions if the pack has
    none."""
    if isinstance(qtype, GGUFType):
        return qtype
    qtype = Q(qtype)
    return BY_TYPE.get(qtype) or GGUFType(qtype, *GGML_QUANT_SIZES[qtype])


def read_types() -> str:
    """The GGUF types the pack dequantizes itself, as the errors list them."""
    return ", ".join(q.name for q in READ_TYPES)


# --- reading --------------------------------------------------------------------------------------------------


def dequantize(data: torch.Tensor, qtype, shape, dtype: torch.dtype = torch.float16, *,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """Values of a GGUF tensor from its raw bytes (uint8, on CPU or GPU), shaped `shape` (torch order), bit-exact with
    gguf-py's numpy dequantizer in float32 before the cast to `dtype`; into `out` where given."""
    row = type_of(qtype)
    shape = tuple(int(s) for s in shape)
    n_values = math.prod(shape)
    data = data.reshape(-1)
    if n_values % row.block_values or data.numel() != n_values // row.block_values * row.block_bytes:
        raise CorruptFileError(
            f"{data.numel()} bytes of {row.name} data cannot hold a tensor of shape {list(shape)} "
            f"(blocks of {row.block_values} values in {row.block_bytes} bytes)."
        )
    out = kernels.output(out, shape, dtype, data.device)
    if data.storage_offset() % 8:
        data = data.clone()  # fields are read as fp16 and int64 views, which need aligned memory
    if row.float_dtype:
        return out.copy_(data.view(getattr(torch, row.float_dtype)).view(shape))
    if row.read is None:
        return out.copy_(_numpy_values(data, row, shape))
    blocks = data.view(-1, row.block_bytes)
    if kernels.dequantize(row, blocks, out):
        return out
    scales, codes, apply, book = row.read
    book = None if book is None else nibble_book(book, data.device)

    def fill(rows: slice, v: torch.Tensor) -> None:
        chunk = codes(blocks[rows])
        if book is None:
            v.copy_(chunk)
        else:
            torch.index_select(book, 0, chunk.view(-1), out=v.view(torch.float64).view(-1))
        apply(v, *(s[rows] for s in per_block))

    with kernels.few_threads(data.device):
        per_block = scales(blocks)
        kernels.fill_by_rows(out.view(-1, row.block_values), fill)
    return out


_warned: set[Q] = set()


def _numpy_values(data: torch.Tensor, row: GGUFType, shape: tuple[int, ...]) -> torch.Tensor:
    from gguf.quants import dequantize as reference

    raw = data.cpu().numpy().reshape(-1, row.block_bytes)
    try:
        values = reference(raw, row.qtype)
    except NotImplementedError:
        raise UnsupportedFormatError(
            f"GGUF tensors of type {row.name} cannot be dequantized (neither the pack nor the gguf library reads "
            f"them). Use a file quantized with a type the pack reads: {read_types()}."
        ) from None
    if row.qtype not in _warned:
        _warned.add(row.qtype)
        log.warning("GGUF %s tensors are dequantized by gguf's numpy code on the CPU (slow).", row.name)
    return torch.from_numpy(values).reshape(shape).to(data.device)


# --- writing --------------------------------------------------------------------------------------------------


def quantized_buffer(qtype, rows: int, columns: int) -> torch.Tensor:
    """Room for `rows` rows of `columns` values in `qtype`: uint8 [rows, row bytes], uninitialized, allocated by numpy
    (which asks Linux for huge pages on large arrays where torch does not)."""
    return torch.from_numpy(np.empty((rows, type_of(qtype).row_bytes(columns)), np.uint8))


# The plain Python kernels' pace (a K block measured), and the most time they may be given for one conversion or tensor
PLAIN_SECONDS_PER_BLOCK = 0.035
PLAIN_SECONDS = 60
# Longer times as a person reads them: (seconds in the unit, its name), the largest first
_UNITS = ((86400, "days"), (3600, "hours"), (60, "minutes"), (1, "seconds"))


def check_pace(tensors) -> None:
    """Refuses, before anything is quantized, (GGUF type, shape) pairs that the plain Python kernels would take more
    than PLAIN_SECONDS on."""
    rows = [(type_of(qtype), math.prod(shape)) for qtype, shape in tensors]
    blocks = sum(values // row.block_values for row, values in rows
                 if row.writer and kernels.write_path(row) == "python")
    seconds = blocks * PLAIN_SECONDS_PER_BLOCK
    if seconds <= PLAIN_SECONDS:
        return
    unit, name = next((unit, name) for unit, name in _UNITS if seconds >= unit)
    why = "numba cannot be imported" if kernels.numba_ops() is None else "numba failed to compile them"
    raise UnsupportedFormatError(
        f"The compiled quantizers cannot run here ({why}; the log says why), and their plain Python stand-ins would "
        f"take about {seconds / unit:.0f} {name} for these {blocks} blocks. Install numba into the Python that runs "
        "the pack (pip install numba) and run it again.")


def check_scales(qtype, blocks: np.ndarray) -> None:
    """Refuses blocks (uint8 [n, block bytes]) whose fp16 scale fields are infinite or NaN (exponent bits all set)."""
    row = type_of(qtype)
    for at in row.scale_fields:
        if ((blocks[:, at + 1] & 0x7C) == 0x7C).any():
            raise NotQuantizable(f"its {row.name} scales are beyond float16's range (values too large)")


def _refuse(values: torch.Tensor, row: GGUFType, out: torch.Tensor):
    """Says why a kernel did not write `values`: a value, or a scale it wrote, the type cannot hold."""
    check_peak(max(values.amax().item(), -values.amin().item()), row.limited)
    check_scales(row, out.numpy().reshape(-1, row.block_bytes))
    raise NotQuantizable(f"its values cannot be written as {row.name}")


def quantize(values: torch.Tensor, qtype, *, out: torch.Tensor | None = None,
             threads: int | None = None) -> torch.Tensor:
    """The GGUF bytes of `values` (a float tensor on the CPU, last dimension the rows) in `qtype`: uint8 [rows, row
    bytes], into `out` where given. Raises NotQuantizable for values the type cannot hold, ValueError for rows of
    part blocks or a wrong `out`, UnsupportedFormatError for a type the pack does not write or check_pace's refusal."""
    row = type_of(qtype)
    if not row.writer:
        raise UnsupportedFormatError(
            f"The pack writes GGUF types {', '.join(q.name for q in WRITE_TYPES)}, not {row.name}.")
    columns = values.shape[-1] if values.dim() else 1
    if columns % row.block_values:
        raise ValueError(f"rows of {columns} values do not hold whole {row.name} blocks of {row.block_values}")
    rows = values.reshape(-1, columns)
    shape = (rows.shape[0], row.row_bytes(columns))
    out = quantized_buffer(row, *rows.shape) if out is None else \
        kernels.output(out, shape, torch.uint8, torch.device("cpu"))
    ran = kernels.quantize(row, rows, out, threads)
    if ran is False:
        _refuse(rows, row, out)
    if ran:
        return out
    if row.write_torch is None:
        check_pace([(row, rows.shape)])
    parts = kernels.chunks(rows.shape[0], columns)
    scratch = Scratch(parts[0].stop * columns if parts else 0, row.block_values)
    with kernels.few_threads(torch.device("cpu")), np.errstate(all="ignore"):
        for part in parts:
            chunk = rows[part]
            if chunk.dtype != torch.float32 or not chunk.is_contiguous():
                chunk = scratch.x[: chunk.numel()].view(chunk.shape).copy_(chunk)
            blocks, target = chunk.view(-1, row.block_values), out[part].view(-1, row.block_bytes)
            if row.write_torch is not None:
                torch.cat(row.write_torch(blocks, scratch), dim=1, out=target)
            elif not row.write_kernel(blocks.numpy(), target.numpy()):  # the plain Python kernel: C's float32 overflows
                _refuse(chunk, row, target)
    return out
