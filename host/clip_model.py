"""The host's FLUX.2 [dev] text encoder model with the pack's masking: the host's pruned Mistral encoder
(comfy.text_encoders.flux), running the layers its [dev] variant reads (loaders/models/variants.py). The host
derives its mask from pad id 0 ("everything from the first pad on"), which cannot describe leading <pad>=11
tokens, so "reference" padding would otherwise attend to the pads; the subclass here masks them the way
transformers does."""

from __future__ import annotations

import contextlib
import functools

import torch

from ..errors import HostError
from ..loaders.models.encoder import EncoderPlan
from . import ensure_comfy

# model_options keys: the hidden states the variant reads, and how many layers the model has to run for them.
LAYERS_KEY = "flux2dev_encoder_layers"
LAYERS_KEPT_KEY = "flux2dev_layers_kept"
# The stored dtype of the norm weights -> the dtype the host runs the encoder in (packed files: bf16).
COMPUTE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
NORM = "model.layers.0.input_layernorm.weight"


@functools.cache
def encoder_model_class():
    ensure_comfy()
    import comfy.text_encoders.flux

    from ..tokenizers import left_padding_mask

    class Flux2DevMistral3(comfy.text_encoders.flux.Mistral3_24BModel):
        def __init__(self, device="cpu", layer_idx=None, dtype=None, attention_mask=True,
                     model_options={}):  # noqa: B006  (the host's signature; only read)
            # The host's pruned encoder is real [dev]'s (30 layers, hidden states 10, 20, 30); the variant table
            # says what this encoder runs and reads.
            model_options = {**model_options, "num_layers": model_options[LAYERS_KEPT_KEY]}
            super().__init__(device=device, layer=list(model_options[LAYERS_KEY]), layer_idx=layer_idx, dtype=dtype,
                             attention_mask=attention_mask, model_options=model_options)

        def process_tokens(self, tokens, device):
            embeds, _, _, embeds_info = super().process_tokens(tokens, device)
            masks = [left_padding_mask(t) for t in tokens]
            mask = torch.tensor(masks, device=device, dtype=torch.long)
            return embeds, mask, [sum(m) for m in masks], embeds_info

        def forward(self, tokens):
            # Left pads are masked as transformers masks them: a pad sees no key, so its attention output is
            # 0 (torch's SDPA), and real tokens never see pads. The host's CPU attention turns such fully
            # masked rows into NaN, so the two parts run apart: real tokens at their true positions, pads
            # through the residual + MLP path alone, in the same pass (each layer's weights read once).
            device = self.transformer.get_input_embeddings().weight.device
            embeds, mask, num_tokens, embeds_info = self.process_tokens(tokens, device)
            pads = [int(len(m) - n) for m, n in zip(mask.tolist(), num_tokens)]
            if not isinstance(self.layer, list) or not any(pads) or embeds_info:
                return super().forward(tokens)
            outs = []
            for b, p in enumerate(pads):
                length = embeds.shape[1]
                with self._pads_alongside(embeds[b:b + 1, :p]) as pad_states:
                    real = self.transformer(
                        None, None, embeds=embeds[b:b + 1, p:], num_tokens=[length - p],
                        intermediate_output=self.layer, final_layer_norm_intermediate=self.layer_norm_hidden_state,
                        dtype=torch.float32, position_ids=torch.arange(p, length, device=device).unsqueeze(0),
                    )[1]
                outs.append(torch.cat((pad_states(), real.float()), dim=2))
            extra = {"attention_mask": mask} if self.return_attention_masks else {}
            return torch.cat(outs), None, extra

        @contextlib.contextmanager
        def _pads_alongside(self, x):
            # Pads take no part in attention, so a pad's states depend on its embedding alone: each layer's MLP
            # takes their rows beside the real tokens' (where every pad is the same, the <pad> token unweighted,
            # one row for all of them). Yields a function that returns their states once the pass has run.
            same = x.shape[1] > 1 and torch.equal(x, x[:, :1].expand_as(x))
            layers = self.transformer.model.layers
            pad, states, ran = [x[:, :1] if same else x], [], []

            def alongside(i, mlp, args):
                if i in self.layer:
                    states.append(pad[0])
                (h,) = args
                return (torch.cat((h, layers[i].post_attention_layernorm(pad[0]).to(h.dtype)), dim=1),)

            def apart(i, mlp, args, out):
                real = out.shape[1] - pad[0].shape[1]
                pad[0] = pad[0] + out[:, real:].to(pad[0].dtype)
                ran.append(i)
                return out[:, :real]

            def pad_states():
                if ran != list(range(len(layers))):
                    raise HostError("ComfyUI's Mistral layers did not run their MLP once each, in order, as the "
                                    "pack's reference padding expects; update the pack or use comfy padding.")
                if len(layers) in self.layer:
                    states.append(pad[0])
                out = torch.stack(states, dim=1).float()
                return out.expand(-1, -1, x.shape[1], -1) if same else out

            hooks = [hook for i, layer in enumerate(layers)
                     for hook in (layer.mlp.register_forward_pre_hook(functools.partial(alongside, i)),
                                  layer.mlp.register_forward_hook(functools.partial(apart, i)))]
            try:
                yield pad_states
            finally:
                for hook in hooks:
                    hook.remove()

    return Flux2DevMistral3


def model_config(encoder) -> dict:
    """The host Mistral config entries that follow from the checkpoint (head_dim is 128 in the host); `encoder`
    is its plan or the loaded encoder."""
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


def compute_dtype(plan: EncoderPlan) -> torch.dtype:
    return COMPUTE_DTYPES.get(plan.source.entries[plan.mapping[NORM]][0], torch.bfloat16)
