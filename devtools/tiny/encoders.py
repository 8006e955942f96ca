"""Deterministic tiny FLUX.2 [dev] text encoders in every layout users have.

Every file holds the same seeded model (TINY_MISTRAL geometry: real vocabulary size and layer counts, tiny
width), so one transformers reference serves all bf16 layouts; quantized files hold that model quantized.
The tokenizer data is the real Mistral-Small vocabulary shipped with mistral-common."""

from __future__ import annotations

import functools
import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from ...tokenizers.ladder import bundled_tekken_path
from .geometry import TINY_MISTRAL
from .gguf_blocks import write_and_close

SEED = 20251125
LAYERS = TINY_MISTRAL.layers[-1]  # the full model; pruned files keep the first 30
PRUNED = TINY_MISTRAL.layers[0]
PARTS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
MODULE = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
          "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
# Mistral's native (consolidated.safetensors) names of the HF names, in Mistral's reference implementation's
# words; the tests check them against gguf-py's name map, which knows both. GGUF names come from gguf-py.
NATIVE = {"model.embed_tokens": "tok_embeddings", "model.norm": "norm", "lm_head": "output",
          "self_attn.q_proj": "attention.wq", "self_attn.k_proj": "attention.wk", "self_attn.v_proj": "attention.wv",
          "self_attn.o_proj": "attention.wo", "mlp.gate_proj": "feed_forward.w1", "mlp.up_proj": "feed_forward.w3",
          "mlp.down_proj": "feed_forward.w2", "input_layernorm": "attention_norm",
          "post_attention_layernorm": "ffn_norm"}
VISION = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=1, head_dim=16,
              image_size=128, patch_size=16, num_channels=3)


@functools.lru_cache(maxsize=1)
def tekken_data() -> bytes:
    return bundled_tekken_path().read_bytes()


@functools.lru_cache(maxsize=1)
def embedded_tekken_data() -> bytes:
    """tekken.json as ComfyUI's encoder files embed it (tekken_model): with the special_tokens list ComfyUI's own
    tokenizer reads, which mistral-common's bundled v3 file leaves out (the list is mistral-common's reading of it)."""
    from mistral_common.tokens.tokenizers.tekken import Tekkenizer

    tekkenizer = Tekkenizer.from_file(str(bundled_tekken_path()))
    doc = json.loads(tekken_data())
    doc["special_tokens"] = [{"rank": i, "token_str": tekkenizer.id_to_piece(i), "is_control": True}
                             for i in range(tekkenizer.num_special_tokens)]
    return json.dumps(doc).encode()


def tekken_tensor() -> torch.Tensor:
    """embedded_tekken_data as the tekken_model tensor of a safetensors file."""
    return torch.frombuffer(bytearray(embedded_tekken_data()), dtype=torch.uint8)


def _shapes(layers: int) -> dict[str, tuple[int, ...]]:
    g = TINY_MISTRAL
    out = {"model.embed_tokens.weight": (g.vocab, g.width)}
    rows = {"q_proj": (g.heads * g.head_dim, g.width), "k_proj": (g.kv_heads * g.head_dim, g.width),
            "v_proj": (g.kv_heads * g.head_dim, g.width), "o_proj": (g.width, g.heads * g.head_dim),
            "gate_proj": (g.mlp, g.width), "up_proj": (g.mlp, g.width), "down_proj": (g.width, g.mlp)}
    for i in range(layers):
        for part, shape in rows.items():
            out[f"model.layers.{i}.{MODULE[part]}.{part}.weight"] = shape
        out[f"model.layers.{i}.input_layernorm.weight"] = (g.width,)
        out[f"model.layers.{i}.post_attention_layernorm.weight"] = (g.width,)
    out["model.norm.weight"] = (g.width,)
    out["lm_head.weight"] = (g.vocab, g.width)
    return out


@functools.lru_cache(maxsize=1)
def base_model() -> dict[str, torch.Tensor]:
    """The tiny model in MistralForCausalLM keys, bf16, 40 layers with final norm and lm_head."""
    gen = torch.Generator().manual_seed(SEED)
    out = {}
    for name, shape in _shapes(LAYERS).items():
        if len(shape) == 1:  # norm weights near 1, so a mixed-up norm shows
            t = 1.0 + 0.2 * torch.randn(shape, generator=gen)
        elif "embed_tokens" in name or "lm_head" in name:
            t = 0.5 * torch.randn(shape, generator=gen)
        else:  # small enough that 30 layers keep hidden states O(1), so float32 parity can be checked at 1e-5
            t = 0.5 * torch.randn(shape, generator=gen) / shape[1] ** 0.5
        out[name] = t.to(torch.bfloat16)
    return out


def text_config(layers: int) -> dict:
    g = TINY_MISTRAL
    return {
        "model_type": "mistral", "vocab_size": g.vocab, "hidden_size": g.width, "intermediate_size": g.mlp,
        "num_hidden_layers": layers, "num_attention_heads": g.heads, "num_key_value_heads": g.kv_heads,
        "head_dim": g.head_dim, "hidden_act": "silu", "max_position_embeddings": 131072, "rms_norm_eps": g.rms_norm_eps,
        "rope_theta": g.rope_theta, "rope_parameters": {"rope_type": "default", "rope_theta": g.rope_theta},
        "tie_word_embeddings": False, "sliding_window": None, "bos_token_id": 1, "eos_token_id": 2,
    }


def mistral3_config(layers: int) -> dict:
    return {
        "architectures": ["Mistral3ForConditionalGeneration"], "model_type": "mistral3", "torch_dtype": "bfloat16",
        "text_config": text_config(layers), "vision_config": {"model_type": "pixtral", **VISION},
        "image_token_index": 10, "projector_hidden_act": "gelu", "vision_feature_layer": -1,
        "multimodal_projector_bias": False, "spatial_merge_size": 2, "tie_word_embeddings": False,
    }


@functools.lru_cache(maxsize=1)
def vision_weights() -> dict[str, torch.Tensor]:
    """Vision tower and projector weights, named relative to the Mistral3 model (shapes from transformers)."""
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    config = Mistral3Config(**{k: v for k, v in mistral3_config(1).items()
                               if k not in ("architectures", "torch_dtype")})
    with torch.device("meta"):
        model = Mistral3ForConditionalGeneration(config)
    gen = torch.Generator().manual_seed(SEED + 1)
    out = {}
    for part in ("vision_tower", "multi_modal_projector"):
        for name, t in sorted(getattr(model.model, part).state_dict().items()):
            out[f"{part}.{name}"] = (0.1 * torch.randn(tuple(t.shape), generator=gen)).to(torch.bfloat16)
    return out


def _save(tensors: dict[str, torch.Tensor], path: str, metadata: dict | None = None) -> None:
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in tensors.items()}, path, metadata=metadata)


def _pruned(model: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v for k, v in model.items() if not k.startswith(("lm_head", "model.norm")) and _layer(k) < PRUNED}


def _layer(key: str) -> int:
    parts = key.split(".")
    return int(parts[2]) if key.startswith("model.layers.") else -1


# --- layouts ---------------------------------------------------------------------------------------------

HF_PREFIXES = {
    # language-model prefix -> (vision prefix, lm_head name), as transformers saves them
    "model.language_model": ("model.", "lm_head.weight"),
    "language_model.model": ("", "language_model.lm_head.weight"),
}


def write_hf_mistral3(dir: str, *, layers: int = LAYERS, prefix: str = "model.language_model", shards: int = 2,
                      model: dict[str, torch.Tensor] | None = None) -> None:
    """A Mistral3ForConditionalGeneration folder (config.json, sharded safetensors + index), as on the hub; `model`:
    the language model's tensors in MistralForCausalLM keys (default: the tiny model in bf16)."""
    os.makedirs(dir, exist_ok=True)
    vision_prefix, lm_head = HF_PREFIXES[prefix]
    model = {k: v for k, v in (model or base_model()).items() if _layer(k) < layers}
    tensors = {}
    for k, v in model.items():
        tensors[lm_head if k.startswith("lm_head.") else prefix + k[len("model"):]] = v
    tensors.update({vision_prefix + k: v for k, v in vision_weights().items()})
    names = sorted(tensors)
    per = -(-len(names) // shards)
    weight_map = {}
    for s in range(shards):
        file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        chunk = names[s * per:(s + 1) * per]
        _save({k: tensors[k] for k in chunk}, os.path.join(dir, file), {"format": "pt"})
        weight_map.update({k: file for k in chunk})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    with open(os.path.join(dir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)
    with open(os.path.join(dir, "config.json"), "w") as f:
        json.dump(mistral3_config(layers), f, indent=1)


def write_tekken(dir: str) -> None:
    os.makedirs(dir, exist_ok=True)
    shutil.copyfile(bundled_tekken_path(), os.path.join(dir, "tekken.json"))


def write_tokenizer_folder(dir: str) -> None:
    """A diffusers pipeline's tokenizer/ folder: the HF tokenizer.json form, no preprocessor_config.json."""
    from ...tokenizers.canonical import build_backend
    from ...tokenizers.vocab import parse_tekken_json

    os.makedirs(dir, exist_ok=True)
    build_backend(parse_tekken_json(tekken_data())).save(os.path.join(dir, "tokenizer.json"))
    with open(os.path.join(dir, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "LlamaTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
                   "unk_token": "<unk>", "pad_token": "<pad>", "model_max_length": 131072}, f, indent=1)
    with open(os.path.join(dir, "processor_config.json"), "w") as f:
        json.dump({"processor_class": "PixtralProcessor", "image_token": "[IMG]"}, f, indent=1)


def write_standalone(dir: str) -> None:
    """BFL-style: config.json (mistral3) + model.safetensors + tekken.json, 30 layers."""
    os.makedirs(dir, exist_ok=True)
    model = _pruned(base_model())
    _save({"model.language_model" + k[len("model"):]: v for k, v in model.items()},
          os.path.join(dir, "model.safetensors"))
    with open(os.path.join(dir, "config.json"), "w") as f:
        json.dump(mistral3_config(PRUNED), f, indent=1)
    write_tekken(dir)


def write_comfy_single(path: str) -> None:
    """ComfyUI's mistral_3_small_flux2_bf16.safetensors form: 30 layers, model.* keys, tekken_model."""
    model = {k: v for k, v in base_model().items() if _layer(k) < PRUNED and k != "lm_head.weight"}
    _save({**model, "tekken_model": tekken_tensor()}, path)


def _rotary_interleave(w: torch.Tensor, heads: int) -> torch.Tensor:
    """HF half-split rows -> Meta/llama.cpp interleaved rows (what native files and llama.cpp store)."""
    rows = w.shape[0]
    return w.reshape(heads, 2, rows // heads // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _interleaved(key: str, v: torch.Tensor) -> torch.Tensor:
    """A weight as Meta/llama.cpp store it: Q/K rows interleaved per head, the rest as it is."""
    heads = {"self_attn.q_proj": TINY_MISTRAL.heads, "self_attn.k_proj": TINY_MISTRAL.kv_heads}.get(_module(key))
    return _rotary_interleave(v, heads) if heads else v


def _module(key: str) -> str:
    """"self_attn.q_proj" of model.layers.3.self_attn.q_proj.weight; "model.norm" of model.norm.weight."""
    stem = key[: -len(".weight")]
    return stem.split(".", 3)[3] if key.startswith("model.layers.") else stem


def native_name(key: str) -> str:
    module = NATIVE[_module(key)]
    return f"layers.{_layer(key)}.{module}.weight" if key.startswith("model.layers.") else f"{module}.weight"


def write_native(dir: str) -> None:
    """Mistral's consolidated.safetensors + params.json + tekken.json, 40 layers, wq/wk interleaved."""
    g = TINY_MISTRAL
    os.makedirs(dir, exist_ok=True)
    _save({native_name(k): _interleaved(k, v) for k, v in base_model().items()},
          os.path.join(dir, "consolidated.safetensors"))
    params = {"dim": g.width, "n_layers": LAYERS, "head_dim": g.head_dim, "hidden_dim": g.mlp, "n_heads": g.heads,
              "n_kv_heads": g.kv_heads, "norm_eps": g.rms_norm_eps, "vocab_size": g.vocab, "rope_theta": g.rope_theta}
    with open(os.path.join(dir, "params.json"), "w") as f:
        json.dump(params, f, indent=1)
    write_tekken(dir)


def _linear_keys(model: dict[str, torch.Tensor]) -> list[str]:
    return [k for k in model if k.startswith("model.layers.") and k.split(".")[-2] in PARTS]


def _fp8(model: dict[str, torch.Tensor], spelling: str, per_channel: bool,
         input_scales: bool) -> dict[str, torch.Tensor]:
    """The model with its layers' linear weights in fp8_e4m3fn and a scale (.weight_scale or .scale_weight)."""
    out = dict(model)
    input_spelling = {"weight_scale": "input_scale", "scale_weight": "scale_input"}[spelling]
    for k in _linear_keys(model):
        w = model[k].float()
        amax = w.abs().amax(dim=1, keepdim=True) if per_channel else w.abs().amax()
        scale = (amax / torch.finfo(torch.float8_e4m3fn).max).to(torch.float32)
        out[k] = (w / scale).to(torch.float8_e4m3fn)
        stem = k[: -len("weight")]
        out[stem + spelling] = scale
        if input_scales:
            out[stem + input_spelling] = torch.ones((), dtype=torch.float32)
    return out


def write_fp8(path: str, *, spelling: str, per_channel: bool) -> None:
    """ComfyUI single file with fp8_e4m3fn linear weights and a scale (.weight_scale or .scale_weight)."""
    model = {k: v for k, v in base_model().items() if _layer(k) < PRUNED and k != "lm_head.weight"}
    out = _fp8(model, spelling, per_channel, input_scales=True)
    out["tekken_model"] = tekken_tensor()
    if spelling == "scale_weight":  # ComfyUI's older scaled-fp8 files mark themselves with this empty tensor
        out["scaled_fp8"] = torch.empty(0, dtype=torch.float8_e4m3fn)
    _save(out, path)


_E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def swizzle_block_scales(plain: torch.Tensor) -> torch.Tensor:
    """Block scales [rows, blocks] in cuBLAS' 128x4 tiles, padded with zeros: the inverse of
    packed_dequant.unswizzle_block_scales."""
    rows, blocks = plain.shape
    row_tiles, col_tiles = -(-rows // 128), -(-blocks // 4)
    padded = torch.zeros(row_tiles * 128, col_tiles * 4, dtype=plain.dtype)
    padded[:rows, :blocks] = plain
    tiles = padded.reshape(row_tiles, 4, 32, col_tiles, 4).permute(0, 3, 2, 1, 4)
    return tiles.reshape(row_tiles * 128, col_tiles * 4)


def quantize_nvfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(packed uint8 [out, in/2] high nibble first, swizzled fp8 block scales, fp32 tensor scale)."""
    w = w.float()
    rows, cols = w.shape
    tensor_scale = (w.abs().amax() / (6.0 * 448.0)).reshape(())
    blocks = w.reshape(rows, cols // 16, 16)
    block_scale = (blocks.abs().amax(-1) / 6.0 / tensor_scale).to(torch.float8_e4m3fn)
    total = (block_scale.float() * tensor_scale).clamp(min=1e-30).unsqueeze(-1)
    scaled = (blocks / total).clamp(-6, 6)
    codes = (scaled.abs().unsqueeze(-1) - _E2M1).abs().argmin(-1) | ((scaled < 0).long() << 3)
    codes = codes.reshape(rows, cols).to(torch.uint8)
    packed = (codes[:, 0::2] << 4) | codes[:, 1::2]
    return packed, swizzle_block_scales(block_scale), tensor_scale.to(torch.float32)


def write_hf_fp8(dir: str) -> None:
    """A whole Mistral3 folder whose layers are fp8 with a scale per output channel (as the hub's FP8 checkpoints of
    Mistral-Small: embeddings, norms, lm_head and the vision tower kept bf16)."""
    write_hf_mistral3(dir, model=_fp8(base_model(), "weight_scale", per_channel=True, input_scales=False))
    write_tekken(dir)


def write_nvfp4(path: str, *, whole: bool = False) -> None:
    """ComfyUI "fp4_mixed": most linear weights NVFP4, layer 0 and every down_proj kept bf16; whole: all 40 layers
    with the final norm and lm_head (bf16), which text generation reads."""
    model = {k: v for k, v in base_model().items() if whole or (_layer(k) < PRUNED and k != "lm_head.weight")}
    out = dict(model)
    for k in _linear_keys(model):
        if _layer(k) == 0 or k.endswith("down_proj.weight"):
            continue
        packed, block_scales, tensor_scale = quantize_nvfp4(model[k])
        stem = k[: -len("weight")]
        out[k] = packed
        out[stem + "weight_scale"] = block_scales
        out[stem + "weight_scale_2"] = tensor_scale
        out[stem + "comfy_quant"] = torch.frombuffer(bytearray(b'{"format": "nvfp4"}'), dtype=torch.uint8)
    out["tekken_model"] = tekken_tensor()
    _save(out, path)


# --- GGUF ---------------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def _gguf_vocab() -> tuple[list[str], list[int]]:
    from ...tokenizers.vocab import byte_level_string, parse_tekken_json

    vocab = parse_tekken_json(tekken_data())
    tokens = list(vocab.specials) + [byte_level_string(t) for t in vocab.ranks]
    tokens = tokens[: TINY_MISTRAL.vocab]
    types = [3] * len(vocab.specials) + [1] * (len(tokens) - len(vocab.specials))
    return tokens, types


GGUF_FILES = {
    # file -> (architecture, linear qtype, embedding qtype, llama.cpp Q/K rotary order, tokenizer metadata)
    "llama-q8_0.gguf": ("llama", "Q8_0", "F16", True, True),
    "mistral3-q4_0.gguf": ("mistral3", "Q4_0", "Q8_0", True, True),
    "cow-f16.gguf": ("cow", "F16", "F16", False, False),
    # K-quant blocks span 256 inputs: only attn_output (256 inputs at the tiny width) holds whole blocks;
    # the rest stay F16, as llama.cpp does with rows a type cannot hold.
    "mistral3-q4_k.gguf": ("mistral3", "Q4_K", "Q8_0", True, True),
}


def gguf_encoder_writer(path: str, arch: str, g, layers: int):
    """A gguf.GGUFWriter for an encoder of geometry `g` with `layers` layers, its settings written as llama.cpp
    writes Mistral's."""
    import gguf

    from ...loaders.convert.encoder_gguf import encoder_settings

    writer = gguf.GGUFWriter(path, arch)
    for key, vtype, value in encoder_settings(arch, g, layers, g.rope_theta):
        writer.add_key_value(key, value, vtype)
    return writer


def write_gguf(path: str, arch: str, linear: str, embed: str, interleave: bool, tokenizer: bool) -> None:
    import gguf

    layers = PRUNED if arch == "cow" else LAYERS
    writer = gguf_encoder_writer(path, arch, TINY_MISTRAL, layers)
    if tokenizer:
        tokens, types = _gguf_vocab()
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("tekken")
        writer.add_token_list(tokens)
        writer.add_token_types(types)
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
        writer.add_unk_token_id(0)
        writer.add_pad_token_id(11)

    rng = np.random.default_rng(SEED)

    def add(name: str, t: torch.Tensor, qtype: str) -> None:
        from .gguf_blocks import random_blocks
        from .gguf_transformers import K_QUANT_MAGNITUDES

        data = t.float().numpy()
        q = gguf.GGMLQuantizationType[qtype]
        if q == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(name, data.astype(np.float32))
        elif q == gguf.GGMLQuantizationType.F16 or data.shape[-1] % gguf.GGML_QUANT_SIZES[q][0]:
            writer.add_tensor(name, data.astype(np.float16))
        elif q in K_QUANT_MAGNITUDES:
            writer.add_tensor(name, random_blocks(q, data.shape, rng, K_QUANT_MAGNITUDES[q]), raw_dtype=q)
        else:
            writer.add_tensor(name, gguf.quants.quantize(data, q), raw_dtype=q)

    names = gguf_names()
    for k, v in base_model().items():
        if _layer(k) >= layers or (k == "lm_head.weight" and arch == "cow"):  # gguf-org's files carry no output head
            continue
        qtype = embed if k == "model.embed_tokens.weight" else "F32" if v.dim() == 1 else linear
        add(names.get_name(k, try_suffixes=(".weight",)), _interleaved(k, v) if interleave else v, qtype)
    if arch == "cow":  # gguf-org: the tekken.json bytes, one value per F16 element
        writer.add_tensor("tekken_model", np.frombuffer(embedded_tekken_data(), dtype=np.uint8).astype(np.float16))
    write_and_close(writer)


def gguf_names():
    """gguf-py's map from transformers' names to llama.cpp's (llama.cpp converts Mistral as "llama")."""
    from gguf import MODEL_ARCH
    from gguf.tensor_mapping import get_tensor_name_map

    return get_tensor_name_map(MODEL_ARCH.LLAMA, LAYERS)


# --- all of them --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TinyEncoder:
    name: str  # the file or folder in text_encoders/
    layout: str  # the layout the pack reports for it
    format: str  # the format word of its layer weights
    write: Callable[[str], None]


def _hf_folder(prefix: str) -> Callable[[str], None]:
    def write(path: str) -> None:
        write_hf_mistral3(path, prefix=prefix)
        write_tekken(path)

    return write


# Every tiny encoder, in the order written (the manifest's): the tests take their lists of layouts from here.
ENCODERS = (
    TinyEncoder("hf-mistral3", "hf-mistral3", "bf16", _hf_folder("model.language_model")),
    TinyEncoder("hf-mistral3-old-prefix", "hf-mistral3", "bf16", _hf_folder("language_model.model")),
    TinyEncoder("standalone", "standalone-folder", "bf16", write_standalone),
    TinyEncoder("mistral_3_small_flux2_bf16.safetensors", "comfy-single-file", "bf16", write_comfy_single),
    TinyEncoder("native", "mistral-native", "bf16", write_native),
    TinyEncoder("mistral_3_small_flux2_fp8.safetensors", "comfy-single-file", "fp8-scaled",
                lambda path: write_fp8(path, spelling="scale_weight", per_channel=False)),
    TinyEncoder("mistral_3_small_flux2_fp8_channel.safetensors", "comfy-single-file", "fp8-scaled",
                lambda path: write_fp8(path, spelling="weight_scale", per_channel=True)),
    TinyEncoder("mistral_3_small_flux2_fp4_mixed.safetensors", "comfy-single-file", "nvfp4", write_nvfp4),
    # Whole models in packed formats: they encode as the others, and prompt upsampling reads all of them.
    TinyEncoder("hf-mistral3-fp8", "hf-mistral3", "fp8-scaled", write_hf_fp8),
    TinyEncoder("mistral_3_small_whole_fp4_mixed.safetensors", "comfy-single-file", "nvfp4",
                lambda path: write_nvfp4(path, whole=True)),
    *(TinyEncoder(name, f"gguf-{spec[0]}", f"gguf-{spec[1]}", lambda path, spec=spec: write_gguf(path, *spec))
      for name, spec in GGUF_FILES.items()),
)


def write_encoders(root: str, names: tuple[str, ...] | None = None) -> list[dict]:
    """Every tiny encoder (ENCODERS), or those `names` names, under root; manifest entries with paths relative to
    root."""
    os.makedirs(root, exist_ok=True)
    chosen = [e for e in ENCODERS if names is None or e.name in names]
    for encoder in chosen:
        encoder.write(os.path.join(root, encoder.name))
    return [{"path": e.name, "kind": "encoder", "layout": e.layout, "variant": "dev", "format": e.format}
            for e in chosen]
