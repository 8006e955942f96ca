"""`flux2dev convert transformer`: a FLUX.2 transformer (BFL single file in bf16 or scaled fp8, diffusers
`transformer/` folder, pipeline) written as a GGUF file that this pack and ComfyUI-GGUF load, optionally with
LoRAs baked in.

Each tensor is read on its own (loaders/models/transformer.py plans and checks the whole file first, as a load
does), its packed weights dequantized exactly in float32, a LoRA applied in float32 where one is given, and
written in the type the table below gives it: the asked --type for the weights that take it, the rest in
higher precision. What stays unquantized, and why (UNQUANTIZED, first rule that applies):

- 1-D tensors and tensors of at most 1024 values (FLUX.2's RMSNorm scales; it has no biases): F32. llama.cpp
  quantizes matrices only, and ComfyUI-GGUF's convert.py keeps these in F32.
- img_in, txt_in, time_in, guidance_in, final_layer: BF16 (F16 with --type F16). The FLUX filter of
  ComfyUI-GGUF's llama.cpp patch keeps these (the embedders and the output layer) unquantized: they touch
  every token at the model's entry and exit, where an error is not averaged out by later blocks.
- double_stream_modulation_img, double_stream_modulation_txt, single_stream_modulation: BF16 (F16 with
  --type F16). FLUX.2's shared modulation replaces FLUX.1's per-block one; it scales and gates every block's
  activations, and runs once per step on one vector, so keeping it precise costs memory (1.1 GB in BF16 for
  [dev] instead of 0.3 GB at 4 bits) and no speed.
- a matrix whose rows do not hold whole blocks of the type: BF16, F16 in a K type as lcpp.patch falls back (no
  FLUX.2 tensor is one).

The metadata is what FLUX.2 GGUFs in the wild carry: general.architecture "flux", general.quantization_version
2 and general.file_type (llama.cpp's number for the --type); tensors keep their BFL names.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
from gguf import GGML_QUANT_VERSION, GGUFValueType, LlamaFileType
from gguf import GGMLQuantizationType as Q

from ...errors import CorruptFileError, UnsupportedFormatError
from ..formats import packed_dequant
from ..formats.gguf_row import NotQuantizable
from ..formats.gguf_types import K_TYPES, type_of
from ..models import progress
from ..models.transformer import TransformerPlan, plan_transformer
from .output import check_not_source, check_output, output_file
from .presets import K_PRESETS, written_types
from .tensor_files import gguf_file, write_quantized

ARCHITECTURE = "flux"  # what FLUX GGUF files (city96's conversions and FLUX.2's among them) state


@dataclass(frozen=True)
class Written:
    """What a --type writes: the GGUF type of the weights, that of the fused attention qkv weights, and the file
    type llama.cpp names it by (general.file_type)."""

    weights: Q
    qkv: Q
    file_type: LlamaFileType


TYPES = {name: Written(*(Q[t] for t in K_PRESETS.get(name, (name, name))), LlamaFileType[f"MOSTLY_{name}"])
         for name in written_types()}
QKV = ("attn_qkv.weight", "attn.qkv.weight", "attention.qkv.weight")  # lcpp.patch's spellings of a fused qkv
SMALL = 1024  # values: a tensor this small stays F32 (ComfyUI-GGUF's QUANTIZATION_THRESHOLD)
VECTOR = Q.F32


def _file_float(qtype: Q) -> Q:
    """The higher-precision float type of a file written in `qtype`: F16 in an F16 file, else BF16."""
    return Q.F16 if qtype == Q.F16 else Q.BF16


@dataclass(frozen=True)
class Keep:
    """A rule of the unquantized list: a tensor it applies to, which would take `qtype`, is stored in
    `stored(qtype)`."""

    why: str
    applies: Callable[[str, tuple[int, ...], Q], bool]
    stored: Callable[[Q], Q] = _file_float


UNQUANTIZED = (
    Keep("a vector or a tensor of at most 1024 values (norm scales)",
         lambda key, shape, qtype: len(shape) < 2 or math.prod(shape) <= SMALL, lambda qtype: VECTOR),
    Keep("an embedder or the final layer (ComfyUI-GGUF's FLUX filter)",
         lambda key, shape, qtype: key.startswith(("img_in.", "txt_in.", "time_in.", "guidance_in.",
                                                   "final_layer."))),
    Keep("FLUX.2's shared modulation",
         lambda key, shape, qtype: key.startswith(("double_stream_modulation_img.", "double_stream_modulation_txt.",
                                                   "single_stream_modulation."))),
    # in a K type, such rows fall back to F16 (lcpp.patch)
    Keep("rows that do not hold whole blocks of the type", lambda key, shape, qtype: not type_of(qtype).fits(shape),
         lambda qtype: Q.F16 if qtype in K_TYPES else _file_float(qtype)),
)


def tensor_type(key: str, shape: tuple[int, ...], written: Written) -> tuple[Q, str | None]:
    """The GGUF type of tensor `key` in a file of `written`, and the rule that kept it unquantized (None when it
    takes the written type)."""
    qtype = written.qkv if any(spelling in key for spelling in QKV) else written.weights
    rule = next((rule for rule in UNQUANTIZED if rule.applies(key, shape, qtype)), None)
    return (qtype, None) if rule is None else (rule.stored(qtype), rule.why)


def gguf_plan(shapes: dict[str, tuple[int, ...]], qtype: str) -> tuple[list, dict[str, tuple[Q, tuple, int]]]:
    """The metadata and the tensors ({key: (GGUF type, shape, bytes)}, by name) of a transformer GGUF whose
    weights are `qtype` (a TYPES name), for gguf_file."""
    written = TYPES[qtype]
    layout = {}
    for key, shape in sorted(shapes.items()):
        stored = tensor_type(key, shape, written)[0]
        layout[key] = (stored, shape, type_of(stored).nbytes(shape))
    metadata = [
        ("general.architecture", GGUFValueType.STRING, ARCHITECTURE),
        ("general.quantization_version", GGUFValueType.UINT32, GGML_QUANT_VERSION),
        ("general.file_type", GGUFValueType.UINT32, int(written.file_type)),
    ]
    return metadata, layout


def convert_transformer(src: str, out: str, *, qtype: str, force: bool = False,
                        patch: Callable[[TransformerPlan],
                                        Callable[[str, torch.Tensor], torch.Tensor]] | None = None) -> dict:
    """Write the transformer at `src` to `out` (a .gguf file) with its weights in `qtype` (a TYPES name) and
    the rest as UNQUANTIZED says; returns what was written. `patch(plan)`, where given, makes the function that
    bakes LoRAs into each dense float32 weight (host/lora_bake.py). Nothing is written when the source is
    refused or `out` is taken (unless `force`)."""
    if qtype not in TYPES:
        raise UnsupportedFormatError(f"GGUF transformers are written as {', '.join(TYPES)}, not {qtype!r}.")
    target = check_output(out, force=force, suffix=".gguf")
    plan = plan_transformer(src)
    check_not_source(target, src)
    apply = patch(plan) if patch is not None else None
    metadata, layout = gguf_plan({key: shape for key, (shape, _) in plan.tensors.items()}, qtype)
    types = {key: stored for key, (stored, _, _) in layout.items()}
    with output_file(target, force=force) as f:
        file = gguf_file(f, metadata, layout)
        for key in progress.tracked(list(types)):
            shape, read = plan.tensors[key]
            weight, companions = packed_dequant.split_entries(read(), key)
            values = (packed_dequant.dequantize(weight, companions, torch.float32, shape) if companions or apply
                      else weight)
            if apply is not None:
                values = apply(key, values)
            del weight, companions
            _write(file, key, values, types[key])
            del values
        file.finish()
    counts: dict[str, int] = {}
    for t in types.values():
        counts[t.name] = counts.get(t.name, 0) + 1
    return {"path": str(target), "layout": plan.layout.name, "variant": plan.variant.key, "type": qtype,
            "tensors": len(types), "types": counts, "bytes": os.path.getsize(target)}


def _write(file, key: str, values: torch.Tensor, qtype: Q) -> None:
    try:
        write_quantized(file, key, values, qtype)
    except NotQuantizable as e:
        raise CorruptFileError(
            f"The transformer's {key} cannot be written as {qtype.name}: {e}. A weight like that is damaged "
            "(or a LoRA baked into it diverged); check the source, or write BF16 where the values are only large."
        ) from None
