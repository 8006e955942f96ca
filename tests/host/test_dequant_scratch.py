"""Packed weights dequantized into the CPU scratch buffer during a forward pass (host/ops.forward_weight):
the same bits as a new tensor per layer (the path with autograd on), equal to independent references
(gguf's numpy dequantizer, comfy_kitchen's NVFP4, float32 fp8 times its scale), with two same-shape
layers in a row sharing the buffer, and with a LoRA applied after dequantization."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from comfyui_flux2dev.devtools.tiny.gguf_blocks import random_blocks
from helpers import GGUF_QUANTIZED_TYPES

WIDTH = 512  # two NVFP4 scale tiles wide, two K-quant blocks


def _scratch_bytes() -> int:
    from comfyui_flux2dev.host import ops

    buffer = getattr(ops._scratch, "buffer", None)
    return 0 if buffer is None else buffer.numel()


def _gguf_weight(qtype: Q, seed: int):
    """(state-dict entries of a packed [WIDTH, WIDTH] weight, its values by gguf's numpy dequantizer)."""
    raw = random_blocks(qtype, (WIDTH * WIDTH,), np.random.default_rng(seed)).reshape(WIDTH, -1)
    values = torch.from_numpy(gguf.quants.dequantize(raw, qtype).reshape(WIDTH, WIDTH))
    return {"weight": torch.from_numpy(raw), "weight_gguf_type": torch.tensor(int(qtype))}, values


def _fp8_weight(qtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    weight = (torch.randn(WIDTH, WIDTH, generator=g) * 0.5).to(torch.float8_e4m3fn)
    scale = torch.rand(WIDTH, 1, generator=g) + 0.1 if seed % 2 else torch.tensor(0.37)
    return {"weight": weight, "weight_scale": scale}, weight.float() * scale.float()


def _nvfp4_weight(qtype, seed: int):
    from comfy_kitchen.backends.eager.quantization import dequantize_nvfp4

    from comfyui_flux2dev.devtools.tiny.encoders import quantize_nvfp4

    packed, scales, scale2 = quantize_nvfp4(torch.randn(WIDTH, WIDTH, generator=torch.Generator().manual_seed(seed)))
    values = dequantize_nvfp4(packed, scale2, scales, output_type=torch.float32)
    return {"weight": packed, "weight_scale": scales, "weight_scale_2": scale2}, values


FORMATS = {n: (_gguf_weight, Q[n]) for n in GGUF_QUANTIZED_TYPES} | {
    "fp8-scaled": (_fp8_weight, None), "nvfp4": (_nvfp4_weight, None),
}


def _two_layers(fmt: str):
    """Two packed [WIDTH, WIDTH] Linear layers in a row (the second reuses the first's scratch), and their
    weights as the references dequantize them."""
    from comfyui_flux2dev.host.ops import packed_operations

    make, qtype = FORMATS[fmt]
    linear = packed_operations().Linear
    net = torch.nn.Sequential(linear(WIDTH, WIDTH), linear(WIDTH, WIDTH))
    sd, weights = {}, []
    for i in range(2):
        entries, values = make(qtype, seed=10 + i)
        sd.update({f"{i}.{k}": v for k, v in entries.items()})
        sd[f"{i}.bias"] = torch.randn(WIDTH, generator=torch.Generator().manual_seed(i))
        weights.append(values)
    net.load_state_dict(sd)
    assert all(layer.companions for layer in net)  # the weights stayed packed
    return net, weights, [sd["0.bias"], sd["1.bias"]]


@pytest.mark.parametrize("fmt", FORMATS)
def test_two_same_shape_layers_in_a_row(comfy_host, fmt, device):
    """On the CPU through the scratch buffer; on a GPU with the weights there, and with them kept on the CPU
    (the host's offloading), copied over and dequantized on the GPU, never in the CPU scratch."""
    from comfyui_flux2dev.host import ops

    net, weights, biases = _two_layers(fmt)
    x = torch.randn(3, WIDTH, generator=torch.Generator().manual_seed(5)).to(device)
    weights, biases = [w.to(device) for w in weights], [b.to(device) for b in biases]
    expected = torch.nn.functional.linear(torch.nn.functional.linear(x, weights[0], biases[0]), weights[1], biases[1])
    for home in dict.fromkeys((device, torch.device("cpu"))):  # where the weights live
        net.to(home)
        ops._scratch.buffer = None  # what earlier tests left
        with torch.inference_mode():  # as ComfyUI runs nodes: the scratch path on the CPU
            reused = net(x)
        assert _scratch_bytes() == (WIDTH * WIDTH * 4 if device.type == "cpu" else 0)
        with torch.enable_grad():  # autograd on: a new tensor per layer
            fresh = net(x)
        assert reused.device == x.device
        assert torch.equal(reused, fresh)
        assert torch.equal(reused, expected)


def test_scratch_holds_one_layer_and_returns_it_for_the_op_only(comfy_host):
    """The buffer is one layer's worth whatever the number of layers; a second layer overwrites the first's
    values, which is why weight_bias's result is used at once."""
    from comfyui_flux2dev.host import ops

    net, weights, _ = _two_layers("Q4_K")
    cpu = torch.device("cpu")
    ops._scratch.buffer = None  # what earlier tests left
    with torch.no_grad():
        first, _ = net[0].weight_bias(cpu, torch.float32)
        assert torch.equal(first, weights[0])
        second, _ = net[1].weight_bias(cpu, torch.float32)
        assert torch.equal(second, weights[1])
        assert first.data_ptr() == second.data_ptr()  # one buffer: the first is gone
        half, _ = net[0].weight_bias(cpu, torch.float16)  # another dtype, the same buffer
        assert half.data_ptr() == second.data_ptr() and torch.equal(half, weights[0].half())
    assert _scratch_bytes() == WIDTH * WIDTH * 4


# --- through the host: the tiny GGUF transformer, as test_gguf_transformer runs it ---------------------


@pytest.fixture(scope="module")
def gguf_dir(tiny_part, comfy_host):
    root, entries = tiny_part("unet")
    return {(e["variant"], e["format"].removeprefix("gguf-")): root / e["path"] for e in entries}


def _forward(patcher, grad_mode, device):
    """One forward on `device` of the host model with its patches applied the host's way, under a grad mode."""
    from helpers import flux2_forward

    patcher.patch_model(device_to=device)
    try:
        with grad_mode():
            return flux2_forward(patcher, device).detach().cpu()
    finally:
        patcher.unpatch_model(device_to=torch.device("cpu"))


@pytest.mark.parametrize("fmt", ("Q4_0", "Q6_K"))
def test_host_forward_scratch_equals_fresh_and_gguf_with_and_without_lora(gguf_dir, comfy_host, fmt, device):
    from comfyui_flux2dev.host import model as host_model
    from comfyui_flux2dev.host import ops
    from helpers import reference_model, tiny_lora

    ops._scratch.buffer = None  # what earlier tests left
    path = gguf_dir[("dev", fmt)]
    model, reference = host_model.load_gguf_model(path, dtype=torch.float32), reference_model(path)
    lora = tiny_lora(reference)  # on double_blocks.0.img_attn.qkv: txt_attn.qkv, the same shape, follows it
    patched, _ = comfy_host.load_lora_for_models(model, None, lora, 1.0, 0.0)
    patched_reference, _ = comfy_host.load_lora_for_models(reference, None, lora, 1.0, 0.0)
    for ours, theirs in ((model, reference), (patched, patched_reference)):
        reused = _forward(ours, torch.inference_mode, device)
        assert torch.equal(reused, _forward(ours, torch.enable_grad, device))
        assert torch.equal(reused, _forward(ours, torch.inference_mode, device))  # the buffer left nothing behind
        assert (reused - _forward(theirs, torch.no_grad, device)).abs().max().item() <= 1e-5
    lora_delta = _forward(patched, torch.no_grad, device) - _forward(model, torch.no_grad, device)
    assert lora_delta.abs().max() > 1e-3  # the LoRA counts
    largest = max(m.weight_shape[0] * m.weight_shape[1] for m in model.model.modules() if getattr(m, "companions", ()))
    assert _scratch_bytes() == (largest * 4 if device.type == "cpu" else 0)  # one layer's worth: the largest
