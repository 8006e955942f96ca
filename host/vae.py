"""The FLUX.2 VAE as the host's VAE object. The host reads diffusers and BFL keys alike and recognises
FLUX.2 by its latent batch-norm statistics."""

from __future__ import annotations

from pathlib import Path

from ..errors import HostError, MissingWeightsError
from ..loaders.models.vae import LATENT_CHANNELS, load_vae_state_dict
from . import compat, ensure_comfy

PATCH = 2  # the host packs 2x2 latent pixels into channels for FLUX.2
MISSING_VAE_KEYS = "Missing VAE keys"  # what the host logs, with the list, after its own key conversion
TRAINING_COUNTER = "num_batches_tracked"  # a batch norm's training step count; files may leave it out


def load_vae(path: str | Path):
    """The FLUX.2 VAE of a pipeline folder ([dev] or Klein), a vae/ folder or an ae.safetensors file, as the
    host's VAE, which the host's device nodes can load again from the same path."""
    ensure_comfy()
    import comfy.sd

    with compat.load_progress():
        state_dict = load_vae_state_dict(path)
    with compat.keys_the_host_logs_missing(MISSING_VAE_KEYS) as missing:
        vae = comfy.sd.VAE(sd=state_dict)
    vae.throw_exception_if_invalid()
    if vae.latent_channels != LATENT_CHANNELS * PATCH * PATCH:
        raise HostError(
            f"ComfyUI built a VAE with {vae.latent_channels} latent channels from {path}, not the FLUX.2 VAE's "
            f"{LATENT_CHANNELS * PATCH * PATCH}; this ComfyUI may predate FLUX.2 (0.3.75)."
        )
    # The host goes on without the weights it did not find; the pack stops instead of decoding with garbage.
    missing = [k for k in missing if not k.endswith(TRAINING_COUNTER)]
    if missing:
        raise MissingWeightsError(
            f"The FLUX.2 VAE at {path} lacks {len(missing)} tensor(s) ComfyUI's VAE needs ({', '.join(missing[:5])}); "
            "the file is incomplete. Download it again."
        )
    compat.set_reload(vae.patcher, load_vae_patcher, (str(path),))
    return vae


def load_vae_patcher(path: str, disable_dynamic: bool = False):
    """The reload factory the device nodes call (the host's VAE picks its patcher class itself)."""
    return load_vae(path).patcher
