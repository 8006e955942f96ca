"""What the LoRA tests share: the tiny FLUX.2 [dev] MODELs a LoRA is applied to (dense, safetensors bf16, scaled fp8,
GGUF Q8_0 and Q4_K, each with the float32 weights it computes with), where each diffusers weight lies in BFL's, and
a forward pass of a patched MODEL."""

from __future__ import annotations

import torch

from helpers import dense_model, flux2_forward, fp8_weights, gguf_weights

CPU = torch.device("cpu")
TRANSFORMER = "diffusion_models/flux2-dev-tiny.safetensors"
FP8 = "diffusion_models/flux2-dev-tiny-fp8-weight_scale.safetensors"
PACKED = ("safetensors", "fp8", "Q8_0", "Q4_K")


def bfl_weights(path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {k: v.float() for k, v in load_file(str(path)).items()}


def diffusers_places(bfl: dict[str, torch.Tensor]) -> dict:
    """Each diffusers weight -> (BFL key, the flat positions in it its values come from), traced through diffusers'
    own converter on a BFL state dict whose every value is its own global position."""
    from diffusers.loaders.single_file_utils import convert_flux2_transformer_checkpoint_to_diffusers

    probe, owner, start = {}, {}, 0
    for key, t in bfl.items():
        probe[key] = torch.arange(start, start + t.numel(), dtype=torch.float64).reshape(t.shape)
        owner[key] = start
        start += t.numel()
    starts = sorted((s, k) for k, s in owner.items())
    out = {}
    for name, values in convert_flux2_transformer_checkpoint_to_diffusers(dict(probe)).items():
        flat = values.reshape(-1).long()
        key = next(k for s, k in reversed(starts) if s <= flat[0].item())
        out[name.removesuffix(".weight")] = (key, flat - owner[key])
    return out


def lora_models(tiny_root, tiny_part) -> dict:
    """name -> (a FLUX.2 [dev] MODEL, the float32 BFL weights it computes with)."""
    from comfyui_flux2dev.host.model import load_gguf_model, load_model

    root, entries = tiny_part("unet")
    ggufs = {e["format"].removeprefix("gguf-"): root / e["path"] for e in entries if e["variant"] == "dev"}
    bfl = bfl_weights(tiny_root / TRANSFORMER)
    return {
        "dense": (dense_model(bfl), bfl),
        "safetensors": (load_model(str(tiny_root / TRANSFORMER), dtype=torch.float32), bfl),
        "fp8": (load_model(str(tiny_root / FP8), dtype=torch.float32), fp8_weights(tiny_root / FP8)),
        **{fmt: (load_gguf_model(str(ggufs[fmt]), dtype=torch.float32), gguf_weights(ggufs[fmt]))
           for fmt in ("Q8_0", "Q4_K")},
    }


def forward(patcher) -> torch.Tensor:
    patcher.patch_model(device_to=CPU)
    try:
        with torch.no_grad():
            return flux2_forward(patcher, CPU)
    finally:
        patcher.unpatch_model(device_to=CPU)


def patched_weights(patcher) -> dict[str, torch.Tensor]:
    """The float32 BFL weights of a dense MODEL as its patches make them (0.33 names the norms' scales .weight)."""
    patcher.patch_model(device_to=CPU)
    try:
        return {k.removesuffix(".weight") + ".scale" if "norm" in k and k.endswith(".weight") else k: v.clone()
                for k, v in patcher.model.diffusion_model.state_dict().items()}
    finally:
        patcher.unpatch_model(device_to=CPU)


def save(tensors: dict, path) -> str:
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path))
    return str(path)


def close(got: torch.Tensor, want: torch.Tensor, rtol: float = 1e-5) -> bool:
    """Within `rtol` of the reference's largest value, everywhere."""
    return (got - want).abs().max().item() <= rtol * want.abs().max().item()
