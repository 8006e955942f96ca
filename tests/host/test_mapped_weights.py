"""Safetensors weights stay mapped from their file: the host CLIP's weights are views of the file's pages, not
copies, and the conditioning is bit for bit what the same weights read into memory of their own give (how the
pack read them before). A loaded model holds one open file per file it was read from, whatever its tensors number
(the tiny ones have the real layer counts: a map per tensor held 421 for the fp8 encoder), and none once released."""

from __future__ import annotations

import gc
import os
from pathlib import Path

import pytest
import torch

from comfyui_flux2dev.loaders.formats.safetensors_file import SafetensorsFiles

ENCODERS = ("mistral_3_small_flux2_bf16", "mistral_3_small_flux2_fp8", "mistral_3_small_flux2_fp4_mixed")
PROMPTS = ("a red fox in the snow", "drei Katzen, 1999 [IMG]")


def _weights(clip) -> list[torch.Tensor]:
    from comfyui_flux2dev.host.ops import PackedLayer

    return [p for m in clip.cond_stage_model.modules() if isinstance(m, PackedLayer)
            for p in m.parameters(recurse=False)]


def _in_file_maps(tensor: torch.Tensor, path: str) -> bool:
    """Whether the tensor's bytes lie in a map of the file `path`, or of a file in the folder `path` (Linux's
    /proc/self/maps)."""
    with open("/proc/self/maps") as f:
        spans = [line.split()[0].split("-") for line in f
                 if line.rstrip().endswith(path) or f" {path}/" in line]
    return any(int(a, 16) <= tensor.data_ptr() < int(b, 16) for a, b in spans)


def _open_files(path: str) -> list[str]:
    """The files this process holds open (one entry per descriptor): `path` itself, or those in the folder `path`."""
    path = os.path.realpath(path)
    held = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # the listing's own descriptor, closed by now
            continue
        if target == path or target.startswith(path + "/"):
            held.append(target)
    return sorted(held)


def _encoded(path: str) -> tuple[list[torch.Tensor], list[torch.Tensor], list[str]]:
    """The conditioning of PROMPTS, the CLIP's weights, and the files it held open while loaded."""
    from comfyui_flux2dev.host.clip import load_clip

    clip = load_clip(path)
    encoded = [clip.encode_from_tokens(clip.tokenize(p)) for p in PROMPTS]
    return encoded, _weights(clip), _open_files(path)


@pytest.mark.parametrize("name", ENCODERS)
def test_mapped_weights_encode_the_same_bits_as_weights_read_into_memory(comfy_host, tiny_root, name, monkeypatch):
    path = str(tiny_root / "text_encoders" / f"{name}.safetensors")
    mapped, weights, held = _encoded(path)
    assert weights and all(_in_file_maps(w, path) for w in weights), "every weight a view of the file's pages"
    assert held == [os.path.realpath(path)], "one open file: the file's one map"
    del weights
    gc.collect()
    assert _open_files(path) == [], "none once the CLIP is gone"
    monkeypatch.setattr(SafetensorsFiles, "view", SafetensorsFiles.read)
    read, weights, _ = _encoded(path)
    assert not any(_in_file_maps(w, path) for w in weights)
    for a, b in zip(mapped, read):
        assert torch.equal(a, b)


TRANSFORMERS = ("diffusion_models/flux2-dev-tiny-fp8-weight_scale.safetensors", "unet/flux2-dev-tiny-Q4_K.gguf")


@pytest.mark.parametrize("name", TRANSFORMERS)
def test_a_transformer_keeps_its_packed_and_bf16_weights_mapped(comfy_host, tiny_root, name, monkeypatch):
    """Packed weights and the bf16 ones beside them (embedders, modulation: 1.6 GB of [dev]) stay views of the file,
    cast per op: on the CPU the host would make them float32 copies, doubling them. The output is bit for bit what
    weights read into memory of their own give."""
    from comfyui_flux2dev.host.model import load_gguf_model, load_model
    from comfyui_flux2dev.host.ops import PackedLayer
    from helpers import flux2_forward

    path = str(tiny_root / name)
    load = load_gguf_model if path.endswith(".gguf") else load_model

    def forward() -> tuple[torch.Tensor, list[torch.Tensor], list[str]]:
        patcher = load(path)
        with torch.inference_mode():
            out = flux2_forward(patcher, torch.device("cpu"))
        layers = [m for m in patcher.model.diffusion_model.modules() if isinstance(m, PackedLayer)]
        return out, [m.weight for m in layers], _open_files(path)

    mapped, weights, held = forward()
    assert all(_in_file_maps(w, path) for w in weights), "every weight of the pack's layers a view of the file"
    assert any(w.dtype in (torch.bfloat16, torch.float16) for w in weights), "float weights among them"
    assert held == [os.path.realpath(path)], "one open file: the file's one map"
    del weights
    gc.collect()
    assert _open_files(path) == [], "none once the MODEL is gone"
    if path.endswith(".safetensors"):
        monkeypatch.setattr(SafetensorsFiles, "view", SafetensorsFiles.read)
        read, weights, _ = forward()
        assert not any(_in_file_maps(w, path) for w in weights)
        assert torch.equal(mapped, read)


# The layouts whose query and key rows are in llama.cpp's (Meta's) rotary order: the pack reorders those rows once, at
# load, into a copy of its own (the file's pages stay reclaimable, so it is one copy, not two).
REORDERED = {"native": True, "hf-mistral3-fp8": False, "mistral3-q4_k.gguf": True}


@pytest.mark.parametrize("name", REORDERED)
def test_the_upsampler_kept_loaded_holds_its_weights_mapped(comfy_host, tiny_root, name):
    """Prompt upsampling with keep_loaded on holds no second copy of a weight, lm_head included (1.3 GB in bf16 for
    Mistral-Small): every weight of the pack's layers is a view of the files, cast or dequantized per op, but the
    query and key rows a rotary-order layout stores reordered."""
    from comfyui_flux2dev.host import upsampler
    from comfyui_flux2dev.host.ops import PackedLayer

    path = str(tiny_root / "text_encoders" / name)
    upsampler.upsample(path, "a fox", temperature=0, max_new_tokens=2, dtype=torch.float32, keep_loaded=True)
    try:
        weights = {n: m.weight for n, m in upsampler._held.patcher.model.named_modules() if isinstance(m, PackedLayer)}
        copied = {n for n, w in weights.items() if not _in_file_maps(w, path)}
        reordered = {n for n in weights if n.endswith(("self_attn.q_proj", "self_attn.k_proj"))}
        assert len(weights) > 100 and "lm_head" in weights
        assert copied == (reordered if REORDERED[name] else set())
        files = [path] if os.path.isfile(path) else sorted(str(p) for p in Path(path).glob("*.safetensors"))
        assert _open_files(path) == [os.path.realpath(f) for f in files], "one open file per weight file"
    finally:
        weights = None
        upsampler.release_held()
    gc.collect()
    assert _open_files(path) == [], "none once released"
