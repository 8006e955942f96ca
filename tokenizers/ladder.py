"""The tokenizer ladder: find the Tekken vocabulary of a FLUX.2 [dev] text encoder wherever it is, offline.

Each rung yields candidate sources; each candidate's vocabulary is built into the one canonical tokenizer
(canonical.py) and self-tested. The first that passes wins; every failure or skip is recorded, and when all
fail the error lists them with what to do. Outcomes are cached per source (path + mtime + size, or content
hash) and built tokenizers per vocabulary hash, so resolving again in the same process is cheap."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from ..errors import CorruptFileError, Flux2DevError, TokenizerNotFoundError, TooManyOpenFilesError
from ..loaders.formats.files import TEKKEN_FILE, TOKENIZER_FOLDER
from ..loaders.formats.validate import checked, read_json_file, too_many_open_files
from .canonical import Flux2Tokenizer, self_test
from .vocab import (
    TekkenVocab,
    gguf_tokens,
    parse_tekken_json,
    read_tekken_json,
    tekken_bytes,
    vocab_from_gguf,
    vocab_from_tokenizers_backend,
    vocab_from_transformers,
)

log = logging.getLogger(__name__)

# What transformers logs while probing a tokenizer folder that no user can act on (the folder is as its publisher
# made it, and the pack checks the result itself): (logger, words of the message). Dropped during the probe only.
UNACTIONABLE_WARNINGS = (
    ("transformers.models.auto.tokenization_auto", "but `tokenizer.json` is ByteLevel; loading `TokenizersBackend`"),
)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", TEKKEN_FILE, "tokenizer.model")
TRANSFORMERS_PROBES = ("AutoProcessor", "AutoTokenizer")
# The JSON files transformers reads from a tokenizer folder (and their kind, for validate's bounds): each is
# checked before transformers sees it, and one naming custom code (auto_map) is refused without importing it.
TRANSFORMERS_JSON = {
    "tokenizer.json": "vocabulary",
    "tokenizer_config.json": "config",
    "config.json": "config",
    "special_tokens_map.json": "config",
    "added_tokens.json": "config",
    "processor_config.json": "config",
    "preprocessor_config.json": "config",
    "chat_template.json": "config",
}
CUSTOM_CODE_KEYS = ("auto_map",)
# What the guard around third-party code lets through: asking the process to stop, and running out of open files
# (every other rung would too, and the file would be remembered as failed). Everything else, the tokenizers
# library's Rust panics (pyo3's PanicException, a BaseException) included, fails the attempt.
NEVER_CAUGHT = (KeyboardInterrupt, SystemExit, GeneratorExit, TooManyOpenFilesError)
BUNDLED_TEKKEN = ("data", "tekken_240911.json")  # inside the mistral_common package; Mistral-Small-3.x BPE
HUB_REPO = "black-forest-labs/FLUX.2-dev"
HUB_FILE = "tokenizer.json"
OFFLINE_ENV = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
TRUE_VALUES = ("1", "ON", "YES", "TRUE")
REASON_CHARS = 400

FIX_HINT = (
    "To fix it, do one of: put the encoder's tekken.json (from mistralai/Mistral-Small-3.1-24B-Instruct-2503) "
    "beside the encoder file or in a tokenizer/ folder next to it; install mistral-common "
    "(pip install mistral-common), which ships the vocabulary; or allow downloads with Hugging Face access to "
    f"{HUB_REPO} (accept its license, then `hf auth login`)."
)


@dataclass(frozen=True)
class TokenizerResolution:
    tokenizer: Flux2Tokenizer  # shared by every resolution of the same vocabulary: do not modify it
    rung: str
    source: str
    attempts: list[tuple[str, str, str]]  # (rung, source, reason) for what failed or was skipped first


@dataclass(frozen=True)
class _Request:
    folders: tuple[Path, ...]
    embedded: Any
    gguf_metadata: Mapping[str, Any] | None
    allow_network: bool


@dataclass(frozen=True)
class _Candidate:
    source: str
    key: tuple | None  # None: never cache the outcome (the hub can change between calls)
    load: Callable[[], TekkenVocab]
    label: str = ""  # prefixed to a failure reason (which transformers probe failed)


class _Skipped(Exception):
    """The rung has nothing to try for this encoder."""


class _FailedBefore(Exception):
    """This source (same file and mtime) or vocabulary already failed in this process; the message is its reason."""


# ---------------------------------------------------------------- cache


@dataclass(frozen=True)
class _Failed:
    reason: str  # the reason only: a stored exception would keep its frames (and 19 MB of JSON) alive


_lock = threading.Lock()
_outcomes: dict[tuple, Flux2Tokenizer | _Failed] = {}
_by_vocab: dict[str, Flux2Tokenizer | _Failed] = {}
# Why a file version may not be handed to transformers (None: it may), so a hostile file is parsed once per
# process, not once per rung and probe.
_refusals: dict[tuple, str | None] = {}


def _attempt(call: Callable[[], Any]) -> tuple[Any, str | None]:
    """(call(), None), or (None, why it failed). The one guard around the ladder's rungs, builds and
    third-party probes: a panic of the tokenizers library becomes a failed attempt, never a crash."""
    try:
        return call(), None
    except NEVER_CAUGHT:
        raise
    except BaseException as exc:  # noqa: BLE001 - pyo3's PanicException derives from BaseException
        if (out_of_files := too_many_open_files(exc, getattr(exc, "filename", None), "tokenizer file")) is not None:
            raise out_of_files from None  # from a library's own reading
        return None, _reason(exc)


def _cached(cache: dict, key, make: Callable[[], Flux2Tokenizer]) -> Flux2Tokenizer:
    """cache[key], made once; a failure is kept as its reason and raised again on every later look-up."""
    value = cache.get(key)
    if value is None:
        value, reason = _attempt(make)
        if reason is not None:
            value = _Failed(reason)
        cache[key] = value
    if isinstance(value, _Failed):
        raise _FailedBefore(value.reason)
    return value


def _self_tested(tokenizer: Flux2Tokenizer) -> Flux2Tokenizer:
    self_test(tokenizer)
    return tokenizer


def _build(load: Callable[[], TekkenVocab]) -> Flux2Tokenizer:
    vocab = load()
    return _cached(_by_vocab, vocab.digest, lambda: _self_tested(Flux2Tokenizer(vocab)))


def _outcome(candidate: _Candidate) -> Flux2Tokenizer:
    with _lock:
        if candidate.key is None:
            return _build(candidate.load)
        return _cached(_outcomes, candidate.key, lambda: _build(candidate.load))


def _reason(exc: BaseException) -> str:
    plain = isinstance(exc, (_Skipped, _FailedBefore, Flux2DevError))  # already written for the reader
    text = str(exc) if plain else f"{type(exc).__name__}: {exc}"
    text = " ".join(text.split())
    return text if len(text) <= REASON_CHARS else text[: REASON_CHARS - 3] + "..."


def _file_key(path: Path) -> tuple:
    stat = path.stat()
    return ("file", str(path.resolve()), stat.st_mtime_ns, stat.st_size)


def _folder_key(folder: Path) -> tuple:
    entries = sorted((e.name, e.stat().st_size, e.stat().st_mtime_ns) for e in os.scandir(folder) if e.is_file())
    return (str(folder.resolve()), tuple(entries))


def _tekken_file(path: Path) -> _Candidate:
    return _Candidate(str(path), _file_key(path), partial(_read_tekken, path))


def _read_tekken(path: Path) -> TekkenVocab:
    key = ("tekken", *_file_key(path))
    try:
        vocab = read_tekken_json(path)
    except TooManyOpenFilesError:
        raise  # not the file's fault: judged when it can be opened
    except Flux2DevError as exc:
        _refusals[key] = str(exc)
        raise
    _refusals[key] = None
    return vocab


# ---------------------------------------------------------------- rungs


def _embedded(req: _Request) -> list[_Candidate]:
    if req.embedded is None:
        raise _Skipped("skipped: the weights hold no tekken_model tensor")
    data = tekken_bytes(req.embedded)
    return [_Candidate("tekken_model tensor", ("embedded", hashlib.sha256(data).hexdigest()),
                       partial(parse_tekken_json, data, "the tekken_model tensor"))]


def _tekken_json(req: _Request) -> list[_Candidate]:
    files = [folder / TEKKEN_FILE for folder in req.folders if (folder / TEKKEN_FILE).is_file()]
    if not files:
        raise _Skipped(f"skipped: no {TEKKEN_FILE} in {_where(req)}")
    return [_tekken_file(path) for path in files]


def _transformers(req: _Request) -> list[_Candidate]:
    folders = [f for f in req.folders if any((f / name).is_file() for name in TOKENIZER_FILES)]
    if not folders:
        raise _Skipped(f"skipped: no tokenizer files ({', '.join(TOKENIZER_FILES)}) in {_where(req)}")
    return [
        _Candidate(str(folder), ("transformers", probe, _folder_key(folder)), partial(_probe, probe, folder),
                   f"{probe}: ")
        for folder in folders
        for probe in TRANSFORMERS_PROBES
    ]


def _probe(probe: str, folder: Path) -> TekkenVocab:
    _vet_folder(folder)
    import transformers

    with _unactionable_warnings_dropped():
        loaded = getattr(transformers, probe).from_pretrained(str(folder), local_files_only=True,
                                                              trust_remote_code=False)
    return vocab_from_transformers(loaded)


@contextlib.contextmanager
def _unactionable_warnings_dropped():
    def keep(record: logging.LogRecord) -> bool:
        return not any(record.name == name and words in record.getMessage() for name, words in UNACTIONABLE_WARNINGS)

    loggers = [logging.getLogger(name) for name in dict.fromkeys(name for name, _ in UNACTIONABLE_WARNINGS)]
    for logger in loggers:
        logger.addFilter(keep)
    try:
        yield
    finally:
        for logger in loggers:
            logger.removeFilter(keep)


def _vet_folder(folder: Path) -> None:
    """Check every file transformers would read from `folder` before it reads them: JSON files bounded and
    shaped, none naming custom code, and a tekken.json (which mistral-common would read) a sane vocabulary."""
    key = ("folder", *_folder_key(folder))
    if key not in _refusals:
        _, _refusals[key] = _attempt(partial(_check_folder, folder))
    if _refusals[key] is not None:
        raise CorruptFileError(_refusals[key])


def _check_folder(folder: Path) -> None:
    for name, kind in TRANSFORMERS_JSON.items():
        path = folder / name
        if not path.exists():
            continue
        doc = read_json_file(path, kind)
        if not isinstance(doc, dict):
            raise CorruptFileError(f"{path} is not a JSON object; download it again.")
        custom = [key for key in CUSTOM_CODE_KEYS if key in doc]
        if custom:
            raise CorruptFileError(
                f"{path} names custom tokenizer code ({custom[0]}); the pack never runs code from model files. "
                "Use the model's tekken.json, or a tokenizer folder without custom classes."
            )
    tekken = folder / TEKKEN_FILE
    if tekken.exists():
        key = ("tekken", *_file_key(tekken))
        if key not in _refusals:  # not judged yet by the tekken-json rung
            _read_tekken(tekken)
        elif _refusals[key] is not None:
            raise CorruptFileError(_refusals[key])


def _gguf(req: _Request) -> list[_Candidate]:
    meta = req.gguf_metadata
    if meta is None or "tokenizer.ggml.tokens" not in meta:
        raise _Skipped("skipped: no GGUF header with tokenizer.ggml.tokens was given")
    tokens, types = gguf_tokens(meta)
    return [_Candidate("GGUF metadata tokenizer.ggml.*", ("gguf", _gguf_digest(tokens, types)),
                       partial(vocab_from_gguf, meta))]


def _gguf_digest(tokens: list[str], types: list[int]) -> str:
    h = hashlib.sha256()
    for token in tokens:
        h.update(token.encode("utf-8", "surrogatepass"))
        h.update(b"\x00")
    h.update(str(types).encode())
    return h.hexdigest()


def bundled_tekken_path() -> Path:
    """The tekken.json inside the installed mistral_common package."""
    import mistral_common

    return Path(mistral_common.__file__).parent.joinpath(*BUNDLED_TEKKEN)


@functools.cache
def tekken_pattern() -> str:
    """mistral-common's Tekken split pattern, as its bundled vocabulary states it (a tekken.json the pack writes
    states it too; the FLUX.2 reference path splits with the pattern of canonical.py instead)."""
    from .vocab import TEKKEN_CONFIG_FIELDS, TEKKEN_FIELDS

    path = bundled_tekken_path()
    doc = checked(read_json_file(path, "vocabulary"), TEKKEN_FIELDS, str(path))
    pattern = checked(doc["config"], TEKKEN_CONFIG_FIELDS, f"{path} config").get("pattern")
    if not pattern:
        raise CorruptFileError(f"{path} states no split pattern; reinstall mistral-common.")
    return pattern


def _bundled(req: _Request) -> list[_Candidate]:
    path = bundled_tekken_path()
    if not path.is_file():
        raise _Skipped(f"{path} is missing from the installed mistral-common")
    return [_tekken_file(path)]


def _hub(req: _Request) -> list[_Candidate]:
    if not req.allow_network:
        raise _Skipped("skipped: network use not allowed (allow_network=False)")
    offline = [name for name in OFFLINE_ENV if os.environ.get(name, "").upper() in TRUE_VALUES]
    if offline:
        raise _Skipped(f"skipped: {offline[0]} is set, the process is offline")
    return [_Candidate(f"{HUB_REPO}/{TOKENIZER_FOLDER}/{HUB_FILE}", None, _from_hub)]


def _from_hub() -> TekkenVocab:
    from huggingface_hub import hf_hub_download

    from .canonical import hf_tokenizers

    where = {"repo_id": HUB_REPO, "filename": HUB_FILE, "subfolder": TOKENIZER_FOLDER}
    try:
        path = hf_hub_download(**where, local_files_only=True)
    except Exception:  # not in the cache yet
        path = hf_hub_download(**where)
    return vocab_from_tokenizers_backend(hf_tokenizers().Tokenizer.from_file(path))


# (short name, what it looks at, rung): the order is the ladder.
RUNGS: tuple[tuple[str, str, Callable[[_Request], list[_Candidate]]], ...] = (
    ("embedded-tekken", "tekken_model tensor", _embedded),
    ("tekken-json", TEKKEN_FILE, _tekken_json),
    ("transformers", "tokenizer files", _transformers),
    ("gguf-vocab", "GGUF metadata", _gguf),
    ("bundled-tekken", "mistral-common wheel", _bundled),
    ("hub", f"{HUB_REPO} {TOKENIZER_FOLDER}/", _hub),
)


def _where(req: _Request) -> str:
    return ", ".join(str(f) for f in req.folders) or "any folder (no model path given)"


def resolve_tokenizer(
    folders: Sequence[str | os.PathLike] = (),
    *,
    embedded_tekken: Any = None,
    gguf_metadata: Mapping[str, Any] | None = None,
    allow_network: bool = False,
) -> TokenizerResolution:
    """The tokenizer of a FLUX.2 [dev] text encoder. folders: where its tokenizer files may be, in order (the
    encoder's layout says; those that are no folder are passed over); embedded_tekken the tekken_model tensor
    of the weights (bytes, uint8 or one-byte-per-float array); gguf_metadata the already-parsed GGUF header.
    Raises TokenizerNotFoundError when every rung fails."""
    folders = tuple(dict.fromkeys(Path(f) for f in folders if Path(f).is_dir()))
    req = _Request(folders, embedded_tekken, gguf_metadata, allow_network)
    attempts: list[tuple[str, str, str]] = []
    for name, where, rung in RUNGS:
        candidates, reason = _attempt(partial(rung, req))
        if reason is not None:
            attempts.append((name, where, reason))
            continue
        for candidate in candidates:
            tokenizer, reason = _attempt(partial(_outcome, candidate))
            if reason is not None:
                attempts.append((name, candidate.source, candidate.label + reason))
                continue
            log.info("FLUX.2 [dev] tokenizer from %s (%s)", candidate.source, name)
            return TokenizerResolution(tokenizer, name, candidate.source, attempts)
    tried = "\n".join(f"  - {name} ({source}): {reason}" for name, source, reason in attempts)
    subject = f" in {_where(req)}" if req.folders else ""
    raise TokenizerNotFoundError(
        f"No tokenizer found for the FLUX.2 [dev] text encoder{subject}. Tried, in order:\n{tried}\n{FIX_HINT}"
    )
