"""Device placement of the hot paths (every dequantizer, the packed Linear, Conv and Embedding layers), checked
without a GPU, on torch's `meta` device:

- with every input on `meta`, a path must run and give `meta` values: a read of a value back to the host
  (`.item()`, `int(tensor)`, `.tolist()`, `.cpu()`, `.numpy()`), which on a GPU waits for it at every layer,
  fails there, and so does an op mixing in a tensor made on the CPU;
- with `meta` as the default device, a path run on the CPU must give the same CPU values: a tensor made without
  naming its device lands on `meta` and fails or shows, where on a GPU it would silently be made on the CPU.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q

from comfyui_flux2dev.devtools.tiny.gguf_blocks import random_blocks
from comfyui_flux2dev.loaders.formats import packed_dequant, packing
from comfyui_flux2dev.loaders.formats.gguf_types import BY_TYPE
from helpers import GGUF_FLOAT_TYPES, GGUF_QUANTIZED_TYPES

META = torch.device("meta")
SHAPE = (256, 512)  # two NVFP4 scale tiles tall, two K-quant blocks wide


def _gguf(name: str) -> tuple[dict, tuple[int, ...]]:
    """(stored weight and companions as the loaders keep them, the logical shape) of a GGUF weight: random blocks,
    or a float type's bytes."""
    qtype, float_dtype = Q[name], BY_TYPE[Q[name]].float_dtype
    if float_dtype:
        values = torch.randn(SHAPE, generator=torch.Generator().manual_seed(0)).to(getattr(torch, float_dtype))
        raw = values.view(torch.uint8)
    else:
        raw = torch.from_numpy(random_blocks(qtype, SHAPE, np.random.default_rng(0)))
    return {"weight": raw, packing.GGUF_TYPE: torch.tensor(int(qtype))}, SHAPE


def _fp8(dtype: torch.dtype, per_channel: bool):
    g = torch.Generator().manual_seed(1)
    weight = (torch.randn(SHAPE, generator=g) * 0.5).to(dtype)
    scale = torch.rand(SHAPE[0], 1, generator=g) + 0.1 if per_channel else torch.tensor(0.37)
    return {"weight": weight, "weight_scale": scale}, SHAPE


def _nvfp4():
    from comfyui_flux2dev.devtools.tiny.encoders import quantize_nvfp4

    packed, scales, scale2 = quantize_nvfp4(torch.randn(SHAPE, generator=torch.Generator().manual_seed(2)))
    return {"weight": packed, "weight_scale": scales, "weight_scale_2": scale2}, SHAPE


def _comfy_quant(mode: str):
    """A weight in a comfy-kitchen layout (quant_writers.KITCHEN) as the loaders hand it over: its stored tensors, and
    its row and settings as the loaders read them from ComfyUI's declaration (weight_packing)."""
    import comfy_kitchen.tensor

    from comfyui_flux2dev.loaders.formats.safetensors_file import SAFETENSORS_DTYPES
    from quant_writers import KITCHEN

    layout, arguments, declaration, _ = KITCHEN[mode]
    layout = getattr(comfy_kitchen.tensor, layout)
    values = torch.randn(SHAPE, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    qdata, params = layout.quantize(values, **arguments)
    entries = {"weight" + suffix: t for suffix, t in layout.state_dict_tensors(qdata, params).items()}
    row = packing.declared_format("weight", SAFETENSORS_DTYPES[str(qdata.dtype)], declaration)
    if packing.PACKING in row.companions:
        entries[packing.PACKING] = torch.tensor(
            [packing.FORMATS.index(row), *packing.declared_settings("weight", row, declaration, SHAPE[1])])
    return entries, SHAPE


def _nvfp4_pre_quant_scale():
    entries, shape = _nvfp4()
    return {**entries, "pre_quant_scale": torch.rand(SHAPE[1], generator=torch.Generator().manual_seed(6))}, shape


# Every packed weight the dequantizers read: each GGUF type, fp8 of both kinds and scale layouts, NVFP4 (with and
# without the input scaling it may carry), and every other comfy_quant format ComfyUI reads.
COMFY_QUANT = ("mxfp8", "int8", "int8-row", "int8-convrot", "convrot-w4a4", "w4a8", "w4a8-uniform")
WEIGHTS = {
    **{f"gguf-{n}": (lambda n=n: _gguf(n)) for n in GGUF_FLOAT_TYPES + GGUF_QUANTIZED_TYPES},
    "fp8-e4m3fn-tensor": lambda: _fp8(torch.float8_e4m3fn, False),
    "fp8-e5m2-channel": lambda: _fp8(torch.float8_e5m2, True),
    "nvfp4": _nvfp4,
    "nvfp4-pre_quant_scale": _nvfp4_pre_quant_scale,
    **{mode: (lambda mode=mode: _comfy_quant(mode)) for mode in COMFY_QUANT},
}


def _dequantize(entries: dict, shape, dtype=torch.bfloat16, out=None) -> torch.Tensor:
    companions = {k: v for k, v in entries.items() if k != "weight"}
    return packed_dequant.dequantize(entries["weight"], companions, dtype, shape, out=out)


def _forget_what_was_made() -> None:
    """Drop what the dequantizers keep between calls (code books, index orders: their functools caches) and the
    CPU scratch buffer, so that the run under test makes them anew."""
    from comfyui_flux2dev.host import ops
    from comfyui_flux2dev.loaders.formats import gguf_legacy, gguf_row, gguf_types

    for module in (packed_dequant, gguf_row, gguf_types, gguf_legacy):
        for value in vars(module).values():
            if callable(getattr(value, "cache_clear", None)):
                value.cache_clear()
    ops._scratch.buffer = None


def _to(entries: dict, device) -> dict:
    """The stored weight and scales on `device`; the GGUF type and the packing stay where the loaders make them (CPU
    numbers)."""
    return {k: v if k in (packing.GGUF_TYPE, packing.PACKING) else v.to(device) for k, v in entries.items()}


@pytest.mark.parametrize("name", WEIGHTS)
def test_every_dequantizer_runs_where_its_weight_is(name):
    entries, shape = WEIGHTS[name]()
    got = _dequantize(_to(entries, META), shape)
    assert got.device == META and tuple(got.shape) == shape and got.dtype == torch.bfloat16
    out = torch.empty(shape, dtype=torch.float16, device=META)
    assert _dequantize(_to(entries, META), shape, torch.float16, out=out) is out


@pytest.mark.parametrize("name", WEIGHTS)
def test_every_dequantizer_names_the_device_of_what_it_makes(name):
    entries, shape = WEIGHTS[name]()
    want = _dequantize(entries, shape)
    _forget_what_was_made()
    with torch.device(META):
        got = _dequantize(entries, shape)
    assert got.device.type == "cpu" and torch.equal(got, want)


def test_the_audit_sees_a_tensor_made_without_its_device():
    """What the checks above catch, shown on a dequantizer that makes its column scales without naming the device
    and one that reads a scale back to the host."""

    def careless(weight: torch.Tensor) -> torch.Tensor:
        return weight.float() * torch.full((weight.shape[1],), 0.5)

    def reading(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return weight.float() * float(scale)

    weight = torch.randint(0, 256, SHAPE, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="device"):
        careless(weight.to(META))
    with pytest.raises(RuntimeError, match="meta"):
        reading(weight.to(META), torch.tensor(0.5, device=META))
    with torch.device(META), pytest.raises(RuntimeError, match="device"):
        careless(weight)


# --- the packed layers of the host's models --------------------------------------------------------------


def _layers(name: str):
    """A packed Linear, and for GGUF also a Conv2d and an Embedding, with `name`'s weight loaded as the host loads
    it."""
    from comfyui_flux2dev.host.ops import packed_operations

    ops = packed_operations()
    entries, (rows, cols) = WEIGHTS[name]()
    made = {"linear": ops.Linear(cols, rows)}
    made["linear"].load_state_dict({**entries, "bias": torch.randn(rows)})
    if name.startswith("gguf-") and name.removeprefix("gguf-") in GGUF_QUANTIZED_TYPES:
        block = GGML_QUANT_SIZES[Q[name.removeprefix("gguf-")]][0]
        conv = ops.Conv2d(cols // block, rows, (1, block))  # a [out, in, 1, block] weight: whole blocks per row
        conv.load_state_dict({"weight": entries["weight"].view(rows, cols // block, 1, -1), "bias": torch.randn(rows),
                              packing.GGUF_TYPE: entries[packing.GGUF_TYPE]})
        made["conv"] = conv
        made["embedding"] = ops.Embedding(rows, cols)
        made["embedding"].load_state_dict(entries)
    return made


def _inputs(kind: str, layer, device) -> tuple:
    g = torch.Generator().manual_seed(3)
    if kind == "linear":
        return (torch.randn(3, layer.in_features, generator=g).to(device),)
    if kind == "conv":
        return (torch.randn(1, layer.in_channels, 2, layer.kernel_size[1] + 1, generator=g).to(device),)
    return (torch.tensor([[1, 7, 3]], device=device), torch.float32)


@pytest.mark.parametrize("name", WEIGHTS)
def test_packed_layers_run_where_their_input_is(comfy_host, name):
    """Weights on the input's device (the host's full load) and weights left on the CPU (its offloading): every
    forward runs on the input's device, reads nothing back and keeps the CPU scratch buffer out of it."""
    from comfyui_flux2dev.host import ops

    for kind, layer in _layers(name).items():
        # An embedding whose table stays on the CPU gathers its rows there: the token ids come over (once a prompt).
        for home in (META,) if kind == "embedding" else (torch.device("cpu"), META):
            layer.to(home)
            ops._scratch.buffer = None
            with torch.no_grad():
                out = layer(*_inputs(kind, layer, META))
            assert out.device == META, (kind, home)
            assert getattr(ops._scratch, "buffer", None) is None, (kind, home)


@pytest.mark.parametrize("name", WEIGHTS)
def test_packed_layers_name_the_device_of_what_they_make(comfy_host, name):
    for kind, layer in _layers(name).items():
        inputs = _inputs(kind, layer, torch.device("cpu"))
        with torch.no_grad():
            want = layer(*inputs).clone()
            _forget_what_was_made()
            with torch.device(META):
                got = layer(*inputs)
        assert got.device.type == "cpu" and torch.equal(got, want), kind


def test_a_gguf_layer_keeps_its_type_as_a_number_wherever_it_moves(comfy_host):
    """The host moves a model's buffers with its weights; a GGUF type among them would be read back from the GPU
    at every forward."""
    layer = _layers("gguf-Q4_K")["linear"]
    layer.to(META)
    assert isinstance(getattr(layer, packing.GGUF_TYPE), int)
    assert packing.GGUF_TYPE not in dict(layer.named_buffers())


# --- the language model that writes text (prompt upsampling) ------------------------------------------------------


def _language_model(device=None):
    from comfyui_flux2dev.loaders.models.variants import MistralEncoderGeometry
    from comfyui_flux2dev.loaders.upsampler.language_model import MistralLM

    g = MistralEncoderGeometry(width=32, heads=4, kv_heads=2, mlp=64, vocab=100, head_dim=8, layers=(2,))
    torch.manual_seed(3)
    model = MistralLM(g, 2, 1e9)
    for p in model.parameters():
        p.data.normal_(0, 0.3)
    return model.to(device) if device is not None else model


def test_the_language_model_writes_where_its_weights_are():
    """A prompt read and one token written on `meta`: the decoder, its rotary angles and its cache stay on the
    model's device (only choosing the next token reads a value back, once per token, by design)."""
    model = _language_model(META)
    cache = model.new_cache(8, META)
    embeds = model.embed(torch.tensor([[1, 5, 7]], device=META))
    logits = model(embeds, cache, 0)
    assert logits.device == META and tuple(logits.shape) == (100,)
    assert model(model.embed(torch.tensor([[9]], device=META)), cache, 3).device == META


def test_the_language_model_names_the_device_of_what_it_makes():
    model = _language_model()
    ids = torch.tensor([[1, 5, 7]])
    want = model(model.embed(ids), model.new_cache(8, torch.device("cpu")), 0)
    with torch.device(META):
        got = model(model.embed(ids), model.new_cache(8, torch.device("cpu")), 0)
    assert got.device.type == "cpu" and torch.equal(got, want)
