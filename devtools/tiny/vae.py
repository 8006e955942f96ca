"""A seeded random FLUX.2 VAE (diffusers AutoencoderKLFlux2), as a diffusers vae/ folder and as a single
ae.safetensors in the key layout of BFL's ae.safetensors.

Not tiny: the host builds every FLUX.2 VAE with the real geometry (128-512 channels, 2 res blocks, 32
latent channels; comfy.sd.VAE reads only the latent width from the weights), so a smaller one would not
load. It is written in bf16 (about 170 MB per copy)."""

from __future__ import annotations

import copy
import re
from functools import lru_cache
from pathlib import Path

import torch

SEED = 1616
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


@lru_cache(maxsize=1)
def make_vae():
    """The seeded random VAE (float32). Norm weights and the latent batch-norm statistics are random too,
    so a mix-up of scale and shift or of mean and variance shows in the output."""
    from diffusers import AutoencoderKLFlux2

    with torch.random.fork_rng():
        torch.manual_seed(SEED)
        vae = AutoencoderKLFlux2()
        with torch.no_grad():
            for name, p in vae.named_parameters():
                if p.ndim == 1 and "norm" in name and name.endswith("weight"):
                    p.uniform_(0.5, 1.5)
            vae.bn.running_mean.normal_(0.0, 0.5)
            vae.bn.running_var.uniform_(0.5, 2.0)
    return vae.eval()


def write_vae_folder(path: Path) -> None:
    copy.deepcopy(make_vae()).bfloat16().save_pretrained(str(path))


def write_vaes(root: str | Path) -> list[dict]:
    from safetensors.torch import save_file

    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    write_vae_folder(root / "flux2-vae-diffusers")
    bf16 = {k: v.to(torch.bfloat16) for k, v in make_vae().state_dict().items()}
    save_file(diffusers_to_ae(bf16), str(root / "flux2-ae.safetensors"))
    return [
        {"path": "flux2-vae-diffusers", "kind": "vae", "layout": "diffusers", "variant": None, "format": "bf16"},
        {"path": "flux2-ae.safetensors", "kind": "vae", "layout": "BFL", "variant": None, "format": "bf16"},
    ]
