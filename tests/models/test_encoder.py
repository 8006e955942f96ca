"""The FLUX.2 [dev] encoder loader end to end: every tiny layout through the host's CLIP, compared with
transformers' Mistral on the same (or the independently dequantized) weights."""

from __future__ import annotations

import collections
import copy
import os

import numpy as np
import pytest
import torch

import references
from comfyui_flux2dev.devtools.tiny import encoders as tiny
from comfyui_flux2dev.errors import MissingWeightsError, UnknownModelError, UnsupportedFormatError, WrongModelError
from comfyui_flux2dev.loaders.models import encoder as enc
from helpers import on_device

PROMPTS = ("a red fox in the snow", "Ein Café, 2024: [IMG] 3 cats <s>!")
# The tiny encoders, from the table that writes them: bf16 ones (with the tiny [dev] pipeline as one more
# layout) against transformers, packed ones against their own dequantization (references.WEIGHTS, by format family).
BF16_LAYOUTS = {**{e.name: e.layout for e in tiny.ENCODERS if e.format == "bf16"}, "pipeline": "diffusers-pipeline"}
QUANTIZED = {e.name: e.format.split("-")[0] for e in tiny.ENCODERS if e.format != "bf16"}


@pytest.fixture(scope="session")
def encoders(tiny_root, tmp_path_factory):
    """A folder of the tiny encoders, with the tiny [dev] pipeline as one more layout."""
    folder = tmp_path_factory.mktemp("encoders")
    for entry in (tiny_root / "text_encoders").iterdir():
        (folder / entry.name).symlink_to(entry, target_is_directory=entry.is_dir())
    (folder / "pipeline").symlink_to(tiny_root / "diffusers" / "flux2-dev-tiny-pipeline", target_is_directory=True)
    return str(folder)


# How far the host's conditioning may be from transformers' (float32 both): on a GPU their attention and matmul
# kernels differ more than on the CPU.
TOLERANCE = {"cpu": 1e-5, "cuda": 1e-4}


def _hidden(model, ids, mask):
    device = next(model.parameters()).device
    out = model(input_ids=torch.tensor([ids], device=device), attention_mask=torch.tensor([mask], device=device),
                output_hidden_states=True)
    return torch.cat([out.hidden_states[i] for i in (10, 20, 30)], dim=-1).cpu()


def _on(model, device):
    """A reference model on the test's device: the model itself on the CPU, a copy elsewhere."""
    return model if device.type == "cpu" else copy.deepcopy(model).to(device)


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


def _encoder_weights(weights: dict) -> dict:
    """The embeddings and layers 0..29 of a file's weights (references.WEIGHTS) in MistralModel's names."""
    def kept(key: str) -> bool:
        return key == "model.embed_tokens.weight" \
            or key.startswith("model.layers.") and int(key.split(".")[2]) < tiny.PRUNED

    return {k[len("model."):]: v for k, v in weights.items() if kept(k)}


def _host_cond(clip, prompt):
    return clip.encode_from_tokens(clip.tokenize(prompt), return_dict=True)["cond"].cpu()


def _check(clip, reference, tokenizer, padding, device=torch.device("cpu")):
    """The CLIP's conditioning on `device` (the host loads it there) against the reference's, run there too."""
    from comfyui_flux2dev.tokenizers import prompt_ids

    on_device(clip.patcher, device)
    reference = _on(reference, device)
    for prompt in PROMPTS:
        ids, mask = prompt_ids(tokenizer, prompt, padding)
        assert [t[0] for t in clip.tokenize(prompt)["mistral3_24b"][0]] == ids
        got = _host_cond(clip, prompt)
        with torch.no_grad():
            want = _hidden(reference, ids, mask)
        assert got.shape == want.shape == (1, len(ids), 3 * 64)
        assert torch.isfinite(got).all()
        assert (got - want).abs().max().item() <= TOLERANCE[device.type], \
            (prompt, padding, (got - want).abs().max().item())


@pytest.mark.transformers_matrix
@pytest.mark.parametrize("padding", ["reference", "comfy"])
@pytest.mark.parametrize("name", sorted(BF16_LAYOUTS))
def test_bf16_layouts_match_transformers(comfy_host, encoders, hf_reference, name, padding, device):
    from comfyui_flux2dev.host.clip import load_clip

    path = os.path.join(encoders, name)
    clip = load_clip(path, padding=padding, dtype=torch.float32)
    assert clip.flux2dev_encoder["layout"] == BF16_LAYOUTS[name]
    _check(clip, hf_reference, clip.tokenizer.tokenizer, padding, device)


@pytest.mark.transformers_matrix
@pytest.mark.parametrize("name", sorted(QUANTIZED))
def test_quantized_layouts_match_transformers_on_dequantized_weights(comfy_host, encoders, name, device):
    from comfyui_flux2dev.host.clip import load_clip

    path = os.path.join(encoders, name)
    reference = _mistral_with(_encoder_weights(references.WEIGHTS[QUANTIZED[name]](path)))
    clip = load_clip(path, padding="reference", dtype=torch.float32)
    _check(clip, reference, clip.tokenizer.tokenizer, "reference", device)


def test_reference_padding_runs_each_layer_once(comfy_host, encoders):
    """The pads of reference padding ride along in each layer's MLP beside the real tokens: every linear layer runs
    once per encode, so its weights are read (and dequantized) once, not a second time for the pads."""
    from comfyui_flux2dev.host.clip import load_clip
    from comfyui_flux2dev.host.clip_tokenizer import CLIP_NAME

    clip = load_clip(os.path.join(encoders, "mistral_3_small_flux2_fp8.safetensors"), padding="reference")
    calls = collections.Counter()
    for name, module in getattr(clip.cond_stage_model, CLIP_NAME).transformer.model.layers.named_modules():
        if isinstance(module, torch.nn.Linear):
            module.register_forward_pre_hook(lambda module, args, name=name: calls.update([name]))
    with torch.inference_mode():
        _host_cond(clip, PROMPTS[0])
    assert calls and set(calls.values()) == {1}, calls


@pytest.mark.parametrize("name", ("hf-mistral3", "mistral_3_small_flux2_fp8.safetensors", "mistral3-q4_k.gguf"))
def test_the_default_encode_is_closer_to_float32_than_the_reference_pipelines_bf16(comfy_host, encoders, hf_reference,
                                                                                  name):
    """A CLIP as the nodes make it (bf16 for these files) multiplies in bf16 where the CPU does it natively, keeping
    everything else in float32: its conditioning is no further from transformers' float32 encode than transformers'
    own bf16 encode, the dtype Black Forest Labs' and diffusers' FLUX.2 pipelines run the encoder in. Where the CPU
    multiplies bf16 slowly it stays float32's, within the float32 bar."""
    from comfyui_flux2dev.host.clip import load_clip
    from comfyui_flux2dev.host.ops import fast_cpu_matmul_dtype
    from comfyui_flux2dev.tokenizers import prompt_ids

    path = os.path.join(encoders, name)
    exact = _mistral_with(_encoder_weights(references.WEIGHTS[QUANTIZED[name]](path))) if name in QUANTIZED \
        else hf_reference
    bf16 = copy.deepcopy(exact).bfloat16()
    for padding in ("reference", "comfy"):
        clip = load_clip(path, padding=padding)
        assert clip.flux2dev_source.cpu_matmul_dtype == fast_cpu_matmul_dtype()
        for prompt in PROMPTS:
            ids, mask = prompt_ids(clip.tokenizer.tokenizer, prompt, padding)
            got = _host_cond(clip, prompt)
            with torch.no_grad():
                want = _hidden(exact, ids, mask)
                pipeline = _hidden(bf16, ids, mask).float()
            error = (got - want).abs().max().item()
            if fast_cpu_matmul_dtype() is None:
                assert error <= TOLERANCE["cpu"], (name, padding, prompt, error)
            else:
                assert 0 < error <= (pipeline - want).abs().max().item(), (name, padding, prompt, error)


def test_quantized_weights_stay_packed_in_the_host(comfy_host, encoders):
    from comfyui_flux2dev.host.clip import load_clip

    for name, dtype in (("mistral_3_small_flux2_fp8.safetensors", torch.float8_e4m3fn),
                        ("mistral_3_small_flux2_fp4_mixed.safetensors", torch.uint8), ("llama-q8_0.gguf", torch.uint8)):
        clip = load_clip(os.path.join(encoders, name), dtype=torch.bfloat16)
        layer = clip.cond_stage_model.mistral3_24b.transformer.model.layers[5]
        assert layer.self_attn.q_proj.weight.dtype == dtype, name


@pytest.mark.parametrize(
    "name",
    ("mistral_3_small_flux2_fp8_channel.safetensors", "mistral_3_small_flux2_fp4_mixed.safetensors", "llama-q8_0.gguf")
)
def test_lora_applies_to_the_dequantized_encoder_weight(comfy_host, encoders, name, device):
    from comfy.model_management import load_model_gpu

    from comfyui_flux2dev.host.clip import load_clip

    clip = load_clip(os.path.join(encoders, name), dtype=torch.float32)
    on_device(clip.patcher, device)  # the LoRA's clone below inherits it
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
    x = x.to(device)
    with torch.no_grad():  # the host's own loading swaps the patched clone in and out
        load_model_gpu(clip.patcher)
        plain = layer(x).cpu()
        load_model_gpu(patched.patcher)
        out = layer(x).cpu()
        load_model_gpu(clip.patcher)
        again = layer(x).cpu()
    assert (out - plain - delta).abs().max().item() <= TOLERANCE[device.type]
    assert torch.equal(again, plain)
    # the stored weight stays packed and untouched
    assert layer.weight.device.type == device.type
    assert layer.weight.dtype == stored.dtype \
        and torch.equal(layer.weight.cpu().view(torch.uint8), stored.view(torch.uint8))


def test_nvfp4_dequant_is_exact_against_comfy_kitchen(device):
    from comfy_kitchen.backends.eager.quantization import dequantize_nvfp4
    from comfy_kitchen.float_utils import to_blocked

    from comfyui_flux2dev.loaders.formats import packed_dequant

    w = torch.randn(200, 96, generator=torch.Generator().manual_seed(1))
    packed, scales, scale2 = tiny.quantize_nvfp4(w)
    plain = packed_dequant.unswizzle_block_scales(scales, 200, 6)
    assert torch.equal(to_blocked(plain, flatten=False).view(torch.uint8), scales.view(torch.uint8))
    ours = packed_dequant.dequantize_nvfp4(packed.to(device), scales.to(device), scale2.to(device), torch.float32)
    theirs = dequantize_nvfp4(packed, scale2, scales, output_type=torch.float32)  # comfy_kitchen's, on the CPU
    assert ours.device.type == device.type
    ours = ours.cpu()
    assert torch.equal(ours, theirs)
    assert (ours - w).abs().max() < 0.5 * w.abs().max()  # and it is the weight, roughly


def test_only_layers_0_to_29_and_embeddings_are_read(encoders, monkeypatch):
    from comfyui_flux2dev.loaders.formats.safetensors_file import SafetensorsFiles

    read = []
    original = SafetensorsFiles.view
    monkeypatch.setattr(SafetensorsFiles, "view", lambda self, name: read.append(name) or original(self, name))
    loaded = enc.load_encoder(os.path.join(encoders, "hf-mistral3"))
    assert loaded.layers_in_file == 40 and loaded.layout == "hf-mistral3"
    layers = {int(k.split(".")[3]) for k in read if ".layers." in k}
    assert layers == set(range(30))
    assert not any(k.startswith(("lm_head", "model.vision_tower", "model.multi_modal_projector"))
                   or "norm.weight" == k[-11:] and ".layers." not in k for k in read)
    assert len(read) == 1 + 30 * 9 == len(loaded.reads)
    assert "lm_head.weight" in loaded.skips and "model.language_model.layers.39.mlp.up_proj.weight" in loaded.skips
    assert any(k.startswith("model.vision_tower.") for k in loaded.skips)
    assert loaded.rope_theta == 1e9 and loaded.formats == {"bf16": 271}


def test_inspect_reports_layout_formats_and_tokenizer(encoders):
    info = enc.inspect_encoder(os.path.join(encoders, "mistral_3_small_flux2_fp8_channel.safetensors"))
    assert info["kind"] == "encoder" and info["layout"] == "comfy-single-file" and info["variant"] == "dev"
    assert info["layers"] == 30 and info["reads"] == 1 + 30 * 9 + 210 \
        and info["formats"] == {"bf16": 61, "fp8-scaled": 210}
    assert info["tokenizer"]["rung"] == "embedded-tekken"
    # fp8 linears (1 byte) + fp32 per-channel scales + bf16 embeddings and norms
    assert info["memory_bytes"] < 131072 * 64 * 2 + 30 * 73728 * 1.2


# Files whose Q/K rows are stored interleaved, and how far their stored values may be from the model's
# (F16 rounding; Q8_0 blocks): far below what rows in the wrong order would give.
INTERLEAVED = {"native": 0.0, "mistral3-q4_k.gguf": 1e-3, "llama-q8_0.gguf": 2e-2}


@pytest.mark.parametrize("name", sorted(INTERLEAVED))
def test_native_and_gguf_rows_are_unpermuted(encoders, name):
    from comfyui_flux2dev.loaders.formats import packed_dequant, packing

    loaded = enc.load_encoder(os.path.join(encoders, name)).state_dict
    for k in ("model.layers.3.self_attn.q_proj.weight", "model.layers.3.self_attn.k_proj.weight"):
        stem = k[: -len("weight")]
        companions = {c: loaded[stem + c] for c in packing.COMPANIONS if stem + c in loaded}
        want = tiny.base_model()[k].float()
        got = packed_dequant.dequantize(loaded[k], companions, torch.float32, want.shape)
        assert (got - want).abs().max() <= INTERLEAVED[name] * want.abs().max(), k


# --- what the loader says about files that are not a [dev] encoder -------------------------------------------


def _save(path, tensors):
    from safetensors.torch import save_file

    save_file(tensors, path)
    return path


@pytest.mark.parametrize("width, klein", [(2560, "Qwen3-4B text encoder of FLUX.2 Klein 4B"),
                                          (4096, "Qwen3-8B text encoder of FLUX.2 Klein 9B")])
def test_klein_encoder_shapes_name_the_klein_model(monkeypatch, width, klein):
    monkeypatch.delenv("FLUX2DEV_TINY_MODELS")
    shapes = {"model.embed_tokens.weight": (151936, width), "model.layers.0.self_attn.q_proj.weight": (4096, width),
              "model.layers.0.self_attn.q_norm.weight": (128,)}
    with pytest.raises(WrongModelError,
                       match=rf"^This is the {klein} \(hidden size {width}, attention q_norm present\)"):
        enc.identify(shapes)


def _declared(fmt: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(f'{{"format": "{fmt}"}}'.encode()), dtype=torch.uint8)


Z = torch.zeros
# file -> (tensors, the error, how its message starts)
WRONG_FILES = {
    "qwen": ({"model.embed_tokens.weight": Z(151936, 32), "model.layers.0.self_attn.q_norm.weight": Z(128)},
             WrongModelError, r"This is the tiny Qwen3 text encoder of FLUX.2 Klein 4B \(tiny test model\)"),
    "flux2": ({"double_blocks.0.img_attn.qkv.weight": Z(12, 4)}, WrongModelError,
              r"This is a FLUX.2 diffusion transformer"),
    "ae": ({"decoder.conv_in.weight": Z(4, 4, 3, 3), "bn.running_mean": Z(128)}, WrongModelError, r"This is a VAE"),
    "llama": ({"model.embed_tokens.weight": Z(32000, 64)}, WrongModelError,
              r"This is a Llama-family model with a 32000-token vocabulary"),
    "odd": ({"something.weight": Z(3)}, UnknownModelError, r"This file is not a Mistral text encoder"),
    "undeclared-u8": ({"model.layers.0.mlp.up_proj.weight": Z(4, 8, dtype=torch.uint8)}, UnsupportedFormatError,
                      r"model.layers.0.mlp.up_proj.weight is stored as U8 with no comfy_quant tensor"),
    "declared-rowwise": ({"model.layers.0.mlp.up_proj.weight": Z(4, 8, dtype=torch.float8_e4m3fn),
                          "model.layers.0.mlp.up_proj.comfy_quant": _declared("float8_e4m3fn_rowwise")},
                         UnsupportedFormatError, r"model.layers.0.mlp.up_proj.weight is declared as "
                         r"'float8_e4m3fn_rowwise' quantization \(its comfy_quant tensor\), which no ComfyUI release"),
}


@pytest.mark.parametrize("name", sorted(WRONG_FILES))
def test_wrong_files_are_named(tmp_path, name):
    tensors, error, message = WRONG_FILES[name]
    with pytest.raises(error, match="^" + message):
        enc.load_encoder(_save(str(tmp_path / f"{name}.safetensors"), tensors))


@pytest.mark.parametrize(
    "architecture, error, message",
    [("flux", WrongModelError, r"x.gguf is a FLUX transformer GGUF, not a text encoder"),
     ("qwen3", WrongModelError, r"x.gguf is a Qwen3 text encoder \(FLUX.2 Klein's\)"),
     ("mamba", UnknownModelError, r".*x.gguf is a GGUF file of architecture 'mamba'; .* cow, llama, mistral3\.$")],
)
def test_gguf_files_of_other_architectures_are_named(tmp_path, architecture, error, message):
    import gguf

    from comfyui_flux2dev.devtools.tiny.gguf_blocks import write_and_close

    writer = gguf.GGUFWriter(str(tmp_path / "x.gguf"), architecture)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    write_and_close(writer)
    with pytest.raises(error, match=message):
        enc.load_encoder(str(tmp_path / "x.gguf"))


@pytest.mark.parametrize(
    "name, cut, missing",
    [
        ("mistral_3_small_flux2_bf16.safetensors", "model.layers.17.mlp.down_proj.weight",
         r"lacks 1 tensor\(s\) the FLUX.2 \[dev\] encoder needs: model.layers.17.mlp.down_proj.weight\."),
        ("mistral_3_small_flux2_fp8.safetensors", "model.layers.2.self_attn.q_proj.scale_weight",
         r"needs: model.layers.2.self_attn.q_proj.weight_scale\."),
        ("mistral_3_small_flux2_fp4_mixed.safetensors", "model.layers.4.mlp.up_proj.weight_scale_2",
         r"needs: model.layers.4.mlp.up_proj.weight_scale_2\."),
    ],
)
def test_missing_weights_are_named_never_filled(encoders, tmp_path, name, cut, missing):
    from safetensors.torch import load_file

    sd = load_file(os.path.join(encoders, name))
    del sd[cut]
    path = _save(str(tmp_path / "cut.safetensors"), sd)
    with pytest.raises(MissingWeightsError, match=missing):
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
    from comfyui_flux2dev.loaders.formats import gguf_file

    before = gguf_file.parse_count()
    loaded = enc.load_encoder(os.path.join(encoders, "mistral3-q4_0.gguf"))
    assert gguf_file.parse_count() - before == 1
    assert loaded.tokenizer.rung == "gguf-vocab"
