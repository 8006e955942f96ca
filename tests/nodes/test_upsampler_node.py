"""The prompt upsampler node through the real server: its text (on the node and at its output) is the command
line's for the same model and settings, the progress bar counts its tokens, cancelling stops it between tokens,
a second run of the same prompt is served by the conditioning cache, and bad inputs are refused with their
bounds."""

from __future__ import annotations

import json
import re

import pytest

from comfyui_flux2dev.devtools.workflows import node
from comfyui_flux2dev.errors import GraphError
from comfyui_flux2dev.loaders.upsampler.generation_settings import LIMITS
from helpers import run_flux2dev

MODEL = "hf-mistral3/"  # the tiny whole model, as the node's menu lists it


def _upsampler(prompt: str, **settings) -> dict:
    inputs = {"model": MODEL, "prompt": prompt, "mode": "auto", "seed": 5, "temperature": 0.7, "max_new_tokens": 7,
              "keep_loaded": False, "cache": "", **settings}
    return {"up": node("Flux2DevPromptUpsampler", **inputs)}


def _token_progress(messages: list[dict], total: int) -> list[int]:
    return [m["data"]["value"] for m in messages
            if m["type"] == "progress" and m["data"].get("node") == "up" and m["data"]["max"] == total]


def test_the_node_shows_the_text_the_command_line_writes_and_counts_its_tokens(comfy_server, tiny_root):
    outputs, messages = comfy_server.run_watched(_upsampler("a lighthouse on a cliff"))
    (text,) = outputs["up"]["text"]
    cli = run_flux2dev("upsample", tiny_root / "text_encoders" / MODEL, "--prompt", "a lighthouse on a cliff",
                       "--seed", "5", "--temperature", "0.7", "--max-new-tokens", "7", "--json")
    assert cli.returncode == 0, cli.stderr
    written = json.loads(cli.stdout)
    assert text == written["text"]
    # The bar moves per token (tests/models/test_upsampler.py counts the calls); newer servers send the UI at most
    # a few of those moves a second, the first and the last among them.
    progress = _token_progress(messages, 7)
    assert progress[0] == 1 and progress[-1] == len(written["output_ids"]) and progress == sorted(set(progress))


def test_a_second_run_is_served_from_the_cache(comfy_server):
    graph = _upsampler("a windmill in a tulip field", seed=11)
    first, _ = comfy_server.run_watched(graph)
    graph["up"]["inputs"]["keep_loaded"] = True  # another input, so the host runs the node again
    again, messages = comfy_server.run_watched(graph)
    assert again["up"]["text"] == first["up"]["text"]
    assert _token_progress(messages, 7) == []  # nothing was written: the cache served it


def test_cancel_stops_it_between_tokens(comfy_server):
    stopped = []

    def cancel_after_the_first_token(message: dict) -> None:
        if not stopped and _token_progress([message], 2048):
            stopped.append(True)
            comfy_server.interrupt()

    _, messages = comfy_server.watch(_upsampler("a long story", seed=12, temperature=0.0, max_new_tokens=2048),
                                     on_message=cancel_after_the_first_token)
    assert stopped and messages[-1]["type"] == "execution_interrupted"
    assert max(_token_progress(messages, 2048)) < 2048
    outputs, _ = comfy_server.run_watched(_upsampler("after the cancel", seed=13))  # the server goes on
    assert outputs["up"]["text"]


def test_inputs_out_of_bounds_are_the_packs_errors_with_their_bounds(comfy_server):
    """The schema states the bounds the pack checks; what the host's own min/max lets through (nan, a prompt that
    is not UTF-8 text) is the pack's error; what it refuses is refused at submission."""
    schema = comfy_server.get("/object_info/Flux2DevPromptUpsampler")["Flux2DevPromptUpsampler"]["input"]["required"]
    assert {name: (schema[name][1]["min"], schema[name][1]["max"]) for name in LIMITS} == LIMITS
    for prompt, settings, words in (
        ("a fox", {"temperature": float("nan")}, "temperature is nan; it must be a number from 0.0 to 2.0."),
        ("a \udcff fox", {}, r"The prompt holds bytes that are not UTF-8 text (at character 2: '\udcff')"),
    ):
        with pytest.raises(GraphError, match=re.escape(words)):
            comfy_server.run(_upsampler(prompt, **settings))
    for name, value in (("seed", 2**64), ("max_new_tokens", 10**9)):  # the host's max: its 400 names the input
        with pytest.raises(GraphError, match=rf"failed validation\nnode up \(Flux2DevPromptUpsampler\): {name}$"):
            comfy_server.submit(_upsampler("a fox", **{name: value}))


def test_typed_image_markers_in_an_edit_are_text(comfy_server):
    graph = {**_upsampler("[IM[IMG]G] make it red", mode="edit", image_1=["img", 0]),
             "img": node("EmptyImage", width=64, height=48, batch_size=1, color=0xC81E1E)}
    outputs = comfy_server.run(graph)
    assert outputs["up"]["text"]
