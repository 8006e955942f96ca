"""`flux2dev bench --real DIR`: FLUX.2 [dev]'s text encoder at its real size, beside the host's own CLIPLoader
and ComfyUI-GGUF's CLIPLoaderGGUF on the same files. Each step runs in a process of its own, which is sampled for
its wall time, its peak anonymous memory (its own: what the machine must have free), its peak mapped memory
(file pages: the kernel reads them as they are touched and takes them back under pressure) and the most files it
held open (a loaded model file costs one, whatever its tensors number; macOS starts programs with a limit of 256).

The files are written once into DIR and reused by later runs: the 30 layers of Mistral-Small 24B that FLUX.2
reads, with random weights of realistic scale, in ComfyUI's single-file form as bf16 (34.7 GB, written in a stream
after checking the disk space), then its fp8 and Q4_K_M GGUF by `flux2dev convert`, measured as they are made.
Rows: each file encoded by the pack in both padding modes (the reference's 512 tokens and the host's), by the
host's CLIPLoader (type flux2; safetensors files) and by ComfyUI-GGUF (the GGUF). A loader whose own memory would
outgrow the machine is stopped first and its row says so. Then the transformer's rows (real_transformer.py). CI runs
none of it: tests/devtools/test_real_size.py runs the same code on the benchmark encoder (the real width, 3 layers)
and transformer (the real width, one block of each kind)."""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil

import torch

from ...loaders.models.variants import MISTRAL_SMALL, MistralEncoderGeometry, layers_kept
from ...tokenizers.prompt import PADDING_MODES, left_padding_mask
from .encode_scenarios import _PROMPTS, encoder_tensors, write_encoder
from .meters import cache, evict, machine, proc_kib, sampled_call
from .real_transformer import LATENT, TEXT_TOKENS, bench_real_transformer
from .roofline import encode_flops, layer_bytes, machine_rates, measured_against, read_from

BF16 = "bf16"
WRITTEN = {BF16: "bf16.safetensors", "nvfp4": "fp4_mixed.safetensors"}  # written random, as encode_scenarios writes
CONVERSIONS = {"fp8": ("fp8.safetensors", ["--dtype", "fp8"]), "Q8_0": ("Q8_0.gguf", ["--type", "Q8_0"]),
               "Q4_K_M": ("Q4_K_M.gguf", ["--type", "Q4_K_M"])}
FORMATS = (BF16, "fp8", "nvfp4", "Q8_0", "Q4_K_M")
# Where the bench holds a run to the mark: within 1.5x of its roofline, plus start-up (imports, headers,
# tokenizer) in the step's wall time.
ROOFLINE_FACTOR, START_UP_S = 1.5, 20.0
_MARGIN = 1 << 30  # the disk space and memory left over, beyond what a step needs
_HOST_PADDING = "comfy"  # the host's CLIPLoader and ComfyUI-GGUF pad as the host does


def _name(fmt: str) -> str:
    return f"flux2-dev-encoder-{WRITTEN[fmt] if fmt in WRITTEN else CONVERSIONS[fmt][0]}"


def _memory_available() -> int:
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))


def _digest(cond: torch.Tensor) -> str:
    return hashlib.sha256(cond.float().contiguous().numpy().tobytes()).hexdigest()[:16]


def _encoded(clip, started_anon: int) -> dict:
    import time

    tokens = clip.tokenize(_PROMPTS[0])
    start = time.perf_counter()
    with torch.inference_mode():  # as ComfyUI runs a node
        cond = clip.encode_from_tokens(tokens, return_dict=True)["cond"]
    (ids,) = ([t[0] for t in seq] for seq in next(iter(tokens.values())))
    return {"encode_s": time.perf_counter() - start, "anon_before_bytes": started_anon,
            "tokens": int(cond.shape[1]), "pads": len(ids) - sum(left_padding_mask(ids)), "digest": _digest(cond)}


def rates(path: str) -> dict:
    """The machine's rates the pack's encodes are measured against (roofline.py), in the dtype its encoder multiplies
    in here."""
    from ...host.ops import fast_cpu_matmul_dtype

    return machine_rates(MISTRAL_SMALL, fast_cpu_matmul_dtype() or torch.float32, path)


# --- the steps, each run in a process of its own ----------------------------------------------------------------


def pack_encode(path: str, padding: str) -> dict:
    """The pack's CLIP, as its encoder node makes it (headers and tokenizer read), then one prompt encoded."""
    from ...host.clip import lazy_clip

    clip = lazy_clip(path, padding=padding)
    return _encoded(clip, proc_kib("RssAnon") * 1024)


def _flux2_clip_type():
    """What the host's CLIPLoader (and ComfyUI-GGUF's) make of type "flux2": releases before 0.33 have no FLUX2
    member and take the default, under which they find the Mistral encoder by its weights."""
    import comfy.sd

    return getattr(comfy.sd.CLIPType, "FLUX2", comfy.sd.CLIPType.STABLE_DIFFUSION)


def host_encode(path: str) -> dict:
    """The host's own CLIPLoader (type flux2) on the file."""
    from ...host import ensure_comfy

    ensure_comfy()
    import comfy.sd

    started = proc_kib("RssAnon") * 1024
    clip = comfy.sd.load_clip(ckpt_paths=[path], clip_type=_flux2_clip_type())
    return _encoded(clip, started)


def peer_encode(path: str) -> dict:
    """ComfyUI-GGUF's CLIPLoaderGGUF (type flux2) on the file."""
    from ...host import ensure_comfy
    from .peers import comfyui_gguf_nodes

    ensure_comfy()
    loader = comfyui_gguf_nodes().CLIPLoaderGGUF()
    started = proc_kib("RssAnon") * 1024
    clip = loader.load_patcher([path], _flux2_clip_type(), loader.load_data([path]))
    return _encoded(clip, started)


def convert(src: str, out: str, options: list[str]) -> dict:
    from ...cli import main

    if main(["convert", "encoder", src, out, *options]):
        raise SystemExit(f"convert encoder {src} {out} failed")
    return {}


def _step(function: str, *args, what: str, anon_limit: int) -> dict:
    return sampled_call("real_size", function, *args, what=what, anon_limit=anon_limit)


def _started(path: str, rates: dict) -> dict:
    """The file put where the roofline reads it from (read_from), before a loader's step: in the page cache where it
    fits in the memory, else evicted; every loader starts alike."""
    where = read_from(rates, os.path.getsize(path))
    (evict if where == "disk" else cache)([path])
    return {"started_from": where}


# --- the files ------------------------------------------------------------------------------------------------


def _written(folder: str, g: MistralEncoderGeometry, layers: int, fmt: str = BF16) -> str:
    path = os.path.join(folder, _name(fmt))
    size = sum(d.itemsize * math.prod(s) for d, s, _ in encoder_tensors(g, layers, fmt).values())
    if os.path.isfile(path) and os.path.getsize(path) >= size:
        return path
    free = shutil.disk_usage(folder).free
    if free < size + _MARGIN:
        raise RuntimeError(f"{folder} has {free / 1e9:.1f} GB free; the {fmt} encoder takes {size / 1e9:.1f} GB.")
    write_encoder(path, g, layers, fmt)
    return path


def _made(folder: str, g: MistralEncoderGeometry, layers: int, fmt: str, anon_limit: int) -> str:
    """The `fmt` file in `folder`: the bf16 and NVFP4 ones written, the others converted from the bf16 one, where
    missing (each conversion measured, its figures kept in conversions.json)."""
    path = os.path.join(folder, _name(fmt))
    if fmt in WRITTEN or os.path.isfile(path):
        return _written(folder, g, layers, fmt) if fmt in WRITTEN else path
    source = _written(folder, g, layers)
    record = os.path.join(folder, "conversions.json")
    made = json.load(open(record)) if os.path.isfile(record) else {}
    made[fmt] = _step("convert", source, path, CONVERSIONS[fmt][1], what=f"convert to {fmt}", anon_limit=anon_limit)
    if os.path.isfile(path):
        made[fmt]["file_bytes"] = os.path.getsize(path)
    with open(record + ".partial", "w") as f:
        json.dump(made, f)
    os.replace(record + ".partial", record)  # the bench's own record in its own folder
    return path


# --- the run ----------------------------------------------------------------------------------------------------


def bench_real_encoder(folder: str, g: MistralEncoderGeometry = MISTRAL_SMALL, formats=FORMATS,
                       paddings=PADDING_MODES, peers: bool = True) -> dict:
    """{"machine", "geometry", "rates", "files", "conversions", "rows"}: a row per loader, file and padding mode, with
    where its file started (started_from), seconds, peak_anon_bytes, peak_mapped_bytes and peak_open_files of its
    process, and "result" (the encode's seconds, the process's own memory before it, the tokens and a digest of the
    conditioning), "failed" or "over_limit"; the pack's rows also its "roofline" against the machine's rates,
    measured first."""
    os.makedirs(folder, exist_ok=True)
    layers = layers_kept(g)
    anon_limit = _memory_available() - _MARGIN
    rows, files, machine_limits = [], {}, None
    for fmt in formats:  # each made just before its rows: a machine may lack the disk for all at once
        path = _made(folder, g, layers, fmt, anon_limit)
        files[fmt] = os.path.getsize(path)
        if machine_limits is None:  # measured once, on the first file, before any encode
            machine_limits = _step("rates", path, what="the machine's rates", anon_limit=anon_limit)["result"]
        for padding in paddings:
            row = {"loader": "pack", "format": fmt, "padding": padding, **_started(path, machine_limits),
                   **_step("pack_encode", path, padding, what=f"pack, {fmt}", anon_limit=anon_limit)}
            if "result" in row:
                r = row["result"]
                row["roofline"] = measured_against(machine_limits, encode_flops(g, layers, r["tokens"] - r["pads"],
                                                                                r["pads"]),
                                                   layer_bytes(path), files[fmt], r["encode_s"])
                row["roofline"]["within_mark"] = \
                    row["seconds"] <= ROOFLINE_FACTOR * row["roofline"]["roofline_s"] + START_UP_S
            rows.append(row)
        if peers:
            loader, function = ("ComfyUI-GGUF", "peer_encode") if path.endswith(".gguf") else ("host", "host_encode")
            rows.append({"loader": loader, "format": fmt, "padding": _HOST_PADDING, **_started(path, machine_limits),
                         **_step(function, path, what=f"{loader}, {fmt}", anon_limit=anon_limit)})
    record = os.path.join(folder, "conversions.json")
    return {
        "machine": {**machine(), "memory_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")},
        "geometry": {"width": g.width, "layers": layers, "vocab": g.vocab, "mlp": g.mlp},
        "rates": machine_limits,
        "files": files,
        "conversions": json.load(open(record)) if os.path.isfile(record) else {},
        "rows": rows,
    }


def bench_real(folder: str) -> dict:
    """The encoder's rows, then the transformer's (real_transformer.py), each file written just before its rows."""
    result = bench_real_encoder(folder)
    result["transformer"] = bench_real_transformer(folder, anon_limit=_memory_available() - _MARGIN, margin=_MARGIN)
    return result


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f}"


def _files(row: dict) -> str:
    """A row's peak open files; blank in records made before they were sampled (conversions.json keeps old ones)."""
    return str(row.get("peak_open_files", ""))


def _outcome(row: dict) -> str:
    if "over_limit" in row:
        return f"stopped: its own memory passed {_gb(row['over_limit'])} GB"
    if "failed" in row:
        return f"fails: {row['failed']}"
    r = row["result"]
    if "forward_s" in r:
        return (f"load {r['load_s']:.1f} s (own {_gb(r['anon_loaded_bytes'] - r['anon_before_bytes'])} GB after it), "
                f"forward {r['forward_s']:.0f} s, output rms {r['rms']:.4f}")
    return f"{r['tokens']} tokens, encode {r['encode_s']:.1f} s, conditioning {r['digest']}"


def format_real(result: dict) -> str:
    """The run as a Markdown table (docs/benchmarks.md keeps one)."""
    m, r = result["machine"], result["rates"]
    lines = [f"Real size, {m['date']}: {m['cpu_count']} cores, {_gb(m['memory_bytes'])} GB of RAM, torch "
             f"{m['torch_version']}; the encoder's {result['geometry']['layers']} layers "
             f"({result['geometry']['width']} wide).", "",
             f"Measured against (roofline.py): matmuls at {r['matmul_flops'] / 1e12:.2f} TFLOP/s in {r['dtype']} on "
             f"the encoder's shapes, the file read at {r['cache_bytes_s'] / 1e9:.1f} GB/s from the page cache and "
             f"{r['disk_bytes_s'] / 1e9:.2f} GB/s from the disk (for a file larger than the "
             f"{_gb(r['memory_available_bytes'])} GB available); every step starts with its file where that says. "
             f"The mark: a step's wall time within "
             f"{ROOFLINE_FACTOR:g}x its roofline plus {START_UP_S:.0f} s of start-up.", "",
             "| step | file GB | wall s | peak own (anon) GB | peak mapped GB | peak open files | roofline s | "
             "encode / roofline | within the mark | outcome |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for fmt, row in result["conversions"].items():
        lines.append(f"| convert bf16 -> {fmt} | {_gb(row.get('file_bytes', 0))} | {row['seconds']:.0f} | "
                     f"{_gb(row['peak_anon_bytes'])} | {_gb(row['peak_mapped_bytes'])} | {_files(row)} | | | | "
                     f"{'written' if 'result' in row else _outcome(row)} |")
    for row in result["rows"]:
        roof = row.get("roofline")
        against = (f"{roof['roofline_s']:.1f} ({roof['read_from']}) | {roof['ratio']:.2f} | "
                   f"{'yes' if roof['within_mark'] else 'no'}") if roof else " | | "
        lines.append(f"| {row['loader']} encode, {row['format']}, {row['padding']} padding | "
                     f"{_gb(result['files'][row['format']])} | {row['seconds']:.0f} | {_gb(row['peak_anon_bytes'])} | "
                     f"{_gb(row['peak_mapped_bytes'])} | {_files(row)} | {against} | {_outcome(row)} |")
    if "transformer" in result:
        lines += ["", format_transformer(result["transformer"])]
    return "\n".join(lines)


def format_transformer(result: dict) -> str:
    """The transformer's rows as a Markdown table."""
    double, single = result["blocks"]
    lines = [f"The transformer ({double} double and {single} single blocks): a load and one forward at a "
             f"{LATENT[2] * 16}x{LATENT[3] * 16} image's latent and {TEXT_TOKENS} text tokens, in float32.", "",
             "| loader, file | file GB | wall s | peak own (anon) GB | peak mapped GB | peak open files | outcome |",
             "|---|---|---|---|---|---|---|"]
    for row in result["rows"]:
        size = _gb(result["files"][row["format"]])
        if "seconds" not in row:  # not run: its reason
            lines.append(f"| {row['loader']}, {row['format']} | {size} | | | | | {row['failed']} |")
            continue
        lines.append(f"| {row['loader']}, {row['format']} | {size} | {row['seconds']:.0f} | "
                     f"{_gb(row['peak_anon_bytes'])} | {_gb(row['peak_mapped_bytes'])} | {_files(row)} | "
                     f"{_outcome(row)} |")
    return "\n".join(lines)
