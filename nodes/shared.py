"""What more than one node shares: the schema's frame (title, search words, menu category) and input and output
tooltips."""

from comfy_api.latest import io

from ..host.compat import node_schema
from ..loaders.models.node_titles import NODES

CATEGORY = "loaders/FLUX.2"  # beside the host's own loaders
CONDITIONING_CATEGORY = "conditioning/FLUX.2"  # beside CLIP Text Encode, which the upsampler's prompt feeds


def schema(node_id: str, description: str, inputs: list, outputs: list, category: str = CATEGORY,
           is_output_node: bool = False):
    """The node's schema, with the title and search words node_titles gives it."""
    title, aliases = NODES[node_id]
    return node_schema(node_id=node_id, display_name=title, search_aliases=list(aliases), category=category,
                       description=description, inputs=inputs, outputs=outputs, is_output_node=is_output_node)


def dtype_input(name: str, dtypes: dict, default: str, tooltip: str):
    """A Combo input of the precisions in `dtypes` (their names, as host/ maps them to torch dtypes)."""
    return io.Combo.Input(name, options=list(dtypes), default=default, tooltip=tooltip)


PADDING_TOOLTIP = (
    "How the prompt's tokens are laid out. reference (the default): as Black Forest Labs' and diffusers' own "
    "FLUX.2 [dev] pipelines, padded to 512 tokens, for images that match the official ones. comfy: exactly "
    "ComfyUI's built-in FLUX.2 text encoder, to reproduce workflows made with it."
)
MODEL_TOOLTIP = ("The FLUX.2 transformer: connect it to a guider (BasicGuider) or a sampler, through LoRA loaders "
                 "if any.")
CLIP_TOOLTIP = "The FLUX.2 [dev] text encoder: connect it to CLIP Text Encode (and the host's other CLIP nodes)."
CACHE_TOOLTIP = (
    "The conditioning cache folder: each prompt is encoded once and served from here after "
    "that, without reading the encoder's weights. Empty: the FLUX2DEV_CACHE_DIR folder if set, else "
    "flux2dev-conditioning-cache in ComfyUI's user folder; a relative folder lies inside the user "
    "folder. It must be a folder of the cache's own: one holding other files (a models folder) is "
    "refused. Several ComfyUI instances may share one folder (an absolute path, e.g. on a shared "
    "drive). A CLIP with a LoRA applied bypasses the cache."
)
KEEP_LOADED_TOOLTIP = (
    "On: the encoder's weights stay in memory after the first prompt that was not cached. Off: "
    "they are freed after each encode, so the memory goes back to the transformer; the next uncached "
    "prompt reads them again."
)
