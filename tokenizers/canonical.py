"""The one tokenizer every rung builds: the HF tokenizer.json form of the Mistral-Small-3.1 tokenizer that the
FLUX.2 reference path (BFL, diffusers) loads, as transformers 4.57's convert_tekken_tokenizer made it:
byte-level BPE with merges derived from the ranks, a Llama-3 style split pattern, and every special token an
added special token (so special strings typed in a prompt become their ids)."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path

from ..errors import TokenizerNotFoundError
from .chat import CHAT_MARKERS
from .prompt import TEMPLATE_MARKERS
from .vocab import TekkenVocab, byte_level_string

# The reference pattern (Llama-3 style, \p{N}{1,3}); mistral-common's own Tekken pattern splits differently.
REFERENCE_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# What every accepted tokenizer must give: each marker of the FLUX.2 template and of the upsampler's chat as
# exactly its one id.
SELF_TEST = tuple({**TEMPLATE_MARKERS, **CHAT_MARKERS}.items())
SELF_TEST_TEXT = "a red fox"


def vocab_and_merges(vocab: TekkenVocab) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """A Tekken vocabulary as byte-level BPE: {token string: id} and the merges in rank order (what tokenizer.json
    and a llama.cpp GGUF hold)."""
    # Linear in the vocabulary's bytes: each token is split at each of its (bounded, vocab.py) byte positions
    # once, and each piece's byte-level string is made once per rank, not once per merge.
    rank_of = {token: r for r, token in enumerate(vocab.ranks)}
    strings = [byte_level_string(token) for token in vocab.ranks]
    n_special = len(vocab.specials)
    ids = {s: i for i, s in enumerate(vocab.specials)}
    merges = []
    for r, token in enumerate(vocab.ranks):
        # As the reference: a BPE string equal to a special string takes the later (BPE) id.
        ids[strings[r]] = n_special + r
        pairs = []
        for k in range(1, len(token)):
            left = rank_of.get(token[:k])
            if left is not None:
                right = rank_of.get(token[k:])
                if right is not None:
                    pairs.append((left, right))
        pairs.sort()  # by the pieces' ranks, as the reference orders a token's merges
        merges.extend((strings[left], strings[right]) for left, right in pairs)
    return ids, merges


def hf_tokenizers():
    """The Hugging Face `tokenizers` library, imported here and nowhere else in the pack. This package has the
    same name: where the pack's own folder is on sys.path (Python started inside it without -P), `import
    tokenizers` finds this package instead of the library, and the import fails half way. That is said
    plainly here rather than as an import error from deep inside."""
    this_package = Path(__file__).resolve().parent
    spec = importlib.util.find_spec("tokenizers")
    if spec is None or (spec.origin and Path(spec.origin).resolve().parent == this_package):
        sys.modules.pop("tokenizers", None)  # whatever half of this package the failed import left behind
        raise TokenizerNotFoundError(
            f"Python finds the pack's own folder {this_package.parent} before the Hugging Face tokenizers library (it "
            "is on sys.path, for example as the current folder), and the pack's tokenizers/ package hides the "
            "library. Start Python from another folder (or with -P), or install tokenizers (pip install tokenizers)."
        )
    return importlib.import_module("tokenizers")


def build_backend(vocab: TekkenVocab):
    lib = hf_tokenizers()
    AddedToken, Regex, decoders, pre_tokenizers, processors = (
        lib.AddedToken, lib.Regex, lib.decoders, lib.pre_tokenizers, lib.processors)
    ids, merges = vocab_and_merges(vocab)
    backend = lib.Tokenizer(lib.models.BPE(ids, merges, fuse_unk=False))
    backend.model.ignore_merges = True  # whole words found in the vocabulary are not re-merged (tiktoken rule)
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(REFERENCE_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    backend.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in vocab.specials])
    return backend


class Flux2Tokenizer:
    """The canonical tokenizer: `encode` gives the reference ids, without BOS, special strings split out."""

    def __init__(self, vocab: TekkenVocab):
        self.vocab = vocab  # what a converted encoder embeds as its tokenizer
        self.backend = build_backend(vocab)
        self.num_special_tokens = len(vocab.specials)
        self.vocab_size = len(vocab.specials) + len(vocab.ranks)
        self.vocab_digest = vocab.digest
        # How far before the end of a cut text its tokens may differ from the whole text's: a special string
        # cut in two, and the split pattern's look at the next character.
        self._cut_margin = max(map(len, vocab.specials), default=0) + 3
        self._text_backend = None  # the backend that reads special strings as plain text: made when first asked for

    def encode(self, text: str, limit: int | None = None, specials: bool = True) -> list[int]:
        """The reference ids of `text`, without BOS; with `limit`, only its first `limit` ids, for which only
        as much of a long text is tokenized as they need. specials off: special strings typed in the text are
        plain text (their pieces' ids), as mistral-common encodes a user's message."""
        backend = self.backend if specials else self.text_backend()
        if limit is None:
            return backend.encode(text, add_special_tokens=False).ids
        size = 16 * limit + 4 * self._cut_margin
        while size < len(text):
            ids = self._leading_ids(backend, text[:size], size - self._cut_margin)
            if len(ids) >= limit:
                return ids[:limit]
            size *= 4
        return backend.encode(text, add_special_tokens=False).ids[:limit]

    def text_backend(self):
        """A copy of the backend that tokenizes special strings as any other text."""
        if self._text_backend is None:
            backend = type(self.backend).from_str(self.backend.to_str())
            backend.encode_special_tokens = True
            self._text_backend = backend
        return self._text_backend

    def _leading_ids(self, backend, head: str, safe: int) -> list[int]:
        """The ids of the words of `head` that end by character `safe`: the same as the whole text's first ids.
        Words (the split pattern's pieces, and special tokens) are tokenized each on its own, and a word that
        ends before the cut margin was split and tokenized exactly as in the whole text."""
        enc = backend.encode(head, add_special_tokens=False)
        ends: dict = {}
        for i, (word, (_, end)) in enumerate(zip(enc.word_ids, enc.offsets)):
            ends[i if word is None else word] = end
        kept = []
        for i, (token, word) in enumerate(zip(enc.ids, enc.word_ids)):
            if ends[i if word is None else word] > safe:
                break
            kept.append(token)
        return kept

    def decode(self, ids: list[int]) -> str:
        return self.backend.decode(ids, skip_special_tokens=False)

    def token_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)


def self_test(tokenizer: Flux2Tokenizer) -> None:
    """Raise ValueError unless the template markers and plain text encode as FLUX.2 needs."""
    for text, want in SELF_TEST:
        got = tokenizer.encode(text)
        if got != [want]:
            raise ValueError(f"self-test: {text!r} encodes to {got}, expected [{want}]")
    plain = tokenizer.encode(SELF_TEST_TEXT)
    if not plain or min(plain) < tokenizer.num_special_tokens:
        raise ValueError(f"self-test: {SELF_TEST_TEXT!r} encodes to {plain}, expected ordinary BPE ids")
