"""The mutations of an input: structure-aware ones for each format (a JSON value at a random path retyped,
made huge or deeply nested; safetensors header lengths and entries; GGUF counts, values, vocabulary arrays
and tensor dims, types and offsets; JSON lines) and raw ones (bit flips, interesting integers, insertions,
deletions, truncation)."""

from __future__ import annotations

import copy
import json
import math
import random
import struct
from typing import Any

from .files import G_ARRAY, G_STRING, FileSpec, GArray, Gguf, JsonLines, RawFile, Safetensors

INTERESTING_INTS = (0, 1, -1, 2, 3, 7, 32, 255, 256, 1000, 65535, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**53 + 1,
                    2**62, 2**63 - 1, 2**63, 2**64 - 1, 2**64, -(2**63), 10**5, 10**6, 10**7, 10**100)
INTERESTING_FLOATS = (0.5, -0.0, 1e308, -1e308, 1e-308, math.inf, -math.inf, math.nan, 1e9, 3.0)
INTERESTING_STRINGS = (
    "", "0", "-1", "1e308", "Infinity", "NaN", "null", "true", "gpt2", "llama", "mistral3", "flux", "BF16", "U8",
    "../canary", "../../canary", "../../../canary", "../../../../canary", "/etc/passwd", "/proc/self/environ",
    "../../../../../../../../etc/passwd", ".", "..", "a\nb", "\u202eevil.safetensors", "\ud800", "\x00", "<s>",
    "[INST]", "x" * 4096, "model.safetensors", "diffusion_pytorch_model.safetensors",
)
DEEP, BLOAT = "@@deep@@", "@@bloat@@"  # stand for a deeply nested and a huge value in serialised JSON


def _json_value(rng: random.Random, depth: int = 0) -> Any:
    kind = rng.randrange(8)
    if kind == 0:
        return rng.choice(INTERESTING_INTS)
    if kind == 1:
        return rng.choice(INTERESTING_FLOATS)
    if kind == 2:
        return rng.choice(INTERESTING_STRINGS)
    if kind == 3:
        return None
    if kind == 4:
        return rng.random() < 0.5
    if kind == 5 and depth < 2:
        return [_json_value(rng, depth + 1) for _ in range(rng.randrange(4))]
    if kind == 6 and depth < 2:
        return {rng.choice(("a", "dtype", "shape", "rank", "token_bytes", "weight_map")): _json_value(rng, depth + 1)}
    return {}


def _retyped(value: Any, rng: random.Random) -> Any:
    """The same value in another JSON type: string <-> number <-> array <-> object <-> null."""
    forms = [str(value) if not isinstance(value, str) else value + "x", [value], {"value": value}, None]
    if isinstance(value, str):
        try:
            forms.append(float(value))
        except ValueError:
            forms.append(len(value))
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        forms += [float(value) if isinstance(value, int) else int(value) if math.isfinite(value) else 0, value == 0]
    elif isinstance(value, (list, dict)):
        forms += [len(value), json.dumps(value)[:100]]
    return rng.choice(forms)


def _walk(doc: Any, rng: random.Random, stop: float = 0.3) -> list:
    """A random path into `doc`: every level is as likely a stop as the leaves, so top fields get hit."""
    path, node = [], doc
    while isinstance(node, (dict, list)) and node and (not path or rng.random() > stop):
        key = rng.choice(list(node)) if isinstance(node, dict) else rng.randrange(len(node))
        path.append(key)
        node = node[key]
    return path


def _get(doc, path):
    for key in path:
        doc = doc[key]
    return doc


def mutate_json(doc: Any, rng: random.Random, notes: list[str]) -> tuple[Any, str]:
    """A copy of `doc` changed at a random path, and the text to write (with deep or huge values spliced)."""
    doc = copy.deepcopy(doc)
    path = _walk(doc, rng)
    old = _get(doc, path)
    op = rng.choice(("retype", "number", "string", "value", "delete", "insert", "empty", "deep", "repeat",
                     "number", "retype", "value"))
    splice = None
    if op == "retype":
        new = _retyped(old, rng)
    elif op == "number":
        new = rng.choice(INTERESTING_INTS + INTERESTING_FLOATS)
    elif op == "string":
        new = rng.choice(INTERESTING_STRINGS)
    elif op == "value":
        new = _json_value(rng)
    elif op == "empty":
        new = type(old)() if isinstance(old, (dict, list, str)) else []
    elif op == "repeat":
        new = [old] * rng.choice((2, 100, 10000)) if not isinstance(old, (dict, list)) or len(json.dumps(old)) < 2000 \
            else [old, old]
    elif op == "deep":
        new, splice = DEEP, (DEEP, rng.choice((64, 1000, 100000)))
    elif op == "delete" and path:
        parent = _get(doc, path[:-1])
        del parent[path[-1]]
        notes.append(f"json: delete {_show_path(path)}")
        return doc, json.dumps(doc, allow_nan=True)
    else:  # insert into the container at the path (or next to the value)
        container = old if isinstance(old, (dict, list)) else _get(doc, path[:-1]) if path else None
        if isinstance(container, dict):
            container[rng.choice(("__metadata__", "x", "0", "weight_map", "special_tokens", "",
                                  "\u202e"))] = _json_value(rng)
        elif isinstance(container, list):
            container.insert(rng.randrange(len(container) + 1), _json_value(rng))
        notes.append(f"json: insert into {_show_path(path)}")
        return doc, json.dumps(doc, allow_nan=True)
    if rng.random() < 0.01:
        new, splice = BLOAT, (BLOAT, rng.choice((32, 48, 64)) << 20)
    if path:
        _get(doc, path[:-1])[path[-1]] = new
    else:
        doc = new
    text = json.dumps(doc, allow_nan=True)
    notes.append(f"json: {op} {_show_path(path)} = {str(new)[:80]!r}" + (f" ({splice[1]})" if splice else ""))
    if splice is not None:
        marker, n = splice
        if marker == DEEP:
            filler = "[" * n + "0" + "]" * n
        else:  # empty objects: what costs a JSON parser the most per byte
            filler = "[" + "{}," * (n // 3) + "{}]"
        text = text.replace(json.dumps(marker), filler, 1)
    return doc, text


def _show_path(path: list) -> str:
    return "/" + "/".join(str(p) for p in path)


ODD_LINES = ("", "\ufeff\"x\"", '"a\u2028b"', '"a\u2029b"', '"\\ud800"', '"\\udfff\\ud800"', "\r", "[" * 64 + "]" * 64,
             "null", "5", '{"prompt": "x"}', '"x', "\x00", '"[INST] <s> <pad> [IMG]"', " " * 10000)


def mutate_lines(model: JsonLines, rng: random.Random, notes: list[str]) -> RawFile:
    """A prompts file with one line's JSON mutated, an odd line inserted, or a line repeated many times."""
    lines = [json.dumps(v, ensure_ascii=False) for v in model.values]
    at = rng.randrange(len(lines))
    op = rng.choice(("json", "json", "odd", "repeat"))
    if op == "json":
        _, lines[at] = mutate_json(model.values[at], rng, notes)
    elif op == "odd":
        lines.insert(at, rng.choice(ODD_LINES))
        notes.append(f"lines: odd line {lines[at][:40]!r} at {at}")
    else:
        lines[at:at + 1] = [lines[at]] * rng.choice((100, 10000))
        notes.append(f"lines: line {at} repeated")
    return RawFile("\n".join(lines).encode("utf-8", "surrogatepass"))


def mutate_safetensors(model: Safetensors, rng: random.Random, notes: list[str]) -> Safetensors:
    model = Safetensors(copy.deepcopy(model.header), model.data, model.data_size, model.length)
    op = rng.choice(("length", "json", "json", "entry", "entry", "entry", "metadata"))
    names = [n for n in model.header if n != "__metadata__"]
    if op == "length":
        text_len = len(json.dumps(model.header).encode())
        model.length = rng.choice((0, 1, 2, text_len - 1, text_len + 1, text_len + 8, model.data_size, 2**63,
                                   2**64 - 1, (100 << 20) + 1, rng.choice(INTERESTING_INTS)))
        notes.append(f"safetensors: header length = {model.length}")
    elif op == "metadata":
        model.header["__metadata__"] = rng.choice(({"format": rng.choice(INTERESTING_INTS)}, [], "pt", None,
                                                   {"a": {"b": 1}}, _json_value(rng)))
        notes.append(f"safetensors: __metadata__ = {str(model.header['__metadata__'])[:60]}")
    elif op == "entry" and names:
        name = rng.choice(names)
        entry = model.header[name]
        what = rng.choice(("dtype", "shape", "data_offsets", "delete"))
        if not isinstance(entry, dict):
            entry = model.header[name] = {}
        if what == "dtype":
            entry["dtype"] = rng.choice(("BF16", "F16", "F32", "F64", "U8", "I64", "F8_E4M3", "F8_E5M2", "F4",
                                         "Q4_K", "", "bf16", 7, None, ["BF16"]))
        elif what == "shape":
            shape = list(entry.get("shape") or [1])
            choice = rng.randrange(5)
            if choice == 0 and shape:
                shape[rng.randrange(len(shape))] = rng.choice(INTERESTING_INTS + INTERESTING_FLOATS + ("3", None))
            elif choice == 1:
                shape.append(rng.choice((1, 0, 2)))
            elif choice == 2:
                shape = shape[:-1]
            elif choice == 3:
                shape = rng.choice(([], [0], [[1]], [2**63, 2**63], [-1, -1], "1,2"))
            else:
                shape = shape[::-1]
            entry["shape"] = shape
        elif what == "data_offsets":
            offsets = entry.get("data_offsets")
            ok = isinstance(offsets, list) and len(offsets) >= 2 and all(type(o) is int for o in offsets[:2])
            start, end = offsets[:2] if ok else (0, 0)
            entry["data_offsets"] = rng.choice(([end, start], [start, 2**64], [-1, end], [start], [start, end, 1],
                                                "0,1", [start + 1, end + 1], [1.5, end], [start, math.inf],
                                                [0, model.data_size + 1], [start, start]))
        else:
            entry.pop(rng.choice(("dtype", "shape", "data_offsets")), None)
        notes.append(f"safetensors: {name} {what} -> {str(entry)[:100]}")
    else:
        model.header, model.text = mutate_json(model.header, rng, notes)
    return model


def _g_random_value(rng: random.Random) -> tuple[int, Any]:
    vtype = rng.choice((0, 4, 5, 6, 7, 10, 11, 12, G_STRING, G_STRING, G_ARRAY, G_ARRAY, 13, 2**32 - 1))
    if vtype == G_STRING:
        return vtype, rng.choice(INTERESTING_STRINGS + (b"\xff\xfe", b"\xc3"))
    if vtype == G_ARRAY:
        itype = rng.choice((0, 4, 6, G_STRING, G_ARRAY, 13))
        items = [] if itype in (G_ARRAY, 13) else [rng.choice(INTERESTING_INTS) if itype != G_STRING else "x"
                                                  for _ in range(rng.randrange(4))]
        return vtype, GArray(itype, items, rng.choice((None, None, 0, 2**63, 2**64 - 1, 5)))
    if vtype in (6, 12):
        return vtype, rng.choice(INTERESTING_FLOATS + (1.0, 0.0))
    return vtype, rng.choice(INTERESTING_INTS)


def mutate_gguf(model: Gguf, rng: random.Random, notes: list[str]) -> Gguf:
    model = copy.copy(model)
    model.kvs = [list(kv) for kv in model.kvs]
    model.tensors = [[t[0], list(t[1]), t[2], t[3]] for t in model.tensors]
    arch = next((v for k, _, v in model.kvs if k == "general.architecture" and isinstance(v, str)), "flux")
    op = rng.choice(("version", "count", "kv", "kv", "kv-type", "kv-delete", "kv-add", "kv-add", "array", "array",
                     "vocab", "vocab", "bloat", "tensor-dims", "tensor-dims", "tensor-type", "tensor-offset",
                     "tensor-offset", "tensor-name", "tensor-delete"))
    if op == "version":
        model.version = rng.choice((0, 1, 2, 3, 4, 0x03000000, 2**32 - 1))
        notes.append(f"gguf: version {model.version}")
    elif op == "count":
        which = rng.choice(("n_tensors", "n_kv"))
        actual = len(model.tensors if which == "n_tensors" else model.kvs)
        setattr(model, which, rng.choice((0, actual - 1, actual + 1, 2**63, 2**64 - 1, 2**32, 10**6)))
        notes.append(f"gguf: {which} = {getattr(model, which)}")
    elif op in ("kv", "kv-type", "kv-delete") and model.kvs:
        favoured = [kv for kv in model.kvs if kv[0].startswith(("tokenizer.", "general.", arch))]
        kv = rng.choice(favoured if favoured and rng.random() < 0.7 else model.kvs)
        if op == "kv":
            kv[1], kv[2] = _g_random_value(rng)
        elif op == "kv-type":
            kv[1] = rng.choice((0, 4, 6, 7, 10, 12, G_STRING, G_ARRAY, 13))
            if kv[1] == G_ARRAY and not isinstance(kv[2], GArray):
                kv[2] = GArray(G_STRING if isinstance(kv[2], str) else 4, [kv[2]])
            elif kv[1] != G_ARRAY and isinstance(kv[2], GArray):
                kv[2] = kv[2].items[0] if kv[2].items else 0
        else:
            model.kvs.remove(kv)
        notes.append(f"gguf: {op} {kv[0]} -> type {kv[1]} {str(kv[2])[:60]}")
    elif op == "kv-add":
        key = rng.choice(("general.alignment", "general.architecture", f"{arch}.attention.head_count",
                          f"{arch}.attention.head_count_kv", f"{arch}.rope.freq_base", "tokenizer.ggml.model",
                          "tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "x"))
        vtype, value = _g_random_value(rng)
        if key == "general.alignment" and rng.random() < 0.5:
            vtype, value = 4, rng.choice((0, 1, 3, 7, 64, 2**31, 2**32 - 1))
        existing = next((kv for kv in model.kvs if kv[0] == key), None)
        if existing is not None and rng.random() < 0.7:
            existing[1], existing[2] = vtype, value
        else:
            model.kvs.append([key, vtype, value])
        notes.append(f"gguf: set {key} = type {vtype} {str(value)[:60]}")
    elif op in ("array", "vocab"):
        arrays = [kv for kv in model.kvs if isinstance(kv[2], GArray)]
        vocab = [kv for kv in arrays if kv[0] in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type")]
        pool = vocab if op == "vocab" and vocab else arrays
        if pool:
            kv = rng.choice(pool)
            kv[2] = array = GArray(kv[2].itype, list(kv[2].items), kv[2].count)
            how = rng.randrange(7)
            if how == 0:
                array.count = rng.choice((0, len(array.items) + 1, len(array.items) - 1, 2**63, 2**64 - 1, 2**40))
            elif how == 1 and array.items:
                i = rng.randrange(min(len(array.items), rng.choice((20, 1100, len(array.items)))))
                array.items[i] = (rng.choice(INTERESTING_STRINGS + (b"\xff", "Ġ", array.items[0]))
                                  if array.itype == G_STRING else rng.choice(INTERESTING_INTS))
            elif how == 2:
                array.items = array.items[: rng.randrange(len(array.items) + 1)]
            elif how == 3 and array.items:
                i = rng.randrange(len(array.items))
                array.items[i:i] = array.items[i : i + rng.choice((1, 10, 500))]
            elif how == 4:
                array.itype = rng.choice((0, 4, 6, 7, 10, G_STRING, G_ARRAY, 13))
                if array.itype == G_STRING:
                    array.items = [str(x) for x in array.items]
                elif array.itype in (G_ARRAY, 13):
                    array.items = []
                else:
                    array.items = [len(x) if isinstance(x, (str, bytes)) else x for x in array.items]
            elif how == 5 and array.itype == G_STRING:
                # every token a prefix of the next: the merge builder's worst case
                array.items[1000:] = ["a" * (k + 1) for k in range(len(array.items) - 1000)]
            else:
                rng.shuffle(array.items)
            notes.append(f"gguf: {kv[0]} array change {how} (count {array.count}, {len(array.items)} items)")
    elif op == "bloat":
        size = rng.choice((64, 1024, 48 << 20, 64 << 20))
        kind = rng.choice(("strings", "arrays", "deep"))
        if kind == "strings":
            value = GArray(G_STRING, [], size // 8, bytes(size // 8 * 8))
        elif kind == "arrays":
            value = GArray(G_ARRAY, [], size // 12, struct.pack("<IQ", 0, 0) * (size // 12))
        else:  # arrays of one array, nested `depth` deep, the innermost empty
            depth = rng.choice((9, 100, 10000))
            value = GArray(G_ARRAY, [], 1, struct.pack("<IQ", G_ARRAY, 1) * (depth - 2) + struct.pack("<IQ", 0, 0))
        model.kvs.append([rng.choice(("x.bloat", "tokenizer.ggml.merges")), G_ARRAY, value])
        notes.append(f"gguf: add {kind} bloat ({size} bytes)")
    elif op.startswith("tensor") and model.tensors:
        tensor = rng.choice(model.tensors)
        if op == "tensor-dims":
            dims = tensor[1]
            how = rng.randrange(4)
            if how == 0 and dims:
                dims[rng.randrange(len(dims))] = rng.choice((0, 1, 2**63, 2**64 - 1, 2**32, dims[0] * 2, dims[0] - 1,
                                                             31))
            elif how == 1:
                dims.append(rng.choice((1, 2, 0)))
            elif how == 2 and dims:
                dims.pop()
            else:
                tensor[1] = [1] * rng.choice((0, 5, 1000))
        elif op == "tensor-type":
            tensor[2] = rng.choice((*range(0, 42), 2**31, 2**32 - 1))
        elif op == "tensor-offset":
            other = rng.choice(model.tensors)
            tensor[3] = rng.choice((tensor[3] + 1, tensor[3] + 32, other[3], 2**63, 2**64 - 1, model.data_size,
                                    model.data_size + 32, 0))
        elif op == "tensor-name":
            tensor[0] = rng.choice((rng.choice(model.tensors)[0], "", b"\xff\xfe",
                                    f"model.diffusion_model.{tensor[0]!s}", "x" * 70000, "tekken_model"))
        else:
            model.tensors.remove(tensor)
        notes.append(f"gguf: {op} {tensor[0]!r:.60} -> dims {tensor[1][:6]} type {tensor[2]} offset {tensor[3]}")
    return model


def mutate_bytes(spec: FileSpec, rng: random.Random, notes: list[str]) -> FileSpec:
    """Raw damage to the first chunk (the header) and the size."""
    (first_offset, data), *rest = spec.chunks
    data = bytearray(data)
    size = spec.size
    op = rng.choice(("flip", "flip", "byte", "u64", "u32", "insert", "delete", "truncate", "truncate", "extend",
                     "splice"))
    head = min(len(data), 4096)
    pos = rng.randrange(len(data)) if data and rng.random() < 0.5 else rng.randrange(max(1, head))
    if op == "flip" and data:
        for _ in range(rng.choice((1, 1, 2, 4, 8))):
            i = rng.randrange(len(data)) if rng.random() < 0.5 else rng.randrange(max(1, head))
            data[i] ^= 1 << rng.randrange(8)
    elif op == "byte" and data:
        data[pos % len(data)] = rng.choice((0, 0xFF, 0x7F, 0x80, 0x20, 0x22, 0x7B, 0x5B, 0x30))
    elif op in ("u64", "u32") and len(data) >= 8:
        width = 8 if op == "u64" else 4
        if rng.random() < 0.5:
            pos = rng.randrange(0, min(len(data), 64) - width + 1) // 4 * 4
        pos = min(pos, len(data) - width)
        value = rng.choice(INTERESTING_INTS) & ((1 << (8 * width)) - 1)
        data[pos : pos + width] = value.to_bytes(width, "little")
    elif op == "insert":
        data[pos:pos] = bytes(rng.randrange(256) for _ in range(rng.choice((1, 4, 16))))
        size += len(data) - len(spec.chunks[0][1])
    elif op == "delete" and data:
        n = rng.choice((1, 4, 64))
        del data[pos : pos + n]
        size -= min(n, len(spec.chunks[0][1]) - pos)
    elif op == "truncate":
        size = rng.randrange(0, len(data) + 1) if rng.random() < 0.6 else rng.randrange(0, size + 1)
    elif op == "extend":
        size += rng.choice((1, 7, 4096, 1 << 20))
    elif data:
        n = rng.choice((8, 64, 512))
        piece = data[pos : pos + n]
        at = rng.randrange(len(data))
        data[at:at] = piece
        size += len(piece)
    notes.append(f"bytes: {op} at {pos} (size {size})")
    return FileSpec(((first_offset, bytes(data)), *rest), max(size, 0))
