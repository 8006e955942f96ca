"""The FLUX.2 GGUF transformer loader node."""

from __future__ import annotations

from comfy_api.latest import io

from ..host import model
from ..host.menus import chosen_path, model_choices
from ..loaders.models.node_titles import title
from .shared import MODEL_TOOLTIP, dtype_input, schema


class Flux2DevGGUFTransformerLoader(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return schema(
            "Flux2DevGGUFTransformerLoader",
            "A FLUX.2 transformer quantized as .gguf ([dev], Klein 4B or Klein 9B: the file says which) from "
            "models/diffusion_models or models/unet, such as city96's FLUX.2-dev-gguf files. Pick this one for "
            f".gguf files; for .safetensors files and pipeline folders use {title('Flux2DevTransformerSource')}. "
            "Weights stay quantized in memory and are expanded one layer at a time while sampling; LoRAs apply on top "
            "as usual.",
            [
                io.Combo.Input(
                    "gguf_name",
                    options=list(model_choices("gguf")),
                    tooltip="A FLUX.2 transformer quantized as .gguf (for example one of city96's FLUX.2-dev-gguf "
                    "files), from models/diffusion_models or models/unet. Not a text encoder .gguf: those go to "
                    f"{title('Flux2DevEncoderLoader')}.",
                ),
                dtype_input(
                    "dequant_dtype", model.DEQUANT_DTYPES, "default",
                    "The precision each layer's weights are expanded to while sampling. default: the model's own "
                    "compute precision (best for most); float32 uses more memory for no visible gain.",
                ),
                dtype_input(
                    "patch_dtype", model.PATCH_DTYPES, "float32",
                    "The precision LoRAs are added in, on each expanded layer. float32 (the default) is exact; "
                    "bfloat16 or float16 save a little memory with large LoRAs.",
                ),
            ],
            [io.Model.Output(tooltip=MODEL_TOOLTIP)],
        )

    @classmethod
    def execute(cls, gguf_name, dequant_dtype, patch_dtype) -> io.NodeOutput:
        path = chosen_path("gguf", gguf_name, "The GGUF file")
        return io.NodeOutput(model.load_gguf_model(
            path, dequant_dtype=model.DEQUANT_DTYPES[dequant_dtype], patch_dtype=model.PATCH_DTYPES[patch_dtype]
        ))

