"""The front's shape: the app composes its routers with what they serve, so its modules import
one another without a cycle and no handler looks objects up on the app; and the front never
compiles a grammar (llguidance and nanoserve.structured_output stay out of its process)."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import nanoserve.server

SERVER_DIR = Path(nanoserve.server.__file__).parent
PACKAGE_ROOT = SERVER_DIR.parent.parent  # the folder that holds nanoserve/


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE_ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


SERVER_MODULES = {module_name(path): path for path in sorted(SERVER_DIR.rglob("*.py"))}


def module_level_imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """Imports that run when the module is imported or type-checked: those at its top level,
    inside `if` (TYPE_CHECKING too) and `try` blocks, never inside functions or classes."""
    found: list[ast.Import | ast.ImportFrom] = []
    blocks: list[list[ast.stmt]] = [tree.body]
    while blocks:
        for node in blocks.pop():
            if isinstance(node, ast.Import | ast.ImportFrom):
                found.append(node)
            elif isinstance(node, ast.If):
                blocks += [node.body, node.orelse]
            elif isinstance(node, ast.Try):
                blocks += [node.body, node.orelse, node.finalbody]
                blocks += [handler.body for handler in node.handlers]
    return found


def server_imports(name: str, path: Path) -> set[str]:
    """The nanoserve.server modules that module `name` imports."""
    imported: set[str] = set()
    is_package = path.name == "__init__.py"
    for node in module_level_imports(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            imported |= {alias.name for alias in node.names}
            continue
        base = node.module or ""
        if node.level:  # relative: from the module's package, up `level - 1` more
            package = name.split(".") if is_package else name.split(".")[:-1]
            package = package[: len(package) - (node.level - 1)]
            base = ".".join([*package, *([base] if base else [])])
        for alias in node.names:  # `from package import module` imports the module
            submodule = f"{base}.{alias.name}"
            imported.add(submodule if submodule in SERVER_MODULES else base)
    return {module for module in imported if module in SERVER_MODULES and module != name}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of `graph` as a path that ends where it starts, or None."""
    state: dict[str, str] = {}  # "open" while on the path, "done" once fully explored
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (cycle := visit(nxt)) is not None:
                return cycle
        path.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)) is not None:
            return cycle
    return None


def test_the_cycle_finder_finds_a_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_the_server_imports_one_way() -> None:
    graph = {name: server_imports(name, path) for name, path in SERVER_MODULES.items()}
    assert "nanoserve.server.openai.chat" in graph["nanoserve.server.app"]  # the graph is read
    assert "nanoserve.server.openai.chat" in graph["nanoserve.server.openai.responses"]
    assert find_cycle(graph) is None


def test_no_route_looks_its_objects_up_on_the_app() -> None:
    readers = [name for name, path in SERVER_MODULES.items() if "app.state" in path.read_text()]
    assert readers == []


def test_the_server_app_is_imported_from_its_old_place() -> None:
    from nanoserve.server.app import ServerConfig, create_app

    assert ServerConfig.__module__ == "nanoserve.server.config" and callable(create_app)


# Imports every server module in a fresh interpreter, then lists what got imported.
IMPORT_ALL = """
import importlib, json, sys
for name in json.loads(sys.argv[1]):
    importlib.import_module(name)
print(json.dumps(sorted(sys.modules)))
"""


def test_the_front_never_compiles_a_grammar() -> None:
    result = subprocess.run(
        [sys.executable, "-c", IMPORT_ALL, json.dumps(sorted(SERVER_MODULES))],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    modules = json.loads(result.stdout.strip().splitlines()[-1])
    assert "nanoserve.server.openai.constraints" in modules
    grammar_modules = [
        m for m in modules if m.split(".")[0] == "llguidance" or "structured_output" in m
    ]
    assert grammar_modules == []
