"""The table of GGUF types (gguf_types.TYPES, the families' rows): each row's block is gguf's, its scale fields are
where gguf-py's dequantizer reads its scales, and a new type is one row written in one module: the reader, the
dequantizer, the quantizer, every derived list and `flux2dev convert` take it, with no other file touched."""

from __future__ import annotations

import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest

from comfyui_flux2dev.loaders.formats.gguf_types import TYPES
from helpers import gguf_bytes, gguf_tensor_info, run_python

PACK_ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("row", TYPES, ids=lambda row: row.name)
def test_each_row_is_its_types_block_with_its_functions(row):
    assert (row.block_values, row.block_bytes) == gguf.GGML_QUANT_SIZES[row.qtype]
    if row.float_dtype:
        assert row.read is None and row.read_kernel is None and not row.scale_fields
    else:
        assert row.read is not None and row.read_kernel is not None and row.scale_fields
    assert bool(row.writer) == bool(row.write_kernel or row.write_torch)


@pytest.mark.parametrize("row", [row for row in TYPES if not row.float_dtype], ids=lambda row: row.name)
def test_the_scale_fields_are_where_gguf_py_reads_the_scales(row):
    """Random blocks with every scale field 0 decode to zeros, and with them 1.0 to values not all zero."""
    block_size, type_size = gguf.GGML_QUANT_SIZES[row.qtype]
    blocks = np.random.default_rng(int(row.qtype)).integers(0, 256, (64, type_size), dtype=np.uint8)
    for scale, nonzero in ((0.0, False), (1.0, True)):
        for at in row.scale_fields:
            blocks[:, at : at + 2] = np.full((len(blocks), 1), scale, np.float16).view(np.uint8)
        values = gguf.quants.dequantize(blocks, row.qtype)
        assert values.shape == (64, block_size) and bool(values.any()) == nonzero


# A type the pack does not read (gguf-py knows its blocks, and reads and writes them in numpy), as a new row would add
# it to a family's module: its torch steps, and gguf-py's own quantizer as its writer
_NEW_FUNCTIONS = '''

from .gguf_row import CRUMBS


def _tq2_0_d(b):
    return (f16_field(b, 64),)


def _tq2_0_codes(b):
    return as_bytes(unpack(b[:, :64], 2, CRUMBS, 3)).sub_(1).view(torch.int8)


def _tq2_0_write(b, s):
    from gguf.quants import quantize

    return [torch.from_numpy(quantize(b.numpy(), Q.TQ2_0))]


ROWS = (
'''
_NEW_ROW = '''    GGUFType(Q.TQ2_0, 256, 66, (64,), read=ReadSteps(_tq2_0_d, _tq2_0_codes, times_d), writer="gguf-py",
             write_torch=_tq2_0_write),
)
'''

_CHILD = """
    import os, sys
    import gguf, numpy as np, torch
    from gguf import GGMLQuantizationType as Q
    from safetensors.torch import save_file
    import comfyui_flux2dev
    assert comfyui_flux2dev.__file__.startswith(sys.argv[1]), comfyui_flux2dev.__file__
    from comfyui_flux2dev.devtools.tiny.geometry import TINY_VARIANTS, test_models_env
    from comfyui_flux2dev.devtools.tiny.transformers import make_transformer
    from comfyui_flux2dev.loaders.convert.presets import written_types
    from comfyui_flux2dev.loaders.convert.transformer import convert_transformer
    from comfyui_flux2dev.loaders.formats import gguf_types
    from comfyui_flux2dev.loaders.formats.gguf_file import open_gguf
    from comfyui_flux2dev.loaders.models.gguf_transformer import load_gguf_transformer
    from comfyui_flux2dev.loaders.models.transformer import diffusers_to_bfl

    # the derived lists: the table's, the error's list of types read, convert's --type
    assert Q.TQ2_0 in gguf_types.READ_TYPES and Q.TQ2_0 in gguf_types.QUANTIZED_TYPES
    assert Q.TQ2_0 in gguf_types.WRITE_TYPES and Q.TQ2_0 not in gguf_types.FLOAT_TYPES
    assert "TQ2_0" in gguf_types.read_types().split(", ") and "TQ2_0" in written_types()
    # the reader and the dequantizer: its torch steps, not gguf-py's numpy stand-in (which warns)
    with open_gguf(sys.argv[2]) as f:
        tensor = f.tensors["w"]
        assert tensor.qtype == Q.TQ2_0 and tensor.shape == (2, 256)
        got = gguf_types.dequantize(tensor.data, tensor.qtype, tensor.shape, torch.float32)
        assert np.array_equal(got.numpy(), gguf.quants.dequantize(tensor.data.numpy().reshape(2, 66), Q.TQ2_0))
    assert not gguf_types._warned
    # the quantizer
    values = torch.randn(4, 512, generator=torch.Generator().manual_seed(0))
    want = gguf.quants.quantize(values.numpy(), Q.TQ2_0).reshape(4, -1)
    assert np.array_equal(gguf_types.quantize(values, Q.TQ2_0).numpy(), want)
    # convert: a tiny transformer written as TQ2_0, and loaded back
    os.environ.update(test_models_env(sys.argv[3]))
    source, out = os.path.join(sys.argv[3], "tiny.safetensors"), os.path.join(sys.argv[3], "tiny-TQ2_0.gguf")
    model = make_transformer(TINY_VARIANTS[0]).bfloat16()
    save_file({k: v.contiguous() for k, v in diffusers_to_bfl(model.state_dict()).items()}, source)
    convert_transformer(source, out, qtype="TQ2_0")
    with open_gguf(out) as f:
        written = [t for t in f.tensors.values() if t.qtype == Q.TQ2_0]
    kept = load_gguf_transformer(out).state_dict
    assert written and sum(int(v) == int(Q.TQ2_0) for k, v in kept.items() if k.endswith(".weight_gguf_type")) \
        == len(written)
    print(len(written), "TQ2_0 tensors")
"""


def test_a_new_row_is_all_the_reader_the_dequantizer_the_quantizer_and_convert_need(tmp_path):
    """A copy of the pack with one row (and its functions) added to one family's module, no other file touched."""
    copy = tmp_path / "copy" / "comfyui_flux2dev"
    for part in ("__init__.py", "errors.py", "loaders", "devtools"):
        if (PACK_ROOT / part).is_dir():
            shutil.copytree(PACK_ROOT / part, copy / part, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            copy.mkdir(parents=True, exist_ok=True)
            shutil.copy2(PACK_ROOT / part, copy / part)
    family = copy / "loaders" / "formats" / "gguf_legacy.py"
    source = family.read_text()
    assert source.count("\nROWS = (\n") == 1 and source.endswith("\n)\n"), "ROWS no longer ends as this test expects"
    family.write_text(source.replace("\n\nROWS = (\n", _NEW_FUNCTIONS)[: -len(")\n")] + _NEW_ROW)

    blocks = np.random.default_rng(0).integers(0, 256, (2, 66), dtype=np.uint8)
    blocks[:, 64:66] = np.full((2, 1), 0.5, np.float16).view(np.uint8)
    path = tmp_path / "new_type.gguf"
    path.write_bytes(gguf_bytes((), [gguf_tensor_info("w", [256, 2], gguf.GGMLQuantizationType.TQ2_0, 0)],
                                blocks.tobytes()))
    work = tmp_path / "work"
    work.mkdir()
    done = run_python(_CHILD, copy.parent, path, work, env={"PYTHONPATH": str(copy.parent)}, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "TQ2_0 tensors" in done.stdout
