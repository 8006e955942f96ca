"""The FLUX.2 variant table: the one place that knows the numbers of [dev] and Klein.

Every detector, guard and message reads these rows. Tiny rows stand in for the real models in the tests
and the demo; they are known only while FLUX2DEV_TINY_MODELS=1 is set, so a real install still fails
closed on any geometry it does not know.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

TINY_MODELS_ENV = "FLUX2DEV_TINY_MODELS"


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
    tiny: bool = False

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
TINY_VARIANTS = (
    Flux2Variant("dev", "FLUX.2 [dev] (tiny test model)", "tiny Mistral", 64, (10, 20, 30), 256, 2, 2, 2, True, True),
    Flux2Variant("klein-4b", "FLUX.2 Klein 4B (tiny test model)", "tiny Qwen3", 32, (9, 18, 27), 128, 1, 1, 2, False, True),
    Flux2Variant("klein-9b", "FLUX.2 Klein 9B (tiny test model)", "tiny Qwen3", 48, (9, 18, 27), 256, 2, 1, 2, False, True),
)

MISTRAL_SMALL = MistralEncoderGeometry(width=5120, heads=32, kv_heads=8, mlp=32768)
TINY_MISTRAL = MistralEncoderGeometry(width=64, heads=2, kv_heads=1, mlp=128)
# `flux2dev bench` measures the conditioning cache at Mistral-Small's real width with 3 layers, which fit a test
# machine (4.7 GB in bf16). Known under the tiny switch like TINY_MISTRAL; its [dev] row reads hidden states
# 1, 2, 3 so the conditioning is 15360 wide as real [dev]'s. The row stays out of TINY_VARIANTS: it has no
# transformer, and the lookups by conditioning width or key must keep finding real or tiny [dev].
BENCH_MISTRAL = MistralEncoderGeometry(width=5120, heads=32, kv_heads=8, mlp=32768, layers=(3,))
BENCH_DEV = Flux2Variant("dev", "FLUX.2 [dev] (benchmark encoder, 3 layers)", "Mistral-Small 24B (3 layers)", 5120,
                         (1, 2, 3), 6144, 48, 8, 48, True, True)
# Encoder geometry -> the [dev] row whose conditioning it makes.
DEV_VARIANTS_BY_ENCODER = {MISTRAL_SMALL: VARIANTS[0], TINY_MISTRAL: TINY_VARIANTS[0], BENCH_MISTRAL: BENCH_DEV}


def tiny_models_enabled() -> bool:
    return os.environ.get(TINY_MODELS_ENV) == "1"


def tiny_hint(is_tiny: bool) -> str:
    """What to add to an unknown-geometry error when the shapes are those of the tiny test models."""
    if not is_tiny or tiny_models_enabled():
        return ""
    return (
        f" These are the shapes of the pack's tiny test models (written by `flux2dev tiny`), which ComfyUI loads "
        f"only when started with {TINY_MODELS_ENV}=1."
    )


def known_variants() -> tuple[Flux2Variant, ...]:
    return VARIANTS + (TINY_VARIANTS if tiny_models_enabled() else ())


def known_mistral_encoders() -> tuple[MistralEncoderGeometry, ...]:
    return (MISTRAL_SMALL,) + ((TINY_MISTRAL, BENCH_MISTRAL) if tiny_models_enabled() else ())


def variant_for_transformer(context_in_dim: int, hidden_size: int, guidance: bool) -> Flux2Variant | None:
    for v in known_variants():
        if (v.context_in_dim, v.hidden_size, v.guidance) == (context_in_dim, hidden_size, guidance):
            return v
    return None


def variant_for_conditioning(width: int) -> Flux2Variant | None:
    for v in known_variants():
        if v.context_in_dim == width:
            return v
    return None


def variant_by_key(key: str, tiny: bool = False) -> Flux2Variant:
    for v in VARIANTS + TINY_VARIANTS:
        if v.key == key and v.tiny == tiny:
            return v
    raise KeyError(key)


def dev_variant_for_encoder(geometry: MistralEncoderGeometry) -> Flux2Variant:
    return DEV_VARIANTS_BY_ENCODER[geometry]


def layers_kept(geometry: MistralEncoderGeometry) -> int:
    """How many layers of the encoder FLUX.2 [dev] runs: hidden_states[i] is layer i-1's output, so layers
    0..max(encoder_layers)-1 (real and tiny: 30; the benchmark encoder: 3)."""
    return max(dev_variant_for_encoder(geometry).encoder_layers)
