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

from ..tokenizers.prompt import PADDING_MODES
from .tiny.loras import TURBO_LORA as TINY_TURBO_LORA
from .workflow_files import ALWAYS, BYPASS
from .workflows import node, official_dev_graph

PACK_ROOT = Path(__file__).resolve().parents[1]
UI_FOLDER = PACK_ROOT / "example_workflows"
API_FOLDER = PACK_ROOT / "tests" / "data" / "example_workflows"
TINY_FOLDER = "flux2dev-tiny"  # where `tiny --comfyui` puts the tiny models, in each of ComfyUI's model folders

GGUF = "flux2-dev-Q4_K_M.gguf"
UPSAMPLER = "Mistral-Small-3.2-24B-Instruct-2506-Q4_K_M.gguf"  # the whole model (the encoder files are pruned)
ENCODER = "mistral_3_small_flux2_fp8.safetensors"
VAE = "full_encoder_small_decoder.safetensors"  # BFL's small decoder, as the official templates load
TURBO_LORA = "Flux_2-Turbo-LoRA_comfyui.safetensors"
TURBO_STEPS = 8  # what the Turbo LoRA samples in, in place of SIZES' steps
DEV_PIPELINE = "FLUX.2-dev/"
KLEIN_PIPELINE = "FLUX.2-klein-4B/"
# The public files the examples name: name -> (ComfyUI model folder, download address, tiny model in its place).
# The frontend offers each download when the file is missing.
MODELS = {
    GGUF: ("diffusion_models", "https://huggingface.co/city96/FLUX.2-dev-gguf/resolve/main/flux2-dev-Q4_K_M.gguf",
           "flux2-dev-tiny-Q4_K.gguf"),
    ENCODER: ("text_encoders", "https://huggingface.co/Comfy-Org/flux2-dev/resolve/main/split_files/text_encoders/"
              "mistral_3_small_flux2_fp8.safetensors", "mistral_3_small_flux2_fp8.safetensors"),
    VAE: ("vae", "https://huggingface.co/black-forest-labs/FLUX.2-small-decoder/resolve/main/" + VAE, VAE),
    TURBO_LORA: ("loras", "https://huggingface.co/ByteZSzn/Flux.2-Turbo-ComfyUI/resolve/main/" + TURBO_LORA,
                 TINY_TURBO_LORA),
    UPSAMPLER: ("text_encoders", "https://huggingface.co/unsloth/Mistral-Small-3.2-24B-Instruct-2506-GGUF/resolve/main/"
                "Mistral-Small-3.2-24B-Instruct-2506-Q4_K_M.gguf", "mistral3-q4_k.gguf"),
}
# Pipeline folders are repositories, not one file to download: name -> (repository, tiny pipeline in its place).
PIPELINES = {
    DEV_PIPELINE: ("https://huggingface.co/black-forest-labs/FLUX.2-dev", "flux2-dev-tiny-pipeline/"),
    KLEIN_PIPELINE: ("https://huggingface.co/black-forest-labs/FLUX.2-klein-4B", "flux2-klein-4b-tiny-pipeline/"),
}
# The edit example's reference images, shipped in example_workflows/inputs/ and copied into ComfyUI's input
# folder when the pack loads (host/examples.py).
REFERENCES = ("flux2dev-reference-1.png", "flux2dev-reference-2.png")
CACHE = "flux2dev-shared-cache"
PROMPT = "A red fox sitting in fresh snow at dawn, soft light, shallow depth of field"
EDIT_PROMPT = ("The wooden cabin from the first image, its walls painted in the red and white stripes of the second "
               "image, in a snowy forest at dawn")
SHORT_PROMPT = "a red fox in the snow"  # what the upsampler example rewrites
# The official FLUX.2 [dev] workflow's size and steps (ComfyUI's image_flux2 template), and the tiny form's; the
# upsampler writes at most the reference's 512 tokens, 16 in the tiny form.
SIZES = {"width": 1248, "height": 832, "steps": 20}
UPSAMPLED_TOKENS = {"max_new_tokens": 512}
TINY_SIZES = {"width": 256, "height": 256, "steps": 2, "max_new_tokens": 16}


def gguf_loader() -> dict:
    return node("Flux2DevGGUFTransformerLoader", gguf_name=GGUF, dequant_dtype="default", patch_dtype="float32")


def encoder_loader(cache: str = "", keep_loaded: bool = True) -> dict:
    return node("Flux2DevEncoderLoader", encoder=ENCODER, padding=PADDING_MODES[0], allow_network=False, cache=cache,
                keep_loaded=keep_loaded)


def vae_source(name: str = VAE) -> dict:
    return node("Flux2DevVAESource", vae=name)


def _dev(model: dict, clip: dict, vae: dict, prefix: str, prompt: str = PROMPT) -> dict:
    """The official graph with its Turbo LoRA switch: the LoRA node, bypassed (off) as 0.3.75 has no switch node."""
    graph = official_dev_graph(model, clip, vae, prompt=prompt, **SIZES, filename_prefix=prefix)
    graph["turbo"] = {**node("Flux2DevLoraLoader", model=["model", 0], lora_name=TURBO_LORA, strength_model=1.0,
                             strength_clip=1.0),
                      "mode": BYPASS, "_meta": {"title": f"Turbo LoRA (Ctrl+B: on/off; on: {TURBO_STEPS} steps)"}}
    graph["guider"]["inputs"]["model"] = ["turbo", 0]
    return graph


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


def _upsampled() -> dict:
    graph = _dev(gguf_loader(), encoder_loader(), vae_source(), "flux2-dev-upsampled")
    graph["upsampler"] = node("Flux2DevPromptUpsampler", model=UPSAMPLER, prompt=SHORT_PROMPT, mode="auto", seed=0,
                              temperature=0.15, **UPSAMPLED_TOKENS, keep_loaded=False, cache="")
    graph["text"]["inputs"]["text"] = ["upsampler", 0]
    return graph


# name -> the graph; the name is the template's title in ComfyUI's Templates browser, which shows its first
# words only, so they say what differs.
EXAMPLES = {
    "Text to image, GGUF transformer - FLUX.2 dev": lambda: _dev(
        gguf_loader(), encoder_loader(), vae_source(), "flux2-dev"),
    "Pipeline folder (diffusers) - FLUX.2 dev": lambda: _dev(
        node("Flux2DevTransformerSource", transformer=DEV_PIPELINE),
        node("Flux2DevEncoderSource", pipeline=DEV_PIPELINE, padding=PADDING_MODES[0], cache="", keep_loaded=True),
        vae_source(DEV_PIPELINE), "flux2-dev-pipeline"),
    "Image edit, two reference images - FLUX.2 dev": _edit,
    "VAE from a Klein pipeline - FLUX.2 dev": lambda: _dev(
        gguf_loader(), encoder_loader(), vae_source(KLEIN_PIPELINE), "flux2-dev-klein-vae"),
    # Each prompt is encoded once into the named cache folder (relative: in ComfyUI's user folder; an absolute
    # path on a shared drive serves several ComfyUI instances), and the encoder's memory is freed after use.
    "Conditioning cache, encoder freed - FLUX.2 dev": lambda: _dev(
        gguf_loader(), encoder_loader(cache=CACHE, keep_loaded=False), vae_source(), "flux2-dev-cached"),
    # The short prompt rewritten by the whole Mistral-Small model (its GGUF), then encoded as usual.
    "Prompt upsampling, text to image - FLUX.2 dev": _upsampled,
}
TEXT_TO_IMAGE = next(iter(EXAMPLES))


SIZED = ("Flux2Scheduler", "EmptyFlux2LatentImage", "Flux2DevPromptUpsampler")  # the nodes that hold SIZES


def _tiny_names(folder: str) -> dict[str, str]:
    return ({name: folder + row[2] for name, row in MODELS.items()}
            | {name: folder + row[1] for name, row in PIPELINES.items()})


def tiny_form(graph: dict, folder: str = TINY_FOLDER + "/") -> dict:
    """An example's API graph on the tiny models (in `folder` of each model folder) at the tiny size and steps."""
    names = _tiny_names(folder)
    return {key: {**n, "inputs": {
        k: names.get(v, v) if isinstance(v, str)
        else TINY_SIZES[k] if k in TINY_SIZES and n["class_type"] in SIZED else v
        for k, v in n["inputs"].items()}} for key, n in graph.items()}


def tiny_ui(ui: dict, folder: str = TINY_FOLDER + "/") -> dict:
    """An example's UI file in the tiny form of tiny_form; its nodes list no downloads (there are none)."""
    names = _tiny_names(folder)
    small = {v: TINY_SIZES[k] for k, v in (SIZES | UPSAMPLED_TOKENS).items()}
    nodes = []
    for n in ui["nodes"]:
        values = [names.get(v, v) if isinstance(v, str) else small.get(v, v) if n["type"] in SIZED else v
                  for v in n["widgets_values"]]
        properties = {k: v for k, v in n["properties"].items() if k != "models"}
        nodes.append({**n, "widgets_values": values, "properties": properties})
    return {**ui, "nodes": nodes}


def downloads() -> dict[str, tuple[str, str]]:
    return {name: (folder, url) for name, (folder, url, _) in MODELS.items()}


def _cabin(draw) -> None:
    """Reference 1: a wooden cabin in the snow, drawn with flat shapes."""
    draw.rectangle((0, 0, 768, 330), fill=(176, 206, 232))
    draw.rectangle((0, 330, 768, 512), fill=(244, 247, 250))
    for x in (40, 600, 690):
        draw.polygon([(x, 340), (x + 40, 180), (x + 80, 340)], fill=(38, 84, 52))
    draw.rectangle((250, 230, 520, 400), fill=(133, 86, 48))
    for y in range(245, 400, 22):
        draw.line((250, y, 520, y), fill=(104, 64, 34), width=3)
    draw.polygon([(225, 235), (385, 120), (545, 235)], fill=(250, 250, 252))
    draw.rectangle((360, 310, 410, 400), fill=(74, 44, 22))
    draw.rectangle((280, 270, 330, 320), fill=(255, 214, 120))


def _stripes(draw) -> None:
    """Reference 2: a red and white striped pattern."""
    for i in range(-512, 1024, 64):
        draw.polygon([(i, 0), (i + 32, 0), (i + 32 + 512, 512), (i + 512, 512)], fill=(200, 30, 40))


REFERENCE_DRAWINGS = {REFERENCES[0]: ((768, 512), (255, 255, 255), _cabin),
                      REFERENCES[1]: ((512, 512), (250, 246, 240), _stripes)}
INPUTS_FOLDER = UI_FOLDER / "inputs"


def write_references() -> list[Path]:
    """The edit example's reference images, drawn here so that the pack ships pictures of its own."""
    from PIL import Image, ImageDraw

    INPUTS_FOLDER.mkdir(parents=True, exist_ok=True)
    written = []
    for name, (size, background, drawing) in REFERENCE_DRAWINGS.items():
        image = Image.new("RGB", size, background)
        drawing(ImageDraw.Draw(image))
        image.save(INPUTS_FOLDER / name, optimize=True)
        written.append(INPUTS_FOLDER / name)
    return written


def numbered(graph: dict) -> dict:
    """The graph with node ids 1, 2, ... in order, as the frontend numbers them."""
    ids = {key: str(i) for i, key in enumerate(graph, 1)}
    return {
        ids[key]: {**n, "inputs": {k: [ids[v[0]], v[1]] if isinstance(v, list) else v for k, v in n["inputs"].items()}}
        for key, n in graph.items()
    }


# What a bypassed node passes on: its output slot -> the input it passes (what the frontend picks by type).
PASSES = {"Flux2DevLoraLoader": ("model", "clip")}


def as_run(graph: dict) -> dict:
    """The API graph the server gets when an example's UI file is queued: bypassed nodes left out, what they pass
    on linked past them."""
    def source(link):
        while isinstance(link, list) and graph[link[0]].get("mode") == BYPASS:
            passing = graph[link[0]]
            link = passing["inputs"].get(PASSES[passing["class_type"]][link[1]])
        return link

    return {key: {"class_type": n["class_type"],
                  "inputs": {k: source(v) for k, v in n["inputs"].items() if source(v) is not None}}
            for key, n in graph.items() if n.get("mode", ALWAYS) != BYPASS}


def write_all(object_info: dict) -> list[Path]:
    from .workflow_files import api_to_ui

    UI_FOLDER.mkdir(exist_ok=True)
    API_FOLDER.mkdir(parents=True, exist_ok=True)
    written = write_references()
    for name, build in EXAMPLES.items():
        graph = numbered(build())
        for path, doc in ((UI_FOLDER / f"{name}.json", api_to_ui(graph, object_info, downloads())),
                          (API_FOLDER / f"{name}.json", as_run(graph))):
            path.write_text(json.dumps(doc, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
            written.append(path)
    return written


def main(argv: list[str] | None = None) -> int:
    import argparse

    from .headless import HeadlessComfy

    argparse.ArgumentParser(prog="python -m comfyui_flux2dev.devtools workflows",
                            description=__doc__.splitlines()[0]).parse_args(argv)
    with HeadlessComfy(os.environ["COMFYUI_ROOT"]) as server:
        for path in write_all(server.get("/object_info")):
            print(f"wrote {path.relative_to(PACK_ROOT)}")
    return 0
