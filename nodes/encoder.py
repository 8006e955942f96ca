"""Flux2DevEncoderLoader: a FLUX.2 [dev] text encoder in any layout, as the host's CLIP."""

from __future__ import annotations

import os

from comfy_api.latest import io

from ..tokenizers import PADDING_MODES
from . import CATEGORY

FOLDER = "text_encoders"
ENCODER_FILES = (".safetensors", ".gguf")


def encoder_choices() -> list[str]:
    """Files and folders in the host's text_encoders folders (models/text_encoders, models/clip)."""
    import folder_paths

    names = set()
    for root in folder_paths.get_folder_paths(FOLDER):
        if not os.path.isdir(root):
            continue
        for entry in os.listdir(root):
            full = os.path.join(root, entry)
            if os.path.isdir(full) or entry.lower().endswith(ENCODER_FILES):
                names.add(entry)
    return sorted(names)


def encoder_path(name: str) -> str:
    import folder_paths

    for root in folder_paths.get_folder_paths(FOLDER):
        full = os.path.join(root, name)
        if os.path.commonpath([os.path.abspath(root), os.path.abspath(full)]) == os.path.abspath(root) and os.path.exists(full):
            return full
    raise FileNotFoundError(f"{name} is not in any text_encoders folder ({', '.join(folder_paths.get_folder_paths(FOLDER))}).")


class Flux2DevEncoderLoader(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="Flux2DevEncoderLoader",
            display_name="Load FLUX.2 [dev] text encoder",
            category=CATEGORY,
            description="Loads the Mistral-Small text encoder of FLUX.2 [dev] from any layout (ComfyUI file, HF or "
            "diffusers folder, Mistral native, fp8, NVFP4, GGUF). 'reference' padding matches BFL/diffusers; "
            "'comfy' matches ComfyUI's own loader.",
            inputs=[
                io.Combo.Input("encoder", options=encoder_choices()),
                io.Combo.Input("padding", options=list(PADDING_MODES), default="reference"),
                io.Boolean.Input("allow_network", default=False, tooltip="Let the tokenizer ladder download from the hub as a last resort."),
            ],
            outputs=[io.Clip.Output()],
        )

    @classmethod
    def execute(cls, encoder, padding, allow_network) -> io.NodeOutput:
        from ..host.clip import load_clip

        return io.NodeOutput(load_clip(encoder_path(encoder), padding=padding, allow_network=allow_network))


NODES = [Flux2DevEncoderLoader]
