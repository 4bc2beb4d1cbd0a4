"""The llamacpp arm: what llama-server is started with, a given binary used as it is, and the
conversion's pre-tokenizer fallback (its build, ~10 minutes, is not part of the tests)."""

from __future__ import annotations

from types import SimpleNamespace

from tiny_checkpoints import make_tiny_checkpoint

from nanoserve.bench import llamacpp, llamacpp_convert
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


def test_an_editor_set_up_of_llama_server_has_one_slot_and_extra_flags(tmp_path):
    (tmp_path / "model-bf16.gguf").write_bytes(b"GGUF")
    options = ArmOptions(
        threads=2,
        max_model_len=4096,
        startup_timeout_s=1,
        log_dir=tmp_path,
        llamacpp_server=tmp_path / "llama-server",
        llamacpp_slots=1,
        llamacpp_args=["--cache-reuse", "256"],
    )
    argv, _, description = Server(parse_arm("llamacpp"), tmp_path, options)._launch()
    flags = dict(zip(argv[3::2], argv[4::2], strict=True))
    assert flags["--parallel"] == "1" and flags["--ctx-size"] == "4096"
    assert flags["--cache-reuse"] == "256" and "1 slots" in description["mode"]
    assert "--cache-reuse 256" in description["mode"]


def test_the_byte_tokenizer_is_written_as_a_byte_fallback_vocabulary(tmp_path):
    """Ids keep their meaning: id b is the byte b, the specials stay at their ids, the rest
    up to the model's vocabulary is unused."""
    checkpoint = make_tiny_checkpoint(tmp_path, "qwen3")
    assert llamacpp_convert.is_byte_tokenizer(checkpoint)
    written: dict[str, object] = {}

    class Writer:
        def __getattr__(self, name):
            return lambda value: written.__setitem__(name.removeprefix("add_"), value)

    class SpecialVocab:
        def __init__(self, *args, **kwargs) -> None:
            pass

        def add_to_gguf(self, writer) -> None:
            written["special_vocab"] = True

    gguf = SimpleNamespace(
        TokenType=SimpleNamespace(BYTE="byte", CONTROL="control", UNUSED="unused"),
        SpecialVocab=SpecialVocab,
    )
    model = SimpleNamespace(dir_model=checkpoint, hparams={"vocab_size": 320}, gguf_writer=Writer())
    llamacpp_convert.set_byte_vocab(model, gguf)
    tokens, types = written["token_list"], written["token_types"]
    assert written["tokenizer_model"] == "llama" and written["add_space_prefix"] is False
    assert len(tokens) == len(types) == 320
    assert tokens[0] == "<0x00>" and tokens[255] == "<0xFF>" and types[65] == "byte"
    assert tokens[258] == "<|im_end|>" and types[258] == "control"
    assert tokens[300] == "[PAD300]" and types[300] == "unused"
    assert written["special_vocab"] is True
