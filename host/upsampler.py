"""Prompt upsampling in the host: Mistral-Small-3.x rewrites a short prompt into the long, structured kind
FLUX.2 [dev] was trained on, with the weights of the encoder checkpoint the user already has (Black Forest
Labs' recommended use of [dev]).

The language model (loaders/upsampler/language_model.py) is built with the pack's packed operations (ops.py), so
fp8, NVFP4 and GGUF weights stay packed and are expanded one layer at a time, and held by the host's plain
patcher, so the host moves it to its text-encoder device and off again as it does its own models. The rewritten
prompt is kept in the conditioning cache folder under everything that decides it: a prompt upsampled before is
served without reading the weights. With keep_loaded off the model is freed after each run."""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from ..errors import HostError, InputError
from ..loaders.cache.keys import UpsampleKey
from ..loaders.cache.store import ConditioningCache, stat_signature, weights_fingerprint
from ..loaders.formats.validate import released_on_error
from ..loaders.models.encoder import EncoderPlan, plan_language_model, read_weights, resolve_plan_tokenizer
from ..loaders.upsampler.generation_settings import check_settings
from ..loaders.upsampler.images import MAX_DECODED_PIXELS, reference_image
from ..loaders.upsampler.language_model import MistralLM, Sampling, generate
from ..loaders.upsampler.vision import VisionEncoder, VisionPlan, plan_vision, prepare, read_vision_weights
from ..tokenizers.chat import EOS_ID, IMAGE_ID, MODES, SYSTEM_MESSAGES, chat_ids, check_prompt, reply_text
from . import compat, ensure_comfy
from .clip_model import compute_dtype
from .clip_weights import return_freed_memory

TEXT_KEY, IDS_KEY = "text", "output_ids"  # a cache entry's tensors


@dataclass(frozen=True)
class Upsampled:
    text: str
    system_message: str
    input_ids: list[int]  # the whole chat prompt as fed to the model (each image's [IMG] tokens included)
    output_ids: list[int]  # what the model wrote (its closing </s> included when it stopped by itself)
    cached: bool


@dataclass(eq=False)
class LoadedLanguageModel:
    source: tuple  # (path, what is read, its files' stat signature, dtype, device): the same load again is this one
    patcher: object
    fingerprint: str | None = None


_held: LoadedLanguageModel | None = None  # the model kept loaded (keep_loaded on): one at most


def images_from_host(images) -> list:
    """PIL images of the host's IMAGE tensors ([batch, height, width, channels], 0..1), each batch entry one."""
    from PIL import Image

    out = []
    for batch in images:
        height, width = batch.shape[1:3]
        if height * width > MAX_DECODED_PIXELS:
            raise InputError(f"A reference image is {width}x{height} pixels; the upsampler takes at most "
                             f"{MAX_DECODED_PIXELS} pixels of an image. Scale it down (Upscale Image By) first.")
        for frame in batch:
            rgb = np.clip(np.rint(frame[..., :3].float().cpu().numpy() * 255), 0, 255).astype(np.uint8)
            out.append(Image.fromarray(rgb, "RGB"))
    return out


def _reads(plan: EncoderPlan, vision: VisionPlan | None) -> str:
    """A digest of the tensors a load reads: the fingerprint of one set of them is not another's."""
    names = sorted(plan.mapping) + (sorted(vision.stored) if vision else [])
    return hashlib.sha256(json.dumps(names).encode()).hexdigest()


def upsample(path: str, prompt: str, *, images: list = (), mode: str = "auto", seed: int = 0, temperature: float = 0.15,
             max_new_tokens: int = 512, cache: str | None = None, keep_loaded: bool = False,
             dtype: torch.dtype | None = None, device: torch.device | None = None,
             on_token: Callable[[int, int], None] | None = None) -> Upsampled:
    """The prompt rewritten by the Mistral-Small-3.x checkpoint at `path` (a whole model: all layers and lm_head);
    with images (PIL images, or image files' paths) an edit instruction about them. cache: a conditioning cache
    folder (None: no cache). device: where it computes (default: the host's text-encoder device).
    on_token(count, max_new_tokens) follows generation, beside the running node's progress bar.
    The settings are checked first, then the model's headers, then the images: each refusal before any weight
    is read."""
    if mode not in MODES:
        raise InputError(f"mode is {mode!r}; it is one of {', '.join(MODES)}.")
    if mode == "edit" and not images:
        raise InputError("mode is edit, but no reference image is connected. Connect the images to edit, or set mode "
                         "to text to image (or auto).")
    check_settings(seed=seed, temperature=temperature, max_new_tokens=max_new_tokens)
    check_prompt(prompt)
    edit = bool(images) and mode != "text to image"
    plan = plan_language_model(path)
    vision = plan_vision(plan) if edit else None
    tokenizer = resolve_plan_tokenizer(plan).tokenizer
    prepared = prepare([reference_image(images)], vision) if edit else None
    system = SYSTEM_MESSAGES["edit" if edit else "text to image"]
    input_ids = chat_ids(tokenizer, system, prompt, prepared.grid if prepared else None)
    dtype = dtype or compute_dtype(plan)
    ensure_comfy()
    import comfy.model_management

    device = torch.device(device) if device is not None else comfy.model_management.text_encoder_device()
    sampling = Sampling(temperature=float(temperature), seed=int(seed))
    store = ConditioningCache(cache) if cache else None
    source = (plan.path, _reads(plan, vision), stat_signature(plan.path, plan.source.files), str(dtype), str(device))
    held = _held if _held is not None and _held.source == source else None
    signature = hashlib.sha256(json.dumps(source[1:3]).encode()).hexdigest()
    fingerprint = (held.fingerprint if held else None) or (store.known_fingerprint(signature) if store else None)

    def key(weights: str) -> UpsampleKey:
        return UpsampleKey(
            weights=weights, layout=plan.layout, formats=tuple(sorted(plan.formats.items())),
            vocabulary=tokenizer.vocab_digest, system_message=system, prompt=prompt, input_ids=tuple(input_ids),
            image=prepared.digest if prepared else "", seed=sampling.seed, temperature=sampling.temperature,
            top_k=sampling.top_k, max_new_tokens=int(max_new_tokens), dtype=str(dtype), device=device.type,
            host=compat.host_version(),
        )

    if store is not None and fingerprint is not None:
        hit = _reply(store.get(key(fingerprint)))
        if hit is not None:
            logging.info("FLUX.2 [dev] prompt upsampling: cache hit in %s (the model did not run).", store.folder)
            return Upsampled(hit[0], system, input_ids, hit[1], True)

    started = time.monotonic()
    loaded = held or _load(plan, vision, dtype, device, source, store, signature)
    try:
        output_ids = _run(loaded.patcher, input_ids, prepared, max_new_tokens, sampling, on_token)
    finally:
        _keep(loaded, keep_loaded)
    text = reply_text(tokenizer, output_ids)
    stored = None
    if store is not None and loaded.fingerprint is not None:
        entry = {TEXT_KEY: torch.tensor(list(text.encode()), dtype=torch.uint8), IDS_KEY: torch.tensor(output_ids)}
        stored = store.put(key(loaded.fingerprint), entry)
    logging.info("FLUX.2 [dev] prompt upsampling: %d tokens in %.1f s%s.", len(output_ids), time.monotonic() - started,
                 "" if store is None
                 else f", now stored in {store.folder}" if stored else f"; {store.folder} could not take it")
    return Upsampled(text, system, input_ids, output_ids, False)


def _reply(entry: dict | None) -> tuple[str, list[int]] | None:
    """The text and ids of a cache entry, or None (a miss, as a damaged entry is) when it is not what the
    upsampler stores: UTF-8 text as bytes, and the ids."""
    text, ids = (entry.get(TEXT_KEY), entry.get(IDS_KEY)) if entry is not None else (None, None)
    if not all(isinstance(t, torch.Tensor) and t.dtype == dtype and t.dim() == 1
               for t, dtype in ((text, torch.uint8), (ids, torch.int64))):
        return None
    try:
        return bytes(text.tolist()).decode("utf-8"), ids.tolist()
    except UnicodeDecodeError:
        return None


def node_upsample(path: str, prompt: str, *, images: list, cache: str = "", **settings) -> str:
    """The upsampler node's text: `images` are the host's IMAGE inputs (None where not connected), `cache` its
    cache folder input."""
    from .clip_cache import cache_folder

    frames = images_from_host([i for i in images if i is not None])
    return upsample(path, prompt, images=frames, cache=cache_folder(cache), **settings).text


@released_on_error
def _load(plan: EncoderPlan, vision: VisionPlan | None, dtype: torch.dtype, device: torch.device, source: tuple,
          store: ConditioningCache | None, signature: str) -> LoadedLanguageModel:
    """Read the weights into the language model (and the vision tower) under the host's patcher."""
    import comfy.model_management

    from .ops import packed_operations, packed_patcher

    with compat.load_progress():
        weights = read_weights(plan)
        vision_weights = read_vision_weights(plan, vision) if vision else {}
    fingerprint = None
    if store is not None:
        fingerprint = weights_fingerprint(store, signature, lambda: {**weights, **vision_weights})
    offload = comfy.model_management.text_encoder_offload_device()
    model = MistralLM(plan.geometry, plan.layers_in_file, plan.rope_theta, operations=packed_operations(),
                      device=offload, dtype=dtype)
    missing, _ = model.load_state_dict(weights, strict=False)
    if missing:
        raise HostError(f"The language model lacks weights the plan should have read ({', '.join(missing[:5])}); "
                        "this is a bug of the pack. Report it with the file's name.")
    if vision is not None:
        model.vision = VisionEncoder(vision, vision_weights, dtype).to(offload)
    patcher = compat.new_patcher(model, device, offload, disable_dynamic=True)
    return LoadedLanguageModel(source, packed_patcher(patcher), fingerprint)


def _run(patcher, input_ids: list[int], image, max_new_tokens: int, sampling: Sampling,
         on_token: Callable[[int, int], None] | None) -> list[int]:
    import comfy.model_management
    import comfy.utils

    comfy.model_management.load_models_gpu([patcher])
    model: MistralLM = patcher.model
    device = patcher.load_device
    bar = comfy.utils.ProgressBar(max_new_tokens)

    def token_done(count: int, token: int) -> None:
        bar.update_absolute(count, max_new_tokens)
        if on_token is not None:
            on_token(count, max_new_tokens)
        comfy.model_management.throw_exception_if_processing_interrupted()

    with torch.inference_mode():
        ids = torch.tensor([input_ids], device=device)
        embeds = model.embed(ids)
        if image is not None:
            features = model.vision(image).to(device=device, dtype=embeds.dtype)
            embeds = embeds.masked_scatter((ids == IMAGE_ID)[..., None], features)
    return generate(model, embeds, max_new_tokens=max_new_tokens, sampling=sampling, eos_id=EOS_ID, on_token=token_done)


def _keep(loaded: LoadedLanguageModel, keep_loaded: bool) -> None:
    """Hold the model for the next run, or give its memory back."""
    global _held
    if keep_loaded:
        if _held is not None and _held is not loaded:
            _release(_held)
        _held = loaded
        return
    if _held is loaded:
        _held = None
    _release(loaded)


def _release(loaded: LoadedLanguageModel) -> None:
    import comfy.model_management

    loaded_models = comfy.model_management.current_loaded_models
    for i in range(len(loaded_models) - 1, -1, -1):
        if loaded_models[i].model is loaded.patcher:
            loaded_models.pop(i).model_unload()
    loaded.patcher = None
    return_freed_memory()


def release_held() -> None:
    """Free the model kept loaded, if any."""
    global _held
    if _held is not None:
        held, _held = _held, None
        _release(held)

