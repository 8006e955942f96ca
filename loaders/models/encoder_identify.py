"""Naming and identification of a text encoder checkpoint: each stored name in the host's
MistralForCausalLM names (through a layout's key scheme), and the Mistral-Small geometry the names and
shapes say it is. Anything else fails closed, naming what it is when the names tell."""

from __future__ import annotations

from collections.abc import Callable

from ...errors import UnknownModelError, WrongModelError
from ..formats import packing
from . import variants
from .encoder_layouts import HF_SCHEME, KeyScheme
from .kinds import kind_from_names, other_checkpoint
from .node_titles import title
from .variants import MistralEncoderGeometry

EMBED = "model.embed_tokens.weight"
FINAL_NORM = "model.norm.weight"
LM_HEAD = "lm_head"  # the output head's module in the host's names
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
# Stored tensor suffix -> the host's (packing.SPELLINGS for packed companions); None: read past.
SUFFIXES = {"weight": "weight", **packing.SPELLINGS}
# Names other than the model's some files carry; what the pack says when such a file is picked here.
OTHER_KINDS = {
    "transformer": "This is a FLUX.2 diffusion transformer, not a text encoder. Load it with "
    f"{title('Flux2DevTransformerSource')} or {title('Flux2DevGGUFTransformerLoader')}, and pick a Mistral-Small "
    "text encoder (e.g. mistral_3_small_flux2_bf16.safetensors) here.",
    "vae": f"This is a VAE (autoencoder), not a text encoder. Load it with {title('Flux2DevVAESource')} or Load VAE, "
    "and pick a Mistral-Small text encoder (e.g. mistral_3_small_flux2_bf16.safetensors) here.",
}
PICK = "Pick a FLUX.2 [dev] encoder (mistral_3_small_flux2_*.safetensors or a Mistral-Small-3.x folder)"
MAX_LAYER_DIGITS = 6  # a layer number longer than this is no real model's
SMALLEST_MISTRAL_VOCAB = 100000  # Llama-family vocabularies (32000, 128256 is Llama 3's) fall below Tekken's 131072


def host_name(stored: str, scheme: KeyScheme) -> tuple[str | None, int | None]:
    """(host name, layer index) of one stored tensor name, or (None, None) when the pack never uses it.
    A host name of "" means a companion tensor that is read past on purpose (input scales, declarations).
    The final norm and the output head are named too; only text generation reads them."""
    whole, _, suffix = stored.rpartition(".")
    if whole in scheme.lm_head and suffix in SUFFIXES:
        return (f"{LM_HEAD}.{SUFFIXES[suffix]}" if SUFFIXES[suffix] else ""), None
    prefix = next((p for p in scheme.prefixes if stored.startswith(p)), None)
    if prefix is None:
        return None, None
    module, _, suffix = stored[len(prefix):].rpartition(".")
    if suffix not in SUFFIXES:
        return None, None
    mapped = SUFFIXES[suffix]
    if module == scheme.embed:  # the table, or a companion of its packing
        return (EMBED.removesuffix("weight") + mapped if mapped else ""), None
    if module == scheme.final_norm:
        return (FINAL_NORM if mapped == "weight" else None), None
    head, _, tail = module.partition(".")
    if head != scheme.layer_word:
        return None, None
    index, _, part = tail.partition(".")
    # ASCII digits only ("²" is a digit int() refuses), and no more than any real model has layers
    if not (index.isascii() and index.isdigit() and len(index) <= MAX_LAYER_DIGITS) or part not in scheme.parts:
        return None, None
    layer = int(index)  # "007" is layer 7, so a file holding both is caught as ambiguous
    if mapped is None:
        return "", layer
    return f"model.layers.{layer}.{scheme.parts[part]}.{mapped}", layer


def _embed_shape(shapes: dict[str, tuple[int, ...]], scheme: KeyScheme) -> tuple[int, ...] | None:
    """The embedding table's [vocabulary, width], or None when there is none; any other shape is refused."""
    shape = next((shape for name, shape in shapes.items() if host_name(name, scheme)[0] == EMBED), None)
    if shape is not None and (len(shape) != 2 or 0 in shape):
        raise UnknownModelError(
            f"This text encoder's embedding table has shape {list(shape)}, but an embedding table is [vocabulary, "
            f"width], neither empty. The file is damaged or not a text encoder. {PICK}."
        )
    return shape


def _what_else(shapes: dict[str, tuple[int, ...]], scheme: KeyScheme) -> None:
    """Raise WrongModelError when the names say the file is some other known model."""
    names = list(shapes)
    kind = kind_from_names(names)
    if kind == "other":
        raise WrongModelError(f"This is {other_checkpoint(names)}, not a text encoder. {PICK}.")
    if kind in OTHER_KINDS:
        raise WrongModelError(OTHER_KINDS[kind])
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
    if embed and embed[0] < SMALLEST_MISTRAL_VOCAB:
        raise WrongModelError(
            f"This is a Llama-family model with a {embed[0]}-token vocabulary, not the Mistral-Small 24B encoder "
            f"(131072 tokens) FLUX.2 [dev] needs. {PICK}."
        )


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
    flat = [f"{name} {list(shape)}" for name, shape in (("q", q), ("k", k), ("gate", gate))
            if shape is not None and len(shape) != 2]
    if flat:
        raise UnknownModelError(
            f"This text encoder's layer-0 projections are not matrices ({', '.join(flat)}); the file is damaged or "
            f"not a text encoder. {PICK}."
        )
    if embed is None or q is None or k is None or gate is None:
        raise UnknownModelError(
            "This file is not a Mistral text encoder the pack knows: it lacks an embedding table or layer-0 attention "
            f"and MLP weights (found {len(shapes)} tensors, e.g. {', '.join(sorted(shapes)[:5])}). {PICK}."
        )
    found = dict(vocab=embed[0], width=embed[1], q_rows=q[0], k_rows=k[0], mlp=gate[0], layers=len(layer_ids))
    for g in variants.known_mistral_encoders():
        want = dict(vocab=g.vocab, width=g.width, q_rows=g.heads * g.head_dim, k_rows=g.kv_heads * g.head_dim,
                    mlp=g.mlp)
        if all(found[key] == value for key, value in want.items()) and found["layers"] in g.layers:
            return g, found["layers"]
    known = "; ".join(
        f"vocab {g.vocab}, width {g.width}, {g.heads} heads, {g.kv_heads} kv heads, MLP {g.mlp}, "
        f"{' or '.join(map(str, g.layers))} layers"
        for g in variants.known_mistral_encoders()
    )
    raise UnknownModelError(
        "This text encoder's geometry matches no FLUX.2 [dev] encoder: found vocab {vocab}, width {width}, "
        "q rows {q_rows}, k rows {k_rows}, MLP {mlp}, {layers} layers; expected Mistral-Small ({known}). "
        "{pick}.".format(known=known, pick=PICK, **found)
    )
