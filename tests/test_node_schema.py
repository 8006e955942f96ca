"""The nodes as the real server describes them to the UI (/object_info)."""

from __future__ import annotations

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
