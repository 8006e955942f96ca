"""FLUX.2 transformer GGUFs through the host: packed weights against the host model built from gguf-py's
own dequantization of the same file, LoRAs, per-load settings, memory accounting and wrong files."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from comfyui_flux2dev.errors import UnknownModelError, VariantMismatchError, WrongModelError
from comfyui_flux2dev.loaders.models.variants import variant_by_key
from helpers import flux2_forward, reference_model, tiny_lora

DEV_FILES = ("F16", "Q8_0", "Q4_0", "Q4_K", "Q5_K", "Q6_K")
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def gguf_dir(tiny_part, comfy_host):
    root, entries = tiny_part("unet")
    return root, {(e["variant"], e["format"].removeprefix("gguf-")): root / e["path"] for e in entries}


@pytest.fixture(scope="module")
def ops():
    from comfyui_flux2dev.host import model

    return model


def load(ops, path, **kwargs):
    return ops.load_gguf_model(path, dtype=torch.float32, **kwargs)


def forward(patcher, device=CPU):
    """One forward on `device`, the output on the CPU. A model the host has not loaded there runs as in its
    low-VRAM mode: each layer's weight is copied to the input's device for the op."""
    with torch.no_grad():
        return flux2_forward(patcher, device).cpu()


def run(patcher, device=CPU, lowvram=False, unload_after_load=False):
    """One forward on `device` with the patcher's patches applied the host's way: a full load, a low-VRAM load
    (weights left on the CPU), or a full load the host then moves to low-VRAM mode to free memory."""
    patcher.patch_model(device_to=device, lowvram_model_memory=1 if lowvram else 0)
    try:
        if unload_after_load:
            assert patcher.partially_unload(CPU, memory_to_free=patcher.model_size()) > 0
        return forward(patcher, device)
    finally:
        patcher.unpatch_model(device_to=CPU)


@pytest.mark.parametrize("fmt", DEV_FILES)
def test_gguf_matches_dequantized_model(gguf_dir, ops, fmt, device):
    path = gguf_dir[1][("dev", fmt)]
    out = run(load(ops, path), device)
    expected = run(reference_model(path), device)
    assert torch.isfinite(expected).all() and expected.abs().max() > 0
    assert (out - expected).abs().max().item() <= 1e-5


def test_klein_gguf_detected_and_matches(gguf_dir, ops, device):
    path = gguf_dir[1][("klein-4b", "Q8_0")]
    model = load(ops, path)
    assert model.model.flux2_variant == variant_by_key("klein-4b", tiny=True)
    assert (run(model, device) - run(reference_model(path), device)).abs().max().item() <= 1e-5


def test_header_parsed_once_per_load(gguf_dir, ops):
    from comfyui_flux2dev.loaders.formats import gguf_file

    before = gguf_file.parse_count()
    load(ops, gguf_dir[1][("dev", "Q4_K")])
    assert gguf_file.parse_count() == before + 1


def with_lora(gguf_dir, ops, comfy_host, fmt):
    """(GGUF model, its dequantized reference, and each with the same tiny LoRA applied by the host)."""
    path = gguf_dir[1][("dev", fmt)]
    model, reference = load(ops, path), reference_model(path)
    lora = tiny_lora(reference)
    patched, _ = comfy_host.load_lora_for_models(model, None, lora, 1.0, 0.0)
    patched_reference, _ = comfy_host.load_lora_for_models(reference, None, lora, 1.0, 0.0)
    return model, reference, patched, patched_reference


@pytest.mark.parametrize("fmt", ("Q4_0", "Q6_K"))
def test_lora_matches_lora_on_dequantized_model(gguf_dir, ops, comfy_host, fmt, device):
    model, reference, patched, patched_reference = with_lora(gguf_dir, ops, comfy_host, fmt)
    assert len(patched.patches) == 3
    expected = run(patched_reference, device)
    assert (expected - run(reference, device)).abs().max() > 1e-3  # the LoRA changes the output
    assert (run(patched, device) - expected).abs().max().item() <= 1e-5
    # The host's low-VRAM paths patch through weight functions instead; same result.
    assert (run(patched, device, lowvram=True) - expected).abs().max().item() <= 1e-5
    assert (run(patched, device, unload_after_load=True) - expected).abs().max().item() <= 1e-5
    # The unpatched model is untouched by its patched clone.
    assert (run(model, device) - run(reference, device)).abs().max().item() <= 1e-5


def test_per_load_settings_do_not_leak(gguf_dir, ops, comfy_host, device):
    path = gguf_dir[1][("dev", "Q8_0")]
    expected = run(reference_model(path), device)
    half = load(ops, path, dequant_dtype=torch.float16, patch_dtype=torch.float16)
    half_out = run(half, device)
    plain = load(ops, path)
    assert (run(plain, device) - expected).abs().max().item() <= 1e-5
    assert torch.equal(run(half, device), half_out)
    assert (half_out - expected).abs().max().item() > 1e-5  # float16 dequantization rounds
    half_layer = half.model.diffusion_model.img_in
    plain_layer = plain.model.diffusion_model.img_in
    assert type(half_layer) is not type(plain_layer)
    assert (type(half_layer).settings.dequant_dtype, type(plain_layer).settings.dequant_dtype) == (torch.float16, None)
    lora = tiny_lora(plain)
    patched_half, _ = comfy_host.load_lora_for_models(half, None, lora, 1.0, 0.0)
    patched_plain, _ = comfy_host.load_lora_for_models(plain, None, lora, 1.0, 0.0)
    plain_lora = run(patched_plain, device)
    assert (run(patched_half, device) - plain_lora).abs().max().item() > 1e-5
    assert torch.equal(run(patched_plain, device), plain_lora)


def test_memory_accounting_sees_packed_sizes(gguf_dir, ops):
    from comfy.model_management import module_size

    from comfyui_flux2dev.loaders.formats.gguf_file import open_gguf

    path = gguf_dir[1][("dev", "Q4_0")]
    model, reference = load(ops, path), reference_model(path)
    with open_gguf(path) as gfile:
        packed = sum(t.nbytes for t in gfile.tensors.values() if len(t.shape) >= 2)
        loose = sum(int(np.prod(t.shape)) * 4 for t in gfile.tensors.values() if len(t.shape) < 2)
    # The host's own buffers (model sampling) come on top of the transformer's weights in both models.
    host_buffers = reference.model_size() - module_size(reference.model.diffusion_model)
    assert model.model_size() == packed + loose + host_buffers
    assert model.model_size() < reference.model_size() / 4


def test_klein_gguf_with_dev_conditioning_fails_before_sampling(gguf_dir, ops):
    model = load(ops, gguf_dir[1][("klein-4b", "Q8_0")])
    dev = variant_by_key("dev", tiny=True)
    with pytest.raises(VariantMismatchError) as e:
        model.model.extra_conds(cross_attn=torch.zeros(1, 4, dev.context_in_dim))
    assert "Klein 4B" in str(e.value) and "[dev]" in str(e.value)


def _rewrite(src, dst, architecture="flux", drop=()):
    """Copy a tiny GGUF's tensors into a new file with another architecture or without some tensors."""
    from gguf import GGUFReader

    from comfyui_flux2dev.devtools.tiny.gguf_transformers import write_gguf

    tensors = {t.name: (np.array(t.data), t.tensor_type) for t in GGUFReader(str(src)).tensors
               if not t.name.startswith(drop)}
    write_gguf(dst, tensors, architecture)
    return dst


@pytest.mark.parametrize("architecture", (None, "pig"))
def test_other_transformer_architecture_names_load(gguf_dir, ops, tmp_path, architecture):
    path = _rewrite(gguf_dir[1][("dev", "Q8_0")], tmp_path / "t.gguf", architecture)
    assert load(ops, path).model.flux2_variant.key == "dev"


@pytest.mark.parametrize(
    "architecture, error, words",
    (("mistral3", WrongModelError, "Mistral-Small text encoder"), ("llama", WrongModelError, "text encoder"),
     ("qwen3", WrongModelError, "Klein"), ("mamba", UnknownModelError, "'mamba'")),
)
def test_other_models_are_refused(gguf_dir, tmp_path, architecture, error, words):
    from comfyui_flux2dev.loaders.models.gguf_transformer import load_gguf_transformer

    path = _rewrite(gguf_dir[1][("klein-4b", "Q8_0")], tmp_path / "x.gguf", architecture)
    with pytest.raises(error, match="not a FLUX.2 transformer|FLUX.2 transformer GGUFs") as e:
        load_gguf_transformer(path)
    assert words in str(e.value)


def test_flux1_and_unknown_geometry_are_refused(gguf_dir, tmp_path):
    from comfyui_flux2dev.loaders.models.gguf_transformer import load_gguf_transformer

    src = gguf_dir[1][("dev", "Q8_0")]
    with pytest.raises(WrongModelError, match="FLUX.1"):
        load_gguf_transformer(_rewrite(src, tmp_path / "flux1.gguf", drop=("double_stream_modulation",)))
    with pytest.raises(UnknownModelError, match="Unknown FLUX.2 transformer geometry"):
        load_gguf_transformer(_rewrite(src, tmp_path / "odd.gguf", drop=("guidance_in.",)))


def test_combo_lists_gguf_files_of_the_diffusion_model_folders(tmp_path, comfy_host):
    import folder_paths

    from comfyui_flux2dev.host.menus import model_choices

    (tmp_path / "a.gguf").write_bytes(b"")
    (tmp_path / "b.safetensors").write_bytes(b"")
    extensions = set(folder_paths.folder_names_and_paths["diffusion_models"][1])
    folder_paths.add_model_folder_path("diffusion_models", str(tmp_path))
    try:
        choices = model_choices("gguf")
        assert choices["a.gguf"] == str(tmp_path / "a.gguf") and "b.safetensors" not in choices
        assert "b.safetensors" in folder_paths.get_filename_list("diffusion_models")
        assert "a.gguf" not in folder_paths.get_filename_list("diffusion_models")
        assert set(folder_paths.folder_names_and_paths["diffusion_models"][1]) == extensions
    finally:
        folder_paths.folder_names_and_paths["diffusion_models"][0].remove(str(tmp_path))


def test_node_lists_and_loads_gguf_files(gguf_dir, ops, comfy_host):
    import folder_paths

    from comfyui_flux2dev.nodes import NODES
    from comfyui_flux2dev.nodes.gguf import Flux2DevGGUFTransformerLoader

    root = str(gguf_dir[0])
    folder_paths.add_model_folder_path("diffusion_models", root)
    try:
        schema = Flux2DevGGUFTransformerLoader.define_schema()
        assert schema.node_id == "Flux2DevGGUFTransformerLoader" and Flux2DevGGUFTransformerLoader in NODES
        names = schema.inputs[0].options
        assert "flux2-klein-4b-tiny-Q8_0.gguf" in names and all(n.endswith(".gguf") for n in names)
        out = Flux2DevGGUFTransformerLoader.execute("flux2-klein-4b-tiny-Q8_0.gguf", "default", "float32")
        assert out.result[0].model.flux2_variant.key == "klein-4b"
    finally:
        folder_paths.folder_names_and_paths["diffusion_models"][0].remove(root)


def test_conv_and_embedding_weights_stay_packed(comfy_host, device):
    """FLUX.2 has Linear layers only; the ops' Conv and Embedding layers are checked on their own."""
    import gguf

    from comfyui_flux2dev.host.ops import packed_operations

    q8 = gguf.GGMLQuantizationType.Q8_0
    rng = np.random.default_rng(0)
    floats = {"conv.weight": rng.standard_normal((8, 4, 3, 32)), "emb.weight": rng.standard_normal((10, 64))}
    raw = {k: gguf.quants.quantize(v.astype(np.float32), q8) for k, v in floats.items()}
    values = {k: torch.from_numpy(gguf.quants.dequantize(v, q8)) for k, v in raw.items()}
    layers = packed_operations()
    net = torch.nn.Module()
    net.conv = layers.Conv2d(4, 8, (3, 32))
    net.emb = layers.Embedding(10, 64)
    bias = torch.randn(8)
    sd = {k: torch.from_numpy(v) for k, v in raw.items()}
    sd.update({k.replace("weight", "weight_gguf_type"): torch.tensor(int(q8)) for k in raw})
    sd["conv.bias"] = bias
    net.load_state_dict(sd)
    assert net.conv.weight.dtype == net.emb.weight.dtype == torch.uint8
    net.to(device)
    values = {k: v.to(device) for k, v in values.items()}
    x = torch.randn(1, 4, 5, 40).to(device)
    assert torch.equal(net.conv(x), torch.nn.functional.conv2d(x, values["conv.weight"], bias.to(device)))
    ids = torch.tensor([[1, 7, 3]], device=device)
    assert torch.equal(net.emb(ids, out_dtype=torch.float32), torch.nn.functional.embedding(ids, values["emb.weight"]))


def test_patched_weight_comes_back_dequantized_when_the_host_asks_for_it(gguf_dir, ops, comfy_host, device):
    """Newer hosts ask patch_weight_to_device(..., return_weight=True) for the real values (to save a model)."""
    _, reference, patched, patched_reference = with_lora(gguf_dir, ops, comfy_host, "Q4_0")
    key = "diffusion_model.double_blocks.0.img_attn.qkv.weight"
    got = patched.patch_weight_to_device(key, device, return_weight=True)
    assert got.device.type == device.type
    got = got.cpu()
    patched_reference.patch_model(device_to=CPU)
    try:
        want = _attr(patched_reference.model, key)
    finally:
        patched_reference.unpatch_model(device_to=CPU)
    assert got.shape == want.shape and (got.float() - want.float()).abs().max().item() <= 1e-5
    assert not torch.equal(want, _attr(reference.model, key))  # the LoRA is in it


def test_patches_handed_over_as_lowvram_functions_apply_after_dequantization(gguf_dir, ops, comfy_host, device):
    """Newer hosts' dynamic patcher sets "weight_lowvram_function" on layers instead of weight_function, and leaves
    the weights where they are (here the CPU) for the ops to copy to the input's device."""
    import comfy.model_patcher

    _, _, patched, patched_reference = with_lora(gguf_dir, ops, comfy_host, "Q6_K")
    expected = run(patched_reference, device)
    layers = []
    for key in patched.patches:
        layer = _attr(patched.model, key.rpartition(".")[0])
        layer.weight_lowvram_function = comfy.model_patcher.LowVramPatch(key, patched.patches)
        layers.append(layer)
    try:
        assert (forward(patched, device) - expected).abs().max().item() <= 1e-5
    finally:
        for layer in layers:
            del layer.weight_lowvram_function


def _attr(obj, dotted: str):
    import comfy.utils

    return comfy.utils.get_attr(obj, dotted)
