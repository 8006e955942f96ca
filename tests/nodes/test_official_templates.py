"""The official FLUX.2 [dev] templates (comfyui-workflow-templates, fetched from the host as its frontend fetches
them) with the pack's loaders and LoRA node in place of the host's, inside the templates' subgraph: the subgraph's
widgets name the pack's widgets, and each template runs on the tiny weights with its Turbo switch off and on,
sampling the image of the same graph written by hand with the pack's nodes."""

from __future__ import annotations

import copy
import urllib.error

import numpy as np
import pytest
from PIL import Image

from comfyui_flux2dev.devtools import example_workflows as examples
from comfyui_flux2dev.devtools.official_templates import PACK_NODES, with_pack_nodes
from comfyui_flux2dev.devtools.workflow_files import EXTRA_WIDGET_VALUES, set_widget_values, ui_to_api, widget_values
from comfyui_flux2dev.devtools.workflows import node, official_dev_graph
from comfyui_flux2dev.tokenizers.prompt import PADDING_MODES

TEMPLATES = ("image_flux2", "image_flux2_text_to_image")  # the edit template, and text to image
TINY_TRANSFORMER = "flux2-dev-tiny-fp8-weight_scale.safetensors"  # scaled fp8, as flux2_dev_fp8mixed
TINY_ENCODER = "mistral_3_small_flux2_bf16.safetensors"
TINY_VAE = examples.MODELS[examples.VAE][2]
TINY_LORA = examples.MODELS[examples.TURBO_LORA][2]
IMAGE = examples.REFERENCES[0]
# What the templates name -> the tiny files in their place (the edit template's picture is not in the package).
TINY_NAMES = {"flux2_dev_fp8mixed.safetensors": TINY_TRANSFORMER,
              "mistral_3_small_flux2_bf16.safetensors": TINY_ENCODER, examples.VAE: TINY_VAE,
              examples.TURBO_LORA: TINY_LORA, "image_flux2_input_image.png": IMAGE}
SIZE = 64
MEGAPIXELS = 0.01  # the edit template samples at its picture's size, scaled to this
# The templates' step counts (standard and Turbo) -> the tiny form's.
STEPS = {20: 2, examples.TURBO_STEPS: 1}
TINY_WIDGETS = {("EmptyFlux2LatentImage", "width"): SIZE, ("EmptyFlux2LatentImage", "height"): SIZE,
                ("Flux2Scheduler", "width"): SIZE, ("Flux2Scheduler", "height"): SIZE,
                ("ImageScaleToTotalPixels", "megapixels"): MEGAPIXELS}


@pytest.fixture(scope="module")
def object_info(_server_session) -> dict:
    info = _server_session.get("/object_info")
    if "ComfySwitchNode" not in info:
        pytest.skip("this ComfyUI has no ComfySwitchNode, which the official templates switch Turbo with (0.33 has it)")
    return info


def _template(server, name: str) -> dict:
    try:
        return server.get(f"/templates/{name}.json")
    except urllib.error.HTTPError:
        pytest.skip(f"this ComfyUI's comfyui-workflow-templates has no {name}")


def _graphs(ui: dict) -> list[dict]:
    return [ui, *ui.get("definitions", {}).get("subgraphs", [])]


def _tiny(ui: dict, object_info: dict, turbo: bool) -> dict:
    """The template on the tiny files, at the tiny size and steps, with its Turbo switch set."""
    ui = copy.deepcopy(ui)
    for graph in _graphs(ui):
        for n in graph["nodes"]:
            if n["type"] not in object_info:
                continue
            schema = object_info[n["type"]]
            values = widget_values(n, schema)
            tiny = {k: TINY_NAMES.get(v, v) if isinstance(v, str) else TINY_WIDGETS.get((n["type"], k), v)
                    for k, v in values.items()}
            if n["type"] == "PrimitiveInt":
                tiny["value"] = STEPS[values["value"]]
            if n["type"] == "PrimitiveBoolean":
                tiny["value"] = turbo
            set_widget_values(n, schema, tiny)
    return ui


def _image(server, graph: dict) -> np.ndarray:
    (saved,) = (image for out in server.run(graph).values() for image in out.get("images", []))
    return np.asarray(Image.open(server.output_file(saved)))


def _written_by_hand(template: dict, edit: bool, turbo: bool) -> dict:
    """The template's graph with the pack's nodes, in API form: the official graph (workflows.official_dev_graph),
    the Turbo LoRA before the guider when on, and for an edit the picture as a reference latent, at its size."""
    values = {n["type"]: n["widgets_values"] for graph in _graphs(template) for n in graph["nodes"]}
    graph = official_dev_graph(
        node("Flux2DevTransformerSource", transformer=TINY_TRANSFORMER),
        node("Flux2DevEncoderLoader", encoder=TINY_ENCODER, padding=PADDING_MODES[0], allow_network=False),
        node("Flux2DevVAESource", vae=TINY_VAE), prompt=values["CLIPTextEncode"][0], width=SIZE, height=SIZE,
        steps=STEPS[examples.TURBO_STEPS if turbo else 20], guidance=values["FluxGuidance"][0],
        seed=values["RandomNoise"][0])
    if turbo:
        graph["turbo"] = node("Flux2DevLoraLoader", model=["model", 0], lora_name=TINY_LORA, strength_model=1.0,
                              strength_clip=1.0)
        graph["guider"]["inputs"]["model"] = ["turbo", 0]
    if edit:
        graph["image"] = node("LoadImage", image=IMAGE)
        graph["scaled"] = node("ImageScaleToTotalPixels", image=["image", 0], upscale_method="lanczos",
                               megapixels=MEGAPIXELS, resolution_steps=1)
        graph["size"] = node("GetImageSize", image=["scaled", 0])
        graph["encoded"] = node("VAEEncode", pixels=["scaled", 0], vae=["vae", 0])
        graph["reference"] = node("ReferenceLatent", conditioning=["guidance", 0], latent=["encoded", 0])
        graph["guider"]["inputs"]["conditioning"] = ["reference", 0]
        for sized in ("sigmas", "latent"):
            graph[sized]["inputs"].update(width=["size", 0], height=["size", 1])
    return graph


@pytest.mark.parametrize("name", TEMPLATES)
def test_the_templates_load_the_files_the_examples_name(comfy_server, object_info, name):
    """The pack's examples follow the official templates: the small-decoder VAE and the Turbo LoRA, in 8 steps."""
    template = _template(comfy_server, name)
    nodes = [n for graph in _graphs(template) for n in graph["nodes"] if n["type"] in object_info]
    named = {(n["type"], k): v for n in nodes for k, v in widget_values(n, object_info[n["type"]]).items()}
    assert named[("VAELoader", "vae_name")] == examples.VAE
    assert named[("LoraLoaderModelOnly", "lora_name")] == examples.TURBO_LORA
    assert sorted(n["widgets_values"][0] for n in nodes if n["type"] == "PrimitiveInt") \
        == [examples.TURBO_STEPS, examples.SIZES["steps"]]


@pytest.mark.parametrize("name", TEMPLATES)
def test_the_subgraph_shows_the_pack_nodes_widgets(comfy_server, object_info, name):
    """Every host loader is replaced, in the subgraph, and each widget the subgraph's node shows (its proxy widgets)
    and each of its inputs names a widget its inner node has."""
    swapped = with_pack_nodes(_template(comfy_server, name), object_info)
    assert not [n["type"] for graph in _graphs(swapped) for n in graph["nodes"] if n["type"] in PACK_NODES]
    (subgraph,) = swapped["definitions"]["subgraphs"]
    inner = {str(n["id"]): n for n in subgraph["nodes"]}
    (instance,) = (n for n in swapped["nodes"] if n["type"] == subgraph["id"])
    shown = instance["properties"]["proxyWidgets"]
    assert {tuple(p) for p in shown} >= {(str(n["id"]), pack_widget) for n in subgraph["nodes"]
                                         for host, (pack, names) in PACK_NODES.items() if n["type"] == pack
                                         for pack_widget in names.values() if pack_widget != "strength_model"}
    for node_id, widget in shown:
        schema = object_info[inner[node_id]["type"]]
        assert widget in widget_values(inner[node_id], schema) or widget in EXTRA_WIDGET_VALUES, (node_id, widget)
    links = {link["id"]: link for link in subgraph["links"]}
    for entry in subgraph["inputs"]:
        for link in entry["linkIds"]:
            target = inner[str(links[link]["target_id"])]
            socket = target["inputs"][links[link]["target_slot"]]
            if socket.get("widget"):
                assert socket["widget"]["name"] in widget_values(target, object_info[target["type"]])


@pytest.mark.parametrize("turbo", [False, True], ids=["turbo-off", "turbo-on"])
@pytest.mark.parametrize("name", TEMPLATES)
def test_the_template_with_the_pack_nodes_samples_as_the_graph_written_by_hand(comfy_server, object_info, name,
                                                                               turbo):
    template = _template(comfy_server, name)
    ui = _tiny(with_pack_nodes(template, object_info), object_info, turbo)
    image = _image(comfy_server, ui_to_api(ui, object_info))
    reference = _image(comfy_server, _written_by_hand(template, name == "image_flux2", turbo))
    assert image.shape[2] == 3 and image.std() > 0
    np.testing.assert_array_equal(image, reference)


def test_the_turbo_lora_changes_the_image(comfy_server, object_info):
    """The switch is no no-op: with the tiny Turbo LoRA the image differs (the steps held equal)."""
    template = _template(comfy_server, TEMPLATES[1])
    off, on = (_written_by_hand(template, edit=False, turbo=turbo) for turbo in (False, True))
    on["sigmas"]["inputs"]["steps"] = off["sigmas"]["inputs"]["steps"]
    assert not np.array_equal(_image(comfy_server, off), _image(comfy_server, on))

