"""Mutation fuzzing of every parser and loader entry point (devtools/fuzz/) in its quick mode: each target
first runs its seed files unchanged (they must load), then 300 mutated inputs of seed 0 and the regression
corpus (harness.REGRESSIONS), each of which must end
normally or in the pack's own error, in bounded time and memory. Each target runs in a process of its own
(`python -m comfyui_flux2dev.devtools fuzz`), as a developer runs it; failing inputs are written under the
test's tmp_path. The harness itself is tested first: a planted escape, hang and blowup must be reported."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from comfyui_flux2dev.devtools.fuzz import files, harness, targets
from comfyui_flux2dev.errors import CorruptFileError

PLANTED = {0: ("exception", "KeyError"), 1: ("hang", "-"), 2: ("memory", "-"), 3: ("leak", "CorruptFileError")}


def _planted_bug(data: bytes) -> int:
    return hashlib.sha256(data).digest()[0] % 8  # a key of PLANTED, or no bug


def _planted(path: Path) -> None:
    """An entry point with one bug of each kind (PLANTED), each on about an eighth of the inputs."""
    bug = _planted_bug(path.read_bytes())
    if bug == 0:
        raise KeyError("dtype")
    if bug == 1:
        time.sleep(60)  # blocked without using CPU, as when a FIFO is opened
    if bug == 2:
        assert len(b"x" * (900 << 20))  # a blowup far past the input's size
    if bug == 3:
        raise CorruptFileError(f"header length {harness.LEAKS[1]} is too large")  # quotes the canary's first bytes
    raise CorruptFileError("not this time")


def test_harness_reports_each_kind_of_failure(tmp_path):
    tree = targets.Tree("planted", {"x.json": files.JsonDoc({"a": [1, "b"]})}, "x.json", ("x.json",), _planted)
    report = harness.fuzz_target("planted", [tree], inputs=40, seed=3, out=tmp_path, jobs=2, log=lambda line: None)
    found = {f["index"]: (f["kind"], f["type"]) for f in report.failures}
    expected = {}
    for index in range(-1, 40):
        case = harness.make_case("planted", [tree], 3, index)
        if case.spec is not None:
            bug = _planted_bug(case.spec.bytes())
            if bug in PLANTED:
                expected[index] = PLANTED[bug]
        elif index in found:
            expected[index] = found[index]  # a folder or FIFO in place of the file: the entry point above fails too
    assert len(set(expected.values())) == len(PLANTED)
    assert found == expected, report.summary()
    assert all(Path(f["saved"]).exists() for f in report.failures if f["saved"])
    assert report.inputs == 40


def test_the_regression_corpus_runs_with_seed_0(tmp_path, monkeypatch):
    tree = targets.Tree("planted", {"x.json": files.JsonDoc({"a": [1, "b"]})}, "x.json", ("x.json",), _planted)
    escapes = [i for i in range(10, 200)
               if (case := harness.make_case("planted", [tree], 0, i)).spec is not None
               and _planted_bug(case.spec.bytes()) == 0]
    monkeypatch.setattr(harness, "REGRESSIONS", {"planted": (escapes[0],)})
    report = harness.fuzz_target("planted", [tree], inputs=5, seed=0, out=tmp_path, jobs=1, log=lambda line: None)
    assert report.inputs == 6 and escapes[0] in {f["index"] for f in report.failures}
    report = harness.fuzz_target("planted", [tree], inputs=5, seed=1, out=tmp_path, jobs=1, log=lambda line: None)
    assert report.inputs == 5


def test_inputs_are_reproducible():
    tree = targets.Tree("t", {"x.json": files.JsonDoc({"config": {"n": 1000}, "vocab": [{"rank": 0}]})}, "x.json",
                     ("x.json",), _planted)
    first = [harness.make_case("t", [tree], 5, i) for i in range(50)]
    again = [harness.make_case("t", [tree], 5, i) for i in range(50)]
    assert [(c.notes, c.spec) for c in first] == [(c.notes, c.spec) for c in again]
    assert len({c.spec for c in first}) > 40  # and they differ from one another


@pytest.mark.parametrize("target", sorted(targets.TARGETS))
def test_fuzz_quick(target, tiny_root, tmp_path):
    inputs, report_file = tmp_path / "inputs", tmp_path / "report.json"
    run = subprocess.run(
        [sys.executable, "-P", "-m", "comfyui_flux2dev.devtools", "fuzz", "--target", target,
         "--fixtures", str(tiny_root), "--inputs", str(harness.QUICK_INPUTS), "--out", str(inputs),
         "--json", str(report_file)],
        capture_output=True, text=True, timeout=1200,
    )
    assert report_file.is_file(), f"the fuzz harness did not finish:\n{run.stdout[-4000:]}\n{run.stderr[-4000:]}"
    (report,) = json.loads(report_file.read_text())
    assert report["inputs"] == harness.QUICK_INPUTS + sum(i >= harness.QUICK_INPUTS
                                                         for i in harness.REGRESSIONS.get(target, ()))
    summary = run.stdout[run.stdout.rfind(f"{target}: "):]
    assert not report["failures"], f"inputs written under {inputs}:\n{summary[-6000:]}"
