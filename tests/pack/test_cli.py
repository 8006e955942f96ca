"""The `flux2dev` command as a user runs it: its output contract and its one-sentence failures."""

import json

import pytest

from comfyui_flux2dev import tokenizers
from helpers import run_devtools, run_flux2dev


@pytest.fixture
def tekken_folder(tmp_path):
    """A folder holding only the bundled tekken.json, as a user's tokenizer folder would."""
    import shutil

    shutil.copyfile(tokenizers.bundled_tekken_path(), tmp_path / "tekken.json")
    return tmp_path


@pytest.mark.transformers_matrix
@pytest.mark.parametrize("padding", [None, "reference", "comfy"])
def test_tokenize_json_prints_rung_source_the_ids_without_pads_and_the_mask(tekken_folder, padding):
    """The default padding is the encoder node's (reference); the ids are those the encoder attends to, the
    mask has one 0 per left pad."""
    tmp_path = tekken_folder
    out = run_flux2dev("tokenize", str(tmp_path), "--prompt", "a red fox", "--json",
                       *(("--padding", padding) if padding else ()))
    assert out.returncode == 0, out.stderr
    record = json.loads(out.stdout)
    resolution = tokenizers.resolve_tokenizer([tmp_path])
    mode = padding or "reference"
    ids, mask = tokenizers.prompt_ids(resolution.tokenizer, "a red fox", mode)
    pads = mask.count(0)
    assert record == {"rung": resolution.rung, "source": str(resolution.source), "padding": mode, "ids": ids[pads:],
                      "mask": mask}
    assert record["ids"][:2] == [1, 17] and record["ids"][-1] == 4 and ids[:pads] == [tokenizers.PAD_ID] * pads
    assert (pads > 0) == (mode == "reference") and len(mask) == (512 if mode == "reference" else len(ids))
    assert record["rung"] == "tekken-json"


# Which rung of the ladder each tiny layout's tokenizer comes from, as the encoder loader resolves it.
RUNG_OF_LAYOUT = {
    "hf-mistral3": "tekken-json",
    "hf-mistral3-old-prefix": "tekken-json",
    "standalone": "tekken-json",
    "native": "tekken-json",
    "mistral_3_small_flux2_bf16.safetensors": "embedded-tekken",
    "mistral_3_small_flux2_fp8.safetensors": "embedded-tekken",
    "mistral_3_small_flux2_fp8_channel.safetensors": "embedded-tekken",
    "mistral_3_small_flux2_fp4_mixed.safetensors": "embedded-tekken",
    "hf-mistral3-fp8": "tekken-json",
    "mistral_3_small_whole_fp4_mixed.safetensors": "embedded-tekken",
    "cow-f16.gguf": "embedded-tekken",
    "llama-q8_0.gguf": "gguf-vocab",
    "mistral3-q4_0.gguf": "gguf-vocab",
    "mistral3-q4_k.gguf": "gguf-vocab",
}


@pytest.mark.transformers_matrix
def test_each_tiny_layout_resolves_its_tokenizer_on_the_expected_rung(tiny_root, tiny_manifest):
    from comfyui_flux2dev.loaders.models.encoder import encoder_tokenizer

    layouts = {e["path"].removeprefix("text_encoders/") for e in tiny_manifest if e["kind"] == "encoder"}
    assert layouts == set(RUNG_OF_LAYOUT)
    ids = set()
    for name, rung in RUNG_OF_LAYOUT.items():
        resolution = encoder_tokenizer(str(tiny_root / "text_encoders" / name))
        assert resolution.rung == rung, (name, resolution.rung, resolution.attempts)
        ids.add(tuple(tokenizers.prompt_ids(resolution.tokenizer, "a red fox, 3 apples", "comfy")[0]))
    assert len(ids) == 1  # every rung gives the same ids
    pipeline = encoder_tokenizer(str(tiny_root / "diffusers/flux2-dev-tiny-pipeline"))
    assert pipeline.rung == "transformers"
    assert tuple(tokenizers.prompt_ids(pipeline.tokenizer, "a red fox, 3 apples", "comfy")[0]) in ids


def test_tokenize_an_encoder_file_uses_its_embedded_vocabulary(tiny_root):
    out = run_flux2dev("tokenize", str(tiny_root / "text_encoders/mistral_3_small_flux2_bf16.safetensors"),
                       "--prompt", "x", "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["rung"] == "embedded-tekken"


@pytest.mark.transformers_matrix
def test_tokenize_prompts_file_prints_one_object_a_line_in_order(tekken_folder):
    tmp_path = tekken_folder
    prompts = ["a red fox", "", "[INST] literal"]
    file = tmp_path / "p.jsonl"
    file.write_text("".join(json.dumps(p) + "\n" for p in prompts))
    out = run_flux2dev("tokenize", str(tmp_path), "--prompts", str(file), "--json")
    assert out.returncode == 0, out.stderr
    lines = [json.loads(line) for line in out.stdout.splitlines()]
    tok = tokenizers.resolve_tokenizer([tmp_path]).tokenizer
    assert [r["ids"] for r in lines] == [tokenizers.prompt_ids(tok, p, "reference")[0][-len(r["ids"]):]
                                         for p, r in zip(prompts, lines)]
    assert all(sum(r["mask"]) == len(r["ids"]) for r in lines)


def test_a_failure_is_exit_2_and_one_sentence_without_traceback(tmp_path):
    missing = tmp_path / "nowhere"
    out = run_flux2dev("tokenize", str(missing), "--prompt", "x")
    assert out.returncode == 2
    assert out.stdout == ""
    assert "Traceback" not in out.stderr
    assert out.stderr.count("\n") == 1
    assert f"{missing} does not exist" in out.stderr


def test_debug_shows_the_traceback(tmp_path):
    out = run_flux2dev("--debug", "tokenize", str(tmp_path / "nowhere"), "--prompt", "x")
    assert out.returncode != 0 and "Traceback" in out.stderr


def test_inspect_sees_every_tiny_file_as_the_factory_wrote_it(tiny_root, tiny_manifest):
    from comfyui_flux2dev.loaders.models.inspect import inspect_path

    for entry in tiny_manifest:
        seen = inspect_path(tiny_root / entry["path"])
        assert (seen["kind"], seen["layout"], seen["variant"]) == (entry["kind"], entry["layout"],
                                                                   entry["variant"]), entry
        if entry["kind"] in ("encoder", "transformer"):
            assert entry["format"] in seen["formats"], (entry, seen["formats"])


def test_inspect_json_for_an_encoder_names_its_tokenizer_rung(tiny_root):
    out = run_flux2dev("inspect", str(tiny_root / "text_encoders/mistral_3_small_flux2_bf16.safetensors"), "--json")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert set(report) == {"kind", "layout", "variant", "layers", "reads", "skips", "formats", "tokenizer",
                           "memory_bytes"}
    assert report["tokenizer"]["rung"] == "embedded-tekken"
    assert (report["kind"], report["variant"], report["layers"]) == ("encoder", "dev", 30)


def test_inspect_refuses_a_klein_encoder_in_one_sentence(tiny_root):
    out = run_flux2dev("inspect", str(tiny_root / "diffusers/flux2-klein-4b-tiny-pipeline/text_encoder"))
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "tiny Qwen3 text encoder of FLUX.2 Klein 4B" in out.stderr


def test_encode_writes_what_the_host_clip_produces(comfy_host, tiny_root, tmp_path):
    import torch
    from safetensors.torch import load_file

    from comfyui_flux2dev.host.clip import load_clip

    path = tiny_root / "text_encoders/mistral_3_small_flux2_bf16.safetensors"
    out_file = tmp_path / "cond.safetensors"
    out = run_flux2dev("encode", str(path), "--prompt", "a red fox", "--padding", "reference", "--dtype", "float32",
                   "--out", str(out_file))
    assert out.returncode == 0, out.stderr
    written = load_file(out_file)["conditioning"]
    clip = load_clip(path, padding="reference")
    expected = clip.encode_from_tokens(clip.tokenize("a red fox"))
    assert written.shape == (1, 512, 3 * 64) and written.dtype == torch.float32
    assert torch.equal(written, expected)


@pytest.mark.parametrize("relative", ["unet/flux2-dev-tiny-Q4_K.gguf",
                                      "text_encoders/mistral_3_small_flux2_bf16.safetensors"])
def test_tiny_models_are_unknown_without_their_declaration(tiny_root, relative):
    out = run_flux2dev("inspect", str(tiny_root / relative), env={"FLUX2DEV_TINY_MODELS": ""})
    assert out.returncode == 2 and "geometry" in out.stderr, out.stderr
    missing = run_flux2dev("inspect", str(tiny_root / relative), env={"FLUX2DEV_TINY_MODELS": "1"})
    assert missing.returncode == 2 and "FLUX2DEV_TINY_MODELS is '1', which is no file" in missing.stderr


def test_the_dev_tools_write_tiny_models_only_into_a_comfyui_folder(tmp_path):
    """(The whole run into a ComfyUI folder: tests/nodes/test_example_workflows.py.)"""
    refused = run_devtools("tiny", "--comfyui", str(tmp_path))
    assert refused.returncode == 2 and "not a ComfyUI folder" in refused.stderr
