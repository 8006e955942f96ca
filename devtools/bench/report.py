"""The benchmark figures as text: the dequantization tables and the whole report."""

from __future__ import annotations

import numpy as np

from .convert_scenarios import format_conversion, format_kquant, format_quantize, format_vector_kernels
from .encode_scenarios import format_conditioning_cache
from .upsample_scenarios import format_upsampling


def _geomean(values: list[float]) -> float:
    return float(np.exp(np.mean(np.log(values))))


def format_table(results: list[dict]) -> str:
    """The dequantization results as an aligned text table, with the geometric means of the speed-ups."""
    lines = [
        f"{'type':8} {'path':6} {'values':>9} {'new out':>8} {'reused':>8} {'gguf':>6} {'ratio new':>10} "
        f"{'ratio reused':>13} {'copy':>6} {'of copy':>8}  exact",
        f"{'':8} {'':6} {'':>9} {'GB/s':>8} {'GB/s':>8} {'GB/s':>6} {'':>10} {'':>13} {'GB/s':>6} {'reused':>8}",
    ]
    fresh, reused = [], []
    for r in results:
        fresh.append(r["pack_gbps"] / r["reference_gbps"])
        reused.append(r["pack_reused_gbps"] / r["reference_gbps"])
        lines.append(
            f"{r['type']:8} {r['path']:6} {r['values']:>9} {r['pack_gbps']:>8.2f} {r['pack_reused_gbps']:>8.2f} "
            f"{r['reference_gbps']:>6.2f} {fresh[-1]:>9.1f}x {reused[-1]:>12.1f}x {r['copy_gbps']:>6.1f} "
            f"{r['pack_reused_gbps'] / r['copy_gbps']:>8.0%}  {'yes' if r['exact'] else 'NO'}"
        )
    if results:
        lines.append(
            f"geometric mean speed-up: {_geomean(fresh):.1f}x into new tensors, "
            f"{_geomean(reused):.1f}x into a reused one"
        )
    return "\n".join(lines)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f}"


def _shape(shape) -> str:
    return "x".join(map(str, shape))


def format_forward(results: dict) -> str:
    """The per-forward dequantization at FLUX.2 shapes: each row against gguf's numpy reference, ComfyUI-GGUF
    (where it was there), the torch path and the copy ceiling; fp8 and NVFP4 against a plain torch
    dequantization (the `before` column); the worst of each."""
    peer = results["peer"] is not None
    lines = [
        f"{'type':7} {'shape':>10} {'path':6} {'gguf ms':>8} {'peer ms':>8} {'torch ms':>8} {'forward ms':>10} "
        f"{'x gguf':>7} {'x peer':>7} {'x torch':>7} {'of copy':>7}  exact",
    ]
    for r in results["gguf"]:
        peer_ms, x_peer = (_ms(r["peer_s"]), f"{r['peer_s'] / r['forward_s']:.1f}x") if peer else ("-", "-")
        lines.append(
            f"{r['type']:7} {_shape(r['shape']):>10} {r['path']:6} {_ms(r['reference_s']):>8} "
            f"{peer_ms:>8} {_ms(r['torch_s']):>8} {_ms(r['forward_s']):>10} "
            f"{r['reference_s'] / r['forward_s']:>6.1f}x {x_peer:>7} "
            f"{r['torch_s'] / r['forward_s']:>6.1f}x {r['copy_s'] / r['forward_s']:>7.0%}  "
            f"{'yes' if r['exact'] else 'NO'}"
        )
    rows = results["gguf"]
    worst = min(rows, key=lambda r: r["reference_s"] / r["forward_s"])
    slowest = min(rows, key=lambda r: r["copy_s"] / r["forward_s"])
    lines.append(
        f"lowest inside a forward pass: {worst['reference_s'] / worst['forward_s']:.1f}x gguf ({worst['type']} "
        f"{_shape(worst['shape'])}), {slowest['copy_s'] / slowest['forward_s']:.0%} of the copy ceiling "
        f"({slowest['type']} {_shape(slowest['shape'])})"
        + (f", {min(r['peer_s'] / r['forward_s'] for r in rows):.1f}x ComfyUI-GGUF" if peer else "")
    )
    lines.append(
        f"{'format':10} {'shape':>10} {'path':6} {'before ms':>9} {'torch ms':>8} {'forward ms':>10} {'speed-up':>9} "
        f"{'x torch':>7} {'of copy':>7}  exact"
    )
    for r in results["float"]:
        lines.append(
            f"{r['format']:10} {_shape(r['shape']):>10} {r['path']:6} {_ms(r['before_s']):>9} {_ms(r['torch_s']):>8} "
            f"{_ms(r['forward_s']):>10} {r['before_s'] / r['forward_s']:>8.1f}x {r['torch_s'] / r['forward_s']:>6.1f}x "
            f"{r['copy_s'] / r['forward_s']:>7.0%}  {'yes' if r['exact'] else 'NO'}"
        )
    copies = {}
    for r in results["gguf"] + results["float"]:
        copies.setdefault(_shape(r["shape"]), []).append(2 * np.prod(r["shape"]) / r["copy_s"] / 1e9)
    lines.append("copy ceiling (fp16 into a reused tensor, the faster of every thread and one, beside each row): "
                 + ", ".join(f"{shape} {min(gbps):.1f}-{max(gbps):.1f} GB/s" for shape, gbps in copies.items()))
    if not peer:
        lines.append(f"peer: not measured, {results['peer_missing']}")
    return "\n".join(lines)


def _forward_title(results: dict) -> str:
    beside = results["memory_bound_processes"]
    return (
        "Dequantization inside a CPU forward pass, to fp16, per layer "
        + (f"beside {beside} memory-bound process{'es' if beside > 1 else ''} "
           f"(load average {results['load_average']:.2f})"
           if beside else f"(load average {results['load_average']:.2f})")
        + "\n(forward: host/ops.forward_weight into the scratch buffer, by the path named; gguf: its numpy reference; "
        + f"peer: {results['peer'] or 'ComfyUI-GGUF'}'s dequantize\nas its layers call it; "
          "torch: the pack's torch path, "
        + "which ran before the one-pass kernels; before: a plain torch fp8 and NVFP4\ndequantization "
        + "(widen, scale, cast); "
        + "of copy: the copy's time over the forward's, for the same output bytes)"
    )


def format_contention(results: dict) -> str:
    """The GGUF forward rows beside a competing load: medians, the pack's spread, the ratio to gguf."""
    lines = [
        f"{'type':10} {'path':6} {'forward ms':>10} {'spread':>7} {'gguf ms':>8} {'ratio':>6}",
        f"{'':10} {'':6} {'median':>10} {'':>7} {'median':>8}",
    ]
    ratios = []
    for r in results["rows"]:
        ratios.append(r["reference_median_s"] / r["forward_median_s"])
        lines.append(
            f"{r['type']:10} {r['path']:6} {_ms(r['forward_median_s']):>10} "
            f"{r['forward_median_s'] / r['forward_best_s']:>6.1f}x "
            f"{_ms(r['reference_median_s']):>8} {ratios[-1]:>5.1f}x"
        )
    lines.append(f"lowest ratio under load: {min(ratios):.1f}x gguf, geometric mean {_geomean(ratios):.1f}x")
    return "\n".join(lines)


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


def format_report(results: dict) -> str:
    m, h, t, e, load, c = (results[k] for k in ("machine", "header", "tokenizer", "encoder_load", "load", "contention"))
    r, p = results["refusal"], results["long_prompt"]
    tiny, synthetic = load, load["synthetic_read"]
    lines = [
        f"machine: {m['cpu_count']} CPUs, torch {m['torch_version']} with {m['torch_threads']} threads, "
        f"{m['platform']}, Python {m['python']}, {m['date']}, load average {m['load_average']:.2f}",
        "",
        "Dequantization to fp16 (pack: into a new tensor per call / into one reused tensor; gguf: its numpy reference)",
        format_table(results["dequant"]),
        "",
        _forward_title(results["forward_dequant"]),
        format_forward(results["forward_dequant"]),
        "",
        _forward_title(results["forward_dequant_slow_memory"]),
        format_forward(results["forward_dequant_slow_memory"]),
        "",
        f"The same beside {c['competing_processes']} busy processes (load average {c['load_average']:.2f}), "
        f"{_shape(c['shape'])}, medians; spread: the pack's median over its fastest call",
        format_contention(c),
        "",
        f"GGUF tokenizer header ({h['tokens']} tokens, {h['merges']} merges): pack {h['pack_s'] * 1e3:.1f} ms, "
        f"gguf.GGUFReader {h['reference_s'] * 1e3:.1f} ms ({h['reference_s'] / h['pack_s']:.1f}x)",
        f"tokenizer from tekken.json ({t['rung']}): first resolve {t['first_s']:.2f} s, "
        f"second {t['second_s'] * 1e3:.2f} ms "
        f"(same object: {t['same_tokenizer']})",
        "",
        f"encoder load (tiny width, {e['layers_kept']} of {e['layers_in_file']} layers kept, safetensors, "
        "page cache evicted):",
        f"  file {_mib(e['file_bytes'])}, kept {_mib(e['kept_bytes'])} "
        f"({e['kept_bytes'] / e['file_bytes']:.0%} of the file), "
        f"read {_mib(e['read_bytes'])}, peak RSS {_mib(e['peak_rss_bytes'])}, {e['seconds']:.2f} s",
        f"  peak RSS / kept {e['rss_per_kept_byte']:.2f}, read / kept {e['read_per_kept_byte']:.2f}; after touching "
        f"every kept byte: RSS {_mib(e['rss_after_use_bytes'])} ({e['rss_after_use_per_kept_byte']:.2f} x kept), "
        f"read {_mib(e['read_after_use_bytes'])}",
        "",
        f"GGUF transformer load ({tiny['file']}, load_gguf_transformer): file {_mib(tiny['file_bytes'])}, "
        f"peak RSS {_mib(tiny['peak_rss_bytes'])}, read {_mib(tiny['read_bytes'])}, {tiny['seconds'] * 1e3:.0f} ms, "
        f"header parsed {tiny['header_parses']}x",
        f"synthetic GGUF ({synthetic['tensors']} Q4_K tensors, not a model; open + every tensor dequantized once): "
        f"file {_mib(synthetic['file_bytes'])}, peak RSS {_mib(synthetic['peak_rss_bytes'])} "
        f"(budget 1.1 x file + largest dequantized {_mib(synthetic['largest_dequantized_bytes'])} = "
        f"{_mib(synthetic['rss_budget_bytes'])}), read {_mib(synthetic['read_bytes'])}, {synthetic['seconds']:.2f} s, "
        f"header parsed {synthetic['header_parses']}x",
        "",
        format_conditioning_cache(results["conditioning_cache"]),
        "",
        f"`flux2dev inspect` refusing an 8-byte .safetensors file: {r['refuse_s'] * 1e3:.0f} ms, `python -c pass` "
        f"{r['python_s'] * 1e3:.0f} ms ({r['refuse_s'] / r['python_s']:.1f}x)",
        f"reference ids of a {p['chars'] / 1e6:.0f}-million-character prompt: {p['pack_s'] * 1e3:.1f} ms; tokenizing "
        f"the whole of its first {p['whole_head_chars'] / 1e6:.0f} million characters: "
        f"{p['whole_head_s'] * 1e3:.0f} ms",
        "",
        "GGUF quantization of float32 weights (pack: gguf_types.quantize into one reused output, as a conversion "
        "writes; gguf: gguf.quants.quantize;\nGB/s: bytes read and written, the pack's and a plain copy's of the same "
        "weights on the quantizer's threads, measured before the row)",
        format_quantize(results["quantize"]),
        format_vector_kernels(results["vector_kernels"]),
        format_conversion(results["conversion"]),
        "",
        format_kquant(results["kquant"]),
        "",
        format_upsampling(results["upsampling"]),
    ]
    return "\n".join(lines)
