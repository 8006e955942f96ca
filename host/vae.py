"""The FLUX.2 VAE as the host's VAE object. The host reads diffusers and BFL keys alike and recognises
FLUX.2 by its latent batch-norm statistics. A decoder narrower than the encoder (BFL's small decoder) the host
builds itself from 0.33 on; 0.3.75 builds every decoder as wide as the encoder, so there the host builds the rest
and the pack builds the host's own decoder class at the file's width in its place."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from ..errors import HostError, MissingWeightsError, UnknownModelError
from ..loaders.models import vae as files
from ..loaders.models.vae import DECODER_IN_KEY, LATENT_CHANNELS, load_vae_state_dict
from . import compat, ensure_comfy

PATCH = 2  # the host packs 2x2 latent pixels into channels for FLUX.2
MISSING_VAE_KEYS = "Missing VAE keys"  # what the host logs, with the list, after its own key conversion
TRAINING_COUNTER = "num_batches_tracked"  # a batch norm's training step count; files may leave it out
# comfy/sd.py's geometry of the FLUX.2 VAE (its ddconfig for a VAE with latent batch norm). A decoder's `ch` is
# the file's: its conv_in has ch * ch_mult[-1] channels.
FLUX2_DDCONFIG = {"ch": 128, "ch_mult": [1, 2, 4, 4], "num_res_blocks": 2, "attn_resolutions": [], "dropout": 0.0,
                  "in_channels": 3, "out_ch": 3, "resolution": 256, "z_channels": LATENT_CHANNELS}
DECODER = "decoder."
OUTSIDE_DECODER = "decoder.post_quant_conv."  # BFL keeps post_quant_conv under decoder., the host's model does not
DIFFUSERS_KEY = "decoder.up_blocks.0.resnets.0.norm1.weight"  # the key by which the host converts diffusers keys
HOST_MESSAGE_LINES = 3  # of the host's error, in the pack's (a size mismatch names every tensor, one a line)


def load_vae(path: str | Path):
    """The FLUX.2 VAE of a pipeline folder ([dev] or Klein), a vae/ folder or an ae.safetensors file, as the
    host's VAE, which the host's device nodes can load again from the same path."""
    ensure_comfy()

    with compat.load_progress():
        state_dict = load_vae_state_dict(path)
    with compat.keys_the_host_logs_missing(MISSING_VAE_KEYS) as missing:
        try:
            vae = _host_vae(state_dict, missing)
            vae.throw_exception_if_invalid()
        except Exception as e:  # the host's construction, whatever it raises: the user reads the pack's error
            raise UnknownModelError(_not_built(path, state_dict, e)) from e
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


def decoder_widths(state_dict) -> list[int]:
    """The channels of the file's decoder at each resolution, from its conv_in (as 0.33's comfy/sd.py reads them)."""
    ch = state_dict[DECODER_IN_KEY].shape[0] // FLUX2_DDCONFIG["ch_mult"][-1]
    return [ch * m for m in FLUX2_DDCONFIG["ch_mult"]]


def _host_vae(state_dict: dict, missing: list[str]):
    """The host's VAE of these weights. Where the file's decoder is narrower than the host builds it (0.3.75), the
    host builds the rest from the weights without the decoder's, the pack the host's decoder class at the file's
    width, and `missing` (the keys the host logged) then lists the decoder's missing keys in place of the host's."""
    import comfy.sd

    width = decoder_widths(state_dict)[0]
    if width == FLUX2_DDCONFIG["ch"] or compat.builds_narrow_vae_decoders():
        return comfy.sd.VAE(sd=state_dict)
    import comfy.diffusers_convert

    if DIFFUSERS_KEY in state_dict:
        state_dict = comfy.diffusers_convert.convert_vae_state_dict(state_dict)
    in_decoder = {k: k.startswith(DECODER) and not k.startswith(OUTSIDE_DECODER) for k in state_dict}
    rest = {k: v for k, v in state_dict.items() if not in_decoder[k]}
    # The host finds the FLUX.2 VAE by decoder.conv_in: a stand-in as wide as it builds decoders (a zero, expanded).
    wide = FLUX2_DDCONFIG["ch"] * FLUX2_DDCONFIG["ch_mult"][-1]
    rest[DECODER_IN_KEY] = torch.zeros(()).expand(wide, *state_dict[DECODER_IN_KEY].shape[1:])
    vae = comfy.sd.VAE(sd=rest)
    model = vae.first_stage_model
    dtype = model.decoder.conv_in.weight.dtype
    model.decoder = type(model.decoder)(**{**FLUX2_DDCONFIG, "ch": width}).to(dtype).eval()
    # Loaded through the whole model, so that an error names each tensor by its whole key, as the host's own do.
    absent, _ = model.load_state_dict({k: v for k, v in state_dict.items() if in_decoder[k]}, strict=False)
    missing[:] = [k for k in missing if not k.startswith(DECODER)] + [k for k in absent if k.startswith(DECODER)]
    logging.info("FLUX.2 [dev]: this ComfyUI builds VAE decoders only as wide as the encoder, so the pack put the "
                 "file's narrower decoder (conv_in %s channels) in place of the one ComfyUI built; the decoder keys "
                 "ComfyUI logged as missing were that one's.", width * FLUX2_DDCONFIG["ch_mult"][-1])
    vae.size = None  # the host measured the wide decoder; model_size() measures again when asked
    return vae


def _not_built(path, state_dict: dict, error: Exception) -> str:
    """What the user reads when the host could not build a VAE of these weights: its own words, shortened."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    more = len(lines) - HOST_MESSAGE_LINES
    said = " ".join(lines[:HOST_MESSAGE_LINES]) + (f" (and {more} more)" if more > 0 else "")
    wide = [FLUX2_DDCONFIG["ch"] * m for m in FLUX2_DDCONFIG["ch_mult"]]
    return (
        f"ComfyUI could not build a VAE from {path} ({type(error).__name__}: {said}). The file has a decoder of "
        f"{decoder_widths(state_dict)} channels; ComfyUI's FLUX.2 VAE has an encoder of {wide} channels and a decoder "
        f"of those or narrower ones (BFL's small decoder). The file is damaged or not a FLUX.2 VAE: download it "
        f"again, flux2-vae.safetensors or {files.SMALL_DECODER_FILE} from {files.SMALL_DECODER_REPOSITORY}."
    )


def load_vae_patcher(path: str, disable_dynamic: bool = False):
    """The reload factory the device nodes call (the host's VAE picks its patcher class itself)."""
    return load_vae(path).patcher
