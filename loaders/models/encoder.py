"""The FLUX.2 [dev] text encoder loader: any layout of a Mistral-Small-3.x checkpoint in, one state dict in
the host's MistralForCausalLM keys out.

Reading happens in two steps. `plan_encoder` looks only at headers: it finds the layout
(encoder_layouts.LAYOUTS), maps every stored name to the host's name and identifies the model strictly
(encoder_identify.py), and decides what to read. FLUX.2 uses layers 0..29 (variants.layers_kept) and the
embeddings only, so layers 30+, the final norm, lm_head, the vision tower and the projector are skipped by
name and never read. `load_encoder` then reads exactly the planned tensors. Quantized weights stay packed (see
packing.py); the host dequantizes them per layer at run time.

Prompt upsampling writes text with the same checkpoint, and needs all of its layers, the final norm and lm_head:
`plan_language_model` plans that reading (READINGS), and refuses a checkpoint that lacks them before anything
is read.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ...errors import (
    CorruptFileError,
    MissingWeightsError,
    ModelNotFoundError,
    TokenizerNotFoundError,
    UnknownModelError,
    WrongModelError,
)
from ..formats import packing
from ..formats.files import MODEL_FOLDER_MARKERS
from ..formats.validate import JSON_LIMITS, released_on_error
from . import progress, variants
from .encoder_identify import EMBED, FINAL_NORM, LAYER_SHAPES, LM_HEAD, host_name, identify
from .encoder_layouts import GGUF_METADATA, Source, find_layout, tokenizer_folders
from .variants import MistralEncoderGeometry

if TYPE_CHECKING:  # for the annotations only: torch is imported where a tensor is made
    import torch

EMBEDDED_TEKKEN = "tekken_model"  # ComfyUI single files and gguf-org files carry tekken.json as a tensor
FULL_MODEL_SOURCES = (
    "a Hugging Face Mistral-Small-3.x folder (mistralai/Mistral-Small-3.2-24B-Instruct-2506), the text_encoder/ of a "
    "FLUX.2 [dev] diffusers pipeline, Mistral's consolidated.safetensors, or a llama.cpp .gguf of Mistral-Small-3.x"
)


@dataclass(frozen=True)
class Reading:
    """What a plan reads of a checkpoint."""

    name: str
    layers: Callable[[MistralEncoderGeometry, int], int]  # (geometry, layers in the file) -> leading layers read
    head: bool  # the final norm and lm_head


# FLUX.2 conditioning reads the embeddings and the layers its hidden states come from; writing text reads the
# whole language model.
CONDITIONING = Reading("conditioning", lambda g, in_file: variants.layers_kept(g), head=False)
GENERATION = Reading("text generation", lambda g, in_file: max(g.layers), head=True)


@dataclass
class EncoderPlan:
    path: str
    layout: str
    geometry: MistralEncoderGeometry
    layers_in_file: int
    rope_theta: float
    mapping: dict[str, str]  # host name -> stored name, exactly what is read
    skips: list[str]
    formats: dict[str, int]
    memory_bytes: int
    unpermute_heads: dict[str, int]  # host q/k module -> head count, for layouts that need it
    source: Source = field(repr=False)
    tokenizer_folders: tuple[str, ...] = ()
    embedded_tekken_key: str | None = None
    gguf_metadata: dict | None = field(default=None, repr=False)


@dataclass
class LoadedEncoder:
    path: str
    layout: str
    geometry: MistralEncoderGeometry
    layers_in_file: int
    rope_theta: float
    state_dict: dict[str, torch.Tensor] = field(repr=False)
    formats: dict[str, int]
    reads: list[str]
    skips: list[str]
    tokenizer: object  # tokenizers.TokenizerResolution
    memory_bytes: int


def plan_encoder(path: str) -> EncoderPlan:
    """Everything about an encoder checkpoint that its headers tell, without reading tensor data."""
    return _planned(path, CONDITIONING)


def plan_language_model(path: str) -> EncoderPlan:
    """The plan of the whole Mistral-Small language model in a checkpoint (all layers, final norm, lm_head), for
    writing text; a checkpoint that cannot write text (ComfyUI's pruned 30-layer files, a file without lm_head)
    is refused from its headers, naming what it lacks and which files work."""
    return _planned(path, GENERATION)


def _planned(path: str, reading: Reading) -> EncoderPlan:
    path = os.path.abspath(path)
    if not os.path.lexists(path):
        raise ModelNotFoundError(f"{path} does not exist. Give a text encoder file or folder that exists on this "
                                 "machine.")
    layout, checkpoint = find_layout(path)
    return _plan(path, layout, checkpoint, reading)


def _is_read(host: str, layer: int | None, kept: int, reading: Reading) -> bool:
    if layer is not None:
        return layer < kept
    if host.startswith(EMBED.removesuffix("weight")):  # the embeddings, and the companions of their packing
        return True
    return reading.head and host.startswith((FINAL_NORM, LM_HEAD + "."))


def _plan(path: str, layout, checkpoint, reading: Reading) -> EncoderPlan:
    source = layout.source(checkpoint)
    shapes = {k: shape for k, (_, shape) in source.entries.items()}
    geometry, layers_in_file = identify(shapes, layout.scheme)
    kept = reading.layers(geometry, layers_in_file)
    if layers_in_file < kept:
        raise WrongModelError(
            f"{os.path.basename(path)} holds {layers_in_file} of Mistral-Small's {kept} layers: it is a pruned FLUX.2 "
            "encoder (as ComfyUI's mistral_3_small_flux2_* files), which encodes prompts but cannot do "
            f"{reading.name}. Pick the whole model: {FULL_MODEL_SOURCES}."
        )

    mapping: dict[str, str] = {}
    skips: list[str] = []
    for stored in source.entries:
        host, layer = host_name(stored, layout.scheme)
        if not host or not _is_read(host, layer, kept, reading):
            if stored != EMBEDDED_TEKKEN:
                skips.append(stored)
            continue
        if host in mapping:
            raise CorruptFileError(f"{path}: both {mapping[host]} and {stored} hold {host}; the file is ambiguous.")
        mapping[host] = stored
    _check_complete(path, geometry, kept, mapping, shapes, source, reading)

    formats: dict[str, int] = {}
    for host, stored in mapping.items():
        if host.endswith(".weight"):
            fmt = source.entries[stored][0]
            formats[fmt] = formats.get(fmt, 0) + 1

    theta = layout.settings.rope_theta(source)
    heads = dict(zip(("self_attn.q_proj", "self_attn.k_proj"), _stated_heads(path, layout, source, geometry))) \
        if layout.qk_permuted else {}
    return EncoderPlan(
        path=path,
        layout=layout.name,
        geometry=geometry,
        layers_in_file=layers_in_file,
        rope_theta=theta if theta is not None else geometry.rope_theta,
        mapping=mapping,
        skips=sorted(skips),
        formats=formats,
        memory_bytes=sum(source.nbytes(s) for s in mapping.values()),
        unpermute_heads=heads,
        source=source,
        tokenizer_folders=layout.tokenizer(checkpoint),
        embedded_tekken_key=EMBEDDED_TEKKEN if EMBEDDED_TEKKEN in source.entries else None,
        gguf_metadata=source.settings if layout.settings is GGUF_METADATA else None,
    )


def _stated_heads(path: str, layout, source, geometry: MistralEncoderGeometry) -> tuple[int, int]:
    """The head counts the file's settings state, which undo the rotary interleave: they must be the
    geometry's, or the rows would be regrouped wrongly (a model that runs and is wrong)."""
    stated = layout.settings.heads(source, geometry)
    if stated != (geometry.heads, geometry.kv_heads):
        raise UnknownModelError(
            f"{path} states {stated[0]} attention heads and {stated[1]} key/value heads, but its weights are those of "
            f"an encoder with {geometry.heads} and {geometry.kv_heads}; its settings and weights disagree. "
            "Download it again."
        )
    return stated


def _check_complete(path, geometry, kept, mapping, shapes, source, reading: Reading) -> None:
    missing, wrong = [], []
    need = {EMBED: (geometry.vocab, geometry.width)}
    for i in range(kept):
        for part, shape in LAYER_SHAPES.items():
            need[f"model.layers.{i}.{part}.weight"] = shape(geometry)
    if reading.head:
        head = {FINAL_NORM: ("the final norm", (geometry.width,)),
                f"{LM_HEAD}.weight": ("the output head (lm_head)", (geometry.vocab, geometry.width))}
        absent = [what for name, (what, _) in head.items() if name not in mapping]
        if absent:
            raise MissingWeightsError(
                f"{os.path.basename(path)} has all {kept} layers but not {' and '.join(absent)}, which turn them into "
                f"words, so it cannot do {reading.name}. Pick the whole model: {FULL_MODEL_SOURCES}."
            )
        need.update({name: shape for name, (_, shape) in head.items()})
    for host, shape in need.items():
        stored = mapping.get(host)
        if stored is None:
            missing.append(host)
            continue
        if shapes[stored] != shape:
            wrong.append(f"{stored} {list(shapes[stored])} (expected {list(shape)})")
        packed = packing.packed_format(source.entries[stored][0])
        for suffix in packed.stored_companions if packed else ():
            companion = host[: -len("weight")] + suffix
            if companion not in mapping:
                missing.append(companion)
    if missing:
        shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
        raise MissingWeightsError(
            f"{path} lacks {len(missing)} tensor(s) the FLUX.2 [dev] encoder needs: {shown}. The download is "
            "incomplete or the file was cut; download it again."
        )
    if wrong:
        raise UnknownModelError(f"{path}: tensors with unexpected shapes: {'; '.join(wrong[:5])}.")


def undo_rotary_permute(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows stored interleaved per head (Meta/llama.cpp rotary order) -> HF half-split order. Works on
    packed rows too: only whole rows move."""
    rows = weight.shape[0]
    return weight.reshape(heads, rows // heads // 2, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def planned_weights(plan: EncoderPlan) -> list[str]:
    """The host names of the planned weights (their packing companions come with them)."""
    return [host for host in plan.mapping if not packing.is_companion(host)]


def read_weight(plan: EncoderPlan, host: str) -> dict[str, torch.Tensor]:
    """One planned weight in the host's names, with the companions of its packing, its rows in HF order."""
    entries = plan.source.state_entries(host, plan.mapping[host])
    layer = host[: -len("weight")]
    for companion in packing.COMPANIONS:
        if layer + companion in plan.mapping:
            entries.update(plan.source.state_entries(layer + companion, plan.mapping[layer + companion]))
    module = host.split(".")[3] + "." + host.split(".")[4] if host.startswith("model.layers.") else ""
    if module in plan.unpermute_heads:
        entries[host] = undo_rotary_permute(entries[host], plan.unpermute_heads[module])
    return entries


@released_on_error
def read_weights(plan: EncoderPlan) -> dict[str, torch.Tensor]:
    """Exactly the planned tensors, in the host's names (packed ones with their companions)."""
    state_dict = {}
    for host in progress.tracked(planned_weights(plan)):
        state_dict.update(read_weight(plan, host))
    return state_dict


def load_encoder(path: str, *, allow_network: bool = False) -> LoadedEncoder:
    """Read a FLUX.2 [dev] text encoder from any supported layout, with its tokenizer."""
    plan = plan_encoder(path)
    state_dict = read_weights(plan)
    tokenizer = resolve_plan_tokenizer(plan, allow_network=allow_network)
    return LoadedEncoder(
        path=plan.path,
        layout=plan.layout,
        geometry=plan.geometry,
        layers_in_file=plan.layers_in_file,
        rope_theta=plan.rope_theta,
        state_dict=state_dict,
        formats=plan.formats,
        reads=sorted(plan.mapping.values()),
        skips=plan.skips,
        tokenizer=tokenizer,
        memory_bytes=sum(t.numel() * t.element_size() for t in state_dict.values()),
    )


def resolve_plan_tokenizer(plan: EncoderPlan, *, allow_network: bool = False):
    from ...tokenizers import resolve_tokenizer

    key = plan.embedded_tekken_key
    # A tekken.json is JSON_LIMITS["vocabulary"] bytes at most; GGUF files may store each byte as an F16 value.
    if key and plan.source.nbytes(key) > 2 * JSON_LIMITS["vocabulary"]:
        raise CorruptFileError(
            f"{plan.path}: its embedded vocabulary ({key}) is {plan.source.nbytes(key)} bytes, more than any real "
            "tekken.json; the file is damaged. Download it again."
        )
    embedded = plan.source.read(key) if key else None
    return resolve_tokenizer(
        plan.tokenizer_folders,
        embedded_tekken=embedded,
        gguf_metadata=plan.gguf_metadata,
        allow_network=allow_network,
    )


def encoder_tokenizer(path: str, *, allow_network: bool = False):
    """The tokenizer the encoder at `path` gets when it loads (its embedded or GGUF vocabulary before the
    rest of the ladder). A folder that holds only tokenizer files goes up the ladder as it is."""
    from ...tokenizers import resolve_tokenizer
    from ...tokenizers.ladder import TOKENIZER_FILES

    if os.path.isdir(path) and not any(n.endswith(".safetensors") or n in MODEL_FOLDER_MARKERS
                                       for n in os.listdir(path)):
        if not any(os.path.isfile(os.path.join(path, name)) for name in TOKENIZER_FILES):
            raise TokenizerNotFoundError(
                f"{path} holds neither text encoder weights nor tokenizer files ({', '.join(TOKENIZER_FILES)}). "
                "Give the encoder's file or folder."
            )
        return resolve_tokenizer(tokenizer_folders(path), allow_network=allow_network)
    return resolve_plan_tokenizer(plan_encoder(path), allow_network=allow_network)


def inspect_encoder(path: str) -> dict:
    """What `flux2dev inspect` prints for an encoder: found from headers, nothing but the tokenizer read."""
    plan = plan_encoder(path)
    tokenizer = resolve_plan_tokenizer(plan)
    return {
        "kind": "encoder",
        "layout": plan.layout,
        "variant": variants.dev_variant_for_encoder(plan.geometry).key,
        "layers": plan.layers_in_file,
        "reads": len(plan.mapping),
        "skips": len(plan.skips),
        "formats": plan.formats,
        "tokenizer": {"rung": tokenizer.rung, "source": tokenizer.source},
        "memory_bytes": plan.memory_bytes,
    }
