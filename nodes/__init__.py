"""The pack's nodes (ComfyUI V3 API). Each module declares its nodes' UI schema and calls one loader
function per node, and lists them in NODES."""

from __future__ import annotations

import importlib

from comfy_api.latest import ComfyExtension

NODE_MODULES = ("encoder", "gguf", "sources")
CATEGORY = "loaders/FLUX.2"  # beside the host's own loaders

# Tooltips shared by more than one node.
PADDING_TOOLTIP = (
    "How the prompt's tokens are laid out. reference (the default): as Black Forest Labs' and diffusers' own "
    "FLUX.2 [dev] pipelines, padded to 512 tokens, for images that match the official ones. comfy: exactly "
    "ComfyUI's built-in FLUX.2 text encoder, to reproduce workflows made with it."
)
MODEL_TOOLTIP = "The FLUX.2 transformer: connect it to a guider (BasicGuider) or a sampler, through LoRA loaders if any."
CLIP_TOOLTIP = "The FLUX.2 [dev] text encoder: connect it to CLIP Text Encode (and the host's other CLIP nodes)."


class Flux2DevExtension(ComfyExtension):
    async def get_node_list(self):
        nodes = []
        for name in NODE_MODULES:
            nodes.extend(importlib.import_module(f".{name}", __name__).NODES)
        return nodes
