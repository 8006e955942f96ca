"""Exact dequantization of the packed weight formats of encoder and transformer checkpoints.

The loaders keep packed weights as stored, each with its companions (the tensors stored beside it, by
suffix), and the host's layers (host/ops.py) call `dequantize` per layer at run time, so a fp8 model costs
fp8 memory. Formats are told apart by the companions and the stored weight dtype.

- Scaled fp8: float8 weight [out, in] times a float32 scale, per tensor (one value) or per output
  channel ([out] or [out, 1]).
- GGUF: uint8 rows of the file's raw blocks along the last dimension, with the GGMLQuantizationType
  number as weight_gguf_type (loaders/gguf_dequant.py).
- NVFP4 ("fp4_mixed", ComfyUI/comfy-kitchen packing): uint8 weight [out, in/2], two E2M1 codes per byte,
  the even-indexed element in the high nibble; float8_e4m3fn block scales, one per 16 inputs, stored in
  cuBLAS' 128x4 tiled layout padded to [roundup(out,128), roundup(in/16,4)]; a float32 per-tensor scale.
"""

from __future__ import annotations

import torch

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
COMPANIONS = ("weight_scale", "weight_scale_2", "weight_gguf_type")  # stored beside a packed weight
GGUF_TYPE = "weight_gguf_type"
NVFP4_BLOCK = 16

# The 16 E2M1 code points, indexed by the 4-bit code (sign in bit 3).
_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def is_companion(key: str) -> bool:
    """Whether a state-dict key names a companion of a packed weight rather than a weight."""
    return key.rpartition(".")[2] in COMPANIONS


def from_gguf(key: str, tensor) -> dict[str, torch.Tensor]:
    """State-dict entries for the GGUF tensor (gguf_file.GGUFTensor) stored under `key`: float types as
    float tensors, a quantized weight kept packed (rows of whole blocks, a view of the mapped file) with its
    type beside it, and any other quantized tensor (1-D ones, rare) dequantized, as no layer reads those
    packed."""
    from .gguf_dequant import FLOAT_TYPES, dequantize as gguf_dequantize

    if tensor.qtype in FLOAT_TYPES:
        return {key: tensor.data.view(FLOAT_TYPES[tensor.qtype]).reshape(tensor.shape)}
    if len(tensor.shape) < 2 or not key.endswith(".weight"):
        return {key: gguf_dequantize(tensor.data, tensor.qtype, tensor.shape, torch.float32)}
    return {key: tensor.data.view(*tensor.shape[:-1], -1), key[: -len("weight")] + GGUF_TYPE: torch.tensor(int(tensor.qtype))}


def stored_shape(shape, weight_dtype: torch.dtype, companions) -> tuple[int, ...]:
    """The shape a weight of logical `shape` is stored in: GGUF rows of whole blocks, NVFP4 two values a
    byte, fp8 one value an element."""
    shape = tuple(int(s) for s in shape)
    if GGUF_TYPE in companions:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        block_size, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(int(companions[GGUF_TYPE]))]
        return (*shape[:-1], shape[-1] // block_size * type_size)
    if weight_dtype == torch.uint8:
        return (*shape[:-1], shape[-1] // 2)
    return shape


def weight_format(weight: torch.Tensor) -> str:
    """The format name of a stored linear weight, as reported to the user."""
    if weight.dtype in FP8_DTYPES:
        return "fp8-scaled"
    if weight.dtype == torch.uint8:
        return "nvfp4"
    return {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}.get(weight.dtype, str(weight.dtype))


def dequantize_fp8(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    scale = scale.to(device=weight.device, dtype=torch.float32)
    if scale.numel() > 1:
        scale = scale.reshape(-1, 1)
    return (weight.to(torch.float32) * scale).to(dtype)


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


def dequantize_nvfp4(
    packed: torch.Tensor, block_scales: torch.Tensor, tensor_scale: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    rows, half = packed.shape
    cols = half * 2
    codes = torch.stack((packed >> 4, packed & 0x0F), dim=-1).reshape(rows, cols).long()
    values = torch.tensor(_E2M1, dtype=torch.float32, device=packed.device)[codes]
    scales = unswizzle_block_scales(block_scales, rows, cols // NVFP4_BLOCK).to(torch.float32)
    scales = scales * tensor_scale.to(device=packed.device, dtype=torch.float32)
    values = values.reshape(rows, cols // NVFP4_BLOCK, NVFP4_BLOCK) * scales.unsqueeze(-1)
    return values.reshape(rows, cols).to(dtype)


def dequantize(weight: torch.Tensor, companions: dict[str, torch.Tensor], dtype: torch.dtype, shape) -> torch.Tensor:
    """A weight of logical `shape` as `dtype`, whatever its stored format; `companions` holds the tensors
    stored beside it by suffix (weight_scale, weight_scale_2, weight_gguf_type). Packed GGUF rows (uint8
    with a weight_gguf_type) go to the GGUF dequantizer."""
    if GGUF_TYPE in companions:
        from .gguf_dequant import dequantize as gguf_dequantize

        return gguf_dequantize(weight, int(companions[GGUF_TYPE]), shape, dtype)
    if weight.dtype in FP8_DTYPES:
        return dequantize_fp8(weight, companions["weight_scale"], dtype)
    if weight.dtype == torch.uint8:
        return dequantize_nvfp4(weight, companions["weight_scale"], companions["weight_scale_2"], dtype)
    return weight.to(dtype)
