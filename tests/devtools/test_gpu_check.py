"""The GPU check without a GPU: its command says so in one line and exits 0, its steps refuse in one sentence,
and the steps' own code (what the GPU runs, timed by the clock instead) runs on the CPU at small sizes, through
the real host, and makes a report."""

from __future__ import annotations

import json
import os
import subprocess

import pytest
import torch

from comfyui_flux2dev.loaders.models.variants import TEST_MODELS_ENV
from helpers import PACK, run_devtools

PEERS = PACK.parent / "shared" / "peers"  # ComfyUI-GGUF beside CI and the clone; a user's clone has none
FORMATS = 12 + 2  # the GGUF types the pack dequantizes, fp8 and NVFP4


def _has_gpu() -> bool:
    try:
        return subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout.startswith("GPU")
    except OSError:
        return False


@pytest.mark.skipif(_has_gpu(), reason="this machine has a GPU: the command would run the whole check")
def test_without_a_gpu_the_command_says_so_in_one_line_and_exits_0():
    out = PACK / "gpu-check-out"
    was_there = out.exists()
    done = subprocess.run(["bash", str(PACK / "devtools" / "gpu-check")], capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stderr) == (0, "")
    assert done.stdout.count("\n") == 1 and done.stdout.startswith("gpu-check: no NVIDIA GPU here")
    assert out.exists() == was_there  # nothing set up, nothing written


@pytest.mark.skipif(torch.cuda.is_available(), reason="torch sees a GPU here")
def test_without_cuda_a_step_refuses_in_one_sentence(tmp_path):
    done = run_devtools("gpu-check", "measure", "--out", tmp_path, "--peers", tmp_path)
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "torch sees no CUDA GPU here" in done.stderr


@pytest.mark.one_host  # the GPU check runs on the host `bash tests/run devtools` sets up
def test_the_steps_run_on_the_cpu_and_make_a_report(comfy_server, comfy_host, tmp_path, monkeypatch):
    from comfyui_flux2dev.devtools import gpu_check

    monkeypatch.setenv(TEST_MODELS_ENV, os.environ[TEST_MODELS_ENV])  # measure() declares the benchmark encoder anew
    measured = gpu_check.measure(torch.device("cpu"), quick=True, peers=PEERS)
    dequant = measured["dequant"]["rows"]
    assert len(dequant) == FORMATS and all(r["exact"] for r in dequant)
    assert all(r["pack_gbps"] > 0 and r["copy_gbps"] > 0 for r in dequant)
    linear = measured["linear"]["rows"]
    assert len(linear) == FORMATS and all(r["pack_s"] > 0 and r["dense_s"] > 0 for r in linear)
    if PEERS.is_dir():  # ComfyUI-GGUF reads every GGUF type the pack does
        assert measured["peer"] \
            and all((r["peer_gbps"] is None) == (r["format"] in ("fp8-scaled", "nvfp4")) for r in dequant)
        assert all((r["peer_s"] is None) == (r["format"] in ("fp8-scaled", "nvfp4")) for r in linear)
    else:
        assert measured["peer"] is None and str(PEERS) in measured["no_peer"]
    encoder = measured["encoder"]["rows"]
    assert [r["format"] for r in encoder] == ["bf16", "fp8", "gguf-Q4_K"]
    assert all(r["finite"] and r["tokens"] == 512 and r["device"] == "cpu" for r in encoder)

    sampled = gpu_check.sample(comfy_server, quick=True)
    assert sampled["images_nonblank"] and not sampled["dynamic_vram"]
    parts = {p["part"]: p for p in sampled["patchers"]}
    assert parts.keys() == {"MODEL", "CLIP"} and all(p["device"] == "cpu" for p in parts.values())
    assert parts["MODEL"]["patcher"].startswith("Packed") and parts["CLIP"]["patcher"].startswith("Packed")
    if sampled["device_nodes"]:  # 0.33: on a CPU host, "default" and "cpu" are the same device
        assert sampled["default_vs_cpu_max_diff"] == 0 and not sampled["device_node_warnings"]

    (tmp_path / "measure.json").write_text(json.dumps(measured))
    (tmp_path / "sample-here.json").write_text(json.dumps(sampled))
    (tmp_path / "tests-here.xml").write_text(
        '<testsuites><testsuite tests="3" failures="1" errors="0" skipped="1"><testcase classname="t" name="ok"/>'
        '<testcase classname="t" name="bad"><failure message="assert 1 == 2">...</failure></testcase>'
        '<testcase classname="t" name="later"><skipped/></testcase></testsuite></testsuites>'
    )
    report = gpu_check.format_report(tmp_path)
    assert "here: 1 passed, 1 failed, 1 skipped" in report and "FAILED t::bad: assert 1 == 2" in report
    assert all(f"\n{r['format']} " in report for r in dequant) and "Triton candidates" in report
    assert "Packed Linear forward" in report and "gguf-Q4_K" in report and "Sampling through ComfyUI" in report
