"""`flux2dev bench --real DIR`, the transformer: FLUX.2 [dev]'s 32B transformer at its real size, loaded and run one
forward at the smallest latent by the pack, the host's own UNETLoader and ComfyUI-GGUF's UnetLoaderGGUF on the same
files, each in a process of its own (sampled as real_size.py's encoder rows are).

Two files are written once into DIR, with random weights of realistic scale, in a stream after checking the disk
space: the Q4_K_M GGUF that `flux2dev convert transformer --type Q4_K_M` lays out (random K-quant blocks; converting
32B values would take most of an hour here and measure the quantizer, which the quick bench does), and scaled fp8 in
ComfyUI's single-file form (block weights float8_e4m3fn with a per-tensor scale_weight, the rest bf16). The forward
is the host's own model on a 64x64 image's latent (16 tokens) and TEXT_TOKENS tokens of text, in float32 on the CPU.
CI runs none of it: tests/devtools/test_real_size.py runs the same code at the real width with one block of each
kind."""

from __future__ import annotations

import functools
import math
import os
import shutil
import time

import numpy as np
import torch

from ...loaders.models.transformer_layout import TransformerGeometry, bfl_tensor_shapes
from ...loaders.models.variants import VARIANTS
from .meters import proc_kib

DEV = VARIANTS[0]
FULL = TransformerGeometry(hidden_size=DEV.hidden_size, context_in_dim=DEV.context_in_dim, in_channels=128,
                           guidance=True, double_blocks=DEV.double_blocks, single_blocks=DEV.single_blocks)
PRESET = "Q4_K_M"  # city96's most shared FLUX.2 [dev] GGUF
FILES = {"Q4_K_M": "flux2-dev-Q4_K_M.gguf", "fp8": "flux2-dev-fp8-scaled.safetensors"}
LATENT = (1, 128, 4, 4)  # a 64x64 image: the smallest latent
TEXT_TOKENS = 32  # about a short prompt in the host's padding
WEIGHT_RMS = 0.02  # a trained FLUX.2 linear's weights, about
_PIECE = 1 << 24  # values made and written at a time
_SEED = 4100


def _is_block_weight(key: str, shape: tuple[int, ...]) -> bool:
    """The weights an fp8 file holds in fp8: the blocks' matrices (the rest stays bf16, as in ComfyUI's files)."""
    return len(shape) == 2 and key.startswith(("double_blocks.", "single_blocks."))


def _fp8_codes(n: int, rng: np.random.Generator) -> np.ndarray:
    codes = rng.integers(0, 256, n, dtype=np.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0  # the two NaN codes
    return codes


_FP8_RMS = float(torch.from_numpy(_fp8_codes(1 << 16, np.random.default_rng(0))).view(torch.float8_e4m3fn)
                 .float().square().mean().sqrt())


@functools.cache
def _pool(kind) -> torch.Tensor:
    """_PIECE random values of a kind ("bf16", "fp8" codes, or a GGUF K type's blocks) as bytes, made once and
    written wherever a tensor of that kind needs values: files of many GB are written at the disk's speed."""
    from ..tiny.gguf_blocks import random_blocks
    from ..tiny.gguf_transformers import K_QUANT_MAGNITUDES

    rng = np.random.default_rng(_SEED)
    if kind == "bf16":
        values = (torch.randn(_PIECE, generator=torch.Generator().manual_seed(_SEED)) * WEIGHT_RMS).to(torch.bfloat16)
        return values.view(torch.uint8)
    if kind == "fp8":
        return torch.from_numpy(_fp8_codes(_PIECE, rng))
    return torch.from_numpy(random_blocks(kind, (_PIECE,), rng, K_QUANT_MAGNITUDES[kind]))


def _pieces(shape: tuple[int, ...], nbytes: int):
    """(byte offset, byte count) of a tensor of `shape` and `nbytes`, in pieces of whole rows of at most _PIECE
    values."""
    rows, row = math.prod(shape[:-1]), shape[-1]
    per_piece = max(1, _PIECE // row)
    return [(r * nbytes // rows, min(per_piece, rows - r) * nbytes // rows) for r in range(0, rows, per_piece)]


def _write(path: str, tensor_file, fills: dict[str, tuple[object, tuple[int, ...], int]]) -> None:
    """A fresh file at `path` laid out by `tensor_file(f)`, each tensor ({name: (fill, shape, bytes)}) written from
    its fill's pool, or as its fill where that is a tensor (a constant of the tensor's dtype)."""
    from ...loaders.formats.files import new_file

    with new_file(path) as f:
        file = tensor_file(f)
        for name, (fill, shape, nbytes) in fills.items():
            if isinstance(fill, torch.Tensor):
                file.write(name, fill.expand(shape))
                continue
            for at, count in _pieces(shape, nbytes):
                file.write(name, _pool(fill)[:count], at)
        file.finish()


def _gguf_plan(shapes: dict[str, tuple[int, ...]]):
    """(the GGUF's layout for gguf_file, its tensors' fills)."""
    from gguf import GGMLQuantizationType as Q

    from ...loaders.convert.tensor_files import gguf_file
    from ...loaders.convert.transformer import gguf_plan

    metadata, layout = gguf_plan(shapes, PRESET)
    fills = {key: ({Q.F32: torch.ones(()), Q.BF16: "bf16"}.get(qtype, qtype), shape, nbytes)
             for key, (qtype, shape, nbytes) in layout.items()}
    return (lambda f: gguf_file(f, metadata, layout)), fills


def _fp8_plan(shapes: dict[str, tuple[int, ...]]):
    """(the scaled fp8 file's layout for safetensors_file, its tensors' fills)."""
    from ...loaders.convert.tensor_files import safetensors_file

    tensors, fills = {"scaled_fp8": (torch.float8_e4m3fn, (0,))}, {}
    for key, shape in shapes.items():
        if _is_block_weight(key, shape):
            tensors[key], fills[key] = (torch.float8_e4m3fn, shape), ("fp8", shape, math.prod(shape))
            scale = key.removesuffix(".weight") + ".scale_weight"
            tensors[scale], fills[scale] = (torch.float32, ()), (torch.tensor(WEIGHT_RMS / _FP8_RMS), (), 4)
        else:
            fill = "bf16" if len(shape) > 1 else torch.ones((), dtype=torch.bfloat16)
            tensors[key], fills[key] = (torch.bfloat16, shape), (fill, shape, 2 * math.prod(shape))
    return (lambda f: safetensors_file(f, tensors)), fills


PLANS = {"Q4_K_M": _gguf_plan, "fp8": _fp8_plan}


def made(folder: str, fmt: str, geometry: TransformerGeometry, margin: int) -> str:
    """The `fmt` file in `folder`, written where missing, after checking the disk space."""
    path = os.path.join(folder, FILES[fmt])
    if os.path.isfile(path):
        return path
    tensor_file, fills = PLANS[fmt](bfl_tensor_shapes(geometry, DEV))
    size, free = sum(nbytes for _, _, nbytes in fills.values()), shutil.disk_usage(folder).free
    if free < size + margin:
        raise RuntimeError(f"{folder} has {free / 1e9:.1f} GB free; the {fmt} transformer takes {size / 1e9:.1f} GB.")
    _write(path, tensor_file, fills)
    return path


# --- the steps, each run in a process of its own ----------------------------------------------------------------


def _forward(patcher, started_anon: int, load_s: float) -> dict:
    """One forward of a loaded host MODEL, as a sampler's first step calls it (the host loads it first)."""
    import comfy.model_management

    loaded_anon = proc_kib("RssAnon") * 1024
    start = time.perf_counter()
    comfy.model_management.load_models_gpu([patcher])
    g = torch.Generator().manual_seed(0)
    x, context = torch.randn(LATENT, generator=g), torch.randn(1, TEXT_TOKENS, DEV.context_in_dim, generator=g)
    with torch.inference_mode():
        out = patcher.model.diffusion_model(x, torch.tensor([0.7]), context, guidance=torch.tensor([4.0])).float()
    return {"load_s": load_s, "forward_s": time.perf_counter() - start, "anon_before_bytes": started_anon,
            "anon_loaded_bytes": loaded_anon, "finite": bool(out.isfinite().all()),
            "rms": float(out.square().mean().sqrt())}


def _loaded(load) -> dict:
    started = proc_kib("RssAnon") * 1024
    start = time.perf_counter()
    patcher = load()
    return _forward(patcher, started, time.perf_counter() - start)


def pack_forward(path: str) -> dict:
    """The pack's loader node for the file (the GGUF loader, or the transformer source for a safetensors file)."""
    from ...host.model import load_gguf_model, load_model

    return _loaded(lambda: (load_gguf_model if path.endswith(".gguf") else load_model)(path))


def host_forward(path: str) -> dict:
    """The host's own UNETLoader (weight_dtype default) on the file."""
    from ...host import ensure_comfy

    ensure_comfy()
    import comfy.sd

    return _loaded(lambda: comfy.sd.load_diffusion_model(path))


def peer_forward(path: str) -> dict:
    """ComfyUI-GGUF's UnetLoaderGGUF on the file, found where its node looks (the host's diffusion_models)."""
    from ...host import ensure_comfy
    from .peers import comfyui_gguf_nodes

    ensure_comfy()
    import folder_paths

    nodes = comfyui_gguf_nodes()
    folder_paths.add_model_folder_path("diffusion_models", os.path.dirname(path))
    return _loaded(lambda: nodes.UnetLoaderGGUF().load_unet(os.path.basename(path))[0])


# --- the run ----------------------------------------------------------------------------------------------------

# Who loads each file beside the pack: ComfyUI-GGUF a GGUF, the host's UNETLoader a safetensors file.
PEERS = {"Q4_K_M": ("ComfyUI-GGUF", "peer_forward"), "fp8": ("host", "host_forward")}


def bench_real_transformer(folder: str, anon_limit: int, margin: int, geometry: TransformerGeometry = FULL,
                           formats=tuple(FILES), peers: bool = True) -> dict:
    """{"blocks", "files", "rows"}: a row per loader and file, with seconds, peak_anon_bytes, peak_mapped_bytes and
    peak_open_files of its process, and "result" (load and forward seconds, its own memory before the load and after
    it, and the output's size), "failed" or "over_limit"."""
    from .meters import evict, sampled_call
    from .peers import PEER_ARCHIVE, missing_reason

    os.makedirs(folder, exist_ok=True)
    rows, files = [], {}
    for fmt in formats:  # each written just before its rows
        path = made(folder, fmt, geometry, margin)
        files[fmt] = os.path.getsize(path)
        for loader, function in (("pack", "pack_forward"), *([PEERS[fmt]] if peers else [])):
            if function == "peer_forward" and not PEER_ARCHIVE.is_file():
                rows.append({"loader": loader, "format": fmt, "failed": missing_reason()})
                continue
            evict([path])  # every loader starts from the disk
            rows.append({"loader": loader, "format": fmt, **sampled_call(
                "real_transformer", function, path, what=f"{loader}, {fmt}", anon_limit=anon_limit)})
    return {"blocks": (geometry.double_blocks, geometry.single_blocks), "files": files, "rows": rows}
