"""`flux2dev demo`: the pack's three loaders in the official FLUX.2 [dev] graph, run by a real headless
ComfyUI on tiny generated weights. The weights are random, so the image is noise; what it shows is that
every part loads into the host's own objects and the host's sampling graph runs on them."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from ..errors import HostError
from ..host import COMFYUI_ROOT_ENV
from ..tokenizers.prompt import PADDING_MODES
from . import tiny
from .headless import HeadlessComfy
from .tiny.encoders import write_encoders
from .tiny.geometry import test_models_env
from .workflows import node, official_dev_graph

DEMO_PARTS = ("text_encoders", "unet", "vae")
DEMO_ENCODER = "mistral_3_small_flux2_bf16.safetensors"  # of the tiny encoders, the one the graph loads
IMAGE_NAME = "flux2dev-demo.png"


def demo_graph(prompt: str) -> dict:
    return official_dev_graph(
        model=node("Flux2DevGGUFTransformerLoader", gguf_name="flux2-dev-tiny-Q4_K.gguf",
                   dequant_dtype="default", patch_dtype="float32"),
        clip=node("Flux2DevEncoderLoader", encoder=DEMO_ENCODER,
                  padding=PADDING_MODES[0], allow_network=False),
        vae=node("Flux2DevVAESource", vae="flux2-ae.safetensors"),
        prompt=prompt, width=256, height=256, steps=4, filename_prefix="flux2dev-demo",
    )


def write_demo_models(models: Path) -> None:
    """The tiny models the demo's graph loads (of the tiny encoders, its own alone); the manifest, written last, says
    the folder is complete."""
    write_encoders(str(models / "text_encoders"), names=(DEMO_ENCODER,))
    tiny.write_all(models, parts=("unet", "vae"))


def run_demo(out: Path, prompt: str) -> Path:
    root = os.environ.get(COMFYUI_ROOT_ENV)
    if not root:
        raise HostError(f"The demo needs a ComfyUI tree: set {COMFYUI_ROOT_ENV}, or run it as `bash tests/run demo`.")
    models = out / "models"
    write_demo_models(models)
    with HeadlessComfy(root, models={part: [models / part] for part in DEMO_PARTS},
                       env=test_models_env(models)) as server:
        outputs = server.run(demo_graph(prompt))
        image = outputs["save"]["images"][0]
        target = out / IMAGE_NAME
        shutil.copyfile(server.output_file(image), target)
        (out / "server.log").write_text(server.log())
    return target
