"""Prompt upsampling end to end on the tiny encoders: on every layout that holds the whole model, greedy generation
through the pack equals transformers' generate(do_sample=False) on the same weights (the bf16 layouts against
transformers' own Mistral3 loaded from the hub-style folder; packed ones against MistralForCausalLM on weights
expanded independently, tests/models/references.py), token for token, for 20 prompts of the tests' corpus on the
reference layout and 4 on each other; edits
with 1 and 3 reference images on the folder layouts against transformers' Mistral3 on the processor's pixels
(joined by diffusers' own functions); sampled runs are repeatable, in this process and a fresh one; files that
cannot write text are refused from their headers, each with its message; the cache serves a prompt upsampled
before without reading a weight."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import references
from comfyui_flux2dev.devtools.tiny import encoders as tiny
from comfyui_flux2dev.errors import InputError, MissingWeightsError, PromptTooLongError, WrongModelError
from helpers import DATA, link_tree, run_flux2dev

NEW_TOKENS = 8
# The tiny layouts that hold the whole model (all 40 layers, the final norm, lm_head) -> their reference: "bf16"
# (transformers' Mistral3 from the hub-style folder, the same weights) or the format family of references.WEIGHTS.
WHOLE = {
    "hf-mistral3": "bf16", "hf-mistral3-old-prefix": "bf16", "native": "bf16", "pipeline": "bf16",
    "hf-mistral3-fp8": "fp8", "mistral_3_small_whole_fp4_mixed.safetensors": "nvfp4",
    "llama-q8_0.gguf": "gguf", "mistral3-q4_0.gguf": "gguf", "mistral3-q4_k.gguf": "gguf",
}
# Every weight but the embedding's rows takes part in every token, so a few prompts show that a layout's weights
# are read right; the generation itself (chat layout, sampling, stopping) meets the corpus's 20 on one layout.
REFERENCE_LAYOUT, CORPUS_PROMPTS, LAYOUT_PROMPTS = "hf-mistral3", 20, 4
# What transformers 4.57 changes here is the tokenizer a folder's rung builds and the reference itself: one
# layout per tokenizer source (a folder's files, a GGUF's vocabulary) runs again under it.
MATRIX = (REFERENCE_LAYOUT, "mistral3-q4_k.gguf")
FOLDERS_WITH_VISION = ("hf-mistral3", "hf-mistral3-old-prefix", "pipeline", "hf-mistral3-fp8")
PRUNED = "holds 30 of Mistral-Small's 40 layers: it is a pruned FLUX.2 encoder"
# Each tiny layout that cannot write text -> the words of its refusal.
REFUSED = {
    "mistral_3_small_flux2_bf16.safetensors": PRUNED, "mistral_3_small_flux2_fp8.safetensors": PRUNED,
    "mistral_3_small_flux2_fp4_mixed.safetensors": PRUNED, "standalone": PRUNED, "cow-f16.gguf": PRUNED,
}


def _matrix(names) -> list:
    """`names` as parameters, those in MATRIX marked to run again under transformers 4.57. Only the reference
    layout runs on every host tree: the host's part (devices, loading, progress) is the same for every layout."""
    return [pytest.param(n, marks=[*([pytest.mark.transformers_matrix] if n in MATRIX else []),
                                   *([] if n == REFERENCE_LAYOUT else [pytest.mark.one_host])]) for n in names]


def corpus(count: int = 20) -> list[str]:
    """The first `count` prompts of the tests' own corpus that are not blank."""
    lines = (DATA / "prompts.jsonl").read_text(encoding="utf-8").splitlines()
    prompts = [json.loads(line) for line in lines if line.strip()]
    return [p for p in prompts if p.strip() and len(p) < 2000][:count]


@pytest.fixture(scope="module")
def encoders(tiny_root, tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("upsampler-encoders")
    for entry in (tiny_root / "text_encoders").iterdir():
        (folder / entry.name).symlink_to(entry, target_is_directory=entry.is_dir())
    (folder / "pipeline").symlink_to(tiny_root / "diffusers" / "flux2-dev-tiny-pipeline", target_is_directory=True)
    return folder


@pytest.fixture(scope="module")
def hf_model(encoders):
    """transformers' Mistral3 as saved on the hub (the vision tower too), float32."""
    from transformers import Mistral3ForConditionalGeneration

    model = Mistral3ForConditionalGeneration.from_pretrained(str(encoders / "hf-mistral3"), attn_implementation="sdpa")
    return model.float().eval()


def _causal_lm(weights: dict):
    from transformers import MistralConfig, MistralForCausalLM

    config = MistralConfig(**{k: v for k, v in tiny.text_config(tiny.LAYERS).items() if k != "model_type"})
    config._attn_implementation = "sdpa"
    model = MistralForCausalLM(config).float().eval()
    missing, unexpected = model.load_state_dict(weights, strict=False)
    assert not missing and not unexpected
    return model


def _reference_ids(model, input_ids: list[int], **inputs) -> list[int]:
    device = next(model.parameters()).device
    ids = torch.tensor([input_ids], device=device)
    inputs = {k: v.to(device) for k, v in inputs.items()}
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=NEW_TOKENS, pad_token_id=11, **inputs)
    return out[0, len(input_ids):].tolist()


def _upsample(path, prompt, **settings):
    from comfyui_flux2dev.host.upsampler import upsample

    return upsample(str(path), prompt,
                    **{"temperature": 0, "max_new_tokens": NEW_TOKENS, "dtype": torch.float32, **settings})


@pytest.mark.one_host  # the host's part runs on every tree in the edit test, on the reference layout
@pytest.mark.parametrize("name", _matrix(sorted(WHOLE)))
def test_greedy_text_to_image_equals_transformers(comfy_host, encoders, hf_model, name, device):
    from comfyui_flux2dev.host.upsampler import release_held

    path = encoders / name
    family = WHOLE[name]
    reference = (hf_model if family == "bf16" else _causal_lm(references.WEIGHTS[family](path))).to(device)
    try:
        for prompt in corpus(CORPUS_PROMPTS if name == REFERENCE_LAYOUT else LAYOUT_PROMPTS):
            got = _upsample(path, prompt, keep_loaded=True, device=device)
            assert got.output_ids == _reference_ids(reference, got.input_ids), prompt
            assert not got.cached and got.system_message.startswith("You are an expert prompt engineer for FLUX.2")
    finally:
        release_held()
        reference.to("cpu")


def _pictures(count: int) -> list[Image.Image]:
    rng = np.random.default_rng(count)
    sizes = [(60, 40), (80, 50), (70, 70)][:count]
    return [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for w, h in sizes]


def _reference_pixels(images: list[Image.Image]):
    """What BFL's reference hands the Pixtral processor (joined and capped by diffusers' own functions), processed
    by transformers' Pixtral image processor."""
    import transformers
    from diffusers.pipelines.flux2.image_processor import Flux2ImageProcessor

    image = Flux2ImageProcessor.concatenate_images(images) if len(images) > 1 else images[0]
    image = Flux2ImageProcessor._resize_if_exceeds_area(image, 768 * 768)
    cls = getattr(transformers, "PixtralImageProcessorPil", None) or transformers.PixtralImageProcessor
    vision = tiny.VISION
    side = vision["patch_size"] * 2  # spatial_merge_size 2
    processed = cls(size={"longest_edge": vision["image_size"]}, patch_size={"height": side, "width": side})(
        [image.convert("RGB")], return_tensors="pt")
    return processed["pixel_values"], torch.as_tensor(processed["image_sizes"])


@pytest.mark.parametrize("count", [1, 3])
@pytest.mark.parametrize("name", _matrix(FOLDERS_WITH_VISION))
def test_greedy_edit_with_reference_images_equals_transformers(comfy_host, encoders, hf_model, name, count, device):
    images = _pictures(count)
    got = _upsample(encoders / name, "make the roof red", images=images, device=device)
    assert got.system_message.startswith("You are FLUX.2 by Black Forest Labs, an image-editing expert")
    assert got.input_ids.count(10) >= 1 and 13 in got.input_ids  # [IMG] rows, closed by [IMG_END]
    if WHOLE[name] == "bf16":
        model = hf_model
    else:  # the same Mistral3 with the folder's language model, expanded independently
        model = hf_model.__class__(hf_model.config).float().eval()
        model.load_state_dict(hf_model.state_dict())
        lm = references.WEIGHTS[WHOLE[name]](encoders / name)
        model.model.language_model.load_state_dict({k.removeprefix("model."): v for k, v in lm.items()
                                                    if k != "lm_head.weight"})
        model.lm_head.weight.data.copy_(lm["lm_head.weight"])
    pixels, sizes = _reference_pixels(images)
    try:
        assert _reference_ids(model.to(device), got.input_ids, pixel_values=pixels, image_sizes=sizes) == got.output_ids
    finally:
        model.to("cpu")


@pytest.mark.one_host  # sampling is the pack's and torch's
def test_sampled_text_is_the_same_twice_and_in_a_fresh_process(comfy_host, encoders):
    settings = {"temperature": 0.8, "seed": 7, "max_new_tokens": 12, "dtype": None}
    counted = []
    first = _upsample(encoders / "hf-mistral3", "a lighthouse at dusk",
                      on_token=lambda n, total: counted.append((n, total)), **settings)
    assert counted == [(n, 12) for n in range(1, len(first.output_ids) + 1)]  # the progress bar's steps, one a token
    second = _upsample(encoders / "hf-mistral3", "a lighthouse at dusk", **settings)
    other_seed = _upsample(encoders / "hf-mistral3", "a lighthouse at dusk", **{**settings, "seed": 8})
    assert first.output_ids == second.output_ids and first.text == second.text
    assert other_seed.output_ids != first.output_ids
    out = run_flux2dev("upsample", encoders / "hf-mistral3", "--prompt", "a lighthouse at dusk", "--seed", "7",
                       "--temperature", "0.8", "--max-new-tokens", "12", "--json")
    assert out.returncode == 0, out.stderr
    fresh = json.loads(out.stdout)
    assert fresh["output_ids"] == first.output_ids and fresh["text"] == first.text
    assert fresh["input_ids"] == first.input_ids and fresh["system_message"] == first.system_message


def _without(tmp_path, *names: str) -> Path:
    """A whole model in one file (ComfyUI's key layout, 40 layers) lacking the given tensors."""
    from safetensors.torch import save_file

    tensors = {k: v for k, v in tiny.base_model().items() if k not in names}
    path = tmp_path / f"whole-without-{'-'.join(n.split('.')[-2] for n in names)}.safetensors"
    save_file({**tensors, "tekken_model": tiny.tekken_tensor()}, str(path))
    return path


def test_files_that_cannot_write_text_are_refused_from_their_headers(comfy_host, encoders, tiny_root, tmp_path, reads):
    for name, words in REFUSED.items():
        with pytest.raises(WrongModelError, match=words) as e:
            _upsample(encoders / name, "a fox")
        assert "Hugging Face Mistral-Small-3.x folder" in str(e.value) and "llama.cpp .gguf" in str(e.value)
    with pytest.raises(MissingWeightsError, match=r"has all 40 layers but not the output head \(lm_head\), which turn"):
        _upsample(_without(tmp_path, "lm_head.weight"), "a fox")
    with pytest.raises(MissingWeightsError, match="has all 40 layers but not the final norm and the output head"):
        _upsample(_without(tmp_path, "lm_head.weight", "model.norm.weight"), "a fox")
    with pytest.raises(WrongModelError, match="Qwen3 text encoder of FLUX.2 Klein 4B"):
        _upsample(tiny_root / "diffusers/flux2-klein-4b-tiny-pipeline/text_encoder", "a fox")
    # every refusal came from headers alone (and the small per-layer format declarations of NVFP4 files)
    assert [name for name in reads if not name.endswith(".comfy_quant")] == []


def test_edits_need_a_vision_tower_and_images(comfy_host, encoders, tmp_path):
    picture = _pictures(1)
    with pytest.raises(MissingWeightsError, match="llama.cpp keeps the vision tower in a separate mmproj"):
        _upsample(encoders / "mistral3-q4_0.gguf", "make it red", images=picture)
    with pytest.raises(MissingWeightsError, match="Mistral's own files name the vision encoder their own way"):
        _upsample(encoders / "native", "make it red", images=picture)
    no_vision = link_tree(encoders / "hf-mistral3", tmp_path / "no-vision")
    config = json.loads((no_vision / "config.json").read_text())
    del config["vision_config"]
    (no_vision / "config.json").unlink()
    (no_vision / "config.json").write_text(json.dumps(config))
    with pytest.raises(MissingWeightsError, match="the file holds no vision tower"):
        _upsample(no_vision, "make it red", images=picture)
    with pytest.raises(InputError, match="mode is edit, but no reference image is connected"):
        _upsample(encoders / "hf-mistral3", "make it red", mode="edit")
    text_only = _upsample(encoders / "mistral3-q4_0.gguf", "make it red", images=picture, mode="text to image")
    assert 10 not in text_only.input_ids  # the images are not read in text-to-image mode
    with pytest.raises(PromptTooLongError, match="at most 2048 tokens"):
        _upsample(encoders / "hf-mistral3", "word " * 3000)


def test_a_prompt_upsampled_before_is_served_without_reading_a_weight(comfy_host, encoders, tmp_path, reads):
    from comfyui_flux2dev.host import upsampler

    cache = str(tmp_path / "cache")
    settings = {"temperature": 0.5, "seed": 3, "cache": cache}
    first = _upsample(encoders / "hf-mistral3", "a red fox", **settings)
    assert not first.cached and reads
    reads.clear()
    again = _upsample(encoders / "hf-mistral3", "a red fox", **settings)
    assert again.cached and set(reads) == {upsampler.TEXT_KEY, upsampler.IDS_KEY}  # the cache entry's, no weight
    assert (again.text, again.output_ids, again.input_ids) == (first.text, first.output_ids, first.input_ids)
    for changed in ({"seed": 4}, {"temperature": 0.6}, {"max_new_tokens": NEW_TOKENS + 1}):
        assert not _upsample(encoders / "hf-mistral3", "a red fox", **{**settings, **changed}).cached, changed
    assert not _upsample(encoders / "hf-mistral3", "a red fox!", **settings).cached
    assert not _upsample(encoders / "hf-mistral3", "a red fox", images=_pictures(1), **settings).cached
    assert not _upsample(encoders / "native", "a red fox", **settings).cached  # the same weights, another layout


def test_quantized_weights_stay_packed_while_writing(comfy_host, encoders, monkeypatch):
    from comfyui_flux2dev.host import upsampler

    seen = {}
    original = upsampler.generate

    def spy(model, *args, **kwargs):
        seen["q"] = model.model.layers[5].self_attn.q_proj.weight.dtype
        return original(model, *args, **kwargs)

    monkeypatch.setattr(upsampler, "generate", spy)
    for name, dtype in (("hf-mistral3-fp8", torch.float8_e4m3fn), ("llama-q8_0.gguf", torch.uint8),
                        ("mistral_3_small_whole_fp4_mixed.safetensors", torch.uint8)):
        _upsample(encoders / name, "a fox", dtype=torch.bfloat16)
        assert seen["q"] == dtype, name
