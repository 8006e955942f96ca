"""Flux2DevEncoderLoader: a FLUX.2 [dev] text encoder in any layout, as the host's CLIP."""

from __future__ import annotations

from comfy_api.latest import io

from ..tokenizers import PADDING_MODES
from . import CATEGORY, CLIP_TOOLTIP, PADDING_TOOLTIP
from ..host.menus import chosen_path, model_choices


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
                io.Combo.Input(
                    "encoder",
                    options=list(model_choices("encoder")),
                    tooltip="The Mistral-Small text encoder of FLUX.2 [dev], from models/text_encoders (or models/clip): "
                    "a single file such as mistral_3_small_flux2_bf16.safetensors or its fp8 / NVFP4 versions, a .gguf "
                    "quantization, or a folder (Hugging Face, diffusers text_encoder/, Mistral native; shown with a "
                    "trailing /). Not the Qwen3 encoder of FLUX.2 Klein.",
                ),
                io.Combo.Input("padding", options=list(PADDING_MODES), default="reference", tooltip=PADDING_TOOLTIP),
                io.Boolean.Input(
                    "allow_network",
                    default=False,
                    tooltip="Only if no tokenizer is found on disk (none is embedded in the file, beside it, or bundled "
                    "with mistral-common): let the pack download FLUX.2 [dev]'s tokenizer from Hugging Face. Off: "
                    "nothing is ever downloaded.",
                ),
            ],
            outputs=[io.Clip.Output(tooltip=CLIP_TOOLTIP)],
        )

    @classmethod
    def execute(cls, encoder, padding, allow_network) -> io.NodeOutput:
        from ..host.clip import load_clip

        path = chosen_path("encoder", encoder, "The text encoder")
        return io.NodeOutput(load_clip(path, padding=padding, allow_network=allow_network))


NODES = [Flux2DevEncoderLoader]
