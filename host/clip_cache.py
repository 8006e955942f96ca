"""The conditioning cache's policy for the lazy CLIP: where its folder is, when a prompt's conditioning may be
cached (not with LoRAs, hooks, a CLIP layer or embeddings), and the key of everything that shapes it."""

from __future__ import annotations

import os

from ..errors import CacheError
from ..loaders.cache.keys import ConditioningKey
from ..loaders.cache.store import CACHE_DIR_ENV
from . import ensure_comfy
from .clip_model import model_config
from .clip_tokenizer import CLIP_NAME
from .clip_weights import load_weights, plan_signature

CACHE_FOLDER = "flux2dev-conditioning-cache"  # inside the host's user directory


def cache_folder(choice: str = "") -> str:
    """The conditioning cache folder a node input names: empty for FLUX2DEV_CACHE_DIR, else a folder in the
    host's user directory; a relative folder lies in the user directory (a name that climbs out of it is
    refused), an absolute one anywhere."""
    choice = os.path.expanduser(choice.strip() or os.environ.get(CACHE_DIR_ENV, "") or CACHE_FOLDER)
    if os.path.isabs(choice):
        return choice
    ensure_comfy()
    import folder_paths

    user = os.path.abspath(folder_paths.get_user_directory())
    folder = os.path.normpath(os.path.join(user, choice))
    if os.path.commonpath([user, folder]) != user:
        raise CacheError(
            f"The cache folder {choice!r} leads out of ComfyUI's user folder ({user}); a relative cache folder lies "
            "inside it. Give a plain name, or an absolute path for a folder elsewhere."
        )
    return folder


def cache_bypass(clip, tokens) -> str | None:
    """Why this CLIP's conditioning cannot be cached, or None."""
    patcher = clip.patcher
    if patcher.patches:
        return "this CLIP has a LoRA or other weight patch applied"
    if getattr(patcher, "forced_hooks", None) is not None or getattr(patcher, "hook_patches", None):
        return "this CLIP has hooks"
    if clip.layer_idx is not None:
        return "a CLIP layer is set on this CLIP"
    if set(tokens) != {CLIP_NAME} or not all(isinstance(p[0], int) for seq in tokens[CLIP_NAME] for p in seq):
        return "the prompt holds embeddings, not only token ids"
    return None


def compute(src, device) -> str:
    """The dtypes an encode computes in on `device`: the CLIP's, and where other, its matmuls' (a cache shared by
    machines that multiply differently keeps their entries apart)."""
    if device.type == "cpu" and src.cpu_matmul_dtype not in (None, src.dtype):
        return f"{src.dtype}, matmuls in {src.cpu_matmul_dtype}"
    return str(src.dtype)


def conditioning_key(clip, tokens) -> ConditioningKey:
    """Everything that shapes this conditioning; computing it may read the weights once, to fingerprint them."""
    from ..loaders.models.variants import dev_variant_for_encoder
    from . import compat

    src = clip.flux2dev_source
    if src.fingerprint is None:
        src.fingerprint = src.cache.known_fingerprint(plan_signature(src.plan))
    if src.fingerprint is None:
        load_weights(clip)  # fingerprints what it reads
    return ConditioningKey(
        weights=src.fingerprint,
        layout=src.plan.layout,
        formats=tuple(sorted(src.plan.formats.items())),
        settings=tuple(sorted(model_config(src.plan).items())),
        vocabulary=src.tokenizer.tokenizer.vocab_digest,
        padding=src.padding,
        tokens=tuple(tuple((p[0], float(p[1])) for p in seq) for seq in tokens[CLIP_NAME]),
        dtype=compute(src, clip.patcher.load_device),
        device=clip.patcher.load_device.type,
        layers=tuple(dev_variant_for_encoder(src.plan.geometry).encoder_layers),
        host=compat.host_version(),
    )
