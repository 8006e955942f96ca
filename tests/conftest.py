"""Shared fixtures: the real ComfyUI host (in process and as a headless server) and the tiny weights."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest
# The Hugging Face library, before pytest imports the repository's own __init__.py (the pack's folder is a package)
# and so puts the repository first on sys.path, where the pack's tokenizers/ would hide the library of that name
# from a test file run alone.
import tokenizers  # noqa: F401

from comfyui_flux2dev.loaders.cache.store import CACHE_DIR_ENV
from comfyui_flux2dev.devtools.tiny.geometry import test_models_env
from comfyui_flux2dev.loaders.models.variants import TEST_MODELS_ENV

# The tests run on tiny stand-ins for the real weights; the pack knows their geometry only when told.
_declaration = tempfile.TemporaryDirectory(prefix="flux2dev-tiny-models-")
os.environ.update(test_models_env(_declaration.name))
# Conditioning caches the tests do not name go to a folder of this session (the host's user folder would keep
# them from one run to the next, so a later run would hit where a test expects the encoder to run).
_session_cache = tempfile.TemporaryDirectory(prefix="flux2dev-test-cache-")
os.environ[CACHE_DIR_ENV] = _session_cache.name


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
    from comfyui_flux2dev.devtools import tiny

    root = tmp_path_factory.mktemp("tiny")
    tiny.write_all(root)
    return root


@pytest.fixture
def encoder(tiny_root, tmp_path) -> Path:
    """A private copy of the tiny bf16 single-file encoder, which a test may rewrite or copy."""
    import shutil

    path = tmp_path / "encoder.safetensors"
    shutil.copyfile(tiny_root / "text_encoders/mistral_3_small_flux2_bf16.safetensors", path)
    return path


@pytest.fixture(scope="session")
def tiny_manifest(tiny_root) -> list[dict]:
    from comfyui_flux2dev.devtools import tiny

    return tiny.read_manifest(tiny_root)


@pytest.fixture(scope="session")
def server_extras(tiny_root, tmp_path_factory) -> dict[str, Path]:
    """Files the server lists beside the tiny weights: parts of the wrong kind in text_encoders (for the
    encoder loader's errors), and each tiny [dev] GGUF dequantized by gguf's own numpy code into a plain
    float32 safetensors file (the references for the GGUF loader through the server)."""
    import gguf
    import torch
    from safetensors.torch import save_file

    extras = tmp_path_factory.mktemp("server-extras")
    wrong = extras / "text_encoders"
    wrong.mkdir()
    (wrong / "klein-4b-text-encoder").symlink_to(tiny_root / "diffusers/flux2-klein-4b-tiny-pipeline/text_encoder")
    (wrong / "flux2-dev-transformer.safetensors").symlink_to(tiny_root / "diffusion_models/flux2-dev-tiny.safetensors")
    (wrong / "flux2-vae.safetensors").symlink_to(tiny_root / "vae/flux2-ae.safetensors")
    reference = extras / "diffusion_models"
    reference.mkdir()
    for gguf_file in sorted((tiny_root / "unet").glob("flux2-dev-tiny-*.gguf")):
        reader = gguf.GGUFReader(gguf_file)
        tensors = {
            t.name: torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).astype("float32").copy())
            .reshape(tuple(reversed([int(d) for d in t.shape])))
            for t in reader.tensors
        }
        save_file(tensors, reference / f"{gguf_file.stem}-dequantized.safetensors")
    return {"text_encoders": wrong, "diffusion_models": reference}


@pytest.fixture(scope="session")
def _server_session(tiny_root, server_extras):
    from comfyui_flux2dev.devtools import tiny
    from comfyui_flux2dev.devtools.headless import HeadlessComfy

    models = {folder: [tiny_root / folder] for folder in tiny.PARTS}
    for folder, extra in server_extras.items():
        models[folder].append(extra)
    with HeadlessComfy(_comfyui_root(), models=models, env={TEST_MODELS_ENV: os.environ[TEST_MODELS_ENV]}) as server:
        yield server


# A test that runs ComfyUI (in process or as a server) asks for one of these, directly or through its fixtures;
# it is marked `host` and runs once per host tree (.ci/run), the others once in all.
HOST_FIXTURES = ("comfy_host", "comfy_server")


@pytest.hookimpl(tryfirst=True)  # before -m selects by markers
def pytest_collection_modifyitems(config, items):
    for item in items:
        if any(f in getattr(item, "fixturenames", ()) for f in HOST_FIXTURES) or item.get_closest_marker("server"):
            item.add_marker(pytest.mark.host)


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


@pytest.fixture(scope="session")
def tiny_part(tiny_root, tiny_manifest):
    """tiny_part("vae") -> (the folder, its manifest entries with paths relative to that folder)."""

    def part(folder: str):
        prefix = folder + "/"
        entries = [{**e, "path": e["path"][len(prefix):]} for e in tiny_manifest if e["path"].startswith(prefix)]
        return tiny_root / folder, entries

    return part
