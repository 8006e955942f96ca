"""The wiring guards: conditioning of one FLUX.2 variant reaching another's transformer stops the sampler
before its first step, naming both sides. Checked on the real dimensions (shape-only, meta device) and
end to end in the host on tiny models."""

from __future__ import annotations

import pytest
import torch

from comfyui_flux2dev.devtools.tiny.geometry import TINY_VARIANTS
from comfyui_flux2dev.errors import VariantMismatchError
from comfyui_flux2dev.loaders.models.transformer import check_conditioning_width
from comfyui_flux2dev.loaders.models.transformer_layout import geometry_from_shapes, variant_for_geometry
from comfyui_flux2dev.loaders.models.variants import VARIANTS

DEV, KLEIN_4B, KLEIN_9B = VARIANTS
# The diffusers configs of the published transformers (only the geometry differs).
REAL_CONFIGS = {
    "dev": dict(num_layers=8, num_single_layers=48, num_attention_heads=48, joint_attention_dim=15360,
                guidance_embeds=True),
    "klein-4b": dict(num_layers=5, num_single_layers=20, num_attention_heads=24, joint_attention_dim=7680,
                     guidance_embeds=False),
    "klein-9b": dict(num_layers=8, num_single_layers=24, num_attention_heads=32, joint_attention_dim=12288,
                     guidance_embeds=False),
}


def real_shapes(key):
    from diffusers import Flux2Transformer2DModel

    with torch.device("meta"):  # 32B parameters, no memory
        model = Flux2Transformer2DModel(**REAL_CONFIGS[key])
    return {k: tuple(t.shape) for k, t in model.state_dict().items()}


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: v.key)
def test_real_transformers_are_told_apart_by_shape(variant):
    assert variant_for_geometry(*geometry_from_shapes(real_shapes(variant.key))) == variant


@pytest.mark.parametrize(
    "width, variant, text",
    [
        (7680, DEV, "The conditioning is 7680 wide (the Qwen3-4B encoder of FLUX.2 Klein 4B) but this FLUX.2 [dev] "
                    "transformer expects 15360 (the Mistral-Small 24B encoder of FLUX.2 [dev]). Encode the prompt with "
                    "the text encoder that belongs to FLUX.2 [dev]; encoders of different FLUX.2 variants do not mix."),
        (15360, KLEIN_4B, "The conditioning is 15360 wide (the Mistral-Small 24B encoder of FLUX.2 [dev]) but this "
                          "FLUX.2 Klein 4B transformer expects 7680 (the Qwen3-4B encoder of FLUX.2 Klein 4B). Encode "
                          "the prompt with the text encoder that belongs to FLUX.2 Klein 4B; encoders of different "
                          "FLUX.2 variants do not mix."),
        (12288, KLEIN_4B, "The conditioning is 12288 wide (the Qwen3-8B encoder of FLUX.2 Klein 9B) but this FLUX.2 "
                          "Klein 4B transformer expects 7680 (the Qwen3-4B encoder of FLUX.2 Klein 4B). Encode "
                          "the prompt with the text encoder that belongs to FLUX.2 Klein 4B; encoders of different "
                          "FLUX.2 variants do not mix."),
        (7680, KLEIN_9B, "The conditioning is 7680 wide (the Qwen3-4B encoder of FLUX.2 Klein 4B) but this FLUX.2 "
                         "Klein 9B transformer expects 12288 (the Qwen3-8B encoder of FLUX.2 Klein 9B). Encode the "
                         "prompt with the text encoder that belongs to FLUX.2 Klein 9B; encoders of different FLUX.2 "
                         "variants do not mix."),
    ],
)
def test_cross_wiring_on_real_dimensions(width, variant, text):
    with pytest.raises(VariantMismatchError) as e:
        check_conditioning_width(width, variant)
    assert str(e.value) == text


def test_unknown_conditioning_width_fails_closed():
    with pytest.raises(VariantMismatchError) as e:
        check_conditioning_width(4096, DEV)  # FLUX.1's T5-XXL
    assert str(e.value).startswith(
        "The conditioning is 4096 wide, which no FLUX.2 text encoder gives (FLUX.2 [dev] 15360, FLUX.2 Klein 4B 7680, "
        "FLUX.2 Klein 9B 12288, "
    )
    assert str(e.value).endswith(
        "): it comes from the encoder of another model family (FLUX.1 or other), but this FLUX.2 [dev] transformer "
        "expects 15360 (the Mistral-Small 24B encoder of FLUX.2 [dev]). Encode the prompt with the text encoder that "
        "belongs to FLUX.2 [dev]."
    )


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: v.key)
def test_matching_width_passes(variant):
    check_conditioning_width(variant.context_in_dim, variant)


# --- end to end in the host, tiny models -------------------------------------------------------------


@pytest.fixture(scope="module")
def parts(tiny_part):
    transformers, _ = tiny_part("diffusion_models")
    pipelines, _ = tiny_part("diffusers")
    return transformers, pipelines


@pytest.fixture(scope="module")
def models(comfy_host, parts):
    from comfyui_flux2dev.host.model import load_model

    transformers, _ = parts
    return {v.key: load_model(transformers / f"flux2-{v.key}-tiny.safetensors", dtype=torch.float32)
            for v in TINY_VARIANTS}


@torch.no_grad()
def klein_conditioning(pipeline):
    """What a Klein pipeline's own Qwen3 encoder gives: hidden states 9, 18, 27 side by side (diffusers)."""
    from transformers import AutoTokenizer, Qwen3ForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(str(pipeline / "tokenizer"))
    encoder = Qwen3ForCausalLM.from_pretrained(str(pipeline / "text_encoder"), dtype=torch.float32)
    ids = tokenizer("a red cube", return_tensors="pt").input_ids
    hidden = encoder(ids, output_hidden_states=True).hidden_states
    return torch.cat([hidden[i] for i in TINY_VARIANTS[1].encoder_layers], dim=-1)


@pytest.fixture(scope="module")
def conditionings(comfy_host, parts):
    from comfyui_flux2dev.host.clip import load_clip

    _, pipelines = parts
    clip = load_clip(str(pipelines / "flux2-dev-tiny-pipeline"), padding="comfy")
    return {
        "dev": clip.encode_from_tokens_scheduled(clip.tokenize("a red cube")),
        "klein-4b": [[klein_conditioning(pipelines / "flux2-klein-4b-tiny-pipeline"), {"pooled_output": None}]],
        "klein-9b": [[klein_conditioning(pipelines / "flux2-klein-9b-tiny-pipeline"), {"pooled_output": None}]],
    }


def sample(model, conditioning, steps=None):
    """One euler step; returns how many steps ran (each also recorded in `steps`), or raises what the
    sampler raised."""
    import comfy.sample

    steps = [] if steps is None else steps
    latent = torch.zeros(1, 128, 2, 2)
    noise = torch.randn(latent.shape, generator=torch.Generator().manual_seed(0))
    positive = [[c, {**opts, "guidance": 4.0}] for c, opts in conditioning]
    comfy.sample.sample(model, noise, 1, 1.0, "euler", "simple", positive, positive, latent,
                        callback=lambda *a: steps.append(a), disable_pbar=True, seed=0)
    return len(steps)


@pytest.mark.parametrize("key", [v.key for v in TINY_VARIANTS])
def test_matching_parts_sample(models, conditionings, key):
    assert sample(models[key], conditionings[key]) == 1


@pytest.mark.parametrize(
    "source, target",
    [("klein-4b", "dev"), ("dev", "klein-4b"), ("klein-9b", "klein-4b"), ("klein-4b", "klein-9b"), ("klein-9b", "dev")],
)
def test_cross_wired_conditioning_stops_before_the_first_step(models, conditionings, source, target):
    by_key = {v.key: v for v in TINY_VARIANTS}
    src, dst = by_key[source], by_key[target]
    steps = []
    with pytest.raises(VariantMismatchError) as e:
        sample(models[target], conditionings[source], steps)
    assert steps == []  # the sampler's callback never ran: it stopped before the first step
    assert str(e.value) == (
        f"The conditioning is {src.context_in_dim} wide (the {src.encoder_name} encoder of {src.name}) but this "
        f"{dst.name} transformer expects {dst.context_in_dim} (the {dst.encoder_name} encoder of {dst.name}). Encode "
        f"the prompt with the text encoder that belongs to {dst.name}; encoders of different FLUX.2 variants do not "
        "mix."
    )
