"""Offline: with HF_HUB_OFFLINE=1 and TRANSFORMERS_OFFLINE=1 set before anything is
imported (huggingface_hub and transformers read them at import time, so the run is a process of its own),
every node works on local tiny files, even with downloads allowed, and nothing touches the network: the
hub rung is never reached when a lower rung gives the tokenizer, and when none does it is skipped with a note
naming the offline setting."""

from __future__ import annotations

import json

import pytest

from helpers import CHILD_WITH_TINY_FOLDERS, run_python

pytestmark = pytest.mark.host  # the nodes run in a child process with the host

OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}

# Runs in a fresh process: every node on the tiny files, the ladder with downloads allowed, and a record of
# every network call Python makes (the socket audit events).
CHILD = r"""
import json, sys
from pathlib import Path

network = []
REACHING_OUT = ("socket.connect", "socket.getaddrinfo", "socket.gethostbyname", "socket.gethostbyaddr")
sys.addaudithook(lambda event, args: network.append(f"{event} {args[1:]}") if event in REACHING_OUT else None)

""" + CHILD_WITH_TINY_FOLDERS + r"""
import huggingface_hub.constants
from comfyui_flux2dev.nodes.encoder import Flux2DevEncoderLoader
from comfyui_flux2dev.nodes.gguf import Flux2DevGGUFTransformerLoader
from comfyui_flux2dev.nodes.sources import Flux2DevEncoderSource, Flux2DevTransformerSource, Flux2DevVAESource
from comfyui_flux2dev.tokenizers import ladder

report = {"hub_offline": huggingface_hub.constants.HF_HUB_OFFLINE, "nodes": {}}
runs = {
    "encoder loader, embedded vocabulary": lambda: Flux2DevEncoderLoader.execute(
        encoder="mistral_3_small_flux2_bf16.safetensors", padding="reference", allow_network=True),
    "encoder loader, GGUF vocabulary": lambda: Flux2DevEncoderLoader.execute(
        encoder="llama-q8_0.gguf", padding="comfy", allow_network=True),
    "encoder loader, tekken.json": lambda: Flux2DevEncoderLoader.execute(
        encoder="hf-mistral3/", padding="reference", allow_network=True),
    "encoder source, transformers tokenizer": lambda: Flux2DevEncoderSource.execute(
        pipeline="flux2-dev-tiny-pipeline/", padding="comfy"),
    "GGUF transformer loader": lambda: Flux2DevGGUFTransformerLoader.execute(
        gguf_name="flux2-dev-tiny-Q8_0.gguf", dequant_dtype="default", patch_dtype="float32"),
    "transformer source, pipeline": lambda: Flux2DevTransformerSource.execute(transformer="flux2-dev-tiny-pipeline/"),
    "transformer source, file": lambda: Flux2DevTransformerSource.execute(
        transformer="flux2-klein-4b-tiny.safetensors"),
    "VAE source": lambda: Flux2DevVAESource.execute(vae="flux2-klein-4b-tiny-pipeline/"),
}
for name, run in runs.items():
    try:
        out = run().result[0]
        if hasattr(out, "tokenize"):  # a CLIP: it encodes, with the tokenizer its rung gave
            shape = list(out.encode_from_tokens(out.tokenize("a red fox")).shape)
            report["nodes"][name] = {"ok": True, "rung": out.flux2dev_encoder["tokenizer"], "shape": shape}
        else:
            report["nodes"][name] = {"ok": True}
    except Exception as e:
        report["nodes"][name] = {"ok": False, "error": f"{type(e).__name__}: {e}"}

found = ladder.resolve_tokenizer([tiny / "text_encoders/standalone"], allow_network=True)
report["lower_rung"] = {"rung": found.rung, "attempts": found.attempts}

# No rung below the hub can give a tokenizer here (an empty folder, and mistral-common's bundled vocabulary
# taken away): the hub is all that is left, and the offline process skips it with a note.
ladder.BUNDLED_TEKKEN = ("data", "no-such-vocabulary.json")
empty = Path(sys.argv[2])
try:
    ladder.resolve_tokenizer([empty], allow_network=True)
    report["hub_only"] = "resolved"
except Exception as e:
    report["hub_only"] = f"{type(e).__name__}: {e}"
report["network"] = network
print(json.dumps(report))
"""


@pytest.fixture(scope="module")
def offline(tiny_root, tmp_path_factory) -> dict:
    empty = tmp_path_factory.mktemp("empty")
    done = run_python(CHILD, tiny_root, empty, env=OFFLINE)
    assert done.returncode == 0, done.stderr[-5000:]
    return json.loads(done.stdout.splitlines()[-1])


def test_the_child_process_is_offline(offline):
    assert offline["hub_offline"] is True


def test_every_node_works_offline_on_local_files(offline):
    failed = {name: r["error"] for name, r in offline["nodes"].items() if not r["ok"]}
    assert not failed
    rungs = {name: r["rung"] for name, r in offline["nodes"].items() if "rung" in r}
    assert rungs == {
        "encoder loader, embedded vocabulary": "embedded-tekken",
        "encoder loader, GGUF vocabulary": "gguf-vocab",
        "encoder loader, tekken.json": "tekken-json",
        "encoder source, transformers tokenizer": "transformers",
    }


def test_nothing_touches_the_network(offline):
    assert offline["network"] == []


def test_the_hub_is_not_reached_when_a_lower_rung_gives_the_tokenizer(offline):
    lower = offline["lower_rung"]
    assert lower["rung"] == "tekken-json"
    assert not [a for a in lower["attempts"] if a[0] == "hub"]


def test_the_hub_rung_is_skipped_with_a_note_when_offline(offline):
    text = offline["hub_only"]
    assert text.startswith("TokenizerNotFoundError: No tokenizer found"), text
    hub = [line for line in text.splitlines() if line.strip().startswith("- hub (")]
    assert len(hub) == 1 and "skipped: HF_HUB_OFFLINE is set, the process is offline" in hub[0], text
