"""LoRAs in every layout trainers publish, on a FLUX.2 MODEL (the host's own or the pack's, dense or packed) and
the FLUX.2 [dev] CLIP. The judge (loaders/models/lora_plan.py) decides what each tensor does; here its plan becomes
the host's own patches, so strengths, hooks and offloading behave as the host's: the host's weight adapters do the
arithmetic, wrapped in the pack's adapter where the host's differs from the trainer's (DoRA, OFT's rescale, a
replacement, the final norm's halves). Then each layer's change is computed as the host computes it, and the report
says what changed: a layer that changes nothing is not counted, and one whose change is not finite is refused."""

from __future__ import annotations

import functools
import logging
from collections import defaultdict
from dataclasses import dataclass, field

import torch

from ..errors import CorruptFileError, HostError, WrongModelError
from ..loaders.formats.safetensors_file import SafetensorsFiles
from ..loaders.models import lora_layouts
from ..loaders.models.lora_layouts import ENCODER, TRANSFORMER, Target
from ..loaders.models.lora_plan import ALPHA, LoraPlan, PlannedLayer, checked_strength, plan_lora, read_header
from ..loaders.models.node_titles import title
from ..loaders.models.transformer_layout import BFL
from . import compat, ensure_comfy
from .clip_tokenizer import CLIP_NAME

MODEL_PREFIX = "diffusion_model."  # the host's key of a transformer weight inside its model
ENCODER_PREFIX = CLIP_NAME + ".transformer."  # the host's key of a Mistral weight inside its CLIP
SHOWN = 3  # names listed per reason in a summary
UNCHANGED = "that change nothing here (factors that multiply to zero, or a change below float32's precision)"
NO_STRENGTH = "of a model whose strength is 0"


@dataclass
class LoraReport:
    """What one LoRA did, measured: its tensors applied to each model and the weights they changed, and the tensors
    not applied, by reason."""

    path: str
    total: int
    applied: dict[str, list[str]] = field(default_factory=dict)  # model word -> tensor names
    changed: dict[str, set[str]] = field(default_factory=dict)  # model word -> weight keys
    not_applied: dict[str, list[str]] = field(default_factory=dict)  # reason -> tensor names

    @property
    def applied_count(self) -> int:
        return sum(map(len, self.applied.values()))

    def summary(self) -> str:
        """Lines of what the LoRA did, for the node's text and the log."""
        weights = " and ".join(f"{len(keys)} weight{'s' if len(keys) != 1 else ''} of the {model}"
                               for model, keys in self.changed.items() if keys)
        lines = [f"{self.applied_count} of {self.total} LoRA tensors applied"
                 + (f", changing {weights}" if weights else "")]
        for reason, names in self.not_applied.items():
            names = sorted(names)
            listed = ", ".join(names[:SHOWN]) + (" ..." if len(names) > SHOWN else "")
            lines.append(f"{len(names)} not applied, {reason}: {listed}")
        return "\n".join(lines)


def read_tensors(files: SafetensorsFiles, plan: LoraPlan) -> dict[str, torch.Tensor]:
    """The tensors the plan's layers use, read, each refused unless every value is finite."""
    out = {}
    for layer in plan.layers:
        for name in layer.names:
            if name.endswith(ALPHA):
                continue  # read by the judge, and handed to the host as the planned alpha
            tensor = files.read(name)
            if not torch.isfinite(tensor).all():
                bad = "NaN" if torch.isnan(tensor).any() else "infinite values"
                raise CorruptFileError(f"{plan.path}: the LoRA's {name} holds {bad}; applied, it would make the weight "
                                       "it patches unusable. The file is damaged; download it again.")
            out[name] = tensor
    return out


def _swap_halves(rows: torch.Tensor) -> torch.Tensor:
    first, second = rows.chunk(2, dim=0)
    return torch.cat((second, first), dim=0)


def trained_weight(weight: torch.Tensor, key: str, strength: float, inner, magnitude, rescale, per_row: bool,
                   swap: bool) -> torch.Tensor:
    """`weight` moved `strength` of the way to what the trainer's own merge makes of it: the host's adapter `inner`
    at strength 1, OFT's `rescale` of its rows, DoRA's `magnitude` over each row (`per_row`) or column, all in the
    LoRA's own row order (`swap`: diffusers' final norm holds BFL's halves the other way round). In place, as the
    host's adapters patch."""
    import comfy.lora

    base = weight.to(torch.float32)
    if swap:
        base = _swap_halves(base)
    made = comfy.lora.calculate_weight([(1.0, inner, 1.0, None, None)], base.clone(), key,
                                       intermediate_dtype=torch.float32)
    if rescale is not None:
        made = made * rescale.to(made).reshape(-1, 1)
    if magnitude is not None:
        norm = made.norm(dim=1, keepdim=True) if per_row else made.norm(dim=0, keepdim=True)
        made = made * (magnitude.to(made).reshape(norm.shape) / (norm + torch.finfo(torch.float32).eps))
    change = (made - base) * strength
    weight += (_swap_halves(change) if swap else change).to(weight.dtype)
    return weight


@functools.cache
def trained_adapter():
    """The pack's weight adapter class (a host adapter class, made once the host is imported): calculate_weight is
    trained_weight over its weights (inner, magnitude, rescale, per_row, swap), which the host moves with it."""
    ensure_comfy()
    from comfy.weight_adapter.base import WeightAdapterBase

    class TrainedAdapter(WeightAdapterBase):
        name = "flux2dev-trained"

        def __init__(self, loaded_keys, weights):
            self.loaded_keys, self.weights = loaded_keys, weights

        def calculate_weight(self, weight, key, strength, strength_model, offset, function,
                             intermediate_dtype=torch.float32, original_weight=None):
            return trained_weight(weight, key, strength, *self.weights)

    return TrainedAdapter


def _needs_wrapping(layer: PlannedLayer) -> bool:
    """Whether the host's own adapter alone would apply the layer otherwise than its trainer: DoRA (the host takes a
    per-row magnitude's norm from the weight before the change), OFT (its rescale is dropped by the host's diagonal
    OFT, its strength doubled by the butterfly one), a replacement (the host ignores the strength), the final
    norm's swapped halves (a change that depends on the weight must see the trainer's row order)."""
    return layer.magnitude is not None or layer.kind.on_weight or layer.target.swap_halves


def patch_key(target: Target):
    """The host's patch key of a target: the weight's key, or (key, (dim, start, count)) for a run of its rows."""
    return target.key if target.rows is None else (target.key, (0, *target.rows))


def host_adapters(plan: LoraPlan, tensors: dict[str, torch.Tensor]) -> dict[str, object]:
    """Each planned layer's adapter, by layer name: the host's own, made by its LoRA reader from the layer's tensors
    alone (with the planned alpha), wrapped in the pack's where the host's arithmetic is not the trainer's."""
    ensure_comfy()
    import comfy.lora

    given, to_load = {}, {}
    for layer in plan.layers:
        withheld = ".rescale" if layer.kind.name == "OFT" else None  # applied by the pack's adapter
        for end, name in layer.tensors.items():
            if end not in (ALPHA, withheld):
                given[layer.name + end] = tensors[name]
        if layer.alpha is not None:
            given[layer.name + ALPHA] = torch.tensor(layer.alpha)
        to_load[layer.name] = layer.name
    with compat.host_warnings() as messages:
        made = comfy.lora.load_lora(lora=given, to_load=to_load)
    taken = compat.lora_keys_not_loaded(messages) | (set(to_load) - set(made))
    if taken:
        raise HostError(f"This ComfyUI's LoRA reader did not read {', '.join(sorted(taken)[:SHOWN])} of {plan.path}, "
                        "which the pack planned to apply; its LoRA reader differs from the one the pack was built for. "
                        "Report it with your ComfyUI version.")
    adapters = {}
    for layer in plan.layers:
        adapter = made[layer.name]
        if _needs_wrapping(layer):
            rescale = layer.tensors.get(".rescale") if layer.kind.name == "OFT" else None
            adapter = trained_adapter()(getattr(adapter, "loaded_keys", set()), (
                adapter, tensors[layer.magnitude] if layer.magnitude else None,
                tensors[rescale] if rescale else None, layer.per_row, layer.target.swap_halves))
        adapters[layer.name] = adapter
    return adapters


def entry(layer: PlannedLayer, adapter, strength: float) -> tuple:
    """The host's patch entry of a layer's adapter: (strength, adapter, strength_model, offset, function)."""
    return strength, adapter, 1.0, None if layer.target.rows is None else (0, *layer.target.rows), None


class Measure:
    """What each layer's change is, computed as the host computes it: on zeros where the change does not depend on
    the weight, else on the weight's own values (`values(key)`), in float32. A change that is not finite is refused,
    the host's errors while computing it become the pack's, and a layer that changes nothing is so reported."""

    def __init__(self, plan: LoraPlan, report: LoraReport):
        self.plan, self.report = plan, report

    def layer(self, layer: PlannedLayer, patch: tuple, base: torch.Tensor) -> torch.Tensor:
        """The weight `base` (float32, whole) after the layer's patch, the report updated; `base` is left as it is."""
        import comfy.lora

        with compat.host_warnings() as messages:
            after = comfy.lora.calculate_weight([patch], base.clone(), layer.target.key,
                                                intermediate_dtype=torch.float32)
        if messages:
            raise HostError(f"ComfyUI could not apply the layer {layer.name} of {self.plan.path} to "
                            f"{layer.target.key}: {messages[0]}")
        if not torch.isfinite(after).all():
            raise WrongModelError(
                f"{self.plan.path}: at strength {patch[0]:g} the LoRA's layer {layer.name} makes the weight "
                f"{layer.target.key} overflow (values beyond float32's range). Use a lower strength, or a LoRA made "
                "for this model.")
        if torch.equal(after, base):
            self.report.not_applied.setdefault(UNCHANGED, []).extend(layer.names)
        else:
            self.report.applied.setdefault(layer.target.model, []).extend(layer.names)
            self.report.changed.setdefault(layer.target.model, set()).add(layer.target.key)
        return after


def weight_shapes(module) -> dict[str, tuple[int, ...]]:
    """Each weight of a host module by its state-dict key -> its logical shape (a packed layer keeps its own)."""
    shapes = {key: tuple(t.shape) for key, t in module.state_dict().items()}
    for name, layer in module.named_modules():
        if hasattr(layer, "weight_shape"):
            shapes[f"{name}.weight"] = tuple(layer.weight_shape)
    return shapes


def _values(module, key: str, device: torch.device) -> torch.Tensor:
    """The float32 values of a host module's weight `key`, dequantized where the pack keeps it packed."""
    import comfy.utils

    from .ops import PackedLayer, _to_device

    path, _, name = key.rpartition(".")
    layer = comfy.utils.get_attr(module, path)
    if isinstance(layer, PackedLayer) and name == "weight":
        return layer._dequantized(_to_device(layer.weight, device), layer.weight_shape, device, torch.float32).float()
    return getattr(layer, name).to(device=device, dtype=torch.float32)


def measured(plan: LoraPlan, adapters: dict, strengths: dict[str, float], modules: dict,
             shapes: dict[str, dict[str, tuple[int, ...]]]) -> LoraReport:
    """The report of the plan's layers at each model's strength: every layer's change computed and checked, on the
    device its model computes on. `modules`: model word -> (the host module holding its weights, that device)."""
    report = LoraReport(plan.path, plan.total, not_applied={k: list(v) for k, v in plan.not_applied.items()})
    measure = Measure(plan, report)
    by_key = defaultdict(list)
    for layer in plan.layers:
        if strengths[layer.target.model] == 0:
            report.not_applied.setdefault(NO_STRENGTH, []).extend(layer.names)
        else:
            by_key[(layer.target.model, layer.target.key)].append(layer)
    for (model, key), layers in by_key.items():
        module, device = modules[model]
        on_weight = any(_needs_wrapping(layer) for layer in layers)
        base = _values(module, key, device) if on_weight else torch.zeros(shapes[model][key], device=device)
        for layer in layers:
            measure.layer(layer, entry(layer, adapters[layer.name], strengths[model]), base)
    return report


def load_lora(model, clip, path: str, strength_model: float, strength_clip: float):
    """(MODEL, CLIP, report): clones of `model` and `clip` (either may be None) with the LoRA at `path` applied at
    the strengths given, through the host's own patches; the report says what changed."""
    strengths = {TRANSFORMER: checked_strength(strength_model, "strength_model"),
                 ENCODER: checked_strength(strength_clip, "strength_clip")}
    header = read_header(path)
    shapes, targets, modules = {}, {}, {}
    if model is not None:
        modules[TRANSFORMER] = model.model, model.load_device
        shapes[TRANSFORMER] = weight_shapes(model.model)
        if MODEL_PREFIX + BFL.flux2_marker not in shapes[TRANSFORMER]:
            raise WrongModelError(
                f"The MODEL given to {title('Flux2DevLoraLoader')} is no FLUX.2 transformer "
                f"({type(model.model).__name__}, without {BFL.flux2_marker}). Use ComfyUI's own Load LoRA for other "
                "models."
            )
        targets[TRANSFORMER] = lora_layouts.transformer_targets(shapes[TRANSFORMER], MODEL_PREFIX)
    if clip is not None:
        modules[ENCODER] = clip.cond_stage_model, clip.patcher.load_device
        shapes[ENCODER] = weight_shapes(clip.cond_stage_model)
        targets[ENCODER] = lora_layouts.encoder_targets(shapes[ENCODER], ENCODER_PREFIX)
    plan = plan_lora(header, shapes, targets)
    adapters = host_adapters(plan, read_tensors(header.files, plan))
    if clip is not None and any(layer.target.model == ENCODER and _needs_wrapping(layer) for layer in plan.layers):
        from .clip_weights import load_weights

        if getattr(clip, "flux2dev_source", None) is not None:
            load_weights(clip)  # a change that depends on the weight is measured on the weight
    report = measured(plan, adapters, strengths, modules, shapes)
    patched = {TRANSFORMER: model, ENCODER: clip}
    for word, target in patched.items():
        keys = report.changed.get(word)
        if not keys:
            continue
        patches = {patch_key(layer.target): adapters[layer.name] for layer in plan.layers
                   if layer.target.model == word and layer.target.key in keys}
        patched[word] = target.clone()
        added = patched[word].add_patches(patches, strengths[word])
        if len(added) != len(patches):
            raise HostError(f"ComfyUI took {len(added)} of the {len(patches)} patches of {path} for the {word}; its "
                            "patcher differs from the one the pack was built for. Report it with your ComfyUI version.")
    logging.info("FLUX.2 LoRA %s: %s", path, report.summary().replace("\n", "; "))
    return patched[TRANSFORMER], patched[ENCODER], report
