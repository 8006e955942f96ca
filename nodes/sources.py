"""Source nodes for FLUX.2 parts kept as diffusers pipeline folders (models/diffusers) or single files: the
VAE (shared by [dev] and Klein), the [dev] text encoder, and the transformer of any FLUX.2 variant."""

from __future__ import annotations

from comfy_api.latest import io

from . import CATEGORY

PIPELINE_MARK = "/"  # pipeline folders are listed with a trailing slash, files by their name


def _pipelines() -> dict[str, str]:
    """{"<folder>/": path} for the FLUX.2 pipeline folders under models/diffusers."""
    import os

    import folder_paths

    from ..loaders.pipeline import find_pipelines

    found = {}
    for root in folder_paths.get_folder_paths("diffusers"):
        for path in find_pipelines([root]):
            found[os.path.relpath(path, root) + PIPELINE_MARK] = str(path)
    return found


def _files(folder: str) -> dict[str, str]:
    import folder_paths

    names = [n for n in folder_paths.get_filename_list(folder) if n.endswith(".safetensors")]
    return {name: folder_paths.get_full_path_or_raise(folder, name) for name in names}


def _resolve(choices: dict[str, str], name: str, what: str) -> str:
    if name not in choices:
        raise FileNotFoundError(f"{what} {name!r} is no longer there; refresh the node list and choose again.")
    return choices[name]


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
            inputs=[io.Combo.Input("vae", options=sorted(_pipelines()) + sorted(_files("vae")))],
            outputs=[io.Vae.Output()],
        )

    @classmethod
    def execute(cls, vae) -> io.NodeOutput:
        from ..host.vae import load_vae

        return io.NodeOutput(load_vae(_resolve({**_pipelines(), **_files("vae")}, vae, "The VAE")))


class Flux2DevEncoderSource(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        from ..tokenizers import PADDING_MODES

        return io.Schema(
            node_id="Flux2DevEncoderSource",
            display_name="FLUX.2 [dev] text encoder from pipeline",
            category=CATEGORY,
            description=(
                "The Mistral-Small text encoder and tokenizer of a FLUX.2 [dev] pipeline folder in models/diffusers. "
                "Klein pipelines carry a Qwen3 encoder that cannot condition [dev] and are refused before loading."
            ),
            inputs=[
                io.Combo.Input("pipeline", options=sorted(_pipelines())),
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

        folder = dev_encoder_folder(_resolve(_pipelines(), pipeline, "The pipeline folder"))
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
            inputs=[io.Combo.Input("transformer", options=sorted(_pipelines()) + sorted(_files("diffusion_models")))],
            outputs=[io.Model.Output()],
        )

    @classmethod
    def execute(cls, transformer) -> io.NodeOutput:
        from ..host.model import load_model

        choices = {**_pipelines(), **_files("diffusion_models")}
        return io.NodeOutput(load_model(_resolve(choices, transformer, "The transformer")))


NODES = [Flux2DevVAESource, Flux2DevEncoderSource, Flux2DevTransformerSource]
