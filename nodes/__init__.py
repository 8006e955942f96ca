"""The pack's nodes (ComfyUI V3 API). Each module declares its nodes' UI schema and calls one loader
function per node, and lists them in NODES."""

from __future__ import annotations

import importlib

from comfy_api.latest import ComfyExtension

NODE_MODULES = ("encoder", "gguf", "sources")
CATEGORY = "loaders/FLUX.2"  # beside the host's own loaders


class Flux2DevExtension(ComfyExtension):
    async def get_node_list(self):
        nodes = []
        for name in NODE_MODULES:
            nodes.extend(importlib.import_module(f".{name}", __name__).NODES)
        return nodes
