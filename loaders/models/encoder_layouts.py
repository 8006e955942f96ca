"""The layouts a FLUX.2 [dev] text encoder checkpoint comes in, as one table (LAYOUTS). Each row says how
the layout is detected, how its weights are opened, its key scheme, whether its Q/K rows are stored in the
rotary order of llama.cpp and Mistral's own files, where its rope theta and head counts come from, and where
its tokenizer lives.

`find_layout` walks the table in order and takes the first row whose detector says yes; a path no row
claims is refused with the error that names what it is (REFUSALS), never read as a guess. Adding a layout
is one row here plus its writer in tiny/encoders.py.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING

from ...errors import (
    CorruptFileError,
    MissingWeightsError,
    UnknownModelError,
    UnsupportedFormatError,
    WrongModelError,
)
from ..formats import packing
from ..formats.files import (
    CONFIG,
    ENCODER_CONFIG,
    MODEL_INDEX,
    PARAMS,
    PARAMS_FIELDS,
    TEKKEN_FILE,
    TEXT_ENCODER_FOLDER,
    TOKENIZER_FOLDER,
    read_json,
    shards,
)
from ..formats.safetensors_file import SafetensorsFiles
from .kinds import GGUF_ARCHITECTURES, gguf_architectures, gguf_kind
from .node_titles import title
from .variants import MistralEncoderGeometry

if TYPE_CHECKING:  # for the annotations only: torch is imported where a tensor is made
    import torch

HF_WEIGHTS = "model.safetensors"  # transformers' weights file (or its index's stem)
HUB_MARKERS = (HF_WEIGHTS + ".index.json", "tokenizer.json")  # files a hub download has and a BFL folder lacks
NATIVE_SHARDS = "consolidated*.safetensors"


# --- key schemes: stored names -> the host's MistralForCausalLM names -----------------------------------------


@dataclass(frozen=True)
class KeyScheme:
    prefixes: tuple[str, ...]  # stripped from stored names, first match wins
    embed: str
    layer_word: str
    parts: dict[str, str]  # stored module name in a layer -> the host's
    final_norm: str  # the final norm's module, under a prefix (only text generation reads it)
    lm_head: tuple[str, ...]  # the output head's stored module names, whole (only text generation reads it)


HOST_PARTS = (
    "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
    "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "input_layernorm", "post_attention_layernorm",
)
HF_SCHEME = KeyScheme(
    ("model.language_model.", "language_model.model.", "model."), "embed_tokens", "layers", {p: p for p in HOST_PARTS},
    "norm", ("lm_head", "language_model.lm_head"),
)
NATIVE_SCHEME = KeyScheme(("",), "tok_embeddings", "layers", dict(zip((
    "attention.wq", "attention.wk", "attention.wv", "attention.wo",
    "feed_forward.w1", "feed_forward.w3", "feed_forward.w2", "attention_norm", "ffn_norm",
), HOST_PARTS)), "norm", ("output",))
GGUF_SCHEME = KeyScheme(("",), "token_embd", "blk", dict(zip((
    "attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down", "attn_norm", "ffn_norm",
), HOST_PARTS)), "output_norm", ("output",))


# --- the path being read, looked at once -------------------------------------------------------------------


class Checkpoint:
    """A file or folder as the detectors see it. The GGUF header and a single file's safetensors header
    are parsed once, for detection and loading alike."""

    def __init__(self, path: str):
        self.path = path
        self.is_dir = os.path.isdir(path)
        self.ext = "" if self.is_dir else os.path.splitext(path)[1].lower()
        self.folder = path if self.is_dir else os.path.dirname(path)

    def has(self, name: str) -> bool:
        # whatever is there under the name marks the layout; its reader then refuses one that is no regular file
        return self.is_dir and os.path.lexists(os.path.join(self.path, name))

    def weights(self, pattern: str = "*.safetensors") -> list[str]:
        # the folder's own name is escaped: "flux [fp8]" is a folder, not a pattern
        return sorted(glob.glob(os.path.join(glob.escape(self.path), pattern))) if self.is_dir else []

    @cached_property
    def gguf(self):
        from ..formats.gguf_file import open_gguf

        # The settings of the encoder architectures are read (rope theta, head counts): checked on opening.
        return open_gguf(self.path, frozenset(gguf_architectures("encoder")))

    @cached_property
    def architecture(self) -> str | None:
        return self.gguf.architecture if self.ext == ".gguf" else None

    @cached_property
    def single_file(self) -> SafetensorsFiles | None:
        return SafetensorsFiles([self.path]) if self.ext == ".safetensors" else None


# --- sources: the stored tensors of a checkpoint and the settings beside them ---------------------------------


@dataclass
class Source:
    """Stored tensors of one checkpoint: {name: (format word, logical shape)} plus a reader, and the
    settings stored beside them (config.json, params.json or the GGUF header's metadata)."""

    entries: dict[str, tuple[str, tuple[int, ...]]]
    read: Callable[[str], torch.Tensor]
    nbytes: Callable[[str], int]
    settings: dict
    files: tuple[str, ...]  # the weight files the tensors are read from
    architecture: str | None = None  # GGUF only
    # The state-dict entries (host name -> tensor) of a stored tensor: the tensor as read, or for GGUF the
    # tensor and its packing companion (packed_dequant.from_gguf).
    entries_of: Callable[[str, str], dict[str, torch.Tensor]] | None = None
    # stored weight -> its PACKING companion's values, for declared weights whose format needs them (packing.py)
    packings: dict[str, tuple[int, ...]] = field(default_factory=dict)

    def state_entries(self, host: str, stored: str) -> dict[str, torch.Tensor]:
        if self.entries_of:
            return self.entries_of(host, stored)
        out = {host: self.read(stored)}
        if stored in self.packings:
            import torch

            out[host[: -len("weight")] + packing.PACKING] = torch.tensor(self.packings[stored])
        return out


def _logical(label: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    packed = packing.packed_format(label)
    return packed.logical_shape(shape) if packed else shape


def _files_source(files: SafetensorsFiles, settings: dict) -> Source:
    stored = packing.stored_tensors(files)
    labels = stored.labels
    entries = {k: (labels[k], _logical(labels[k], v.shape)) for k, v in files.infos.items()}
    return Source(entries, files.view, lambda k: files.infos[k].nbytes, settings, tuple(files.paths),
                  packings=stored.packings)


def _safetensors_source(paths: list[str], settings: dict) -> Source:
    return _files_source(SafetensorsFiles(paths), settings)


def _hf_folder_source(folder: str) -> Source:
    found = [str(p) for p in shards(folder, HF_WEIGHTS)] \
        or sorted(glob.glob(os.path.join(glob.escape(folder), "*.safetensors")))
    if not found:
        raise MissingWeightsError(f"{folder} has a {CONFIG} but no .safetensors weights. Finish the download.")
    return _safetensors_source(found, read_json(os.path.join(folder, CONFIG), ENCODER_CONFIG))


def _pipeline_source(ck: Checkpoint) -> Source:
    folder = os.path.join(ck.path, TEXT_ENCODER_FOLDER)
    if not os.path.isdir(folder):
        raise MissingWeightsError(
            f"{ck.path} is a diffusers pipeline folder without a {TEXT_ENCODER_FOLDER}/ folder. Download the "
            f"pipeline's {TEXT_ENCODER_FOLDER}/ and {TOKENIZER_FOLDER}/ folders, or pick a FLUX.2 [dev] text encoder "
            "file."
        )
    return _hf_folder_source(folder)


def _native_source(ck: Checkpoint) -> Source:
    params = os.path.join(ck.folder, PARAMS)
    settings = read_json(params, PARAMS_FIELDS) if os.path.lexists(params) else {}
    if ck.single_file is not None:
        return _files_source(ck.single_file, settings)
    return _safetensors_source(ck.weights(NATIVE_SHARDS) or ck.weights(), settings)


def _single_source(ck: Checkpoint) -> Source:
    return _files_source(ck.single_file, {}) if ck.single_file is not None else _safetensors_source(ck.weights(), {})


def _gguf_source(ck: Checkpoint) -> Source:
    gguf = ck.gguf
    entries = {name: (packing.gguf_label(t.qtype), tuple(t.shape)) for name, t in gguf.tensors.items()}

    def entries_of(host: str, name: str) -> dict[str, torch.Tensor]:
        from ..formats.packed_dequant import from_gguf  # torch, imported where a tensor is made

        return from_gguf(host, gguf.tensors[name])

    return Source(
        entries,
        lambda name: entries_of(name, name)[name],
        lambda name: gguf.tensors[name].nbytes,
        gguf.metadata,
        (ck.path,),
        gguf.architecture,
        entries_of=entries_of,
    )


# --- settings: where rope theta and head counts come from ----------------------------------------------------


@dataclass(frozen=True)
class Settings:
    rope_theta: Callable[[Source], float | None]  # None: the geometry's own
    heads: Callable[[Source, MistralEncoderGeometry], tuple[int, int]]  # (heads, kv heads)


# The values below were checked where they were read: JSON files against files.ENCODER_CONFIG and
# PARAMS_FIELDS, GGUF metadata against gguf_file.METADATA_FIELDS.
def _number(value) -> float | None:
    return float(value) if value is not None else None


def _config_theta(source: Source) -> float | None:
    text = source.settings.get("text_config", source.settings)
    return _number(text.get("rope_theta") or (text.get("rope_parameters") or {}).get("rope_theta"))


def _gguf_value(source: Source, key: str):
    name = f"{source.architecture}.{key}"
    if name not in source.settings:
        raise CorruptFileError(f"The GGUF header lacks {name}, which a text encoder GGUF always states; "
                               "the file is damaged.")
    return source.settings[name]


CONFIG_JSON = Settings(
    _config_theta,
    lambda s, g: (g.heads, g.kv_heads),  # HF rows are stored half-split: the head counts are never needed
)
PARAMS_JSON = Settings(
    lambda s: _number(s.settings.get("rope_theta")),
    lambda s, g: (int(s.settings.get("n_heads", g.heads)), int(s.settings.get("n_kv_heads", g.kv_heads))),
)
GGUF_METADATA = Settings(
    lambda s: _number(s.settings.get(f"{s.architecture}.rope.freq_base")),
    lambda s, g: (int(_gguf_value(s, "attention.head_count")), int(_gguf_value(s, "attention.head_count_kv"))),
)
NO_SETTINGS = Settings(lambda s: None, lambda s, g: (g.heads, g.kv_heads))


# --- the layouts ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class EncoderLayout:
    name: str  # what the pack reports
    detect: Callable[[Checkpoint], bool]  # asked in table order; the first row that says yes reads the path
    source: Callable[[Checkpoint], Source]
    scheme: KeyScheme
    qk_permuted: bool  # Q/K rows stored in Meta/llama.cpp rotary order, undone on load
    settings: Settings
    tokenizer: Callable[[Checkpoint], tuple[str, ...]]  # the folders the tokenizer ladder looks in


def tokenizer_folders(folder: str) -> tuple[str, ...]:
    """Where the tokenizer of a model in `folder` (its folder, or the folder of its file) can live, in order: the
    folder itself, its tokenizer/, and the tokenizer/ of the diffusers pipeline the folder is part of."""
    found = [folder, os.path.join(folder, TOKENIZER_FOLDER)]
    parent = os.path.dirname(os.path.abspath(folder))
    if os.path.isfile(os.path.join(parent, MODEL_INDEX)):
        found.append(os.path.join(parent, TOKENIZER_FOLDER))
    return tuple(found)


def _beside(ck: Checkpoint) -> tuple[str, ...]:
    return tokenizer_folders(ck.folder)


def _is_hub_folder(ck: Checkpoint) -> bool:
    # hub folders are sharded or carry an HF tokenizer; BFL-style folders hold one file beside tekken.json
    return ck.has(CONFIG) and (any(ck.has(n) for n in HUB_MARKERS) or not ck.has(TEKKEN_FILE))


def _is_native_file(ck: Checkpoint) -> bool:
    return ck.single_file is not None and any(
        k.startswith("layers.") and ".attention." in k for k in ck.single_file.infos
    )


def _gguf_layout(arch: str, qk_permuted: bool) -> EncoderLayout:
    return EncoderLayout(
        f"gguf-{arch}", lambda ck: ck.ext == ".gguf" and ck.architecture == arch, _gguf_source, GGUF_SCHEME,
        qk_permuted, GGUF_METADATA, _beside,
    )


LAYOUTS: tuple[EncoderLayout, ...] = (
    EncoderLayout("diffusers-pipeline", lambda ck: ck.has(MODEL_INDEX), _pipeline_source, HF_SCHEME, False,
                  CONFIG_JSON, lambda ck: (os.path.join(ck.path, TOKENIZER_FOLDER),)),
    EncoderLayout("mistral-native", lambda ck: ck.has(PARAMS) or _is_native_file(ck), _native_source, NATIVE_SCHEME,
                  True, PARAMS_JSON, _beside),
    EncoderLayout("hf-mistral3", _is_hub_folder, lambda ck: _hf_folder_source(ck.path), HF_SCHEME, False,
                  CONFIG_JSON, _beside),
    EncoderLayout("standalone-folder", lambda ck: ck.has(CONFIG), lambda ck: _hf_folder_source(ck.path), HF_SCHEME,
                  False, CONFIG_JSON, _beside),
    _gguf_layout("llama", True),
    _gguf_layout("mistral3", True),
    _gguf_layout("cow", False),  # gguf-org's files keep the HF row order
    EncoderLayout("comfy-single-file", lambda ck: ck.single_file is not None or bool(ck.weights()), _single_source,
                  HF_SCHEME, False, NO_SETTINGS, _beside),
)


def _encoder_architectures() -> str:
    return ", ".join(sorted(a for a in gguf_architectures("encoder")))


# What a path no layout claims is, in the user's words; the first row that applies names it.
REFUSALS: tuple[tuple[Callable[[Checkpoint], bool], Callable[[Checkpoint], Exception]], ...] = (
    (lambda ck: ck.is_dir, lambda ck: UnknownModelError(
        f"{ck.path} is a folder with no {CONFIG}, {PARAMS}, {MODEL_INDEX} or .safetensors files; it holds no "
        "text encoder the pack can read.")),
    (lambda ck: ck.ext == ".gguf" and gguf_kind(ck.architecture) == "transformer", lambda ck: WrongModelError(
        f"{os.path.basename(ck.path)} is a FLUX transformer GGUF, not a text encoder. Load it with "
        f"{title('Flux2DevGGUFTransformerLoader')}, and pick a Mistral-Small text encoder here.")),
    (lambda ck: ck.ext == ".gguf" and gguf_kind(ck.architecture) == "other", lambda ck: WrongModelError(
        f"{os.path.basename(ck.path)} is {GGUF_ARCHITECTURES[ck.architecture][1]} (general.architecture "
        f"{ck.architecture!r}), not the FLUX.2 [dev] text encoder. Pick a Mistral-Small text encoder here.")),
    (lambda ck: ck.ext == ".gguf", lambda ck: UnknownModelError(
        f"{ck.path} is a GGUF file of architecture {ck.architecture!r}; the FLUX.2 [dev] encoder is read from "
        f"GGUF architectures {_encoder_architectures()}.")),
    (lambda ck: True, lambda ck: UnsupportedFormatError(
        f"{ck.path} is a {ck.ext or 'extensionless'} file; the pack reads .safetensors and .gguf only (pickled "
        ".pt/.bin/.ckpt files can run code when opened, so they are never loaded). Convert it to safetensors.")),
)


def find_layout(path: str) -> tuple[EncoderLayout, Checkpoint]:
    """The layout of an existing encoder file or folder; raises what the path is when no layout claims it."""
    ck = Checkpoint(path)
    for layout in LAYOUTS:
        if layout.detect(ck):
            return layout, ck
    raise next(error(ck) for applies, error in REFUSALS if applies(ck))
