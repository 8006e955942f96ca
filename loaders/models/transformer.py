"""FLUX.2 transformers from disk, as a BFL-keyed state dict and the variant its shapes say it is.

Reads a BFL single file (flux2-dev.safetensors, also scaled fp8 in either scale spelling), a diffusers
transformer folder (single or sharded with an index) or a whole pipeline folder (its transformer/). The
variant comes from the tensor shapes alone (safetensors headers), so an unknown model fails before any
weight is read. diffusers keys are renamed to the host's BFL keys through one table.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping

import torch

from ...errors import (
    MissingWeightsError,
    UnknownModelError,
    UnsupportedFormatError,
    VariantMismatchError,
    WrongModelError,
)
from ..formats import progress, quant
from ..formats.files import part_files
from ..formats.safetensors_file import DTYPES, SafetensorsFiles, torch_dtype
from .variants import Flux2Variant, known_variants, variant_for_conditioning, variant_for_transformer

# BFL key <- diffusers keys (several are concatenated along the output dim), and whether the two halves of
# the result swap places (diffusers' final norm stores scale, shift; BFL stores shift, scale).
# "{n}" is a block index.
DIFFUSERS_TO_BFL = (
    ("img_in.weight", ("x_embedder.weight",), False),
    ("txt_in.weight", ("context_embedder.weight",), False),
    ("time_in.in_layer.weight", ("time_guidance_embed.timestep_embedder.linear_1.weight",), False),
    ("time_in.out_layer.weight", ("time_guidance_embed.timestep_embedder.linear_2.weight",), False),
    ("guidance_in.in_layer.weight", ("time_guidance_embed.guidance_embedder.linear_1.weight",), False),
    ("guidance_in.out_layer.weight", ("time_guidance_embed.guidance_embedder.linear_2.weight",), False),
    ("double_stream_modulation_img.lin.weight", ("double_stream_modulation_img.linear.weight",), False),
    ("double_stream_modulation_txt.lin.weight", ("double_stream_modulation_txt.linear.weight",), False),
    ("single_stream_modulation.lin.weight", ("single_stream_modulation.linear.weight",), False),
    (
        "double_blocks.{n}.img_attn.qkv.weight",
        tuple(f"transformer_blocks.{{n}}.attn.to_{x}.weight" for x in "qkv"),
        False,
    ),
    (
        "double_blocks.{n}.txt_attn.qkv.weight",
        tuple(f"transformer_blocks.{{n}}.attn.add_{x}_proj.weight" for x in "qkv"),
        False,
    ),
    ("double_blocks.{n}.img_attn.norm.query_norm.scale", ("transformer_blocks.{n}.attn.norm_q.weight",), False),
    ("double_blocks.{n}.img_attn.norm.key_norm.scale", ("transformer_blocks.{n}.attn.norm_k.weight",), False),
    ("double_blocks.{n}.txt_attn.norm.query_norm.scale", ("transformer_blocks.{n}.attn.norm_added_q.weight",), False),
    ("double_blocks.{n}.txt_attn.norm.key_norm.scale", ("transformer_blocks.{n}.attn.norm_added_k.weight",), False),
    ("double_blocks.{n}.img_attn.proj.weight", ("transformer_blocks.{n}.attn.to_out.0.weight",), False),
    ("double_blocks.{n}.txt_attn.proj.weight", ("transformer_blocks.{n}.attn.to_add_out.weight",), False),
    ("double_blocks.{n}.img_mlp.0.weight", ("transformer_blocks.{n}.ff.linear_in.weight",), False),
    ("double_blocks.{n}.img_mlp.2.weight", ("transformer_blocks.{n}.ff.linear_out.weight",), False),
    ("double_blocks.{n}.txt_mlp.0.weight", ("transformer_blocks.{n}.ff_context.linear_in.weight",), False),
    ("double_blocks.{n}.txt_mlp.2.weight", ("transformer_blocks.{n}.ff_context.linear_out.weight",), False),
    ("single_blocks.{n}.linear1.weight", ("single_transformer_blocks.{n}.attn.to_qkv_mlp_proj.weight",), False),
    ("single_blocks.{n}.linear2.weight", ("single_transformer_blocks.{n}.attn.to_out.weight",), False),
    ("single_blocks.{n}.norm.query_norm.scale", ("single_transformer_blocks.{n}.attn.norm_q.weight",), False),
    ("single_blocks.{n}.norm.key_norm.scale", ("single_transformer_blocks.{n}.attn.norm_k.weight",), False),
    ("final_layer.linear.weight", ("proj_out.weight",), False),
    ("final_layer.adaLN_modulation.1.weight", ("norm_out.linear.weight",), True),
)


@dataclass(frozen=True)
class KeyLayout:
    """Where a layout keeps the tensors that tell the geometry."""

    name: str
    img_in: str
    txt_in: str
    guidance_prefix: str
    double_prefix: str
    single_prefix: str
    flux2_marker: str  # the shared modulation only FLUX.2 has


LAYOUTS = (
    KeyLayout("BFL", "img_in.weight", "txt_in.weight", "guidance_in.", "double_blocks.", "single_blocks.",
              "double_stream_modulation_img.lin.weight"),
    KeyLayout("diffusers", "x_embedder.weight", "context_embedder.weight", "time_guidance_embed.guidance_embedder.",
              "transformer_blocks.", "single_transformer_blocks.", "double_stream_modulation_img.linear.weight"),
)
BFL, DIFFUSERS = LAYOUTS

FP8_MARKERS = ("scaled_fp8",)  # whole-file flags some fp8 writers add; they carry no weights
# The packed formats (loaders/quant.py) the pack reads in a BFL transformer file.
READ_FORMATS = (quant.FP8_SCALED,)
FLOAT_DTYPES = ("BF16", "F16", "F32")  # the safetensors dtypes of a plain (unpacked) transformer
# What the errors say the pack reads, from the two tables above.
READS = (f"{', '.join(DTYPES[d][0] for d in FLOAT_DTYPES)} and {', '.join(f.label for f in READ_FORMATS)} FLUX.2 "
         "transformers")


@dataclass(frozen=True)
class TransformerGeometry:
    hidden_size: int
    context_in_dim: int
    in_channels: int
    guidance: bool
    double_blocks: int
    single_blocks: int


@dataclass
class LoadedTransformer:
    state_dict: dict[str, torch.Tensor]  # BFL keys; fp8 weights stay fp8 with "<layer>.weight_scale" beside them
    variant: Flux2Variant
    geometry: TransformerGeometry
    layout: str  # "BFL" or "diffusers"


def _count_blocks(keys, prefix: str) -> int:
    return len({k[len(prefix):].split(".", 1)[0] for k in keys if k.startswith(prefix)})


def detect_layout(keys) -> KeyLayout:
    keys = set(keys)
    for layout in LAYOUTS:
        if layout.img_in in keys or layout.txt_in in keys:
            return layout
    sample = ", ".join(sorted(keys)[:5])
    raise UnknownModelError(
        f"This file holds no FLUX.2 transformer: neither img_in.weight (BFL) nor x_embedder.weight (diffusers) is in "
        f"it (first keys: {sample}). Choose a FLUX.2 transformer file or a diffusers FLUX.2 pipeline folder."
    )


def geometry_from_shapes(shapes: Mapping[str, tuple[int, ...]]) -> tuple[TransformerGeometry, KeyLayout]:
    """The transformer's geometry from tensor names and shapes alone (headers or meta tensors)."""
    layout = detect_layout(shapes)
    for key in (layout.img_in, layout.txt_in):
        if key not in shapes:
            raise MissingWeightsError(f"The transformer has no {key}; the file is incomplete. Download it again.")
    if layout.flux2_marker not in shapes:
        raise WrongModelError(
            f"This is not a FLUX.2 transformer: it lacks {layout.flux2_marker} (FLUX.2's shared modulation), so it is "
            f"a FLUX.1 or other Flux-family model ({layout.img_in} {list(shapes[layout.img_in])}, {layout.txt_in} "
            f"{list(shapes[layout.txt_in])}). Load it with ComfyUI's own Load Diffusion Model node."
        )
    flat = [f"{key} {list(shapes[key])}" for key in (layout.img_in, layout.txt_in) if len(shapes[key]) != 2]
    if flat:
        raise UnknownModelError(
            f"The transformer's input projections are not matrices ({', '.join(flat)}); the file is damaged or not a "
            "FLUX.2 transformer. Download it again."
        )
    hidden, in_channels = shapes[layout.img_in]
    txt_hidden, context_in_dim = shapes[layout.txt_in]
    if txt_hidden != hidden:
        raise UnknownModelError(
            f"The transformer's image and text projections disagree: {layout.img_in} {list(shapes[layout.img_in])} "
            f"but {layout.txt_in} {list(shapes[layout.txt_in])}. The file is damaged or not a FLUX.2 transformer."
        )
    geometry = TransformerGeometry(
        hidden_size=hidden,
        context_in_dim=context_in_dim,
        in_channels=in_channels,
        guidance=any(k.startswith(layout.guidance_prefix) for k in shapes),
        double_blocks=_count_blocks(shapes, layout.double_prefix),
        single_blocks=_count_blocks(shapes, layout.single_prefix),
    )
    return geometry, layout


def variant_for_geometry(geometry: TransformerGeometry, layout: KeyLayout) -> Flux2Variant:
    """The known variant with these shapes; anything else fails closed, naming what was found."""
    found = (
        f"{layout.img_in} [{geometry.hidden_size}, {geometry.in_channels}], {layout.txt_in} "
        f"[{geometry.hidden_size}, {geometry.context_in_dim}], {'a' if geometry.guidance else 'no'} guidance embedder, "
        f"{geometry.double_blocks} double and {geometry.single_blocks} single blocks"
    )
    variant = variant_for_transformer(geometry.context_in_dim, geometry.hidden_size, geometry.guidance)
    if variant is None:
        known = "; ".join(
            f"{v.name}: hidden {v.hidden_size}, context {v.context_in_dim}, {'with' if v.guidance else 'no'} guidance"
            for v in known_variants()
        )
        raise UnknownModelError(f"Unknown FLUX.2 transformer geometry: {found}. Known: {known}.")
    if (geometry.double_blocks, geometry.single_blocks) != (variant.double_blocks, variant.single_blocks):
        raise MissingWeightsError(
            f"This looks like {variant.name} ({found}), which has {variant.double_blocks} double and "
            f"{variant.single_blocks} single blocks. The file is incomplete or pruned; download it again."
        )
    return variant


def _diffusers_plan(shapes: Mapping[str, tuple[int, ...]], geometry: TransformerGeometry) -> list[tuple[str, list[str], bool]]:
    """(BFL key, the diffusers tensors it is made of, whether its halves swap) for every tensor, from the
    shapes alone: parts that cannot be concatenated or halved are refused before anything is read."""
    counts = {"double_blocks.": geometry.double_blocks, "single_blocks.": geometry.single_blocks}
    plan, used = [], set()
    for bfl_key, sources, swap_halves in DIFFUSERS_TO_BFL:
        blocks = next((n for prefix, n in counts.items() if bfl_key.startswith(prefix)), None)
        for n in range(blocks) if blocks is not None else (None,):
            names = [s.format(n=n) for s in sources]
            present = [s for s in names if s in shapes]
            if not present and bfl_key.startswith("guidance_in.") and not geometry.guidance:
                continue
            if len(present) != len(names):
                missing = sorted(set(names) - set(present))
                raise MissingWeightsError(f"The diffusers transformer lacks {', '.join(missing)}; the folder is incomplete.")
            parts = [shapes[s] for s in names]
            if any(not shape for shape in parts) or len({shape[1:] for shape in parts}) != 1 or (swap_halves and parts[0][0] % 2):
                shown = ", ".join(f"{s} {list(shape)}" for s, shape in zip(names, parts))
                raise UnknownModelError(
                    f"The diffusers transformer's {shown} cannot make the FLUX.2 tensor {bfl_key.format(n=n)}; the "
                    "folder is damaged or not a FLUX.2 transformer."
                )
            plan.append((bfl_key.format(n=n), names, swap_halves))
            used.update(names)
    _refuse_leftovers(set(shapes) - used, "diffusers")
    return plan


def _diffusers_readers(shapes: Mapping[str, tuple[int, ...]], read: Callable[[str], torch.Tensor],
                       geometry: TransformerGeometry) -> dict[str, tuple[tuple[int, ...], Callable[[], dict]]]:
    """BFL key -> (its shape, a reader of it) for a diffusers state dict: the parts concatenated, the halves
    swapped where the table says."""

    def reader(bfl_key: str, names: list[str], swap_halves: bool) -> Callable[[], dict]:
        def read_one() -> dict[str, torch.Tensor]:
            tensor = torch.cat([read(s) for s in names]) if len(names) > 1 else read(names[0])
            if swap_halves:
                first, second = tensor.chunk(2)
                tensor = torch.cat((second, first))
            return {bfl_key: tensor}

        return read_one

    out = {}
    for bfl_key, names, swap_halves in _diffusers_plan(shapes, geometry):
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


def _refuse_leftovers(leftover: set[str], layout: str) -> None:
    if leftover:
        names = ", ".join(sorted(leftover)[:6])
        raise UnknownModelError(
            f"The {layout} FLUX.2 transformer holds {len(leftover)} tensor(s) the pack does not know ({names}); "
            "it may be a fine-tune with extra layers or a newer format. The pack does not guess what they do."
        )


def _bfl_readers(files: SafetensorsFiles) -> dict[str, tuple[tuple[int, ...], Callable[[], dict]]]:
    """BFL key -> (its shape, a reader of it) for a BFL file, every check made on the headers first: a packed
    format the pack does not read, a packed weight without its scale, an integer weight. A reader gives the
    tensor as stored, packed ones with their companions under the host's suffixes (loaders/quant.py)."""
    packed = {}
    for name, label in quant.labels(files).items():
        found = quant.packed_format(label)
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
        if suffix in quant.SPELLINGS:
            if quant.SPELLINGS[suffix] is not None:
                companions.setdefault(layer, {})[quant.SPELLINGS[suffix]] = name
            continue
        tensors.append(name)
    for f in READ_FORMATS:
        lacking = [k for k, g in packed.items() if g is f and any(c not in companions.get(k.rpartition(".")[0], {}) for c in f.companions)]
        if lacking:
            spellings = " or ".join(f".{s}" for s, host in f.spellings.items() if host in f.companions)
            raise UnsupportedFormatError(
                f"{len(lacking)} {f.label} weight(s) have no scale beside them (e.g. {lacking[0]}); the pack reads "
                f"them with {spellings} only, since unscaled weights from an unknown writer may be off by a factor."
            )
    stored = {name: torch_dtype(files.infos[name].dtype) for name in [*tensors, *(n for c in companions.values() for n in c.values())]}
    odd = [name for name, dtype in stored.items() if dtype is not None and not dtype.is_floating_point]
    if odd:
        raise UnsupportedFormatError(
            f"The transformer holds integer tensors (e.g. {odd[0]}, {stored[odd[0]]}); the pack reads {READS}."
        )

    def reader(name: str) -> Callable[[], dict]:
        def read_one() -> dict[str, torch.Tensor]:
            layer = name.rpartition(".")[0]
            out = {name: files.read(name)}
            if name.endswith(".weight"):
                for host, stored_name in companions.get(layer, {}).items():
                    out[f"{layer}.{host}"] = files.read(stored_name).to(torch.float32)
            return out

        return read_one

    return {name: (files.infos[name].shape, reader(name)) for name in tensors}


def transformer_files(path: str | Path) -> list[Path]:
    """The safetensors files of a transformer: a single file, a diffusers transformer folder (single or
    sharded with an index), or a pipeline folder's transformer/."""
    return part_files(
        path, "transformer", "Choose a .safetensors FLUX.2 transformer file, a diffusers transformer folder or a "
        "pipeline folder (GGUF files have their own node)."
    )


def identify_transformer(path: str | Path) -> tuple[Flux2Variant, TransformerGeometry, KeyLayout]:
    """The variant of a transformer on disk from its safetensors headers only."""
    files = SafetensorsFiles([str(p) for p in transformer_files(path)])
    shapes = {name: info.shape for name, info in files.infos.items()}
    geometry, layout = geometry_from_shapes(shapes)
    return variant_for_geometry(geometry, layout), geometry, layout


@dataclass
class TransformerPlan:
    """A transformer on disk, from its headers alone: every check a load makes is made here, before any weight
    is read; then each tensor is read on its own (`tensors[key][1]()`), in BFL keys."""

    variant: Flux2Variant
    geometry: TransformerGeometry
    layout: KeyLayout
    tensors: dict[str, tuple[tuple[int, ...], Callable[[], dict]]]  # BFL key -> (shape, reader of it and its companions)


def plan_transformer(path: str | Path) -> TransformerPlan:
    """A FLUX.2 transformer's plan, after its headers named a known variant."""
    files = SafetensorsFiles([str(p) for p in transformer_files(path)])
    shapes = {name: info.shape for name, info in files.infos.items()}
    geometry, layout = geometry_from_shapes(shapes)
    variant = variant_for_geometry(geometry, layout)
    if layout is DIFFUSERS:
        if any(info.dtype not in FLOAT_DTYPES for info in files.infos.values()):
            raise UnsupportedFormatError(
                "This diffusers-layout transformer holds quantized weights; the pack reads diffusers transformers in "
                f"{', '.join(DTYPES[d][0] for d in FLOAT_DTYPES)}, and "
                f"{', '.join(f.label for f in READ_FORMATS)} as a BFL single file."
            )
        tensors = _diffusers_readers(shapes, files.read, geometry)
    else:
        tensors = _bfl_readers(files)
    return TransformerPlan(variant, geometry, layout, tensors)


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
