"""How far one model's outputs are from another's (`flux2dev compare`'s figures): two text encoders' FLUX.2
conditioning for the same prompts, or two transformers' outputs for the same seeded inputs at a few timesteps,
each model loaded by the pack as a node would load it, run, and unloaded before the other is loaded."""

from __future__ import annotations

import gc
from pathlib import Path

import torch

from ..errors import VariantMismatchError
from ..loaders.convert.identity import distances, figure
from ..loaders.models import progress
from ..tokenizers.prompt import PADDING_MODES
from . import compat, ensure_comfy

# The prompts when none are given: short and long, plain and with the template's markers and a non-Latin script.
PROMPTS = (
    "a red fox sitting in fresh snow at dawn",
    "A lighthouse on a cliff at dusk, oil painting, thick brush strokes, warm light from the lamp",
    "macro photo of a dew drop on a spider web, shallow depth of field",
    "Ein Café in Wien, 1910: Zeitungen, Marmortische [IMG] und ein Kellner",
    "東京の夜の街、ネオンの看板、雨に濡れた路面",
)
SEED = 0
LATENT = (128, 8, 8)  # the transformer's input: 128 channels (32 latent channels 2x2-patchified), 8x8 positions
TEXT_TOKENS = 16
TIMESTEPS = (0.9, 0.5, 0.1)
GUIDANCE = 4.0  # the reference's default for [dev]


def figures(a: torch.Tensor, b: torch.Tensor) -> dict:
    """cosine similarity (None where an output is all zeros: it has no direction), and the distances of B from A
    (identity.distances), in float64; any figure None where an output holds NaN or infinities."""
    a, b = a.double().reshape(-1), b.double().reshape(-1)
    return {"cosine": figure((a @ b) / (a.norm() * b.norm())), **distances(a, b)}


def worst(rows: list[dict]) -> dict | None:
    """The row of the lowest cosine, a row whose cosine is undefined before any (nothing vouches for its
    outputs); None where no row has figures."""
    ranked = [r for r in rows if "cosine" in r]
    return min(ranked, key=lambda r: (r["cosine"] is not None, r["cosine"] or 0.0)) if ranked else None


def _conditionings(path: str, prompts: list[str], padding: str) -> list[torch.Tensor]:
    from .clip import load_clip
    from .clip_weights import release_weights

    clip = load_clip(path, padding=padding)
    try:
        return [clip.encode_from_tokens(clip.tokenize(p)).float().cpu() for p in progress.tracked(prompts)]
    finally:
        release_weights(clip)
        del clip
        gc.collect()


def encoder_parity(a: str, b: str, prompts: list[str], padding: str = PADDING_MODES[0]) -> dict:
    """Per prompt, the figures of B's conditioning against A's, and the worst prompt (lowest cosine)."""
    conds_a = _conditionings(a, prompts, padding)
    conds_b = _conditionings(b, prompts, padding)
    rows = []
    for prompt, x, y in zip(prompts, conds_a, conds_b):
        if x.shape != y.shape:  # different tokenizers cut the prompt differently
            rows.append({"prompt": prompt, "shapes": [list(x.shape), list(y.shape)]})
            continue
        rows.append({"prompt": prompt, **figures(x, y)})
    return {"what": f"conditioning ({padding} padding)", "rows": rows, "worst": worst(rows)}


def _load(path: str):
    from .model import load_gguf_model, load_model

    return load_gguf_model(path) if Path(path).suffix.lower() == ".gguf" else load_model(path)


def _outputs(path: str) -> tuple[str, list[torch.Tensor]]:
    ensure_comfy()
    import comfy.model_management

    patcher = _load(path)
    variant = patcher.model.flux2_variant
    g = torch.Generator().manual_seed(SEED)
    x = torch.randn(1, *LATENT, generator=g)
    context = torch.randn(1, TEXT_TOKENS, variant.context_in_dim, generator=g)
    guidance = torch.tensor([GUIDANCE]) if variant.guidance else None
    try:
        comfy.model_management.load_models_gpu([patcher])
        device, dtype = patcher.load_device, compat.inference_dtype(patcher.model)
        outs = []
        with torch.no_grad():
            for t in progress.tracked(TIMESTEPS):
                out = patcher.model.diffusion_model(x.to(device, dtype), torch.tensor([t], device=device),
                                                    context.to(device, dtype),
                                                    guidance=None if guidance is None else guidance.to(device))
                outs.append(out.float().cpu())
        return variant.key, outs
    finally:
        compat.unload_held(patcher.model)
        del patcher
        gc.collect()


def transformer_parity(a: str, b: str) -> dict:
    """Per timestep, the figures of B's output against A's for the same seeded latent, text and guidance."""
    variant_a, outs_a = _outputs(a)
    variant_b, outs_b = _outputs(b)
    if variant_a != variant_b:
        raise VariantMismatchError(f"{a} is a FLUX.2 {variant_a} transformer and {b} a {variant_b} one; their outputs "
                                   "cannot be compared (they take conditioning of different widths).")
    rows = [{"timestep": t, **figures(x, y)} for t, x, y in zip(TIMESTEPS, outs_a, outs_b)]
    return {"what": f"transformer output (seed {SEED}, latent {list(LATENT)}, {TEXT_TOKENS} text tokens)", "rows": rows,
            "worst": worst(rows)}
