"""The K-quant quantizers against ggml's own (quantize_row_q*_K_ref, compiled from llama.cpp's C by
tests/ggml_reference.py): the same bytes for every K type, at FLUX.2's row lengths and on the inputs where the
reference's arithmetic has its edges (zeros, constants, outliers, subnormals, float16's limits, rounding ties).
Every test runs on both paths: numba's compiled kernels and the plain Python that stands in without numba."""

from __future__ import annotations

import io

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from comfyui_flux2dev.errors import UnsupportedFormatError
from comfyui_flux2dev.loaders.convert.tensor_files import gguf_file
from comfyui_flux2dev.loaders.formats import gguf_types, kernels
from comfyui_flux2dev.loaders.formats.gguf_row import NotQuantizable
from comfyui_flux2dev.loaders.formats.gguf_types import BY_TYPE, K_TYPES, quantize
from helpers import quantizer_paths, time_bound

quantizer_path = quantizer_paths("python")


def _blocks(*rows) -> np.ndarray:
    """Rows of 256 values, each given as a value (a constant block) or an array that is tiled over the block."""
    return np.array([np.resize(np.asarray(row, np.float32), 256) for row in rows], np.float32)


def _edge_rows() -> np.ndarray:
    rng = np.random.default_rng(3)
    normal = rng.standard_normal(256).astype(np.float32)
    outlier = np.zeros(256, np.float32)
    outlier[77] = 3.5
    lone = normal * np.float32(1e-3)
    lone[200] = -40.0  # one value far beyond the rest of its super-block
    mixed_zero = np.zeros(256, np.float32)
    mixed_zero[::3] = -0.0
    huge = rng.uniform(-65504, 65504, 256).astype(np.float32)
    huge[[0, 100]] = (65504, -65504)  # float16's largest finite values
    sub = np.where(rng.random(256) < 0.5, 1e-40, -3e-41).astype(np.float32)  # float32 subnormals
    sub_groups = normal.copy()
    sub_groups[:32] = 1e-42  # one sub-block of subnormals beside normal ones: its scale rounds to 0 in float16
    tiny_group = normal.copy()
    tiny_group[64:96] *= np.float32(1e-6)  # a sub-block whose 6-bit scale rounds to 0
    ties = (rng.integers(-64, 64, 256) + 0.5).astype(np.float32) / 8  # halves on a coarse grid: rounding ties
    steps = np.arange(256, dtype=np.float32) - 127.5
    mirror = np.concatenate([normal[:16], -normal[:16]])  # sub-blocks of equal and opposite scales: the first wins
    positive = np.abs(normal) + 1  # no negative values: the mins are 0
    negative = -np.abs(normal) - 1
    return _blocks(0.0, mixed_zero, -mixed_zero, 1.0, -2.5, 1e-30, outlier, -outlier, lone, huge, -huge, 65504.0,
                   -65504.0, sub, sub_groups, tiny_group, ties, steps, -steps, mirror, positive, negative, 1e-40,
                   normal)


def _cases():
    rng = np.random.default_rng(11)
    yield "edges", _edge_rows()
    # FLUX.2's row lengths, weights of the usual size; and rounded to bfloat16, as most sources hold them
    for width in (3072, 6144, 18432):
        yield f"flux2-{width}", (rng.standard_normal((1, width)) * 0.02).astype(np.float32)
    bf16 = torch.from_numpy(rng.standard_normal((2, 3072)).astype(np.float32)).bfloat16().float().numpy()
    yield "bf16-valued", bf16
    # every block at its own magnitude, from float32's subnormals up to float16's range
    scales = np.exp(rng.uniform(-95, 9, (24, 1))).astype(np.float32)
    yield "wide-range", (rng.standard_normal((24, 256)) * scales).astype(np.float32)
    # heavy tails and values on small grids (ties of rounding and of magnitude)
    yield "heavy-tails", (rng.standard_cauchy((8, 256)) * 0.1).astype(np.float32)
    yield "grid", (rng.integers(-8, 8, (8, 256)) * np.float32(0.25)).astype(np.float32)
    # an odd number of blocks: Q4_K and Q5_K search two blocks side by side, the last one alone
    yield "odd-blocks", (rng.standard_normal((3, 768)) * 0.02).astype(np.float32)


# The plain path is slow (tens of ms a block): it runs on the edges, the grid and a row of 3072.
_PLAIN_CASES = {"edges", "flux2-3072", "grid", "odd-blocks"}


@pytest.mark.parametrize("qtype", K_TYPES, ids=lambda q: q.name)
def test_bytes_equal_ggml(ggml, quantizer_path, qtype):
    for name, values in _cases():
        if quantizer_path == "python" and name not in _PLAIN_CASES:
            continue
        want = ggml(qtype, values)
        got = quantize(torch.from_numpy(values), qtype).numpy()
        bad = np.flatnonzero((got != want).any(axis=1))
        first = bad[0] if bad.size else None
        assert bad.size == 0, f"{name}: {bad.size} rows differ, first {first}: {got[first][:24]} != {want[first][:24]}"
    assert kernels.write_path(BY_TYPE[qtype]) == quantizer_path


@pytest.mark.parametrize("qtype", K_TYPES, ids=lambda q: q.name)
def test_bfloat16_values_are_quantized_as_their_float32_values(ggml, qtype):
    values = torch.randn(3, 512, generator=torch.Generator().manual_seed(5)).bfloat16()
    out = torch.full((3, 2 * gguf.GGML_QUANT_SIZES[qtype][1]), 7, dtype=torch.uint8)
    assert quantize(values, qtype, out=out) is out
    assert np.array_equal(out.numpy(), ggml(qtype, values.float().numpy()))


@pytest.mark.parametrize("qtype", K_TYPES, ids=lambda q: q.name)
def test_chunks_and_threads_change_no_byte(qtype, monkeypatch):
    """Rows are quantized a chunk at a time (kernels.CHUNK_VALUES), each chunk in runs of blocks on several threads:
    chunks of three rows on three threads, and every row in one chunk on one thread, give the same bytes."""
    values = torch.randn(7, 512, generator=torch.Generator().manual_seed(6)).bfloat16()
    whole = quantize(values, qtype, threads=1)
    monkeypatch.setitem(kernels.CHUNK_VALUES, "cpu", 3 * 512)
    assert torch.equal(quantize(values, qtype, threads=3), whole)


@pytest.mark.parametrize("qtype", K_TYPES, ids=lambda q: q.name)
def test_gguf_py_reads_the_bytes_back(qtype):
    """gguf-py's own numpy dequantizer reads the blocks back to values near the originals."""
    values = torch.randn(4, 3072, generator=torch.Generator().manual_seed(2)) * 0.02
    back = gguf.quants.dequantize(quantize(values, qtype).numpy(), qtype)
    assert back.shape == (4, 3072)
    # relative RMS error by bits per weight: Q2_K ~ 0.2 ... Q6_K ~ 0.01
    error = np.sqrt(np.mean((back - values.numpy()) ** 2)) / values.std().item()
    assert error < {Q.Q2_K: 0.4, Q.Q3_K: 0.2, Q.Q4_K: 0.1, Q.Q5_K: 0.05, Q.Q6_K: 0.025}[qtype], error


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_values_that_are_not_finite_are_refused(bad):
    values = torch.zeros(2, 256)
    values[1, 9] = bad
    with pytest.raises(NotQuantizable, match="NaN or infinite"):
        quantize(values, Q.Q4_K)


@pytest.mark.parametrize("qtype", K_TYPES, ids=lambda q: q.name)
def test_values_beyond_float16_are_refused(qtype):
    """As the legacy types refuse them (far beyond, ggml writes all-zero Q6_K blocks and NaN scales elsewhere)."""
    values = torch.randn(2, 256, generator=torch.Generator().manual_seed(1))
    values[1, 3] = 65520.0  # rounds to float16's infinity
    with pytest.raises(NotQuantizable, match="beyond float16"):
        quantize(values, qtype)


@pytest.mark.parametrize("qtype", K_TYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("field", [0x7C00, 0xFE00], ids=["inf", "nan"])
def test_blocks_with_scales_float16_cannot_hold_are_refused(qtype, field):
    for at in BY_TYPE[qtype].scale_fields:
        blocks = np.zeros((3, gguf.GGML_QUANT_SIZES[qtype][1]), np.uint8)
        gguf_types.check_scales(qtype, blocks)
        blocks[2, at : at + 2] = np.array([field], "<u2").view(np.uint8)
        with pytest.raises(NotQuantizable, match="scales are beyond float16"):
            gguf_types.check_scales(qtype, blocks)


def test_other_types_and_partial_blocks_are_refused():
    with pytest.raises(UnsupportedFormatError, match="not IQ4_XS"):
        quantize(torch.zeros(1, 256), Q.IQ4_XS)
    with pytest.raises(ValueError, match="whole Q6_K blocks"):
        quantize(torch.zeros(1, 384), Q.Q6_K)


def test_work_the_plain_path_would_take_minutes_on_is_refused_at_once(quantizer_path):
    """The plain port quantizes 30-40 ms a block: one FLUX.2 [dev] weight would take it 20 minutes, the model weeks.
    Without numba a tensor or a conversion (its GGUF layout) like that is refused before any of it is quantized or
    written, saying what to install; with numba it goes ahead."""
    shape = (3072, 3072)
    layout = {"w": (Q.Q4_K, shape, BY_TYPE[Q.Q4_K].nbytes(shape))}
    if quantizer_path == "numba":
        gguf_types.check_pace([(Q.Q4_K, shape)])
        gguf_file(io.BytesIO(), [], layout)
        return
    with time_bound(5):
        with pytest.raises(UnsupportedFormatError, match=r"about 22 minutes for these 36864 blocks.*pip install numba"):
            quantize(torch.zeros(shape), Q.Q4_K)
        written = io.BytesIO()
        with pytest.raises(UnsupportedFormatError, match="numba cannot be imported"):
            gguf_file(written, [], layout)
    assert written.getvalue() == b""
