"""The fixtures the LoRA tests share (lora_models.py)."""

import pytest

from lora_models import TRANSFORMER, bfl_weights, diffusers_places, lora_models


@pytest.fixture(scope="module")
def places(tiny_root):
    """Each diffusers weight of the tiny [dev] -> (BFL key, the flat positions of its values there)."""
    return diffusers_places(bfl_weights(tiny_root / TRANSFORMER))


@pytest.fixture(scope="module")
def models(tiny_root, tiny_part, comfy_host):
    """name -> (a tiny FLUX.2 [dev] MODEL, the float32 BFL weights it computes with)."""
    return lora_models(tiny_root, tiny_part)
