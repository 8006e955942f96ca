"""`convert transformer` from every tiny transformer layout to every --type: read back by gguf-py's own reader,
each tensor's bytes are gguf-py's quantizer on the source's dense weights (read without the pack) in the type
the unquantized list gives it, the metadata is a FLUX GGUF's, the pack loads the file, and a LoRA baked in is the
dense weight plus the LoRA's product, computed here by hand, then quantized."""

from __future__ import annotations

import math

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from comfyui_flux2dev.errors import CorruptFileError, WrongModelError
from comfyui_flux2dev.loaders.convert.transformer import TYPES, convert_transformer
from helpers import fp8_weights

# source -> (path under the tiny root, the file whose tensors are its dense weights, fp8 spelling or None)
SOURCES = {
    "bfl": ("diffusion_models/flux2-dev-tiny.safetensors", "diffusion_models/flux2-dev-tiny.safetensors", None),
    "diffusers": ("diffusion_models/flux2-dev-tiny-diffusers", "diffusion_models/flux2-dev-tiny.safetensors", None),
    "pipeline": ("diffusers/flux2-dev-tiny-pipeline", "diffusion_models/flux2-dev-tiny.safetensors", None),
    "fp8-scale_weight": ("diffusion_models/flux2-dev-tiny-fp8-scale_weight.safetensors", None, "scale_weight"),
    "fp8-weight_scale": ("diffusion_models/flux2-dev-tiny-fp8-weight_scale.safetensors", None, "weight_scale"),
    "klein-4b": ("diffusion_models/flux2-klein-4b-tiny.safetensors", "diffusion_models/flux2-klein-4b-tiny.safetensors",
                 None),
}
# What the README says stays unquantized: FLUX's embedders and final layer, FLUX.2's shared modulation (kept in
# the file's 16-bit float type), and vectors and tiny tensors (F32).
KEPT = ("img_in.", "txt_in.", "time_in.", "guidance_in.", "final_layer.", "double_stream_modulation_img.",
        "double_stream_modulation_txt.", "single_stream_modulation.")
# llama.cpp's numbers of each --type (general.file_type)
FILE_TYPES = {"Q8_0": 7, "Q5_1": 9, "Q5_0": 8, "Q4_1": 3, "Q4_0": 2, "Q6_K": 18, "Q5_K_M": 17, "Q5_K_S": 16,
              "Q4_K_M": 15, "Q4_K_S": 14, "Q3_K_L": 13, "Q3_K_M": 12, "Q3_K_S": 11, "Q2_K": 10, "BF16": 32, "F16": 1}
# The K presets as llama.cpp's image-model rules (ComfyUI-GGUF's tools/lcpp.patch, img_tensor_get_type) type FLUX.2's
# weights: preset -> (its weights' type, the fused attention qkv weights' type). Its attention v and ffn_down
# rules name no FLUX.2 tensor.
PRESETS = {"Q6_K": (Q.Q6_K, Q.Q6_K), "Q5_K_M": (Q.Q5_K, Q.Q6_K), "Q5_K_S": (Q.Q5_K, Q.Q5_K),
           "Q4_K_M": (Q.Q4_K, Q.Q5_K), "Q4_K_S": (Q.Q4_K, Q.Q4_K), "Q3_K_L": (Q.Q3_K, Q.Q4_K),
           "Q3_K_M": (Q.Q3_K, Q.Q4_K), "Q3_K_S": (Q.Q3_K, Q.Q3_K), "Q2_K": (Q.Q2_K, Q.Q2_K)}
FUSED_QKV = ("img_attn.qkv.weight", "txt_attn.qkv.weight")
LEGACY = [t for t in FILE_TYPES if t not in PRESETS]  # one GGUF type for every weight, gguf-py's to check


def expected_type(key: str, shape: tuple[int, ...], qtype: str) -> Q:
    if len(shape) < 2 or math.prod(shape) <= 1024:
        return Q.F32
    if key.startswith(KEPT):
        return Q.F16 if qtype == "F16" else Q.BF16
    if qtype in PRESETS:
        weights, qkv = PRESETS[qtype]
        kind = qkv if key.endswith(FUSED_QKV) else weights
        return kind if shape[-1] % 256 == 0 else Q.F16  # rows of part K blocks fall back to F16
    return Q[qtype]


@pytest.fixture(scope="module")
def dense(tiny_root) -> dict[str, dict[str, np.ndarray]]:
    from safetensors.torch import load_file

    out = {}
    for name, (path, plain, spelling) in SOURCES.items():
        weights = fp8_weights(tiny_root / path, spelling) if spelling \
            else {k: v.float() for k, v in load_file(str(tiny_root / plain)).items()}
        out[name] = {k: v.numpy() for k, v in weights.items()}
    return out


@pytest.fixture(scope="module")
def converted(tiny_root, tmp_path_factory) -> dict[tuple[str, str], str]:
    out = tmp_path_factory.mktemp("converted-transformers")
    done = {}
    for name, (path, _, _) in SOURCES.items():
        for qtype in LEGACY:
            target = out / f"{name}-{qtype}.gguf"
            convert_transformer(str(tiny_root / path), str(target), qtype=qtype)
            done[(name, qtype)] = str(target)
    return done


def _tensors(path: str) -> dict[str, tuple[Q, np.ndarray]]:
    reader = gguf.GGUFReader(path)
    return {t.name: (Q(t.tensor_type), np.asarray(t.data).view(np.uint8).reshape(-1)) for t in reader.tensors}


def test_the_written_types_are_the_ones_listed():
    assert list(TYPES) == list(FILE_TYPES)


@pytest.mark.parametrize("name", SOURCES)
def test_each_tensor_is_gguf_pys_quantization_of_the_dense_weight(dense, converted, name):
    for qtype in LEGACY:
        found = _tensors(converted[(name, qtype)])
        assert found.keys() == dense[name].keys(), qtype
        for key, values in dense[name].items():
            want_type = expected_type(key, values.shape, qtype)
            got_type, got = found[key]
            assert got_type == want_type, (qtype, key)
            want = gguf.quants.quantize(values, want_type).view(np.uint8).reshape(-1)
            assert np.array_equal(got, want), (qtype, key)


def test_metadata_is_a_flux_ggufs_and_the_pack_loads_every_file(converted):
    from comfyui_flux2dev.loaders.models.gguf_transformer import load_gguf_transformer

    for (name, qtype), path in converted.items():
        fields = gguf.GGUFReader(path).fields
        metadata = {k: fields[k].contents() for k in fields if not k.startswith("GGUF.")}
        assert metadata == {"general.architecture": "flux", "general.quantization_version": 2,
                            "general.file_type": FILE_TYPES[qtype]}, (name, qtype)
        loaded = load_gguf_transformer(path)
        assert loaded.variant.key == ("klein-4b" if name == "klein-4b" else "dev"), (name, qtype)


@pytest.fixture(scope="module")
def presets(tiny_root, tmp_path_factory) -> dict[tuple[str, str], str]:
    """Each K preset written from the tiny [dev] (BFL) and the tiny Klein 4B, whose rows of 128 hold no K block."""
    out = tmp_path_factory.mktemp("presets")
    done = {}
    for name in ("bfl", "klein-4b"):
        for preset in PRESETS:
            done[(name, preset)] = str(out / f"{name}-{preset}.gguf")
            convert_transformer(str(tiny_root / SOURCES[name][0]), done[(name, preset)], qtype=preset)
    return done


def test_each_preset_tensor_is_ggmls_quantization_of_the_dense_weight(dense, presets, ggml):
    """The per-tensor types are PRESETS' table; K-type tensors hold ggml's reference bytes of the dense weights, the
    others gguf-py's; the metadata is the preset's."""
    from comfyui_flux2dev.loaders.formats.gguf_types import K_TYPES
    from comfyui_flux2dev.loaders.models.gguf_transformer import load_gguf_transformer

    for (name, preset), path in presets.items():
        assert load_gguf_transformer(path).variant.key == ("klein-4b" if name == "klein-4b" else "dev")
        fields = gguf.GGUFReader(path).fields
        assert fields["general.file_type"].contents() == FILE_TYPES[preset], (name, preset)
        assert fields["general.quantization_version"].contents() == 2
        found = _tensors(path)
        assert found.keys() == dense[name].keys()
        for key, values in dense[name].items():
            want_type = expected_type(key, values.shape, preset)
            got_type, got = found[key]
            assert got_type == want_type, (name, preset, key)
            rows = values.reshape(-1, values.shape[-1]) if values.ndim else values.reshape(1, 1)
            want = ggml(want_type, rows) if want_type in K_TYPES else gguf.quants.quantize(values, want_type)
            assert np.array_equal(got, want.view(np.uint8).reshape(-1)), (name, preset, key)
    raised = {k: t for k, (t, _) in _tensors(presets[("bfl", "Q4_K_M")]).items() if t == Q.Q5_K}
    assert raised and all(k.endswith(FUSED_QKV) for k in raised)  # the rule met FLUX.2's names


def test_compare_states_a_preset_the_cast_of_its_source(tiny_root, presets):
    from comfyui_flux2dev.loaders.convert.identity import compare_weights, weights_at

    found = compare_weights(weights_at(str(tiny_root / SOURCES["bfl"][0])), weights_at(presets[("bfl", "Q4_K_M")]))
    assert set(found["counts"]) <= {"identical", "equal after dequantization", "B is a cast of A"}, found["counts"]
    assert found["counts"]["B is a cast of A"] > 0 and found["summary"].startswith("B is A exactly cast")


def test_every_layout_of_one_model_gives_the_same_bytes_and_so_does_a_second_run(tiny_root, converted, tmp_path):
    for qtype in ("Q4_1", "BF16"):
        first = open(converted[("bfl", qtype)], "rb").read()
        for name in ("diffusers", "pipeline"):
            assert open(converted[(name, qtype)], "rb").read() == first, (name, qtype)
    again = tmp_path / "again.gguf"
    convert_transformer(str(tiny_root / SOURCES["fp8-weight_scale"][0]), str(again), qtype="Q5_0")
    assert again.read_bytes() == open(converted[("fp8-weight_scale", "Q5_0")], "rb").read()


@pytest.mark.parametrize("value, dtype, qtype, said", [
    (float("nan"), torch.bfloat16, "Q8_0", "Q8_0: it holds NaN or infinite values"),
    # float64 values beyond float32 are told as they are, not as the infinities a float32 cast would make of them
    (1e300, torch.float64, "Q8_0", "Q8_0: it holds values up to 1e+300, beyond float16's 65504"),
    (-1e300, torch.float64, "Q4_K_M", "Q4_K: it holds values up to 1e+300, beyond float16's 65504"),
    (1e300, torch.float64, "BF16", "BF16: it holds values up to 1e+300, beyond float32's 3.40282e+38"),
], ids=["nan", "1e300-Q8_0", "1e300-Q4_K_M", "1e300-BF16"])
def test_a_weight_that_does_not_fit_is_refused_naming_it(tiny_root, tmp_path, value, dtype, qtype, said):
    from safetensors.torch import load_file, save_file

    weights = load_file(str(tiny_root / SOURCES["bfl"][0]))
    weights["single_blocks.1.linear2.weight"] = weights["single_blocks.1.linear2.weight"].to(dtype)
    weights["single_blocks.1.linear2.weight"][3, 5] = value
    save_file(weights, str(tmp_path / "bad.safetensors"))
    with pytest.raises(CorruptFileError) as refused:
        convert_transformer(str(tmp_path / "bad.safetensors"), str(tmp_path / "out.gguf"), qtype=qtype)
    assert f"single_blocks.1.linear2.weight cannot be written as {said}." in str(refused.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.safetensors"]


# --- LoRAs, through the host's own LoRA loader ------------------------------------------------------------------

HIDDEN = 256  # the tiny [dev]'s width


def _lora_pair(prefix: str, up: str, down: str, out_features: int, in_features: int, seed: int, rank: int = 4,
               alpha=None):
    g = torch.Generator().manual_seed(seed)
    pair = {f"{prefix}.{up}.weight": torch.randn(out_features, rank, generator=g) * 0.2,
            f"{prefix}.{down}.weight": torch.randn(rank, in_features, generator=g) * 0.2}
    if alpha is not None:
        pair[f"{prefix}.alpha"] = torch.tensor(float(alpha))
    return pair


def test_a_baked_lora_is_the_dense_weight_plus_its_product_then_quantized(comfy_host, tiny_root, dense, converted,
                                                                          tmp_path):
    """Two LoRAs in the formats the host reads for FLUX.2: generic BFL names and kohya's lora_unet_ names (with
    alpha), and diffusers' transformer.* names whose q, k and v land in slices of the fused qkv weight."""
    from safetensors.torch import save_file

    from comfyui_flux2dev.host.lora_bake import LoraBake

    first = {**_lora_pair("diffusion_model.double_blocks.0.img_attn.qkv", "lora_up", "lora_down", 3 * HIDDEN, HIDDEN,
                          1, alpha=2),
             **_lora_pair("lora_unet_single_blocks_1_linear2", "lora_up", "lora_down", HIDDEN, HIDDEN + 3 * HIDDEN,
                          2, alpha=8)}
    second = _lora_pair("transformer.transformer_blocks.1.attn.to_k", "lora_A", "lora_B", HIDDEN, HIDDEN, 3, rank=2)
    second = {k.replace("lora_A", "X").replace("lora_B", "lora_A").replace("X", "lora_B"): v for k, v in second.items()}
    save_file(first, str(tmp_path / "first.safetensors"))
    save_file(second, str(tmp_path / "second.safetensors"))
    out = tmp_path / "baked.gguf"
    convert_transformer(str(tiny_root / SOURCES["bfl"][0]), str(out), qtype="Q8_0",
                        patch=LoraBake([(str(tmp_path / "first.safetensors"), 0.7),
                                          (str(tmp_path / "second.safetensors"), -1.5)]))

    want = {k: torch.from_numpy(v.copy()) for k, v in dense["bfl"].items()}
    up, down = (first["diffusion_model.double_blocks.0.img_attn.qkv.lora_up.weight"],
                first["diffusion_model.double_blocks.0.img_attn.qkv.lora_down.weight"])
    want["double_blocks.0.img_attn.qkv.weight"] += (0.7 * (2 / 4)) * (up @ down)
    up, down = (first["lora_unet_single_blocks_1_linear2.lora_up.weight"],
                first["lora_unet_single_blocks_1_linear2.lora_down.weight"])
    want["single_blocks.1.linear2.weight"] += (0.7 * (8 / 4)) * (up @ down)
    up, down = (second["transformer.transformer_blocks.1.attn.to_k.lora_B.weight"],
                second["transformer.transformer_blocks.1.attn.to_k.lora_A.weight"])
    want["double_blocks.1.img_attn.qkv.weight"][HIDDEN : 2 * HIDDEN] += -1.5 * (up @ down)

    found = _tensors(str(out))
    plain = _tensors(converted[("bfl", "Q8_0")])
    patched = {"double_blocks.0.img_attn.qkv.weight", "single_blocks.1.linear2.weight",
               "double_blocks.1.img_attn.qkv.weight"}
    for key, values in want.items():
        qtype, got = found[key]
        if key in patched:
            assert np.array_equal(got, gguf.quants.quantize(values.numpy(), qtype).view(np.uint8).reshape(-1)), key
            assert not np.array_equal(got, plain[key][1]), key
        else:
            assert np.array_equal(got, plain[key][1]), key


def test_a_lora_of_another_model_is_refused(comfy_host, tiny_root, tmp_path):
    from safetensors.torch import save_file

    from comfyui_flux2dev.host.lora_bake import LoraBake

    save_file(_lora_pair("lora_unet_input_blocks_1_1_proj_in", "lora_up", "lora_down", 320, 320, 4),
              str(tmp_path / "sdxl.safetensors"))
    with pytest.raises(WrongModelError, match="patches nothing here: .*it is a LoRA of Stable Diffusion or SDXL"):
        convert_transformer(str(tiny_root / SOURCES["bfl"][0]), str(tmp_path / "out.gguf"), qtype="Q4_0",
                            patch=LoraBake([(str(tmp_path / "sdxl.safetensors"), 1.0)]))
    assert not (tmp_path / "out.gguf").exists()


def test_a_bake_says_which_layers_it_applied_and_refuses_a_lora_that_misfits(comfy_host, tiny_root, converted,
                                                                            tmp_path):
    """Of one LoRA: a layer that fits its weight, one of a text encoder, one whose factors multiply to zero. Of
    another: a layer shaped for another weight, refused before a byte is written."""
    from safetensors.torch import save_file

    from comfyui_flux2dev.host.lora_bake import LoraBake, summary

    up, down = "lora_up", "lora_down"
    zero = {**_lora_pair("diffusion_model.double_blocks.1.img_attn.qkv", up, down, 3 * HIDDEN, HIDDEN, 2)}
    zero["diffusion_model.double_blocks.1.img_attn.qkv.lora_up.weight"].zero_()
    mixed = {**_lora_pair("diffusion_model.double_blocks.0.img_attn.qkv", up, down, 3 * HIDDEN, HIDDEN, 1), **zero,
             **_lora_pair("lora_te_model_layers_0_mlp_up_proj", up, down, HIDDEN, HIDDEN, 3)}
    save_file(mixed, str(tmp_path / "mixed.safetensors"))
    bake = LoraBake([(str(tmp_path / "mixed.safetensors"), 1.0)])
    out = tmp_path / "baked.gguf"
    convert_transformer(str(tiny_root / SOURCES["bfl"][0]), str(out), qtype="Q8_0", patch=bake)
    (baked,) = bake.baked
    qkv0, qkv1, te = ("diffusion_model.double_blocks.0.img_attn.qkv", "diffusion_model.double_blocks.1.img_attn.qkv",
                      "lora_te_model_layers_0_mlp_up_proj")
    assert baked.report.applied == {"transformer": [f"{qkv0}.lora_up.weight", f"{qkv0}.lora_down.weight"]}
    assert summary(baked) == (
        f"LoRA {tmp_path / 'mixed.safetensors'} (strength 1): 2 of 6 LoRA tensors applied, changing 1 weight of the "
        f"transformer; 2 not applied, naming no layer of the FLUX.2 transformer or its text encoder given: "
        f"{te}.lora_down.weight, {te}.lora_up.weight; 2 not applied, that change nothing here (factors that multiply "
        f"to zero, or a change below float32's precision): {qkv1}.lora_down.weight, {qkv1}.lora_up.weight")
    found, plain = _tensors(str(out)), _tensors(converted[("bfl", "Q8_0")])
    patched = "double_blocks.0.img_attn.qkv.weight"
    assert not np.array_equal(found[patched][1], plain[patched][1])
    assert all(np.array_equal(found[k][1], plain[k][1]) for k in plain if k != patched)

    save_file(_lora_pair("diffusion_model.double_blocks.0.img_attn.proj", up, down, 3 * HIDDEN, HIDDEN, 4),
              str(tmp_path / "misfit.safetensors"))
    said = (r"none of its 2 tensors lands on the transformer \(its layers are shaped unlike the weights they name, "
            r"diffusion_model.double_blocks.0.img_attn.proj.lora_down.weight makes a difference of shape \[768, 256\]")
    with pytest.raises(WrongModelError, match=said):
        convert_transformer(str(tiny_root / SOURCES["bfl"][0]), str(tmp_path / "out.gguf"), qtype="Q8_0",
                            patch=LoraBake([(str(tmp_path / "misfit.safetensors"), 1.0)]))
    assert not (tmp_path / "out.gguf").exists()
