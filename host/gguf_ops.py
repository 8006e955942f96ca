"""GGUF weights inside the host's model: Linear, Conv and Embedding weights stay packed (the file's raw
blocks) in memory and are dequantized per layer, on the device of the layer's input, at each forward.

The pieces, all per load so one load's settings never reach another:
- gguf_operations(...) -> a comfy.ops-style class for model_options["custom_operations"];
- GGUFModelPatcher: the host's ModelPatcher, except that patches (LoRAs) of packed weights are applied to
  the dequantized weight at forward time instead of being baked into the stored weight, which would
  unpack it. In low-VRAM mode the host itself adds them as weight functions, which run at the same place.
The host's memory accounting reads the parameters, which are the packed bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import torch

from . import ensure_comfy

ensure_comfy()

import comfy.model_management  # noqa: E402
import comfy.model_patcher  # noqa: E402
import comfy.ops  # noqa: E402
import comfy.utils  # noqa: E402

from ..loaders.gguf_dequant import dequantize  # noqa: E402
from ..loaders.gguf_transformer import load_gguf_transformer  # noqa: E402
from .model import build_model  # noqa: E402

# Pack-private folder_paths key: the host's diffusion_models folders (models/unet, models/diffusion_models
# and any extra paths), listing .gguf files only.
GGUF_FOLDER = "flux2dev_gguf_diffusion_models"
GGUF_EXTENSIONS = {".gguf"}
DEQUANT_DTYPES = {"default": None, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
PATCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def register_gguf_folder() -> str:
    """Register (or refresh) the pack's .gguf view of the diffusion model folders; returns its key. The
    folder list is shared, so paths added later (extra_model_paths.yaml) show up here too."""
    import folder_paths

    paths = folder_paths.folder_names_and_paths["diffusion_models"][0]
    folder_paths.folder_names_and_paths[GGUF_FOLDER] = (paths, set(GGUF_EXTENSIONS))
    return GGUF_FOLDER


@dataclass(frozen=True)
class GGUFSettings:
    packed: Mapping[str, tuple]  # state-dict key (relative to the diffusion model) -> (GGUF type, torch shape)
    dequant_dtype: torch.dtype | None  # None: the dtype of the layer's input
    patch_dtype: torch.dtype  # LoRA math runs in this dtype, as the host's own patching runs in float32


class PackedLayer:
    """Mixin for comfy.ops layers whose weight may stay packed. Subclasses set `gguf` (GGUFSettings)."""

    gguf: GGUFSettings
    comfy_cast_weights = True

    def __init__(self, *args, **kwargs):
        device = kwargs.get("device")
        super().__init__(*args, **{**kwargs, "device": "meta"})
        # Shape-only placeholders (one element broadcast to the full shape): the host sees the layer's keys and
        # shapes before loading, and no memory goes to weights the file replaces.
        for name, p in list(self._parameters.items()):
            if p is not None:
                placeholder = torch.empty(1, dtype=p.dtype, device=device).expand(p.shape)
                setattr(self, name, torch.nn.Parameter(placeholder, requires_grad=False))
        self.packed_types: dict[str, tuple] = {}  # parameter name -> (GGUF type, shape) of what is stored packed
        self.lazy_patches: dict[str, list] = {}  # parameter name -> patches GGUFModelPatcher did not bake in
        self.weight_function = []
        self.bias_function = []

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
        for name, placeholder in list(self._parameters.items()):
            if placeholder is None:
                continue
            key = prefix + name
            if key not in state_dict:
                missing_keys.append(key)
                continue
            tensor = state_dict[key]
            entry = self.gguf.packed.get(key)
            shape = tuple(entry[1]) if entry is not None else tuple(tensor.shape)
            if shape != tuple(placeholder.shape):
                error_msgs.append(f"size mismatch for {key}: the file holds {list(shape)}, the model needs {list(placeholder.shape)}")
                continue
            if entry is not None:
                self.packed_types[name] = (entry[0], shape)
            setattr(self, name, torch.nn.Parameter(tensor, requires_grad=False))

    def _value(self, name: str, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        stored = getattr(self, name)
        value = comfy.model_management.cast_to(
            stored, None, device, non_blocking=comfy.model_management.device_supports_non_blocking(device), copy=False
        )
        packed = self.packed_types.get(name)
        if packed is not None:
            value = dequantize(value, packed[0], packed[1], dtype=self.gguf.dequant_dtype or dtype)
        functions = self.lazy_patches.get(name, []) + getattr(self, f"{name}_function")
        if functions:
            value = value.to(self.gguf.patch_dtype)
            for f in functions:
                value = f(value)
        return value.to(dtype)

    def gguf_weight_bias(self, device, dtype):
        bias = self._value("bias", device, dtype) if self.bias is not None else None
        return self._value("weight", device, dtype), bias

    def forward(self, *args, **kwargs):
        return self.forward_comfy_cast_weights(*args, **kwargs)


class PackedConv(PackedLayer):
    def forward_comfy_cast_weights(self, input):
        return self._conv_forward(input, *self.gguf_weight_bias(input.device, input.dtype))


def gguf_operations(packed: Mapping[str, tuple], dequant_dtype: torch.dtype | None = None, patch_dtype: torch.dtype = torch.float32):
    """A fresh comfy.ops class for one load. `packed` maps the keys whose tensors are raw GGUF blocks to
    (GGUF type, torch shape); other parameters load as the float tensors they are."""
    settings = GGUFSettings(dict(packed), dequant_dtype, patch_dtype)
    base = comfy.ops.manual_cast

    class GGUFOps(base):
        class Linear(PackedLayer, base.Linear):
            gguf = settings

            def forward_comfy_cast_weights(self, input):
                return torch.nn.functional.linear(input, *self.gguf_weight_bias(input.device, input.dtype))

        class Conv1d(PackedConv, base.Conv1d):
            gguf = settings

        class Conv2d(PackedConv, base.Conv2d):
            gguf = settings

        class Conv3d(PackedConv, base.Conv3d):
            gguf = settings

        class Embedding(PackedLayer, base.Embedding):
            gguf = settings

            def forward_comfy_cast_weights(self, input, out_dtype=None):
                weight, _ = self.gguf_weight_bias(input.device, out_dtype or settings.dequant_dtype or torch.float32)
                return torch.nn.functional.embedding(
                    input, weight, self.padding_idx, self.max_norm, self.norm_type, self.scale_grad_by_freq, self.sparse
                )

    return GGUFOps


def _packed_layer(model, key: str):
    """(layer, parameter name) when `key` names a packed weight, else (None, None)."""
    path, _, name = key.rpartition(".")
    layer = comfy.utils.get_attr(model, path) if path else None
    if isinstance(layer, PackedLayer) and name in layer.packed_types:
        return layer, name
    return None, None


class GGUFModelPatcher(comfy.model_patcher.ModelPatcher):
    """Where the host would bake a patch into a stored weight, a packed weight gets it as a lazy patch,
    applied after dequantization; float weights are patched the host's way."""

    def _packed_layers(self):
        return (m for m in self.model.modules() if isinstance(m, PackedLayer))

    def patch_weight_to_device(self, key, device_to=None, *args, **kwargs):
        layer, name = _packed_layer(self.model, key)
        if layer is None:
            return super().patch_weight_to_device(key, device_to, *args, **kwargs)
        if key in self.patches:
            layer.lazy_patches[name] = [comfy.model_patcher.LowVramPatch(key, self.patches)]
        else:
            layer.lazy_patches.pop(name, None)

    def unpatch_model(self, device_to=None, unpatch_weights=True):
        if unpatch_weights:
            for layer in self._packed_layers():
                layer.lazy_patches.clear()
        return super().unpatch_model(device_to, unpatch_weights)

    def partially_unload(self, *args, **kwargs):
        freed = super().partially_unload(*args, **kwargs)
        # Layers the host just moved to low-VRAM mode carry their patches as weight functions now.
        for layer in self._packed_layers():
            if getattr(layer, "comfy_patched_weights", None) is False:
                layer.lazy_patches.clear()
        return freed


def load_gguf_model(path, dequant_dtype: torch.dtype | None = None, patch_dtype: torch.dtype = torch.float32, dtype: torch.dtype | None = None):
    """The FLUX.2 transformer GGUF at `path` as a host MODEL whose weights stay packed."""
    loaded = load_gguf_transformer(path)
    ops = gguf_operations(loaded.packed, dequant_dtype=dequant_dtype, patch_dtype=patch_dtype)
    patcher = build_model(loaded, dtype=dtype, model_options={"custom_operations": ops})
    return GGUFModelPatcher(patcher.model, load_device=patcher.load_device, offload_device=patcher.offload_device)
