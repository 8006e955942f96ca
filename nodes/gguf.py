"""The FLUX.2 GGUF transformer loader node."""

from __future__ import annotations

from comfy_api.latest import io

from ..host import gguf_ops
from . import CATEGORY
from .choices import chosen_path, model_choices


def gguf_choices() -> dict[str, str]:
    """The .gguf files in models/diffusion_models and models/unet."""
    return model_choices("diffusion_models", (".gguf",))


class Flux2DevGGUFTransformerLoader(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="Flux2DevGGUFTransformerLoader",
            display_name="Load FLUX.2 GGUF transformer",
            category=CATEGORY,
            description=(
                "Loads a FLUX.2 transformer GGUF ([dev], Klein 4B or Klein 9B: the file says which) from "
                "models/diffusion_models or models/unet. Weights stay quantized in memory and are expanded one "
                "layer at a time while sampling; LoRAs apply on top as usual."
            ),
            inputs=[
                io.Combo.Input("gguf_name", options=list(gguf_choices())),
                io.Combo.Input(
                    "dequant_dtype",
                    options=list(gguf_ops.DEQUANT_DTYPES),
                    default="default",
                    tooltip="The dtype each layer is expanded to; default: the model's compute dtype.",
                ),
                io.Combo.Input(
                    "patch_dtype",
                    options=list(gguf_ops.PATCH_DTYPES),
                    default="float32",
                    tooltip="The dtype LoRA patches are computed in, on each expanded layer.",
                ),
            ],
            outputs=[io.Model.Output()],
        )

    @classmethod
    def execute(cls, gguf_name, dequant_dtype, patch_dtype) -> io.NodeOutput:
        path = chosen_path(gguf_choices(), gguf_name, "The GGUF file")
        model = gguf_ops.load_gguf_model(
            path, dequant_dtype=gguf_ops.DEQUANT_DTYPES[dequant_dtype], patch_dtype=gguf_ops.PATCH_DTYPES[patch_dtype]
        )
        return io.NodeOutput(model)


NODES = [Flux2DevGGUFTransformerLoader]
