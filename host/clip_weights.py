"""The lazy CLIP's weights: what it reads them from (EncoderSource), reading them on demand (fingerprinting them
for the conditioning cache on the way) and giving their memory back."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field

import torch

from ..errors import HostError
from ..loaders.cache.store import ConditioningCache, stat_signature, weights_fingerprint
from ..loaders.formats.validate import released_on_error
from ..loaders.models.encoder import EncoderPlan, plan_encoder, read_weights
from . import compat


@dataclass(eq=False)
class EncoderSource:
    """What a lazy CLIP reads its weights from and caches under; shared by the CLIP's clones, as its model is."""

    plan: EncoderPlan
    tokenizer: object  # tokenizers.TokenizerResolution
    padding: str
    dtype: torch.dtype
    keep_loaded: bool
    allow_network: bool
    cache: ConditioningCache | None
    cpu_matmul_dtype: torch.dtype | None  # the dtype its linear layers multiply in on the CPU (None: the input's)
    placeholders: list = field(default_factory=list)  # (layer, parameter name, shape, dtype) while unloaded
    loaded: bool = False
    fingerprint: str | None = None  # of the weights loaded now, or of the files on disk


def plan_signature(plan: EncoderPlan) -> str:
    """The stat signature of the weight files the plan reads (the conditioning cache's index key)."""
    return stat_signature(plan.path, plan.source.files)


@released_on_error
def load_weights(clip) -> None:
    """Read the CLIP's weights if it does not hold them (fingerprinting them for the cache on the way)."""
    src = clip.flux2dev_source
    if src.loaded:
        return
    # Planned again: the files may have been replaced since the CLIP was built, and the old plan's offsets
    # would then read the wrong bytes. The tokenizer is the CLIP's own and is not resolved again.
    with compat.load_progress():
        plan = plan_encoder(src.plan.path)
        state_dict = read_weights(plan)
    src.fingerprint = None
    if src.cache is not None:
        src.fingerprint = weights_fingerprint(src.cache, plan_signature(plan), lambda: state_dict)
    # The weights are loaded here rather than in the constructor (which only logs missing keys), so that a
    # missing one stops the load.
    missing, _ = clip.load_sd(compat.host_owned(state_dict) if compat.is_dynamic(clip.patcher) else state_dict)
    if missing:  # the host model has exactly the layers + embeddings the loader reads (variants.layers_kept)
        raise HostError(
            f"This ComfyUI's FLUX.2 text encoder has weights the pack does not provide ({', '.join(missing[:5])}); "
            "its encoder differs from the one the pack was built for. Report it with your ComfyUI version."
        )
    src.loaded = True


def release_weights(clip) -> None:
    """Unload the CLIP from the host and give its weights' memory back; the next miss reads them again."""
    src = clip.flux2dev_source
    if not src.loaded:
        return
    compat.unload_held(clip.cond_stage_model)
    device = clip.patcher.offload_device
    for layer, name, shape, dtype in src.placeholders:
        setattr(layer, name,
                torch.nn.Parameter(torch.empty(1, dtype=dtype, device=device).expand(shape), requires_grad=False))
        for companion in layer.companions:
            delattr(layer, companion)
        layer.companions, layer.lazy_patches = (), []
    src.loaded, src.fingerprint = False, None
    return_freed_memory()  # with keep_loaded off the point is to give the memory to the transformer


def return_freed_memory() -> None:
    """Hand the C heap's free pages back to the system. glibc keeps freed blocks for reuse, so RSS stays up by
    whatever was freed last; elsewhere there is nothing to do."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
