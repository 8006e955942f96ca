"""The GPU check's steps (devtools/gpu-check runs them on a GPU machine, each inside `bash tests/run devtools`, so
on the host tree it names; docs/development.md). Each writes JSON into the check's folder; `report` turns those
and the tests' JUnit files into report.md:

- measure: dequantization GB/s per GGUF type and packed format, against the device's copy bandwidth and against
  ComfyUI-GGUF's dequantizers on the same bytes (../shared/peers); the packed Linear forward at FLUX.2 [dev]
  shapes against ComfyUI-GGUF's layer and a dense bf16 F.linear, with the weights on the GPU and left on the CPU
  (the host's offloading); the encoder's time to conditioning at [dev]'s real width with 3 layers, in bf16, fp8
  and GGUF Q4_K;
- sample: the official graph on the tiny models through a headless ComfyUI on the GPU, with the patcher classes
  the pack's MODEL and CLIP got (their log lines), and the host's device-selection nodes on them;
- report: everything as one text.

The functions take the device and a `quick` flag so that the tests run them on the CPU at small sizes.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import re
import sys
import tarfile
import tempfile
import time
import types
import xml.etree.ElementTree as ET
from pathlib import Path

import numpy as np
import torch

from ..cli import UsageError, run

NO_GPU = "torch sees no CUDA GPU here, so there is nothing to measure; the GPU check runs on a machine with one."
# FLUX.2 [dev] weights [out, in] (hidden 6144, an MLP of 18432 with SiLU gating): a double block's qkv, its MLP's
# output, a single block's fused input. Quick (the tests, on the CPU): one small one.
LINEAR_SHAPES = {False: ((18432, 6144), (6144, 18432), (55296, 6144)), True: ((64, 512),)}
TOKENS = {False: 4096 + 512, True: 8}  # a 1024x1024 image and the prompt
DEQUANT_VALUES = {False: 1 << 26, True: 1 << 14}  # 128 MiB of bf16 output
EXACT_VALUES = 1 << 14  # values checked bit for bit against the CPU references
OFFLOADED = ("Q4_K", "fp8-scaled")  # the formats measured with the weight left on the CPU
REPEATS = {False: 10, True: 2}
DTYPE = torch.bfloat16  # what FLUX.2 runs in on a GPU
LOG_LINE = re.compile(r"FLUX\.2 (?:\[dev\] )?(MODEL|CLIP) ready: (\w+) patcher, computing on (\S+),")


def _seconds(fn, device: torch.device, repeats: int) -> float:
    """The fastest of `repeats` calls after one to warm up: timed by the device's own clock on a GPU."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            best = min(best, start.elapsed_time(end) / 1e3)
        else:
            begin = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - begin)
    return best


# --- ComfyUI-GGUF, the peer -------------------------------------------------------------------------------


def load_peer(peers: Path | None):
    """ComfyUI-GGUF's dequant and ops modules, from its tarball in `peers` unpacked into a temporary folder (as a
    package of another name: its own folder name is no Python name), or (None, why not)."""
    from ..host import ensure_comfy

    tarballs = sorted(peers.glob("comfyui-gguf-*.tar.gz")) if peers and peers.is_dir() else []
    if not tarballs:
        return None, f"ComfyUI-GGUF is not in {peers} (its tarball, comfyui-gguf-*.tar.gz)"
    unpacked = tempfile.TemporaryDirectory(prefix="flux2dev-peer-")  # held by the result, removed with it
    folder = Path(unpacked.name)
    with tarfile.open(tarballs[-1]) as t:
        t.extractall(folder, filter="data")
    ensure_comfy()  # its ops build on the host's
    package = types.ModuleType("flux2dev_peer_gguf")
    package.__path__ = [str(folder / "ComfyUI-GGUF")]
    sys.modules[package.__name__] = package
    dequant = importlib.import_module(f"{package.__name__}.dequant")
    ops = importlib.import_module(f"{package.__name__}.ops")
    return types.SimpleNamespace(name=tarballs[-1].name.removesuffix(".tar.gz"), dequant=dequant, ops=ops,
                                 folder=unpacked), None


def _peer_tensor(peer, data: torch.Tensor, qtype, shape) -> torch.Tensor:
    return peer.ops.GGMLTensor(data, tensor_type=qtype, tensor_shape=torch.Size(shape))


def _peer_reads(peer, qtype) -> bool:
    return peer is not None and qtype in peer.dequant.dequantize_functions


# --- the packed weights -----------------------------------------------------------------------------------


def _weights(shape, rng) -> list[tuple[str, object, torch.Tensor, dict]]:
    """(format, GGUF type or None, stored weight, companions) of every format the pack dequantizes, on the CPU."""
    from ..loaders.formats.gguf_types import QUANTIZED_TYPES
    from .bench.scenarios import _float_case, _gguf_case

    out = []
    for qtype in QUANTIZED_TYPES:
        stored, companions, _ = _gguf_case(qtype, shape, rng)
        out.append((qtype.name, qtype, stored, companions))
    for fmt in ("fp8-scaled", "nvfp4"):
        stored, companions, _ = _float_case(fmt, shape, rng)
        out.append((fmt, None, stored, companions))
    return out


def _on(companions: dict, device) -> dict:
    return {k: v.to(device) for k, v in companions.items()}


def _exact(fmt: str, qtype, device: torch.device, rng) -> bool:
    """The pack's float32 values on `device` bit for bit against the format's independent reference on the CPU:
    gguf's numpy dequantizer, comfy_kitchen's NVFP4, fp8 times its scale in float32."""
    import gguf
    from comfy_kitchen.backends.eager.quantization import dequantize_nvfp4

    from ..loaders.formats import packed_dequant

    shape = (EXACT_VALUES // 512, 512)
    ((_, _, stored, companions),) = [w for w in _weights(shape, rng) if w[0] == fmt]
    got = packed_dequant.dequantize(stored.to(device), _on(companions, device), torch.float32, shape).cpu()
    if qtype is not None:
        want = torch.from_numpy(gguf.quants.dequantize(stored.numpy(), qtype).reshape(shape))
    elif fmt == "nvfp4":
        want = dequantize_nvfp4(stored, companions["weight_scale_2"], companions["weight_scale"],
                                output_type=torch.float32)
    else:
        want = stored.float() * companions["weight_scale"].float()
    return torch.equal(got.view(torch.int32), want.view(torch.int32))


def bench_dequant(device: torch.device, quick: bool, peer) -> dict:
    """Per format: GB/s of bf16 output for the pack (into a reused tensor, as a forward's weight) and for
    ComfyUI-GGUF on the same bytes, the device's copy of the same output size, and exactness."""
    from ..loaders.formats import packed_dequant

    n, repeats = DEQUANT_VALUES[quick], REPEATS[quick]
    shape = (n // 4096, 4096)
    rng = np.random.default_rng(0)
    source = torch.empty(shape, dtype=DTYPE, device=device)
    out = torch.empty_like(source)
    copy_s = _seconds(lambda: out.copy_(source), device, repeats)
    rows = []
    for fmt, qtype, stored, companions in _weights(shape, rng):
        stored, companions = stored.to(device), _on(companions, device)
        # The lambdas run in this iteration, before the `del` at its end, which ruff takes for an undefined name.
        pack_s = _seconds(lambda: packed_dequant.dequantize(stored, companions, DTYPE, shape, out=out),  # noqa: F821
                          device, repeats)
        peer_s = None
        if _peer_reads(peer, qtype):
            tensor = _peer_tensor(peer, stored, qtype, shape)
            peer_s = _seconds(lambda: peer.dequant.dequantize_tensor(tensor, DTYPE), device, repeats)
        rows.append({"format": fmt, "values": n, "pack_gbps": n * 2 / pack_s / 1e9,
                     "peer_gbps": None if peer_s is None else n * 2 / peer_s / 1e9, "copy_gbps": n * 2 / copy_s / 1e9,
                     "exact": _exact(fmt, qtype, device, rng)})
        del stored, companions
    return {"rows": rows}


def bench_linear(device: torch.device, quick: bool, peer) -> dict:
    """The packed Linear forward at FLUX.2 [dev] shapes on TOKENS tokens of bf16: the pack's layer, ComfyUI-GGUF's
    GGMLOps.Linear on the same bytes and a dense bf16 F.linear, with the weights on `device`; then, for
    OFFLOADED formats, with them left on the CPU in ordinary and in pinned memory (copied over at every forward,
    as the host's offloading runs a layer)."""
    from ..host.ops import packed_operations

    ops, repeats, rng = packed_operations(), REPEATS[quick], np.random.default_rng(1)
    rows, offloaded = [], []
    with torch.no_grad():  # as under the host's inference mode: no autograd, the ops' scratch path on the CPU
        for shape in LINEAR_SHAPES[quick]:
            x = torch.randn(1, TOKENS[quick], shape[1], dtype=DTYPE, device=device)
            dense = torch.randn(shape, dtype=DTYPE, device=device)
            dense_s = _seconds(lambda: torch.nn.functional.linear(x, dense), device, repeats)
            cpu_dense = dense.cpu()
            for fmt, qtype, stored, companions in _weights(shape, rng):
                layer = ops.Linear(shape[1], shape[0], bias=False)
                layer.load_state_dict({"weight": stored, **companions})
                homes = {"device": device}
                if fmt in OFFLOADED and device.type != "cpu":
                    homes.update(cpu=torch.device("cpu"), pinned=torch.device("cpu"))
                for home, where in homes.items():
                    layer.to(where)
                    if home == "pinned":
                        layer.weight = torch.nn.Parameter(layer.weight.pin_memory(), requires_grad=False)
                    pack_s = _seconds(lambda: layer(x), device, repeats)  # noqa: F821  (run before the `del` below)
                    peer_s = None
                    if _peer_reads(peer, qtype):
                        theirs = peer.ops.GGMLOps.Linear(shape[1], shape[0], bias=False)
                        weight = stored.to(where).pin_memory() if home == "pinned" else stored.to(where)
                        theirs.load_state_dict({"weight": _peer_tensor(peer, weight, qtype, shape)}, strict=False)
                        peer_s = _seconds(lambda: theirs(x), device, repeats)
                    row = {"format": fmt, "shape": list(shape), "weights": home, "pack_s": pack_s, "peer_s": peer_s}
                    if home == "device":
                        rows.append({**row, "dense_s": dense_s})
                    else:
                        source = cpu_dense.pin_memory() if home == "pinned" else cpu_dense
                        dense_copy_s = _seconds(
                            lambda: torch.nn.functional.linear(x, source.to(device, non_blocking=True)), device,
                            repeats)
                        offloaded.append({**row, "dense_s": dense_copy_s})
                del layer
    return {"tokens": TOKENS[quick], "rows": rows, "offloaded": offloaded}


# --- the encoder at FLUX.2 [dev]'s width ------------------------------------------------------------------


def write_gguf_encoder(path: str, g, layers: int, qtype) -> None:
    """A random encoder of geometry `g` as a GGUF in gguf-org's layout ("cow": HF row order, the Tekken
    vocabulary as a tensor): `qtype` blocks for the layers' linears (F16 where a row holds no whole block),
    Q8_0 embeddings, F32 norms."""
    import gguf

    from .tiny.encoders import embedded_tekken_data, gguf_encoder_writer, gguf_names
    from .tiny.gguf_blocks import random_blocks, write_and_close

    rng = np.random.default_rng(0)
    writer = gguf_encoder_writer(path, "cow", g, layers)
    names = gguf_names()

    def add(key: str, shape: tuple[int, int], q) -> None:
        name = names.get_name(key, try_suffixes=(".weight",))
        if shape[-1] % gguf.GGML_QUANT_SIZES[q][0]:
            writer.add_tensor(name,
                              (rng.standard_normal(shape, dtype=np.float32) / shape[-1] ** 0.5).astype(np.float16))
        else:
            writer.add_tensor(name, random_blocks(q, shape, rng, magnitude=0.02 / shape[-1] ** 0.5), raw_dtype=q)

    add("model.embed_tokens.weight", (g.vocab, g.width), gguf.GGMLQuantizationType.Q8_0)
    q_rows, kv_rows = g.heads * g.head_dim, g.kv_heads * g.head_dim
    parts = {"self_attn.q_proj": (q_rows, g.width), "self_attn.k_proj": (kv_rows, g.width),
             "self_attn.v_proj": (kv_rows, g.width), "self_attn.o_proj": (g.width, q_rows),
             "mlp.gate_proj": (g.mlp, g.width), "mlp.up_proj": (g.mlp, g.width), "mlp.down_proj": (g.width, g.mlp)}
    for i in range(layers):
        for part, shape in parts.items():
            add(f"model.layers.{i}.{part}.weight", shape, qtype)
        for norm in ("input_layernorm", "post_attention_layernorm"):
            writer.add_tensor(names.get_name(f"model.layers.{i}.{norm}.weight", try_suffixes=(".weight",)),
                              np.ones(g.width, dtype=np.float32))
    writer.add_tensor("tekken_model", np.frombuffer(embedded_tekken_data(), dtype=np.uint8).astype(np.float16))
    write_and_close(writer)


def bench_encoder(quick: bool) -> dict:
    """Time to conditioning of 512-token prompts through the host's CLIP on the device the host picks, after a
    first encode that loads the weights there: the benchmark encoder (FLUX.2 [dev]'s width, 3 layers; quick: the
    tiny one) in bf16, fp8 and GGUF Q4_K files."""
    import gc

    from gguf import GGMLQuantizationType

    from ..host.clip import lazy_clip
    from ..host.clip_weights import release_weights
    from .bench.encode_scenarios import _PROMPTS, write_encoder
    from .tiny.geometry import BENCH_MISTRAL, TINY_MISTRAL

    g = TINY_MISTRAL if quick else BENCH_MISTRAL
    layers = g.layers[0]
    rows = []
    with tempfile.TemporaryDirectory(prefix="flux2dev-gpu-encoders-") as tmp:
        for fmt in ("bf16", "fp8", "gguf-Q4_K"):
            path = str(Path(tmp) / (f"encoder-{fmt}.gguf" if fmt.startswith("gguf") else f"encoder-{fmt}.safetensors"))
            if fmt.startswith("gguf"):
                write_gguf_encoder(path, g, layers, GGMLQuantizationType.Q4_K)
            else:
                write_encoder(path, g, layers, fmt)
            clip = lazy_clip(path)
            device = clip.patcher.load_device
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            began = time.perf_counter()
            cond = _encode(clip, _PROMPTS[0], device)
            first_s = time.perf_counter() - began
            warm = []
            for prompt in _PROMPTS[1:2] if quick else _PROMPTS[1:]:
                began = time.perf_counter()
                _encode(clip, prompt, device)
                warm.append(time.perf_counter() - began)
            rows.append({"format": fmt, "file_bytes": Path(path).stat().st_size, "device": str(device),
                         "dtype": str(clip.flux2dev_source.dtype).removeprefix("torch."),
                         "tokens": int(cond.shape[1]), "first_s": first_s, "warm_s": min(warm),
                         "finite": bool(torch.isfinite(cond).all()),
                         "peak_device_bytes":
                             torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None})
            release_weights(clip)
            del clip, cond
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
            Path(path).unlink()
    return {"geometry": {"width": g.width, "heads": g.heads, "kv_heads": g.kv_heads, "mlp": g.mlp, "layers": layers},
            "rows": rows}


def _encode(clip, prompt: str, device: torch.device) -> torch.Tensor:
    cond = clip.encode_from_tokens(clip.tokenize(prompt), return_dict=True)["cond"]
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return cond


def machine(device: torch.device) -> dict:
    from ..host import compat, ensure_comfy

    ensure_comfy()
    gpu = torch.cuda.get_device_properties(device) if device.type == "cuda" else None
    return {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "device": gpu.name if gpu else "cpu",
            "device_memory_gib": gpu.total_memory / 2**30 if gpu else None, "torch": torch.__version__,
            "cuda": torch.version.cuda, "python": platform.python_version(), "host": compat.host_version()}


def measure(device: torch.device, quick: bool, peers: Path | None) -> dict:
    from .tiny.geometry import test_models_env

    os.environ.update(test_models_env())  # the benchmark encoder is a declared test model
    peer, no_peer = load_peer(peers)
    return {"machine": machine(device), "peer": peer.name if peer else None, "no_peer": no_peer,
            "dequant": bench_dequant(device, quick, peer), "linear": bench_linear(device, quick, peer),
            "encoder": bench_encoder(quick)}


# --- sampling through the host ----------------------------------------------------------------------------


def _image(server, outputs) -> np.ndarray:
    from PIL import Image

    return np.asarray(Image.open(server.output_file(outputs["save"]["images"][0])), dtype=np.int16)


def _with_device_nodes(graph: dict, device: str) -> dict:
    """The graph with the host's Select Model Device and Select CLIP Device between the pack's loaders and the rest."""
    from .workflows import node

    graph = dict(graph)
    graph["model_loader"], graph["clip_loader"] = graph["model"], graph["clip"]
    graph["model"] = node("SelectModelDevice", model=["model_loader", 0], device=device)
    graph["clip"] = node("SelectCLIPDevice", clip=["clip_loader", 0], device=device)
    return graph


def sample(server, quick: bool = False) -> dict:
    """The demo's graph (the tiny GGUF transformer, bf16 encoder and VAE; quick: 64x64 in 2 steps) through `server`
    (a HeadlessComfy with them in its model folders): twice (loads, then loaded), then, where the host has device
    nodes, behind Select Model/CLIP Device set to "default" and to "cpu"; what the pack's log lines and the
    host's say."""
    from .demo import demo_graph
    from .workflows import official_dev_graph

    start = len(server.log())
    # A server that ran these loaders before (the tests' shared one) would serve them from its node cache and log
    # nothing of them: freed first, at least one of the two runs loads them.
    server.free()
    graph = demo_graph("a red fox in the snow")
    if quick:
        graph = official_dev_graph(graph["model"], graph["clip"], graph["vae"], filename_prefix="flux2dev-gpu-check")
    runs, images = [], {}
    for name in ("first", "again"):
        began = time.perf_counter()
        images[name] = _image(server,
                              server.run({**graph, "noise": {**graph["noise"], "inputs": {"noise_seed": len(runs)}}}))
        runs.append({"graph": name, "seconds": time.perf_counter() - began})
    has_device_nodes = "SelectModelDevice" in server.get("/object_info")
    if has_device_nodes:
        for device in ("default", "cpu"):
            began = time.perf_counter()
            images[device] = _image(server, server.run(_with_device_nodes(graph, device)))
            runs.append({"graph": f"device nodes: {device}", "seconds": time.perf_counter() - began})
    log = server.log()[start:]
    return {
        "host": server.get("/system_stats").get("system", {}).get("comfyui_version"),
        "devices": [d.get("name") for d in server.get("/system_stats").get("devices", [])],
        "dynamic_vram": "DynamicVRAM support detected and enabled" in log,
        "patchers": [{"part": m[1], "patcher": m[2], "device": m[3]} for m in LOG_LINE.finditer(log)],
        "runs": runs,
        "images_nonblank": all(float(i.std()) > 0 for i in images.values()),
        "device_nodes": has_device_nodes,
        "device_node_warnings": [line for line in log.splitlines() if "cannot retarget" in line],
        "default_vs_cpu_max_diff": int(np.abs(images["default"] - images["cpu"]).max()) if has_device_nodes else None,
    }


def sample_on_gpu(models: Path, log: Path) -> dict:
    """sample() through a headless ComfyUI (COMFYUI_ROOT's tree) started for the GPU, on the tiny models in `models`
    (written there when missing); the server's log goes to `log`."""
    from ..host import COMFYUI_ROOT_ENV
    from . import tiny
    from .demo import DEMO_PARTS, write_demo_models
    from .headless import HeadlessComfy
    from .tiny.geometry import test_models_env

    if not (models / tiny.MANIFEST).is_file():
        write_demo_models(models)
    with HeadlessComfy(os.environ[COMFYUI_ROOT_ENV], models={p: [models / p] for p in DEMO_PARTS},
                       env=test_models_env(models), gpu=True) as server:
        try:
            return sample(server)
        finally:
            log.write_text(server.log())


# --- the report -------------------------------------------------------------------------------------------


def _tests(path: Path) -> str:
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root)
    count = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    passed = count["tests"] - count["failures"] - count["errors"] - count["skipped"]
    lines = [f"  {path.stem.removeprefix('tests-')}: {passed} passed, {count['failures'] + count['errors']} failed, "
             f"{count['skipped']} skipped"]
    for case in root.iter("testcase"):
        for problem in [*case.findall("failure"), *case.findall("error")]:
            message = (problem.get("message") or "").splitlines()[0][:160] if problem.get("message") else ""
            lines.append(f"    FAILED {case.get('classname')}::{case.get('name')}: {message}")
    return "\n".join(lines)


def _gbps(value) -> str:
    return "-" if value is None else f"{value:.0f}"


def _ms(seconds) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.2f}"


def _ratio(a, b) -> str:
    return "-" if a is None or b is None else f"{a / b:.2f}x"


def format_report(out: Path) -> str:
    """report.md's text from what the steps left in `out`; a step that left nothing is named as missing."""
    def load(name: str):
        path = out / name
        return json.loads(path.read_text()) if path.is_file() else None

    measured = load("measure.json")
    lines = []
    if measured:
        m = measured["machine"]
        memory = "" if m["device_memory_gib"] is None else f" ({m['device_memory_gib']:.0f} GiB)"
        lines.append(f"GPU check of {m['date']} on {m['device']}{memory}, torch {m['torch']} (CUDA {m['cuda']}), "
                     f"Python {m['python']}, measured on ComfyUI {m['host']}")
    lines.append("\nTests (the CUDA variants, -m cuda):")
    junits = sorted(out.glob("tests-*.xml"))
    lines.extend(_tests(p) for p in junits)
    if not junits:
        lines.append("  none ran (see tests-*.log)")
    if not measured:
        lines.append("\nmeasure: no results (see measure.log)")
    else:
        d = measured["dequant"]["rows"]
        peer = measured["peer"] or f"none ({measured['no_peer']})"
        lines += [f"\nDequantization to bf16, {d[0]['values']} values (GB/s of output; copy: the device copying that "
                  f"output; peer: {peer})",
                  f"{'format':11} {'pack':>6} {'peer':>6} {'copy':>6} {'pack/copy':>9} {'pack/peer':>9}  exact"]
        for r in d:
            lines.append(f"{r['format']:11} {_gbps(r['pack_gbps']):>6} {_gbps(r['peer_gbps']):>6} "
                         f"{_gbps(r['copy_gbps']):>6} "
                         f"{r['pack_gbps'] / r['copy_gbps']:>9.2f} {_ratio(r['pack_gbps'], r['peer_gbps']):>9}  "
                         f"{'yes' if r['exact'] else 'NO'}")
        slow = [r["format"] for r in d if r["pack_gbps"] < r["copy_gbps"] / 2]
        lines.append(f"below half the copy bandwidth (Triton candidates): {', '.join(slow) or 'none'}")
        lin = measured["linear"]
        lines += [f"\nPacked Linear forward, {lin['tokens']} tokens of bf16 (ms; x: time over the dense bf16 F.linear)",
                  f"{'format':11} {'shape':>11} {'pack':>7} {'peer':>7} {'dense':>7} {'pack/dense':>10} "
                  f"{'peer/dense':>10}"]
        for r in lin["rows"]:
            lines.append(f"{r['format']:11} {'x'.join(map(str, r['shape'])):>11} {_ms(r['pack_s']):>7} "
                         f"{_ms(r['peer_s']):>7} {_ms(r['dense_s']):>7} {_ratio(r['pack_s'], r['dense_s']):>10} "
                         f"{_ratio(r['peer_s'], r['dense_s']):>10}")
        if lin["offloaded"]:
            lines += ["weights left on the CPU (ordinary or pinned memory), copied over at every forward; dense: its "
                      "bf16 weight copied over"]
            for r in lin["offloaded"]:
                lines.append(f"{r['format']:11} {'x'.join(map(str, r['shape'])):>11} {r['weights']:>7} "
                             f"{_ms(r['pack_s']):>7} {_ms(r['peer_s']):>7} {_ms(r['dense_s']):>7} "
                             f"{_ratio(r['pack_s'], r['dense_s']):>10}")
        e = measured["encoder"]
        g = e["geometry"]
        lines.append(f"\nEncoder (width {g['width']}, {g['heads']}/{g['kv_heads']} heads, MLP {g['mlp']}, "
                     f"{g['layers']} layers): time to conditioning of a prompt through the host's CLIP")
        for r in e["rows"]:
            peak = "" if r["peak_device_bytes"] is None \
                else f", peak device memory {r['peak_device_bytes'] / 2**30:.1f} GiB"
            lines.append(f"  {r['format']:9} {r['file_bytes'] / 2**30:.1f} GiB file, in {r['dtype']} on "
                         f"{r['device']}: first (with the load) {r['first_s']:.2f} s, "
                         f"then {r['warm_s'] * 1e3:.0f} ms for {r['tokens']} tokens"
                         f"{'' if r['finite'] else ' (NOT FINITE)'}{peak}")
    samples = sorted(out.glob("sample-*.json"))
    for path in samples:
        s = json.loads(path.read_text())
        patchers = ", ".join(f"{p['part']} {p['patcher']} on {p['device']}" for p in s["patchers"]) \
            or "no pack log line"
        lines += [f"\nSampling through ComfyUI {s['host']} on {', '.join(map(str, s['devices']))}: dynamic VRAM "
                  f"{'on' if s['dynamic_vram'] else 'off'}; patchers in load order: {patchers}",
                  "  " + "; ".join(f"{r['graph']} {r['seconds']:.1f} s" for r in s["runs"])
                  + f"; images {'made' if s['images_nonblank'] else 'BLANK'}"]
        if s["device_nodes"]:
            warnings = "; ".join(s["device_node_warnings"]) or "none"
            lines.append(f"  device nodes: default and cpu images differ by at most {s['default_vs_cpu_max_diff']} "
                         f"of 255; host warnings: {warnings}")
        else:
            lines.append("  this host has no device-selection nodes")
    if not samples:
        lines.append("\nsample: no results (see sample-*.log)")
    return "\n".join(lines) + "\n"


# --- the command ------------------------------------------------------------------------------------------


def _cuda() -> torch.device:
    if not torch.cuda.is_available():
        raise UsageError(NO_GPU)
    return torch.device("cuda")


def _probe(args) -> None:
    device = _cuda()
    m = machine(device)
    print(f"torch {m['torch']} (CUDA {m['cuda']}) sees {m['device']} ({m['device_memory_gib']:.0f} GiB); "
          f"ComfyUI {m['host']}")


def _measure(args) -> None:
    (Path(args.out) / "measure.json").write_text(json.dumps(measure(_cuda(), False, Path(args.peers)), indent=1))


def _sample(args) -> None:
    _cuda()
    out = Path(args.out)
    result = sample_on_gpu(out / "tiny-models", out / f"server-{args.name}.log")
    (out / f"sample-{args.name}.json").write_text(json.dumps(result, indent=1))


def _report(args) -> None:
    text = format_report(Path(args.out))
    (Path(args.out) / "report.md").write_text(text)
    print(text, end="")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m comfyui_flux2dev.devtools gpu-check",
                                     description="the GPU check's steps (devtools/gpu-check runs them)")
    parser.add_argument("--debug", action="store_true", help="show the traceback of a failure")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("probe", help="whether torch sees the GPU, and the host's version").set_defaults(run=_probe)
    p = sub.add_parser("measure", help="dequantization, packed Linear and encoder figures on the GPU")
    p.add_argument("--out", required=True)
    p.add_argument("--peers", required=True, help="the folder holding ComfyUI-GGUF's tarball (../shared/peers)")
    p.set_defaults(run=_measure)
    p = sub.add_parser("sample", help="the official graph on tiny models through a headless ComfyUI on the GPU")
    p.add_argument("--out", required=True)
    p.add_argument("--name", required=True, help="the host tree's name in the result's file name")
    p.set_defaults(run=_sample)
    p = sub.add_parser("report", help="report.md from the steps' results")
    p.add_argument("--out", required=True)
    p.set_defaults(run=_report)
    return run(parser, argv)
