"""The pack's nodes (ComfyUI V3 API). Each module declares its nodes' UI schema, and each node's execute calls one
function of host/; NODES is the list the host gets."""

from __future__ import annotations

from comfy_api.latest import ComfyExtension

from .encoder import Flux2DevEncoderLoader
from .gguf import Flux2DevGGUFTransformerLoader
from .lora import Flux2DevLoraLoader
from .sources import Flux2DevEncoderSource, Flux2DevTransformerSource, Flux2DevVAESource
from .upsampler import Flux2DevPromptUpsampler

NODES = (
    Flux2DevEncoderLoader,
    Flux2DevGGUFTransformerLoader,
    Flux2DevTransformerSource,
    Flux2DevEncoderSource,
    Flux2DevVAESource,
    Flux2DevLoraLoader,
    Flux2DevPromptUpsampler,
)


class Flux2DevExtension(ComfyExtension):
    async def get_node_list(self):
        from ..host.examples import install_example_inputs, serve_thumbnails

        install_example_inputs()  # here, not in on_load: ComfyUI 0.3.75 never calls on_load
        serve_thumbnails()
        return list(NODES)
