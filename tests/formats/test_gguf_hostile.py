"""Hostile GGUF files: each ends in the pack's own error naming what is wrong, a refusal costs
neither gigabytes nor minutes (checked in a child process, by its peak memory, with a hang guard), and a
load that fails leaves nothing of the file mapped."""

from __future__ import annotations

import os
import struct

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import GGUFValueType as V

from comfyui_flux2dev.devtools.tiny.gguf_transformers import write_gguf
from comfyui_flux2dev.errors import CorruptFileError, ModelNotFoundError, WrongModelError
from comfyui_flux2dev.loaders.formats.gguf_file import open_gguf
from comfyui_flux2dev.loaders.models.gguf_transformer import load_gguf_transformer
from comfyui_flux2dev.loaders.models.kinds import gguf_architectures
from helpers import gguf_array, gguf_bytes, gguf_f32, gguf_kv, gguf_string, gguf_tensor_info, gguf_u32, run_python

# The architectures whose settings the encoder loader reads, as it tells the reader.
ENCODER_ARCHITECTURES = frozenset(gguf_architectures("encoder"))
ARCH = gguf_kv("general.architecture", V.STRING, gguf_string("mistral3"))
TENSOR = [gguf_tensor_info("a", [32, 2], Q.F32, 0)]
DATA = bytes(256)

# name -> (file, words the message must hold)
CORRUPT = {
    "alignment 1": (gguf_bytes([ARCH, gguf_u32("general.alignment", 1)], TENSOR, DATA), "general.alignment"),
    "alignment 0": (gguf_bytes([ARCH, gguf_u32("general.alignment", 0)], TENSOR, DATA), "general.alignment"),
    "alignment huge": (
        gguf_bytes([ARCH, gguf_kv("general.alignment", V.UINT64, struct.pack("<Q", 2**63))], TENSOR, DATA),
        "general.alignment"),
    "alignment a float": (gguf_bytes([ARCH, gguf_f32("general.alignment", 32.0)], TENSOR, DATA), "general.alignment"),
    "alignment 96": (gguf_bytes([ARCH, gguf_u32("general.alignment", 96)], TENSOR, DATA), "power of two"),
    "a dimension of 0": (gguf_bytes([ARCH], [gguf_tensor_info("a", [2**63, 0], Q.F32, 0)], DATA), "dimension of 0"),
    "a dimension of 2**63": (gguf_bytes([ARCH], [gguf_tensor_info("a", [32, 2**63], Q.F32, 0)], DATA),
                             "runs past the end"),
    "dimensions whose product overflows 64 bits": (
        gguf_bytes([ARCH], [gguf_tensor_info("a", [2**62, 2**62, 2**62], Q.F32, 0)], DATA), "runs past the end"),
    "a 0-D tensor": (gguf_bytes([ARCH], [gguf_tensor_info("token_embd.weight", [], Q.F32, 0)], DATA), "dimensions"),
    "architecture an array": (gguf_bytes([gguf_array("general.architecture", V.STRING, [gguf_string("llama")])], TENSOR,
                                         DATA), "general.architecture"),
    "architecture a number": (gguf_bytes([gguf_u32("general.architecture", 7)], TENSOR, DATA), "general.architecture"),
    "head count a string": (
        gguf_bytes([ARCH, gguf_kv("mistral3.attention.head_count", V.STRING, gguf_string("32"))], TENSOR, DATA),
        "mistral3.attention.head_count"),
    "head count 0": (gguf_bytes([ARCH, gguf_u32("mistral3.attention.head_count_kv", 0)], TENSOR, DATA),
                     "mistral3.attention.head_count_kv"),
    "head count an array": (
        gguf_bytes([ARCH, gguf_array("mistral3.attention.head_count", V.UINT32, [struct.pack("<I", 8)] * 40)], TENSOR,
                   DATA), "head_count"),
    "rope freq_base a string": (
        gguf_bytes([ARCH, gguf_kv("mistral3.rope.freq_base", V.STRING, gguf_string("1e9"))], TENSOR, DATA),
        "mistral3.rope.freq_base"),
    "rope freq_base an array": (
        gguf_bytes([ARCH, gguf_array("mistral3.rope.freq_base", V.FLOAT32, [struct.pack("<f", 1e9)])], TENSOR, DATA),
        "rope.freq_base"),
    "rope freq_base infinite": (gguf_bytes([ARCH, gguf_f32("mistral3.rope.freq_base", float("inf"))], TENSOR, DATA),
                                "rope.freq_base"),
    "llama head count a float": (
        gguf_bytes([gguf_kv("general.architecture", V.STRING, gguf_string("llama")),
                    gguf_f32("llama.attention.head_count", 32.0)], TENSOR, DATA),
        "llama.attention.head_count"),
    "tokens numbers": (
        gguf_bytes([ARCH, gguf_array("tokenizer.ggml.tokens", V.UINT32, [struct.pack("<I", 1)] * 3)], TENSOR, DATA),
        "tokenizer.ggml.tokens"),
    "token types strings": (
        gguf_bytes([ARCH, gguf_array("tokenizer.ggml.token_type", V.STRING, [gguf_string("3")])], TENSOR, DATA),
        "tokenizer.ggml.token_type"),
    "token types not one per token": (
        gguf_bytes([ARCH, gguf_array("tokenizer.ggml.tokens", V.STRING, [gguf_string("a"), gguf_string("b")]),
                    gguf_array("tokenizer.ggml.token_type", V.INT32, [struct.pack("<i", 1)])], TENSOR, DATA),
        "2 tokens but 1 token types",
    ),
    "too many nested arrays": (gguf_bytes([gguf_array("k", V.ARRAY, [struct.pack("<IQ", V.UINT8, 0)] * 5000)]),
                               "nested arrays"),
    "arrays nested three deep": (
        gguf_bytes([gguf_array("k", V.ARRAY, [struct.pack("<IQ", V.ARRAY, 1) + struct.pack("<IQ", V.UINT8, 0)])]),
        "nests arrays"),
    "a string value of 1 GiB claimed": (gguf_bytes([gguf_kv("k", V.STRING, struct.pack("<Q", 1 << 30))], (), bytes(64)),
                                        "more than any real file"),
}


@pytest.mark.parametrize("raw, words", CORRUPT.values(), ids=CORRUPT.keys())
def test_hostile_metadata_and_tensor_table_are_refused(tmp_path, raw, words):
    path = tmp_path / "hostile.gguf"
    path.write_bytes(raw)
    with pytest.raises(CorruptFileError) as caught:
        open_gguf(path, ENCODER_ARCHITECTURES)
    assert "hostile.gguf" in str(caught.value) and words in str(caught.value)


def test_declared_values_pass_when_sane(tmp_path):
    path = tmp_path / "sane.gguf"
    kvs = [ARCH, gguf_u32("general.alignment", 64), gguf_u32("mistral3.attention.head_count", 32),
           gguf_f32("mistral3.rope.freq_base", 1e9),
           gguf_array("tokenizer.ggml.tokens", V.STRING, [gguf_string("a"), gguf_string("b")]),
           gguf_array("tokenizer.ggml.token_type", V.INT32, [struct.pack("<i", 3)] * 2)]
    head = b"GGUF" + struct.pack("<IQQ", 3, 1, len(kvs)) + b"".join(kvs) + TENSOR[0]
    path.write_bytes(head + b"\0" * (-len(head) % 64) + DATA)
    with open_gguf(path, ENCODER_ARCHITECTURES) as f:
        assert f.architecture == "mistral3" and f.metadata["mistral3.attention.head_count"] == 32
        assert f.metadata["tokenizer.ggml.tokens"] == ["a", "b"] and f.tensors["a"].shape == (2, 32)


def test_other_models_settings_are_not_judged(tmp_path):
    """Per-layer head counts (an array, as some llama.cpp architectures store them) in a model the pack does
    not read: the file opens, and its loader names the model instead of calling it damaged."""
    path = tmp_path / "other.gguf"
    heads = gguf_array("deci.attention.head_count_kv", V.UINT32, [struct.pack("<I", 8)] * 4)
    path.write_bytes(gguf_bytes([gguf_kv("general.architecture", V.STRING, gguf_string("deci")), heads], TENSOR, DATA))
    with open_gguf(path, ENCODER_ARCHITECTURES) as f:
        assert f.architecture == "deci" and len(f.metadata["deci.attention.head_count_kv"]) == 4
    bad = tmp_path / "mistral3.gguf"  # a reader not told an architecture does not judge its settings either
    bad.write_bytes(CORRUPT["head count 0"][0])
    with open_gguf(bad) as f:
        assert f.metadata["mistral3.attention.head_count_kv"] == 0


def test_not_a_regular_file(tmp_path):
    folder = tmp_path / "folder.gguf"
    folder.mkdir()
    with pytest.raises(CorruptFileError, match="is a folder"):
        open_gguf(folder)
    with pytest.raises(ModelNotFoundError, match="missing.gguf"):
        open_gguf(tmp_path / "missing.gguf")
    loop = tmp_path / "loop.gguf"
    loop.symlink_to(loop)
    with pytest.raises(CorruptFileError, match="loop.gguf"):
        open_gguf(loop)


def _child(code: str, timeout: int = 120) -> str:
    """Run `code` in a fresh interpreter (its peak memory is its own); a hang fails the test, not the run."""
    done = run_python(code, timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_fifo_named_gguf_does_not_block(tmp_path):
    fifo = tmp_path / "x.gguf"
    os.mkfifo(fifo)
    out = _child(f"""
        from comfyui_flux2dev.errors import CorruptFileError
        from comfyui_flux2dev.loaders.formats.gguf_file import open_gguf
        try:
            open_gguf({str(fifo)!r})
        except CorruptFileError as e:
            print(e)
    """, timeout=60)
    assert "not a regular file" in out


# Big hostile headers: (what fills the file, its item count). Parsed without bounds, the first two cost
# gigabytes and tens of seconds (about +1.8 GB and 24 s, and +1.75 GB); the third is the most a file may hold.
BLOATED = {
    "64 MiB of empty nested arrays": (struct.pack("<IQ", V.ARRAY, (64 << 20) // 12), struct.pack("<IQ", V.UINT8, 0),
                                      (64 << 20) // 12),
    "128 MiB of empty strings": (struct.pack("<IQ", V.STRING, (128 << 20) // 8), struct.pack("<Q", 0),
                                 (128 << 20) // 8),
    "2M empty strings (the most a file may hold)": (struct.pack("<IQ", V.STRING, 1 << 21), struct.pack("<Q", 0),
                                                    1 << 21),
}
MEMORY_BOUND_MIB = 400  # growth of the child's peak RSS; real Mistral headers need ~30 MiB


@pytest.mark.parametrize("head, item, count", BLOATED.values(), ids=BLOATED.keys())
def test_bloated_metadata_costs_bounded_memory(tmp_path, head, item, count):
    path = tmp_path / "bloat.gguf"
    with open(path, "wb") as f:
        f.write(b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + gguf_string("k") + struct.pack("<I", V.ARRAY) + head)
        f.write(item * count)
        f.write(bytes(64))
    out = _child(f"""
        import resource
        from comfyui_flux2dev.errors import Flux2DevError
        from comfyui_flux2dev.loaders.formats.gguf_file import open_gguf
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        try:
            with open_gguf({str(path)!r}) as f:
                print("read", len(f.metadata["k"]))
        except Flux2DevError as e:
            print("refused", type(e).__name__, e)
        print("growth", (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024)
    """)
    growth = int(out.split("growth ")[-1])
    assert growth < MEMORY_BOUND_MIB, out
    if count > 1 << 21:
        assert "refused CorruptFileError" in out and "more than any real file holds" in out, out
    else:
        assert f"read {count}" in out, out


def _mapped(path) -> bool:
    with open("/proc/self/maps") as maps:
        return any(line.rstrip().endswith(str(path)) for line in maps)


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs Linux's /proc/self/maps")
def test_failed_loads_leave_nothing_mapped(tmp_path):
    wrong = tmp_path / "qwen.gguf"  # parses, then is refused as the wrong model
    write_gguf(wrong, {"img_in.weight": (np.zeros((4, 32), np.float32), Q.F32)}, "qwen3")
    with pytest.raises(WrongModelError) as kept:  # the error (and its frames) stay alive in `kept`
        load_gguf_transformer(wrong)
    assert not _mapped(wrong)
    damaged = tmp_path / "damaged.gguf"  # fails while its metadata is checked
    damaged.write_bytes(CORRUPT["head count 0"][0])
    with pytest.raises(CorruptFileError) as kept:
        open_gguf(damaged, ENCODER_ARCHITECTURES)
    assert not _mapped(damaged) and kept.value is not None
