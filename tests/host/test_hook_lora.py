"""The host's hook LoRAs (CreateHookLora + SetClipHooks, CreateHookLoraModelOnly + SetModelHooksOnCond) on packed
weights: the same result as LoraLoader's on the same objects, for CLIP and MODEL, with the stored weights left
packed and untouched."""

from __future__ import annotations

import os

import pytest
import torch

from helpers import flux2_forward, on_device, tiny_lora

CPU = torch.device("cpu")
LAYERS = tuple(f"mistral3_24b.transformer.model.{name}"
               for name in ("layers.5.self_attn.q_proj", "layers.20.mlp.down_proj", "embed_tokens"))
EMBEDDING = LAYERS[-1]
PROMPT = "a red fox in the snow"


def _clip_lora(clip, layers=LAYERS) -> dict:
    """A rank-4 LoRA over `layers` of a CLIP, in the host's text_encoders. spelling."""
    g = torch.Generator().manual_seed(3)
    lora = {}
    for name in layers:
        rows, columns = clip.cond_stage_model.get_submodule(name).weight_shape
        lora[f"text_encoders.{name}.lora_up.weight"] = torch.randn(rows, 4, generator=g) * 0.2
        lora[f"text_encoders.{name}.lora_down.weight"] = torch.randn(4, columns, generator=g) * 0.2
        lora[f"text_encoders.{name}.alpha"] = torch.tensor(4.0)
    return lora


def _packed(module) -> dict:
    """The stored weights of a module's packed layers (float weights are the host's to patch in place)."""
    from comfyui_flux2dev.host.ops import PackedLayer

    return {name: layer.weight.detach().cpu().clone() for name, layer in module.named_modules()
            if isinstance(layer, PackedLayer) and layer.companions}


def _same_bytes(before: dict, after: dict) -> bool:
    """Whether two _packed results hold the same bytes in the same dtypes."""
    if before.keys() != after.keys():
        return False
    return all(v.dtype == after[k].dtype and torch.equal(v.view(torch.uint8), after[k].view(torch.uint8))
               for k, v in before.items())


CLIPS = ("mistral_3_small_flux2_fp8.safetensors", "mistral_3_small_flux2_fp4_mixed.safetensors", "mistral3-q4_0.gguf")


@pytest.mark.parametrize("name", CLIPS)
def test_clip_hook_lora_equals_lora_loader(comfy_host, tiny_root, name, device):
    import comfy.hooks
    from comfy_extras.nodes_hooks import SetClipHooks

    from comfyui_flux2dev.host.clip import load_clip

    clip = load_clip(os.path.join(tiny_root, "text_encoders", name), dtype=torch.float32)
    on_device(clip.patcher, device)  # the clones below inherit it
    stored = _packed(clip.cond_stage_model)
    lora = _clip_lora(clip)
    tokens = clip.tokenize(PROMPT)
    plain = clip.encode_from_tokens(tokens).cpu()
    _, loaded = comfy_host.load_lora_for_models(None, clip, lora, 0.0, 1.0)
    assert len(loaded.patcher.patches) == len(LAYERS)
    expected = loaded.encode_from_tokens(tokens).cpu()
    assert (expected - plain).abs().max() > 0.1  # the LoRA counts

    hooks = comfy.hooks.create_hook_lora(lora, strength_model=0.0, strength_clip=1.0)  # what CreateHookLora makes
    (hooked,) = SetClipHooks().apply_hooks(clip=clip, schedule_clip=False, apply_to_conds=True, hooks=hooks)
    first = hooked.encode_from_tokens(tokens).cpu()
    assert (first - expected).abs().max().item() <= 1e-6
    assert torch.equal(clip.encode_from_tokens(tokens).cpu(), plain)  # the hook is gone with its CLIP
    assert torch.equal(hooked.encode_from_tokens(tokens).cpu(), first)  # and back again
    assert _same_bytes(stored, _packed(clip.cond_stage_model))  # packed and untouched throughout


def _model_hooks(lora: dict):
    """CreateHookLoraModelOnly's hooks of a LoRA."""
    import comfy.hooks

    return comfy.hooks.create_hook_lora(lora, strength_model=1.0, strength_clip=0.0)


def _sample(patcher, hooks=None) -> torch.Tensor:
    """A 1-step euler sample of the tiny model, its conditioning carrying `hooks` (SetModelHooksOnCond)."""
    import comfy.hooks
    import comfy.sample

    g = torch.Generator().manual_seed(0)
    context = torch.randn(1, 5, patcher.model.flux2_variant.context_in_dim, generator=g)
    positive = [[context, {"guidance": 4.0, "pooled_output": None}]]
    if hooks is not None:
        positive = comfy.hooks.set_hooks_for_conditioning(positive, hooks)
    negative = [[context, {"guidance": 4.0, "pooled_output": None}]]  # unused at cfg 1
    noise = torch.randn(1, 128, 4, 4, generator=g)
    return comfy.sample.sample(patcher, noise, 1, 1.0, "euler", "simple", positive, negative, torch.zeros(1, 128, 4, 4),
                               seed=0, disable_pbar=True).cpu()


def _hooked_forward(patcher, hooks, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Forwards of the model with the hooks on, off, and on again (the last from the host's hook cache), each
    patched the way the host's sampler patches a hooked conditioning."""
    import comfy.hooks

    patcher = patcher.clone()
    patcher.register_all_hook_patches(hooks, comfy.hooks.create_target_dict(comfy.hooks.EnumWeightTarget.Model))
    patcher.patch_model(device_to=device)
    outputs = []
    try:
        for active in (hooks, None, hooks):
            patcher.apply_hooks(active)
            with torch.no_grad():
                outputs.append(flux2_forward(patcher, device).cpu())
    finally:
        patcher.unpatch_model(device_to=CPU)
    return tuple(outputs)


def _forward(patcher, device) -> torch.Tensor:
    patcher.patch_model(device_to=device)
    try:
        with torch.no_grad():
            return flux2_forward(patcher, device).cpu()
    finally:
        patcher.unpatch_model(device_to=CPU)


MODELS = {
    "fp8": lambda root, m: m.load_model(str(root / "diffusion_models/flux2-dev-tiny-fp8-weight_scale.safetensors"),
                                        dtype=torch.float32),
    "gguf": lambda root, m: m.load_gguf_model(str(root / "unet/flux2-dev-tiny-Q4_0.gguf"), dtype=torch.float32),
}


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_model_hook_lora_equals_lora_loader(comfy_host, tiny_root, kind, device):
    from comfyui_flux2dev.host import model as host_model

    patcher = on_device(MODELS[kind](tiny_root, host_model), device)
    stored = _packed(patcher.model.diffusion_model)
    lora = tiny_lora(patcher)
    loaded, _ = comfy_host.load_lora_for_models(patcher, None, lora, 1.0, 0.0)
    assert len(loaded.patches) == 3
    expected, plain = _forward(loaded, device), _forward(patcher, device)
    assert (expected - plain).abs().max() > 1e-3  # the LoRA counts
    on, off, cached = _hooked_forward(patcher, _model_hooks(lora), device)
    assert (on - expected).abs().max().item() <= 1e-5
    assert (cached - expected).abs().max().item() <= 1e-5
    assert (off - plain).abs().max().item() <= 1e-5
    # Through the host's sampler, as SetModelHooksOnCond's conditioning runs.
    want = _sample(loaded)
    assert (_sample(patcher) - want).abs().max() > 1e-3
    assert (_sample(patcher, _model_hooks(lora)) - want).abs().max().item() <= 1e-5
    assert _same_bytes(stored, _packed(patcher.model.diffusion_model))


def test_model_as_lora_hook_reads_the_dequantized_weight(comfy_host, tiny_root, device):
    """CreateHookModelAsLora's hook adds (its model's weight - this model's weight as loaded): a Q4_0 model's
    weights (gguf-py's dequantization) over a Q8_0 model give the Q4_0 model's output."""
    import comfy.hooks

    from comfyui_flux2dev.host import model as host_model
    from helpers import reference_model

    q8 = host_model.load_gguf_model(str(tiny_root / "unet/flux2-dev-tiny-Q8_0.gguf"), dtype=torch.float32)
    on_device(q8, device)
    q4 = on_device(reference_model(tiny_root / "unet/flux2-dev-tiny-Q4_0.gguf"), device)
    weights = {k: v for k, v in q4.model.state_dict().items() if k.startswith("diffusion_model.")}
    hooks = comfy.hooks.create_hook_model_as_lora(weights, None, strength_model=1.0, strength_clip=0.0)
    expected = _forward(q4, device)
    assert (expected - _forward(q8, device)).abs().max() > 1e-4
    on, _, _ = _hooked_forward(q8, hooks, device)
    assert (on - expected).abs().max().item() <= 1e-5


def test_gguf_embedding_takes_the_dynamic_patchers_lowvram_function(comfy_host, tiny_root, device):
    """0.33's dynamic-VRAM patcher hands a layer its LoRA as weight_lowvram_function (set here as it sets it):
    the GGUF embedding's gathered-rows path must not skip it."""
    import comfy.model_patcher

    from comfyui_flux2dev.host.clip import load_clip

    clip = load_clip(os.path.join(tiny_root, "text_encoders/mistral3-q4_0.gguf"), dtype=torch.float32)
    layer = clip.cond_stage_model.get_submodule(EMBEDDING)
    lora = _clip_lora(clip, (EMBEDDING,))
    _, loaded = comfy_host.load_lora_for_models(None, clip, lora, 0.0, 1.0)
    key = f"{EMBEDDING}.weight"
    ids = torch.tensor([[1, 17, 97, 40, 5]], device=device)
    layer.to(device)
    with torch.no_grad():
        plain = layer(ids).cpu()
        layer.weight_lowvram_function = comfy.model_patcher.LowVramPatch(key, loaded.patcher.patches)
        try:
            out = layer(ids).cpu()
        finally:
            del layer.weight_lowvram_function
    up, down = lora[f"text_encoders.{EMBEDDING}.lora_up.weight"], lora[f"text_encoders.{EMBEDDING}.lora_down.weight"]
    delta = (up @ down)[ids.cpu()]  # alpha / rank = 1
    assert delta.abs().max() > 1e-2
    assert (out - plain - delta).abs().max().item() <= 1e-5
