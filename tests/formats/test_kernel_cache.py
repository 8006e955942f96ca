"""numba's on-disk cache of the one-pass kernels, in fresh processes, on a copy of the pack: imported as ComfyUI
imports a custom node (its modules named by the folder's path) and as the installed comfyui_flux2dev, in both
orders, from a moved folder, from a read-only one, and with a damaged cache. Every process gets the reference's
bits, and a cache entry written by one is loaded by the next (or, damaged, leaves its type to the torch path)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

PACK_ROOT = Path(__file__).resolve().parents[2]

# Imports the pack from sys.argv[2] under the name sys.argv[1] (ComfyUI's nodes.load_custom_node does the same
# with the folder's path as the name), then quantizes and dequantizes Q8_0 with it, against gguf's numpy code.
_CHILD = """
import importlib, importlib.util, json, logging, sys
name, root = sys.argv[1], sys.argv[2]
if name != "comfyui_flux2dev":
    sys.modules["comfyui_flux2dev"] = None  # as in a ComfyUI where the pack is only in custom_nodes
spec = importlib.util.spec_from_file_location(name, root + "/__init__.py")
pack = importlib.util.module_from_spec(spec)
sys.modules[name] = pack
spec.loader.exec_module(pack)

import gguf, numpy as np, torch
from gguf import GGMLQuantizationType as Q
logging.basicConfig(level=logging.WARNING)
fused = importlib.import_module(name + ".loaders.formats.fused")
dequantize = importlib.import_module(name + ".loaders.formats.gguf_dequant").dequantize
quantize = importlib.import_module(name + ".loaders.formats.gguf_quant").quantize

values = np.random.default_rng(0).standard_normal((64, 256)).astype(np.float32)
blocks = quantize(torch.from_numpy(values), Q.Q8_0)
assert np.array_equal(blocks.numpy(), gguf.quants.quantize(values, Q.Q8_0)), "quantized bytes differ"
got = dequantize(blocks, Q.Q8_0, values.shape, torch.float16)
assert np.array_equal(got.numpy(), gguf.quants.dequantize(blocks.numpy(), Q.Q8_0).astype(np.float16)), "values differ"
kernels = fused._kernels()
used = {"convert": kernels.convert, "quantize": kernels.QUANTIZE["Q8_0"], "dequantize": kernels.GGUF["Q8_0"]}
print(json.dumps({"failed": sorted(fused._FAILED), "path": fused.path("cpu", torch.float16),
                  "cache": {k: [sum(v.stats.cache_hits.values()), sum(v.stats.cache_misses.values())]
                            for k, v in used.items()}}))
"""


def _copy_of_the_pack(dest: Path) -> Path:
    """The pack's modules that quantization needs, in a folder named as a custom node is, without numba's cache."""
    for part in ("__init__.py", "errors.py", "loaders"):
        source = PACK_ROOT / part
        if source.is_dir():
            shutil.copytree(source, dest / part, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            dest.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest / part)
    return dest


def _run(name: str, root: Path, cache_home: Path, wrap: list[str] = ()) -> dict:
    """One fresh process; numba's own choices (no NUMBA_CACHE_DIR), its per-user cache under `cache_home`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("NUMBA_")} | {"XDG_CACHE_HOME": str(cache_home)}
    done = subprocess.run([*wrap, sys.executable, "-P", "-c", textwrap.dedent(_CHILD), name, str(root)],
                          capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "failed unexpectedly" not in done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["log"] = done.stderr
    return result


def _compiled(result: dict) -> bool:
    return result["failed"] == [] and result["path"] == "numba" and all(m > 0 for h, m in result["cache"].values())


def _loaded(result: dict) -> bool:
    return result["failed"] == [] and result["path"] == "numba" \
        and all(h > 0 and m == 0 for h, m in result["cache"].values())


@pytest.mark.parametrize("first_as_comfyui", [True, False], ids=["comfyui-first", "installed-first"])
def test_a_cache_written_under_one_import_name_is_loaded_under_the_other(tmp_path, first_as_comfyui):
    """ComfyUI names the pack's modules by its folder's path, the command line by comfyui_flux2dev; whichever
    compiled the kernels first, the other loads them, and so does the same folder moved elsewhere."""
    pack = _copy_of_the_pack(tmp_path / "ComfyUI" / "custom_nodes" / "ComfyUI-Flux2Dev")
    names = [str(pack), "comfyui_flux2dev"] if first_as_comfyui else ["comfyui_flux2dev", str(pack)]
    assert _compiled(_run(names[0], pack, tmp_path / "user-cache"))
    assert _loaded(_run(names[1], pack, tmp_path / "user-cache"))
    moved = tmp_path / "ComfyUI_portable" / "custom_nodes" / "flux2dev"
    moved.parent.mkdir(parents=True)
    pack.rename(moved)
    assert _loaded(_run(str(moved), moved, tmp_path / "user-cache"))
    assert _loaded(_run("comfyui_flux2dev", moved, tmp_path / "user-cache"))
    assert not (tmp_path / "user-cache").exists(), "the pack's folder was writable: numba's cache belongs beside it"


def test_a_damaged_cache_leaves_its_kernels_to_the_torch_path(tmp_path):
    """A cache entry that cannot be read (here: the kernels' entries overwritten with other bytes) costs speed,
    not the load: the kernel's type takes the torch path, with one log line naming it, and the bits are the same."""
    pack = _copy_of_the_pack(tmp_path / "custom_nodes" / "ComfyUI-Flux2Dev")
    assert _compiled(_run(str(pack), pack, tmp_path / "user-cache"))
    damaged = [f for f in (pack / "loaders" / "formats" / "__pycache__").iterdir()
               if f.suffix in (".nbi", ".nbc") and not f.name.startswith("numba_kernels.convert-")]
    assert damaged
    for entry in damaged:
        entry.write_bytes(b"\x80\x04not a pickle")
    result = _run("comfyui_flux2dev", pack, tmp_path / "user-cache")
    assert result["failed"] == ["Q8_0 dequantization", "Q8_0 quantization"]
    for kernel in result["failed"]:
        assert result["log"].count(f"kernel for {kernel} could not be loaded or compiled") == 1


def _read_only(folder: Path) -> list[str]:
    """A command prefix that runs its command with `folder` mounted read-only (root's chmod would not stop root)."""
    probe = subprocess.run(["unshare", "-m", "sh", "-c",
                            f"mount --bind -o ro '{folder}' '{folder}' && ! touch '{folder}/x'"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip("a read-only bind mount needs root and unshare (util-linux); not available here")
    return ["unshare", "-m", "sh", "-c", f"mount --bind -o ro '{folder}' '{folder}' && exec \"$@\"", "read-only"]


def test_from_a_read_only_folder_the_kernels_are_cached_per_user(tmp_path):
    """A pack folder the user cannot write (a system-wide install): numba keeps the kernels in the user's cache
    folder instead, and the next process, under the other import name, loads them from there."""
    pack = _copy_of_the_pack(tmp_path / "custom_nodes" / "ComfyUI-Flux2Dev")
    wrap = _read_only(pack)
    assert _compiled(_run(str(pack), pack, tmp_path / "user-cache", wrap))
    assert _loaded(_run("comfyui_flux2dev", pack, tmp_path / "user-cache", wrap))
    assert not (pack / "loaders" / "formats" / "__pycache__").exists()
    assert any((tmp_path / "user-cache").rglob("*.nbi"))
