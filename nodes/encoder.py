"""Flux2DevEncoderLoader: a FLUX.2 [dev] text encoder in any layout, as the host's CLIP."""

from __future__ import annotations

from comfy_api.latest import io

from ..tokenizers import PADDING_MODES
from . import CATEGORY
from .choices import chosen_path, has_config, model_choices

ENCODER_FILES = (".safetensors", ".gguf")


def encoder_choices() -> dict[str, str]:
    """Encoder files and folders in models/text_encoders and models/clip."""
    return model_choices("text_encoders", ENCODER_FILES, has_config)


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
                io.Combo.Input("encoder", options=list(encoder_choices())),
                io.Combo.Input("padding", options=list(PADDING_MODES), default="reference"),
                io.Boolean.Input("allow_network", default=False, tooltip="Let the tokenizer ladder download from the hub as a last resort."),
            ],
            outputs=[io.Clip.Output()],
        )

    @classmethod
    def execute(cls, encoder, padding, allow_network) -> io.NodeOutput:
        from ..host.clip import load_clip

        path = chosen_path(encoder_choices(), encoder, "The text encoder")
        return io.NodeOutput(load_clip(path, padding=padding, allow_network=allow_network))


NODES = [Flux2DevEncoderLoader]
