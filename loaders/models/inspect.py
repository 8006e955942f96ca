"""`flux2dev inspect`: what the pack sees in a file or folder, from headers alone (no weights are read).

The kind of a checkpoint is told by loaders/models/kinds.py (tensor names, GGUF architectures); each kind then
has one describer, which runs the same identification as that kind's loader, so inspect fails where a
load would, with the same message."""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

from ...errors import ModelNotFoundError, UnknownModelError, VariantMismatchError, WrongModelError
from ..formats.files import is_pipeline
from ..formats.safetensors_file import SafetensorsFiles
from .kinds import gguf_kind, kind_from_names, other_checkpoint
from .pipeline import describe_pipeline


def _safetensors(path: Path) -> SafetensorsFiles:
    files = [path] if path.is_file() else sorted(path.glob("*.safetensors"))
    return SafetensorsFiles([str(f) for f in files])


def _header_figures(files: SafetensorsFiles) -> dict:
    from ..formats import packing

    formats = Counter(packing.labels(files).values())
    nbytes = sum(info.nbytes for info in files.infos.values())
    return {"reads": len(files.infos), "skips": 0, "formats": dict(formats), "memory_bytes": nbytes}


def _transformer(path: Path) -> dict:
    """The loader's plan (so what it refuses, this refuses): the tensors it reads, the formats of the model's
    tensors among them (their companions apart) and the bytes it reads."""
    from ..formats import packing
    from .transformer import plan_transformer

    plan = plan_transformer(path)
    labels, infos = packing.labels(plan.files), plan.files.infos
    formats = Counter(labels[n] for n in plan.reads if n.rpartition(".")[2] not in packing.SPELLINGS)
    g = plan.geometry
    return {"kind": "transformer", "layout": plan.layout.name, "variant": plan.variant.key,
            "layers": g.double_blocks + g.single_blocks, "reads": len(plan.reads),
            "skips": len(infos) - len(plan.reads), "formats": dict(formats),
            "memory_bytes": sum(infos[n].nbytes for n in plan.reads)}


def _gguf_transformer(path: Path) -> dict:
    from ..formats import packing
    from .gguf_transformer import load_gguf_transformer

    loaded = load_gguf_transformer(path)  # views of the mapped file: nothing is dequantized
    g = loaded.geometry
    weights = {k: t for k, t in loaded.state_dict.items() if not packing.is_companion(k)}
    return {"kind": "transformer", "layout": "gguf", "variant": loaded.variant.key,
            "layers": g.double_blocks + g.single_blocks, "reads": len(weights), "skips": 0,
            "formats": loaded.formats, "memory_bytes": sum(t.numel() * t.element_size() for t in weights.values())}


def _vae(path: Path) -> dict:
    from .vae import check_flux2_vae, vae_files

    files = SafetensorsFiles([str(p) for p in vae_files(path)])
    check_flux2_vae({k: i.shape for k, i in files.infos.items()}, str(path))
    layout = "diffusers" if "decoder.conv_norm_out.weight" in files.infos else "BFL"
    return {"kind": "vae", "layout": layout, "variant": None, "layers": None, **_header_figures(files)}


def _pipeline(path: Path) -> dict:
    info = describe_pipeline(path)
    parts = sorted(p.name for p in path.iterdir() if p.is_dir())
    return {"kind": "pipeline", "layout": "diffusers", "variant": info.variant.key, "class": info.class_name,
            "parts": parts}


def _other(path: Path) -> dict:
    raise WrongModelError(
        f"{path} is {other_checkpoint(_safetensors(path).infos)}, not a part of FLUX.2 [dev]: the pack reads FLUX.2 "
        "transformers, text encoders, VAEs and pipelines."
    )


def _encoder(path: Path) -> dict:
    from .encoder import inspect_encoder

    return inspect_encoder(str(path))


def model_kind(path: Path) -> str:
    """The describer's key: the kind of model at `path`, GGUF transformers apart."""
    if path.is_dir() and is_pipeline(path):
        return "pipeline"
    suffix = path.suffix.lower()  # as the writers take it: upper.GGUF is a GGUF file
    if suffix == ".gguf":
        from ..formats.gguf_file import open_gguf

        with open_gguf(path) as gguf:
            return "encoder" if gguf_kind(gguf.architecture) == "encoder" else "gguf-transformer"
    if path.is_file() and suffix != ".safetensors":
        return "encoder"  # its layout table names every other format, and refuses pickles unopened
    has_weights = path.is_file() or any(path.glob("*.safetensors"))
    return (kind_from_names(_safetensors(path).infos) if has_weights else None) or "encoder"


DESCRIBERS = {
    "pipeline": _pipeline,
    "encoder": _encoder,
    "gguf-transformer": _gguf_transformer,
    "transformer": _transformer,
    "vae": _vae,
    "other": _other,
}


def inspect_path(path) -> dict:
    path = Path(path)
    if not os.path.lexists(path):  # a symlink loop is there, and gets the reader's own error
        raise ModelNotFoundError(f"{path} does not exist. Give a model file or folder that exists on this machine.")
    return DESCRIBERS[model_kind(path)](path)


# The kinds compare takes, by what they are compared as.
COMPARED_AS = {"encoder": "encoder", "transformer": "transformer", "gguf-transformer": "transformer", "vae": "vae"}


def _variant(path: Path, kind: str) -> str | None:
    from .transformer_layout import identify_gguf_transformer, identify_transformer

    if kind == "transformer":
        return identify_transformer(path)[0].key
    if kind == "gguf-transformer":
        from ..formats.gguf_file import open_gguf

        with open_gguf(path) as gguf:
            return identify_gguf_transformer(gguf)[0].key
    return None


def check_comparable(a, b) -> None:
    """Refuse, from the headers alone and before torch is imported, two models whose outputs cannot be compared:
    of two kinds, or transformers of two FLUX.2 variants. A path that is no model is left to the loaders' errors."""
    kinds = []
    for path in map(Path, (a, b)):
        kind = model_kind(path) if os.path.lexists(path) else None
        if kind not in COMPARED_AS:
            return
        kinds.append(kind)
    if COMPARED_AS[kinds[0]] != COMPARED_AS[kinds[1]]:
        raise UnknownModelError(f"{a} is a {COMPARED_AS[kinds[0]]} and {b} a {COMPARED_AS[kinds[1]]}; compare two "
                                "models of one kind.")
    variants = _variant(Path(a), kinds[0]), _variant(Path(b), kinds[1])
    if variants[0] != variants[1]:
        raise VariantMismatchError(f"{a} is a FLUX.2 {variants[0]} transformer and {b} a {variants[1]} one; their "
                                   "outputs cannot be compared (they take conditioning of different widths).")
