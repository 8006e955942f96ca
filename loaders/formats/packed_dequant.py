"""The exact dequantization of the packed weight formats (packing.FORMATS: what a stored tensor is, told from
headers without torch), one function a format, and the state-dict entries of GGUF tensors.

The loaders keep packed weights as stored, each with its companions under the host's suffixes, and the
host's layers (host/ops.py) call `dequantize` per layer at run time, so a fp8 model costs fp8 memory. On the
CPU, fp8 and NVFP4 go through the one-pass kernels (compiled.py) where numba runs, with the same bits.
"""

from __future__ import annotations

import functools

import torch

from ...errors import CorruptFileError, UnsupportedFormatError
from . import compiled
from .packing import FORMATS, FP8_SCALED, GGUF, GGUF_TYPE, NVFP4, Shape, stored_format
from .safetensors_file import SAFETENSORS_DTYPES, torch_dtype
from .steps import few_threads, fill_by_rows, output

FP8_DTYPES = tuple(torch_dtype(d) for d in FP8_SCALED.dtypes)
NVFP4_BLOCK = 16

# The 16 E2M1 code points, indexed by the 4-bit code (sign in bit 3).
_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def _gguf_dequantize(weight: torch.Tensor, companions: dict, dtype: torch.dtype, shape: Shape,
                     out=None) -> torch.Tensor:
    from .gguf_dequant import dequantize as gguf_dequantize

    return gguf_dequantize(weight, int(companions[GGUF_TYPE]), shape, dtype, out=out)


def _fp8_dequantize(weight: torch.Tensor, companions: dict, dtype: torch.dtype, shape: Shape, out=None) -> torch.Tensor:
    return dequantize_fp8(weight, companions["weight_scale"], dtype, out=out)


def _nvfp4_dequantize(weight: torch.Tensor, companions: dict, dtype: torch.dtype, shape: Shape,
                      out=None) -> torch.Tensor:
    return dequantize_nvfp4(weight, companions["weight_scale"], companions["weight_scale_2"], dtype, out=out)


# format label -> (weight, companions, dtype, shape, out=None) -> values
DEQUANTIZE = {FP8_SCALED.label: _fp8_dequantize, NVFP4.label: _nvfp4_dequantize, GGUF.label: _gguf_dequantize}


def split_entries(entries: dict[str, torch.Tensor], key: str) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """A weight's entries as the readers return them -> the weight, and its companions by suffix."""
    return entries[key], {k.rpartition(".")[2]: v for k, v in entries.items() if k != key}


def _stored_format(weight_dtype: torch.dtype, companions):
    """The format of a stored weight from its torch dtype and the companions beside it (what the loader kept)."""
    return stored_format(SAFETENSORS_DTYPES.get(str(weight_dtype)), companions)


def from_gguf(key: str, tensor) -> dict[str, torch.Tensor]:
    """State-dict entries for the GGUF tensor (gguf_file.GGUFTensor) stored under `key`: float types as
    float tensors, a quantized weight kept packed (rows of whole blocks, a view of the mapped file) with its
    type beside it, and any other quantized tensor (1-D ones, rare) dequantized, as no layer reads those
    packed."""
    from .gguf_dequant import FLOAT_TYPES
    from .gguf_dequant import dequantize as gguf_dequantize

    if tensor.qtype in FLOAT_TYPES:
        return {key: tensor.data.view(FLOAT_TYPES[tensor.qtype]).reshape(tensor.shape)}
    if len(tensor.shape) < 2 or not key.endswith(".weight"):
        return {key: gguf_dequantize(tensor.data, tensor.qtype, tensor.shape, torch.float32)}
    return {key: tensor.data.view(*tensor.shape[:-1], -1),
            key[: -len("weight")] + GGUF_TYPE: torch.tensor(int(tensor.qtype))}


# --- the host's calls -------------------------------------------------------------------------------------


def stored_shape(shape, weight_dtype: torch.dtype, companions) -> tuple[int, ...]:
    """The shape a weight of logical `shape` is stored in, given its dtype and companions: GGUF rows of
    whole blocks, NVFP4 two values a byte, fp8 and plain weights one value an element."""
    shape = tuple(int(s) for s in shape)
    found = _stored_format(weight_dtype, companions)
    return found.stored_shape(shape, companions) if found else shape


def dequantize(
    weight: torch.Tensor, companions: dict[str, torch.Tensor], dtype: torch.dtype, shape,
    out: torch.Tensor | None = None
) -> torch.Tensor:
    """A weight of logical `shape` as `dtype`, whatever its stored format; `companions` holds the tensors
    stored beside it by suffix (weight_scale, weight_scale_2, weight_gguf_type). The values go into `out` where
    given (a contiguous tensor of that shape, dtype and device) instead of a new tensor."""
    found = _stored_format(weight.dtype, companions)
    if found is not None:
        return DEQUANTIZE[found.label](weight, companions, dtype, tuple(shape), out=out)
    if any(SAFETENSORS_DTYPES.get(str(weight.dtype)) in f.dtypes for f in FORMATS):
        raise UnsupportedFormatError(
            f"A {weight.dtype} weight {list(weight.shape)} came without the companions its packing needs "
            f"(given: {', '.join(companions) or 'none'}); it cannot be dequantized. Load the model again."
        )
    return weight.to(dtype) if out is None else out.copy_(weight.reshape(out.shape))


@functools.cache
def _fp8_book(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """fp8 byte -> its float32 value: one gather, several times faster on the CPU than torch's fp8 cast. Made on
    the CPU once per device, then moved."""
    return torch.arange(256, dtype=torch.uint8, device="cpu").view(dtype).to(torch.float32).to(device)


def dequantize_fp8(
    weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, *, out: torch.Tensor | None = None
) -> torch.Tensor:
    """float32(weight) * float32(scale), per tensor or per output channel, cast to `dtype` (into `out`)."""
    codes = weight.view(torch.uint8).reshape(weight.shape[0], -1)
    scale = scale.to(device=weight.device, dtype=torch.float32).reshape(-1, 1)
    if scale.shape[0] not in (1, codes.shape[0]):
        raise CorruptFileError(
            f"A fp8 weight of {codes.shape[0]} rows has {scale.shape[0]} scales; it needs one, or one per row. "
            "The file is damaged; download it again."
        )
    out = output(out, weight.shape, dtype, weight.device)
    if compiled.fp8(codes, weight.dtype, scale, out):
        return out
    per_row = scale.shape[0] > 1
    book = _fp8_book(weight.dtype, weight.device)

    def fill(rows: slice, v: torch.Tensor) -> None:
        torch.index_select(book, 0, codes[rows].reshape(-1).int(), out=v.view(-1))
        v.mul_(scale[rows] if per_row else scale)

    with few_threads(weight.device):
        fill_by_rows(out.view(codes.shape), fill)
    return out


def unswizzle_block_scales(scales: torch.Tensor, rows: int, blocks: int) -> torch.Tensor:
    """Undo the 128x4 tiling: within a tile, row r and column c sit at (r % 32) * 16 + (r // 32) * 4 + c."""
    row_tiles, col_tiles = -(-rows // 128), -(-blocks // 4)
    tiles = scales.reshape(row_tiles, col_tiles, 32, 4, 4)  # [row tile, col tile, r % 32, r // 32, c]
    plain = tiles.permute(0, 3, 2, 1, 4).reshape(row_tiles * 128, col_tiles * 4)
    return plain[:rows, :blocks]


def swizzle_block_scales(plain: torch.Tensor) -> torch.Tensor:
    """The inverse of unswizzle_block_scales (pads with zeros); used to write test checkpoints."""
    rows, blocks = plain.shape
    row_tiles, col_tiles = -(-rows // 128), -(-blocks // 4)
    padded = torch.zeros(row_tiles * 128, col_tiles * 4, dtype=plain.dtype)
    padded[:rows, :blocks] = plain
    tiles = padded.reshape(row_tiles, 4, 32, col_tiles, 4).permute(0, 3, 2, 1, 4)
    return tiles.reshape(row_tiles * 128, col_tiles * 4)


@functools.cache
def _e2m1_pairs(device: torch.device) -> torch.Tensor:
    """byte -> the float32 values of its two E2M1 codes (the high nibble's first: the even element) side
    by side in one float64 slot: one gather yields two neighbouring values."""
    book, codes = torch.tensor(_E2M1, dtype=torch.float32, device="cpu"), torch.arange(256, device="cpu")
    return torch.stack((book[codes >> 4], book[codes & 0x0F]), dim=1).view(torch.float64).reshape(256).to(device)


def dequantize_nvfp4(
    packed: torch.Tensor, block_scales: torch.Tensor, tensor_scale: torch.Tensor, dtype: torch.dtype,
    *, out: torch.Tensor | None = None,
) -> torch.Tensor:
    """E2M1 value * (float32(block scale) * float32(tensor scale)), cast to `dtype` (into `out`)."""
    rows, half = packed.shape
    cols = half * 2
    tiled = -(-rows // 128) * 128 * -(-cols // NVFP4_BLOCK // 4) * 4
    if cols % NVFP4_BLOCK or block_scales.numel() != tiled or tensor_scale.numel() != 1:
        raise CorruptFileError(
            f"An NVFP4 weight [{rows}, {cols}] came with {block_scales.numel()} block scales and "
            f"{tensor_scale.numel()} tensor scales; it needs {tiled} (one per {NVFP4_BLOCK} values, in 128x4 tiles) "
            "and one. The file is damaged; download it again."
        )
    out = output(out, (rows, cols), dtype, packed.device)
    tensor_scale = tensor_scale.to(device=packed.device, dtype=torch.float32)
    if compiled.nvfp4(packed, block_scales, tensor_scale, _E2M1, out):
        return out
    scales = unswizzle_block_scales(block_scales, rows, cols // NVFP4_BLOCK)
    pairs = _e2m1_pairs(packed.device)

    def fill(chunk: slice, v: torch.Tensor) -> None:
        torch.index_select(pairs, 0, packed[chunk].reshape(-1).int(), out=v.view(torch.float64).view(-1))
        block = scales[chunk].to(torch.float32) * tensor_scale
        v.view(v.shape[0], -1, NVFP4_BLOCK).mul_(block.unsqueeze(-1))

    with few_threads(packed.device):
        fill_by_rows(out, fill)
    return out
