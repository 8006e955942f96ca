"""A LoRA to bake into a transformer, judged from its safetensors header before torch and ComfyUI are imported:
its layers (the up/down pairs and full differences ComfyUI's LoRA loader reads), each pair whole and of one
rank, each alpha one number, and whether any layer is shaped for, and named after, a weight of the transformer at
all. The host's loader then maps the names (host/lora_bake.py)."""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass, field

from ...errors import CorruptFileError, UnsupportedFormatError, WrongModelError
from ..formats.safetensors_file import SafetensorsFiles
from ..models.lora_layouts import PAIRS
from ..models.transformer_layout import bfl_shapes, module_names

DIFF = ".diff"  # a full difference of the weight's shape
ALPHA = ".alpha"  # one number: the pair's product is scaled by alpha / rank
FLOATS = ("F64", "F32", "F16", "BF16")
# alpha is read as a number: any numeric type, one value (its struct format; bf16 is float32's upper half)
ALPHA_FORMATS = {"F64": "<d", "F32": "<f", "F16": "<e", "BF16": "<f", "I64": "<q", "I32": "<i", "I8": "<b", "U8": "<B"}


@dataclass
class LoraFile:
    """A LoRA's layers by name: the shape of the difference each makes to its weight (None when that shape
    takes the host's arithmetic to tell: a LoCon mid weight), and how many tensors are of kinds the host may
    read that are no pair or difference (LoHa, LoKr ...)."""

    path: str
    layers: dict[str, tuple[int, ...] | None] = field(default_factory=dict)
    others: int = 0


def _ending(name: str) -> tuple[str, str, bool] | None:
    """(layer, pair ending, whether it is the up half) of a pair's key, or None."""
    for up, down in PAIRS:
        for end, is_up in ((up, True), (down, False)):
            if name.endswith(end) and len(name) > len(end):
                return name[: -len(end)], end, is_up
    return None


def read_lora(path: str) -> LoraFile:
    """The layers of the LoRA at `path`, every pair and alpha checked; the pack's error naming the key that
    is not what a LoRA holds."""
    if not str(path).lower().endswith(".safetensors"):
        raise UnsupportedFormatError(
            f"{path}: LoRAs are read from .safetensors files only (GGUF files hold models, and pickled .pt/.ckpt/.bin "
            "files can run code when opened). Give the LoRA's .safetensors file."
        )
    files = SafetensorsFiles([str(path)])
    infos = files.infos
    lora = LoraFile(str(path))
    used = set()
    for name, info in sorted(infos.items()):
        found = _ending(name)
        if found is None or not found[2]:
            continue
        layer, end = found[0], found[1]
        down_name = layer + dict(PAIRS)[end]
        if down_name not in infos:
            raise CorruptFileError(f"{path}: the LoRA holds {name} but not its other half {down_name}; the file is "
                                   "damaged or not a LoRA. Download it again.")
        down = infos[down_name]
        for key, part in ((name, info), (down_name, down)):
            if part.dtype not in FLOATS or len(part.shape) < 2 or 0 in part.shape:
                raise CorruptFileError(f"{path}: the LoRA's {key} is {part.dtype} {list(part.shape)}, not a matrix of "
                                       "floats; the file is damaged or not a LoRA.")
        rank = math.prod(info.shape[1:])
        if rank != down.shape[0]:
            raise CorruptFileError(f"{path}: the LoRA's {name} {list(info.shape)} and {down_name} {list(down.shape)} "
                                   "are not of one rank; the file is damaged.")
        mid = layer + ".lora_mid.weight"
        lora.layers[layer] = None if mid in infos else (info.shape[0], math.prod(down.shape[1:]))
        used.update((name, down_name, mid))
    for name, info in sorted(infos.items()):
        if name in used or name.endswith(ALPHA):
            continue
        found = _ending(name)
        if found is not None:  # a down half whose up half is not there
            up = found[0] + next(u for u, d in PAIRS if d == found[1])
            raise CorruptFileError(f"{path}: the LoRA holds {name} but not its other half {up}; the file is "
                                   "damaged or not a LoRA. Download it again.")
        if name.endswith(DIFF) and info.dtype in FLOATS:
            lora.layers[name[: -len(DIFF)]] = tuple(info.shape)
        elif not name.endswith(".dora_scale"):
            lora.others += 1
    for name in (n for n in infos if n.endswith(ALPHA)):
        _check_alpha(files, name, path)
    if not lora.layers and not lora.others:
        raise WrongModelError(f"{path} holds no LoRA layer (no up/down pair, no difference); it is not a LoRA.")
    return lora


def _check_alpha(files: SafetensorsFiles, name: str, path: str) -> None:
    info = files.infos[name]
    if info.dtype not in ALPHA_FORMATS or math.prod(info.shape) != 1:
        raise CorruptFileError(f"{path}: the LoRA's {name} is {info.dtype} {list(info.shape)}, not one number; "
                               "the file is damaged or was written wrongly.")
    raw = files.read_bytes(name)
    (value,) = struct.unpack(ALPHA_FORMATS[info.dtype], b"\0\0" + raw if info.dtype == "BF16" else raw)
    if not math.isfinite(value):
        raise CorruptFileError(f"{path}: the LoRA's {name} is {value}, not a finite number; the file is damaged.")


def fits(delta: tuple[int, ...], weight: tuple[int, ...]) -> bool:
    """Whether a difference of shape `delta` can land in a weight of shape `weight`: the whole weight, or a run
    of its rows (the host puts diffusers' separate q, k and v into slices of a fused weight)."""
    return len(delta) == len(weight) and delta[1:] == weight[1:] and delta[0] <= weight[0]


def _flat(name: str) -> str:
    return name.replace(".", "").replace("_", "").lower()


def check_applies(lora: LoraFile, shapes: dict[str, tuple[int, ...]], model: str) -> None:
    """Refuse a LoRA of another model, told from the headers alone: none of its layers is shaped for any weight
    of the transformer (`shapes`, BFL keys; `model` names it), or none is named after one in any spelling (a
    layer's name, without dots and underscores, ends with a weight's BFL or diffusers module name)."""
    known = {layer: delta for layer, delta in lora.layers.items() if delta is not None}
    if lora.others or len(known) < len(lora.layers):
        return  # some layer's shape is the host's to tell
    targets = set(shapes.values())
    if not any(fits(delta, weight) for delta in known.values() for weight in targets):
        widths = sorted({delta[-1] for delta in known.values()})
        ours = sorted({weight[-1] for weight in targets if len(weight) > 1})
        raise WrongModelError(
            f"{lora.path} patches no weight of this {model} transformer: none of its {len(known)} layer(s) is shaped "
            f"for it (they take inputs of width {', '.join(map(str, widths[:6]))}; its weights "
            f"{', '.join(map(str, ours[:8]))}). It is a LoRA of another model; pick one made for {model}."
        )
    modules = {_flat(name) for name in module_names(shapes)}
    if not any(flat[i:] in modules for flat in map(_flat, known) for i in range(len(flat))):
        shown = ", ".join(sorted(known)[:3]) + (" ..." if len(known) > 3 else "")
        raise WrongModelError(
            f"{lora.path} patches no weight of this {model} transformer: none of its {len(known)} layer(s) is named "
            f"after one ({shown}). It is a LoRA of another model (or of a text encoder alone); pick one made for "
            f"{model}."
        )


def check_loras(paths: list[str], transformer: str) -> list[LoraFile]:
    """Each LoRA at `paths` read and checked against the transformer at `transformer`, from headers alone,
    before torch is imported."""
    loras = [read_lora(path) for path in paths]
    variant, shapes = bfl_shapes(transformer)
    for lora in loras:
        check_applies(lora, shapes, variant.name)
    return loras
