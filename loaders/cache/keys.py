"""What a conditioning cache entry is keyed by: everything that changes a prompt's conditioning."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import ClassVar

from ...errors import Flux2DevError
from ..formats.validate import Field, check_field, parse_json

# Raise when the pack's encoding math changes (template, masking, layer choice ...): old entries then miss.
# tests/cache/test_encoding_version.py holds the digest of the code it guards, per version.
ENCODING_VERSION = 4


class CacheKey:
    """A cache entry's key: a dataclass of everything that decides the entry, stored as JSON beside it."""

    kind: ClassVar[str]

    def to_json(self) -> str:
        return json.dumps({"kind": self.kind, **asdict(self)}, sort_keys=True)


@dataclass(frozen=True)
class ConditioningKey(CacheKey):
    """Everything that shapes one prompt's conditioning."""

    weights: str  # content hash of the weights the encoder keeps (tensors_digest)
    layout: str
    formats: tuple[tuple[str, int], ...]  # weight format -> tensors in it
    settings: tuple[tuple[str, float], ...]  # the model settings the host runs with (rope theta, eps, heads ...)
    vocabulary: str  # digest of the tokenizer's vocabulary
    padding: str
    tokens: tuple[tuple[tuple[int, float], ...], ...]  # per sequence: (id, weight)
    dtype: str
    device: str  # device type (cpu, cuda ...): kernels differ between them
    layers: tuple[int, ...]  # the hidden states read
    host: str  # the host's version
    encoding_version: int = ENCODING_VERSION
    kind: ClassVar[str] = "conditioning"


# Raise when the pack's generation changes (chat layout, image handling, sampling, the decoder's math): old
# upsampled prompts then miss. tests/cache/test_encoding_version.py holds the digest of the code it guards.
GENERATION_VERSION = 2


@dataclass(frozen=True)
class UpsampleKey(CacheKey):
    """Everything that decides an upsampled prompt (a greedy or seeded run is deterministic on one machine)."""

    weights: str  # content hash of the whole language model's weights (and the vision tower's, for an edit)
    layout: str
    formats: tuple[tuple[str, int], ...]
    vocabulary: str
    system_message: str
    prompt: str
    input_ids: tuple[int, ...]  # the whole chat prompt, image tokens included
    image: str  # digest of the reference images as the model sees them ("" for text to image)
    seed: int
    temperature: float
    top_k: int
    max_new_tokens: int
    dtype: str
    device: str
    host: str
    generation_version: int = GENERATION_VERSION
    kind: ClassVar[str] = "upsampled prompt"


# What `flux2dev cache` reads back from a stored key to list it; anything else in it is only compared.
STORED_KEY_FIELDS = {
    "kind": Field(str, max_len=32),
    "weights": Field(str, max_len=64),
    "layout": Field(str, max_len=64),
    "padding": Field(str, max_len=32),
    "dtype": Field(str, max_len=32),
    "device": Field(str, max_len=32),
    "tokens": Field(list, max_len=1 << 12),
}


def stored_key(key_json: str, where: str) -> dict | None:
    """The listed fields of a stored key, each what STORED_KEY_FIELDS declares, and its token count; None
    when the text is not such a key."""
    try:
        doc = parse_json(key_json, where, "config")
        if not isinstance(doc, dict):
            return None
        out = {name: check_field(doc[name], f, where, name) for name, f in STORED_KEY_FIELDS.items() if name in doc}
    except Flux2DevError:
        return None
    sequences = out.get("tokens", [])
    out["tokens"] = sum(len(s) for s in sequences) if all(isinstance(s, list) for s in sequences) else None
    return out
