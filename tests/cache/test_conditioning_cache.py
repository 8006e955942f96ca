"""The conditioning cache through the real host: a hit is bit-equal to a fresh encode, every part of the key
changed alone is a miss, damaged entries are misses that get replaced, and processes sharing a folder leave
only valid entries. The first tests use the cache module alone."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from cache_keys import key_of
from comfyui_flux2dev.loaders.cache.store import ConditioningCache, stat_signature, tensors_digest, weights_fingerprint
from helpers import cuda_param, on_device, run_flux2dev

PROMPT = "a red fox in the snow"
BF16 = "text_encoders/mistral_3_small_flux2_bf16.safetensors"


# --- the cache module alone -------------------------------------------------------------------------------

def test_entries_round_trip_and_a_foreign_or_damaged_file_is_a_miss(tmp_path):
    cache = ConditioningCache(tmp_path)
    key, other = key_of("a"), key_of("b")
    values = {"cond": torch.randn(1, 7, 12), "attention_mask": torch.ones(1, 7, dtype=torch.long)}
    path = cache.put(key, values)
    got = cache.get(key)
    assert got.keys() == values.keys() and all(torch.equal(got[k], values[k]) for k in values)
    assert cache.get(other) is None
    shutil.copyfile(path, cache.path_of(other))  # another key's file under this key's name
    assert cache.get(other) is None
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))
    assert cache.get(key) is None
    path.write_bytes(bytes(data[: len(data) // 2]))
    assert cache.get(key) is None
    assert [e.path for e in cache.entries()] == [], "a damaged file whose name is not its key's hash is no entry"


def test_eviction_drops_the_least_recently_used_first(tmp_path):
    cache = ConditioningCache(tmp_path)
    keys = [key_of(str(i)) for i in range(4)]
    for i, key in enumerate(keys):
        cache.put(key, {"cond": torch.full((1, 256), float(i))})
        os.utime(cache.path_of(key), (1000 + i, 1000 + i))
    assert cache.get(keys[0]) is not None  # a hit makes the oldest the most recent
    size = cache.entries()[0].bytes
    removed = cache.evict(2 * size)
    assert set(removed) == {cache.path_of(keys[1]), cache.path_of(keys[2])}
    assert cache.get(keys[0]) is not None and cache.get(keys[3]) is not None


def test_a_known_file_is_never_hashed_again(tmp_path):
    weights = tmp_path / "weights.safetensors"
    weights.write_bytes(b"x" * 100)
    cache = ConditioningCache(tmp_path / "cache")
    state = {"w": torch.arange(10)}
    calls = []

    def read():
        calls.append(1)
        return state

    def signature():
        return stat_signature(str(weights), [str(weights)])

    first = weights_fingerprint(cache, signature(), read)
    assert first == tensors_digest(state)
    assert weights_fingerprint(cache, signature(), read) == first and len(calls) == 1
    assert weights_fingerprint(ConditioningCache(tmp_path / "other"), signature(), read) == first and len(calls) == 1
    os.utime(weights, (1, 1))  # touched: the file may have changed
    weights_fingerprint(cache, signature(), read)
    assert len(calls) == 2


# --- through the host -------------------------------------------------------------------------------------

def _encode(clip, prompt=PROMPT):
    return clip.encode_from_tokens(clip.tokenize(prompt), return_dict=True)["cond"]


def _lazy(path, cache, device=torch.device("cpu"), **options):
    """The lazy CLIP with this cache, run on `device` by the host."""
    from comfyui_flux2dev.host.clip import lazy_clip

    clip = lazy_clip(str(path), cache=str(cache), dtype=options.pop("dtype", torch.float32), **options)
    on_device(clip.patcher, device)
    return clip


def _entries(cache) -> int:
    return len(ConditioningCache(cache).entries())


def test_a_hit_is_bit_equal_to_a_fresh_encode_and_reads_no_weights(comfy_host, encoder, tmp_path, device):
    from comfyui_flux2dev.host.clip import load_clip

    eager = load_clip(str(encoder), dtype=torch.float32)
    on_device(eager.patcher, device)
    fresh = _encode(eager)
    cache = tmp_path / "cache"
    first = _lazy(encoder, cache, device)
    assert torch.equal(_encode(first), fresh) and _entries(cache) == 1
    copy = tmp_path / "elsewhere" / "same-weights.safetensors"  # the key does not depend on the path
    copy.parent.mkdir()
    shutil.copyfile(encoder, copy)
    for path in (encoder, copy):  # a new file is fingerprinted once (a read), then served
        hit = _encode(_lazy(path, cache, device))
        assert hit.dtype == fresh.dtype and torch.equal(hit, fresh)
        assert _entries(cache) == 1
    third = _lazy(copy, cache, device)
    assert torch.equal(_encode(third), fresh) and not third.flux2dev_source.loaded


def _other_vocabulary(tiny_root, tmp_path):
    """The tiny HF folder (weights linked) with the last two ranks of its tekken.json swapped: another vocabulary."""
    folder = tmp_path / "hf-other-vocabulary"
    folder.mkdir()
    source = tiny_root / "text_encoders/hf-mistral3"
    for entry in source.iterdir():
        if entry.name != "tekken.json":
            (folder / entry.name).symlink_to(entry)
    doc = json.loads((source / "tekken.json").read_text())
    n = int(doc["config"]["default_vocab_size"]) - int(doc["config"]["default_num_special_tokens"])
    a, b = doc["vocab"][n - 2], doc["vocab"][n - 1]
    a["token_bytes"], b["token_bytes"] = b["token_bytes"], a["token_bytes"]
    (folder / "tekken.json").write_text(json.dumps(doc))
    return folder


def _rewrite_weights(path):
    """The same file with one weight changed slightly, written anew (new inode and mtime)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(path), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
        metadata = f.metadata()
    name = "model.layers.3.mlp.down_proj.weight"
    tensors[name] = (tensors[name].float() * 1.01).to(tensors[name].dtype)
    os.remove(path)
    save_file(tensors, str(path), metadata=metadata)


@pytest.mark.parametrize("part", ["weights", "padding", "dtype", "prompt", "vocabulary", cuda_param("device")])
def test_each_key_part_changed_alone_is_a_miss(comfy_host, tiny_root, encoder, tmp_path, part):
    cache = tmp_path / "cache"
    base = tiny_root / "text_encoders/hf-mistral3" if part == "vocabulary" else encoder
    before = _encode(_lazy(base, cache))
    assert _entries(cache) == 1
    assert torch.equal(_encode(_lazy(base, cache)), before) and _entries(cache) == 1  # unchanged: a hit
    path, options, prompt = base, {}, PROMPT
    if part == "device":  # the same prompt encoded on the GPU: its kernels give other numbers than the CPU's
        options = {"device": torch.device("cuda")}
    elif part == "weights":
        _rewrite_weights(encoder)
    elif part == "padding":
        options = {"padding": "comfy"}
    elif part == "dtype":
        options = {"dtype": torch.bfloat16}
    elif part == "prompt":
        prompt = "a red fox in the snow."
    else:
        path = _other_vocabulary(tiny_root, tmp_path)
    clip = _lazy(path, cache, **options)
    changed = _encode(clip, prompt)
    assert clip.flux2dev_source.loaded, "a miss reads the weights"
    assert _entries(cache) == 2
    # (bf16 weights run in float32 either way; another vocabulary may give the same ids; another device the same
    # numbers)
    if part not in ("vocabulary", "dtype", "device"):
        assert not (changed.shape == before.shape and torch.equal(changed.to(before.dtype), before))


@pytest.mark.parametrize("strength", [0.5, 1.0])
def test_a_patched_clip_bypasses_the_cache(comfy_host, encoder, tmp_path, strength, caplog):
    cache = tmp_path / "cache"
    clip = _lazy(encoder, cache)
    plain = _encode(clip)
    layer_name = "mistral3_24b.transformer.model.layers.5.self_attn.q_proj"
    layer = clip.cond_stage_model.get_submodule(layer_name)
    g = torch.Generator().manual_seed(2)
    prefix = f"text_encoders.{layer_name}"
    lora = {f"{prefix}.lora_up.weight": torch.randn(layer.out_features, 4, generator=g) * 0.5,
            f"{prefix}.lora_down.weight": torch.randn(4, layer.in_features, generator=g) * 0.5,
            f"{prefix}.alpha": torch.tensor(4.0)}
    _, patched = comfy_host.load_lora_for_models(None, clip, lora, 0.0, strength)
    with caplog.at_level("INFO"):
        with_lora = _encode(patched)
    assert "conditioning cache bypassed" in caplog.text and "LoRA" in caplog.text
    assert not torch.equal(with_lora, plain) and _entries(cache) == 1
    _, other = comfy_host.load_lora_for_models(None, clip, lora, 0.0, strength / 2)
    assert not torch.equal(_encode(other), with_lora)
    assert torch.equal(_encode(clip), plain), "the unpatched CLIP still hits its own entry"


@pytest.mark.parametrize("damage", ["truncated", "corrupted"])
def test_a_damaged_entry_is_a_miss_and_is_replaced(comfy_host, encoder, tmp_path, damage):
    cache = tmp_path / "cache"
    fresh = _encode(_lazy(encoder, cache))
    (entry,) = ConditioningCache(cache).entries()
    data = bytearray(entry.path.read_bytes())
    if damage == "truncated":
        data = data[: len(data) - 1000]
    else:
        data[-1000] ^= 0x40  # one bit of one value
    entry.path.write_bytes(bytes(data))
    clip = _lazy(encoder, cache)
    assert torch.equal(_encode(clip), fresh)
    assert clip.flux2dev_source.loaded, "the damaged entry was not served"
    (entry,) = ConditioningCache(cache).entries()
    assert torch.equal(ConditioningCache(cache).read(entry)["cond"], fresh)


FILL = """
import sys, torch
from comfyui_flux2dev.host.clip import lazy_clip
clip = lazy_clip(sys.argv[1], cache=sys.argv[2], dtype=torch.float32)
for prompt in sys.argv[3:]:
    clip.encode_from_tokens(clip.tokenize(prompt), return_dict=True)
"""


@pytest.mark.one_host  # the cache's files under two writers; the host's encode is checked on every host
def test_two_processes_filling_one_cache_leave_only_valid_entries(comfy_host, encoder, tmp_path):
    cache = tmp_path / "cache"
    prompts = [f"prompt number {i}" for i in range(6)]
    env = dict(os.environ)  # the host's own needs may be on PYTHONPATH (tests/run puts them there)
    runs = [subprocess.Popen([sys.executable, "-P", "-c", FILL, str(encoder), str(cache), *order], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for order in (prompts, prompts[::-1])]
    for run in runs:
        out, _ = run.communicate(timeout=600)
        assert run.returncode == 0, out[-3000:]
    store = ConditioningCache(cache)
    entries = store.entries()
    assert len(entries) == len(prompts)
    assert not list(cache.glob(".*.tmp"))
    for entry in entries:
        assert store.read(entry) is not None
    clip = _lazy(encoder, cache)
    for prompt in prompts:
        cached = _encode(clip, prompt)
        assert not clip.flux2dev_source.loaded
        assert torch.isfinite(cached).all()


def test_tokens_are_part_of_the_key_through_the_template(comfy_host, encoder, tmp_path):
    """The stored key holds the token ids the template and padding produced, and the vocabulary's digest."""
    cache = tmp_path / "cache"
    clip = _lazy(encoder, cache)
    _encode(clip)
    key = json.loads(ConditioningCache(cache).entries()[0].key_json)
    ids = [pair[0] for pair in clip.tokenize(PROMPT)["mistral3_24b"][0]]
    assert [t[0] for t in key["tokens"][0]] == ids
    assert key["vocabulary"] == clip.flux2dev_source.tokenizer.tokenizer.vocab_digest
    assert key["padding"] == "reference" and key["layers"] == [10, 20, 30]


def test_the_command_fills_a_cache_the_node_then_hits_and_lists_and_prunes_it(comfy_host, encoder, tmp_path):
    """`flux2dev encode --prompts --cache` fills with the node's defaults (dtype as stored), resumes, and
    `flux2dev cache` lists and prunes; the CLIP the node builds then serves every prompt from the cache."""
    from comfyui_flux2dev.host.clip import lazy_clip, load_clip

    cache = tmp_path / "cache"
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('"a red fox"\n"a lighthouse"\n')
    out = run_flux2dev("encode", str(encoder), "--prompts", str(prompts), "--cache", str(cache))
    assert out.returncode == 0, out.stderr
    assert "2 encoded" in out.stdout and "2/2 prompts" in out.stderr
    prompts.write_text('"a red fox"\n"a lighthouse"\n"three cats"\n')
    out = run_flux2dev("encode", str(encoder), "--prompts", str(prompts), "--cache", str(cache))
    assert out.returncode == 0 and "1 encoded" in out.stdout, out.stderr
    clip = lazy_clip(str(encoder), cache=str(cache))  # as the node builds it
    fresh = load_clip(str(encoder))
    for prompt in ("a red fox", "a lighthouse", "three cats"):
        assert torch.equal(_encode(clip, prompt), _encode(fresh, prompt))
    assert not clip.flux2dev_source.loaded

    listed = json.loads(run_flux2dev("cache", str(cache), "--json").stdout)["entries"]
    assert len(listed) == 3 and {e["padding"] for e in listed} == {"reference"}
    damaged = ConditioningCache(cache).entries()[0].path
    damaged.write_bytes(damaged.read_bytes()[:-10])
    pruned = json.loads(run_flux2dev("cache", str(cache), "--prune", "--json").stdout)
    assert pruned["removed"] == [damaged.name] and len(pruned["entries"]) == 2
    one = pruned["entries"][0]["bytes"]
    kept = json.loads(run_flux2dev("cache", str(cache), "--max-size", str(one), "--json").stdout)
    assert len(kept["entries"]) == 1
    refused = run_flux2dev("encode", str(encoder), "--prompts", str(prompts))
    assert refused.returncode == 2 and "--cache DIR" in refused.stderr and "Traceback" not in refused.stderr
