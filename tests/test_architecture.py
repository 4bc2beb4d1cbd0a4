"""The shape the code promises its readers (docs/architecture.md): folders by process role, a
core that stands alone and fits in one sitting, fast paths that enter it through its plug points,
a front that never imports the engine, and short functions."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

from tiny_checkpoints import make_tiny_checkpoint

import nanoserve

PACKAGE_DIR = Path(nanoserve.__file__).parent
ROOT = PACKAGE_DIR.parent
MAX_FUNCTION_LINES = 60
# The design's "~3,200 lines", with room for the speculative-decoding steps the scheduler, the
# layout and the model runner carry (vLLM v1 keeps them in its scheduler too), and for the
# prefix cache's kept tails (the blocks an editor's next keystroke shares part of and takes over).
MAX_CORE_LINES = 3490
# What each part of the package may import of the others (by module-name prefix).
CONTRACTS = ("nanoserve.common",)
CORE = ("nanoserve.core",)
FRONT = ("nanoserve.client", "nanoserve.server", "nanoserve.cli")
ENGINE_SIDE = (
    "nanoserve.core",
    "nanoserve.platforms",
    "nanoserve.quantization",
    "nanoserve.distributed",
    "nanoserve.structured_output",
    "nanoserve.spec_decode",
    "nanoserve.moe",
    "nanoserve.engine_setup",
    "nanoserve.llm",
)


# Everything the `serve` path does in the front before uvicorn runs: parse the flags, validate
# the configs against the checkpoint's config.json, load the tokenizer, build the app and its
# ZMQ engine client; plus the chat client, headless nodes and the in-process engine client
# (which runs an engine it is given, never imports one). Then list what got imported.
FRONT_SCRIPT = """
import json, sys
from nanoserve.cli.main import build_parser, check_engine_config, engine_config_from_args
from nanoserve.server.app import ServerConfig, create_app
from nanoserve.client.zmq_engine_client import ZmqEngineClient
from nanoserve.text.tokenizer import load_tokenizer
import nanoserve.cli.chat
import nanoserve.client.headless, nanoserve.client.inprocess

args = build_parser().parse_args(["serve", "--model", sys.argv[1], "--max-model-len", "256"])
config = engine_config_from_args(args, args.model)
tokenizer = load_tokenizer(check_engine_config(config))
client = ZmqEngineClient(config)
create_app(ServerConfig(model=args.model, served_model_names=("m",)), client, tokenizer)
client.kill_now()
print(json.dumps(sorted(sys.modules)))
"""


def test_the_front_never_imports_the_engine(tmp_path: Path) -> None:
    checkpoint = make_tiny_checkpoint(tmp_path / "model", "qwen3")
    result = subprocess.run(
        [sys.executable, "-c", FRONT_SCRIPT, str(checkpoint)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    modules = json.loads(result.stdout.strip().splitlines()[-1])
    assert "nanoserve.server.app" in modules and "nanoserve.common.checkpoint" in modules
    assert [m for m in modules if m.startswith("nanoserve.core")] == []


def _python_files() -> list[Path]:
    return sorted(PACKAGE_DIR.rglob("*.py"))


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def nanoserve_imports(path: Path) -> set[str]:
    """Every nanoserve module `path` imports, at the top or inside a function (but the package's
    own `__init__`, which loads `LLM` only when someone asks for it)."""
    package = (
        module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    )
    names: set[str] = set()
    tree = ast.parse(path.read_text())
    nodes = tree.body if path == PACKAGE_DIR / "__init__.py" else ast.walk(tree)
    for node in nodes:
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package up
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}" if base else parent
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return {n for n in names if n == "nanoserve" or n.startswith("nanoserve.")}


def is_in(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def imports_of(prefixes: tuple[str, ...]) -> dict[str, set[str]]:
    modules = {module_name(p): nanoserve_imports(p) for p in _python_files()}
    return {m: imported for m, imported in modules.items() if is_in(m, prefixes)}


def test_the_core_imports_only_itself_and_the_contracts() -> None:
    """No platform, plug-in, client, server or command line: fast paths come in through the
    plug points (core/fast_paths.py), chosen outside the core."""
    allowed = CORE + CONTRACTS
    stray = {
        module: sorted(n for n in imported if n != "nanoserve" and not is_in(n, allowed))
        for module, imported in imports_of(CORE).items()
    }
    assert {m: names for m, names in stray.items() if names} == {}


def test_the_front_imports_nothing_of_the_engine_side() -> None:
    """The front, followed through every nanoserve module it imports (lazily too), reaches no
    core, platform or plug-in module: the process boundary is the import boundary."""
    graph = {module_name(p): nanoserve_imports(p) for p in _python_files()}
    reached: dict[str, str] = {}  # module -> a front module that reaches it
    for start in (m for m in graph if is_in(m, FRONT)):
        stack = [start]
        while stack:
            for name in graph.get(stack.pop(), ()):
                if name in graph and name not in reached:
                    reached[name] = start
                    stack.append(name)
    engine_side = {m: via for m, via in reached.items() if is_in(m, ENGINE_SIDE)}
    assert engine_side == {}


def test_the_core_fits_in_one_sitting_and_the_readme_says_how_long_it_is() -> None:
    core_files = sorted((PACKAGE_DIR / "core").rglob("*.py"))
    num_lines = sum(len(p.read_text().splitlines()) for p in core_files)
    assert num_lines <= MAX_CORE_LINES
    claim = re.search(r"\(`nanoserve/core/`, ([0-9,]+) lines", (ROOT / "README.md").read_text())
    assert claim is not None, "README.md should say how long the core is"
    assert int(claim.group(1).replace(",", "")) == num_lines


def test_no_function_is_over_60_lines() -> None:
    long = {}
    for path in _python_files():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                num_lines = node.end_lineno - node.lineno + 1
                if num_lines > MAX_FUNCTION_LINES:
                    long[f"{path.relative_to(PACKAGE_DIR)}:{node.lineno} {node.name}"] = num_lines
    assert long == {}


def test_no_formatter_is_switched_off() -> None:
    """ruff formats every line of the package: no `# fmt: skip` or `# fmt: off`."""
    marked = [
        f"{path.relative_to(PACKAGE_DIR)}:{number}"
        for path in _python_files()
        for number, line in enumerate(path.read_text().splitlines(), start=1)
        if re.search(r"#\s*fmt:\s*(skip|off)", line)
    ]
    assert marked == []


def documented_tree() -> set[str]:
    """The files of the package tree in docs/architecture.md (between its tree markers)."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    tree = text.split("<!-- package tree -->")[1].split("<!-- end of package tree -->")[0]
    paths: set[str] = set()
    folders: list[str] = []  # the folder at each indentation level
    for line in tree.splitlines():
        match = re.match(r"^( *)(\S+)", line)
        if not match or line.strip().startswith("```"):
            continue
        depth, name = len(match.group(1)) // 2, match.group(2)
        folders = folders[:depth]
        if name.endswith("/"):
            folders.append(name.rstrip("/"))
            paths.add("/".join(folders) + "/")
        else:
            paths.add("/".join([*folders, name]))
    return paths


def files_on_disk() -> set[str]:
    """The package's folders, modules (but `__init__.py`) and C++ sources; its data folders'
    files are not listed."""
    paths: set[str] = set()
    for path in PACKAGE_DIR.rglob("*"):
        relative = path.relative_to(PACKAGE_DIR.parent).as_posix()
        if "__pycache__" in relative or "/assets/" in relative or "/presets/" in relative:
            continue
        if path.is_dir():
            paths.add(relative + "/")
        elif path.suffix in (".py", ".cpp", ".h") and path.name != "__init__.py":
            paths.add(relative)  # every folder's __init__.py goes without saying
    return paths


def test_the_documented_tree_is_the_tree_on_disk() -> None:
    documented = documented_tree()
    on_disk = files_on_disk() | {"nanoserve/", "nanoserve/assets/", "nanoserve/presets/"}
    assert sorted(on_disk - documented) == [], "on disk, missing from docs/architecture.md"
    assert sorted(documented - on_disk) == [], "in docs/architecture.md, not on disk"
