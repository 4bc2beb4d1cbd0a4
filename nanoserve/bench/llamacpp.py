"""llama.cpp's server as a benchmark arm: built once from the source package on PyPI that
carries it (`llama-cpp-python`), the checkpoint converted with llama.cpp's own converter.

    ensure_llama_server(cache_dir)       llama-server, built with cmake for this CPU (~10 min once)
    ensure_gguf(model_dir, cache_dir)    the checkpoint as a bf16 GGUF, converted once per model

llama.cpp's converter names a BPE tokenizer's pre-tokenizer by hashing how it splits a test
text and refuses one it does not know; the benchmark's dummy checkpoints carry a byte-level
tokenizer (one token per byte, no merges), which no pre-tokenizer rule changes, so an unknown
one is converted as "default". Nothing of llama.cpp is vendored or committed: it is built from
the package, outside the project, as the vLLM arm's environment is.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import tarfile
from pathlib import Path

LLAMACPP_PACKAGE = "llama-cpp-python==0.3.36"  # its source distribution vendors llama.cpp
DEFAULT_LLAMACPP_DIR = Path.home() / ".cache" / "nanoserve" / "llama.cpp-0.3.36"
SLOTS = 8  # parallel sequences llama-server serves, each with max_model_len of context

# Runs llama.cpp's converter, with an unknown pre-tokenizer taken as "default" (see above).
CONVERT = """
import sys
sys.path.insert(0, sys.argv[1])
import convert_hf_to_gguf as converter
from conversion import base

known = base.TextModel.get_vocab_base_pre


def pre_tokenizer(self, tokenizer):
    try:
        return known(self, tokenizer)
    except NotImplementedError:
        return "default"


base.TextModel.get_vocab_base_pre = pre_tokenizer
sys.argv = ["convert_hf_to_gguf.py", *sys.argv[2:]]
converter.main()
"""


def _run(step: list[str], cwd: Path | None = None) -> None:
    print("  $ " + shlex.join(step), file=sys.stderr, flush=True)
    subprocess.run(step, check=True, cwd=cwd)


def source_dir(cache_dir: Path) -> Path:
    """The unpacked package (its llama.cpp sources are in vendor/llama.cpp)."""
    return next((cache_dir / "src").glob("llama_cpp_python-*"))


def ensure_llama_server(cache_dir: Path = DEFAULT_LLAMACPP_DIR) -> Path:
    """llama-server, built once from the package's vendored llama.cpp; its path."""
    binary = cache_dir / "bin" / "llama-server"
    if binary.exists():
        return binary
    print(f"building llama.cpp's server in {cache_dir} ({LLAMACPP_PACKAGE})...", file=sys.stderr)
    downloads = cache_dir / "download"
    pip = [sys.executable, "-m", "pip"]
    _run(
        [
            *pip,
            "download",
            "--no-deps",
            "--no-binary",
            ":all:",
            "-d",
            str(downloads),
            LLAMACPP_PACKAGE,
        ]
    )
    (archive,) = downloads.glob("*.tar.gz")
    with tarfile.open(archive) as tar:
        tar.extractall(cache_dir / "src", filter="data")
    llama_cpp = source_dir(cache_dir) / "vendor" / "llama.cpp"
    build = llama_cpp / "build"
    options = ["-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF", "-DGGML_NATIVE=ON"]
    _run(["cmake", "-S", str(llama_cpp), "-B", str(build), *options, "-DLLAMA_BUILD_TESTS=OFF"])
    _run(["cmake", "--build", str(build), "--target", "llama-server", "-j"])
    # The Qwen converters try sentencepiece first; it lives beside the build, not in our venv.
    _run([*pip, "install", "--target", str(cache_dir / "pydeps"), "sentencepiece"])
    binary.parent.mkdir(parents=True, exist_ok=True)
    (build / "bin" / "llama-server").rename(binary)
    return binary


def ensure_gguf(model_dir: Path, cache_dir: Path = DEFAULT_LLAMACPP_DIR) -> Path:
    """`model_dir` as a bf16 GGUF (written beside its safetensors, once)."""
    gguf = model_dir / "model-bf16.gguf"
    if gguf.exists():
        return gguf
    llama_cpp = source_dir(cache_dir) / "vendor" / "llama.cpp"
    env_path = cache_dir / "pydeps"
    command = [sys.executable, "-c", CONVERT, str(llama_cpp), str(model_dir)]
    command += ["--outtype", "bf16", "--outfile", str(gguf)]
    print("  $ " + shlex.join(command[:2] + ["<convert>", *command[3:]]), file=sys.stderr)
    env = {**os.environ, "PYTHONPATH": f"{env_path}:{llama_cpp / 'gguf-py'}"}
    subprocess.run(command, check=True, env=env)
    return gguf
