"""The FLUX.2 VAE from disk: from any FLUX.2 pipeline folder ([dev] and Klein share one VAE), a diffusers
vae/ folder, or a single ae.safetensors (BFL's full_encoder_small_decoder.safetensors among them: the same encoder,
a narrower decoder). The host reads both key layouts, so the weights go to it as stored; this module only finds
them and checks from the header that they are a whole FLUX.2 VAE."""

from __future__ import annotations

from pathlib import Path

import torch

from ...errors import UnknownModelError, WrongModelError
from ..formats.files import part_files
from ..formats.safetensors_file import SafetensorsFiles
from . import progress

LATENT_CHANNELS = 32  # AutoencoderKLFlux2; the transformer sees them 2x2-patchified (128)
BATCH_NORM_KEY = "bn.running_mean"  # the latent batch-norm statistics only the FLUX.2 VAE has
DECODER_IN_KEY = "decoder.conv_in.weight"  # [channels, latent channels, 3, 3] in both layouts
BARE_DECODER_IN_KEY = "conv_in.weight"  # a decoder saved alone; an encoder's takes 3 (RGB) channels, not latents
SMALL_DECODER_FILE = "full_encoder_small_decoder.safetensors"
SMALL_DECODER_REPOSITORY = "https://huggingface.co/black-forest-labs/FLUX.2-small-decoder"


def vae_files(path: str | Path) -> list[Path]:
    return part_files(path, "vae", "Choose a FLUX.2 pipeline folder, its vae/ folder or ae.safetensors.")


def check_flux2_vae(shapes: dict[str, tuple[int, ...]], where: str) -> None:
    """Fail unless the shapes are those of a FLUX.2 VAE, naming what they are instead."""
    if DECODER_IN_KEY not in shapes and shapes.get(BARE_DECODER_IN_KEY, ())[1:2] == (LATENT_CHANNELS,):
        raise WrongModelError(
            f"{where} is a FLUX.2 VAE decoder alone (like BFL's small_decoder.safetensors), without the encoder a "
            f"VAE needs. Download {SMALL_DECODER_FILE} (the same small decoder with the full encoder) from "
            f"{SMALL_DECODER_REPOSITORY} into models/vae and choose it."
        )
    if DECODER_IN_KEY not in shapes:
        raise WrongModelError(f"{where} is not a VAE (it has no {DECODER_IN_KEY}).")
    if len(shapes[DECODER_IN_KEY]) != 4:
        raise UnknownModelError(
            f"{where}: {DECODER_IN_KEY} has shape {list(shapes[DECODER_IN_KEY])}, not a convolution's "
            "[out, in, height, width]; the file is damaged or not a VAE. Download it again."
        )
    latent = shapes[DECODER_IN_KEY][1]
    if BATCH_NORM_KEY not in shapes or latent != LATENT_CHANNELS:
        raise WrongModelError(
            f"{where} is a VAE with {latent} latent channels"
            f"{'' if BATCH_NORM_KEY in shapes else ' and no latent batch norm'}"
            f", not the FLUX.2 VAE ({LATENT_CHANNELS} latent channels with batch-norm statistics); "
            f"{'it is the FLUX.1 VAE. ' if latent == 16 else ''}Choose the ae.safetensors or vae/ of a FLUX.2 model."
        )


def load_vae_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """The FLUX.2 VAE's tensors as stored (diffusers or BFL keys; the host converts diffusers keys itself)."""
    files = SafetensorsFiles([str(p) for p in vae_files(path)])
    check_flux2_vae({k: i.shape for k, i in files.infos.items()}, str(path))
    return {name: files.read(name) for name in progress.tracked(files.infos)}
