"""Bad and hostile inputs for the hardening tests (docs/hardening.md), and the tools to watch what a call does with
them: a time bound (a FIFO opened for reading waits for a writer forever), the files it opens (Python's
audit hooks), and the checks every message of the pack must pass.

Each builder writes one input into an empty folder of its own and returns its path, so that a test can
point a host model folder at that folder and find the input in a node's menu as a user would."""

from __future__ import annotations

import builtins
import contextlib
import json
import os
import re
import struct
import sys
import unicodedata
from pathlib import Path

import numpy as np
import torch

from helpers import TESTS, link_tree, time_bound, write_gguf

SECRET = b"SECRET-BYTES-OUTSIDE-THE-MODEL-FOLDER"  # planted at ../../x of every escaping index
# What an index names instead of its second shard: a file outside the model folder, three ways.
ESCAPES = {"relative": "../../x", "passwd": "/etc/passwd", "environ": "/proc/self/environ"}
# Every builtin exception name: none may reach a user, in a message or on the command line.
BUILTIN_ERRORS = sorted(
    name for name, obj in vars(builtins).items() if isinstance(obj, type) and issubclass(obj, BaseException)
) + ["PanicException"]
RAW_NAME = re.compile(rf"\b(?:{'|'.join(BUILTIN_ERRORS)})\b")
ODD = "evil\nname\u202e"  # a newline and a right-to-left override, as a downloaded name may carry


# --- watching a call --------------------------------------------------------------------------------------


_watched: dict[str, list] | None = None  # audit event -> its records, while a `watching` block runs
_hooked = False


def _audit(event: str, args: tuple) -> None:
    if _watched is None or event not in _watched:
        return
    if event == "open":  # builtins.open, io.open, os.open; an fd (os.fdopen) names no file
        if isinstance(args[0], (str, bytes, os.PathLike)):
            _watched[event].append(os.path.abspath(os.fsdecode(args[0])))
    else:
        _watched[event].append(args)


@contextlib.contextmanager
def watching(*events: str):
    """{event: records} of Python audit events inside the block: "open" records the paths opened,
    "pickle.find_class" each class an unpickler looked up, "import" each module imported."""
    global _watched, _hooked
    if not _hooked:
        sys.addaudithook(_audit)  # hooks cannot be removed; it records only inside a block
        _hooked = True
    _watched = found = {event: [] for event in events}
    try:
        yield found
    finally:
        _watched = None


@contextlib.contextmanager
def opened_files():
    """The paths Python opens inside the block."""
    with watching("open") as found:
        yield found["open"]


def outcome(call, *args, seconds: float = 5.0):
    """(the exception call(*args) raised or None, the files it opened), within a time bound."""
    with opened_files() as opened:
        try:
            with time_bound(seconds):
                call(*args)
        except Exception as e:  # BaseExceptions (Blocked, a Rust panic) fail the test where they happen
            return e, opened
    return None, opened


def message_faults(message: str) -> list[str]:
    """What is wrong with a message of the pack as a user would read it; [] when nothing is."""
    faults = []
    if "Traceback" in message:
        faults.append("it holds a traceback")
    raw = RAW_NAME.findall(message)
    if raw:
        faults.append(f"it names Python exception types {sorted(set(raw))}")
    hidden = sorted({f"U+{ord(c):04X}" for c in message if unicodedata.category(c) == "Cf"})
    if hidden:
        faults.append(f"it holds invisible format characters {hidden} (a right-to-left override reorders what the "
                      "user reads)")
    return faults


def secret_faults(message: str, outside: Path) -> list[str]:
    """Whether a message quotes bytes of a file outside the model folder: as text or as the number a reader
    makes of its first 8 bytes."""
    try:
        head = outside.read_bytes()[:8]
    except OSError:
        return []
    shown = [head.decode("latin-1"), str(struct.unpack("<Q", head.ljust(8, b"\0"))[0])]
    return [f"it quotes {outside}: {s!r}" for s in shown if len(s) >= 4 and s in message]


# --- building inputs --------------------------------------------------------------------------------------


def rewrite_index(folder: Path, index: str, shard: str, new_name: str | None) -> None:
    """Point every tensor of `shard` at `new_name` in the folder's index, and take the shard away."""
    path = folder / index
    data = json.loads(path.read_text())
    data["weight_map"] = {k: (new_name if v == shard else v) for k, v in data["weight_map"].items()}
    path.unlink()  # a hard link: write a new file, never through the link into the tiny original
    path.write_text(json.dumps(data))
    (folder / shard).unlink()


def save(path: Path, tensors: dict) -> Path:
    from safetensors.torch import save_file

    save_file(tensors, str(path))
    return path


Z = torch.zeros


def flux1_tensors() -> dict:
    """FLUX.1 [dev] names at toy sizes: image/text/vector inputs and blocks, but no shared modulation."""
    return {
        "img_in.weight": Z(32, 64), "txt_in.weight": Z(32, 16), "vector_in.in_layer.weight": Z(32, 8),
        "guidance_in.in_layer.weight": Z(32, 8), "time_in.in_layer.weight": Z(32, 8),
        "double_blocks.0.img_attn.qkv.weight": Z(96, 32), "double_blocks.0.img_mod.lin.weight": Z(192, 32),
        "single_blocks.0.linear1.weight": Z(96, 32), "final_layer.linear.weight": Z(64, 32),
    }


def sdxl_tensors() -> dict:
    """Stable Diffusion XL checkpoint names (UNet, both CLIP text encoders, VAE) at toy sizes."""
    return {
        "model.diffusion_model.input_blocks.0.0.weight": Z(8, 4, 3, 3),
        "model.diffusion_model.label_emb.0.0.weight": Z(8, 16),
        "model.diffusion_model.middle_block.1.proj_in.weight": Z(8, 8),
        "model.diffusion_model.out.2.weight": Z(4, 8, 3, 3),
        "conditioner.embedders.0.transformer.text_model.embeddings.token_embedding.weight": Z(64, 8),
        "conditioner.embedders.1.model.token_embedding.weight": Z(64, 8),
        "first_stage_model.decoder.conv_in.weight": Z(8, 4, 3, 3),
        "first_stage_model.encoder.conv_in.weight": Z(8, 3, 3, 3),
    }


def truncated_safetensors() -> bytes:
    """A safetensors header that promises 1000 bytes and ends after 20."""
    return struct.pack("<Q", 1000) + b'{"a": {"dtype": "F32'


def fifo(path: Path) -> Path:
    os.mkfifo(path)
    return path


def _hf_encoder(d, tiny, skip=()):
    return link_tree(tiny / "text_encoders/hf-mistral3", d / "mistral-small-3.1", skip)


def _diffusers_transformer(d, tiny, skip=()):
    return link_tree(tiny / "diffusion_models/flux2-klein-4b-tiny-diffusers", d / "flux2-klein-4b-transformer", skip)


ENCODER_INDEX, ENCODER_SHARD = "model.safetensors.index.json", "model-00002-of-00002.safetensors"
TRANSFORMER_INDEX = "diffusion_pytorch_model.safetensors.index.json"
TRANSFORMER_SHARD = "diffusion_pytorch_model-00002-of-00002.safetensors"


def _escaping(make_folder, index: str, shard: str, name: str):
    """A builder of a sharded folder whose index names `name` in place of `shard`."""
    def build(d, tiny):
        folder = make_folder(d, tiny)
        rewrite_index(folder, index, shard, name)
        return folder

    return build


def _escaping_encoder(name):
    return _escaping(_hf_encoder, ENCODER_INDEX, ENCODER_SHARD, name)


def _escaping_transformer(name):
    return _escaping(_diffusers_transformer, TRANSFORMER_INDEX, TRANSFORMER_SHARD, name)


def _hf_with(entry, make):
    """A Hugging Face encoder folder (config.json) whose model.safetensors is `make(path)`."""

    def build(d, tiny):
        folder = d / entry
        folder.mkdir()
        os.link(tiny / "text_encoders/hf-mistral3/config.json", folder / "config.json")
        make(folder / "model.safetensors")
        return folder

    return build


def _transformer_with(make):
    def build(d, tiny):
        folder = d / "flux2-transformer"
        folder.mkdir()
        os.link(tiny / "diffusion_models/flux2-klein-4b-tiny-diffusers/config.json", folder / "config.json")
        make(folder / "diffusion_pytorch_model.safetensors")
        return folder

    return build


def _self_loop(path: Path) -> Path:
    path.symlink_to(path.name)
    return path


def _pipeline_without_weights(d, tiny):
    src, folder = tiny / "diffusers/flux2-dev-tiny-pipeline", d / "flux2-dev"
    for part in ("transformer", "text_encoder"):
        (folder / part).mkdir(parents=True)
        os.link(src / part / "config.json", folder / part / "config.json")
    os.link(src / "model_index.json", folder / "model_index.json")
    return folder


def _damaged_pipeline(d, tiny):
    folder = link_tree(tiny / "diffusers/flux2-klein-4b-tiny-pipeline", d / "flux2-half-downloaded")
    (folder / "model_index.json").unlink()
    (folder / "model_index.json").write_text('{"_class_name": "Flux2Pipeline", "vae": ["diff')
    return folder


def _mkdir(path: Path) -> Path:
    path.mkdir()
    return path


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


# name -> builder(folder, tiny_root) -> the input's path (inside `folder`).
CASES = {
    "vae-file": lambda d, t: link_tree(t / "vae/flux2-ae.safetensors", d / "flux2-ae.safetensors"),
    "encoder-file": lambda d, t: link_tree(t / "text_encoders/mistral_3_small_flux2_bf16.safetensors",
                                           d / "mistral_3_small_flux2_bf16.safetensors"),
    "encoder-gguf": lambda d, t: link_tree(t / "text_encoders/mistral3-q4_0.gguf", d / "mistral-small-3.1-Q4_0.gguf"),
    "flux1-file": lambda d, t: save(d / "flux1-dev.safetensors", flux1_tensors()),
    "flux1-gguf": lambda d, t: write_gguf(d / "flux1-dev-Q8_0.gguf", "flux",
                                          {k: v.numpy() for k, v in flux1_tensors().items()}),
    "sdxl-checkpoint": lambda d, t: save(d / "sd_xl_base_1.0.safetensors", sdxl_tensors()),
    "llama-gguf": lambda d, t: write_gguf(d / "llama-2-7b.Q8_0.gguf", "llama",
                                          {"token_embd.weight": np.zeros((32000, 8), np.float16)}),
    "klein-encoder": lambda d, t: link_tree(t / "diffusers/flux2-klein-4b-tiny-pipeline/text_encoder", d / "qwen3-4b"),
    "klein-pipeline": lambda d, t: link_tree(t / "diffusers/flux2-klein-4b-tiny-pipeline", d / "flux2-klein-4b"),
    "empty-folder": lambda d, t: _mkdir(d / "flux2-dev"),
    "config-only": _hf_with("mistral-small-3.1", lambda p: None),
    "pipeline-without-weights": _pipeline_without_weights,
    "damaged-model-index": _damaged_pipeline,
    "missing-shard": lambda d, t: _hf_encoder(d, t, skip=(ENCODER_SHARD,)),
    "transformer-missing-shard": lambda d, t: _diffusers_transformer(d, t, skip=(TRANSFORMER_SHARD,)),
    "index-names-a-missing-file": _escaping_encoder("model-00003-of-00003.safetensors"),
    **{f"encoder-index-escape-{k}": _escaping_encoder(v) for k, v in ESCAPES.items()},
    **{f"transformer-index-escape-{k}": _escaping_transformer(v) for k, v in ESCAPES.items()},
    "empty-safetensors": lambda d, t: _write(d / "x.safetensors", b""),
    "empty-gguf": lambda d, t: _write(d / "x.gguf", b""),
    "folder-named-safetensors": lambda d, t: _mkdir(d / "x.safetensors"),
    "folder-named-gguf": lambda d, t: _mkdir(d / "x.gguf"),
    "folder-named-safetensors-inside": _hf_with("mistral-small-3.1", _mkdir),
    "symlink-loop-inside": _hf_with("mistral-small-3.1", _self_loop),
    "symlink-loop-in-transformer": _transformer_with(_self_loop),
    "symlink-loop": lambda d, t: _self_loop(d / "x.safetensors"),
    "odd-file-name": lambda d, t: _write(d / f"{ODD}gguf.safetensors", truncated_safetensors()),
    "odd-folder-name": _hf_with(ODD, lambda p: None),
    "fifo-gguf": lambda d, t: fifo(d / "x.gguf"),
    "fifo-safetensors": lambda d, t: fifo(d / "x.safetensors"),
    "fifo-inside": _hf_with("mistral-small-3.1", fifo),
    "fifo-in-transformer": _transformer_with(fifo),
}


def build_all(root: Path, tiny: Path) -> dict[str, Path]:
    """Every case, each in a folder of its own under root (root/<case>/<input>); root/x is what an index's
    `../../x` reaches from an input folder."""
    (root / "x").write_bytes(SECRET)
    paths = {}
    for name, build in CASES.items():
        (root / name).mkdir(parents=True)
        paths[name] = build(root / name, tiny)
    return paths


def outside_target(case: str, path: Path) -> Path | None:
    """The file outside the model folder that an escaping case's index names."""
    for key, name in ESCAPES.items():
        if case.endswith(f"-escape-{key}"):
            return Path(os.path.normpath(path / name))
    return None


# --- the command line, in one process ------------------------------------------------------------------------

# Runs cli.main over every (verb, path), each bounded in time, with file descriptor 2 caught (a Rust panic
# writes there directly), and prints what each printed on stderr, returned, and opened.
_CLI_CHILD = r"""
import json, os, sys, tempfile
sys.path[:0] = sys.argv[2:4]  # the folders of bad_files and of helpers
from bad_files import opened_files
from helpers import time_bound
from comfyui_flux2dev.cli import main

results = []
for verb, path, out in json.loads(open(sys.argv[1], encoding="utf-8").read()):
    extra = {"inspect": [], "tokenize": ["--prompt", "a fox"], "encode": ["--prompt", "a fox", "--out", out]}[verb]
    with tempfile.TemporaryFile() as caught:
        sys.stderr.flush()
        saved = os.dup(2)
        os.dup2(caught.fileno(), 2)
        with opened_files() as opened:
            try:
                with time_bound(20):
                    status = main([verb, path, *extra])
            except BaseException as e:
                status = f"escaped: {type(e).__name__}: {e}"
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)
        caught.seek(0)
        stderr = caught.read().decode("utf-8", "replace")
    results.append({"status": status, "stderr": stderr, "opened": opened})
print(json.dumps(results))
"""


def run_cli(runs: list[tuple[str, Path]], work: Path, env: dict | None = None) -> list[dict]:
    """[{"status", "stderr", "opened"}] of `flux2dev VERB PATH` for each (verb, path), all in one process
    (tokenize and encode with a short prompt, encode writing into `work`)."""
    import subprocess

    listing = work / "runs.json"
    listing.write_text(json.dumps([(verb, str(path), str(work / "out.safetensors")) for verb, path in runs]),
                       encoding="utf-8")
    done = subprocess.run([sys.executable, "-P", "-c", _CLI_CHILD, str(listing), str(Path(__file__).parent),
                           str(TESTS)], capture_output=True, text=True, timeout=600,
                          env={**os.environ, **(env or {})})
    assert done.returncode == 0, done.stderr[-5000:]
    return json.loads(done.stdout.splitlines()[-1])


def entry_points() -> dict:
    """Each entry point a user's file reaches, by the name the tests use."""
    from comfyui_flux2dev.loaders.models.encoder import encoder_tokenizer, load_encoder
    from comfyui_flux2dev.loaders.models.encoder_layouts import tokenizer_folders
    from comfyui_flux2dev.loaders.models.gguf_transformer import load_gguf_transformer
    from comfyui_flux2dev.loaders.models.inspect import inspect_path
    from comfyui_flux2dev.loaders.models.pipeline import dev_encoder_folder
    from comfyui_flux2dev.loaders.models.transformer import load_transformer
    from comfyui_flux2dev.loaders.models.vae import load_vae_state_dict
    from comfyui_flux2dev.tokenizers import resolve_tokenizer

    return {
        "encoder": lambda p: load_encoder(str(p)),
        "tokenizer": lambda p: encoder_tokenizer(str(p)),
        # the folders the encoder loader would give the ladder for a model there
        "ladder": lambda p: resolve_tokenizer(tokenizer_folders(str(p if os.path.isdir(p) else os.path.dirname(p)))),
        "inspect": inspect_path,
        "transformer": load_transformer,
        "gguf": load_gguf_transformer,
        "vae": load_vae_state_dict,
        "dev-encoder": lambda p: load_encoder(str(dev_encoder_folder(p))),
    }
