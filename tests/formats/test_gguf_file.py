"""The pack's GGUF reader: a file written by gguf.GGUFWriter reads back the same as gguf.GGUFReader sees
it, each open parses once, and truncated or hostile files fail with the pack's errors."""

from __future__ import annotations

import os
import struct

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import GGUFValueType as V

from comfyui_flux2dev.devtools.tiny.gguf_blocks import random_blocks, write_and_close
from comfyui_flux2dev.errors import CorruptFileError, UnsupportedFormatError
from comfyui_flux2dev.loaders.formats import gguf_file
from comfyui_flux2dev.loaders.formats.gguf_file import open_gguf
from helpers import gguf_bytes, gguf_kv, gguf_string, gguf_tensor_info

TOKENS = ["<unk>", "<s>", "", "ÿ", "Ġthe", "日本", "a b", "\n", "🙂", "ĊĠĠ"] * 30
# (name, gguf shape in torch order, type)
TENSORS = [
    ("token_embd.weight", (10, 64), Q.F16),
    ("blk.0.attn_q.weight", (4, 256), Q.Q4_K),
    ("blk.0.ffn_down.weight", (3, 2, 96), Q.Q8_0),
    ("output_norm.weight", (64,), Q.F32),
    ("blk.0.attn_k.weight", (2, 512), Q.Q6_K),
]


def _tensor_bytes(shape, qtype, seed):
    rng = np.random.default_rng(seed)
    if qtype in (Q.F16, Q.F32):
        return rng.standard_normal(shape).astype(np.float16 if qtype == Q.F16 else np.float32)
    return random_blocks(qtype, shape, rng)


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("gguf") / "model.gguf")
    writer = gguf.GGUFWriter(path, "mistral3")
    writer.add_uint8("t.u8", 200)
    writer.add_int8("t.i8", -5)
    writer.add_uint16("t.u16", 60000)
    writer.add_int16("t.i16", -30000)
    writer.add_uint32("mistral3.block_count", 40)
    writer.add_int32("t.i32", -(2**31))
    writer.add_float32("mistral3.rope.freq_base", 1e9)
    writer.add_uint64("t.u64", 2**64 - 1)
    writer.add_int64("t.i64", -(2**63))
    writer.add_float64("t.f64", 1 / 3)
    writer.add_bool("t.bool", True)
    writer.add_string("t.str", "Grüße, 世界")
    writer.add_token_list(TOKENS)
    writer.add_token_types([3, 3] + [1] * (len(TOKENS) - 2))
    writer.add_array("t.floats", [0.5, -2.25, 1e-3])
    writer.add_array("t.empty", [])
    for i, (name, shape, qtype) in enumerate(TENSORS):
        raw = _tensor_bytes(shape, qtype, i)
        writer.add_tensor(name, raw, raw_dtype=None if qtype in (Q.F16, Q.F32) else qtype)
    write_and_close(writer)
    return path


def test_metadata_matches_gguf_reader(written):
    reader = gguf.GGUFReader(written)
    with open_gguf(written) as f:
        expected_keys = [k for k in reader.fields if not k.startswith("GGUF.")]
        assert list(f.metadata) == expected_keys
        for key in expected_keys:
            got, want = f.metadata[key], reader.fields[key].contents()
            if isinstance(got, np.ndarray):
                got = got.tolist()
            assert got == want, key
        assert f.architecture == "mistral3"
        assert f.metadata["tokenizer.ggml.tokens"] == TOKENS
        assert f.metadata["t.u64"] == 2**64 - 1 and f.metadata["t.bool"] is True


def test_tensors_match_gguf_reader(written):
    reader = gguf.GGUFReader(written)
    with open_gguf(written) as f:
        assert list(f.tensors) == [t.name for t in reader.tensors]
        for want in reader.tensors:
            got = f.tensors[want.name]
            assert got.qtype == want.tensor_type
            assert got.shape == tuple(reversed(want.shape.tolist()))
            assert got.nbytes == want.n_bytes
            assert got.data.dtype == torch.uint8
            assert np.array_equal(got.data.numpy(), want.data.view(np.uint8).reshape(-1))
    for name, shape, qtype in TENSORS:
        assert f.tensors[name].shape == shape and f.tensors[name].qtype == qtype


def test_one_parse_per_open(written):
    before = gguf_file.parse_count()
    f = open_gguf(written)
    f.tensors["blk.0.attn_q.weight"].data.sum()
    _ = f.metadata, f.architecture, f.tensors
    assert gguf_file.parse_count() == before + 1
    f.close()


def test_views_outlive_close(written):
    with open_gguf(written) as f:
        view = f.tensors["output_norm.weight"].data
        expected = view.clone()
    assert torch.equal(view, expected)  # the map stays alive for the view
    with pytest.raises(ValueError, match="closed"):
        _ = f.tensors["output_norm.weight"].data


# Hostile files, built byte by byte so each field can be set to anything.


GOOD_KVS = [gguf_kv("general.architecture", V.STRING, gguf_string("llama")),
            gguf_kv("tokenizer.ggml.tokens", V.ARRAY,
                    struct.pack("<IQ", V.STRING, 3) + gguf_string("a") + gguf_string("ÿ") + gguf_string(""))]
GOOD_INFOS = [gguf_tensor_info("a", [32, 2], Q.F32, 0), gguf_tensor_info("b", [32], Q.Q8_0, 256)]
GOOD = gguf_bytes(GOOD_KVS, GOOD_INFOS, bytes(range(256)) + bytes(34))


def _open_bytes(tmp_path, raw: bytes):
    path = tmp_path / "hostile.gguf"
    path.write_bytes(raw)
    return open_gguf(path)


def test_handmade_file_is_valid(tmp_path):
    with _open_bytes(tmp_path, GOOD) as f:
        assert f.metadata["tokenizer.ggml.tokens"] == ["a", "ÿ", ""]
        assert f.tensors["a"].shape == (2, 32) and f.tensors["b"].nbytes == 34
        assert bytes(f.tensors["a"].data[:4].tolist()) == bytes(range(4))


def test_every_truncation_fails(tmp_path):
    for cut in range(len(GOOD)):
        with pytest.raises(CorruptFileError):
            _open_bytes(tmp_path, GOOD[:cut])



def test_a_file_cut_after_its_header_fails_at_the_tensor(tmp_path):
    """A download replaced in place while the file is open: the tensor past the new end is the pack's error,
    not a process killed for touching a map past the end of its file."""
    path = tmp_path / "cut.gguf"
    path.write_bytes(GOOD)
    with open_gguf(path) as f:
        os.truncate(path, len(GOOD) - 10)
        assert f.tensors["a"].data.shape == (256,)
        with pytest.raises(CorruptFileError, match="ended inside a tensor"):
            _ = f.tensors["b"].data

HOSTILE = {
    "wrong magic": gguf_bytes(GOOD_KVS, GOOD_INFOS, bytes(290), magic=b"GGML"),
    "absurd tensor count": gguf_bytes(GOOD_KVS, GOOD_INFOS, bytes(290), n_tensors=2**63),
    "absurd metadata count": gguf_bytes(GOOD_KVS, GOOD_INFOS, bytes(290), n_kv=2**60),
    "key length past the end": gguf_bytes([struct.pack("<Q", 2**40) + b"general"], [], bytes(64)),
    "string value past the end": gguf_bytes([gguf_kv("k", V.STRING, struct.pack("<Q", 10**6) + b"abc")], [], bytes(64)),
    "string array count": gguf_bytes([gguf_kv("k", V.ARRAY, struct.pack("<IQ", V.STRING, 2**62) + gguf_string("a"))],
                                     [], bytes(64)),
    "string in array past the end": gguf_bytes(
        [gguf_kv("k", V.ARRAY, struct.pack("<IQ", V.STRING, 2) + gguf_string("a") + struct.pack("<Q", 2**50))], [],
        bytes(64)),
    "numeric array count": gguf_bytes([gguf_kv("k", V.ARRAY, struct.pack("<IQ", V.INT32, 2**61))], [], bytes(64)),
    "nested arrays": gguf_bytes([gguf_kv("k", V.ARRAY, struct.pack("<IQ", V.ARRAY, 1) * 20)], [], bytes(400)),
    "unknown value type": gguf_bytes([gguf_kv("k", 99, b"\0" * 8)], [], bytes(64)),
    "invalid UTF-8 in a string array": gguf_bytes(
        [gguf_kv("k", V.ARRAY, struct.pack("<IQ", V.STRING, 2) + gguf_string(b"\xc3") + gguf_string(b"\xa9"))], [],
        bytes(64)),
    "0xFF inside a string array": gguf_bytes(
        [gguf_kv("k", V.ARRAY, struct.pack("<IQ", V.STRING, 1) + gguf_string(b"a\xffb"))], [], bytes(64)),
    "duplicate key": gguf_bytes(GOOD_KVS + GOOD_KVS[:1], GOOD_INFOS, bytes(290)),
    "tensor past the end": gguf_bytes(GOOD_KVS, [gguf_tensor_info("a", [32, 2], Q.F32, 0),
                                                 gguf_tensor_info("b", [32], Q.Q8_0, 2**40)], bytes(290)),
    "tensor dims past the end": gguf_bytes(GOOD_KVS, [gguf_tensor_info("a", [2**40, 2**20], Q.F32, 0)], bytes(290)),
    "overlapping tensors": gguf_bytes(GOOD_KVS, [gguf_tensor_info("a", [32, 2], Q.F32, 0),
                                                 gguf_tensor_info("b", [32], Q.Q8_0, 224)], bytes(290)),
    "misaligned tensor": gguf_bytes(GOOD_KVS, [gguf_tensor_info("a", [32, 2], Q.F32, 8)], bytes(290)),
    "row not a whole block": gguf_bytes(GOOD_KVS, [gguf_tensor_info("b", [33], Q.Q8_0, 0)], bytes(290)),
    "too many dims": gguf_bytes(GOOD_KVS, [gguf_tensor_info("a", [1, 1, 1, 1, 1], Q.F32, 0)], bytes(290)),
    "duplicate tensor": gguf_bytes(GOOD_KVS, GOOD_INFOS[:1] * 2, bytes(290)),
    "alignment not a power of two": gguf_bytes(
        GOOD_KVS + [gguf_kv("general.alignment", V.UINT32, struct.pack("<I", 48))], [], bytes(64)),
    "alignment zero": gguf_bytes(GOOD_KVS + [gguf_kv("general.alignment", V.UINT32, struct.pack("<I", 0))], [],
                                 bytes(64)),
}
UNSUPPORTED = {
    "unknown tensor type": gguf_bytes(GOOD_KVS, [gguf_tensor_info("a", [32], 200, 0)], bytes(290)),
    "removed tensor type Q4_2": gguf_bytes(GOOD_KVS, [gguf_tensor_info("a", [32], 4, 0)], bytes(290)),
    "version 1": gguf_bytes(GOOD_KVS, GOOD_INFOS, bytes(290), version=1),
    "big-endian": gguf_bytes(GOOD_KVS, GOOD_INFOS, bytes(290), version=3 << 24),
}


@pytest.mark.parametrize("raw", HOSTILE.values(), ids=HOSTILE.keys())
def test_hostile_file_is_corrupt(tmp_path, raw):
    with pytest.raises(CorruptFileError, match="hostile.gguf"):
        _open_bytes(tmp_path, raw)


@pytest.mark.parametrize("raw", UNSUPPORTED.values(), ids=UNSUPPORTED.keys())
def test_unknown_format_is_unsupported(tmp_path, raw):
    with pytest.raises(UnsupportedFormatError, match="hostile.gguf"):
        _open_bytes(tmp_path, raw)
