"""The llamacpp arm: what llama-server is started with, a given binary used as it is, and the
conversion's pre-tokenizer fallback (its build, ~10 minutes, is not part of the tests)."""

from __future__ import annotations

import subprocess
import sys

from nanoserve.bench import llamacpp
from nanoserve.bench.arms import ArmOptions, Server, parse_arm


def test_llama_server_gets_the_threads_slots_and_context_of_every_arm(tmp_path):
    (tmp_path / "model-bf16.gguf").write_bytes(b"GGUF")  # converted before: not again
    server = tmp_path / "llama-server"
    options = ArmOptions(
        threads=3, max_model_len=512, startup_timeout_s=1, log_dir=tmp_path, llamacpp_server=server
    )
    argv, env, description = Server(parse_arm("llamacpp"), tmp_path, options)._launch()
    assert argv[:3] == [str(server), "-m", str(tmp_path / "model-bf16.gguf")]
    flags = dict(zip(argv[3::2], argv[4::2], strict=True))
    assert flags["--threads"] == "3" and flags["--parallel"] == str(llamacpp.SLOTS)
    assert flags["--ctx-size"] == str(llamacpp.SLOTS * 512)  # max_model_len for every slot
    assert env["OMP_NUM_THREADS"] == "3" and "bf16 GGUF" in description["mode"]


def test_the_converter_shim_takes_an_unknown_pre_tokenizer_as_default(tmp_path):
    """The shim wraps llama.cpp's own method: a known tokenizer keeps its name."""
    fake = tmp_path / "llama.cpp"
    (fake / "conversion").mkdir(parents=True)
    (fake / "conversion" / "__init__.py").write_text("")
    (fake / "conversion" / "base.py").write_text(
        "class TextModel:\n"
        "    def get_vocab_base_pre(self, tokenizer):\n"
        "        if tokenizer == 'known':\n"
        "            return 'qwen2'\n"
        "        raise NotImplementedError('BPE pre-tokenizer was not recognized')\n"
    )
    (fake / "convert_hf_to_gguf.py").write_text(
        "import sys\n"
        "from conversion import base\n"
        "def main():\n"
        "    model = base.TextModel()\n"
        "    names = model.get_vocab_base_pre('known'), model.get_vocab_base_pre('bytes')\n"
        "    print(*names, sys.argv[1:])\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", llamacpp.CONVERT, str(fake), "/model", "--outtype", "bf16"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert done.stdout.strip() == "qwen2 default ['/model', '--outtype', 'bf16']"
