"""The FLUX.2 [dev] text encoder as the host's own CLIP object.

The weights come from loaders.encoder in the host's MistralForCausalLM names; the model is the host's
pruned FLUX.2 encoder (comfy.text_encoders.flux.flux2_te) with three pack parts plugged in:
- Flux2DevTokenizer renders the FLUX.2 template with the pack's tokenizer and padding mode;
- the pack's subclass of the host's Mistral3_24BModel masks left padding the way transformers does. The
  host derives its mask from pad id 0 ("everything from the first pad on"), which cannot describe
  leading <pad>=11 tokens, so "reference" padding would otherwise attend to the pads;
- the pack's packed ops and patcher (host/ops.py) keep fp8 / NVFP4 / GGUF weights packed, dequantize them
  per layer at run time and apply LoRAs to the dequantized weights.
"""

from __future__ import annotations

import functools

import torch

from ..errors import HostError
from ..loaders.encoder import LoadedEncoder, load_encoder
from . import ensure_comfy

CLIP_NAME = "mistral3_24b"  # the host's name of the FLUX.2 text encoder slot
TOKENIZER_KEY = "flux2dev_tokenizer"
PADDING_KEY = "flux2dev_padding"


class Flux2DevTokenizer:
    """The host tokenizer interface over the pack's tokenizer (given through tokenizer_data)."""

    def __init__(self, embedding_directory=None, tokenizer_data={}):
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


def left_padding_mask(tokens, pad_id: int) -> list[int]:
    """1 for real tokens, 0 for the run of pad ids a sequence starts with (left padding)."""
    ids = [int(t) for t in tokens]
    pads = next((i for i, t in enumerate(ids) if t != pad_id), len(ids))
    return [0] * pads + [1] * (len(ids) - pads)


@functools.cache
def _model_class():
    ensure_comfy()
    import comfy.text_encoders.flux

    from ..tokenizers import PAD_ID

    class Flux2DevMistral3(comfy.text_encoders.flux.Mistral3_24BModel):
        def process_tokens(self, tokens, device):
            embeds, _, _, embeds_info = super().process_tokens(tokens, device)
            masks = [left_padding_mask(t, PAD_ID) for t in tokens]
            mask = torch.tensor(masks, device=device, dtype=torch.long)
            return embeds, mask, [sum(m) for m in masks], embeds_info

        def forward(self, tokens):
            # Left pads are masked as transformers masks them: a pad sees no key, so its attention output is
            # 0 (torch's SDPA), and real tokens never see pads. The host's CPU attention turns such fully
            # masked rows into NaN, so the two parts run apart: real tokens at their true positions, pads
            # through the residual + MLP path alone.
            device = self.transformer.get_input_embeddings().weight.device
            embeds, mask, num_tokens, embeds_info = self.process_tokens(tokens, device)
            pads = [int(len(m) - n) for m, n in zip(mask.tolist(), num_tokens)]
            if not isinstance(self.layer, list) or not any(pads) or embeds_info:
                return super().forward(tokens)
            outs = []
            for b, p in enumerate(pads):
                length = embeds.shape[1]
                real = self.transformer(
                    None, None, embeds=embeds[b:b + 1, p:], num_tokens=[length - p], intermediate_output=self.layer,
                    final_layer_norm_intermediate=self.layer_norm_hidden_state, dtype=torch.float32,
                    position_ids=torch.arange(p, length, device=device).unsqueeze(0),
                )[1]
                outs.append(torch.cat((self._pad_states(embeds[b:b + 1, :p]), real.float()), dim=2))
            extra = {"attention_mask": mask} if self.return_attention_masks else {}
            return torch.cat(outs), None, extra

        def _pad_states(self, x):
            layers = self.transformer.model.layers
            states = []
            for i, layer in enumerate(layers):
                if i in self.layer:
                    states.append(x)
                x = x + layer.mlp(layer.post_attention_layernorm(x))
            if len(layers) in self.layer:
                states.append(x)
            return torch.stack(states, dim=1).float()

    return Flux2DevMistral3


def model_config(encoder: LoadedEncoder) -> dict:
    """The host Mistral config entries that follow from the checkpoint (head_dim is 128 in the host)."""
    g = encoder.geometry
    return {
        "vocab_size": g.vocab,
        "hidden_size": g.width,
        "intermediate_size": g.mlp,
        "num_attention_heads": g.heads,
        "num_key_value_heads": g.kv_heads,
        "rms_norm_eps": g.rms_norm_eps,
        "rope_theta": float(encoder.rope_theta),
    }


def _compute_dtype(encoder: LoadedEncoder) -> torch.dtype:
    stored = encoder.state_dict["model.layers.0.input_layernorm.weight"].dtype
    return stored if stored in (torch.bfloat16, torch.float16, torch.float32) else torch.bfloat16


def clip_from_encoder(encoder: LoadedEncoder, *, padding: str = "reference", dtype: torch.dtype | None = None,
                      embedding_directory=None, disable_dynamic: bool = False):
    """A host CLIP holding `encoder`. dtype: the weights' dtype in the host (default: as stored). The host
    picks the CLIP's patcher class as for its own encoders (disable_dynamic: the plain one)."""
    from ..tokenizers import PADDING_MODES

    if padding not in PADDING_MODES:
        raise ValueError(f"padding must be one of {PADDING_MODES}, got {padding!r}")
    model_class = _model_class()
    import comfy.sd
    import comfy.text_encoders.flux

    from . import compat
    from .ops import packed_operations, packed_patcher

    dtype = dtype or _compute_dtype(encoder)

    class Target:
        params = {}
        clip = compat.call_with_known(comfy.text_encoders.flux.flux2_te, dtype_llama=dtype, pruned=True)
        tokenizer = Flux2DevTokenizer

    model_options = {
        "dtype": dtype,
        "custom_operations": packed_operations(),
        f"{CLIP_NAME}_class": model_class,
        f"{CLIP_NAME}_model_config": model_config(encoder),
    }
    tokenizer_data = {TOKENIZER_KEY: encoder.tokenizer.tokenizer, PADDING_KEY: padding}
    parameters = sum(t.numel() for t in encoder.state_dict.values())
    # The weights are loaded here rather than in the constructor (which only logs missing keys), so that a
    # missing one stops the load.
    clip = compat.call_with_known(
        comfy.sd.CLIP,
        target=Target,
        embedding_directory=embedding_directory,
        tokenizer_data=tokenizer_data,
        parameters=parameters,
        model_options=model_options,
        disable_dynamic=disable_dynamic,
    )
    missing, _ = clip.load_sd(encoder.state_dict)
    if missing:  # the pruned host model has exactly the 30 layers + embeddings the loader reads
        raise HostError(
            f"This ComfyUI's FLUX.2 text encoder has weights the pack does not provide ({', '.join(missing[:5])}); "
            "its encoder differs from the one the pack was built for. Report it with your ComfyUI version."
        )
    packed_patcher(clip.patcher)
    clip.flux2dev_encoder = {"layout": encoder.layout, "formats": encoder.formats, "tokenizer": encoder.tokenizer.rung}
    return clip


def load_clip(path: str, *, padding: str = "reference", allow_network: bool = False, dtype: torch.dtype | None = None,
              embedding_directory=None, disable_dynamic: bool = False):
    """Load a FLUX.2 [dev] text encoder from any supported layout as a host CLIP, which the host's device
    nodes can load again from the same path and options."""
    from . import compat

    with compat.load_progress():
        encoder = load_encoder(path, allow_network=allow_network)
    clip = clip_from_encoder(encoder, padding=padding, dtype=dtype, embedding_directory=embedding_directory,
                             disable_dynamic=disable_dynamic)
    options = {"padding": padding, "allow_network": allow_network, "dtype": dtype, "embedding_directory": embedding_directory}
    compat.set_reload(clip.patcher, load_clip_patcher, (path, options))
    return clip


def load_clip_patcher(path: str, options: dict, disable_dynamic: bool = False):
    """The reload factory the device nodes call: a fresh load's patcher."""
    return load_clip(path, **options, disable_dynamic=disable_dynamic).patcher
