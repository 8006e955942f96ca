"""The files the pack writes, read by others: ComfyUI's own text-encoder detection and quantization-metadata
reading take a converted encoder for the pruned FLUX.2 Mistral encoder with the right dtype (on every host
release CI runs), ComfyUI's own encoder model loads every tensor of it and gives the pack's conditioning, and
ComfyUI-GGUF (the GGUF node pack users have) reads every converted transformer into the same tensors as gguf-py."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from comfyui_flux2dev.devtools.tiny import encoders as tiny
from comfyui_flux2dev.loaders.convert.encoder import FP8_PARTS, convert_encoder
from comfyui_flux2dev.loaders.convert.transformer import TYPES, convert_transformer
from comfyui_flux2dev.loaders.models.encoder_identify import LAYER_SHAPES
from comfyui_flux2dev.loaders.models.variants import known_mistral_encoders
from helpers import host_flux2_tokenizer

ENCODER = "text_encoders/mistral_3_small_flux2_bf16.safetensors"
TRANSFORMER = "diffusion_models/flux2-dev-tiny.safetensors"


@pytest.fixture(scope="module")
def encoders(tiny_root, tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("for-the-host")
    out = {}
    for dtype in ("bf16", "fp8"):
        out[dtype] = folder / f"mistral_3_small_flux2_{dtype}.safetensors"
        convert_encoder(str(tiny_root / ENCODER), str(out[dtype]), dtype=dtype)
    return out


def _as_the_host_reads(path: Path) -> dict:
    """The state dict the host's load_clip hands its text-encoder detection (comfy/sd.py load_clip): the file
    through comfy.utils.load_torch_file, then its quantization header the way the release reads it (0.33 turns
    it into per-layer comfy_quant tensors with convert_old_quants; 0.3.75 passes the header itself on)."""
    import comfy.utils

    sd, metadata = comfy.utils.load_torch_file(str(path), safe_load=True, return_metadata=True)
    if hasattr(comfy.utils, "convert_old_quants"):
        sd, metadata = comfy.utils.convert_old_quants(sd, model_prefix="", metadata=metadata)
    elif metadata and "_quantization_metadata" in metadata:
        sd["_quantization_metadata"] = metadata["_quantization_metadata"]
    return sd


def _at_real_width(sd: dict) -> dict:
    """The same keys, dtypes and metadata with every weight at FLUX.2 [dev]'s real geometry (meta tensors, no
    memory): the host tells Mistral encoders apart by their width (5120), which no file the tests can afford has."""
    real = next(g for g in known_mistral_encoders() if g.width == 5120)
    out = {}
    for key, value in sd.items():
        if not isinstance(value, torch.Tensor) or key == "tekken_model" \
                or key.endswith((".comfy_quant", ".weight_scale")):
            out[key] = value
            continue
        part = ".".join(key.split(".")[3:5])
        shape = (real.vocab, real.width) if key == "model.embed_tokens.weight" else \
            LAYER_SHAPES[part](real) if part in LAYER_SHAPES else (real.width,)
        out[key] = torch.empty(shape, dtype=value.dtype, device="meta")
    return out


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_comfyuis_detection_takes_it_for_the_pruned_flux2_encoder_in_bf16(comfy_host, encoders, dtype):
    import comfy.sd

    sd = _as_the_host_reads(encoders[dtype])
    real = _at_real_width(sd)
    assert comfy.sd.detect_te_model(real) == comfy.sd.TEModel.MISTRAL3_24B_PRUNED_FLUX2
    detected = comfy.sd.llama_detect([real])
    assert detected["dtype_llama"] == torch.bfloat16
    quantization = detected.get("llama_quantization_metadata")
    if dtype == "bf16":
        assert quantization is None
        return
    projections = sorted(f"model.layers.{i}.{part}" for i in range(tiny.PRUNED) for part in FP8_PARTS)
    if isinstance(quantization, str):  # 0.3.75: the header's layers
        assert sorted(json.loads(quantization)["layers"]) == projections
        assert {v["format"] for v in json.loads(quantization)["layers"].values()} == {"float8_e4m3fn"}
    else:  # 0.33: comfy_quant tensors, one per fp8 layer
        assert quantization == {"mixed_ops": True}
        declared = {k.removesuffix(".comfy_quant"): json.loads(bytes(v.tolist())) for k, v in sd.items()
                    if k.endswith(".comfy_quant")}
        assert sorted(declared) == projections and all(v["format"] == "float8_e4m3fn" for v in declared.values())


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_comfyuis_own_encoder_loads_every_tensor_and_gives_the_packs_conditioning(comfy_host, encoders, dtype):
    """ComfyUI's CLIP with its FLUX.2 text encoder, made with what its detection found (its own ops: the
    mixed-precision layers read the fp8 scales), loads the file with no tensor missing or left over, and on the
    pack's tokens gives the pack's conditioning (the pack's tokenizer stands in for the host's, checked below)."""
    import comfy.sd
    import comfy.text_encoders.flux

    from comfyui_flux2dev.host import compat
    from comfyui_flux2dev.host.clip import load_clip
    from comfyui_flux2dev.host.clip_model import model_config
    from comfyui_flux2dev.host.clip_tokenizer import PADDING_KEY, TOKENIZER_KEY, Flux2DevTokenizer
    from comfyui_flux2dev.loaders.models.encoder import plan_encoder, resolve_plan_tokenizer

    sd = _as_the_host_reads(encoders[dtype])
    plan = plan_encoder(str(encoders[dtype]))

    class Target:
        params = {}
        clip = comfy.text_encoders.flux.flux2_te(**comfy.sd.llama_detect([sd]), pruned=True)
        tokenizer = Flux2DevTokenizer

    host = compat.call_with_known(
        comfy.sd.CLIP, target=Target, state_dict=[dict(sd)],
        tokenizer_data={TOKENIZER_KEY: resolve_plan_tokenizer(plan).tokenizer, PADDING_KEY: "comfy"},
        model_options={"mistral3_24b_model_config": model_config(plan)},
    )
    missing, unexpected = host.load_sd({k: v for k, v in sd.items() if isinstance(v, torch.Tensor)})
    assert not missing and set(unexpected) <= {"tekken_model", "model.norm.weight"}, (missing, unexpected)
    # The host's text encoder computes in float32 on a CPU; the pack's float32 CLIP does the same arithmetic.
    mine = load_clip(str(encoders[dtype]), padding="comfy", dtype=torch.float32)
    for prompt in ("a red fox in the snow", "drei Katzen, 1999 [IMG]"):
        tokens = mine.tokenize(prompt)
        want = mine.encode_from_tokens(tokens).float()
        try:
            got = host.encode_from_tokens(tokens).float()
        except RuntimeError as e:
            if dtype == "fp8" and compat.host_version() == "0.3.75" and "same dtype" in str(e):
                pytest.skip("ComfyUI 0.3.75's mixed-precision layers dequantize fp8 weights to bf16 whatever dtype "
                            "they are cast to (its QuantizedTensor.to(float32) keeps bf16), and its text encoder "
                            f"computes in float32, so its own fp8 encoders do not run on it ({e}); the file's load is "
                            "checked above")
            raise
        assert got.shape == want.shape and (got - want).norm() / want.norm() < 1e-3, \
            (prompt, ((got - want).norm() / want.norm()).item())


@pytest.mark.parametrize("written", [True, False], ids=["converted", "the tests' comfy file"])
def test_comfyuis_own_tokenizer_reads_the_embedded_vocabulary_as_the_pack_does(comfy_host, encoders, tiny_root,
                                                                               written):
    """On the pack's converted file, and on the tiny ComfyUI file the tests stand in for ComfyUI's with (whose embedded
    tekken must be one ComfyUI's own loader reads, as every real one is)."""
    from comfyui_flux2dev.host.clip import load_clip

    path = encoders["bf16"] if written else tiny_root / ENCODER
    host = host_flux2_tokenizer(_as_the_host_reads(path)["tekken_model"])
    mine = load_clip(str(path), padding="comfy")
    for prompt in ("a red fox in the snow", "Ein Café, 2024: [IMG] 3 cats <s>!", "東京の夜"):
        assert [t[0] for t in host.tokenize_with_weights(prompt)["mistral3_24b"][0]] == \
            [t[0] for t in mine.tokenize(prompt)["mistral3_24b"][0]], prompt


def test_comfyui_gguf_reads_every_type_into_the_same_tensors(peer, tiny_root, tmp_path):
    loader, dequant = peer
    for qtype in TYPES:
        path = tmp_path / f"flux2-dev-tiny-{qtype}.gguf"
        convert_transformer(str(tiny_root / TRANSFORMER), str(path), qtype=qtype)
        sd, architecture = loader.gguf_sd_loader(str(path), return_arch=True)
        assert architecture == "flux"
        reference = gguf.GGUFReader(str(path)).tensors
        assert set(sd) == {t.name for t in reference}
        for t in reference:
            want = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32).reshape(
                [int(d) for d in reversed(t.shape)])
            got = dequant.dequantize_tensor(sd[t.name], dtype=torch.float32, dequant_dtype=torch.float32)
            assert tuple(got.shape) == want.shape and np.array_equal(got.numpy(), want), (qtype, t.name)
