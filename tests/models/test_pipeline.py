"""diffusers FLUX.2 pipeline folders: discovery, the variant every part must agree on, the Klein-as-[dev]-
encoder refusal, and the source nodes on tiny pipelines in the real host."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from comfyui_flux2dev.devtools.tiny.geometry import TINY_VARIANTS
from comfyui_flux2dev.errors import VariantMismatchError, WrongModelError
from comfyui_flux2dev.loaders.models.pipeline import (
    describe_pipeline,
    dev_encoder_folder,
    klein_encoder_error,
    pipeline_class,
    pipeline_variant,
)
from comfyui_flux2dev.loaders.models.variants import VARIANTS


def refusal(call, *args) -> str:
    """The message of the VariantMismatchError `call(*args)` raises."""
    with pytest.raises(VariantMismatchError) as e:
        call(*args)
    return str(e.value)


def test_pipelines_are_found_and_identified(tiny_pipelines, tmp_path):
    root, entries = tiny_pipelines
    assert pipeline_class(tmp_path) is None
    for entry in entries:
        assert pipeline_class(root / entry["path"]) in ("Flux2Pipeline", "Flux2KleinPipeline")
        assert describe_pipeline(root / entry["path"]).variant.key == entry["variant"]


def test_tiny_pipelines_load_in_diffusers(tiny_pipelines):
    from diffusers import AutoencoderKLFlux2, Flux2KleinPipeline, Flux2Transformer2DModel
    from transformers import Mistral3ForConditionalGeneration

    root, _ = tiny_pipelines
    for variant in TINY_VARIANTS[1:]:
        pipe = Flux2KleinPipeline.from_pretrained(str(root / f"flux2-{variant.key}-tiny-pipeline"), dtype=torch.float32)
        assert pipe.text_encoder.config.hidden_size == variant.encoder_width
        assert pipe.transformer.config.joint_attention_dim == variant.context_in_dim
    dev = root / "flux2-dev-tiny-pipeline"
    assert Flux2Transformer2DModel.from_pretrained(str(dev / "transformer")).config.guidance_embeds
    assert AutoencoderKLFlux2.from_pretrained(str(dev / "vae")).config.latent_channels == 32
    encoder = Mistral3ForConditionalGeneration.from_pretrained(str(dev / "text_encoder"))
    assert encoder.config.text_config.hidden_size == TINY_VARIANTS[0].encoder_width


def test_klein_pipeline_is_refused_as_dev_encoder_before_any_weight_is_read(tiny_pipelines, tmp_path):
    root, _ = tiny_pipelines
    klein = tmp_path / "FLUX.2-klein-4B"
    shutil.copytree(root / "flux2-klein-4b-tiny-pipeline", klein)
    for weights in (klein / "text_encoder").glob("*.safetensors"):
        weights.write_bytes(b"")  # nothing to read: the refusal must come from the JSON and headers alone
    assert refusal(dev_encoder_folder, klein) == (
        "FLUX.2-klein-4B is a FLUX.2 Klein 4B (tiny test model) pipeline (Flux2KleinPipeline). Its tiny Qwen3 text "
        "encoder gives 96-wide conditioning, but FLUX.2 [dev] (tiny test model) needs 192 (the tiny Mistral encoder). "
        "Use this pipeline only for its VAE (with Load FLUX.2 VAE (file or pipeline): the VAE is shared); for the "
        "text encoder choose a FLUX.2 [dev] (tiny test model) pipeline folder, or a tiny Mistral encoder file or "
        "folder in models/text_encoders."
    )
    assert dev_encoder_folder(root / "flux2-dev-tiny-pipeline") == root / "flux2-dev-tiny-pipeline"


@pytest.mark.parametrize("variant", VARIANTS[1:], ids=lambda v: v.key)
def test_klein_refusal_on_real_dimensions(variant):
    size = variant.key.split("-")[1].upper()
    assert str(klein_encoder_error(f"FLUX.2-klein-{size}", "Flux2KleinPipeline", variant)) == (
        f"FLUX.2-klein-{size} is a FLUX.2 Klein {size} pipeline (Flux2KleinPipeline). Its {variant.encoder_name} text "
        f"encoder gives {variant.context_in_dim}-wide conditioning, but FLUX.2 [dev] needs 15360 (the Mistral-Small "
        "24B encoder). Use this pipeline only for its VAE (with Load FLUX.2 VAE (file or pipeline): the VAE is "
        "shared); for the text encoder choose a FLUX.2 [dev] pipeline folder, or a Mistral-Small 24B encoder file or "
        "folder in models/text_encoders."
    )
    assert {7680: "klein-4b", 12288: "klein-9b"}[variant.context_in_dim] == variant.key


def test_a_pipeline_that_contradicts_itself_says_which_part_says_what(tiny_pipelines, tmp_path):
    root, _ = tiny_pipelines
    mixed = tmp_path / "mixed"
    shutil.copytree(root / "flux2-klein-4b-tiny-pipeline", mixed)
    shutil.rmtree(mixed / "transformer")
    shutil.copytree(root / "flux2-dev-tiny-pipeline" / "transformer", mixed / "transformer")
    assert refusal(describe_pipeline, mixed) == (
        "The pipeline folder mixed contradicts itself: model_index.json names Flux2KleinPipeline; "
        "transformer/config.json (joint_attention_dim 192, 2 heads x 128, guidance_embeds True) describes FLUX.2 [dev] "
        "(tiny test model); the transformer weights (hidden 256, context 192) are FLUX.2 [dev] (tiny test model); "
        "text_encoder/config.json is 32 wide. A FLUX.2 [dev] (tiny test model) text encoder is 64 wide (tiny "
        "Mistral). Parts of different FLUX.2 variants were mixed in one folder; download the pipeline again."
    )


def test_config_and_weights_must_agree_on_real_dimensions():
    from diffusers import Flux2Transformer2DModel

    dev_config = dict(num_layers=8, num_single_layers=48, num_attention_heads=48, joint_attention_dim=15360)
    with torch.device("meta"):
        shapes = {k: tuple(t.shape) for k, t in Flux2Transformer2DModel(**dev_config).state_dict().items()}
    klein_config = {"num_attention_heads": 24, "attention_head_dim": 128, "joint_attention_dim": 7680,
                    "guidance_embeds": False}
    with pytest.raises(VariantMismatchError) as e:
        pipeline_variant("FLUX.2-dev", "Flux2Pipeline", klein_config, shapes, {"text_config": {"hidden_size": 5120}})
    assert str(e.value) == (
        "The pipeline folder FLUX.2-dev contradicts itself: model_index.json names Flux2Pipeline; "
        "transformer/config.json (joint_attention_dim 7680, 24 heads x 128, guidance_embeds False) describes FLUX.2 "
        "Klein 4B; the transformer weights (hidden 6144, context 15360) are FLUX.2 [dev]; text_encoder/config.json is "
        "5120 wide. A FLUX.2 [dev] text encoder is 5120 wide (Mistral-Small 24B). Parts of different FLUX.2 variants "
        "were mixed in one folder; download the pipeline again."
    )
    dev_config_json = {**klein_config, "num_attention_heads": 48, "joint_attention_dim": 15360, "guidance_embeds": True}
    assert pipeline_variant("FLUX.2-dev", "Flux2Pipeline", dev_config_json, shapes, None) == VARIANTS[0]


def test_other_pipelines_are_not_flux2(tmp_path):
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "FluxPipeline"}))
    with pytest.raises(WrongModelError, match=r"is a diffusers FluxPipeline pipeline, not a FLUX.2 one"):
        describe_pipeline(tmp_path)
    assert pipeline_class(tmp_path) is None


# --- the nodes, in the host --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def registered(comfy_host, tiny_pipelines):
    import folder_paths

    root, _ = tiny_pipelines
    folder_paths.add_model_folder_path("diffusers", str(root))
    return root


def test_nodes_list_pipelines_and_klein_vae_serves_dev(registered):
    from comfyui_flux2dev.host.model import flux2_classes
    from comfyui_flux2dev.nodes import NODES
    from comfyui_flux2dev.nodes.sources import Flux2DevTransformerSource, Flux2DevVAESource

    assert {"Flux2DevVAESource", "Flux2DevEncoderSource", "Flux2DevTransformerSource"} \
        <= {n.define_schema().node_id for n in NODES}
    options = Flux2DevVAESource.define_schema().inputs[0].options
    assert "flux2-klein-4b-tiny-pipeline/" in options
    vae = Flux2DevVAESource.execute(vae="flux2-klein-4b-tiny-pipeline/").result[0]
    model = Flux2DevTransformerSource.execute(transformer="flux2-dev-tiny-pipeline/").result[0]
    assert isinstance(model.model, flux2_classes()[0]) and model.model.flux2_variant.key == "dev"
    with torch.inference_mode():  # the Klein pipeline's VAE decodes a [dev] latent
        assert vae.decode(torch.zeros(1, 128, 2, 2)).shape == (1, 32, 32, 3)


def test_encoder_node_refuses_klein_and_loads_dev(registered):
    from comfyui_flux2dev.nodes.sources import Flux2DevEncoderSource

    with pytest.raises(VariantMismatchError,
                       match=r"^flux2-klein-9b-tiny-pipeline is a FLUX.2 Klein 9B \(tiny test model\)"):
        Flux2DevEncoderSource.execute(pipeline="flux2-klein-9b-tiny-pipeline/", padding="reference")
    clip = Flux2DevEncoderSource.execute(pipeline="flux2-dev-tiny-pipeline/", padding="reference").result[0]
    cond = clip.encode_from_tokens_scheduled(clip.tokenize("a red cube"))
    assert cond[0][0].shape[-1] == TINY_VARIANTS[0].context_in_dim


def test_the_encoder_source_gives_the_lazy_cached_clip_of_the_encoder_loader(registered, tmp_path):
    """The pipeline's [dev] encoder reads its weights on the first prompt the cache lacks, stores it, and a
    second CLIP from the same pipeline is served from the cache without reading them; keep_loaded off frees
    them after each encode."""
    from comfyui_flux2dev.loaders.cache.store import ConditioningCache
    from comfyui_flux2dev.nodes.sources import Flux2DevEncoderSource

    cache = tmp_path / "cache"
    kwargs = dict(pipeline="flux2-dev-tiny-pipeline/", padding="reference", cache=str(cache))
    first = Flux2DevEncoderSource.execute(**kwargs, keep_loaded=True).result[0]
    assert not first.flux2dev_source.loaded, "only headers and the tokenizer are read when the node runs"
    cond = first.encode_from_tokens(first.tokenize("a red fox"))
    assert first.flux2dev_source.loaded and len(ConditioningCache(cache).entries()) == 1
    second = Flux2DevEncoderSource.execute(**kwargs, keep_loaded=False).result[0]
    assert torch.equal(second.encode_from_tokens(second.tokenize("a red fox")), cond)
    assert not second.flux2dev_source.loaded, "a hit reads no weights"
    second.encode_from_tokens(second.tokenize("another prompt"))
    assert not second.flux2dev_source.loaded, "keep_loaded off frees the weights after the encode"
    assert len(ConditioningCache(cache).entries()) == 2
