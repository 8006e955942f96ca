"""The pack's safetensors reader: exact tensors, and a clear error for every damaged header."""

import json
import os
import struct

import pytest
import torch
from safetensors.torch import load_file, save_file

from comfyui_flux2dev.errors import CorruptFileError
from comfyui_flux2dev.loaders.formats.safetensors_file import SafetensorsFiles


def test_tensors_read_back_exactly_as_safetensors_reads_them(tmp_path):
    g = torch.Generator().manual_seed(0)
    tensors = {
        "bf16": torch.randn(3, 5, generator=g).to(torch.bfloat16),
        "fp8": torch.randn(4, 4, generator=g).to(torch.float8_e4m3fn),
        "u8": torch.randint(0, 255, (7,), dtype=torch.uint8),
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 4),
    }
    path = tmp_path / "t.safetensors"
    save_file(tensors, path)
    files = SafetensorsFiles([str(path)])
    for name, want in load_file(path).items():
        got = files.read(name)
        assert got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)) if got.dim() else torch.equal(got, want)


def _file(tmp_path, header, data=b"\0" * 16):
    raw = json.dumps(header).encode()
    path = tmp_path / "bad.safetensors"
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return str(path)


@pytest.mark.parametrize("header", [
    [1, 2, 3],
    {"t": {"dtype": "F32", "shape": [2]}},
    {"t": {"dtype": "F32", "shape": [2], "data_offsets": [0]}},
    {"t": {"dtype": "F32", "shape": "2", "data_offsets": [0, 8]}},
    {"t": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}},
    {"t": {"dtype": "F32", "shape": [2], "data_offsets": [8, 0]}},
    {"t": {"dtype": "F32", "shape": [2], "data_offsets": [0, 64]}},
    {"t": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}},
], ids=["not-an-object", "no-offsets", "one-offset", "shape-not-a-list", "negative-dim", "reversed", "past-the-end",
        "size-mismatch"])
def test_a_damaged_header_is_a_corrupt_file_error(tmp_path, header):
    with pytest.raises(CorruptFileError):
        SafetensorsFiles([_file(tmp_path, header)])


def test_a_truncated_file_is_a_corrupt_file_error(tmp_path):
    path = tmp_path / "t.safetensors"
    save_file({"a": torch.ones(64)}, path)
    data = path.read_bytes()
    for cut in (4, 20, len(data) - 1):
        (tmp_path / "cut.safetensors").write_bytes(data[:cut])
        with pytest.raises(CorruptFileError):
            SafetensorsFiles([str(tmp_path / "cut.safetensors")])


def test_a_file_cut_after_its_header_fails_at_the_tensor(tmp_path):
    path = tmp_path / "t.safetensors"
    save_file({"a": torch.ones(64), "b": torch.ones(4096)}, path)
    files = SafetensorsFiles([str(path)])
    os.truncate(path, path.stat().st_size - 8)
    assert torch.equal(files.view("a"), torch.ones(64))
    with pytest.raises(CorruptFileError, match="ended inside a tensor"):
        files.view("b")
