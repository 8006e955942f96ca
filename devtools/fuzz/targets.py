"""The fuzzing targets (TARGETS): each entry point, the seed trees it runs on (rebuilt from the tiny
fixtures: weights sparse, vocabularies cut), and what it must return."""

from __future__ import annotations

import base64
import json
import os
import shutil
import struct
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .files import G_STRING, FileSpec, GArray, Gguf, JsonDoc, JsonLines, RawFile, Safetensors

N_RANKS = 300  # BPE ranks kept in the cut vocabularies (the 256 bytes and the first merges)
PROMPT = "a red fox [INST] <s> in the snow"


@dataclass
class Tree:
    """Files rebuilt from one tiny fixture, the entry the target is called with, and which files it mutates."""

    name: str
    files: dict[str, Any]  # relative path -> JsonDoc | RawFile | Safetensors | Gguf
    entry: str  # relative path given to the target ("" : the tree's root folder)
    mutable: tuple[str, ...]
    run: Callable[[Path], str | None]  # None when the result is sound; else what is wrong with it
    specs: dict[str, FileSpec] = field(default_factory=dict)

    def spec(self, rel: str) -> FileSpec:
        """The file as the fixture has it (computed once)."""
        if rel not in self.specs:
            self.specs[rel] = self.files[rel].spec()
        return self.specs[rel]


def _cut_tekken(data: bytes, listed: bool = False) -> bytes:
    """tekken.json with its 1000 specials and only the first N_RANKS ranks (optionally with a special_tokens
    list, as files of version v7+ have)."""
    doc = json.loads(data)
    doc["vocab"] = doc["vocab"][:N_RANKS]
    config = doc["config"]
    config["default_vocab_size"] = config["default_num_special_tokens"] + N_RANKS
    config["num_vocab_tokens"] = N_RANKS
    doc.pop("image", None)
    if listed:
        from ...tokenizers.vocab import V3_SPECIAL_TOKENS

        config["version"] = "v11"
        doc["special_tokens"] = [{"rank": i, "token_str": s, "is_control": True}
                                 for i, s in enumerate(V3_SPECIAL_TOKENS)]
    return json.dumps(doc).encode()


class Fixtures:
    """The tiny fixtures under `root`, read into seed trees on request."""

    def __init__(self, root: Path):
        self.root = root
        from ...tokenizers.ladder import bundled_tekken_path

        self.tekken = _cut_tekken(bundled_tekken_path().read_bytes())
        self.tekken_listed = _cut_tekken(bundled_tekken_path().read_bytes(), listed=True)

    def model(self, rel: str) -> Any:
        path = self.root / rel
        if path.name == "tekken.json":
            return JsonDoc(json.loads(self.tekken))
        if path.suffix == ".json":
            return JsonDoc(json.loads(path.read_bytes()))
        if path.suffix == ".safetensors":
            return Safetensors.read(path, {"tekken_model": self.tekken})
        if path.suffix == ".gguf":
            return self._gguf(path)
        return RawFile(path.read_bytes())

    def _gguf(self, path: Path) -> Gguf:
        from ...tokenizers.vocab import byte_level_string

        vocab = json.loads(self.tekken)
        n_special = vocab["config"]["default_num_special_tokens"]
        ranks = [base64.b64decode(e["token_bytes"]) for e in vocab["vocab"]]
        from ...tokenizers.vocab import V3_SPECIAL_TOKENS

        specials = [*V3_SPECIAL_TOKENS, *(f"<SPECIAL_{i}>" for i in range(len(V3_SPECIAL_TOKENS), n_special))]
        tokens = GArray(G_STRING, specials + [byte_level_string(r) for r in ranks])
        types = GArray(5, [3] * n_special + [1] * len(ranks))
        f16 = struct.pack(f"<{len(self.tekken)}e", *self.tekken)
        return Gguf.read(path, {"tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types,
                                "tokenizer.ggml.merges": GArray(G_STRING, [])}, {"tekken_model": (1, f16)})

    def cache_tree(self) -> Tree:
        """A conditioning cache folder as the cache writes it (its tag, two entries, a fingerprint index and the
        lock), with a file of the user's beside them that it must leave alone."""
        from ...loaders.cache.store import ConditioningCache

        folder = Path(tempfile.mkdtemp(prefix="fuzz-cache-"))
        cache = ConditioningCache(folder)
        for i, key in enumerate(CACHE_KEYS):
            cache.put(key, {"cond": _full((1, 4, 32), float(i))})
        cache.remember_fingerprint(CACHE_SIGNATURE, "f" * 64)
        files: dict[str, Any] = {p.name: RawFile(p.read_bytes()) for p in folder.iterdir()}
        files[CACHE_FINGERPRINTS] = JsonDoc(json.loads(files[CACHE_FINGERPRINTS].data))
        files[USER_FILE] = RawFile(b"a user's model file, which no cache operation may touch\n" * 64)
        shutil.rmtree(folder)
        return Tree("cache", files, "", tuple(sorted(n for n in files if n != USER_FILE)), run_cache_folder)

    def tree(self, name: str, rel: str, run: Callable[[Path], str | None], *, files: tuple[str, ...] = (),
             mutable: tuple[str, ...] | None = None, entry: str | None = None) -> Tree:
        """A tree of the fixture `rel` (a file, or a folder's `files`, all of them by default)."""
        base = self.root / rel
        if base.is_file():
            return Tree(name, {base.name: self.model(rel)}, entry or base.name, (base.name,), run)
        names = files or tuple(sorted(str(p.relative_to(base)) for p in base.rglob("*") if p.is_file()))
        models = {n: self.model(f"{rel}/{n}") for n in names}
        return Tree(name, models, entry if entry is not None else "", mutable or names, run)


# Each run function gets the path to call the entry point with and returns None, or the problem with a
# result that returned normally. Imports are inside: the worker pays for them once, before its first input.


def run_gguf_reader(path: Path) -> None:
    from ...loaders.formats.gguf_file import open_gguf

    with open_gguf(path) as gguf:
        for tensor in gguf.tensors.values():
            _ = tensor.data  # every view can be made


def run_safetensors_header(path: Path) -> None:
    from ...loaders.formats.safetensors_file import read_header

    read_header(str(path))


def _outside(folder: Path, found) -> str | None:
    root = folder.resolve()
    escaped = [str(p) for p in found if not Path(p).resolve().is_relative_to(root)]
    return f"names file(s) outside the model folder: {escaped[:3]}" if escaped else None


def run_shards(weights: str) -> Callable[[Path], str | None]:
    def run(folder: Path) -> str | None:
        from ...loaders.formats.files import shards

        return _outside(folder, shards(folder, weights))

    return run


def run_part_files(folder: Path) -> str | None:
    from ...loaders.formats.files import part_files

    return _outside(folder, part_files(folder, "transformer", "Choose another."))


def _encode(resolution) -> None:
    from ...tokenizers import prompt_ids

    resolution.tokenizer.encode(PROMPT)
    prompt_ids(resolution.tokenizer, PROMPT, "reference")


def run_tekken_ladder(folder: Path) -> None:
    from ...tokenizers import resolve_tokenizer

    _encode(resolve_tokenizer([folder]))


def run_gguf_vocab(path: Path) -> None:
    from ...loaders.formats.gguf_file import open_gguf
    from ...tokenizers import resolve_tokenizer

    with open_gguf(path) as gguf:
        metadata = gguf.metadata
    _encode(resolve_tokenizer(gguf_metadata=metadata))


def run_pipeline_class(folder: Path) -> None:
    from ...loaders.models.pipeline import holds_variant, pipeline_class

    pipeline_class(folder)
    holds_variant(folder, "dev")


def run_plan_encoder(path: Path) -> None:
    from ...loaders.models.encoder import plan_encoder

    plan_encoder(str(path))


def run_inspect(path: Path) -> None:
    from ...loaders.models.inspect import inspect_path

    json.dumps(inspect_path(path))


def run_encoder(path: Path) -> None:
    from ...loaders.models.encoder import load_encoder

    loaded = load_encoder(str(path))
    _encode(loaded.tokenizer)


def run_transformer(path: Path) -> None:
    from ...loaders.models.transformer import load_transformer

    load_transformer(path)


def run_gguf_transformer(path: Path) -> None:
    from ...loaders.models.gguf_transformer import load_gguf_transformer

    load_gguf_transformer(path)


def run_pipeline(folder: Path) -> None:
    from ...loaders.models.pipeline import describe_pipeline, dev_encoder_folder

    describe_pipeline(folder)
    dev_encoder_folder(folder)


def run_prompts_file(path: Path) -> None:
    from ...loaders.formats.files import read_prompts
    from ...tokenizers import prompt_ids, resolve_tokenizer

    tokenizer = resolve_tokenizer().tokenizer  # the bundled vocabulary, built once per worker
    for prompt in dict.fromkeys(read_prompts(path)):  # each distinct prompt: a repeated line costs its reading only
        prompt_ids(tokenizer, prompt, "reference")


USER_FILE = "flux2-dev.safetensors"
CACHE_SIGNATURE = "s" * 64
CACHE_FINGERPRINTS = "fingerprints.json"


def _cache_keys():
    from ...loaders.cache.keys import ConditioningKey

    return [ConditioningKey(weights="0" * 64, layout="comfy-single-file", formats=(("bf16", 3),), settings=(),
                            vocabulary=str(i), padding="reference", tokens=(((1, 1.0),),), dtype="torch.float32",
                            device="cpu", layers=(10, 20, 30), host="fuzz") for i in range(2)]


CACHE_KEYS = _cache_keys()


def _full(shape, value):
    import torch

    return torch.full(shape, value)


def _regular_files(folder: Path) -> dict[str, bytes]:
    """The folder's regular files (not following links, opening nothing else), by name."""
    import stat as stat_

    out = {}
    for item in os.scandir(folder):
        if stat_.S_ISREG(item.stat(follow_symlinks=False).st_mode):
            with open(item.path, "rb") as f:
                out[item.name] = f.read()
    return out


def run_cache_folder(folder: Path) -> str | None:
    """Every cache operation on the folder: open, list, read, look up, prune, store, remember, evict to
    nothing. The user's file must come through byte-identical; the folder is then put back as it was."""
    from ...loaders.cache.store import ConditioningCache

    before = _regular_files(folder)
    try:
        cache = ConditioningCache(folder)
        for entry in cache.entries():
            cache.read(entry)
        cache.known_fingerprint(CACHE_SIGNATURE)
        for key in CACHE_KEYS:
            cache.get(key)
        cache.others()
        cache.prune()
        cache.put(CACHE_KEYS[0], {"cond": _full((1, 2, 8), 7.0)})
        cache.remember_fingerprint("r" * 64, "e" * 64)
        cache.evict(0)
    finally:
        after = _regular_files(folder)
        for name in after.keys() - before.keys():  # what the operations wrote goes again
            os.unlink(folder / name)
        for name, data in before.items():
            if after.get(name) != data:
                (folder / name).unlink(missing_ok=True)
                (folder / name).write_bytes(data)
    if after.get(USER_FILE) != before.get(USER_FILE):
        return f"the user's file {USER_FILE} beside the cache was changed or deleted"
    return None


TE, DM, UNET, DIFF = "text_encoders", "diffusion_models", "unet", "diffusers"
DEV_PIPELINE = f"{DIFF}/flux2-dev-tiny-pipeline"
PIPELINE_FILES = ("model_index.json", "transformer/config.json", "text_encoder/config.json",
                  "transformer/diffusion_pytorch_model.safetensors.index.json",
                  *(f"transformer/diffusion_pytorch_model-0000{i}-of-00009.safetensors" for i in range(1, 10)))
DEV_DIFFUSERS = f"{DM}/flux2-dev-tiny-diffusers"
DIFFUSERS_INDEX = "diffusion_pytorch_model.safetensors.index.json"
HF_INDEX = "model.safetensors.index.json"


def target_trees(target: str, fx: Fixtures) -> list[Tree]:
    t = fx.tree
    if target == "gguf-reader":
        return [t(n, f"{UNET}/flux2-dev-tiny-{n}.gguf", run_gguf_reader) for n in ("Q4_K", "Q8_0")] + [
            t(n, f"{TE}/{n}.gguf", run_gguf_reader) for n in ("mistral3-q4_k", "cow-f16")]
    if target == "safetensors-header":
        return [t(n, f"{DM}/{n}.safetensors", run_safetensors_header)
                for n in ("flux2-dev-tiny", "flux2-dev-tiny-fp8-weight_scale")] + [
            t(n, f"{TE}/{n}.safetensors", run_safetensors_header)
            for n in ("mistral_3_small_flux2_bf16", "mistral_3_small_flux2_fp4_mixed")]
    if target == "shard-index":
        return [t("diffusers-shards", DEV_DIFFUSERS, run_shards("diffusion_pytorch_model.safetensors"),
                  mutable=(DIFFUSERS_INDEX,)),
                t("transformer-part", DEV_DIFFUSERS, run_part_files, mutable=(DIFFUSERS_INDEX,)),
                t("hf-shards", f"{TE}/hf-mistral3", run_shards("model.safetensors"), mutable=(HF_INDEX,))]
    if target == "tekken-ladder":
        plain = Tree("tekken-v3", {"tekken.json": JsonDoc(json.loads(fx.tekken))}, "", ("tekken.json",),
                     run_tekken_ladder)
        listed = Tree("tekken-v11", {"tekken.json": JsonDoc(json.loads(fx.tekken_listed))}, "", ("tekken.json",),
                      run_tekken_ladder)
        return [plain, listed]
    if target == "gguf-vocab":
        return [t("mistral3-q4_k", f"{TE}/mistral3-q4_k.gguf", run_gguf_vocab)]
    if target == "configs":
        return [t("model_index", DEV_PIPELINE, run_pipeline_class, files=("model_index.json",)),
                t("params", f"{TE}/native", run_plan_encoder, mutable=("params.json",)),
                t("standalone-config", f"{TE}/standalone", run_plan_encoder, mutable=("config.json",)),
                t("hf-config", f"{TE}/hf-mistral3", run_plan_encoder, mutable=("config.json",))]
    if target == "inspect":
        return [t("transformer", f"{DM}/flux2-dev-tiny.safetensors", run_inspect),
                t("diffusers-transformer", DEV_DIFFUSERS, run_inspect),
                t("gguf-transformer", f"{UNET}/flux2-dev-tiny-Q4_K.gguf", run_inspect),
                t("vae", "vae/flux2-ae.safetensors", run_inspect),
                t("encoder", f"{TE}/mistral_3_small_flux2_bf16.safetensors", run_inspect),
                t("gguf-encoder", f"{TE}/mistral3-q4_0.gguf", run_inspect),
                t("pipeline", DEV_PIPELINE, run_inspect, files=PIPELINE_FILES)]
    if target == "encoder":
        return [t(n, f"{TE}/{n}.safetensors", run_encoder)
                for n in ("mistral_3_small_flux2_bf16", "mistral_3_small_flux2_fp8_channel")] + [
            t(n, f"{TE}/{n}.gguf", run_encoder) for n in ("mistral3-q4_k", "cow-f16", "llama-q8_0")] + [
            t(n, f"{TE}/{n}", run_encoder) for n in ("native", "standalone", "hf-mistral3")]
    if target == "transformer":
        return [t(n, f"{DM}/{n}.safetensors", run_transformer)
                for n in ("flux2-dev-tiny", "flux2-dev-tiny-fp8-scale_weight")] + [
            t("diffusers", DEV_DIFFUSERS, run_transformer)]
    if target == "gguf-transformer":
        return [t(n, f"{UNET}/{n}.gguf", run_gguf_transformer)
                for n in ("flux2-dev-tiny-Q4_K", "flux2-dev-tiny-Q8_0", "flux2-klein-4b-tiny-Q8_0")]
    if target == "pipeline":
        return [t("dev-pipeline", DEV_PIPELINE, run_pipeline, files=PIPELINE_FILES)]
    if target == "cache-folder":
        return [fx.cache_tree()]
    if target == "prompts-file":
        prompts = JsonLines([PROMPT, "a lighthouse at dusk, 35mm", "東京の夜景", "x" * 3000, "line\u2028break"])
        return [Tree("prompts", {"prompts.jsonl": prompts}, "prompts.jsonl", ("prompts.jsonl",), run_prompts_file)]
    raise KeyError(target)


# target -> what it calls
TARGETS = {
    "gguf-reader": "loaders.formats.gguf_file.open_gguf (header, metadata, tensor table, every tensor view)",
    "safetensors-header": "loaders.formats.safetensors_file.read_header",
    "shard-index": "loaders.formats.files.shards and part_files on a sharded folder's index",
    "tekken-ladder": "tokenizers.resolve_tokenizer on a folder with tekken.json, then prompt_ids",
    "gguf-vocab": "open_gguf, then resolve_tokenizer with the GGUF's tokenizer.ggml.* metadata, then prompt_ids",
    "configs": "model_index.json (pipeline_class), params.json and config.json (plan_encoder)",
    "inspect": "loaders.models.inspect.inspect_path on each kind of model",
    "encoder": "loaders.models.encoder.load_encoder on each encoder layout, then prompt_ids",
    "transformer": "loaders.models.transformer.load_transformer (BFL file, scaled fp8, diffusers folder)",
    "gguf-transformer": "loaders.models.gguf_transformer.load_gguf_transformer",
    "pipeline": "loaders.models.pipeline.describe_pipeline and dev_encoder_folder",
    "cache-folder": "loaders.cache.store: open, list, read, get, prune, put, remember, evict "
                    "(a user's file beside)",
    "prompts-file": "loaders.formats.files.read_prompts, then prompt_ids of each prompt",
}
LADDER_TARGETS = ("tekken-ladder", "gguf-vocab", "inspect", "encoder", "prompts-file")
