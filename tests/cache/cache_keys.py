"""Conditioning keys for the cache tests that use the cache module alone: one field (the vocabulary digest)
carries the test's label, the rest is a plausible key."""

from comfyui_flux2dev.loaders.cache.keys import ConditioningKey


def key_of(label: str, **fields) -> ConditioningKey:
    base = dict(weights="0" * 64, layout="comfy-single-file", formats=(("bf16", 3),), settings=(("hidden_size", 64),),
                vocabulary=label, padding="reference", tokens=(((1, 1.0), (17, 1.0)),), dtype="torch.float32",
                device="cpu", layers=(10, 20, 30), host="0.3.75")
    return ConditioningKey(**{**base, **fields})
