"""`flux2dev bench --real` at reduced depth: its own code on the benchmark encoder (Mistral-Small's real width,
3 GB in fp8, its embedding table in bf16), encoded by the pack in a process of its own. Whatever the file's size, an
encode costs the process about one layer of its own memory: the weights stay mapped from the file, which costs one
open file whatever its tensors number. The file is written here rather than converted from bf16 (a minute of CI); a
conversion's memory is the quick bench's row."""

from __future__ import annotations

import dataclasses
import math
import shutil

import pytest

from comfyui_flux2dev.devtools.bench import real_size, real_transformer
from comfyui_flux2dev.devtools.bench.encode_scenarios import encoder_tensors, write_encoder
from comfyui_flux2dev.devtools.bench.real_size import bench_real_encoder, format_real
from comfyui_flux2dev.devtools.tiny.geometry import BENCH_MISTRAL, BENCH_TRANSFORMER
from comfyui_flux2dev.loaders.models.transformer_layout import bfl_tensor_shapes

# The most files an encode or a forward holds open: the interpreter's own (about 5) and one per model file. A map per
# tensor held 46 (the encoder) and 32 (the transformer) at this depth, and 424 at real size.
OPEN_FILES = 16


@pytest.fixture
def folder(tmp_path):
    """The bench's folder, removed at once: its 3 GB would outlive the test in pytest's kept folders."""
    yield tmp_path / "real"
    shutil.rmtree(tmp_path / "real", ignore_errors=True)


@pytest.mark.one_host  # the pack's reading and memory, the same on every release (test_mapped_weights runs on each)
def test_an_encode_costs_one_layer_of_own_memory_whatever_the_file(comfy_host, folder):
    folder.mkdir()
    write_encoder(str(folder / real_size._name("fp8")), BENCH_MISTRAL, 3, "fp8")
    result = bench_real_encoder(str(folder), BENCH_MISTRAL, formats=("fp8",), paddings=("comfy",), peers=False)
    tensors = encoder_tensors(BENCH_MISTRAL, 1, "bf16")
    layer = sum(d.itemsize * math.prod(s) for name, (d, s, _) in tensors.items() if ".layers.0." in name)
    assert result["files"]["fp8"] > 2.5 * layer  # holding it would show
    rows = {row["format"]: row for row in result["rows"]}
    assert set(rows) == {"fp8"} and not list(folder.glob("*bf16*"))
    for fmt, row in rows.items():
        assert "result" in row, row.get("stderr") or row
        grown = row["peak_anon_bytes"] - row["result"]["anon_before_bytes"]
        assert 0 < grown < layer, (fmt, grown, layer)
        assert row["peak_mapped_bytes"] > result["files"][fmt] / 2, "the weights were read from the map"
        assert row["peak_open_files"] < OPEN_FILES, row["peak_open_files"]
        # measured against the machine's limits in the same run (the figures are the docs', not a timed bar)
        roof, rates = row["roofline"], result["rates"]
        assert rates["matmul_flops"] > 0 and rates["cache_bytes_s"] > 0 and rates["disk_bytes_s"] > 0
        assert roof["flops"] > 0 and 0 < roof["weight_bytes"] < result["files"][fmt]
        assert roof["roofline_s"] == max(roof["flops"] / rates["matmul_flops"],
                                         roof["weight_bytes"] / rates["cache_bytes_s"])
        assert roof["ratio"] == row["result"]["encode_s"] / roof["roofline_s"]
        assert row["started_from"] == roof["read_from"] == "page cache"  # the encode started as its roofline reads
    assert "| pack encode, fp8, comfy padding |" in format_real(result)


ONE_BLOCK_EACH = dataclasses.replace(real_transformer.FULL, double_blocks=BENCH_TRANSFORMER.double_blocks,
                                     single_blocks=BENCH_TRANSFORMER.single_blocks)


@pytest.mark.one_host
def test_a_transformer_forward_costs_one_layer_of_own_memory(comfy_host, folder):
    """The transformer half at the real width with one block of each kind, as Q4_K_M (2.5 GB, most of it the bf16
    modulation and embedders): the pack's load keeps the weights mapped, bf16 ones too, and a forward holds about one
    weight dequantized to float32 of its own. The fp8 file and the peers' rows run in the real bench only (a minute
    more of CI); test_mapped_weights checks that an fp8 transformer's weights stay mapped."""
    result = real_transformer.bench_real_transformer(str(folder), anon_limit=8 << 30, margin=1 << 30,
                                                     geometry=ONE_BLOCK_EACH, formats=("Q4_K_M",), peers=False)
    largest = max(4 * math.prod(s) for s in bfl_tensor_shapes(ONE_BLOCK_EACH, real_transformer.DEV).values())
    [row] = result["rows"]
    assert row["loader"] == "pack" and "result" in row, row.get("stderr") or row
    assert row["result"]["finite"]
    loaded = row["result"]["anon_loaded_bytes"] - row["result"]["anon_before_bytes"]
    assert loaded < 256 << 20, loaded  # a float32 copy of the bf16 weights would be 3.2 GB
    grown = row["peak_anon_bytes"] - row["result"]["anon_before_bytes"]
    assert 0 < grown < largest + (512 << 20), (grown, largest)  # the scratch and activations, no copy
    assert row["peak_mapped_bytes"] > result["files"]["Q4_K_M"] / 2, "the weights were read from the map"
    assert row["peak_open_files"] < OPEN_FILES, row["peak_open_files"]
    assert not list(folder.glob("*.partial*"))
    assert "| pack, Q4_K_M |" in real_size.format_transformer(result)
