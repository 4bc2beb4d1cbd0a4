"""llama.cpp's server as a benchmark arm: built once from the source package on PyPI that
carries it (`llama-cpp-python`), the checkpoint converted with llama.cpp's own converter.

    ensure_llama_server(cache_dir)       llama-server, built with cmake for this CPU (~10 min once)
    ensure_gguf(model_dir, cache_dir)    the checkpoint as a bf16 GGUF, converted once per model

The benchmark's dummy checkpoints carry a byte-level tokenizer that llama.cpp's BPE loader
refuses (it has no merges); `llamacpp_convert.py` writes it as llama.cpp's byte-fallback
vocabulary instead. Nothing of llama.cpp is vendored or committed: it is built from the
package, outside the project, as the vLLM arm's environment is.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import subprocess
import sys
import tarfile
from pathlib import Path

LLAMACPP_PACKAGE = "llama-cpp-python==0.3.36"  # its source distribution vendors llama.cpp
DEFAULT_LLAMACPP_DIR = Path.home() / ".cache" / "nanoserve" / "llama.cpp-0.3.36"
SLOTS = 8  # parallel sequences llama-server serves, each with max_model_len of context


def _run(step: list[str], cwd: Path | None = None) -> None:
    print("  $ " + shlex.join(step), file=sys.stderr, flush=True)
    subprocess.run(step, check=True, cwd=cwd)


def source_dir(cache_dir: Path) -> Path:
    """The unpacked package (its llama.cpp sources are in vendor/llama.cpp)."""
    return next((cache_dir / "src").glob("llama_cpp_python-*"))


def ensure_llama_server(cache_dir: Path = DEFAULT_LLAMACPP_DIR) -> Path:
    """llama-server, built once from the package's vendored llama.cpp; its path."""
    with contextlib.suppress(StopIteration):
        binary = source_dir(cache_dir) / "vendor" / "llama.cpp" / "build" / "bin" / "llama-server"
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
    options += ["-DLLAMA_BUILD_TESTS=OFF", "-DBUILD_SHARED_LIBS=OFF"]
    _run(["cmake", "-S", str(llama_cpp), "-B", str(build), *options])
    _run(["cmake", "--build", str(build), "--target", "llama-server", "-j"])
    # The Qwen converters try sentencepiece first; it lives beside the build, not in our venv.
    _run([*pip, "install", "--target", str(cache_dir / "pydeps"), "sentencepiece"])
    return build / "bin" / "llama-server"


def ensure_gguf(model_dir: Path, cache_dir: Path = DEFAULT_LLAMACPP_DIR) -> Path:
    """`model_dir` as a bf16 GGUF (written beside its safetensors, once)."""
    gguf = model_dir / "model-bf16.gguf"
    if gguf.exists():
        return gguf
    llama_cpp = source_dir(cache_dir) / "vendor" / "llama.cpp"
    command = [sys.executable, "-m", "nanoserve.bench.llamacpp_convert", str(llama_cpp)]
    command += [str(model_dir), "--outtype", "bf16", "--outfile", str(gguf)]
    print("  $ " + shlex.join(command), file=sys.stderr)
    python_path = [str(cache_dir / "pydeps"), str(llama_cpp / "gguf-py"), *sys.path]
    subprocess.run(command, check=True, env={**os.environ, "PYTHONPATH": ":".join(python_path)})
    return gguf
