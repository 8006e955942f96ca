"""The FLUX.2 [dev] text encoder as the host's own CLIP object.

The weights come from loaders/models/encoder.py in the host's MistralForCausalLM names; the model is the host's
pruned FLUX.2 encoder with the pack's masking (clip_model.py), the pack's tokenizer (clip_tokenizer.py), and
the pack's packed ops and patcher (ops.py), which keep quantized weights (comfy_quant formats, GGUF) packed,
dequantize them per layer at run time and apply LoRAs to the dequantized weights.

The CLIP is lazy: it is built from the checkpoint's headers and tokenizer alone, and reads the weights
(clip_weights.py) on the first prompt the conditioning cache (clip_cache.py, loaders/cache/) does not hold.
With keep_loaded off it frees them again after each encode.
"""

from __future__ import annotations

import functools
import logging
import math
import time

import torch

from ..loaders.cache.store import ConditioningCache
from ..loaders.models.encoder import EncoderPlan, plan_encoder, resolve_plan_tokenizer
from ..tokenizers.prompt import PADDING_MODES
from . import ensure_comfy
from .clip_cache import cache_bypass, cache_folder, conditioning_key
from .clip_model import LAYERS_KEPT_KEY, LAYERS_KEY, compute_dtype, encoder_model_class, model_config
from .clip_tokenizer import CLIP_NAME, PADDING_KEY, TOKENIZER_KEY, Flux2DevTokenizer
from .clip_weights import EncoderSource, load_weights, release_weights


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
            bypass = cache_bypass(self, tokens) if src.cache is not None else None
            key = conditioning_key(self, tokens) if src.cache is not None and not bypass else None
            out = src.cache.get(key) if key is not None else None
            if out is not None:
                out = {"pooled_output": None, **out}
                self.add_hooks_to_dict(out)
                logging.info("FLUX.2 [dev] prompt: conditioning cache hit in %s (the encoder did not run).",
                             src.cache.folder)
            else:
                started = time.monotonic()
                out = super().encode_from_tokens(tokens, return_pooled=return_pooled, return_dict=True)
                tensors = {k: v for k, v in out.items() if isinstance(v, torch.Tensor)}
                stored = None
                if key is not None and all(v is None or k in tensors or k == "hooks" for k, v in out.items()):
                    stored = src.cache.put(key, tensors)
                logging.info("FLUX.2 [dev] prompt encoded in %.1f s: %s.", time.monotonic() - started,
                             _miss(src, bypass, stored))
            if not src.keep_loaded:
                release_weights(self)
            if return_dict:
                return out
            return (out["cond"], out["pooled_output"]) if return_pooled else out["cond"]

    return Flux2DevCLIP


def _miss(src: EncoderSource, bypass: str | None, stored) -> str:
    """What the log says of a prompt the conditioning cache did not serve."""
    if src.cache is None:
        return "no conditioning cache is set"
    if bypass:
        return f"conditioning cache bypassed ({bypass}), so it is not stored in {src.cache.folder}"
    if stored is None:
        return f"conditioning cache miss; {src.cache.folder} could not take it, so it is not stored"
    return f"conditioning cache miss, now stored in {src.cache.folder}"


def _build_clip(plan: EncoderPlan, tokenizer, *, padding: str, dtype: torch.dtype | None, keep_loaded: bool,
                allow_network: bool, cache: ConditioningCache | None, embedding_directory, disable_dynamic: bool):
    """The host CLIP of a planned encoder, its weights not read yet. dtype: the weights' dtype in the host
    (default: as stored). The host picks the CLIP's patcher class as for its own encoders (disable_dynamic:
    the plain one)."""
    from ..loaders.models.variants import dev_variant_for_encoder, layers_kept
    if padding not in PADDING_MODES:
        raise ValueError(f"padding must be one of {PADDING_MODES}, got {padding!r}")
    model_class = encoder_model_class()
    import comfy.text_encoders.flux

    from . import compat
    from .ops import PackedLayer, fast_cpu_matmul_dtype, packed_operations, packed_patcher, read_ahead

    dtype = dtype or compute_dtype(plan)
    # bf16 weights (as stored, or dequantized to them) are multiplied in bf16 where the CPU does it natively
    cpu_matmul_dtype = fast_cpu_matmul_dtype() if dtype == torch.bfloat16 else None

    class Target:
        params = {}
        clip = compat.call_with_known(comfy.text_encoders.flux.flux2_te, dtype_llama=dtype, pruned=True)
        tokenizer = Flux2DevTokenizer

    model_options = {
        "dtype": dtype,
        "custom_operations": packed_operations(cpu_matmul_dtype=cpu_matmul_dtype),
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
    read_ahead(list(getattr(clip.cond_stage_model, CLIP_NAME).transformer.model.layers))
    logging.info("FLUX.2 [dev] CLIP ready: %s patcher, computing on %s, kept on %s when idle; its weights are read on "
                 "the first prompt the conditioning cache lacks.", type(clip.patcher).__name__,
                 clip.patcher.load_device, clip.patcher.offload_device)
    placeholders = [(m, name, tuple(p.shape), p.dtype) for m in clip.cond_stage_model.modules()
                    if isinstance(m, PackedLayer) for name, p in m._parameters.items() if p is not None]
    clip.flux2dev_source = EncoderSource(plan, tokenizer, padding, dtype, keep_loaded, allow_network, cache,
                                         cpu_matmul_dtype, placeholders)
    clip.flux2dev_encoder = {"layout": plan.layout, "formats": plan.formats, "tokenizer": tokenizer.rung}
    return clip


def lazy_clip(path: str, *, padding: str = PADDING_MODES[0], allow_network: bool = False,
              dtype: torch.dtype | None = None, cache: str | None = None, keep_loaded: bool = True,
              embedding_directory=None, disable_dynamic: bool = False):
    """A FLUX.2 [dev] text encoder from any supported layout as a host CLIP, after reading its headers and
    tokenizer only. cache: a conditioning cache folder (None: no cache)."""
    plan = plan_encoder(path)
    tokenizer = resolve_plan_tokenizer(plan, allow_network=allow_network)
    clip = _build_clip(plan, tokenizer, padding=padding, dtype=dtype, keep_loaded=keep_loaded,
                       allow_network=allow_network, cache=ConditioningCache(cache) if cache else None,
                       embedding_directory=embedding_directory, disable_dynamic=disable_dynamic)
    options = {"padding": padding, "allow_network": allow_network, "dtype": dtype,
               "embedding_directory": embedding_directory}
    from . import compat

    compat.set_reload(clip.patcher, load_clip_patcher, (path, options))
    return clip


def load_clip(path: str, *, padding: str = PADDING_MODES[0], allow_network: bool = False,
              dtype: torch.dtype | None = None, cache: str | None = None, keep_loaded: bool = True,
              embedding_directory=None, disable_dynamic: bool = False):
    """lazy_clip with its weights read now, which the host's device nodes can load again from the same path
    and options."""
    clip = lazy_clip(path, padding=padding, allow_network=allow_network, dtype=dtype, cache=cache,
                     keep_loaded=keep_loaded, embedding_directory=embedding_directory, disable_dynamic=disable_dynamic)
    load_weights(clip)
    return clip


def load_clip_patcher(path: str, options: dict, disable_dynamic: bool = False):
    """The reload factory the device nodes call: a fresh load's patcher, weights read."""
    return load_clip(path, **options, disable_dynamic=disable_dynamic).patcher


def node_clip(path: str, *, padding: str, allow_network: bool = False, cache: str = "", keep_loaded: bool = True):
    """The CLIP an encoder node gives: lazy, with the conditioning cache folder its `cache` input names."""
    return lazy_clip(path, padding=padding, allow_network=allow_network, cache=cache_folder(cache),
                     keep_loaded=keep_loaded)


def pipeline_clip(pipeline: str, *, padding: str, cache: str = "", keep_loaded: bool = True):
    """node_clip of the [dev] text encoder of a diffusers pipeline folder; a Klein pipeline is refused, naming its
    encoder, before anything is read."""
    from ..loaders.models.pipeline import dev_encoder_folder

    return node_clip(str(dev_encoder_folder(pipeline)), padding=padding, cache=cache, keep_loaded=keep_loaded)
