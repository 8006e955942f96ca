"""The tiny models' folders that more than one test module of models/ reads."""

import pytest


@pytest.fixture(scope="module")
def tiny_transformers(tiny_part):
    """(the tiny transformers' folder, diffusion_models/, and their manifest entries)"""
    return tiny_part("diffusion_models")


@pytest.fixture(scope="module")
def tiny_pipelines(tiny_part):
    """(the tiny diffusers pipelines' folder and their manifest entries)"""
    return tiny_part("diffusers")
