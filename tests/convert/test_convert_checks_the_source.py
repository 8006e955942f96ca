"""`convert transformer` checks what a load checks before anything is written: every tensor's shape against the
FLUX.2 variant's (transformer_layout.BFL_TENSORS), nothing missing, nothing extra, no name twice in a header. A
source no loader would take is refused with the pack's error naming the tensor, never converted and called
FLUX.2 [dev], and never left to fail deep inside ComfyUI or the quantizer."""

from __future__ import annotations

import json
import struct

import pytest
import torch

from comfyui_flux2dev.errors import CorruptFileError, MissingWeightsError, UnknownModelError
from comfyui_flux2dev.loaders.convert.transformer import convert_transformer

BFL = "diffusion_models/flux2-dev-tiny.safetensors"
FP8 = "diffusion_models/flux2-dev-tiny-fp8-weight_scale.safetensors"
QKV = "double_blocks.0.img_attn.qkv.weight"  # [768, 256] in the tiny [dev]
NORM = "double_blocks.0.img_attn.norm.query_norm.scale"  # [128]


def _changed(change):
    def edit(tensors: dict) -> dict:
        tensors = dict(tensors)
        change(tensors)
        return tensors
    return edit


def _set(key, value):
    return _changed(lambda t: t.__setitem__(key, value))


def _drop(key):
    return _changed(lambda t: t.pop(key))


# case -> (the tiny file it starts from, its change, the error, what the message says)
CASES = {
    "a weight of no rows": (BFL, _set(QKV, torch.zeros(0, 256)), UnknownModelError, rf"{QKV} \[0, 256\] \(expected "
                            r"\[768, 256\]\)"),
    "a weight of no columns": (BFL, _set("single_blocks.0.linear1.weight", torch.zeros(2304, 0)), UnknownModelError,
                               r"linear1\.weight \[2304, 0\] \(expected \[2304, 256\]\)"),
    "rows of 250 where 256 belong": (BFL, _set("single_blocks.0.linear2.weight", torch.zeros(250, 1024)),
                                     UnknownModelError, r"linear2\.weight \[250, 1024\] \(expected \[256, 1024\]\)"),
    "a 1-D weight": (BFL, _set(QKV, torch.zeros(768)), UnknownModelError, rf"{QKV} \[768\] \(expected"),
    "a 5-D weight": (BFL, _set(QKV, torch.zeros(768, 256, 1, 1, 1)), UnknownModelError,
                     rf"{QKV} \[768, 256, 1, 1, 1\]"),
    "a 0-d norm": (BFL, _set(NORM, torch.tensor(1.0)), UnknownModelError, rf"{NORM} \[\] \(expected \[128\]\)"),
    "a missing weight": (BFL, _drop("double_blocks.1.txt_mlp.2.weight"), MissingWeightsError,
                         r"lacks 1 tensor\(s\) \(double_blocks\.1\.txt_mlp\.2\.weight\)"),
    "a missing norm": (BFL, _drop(NORM), MissingWeightsError, rf"lacks 1 tensor\(s\) \({NORM}\)"),
    "an extra key": (BFL, _set("double_blocks.0.img_attn.extra.weight", torch.zeros(4, 4)), UnknownModelError,
                     r"1 tensor\(s\) the pack does not know \(double_blocks\.0\.img_attn\.extra\.weight\)"),
    "a 0-d fp8 weight": (FP8, _set(QKV, torch.tensor(1.0).to(torch.float8_e4m3fn)), UnknownModelError,
                         rf"{QKV} \[\] \(expected \[768, 256\]\)"),
    "an fp8 weight of no rows": (FP8, _set(QKV, torch.zeros(0, 256).to(torch.float8_e4m3fn)), UnknownModelError,
                                 rf"{QKV} \[0, 256\]"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_source_no_loader_takes_is_refused_before_anything_is_written(tiny_root, tmp_path, case):
    from safetensors.torch import load_file, save_file

    start, change, error, said = CASES[case]
    src = tmp_path / "src.safetensors"
    save_file({k: v.contiguous() for k, v in change(load_file(str(tiny_root / start))).items()}, str(src))
    out = tmp_path / "out.gguf"
    with pytest.raises(error, match=said):
        convert_transformer(str(src), str(out), qtype="Q8_0")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src.safetensors"]


def _with_a_name_twice(tiny_root, tmp_path, name: str, shape: list[int]):
    """The tiny [dev] file with a second header entry under `name` (of `shape`, bf16, its bytes appended): json
    would keep one of the two silently."""
    raw = (tiny_root / BFL).read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header, data = raw[8:8 + length].decode().rstrip(" "), raw[8 + length:]
    extra = 2 * shape[0] * shape[1]
    entry = json.dumps({"dtype": "BF16", "shape": shape, "data_offsets": [len(data), len(data) + extra]})
    header = header[:-1] + f', "{name}": {entry}' + "}"
    src = tmp_path / "twice.safetensors"
    src.write_bytes(struct.pack("<Q", len(header)) + header.encode() + data + bytes(extra))
    return src


@pytest.mark.parametrize("name, shape", [(QKV, [768, 256]), ("img_in.weight", [256, 64])],
                         ids=["same shape, other bytes", "img_in with another shape"])
def test_a_name_twice_in_a_header_is_refused_by_the_reader(tiny_root, tmp_path, name, shape):
    from comfyui_flux2dev.loaders.formats.safetensors_file import read_header

    src = _with_a_name_twice(tiny_root, tmp_path, name, shape)
    said = rf"names '{name}' more than once"
    with pytest.raises(CorruptFileError, match=said):
        read_header(str(src))
    with pytest.raises(CorruptFileError, match=said):
        convert_transformer(str(src), str(tmp_path / "out.gguf"), qtype="Q8_0")
    assert not (tmp_path / "out.gguf").exists()

