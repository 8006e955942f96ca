"""`flux2dev inspect --json` on every tiny fixture gives what it gave when tests/data/inspect_golden.json was
recorded (paths relative to the tiny root), so reshaping the loaders cannot change what a user is told; and the
same with a file's suffix in capitals, which the writers take as well."""

from __future__ import annotations

import json
import os
from pathlib import Path

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


@pytest.mark.parametrize("path", ["unet/flux2-dev-tiny-Q8_0.gguf", "text_encoders/mistral3-q4_0.gguf",
                                  "diffusion_models/flux2-dev-tiny.safetensors", "vae/flux2-ae.safetensors"])
def test_a_suffix_in_capitals_gives_the_same_report(tiny_root, tmp_path, capsys, path):
    capitals = tmp_path / (Path(path).stem + Path(path).suffix.upper())
    os.link(tiny_root / path, capitals)
    assert cli.main(["inspect", str(capitals), "--json"]) == 0, capsys.readouterr().err
    assert json.loads(capsys.readouterr().out) == GOLDEN[path]
