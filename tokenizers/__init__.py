"""The FLUX.2 [dev] tokenizer: one canonical tokenizer (the reference HF tokenizer.json form of the
Mistral-Small-3.1 Tekken vocabulary) found by a ladder of offline sources, and the prompt template."""

from .canonical import Flux2Tokenizer, self_test
from .ladder import RUNGS, TokenizerResolution, bundled_tekken_path, resolve_tokenizer
from .prompt import MAX_LENGTH, PAD_ID, PADDING_MODES, SYSTEM_PROMPT, left_padding_mask, prompt_ids
from .vocab import TekkenVocab, parse_tekken_json, tekken_bytes, vocab_from_gguf

__all__ = [
    "Flux2Tokenizer",
    "MAX_LENGTH",
    "PADDING_MODES",
    "PAD_ID",
    "RUNGS",
    "SYSTEM_PROMPT",
    "TekkenVocab",
    "TokenizerResolution",
    "bundled_tekken_path",
    "left_padding_mask",
    "parse_tekken_json",
    "prompt_ids",
    "resolve_tokenizer",
    "self_test",
    "tekken_bytes",
    "vocab_from_gguf",
]
