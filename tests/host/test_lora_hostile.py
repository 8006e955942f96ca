"""LoRA files and node inputs that are damaged or hostile: each ends in the pack's error, naming what is wrong, before a
weight is patched (on the node) or a byte written (in the bake), or lands exactly as the report says; NaN never
reaches a weight."""

from __future__ import annotations

import pytest
import torch

from comfyui_flux2dev.errors import CorruptFileError, Flux2DevError, InputError, UnsupportedFormatError, WrongModelError
from lora_models import CPU, forward, patched_weights, save

QKV = "diffusion_model.double_blocks.0.img_attn.qkv"  # [768, 256] in the tiny [dev]
PROJ = "diffusion_model.double_blocks.0.img_attn.proj"  # [256, 256]


def _pair(layer: str = QKV, out: int = 768, inputs: int = 256, up: str = ".lora_up.weight",
          down: str = ".lora_down.weight") -> dict:
    g = torch.Generator().manual_seed(out + inputs)
    return {layer + up: torch.randn(out, 4, generator=g) * 0.1, layer + down: torch.randn(4, inputs, generator=g) * 0.1}


def _with(tensors: dict, name: str, value) -> dict:
    return {**tensors, name: value}


def _nan_in(tensors: dict, name: str, value: float = float("nan")) -> dict:
    changed = {k: v.clone() for k, v in tensors.items()}
    changed[name].view(-1)[3] = value
    return changed


def _lokr(layer: str = PROJ) -> dict:
    return {layer + ".lokr_w1": torch.full((2, 2), 0.5), layer + ".lokr_w2": torch.full((128, 128), 0.01)}


def _loha(layer: str = PROJ) -> dict:
    g = torch.Generator().manual_seed(3)
    return {layer + f".hada_{w}": torch.randn(*shape, generator=g) for w, shape in
            (("w1_a", (256, 2)), ("w1_b", (2, 256)), ("w2_a", (256, 2)), ("w2_b", (2, 256)))}


# (id, the LoRA's tensors, the error, what it says)
REFUSED = (
    ("lokr-without-w2", {PROJ + ".lokr_w1": torch.ones(2, 2)}, CorruptFileError, "holds no w2"),
    ("nan-up", _nan_in(_pair(), QKV + ".lora_up.weight"), CorruptFileError, "lora_up.weight holds NaN"),
    ("inf-down", _nan_in(_pair(), QKV + ".lora_down.weight", float("inf")), CorruptFileError,
     "lora_down.weight holds infinite values"),
    ("nan-lokr", _nan_in(_lokr(), PROJ + ".lokr_w2"), CorruptFileError, "lokr_w2 holds NaN"),
    ("nan-loha", _nan_in(_loha(), PROJ + ".hada_w2_b"), CorruptFileError, "hada_w2_b holds NaN"),
    ("nan-diff", {PROJ + ".diff": torch.full((256, 256), float("nan"))}, CorruptFileError, "diff holds NaN"),
    ("nan-dora-scale", {**_pair(PROJ, 256, 256), PROJ + ".dora_scale": torch.full((256, 1), float("nan"))},
     CorruptFileError, "dora_scale holds NaN"),
    ("nan-alpha", {**_pair(), QKV + ".alpha": torch.tensor(float("nan"))}, CorruptFileError, "not a finite number"),
    ("bfl-and-kohya", {**_pair(), **_pair("lora_unet_double_blocks_0_img_attn_qkv")}, CorruptFileError,
     "gives the weight diffusion_model.double_blocks.0.img_attn.qkv.weight twice"),
    ("bfl-and-peft", {**_pair(), **_pair("transformer.transformer_blocks.0.attn.to_k", 256, 256, ".lora_B.weight",
                                         ".lora_A.weight")}, CorruptFileError, "twice"),
    ("two-kinds-one-layer", {**_pair(PROJ, 256, 256), **_lokr()}, CorruptFileError,
     "holds LoRA .* and LoKr .*; a layer is one adapter"),
    ("two-spellings-one-layer", {**_pair(PROJ, 256, 256), **_pair(PROJ, 256, 256, ".lora_B.weight", ".lora_A.weight")},
     CorruptFileError, "a layer is one adapter, in one spelling"),
    ("dora-scale-misshapen", {**_pair(PROJ, 256, 256), PROJ + ".dora_scale": torch.ones(7, 1)}, CorruptFileError,
     "has a DoRA magnitude .* of shape \\[7, 1\\]"),
    ("integer-lokr", {PROJ + ".lokr_w1": torch.ones(2, 2, dtype=torch.int32), PROJ + ".lokr_w2": torch.ones(128, 128)},
     CorruptFileError, "stored as I32, not as floats"),
    ("bool-diff", {PROJ + ".diff": torch.ones(256, 256, dtype=torch.bool)}, CorruptFileError,
     "stored as BOOL, not as floats"),
    ("integer-loha", {**_loha(), PROJ + ".hada_w1_a": torch.ones(256, 2, dtype=torch.int8)}, CorruptFileError,
     "stored as I8, not as floats"),
    ("misfit", _pair(PROJ, 768, 256), WrongModelError, "makes a difference of shape \\[768, 256\\]"),
    ("ranks", {QKV + ".lora_up.weight": torch.ones(768, 4), QKV + ".lora_down.weight": torch.ones(8, 256)},
     CorruptFileError, "are not of one rank"),
    ("convolution", {**_pair(PROJ, 256, 256), PROJ + ".lora_mid.weight": torch.ones(4, 4, 3, 3)}, WrongModelError,
     "a factor of a convolution's adapter"),
    ("oft-misshapen", {PROJ + ".oft_blocks": torch.ones(4, 8, 9)}, CorruptFileError, "not blocks of square rotations"),
    ("dora-on-a-difference", {PROJ + ".diff": torch.ones(256, 256), PROJ + ".dora_scale": torch.ones(256, 1)},
     UnsupportedFormatError, "DoRA is read once per layer, on LoRA, LoHa and LoKr layers"),
    ("sdxl-text-encoder", _pair("lora_te1_text_model_encoder_layers_0_self_attn_q_proj", 768, 768), WrongModelError,
     "it is a LoRA of Stable Diffusion or SDXL"),
)


@pytest.mark.parametrize("case", REFUSED, ids=lambda case: case[0])
def test_a_damaged_or_hostile_lora_is_refused_naming_what_is_wrong(models, case, tmp_path):
    from comfyui_flux2dev.host.lora import load_lora

    _, tensors, error, said = case
    model, _ = models["dense"]
    with pytest.raises(error, match=said):
        load_lora(model, None, save(tensors, tmp_path / "lora.safetensors"), 1.0, 1.0)
    assert not model.patches  # the MODEL given is as it was


PEFT_METADATA = {
    "transformer.r": 4, "transformer.lora_alpha": 8, "transformer.peft_type": "LORA",
}
PEFT_REFUSED = (
    ({"transformer.peft_type": "LOHA"}, UnsupportedFormatError, "PEFT LOHA adapter"),
    ({"transformer.fan_in_fan_out": True}, UnsupportedFormatError, "sets fan_in_fan_out to True"),
    ({"transformer.alora_invocation_tokens": [1, 2]}, UnsupportedFormatError, "sets alora_invocation_tokens"),
    ({"transformer.rank_pattern": {"(a+)+$": 2}}, UnsupportedFormatError, "patterns that are module names"),
    ({"transformer.r": 8}, CorruptFileError, "gives the layer rank 8, but its factors are of rank 4"),
    ({"transformer.lora_alpha": 1e12}, CorruptFileError, "transformer.lora_alpha is 1000000000000.0, expected"),
    ({"transformer.use_dora": True}, CorruptFileError, "PEFT's config says DoRA"),
)


@pytest.mark.parametrize("changed, error, said", PEFT_REFUSED, ids=lambda c: str(c)[:30])
def test_a_peft_config_that_changes_the_arithmetic_otherwise_is_refused(models, changed, error, said, tmp_path):
    import json

    from safetensors.torch import save_file

    from comfyui_flux2dev.host.lora import load_lora

    tensors = _pair("transformer.transformer_blocks.0.attn.to_k", 256, 256, ".lora_B.weight", ".lora_A.weight")
    metadata = {"lora_adapter_metadata": json.dumps({**PEFT_METADATA, **changed}), "format": "pt"}
    save_file(tensors, str(tmp_path / "peft.safetensors"), metadata=metadata)
    with pytest.raises(error, match=said):
        load_lora(models["dense"][0], None, str(tmp_path / "peft.safetensors"), 1.0, 1.0)


@pytest.mark.parametrize("strength", (float("nan"), float("inf"), -float("inf"), 1e30, 100.5, True))
def test_a_strength_beyond_the_nodes_range_is_refused(models, strength, tmp_path):
    from comfyui_flux2dev.host.lora import load_lora

    path = save(_pair(), tmp_path / "lora.safetensors")
    for model_strength, clip_strength, name in ((strength, 1.0, "strength_model"), (1.0, strength, "strength_clip")):
        with pytest.raises(InputError, match=f"{name} is .*; a LoRA's strength is a number from -100 to 100"):
            load_lora(models["dense"][0], None, path, model_strength, clip_strength)


def test_a_change_that_overflows_is_refused_before_it_reaches_a_weight(models, tmp_path):
    from comfyui_flux2dev.host.lora import load_lora

    huge = {QKV + ".lora_up.weight": torch.full((768, 4), 3e19), QKV + ".lora_down.weight": torch.full((4, 256), 3e19)}
    with pytest.raises(WrongModelError, match="at strength 1 the LoRA's layer .*qkv makes the weight .* overflow"):
        load_lora(models["dense"][0], None, save(huge, tmp_path / "huge.safetensors"), 1.0, 1.0)


def test_a_replacement_moves_the_weight_as_far_as_the_strength_says(models, tmp_path):
    """set_weight replaces a weight; at strength s the weight moves s of the way to it, as DoRA's and OFT's do."""
    from comfyui_flux2dev.host.lora import load_lora

    model, bfl = models["dense"]
    target = torch.full((256, 256), 0.25)
    path = save({PROJ + ".set_weight": target}, tmp_path / "set.safetensors")
    for strength in (1.0, 0.5, -0.5):
        patched, _, report = load_lora(model, None, path, strength, 1.0)
        got = patched_weights(patched)["double_blocks.0.img_attn.proj.weight"]
        want = bfl["double_blocks.0.img_attn.proj.weight"] * (1 - strength) + target * strength
        assert (got - want).abs().max().item() <= 1e-6
        assert report.summary() == "1 of 1 LoRA tensors applied, changing 1 weight of the transformer"
    patched, _, report = load_lora(model, None, path, 0.0, 1.0)
    assert patched is model and report.summary() == (
        "0 of 1 LoRA tensors applied\n1 not applied, of a model whose strength is 0: "
        "diffusion_model.double_blocks.0.img_attn.proj.set_weight")


def test_the_bake_refuses_a_damaged_lora_before_a_byte_is_written(comfy_host, tiny_root, tmp_path):
    from comfyui_flux2dev.host.lora_bake import LoraBake
    from comfyui_flux2dev.loaders.convert.transformer import convert_transformer

    out = tmp_path / "out.gguf"
    for name, tensors, error, said in (REFUSED[1], REFUSED[8]):
        lora = save(tensors, tmp_path / f"{name}.safetensors")
        with pytest.raises(error, match=said):
            convert_transformer(str(tiny_root / "diffusion_models/flux2-dev-tiny.safetensors"), str(out),
                                qtype="Q8_0", patch=LoraBake([(lora, 1.0)]))
        assert not out.exists()
    with pytest.raises(Flux2DevError, match="The --strength of .* is inf"):
        LoraBake([(lora, float("inf"))])


def test_nan_never_reaches_a_packed_weight_through_the_hosts_own_path(models, tmp_path):
    """The packed MODELs too: a refused LoRA leaves their forward as it was."""
    from comfyui_flux2dev.host.lora import load_lora

    for name in ("fp8", "Q4_K"):
        model, _ = models[name]
        before = forward(model)
        with pytest.raises(CorruptFileError):
            load_lora(model, None, save(REFUSED[1][1], tmp_path / "nan.safetensors"), 1.0, 1.0)
        assert torch.equal(forward(model), before) and torch.isfinite(before).all()
        assert model.load_device == CPU
