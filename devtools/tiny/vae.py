"""A seeded random FLUX.2 VAE (diffusers AutoencoderKLFlux2), as a diffusers vae/ folder and as a single
ae.safetensors in the key layout of BFL's ae.safetensors; and the same encoder with a narrower decoder, as BFL's
small-decoder VAE pairs them, in both forms and as the decoder alone (BFL's small_decoder.safetensors).

Not tiny: the host builds every FLUX.2 encoder with the real geometry (128-512 channels, 2 res blocks, 32
latent channels; comfy.sd.VAE reads only the latent width and the decoder's width from the weights), so a
smaller one would not load. It is written in bf16 (about 170 MB per copy; 75 MB with the narrow decoder)."""

from __future__ import annotations

import copy
import re
from functools import lru_cache
from pathlib import Path

import torch

SEED = 1616
# BFL's small decoder is [96, 192, 384, 384]: the same steps as the full [128, 256, 512, 512], narrower. The tiny
# one is narrower still (the host's group norms take multiples of 32).
SMALL_DECODER = (32, 64, 128, 128)
UP_BLOCKS = 4  # diffusers numbers decoder blocks from the latent side, BFL from the image side

# diffusers key -> BFL ae key, applied in order; the replacement may be a function of the match.
DIFFUSERS_TO_AE = (
    (r"^quant_conv\.", "encoder.quant_conv."),
    (r"^post_quant_conv\.", "decoder.post_quant_conv."),
    (r"^(encoder)\.down_blocks\.(\d+)\.resnets\.", r"\1.down.\2.block."),
    (r"^(encoder)\.down_blocks\.(\d+)\.downsamplers\.0\.", r"\1.down.\2.downsample."),
    (r"^decoder\.up_blocks\.(\d+)\.resnets\.", lambda m: f"decoder.up.{UP_BLOCKS - 1 - int(m[1])}.block."),
    (r"^decoder\.up_blocks\.(\d+)\.upsamplers\.0\.", lambda m: f"decoder.up.{UP_BLOCKS - 1 - int(m[1])}.upsample."),
    (r"\.mid_block\.resnets\.0\.", ".mid.block_1."),
    (r"\.mid_block\.resnets\.1\.", ".mid.block_2."),
    (r"\.mid_block\.attentions\.0\.group_norm\.", ".mid.attn_1.norm."),
    (r"\.mid_block\.attentions\.0\.to_([qkv])\.", r".mid.attn_1.\1."),
    (r"\.mid_block\.attentions\.0\.to_out\.0\.", ".mid.attn_1.proj_out."),
    (r"\.conv_shortcut\.", ".nin_shortcut."),
    (r"\.conv_norm_out\.", ".norm_out."),
)
# BFL's mid-block attention uses 1x1 convolutions where diffusers uses linear layers.
AE_CONV_1X1 = re.compile(r"\.mid\.attn_1\.(q|k|v|proj_out)\.weight$")


def diffusers_to_ae(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for key, tensor in state_dict.items():
        if key.endswith("num_batches_tracked"):
            continue
        for pattern, replacement in DIFFUSERS_TO_AE:
            key = re.sub(pattern, replacement, key)
        if AE_CONV_1X1.search(key) and tensor.ndim == 2:
            tensor = tensor[:, :, None, None]
        out[key] = tensor.contiguous()
    return out


def _seeded(seed: int, **config):
    """A seeded random AutoencoderKLFlux2 (float32). Norm weights and the latent batch-norm statistics are random
    too, so a mix-up of scale and shift or of mean and variance shows in the output."""
    from diffusers import AutoencoderKLFlux2

    with torch.random.fork_rng():
        torch.manual_seed(seed)
        vae = AutoencoderKLFlux2(**config)
        with torch.no_grad():
            for name, p in vae.named_parameters():
                if p.ndim == 1 and "norm" in name and name.endswith("weight"):
                    p.uniform_(0.5, 1.5)
            vae.bn.running_mean.normal_(0.0, 0.5)
            vae.bn.running_var.uniform_(0.5, 2.0)
    return vae.eval()


@lru_cache(maxsize=1)
def make_vae():
    """The seeded random VAE (float32)."""
    return _seeded(SEED)


@lru_cache(maxsize=1)
def make_small_decoder_vae():
    """make_vae()'s encoder with a seeded decoder of SMALL_DECODER channels. Put together from two models, with the
    widths in its config as diffusers' decoder_block_out_channels, which the diffusers that reads them builds
    (older diffusers, 0.37 among them, has no such parameter but writes the config as set)."""
    vae = copy.deepcopy(make_vae())
    vae.decoder = _seeded(SEED + 1, block_out_channels=SMALL_DECODER).decoder
    vae.register_to_config(decoder_block_out_channels=SMALL_DECODER)
    return vae


def write_vae_folder(path: Path, vae=None) -> None:
    copy.deepcopy(make_vae() if vae is None else vae).bfloat16().save_pretrained(str(path))


def _bfl_keys(vae) -> dict[str, torch.Tensor]:
    return diffusers_to_ae({k: v.to(torch.bfloat16) for k, v in vae.state_dict().items()})


def write_ae(path: Path, vae) -> None:
    from safetensors.torch import save_file

    save_file(_bfl_keys(vae), str(path))


def write_decoder_alone(path: Path, vae) -> None:
    """The decoder's tensors alone, with bare keys (conv_in.weight, up.0.block.0.norm1.weight, ...) as BFL ships it."""
    from safetensors.torch import save_file

    save_file({k.removeprefix("decoder."): v for k, v in _bfl_keys(vae).items() if k.startswith("decoder.")}, str(path))


# file or folder -> (the model, its writer, its layout; None for the decoder alone, no VAE the pack loads: its
# refusal names the file to use, so it is left out of the manifest)
WRITTEN = {
    "flux2-vae-diffusers": (make_vae, write_vae_folder, "diffusers"),
    "flux2-ae.safetensors": (make_vae, write_ae, "BFL"),
    "flux2-small-decoder-vae-diffusers": (make_small_decoder_vae, write_vae_folder, "diffusers"),
    "full_encoder_small_decoder.safetensors": (make_small_decoder_vae, write_ae, "BFL"),
    "small_decoder.safetensors": (make_small_decoder_vae, write_decoder_alone, None),
}


def write_vaes(root: str | Path) -> list[dict]:
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    for name, (make, write, _) in WRITTEN.items():
        write(root / name, make())
    return [{"path": name, "kind": "vae", "layout": layout, "variant": None, "format": "bf16"}
            for name, (_, _, layout) in WRITTEN.items() if layout]
