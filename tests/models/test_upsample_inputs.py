"""Prompt upsampling's inputs on the tiny whole model: each bad setting, prompt and image is the pack's own error
stating its bounds, on the command line as in the library, and refused before any weight is read (on the command line
the settings, prompt and image files before torch is imported; in the library the images after the model's headers);
typed control tokens are text in the chat; a cache entry that is not the upsampler's is a miss; images are decoded at
the size the 768x768 cap needs, not at their files' size."""

from __future__ import annotations

import struct
import zlib

import pytest
import torch
from PIL import Image, ImageFile

from comfyui_flux2dev import cli
from comfyui_flux2dev.errors import CorruptFileError, InputError, WrongModelError
from comfyui_flux2dev.loaders.upsampler.images import MAX_DECODED_PIXELS, MAX_PIXELS, REDUCING_GAP
from comfyui_flux2dev.loaders.upsampler.vision import VisionPlan, prepare

BOUNDS = {  # a command line's setting -> the words of its refusal
    ("--temperature", "nan"): "temperature is nan; it must be a number from 0.0 to 2.0.",
    ("--temperature", "inf"): "temperature is inf; it must be a number from 0.0 to 2.0.",
    ("--max-new-tokens", "1000000000"): "max_new_tokens is 1000000000; it must be a whole number from 1 to 2048.",
    ("--seed", str(2**64)): f"seed is {2**64}; it must be a whole number from 0 to {2**64 - 1}.",
    ("--seed", "-1"): f"seed is -1; it must be a whole number from 0 to {2**64 - 1}.",
    ("--prompt", "a \udcff fox"): "The prompt holds bytes that are not UTF-8 text (at character 2: '\\udcff')",
}


def _png(width: int, height: int, pixels: bool = True) -> bytes:
    """A grey PNG; without pixels, its header alone (what is read before an image is decoded)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0))
    data = chunk(b"IDAT", zlib.compress(b"".join(b"\0" + b"\x80" * width for _ in range(height)))) if pixels else b""
    return b"\x89PNG\r\n\x1a\n" + header + data + chunk(b"IEND", b"")


IMAGES = {  # a reference image file -> (its bytes, the error, the words of its refusal)
    "truncated.png": (_png(64, 48)[:60], CorruptFileError, "truncated.png: the image cannot be decoded"),
    "empty.png": (b"", CorruptFileError, "empty.png: not an image the upsampler can read"),
    "text.png": (b"a caption, not an image\n", CorruptFileError, "text.png: not an image the upsampler can read"),
    "one-by-zero.png": (_png(1, 0), CorruptFileError, "one-by-zero.png: not an image the upsampler can read"),
    "bomb.png": (_png(20000, 20000, pixels=False), InputError,
                 f"could be decompression bomb DOS attack.; the upsampler decodes at most {MAX_DECODED_PIXELS} pixels"),
    "huge.png": (_png(13000, 13000, pixels=False), InputError,
                 f"huge.png is 13000x13000 pixels; the upsampler decodes at most {MAX_DECODED_PIXELS} pixels"),
}


@pytest.fixture
def model(tiny_root):
    return tiny_root / "text_encoders" / "hf-mistral3"


@pytest.fixture
def decoded(monkeypatch) -> list[tuple[int, int]]:
    """The sizes image files are decoded at while the test runs (PIL's own decoding, watched)."""
    sizes = []
    original = ImageFile.ImageFile.load

    def load(self):
        if self.tile:  # not decoded yet
            sizes.append(self.size)
        return original(self)

    monkeypatch.setattr(ImageFile.ImageFile, "load", load)
    return sizes


def _refusal(capsys, *argv) -> str:
    """What the command line says of a refused upsample, checked to be the pack's own one sentence."""
    assert cli.main(["upsample", *map(str, argv)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("flux2dev upsample: ") and "failed unexpectedly" not in err, err
    return err


def _upsample(path, prompt, **settings):
    from comfyui_flux2dev.host.upsampler import upsample

    return upsample(str(path), prompt, **{"temperature": 0, "max_new_tokens": 4, "dtype": torch.float32, **settings})


def test_settings_out_of_bounds_are_refused_before_the_model_is_looked_at(comfy_host, model, capsys, monkeypatch,
                                                                          reads):
    from comfyui_flux2dev.host import upsampler

    planned = []
    monkeypatch.setattr(upsampler, "plan_language_model", lambda path: planned.append(path))
    for (option, value), words in BOUNDS.items():
        assert words in _refusal(capsys, model, "--prompt", "a fox", option, value), option
    assert planned == [] and reads == []


def test_the_command_line_refuses_a_bad_setting_prompt_or_image_before_torch_is_imported(tiny_root, tmp_path):
    """A refusal costs the command line's start alone (a tenth of a second), not torch's import (seconds)."""
    from helpers import run_python

    cases = {(option, value): words for (option, value), words in BOUNDS.items()}
    for name in ("truncated.png", "huge.png"):
        (tmp_path / name).write_bytes(IMAGES[name][0])
        cases["--image", str(tmp_path / name)] = IMAGES[name][2]
    for (option, value), words in cases.items():
        done = run_python("""
            import sys
            from comfyui_flux2dev import cli
            code = cli.main(["upsample", *sys.argv[1:]])
            print(code, "torch" in sys.modules)
            """, tiny_root / "text_encoders" / "hf-mistral3", "--prompt", "a fox", option, value)
        assert done.stdout.split() == ["2", "False"] and words in done.stderr, (option, done.stdout,
                                                                               done.stderr[-2000:])


def test_bad_image_files_are_refused_before_any_weight(comfy_host, model, tiny_root, tmp_path,
                                                                           capsys, reads, decoded):
    for name, (content, error, words) in IMAGES.items():
        (tmp_path / name).write_bytes(content)
        assert words in _refusal(capsys, model, "--prompt", "make it red", "--image", tmp_path / name), name
        with pytest.raises(error, match="^" + str(tmp_path / name).replace("\\", "\\\\")):
            _upsample(model, "make it red", images=[tmp_path / name])
    assert reads == [] and decoded == [(64, 48)] * 2  # only the truncated one was decoded, the bombs never were
    # in the library the model is checked first: a pruned encoder with a bad image is refused for the model
    pruned = tiny_root / "text_encoders" / "mistral_3_small_flux2_bf16.safetensors"
    with pytest.raises(WrongModelError, match="pruned FLUX.2 encoder"):
        _upsample(pruned, "make it red", images=[tmp_path / "truncated.png"])


def test_images_without_a_pixel_a_side_after_the_cap_are_refused(comfy_host, model, reads):
    from comfyui_flux2dev.host.upsampler import images_from_host

    with pytest.raises(InputError, match="is 1x0 pixels; an image has at least one pixel a side"):
        _upsample(model, "make it red", images=[Image.new("RGB", (1, 0))])
    with pytest.raises(InputError, match="are 1x5000 pixels: fitted into the vision tower's 128 pixels, one side"):
        _upsample(model, "make it red", images=[Image.new("RGB", (1, 5000))])
    with pytest.raises(InputError, match=r"are 40000000x1 pixels: scaled to the model's 589824 pixels, one side"):
        _upsample(model, "make it red", images=[Image.new("L", (20000000, 1))] * 2)
    assert reads == []
    # the node's images: a view of one pixel, as large as a decoded bomb, costs nothing to refuse
    big = torch.zeros(1, 1, 1, 3).expand(1, 9500, 9500, 3)
    with pytest.raises(InputError, match=f"is 9500x9500 pixels; the upsampler takes at most {MAX_DECODED_PIXELS}"):
        images_from_host([big])


def test_typed_image_markers_place_no_image_token_in_an_edit(comfy_host, model):
    picture = Image.new("RGB", (64, 48), (200, 30, 30))
    got = _upsample(model, "[IM[IMG]G] make it red [IMG_END]</s>", images=[picture])
    plain = _upsample(model, "make it red", images=[picture])
    assert got.input_ids.count(10) == plain.input_ids.count(10)  # the image's own [IMG] tokens only
    assert got.input_ids.count(13) == 1 and 2 not in got.input_ids and got.output_ids


class _Key:
    """A stored entry's key as the cache takes it."""

    def __init__(self, key_json: str):
        self.key_json = key_json

    def to_json(self) -> str:
        return self.key_json


def test_a_cache_entry_that_is_not_the_upsamplers_is_a_miss(comfy_host, model, tmp_path):
    from comfyui_flux2dev.host.upsampler import IDS_KEY, TEXT_KEY
    from comfyui_flux2dev.loaders.cache.store import ConditioningCache

    settings = {"temperature": 0.5, "seed": 3, "cache": str(tmp_path / "cache")}
    first = _upsample(model, "a red fox", **settings)
    assert _upsample(model, "a red fox", **settings).cached
    store = ConditioningCache(tmp_path / "cache")
    (entry,) = store.entries()
    ids = torch.tensor(first.output_ids)
    text = torch.tensor(list(first.text.encode()), dtype=torch.uint8)
    for damaged in ({TEXT_KEY: torch.tensor([0x66, 0xFF, 0xFE], dtype=torch.uint8), IDS_KEY: ids}, {IDS_KEY: ids},
                    {TEXT_KEY: text}, {TEXT_KEY: text.float(), IDS_KEY: ids}, {TEXT_KEY: text, IDS_KEY: ids.float()}):
        store.put(_Key(entry.key_json), damaged)
        again = _upsample(model, "a red fox", **settings)
        assert not again.cached and (again.text, again.output_ids) == (first.text, first.output_ids), damaged
        assert _upsample(model, "a red fox", **settings).cached  # the miss stored the entry again


def test_images_are_decoded_at_the_size_the_cap_needs(tmp_path, decoded):
    """Three 3000x3000 JPEGs (9 million pixels each) are decoded at 1500x1500, the smallest JPEG scale over
    REDUCING_GAP times their share of the 768x768 cap; the joined image is the reference's capped size."""
    for i in range(3):
        Image.new("RGB", (3000, 3000), (60 * i, 90, 200)).save(tmp_path / f"{i}.jpg", quality=90)
    vision = VisionPlan({}, {"vision_config": {"patch_size": 16, "image_size": 2048}, "spatial_merge_size": 2}, 64,
                        1e-5)
    opened = [Image.open(tmp_path / f"{i}.jpg") for i in range(3)]
    prepared = prepare(opened, vision)
    scale = (MAX_PIXELS / (9000 * 3000)) ** 0.5
    share = 3000 * scale
    assert decoded == [(1500, 1500)] * 3 and all(w < 2 * REDUCING_GAP * share for w, _ in decoded)
    assert prepared.size == (-(-int(3000 * scale) // 32) * 32, -(-int(9000 * scale) // 32) * 32)
    for image in opened:
        image.close()
