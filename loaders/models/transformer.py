"""FLUX.2 transformers from disk, as a BFL-keyed state dict and the variant its shapes say it is.

Reads a BFL single file (flux2-dev.safetensors, also scaled fp8 in either scale spelling and every comfy_quant
format ComfyUI reads: NVFP4, MXFP8, INT8 with and without ConvRot, W4A4, W4A8), a diffusers
transformer folder (single or sharded with an index) or a whole pipeline folder (its transformer/). The
variant comes from the tensor shapes alone (safetensors headers), so an unknown model fails before any
weight is read. diffusers keys are renamed to the host's BFL keys through one table.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ...errors import (
    MissingWeightsError,
    UnknownModelError,
    UnsupportedFormatError,
    VariantMismatchError,
)
from ..formats import packing
from ..formats.safetensors_file import DTYPES, SafetensorsFiles
from ..formats.validate import released_on_error
from . import progress
from .transformer_layout import (
    DIFFUSERS,
    KeyLayout,
    TransformerGeometry,
    check_tensor_shapes,
    diffusers_plan,
    geometry_from_shapes,
    transformer_files,
    variant_for_geometry,
)
from .variants import Flux2Variant, known_variants, variant_for_conditioning

if TYPE_CHECKING:  # for the annotations only: torch is imported where a tensor is made
    import torch

FP8_MARKERS = ("scaled_fp8",)  # whole-file flags some fp8 writers add; they carry no weights
# The packed formats (loaders/formats/packing.py) the pack reads in a BFL transformer file: every safetensors one.
READ_FORMATS = tuple(f for f in packing.FORMATS if f is not packing.GGUF)
FLOAT_DTYPES = ("BF16", "F16", "F32")  # the safetensors dtypes of a plain (unpacked) transformer
# What the errors say the pack reads, from the two tables above.
READS = (f"{', '.join(DTYPES[d][0] for d in FLOAT_DTYPES)} and {', '.join(f.label for f in READ_FORMATS)} FLUX.2 "
         "transformers")


@dataclass
class LoadedTransformer:
    # BFL keys; packed weights stay as stored, with their companions ("<layer>.weight_scale" ...) beside them
    state_dict: dict[str, torch.Tensor]
    variant: Flux2Variant
    geometry: TransformerGeometry
    layout: str  # "BFL" or "diffusers"


def _diffusers_readers(shapes: Mapping[str, tuple[int, ...]], read: Callable[[str], torch.Tensor],
                       geometry: TransformerGeometry) -> dict[str, tuple[tuple[int, ...], Callable[[], dict]]]:
    """BFL key -> (its shape, a reader of it) for a diffusers state dict: the parts concatenated, the halves
    swapped where the table says."""

    def reader(bfl_key: str, names: list[str], swap_halves: bool) -> Callable[[], dict]:
        def read_one() -> dict[str, torch.Tensor]:
            import torch

            tensor = torch.cat([read(s) for s in names]) if len(names) > 1 else read(names[0])
            if swap_halves:
                first, second = tensor.chunk(2)
                tensor = torch.cat((second, first))
            return {bfl_key: tensor}

        return read_one

    out = {}
    for bfl_key, names, swap_halves in diffusers_plan(shapes, geometry):
        shape = (sum(shapes[s][0] for s in names), *shapes[names[0]][1:])
        out[bfl_key] = (shape, reader(bfl_key, names, swap_halves))
    return out


def diffusers_to_bfl(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A diffusers Flux2Transformer2DModel state dict in the host's BFL keys."""
    shapes = {k: tuple(t.shape) for k, t in state_dict.items()}
    geometry, layout = geometry_from_shapes(shapes)
    if layout is not DIFFUSERS:
        raise UnknownModelError("diffusers_to_bfl was given a state dict that is not in diffusers keys.")
    out = {}
    for _, read in _diffusers_readers(shapes, state_dict.__getitem__, geometry).values():
        out.update(read())
    return out


def _bfl_readers(files: SafetensorsFiles, shapes: Mapping[str, tuple[int, ...]]
                 ) -> tuple[dict[str, tuple[tuple[int, ...], Callable[[], dict]]], list[str]]:
    """BFL key -> (its shape, a reader of it) for a BFL file, every check made on the headers first: a packed
    format the pack does not read, a packed weight without its companions, an integer weight. A reader gives the
    tensor as stored, packed ones with their companions under the host's suffixes, as stored too
    (loaders/formats/packing.py). Also: the stored tensors the readers read."""
    stored = packing.stored_tensors(files)
    packed = {}
    for name, label in stored.labels.items():
        found = packing.packed_format(label)
        if found is not None and name not in FP8_MARKERS:
            packed[name] = found
    other = sorted({f"{f.label} ({name})" for name, f in packed.items() if f not in READ_FORMATS})
    if other:
        raise UnsupportedFormatError(
            f"The transformer holds {other[0]} weights; the pack reads {READS}. Use one of those."
        )
    companions: dict[str, dict[str, str]] = {}  # layer -> host suffix -> stored name
    tensors = []
    for name in files.infos:
        if name in FP8_MARKERS:
            continue
        layer, _, suffix = name.rpartition(".")
        if suffix in packing.SPELLINGS:
            if packing.SPELLINGS[suffix] is not None:
                companions.setdefault(layer, {})[packing.SPELLINGS[suffix]] = name
            continue
        tensors.append(name)
    for f in READ_FORMATS:
        lacking = {k: [c for c in f.stored_companions if c not in companions.get(k.rpartition(".")[0], {})]
                   for k, g in packed.items() if g is f}
        lacking = {k: absent for k, absent in lacking.items() if absent}
        if not lacking:
            continue
        first, absent = next(iter(lacking.items()))
        if f is packing.FP8_SCALED:
            spellings = " or ".join(f".{s}" for s, host in f.spellings.items() if host in f.companions)
            raise UnsupportedFormatError(
                f"{len(lacking)} {f.label} weight(s) have no scale beside them (e.g. {first}); the pack reads "
                f"them with {spellings} only, since unscaled weights from an unknown writer may be off by a factor."
            )
        raise MissingWeightsError(
            f"{len(lacking)} {f.label} weight(s) lack the tensors stored beside them that say what they are (e.g. "
            f"{first} without .{', .'.join(absent)}); the file is incomplete. Download it again."
        )
    # Integer tensors other than packed weights and their companions: no float model has them.
    beside_packed = {n for k in packed for n in companions.get(k.rpartition(".")[0], {}).values()}
    kinds = {name: files.infos[name].dtype for name in tensors if name not in packed}
    kinds.update({name: files.infos[name].dtype for c in companions.values() for name in c.values()
                  if name not in beside_packed})
    odd = [name for name, dtype in kinds.items() if packing.is_integer(dtype)]
    if odd:
        raise UnsupportedFormatError(
            f"The transformer holds integer tensors (e.g. {odd[0]}, torch.{DTYPES[kinds[odd[0]]][2]}); the pack "
            f"reads {READS}."
        )

    def reader(name: str) -> Callable[[], dict]:
        def read_one() -> dict[str, torch.Tensor]:
            import torch

            layer = name.rpartition(".")[0]
            out = {name: files.view(name)}
            if name.endswith(".weight"):
                for host, stored_name in companions.get(layer, {}).items():
                    out[f"{layer}.{host}"] = files.view(stored_name)
                if name in stored.packings:
                    out[f"{layer}.{packing.PACKING}"] = torch.tensor(stored.packings[name])
            return out

        return read_one

    read = [*tensors, *(n for t in tensors if t.endswith(".weight")
                        for n in companions.get(t.rpartition(".")[0], {}).values())]
    return {name: (shapes[name], reader(name)) for name in tensors}, read


@dataclass
class TransformerPlan:
    """A transformer on disk, from its headers alone: every check a load makes is made here, before any weight
    is read; then each tensor is read on its own (`tensors[key][1]()`), in BFL keys."""

    variant: Flux2Variant
    geometry: TransformerGeometry
    layout: KeyLayout
    # BFL key -> (shape, reader of it and its companions)
    tensors: dict[str, tuple[tuple[int, ...], Callable[[], dict]]]
    reads: list[str]  # the stored tensors the readers read; the file's others are read past
    files: SafetensorsFiles


def plan_transformer(path: str | Path) -> TransformerPlan:
    """A FLUX.2 transformer's plan, after its headers named a known variant."""
    files = SafetensorsFiles([str(p) for p in transformer_files(path)])
    shapes = packing.logical_shapes(files)
    geometry, layout = geometry_from_shapes(shapes)
    variant = variant_for_geometry(geometry, layout)
    if layout is DIFFUSERS:
        if any(info.dtype not in FLOAT_DTYPES for info in files.infos.values()):
            raise UnsupportedFormatError(
                "This diffusers-layout transformer holds quantized weights; the pack reads diffusers transformers in "
                f"{', '.join(DTYPES[d][0] for d in FLOAT_DTYPES)}, and "
                f"{', '.join(f.label for f in READ_FORMATS)} as a BFL single file."
            )
        tensors = _diffusers_readers(shapes, files.view, geometry)
        reads = [name for _, names, _ in diffusers_plan(shapes, geometry) for name in names]
    else:
        tensors, reads = _bfl_readers(files, shapes)
    check_tensor_shapes({key: shape for key, (shape, _) in tensors.items()}, geometry, variant)
    return TransformerPlan(variant, geometry, layout, tensors, reads, files)


@released_on_error
def load_transformer(path: str | Path) -> LoadedTransformer:
    """Read a FLUX.2 transformer into BFL keys, after its headers named a known variant."""
    plan = plan_transformer(path)
    state_dict = {}
    for _, read in progress.tracked(plan.tensors.values()):
        state_dict.update(read())
    return LoadedTransformer(state_dict, plan.variant, plan.geometry, plan.layout.name)


def _encoder_phrase(variant: Flux2Variant) -> str:
    return f"the {variant.encoder_name} encoder of {variant.name}"


def check_conditioning_width(width: int, variant: Flux2Variant) -> None:
    """Raise unless conditioning `width` wide is what a `variant` transformer takes. Runs when the sampler
    prepares its conds, so a cross-wired graph stops before the first step, naming both sides."""
    if width == variant.context_in_dim:
        return
    expects = f"this {variant.name} transformer expects {variant.context_in_dim} ({_encoder_phrase(variant)})"
    source = variant_for_conditioning(width)
    if source is not None:
        raise VariantMismatchError(
            f"The conditioning is {width} wide ({_encoder_phrase(source)}) but {expects}. Encode the prompt with "
            f"the text encoder that belongs to {variant.name}; encoders of different FLUX.2 variants do not mix."
        )
    widths = ", ".join(f"{v.name} {v.context_in_dim}" for v in known_variants())
    raise VariantMismatchError(
        f"The conditioning is {width} wide, which no FLUX.2 text encoder gives ({widths}): it comes from the encoder "
        f"of another model family (FLUX.1 or other), but {expects}. Encode the prompt with the text encoder that "
        f"belongs to {variant.name}."
    )
