"""Tekken vocabularies from every source, reduced to one form: the special-token strings (ids 0..n-1) and
the BPE token bytes in rank order (rank r has id n + r). Every rung of the ladder ends here, so every rung
builds the same tokenizer from the same vocabulary."""

from __future__ import annotations

import base64
import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

# The names of the first 20 ids in tekken files of version <= v7 that carry no "special_tokens" list;
# mistral-common fills the rest of the special range with <SPECIAL_n>.
V3_SPECIAL_TOKENS = (
    "<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
    "[TOOL_RESULTS]", "[/TOOL_RESULTS]", "[TOOL_CALLS]", "[IMG]", "<pad>", "[IMG_BREAK]", "[IMG_END]",
    "[PREFIX]", "[MIDDLE]", "[SUFFIX]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[TOOL_CONTENT]",
)
FILLER_SPECIAL = "<SPECIAL_{}>"
# The newest tekken version allowed to omit the special_tokens list.
LAST_VERSION_WITHOUT_SPECIALS = 7
GGUF_CONTROL_TOKEN = 3


@dataclass(frozen=True)
class TekkenVocab:
    specials: tuple[str, ...]
    ranks: tuple[bytes, ...]
    digest: str = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        h = hashlib.sha256()
        h.update("\x00".join(self.specials).encode())
        for token in self.ranks:
            h.update(len(token).to_bytes(2, "little"))
            h.update(token)
        object.__setattr__(self, "digest", h.hexdigest())


def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table, used by byte-level BPE token strings."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


BYTE_TO_UNICODE = _byte_to_unicode()
UNICODE_TO_BYTE = {c: b for b, c in BYTE_TO_UNICODE.items()}


def byte_level_string(token: bytes) -> str:
    return "".join(BYTE_TO_UNICODE[b] for b in token)


def _byte_level_bytes(token: str, token_id: int) -> bytes:
    try:
        return bytes(UNICODE_TO_BYTE[c] for c in token)
    except KeyError:
        raise ValueError(
            f"token {token_id} ({token!r}) is not a byte-level BPE string: this is not a Tekken vocabulary"
        ) from None


def parse_tekken_json(data: bytes | str) -> TekkenVocab:
    """A tekken.json document (mistral-common's format), with or without its special_tokens list."""
    doc = json.loads(data)
    config = doc["config"]
    n_special = int(config["default_num_special_tokens"])
    n_ranks = int(config["default_vocab_size"]) - n_special
    listed = doc.get("special_tokens")
    if listed is None:
        version = str(config.get("version", ""))
        number = re.fullmatch(r"v(\d+)", version)
        if number is None or int(number[1]) > LAST_VERSION_WITHOUT_SPECIALS:
            raise ValueError(f"tekken file of version {version!r} has no special_tokens list")
        names = V3_SPECIAL_TOKENS
    else:
        listed = sorted(listed, key=lambda t: int(t["rank"]))
        if [int(t["rank"]) for t in listed] != list(range(len(listed))):
            raise ValueError("tekken special_tokens ranks are not 0, 1, 2, ...")
        names = tuple(str(t["token_str"]) for t in listed)
    vocab = doc["vocab"]
    if len(vocab) < n_ranks:
        raise ValueError(f"tekken vocab has {len(vocab)} entries, config needs {n_ranks}")
    ranks = []
    for i, entry in enumerate(vocab[:n_ranks]):
        if int(entry["rank"]) != i:
            raise ValueError(f"tekken vocab entry {i} has rank {entry['rank']}")
        ranks.append(base64.b64decode(entry["token_bytes"]))
    return TekkenVocab(_fill_specials(names, n_special), tuple(ranks))


def _fill_specials(names: Sequence[str], n_special: int) -> tuple[str, ...]:
    if len(names) > n_special or len(set(names)) != len(names):
        raise ValueError(f"{len(names)} special tokens (duplicates or more than {n_special})")
    return (*names, *(FILLER_SPECIAL.format(i) for i in range(len(names), n_special)))


def tekken_bytes(values: Any) -> bytes:
    """The tekken.json text held by an embedded tekken_model tensor: uint8 bytes, or one byte value per
    float element (gguf-org "cow" files store it as F16). Accepts bytes, numpy arrays and torch tensors."""
    import numpy as np

    if isinstance(values, (bytes, bytearray, memoryview)):
        return bytes(values)
    if hasattr(values, "detach"):  # torch: numpy cannot hold bf16, and floats are converted below anyway
        values = values.detach().cpu()
        values = values.numpy() if str(values.dtype) == "torch.uint8" else values.float().numpy()
    array = np.asarray(values).reshape(-1)
    if array.dtype == np.uint8:
        return array.tobytes()
    if array.dtype.kind != "f":
        raise ValueError(f"tekken_model tensor has dtype {array.dtype}; expected uint8 or one byte per float")
    as_bytes = array.astype(np.uint8)
    if not np.array_equal(as_bytes.astype(array.dtype), array):
        raise ValueError("tekken_model float tensor holds values that are not bytes (0..255 integers)")
    return as_bytes.tobytes()


def vocab_from_byte_level(tokens: Sequence[str], n_special: int) -> TekkenVocab:
    """A vocabulary given as token strings by id: specials first, then GPT-2 byte-level BPE strings."""
    ranks = tuple(_byte_level_bytes(t, n_special + i) for i, t in enumerate(tokens[n_special:]))
    return TekkenVocab(tuple(tokens[:n_special]), ranks)


def vocab_from_gguf(metadata: Mapping[str, Any]) -> TekkenVocab:
    """The tokenizer.ggml.* keys of a parsed GGUF header (llama.cpp's "gpt2" model with the tekken pre-tokenizer).
    The merges are not read: they follow from the ranks, exactly as the reference converter derives them."""
    model = metadata.get("tokenizer.ggml.model")
    if model != "gpt2":
        raise ValueError(f"tokenizer.ggml.model is {model!r}; a Tekken vocabulary is stored as 'gpt2'")
    tokens = [t.decode("utf-8") if isinstance(t, bytes) else str(t) for t in metadata["tokenizer.ggml.tokens"]]
    types = [int(t) for t in metadata["tokenizer.ggml.token_type"]]
    if len(types) != len(tokens):
        raise ValueError(f"{len(tokens)} tokens but {len(types)} token types")
    n_special = next((i for i, t in enumerate(types) if t != GGUF_CONTROL_TOKEN), len(types))
    return vocab_from_byte_level(tokens, n_special)


def vocab_from_tokenizers_backend(backend: Any) -> TekkenVocab:
    """A `tokenizers.Tokenizer` holding a byte-level BPE Tekken vocabulary (an HF tokenizer.json); only its
    vocabulary is kept, so a file converted with another pre-tokenizer pattern still gives reference ids."""
    vocab = backend.get_vocab(with_added_tokens=True)
    by_id = {i: t for t, i in vocab.items()}
    if sorted(by_id) != list(range(len(by_id))):
        raise ValueError("the tokenizer's ids are not contiguous from 0")
    added = backend.get_added_tokens_decoder()
    n_special = next((i for i in range(len(by_id)) if i not in added or not added[i].special), len(by_id))
    return vocab_from_byte_level([by_id[i] for i in range(len(by_id))], n_special)


def vocab_from_tekkenizer(tekkenizer: Any) -> TekkenVocab:
    """mistral-common's Tekkenizer: its rank table and special tokens; its own encoder is never used, since it
    neither splits special strings nor uses the reference pre-tokenizer pattern."""
    ranks_by_bytes = tekkenizer._tekken_token2id_nospecial
    ranks = sorted(ranks_by_bytes, key=ranks_by_bytes.__getitem__)
    if sorted(ranks_by_bytes.values()) != list(range(len(ranks))):
        raise ValueError("the Tekkenizer's ranks are not contiguous from 0")
    specials = [getattr(t["token_str"], "value", t["token_str"]) for t in tekkenizer._all_special_tokens]
    return TekkenVocab(tuple(str(s) for s in specials), tuple(ranks))


def vocab_from_transformers(obj: Any) -> TekkenVocab:
    """What AutoProcessor or AutoTokenizer returned: a tokenizers-backed tokenizer, a mistral-common-backed one
    (MistralCommonBackend / MistralCommonTokenizer), or a processor holding either as .tokenizer."""
    backend = getattr(obj, "backend_tokenizer", None)
    if backend is not None:
        return vocab_from_tokenizers_backend(backend)
    inner = getattr(obj, "tokenizer", None)
    if inner is not None and hasattr(inner, "instruct_tokenizer"):
        return vocab_from_tekkenizer(inner.instruct_tokenizer.tokenizer)
    if inner is not None and inner is not obj:
        return vocab_from_transformers(inner)
    raise TypeError(f"{type(obj).__name__} holds neither a tokenizers backend nor a mistral-common tokenizer")
