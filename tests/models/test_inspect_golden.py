"""`flux2dev inspect --json` on every tiny fixture gives what it gave when tests/data/inspect_golden.json was
recorded (paths relative to the tiny root), so reshaping the loaders cannot change what a user is told."""

from __future__ import annotations

import json

import pytest

from comfyui_flux2dev import cli
from helpers import DATA

GOLDEN = json.loads((DATA / "inspect_golden.json").read_text())


def test_the_golden_file_covers_every_tiny_fixture(tiny_manifest):
    assert {e["path"] for e in tiny_manifest} == set(GOLDEN)


@pytest.mark.parametrize("path", sorted(GOLDEN))
def test_inspect_json_is_unchanged(tiny_root, capsys, path):
    assert cli.main(["inspect", str(tiny_root / path), "--json"]) == 0
    out = capsys.readouterr().out.replace(f"{tiny_root}/", "")
    assert json.loads(out) == GOLDEN[path]
