"""Tekken vocabularies from every source, reduced to one form: the special-token strings (ids 0..n-1) and
the BPE token bytes in rank order (rank r has id n + r). Every rung of the ladder ends here, so every rung
builds the same tokenizer from the same vocabulary."""

from __future__ import annotations

import base64
import binascii
import hashlib
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..errors import CorruptFileError, WrongModelError
from ..loaders.formats.validate import Field, check_field, checked, parse_json, read_json_file

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

# What a Tekken vocabulary can be, with wide margins over the real one (1,000 specials, 130,072 ranks of at
# most 78 bytes, 878,258 bytes in all): the tokenizer build is linear in the total, and a damaged or
# hostile vocabulary beyond these is refused before anything is built from it.
MAX_SPECIALS = 1 << 13
MAX_SPECIAL_CHARS = 256
MAX_RANKS = 1 << 18
MAX_TOKEN_BYTES = 256
MAX_VOCAB_BYTES = 1 << 22
MAX_BASE64 = -(-MAX_TOKEN_BYTES // 3) * 4  # characters of a token's base64

TEKKEN_FIELDS = {
    "config": Field(dict),
    "vocab": Field(list, max_len=MAX_RANKS),
    "special_tokens": Field(list, max_len=MAX_SPECIALS, required=False),
}
TEKKEN_CONFIG_FIELDS = {
    "default_num_special_tokens": Field(int, lo=1, hi=MAX_SPECIALS),
    "default_vocab_size": Field(int, lo=1, hi=MAX_SPECIALS + MAX_RANKS),
    "version": Field(str, max_len=16, required=False),
    "pattern": Field(str, max_len=4096, required=False),
}
SPECIAL_TOKEN_FIELDS = {"rank": Field(int, lo=0, hi=MAX_SPECIALS - 1),
                        "token_str": Field(str, max_len=MAX_SPECIAL_CHARS)}
VOCAB_ENTRY_FIELDS = {"rank": Field(int, lo=0, hi=MAX_RANKS - 1), "token_bytes": Field(str, max_len=MAX_BASE64)}


@dataclass(frozen=True)
class TekkenVocab:
    specials: tuple[str, ...]
    ranks: tuple[bytes, ...]
    digest: str = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # Every source ends here, so every vocabulary is bounded here, before a tokenizer is built from it.
        problem = _bounds_problem(self.specials, self.ranks)
        if problem:
            raise CorruptFileError(f"The Tekken vocabulary is damaged or not one: {problem}.")
        h = hashlib.sha256()
        h.update("\x00".join(self.specials).encode())
        for token in self.ranks:
            h.update(len(token).to_bytes(2, "little"))
            h.update(token)
        object.__setattr__(self, "digest", h.hexdigest())


def _bounds_problem(specials: tuple, ranks: tuple) -> str | None:
    if not 0 < len(specials) <= MAX_SPECIALS:
        return f"{len(specials)} special tokens (1 to {MAX_SPECIALS} expected)"
    if not 0 < len(ranks) <= MAX_RANKS:
        return f"{len(ranks)} BPE tokens (1 to {MAX_RANKS} expected)"
    for i, s in enumerate(specials):
        if type(s) is not str or not 0 < len(s) <= MAX_SPECIAL_CHARS:
            return f"special token {i} is not a string of 1 to {MAX_SPECIAL_CHARS} characters"
    if len(set(specials)) != len(specials):
        return "a special token appears twice"
    total = 0
    for i, token in enumerate(ranks):
        if type(token) is not bytes or not 0 < len(token) <= MAX_TOKEN_BYTES:
            return f"BPE token {i} is not 1 to {MAX_TOKEN_BYTES} bytes"
        total += len(token)
    if total > MAX_VOCAB_BYTES:
        return f"its BPE tokens hold {total} bytes in all ({MAX_VOCAB_BYTES} at most)"
    if len(set(ranks)) != len(ranks):
        return "a BPE token appears twice"
    return None


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


def read_tekken_json(path: str | os.PathLike) -> TekkenVocab:
    """A tekken.json file, read only if it is a regular file of a vocabulary's size."""
    return tekken_vocab(read_json_file(path, "vocabulary"), str(path))


def parse_tekken_json(data: bytes | str, where: str = "tekken.json") -> TekkenVocab:
    """A tekken.json document (mistral-common's format), with or without its special_tokens list."""
    return tekken_vocab(parse_json(data, where, "vocabulary"), where)


def tekken_vocab(doc: Any, where: str) -> TekkenVocab:
    """The vocabulary of a parsed tekken.json document, every field it uses checked first."""
    checked(doc, TEKKEN_FIELDS, where)
    config = checked(doc["config"], TEKKEN_CONFIG_FIELDS, f"{where} config")
    n_special = config["default_num_special_tokens"]
    n_ranks = config["default_vocab_size"] - n_special
    if n_ranks < 1:
        raise CorruptFileError(
            f"{where}: config.default_vocab_size ({config['default_vocab_size']}) leaves no room for BPE tokens after "
            f"{n_special} special tokens. The file is damaged; download it again."
        )
    listed = doc.get("special_tokens")
    if listed is None:
        version = config.get("version", "")
        number = re.fullmatch(r"v(\d{1,4})", version)
        if number is None or int(number[1]) > LAST_VERSION_WITHOUT_SPECIALS:
            raise CorruptFileError(f"{where}: a tekken file of version {version!r} has no special_tokens list; "
                                   "download it again.")
        names = V3_SPECIAL_TOKENS
    else:
        for i, token in enumerate(listed):
            checked(token, SPECIAL_TOKEN_FIELDS, f"{where} special_tokens[{i}]")
        listed = sorted(listed, key=lambda t: t["rank"])
        if [t["rank"] for t in listed] != list(range(len(listed))):
            raise CorruptFileError(f"{where}: the special_tokens ranks are not 0, 1, 2, ...; download the file again.")
        names = tuple(t["token_str"] for t in listed)
    vocab = doc["vocab"]
    if len(vocab) < n_ranks:
        raise CorruptFileError(f"{where}: vocab has {len(vocab)} entries, config needs {n_ranks}; "
                               "download the file again.")
    ranks = []
    for i, entry in enumerate(vocab[:n_ranks]):
        if (
            type(entry) is not dict
            or entry.get("rank") != i
            or type(entry.get("token_bytes")) is not str
            or len(entry["token_bytes"]) > MAX_BASE64
        ):
            _refuse_entry(entry, i, where)
        try:
            ranks.append(base64.b64decode(entry["token_bytes"], validate=True))
        except binascii.Error:
            raise CorruptFileError(f"{where}: vocab[{i}].token_bytes is not base64; download the file again.") from None
    return TekkenVocab(_fill_specials(names, n_special, where), tuple(ranks))


WRITTEN_VERSION = "v7"  # the version of the tekken.json the pack writes: one that lists its special tokens


def tekken_json(vocab: TekkenVocab, pattern: str) -> bytes:
    """`vocab` as a tekken.json document listing its special tokens (what ComfyUI's single files embed as
    tekken_model, and what its own FLUX.2 tokenizer needs), with mistral-common's split `pattern`: compact, and
    the same bytes for the same vocabulary."""
    import json

    def text(token: bytes) -> str | None:
        try:
            return token.decode("utf-8")
        except UnicodeDecodeError:
            return None

    n_special = len(vocab.specials)
    doc = {
        "config": {"pattern": pattern, "num_vocab_tokens": len(vocab.ranks),
                   "default_vocab_size": n_special + len(vocab.ranks), "default_num_special_tokens": n_special,
                   "version": WRITTEN_VERSION},
        "vocab": [{"rank": r, "token_bytes": base64.b64encode(t).decode(), "token_str": text(t)}
                  for r, t in enumerate(vocab.ranks)],
        "special_tokens": [{"rank": i, "token_str": s, "is_control": True} for i, s in enumerate(vocab.specials)],
    }
    return json.dumps(doc, ensure_ascii=False, separators=(",", ":")).encode()


def _refuse_entry(entry: Any, i: int, where: str) -> None:
    """The pack's error for a vocab entry that the fast check refused, naming the field."""
    name = f"{where} vocab[{i}]"
    checked(entry, VOCAB_ENTRY_FIELDS, name)
    check_field(entry["rank"], Field(int, lo=i, hi=i), name, "rank")
    check_field(entry["token_bytes"], VOCAB_ENTRY_FIELDS["token_bytes"], name, "token_bytes")


def _fill_specials(names: Sequence[str], n_special: int, where: str) -> tuple[str, ...]:
    if len(names) > n_special or len(set(names)) != len(names):
        raise CorruptFileError(
            f"{where}: {len(names)} special tokens, duplicates or more than config.default_num_special_tokens "
            f"({n_special}); download the file again."
        )
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


def gguf_tokens(metadata: Mapping[str, Any], where: str = "the GGUF metadata") -> tuple[list[str], list[int]]:
    """The token strings and token types of a parsed GGUF header holding a Tekken vocabulary (llama.cpp's
    "gpt2" model), checked: a list of strings and as many integer types."""
    model = metadata.get("tokenizer.ggml.model")
    if model != "gpt2":
        raise WrongModelError(f"{where}: tokenizer.ggml.model is {model!r}; a Tekken vocabulary is stored as 'gpt2'.")
    tokens = metadata.get("tokenizer.ggml.tokens")
    types = metadata.get("tokenizer.ggml.token_type")
    types = types.tolist() if hasattr(types, "tolist") else types  # a numpy array from the GGUF reader
    check_field(tokens, Field(list, max_len=MAX_SPECIALS + MAX_RANKS), where, "tokenizer.ggml.tokens")
    check_field(types, Field(list, max_len=MAX_SPECIALS + MAX_RANKS), where, "tokenizer.ggml.token_type")
    if not all(type(t) is str for t in tokens) or not all(type(t) is int for t in types) or len(types) != len(tokens):
        raise CorruptFileError(
            f"{where}: tokenizer.ggml.tokens and tokenizer.ggml.token_type are not {len(tokens)} strings and as many "
            "integers; the file is damaged, download it again."
        )
    return tokens, types


def vocab_from_gguf(metadata: Mapping[str, Any]) -> TekkenVocab:
    """The tokenizer.ggml.* keys of a parsed GGUF header (llama.cpp's "gpt2" model with the tekken pre-tokenizer).
    The merges are not read: they follow from the ranks, exactly as the reference converter derives them."""
    tokens, types = gguf_tokens(metadata)
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
