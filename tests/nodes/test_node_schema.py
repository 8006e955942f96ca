"""The nodes as the real server shows them to the UI: their schema (/object_info) and their errors."""

from __future__ import annotations

import time

from test_graphs import encoder, gguf_model, vae

from comfyui_flux2dev.devtools.workflows import node, official_dev_graph

NODE_IDS = ("Flux2DevEncoderLoader", "Flux2DevGGUFTransformerLoader", "Flux2DevVAESource", "Flux2DevEncoderSource",
            "Flux2DevTransformerSource")


def test_every_input_and_output_has_a_tooltip(comfy_server):
    info = comfy_server.get("/object_info")
    untold = []
    for node_id in NODE_IDS:
        node = info[node_id]
        for group in ("required", "optional"):
            for name, spec in node["input"].get(group, {}).items():
                options = spec[1] if len(spec) > 1 else {}
                if len(options.get("tooltip", "")) < 20:
                    untold.append(f"{node_id} input {name}")
        tooltips = node.get("output_tooltips") or []
        for i, name in enumerate(node["output_name"]):
            if i >= len(tooltips) or not tooltips[i] or len(tooltips[i]) < 20:
                untold.append(f"{node_id} output {name}")
    assert untold == []


def test_error_reports_name_the_package_not_the_install_path(comfy_server):
    """The server loads the pack from a folder with another name; the error type still reads as the package's."""
    prompt_id = comfy_server.submit(official_dev_graph(gguf_model(), encoder("flux2-vae.safetensors"), vae()))
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        status = comfy_server.get(f"/history/{prompt_id}").get(prompt_id, {}).get("status", {})
        errors = [data for kind, data in status.get("messages", []) if kind == "execution_error"]
        if errors:
            assert errors[0]["exception_type"] == "comfyui_flux2dev.errors.WrongModelError"
            return
        time.sleep(0.2)
    raise AssertionError("the graph did not fail")


def test_loads_move_the_progress_bar(comfy_server):
    """Each loader node of a graph sends progress to the UI while it reads its weights; the encoder's are read
    by the node that encodes the first prompt the conditioning cache lacks."""
    graph = official_dev_graph(
        node("Flux2DevGGUFTransformerLoader", gguf_name="flux2-dev-tiny-Q8_0.gguf", dequant_dtype="default",
             patch_dtype="bfloat16"),
        encoder("mistral_3_small_flux2_fp8_channel.safetensors", padding="comfy"),
        node("Flux2DevVAESource", vae="flux2-vae-diffusers/"),
        prompt="progress, please",
    )
    _, messages = comfy_server.run_watched(graph)
    progress = {}
    for m in messages:
        if m["type"] == "progress":
            progress.setdefault(m["data"]["node"], []).append((m["data"]["value"], m["data"]["max"]))
    for loader in ("model", "text", "vae"):
        steps = progress.get(loader, [])
        assert len(steps) >= 2 and steps[-1][0] == steps[-1][1] > 1, (loader, steps)
        assert [value for value, _ in steps] == sorted(value for value, _ in steps)
