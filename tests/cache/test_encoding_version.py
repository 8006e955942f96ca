"""The versions in loaders/cache/keys.py stand for what a cache key does not hold otherwise: ENCODING_VERSION for
the encoding math (the template and its mask, the host encoder's masking of left pads), GENERATION_VERSION for
what decides an upsampled prompt. A change to that code without a new version would serve old entries, made the
old way, as if they were new: this test holds the digest of the code per version, so such a change fails here
until the version is raised."""

from __future__ import annotations

import ast
import hashlib
import inspect
import json
import textwrap

import pytest

from comfyui_flux2dev.host import clip_model, upsampler
from comfyui_flux2dev.loaders.cache.keys import ENCODING_VERSION, GENERATION_VERSION
from comfyui_flux2dev.loaders.upsampler import images, language_model, vision
from comfyui_flux2dev.tokenizers import chat, prompt

# One row per version in loaders/cache/keys.py: what it stands for, the code it guards (functions and classes:
# their code, docstrings and comments aside), the constants it guards (values), and the digest of that code per
# version. When a test fails after an intended change: raise the version and add its digest (the failure prints it).
GUARDS = {
    "ENCODING_VERSION": dict(
        version=ENCODING_VERSION,
        means="the encoding math",
        code=(prompt.prompt_ids, prompt.left_padding_mask, prompt.comfy_pieces, clip_model.encoder_model_class,
              clip_model.compute_dtype, clip_model.model_config),
        values={"SYSTEM_PROMPT": prompt.SYSTEM_PROMPT, "TEMPLATE_MARKERS": prompt.TEMPLATE_MARKERS,
                "MAX_LENGTH": prompt.MAX_LENGTH, "IMAGE_MARKER": prompt.IMAGE_MARKER,
                "COMFY_TEMPLATE": prompt.COMFY_TEMPLATE, "PADDING_MODES": prompt.PADDING_MODES},
        digests={2: "a79fd24e36022271d3fac43a19baf18502a39026728c11fb4e00e5df5410571e",
                 3: "d755f440d488ff22966b6a3a0f363c51d9ce557134f0edd46057ba674664a088",
                 4: "3bc7f3a39bedcc3835b2b1d04a5c42cbd9f3d186a934cc26c5f3930dd75aa6b9"},
    ),
    # What decides an upsampled prompt beyond its key: the chat layout, the images as the model sees them, the
    # decoder's math, sampling and decoding.
    "GENERATION_VERSION": dict(
        version=GENERATION_VERSION,
        means="what decides an upsampled prompt",
        code=(chat.chat_ids, chat.image_ids, chat.reply_text, images.joined, vision.prepare, vision.VisionEncoder,
              language_model.RMSNorm, language_model._rotate_half, language_model.KVCache, language_model.Attention,
              language_model.MLP, language_model.DecoderLayer, language_model.MistralLM, language_model.Sampling,
              language_model.generate, upsampler._run),
        values={"SYSTEM_MESSAGES": chat.SYSTEM_MESSAGES, "CHAT_MARKERS": chat.CHAT_MARKERS,
                "MAX_CHAT_TOKENS": chat.MAX_CHAT_TOKENS, "MAX_PIXELS": images.MAX_PIXELS,
                "IMAGE_MEAN": vision.IMAGE_MEAN, "IMAGE_STD": vision.IMAGE_STD},
        digests={1: "626f220d2ed1361c3b68d1f12144261a6bf18cb9710f87e4e8e94849b40933a4",
                 2: "2582e41f58120e2b1db86d18e15689269525a54d89fca93a7cbae71de2972100"},
    ),
}


def code_digest(source: str) -> str:
    """The digest of a function's or class's code: its syntax tree without docstrings and type annotations, so
    comments, docstrings, annotations and layout may change freely (a field's annotation is kept as a mark: the
    field is there)."""
    tree = ast.parse(textwrap.dedent(source))
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            node.returns = None
        elif isinstance(node, ast.arg):
            node.annotation = None
        elif isinstance(node, ast.AnnAssign):
            node.annotation = ast.Constant("annotated")
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) \
                and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
            node.body = body[1:] or [ast.Pass()]
    return hashlib.sha256(ast.dump(tree).encode()).hexdigest()


def guarded_digest(code, values) -> str:
    h = hashlib.sha256()
    for item in code:
        h.update(code_digest(inspect.getsource(item)).encode())
    h.update(json.dumps(values, sort_keys=True, default=list).encode())
    return h.hexdigest()


@pytest.mark.parametrize("name", GUARDS)
def test_the_guarded_code_is_the_one_its_version_was_recorded_with(name):
    guard = GUARDS[name]
    digest = guarded_digest(guard["code"], guard["values"])
    assert guard["digests"].get(guard["version"]) == digest, (
        f"The code {name} {guard['version']} guards changed (digest now {digest}). If {guard['means']} changed, "
        f"raise {name} in loaders/cache/keys.py and record its digest in GUARDS; old cache entries then miss, as "
        "they must."
    )


def test_the_digest_sees_a_change_of_code_but_not_of_comments_or_docstrings():
    source = inspect.getsource(prompt.left_padding_mask)
    commented = source.replace("    ids = [int(t) for t in ids]", "    # a comment\n    ids = [int(t) for t in ids]")
    redocumented = source.replace("1 for real tokens", "One for each real token")
    changed = source.replace("[0] * pads", "[1] * pads")
    assert len({source, commented, redocumented, changed}) == 4
    assert code_digest(commented) == code_digest(redocumented) == code_digest(source) != code_digest(changed)
