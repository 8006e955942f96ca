"""The FLUX.2 variant table: the one place that knows the numbers of [dev] and Klein.

Every detector, guard and message reads these rows. Only real models are in the table. Test models (the
tiny ones the dev tools write, and the benchmark's encoder) declare their geometry in a file that the
FLUX2DEV_TINY_MODELS environment variable names; without it a real install fails closed on any geometry
it does not know.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, fields

from ...errors import UnknownModelError
from ..formats.files import read_json
from ..formats.validate import Field, checked

TEST_MODELS_ENV = "FLUX2DEV_TINY_MODELS"  # the path of a test models' declaration file (DECLARATION_FIELDS)


@dataclass(frozen=True)
class Flux2Variant:
    key: str  # the manifest's word: "dev", "klein-4b", "klein-9b"
    name: str  # what the user reads
    encoder_name: str
    encoder_width: int
    encoder_layers: tuple[int, int, int]  # indices into HF hidden_states
    hidden_size: int
    num_heads: int
    double_blocks: int
    single_blocks: int
    guidance: bool
    tiny: bool = False  # a test model's row (declared in a file)

    @property
    def context_in_dim(self) -> int:
        return 3 * self.encoder_width


@dataclass(frozen=True)
class MistralEncoderGeometry:
    """The Mistral-Small text encoder of a [dev] row (Klein rows use Qwen3, which the pack never loads)."""

    width: int
    heads: int
    kv_heads: int
    mlp: int
    vocab: int = 131072
    head_dim: int = 128
    layers: tuple[int, ...] = (30, 40)  # the pruned and the full model
    rope_theta: float = 1e9
    rms_norm_eps: float = 1e-5


VARIANTS = (
    Flux2Variant("dev", "FLUX.2 [dev]", "Mistral-Small 24B", 5120, (10, 20, 30), 6144, 48, 8, 48, True),
    Flux2Variant("klein-4b", "FLUX.2 Klein 4B", "Qwen3-4B", 2560, (9, 18, 27), 3072, 24, 5, 20, False),
    Flux2Variant("klein-9b", "FLUX.2 Klein 9B", "Qwen3-8B", 4096, (9, 18, 27), 4096, 32, 8, 24, False),
)
MISTRAL_SMALL = MistralEncoderGeometry(width=5120, heads=32, kv_heads=8, mlp=32768)
# Encoder geometry -> the [dev] row whose conditioning it makes.
DEV_VARIANTS_BY_ENCODER = {MISTRAL_SMALL: VARIANTS[0]}


# --- test models, declared in a file -------------------------------------------------------------------

_INT = Field(int, lo=1, hi=1 << 20)
_NAME = Field(str, max_len=200)
_LAYERS = Field(list, max_len=8)
VARIANT_FIELDS = {
    "key": Field(str, max_len=32), "name": _NAME, "encoder_name": _NAME, "encoder_width": _INT,
    "encoder_layers": _LAYERS, "hidden_size": _INT, "num_heads": _INT, "double_blocks": _INT, "single_blocks": _INT,
    "guidance": Field(bool),
}
ENCODER_FIELDS = {
    "width": _INT, "heads": _INT, "kv_heads": _INT, "mlp": _INT, "vocab": _INT, "head_dim": _INT, "layers": _LAYERS,
    "rope_theta": Field(float, lo=1, hi=1e15), "rms_norm_eps": Field(float, lo=0, hi=1),
    "dev_variant": Field(dict, fields=VARIANT_FIELDS),  # the [dev] row whose conditioning it makes
}
DECLARATION_FIELDS = {
    "variants": Field(list, max_len=16),  # each VARIANT_FIELDS
    "mistral_encoders": Field(list, max_len=16),  # each ENCODER_FIELDS
}


@dataclass(frozen=True)
class DeclaredModels:
    variants: tuple[Flux2Variant, ...] = ()
    dev_by_encoder: tuple[tuple[MistralEncoderGeometry, Flux2Variant], ...] = ()


def declaration_of(variants: tuple[Flux2Variant, ...], dev_by_encoder: dict) -> dict:
    """The declaration file's content for these test rows (what the dev tools write)."""
    def row(v: Flux2Variant) -> dict:
        return {f.name: getattr(v, f.name) for f in fields(v) if f.name != "tiny"}

    return {"variants": [row(v) for v in variants],
            "mistral_encoders": [{**{f.name: getattr(g, f.name) for f in fields(g)}, "dev_variant": row(v)}
                                 for g, v in dev_by_encoder.items()]}


def _variant(doc: dict, where: str) -> Flux2Variant:
    doc = checked(doc, VARIANT_FIELDS, where)
    if len(doc["encoder_layers"]) != 3 or not all(isinstance(i, int) and 0 < i < 1024 for i in doc["encoder_layers"]):
        raise UnknownModelError(f"{where}: encoder_layers must be three layer numbers.")
    return Flux2Variant(**{**doc, "encoder_layers": tuple(doc["encoder_layers"])}, tiny=True)


def _encoder(doc: dict, where: str) -> tuple[MistralEncoderGeometry, Flux2Variant]:
    doc = checked(doc, ENCODER_FIELDS, where)
    if not all(isinstance(i, int) and 0 < i < 1024 for i in doc["layers"]):
        raise UnknownModelError(f"{where}: layers must be layer counts.")
    geometry = {k: v for k, v in doc.items() if k != "dev_variant"}
    return MistralEncoderGeometry(**{**geometry, "layers": tuple(doc["layers"])}), _variant(doc["dev_variant"], where)


@functools.lru_cache(maxsize=4)
def _read_declaration(path: str, stamp: tuple) -> DeclaredModels:
    doc = read_json(path, DECLARATION_FIELDS)
    return DeclaredModels(tuple(_variant(v, path) for v in doc["variants"]),
                      tuple(_encoder(e, path) for e in doc["mistral_encoders"]))


def declared_models() -> DeclaredModels:
    """The test models FLUX2DEV_TINY_MODELS declares (none when it is unset)."""
    path = os.environ.get(TEST_MODELS_ENV, "")
    if not path:
        return DeclaredModels()
    try:
        s = os.stat(path)
    except OSError:
        raise UnknownModelError(
            f"{TEST_MODELS_ENV} is {path!r}, which is no file: it names the declaration of the pack's tiny test "
            "models (flux2dev-tiny-models.json, written beside them by `python -m comfyui_flux2dev.devtools tiny`). "
            f"Unset {TEST_MODELS_ENV} to load real models only."
        ) from None
    return _read_declaration(path, (s.st_mtime_ns, s.st_size, s.st_ino))


def known_variants() -> tuple[Flux2Variant, ...]:
    return VARIANTS + declared_models().variants


def _dev_by_encoder() -> dict[MistralEncoderGeometry, Flux2Variant]:
    return {**DEV_VARIANTS_BY_ENCODER, **dict(declared_models().dev_by_encoder)}


def known_mistral_encoders() -> tuple[MistralEncoderGeometry, ...]:
    return tuple(_dev_by_encoder())


def variant_for_transformer(context_in_dim: int, hidden_size: int, guidance: bool,
                            blocks: tuple[int, int] | None = None) -> Flux2Variant | None:
    """The variant of these widths; of several (a test row of a real row's widths), the one with these (double,
    single) block counts where one has them."""
    widths = (context_in_dim, hidden_size, guidance)
    found = [v for v in known_variants() if (v.context_in_dim, v.hidden_size, v.guidance) == widths]
    return next((v for v in found if (v.double_blocks, v.single_blocks) == blocks), found[0] if found else None)


def variant_for_conditioning(width: int) -> Flux2Variant | None:
    for v in known_variants():
        if v.context_in_dim == width:
            return v
    return None


def variant_by_key(key: str, tiny: bool = False) -> Flux2Variant:
    for v in known_variants():
        if v.key == key and v.tiny == tiny:
            return v
    raise KeyError(key)


def dev_variant_for_encoder(geometry: MistralEncoderGeometry) -> Flux2Variant:
    return _dev_by_encoder()[geometry]


def layers_kept(geometry: MistralEncoderGeometry) -> int:
    """How many layers of the encoder FLUX.2 [dev] runs: hidden_states[i] is layer i-1's output, so layers
    0..max(encoder_layers)-1 (real [dev] and its tiny models: 30; the benchmark encoder: 3)."""
    return max(dev_variant_for_encoder(geometry).encoder_layers)
