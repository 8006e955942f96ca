"""`flux2dev inspect`: what the pack sees in a file or folder, from headers alone (no weights are read).

The kind of a checkpoint is told by its stored tensor names (KIND_BY_NAMES); each kind then has one
describer, which runs the same identification as that kind's loader, so inspect fails where a load
would, with the same message."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

from ..errors import ModelNotFoundError
from .pipeline import MODEL_INDEX, describe_pipeline
from .safetensors_file import SafetensorsFiles

# (kind, pattern on a stored tensor name); the first kind any name matches wins, else "encoder".
KIND_BY_NAMES = (
    ("transformer", re.compile(r"^(?:model\.diffusion_model\.)?(?:double_blocks|single_blocks|transformer_blocks|single_transformer_blocks)\.")),
    ("vae", re.compile(r"^(?:first_stage_model\.|vae\.)?(?:(?:decoder|encoder)\..*conv|bn\.running_mean)")),
)
def kind_from_names(names) -> str | None:
    """"transformer" or "vae" when the stored names say so; None for anything else."""
    for kind, pattern in KIND_BY_NAMES:
        if any(pattern.match(name) for name in names):
            return kind
    return None


def _safetensors(path: Path) -> SafetensorsFiles:
    files = [path] if path.is_file() else sorted(path.glob("*.safetensors"))
    return SafetensorsFiles([str(f) for f in files])


def _header_figures(files: SafetensorsFiles) -> dict:
    formats = Counter(info.format for info in files.infos.values())
    nbytes = sum(info.nbytes for info in files.infos.values())
    return {"reads": len(files.infos), "skips": 0, "formats": dict(formats), "memory_bytes": nbytes}


def _transformer(path: Path) -> dict:
    from .transformer import identify_transformer, transformer_files

    variant, geometry, layout = identify_transformer(path)
    figures = _header_figures(SafetensorsFiles([str(p) for p in transformer_files(path)]))
    return {"kind": "transformer", "layout": layout.name, "variant": variant.key,
            "layers": geometry.double_blocks + geometry.single_blocks, **figures}


def _gguf_transformer(path: Path) -> dict:
    from .gguf_transformer import load_gguf_transformer
    from .quant import is_companion

    loaded = load_gguf_transformer(path)  # views of the mapped file: nothing is dequantized
    g = loaded.geometry
    weights = {k: t for k, t in loaded.state_dict.items() if not is_companion(k)}
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


def _encoder(path: Path) -> dict:
    from .encoder import inspect_encoder

    return inspect_encoder(str(path))


def inspect_path(path) -> dict:
    path = Path(path)
    if not path.exists():
        raise ModelNotFoundError(f"{path} does not exist. Give a model file or folder that exists on this machine.")
    if path.is_dir() and (path / MODEL_INDEX).is_file():
        return _pipeline(path)
    if path.suffix == ".gguf":
        from .encoder import GGUF_ARCH_LAYOUTS
        from .gguf_file import open_gguf

        with open_gguf(path) as gguf:
            architecture = gguf.architecture
        return _encoder(path) if architecture in GGUF_ARCH_LAYOUTS else _gguf_transformer(path)
    kind = kind_from_names(_safetensors(path).infos) if path.is_file() or any(path.glob("*.safetensors")) else None
    return {"transformer": _transformer, "vae": _vae}.get(kind, _encoder)(path)
