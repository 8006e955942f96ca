"""FLUX.2 transformers from BFL files, sharded diffusers folders and scaled fp8 files, against diffusers'
Flux2Transformer2DModel on the same weights."""

from __future__ import annotations

import pytest
import torch

from comfyui_flux2dev.devtools.tiny.geometry import TINY_VARIANTS
from comfyui_flux2dev.devtools.tiny.transformers import FP8_SPELLINGS
from comfyui_flux2dev.errors import MissingWeightsError, UnknownModelError, WrongModelError
from comfyui_flux2dev.loaders.models.transformer_layout import (
    geometry_from_shapes,
    identify_transformer,
    variant_for_geometry,
)
from helpers import fp8_weights


def entries_of(part, **match):
    return [e for e in part[1] if all(e[k] == v for k, v in match.items())]


def diffusers_reference(folder):
    from diffusers import Flux2Transformer2DModel

    return Flux2Transformer2DModel.from_pretrained(str(folder), dtype=torch.float32).eval()


def positions(h, w, text_len):
    img = torch.zeros(h, w, 4)
    img[..., 1] = torch.arange(h)[:, None]
    img[..., 2] = torch.arange(w)[None]
    txt = torch.zeros(text_len, 4)
    txt[:, 3] = torch.arange(text_len)
    return img.reshape(-1, 4), txt


def inputs(variant, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, 128, 4, 6, generator=g)
    context = torch.randn(1, 7, variant.context_in_dim, generator=g)
    return x, torch.tensor([0.6]), context, torch.tensor([4.0]) if variant.guidance else None


def inputs_on(device, variant):
    return [None if t is None else t.to(device) for t in inputs(variant)]


@torch.no_grad()
def reference_output(ref, variant, device):
    x, t, context, guidance = inputs_on(device, variant)
    img_ids, txt_ids = positions(4, 6, context.shape[1])
    out = ref.to(device)(hidden_states=x.flatten(2).transpose(1, 2), encoder_hidden_states=context, timestep=t,
                         img_ids=img_ids.to(device), txt_ids=txt_ids.to(device), guidance=guidance).sample
    return out.transpose(1, 2).reshape(x.shape).cpu()


@torch.no_grad()
def host_output(patcher, variant, device):
    """The host model's output with the host's own load onto `device`, on the CPU."""
    patcher.patch_model(device_to=device)
    x, t, context, guidance = inputs_on(device, variant)
    try:
        return patcher.model.diffusion_model(x, t, context, guidance=guidance).cpu()
    finally:
        patcher.unpatch_model(device_to=torch.device("cpu"))


def bfl_to_diffusers(bfl):
    """diffusers' own converter: an independent check of the pack's table (it reads BFL the other way)."""
    from diffusers.loaders.single_file_utils import convert_flux2_transformer_checkpoint_to_diffusers

    return convert_flux2_transformer_checkpoint_to_diffusers(dict(bfl))


@pytest.mark.parametrize("variant", TINY_VARIANTS, ids=lambda v: v.key)
def test_tiny_files_are_what_they_claim(tiny_transformers, variant):
    from safetensors.torch import load_file

    root, _ = tiny_transformers
    (bfl,) = entries_of(tiny_transformers, variant=variant.key, layout="BFL", format="bf16")
    (folder,) = entries_of(tiny_transformers, variant=variant.key, layout="diffusers")
    ref = diffusers_reference(root / folder["path"])
    assert (root / folder["path"] / "diffusion_pytorch_model.safetensors.index.json").is_file()  # sharded
    assert ref.config.joint_attention_dim == variant.context_in_dim and ref.config.guidance_embeds == variant.guidance
    converted = bfl_to_diffusers({k: v.float() for k, v in load_file(str(root / bfl["path"])).items()})
    expected = ref.state_dict()
    assert converted.keys() == expected.keys()
    for key in expected:
        assert torch.equal(converted[key], expected[key]), key


def test_fp8_files_hold_the_bf16_model_quantized(tiny_transformers):
    from safetensors.torch import load_file

    root, _ = tiny_transformers
    (bf16,) = entries_of(tiny_transformers, variant="dev", layout="BFL", format="bf16")
    exact = {k: v.float() for k, v in load_file(str(root / bf16["path"])).items()}
    for spelling in FP8_SPELLINGS:
        (entry,) = [e for e in entries_of(tiny_transformers, format="fp8-scaled") if spelling in e["path"]]
        stored = load_file(str(root / entry["path"]))
        assert any(k.endswith(f".{FP8_SPELLINGS[spelling][0]}") for k in stored)
        assert stored["double_blocks.0.img_attn.qkv.weight"].dtype == torch.float8_e4m3fn
        approx = fp8_weights(root / entry["path"], spelling)
        assert approx.keys() == exact.keys()
        for key in exact:
            assert torch.allclose(approx[key], exact[key], rtol=0.07, atol=1e-6), key


@pytest.mark.parametrize("layout", ["BFL", "diffusers"])
@pytest.mark.parametrize("variant", TINY_VARIANTS, ids=lambda v: v.key)
def test_model_matches_diffusers(comfy_host, tiny_transformers, variant, layout, device):
    from comfyui_flux2dev.host.model import load_model

    root, _ = tiny_transformers
    (entry,) = entries_of(tiny_transformers, variant=variant.key, layout=layout, format="bf16")
    (folder,) = entries_of(tiny_transformers, variant=variant.key, layout="diffusers")
    patcher = load_model(root / entry["path"], dtype=torch.float32)
    assert patcher.model.diffusion_model.params.num_heads == variant.num_heads
    expected = reference_output(diffusers_reference(root / folder["path"]), variant, device)
    got = host_output(patcher, variant, device)
    assert expected.abs().max() > 0.1  # a real output, not a degenerate one
    assert (got - expected).abs().max() <= 1e-4


@pytest.mark.parametrize("spelling", list(FP8_SPELLINGS))
def test_fp8_model_matches_diffusers_on_dequantized_weights(comfy_host, tiny_transformers, spelling, device):
    from diffusers import Flux2Transformer2DModel

    from comfyui_flux2dev.host.model import load_model

    root, _ = tiny_transformers
    variant = next(v for v in TINY_VARIANTS if v.key == "dev")
    (entry,) = [e for e in entries_of(tiny_transformers, format="fp8-scaled") if spelling in e["path"]]
    (folder,) = entries_of(tiny_transformers, variant="dev", layout="diffusers")
    ref = Flux2Transformer2DModel.from_config(Flux2Transformer2DModel.load_config(str(root / folder["path"])))
    ref.load_state_dict(bfl_to_diffusers(fp8_weights(root / entry["path"], spelling)), strict=True)
    patcher = load_model(root / entry["path"], dtype=torch.float32)
    layer = patcher.model.diffusion_model.single_blocks[0].linear1
    assert layer.weight.dtype == torch.float8_e4m3fn  # stays fp8 in memory
    got, expected = host_output(patcher, variant, device), reference_output(ref.eval(), variant, device)
    assert (got - expected).abs().max() <= 1e-4


def meta_shapes(**config):
    from diffusers import Flux2Transformer2DModel

    with torch.device("meta"):
        model = Flux2Transformer2DModel(**config)
    return {k: tuple(t.shape) for k, t in model.state_dict().items()}


def test_unknown_geometry_fails_closed_naming_the_shapes():
    shapes = meta_shapes(num_layers=1, num_single_layers=1, num_attention_heads=1, joint_attention_dim=200)
    with pytest.raises(UnknownModelError) as e:
        variant_for_geometry(*geometry_from_shapes(shapes))
    assert str(e.value).startswith(
        "Unknown FLUX.2 transformer geometry: x_embedder.weight [128, 128], context_embedder.weight [128, 200], "
        "a guidance embedder, 1 double and 1 single blocks. Known: FLUX.2 [dev]: hidden 6144, context 15360, "
        "with guidance;"
    )


def test_a_flux1_transformer_is_named():
    shapes = {"img_in.weight": (3072, 64), "txt_in.weight": (3072, 4096), "vector_in.in_layer.weight": (3072, 768)}
    with pytest.raises(WrongModelError,
                       match=r"^This is not a FLUX.2 transformer: it lacks double_stream_modulation_img"):
        geometry_from_shapes(shapes)


def test_a_truncated_transformer_is_refused_before_reading(tiny_transformers, tmp_path):
    from safetensors.torch import load_file, save_file

    root, _ = tiny_transformers
    (entry,) = entries_of(tiny_transformers, variant="dev", layout="BFL", format="bf16")
    sd = {k: v for k, v in load_file(str(root / entry["path"])).items() if not k.startswith("single_blocks.1.")}
    save_file(sd, str(tmp_path / "cut.safetensors"))
    with pytest.raises(MissingWeightsError, match=r"has 2 double and 2 single blocks\. The file is incomplete"):
        identify_transformer(tmp_path / "cut.safetensors")


def test_a_missing_tensor_is_never_zero_filled(comfy_host, tiny_transformers, tmp_path):
    from safetensors.torch import load_file, save_file

    from comfyui_flux2dev.host.model import load_model

    root, _ = tiny_transformers
    (entry,) = entries_of(tiny_transformers, variant="klein-4b", layout="BFL", format="bf16")
    sd = load_file(str(root / entry["path"]))
    del sd["double_blocks.0.txt_mlp.2.weight"]
    save_file(sd, str(tmp_path / "holed.safetensors"))
    with pytest.raises(MissingWeightsError,
                       match=r"lacks 1 tensor\(s\) \(double_blocks\.0\.txt_mlp\.2\.weight\); the file is incomplete"):
        load_model(tmp_path / "holed.safetensors", dtype=torch.float32)
