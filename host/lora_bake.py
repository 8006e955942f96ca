"""LoRAs baked into a transformer being converted (loaders/convert/transformer.py), through the same layout table
and host reader as the LoRA node (host/lora.py): every layout trainers publish is taken, and the host's own patch
arithmetic applies them, in float32, to each dense weight as the conversion streams it. The host's model is built
on the meta device for its key names alone: no weight is held.

Each LoRA's header is checked first, without the host (loaders/convert/lora.py); then every patch is tried on the
meta device, shapes alone, so the bake says how many of the LoRA's tensors it applies and which not, and refuses a
LoRA that applies to nothing before a byte is written."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..loaders.convert.lora import LoraFile, check_applies, read_lora
from ..loaders.formats.safetensors_file import SafetensorsFiles
from ..loaders.models import lora_layouts
from ..loaders.models.lora_layouts import TRANSFORMER
from ..loaders.models.transformer import LoadedTransformer, TransformerPlan
from . import compat, ensure_comfy
from .lora import MODEL_PREFIX, LoraReport, host_log_quiet, lora_patches, patch_entry, refusal


@dataclass
class Baked:
    """What one LoRA did, at the strength it was baked in with."""

    strength: float
    report: LoraReport


class LoraBake:
    """For convert_transformer's `patch`: `loras` ([(LoRA read by read_lora, strength)], applied in that order, as
    LoRA loader nodes in a chain). Called with the transformer's plan, it checks each LoRA against the plan's
    shapes and gives the function that patches one dense weight; `baked` tells what each LoRA did."""

    def __init__(self, loras: list[tuple[LoraFile, float]]):
        self.loras = loras
        self.baked: list[Baked] = []

    def __call__(self, plan: TransformerPlan):
        shapes = {key: shape for key, (shape, _) in plan.tensors.items()}
        for lora, _ in self.loras:
            check_applies(lora, shapes, plan.variant.name)
        ensure_comfy()
        import comfy.lora

        from .model import build_model

        meta = {key: torch.empty(shape, dtype=torch.bfloat16, device="meta") for key, shape in shapes.items()}
        patcher = build_model(LoadedTransformer(meta, plan.variant, plan.geometry, plan.layout.name),
                              dtype=torch.bfloat16, disable_dynamic=True, device=torch.device("meta"))
        ours = {MODEL_PREFIX + host: key for key, host in
                compat.unet_keys_renamed(patcher.model.model_config, plan.tensors).items()}
        host_shapes = {TRANSFORMER: {host: shapes[key] for host, key in ours.items()}}
        targets = {TRANSFORMER: lora_layouts.transformer_targets(host_shapes[TRANSFORMER], MODEL_PREFIX)}
        patches: dict[str, list] = {}
        for lora, strength in self.loras:
            files = SafetensorsFiles([lora.path])
            tensors = {name: files.read(name) for name in files.infos}
            made, report = lora_patches(tensors, lora.path, host_shapes, targets)
            if not report.applied_count:
                raise refusal(report, tensors, host_shapes)
            for key, adapter in made[TRANSFORMER].items():
                host_key, entry = patch_entry(key, adapter, strength)
                patches.setdefault(ours[host_key], []).append(entry)
            self.baked.append(Baked(strength, report))

        def apply(key: str, dense: torch.Tensor) -> torch.Tensor:
            found = patches.get(key)
            if not found:
                return dense
            with host_log_quiet():  # every patch was tried against its weight's shape already
                return comfy.lora.calculate_weight(found, dense.to(torch.float32), key,
                                                   intermediate_dtype=torch.float32)

        return apply


def summary(baked: Baked) -> str:
    """One line of what a LoRA did: how many of its tensors were baked in, and which were not."""
    return f"LoRA {baked.report.path} (strength {baked.strength:g}): " + baked.report.summary().replace("\n", "; ")


def lora_patch(loras: list[tuple[str, float]]) -> LoraBake:
    """`loras` ([(file, strength)]) as convert_transformer's `patch`, each file's header read and checked here."""
    return LoraBake([(read_lora(path), strength) for path, strength in loras])
