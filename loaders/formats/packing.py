"""What a stored tensor is, from headers alone and without torch: the packed weight formats of encoder and
transformer checkpoints in one table (FORMATS), how each is detected, the shape it is stored in, the companions
it needs (the tensors stored beside the weight, in every spelling met in the wild), the settings its declaration
carries, the word the pack reports for it, and its dequantizer, by packed_dequant.py's torch functions, as ComfyUI
0.33 (comfy/quant_ops.py's QUANT_ALGOS, through comfy-kitchen) dequantizes them.

Each format's bytes and values are as docs/dequantization.md's table of comfy_quant formats gives them; GGUF weights
are uint8 rows of the file's raw blocks, with the type's number beside them as weight_gguf_type (gguf_types.py).

A safetensors weight's format is the one its `<layer>.comfy_quant` tensor declares (ComfyUI's JSON
{"format": ...} and the format's settings); only where nothing is declared is it guessed from the stored dtype,
and only for dtypes that one format alone uses (float8). Other packed bytes without a declaration are refused:
4-bit packings differ between writers, and a wrong guess would give a model that runs and is wrong. A declared
format no ComfyUI release reads (convert-to-quant's row- and block-wise fp8 and block-wise int8) is refused too.
The loaders hand a declared weight's row and settings to the dequantizer as one more companion (PACKING).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from ...errors import CorruptFileError, UnsupportedFormatError
from .safetensors_file import DTYPES, FLOATS
from .validate import JSON_LIMITS, Field, checked, parse_json

GGUF_TYPE = "weight_gguf_type"
# The loader's companion of a declared weight whose row needs it: [its index in FORMATS, *its settings' values].
PACKING = "weight_packing"
DECLARATION = "comfy_quant"  # ComfyUI's per-layer JSON naming the layer's packed format

Shape = tuple[int, ...]


def _power_of_4(n: int) -> bool:
    return n >= 4 and n & (n - 1) == 0 and (n.bit_length() - 1) % 2 == 0


@dataclass(frozen=True)
class Setting:
    """An integer a declaration carries (at its top level, or in its "params" object, as ComfyUI reads it)."""

    name: str
    default: int  # ComfyUI's, where the declaration leaves it out
    valid: Callable[[int], bool]
    expected: str  # what `valid` asks, in words
    divides_inputs: bool = True  # it must divide the layer's inputs (the weight's last logical dimension)


CONVROT_GROUP = Setting("convrot_groupsize", 256, _power_of_4, "a power of 4 (16, 64, 256, ...)")
W4A8_GROUP = Setting("group_size", 16, lambda n: n >= 4 and (16 % n == 0 or n % 16 == 0),
                     "4, 8, 16 or a multiple of 16")


@dataclass(frozen=True)
class PackedFormat:
    label: str  # what the pack reports ("gguf-<type>" for GGUF)
    dtypes: tuple[str, ...]  # the stored weight's safetensors dtype names
    companions: tuple[str, ...]  # needed beside the weight to dequantize it, by the host's suffix
    # stored suffix -> the host's companion suffix, or None for a companion that is read past (input scales only
    # serve quantized matmuls; the pack computes in the model's float dtype)
    spellings: dict[str, str | None]
    stored_shape: Callable[[Shape, dict], Shape]
    declared: tuple[str, ...] = ()  # comfy_quant "format" values that name it
    guessed: bool = False  # an undeclared weight of one of its dtypes is taken for it
    logical_shape: Callable[[Shape], Shape] = field(default=lambda shape: shape)
    rank: int | None = None  # the stored weight's number of dimensions, where the format fixes it
    optional: tuple[str, ...] = ()  # companions read where the file has them
    flag: str | None = None  # the declaration's true/false field that picks this row among rows of one format word
    settings: tuple[Setting, ...] = ()  # what its declaration carries, in PACKING's order
    # (weight name, its stored shape, its companions' stored shapes by stored suffix, its declaration) -> what is
    # wrong with a weight its declaration names this format, or None: checks the headers alone can make
    check: Callable[[str, Shape, dict[str, Shape], dict], str | None] | None = None
    dequantize: Callable | None = None  # its dequantizer (below)

    @property
    def stored_companions(self) -> tuple[str, ...]:
        """The companions a file must store (GGUF's type is the loader's, from the file's own type field; PACKING
        the loader's, from the declaration)."""
        return tuple(c for c in self.companions if c in self.spellings.values())


def _gguf_stored_shape(shape: Shape, companions: dict) -> Shape:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    block_size, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(int(companions[GGUF_TYPE]))]
    return (*shape[:-1], shape[-1] // block_size * type_size)


def _same(shape: Shape, companions: dict) -> Shape:
    return shape


def _halved(shape: Shape, companions: dict) -> Shape:
    """Two 4-bit values a byte along the inputs."""
    return (*shape[:-1], shape[-1] // 2)


def _doubled(shape: Shape) -> Shape:
    return (*shape[:-1], shape[-1] * 2)


def _w4a8_check(name: str, stored: Shape, companions: dict[str, Shape], declaration: dict) -> str | None:
    """W4A8's codes are 4 bits (ComfyUI 0.33's comfy-kitchen); newer comfy-kitchen also writes 6-bit ones under the
    same word, told by the inputs weight_s_rel's groups cover."""
    s_rel, group = companions.get("weight_s_rel"), _declared(declaration, W4A8_GROUP.name, W4A8_GROUP.default)
    if s_rel is None or len(s_rel) != 2 or len(stored) != 2 or s_rel[1] * group == stored[1] * 2:
        return None
    return (f"{name} stores {stored[1]} bytes a row for {s_rel[1] * group} inputs ({s_rel[1]} groups of {group} in "
            f"its weight_s_rel): codes of {stored[1] * 8 / (s_rel[1] * group):g} bits, where ComfyUI reads 4-bit W4A8 "
            "(comfy-kitchen's 6-bit codes are newer than ComfyUI 0.33). Use a 4-bit W4A8 file, another format or a "
            "bf16 file.")


# The rows' dequantizers: (packed_dequant, weight, companions by suffix, dtype, logical shape, out=None) -> values.
# packed_dequant.dequantize hands itself in: its functions are torch, which this module does not import.


def _gguf_values(dq, weight, companions, dtype, shape, out=None):
    return dq.dequantize_gguf(weight, int(companions[GGUF_TYPE]), shape, dtype, out=out)  # gguf_types.dequantize


def _fp8_values(dq, weight, companions, dtype, shape, out=None):
    return dq.dequantize_fp8(weight, companions["weight_scale"], dtype, out=out)


def _nvfp4_values(dq, weight, companions, dtype, shape, out=None):
    return dq.dequantize_nvfp4_layer(weight, companions, dtype, out=out)


def _mxfp8_values(dq, weight, companions, dtype, shape, out=None):
    return dq.dequantize_mxfp8(weight, companions["weight_scale"], dtype, out=out)


def _int8_values(dq, weight, companions, dtype, shape, out=None):
    return dq.dequantize_int8(weight, companions["weight_scale"], dtype, out=out)


def _int8_convrot_values(dq, weight, companions, dtype, shape, out=None):
    (group,) = settings(companions)
    return dq.dequantize_int8(weight, companions["weight_scale"], dtype, convrot_group=group, out=out)


def _w4a4_values(dq, weight, companions, dtype, shape, out=None):
    (group,) = settings(companions)
    return dq.dequantize_convrot_w4a4(weight, companions["weight_scale"], group, dtype, out=out)


def _w4a8_values(dq, weight, companions, dtype, shape, out=None):
    group, convrot_group = settings(companions)
    return dq.dequantize_w4a8(weight, companions["weight_s_rel"], companions["weight_s_channel"],
                              companions.get("weight_codebook"), group, convrot_group, dtype, out=out)


WEIGHT_SCALE = {"weight_scale": "weight_scale", "input_scale": None}

GGUF = PackedFormat("gguf", ("U8",), (GGUF_TYPE,), {}, _gguf_stored_shape, dequantize=_gguf_values)
NVFP4 = PackedFormat(
    "nvfp4", ("U8",), ("weight_scale", "weight_scale_2"),
    {**WEIGHT_SCALE, "weight_scale_2": "weight_scale_2", "pre_quant_scale": "pre_quant_scale"}, _halved,
    declared=("nvfp4",), logical_shape=_doubled, rank=2, optional=("pre_quant_scale",), dequantize=_nvfp4_values,
)
FP8_SCALED = PackedFormat(
    "fp8-scaled", ("F8_E4M3", "F8_E5M2"), ("weight_scale",),
    {**WEIGHT_SCALE, "scale_weight": "weight_scale", "scale_input": None}, _same,
    declared=("float8_e4m3fn", "float8_e5m2"), guessed=True, dequantize=_fp8_values,
)
MXFP8 = PackedFormat("mxfp8", ("F8_E4M3",), ("weight_scale", PACKING), WEIGHT_SCALE, _same, declared=("mxfp8",),
                     rank=2, dequantize=_mxfp8_values)
INT8 = PackedFormat("int8", ("I8",), ("weight_scale", PACKING), WEIGHT_SCALE, _same, declared=("int8_tensorwise",),
                    rank=2, dequantize=_int8_values)
INT8_CONVROT = PackedFormat("int8-convrot", ("I8",), ("weight_scale", PACKING), WEIGHT_SCALE, _same,
                            declared=("int8_tensorwise",), rank=2, flag="convrot", settings=(CONVROT_GROUP,),
                            dequantize=_int8_convrot_values)
CONVROT_W4A4 = PackedFormat("convrot-w4a4", ("I8",), ("weight_scale", PACKING), WEIGHT_SCALE, _halved,
                            declared=("convrot_w4a4",), logical_shape=_doubled, rank=2, settings=(CONVROT_GROUP,),
                            dequantize=_w4a4_values)
W4A8 = PackedFormat(
    "w4a8", ("I8",), ("weight_s_rel", "weight_s_channel", PACKING),
    {"weight_s_rel": "weight_s_rel", "weight_s_channel": "weight_s_channel", "weight_codebook": "weight_codebook",
     "input_scale": None}, _halved,
    declared=("asym_w4a8_int8",), logical_shape=_doubled, rank=2, optional=("weight_codebook",),
    settings=(W4A8_GROUP, CONVROT_GROUP), check=_w4a8_check, dequantize=_w4a8_values,
)
FORMATS = (FP8_SCALED, NVFP4, MXFP8, INT8, INT8_CONVROT, CONVROT_W4A4, W4A8, GGUF)
BY_LABEL = {f.label: f for f in FORMATS}
# The comfy_quant formats the pack reads, as ComfyUI names them.
DECLARED = tuple(dict.fromkeys(d for f in FORMATS for d in f.declared))

# Stored beside a packed weight: what the formats need or read where it is there.
COMPANIONS = tuple(dict.fromkeys(c for f in FORMATS for c in (*f.companions, *f.optional)))
# Every stored companion suffix -> the host's suffix (None: dropped); the declaration is read, never kept.
SPELLINGS: dict[str, str | None] = {
    **{stored: host for f in FORMATS for stored, host in f.spellings.items()},
    DECLARATION: None,
}
# Companions of a declared weight that ComfyUI 0.33 reads past although they change what the weight is: a file
# that holds one is refused rather than read as the host reads it (wrongly).
REFUSED_COMPANIONS = {
    "weight_correction": "asymmetric W4A8 (a zero point per group in weight_correction), which ComfyUI 0.33 loads "
                         "without its zero points, so its weights come out shifted",
}


def is_companion(key: str) -> bool:
    """Whether a state-dict key names a companion of a packed weight rather than a weight."""
    return key.rpartition(".")[2] in COMPANIONS


def packed_format(label: str) -> PackedFormat | None:
    """The row of a reported format word ("gguf-Q8_0" is GGUF's), or None for a plain float format."""
    return BY_LABEL.get(label.split("-")[0] if label.startswith("gguf-") else label)


def gguf_label(qtype) -> str:
    return f"{GGUF.label}-{qtype.name}"


def packing_values(companions) -> tuple[int, ...]:
    """The PACKING companion's values (a tensor as the loaders make it, or the numbers the host's layers keep)."""
    return tuple(int(v) for v in companions[PACKING])


def stored_format(weight_dtype: str | None, companions) -> PackedFormat | None:
    """The format of a stored weight from its safetensors dtype name and the companions beside it (what the
    loader kept): the declared row where PACKING names one, else the one row its dtype and companions fit."""
    if PACKING in companions:
        index = packing_values(companions)[0]
        return FORMATS[index] if 0 <= index < len(FORMATS) else None
    for f in FORMATS:
        if PACKING not in f.companions and weight_dtype in f.dtypes and all(c in companions for c in f.companions):
            return f
    return None


def settings(companions) -> tuple[int, ...]:
    """A declared weight's settings, in its row's order (PACKING's values after the row's index)."""
    return packing_values(companions)[1:]


# --- safetensors: what a file declares, and the format word of each stored tensor -------------------------


_SETTING_FIELD = Field(int, lo=1, hi=1 << 16, required=False)
# The fields of a comfy_quant the pack reads; ComfyUI reads the settings from its "params" object too.
_SETTING_FIELDS = {s.name: _SETTING_FIELD for s in dict.fromkeys(s for f in FORMATS for s in f.settings)}
_FLAG_FIELDS = {f.flag: Field((bool, int), required=False) for f in FORMATS if f.flag}
DECLARATION_FIELDS = {
    "format": Field(str, max_len=64), **_FLAG_FIELDS, **_SETTING_FIELDS,
    "params": Field((dict, type(None)), required=False, fields={**_FLAG_FIELDS, **_SETTING_FIELDS}),
}


def declarations(files) -> dict[str, dict]:
    """{layer prefix ("model.layers.1.self_attn.q_proj."): its checked comfy_quant JSON object} from a file's
    comfy_quant tensors."""
    out = {}
    for name, info in files.infos.items():
        layer, _, suffix = name.rpartition(".")
        if suffix != DECLARATION:
            continue
        where = f"{name} (ComfyUI's quantization declaration)"
        if info.nbytes > JSON_LIMITS["config"]:  # refused before it is read
            raise CorruptFileError(f"{where} is {info.nbytes} bytes, not a short JSON text; the file is damaged.")
        out[layer + "."] = checked(parse_json(files.read_bytes(name), where, "config"), DECLARATION_FIELDS, where)
    return out


def _declared(declaration: dict, name: str, default):
    """A declaration's field as ComfyUI reads it: at the top level, else in "params", else its default."""
    params = declaration.get("params")
    return declaration.get(name, params.get(name, default) if isinstance(params, dict) else default)


def declared_format(name: str, dtype: str, declaration: dict) -> PackedFormat:
    """The row weight `name` (safetensors dtype `dtype`) is declared as: the rows of its format word, the one
    whose flag the declaration sets, else the one without a flag."""
    word = declaration["format"]
    rows = [f for f in FORMATS if word in f.declared]
    if not rows:
        raise UnsupportedFormatError(
            f"{name} is declared as {word!r} quantization (its comfy_quant tensor), which no ComfyUI release reads "
            f"(convert-to-quant writes its row- and block-wise fp8 and block-wise int8 so); the pack reads "
            f"{', '.join(DECLARED)}, as ComfyUI does. Convert the model again in one of those (convert-to-quant: "
            "per-tensor fp8, --int8 with tensor or row scaling, --mxfp8 or --nvfp4), or use a bf16 file."
        )
    found = next((f for f in rows if f.flag and _declared(declaration, f.flag, False)), None) \
        or next(f for f in rows if not f.flag)
    if dtype not in found.dtypes:
        raise CorruptFileError(f"{name} is declared {word!r} but stored as {dtype}; the file is damaged.")
    return found


def declared_settings(name: str, found: PackedFormat, declaration: dict, inputs: int) -> tuple[int, ...]:
    """The values of `found`'s settings in the declaration of weight `name` (with `inputs` inputs), each checked
    to be one the format can have."""
    values = []
    for s in found.settings:
        value = _declared(declaration, s.name, s.default)  # an integer: DECLARATION_FIELDS checked it
        if not s.valid(value) or (s.divides_inputs and inputs % value):
            raise CorruptFileError(
                f"{name}'s comfy_quant gives {s.name} {value}; {found.label} needs {s.expected}"
                + (f" that divides the layer's {inputs} inputs" if s.divides_inputs else "")
                + ". The file is damaged; download it again."
            )
        values.append(value)
    return tuple(values)


def label(name: str, dtype: str, plain: str, declaration: dict | None) -> str:
    """The format word of stored tensor `name` (safetensors dtype `dtype`, plainly called `plain`): the format
    its comfy_quant declares, else the one its dtype alone implies, else its plain dtype."""
    if declaration is not None:
        return declared_format(name, dtype, declaration).label
    guessed = next((f for f in FORMATS if f.guessed and dtype in f.dtypes), None)
    if guessed is not None:
        return guessed.label
    if name.endswith(".weight") and is_integer(dtype):
        raise UnsupportedFormatError(
            f"{name} is stored as {dtype} with no comfy_quant tensor saying how it is packed. Packed weights "
            "differ between writers, so the pack does not guess: use a file written by ComfyUI or convert-to-quant "
            "(with its comfy_quant declarations), or a bf16 or fp8 file of this model."
        )
    return plain


def is_integer(dtype: str) -> bool:
    """Whether safetensors dtype `dtype` is one the pack reads and no float type (uint8, int8, bool ...)."""
    return dtype in DTYPES and dtype not in FLOATS


@dataclass(frozen=True)
class StoredTensors:
    labels: dict[str, str]  # stored name -> its format word
    # stored name of a declared weight whose row needs it -> its PACKING companion's values
    packings: dict[str, tuple[int, ...]]


def stored_tensors(files) -> StoredTensors:
    """What each tensor of a SafetensorsFiles is, from its headers and declarations."""
    declared = declarations(files)
    labels, packings = {}, {}
    for name, info in files.infos.items():
        layer, _, suffix = name.rpartition(".")
        declaration = declared.get(layer + ".")
        if suffix in REFUSED_COMPANIONS and declaration is not None:
            raise UnsupportedFormatError(
                f"{name}: the layer is {REFUSED_COMPANIONS[suffix]}. The pack does not read it; use a symmetric "
                "W4A8 file (comfy-kitchen's default), another format or a bf16 file."
            )
        if suffix in SPELLINGS:  # a companion is a packed weight's part, not a weight: its plain dtype
            labels[name] = info.plain
            continue
        labels[name] = label(name, info.dtype, info.plain, declaration if suffix == "weight" else None)
        packed = packed_format(labels[name])
        if packed is None:
            continue
        if packed.rank is not None and len(info.shape) != packed.rank:
            raise CorruptFileError(
                f"{name} is a {packed.label} weight of shape {list(info.shape)}; {packed.label} weights have "
                f"{packed.rank} dimensions. The file is damaged; download it again."
            )
        beside = {s: files.infos[f"{layer}.{s}"].shape for s in packed.spellings if f"{layer}.{s}" in files.infos}
        problem = packed.check(name, info.shape, beside, declaration) if packed.check else None
        if problem:
            raise UnsupportedFormatError(problem)
        if PACKING in packed.companions:
            inputs = packed.logical_shape(info.shape)[-1]
            packings[name] = (FORMATS.index(packed), *declared_settings(name, packed, declaration, inputs))
    return StoredTensors(labels, packings)


def labels(files) -> dict[str, str]:
    """{stored name: format word} for every tensor of a SafetensorsFiles, from its headers and declarations."""
    return stored_tensors(files).labels


def logical_shapes(files) -> dict[str, Shape]:
    """{stored name: the shape it stands for} for every tensor of a SafetensorsFiles: a declared 4-bit weight holds
    twice the inputs it stores, the rest as stored. What is refused is left to stored_tensors."""
    declared = declarations(files)
    out = {}
    for name, info in files.infos.items():
        layer, _, suffix = name.rpartition(".")
        word = declared.get(layer + ".", {}).get("format") if suffix == "weight" else None
        found = next((f for f in FORMATS if word in f.declared), None)
        out[name] = found.logical_shape(info.shape) if found else info.shape
    return out
