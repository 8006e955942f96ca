"""The example workflows' inputs and thumbnails. The edit example's reference images, shipped in
example_workflows/inputs/, are copied into ComfyUI's input folder (where its Load Image node lists pictures) under
their own names; a file already there under such a name is left as it is. The templates' thumbnails are served
where the frontend asks for them."""

from __future__ import annotations

import functools
import logging
from pathlib import Path

from ..loaders.formats.files import write_new_file
from . import compat, ensure_comfy

FOLDER = Path(__file__).resolve().parents[1] / "example_workflows"
INPUTS = FOLDER / "inputs"
# template title -> its thumbnail, the only files the pack's route serves
THUMBNAILS = {path.stem: path for path in sorted(FOLDER.glob("*.jpg"))}


def install_example_inputs() -> list[str]:
    """Copy the examples' input pictures that ComfyUI's input folder lacks; the names copied."""
    ensure_comfy()
    import folder_paths

    target = Path(folder_paths.get_input_directory())
    copied = []
    for source in sorted(INPUTS.glob("*.png")):
        try:
            target.mkdir(parents=True, exist_ok=True)
            if write_new_file(target / source.name, source.read_bytes()):
                copied.append(source.name)
        except OSError as e:  # a read-only input folder costs the example its pictures, not the pack its nodes
            logging.warning("FLUX.2 [dev]: could not copy the example picture %s into %s: %s", source.name, target, e)
    if copied:
        logging.info("FLUX.2 [dev]: copied the image edit example's pictures into %s: %s", target, ", ".join(copied))
    return copied


@functools.cache
def serve_thumbnails() -> None:
    """Serve the templates' thumbnails where the frontend asks for them, GET /api/workflow_templates/<pack>/<title>.jpg
    (its getTemplateThumbnailUrl for a pack's templates): ComfyUI 0.38 serves only the .json files of a pack's
    example_workflows there; older releases serve the whole folder, as this route does (the route is added once,
    and only inside a running server)."""
    found = compat.server_routes()
    if found is not None:
        add_thumbnail_routes(*found)


def add_thumbnail_routes(routes, names) -> None:
    """Add the thumbnails' route to a server's route table (the host serves each of its routes under /api too),
    for each name the host loaded the pack under."""
    for name in names:
        routes.get(f"/workflow_templates/{name}/{{title}}.jpg")(_send_thumbnail)


async def _send_thumbnail(request):
    from aiohttp import web

    path = THUMBNAILS.get(request.match_info["title"])
    if path is None:
        raise web.HTTPNotFound()
    return web.FileResponse(path)
