"""Tiny FLUX.2 weights in every layout the pack reads, for the tests and the demo.

Deterministic (seeded). The geometry is geometry.py's: the pack recognises it only while FLUX2DEV_TINY_MODELS
names the declaration file written beside the models. Each part goes to its own subfolder, named after the
host model folder it belongs in, so a headless ComfyUI can link them in as they are."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

from ...errors import Flux2DevError
from .geometry import DECLARATION, write_declaration

# subfolder -> (module, writer); each writer returns manifest entries relative to its subfolder.
# Every part but the encoders builds its weights with diffusers' own model classes.
PARTS = {
    "text_encoders": ("encoders", "write_encoders"),
    "diffusion_models": ("transformers", "write_transformers"),
    "vae": ("vae", "write_vaes"),
    "diffusers": ("pipelines", "write_pipelines"),
    "unet": ("gguf_transformers", "write_gguf_transformers"),
    "loras": ("loras", "write_loras"),
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


TINY_WORKFLOW_PREFIX = "Tiny models - "  # the examples' tiny form, in the user's workflows


def write_into_comfyui(comfyui: str | Path) -> list[Path]:
    """The tiny models in a folder of their own (example_workflows.TINY_FOLDER) inside each of that ComfyUI's
    model folders, the declaration of their geometry in models/, and the pack's examples in their tiny form in
    the user's workflows; the paths written. Nothing is replaced: when any of them is already there, nothing is
    written."""
    from ...loaders.formats.files import write_new_file
    from ..example_workflows import EXAMPLES, TINY_FOLDER, UI_FOLDER, tiny_ui

    models = Path(comfyui) / "models"
    workflows = Path(comfyui) / "user" / "default" / "workflows"
    folders = [models / part / TINY_FOLDER for part in PARTS]
    declaration = models / DECLARATION
    tiny_workflows = {
        workflows / f"{TINY_WORKFLOW_PREFIX}{name}.json":
            tiny_ui(json.loads((UI_FOLDER / f"{name}.json").read_text(encoding="utf-8")))
        for name in EXAMPLES
    }
    present = [str(p) for p in (*folders, declaration, *tiny_workflows) if os.path.lexists(p)]
    if present:
        raise Flux2DevError(
            f"Tiny models or workflows are already there ({', '.join(present)}); nothing was written, since these "
            "tools never replace a file. Delete them first to write them again."
        )
    models.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".flux2dev-tiny-", dir=models))  # renamed into place part by part
    try:
        write_all(staging, manifest=False)
        for part, folder in zip(PARTS, folders):
            folder.parent.mkdir(parents=True, exist_ok=True)
            os.rename(staging / part, folder)  # fails, rather than replaces, if a folder appeared meanwhile
        write_new_file(declaration, (staging / DECLARATION).read_bytes())
        workflows.mkdir(parents=True, exist_ok=True)
        for path, doc in tiny_workflows.items():
            write_new_file(path, (json.dumps(doc, indent=1, ensure_ascii=False) + "\n").encode())
    finally:
        shutil.rmtree(staging)
    return [*folders, declaration, *tiny_workflows]
