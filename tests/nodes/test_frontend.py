"""ComfyUI's real frontend (headless Chromium, driven by devtools/frontend.py, the script that takes the README's
pictures) on a ComfyUI folder as `tiny --comfyui` leaves it: the node search puts the node a phrase means
first, the Templates browser shows each example with its own title and thumbnail, and the tiny text-to-image
workflow opens without a missing-model error, where the template with the public file names reports them."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from comfyui_flux2dev.devtools import example_workflows as examples
from comfyui_flux2dev.devtools import frontend
from comfyui_flux2dev.devtools.headless import PACK_FOLDER
from comfyui_flux2dev.devtools.official_templates import with_pack_nodes
from comfyui_flux2dev.devtools.workflow_files import ui_to_api
from test_official_templates import TEMPLATES

pytestmark = pytest.mark.server

TITLES = {
    "encoder": "Load FLUX.2 text encoder (Mistral)",
    "encoder source": "Load FLUX.2 text encoder (pipeline)",
    "gguf": "Load FLUX.2 transformer (GGUF)",
    "transformer source": "Load FLUX.2 transformer (safetensors or pipeline)",
    "vae": "Load FLUX.2 VAE (file or pipeline)",
    "lora": "Load FLUX.2 LoRA",
}
FIRST = {"flux2 vae": TITLES["vae"], "gguf": TITLES["gguf"], "text encoder": TITLES["encoder"]}


def _host_version() -> str:
    text = (Path(os.environ["COMFYUI_ROOT"]) / "comfyui_version.py").read_text()
    return text.split('"')[1]


@pytest.fixture(scope="module")
def tiny_comfyui(tmp_path_factory):
    """(the folder, its server): a ComfyUI folder after `tiny --comfyui`, served headless."""
    reason = frontend.unavailable()
    if reason:
        pytest.skip(f"the frontend cannot be driven here: {reason}")
    if _host_version() == "0.3.75":
        pytest.skip("ComfyUI 0.3.75's frontend (1.32) predates node search aliases and the missing-model check; "
                    "these run on 0.33 (CI's second leg)")
    folder = tmp_path_factory.mktemp("ComfyUI")
    with frontend.tiny_comfyui(folder) as server:
        yield folder, server


@pytest.fixture
def page(tiny_comfyui):
    """A fresh page of the frontend: no dialog or graph left over from another test."""
    with frontend.open_frontend(tiny_comfyui[1]) as page:
        yield page


def test_search_phrases_list_the_node_they_mean_first(page):
    assert sorted(frontend.search(page, "load flux")[:len(TITLES)]) == sorted(TITLES.values())
    for phrase, title in FIRST.items():
        assert frontend.search(page, phrase)[0] == title, phrase


def test_the_templates_browser_shows_each_example_with_its_own_title_and_thumbnail(page):
    cards = frontend.templates_browser(page, PACK_FOLDER)
    assert sorted(title for title, _ in cards) == sorted(examples.EXAMPLES)
    for title, thumbnail in cards:
        assert thumbnail == (examples.UI_FOLDER / f"{title}.jpg").read_bytes(), title
    assert len({thumbnail for _, thumbnail in cards}) == len(cards)


def test_the_tiny_text_to_image_workflow_opens_without_missing_models(page, tiny_comfyui):
    frontend.load_workflow(page, frontend.tiny_workflow(tiny_comfyui[0], examples.TEXT_TO_IMAGE))
    assert not frontend.shows_missing_models(page)


def test_the_template_names_the_public_files_which_the_frontend_reports_missing(page):
    template = json.loads((examples.UI_FOLDER / f"{examples.TEXT_TO_IMAGE}.json").read_text(encoding="utf-8"))
    frontend.load_workflow(page, template)
    assert frontend.shows_missing_models(page)


def test_the_frontend_queues_workflows_as_ui_to_api_reads_them(page, tiny_comfyui):
    """ui_to_api, which the tests run UI files through, sends what the frontend sends: for an example, without its
    bypassed Turbo LoRA; for the official templates with the pack's nodes, their subgraph's nodes with its values."""
    folder, server = tiny_comfyui
    object_info = server.get("/object_info")
    workflows = [frontend.tiny_workflow(folder, examples.TEXT_TO_IMAGE)]
    workflows += [with_pack_nodes(server.get(f"/templates/{name}.json"), object_info) for name in TEMPLATES]
    for ui in workflows:
        frontend.load_workflow(page, ui)
        sent = page.evaluate("async () => (await window.app.graphToPrompt()).output")
        assert {key: {"class_type": n["class_type"], "inputs": n["inputs"]} for key, n in sent.items()} \
            == ui_to_api(ui, object_info)
