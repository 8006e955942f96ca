"""LoRAs as the tools users train with write them, on the tiny FLUX.2 [dev] MODELs: PEFT through diffusers'
Flux2Pipeline.save_lora_weights exactly as diffusers' train_dreambooth_lora_flux2.py saves them (alpha equal to the rank
and not, rank and alpha patterns, rsLoRA, DoRA), and LyCORIS (every algorithm ComfyUI has an adapter for, DoRA on
either axis). Each must land as the tool itself applies it, on the weights the MODEL computes with: diffusers' own
loader and fuse_lora for PEFT, the LyCORIS network's own forward for LyCORIS. And the node's report is what changed."""

from __future__ import annotations

import pytest
import torch

from helpers import dense_model
from lora_models import close, forward, patched_weights

RANK = 4


def _diffusers_model(bfl: dict[str, torch.Tensor]):
    """A float32 diffusers Flux2Transformer2DModel of the tiny [dev] holding the BFL weights `bfl`, through diffusers'
    own converter."""
    from diffusers import Flux2Transformer2DModel
    from diffusers.loaders.single_file_utils import convert_flux2_transformer_checkpoint_to_diffusers

    from comfyui_flux2dev.devtools.tiny.geometry import TINY_VARIANTS
    from comfyui_flux2dev.devtools.tiny.transformers import diffusers_config

    model = Flux2Transformer2DModel(**diffusers_config(TINY_VARIANTS[0]))
    model.load_state_dict(convert_flux2_transformer_checkpoint_to_diffusers({k: v.clone() for k, v in bfl.items()}))
    return model.eval()


def _in_bfl(diffusers_weights: dict[str, torch.Tensor], bfl: dict[str, torch.Tensor], places) -> dict:
    """BFL weights holding `diffusers_weights` where they come from (the rest as in `bfl`)."""
    out = {k: v.clone() for k, v in bfl.items()}
    for name, values in diffusers_weights.items():
        key, positions = places[name.removesuffix(".weight")]
        out[key].view(-1)[positions] = values.reshape(-1).to(out[key].dtype)
    return out


def _check(models, path: str, expected_for, strength: float = 1.0) -> None:
    """The LoRA at `path` on every MODEL against `expected_for(weights)` (a MODEL's float32 BFL weights -> those
    weights as the tool applies the LoRA to them): the dense MODEL's weights one by one, the packed MODELs' forward
    against a dense MODEL of the expected weights; and the report counts what changed."""
    from comfyui_flux2dev.host.lora import load_lora

    model, bfl = models["dense"]
    want = expected_for(bfl)
    patched, _, report = load_lora(model, None, path, strength, 1.0)
    got = patched_weights(patched)
    changed = {k for k in bfl if not torch.equal(want[k], bfl[k])}
    for key in bfl:
        assert close(got[key], want[key]), (key, (got[key] - want[key]).abs().max().item())
    assert (report.applied_count, report.not_applied) == (report.total, {}), report.summary()
    assert report.changed == {"transformer": {"diffusion_model." + k for k in changed}}
    assert {k for k in bfl if not torch.equal(got[k], bfl[k])} == changed
    for name in ("fp8", "Q8_0", "Q4_K"):
        model, bfl = models[name]
        out = forward(load_lora(model, None, path, strength, 1.0)[0])
        reference = forward(dense_model(expected_for(bfl)))
        assert close(out, reference), (name, (out - reference).abs().max().item())


# --- PEFT, saved by diffusers -------------------------------------------------------------------------------------

PEFT_CONFIGS = {
    "alpha-is-rank": {"lora_alpha": RANK},
    "alpha-twice-rank": {"lora_alpha": 2 * RANK},
    "patterns": {"lora_alpha": 8, "rank_pattern": {"to_k": 2, "single_transformer_blocks.1.attn.to_out": 8},
                 "alpha_pattern": {"to_v": 3, "proj_out": 16}},
    "rslora": {"lora_alpha": 8, "use_rslora": True},
    "dora": {"lora_alpha": 8, "use_dora": True},
}


def _peft_lora(models, config: dict, path) -> str:
    """A rank-4 LoRA over every linear layer of the tiny [dev], trained values drawn at random, saved as diffusers'
    FLUX.2 training script saves it."""
    from diffusers import Flux2Pipeline
    from diffusers.training_utils import _collate_lora_metadata
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    model = _diffusers_model(models["dense"][1])
    model.add_adapter(LoraConfig(r=RANK, target_modules="all-linear", init_lora_weights="gaussian", **config))
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:  # PEFT starts B at zero
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
            elif "lora_magnitude_vector" in name:  # and the magnitude at the weight's own norm
                p.mul_(1 + 0.1 * torch.randn(p.shape, generator=g))
    Flux2Pipeline.save_lora_weights(str(path), transformer_lora_layers=get_peft_model_state_dict(model),
                                    **_collate_lora_metadata({"transformer": model}))
    return str(path / "pytorch_lora_weights.safetensors")


def _diffusers_applies(path: str, places, strength: float):
    """weights -> the weights as diffusers applies the LoRA: its own loader, with the metadata, then fuse_lora."""
    from diffusers import Flux2Pipeline

    def expected_for(bfl: dict) -> dict:
        model = _diffusers_model(bfl)
        state_dict, metadata = Flux2Pipeline.lora_state_dict(path, return_lora_metadata=True)
        model.load_lora_adapter(state_dict, prefix="transformer", metadata=metadata)
        model.fuse_lora(lora_scale=strength)
        model.unload_lora()
        return _in_bfl(model.state_dict(), bfl, places)
    return expected_for


@pytest.mark.parametrize("config", PEFT_CONFIGS, ids=str)
def test_a_peft_lora_lands_as_diffusers_applies_it(models, places, config, tmp_path):
    path = _peft_lora(models, PEFT_CONFIGS[config], tmp_path)
    _check(models, path, _diffusers_applies(path, places, 1.0))
    if config == "alpha-twice-rank":
        _check(models, path, _diffusers_applies(path, places, 0.5), strength=0.5)


# --- LyCORIS ----------------------------------------------------------------------------------------------------

# Which layers a LyCORIS network wraps: every linear one, or (butterfly OFT, whose rows must split in powers of two)
# the double blocks' attention.
PRESETS = {
    "linear": {"target_module": ["Linear"], "target_name": []},
    "square": {"target_module": [],
               "target_name": [r"transformer_blocks\.\d+\.attn\.(to_[qkv]|to_out\.0|add_[qkv]_proj)"]},
}
LYCORIS = {  # what LyCORIS writes for FLUX.2 with each algorithm ComfyUI has an adapter for
    "locon": {"algo": "lora"},
    "loha": {"algo": "loha"},
    "lokr": {"algo": "lokr", "factor": 4},
    "lokr-decomposed": {"algo": "lokr", "factor": 4, "decompose_both": True},
    "full": {"algo": "full"},
    "glora": {"algo": "glora"},
    "diag-oft": {"algo": "diag-oft"},
    "diag-oft-constrained-rescaled": {"algo": "diag-oft", "constraint": 1e-2, "rescaled": True},
    "boft": {"algo": "boft", "linear_dim": 2, "preset": "square"},
    "boft-constrained-rescaled": {"algo": "boft", "linear_dim": 2, "constraint": 1e-2, "rescaled": True,
                                  "preset": "square"},
    "dora-per-row": {"algo": "lora", "dora_wd": True},
    "dora-per-column": {"algo": "lora", "dora_wd": True, "wd_on_output": False},
    "loha-dora": {"algo": "loha", "dora_wd": True},
    "lokr-dora": {"algo": "lokr", "factor": 4, "dora_wd": True},
}


def _lycoris_network(bfl: dict, config: dict):
    """A LyCORIS network of `config` over a diffusers model of the tiny [dev] holding `bfl`, applied to it."""
    from lycoris import LycorisNetwork, create_lycoris

    model = _diffusers_model(bfl)
    config = dict(config)
    LycorisNetwork.apply_preset(PRESETS[config.pop("preset", "linear")])
    network = create_lycoris(model, 1.0, **{"linear_dim": RANK, "linear_alpha": 2, **config})
    network.apply_to()
    return model, network


def _lycoris_lora(models, config: dict, path) -> str:
    """A LyCORIS network of `config` over the tiny [dev], trained values drawn at random, saved by LyCORIS."""
    _, network = _lycoris_network(models["dense"][1], config)
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for p in network.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    network.save_weights(str(path / "lycoris.safetensors"), torch.float32, {})
    return str(path / "lycoris.safetensors")


def _lycoris_applies(path: str, config: dict, places):
    """weights -> the weights LyCORIS's own modules compute with: the file loaded into a network of `config` over a
    model of those weights, each module's forward of the identity, in eval mode."""

    def expected_for(bfl: dict) -> dict:
        model, network = _lycoris_network(bfl, config)
        assert network.load_weights(path) == {}  # every tensor of the file, and nothing else
        network.eval()
        names = {module: name for name, module in model.named_modules()}
        made = {}
        with torch.no_grad():
            for lora in network.loras:
                layer = lora.org_module[0]
                made[names[layer] + ".weight"] = lora(torch.eye(layer.in_features)).T.clone()
        return _in_bfl(made, bfl, places)
    return expected_for


@pytest.mark.parametrize("config", LYCORIS, ids=str)
def test_a_lycoris_lora_lands_as_lycoris_computes_it(models, places, config, tmp_path):
    path = _lycoris_lora(models, LYCORIS[config], tmp_path)
    _check(models, path, _lycoris_applies(path, LYCORIS[config], places))
