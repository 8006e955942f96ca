"""Tiny FLUX.2 transformers, one per TINY_VARIANTS row, made by diffusers' Flux2Transformer2DModel.

Each is written as a BFL single file (keys through the pack's diffusers -> BFL table), as a sharded
diffusers transformer folder, and the [dev] one also as scaled fp8 in both scale spellings."""

from __future__ import annotations

from pathlib import Path

import torch

from ...loaders.models.transformer import diffusers_to_bfl
from ...loaders.models.variants import Flux2Variant
from .geometry import TINY_VARIANTS

SEED = 2000
SHARD_SIZE = "2MB"  # small enough that every tiny diffusers transformer is sharded with an index
FP8_MAX = 448.0  # largest float8_e4m3fn value
# The two spellings of the scaled-fp8 companions: (weight scale, input scale).
FP8_SPELLINGS = {"weight_scale": ("weight_scale", "input_scale"), "scale_weight": ("scale_weight", "scale_input")}
FP8_VARIANT = "dev"


def diffusers_config(variant: Flux2Variant) -> dict:
    return {
        "num_layers": variant.double_blocks,
        "num_single_layers": variant.single_blocks,
        "attention_head_dim": variant.hidden_size // variant.num_heads,
        "num_attention_heads": variant.num_heads,
        "joint_attention_dim": variant.context_in_dim,
        "guidance_embeds": variant.guidance,
    }


def make_transformer(variant: Flux2Variant):
    """A seeded random diffusers Flux2Transformer2DModel of this geometry (float32). Norm scales are
    random too, so a query/key norm mix-up shows in the output."""
    from diffusers import Flux2Transformer2DModel

    with torch.random.fork_rng():
        torch.manual_seed(SEED + TINY_VARIANTS.index(variant))
        model = Flux2Transformer2DModel(**diffusers_config(variant))
        with torch.no_grad():
            for p in model.parameters():
                if p.ndim == 1:
                    p.uniform_(0.5, 1.5)
    return model.eval()


def scaled_fp8(state_dict: dict[str, torch.Tensor], spelling: str) -> dict[str, torch.Tensor]:
    """Block weights as float8_e4m3fn with a per-tensor (double blocks) or per-output-channel (single blocks)
    scale, named in `spelling`; the rest stays as it is, as in the fp8 files people share."""
    weight_scale, input_scale = FP8_SPELLINGS[spelling]
    out = {"scaled_fp8": torch.zeros(0, dtype=torch.float8_e4m3fn)}
    for key, w in state_dict.items():
        layer = key.removesuffix(".weight")
        if w.ndim != 2 or not key.startswith(("double_blocks.", "single_blocks.")):
            out[key] = w
            continue
        w = w.float()
        amax = w.abs().amax(dim=1, keepdim=True) if key.startswith("single_blocks.") else w.abs().amax()
        scale = amax.clamp(min=1e-12) / FP8_MAX
        out[key] = (w / scale).to(torch.float8_e4m3fn)
        out[f"{layer}.{weight_scale}"] = scale.reshape(-1) if scale.ndim else scale
        out[f"{layer}.{input_scale}"] = torch.ones((), dtype=torch.float32)
    return out


def write_transformers(root: str | Path) -> list[dict]:
    from safetensors.torch import save_file

    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    entries = []
    for variant in TINY_VARIANTS:
        model = make_transformer(variant).bfloat16()
        bfl = {k: v.contiguous() for k, v in diffusers_to_bfl(model.state_dict()).items()}
        name = f"flux2-{variant.key}-tiny"
        save_file(bfl, str(root / f"{name}.safetensors"))
        entries.append(_entry(f"{name}.safetensors", "BFL", variant.key, "bf16"))
        model.save_pretrained(str(root / f"{name}-diffusers"), max_shard_size=SHARD_SIZE)
        entries.append(_entry(f"{name}-diffusers", "diffusers", variant.key, "bf16"))
        if variant.key == FP8_VARIANT:
            for spelling in FP8_SPELLINGS:
                path = f"{name}-fp8-{spelling}.safetensors"
                save_file(scaled_fp8(bfl, spelling), str(root / path))
                entries.append(_entry(path, "BFL", variant.key, "fp8-scaled"))
    return entries


def _entry(path: str, layout: str, variant: str, fmt: str) -> dict:
    return {"path": path, "kind": "transformer", "layout": layout, "variant": variant, "format": fmt}
