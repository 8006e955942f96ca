"""'comfy' padding means ComfyUI's own tokens: the pack's ids equal those of the running host's own FLUX.2
tokenizer, built from the same vocabulary, for the whole prompt corpus and for the host's prompt syntax."""

from __future__ import annotations

import json

import pytest

from helpers import host_flux2_tokenizer
from test_tokenizers import V3_NAMES, _v7_tekken, corpus_prompts

pytestmark = pytest.mark.transformers_matrix

# What the host's prompt tokenizer treats apart: its weight-syntax escapes, its embedding syntax, markers.
HOST_SYNTAX = [
    "a [IMG] b", "[IMG][IMG]", "x \\(y\\) z", "\\\\(", "(cat:1.2) and (dog)", "a embedding:foo bar", "embedding:x",
    "tab\tembedding:y", "[INST] hi [/INST] <s> <pad>", "{} {0} braces", "",
]


def test_comfy_padding_gives_the_hosts_own_ids(comfy_host, tiny_root):
    """The pack's CLIP on a tiny encoder (the bundled vocabulary) against the host's own FLUX.2 tokenizer built
    from the same vocabulary, as ComfyUI's single files embed it (with its special-token list)."""
    from comfyui_flux2dev.host.clip import load_clip

    host = host_flux2_tokenizer(json.dumps(_v7_tekken(V3_NAMES)).encode())
    clip = load_clip(str(tiny_root / "text_encoders/mistral_3_small_flux2_bf16.safetensors"), padding="comfy")
    for prompt in corpus_prompts() + HOST_SYNTAX:
        want = [t[0] for t in host.tokenize_with_weights(prompt)["mistral3_24b"][0]]
        assert [t[0] for t in clip.tokenize(prompt)["mistral3_24b"][0]] == want, prompt


def test_without_a_host_comfy_padding_follows_current_releases(comfy_host):
    """The command line has no host to ask: its comfy ids follow the prompt syntax of current releases, the
    same pieces the running host makes where it is one of them."""
    import inspect

    import comfy.sd1_clip

    from comfyui_flux2dev.host.compat import prompt_pieces
    from comfyui_flux2dev.tokenizers.prompt import comfy_pieces

    pieces = prompt_pieces()
    if pieces is None or "disable_weights" not in inspect.signature(comfy.sd1_clip.SDTokenizer).parameters:
        pytest.skip("this ComfyUI predates the current prompt syntax (0.33)")
    for prompt in corpus_prompts() + HOST_SYNTAX:
        assert comfy_pieces(prompt) == pieces(prompt), prompt
