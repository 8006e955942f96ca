"""Every ComfyUI internal the pack relies on, named and probed in one place.

The pack builds the host's own objects, so it calls into comfy below the node API. Those internals move
between releases; REQUIRED lists each one (a test scans host/ and nodes/ for every host name they use and
finds it here), and `missing_internals()` (run by one test) names whatever a new release dropped, instead of
many tests failing deep inside a load. What only some releases have is in OPTIONAL, with the release that
brought it, and is used through the functions below, each tagged with the releases it tells apart, which
fall back to the older behaviour where the host lacks it. SIGNATURES and RESULTS name the parameters the pack passes
host functions and the results it unpacks, which `unfit_calls()` (run by one test) checks by signature and source.
"""

from __future__ import annotations

import ast
import base64
import contextlib
import functools
import importlib
import inspect
import json
import logging
import sys
import textwrap
from pathlib import Path

from . import ensure_comfy

# (what the pack uses it for, "module:attribute.path")
REQUIRED = (
    ("the FLUX.2 model class the pack's MODEL extends", "comfy.model_base:Flux2.extra_conds"),
    ("the FLUX.2 model config (dtypes, key conversion)", "comfy.supported_models:Flux2.process_unet_state_dict"),
    ("loading a state dict into a model", "comfy.model_base:BaseModel.load_model_weights"),
    ("FLUX.2 transformer detection", "comfy.model_detection:detect_unet_config"),
    ("the model patcher whose weight patching packed layers take over",
     "comfy.model_patcher:ModelPatcher.patch_weight_to_device"),
    ("the patcher's unpatching, which clears packed layers' patches", "comfy.model_patcher:ModelPatcher.unpatch_model"),
    ("the patcher's low-VRAM switch, after which patches run as weight functions",
     "comfy.model_patcher:ModelPatcher.partially_unload"),
    ("patches applied at forward time", "comfy.model_patcher:LowVramPatch"),
    ("hook LoRAs written into weights, which packed layers take over",
     "comfy.model_patcher:ModelPatcher.patch_hook_weight_to_device"),
    ("hooked weights from the hook cache, which packed layers take over",
     "comfy.model_patcher:ModelPatcher.patch_cached_hook_weights"),
    ("the hook path's unpatching, which clears packed layers' hooks", "comfy.model_patcher:ModelPatcher.unpatch_hooks"),
    ("the hook mode whose cache holds packed layers' hook patches", "comfy.hooks:EnumHookMode.MaxSpeed"),
    ("the layers packed weights plug into", "comfy.ops:manual_cast.Linear"),
    ("the per-op hook of the host's layers", "comfy.ops:run_every_op"),
    ("moving weights to the compute device", "comfy.model_management:cast_to"),
    ("whether a device copies asynchronously", "comfy.model_management:device_supports_non_blocking"),
    ("the CLIP object", "comfy.sd:CLIP.load_sd"),
    ("the CLIP methods the lazy encoder overrides", "comfy.sd:CLIP.encode_from_tokens"),
    ("the CLIP's model load, where the lazy encoder reads its weights", "comfy.sd:CLIP.load_model"),
    ("the CLIP's clone, whose copies share the lazy weights", "comfy.sd:CLIP.clone"),
    ("the hooks a cached conditioning carries like an encoded one", "comfy.sd:CLIP.add_hooks_to_dict"),
    ("the models the host holds, which keep_loaded off unloads", "comfy.model_management:current_loaded_models"),
    ("unloading one held model", "comfy.model_management:LoadedModel.model_unload"),
    ("the user folder the conditioning cache lives in", "folder_paths:get_user_directory"),
    ("the input folder the image edit example's pictures are copied into", "folder_paths:get_input_directory"),
    ("the VAE object", "comfy.sd:VAE.throw_exception_if_invalid"),
    ("the VAE's size, measured again after the pack puts a narrower decoder in", "comfy.sd:VAE.model_size"),
    ("the host's VAE model, whose source says whether it builds a decoder narrower than the encoder",
     "comfy.ldm.models.autoencoder:AutoencodingEngineLegacy.__init__"),
    ("the host's diffusers-to-BFL VAE key conversion, run before the pack takes the decoder's weights out",
     "comfy.diffusers_convert:convert_vae_state_dict"),
    ("the pruned FLUX.2 text encoder", "comfy.text_encoders.flux:flux2_te"),
    ("the host's LoRA arithmetic, applied to a weight", "comfy.lora:calculate_weight"),
    ("reading a LoRA's tensors into patches, from the pack's map of where its layers land", "comfy.lora:load_lora"),
    ("a LoRA's patches added to a MODEL", "comfy.model_patcher:ModelPatcher.add_patches"),
    ("the host's weight adapters, which the pack's own adapter extends where the host's arithmetic is not the "
     "trainer's", "comfy.weight_adapter.base:WeightAdapterBase.calculate_weight"),
    ("a LoRA's patches added to a CLIP", "comfy.sd:CLIP.add_patches"),
    ("loading a model onto the device the host computes on", "comfy.model_management:load_models_gpu"),
    ("a model's weight dtype", "comfy.model_base:BaseModel.get_dtype"),
    ("the Mistral encoder class the pack masks left padding in",
     "comfy.text_encoders.flux:Mistral3_24BModel.process_tokens"),
    ("the Mistral layers the pack runs pads through", "comfy.text_encoders.llama:Mistral3Small24B"),
    ("the host's own FLUX.2 tokenizer, whose prompt syntax comfy padding follows",
     "comfy.text_encoders.flux:Flux2Tokenizer.tokenize_with_weights"),
    ("the progress bar of the node that runs", "comfy.utils:ProgressBar.update_absolute"),
    ("the model folders the menus list", "folder_paths:get_folder_paths"),
    ("the device the host computes on", "comfy.model_management:get_torch_device"),
    ("the device the host keeps unused transformers on", "comfy.model_management:unet_offload_device"),
    ("the dtype the host runs a transformer in", "comfy.model_management:unet_dtype"),
    ("the dtype the host casts weights to per op", "comfy.model_management:unet_manual_cast"),
    ("whether a device is the CPU", "comfy.model_management:is_device_cpu"),
    ("the host's command-line arguments, parsed once outside its main.py", "comfy.options:enable_args_parsing"),
    ("a state dict's parameter count, which the host sizes models by", "comfy.utils:calculate_parameters"),
    ("a state dict's weight dtype", "comfy.utils:weight_dtype"),
    ("a module's parameter by its dotted name", "comfy.utils:get_attr"),
    ("the node API (V3): the extension", "comfy_api.latest:ComfyExtension"),
    ("the node API (V3): a node", "comfy_api.latest:io.ComfyNode"),
    ("the node API (V3): a node's schema", "comfy_api.latest:io.Schema"),
    ("the node API (V3): a node's outputs", "comfy_api.latest:io.NodeOutput"),
    ("the node API (V3): a menu input", "comfy_api.latest:io.Combo.Input"),
    ("the node API (V3): a switch input", "comfy_api.latest:io.Boolean.Input"),
    ("the node API (V3): a text input", "comfy_api.latest:io.String.Input"),
    ("the node API (V3): a CLIP output", "comfy_api.latest:io.Clip.Output"),
    ("the node API (V3): a CLIP input", "comfy_api.latest:io.Clip.Input"),
    ("the node API (V3): a MODEL input", "comfy_api.latest:io.Model.Input"),
    ("the node API (V3): a MODEL output", "comfy_api.latest:io.Model.Output"),
    ("the node API (V3): a VAE output", "comfy_api.latest:io.Vae.Output"),
    ("the node API (V3): a number input", "comfy_api.latest:io.Int.Input"),
    ("the node API (V3): a decimal input", "comfy_api.latest:io.Float.Input"),
    ("the node API (V3): an image input", "comfy_api.latest:io.Image.Input"),
    ("the node API (V3): a text output", "comfy_api.latest:io.String.Output"),
    ("the node API (V3): text shown on the node", "comfy_api.latest:ui.PreviewText"),
    ("the device the host runs text encoders on", "comfy.model_management:text_encoder_device"),
    ("the device the host keeps unused text encoders on", "comfy.model_management:text_encoder_offload_device"),
    ("moving a model to its device before it runs", "comfy.model_management:load_models_gpu"),
    ("stopping a run the user cancelled", "comfy.model_management:throw_exception_if_processing_interrupted"),
)
# (what, "module:attribute.path", the first release that has it): used where there, with a fallback before.
OPTIONAL = (
    ("the patcher the host's own loaders build (its dynamic-VRAM one on NVIDIA)",
     "comfy.model_patcher:CoreModelPatcher", "0.33.0"),
    ("whether a patcher is the dynamic-VRAM one", "comfy.model_patcher:ModelPatcher.is_dynamic", "0.33.0"),
    ("the running release's version, part of the conditioning cache's key", "comfyui_version:__version__", "0.3.75"),
    ("a seed's control-after-generate default", "comfy_api.latest:io.ControlAfterGenerate", "0.33.0"),
    ("the dtype a model computes in", "comfy.model_base:BaseModel.get_dtype_inference", "0.33.0"),
)
# (what the pack passes them for, "module:attribute.path", the keyword parameters it passes or reads, the first
# release that takes them all): the names REQUIRED finds may still have lost a parameter in a new release.
SIGNATURES = (
    ("the lazy encoder's CLIP, built with the patcher class its caller asks for", "comfy.sd:CLIP.__init__",
     ("target", "embedding_directory", "tokenizer_data", "parameters", "model_options", "disable_dynamic"), "0.33.0"),
    ("packed layers' patched weights, which the host asks for by return_weight to save a model",
     "comfy.model_patcher:ModelPatcher.patch_weight_to_device", ("key", "device_to", "return_weight"), "0.33.0"),
    ("running real tokens apart from left pads, at their own positions, in comfy padding",
     "comfy.text_encoders.llama:Llama2_.forward",
     ("embeds", "num_tokens", "intermediate_output", "final_layer_norm_intermediate", "dtype", "position_ids"),
     "0.3.75"),
    ("a transformer's weights assigned, not copied, as the dynamic-VRAM patcher wants",
     "comfy.model_base:BaseModel.load_model_weights", ("sd", "unet_prefix", "assign"), "0.33.0"),
    ("a LoRA's tensors read into patches, by the map the pack gives", "comfy.lora:load_lora", ("lora", "to_load"),
     "0.3.75"),
)
# (what the pack unpacks it for, "module:attribute.path", the number of values it unpacks from its result)
RESULTS = (
    ("the left-padding mask the pack puts in place of the host's",
     "comfy.text_encoders.flux:Mistral3_24BModel.process_tokens", 4),
)


def _lookup(spec: str):
    module, _, path = spec.partition(":")
    obj = importlib.import_module(module)
    for name in path.split("."):
        obj = getattr(obj, name)
    return obj


def missing_internals() -> list[str]:
    """One line per internal in REQUIRED that the running host lacks, and per one in OPTIONAL it lacks though
    its release is that one's or newer; empty when all are there."""
    ensure_comfy()
    release = _release(host_version())
    wanted = [(what, spec) for what, spec in REQUIRED]
    wanted += [(f"{what}, since {since}", spec) for what, spec, since in OPTIONAL if release >= _release(since)]
    missing = []
    for what, spec in wanted:
        try:
            _lookup(spec)
        except (ImportError, AttributeError) as e:
            missing.append(f"{spec} ({what}): {e}")
    return missing


def unfit_calls() -> list[str]:
    """One line per host function in SIGNATURES that lacks a parameter the pack passes (from its release on), and
    per one in RESULTS whose result the pack cannot unpack; empty when all fit."""
    ensure_comfy()
    release = _release(host_version())
    found = [unfit_signature(_lookup(spec), spec, what, parameters)
             for what, spec, parameters, since in SIGNATURES if release >= _release(since)]
    found += [unfit_result(_lookup(spec), spec, what, size) for what, spec, size in RESULTS]
    return [line for line in found if line]


def unfit_signature(fn, spec: str, what: str, parameters) -> str | None:
    """What `fn` (the host's `spec`) lacks of the keyword parameters the pack passes it for `what`; None when it
    takes them all by name (a **kwargs alone does not count: call_with_known drops what the signature omits)."""
    accepted = inspect.signature(fn).parameters
    missing = [p for p in parameters if p not in accepted]
    if not missing:
        return None
    return (f"{spec} takes no parameter {', '.join(missing)}; the pack passes it for {what}. "
            f"Its parameters here: {', '.join(accepted)}")


def unfit_result(fn, spec: str, what: str, size: int) -> str | None:
    """Whether every return of `fn` (the host's `spec`, read from its source) is a tuple of the `size` values the
    pack unpacks for `what`; None when so, else what it returns instead."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    returned = {len(node.value.elts) if isinstance(node.value, ast.Tuple) else "something other than a tuple"
                for node in ast.walk(tree) if isinstance(node, ast.Return)}
    if returned == {size}:
        return None
    shown = ", ".join(f"{r} values" if isinstance(r, int) else r for r in sorted(returned, key=str)) or "nothing"
    return f"{spec} returns {shown}; the pack unpacks {size} values from it for {what}"


def _release(version: str) -> tuple[int, ...]:
    """A release's version as numbers ("unknown": the oldest)."""
    return tuple(int(p) for p in version.split(".") if p.isdigit()) if version[:1].isdigit() else ()


def call_with_known(fn, **kwargs):
    """Call a host function with the keyword arguments its signature (in this release) accepts."""
    accepted = inspect.signature(fn).parameters
    return fn(**{k: v for k, v in kwargs.items() if k in accepted})


def node_schema(**fields):
    """The host's V3 node schema with the fields this release knows: search_aliases is newer than 0.3.75, whose
    server sends none (its search finds the pack's nodes by title only)."""
    from comfy_api.latest import io

    return call_with_known(io.Schema, **fields)


def fixed_seed_control():
    """A seed input's control after generate, set to keep the seed: 0.33's "fixed"; on 0.3.75, which takes a switch
    only, the frontend's default control."""
    from comfy_api.latest import io

    control = getattr(io, "ControlAfterGenerate", None)
    return control.fixed if control is not None else True


def new_patcher(model, load_device, offload_device, disable_dynamic: bool = False):
    """The patcher the host's own loaders would build for `model` right now. 0.33: CoreModelPatcher, which
    its main.py points at the dynamic-VRAM patcher on NVIDIA GPUs (the plain one on the CPU); the plain
    ModelPatcher when asked (disable_dynamic) and on 0.3.75, which has no CoreModelPatcher."""
    import comfy.model_patcher

    plain = comfy.model_patcher.ModelPatcher
    cls = plain if disable_dynamic else getattr(comfy.model_patcher, "CoreModelPatcher", plain)
    return cls(model, load_device=load_device, offload_device=offload_device)


def is_dynamic(patcher) -> bool:
    """Whether a patcher is 0.33's dynamic-VRAM one (0.3.75 has none)."""
    return bool(getattr(patcher, "is_dynamic", lambda: False)())


def patch_functions(layer, name: str) -> list:
    """The patch functions the host hands a layer's parameter `name` (weight, bias): its `<name>_function`
    list, and 0.33's dynamic-VRAM patcher's `<name>_lowvram_function` before them."""
    lowvram = getattr(layer, f"{name}_lowvram_function", None)
    return ([lowvram] if lowvram is not None else []) + getattr(layer, f"{name}_function")


def expected_unet_keys(diffusion_model) -> set[str]:
    """The parameter names a host transformer model loads. 0.33 creates the host's layers with weight None
    until they are loaded, which state_dict() leaves out: those are added by module (and their bias where the
    host marks it for lazy creation). On 0.3.75 state_dict() has them all."""
    import torch

    weighted = (torch.nn.Linear, torch.nn.Embedding, torch.nn.modules.conv._ConvNd)  # layers that always own a weight
    expected = set(diffusion_model.state_dict())
    for name, module in diffusion_model.named_modules():
        if isinstance(module, weighted) and module.weight is None:
            expected.add(f"{name}.weight")
            if getattr(module, "comfy_need_lazy_init_bias", False):
                expected.add(f"{name}.bias")
    return expected


def load_unet_weights(model, state_dict: dict, dynamic: bool) -> None:
    """Load a transformer's weights the host's way (its key conversion included). 0.33's dynamic patcher wants
    them assigned, not copied, as the host's own loader does (0.3.75's load_model_weights takes no `assign`)."""
    sd = host_owned(state_dict) if dynamic else state_dict
    call_with_known(model.load_model_weights, sd=sd, unet_prefix="", assign=dynamic)


def host_owned(state_dict: dict) -> dict:
    """A state dict to be assigned (0.33's dynamic patcher), with copies of what the host's own modules keep (norms'
    scales, biases: the pack's layers hold every matrix): a weight mapped from a file is read-only, and the host's
    hook LoRAs write into the weights of its modules in place."""
    return {k: v.clone() if v.ndim < 2 else v for k, v in state_dict.items()}


def inference_dtype(model):
    """The dtype a host model computes in: 0.33's get_dtype_inference; before it, the manual-cast dtype where
    the model has one, else its weights' (what 0.3.75's apply_model casts its inputs to)."""
    found = getattr(model, "get_dtype_inference", None)
    if found is not None:
        return found()
    return model.manual_cast_dtype or model.get_dtype()


def builds_narrow_vae_decoders() -> bool:
    """Whether the host builds a VAE decoder narrower than its encoder, sized from the file's decoder.conv_in (0.33:
    its VAE model takes a decoder_ddconfig); 0.3.75 builds the decoder as wide as the encoder."""
    import comfy.ldm.models.autoencoder

    return "decoder_ddconfig" in inspect.getsource(comfy.ldm.models.autoencoder.AutoencodingEngineLegacy.__init__)


def unload_held(model) -> None:
    """Unload whatever the host holds of `model` (a patcher's model: a CLIP's cond_stage_model, a MODEL's
    model), so that its memory can go."""
    import comfy.model_management

    loaded_models = comfy.model_management.current_loaded_models
    for i in range(len(loaded_models) - 1, -1, -1):
        patcher = loaded_models[i].model
        if patcher is not None and patcher.model is model:
            loaded_models.pop(i).model_unload()


def unet_keys_renamed(model_config, keys) -> dict[str, str]:
    """file key -> the key the host loads it under, one by one through its own conversion (0.33 renames FLUX
    RMSNorm scales to weights; 0.3.75 keeps every key)."""
    return {key: next(iter(model_config.process_unet_state_dict({key: None}))) for key in keys}


def unet_keys_as_loaded(model_config, state_dict: dict) -> set[str]:
    """The keys the host will load a transformer state dict under, after its own conversion (0.33 renames
    FLUX RMSNorm scales to weights there; 0.3.75 loads them as stored)."""
    return set(model_config.process_unet_state_dict(dict(state_dict)))


@contextlib.contextmanager
def _host_records(parse, suppress: bool):
    """What `parse` (message -> a list of values, or None to pass it by) takes from each message the host logs at
    WARNING or above inside the block, collected into one list; those it takes are kept out of the log where
    `suppress`."""
    found: list = []
    root = logging.getLogger()
    level = root.level

    class Collect(logging.Filter):
        def filter(self, record) -> bool:
            taken = parse(record.getMessage()) if record.levelno >= logging.WARNING else None
            if taken is None:
                return record.levelno >= level
            found.extend(taken)
            return not suppress and record.levelno >= level

    collect = Collect()
    root.addFilter(collect)
    if level > logging.WARNING:  # a user's --verbose ERROR would drop the record before the filter sees it
        root.setLevel(logging.WARNING)
    try:
        yield found
    finally:
        root.removeFilter(collect)
        root.setLevel(level)


def keys_the_host_logs_missing(message: str):
    """Collect the keys the host reports missing while building a model, where it only logs them (its VAE:
    "Missing VAE keys [...]") after its own key conversion, and then goes on with uninitialised weights."""
    return _host_records(
        lambda text: ast.literal_eval(text[len(message):].strip()) if text.startswith(message) else None, False)


# What the host's LoRA reader logs for each tensor of a LoRA it did not read (comfy.lora.load_lora).
LORA_KEY_NOT_LOADED = "lora key not loaded: "


def lora_keys_not_loaded(messages: list[str]) -> set[str]:
    """The LoRA tensors the host's reader said it did not read, among `messages` (from host_warnings)."""
    return {m[len(LORA_KEY_NOT_LOADED):] for m in messages if m.startswith(LORA_KEY_NOT_LOADED)}


def host_warnings():
    """Collect what the host logs as a warning or an error inside the block, instead of logging it: its LoRA reader
    names the tensors it did not read, and its weight adapters a patch they could not apply (leaving the weight as
    it was); the pack reports them, or raises its own error with them."""
    return _host_records(lambda text: [text], True)


@contextlib.contextmanager
def load_progress():
    """Show the progress of the loads inside the block in the running node's progress bar (outside a node the
    host's bar does nothing)."""
    ensure_comfy()
    import comfy.utils

    from ..loaders.models import progress

    bar = comfy.utils.ProgressBar(1)
    with progress.listening(lambda done, total: bar.update_absolute(done, total)):
        yield


class _PieceRecorder:
    """Stands in for the BPE inside the host's own FLUX.2 tokenizer: it keeps the texts the host's prompt
    syntax hands over, so that the pack tokenizes exactly those."""

    def __init__(self):
        self.pieces: list[str] = []

    def __call__(self, text: str) -> dict:
        self.pieces.append(text)
        return {"input_ids": []}


def _vocabulary_stub() -> bytes:
    """The smallest tekken file the host's FLUX.2 tokenizer builds from: the special tokens and the 256 bytes."""
    from ..tokenizers.vocab import V3_SPECIAL_TOKENS

    specials = [{"rank": i, "token_str": s, "is_control": True} for i, s in enumerate(V3_SPECIAL_TOKENS)]
    ranks = [{"rank": b, "token_bytes": base64.b64encode(bytes([b])).decode()} for b in range(256)]
    config = {"version": "v7", "default_num_special_tokens": len(specials), "default_vocab_size": len(specials) + 256,
              "pattern": r"\s+|\S+"}
    return json.dumps({"config": config, "vocab": ranks, "special_tokens": specials}).encode()


@functools.cache
def prompt_pieces():
    """prompt -> the texts the running host's own FLUX.2 tokenizer tokenizes (its template, escapes, weight and
    embedding syntax applied), or None where the host's tokenizer cannot be built, whatever its builder raises
    (0.3.75 under transformers 5.15 and newer: its MistralConverter call lacks vocab_file; 0.33 has its own BPE):
    comfy padding then follows the pack's copy of that syntax."""
    ensure_comfy()
    import comfy.text_encoders.flux

    try:
        host = comfy.text_encoders.flux.Flux2Tokenizer(tokenizer_data={"tekken_model": _vocabulary_stub()})
    except Exception as e:  # the host's builder, not the pack: any failure of it leaves the pack's own syntax
        logging.info("FLUX.2 [dev]: ComfyUI's own FLUX.2 tokenizer cannot be built here (%s: %s); comfy padding "
                     "follows the pack's copy of its prompt syntax.", type(e).__name__, e)
        return None
    recorder = host.mistral3_24b.tokenizer = _PieceRecorder()

    def pieces(prompt: str) -> list[str]:
        recorder.pieces = []
        host.tokenize_with_weights(prompt)
        return recorder.pieces

    return pieces


def server_routes() -> tuple[object, list[str]] | None:
    """(the running server's route table, the names it loaded the pack's folder under: a link's own name, not its
    target's), or None outside a server (the command line, the tests in process). Read from the modules main.py
    imported before loading the pack, never imported here: the server does not import outside main.py."""
    server, nodes = sys.modules.get("server"), sys.modules.get("nodes")
    instance = getattr(getattr(server, "PromptServer", None), "instance", None)
    if instance is None or not hasattr(nodes, "LOADED_MODULE_DIRS"):
        return None
    pack = Path(__file__).resolve().parents[1]
    names = [name for name, folder in nodes.LOADED_MODULE_DIRS.items() if Path(folder).resolve() == pack]
    return instance.routes, names


def set_reload(patcher, factory, args: tuple) -> None:
    """Register how to load this model again (0.33's `cached_patcher_init`). Its device nodes and the
    multi-GPU clone rebuild a model with factory(*args) or factory(*args, disable_dynamic=True), which must
    return a patcher. 0.3.75 has no device nodes and never calls it."""
    patcher.cached_patcher_init = (factory, args)


def host_version() -> str:
    """The running ComfyUI's version ("unknown" for a tree without comfyui_version.py): part of the
    conditioning cache's key, since the host's encoder code shapes the numbers."""
    try:
        import comfyui_version
    except ImportError:
        return "unknown"
    return str(comfyui_version.__version__)
