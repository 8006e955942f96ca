"""No code from files, ever. Payloads that would write a marker file, if run, are planted
where every verb looks: pickled checkpoints (.ckpt, .pt, .bin) whose unpickling writes it, and tokenizer and
model configs whose auto_map names a custom class in a Python file beside them that writes it when
imported. Each verb (the encoder loader, the tokenizer ladder, inspect, the pipeline sources, the nodes, the
command line) either refuses with the pack's error or loads only what it reads itself; no marker is written,
no class is unpickled, and no planted module is imported."""

from __future__ import annotations

import json
import os
import pickle
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bad_files import entry_points, link_tree, message_faults, run_cli, time_bound, watching
from comfyui_flux2dev.errors import MODULE, MissingWeightsError, UnsupportedFormatError
from helpers import TINY_FOLDERS, point_model_folders

PACKAGE = Path(__file__).resolve().parents[2]
PLANTED_MODULES = ("tokenization_planted", "processing_planted", "configuration_planted", "modeling_planted")


class WritesMarker:
    """Unpickling this calls exec, which writes the marker file."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'a').write('unpickled\\n')",)


TOKENIZER_CONFIGS = ("tokenizer_config.json", "processor_config.json")
MODEL_CONFIGS = (*TOKENIZER_CONFIGS, "config.json")


def plant_code(folder: Path, marker: Path, configs: tuple[str, ...] = MODEL_CONFIGS) -> None:
    """Python files that write the marker when imported, and auto_map entries naming them in `configs`."""
    for module in PLANTED_MODULES:
        (folder / f"{module}.py").write_text(
            f"open({str(marker)!r}, 'a').write('imported {module}\\n')\n"
            "class PlantedTokenizer: pass\nclass PlantedProcessor: pass\n"
            "class PlantedConfig: pass\nclass PlantedModel: pass\n"
        )
    auto_map = {
        "AutoTokenizer": ["tokenization_planted.PlantedTokenizer", None],
        "AutoProcessor": "processing_planted.PlantedProcessor",
        "AutoConfig": "configuration_planted.PlantedConfig",
        "AutoModel": "modeling_planted.PlantedModel",
    }
    extras = {"tokenizer_config.json": {"tokenizer_class": "PlantedTokenizer"},
              "processor_config.json": {"processor_class": "PlantedProcessor"}}
    for name in configs:
        extra = extras.get(name, {})
        path = folder / name
        data = json.loads(path.read_text()) if path.exists() else {}
        if path.exists():
            path.unlink()  # a hard link into the tiny originals: write a new file
        path.write_text(json.dumps({**data, **extra, "auto_map": auto_map}))


def pickles(folder: Path, marker: Path, names=("model.ckpt", "model.pt", "pytorch_model.bin")) -> list[Path]:
    """Pickled checkpoints: a plain pickle (.ckpt) and torch.save archives (.pt, .bin)."""
    paths = []
    for name in names:
        path = folder / name
        if name.endswith(".ckpt"):
            path.write_bytes(pickle.dumps({"state_dict": {"model.embed_tokens.weight": WritesMarker(marker)}}))
        else:
            torch.save({"model.embed_tokens.weight": WritesMarker(marker)}, path)
        paths.append(path)
    return paths


@pytest.fixture(scope="module")
def planted(tmp_path_factory, tiny_root) -> dict:
    """{"marker": the file a payload would write, name: path of each planted input}."""
    root = tmp_path_factory.mktemp("planted")
    marker = root / "MARKER"
    files = root / "files"
    files.mkdir()
    ckpt, pt, bin_file = pickles(files, marker)

    pickled_encoder = root / "pickled-encoder"  # an HF folder whose weights are pickled only
    pickled_encoder.mkdir()
    os.link(tiny_root / "text_encoders/hf-mistral3/config.json", pickled_encoder / "config.json")
    pickles(pickled_encoder, marker, ("pytorch_model.bin",))
    plant_code(pickled_encoder, marker)

    pickled_transformer = root / "pickled-transformer"
    pickled_transformer.mkdir()
    os.link(tiny_root / "diffusion_models/flux2-klein-4b-tiny-diffusers/config.json",
            pickled_transformer / "config.json")
    pickles(pickled_transformer, marker, ("diffusion_pytorch_model.bin",))

    # Real safetensors weights beside a tokenizer whose config names planted code (and no tekken.json).
    encoder = link_tree(tiny_root / "text_encoders/hf-mistral3", root / "encoder-with-code", skip=("tekken.json",))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        os.link(tiny_root / "diffusers/flux2-dev-tiny-pipeline/tokenizer" / name, encoder / name)
    plant_code(encoder, marker)
    pickles(encoder, marker, ("pytorch_model.bin",))

    tokenizer = link_tree(tiny_root / "diffusers/flux2-dev-tiny-pipeline/tokenizer", root / "tokenizer-with-code")
    plant_code(tokenizer, marker, TOKENIZER_CONFIGS)

    pipeline = link_tree(tiny_root / "diffusers/flux2-dev-tiny-pipeline", root / "pipeline-with-code")
    plant_code(pipeline / "tokenizer", marker, TOKENIZER_CONFIGS)
    for part in ("text_encoder", "transformer"):
        plant_code(pipeline / part, marker)
    pickles(pipeline / "text_encoder", marker, ("pytorch_model.bin",))
    pickles(pipeline / "transformer", marker, ("diffusion_pytorch_model.bin",))
    return {"marker": marker, "ckpt": ckpt, "pt": pt, "bin": bin_file, "pickled-encoder": pickled_encoder,
            "pickled-transformer": pickled_transformer, "encoder-with-code": encoder,
            "tokenizer-with-code": tokenizer, "pipeline-with-code": pipeline}


def test_the_payloads_do_run_when_loaded_the_unsafe_way(tmp_path):
    """The payloads are live: pickle.load, torch.load without weights_only, and importing a planted module each
    write the marker (so the tests below, which find none, could have found one)."""
    marker = tmp_path / "live"
    ckpt, pt = pickles(tmp_path, marker, ("model.ckpt", "model.pt"))
    plant_code(tmp_path, marker)
    unsafe = (f"import pickle, sys, torch\npickle.load(open({str(ckpt)!r}, 'rb'))\n"
              f"torch.load({str(pt)!r}, weights_only=False)\nsys.path.insert(0, {str(tmp_path)!r})\n"
              "import tokenization_planted\n")
    done = subprocess.run([sys.executable, "-P", "-c", unsafe], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert marker.read_text().splitlines() == ["unpickled", "unpickled", "imported tokenization_planted"]


def run_verb(call, *args):
    """(the exception or None, the result or None, the audit records) of one verb on a planted input."""
    with watching("pickle.find_class", "import") as seen:
        try:
            with time_bound(60):
                return None, call(*args), seen
        except Exception as e:
            return e, None, seen


PICKLED = r"unpickle|pickled"
# (input, verb) -> None: it loads (what the pack reads itself), or (error, pattern its message holds).
EXPECTED = {
    **{(f, v): (UnsupportedFormatError, PICKLED) for f in ("ckpt", "pt", "bin")
       for v in ("encoder", "tokenizer", "inspect", "transformer", "vae")},
    **{(f, "gguf"): (Exception, r"not a GGUF file") for f in ("ckpt", "pt", "bin")},
    **{("pickled-encoder", v): (MissingWeightsError, r"no \.safetensors weights")
       for v in ("encoder", "tokenizer", "inspect")},
    ("pickled-transformer", "transformer"): (MissingWeightsError, r"holds no transformer weights"),
    ("pickled-transformer", "inspect"): (MissingWeightsError, r"no \.safetensors weights"),
    **{("encoder-with-code", v): None for v in ("encoder", "tokenizer", "ladder", "inspect")},
    ("tokenizer-with-code", "tokenizer"): None,
    ("tokenizer-with-code", "ladder"): None,
    **{("pipeline-with-code", v): None
       for v in ("encoder", "tokenizer", "inspect", "transformer", "vae", "dev-encoder")},
}


@pytest.mark.parametrize("name, verb", list(EXPECTED), ids=[f"{n}-{v}" for n, v in EXPECTED])
def test_a_verb_runs_no_code_from_the_files_it_is_given(planted, name, verb):
    error, result, seen = run_verb(entry_points()[verb], planted[name])
    assert not planted["marker"].exists(), planted["marker"].read_text()
    assert seen["pickle.find_class"] == []
    assert not [m for (m, *_) in seen["import"] if m in PLANTED_MODULES]
    expected = EXPECTED[(name, verb)]
    if expected is None:
        assert error is None, f"{type(error).__name__}: {error}"
        resolution = getattr(result, "tokenizer", result)  # a LoadedEncoder carries its TokenizerResolution
        if hasattr(resolution, "rung"):
            # The planted tokenizer config was refused, not used: another rung gave the tokenizer.
            assert resolution.rung != "transformers", resolution
    else:
        kind, pattern = expected
        assert isinstance(error, kind) and type(error).__module__ == MODULE, f"{type(error).__name__}: {error}"
        assert re.search(pattern, str(error)) and not message_faults(str(error)), str(error)


def test_the_ladder_notes_why_a_tokenizer_naming_custom_code_was_refused(planted):
    from comfyui_flux2dev.tokenizers import resolve_tokenizer

    folder = planted["tokenizer-with-code"]
    resolution = resolve_tokenizer([folder])
    refused = [reason for rung, source, reason in resolution.attempts
               if rung == "transformers" and source == str(folder)]
    assert refused and all(re.search(r"custom code|trust_remote_code|auto_map", r) for r in refused), \
        resolution.attempts
    assert not planted["marker"].exists()


def test_nodes_and_sources_run_no_code_from_a_models_folder(planted, comfy_host, monkeypatch):
    """The encoder loader, the pipeline sources, in the host, over models folders holding the planted inputs."""
    from comfyui_flux2dev.nodes.encoder import Flux2DevEncoderLoader
    from comfyui_flux2dev.nodes.sources import Flux2DevEncoderSource, Flux2DevTransformerSource, Flux2DevVAESource

    root = planted["encoder-with-code"].parent
    point_model_folders(monkeypatch, {key: [root] for key in TINY_FOLDERS})
    with watching("pickle.find_class", "import") as seen:
        clip = Flux2DevEncoderLoader.execute(encoder="encoder-with-code/", padding="reference",
                                             allow_network=False).result[0]
        assert clip.flux2dev_encoder["tokenizer"] != "transformers"
        Flux2DevEncoderSource.execute(pipeline="pipeline-with-code/", padding="comfy")
        Flux2DevTransformerSource.execute(transformer="diffusers:pipeline-with-code/")
        Flux2DevVAESource.execute(vae="pipeline-with-code/")
        with pytest.raises(MissingWeightsError):
            Flux2DevEncoderLoader.execute(encoder="pickled-encoder/", padding="reference", allow_network=False)
    assert not planted["marker"].exists()
    assert seen["pickle.find_class"] == [] and not [m for (m, *_) in seen["import"] if m in PLANTED_MODULES]


def test_the_command_line_runs_no_code_from_the_files_it_is_given(planted, tmp_path):
    names = ("ckpt", "pt", "bin", "pickled-encoder", "encoder-with-code", "tokenizer-with-code")
    runs = [(verb, planted[name]) for name in names for verb in ("tokenize", "inspect", "encode")]
    for (verb, path), run in zip(runs, run_cli(runs, tmp_path)):
        stderr = run["stderr"]
        assert run["status"] in (0, 2), (verb, path, run)
        if run["status"] == 2:
            assert stderr.startswith(f"flux2dev {verb}: ") and stderr.count("\n") == 1 \
                and not message_faults(stderr), stderr
    assert not planted["marker"].exists(), planted["marker"].read_text()


def test_trust_remote_code_is_never_set():
    """Every mention of trust_remote_code in the pack's own code passes False."""
    mentions = []
    for path in PACKAGE.rglob("*.py"):
        if {".venv", ".comfyui", ".hosts", "tests"} & set(path.relative_to(PACKAGE).parts):
            continue
        mentions += [(path.name, m)
                     for m in re.findall(r"trust_remote_code\s*=\s*\w+", path.read_text(encoding="utf-8"))]
    assert mentions and all(m.endswith("False") for _, m in mentions), mentions
