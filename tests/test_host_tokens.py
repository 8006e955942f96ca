"""'comfy' padding means ComfyUI's own tokens: the pack's ids equal those of the running host's own FLUX.2
tokenizer, built from the same vocabulary, for the whole prompt corpus and for the host's prompt syntax."""

from __future__ import annotations

import json

import pytest
from test_tokenizers import V3_NAMES, _v7_tekken, corpus_prompts

from comfyui_flux2dev.tokenizers import Flux2Tokenizer, parse_tekken_json, prompt_ids

pytestmark = pytest.mark.transformers_matrix

# What the host's prompt tokenizer treats apart: its weight-syntax escapes, its embedding syntax, markers.
HOST_SYNTAX = [
    "a [IMG] b", "[IMG][IMG]", "x \\(y\\) z", "\\\\(", "(cat:1.2) and (dog)", "a embedding:foo bar", "embedding:x",
    "tab\tembedding:y", "[INST] hi [/INST] <s> <pad>", "{} {0} braces", "",
]


def test_comfy_padding_gives_the_hosts_own_ids(comfy_host):
    import comfy.text_encoders.flux
    import transformers

    # ComfyUI's FLUX.2 files embed a tekken file that lists its special tokens; the host needs the list.
    tekken = json.dumps(_v7_tekken(V3_NAMES)).encode()
    try:
        host = comfy.text_encoders.flux.Flux2Tokenizer(tokenizer_data={"tekken_model": tekken})
    except TypeError as e:
        if "vocab_file" not in str(e):
            raise
        pytest.skip(f"this ComfyUI's own FLUX.2 tokenizer does not build under transformers {transformers.__version__} ({e})")
    pack = Flux2Tokenizer(parse_tekken_json(tekken))
    for prompt in corpus_prompts() + HOST_SYNTAX:
        want = [t[0] for t in host.tokenize_with_weights(prompt)["mistral3_24b"][0]]
        assert prompt_ids(pack, prompt, "comfy") == (want, [1] * len(want)), prompt
