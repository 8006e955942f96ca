"""Flux2DevEncoderLoader: a FLUX.2 [dev] text encoder in any layout, as the host's CLIP."""

from __future__ import annotations

from comfy_api.latest import io

from ..host.menus import chosen_path, model_choices
from ..loaders.models.node_titles import title
from ..tokenizers import PADDING_MODES
from .shared import CACHE_TOOLTIP, CLIP_TOOLTIP, KEEP_LOADED_TOOLTIP, PADDING_TOOLTIP, schema


class Flux2DevEncoderLoader(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return schema(
            "Flux2DevEncoderLoader",
            "The Mistral-Small text encoder of FLUX.2 [dev] from models/text_encoders, in any layout: a ComfyUI file "
            "(bf16, or any quantization ComfyUI reads: fp8, NVFP4, MXFP8, INT8, W4A4, W4A8), a .gguf quantization, a "
            "Hugging Face, diffusers text_encoder/ or Mistral native folder. Pick this one for an encoder file or "
            f"folder of its own; for the encoder inside a whole diffusers pipeline folder use "
            f"{title('Flux2DevEncoderSource')}. Only headers and the tokenizer are read here; the weights are read on "
            "the first prompt the conditioning cache does not hold.",
            [
                io.Combo.Input(
                    "encoder",
                    options=list(model_choices("encoder")),
                    tooltip="The Mistral-Small text encoder of FLUX.2 [dev], from models/text_encoders (or "
                    "models/clip): a single file such as mistral_3_small_flux2_bf16.safetensors or a quantized one "
                    "(fp8, NVFP4, MXFP8, INT8, W4A4, W4A8), a .gguf quantization, or a folder (Hugging Face, "
                    "diffusers text_encoder/, Mistral native; shown with a trailing /). Not the Qwen3 encoder of "
                    "FLUX.2 Klein.",
                ),
                io.Combo.Input("padding", options=list(PADDING_MODES), default=PADDING_MODES[0],
                               tooltip=PADDING_TOOLTIP),
                io.Boolean.Input(
                    "allow_network",
                    default=False,
                    tooltip="Only if no tokenizer is found on disk (none is embedded in the file, beside it, or "
                    "bundled with mistral-common): let the pack download FLUX.2 [dev]'s tokenizer from Hugging Face. "
                    "Off: nothing is ever downloaded.",
                ),
                io.String.Input(
                    "cache",
                    default="",
                    optional=True,
                    tooltip=CACHE_TOOLTIP,
                ),
                io.Boolean.Input(
                    "keep_loaded",
                    default=True,
                    optional=True,
                    tooltip=KEEP_LOADED_TOOLTIP,
                ),
            ],
            [io.Clip.Output(tooltip=CLIP_TOOLTIP + " Its weights are read on the first prompt not in the cache.")],
        )

    @classmethod
    def execute(cls, encoder, padding, allow_network, cache="", keep_loaded=True) -> io.NodeOutput:
        from ..host.clip import node_clip

        path = chosen_path("encoder", encoder, "The text encoder")
        return io.NodeOutput(node_clip(path, padding=padding, allow_network=allow_network, cache=cache,
                                       keep_loaded=keep_loaded))

