"""`flux2dev bench --quick` end to end: every documented figure is there and sane. No timing assertions
(shared machines make timings noisy); what must hold whatever the load is checked: bit-exact
dequantization, one header parse per GGUF load, finite positive ratios."""

from __future__ import annotations

import math

import pytest

from comfyui_flux2dev.devtools import bench
from comfyui_flux2dev.loaders.gguf_dequant import QUANTIZED_TYPES


@pytest.fixture(scope="module")
def results():
    return bench.run_all(quick=True)


def _positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def test_documented_keys(results):
    assert set(results) == {"machine", "dequant", "header", "tokenizer", "encoder_load", "load"}
    assert {"cpu_count", "torch_threads", "torch_version", "platform", "date"} <= set(results["machine"])
    assert {"first_s", "second_s", "rung"} <= set(results["tokenizer"])
    assert {"file_bytes", "peak_rss_bytes", "seconds", "header_parses", "synthetic_read"} <= set(results["load"])


def test_dequant_rows_are_exact_for_every_type(results):
    rows = results["dequant"]
    assert [r["type"] for r in rows] == [q.name for q in QUANTIZED_TYPES]
    for r in rows:
        assert r["exact"] is True, r["type"]
        for key in ("pack_gbps", "pack_reused_gbps", "reference_gbps", "copy_gbps"):
            assert _positive(r[key]), (r["type"], key)


def test_tokenizer_is_resolved_from_tekken_json_and_cached(results):
    t = results["tokenizer"]
    assert t["rung"] == "tekken-json"
    assert t["same_tokenizer"] is True
    assert _positive(t["first_s"]) and _positive(t["second_s"])


def test_encoder_load_keeps_30_of_40_layers(results):
    e = results["encoder_load"]
    assert (e["layers_in_file"], e["layers_kept"]) == (40, 30)
    assert 0 < e["kept_bytes"] < e["file_bytes"]
    assert 0 < e["read_bytes"] <= e["file_bytes"] + 2**20  # the cache was evicted: the load reads the disk
    for key in ("rss_per_kept_byte", "read_per_kept_byte", "rss_after_use_per_kept_byte"):
        assert _positive(e[key]), key


def test_gguf_loads_parse_each_header_once(results):
    for name, r in (("transformer", results["load"]), ("synthetic", results["load"]["synthetic_read"])):
        assert r["header_parses"] == 1, name
        assert _positive(r["file_bytes"]) and _positive(r["read_bytes"]), name
        assert r["peak_rss_bytes"] >= 0 and r["seconds"] > 0, name
    synthetic = results["load"]["synthetic_read"]
    assert synthetic["largest_dequantized_bytes"] == 2 * 3072 * 3072


def test_header_and_report(results):
    h = results["header"]
    assert _positive(h["pack_s"]) and _positive(h["reference_s"])
    report = bench.format_report(results)
    for line in ("Dequantization", "geometric mean", "tokenizer", "encoder load", "GGUF transformer load", "synthetic GGUF"):
        assert line in report
    assert "NO" not in report.split()
