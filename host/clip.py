"""The FLUX.2 [dev] text encoder as the host's own CLIP object.

The weights come from loaders.encoder in the host's MistralForCausalLM names; the model is the host's
pruned FLUX.2 encoder (comfy.text_encoders.flux.flux2_te), running the layers its [dev] variant reads
(loaders/variants.py), with three pack parts plugged in:
- Flux2DevTokenizer renders the FLUX.2 template with the pack's tokenizer and padding mode;
- the pack's subclass of the host's Mistral3_24BModel masks left padding the way transformers does. The
  host derives its mask from pad id 0 ("everything from the first pad on"), which cannot describe
  leading <pad>=11 tokens, so "reference" padding would otherwise attend to the pads;
- the pack's packed ops and patcher (host/ops.py) keep fp8 / NVFP4 / GGUF weights packed, dequantize them
  per layer at run time and apply LoRAs to the dequantized weights.

The CLIP is lazy: it is built from the checkpoint's headers and tokenizer alone, and reads the weights on the
first prompt the conditioning cache (loaders/conditioning_cache.py) does not hold. With keep_loaded off it
frees them again after each encode. A CLIP with patches (LoRAs), hooks or a clip layer set bypasses the cache.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import math
import os
from dataclasses import dataclass, field

import torch

from ..errors import CacheError, HostError
from ..loaders.cache.keys import ConditioningKey
from ..loaders.cache.store import CACHE_DIR_ENV, ConditioningCache, stat_signature, weights_fingerprint
from ..loaders.models.encoder import EncoderPlan, plan_encoder, read_weights, resolve_plan_tokenizer
from . import ensure_comfy

CLIP_NAME = "mistral3_24b"  # the host's name of the FLUX.2 text encoder slot
TOKENIZER_KEY = "flux2dev_tokenizer"
PADDING_KEY = "flux2dev_padding"
# model_options keys: the hidden states the variant reads, and how many layers the model has to run for them.
LAYERS_KEY = "flux2dev_encoder_layers"
LAYERS_KEPT_KEY = "flux2dev_layers_kept"


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
        def __init__(self, device="cpu", layer_idx=None, dtype=None, attention_mask=True, model_options={}):
            # The host's pruned encoder is real [dev]'s (30 layers, hidden states 10, 20, 30); the variant table
            # says what this encoder runs and reads.
            model_options = {**model_options, "num_layers": model_options[LAYERS_KEPT_KEY]}
            super().__init__(device=device, layer=list(model_options[LAYERS_KEY]), layer_idx=layer_idx, dtype=dtype,
                             attention_mask=attention_mask, model_options=model_options)

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


# The stored dtype of the norm weights -> the dtype the host runs the encoder in (packed files: bf16).
COMPUTE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
NORM = "model.layers.0.input_layernorm.weight"
CACHE_FOLDER = "flux2dev-conditioning-cache"  # inside the host's user directory


def _compute_dtype(plan: EncoderPlan) -> torch.dtype:
    return COMPUTE_DTYPES.get(plan.source.entries[plan.mapping[NORM]][0], torch.bfloat16)


def cache_folder(choice: str = "") -> str:
    """The conditioning cache folder a node input names: empty for FLUX2DEV_CACHE_DIR, else a folder in the
    host's user directory; a relative folder lies in the user directory (a name that climbs out of it is
    refused), an absolute one anywhere."""
    choice = os.path.expanduser(choice.strip() or os.environ.get(CACHE_DIR_ENV, "") or CACHE_FOLDER)
    if os.path.isabs(choice):
        return choice
    ensure_comfy()
    import folder_paths

    user = os.path.abspath(folder_paths.get_user_directory())
    folder = os.path.normpath(os.path.join(user, choice))
    if os.path.commonpath([user, folder]) != user:
        raise CacheError(
            f"The cache folder {choice!r} leads out of ComfyUI's user folder ({user}); a relative cache folder lies "
            "inside it. Give a plain name, or an absolute path for a folder elsewhere."
        )
    return folder


@dataclass(eq=False)
class EncoderSource:
    """What a lazy CLIP reads its weights from and caches under; shared by the CLIP's clones, as its model is."""

    plan: EncoderPlan
    tokenizer: object  # tokenizers.TokenizerResolution
    padding: str
    dtype: torch.dtype
    keep_loaded: bool
    allow_network: bool
    cache: ConditioningCache | None
    placeholders: list = field(default_factory=list)  # (layer, parameter name, shape, dtype) while unloaded
    loaded: bool = False
    fingerprint: str | None = None  # of the weights loaded now, or of the files on disk


@functools.cache
def _clip_class():
    ensure_comfy()
    import comfy.sd

    class Flux2DevCLIP(comfy.sd.CLIP):
        """The host's CLIP, reading its weights on demand and serving cached conditioning."""

        flux2dev_source: EncoderSource

        def clone(self, *args, **kwargs):
            n = super().clone(*args, **kwargs)  # the host builds a plain CLIP
            n.__class__ = type(self)
            n.flux2dev_source, n.flux2dev_encoder = self.flux2dev_source, self.flux2dev_encoder
            return n

        def load_model(self, *args, **kwargs):
            load_weights(self)  # every host path that runs the model comes through here
            return super().load_model(*args, **kwargs)

        def encode_from_tokens(self, tokens, return_pooled=False, return_dict=False):
            src = self.flux2dev_source
            bypass = _cache_bypass(self, tokens) if src.cache is not None else None
            if bypass:
                logging.info("FLUX.2 [dev] conditioning cache bypassed: %s; this prompt is encoded fresh and not stored.", bypass)
            key = _key(self, tokens) if src.cache is not None and not bypass else None
            out = src.cache.get(key) if key is not None else None
            if out is not None:
                out = {"pooled_output": None, **out}
                self.add_hooks_to_dict(out)
            else:
                out = super().encode_from_tokens(tokens, return_pooled=return_pooled, return_dict=True)
                tensors = {k: v for k, v in out.items() if isinstance(v, torch.Tensor)}
                if key is not None and all(v is None or k in tensors or k == "hooks" for k, v in out.items()):
                    src.cache.put(key, tensors)
            if not src.keep_loaded:
                release_weights(self)
            if return_dict:
                return out
            return (out["cond"], out["pooled_output"]) if return_pooled else out["cond"]

    return Flux2DevCLIP


def _cache_bypass(clip, tokens) -> str | None:
    """Why this CLIP's conditioning cannot be cached, or None."""
    patcher = clip.patcher
    if patcher.patches:
        return "this CLIP has a LoRA or other weight patch applied"
    if getattr(patcher, "forced_hooks", None) is not None or getattr(patcher, "hook_patches", None):
        return "this CLIP has hooks"
    if clip.layer_idx is not None:
        return "a CLIP layer is set on this CLIP"
    if set(tokens) != {CLIP_NAME} or not all(isinstance(p[0], int) for seq in tokens[CLIP_NAME] for p in seq):
        return "the prompt holds embeddings, not only token ids"
    return None


def _key(clip, tokens) -> ConditioningKey:
    """Everything that shapes this conditioning; computing it may read the weights once, to fingerprint them."""
    from ..loaders.models.variants import dev_variant_for_encoder
    from . import compat

    src = clip.flux2dev_source
    if src.fingerprint is None:
        src.fingerprint = src.cache.known_fingerprint(_signature(src.plan))
    if src.fingerprint is None:
        load_weights(clip)  # fingerprints what it reads
    return ConditioningKey(
        weights=src.fingerprint,
        layout=src.plan.layout,
        formats=tuple(sorted(src.plan.formats.items())),
        settings=tuple(sorted(model_config(src.plan).items())),
        vocabulary=src.tokenizer.tokenizer.vocab_digest,
        padding=src.padding,
        tokens=tuple(tuple((p[0], float(p[1])) for p in seq) for seq in tokens[CLIP_NAME]),
        dtype=str(src.dtype),
        device=clip.patcher.load_device.type,
        layers=tuple(dev_variant_for_encoder(src.plan.geometry).encoder_layers),
        host=compat.host_version(),
    )


def _signature(plan: EncoderPlan) -> str:
    return stat_signature(plan.path, plan.source.files)


def _build_clip(plan: EncoderPlan, tokenizer, *, padding: str, dtype: torch.dtype | None, keep_loaded: bool,
                allow_network: bool, cache: ConditioningCache | None, embedding_directory, disable_dynamic: bool):
    """The host CLIP of a planned encoder, its weights not read yet. dtype: the weights' dtype in the host
    (default: as stored). The host picks the CLIP's patcher class as for its own encoders (disable_dynamic:
    the plain one)."""
    from ..loaders.models.variants import dev_variant_for_encoder, layers_kept
    from ..tokenizers import PADDING_MODES

    if padding not in PADDING_MODES:
        raise ValueError(f"padding must be one of {PADDING_MODES}, got {padding!r}")
    model_class = _model_class()
    import comfy.text_encoders.flux

    from . import compat
    from .ops import PackedLayer, packed_operations, packed_patcher

    dtype = dtype or _compute_dtype(plan)

    class Target:
        params = {}
        clip = compat.call_with_known(comfy.text_encoders.flux.flux2_te, dtype_llama=dtype, pruned=True)
        tokenizer = Flux2DevTokenizer

    model_options = {
        "dtype": dtype,
        "custom_operations": packed_operations(),
        f"{CLIP_NAME}_class": model_class,
        f"{CLIP_NAME}_model_config": model_config(plan),
        LAYERS_KEY: dev_variant_for_encoder(plan.geometry).encoder_layers,
        LAYERS_KEPT_KEY: layers_kept(plan.geometry),
    }
    tokenizer_data = {TOKENIZER_KEY: tokenizer.tokenizer, PADDING_KEY: padding}
    clip = compat.call_with_known(
        _clip_class(),
        target=Target,
        embedding_directory=embedding_directory,
        tokenizer_data=tokenizer_data,
        parameters=sum(math.prod(plan.source.entries[s][1]) for s in plan.mapping.values()),
        model_options=model_options,
        disable_dynamic=disable_dynamic,
    )
    packed_patcher(clip.patcher)
    placeholders = [(m, name, tuple(p.shape), p.dtype) for m in clip.cond_stage_model.modules() if isinstance(m, PackedLayer)
                    for name, p in m._parameters.items() if p is not None]
    clip.flux2dev_source = EncoderSource(plan, tokenizer, padding, dtype, keep_loaded, allow_network, cache, placeholders)
    clip.flux2dev_encoder = {"layout": plan.layout, "formats": plan.formats, "tokenizer": tokenizer.rung}
    return clip


def load_weights(clip) -> None:
    """Read the CLIP's weights if it does not hold them (fingerprinting them for the cache on the way)."""
    from . import compat

    src = clip.flux2dev_source
    if src.loaded:
        return
    # Planned again: the files may have been replaced since the CLIP was built, and the old plan's offsets
    # would then read the wrong bytes. The tokenizer is the CLIP's own and is not resolved again.
    with compat.load_progress():
        plan = plan_encoder(src.plan.path)
        state_dict = read_weights(plan)
    src.fingerprint = None
    if src.cache is not None:
        src.fingerprint = weights_fingerprint(src.cache, _signature(plan), lambda: state_dict)
    # The weights are loaded here rather than in the constructor (which only logs missing keys), so that a
    # missing one stops the load.
    missing, _ = clip.load_sd(state_dict)
    if missing:  # the host model has exactly the layers + embeddings the loader reads (variants.layers_kept)
        raise HostError(
            f"This ComfyUI's FLUX.2 text encoder has weights the pack does not provide ({', '.join(missing[:5])}); "
            "its encoder differs from the one the pack was built for. Report it with your ComfyUI version."
        )
    src.loaded = True


def release_weights(clip) -> None:
    """Unload the CLIP from the host and give its weights' memory back; the next miss reads them again."""
    import comfy.model_management

    src = clip.flux2dev_source
    if not src.loaded:
        return
    loaded_models = comfy.model_management.current_loaded_models
    for i in range(len(loaded_models) - 1, -1, -1):
        patcher = loaded_models[i].model
        if patcher is not None and patcher.model is clip.cond_stage_model:
            loaded_models.pop(i).model_unload()
    device = clip.patcher.offload_device
    for layer, name, shape, dtype in src.placeholders:
        setattr(layer, name, torch.nn.Parameter(torch.empty(1, dtype=dtype, device=device).expand(shape), requires_grad=False))
        for companion in layer.companions:
            delattr(layer, companion)
        layer.companions, layer.lazy_patches = (), []
    src.loaded, src.fingerprint = False, None
    return_freed_memory()  # with keep_loaded off the point is to give the memory to the transformer


def return_freed_memory() -> None:
    """Hand the C heap's free pages back to the system. glibc keeps freed blocks for reuse, so RSS stays up by
    whatever was freed last; elsewhere there is nothing to do."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def lazy_clip(path: str, *, padding: str = "reference", allow_network: bool = False, dtype: torch.dtype | None = None,
              cache: str | None = None, keep_loaded: bool = True, embedding_directory=None, disable_dynamic: bool = False):
    """A FLUX.2 [dev] text encoder from any supported layout as a host CLIP, after reading its headers and
    tokenizer only. cache: a conditioning cache folder (None: no cache)."""
    plan = plan_encoder(path)
    tokenizer = resolve_plan_tokenizer(plan, allow_network=allow_network)
    clip = _build_clip(plan, tokenizer, padding=padding, dtype=dtype, keep_loaded=keep_loaded, allow_network=allow_network,
                       cache=ConditioningCache(cache) if cache else None, embedding_directory=embedding_directory,
                       disable_dynamic=disable_dynamic)
    options = {"padding": padding, "allow_network": allow_network, "dtype": dtype, "embedding_directory": embedding_directory}
    from . import compat

    compat.set_reload(clip.patcher, load_clip_patcher, (path, options))
    return clip


def load_clip(path: str, *, padding: str = "reference", allow_network: bool = False, dtype: torch.dtype | None = None,
              cache: str | None = None, keep_loaded: bool = True, embedding_directory=None, disable_dynamic: bool = False):
    """lazy_clip with its weights read now, which the host's device nodes can load again from the same path
    and options."""
    clip = lazy_clip(path, padding=padding, allow_network=allow_network, dtype=dtype, cache=cache, keep_loaded=keep_loaded,
                     embedding_directory=embedding_directory, disable_dynamic=disable_dynamic)
    load_weights(clip)
    return clip


def load_clip_patcher(path: str, options: dict, disable_dynamic: bool = False):
    """The reload factory the device nodes call: a fresh load's patcher, weights read."""
    return load_clip(path, **options, disable_dynamic=disable_dynamic).patcher
