"""Source nodes for FLUX.2 parts kept as diffusers pipeline folders (models/diffusers) or single files: the
VAE (shared by [dev] and Klein), the [dev] text encoder, and the transformer of any FLUX.2 variant."""

from __future__ import annotations

from comfy_api.latest import io

from ..host.menus import chosen_path, model_choices
from ..loaders.models.node_titles import title
from .shared import CACHE_TOOLTIP, CLIP_TOOLTIP, KEEP_LOADED_TOOLTIP, MODEL_TOOLTIP, PADDING_TOOLTIP, schema


class Flux2DevVAESource(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return schema(
            "Flux2DevVAESource",
            "The FLUX.2 VAE, from models/vae (flux2-vae.safetensors, BFL's ae.safetensors, its small-decoder "
            "full_encoder_small_decoder.safetensors or a diffusers vae/ folder) or from any FLUX.2 pipeline folder in "
            "models/diffusers: [dev] and Klein share one VAE, so a Klein pipeline serves [dev] too. Not the FLUX.1 "
            "VAE, which core's Load VAE also lists.",
            [
                io.Combo.Input(
                    "vae",
                    options=list(model_choices("vae")),
                    tooltip="A FLUX.2 pipeline folder from models/diffusers ([dev] or Klein: they share the VAE), or "
                    "from models/vae the FLUX.2 ae.safetensors, full_encoder_small_decoder.safetensors (a faster, "
                    "narrower decoder) or a diffusers vae/ folder. Not the FLUX.1 VAE.",
                )
            ],
            [io.Vae.Output(tooltip="The FLUX.2 VAE: connect it to VAE Decode (and VAE Encode for reference images).")],
        )

    @classmethod
    def execute(cls, vae) -> io.NodeOutput:
        from ..host.vae import load_vae

        return io.NodeOutput(load_vae(chosen_path("vae", vae, "The VAE")))


class Flux2DevEncoderSource(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        from ..tokenizers import PADDING_MODES

        return schema(
            "Flux2DevEncoderSource",
            "The Mistral-Small text encoder and tokenizer inside a FLUX.2 [dev] diffusers pipeline folder in "
            "models/diffusers (a copy of black-forest-labs/FLUX.2-dev). Pick this one when you keep the whole "
            f"pipeline; for an encoder file or folder of its own use {title('Flux2DevEncoderLoader')}. Klein "
            "pipelines carry a Qwen3 encoder that cannot condition [dev] and are refused before loading.",
            [
                io.Combo.Input(
                    "pipeline",
                    options=list(model_choices("dev pipeline")),
                    tooltip="A FLUX.2 [dev] pipeline folder from models/diffusers (a copy of "
                    "black-forest-labs/FLUX.2-dev with model_index.json, text_encoder/ and tokenizer/). Klein "
                    "pipelines are refused: their text encoder cannot condition [dev].",
                ),
                io.Combo.Input("padding", options=list(PADDING_MODES), default=PADDING_MODES[0],
                               tooltip=PADDING_TOOLTIP),
                io.String.Input("cache", default="", optional=True, tooltip=CACHE_TOOLTIP),
                io.Boolean.Input("keep_loaded", default=True, optional=True, tooltip=KEEP_LOADED_TOOLTIP),
            ],
            [io.Clip.Output(tooltip=CLIP_TOOLTIP + " Its weights are read on the first prompt not in the cache.")],
        )

    @classmethod
    def execute(cls, pipeline, padding, cache="", keep_loaded=True) -> io.NodeOutput:
        from ..host.clip import pipeline_clip

        # Any FLUX.2 pipeline is listed, so that a Klein one (from a shared workflow) is refused by name.
        path = chosen_path("pipeline", pipeline, "The pipeline folder")
        return io.NodeOutput(pipeline_clip(path, padding=padding, cache=cache, keep_loaded=keep_loaded))


class Flux2DevTransformerSource(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return schema(
            "Flux2DevTransformerSource",
            "A FLUX.2 transformer ([dev], Klein 4B or Klein 9B: the weights say which) from a .safetensors file in "
            "models/diffusion_models (BFL keys: bf16, or any quantization ComfyUI reads, such as "
            "flux2_dev_fp8mixed.safetensors, flux2-dev-nvfp4.safetensors or an MXFP8, INT8, W4A4 or W4A8 file) or a "
            "pipeline folder in models/diffusers (diffusers transformer/, sharded or not). For .gguf files use "
            f"{title('Flux2DevGGUFTransformerLoader')}. Conditioning from another variant's text encoder is refused "
            "when sampling starts.",
            [
                io.Combo.Input(
                    "transformer",
                    options=list(model_choices("transformer")),
                    tooltip="A FLUX.2 pipeline folder from models/diffusers, or from models/diffusion_models a FLUX.2 "
                    "transformer .safetensors (such as flux2_dev_fp8mixed.safetensors) or a diffusers transformer/ "
                    f"folder. For .gguf files use {title('Flux2DevGGUFTransformerLoader')}.",
                )
            ],
            [io.Model.Output(tooltip=MODEL_TOOLTIP)],
        )

    @classmethod
    def execute(cls, transformer) -> io.NodeOutput:
        from ..host.model import load_model

        return io.NodeOutput(load_model(chosen_path("transformer", transformer, "The transformer")))

