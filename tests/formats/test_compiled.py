"""The one-pass CPU dequantizers (numba) against the torch path they sit in front of and against gguf's numpy
reference, on blocks whose scale fields take the edge values (zeros, subnormals, the largest finite values,
infinities, NaNs) and whose codes take their smallest and largest values; and the torch path taking over
where numba cannot run (forced here by making it impossible to import), saying so.

Equal means the same bits, except that any NaN equals any NaN: torch's own CPU cast writes different NaN
bits in its vectorized and its scalar loop, so NaN payloads are no contract of either path."""

from __future__ import annotations

import json
import logging

import gguf
import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q

from comfyui_flux2dev.devtools.tiny.encoders import swizzle_block_scales
from comfyui_flux2dev.devtools.tiny.gguf_blocks import FP16_FIELDS
from comfyui_flux2dev.errors import CorruptFileError
from comfyui_flux2dev.loaders.formats import gguf_legacy, kernels, packed_dequant
from comfyui_flux2dev.loaders.formats.gguf_types import BY_TYPE, dequantize
from helpers import GGUF_QUANTIZED_TYPES, numba_unavailable, run_python
from test_gguf_quant import quantization_cases

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# fp16 bit patterns: +-0, the smallest and largest subnormals, the smallest normal, 1, the largest finite
# values, +-inf, quiet, signalling and negative NaNs
EDGE_HALVES = (0x0000, 0x8000, 0x0001, 0x03FF, 0x0400, 0x3C00, 0x7BFF, 0xFBFF, 0x7C00, 0xFC00, 0x7E00, 0x7C01, 0xFE00)
CODE_BYTES = (0x00, 0xFF, 0x0F, 0xF0, 0x55, 0xAA)  # smallest and largest codes in every field, and mixes
def _same(got: torch.Tensor, want: torch.Tensor) -> None:
    """The same bits, NaN for NaN."""
    assert got.shape == want.shape and got.dtype == want.dtype
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan), f"NaN at {int((torch.isnan(got) != nan).sum())} other places"
    bits = {4: torch.int32, 2: torch.int16}[got.element_size()]
    differ = (got.view(bits) != want.view(bits)) & ~nan
    assert not differ.any(), \
        f"{int(differ.sum())} values differ, first at flat index {int(differ.view(-1).nonzero()[0])}"


def _edge_blocks(qtype: Q, seed: int) -> np.ndarray:
    """Rows of blocks: each fp16 field cycles through EDGE_HALVES (fields of one block shifted against each
    other, so every pairing of d and dmin edges occurs), the other bytes are all one of CODE_BYTES or random."""
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    n = len(EDGE_HALVES) * (len(CODE_BYTES) + 1) * 2
    blocks = rng.integers(0, 256, size=(n, type_size), dtype=np.uint8)
    for i in range(n):
        pattern = i // len(EDGE_HALVES) % (len(CODE_BYTES) + 1)
        if pattern < len(CODE_BYTES):
            blocks[i] = CODE_BYTES[pattern]
    for f, offset in enumerate(FP16_FIELDS[qtype]):
        halves = np.array([EDGE_HALVES[(i + 5 * f) % len(EDGE_HALVES)] for i in range(n)], np.uint16)
        blocks[:, offset : offset + 2] = halves.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(-1, 2 * type_size)  # two blocks a row


def test_numba_runs_here():
    """The tests' environment has numba: a broken install fails here rather than leaving the fallback tested twice."""
    for dtype in DTYPES.values():
        assert kernels.path("cpu", dtype) == "numba"
    assert kernels.path("meta", torch.float16) == "torch"  # GPUs and other devices keep the torch path
    assert kernels.path("cpu", torch.float64) == "torch"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("qtype", [Q[n] for n in GGUF_QUANTIZED_TYPES], ids=lambda q: q.name)
def test_gguf_equals_torch_path_and_numpy_on_edge_values(qtype, dtype):
    raw = _edge_blocks(qtype, seed=int(qtype))
    shape = (raw.shape[0], 2 * GGML_QUANT_SIZES[qtype][0])
    data = torch.from_numpy(raw)
    with np.errstate(all="ignore"):
        want = torch.from_numpy(gguf.quants.dequantize(raw, qtype).reshape(shape)).to(DTYPES[dtype])
    got = dequantize(data, qtype, shape, DTYPES[dtype])
    with numba_unavailable():
        by_torch = dequantize(data, qtype, shape, DTYPES[dtype])
    _same(got, want)
    _same(by_torch, want)
    assert torch.isnan(want).any() and torch.isinf(want).any()  # the edges are in there


def _fp8_cases(fp8: torch.dtype, per_row: bool):
    """Every fp8 byte in every row; scales (one, or one per row) at their edges."""
    codes = torch.arange(256, dtype=torch.uint8).repeat(8, 1).view(fp8)
    scales = torch.tensor([1.0, 0.37, 0.0, -2.5, 1e-40, 3e38, float("inf"), float("nan")])
    return codes, scales.reshape(-1, 1) if per_row else scales[1:2]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("per_row", (False, True), ids=("per-tensor", "per-row"))
@pytest.mark.parametrize("fp8", (torch.float8_e4m3fn, torch.float8_e5m2), ids=str)
def test_fp8_equals_torch_path(fp8, per_row, dtype):
    weight, scale = _fp8_cases(fp8, per_row)
    want = (weight.float() * scale).to(DTYPES[dtype])  # float32 value times float32 scale, then the cast
    got = packed_dequant.dequantize_fp8(weight, scale, DTYPES[dtype])
    with numba_unavailable():
        by_torch = packed_dequant.dequantize_fp8(weight, scale, DTYPES[dtype])
    _same(got, want)
    _same(by_torch, want)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tensor_scale", (0.01, 448.0, float("inf"), float("nan")))
def test_nvfp4_equals_torch_path(tensor_scale, dtype):
    """Every packed byte and every fp8 block-scale byte (NaN ones included), over rows and blocks that need
    padded 128x4 tiles."""
    rows, cols = 130, 16 * 36
    g = torch.Generator().manual_seed(4)
    packed = torch.randint(0, 256, (rows, cols // 2), dtype=torch.uint8, generator=g)
    packed[0, :256] = torch.arange(256, dtype=torch.uint8)  # every pair of codes
    block_scales = torch.arange(rows * cols // 16).remainder(256).to(torch.uint8).view(torch.float8_e4m3fn)
    block_scales = block_scales.reshape(rows, cols // 16)
    tiled = swizzle_block_scales(block_scales)
    scale2 = torch.tensor(tensor_scale)
    got = packed_dequant.dequantize_nvfp4(packed, tiled, scale2, DTYPES[dtype])
    with numba_unavailable():
        by_torch = packed_dequant.dequantize_nvfp4(packed, tiled, scale2, DTYPES[dtype])
    e2m1 = torch.tensor(packed_dequant._E2M1)
    values = torch.stack((e2m1[packed.long() >> 4], e2m1[packed.long() & 15]), dim=-1).reshape(rows, cols)
    want = (values.reshape(rows, -1, 16) * (block_scales.float() * scale2).unsqueeze(-1)).reshape(rows, cols)
    _same(got, want.to(DTYPES[dtype]))
    _same(by_torch, want.to(DTYPES[dtype]))


def test_without_numba_the_torch_path_runs_and_says_so(caplog, monkeypatch):
    """The fallback, forced: the path named is torch, one warning says why, and the values are gguf's, also when
    the torch path steps through many chunks."""
    qtype, shape = Q.Q4_K, (10, 512)
    raw = _edge_blocks(qtype, seed=1)[:10]
    monkeypatch.setitem(kernels.CHUNK_VALUES, "cpu", 3 * 256)
    with np.errstate(all="ignore"):
        want = torch.from_numpy(gguf.quants.dequantize(raw, qtype).reshape(shape))
    with numba_unavailable(), caplog.at_level(logging.WARNING, logger=kernels.__name__):
        assert kernels.path("cpu", torch.float16) == "torch"
        _same(dequantize(torch.from_numpy(raw), qtype, shape, torch.float32), want)
        _same(dequantize(torch.from_numpy(raw), qtype, shape, torch.float16), want.half())
    assert caplog.text.count("need numba") == 1
    assert kernels.path("cpu", torch.float16) == "numba"  # back once numba can be imported


@pytest.mark.parametrize("dtype", ("float16", "bfloat16"))
def test_the_kernels_cast_as_torch_does(dtype):
    """The kernels' conversion of float32 to the output dtype against torch's cast, on every sign and exponent
    with random mantissas and with mantissas at, below and above every rounding tie."""
    high = torch.arange(1 << 9, dtype=torch.int64) << 23
    mantissas = torch.randint(0, 1 << 23, (64,), generator=torch.Generator().manual_seed(0))
    ties = torch.tensor([(1 << (n - 1)) | odd << n for n in range(13, 24) for odd in (0, 1)])
    low = torch.cat([mantissas, ties - 1, ties, ties + 1]) & 0x7FFFFF
    values = (high[:, None] | low[None, :]).reshape(-1).to(torch.int32).view(torch.float32)
    got = torch.empty(values.shape, dtype=DTYPES[dtype])
    kernels.numba_ops().convert(values.numpy(), got.view(kernels.VIEWS[got.dtype]).numpy())
    _same(got, values.to(DTYPES[dtype]))


def test_without_the_cpus_fp16_instruction_the_kernels_convert_by_ops():
    """Where numba compiles for a CPU without a float32-to-fp16 instruction (here: told to compile for a
    generic x86-64), the kernels convert with integer and float32 ops, and still equal torch and gguf."""
    done = run_python(
        """
        import gguf, numpy as np, torch
        from gguf import GGMLQuantizationType as Q
        from comfyui_flux2dev.devtools.tiny.gguf_blocks import random_blocks
        from comfyui_flux2dev.loaders.formats import kernels
        from comfyui_flux2dev.loaders.formats.gguf_types import dequantize

        assert not kernels.numba_ops().HARDWARE_FP16 and kernels.path("cpu", torch.float16) == "numba"
        raw = random_blocks(Q.Q6_K, (64, 1024), np.random.default_rng(0))
        with np.errstate(all="ignore"):
            want = gguf.quants.dequantize(raw, Q.Q6_K).astype(np.float16)
        got = dequantize(torch.from_numpy(raw), Q.Q6_K, (64, 1024), torch.float16)
        assert np.array_equal(got.numpy().view(np.uint16), want.view(np.uint16))
        print("converted by ops")
        """,
        env={"NUMBA_CPU_NAME": "generic"},
    )
    assert done.returncode == 0 and "converted by ops" in done.stdout, done.stderr[-3000:]


def test_a_conversion_unlike_torch_keeps_the_torch_path(caplog, monkeypatch):
    """The once-per-process check of the kernels' fp16 cast: where it disagrees with torch's (here: made to),
    fp16 stays on the torch path, with a warning, and other dtypes keep the kernels."""
    kernels._converts.cache_clear()
    monkeypatch.setattr(kernels.numba_ops(), "convert", lambda values, out: out.fill(0))
    try:
        with caplog.at_level(logging.WARNING, logger=kernels.__name__):
            assert kernels.path("cpu", torch.float16) == "torch"
        assert "unlike torch" in caplog.text
        assert kernels.path("cpu", torch.float32) == "numba"
    finally:
        kernels._converts.cache_clear()


def test_several_threads_give_the_same_bits(monkeypatch):
    """On machines with more cores the kernels run on half of them, each on runs of rows: the same values as one
    thread, for rows that do not divide evenly and NVFP4 runs that start inside a scale tile."""
    qtype, shape = Q.Q5_K, (37, 512)
    raw = torch.from_numpy(_edge_blocks(qtype, seed=2)[:37])
    weight, scale = _fp8_cases(torch.float8_e4m3fn, per_row=True)
    packed = torch.randint(0, 256, (133, 64), dtype=torch.uint8, generator=torch.Generator().manual_seed(5))
    tiled = swizzle_block_scales(
        torch.rand(133, 8, generator=torch.Generator().manual_seed(6)).to(torch.float8_e4m3fn))

    def everything():
        return (dequantize(raw, qtype, shape, torch.float16),
                packed_dequant.dequantize_fp8(weight, scale, torch.bfloat16),
                packed_dequant.dequantize_nvfp4(packed, tiled, torch.tensor(0.5), torch.float32))

    monkeypatch.setattr(kernels, "cpu_threads", lambda: 1)
    one = everything()
    monkeypatch.setattr(kernels, "cpu_threads", lambda: 3)
    for got, want in zip(everything(), one):
        _same(got, want)


@pytest.mark.parametrize("name", ("Q8_0", "Q5_1", "Q5_0", "Q4_1", "Q4_0"))
def test_the_vector_quantizers_equal_their_plain_loops(name):
    """The hand-written vector code (numba_ops.py) against the same kernel with the plain loops it replaces
    (gguf_legacy's block ops), on the quantizer tests' weights and edge blocks, and on blocks it refuses (its
    answer)."""
    code = BY_TYPE[Q[name]].write_kernel
    vector, loops = kernels.compiled(code), kernels.compiled(code, vector=False)
    refused = np.full((3, 32), 0.5, np.float32)
    refused[0, 3], refused[1, 7], refused[2, 31] = np.nan, -np.inf, 70000.0
    cases = [*((case, values) for case, values in quantization_cases(Q[name]) if case != "many-chunks"),
             *(("refused", refused[i : i + 1]) for i in range(3))]
    for case, values in cases:
        blocks = np.ascontiguousarray(values.reshape(-1, 32), dtype=np.float32)
        got = np.zeros((len(blocks), GGML_QUANT_SIZES[Q[name]][1]), np.uint8)
        want = got.copy()
        fits = vector(blocks, got)
        assert fits == loops(blocks, want), case
        assert not fits or np.array_equal(got, want), case
    assert {row.name for row in gguf_legacy.ROWS if row.write_kernel} == {"Q8_0", "Q5_1", "Q5_0", "Q4_1", "Q4_0"}


def test_sizes_are_checked_before_any_kernel_reads():
    """The kernels do not check indexes, so a damaged file's sizes are refused first, as errors for the user."""
    packed = torch.zeros(128, 32, dtype=torch.uint8)
    scales = torch.zeros(128 * 4 - 1, dtype=torch.uint8).view(torch.float8_e4m3fn)
    with pytest.raises(CorruptFileError, match="block scales"):
        packed_dequant.dequantize_nvfp4(packed, scales, torch.tensor(1.0), torch.float16)
    with pytest.raises(CorruptFileError, match="scales"):
        packed_dequant.dequantize_fp8(torch.zeros(4, 8).to(torch.float8_e4m3fn), torch.ones(3), torch.float16)


_EVERY_KERNEL_ONCE = """
    import json, torch
    from comfyui_flux2dev.loaders.formats import kernels, packed_dequant
    from comfyui_flux2dev.loaders.formats.gguf_types import TYPES, dequantize, quantize
    for row in TYPES:
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            if row.read_kernel:
                dequantize(torch.zeros(2, row.block_bytes, dtype=torch.uint8), row, (2 * row.block_values,), dtype)
        for dtype in (torch.float32, torch.bfloat16):
            if row.write_kernel and row.writer == "gguf-py":
                quantize(torch.ones(2, 64, dtype=dtype), row)
    packed_dequant.dequantize_fp8(torch.zeros(4, 8).to(torch.float8_e4m3fn), torch.ones(1), torch.float16)
    ops = kernels.numba_ops()
    used = {"convert": ops.convert, "widen_bf16": ops.widen_bf16, "fp8": kernels._entry(packed_dequant._fp8_rows)}
    used |= {f"quantize {row.name}": kernels._entry(row.write_kernel) for row in TYPES
             if row.write_kernel and row.writer == "gguf-py"}
    used |= {f"dequantize {row.name}": kernels._entry(row.read_kernel) for row in TYPES if row.read_kernel}
    print(json.dumps({k: [sum(v.stats.cache_hits.values()), sum(v.stats.cache_misses.values())]
                      for k, v in used.items()}))
"""


def test_the_kernels_machine_code_is_loaded_from_the_cache_by_the_next_process():
    """numba compiles a kernel once per machine and keeps it beside the module; a kernel whose cache key changes
    from one process to the next (a closure over an object numba pickles differently each time) would compile
    again in every process and add files to the pack's folder at every start."""
    first = run_python(_EVERY_KERNEL_ONCE)
    assert first.returncode == 0, first.stderr[-3000:]
    second = run_python(_EVERY_KERNEL_ONCE)
    assert second.returncode == 0, second.stderr[-3000:]
    counts = json.loads(second.stdout.strip().splitlines()[-1])
    assert counts["quantize Q5_0"][0] > 0 and counts["widen_bf16"][0] > 0 and counts["dequantize Q4_K"][0] > 0
    assert {name: misses for name, (hits, misses) in counts.items() if misses} == {}
