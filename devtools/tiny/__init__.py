"""Tiny FLUX.2 weights in every layout the pack reads, for the tests and the demo.

Deterministic (seeded). The geometry is geometry.py's: the pack recognises it only while FLUX2DEV_TINY_MODELS
names the declaration file written beside the models. Each part goes to its own subfolder, named after the
host model folder it belongs in, so a headless ComfyUI can link them in as they are."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from ...errors import Flux2DevError
from .geometry import write_declaration

# subfolder -> (module, writer); each writer returns manifest entries relative to its subfolder.
# Every part but the encoders builds its weights with diffusers' own model classes.
PARTS = {
    "text_encoders": ("encoders", "write_encoders"),
    "diffusion_models": ("transformers", "write_transformers"),
    "vae": ("vae", "write_vaes"),
    "diffusers": ("pipelines", "write_pipelines"),
    "unet": ("gguf_transformers", "write_gguf_transformers"),
}
MANIFEST = "manifest.json"


def write_all(root: str | Path, parts: tuple[str, ...] = tuple(PARTS), manifest: bool = True) -> list[dict]:
    """Write the tiny weights under `root`, the declaration of their geometry (geometry.DECLARATION) and, unless
    told not to, root/manifest.json; return the manifest's entries."""
    if any(folder != "text_encoders" for folder in parts) and importlib.util.find_spec("diffusers") is None:
        raise Flux2DevError(
            "The tiny FLUX.2 transformers, VAE and pipelines are built with diffusers, which is not installed here. "
            "Install it with: pip install 'diffusers>=0.37.1' (or pip install -e '.[tiny]' in the pack's folder)."
        )
    root = Path(root)
    write_declaration(root)
    entries = []
    for folder in parts:
        module_name, writer = PARTS[folder]
        module = importlib.import_module(f".{module_name}", __name__)
        for entry in getattr(module, writer)(root / folder):
            entries.append({**entry, "path": f"{folder}/{entry['path']}"})
    if manifest:
        (root / MANIFEST).write_text(json.dumps(entries, indent=1))
    return entries


def read_manifest(root: str | Path) -> list[dict]:
    return json.loads((Path(root) / MANIFEST).read_text())
