"""The pack's example workflows (ComfyUI lists example_workflows/ as the pack's templates), defined here as
API graphs with the file names users have, and written in the UI format the frontend loads, with their
API twins beside the tests:

    COMFYUI_ROOT=/path/to/ComfyUI python -m comfyui_flux2dev.devtools workflows

The UI files are laid out from the graphs (one column per step); the node schemas come from a headless
ComfyUI with the pack loaded."""

from __future__ import annotations

import json
import os
from pathlib import Path

from .workflows import node, official_dev_graph

PACK_ROOT = Path(__file__).resolve().parents[1]
UI_FOLDER = PACK_ROOT / "example_workflows"
API_FOLDER = PACK_ROOT / "tests" / "data" / "example_workflows"

GGUF = "flux2-dev-Q4_K_M.gguf"
ENCODER = "mistral_3_small_flux2_fp8.safetensors"
VAE = "flux2-vae.safetensors"
DEV_PIPELINE = "FLUX.2-dev/"
KLEIN_PIPELINE = "FLUX.2-klein-4B/"
REFERENCES = ("reference-1.png", "reference-2.png")
CACHE = "flux2dev-shared-cache"
PROMPT = "A red fox sitting in fresh snow at dawn, soft light, shallow depth of field"
EDIT_PROMPT = "The fox from the first image wearing the scarf from the second image, same snowy forest"


def gguf_loader() -> dict:
    return node("Flux2DevGGUFTransformerLoader", gguf_name=GGUF, dequant_dtype="default", patch_dtype="float32")


def encoder_loader(cache: str = "", keep_loaded: bool = True) -> dict:
    return node("Flux2DevEncoderLoader", encoder=ENCODER, padding="reference", allow_network=False, cache=cache,
                keep_loaded=keep_loaded)


def vae_source(name: str = VAE) -> dict:
    return node("Flux2DevVAESource", vae=name)


def _dev(model: dict, clip: dict, vae: dict, prefix: str, prompt: str = PROMPT) -> dict:
    return official_dev_graph(model, clip, vae, prompt=prompt, width=1024, height=1024, steps=28,
                              filename_prefix=prefix)


def _edit() -> dict:
    graph = _dev(gguf_loader(), encoder_loader(), vae_source(), "flux2-dev-edit", EDIT_PROMPT)
    conditioning = ["text", 0]
    for i, image in enumerate(REFERENCES, 1):
        graph[f"image {i}"] = node("LoadImage", image=image)
        graph[f"encode {i}"] = node("VAEEncode", pixels=[f"image {i}", 0], vae=["vae", 0])
        graph[f"reference {i}"] = node("ReferenceLatent", conditioning=conditioning, latent=[f"encode {i}", 0])
        conditioning = [f"reference {i}", 0]
    graph["guidance"]["inputs"]["conditioning"] = conditioning
    return graph


# name -> the graph; the name is the template's title in ComfyUI's Templates browser.
EXAMPLES = {
    "FLUX.2 dev text to image - GGUF transformer, fp8 encoder": lambda: _dev(
        gguf_loader(), encoder_loader(), vae_source(), "flux2-dev"),
    "FLUX.2 dev from a diffusers pipeline folder": lambda: _dev(
        node("Flux2DevTransformerSource", transformer=DEV_PIPELINE),
        node("Flux2DevEncoderSource", pipeline=DEV_PIPELINE, padding="reference", cache="", keep_loaded=True),
        vae_source(DEV_PIPELINE), "flux2-dev-pipeline"),
    "FLUX.2 dev image edit with two reference images": _edit,
    "FLUX.2 dev with the VAE of a Klein pipeline": lambda: _dev(
        gguf_loader(), encoder_loader(), vae_source(KLEIN_PIPELINE), "flux2-dev-klein-vae"),
    # Each prompt is encoded once into the named cache folder (relative: in ComfyUI's user folder; an absolute
    # path on a shared drive serves several ComfyUI instances), and the encoder's memory is freed after use.
    "FLUX.2 dev with a conditioning cache, encoder freed after use": lambda: _dev(
        gguf_loader(), encoder_loader(cache=CACHE, keep_loaded=False), vae_source(), "flux2-dev-cached"),
}


def numbered(graph: dict) -> dict:
    """The graph with node ids 1, 2, ... in order, as the frontend numbers them."""
    ids = {key: str(i) for i, key in enumerate(graph, 1)}
    return {
        ids[key]: {"class_type": n["class_type"],
                   "inputs": {k: [ids[v[0]], v[1]] if isinstance(v, list) else v for k, v in n["inputs"].items()}}
        for key, n in graph.items()
    }


def write_all(object_info: dict) -> list[Path]:
    from .workflow_files import api_to_ui

    UI_FOLDER.mkdir(exist_ok=True)
    API_FOLDER.mkdir(parents=True, exist_ok=True)
    written = []
    for name, build in EXAMPLES.items():
        graph = numbered(build())
        for path, doc in ((UI_FOLDER / f"{name}.json", api_to_ui(graph, object_info)),
                          (API_FOLDER / f"{name}.json", graph)):
            path.write_text(json.dumps(doc, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
            written.append(path)
    return written


def main(argv: list[str] | None = None) -> int:
    import argparse

    from .headless import HeadlessComfy

    argparse.ArgumentParser(prog="python -m comfyui_flux2dev.devtools workflows", description=__doc__.splitlines()[0]).parse_args(argv)
    with HeadlessComfy(os.environ["COMFYUI_ROOT"]) as server:
        for path in write_all(server.get("/object_info")):
            print(f"wrote {path.relative_to(PACK_ROOT)}")
    return 0
