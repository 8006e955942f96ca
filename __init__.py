"""ComfyUI-Flux2Dev: FLUX.2 [dev] loaders for ComfyUI."""


async def comfy_entrypoint():
    # The host imports this package on start; the node modules (and with them comfy) load only here.
    from .nodes import Flux2DevExtension

    return Flux2DevExtension()
