"""Independent references for the tiny encoders' weights: each file read by safetensors or gguf-py and its packed
weights expanded by code other than the pack's (the scale multiplied in for fp8, comfy_kitchen for NVFP4, gguf's
numpy dequantizer and a rotary un-permute of its own for GGUF), in transformers' MistralForCausalLM names."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from comfyui_flux2dev.devtools.tiny import encoders as tiny

# Where the language model's tensors are stored in the tiny files -> transformers' MistralForCausalLM names.
STORED_PREFIXES = {"model.language_model.": "model.", "language_model.model.": "model.",
                   "language_model.lm_head.": "lm_head.", "model.": "model.", "lm_head.": "lm_head."}


def _safetensors(path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    path = Path(path)
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
    return {k: v for f in files for k, v in load_file(f).items()}


def _dequantized(path, dequantize) -> dict[str, torch.Tensor]:
    """The language model's weights of a safetensors file or folder, each through `dequantize(weight, companions by
    suffix)`."""
    sd = _safetensors(path)
    out = {}
    for k, v in sd.items():
        prefix = next((p for p in STORED_PREFIXES if k.startswith(p)), None)
        if prefix is None or not k.endswith(".weight") or ".vision_tower." in k or "multi_modal_projector" in k:
            continue
        stem = k[: -len("weight")]
        companions = {name[len(stem):]: t for name, t in sd.items() if name.startswith(stem) and name != k}
        out[STORED_PREFIXES[prefix] + k[len(prefix):]] = dequantize(v, companions).float()
    return out


def fp8_weights(path) -> dict[str, torch.Tensor]:
    def dequantize(weight, companions):
        scale = companions.get("weight_scale", companions.get("scale_weight"))
        if scale is None:
            return weight
        return weight.float() * (scale.float().reshape(-1, 1) if scale.numel() > 1 else scale.float())

    return _dequantized(path, dequantize)


def nvfp4_weights(path) -> dict[str, torch.Tensor]:
    from comfy_kitchen.backends.eager.quantization import dequantize_nvfp4

    def dequantize(weight, companions):
        if weight.dtype != torch.uint8:
            return weight
        return dequantize_nvfp4(weight, companions["weight_scale_2"], companions["weight_scale"],
                                output_type=torch.float32)

    return _dequantized(path, dequantize)


def gguf_weights(path) -> dict[str, torch.Tensor]:
    """A GGUF file's weights through gguf-py's numpy dequantizer (the raw blocks as the pack's reader hands them out,
    checked against gguf-py's own reader in tests/formats: gguf-py's reader takes seconds over the vocabulary),
    llama.cpp's interleaved Q/K rows put back in HF order here."""
    import gguf

    from comfyui_flux2dev.loaders.formats.gguf_file import open_gguf

    names = tiny.gguf_names()
    hf_names = {names.get_name(k, try_suffixes=(".weight",)): k for k in tiny.base_model()}
    heads = {"self_attn.q_proj": tiny.TINY_MISTRAL.heads, "self_attn.k_proj": tiny.TINY_MISTRAL.kv_heads}
    out = {}
    with open_gguf(str(path)) as g:
        for name, t in g.tensors.items():
            key = hf_names.get(name)
            if key is None:
                continue
            raw = t.data.numpy().reshape(-1, gguf.GGML_QUANT_SIZES[t.qtype][1])
            w = torch.from_numpy(gguf.quants.dequantize(raw, t.qtype).astype(np.float32).reshape(t.shape))
            module = key.split(".", 3)[-1][: -len(".weight")] if key.startswith("model.layers.") else ""
            if g.architecture in ("llama", "mistral3") and module in heads:
                h, rows = heads[module], w.shape[0]
                w = w.reshape(h, rows // h // 2, 2, -1).transpose(1, 2).reshape(rows, -1)
            out[key] = w
    return out


# format family (the tiny encoder table's format word before "-") -> the file's weights, independently expanded
WEIGHTS = {"fp8": fp8_weights, "nvfp4": nvfp4_weights, "gguf": gguf_weights}
