"""Hostile vocabularies and tokenizer folders: tekken.json and GGUF vocabularies are checked field
by field before anything is built from them, the build stays linear in the vocabulary, a panic of the
tokenizers library ends as a failed rung of the ladder (never a crash), and no tokenizer file runs code."""

from __future__ import annotations

import base64
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from comfyui_flux2dev.errors import CorruptFileError, WrongModelError
from comfyui_flux2dev.tokenizers import bundled_tekken_path, parse_tekken_json, resolve_tokenizer, vocab_from_gguf
from comfyui_flux2dev.tokenizers.vocab import MAX_TOKEN_BYTES, V3_SPECIAL_TOKENS, TekkenVocab

BYTES = [bytes([b]) for b in range(256)]


def _tekken(ranks: list[bytes], n_special: int = 1000, **config) -> dict:
    """A v3 tekken document (no special_tokens list) over `ranks`."""
    return {
        "config": {"default_num_special_tokens": n_special, "default_vocab_size": n_special + len(ranks),
                   "version": "v3", **config},
        "vocab": [{"rank": i, "token_bytes": base64.b64encode(t).decode(), "token_str": None}
                  for i, t in enumerate(ranks)],
    }


def _refused(doc, *words: str, error=CorruptFileError) -> str:
    with pytest.raises(error) as caught:
        parse_tekken_json(json.dumps(doc), "hostile/tekken.json")
    message = str(caught.value)
    assert all(w in message for w in words), message
    return message


def test_small_tekken_reads():
    vocab = parse_tekken_json(json.dumps(_tekken(BYTES)))
    assert len(vocab.specials) == 1000 and vocab.ranks == tuple(BYTES) and vocab.specials[17] == "[SYSTEM_PROMPT]"


def _with(doc: dict, path: tuple, value) -> dict:
    doc = json.loads(json.dumps(doc))
    target = doc
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    return doc


GOOD = _tekken(BYTES)
LISTED = {**GOOD, "special_tokens": [{"rank": i, "token_str": s, "is_control": True}
                                    for i, s in enumerate(V3_SPECIAL_TOKENS)]}

# name -> (document, words of the message)
HOSTILE_TEKKEN = {
    "not an object": ([1, 2], ("hostile/tekken.json", "expected a JSON object")),
    "config a list": (_with(GOOD, ("config",), []), ("config", "expected an object")),
    "10**7 specials": (_with(GOOD, ("config", "default_num_special_tokens"), 10**7),
                       ("default_num_special_tokens", "10000000")),
    "specials a string": (_with(GOOD, ("config", "default_num_special_tokens"), "1000"),
                          ("default_num_special_tokens", "expected an integer")),
    "vocab size below the specials": (_with(GOOD, ("config", "default_vocab_size"), 1000),
                                      ("default_vocab_size", "no room")),
    "vocab size a float": (_with(GOOD, ("config", "default_vocab_size"), 1256.5), ("default_vocab_size",)),
    "version a number": (_with(GOOD, ("config", "version"), 3), ("version", "expected a string")),
    "pattern a list": (_with(GOOD, ("config", "pattern"), ["a"]), ("pattern", "expected a string")),
    "vocab an object": (_with(GOOD, ("vocab",), {}), ("vocab", "expected a list")),
    "vocab shorter than the config says": (_with(GOOD, ("config", "default_vocab_size"), 2000),
                                           ("vocab has 256 entries",)),
    "vocab entry a string": (_with(GOOD, ("vocab", 3), "AA=="), ("vocab[3]", "expected a JSON object")),
    "vocab rank a string": (_with(GOOD, ("vocab", 3, "rank"), "3"), ("vocab[3]", "rank", "expected an integer")),
    "vocab rank out of order": (_with(GOOD, ("vocab", 3, "rank"), 4), ("vocab[3]", "rank is 4")),
    "vocab entry without bytes": (_with(GOOD, ("vocab", 3), {"rank": 3}), ("vocab[3]", "lacks token_bytes")),
    "token_bytes a number": (_with(GOOD, ("vocab", 3, "token_bytes"), 3), ("vocab[3]", "token_bytes")),
    "token_bytes not base64": (_with(GOOD, ("vocab", 3, "token_bytes"), "!!!!"),
                               ("vocab[3].token_bytes", "not base64")),
    "a token of 3000 bytes": (_with(GOOD, ("vocab", 3, "token_bytes"), base64.b64encode(b"a" * 3000).decode()),
                              ("vocab[3]", "token_bytes")),
    "an empty token": (_with(GOOD, ("vocab", 3, "token_bytes"), ""), ("BPE token 3",)),
    "a token twice": (_with(GOOD, ("vocab", 3, "token_bytes"), "AA=="), ("appears twice",)),
    "v13 without special_tokens": (_with(GOOD, ("config", "version"), "v13"), ("'v13'", "no special_tokens list")),
    "special_tokens an object": (_with(LISTED, ("special_tokens",), {}), ("special_tokens", "expected a list")),
    "special_tokens entry a string": (_with(LISTED, ("special_tokens", 2), "</s>"),
                                      ("special_tokens[2]", "expected a JSON object")),
    "special rank a string": (_with(LISTED, ("special_tokens", 2, "rank"), "2"), ("special_tokens[2]", "rank")),
    "special token_str a number": (_with(LISTED, ("special_tokens", 2, "token_str"), 2),
                                   ("special_tokens[2]", "token_str")),
    "special ranks with a gap": (_with(LISTED, ("special_tokens", 2, "rank"), 900), ("ranks are not 0, 1, 2",)),
    "more listed specials than the config": (
        _with(_with(LISTED, ("config", "default_num_special_tokens"), 19), ("config", "default_vocab_size"), 19 + 256),
        ("20 special tokens", "(19)"),
    ),
    "10**5 listed specials": ({**LISTED, "special_tokens": [{"rank": i, "token_str": f"<x{i}>"} for i in range(10**5)]},
                              ("special_tokens", "100000 items")),
    "an empty special": (_with(LISTED, ("special_tokens", 19, "token_str"), ""), ("special token 19",)),
}


@pytest.mark.parametrize("doc, words", HOSTILE_TEKKEN.values(), ids=HOSTILE_TEKKEN.keys())
def test_hostile_tekken_json_is_refused(doc, words):
    _refused(doc, *words)


def test_damaged_json_and_the_size_bound(tmp_path):
    _refused_text = lambda text: parse_tekken_json(text, "hostile/tekken.json")  # noqa: E731
    with pytest.raises(CorruptFileError, match="not valid JSON"):
        _refused_text(b"{'config': 1}")
    with pytest.raises(CorruptFileError, match="nests deeper"):
        _refused_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(CorruptFileError, match="not valid JSON"):
        _refused_text('{"config": {"default_num_special_tokens": NaN}}')


# A vocabulary whose tokens are each other's prefixes is the merge builder's worst case: built naively it is
# quadratic (3,000 tokens take over 120 s and 6 GB). Tokens are bounded in length and the build is linear in the
# vocabulary's bytes; the child below resolves a folder's tokenizer and reports its peak memory growth.
PREFIX_CHAIN = """
    import base64, json, resource, sys
    from comfyui_flux2dev.errors import Flux2DevError
    from comfyui_flux2dev.tokenizers import resolve_tokenizer
    folder = sys.argv[1]
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    res = resolve_tokenizer([folder])
    print("rung", res.rung)
    print("\\n".join(" | ".join(a) for a in res.attempts))
    print("growth", (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024)
"""


def _child(code: str, *args: str, timeout: int = 300) -> str:
    """Run `code` in a fresh interpreter (its peak memory is its own); a hang fails the test, not the run."""
    done = subprocess.run([sys.executable, "-P", "-c", textwrap.dedent(code), *args], capture_output=True, text=True,
                          timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@pytest.mark.parametrize("longest", (3000, MAX_TOKEN_BYTES))
def test_prefix_chain_vocabulary_is_refused_or_built_in_bounded_memory(tmp_path, longest):
    chain = [b"a" * k for k in range(2, longest + 1)]
    (tmp_path / "tekken.json").write_text(json.dumps(_tekken(BYTES + chain)))
    out = _child(PREFIX_CHAIN, str(tmp_path))
    growth = int(out.split("growth ")[-1])
    assert growth < 1000, out  # the real vocabulary builds in ~250 MiB
    if longest > MAX_TOKEN_BYTES:  # refused, naming the file and the token; the ladder goes on
        assert "rung bundled-tekken" in out
        refusal = next(line for line in out.splitlines() if line.startswith("tekken-json"))
        assert str(tmp_path / "tekken.json") in refusal and "token_bytes" in refusal, out
    else:  # the longest allowed tokens, each merge of the chain valid: built, and a tokenizer after all
        assert "rung tekken-json" in out


def test_huge_special_counts_cost_bounded_memory(tmp_path):
    doc = _tekken(BYTES, n_special=10**7)
    (tmp_path / "tekken.json").write_text(json.dumps(doc))
    out = _child(PREFIX_CHAIN, str(tmp_path))
    assert int(out.split("growth ")[-1]) < 500 and "default_num_special_tokens is 10000000" in out, out


def test_gguf_vocabulary_arrays_are_checked():
    good = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": [*V3_SPECIAL_TOKENS, "a", "b"],
            "tokenizer.ggml.token_type": [3] * 20 + [1, 1]}
    assert vocab_from_gguf(good).ranks == (b"a", b"b")
    cases = {
        "tokenizer.ggml.model": ("llama", WrongModelError, "'llama'"),
        "tokenizer.ggml.tokens": ("abc", CorruptFileError, "tokenizer.ggml.tokens is 'abc', expected a list"),
        "tokenizer.ggml.token_type": ([3] * 21, CorruptFileError, "22 strings and as many integers"),
    }
    for key, (value, error, words) in cases.items():
        with pytest.raises(error, match=words.replace("(", r"\(").replace("[", r"\[")):
            vocab_from_gguf({**good, key: value})
    with pytest.raises(CorruptFileError, match="as many integers"):
        vocab_from_gguf({**good, "tokenizer.ggml.token_type": ["3"] * 22})
    with pytest.raises(CorruptFileError, match="as many integers"):
        vocab_from_gguf({**good, "tokenizer.ggml.tokens": [*V3_SPECIAL_TOKENS, "a", 7]})
    with pytest.raises(CorruptFileError, match="special token 0"):
        TekkenVocab(("",), (b"a",))


def test_gguf_vocabulary_refusal_is_a_failed_rung():
    res = resolve_tokenizer(gguf_metadata={"tokenizer.ggml.tokens": 5, "tokenizer.ggml.model": "gpt2"})
    assert res.rung == "bundled-tekken"
    assert res.attempts[-1][0] == "gguf-vocab" and "tokenizer.ggml.tokens is 5, expected a list" in res.attempts[-1][2]


# ---------------------------------------------------------------- the transformers rung


def _bpe_tokenizer_json(folder: Path, normalizer: dict | None = None) -> None:
    from tokenizers import Tokenizer, models

    Tokenizer(models.BPE({"a": 0, "b": 1, "ab": 2}, [("a", "b")])).save(str(folder / "tokenizer.json"))
    if normalizer is not None:
        doc = json.loads((folder / "tokenizer.json").read_text())
        doc["normalizer"] = normalizer
        (folder / "tokenizer.json").write_text(json.dumps(doc))


def test_tokenizers_panic_is_a_failed_rung(tmp_path):
    """The tokenizers library panics (pyo3's PanicException, a BaseException) on this charsmap; the ladder
    notes it for both transformers probes and goes on to the next rung."""
    _bpe_tokenizer_json(tmp_path, {"type": "Precompiled", "precompiled_charsmap": "!!!"})
    res = resolve_tokenizer([tmp_path])
    assert res.rung == "bundled-tekken"
    transformers = [reason for rung, _, reason in res.attempts if rung == "transformers"]
    assert len(transformers) == 2 \
        and all("PanicException" in reason and "Precompiled" in reason for reason in transformers), res.attempts


MARKER_MODULE = """
import pathlib
pathlib.Path({marker!r}).write_text("ran")
from transformers import PreTrainedTokenizerFast
class EvilTokenizer(PreTrainedTokenizerFast):
    pass
"""


@pytest.mark.parametrize("config_file", ("tokenizer_config.json", "config.json", "processor_config.json"))
def test_custom_tokenizer_code_is_refused_without_import(tmp_path, config_file):
    marker = tmp_path / "marker"
    folder = tmp_path / "encoder"
    folder.mkdir()
    _bpe_tokenizer_json(folder)
    (folder / "evil.py").write_text(MARKER_MODULE.format(marker=str(marker)))
    auto_map = {"AutoTokenizer": ["evil.EvilTokenizer", None], "AutoProcessor": "evil.EvilTokenizer"}
    (folder / config_file).write_text(json.dumps({"tokenizer_class": "EvilTokenizer", "auto_map": auto_map}))
    res = resolve_tokenizer([folder])
    assert res.rung == "bundled-tekken" and not marker.exists()
    reasons = [reason for rung, _, reason in res.attempts if rung == "transformers"]
    assert len(reasons) == 2 and all("custom tokenizer code (auto_map)" in r and config_file in r for r in reasons), \
        res.attempts


def test_tokenizer_files_that_are_not_files(tmp_path):
    import os

    (tmp_path / "tokenizer.json").mkdir()
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    os.mkfifo(tmp_path / "tekken.json")
    out = _child(PREFIX_CHAIN, str(tmp_path), timeout=120)  # a FIFO opened would block: the guard is the timeout
    assert "rung bundled-tekken" in out
    assert "tekken-json" in out and "no tekken.json" in out
    assert "is a folder, but a vocabulary file was expected" in out, out


def test_bundled_vocabulary_is_within_the_bounds():
    vocab = parse_tekken_json(bundled_tekken_path().read_bytes())
    assert max(map(len, vocab.ranks)) * 3 <= MAX_TOKEN_BYTES  # a wide margin over the real tokens
