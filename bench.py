"""Benchmarks of the pack's GGUF reading against the gguf library it replaces, reported as figures and
ratios (never pass/fail): dequantization per quant type, and the parse of a Mistral-sized tokenizer header.
Each function returns plain data so the `flux2dev bench` command can print, compare or extend it."""

from __future__ import annotations

import base64
import json
import os
import tempfile
import time
from importlib import resources

import numpy as np
import torch

# Values per benchmarked tensor. The full size (32 MiB of fp16) is still below most FLUX.2 weights
# (6144 x 6144 = 38M values), so the output does not fit in cache, as in a real load.
_DEQUANT_VALUES = {True: 1 << 20, False: 1 << 24}
# (tokens, merges) of the header: the full size is Mistral-Small's (131072 tokens, ~270k merges).
_HEADER_SIZES = {True: (16384, 32768), False: (131072, 269443)}
_SPECIAL_TOKENS = 1000  # Tekken's reserved ids before the BPE ranks


def _best(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


# Byte offsets of the fp16 scale fields in each quant type's block (ggml's block_* structs).
_FP16_FIELDS = {
    "Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q2_K": (80, 82),
    "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "IQ4_NL": (0,), "IQ4_XS": (0,),
}


def random_blocks(qtype, n_values: int, rng: np.random.Generator) -> np.ndarray:
    """Raw bytes (uint8, 1-D) of a quantized tensor of n_values: random blocks whose fp16 scale fields
    are random but finite (no inf or NaN), as test and benchmark data for the dequantizer."""
    import gguf

    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(n_values // block_size, type_size), dtype=np.uint8)
    for offset in _FP16_FIELDS[qtype.name]:
        bits = rng.integers(0, 1 << 16, size=blocks.shape[0], dtype=np.uint16)
        bits[(bits & 0x7C00) == 0x7C00] &= 0xBFFF  # an all-ones exponent is inf/NaN: clear one of its bits
        blocks[:, offset : offset + 2] = bits.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(-1)


def bench_dequant(quick: bool) -> list[dict]:
    """Per quantized type: GB/s of fp16 output for the pack and for gguf's numpy dequantizer (which
    returns float32; its time is counted without a cast) on the same tensor, the GB/s of a plain copy
    of the output size (the ceiling), and bit equality of the two in float32."""
    import gguf

    from .loaders.gguf_dequant import QUANTIZED_TYPES, dequantize

    n = _DEQUANT_VALUES[quick]
    repeats = 3 if quick else 5
    rng = np.random.default_rng(0)
    src = torch.empty(n, dtype=torch.float16)
    dst = torch.empty_like(src)
    copy_s = _best(lambda: dst.copy_(src), repeats)
    results = []
    for qtype in QUANTIZED_TYPES:
        raw = random_blocks(qtype, n, rng)
        rows = raw.reshape(n // 4096, -1)  # rows of 4096 values, like a weight matrix
        shape = (n // 4096, 4096)
        data = torch.from_numpy(raw)
        pack_s = _best(lambda: dequantize(data, qtype, shape), repeats)
        reference_s = _best(lambda: gguf.quants.dequantize(rows, qtype), repeats)
        exact = np.array_equal(
            dequantize(data, qtype, shape, dtype=torch.float32).numpy().view(np.uint32),
            gguf.quants.dequantize(rows, qtype).view(np.uint32),
        )
        out_bytes = n * 2
        results.append(
            {
                "type": qtype.name,
                "values": n,
                "pack_gbps": out_bytes / pack_s / 1e9,
                "reference_gbps": out_bytes / reference_s / 1e9,
                "copy_gbps": out_bytes / copy_s / 1e9,
                "exact": bool(exact),
            }
        )
    return results


def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in for each byte, the spelling llama.cpp uses for BPE vocabularies."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _tokenizer_arrays(n_tokens: int, n_merges: int) -> tuple[list[str], list[str]]:
    """Tokens and merges shaped like Mistral-Small's GGUF tokenizer: the real Tekken BPE vocabulary from
    mistral-common's bundled file in GPT-2 spelling, and merges split from those tokens."""
    raw = resources.files("mistral_common").joinpath("data/tekken_240911.json").read_text(encoding="utf-8")
    vocab = json.loads(raw)["vocab"]
    spell = _byte_to_unicode()
    tokens = [f"<SPECIAL_{i}>" for i in range(_SPECIAL_TOKENS)]
    for entry in vocab[: n_tokens - _SPECIAL_TOKENS]:
        tokens.append("".join(spell[b] for b in base64.b64decode(entry["token_bytes"])))
    merges = []
    for token in tokens[_SPECIAL_TOKENS:]:
        if len(token) > 1:
            merges.append(f"{token[:1]} {token[1:]}")
            merges.append(f"{token[:-1]} {token[-1:]}")
        if len(merges) >= n_merges:
            break
    return tokens, merges[:n_merges]


def write_tokenizer_header(path: str, n_tokens: int, n_merges: int) -> None:
    """A GGUF file holding a Mistral-style tokenizer header and no tensors."""
    import gguf

    tokens, merges = _tokenizer_arrays(n_tokens, n_merges)
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("tekken")
    writer.add_token_list(tokens)
    writer.add_token_types([3] * _SPECIAL_TOKENS + [1] * (len(tokens) - _SPECIAL_TOKENS))
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def bench_header(quick: bool) -> dict:
    """Seconds to parse a Mistral-sized tokenizer header: the pack's reader against gguf.GGUFReader."""
    import gguf

    from .loaders.gguf_file import open_gguf

    n_tokens, n_merges = _HEADER_SIZES[quick]
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "tokenizer.gguf")
        write_tokenizer_header(path, n_tokens, n_merges)

        def pack():
            with open_gguf(path) as f:
                assert len(f.metadata["tokenizer.ggml.tokens"]) == n_tokens

        pack_s = _best(pack, 5)
        reference_s = _best(lambda: gguf.GGUFReader(path), 1 if not quick else 2)
    return {"pack_s": pack_s, "reference_s": reference_s, "tokens": n_tokens, "merges": n_merges}


def format_table(results: list[dict]) -> str:
    """The dequantization results as an aligned text table, with the geometric mean of the speed-ups."""
    lines = [f"{'type':8} {'values':>10} {'pack GB/s':>10} {'gguf GB/s':>10} {'ratio':>7} {'copy GB/s':>10}  exact"]
    ratios = []
    for r in results:
        ratio = r["pack_gbps"] / r["reference_gbps"]
        ratios.append(ratio)
        lines.append(
            f"{r['type']:8} {r['values']:>10} {r['pack_gbps']:>10.2f} {r['reference_gbps']:>10.2f} "
            f"{ratio:>6.1f}x {r['copy_gbps']:>10.1f}  {'yes' if r['exact'] else 'NO'}"
        )
    if ratios:
        lines.append(f"geometric mean speed-up: {float(np.exp(np.mean(np.log(ratios)))):.1f}x")
    return "\n".join(lines)
