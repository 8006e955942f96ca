"""Source nodes for FLUX.2 parts kept as diffusers pipeline folders (models/diffusers) or single files: the
VAE (shared by [dev] and Klein), the [dev] text encoder, and the transformer of any FLUX.2 variant."""

from __future__ import annotations

from comfy_api.latest import io

from . import CATEGORY
from .choices import chosen_path, has_config, model_choices

SAFETENSORS = (".safetensors",)


def _is_pipeline(path: str) -> bool:
    from ..loaders.pipeline import pipeline_class

    return pipeline_class(path) is not None


def _pipelines() -> dict[str, str]:
    """The FLUX.2 pipeline folders in models/diffusers."""
    return model_choices("diffusers", (), _is_pipeline)


def _vaes() -> dict[str, str]:
    return {**_pipelines(), **model_choices("vae", SAFETENSORS, has_config)}


def _transformers() -> dict[str, str]:
    return {**_pipelines(), **model_choices("diffusion_models", SAFETENSORS, has_config)}


class Flux2DevVAESource(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="Flux2DevVAESource",
            display_name="FLUX.2 VAE source",
            category=CATEGORY,
            description=(
                "The FLUX.2 VAE from any FLUX.2 pipeline folder in models/diffusers ([dev] and Klein share one VAE, "
                "so a Klein pipeline serves [dev] too) or from an ae.safetensors in models/vae."
            ),
            inputs=[io.Combo.Input("vae", options=list(_vaes()))],
            outputs=[io.Vae.Output()],
        )

    @classmethod
    def execute(cls, vae) -> io.NodeOutput:
        from ..host.vae import load_vae

        return io.NodeOutput(load_vae(chosen_path(_vaes(), vae, "The VAE")))


class Flux2DevEncoderSource(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        from ..tokenizers import PADDING_MODES

        return io.Schema(
            node_id="Flux2DevEncoderSource",
            display_name="FLUX.2 [dev] text encoder source",
            category=CATEGORY,
            description=(
                "The Mistral-Small text encoder and tokenizer of a FLUX.2 [dev] pipeline folder in models/diffusers. "
                "Klein pipelines carry a Qwen3 encoder that cannot condition [dev] and are refused before loading."
            ),
            inputs=[
                io.Combo.Input("pipeline", options=list(_pipelines())),
                io.Combo.Input(
                    "padding",
                    options=list(PADDING_MODES),
                    default=PADDING_MODES[0],
                    tooltip="reference: left-pad to 512 as BFL/diffusers do; comfy: ComfyUI's own FLUX.2 conditioning.",
                ),
            ],
            outputs=[io.Clip.Output()],
        )

    @classmethod
    def execute(cls, pipeline, padding) -> io.NodeOutput:
        from ..host.clip import load_clip
        from ..loaders.pipeline import dev_encoder_folder

        folder = dev_encoder_folder(chosen_path(_pipelines(), pipeline, "The pipeline folder"))
        return io.NodeOutput(load_clip(str(folder), padding=padding))


class Flux2DevTransformerSource(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="Flux2DevTransformerSource",
            display_name="FLUX.2 transformer source",
            category=CATEGORY,
            description=(
                "A FLUX.2 transformer ([dev], Klein 4B or Klein 9B: the weights say which) from a pipeline folder in "
                "models/diffusers (diffusers transformer/, sharded or not) or a .safetensors file in "
                "models/diffusion_models (BFL keys, bf16 or scaled fp8). Conditioning from another variant's text "
                "encoder is refused when sampling starts."
            ),
            inputs=[io.Combo.Input("transformer", options=list(_transformers()))],
            outputs=[io.Model.Output()],
        )

    @classmethod
    def execute(cls, transformer) -> io.NodeOutput:
        from ..host.model import load_model

        return io.NodeOutput(load_model(chosen_path(_transformers(), transformer, "The transformer")))


NODES = [Flux2DevVAESource, Flux2DevEncoderSource, Flux2DevTransformerSource]
