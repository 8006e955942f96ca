"""The host's tokenizer interface over the pack's tokenizer: the FLUX.2 template and padding mode, in the pieces
the running host's prompt syntax makes for comfy padding."""

from __future__ import annotations

CLIP_NAME = "mistral3_24b"  # the host's name of the FLUX.2 text encoder slot
TOKENIZER_KEY = "flux2dev_tokenizer"
PADDING_KEY = "flux2dev_padding"


class Flux2DevTokenizer:
    """The host tokenizer interface over the pack's tokenizer (given through tokenizer_data)."""

    def __init__(self, embedding_directory=None, tokenizer_data={}):  # noqa: B006  (the host's signature; only read)
        self.tokenizer = tokenizer_data[TOKENIZER_KEY]
        self.padding = tokenizer_data[PADDING_KEY]

    def tokenize_with_weights(self, text: str, return_word_ids: bool = False, **kwargs):
        from ..tokenizers import prompt_ids
        from ..tokenizers.prompt import comfy_pieces
        from . import compat

        # comfy: the pieces the running host's own prompt syntax makes (current releases' where it cannot say);
        # the host's tokenizer is asked only then, not for reference padding.
        host_pieces = compat.prompt_pieces() if self.padding == "comfy" else None
        ids, _ = prompt_ids(self.tokenizer, text, self.padding, host_pieces or comfy_pieces)
        pairs = [(i, 1.0, 0) if return_word_ids else (i, 1.0) for i in ids]
        return {CLIP_NAME: [pairs]}

    def untokenize(self, token_weight_pair):
        return [(pair, self.tokenizer.decode([pair[0]])) for pair in token_weight_pair]

    def state_dict(self):
        return {}
