"""The FLUX.2 [dev] text encoder loader: any layout of a Mistral-Small-3.x checkpoint in, one state dict in
the host's MistralForCausalLM keys out.

Reading happens in two steps. `plan_encoder` looks only at headers: it finds the layout, maps every stored
name to the host's name (tables below), identifies the model strictly and decides what to read. FLUX.2
uses layers 0..29 and the embeddings only, so layers 30+, the final norm, lm_head, the vision tower and the
projector are skipped by name and never read. `load_encoder` then reads exactly the planned tensors.
Quantized weights stay packed (see quant.py); the host dequantizes them per layer at run time.
"""

from __future__ import annotations

import glob
import json
import os
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..errors import (
    CorruptFileError,
    MissingWeightsError,
    ModelNotFoundError,
    TokenizerNotFoundError,
    UnknownModelError,
    UnsupportedFormatError,
    WrongModelError,
)
from . import quant, variants
from .inspect import kind_from_names
from .safetensors_file import SafetensorsFiles
from .variants import MistralEncoderGeometry

FLUX2_LAYERS = 30  # hidden_states[10, 20, 30] need layers 0..29 only
EMBED = "model.embed_tokens.weight"

# The host's per-layer modules (MistralForCausalLM names), with the weight shape each must have.
LAYER_SHAPES: dict[str, Callable[[MistralEncoderGeometry], tuple[int, ...]]] = {
    "self_attn.q_proj": lambda g: (g.heads * g.head_dim, g.width),
    "self_attn.k_proj": lambda g: (g.kv_heads * g.head_dim, g.width),
    "self_attn.v_proj": lambda g: (g.kv_heads * g.head_dim, g.width),
    "self_attn.o_proj": lambda g: (g.width, g.heads * g.head_dim),
    "mlp.gate_proj": lambda g: (g.mlp, g.width),
    "mlp.up_proj": lambda g: (g.mlp, g.width),
    "mlp.down_proj": lambda g: (g.width, g.mlp),
    "input_layernorm": lambda g: (g.width,),
    "post_attention_layernorm": lambda g: (g.width,),
}
HOST_PARTS = {name: name for name in LAYER_SHAPES}
NATIVE_PARTS = {
    "attention.wq": "self_attn.q_proj",
    "attention.wk": "self_attn.k_proj",
    "attention.wv": "self_attn.v_proj",
    "attention.wo": "self_attn.o_proj",
    "feed_forward.w1": "mlp.gate_proj",
    "feed_forward.w3": "mlp.up_proj",
    "feed_forward.w2": "mlp.down_proj",
    "attention_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
GGUF_PARTS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}

# Tensor suffixes: stored spelling -> the name the host ops read; None = ignored (fp8 input scales are
# placeholders: activations are never quantized here).
SUFFIXES = {
    "weight": "weight",
    "weight_scale": "weight_scale",
    "scale_weight": "weight_scale",
    "weight_scale_2": "weight_scale_2",
    "input_scale": None,
    "scale_input": None,
}


@dataclass(frozen=True)
class KeyScheme:
    prefixes: tuple[str, ...]  # stripped from stored names, first match wins
    embed: str
    layer_word: str
    parts: dict[str, str]


HF_SCHEME = KeyScheme(("model.language_model.", "language_model.model.", "model."), "embed_tokens", "layers", HOST_PARTS)
NATIVE_SCHEME = KeyScheme(("",), "tok_embeddings", "layers", NATIVE_PARTS)
GGUF_SCHEME = KeyScheme(("",), "token_embd", "blk", GGUF_PARTS)

# layout -> (key scheme, Q/K rows stored in the interleaved rotary order that must be undone)
LAYOUTS: dict[str, tuple[KeyScheme, bool]] = {
    "hf-mistral3": (HF_SCHEME, False),
    "diffusers-pipeline": (HF_SCHEME, False),
    "standalone-folder": (HF_SCHEME, False),
    "comfy-single-file": (HF_SCHEME, False),
    "mistral-native": (NATIVE_SCHEME, True),
    "gguf-llama": (GGUF_SCHEME, True),
    "gguf-mistral3": (GGUF_SCHEME, True),
    "gguf-cow": (GGUF_SCHEME, False),  # gguf-org's files keep HF row order (FACTS: unverified; as documented)
}
GGUF_ARCH_LAYOUTS = {"llama": "gguf-llama", "mistral3": "gguf-mistral3", "cow": "gguf-cow"}
EMBEDDED_TEKKEN = "tekken_model"  # ComfyUI single files and gguf-org files carry tekken.json as a tensor
# The companions each packed format needs beside its weight; a weight without them cannot be dequantized.
REQUIRED_COMPANIONS = {"fp8-scaled": ("weight_scale",), "nvfp4": ("weight_scale", "weight_scale_2")}


@dataclass
class Source:
    """Stored tensors of one checkpoint: {name: (format word, shape)} plus a reader."""

    entries: dict[str, tuple[str, tuple[int, ...]]]
    read: Callable[[str], torch.Tensor]
    nbytes: Callable[[str], int]
    metadata: dict
    architecture: str | None = None  # GGUF only
    # The state-dict entries (host name -> tensor) of a stored tensor: the tensor as read, or for GGUF the
    # tensor and its packing companion (quant.from_gguf).
    entries_of: Callable[[str, str], dict[str, torch.Tensor]] | None = None

    def state_entries(self, host: str, stored: str) -> dict[str, torch.Tensor]:
        return self.entries_of(host, stored) if self.entries_of else {host: self.read(stored)}


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
    tokenizer_folder: str | None = None
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

    @property
    def variant(self) -> variants.Flux2Variant:
        return variants.dev_variant_for_encoder(self.geometry)


# --- sources --------------------------------------------------------------------------------------------

def _safetensors_source(paths: list[str]) -> Source:
    files = SafetensorsFiles(paths)
    entries = {k: (v.format, v.shape) for k, v in files.infos.items()}
    return Source(entries, files.read, lambda k: files.infos[k].nbytes, files.metadata)


def _gguf_source(path: str) -> Source:
    from .gguf_file import open_gguf

    gguf = open_gguf(path)
    entries = {name: (f"gguf-{t.qtype.name}", tuple(t.shape)) for name, t in gguf.tensors.items()}
    return Source(
        entries,
        lambda name: quant.from_gguf(name, gguf.tensors[name])[name],
        lambda name: gguf.tensors[name].nbytes,
        gguf.metadata,
        gguf.architecture,
        entries_of=lambda host, name: quant.from_gguf(host, gguf.tensors[name]),
    )


# --- finding the layout ---------------------------------------------------------------------------------


def _weights_in(folder: str) -> list[str]:
    return sorted(glob.glob(os.path.join(folder, "*.safetensors")))


def _read_json(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except ValueError as e:
        raise CorruptFileError(f"{path} is not valid JSON ({e}).") from None


def _open(path: str) -> tuple[str, Source, dict, str | None]:
    """(layout, source, config dict, tokenizer folder) for a file or folder."""
    if os.path.isdir(path):
        if os.path.isfile(os.path.join(path, "model_index.json")):
            te = os.path.join(path, "text_encoder")
            if not os.path.isdir(te):
                raise MissingWeightsError(
                    f"{path} is a diffusers pipeline folder without a text_encoder/ folder. Download the pipeline's "
                    "text_encoder/ and tokenizer/ folders, or pick a FLUX.2 [dev] text encoder file."
                )
            return "diffusers-pipeline", _folder_source(te), _config(te), os.path.join(path, "tokenizer")
        if os.path.isfile(os.path.join(path, "params.json")):
            shards = sorted(glob.glob(os.path.join(path, "consolidated*.safetensors")))
            return "mistral-native", _safetensors_source(shards or _weights_in(path)), _read_json(os.path.join(path, "params.json")), path
        if os.path.isfile(os.path.join(path, "config.json")):
            # hub folders are sharded or carry an HF tokenizer; BFL-style folders hold one file beside tekken.json
            hub = any(os.path.isfile(os.path.join(path, n)) for n in ("model.safetensors.index.json", "tokenizer.json"))
            layout = "hf-mistral3" if hub or not os.path.isfile(os.path.join(path, "tekken.json")) else "standalone-folder"
            return layout, _folder_source(path), _config(path), path
        if _weights_in(path):
            return "comfy-single-file", _safetensors_source(_weights_in(path)), {}, path
        raise UnknownModelError(
            f"{path} is a folder with no config.json, params.json, model_index.json or .safetensors files; it holds no "
            "text encoder the pack can read."
        )
    if not os.path.isfile(path):
        raise ModelNotFoundError(f"{path} does not exist. Give a text encoder file or folder that exists on this machine.")
    ext = os.path.splitext(path)[1].lower()
    folder = os.path.dirname(path)
    if ext == ".gguf":
        source = _gguf_source(path)
        layout = GGUF_ARCH_LAYOUTS.get(source.architecture)
        if layout is None and source.architecture in (None, "flux", "pig"):
            raise WrongModelError(
                f"{os.path.basename(path)} is a FLUX transformer GGUF, not a text encoder. Load it with Load FLUX.2 "
                "GGUF transformer, and pick a Mistral-Small text encoder here."
            )
        if layout is None:
            raise UnknownModelError(
                f"{path} is a GGUF file of architecture {source.architecture!r}; the FLUX.2 [dev] encoder is read from "
                f"GGUF architectures {', '.join(sorted(GGUF_ARCH_LAYOUTS))}."
            )
        return layout, source, {}, folder
    if ext != ".safetensors":
        raise UnsupportedFormatError(
            f"{path} is a {ext or 'extensionless'} file; the pack reads .safetensors and .gguf only (pickled "
            ".pt/.bin/.ckpt files can run code when opened, so they are never loaded). Convert it to safetensors."
        )
    source = _safetensors_source([path])
    if any(k.startswith("layers.") and ".attention." in k for k in source.entries):
        params = os.path.join(folder, "params.json")
        return "mistral-native", source, _read_json(params) if os.path.isfile(params) else {}, folder
    return "comfy-single-file", source, {}, folder


def _folder_source(folder: str) -> Source:
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index):
        shards = sorted(set(_read_json(index)["weight_map"].values()))
        missing = [s for s in shards if not os.path.isfile(os.path.join(folder, s))]
        if missing:
            raise MissingWeightsError(
                f"{folder}: the index names shard(s) that are not there: {', '.join(missing)}. Finish the download."
            )
        return _safetensors_source([os.path.join(folder, s) for s in shards])
    shards = _weights_in(folder)
    if not shards:
        raise MissingWeightsError(f"{folder} has a config.json but no .safetensors weights. Finish the download.")
    return _safetensors_source(shards)


def _config(folder: str) -> dict:
    return _read_json(os.path.join(folder, "config.json"))


# rope theta, by layout: where the checkpoint states it
def _theta_from_config(config: dict) -> float | None:
    text = config.get("text_config", config)
    theta = text.get("rope_theta") or (text.get("rope_parameters") or {}).get("rope_theta")
    return float(theta) if theta is not None else None


def _theta_from_params(params: dict) -> float | None:
    return float(params["rope_theta"]) if "rope_theta" in params else None


def _theta_from_gguf(metadata: dict, arch: str) -> float | None:
    value = metadata.get(f"{arch}.rope.freq_base")
    return float(value) if value is not None else None


# --- naming and identification ---------------------------------------------------------------------------


def host_name(stored: str, scheme: KeyScheme) -> tuple[str | None, int | None]:
    """(host name, layer index) of one stored tensor name, or (None, None) when FLUX.2 never uses it.
    A host name of "" means a companion tensor that is ignored on purpose (input scales)."""
    rest = stored
    for prefix in scheme.prefixes:
        if stored.startswith(prefix):
            rest = stored[len(prefix):]
            break
    else:
        return None, None
    module, _, suffix = rest.rpartition(".")
    if suffix not in SUFFIXES:
        return None, None
    mapped = SUFFIXES[suffix]
    if module == scheme.embed:
        return (EMBED if mapped == "weight" else None), None
    head, _, tail = module.partition(".")
    if head != scheme.layer_word:
        return None, None
    index, _, part = tail.partition(".")
    if not index.isdigit() or part not in scheme.parts:
        return None, None
    if mapped is None:
        return "", int(index)
    return f"model.layers.{index}.{scheme.parts[part]}.{mapped}", int(index)


def _what_else(shapes: dict[str, tuple[int, ...]], scheme: KeyScheme) -> None:
    """Raise WrongModelError when the names say the file is some other known model."""
    names = list(shapes)
    kind = kind_from_names(names)
    if kind == "transformer":
        raise WrongModelError(
            "This is a FLUX.2 diffusion transformer, not a text encoder. Load it with FLUX.2 transformer source or Load "
            "FLUX.2 GGUF transformer, and pick a Mistral-Small text encoder (e.g. mistral_3_small_flux2_bf16.safetensors) "
            "here."
        )
    if kind == "vae":
        raise WrongModelError(
            "This is a VAE (autoencoder), not a text encoder. Load it with FLUX.2 VAE source or Load VAE, and pick a "
            "Mistral-Small text encoder (e.g. mistral_3_small_flux2_bf16.safetensors) here."
        )
    embed = _embed_shape(shapes, scheme)
    if any("q_norm" in n for n in names):
        width = embed[1] if embed else None
        klein = [v for v in variants.known_variants() if not v.guidance and v.encoder_width == width]
        what = f"the {klein[0].encoder_name} text encoder of {klein[0].name}" if klein else "a Qwen3-style text encoder"
        raise WrongModelError(
            f"This is {what} (hidden size {width}, attention q_norm present), not the Mistral-Small 24B encoder "
            "FLUX.2 [dev] needs. Use it with the matching FLUX.2 Klein model, or pick a FLUX.2 [dev] encoder "
            "(mistral_3_small_flux2_*.safetensors or a Mistral-Small-3.x folder) here."
        )
    if embed and embed[0] < 100000:
        raise WrongModelError(
            f"This is a Llama-family model with a {embed[0]}-token vocabulary, not the Mistral-Small 24B encoder "
            "(131072 tokens) FLUX.2 [dev] needs. Pick a FLUX.2 [dev] encoder (mistral_3_small_flux2_*.safetensors "
            "or a Mistral-Small-3.x folder)."
        )


def _embed_shape(shapes: dict[str, tuple[int, ...]], scheme: KeyScheme) -> tuple[int, ...] | None:
    for name, shape in shapes.items():
        if host_name(name, scheme)[0] == EMBED:
            return shape
    return None


def identify(shapes: dict[str, tuple[int, ...]], scheme: KeyScheme = HF_SCHEME) -> tuple[MistralEncoderGeometry, int]:
    """The Mistral-Small geometry and layer count of a checkpoint, from its stored names and shapes alone
    (host-order shapes; packed formats report their logical shape). Raises for anything else."""
    _what_else(shapes, scheme)
    embed = _embed_shape(shapes, scheme)
    hosted = {}
    for name, shape in shapes.items():
        host, _ = host_name(name, scheme)
        if host:
            hosted[host] = shape
    layer_ids = {int(h.split(".")[2]) for h in hosted if h.startswith("model.layers.")}
    q = hosted.get("model.layers.0.self_attn.q_proj.weight")
    k = hosted.get("model.layers.0.self_attn.k_proj.weight")
    gate = hosted.get("model.layers.0.mlp.gate_proj.weight")
    if embed is None or q is None or k is None or gate is None:
        raise UnknownModelError(
            "This file is not a Mistral text encoder the pack knows: it lacks an embedding table or layer-0 attention "
            f"and MLP weights (found {len(shapes)} tensors, e.g. {', '.join(sorted(shapes)[:5])}). Pick a FLUX.2 [dev] "
            "encoder (mistral_3_small_flux2_*.safetensors or a Mistral-Small-3.x folder)."
        )
    found = dict(vocab=embed[0], width=embed[1], q_rows=q[0], k_rows=k[0], mlp=gate[0], layers=len(layer_ids))
    for g in variants.known_mistral_encoders():
        want = dict(vocab=g.vocab, width=g.width, q_rows=g.heads * g.head_dim, k_rows=g.kv_heads * g.head_dim, mlp=g.mlp)
        if all(found[key] == value for key, value in want.items()) and found["layers"] in g.layers:
            return g, found["layers"]
    known = "; ".join(
        f"vocab {g.vocab}, width {g.width}, {g.heads} heads, {g.kv_heads} kv heads, MLP {g.mlp}, {' or '.join(map(str, g.layers))} layers"
        for g in variants.known_mistral_encoders()
    )
    raise UnknownModelError(
        "This text encoder's geometry matches no FLUX.2 [dev] encoder: found vocab {vocab}, width {width}, "
        "q rows {q_rows}, k rows {k_rows}, MLP {mlp}, {layers} layers; expected Mistral-Small ({known}). "
        "Pick a FLUX.2 [dev] encoder (mistral_3_small_flux2_*.safetensors or a Mistral-Small-3.x folder).".format(
            known=known, **found
        )
    )


# --- planning and loading ---------------------------------------------------------------------------------


def _logical_shape(fmt: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    # NVFP4 packs two inputs per byte
    return (shape[0], shape[1] * 2) if fmt == "nvfp4" and len(shape) == 2 else shape


def plan_encoder(path: str) -> EncoderPlan:
    """Everything about an encoder checkpoint that its headers tell, without reading tensor data."""
    path = os.path.abspath(path)
    layout, source, config, tokenizer_folder = _open(path)
    scheme, interleaved = LAYOUTS[layout]
    shapes = {k: _logical_shape(fmt, shape) for k, (fmt, shape) in source.entries.items()}
    geometry, layers_in_file = identify(shapes, scheme)

    mapping: dict[str, str] = {}
    skips: list[str] = []
    for stored in source.entries:
        host, layer = host_name(stored, scheme)
        if not host or (layer is not None and layer >= FLUX2_LAYERS):
            if stored != EMBEDDED_TEKKEN:
                skips.append(stored)
            continue
        if host in mapping:
            raise CorruptFileError(f"{path}: both {mapping[host]} and {stored} hold {host}; the file is ambiguous.")
        mapping[host] = stored
    _check_complete(path, geometry, mapping, shapes, source)

    formats: dict[str, int] = {}
    for host, stored in mapping.items():
        if host.endswith(".weight"):
            fmt = source.entries[stored][0]
            formats[fmt] = formats.get(fmt, 0) + 1

    theta = {
        "hf-mistral3": lambda: _theta_from_config(config),
        "diffusers-pipeline": lambda: _theta_from_config(config),
        "standalone-folder": lambda: _theta_from_config(config),
        "mistral-native": lambda: _theta_from_params(config),
        "comfy-single-file": lambda: None,
    }.get(layout, lambda: _theta_from_gguf(source.metadata, source.architecture))()

    heads = {}
    if interleaved:
        if layout.startswith("gguf"):
            arch = source.architecture
            heads = {
                "self_attn.q_proj": int(source.metadata[f"{arch}.attention.head_count"]),
                "self_attn.k_proj": int(source.metadata[f"{arch}.attention.head_count_kv"]),
            }
        else:
            heads = {
                "self_attn.q_proj": int(config.get("n_heads", geometry.heads)),
                "self_attn.k_proj": int(config.get("n_kv_heads", geometry.kv_heads)),
            }
    return EncoderPlan(
        path=path,
        layout=layout,
        geometry=geometry,
        layers_in_file=layers_in_file,
        rope_theta=theta if theta is not None else geometry.rope_theta,
        mapping=mapping,
        skips=sorted(skips),
        formats=formats,
        memory_bytes=sum(source.nbytes(s) for s in mapping.values()),
        unpermute_heads=heads,
        source=source,
        tokenizer_folder=tokenizer_folder,
        embedded_tekken_key=EMBEDDED_TEKKEN if EMBEDDED_TEKKEN in source.entries else None,
        gguf_metadata=source.metadata if layout.startswith("gguf") else None,
    )


def _check_complete(path, geometry, mapping, shapes, source) -> None:
    missing, wrong = [], []
    need = {EMBED: (geometry.vocab, geometry.width)}
    for i in range(FLUX2_LAYERS):
        for part, shape in LAYER_SHAPES.items():
            need[f"model.layers.{i}.{part}.weight"] = shape(geometry)
    for host, shape in need.items():
        stored = mapping.get(host)
        if stored is None:
            missing.append(host)
            continue
        if shapes[stored] != shape:
            wrong.append(f"{stored} {list(shapes[stored])} (expected {list(shape)})")
        for suffix in REQUIRED_COMPANIONS.get(source.entries[stored][0], ()):
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


def load_encoder(path: str, *, allow_network: bool = False) -> LoadedEncoder:
    """Read a FLUX.2 [dev] text encoder from any supported layout, with its tokenizer."""
    plan = plan_encoder(path)
    state_dict = {}
    for host, stored in plan.mapping.items():
        entries = plan.source.state_entries(host, stored)
        module = host.split(".")[3] + "." + host.split(".")[4] if host.startswith("model.layers.") else ""
        if module in plan.unpermute_heads and host.endswith(".weight"):
            entries[host] = undo_rotary_permute(entries[host], plan.unpermute_heads[module])
        state_dict.update(entries)
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
    from ..tokenizers import resolve_tokenizer

    embedded = plan.source.read(plan.embedded_tekken_key) if plan.embedded_tekken_key else None
    return resolve_tokenizer(
        plan.tokenizer_folder or plan.path,
        embedded_tekken=embedded,
        gguf_metadata=plan.gguf_metadata,
        allow_network=allow_network,
    )


def encoder_tokenizer(path: str, *, allow_network: bool = False):
    """The tokenizer the encoder at `path` gets when it loads (its embedded or GGUF vocabulary before the
    rest of the ladder). A folder that holds only tokenizer files goes up the ladder as it is."""
    from ..tokenizers import resolve_tokenizer
    from ..tokenizers.ladder import TOKENIZER_FILES

    if os.path.isdir(path) and not _weights_in(path) and not any(
        os.path.isfile(os.path.join(path, name)) for name in ("config.json", "params.json", "model_index.json")
    ):
        if not any(os.path.isfile(os.path.join(path, name)) for name in TOKENIZER_FILES):
            raise TokenizerNotFoundError(
                f"{path} holds neither text encoder weights nor tokenizer files ({', '.join(TOKENIZER_FILES)}). "
                "Give the encoder's file or folder."
            )
        return resolve_tokenizer(path, allow_network=allow_network)
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
