"""The bad-input matrix. Each bad input (tests/pack/bad_files.py: the wrong kind of model for a
loader, a folder without weights, half a sharded set, an index naming a file outside the model folder, an
empty file, a folder named like a file, a symlink loop, odd file names, a FIFO) given to each loader, to
`flux2dev inspect`'s reader and to the tokenizer ladder ends in the pack's own error type, whose message
says what was found and what was expected. Nothing blocks, nothing outside the model folder is opened or
quoted, each node fails exactly as its loader does, and the command line prints one sentence."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from bad_files import (
    ESCAPES,
    build_all,
    entry_points,
    message_faults,
    outcome,
    outside_target,
    run_cli,
    secret_faults,
    time_bound,
)
from comfyui_flux2dev.errors import (
    MODULE,
    CorruptFileError,
    MissingWeightsError,
    ModelNotFoundError,
    TokenizerNotFoundError,
    UnknownModelError,
    UnsupportedFormatError,
    VariantMismatchError,
    WrongModelError,
)
from helpers import point_model_folders

ENCODER = ("encoder", "tokenizer", "inspect")  # the verbs that read a text encoder
NOT_GGUF = (CorruptFileError, [r"not a GGUF file"])
NOT_SAFETENSORS = (UnsupportedFormatError, [r"not a \.safetensors file"])
IS_FOLDER = (CorruptFileError, [r"is a folder"])
NOT_REGULAR = (CorruptFileError, [r"is not a regular file"])
OUTSIDE = (CorruptFileError, [r"outside the model folder"])
NOT_A_TRANSFORMER = ((UnknownModelError, WrongModelError), [r"(no|not a) FLUX\.2 transformer"])
NO_TRANSFORMER_WEIGHTS = (MissingWeightsError, [r"holds no transformer weights"])
NO_VAE_WEIGHTS = (MissingWeightsError, [r"holds no vae weights"])
NOT_A_PIPELINE = (WrongModelError, [r"is not a diffusers pipeline folder"])
KLEIN_ENCODER = (WrongModelError, [r"Qwen3 text encoder of FLUX\.2 Klein 4B",
                                    r"not the Mistral-Small 24B encoder FLUX\.2 \[dev\] needs"])


def each(targets, expected) -> dict:
    return dict.fromkeys(targets, expected)


# case -> {target: (the error type or types, patterns its message must hold)}
EXPECTED = {
    "vae-file": {
        **each(("encoder", "tokenizer"), (WrongModelError, [r"^This is a VAE", r"not a text encoder"])),
        "transformer": NOT_A_TRANSFORMER, "gguf": NOT_GGUF, "dev-encoder": NOT_A_PIPELINE,
    },
    "encoder-file": {
        "transformer": NOT_A_TRANSFORMER, "vae": (WrongModelError, [r"is not a VAE"]), "gguf": NOT_GGUF,
        "dev-encoder": NOT_A_PIPELINE,
    },
    "encoder-gguf": {
        "gguf": (WrongModelError, [r"Mistral-Small text encoder", r"not a FLUX\.2 transformer",
                                   r"Load FLUX\.2 text encoder \(Mistral\)"]),
        "transformer": NOT_SAFETENSORS, "vae": NOT_SAFETENSORS,
    },
    "flux1-file": {
        **each(("transformer", "inspect"),
               (WrongModelError, [r"not a FLUX\.2 transformer", r"FLUX\.1", r"Load Diffusion Model"])),
        **each(("encoder", "tokenizer"), (WrongModelError, [r"diffusion transformer, not a text encoder"])),
        "vae": (WrongModelError, [r"is not a VAE"]), "gguf": NOT_GGUF,
    },
    "flux1-gguf": {
        **each(("gguf", "inspect"), (WrongModelError, [r"not a FLUX\.2 transformer", r"FLUX\.1"])),
        **each(("encoder", "tokenizer"), (WrongModelError, [r"FLUX transformer GGUF, not a text encoder"])),
    },
    # An SDXL checkpoint carries a VAE (first_stage_model.*) beside its UNet: it must be named as what it is.
    "sdxl-checkpoint": {
        **each(("encoder", "tokenizer"), (WrongModelError, [r"Stable Diffusion XL", r"not a text encoder"])),
        "inspect": ((WrongModelError, UnknownModelError), [r"Stable Diffusion XL"]),
        "transformer": NOT_A_TRANSFORMER, "vae": (WrongModelError, [r"FLUX\.2 VAE|not a VAE"]), "gguf": NOT_GGUF,
    },
    "llama-gguf": {
        **each(ENCODER,
               (WrongModelError, [r"Llama-family model with a 32000-token vocabulary", r"Mistral-Small 24B encoder"])),
        "gguf": (WrongModelError, [r"text encoder", r"not a FLUX\.2 transformer"]),
    },
    "klein-encoder": {**each(ENCODER, KLEIN_ENCODER), "transformer": NO_TRANSFORMER_WEIGHTS},
    "klein-pipeline": {
        "dev-encoder": (VariantMismatchError, [r"is a FLUX\.2 Klein 4B", r"-wide conditioning, but FLUX\.2 \[dev\]"]),
        "encoder": KLEIN_ENCODER,
    },
    "empty-folder": {
        **each(("encoder", "inspect"), (UnknownModelError, [r"is a folder with no config\.json"])),
        "tokenizer": (TokenizerNotFoundError, [r"holds neither text encoder weights nor tokenizer files"]),
        "transformer": NO_TRANSFORMER_WEIGHTS, "vae": NO_VAE_WEIGHTS, "gguf": IS_FOLDER, "dev-encoder": NOT_A_PIPELINE,
    },
    "config-only": {
        **each(ENCODER, (MissingWeightsError, [r"has a config\.json but no \.safetensors weights"])),
        "transformer": NO_TRANSFORMER_WEIGHTS,
    },
    "pipeline-without-weights": {
        **each(("transformer", "dev-encoder", "inspect"), NO_TRANSFORMER_WEIGHTS),
        "vae": NO_VAE_WEIGHTS, "encoder": (MissingWeightsError, [r"no \.safetensors weights"]),
    },
    "damaged-model-index": each(("dev-encoder", "inspect"),
                                (CorruptFileError, [r"model_index\.json is not valid JSON"])),
    "missing-shard": each(ENCODER, (MissingWeightsError, [r"the index names shard\(s\) that are not there: "
                                                          r"model-00002-of-00002\.safetensors"])),
    "transformer-missing-shard": each(("transformer", "inspect"),
                                      (MissingWeightsError,
                                       [r"not there: diffusion_pytorch_model-00002-of-00002\.safetensors"])),
    "index-names-a-missing-file": each(ENCODER,
                                       (MissingWeightsError, [r"not there: model-00003-of-00003\.safetensors"])),
    **{f"encoder-index-escape-{k}": each(ENCODER, OUTSIDE) for k in ESCAPES},
    **{f"transformer-index-escape-{k}": each(("transformer", "inspect"), OUTSIDE) for k in ESCAPES},
    "empty-safetensors": each(ENCODER + ("transformer", "vae"),
                              (CorruptFileError, [r"too short to be a safetensors file \(0 bytes\)"])),
    "empty-gguf": {
        **each(ENCODER + ("gguf",), (CorruptFileError, [r"too short to be a GGUF file \(0 bytes\)"])),
        **each(("transformer", "vae"), NOT_SAFETENSORS),
    },
    "folder-named-safetensors": {
        **each(("encoder", "inspect"), ((UnknownModelError, CorruptFileError), [r"x\.safetensors is a folder"])),
        "tokenizer": (TokenizerNotFoundError, [r"holds neither text encoder weights nor tokenizer files"]),
        "transformer": NO_TRANSFORMER_WEIGHTS, "vae": NO_VAE_WEIGHTS,
    },
    "folder-named-gguf": {
        **each(("encoder", "inspect"), ((UnknownModelError, CorruptFileError), [r"x\.gguf is a folder"])),
        "gguf": IS_FOLDER,
    },
    "folder-named-safetensors-inside": each(ENCODER, (CorruptFileError, [r"model\.safetensors is a folder"])),
    "symlink-loop-inside": each(ENCODER, (CorruptFileError, [r"model\.safetensors", r"symbolic links"])),
    "symlink-loop-in-transformer": {"transformer": ((MissingWeightsError, CorruptFileError),
                                                    [r"diffusion_pytorch_model"])},
    "symlink-loop": each(ENCODER + ("transformer", "vae"),
                         ((ModelNotFoundError, CorruptFileError, MissingWeightsError), [r"x\.safetensors"])),
    "odd-file-name": each(ENCODER + ("transformer", "vae"),
                          (CorruptFileError, [r"not a readable safetensors file", r"evil"])),
    "odd-folder-name": each(ENCODER, (MissingWeightsError, [r"no \.safetensors weights", r"evil"])),
    "fifo-gguf": {
        **each(ENCODER + ("gguf",), NOT_REGULAR),
        **each(("transformer", "vae"), ((UnsupportedFormatError, MissingWeightsError, CorruptFileError), [r"x\.gguf"])),
    },
    "fifo-safetensors": {
        **each(ENCODER, NOT_REGULAR),
        **each(("transformer", "vae"), ((MissingWeightsError, CorruptFileError), [r"x\.safetensors"])),
    },
    "fifo-inside": each(ENCODER, (CorruptFileError, [r"model\.safetensors is not a regular file"])),
    "fifo-in-transformer": {"transformer": ((MissingWeightsError, CorruptFileError), [r"diffusion_pytorch_model"])},
}
MATRIX = [(case, target) for case, row in EXPECTED.items() for target in row]


@pytest.fixture(scope="module")
def bad(tmp_path_factory, tiny_root) -> dict[str, Path]:
    return build_all(tmp_path_factory.mktemp("bad"), tiny_root)


def faults(error, kinds, words, case: str, path: Path, opened: list[str]) -> list[str]:
    """What is wrong with how a call ended on a bad input; [] when it ended as it must."""
    import re

    if error is None:
        return ["it did not fail"]
    message = str(error)
    found = []
    if type(error).__module__ != MODULE or not isinstance(error, kinds):
        found.append(f"it raised {type(error).__name__}, expected {kinds}")
    found += [f"the message lacks {w!r}" for w in words if not re.search(w, message)]
    found += message_faults(message)
    outside = outside_target(case, path)
    if outside is not None:
        if str(outside) in opened:
            found.append(f"it opened {outside}, outside the model folder")
        found += secret_faults(message, outside)
    return found


@pytest.mark.parametrize("case, target", MATRIX, ids=[f"{c}-{t}" for c, t in MATRIX])
def test_a_bad_input_ends_in_the_packs_error(bad, case, target):
    kinds, words = EXPECTED[case][target]
    error, opened = outcome(entry_points()[target], bad[case])
    assert not faults(error, kinds, words, case, bad[case], opened), f"{type(error).__name__}: {error}"


def test_shards_kept_as_symlinks_into_a_cache_still_load(tiny_root, tmp_path):
    """The Hugging Face cache keeps a snapshot's files as symlinks into blobs/: an index naming files inside
    the folder is fine wherever those links point (the check is on the names, not on where links lead)."""
    from comfyui_flux2dev.loaders.models.encoder import plan_encoder

    src = tiny_root / "text_encoders/hf-mistral3"
    blobs, snapshot = tmp_path / "blobs", tmp_path / "snapshots" / "0123abc"
    blobs.mkdir()
    snapshot.mkdir(parents=True)
    for i, item in enumerate(sorted(src.iterdir())):
        os.link(item, blobs / f"blob{i}")
        (snapshot / item.name).symlink_to(os.path.relpath(blobs / f"blob{i}", snapshot))
    assert plan_encoder(str(snapshot)).layout == "hf-mistral3"


# --- the nodes, in the host's process ------------------------------------------------------------------------

# node id -> (its menu, the loader it calls, how the node is called with a menu name)
NODE_CALLS = {
    "Flux2DevEncoderLoader": ("encoder", "encoder",
                              lambda n, name: n.execute(encoder=name, padding="reference", allow_network=False)),
    "Flux2DevGGUFTransformerLoader": ("gguf", "gguf",
                                      lambda n, name: n.execute(gguf_name=name, dequant_dtype="default",
                                                                patch_dtype="float32")),
    "Flux2DevTransformerSource": ("transformer", "transformer", lambda n, name: n.execute(transformer=name)),
    "Flux2DevVAESource": ("vae", "vae", lambda n, name: n.execute(vae=name)),
    "Flux2DevEncoderSource": ("dev pipeline", "dev-encoder",
                              lambda n, name: n.execute(pipeline=name, padding="reference")),
}
MODEL_FOLDERS = ("text_encoders", "diffusion_models", "diffusers", "vae")
NODE_MATRIX = [(case, node) for case, row in EXPECTED.items() for node, (_, target, _) in NODE_CALLS.items()
               if target in row]


def node_class(node_id: str):
    from comfyui_flux2dev.nodes import NODES

    return next(n for n in NODES if n.define_schema().node_id == node_id)


@pytest.fixture
def model_folders(comfy_host, monkeypatch):
    """point(folder): every model folder the pack's menus read is `folder` alone."""
    return lambda folder: point_model_folders(monkeypatch, {key: [folder] for key in MODEL_FOLDERS})


@pytest.mark.parametrize("case, node", NODE_MATRIX, ids=[f"{c}-{n}" for c, n in NODE_MATRIX])
def test_a_node_fails_on_a_bad_input_as_its_loader_does(bad, model_folders, case, node):
    """A listed input fails in the node exactly as in its loader; one the menu leaves out (a FIFO, a folder
    named like a file) is "no longer there" when a saved workflow names it, or fails as in the loader."""
    from comfyui_flux2dev.host.menus import model_choices

    menu, target, call = NODE_CALLS[node]
    path = bad[case]
    model_folders(path.parent)
    with time_bound():
        listed = [name for name, p in model_choices(menu).items() if p == str(path)]
    name = listed[0] if listed else path.name + ("/" if path.is_dir() else "")
    error, _ = outcome(call, node_class(node), name)
    expected, _ = outcome(entry_points()[target], path)
    assert error is not None and type(error).__module__ == MODULE, f"{type(error).__name__}: {error}"
    same = (type(error), str(error)) == (type(expected), str(expected))
    stale = not listed and isinstance(error, ModelNotFoundError) and "is no longer there" in str(error)
    assert same or stale, f"node: {type(error).__name__}: {error}\nloader: {type(expected).__name__}: {expected}"
    assert not message_faults(str(error))


def test_menus_over_every_bad_input_list_only_what_can_be_read(bad, model_folders):
    """The menus walk a models folder holding all the bad inputs at once without blocking or failing, and
    list no FIFO, loop or other non-regular file (choosing one could only block or fail)."""
    from comfyui_flux2dev.host.menus import MENUS, model_choices

    model_folders(next(iter(bad.values())).parent.parent)
    for menu in MENUS:
        with time_bound():
            choices = model_choices(menu)
        odd = [name for name, path in choices.items()
               if not (os.path.isdir(path) if name.endswith("/") else os.path.isfile(path))]
        assert not odd, (menu, odd)


# --- the command line ------------------------------------------------------------------------------------------

CLI_VERBS = {"inspect": "inspect", "tokenize": "tokenizer", "encode": "encoder"}  # verb -> the matrix target it runs
CLI_MATRIX = [(verb, case) for case, row in EXPECTED.items() for verb, target in CLI_VERBS.items() if target in row]

@pytest.fixture(scope="module")
def cli_runs(bad, tmp_path_factory) -> dict:
    runs = run_cli([(verb, bad[case]) for verb, case in CLI_MATRIX], tmp_path_factory.mktemp("cli"))
    return dict(zip(CLI_MATRIX, runs))


@pytest.mark.parametrize("verb, case", CLI_MATRIX, ids=[f"{v}-{c}" for v, c in CLI_MATRIX])
def test_the_command_line_prints_one_sentence_for_a_bad_input(cli_runs, bad, verb, case):
    run = cli_runs[(verb, case)]
    stderr = run["stderr"]
    assert run["status"] == 2, run
    assert stderr.startswith(f"flux2dev {verb}: ") and stderr.count("\n") == 1, stderr
    assert not message_faults(stderr), (message_faults(stderr), stderr)
    outside = outside_target(case, bad[case])
    if outside is not None:
        assert str(outside) not in run["opened"]
        assert not secret_faults(stderr, outside), stderr
