"""The example workflows (example_workflows/, the pack's templates in ComfyUI): the host lists them, each UI
file is the graph of its API twin and names the public files it needs with their download addresses, each
twin runs on the tiny weights, and `tiny --comfyui` gives a ComfyUI folder the tiny models and the examples'
tiny form, whose files are in that ComfyUI's menus and which run there as they are."""

from __future__ import annotations

import contextlib
import json
import os
import re
import urllib.parse
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from comfyui_flux2dev.devtools import example_workflows as examples
from comfyui_flux2dev.devtools.headless import PACK_FOLDER, HeadlessComfy
from comfyui_flux2dev.devtools.workflow_files import ALWAYS, BYPASS, set_widget_values, ui_to_api
from helpers import run_devtools, run_flux2dev

NAMES = sorted(examples.EXAMPLES)
README = Path(__file__).resolve().parents[2] / "README.md"
SAVED_BEFORE = Path(__file__).resolve().parents[1] / "data" / "saved_workflows"


def _load(folder: Path, name: str) -> dict:
    return json.loads((folder / f"{name}.json").read_text(encoding="utf-8"))


def _menu(info: dict, field: str) -> list[str]:
    """A combo input's choices as /object_info lists them: [choices, ...] or, for V3 nodes on newer hosts,
    ["COMBO", {"options": choices}]."""
    spec = {**info["input"].get("optional", {}), **info["input"]["required"]}[field]
    return spec[0] if isinstance(spec[0], list) else spec[1]["options"]


def _saved_image(server, outputs) -> Image.Image:
    (saved,) = (images for node in outputs.values() for images in node.get("images", []))
    return Image.open(server.output_file(saved))


def test_the_host_lists_them_as_the_packs_templates(comfy_server):
    assert sorted(comfy_server.get("/api/workflow_templates")[PACK_FOLDER]) == NAMES
    assert sorted(p.stem for p in examples.UI_FOLDER.glob("*.json")) == NAMES


def test_titles_differ_in_their_first_words():
    assert len({" ".join(name.split()[:2]) for name in NAMES}) == len(NAMES)


def test_each_template_has_a_thumbnail_of_its_own():
    thumbnails = [examples.UI_FOLDER / f"{name}.jpg" for name in NAMES]
    assert all(t.is_file() for t in thumbnails)
    assert len({t.read_bytes() for t in thumbnails}) == len(NAMES)
    assert all(Image.open(t).format == "JPEG" for t in thumbnails)


@pytest.mark.parametrize("name", NAMES)
def test_each_ui_file_is_the_graph_of_its_api_twin(comfy_server, name):
    twin = _load(examples.API_FOLDER, name)
    assert twin == examples.as_run(examples.numbered(examples.EXAMPLES[name]()))
    ui = _load(examples.UI_FOLDER, name)
    assert ui_to_api(ui, comfy_server.get("/object_info")) == twin
    assert len({tuple(n["pos"]) for n in ui["nodes"]}) == len(ui["nodes"])  # no node hides another


@pytest.mark.parametrize("name", NAMES)
def test_each_model_file_a_template_names_has_a_download_address_the_readme_lists(name):
    readme = README.read_text(encoding="utf-8")
    for node in _load(examples.UI_FOLDER, name)["nodes"]:
        files = [v for v in node["widgets_values"] if isinstance(v, str) and v.endswith((".safetensors", ".gguf"))]
        models = node["properties"].get("models", [])
        assert sorted(m["name"] for m in models) == sorted(files), node["type"]
        for model in models:
            url = urllib.parse.urlparse(model["url"])
            assert url.scheme == "https" and url.netloc == "huggingface.co", model
            assert url.path.rsplit("/", 1)[1] == model["name"]
            assert model["directory"] in ("diffusion_models", "text_encoders", "vae", "loras")
            assert model["url"] in readme and f"`{model['name']}`" in readme


def test_the_official_size_and_steps():
    """ComfyUI's own FLUX.2 [dev] template samples 1248x832 in 20 steps."""
    twin = _load(examples.API_FOLDER, examples.TEXT_TO_IMAGE)
    sizes = {(n["class_type"], k): v for n in twin.values() for k, v in n["inputs"].items()
             if k in ("width", "height", "steps")}
    assert sizes == {("Flux2Scheduler", "steps"): 20, ("Flux2Scheduler", "width"): 1248,
                     ("Flux2Scheduler", "height"): 832, ("EmptyFlux2LatentImage", "width"): 1248,
                     ("EmptyFlux2LatentImage", "height"): 832}


def test_the_edit_examples_pictures_are_in_the_input_folder(comfy_server):
    """The host loads the pack, which copies the pictures the edit example names into ComfyUI's input folder."""
    images = [n["inputs"]["image"]
              for n in _load(examples.API_FOLDER, "Image edit, two reference images - FLUX.2 dev").values()
              if n["class_type"] == "LoadImage"]
    assert images == list(examples.REFERENCES)
    for image in images:
        copied = comfy_server.base_dir / "input" / image
        assert copied.read_bytes() == (examples.INPUTS_FOLDER / image).read_bytes()
    assert set(images) <= set(comfy_server.get("/object_info/LoadImage")["LoadImage"]["input"]["required"]["image"][0])


@pytest.mark.parametrize("name", NAMES)
def test_each_example_follows_the_official_template(name):
    """As ComfyUI's own FLUX.2 [dev] templates: Flux2Scheduler, and a Turbo LoRA switch, here the pack's LoRA node
    bypassed (off; 0.3.75 has no switch node); the small-decoder VAE where the example loads a VAE file."""
    ui = _load(examples.UI_FOLDER, name)
    (turbo,) = (n for n in ui["nodes"] if n["type"] == "Flux2DevLoraLoader")
    assert turbo["mode"] == BYPASS and turbo["widgets_values"][0] == examples.TURBO_LORA
    assert str(examples.TURBO_STEPS) in turbo["title"]
    assert any(n["type"] == "Flux2Scheduler" for n in ui["nodes"])
    vaes = [n["widgets_values"][0] for n in ui["nodes"] if n["type"] == "Flux2DevVAESource"]
    assert vaes == [examples.VAE] or vaes[0].endswith("/"), vaes  # or a pipeline's VAE


def _turbo_on(ui: dict, object_info: dict) -> dict:
    """The example with its Turbo LoRA on (not bypassed), in its steps."""
    nodes = []
    for n in ui["nodes"]:
        n = {**n, "mode": ALWAYS}
        if n["type"] == "Flux2Scheduler":
            set_widget_values(n, object_info["Flux2Scheduler"], {"steps": examples.TURBO_STEPS})
        nodes.append(n)
    return {**ui, "nodes": nodes}


def _small(graph: dict) -> dict:
    """The tiny form at 64x64, which is enough to tell two images apart."""
    graph = examples.tiny_form(graph, folder="")
    for n in graph.values():
        if n["class_type"] in examples.SIZED:
            n["inputs"].update({k: 64 for k in ("width", "height") if k in n["inputs"]})
    return graph


def test_the_turbo_switch_of_an_example_runs_its_lora(comfy_server):
    """Turned on, the Turbo LoRA node runs between the transformer and the guider, in the Turbo steps, shows that it
    applied every tensor of the LoRA, and changes the image of the tiny weights."""
    from comfyui_flux2dev.devtools.tiny.loras import turbo_lora

    object_info = comfy_server.get("/object_info")
    ui = _load(examples.UI_FOLDER, examples.TEXT_TO_IMAGE)
    example = examples.numbered(examples.EXAMPLES[examples.TEXT_TO_IMAGE]())
    graph = {key: {**n, "mode": ALWAYS} for key, n in example.items()}
    (scheduler,) = (n for n in graph.values() if n["class_type"] == "Flux2Scheduler")
    scheduler["inputs"]["steps"] = examples.TURBO_STEPS
    on = ui_to_api(_turbo_on(ui, object_info), object_info)
    assert on == examples.as_run(graph)
    off = _load(examples.API_FOLDER, examples.TEXT_TO_IMAGE)
    ran = {"off": comfy_server.run(_small(off)), "on": comfy_server.run(_small(on))}
    assert not np.array_equal(*(np.asarray(_saved_image(comfy_server, outputs)) for outputs in ran.values()))
    (lora,) = (key for key, n in on.items() if n["class_type"] == "Flux2DevLoraLoader")
    count = len(turbo_lora())
    assert ran["on"][lora]["text"] == [f"{count} of {count} LoRA tensors applied, changing {count // 2} weights of "
                                       "the transformer"]


@pytest.mark.parametrize("name", NAMES)
def test_each_example_runs_on_the_tiny_weights(comfy_server, name):
    graph = examples.tiny_form(_load(examples.API_FOLDER, name), folder="")
    assert _saved_image(comfy_server, comfy_server.run(graph)).size == (256, 256)


def test_the_server_runs_them_under_a_macos_shells_limit_of_open_files(comfy_server):
    """The shared server starts under a soft limit of 256 open files (conftest.SERVER_OPEN_FILES), as a macOS shell
    gives the programs it starts: these examples and the other server tests' graphs, every loader among them, run
    under it. With the text-to-image example's models loaded (GGUF transformer, fp8 encoder of 30 layers, VAE) the
    server holds one open file per model file, a few beside the host's own (a map per tensor held 420 for the
    encoder alone)."""
    pid = comfy_server.process.pid
    (limit,) = [line for line in Path(f"/proc/{pid}/limits").read_text().splitlines()
                if line.startswith("Max open files")]
    assert limit.split()[3] == "256", limit
    comfy_server.run(_small(_load(examples.API_FOLDER, examples.TEXT_TO_IMAGE)))
    held = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            held.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
    models = sorted(Path(target).name for target in held if target.endswith((".safetensors", ".gguf")))
    assert models == sorted(["flux2-dev-tiny-Q4_K.gguf", examples.ENCODER]), models
    assert len(held) < 64, held


def test_a_workflow_saved_before_the_new_titles_runs_unchanged(comfy_server):
    """A workflow the frontend saved with the nodes' old titles names the same node ids: it loads and runs."""
    ui = json.loads((SAVED_BEFORE / "text to image, GGUF.json").read_text(encoding="utf-8"))
    assert {n["title"] for n in ui["nodes"] if n["type"].startswith("Flux2Dev")} >= {"Load FLUX.2 GGUF transformer"}
    graph = ui_to_api(ui, comfy_server.get("/object_info"))
    assert _saved_image(comfy_server, comfy_server.run(graph)).size == (64, 64)


@pytest.mark.server
@pytest.mark.one_host  # what `tiny --comfyui` writes; the examples run on every host (test_each_example_runs_...)
def test_tiny_comfyui_writes_models_and_tiny_workflows_that_run_there(tmp_path):
    comfyui = tmp_path / "ComfyUI"
    own = comfyui / "models" / "text_encoders" / examples.ENCODER  # a user's file named like a tiny model
    own.parent.mkdir(parents=True)
    own.write_bytes(b"the user's own encoder")
    (comfyui / "main.py").write_text("")
    out = run_devtools("tiny", "--comfyui", comfyui, env={"FLUX2DEV_TINY_MODELS": ""})
    assert out.returncode == 0, out.stderr
    declaration = comfyui / "models" / "flux2dev-tiny-models.json"
    assert f"FLUX2DEV_TINY_MODELS={declaration.resolve()} python main.py" in out.stdout
    assert "256x256, 2 steps" in out.stdout
    assert own.read_bytes() == b"the user's own encoder"
    tiny_gguf = comfyui / "models" / "unet" / examples.TINY_FOLDER / "flux2-dev-tiny-Q4_K.gguf"
    known = run_flux2dev("inspect", tiny_gguf, env={"FLUX2DEV_TINY_MODELS": str(declaration)})
    assert known.returncode == 0 and json.loads(known.stdout)["variant"] == "dev", known.stderr

    everything = sorted((p, p.stat().st_mtime_ns) for p in comfyui.rglob("*") if p.is_file())
    again = run_devtools("tiny", "--comfyui", comfyui)
    assert again.returncode == 2 and "nothing was written" in again.stderr
    assert sorted((p, p.stat().st_mtime_ns) for p in comfyui.rglob("*") if p.is_file()) == everything

    workflows = comfyui / "user" / "default" / "workflows"
    with HeadlessComfy(os.environ["COMFYUI_ROOT"], base_dir=comfyui,
                       env={"FLUX2DEV_TINY_MODELS": str(declaration)}) as server:
        listed = server.get("/api/userdata?dir=workflows")
        object_info = server.get("/object_info")
        for name in NAMES:
            saved = f"Tiny models - {name}.json"
            assert saved in listed
            ui = json.loads((workflows / saved).read_text(encoding="utf-8"))
            graph = ui_to_api(ui, object_info)
            assert graph == examples.tiny_form(_load(examples.API_FOLDER, name))
            names = {(n["class_type"], k): v for n in graph.values() for k, v in n["inputs"].items()
                     if isinstance(v, str) and re.search(r"\.(gguf|safetensors)$|/$", v)}
            assert names and all(v.startswith(examples.TINY_FOLDER + "/") for v in names.values()), names
            for (node, field), chosen in names.items():  # each file the workflow names is in its menu there
                assert chosen in _menu(object_info[node], field), (name, node, chosen)
        # The examples run on the tiny weights above (test_each_example_runs_on_the_tiny_weights); here one runs
        # from the folder `tiny --comfyui` wrote, as a user opens it.
        ui = json.loads((workflows / f"Tiny models - {examples.TEXT_TO_IMAGE}.json").read_text(encoding="utf-8"))
        assert _saved_image(server, server.run(ui_to_api(ui, object_info))).size == (256, 256)
