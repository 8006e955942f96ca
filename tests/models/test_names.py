"""The tensor names the encoder loader and the tiny writers use, checked against sources of their own:
transformers' MistralForCausalLM (the host's names) and gguf-py's tensor name map, which knows llama.cpp's
names and Mistral's native ones (layers.N.attention.wq, feed_forward.w1, ...) side by side."""

from __future__ import annotations

import os

import pytest
import torch
from gguf import MODEL_ARCH
from gguf.tensor_mapping import get_tensor_name_map

from comfyui_flux2dev.devtools.tiny import encoders as tiny
from comfyui_flux2dev.loaders.models import encoder_identify, encoder_layouts, kinds

LAYERS = 40
GGUF_NAMES = get_tensor_name_map(MODEL_ARCH.LLAMA, LAYERS)


def llama_cpp(name: str) -> str | None:
    return GGUF_NAMES.get_name(name, try_suffixes=(".weight",))


@pytest.fixture(scope="module")
def mistral_keys() -> list[str]:
    """MistralForCausalLM's own state-dict keys for a small config (meta tensors: no memory)."""
    from transformers import MistralConfig, MistralForCausalLM

    config = MistralConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                           num_attention_heads=2, num_key_value_heads=1, head_dim=8)
    with torch.device("meta"):
        return list(MistralForCausalLM(config).state_dict())


def stored_names(scheme: encoder_layouts.KeyScheme, layer: int = 1) -> dict[str, str]:
    """{stored name: the host name the loader gives it} for the embedding and one layer of a scheme."""
    names = [f"{scheme.prefixes[-1]}{scheme.embed}.weight"]
    names += [f"{scheme.prefixes[-1]}{scheme.layer_word}.{layer}.{part}.weight" for part in scheme.parts]
    return {name: encoder_identify.host_name(name, scheme)[0] for name in names}


def test_host_names_are_mistral_for_causal_lm_keys(mistral_keys):
    hosted = set(stored_names(encoder_layouts.HF_SCHEME).values())
    expected = {k for k in mistral_keys if k.startswith(("model.embed_tokens.", "model.layers.1."))}
    assert hosted == expected
    assert encoder_identify.EMBED in mistral_keys
    assert {f"model.layers.0.{part}.weight" for part in encoder_identify.LAYER_SHAPES} <= set(mistral_keys)


# scheme -> its stored names in llama.cpp's words: gguf-py translates native names; GGUF names are them.
IN_LLAMA_CPP_WORDS = {"NATIVE_SCHEME": llama_cpp, "GGUF_SCHEME": lambda name: name}


@pytest.mark.parametrize("scheme", sorted(IN_LLAMA_CPP_WORDS))
def test_each_stored_name_is_what_gguf_py_says_the_host_name_is(scheme):
    """gguf-py maps Mistral-native and transformers names to llama.cpp's: a stored name and the host name
    the loader gives it must land on the same one (a w1/w3 swap would not)."""
    for stored, host in stored_names(getattr(encoder_layouts, scheme)).items():
        assert llama_cpp(host) is not None and IN_LLAMA_CPP_WORDS[scheme](stored) == llama_cpp(host), (stored, host)


def test_the_tiny_native_file_uses_mistral_names(tiny_root):
    from safetensors import safe_open

    with safe_open(str(tiny_root / "text_encoders/native/consolidated.safetensors"), "pt") as f:
        stored = set(f.keys())
    by_llama_cpp = {llama_cpp(k): k for k in tiny.base_model()}
    assert {by_llama_cpp[llama_cpp(name)] for name in stored} == set(tiny.base_model())
    assert all(name.startswith(("layers.", "tok_embeddings.", "norm.", "output.")) for name in stored)


@pytest.mark.parametrize("name", sorted(tiny.GGUF_FILES))
def test_the_tiny_gguf_files_use_llama_cpp_names(tiny_root, name):
    import gguf

    reader = gguf.GGUFReader(str(tiny_root / "text_encoders" / name))
    stored = {t.name for t in reader.tensors} - {"tekken_model"}
    known = {llama_cpp(k) for k in tiny.base_model()}
    assert stored <= known and "blk.0.ffn_gate.weight" in stored and "token_embd.weight" in stored


def test_every_encoder_gguf_architecture_has_one_layout():
    gguf_layouts = {layout.name for layout in encoder_layouts.LAYOUTS if layout.name.startswith("gguf-")}
    assert gguf_layouts == {f"gguf-{arch}" for arch in kinds.gguf_architectures("encoder")}


def test_layout_names_are_unique_and_every_tiny_layout_is_a_row(tiny_manifest):
    names = [layout.name for layout in encoder_layouts.LAYOUTS]
    assert len(names) == len(set(names))
    written = {e["layout"] for e in tiny_manifest if e["kind"] == "encoder"}
    assert written | {"diffusers-pipeline"} == set(names)


def test_the_tiny_encoders_folder_holds_one_file_or_folder_per_manifest_entry(tiny_root, tiny_manifest):
    entries = {e["path"].removeprefix("text_encoders/") for e in tiny_manifest if e["kind"] == "encoder"}
    assert entries == set(os.listdir(tiny_root / "text_encoders"))


# Each scheme's stored names of the final norm and the output head, as the files that carry them store them.
HEAD_NAMES = {
    "HF_SCHEME": ("model.language_model.norm.weight", "language_model.model.norm.weight", "model.norm.weight",
                  "lm_head.weight", "language_model.lm_head.weight"),
    "NATIVE_SCHEME": ("norm.weight", "output.weight"),
    "GGUF_SCHEME": ("output_norm.weight", "output.weight"),
}


@pytest.mark.parametrize("scheme", sorted(HEAD_NAMES))
def test_the_final_norm_and_output_head_are_named_as_transformers_and_gguf_py_name_them(mistral_keys, scheme):
    """What text generation reads beyond the encoder's layers: the host names are MistralForCausalLM's, and for
    Mistral-native and llama.cpp names gguf-py agrees on which stored name is which."""
    for stored in HEAD_NAMES[scheme]:
        host, layer = encoder_identify.host_name(stored, getattr(encoder_layouts, scheme))
        assert host in mistral_keys and host in ("model.norm.weight", "lm_head.weight") and layer is None, stored
        if scheme in IN_LLAMA_CPP_WORDS:
            assert IN_LLAMA_CPP_WORDS[scheme](stored) == llama_cpp(host), (stored, host)
