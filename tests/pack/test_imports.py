"""The package's import graph: no module imports itself through others (an import cycle works or breaks
by import order), no layer imports one above it, and the layers below the host stand without it."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = "comfyui_flux2dev"
ROOT = Path(__file__).resolve().parents[2]
SKIPPED = {".venv", ".comfyui", ".hosts", "tests", ".git"}


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join((PACKAGE, *parts[:-1])) if parts[-1] == "__init__" else ".".join((PACKAGE, *parts))


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted(ROOT.rglob("*.py")):
        if not SKIPPED & set(path.relative_to(ROOT).parts[:-1]) and path.relative_to(ROOT).parts[0] not in SKIPPED:
            found[_module_name(path)] = path
    return found


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules that `name` imports anywhere in its body (function-level imports count too)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        out.update(t for t in targets if t in modules and t != name)
    return out


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the graph as a path of module names, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_the_cycle_finder_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    # __init__ modules are imported on the way to their submodules; that edge is no cycle of the code's own
    return {name: {t for t in targets if not name.startswith(t + ".")} for name, targets in graph.items()}


def test_the_package_has_no_import_cycle():
    graph = _graph()
    assert f"{PACKAGE}.loaders.models.encoder" in graph and f"{PACKAGE}.tokenizers.ladder" in graph
    assert f"{PACKAGE}.loaders.models.kinds" in graph[f"{PACKAGE}.loaders.models.encoder_identify"]
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))


# The layers, lowest first: a module imports modules of its own layer and those below, never above.
LAYERS = (
    ("errors",),
    ("loaders.formats",),  # bytes in, tensors out: no knowledge of models
    ("tokenizers",),
    ("loaders.models",),
    ("loaders.upsampler",),  # prompt upsampling: the language model, the vision tower, the images, the settings
    ("loaders.cache",),
    ("loaders.convert",),  # writing files: above the models it reads and the content digest of the cache
    ("loaders",),  # the package's own __init__
    ("host",),  # the one layer that touches ComfyUI
    ("nodes", "cli", ""),  # the UI and the command line, and the package root (its entry point)
    ("devtools",),  # what only developers run: never imported by the layers above
)
HOST_FREE = ("errors", "loaders", "tokenizers")


def layer_of(module: str) -> int:
    rel = module.removeprefix(PACKAGE).lstrip(".")
    best = None
    for level, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if rel == prefix or rel.startswith(prefix + ".") or (prefix == "" and rel == ""):
                if best is None or len(prefix) > best[0]:
                    best = (len(prefix), level)
    assert best is not None, f"{module} is in no layer of LAYERS"
    return best[1]


def test_the_layer_finder_places_modules():
    assert layer_of(f"{PACKAGE}.loaders.formats.gguf_file") < layer_of(f"{PACKAGE}.loaders.models.encoder")
    assert layer_of(f"{PACKAGE}.loaders") > layer_of(f"{PACKAGE}.loaders.cache.store")
    assert layer_of(PACKAGE) == layer_of(f"{PACKAGE}.cli") < layer_of(f"{PACKAGE}.devtools.fuzz")


def test_no_layer_imports_one_above_it():
    upward = [f"{name} imports {target}" for name, targets in _graph().items() for target in sorted(targets)
              if layer_of(target) > layer_of(name)]
    assert not upward, "\n".join(upward)


@pytest.mark.parametrize("package", HOST_FREE)
def test_the_layers_below_the_host_never_import_it(package):
    modules = [name for name in _modules() if name.removeprefix(PACKAGE + ".").split(".")[0] == package]
    code = (
        "import importlib, sys\n"
        f"for name in {modules!r}: importlib.import_module(name)\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('comfy', 'folder_paths', 'comfy_api')))\n"
    )
    out = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True)  # a fresh process
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
