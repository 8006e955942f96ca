"""Where a model's files are: the names that mark a folder's layout, its JSON files, and the safetensors
files of one part (a single file, a folder sharded with an index, or a diffusers pipeline's part folder).

Every JSON file is read through `read_json` with the declaration of the fields the pack uses (the tables
below), so no value from a file reaches arithmetic unchecked. The bounds refuse only what no real model
has: the configs of the models a user may pick by mistake (FLUX.1, SDXL, Klein's Qwen3, Llama ...) pass
here and are named by the loaders as the wrong model."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

try:
    import fcntl
except ImportError:  # Windows: no advisory locks, so no partial file is ever taken as stale
    fcntl = None

from ...errors import CorruptFileError, MissingWeightsError, UnsupportedFormatError
from .validate import (
    NULL,
    Field,
    MiB,
    checked,
    describe,
    inside,
    parse_json,
    read_bounded,
    read_json_file,
    regular_file,
)

MODEL_INDEX = "model_index.json"  # marks a diffusers pipeline folder
CONFIG = "config.json"  # transformers' model config
PARAMS = "params.json"  # Mistral's native model config
MODEL_FOLDER_MARKERS = (CONFIG, PARAMS, MODEL_INDEX)  # a folder holding one of these is a model kept as a folder
TEKKEN_FILE = "tekken.json"  # mistral-common's vocabulary file
TOKENIZER_FOLDER = "tokenizer"  # beside a model's weights, or in a diffusers pipeline folder
TEXT_ENCODER_FOLDER = "text_encoder"  # a diffusers pipeline's text encoder
DIFFUSERS_WEIGHTS = "diffusion_pytorch_model.safetensors"  # a diffusers model folder's weights (or its index's stem)
INDEX_SUFFIX = ".index.json"  # "<weights>.index.json" maps each tensor to its shard

# --- what the pack reads of each JSON file ----------------------------------------------------------------

_ROPE = {"rope_theta": Field((float, NULL), lo=1, hi=1e15, required=False)}
# A transformers text model config (Mistral, Qwen3, Llama ...), at the top of config.json or as its text_config.
_TEXT_MODEL = {
    "hidden_size": Field(int, lo=1, hi=1 << 17, required=False),
    "num_hidden_layers": Field(int, lo=1, hi=1024, required=False),
    "num_attention_heads": Field(int, lo=1, hi=4096, required=False),
    "num_key_value_heads": Field((int, NULL), lo=1, hi=4096, required=False),
    "head_dim": Field((int, NULL), lo=1, hi=1 << 16, required=False),
    "intermediate_size": Field((int, NULL), lo=1, hi=1 << 20, required=False),
    "vocab_size": Field(int, lo=1, hi=1 << 24, required=False),
    "rms_norm_eps": Field(float, lo=0, hi=1, required=False),
    **_ROPE,
    "rope_parameters": Field((dict, NULL), required=False, fields=_ROPE),
}
ENCODER_CONFIG = {**_TEXT_MODEL, "text_config": Field(dict, required=False, fields=_TEXT_MODEL)}  # config.json
# What prompt upsampling reads of a Mistral3 config.json to build its vision tower and projector
# (loaders/upsampler/vision.py).
PIXTRAL_CONFIG = {
    "hidden_size": Field(int, lo=1, hi=1 << 16),
    "intermediate_size": Field(int, lo=1, hi=1 << 18),
    "num_hidden_layers": Field(int, lo=1, hi=256),
    "num_attention_heads": Field(int, lo=1, hi=1024),
    "head_dim": Field((int, NULL), lo=1, hi=4096, required=False),
    "image_size": Field(int, lo=1, hi=1 << 15),
    "patch_size": Field(int, lo=1, hi=1024),
    "num_channels": Field(int, lo=3, hi=3, required=False),
    "rope_theta": Field(float, lo=1, hi=1e15, required=False),
    "hidden_act": Field(str, max_len=32, required=False),
}
VISION_CONFIG = {
    "vision_config": Field(dict, fields=PIXTRAL_CONFIG),
    "spatial_merge_size": Field(int, lo=1, hi=64, required=False),
    "projector_hidden_act": Field(str, max_len=32, required=False),
    "multimodal_projector_bias": Field(bool, required=False),
    "vision_feature_layer": Field(int, lo=-1, hi=-1, required=False),
}
PARAMS_FIELDS = {  # Mistral's params.json
    "dim": Field(int, lo=1, hi=1 << 17, required=False),
    "n_layers": Field(int, lo=1, hi=1024, required=False),
    "n_heads": Field(int, lo=1, hi=4096, required=False),
    "n_kv_heads": Field(int, lo=1, hi=4096, required=False),
    "head_dim": Field(int, lo=1, hi=1 << 16, required=False),
    "hidden_dim": Field(int, lo=1, hi=1 << 20, required=False),
    "vocab_size": Field(int, lo=1, hi=1 << 24, required=False),
    "norm_eps": Field(float, lo=0, hi=1, required=False),
    "rope_theta": Field(float, lo=1, hi=1e15, required=False),
}
_COMPONENT = Field((list, NULL), max_len=2, required=False)  # ["library", "class"], or nulls
PIPELINE_INDEX = {  # model_index.json
    "_class_name": Field(str, max_len=200, required=False),
    **{part: _COMPONENT for part in ("transformer", "vae", "text_encoder", "tokenizer", "scheduler")},
}
TRANSFORMER_CONFIG = {  # a diffusers transformer's config.json: pipeline.py multiplies heads by head width
    "num_attention_heads": Field(int, lo=1, hi=1024, required=False),
    "attention_head_dim": Field(int, lo=1, hi=4096, required=False),
    "joint_attention_dim": Field((int, NULL), lo=1, hi=1 << 20, required=False),
    "guidance_embeds": Field(bool, required=False),
    "num_layers": Field(int, lo=0, hi=1024, required=False),
    "num_single_layers": Field(int, lo=0, hi=1024, required=False),
    "in_channels": Field(int, lo=1, hi=1 << 16, required=False),
}
_MAX_TENSORS = 1 << 20  # weight_map entries (a FLUX.2 transformer has about 1,500)
_MAX_SHARDS = 4096  # real sharded models have at most a few hundred
SHARD_INDEX = {  # <weights>.index.json
    "weight_map": Field(dict, max_len=_MAX_TENSORS),
    "metadata": Field((dict, NULL), required=False),
}


def read_json(path: str | Path, fields: dict[str, Field], kind: str = "config") -> dict:
    """A JSON file (a regular file within its kind's size bound) whose declared `fields` are what they must be."""
    return checked(read_json_file(path, kind), fields, str(path))


def is_pipeline(folder: str | Path) -> bool:
    return (Path(folder) / MODEL_INDEX).is_file()


def shard_names(index: Path) -> list[str]:
    """The distinct shard names an index's weight_map names, each a plain string."""
    weight_map = read_json(index, SHARD_INDEX, "index")["weight_map"]
    names = set(weight_map.values()) if all(isinstance(name, str) for name in weight_map.values()) else None
    if names is None or len(names) > _MAX_SHARDS:
        raise CorruptFileError(
            f"{index}: weight_map must map each tensor to a shard file name, naming at most {_MAX_SHARDS} shards; "
            "the index is damaged. Download it again."
        )
    return sorted(names)


def shards(folder: str | Path, weights: str) -> list[Path]:
    """The files of `weights` in a folder: its index's shards (all present), the single file, or [].
    Every shard an index names must be a regular file inside the folder; nothing else is opened."""
    folder = Path(folder)
    index = folder / (weights + INDEX_SUFFIX)
    if os.path.lexists(index):
        found = [inside(folder, name, f"index {index.name}") for name in shard_names(index)]
        missing = [s.name for s in found if not os.path.lexists(s)]
        if missing:
            raise MissingWeightsError(
                f"{folder}: the index names shard(s) that are not there: {', '.join(missing)}. Finish the download."
            )
        return [regular_file(s, "shard") for s in found]
    single = folder / weights
    return [regular_file(single, "weights file")] if os.path.lexists(single) else []


def part_files(path: str | Path, part: str, choose: str) -> list[Path]:
    """The safetensors files of one part of a FLUX.2 model (part: the pipeline subfolder, "transformer" or
    "vae"): a single file, a diffusers folder of that part, or a pipeline folder's part/. `choose` ends the
    messages: what the user should pick instead."""
    path = Path(path)
    if path.is_dir() and is_pipeline(path):
        path = path / part
    none = MissingWeightsError(f"{path} holds no {part} weights ({DIFFUSERS_WEIGHTS} or its index). {choose}")
    if not os.path.lexists(path):
        raise none
    if not path.is_dir():
        if path.suffix.lower() != ".safetensors":
            raise UnsupportedFormatError(
                f"{path.name} is not a .safetensors file; the pack never unpickles .ckpt/.pt/.bin files. {choose}"
            )
        return [regular_file(path, f"{part} file")]
    found = shards(path, DIFFUSERS_WEIGHTS)
    if not found:
        raise none
    return found


PROMPTS_LIMIT = 64 * MiB  # a prompts file: a hundred thousand long prompts fit


def read_prompts(path: str | Path) -> list[str]:
    """The prompts of a prompts file: JSON lines, each line one JSON string (blank lines skipped, a leading
    byte order mark allowed). Lines are split on "\n" alone, so a prompt may hold any other line break."""
    data = read_bounded(path, PROMPTS_LIMIT, "prompts file").removeprefix(b"\xef\xbb\xbf")
    prompts = []
    for number, line in enumerate(data.split(b"\n"), 1):
        if not line.strip():
            continue
        where = f"{path} line {number}"
        value = parse_json(line, where, "prompt")
        if not isinstance(value, str):
            raise CorruptFileError(
                f"{where} holds {describe(value)}, not a JSON string; each line of a prompts file is one prompt "
                'written as a JSON string, such as "a red fox in the snow".'
            )
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:  # "\ud800" is valid JSON, but no text
            raise CorruptFileError(f"{where}: character {e.start + 1} of the prompt is a lone surrogate escape "
                                   f"({ascii(value[e.start])}), which is no character; fix that line.") from None
        prompts.append(value)
    if not prompts:
        raise CorruptFileError(f"{path} holds no prompt; write one JSON string a line, such as \"a red fox\".")
    return prompts


def first_look(path: str | Path) -> None:
    """What a model file's first bytes tell, without torch or the host: that it is a regular file, and for a
    .safetensors or .gguf file that its header starts right. The command line asks this first, so a bad file
    is refused at once; the loaders then check everything (folders and missing paths are theirs alone)."""
    from . import gguf_file, safetensors_file

    path = Path(path)
    if not os.path.lexists(path) or path.is_dir():
        return
    suffix = path.suffix.lower()
    if suffix == ".safetensors":
        safetensors_file.read_header(str(path))
    elif suffix == ".gguf":
        gguf_file.check_start(path)
    else:
        regular_file(path, "model file")


_NAME_MAX = 255  # bytes in a file name on the file systems models are kept on (ext4, XFS, btrfs, APFS, NTFS)
_PARTIAL_PARTS = len("..0123456789abcdef.partial")  # what a temporary name adds to its stem


def _partial_stem(name: str) -> str:
    """What the temporary names of a file `name` hold of it: the name itself, or where that would make them longer
    than a file name may be, as many of its first characters as fit, then "~" and a digest of the whole name."""
    room = _NAME_MAX - _PARTIAL_PARTS
    if len(os.fsencode(name)) <= room:
        return name
    digest = "~" + hashlib.sha256(os.fsencode(name)).hexdigest()[:16]
    head = name
    while len(os.fsencode(head + digest)) > room:  # cut at a character, never inside one
        head = head[:-1]
    return head + digest


def _partial_name(path: Path) -> Path:
    """The fresh temporary name new_file writes `path` through (PARTIAL matches exactly these)."""
    import secrets

    return path.with_name(f".{_partial_stem(path.name)}.{secrets.token_hex(8)}.partial")


PARTIAL = r"\.{stem}\.[0-9a-f]{{16}}\.partial"  # _partial_name's names, as a pattern (`stem`: _partial_stem's)


def _locked(fd: int, *, wait: bool) -> bool:
    """An exclusive lock on an open file, held until it is closed (or its process ends, however it ends)."""
    if fcntl is None:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
    except OSError:  # held by another process, or a file system without locks (then nothing is taken as stale)
        return False
    return True


@contextlib.contextmanager
def new_file(path: str | Path, *, replace: bool = False) -> Iterator[BinaryIO]:
    """A file to write `path` through: a fresh temporary file in the same folder, created exclusively (never
    through a link) and locked from its creation until it is published, which becomes `path` only when the block
    ends without an error, after its bytes reached the disk. It is linked into place, and a link never replaces
    what is at the name: FileExistsError when something is there (checked first too, before any byte is written).
    With `replace`, it is renamed into place instead, which replaces a file or a link at the name and never writes
    through the link. When the block fails (a full disk, an interrupt), the temporary file is removed and
    nothing shows under `path`; one left by a killed process is stale (remove_stale_partials)."""
    path = Path(path)
    if not replace and os.path.lexists(path):
        raise FileExistsError(errno.EEXIST, "something is already there", str(path))
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_BINARY", 0)
    while True:
        temp = _partial_name(path)
        fd = os.open(temp, flags, 0o644)
        locked = _locked(fd, wait=True)
        with contextlib.suppress(FileNotFoundError):  # a sweep may take it as stale between create and lock
            if os.path.samestat(os.fstat(fd), os.lstat(temp)):
                break
        os.close(fd)
    try:
        with open(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
            if locked:  # published before the lock goes, so a sweep never takes the finished file for a killed one's
                _publish(temp, path, replace=replace)
        if not locked:  # nothing sweeps an unlocked file, and Windows (no locks) renames no open file
            _publish(temp, path, replace=replace)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temp)


def _publish(temp: Path, path: Path, *, replace: bool) -> None:
    """The finished temporary file under `path`: renamed over what is there (`replace`), else linked, which never
    replaces anything (FileExistsError), and its temporary name removed."""
    if replace:
        os.replace(temp, path)
    else:
        os.link(temp, path)
        os.unlink(temp)


def remove_stale_partials(path: str | Path) -> list[str]:
    """Remove the temporary files new_file left for `path` in a process that was killed: only names of its
    exact pattern for this name, only regular files of this user, and only those no process holds locked (a
    write in progress keeps its lock). Where files cannot be locked (no fcntl), nothing is removed."""
    import re

    path = Path(path)
    pattern = re.compile(PARTIAL.format(stem=re.escape(_partial_stem(path.name))))
    removed = []
    if fcntl is None or not path.parent.is_dir():
        return removed
    for name in os.listdir(path.parent):
        if not pattern.fullmatch(name):
            continue
        found = path.parent / name
        try:
            fd = os.open(found, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
        except OSError:
            continue
        try:
            mine = os.fstat(fd)
            if stat.S_ISREG(mine.st_mode) and mine.st_uid == os.getuid() and _locked(fd, wait=False) \
                    and os.path.samestat(mine, os.lstat(found)):
                os.unlink(found)
                removed.append(name)
        except OSError:
            pass
        finally:
            os.close(fd)
    return removed


def write_new_file(path: str | Path, data: bytes) -> bool:
    """`data` at `path` if nothing is there, else nothing (False): through new_file, so a file that appeared
    meanwhile is left as it is, and a half-written file never shows under the name."""
    try:
        with new_file(path) as f:
            f.write(data)
    except FileExistsError:
        return False
    return True
