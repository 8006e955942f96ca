"""The table of GGUF types (gguf_types.TYPES) against the kernel tables beside the kernels: each holds exactly the
kernels the rows name, and each row's scale fields are where gguf-py's dequantizer reads its scales."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from comfyui_flux2dev.loaders.formats import compiled, gguf_dequant, gguf_quant, kquant_kernels
from comfyui_flux2dev.loaders.formats.gguf_types import TYPES


def _named(flag) -> set[str]:
    return {row.qtype.name for row in TYPES if flag(row)}


def test_every_kernel_table_holds_the_kernels_the_rows_name():
    one_pass = compiled._kernels()
    assert {q.name for q in gguf_dequant._KERNELS} == _named(lambda row: not row.float_dtype)
    assert {q.name for q in gguf_dequant.FLOAT_TYPES} == _named(lambda row: row.float_dtype)
    assert set(one_pass.GGUF) == _named(lambda row: row.one_pass_read)
    assert {q.name for q in gguf_quant._KERNELS} == _named(lambda row: row.writer == "gguf-py")
    assert set(one_pass.QUANTIZE) == _named(lambda row: row.one_pass_write)
    assert set(kquant_kernels.KERNELS) == _named(lambda row: row.writer == "ggml")
    assert not _named(lambda row: row.one_pass_write and row.writer != "gguf-py")


@pytest.mark.parametrize("row", [row for row in TYPES if not row.float_dtype], ids=lambda row: row.qtype.name)
def test_the_scale_fields_are_where_gguf_py_reads_the_scales(row):
    """Random blocks with every scale field 0 decode to zeros, and with them 1.0 to values not all zero."""
    block_size, type_size = gguf.GGML_QUANT_SIZES[row.qtype]
    blocks = np.random.default_rng(int(row.qtype)).integers(0, 256, (64, type_size), dtype=np.uint8)
    for scale, nonzero in ((0.0, False), (1.0, True)):
        for at in row.scale_fields:
            blocks[:, at : at + 2] = np.full((len(blocks), 1), scale, np.float16).view(np.uint8)
        values = gguf.quants.dequantize(blocks, row.qtype)
        assert values.shape == (64, block_size) and bool(values.any()) == nonzero
