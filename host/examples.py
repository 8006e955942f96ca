"""The example workflows' inputs: the edit example's reference images, shipped in example_workflows/inputs/,
copied into ComfyUI's input folder (where its Load Image node lists pictures) under their own names. A file
already there under such a name is left as it is."""

from __future__ import annotations

import logging
from pathlib import Path

from ..loaders.formats.files import write_new_file
from . import ensure_comfy

INPUTS = Path(__file__).resolve().parents[1] / "example_workflows" / "inputs"


def install_example_inputs() -> list[str]:
    """Copy the examples' input pictures that ComfyUI's input folder lacks; the names copied."""
    ensure_comfy()
    import folder_paths

    target = Path(folder_paths.get_input_directory())
    copied = []
    for source in sorted(INPUTS.glob("*.png")):
        try:
            target.mkdir(parents=True, exist_ok=True)
            if write_new_file(target / source.name, source.read_bytes()):
                copied.append(source.name)
        except OSError as e:  # a read-only input folder costs the example its pictures, not the pack its nodes
            logging.warning("FLUX.2 [dev]: could not copy the example picture %s into %s: %s", source.name, target, e)
    if copied:
        logging.info("FLUX.2 [dev]: copied the image edit example's pictures into %s: %s", target, ", ".join(copied))
    return copied
