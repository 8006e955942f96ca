"""Shared fixtures: the real ComfyUI host (in process and as a headless server) and the tiny weights."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from comfyui_flux2dev.loaders.variants import TINY_MODELS_ENV

# The tests run on tiny stand-ins for the real weights; the pack knows their geometry only when told.
os.environ[TINY_MODELS_ENV] = "1"


def _comfyui_root() -> Path:
    root = os.environ.get("COMFYUI_ROOT")
    if not root:
        pytest.fail("COMFYUI_ROOT is not set: run the suite through `bash tests/run`, which sets up the host.")
    return Path(root)


@pytest.fixture(scope="session")
def comfy_host():
    """The real comfy package, imported in this process on the CPU."""
    _comfyui_root()
    from comfyui_flux2dev.host import ensure_comfy

    ensure_comfy()
    import comfy.sd

    return comfy.sd


@pytest.fixture(scope="session")
def tiny_root(tmp_path_factory) -> Path:
    """Every tiny layout, written once per session by the same factory as `flux2dev tiny DIR`."""
    from comfyui_flux2dev import tiny

    root = tmp_path_factory.mktemp("tiny")
    tiny.write_all(root)
    return root


@pytest.fixture(scope="session")
def tiny_manifest(tiny_root) -> list[dict]:
    from comfyui_flux2dev import tiny

    return tiny.read_manifest(tiny_root)


@pytest.fixture(scope="session")
def _server_session(tiny_root):
    from comfyui_flux2dev import tiny
    from comfyui_flux2dev.headless import HeadlessComfy

    models = {folder: tiny_root / folder for folder in tiny.PARTS}
    with HeadlessComfy(_comfyui_root(), models=models, env={TINY_MODELS_ENV: "1"}) as server:
        yield server


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    setattr(item, f"report_{report.when}", report)
    return report


@pytest.fixture
def comfy_server(_server_session, request):
    """The real ComfyUI, headless on 127.0.0.1 with the pack loaded; its log is printed when a test fails."""
    yield _server_session
    report = getattr(request.node, "report_call", None)
    if report is not None and report.failed:
        print("---- ComfyUI server log ----\n" + _server_session.log()[-20000:])
