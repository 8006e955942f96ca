"""The adapter layer: the only code that touches ComfyUI. It turns what loaders/ produces into the host's
own MODEL, CLIP and VAE objects. Host signatures move between releases, so every call into comfy lives
in this package and uses keyword arguments."""

from __future__ import annotations

import os
import sys

from ..errors import HostError

COMFYUI_ROOT_ENV = "COMFYUI_ROOT"


def ensure_comfy() -> None:
    """Make `import comfy` work. Inside ComfyUI it already does; from the command line or the tests the
    tree named by COMFYUI_ROOT is put on sys.path and comfy is started on the CPU when no GPU is there."""
    if "comfy.model_management" in sys.modules:
        return
    root = os.environ.get(COMFYUI_ROOT_ENV)
    if root:
        if not os.path.isfile(os.path.join(root, "comfy", "model_management.py")):
            raise HostError(
                f"{COMFYUI_ROOT_ENV} is {root!r}, but that folder holds no ComfyUI tree "
                "(no comfy/model_management.py). "
                "Point it at the folder that holds ComfyUI's main.py."
            )
        if root not in sys.path:
            sys.path.insert(0, root)
    try:
        import comfy.options
    except ImportError as e:
        raise HostError(
            f"ComfyUI could not be imported ({e}). Run inside ComfyUI, or set {COMFYUI_ROOT_ENV} to the folder that "
            "holds ComfyUI's main.py."
        ) from None
    import torch

    argv = ["main.py"] if torch.cuda.is_available() else ["main.py", "--cpu"]
    saved, sys.argv = sys.argv, argv
    try:
        comfy.options.enable_args_parsing()
        import comfy.cli_args  # noqa: F401  (parses the arguments above once)
        import comfy.model_management  # noqa: F401
    finally:
        sys.argv = saved
