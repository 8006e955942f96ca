"""The tiny encoder files are what they claim, read by independent libraries (transformers, gguf, safetensors)."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from comfyui_flux2dev.devtools.tiny import encoders as tiny
from comfyui_flux2dev.tokenizers import bundled_tekken_path


@pytest.fixture(scope="module")
def root(tiny_root, tiny_manifest):
    encoders = [e for e in tiny_manifest if e["kind"] == "encoder"]
    assert encoders and all(e["variant"] == "dev" for e in encoders)
    assert all((tiny_root / e["path"]).exists() for e in encoders)
    return str(tiny_root / "text_encoders")


@pytest.mark.transformers_matrix
@pytest.mark.parametrize("name", ["hf-mistral3", "hf-mistral3-old-prefix"])
def test_hf_folders_load_in_transformers_with_every_weight(root, name):
    from transformers import Mistral3ForConditionalGeneration

    model = Mistral3ForConditionalGeneration.from_pretrained(os.path.join(root, name))
    assert model.config.text_config.num_hidden_layers == 40 and model.config.model_type == "mistral3"
    lm = model.model.language_model
    base = tiny.base_model()
    assert torch.equal(lm.layers[39].mlp.up_proj.weight.to(torch.bfloat16), base["model.layers.39.mlp.up_proj.weight"])
    assert torch.equal(model.lm_head.weight.to(torch.bfloat16), base["lm_head.weight"])
    index = json.load(open(os.path.join(root, name, "model.safetensors.index.json")))
    assert len(set(index["weight_map"].values())) == 2


def _is_the_real_tekken_as_comfyui_embeds_it(data: bytes) -> bool:
    """mistral-common's tekken.json with the special_tokens list ComfyUI's tokenizer reads (the bundled one has
    none)."""
    doc = json.loads(data)
    listed = doc.pop("special_tokens")
    return doc == json.loads(bundled_tekken_path().read_bytes()) and len(listed) == 1000 and \
        [t["token_str"] for t in listed[:4]] == ["<unk>", "<s>", "</s>", "[INST]"] and \
        [t["rank"] for t in listed] == list(range(1000))


def test_single_files_hold_30_layers_and_the_real_tekken(root):
    from safetensors import safe_open

    with safe_open(os.path.join(root, "mistral_3_small_flux2_bf16.safetensors"), "pt") as f:
        keys = set(f.keys())
        assert _is_the_real_tekken_as_comfyui_embeds_it(bytes(f.get_tensor("tekken_model").numpy()))
    assert {int(k.split(".")[2]) for k in keys if k.startswith("model.layers.")} == set(range(30))
    with safe_open(os.path.join(root, "mistral_3_small_flux2_fp8.safetensors"), "pt") as f:
        assert f.get_tensor("model.layers.0.self_attn.q_proj.weight").dtype == torch.float8_e4m3fn
        assert f.get_tensor("model.layers.0.self_attn.q_proj.scale_weight").numel() == 1
    with safe_open(os.path.join(root, "mistral_3_small_flux2_fp8_channel.safetensors"), "pt") as f:
        assert f.get_tensor("model.layers.0.self_attn.q_proj.weight_scale").shape == (256, 1)
    with safe_open(os.path.join(root, "mistral_3_small_flux2_fp4_mixed.safetensors"), "pt") as f:
        assert f.get_tensor("model.layers.1.self_attn.q_proj.weight").shape == (256, 32)
        assert f.get_tensor("model.layers.1.self_attn.q_proj.weight_scale").dtype == torch.float8_e4m3fn
        assert f.get_tensor("model.layers.1.self_attn.q_proj.weight_scale_2").dtype == torch.float32


def test_native_file_holds_interleaved_rotary_rows(root):
    from safetensors.torch import load_file

    sd = load_file(os.path.join(root, "native", "consolidated.safetensors"))
    params = json.load(open(os.path.join(root, "native", "params.json")))
    hf = tiny.base_model()["model.layers.0.self_attn.q_proj.weight"]
    wq = sd["layers.0.attention.wq.weight"]
    h = params["n_heads"]
    # transformers' convert_mistral_weights_to_hf permute: interleaved -> half split
    assert torch.equal(wq.view(h, wq.shape[0] // h // 2, 2, -1).transpose(1, 2).reshape(wq.shape), hf)
    assert not torch.equal(wq, hf) and params["rope_theta"] == 1e9


@pytest.mark.parametrize("name", sorted(tiny.GGUF_FILES))
def test_gguf_files_read_with_gguf_py(root, name):
    import gguf

    arch, linear, embed, _, has_tokenizer = tiny.GGUF_FILES[name]
    reader = gguf.GGUFReader(os.path.join(root, name))
    field = lambda key: reader.fields[key].parts[-1]  # noqa: E731
    assert bytes(field("general.architecture")).decode() == arch
    assert int(field(f"{arch}.attention.head_count")[0]) == 2 and float(field(f"{arch}.rope.freq_base")[0]) == 1e9
    tensors = {t.name: t for t in reader.tensors}
    # K-quant blocks hold 256 inputs: at the tiny width only attn_output (256 inputs) can be one
    quantized = "blk.0.attn_output.weight" if linear.endswith("_K") else "blk.0.attn_q.weight"
    assert tensors[quantized].tensor_type.name == linear
    assert tensors["token_embd.weight"].tensor_type.name == embed
    assert ("tokenizer.ggml.tokens" in reader.fields) == has_tokenizer
    if has_tokenizer:
        tokens = reader.fields["tokenizer.ggml.tokens"]
        assert len(tokens.data) == 131072 and bytes(tokens.parts[tokens.data[1]]).decode() == "<s>"
    else:
        values = np.array(tensors["tekken_model"].data, dtype=np.float16).astype(np.uint8).tobytes()
        assert _is_the_real_tekken_as_comfyui_embeds_it(values)
