"""Prompt upsampling in `flux2dev bench`: greedy generation of a text-to-image upsampling chat through the pack
(host/upsampler.py) beside transformers' generate on the same weights (MistralForCausalLM), in bf16 and float32,
and the pack on an fp8 and a GGUF Q4_0 file of the same model: time to first token, tokens per second after it,
and the peak RSS of loading and writing.

The full model is FLUX.2 [dev]'s Mistral-Small at its real width (hidden 5120, 32 query and 8 key/value heads of
128, MLP 32768, vocabulary 131072) with 3 layers, the final norm and lm_head (the benchmark encoder's geometry,
tiny/geometry.py); quick: the tiny test model (width 64, 40 layers). Each row runs in a child process of its own,
so its peak RSS is its own. Needs the host (COMFYUI_ROOT)."""

from __future__ import annotations

import os
import tempfile
import time

import torch

from ..tiny.geometry import BENCH_MISTRAL, TINY_MISTRAL
from .encode_scenarios import write_encoder
from .meters import Measured, in_child
from .roofline import layer_bytes, matmul_rate, memory_rate, roofline_s, token_flops

NEW_TOKENS = {True: 8, False: 16}
PROMPT = "a red fox sitting in fresh snow at dawn"
# (row name, what runs it, file format, compute dtype)
ROWS = (
    ("pack bf16", "pack", "bf16", "bfloat16"),
    ("transformers bf16", "transformers", "bf16", "bfloat16"),
    ("pack float32", "pack", "bf16", "float32"),
    ("transformers float32", "transformers", "bf16", "float32"),
    ("pack fp8", "pack", "fp8", "bfloat16"),
    ("pack GGUF Q4_0", "pack", "gguf", "bfloat16"),
)


def write_whole_gguf(path: str, bf16_path: str, g, layers: int) -> None:
    """The bf16 file's model as a llama.cpp GGUF ("mistral3", Q/K rows in llama.cpp's order): Q4_0 linears, Q8_0
    embeddings, F16 lm_head, F32 norms."""
    import gguf
    from safetensors import safe_open

    from ...loaders.formats.gguf_types import quantize
    from ..tiny.encoders import gguf_encoder_writer, gguf_names
    from ..tiny.gguf_blocks import write_and_close

    writer = gguf_encoder_writer(path, "mistral3", g, layers)
    names = gguf_names()
    heads = {"self_attn.q_proj": g.heads, "self_attn.k_proj": g.kv_heads}
    with safe_open(bf16_path, "pt") as f:
        for key in f.keys():
            if key == "tekken_model":
                continue
            w = f.get_tensor(key).float()
            module = key.split(".", 3)[-1][: -len(".weight")] if key.startswith("model.layers.") else ""
            if module in heads:  # llama.cpp's rotary order
                h = heads[module]
                w = w.reshape(h, 2, w.shape[0] // h // 2, -1).transpose(1, 2).reshape(w.shape)
            qtype = (gguf.GGMLQuantizationType.F32 if w.dim() == 1
                     else gguf.GGMLQuantizationType.F16 if key == "lm_head.weight"
                     else gguf.GGMLQuantizationType.Q8_0 if "embed_tokens" in key else gguf.GGMLQuantizationType.Q4_0)
            name = names.get_name(key, try_suffixes=(".weight",))
            if qtype == gguf.GGMLQuantizationType.F32:
                writer.add_tensor(name, w.numpy())
            elif qtype == gguf.GGMLQuantizationType.F16:
                writer.add_tensor(name, w.half().numpy())
            else:
                writer.add_tensor(name, quantize(w, qtype).numpy(), raw_dtype=qtype)
            del w
    write_and_close(writer)


def _transformers_model(path: str, g, layers: int, dtype: torch.dtype):
    """transformers' MistralForCausalLM on the weights of the bf16 file (the same keys), in `dtype`."""
    from safetensors.torch import load_file
    from transformers import MistralConfig, MistralForCausalLM

    config = MistralConfig(vocab_size=g.vocab, hidden_size=g.width, intermediate_size=g.mlp, num_hidden_layers=layers,
                           num_attention_heads=g.heads, num_key_value_heads=g.kv_heads, head_dim=g.head_dim,
                           rms_norm_eps=g.rms_norm_eps, rope_theta=g.rope_theta, tie_word_embeddings=False,
                           max_position_embeddings=4096, bos_token_id=1, eos_token_id=2)
    config._attn_implementation = "sdpa"
    with torch.device("meta"):
        model = MistralForCausalLM(config)
    weights = {k: v for k, v in load_file(path).items() if k != "tekken_model"}
    model.load_state_dict(weights, assign=True, strict=True)
    del weights
    model.model.rotary_emb = type(model.model.rotary_emb)(config=config)  # its angles are no weights: made, not loaded
    return model.to(dtype).eval()


class _Stamps:
    """transformers' streamer interface: the time of each token generate writes (the first put is the prompt)."""

    def __init__(self):
        self.times: list[float] = []
        self.prompt_seen = False

    def put(self, value) -> None:
        if self.prompt_seen:
            self.times.append(time.perf_counter())
        self.prompt_seen = True

    def end(self) -> None:
        pass


def _child(path: str, runner: str, dtype: str, layers: int, quick: bool) -> dict:
    from ...host.upsampler import upsample
    from ...loaders.models.encoder import plan_language_model, resolve_plan_tokenizer
    from ...tokenizers.chat import TEXT_TO_IMAGE_SYSTEM, chat_ids

    g = TINY_MISTRAL if quick else BENCH_MISTRAL
    new_tokens = NEW_TOKENS[quick]
    torch_dtype = getattr(torch, dtype)
    tokenizer = resolve_plan_tokenizer(plan_language_model(path)).tokenizer
    ids = chat_ids(tokenizer, TEXT_TO_IMAGE_SYSTEM, PROMPT)
    with Measured() as measured:
        if runner == "pack":
            settings = {"temperature": 0, "max_new_tokens": new_tokens, "dtype": torch_dtype, "keep_loaded": True}
            upsample(path, "warm-up", **{**settings, "max_new_tokens": 2})  # loads the model, kept for the next call
            stamps = []
            start = time.perf_counter()
            written = upsample(path, PROMPT, on_token=lambda count, total: stamps.append(time.perf_counter()),
                               **settings)
            assert written.input_ids == ids
        else:
            model = _transformers_model(path, g, layers, torch_dtype)
            prompt = torch.tensor([ids])
            with torch.inference_mode():
                model.generate(prompt, do_sample=False, max_new_tokens=2, pad_token_id=11)
                streamer = _Stamps()
                start = time.perf_counter()
                model.generate(prompt, do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                               pad_token_id=11, streamer=streamer)
            stamps = streamer.times
    first = stamps[0] - start
    return {"prompt_tokens": len(ids), "new_tokens": len(stamps), "first_token_s": first,
            "tokens_per_s": (len(stamps) - 1) / (stamps[-1] - stamps[0]), "peak_rss_bytes": measured.peak_rss_bytes,
            "file_bytes": os.path.getsize(path)}


def bench_upsampling(quick: bool) -> dict:
    """{"geometry": {...}, "rows": [{"name", "prompt_tokens", "new_tokens", "first_token_s", "tokens_per_s",
    "peak_rss_bytes", "file_bytes"}, ...]} for ROWS (quick: the pack and transformers on the bf16 file, in bfloat16)."""
    g = TINY_MISTRAL if quick else BENCH_MISTRAL
    layers = max(g.layers)
    rows = []
    chosen = [row for row in ROWS if not quick or row[2:] == ("bf16", "bfloat16")]
    formats = {fmt for _, _, fmt, _ in chosen}
    with tempfile.TemporaryDirectory() as tmp:
        files = {fmt: os.path.join(tmp, f"model-{fmt}.{'gguf' if fmt == 'gguf' else 'safetensors'}")
                 for fmt in ("bf16", "fp8", "gguf")}
        write_encoder(files["bf16"], g, layers, "bf16", whole=True)
        if "fp8" in formats:
            write_encoder(files["fp8"], g, layers, "fp8", whole=True)
        if "gguf" in formats:
            write_whole_gguf(files["gguf"], files["bf16"], g, layers)
        rates = {"memory_bytes_s": memory_rate(),
                 **{dtype: matmul_rate(g, getattr(torch, dtype)) for dtype in {dtype for *_, dtype in chosen}}}
        for name, runner, fmt, dtype in chosen:
            row = {"name": name, **in_child("upsample_scenarios", "_child", files[fmt], runner, dtype, layers,
                                            quick, what=f"upsampling, {name}")}
            if runner == "pack":
                row["roofline"] = _against(row, g, layers, rates[dtype], rates["memory_bytes_s"],
                                           layer_bytes(files[fmt], head=True))
            rows.append(row)
    geometry = {"width": g.width, "heads": g.heads, "kv_heads": g.kv_heads, "mlp": g.mlp, "vocab": g.vocab,
                "layers": layers}
    return {"geometry": geometry, "rates": rates, "rows": rows}


def _against(row: dict, g, layers: int, rate: float, read_rate: float, weight_bytes: int) -> dict:
    """A pack row's prefill (its first token) and each token after it against the machine's limits (roofline.py):
    every token reads the whole model's weights once, from memory (the row's model is loaded by a first call)."""
    prompt, new = row["prompt_tokens"], row["new_tokens"]
    prefill = roofline_s(token_flops(g, layers, prompt, prompt), weight_bytes, rate, read_rate)
    token = roofline_s(token_flops(g, layers, 1, prompt + new), weight_bytes, rate, read_rate)
    return {"prefill_roofline_s": prefill, "prefill_ratio": row["first_token_s"] / prefill,
            "token_roofline_s": token, "token_ratio": 1 / row["tokens_per_s"] / token}


def format_upsampling(result: dict) -> str:
    g = result["geometry"]
    rows = {r["name"]: r for r in result["rows"]}
    first = result["rows"][0]
    lines = [f"prompt upsampling, greedy (model {g['width']} wide, {g['heads']}/{g['kv_heads']} heads, MLP {g['mlp']}, "
             f"vocabulary {g['vocab']}, {g['layers']} layers; a {first['prompt_tokens']}-token chat, "
             f"{first['new_tokens']} tokens written):"]
    for r in result["rows"]:
        peer = rows.get(r["name"].replace("pack", "transformers"))
        versus = ""
        if peer is not None and peer is not r:
            versus = (f" ({r['tokens_per_s'] / peer['tokens_per_s']:.2f}x transformers' tokens/s, first token "
                      f"{r['first_token_s'] / peer['first_token_s']:.2f}x its time, peak RSS "
                      f"{r['peak_rss_bytes'] / peer['peak_rss_bytes']:.2f}x)")
        elif r["name"].startswith("pack") and "transformers bf16" in rows:
            versus = (f" (peak RSS {r['peak_rss_bytes'] / rows['transformers bf16']['peak_rss_bytes']:.2f}x "
                      "transformers bf16's)")
        roof = r.get("roofline")
        if roof:
            versus += (f"; prefill {roof['prefill_ratio']:.1f}x its roofline, a token {roof['token_ratio']:.1f}x "
                       "its roofline")
        lines.append(f"  {r['name']:<22} first token {r['first_token_s'] * 1e3:8.0f} ms, "
                     f"{r['tokens_per_s']:7.2f} tokens/s, peak RSS {r['peak_rss_bytes'] / 2**20:7.0f} MiB, "
                     f"file {r['file_bytes'] / 2**20:6.0f} MiB{versus}")
    return "\n".join(lines)


