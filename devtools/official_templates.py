"""The official FLUX.2 [dev] templates (ComfyUI's comfyui-workflow-templates: image_flux2,
image_flux2_text_to_image) with the pack's nodes in place of the host's loaders, wherever they stand: at the top
or inside a subgraph, whose inputs and proxy widgets (the widgets its node shows) are re-pointed to the pack's
widget names."""

from __future__ import annotations

import copy

from .workflow_files import set_widget_values, widget_values

# host node -> (the pack's node, {host widget: the pack's widget}). The pack's other widgets take their defaults;
# the host's others (weight_dtype, the CLIP type and device) have no counterpart.
PACK_NODES = {
    "UNETLoader": ("Flux2DevTransformerSource", {"unet_name": "transformer"}),
    "CLIPLoader": ("Flux2DevEncoderLoader", {"clip_name": "encoder"}),
    "VAELoader": ("Flux2DevVAESource", {"vae_name": "vae"}),
    "LoraLoaderModelOnly": ("Flux2DevLoraLoader", {"lora_name": "lora_name", "strength_model": "strength_model"}),
}


def with_pack_nodes(ui: dict, object_info: dict) -> dict:
    """A copy of a UI-format workflow with each node of PACK_NODES replaced by the pack's (`object_info`: the
    server's node schemas, the host's and the pack's)."""
    ui = copy.deepcopy(ui)
    graphs = [ui, *ui.get("definitions", {}).get("subgraphs", [])]
    renamed = {}  # (graph id, node id) -> {host widget: the pack's}
    for graph in graphs:
        for node in graph["nodes"]:
            if node["type"] in PACK_NODES:
                renamed[(graph.get("id"), node["id"])] = _swap(node, object_info)
    subgraphs = {graph["id"]: graph for graph in graphs[1:]}
    for graph in graphs:
        for node in graph["nodes"]:
            if node["type"] in subgraphs:
                _repoint(node, subgraphs[node["type"]], renamed)
    return ui


def _swap(node: dict, object_info: dict) -> dict:
    pack_type, names = PACK_NODES[node["type"]]
    values = widget_values(node, object_info[node["type"]])
    schema = object_info[pack_type]
    node["widgets_values"] = []
    set_widget_values(node, schema, {names[k]: v for k, v in values.items() if k in names})
    for socket in node.get("inputs", []):
        if socket.get("widget"):
            socket["name"] = socket["localized_name"] = socket["widget"]["name"] = names[socket["name"]]
    links = [out.get("links") for out in node.get("outputs", [])]
    node["outputs"] = [{"localized_name": name, "name": name, "type": kind, "links": links[i] if i < len(links) else []}
                       for i, (name, kind) in enumerate(zip(schema["output_name"], schema["output"]))]
    node["type"] = node.setdefault("properties", {})["Node name for S&R"] = pack_type
    return names


def _repoint(instance: dict, subgraph: dict, renamed: dict) -> None:
    """A subgraph node's inputs and proxy widgets, and its subgraph's inputs, named after the pack's widgets."""
    inner = {link["id"]: (link["target_id"], link["target_slot"]) for link in subgraph["links"]}
    nodes = {node["id"]: node for node in subgraph["nodes"]}
    for entry in subgraph["inputs"]:
        targets = [inner[link] for link in entry.get("linkIds", [])]
        new = {nodes[n]["inputs"][slot]["name"] for n, slot in targets if (subgraph["id"], n) in renamed}
        if len(new) == 1:
            old, entry["name"] = entry["name"], new.pop()
            for socket in instance.get("inputs", []):
                if socket["name"] == old:
                    socket["name"] = entry["name"]
                    if "widget" in socket:
                        socket["widget"]["name"] = entry["name"]
    instance["properties"]["proxyWidgets"] = [
        [node_id, renamed.get((subgraph["id"], int(node_id)), {}).get(widget, widget)]
        for node_id, widget in instance["properties"].get("proxyWidgets", [])]
