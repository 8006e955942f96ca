"""FLUX.2 transformers (safetensors files and folders, and GGUF files) as the host's MODEL, built from the
pack's own geometry detection, with the wiring guard: conditioning of the wrong width stops the sampler at
setup, naming both sides, instead of failing deep in the first step with a matmul error. Packed weights (scaled
fp8, the other comfy_quant formats, GGUF blocks) stay as stored; host/ops.py dequantizes them per layer."""

from __future__ import annotations

import functools
import logging
from pathlib import Path

import torch

from ..errors import HostError, MissingWeightsError, UnknownModelError
from ..loaders.formats import packing
from ..loaders.models.gguf_transformer import load_gguf_transformer
from ..loaders.models.transformer import LoadedTransformer, check_conditioning_width, load_transformer
from . import compat, ensure_comfy
from .ops import packed_operations, packed_patcher

# The GGUF loader node's choices: the dtype layers are expanded to, and the one LoRA patches are computed in.
DEQUANT_DTYPES = {"default": None, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
PATCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# unet_config entries the pack fills from its own detection; the host's sniffing fixes num_heads at 48.
def _geometry_config(loaded: LoadedTransformer) -> dict:
    g, v = loaded.geometry, loaded.variant
    return {
        "hidden_size": g.hidden_size,
        "num_heads": v.num_heads,
        "context_in_dim": g.context_in_dim,
        "in_channels": g.in_channels,
        "depth": g.double_blocks,
        "depth_single_blocks": g.single_blocks,
        "guidance_embed": g.guidance,
    }


@functools.cache
def flux2_classes():
    """(model class, config class): the host's FLUX.2 ones, with the wiring guard. Made on first use, so that
    importing this module leaves comfy alone."""
    ensure_comfy()
    import comfy.model_base
    import comfy.supported_models

    class GuardedFlux2(comfy.model_base.Flux2):
        """The host's FLUX.2 model, refusing conditioning of another width when the sampler prepares its conds."""

        def __init__(self, model_config, device=None):
            super().__init__(model_config, device=device)
            self.flux2_variant = model_config.flux2_variant

        def concat_cond(self, **kwargs):
            # No FLUX.2 variant takes extra image channels beside the latent (in_channels equals out_channels).
            # The host would infer them from img_in.weight's stored shape, which for a packed weight (GGUF rows)
            # is a byte count, and would then concatenate a phantom image.
            return None

        def extra_conds(self, **kwargs):
            cross_attn = kwargs.get("cross_attn")
            if cross_attn is not None:
                check_conditioning_width(cross_attn.shape[-1], self.flux2_variant)
            return super().extra_conds(**kwargs)

    class Flux2Config(comfy.supported_models.Flux2):
        flux2_variant = None

        def get_model(self, state_dict, prefix="", device=None):
            return GuardedFlux2(self, device=device)

    return GuardedFlux2, Flux2Config


def _check_keys(model, keys: set[str]) -> None:
    expected = compat.expected_unet_keys(model.diffusion_model)
    given = {k for k in keys if not packing.is_companion(k)}
    missing, extra = sorted(expected - given), sorted(given - expected)
    if missing:
        raise MissingWeightsError(
            f"The FLUX.2 transformer lacks {len(missing)} tensor(s) the model needs ({', '.join(missing[:5])}); the "
            "file is incomplete. Download it again."
        )
    if extra:
        raise UnknownModelError(
            f"The FLUX.2 transformer holds {len(extra)} tensor(s) the model does not have ({', '.join(extra[:5])}); "
            "it may be a fine-tune with extra layers or a newer format. The pack does not guess what they do."
        )


def build_model(
    loaded: LoadedTransformer,
    dtype: torch.dtype | None = None,
    dequant_dtype: torch.dtype | None = None,
    patch_dtype: torch.dtype = torch.float32,
    disable_dynamic: bool = False,
    device: torch.device | None = None,
):
    """A host MODEL (ModelPatcher) from a loaded transformer. Packed weights (comfy_quant formats, GGUF blocks: a
    weight with companions beside it) stay as stored and are dequantized per layer by the pack's ops, with
    dequant_dtype and patch_dtype as their settings (host/ops.py); float models get the host's own ops. The
    patcher is the class the host's own loaders would use now (disable_dynamic: the plain one). With `device`
    "meta" (and meta tensors in the state dict) the model is its structure alone, in no memory."""
    _, flux2_config = flux2_classes()
    import comfy.model_detection
    import comfy.model_management
    import comfy.utils

    sd = loaded.state_dict
    unet_config = comfy.model_detection.detect_unet_config(sd, "")
    if not unet_config or unet_config.get("image_model") != "flux2":
        raise HostError(
            "This ComfyUI does not recognise FLUX.2 transformers (its model detection returned "
            f"{unet_config and unet_config.get('image_model')!r}); FLUX.2 needs ComfyUI 0.3.75 or newer."
        )
    unet_config.update(_geometry_config(loaded))
    model_config = flux2_config(unet_config)
    model_config.flux2_variant = loaded.variant

    load_device = comfy.model_management.get_torch_device()
    offload_device = comfy.model_management.unet_offload_device()
    supported = model_config.supported_inference_dtypes
    if dtype is None:
        stored = comfy.utils.weight_dtype(sd)
        dtype = comfy.model_management.unet_dtype(
            model_params=comfy.utils.calculate_parameters(sd),
            supported_dtypes=supported,
            weight_dtype=stored if stored in supported else None,  # fp8 / packed weights: the host picks
        )
    manual_cast = comfy.model_management.unet_manual_cast(dtype, load_device, supported)
    compat.call_with_known(model_config.set_inference_dtype, dtype=dtype, manual_cast_dtype=manual_cast,
                           device=load_device)
    packed = any(packing.is_companion(k) for k in sd)
    model_config.custom_operations = packed_operations(dequant_dtype, patch_dtype) if packed else None

    model = model_config.get_model(sd, "", device=device)
    patcher = compat.new_patcher(model, load_device, offload_device, disable_dynamic)
    if packed:
        packed_patcher(patcher)
    if device is None and not comfy.model_management.is_device_cpu(offload_device):
        model.to(offload_device)
    # The check sees the keys after the host's own conversion: what load_model_weights will really load.
    _check_keys(model, compat.unet_keys_as_loaded(model_config, sd))
    compat.load_unet_weights(model, dict(sd), dynamic=compat.is_dynamic(patcher) or device is not None)
    logging.info("FLUX.2 MODEL ready: %s patcher, computing on %s, kept on %s when idle.",
                 type(patcher).__name__, patcher.load_device, patcher.offload_device)
    return patcher


def load_model(path: str | Path, dtype: torch.dtype | None = None, disable_dynamic: bool = False):
    """The FLUX.2 transformer at `path` (BFL file, diffusers transformer folder or pipeline folder) as a MODEL
    that the host's device nodes can load again from the same file."""
    with compat.load_progress():
        loaded = load_transformer(path)
    patcher = build_model(loaded, dtype=dtype, disable_dynamic=disable_dynamic)
    compat.set_reload(patcher, load_model, (str(path), dtype))
    return patcher


def load_gguf_model(path, dequant_dtype: torch.dtype | None = None, patch_dtype: torch.dtype = torch.float32,
                    dtype: torch.dtype | None = None, disable_dynamic: bool = False):
    """The FLUX.2 transformer GGUF at `path` as a host MODEL whose weights stay packed, which the host's device
    nodes can load again from the same file."""
    with compat.load_progress():
        loaded = load_gguf_transformer(path)
    patcher = build_model(loaded, dtype=dtype, dequant_dtype=dequant_dtype,
                          patch_dtype=patch_dtype, disable_dynamic=disable_dynamic)
    compat.set_reload(patcher, load_gguf_model, (str(path), dequant_dtype, patch_dtype, dtype))
    return patcher
