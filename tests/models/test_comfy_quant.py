"""comfy_quant files as their writers make them (convert-to-quant in every mode with its FLUX.2 filters,
comfy-kitchen's layouts with ComfyUI's declarations), read by the pack on the running host and checked against
ComfyUI 0.33's meaning of each file (quant_writers.reference_weight: the host's own dequantization):

- every declared weight, as the pack's loader hands it to the host's layers, dequantizes to the host's float32
  values (to float32 rounding) and, in bf16, to within one bf16 step of them;
- the encoder's conditioning, and the transformer's output, are within 1e-5 (relative) of the same models on the
  host's dequantized weights (transformers' Mistral for the encoder, the host's own FLUX.2 for the transformer);
- what no ComfyUI release reads is refused with the pack's error, naming the layer and the format (and ComfyUI 0.33
  fails on those files too); `flux2dev inspect` reports what the loaders read.
"""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch

import quant_writers
from comfyui_flux2dev.devtools.tiny import encoders as tiny
from comfyui_flux2dev.errors import CorruptFileError, UnsupportedFormatError
from comfyui_flux2dev.loaders.formats import packed_dequant, packing
from helpers import dense_model, flux2_forward, on_device

PARTS = {"encoder": "text_encoders/mistral_3_small_flux2_bf16.safetensors",
         "transformer": "diffusion_models/flux2-dev-tiny.safetensors"}
PRE_QUANT_LAYER = {"encoder": "model.layers.1.self_attn.o_proj", "transformer": "double_blocks.1.img_mlp.2"}
# (part, writer, mode) of every file written, and whether ComfyUI 0.33 reads it as it is
CASES = {
    **{(part, "convert-to-quant", mode): quant_writers.CONVERT_TO_QUANT[mode][2]
       for part in PARTS for mode in quant_writers.CONVERT_TO_QUANT_MODES[part]},
    **{(part, "comfy-kitchen", mode): spec[3] for part in PARTS for mode, spec in quant_writers.KITCHEN.items()},
    **{(part, "comfy-kitchen", "nvfp4-pre_quant_scale"): True for part in PARTS},
}
READ = [case for case, reads in CASES.items() if reads]
REFUSED = [case for case, reads in CASES.items() if not reads]
# The pack's word for each comfy_quant format (and ConvRot INT8), as inspect reports it.
LABELS = {"float8_e4m3fn": "fp8-scaled", "float8_e5m2": "fp8-scaled", "nvfp4": "nvfp4", "mxfp8": "mxfp8",
          "int8_tensorwise": "int8", "convrot_w4a4": "convrot-w4a4", "asym_w4a8_int8": "w4a8"}
READ_PAST = ("input_scale", "comfy_quant")  # stored beside packed weights, no part of their values


def _id(case) -> str:
    return "-".join(case)


def _load(path):
    from safetensors.torch import load_file

    return load_file(str(path))


@pytest.fixture(scope="module")
def written(tiny_root, tmp_path_factory) -> dict[tuple[str, str, str], object]:
    """Every file of CASES, written once for the module."""
    from safetensors.torch import save_file

    folder = tmp_path_factory.mktemp("comfy_quant")
    sources = {part: tiny_root / path for part, path in PARTS.items()}
    files = {(part, "convert-to-quant", mode): path
             for (part, mode), path in quant_writers.convert_to_quant(sources, folder).items()}
    for part, source in sources.items():
        base = _load(source)
        for mode in filter(quant_writers.kitchen_writes, quant_writers.KITCHEN):
            files[part, "comfy-kitchen", mode] = folder / f"{part}-kitchen-{mode}.safetensors"
            save_file(quant_writers.kitchen(part, base, mode), str(files[part, "comfy-kitchen", mode]))
        files[part, "comfy-kitchen", "nvfp4-pre_quant_scale"] = folder / f"{part}-kitchen-pre_quant_scale.safetensors"
        save_file(quant_writers.with_pre_quant_scale(base, PRE_QUANT_LAYER[part]),
                  str(files[part, "comfy-kitchen", "nvfp4-pre_quant_scale"]))
    assert set(files) == {case for case in CASES if case[1] != "comfy-kitchen" or case[2] not in quant_writers.KITCHEN
                          or quant_writers.kitchen_writes(case[2])}
    return files


@pytest.fixture(scope="module")
def bases(tiny_root) -> dict[str, dict[str, torch.Tensor]]:
    return {part: _load(tiny_root / path) for part, path in PARTS.items()}


def _declared(stored: dict) -> dict[str, dict]:
    """{layer: its comfy_quant JSON} of a file's tensors."""
    return {k.removesuffix(".comfy_quant"): json.loads(bytes(v.tolist())) for k, v in stored.items()
            if k.endswith(".comfy_quant")}


def _reference_weights(stored: dict, base: dict) -> dict[str, torch.Tensor]:
    """The file's model tensors in float32, each declared weight as ComfyUI 0.33 dequantizes it."""
    declared = _declared(stored)
    out = {}
    for key in base:
        layer = key.removesuffix(".weight")
        out[key] = (quant_writers.reference_weight(quant_writers.layer_tensors(stored, layer), base[key].shape)
                    if key.endswith(".weight") and layer in declared else stored[key].float())
    return out


def _loaded(part: str, path) -> dict[str, torch.Tensor]:
    """The state dict the pack's loader hands to the host's layers."""
    from comfyui_flux2dev.loaders.models.encoder import load_encoder
    from comfyui_flux2dev.loaders.models.transformer import load_transformer

    return load_encoder(str(path)).state_dict if part == "encoder" else load_transformer(path).state_dict


def _bf16_steps(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """|got - want| in steps of bf16 at want's magnitude (2^-7 of its power of two)."""
    steps = (got - want).abs() / torch.ldexp(torch.ones_like(want), torch.frexp(want).exponent - 8)
    return torch.where(want == 0, torch.where(got == 0, 0.0, float("inf")), steps)


def _check_kept_packed(model, stored: dict) -> None:
    """The host's layers keep every declared weight as stored, its row and settings as numbers (not buffers the
    host would move to the GPU)."""
    for layer in _declared(stored):
        module = model.get_submodule(layer)
        assert module.weight.dtype == stored[layer + ".weight"].dtype, layer
        assert packing.PACKING not in dict(module.named_buffers())
        assert isinstance(getattr(module, packing.PACKING, ()), tuple)


@pytest.mark.parametrize("case", READ, ids=_id)
def test_weights_are_comfyuis_dequantization(comfy_host, written, bases, case, device):
    part = case[0]
    stored, loaded = _load(written[case]), _loaded(part, written[case])
    declared = _declared(stored)
    assert declared
    for layer in declared:
        key = layer + ".weight"
        shape = bases[part][key].shape
        want = quant_writers.reference_weight(quant_writers.layer_tensors(stored, layer), shape)
        weight, companions = packed_dequant.split_entries(
            {k: v.to(device) for k, v in loaded.items() if k.rpartition(".")[0] == layer}, key)
        assert weight.dtype == stored[key].dtype  # kept as stored
        got = packed_dequant.dequantize(weight, companions, torch.float32, shape).cpu()
        assert (got - want).abs().max() <= 2**-20 * want.abs().max(), layer
        narrow = packed_dequant.dequantize(weight, companions, torch.bfloat16, shape).cpu().float()
        assert _bf16_steps(narrow, want).max() <= 1, layer
        # and the host's values are the weight the writer was given, roughly
        assert (want - bases[part][key].float()).abs().max() <= 0.5 * bases[part][key].float().abs().max(), layer


@pytest.mark.parametrize("case", [c for c in READ if c[0] == "encoder"], ids=_id)
def test_encoder_conditioning_is_on_comfyuis_weights(comfy_host, written, bases, case, device):
    from transformers import MistralConfig, MistralModel

    from comfyui_flux2dev.host.clip import load_clip
    from comfyui_flux2dev.tokenizers import prompt_ids

    weights = _reference_weights(_load(written[case]), bases["encoder"])
    config = MistralConfig(**{k: v for k, v in tiny.text_config(tiny.PRUNED).items() if k != "model_type"})
    config._attn_implementation = "sdpa"
    reference = MistralModel(config).float().eval()
    missing, unexpected = reference.load_state_dict(
        {k.removeprefix("model."): v for k, v in weights.items() if k.startswith("model.")}, strict=False)
    assert set(missing) <= {"norm.weight"} and not unexpected
    reference.norm = torch.nn.Identity()  # FLUX.2 reads layer 29's raw output
    reference.to(device)
    clip = load_clip(str(written[case]), padding="comfy", dtype=torch.float32)
    on_device(clip.patcher, device)
    _check_kept_packed(clip.cond_stage_model.mistral3_24b.transformer, _load(written[case]))
    prompt = "Ein Café, 2024: a red fox in the snow"
    ids, mask = prompt_ids(clip.tokenizer.tokenizer, prompt, "comfy")
    got = clip.encode_from_tokens(clip.tokenize(prompt), return_dict=True)["cond"].cpu()
    with torch.no_grad():
        out = reference(input_ids=torch.tensor([ids], device=device),
                        attention_mask=torch.tensor([mask], device=device), output_hidden_states=True)
    want = torch.cat([out.hidden_states[i] for i in (10, 20, 30)], dim=-1).cpu()
    assert got.shape == want.shape == (1, len(ids), 3 * tiny.TINY_MISTRAL.width)
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()


@pytest.mark.parametrize("case", [c for c in READ if c[0] == "transformer"], ids=_id)
def test_transformer_output_is_on_comfyuis_weights(comfy_host, written, bases, case, device):
    from comfyui_flux2dev.host.model import load_model

    reference = on_device(dense_model(_reference_weights(_load(written[case]), bases["transformer"])), device)
    patcher = on_device(load_model(written[case], dtype=torch.float32), device)
    _check_kept_packed(patcher.model.diffusion_model, _load(written[case]))
    outputs = []
    for model in (patcher, reference):
        model.patch_model(device_to=device)
        try:
            with torch.no_grad():
                outputs.append(flux2_forward(model, device).cpu())
        finally:
            model.unpatch_model(device_to=torch.device("cpu"))
    got, want = outputs
    assert want.abs().max() > 0.1
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()


@pytest.mark.parametrize("case", REFUSED, ids=_id)
def test_what_no_release_reads_is_refused_naming_layer_and_format(written, case):
    from comfyui_flux2dev.loaders.models.inspect import inspect_path

    part, writer, mode = case
    if case not in written:
        pytest.skip(f"this comfy-kitchen does not write {mode}")
    stored = _load(written[case])
    layer = sorted(_declared(stored))[0]
    if mode == "w6a8":
        said = (rf"^{layer}\.weight stores \d+ bytes a row for \d+ inputs \(\d+ groups of 16 in its weight_s_rel\): "
                r"codes of 6 bits, where ComfyUI reads 4-bit W4A8")
    elif mode == "w4a8-asymmetric":
        said = (rf"^{layer}\.weight_correction: the layer is asymmetric W4A8 .* which ComfyUI 0\.33 loads without "
                r"its zero points.* use a symmetric W4A8 file")
    else:
        word = quant_writers.CONVERT_TO_QUANT[mode][1]
        said = (rf"^{layer}\.weight is declared as '{word}' quantization \(its comfy_quant tensor\), which no ComfyUI "
                r"release reads .* the pack reads float8_e4m3fn, float8_e5m2, nvfp4, mxfp8, int8_tensorwise, "
                r"convrot_w4a4, asym_w4a8_int8, as ComfyUI does\. Convert the model again")
    with pytest.raises(UnsupportedFormatError, match=said):
        _loaded(part, written[case])
    with pytest.raises(UnsupportedFormatError, match=said):  # inspect says what a load would
        inspect_path(written[case])


@pytest.mark.parametrize("case", [c for c in REFUSED if c[1] == "convert-to-quant"], ids=_id)
def test_comfyui_fails_on_the_formats_it_has_no_reading_for(comfy_host, written, bases, case):
    if not quant_writers.host_reads_comfy_quant():
        pytest.skip("this ComfyUI reads no comfy_quant formats of its own (0.33 does)")
    stored = _load(written[case])
    layer = sorted(_declared(stored))[0]
    with pytest.raises(KeyError, match=quant_writers.CONVERT_TO_QUANT[case[2]][1]):
        quant_writers.hosts_reading(quant_writers.layer_tensors(stored, layer), bases[case[0]][layer + ".weight"].shape)


def test_the_reference_is_comfyuis_own_reading(comfy_host, written, bases):
    """On a ComfyUI that reads comfy_quant files, the table the reference falls back to elsewhere (comfy-kitchen's
    layouts with 0.33's parameters) gives the host's own values for every file read."""
    if not quant_writers.host_reads_comfy_quant():
        pytest.skip("this ComfyUI reads no comfy_quant formats of its own (0.33 does): the reference is the table")
    for case in READ:
        stored = _load(written[case])
        for layer in _declared(stored):
            tensors, shape = quant_writers.layer_tensors(stored, layer), bases[case[0]][layer + ".weight"].shape
            assert torch.equal(quant_writers.kitchen_reading(tensors, shape),
                               quant_writers.hosts_reading(tensors, shape)), (case, layer)


@pytest.mark.parametrize("case", READ, ids=_id)
def test_inspect_reports_what_the_loader_reads(written, bases, case):
    from comfyui_flux2dev.loaders.models.inspect import inspect_path

    part = case[0]
    stored = _load(written[case])
    declared = _declared(stored)
    words = Counter(LABELS[d["format"]] + ("-convrot" if d.get("convrot") else "") for d in declared.values())
    model = [k for k in bases[part] if part == "transformer" or k.startswith("model.layers.")
             and int(k.split(".")[2]) < tiny.PRUNED or k == "model.embed_tokens.weight"]
    weights = [k for k in model if part == "transformer" or k.endswith(".weight")]
    companions = [k for k in stored if k.rpartition(".")[0] in declared and not k.endswith(".weight")
                  and not k.endswith(READ_PAST)]
    info = inspect_path(written[case])
    assert info["formats"] == {**({"bf16": len(weights) - len(declared)}), **words}
    assert info["reads"] == len(model) + len(companions)
    assert info["memory_bytes"] == sum(stored[k].numel() * stored[k].element_size() for k in (*model, *companions))


def test_settings_a_format_cannot_have_are_refused(tmp_path, bases):
    from safetensors.torch import save_file

    from comfyui_flux2dev.loaders.models.transformer import load_transformer

    stored = quant_writers.kitchen("transformer", bases["transformer"], "int8-convrot")
    layer = "double_blocks.0.img_attn.proj"
    stored[layer + ".comfy_quant"] = torch.tensor(list(b'{"format": "int8_tensorwise", "convrot": true, '
                                                       b'"params": {"convrot_groupsize": 48}}'), dtype=torch.uint8)
    save_file(stored, str(tmp_path / "odd.safetensors"))
    with pytest.raises(CorruptFileError, match=rf"^{layer}\.weight's comfy_quant gives convrot_groupsize 48; "
                                               r"int8-convrot needs a power of 4 \(16, 64, 256, \.\.\.\) that divides"):
        load_transformer(tmp_path / "odd.safetensors")


def test_every_format_row_has_its_dequantizer():
    assert all(callable(f.dequantize) for f in packing.FORMATS)
