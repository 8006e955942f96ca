"""The layouts a FLUX.2 transformer is stored in (BFL, diffusers) and what their headers tell: the layout, the
geometry, the variant, and each BFL tensor's shape. Plain shape logic, without torch, so that a command can
check a transformer (and a LoRA against it) before torch is imported."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from ...errors import MissingWeightsError, UnknownModelError, UnsupportedFormatError, WrongModelError
from ..formats.files import part_files
from ..formats.gguf_file import GGUFFile
from ..formats.packing import logical_shapes
from ..formats.safetensors_file import SafetensorsFiles
from .kinds import GGUF_ARCHITECTURES, gguf_architectures, gguf_kind
from .node_titles import title
from .variants import Flux2Variant, known_variants, variant_for_transformer

# Key prefixes some converters keep from the checkpoint they started from.
KEY_PREFIXES = ("model.diffusion_model.", "diffusion_model.")

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


# Every tensor of a FLUX.2 transformer in BFL keys and its shape in the geometry's widths: h the model's, c the text
# conditioning's, i the latent channels, d a head's, t the timestep embedding's (256); "6h" is six times h. "{n}" is
# a double or single block's index. The MLPs are SwiGLU of 3h, fused into linear1 and linear2 in the single blocks.
TIMESTEP_WIDTH = 256
BFL_TENSORS = (
    ("img_in.weight", ("h", "i")),
    ("txt_in.weight", ("h", "c")),
    ("time_in.in_layer.weight", ("h", "t")),
    ("time_in.out_layer.weight", ("h", "h")),
    ("guidance_in.in_layer.weight", ("h", "t")),  # with guidance only ([dev])
    ("guidance_in.out_layer.weight", ("h", "h")),
    ("double_stream_modulation_img.lin.weight", ("6h", "h")),
    ("double_stream_modulation_txt.lin.weight", ("6h", "h")),
    ("single_stream_modulation.lin.weight", ("3h", "h")),
    *((f"double_blocks.{{n}}.{stream}_{part}", shape) for stream in ("img", "txt") for part, shape in (
        ("attn.qkv.weight", ("3h", "h")),
        ("attn.norm.query_norm.scale", ("d",)),
        ("attn.norm.key_norm.scale", ("d",)),
        ("attn.proj.weight", ("h", "h")),
        ("mlp.0.weight", ("6h", "h")),
        ("mlp.2.weight", ("h", "3h")),
    )),
    ("single_blocks.{n}.linear1.weight", ("9h", "h")),
    ("single_blocks.{n}.linear2.weight", ("h", "4h")),
    ("single_blocks.{n}.norm.query_norm.scale", ("d",)),
    ("single_blocks.{n}.norm.key_norm.scale", ("d",)),
    ("final_layer.linear.weight", ("i", "h")),
    ("final_layer.adaLN_modulation.1.weight", ("2h", "h")),
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

@dataclass(frozen=True)
class TransformerGeometry:
    hidden_size: int
    context_in_dim: int
    in_channels: int
    guidance: bool
    double_blocks: int
    single_blocks: int



def bfl_tensor_shapes(geometry: TransformerGeometry, variant: Flux2Variant) -> dict[str, tuple[int, ...]]:
    """Every BFL tensor a transformer of this geometry and variant has, and its shape (BFL_TENSORS)."""
    widths = {"h": geometry.hidden_size, "c": geometry.context_in_dim, "i": geometry.in_channels,
              "d": geometry.hidden_size // variant.num_heads, "t": TIMESTEP_WIDTH}
    blocks = {"double_blocks.": geometry.double_blocks, "single_blocks.": geometry.single_blocks}
    out = {}
    for key, dims in BFL_TENSORS:
        if key.startswith("guidance_in.") and not geometry.guidance:
            continue
        shape = tuple(int(dim[:-1] or 1) * widths[dim[-1]] for dim in dims)
        count = next((n for prefix, n in blocks.items() if key.startswith(prefix)), None)
        out.update({key.format(n=n): shape for n in range(count)} if count is not None else {key: shape})
    return out


def check_tensor_shapes(shapes: Mapping[str, tuple[int, ...]], geometry: TransformerGeometry,
                        variant: Flux2Variant) -> None:
    """Refuse, before anything is read, a transformer (BFL keys) with a tensor missing, one too many, or one whose
    shape is not its variant's: what a load would refuse, or what would only break later in ComfyUI."""
    expected = bfl_tensor_shapes(geometry, variant)
    missing = sorted(expected.keys() - shapes.keys())
    if missing:
        raise MissingWeightsError(
            f"The {variant.name} transformer lacks {len(missing)} tensor(s) ({', '.join(missing[:4])}"
            f"{' ...' if len(missing) > 4 else ''}); the file is incomplete. Download it again."
        )
    wrong = [f"{key} {list(shapes[key])} (expected {list(shape)})" for key, shape in sorted(expected.items())
             if tuple(shapes[key]) != shape]
    if wrong:
        raise UnknownModelError(
            f"The {variant.name} transformer has {len(wrong)} tensor(s) of the wrong shape: {'; '.join(wrong[:3])}"
            f"{' ...' if len(wrong) > 3 else ''}. The file is damaged or not a FLUX.2 transformer; download it again."
        )
    _refuse_leftovers(shapes.keys() - expected.keys(), "BFL")


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
    variant = variant_for_transformer(geometry.context_in_dim, geometry.hidden_size, geometry.guidance,
                                      (geometry.double_blocks, geometry.single_blocks))
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


def diffusers_plan(shapes: Mapping[str, tuple[int, ...]],
                   geometry: TransformerGeometry) -> list[tuple[str, list[str], bool]]:
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
                raise MissingWeightsError(f"The diffusers transformer lacks {', '.join(missing)}; the folder is "
                                          "incomplete.")
            parts = [shapes[s] for s in names]
            if any(not shape for shape in parts) or len({shape[1:] for shape in parts}) != 1 \
                    or (swap_halves and parts[0][0] % 2):
                shown = ", ".join(f"{s} {list(shape)}" for s, shape in zip(names, parts))
                raise UnknownModelError(
                    f"The diffusers transformer's {shown} cannot make the FLUX.2 tensor {bfl_key.format(n=n)}; the "
                    "folder is damaged or not a FLUX.2 transformer."
                )
            plan.append((bfl_key.format(n=n), names, swap_halves))
            used.update(names)
    _refuse_leftovers(set(shapes) - used, "diffusers")
    return plan


def _refuse_leftovers(leftover: set[str], layout: str) -> None:
    if leftover:
        names = ", ".join(sorted(leftover)[:6])
        raise UnknownModelError(
            f"The {layout} FLUX.2 transformer holds {len(leftover)} tensor(s) the pack does not know ({names}); "
            "it may be a fine-tune with extra layers or a newer format. The pack does not guess what they do."
        )


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
    geometry, layout = geometry_from_shapes(logical_shapes(files))
    return variant_for_geometry(geometry, layout), geometry, layout


def bfl_shapes(path: str | Path) -> tuple[Flux2Variant, dict[str, tuple[int, ...]]]:
    """The variant of the transformer at `path` and the shape of each of its weights in BFL keys, from its
    headers alone (a diffusers transformer's parts concatenated as the load does)."""
    files = SafetensorsFiles([str(p) for p in transformer_files(path)])
    shapes = logical_shapes(files)
    geometry, layout = geometry_from_shapes(shapes)
    variant = variant_for_geometry(geometry, layout)
    if layout is BFL:
        return variant, shapes
    return variant, {key: (sum(shapes[s][0] for s in names), *shapes[names[0]][1:])
                     for key, names, _ in diffusers_plan(shapes, geometry)}


def check_architecture(gfile: GGUFFile) -> None:
    arch = gfile.architecture
    kind = gguf_kind(arch)
    if kind == "transformer":
        return
    name = os.path.basename(gfile.path)
    if kind is not None:
        raise WrongModelError(
            f"{name} is {GGUF_ARCHITECTURES[arch][1]} (general.architecture {arch!r}), not a FLUX.2 transformer. "
            f"Choose a FLUX.2 transformer GGUF here; text encoders go into {title('Flux2DevEncoderLoader')}."
        )
    known = ", ".join(repr(a) if a else "none" for a in gguf_architectures("transformer"))
    raise UnknownModelError(
        f"{name} has general.architecture {arch!r}; FLUX.2 transformer GGUFs have {known}. "
        "The pack does not guess what this file is; choose a FLUX.2 transformer GGUF."
    )


def _strip_prefix(names) -> dict[str, str]:
    """BFL key -> GGUF tensor name."""
    out = {}
    for name in names:
        key = next((name[len(p):] for p in KEY_PREFIXES if name.startswith(p)), name)
        out[key] = name
    return out


def identify_gguf_transformer(gfile: GGUFFile) -> tuple[Flux2Variant, TransformerGeometry, dict[str, str]]:
    """The variant and geometry of a FLUX.2 transformer GGUF from its header, and its BFL key -> tensor name."""
    check_architecture(gfile)
    names = _strip_prefix(gfile.tensors)
    geometry, layout = geometry_from_shapes({key: gfile.tensors[name].shape for key, name in names.items()})
    if layout is not BFL:
        raise UnsupportedFormatError(
            f"{os.path.basename(gfile.path)} keeps its tensors under diffusers names; FLUX.2 GGUFs use BFL names "
            "(img_in, double_blocks, ...). Convert it with a FLUX.2-aware GGUF converter."
        )
    return variant_for_geometry(geometry, layout), geometry, names
