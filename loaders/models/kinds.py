"""Telling model kinds apart, from stored tensor names and GGUF architectures: one table each. Every
loader and `flux2dev inspect` ask here, so a file picked in the wrong loader is named the same way
everywhere."""

from __future__ import annotations

import re

# Full checkpoints of other model families, told by a name only they store: (GGUF_ARCHITECTURES key for
# their words, pattern). They are checked first: an SDXL checkpoint also stores a VAE.
OTHER_CHECKPOINTS = (
    ("sdxl", re.compile(r"^conditioner\.embedders\.1\.model\.")),
    ("sd1", re.compile(r"^cond_stage_model\.transformer\.")),
)

# (kind, pattern on a stored tensor name); the first kind any name matches wins.
KIND_BY_NAMES = (
    ("transformer", re.compile(r"^(?:model\.diffusion_model\.)?"
                               r"(?:double_blocks|single_blocks|transformer_blocks|single_transformer_blocks)\.")),
    ("vae", re.compile(r"^(?:first_stage_model\.|vae\.)?(?:(?:decoder|encoder)\..*conv|bn\.running_mean)")),
)

# general.architecture of a GGUF file (None: the key is absent) -> (kind, what it is in the user's words).
# "encoder" rows are read by the text encoder loader (loaders/models/encoder_layouts.py has one layout each).
GGUF_ARCHITECTURES = {
    None: ("transformer", "a FLUX transformer (city96-style conversion)"),
    "flux": ("transformer", "a FLUX transformer"),
    "pig": ("transformer", "a FLUX transformer (gguf-org conversion)"),
    "llama": ("encoder", "a Mistral/Llama text encoder (older llama.cpp conversions of Mistral-Small use this name)"),
    "mistral3": ("encoder", "a Mistral-Small text encoder (FLUX.2 [dev]'s)"),
    "cow": ("encoder", "a Mistral-Small text encoder in gguf-org's layout (FLUX.2 [dev]'s)"),
    "qwen3": ("other", "a Qwen3 text encoder (FLUX.2 Klein's)"),
    "t5": ("other", "a T5 text encoder"),
    "t5encoder": ("other", "a T5 text encoder"),
    "sd1": ("other", "a Stable Diffusion 1.x model"),
    "sdxl": ("other", "a Stable Diffusion XL model"),
    "sd3": ("other", "a Stable Diffusion 3 model"),
    "aura": ("other", "an AuraFlow model"),
    "hidream": ("other", "a HiDream model"),
    "cosmos": ("other", "a Cosmos model"),
    "ltxv": ("other", "an LTX-Video model"),
    "hyvid": ("other", "a HunyuanVideo model"),
    "wan": ("other", "a Wan video model"),
    "lumina2": ("other", "a Lumina 2 model"),
    "qwen_image": ("other", "a Qwen-Image model"),
}


def other_checkpoint(names) -> str | None:
    """What the stored names say the file is, in the user's words, when it is another family's checkpoint."""
    for architecture, pattern in OTHER_CHECKPOINTS:
        if any(pattern.match(name) for name in names):
            return GGUF_ARCHITECTURES[architecture][1]
    return None


def kind_from_names(names) -> str | None:
    """"other" (another family's checkpoint), "transformer" or "vae" when the stored names say so; None for
    anything else."""
    if other_checkpoint(names):
        return "other"
    for kind, pattern in KIND_BY_NAMES:
        if any(pattern.match(name) for name in names):
            return kind
    return None


def gguf_kind(architecture: str | None) -> str | None:
    """"transformer", "encoder" or "other" for a known GGUF architecture; None for an unknown one."""
    return GGUF_ARCHITECTURES.get(architecture, (None, ""))[0]


def gguf_architectures(kind: str) -> tuple[str | None, ...]:
    return tuple(arch for arch, (k, _) in GGUF_ARCHITECTURES.items() if k == kind)
