"""The benchmarks behind `flux2dev bench`, reported as figures and ratios (never pass/fail): dequantization per
quant type against the gguf library it replaces (on its own, inside a CPU forward pass at FLUX.2 shapes,
and beside a competing load), the parse of a Mistral-sized tokenizer header, the
tokenizer cache, the memory and disk reads of loading an encoder and a GGUF transformer, and the conditioning
cache against encoding (encode_scenarios.py). Each function returns plain data so the command can print it,
emit it as JSON, or compare runs.

Loads are measured in a fresh child process each, so that nothing this process has imported, cached or
mapped counts, and after evicting the files from the page cache, so that the bytes read are real reads."""

from __future__ import annotations

import base64
import gc
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch

from ...tokenizers.ladder import bundled_tekken_path
from ...tokenizers.vocab import byte_level_string
from ..tiny.gguf_blocks import random_blocks, write_and_close
from .convert_scenarios import bench_conversion, bench_kquant, bench_quantize, bench_vector_kernels
from .encode_scenarios import bench_conditioning_cache
from .meters import Measured, best, competing_load, evict, in_child, machine, one_thread, timings
from .upsample_scenarios import bench_upsampling

# Values per benchmarked tensor. The full size (32 MiB of fp16) is still below most FLUX.2 weights
# (6144 x 6144 = 38M values), so the output does not fit in cache, as in a real load.
_DEQUANT_VALUES = {True: 1 << 20, False: 1 << 24}
# (tokens, merges) of the header: the full size is Mistral-Small's (131072 tokens, ~270k merges).
_HEADER_SIZES = {True: (16384, 32768), False: (131072, 269443)}
_SPECIAL_TOKENS = 1000  # Tekken's reserved ids before the BPE ranks


def bench_dequant(quick: bool) -> list[dict]:
    """Per quantized type: GB/s of fp16 output for the pack, into a new tensor per call (page faults of
    fresh memory included) and into one reused output tensor (as the host's ops can), and for gguf's numpy
    dequantizer on the same blocks (its float32 result as it returns it, without a cast); the GB/s of a
    plain copy of the output size beside each row (a ceiling); and bit equality of the pack and gguf in float32."""
    import gguf

    from ...loaders.formats import kernels
    from ...loaders.formats.gguf_types import QUANTIZED_TYPES, dequantize

    n = _DEQUANT_VALUES[quick]
    repeats, reference_repeats = (3, 2) if quick else (9, 3)
    path = kernels.path("cpu", torch.float16)
    rng = np.random.default_rng(0)
    shape = (n // 4096, 4096)  # rows of 4096 values, like a weight matrix
    reused = torch.empty(shape, dtype=torch.float16)
    results = []
    for qtype in QUANTIZED_TYPES:
        raw = random_blocks(qtype, (n,), rng)
        rows = raw.reshape(shape[0], -1)
        data = torch.from_numpy(raw)
        copy_s = _copy_s(shape, repeats)
        fresh_s = best(lambda: dequantize(data, qtype, shape), repeats)
        reused_s = best(lambda: dequantize(data, qtype, shape, out=reused), repeats)
        reference_s = best(lambda: gguf.quants.dequantize(rows, qtype), reference_repeats)
        exact = np.array_equal(
            dequantize(data, qtype, shape, dtype=torch.float32).numpy().view(np.uint32),
            gguf.quants.dequantize(rows, qtype).view(np.uint32),
        )
        out_bytes = n * 2
        results.append(
            {
                "type": qtype.name,
                "path": path,
                "values": n,
                "pack_gbps": out_bytes / fresh_s / 1e9,
                "pack_reused_gbps": out_bytes / reused_s / 1e9,
                "reference_gbps": out_bytes / reference_s / 1e9,
                "copy_gbps": out_bytes / copy_s / 1e9,
                "exact": bool(exact),
            }
        )
    return results


# FLUX.2 [dev] weight shapes [out, in] (the double blocks' MLP out, the single blocks' fused in); quick: one
# small one. The contention rows use the first.
_FORWARD_SHAPES = {True: ((512, 2048),), False: ((3072, 12288), (6144, 18432))}
_COMPETING_PROCESSES = 2
# Memory-bound processes beside the second run of the forward rows: a machine whose memory is slow or busy
# (the copy ceiling drops to a fraction of an idle machine's)
_MEMORY_BOUND_PROCESSES = 1
_FORWARD_DTYPE = torch.float16


def _median(values: list[float]) -> float:
    return float(np.median(values))


def _gguf_case(qtype, shape, rng):
    """(packed rows as the loader keeps them, companions, gguf's rows for its numpy reference)."""
    raw = random_blocks(qtype, (shape[0] * shape[1],), rng).reshape(shape[0], -1)
    return torch.from_numpy(raw), {"weight_gguf_type": torch.tensor(int(qtype))}, raw


def _previous_fp8(weight, companions):
    """The fp8 rows' baseline, a plain torch dequantization: float32 cast, multiply, cast."""
    return (weight.to(torch.float32) * companions["weight_scale"]).to(_FORWARD_DTYPE)


def _previous_nvfp4(packed, companions):
    """The NVFP4 rows' baseline, a plain torch dequantization: int64 codes, a float32 table lookup, the
    scales, a multiply and a cast, each into a new tensor."""
    from ...loaders.formats.packed_dequant import _E2M1, NVFP4_BLOCK, unswizzle_block_scales

    rows, cols = packed.shape[0], packed.shape[1] * 2
    codes = torch.stack((packed >> 4, packed & 0x0F), dim=-1).reshape(rows, cols).long()
    values = torch.tensor(_E2M1, dtype=torch.float32)[codes]
    scales = unswizzle_block_scales(companions["weight_scale"], rows, cols // NVFP4_BLOCK).to(torch.float32)
    scales = scales * companions["weight_scale_2"].to(torch.float32)
    values = values.reshape(rows, cols // NVFP4_BLOCK, NVFP4_BLOCK) * scales.unsqueeze(-1)
    return values.reshape(rows, cols).to(_FORWARD_DTYPE)


def _float_case(fmt: str, shape, rng):
    """(stored weight, companions, the previous dequantization) of a fp8 or NVFP4 weight."""
    from ..tiny.encoders import swizzle_block_scales

    g = torch.Generator().manual_seed(int(rng.integers(1 << 31)))
    if fmt == "fp8-scaled":
        weight = (torch.randn(shape, generator=g) * 0.5).to(torch.float8_e4m3fn)
        return weight, {"weight_scale": torch.rand(shape[0], 1, generator=g) + 0.1}, _previous_fp8
    packed = torch.randint(0, 256, (shape[0], shape[1] // 2), dtype=torch.uint8, generator=g)
    block_scales = (torch.rand(shape[0], shape[1] // 16, generator=g) * 4).to(torch.float8_e4m3fn)
    return (packed, {"weight_scale": swizzle_block_scales(block_scales), "weight_scale_2": torch.tensor(0.01)},
            _previous_nvfp4)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.int16), b.view(torch.int16))


def _copy_s(shape, repeats: int) -> float:
    """The ceiling: seconds of a plain copy of a fp16 tensor of this shape into a reused one, the faster of
    torch's copy on every thread and on one (on a busy machine, one thread often wins: see kernels.py)."""
    src = torch.ones(shape, dtype=_FORWARD_DTYPE)
    dst = torch.zeros_like(src)
    with one_thread():
        one = best(lambda: dst.copy_(src), repeats)
    return min(one, best(lambda: dst.copy_(src), repeats))


def _torch_path(fn):
    """fn run with the one-pass kernels switched off: the torch path, which runs on GPUs and wherever numba
    cannot."""
    from ...loaders.formats import kernels

    kernel = kernels.kernel
    kernels.kernel = lambda *args: None
    try:
        return fn()
    finally:
        kernels.kernel = kernel


def _forward_figures(stored, companions, shape, repeats: int) -> tuple[torch.Tensor, dict]:
    """One packed weight as a CPU forward pass dequantizes it: its values, and a row with the copy ceiling
    measured beside it (the load of a shared machine drifts), the path that ran, its time, the torch path's
    time, and whether the two paths gave the same bits."""
    from ...host.ops import forward_weight
    from ...loaders.formats import kernels

    copy_s = _copy_s(shape, repeats)
    with torch.inference_mode():
        forward = lambda: forward_weight(stored, companions, _FORWARD_DTYPE, shape)  # noqa: E731
        got = forward().clone()  # the first call also loads the compiled kernel: not timed
        forward_s = best(forward, repeats)
        torch_s = _torch_path(lambda: best(forward, repeats))
        same = _same_bits(_torch_path(forward), got)
    return got, {"shape": list(shape), "path": kernels.path("cpu", _FORWARD_DTYPE), "forward_s": forward_s,
                 "torch_s": torch_s, "copy_s": copy_s, "exact": same}


def bench_forward_dequant(quick: bool, memory_bound: int = 0) -> dict:
    """Dequantization per layer and forward pass at FLUX.2 weight shapes, to fp16, as a CPU forward pass
    runs it: host/ops.forward_weight under inference mode (as ComfyUI runs nodes), into the scratch buffer.
    Against, in the same run and conditions: a plain copy of the output's size (the memory's ceiling); the
    torch path into the same buffer; for GGUF, gguf's numpy reference and ComfyUI-GGUF's dequantizer on the
    same bytes (where its archive is beside the clone); for fp8 and NVFP4, the ops' previous dequantization.
    memory_bound: that many memory-bound processes run beside it (a machine whose memory is slow or busy)."""
    import gguf

    from ...loaders.formats.gguf_types import QUANTIZED_TYPES
    from .peers import PEER, comfyui_gguf_dequantize, missing_reason

    repeats, reference_repeats = (2, 1) if quick else (5, 2)
    peer = comfyui_gguf_dequantize()
    rng = np.random.default_rng(2)
    gguf_rows, float_rows = [], []
    with competing_load(memory_bound, memory=True):
        load = os.getloadavg()[0]
        for shape in _FORWARD_SHAPES[quick]:
            for qtype in QUANTIZED_TYPES:
                stored, companions, raw = _gguf_case(qtype, shape, rng)
                got, row = _forward_figures(stored, companions, shape, repeats)
                reference = []
                reference_s = best(lambda: reference.append(gguf.quants.dequantize(raw, qtype)), reference_repeats)
                with np.errstate(over="ignore"):  # large K-quant values overflow fp16 the same way on both sides
                    want = torch.from_numpy(reference[-1].astype(np.float16))
                row.update(type=qtype.name, reference_s=reference_s, exact=_same_bits(got, want) and row["exact"])
                if peer is not None:
                    row["peer_s"] = best(lambda: peer(stored, qtype, shape, None).to(_FORWARD_DTYPE), reference_repeats)
                gguf_rows.append(row)
            for fmt in ("fp8-scaled", "nvfp4"):
                stored, companions, previous = _float_case(fmt, shape, rng)
                got, row = _forward_figures(stored, companions, shape, repeats)
                before_s = best(lambda: previous(stored, companions), repeats)
                row.update(format=fmt, before_s=before_s,
                           exact=_same_bits(got, previous(stored, companions)) and row["exact"])
                float_rows.append(row)
    return {"gguf": gguf_rows, "float": float_rows, "memory_bound_processes": memory_bound,
            "load_average": load, "peer": PEER if peer is not None else None,
            "peer_missing": None if peer is not None else missing_reason()}


def bench_contention(quick: bool) -> dict:
    """The GGUF rows of bench_forward_dequant at the first shape, run beside busy processes: medians of
    several calls (the pack's and gguf's numpy reference, both under the same load), and the pack's spread
    (median over fastest call), which shows calls stalled by the other jobs."""
    import gguf

    from ...host.ops import forward_weight
    from ...loaders.formats import kernels
    from ...loaders.formats.gguf_types import QUANTIZED_TYPES

    shape = _FORWARD_SHAPES[quick][0]
    repeats, reference_repeats = (3, 1) if quick else (9, 3)
    rng = np.random.default_rng(3)
    rows = []
    with competing_load(_COMPETING_PROCESSES):
        load = os.getloadavg()[0]
        for qtype in QUANTIZED_TYPES:
            stored, companions, raw = _gguf_case(qtype, shape, rng)
            with torch.inference_mode():
                forward_weight(stored, companions, _FORWARD_DTYPE, shape)  # loads the compiled kernel: not timed
                forward = timings(lambda: forward_weight(stored, companions, _FORWARD_DTYPE, shape), repeats)
            reference = timings(lambda: gguf.quants.dequantize(raw, qtype), reference_repeats)
            rows.append({"type": qtype.name, "path": kernels.path("cpu", _FORWARD_DTYPE),
                         "forward_median_s": _median(forward), "forward_best_s": min(forward),
                         "reference_median_s": _median(reference)})
    return {"shape": list(shape), "competing_processes": _COMPETING_PROCESSES, "load_average": load, "rows": rows}


def _tokenizer_arrays(n_tokens: int, n_merges: int) -> tuple[list[str], list[str]]:
    """Tokens and merges shaped like Mistral-Small's GGUF tokenizer: the real Tekken BPE vocabulary from
    mistral-common's bundled file in GPT-2 spelling, and merges split from those tokens."""
    vocab = json.loads(bundled_tekken_path().read_bytes())["vocab"]
    tokens = [f"<SPECIAL_{i}>" for i in range(_SPECIAL_TOKENS)]
    for entry in vocab[: n_tokens - _SPECIAL_TOKENS]:
        tokens.append(byte_level_string(base64.b64decode(entry["token_bytes"])))
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
    write_and_close(writer)


def bench_header(quick: bool) -> dict:
    """Seconds to parse a Mistral-sized tokenizer header: the pack's reader against gguf.GGUFReader."""
    import gguf

    from ...loaders.formats.gguf_file import open_gguf

    n_tokens, n_merges = _HEADER_SIZES[quick]
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "tokenizer.gguf")
        write_tokenizer_header(path, n_tokens, n_merges)

        def pack():
            with open_gguf(path) as f:
                assert len(f.metadata["tokenizer.ggml.tokens"]) == n_tokens

        pack_s = best(pack, 5)
        reference_s = best(lambda: gguf.GGUFReader(path), 1 if not quick else 2)
    return {"pack_s": pack_s, "reference_s": reference_s, "tokens": n_tokens, "merges": n_merges}


# --- loads, each measured in a fresh child process ---------------------------------------------------------

# Q4_K tensors of the synthetic GGUF (shape per tensor, count): FLUX.2 [dev]-sized rows, fewer of them.
_SYNTHETIC_GGUF = {True: ((3072, 3072), 2), False: ((6144, 6144), 8)}


def _child_tokenizer(folder: str) -> dict:
    from ...tokenizers import resolve_tokenizer

    start = time.perf_counter()
    first = resolve_tokenizer([folder])
    first_s = time.perf_counter() - start
    start = time.perf_counter()
    second = resolve_tokenizer([folder])
    second_s = time.perf_counter() - start
    return {"first_s": first_s, "second_s": second_s, "rung": first.rung,
            "same_tokenizer": second.tokenizer is first.tokenizer}


def _child_encoder(folder: str) -> dict:
    from ...loaders.models.encoder import load_encoder

    files = [os.path.join(folder, name) for name in sorted(os.listdir(folder)) if name.endswith(".safetensors")]
    # An unmeasured load first: lazy imports and the tokenizer (cached per process) are one-time costs,
    # so what is measured is what a load of the weights costs.
    load_encoder(folder)
    evict(files)
    with Measured() as m:
        loaded = load_encoder(folder)
    kept = sum(t.numel() * t.element_size() for t in loaded.state_dict.values())
    # Weights may be views of the mapped files, resident only once used: touch every byte kept.
    with Measured() as touched:
        for t in loaded.state_dict.values():
            t.reshape(-1).view(torch.uint8).max()
    return {
        "layers_in_file": loaded.layers_in_file,
        "layers_kept": len({k.split(".")[2] for k in loaded.state_dict if k.startswith("model.layers.")}),
        "file_bytes": sum(os.path.getsize(p) for p in files),
        "kept_bytes": kept,
        "read_bytes": m.read_bytes,
        "peak_rss_bytes": m.peak_rss_bytes,
        "seconds": m.seconds,
        "rss_per_kept_byte": m.peak_rss_bytes / kept,
        "rss_after_use_bytes": m.peak_rss_bytes + touched.peak_rss_bytes,
        "rss_after_use_per_kept_byte": (m.peak_rss_bytes + touched.peak_rss_bytes) / kept,
        "read_after_use_bytes": m.read_bytes + touched.read_bytes,
        "read_per_kept_byte": m.read_bytes / kept,
    }


def _warm_up(path: str, load) -> None:
    """One unmeasured load of a copy of the file (whose pages stay apart from the measured file's), so
    that one-time costs (lazy imports, thread pools) do not count against the file size."""
    copy = path + ".warm-up"
    shutil.copyfile(path, copy)
    try:
        load(copy)
        gc.collect()
    finally:
        os.remove(copy)


def _child_gguf_transformer(path: str) -> dict:
    from ...loaders.formats.gguf_file import parse_count
    from ...loaders.models.gguf_transformer import load_gguf_transformer

    _warm_up(path, load_gguf_transformer)
    evict([path])
    parses = parse_count()
    with Measured() as m:
        loaded = load_gguf_transformer(path)
    floats = [t for t in loaded.state_dict.values() if t.is_floating_point()]
    largest = max((t.numel() * t.element_size() for t in floats), default=0)
    return {"file": os.path.basename(path), **_gguf_figures(path, m, parse_count() - parses, largest)}


def _gguf_figures(path: str, m: Measured, header_parses: int, largest: int) -> dict:
    """A GGUF measurement against the memory budget: 1.1 x the file plus the largest dequantized tensor."""
    file_bytes = os.path.getsize(path)
    return {
        "file_bytes": file_bytes,
        "read_bytes": m.read_bytes,
        "peak_rss_bytes": m.peak_rss_bytes,
        "seconds": m.seconds,
        "header_parses": header_parses,
        "largest_dequantized_bytes": largest,
        "rss_budget_bytes": int(1.1 * file_bytes) + largest,
    }


def _child_gguf_read(path: str) -> dict:
    """open_gguf, then every tensor dequantized to fp16 once, one at a time, as a forward pass does."""
    from gguf import GGMLQuantizationType

    from ...loaders.formats.gguf_file import open_gguf, parse_count
    from ...loaders.formats.gguf_types import dequantize

    def read(path: str) -> tuple[int, int]:
        gfile = open_gguf(path)
        largest = max(dequantize(t.data, t.qtype, t.shape).nbytes for t in gfile.tensors.values())
        return len(gfile.tensors), largest

    # warm-up with one small tensor: lazy imports and thread pools, but no large allocation that the
    # allocator would keep and the measured pass reuse unseen
    dequantize(torch.zeros(144, dtype=torch.uint8), GGMLQuantizationType.Q4_K, (256,))
    evict([path])
    parses = parse_count()
    with Measured() as m:
        tensors, largest = read(path)
    return {"tensors": tensors, **_gguf_figures(path, m, parse_count() - parses, largest)}


def bench_tokenizer() -> dict:
    """Seconds of the first and the second tokenizer resolution of a folder holding tekken.json, in one
    process: the second comes from the cache."""
    from ..tiny.encoders import write_tekken

    with tempfile.TemporaryDirectory() as tmp:
        write_tekken(tmp)
        return in_child("scenarios", "_child_tokenizer", tmp, what="tokenizer")


def bench_encoder_load() -> dict:
    """A 40-layer tiny-width [dev] encoder (Mistral3 folder of sharded safetensors): peak RSS and disk
    reads of the load against the bytes it keeps (embeddings and layers 0-29 only)."""
    from ..tiny.encoders import LAYERS, write_hf_mistral3

    with tempfile.TemporaryDirectory() as tmp:
        write_hf_mistral3(tmp, layers=LAYERS)
        return in_child("scenarios", "_child_encoder", tmp, what="encoder load")


def bench_gguf_load(quick: bool) -> dict:
    """The tiny [dev] Q4_K transformer GGUF through load_gguf_transformer, and a larger synthetic Q4_K
    GGUF (not a model) opened and dequantized tensor by tensor: time, peak RSS, reads, header parses."""
    from gguf import GGMLQuantizationType as Q

    from ..tiny.gguf_transformers import SEED, gguf_tensors, tiny_bfl, write_gguf

    shape, count = _SYNTHETIC_GGUF[quick]
    rng = np.random.default_rng(1)
    with tempfile.TemporaryDirectory() as tmp:
        tiny = os.path.join(tmp, "flux2-dev-tiny-Q4_K.gguf")
        write_gguf(tiny, gguf_tensors(tiny_bfl("dev"), Q.Q4_K, SEED))
        synthetic = os.path.join(tmp, "synthetic-Q4_K.gguf")
        blocks = {f"blocks.{i}.weight": (random_blocks(Q.Q4_K, shape, rng), Q.Q4_K) for i in range(count)}
        write_gguf(synthetic, blocks)
        # The GGUF transformer's own figures at the top level; the synthetic file's under their own key.
        load = in_child("scenarios", "_child_gguf_transformer", tiny, what="GGUF transformer load")
        return {**load, "synthetic_read": in_child("scenarios", "_child_gguf_read", synthetic, what="GGUF read")}


def bench_refusal(quick: bool) -> dict:
    """Seconds for `flux2dev inspect` to refuse an 8-byte file named .safetensors (a fresh process each time, as a
    user runs it), against `python -c pass` in the same run: the command refuses before importing torch."""
    repeats = 3 if quick else 7
    with tempfile.TemporaryDirectory() as tmp:
        bad = os.path.join(tmp, "bad.safetensors")
        with open(bad, "wb") as f:
            f.write(b"12345678")
        refuse = [sys.executable, "-P", "-m", "comfyui_flux2dev.cli", "inspect", bad]
        refuse_s = best(lambda: subprocess.run(refuse, capture_output=True), repeats)
        python_s = best(lambda: subprocess.run([sys.executable, "-c", "pass"], capture_output=True), repeats)
    return {"refuse_s": refuse_s, "python_s": python_s}


def bench_long_prompt(quick: bool) -> dict:
    """The reference ids of a prompt of many megabytes (only its first 512 tokens are used): the pack, which
    tokenizes only as far as they need, against tokenizing the whole text, on the first 1 MB of it."""
    from ...tokenizers import prompt_ids, resolve_tokenizer

    tokenizer = resolve_tokenizer().tokenizer
    sentence = "a red fox in the snow beside a lighthouse at dusk, 35mm, soft light; "
    text = sentence * ((4 if quick else 20) * 10**6 // len(sentence))
    head = text[: 10**6]
    pack_s = best(lambda: prompt_ids(tokenizer, text, "reference"), 3)
    whole_s = best(lambda: tokenizer.encode(head), 2)
    return {"chars": len(text), "pack_s": pack_s, "whole_head_chars": len(head), "whole_head_s": whole_s}


def run_all(quick: bool) -> dict:
    """Every benchmark: small sizes with quick (for CI), realistic ones otherwise."""
    return {
        "machine": machine(),
        "dequant": bench_dequant(quick),
        "forward_dequant": bench_forward_dequant(quick),
        "forward_dequant_slow_memory": bench_forward_dequant(quick, _MEMORY_BOUND_PROCESSES),
        "contention": bench_contention(quick),
        "header": bench_header(quick),
        "tokenizer": bench_tokenizer(),
        "encoder_load": bench_encoder_load(),
        "load": bench_gguf_load(quick),
        "conditioning_cache": bench_conditioning_cache(quick),
        "refusal": bench_refusal(quick),
        "long_prompt": bench_long_prompt(quick),
        "quantize": bench_quantize(quick),
        "vector_kernels": bench_vector_kernels(quick),
        "kquant": bench_kquant(quick),
        "conversion": bench_conversion(quick),
        "upsampling": bench_upsampling(quick),
    }


