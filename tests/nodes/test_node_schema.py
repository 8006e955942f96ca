"""The nodes as the real server shows them to the UI: their schema (/object_info) and their errors."""

from __future__ import annotations

import time

from comfyui_flux2dev.devtools.workflows import node, official_dev_graph
from test_graphs import encoder, gguf_model, vae

NODE_IDS = ("Flux2DevEncoderLoader", "Flux2DevGGUFTransformerLoader", "Flux2DevVAESource", "Flux2DevEncoderSource",
            "Flux2DevTransformerSource")


# What a user sees in the node list and types into its search; written out here, not read from the pack's table.
TITLES = {
    "Flux2DevEncoderLoader": "Load FLUX.2 text encoder (Mistral)",
    "Flux2DevEncoderSource": "Load FLUX.2 text encoder (pipeline)",
    "Flux2DevGGUFTransformerLoader": "Load FLUX.2 transformer (GGUF)",
    "Flux2DevTransformerSource": "Load FLUX.2 transformer (safetensors or pipeline)",
    "Flux2DevVAESource": "Load FLUX.2 VAE (file or pipeline)",
}
ALIASES = {  # a few of each node's search words
    "Flux2DevEncoderLoader": {"flux2", "text encoder", "mistral", "clip"},
    "Flux2DevEncoderSource": {"flux2", "pipeline", "diffusers", "mistral"},
    "Flux2DevGGUFTransformerLoader": {"flux2", "gguf", "unet", "diffusion model"},
    "Flux2DevTransformerSource": {"flux2", "diffusion model", "pipeline", "diffusers"},
    "Flux2DevVAESource": {"flux2", "vae", "flux2 vae", "pipeline"},
}


def test_the_upsampler_sits_beside_clip_text_encode_and_shows_its_text(comfy_server):
    info = comfy_server.get("/object_info")["Flux2DevPromptUpsampler"]
    assert info["display_name"] == "FLUX.2 [dev] prompt upsampler"
    assert info["category"] == "conditioning/FLUX.2" and info["output_node"]
    assert info["output"] == ["STRING"] and "CLIP Text Encode" in info["description"]
    assert {"image_1", "image_2", "image_3", "cache"} <= set(info["input"]["optional"])


def test_titles_say_what_each_node_loads_and_from_what(comfy_server):
    info = comfy_server.get("/object_info")
    assert {node_id: info[node_id]["display_name"] for node_id in NODE_IDS} == TITLES
    assert all(info[node_id]["category"] == "loaders/FLUX.2" for node_id in NODE_IDS)
    for node_id in NODE_IDS:  # each description names the node to pick instead, where there is one
        others = [t for other, t in TITLES.items() if other != node_id and t in info[node_id]["description"]]
        assert others or node_id == "Flux2DevVAESource", node_id


def test_search_aliases_reach_the_frontend_where_the_host_sends_them(comfy_server):
    """ComfyUI 0.33 sends each node's search aliases in /object_info; 0.3.75 has none to send."""
    info = comfy_server.get("/object_info")
    if comfy_server.get("/system_stats")["system"]["comfyui_version"] == "0.3.75":
        assert all("search_aliases" not in info[node_id] for node_id in NODE_IDS)
        return
    for node_id, wanted in ALIASES.items():
        assert wanted <= set(info[node_id]["search_aliases"]), node_id


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


def test_each_encode_logs_whether_the_cache_served_it_and_where_the_cache_is(comfy_server):
    cache = comfy_server.base_dir / "user" / "flux2dev-log-line-cache"

    def graph(keep_loaded):
        clip = node("Flux2DevEncoderLoader", encoder="mistral_3_small_flux2_bf16.safetensors", padding="reference",
                    allow_network=False, cache="flux2dev-log-line-cache", keep_loaded=keep_loaded)
        return official_dev_graph(gguf_model(), clip, vae(), prompt="a log line, please")

    before = len(comfy_server.log())
    comfy_server.run(graph(True))
    miss = comfy_server.log()[before:]
    assert f"conditioning cache miss, now stored in {cache}" in miss
    assert "FLUX.2 [dev] prompt encoded in " in miss and "cache hit" not in miss
    before = len(comfy_server.log())
    comfy_server.run(graph(False))  # another CLIP node, the same prompt and weights: served by the cache
    hit = comfy_server.log()[before:]
    assert f"FLUX.2 [dev] prompt: conditioning cache hit in {cache} (the encoder did not run)." in hit
    assert "prompt encoded in" not in hit
