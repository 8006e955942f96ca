"""Workflow files in both of ComfyUI's formats: the UI format the frontend saves and loads (nodes with
positions, links, widget values) and the API format the server runs. The node schemas (/object_info)
say which inputs are links and which are widgets, and in what order the widgets stand."""

from __future__ import annotations

import uuid

# The frontend adds a value after some widgets: the seed's "control after generate" and the image upload.
EXTRA_WIDGET_VALUES = {"control_after_generate": "fixed", "image_upload": "image"}
COLUMN_WIDTH, NODE_WIDTH, ROW_GAP = 400, 340, 40


def _inputs(schema: dict) -> list[tuple[str, list]]:
    """(name, spec) of a node's inputs in the order the frontend lays out its widgets."""
    return [item for group in ("required", "optional") for item in schema["input"].get(group, {}).items()]


def _options(spec: list) -> dict:
    return spec[1] if len(spec) > 1 and isinstance(spec[1], dict) else {}


def _is_widget(spec: list) -> bool:
    kind = spec[0]
    return isinstance(kind, list) or kind in ("INT", "FLOAT", "STRING", "BOOLEAN", "COMBO")


def _extras(spec: list) -> list:
    return [value for option, value in EXTRA_WIDGET_VALUES.items() if _options(spec).get(option)]


def _height(schema: dict, links: int) -> int:
    widgets = [spec for _, spec in _inputs(schema) if _is_widget(spec)]
    tall = sum(1 for spec in widgets if _options(spec).get("multiline"))
    rows = max(links, len(schema["output"])) + len(widgets) - tall
    return 46 + 24 * rows + 140 * tall


def api_to_ui(graph: dict, object_info: dict, downloads: dict[str, tuple[str, str]] | None = None) -> dict:
    """The UI-format workflow of an API graph, laid out left to right, one column per step: a node stands one
    column right of its deepest input. downloads: {model file name: (model folder, download address)}; a node
    naming such a file lists it in its properties, where the frontend's missing-models dialog reads it."""
    downloads = downloads or {}
    ids = {key: i for i, key in enumerate(graph, 1)}
    depth: dict[str, int] = {}

    def column(key: str) -> int:
        if key not in depth:
            sources = [v[0] for v in graph[key]["inputs"].values() if isinstance(v, list)]
            depth[key] = 1 + max((column(s) for s in sources), default=-1)
        return depth[key]

    consumers: dict[str, list[str]] = {}
    for key, node in graph.items():
        for value in node["inputs"].values():
            if isinstance(value, list):
                consumers.setdefault(value[0], []).append(key)
    for key in graph:
        column(key)
    for key in graph:  # a node that takes no links stands just before its first consumer, not far to the left
        if depth[key] == 0 and key in consumers:
            depth[key] = max(0, min(depth[c] for c in consumers[key]) - 1)

    links, nodes, outputs = [], [], {}
    for key, node in graph.items():
        for name, value in node["inputs"].items():
            if isinstance(value, list):
                links.append([len(links) + 1, ids[value[0]], value[1], ids[key], name])
                outputs.setdefault((value[0], value[1]), []).append(len(links))
    y_of_column: dict[int, int] = {}
    for key, node in graph.items():
        schema = object_info[node["class_type"]]
        node_links = {link[4]: link for link in links if link[3] == ids[key]}
        inputs, widgets = [], []
        for name, spec in _inputs(schema):
            if name in node_links:  # a widget fed by a link shows as its input socket
                widget = {"widget": {"name": name}} if _is_widget(spec) else {}
                inputs.append({"name": name, "type": spec[0], **widget, "link": node_links[name][0]})
            elif _is_widget(spec):
                widgets += [node["inputs"][name], *_extras(spec)]
        outs = [
            {"name": name, "type": kind, "links": outputs.get((key, slot), []), "slot_index": slot}
            for slot, (name, kind) in enumerate(zip(schema["output_name"], schema["output"]))
        ]
        x = column(key)
        height = _height(schema, len(inputs))
        y = y_of_column.get(x, 0)
        y_of_column[x] = y + height + ROW_GAP
        nodes.append({
            "id": ids[key], "type": node["class_type"], "pos": [x * COLUMN_WIDTH, y], "size": [NODE_WIDTH, height],
            "flags": {}, "order": 0, "mode": 0, "inputs": inputs, "outputs": outs,
            "title": node.get("_meta", {}).get("title", schema["display_name"]),
            "properties": {"Node name for S&R": node["class_type"], **_models(widgets, downloads)},
            "widgets_values": widgets,
        })
    for order, n in enumerate(sorted(nodes, key=lambda n: (column(_key(graph, ids, n["id"])), n["id"]))):
        n["order"] = order
    ui_links = []
    for link_id, origin, slot, target, name in links:
        target_node = next(n for n in nodes if n["id"] == target)
        target_slot = next(i for i, inp in enumerate(target_node["inputs"]) if inp["name"] == name)
        kind = target_node["inputs"][target_slot]["type"]
        ui_links.append([link_id, origin, slot, target, target_slot, kind])
    return {
        "id": str(uuid.uuid5(uuid.NAMESPACE_URL, "comfyui-flux2dev/" + ",".join(sorted(ids)))),
        "revision": 0, "last_node_id": len(nodes), "last_link_id": len(ui_links), "nodes": nodes,
        "links": ui_links, "groups": [], "config": {}, "extra": {"ds": {"scale": 1, "offset": [90, 140]}},
        "version": 0.4,
    }


def _models(widgets: list, downloads: dict[str, tuple[str, str]]) -> dict:
    found = [{"name": v, "url": downloads[v][1], "directory": downloads[v][0]}
             for v in widgets if isinstance(v, str) and v in downloads]
    return {"models": found} if found else {}


def _key(graph: dict, ids: dict, node_id: int) -> str:
    return next(key for key in graph if ids[key] == node_id)


def ui_to_api(ui: dict, object_info: dict) -> dict:
    """The API graph a UI-format workflow runs as (what the frontend sends when a user queues it)."""
    links = {link[0]: link for link in ui["links"]}
    graph = {}
    for n in ui["nodes"]:
        if n.get("mode", 0) != 0:
            continue
        schema = object_info[n["type"]]
        linked = {inp["name"]: inp["link"] for inp in n.get("inputs", []) if inp.get("link") is not None}
        values = iter(n.get("widgets_values", []))
        inputs = {}
        for name, spec in _inputs(schema):
            if name in linked:
                link = links[linked[name]]
                inputs[name] = [str(link[1]), link[2]]
            elif _is_widget(spec):
                inputs[name] = next(values)
                for _ in _extras(spec):
                    next(values)
        graph[str(n["id"])] = {"class_type": n["type"], "inputs": inputs}
    return graph
