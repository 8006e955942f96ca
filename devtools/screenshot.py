"""A screenshot of an example workflow in ComfyUI's real web frontend, for the README:

    apt-get install chromium && pip install playwright
    COMFYUI_ROOT=/path/to/ComfyUI python -m comfyui_flux2dev.devtools.screenshot [NAME] [--out FOLDER]

It starts a headless ComfyUI with the pack (on the tiny models, so the menus list files), opens the page in
the system's headless Chromium, and saves the Templates browser with the pack's examples, then the example
workflow loaded, as PNGs."""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

from . import tiny
from .tiny.geometry import test_models_env
from .example_workflows import EXAMPLES, UI_FOLDER
from .headless import PACK_FOLDER, HeadlessComfy

CHROMIUM = "/usr/bin/chromium"
DEFAULT = "FLUX.2 dev text to image - GGUF transformer, fp8 encoder"
DOCS = Path(__file__).resolve().parents[1] / "docs"
VIEW = {"width": 2900, "height": 1000}  # the whole graph at 100% zoom


def take(name: str, out: Path) -> None:
    """out/templates.png: the Templates browser listing the pack's examples; out/example-workflow.png: the
    example `name` loaded from it."""
    from playwright.sync_api import sync_playwright

    workflow = json.loads((UI_FOLDER / f"{name}.json").read_text(encoding="utf-8"))
    with tempfile.TemporaryDirectory() as models:
        tiny.write_all(models, manifest=False)
        parts = {folder: [Path(models) / folder] for folder in tiny.PARTS}
        with HeadlessComfy(os.environ["COMFYUI_ROOT"], models=parts, env=test_models_env(models)) as server, \
                sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
            page = browser.new_page(viewport=VIEW)
            page.goto(f"http://127.0.0.1:{server.port}/")
            page.wait_for_function("() => window.app && window.app.graph", timeout=120_000)
            out.mkdir(parents=True, exist_ok=True)
            page.get_by_text(PACK_FOLDER).first.click()  # the Templates browser opens on a first visit
            page.wait_for_timeout(2000)
            page.screenshot(path=str(out / "templates.png"), clip={"x": 0, "y": 0, "width": 1700, "height": 850})
            page.get_by_text(name).first.click()  # loads the example, as a user would
            page.wait_for_function("(n) => window.app.graph.nodes.length === n", arg=len(workflow["nodes"]))
            page.mouse.click(VIEW["width"] // 2, VIEW["height"] - 40)  # focus the canvas, on empty space
            page.keyboard.press(".")  # the frontend's "fit view"
            page.wait_for_timeout(2000)
            page.screenshot(path=str(out / "example-workflow.png"))
            browser.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m comfyui_flux2dev.devtools screenshot", description=__doc__.splitlines()[0])
    parser.add_argument("name", nargs="?", default=DEFAULT, choices=sorted(EXAMPLES))
    parser.add_argument("--out", type=Path, default=DOCS, help="the folder for the two PNGs")
    args = parser.parse_args(argv)
    take(args.name, args.out)
    print(f"wrote {args.out}")
    return 0
