"""The FLUX.2 VAE as the host's VAE object. The host reads diffusers and BFL keys alike and recognises
FLUX.2 by its latent batch-norm statistics."""

from __future__ import annotations

from pathlib import Path

from . import ensure_comfy

ensure_comfy()

import comfy.sd  # noqa: E402

from ..errors import HostError  # noqa: E402
from ..loaders.vae import LATENT_CHANNELS, load_vae_state_dict  # noqa: E402

PATCH = 2  # the host packs 2x2 latent pixels into channels for FLUX.2


def load_vae(path: str | Path) -> comfy.sd.VAE:
    """The FLUX.2 VAE of a pipeline folder ([dev] or Klein), a vae/ folder or an ae.safetensors file."""
    vae = comfy.sd.VAE(sd=load_vae_state_dict(path))
    vae.throw_exception_if_invalid()
    if vae.latent_channels != LATENT_CHANNELS * PATCH * PATCH:
        raise HostError(
            f"ComfyUI built a VAE with {vae.latent_channels} latent channels from {path}, not the FLUX.2 VAE's "
            f"{LATENT_CHANNELS * PATCH * PATCH}; this ComfyUI may predate FLUX.2 (0.3.75)."
        )
    return vae
