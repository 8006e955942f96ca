"""What a newer ComfyUI changes under the pack: its server serves only the .json files of a pack's
example_workflows (0.38), so the pack serves its templates' thumbnails itself; a host function may lose a parameter
the pack passes, which compat names; the host's own FLUX.2 tokenizer may fail to build in any way, and comfy padding
then follows the pack's copy of its prompt syntax."""

from __future__ import annotations

import asyncio
import urllib.error
import urllib.request

import pytest

from comfyui_flux2dev.devtools.headless import PACK_FOLDER
from comfyui_flux2dev.host import examples

TITLES = sorted(examples.THUMBNAILS)


def _json_only_route(routes):
    """ComfyUI 0.38's route for a pack's templates (app/custom_node_manager.py): GET
    /workflow_templates/{module_name}/{filename} answers 404 unless the file name ends in .json, and there is no
    static mount of the folder any more."""
    from aiohttp import web

    @routes.get("/workflow_templates/{module_name}/{filename}")
    async def get_workflow_template_file(request):
        if not request.match_info["filename"].endswith(".json"):
            raise web.HTTPNotFound()
        return web.FileResponse(examples.FOLDER / request.match_info["filename"])


async def _fetch_all(app, paths) -> dict[str, tuple[int, bytes]]:
    from aiohttp.test_utils import TestClient, TestServer

    async with TestClient(TestServer(app)) as client:
        answers = {}
        for path in paths:
            response = await client.get(path)
            answers[path] = (response.status, await response.read())
        return answers


def test_a_server_that_serves_only_template_json_still_serves_the_thumbnails():
    """The pack's routes go into the server's table while the pack loads, before the host adds its own; the host
    then serves each route under /api too (server.add_routes), which is where the frontend asks."""
    from aiohttp import web

    routes = web.RouteTableDef()
    examples.add_thumbnail_routes(routes, [PACK_FOLDER])
    _json_only_route(routes)
    app = web.Application()
    app.add_routes([web.route(r.method, "/api" + r.path, r.handler) for r in routes])
    base = f"/api/workflow_templates/{PACK_FOLDER}"
    thumbnails = [f"{base}/{title}.jpg" for title in TITLES]
    answers = asyncio.run(_fetch_all(app, [*thumbnails, f"{base}/{TITLES[0]}.json", f"{base}/not a template.jpg"]))
    assert [answers[p] for p in thumbnails] == [(200, examples.THUMBNAILS[t].read_bytes()) for t in TITLES]
    assert answers[f"{base}/{TITLES[0]}.json"][0] == 200  # the host's own route still serves the workflow
    assert answers[f"{base}/not a template.jpg"][0] == 404


def _get(server, path: str) -> tuple[int, bytes]:
    url = f"http://127.0.0.1:{server.port}{urllib.request.quote(path, safe='/%')}"
    try:
        with urllib.request.urlopen(url, timeout=30) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, b""


def test_the_running_host_serves_the_thumbnails_through_the_packs_route(comfy_server):
    """The pack's own route is there on the real server: the host serves its routes without the /api prefix too,
    where no static mount of example_workflows answers (on releases before 0.38 that mount may answer /api first)."""
    assert len(TITLES) >= 6
    for prefix in ("", "/api"):
        for title in TITLES:
            got = _get(comfy_server, f"{prefix}/workflow_templates/{PACK_FOLDER}/{title}.jpg")
            assert got == (200, examples.THUMBNAILS[title].read_bytes()), (prefix, title)
    assert _get(comfy_server, f"/workflow_templates/{PACK_FOLDER}/..%2Fpyproject.jpg")[0] == 404


def test_every_host_call_the_pack_makes_fits_the_hosts_signatures(comfy_host):
    from comfyui_flux2dev.host.compat import unfit_calls

    unfit = unfit_calls()
    assert unfit == [], "This ComfyUI's functions no longer take what the pack passes them:\n" + "\n".join(unfit)


def test_a_host_function_without_a_parameter_the_pack_passes_is_named():
    from comfyui_flux2dev.host.compat import SIGNATURES, unfit_signature

    def load_model_weights(self, sd, unet_prefix=""):  # 0.3.75's, which has no `assign`
        pass

    ((what, spec, parameters, _),) = [row for row in SIGNATURES if row[1].endswith("load_model_weights")]
    message = unfit_signature(load_model_weights, spec, what, parameters)
    assert message == (f"comfy.model_base:BaseModel.load_model_weights takes no parameter assign; the pack passes it "
                       f"for {what}. Its parameters here: self, sd, unet_prefix")
    assert unfit_signature(lambda sd, unet_prefix, assign, **kwargs: None, spec, what, parameters) is None


def test_a_host_result_the_pack_cannot_unpack_is_named():
    from comfyui_flux2dev.host.compat import RESULTS, unfit_result

    def process_tokens(self, tokens, device):
        if not tokens:
            return None
        return tokens, device, []

    def four(self, tokens, device):
        return tokens, device, [], []

    ((what, spec, size),) = RESULTS
    assert unfit_result(process_tokens, spec, what, size) == (
        f"{spec} returns 3 values, something other than a tuple; the pack unpacks 4 values from it for {what}")
    assert unfit_result(four, spec, what, size) is None


@pytest.mark.parametrize("error", [ValueError("the tekken file's pattern is not a regex"), KeyError("vocab")])
def test_comfy_padding_falls_back_when_the_hosts_tokenizer_builder_raises(comfy_host, monkeypatch, error):
    import comfy.text_encoders.flux

    from comfyui_flux2dev.host.compat import prompt_pieces

    def builder_that_fails(self, *args, **kwargs):
        raise error

    monkeypatch.setattr(comfy.text_encoders.flux.Mistral3Tokenizer, "__init__", builder_that_fails)
    with pytest.raises(type(error)):  # the host's own builder is what fails
        comfy.text_encoders.flux.Flux2Tokenizer(tokenizer_data={})
    prompt_pieces.cache_clear()
    try:
        assert prompt_pieces() is None
    finally:
        prompt_pieces.cache_clear()
