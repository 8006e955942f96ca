"""Where each layer of a FLUX.2 LoRA lands, in every layout trainers publish: the transformer's layers under BFL
names (ComfyUI, kohya, LyCORIS) or diffusers names (diffusers, ai-toolkit, fal, OneTrainer, LyCORIS), diffusers'
separate q, k and v as slices of BFL's fused weights, and the Mistral encoder's layers under Hugging Face or kohya
names. Plain name logic over the model's own weight names and shapes, without torch; what each tensor of a LoRA does
is lora_plan.py's to judge."""

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

# Other model families whose LoRAs FLUX.2 users meet: the layers only they have (in kohya's underscore form; a
# LoRA naming them is for that family), and their width (None: more than one).
OTHER_FAMILIES = (
    ("FLUX.1", re.compile(r"(^|_)(img|txt)_mod_lin|blocks_\d+_modulation_lin|norm1(_context)?_linear|ff_net_0_proj"
                          r"|proj_mlp"), 3072),
    ("Stable Diffusion or SDXL", re.compile(r"(^|_)(text_model_encoder_layers|input_blocks|middle_block|output_blocks|"
                                            r"down_blocks_\d+_attentions|up_blocks_\d+_attentions)_"), None),
)
# The layers of a Mistral text encoder a LoRA names (kohya's underscore form): attention, MLP, embeddings.
MISTRAL_LAYER = re.compile(r"(^|_)(layers_\d+_(self_attn_[qkvo]_proj|mlp_(gate|up|down)_proj)|embed_tokens)(_|$)")

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


def lookups(targets: Mapping[str, Mapping[str, Target]]) -> dict[str, dict[str, Target]]:
    """Each model's targets (model word -> transformer_targets or encoder_targets) under dotted and kohya names."""
    return {model: {**{_flat(name): target for name, target in found.items()}, **found}
            for model, found in targets.items()}


def locate(layer: str, found: Mapping[str, Mapping[str, Target]]) -> tuple[str, Target] | None:
    """(the trainer's prefix, the Target) of a LoRA layer's name among `found` (from lookups; a model not given is
    not looked in), or None where it names no weight of them."""
    for prefix, model in SPELLINGS:
        if model in found and layer.startswith(prefix):
            target = found[model].get(layer[len(prefix):])
            if target is not None:
                return prefix, target
    return None


def names_encoder_layers(names) -> bool:
    """Whether any of the LoRA tensors `names` names a layer of a Mistral text encoder, in a spelling only encoders'
    layers are given (HF/PEFT or kohya)."""
    shared = {prefix for prefix, of in SPELLINGS if of != ENCODER}
    prefixes = tuple(prefix for prefix, of in SPELLINGS if of == ENCODER and prefix not in shared)
    return any(name.startswith(prefixes) and MISTRAL_LAYER.search(_flat(name)) for name in names)


def other_family(names) -> str | None:
    """The model family other than FLUX.2 whose layers the LoRA tensors `names` name, or None."""
    for family, pattern, _ in OTHER_FAMILIES:
        if any(pattern.search(_flat(name)) for name in names):
            return family
    return None
