"""The pack against the running host's internals: each internal it relies on is there, its patchers are the
class the host's own loaders would build at that moment, and every model it returns carries a factory the
host's device nodes and multi-GPU clone (newer releases) rebuild it with."""

from __future__ import annotations

import pytest
import torch

from helpers import PACK

CPU = torch.device("cpu")
PROMPT = "a red fox in the snow"


@pytest.fixture(scope="module")
def paths(tiny_root):
    return {
        "gguf": tiny_root / "unet/flux2-dev-tiny-Q4_K.gguf",
        "transformer": tiny_root / "diffusion_models/flux2-dev-tiny.safetensors",
        "encoder": tiny_root / "text_encoders/mistral_3_small_flux2_bf16.safetensors",
        "fp8 encoder": tiny_root / "text_encoders/mistral_3_small_flux2_fp8.safetensors",
        "vae": tiny_root / "vae/flux2-ae.safetensors",
    }


def _load(kind: str, path, **kwargs):
    from comfyui_flux2dev.host import clip, model, vae

    loaders = {
        "gguf": lambda: model.load_gguf_model(str(path), dtype=torch.float32, **kwargs),
        "transformer": lambda: model.load_model(str(path), dtype=torch.float32, **kwargs),
        "encoder": lambda: clip.load_clip(str(path), padding="comfy", dtype=torch.float32, **kwargs),
        "fp8 encoder": lambda: clip.load_clip(str(path), padding="comfy", dtype=torch.float32, **kwargs),
        "vae": lambda: vae.load_vae(str(path)),
    }
    return loaders[kind]()


def _patcher(kind: str, loaded):
    return loaded if kind in ("gguf", "transformer") else loaded.patcher


def _output(kind: str, patcher) -> torch.Tensor:
    """The patcher's model run on a fixed input."""
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        if kind in ("gguf", "transformer"):
            variant = patcher.model.flux2_variant
            x = torch.randn(1, 128, 4, 4, generator=g)
            context = torch.randn(1, 5, variant.context_in_dim, generator=g)
            return patcher.model.diffusion_model(x, torch.tensor([0.7]), context, guidance=torch.tensor([4.0]))
        if kind == "vae":
            return patcher.model.decode(torch.randn(1, 128, 2, 2, generator=g))
        tokens = {"mistral3_24b": [[(1, 1.0), (17, 1.0), (1097, 1.0), (4051, 1.0), (18, 1.0)]]}
        return patcher.model.encode_token_weights(tokens)[0]


def test_every_host_internal_the_pack_uses_is_there(comfy_host):
    from comfyui_flux2dev.host.compat import missing_internals

    missing = missing_internals()
    assert missing == [], "This ComfyUI lacks internals the pack builds on:\n" + "\n".join(missing)


HOST_ROOTS = ("comfy", "comfy_api", "folder_paths", "comfyui_version")


def _host_names(path) -> set[str]:
    """The host names a module uses: each dotted chain from an imported host module (import comfy.sd; from
    comfy_api.latest import io), longest form only (comfy.sd.CLIP.load_sd, not also comfy.sd.CLIP)."""
    import ast

    tree = ast.parse(path.read_text(encoding="utf-8"))
    aliases = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in HOST_ROOTS:
                    aliases[(alias.asname or alias.name).split(".")[0]] = \
                        alias.name if alias.asname else alias.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] in HOST_ROOTS:
            for alias in node.names:
                aliases[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    found = set()
    for node in ast.walk(tree):
        parts = []
        while isinstance(node, ast.Attribute):
            parts.append(node.attr)
            node = node.value
        if isinstance(node, ast.Name) and node.id in aliases:
            found.add(".".join([aliases[node.id], *reversed(parts)]))
    return {name for name in found if not any(other.startswith(name + ".") for other in found)}


def test_the_hosts_lora_reader_logs_each_tensor_it_did_not_read(comfy_host):
    """The LoRA node counts what the host's reader left by its log line for each such tensor."""
    import comfy.lora

    from comfyui_flux2dev.host.compat import host_warnings, lora_keys_not_loaded

    lora = {"read.lora_up.weight": torch.ones(2, 1), "read.lora_down.weight": torch.ones(1, 2),
            "left.diff": torch.ones(1)}
    with host_warnings() as messages:
        patches = comfy.lora.load_lora(lora=lora, to_load={"read": "model.weight"})
    assert list(patches) == ["model.weight"] and lora_keys_not_loaded(messages) == {"left.diff"}


def test_the_hosts_weight_adapters_log_a_patch_they_cannot_apply(comfy_host):
    """The pack measures each LoRA layer's change through the host's arithmetic, and raises its own error with what
    the host logs where an adapter fails (it logs, and leaves the weight as it was)."""
    import comfy.lora

    from comfyui_flux2dev.host.compat import host_warnings

    patches = comfy.lora.load_lora(lora={"x.lora_up.weight": torch.ones(3, 1), "x.lora_down.weight": torch.ones(1, 2)},
                                   to_load={"x": "model.weight"})
    weight = torch.zeros(2, 2)
    with host_warnings() as messages:
        out = comfy.lora.calculate_weight([(1.0, patches["model.weight"], 1.0, None, None)], weight.clone(),
                                          "model.weight")
    assert torch.equal(out, weight) and len(messages) == 1 and "model.weight" in messages[0]


def test_every_host_name_the_pack_uses_is_probed_in_compat():
    """A scan of host/ and nodes/: each name of ComfyUI the code reaches is a REQUIRED or OPTIONAL row of
    compat (the row may name a member of it, or it a member of the row's), so a release that drops it fails
    the probe above with the row's words, not deep inside a load."""
    from comfyui_flux2dev.host.compat import OPTIONAL, REQUIRED

    used = set()
    for folder in ("host", "nodes"):
        for path in sorted((PACK / folder).glob("*.py")):
            used |= _host_names(path)
    probed = [spec.replace(":", ".") for _, spec in REQUIRED] + [spec.replace(":", ".") for _, spec, _ in OPTIONAL]
    assert len(used) > 30, sorted(used)  # the scan sees the code's host names
    unprobed = sorted(n for n in used
                      if not any(p == n or p.startswith(n + ".") or n.startswith(p + ".") for p in probed))
    assert not unprobed, f"host names the pack uses that compat's REQUIRED does not list: {unprobed}"


def test_optional_internals_are_there_from_their_release_on(comfy_host):
    from comfyui_flux2dev.host import compat

    release = compat._release(compat.host_version())
    for _what, spec, since in compat.OPTIONAL:
        if release >= compat._release(since):
            compat._lookup(spec)  # raises with the name when a release that should have it lacks it


@pytest.mark.parametrize("kind", ["gguf", "transformer", "encoder", "fp8 encoder"])
def test_patchers_are_the_class_the_host_would_build(comfy_host, paths, kind, monkeypatch):
    """Newer releases pick their loaders' patcher class at start-up (CoreModelPatcher: the dynamic-VRAM one on
    NVIDIA); the pack's models get whatever class is chosen, packed weights still patched after dequantization."""
    import comfy.model_patcher

    from comfyui_flux2dev.host.ops import PackedPatching

    class HostsChoice(comfy.model_patcher.ModelPatcher):
        pass

    monkeypatch.setattr(comfy.model_patcher, "CoreModelPatcher", HostsChoice, raising=False)
    patcher = _patcher(kind, _load(kind, paths[kind]))
    uses_core = kind in ("gguf", "transformer") or "disable_dynamic" in _clip_parameters()
    assert isinstance(patcher, HostsChoice if uses_core else comfy.model_patcher.ModelPatcher)
    assert isinstance(patcher, PackedPatching) == (kind in ("gguf", "encoder", "fp8 encoder"))
    assert isinstance(patcher.clone(), PackedPatching) == isinstance(patcher, PackedPatching)

    plain = _patcher(kind, _load(kind, paths[kind], disable_dynamic=True))
    assert not isinstance(plain, HostsChoice)


def _clip_parameters():
    import inspect

    import comfy.sd

    return inspect.signature(comfy.sd.CLIP).parameters


def test_dynamic_vram_on_the_cpu_falls_back_as_the_host_does(comfy_host, paths, monkeypatch):
    import comfy.model_patcher

    if not hasattr(comfy.model_patcher, "ModelPatcherDynamic"):
        pytest.skip("this ComfyUI has no dynamic-VRAM patcher (older than 0.33)")
    from comfyui_flux2dev.host.ops import PackedPatching

    monkeypatch.setattr(comfy.model_patcher, "CoreModelPatcher", comfy.model_patcher.ModelPatcherDynamic)
    patcher = _load("gguf", paths["gguf"])
    assert isinstance(patcher, PackedPatching) and not patcher.is_dynamic()
    assert isinstance(patcher.clone(disable_dynamic=True), PackedPatching)


@pytest.mark.parametrize("kind", ["gguf", "transformer", "encoder", "fp8 encoder", "vae"])
def test_reload_factory_rebuilds_an_equal_model(comfy_host, paths, kind):
    patcher = _patcher(kind, _load(kind, paths[kind]))
    factory, args = patcher.cached_patcher_init
    for again in (factory(*args), factory(*args, disable_dynamic=True)):
        assert again.model is not patcher.model
        assert type(again) is type(patcher)
        assert torch.equal(_output(kind, again), _output(kind, patcher))


def test_device_nodes_take_the_packs_models(comfy_host, paths):
    nodes_multigpu = pytest.importorskip("comfy_extras.nodes_multigpu",
                                         reason="this ComfyUI has no device nodes (older than 0.33)")

    from comfyui_flux2dev.host.ops import PackedPatching

    model = _load("gguf", paths["gguf"])
    clip = _load("encoder", paths["encoder"])
    vae = _load("vae", paths["vae"])
    for device in ("cpu", "default"):
        moved = nodes_multigpu.SelectModelDeviceNode.execute(model, device).result[0]
        assert moved.load_device == CPU and isinstance(moved, PackedPatching)
        assert torch.equal(_output("gguf", moved), _output("gguf", model))
        moved_clip = nodes_multigpu.SelectCLIPDeviceNode.execute(clip, device).result[0]
        assert moved_clip.patcher.load_device == CPU and isinstance(moved_clip.patcher, PackedPatching)
    assert nodes_multigpu.SelectVAEDeviceNode.execute(vae, "default").result[0].patcher.load_device \
        == vae.patcher.load_device

    # The multi-GPU clone loads a model of its own through the factory.
    twin = model.deepclone_multigpu(new_load_device=CPU)
    assert twin.model is not model.model and isinstance(twin, PackedPatching)
    assert torch.equal(_output("gguf", twin), _output("gguf", model))


@pytest.mark.parametrize("name", ["decoder.conv_out.weight", "encoder.quant_conv.weight"])
def test_a_vae_weight_missing_after_the_hosts_key_conversion_stops_the_load(comfy_host, paths, tmp_path, name):
    from safetensors.torch import load_file, save_file

    from comfyui_flux2dev.errors import MissingWeightsError
    from comfyui_flux2dev.host.vae import load_vae

    tensors = load_file(paths["vae"])
    assert name in tensors
    save_file({k: v for k, v in tensors.items() if k != name}, tmp_path / "ae.safetensors")
    with pytest.raises(MissingWeightsError, match=name.removeprefix("encoder.")):
        load_vae(tmp_path / "ae.safetensors")
