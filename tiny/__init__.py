"""Tiny FLUX.2 weights in every layout the pack reads, for the tests and the demo.

Deterministic (seeded). The geometry is the tiny rows of loaders/variants.py: the pack recognises them
only while FLUX2DEV_TINY_MODELS=1 is set. Each part goes to its own subfolder, named after the host model
folder it belongs in, so a headless ComfyUI can link them in as they are."""

from __future__ import annotations

import json
from pathlib import Path

# subfolder -> (module, writer); each writer returns manifest entries relative to its subfolder.
PARTS = {
    "text_encoders": ("encoders", "write_encoders"),
    "diffusion_models": ("transformers", "write_transformers"),
    "vae": ("vae", "write_vaes"),
    "diffusers": ("pipelines", "write_pipelines"),
    "unet": ("gguf_transformers", "write_gguf_transformers"),
}
MANIFEST = "manifest.json"


def write_all(root: str | Path, parts: tuple[str, ...] = tuple(PARTS)) -> list[dict]:
    """Write the tiny weights under `root` and root/manifest.json; return the manifest's entries."""
    import importlib

    root = Path(root)
    entries = []
    for folder in parts:
        module_name, writer = PARTS[folder]
        module = importlib.import_module(f".{module_name}", __name__)
        for entry in getattr(module, writer)(root / folder):
            entries.append({**entry, "path": f"{folder}/{entry['path']}"})
    (root / MANIFEST).write_text(json.dumps(entries, indent=1))
    return entries


def read_manifest(root: str | Path) -> list[dict]:
    return json.loads((Path(root) / MANIFEST).read_text())
