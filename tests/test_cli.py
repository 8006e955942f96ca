"""The `flux2dev` command as a user runs it: its output contract and its one-sentence failures."""

import json
import subprocess
import sys

import pytest

from comfyui_flux2dev import tokenizers


def flux2dev(*args):
    return subprocess.run([sys.executable, "-P", "-m", "comfyui_flux2dev.cli", *args], capture_output=True, text=True)


@pytest.mark.transformers_matrix
def test_tokenize_json_prints_rung_source_and_the_comfy_mode_ids(tmp_path):
    out = flux2dev("tokenize", str(tmp_path), "--prompt", "a red fox", "--json")
    assert out.returncode == 0, out.stderr
    record = json.loads(out.stdout)
    resolution = tokenizers.resolve_tokenizer(tmp_path)
    assert record == {
        "rung": resolution.rung,
        "source": str(resolution.source),
        "ids": tokenizers.prompt_ids(resolution.tokenizer, "a red fox", "comfy")[0],
    }
    assert record["ids"][:2] == [1, 17] and record["ids"][-1] == 4


@pytest.mark.transformers_matrix
def test_tokenize_prompts_file_prints_one_object_a_line_in_order(tmp_path):
    prompts = ["a red fox", "", "[INST] literal"]
    file = tmp_path / "p.jsonl"
    file.write_text("".join(json.dumps(p) + "\n" for p in prompts))
    out = flux2dev("tokenize", str(tmp_path), "--prompts", str(file), "--json")
    assert out.returncode == 0, out.stderr
    lines = [json.loads(line) for line in out.stdout.splitlines()]
    tok = tokenizers.resolve_tokenizer(tmp_path).tokenizer
    assert [r["ids"] for r in lines] == [tokenizers.prompt_ids(tok, p, "comfy")[0] for p in prompts]


def test_a_failure_is_exit_2_and_one_sentence_without_traceback(tmp_path):
    missing = tmp_path / "nowhere"
    out = flux2dev("tokenize", str(missing), "--prompt", "x")
    assert out.returncode == 2
    assert out.stdout == ""
    assert "Traceback" not in out.stderr
    assert out.stderr.count("\n") == 1
    assert f"{missing} does not exist" in out.stderr


def test_debug_shows_the_traceback(tmp_path):
    out = flux2dev("--debug", "tokenize", str(tmp_path / "nowhere"), "--prompt", "x")
    assert out.returncode != 0 and "Traceback" in out.stderr
