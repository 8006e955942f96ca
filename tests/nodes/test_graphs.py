"""The official FLUX.2 [dev] graph in a real headless ComfyUI, with the pack's loaders in place of the
host's three. Every test here submits API-format JSON to the server, as a shared workflow would."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from comfyui_flux2dev.devtools.tiny.encoders import ENCODERS
from comfyui_flux2dev.devtools.workflows import node, official_dev_graph
from comfyui_flux2dev.errors import GraphError

pytestmark = pytest.mark.server

# Each tiny encoder as the encoder loader's menu names it (folders end with "/").
ENCODER_LAYOUTS = sorted(e.name if e.name.endswith((".safetensors", ".gguf")) else e.name + "/" for e in ENCODERS)
DEV_PIPELINE = "flux2-dev-tiny-pipeline/"
KLEIN_PIPELINE = "flux2-klein-4b-tiny-pipeline/"


def encoder(name, padding="reference"):
    return node("Flux2DevEncoderLoader", encoder=name, padding=padding, allow_network=False)


def gguf_model(name="flux2-dev-tiny-Q4_K.gguf"):
    return node("Flux2DevGGUFTransformerLoader", gguf_name=name, dequant_dtype="default", patch_dtype="float32")


def vae(name="flux2-ae.safetensors"):
    return node("Flux2DevVAESource", vae=name)


def image_of(server, outputs) -> np.ndarray:
    images = outputs["save"]["images"]
    assert len(images) == 1
    return np.asarray(Image.open(server.output_file(images[0])))


def test_the_tiny_factory_writes_every_encoder_of_its_table(tiny_manifest):
    made = {(e["path"].removeprefix("text_encoders/"), e["layout"], e["format"]) for e in tiny_manifest
            if e["kind"] == "encoder"}
    assert made == {(e.name, e.layout, e.format) for e in ENCODERS}


@pytest.mark.parametrize("layout", ENCODER_LAYOUTS)
def test_official_graph_writes_an_image_with_each_encoder_layout(server_on_device, layout):
    server = server_on_device
    image = image_of(server, server.run(official_dev_graph(gguf_model(), encoder(layout), vae(), seed=1)))
    assert image.shape == (64, 64, 3) and image.dtype == np.uint8
    assert image.std() > 0  # a decoded latent, not a blank canvas


def sampled_latent(server, graph) -> torch.Tensor:
    """Run `graph` with its sampler's output saved as a latent file instead of decoded, and read it back."""
    graph = {k: v for k, v in graph.items() if k not in ("decode", "save", "vae")}
    graph["save"] = node("SaveLatent", samples=["sample", 0], filename_prefix="flux2dev-latent")
    latents = server.run(graph)["save"]["latents"]
    return load_file(server.output_file(latents[0]))["latent_tensor"]


@pytest.mark.parametrize("qtype", ["F16", "Q8_0", "Q4_0", "Q4_K", "Q5_K", "Q6_K"])
def test_gguf_through_the_server_equals_its_dequantized_weights(comfy_server, qtype):
    clip = encoder("mistral_3_small_flux2_bf16.safetensors")
    name = f"flux2-dev-tiny-{qtype}"
    packed = sampled_latent(comfy_server, official_dev_graph(gguf_model(f"{name}.gguf"), clip, vae(), seed=7))
    plain = sampled_latent(comfy_server, official_dev_graph(
        node("Flux2DevTransformerSource", transformer=f"{name}-dequantized.safetensors"), clip, vae(), seed=7
    ))
    assert packed.dtype == plain.dtype == torch.float32 and packed.shape == plain.shape
    assert (packed - plain).abs().max().item() <= 1e-5


@pytest.mark.parametrize(
    "padding, vae_pipeline",
    [("reference", DEV_PIPELINE), ("comfy", KLEIN_PIPELINE)],  # the VAE of a Klein pipeline serves [dev]
    ids=["three-source-nodes-on-one-dev-pipeline", "klein-pipeline-vae"],
)
def test_source_nodes_on_dev_pipelines(comfy_server, padding, vae_pipeline):
    graph = official_dev_graph(
        node("Flux2DevTransformerSource", transformer=DEV_PIPELINE),
        node("Flux2DevEncoderSource", pipeline=DEV_PIPELINE, padding=padding),
        vae(vae_pipeline),
    )
    assert image_of(comfy_server, comfy_server.run(graph)).shape == (64, 64, 3)


ENCODER_REFUSALS = {
    "klein-4b-text-encoder/": (
        "This is the tiny Qwen3 text encoder of FLUX.2 Klein 4B (tiny test model) (hidden size 32, attention q_norm "
        "present), not the Mistral-Small 24B encoder FLUX.2 [dev] needs. Use it with the matching FLUX.2 Klein model, "
        "or pick a FLUX.2 [dev] encoder (mistral_3_small_flux2_*.safetensors or a Mistral-Small-3.x folder) here."
    ),
    "flux2-dev-transformer.safetensors": (
        "This is a FLUX.2 diffusion transformer, not a text encoder. Load it with Load FLUX.2 transformer "
        "(safetensors or pipeline) or Load FLUX.2 transformer (GGUF), and pick a Mistral-Small text encoder (e.g. "
        "mistral_3_small_flux2_bf16.safetensors) here."
    ),
    "flux2-vae.safetensors": (
        "This is a VAE (autoencoder), not a text encoder. Load it with Load FLUX.2 VAE (file or pipeline) or Load VAE, "
        "and pick a Mistral-Small text encoder (e.g. mistral_3_small_flux2_bf16.safetensors) here."
    ),
}


@pytest.mark.parametrize("name", sorted(ENCODER_REFUSALS))
def test_the_encoder_loader_names_what_it_was_given_instead(comfy_server, name):
    with pytest.raises(GraphError) as refused:
        comfy_server.run(official_dev_graph(gguf_model(), encoder(name), vae()))
    assert str(refused.value) == ENCODER_REFUSALS[name]


def test_a_klein_gguf_with_the_dev_encoder_fails_before_sampling(comfy_server):
    graph = official_dev_graph(
        gguf_model("flux2-klein-4b-tiny-Q8_0.gguf"), encoder("mistral_3_small_flux2_bf16.safetensors"), vae()
    )
    with pytest.raises(GraphError) as refused:
        comfy_server.run(graph)
    assert str(refused.value) == (
        "The conditioning is 192 wide (the tiny Mistral encoder of FLUX.2 [dev] (tiny test model)) but this FLUX.2 "
        "Klein 4B (tiny test model) transformer expects 96 (the tiny Qwen3 encoder of FLUX.2 Klein 4B (tiny test "
        "model)). Encode the prompt with the text encoder that belongs to FLUX.2 Klein 4B (tiny test model); "
        "encoders of different FLUX.2 variants do not mix."
    )
