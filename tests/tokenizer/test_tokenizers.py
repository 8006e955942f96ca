"""The tokenizer ladder, rung by rung, on real files made here, against an independent reference: the HF
tokenizer transformers 4.57 builds from the same vocabulary (tests/tokenizer/tokenizer_reference.py, run in a
subprocess under .venv/oldest). Every test runs again on the oldest supported releases (transformers_matrix)."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from comfyui_flux2dev.devtools.tiny.gguf_blocks import write_and_close
from comfyui_flux2dev.errors import CorruptFileError, TokenizerNotFoundError
from comfyui_flux2dev.tokenizers import (
    MAX_LENGTH,
    PAD_ID,
    PADDING_MODES,
    SYSTEM_PROMPT,
    Flux2Tokenizer,
    bundled_tekken_path,
    parse_tekken_json,
    prompt_ids,
    resolve_tokenizer,
    tekken_bytes,
)
from comfyui_flux2dev.tokenizers.vocab import vocab_from_transformers

pytestmark = pytest.mark.transformers_matrix

REPO = Path(__file__).resolve().parents[2]
OLDEST = REPO / ".venv" / "oldest"  # transformers 4.57 and the other oldest releases (tests/run)
OWN_CORPUS = Path(__file__).resolve().parents[1] / "data" / "prompts.jsonl"
# More prompts where the project's shared folder lies beside the clone (a user's clone has none).
SHARED_CORPUS = Path(os.environ.get("FLUX2DEV_PROMPT_CORPUS", REPO.parent / "shared" / "corpus" / "prompts.jsonl"))
REFERENCE_SCRIPT = Path(__file__).with_name("tokenizer_reference.py")
MISTRAL3_CONFIG = {
    "model_type": "mistral3",
    "architectures": ["Mistral3ForConditionalGeneration"],
    "text_config": {"model_type": "mistral"},
    "vision_config": {"model_type": "pixtral"},
}


def _beside(path):
    """The folders the encoder loader gives the ladder for a model at `path` (its folder, or its file's)."""
    from comfyui_flux2dev.loaders.models.encoder_layouts import tokenizer_folders

    return tokenizer_folders(str(path if path.is_dir() else path.parent))


def corpus_prompts() -> list[str]:
    """The pack's own prompt corpus, then the shared one where it is there."""
    files = [OWN_CORPUS, *([SHARED_CORPUS] if SHARED_CORPUS.is_file() else [])]
    return [json.loads(line) for f in files for line in f.read_text(encoding="utf-8").splitlines() if line.strip()]


@pytest.fixture(scope="session")
def reference(request) -> dict:
    """Ids from transformers 4.57's converter for the corpus, and the HF files it saved; cached on disk by the
    hash of everything that goes into it."""
    tekken = bundled_tekken_path()
    corpus = "".join(json.dumps(p) + "\n" for p in corpus_prompts())
    key = hashlib.sha256()
    for part in (REFERENCE_SCRIPT.read_bytes(), corpus.encode(), str(tekken.stat().st_size).encode()):
        key.update(part)
    key.update(",".join(sorted(p.name for p in OLDEST.glob("*.dist-info"))).encode())
    out = request.config.cache.mkdir("flux2dev-tokenizer-reference") / key.hexdigest()[:16]
    if not (out / "reference.json").is_file():
        out.mkdir(parents=True, exist_ok=True)
        (out / "corpus.jsonl").write_text(corpus, encoding="utf-8")
        env = {**os.environ, "PYTHONPATH": str(OLDEST)}
        subprocess.run(
            [sys.executable, "-P", str(REFERENCE_SCRIPT), str(tekken), str(out / "corpus.jsonl"), str(out)],
            env=env, check=True, capture_output=True, timeout=600,
        )
    result = json.loads((out / "reference.json").read_text(encoding="utf-8"))
    result["hf_dir"] = out / "hf"
    return result


def _assert_reference_ids(tokenizer: Flux2Tokenizer, reference: dict) -> None:
    for prompt, want in zip(reference["prompts"], reference["prompt_ids"]):
        assert tokenizer.encode(prompt) == want, prompt
    for text, want in zip(reference["extra_texts"], reference["extra_ids"]):
        assert tokenizer.encode(text) == want, text


def _write_json(path: Path, value) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(value), encoding="utf-8")
    return path


def _hf_folder(folder: Path, reference: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for file in reference["hf_dir"].iterdir():
        shutil.copy(file, folder / file.name)
    return folder


def _v7_tekken(names: list[str]) -> dict:
    """The bundled vocabulary rewritten as a v7 file that lists its special tokens."""
    doc = json.loads(bundled_tekken_path().read_bytes())
    doc["config"]["version"] = "v7"
    filler = [f"<SPECIAL_{i}>" for i in range(len(names), doc["config"]["default_num_special_tokens"])]
    doc["special_tokens"] = [{"rank": i, "token_str": s, "is_control": True} for i, s in enumerate(names + filler)]
    return doc


V3_NAMES = [
    "<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]",
    "[/TOOL_RESULTS]", "[TOOL_CALLS]", "[IMG]", "<pad>", "[IMG_BREAK]", "[IMG_END]", "[PREFIX]", "[MIDDLE]",
    "[SUFFIX]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[TOOL_CONTENT]",
]


# ---------------------------------------------------------------- the reference and the canonical build


def test_reference_is_transformers_4_57(reference):
    assert reference["transformers"].startswith("4.57.")
    assert len(reference["prompts"]) == len(reference["prompt_ids"]) >= 50


def test_bundled_fallback_matches_reference(reference, tmp_path):
    empty = tmp_path / "encoder"
    empty.mkdir()
    res = resolve_tokenizer([empty])
    assert res.rung == "bundled-tekken"
    assert res.source == str(bundled_tekken_path())
    assert [a[0] for a in res.attempts] == ["embedded-tekken", "tekken-json", "transformers", "gguf-vocab"]
    assert all(reason.startswith("skipped:") for _, _, reason in res.attempts)
    _assert_reference_ids(res.tokenizer, reference)


def test_template_matches_reference(reference):
    tokenizer = resolve_tokenizer().tokenizer
    for prompt, want in zip(reference["prompts"], reference["template_ids"]):
        ids, mask = prompt_ids(tokenizer, prompt, "reference")
        assert [i for i, m in zip(ids, mask) if m] == want[:MAX_LENGTH], prompt
    _, fixed = prompt_ids(tokenizer, "", "reference")
    assert sum(fixed) == 33  # the fixed part of the template: system prompt and [INST] markers


def test_special_looking_user_text_becomes_special_ids(reference):
    """As the reference tokenizer.json: every special string typed in a prompt is split out as its id."""
    encode = resolve_tokenizer().tokenizer.encode
    assert encode("[INST]") == [3]
    assert encode("a<s>b</s>c") == [1097, 1, 1098, 2, 1099]
    assert encode("<pad>") == [PAD_ID]
    assert 42 in encode("<SPECIAL_42>")
    assert 3 not in encode("[inst]") and 3 not in encode("[ INST ]")  # exact spelling only
    ids, _ = prompt_ids(resolve_tokenizer().tokenizer, "x [SYSTEM_PROMPT] y", "comfy")
    assert ids.count(17) == 2


# ---------------------------------------------------------------- padding modes


def test_padding_modes(reference):
    tokenizer = resolve_tokenizer().tokenizer
    assert PADDING_MODES == ("reference", "comfy")
    want = reference["template_ids"][0]
    ids, mask = prompt_ids(tokenizer, reference["prompts"][0], "reference")
    assert len(ids) == len(mask) == MAX_LENGTH
    pads = MAX_LENGTH - len(want)
    assert ids == [PAD_ID] * pads + want
    assert mask == [0] * pads + [1] * len(want)

    long_prompt = "a red fox " * 400
    full, _ = prompt_ids(tokenizer, long_prompt, "comfy")
    assert len(full) > MAX_LENGTH
    cut, cut_mask = prompt_ids(tokenizer, long_prompt, "reference")
    assert cut == full[:MAX_LENGTH] and cut_mask == [1] * MAX_LENGTH

    assert prompt_ids(tokenizer, "a [IMG]red fox[IMG]", "reference") == prompt_ids(tokenizer, "a red fox", "reference")
    with_image, _ = prompt_ids(tokenizer, "a [IMG]red fox", "comfy")
    assert with_image.count(10) == 1  # comfy mode keeps [IMG], as ComfyUI's own tokenizer does
    assert tokenizer.encode(SYSTEM_PROMPT) == full[2:30]  # 28 ids between [SYSTEM_PROMPT] and [/SYSTEM_PROMPT]
    with pytest.raises(ValueError, match="padding"):
        prompt_ids(tokenizer, "x", "right")


# ---------------------------------------------------------------- rung 1: embedded tekken_model


def test_embedded_uint8_safetensors(reference, tmp_path):
    from safetensors.numpy import load_file, save_file

    weights = tmp_path / "mistral_3_small_flux2_bf16.safetensors"
    raw = np.frombuffer(bundled_tekken_path().read_bytes(), dtype=np.uint8)
    save_file({"tekken_model": raw, "model.norm.weight": np.ones(4, np.float32)}, str(weights))
    res = resolve_tokenizer(_beside(weights), embedded_tekken=load_file(str(weights))["tekken_model"])
    assert (res.rung, res.source, res.attempts) == ("embedded-tekken", "tekken_model tensor", [])
    _assert_reference_ids(res.tokenizer, reference)


def test_embedded_f16_per_byte_cow_gguf(reference, tmp_path):
    import gguf

    path = tmp_path / "encoder-cow.gguf"
    writer = gguf.GGUFWriter(str(path), "cow")
    writer.add_tensor("tekken_model",
                      np.frombuffer(bundled_tekken_path().read_bytes(), dtype=np.uint8).astype(np.float16))
    write_and_close(writer)
    tensor = next(t for t in gguf.GGUFReader(str(path)).tensors if t.name == "tekken_model")
    assert tensor.data.dtype == np.float16
    res = resolve_tokenizer(_beside(path), embedded_tekken=tensor.data)
    assert res.rung == "embedded-tekken"
    _assert_reference_ids(res.tokenizer, reference)


def test_embedded_torch_tensors_and_bad_values():
    import torch

    data = b'{"config": 1}'
    as_uint8 = torch.tensor(list(data), dtype=torch.uint8)
    assert tekken_bytes(as_uint8) == data
    assert tekken_bytes(as_uint8.to(torch.bfloat16)) == data
    with pytest.raises(ValueError, match="not bytes"):
        tekken_bytes(np.array([65.5, 66.0], dtype=np.float16))
    with pytest.raises(ValueError, match="dtype"):
        tekken_bytes(np.array([65, 66], dtype=np.int64))


def test_broken_embedded_tensor_falls_through(reference):
    res = resolve_tokenizer(embedded_tekken=np.array([300.0, 1.5], dtype=np.float32))
    assert res.rung == "bundled-tekken"
    assert res.attempts[0][0] == "embedded-tekken" and "not bytes" in res.attempts[0][2]
    res = resolve_tokenizer(embedded_tekken=b"not json at all")
    assert res.rung == "bundled-tekken" and "the tekken_model tensor is not valid JSON" in res.attempts[0][2]


# ---------------------------------------------------------------- rung 2: tekken.json


def test_hf_mistral_small_folder_uses_tekken_json_first(reference, tmp_path):
    """The HF layout has tekken.json and tokenizer.json: tekken.json wins and transformers is never probed
    (AutoTokenizer there returns the backend that encodes markers as text)."""
    folder = _hf_folder(tmp_path / "Mistral-Small-3.1", reference)
    _write_json(folder / "config.json", MISTRAL3_CONFIG)
    shutil.copy(bundled_tekken_path(), folder / "tekken.json")
    res = resolve_tokenizer([folder])
    assert (res.rung, res.source) == ("tekken-json", str(folder / "tekken.json"))
    assert [rung for rung, _, _ in res.attempts] == ["embedded-tekken"]
    _assert_reference_ids(res.tokenizer, reference)


def test_tekken_only_folder_without_special_tokens(reference, tmp_path):
    """Other loaders raise KeyError 'special_tokens' on a v3 file; the ids 0..999 are specials."""
    folder = tmp_path / "tekken-only"
    folder.mkdir()
    shutil.copy(bundled_tekken_path(), folder / "tekken.json")
    assert "special_tokens" not in json.loads((folder / "tekken.json").read_bytes())
    weights = folder / "consolidated.safetensors"
    weights.write_bytes(b"")
    res = resolve_tokenizer(_beside(weights))
    assert res.rung == "tekken-json" and res.source == str(folder / "tekken.json")
    assert res.tokenizer.token_id("[TOOL_CONTENT]") == 19 and res.tokenizer.token_id("<SPECIAL_999>") == 999
    _assert_reference_ids(res.tokenizer, reference)


def test_v7_tekken_in_tokenizer_subfolder(reference, tmp_path):
    _write_json(tmp_path / "encoder" / "tokenizer" / "tekken.json", _v7_tekken(V3_NAMES))
    res = resolve_tokenizer(_beside(tmp_path / "encoder"))
    assert res.rung == "tekken-json" and res.source == str(tmp_path / "encoder" / "tokenizer" / "tekken.json")
    _assert_reference_ids(res.tokenizer, reference)


def test_self_test_rejects_wrong_specials_and_cache_follows_the_file(reference, tmp_path):
    folder = tmp_path / "encoder"
    tekken = _write_json(folder / "tekken.json", _v7_tekken(V3_NAMES))
    first = resolve_tokenizer([folder])
    assert first.rung == "tekken-json" and resolve_tokenizer([folder]).tokenizer is first.tokenizer

    swapped = list(V3_NAMES)
    swapped[3], swapped[4] = swapped[4], swapped[3]  # [INST] and [/INST] exchanged
    _write_json(tekken, _v7_tekken(swapped))
    os.utime(tekken, ns=(1, 1))  # a different mtime, whatever the file system's clock resolution
    res = resolve_tokenizer([folder])
    assert res.rung == "bundled-tekken"
    assert res.attempts[1][:2] == ("tekken-json", str(tekken))
    assert "self-test" in res.attempts[1][2] and "'[INST]'" in res.attempts[1][2]


# ---------------------------------------------------------------- rung 3: transformers


def test_tokenizer_json_folder(reference, tmp_path):
    folder = _hf_folder(tmp_path / "hf-tokenizer", reference)
    res = resolve_tokenizer([folder])
    assert res.rung == "transformers" and res.source == str(folder)
    assert [a[0] for a in res.attempts] == ["embedded-tekken", "tekken-json"] + ["transformers"] * (
        len(res.attempts) - 2
    )
    _assert_reference_ids(res.tokenizer, reference)


def test_tokenizer_json_with_true_tekken_pattern_still_gives_reference_ids(reference, tmp_path):
    """transformers 5.x writes tokenizer.json with mistral-common's own pattern, which splits some scripts
    differently; only the vocabulary of a found tokenizer is kept, so the ids stay the reference's."""
    from tokenizers import Tokenizer

    folder = _hf_folder(tmp_path / "tekken-pattern", reference)
    spec = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
    tekken_pattern = json.loads(bundled_tekken_path().read_bytes())["config"]["pattern"]
    spec["pre_tokenizer"]["pretokenizers"][0]["pattern"] = {"Regex": tekken_pattern}
    _write_json(folder / "tokenizer.json", spec)
    as_written = Tokenizer.from_file(str(folder / "tokenizer.json"))
    differing = [
        p for p, want in zip(reference["prompts"], reference["prompt_ids"])
        if as_written.encode(p, add_special_tokens=False).ids != want
    ]
    assert differing  # the file as written disagrees with the reference (Devanagari among others)
    res = resolve_tokenizer([folder])
    assert res.rung == "transformers"
    _assert_reference_ids(res.tokenizer, reference)


def test_mistral3_folder_without_preprocessor_config(reference, tmp_path):
    """AutoProcessor raises OSError there; the ladder records it and AutoTokenizer serves."""
    folder = _hf_folder(tmp_path / "mistral3", reference)
    _write_json(folder / "config.json", MISTRAL3_CONFIG)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    _write_json(folder / "tokenizer_config.json", {**config, "processor_class": "PixtralProcessor"})
    weights = folder / "model-00001-of-00002.safetensors"
    weights.touch()  # the ladder looks beside the weights file it is given
    res = resolve_tokenizer(_beside(weights))
    assert res.rung == "transformers" and res.source == str(folder)
    assert res.attempts[-1][:2] == ("transformers", str(folder))
    assert res.attempts[-1][2].startswith("AutoProcessor: OSError")
    _assert_reference_ids(res.tokenizer, reference)


def test_diffusers_pipeline_tokenizer_folder(reference, tmp_path):
    root = tmp_path / "FLUX.2-dev"
    _write_json(root / "model_index.json",
                {"_class_name": "Flux2Pipeline", "tokenizer": ["transformers", "PixtralProcessor"]})
    _write_json(root / "text_encoder" / "config.json", MISTRAL3_CONFIG)
    _hf_folder(root / "tokenizer", reference)
    (root / "text_encoder" / "model.safetensors").touch()
    for model_path in (root, root / "text_encoder", root / "text_encoder" / "model.safetensors"):
        res = resolve_tokenizer(_beside(model_path))
        assert res.rung == "transformers" and res.source == str(root / "tokenizer"), model_path
    _assert_reference_ids(res.tokenizer, reference)


def test_tokenizer_config_naming_mistral_common_tokenizer(reference, tmp_path):
    """transformers fails on it (AttributeError or ValueError, by version); never a crash."""
    folder = tmp_path / "bfl-encoder"
    _write_json(folder / "config.json", MISTRAL3_CONFIG)
    _write_json(folder / "tokenizer_config.json", {"tokenizer_class": "MistralCommonTokenizer"})
    res = resolve_tokenizer([folder])
    assert res.rung == "bundled-tekken"
    probes = [reason.split(":")[0] for rung, _, reason in res.attempts if rung == "transformers"]
    assert probes == ["AutoProcessor", "AutoTokenizer"]

    shutil.copy(bundled_tekken_path(), folder / "tekken.json")
    res = resolve_tokenizer([folder])
    assert res.rung == "tekken-json" and [rung for rung, _, _ in res.attempts] == ["embedded-tekken"]


def test_mistral_common_backed_tokenizer_is_converted(reference, tmp_path):
    """AutoTokenizer on a BFL-style folder gives the mistral-common backend, which encodes markers as text;
    its vocabulary rebuilt canonically splices them and matches the reference."""
    import transformers

    folder = tmp_path / "bfl-encoder"
    _write_json(folder / "config.json", MISTRAL3_CONFIG)
    shutil.copy(bundled_tekken_path(), folder / "tekken.json")
    backend = transformers.AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    assert type(backend).__name__ in ("MistralCommonBackend", "MistralCommonTokenizer")
    assert 3 not in backend.encode("[INST]a red fox", add_special_tokens=False)
    _assert_reference_ids(Flux2Tokenizer(vocab_from_transformers(backend)), reference)


# ---------------------------------------------------------------- rung 4: GGUF metadata


def _gguf_metadata(reference: dict, model: str = "gpt2") -> dict:
    """What llama.cpp's converter writes, taken from the reference tokenizer.json."""
    spec = json.loads((reference["hf_dir"] / "tokenizer.json").read_text(encoding="utf-8"))
    tokens = [None] * len(spec["model"]["vocab"])
    for token, i in spec["model"]["vocab"].items():
        tokens[i] = token
    for added in spec["added_tokens"]:
        tokens[added["id"]] = added["content"]
    merges = [" ".join(m) if isinstance(m, list) else m for m in spec["model"]["merges"]]
    return {
        "general.architecture": "mistral3",
        "tokenizer.ggml.model": model,
        "tokenizer.ggml.pre": "tekken",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [3] * 1000 + [1] * (len(tokens) - 1000),
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
        "tokenizer.ggml.padding_token_id": 11,
    }


def test_gguf_metadata_vocab(reference, tmp_path):
    gguf_file = tmp_path / "Mistral-Small-3.2-Q4_K_M.gguf"
    gguf_file.write_bytes(b"")
    res = resolve_tokenizer(_beside(gguf_file), gguf_metadata=_gguf_metadata(reference))
    assert res.rung == "gguf-vocab"
    _assert_reference_ids(res.tokenizer, reference)


def test_gguf_metadata_not_tekken_falls_through(reference):
    meta = _gguf_metadata(reference, model="llama")
    res = resolve_tokenizer(gguf_metadata=meta)
    assert res.rung == "bundled-tekken"
    assert res.attempts[-1][0] == "gguf-vocab" and "'llama'" in res.attempts[-1][2]


# ---------------------------------------------------------------- rung 6: the hub, and when all fail


@pytest.fixture
def without_mistral_common(monkeypatch):
    """The package not installed: the bundled rung has nothing, so the ladder reaches the hub rung."""
    monkeypatch.setitem(sys.modules, "mistral_common", None)


@pytest.mark.parametrize(
    ("env", "allow_network", "reason"),
    [
        ({}, False, "network use not allowed"),
        ({"HF_HUB_OFFLINE": "1"}, True, "HF_HUB_OFFLINE is set"),
        ({"TRANSFORMERS_OFFLINE": "yes"}, True, "TRANSFORMERS_OFFLINE is set"),
    ],
)
def test_hub_skipped_and_every_rung_reported(without_mistral_common, monkeypatch, tmp_path, env, allow_network, reason):
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(TokenizerNotFoundError) as caught:
        resolve_tokenizer([tmp_path], allow_network=allow_network)
    message = str(caught.value)
    lines = [line for line in message.splitlines() if line.startswith("  - ")]
    rungs = ["embedded-tekken", "tekken-json", "transformers", "gguf-vocab", "bundled-tekken", "hub"]
    assert [line[4:].split(" ")[0] for line in lines] == rungs
    assert reason in lines[-1] and "mistral_common" in lines[-2]
    assert str(tmp_path) in message and "tekken.json" in message and "pip install mistral-common" in message


# ---------------------------------------------------------------- parsing details


def test_tekken_json_errors_are_clear():
    doc = json.loads(bundled_tekken_path().read_bytes())
    doc["config"]["version"] = "v13"
    with pytest.raises(CorruptFileError, match="no special_tokens list"):
        parse_tekken_json(json.dumps(doc))
    doc = {"config": {"default_num_special_tokens": 2, "default_vocab_size": 4, "version": "v3"},
           "vocab": [{"rank": 0, "token_bytes": base64.b64encode(b"a").decode(), "token_str": "a"}]}
    with pytest.raises(CorruptFileError, match="needs 2"):
        parse_tekken_json(json.dumps(doc))
