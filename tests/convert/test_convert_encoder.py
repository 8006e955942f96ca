"""`convert encoder` from every tiny encoder layout: the file is ComfyUI's single-file layout, its weights are the
source's (the tiny model's own bf16 weights, or the packed ones dequantized by references independent of the
pack) rounded to bf16 or cast to fp8 with a per-tensor scale, the pack loads it with the source's tokenizer,
and its conditioning is the source's, bit for bit."""

from __future__ import annotations

import functools
import json
import sys

import pytest
import torch

from comfyui_flux2dev.devtools.tiny import encoders as tiny
from comfyui_flux2dev.errors import CorruptFileError
from comfyui_flux2dev.loaders.convert.encoder import FP8_PARTS, convert_encoder
from helpers import TESTS

# The encoder tests' references, independent of the pack's dequantizers, serve here too (shared, not copied).
sys.path.append(str(TESTS / "models"))
import references  # noqa: E402
from test_encoder import QUANTIZED  # noqa: E402

# Every tiny encoder layout, the tiny [dev] pipeline as one more; fp8 conversions of one source per family.
SOURCES = {e.name: f"text_encoders/{e.name}" for e in tiny.ENCODERS} | {"pipeline": "diffusers/flux2-dev-tiny-pipeline"}
FP8_SOURCES = ("mistral_3_small_flux2_bf16.safetensors", "native", "mistral_3_small_flux2_fp8_channel.safetensors",
               "mistral_3_small_flux2_fp4_mixed.safetensors", "mistral3-q4_0.gguf")
PROMPTS = ("a red fox in the snow", "Ein Café, 2024: [IMG] 3 cats <s>!")
FP8_MAX = 448.0


@pytest.fixture(scope="module")
def converted(tiny_root, tmp_path_factory) -> dict[tuple[str, str], str]:
    out = tmp_path_factory.mktemp("converted-encoders")
    done = {}
    for name, rel in SOURCES.items():
        for dtype in ("bf16", "fp8") if name in FP8_SOURCES else ("bf16",):
            path = out / f"{name.replace('.', '-')}-{dtype}.safetensors"
            convert_encoder(str(tiny_root / rel), str(path), dtype=dtype)
            done[(name, dtype)] = str(path)
    return done


def _read(key: str) -> bool:
    """Whether the encoder reads a tensor: the embeddings and layers 0-29."""
    return key == "model.embed_tokens.weight" \
        or key.startswith("model.layers.") and int(key.split(".")[2]) < tiny.PRUNED


@functools.cache
def _dense(path: str, family: str | None) -> dict[str, torch.Tensor]:
    if family is None:
        return {k: v.float() for k, v in tiny.base_model().items() if _read(k)}
    return {k: v for k, v in references.WEIGHTS[family](path).items() if _read(k)}


def _reference(tiny_root, name: str) -> dict[str, torch.Tensor]:
    """The source's dense weights in the host's names (float32), made without the pack's dequantizers: the tiny
    model's own weights for bf16 layouts, the independent dequantizations of tests/models/references.py for the
    packed ones."""
    return _dense(str(tiny_root / SOURCES[name]), QUANTIZED.get(name))


def _reference_file(tiny_root, converted, name: str, dtype: str, path) -> str:
    """The source's dense weights rounded to bf16 or cast to fp8 (largest magnitude / 448) without the pack, in
    a file written by safetensors' own writer with the converted file's vocabulary."""
    from safetensors.torch import save_file

    tensors = {}
    for key, want in _reference(tiny_root, name).items():
        if dtype == "fp8" and _projection(key):
            scale = want.abs().max() / FP8_MAX
            tensors[key] = (want / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
            tensors[key.removesuffix("weight") + "weight_scale"] = scale
        else:
            tensors[key] = want.to(torch.bfloat16)
    tensors["tekken_model"] = _stored(converted[(name, dtype)])[0]["tekken_model"]
    save_file(tensors, str(path))
    return str(path)


def _projection(key: str) -> bool:
    return ".".join(key.split(".")[3:5]) in FP8_PARTS


def _stored(path: str) -> tuple[dict, dict]:
    from safetensors import safe_open

    with safe_open(path, "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, f.metadata() or {}


@pytest.mark.parametrize("name", sorted(SOURCES))
def test_bf16_holds_the_sources_weights_rounded_once(tiny_root, converted, name):
    stored, metadata = _stored(converted[(name, "bf16")])
    reference = _reference(tiny_root, name)
    assert set(stored) == set(reference) | {"model.norm.weight", "tekken_model"} and not metadata
    for key, want in reference.items():
        assert stored[key].dtype == torch.bfloat16 and torch.equal(stored[key], want.to(torch.bfloat16)), key
    assert torch.equal(stored["model.norm.weight"], torch.ones(tiny.TINY_MISTRAL.width, dtype=torch.bfloat16))


@pytest.mark.parametrize("name", FP8_SOURCES)
def test_fp8_holds_each_projection_cast_with_its_own_scale(tiny_root, converted, name):
    stored, metadata = _stored(converted[(name, "fp8")])
    reference = _reference(tiny_root, name)
    projections = sorted(k for k in reference if _projection(k))
    assert len(projections) == tiny.PRUNED * len(FP8_PARTS)
    layers = json.loads(metadata["_quantization_metadata"])["layers"]
    assert layers == {k.removesuffix(".weight"): {"format": "float8_e4m3fn"} for k in projections}
    assert set(stored) == set(reference) | {k.removesuffix("weight") + "weight_scale" for k in projections} \
        | {"model.norm.weight", "tekken_model"}
    for key, want in reference.items():
        if not _projection(key):
            assert torch.equal(stored[key], want.to(torch.bfloat16)), key
            continue
        scale = want.abs().max() / FP8_MAX
        assert torch.equal(stored[key.removesuffix("weight") + "weight_scale"], scale), key
        cast = (want / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        assert torch.equal(stored[key].view(torch.uint8), cast.view(torch.uint8)), key


def test_the_pack_loads_every_conversion_with_the_sources_tokenizer(tiny_root, converted):
    from comfyui_flux2dev.loaders.models.encoder import load_encoder, plan_encoder, resolve_plan_tokenizer
    from comfyui_flux2dev.tokenizers.vocab import parse_tekken_json

    for (name, dtype), path in converted.items():
        source = resolve_plan_tokenizer(plan_encoder(str(tiny_root / SOURCES[name]))).tokenizer
        loaded = load_encoder(path)
        assert loaded.layout == "comfy-single-file" and loaded.tokenizer.rung == "embedded-tekken", (name, dtype)
        assert loaded.tokenizer.tokenizer.vocab.digest == source.vocab.digest, (name, dtype)
        assert loaded.formats == ({"bf16": 61, "fp8-scaled": 210} if dtype == "fp8" else {"bf16": 271}), (name, dtype)
        stored, _ = _stored(path)
        tekken = parse_tekken_json(stored["tekken_model"].numpy().tobytes())
        assert tekken.digest == source.vocab.digest


def test_a_second_run_writes_the_same_bytes(tiny_root, converted, tmp_path):
    for key in (("mistral3-q4_0.gguf", "fp8"), ("hf-mistral3", "bf16")):
        again = tmp_path / "again.safetensors"
        convert_encoder(str(tiny_root / SOURCES[key[0]]), str(again), dtype=key[1], force=True)
        assert again.read_bytes() == open(converted[key], "rb").read(), key


def _cond(clip, prompt):
    return clip.encode_from_tokens(clip.tokenize(prompt), return_dict=True)["cond"]


@pytest.mark.one_host  # the bytes decide: both files run the same host code, and every encoder runs on every host
@pytest.mark.parametrize("name", sorted(n for n in SOURCES if n not in QUANTIZED))
def test_a_bf16_sources_conditioning_is_kept_bit_for_bit(comfy_host, tiny_root, converted, name):
    """A bf16 source's weights are stored as they are: the conversion gives exactly the source's conditioning."""
    from comfyui_flux2dev.host.clip import load_clip

    source = load_clip(str(tiny_root / SOURCES[name]))
    mine = load_clip(converted[(name, "bf16")])
    for prompt in PROMPTS:
        assert torch.equal(_cond(mine, prompt), _cond(source, prompt)), prompt


# One source per packed family written as bf16, and fp8 from a bf16 and a GGUF source (the weights of every
# conversion are checked above).
CAST = [("mistral_3_small_flux2_fp8_channel.safetensors", "bf16"),
        ("mistral_3_small_flux2_fp4_mixed.safetensors", "bf16"), ("mistral3-q4_k.gguf", "bf16"),
        ("mistral_3_small_flux2_bf16.safetensors", "fp8"), ("mistral3-q4_0.gguf", "fp8")]


@pytest.mark.parametrize("name, dtype", CAST, ids=[f"{n}-{d}" for n, d in CAST])
def test_the_conditioning_is_the_dense_weights_cast_bit_for_bit(comfy_host, tiny_root, converted, tmp_path, name,
                                                                dtype):
    """A packed source's values are not bf16 numbers in general, and fp8 output is a cast: the conversion gives
    exactly the conditioning of the source's dense weights (dequantized without the pack) rounded to bf16 or
    cast to fp8 with each weight's largest magnitude / 448, as written by safetensors' own writer."""
    from comfyui_flux2dev.host.clip import load_clip

    mine = load_clip(converted[(name, dtype)])
    cast = load_clip(_reference_file(tiny_root, converted, name, dtype, tmp_path / "reference.safetensors"))
    for prompt in PROMPTS:
        assert torch.equal(_cond(mine, prompt), _cond(cast, prompt)), prompt


@pytest.mark.parametrize("value, dtype, said", [
    (float("nan"), torch.bfloat16, "bf16: it holds NaN or infinite values"),
    (1e300, torch.float64, "bf16: it holds values up to 1e+300, beyond float32's 3.40282e+38"),
    (-1e300, torch.float64, "fp8: it holds values up to 1e+300, beyond float32's 3.40282e+38"),
], ids=["nan-bf16", "1e300-bf16", "1e300-fp8"])
def test_a_weight_no_float32_holds_is_refused_naming_it(tiny_root, tmp_path, value, dtype, said):
    """NaN, and float64 values a cast to bfloat16 or fp8 would make infinite, are refused as what they are."""
    from safetensors.torch import load_file, save_file

    weights = load_file(str(tiny_root / "text_encoders" / "mistral_3_small_flux2_bf16.safetensors"))
    key = next(k for k in weights if k.endswith("layers.3.self_attn.q_proj.weight"))
    weights[key] = weights[key].to(dtype)
    weights[key][2, 7] = value
    save_file(weights, str(tmp_path / "bad.safetensors"))
    with pytest.raises(CorruptFileError) as refused:
        convert_encoder(str(tmp_path / "bad.safetensors"), str(tmp_path / "out.safetensors"),
                        dtype=said.split(":")[0])
    assert f"q_proj.weight cannot be written as {said}." in str(refused.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.safetensors"]
