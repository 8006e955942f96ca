"""ComfyUI's real web frontend in headless Chromium: its node search, its Templates browser and its Missing
Models check, for the tests, and the pictures in docs/ and the templates' thumbnails:

    apt-get install chromium && pip install playwright
    COMFYUI_ROOT=/path/to/ComfyUI python -P -m comfyui_flux2dev.devtools screenshot [--docs FOLDER]

The pictures are taken on a headless ComfyUI with the pack and the tiny models (so the menus list files);
those in docs/ are of ComfyUI 0.33's frontend."""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import json
import os
import tempfile
import urllib.parse
from pathlib import Path

from ..loaders.models.variants import TEST_MODELS_ENV
from .example_workflows import EXAMPLES, TEXT_TO_IMAGE, UI_FOLDER
from .headless import INSTALLED_FOLDER, HeadlessComfy
from .tiny.geometry import DECLARATION

CHROMIUM = "/usr/bin/chromium"  # Debian's package
# Headless, and without the background connections a closed network refuses.
CHROMIUM_ARGS = ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
# The user setting the frontend sets on its first visit to a server, when it opens the Templates browser by itself.
TUTORIAL_DONE = "Comfy.TutorialCompleted"
DOCS = Path(__file__).resolve().parents[1] / "docs"
THUMBNAIL = 512  # the Templates browser shows square cards
SEARCHES = ("load flux", "flux2 vae", "gguf", "text encoder")  # docs/node-search.png shows the first


def unavailable() -> str | None:
    """Why the frontend cannot be driven here, or None."""
    if not os.access(CHROMIUM, os.X_OK):
        return f"no Chromium at {CHROMIUM} (apt-get install chromium)"
    if importlib.util.find_spec("playwright") is None:
        return "Playwright is not installed (pip install playwright)"
    return None


@contextlib.contextmanager
def open_frontend(server: HeadlessComfy, width: int = 1600, height: int = 1000):
    """A page of the server's frontend with its graph ready and no dialog open."""
    from playwright.sync_api import sync_playwright

    first_visit = not server.get("/settings").get(TUTORIAL_DONE)
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": width, "height": height})
            page.goto(f"http://127.0.0.1:{server.port}/")
            page.wait_for_function("() => window.app && window.app.graph", timeout=120_000)
            if first_visit:
                _close_first_visit_templates(page)
            yield page
        finally:
            browser.close()


def _close_first_visit_templates(page) -> None:
    """The Templates browser opens by itself on a server's first visit, which then sets TUTORIAL_DONE."""
    from playwright.sync_api import TimeoutError

    browser = page.get_by_text("All Templates").first
    try:
        browser.wait_for(timeout=15_000)
    except TimeoutError:
        return
    page.keyboard.press("Escape")
    browser.wait_for(state="hidden")


def search(page, phrase: str, shot: Path | None = None) -> list[str]:
    """The node titles the frontend's node search lists for `phrase`, best first. The search box opens through the
    frontend's own command (as its shortcut does), wherever the canvas's free space is."""
    page.keyboard.press("Escape")
    page.evaluate("() => window.app.extensionManager.command.execute('Workspace.SearchBox.Toggle')")
    box = page.locator("input[role=combobox]")
    box.wait_for()
    box.fill(phrase)
    page.wait_for_timeout(1500)
    titles = page.evaluate("""() => Array.from(document.querySelectorAll('#results-list [role=option]'))
        .map(item => item.querySelector('.truncate').innerText.trim())""")
    if shot is not None:
        page.screenshot(path=str(shot))
    page.keyboard.press("Escape")
    box.wait_for(state="detached")
    return titles


def templates_browser(page, pack_folder: str, shot: Path | None = None) -> list[tuple[str, bytes]]:
    """(title, thumbnail bytes) of each of the pack's examples the Templates browser shows under the pack's name;
    the thumbnail is what the browser fetches for the card."""
    page.evaluate("() => window.app.extensionManager.command.execute('Comfy.BrowseTemplates')")
    page.get_by_text(pack_folder).last.click()
    page.get_by_text("Showing").first.wait_for()
    page.wait_for_timeout(2000)
    if shot is not None:
        page.screenshot(path=str(shot))
    base = page.url.rstrip("/")
    shown = [name for name in EXAMPLES if page.get_by_text(name, exact=True).count() > 0]
    out = [(name,
            page.request.get(f"{base}/api/workflow_templates/{pack_folder}/{urllib.parse.quote(name)}.jpg").body())
           for name in shown]
    page.keyboard.press("Escape")
    return out


def load_workflow(page, ui: dict) -> None:
    """Load a UI-format workflow as opening its file would."""
    page.evaluate("(workflow) => window.app.loadGraphData(workflow)", ui)
    page.wait_for_function("(n) => window.app.graph.nodes.length === n", arg=len(ui["nodes"]))
    page.wait_for_timeout(2000)


def shows_missing_models(page) -> bool:
    """Whether the frontend reports missing models for the loaded workflow (its errors panel lists them)."""
    details = page.get_by_text("View details")
    if details.count() == 0:
        return False
    details.first.click()
    page.wait_for_timeout(1000)
    missing = page.get_by_text("Missing Models").count() > 0
    page.keyboard.press("Escape")
    return missing


def fit_view(page) -> None:
    page.keyboard.press("Escape")
    page.mouse.click(page.viewport_size["width"] // 2, page.viewport_size["height"] - 30)  # empty canvas
    page.keyboard.press(".")  # the frontend's "fit view"
    page.wait_for_timeout(1000)


def thumbnail(page, ui: dict) -> bytes:
    """A JPEG of the workflow's graph alone (the canvas's own pixels, fitted), letterboxed to a card's square."""
    import base64

    from PIL import Image

    load_workflow(page, ui)
    fit_view(page)
    png, box = page.evaluate("""() => {
        const c = window.app.canvas, ds = c.ds, r = window.devicePixelRatio || 1, title = 30, margin = 20;
        const xs = [], ys = [];
        for (const n of window.app.graph.nodes) {
            xs.push(n.pos[0], n.pos[0] + n.size[0]); ys.push(n.pos[1] - title, n.pos[1] + n.size[1]);
        }
        const px = (v, o) => (v + o) * ds.scale * r;
        return [c.canvas.toDataURL('image/png'),
                [px(Math.min(...xs), ds.offset[0]) - margin, px(Math.min(...ys), ds.offset[1]) - margin,
                 px(Math.max(...xs), ds.offset[0]) + margin, px(Math.max(...ys), ds.offset[1]) + margin]];
    }""")
    graph = Image.open(io.BytesIO(base64.b64decode(png.split(",", 1)[1]))).convert("RGB").crop(tuple(map(round, box)))
    graph.thumbnail((THUMBNAIL, THUMBNAIL), Image.LANCZOS)
    card = Image.new("RGB", (THUMBNAIL, THUMBNAIL), (32, 32, 32))
    card.paste(graph, ((THUMBNAIL - graph.width) // 2, (THUMBNAIL - graph.height) // 2))
    out = io.BytesIO()
    card.save(out, "JPEG", quality=90)
    return out.getvalue()


def tiny_comfyui(folder: Path, **options) -> HeadlessComfy:
    """A ComfyUI folder as `tiny --comfyui` leaves it (tiny models, the examples' tiny form in the user's
    workflows), served headless (HeadlessComfy's `options`)."""
    from . import tiny

    tiny.write_into_comfyui(folder)
    return HeadlessComfy(os.environ["COMFYUI_ROOT"], base_dir=folder,
                         env={TEST_MODELS_ENV: str(folder / "models" / DECLARATION)}, **options)


def tiny_workflow(folder: Path, name: str) -> dict:
    from .tiny import TINY_WORKFLOW_PREFIX

    path = folder / "user" / "default" / "workflows" / f"{TINY_WORKFLOW_PREFIX}{name}.json"
    return json.loads(path.read_text(encoding="utf-8"))


def take_all(docs: Path) -> list[Path]:
    """The templates' thumbnails (example_workflows/NAME.jpg), and in `docs` the Templates browser, a node
    search, and the text-to-image example in its tiny form loaded after `tiny --comfyui`."""
    written = []
    with tempfile.TemporaryDirectory() as comfyui, \
            tiny_comfyui(Path(comfyui), pack_folder=INSTALLED_FOLDER) as server:
        with open_frontend(server, 2900, 1000) as page:  # wide enough for the whole graph near 100% zoom
            for name in EXAMPLES:
                path = UI_FOLDER / f"{name}.jpg"
                path.write_bytes(thumbnail(page, tiny_workflow(Path(comfyui), name)))
                written.append(path)
            load_workflow(page, tiny_workflow(Path(comfyui), TEXT_TO_IMAGE))
            fit_view(page)
            page.screenshot(path=str(docs / "example-workflow.png"))
        with open_frontend(server) as page:
            templates_browser(page, INSTALLED_FOLDER, shot=docs / "templates.png")
            search(page, SEARCHES[0], shot=docs / "node-search.png")
        written += [docs / "example-workflow.png", docs / "templates.png", docs / "node-search.png"]
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m comfyui_flux2dev.devtools screenshot",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--docs", type=Path, default=DOCS, help="the folder for the pictures (docs/)")
    args = parser.parse_args(argv)
    reason = unavailable()
    if reason:
        print(f"cannot drive the frontend: {reason}")
        return 2
    for path in take_all(args.docs):
        print(f"wrote {path}")
    return 0
