"""The shape the code promises its readers: the front never imports the engine, and modules and
functions stay small enough to read (docs/architecture.md)."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

from tiny_checkpoints import make_tiny_checkpoint

import nanoserve

PACKAGE_DIR = Path(nanoserve.__file__).parent
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 60
ENGINE_CORE = ("engine.py", "scheduler.py", "kv_cache_manager.py", "model_runner.py", "request.py")
MAX_ENGINE_CORE_LINES = 1200

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


def test_no_module_is_over_400_lines() -> None:
    long = {
        str(path.relative_to(PACKAGE_DIR)): n
        for path in _python_files()
        if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES
    }
    assert long == {}


def test_no_function_is_over_60_lines() -> None:
    long = {}
    for path in _python_files():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                num_lines = node.end_lineno - node.lineno + 1
                if num_lines > MAX_FUNCTION_LINES:
                    long[f"{path.relative_to(PACKAGE_DIR)}:{node.lineno} {node.name}"] = num_lines
    assert long == {}


def test_the_engine_core_fits_in_one_sitting() -> None:
    engine_dir = PACKAGE_DIR / "core"
    num_lines = sum(len((engine_dir / name).read_text().splitlines()) for name in ENGINE_CORE)
    assert num_lines <= MAX_ENGINE_CORE_LINES
