"""FLUX.2 transformer GGUFs as host MODELs, their weights left packed (host/ops.py dequantizes them per
layer), and the pack's .gguf view of the host's diffusion model folders."""

from __future__ import annotations

import torch

from . import ensure_comfy

ensure_comfy()

from ..loaders.gguf_transformer import load_gguf_transformer  # noqa: E402
from .model import build_model  # noqa: E402

# Pack-private folder_paths key: the host's diffusion_models folders (models/unet, models/diffusion_models
# and any extra paths), listing .gguf files only.
GGUF_FOLDER = "flux2dev_gguf_diffusion_models"
GGUF_EXTENSIONS = {".gguf"}
DEQUANT_DTYPES = {"default": None, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
PATCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def register_gguf_folder() -> str:
    """Register (or refresh) the pack's .gguf view of the diffusion model folders; returns its key. The
    folder list is shared, so paths added later (extra_model_paths.yaml) show up here too."""
    import folder_paths

    paths = folder_paths.folder_names_and_paths["diffusion_models"][0]
    folder_paths.folder_names_and_paths[GGUF_FOLDER] = (paths, set(GGUF_EXTENSIONS))
    return GGUF_FOLDER


def load_gguf_model(path, dequant_dtype: torch.dtype | None = None, patch_dtype: torch.dtype = torch.float32, dtype: torch.dtype | None = None):
    """The FLUX.2 transformer GGUF at `path` as a host MODEL whose weights stay packed."""
    return build_model(load_gguf_transformer(path), dtype=dtype, dequant_dtype=dequant_dtype, patch_dtype=patch_dtype)
