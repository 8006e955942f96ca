"""FLUX.2 transformers from GGUF files (city96-style conversions: BFL key names, general.architecture
"flux", "pig" or none), read once over a memory map and left packed.

Quantized weights stay as their raw GGUF blocks (zero-copy uint8 views of the file) with their GGUF type
beside them as "<layer>.weight_gguf_type" (loaders.quant.from_gguf, shared with the encoder loader), to be
dequantized per layer at forward time by the host's packed ops; float tensors are views of the file as
they are. The variant comes from the tensor shapes, as for safetensors files.
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass, field

from ...errors import UnknownModelError, UnsupportedFormatError, WrongModelError
from ..formats import progress
from ..formats.gguf_file import GGUFFile, open_gguf
from ..formats.quant import from_gguf, gguf_label
from .kinds import GGUF_ARCHITECTURES, gguf_architectures, gguf_kind
from .node_titles import title
from .transformer import BFL, LoadedTransformer, geometry_from_shapes, variant_for_geometry

# Key prefixes some converters keep from the checkpoint they started from.
KEY_PREFIXES = ("model.diffusion_model.", "diffusion_model.")


@dataclass
class LoadedGGUFTransformer(LoadedTransformer):
    """A LoadedTransformer whose state dict holds raw GGUF blocks (uint8 rows) beside their GGUF types."""

    path: str = ""
    formats: dict[str, int] = field(default_factory=dict)  # "gguf-<type>" -> how many tensors the file stores so


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


def load_gguf_transformer(path: str | os.PathLike) -> LoadedGGUFTransformer:
    """Read a FLUX.2 transformer GGUF (its header parsed once) into BFL keys, weights left packed."""
    gfile = open_gguf(path)
    state_dict = {}
    try:
        check_architecture(gfile)
        names = _strip_prefix(gfile.tensors)
        shapes = {key: gfile.tensors[name].shape for key, name in names.items()}
        geometry, layout = geometry_from_shapes(shapes)
        if layout is not BFL:
            raise UnsupportedFormatError(
                f"{os.path.basename(gfile.path)} keeps its tensors under diffusers names; FLUX.2 GGUFs use BFL names "
                "(img_in, double_blocks, ...). Convert it with a FLUX.2-aware GGUF converter."
            )
        variant = variant_for_geometry(geometry, layout)
        for key, name in progress.tracked(names.items()):
            state_dict.update(from_gguf(key, gfile.tensors[name]))
    except BaseException:
        # A load that fails leaves nothing mapped, even while the error (and its frames) are kept.
        state_dict.clear()
        gfile.close()
        raise
    formats = Counter(gguf_label(t.qtype) for t in gfile.tensors.values())
    return LoadedGGUFTransformer(state_dict, variant, geometry, layout.name, path=gfile.path, formats=dict(formats))
