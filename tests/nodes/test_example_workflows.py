"""The example workflows (example_workflows/, the pack's templates in ComfyUI): the host lists them, each UI
file is the graph of its API twin, and each twin runs on the tiny weights and writes an image."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from PIL import Image

from comfyui_flux2dev.devtools import example_workflows as examples
from comfyui_flux2dev.devtools.headless import PACK_FOLDER
from comfyui_flux2dev.devtools.workflow_files import ui_to_api

NAMES = sorted(examples.EXAMPLES)
# The real file names the examples use, and the tiny models that stand in for them here.
TINY_NAMES = {
    examples.GGUF: "flux2-dev-tiny-Q4_K.gguf",
    examples.ENCODER: "mistral_3_small_flux2_fp8.safetensors",
    examples.VAE: "flux2-ae.safetensors",
    examples.DEV_PIPELINE: "flux2-dev-tiny-pipeline/",
    examples.KLEIN_PIPELINE: "flux2-klein-4b-tiny-pipeline/",
}
TINY_SIZES = {"width": 64, "height": 64, "steps": 2}


def _load(folder: Path, name: str) -> dict:
    return json.loads((folder / f"{name}.json").read_text(encoding="utf-8"))


def _tiny(graph: dict) -> dict:
    for node in graph.values():
        for key, value in node["inputs"].items():
            if isinstance(value, str) and value in TINY_NAMES:
                node["inputs"][key] = TINY_NAMES[value]
            elif key in TINY_SIZES and isinstance(value, int):
                node["inputs"][key] = TINY_SIZES[key]
    return graph


def test_the_host_lists_them_as_the_packs_templates(comfy_server):
    assert sorted(comfy_server.get("/api/workflow_templates")[PACK_FOLDER]) == NAMES
    assert sorted(p.stem for p in examples.UI_FOLDER.glob("*.json")) == NAMES


@pytest.mark.parametrize("name", NAMES)
def test_each_ui_file_is_the_graph_of_its_api_twin(comfy_server, name):
    twin = _load(examples.API_FOLDER, name)
    assert twin == examples.numbered(examples.EXAMPLES[name]())
    ui = _load(examples.UI_FOLDER, name)
    assert ui_to_api(ui, comfy_server.get("/object_info")) == twin
    assert len({tuple(n["pos"]) for n in ui["nodes"]}) == len(ui["nodes"])  # no node hides another


@pytest.mark.parametrize("name", NAMES)
def test_each_example_runs_on_the_tiny_weights(comfy_server, name):
    inputs = comfy_server.base_dir / "input"
    inputs.mkdir(exist_ok=True)
    for i, image in enumerate(examples.REFERENCES):
        Image.new("RGB", (64, 48), (200, 60 * i, 30)).save(inputs / image)
    outputs = comfy_server.run(_tiny(_load(examples.API_FOLDER, name)))
    (saved,) = (images for node in outputs.values() for images in node.get("images", []))
    assert Image.open(comfy_server.output_file(saved)).size == (64, 64)
