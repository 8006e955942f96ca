"""The torch dequantizer against gguf's numpy reference: bit-equal float32 for every type it implements,
on data quantized by gguf itself where gguf can quantize, and on random raw blocks otherwise."""

from __future__ import annotations

import logging

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from comfyui_flux2dev.devtools.tiny.gguf_blocks import random_blocks
from comfyui_flux2dev.errors import CorruptFileError, UnsupportedFormatError
from comfyui_flux2dev.loaders.formats import gguf_types, kernels
from comfyui_flux2dev.loaders.formats.gguf_types import READ_TYPES, dequantize
from helpers import GGUF_FLOAT_TYPES, GGUF_QUANTIZED_TYPES

# Types gguf-py can quantize: their test data is real quantizer output rather than random blocks.
QUANTIZABLE = {Q.F32, Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0}
SHAPES = [(1, 256), (3, 512), (5, 7, 1024)]


def _quantized(qtype: Q, shape: tuple[int, ...], seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if qtype in QUANTIZABLE:
        values = (rng.standard_normal(shape) * rng.uniform(0.01, 10)).astype(np.float32)
        values[..., :3] = (0.0, -1e-9, 3e4)  # zero, a tiny value and a large one in the first block
        return gguf.quants.quantize(values, qtype).view(np.uint8).reshape(-1)
    return random_blocks(qtype, (int(np.prod(shape)),), rng)


def _reference(raw: np.ndarray, qtype: Q, shape: tuple[int, ...]) -> np.ndarray:
    rows = raw.reshape(int(np.prod(shape[:-1])), -1)
    return gguf.quants.dequantize(rows, qtype).reshape(shape)


def _assert_bits_equal(got: torch.Tensor, want: np.ndarray) -> None:
    got = got.cpu()
    assert tuple(got.shape) == want.shape
    if got.dtype == torch.bfloat16:  # numpy has no bfloat16: compare the bits through int16
        got_bits = got.view(torch.int16).numpy()
        want_bits = torch.from_numpy(want).to(torch.bfloat16).view(torch.int16).numpy()
    else:
        got_bits = got.numpy().view(f"u{got.element_size()}")
        want_bits = want.view(f"u{want.itemsize}")
    mismatched = np.flatnonzero(got_bits.reshape(-1) != want_bits.reshape(-1))
    assert mismatched.size == 0, f"{mismatched.size} values differ, first at flat index {mismatched[0]}"


def test_the_kernel_table_holds_the_listed_types_and_no_others():
    """The types the pack's kernels dequantize are the ones it lists (docs/dequantization.md, helpers.py), each one gguf
    knows: a kernel added must be listed, and one dropped fails the tests below."""
    assert [q.name for q in READ_TYPES] == [*GGUF_FLOAT_TYPES, *GGUF_QUANTIZED_TYPES]
    assert all(n in Q.__members__ for n in GGUF_FLOAT_TYPES + GGUF_QUANTIZED_TYPES)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("qtype", [Q[n] for n in GGUF_FLOAT_TYPES + GGUF_QUANTIZED_TYPES], ids=lambda q: q.name)
def test_exact_against_gguf_numpy(qtype, shape, device):
    raw = _quantized(qtype, shape, seed=sum(shape) + int(qtype))
    want = _reference(raw, qtype, shape)
    data = torch.from_numpy(raw).to(device)
    got = dequantize(data, qtype, shape, dtype=torch.float32)
    assert got.device == data.device
    _assert_bits_equal(got, want)
    with np.errstate(over="ignore"):  # large K-quant values overflow fp16 the same way on both sides
        _assert_bits_equal(dequantize(data, qtype, shape), want.astype(np.float16))
    _assert_bits_equal(dequantize(data, qtype, shape, dtype=torch.bfloat16), want)


@pytest.mark.parametrize("qtype", [Q[n] for n in GGUF_QUANTIZED_TYPES], ids=lambda q: q.name)
def test_chunk_boundaries(qtype, monkeypatch, device):
    """Tensors spanning many chunks, the last one partial, give the same values as one pass."""
    block_size = gguf.GGML_QUANT_SIZES[qtype][0]
    monkeypatch.setitem(kernels.CHUNK_VALUES, device.type, 3 * block_size)
    shape = (10, 2 * 256)
    raw = _quantized(qtype, shape, seed=7)
    got = dequantize(torch.from_numpy(raw).to(device), qtype, shape, dtype=torch.float32)
    _assert_bits_equal(got, _reference(raw, qtype, shape))


def test_unaligned_input(device):
    """Raw bytes that start at an odd address (a slice of a larger buffer) still decode exactly."""
    shape = (2, 256)
    raw = _quantized(Q.Q4_K, shape, seed=3)
    padded = torch.from_numpy(np.concatenate([np.zeros(1, np.uint8), raw])).to(device)
    _assert_bits_equal(dequantize(padded[1:], Q.Q4_K, shape, dtype=torch.float32), _reference(raw, Q.Q4_K, shape))


def _tq2_blocks(shape: tuple[int, ...]) -> np.ndarray:
    """Random TQ2_0 blocks (a type with no torch kernel) with a finite trailing fp16 scale."""
    block_size, type_size = gguf.GGML_QUANT_SIZES[Q.TQ2_0]
    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, size=(int(np.prod(shape)) // block_size, type_size), dtype=np.uint8)
    blocks[:, -2:] = np.array([0.5], np.float16).view(np.uint8)
    return blocks.reshape(-1)


def test_fallback_to_numpy_warns(caplog, device):
    """A type without a torch kernel goes through gguf's numpy code (on the CPU), with a warning saying so; the
    values land on the device the bytes came from."""
    shape = (2, 256)
    raw = _tq2_blocks(shape)
    gguf_types._warned.discard(Q.TQ2_0)
    with caplog.at_level(logging.WARNING, logger=gguf_types.__name__):
        got = dequantize(torch.from_numpy(raw).to(device), Q.TQ2_0, shape, dtype=torch.float32)
    assert got.device.type == device.type
    _assert_bits_equal(got, _reference(raw, Q.TQ2_0, shape))
    assert "TQ2_0" in caplog.text


def test_type_nobody_can_dequantize():
    with pytest.raises(UnsupportedFormatError, match="I32"):
        dequantize(torch.zeros(16, dtype=torch.uint8), Q.I32, (4,))


def test_size_mismatch_is_corrupt():
    with pytest.raises(CorruptFileError, match="Q8_0"):
        dequantize(torch.zeros(33, dtype=torch.uint8), Q.Q8_0, (32,))
    with pytest.raises(CorruptFileError, match="Q4_K"):
        dequantize(torch.zeros(144, dtype=torch.uint8), Q.Q4_K, (100,))
