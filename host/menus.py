"""The model menus of the pack's nodes, over the host's model folders (folder_paths, so extra_model_paths.yaml
counts). Entries are named as the host names them: the path relative to the model folder with '/'
separators; a model kept as a folder ends with '/'. A menu is listed by walking its folders once per request
(symlinks followed, each real folder visited once, so a looping models folder cannot hang the UI); a chosen
name is found again directly, without a walk. Only regular files are listed: a FIFO, a socket or a symlink
loop named like a model could only block or fail when chosen."""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from ..errors import Flux2DevError, ModelNotFoundError
from ..loaders.formats.files import MODEL_FOLDER_MARKERS

FOLDER_MARK = "/"
QUALIFIER = ":"  # between a model folder's name and an entry's, where two folders of one menu hold that name


def has_config(path: str) -> bool:
    """A model kept as a folder: a Hugging Face / diffusers folder or a Mistral native one."""
    return any(os.path.isfile(os.path.join(path, name)) for name in MODEL_FOLDER_MARKERS)


def is_flux2_pipeline(path: str) -> bool:
    """A FLUX.2 diffusers pipeline folder (model_index.json naming a FLUX.2 pipeline class)."""
    from ..loaders.models.pipeline import pipeline_class

    return _listed_if_damaged(lambda: pipeline_class(path) is not None)


def is_dev_pipeline(path: str) -> bool:
    """A FLUX.2 [dev] pipeline folder: the only ones whose text encoder conditions [dev]."""
    from ..loaders.models.pipeline import holds_variant

    return _listed_if_damaged(lambda: holds_variant(path, "dev"))


def _listed_if_damaged(check: Callable[[], bool]) -> bool:
    # A pipeline whose model_index.json cannot be read is listed rather than failing the whole menu or
    # vanishing from it: choosing it shows the pack's error naming the damage.
    try:
        return check()
    except Flux2DevError:
        return True


@dataclass(frozen=True)
class MenuSource:
    folder: str  # the host's model folder key
    extensions: tuple[str, ...] = ()  # files listed
    is_model_folder: Callable[[str], bool] | None = None  # folders listed as one model


# Each node's menu: its sources in order; a name found in more than one comes from the first.
MENUS = {
    "encoder": (MenuSource("text_encoders", (".safetensors", ".gguf"), has_config),),
    "gguf": (MenuSource("diffusion_models", (".gguf",)),),
    "pipeline": (MenuSource("diffusers", (), is_flux2_pipeline),),
    "dev pipeline": (MenuSource("diffusers", (), is_dev_pipeline),),
    "vae": (MenuSource("diffusers", (), is_flux2_pipeline), MenuSource("vae", (".safetensors",), has_config)),
    "transformer": (MenuSource("diffusers", (), is_flux2_pipeline),
                    MenuSource("diffusion_models", (".safetensors",), has_config)),
    "lora": (MenuSource("loras", (".safetensors",)),),
    "language model": (MenuSource("text_encoders", (".safetensors", ".gguf"), has_config),
                       MenuSource("diffusers", (), is_dev_pipeline)),
}


def _roots(folder: str) -> list[str]:
    import folder_paths

    return folder_paths.get_folder_paths(folder)


def _walk(root: str, source: MenuSource, found: dict[str, str]) -> None:
    visited: set[str] = set()
    for dirpath, dirnames, filenames in os.walk(root, followlinks=True):
        real = os.path.realpath(dirpath)
        if real in visited:
            dirnames.clear()
            continue
        visited.add(real)
        rel = os.path.relpath(dirpath, root)
        if rel != "." and source.is_model_folder is not None and source.is_model_folder(dirpath):
            found.setdefault(rel.replace(os.sep, "/") + FOLDER_MARK, dirpath)
            dirnames.clear()
            continue
        dirnames.sort()
        for name in filenames:
            if name.lower().endswith(source.extensions) and os.path.isfile(os.path.join(dirpath, name)):
                found.setdefault(os.path.normpath(os.path.join(rel, name)).replace(os.sep, "/"),
                                 os.path.join(dirpath, name))


def model_choices(menu: str) -> dict[str, str]:
    """{menu name: path} of every file and model folder the menu's sources hold, in every root of each. A name
    that two sources both hold is listed from each, qualified with its folder ("vae:name") so neither hides
    the other."""
    per_source = []
    for source in MENUS[menu]:
        found: dict[str, str] = {}
        for root in _roots(source.folder):
            if os.path.isdir(root):
                _walk(root, source, found)
        per_source.append((source, found))
    counts = Counter(name for _, found in per_source for name in found)
    choices = {}
    for source, found in per_source:
        for name, path in found.items():
            choices[f"{source.folder}{QUALIFIER}{name}" if counts[name] > 1 else name] = path
    return dict(sorted(choices.items()))


def _is_entry(path: str, name: str, source: MenuSource) -> bool:
    if name.endswith(FOLDER_MARK):
        return source.is_model_folder is not None and os.path.isdir(path) and source.is_model_folder(path)
    return os.path.isfile(path) and name.lower().endswith(source.extensions) and bool(source.extensions)


def chosen_path(menu: str, name: str, what: str) -> str:
    """The path of the entry `name` of a menu, found as the menu would list it; `what` names it for the user."""
    sources = MENUS[menu]
    folder, qualified, rest = name.partition(QUALIFIER)
    if qualified and any(s.folder == folder for s in sources):
        sources, name = [s for s in sources if s.folder == folder], rest
    relative = os.path.normpath(name.rstrip(FOLDER_MARK)) if name else ""
    if relative and not os.path.isabs(relative) and relative.split(os.sep)[0] != "..":
        for source in sources:
            for root in _roots(source.folder):
                path = os.path.join(root, relative)
                if _is_entry(path, name, source):
                    return path
    raise ModelNotFoundError(f"{what} {name!r} is no longer there; refresh the node list (press R) and choose again.")
