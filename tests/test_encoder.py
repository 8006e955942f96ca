"""The FLUX.2 [dev] encoder loader end to end: every tiny layout through the host's CLIP, compared with
transformers' Mistral on the same (or the independently dequantized) weights."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from comfyui_flux2dev.errors import MissingWeightsError, UnknownModelError, WrongModelError
from comfyui_flux2dev.loaders import encoder as enc
from comfyui_flux2dev.tiny import encoders as tiny

PROMPTS = ("a red fox in the snow", "Ein Café, 2024: [IMG] 3 cats <s>!")
BF16_LAYOUTS = {
    "hf-mistral3": "hf-mistral3",
    "hf-mistral3-old-prefix": "hf-mistral3",
    "standalone": "standalone-folder",
    "mistral_3_small_flux2_bf16.safetensors": "comfy-single-file",
    "native": "mistral-native",
    "pipeline": "diffusers-pipeline",
}
QUANTIZED = {
    "mistral_3_small_flux2_fp8.safetensors": "fp8",
    "mistral_3_small_flux2_fp8_channel.safetensors": "fp8",
    "mistral_3_small_flux2_fp4_mixed.safetensors": "nvfp4",
    "llama-q8_0.gguf": "gguf",
    "mistral3-q4_0.gguf": "gguf",
    "mistral3-q4_k.gguf": "gguf",
    "cow-f16.gguf": "gguf",
}


@pytest.fixture(scope="session")
def encoders(tiny_root, tmp_path_factory):
    """A folder of the tiny encoders, with the tiny [dev] pipeline as one more layout."""
    folder = tmp_path_factory.mktemp("encoders")
    for entry in (tiny_root / "text_encoders").iterdir():
        (folder / entry.name).symlink_to(entry, target_is_directory=entry.is_dir())
    (folder / "pipeline").symlink_to(tiny_root / "diffusers" / "flux2-dev-tiny-pipeline", target_is_directory=True)
    return str(folder)


def _hidden(model, ids, mask):
    out = model(input_ids=torch.tensor([ids]), attention_mask=torch.tensor([mask]), output_hidden_states=True)
    return torch.cat([out.hidden_states[i] for i in (10, 20, 30)], dim=-1)


@pytest.fixture(scope="session")
def hf_reference(encoders):
    """transformers' Mistral3 as saved on the hub (40 layers), float32, SDPA."""
    from transformers import Mistral3ForConditionalGeneration

    model = Mistral3ForConditionalGeneration.from_pretrained(
        os.path.join(encoders, "hf-mistral3"), attn_implementation="sdpa"
    ).float().eval()
    return model.model.language_model


def _mistral_with(state_dict: dict) -> torch.nn.Module:
    """A 30-layer transformers MistralModel on given weights, final norm removed (FLUX.2 reads raw layer 29)."""
    from transformers import MistralConfig, MistralModel

    config = MistralConfig(**{k: v for k, v in tiny.text_config(tiny.PRUNED).items() if k != "model_type"})
    config._attn_implementation = "sdpa"
    model = MistralModel(config).float().eval()
    missing, unexpected = model.load_state_dict(state_dict, strict=False)
    assert set(missing) <= {"norm.weight"} and not unexpected
    model.norm = torch.nn.Identity()
    return model


def _dequantized_weights(path, dequantize) -> dict:
    """The file's model.* weights in transformers' MistralModel names, each through `dequantize(weight,
    companions by suffix)`, an implementation independent of the pack's."""
    from safetensors.torch import load_file

    sd = load_file(path)
    out = {}
    for k, v in sd.items():
        if k.startswith("model.") and k.endswith(".weight"):
            stem = k[: -len("weight")]
            companions = {name[len(stem):]: t for name, t in sd.items() if name.startswith(stem) and name != k}
            out[k[len("model."):]] = dequantize(v, companions).float()
    return out


def _fp8_reference(path):
    def dequantize(weight, companions):
        scale = companions.get("weight_scale", companions.get("scale_weight"))
        if scale is None:
            return weight
        return weight.float() * (scale.float().reshape(-1, 1) if scale.numel() > 1 else scale.float())

    return _dequantized_weights(path, dequantize)


def _nvfp4_reference(path):
    from comfy_kitchen.backends.eager.quantization import dequantize_nvfp4

    def dequantize(weight, companions):
        if weight.dtype != torch.uint8:
            return weight
        return dequantize_nvfp4(weight, companions["weight_scale_2"], companions["weight_scale"], output_type=torch.float32)

    return _dequantized_weights(path, dequantize)


def _gguf_reference(path):
    import gguf

    names = {v: k for k, v in tiny.GGUF.items()}
    reader = gguf.GGUFReader(path)
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    heads = {"self_attn.q_proj": tiny.TINY_MISTRAL.heads, "self_attn.k_proj": tiny.TINY_MISTRAL.kv_heads}
    out = {}
    for t in reader.tensors:
        if t.name == "token_embd.weight":
            key = "embed_tokens.weight"
        elif t.name.startswith("blk.") and int(t.name.split(".")[1]) < tiny.PRUNED:
            _, i, part, _ = t.name.split(".")
            key = f"layers.{i}.{names[part]}.weight"
        else:
            continue
        w = torch.from_numpy(np.array(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32))
        w = w.reshape(tuple(int(d) for d in reversed(t.shape)))
        module = key.split(".", 2)[-1][: -len(".weight")]
        if arch in ("llama", "mistral3") and module in heads:  # llama.cpp stores Q/K rows interleaved
            h, rows = heads[module], w.shape[0]
            w = w.reshape(h, rows // h // 2, 2, -1).transpose(1, 2).reshape(rows, -1)
        out[key] = w
    return out


REFERENCES = {"fp8": _fp8_reference, "nvfp4": _nvfp4_reference, "gguf": _gguf_reference}


def _host_cond(clip, prompt):
    return clip.encode_from_tokens(clip.tokenize(prompt), return_dict=True)["cond"]


def _check(clip, reference, tokenizer, padding):
    from comfyui_flux2dev.tokenizers import prompt_ids

    for prompt in PROMPTS:
        ids, mask = prompt_ids(tokenizer, prompt, padding)
        assert [t[0] for t in clip.tokenize(prompt)["mistral3_24b"][0]] == ids
        got = _host_cond(clip, prompt)
        with torch.no_grad():
            want = _hidden(reference, ids, mask)
        assert got.shape == want.shape == (1, len(ids), 3 * 64)
        assert torch.isfinite(got).all()
        assert (got - want).abs().max().item() <= 1e-5, (prompt, padding, (got - want).abs().max().item())


@pytest.mark.transformers_matrix
@pytest.mark.parametrize("padding", ["reference", "comfy"])
@pytest.mark.parametrize("name", sorted(BF16_LAYOUTS))
def test_bf16_layouts_match_transformers(comfy_host, encoders, hf_reference, name, padding):
    from comfyui_flux2dev.host.clip import load_clip

    path = os.path.join(encoders, name)
    clip = load_clip(path, padding=padding, dtype=torch.float32)
    assert clip.flux2dev_encoder["layout"] == BF16_LAYOUTS[name]
    _check(clip, hf_reference, clip.tokenizer.tokenizer, padding)


@pytest.mark.transformers_matrix
@pytest.mark.parametrize("name", sorted(QUANTIZED))
def test_quantized_layouts_match_transformers_on_dequantized_weights(comfy_host, encoders, name):
    from comfyui_flux2dev.host.clip import load_clip

    path = os.path.join(encoders, name)
    reference = _mistral_with(REFERENCES[QUANTIZED[name]](path))
    clip = load_clip(path, padding="reference", dtype=torch.float32)
    _check(clip, reference, clip.tokenizer.tokenizer, "reference")


def test_quantized_weights_stay_packed_in_the_host(comfy_host, encoders):
    from comfyui_flux2dev.host.clip import load_clip

    for name, dtype in (("mistral_3_small_flux2_fp8.safetensors", torch.float8_e4m3fn),
                        ("mistral_3_small_flux2_fp4_mixed.safetensors", torch.uint8), ("llama-q8_0.gguf", torch.uint8)):
        clip = load_clip(os.path.join(encoders, name), dtype=torch.bfloat16)
        layer = clip.cond_stage_model.mistral3_24b.transformer.model.layers[5]
        assert layer.self_attn.q_proj.weight.dtype == dtype, name


@pytest.mark.parametrize(
    "name", ("mistral_3_small_flux2_fp8_channel.safetensors", "mistral_3_small_flux2_fp4_mixed.safetensors", "llama-q8_0.gguf")
)
def test_lora_applies_to_the_dequantized_encoder_weight(comfy_host, encoders, name):
    from comfy.model_management import load_model_gpu

    from comfyui_flux2dev.host.clip import load_clip

    clip = load_clip(os.path.join(encoders, name), dtype=torch.float32)
    layer_name = "mistral3_24b.transformer.model.layers.5.self_attn.q_proj"
    layer = clip.cond_stage_model.get_submodule(layer_name)
    stored = layer.weight.detach().clone()
    g = torch.Generator().manual_seed(2)
    up = torch.randn(layer.out_features, 4, generator=g) * 0.1
    down = torch.randn(4, layer.in_features, generator=g) * 0.1
    prefix = f"text_encoders.{layer_name}"
    lora = {f"{prefix}.lora_up.weight": up, f"{prefix}.lora_down.weight": down, f"{prefix}.alpha": torch.tensor(4.0)}
    _, patched = comfy_host.load_lora_for_models(None, clip, lora, 0.0, 1.0)
    assert len(patched.patcher.patches) == 1
    x = torch.randn(3, layer.in_features, generator=g)
    delta = x @ (up @ down).T  # alpha / rank = 1
    assert delta.abs().max() > 1e-2
    with torch.no_grad():  # the host's own loading swaps the patched clone in and out
        load_model_gpu(clip.patcher)
        plain = layer(x)
        load_model_gpu(patched.patcher)
        out = layer(x)
        load_model_gpu(clip.patcher)
        again = layer(x)
    assert (out - plain - delta).abs().max().item() <= 1e-5
    assert torch.equal(again, plain)
    # the stored weight stays packed and untouched
    assert layer.weight.dtype == stored.dtype and torch.equal(layer.weight.view(torch.uint8), stored.view(torch.uint8))


def test_nvfp4_dequant_is_exact_against_comfy_kitchen():
    from comfy_kitchen.backends.eager.quantization import dequantize_nvfp4
    from comfy_kitchen.float_utils import to_blocked

    from comfyui_flux2dev.loaders import quant

    w = torch.randn(200, 96, generator=torch.Generator().manual_seed(1))
    packed, scales, scale2 = tiny.quantize_nvfp4(w)
    plain = quant.unswizzle_block_scales(scales, 200, 6)
    assert torch.equal(to_blocked(plain, flatten=False).view(torch.uint8), scales.view(torch.uint8))
    ours = quant.dequantize_nvfp4(packed, scales, scale2, torch.float32)
    theirs = dequantize_nvfp4(packed, scale2, scales, output_type=torch.float32)
    assert torch.equal(ours, theirs)
    assert (ours - w).abs().max() < 0.5 * w.abs().max()  # and it is the weight, roughly


def test_only_layers_0_to_29_and_embeddings_are_read(encoders, monkeypatch):
    from comfyui_flux2dev.loaders.safetensors_file import SafetensorsFiles

    read = []
    original = SafetensorsFiles.read
    monkeypatch.setattr(SafetensorsFiles, "read", lambda self, name: read.append(name) or original(self, name))
    loaded = enc.load_encoder(os.path.join(encoders, "hf-mistral3"))
    assert loaded.layers_in_file == 40 and loaded.layout == "hf-mistral3"
    layers = {int(k.split(".")[3]) for k in read if ".layers." in k}
    assert layers == set(range(30))
    assert not any(k.startswith(("lm_head", "model.vision_tower", "model.multi_modal_projector")) or "norm.weight" == k[-11:] and ".layers." not in k for k in read)
    assert len(read) == 1 + 30 * 9 == len(loaded.reads)
    assert "lm_head.weight" in loaded.skips and "model.language_model.layers.39.mlp.up_proj.weight" in loaded.skips
    assert any(k.startswith("model.vision_tower.") for k in loaded.skips)
    assert loaded.rope_theta == 1e9 and loaded.formats == {"bf16": 271}


def test_inspect_reports_layout_formats_and_tokenizer(encoders):
    info = enc.inspect_encoder(os.path.join(encoders, "mistral_3_small_flux2_fp8_channel.safetensors"))
    assert info["kind"] == "encoder" and info["layout"] == "comfy-single-file" and info["variant"] == "dev"
    assert info["layers"] == 30 and info["reads"] == 1 + 30 * 9 + 210 and info["formats"] == {"bf16": 61, "fp8-scaled": 210}
    assert info["tokenizer"]["rung"] == "embedded-tekken"
    # fp8 linears (1 byte) + fp32 per-channel scales + bf16 embeddings and norms
    assert info["memory_bytes"] < 131072 * 64 * 2 + 30 * 73728 * 1.2


def test_native_and_gguf_rows_are_unpermuted(encoders):
    hf = enc.load_encoder(os.path.join(encoders, "mistral_3_small_flux2_bf16.safetensors")).state_dict
    native = enc.load_encoder(os.path.join(encoders, "native")).state_dict
    for k in ("model.layers.3.self_attn.q_proj.weight", "model.layers.3.self_attn.k_proj.weight"):
        assert torch.equal(hf[k], native[k])


# --- what the loader says about files that are not a [dev] encoder -------------------------------------------


def _save(path, tensors):
    from safetensors.torch import save_file

    save_file(tensors, path)
    return path


def test_klein_encoder_shapes_name_the_klein_model(monkeypatch):
    monkeypatch.delenv("FLUX2DEV_TINY_MODELS")
    shapes = {"model.embed_tokens.weight": (151936, 2560), "model.layers.0.self_attn.q_proj.weight": (4096, 2560),
              "model.layers.0.self_attn.q_norm.weight": (128,)}
    with pytest.raises(WrongModelError) as e:
        enc.identify(shapes)
    assert str(e.value) == (
        "This is the Qwen3-4B text encoder of FLUX.2 Klein 4B (hidden size 2560, attention q_norm present), not the "
        "Mistral-Small 24B encoder FLUX.2 [dev] needs. Use it with the matching FLUX.2 Klein model, or pick a FLUX.2 "
        "[dev] encoder (mistral_3_small_flux2_*.safetensors or a Mistral-Small-3.x folder) here."
    )
    shapes["model.embed_tokens.weight"] = (151936, 4096)
    with pytest.raises(WrongModelError, match=r"^This is the Qwen3-8B text encoder of FLUX.2 Klein 9B \(hidden size 4096"):
        enc.identify(shapes)


def test_wrong_files_are_named(tmp_path):
    t = torch.zeros
    klein = _save(str(tmp_path / "qwen.safetensors"), {"model.embed_tokens.weight": t(151936, 32),
                                                        "model.layers.0.self_attn.q_norm.weight": t(128)})
    with pytest.raises(WrongModelError, match=r"^This is the tiny Qwen3 text encoder of FLUX.2 Klein 4B \(tiny test model\)"):
        enc.load_encoder(klein)
    dit = _save(str(tmp_path / "flux2.safetensors"), {"double_blocks.0.img_attn.qkv.weight": t(12, 4)})
    with pytest.raises(WrongModelError) as e:
        enc.load_encoder(dit)
    assert str(e.value) == (
        "This is a FLUX.2 diffusion transformer, not a text encoder. Load it with FLUX.2 transformer source or Load "
        "FLUX.2 GGUF transformer, and pick a Mistral-Small text encoder (e.g. mistral_3_small_flux2_bf16.safetensors) "
        "here."
    )
    vae = _save(str(tmp_path / "ae.safetensors"), {"decoder.conv_in.weight": t(4, 4, 3, 3), "bn.running_mean": t(128)})
    with pytest.raises(WrongModelError) as e:
        enc.load_encoder(vae)
    assert str(e.value) == (
        "This is a VAE (autoencoder), not a text encoder. Load it with FLUX.2 VAE source or Load VAE, and pick a "
        "Mistral-Small text encoder (e.g. mistral_3_small_flux2_bf16.safetensors) here."
    )
    llama = _save(str(tmp_path / "llama.safetensors"), {"model.embed_tokens.weight": t(32000, 64)})
    with pytest.raises(WrongModelError, match=r"^This is a Llama-family model with a 32000-token vocabulary"):
        enc.load_encoder(llama)
    odd = _save(str(tmp_path / "odd.safetensors"), {"something.weight": t(3)})
    with pytest.raises(UnknownModelError):
        enc.load_encoder(odd)


def test_missing_weights_are_named_never_filled(encoders, tmp_path):
    from safetensors.torch import load_file

    sd = load_file(os.path.join(encoders, "mistral_3_small_flux2_bf16.safetensors"))
    del sd["model.layers.17.mlp.down_proj.weight"]
    path = _save(str(tmp_path / "cut.safetensors"), sd)
    with pytest.raises(MissingWeightsError, match=r"lacks 1 tensor\(s\) the FLUX.2 \[dev\] encoder needs: model.layers.17.mlp.down_proj.weight\."):
        enc.load_encoder(path)


def test_fp8_without_scale_is_missing(encoders, tmp_path):
    from safetensors.torch import load_file

    sd = load_file(os.path.join(encoders, "mistral_3_small_flux2_fp8.safetensors"))
    del sd["model.layers.2.self_attn.q_proj.scale_weight"]
    path = _save(str(tmp_path / "noscale.safetensors"), sd)
    with pytest.raises(MissingWeightsError, match=r"model.layers.2.self_attn.q_proj.weight_scale"):
        enc.load_encoder(path)


@pytest.mark.transformers_matrix
def test_rotary_theta_comes_from_the_checkpoint(comfy_host, encoders, tmp_path):
    """A checkpoint that says theta 1e6 is encoded with 1e6 (in float32), not with the table's 1e9."""
    import json
    import shutil

    from transformers import Mistral3ForConditionalGeneration

    from comfyui_flux2dev.host.clip import load_clip

    folder = tmp_path / "theta-1e6"
    shutil.copytree(os.path.join(encoders, "hf-mistral3"), folder)
    config = json.loads((folder / "config.json").read_text())
    text = config["text_config"]
    text["rope_theta"] = 1e6
    if "rope_parameters" in text:
        text["rope_parameters"]["rope_theta"] = 1e6
    (folder / "config.json").write_text(json.dumps(config))
    reference = Mistral3ForConditionalGeneration.from_pretrained(folder, attn_implementation="sdpa").float().eval()
    clip = load_clip(str(folder), padding="comfy", dtype=torch.float32)
    assert enc.load_encoder(str(folder)).rope_theta == 1e6
    _check(clip, reference, clip.tokenizer.tokenizer, "comfy")
    default = load_clip(os.path.join(encoders, "hf-mistral3"), padding="comfy", dtype=torch.float32)
    assert not torch.equal(_host_cond(clip, PROMPTS[0]), _host_cond(default, PROMPTS[0]))


@pytest.mark.transformers_matrix
def test_a_gguf_encoder_header_is_parsed_once_for_weights_and_tokenizer(encoders):
    from comfyui_flux2dev.loaders import gguf_file

    before = gguf_file.parse_count()
    loaded = enc.load_encoder(os.path.join(encoders, "mistral3-q4_0.gguf"))
    assert gguf_file.parse_count() - before == 1
    assert loaded.tokenizer.rung == "gguf-vocab"
