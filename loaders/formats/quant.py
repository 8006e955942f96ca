"""The packed weight formats of encoder and transformer checkpoints, in one table (FORMATS): how each is
detected, the shape it is stored in, the companions it needs (the tensors stored beside the weight, in every
spelling met in the wild), its exact dequantization and the word the pack reports for it.

The loaders keep packed weights as stored, each with its companions under the host's suffixes, and the
host's layers (host/ops.py) call `dequantize` per layer at run time, so a fp8 model costs fp8 memory. On the
CPU, fp8 and NVFP4 go through the one-pass kernels (fused.py) where numba runs, with the same bits.

- Scaled fp8: float8 weight [out, in] times a float32 scale, per tensor (one value) or per output
  channel ([out] or [out, 1]).
- NVFP4 (ComfyUI/comfy-kitchen packing, declared by its comfy_quant tensor): uint8 weight [out, in/2], two
  E2M1 codes per byte, the even-indexed element in the high nibble; float8_e4m3fn block scales, one per
  16 inputs, stored in cuBLAS' 128x4 tiled layout padded to [roundup(out,128), roundup(in/16,4)]; a
  float32 per-tensor scale.
- GGUF: uint8 rows of the file's raw blocks along the last dimension, with the GGMLQuantizationType
  number as weight_gguf_type (loaders/gguf_dequant.py).

A safetensors weight's format is the one its `<layer>.comfy_quant` tensor declares (ComfyUI's JSON
{"format": ...}); only where nothing is declared is it guessed from the stored dtype, and only for dtypes
that one format alone uses (float8). Other packed bytes without a declaration are refused: 4-bit
packings differ between writers, and a wrong guess would give a model that runs and is wrong.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ...errors import CorruptFileError, UnsupportedFormatError
from . import fused
from .dequant_steps import few_threads, fill_by_rows, output
from .safetensors_file import torch_dtype
from .validate import JSON_LIMITS, Field, checked, parse_json

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
GGUF_TYPE = "weight_gguf_type"
DECLARATION = "comfy_quant"  # ComfyUI's per-layer JSON naming the layer's packed format
NVFP4_BLOCK = 16

# The 16 E2M1 code points, indexed by the 4-bit code (sign in bit 3).
_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)

Shape = tuple[int, ...]


@dataclass(frozen=True)
class PackedFormat:
    label: str  # what the pack reports ("gguf-<type>" for GGUF)
    dtypes: tuple[torch.dtype, ...]  # the stored weight's dtype
    companions: tuple[str, ...]  # needed beside the weight to dequantize it, by the host's suffix
    # stored suffix -> the host's companion suffix, or None for a companion that is read past (fp8 input
    # scales only serve fp8 matmuls; the pack computes in the model's float dtype)
    spellings: dict[str, str | None]
    stored_shape: Callable[[Shape, dict], Shape]
    dequantize: Callable[..., torch.Tensor]  # (weight, companions, dtype, shape, out=None) -> values
    declared: tuple[str, ...] = ()  # comfy_quant "format" values that name it
    guessed: bool = False  # an undeclared weight of one of its dtypes is taken for it
    logical_shape: Callable[[Shape], Shape] = field(default=lambda shape: shape)
    rank: int | None = None  # the stored weight's number of dimensions, where the format fixes it

    @property
    def stored_companions(self) -> tuple[str, ...]:
        """The companions a file stores (GGUF's type is the loader's, from the file's own type field)."""
        return tuple(c for c in self.companions if c in self.spellings.values())


def _gguf_stored_shape(shape: Shape, companions: dict) -> Shape:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    block_size, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(int(companions[GGUF_TYPE]))]
    return (*shape[:-1], shape[-1] // block_size * type_size)


def _gguf_dequantize(weight: torch.Tensor, companions: dict, dtype: torch.dtype, shape: Shape,
                     out=None) -> torch.Tensor:
    from .gguf_dequant import dequantize as gguf_dequantize

    return gguf_dequantize(weight, int(companions[GGUF_TYPE]), shape, dtype, out=out)


def _fp8_dequantize(weight: torch.Tensor, companions: dict, dtype: torch.dtype, shape: Shape, out=None) -> torch.Tensor:
    return dequantize_fp8(weight, companions["weight_scale"], dtype, out=out)


def _nvfp4_dequantize(weight: torch.Tensor, companions: dict, dtype: torch.dtype, shape: Shape,
                      out=None) -> torch.Tensor:
    return dequantize_nvfp4(weight, companions["weight_scale"], companions["weight_scale_2"], dtype, out=out)


GGUF = PackedFormat(
    "gguf", (torch.uint8,), (GGUF_TYPE,), {}, _gguf_stored_shape, _gguf_dequantize,
)
NVFP4 = PackedFormat(
    "nvfp4", (torch.uint8,), ("weight_scale", "weight_scale_2"),
    {"weight_scale": "weight_scale", "weight_scale_2": "weight_scale_2", "input_scale": None},
    lambda shape, companions: (*shape[:-1], shape[-1] // 2), _nvfp4_dequantize,
    declared=("nvfp4",), logical_shape=lambda shape: (*shape[:-1], shape[-1] * 2), rank=2,
)
FP8_SCALED = PackedFormat(
    "fp8-scaled", FP8_DTYPES, ("weight_scale",),
    {"weight_scale": "weight_scale", "scale_weight": "weight_scale", "input_scale": None, "scale_input": None},
    lambda shape, companions: shape, _fp8_dequantize,
    declared=("float8_e4m3fn", "float8_e5m2"), guessed=True,
)
FORMATS = (FP8_SCALED, NVFP4, GGUF)
BY_LABEL = {f.label: f for f in FORMATS}

COMPANIONS = tuple(dict.fromkeys(c for f in FORMATS for c in f.companions))  # stored beside a packed weight
# Every stored companion suffix -> the host's suffix (None: dropped); the declaration is read, never kept.
SPELLINGS: dict[str, str | None] = {
    **{stored: host for f in FORMATS for stored, host in f.spellings.items()},
    DECLARATION: None,
}


def is_companion(key: str) -> bool:
    """Whether a state-dict key names a companion of a packed weight rather than a weight."""
    return key.rpartition(".")[2] in COMPANIONS


def split_entries(entries: dict[str, torch.Tensor], key: str) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """A weight's entries as the readers return them -> the weight, and its companions by suffix."""
    return entries[key], {k.rpartition(".")[2]: v for k, v in entries.items() if k != key}


def packed_format(label: str) -> PackedFormat | None:
    """The row of a reported format word ("gguf-Q8_0" is GGUF's), or None for a plain float format."""
    return BY_LABEL.get(label.split("-")[0] if label.startswith("gguf-") else label)


def gguf_label(qtype) -> str:
    return f"{GGUF.label}-{qtype.name}"


def _stored_format(weight_dtype: torch.dtype, companions) -> PackedFormat | None:
    """The format of a stored weight from its dtype and the companions beside it (what the loader kept)."""
    for f in FORMATS:
        if weight_dtype in f.dtypes and all(c in companions for c in f.companions):
            return f
    return None


# --- safetensors: what a file declares, and the format word of each stored tensor -------------------------


DECLARATION_FIELDS = {"format": Field(str, max_len=64)}  # the one field of a comfy_quant the pack reads


def declarations(files) -> dict[str, str]:
    """{layer prefix ("model.layers.1.self_attn.q_proj."): declared format} from a file's comfy_quant tensors."""
    out = {}
    for name, info in files.infos.items():
        layer, _, suffix = name.rpartition(".")
        if suffix != DECLARATION:
            continue
        where = f"{name} (ComfyUI's quantization declaration)"
        if info.nbytes > JSON_LIMITS["config"]:  # refused before it is read
            raise CorruptFileError(f"{where} is {info.nbytes} bytes, not a short JSON text; the file is damaged.")
        raw = files.read(name).reshape(-1).view(torch.uint8).numpy().tobytes()
        out[layer + "."] = checked(parse_json(raw, where, "config"), DECLARATION_FIELDS, where)["format"]
    return out


def label(name: str, dtype: str, plain: str, declared: str | None) -> str:
    """The format word of stored tensor `name` (safetensors dtype `dtype`, plainly called `plain`): the format
    its comfy_quant declares, else the one its dtype alone implies, else its plain dtype."""
    if declared is not None:
        found = next((f for f in FORMATS if declared in f.declared), None)
        if found is None:
            known = ", ".join(d for f in FORMATS for d in f.declared)
            raise UnsupportedFormatError(
                f"{name} is declared as {declared!r} quantization (its comfy_quant tensor); the pack reads {known}. "
                "Use a bf16, fp8 or NVFP4 file of this model."
            )
        if torch_dtype(dtype) not in found.dtypes:
            raise CorruptFileError(f"{name} is declared {declared!r} but stored as {dtype}; the file is damaged.")
        return found.label
    stored = torch_dtype(dtype)
    guessed = next((f for f in FORMATS if f.guessed and stored in f.dtypes), None)
    if guessed is not None:
        return guessed.label
    if name.endswith(".weight") and stored is not None and not stored.is_floating_point:
        raise UnsupportedFormatError(
            f"{name} is stored as {dtype} with no comfy_quant tensor saying how it is packed. Packed 4-bit weights "
            "differ between writers, so the pack does not guess: use a file written by ComfyUI (NVFP4 with its "
            "comfy_quant declarations), or a bf16 or fp8 file of this model."
        )
    return plain


def labels(files) -> dict[str, str]:
    """{stored name: format word} for every tensor of a SafetensorsFiles, from its headers and declarations."""
    declared = declarations(files)
    out = {}
    for name, info in files.infos.items():
        layer = name.rpartition(".")[0] + "."
        out[name] = label(name, info.dtype, info.plain, declared.get(layer) if name.endswith(".weight") else None)
        packed = packed_format(out[name])
        if packed is not None and packed.rank is not None and len(info.shape) != packed.rank:
            raise CorruptFileError(
                f"{name} is a {packed.label} weight of shape {list(info.shape)}; {packed.label} weights have "
                f"{packed.rank} dimensions. The file is damaged; download it again."
            )
    return out


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
    stored beside it by suffix (weight_scale, weight_scale_2, weight_gguf_type). A packed weight's values go
    into `out` where given (a contiguous tensor of that shape, dtype and device) instead of a new tensor."""
    found = _stored_format(weight.dtype, companions)
    if found is not None:
        return found.dequantize(weight, companions, dtype, tuple(shape), out=out)
    if any(weight.dtype in f.dtypes for f in FORMATS):
        raise UnsupportedFormatError(
            f"A {weight.dtype} weight {list(weight.shape)} came without the companions its packing needs "
            f"(given: {', '.join(companions) or 'none'}); it cannot be dequantized. Load the model again."
        )
    return weight.to(dtype)


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
    if fused.fp8(codes, weight.dtype, scale, out):
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
    if fused.nvfp4(packed, block_scales, tensor_scale, _E2M1, out):
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
