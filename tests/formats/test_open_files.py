"""Open files: a model file in use is mapped once, read-only, and that map (one open file) is shared by every
reader and tensor of it and closed with the last of them; nothing written to a tensor can reach the file; and
running out of open files, wherever the pack opens one, is the pack's own error saying so and what to do, never
"the file is damaged"."""

from __future__ import annotations

import os
import shutil
import signal

import pytest
import torch
from gguf import GGMLQuantizationType as Q
from safetensors.torch import save_file

from comfyui_flux2dev.errors import CorruptFileError, TooManyOpenFilesError
from comfyui_flux2dev.loaders.cache.store import ConditioningCache
from comfyui_flux2dev.loaders.convert.output import output_file
from comfyui_flux2dev.loaders.formats.gguf_file import open_gguf
from comfyui_flux2dev.loaders.formats.safetensors_file import SafetensorsFiles
from comfyui_flux2dev.loaders.formats.validate import read_json_file
from comfyui_flux2dev.tokenizers import resolve_tokenizer
from comfyui_flux2dev.tokenizers.ladder import bundled_tekken_path
from helpers import gguf_bytes, gguf_tensor_info, out_of_open_files, run_python

TENSORS = 300  # more than a macOS shell's limit of open files (256)


def _open_files(path) -> int:
    """How many descriptors this process holds on the file `path`."""
    path = os.path.realpath(path)
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            count += os.readlink(f"/proc/self/fd/{fd}") == path
        except OSError:  # the listing's own descriptor, closed by now
            pass
    return count


@pytest.fixture
def many(tmp_path):
    """A safetensors file and a GGUF file of TENSORS tensors each."""
    st = tmp_path / "many.safetensors"
    save_file({f"t{i}": torch.full((64,), float(i)) for i in range(TENSORS)}, st)
    infos = [gguf_tensor_info(f"t{i}", [64], Q.F32, 256 * i) for i in range(TENSORS)]
    gg = tmp_path / "many.gguf"
    gg.write_bytes(gguf_bytes([], infos, bytes(256 * TENSORS)))
    return st, gg


def test_every_tensor_of_a_file_and_every_reader_share_one_open_file_closed_with_the_last(many):
    st, gg = many
    first, second = SafetensorsFiles([st]), SafetensorsFiles([st])
    views = [files.view(f"t{i}") for files in (first, second) for i in range(TENSORS)]
    assert all(torch.equal(v, torch.full((64,), float(i % TENSORS))) for i, v in enumerate(views))
    assert _open_files(st) == 1
    del views[TENSORS:]
    assert _open_files(st) == 1
    del views
    assert _open_files(st) == 0, "closed with the last view, not at a collection"
    gguf_views = []
    for _ in range(2):
        with open_gguf(gg) as f:
            gguf_views += [t.data for t in f.tensors.values()]
    assert len(gguf_views) == 2 * TENSORS and _open_files(gg) == 1
    del gguf_views
    assert _open_files(gg) == 0


def test_a_reader_reads_the_file_it_read_the_header_of(tmp_path):
    """A file put at the name while a tensor of the old one is in use: the reader still reads the old one's bytes
    (its map); with none in use, it refuses the new file instead of reading its bytes at the old header's offsets."""
    path, fresh = tmp_path / "t.safetensors", tmp_path / "fresh.safetensors"
    save_file({"a": torch.ones(64), "b": torch.ones(64)}, path)
    save_file({"a": torch.zeros(64), "b": torch.zeros(64)}, fresh)
    files = SafetensorsFiles([path])
    held = files.view("a")
    os.replace(fresh, path)
    assert torch.equal(files.view("b"), torch.ones(64))
    del held
    with pytest.raises(CorruptFileError, match="was replaced by another file after its header was read"):
        files.view("b")


def test_a_write_into_a_mapped_tensor_never_reaches_the_file(many):
    """The map is read-only: a write into a view (torch takes it as writable) stops the process writing, and the
    file keeps its bytes."""
    st, _ = many
    before = st.read_bytes()
    done = run_python("""
        import resource, sys
        from comfyui_flux2dev.loaders.formats.safetensors_file import SafetensorsFiles
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # its stop leaves no core file behind
        SafetensorsFiles([sys.argv[1]]).view("t1").fill_(0)
        print("written")
        """, st)
    assert done.returncode in (-signal.SIGSEGV, -signal.SIGBUS), (done.returncode, done.stdout, done.stderr[-2000:])
    assert "written" not in done.stdout
    assert st.read_bytes() == before


@pytest.fixture
def openers(many, tmp_path):
    """Each place the pack opens a file: (what it opens, the call, how many more files it may open and still fail:
    a map takes an open file and its own)."""
    st, gg = many
    files = SafetensorsFiles([st])
    config = tmp_path / "config.json"
    config.write_text("{}")
    tokenizer = tmp_path / "tokenizer"
    tokenizer.mkdir()
    shutil.copyfile(bundled_tekken_path(), tokenizer / "tekken.json")  # a file no test has read yet

    def write_output():
        with output_file(tmp_path / "out.safetensors", force=False) as f:
            f.write(b"x")

    return {
        "a config file": (lambda: read_json_file(config), 0),
        "a safetensors header": (lambda: SafetensorsFiles([st]), 0),
        "a tensor read into memory": (lambda: files.read("t0"), 0),
        "a tensor mapped (the file)": (lambda: files.view("t0"), 0),
        "a tensor mapped (the map's own)": (lambda: files.view("t0"), 1),
        "a GGUF file": (lambda: open_gguf(gg), 0),
        "a GGUF file's header map": (lambda: open_gguf(gg), 1),
        "a converted file": (write_output, 0),
        "the conditioning cache folder": (lambda: ConditioningCache(tmp_path), 0),
        "a tokenizer": (lambda: resolve_tokenizer([tokenizer]), 0),
    }


@pytest.mark.parametrize("where", ["a config file", "a safetensors header", "a tensor read into memory",
                                   "a tensor mapped (the file)", "a tensor mapped (the map's own)", "a GGUF file",
                                   "a GGUF file's header map", "a converted file", "the conditioning cache folder",
                                   "a tokenizer"])
def test_running_out_of_open_files_is_the_packs_own_error(openers, many, where):
    call, free = openers[where]
    with out_of_open_files(free), pytest.raises(TooManyOpenFilesError) as raised:
        call()
    message = str(raised.value)
    assert "cannot be opened" in message and "ulimit -n" in message and "The file itself is fine" in message
    assert "damaged" not in message and "Download" not in message
    assert [_open_files(f) for f in many] == [0, 0], "nothing of it left open"
