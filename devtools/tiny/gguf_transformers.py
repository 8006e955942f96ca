"""Tiny FLUX.2 transformers as GGUF files, laid out as city96's converter lays out FLUX GGUFs: BFL key
names, general.architecture "flux", 1-D tensors in F32, and weights whose rows do not fill whole blocks
of the chosen type in F16.

Types gguf-py can quantize (F16, Q8_0, Q4_0) hold the tiny model's own weights. K-quants (which gguf-py
only dequantizes) hold random blocks with finite fp16 scale fields, so for them the reference is the
file's dequantized values, not the original model."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter
from gguf.quants import quantize

from ...loaders.models.transformer import diffusers_to_bfl
from .geometry import TINY_VARIANTS
from .gguf_blocks import random_blocks, write_and_close
from .transformers import make_transformer

Q = GGMLQuantizationType
ARCHITECTURE = "flux"
SEED = 2100
# The size of the random K-quant scales: weights near those of an initialised layer.
K_QUANT_MAGNITUDES = {Q.Q4_K: 2e-4, Q.Q5_K: 1e-4, Q.Q6_K: 5e-5}
# (variant key, GGUF types of the weights): one file each.
FILES = (
    ("dev", Q.F16),
    ("dev", Q.Q8_0),
    ("dev", Q.Q4_0),
    ("dev", Q.Q4_K),
    ("dev", Q.Q5_K),
    ("dev", Q.Q6_K),
    ("klein-4b", Q.Q8_0),
)


def gguf_tensors(state_dict: dict[str, torch.Tensor], qtype: GGMLQuantizationType,
                 seed: int) -> dict[str, tuple[np.ndarray, GGMLQuantizationType]]:
    """name -> (array to write, its GGUF type), as a FLUX GGUF converter would choose them."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, tensor in state_dict.items():
        values = tensor.float().numpy()
        if values.ndim < 2:
            out[name] = (values, Q.F32)
        elif values.shape[-1] % GGML_QUANT_SIZES[qtype][0]:
            out[name] = (values.astype(np.float16), Q.F16)
        elif qtype in K_QUANT_MAGNITUDES:
            out[name] = (random_blocks(qtype, values.shape, rng, K_QUANT_MAGNITUDES[qtype]), qtype)
        elif qtype == Q.F16:
            out[name] = (values.astype(np.float16), Q.F16)
        else:
            out[name] = (quantize(values, qtype), qtype)
    return out


def write_gguf(path: str | Path, tensors: dict[str, tuple[np.ndarray, GGMLQuantizationType]],
               architecture: str | None = ARCHITECTURE) -> None:
    """Write `tensors` (from gguf_tensors) as a GGUF file; architecture None leaves general.architecture out."""
    writer = GGUFWriter(str(path), architecture or "")
    if architecture is None:
        for kv in writer.kv_data:
            kv.pop("general.architecture", None)
    for name, (array, qtype) in tensors.items():
        writer.add_tensor(name, array, raw_dtype=qtype)
    write_and_close(writer)


def tiny_bfl(variant_key: str) -> dict[str, torch.Tensor]:
    variant = next(v for v in TINY_VARIANTS if v.key == variant_key)
    return diffusers_to_bfl(make_transformer(variant).state_dict())


def write_gguf_transformers(root: str | Path) -> list[dict]:
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    entries, models = [], {}
    for i, (variant_key, qtype) in enumerate(FILES):
        if variant_key not in models:
            models[variant_key] = tiny_bfl(variant_key)
        path = f"flux2-{variant_key}-tiny-{qtype.name}.gguf"
        write_gguf(root / path, gguf_tensors(models[variant_key], qtype, SEED + i))
        entries.append({"path": path, "kind": "transformer", "layout": "gguf", "variant": variant_key,
                        "format": f"gguf-{qtype.name}"})
    return entries
