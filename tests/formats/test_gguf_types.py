"""The table of GGUF types (gguf_types.TYPES) against the kernel tables beside the kernels: each holds exactly the
kernels the rows name, and each row's scale fields are where gguf-py's dequantizer reads its scales."""

from __future__ import annotations

import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest

from comfyui_flux2dev.loaders.formats import compiled, gguf_dequant, gguf_quant, kquant_kernels
from comfyui_flux2dev.loaders.formats.gguf_types import TYPES
from helpers import gguf_bytes, gguf_tensor_info, run_python

PACK_ROOT = Path(__file__).resolve().parents[2]


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


# A type the pack does not read (gguf-py knows its blocks and has its numpy dequantizer), as a new row would add it
_NEW_ROW = "    GGUFType(Q.TQ2_0, (64,)),\n"


def test_a_new_row_is_all_the_lists_the_reader_and_the_dequantizer_need(tmp_path):
    """A copy of the pack with one row appended to TYPES and no other file touched: every list derived from TYPES
    holds the type, the reader opens a file with it, dequantize gives gguf-py's values (by its numpy code until the
    type's torch steps are added), and what the kernel tables lack is exactly that kernel, which
    test_every_kernel_table_holds_the_kernels_the_rows_name would name."""
    copy = tmp_path / "copy" / "comfyui_flux2dev"
    for part in ("__init__.py", "errors.py", "loaders"):
        if (PACK_ROOT / part).is_dir():
            shutil.copytree(PACK_ROOT / part, copy / part, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            copy.mkdir(parents=True, exist_ok=True)
            shutil.copy2(PACK_ROOT / part, copy / part)
    table = copy / "loaders" / "formats" / "gguf_types.py"
    source = table.read_text()
    assert source.count("\n)\nBY_TYPE = ") == 1, "TYPES no longer ends as this test expects"
    table.write_text(source.replace("\n)\nBY_TYPE = ", "\n" + _NEW_ROW + ")\nBY_TYPE = "))

    blocks = np.random.default_rng(0).integers(0, 256, (2, 66), dtype=np.uint8)
    blocks[:, 64:66] = np.full((2, 1), 0.5, np.float16).view(np.uint8)
    path = tmp_path / "new_type.gguf"
    path.write_bytes(gguf_bytes((), [gguf_tensor_info("w", [256, 2], gguf.GGMLQuantizationType.TQ2_0, 0)],
                                blocks.tobytes()))
    done = run_python("""
        import sys
        import gguf, numpy as np, torch
        from gguf import GGMLQuantizationType as Q
        import comfyui_flux2dev
        assert comfyui_flux2dev.__file__.startswith(sys.argv[1]), comfyui_flux2dev.__file__
        from comfyui_flux2dev.loaders.formats import gguf_dequant, gguf_types
        from comfyui_flux2dev.loaders.formats.gguf_file import open_gguf

        assert gguf_types.BY_TYPE[Q.TQ2_0].scale_fields == (64,)
        assert gguf_types.READ_TYPES[-1] == gguf_types.QUANTIZED_TYPES[-1] == Q.TQ2_0
        assert Q.TQ2_0 not in (*gguf_types.FLOAT_TYPES, *gguf_types.WRITE_TYPES)
        assert gguf_dequant.read_types().endswith(", TQ2_0")  # as the errors list the types read
        with open_gguf(sys.argv[2]) as f:
            tensor = f.tensors["w"]
            assert tensor.qtype == Q.TQ2_0 and tensor.shape == (2, 256)
            got = gguf_dequant.dequantize(tensor.data, tensor.qtype, tensor.shape, torch.float32)
            assert np.array_equal(got.numpy(), gguf.quants.dequantize(tensor.data.numpy().reshape(2, 66), Q.TQ2_0))
        rows = {row.qtype.name for row in gguf_types.TYPES if not row.float_dtype}
        print(sorted(rows - {q.name for q in gguf_dequant._KERNELS}))
    """, copy.parent, path, env={"PYTHONPATH": str(copy.parent)}, timeout=120)
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.split() == ["['TQ2_0']"]
