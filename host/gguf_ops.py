"""FLUX.2 transformer GGUFs as host MODELs, their weights left packed (host/ops.py dequantizes them per
layer)."""

from __future__ import annotations

import torch

from ..loaders.gguf_transformer import load_gguf_transformer
from . import compat
from .model import build_model

DEQUANT_DTYPES = {"default": None, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
PATCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_gguf_model(path, dequant_dtype: torch.dtype | None = None, patch_dtype: torch.dtype = torch.float32,
                    dtype: torch.dtype | None = None, disable_dynamic: bool = False):
    """The FLUX.2 transformer GGUF at `path` as a host MODEL whose weights stay packed, which the host's device
    nodes can load again from the same file."""
    with compat.load_progress():
        loaded = load_gguf_transformer(path)
    patcher = build_model(loaded, dtype=dtype, dequant_dtype=dequant_dtype,
                          patch_dtype=patch_dtype, disable_dynamic=disable_dynamic)
    compat.set_reload(patcher, load_gguf_model, (str(path), dequant_dtype, patch_dtype, dtype))
    return patcher
