"""The FLUX.2 VAE source: from a [dev] or a Klein pipeline, a diffusers vae/ folder or ae.safetensors, with the
full decoder or BFL's small one, the host VAE encodes and decodes as diffusers' AutoencoderKLFlux2 on the same
weights, on every host; what the host cannot build, and a decoder alone, are refused with the pack's errors."""

from __future__ import annotations

import pytest
import torch

from comfyui_flux2dev.errors import UnknownModelError, WrongModelError
from comfyui_flux2dev.loaders.models.vae import load_vae_state_dict


@pytest.fixture(scope="module")
def sources(tiny_part):
    vaes, _ = tiny_part("vae")
    pipelines, _ = tiny_part("diffusers")
    return {
        "dev pipeline": pipelines / "flux2-dev-tiny-pipeline",
        "klein pipeline": pipelines / "flux2-klein-4b-tiny-pipeline",
        "vae folder": vaes / "flux2-vae-diffusers",
        "ae.safetensors": vaes / "flux2-ae.safetensors",
        "small-decoder vae folder": vaes / "flux2-small-decoder-vae-diffusers",
        "full_encoder_small_decoder.safetensors": vaes / "full_encoder_small_decoder.safetensors",
        "small_decoder.safetensors": vaes / "small_decoder.safetensors",
    }


# source -> the diffusers folder of the same weights, diffusers' model of which is the reference
SAME_WEIGHTS = {
    "dev pipeline": "vae folder",
    "klein pipeline": "vae folder",
    "vae folder": "vae folder",
    "ae.safetensors": "vae folder",
    "small-decoder vae folder": "small-decoder vae folder",
    "full_encoder_small_decoder.safetensors": "small-decoder vae folder",
}


@pytest.fixture(scope="module")
def references(sources):
    from diffusers import AutoencoderKLFlux2

    return {folder: AutoencoderKLFlux2.from_pretrained(str(sources[folder]), dtype=torch.float32).eval()
            for folder in set(SAME_WEIGHTS.values())}


def bn_stats(ref):
    mean = ref.bn.running_mean.view(1, -1, 1, 1)
    std = torch.sqrt(ref.bn.running_var.view(1, -1, 1, 1) + ref.config.batch_norm_eps)
    return mean, std


@torch.no_grad()
def reference_encode(ref, pixels):
    """diffusers' latents as the host keeps them: the mean, 2x2-patchified, batch-normalised (Flux2Pipeline)."""
    z = ref.encode(pixels.movedim(-1, 1) * 2 - 1).latent_dist.mode()
    b, c, h, w = z.shape
    z = z.view(b, c, h // 2, 2, w // 2, 2).permute(0, 1, 3, 5, 2, 4).reshape(b, c * 4, h // 2, w // 2)
    mean, std = bn_stats(ref)
    return (z - mean) / std


@torch.no_grad()
def reference_decode(ref, latents):
    mean, std = bn_stats(ref)
    z = latents * std + mean
    b, c4, h, w = z.shape
    z = z.view(b, c4 // 4, 2, 2, h, w).permute(0, 1, 4, 2, 5, 3).reshape(b, c4 // 4, h * 2, w * 2)
    image = ref.decode(z).sample
    return ((image + 1) / 2).clamp(0, 1).movedim(1, -1)  # the host's pixel range


@pytest.mark.parametrize("source", sorted(SAME_WEIGHTS))
def test_vae_source_matches_diffusers(comfy_host, sources, references, source):
    from comfyui_flux2dev.host.vae import load_vae

    reference = references[SAME_WEIGHTS[source]]
    vae = load_vae(sources[source])
    pixels = torch.rand(1, 32, 48, 3, generator=torch.Generator().manual_seed(5))
    with torch.inference_mode():
        latents = vae.encode(pixels)
        expected = reference_encode(reference, pixels)
        assert latents.shape == (1, 128, 2, 3)
        assert (latents - expected).abs().max() <= 1e-5
        image = vae.decode(latents)
        decoded = reference_decode(reference, latents)
    assert 0.05 < decoded.std()  # not a flat image
    assert (image - decoded).abs().max() <= 1e-5


@pytest.mark.parametrize("source", ["ae.safetensors", "full_encoder_small_decoder.safetensors"])
def test_ae_file_has_the_keys_the_host_derives_from_diffusers(comfy_host, sources, source):
    """The host's own diffusers -> ae conversion is the independent check of the factory's table."""
    from comfy.diffusers_convert import convert_vae_state_dict

    ours = load_vae_state_dict(sources[source])
    diffusers_keys = {k: v for k, v in load_vae_state_dict(sources[SAME_WEIGHTS[source]]).items()
                      if "num_batches" not in k}
    host = convert_vae_state_dict(diffusers_keys)
    host = {{"quant_conv.weight": "encoder.quant_conv.weight", "quant_conv.bias": "encoder.quant_conv.bias",
              "post_quant_conv.weight": "decoder.post_quant_conv.weight",
              "post_quant_conv.bias": "decoder.post_quant_conv.bias"}.get(k, k): v for k, v in host.items()}
    assert ours.keys() == host.keys()
    for key in host:
        assert torch.equal(ours[key], host[key].reshape(ours[key].shape)), key


def test_pipeline_vae_is_the_diffusers_vae(sources, references):
    from diffusers import AutoencoderKLFlux2

    for source in ("dev pipeline", "klein pipeline"):
        vae = AutoencoderKLFlux2.from_pretrained(str(sources[source] / "vae"), dtype=torch.float32)
        for key, value in references["vae folder"].state_dict().items():
            assert torch.equal(vae.state_dict()[key], value), (source, key)


def test_a_flux1_vae_is_named(tmp_path):
    from safetensors.torch import save_file

    save_file({"decoder.conv_in.weight": torch.zeros(8, 16, 3, 3)}, str(tmp_path / "ae.safetensors"))
    with pytest.raises(WrongModelError) as e:
        load_vae_state_dict(tmp_path / "ae.safetensors")
    assert str(e.value) == (
        f"{tmp_path / 'ae.safetensors'} is a VAE with 16 latent channels and no latent batch norm, not the FLUX.2 VAE "
        "(32 latent channels with batch-norm statistics); it is the FLUX.1 VAE. Choose the ae.safetensors or vae/ of a "
        "FLUX.2 model."
    )


def test_the_small_decoder_vae_is_the_full_encoder_with_a_narrow_decoder(references):
    full, small = references["vae folder"], references["small-decoder vae folder"]
    assert small.decoder.conv_in.out_channels < full.decoder.conv_in.out_channels
    for key, value in full.state_dict().items():
        if not key.startswith("decoder."):
            assert torch.equal(small.state_dict()[key], value), key


def test_the_decoder_alone_is_refused_naming_the_file_to_use(sources):
    path = sources["small_decoder.safetensors"]
    with pytest.raises(WrongModelError) as e:
        load_vae_state_dict(path)
    assert str(e.value) == (
        f"{path} is a FLUX.2 VAE decoder alone (like BFL's small_decoder.safetensors), without the encoder a VAE "
        "needs. Download full_encoder_small_decoder.safetensors (the same small decoder with the full encoder) from "
        "https://huggingface.co/black-forest-labs/FLUX.2-small-decoder into models/vae and choose it."
    )


@pytest.mark.parametrize(("source", "name"), [
    ("ae.safetensors", "encoder.conv_in.weight"),
    ("full_encoder_small_decoder.safetensors", "decoder.up.1.block.0.conv1.weight"),
    ("full_encoder_small_decoder.safetensors", "encoder.conv_in.weight"),
])
def test_what_the_host_cannot_build_is_the_packs_error(comfy_host, sources, tmp_path, source, name):
    """A tensor of another shape than ComfyUI builds (in the host's VAE or, on 0.3.75, the pack's narrow decoder):
    the host's error reaches the user as the pack's, naming the tensor and what to do."""
    from safetensors.torch import load_file, save_file

    from comfyui_flux2dev.host.vae import load_vae

    tensors = load_file(sources[source])
    tensors[name] = tensors[name][: tensors[name].shape[0] // 2]
    save_file(tensors, tmp_path / "ae.safetensors")
    with pytest.raises(UnknownModelError) as e:
        load_vae(tmp_path / "ae.safetensors")
    message = str(e.value)
    assert message.startswith(f"ComfyUI could not build a VAE from {tmp_path / 'ae.safetensors'} (RuntimeError: ")
    assert name in message and message.endswith(
        "download it again, flux2-vae.safetensors or full_encoder_small_decoder.safetensors from "
        "https://huggingface.co/black-forest-labs/FLUX.2-small-decoder.")
    assert isinstance(e.value.__cause__, RuntimeError)


def test_the_host_builds_narrow_decoders_from_0_33_on(comfy_host):
    from comfyui_flux2dev.host import compat

    assert compat.builds_narrow_vae_decoders() == (compat._release(compat.host_version()) >= (0, 33))
