"""`flux2dev convert encoder`: a FLUX.2 [dev] text encoder from any layout the encoder loader reads, written as
ComfyUI's own single file (`mistral_3_small_flux2_bf16/fp8.safetensors`), which this pack and ComfyUI's CLIPLoader
(type flux2) both take.

What is read is what the loader reads (loaders/models/encoder.py: the embeddings and layers 0-29, never the later
layers, the final norm, lm_head or the vision tower), checked the same way, one weight at a time, packed weights
(fp8, NVFP4, GGUF) dequantized exactly in float32 first. What is written, in the host's key names:

- bf16: every weight in bfloat16 (the float32 values rounded to nearest even);
- fp8: each layer's seven projection weights in float8_e4m3fn with a per-tensor float32 scale beside it
  (`<layer>.weight_scale` = the weight's largest magnitude / 448; each value divided by it and rounded), named in
  the `_quantization_metadata` header ComfyUI reads; the embeddings and norms in bfloat16;
- `model.norm.weight`, ones: the pruned encoder never applies a final norm, and ComfyUI's files carry one because
  ComfyUI 0.3.75 takes the encoder's dtype from it;
- `tekken_model`: the tokenizer's vocabulary as a tekken.json listing its special tokens (the form ComfyUI's own
  tokenizer reads), the vocabulary the pack's tokenizer ladder found for the source.
"""

from __future__ import annotations

import json
import os

import torch

from ...errors import CorruptFileError, UnsupportedFormatError
from ..formats import packed_dequant
from ..formats.gguf_row import NotQuantizable, check_peak
from ..formats.kernels import chunks
from ..models import progress
from ..models.encoder import plan_encoder, planned_weights, read_weight, resolve_plan_tokenizer
from ..models.encoder_identify import LAYER_SHAPES
from .output import check_not_source, check_output, output_file
from .tensor_files import safetensors_file

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
FINAL_NORM = "model.norm.weight"
TEKKEN_KEY = "tekken_model"
QUANTIZATION_METADATA = "_quantization_metadata"  # the header entry ComfyUI reads a file's per-layer formats from
SCALE = "weight_scale"
# The layer weights that fp8 files store as fp8: the projections (matrices); norms and embeddings stay bfloat16.
FP8_PARTS = tuple(part for part in LAYER_SHAPES if not part.endswith("norm"))
# --dtype -> (the dtype of fp8-able weights, the dtype of the rest)
DTYPES = {"bf16": (torch.bfloat16, torch.bfloat16), "fp8": (FP8, torch.bfloat16)}


def _is_projection(host: str) -> bool:
    parts = host.split(".")
    return host.startswith("model.layers.") and ".".join(parts[3:5]) in FP8_PARTS


_CAST_VALUES = 1 << 22  # values cast at a time, so no full-size temporary is made


def fp8_scale(peak: float) -> torch.Tensor:
    """The per-tensor scale of a weight's fp8 cast from its largest magnitude `peak`: peak / 448 in float32 (1 for an
    all-zero weight)."""
    peak = torch.tensor(peak, dtype=torch.float32)
    return torch.where(peak > 0, peak / FP8_MAX, torch.ones((), dtype=torch.float32))


def fp8_cast(dense: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = FP8) -> torch.Tensor:
    """float32 values / scale, clamped to the fp8 type's range (the division may land a hair above it), as fp8."""
    top = float(torch.finfo(dtype).max)
    return (dense.to(torch.float32) / scale).clamp_(-top, top).to(dtype)


def _write_cast(file, name: str, values: torch.Tensor, cast) -> None:
    """cast(rows) of `values` written rows after rows, so that only a chunk is ever held in a new dtype."""
    rows = values.reshape(values.shape[0], -1)
    for part in chunks(rows.shape[0], rows.shape[1], values=_CAST_VALUES):
        chunk = cast(rows[part])
        file.write(name, chunk, at=part.start * rows.shape[1] * chunk.element_size())


def _checked_peak(host: str, values: torch.Tensor, dtype: str) -> float:
    """A weight's largest magnitude; refuses a weight no float32 holds (NaN, infinities, float64 values beyond
    float32's range), naming it."""
    peak = max(values.amax().item(), -values.amin().item()) if values.numel() else 0.0
    try:
        check_peak(peak, limited=False)
    except NotQuantizable as e:
        raise CorruptFileError(f"The encoder's {host} cannot be written as {dtype}: {e}. A weight like that is "
                               "damaged; check the source.") from None
    return peak


def convert_encoder(src: str, out: str, *, dtype: str = "bf16", force: bool = False) -> dict:
    """Write the encoder at `src` to `out` (a .safetensors file) in ComfyUI's single-file layout; returns what
    was written. Nothing is written when the source is refused or `out` is taken (unless `force`)."""
    if dtype not in DTYPES:
        raise UnsupportedFormatError(f"The encoder is written as {' or '.join(DTYPES)}, not {dtype!r}.")
    target = check_output(out, force=force, suffix=".safetensors")
    plan = plan_encoder(src)
    check_not_source(target, src)
    tekken = torch.frombuffer(bytearray(_tekken_document(plan)), dtype=torch.uint8)
    packed_dtype, plain_dtype = DTYPES[dtype]
    weights = planned_weights(plan)
    layout, packed = {}, []
    for host in weights:
        shape = plan.source.entries[plan.mapping[host]][1]
        if packed_dtype != plain_dtype and _is_projection(host):
            layout[host] = (packed_dtype, shape)
            layout[host[: -len("weight")] + SCALE] = (torch.float32, ())
            packed.append(host[: -len(".weight")])
        else:
            layout[host] = (plain_dtype, shape)
    layout[FINAL_NORM] = (plain_dtype, (plan.geometry.width,))
    layout[TEKKEN_KEY] = (torch.uint8, tuple(tekken.shape))
    metadata = {QUANTIZATION_METADATA: json.dumps({"format_version": "1.0", "layers": {
        layer: {"format": str(FP8).removeprefix("torch.")} for layer in sorted(packed)}})} if packed else None

    with output_file(target, force=force) as f:
        file = safetensors_file(f, layout, metadata)
        for host in progress.tracked(weights):
            weight, companions = packed_dequant.split_entries(read_weight(plan, host), host)
            shape = layout[host][1]
            # a plain weight, float64 among them, checked as stored: a cast would hide its values
            peak = None if companions else _checked_peak(host, weight, dtype)
            if layout[host][0] == FP8:  # a plain weight is scaled and cast from the file, a chunk at a time
                dense = weight
                if companions:
                    dense = packed_dequant.dequantize(weight, companions, torch.float32, shape)
                    peak = _checked_peak(host, dense, dtype)
                scale = fp8_scale(peak)
                _write_cast(file, host, dense, lambda rows: fp8_cast(rows, scale))
                file.write(host[: -len("weight")] + SCALE, scale)
                del dense
            elif not companions:  # rounded once to bfloat16, a chunk at a time
                _write_cast(file, host, weight, lambda rows: rows.to(plain_dtype))
            else:  # the exact float32 values, rounded once to bfloat16 (computed in chunks by the dequantizer)
                file.write(host, packed_dequant.dequantize(weight, companions, plain_dtype, shape))
            del weight, companions
        file.write(FINAL_NORM, torch.ones(plan.geometry.width, dtype=plain_dtype))
        file.write(TEKKEN_KEY, tekken)
        file.finish()
    return {"path": str(target), "layout": plan.layout, "dtype": dtype, "tensors": len(layout),
            "bytes": os.path.getsize(target), "fp8_layers": len(packed)}


def _tekken_document(plan) -> bytes:
    """The tokenizer the encoder loads with (its own embedded or GGUF vocabulary first, then the ladder), as
    tekken.json bytes."""
    from ...tokenizers.ladder import tekken_pattern
    from ...tokenizers.vocab import tekken_json

    return tekken_json(resolve_plan_tokenizer(plan).tokenizer.vocab, tekken_pattern())
