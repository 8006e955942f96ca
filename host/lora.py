"""LoRAs in every layout trainers publish, on a FLUX.2 MODEL (the host's own or the pack's, dense or packed) and
the FLUX.2 [dev] CLIP. The layout table (loaders/models/lora_layouts.py) says where each LoRA layer lands; the
host's own LoRA reader and weight adapters make the patches from that map, so strengths, hooks and offloading
behave as the host's. Every tensor is accounted for: applied, or named with the reason it was not, and a LoRA
none of whose tensors land is refused, saying what it is for."""

from __future__ import annotations

import contextlib
import logging
from collections import Counter
from dataclasses import dataclass, field

import torch

from ..errors import WrongModelError
from ..loaders.convert.lora import read_lora
from ..loaders.formats.safetensors_file import SafetensorsFiles
from ..loaders.models import lora_layouts
from ..loaders.models.lora_layouts import ENCODER, PAIRS, TRANSFORMER, LoraPlan, Target
from ..loaders.models.node_titles import title
from ..loaders.models.transformer_layout import BFL
from ..loaders.models.variants import known_variants
from . import compat, ensure_comfy
from .clip_tokenizer import CLIP_NAME

MODEL_PREFIX = "diffusion_model."  # the host's key of a transformer weight inside its model
ENCODER_PREFIX = CLIP_NAME + ".transformer."  # the host's key of a Mistral weight inside its CLIP
SHOWN = 3  # names listed per reason in a summary


@dataclass
class LoraReport:
    """What one LoRA did: its tensors applied to each model, and those not applied, by reason."""

    path: str
    total: int
    applied: dict[str, list[str]] = field(default_factory=dict)  # model word -> tensor names
    not_applied: dict[str, list[str]] = field(default_factory=dict)  # reason -> tensor names

    @property
    def applied_count(self) -> int:
        return sum(map(len, self.applied.values()))

    def summary(self) -> str:
        """Lines of what the LoRA did, for the node's text and the log."""
        parts = ", ".join(f"{len(names)} to the {model}" for model, names in self.applied.items() if names)
        lines = [f"{self.applied_count} of {self.total} LoRA tensors applied" + (f" ({parts})" if parts else "")]
        for reason, names in self.not_applied.items():
            listed = ", ".join(names[:SHOWN]) + (" ..." if len(names) > SHOWN else "")
            lines.append(f"{len(names)} not applied, {reason}: {listed}")
        return "\n".join(lines)


def _swap_halves(diff: torch.Tensor) -> torch.Tensor:
    first, second = diff.chunk(2, dim=0)
    return torch.cat((second, first), dim=0)


def patch_key(target: Target):
    """The host's patch key for a target: the weight's key, or (key, (dim, start, count) or None[, function])."""
    offset = None if target.rows is None else (0, *target.rows)
    if target.swap_halves:
        return target.key, offset, _swap_halves
    return target.key if offset is None else (target.key, offset)


def patch_entry(key, adapter, strength: float) -> tuple[str, tuple]:
    """(weight key, the host's patch entry) of a patch key from lora_patches, as the host's add_patches makes it."""
    key, offset, function = (key, None, None) if isinstance(key, str) else (*key, None)[:3]
    return key, (strength, adapter, 1.0, offset, function)


def weight_shapes(module) -> dict[str, tuple[int, ...]]:
    """Each weight of a host module by its state-dict key -> its logical shape (a packed layer keeps its own)."""
    shapes = {key: tuple(t.shape) for key, t in module.state_dict().items()}
    for name, layer in module.named_modules():
        if hasattr(layer, "weight_shape"):
            shapes[f"{name}.weight"] = tuple(layer.weight_shape)
    return shapes


def _target_shape(shape: tuple[int, ...], offset) -> list[int]:
    """The shape a patch lands in: the weight's, or the slice `offset` (dim, start, length) names."""
    out = list(shape)
    if offset is not None:
        out[offset[0]] = offset[2]
    return out


@contextlib.contextmanager
def host_log_quiet():
    """The host's log silenced inside the block, errors included."""
    previous = logging.root.manager.disable
    logging.disable(logging.ERROR)
    try:
        yield
    finally:
        logging.disable(previous)


def fits(entry: tuple, key: str, shape: tuple[int, ...]) -> bool:
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
        with host_log_quiet():  # the host logs a patch that does not fit; the report names it instead
            comfy.lora.calculate_weight([(strength, adapter, strength_model, offset, record)], weight, key,
                                        intermediate_dtype=torch.float32)
    except (RuntimeError, ValueError, IndexError):  # shapes the host does not catch itself
        return False
    return bool(reached)


UNPLACED = "naming no layer of the FLUX.2 transformer or its text encoder given"
MISFIT = "shaped unlike the weight their layer names"
UNUSED = "that change no weight (an alpha without its pair, a bias difference where FLUX.2 has no bias)"


def lora_patches(tensors: dict[str, torch.Tensor], path: str, shapes: dict[str, dict[str, tuple[int, ...]]],
                 layouts: dict[str, dict[str, Target]]) -> tuple[dict[str, dict], LoraReport]:
    """The host's patches of the LoRA `tensors` (from `path`) for each model word in `layouts` (its targets;
    `shapes`: its weights' shapes by key), and the report of every tensor. Only patches that fit their weight are
    kept."""
    ensure_comfy()
    import comfy.lora

    layout: LoraPlan = lora_layouts.plan(tensors, layouts)
    to_load = {layer: patch_key(target) for layer, target in layout.layers.items()}
    with compat.lora_keys_not_loaded() as not_loaded:
        made = comfy.lora.load_lora(lora=tensors, to_load=to_load)
    report = LoraReport(path, len(tensors))
    patches: dict[str, dict] = {model: {} for model in layouts}
    misfit: list[str] = []
    unused: list[str] = []
    for layer, target in layout.layers.items():
        key = to_load[layer]
        adapter = made.get(key)
        names = [n for n in layout.tensors[layer] if n not in not_loaded]
        bias = target.key.removesuffix(".weight") + ".bias"
        if bias not in shapes[target.model]:  # the host makes a bias patch of them, which lands nowhere
            unused.extend(n for n in names if n.endswith(lora_layouts.BIAS_PARTS))
            names = [n for n in names if not n.endswith(lora_layouts.BIAS_PARTS)]
        if adapter is None:
            unused.extend(names)
            continue
        if not fits(patch_entry(key, adapter, 1.0)[1], target.key, shapes[target.model][target.key]):
            misfit.extend(names)
            continue
        patches[target.model][key] = adapter
        report.applied.setdefault(target.model, []).extend(names)
    reasons = (
        (UNPLACED, layout.unplaced),
        ("of a kind the host's LoRA reader does not read", sorted(not_loaded - set(layout.unplaced))),
        (MISFIT, sorted(misfit)),
        (UNUSED, sorted(unused)),
    )
    report.not_applied = {reason: names for reason, names in reasons if names}
    return patches, report


def what_it_is_for(report: LoraReport, tensors: dict[str, torch.Tensor], shapes: dict[str, dict]) -> str:
    """A clause naming what a LoRA none of whose tensors landed was made for, as far as its names and the width of
    its layers' inputs tell (`shapes`: the weights' shapes of the models given, by model word)."""
    family = lora_layouts.other_family(tensors)
    if family is not None:
        return f"it is a LoRA of {family}"
    if ENCODER not in shapes and lora_layouts.names_model(report.not_applied.get(UNPLACED, ()), ENCODER):
        return "its layers are the text encoder's: connect the FLUX.2 [dev] CLIP to the node's clip input"
    hidden_size = shapes.get(TRANSFORMER, {}).get(MODEL_PREFIX + "img_in.weight", (None,))[0]
    downs = tuple(down for _, down in PAIRS)
    widths = Counter(tensors[n].shape[-1] for n in report.not_applied.get(MISFIT, ()) if n.endswith(downs))
    if not widths:
        return "its layers name no weight of a FLUX.2 transformer or of FLUX.2 [dev]'s Mistral text encoder"
    width = widths.most_common(1)[0][0]
    if width == hidden_size:
        return "its layers are shaped unlike the weights they name: a LoRA of another model, or written wrongly"
    models = [v.name for v in known_variants() if v.hidden_size == width]
    models += [family for family, _, family_width in lora_layouts.OTHER_FAMILIES if family_width == width]
    made_for = f": {' or '.join(models)}" if models else ""
    return f"its layers take inputs of width {width}, this transformer's are {hidden_size}; it is for another model" \
        + made_for


def refusal(report: LoraReport, tensors: dict[str, torch.Tensor], shapes: dict[str, dict]) -> WrongModelError:
    """The error for a LoRA none of whose tensors landed on the models whose weights' shapes `shapes` gives."""
    return WrongModelError(
        f"{report.path} patches nothing here: none of its {report.total} tensors lands on the "
        f"{' or the '.join(shapes) or 'nothing connected'} ({what_it_is_for(report, tensors, shapes)}).\n"
        f"{report.summary()}\nPick a LoRA made for FLUX.2 [dev]."
    )


def load_lora(model, clip, path: str, strength_model: float, strength_clip: float):
    """(MODEL, CLIP, report): clones of `model` and `clip` (either may be None) with the LoRA at `path` applied at
    the strengths given, through the host's own patches."""
    read_lora(path)  # its pairs and alphas checked from the header, before a tensor is read
    files = SafetensorsFiles([path])
    tensors = {name: files.read(name) for name in files.infos}
    shapes, layouts = {}, {}
    if model is not None:
        shapes[TRANSFORMER] = weight_shapes(model.model)
        if MODEL_PREFIX + BFL.flux2_marker not in shapes[TRANSFORMER]:
            raise WrongModelError(
                f"The MODEL given to {title('Flux2DevLoraLoader')} is no FLUX.2 transformer "
                f"({type(model.model).__name__}, without {BFL.flux2_marker}). Use ComfyUI's own Load LoRA for other "
                "models."
            )
        layouts[TRANSFORMER] = lora_layouts.transformer_targets(shapes[TRANSFORMER], MODEL_PREFIX)
    if clip is not None:
        shapes[ENCODER] = weight_shapes(clip.cond_stage_model)
        layouts[ENCODER] = lora_layouts.encoder_targets(shapes[ENCODER], ENCODER_PREFIX)
    patches, report = lora_patches(tensors, path, shapes, layouts)
    if not report.applied_count:
        raise refusal(report, tensors, shapes)
    if model is not None and strength_model != 0 and patches.get(TRANSFORMER):
        model = model.clone()
        model.add_patches(patches[TRANSFORMER], strength_model)
    if clip is not None and strength_clip != 0 and patches.get(ENCODER):
        clip = clip.clone()
        clip.add_patches(patches[ENCODER], strength_clip)
    logging.info("FLUX.2 LoRA %s: %s", path, report.summary().replace("\n", "; "))
    return model, clip, report
