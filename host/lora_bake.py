"""LoRAs baked into a transformer being converted (loaders/convert/transformer.py): the host's own LoRA loader
reads them, so every format it takes for FLUX.2 is taken (kohya's lora_unet_, diffusers' transformer.,
generic BFL names, LyCoris ...), and the host's own patch arithmetic applies them, in float32, to each dense
weight as the conversion streams it. The host's model is built on the meta device for its key map alone: no
weight is held."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..errors import UnsupportedFormatError, WrongModelError
from ..loaders.formats.safetensors_file import SafetensorsFiles
from ..loaders.models.transformer import LoadedTransformer, TransformerPlan
from . import compat, ensure_comfy

PREFIX = "diffusion_model."  # the host's key of a transformer weight inside its model


def read_lora(path: str) -> dict[str, torch.Tensor]:
    """A LoRA's tensors, from a .safetensors file only (pickled LoRAs can run code when opened)."""
    if not str(path).lower().endswith(".safetensors"):
        raise UnsupportedFormatError(
            f"{path}: LoRAs are read from .safetensors files only (pickled .pt/.ckpt/.bin files can run code when "
            "opened). Convert it to safetensors."
        )
    files = SafetensorsFiles([str(path)])
    return {name: files.read(name) for name in files.infos}


def _count(patches: dict) -> int:
    return sum(len(p) for p in patches.values())


def lora_patch(loras: list[tuple[str, float]]) -> Callable[[TransformerPlan], Callable[[str, torch.Tensor], torch.Tensor]]:
    """For convert_transformer: `loras` ([(file, strength)], applied in that order, as LoraLoader nodes in a
    chain) as a function of the transformer's plan, giving the function that patches one dense weight."""

    def make(plan: TransformerPlan) -> Callable[[str, torch.Tensor], torch.Tensor]:
        ensure_comfy()
        import comfy.lora
        import comfy.sd

        from .model import build_model

        meta = {key: torch.empty(shape, dtype=torch.bfloat16, device="meta") for key, (shape, _) in plan.tensors.items()}
        patcher = build_model(LoadedTransformer(meta, plan.variant, plan.geometry, plan.layout.name),
                              dtype=torch.bfloat16, disable_dynamic=True, device=torch.device("meta"))
        for path, strength in loras:
            before = _count(patcher.patches)
            patcher, _ = comfy.sd.load_lora_for_models(patcher, None, read_lora(path), strength, 0)
            if _count(patcher.patches) == before:
                raise WrongModelError(
                    f"{path} patches no weight of this {plan.variant.name} transformer: it is a LoRA of another model "
                    "(or of a text encoder alone). Pick a LoRA made for FLUX.2 [dev]."
                )
        loaded_as = compat.unet_keys_renamed(patcher.model.model_config, plan.tensors)
        patches = {key: patcher.patches[PREFIX + loaded_as[key]] for key in plan.tensors if PREFIX + loaded_as[key] in patcher.patches}

        def apply(key: str, dense: torch.Tensor) -> torch.Tensor:
            found = patches.get(key)
            if found is None:
                return dense
            return comfy.lora.calculate_weight(found, dense.to(torch.float32), key, intermediate_dtype=torch.float32)

        return apply

    return make
