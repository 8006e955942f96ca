"""LoRAs baked into a transformer being converted (loaders/convert/transformer.py), judged by the same plan as the
LoRA node (loaders/models/lora_plan.py) and applied by the same adapters (host/lora.py), in float32, to each dense
weight as the conversion streams it. The host's model is built on the meta device for its key names alone: no
weight is held. Each LoRA is judged and its tensors read and checked before a byte is written; what each layer
changed is measured as it is baked, so the summary says what the file holds."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch

from ..loaders.models import lora_layouts
from ..loaders.models.lora_layouts import TRANSFORMER
from ..loaders.models.lora_plan import checked_strength, plan_lora, read_header
from ..loaders.models.transformer import LoadedTransformer, TransformerPlan
from . import compat, ensure_comfy
from .lora import MODEL_PREFIX, NO_STRENGTH, LoraReport, Measure, entry, host_adapters, read_tensors


@dataclass
class Baked:
    """What one LoRA did, at the strength it was baked in with."""

    strength: float
    report: LoraReport


class LoraBake:
    """For convert_transformer's `patch`: `loras` ([(file, strength)], applied in that order, as LoRA loader nodes
    in a chain). Called with the transformer's plan, it judges each LoRA against the plan's weights and gives the
    function that patches one dense weight; `baked` tells what each LoRA did."""

    def __init__(self, loras: list[tuple[str, float]]):
        self.loras = [(path, checked_strength(strength, f"The --strength of {path}")) for path, strength in loras]
        self.baked: list[Baked] = []

    def __call__(self, plan: TransformerPlan):
        ensure_comfy()
        from .model import build_model

        shapes = {key: shape for key, (shape, _) in plan.tensors.items()}
        meta = {key: torch.empty(shape, dtype=torch.bfloat16, device="meta") for key, shape in shapes.items()}
        patcher = build_model(LoadedTransformer(meta, plan.variant, plan.geometry, plan.layout.name),
                              dtype=torch.bfloat16, disable_dynamic=True, device=torch.device("meta"))
        ours = {MODEL_PREFIX + host: key for key, host in
                compat.unet_keys_renamed(patcher.model.model_config, plan.tensors).items()}
        host_shapes = {TRANSFORMER: {host: shapes[key] for host, key in ours.items()}}
        targets = {TRANSFORMER: lora_layouts.transformer_targets(host_shapes[TRANSFORMER], MODEL_PREFIX)}
        patches: dict[str, list] = defaultdict(list)  # our key -> [(measure, layer, patch entry)]
        for path, strength in self.loras:
            header = read_header(path)
            lora = plan_lora(header, host_shapes, targets)
            adapters = host_adapters(lora, read_tensors(header.files, lora))
            report = LoraReport(lora.path, lora.total, not_applied={k: list(v) for k, v in lora.not_applied.items()})
            measure = Measure(lora, report)
            for layer in lora.layers:
                if strength == 0:
                    report.not_applied.setdefault(NO_STRENGTH, []).extend(layer.names)
                else:
                    patches[ours[layer.target.key]].append((measure, layer, entry(layer, adapters[layer.name],
                                                                                  strength)))
            self.baked.append(Baked(strength, report))

        def apply(key: str, dense: torch.Tensor) -> torch.Tensor:
            values = dense.to(torch.float32)
            for measure, layer, patch in patches.get(key, ()):
                values = measure.layer(layer, patch, values)
            return values

        return apply


def summary(baked: Baked) -> str:
    """One line of what a LoRA did: how many of its tensors were baked in, and which were not."""
    return f"LoRA {baked.report.path} (strength {baked.strength:g}): " + baked.report.summary().replace("\n", "; ")
