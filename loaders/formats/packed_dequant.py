"""The exact dequantization of the packed weight formats (packing.FORMATS: what a stored tensor is, told from headers
without torch, each row with its dequantizer here), one function a format, and the state-dict entries of GGUF
tensors.

The loaders keep packed weights as stored, each with its companions under the host's suffixes, and the host's layers
(host/ops.py) call `dequantize` per layer at run time, so a fp8 model costs fp8 memory. Each format does ComfyUI
0.33's float32 operations (comfy-kitchen's reference functions, comfy/quant_ops.py's layouts) in the same order,
chunk by chunk into the output. On the CPU, fp8 and NVFP4 run one-pass kernels (kernel code, compiled by kernels.py)
where numba runs, with the same bits.
"""

from __future__ import annotations

import functools
import sys

import numpy as np
import torch

from ...errors import CorruptFileError, UnsupportedFormatError
from . import kernels
from .gguf_row import jit, nibble_book, nibble_pairs, put
from .gguf_types import dequantize as dequantize_gguf
from .gguf_types import type_of
from .packing import CONVROT_GROUP, FORMATS, GGUF, GGUF_TYPE, PackedFormat, stored_format
from .safetensors_file import SAFETENSORS_DTYPES

NVFP4_BLOCK = 16
MXFP8_BLOCK = 32

# The 16 E2M1 code points, indexed by the 4-bit code (sign in bit 3).
_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
# ConvRot's regular 4x4 Hadamard matrix; the size-n one is its Kronecker power, divided by sqrt(n).
_HADAMARD_4 = ((1, 1, 1, -1), (1, 1, -1, 1), (1, -1, 1, 1), (-1, 1, 1, 1))


def split_entries(entries: dict[str, torch.Tensor], key: str) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """A weight's entries as the readers return them -> the weight, and its companions by suffix."""
    return entries[key], {k.rpartition(".")[2]: v for k, v in entries.items() if k != key}


def format_of(weight_dtype: torch.dtype, companions) -> PackedFormat | None:
    """The format of a stored weight from its torch dtype and the companions beside it (what the loader kept)."""
    return stored_format(SAFETENSORS_DTYPES.get(str(weight_dtype)), companions)


def from_gguf(key: str, tensor) -> dict[str, torch.Tensor]:
    """State-dict entries for the GGUF tensor (gguf_file.GGUFTensor) stored under `key`: float types as
    float tensors, a quantized weight kept packed (rows of whole blocks, a view of the mapped file) with its
    type beside it, and any other quantized tensor (1-D ones, rare) dequantized, as no layer reads those
    packed."""
    row = type_of(tensor.qtype)
    if row.float_dtype:
        return {key: tensor.data.view(getattr(torch, row.float_dtype)).reshape(tensor.shape)}
    if len(tensor.shape) < 2 or not key.endswith(".weight"):
        return {key: dequantize_gguf(tensor.data, row, tensor.shape, torch.float32)}
    return {key: tensor.data.view(*tensor.shape[:-1], -1),
            key[: -len("weight")] + GGUF_TYPE: torch.tensor(int(tensor.qtype))}


# --- the host's calls -------------------------------------------------------------------------------------


def stored_shape(shape, weight_dtype: torch.dtype, companions) -> tuple[int, ...]:
    """The shape a weight of logical `shape` is stored in, given its dtype and companions: GGUF rows of
    whole blocks, 4-bit formats two values a byte, the others and plain weights one value an element."""
    shape = tuple(int(s) for s in shape)
    found = format_of(weight_dtype, companions)
    return found.stored_shape(shape, companions) if found else shape


def dequantize(
    weight: torch.Tensor, companions: dict[str, torch.Tensor], dtype: torch.dtype, shape,
    out: torch.Tensor | None = None
) -> torch.Tensor:
    """A weight of logical `shape` as `dtype`, whatever its stored format; `companions` holds the tensors stored
    beside it by suffix (weight_scale, weight_scale_2, weight_packing, weight_gguf_type ...). The values go into
    `out` where given (a contiguous tensor of that shape, dtype and device) instead of a new tensor."""
    found = format_of(weight.dtype, companions)
    if found is not None:
        if found is not GGUF and SAFETENSORS_DTYPES.get(str(weight.dtype)) not in found.dtypes:
            raise UnsupportedFormatError(
                f"A {found.label} weight {list(weight.shape)} came as {weight.dtype}; {found.label} weights are stored "
                f"as {', '.join(found.dtypes)}. Load the model again."
            )
        return found.dequantize(sys.modules[__name__], weight, companions, dtype, tuple(shape), out=out)
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
    out = kernels.output(out, weight.shape, dtype, weight.device)
    kernel = kernels.kernel(_fp8_rows, "fp8", weight.device, dtype)
    if kernel is not None:
        c, s, o = codes.contiguous().numpy(), scale.reshape(-1).contiguous().numpy(), kernels.array(out, codes.shape[1])
        book = _fp8_book(weight.dtype, weight.device).numpy()
        if kernels.run("fp8", c.shape[0], lambda first, stop: kernel(c[first:stop], s if s.shape[0] == 1 else
                                                                    s[first:stop], o[first:stop], book)):
            return out
    per_row = scale.shape[0] > 1
    book = _fp8_book(weight.dtype, weight.device)

    def fill(rows: slice, v: torch.Tensor) -> None:
        torch.index_select(book, 0, codes[rows].reshape(-1).int(), out=v.view(-1))
        v.mul_(scale[rows] if per_row else scale)

    with kernels.few_threads(weight.device):
        kernels.fill_by_rows(out.view(codes.shape), fill)
    return out


@jit(nogil=True)
def _fp8_rows(codes, scales, out, book):
    """out[r, c] = book[codes[r, c]] * scales[r] (scales of length 1: one for every row); book: fp8 byte -> float32.
    A row's 256 possible values are made once in out's type, then each value is one lookup."""
    per_row = scales.shape[0] > 1
    table = np.empty(256, out.dtype)
    for r in range(codes.shape[0]):
        if r == 0 or per_row:
            s = scales[r if per_row else 0]
            for b in range(256):
                put(table, b, book[b] * s)
        c, o = codes[r], out[r]
        for k in range(c.shape[0]):
            o[k] = table[c[k]]


def dequantize_nvfp4_layer(weight: torch.Tensor, companions: dict, dtype: torch.dtype, *,
                           out: torch.Tensor | None = None) -> torch.Tensor:
    """An NVFP4 weight from its companions: times the pre_quant_scale by which the host multiplies the layer's input,
    where it has one (the same product, on the weight's columns, in float32)."""
    pre_quant_scale = companions.get("pre_quant_scale")
    if pre_quant_scale is None:
        return dequantize_nvfp4(weight, companions["weight_scale"], companions["weight_scale_2"], dtype, out=out)
    values = dequantize_nvfp4(weight, companions["weight_scale"], companions["weight_scale_2"], torch.float32)
    if pre_quant_scale.numel() != values.shape[1]:
        raise CorruptFileError(
            f"An NVFP4 weight of {values.shape[1]} inputs has a pre_quant_scale of {pre_quant_scale.numel()} values; "
            "it needs one per input. The file is damaged; download it again."
        )
    values.mul_(pre_quant_scale.to(device=weight.device, dtype=torch.float32).reshape(1, -1))
    return values.to(dtype) if out is None else out.copy_(values)


def unswizzle_block_scales(scales: torch.Tensor, rows: int, blocks: int) -> torch.Tensor:
    """Undo the 128x4 tiling: within a tile, row r and column c sit at (r % 32) * 16 + (r // 32) * 4 + c."""
    row_tiles, col_tiles = -(-rows // 128), -(-blocks // 4)
    tiles = scales.reshape(row_tiles, col_tiles, 32, 4, 4)  # [row tile, col tile, r % 32, r // 32, c]
    plain = tiles.permute(0, 3, 2, 1, 4).reshape(row_tiles * 128, col_tiles * 4)
    return plain[:rows, :blocks]


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
    out = kernels.output(out, (rows, cols), dtype, packed.device)
    tensor_scale = tensor_scale.to(device=packed.device, dtype=torch.float32)
    block_scales = _as_bytes_of(block_scales, torch.float8_e4m3fn, "NVFP4 block scales")
    kernel = kernels.kernel(_nvfp4_rows, "NVFP4", packed.device, dtype)
    if kernel is not None:
        tiled, scale = block_scales.contiguous().view(torch.uint8).reshape(-1).numpy(), tensor_scale.reshape(1).numpy()
        book, values = _fp8_book(block_scales.dtype, packed.device).numpy(), np.array(_E2M1, np.float32)
        p, o = packed.contiguous().numpy(), kernels.array(out, cols)
        if kernels.run("NVFP4", rows, lambda first, stop: kernel(p[first:stop], tiled, scale, o[first:stop], book,
                                                                 values, first)):
            return out
    scales = unswizzle_block_scales(block_scales, rows, cols // NVFP4_BLOCK)
    pairs = nibble_book(_E2M1, packed.device, high_first=True)  # the even element in the high nibble

    def fill(chunk: slice, v: torch.Tensor) -> None:
        torch.index_select(pairs, 0, packed[chunk].reshape(-1).int(), out=v.view(torch.float64).view(-1))
        block = scales[chunk].to(torch.float32) * tensor_scale
        v.view(v.shape[0], -1, NVFP4_BLOCK).mul_(block.unsqueeze(-1))

    with kernels.few_threads(packed.device):
        kernels.fill_by_rows(out, fill)
    return out


@jit(nogil=True)
def _nvfp4_rows(packed, tiled, tensor_scale, out, book, e2m1, first_row):
    """E2M1 value * (book[block scale] * tensor_scale[0]), the even element in the high nibble; the block scales in
    cuBLAS' 128x4 tiling (tiled: its bytes, [roundup(rows, 128) * roundup(blocks, 4)]), where row r and block c sit in
    tile (r // 128, c // 4) at (r % 32) * 16 + (r // 32 % 4) * 4 + c % 4. packed and out are the weight's rows from
    first_row on. The 16 values of each of the 256 block scales are made once in out's type: a lookup per value."""
    ts = tensor_scale[0]
    table = np.empty(256 * 16, out.dtype)
    for b in range(256):
        s = book[b] * ts
        for q in range(16):
            put(table, b * 16 + q, e2m1[q] * s)
    col_tiles = (packed.shape[1] // 8 + 3) // 4
    for i in range(packed.shape[0]):
        p, o, r = packed[i], out[i], first_row + i
        row_at = (r >> 7) * col_tiles * 512 + (r & 31) * 16 + ((r >> 5) & 3) * 4
        for c in range(packed.shape[1] // 8):
            at = np.int32(tiled[row_at + (c >> 2) * 512 + (c & 3)]) * 16
            for k in range(8):
                q = np.int32(p[c * 8 + k])
                o[c * 16 + 2 * k] = table[at + (q >> 4)]
                o[c * 16 + 2 * k + 1] = table[at + (q & 15)]


def _as_bytes_of(scales: torch.Tensor, dtype: torch.dtype, what: str) -> torch.Tensor:
    """One-byte scales as `dtype`: files store them so or as uint8 (ComfyUI views either as `dtype`)."""
    if scales.dtype == dtype:
        return scales
    if scales.dtype not in (torch.uint8, torch.float8_e4m3fn, torch.float8_e8m0fnu):
        raise CorruptFileError(f"The {what} are stored as {scales.dtype}; they are one byte each ({dtype} or uint8). "
                               "The file is damaged; download it again.")
    return scales.view(dtype)


def _scale_of_rows(scale: torch.Tensor, rows: int, device: torch.device, what: str,
                   shapes: tuple[tuple[int, ...], ...]) -> torch.Tensor:
    """A float32 scale [n, 1] for broadcasting over `rows` rows (n is 1 or `rows`), stored in one of `shapes`."""
    if tuple(scale.shape) not in shapes:
        expected = " or ".join(str(list(s)) for s in shapes)
        raise CorruptFileError(f"A {what} of {rows} rows has a scale of shape {list(scale.shape)}; it needs "
                               f"{expected}. The file is damaged; download it again.")
    return scale.to(device=device, dtype=torch.float32).reshape(-1, 1)


@functools.cache
def _hadamard(size: int, device: torch.device) -> torch.Tensor:
    """ConvRot's normalized regular Hadamard matrix of `size` (a power of 4), float32: its entries are +-2^-k,
    exact."""
    h4 = torch.tensor(_HADAMARD_4, dtype=torch.float32, device="cpu")
    h = h4
    while h.shape[0] < size:
        h = torch.kron(h, h4)
    return (h / size**0.5).to(device)


def _check_group(inputs: int, group: int, what: str) -> None:
    if not CONVROT_GROUP.valid(group) or inputs % group:
        raise CorruptFileError(f"A {what} of {inputs} inputs is rotated in groups of {group}; ConvRot groups are "
                               f"{CONVROT_GROUP.expected} that divides the inputs. The file is damaged; download it "
                               "again.")


def _unrotate(v: torch.Tensor, group: int) -> None:
    """Rows v [n, inputs] (float32) back from ConvRot's basis, in place: each group of `group` inputs times the
    transposed Hadamard matrix, as the host's _rotate_weight (the matrix is its own inverse). A matmul, on every
    thread (kernels.py): 2 x group float32 operations a value, most of a ConvRot weight's dequantization on the CPU."""
    h = _hadamard(group, v.device)
    v.copy_(torch.matmul(v.view(v.shape[0], -1, group), h.T).view(v.shape))


def dequantize_int8(
    weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, *, convrot_group: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """float32(int8 weight) * float32(scale), one scale or one per row ([rows, 1]), then back from ConvRot's basis
    where `convrot_group` is given; cast to `dtype` (into `out`)."""
    rows, inputs = weight.shape
    scale = _scale_of_rows(scale, rows, weight.device, "INT8 weight", ((), (1,), (1, 1), (rows, 1)))
    if convrot_group is not None:
        _check_group(inputs, convrot_group, "ConvRot INT8 weight")
    per_row = scale.shape[0] > 1
    out = kernels.output(out, weight.shape, dtype, weight.device)

    def fill(chunk: slice, v: torch.Tensor) -> None:
        with kernels.few_threads(weight.device):
            v.copy_(weight[chunk])
            v.mul_(scale[chunk] if per_row else scale)
        if convrot_group is not None:
            _unrotate(v, convrot_group)

    kernels.fill_by_rows(out, fill)
    return out


@functools.cache
def _e8m0_book(device: torch.device) -> torch.Tensor:
    """E8M0 byte -> its float32 value, 2^(byte - 127), by the host's bit construction (byte 0 is 0, 255 infinite)."""
    powers = (torch.arange(256, dtype=torch.int32, device="cpu") << 23).view(torch.float32)
    powers[0] = 0.0
    return powers.to(device)


def dequantize_mxfp8(
    weight: torch.Tensor, block_scales: torch.Tensor, dtype: torch.dtype, *, out: torch.Tensor | None = None
) -> torch.Tensor:
    """float32(float8_e4m3fn weight) * 2^(block scale - 127), one E8M0 scale per 32 inputs in 128x4 tiles; cast
    to `dtype` (into `out`)."""
    rows, inputs = weight.shape
    tiled = -(-rows // 128) * 128 * -(-inputs // MXFP8_BLOCK // 4) * 4
    if inputs % MXFP8_BLOCK or block_scales.numel() != tiled or weight.dtype != torch.float8_e4m3fn:
        raise CorruptFileError(
            f"An MXFP8 weight [{rows}, {inputs}] ({weight.dtype}) came with {block_scales.numel()} block scales; it "
            f"needs float8_e4m3fn values and {tiled} scales (one per {MXFP8_BLOCK} values, in 128x4 tiles). The file "
            "is damaged; download it again."
        )
    scales = _as_bytes_of(block_scales, torch.uint8, "MXFP8 block scales")
    plain = unswizzle_block_scales(scales, rows, inputs // MXFP8_BLOCK)
    codes, book, powers = weight.view(torch.uint8), _fp8_book(weight.dtype, weight.device), _e8m0_book(weight.device)
    out = kernels.output(out, weight.shape, dtype, weight.device)

    def fill(chunk: slice, v: torch.Tensor) -> None:
        torch.index_select(book, 0, codes[chunk].reshape(-1).int(), out=v.view(-1))
        v.view(v.shape[0], -1, MXFP8_BLOCK).mul_(powers[plain[chunk].int()].unsqueeze(-1))

    with kernels.few_threads(weight.device):
        kernels.fill_by_rows(out, fill)
    return out


_SIGNED_NIBBLES = tuple(float(n - 16 if n >= 8 else n) for n in range(16))  # two's complement 4-bit values
_W4A8_CODES = tuple(float(n - 8) for n in range(16))  # W4A8's codes without a codebook


def _nibbles(packed: torch.Tensor, pairs: torch.Tensor, chunk: slice, v: torch.Tensor) -> None:
    """The values of rows `chunk` of 4-bit codes (int8 [rows, inputs/2]) into v [n, inputs] through `pairs`."""
    torch.index_select(pairs, 0, packed[chunk].view(torch.uint8).reshape(-1).int(),
                       out=v.view(torch.float64).view(-1))


def dequantize_convrot_w4a4(
    packed: torch.Tensor, scale: torch.Tensor, convrot_group: int, dtype: torch.dtype, *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Signed 4-bit values (int8 [rows, inputs/2], the even element in the low nibble) * float32(row scale), back
    from ConvRot's basis; cast to `dtype` (into `out`)."""
    rows, half = packed.shape
    inputs = half * 2
    scale = _scale_of_rows(scale, rows, packed.device, "ConvRot W4A4 weight", ((rows,), (rows, 1)))
    _check_group(inputs, convrot_group, "ConvRot W4A4 weight")
    pairs = nibble_book(_SIGNED_NIBBLES, packed.device)
    out = kernels.output(out, (rows, inputs), dtype, packed.device)

    def fill(chunk: slice, v: torch.Tensor) -> None:
        with kernels.few_threads(packed.device):
            _nibbles(packed, pairs, chunk, v)
            v.mul_(scale[chunk])
        _unrotate(v, convrot_group)

    kernels.fill_by_rows(out, fill)
    return out


def dequantize_w4a8(
    packed: torch.Tensor, s_rel: torch.Tensor, s_channel: torch.Tensor, codebook: torch.Tensor | None,
    group: int, convrot_group: int, dtype: torch.dtype, *, out: torch.Tensor | None = None,
) -> torch.Tensor:
    """W4A8: each unsigned 4-bit code (the even element in the low nibble) through the codebook (or code - 8),
    times its group's float32(s_rel), rounded to an integer in [-127, 127], times float32(s_channel) of its row,
    back from ConvRot's basis; cast to `dtype` (into `out`)."""
    rows, half = packed.shape
    inputs = half * 2
    groups = inputs // group if group else 0
    if (inputs % 16 or not group or inputs % group or tuple(s_rel.shape) != (rows, groups)
            or tuple(s_channel.shape) != (rows,) or (codebook is not None and tuple(codebook.shape) != (16,))):
        raise CorruptFileError(
            f"A W4A8 weight [{rows}, {inputs}] in groups of {group} came with weight_s_rel {list(s_rel.shape)}, "
            f"weight_s_channel {list(s_channel.shape)}"
            + ("" if codebook is None else f" and weight_codebook {list(codebook.shape)}")
            + f"; it needs [{rows}, {groups}], [{rows}] and 16 codebook values, with 16 and the group dividing the "
            "inputs. The file is damaged (or holds 6-bit codes, which ComfyUI 0.33 does not read)."
        )
    _check_group(inputs, convrot_group, "W4A8 weight")
    device = packed.device
    if s_rel.dtype == torch.uint8:
        s_rel = s_rel.view(torch.float8_e4m3fn)
    s_rel = s_rel.to(device=device, dtype=torch.float32)
    s_channel = s_channel.to(device=device, dtype=torch.float32).reshape(-1, 1)
    if codebook is None:
        pairs = nibble_book(_W4A8_CODES, device)
    else:  # made for this weight's codebook
        pairs = nibble_pairs(codebook.to(device=device, dtype=torch.float32))
    out = kernels.output(out, (rows, inputs), dtype, device)

    def fill(chunk: slice, v: torch.Tensor) -> None:
        with kernels.few_threads(device):
            _nibbles(packed, pairs, chunk, v)
            v.view(v.shape[0], groups, group).mul_(s_rel[chunk].unsqueeze(-1))
            v.round_().clamp_(-127, 127)  # the host's int8 grid
            v.mul_(s_channel[chunk])
        _unrotate(v, convrot_group)

    kernels.fill_by_rows(out, fill)
    return out
