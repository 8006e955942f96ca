"""`flux2dev bench --real` at reduced depth: its own code on the benchmark encoder (Mistral-Small's real width,
3 layers, 4.7 GB in bf16), written, converted to fp8 and encoded by the pack, each step in a process of its own.
Whatever the file's size, an encode costs the process about one layer of its own memory: the weights stay mapped
from the file. A conversion holds one tensor at a time."""

from __future__ import annotations

import math
import shutil

import pytest

from comfyui_flux2dev.devtools.bench.encode_scenarios import encoder_tensors
from comfyui_flux2dev.devtools.bench.real_size import bench_real_encoder, format_real
from comfyui_flux2dev.devtools.tiny.geometry import BENCH_MISTRAL


@pytest.fixture
def folder(tmp_path):
    """The bench's folder, removed at once: its 7.7 GB would outlive the test in pytest's kept folders."""
    yield tmp_path / "real"
    shutil.rmtree(tmp_path / "real", ignore_errors=True)


def test_an_encode_costs_one_layer_of_own_memory_whatever_the_file(comfy_host, folder):
    result = bench_real_encoder(str(folder), BENCH_MISTRAL, formats=("bf16", "fp8"), paddings=("comfy",),
                                peers=False)
    tensors = encoder_tensors(BENCH_MISTRAL, 1, "bf16")
    layer = sum(d.itemsize * math.prod(s) for name, (d, s, _) in tensors.items() if ".layers.0." in name)
    assert result["files"]["bf16"] > 3 * layer and result["files"]["fp8"] > 1.5 * layer  # holding them would show
    rows = {row["format"]: row for row in result["rows"]}
    assert set(rows) == {"bf16", "fp8"}
    for fmt, row in rows.items():
        assert "result" in row, row.get("stderr") or row
        grown = row["peak_anon_bytes"] - row["result"]["anon_before_bytes"]
        assert 0 < grown < layer, (fmt, grown, layer)
        assert row["peak_mapped_bytes"] > result["files"][fmt] / 2, "the weights were read from the map"
    converted = result["conversions"]["fp8"]
    assert "result" in converted, converted.get("stderr")
    assert converted["peak_anon_bytes"] < result["files"]["bf16"] / 2
    assert "| pack encode, fp8, comfy padding |" in format_real(result)
