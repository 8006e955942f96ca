"""The streamed writers against independent readers: safetensors' own loader and gguf-py's GGUFReader read what
the pack writes, tensors written out of order and in pieces land where the header says, a tensor left unwritten
stops the file, and the same tensors give the same bytes. And the file they go through: a fresh temporary name,
published only when complete, never over what is at the name unless asked, never through a link."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import GGUFValueType as V

from comfyui_flux2dev.errors import OutputError
from comfyui_flux2dev.loaders.convert.output import check_output, output_file
from comfyui_flux2dev.loaders.convert.tensor_files import gguf_file, safetensors_file
from comfyui_flux2dev.loaders.formats.files import new_file
from comfyui_flux2dev.loaders.formats.gguf_file import open_gguf
from comfyui_flux2dev.loaders.formats.gguf_types import quantize, type_of
from comfyui_flux2dev.loaders.formats.safetensors_file import SafetensorsFiles

TENSORS = {
    "b.weight": torch.randn(6, 10, generator=torch.Generator().manual_seed(1)).bfloat16(),
    "a.scale": torch.tensor(0.25),
    "c.fp8": torch.randn(3, 5).to(torch.float8_e4m3fn),
    "d.bytes": torch.arange(7, dtype=torch.uint8),
    "e.f32": torch.randn(3),
}


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def _write_safetensors(path: Path, pieces: bool) -> None:
    with new_file(path) as f:
        file = safetensors_file(f, {k: (v.dtype, tuple(v.shape)) for k, v in TENSORS.items()}, {"note": "x"})
        for name in reversed(TENSORS):  # any order
            t = TENSORS[name]
            if pieces and t.dim() == 2:
                row = t[0].numel() * t.element_size()
                for i in reversed(range(t.shape[0])):
                    file.write(name, t[i], at=i * row)
            else:
                file.write(name, t)
        file.finish()


def test_safetensors_are_read_back_by_safetensors_and_the_pack(tmp_path):
    from safetensors import safe_open

    _write_safetensors(tmp_path / "a.safetensors", pieces=False)
    _write_safetensors(tmp_path / "b.safetensors", pieces=True)
    assert (tmp_path / "a.safetensors").read_bytes() == (tmp_path / "b.safetensors").read_bytes()
    with safe_open(str(tmp_path / "a.safetensors"), "pt") as f:
        assert f.metadata() == {"note": "x"} and set(f.keys()) == set(TENSORS)
        for name, t in TENSORS.items():
            got = f.get_tensor(name)
            assert got.dtype == t.dtype and torch.equal(_bytes(got), _bytes(t)), name
    pack = SafetensorsFiles([str(tmp_path / "a.safetensors")])
    for name, info in pack.infos.items():  # laid out so that every tensor starts at a multiple of its size
        assert (info.start - pack.infos[min(pack.infos, key=lambda n: pack.infos[n].start)].start) \
            % TENSORS[name].element_size() == 0
        assert torch.equal(_bytes(pack.read(name)), _bytes(TENSORS[name]))


def test_a_tensor_left_unwritten_stops_the_file(tmp_path):
    out = tmp_path / "x.safetensors"
    with pytest.raises(RuntimeError, match="not written in full"):
        with new_file(out) as f:
            file = safetensors_file(f, {"a": (torch.float32, (4,)), "b": (torch.float32, (2,))})
            file.write("a", torch.zeros(4))
            file.write("b", torch.zeros(1))
            file.finish()
    assert os.listdir(tmp_path) == []
    with new_file(out) as f:
        file = safetensors_file(f, {"a": (torch.float32, (4,))})
        with pytest.raises(ValueError, match="do not fit"):
            file.write("a", torch.zeros(5))


def test_gguf_is_read_back_by_gguf_and_the_pack(tmp_path):
    rng = np.random.default_rng(3)
    values = {"w.weight": rng.standard_normal((4, 64)).astype(np.float32),
              "n.scale": rng.standard_normal(5).astype(np.float32)}
    types = {"w.weight": Q.Q4_1, "n.scale": Q.F32}
    path = tmp_path / "x.gguf"
    metadata = [("general.architecture", V.STRING, "flux"), ("general.file_type", V.UINT32, 3)]
    with new_file(path) as f:
        file = gguf_file(f, metadata,
                         {k: (types[k], v.shape, type_of(types[k]).nbytes(v.shape)) for k, v in values.items()})
        for name in reversed(values):
            file.write(name, quantize(torch.from_numpy(values[name]), types[name]))
        file.finish()
    reader = gguf.GGUFReader(str(path))
    assert reader.fields["general.architecture"].contents() == "flux" \
        and reader.fields["general.file_type"].contents() == 3
    for t in reader.tensors:
        want = gguf.quants.quantize(values[t.name], types[t.name])
        assert t.tensor_type == types[t.name] \
            and np.array_equal(np.asarray(t.data).view(np.uint8).reshape(-1), want.view(np.uint8).reshape(-1))
    with open_gguf(path) as g:
        assert g.metadata["general.architecture"] == "flux"
        assert {n: t.shape for n, t in g.tensors.items()} == {"w.weight": (4, 64), "n.scale": (5,)}
    assert path.stat().st_size % 32 == 0


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_new_file_publishes_only_a_complete_file_and_never_replaces_unasked(tmp_path):
    out = tmp_path / "out.bin"
    with pytest.raises(KeyboardInterrupt):
        with new_file(out) as f:
            f.write(b"half")
            raise KeyboardInterrupt
    assert os.listdir(tmp_path) == [], "an interrupted write leaves nothing, not even its temporary file"
    with new_file(out) as f:
        f.write(b"first")
    with pytest.raises(FileExistsError):
        with new_file(out) as f:
            f.write(b"second")
    assert out.read_bytes() == b"first" and os.listdir(tmp_path) == ["out.bin"]
    with new_file(out, replace=True) as f:
        f.write(b"second")
    assert out.read_bytes() == b"second"


def test_a_link_at_the_name_is_replaced_never_written_through(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_bytes(b"the user's file")
    out = tmp_path / "out.gguf"
    out.symlink_to(victim)
    with pytest.raises(OutputError, match="already exists"):
        check_output(out, force=False, suffix=".gguf")
    with output_file(check_output(out, force=True, suffix=".gguf"), force=True) as f:
        f.write(b"new")
    assert not out.is_symlink() and out.read_bytes() == b"new" and victim.read_bytes() == b"the user's file"


def test_a_long_legal_name_is_written_and_a_stale_partial_of_it_alone_is_swept(tmp_path):
    """A 250-byte name (a file name holds 255): its temporary names are cut to fit, still starting with the name;
    the next write into it sweeps one a killed writer left, never a link at such a name nor another name's."""
    out = tmp_path / ("x" + "é" * 122 + ".gguf")  # the cut falls inside a two-byte character
    assert len(os.fsencode(out.name)) == 250
    with output_file(check_output(out, force=False, suffix=".gguf"), force=False) as f:
        (partial,) = [name for name in os.listdir(tmp_path) if name != out.name]
        f.write(b"first")
    assert len(os.fsencode(partial)) <= 255 and partial.startswith(".x" + "é" * 100) and partial.endswith(".partial")
    assert os.listdir(tmp_path) == [out.name] and out.read_bytes() == b"first"

    stem = partial[1 : -len(".0123456789abcdef.partial")]  # the name, cut, and a digest of it

    def named(random: str, stem: str = stem) -> Path:  # the partial's name with another random part
        return tmp_path / f".{stem}.{random}.partial"

    named("0123456789abcdef").write_bytes(b"left by a killed writer")
    victim = tmp_path / "victim.txt"
    victim.write_bytes(b"the user's file")
    named("fedcba9876543210").symlink_to(victim)
    other = named("0123456789abcdef", stem=stem[:-1] + ("1" if stem.endswith("0") else "0"))  # another digest
    other.write_bytes(b"another name's")
    with output_file(out, force=True) as f:
        f.write(b"second")
    assert sorted(os.listdir(tmp_path)) == sorted([out.name, victim.name, named("fedcba9876543210").name, other.name])
    assert out.read_bytes() == b"second" and victim.read_bytes() == b"the user's file"
    assert named("fedcba9876543210").is_symlink() and other.read_bytes() == b"another name's"


@pytest.mark.parametrize("name, problem", [
    ("out.txt", "is a .gguf file"), ("missing/out.gguf", "does not exist"), ("folder.gguf", "is a folder"),
])
def test_an_output_name_that_cannot_work_is_refused_first(tmp_path, name, problem):
    (tmp_path / "folder.gguf").mkdir()
    with pytest.raises(OutputError, match=problem):
        check_output(tmp_path / name, force=True, suffix=".gguf")
