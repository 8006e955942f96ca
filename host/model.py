"""FLUX.2 transformers as the host's MODEL, built from the pack's own geometry detection, with the wiring
guard: conditioning of the wrong width stops the sampler at setup, naming both sides, instead of failing
deep in the first step with a matmul error."""

from __future__ import annotations

from pathlib import Path

import torch

from . import ensure_comfy

ensure_comfy()

import comfy.model_base  # noqa: E402
import comfy.model_detection  # noqa: E402
import comfy.model_management  # noqa: E402
import comfy.model_patcher  # noqa: E402
import comfy.ops  # noqa: E402
import comfy.supported_models  # noqa: E402
import comfy.utils  # noqa: E402

from ..errors import MissingWeightsError, UnknownModelError  # noqa: E402
from ..loaders.transformer import LoadedTransformer, check_conditioning_width, load_transformer  # noqa: E402

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


class GuardedFlux2(comfy.model_base.Flux2):
    """The host's FLUX.2 model, refusing conditioning of another width when the sampler prepares its conds."""

    def __init__(self, model_config, device=None):
        super().__init__(model_config, device=device)
        self.flux2_variant = model_config.flux2_variant

    def concat_cond(self, **kwargs):
        # No FLUX.2 variant takes extra image channels beside the latent (in_channels equals out_channels).
        # The host would infer them from img_in.weight's stored shape, which for a packed GGUF weight is a
        # byte count, and would then concatenate a phantom image.
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


def _scaled_fp8_ops(base):
    """Linear layers that keep each stored weight as it comes (fp8 or float) with its scale, and multiply
    the scale in per call, so an fp8 transformer stays fp8 in memory."""

    class ScaledFp8Ops(base):
        class Linear(base.Linear):
            def reset_parameters(self):
                self.register_parameter("weight_scale", None)  # filled by the load when the file has one

            def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
                weight = state_dict.pop(prefix + "weight", None)
                scale = state_dict.pop(prefix + "weight_scale", None)
                if weight is None:
                    missing_keys.append(prefix + "weight")
                    return
                self.weight = torch.nn.Parameter(weight, requires_grad=False)
                if scale is not None:
                    scale = scale.to(torch.float32)
                    self.weight_scale = torch.nn.Parameter(scale.reshape(-1, 1) if scale.numel() > 1 else scale, requires_grad=False)

            def _scale_like(self, weight):
                return self.weight_scale.to(device=weight.device, dtype=weight.dtype)

            def forward_comfy_cast_weights(self, input):
                weight, bias = comfy.ops.cast_bias_weight(self, input)
                if self.weight_scale is not None:
                    weight = weight * self._scale_like(weight)
                return torch.nn.functional.linear(input, weight, bias)

            # The host's weight patching (LoRA) works on real values: these convert to and from storage.
            def convert_weight(self, weight, inplace=False, **kwargs):
                if self.weight_scale is None:
                    return weight
                if inplace:
                    return weight.mul_(self._scale_like(weight))
                return weight.to(torch.float32) * self.weight_scale.to(device=weight.device)

            def set_weight(self, weight, inplace_update=False, seed=None, return_weight=False, **kwargs):
                import comfy.float

                if self.weight_scale is not None:
                    weight = weight / self._scale_like(weight)
                weight = comfy.float.stochastic_rounding(weight, self.weight.dtype, seed=seed)
                if return_weight:
                    return weight
                if inplace_update:
                    self.weight.data.copy_(weight)
                else:
                    self.weight = torch.nn.Parameter(weight, requires_grad=False)

    return ScaledFp8Ops


def _check_keys(model, state_dict: dict) -> None:
    expected = set(model.diffusion_model.state_dict())
    given = {k for k in state_dict if not k.endswith(".weight_scale")}
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


def build_model(loaded: LoadedTransformer, dtype: torch.dtype | None = None, model_options: dict | None = None):
    """A host MODEL (ModelPatcher) from a loaded transformer. model_options["custom_operations"] (host ops
    style) replaces the pack's choice of linear layers, for weights that need other handling (GGUF)."""
    sd = loaded.state_dict
    unet_config = comfy.model_detection.detect_unet_config(sd, "")
    if not unet_config or unet_config.get("image_model") != "flux2":
        raise UnknownModelError(
            "This ComfyUI does not recognise FLUX.2 transformers (its model detection returned "
            f"{unet_config and unet_config.get('image_model')!r}); FLUX.2 needs ComfyUI 0.3.75 or newer."
        )
    unet_config.update(_geometry_config(loaded))
    model_config = Flux2Config(unet_config)
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
    model_config.set_inference_dtype(dtype, manual_cast)
    ops = (model_options or {}).get("custom_operations")
    if ops is None and loaded.scaled_fp8:
        ops = _scaled_fp8_ops(comfy.ops.manual_cast)
    model_config.custom_operations = ops

    model = model_config.get_model(sd, "").to(offload_device)
    _check_keys(model, sd)
    model.load_model_weights(dict(sd), "")
    return comfy.model_patcher.ModelPatcher(model, load_device=load_device, offload_device=offload_device)


def load_model(path: str | Path, dtype: torch.dtype | None = None):
    """The FLUX.2 transformer at `path` (BFL file, diffusers transformer folder or pipeline folder) as a MODEL."""
    return build_model(load_transformer(path), dtype=dtype)
