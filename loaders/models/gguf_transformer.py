"""FLUX.2 transformers from GGUF files (city96-style conversions: BFL key names, general.architecture
"flux", "pig" or none), read once over a memory map and left packed.

Quantized weights stay as their raw GGUF blocks (zero-copy uint8 views of the file) with their GGUF type
beside them as "<layer>.weight_gguf_type" (loaders.formats.packed_dequant.from_gguf, shared with the encoder
loader), to be dequantized per layer at forward time by the host's packed ops; float tensors are views of the
file as they are. The variant comes from the tensor shapes, as for safetensors files.
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass, field

from ..formats.gguf_file import open_gguf
from ..formats.packed_dequant import from_gguf
from ..formats.packing import gguf_label
from ..formats.validate import released_on_error
from . import progress
from .transformer import LoadedTransformer
from .transformer_layout import BFL, identify_gguf_transformer


@dataclass
class LoadedGGUFTransformer(LoadedTransformer):
    """A LoadedTransformer whose state dict holds raw GGUF blocks (uint8 rows) beside their GGUF types."""

    path: str = ""
    formats: dict[str, int] = field(default_factory=dict)  # "gguf-<type>" -> how many tensors the file stores so


@released_on_error
def load_gguf_transformer(path: str | os.PathLike) -> LoadedGGUFTransformer:
    """Read a FLUX.2 transformer GGUF (its header parsed once) into BFL keys, weights left packed."""
    gfile = open_gguf(path)
    variant, geometry, names = identify_gguf_transformer(gfile)
    state_dict = {}
    for key, name in progress.tracked(names.items()):
        state_dict.update(from_gguf(key, gfile.tensors[name]))
    formats = Counter(gguf_label(t.qtype) for t in gfile.tensors.values())
    return LoadedGGUFTransformer(state_dict, variant, geometry, BFL.name, path=gfile.path, formats=dict(formats))
