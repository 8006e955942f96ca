"""`flux2dev convert` as a user runs it, and what it does to the user's files: progress on stderr, one line on
stdout; nothing at OUT's name is replaced without --force and nothing is ever written through a link there; the
files beside OUT are left alone; a read-only or full folder ends in one sentence and no file under OUT's name;
and every source the loaders refuse is refused the same way, before anything is written."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from helpers import TESTS, restricted, run_flux2dev

# The bad-input matrix and what each loader says of each case (tests/pack), shared rather than copied.
sys.path.append(str(TESTS / "pack"))
from bad_files import build_all, outcome  # noqa: E402
from test_bad_inputs import EXPECTED  # noqa: E402

ENCODER = "text_encoders/mistral_3_small_flux2_bf16.safetensors"
TRANSFORMER = "diffusion_models/flux2-dev-tiny.safetensors"


def _snapshot(folder: Path) -> dict[str, tuple]:
    """What is in a folder: each name with its kind, bytes and times (links: where they point)."""
    out = {}
    for p in sorted(folder.iterdir()):
        s = os.lstat(p)
        out[p.name] = (os.readlink(p),) if p.is_symlink() else (s.st_mode, s.st_size, s.st_mtime_ns, p.read_bytes())
    return out


def test_convert_shows_progress_and_says_what_it_wrote(tiny_root, tmp_path):
    done = run_flux2dev("convert", "encoder", tiny_root / ENCODER, tmp_path / "enc.safetensors", "--dtype", "fp8")
    assert done.returncode == 0, done.stderr
    assert "writing the encoder, weights: 271/271" in done.stderr
    assert done.stdout.startswith(f"wrote {tmp_path / 'enc.safetensors'}: 483 tensors (210 fp8 layers)")
    done = run_flux2dev("convert", "transformer", tiny_root / TRANSFORMER, tmp_path / "t.gguf", "--type", "Q5_1")
    assert done.returncode == 0, done.stderr
    assert "writing the transformer, tensors: 43/43" in done.stderr
    assert done.stdout.startswith(f"wrote {tmp_path / 't.gguf'}: 43 tensors (12 F32, 20 Q5_1, 11 BF16)")


def test_what_is_at_out_and_beside_it_is_left_alone_and_force_replaces_only_the_name(tiny_root, tmp_path):
    out = tmp_path / "model.gguf"
    out.write_bytes(b"the user's own file")
    (tmp_path / "notes.txt").write_text("the user's notes")
    victim = tmp_path / "victim.bin"
    victim.write_bytes(b"what a link points to")
    (tmp_path / "link.gguf").symlink_to(victim)
    before = _snapshot(tmp_path)
    for name in ("model.gguf", "link.gguf"):
        done = run_flux2dev("convert", "transformer", tiny_root / TRANSFORMER, tmp_path / name, "--type", "Q8_0")
        assert done.returncode == 2 and "already exists and was left as it is" in done.stderr \
            and "--force" in done.stderr, done.stderr
        assert done.stderr.count("\n") == 1
    assert _snapshot(tmp_path) == before
    done = run_flux2dev("convert", "transformer", tiny_root / TRANSFORMER, tmp_path / "link.gguf", "--type", "Q8_0",
                        "--force")
    assert done.returncode == 0, done.stderr
    after = _snapshot(tmp_path)
    assert not (tmp_path / "link.gguf").is_symlink() and (tmp_path / "link.gguf").read_bytes()[:4] == b"GGUF"
    assert {k: v for k, v in after.items() if k != "link.gguf"} == {k: v for k, v in before.items() if k != "link.gguf"}


CONVERT_SCRIPT = """
import os, sys
from comfyui_flux2dev.cli import main
status = main(["convert", "encoder", {source!r}, {out!r}])
print(sorted(os.listdir({folder!r})))
sys.exit(status)
"""


LONG_NAME = "e" * 238 + ".safetensors"  # 250 bytes: its temporary names are cut to fit


@pytest.mark.parametrize("how, room, error, name", [("read-only", 0, "Read-only file system", LONG_NAME),
                                                    ("full", 1 << 20, "No space left on device", "enc.safetensors")])
def test_a_folder_that_cannot_take_the_file_gets_none_under_its_name(tiny_root, tmp_path, how, room, error, name):
    """Read-only: the temporary file cannot be made. Full: 1 MiB is left, the file needs 29, and the write fails
    midway; the partial file is removed and nothing shows under OUT's name."""
    folder = tmp_path / "out"
    folder.mkdir()
    (folder / "notes.txt").write_text("the user's notes")
    before = _snapshot(folder)
    script = CONVERT_SCRIPT.format(source=str(tiny_root / ENCODER), out=str(folder / name), folder=str(folder))
    done = restricted(script, folder, how, dict(os.environ), room=room)
    assert done.returncode == 2, done.stderr[-3000:]
    message = [line for line in done.stderr.splitlines() if line.startswith("flux2dev convert encoder: ")]
    assert len(message) == 1 and error in message[0] \
        and "nothing was written under its name" in message[0], done.stderr[-3000:]
    listed = eval(done.stdout.strip().splitlines()[-1])
    assert name not in listed and not [n for n in listed if n.endswith(".partial")], listed
    assert _snapshot(folder) == before


# --- bad sources: refused as the loaders refuse them ------------------------------------------------------------

CONVERTERS = {"encoder": "encoder", "transformer": "transformer"}  # the loader matrix target -> what converts it
CASES = [(case, target) for case, row in EXPECTED.items() for target in row if target in CONVERTERS]


@pytest.fixture(scope="module")
def bad(tmp_path_factory, tiny_root) -> dict[str, Path]:
    return build_all(tmp_path_factory.mktemp("bad"), tiny_root)


@pytest.mark.parametrize("case, target", CASES, ids=[f"{c}-{t}" for c, t in CASES])
def test_a_bad_source_is_refused_as_its_loader_refuses_it_and_nothing_is_written(bad, tmp_path, case, target):
    from comfyui_flux2dev.loaders.convert.encoder import convert_encoder
    from comfyui_flux2dev.loaders.convert.transformer import convert_transformer
    from comfyui_flux2dev.loaders.models.encoder import load_encoder
    from comfyui_flux2dev.loaders.models.transformer import load_transformer

    convert = {"encoder": lambda p: convert_encoder(str(p), str(tmp_path / "out.safetensors")),
               "transformer": lambda p: convert_transformer(str(p), str(tmp_path / "out.gguf"), qtype="Q4_0")}[target]
    load = {"encoder": lambda p: load_encoder(str(p)), "transformer": load_transformer}[target]
    expected, _ = outcome(load, bad[case])
    error, _ = outcome(convert, bad[case])
    assert expected is not None and (type(error), str(error)) == (type(expected), str(expected))
    assert os.listdir(tmp_path) == []
