"""The geometry of the tiny test models, and of the benchmark's encoder: rows of the pack's variant table that
no real model has. The pack knows them only from the declaration file written here, which the
FLUX2DEV_TINY_MODELS environment variable names, so a real install still fails closed on them."""

from __future__ import annotations

import functools
import json
import tempfile
from pathlib import Path

from ...loaders.models.variants import TEST_MODELS_ENV, Flux2Variant, MistralEncoderGeometry, declaration_of

DECLARATION = "flux2dev-tiny-models.json"  # beside the tiny models

TINY_VARIANTS = (
    Flux2Variant("dev", "FLUX.2 [dev] (tiny test model)", "tiny Mistral", 64, (10, 20, 30), 256, 2, 2, 2, True, True),
    Flux2Variant("klein-4b", "FLUX.2 Klein 4B (tiny test model)", "tiny Qwen3", 32, (9, 18, 27), 128, 1, 1, 2, False,
                 True),
    Flux2Variant("klein-9b", "FLUX.2 Klein 9B (tiny test model)", "tiny Qwen3", 48, (9, 18, 27), 256, 2, 1, 2, False,
                 True),
)
TINY_MISTRAL = MistralEncoderGeometry(width=64, heads=2, kv_heads=1, mlp=128)
# `flux2dev bench` measures the conditioning cache at Mistral-Small's real width with 3 layers, which fit a test
# machine (4.7 GB in bf16). Its [dev] row reads hidden states 1, 2, 3, so the conditioning is 15360 wide as
# real [dev]'s; the row has no transformer, so it is no variant of its own (lookups by conditioning width or
# key keep finding real or tiny [dev]).
BENCH_MISTRAL = MistralEncoderGeometry(width=5120, heads=32, kv_heads=8, mlp=32768, layers=(3,))
BENCH_DEV = Flux2Variant("dev", "FLUX.2 [dev] (benchmark encoder, 3 layers)", "Mistral-Small 24B (3 layers)", 5120,
                         (1, 2, 3), 6144, 48, 8, 48, True, True)

# `flux2dev bench --real`'s transformer test: [dev]'s real widths with one block of each kind (1.2 GB as Q4_K_M).
BENCH_TRANSFORMER = Flux2Variant("dev", "FLUX.2 [dev] (benchmark transformer, 1 + 1 blocks)", "Mistral-Small 24B",
                                 5120, (10, 20, 30), 6144, 48, 1, 1, True, True)


def write_declaration(folder: str | Path) -> Path:
    """The declaration of the test models in `folder`: set FLUX2DEV_TINY_MODELS to this path."""
    path = Path(folder) / DECLARATION
    path.parent.mkdir(parents=True, exist_ok=True)
    declared = declaration_of((*TINY_VARIANTS, BENCH_TRANSFORMER),
                              {TINY_MISTRAL: TINY_VARIANTS[0], BENCH_MISTRAL: BENCH_DEV})
    path.write_text(json.dumps(declared, indent=1))
    return path


@functools.cache
def _own_folder() -> tempfile.TemporaryDirectory:
    """This process's temporary folder for the declaration, removed when the process ends."""
    return tempfile.TemporaryDirectory(prefix="flux2dev-tiny-models-")


def test_models_env(folder: str | Path | None = None) -> dict[str, str]:
    """The environment entry that makes a process (or a server) know the test models: FLUX2DEV_TINY_MODELS
    naming their declaration, written into `folder` (default: one temporary folder per process). The path is
    absolute: the process it is handed to may run in another folder (ComfyUI's server does)."""
    return {TEST_MODELS_ENV: str(write_declaration(folder or _own_folder().name).resolve())}
