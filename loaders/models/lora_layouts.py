"""Where each layer of a FLUX.2 LoRA lands, in every layout trainers publish: the transformer's layers under BFL
names (ComfyUI, kohya, LyCORIS) or diffusers names (diffusers, ai-toolkit, fal, OneTrainer, LyCORIS), diffusers'
separate q, k and v as slices of BFL's fused weights, and the Mistral encoder's layers under Hugging Face or kohya
names. Plain name logic over the model's own weight names and shapes, without torch: the host's LoRA reader gets
the map this makes (host/lora.py), and the bake of `convert transformer --lora` the same."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from .transformer_layout import DIFFUSERS_TO_BFL

TRANSFORMER, ENCODER = "transformer", "text encoder"

# What a trainer puts before a layer's module name, and which model that module is in. Names after a prefix are
# dotted or, kohya's way, with every dot an underscore; both are looked up. Longest first, so that no prefix is taken
# for a shorter one it starts with.
SPELLINGS = tuple(sorted((
    ("diffusion_model.", TRANSFORMER),  # BFL / ComfyUI
    ("model.diffusion_model.", TRANSFORMER),  # BFL, from a whole checkpoint
    ("transformer.", TRANSFORMER),  # diffusers / PEFT (diffusers, ai-toolkit, fal)
    ("base_model.model.", TRANSFORMER),  # PEFT's own state dict
    ("lora_unet_", TRANSFORMER),  # kohya
    ("lora_transformer_", TRANSFORMER),  # OneTrainer
    ("lycoris_", TRANSFORMER),  # LyCORIS
    ("", TRANSFORMER),  # bare module names
    ("text_encoders.", ENCODER),  # ComfyUI
    ("text_encoder.", ENCODER),  # diffusers / PEFT
    ("base_model.model.", ENCODER),  # PEFT's own state dict
    ("lora_te_", ENCODER),  # kohya
    ("lora_te1_", ENCODER),  # kohya, numbered
    ("", ENCODER),
), key=lambda spelling: -len(spelling[0])))

# The (up, down) endings of the LoRA pairs the host's reader takes, longest first so that no ending is taken for a
# shorter one it ends with; the layer's name is what comes before.
PAIRS = tuple(sorted((
    (".lora_up.weight", ".lora_down.weight"),  # kohya, generic
    ("_lora.up.weight", "_lora.down.weight"),  # diffusers (old)
    (".lora_B.weight", ".lora_A.weight"),  # PEFT / diffusers
    (".lora.up.weight", ".lora.down.weight"),  # diffusers
    (".lora_B", ".lora_A"),  # mochi
    (".lora_linear_layer.up.weight", ".lora_linear_layer.down.weight"),  # transformers
    (".lora_B.default.weight", ".lora_A.default.weight"),  # PEFT adapters named "default"
), key=lambda pair: -len(pair[0])))

# The endings of every tensor of a layer that the host's weight adapters read (LoRA, LoCon, DoRA, LoHa, LoKr, full
# and difference weights), longest first: what comes before is the layer's name.
PARTS = tuple(sorted((
    *(end for pair in PAIRS for end in pair), ".lora_mid.weight", ".alpha", ".dora_scale", ".reshape_weight",
    ".lokr_w1", ".lokr_w2", ".lokr_w1_a", ".lokr_w1_b", ".lokr_w2_a", ".lokr_w2_b", ".lokr_t2",  # LoKr
    ".hada_w1_a", ".hada_w1_b", ".hada_w2_a", ".hada_w2_b", ".hada_t1", ".hada_t2",  # LoHa
    ".diff", ".diff_b", ".set_weight", ".w_norm", ".b_norm",  # full weights and differences
), key=len, reverse=True))

BIAS_PARTS = (".diff_b", ".b_norm")  # parts the host adds to the layer's bias, not its weight

# Other model families whose LoRAs FLUX.2 users meet: the layers only they have (in kohya's underscore form; a
# LoRA naming them is for that family), and their width.
OTHER_FAMILIES = (
    ("FLUX.1", re.compile(r"(^|_)(img|txt)_mod_lin|blocks_\d+_modulation_lin|norm1(_context)?_linear|ff_net_0_proj"
                          r"|proj_mlp"), 3072),
)

WEIGHT_ENDINGS = (".weight", ".scale")  # a norm's weight is .scale in ComfyUI 0.3.75's FLUX.2, .weight later


@dataclass(frozen=True)
class Target:
    """The model weight a LoRA layer patches: its key in the model, the run of rows it patches (start, count) where
    it is one of the parts of a fused weight, and whether the two halves of its rows swap places (diffusers' final
    norm stores scale, shift; BFL shift, scale)."""

    key: str
    model: str
    rows: tuple[int, int] | None = None
    swap_halves: bool = False


def split_part(name: str) -> tuple[str, str] | None:
    """(layer, part) of a LoRA tensor's name, or None where its ending is no part a weight adapter reads."""
    for part in PARTS:
        if name.endswith(part) and len(name) > len(part):
            return name[: -len(part)], part
    return None


def _flat(name: str) -> str:
    return name.replace(".", "_")


def _module(key: str) -> str | None:
    return next((key[: -len(end)] for end in WEIGHT_ENDINGS if key.endswith(end)), None)


def transformer_targets(shapes: Mapping[str, tuple[int, ...]], prefix: str = "") -> dict[str, Target]:
    """Each module name a LoRA may give a transformer weight, BFL and diffusers, -> its Target. `shapes`: the model's
    weights by key, BFL names after `prefix` (the host's "diffusion_model.")."""
    modules = {}
    for key in shapes:
        module = _module(key)
        if module is not None and module.startswith(prefix):
            modules[module[len(prefix):]] = key
    targets = {name: Target(key, TRANSFORMER) for name, key in modules.items()}
    blocks = {int(m.split(".")[1]) for m in modules if m.startswith(("double_blocks.", "single_blocks."))}
    for bfl_key, sources, swap_halves in DIFFUSERS_TO_BFL:
        for n in range(max(blocks, default=-1) + 1) if "{n}" in bfl_key else (0,):
            key = modules.get(_module(bfl_key.format(n=n)))
            if key is None:
                continue
            rows = shapes[key][0] // len(sources)
            for i, source in enumerate(sources):
                targets[_module(source.format(n=n))] = Target(
                    key, TRANSFORMER, (i * rows, rows) if len(sources) > 1 else None, swap_halves)
    return targets


def encoder_targets(keys, prefix: str) -> dict[str, Target]:
    """Each module name a LoRA may give a Mistral encoder weight -> its Target. `keys`: the encoder's weights in the
    host's names, which are MistralForCausalLM's after `prefix` (the host's "mistral3_24b.transformer.")."""
    from .encoder_layouts import HF_SCHEME  # it imports torch; the LoRA header checks run before torch is imported

    targets = {}
    for key in keys:
        module = _module(key)
        if module is None or not module.startswith(prefix):
            continue
        targets[module] = Target(key, ENCODER)
        inner = module[len(prefix):]
        for stored in HF_SCHEME.prefixes:  # the language model inside Mistral3 in each transformers release
            if inner.startswith("model."):
                targets[stored + inner[len("model."):]] = Target(key, ENCODER)
    return targets


@dataclass
class LoraPlan:
    """Where a LoRA's layers land: layer name -> Target, each layer's tensor names, and the tensors that land
    nowhere (their layer names no weight of the models given, or their ending is no part an adapter reads)."""

    layers: dict[str, Target]
    tensors: dict[str, list[str]]
    unplaced: list[str]


def plan(names, targets: dict[str, dict[str, Target]]) -> LoraPlan:
    """Where the LoRA tensors `names` land, among `targets` (model word -> transformer_targets or encoder_targets;
    a model not given is not looked in)."""
    lookups = {}
    for model, found in targets.items():
        lookups[model] = {**{_flat(name): target for name, target in found.items()}, **found}
    out = LoraPlan({}, {}, [])
    for name in sorted(names):
        split = split_part(name)
        target = None if split is None else _target(split[0], lookups)
        if target is None:
            out.unplaced.append(name)
            continue
        out.layers[split[0]] = target
        out.tensors.setdefault(split[0], []).append(name)
    return out


def _target(layer: str, lookups: dict[str, dict[str, Target]]) -> Target | None:
    for prefix, model in SPELLINGS:
        if model in lookups and layer.startswith(prefix):
            found = lookups[model].get(layer[len(prefix):])
            if found is not None:
                return found
    return None


def names_model(names, model: str) -> bool:
    """Whether any of the LoRA tensors `names` is spelled as a trainer spells a layer of `model` alone (by its
    prefix)."""
    shared = {prefix for prefix, of in SPELLINGS if of != model}
    prefixes = tuple(prefix for prefix, of in SPELLINGS if of == model and prefix not in shared)
    return any(name.startswith(prefixes) for name in names)


def other_family(names) -> str | None:
    """The model family other than FLUX.2 whose layers the LoRA tensors `names` name, or None."""
    for family, pattern, _ in OTHER_FAMILIES:
        if any(pattern.search(_flat(name)) for name in names):
            return family
    return None
