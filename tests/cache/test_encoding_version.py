"""ENCODING_VERSION (loaders/cache/keys.py) stands for the encoding math the conditioning cache's key does not
hold otherwise: the template and its mask, and the host encoder's masking of left pads. A change to that code
without a new version would serve old entries, encoded the old way, as if they were new: this test holds the
digest of the code per version, so such a change fails here until the version is raised."""

from __future__ import annotations

import ast
import hashlib
import inspect
import json
import textwrap

from comfyui_flux2dev.host import clip_model, upsampler
from comfyui_flux2dev.loaders.cache.keys import ENCODING_VERSION, GENERATION_VERSION
from comfyui_flux2dev.loaders.models import language_model, vision
from comfyui_flux2dev.tokenizers import chat, prompt

# The code the version guards: functions (their code, docstrings and comments aside) and constants (values).
GUARDED_CODE = (prompt.prompt_ids, prompt.left_padding_mask, prompt.comfy_pieces, clip_model.encoder_model_class,
                clip_model.compute_dtype, clip_model.model_config)
GUARDED_VALUES = {"SYSTEM_PROMPT": prompt.SYSTEM_PROMPT, "TEMPLATE_MARKERS": prompt.TEMPLATE_MARKERS,
                  "MAX_LENGTH": prompt.MAX_LENGTH, "IMAGE_MARKER": prompt.IMAGE_MARKER,
                  "COMFY_TEMPLATE": prompt.COMFY_TEMPLATE, "PADDING_MODES": prompt.PADDING_MODES}
# ENCODING_VERSION -> the digest of the guarded code at that version. When the test fails after an intended
# change of the encoding math: raise ENCODING_VERSION and add its digest here (the failure prints it).
DIGESTS = {
    2: "e929a3e737940548ddf67f7f92acc460dd144bb4a0cb7e6f102209a5430cc714",
}


# GENERATION_VERSION stands for what decides an upsampled prompt beyond its key: the chat layout, the images as the
# model sees them, the decoder's math, sampling and decoding.
GENERATION_CODE = (chat.chat_ids, chat.image_ids, chat.reply_text, vision.joined, vision.prepare, vision.VisionEncoder,
                   language_model.RMSNorm, language_model._rotate_half, language_model.KVCache, language_model.Attention,
                   language_model.MLP, language_model.DecoderLayer, language_model.MistralLM, language_model.Sampling,
                   language_model.generate, upsampler._run)
GENERATION_VALUES = {"SYSTEM_MESSAGES": chat.SYSTEM_MESSAGES, "CHAT_MARKERS": chat.CHAT_MARKERS,
                     "MAX_CHAT_TOKENS": chat.MAX_CHAT_TOKENS, "MAX_PIXELS": vision.MAX_PIXELS,
                     "IMAGE_MEAN": vision.IMAGE_MEAN, "IMAGE_STD": vision.IMAGE_STD}
GENERATION_DIGESTS = {
    1: "626f220d2ed1361c3b68d1f12144261a6bf18cb9710f87e4e8e94849b40933a4",
}


def code_digest(source: str) -> str:
    """The digest of a function's or class's code: its syntax tree without docstrings, so comments, docstrings
    and layout may change freely."""
    tree = ast.parse(textwrap.dedent(source))
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                and isinstance(body[0].value.value, str):
            node.body = body[1:] or [ast.Pass()]
    return hashlib.sha256(ast.dump(tree).encode()).hexdigest()


def guarded_digest(code=GUARDED_CODE, values=GUARDED_VALUES) -> str:
    h = hashlib.sha256()
    for item in code:
        h.update(code_digest(inspect.getsource(item)).encode())
    h.update(json.dumps(values, sort_keys=True, default=list).encode())
    return h.hexdigest()


def test_the_encoding_math_is_the_one_its_version_was_recorded_with():
    digest = guarded_digest()
    assert DIGESTS.get(ENCODING_VERSION) == digest, (
        f"The code ENCODING_VERSION {ENCODING_VERSION} guards changed (digest now {digest}). If the encoding math "
        "changed, raise ENCODING_VERSION in loaders/cache/keys.py and record its digest in DIGESTS; old cache "
        "entries then miss, as they must."
    )


def test_the_generation_is_the_one_its_version_was_recorded_with():
    digest = guarded_digest(GENERATION_CODE, GENERATION_VALUES)
    assert GENERATION_DIGESTS.get(GENERATION_VERSION) == digest, (
        f"The code GENERATION_VERSION {GENERATION_VERSION} guards changed (digest now {digest}). If what decides an "
        "upsampled prompt changed, raise GENERATION_VERSION in loaders/cache/keys.py and record its digest in "
        "GENERATION_DIGESTS; old upsampled prompts then miss, as they must."
    )


def test_the_digest_sees_a_change_of_code_but_not_of_comments_or_docstrings():
    source = inspect.getsource(prompt.left_padding_mask)
    commented = source.replace("    ids = [int(t) for t in ids]", "    # a comment\n    ids = [int(t) for t in ids]")
    redocumented = source.replace("1 for real tokens", "One for each real token")
    changed = source.replace("[0] * pads", "[1] * pads")
    assert len({source, commented, redocumented, changed}) == 4
    assert code_digest(commented) == code_digest(redocumented) == code_digest(source) != code_digest(changed)
