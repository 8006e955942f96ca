"""The reference images of an edit, as the model sees them before the vision tower's own fit: several are
joined side by side on white, centred vertically, into one; one over 768x768 pixels is scaled down to that area
(Lanczos), as Black Forest Labs' reference (and diffusers') do. Memory follows that cap, not the files: the
images are decoded one at a time, a JPEG at the smallest scale the cap allows, and each one far over its share
of the cap is box-reduced by a whole factor before it is joined (as PIL's own reducing_gap does); an image is
refused before it is decoded when it would be over MAX_DECODED_PIXELS decoded.

No torch here: the command line checks a user's image files with this before torch and the host are imported."""

from __future__ import annotations

import contextlib
import math
import os
import struct
import warnings
import zlib

from ...errors import CorruptFileError, InputError

MAX_PIXELS = 768 * 768  # the reference's cap on the joined image's area
# The most pixels one image may have as decoded: PIL's own decompression-bomb bound (its default warning limit).
MAX_DECODED_PIXELS = 89_478_485
# An image at least this many times its share of the cap on each side is box-reduced by a whole factor first,
# down to no less than this many times that share (PIL's thumbnail uses the same gap).
REDUCING_GAP = 2
# Modes Image.reduce takes; others are made RGB first.
REDUCIBLE_MODES = ("L", "LA", "RGB", "RGBA", "RGBX", "CMYK", "I", "F", "La", "RGBa")
BACKGROUND = (255, 255, 255)
# What PIL raises for a file it cannot read or decode (a truncated PNG, a text file named .png, a bad header).
UNREADABLE = (OSError, SyntaxError, ValueError, EOFError, IndexError, struct.error, zlib.error)

def open_image(path: str | os.PathLike) -> PIL.Image.Image:  # noqa: F821
    """The image file at `path`, opened (its header read, not its pixels): decoded by joined()."""
    from PIL import Image

    from ..formats.validate import regular_file

    path = regular_file(path, "image")
    with _pil_errors(path, "not an image the upsampler can read ({e}); give a PNG, JPEG or WebP file that opens in "
                           "an image viewer."), warnings.catch_warnings():
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # joined() bounds the size it decodes
        return Image.open(path)


@contextlib.contextmanager
def _pil_errors(name: str, unreadable: str):
    """PIL's errors as the pack's: a decompression bomb is an image over the bound; anything else of UNREADABLE is
    `unreadable` (its {e} the error) about `name`."""
    from PIL import Image

    try:
        yield
    except Image.DecompressionBombError as e:
        raise InputError(f"{name}: {e}; the upsampler decodes at most {MAX_DECODED_PIXELS} pixels of an image. "
                         "Scale it down.") from None
    except UNREADABLE as e:
        raise CorruptFileError(f"{name}: " + unreadable.format(e=e)) from None


def _name(image) -> str:
    return str(getattr(image, "filename", "") or "a reference image")


def _decoded(image, share: tuple[float, float]) -> PIL.Image.Image:  # noqa: F821
    """One image decoded and reduced for its `share` of the capped joined image (its size there, in pixels)."""

    gap = REDUCING_GAP
    if share[0] * gap < image.width and share[1] * gap < image.height:  # a JPEG decodes at 1/2, 1/4 or 1/8
        image.draft("RGB", (math.ceil(share[0] * gap), math.ceil(share[1] * gap)))
    if image.width * image.height > MAX_DECODED_PIXELS:
        raise InputError(f"{_name(image)} is {image.width}x{image.height} pixels; the upsampler decodes at most "
                         f"{MAX_DECODED_PIXELS} pixels of an image as decoded (about 9459x9459; a large JPEG "
                         "decodes at 1/2 to 1/8 of its size). Scale it down: the model sees at most 768x768 pixels "
                         "of all the images together.")
    with _pil_errors(_name(image), "the image cannot be decoded ({e}); it is damaged or truncated. Save it again, "
                                   "or give another file."):
        image.load()
        if image.mode not in REDUCIBLE_MODES:
            image = image.convert("RGB")
        factor = int(min(image.width / share[0], image.height / share[1]) // gap)
        if factor >= 2:
            image = image.reduce(factor)
        return image.convert("RGB")


def joined(images: list) -> PIL.Image.Image:  # noqa: F821
    """The reference's one image of several (PIL images, opened or decoded): side by side on white, centred
    vertically, its area capped at MAX_PIXELS. Each is decoded in turn, at the size its share of the cap needs."""
    from PIL import Image

    for image in images:
        if image.width < 1 or image.height < 1:
            raise InputError(f"{_name(image)} is {image.width}x{image.height} pixels; an image has at least one "
                             "pixel a side.")
    width, height = sum(im.width for im in images), max(im.height for im in images)
    scale = min(1.0, math.sqrt(MAX_PIXELS / (width * height)))
    size = (int(width * scale), int(height * scale))
    if min(size) < 1:
        raise InputError(f"The reference images, joined side by side, are {width}x{height} pixels: scaled to the "
                         f"model's {MAX_PIXELS} pixels, one side is under one pixel. Give images less long and thin.")
    images = [_decoded(im, (im.width * scale, im.height * scale)) for im in images]
    if len(images) == 1:
        image = images[0]
    else:
        image = Image.new("RGB", (sum(im.width for im in images), max(im.height for im in images)), BACKGROUND)
        x = 0
        for im in images:
            image.paste(im, (x, (image.height - im.height) // 2))
            x += im.width
    if scale < 1:
        image = image.resize(size, Image.Resampling.LANCZOS)
    return image


def reference_image(images: list) -> PIL.Image.Image:  # noqa: F821
    """The reference images (image files' paths or PIL images) joined into the one image the model sees: each
    file opened, then decoded in turn; the pack's error for a file that is no image, damaged or too large."""
    with contextlib.ExitStack() as opened:
        return joined([opened.enter_context(open_image(i)) if isinstance(i, (str, os.PathLike)) else i
                       for i in images])
