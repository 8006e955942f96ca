"""The peer the dequantization and real-size rows are measured beside: ComfyUI-GGUF's dequantizers and loader
nodes, from the copy of its repository in the project's shared folder (../shared/peers beside the clone; a
user's clone has none, and the rows say so instead)."""

from __future__ import annotations

import functools
import importlib.util
import sys
import tarfile
import tempfile
import types
from pathlib import Path

PEER_ARCHIVE = Path(__file__).resolve().parents[2].parent / "shared" / "peers" / "comfyui-gguf-795e451.tar.gz"
PEER = "ComfyUI-GGUF 795e451"
_MODULE = "ComfyUI-GGUF/dequant.py"
_PACKAGE = "comfyui_gguf_peer"


@functools.cache
def _unpacked() -> tempfile.TemporaryDirectory:
    folder = tempfile.TemporaryDirectory(prefix="flux2dev-peer-")
    with tarfile.open(PEER_ARCHIVE) as archive:
        archive.extractall(folder.name, filter="data")
    return folder


@functools.cache
def comfyui_gguf_dequantize():
    """ComfyUI-GGUF's dequantize(data, qtype, shape, dtype), which its GGMLOps layers call with dtype None
    (the arithmetic in the scales' fp16) and cast to the layer's dtype; None when its archive is not beside
    the clone (missing_reason says why)."""
    if not PEER_ARCHIVE.is_file():
        return None
    spec = importlib.util.spec_from_file_location("comfyui_gguf_dequant", Path(_unpacked().name) / _MODULE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.dequantize


def comfyui_gguf_nodes():
    """ComfyUI-GGUF's nodes module (CLIPLoaderGGUF, UnetLoaderGGUF), imported as a package of its own without
    running its __init__ (which registers the nodes with a server); None when its archive is not beside the
    clone. The host must be importable (host.ensure_comfy)."""
    if not PEER_ARCHIVE.is_file():
        return None
    package = types.ModuleType(_PACKAGE)
    package.__path__ = [str(Path(_unpacked().name) / Path(_MODULE).parent)]
    sys.modules.setdefault(_PACKAGE, package)
    return importlib.import_module(f"{_PACKAGE}.nodes")


def missing_reason() -> str:
    return f"{PEER_ARCHIVE} is not there (it is beside CI and the project's clone only)"
