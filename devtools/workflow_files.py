"""Workflow files in both of ComfyUI's formats: the UI format the frontend saves and loads (nodes with
positions, links, widget values) and the API format the server runs. The node schemas (/object_info)
say which inputs are links and which are widgets, and in what order the widgets stand."""

from __future__ import annotations

import uuid

# The frontend adds a value after some widgets: the seed's "control after generate" and the image upload.
EXTRA_WIDGET_VALUES = {"control_after_generate": "fixed", "image_upload": "image"}
COLUMN_WIDTH, NODE_WIDTH, ROW_GAP = 400, 340, 40
# LiteGraph's node modes: ALWAYS runs; no other does (muted: 2), and a BYPASS node passes its inputs on.
ALWAYS, BYPASS = 0, 4
FRONTEND_ONLY = ("Note", "MarkdownNote")  # drawn by the frontend, never sent to the server
SUBGRAPH_INPUT, SUBGRAPH_OUTPUT = -10, -20  # the ids a subgraph's links give its inputs and outputs
_WIDGET = object()  # a subgraph input no link feeds: the inner node's own widget value stands


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
            "flags": {}, "order": 0, "mode": node.get("mode", ALWAYS), "inputs": inputs, "outputs": outs,
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
    """The API graph a UI-format workflow runs as (what the frontend sends when a user queues it): the nodes of its
    subgraphs take their place, with ids "<subgraph node>:<inner node>"; a muted node is left out, a bypassed one
    passes its inputs on (the frontend's rule, _bypass_input); nodes the frontend alone draws are left out."""
    subgraphs = {sg["id"]: sg for sg in ui.get("definitions", {}).get("subgraphs", [])}
    graph: dict = {}
    _add_nodes(_Scope("", ui, None, None), subgraphs, object_info, graph)
    return graph


class _Scope:
    """The top graph, or one subgraph node's copy of its definition: its nodes, its links (origin id, origin slot,
    target id, target slot) and the prefix of its nodes' API ids."""

    def __init__(self, prefix: str, graph: dict, instance: dict | None, parent: _Scope | None):
        self.prefix, self.graph, self.instance, self.parent = prefix, graph, instance, parent
        self.nodes = {n["id"]: n for n in graph["nodes"]}
        self.links = {link[0]: tuple(link[1:5]) for link in graph["links"] if isinstance(link, list)}
        self.links.update({link["id"]: (link["origin_id"], link["origin_slot"], link["target_id"],
                                        link["target_slot"]) for link in graph["links"] if isinstance(link, dict)})

    def inner(self, node: dict, subgraphs: dict) -> _Scope:
        return _Scope(f"{self.prefix}{node['id']}:", subgraphs[node["type"]], node, self)


def _add_nodes(scope: _Scope, subgraphs: dict, object_info: dict, graph: dict) -> None:
    for n in scope.graph["nodes"]:
        if n["type"] in FRONTEND_ONLY or n.get("mode", ALWAYS) != ALWAYS:
            continue
        if n["type"] in subgraphs:
            _add_nodes(scope.inner(n, subgraphs), subgraphs, object_info, graph)
            continue
        schema = object_info[n["type"]]
        sockets = {inp["name"]: inp for inp in n.get("inputs", []) if inp.get("link") is not None}
        values = widget_values(n, schema)
        inputs = {}
        for name, _ in _inputs(schema):
            source = _source(scope, *scope.links[sockets[name]["link"]][:2], subgraphs) if name in sockets else _WIDGET
            if source is _WIDGET and name in values:
                inputs[name] = values[name]
            elif isinstance(source, list):
                inputs[name] = source
        graph[f"{scope.prefix}{n['id']}"] = {"class_type": n["type"], "inputs": inputs}


def _source(scope: _Scope, origin: int, slot: int, subgraphs: dict) -> list | object | None:
    """What a link from `origin`'s output `slot` carries in the API graph: [node id, slot], _WIDGET, or None
    (a muted node's output, or a bypassed one's without an input of its type)."""
    if origin == SUBGRAPH_INPUT:
        name = scope.graph["inputs"][slot]["name"]
        outer = next((inp for inp in scope.instance.get("inputs", []) if inp["name"] == name), {})
        if outer.get("link") is None:
            return _WIDGET
        return _source(scope.parent, *scope.parent.links[outer["link"]][:2], subgraphs)
    node = scope.nodes[origin]
    mode = node.get("mode", ALWAYS)
    if mode == BYPASS:
        passed = _bypass_input(node, slot)
        return None if passed is None else _source(scope, *scope.links[passed["link"]][:2], subgraphs)
    if mode != ALWAYS:
        return None
    if node["type"] in subgraphs:
        inner = scope.inner(node, subgraphs)
        origin, slot = next((o, s) for o, s, target, target_slot in inner.links.values()
                            if (target, target_slot) == (SUBGRAPH_OUTPUT, slot))
        return _source(inner, origin, slot, subgraphs)
    return [f"{scope.prefix}{origin}", slot]


def _bypass_input(node: dict, slot: int) -> dict | None:
    """The linked input a bypassed node passes to its output `slot`, as the frontend picks it: the input in the same
    place if it has the output's type, else the first input of that type."""
    kind = node["outputs"][slot]["type"]
    inputs = node.get("inputs", [])
    same_place = [inputs[slot]] if slot < len(inputs) else []
    passed = next((inp for inp in same_place + inputs if inp["type"] == kind), None)
    return passed if passed is not None and passed.get("link") is not None else None


def _saved_widgets(node: dict, schema: dict) -> list[tuple[str, list, list]]:
    """(name, spec, [its value, the extra values after it]) of each widget a node's widgets_values holds. The
    frontend saves a value for every widget, linked or not; api_to_ui (as frontends before widget sockets did)
    leaves the linked ones out."""
    widgets = [(name, spec) for name, spec in _inputs(schema) if _is_widget(spec)]
    saved = node.get("widgets_values", [])
    if len(saved) != sum(1 + len(_extras(spec)) for _, spec in widgets):
        linked = {inp["name"] for inp in node.get("inputs", []) if inp.get("link") is not None}
        widgets = [(name, spec) for name, spec in widgets if name not in linked]
    out, at = [], 0
    for name, spec in widgets:
        width = 1 + len(_extras(spec))
        if at < len(saved):
            out.append((name, spec, saved[at:at + width]))
        at += width
    return out


def widget_values(node: dict, schema: dict) -> dict:
    """name -> value of a UI node's widgets (`schema`: its /object_info entry)."""
    return {name: held[0] for name, _, held in _saved_widgets(node, schema)}


def set_widget_values(node: dict, schema: dict, values: dict) -> None:
    """Writes `values` (name -> value) into a UI node's widgets_values, which then holds a value for every widget,
    as the frontend saves it; a widget neither `values` nor the node has takes its default."""
    saved = {name: held for name, _, held in _saved_widgets(node, schema)}
    out = []
    for name, spec in _inputs(schema):
        if _is_widget(spec):
            held = saved.get(name) or [_default(spec), *_extras(spec)]
            out += [values.get(name, held[0]), *held[1:]]
    node["widgets_values"] = out


def _default(spec: list):
    options = _options(spec)
    if "default" in options:
        return options["default"]
    choices = spec[0] if isinstance(spec[0], list) else options.get("options", [None])
    return choices[0]
