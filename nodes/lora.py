"""The FLUX.2 LoRA loader node."""

from __future__ import annotations

from comfy_api.latest import io, ui

from ..host.menus import chosen_path, model_choices
from ..loaders.models.lora_plan import STRENGTH_LIMIT
from .shared import CLIP_TOOLTIP, MODEL_TOOLTIP, schema

STRENGTH = {"default": 1.0, "min": -STRENGTH_LIMIT, "max": STRENGTH_LIMIT, "step": 0.01}


class Flux2DevLoraLoader(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return schema(
            "Flux2DevLoraLoader",
            "A FLUX.2 LoRA from models/loras on a FLUX.2 MODEL (ComfyUI's own or this pack's: bf16, every comfy_quant "
            "format, GGUF) and, where it holds text-encoder layers, on the FLUX.2 [dev] CLIP. It reads every layout "
            "trainers publish (ComfyUI/BFL, diffusers and PEFT with the alpha and DoRA in their metadata, kohya, "
            "OneTrainer, LyCORIS) at the scale each was trained at, and shows how many of the LoRA's tensors it "
            "applied and how many weights they changed, measured after patching, naming any it did not apply, where "
            "ComfyUI's own LoRA loaders drop what they cannot place with a line in the log. A LoRA that patches "
            "nothing here (one of FLUX.1, SDXL or Klein), or a damaged one, is refused.",
            [
                io.Model.Input("model", tooltip="The FLUX.2 transformer the LoRA patches."),
                io.Clip.Input("clip", optional=True, tooltip="The FLUX.2 [dev] text encoder, for a LoRA that also "
                              "patches it; leave it unconnected for a transformer-only LoRA."),
                io.Combo.Input("lora_name", options=list(model_choices("lora")),
                               tooltip="A FLUX.2 LoRA (.safetensors) from models/loras."),
                io.Float.Input("strength_model", **STRENGTH, tooltip="How strongly the LoRA patches the transformer; "
                               "0 leaves it as it is, negative values subtract the LoRA."),
                io.Float.Input("strength_clip", **STRENGTH, tooltip="How strongly the LoRA patches the text encoder, "
                               "where it holds text-encoder layers."),
            ],
            [io.Model.Output(tooltip=MODEL_TOOLTIP), io.Clip.Output(tooltip=CLIP_TOOLTIP)],
        )

    @classmethod
    def execute(cls, model, lora_name, strength_model, strength_clip, clip=None) -> io.NodeOutput:
        from ..host.lora import load_lora

        model, clip, report = load_lora(model, clip, chosen_path("lora", lora_name, "The LoRA"), strength_model,
                                        strength_clip)
        return io.NodeOutput(model, clip, ui=ui.PreviewText(report.summary()))
