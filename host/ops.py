"""Packed weights inside the host's models: Linear, Conv and Embedding weights stay as stored (fp8 with
its scale, NVFP4, MXFP8, INT8, W4A4, W4A8, GGUF blocks) and are dequantized per layer, on the device of the
layer's input, at each forward. Encoder (CLIP) and transformer (MODEL) loads share these layers.

A state dict hands a packed weight over as "<layer>.weight" (the stored tensor) plus its companions
("<layer>.weight_scale", ".weight_scale_2", ".weight_packing", ".weight_gguf_type" ...:
loaders.formats.packing.COMPANIONS); every packed weight goes through the one dequantizer,
loaders.formats.packed_dequant.dequantize. On the CPU a forward dequantizes into the thread's scratch buffer
(forward_weight), not a new tensor.

- packed_operations(...) -> a comfy.ops-style class for custom_operations, fresh per load so one load's
  settings never reach another;
- packed_patcher(...): the host's patcher, whichever class it is, except that patches (LoRAs) of packed weights
  are applied to the dequantized weight at forward time instead of being baked into the stored weight, which
  would unpack it. In low-VRAM mode the host itself adds them as weight functions, which run at the same place.
  The host's hook LoRAs (CreateHookLora and the like), which it would write into the stored weight while a
  hook is active, go the same way: applied to the dequantized weight while the hook is active.
The host's memory accounting reads the parameters and scales, which are the stored bytes.
"""

from __future__ import annotations

import functools
import math
import threading
from dataclasses import dataclass

import torch

from ..loaders.formats import packed_dequant, packing
from . import compat, ensure_comfy


@dataclass(frozen=True)
class PackedSettings:
    dequant_dtype: torch.dtype | None  # None: the dtype of the layer's input
    patch_dtype: torch.dtype  # LoRA math runs in this dtype, as the host's own patching runs in float32
    # On the CPU, the dtype Linear layers multiply in, their input cast to it and their output back (None: the
    # input's dtype)
    cpu_matmul_dtype: torch.dtype | None = None


def fast_cpu_matmul_dtype() -> torch.dtype | None:
    """bfloat16 where this CPU multiplies it natively (AMX or AVX512-BF16: 3-5x float32's rate on a FLUX.2 encoder's
    shapes, and a bf16 weight is read as stored), else None: elsewhere bf16 is emulated, slower than float32."""
    native = (getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)()
              or getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)())
    return torch.bfloat16 if native else None


def _to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    import comfy.model_management

    non_blocking = comfy.model_management.device_supports_non_blocking(device)
    return comfy.model_management.cast_to(tensor, None, device, non_blocking=non_blocking, copy=False)


# Float weights the pack's layers keep as stored: each op casts them to its input's dtype.
_CAST_PER_OP = (torch.bfloat16, torch.float16, torch.float32)
_scratch = threading.local()  # .buffer: this thread's scratch, created by its first CPU forward


def _scratch_buffer(shape, dtype: torch.dtype) -> torch.Tensor:
    """A view of this thread's scratch as `shape` and `dtype`. One flat buffer, grown to the largest weight
    asked for, serves every layer and every load: each weight lives in it only until its layer's matmul,
    which is done before the next layer writes to it, so the buffer never holds more than one weight."""
    nbytes = math.prod(shape) * dtype.itemsize
    buffer = getattr(_scratch, "buffer", None)
    if buffer is None or buffer.numel() < nbytes:
        _scratch.buffer = buffer = None  # the smaller one goes before the larger one is allocated
        with torch.inference_mode(False):  # a normal tensor: writable inside and outside inference mode
            buffer = _scratch.buffer = torch.empty(nbytes, dtype=torch.uint8, device="cpu")
    return buffer[:nbytes].view(dtype).view(shape)


def forward_weight(stored: torch.Tensor, companions: dict, dtype: torch.dtype, shape) -> torch.Tensor:
    """A packed weight's values (or a float weight's, cast) for one forward pass. On the CPU they go into the
    thread's scratch buffer: a new tensor per layer and step would pay the page faults of 75-230 MB of fresh
    memory for a FLUX.2 layer, which cost about as much as the dequantization itself (a GPU's caching allocator
    already reuses memory). The result is valid only until the next call on this thread: use it at once and keep
    no reference. With autograd on, a matmul could keep it for the backward pass: a new tensor then."""
    shape = tuple(int(s) for s in shape)
    reuse = stored.device.type == "cpu" and not torch.is_grad_enabled()
    out = _scratch_buffer(shape, dtype) if reuse else None
    return packed_dequant.dequantize(stored, companions, dtype, shape, out=out)


class PackedLayer:
    """Mixin for comfy.ops layers whose weight may stay packed. Subclasses set `settings` (PackedSettings)."""

    settings: PackedSettings
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
        self.weight_shape = tuple(self.weight.shape)  # the logical shape; a packed weight is stored in another
        self.companions: tuple[str, ...] = ()  # names of the weight's companions: non-empty when it is packed
        self.lazy_patches: list = []  # weight patches PackedPatching did not bake in
        self.hook_patches: list = []  # the active hooks' weight patches (HookPatch), set by PackedPatching
        self.weight_function = []
        self.bias_function = []

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        companions = {c: state_dict[prefix + c] for c in packing.COMPANIONS if prefix + c in state_dict}
        for name, placeholder in list(self._parameters.items()):
            if placeholder is None:
                continue
            key = prefix + name
            if key not in state_dict:
                missing_keys.append(key)
                continue
            tensor = state_dict[key]
            packed = companions if name == "weight" else {}
            needs = packed_dequant.stored_shape(placeholder.shape, tensor.dtype, packed)
            if tuple(tensor.shape) != needs:
                error_msgs.append(f"size mismatch for {key}: the file holds {list(tensor.shape)}, "
                                  f"the model needs {list(needs)}")
                continue
            # Packed and bf16/fp16/fp32 weights stay as stored (mapped from the file where it is read so) and are
            # cast per op: a float32 copy of bf16 weights, as the host makes on the CPU, would double them.
            kept = packed or tensor.dtype in _CAST_PER_OP
            tensor = tensor.to(device=placeholder.device, dtype=None if kept else placeholder.dtype)
            setattr(self, name, torch.nn.Parameter(tensor, requires_grad=False))
        for c, tensor in companions.items():
            if c in (packing.GGUF_TYPE, packing.PACKING):
                # Numbers, not weight memory, read here once: as a buffer the host would move them with the weights
                # (to the GPU), and every forward would then wait for the GPU to read them back.
                setattr(self, c, int(tensor) if c == packing.GGUF_TYPE else packing.packing_values({c: tensor}))
            else:
                self.register_buffer(c, tensor.to(self.weight.device))
        self.companions = tuple(companions)

    def _companions(self, device: torch.device) -> dict:
        """The companions on `device` (scales move as the weight does; the GGUF type and the packing stay numbers)."""
        values = {c: getattr(self, c) for c in self.companions}
        return {c: v if isinstance(v, (int, tuple)) else _to_device(v, device) for c, v in values.items()}

    def _dequantized(self, stored: torch.Tensor, shape, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """A new tensor of the weight's values (the host keeps it, or a forward returns it)."""
        return packed_dequant.dequantize(stored, self._companions(device), self.settings.dequant_dtype or dtype, shape)

    def _patched(self, value: torch.Tensor, functions: list, dtype: torch.dtype) -> torch.Tensor:
        if functions:
            # A copy: the host's patch functions add in place, and a float weight is the layer's own tensor.
            value = value.to(self.settings.patch_dtype, copy=True)
            for f in functions:
                value = f(value)
        return value.to(dtype)

    def weight_patches(self) -> list:
        """Every patch of the weight: LoRAs (the patcher's, then the host's weight functions), then hooks'."""
        return self.lazy_patches + compat.patch_functions(self, "weight") + self.hook_patches

    def weight_bias(self, device: torch.device, dtype: torch.dtype):
        """The weight and bias for one op, used at once (a packed weight may be the scratch buffer): patches
        work on a copy, so they never write into it."""
        weight = _to_device(self.weight, device)
        if self.companions:
            weight = forward_weight(weight, self._companions(device), self.settings.dequant_dtype or dtype,
                                    self.weight_shape)
        elif weight.dtype != dtype:  # a float weight kept as stored: cast into the scratch, not a new tensor per op
            weight = forward_weight(weight, {}, dtype, self.weight_shape)
        weight = self._patched(weight, self.weight_patches(), dtype)
        bias = None if self.bias is None else self._patched(_to_device(self.bias, device),
                                                            compat.patch_functions(self, "bias"), dtype)
        return weight, bias

    def forward(self, *args, **kwargs):
        import comfy.ops

        comfy.ops.run_every_op()
        return self.forward_comfy_cast_weights(*args, **kwargs)


class PackedConv(PackedLayer):
    def forward_comfy_cast_weights(self, input):
        return self._conv_forward(input, *self.weight_bias(input.device, input.dtype))


class PackedEmbedding(PackedLayer):
    def forward_comfy_cast_weights(self, input, out_dtype=None):
        dtype = out_dtype or self.settings.dequant_dtype or torch.float32
        if (not self.companions or packing.GGUF_TYPE in self.companions) and not self.weight_patches():
            # Float rows and GGUF rows (whole blocks) stand alone: the prompt's rows are gathered first and only
            # they are cast or dequantized, not the 131072-row table (2.7 GB in float32 for Mistral-Small).
            rows = _to_device(self.weight[input.reshape(-1).to(self.weight.device)], input.device)
            if self.companions:
                rows = self._dequantized(rows, (rows.shape[0], self.embedding_dim), input.device, dtype)
            return rows.to(dtype).reshape(*input.shape, self.embedding_dim)
        weight, _ = self.weight_bias(input.device, dtype)
        return torch.nn.functional.embedding(
            input, weight, self.padding_idx, self.max_norm, self.norm_type, self.scale_grad_by_freq, self.sparse
        )


def packed_operations(dequant_dtype: torch.dtype | None = None, patch_dtype: torch.dtype = torch.float32,
                      cpu_matmul_dtype: torch.dtype | None = None):
    """A fresh comfy.ops class for one load: packed weights (those with companions) and bf16/fp16/fp32 weights
    stay as stored; other float weights load as the model's float tensors."""
    ensure_comfy()
    import comfy.ops

    settings = PackedSettings(dequant_dtype, patch_dtype, cpu_matmul_dtype)
    base = comfy.ops.manual_cast

    class PackedOps(base):
        class Linear(PackedLayer, base.Linear):
            def forward_comfy_cast_weights(self, input):
                dtype = settings.cpu_matmul_dtype if input.device.type == "cpu" else None
                if dtype is None or dtype == input.dtype:
                    return torch.nn.functional.linear(input, *self.weight_bias(input.device, input.dtype))
                out = torch.nn.functional.linear(input.to(dtype), *self.weight_bias(input.device, dtype))
                return out.to(input.dtype)

        class Conv1d(PackedConv, base.Conv1d):
            pass

        class Conv2d(PackedConv, base.Conv2d):
            pass

        class Conv3d(PackedConv, base.Conv3d):
            pass

        class Embedding(PackedEmbedding, base.Embedding):
            pass

    for layer in (PackedOps.Linear, PackedOps.Conv1d, PackedOps.Conv2d, PackedOps.Conv3d, PackedOps.Embedding):
        layer.settings = settings
    return PackedOps


def read_ahead(blocks) -> None:
    """Each of `blocks` (a model's layers, in the order they run) asks, as it starts, for the file pages of the next
    one's weights: a model mapped from a file larger than the memory is read from the disk while it computes."""
    from ..loaders.formats.validate import prefetch

    def hook(block, args, next_block):
        prefetch(t for layer in next_block.modules() if isinstance(layer, PackedLayer)
                 for t in (layer.weight, *(getattr(layer, c) for c in layer.companions))
                 if isinstance(t, torch.Tensor))

    for block, next_block in zip(blocks, blocks[1:]):
        block.register_forward_pre_hook(functools.partial(hook, next_block=next_block))


def _packed_layer(model, key: str):
    """The pack's layer whose weight `key` names (packed, or a float weight kept as stored), else None."""
    import comfy.utils

    path, _, name = key.rpartition(".")
    layer = comfy.utils.get_attr(model, path) if path else None
    return layer if isinstance(layer, PackedLayer) and name == "weight" else None


class _LoadedWeight(dict):
    """The host's `original_weights` for one packed weight: its dequantized values as loaded, made only when a
    patch reads them (the host's model_as_lora hooks)."""

    def __init__(self, layer: PackedLayer, like: torch.Tensor):
        super().__init__()
        self.layer, self.like = layer, like

    def __missing__(self, key):
        layer, device = self.layer, self.like.device
        stored = _to_device(layer.weight, device)
        return [(layer._dequantized(stored, layer.weight_shape, device, self.like.dtype), None)]


class HookPatch:
    """The active hooks' patches of one packed weight, applied by the host's LoRA arithmetic to the dequantized
    weight where the host's hook path would write them into the stored one."""

    def __init__(self, layer: PackedLayer, key: str, patches: list):
        self.layer, self.key, self.patches = layer, key, patches

    def __call__(self, weight: torch.Tensor) -> torch.Tensor:
        import comfy.lora

        return comfy.lora.calculate_weight(self.patches, weight, self.key, intermediate_dtype=weight.dtype,
                                           original_weights=_LoadedWeight(self.layer, weight))


class PackedPatching:
    """Mixed into the host's patcher class: where the host would bake a patch into a stored weight, a weight of
    the pack's layers gets it as a lazy patch, applied after dequantization (or the cast of a float weight kept as
    stored) in patch_dtype; the host's other weights (norms) are patched the host's way."""

    def _packed_layers(self):
        return (m for m in self.model.modules() if isinstance(m, PackedLayer))

    def clone(self, *args, **kwargs):
        # Newer releases clone a dynamic patcher into the plain class (disable_dynamic, the CPU fallback).
        return packed_patcher(super().clone(*args, **kwargs))

    def patch_weight_to_device(self, key, device_to=None, *args, **kwargs):
        layer = _packed_layer(self.model, key)
        if layer is None:
            return super().patch_weight_to_device(key, device_to, *args, **kwargs)
        import comfy.model_patcher

        patches = [comfy.model_patcher.LowVramPatch(key, self.patches)] if key in self.patches else []
        if kwargs.get("return_weight"):
            # 0.33 asks for the patched weight itself (to save a model): give its real values.
            device = device_to or layer.weight.device
            weight = layer._dequantized(_to_device(layer.weight, device), layer.weight_shape, device,
                                        layer.settings.patch_dtype)
            return layer._patched(weight, patches, layer.settings.patch_dtype)
        layer.lazy_patches = patches

    def patch_hook_weight_to_device(self, hooks, combined_patches, key, original_weights, memory_counter):
        layer = _packed_layer(self.model, key)
        if layer is None or key not in combined_patches:
            return super().patch_hook_weight_to_device(hooks, combined_patches, key, original_weights, memory_counter)
        import comfy.hooks

        patch = HookPatch(layer, key, combined_patches[key])
        layer.hook_patches = [patch]
        if self.hook_mode == comfy.hooks.EnumHookMode.MaxSpeed:
            # The host's cache of hooked weights holds the patch: patch_cached_hook_weights sets it again.
            self.cached_hook_patches.setdefault(hooks, {})[key] = (patch, None)

    def patch_cached_hook_weights(self, cached_weights, key, memory_counter):
        layer = _packed_layer(self.model, key)
        if layer is None:
            return super().patch_cached_hook_weights(cached_weights, key, memory_counter)
        layer.hook_patches = [cached_weights[key][0]]

    def unpatch_hooks(self, whitelist_keys_set=None):
        # As the host's own: the weights named, or every weight when none are.
        for name, layer in self.model.named_modules():
            if isinstance(layer, PackedLayer) and (not whitelist_keys_set or f"{name}.weight" in whitelist_keys_set):
                layer.hook_patches = []
        return super().unpatch_hooks(whitelist_keys_set)

    def unpatch_model(self, device_to=None, unpatch_weights=True):
        if unpatch_weights:
            for layer in self._packed_layers():
                layer.lazy_patches = []
        return super().unpatch_model(device_to, unpatch_weights)

    def partially_unload(self, *args, **kwargs):
        freed = super().partially_unload(*args, **kwargs)
        # Layers the host just moved to low-VRAM mode carry their patches as weight functions now (both releases).
        for layer in self._packed_layers():
            if getattr(layer, "comfy_patched_weights", None) is False:
                layer.lazy_patches = []
        return freed


@functools.cache
def _packed_class(host_class: type) -> type:
    return type(f"Packed{host_class.__name__}", (PackedPatching, host_class), {})


def packed_patcher(patcher):
    """The host's own patcher (whichever class it chose: plain, dynamic-VRAM, or a subclass), given the
    pack's patching of packed weights. PackedPatching adds behaviour only, no state, so the object is kept."""
    if not isinstance(patcher, PackedPatching):
        patcher.__class__ = _packed_class(type(patcher))
    return patcher
