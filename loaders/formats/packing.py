"""What a stored tensor is, from headers alone and without torch: the packed weight formats of encoder and
transformer checkpoints in one table (FORMATS), how each is detected, the shape it is stored in, the companions
it needs (the tensors stored beside the weight, in every spelling met in the wild) and the word the pack reports
for it. Their exact dequantization is packed_dequant.py's.

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

from collections.abc import Callable
from dataclasses import dataclass, field

from ...errors import CorruptFileError, UnsupportedFormatError
from .safetensors_file import DTYPES, FLOATS
from .validate import JSON_LIMITS, Field, checked, parse_json

GGUF_TYPE = "weight_gguf_type"
DECLARATION = "comfy_quant"  # ComfyUI's per-layer JSON naming the layer's packed format

Shape = tuple[int, ...]


@dataclass(frozen=True)
class PackedFormat:
    label: str  # what the pack reports ("gguf-<type>" for GGUF)
    dtypes: tuple[str, ...]  # the stored weight's safetensors dtype names
    companions: tuple[str, ...]  # needed beside the weight to dequantize it, by the host's suffix
    # stored suffix -> the host's companion suffix, or None for a companion that is read past (fp8 input
    # scales only serve fp8 matmuls; the pack computes in the model's float dtype)
    spellings: dict[str, str | None]
    stored_shape: Callable[[Shape, dict], Shape]
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


GGUF = PackedFormat("gguf", ("U8",), (GGUF_TYPE,), {}, _gguf_stored_shape)
NVFP4 = PackedFormat(
    "nvfp4", ("U8",), ("weight_scale", "weight_scale_2"),
    {"weight_scale": "weight_scale", "weight_scale_2": "weight_scale_2", "input_scale": None},
    lambda shape, companions: (*shape[:-1], shape[-1] // 2),
    declared=("nvfp4",), logical_shape=lambda shape: (*shape[:-1], shape[-1] * 2), rank=2,
)
FP8_SCALED = PackedFormat(
    "fp8-scaled", ("F8_E4M3", "F8_E5M2"), ("weight_scale",),
    {"weight_scale": "weight_scale", "scale_weight": "weight_scale", "input_scale": None, "scale_input": None},
    lambda shape, companions: shape,
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


def packed_format(label: str) -> PackedFormat | None:
    """The row of a reported format word ("gguf-Q8_0" is GGUF's), or None for a plain float format."""
    return BY_LABEL.get(label.split("-")[0] if label.startswith("gguf-") else label)


def gguf_label(qtype) -> str:
    return f"{GGUF.label}-{qtype.name}"


def stored_format(weight_dtype: str | None, companions) -> PackedFormat | None:
    """The format of a stored weight from its safetensors dtype name and the companions beside it (what the
    loader kept)."""
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
        out[layer + "."] = checked(parse_json(files.read_bytes(name), where, "config"), DECLARATION_FIELDS,
                                   where)["format"]
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
        if dtype not in found.dtypes:
            raise CorruptFileError(f"{name} is declared {declared!r} but stored as {dtype}; the file is damaged.")
        return found.label
    guessed = next((f for f in FORMATS if f.guessed and dtype in f.dtypes), None)
    if guessed is not None:
        return guessed.label
    if name.endswith(".weight") and is_integer(dtype):
        raise UnsupportedFormatError(
            f"{name} is stored as {dtype} with no comfy_quant tensor saying how it is packed. Packed 4-bit weights "
            "differ between writers, so the pack does not guess: use a file written by ComfyUI (NVFP4 with its "
            "comfy_quant declarations), or a bf16 or fp8 file of this model."
        )
    return plain


def is_integer(dtype: str) -> bool:
    """Whether safetensors dtype `dtype` is one the pack reads and no float type (uint8, int8, bool ...)."""
    return dtype in DTYPES and dtype not in FLOATS


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
