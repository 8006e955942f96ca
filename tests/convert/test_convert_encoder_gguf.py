"""`convert encoder SRC OUT.gguf --type T` from the tiny 40-layer Hugging Face encoder: gguf-py reads a llama.cpp
GGUF of layers 0-29 with llama.cpp's names, settings and tokenizer; each tensor's type is llama.cpp's rule for the
preset and its bytes are the reference quantizer's (gguf-py, ggml) of the source weight in llama.cpp's row order;
the pack loads it into the conditioning of those weights round-tripped, with the source's tokenizer; ComfyUI-GGUF
reads it into the same tensors and rebuilds the same tokenizer; bad input is refused as by every conversion."""

from __future__ import annotations

import functools
import os
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from comfyui_flux2dev.cli import main
from comfyui_flux2dev.devtools.tiny import encoders as tiny
from comfyui_flux2dev.errors import OutputError, WrongModelError
from comfyui_flux2dev.loaders.convert.encoder_gguf import convert_encoder_gguf, tensor_type
from comfyui_flux2dev.loaders.models.variants import MISTRAL_SMALL
from helpers import host_flux2_tokenizer

SOURCE = "text_encoders/hf-mistral3"  # 40 layers, bf16, with its vision tower and lm_head
KLEIN = "diffusers/flux2-klein-4b-tiny-pipeline/text_encoder"
PRESETS = ("Q4_K_M", "Q8_0")
G = tiny.TINY_MISTRAL
LAYERS = 30
# llama.cpp's names (llama-arch.cpp LLM_TENSOR_NAMES) -> the host's
PARTS = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
         "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
         "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
HOST = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
        **{f"blk.{i}.{p}.weight": f"model.layers.{i}.{h}.weight" for i in range(LAYERS) for p, h in PARTS.items()}}
# use_more_bits(i, 30) of llama-quant.cpp: i < 3, i >= 26, or (i - 3) % 3 == 2
MORE_BITS = {0, 1, 2, 5, 8, 11, 14, 17, 20, 23, 26, 27, 28, 29}
PROMPTS = ("a red fox in the snow", "Ein Café, 2024: [IMG] 3 cats <s>!", "東京の夜",
           "[SYSTEM_PROMPT]You describe images.[/SYSTEM_PROMPT][INST]two cats[/INST]")


def _tiny_types(preset: str) -> dict[str, str]:
    """Each tensor's type in the tiny file, by llama.cpp's rules, stated by hand. Tiny rows are 64 values (q, k, v,
    gate, up, the embeddings), 128 (down) or 256 (output): K blocks (256) fit only attn_output, and the rest fall back
    as llama.cpp's tensor_type_fallback does (Q4_K -> Q5_0, Q6_K -> Q8_0); the embeddings, quantized as the output
    tensor (the file has none), take Q8_0 where the preset's blocks do not fit their rows."""
    if preset == "Q8_0":
        return {name: "F32" if "norm" in name else "Q8_0" for name in HOST}
    out = {"token_embd.weight": "Q8_0", "output_norm.weight": "F32"}
    for i in range(LAYERS):
        raised = "Q8_0" if i in MORE_BITS else "Q5_0"  # Q6_K on use_more_bits layers, else Q4_K; both fall back
        parts = {"attn_q": "Q5_0", "attn_k": "Q5_0", "attn_v": raised, "attn_output": "Q4_K", "ffn_gate": "Q5_0",
                 "ffn_up": "Q5_0", "ffn_down": raised, "attn_norm": "F32", "ffn_norm": "F32"}
        out.update({f"blk.{i}.{part}.weight": qtype for part, qtype in parts.items()})
    return out


def _real_types(preset: str, kind: str, layer: int) -> str:
    """llama-quantize's type at Mistral-Small's real geometry (30 layers, 32 heads over 8 KV heads: n_gqa 4), where
    every row holds whole K blocks: llama-quant.cpp's rules for each preset, stated by hand."""
    base = {"Q4_K_M": "Q4_K", "Q4_K_S": "Q4_K", "Q3_K_M": "Q3_K", "Q2_K": "Q2_K"}.get(preset, preset)
    if preset in ("BF16", "F16"):
        return preset
    if kind == "token_embd":
        return "Q8_0" if preset == "Q8_0" else "Q6_K"
    more = "Q6_K" if layer in MORE_BITS else base
    rules = {
        "Q4_K_M": {"attn_v": more, "ffn_down": more},
        "Q4_K_S": {"attn_v": "Q5_K" if layer < 4 else base, "ffn_down": "Q5_K" if layer < 3 else base},
        "Q3_K_M": {"attn_v": "Q5_K" if layer < 2 else "Q4_K", "ffn_down": "Q5_K" if layer < 1 else "Q4_K",
                   "attn_output": "Q4_K"},
        "Q2_K": {"attn_v": "Q4_K", "ffn_down": "Q3_K", "attn_output": "Q3_K"},
    }
    return rules.get(preset, {}).get(kind, base)


def test_the_types_at_mistral_smalls_geometry_are_llama_quantizes():
    g = MISTRAL_SMALL
    shapes = {"token_embd": (g.vocab, g.width), "attn_q": (g.heads * g.head_dim, g.width),
              "attn_k": (g.kv_heads * g.head_dim, g.width), "attn_v": (g.kv_heads * g.head_dim, g.width),
              "attn_output": (g.width, g.heads * g.head_dim), "ffn_gate": (g.mlp, g.width), "ffn_up": (g.mlp, g.width),
              "ffn_down": (g.width, g.mlp), "attn_norm": (g.width,)}
    kinds = {"token_embd": gguf.MODEL_TENSOR.TOKEN_EMBD, "attn_q": gguf.MODEL_TENSOR.ATTN_Q,
             "attn_k": gguf.MODEL_TENSOR.ATTN_K, "attn_v": gguf.MODEL_TENSOR.ATTN_V,
             "attn_output": gguf.MODEL_TENSOR.ATTN_OUT, "ffn_gate": gguf.MODEL_TENSOR.FFN_GATE,
             "ffn_up": gguf.MODEL_TENSOR.FFN_UP, "ffn_down": gguf.MODEL_TENSOR.FFN_DOWN,
             "attn_norm": gguf.MODEL_TENSOR.ATTN_NORM}
    for preset in ("Q4_K_M", "Q4_K_S", "Q3_K_M", "Q2_K", "Q8_0", "Q5_0", "BF16"):
        for layer in range(LAYERS):
            for part, shape in shapes.items():
                want = "F32" if part == "attn_norm" else _real_types(preset, part, layer)
                got = tensor_type(kinds[part], layer, shape, preset, g.heads // g.kv_heads, LAYERS)
                assert got.name == want, (preset, part, layer)


@pytest.fixture(scope="module")
def written(tiny_root, tmp_path_factory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("encoder-gguf")
    done = {}
    for preset in PRESETS:
        done[preset] = out / f"mistral-small-flux2-{preset}.gguf"
        convert_encoder_gguf(str(tiny_root / SOURCE), str(done[preset]), qtype=preset)
    return done


READER = gguf.GGUFReader


@functools.cache
def _reader(path: Path) -> gguf.GGUFReader:
    """One gguf-py reader per file: parsing the real vocabulary's header element by element takes seconds."""
    return READER(path)


def _field(reader: gguf.GGUFReader, key: str):
    return reader.get_field(key).contents()


def _llama_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: HF rows -> llama.cpp's."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _llama_unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


HEADS = {"self_attn.q_proj": G.heads, "self_attn.k_proj": G.kv_heads}


def _heads(host: str) -> int | None:
    return HEADS.get(".".join(host.split(".")[3:5]))


def _source(name: str) -> np.ndarray:
    """The source's weight of GGUF tensor `name` in llama.cpp's row order, float32 (the final norm: ones)."""
    host = HOST[name]
    if host == "model.norm.weight":
        return np.ones(G.width, np.float32)
    w = tiny.base_model()[host].float().numpy()
    return _llama_permute(w, _heads(host)) if _heads(host) else w


def _dequantized(t) -> np.ndarray:
    return gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32).reshape([int(d) for d in reversed(t.shape)])


def _round_trip(path: Path) -> dict[str, torch.Tensor]:
    """The file's tensors dequantized by gguf-py, in the host's names and HF row order."""
    out = {}
    for t in _reader(path).tensors:
        host = HOST[t.name]
        w = _dequantized(t)
        out[host] = torch.from_numpy(_llama_unpermute(w, _heads(host)) if _heads(host) else w.copy())
    return out


@pytest.mark.parametrize("preset", PRESETS)
def test_gguf_py_reads_llama_cpps_names_settings_and_types(written, preset):
    reader = _reader(written[preset])
    arch = _field(reader, "general.architecture")
    assert arch == "llama"
    want = {"block_count": LAYERS, "context_length": 131072, "embedding_length": G.width,
            "feed_forward_length": G.mlp, "attention.head_count": G.heads, "attention.head_count_kv": G.kv_heads,
            "attention.key_length": G.head_dim, "attention.value_length": G.head_dim,
            "rope.dimension_count": G.head_dim, "vocab_size": G.vocab}
    assert {k: _field(reader, f"{arch}.{k}") for k in want} == want
    assert _field(reader, f"{arch}.rope.freq_base") == G.rope_theta
    assert _field(reader, f"{arch}.attention.layer_norm_rms_epsilon") == pytest.approx(G.rms_norm_eps)
    assert _field(reader, "general.file_type") == int(gguf.LlamaFileType[f"MOSTLY_{preset}"])
    assert _field(reader, "general.quantization_version") == 2
    assert {t.name: t.tensor_type.name for t in reader.tensors} == _tiny_types(preset)  # no blk.30-39, no output
    tokenizer = {k: _field(reader, f"tokenizer.ggml.{k}") for k in ("model", "pre", "bos_token_id", "eos_token_id",
                                                                    "unknown_token_id", "padding_token_id")}
    assert tokenizer == {"model": "gpt2", "pre": "tekken", "bos_token_id": 1, "eos_token_id": 2,
                         "unknown_token_id": 0, "padding_token_id": 11}
    tokens = _field(reader, "tokenizer.ggml.tokens")
    assert len(tokens) == G.vocab and tokens[:4] == ["<unk>", "<s>", "</s>", "[INST]"]
    assert _field(reader, "tokenizer.ggml.token_type") == [3] * 1000 + [1] * (G.vocab - 1000)


@pytest.mark.parametrize("preset", PRESETS)
def test_each_tensor_is_the_reference_quantization_of_the_source_weight(written, preset, ggml):
    """Legacy types: gguf-py's numpy quantizer; K types: ggml's own reference; F32: the values themselves. Q and K
    rows in llama.cpp's order (LlamaModel.permute)."""
    for t in _reader(written[preset]).tensors:
        values = _source(t.name)
        if t.tensor_type == gguf.GGMLQuantizationType.F32:
            want = values
        elif t.tensor_type.name in ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"):
            want = ggml(t.tensor_type, values.reshape(-1, values.shape[-1]))
        else:
            want = gguf.quants.quantize(values, t.tensor_type)
        assert np.array_equal(np.asarray(t.data).reshape(-1), np.asarray(want).reshape(-1).view(t.data.dtype)), \
            (preset, t.name)


def _cond(clip, prompt):
    return clip.encode_from_tokens(clip.tokenize(prompt), return_dict=True)["cond"]


@pytest.mark.one_host  # the pack's dequantizers and un-permute; the host's encoder runs on every host in test_encoder
@pytest.mark.parametrize("preset", PRESETS)
def test_the_pack_gives_the_conditioning_of_the_round_tripped_weights(comfy_host, written, preset, tmp_path):
    """The pack's GGUF loader (its dequantizers, its un-permute from the stated head counts) against the same
    weights dequantized by gguf-py and un-permuted here, written as a plain float32 single file."""
    from safetensors.torch import save_file

    from comfyui_flux2dev.host.clip import load_clip
    from comfyui_flux2dev.loaders.models.encoder import load_encoder

    loaded = load_encoder(str(written[preset]))
    assert loaded.layout == "gguf-llama" and loaded.layers_in_file == LAYERS and loaded.tokenizer.rung == "gguf-vocab"
    weights = _round_trip(written[preset])
    del weights["model.norm.weight"]
    reference = tmp_path / "round-trip.safetensors"
    save_file({**weights, "tekken_model": tiny.tekken_tensor()},
              str(reference))
    mine = load_clip(str(written[preset]))
    want = load_clip(str(reference), dtype=mine.flux2dev_source.dtype)
    for prompt in PROMPTS[:2]:
        assert torch.equal(_cond(mine, prompt), _cond(want, prompt)), prompt


def test_the_tokenizer_ladder_gives_the_sources_ids_from_the_gguf(tiny_root, written):
    from comfyui_flux2dev.loaders.models.encoder import plan_encoder, resolve_plan_tokenizer
    from comfyui_flux2dev.tokenizers.canonical import REFERENCE_PATTERN, hf_tokenizers

    source = resolve_plan_tokenizer(plan_encoder(str(tiny_root / SOURCE))).tokenizer
    found = resolve_plan_tokenizer(plan_encoder(str(written["Q4_K_M"])))
    assert found.rung == "gguf-vocab" and found.tokenizer.vocab.digest == source.vocab.digest
    for prompt in PROMPTS:
        assert found.tokenizer.encode(prompt) == source.encode(prompt), prompt
    # The merges are what llama.cpp's BPE merges with: merging by them gives the ranks' tokens (text without
    # special strings, which this bare BPE does not split out).
    reader = _reader(written["Q4_K_M"])
    lib = hf_tokenizers()
    tokens = _field(reader, "tokenizer.ggml.tokens")
    merges = [tuple(m.split(" ")) for m in _field(reader, "tokenizer.ggml.merges")]
    bpe = lib.Tokenizer(lib.models.BPE({t: i for i, t in enumerate(tokens) if i >= 1000}, merges))
    bpe.pre_tokenizer = lib.pre_tokenizers.Sequence([
        lib.pre_tokenizers.Split(lib.Regex(REFERENCE_PATTERN), behavior="isolated"),
        lib.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    for prompt in ("a red fox in the snow", "Ein Café, 2024: drei Katzen!", "東京の夜"):
        assert bpe.encode(prompt, add_special_tokens=False).ids == source.encode(prompt), prompt


@pytest.mark.one_host  # ComfyUI-GGUF's reading of the pack's bytes; the pack's GGUF encoder runs on every host
def test_comfyui_gguf_reads_the_same_tensors(peer, written, monkeypatch):
    loader, dequant = peer
    path = str(written["Q4_K_M"])
    monkeypatch.setattr(gguf, "GGUFReader", lambda p: _reader(Path(p)))  # the same parse, once
    want = _round_trip(written["Q4_K_M"])

    def dense(t):
        return dequant.dequantize_tensor(t, dtype=torch.float32, dequant_dtype=torch.float32)

    # CLIPLoaderGGUF's state dict: architecture "llama" taken, every tensor in the host's names (the embeddings
    # dequantized to float16 there). It un-permutes Q and K with Mistral-Small's head counts (32, 8), fixed in its
    # code, so at the tiny geometry they are checked below with the tiny's through its own llama_permute.
    sd = loader.gguf_clip_loader(path)
    assert set(sd) == set(want)
    for key, value in sd.items():
        if _heads(key):
            continue
        expected = want[key].half().float() if key == "model.embed_tokens.weight" else want[key]
        assert torch.equal(dense(value).float(), expected), key
    raw = loader.sd_map_replace(loader.gguf_sd_loader(path, is_text_model=True), loader.LLAMA_SD_MAP)
    for key, value in loader.llama_permute(raw, G.heads, G.kv_heads).items():
        if _heads(key):
            assert torch.equal(dense(value), want[key]), key


def test_comfyui_ggufs_tokenizer_rebuild_is_the_sources(peer, tiny_root, written, monkeypatch):
    """Its tekken rebuild (run for a llama-architecture file at Mistral-Small's embedding shape) holds the source's
    vocabulary, and ComfyUI's own FLUX.2 tokenizer reading it gives the pack's ids."""
    import base64
    import json

    from comfyui_flux2dev.host.clip import load_clip
    from comfyui_flux2dev.loaders.models.encoder import plan_encoder, resolve_plan_tokenizer
    from comfyui_flux2dev.tokenizers.vocab import TekkenVocab

    loader, _ = peer
    path = str(written["Q4_K_M"])
    monkeypatch.setattr(gguf, "GGUFReader", lambda p: _reader(Path(p)))
    tekken = loader.gguf_tekken_tokenizer_loader(path, (131072, 5120))
    doc = json.loads(tekken.numpy().tobytes())
    rebuilt = TekkenVocab(tuple(t["token_str"] for t in doc["special_tokens"]),
                          tuple(base64.b64decode(v["token_bytes"]) for v in doc["vocab"]))
    source = resolve_plan_tokenizer(plan_encoder(str(tiny_root / SOURCE))).tokenizer
    assert rebuilt.digest == source.vocab.digest
    try:
        host = host_flux2_tokenizer(tekken, "; the rebuilt vocabulary is the source's (above)")
    except KeyError as e:  # ComfyUI 0.33's own tekken reader
        if e.args != ("default_num_special_tokens",) or "default_num_special_tokens" in doc["config"]:
            raise
        pytest.skip("ComfyUI-GGUF's tekken rebuild states no default_num_special_tokens, which this ComfyUI's own "
                    "tekken reader requires (so with any llama.cpp Mistral GGUF); the rebuilt vocabulary is the "
                    "source's (above)")
    mine = load_clip(path, padding="comfy")
    for prompt in PROMPTS[:3]:
        assert [t[0] for t in host.tokenize_with_weights(prompt)["mistral3_24b"][0]] == \
            [t[0] for t in mine.tokenize(prompt)["mistral3_24b"][0]], prompt


def test_a_second_run_writes_the_same_bytes(tiny_root, written, tmp_path):
    again = tmp_path / "again.gguf"
    convert_encoder_gguf(str(tiny_root / SOURCE), str(again), qtype="Q8_0")
    assert again.read_bytes() == written["Q8_0"].read_bytes()


def _refused(capsys, *argv) -> str:
    assert main(["convert", "encoder", *map(str, argv)]) == 2
    return " ".join(capsys.readouterr().err.split())


def test_bad_input_is_refused_and_nothing_is_left(tiny_root, written, tmp_path, capsys):
    source = tiny_root / SOURCE
    before = written["Q8_0"].read_bytes()
    with pytest.raises(OutputError, match="already exists"):
        convert_encoder_gguf(str(source), str(written["Q8_0"]), qtype="Q4_K_M")
    assert written["Q8_0"].read_bytes() == before
    out = tmp_path / "out.gguf"
    with pytest.raises(WrongModelError, match="Qwen3"):
        convert_encoder_gguf(str(tiny_root / KLEIN), str(out), qtype="Q8_0")
    assert "--type does not apply to a .safetensors OUT" in _refused(capsys, source, tmp_path / "e.safetensors",
                                                                      "--type", "Q8_0")
    assert "--dtype does not apply to a .gguf OUT" in _refused(capsys, source, out, "--dtype", "bf16")
    assert "needs --type" in _refused(capsys, source, out)
    assert "Qwen3" in _refused(capsys, tiny_root / KLEIN, out, "--type", "Q8_0")
    assert os.listdir(tmp_path) == []  # nothing under OUT, no partial file beside it
