"""Shared fixtures: the real ComfyUI host (in process and as a headless server) and the tiny weights."""

from __future__ import annotations

import collections
import fcntl
import hashlib
import importlib
import json
import os
import shutil
import sys
import tempfile
import types
from pathlib import Path

import pytest
import torch

from comfyui_flux2dev.devtools.tiny.geometry import test_models_env
from comfyui_flux2dev.loaders.cache.store import CACHE_DIR_ENV
from comfyui_flux2dev.loaders.models.variants import TEST_MODELS_ENV
from comfyui_flux2dev.tokenizers.canonical import hf_tokenizers
from helpers import CUDA_MISSING, cuda_param

# The Hugging Face tokenizers library, imported before the first test: pytest puts the repository itself on sys.path
# when it sets up the root folder as a package (it holds __init__.py) under a name that is no Python name (a
# clone's ComfyUI-Flux2Dev), and there the pack's tokenizers/ would hide the library from the host's imports.
hf_tokenizers()

# The tests run on tiny stand-ins for the real weights; the pack knows their geometry only when told.
_declaration = tempfile.TemporaryDirectory(prefix="flux2dev-tiny-models-")
os.environ.update(test_models_env(_declaration.name))
# Conditioning caches the tests do not name go to a folder of this session (the host's user folder would keep
# them from one run to the next, so a later run would hit where a test expects the encoder to run).
_session_cache = tempfile.TemporaryDirectory(prefix="flux2dev-test-cache-")
os.environ[CACHE_DIR_ENV] = _session_cache.name


def pytest_configure(config):
    config.addinivalue_line("markers",
                            "cuda: the CUDA variant of a test that runs on every device (the `device` fixture)")


# Tests that run a model or a packed op take the `device` fixture: they run on the CPU always and on CUDA where
# torch sees a GPU. Without one the CUDA variants are left out of the run (one line says how many);
# devtools/gpu-check runs them (`-m cuda`) on a GPU machine.
@pytest.fixture(params=["cpu", cuda_param("cuda")])
def device(request) -> torch.device:
    """Where the test runs its model or op: the CPU, then CUDA where torch sees a GPU."""
    return torch.device(request.param)


def _leave_out_cuda_variants(config, items) -> None:
    if torch.cuda.is_available():
        return
    left_out = [item for item in items if item.get_closest_marker("cuda")]
    if left_out:
        items[:] = [item for item in items if not item.get_closest_marker("cuda")]
        config.hook.pytest_deselected(items=left_out)
        config.stash[_CUDA_LEFT_OUT] = len(left_out)


_CUDA_LEFT_OUT = pytest.StashKey[int]()


@pytest.hookimpl(tryfirst=True)  # before xdist's own, which sends the worker's output
def pytest_sessionfinish(session):
    """A pytest-xdist worker hands its count of CUDA variants left out to the controller, which prints it."""
    if hasattr(session.config, "workeroutput"):
        session.config.workeroutput["cuda_left_out"] = session.config.stash.get(_CUDA_LEFT_OUT, 0)


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook; without xdist (-p no:xdist) it is not called
def pytest_testnodedown(node, error):
    left_out = getattr(node, "workeroutput", {}).get("cuda_left_out", 0)  # each worker collects every test
    node.config.stash[_CUDA_LEFT_OUT] = max(node.config.stash.get(_CUDA_LEFT_OUT, 0), left_out)


def pytest_terminal_summary(terminalreporter):
    left_out = terminalreporter.config.stash.get(_CUDA_LEFT_OUT, 0)
    if left_out:
        terminalreporter.write_line(f"{left_out} CUDA variants left out: {CUDA_MISSING}")


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


# What decides the tiny weights' bytes besides the pack's own code: the libraries that write them.
_TINY_WRITERS = ("torch", "transformers", "tokenizers", "diffusers", "safetensors", "gguf", "mistral-common", "numpy")
_TINY_SETS_KEPT = 2  # a CI run's two: the current releases' and the oldest supported ones'


def _tiny_key() -> str:
    """The tiny weights' version: the code that writes them (the pack's, their factory's) and the writers' releases."""
    from importlib.metadata import version

    pack = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256(sys.version.encode())
    for name in _TINY_WRITERS:
        digest.update(f"{name}=={version(name)};".encode())
    sources = (p for part in ("devtools", "loaders", "tokenizers") for p in (pack / part).rglob("*"))
    for path in sorted(p for p in sources if p.is_file() and "__pycache__" not in p.parts):
        digest.update(str(path.relative_to(pack)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def _listing(root: Path) -> list[list]:
    """Every file and link under `root` with its size and change time: what a test that wrote into it would change."""
    return sorted([str(p.relative_to(root)), s.st_size, s.st_mtime_ns] for p in root.rglob("*") if (s := p.lstat()))


@pytest.fixture(scope="session")
def tiny_root(request) -> Path:
    """Every tiny layout, written by the same factory as `flux2dev tiny DIR`. Writing them takes half a minute, so
    each version of them (_tiny_key) is written once into pytest's cache folder and read by every worker and every
    later run; no test writes into it, and a set that is not as written is written again."""
    from comfyui_flux2dev.devtools import tiny

    store = request.config.cache.mkdir("flux2dev-tiny")
    key = _tiny_key()
    root, listing = store / key, store / f"{key}.json"
    with open(store / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one writer; the other workers wait for its set
        if not listing.is_file() or json.loads(listing.read_text()) != _listing(root):
            shutil.rmtree(root, ignore_errors=True)
            tiny.write_all(root)
            listing.write_text(json.dumps(_listing(root)))
        os.utime(listing)  # used now: the sets used longest ago go first
        for old in sorted(store.glob("*.json"), key=lambda p: p.stat().st_mtime)[:-_TINY_SETS_KEPT]:
            shutil.rmtree(store / old.stem, ignore_errors=True)
            old.unlink()
    return root


@pytest.fixture
def encoder(tiny_root, tmp_path) -> Path:
    """A private copy of the tiny bf16 single-file encoder, which a test may rewrite or copy."""
    import shutil

    path = tmp_path / "encoder.safetensors"
    shutil.copyfile(tiny_root / "text_encoders/mistral_3_small_flux2_bf16.safetensors", path)
    return path


@pytest.fixture
def reads(monkeypatch) -> list[str]:
    """The tensors read from safetensors files while the test runs, into memory or as views of the mapped file."""
    from comfyui_flux2dev.loaders.formats.safetensors_file import SafetensorsFiles

    read = []
    for method in ("read", "view"):
        original = getattr(SafetensorsFiles, method)
        monkeypatch.setattr(SafetensorsFiles, method,
                            lambda self, name, original=original: read.append(name) or original(self, name))
    return read


@pytest.fixture(scope="session")
def ggml():
    """ggml's reference quantizer (tests/ggml_reference.py): reference(qtype, float32 rows) -> its bytes; the test
    skips, saying why, where it cannot be built."""
    import gguf

    import ggml_reference

    try:
        ggml_reference.build()
    except ggml_reference.Unavailable as e:
        pytest.skip(str(e))
    return lambda qtype, rows: ggml_reference.reference(qtype.name, rows, gguf.GGML_QUANT_SIZES[qtype][1])


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


# The shared server starts under the soft limit of open files a macOS shell gives the programs it starts (many Linux
# desktops give 1024): every graph the tests run on it, with every loader, runs under it, as on a user's Mac.
SERVER_OPEN_FILES = 256


def _headless(tiny_root, server_extras, gpu: bool):
    from comfyui_flux2dev.devtools import tiny
    from comfyui_flux2dev.devtools.headless import HeadlessComfy

    models = {folder: [tiny_root / folder] for folder in tiny.PARTS}
    for folder, extra in server_extras.items():
        models[folder].append(extra)
    return HeadlessComfy(_comfyui_root(), models=models, env={TEST_MODELS_ENV: os.environ[TEST_MODELS_ENV]}, gpu=gpu,
                         open_files=SERVER_OPEN_FILES)


@pytest.fixture(scope="session")
def _server_session(tiny_root, server_extras):
    with _headless(tiny_root, server_extras, gpu=False) as server:
        yield server


@pytest.fixture(scope="session")
def _gpu_server_session(tiny_root, server_extras):
    with _headless(tiny_root, server_extras, gpu=True) as server:
        yield server


# The quick tier (`bash tests/run quick`, marked `quick`): every layer's core path on the smallest fixtures, for a
# developer to run after every change; `bash tests/run` runs everything. Each entry is a file or a test id prefix.
QUICK = (
    "tests/formats/test_gguf_file.py",
    "tests/formats/test_gguf_dequant.py",
    "tests/formats/test_gguf_quant.py",
    "tests/formats/test_safetensors_file.py",
    "tests/formats/test_compiled.py",
    "tests/tokenizer/test_tokenizers.py",
    "tests/tokenizer/test_chat.py",
    "tests/models/test_encoder.py",
    "tests/models/test_transformer.py",
    "tests/models/test_gguf_transformer.py",
    "tests/models/test_vae.py",
    "tests/models/test_guard.py",
    "tests/models/test_pipeline.py",
    "tests/cache/test_conditioning_cache.py::test_entries_round_trip_and_a_foreign_or_damaged_file_is_a_miss",
    "tests/cache/test_conditioning_cache.py::test_a_hit_is_bit_equal_to_a_fresh_encode_and_reads_no_weights",
    "tests/convert/test_convert_transformer.py",
    "tests/convert/test_tensor_files.py",
    "tests/host/test_host_compat.py",
    "tests/host/test_dequant_scratch.py",
    "tests/host/test_lazy_encoder.py",
    "tests/nodes/test_graphs.py::test_official_graph_writes_an_image_with_each_encoder_layout[cpu-mistral_3_small_flux2_bf16",
    "tests/pack/test_bad_inputs.py",
    "tests/pack/test_imports.py",
)


def _in_entry(nodeid: str, entry: str) -> bool:
    """Whether a test id falls under a QUICK entry: the file, the test, or (an entry ending inside [...]) its
    parameters that start so."""
    return (nodeid == entry or nodeid.startswith((entry + "::", entry + "["))
            or ("[" in entry and nodeid.startswith(entry)))


def _mark_quick_tier(config, items) -> None:
    """Marks the QUICK entries' tests; an entry that names a collected file but matches none of its tests is an
    error, so that a renamed test cannot leave the quick tier unnoticed."""
    unmatched = set(QUICK)
    for item in items:
        for entry in QUICK:
            if _in_entry(item.nodeid, entry):
                item.add_marker(pytest.mark.quick)
                unmatched.discard(entry)
    collected = {item.nodeid.split("::")[0] for item in items}
    stale = sorted(entry for entry in unmatched if entry.split("::")[0] in collected)
    if stale:
        raise pytest.UsageError(f"tests/conftest.py QUICK names tests that no longer exist: {stale}")


# A test that runs ComfyUI (in process or as a server) asks for one of these, directly or through its fixtures;
# it is marked `host` and runs once per host tree (.ci/run), the others once in all. A test marked `one_host` checks
# what does not change with the host's release (the same host calls run in other tests on every tree): it runs on
# the first host only.
HOST_FIXTURES = ("comfy_host", "comfy_server", "server_on_device")


# The test files that take longest (each over a minute of a worker's time in CI), slowest first. tests/run hands
# files to the workers in this order, then the others by their number of tests, as xdist would: its own order, by
# number of tests alone, left these few-test files for the end, where one worker ran them while the other idled.
SLOWEST_FILES = (
    "tests/devtools/test_bench.py",
    "tests/devtools/test_fuzz.py",
    "tests/formats/test_kernel_cache.py",
    "tests/nodes/test_example_workflows.py",
    "tests/pack/test_pack.py",
    "tests/host/test_memory_release.py",
    "tests/models/test_upsampler.py",
    "tests/devtools/test_real_size.py",
)


def _slowest_first(items) -> None:
    """Items ordered file by file: SLOWEST_FILES first, then the files with the most tests."""
    counts = collections.Counter(item.nodeid.split("::")[0] for item in items)

    def rank(item):
        path = item.nodeid.split("::")[0]
        return (SLOWEST_FILES.index(path) if path in SLOWEST_FILES else len(SLOWEST_FILES), -counts[path], path)

    items.sort(key=rank)


@pytest.hookimpl(tryfirst=True)  # before -m selects by markers
def pytest_collection_modifyitems(config, items):
    _leave_out_cuda_variants(config, items)
    _mark_quick_tier(config, items)
    _slowest_first(items)
    for item in items:
        if item.get_closest_marker("one_host"):
            continue
        if any(f in getattr(item, "fixturenames", ()) for f in HOST_FIXTURES) or item.get_closest_marker("server"):
            item.add_marker(pytest.mark.host)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    setattr(item, f"report_{report.when}", report)
    return report


def _print_log_if_failed(server, request) -> None:
    report = getattr(request.node, "report_call", None)
    if report is not None and report.failed:
        print("---- ComfyUI server log ----\n" + server.log()[-20000:])


@pytest.fixture
def comfy_server(_server_session, request):
    """The real ComfyUI, headless on 127.0.0.1 with the pack loaded, on the CPU; its log is printed when a test
    fails."""
    yield _server_session
    _print_log_if_failed(_server_session, request)


@pytest.fixture
def server_on_device(device, request):
    """comfy_server, or for the CUDA variant the same server run on the GPU (a second one, started when first
    asked for)."""
    server = request.getfixturevalue("_server_session" if device.type == "cpu" else "_gpu_server_session")
    yield server
    _print_log_if_failed(server, request)


@pytest.fixture(scope="session")
def tiny_part(tiny_root, tiny_manifest):
    """tiny_part("vae") -> (the folder, its manifest entries with paths relative to that folder)."""

    def part(folder: str):
        prefix = folder + "/"
        entries = [{**e, "path": e["path"][len(prefix):]} for e in tiny_manifest if e["path"].startswith(prefix)]
        return tiny_root / folder, entries

    return part


# ComfyUI-GGUF, the independent reader of the GGUF files the pack writes: tests/run unpacks it from ../shared/peers/
# and names it here.
PEER_ENV = "FLUX2DEV_PEER_COMFYUI_GGUF"


@pytest.fixture(scope="module")
def peer(comfy_host):
    """(ComfyUI-GGUF's loader module, its dequant module), or a skip saying why they are not here."""
    folder = os.environ.get(PEER_ENV)
    if not folder or not Path(folder, "loader.py").is_file():
        pytest.skip("ComfyUI-GGUF is not here: tests/run unpacks it from ../shared/peers/ where that is beside the "
                    f"clone (as in CI) and names it in {PEER_ENV}; a user's clone has none")
    package = types.ModuleType("comfyui_gguf_peer")  # its own package, without running its __init__ (node registration)
    package.__path__ = [folder]
    sys.modules.setdefault("comfyui_gguf_peer", package)
    return importlib.import_module("comfyui_gguf_peer.loader"), importlib.import_module("comfyui_gguf_peer.dequant")
