"""The vision tower of Mistral-Small-3.x, for prompt upsampling's edits: the reference images (joined as
images.py makes them) as the model sees them, and their features in place of the chat's [IMG] tokens.

The Pixtral processor fits the joined image within the vision tower's image size and rounds each side up to
whole merged patches (bicubic), and normalises it. The features come from transformers' own Pixtral vision model
and Mistral3 projector, built from the checkpoint's config.json and weights (HF folders and pipelines carry them;
llama.cpp keeps them in a separate mmproj file, which the pack does not read)."""

from __future__ import annotations

import contextlib
import hashlib
import math
import os
from dataclasses import dataclass

import numpy as np
import torch

from ...errors import InputError, MissingWeightsError, UnsupportedFormatError
from ...tokenizers.chat import ImageGrid
from ..formats import packing
from ..formats.files import PIXTRAL_CONFIG, VISION_CONFIG
from ..formats.validate import checked
from ..models.encoder import EncoderPlan
from .images import joined

PARTS = ("vision_tower.", "multi_modal_projector.")  # transformers' module names in Mistral3's model
STORED_PREFIXES = ("model.", "")  # where a Mistral3 checkpoint stores them (transformers >= 4.52, older)
# The Pixtral processor's normalisation (Mistral-Small-3.1's preprocessor_config.json, the processor's defaults).
IMAGE_MEAN = (0.48145466, 0.4578275, 0.40821073)
IMAGE_STD = (0.26862954, 0.26130258, 0.27577711)
# Why a layout without the vision tower has none, beyond "it is not in the file".
NO_VISION_BECAUSE = {
    "gguf": "llama.cpp keeps the vision tower in a separate mmproj-*.gguf file, which the pack does not read",
    "mistral-native": "Mistral's own files name the vision encoder their own way, which the pack does not read",
}


@dataclass(frozen=True)
class VisionPlan:
    stored: dict[str, str]  # transformers name ("vision_tower.patch_conv.weight") -> stored name
    config: dict  # config.json's VISION_CONFIG fields
    width: int  # the language model's
    rms_norm_eps: float

    @property
    def patch(self) -> int:
        """The side of one image token in pixels (a merged patch)."""
        return self.config["vision_config"]["patch_size"] * self.config.get("spatial_merge_size", 1)

    @property
    def longest_edge(self) -> int:
        return self.config["vision_config"]["image_size"]


def plan_vision(plan: EncoderPlan) -> VisionPlan:
    """The vision tower and projector of a planned checkpoint, from its headers and config.json; refused, naming
    why, when it has none (then it can upsample text-to-image prompts only)."""
    stored = {}
    for name in plan.source.entries:
        prefix = next((p for p in STORED_PREFIXES if name.startswith(p + PARTS[0]) or name.startswith(p + PARTS[1])),
                      None)
        if prefix is not None:
            stored[name[len(prefix):]] = name
    has_config = isinstance(plan.source.settings.get("vision_config"), dict)
    if not stored or not has_config:
        family = "gguf" if plan.layout.startswith("gguf-") else plan.layout
        because = NO_VISION_BECAUSE.get(family, "the file holds no vision tower (vision_tower.*, "
                                                "multi_modal_projector.* and config.json's vision_config)")
        raise MissingWeightsError(
            f"{os.path.basename(plan.path)} cannot look at reference images: {because}. Upsample without images (text "
            f"to image), or for edits pick a Hugging Face Mistral-Small-3.x folder or the text_encoder/ of a FLUX.2 "
            "[dev] diffusers pipeline, which carry the vision tower."
        )
    for name, label in ((s, plan.source.entries[s][0]) for s in stored.values()):
        if packing.packed_format(label) is not None:
            raise UnsupportedFormatError(
                f"{os.path.basename(plan.path)} stores its vision tower quantized ({name}: {label}); the pack reads a "
                "vision tower in bf16, fp16 or fp32 only. Use a checkpoint whose vision tower is not quantized."
            )
    settings = checked(plan.source.settings, VISION_CONFIG, os.path.join(plan.path, "config.json"))
    config = {k: settings[k] for k in VISION_CONFIG if k in settings}
    config["vision_config"] = {k: v for k, v in config["vision_config"].items() if k in PIXTRAL_CONFIG}
    return VisionPlan(stored, config, plan.geometry.width, plan.geometry.rms_norm_eps)


# --- the images --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PreparedImage:
    pixels: torch.Tensor  # [1, 3, height, width] float32, normalised
    grid: ImageGrid
    digest: str  # of the joined, capped RGB pixels the processor starts from

    @property
    def size(self) -> tuple[int, int]:
        return tuple(self.pixels.shape[-2:])


def prepare(images: list, vision: VisionPlan) -> PreparedImage:
    """The pixels and [IMG] grid of the reference images (PIL images), as the Pixtral processor makes them."""
    from PIL import Image

    image = joined(images)
    rgb = np.asarray(image, dtype=np.uint8)
    height, width = rgb.shape[:2]
    ratio = max(height / vision.longest_edge, width / vision.longest_edge)
    if ratio > 1:
        height, width = int(math.floor(height / ratio)), int(math.floor(width / ratio))
    if min(height, width) < 1:
        raise InputError(f"The reference images, joined and capped, are {rgb.shape[1]}x{rgb.shape[0]} pixels: fitted "
                         f"into the vision tower's {vision.longest_edge} pixels, one side is under one pixel. Give "
                         "images less long and thin.")
    p = vision.patch
    rows, columns = -(-height // p), -(-width // p)
    resized = np.asarray(image.resize((columns * p, rows * p), Image.Resampling.BICUBIC), dtype=np.uint8)
    scaled = (resized.astype(np.float64) * (1 / 255)).astype(np.float32)
    normalised = (scaled - np.asarray(IMAGE_MEAN, np.float32)) / np.asarray(IMAGE_STD, np.float32)
    pixels = torch.from_numpy(np.ascontiguousarray(normalised.transpose(2, 0, 1)))[None]
    digest = hashlib.sha256(repr(rgb.shape).encode() + rgb.tobytes()).hexdigest()
    return PreparedImage(pixels, ImageGrid(rows, columns), digest)


# --- the model ---------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    # transformers builds a model in the dtype it loads it in; parameters made so need no second copy
    saved = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(saved)


class VisionEncoder(torch.nn.Module):
    """transformers' Pixtral vision model and Mistral3 projector on a checkpoint's weights: an image's features,
    one per [IMG] token, in the language model's width."""

    def __init__(self, vision: VisionPlan, weights: dict[str, torch.Tensor], dtype: torch.dtype):
        super().__init__()
        from transformers import Mistral3Config
        from transformers.models.mistral3.modeling_mistral3 import Mistral3MultiModalProjector
        from transformers.models.pixtral.modeling_pixtral import PixtralVisionModel

        config = Mistral3Config(
            vision_config={"model_type": "pixtral", **vision.config["vision_config"]},
            text_config={"model_type": "mistral", "hidden_size": vision.width, "rms_norm_eps": vision.rms_norm_eps},
            **{k: v for k, v in vision.config.items() if k != "vision_config"},
        )
        config.vision_config._attn_implementation = "sdpa"
        with _default_dtype(dtype):
            self.vision_tower = PixtralVisionModel(config.vision_config)
            self.multi_modal_projector = Mistral3MultiModalProjector(config)
        self.load_state_dict(weights, strict=True)
        self.requires_grad_(False)

    def forward(self, image: PreparedImage) -> torch.Tensor:
        device = next(self.parameters()).device
        size = [image.size]
        states = self.vision_tower(image.pixels.to(device), image_sizes=size).last_hidden_state
        return self.multi_modal_projector(states.squeeze(0), size)


def read_vision_weights(plan: EncoderPlan, vision: VisionPlan) -> dict[str, torch.Tensor]:
    return {name: plan.source.read(stored) for name, stored in vision.stored.items()}
