"""Load FLUX.2 LoRA (host/lora.py) on every LoRA layout trainers publish: BFL/ComfyUI names with lora_up/down and
alpha or lora_A/B, diffusers/PEFT names, kohya, OneTrainer, LyCORIS LoKr, LoHa and full differences, DoRA. Every
tensor lands, and the patched model equals the LoRA's own math, computed here: in BFL names directly, and in
diffusers names placed into BFL's weights by diffusers' own converter (each diffusers weight's values traced back
to the BFL weight and rows they came from), so the pack's key table is checked by code other than its own. The
patched weights of a dense model are compared one by one; packed models (safetensors bf16, scaled fp8, GGUF Q8_0
and Q4_K) by a forward pass against a dense model holding the same weights plus the expected differences."""

from __future__ import annotations

import pytest
import torch

from comfyui_flux2dev.errors import CorruptFileError, WrongModelError
from helpers import dense_model, tiny_lora
from lora_models import CPU, PACKED, close, forward, patched_weights, save

ENCODER = "text_encoders/mistral_3_small_flux2_bf16.safetensors"

# One layer of each kind the transformer has, in BFL names and in diffusers names.
BFL_LAYERS = (
    "img_in", "txt_in", "time_in.in_layer", "time_in.out_layer", "guidance_in.in_layer", "guidance_in.out_layer",
    "double_stream_modulation_img.lin", "double_stream_modulation_txt.lin", "single_stream_modulation.lin",
    "double_blocks.0.img_attn.qkv", "double_blocks.0.img_attn.proj", "double_blocks.1.img_mlp.0",
    "double_blocks.1.img_mlp.2", "double_blocks.1.txt_attn.qkv", "double_blocks.0.txt_attn.proj",
    "double_blocks.0.txt_mlp.0", "double_blocks.1.txt_mlp.2", "single_blocks.0.linear1", "single_blocks.1.linear2",
    "final_layer.linear", "final_layer.adaLN_modulation.1",
)
DIFFUSERS_LAYERS = (
    "x_embedder", "context_embedder", "time_guidance_embed.timestep_embedder.linear_1",
    "time_guidance_embed.guidance_embedder.linear_2", "double_stream_modulation_img.linear",
    "double_stream_modulation_txt.linear", "single_stream_modulation.linear",
    *(f"transformer_blocks.0.attn.{name}" for name in ("to_q", "to_k", "to_v", "to_out.0")),
    *(f"transformer_blocks.1.attn.{name}" for name in ("add_q_proj", "add_k_proj", "add_v_proj", "to_add_out")),
    "transformer_blocks.0.ff.linear_in", "transformer_blocks.1.ff.linear_out",
    "transformer_blocks.1.ff_context.linear_in", "transformer_blocks.0.ff_context.linear_out",
    "single_transformer_blocks.0.attn.to_qkv_mlp_proj",
    "single_transformer_blocks.1.attn.to_out", "proj_out", "norm_out.linear",
)


def _underscored(name: str) -> str:
    return name.replace(".", "_")


# (id, names the layers are given in, how a layer's name is spelled, the adapter)
LAYOUTS = (
    ("bfl-up-down-alpha", "bfl", "diffusion_model.{}", "lora_up_down"),
    ("bfl-A-B", "bfl", "diffusion_model.{}", "lora_A_B"),
    ("comfyui-bare-A-B", "bfl", "{}", "lora_A_B"),
    ("diffusers-peft", "diffusers", "transformer.{}", "lora_A_B"),
    ("kohya", "bfl", "lora_unet_{flat}", "lora_up_down"),
    ("onetrainer", "diffusers", "lora_transformer_{flat}", "lora_up_down"),
    ("lycoris-lokr-diffusers", "diffusers", "lycoris_{flat}", "lokr"),
    ("lycoris-lokr-bfl", "bfl", "lycoris_{flat}", "lokr"),
    ("lycoris-loha-bfl", "bfl", "lycoris_{flat}", "loha"),
    ("lycoris-full-diffusers", "diffusers", "lycoris_{flat}", "diff"),
    ("dora-bfl", "bfl", "diffusion_model.{}", "dora"),
)


def _spelled(spelling: str, layer: str) -> str:
    return spelling.format(layer, flat=_underscored(layer))


def _adapter(kind: str, name: str, weight: torch.Tensor, g: torch.Generator) -> tuple[dict, object]:
    """The tensors of one layer of `kind` for `weight` (its shape, and DoRA's magnitudes near its own), and how its
    difference follows from the weight: a tensor to add, or (for DoRA) a function of the weight."""
    out, inputs = weight.shape
    rank = 4
    scale = 0.05

    def rand(*size):
        return torch.randn(*size, generator=g) * scale

    if kind in ("lora_up_down", "lora_A_B", "dora"):
        up, down = rand(out, rank), rand(rank, inputs)
        alpha = 2.0 if kind != "lora_A_B" else None
        names = (".lora_B.weight", ".lora_A.weight") if kind == "lora_A_B" else (".lora_up.weight", ".lora_down.weight")
        tensors = {name + names[0]: up, name + names[1]: down}
        if alpha is not None:
            tensors[name + ".alpha"] = torch.tensor(alpha)
        diff = up @ down * ((alpha or rank) / rank)
        if kind == "dora":
            magnitude = weight.norm(dim=0, keepdim=True) * (1 + rand(1, inputs))
            tensors[name + ".dora_scale"] = magnitude

            def decomposed(weight, diff=diff, magnitude=magnitude):
                changed = weight + diff
                return changed * (magnitude / (changed.norm(dim=0, keepdim=True) + torch.finfo(weight.dtype).eps)) \
                    - weight
            return tensors, decomposed
        return tensors, diff
    if kind == "lokr":  # w1 whole, w2 as a product of rank 2: the difference is kron(w1, w2) * alpha / rank
        factor = 2 if out % 2 == 0 and inputs % 2 == 0 else 1
        w1 = rand(factor, factor) * 20
        w2_a, w2_b = rand(out // factor, 2), rand(2, inputs // factor)
        tensors = {name + ".lokr_w1": w1, name + ".lokr_w2_a": w2_a, name + ".lokr_w2_b": w2_b,
                   name + ".alpha": torch.tensor(1.0)}
        return tensors, torch.kron(w1, w2_a @ w2_b) * (1.0 / 2)
    if kind == "loha":  # the Hadamard product of two rank-2 products, times alpha / rank
        w1_a, w1_b, w2_a, w2_b = rand(out, 2) * 4, rand(2, inputs) * 4, rand(out, 2) * 4, rand(2, inputs) * 4
        tensors = {name + ".hada_w1_a": w1_a, name + ".hada_w1_b": w1_b, name + ".hada_w2_a": w2_a,
                   name + ".hada_w2_b": w2_b, name + ".alpha": torch.tensor(2.0)}
        return tensors, (w1_a @ w1_b) * (w2_a @ w2_b) * (2.0 / 2)
    diff = rand(out, inputs)
    return {name + ".diff": diff}, diff


def _layout_lora(layout, bfl: dict[str, torch.Tensor], places) -> tuple[dict, dict]:
    """(the LoRA's tensors, the expected difference of each BFL weight, or a function of the weight)."""
    _, names, spelling, kind = layout
    g = torch.Generator().manual_seed(hash(layout[0]) % 2**31)
    tensors, expected = {}, {}
    for layer in BFL_LAYERS if names == "bfl" else DIFFUSERS_LAYERS:
        if names == "bfl":
            key, rows = layer + ".weight", None
            weight = bfl[key]
        else:
            key, rows = places[layer]
            weight = bfl[key].reshape(-1)[rows].reshape(-1, bfl[key].shape[1])
        made, diff = _adapter(kind, _spelled(spelling, layer), weight, g)
        tensors.update(made)
        if rows is None:
            expected[key] = diff
        else:  # a slice (or a reordering) of the BFL weight
            whole = expected.setdefault(key, torch.zeros_like(bfl[key]))
            whole.view(-1)[rows] += diff.reshape(-1)
    return tensors, expected


def _expected_weights(bfl: dict, expected: dict) -> dict:
    return {k: v + (expected[k](v) if callable(expected.get(k)) else expected.get(k, 0)) for k, v in bfl.items()}


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda layout: layout[0])
def test_every_tensor_of_each_layout_lands_as_the_loras_own_math(models, places, layout, tmp_path):
    from comfyui_flux2dev.host.lora import load_lora

    bfl = models["dense"][1]
    tensors, expected = _layout_lora(layout, bfl, places)
    path = save(tensors, tmp_path / f"{layout[0]}.safetensors")
    # The dense model's patched weights, one by one (on 0.33 the norms' keys end in .weight, not .scale).
    dense, _ = models["dense"]
    patched, clip, report = load_lora(dense, None, path, 1.0, 1.0)
    assert clip is None
    assert (report.applied_count, report.total, report.not_applied) == (len(tensors), len(tensors), {})
    want = _expected_weights(bfl, expected)
    assert report.summary() == f"{len(tensors)} of {len(tensors)} LoRA tensors applied, changing {len(expected)} " \
        "weights of the transformer"
    got = patched_weights(patched)
    for key, value in want.items():
        assert (got[key] - value).abs().max().item() <= 1e-5, key
    changed = [k for k in want if not torch.equal(want[k], bfl[k])]
    assert len(changed) == len(expected)
    # Packed models: the forward pass against a dense model with the expected weights.
    for name in PACKED:
        model, weights = models[name]
        out = forward(load_lora(model, None, path, 1.0, 0.0)[0])
        reference = forward(dense_model(_expected_weights(weights, expected)))
        assert (out - forward(model)).abs().max() > 1e-3, name  # the LoRA counts
        # float32 rounding grows with the output, which DoRA's rescaled columns make large
        assert close(out, reference), (name, (out - reference).abs().max().item())


def test_strength_scales_and_the_input_model_is_untouched(models, places, tmp_path):
    from comfyui_flux2dev.host.lora import load_lora

    model, bfl = models["Q4_K"]
    tensors, expected = _layout_lora(LAYOUTS[3], models["dense"][1], places)
    path = save(tensors, tmp_path / "lora.safetensors")
    before = forward(model)
    half = forward(load_lora(model, None, path, 0.5, 1.0)[0])
    reference = forward(dense_model({k: v + 0.5 * expected.get(k, 0) for k, v in bfl.items()}))
    assert close(half, reference), (half - reference).abs().max().item()
    assert torch.equal(forward(model), before)
    assert load_lora(model, None, path, 0.0, 1.0)[0] is model  # strength 0: the MODEL as it came


ENCODER_LAYERS = ("layers.0.self_attn.q_proj", "layers.1.mlp.down_proj", "layers.29.self_attn.o_proj")


@pytest.mark.parametrize("spelling, dora", (("text_encoder.model.language_model.{}", False),
                                            ("text_encoder.model.{}", False), ("base_model.model.model.{}", False),
                                            ("lora_te_model_{flat}", False), ("lora_te_model_{flat}", True)))
def test_text_encoder_layers_land_on_the_clip_as_the_hosts_own_spelling_does(comfy_host, tiny_root, models,
                                                                             spelling, dora, tmp_path):
    """Hugging Face/PEFT and kohya names of the Mistral encoder's layers, against the host's own LoRA loader given
    the same layers in its own spelling (text_encoders.mistral3_24b.transformer.model.<layer>); with DoRA per column
    (where the host's arithmetic is LyCORIS's) the lazy CLIP reads its weights to measure the change on them."""
    from comfyui_flux2dev.host.clip import load_clip
    from comfyui_flux2dev.host.lora import load_lora

    clip = load_clip(str(tiny_root / ENCODER), dtype=torch.float32)
    g = torch.Generator().manual_seed(5)
    ours, hosts = {}, {}
    for layer in ENCODER_LAYERS:
        rows, columns = clip.cond_stage_model.get_submodule(f"mistral3_24b.transformer.model.{layer}").weight.shape
        up, down = torch.randn(rows, 4, generator=g) * 0.2, torch.randn(4, columns, generator=g) * 0.2
        name = spelling.format(layer, flat=_underscored(layer))
        magnitude = {".dora_scale": 1 + torch.rand(1, columns, generator=g)} if dora else {}
        ours.update({f"{name}.lora_B.weight": up, f"{name}.lora_A.weight": down,
                     **{name + end: t for end, t in magnitude.items()}})
        host = f"text_encoders.mistral3_24b.transformer.model.{layer}"
        hosts.update({f"{host}.lora_B.weight": up, f"{host}.lora_A.weight": down,
                      **{host + end: t for end, t in magnitude.items()}})
    model, _ = models["Q8_0"]
    same_model, patched, report = load_lora(model, clip, save(ours, tmp_path / "te.safetensors"), 1.0, 0.8)
    assert same_model is model  # nothing of it patches the transformer
    assert report.summary() == f"{len(ours)} of {len(ours)} LoRA tensors applied, changing {len(ENCODER_LAYERS)} " \
        "weights of the text encoder"
    _, expected = comfy_host.load_lora_for_models(None, clip, hosts, 0.0, 0.8)
    tokens = clip.tokenize("a red fox in the snow")
    want = expected.encode_from_tokens(tokens)
    assert (want - clip.encode_from_tokens(tokens)).abs().max() > 1e-3
    assert (patched.encode_from_tokens(tokens) - want).abs().max().item() <= 1e-6


def test_tensors_that_land_nowhere_are_named(models, tmp_path):
    from comfyui_flux2dev.host.lora import load_lora

    model, _ = models["dense"]
    lora = tiny_lora(model)
    lora["diffusion_model.double_blocks.7.img_attn.qkv.lora_up.weight"] = torch.zeros(768, 4)  # no block 7
    lora["diffusion_model.double_blocks.7.img_attn.qkv.lora_down.weight"] = torch.zeros(4, 256)
    lora["text_encoders.mistral3_24b.transformer.model.layers.0.mlp.up_proj.lora_up.weight"] = torch.zeros(8, 4)
    lora["text_encoders.mistral3_24b.transformer.model.layers.0.mlp.up_proj.lora_down.weight"] = torch.zeros(4, 8)
    lora["diffusion_model.guidance_in.in_layer.alpha"] = torch.tensor(1.0)  # no pair beside it
    lora["diffusion_model.txt_in.diff_b"] = torch.zeros(256)  # FLUX.2's layers have no bias
    lora["diffusion_model.img_in.lora_B.weight"] = torch.zeros(256, 2)  # a pair that multiplies to zero
    lora["diffusion_model.img_in.lora_A.weight"] = torch.ones(2, 128)
    lora["diffusion_model.txt_in.something_else"] = torch.zeros(3)  # no adapter's part
    _, _, report = load_lora(model, None, save(lora, tmp_path / "some.safetensors"), 1.0, 1.0)
    assert report.applied_count + sum(map(len, report.not_applied.values())) == report.total
    assert report.summary() == (
        "9 of 18 LoRA tensors applied, changing 3 weights of the transformer\n"
        "1 not applied, of no kind of adapter ComfyUI applies: diffusion_model.txt_in.something_else\n"
        "4 not applied, naming no layer of the FLUX.2 transformer or its text encoder given: "
        "diffusion_model.double_blocks.7.img_attn.qkv.lora_down.weight, "
        "diffusion_model.double_blocks.7.img_attn.qkv.lora_up.weight, "
        "text_encoders.mistral3_24b.transformer.model.layers.0.mlp.up_proj.lora_down.weight ...\n"
        "1 not applied, an alpha or DoRA magnitude without the factors it scales: "
        "diffusion_model.guidance_in.in_layer.alpha\n"
        "1 not applied, bias differences, where FLUX.2 and its text encoder have no bias: "
        "diffusion_model.txt_in.diff_b\n"
        "2 not applied, that change nothing here (factors that multiply to zero, or a change below float32's "
        "precision): diffusion_model.img_in.lora_A.weight, diffusion_model.img_in.lora_B.weight")


def test_a_layer_shaped_for_another_weight_is_refused_naming_it(models, tmp_path):
    from comfyui_flux2dev.host.lora import load_lora

    model, _ = models["dense"]
    lora = tiny_lora(model)
    lora["diffusion_model.double_blocks.1.img_attn.proj.lora_up.weight"] = torch.zeros(768, 4)  # shaped for qkv
    lora["diffusion_model.double_blocks.1.img_attn.proj.lora_down.weight"] = torch.zeros(4, 256)
    with pytest.raises(WrongModelError, match=r"the LoRA's diffusion_model\.double_blocks\.1\.img_attn\.proj\."
                                              r"lora_down\.weight makes a difference of shape \[768, 256\], but the "
                                              r"weight it names \(diffusion_model\.double_blocks\.1\.img_attn\.proj"
                                              r"\.weight\) is \[256, 256\]"):
        load_lora(model, None, save(lora, tmp_path / "misfit.safetensors"), 1.0, 1.0)


def _pair(name: str, out: int, inputs: int) -> dict:
    return {f"{name}.lora_up.weight": torch.ones(out, 2), f"{name}.lora_down.weight": torch.ones(2, inputs)}


@pytest.mark.parametrize("lora, said", (
    ({**_pair("lora_unet_input_blocks_1_1_proj_in", 320, 320)}, "it is a LoRA of Stable Diffusion or SDXL"),
    ({**_pair("lora_te1_text_model_encoder_layers_0_self_attn_q_proj", 768, 768)},
     "it is a LoRA of Stable Diffusion or SDXL"),
    ({**_pair("lora_unet_some_block_proj", 32, 32)},
     "its layers name no weight of a FLUX.2 transformer or of FLUX.2 \\[dev\\]'s Mistral text encoder"),
    ({**_pair("diffusion_model.double_blocks.0.img_mod.lin", 6 * 3072, 3072),
      **_pair("diffusion_model.double_blocks.0.img_attn.qkv", 3 * 3072, 3072)}, "it is a LoRA of FLUX.1"),
    ({**_pair("transformer.transformer_blocks.0.norm1.linear", 1536, 256)}, "it is a LoRA of FLUX.1"),
    ({**_pair("diffusion_model.double_blocks.0.img_attn.qkv", 3 * 128, 128)},
     "its layers take inputs of width 128, this transformer's are 256; it is for another model: FLUX.2 Klein 4B"),
), ids=("sdxl", "sdxl-text-encoder", "nothing-known", "flux1-bfl", "flux1-diffusers", "klein"))
def test_a_lora_that_patches_nothing_is_refused_saying_what_it_is_for(models, lora, said, tmp_path):
    from comfyui_flux2dev.host.lora import load_lora

    with pytest.raises(WrongModelError, match=said):
        load_lora(models["dense"][0], None, save(lora, tmp_path / "other.safetensors"), 1.0, 1.0)


def test_text_encoder_layers_without_a_clip_and_a_model_of_another_family_are_refused(comfy_host, models, tmp_path):
    import comfy.model_patcher

    from comfyui_flux2dev.host.lora import load_lora

    lora = save(_pair("text_encoder.model.layers.0.self_attn.q_proj", 64, 64), tmp_path / "te.safetensors")
    with pytest.raises(WrongModelError, match="its layers are the text encoder's: connect the FLUX.2 \\[dev\\] CLIP"):
        load_lora(models["dense"][0], None, lora, 1.0, 1.0)
    other = comfy.model_patcher.ModelPatcher(torch.nn.Linear(2, 2), load_device=CPU, offload_device=CPU)
    with pytest.raises(WrongModelError, match="is no FLUX.2 transformer \\(Linear, without double_stream_modulation"):
        load_lora(other, None, lora, 1.0, 1.0)


def test_a_damaged_lora_is_refused_before_a_tensor_is_read(models, tmp_path):
    from comfyui_flux2dev.host.lora import load_lora

    lora = _pair("diffusion_model.double_blocks.0.img_attn.qkv", 768, 256)
    del lora["diffusion_model.double_blocks.0.img_attn.qkv.lora_down.weight"]
    with pytest.raises(CorruptFileError, match="qkv.lora_up.weight but no down beside it"):
        load_lora(models["dense"][0], None, save(lora, tmp_path / "half.safetensors"), 1.0, 1.0)
