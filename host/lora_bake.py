"""LoRAs baked into a transformer being converted (loaders/convert/transformer.py): the host's own LoRA loader
reads them, so every format it takes for FLUX.2 is taken (kohya's lora_unet_, diffusers' transformer.,
generic BFL names, LyCoris ...), and the host's own patch arithmetic applies them, in float32, to each dense
weight as the conversion streams it. The host's model is built on the meta device for its key map alone: no
weight is held.

Each LoRA's header is checked first, without the host (loaders/convert/lora.py); then every patch the host made
of it is tried on the meta device, shapes alone, so the bake says which of the LoRA's layers it applies and
which not, and refuses a LoRA that applies to nothing before a byte is written."""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field

import torch

from ..errors import WrongModelError
from ..loaders.convert.lora import LoraFile, check_applies, read_lora
from ..loaders.formats.safetensors_file import SafetensorsFiles
from ..loaders.models.transformer import LoadedTransformer, TransformerPlan
from . import compat, ensure_comfy

PREFIX = "diffusion_model."  # the host's key of a transformer weight inside its model


@dataclass
class Baked:
    """What one LoRA did: the transformer weights it patches, the patches whose shape is not their weight's
    (the weight and its shape), and the LoRA's layers that name no weight of the transformer."""

    path: str
    strength: float
    layers: int
    applied: list[str] = field(default_factory=list)
    misfit: list[tuple[str, list[int]]] = field(default_factory=list)
    unmatched: list[str] = field(default_factory=list)
    unmatched_count: int = 0


@contextlib.contextmanager
def _quiet():
    """The host logs every key it does not load and every patch that does not fit; the bake reports them itself."""
    before = logging.root.manager.disable
    logging.disable(logging.ERROR)
    try:
        yield
    finally:
        logging.disable(before)


def _target_shape(shape: tuple[int, ...], offset) -> list[int]:
    """The shape a patch lands in: the weight's, or the slice `offset` (dim, start, length) names."""
    out = list(shape)
    if offset is not None:
        out[offset[0]] = offset[2]
    return out


def _fits(entry: tuple, key: str, shape: tuple[int, ...]) -> bool:
    """Whether the host's arithmetic applies `entry` (strength, adapter, strength_model, offset, function) to a
    weight of `shape`: tried on the meta device; the host calls the entry's function on the difference only
    once it has the weight's shape (a "set" patch copies, so its shape is compared)."""
    import comfy.lora

    strength, adapter, strength_model, offset, function = entry
    if isinstance(adapter, tuple) and adapter and adapter[0] == "set":
        return list(adapter[1][0].shape) == _target_shape(shape, offset)
    reached = []

    def record(diff):
        reached.append(True)
        return diff if function is None else function(diff)

    weight = torch.empty(shape, dtype=torch.float32, device="meta")
    try:
        comfy.lora.calculate_weight([(strength, adapter, strength_model, offset, record)], weight, key,
                                    intermediate_dtype=torch.float32)
    except (RuntimeError, ValueError, IndexError):  # shapes the host does not catch itself
        return False
    return bool(reached)


class LoraBake:
    """For convert_transformer's `patch`: `loras` ([(LoRA read by read_lora, strength)], applied in that order, as
    LoraLoader nodes in a chain). Called with the transformer's plan, it checks each LoRA against the plan's
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
        import comfy.sd

        from .model import build_model

        meta = {key: torch.empty(shape, dtype=torch.bfloat16, device="meta") for key, shape in shapes.items()}
        patcher = build_model(LoadedTransformer(meta, plan.variant, plan.geometry, plan.layout.name),
                              dtype=torch.bfloat16, disable_dynamic=True, device=torch.device("meta"))
        loaded_as = compat.unet_keys_renamed(patcher.model.model_config, plan.tensors)
        ours = {PREFIX + host: key for key, host in loaded_as.items()}
        names = comfy.lora.model_lora_keys_unet(patcher.model, {})
        patches: dict[str, list] = {}
        for lora, strength in self.loras:
            files = SafetensorsFiles([lora.path])
            with _quiet():
                loaded, _ = comfy.sd.load_lora_for_models(patcher, None, {n: files.read(n) for n in files.infos},
                                                          strength, 0)
                baked = self._judge(lora, strength, patcher, loaded, ours, shapes, patches, names)
            if not baked.applied:
                model = plan.variant.name
                raise WrongModelError(f"{lora.path} patches no weight of this {model} transformer: none of its "
                                      f"{baked.layers} layer(s) applies ({_not_applied(baked)}). It is a LoRA of "
                                      f"another model (or of a text encoder alone); pick one made for {model}.")
            self.baked.append(baked)
            patcher = loaded

        def apply(key: str, dense: torch.Tensor) -> torch.Tensor:
            found = patches.get(key)
            if not found:
                return dense
            with _quiet():
                return comfy.lora.calculate_weight(found, dense.to(torch.float32), key,
                                                   intermediate_dtype=torch.float32)

        return apply

    @staticmethod
    def _judge(lora: LoraFile, strength: float, before, after, ours: dict, shapes: dict, patches: dict,
               names: dict) -> Baked:
        """The patches `after` holds beyond `before` (one LoRA's), each tried against its weight's shape; those
        that fit join `patches` (BFL key -> the host's patch entries)."""
        baked = Baked(lora.path, strength, 0)
        for host_key, entries in after.patches.items():
            key = ours.get(host_key)
            if key is None:
                continue
            for entry in entries[len(before.patches.get(host_key, [])):]:
                if _fits(entry, host_key, shapes[key]):
                    baked.applied.append(key)
                    patches.setdefault(key, []).append(entry)
                else:
                    baked.misfit.append((key, _target_shape(shapes[key], entry[3])))
        made = len(baked.applied) + len(baked.misfit)
        baked.layers = max(len(lora.layers) + lora.others, made)
        baked.unmatched_count = baked.layers - made
        baked.unmatched = [layer for layer in sorted(lora.layers) if layer not in names][: baked.unmatched_count]
        return baked


def _not_applied(baked: Baked, shown: int = 3) -> str:
    """Which of a LoRA's layers were not applied, and why, in a clause."""
    parts = []
    if baked.misfit:
        listed = ", ".join(f"{key} is {shape}" for key, shape in baked.misfit[:shown])
        more = " ..." if len(baked.misfit) > shown else ""
        parts.append(f"{len(baked.misfit)} shaped unlike its weight ({listed}{more})")
    if baked.unmatched_count:
        listed = ", ".join(baked.unmatched[:shown])
        more = " ..." if baked.unmatched_count > min(shown, len(baked.unmatched)) else ""
        parts.append(f"{baked.unmatched_count} naming no weight of the transformer"
                     + (f" ({listed}{more})" if listed else ""))
    return "; ".join(parts)


def summary(baked: Baked) -> str:
    """One line of what a LoRA did: how many of its layers were baked in, and which were not."""
    line = (f"LoRA {baked.path} (strength {baked.strength:g}): {len(baked.applied)} of its {baked.layers} layer(s) "
            "baked in")
    return line + (f"; not applied: {_not_applied(baked)}" if len(baked.applied) < baked.layers else "")


def lora_patch(loras: list[tuple[str, float]]) -> LoraBake:
    """`loras` ([(file, strength)]) as convert_transformer's `patch`, each file's header read and checked here."""
    return LoraBake([(read_lora(path), strength) for path, strength in loras])
