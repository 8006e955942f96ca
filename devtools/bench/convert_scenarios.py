"""Writing files in `flux2dev bench`: the pack's GGUF quantizers against gguf-py's numpy quantizer, which they
replace, on the same FLUX.2-shaped weights (values per second and bit equality), and a conversion's own memory
against the largest tensor it holds, beside the pages of the source it maps.

The conversion rows convert a random encoder in ComfyUI's single-file form (quick: the tiny test geometry; full:
the benchmark geometry, the real width of FLUX.2 [dev]'s Mistral-Small with 3 layers, whose largest tensor is
the 131072 x 5120 embedding) to bf16, to fp8 and to a Q4_K_M GGUF (llama.cpp's preset), each in a fresh child
process after evicting the source from the page cache; the transformer conversion streams the same way
(loaders/convert/tensor_files.py)."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import tempfile
from pathlib import Path

import numpy as np
import torch

from ..tiny.geometry import BENCH_MISTRAL, TINY_MISTRAL
from .encode_scenarios import write_encoder
from .meters import Measured, best, evict, in_child_sampled, one_thread, proc_kib

# [out, in] of a FLUX.2 [dev] weight (the double blocks' MLP out: 3072 x 12288 would be Klein's; 6144 x 18432 is
# [dev]'s single-block output); quick: one small one.
_QUANT_SHAPES = {True: (512, 2048), False: (6144, 18432)}
_ENCODERS = {True: TINY_MISTRAL, False: BENCH_MISTRAL}


def bench_quantize(quick: bool) -> list[dict]:
    """Per legacy type the pack writes (F32 aside, a copy; the K types have their own rows): values per second of
    the pack's quantizer (into one output buffer, reused as a conversion reuses it) and of gguf-py's numpy one on the
    same float32 weights of a FLUX.2 shape, and whether their bytes are equal; beside each row, the memory's
    ceiling: a plain copy of the weights into a reused tensor on the quantizer's threads, measured just before it."""
    import gguf

    from ...loaders.formats.gguf_types import LEGACY_TYPES, quantize, type_of
    from ...loaders.formats.kernels import few_threads, write_path

    shape = _QUANT_SHAPES[quick]
    repeats, reference_repeats = (3, 1) if quick else (5, 2)
    values = (np.random.default_rng(0).standard_normal(shape) * 0.02).astype(np.float32)
    # the copy's target, like the quantizers' outputs (gguf_types.quantized_buffer), in memory numpy allocates
    tensor, copied = torch.from_numpy(values), torch.from_numpy(np.empty_like(values))
    rows = []
    for qtype in LEGACY_TYPES:
        if qtype == gguf.GGMLQuantizationType.F32:
            continue
        # the compiled kernels run on torch's threads, the torch path on half the cores (kernels.py)
        compiled = write_path(type_of(qtype)) == "numba"
        with contextlib.nullcontext() if compiled else few_threads(torch.device("cpu")):
            copy_s = best(lambda: copied.copy_(tensor), repeats)
        out = quantize(tensor, qtype)  # the converter's way: one output buffer, written again chunk after chunk
        pack_s = best(lambda: quantize(tensor, qtype, out=out), repeats)
        reference_s = best(lambda: gguf.quants.quantize(values, qtype), reference_repeats)
        exact = np.array_equal(quantize(tensor, qtype).numpy().reshape(-1),
                               gguf.quants.quantize(values, qtype).view(np.uint8).reshape(-1))
        rows.append({"type": qtype.name, "shape": list(shape), "pack_s": pack_s, "reference_s": reference_s,
                     "copy_s": copy_s, "values": values.size, "out_bytes": out.numel(), "exact": bool(exact)})
    return rows


# What the hand-written vector code in numba_ops.py must gain over its plain loops to stay.
VECTOR_GAIN = 1.3


def bench_vector_kernels(quick: bool) -> list[dict]:
    """Per legacy block type the pack writes: seconds of its one-pass quantizer (numba_ops' vector code bound) and of
    the same kernel code with the plain loops it replaces (gguf_legacy's block ops), on one thread on the same float32
    blocks of a FLUX.2 shape, and whether their bytes are equal."""
    from ...loaders.formats import gguf_legacy, kernels

    shape = _QUANT_SHAPES[quick]
    repeats = 3 if quick else 5
    blocks = (np.random.default_rng(1).standard_normal(shape) * 0.02).astype(np.float32).reshape(-1, 32)
    rows = []
    for row in (row for row in gguf_legacy.ROWS if row.write_kernel):
        vector, loops = kernels.compiled(row.write_kernel), kernels.compiled(row.write_kernel, vector=False)
        out, reference = (np.empty((len(blocks), row.block_bytes), np.uint8) for _ in range(2))
        vector(blocks, out), loops(blocks, reference)  # compiled before the timing
        rows.append({"type": row.name, "shape": list(shape), "vector_s": best(lambda: vector(blocks, out), repeats),
                     "loops_s": best(lambda: loops(blocks, reference), repeats),
                     "exact": bool(np.array_equal(out, reference))})
    return rows


# [out, in] of the K-quant rows: a FLUX.2 [dev] attention projection (3072 x 3072); quick: 64 of its rows.
_KQUANT_SHAPES = {True: (64, 3072), False: (3072, 3072)}
# ggml's own K-quant quantizers, built into the test environment by the tests' module (a clone has tests/).
GGML_REFERENCE = Path(__file__).resolve().parents[2] / "tests" / "ggml_reference.py"


def _ggml_reference():
    """(tests/ggml_reference.py's module, with its library built, or None; why not, or None)."""
    try:
        spec = importlib.util.spec_from_file_location("flux2dev_ggml_reference", GGML_REFERENCE)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        module.build()
        return module, None
    except FileNotFoundError:
        return None, f"{GGML_REFERENCE} is not there (it is in a clone only)"
    except Exception as e:  # the module's Unavailable (no compiler, no network) or a library that does not load
        return None, f"{type(e).__name__}: {e}"


def bench_kquant(quick: bool) -> dict:
    """Per K type: values per second of the pack's quantizer (gguf_types.quantize into one reused output) and of ggml's
    compiled reference quantizer (quantize_row_q*_K_ref, -O2) on the same float32 weights of a FLUX.2 shape, both on
    one thread, and whether their bytes are equal. Where the reference cannot be built, the rows have the pack's
    figures only and `reference_missing` says why."""
    import gguf

    from ...loaders.formats import kernels
    from ...loaders.formats.gguf_types import K_TYPES, quantize, type_of

    shape = _KQUANT_SHAPES[quick]
    repeats = 3 if quick else 5
    values = (np.random.default_rng(4).standard_normal(shape) * 0.02).astype(np.float32)
    tensor = torch.from_numpy(values)
    reference, missing = _ggml_reference()
    rows = []
    for qtype in K_TYPES:
        out = quantize(tensor, qtype, threads=1)  # the first call also loads the compiled kernels: not timed
        with one_thread():
            pack_s = best(lambda: quantize(tensor, qtype, out=out, threads=1), repeats)
        row = {"type": qtype.name, "shape": list(shape), "values": values.size,
               "path": kernels.write_path(type_of(qtype)), "pack_s": pack_s}
        if reference is not None:
            ggml = lambda: reference.reference(qtype.name, values, gguf.GGML_QUANT_SIZES[qtype][1])  # noqa: E731
            row.update(reference_s=best(ggml, repeats), exact=bool(np.array_equal(out.numpy(), ggml())))
        rows.append(row)
    return {"rows": rows, "reference": f"ggml (llama-cpp-python {reference.VERSION})" if reference else None,
            "reference_missing": missing}


def _child_convert(src: str, out: str, dtype: str) -> dict:
    from ...loaders.convert.encoder import DTYPES, convert_encoder
    from ...loaders.convert.encoder_gguf import convert_encoder_gguf
    from ...loaders.formats.safetensors_file import read_header

    infos, _ = read_header(src)
    evict([src])
    with Measured() as m:
        anon_before, mapped_before = proc_kib("RssAnon") * 1024, proc_kib("RssFile") * 1024
        if dtype in DTYPES:
            convert_encoder(src, out, dtype=dtype)
        else:  # a llama.cpp preset, as a GGUF
            convert_encoder_gguf(src, out, qtype=dtype)
    return {"dtype": dtype, "file_bytes": os.path.getsize(src), "out_bytes": os.path.getsize(out),
            "largest_bytes": max(i.nbytes for i in infos.values()), "anon_before_bytes": anon_before,
            "mapped_before_bytes": mapped_before, "read_bytes": m.read_bytes, "seconds": m.seconds}


# The encoder conversions measured: ComfyUI's single file in bf16 and fp8, and a llama.cpp K preset's GGUF.
CONVERSIONS = ("bf16", "fp8", "Q4_K_M")


def bench_conversion(quick: bool) -> dict:
    """{"geometry": {...}, "rows": [per output type: file, output and largest tensor bytes, own memory and mapped file
    pages at their peaks above the child's before the conversion (the source's pages, and libraries loaded on the way),
    reads, s]}."""
    from ...loaders.convert.encoder import DTYPES

    g = _ENCODERS[quick]
    layers = g.layers[0]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "encoder.safetensors")
        write_encoder(src, g, layers, "bf16")
        for dtype in CONVERSIONS:
            out = os.path.join(tmp, f"out-{dtype}.{'safetensors' if dtype in DTYPES else 'gguf'}")
            row, figures = in_child_sampled("convert_scenarios", "_child_convert", src, out, dtype,
                                            what=f"conversion of {src}")
            rows.append({**row, "own_bytes": figures["peak_anon_bytes"] - row.pop("anon_before_bytes"),
                         "mapped_bytes": figures["peak_mapped_bytes"] - row.pop("mapped_before_bytes")})
            os.remove(out)
    return {"geometry": {"width": g.width, "mlp": g.mlp, "vocab": g.vocab, "layers": layers}, "rows": rows}


def _memory_gbps(r: dict) -> tuple[float, float]:
    """(the pack's bytes read and written per second, the copy's): float32 values in, the type's bytes out."""
    return (4 * r["values"] + r["out_bytes"]) / r["pack_s"] / 1e9, 8 * r["values"] / r["copy_s"] / 1e9


def format_quantize(rows: list[dict]) -> str:
    lines = [f"{'type':<6} {'shape':>12} {'pack Mval/s':>12} {'gguf Mval/s':>12} {'ratio':>7} {'pack GB/s':>10} "
             f"{'copy GB/s':>10} {'of copy':>8}  exact"]
    for r in rows:
        shape = "x".join(map(str, r["shape"]))
        pack_gbps, copy_gbps = _memory_gbps(r)
        lines.append(f"{r['type']:<6} {shape:>12} {r['values'] / r['pack_s'] / 1e6:>12.1f} "
                     f"{r['values'] / r['reference_s'] / 1e6:>12.1f} {r['reference_s'] / r['pack_s']:>6.1f}x "
                     f"{pack_gbps:>10.1f} {copy_gbps:>10.1f} {pack_gbps / copy_gbps:>8.0%}  "
                     f"{'yes' if r['exact'] else 'NO'}")
    ratios = [r["reference_s"] / r["pack_s"] for r in rows]
    lines.append(f"lowest ratio {min(ratios):.1f}x, geometric mean {float(np.exp(np.mean(np.log(ratios)))):.1f}x")
    return "\n".join(lines)


def format_kquant(result: dict) -> str:
    rows = result["rows"]
    lines = [f"K-quant quantization of float32 weights on one thread, the same input for both (pack: gguf_types."
             f"quantize by its {rows[0]['path']} path;\nggml: its compiled quantize_row_q*_K_ref, the bytes "
             "llama-quantize writes)",
             f"{'type':<6} {'shape':>12} {'pack Mval/s':>12} {'ggml Mval/s':>12} {'ratio':>7}  exact"]
    for r in rows:
        pack = f"{r['type']:<6} {'x'.join(map(str, r['shape'])):>12} {r['values'] / r['pack_s'] / 1e6:>12.1f}"
        if "reference_s" not in r:
            lines.append(f"{pack} {'-':>12} {'-':>7}  -")
            continue
        lines.append(f"{pack} {r['values'] / r['reference_s'] / 1e6:>12.1f} {r['reference_s'] / r['pack_s']:>6.2f}x  "
                     f"{'yes' if r['exact'] else 'NO'}")
    if result["reference"] is None:
        lines.append(f"ggml: not measured, {result['reference_missing']}")
    else:
        ratios = [r["reference_s"] / r["pack_s"] for r in rows]
        mean = float(np.exp(np.mean(np.log(ratios))))
        lines.append(f"lowest ratio {min(ratios):.2f}x ggml, geometric mean {mean:.2f}x")
    return "\n".join(lines)


def format_vector_kernels(rows: list[dict]) -> str:
    lines = ["the one-pass quantizers' vector code against the same kernels with plain numba loops in its place, on "
             f"one thread (it stays where it is at least {VECTOR_GAIN}x faster)",
             f"{'type':<6} {'shape':>12} {'vector ms':>10} {'loops ms':>10} {'ratio':>7}  exact"]
    for r in rows:
        gain = r["loops_s"] / r["vector_s"]
        lines.append(f"{r['type']:<6} {'x'.join(map(str, r['shape'])):>12} {r['vector_s'] * 1e3:>10.2f} "
                     f"{r['loops_s'] * 1e3:>10.2f} {gain:>6.2f}x  {'yes' if r['exact'] else 'NO'}"
                     + ("" if gain >= VECTOR_GAIN else f"  (under {VECTOR_GAIN}x: the loops would do)"))
    return "\n".join(lines)


def format_conversion(result: dict) -> str:
    g = result["geometry"]
    lines = [f"encoder conversion (width {g['width']}, MLP {g['mlp']}, vocabulary {g['vocab']}, {g['layers']} layers; "
             "source evicted from the page cache):"]
    for r in result["rows"]:
        lines.append(f"  to {r['dtype']}: file {r['file_bytes'] / 2**20:.0f} MiB -> {r['out_bytes'] / 2**20:.0f} MiB, "
                     f"largest tensor {r['largest_bytes'] / 2**20:.0f} MiB, "
                     f"own memory {r['own_bytes'] / 2**20:.0f} MiB "
                     f"({r['own_bytes'] / r['largest_bytes']:.2f} x the largest tensor, "
                     f"{r['own_bytes'] / r['file_bytes']:.2f} x the file), "
                     f"mapped {r['mapped_bytes'] / 2**20:.0f} MiB, "
                     f"read {r['read_bytes'] / 2**20:.0f} MiB, {r['seconds']:.1f} s")
    return "\n".join(lines)
