"""What two model files are to each other, tensor by tensor (`flux2dev compare`'s identity part), stated from the
weights themselves rather than guessed from names or sizes.

Both files are read as their loader reads them (the same checks, the same key names: the host's for encoders, BFL
for transformers, as stored for VAEs), one weight at a time with the companions of its packing. Each weight is:

- identical: the same stored bytes, dtype and shape (the digest the conditioning cache computes: for encoders,
  the whole file's digest is the cache's weights fingerprint, so equal digests share cache entries);
- equal after dequantization: other bytes, the same values (an F16 GGUF of float32 weights, say);
- a cast of the other: one side packed (scaled fp8, a GGUF type the pack writes) or of a narrower float dtype,
  and exactly what casting the other side's values gives (the fp8 scale the packed side stores; gguf-py's
  quantizer, which the pack's matches bit for bit);
- different, with the largest difference and the relative L2 distance of the values;
- only in one of the files, or of another shape.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ...errors import WrongModelError
from ..cache.store import ContentDigest, tensors_digest
from ..formats import packed_dequant, packing
from ..formats.gguf_types import quantize, type_of
from ..models import progress
from ..models.inspect import check_comparable

IDENTICAL = "identical"
EQUAL = "equal after dequantization"
CAST_OF_A = "B is a cast of A"
CAST_OF_B = "A is a cast of B"
DIFFER = "differ"
ONLY_A, ONLY_B = "only in A", "only in B"
VERDICTS = (IDENTICAL, EQUAL, CAST_OF_A, CAST_OF_B, DIFFER, ONLY_A, ONLY_B)


@dataclass
class Weights:
    """A model file's weights as its loader reads them: names, logical shapes, a reader per weight (the
    weight and the companions of its packing, in the loader's key names), and what the file is."""

    path: str
    kind: str  # encoder, transformer or vae
    description: dict
    shapes: dict[str, tuple[int, ...]]
    read: Callable[[str], dict[str, torch.Tensor]]
    digest: str = field(default="", init=False)


def _encoder(path: str) -> Weights:
    from ..models.encoder import plan_encoder, planned_weights, read_weight

    plan = plan_encoder(path)
    shapes = {host: plan.source.entries[plan.mapping[host]][1] for host in planned_weights(plan)}
    return Weights(path, "encoder", {"layout": plan.layout, "formats": plan.formats}, shapes,
                   lambda host: read_weight(plan, host))


def _transformer(path: str) -> Weights:
    from ..models.transformer import plan_transformer

    plan = plan_transformer(path)
    shapes = {key: shape for key, (shape, _) in plan.tensors.items()}
    return Weights(path, "transformer", {"layout": plan.layout.name, "variant": plan.variant.key}, shapes,
                   lambda key: plan.tensors[key][1]())


def _gguf_transformer(path: str) -> Weights:
    from ..models.gguf_transformer import load_gguf_transformer

    loaded = load_gguf_transformer(path)  # views of the mapped file
    sd = loaded.state_dict
    shapes = {}
    for key, t in sd.items():
        if not packing.is_companion(key):
            shapes[key] = _logical_shape(t, packed_dequant.split_entries(_entries(sd, key), key)[1])
    return Weights(path, "transformer", {"layout": "gguf", "variant": loaded.variant.key, "formats": loaded.formats},
                   shapes, lambda key: _entries(sd, key))


def _vae(path: str) -> Weights:
    from ..formats.safetensors_file import SafetensorsFiles
    from ..models.vae import check_flux2_vae, vae_files

    files = SafetensorsFiles([str(p) for p in vae_files(path)])
    check_flux2_vae({k: i.shape for k, i in files.infos.items()}, str(path))
    layout = "diffusers" if "decoder.conv_norm_out.weight" in files.infos else "BFL"
    return Weights(path, "vae", {"layout": layout}, {k: i.shape for k, i in files.infos.items()},
                   lambda name: {name: files.read(name)})


def _entries(sd: dict, key: str) -> dict[str, torch.Tensor]:
    layer = key[: -len("weight")] if key.endswith(".weight") else None
    out = {key: sd[key]}
    if layer is not None:
        out.update({layer + c: sd[layer + c] for c in packing.COMPANIONS if layer + c in sd})
    return out


def _logical_shape(stored: torch.Tensor, companions: dict) -> tuple[int, ...]:
    if packing.GGUF_TYPE in companions:
        row = type_of(int(companions[packing.GGUF_TYPE]))
        return (*stored.shape[:-1], stored.shape[-1] // row.block_bytes * row.block_values)
    return tuple(stored.shape)


def _pipeline(path: str) -> Weights:
    parts = ", ".join(str(Path(path) / p) for p in ("transformer", "text_encoder", "vae"))
    raise WrongModelError(f"{path} is a pipeline folder, which holds several models; compare one of its parts: "
                          f"{parts}.")


READERS = {"encoder": _encoder, "transformer": _transformer, "gguf-transformer": _gguf_transformer, "vae": _vae,
           "pipeline": _pipeline}


def weights_at(path: str) -> Weights:
    """The weights of the model file or folder at `path`, read as its loader reads them."""
    from ..models.inspect import inspect_path, model_kind

    if not os.path.lexists(path):
        inspect_path(path)  # the loaders' own error for a path that is not there
    kind = model_kind(Path(path))
    if kind == "other":
        inspect_path(path)  # names what it is instead
    return READERS[kind](str(path))


# --- one weight against another --------------------------------------------------------------------------------


def _dense(entries: dict, name: str, shape) -> torch.Tensor:
    weight, companions = packed_dequant.split_entries(entries, name)
    return packed_dequant.dequantize(weight, companions, torch.float32, shape)


def is_cast(dense: torch.Tensor, entries: dict, name: str) -> bool:
    """Whether the stored weight `name` of `entries` is exactly `dense` cast to its packing or dtype: scaled fp8
    with the scale stored beside it, a GGUF type the pack quantizes (gguf-py's quantizer), a narrower float."""
    from .encoder import fp8_cast

    weight, companions = packed_dequant.split_entries(entries, name)
    if packed_dequant.format_of(weight.dtype, companions) is packing.FP8_SCALED:
        scale = companions["weight_scale"].to(torch.float32)
        cast = fp8_cast(dense, scale.reshape(-1, 1) if scale.numel() > 1 else scale.reshape(()), weight.dtype)
        return torch.equal(cast.view(torch.uint8), weight.view(torch.uint8))
    if packing.GGUF_TYPE in companions:
        row = type_of(int(companions[packing.GGUF_TYPE]))
        if not row.writer or not row.fits(tuple(dense.shape)) or not torch.isfinite(dense).all():
            return False
        return torch.equal(quantize(dense, row).reshape(-1), weight.reshape(-1))
    if companions or not weight.is_floating_point() or weight.dtype.itemsize >= dense.dtype.itemsize:
        return False
    return torch.equal(dense.to(weight.dtype).view(torch.int8), weight.view(torch.int8))


def figure(value: torch.Tensor) -> float | None:
    """A 0-d result as a number, or None where it is none (NaN or infinite: a division by a norm of 0, or values
    that are not finite), which JSON cannot hold."""
    value = value.item()
    return value if math.isfinite(value) else None


def distances(a: torch.Tensor, b: torch.Tensor) -> dict:
    """B's distance from A, in float64: the largest absolute difference and the relative L2 distance |a - b| / |a|
    (None where A is all zeros)."""
    a, b = a.double().reshape(-1), b.double().reshape(-1)
    diff = a - b
    return {"max_abs": figure(diff.abs().max()), "rel_l2": figure(diff.norm() / a.norm())}


def verdict(a: dict, b: dict, name: str, shape_a, shape_b) -> dict:
    """How weight `name` of A (`a`: its entries) stands to B's."""
    if tensors_digest(a) == tensors_digest(b):
        return {"name": name, "verdict": IDENTICAL}
    if tuple(shape_a) != tuple(shape_b):
        return {"name": name, "verdict": DIFFER, "shapes": [list(shape_a), list(shape_b)]}
    dense_a, dense_b = _dense(a, name, shape_a), _dense(b, name, shape_b)
    if torch.equal(dense_a, dense_b):
        return {"name": name, "verdict": EQUAL}
    if is_cast(dense_a, b, name):
        return {"name": name, "verdict": CAST_OF_A}
    if is_cast(dense_b, a, name):
        return {"name": name, "verdict": CAST_OF_B}
    return {"name": name, "verdict": DIFFER, **distances(dense_a, dense_b)}


def compare_weights(a: Weights, b: Weights) -> dict:
    """Every weight of A against B's of the same name, and each file's digest (tensors_digest over all its weights
    and companions); {"counts", "tensors", "summary"}."""
    check_comparable(a.path, b.path)
    digests = ContentDigest(), ContentDigest()
    rows = []
    for name in progress.tracked(sorted(set(a.shapes) | set(b.shapes))):
        if name not in b.shapes:
            rows.append({"name": name, "verdict": ONLY_A})
            _feed(digests[0], a.read(name))
            continue
        if name not in a.shapes:
            rows.append({"name": name, "verdict": ONLY_B})
            _feed(digests[1], b.read(name))
            continue
        entries_a, entries_b = a.read(name), b.read(name)
        _feed(digests[0], entries_a)
        _feed(digests[1], entries_b)
        rows.append(verdict(entries_a, entries_b, name, a.shapes[name], b.shapes[name]))
        del entries_a, entries_b
    a.digest, b.digest = (d.hexdigest() for d in digests)
    counts = {v: sum(r["verdict"] == v for r in rows) for v in VERDICTS}
    return {"counts": {v: n for v, n in counts.items() if n}, "tensors": rows, "summary": _summary(counts, len(rows))}


def _feed(digest: ContentDigest, entries: dict) -> None:
    for key in sorted(entries):
        digest.add(key, entries[key])


def _summary(counts: dict[str, int], total: int) -> str:
    if counts[IDENTICAL] == total:
        return "A and B hold the same weights, byte for byte"
    for cast, other in ((CAST_OF_A, "B is A"), (CAST_OF_B, "A is B")):
        if counts[cast] and counts[IDENTICAL] + counts[EQUAL] + counts[cast] == total:
            return (f"{other} exactly cast: every weight is identical, equal, or the cast of the other's "
                    f"({counts[cast]} cast)")
    if counts[IDENTICAL] + counts[EQUAL] == total:
        return "A and B hold the same values, stored differently"
    return f"A and B differ: {counts[DIFFER]} weight(s) differ, {counts[ONLY_A] + counts[ONLY_B]} are in one file only"
