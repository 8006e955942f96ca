"""Where a model's files are: the names that mark a folder's layout, its JSON files, and the safetensors
files of one part (a single file, a folder sharded with an index, or a diffusers pipeline's part folder)."""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import CorruptFileError, MissingWeightsError, UnsupportedFormatError

MODEL_INDEX = "model_index.json"  # marks a diffusers pipeline folder
DIFFUSERS_WEIGHTS = "diffusion_pytorch_model.safetensors"  # a diffusers model folder's weights (or its index's stem)
INDEX_SUFFIX = ".index.json"  # "<weights>.index.json" maps each tensor to its shard


def is_pipeline(folder: str | Path) -> bool:
    return (Path(folder) / MODEL_INDEX).is_file()


def read_json(path: str | Path) -> dict:
    path = Path(path)
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except ValueError as e:
        raise CorruptFileError(f"{path} is not valid JSON ({e}); download it again.") from None


def shards(folder: str | Path, weights: str) -> list[Path]:
    """The files of `weights` in a folder: its index's shards (all present), the single file, or []."""
    folder = Path(folder)
    index = folder / (weights + INDEX_SUFFIX)
    if index.is_file():
        found = [folder / name for name in sorted(set(read_json(index)["weight_map"].values()))]
        missing = [s.name for s in found if not s.is_file()]
        if missing:
            raise MissingWeightsError(
                f"{folder}: the index names shard(s) that are not there: {', '.join(missing)}. Finish the download."
            )
        return found
    return [folder / weights] if (folder / weights).is_file() else []


def part_files(path: str | Path, part: str, choose: str) -> list[Path]:
    """The safetensors files of one part of a FLUX.2 model (part: the pipeline subfolder, "transformer" or
    "vae"): a single file, a diffusers folder of that part, or a pipeline folder's part/. `choose` ends the
    messages: what the user should pick instead."""
    path = Path(path)
    if path.is_dir() and is_pipeline(path):
        path = path / part
    if path.is_file():
        if path.suffix != ".safetensors":
            raise UnsupportedFormatError(
                f"{path.name} is not a .safetensors file; the pack never unpickles .ckpt/.pt/.bin files. {choose}"
            )
        return [path]
    found = shards(path, DIFFUSERS_WEIGHTS) if path.is_dir() else []
    if not found:
        raise MissingWeightsError(f"{path} holds no {part} weights ({DIFFUSERS_WEIGHTS} or its index). {choose}")
    return found
