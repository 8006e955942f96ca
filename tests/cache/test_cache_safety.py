"""The conditioning cache never deletes, overwrites or blocks on what it does not own, and the command line
reads prompts files and sizes safely. Each test reproduces a finding of the hostile-input campaign against
the cache (each failed before the hardening): foreign files beside entries stay byte-identical, links
planted at every name the cache writes are never written through, FIFOs and /dev/zero end at once,
read-only and full caches serve hits, and special files stop no eviction."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from cache_keys import key_of
from comfyui_flux2dev.errors import CacheError, CorruptFileError
from comfyui_flux2dev.loaders.cache import store as cc
from comfyui_flux2dev.loaders.cache.store import TAG, ConditioningCache
from helpers import DATA, flux2dev_here, restricted, run_flux2dev, run_python, time_bound

ENTRY_BYTES = 4096  # about what one small entry below takes


def _tensors(value: float = 1.0) -> dict:
    return {"cond": torch.full((1, 4, 128), value)}


def _snapshot(folder: Path) -> dict[str, bytes]:
    """Every regular file below `folder` (links not followed), by relative name."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file() and not p.is_symlink()}


def _model_file(path: Path, size: int = 10_000) -> bytes:
    """A stand-in for a user's model file: a real safetensors file with no cache metadata."""
    save_file({"w": torch.arange(size // 4, dtype=torch.float32)}, str(path), metadata={"format": "pt"})
    return path.read_bytes()


@pytest.fixture
def cache_dir(tmp_path) -> Path:
    return tmp_path / "cache"


@pytest.fixture(autouse=True)
def _fresh_process_state():
    """What the cache keeps per process (fingerprints, warnings given, unwritable folders), empty per test."""
    for state in (cc._KNOWN_FINGERPRINTS, cc._WARNED, cc._UNWRITABLE):
        state.clear()


# --- ownership: only what the cache proves it wrote is ever deleted ----------------------------------------


def test_a_models_folder_is_refused_as_a_cache_and_left_byte_identical(tmp_path):
    models = tmp_path / "diffusion_models"
    models.mkdir()
    _model_file(models / "flux2-dev.safetensors", 100_000)
    _model_file(models / ("a" * 64 + ".safetensors"))  # even one named like an entry
    before = _snapshot(models)
    with pytest.raises(CacheError) as refused:
        ConditioningCache(models, max_bytes=1)
    assert "did not write" in str(refused.value) and "flux2-dev.safetensors" in str(refused.value)
    assert _snapshot(models) == before


def test_eviction_deletes_only_entries_whose_name_is_the_hash_of_their_stored_key(cache_dir):
    cache = ConditioningCache(cache_dir)
    keys = [key_of(str(i)) for i in range(3)]
    for k in keys:
        cache.put(k, _tensors())
    assert (cache_dir / TAG).is_file(), "the cache marks its folder as its own"
    # Beside the entries, in the cache's own (tagged) folder: files it did not write.
    foreign = {
        "b" * 64 + ".safetensors": None,  # named like an entry, no key inside
        "c" * 64 + ".safetensors": cache.path_of(keys[0]),  # a real entry under a name that is not its key's hash
        "notes.safetensors": None,
        "README.txt": None,
    }
    for name, source in foreign.items():
        if source is not None:
            shutil.copyfile(source, cache_dir / name)
        elif name.endswith(".safetensors"):
            _model_file(cache_dir / name)
        else:
            (cache_dir / name).write_text("mine")
    before = {name: (cache_dir / name).read_bytes() for name in foreign}
    reopened = ConditioningCache(cache_dir)  # a tagged folder may hold other files
    assert {p.name for p in reopened.evict(0)} == {reopened.path_of(k).name for k in keys}
    assert {name: (cache_dir / name).read_bytes() for name in foreign} == before
    assert reopened.others() == sorted(foreign)


def test_an_untagged_folder_of_cache_files_is_adopted(cache_dir):
    cache = ConditioningCache(cache_dir)
    cache.put(key_of("a"), _tensors())
    (cache_dir / TAG).unlink()  # a cache written before the tag existed
    ConditioningCache(cache_dir).put(key_of("b"), _tensors())
    assert (cache_dir / TAG).read_bytes().startswith(cc.TAG_SIGNATURE)


def test_relative_cache_names_stay_inside_the_user_folder(comfy_host, tmp_path):
    import folder_paths

    from comfyui_flux2dev.host.clip_cache import cache_folder

    user = Path(folder_paths.get_user_directory()).resolve()
    assert Path(cache_folder("my cache")).resolve() == user / "my cache"
    assert Path(cache_folder("a/../b")).resolve() == user / "b"
    for climbing in ("..", "../models/diffusion_models", "a/../../x"):
        with pytest.raises(CacheError, match="leads out of ComfyUI's user folder"):
            cache_folder(climbing)
    assert cache_folder(str(tmp_path / "anywhere")) == str(tmp_path / "anywhere")  # absolute: anywhere


@pytest.mark.parametrize("size", ["-5", "infG", "nanM", "0", "-1G", "1e3", "20 GB", "G", "", "0.0001"])
def test_max_size_refuses_what_is_not_a_positive_size_and_deletes_nothing(cache_dir, size):
    ConditioningCache(cache_dir).put(key_of("a"), _tensors())
    before = _snapshot(cache_dir)
    out = flux2dev_here("cache", str(cache_dir), "--prune", f"--max-size={size}")
    assert out.returncode == 2 and "is not a size" in out.stderr and "unexpectedly" not in out.stderr, out.stderr
    assert _snapshot(cache_dir) == before


@pytest.mark.parametrize("size, kept", [("1T", 2), ("1.5K", 0), (str(10**6), 2), ("20g", 2)])
def test_max_size_takes_a_number_with_an_optional_binary_unit(cache_dir, size, kept):
    cache = ConditioningCache(cache_dir)
    for k in (key_of("a"), key_of("b")):
        cache.put(k, _tensors())
    out = flux2dev_here("cache", str(cache_dir), f"--max-size={size}", "--json")
    assert out.returncode == 0, out.stderr
    assert len(json.loads(out.stdout)["entries"]) == kept


def test_the_command_refuses_a_models_folder_and_changes_nothing(tmp_path):
    models = tmp_path / "text_encoders"
    models.mkdir()
    _model_file(models / "mistral_3_small_flux2_bf16.safetensors")
    before = _snapshot(models)
    out = flux2dev_here("cache", str(models), "--prune", "--max-size", "1")
    assert out.returncode == 2 and "did not write" in out.stderr
    assert _snapshot(models) == before


# --- writes: fresh names, exclusive create, never through a link --------------------------------------------


@pytest.mark.parametrize("dangling", [False, True], ids=["links-to-files", "dangling-links"])
def test_links_planted_at_every_name_the_cache_writes_are_never_written_through(cache_dir, tmp_path, dangling):
    """Links at the names the cache writes in a tagged folder (an entry, the fingerprint index, the lock, and
    a temporary name of the index one could predict from the process id); a dangling one would make its target
    if opened with O_CREAT."""
    victims = tmp_path / "victims"
    victims.mkdir()
    cache = ConditioningCache(cache_dir)
    cache.put(key_of("other"), _tensors())  # the folder exists, tagged
    key = key_of("a")
    names = [cache.path_of(key).name, cc.FINGERPRINTS, cc.LOCK_FILE, f".{cc.FINGERPRINTS}.{os.getpid()}.tmp"]
    cache_dir.joinpath(cc.LOCK_FILE).unlink()
    for i, name in enumerate(names):
        target = victims / f"{i}.txt"
        if not dangling:
            target.write_text(f"user data {i}")
        (cache_dir / name).symlink_to(target)
    before = _snapshot(victims)
    cache = ConditioningCache(cache_dir)
    cache.put(key, _tensors())
    cache.remember_fingerprint("signature", "fingerprint")
    cache.evict(0)
    assert _snapshot(victims) == before, "a file outside the cache was written, made or removed"
    for name in names[:2]:  # replaced by the cache's own regular files, never written through
        assert not (cache_dir / name).is_symlink()
    assert (cache_dir / cc.LOCK_FILE).is_symlink(), "a link at the lock's name is left alone"
    cc._KNOWN_FINGERPRINTS.clear()
    assert ConditioningCache(cache_dir).known_fingerprint("signature") == "fingerprint"


def test_a_link_at_the_tag_of_a_folder_of_cache_files_is_replaced(cache_dir, tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("user data")
    cache = ConditioningCache(cache_dir)
    cache.put(key_of("a"), _tensors())
    (cache_dir / TAG).unlink()
    (cache_dir / TAG).symlink_to(victim)
    ConditioningCache(cache_dir).put(key_of("b"), _tensors())
    assert victim.read_text() == "user data" and not (cache_dir / TAG).is_symlink()


def test_an_entry_name_held_by_a_link_or_a_folder_is_a_miss_and_is_replaced_or_skipped(cache_dir, tmp_path):
    cache = ConditioningCache(cache_dir)
    key = key_of("a")
    cache.put(key, _tensors(2.0))
    good = cache.path_of(key).read_bytes()
    elsewhere = tmp_path / "elsewhere.safetensors"
    elsewhere.write_bytes(good)
    cache.path_of(key).unlink()
    cache.path_of(key).symlink_to(elsewhere)  # a valid entry, but through a link: not read
    assert cache.get(key) is None and cache.entries() == []
    cache.put(key, _tensors(2.0))
    assert not cache.path_of(key).is_symlink() and elsewhere.read_bytes() == good
    other = key_of("b")
    cache.path_of(other).mkdir()  # a folder where an entry would go: the store is skipped
    assert cache.put(other, _tensors()) is None and cache.get(other) is None and cache.path_of(other).is_dir()


# --- reads: regular files only, bounded, never blocking ------------------------------------------------------


def _special(path: Path, kind: str, tmp_path: Path) -> None:
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "folder":
        path.mkdir()
    elif kind == "zero":
        path.symlink_to("/dev/zero")
    elif kind == "loop":
        path.symlink_to(path.name)
    else:
        path.symlink_to(tmp_path / "nowhere")


SPECIAL = ["fifo", "folder", "zero", "loop", "dangling"]


@pytest.mark.parametrize("kind", SPECIAL)
def test_a_special_fingerprint_index_is_absent_and_never_blocks(cache_dir, tmp_path, kind):
    cache_dir.mkdir()
    _special(cache_dir / cc.FINGERPRINTS, kind, tmp_path)
    cache = ConditioningCache(cache_dir)
    with time_bound(5):
        assert cache.known_fingerprint("signature") is None
        cache.remember_fingerprint("signature", "fingerprint")  # replaced, or (a folder) kept in memory
    assert cache.known_fingerprint("signature") == "fingerprint"


@pytest.mark.parametrize("kind", SPECIAL)
@pytest.mark.parametrize("name", ["entry", cc.LOCK_FILE, TAG])
def test_special_files_at_the_cache_names_stop_no_eviction(cache_dir, tmp_path, kind, name):
    cache = ConditioningCache(cache_dir)
    keys = [key_of(str(i)) for i in range(3)]
    for k in keys:
        cache.put(k, _tensors())
    target = cache_dir / ("d" * 64 + ".safetensors" if name == "entry" else name)
    if target.exists():
        target.unlink()
    _special(target, kind, tmp_path)
    with time_bound(15):
        reopened = ConditioningCache(cache_dir)
        assert len(reopened.entries()) == 3
        assert {p.name for p in reopened.evict(0)} == {reopened.path_of(k).name for k in keys}
        reopened.put(key_of("new"), _tensors())
        assert reopened.get(key_of("new")) is not None
        out = flux2dev_here("cache", str(cache_dir), "--prune", "--json")
    assert out.returncode == 0, out.stderr
    assert len(json.loads(out.stdout)["entries"]) == 1


def test_a_lock_held_by_another_process_delays_the_cache_a_bounded_time(cache_dir, monkeypatch):
    cache = ConditioningCache(cache_dir)
    cache.put(key_of("a"), _tensors())
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import fcntl, os, sys, time
        fd = os.open({str(cache_dir / cc.LOCK_FILE)!r}, os.O_RDWR)
        fcntl.flock(fd, fcntl.LOCK_EX)
        print("held", flush=True)
        time.sleep(600)
    """)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        monkeypatch.setattr(cc, "LOCK_WAIT_S", 0.5)
        with time_bound(10):
            assert cache.evict(0) == [], "eviction is skipped while another process holds the lock"
            cache.remember_fingerprint("s", "f")  # the index waits; memory has it
            assert cache.get(key_of("a")) is not None
        assert cache.known_fingerprint("s") == "f"
    finally:
        holder.kill()
        holder.wait()
    assert len(cache.evict(0)) == 1


def test_a_killed_writers_temporary_file_counts_toward_the_limit_until_the_next_eviction(cache_dir):
    cache = ConditioningCache(cache_dir)
    cache.put(key_of("a"), _tensors())
    writer = subprocess.Popen([sys.executable, "-P", "-c", textwrap.dedent(f"""
        import os, sys, time
        from pathlib import Path
        from comfyui_flux2dev.loaders.cache import store as cc
        fd, temp = cc._fresh(Path({str(cache_dir)!r}), "e" * 64)
        os.write(fd, b"x" * 1_000_000)
        print(temp, flush=True)
        time.sleep(600)
    """)], stdout=subprocess.PIPE, text=True)
    try:
        temp = Path(writer.stdout.readline().strip())
        size = cache.entries()[0].bytes
        assert cache.evict(1_000_000 + size + 10) == [] and temp.exists(), "a live writer's file stays"
        assert [p.name for p in cache.evict(1_000_000 + size // 2)] == [cache.path_of(key_of("a")).name], \
            "the live writer's bytes count toward the limit"
    finally:
        writer.send_signal(signal.SIGKILL)  # dies mid-write, as under kill -9
        writer.wait()
    assert cache.evict() == [temp] and not temp.exists()


# --- read-only and full caches serve hits ---------------------------------------------------------------------

READER = """
import json, logging, sys, torch
logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
from comfyui_flux2dev.host.clip import lazy_clip
from comfyui_flux2dev.loaders.cache.store import ConditioningCache
encoder, cache = ENCODER, CACHE
clip = lazy_clip(encoder, cache=cache, dtype=torch.float32)
out = {}
for prompt in ("a red fox", "three cats", "three cats"):
    cond = clip.encode_from_tokens(clip.tokenize(prompt), return_dict=True)["cond"]
    out.setdefault(prompt, []).append([cond.sum().item(), clip.flux2dev_source.loaded])
out["entries"] = len(ConditioningCache(cache).entries())
print(json.dumps(out))
"""


@pytest.mark.one_host  # the cache's files are the pack's; the host only encodes, as in every encoder test
@pytest.mark.parametrize("how", ["read-only", "full"])
@pytest.mark.parametrize("same_file", [True, False], ids=["same-encoder-file", "a-copy-of-the-encoder"])
def test_a_read_only_or_full_cache_serves_hits_and_skips_stores_with_one_warning(comfy_host, encoder, tmp_path,
                                                                                 how, same_file):
    from comfyui_flux2dev.host.clip import lazy_clip

    cache = tmp_path / "cache"
    filler = lazy_clip(str(encoder), cache=str(cache), dtype=torch.float32)
    fox = filler.encode_from_tokens(filler.tokenize("a red fox"), return_dict=True)["cond"]
    reader = encoder if same_file else tmp_path / "copy" / "encoder.safetensors"  # a new inode: fingerprinted again
    if not same_file:
        reader.parent.mkdir()
        shutil.copyfile(encoder, reader)
    before = _snapshot(cache)
    script = READER.replace("ENCODER", repr(str(reader))).replace("CACHE", repr(str(cache)))
    done = restricted(script, cache, how, dict(os.environ))
    assert done.returncode == 0, done.stderr[-4000:]
    out = json.loads(done.stdout.splitlines()[-1])
    assert out["a red fox"] == [[fox.sum().item(), not same_file]], "the cached prompt is served"
    assert out["entries"] == 1 and _snapshot(cache) == before
    warnings = [line for line in done.stderr.splitlines() if "conditioning cache:" in line]
    assert len(warnings) == 1 and ("read-only" in warnings[0] or "could not store" in warnings[0]), done.stderr[-3000:]
    assert out["three cats"][0] == out["three cats"][1], "an uncached prompt is encoded, each time the same"


# --- prompts files -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tekken_folder(tmp_path_factory):
    from comfyui_flux2dev import tokenizers

    folder = tmp_path_factory.mktemp("tekken")
    shutil.copyfile(tokenizers.bundled_tekken_path(), folder / "tekken.json")
    return folder


BAD_PROMPTS = {
    "not json": (b'"a red fox"\nnot json\n', "line 2 is not valid JSON"),
    "bad utf-8": (b'"a red fox"\n"caf\xe9"\n', "line 2 is not UTF-8"),
    "a number": (b'"a"\n\n5\n', "line 3 holds 5, not a JSON string"),
    "an object": (b'{"prompt": "a red fox"}\n', "line 1 holds an object"),
    "deep": (b"[" * 100 + b"]" * 100 + b"\n", "line 1 nests deeper"),
    "lone surrogate": (b'"a \\ud800 fox"\n', "line 1: character 3 of the prompt is a lone surrogate"),
    "huge line": (b'"' + b"x" * (2 << 20) + b'"\n', "line 1 is"),
    "empty": (b"\n\n", "holds no prompt"),
}


@pytest.mark.parametrize("case", sorted(BAD_PROMPTS))
def test_a_bad_prompts_file_is_refused_with_its_line_number(tekken_folder, tmp_path, case):
    data, message = BAD_PROMPTS[case]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_bytes(data)
    out = flux2dev_here("tokenize", str(tekken_folder), "--prompts", str(prompts))
    assert out.returncode == 2 and message in out.stderr, out.stderr
    assert "unexpectedly" not in out.stderr


@pytest.mark.parametrize("kind", ["fifo", "zero", "folder"])
def test_a_prompts_file_that_is_no_regular_file_is_refused_at_once(tekken_folder, tmp_path, kind):
    prompts = tmp_path / "prompts.jsonl"
    _special(prompts, kind, tmp_path)
    out = run_flux2dev("tokenize", str(tekken_folder), "--prompts", str(prompts))
    assert out.returncode == 2 and ("not a regular file" in out.stderr or "is a folder" in out.stderr), out.stderr


def test_prompts_files_split_on_newlines_alone_with_a_byte_order_mark_allowed(tekken_folder, tmp_path):
    from comfyui_flux2dev.loaders.formats.files import read_prompts

    prompts = tmp_path / "prompts.jsonl"
    lines = ["a red fox", "a line\u2028separator and a\u2029paragraph one", "tabs\tand\x0bvertical", "crlf line"]
    prompts.write_bytes(b"\xef\xbb\xbf" + "\n".join(json.dumps(p, ensure_ascii=False) for p in lines[:3]).encode()
                        + b"\n" + json.dumps(lines[3]).encode() + b"\r\n\n")
    assert read_prompts(prompts) == lines
    out = flux2dev_here("tokenize", str(tekken_folder), "--prompts", str(prompts), "--json")
    assert out.returncode == 0, out.stderr
    assert len(out.stdout.splitlines()) == 4


def test_a_long_prompt_is_tokenized_only_as_far_as_the_template_uses_and_gives_the_same_ids(tekken_folder):
    """The reference template keeps 512 tokens: the ids of a prompt cut where the tokenizer proves the cut
    changes nothing equal the whole prompt's, for texts built to break a naive cut (special strings, runs of
    spaces and newlines, long words, every script of the corpus) at every length around the cut."""
    import random

    from comfyui_flux2dev import tokenizers
    from comfyui_flux2dev.tokenizers.prompt import prompt_ids

    tokenizer = tokenizers.resolve_tokenizer([tekken_folder]).tokenizer
    system = tokenizer.encode(tokenizers.SYSTEM_PROMPT)
    corpus = [json.loads(line) for line in (DATA / "prompts.jsonl").read_text().splitlines() if line.strip()]
    pieces = ["[INST]", "[/INST]", "<s>", "<pad>", "[SYSTEM_PROMPT]", "<SPECIAL_10>", "<SPECIAL_1>", "[IMG]", "'s",
              "123456"]
    rng = random.Random(0)
    for trial in range(120):
        parts = []
        while sum(map(len, parts)) < rng.choice((600, 3000, 12000, 50000)):
            r = rng.random()
            parts.append(rng.choice(corpus) if r < 0.6 else rng.choice(pieces) if r < 0.75 else
                         " " * rng.randint(1, 40) if r < 0.85 else "\n" * rng.randint(1, 5) if r < 0.9 else
                         rng.choice("xé中") * rng.randint(1, 3000))
        text = "".join(parts)
        whole = tokenizer.encode(text)
        for limit in (1, 7, 100, 479):
            assert tokenizer.encode(text, limit=limit) == whole[:limit], (trial, limit)
        ids, mask = prompt_ids(tokenizer, text, "reference")
        kept = [1, 17, *system, 18, 3, *tokenizer.encode(text.replace("[IMG]", "")), 4][:512]
        assert ids == [11] * (512 - len(kept)) + kept and sum(mask) == len(kept), trial
    huge = " ".join(corpus) * 4000  # tens of megabytes
    with time_bound(60):
        assert tokenizer.encode(huge, limit=479) == tokenizer.encode(huge[:200_000])[:479]


# --- trust boundary --------------------------------------------------------------------------------------------


def test_with_a_secret_entries_sealed_without_it_are_misses(cache_dir, monkeypatch):
    plain = ConditioningCache(cache_dir)
    key = key_of("a")
    plain.put(key, _tensors(3.0))
    monkeypatch.setenv(cc.SECRET_ENV, "s3cret")
    assert plain.get(key) is None, "an unkeyed checksum is not the secret's"
    plain.put(key, _tensors(3.0))
    assert torch.equal(plain.get(key)["cond"], _tensors(3.0)["cond"])
    monkeypatch.setenv(cc.SECRET_ENV, "another")
    assert plain.get(key) is None
    assert [p.name for p in plain.prune()] == [plain.path_of(key).name], "prune drops what fails the secret's seal"


def test_another_prompts_tensors_under_a_keys_name_are_a_miss(cache_dir):
    """The seal binds key and tensors: a valid entry's tensors re-stored under another key, with its old
    checksum, are refused (an attacker's swap of two prompts' conditionings)."""
    from safetensors import safe_open

    cache = ConditioningCache(cache_dir)
    a, b = key_of("a"), key_of("b")
    cache.put(a, _tensors(1.0))
    with safe_open(str(cache.path_of(a)), "pt") as f:
        metadata = f.metadata()
    save_file(_tensors(1.0), str(cache.path_of(b)), metadata={**metadata, "flux2dev_key": b.to_json()})
    assert cache.get(b) is None


def test_with_a_secret_an_unsealed_fingerprint_index_is_ignored(cache_dir, monkeypatch):
    cache = ConditioningCache(cache_dir)
    cache.remember_fingerprint("sig", "fp")
    cc._KNOWN_FINGERPRINTS.clear()
    assert cache.known_fingerprint("sig") == "fp"
    monkeypatch.setenv(cc.SECRET_ENV, "s3cret")
    assert cache.known_fingerprint("sig") is None
    cache.remember_fingerprint("sig2", "fp2")
    cc._KNOWN_FINGERPRINTS.clear()
    assert cache.known_fingerprint("sig2") == "fp2"


@pytest.mark.skipif(os.name != "posix", reason="POSIX permissions")
def test_a_folder_other_users_can_write_is_warned_about_once(cache_dir, caplog, monkeypatch):
    cache_dir.mkdir()
    cache_dir.chmod(0o777)
    cc._WARNED.clear()
    with caplog.at_level(logging.WARNING):
        ConditioningCache(cache_dir)
        ConditioningCache(cache_dir)
    assert caplog.text.count("can be written by other users") == 1 and cc.SECRET_ENV in caplog.text
    caplog.clear()
    cc._WARNED.clear()
    monkeypatch.setenv(cc.SECRET_ENV, "s3cret")
    with caplog.at_level(logging.WARNING):
        ConditioningCache(cache_dir)
    assert "other users" not in caplog.text


# --- stored keys, settings files, the weights walk ------------------------------------------------------------------


def test_listing_survives_stored_keys_of_the_wrong_types(cache_dir):
    cache = ConditioningCache(cache_dir)
    cache.put(key_of("a"), _tensors())
    for odd in ({"kind": "conditioning", "tokens": 5, "padding": ["x"]}, {"tokens": [[1], 7]}, [1, 2]):
        text = json.dumps(odd)
        save_file(_tensors(), str(cache_dir / (hashlib.sha256(text.encode()).hexdigest() + ".safetensors")),
                  metadata={"flux2dev_key": text, "flux2dev_checksum": "x"})
    out = flux2dev_here("cache", str(cache_dir), "--json")
    assert out.returncode == 0, out.stderr
    rows = json.loads(out.stdout)["entries"]
    assert len(rows) == 4 and sorted(r["tokens"] is None for r in rows) == [False, True, True, True]


def test_a_400_digit_integer_in_a_config_is_the_packs_error(tiny_root, tmp_path):
    from comfyui_flux2dev.loaders.models.encoder import plan_encoder

    folder = tmp_path / "standalone"
    shutil.copytree(tiny_root / "text_encoders/standalone", folder)
    config = json.loads((folder / "config.json").read_text())
    config["text_config"]["rope_theta"] = "HUGE"
    (folder / "config.json").write_text(json.dumps(config).replace('"HUGE"', "1" + "0" * 400))
    with pytest.raises(CorruptFileError, match="rope_theta is 1000"):
        plan_encoder(str(folder))


def test_a_dangling_link_beside_the_encoder_breaks_no_cached_encode(comfy_host, tiny_root, tmp_path):
    from comfyui_flux2dev.host.clip import lazy_clip

    folder = tmp_path / "hf"
    shutil.copytree(tiny_root / "text_encoders/hf-mistral3", folder)
    (folder / "extras").mkdir()
    (folder / "extras" / "gone.safetensors").symlink_to(tmp_path / "missing.safetensors")
    (folder / "notes.gguf").symlink_to(tmp_path / "missing.gguf")
    cache = tmp_path / "cache"
    first = lazy_clip(str(folder), cache=str(cache), dtype=torch.float32)
    fresh = first.encode_from_tokens(first.tokenize("a red fox"), return_dict=True)["cond"]
    cc._KNOWN_FINGERPRINTS.clear()
    again = lazy_clip(str(folder), cache=str(cache), dtype=torch.float32)
    assert torch.equal(again.encode_from_tokens(again.tokenize("a red fox"), return_dict=True)["cond"], fresh)
    assert not again.flux2dev_source.loaded, "a hit, fingerprint from the folder's index"


def test_the_fingerprint_covers_the_files_the_encoder_reads_and_no_others(comfy_host, tiny_root, tmp_path):
    from comfyui_flux2dev.host.clip_weights import plan_signature as _signature
    from comfyui_flux2dev.loaders.models.encoder import plan_encoder

    folder = tmp_path / "hf"
    shutil.copytree(tiny_root / "text_encoders/hf-mistral3", folder)
    before = _signature(plan_encoder(str(folder)))
    _model_file(folder / "unrelated.safetensors")  # not in the index: never read
    (folder / "README.md").write_text("notes")
    assert _signature(plan_encoder(str(folder))) == before
    shard = sorted(folder.glob("model-*.safetensors"))[0]
    os.utime(shard, (1, 1))
    assert _signature(plan_encoder(str(folder))) != before


# --- the command line refuses a bad file before importing torch ------------------------------------------------------


@pytest.mark.parametrize("name, content", [("bad.safetensors", b"12345678"),
                                           ("bad.gguf", b"GGUF\x03\x00\x00\x00" + b"\xff" * 16),
                                           ("short.gguf", b"GGUF"), ("fifo.safetensors", None)])
def test_a_bad_file_is_refused_before_torch_or_the_host_is_imported(tmp_path, name, content):
    path = tmp_path / name
    if content is None:
        os.mkfifo(path)
    else:
        path.write_bytes(content)
    probe = textwrap.dedent(f"""
        import sys
        from comfyui_flux2dev import cli
        status = cli.main(["inspect", {str(path)!r}])
        heavy = sorted(m for m in ("torch", "gguf", "comfy", "transformers", "safetensors.torch") if m in sys.modules)
        print(status, heavy)
    """)
    out = run_python(probe, timeout=60)
    assert out.stdout.strip() == "2 []", (out.stdout, out.stderr)
    assert out.stderr.startswith("flux2dev inspect: ") and "unexpectedly" not in out.stderr
