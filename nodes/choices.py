"""The model menus of the pack's nodes: files and model folders found in the host's model folders
(folder_paths, so extra_model_paths.yaml counts), named as the host names them: the path relative to the
model folder with '/' separators; a model kept as a folder ends with '/'."""

from __future__ import annotations

import os
from collections.abc import Callable

import folder_paths

from ..errors import ModelNotFoundError

FOLDER_MARK = "/"


def has_config(path: str) -> bool:
    """A model kept as a folder: a Hugging Face / diffusers folder or a Mistral native one."""
    return any(os.path.isfile(os.path.join(path, name)) for name in ("config.json", "params.json", "model_index.json"))


def model_choices(folder: str, extensions: tuple[str, ...] = (), is_model_folder: Callable[[str], bool] | None = None) -> dict[str, str]:
    """{menu name: path} of the files with `extensions` and the folders `is_model_folder` accepts, in every
    root of the host's `folder` and their subfolders. A model folder's own files are not listed apart."""
    found: dict[str, str] = {}
    for root in folder_paths.get_folder_paths(folder):
        for dirpath, dirnames, filenames in os.walk(root, followlinks=True):
            rel = os.path.relpath(dirpath, root)
            if rel != "." and is_model_folder is not None and is_model_folder(dirpath):
                found.setdefault(rel.replace(os.sep, "/") + FOLDER_MARK, dirpath)
                dirnames.clear()
                continue
            dirnames.sort()
            for name in filenames:
                if name.lower().endswith(extensions):
                    key = os.path.normpath(os.path.join(rel, name)).replace(os.sep, "/")
                    found.setdefault(key, os.path.join(dirpath, name))
    return dict(sorted(found.items()))


def chosen_path(choices: dict[str, str], name: str, what: str) -> str:
    if name not in choices:
        raise ModelNotFoundError(f"{what} {name!r} is no longer there; refresh the node list (press R) and choose again.")
    return choices[name]
