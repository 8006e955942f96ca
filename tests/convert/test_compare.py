"""`flux2dev compare` on pairs whose answer is known: a file and its copy (every tensor identical, cosine 1), a
bf16 encoder and its fp8 conversion (every projection the exact cast), a GGUF conversion of a transformer, two
tiny transformers of different seeds (every weight differs), and the VAE of a Klein pipeline and of a [dev] one
(identical). The digest it reports for an encoder is the conditioning cache's fingerprint of its weights. A figure
with no value (an all-zero model's) is null in the JSON and "undefined" in the text."""

from __future__ import annotations

import json
import os

import pytest
import torch

from comfyui_flux2dev.errors import UnknownModelError, WrongModelError
from comfyui_flux2dev.loaders.convert.identity import compare_weights, weights_at
from helpers import run_flux2dev

ENCODER = "text_encoders/mistral_3_small_flux2_bf16.safetensors"
TRANSFORMER = "diffusion_models/flux2-dev-tiny.safetensors"


def _compare(a, b) -> dict:
    return compare_weights(weights_at(str(a)), weights_at(str(b)))


@pytest.fixture(scope="module")
def pairs(tiny_root, tmp_path_factory) -> dict[str, tuple]:
    from safetensors.torch import save_file

    from comfyui_flux2dev.devtools.tiny.geometry import TINY_VARIANTS
    from comfyui_flux2dev.devtools.tiny.transformers import diffusers_config
    from comfyui_flux2dev.loaders.convert.encoder import convert_encoder
    from comfyui_flux2dev.loaders.convert.transformer import convert_transformer
    from comfyui_flux2dev.loaders.models.transformer import diffusers_to_bfl

    folder = tmp_path_factory.mktemp("pairs")
    os.link(tiny_root / ENCODER, folder / "copy.safetensors")
    convert_encoder(str(tiny_root / ENCODER), str(folder / "fp8.safetensors"), dtype="fp8")
    convert_transformer(str(tiny_root / TRANSFORMER), str(folder / "q8.gguf"), qtype="Q8_0")
    from diffusers import Flux2Transformer2DModel

    with torch.random.fork_rng():
        torch.manual_seed(77)  # the tiny [dev] geometry, another seed
        other = Flux2Transformer2DModel(**diffusers_config(TINY_VARIANTS[0])).bfloat16()
    save_file({k: v.contiguous() for k, v in diffusers_to_bfl(other.state_dict()).items()},
              str(folder / "other-seed.safetensors"))
    return {
        "copy": (tiny_root / ENCODER, folder / "copy.safetensors"),
        "fp8": (tiny_root / ENCODER, folder / "fp8.safetensors"),
        "gguf": (tiny_root / TRANSFORMER, folder / "q8.gguf"),
        "seeds": (tiny_root / TRANSFORMER, folder / "other-seed.safetensors"),
        "vae": (tiny_root / "diffusers/flux2-klein-4b-tiny-pipeline/vae",
                tiny_root / "diffusers/flux2-dev-tiny-pipeline/vae"),
    }


def test_a_file_and_its_copy_are_identical_and_their_digest_is_the_caches_fingerprint(pairs):
    from comfyui_flux2dev.loaders.cache.store import tensors_digest
    from comfyui_flux2dev.loaders.models.encoder import load_encoder

    a, b = (weights_at(str(p)) for p in pairs["copy"])
    found = compare_weights(a, b)
    assert found["counts"] == {"identical": 271} and found["summary"] == "A and B hold the same weights, byte for byte"
    assert a.digest == b.digest == tensors_digest(load_encoder(str(pairs["copy"][0])).state_dict)


def test_an_fp8_conversion_is_stated_the_exact_cast_of_its_source(pairs):
    found = _compare(*pairs["fp8"])
    assert found["counts"] == {"identical": 61, "B is a cast of A": 210}
    assert found["summary"].startswith("B is A exactly cast")
    reverse = _compare(*reversed(pairs["fp8"]))
    assert reverse["counts"] == {"identical": 61, "A is a cast of B": 210}


def test_a_gguf_conversion_is_the_cast_of_its_source(pairs):
    found = _compare(*pairs["gguf"])
    # weights quantized (cast), the 16-bit ones kept as they are, the F32 norm scales equal in value
    assert found["counts"] == {"identical": 11, "equal after dequantization": 12, "B is a cast of A": 20}
    assert found["summary"].startswith("B is A exactly cast")


def test_two_seeds_of_a_tiny_model_differ_everywhere(pairs):
    found = _compare(*pairs["seeds"])
    assert found["counts"] == {"differ": 43} and found["summary"].startswith("A and B differ: 43 weight(s) differ")
    assert all(t["max_abs"] > 0 and t["rel_l2"] > 0.1 for t in found["tensors"])


def test_a_klein_pipelines_vae_is_the_dev_pipelines(pairs):
    found = _compare(*pairs["vae"])
    assert set(found["counts"]) == {"identical"} and found["summary"] == "A and B hold the same weights, byte for byte"


def test_models_of_two_kinds_and_whole_pipelines_are_refused(tiny_root):
    with pytest.raises(UnknownModelError, match="is a transformer and .* a encoder"):
        _compare(tiny_root / TRANSFORMER, tiny_root / ENCODER)
    with pytest.raises(WrongModelError, match="pipeline folder, which holds several models; compare one of its parts"):
        weights_at(str(tiny_root / "diffusers/flux2-dev-tiny-pipeline"))


# --- the figures, through the host -------------------------------------------------------------------------------


@pytest.mark.one_host  # the command's report; the host runs the models it compares in every host's model tests
def test_the_command_reports_identity_and_figures(comfy_host, pairs, tmp_path, capsys):
    """Through the command line as a user runs it: a copy gives cosine 1 and no difference for every prompt of a
    prompts file; then in this process: its fp8 conversion is close and not equal; two seeds are far apart at every
    timestep."""
    from comfyui_flux2dev.cli import main

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('"a red fox in the snow"\n"three cats on a sofa"\n')
    done = run_flux2dev("compare", *pairs["copy"], "--prompts", prompts, "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["kind"] == "encoder" and report["identity"]["counts"] == {"identical": 271}
    assert [r["prompt"] for r in report["parity"]["rows"]] == ["a red fox in the snow", "three cats on a sofa"]
    assert all(r["cosine"] == pytest.approx(1.0, abs=1e-12) and r["rel_l2"] == 0 and r["max_abs"] == 0
               for r in report["parity"]["rows"])

    assert main(["compare", *map(str, pairs["fp8"])]) == 0
    out = capsys.readouterr().out
    assert "identity: 61 identical, 210 B is a cast of A" in out and "worst: " in out

    assert main(["compare", *map(str, pairs["seeds"]), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["parity"]["rows"]
    assert [r["timestep"] for r in rows] == [0.9, 0.5, 0.1] \
        and all(r["cosine"] < 0.9 and r["rel_l2"] > 0.3 for r in rows)


def _strict(constant: str):
    raise ValueError(f"{constant} is not JSON")


def test_an_all_zero_model_gets_null_figures_in_strict_json_and_undefined_ones_in_the_text(comfy_host, tiny_root,
                                                                                           tmp_path, capsys):
    """Its weights and outputs are all zeros: no relative distance from them, and no cosine to another's."""
    from safetensors.torch import load_file, save_file

    from comfyui_flux2dev.cli import main

    zeros = tmp_path / "zeros.safetensors"
    save_file({k: torch.zeros_like(v) for k, v in load_file(str(tiny_root / TRANSFORMER)).items()}, str(zeros))
    assert main(["compare", str(zeros), str(tiny_root / TRANSFORMER), "--json"]) == 0
    report = json.loads(capsys.readouterr().out, parse_constant=_strict)
    assert all(t["rel_l2"] is None and t["max_abs"] > 0 for t in report["identity"]["tensors"])
    rows = report["parity"]["rows"]
    assert all(r["cosine"] is None and r["rel_l2"] is None and r["max_abs"] > 0 for r in rows)
    assert report["parity"]["worst"] == rows[0]
    assert main(["compare", str(zeros), str(tiny_root / TRANSFORMER)]) == 0
    *lines, note = capsys.readouterr().out.splitlines()
    assert not [line for line in lines if " nan" in line or " inf" in line], lines
    assert "  differ: double_blocks.0.img_mlp.2.weight (max abs 0.0361, rel L2 undefined)" in lines
    assert any(line.startswith("  0.9 ") and line.split()[1:3] == ["undefined", "undefined"] for line in lines)
    assert note.startswith("undefined: the figure has no value")


def test_an_fp8_conditioning_is_near_its_sources_and_the_worst_prompt_is_named(comfy_host, pairs):
    from comfyui_flux2dev.host.parity import encoder_parity

    report = encoder_parity(str(pairs["fp8"][0]), str(pairs["fp8"][1]), ["a red fox", "ein Hund im Schnee, 1920"])
    rows = report["rows"]
    assert all(0.99 < r["cosine"] < 1 and 0 < r["rel_l2"] < 0.1 for r in rows)
    assert report["worst"] == min(rows, key=lambda r: r["cosine"])
