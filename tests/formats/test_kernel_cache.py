"""The compiled kernels' on-disk cache (kernel_cache.py), in fresh processes, on a copy of the pack: imported as
ComfyUI imports a custom node (its modules named by the folder's path) and as the installed comfyui_flux2dev, in both
orders, from a moved folder, from a read-only one; with its entries garbled, emptied or swapped between
kernels, its folder full, or no folder writable. Every process gets the reference's bits from the compiled kernels
(the one-pass Q8_0 quantizer and dequantizer, the Q6_K quantizer) at the speed of a clean cache, and a cache entry
written by one is loaded by the next."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from helpers import restricted

PACK_ROOT = Path(__file__).resolve().parents[2]

# Imports the pack from $PACK_ROOT under the name $PACK_NAME (ComfyUI's nodes.load_custom_node does the same with the
# folder's path as the name), dequantizes Q8_0 against gguf's numpy code and quantizes Q6_K against the plain port,
# then times the Q6_K quantizer (the kernels already loaded or compiled).
_CHILD = textwrap.dedent("""
import importlib, importlib.util, json, logging, os, sys, time
name, root = os.environ["PACK_NAME"], os.environ["PACK_ROOT"]
if name != "comfyui_flux2dev":
    sys.modules["comfyui_flux2dev"] = None  # as in a ComfyUI where the pack is only in custom_nodes
spec = importlib.util.spec_from_file_location(name, root + "/__init__.py")
pack = importlib.util.module_from_spec(spec)
sys.modules[name] = pack
spec.loader.exec_module(pack)

import gguf, numpy as np, torch
from gguf import GGMLQuantizationType as Q
logging.basicConfig(level=logging.WARNING)
formats = name + ".loaders.formats."
kernels, gguf_types = importlib.import_module(formats + "kernels"), importlib.import_module(formats + "gguf_types")
dequantize, quantize, rows = gguf_types.dequantize, gguf_types.quantize, gguf_types.BY_TYPE
plain = importlib.import_module(formats + "gguf_k")  # the K quantizers' code, run here as plain Python

values = np.random.default_rng(0).standard_normal((64, 4096)).astype(np.float32)
blocks = torch.from_numpy(gguf.quants.quantize(values, Q.Q8_0))
got = dequantize(blocks, Q.Q8_0, values.shape, torch.float32)
assert np.array_equal(got.numpy(), gguf.quants.dequantize(blocks.numpy(), Q.Q8_0)), "values differ"
k = quantize(torch.from_numpy(values), Q.Q6_K).numpy().reshape(-1, 210)
want = np.zeros((4, 210), np.uint8)
with np.errstate(all="ignore"):
    plain.q6_k(values.reshape(-1, 256)[:4], want)
assert np.array_equal(k[:4], want), "Q6_K bytes differ"
seconds = []
while len(seconds) < 50 and sum(seconds) < 0.25:  # the best of many runs (one, where the plain port runs)
    start = time.perf_counter()
    quantize(torch.from_numpy(values), Q.Q6_K, threads=1)
    seconds.append(time.perf_counter() - start)

used = {"Q8_0": kernels._entry(rows[Q.Q8_0].read_kernel), "Q6_K": kernels._entry(rows[Q.Q6_K].write_kernel)}
folders = {kernel.stats.cache_path for kernel in used.values()}
print(json.dumps({"failed": sorted(kernels._FAILED),
                  "paths": [kernels.path("cpu", torch.float32), kernels.write_path(rows[Q.Q6_K])],
                  "cache": {k: [sum(v.stats.cache_hits.values()), sum(v.stats.cache_misses.values())]
                            for k, v in used.items()},
                  "files": sorted(f for d in folders if os.path.isdir(d) for f in os.listdir(d)),
                  "seconds": min(seconds)}))
""")


def _copy_of_the_pack(dest: Path, source: Path = PACK_ROOT) -> Path:
    """The pack's modules that quantization needs (from a copy made here: with its kernel cache), in a folder named as
    a custom node is."""
    skip = shutil.ignore_patterns("__pycache__") if source == PACK_ROOT else None
    for part in ("__init__.py", "errors.py", "loaders"):
        if (source / part).is_dir():
            shutil.copytree(source / part, dest / part, ignore=skip)
        else:
            dest.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source / part, dest / part)
    return dest


def _run(name: str, root: Path, cache_home: Path, how: str | None = None, folder: Path | None = None) -> dict:
    """One fresh process; no NUMBA_ settings, the user's cache folder under `cache_home`; `folder` made read-only or
    full (`how`) for it alone where given."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("NUMBA_")} | {
        "XDG_CACHE_HOME": str(cache_home), "PACK_NAME": name, "PACK_ROOT": str(root)}
    if how is None:
        done = subprocess.run([sys.executable, "-P", "-c", _CHILD], capture_output=True, text=True, env=env,
                              timeout=600)
    else:
        done = restricted(_CHILD, folder, how, env)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "failed unexpectedly" not in done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["log"] = done.stderr
    return result


def _runs_compiled(result: dict) -> bool:
    return result["failed"] == [] and result["paths"] == ["numba", "numba"]


def _compiled(result: dict) -> bool:
    return _runs_compiled(result) and all(m > 0 for h, m in result["cache"].values())


def _loaded(result: dict) -> bool:
    return _runs_compiled(result) and all(h > 0 and m == 0 for h, m in result["cache"].values())


def _at_compiled_speed(result: dict, clean: dict) -> bool:
    """Quantizing at the speed of a clean cache's process, as a ratio of the two best times: the plain port is over
    a thousand times slower, while a shared machine's speed swings up to 6x between processes (measured on 2 cores)."""
    return result["seconds"] < 20 * clean["seconds"]


_FORMATS = Path("loaders") / "formats"


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> tuple[Path, dict]:
    """A copy of the pack whose kernels one process has compiled into its cache, and what that process reported."""
    pack = _copy_of_the_pack(tmp_path_factory.mktemp("compiled") / "custom_nodes" / "ComfyUI-Flux2Dev")
    result = _run(str(pack), pack, pack.parent / "user-cache")
    assert _compiled(result)
    return pack, result


def _entries(pack: Path) -> list[Path]:
    """The kernel cache's entries in the pack's __pycache__ (numba's own index and data files, or the pack's)."""
    return sorted(f for f in (pack / _FORMATS / "__pycache__").rglob("*") if f.suffix in (".nbi", ".nbc", ".nbk"))


def _sound(entry: Path) -> bool:
    """Whether an entry holds what the pack wrote: its digest matches."""
    from comfyui_flux2dev.loaders.formats.kernel_cache import _MAGIC

    data = entry.read_bytes()
    at = len(_MAGIC) + 32
    return data.startswith(_MAGIC) and data[len(_MAGIC) : at] == hashlib.sha256(data[at:]).digest()


def _swap(entries: list[Path]) -> None:
    """Every kernel's compiled code in another kernel's entry: valid files, each of the wrong kernel."""
    code = [f for f in entries if f.suffix != ".nbi"]
    contents = [f.read_bytes() for f in code]
    for f, other in zip(code, contents[1:] + contents[:1]):
        f.write_bytes(other)


def _garble(f: Path) -> None:
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 3] + bytes(b ^ 0x5A for b in data[len(data) // 3 :]))


_DAMAGE = {
    # every other entry garbled, the rest emptied: each process meets both
    "garbled-or-emptied": lambda entries: [_garble(f) if i % 2 else f.write_bytes(b"") for i, f in enumerate(entries)],
    "swapped": _swap,
}


@pytest.mark.parametrize("damage", _DAMAGE)
def test_damaged_entries_are_compiled_again_and_rewritten(tmp_path, compiled, damage):
    """Both kernels' entries (the dequantizer's, the K quantizer's) damaged: each kernel compiles again, runs at the
    clean cache's speed, and its entry is written afresh for the next process."""
    pack = _copy_of_the_pack(tmp_path / "custom_nodes" / "ComfyUI-Flux2Dev", compiled[0])
    entries = _entries(pack)
    assert len([f for f in entries if f.suffix != ".nbi"]) >= 2
    _DAMAGE[damage](entries)
    damaged = {f: f.read_bytes() for f in entries}
    result = _run(str(pack), pack, tmp_path / "user-cache")
    assert _compiled(result), result
    assert _at_compiled_speed(result, compiled[1]), (result["seconds"], compiled[1]["seconds"])
    assert all(f.read_bytes() != damaged[f] and _sound(f) for f in entries), "the damaged entries were not rewritten"


def test_a_link_at_each_entry_and_a_foreign_file_beside_them_come_through_unharmed(tmp_path, compiled):
    """A link planted at each entry's name (to a user's file) and a file of the user's in the cache folder: the
    kernels compile again, each entry is written afresh in its link's place, and neither the linked file nor the
    other one is touched."""
    pack = _copy_of_the_pack(tmp_path / "custom_nodes" / "ComfyUI-Flux2Dev", compiled[0])
    entries = [f for f in _entries(pack) if f.suffix == ".nbk"]
    users = tmp_path / "a user's file"
    users.write_bytes(b"a user's file")
    for f in entries:
        f.unlink()
        f.symlink_to(users)
    foreign = entries[0].parent / "notes.txt"
    foreign.write_bytes(b"not the pack's")
    result = _run(str(pack), pack, tmp_path / "user-cache")
    assert _compiled(result), result
    assert users.read_bytes() == b"a user's file" and foreign.read_bytes() == b"not the pack's"
    assert entries and all(not f.is_symlink() and _sound(f) for f in entries)


def test_a_full_cache_folder_costs_a_compilation_not_the_kernels(tmp_path, compiled):
    """No room left where the cache goes: the kernels compile, run at the clean cache's speed, and nothing is left
    of the entries that could not be written."""
    pack = _copy_of_the_pack(tmp_path / "custom_nodes" / "ComfyUI-Flux2Dev")
    cache = pack / _FORMATS / "__pycache__"
    cache.mkdir()
    result = _run(str(pack), pack, tmp_path / "user-cache", "full", cache)
    assert _compiled(result), result
    assert _at_compiled_speed(result, compiled[1]), (result["seconds"], compiled[1]["seconds"])
    assert result["files"] == [], "the full folder holds parts of entries"
    assert result["log"].count("could not be saved") == 1  # once for the folder


def test_with_no_writable_folder_the_kernels_are_compiled_in_memory(tmp_path, compiled):
    """Neither the pack's folder nor the user's cache folder can be written: the kernels compile in every process
    and run at the clean cache's speed, with one line saying so."""
    pack = _copy_of_the_pack(tmp_path / "custom_nodes" / "ComfyUI-Flux2Dev")
    result = _run(str(pack), pack, pack / _FORMATS / "user-cache", "read-only", pack / _FORMATS)
    assert _compiled(result), result
    assert _at_compiled_speed(result, compiled[1]), (result["seconds"], compiled[1]["seconds"])
    assert result["log"].count("No folder can be written for the compiled kernels") == 1
    assert not any(tmp_path.rglob("*.nbk"))


def test_a_cache_written_under_one_import_name_is_loaded_under_the_other(tmp_path, compiled):
    """ComfyUI names the pack's modules by its folder's path, the command line by comfyui_flux2dev; kernels compiled
    under ComfyUI's name (the `compiled` fixture's) are loaded under either name from the folder moved elsewhere
    (the read-only test below compiles under the installed name first)."""
    moved = _copy_of_the_pack(tmp_path / "ComfyUI_portable" / "custom_nodes" / "flux2dev", compiled[0])
    assert _loaded(_run("comfyui_flux2dev", moved, tmp_path / "user-cache"))
    assert _loaded(_run(str(moved), moved, tmp_path / "user-cache"))
    assert not (tmp_path / "user-cache").exists(), "the pack's folder was writable: the cache belongs beside it"


def test_from_a_read_only_folder_the_kernels_are_cached_per_user(tmp_path):
    """A pack folder the user cannot write (a system-wide install): the kernels are kept in the user's cache
    folder instead, and the next process, under the other import name, loads them from there."""
    pack = _copy_of_the_pack(tmp_path / "custom_nodes" / "ComfyUI-Flux2Dev")
    assert _compiled(_run("comfyui_flux2dev", pack, tmp_path / "user-cache", "read-only", pack / _FORMATS))
    assert _loaded(_run(str(pack), pack, tmp_path / "user-cache", "read-only", pack / _FORMATS))
    assert not (pack / _FORMATS / "__pycache__").exists()
    assert any((tmp_path / "user-cache").rglob("*.nbk"))
