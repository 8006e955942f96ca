"""The tools users write comfy_quant files with, run on the tiny models, and ComfyUI 0.33's reading of what they
write (the meaning the pack is checked against):

- convert-to-quant (PyPI): its command line (`convert_to_quant`'s own parser and run) in every mode, with the
  --mistral and --flux2 layer filters, on the CPU;
- comfy-kitchen's layouts: `QuantizedTensor.from_float` and its `state_dict`, with the comfy_quant JSON ComfyUI's
  own writer (comfy/ops.py's `_quantized_weight_state_dict`) puts beside them;
- the host's dequantization of a layer: where the running ComfyUI reads comfy_quant files (0.33: QUANT_ALGOS in
  comfy.quant_ops), its own mixed-precision Linear loaded with the layer's tensors; on an older release, the same
  comfy-kitchen layouts with the parameters 0.33 reads from those tensors (KITCHEN_READING, checked against 0.33's
  own reading on that host).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

BLOCK = 64  # the tiny models' widths are multiples of 64: ConvRot groups and block sizes that fit every layer
# convert-to-quant's modes: (its flags, the comfy_quant format its files declare, whether ComfyUI 0.33 reads it)
CONVERT_TO_QUANT = {
    "fp8": ((), "float8_e4m3fn", True),
    "fp8-row": (("--scaling_mode", "row"), "float8_e4m3fn_rowwise", False),
    "fp8-block": (("--scaling_mode", "block", "--block_size", str(BLOCK)), "float8_e4m3fn_blockwise", False),
    "int8": (("--int8", "--scaling_mode", "tensor"), "int8_tensorwise", True),
    "int8-row": (("--int8", "--scaling_mode", "row"), "int8_tensorwise", True),
    "int8-block": (("--int8", "--scaling_mode", "block", "--block_size", str(BLOCK)), "int8_blockwise", False),
    "int8-convrot": (("--int8", "--scaling_mode", "row", "--convrot", "--convrot_group_size", str(BLOCK)),
                     "int8_tensorwise", True),
    "mxfp8": (("--mxfp8",), "mxfp8", True),
    "nvfp4": (("--nvfp4",), "nvfp4", True),
}
FILTERS = {"encoder": "--mistral", "transformer": "--flux2"}  # convert-to-quant's layer filters for FLUX.2's parts
# The modes run on each part: all on the transformer; on the encoder (210 linears, seconds for each INT8 mode) one of
# each kind of weight the pack reads and one it refuses.
CONVERT_TO_QUANT_MODES = {"encoder": ("fp8", "fp8-row", "int8-row", "mxfp8", "nvfp4"),
                          "transformer": tuple(CONVERT_TO_QUANT)}

# comfy-kitchen's layouts: (layout, its quantize arguments, the comfy_quant JSON ComfyUI writes beside it, whether
# ComfyUI 0.33 reads it as it is)
KITCHEN = {
    "fp8-e4m3": ("TensorCoreFP8Layout", {"dtype": torch.float8_e4m3fn}, {"format": "float8_e4m3fn"}, True),
    "fp8-e5m2": ("TensorCoreFP8Layout", {"dtype": torch.float8_e5m2}, {"format": "float8_e5m2"}, True),
    "nvfp4": ("TensorCoreNVFP4Layout", {}, {"format": "nvfp4"}, True),
    "mxfp8": ("TensorCoreMXFP8Layout", {}, {"format": "mxfp8"}, True),
    "int8": ("TensorWiseINT8Layout", {}, {"format": "int8_tensorwise"}, True),
    "int8-row": ("TensorWiseINT8Layout", {"per_channel": True}, {"format": "int8_tensorwise"}, True),
    "int8-convrot": ("TensorWiseINT8Layout", {"per_channel": True, "convrot": True, "convrot_groupsize": BLOCK},
                     {"format": "int8_tensorwise", "convrot": True, "convrot_groupsize": BLOCK}, True),
    "convrot-w4a4": ("TensorCoreConvRotW4A4Layout", {"convrot_groupsize": BLOCK},
                     {"format": "convrot_w4a4", "convrot_groupsize": BLOCK}, True),
    "w4a8": ("AsymW4A8Int8Layout", {"group_size": 16, "convrot_groupsize": BLOCK},
             {"format": "asym_w4a8_int8", "group_size": 16, "convrot_groupsize": BLOCK}, True),
    "w4a8-uniform": ("AsymW4A8Int8Layout", {"group_size": 32, "convrot_groupsize": BLOCK, "codebook": False,
                                            "scale_dtype": torch.float32},
                     {"format": "asym_w4a8_int8", "group_size": 32, "convrot_groupsize": BLOCK}, True),
    "w4a8-asymmetric": ("AsymW4A8Int8Layout", {"group_size": 16, "convrot_groupsize": BLOCK, "symmetric": False},
                        {"format": "asym_w4a8_int8", "group_size": 16, "convrot_groupsize": BLOCK}, False),
    # 6-bit codes under the same word, from comfy-kitchen releases newer than ComfyUI 0.33's
    "w6a8": ("AsymW4A8Int8Layout", {"group_size": 16, "convrot_groupsize": BLOCK, "bits": 6},
             {"format": "asym_w4a8_int8", "group_size": 16, "convrot_groupsize": BLOCK}, False),
}
# What comfy-kitchen quantizes in the tiny models: a few layers (the rest stays bf16, as in mixed files), the
# embedding too in one file. Every linear of the tiny models would cost seconds for W4A8's codebooks.
KITCHEN_LAYERS = {"encoder": ("model.layers.0.", "model.layers.1.", "model.layers.29."),
                  "transformer": ("double_blocks.0.img_attn.", "single_blocks.1.linear2.")}
KITCHEN_EMBEDDING = ("int8-convrot", "model.embed_tokens.weight")

_CTQ_DRIVER = """
import gc, json, sys
gc.collect = lambda *args, **kwargs: 0  # the tool collects after each tensor: 0.2 s each in a process holding torch
from convert_to_quant.cli.main import main
for argv in json.loads(sys.argv[1]):
    sys.argv = ["convert_to_quant", *argv]
    main()
"""


def convert_to_quant(sources: dict[str, Path], folder: Path) -> dict[tuple[str, str], Path]:
    """{(part, mode): the file convert-to-quant writes from `sources[part]` in `mode`}, the modes of
    CONVERT_TO_QUANT_MODES on each part, in one process."""
    runs, out = [], {}
    for part, source in sources.items():
        for mode in CONVERT_TO_QUANT_MODES[part]:
            flags = CONVERT_TO_QUANT[mode][0]
            out[part, mode] = folder / f"{part}-ctq-{mode}.safetensors"
            runs.append(["-i", str(source), "-o", str(out[part, mode]), "--comfy_quant", "--simple", "--device", "cpu",
                         "--save-quant-metadata", "--manual_seed", "0", FILTERS[part], *flags])
    done = subprocess.run([sys.executable, "-P", "-c", _CTQ_DRIVER, json.dumps(runs)], capture_output=True, text=True,
                          timeout=600)
    missing = [str(p) for p in out.values() if not p.is_file()]
    assert done.returncode == 0 and not missing, (missing, done.stdout[-3000:], done.stderr[-3000:])
    return out


def _declaration(conf: dict) -> torch.Tensor:
    return torch.tensor(list(json.dumps(conf).encode()), dtype=torch.uint8)


def kitchen_writes(mode: str) -> bool:
    """Whether this comfy-kitchen's layout takes every argument of `mode` (an older one would ignore what it does not
    know: 6-bit W4A8 came after ComfyUI 0.33's)."""
    import inspect

    import comfy_kitchen.tensor

    layout, arguments, _, _ = KITCHEN[mode]
    return set(arguments) <= set(inspect.signature(getattr(comfy_kitchen.tensor, layout).quantize).parameters)


def kitchen(part: str, base: dict[str, torch.Tensor], mode: str) -> dict[str, torch.Tensor]:
    """`base` (a part's bf16 state dict) with the linear weights of KITCHEN_LAYERS[part] quantized by comfy-kitchen's
    layout of `mode`, each stored as its state_dict names it (QuantizedTensor.from_float(...).state_dict(key)), with
    ComfyUI's comfy_quant JSON. The layout is comfy-kitchen's own class: ComfyUI 0.33 registers its subclasses under
    some of the names once it is imported."""
    import comfy_kitchen.tensor

    layout, arguments, conf, _ = KITCHEN[mode]
    layout = getattr(comfy_kitchen.tensor, layout)
    out = {}
    for key, value in base.items():
        chosen = key.startswith(KITCHEN_LAYERS[part]) or (mode, key) == KITCHEN_EMBEDDING
        if not (chosen and key.endswith(".weight") and value.dim() == 2):
            out[key] = value
            continue
        qdata, params = layout.quantize(value, **arguments)
        out.update({key + suffix: t.contiguous() for suffix, t in layout.state_dict_tensors(qdata, params).items()})
        out[key.removesuffix("weight") + "comfy_quant"] = _declaration(conf)
    return out


def with_pre_quant_scale(base: dict[str, torch.Tensor], layer: str) -> dict[str, torch.Tensor]:
    """NVFP4 as NVIDIA's ModelOpt writes it with AWQ: one layer's columns divided by a per-input pre_quant_scale
    before comfy-kitchen quantizes it, the scale stored beside it (the host multiplies the layer's input by it)."""
    from comfy_kitchen.tensor import TensorCoreNVFP4Layout

    weight = base[layer + ".weight"]
    pre = torch.rand(weight.shape[1], generator=torch.Generator().manual_seed(5)) + 0.5
    qdata, params = TensorCoreNVFP4Layout.quantize((weight.float() / pre).to(weight.dtype))
    out = dict(base)
    out.update({layer + ".weight" + suffix: t for suffix, t in
                TensorCoreNVFP4Layout.state_dict_tensors(qdata, params).items()})
    out[layer + ".pre_quant_scale"] = pre
    out[layer + ".comfy_quant"] = _declaration({"format": "nvfp4"})
    return out


# --- ComfyUI 0.33's reading ---------------------------------------------------------------------------------------


def _one_byte(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t.view(dtype) if t.dtype in (torch.uint8, dtype) else t


def _setting(conf: dict, name: str, default):
    params = conf.get("params") if isinstance(conf.get("params"), dict) else {}
    return conf.get(name, params.get(name, default))


# comfy/ops.py's _load_quantized_module (0.33) as a table: format -> (comfy-kitchen layout, its storage dtype, the
# layout's parameters from the layer's tensors and JSON). The fp8 formats are ComfyUI's subclasses of comfy-kitchen's
# fp8 layout, which dequantize as it does.
KITCHEN_READING = {
    "float8_e4m3fn": ("TensorCoreFP8Layout", torch.float8_e4m3fn, lambda t, c: {"scale": t["weight_scale"]}),
    "float8_e5m2": ("TensorCoreFP8Layout", torch.float8_e5m2, lambda t, c: {"scale": t["weight_scale"]}),
    "mxfp8": ("TensorCoreMXFP8Layout", torch.float8_e4m3fn,
              lambda t, c: {"scale": _one_byte(t["weight_scale"], torch.float8_e8m0fnu)}),
    "nvfp4": ("TensorCoreNVFP4Layout", torch.uint8,
              lambda t, c: {"scale": t["weight_scale_2"], "block_scale": _one_byte(t["weight_scale"],
                                                                                   torch.float8_e4m3fn)}),
    "int8_tensorwise": ("TensorWiseINT8Layout", torch.int8,
                        lambda t, c: {"scale": t["weight_scale"],
                                      **({"convrot": True, "convrot_groupsize": int(_setting(c, "convrot_groupsize",
                                                                                             256))}
                                         if _setting(c, "convrot", False) else {})}),
    "convrot_w4a4": ("TensorCoreConvRotW4A4Layout", torch.int8,
                     lambda t, c: {"scale": t["weight_scale"], "quant_group_size": 64,
                                   "convrot_groupsize": int(_setting(c, "convrot_groupsize", 256)),
                                   "linear_dtype": _setting(c, "linear_dtype", "int4")}),
    "asym_w4a8_int8": ("AsymW4A8Int8Layout", torch.int8,
                       lambda t, c: {"scale": _one_byte(t["weight_s_rel"], torch.float8_e4m3fn),
                                     "s_channel": t.get("weight_s_channel"), "codebook": t.get("weight_codebook"),
                                     "group_size": int(_setting(c, "group_size", 16)),
                                     "convrot_groupsize": int(_setting(c, "convrot_groupsize", 256))}),
}


def layer_tensors(sd: dict[str, torch.Tensor], layer: str) -> dict[str, torch.Tensor]:
    """A layer's stored tensors by suffix ("weight", "weight_scale", "comfy_quant", ...)."""
    return {k[len(layer) + 1:]: v for k, v in sd.items() if k.startswith(layer + ".") and "." not in k[len(layer) + 1:]}


def host_reads_comfy_quant() -> bool:
    """Whether the running ComfyUI reads comfy_quant files itself (0.33 does, 0.3.75 does not)."""
    import comfy.quant_ops

    return "int8_tensorwise" in getattr(comfy.quant_ops, "QUANT_ALGOS", {})


def hosts_reading(tensors: dict[str, torch.Tensor], shape) -> torch.Tensor:
    """The running ComfyUI's own float32 weight of a comfy_quant layer: its mixed-precision Linear loaded with the
    layer's tensors, dequantized, times the pre_quant_scale it multiplies the input by."""
    import comfy.ops

    linear = comfy.ops.mixed_precision_ops({}, compute_dtype=torch.float32).Linear(shape[1], shape[0], bias=False)
    linear.load_state_dict(dict(tensors), strict=False)
    weight = linear.weight.dequantize().float()
    pre = getattr(linear, "pre_quant_scale", None)
    return weight if pre is None else weight * pre.float()


def kitchen_reading(tensors: dict[str, torch.Tensor], shape) -> torch.Tensor:
    """The same through KITCHEN_READING: comfy-kitchen's layout with the parameters ComfyUI 0.33 reads."""
    from comfy_kitchen.tensor import QuantizedTensor, get_layout_class

    conf = json.loads(bytes(tensors["comfy_quant"].tolist()))
    layout, storage, parameters = KITCHEN_READING[conf["format"]]
    params = get_layout_class(layout).Params(**parameters(tensors, conf), orig_dtype=torch.float32,
                                             orig_shape=tuple(shape))
    weight = QuantizedTensor(tensors["weight"].to(storage), layout, params).dequantize().float()
    pre = tensors.get("pre_quant_scale")
    return weight if pre is None else weight * pre.float()


def reference_weight(tensors: dict[str, torch.Tensor], shape) -> torch.Tensor:
    """ComfyUI 0.33's float32 weight of a comfy_quant layer: the host's own reading where it has one."""
    return (hosts_reading if host_reads_comfy_quant() else kitchen_reading)(tensors, shape)
