"""The file a conversion writes: checked before any weight is read, written through a fresh temporary file in
its folder, and published under its name only once complete (formats.files.new_file). Something already at the
name stays as it is unless the user asks for it to be replaced, and then it is replaced, never written through
(a link there is replaced by the new file; what it pointed to is untouched)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from ...errors import OutputError
from ..formats.files import new_file, remove_stale_partials
from ..formats.validate import too_many_open_files

FORCE_HINT = "give another name, or add --force to replace it"


def check_output(path: str | os.PathLike, *, force: bool, suffix: str) -> Path:
    """`path` as a conversion's output: named with `suffix`, in a folder that exists, and with nothing at the
    name unless `force` (and then not a folder)."""
    path = Path(path)
    if path.suffix.lower() != suffix:
        raise OutputError(f"{path}: the output of this conversion is a {suffix} file; name it so "
                          f"(e.g. {path.stem}{suffix}).")
    if not path.parent.is_dir():
        raise OutputError(f"{path}: its folder {path.parent} does not exist; create it first.")
    if path.is_dir() and not path.is_symlink():
        raise OutputError(f"{path} is a folder; give the name of the file to write.")
    if os.path.lexists(path) and not force:
        raise OutputError(f"{path} already exists and was left as it is; {FORCE_HINT}.")
    return path


def _identities(path: str | os.PathLike) -> set[tuple[int, int]]:
    """(device, inode) of a name and of what it leads to, where there is anything."""
    found = set()
    for look in (os.lstat, os.stat):
        with contextlib.suppress(OSError):
            s = look(path)
            found.add((s.st_dev, s.st_ino))
    return found


def check_not_source(target: Path, source: str | os.PathLike) -> None:
    """Refuse to write over the source being converted: OUT the source file itself, or any file of a source
    folder, by device and inode (through links and other names alike)."""
    if not os.path.lexists(target):
        return
    source = Path(source)
    files = [Path(top) / name for top, _, names in os.walk(source) for name in names] if source.is_dir() else [source]
    theirs = set().union(*(_identities(f) for f in files))
    if _identities(target) & theirs:
        raise OutputError(f"{target} is the source being converted ({source}), or one of its files; writing it would "
                          "replace the source with its own conversion, so it was left as it is. Give another name.")


@contextlib.contextmanager
def output_file(path: Path, *, force: bool) -> Iterator[BinaryIO]:
    """A file object writing `path` (checked by check_output). An OSError inside the block is the output's (the
    pack's readers turn their own into its errors): it ends as OutputError, and nothing is left under the name."""
    try:
        remove_stale_partials(path)  # left by a conversion into the same name that was killed
        with new_file(path, replace=force) as f:
            yield f
    except FileExistsError:
        raise OutputError(f"{path} appeared while the conversion ran and was left as it is; {FORCE_HINT}.") from None
    except OSError as e:
        raise too_many_open_files(e, path, "output file") or OutputError(
            f"{path} could not be written ({e.strerror or e}); nothing was written under its name, and the partial "
            "file was removed.") from None
