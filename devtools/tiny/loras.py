"""A tiny Turbo LoRA for the tiny [dev] transformer, as the official templates and the pack's examples switch
on: BFL keys (`diffusion_model.<layer>.lora_A.weight` / `.lora_B.weight`), rank 4, on every linear layer of the
double and single blocks, with small seeded values so that it changes the image without swamping it."""

from __future__ import annotations

from pathlib import Path

import torch

from ...loaders.models.transformer import diffusers_to_bfl
from .geometry import TINY_VARIANTS
from .transformers import make_transformer

TURBO_LORA = "flux2-dev-tiny-turbo-lora.safetensors"
SEED = 808
RANK = 4
SCALE = 0.05
BLOCKS = ("double_blocks.", "single_blocks.")


def turbo_lora() -> dict[str, torch.Tensor]:
    """The LoRA's tensors, for each 2-D block weight of the tiny [dev] transformer, in the order of its keys."""
    dev = next(v for v in TINY_VARIANTS if v.key == "dev")
    weights = diffusers_to_bfl(make_transformer(dev).state_dict())
    g = torch.Generator().manual_seed(SEED)
    lora = {}
    for key, w in weights.items():
        if w.ndim == 2 and key.startswith(BLOCKS) and key.endswith(".weight"):
            layer = "diffusion_model." + key.removesuffix(".weight")
            lora[f"{layer}.lora_A.weight"] = (torch.randn(RANK, w.shape[1], generator=g) * SCALE).bfloat16()
            lora[f"{layer}.lora_B.weight"] = (torch.randn(w.shape[0], RANK, generator=g) * SCALE).bfloat16()
    return lora


def write_loras(root: str | Path) -> list[dict]:
    """The LoRA file; no manifest entry, since the manifest lists what `flux2dev inspect` reads as a model."""
    from safetensors.torch import save_file

    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    save_file(turbo_lora(), str(root / TURBO_LORA))
    return []
