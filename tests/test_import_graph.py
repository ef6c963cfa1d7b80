"""The package's import graph: no circles anywhere, and the layer rules of
DESIGN.md (nothing imports upward; HTTP and gRPC meet only in the transport-neutral
serving modules: the frontend, serving_chat, serving_completion, streaming, chunks).

Every ``import`` counts, deferred ones inside functions too: a circle closed
by a function-level import is still a circle (the old ``server`` <->
``grpc_service`` pair was one). Imports under ``if TYPE_CHECKING:`` are left
out, since they never run.

One more check walks every module: each pydantic model of the package is complete
once its module is imported.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

import pagedserve

PACKAGE = "pagedserve"
# What the control plane's actors load (the cluster controller, which creates the workers; the
# KV manager; each node's relay) and what a caller of the workers needs (the worker actor's
# module, the handle, the stream protocol, the API's structured-output checks), and what the CLI's
# status and stop load (the launcher, bootstrap's init_ray): torch costs each such process about
# 1.3 s of CPU and 180 MB, for nothing. The engine loads in Worker.__init__.
TORCH_FREE_MODULES = ("cluster.config", "cluster.controller", "cluster.kv_central", "cluster.kv_relay",
                      "cluster.handle", "cluster.cli", "cluster.launcher", "cluster.bootstrap", "kvmanager",
                      "workers.actor.worker", "workers.actor.protocol", "workers.sample.grammar")
HTTP_MODULES = ("http_app", "sse")
GRPC_MODULES = ("grpc_service",)
# Which top-level subpackages each one may import (DESIGN.md, "Layers").
LAYERS = {
    "kernels": set(),
    "kvmanager": set(),
    "workers": {"kernels", "kvmanager"},
    "tool_parsers": {"workers", "reasoning_parsers"},   # harmony's markers
    "reasoning_parsers": set(),
    "cluster": {"kernels", "kvmanager", "workers", "tool_parsers", "reasoning_parsers"},
}


def _package_dirs() -> dict[str, Path]:
    """Each ``pagedserve`` package name and its directory (the editable install maps several roots)."""
    dirs: dict[str, Path] = {}

    def walk(name: str, path: Path) -> None:
        dirs[name] = path
        for child in sorted(path.iterdir()):
            if child.is_dir() and (child / "__init__.py").exists():
                walk(f"{name}.{child.name}", child)

    walk(PACKAGE, Path(pagedserve.__file__).parent)
    for sub in LAYERS:
        module = __import__(f"{PACKAGE}.{sub}", fromlist=["__name__"])
        walk(f"{PACKAGE}.{sub}", Path(module.__file__).parent)
    return dirs


def _modules() -> dict[str, Path]:
    modules = {}
    for package, path in _package_dirs().items():
        for file in path.glob("*.py"):
            modules[package if file.stem == "__init__" else f"{package}.{file.stem}"] = file
        for file in path.glob("*.c"):   # a C extension (setup.py): a module that imports no package module
            modules[f"{package}.{file.stem}"] = file
    return modules


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(name: str, file: Path, modules: dict[str, Path], type_only: bool = False) -> set[str]:
    """The package modules ``name`` imports (a ``from pkg import sub`` counts as ``pkg.sub``);
    with ``type_only``, those under ``if TYPE_CHECKING:`` too."""
    if file.suffix != ".py":
        return set()
    is_package = file.stem == "__init__"
    found: set[str] = set()

    def resolve(target: str) -> str | None:
        while target and target not in modules:
            target = target.rpartition(".")[0]
        return target or None

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node) and not type_only:
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith(PACKAGE):
                    found.add(resolve(alias.name))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name if is_package else name.rpartition(".")[0]
                for _ in range(node.level - 1):
                    base = base.rpartition(".")[0]
                source = f"{base}.{node.module}" if node.module else base
            else:
                source = node.module or ""
            if source.startswith(PACKAGE):
                for alias in node.names:
                    found.add(resolve(f"{source}.{alias.name}") if f"{source}.{alias.name}" in modules
                              else resolve(source))
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(file.read_text(), str(file)))
    found.discard(None)
    found.discard(name)
    return found


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, file, modules) for name, file in modules.items()}


@pytest.fixture(scope="module")
def graph_with_types() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, file, modules, type_only=True) for name, file in modules.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph.get(node, ()):
            if target not in index:
                connect(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return components


def _reachable(graph: dict[str, set[str]], source: str) -> set[str]:
    """Everything ``source`` reaches (including through other modules)."""
    seen, todo = set(), [source]
    while todo:
        for nxt in graph.get(todo.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def test_graph_covers_the_package(graph):
    names = set(graph)
    assert {f"{PACKAGE}.cluster.serving.frontend", f"{PACKAGE}.workers.engine.engine",
            f"{PACKAGE}.kvmanager.block_manager", f"{PACKAGE}.kernels.torch_ops"} <= names
    assert f"{PACKAGE}.cluster.serving.frontend" in graph[f"{PACKAGE}.cluster.serving.grpc_service"]


def test_no_import_circles(graph):
    assert _cycles(graph) == []


def test_no_circles_even_through_annotations(graph_with_types):
    """A type named across a circle means two modules each know the other's concept: the
    shared type belongs in a module of its own, or the annotation in a Protocol."""
    assert _cycles(graph_with_types) == []


def test_cycle_finder_finds_a_circle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_nothing_imports_upward(graph):
    wrong = []
    for module, targets in graph.items():
        layer = module.split(".")[1] if module.count(".") else None
        if layer not in LAYERS:
            continue
        for target in targets:
            target_layer = target.split(".")[1] if target.count(".") else None
            if target_layer in LAYERS and target_layer != layer and target_layer not in LAYERS[layer]:
                wrong.append(f"{module} -> {target}")
    assert wrong == []


def test_http_and_grpc_meet_only_in_the_frontend(graph):
    serving = f"{PACKAGE}.cluster.serving"
    http = {f"{serving}.{m}" for m in HTTP_MODULES}
    grpc = {f"{serving}.{m}" for m in GRPC_MODULES}
    for module in http:
        assert not _reachable(graph, module) & grpc, f"{module} reaches the gRPC service"
    for module in grpc:
        assert not _reachable(graph, module) & http, f"{module} reaches the HTTP app"


def test_the_control_plane_loads_without_torch():
    modules = ", ".join(f"{PACKAGE}.{m}" for m in TORCH_FREE_MODULES)
    code = f"import sys, {modules}; print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert loaded.strip() == "[]", f"importing {modules} loads {loaded.strip()}"


# Imports the modules named in argv[1] (JSON), then reports the package's pydantic models and
# those of them that are not complete.
_MODELS_DRIVER = r"""
import importlib, json, sys, pydantic
for name in json.loads(sys.argv[1]):
    importlib.import_module(name)
models, unseen = set(), [pydantic.BaseModel]
while unseen:
    for sub in unseen.pop().__subclasses__():
        unseen.append(sub)
        if sub.__module__.startswith(sys.argv[2] + "."):
            models.add(sub)
incomplete = sorted(f"{c.__module__}.{c.__qualname__}" for c in models if not c.__pydantic_complete__)
print(json.dumps({"found": len(models), "incomplete": incomplete}))
"""


def test_every_pydantic_model_of_the_package_is_built_at_import():
    """A model that pydantic cannot complete when its class is made (a forward reference it cannot
    resolve yet) is rebuilt at its first use: on a request's path, and in pydantic 2.11-2.13 unsafely
    across threads (one could meet BaseModel's own validator). Every model here builds at import."""
    names = sorted(name for name, file in _modules().items() if file.suffix == ".py" and not name.endswith("__main__"))
    done = subprocess.run([sys.executable, "-c", _MODELS_DRIVER, json.dumps(names), PACKAGE], capture_output=True,
                          text=True, check=True)
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["found"] >= 50, f"only {report['found']} models found"
    assert report["incomplete"] == [], f"models left to build at first use: {report['incomplete']}"
