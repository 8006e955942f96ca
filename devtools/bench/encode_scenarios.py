"""The conditioning cache in `flux2dev bench`: time to conditioning for a 512-token prompt through the host's
CLIP, cold (load + encode), warm (loaded, encode) and from the cache (a fresh lazy CLIP, a hit), with the
bytes read and the peak RSS of each, and the RSS left after an encode with keep_loaded off; bf16 and fp8
files of the same random encoder (quick: bf16 only).

The quick encoder is the tiny test geometry (30 layers); the full one is the benchmark geometry: the real width
of FLUX.2 [dev]'s Mistral-Small (hidden 5120, 32 query and 8 key/value heads of 128, MLP 32768, vocabulary
131072) with 3 layers, read as hidden states 1, 2, 3 (loaders/models/variants.py), so the conditioning is as wide as
real [dev]'s. Each file is
measured in a fresh child process, after evicting it from the page cache. Needs the host (COMFYUI_ROOT)."""

from __future__ import annotations

import os
import tempfile

import torch

from ...loaders.models.variants import MistralEncoderGeometry
from ..tiny.geometry import BENCH_MISTRAL, TINY_MISTRAL
from .meters import Measured, evict, in_child

# quick: the tiny test encoder (pruned, 30 layers); full: real width, 3 layers. Files hold the layers FLUX.2 keeps.
_ENCODERS = {True: TINY_MISTRAL, False: BENCH_MISTRAL}
_PROMPTS = ("a red fox sitting in fresh snow at dawn", "a lighthouse on a cliff at dusk, oil painting",
            "three cats asleep on a sofa", "a bowl of ramen, top view")  # reference padding: 512 tokens each
_PARTS = {"self_attn.q_proj": ("heads", "width"), "self_attn.k_proj": ("kv_heads", "width"),
          "self_attn.v_proj": ("kv_heads", "width"), "self_attn.o_proj": ("width", "heads"),
          "mlp.gate_proj": ("mlp", "width"), "mlp.up_proj": ("mlp", "width"), "mlp.down_proj": ("width", "mlp")}


def _dim(g: MistralEncoderGeometry, name: str) -> int:
    return {"heads": g.heads * g.head_dim, "kv_heads": g.kv_heads * g.head_dim}.get(name) or getattr(g, name)


def encoder_tensors(g: MistralEncoderGeometry, layers: int, fmt: str, whole: bool = False) -> dict:
    """{name: (dtype, shape, std)} of a random encoder in ComfyUI's single-file form (model.* keys): bf16; fp8 linear
    weights with a per-tensor weight_scale; or ComfyUI's "fp4_mixed" (NVFP4 linear weights, layer 0 and every
    down_proj bf16) (std None: not random; norms are ones, scales are written with their weight); whole: with the
    final norm and lm_head (bf16), which writing text reads."""
    out = {"model.embed_tokens.weight": (torch.bfloat16, (g.vocab, g.width), 0.5)}
    for i in range(layers):
        prefix = f"model.layers.{i}."
        for part, (rows, cols) in _PARTS.items():
            shape = (_dim(g, rows), _dim(g, cols))
            std, name = shape[1] ** -0.5, prefix + part + "."
            if fmt == "fp8":
                out[name + "weight"] = (torch.float8_e4m3fn, shape, std)
                out[name + "weight_scale"] = (torch.float32, (), None)
            elif fmt == "nvfp4" and i > 0 and part != "mlp.down_proj":
                out[name + "weight"] = (torch.uint8, (shape[0], shape[1] // 2), std)
                out[name + "weight_scale"] = (torch.float8_e4m3fn, (-(-shape[0] // 128) * 128,
                                                                    -(-shape[1] // 16 // 4) * 4), None)
                out[name + "weight_scale_2"] = (torch.float32, (), None)
                out[name + "comfy_quant"] = (torch.uint8, (len(_NVFP4_DECLARATION),), None)
            else:
                out[name + "weight"] = (torch.bfloat16, shape, std)
        for norm in ("input_layernorm", "post_attention_layernorm"):
            out[prefix + norm + ".weight"] = (torch.bfloat16, (g.width,), None)
    if whole:
        out["model.norm.weight"] = (torch.bfloat16, (g.width,), None)
        out["lm_head.weight"] = (torch.bfloat16, (g.vocab, g.width), g.width ** -0.5)
    return out


_NVFP4_DECLARATION = b'{"format": "nvfp4"}'
_E2M1_RMS = 2.93  # the root mean square of the 16 E2M1 values, each as likely: random codes' scale
_NVFP4_TENSOR_SCALE = 1 / 448


_ROWS_VALUES = 1 << 24  # values written at a time: a real-size file costs a small one's memory
_FP8_RANGE = 4.5  # fp8 scales cover +-4.5 standard deviations; the few values beyond are clipped


def write_encoder(path: str, g: MistralEncoderGeometry, layers: int, fmt: str, whole: bool = False) -> None:
    """A random encoder (encoder_tensors) with the embedded tekken.json, written in a stream under a fresh name
    and linked into place (never over a file that is there). The values are windows at random places of one
    pool of normal values: drawing 17 billion of them would take minutes, and no figure measured depends on
    values repeating 16 million apart."""
    from ...loaders.convert.tensor_files import safetensors_file
    from ..tiny.encoders import tekken_tensor

    tensors = encoder_tensors(g, layers, fmt, whole)
    tekken = tekken_tensor()
    gen = torch.Generator().manual_seed(0)
    pool = torch.randn(_ROWS_VALUES, generator=gen).repeat(2)
    fp8_max = torch.finfo(torch.float8_e4m3fn).max
    partial = path + ".partial"
    with open(partial, "wb") as f:
        out = safetensors_file(f, {**{n: (d, s) for n, (d, s, _) in tensors.items()},
                                   "tekken_model": (torch.uint8, tuple(tekken.shape))})
        for name, (dtype, shape, std) in tensors.items():
            if std is None:
                if name.endswith("comfy_quant"):
                    out.write(name, torch.frombuffer(bytearray(_NVFP4_DECLARATION), dtype=torch.uint8))
                elif not name.endswith(("_scale", "_scale_2")):
                    out.write(name, torch.ones(shape, dtype=dtype))
                continue
            if dtype == torch.uint8:  # NVFP4: random codes, one block scale for the tensor's std
                _write_nvfp4(out, name, shape, std, tensors, gen)
                continue
            scale = _FP8_RANGE * std / fp8_max if dtype == torch.float8_e4m3fn else None
            step = max(1, _ROWS_VALUES // shape[1])
            for start in range(0, shape[0], step):
                rows = min(step, shape[0] - start)
                at = int(torch.randint(_ROWS_VALUES, (), generator=gen))
                w = std * pool[at : at + rows * shape[1]].view(rows, shape[1])
                w = w.to(dtype) if scale is None else (w / scale).clamp(-fp8_max, fp8_max).to(dtype)
                out.write(name, w, at=start * shape[1] * dtype.itemsize)
            if scale is not None:
                out.write(name + "_scale", torch.tensor(scale, dtype=torch.float32))
        out.write("tekken_model", tekken)
        out.finish()
    os.link(partial, path)
    os.remove(partial)


def _write_nvfp4(out, name: str, shape, std: float, tensors: dict, gen: torch.Generator) -> None:
    """An NVFP4 weight of random codes whose values have the standard deviation `std`, with its scales."""
    stem = name[: -len("weight")]
    step = max(1, _ROWS_VALUES // shape[1])
    for start in range(0, shape[0], step):
        rows = min(step, shape[0] - start)
        out.write(name, torch.randint(0, 256, (rows, shape[1]), generator=gen, dtype=torch.uint8),
                  at=start * shape[1])
    block = std / _E2M1_RMS / _NVFP4_TENSOR_SCALE
    out.write(stem + "weight_scale", torch.full(tensors[stem + "weight_scale"][1], block).to(torch.float8_e4m3fn))
    out.write(stem + "weight_scale_2", torch.tensor(_NVFP4_TENSOR_SCALE, dtype=torch.float32))


def _figures(m: Measured) -> dict:
    return {"seconds": m.seconds, "read_bytes": m.read_bytes, "peak_rss_bytes": m.peak_rss_bytes}


def _encode(clip, prompt: str):
    return clip.encode_from_tokens(clip.tokenize(prompt), return_dict=True)["cond"]


def _child_encode(path: str, cache: str) -> dict:
    """cold, warm and hit for one file; then a keep_loaded-off encode's RSS against the RSS before it."""
    from ...host.clip import lazy_clip
    from ...host.clip_weights import release_weights
    from ...loaders.cache.store import ConditioningCache
    from .meters import proc_kib

    # Unmeasured: imports, the tokenizer, and the weights' fingerprint (once per file, then remembered).
    first = lazy_clip(path, cache=cache)
    _encode(first, "warm-up")
    release_weights(first)  # the host keeps the models it ran: only the measured CLIP may hold weights
    del first
    evict([path])
    with Measured() as cold:
        clip = lazy_clip(path, cache=cache)
        cond = _encode(clip, _PROMPTS[0])
    with Measured() as warm:
        _encode(clip, _PROMPTS[1])
    release_weights(clip)
    del clip
    fresh = lazy_clip(path, cache=cache)
    with Measured() as hit:
        cached = _encode(fresh, _PROMPTS[0])
    assert torch.equal(cached, cond) and not fresh.flux2dev_source.loaded
    del fresh
    released = lazy_clip(path, cache=cache, keep_loaded=False)
    with Measured() as off:
        _encode(released, _PROMPTS[2])
    rss_left = proc_kib("VmRSS") * 1024 - off.base_rss
    entry = max(e.bytes for e in ConditioningCache(cache).entries())
    return {
        "tokens": int(cond.shape[1]),
        "file_bytes": os.path.getsize(path),
        "entry_bytes": entry,
        "cold": _figures(cold),
        "warm": _figures(warm),
        "hit": _figures(hit),
        "keep_loaded_off": {**_figures(off), "rss_left_bytes": rss_left},
    }


def bench_conditioning_cache(quick: bool) -> dict:
    """{"geometry": {width, heads, kv_heads, mlp, vocab, layers}, "rows": [one per format: {"format",
    "tokens", "file_bytes", "entry_bytes", "cold", "warm", "hit", "keep_loaded_off"}]}; cold/warm/hit hold
    seconds, read_bytes and peak_rss_bytes, keep_loaded_off also rss_left_bytes."""
    g = _ENCODERS[quick]
    layers = g.layers[0]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for fmt in ("bf16",) if quick else ("bf16", "fp8"):
            path = os.path.join(tmp, f"encoder-{fmt}.safetensors")
            write_encoder(path, g, layers, fmt)
            rows.append({"format": fmt, **in_child("encode_scenarios", "_child_encode", path,
                                                   os.path.join(tmp, f"cache-{fmt}"),
                                                   what=f"conditioning cache, {path}")})
            os.remove(path)
    geometry = {"width": g.width, "heads": g.heads, "kv_heads": g.kv_heads, "mlp": g.mlp, "vocab": g.vocab,
                "layers": layers}
    return {"geometry": geometry, "rows": rows}


def format_conditioning_cache(result: dict) -> str:
    """The rows as text, for the report."""
    g = result["geometry"]
    lines = [f"conditioning cache (encoder {g['width']} wide, {g['heads']}/{g['kv_heads']} heads, MLP {g['mlp']}, "
             f"{g['layers']} layers; time to conditioning of a {result['rows'][0]['tokens']}-token prompt):"]
    for r in result["rows"]:
        parts = []
        for name in ("cold", "warm", "hit"):
            m = r[name]
            parts.append(f"{name} {m['seconds'] * 1e3:.0f} ms, read {m['read_bytes'] / 2**20:.1f} MiB, "
                         f"peak RSS {m['peak_rss_bytes'] / 2**20:.1f} MiB")
        off = r["keep_loaded_off"]
        lines.append(f"  {r['format']} ({r['file_bytes'] / 2**20:.0f} MiB file, "
                     f"{r['entry_bytes'] / 2**20:.1f} MiB entry): "
                     + "; ".join(parts)
                     + f"; hit / warm {r['hit']['seconds'] / r['warm']['seconds']:.2%}; keep_loaded off leaves "
                     f"{off['rss_left_bytes'] / 2**20:.1f} MiB of RSS (peak {off['peak_rss_bytes'] / 2**20:.1f} MiB)")
    return "\n".join(lines)
