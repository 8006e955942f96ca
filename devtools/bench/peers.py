"""The peer the dequantization rows are measured beside: ComfyUI-GGUF's dequantizers, from the copy of its
repository in the project's shared folder (../shared/peers beside the clone; a user's clone has none, and
the rows say so instead)."""

from __future__ import annotations

import functools
import importlib.util
import tarfile
import tempfile
from pathlib import Path

PEER_ARCHIVE = Path(__file__).resolve().parents[2].parent / "shared" / "peers" / "comfyui-gguf-795e451.tar.gz"
PEER = "ComfyUI-GGUF 795e451"
_MODULE = "ComfyUI-GGUF/dequant.py"


@functools.cache
def _unpacked() -> tempfile.TemporaryDirectory:
    folder = tempfile.TemporaryDirectory(prefix="flux2dev-peer-")
    with tarfile.open(PEER_ARCHIVE) as archive:
        archive.extract(archive.getmember(_MODULE), folder.name, filter="data")
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


def missing_reason() -> str:
    return f"{PEER_ARCHIVE} is not there (it is beside CI and the project's clone only)"
