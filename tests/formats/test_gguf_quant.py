"""The quantizer against gguf-py's numpy reference (gguf.quants.quantize): the same bytes for every type the pack
writes, on random weights of several sizes and on the blocks where the arithmetic has its edges (ties of
magnitude, signed zeros, exact halves, constant and all-zero blocks, values near float16's limits). Every test
runs on both paths: numba's one-pass kernels and the torch kernels that stand in where numba cannot run."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from comfyui_flux2dev.errors import UnsupportedFormatError
from comfyui_flux2dev.loaders.formats import kernels
from comfyui_flux2dev.loaders.formats.gguf_row import NotQuantizable
from comfyui_flux2dev.loaders.formats.gguf_types import BY_TYPE, LEGACY_TYPES, WRITE_TYPES, quantize
from helpers import quantizer_paths

quantizer_path = quantizer_paths("torch", autouse=True)


@pytest.mark.parametrize("qtype", [q for q in LEGACY_TYPES if q != Q.F32], ids=lambda q: q.name)
def test_the_one_pass_kernels_run_for_float32_bfloat16_and_other_float_values(quantizer_path, qtype):
    """float32 and bfloat16 values as they are, others converted to float32 a chunk at a time."""
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    out = torch.empty(4, type_size, dtype=torch.uint8)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert kernels.quantize(BY_TYPE[qtype], torch.ones(4, block_size, dtype=dtype), out) \
            is (True if quantizer_path == "numba" else None)


def test_a_kernel_whose_conversion_is_unlike_torch_leaves_its_type_to_the_torch_path(quantizer_path, monkeypatch):
    """BF16 writes with the kernels' bfloat16 cast, the others with their fp16 cast: where one disagrees with
    torch's on this machine (kernels._converts, here made to), the types that need it take the torch path."""
    monkeypatch.setattr(kernels, "_converts", lambda dtype: dtype != torch.bfloat16)
    values = torch.randn(4, 64)
    assert kernels.quantize(BY_TYPE[Q.BF16], values.view(-1, 1), torch.empty(256, 2, dtype=torch.uint8)) is None
    assert kernels.quantize(BY_TYPE[Q.F16], values.view(-1, 1), torch.empty(256, 2, dtype=torch.uint8)) \
        is (True if quantizer_path == "numba" else None)
    want = gguf.quants.quantize(values.numpy(), Q.BF16).view(np.uint8)
    assert np.array_equal(quantize(values, Q.BF16).numpy(), want.reshape(4, 128))


def test_the_writer_table_holds_the_types_convert_offers():
    """The writer's table is the GGUF types convert's --type choices write (loaders.convert.presets.written_types(),
    which the docs list, a test in tests/pack checks; the K presets' types) and F32, which small tensors stay in."""
    from comfyui_flux2dev.loaders.convert.presets import K_PRESETS, written_types

    used = {*(t for t in written_types() if t not in K_PRESETS), *(t for pair in K_PRESETS.values() for t in pair)}
    assert sorted(q.name for q in WRITE_TYPES) == sorted({*used, "F32"})
    with pytest.raises(UnsupportedFormatError, match="not IQ4_NL"):
        quantize(torch.zeros(1, 256), Q.IQ4_NL)


SIGNED_ZEROS = np.zeros(32, dtype=np.float32)
SIGNED_ZEROS[::3] = -0.0
MIN_MAX_TYPES = (Q.Q4_1, Q.Q5_1)


def _edge_blocks(qtype) -> np.ndarray:
    """Blocks of 32 where the reference's arithmetic has its edges."""
    rows = []
    rows.append(np.zeros(32))  # all zero: d is 0, the inverse is 0
    if qtype not in MIN_MAX_TYPES:  # +0 and -0: the first of the largest magnitude gives d its sign
        rows.append(SIGNED_ZEROS)
        rows.append(-SIGNED_ZEROS)
    tie = np.linspace(-0.5, 0.5, 32)  # +m and -m: the first one wins
    rows.append(tie)
    rows.append(tie[::-1].copy())
    rows.append(np.full(32, 0.25))  # constant: Q4_1's d is 0
    halves = np.arange(32) - 15.5  # Q8_0 with amax 127 scales by 1: every value is a tie of round-half-away
    halves[0] = 127.0
    rows.append(halves)
    rows.append(-halves)
    just_below = np.full(32, np.float32(0.5) - np.float32(2**-25))  # a sum with 0.5 would round up to 1
    just_below[0] = 127.0
    rows.append(just_below)
    big = np.linspace(-60000, 65504, 32)  # float16's largest finite value
    rows.append(big)
    tiny = np.full(32, 1e-42)  # float32 subnormals: d's inverse overflows, and d is 0 in float16
    tiny[5] = -3e-41
    rows.append(tiny)
    rows.append(np.full(32, 1e-40))
    return np.array(rows, dtype=np.float32)


def quantization_cases(qtype):
    rng = np.random.default_rng(7)
    yield "normal", (rng.standard_normal((64, 4096)) * 0.02).astype(np.float32)
    yield "wide-range", (rng.standard_normal((3, 5, 256)) * np.exp(rng.uniform(-20, 8, (3, 5, 1)))).astype(np.float32)
    # bfloat16 weights (what most sources are): few mantissa bits, so ties of magnitude are common
    yield "bf16-valued", torch.from_numpy(rng.standard_normal((257, 96)).astype(np.float32)).bfloat16().float().numpy()
    yield "edges", _edge_blocks(qtype)
    # every side of float16's and bfloat16's rounding ties and range limits (subnormals too), as far as they fit
    edges = kernels._edge_values()
    edges = edges[np.isfinite(edges) & (np.abs(edges) <= 65504)]
    yield "conversion-edges", np.resize(edges, (-(-edges.size // 32), 32))
    yield "many-chunks", rng.standard_normal((kernels.CHUNK_VALUES["cpu"] // 512 * 3 + 7, 512)).astype(np.float32)


@pytest.mark.parametrize("qtype", LEGACY_TYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_bytes_equal_the_reference(qtype, dtype, monkeypatch):
    """float32 values, and the same values rounded to bfloat16 (what most sources hold), read as they are."""
    monkeypatch.setitem(kernels.CHUNK_VALUES, "cpu", 1 << 18)  # many-chunks: three chunks and a part, in a test's time
    for name, values in quantization_cases(qtype):
        if dtype == torch.bfloat16:  # 65504 rounds up to 65536: the largest bfloat16 float16 holds is 65280
            values = np.clip(values, -65280, 65280)
        tensor = torch.from_numpy(values).to(dtype)
        want = gguf.quants.quantize(tensor.float().numpy(), qtype)
        got = quantize(tensor, qtype).numpy()
        want = want.view(np.uint8).reshape(got.shape)
        bad = np.flatnonzero((got != want).any(axis=1))
        assert bad.size == 0, \
            f"{name}: {bad.size} rows differ, first {bad[0]}: {got[bad[0]][:40]} != {want[bad[0]][:40]}"


@pytest.mark.parametrize("qtype", MIN_MAX_TYPES, ids=lambda q: q.name)
def test_a_zero_minimum_or_maximum_is_written_positive(qtype):
    """numpy's vectorised min and max give a block of +0 and -0 either sign, by lane order; the pack writes +0
    (the decoded values are 0 either way), and the codes are the reference's."""
    for values in (SIGNED_ZEROS, -SIGNED_ZEROS, np.full(32, -0.0, dtype=np.float32)):
        want = gguf.quants.quantize(values[None], qtype).view(np.uint8)[0]
        got = quantize(torch.from_numpy(values[None].copy()), qtype).numpy()[0]
        assert list(got[:4]) == [0, 0, 0, 0] and np.array_equal(got[4:], want[4:])


@pytest.mark.parametrize("qtype", LEGACY_TYPES, ids=lambda q: q.name)
def test_low_precision_input_and_an_out_buffer(qtype):
    """bfloat16 values are widened exactly; `out` receives the same bytes as a new tensor."""
    values = torch.randn(40, 128).bfloat16()
    want = gguf.quants.quantize(values.float().numpy(), qtype).view(np.uint8)
    out = torch.full((40, BY_TYPE[qtype].row_bytes(128)), 0xAB, dtype=torch.uint8)
    assert quantize(values, qtype, out=out) is out
    assert np.array_equal(out.numpy(), want.reshape(out.shape))


@pytest.mark.parametrize("qtype", LEGACY_TYPES, ids=lambda q: q.name)
def test_an_out_buffer_of_another_shape_is_refused_untouched(qtype):
    row = BY_TYPE[qtype].row_bytes(128)
    for shape in ((39, row), (40, row - 2), (41, row)):
        out = torch.full(shape, 0xAB, dtype=torch.uint8)
        with pytest.raises(ValueError, match="out must be"):
            quantize(torch.randn(40, 128), qtype, out=out)
        assert bool((out == 0xAB).all())


# The kernels find a block's range on the values' bits (integer order keys), where NaN of either sign and the
# infinities must still stand out, in float32 weights and in bfloat16 ones.
@pytest.mark.parametrize("qtype", LEGACY_TYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("bits", [0x7FC00000, 0xFFC00000, 0x7F800000, 0xFF800000], ids=["nan", "-nan", "inf", "-inf"])
def test_values_that_are_not_finite_are_refused(qtype, dtype, bits):
    values = torch.zeros(2, 64, dtype=dtype)
    if dtype == torch.bfloat16:  # by its bits: torch's assignment of a float drops a NaN's sign
        values.view(torch.int16)[1, 7] = int(np.array(bits >> 16, np.uint16).view(np.int16))
    else:
        values.view(torch.int32)[1, 7] = int(np.array(bits, np.uint32).view(np.int32))
    with pytest.raises(NotQuantizable, match="NaN or infinite"):
        quantize(values, qtype)


@pytest.mark.parametrize("qtype", LEGACY_TYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_values_beyond_float16_are_refused_where_a_float16_field_holds_them(qtype, dtype):
    values = torch.zeros(1, 64, dtype=dtype)
    values[0, 3] = -70000.0
    if not BY_TYPE[qtype].limited:  # the rows' word for them, which must agree with the kernels
        quantize(values, qtype)
        return
    with pytest.raises(NotQuantizable, match="beyond float16"):
        quantize(values, qtype)


def test_rows_that_hold_no_whole_block_are_refused():
    with pytest.raises(ValueError, match="whole Q8_0 blocks of 32"):
        quantize(torch.zeros(2, 48), Q.Q8_0)
    assert not BY_TYPE[Q.Q4_0].fits((5, 48)) and BY_TYPE[Q.Q4_0].fits((5, 64)) and BY_TYPE[Q.F16].fits((3,))


@pytest.mark.parametrize("qtype", LEGACY_TYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_runs_of_blocks_on_several_threads_and_a_bad_value_in_the_last_block(qtype, dtype, monkeypatch):
    """The kernels take runs of rows, on several threads where there are cores for them, and widen bfloat16 blocks
    a run at a time: the same bytes as gguf-py across runs, and a value that does not fit found in the last block."""
    values = torch.randn(37, 32 * 300, generator=torch.Generator().manual_seed(3)).to(dtype)
    want = gguf.quants.quantize(values.float().numpy(), qtype).view(np.uint8).reshape(37, -1)
    monkeypatch.setattr(kernels, "cpu_threads", lambda: 3)
    assert np.array_equal(quantize(values, qtype).numpy(), want)
    values[-1, -1] = float("inf")
    with pytest.raises(NotQuantizable, match="NaN or infinite"):
        quantize(values, qtype)
