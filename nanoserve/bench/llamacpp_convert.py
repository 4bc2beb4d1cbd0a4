"""llama.cpp's checkpoint converter, taught the benchmark's byte-level dummy tokenizer.

    python -m nanoserve.bench.llamacpp_convert LLAMA_CPP_DIR MODEL_DIR [converter flags...]

runs `convert_hf_to_gguf.py` from LLAMA_CPP_DIR on MODEL_DIR. A dummy checkpoint's tokenizer
(`text/byte_tokenizer.py`) is BPE with one token per byte and no merges, which llama.cpp's BPE
loader refuses ("cannot find tokenizer merges"). Its vocabulary is written instead as
llama.cpp's byte-fallback vocabulary, which tokenizes text the same way: id b is the byte
`<0xbb>` for b < 256, then the special tokens at their ids, then unused padding up to the
model's vocabulary size. Every other tokenizer goes through the converter as it is.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def is_byte_tokenizer(model_dir: Path) -> bool:
    """BPE over the 256 bytes, with no merges: nanoserve's byte-level tokenizer."""
    path = model_dir / "tokenizer.json"
    if not path.exists():
        return False
    model = json.loads(path.read_text())["model"]
    return model.get("type") == "BPE" and not model.get("merges")  # a real BPE has merges


def set_byte_vocab(converter_model, gguf) -> None:
    """Write the byte tokenizer as llama.cpp's byte-fallback ("llama") vocabulary."""
    tokenizer = json.loads((converter_model.dir_model / "tokenizer.json").read_text())
    specials = {token["id"]: token["content"] for token in tokenizer["added_tokens"]}
    tokens, types = [], []
    for token_id in range(converter_model.hparams["vocab_size"]):
        if token_id < 256:
            tokens.append(f"<0x{token_id:02X}>")
            types.append(gguf.TokenType.BYTE)
        elif token_id in specials:
            tokens.append(specials[token_id])
            types.append(gguf.TokenType.CONTROL)
        else:
            tokens.append(f"[PAD{token_id}]")
            types.append(gguf.TokenType.UNUSED)
    writer = converter_model.gguf_writer
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * len(tokens))
    writer.add_token_types(types)
    writer.add_add_space_prefix(False)
    writer.add_add_bos_token(False)
    gguf.SpecialVocab(converter_model.dir_model, n_vocab=len(tokens)).add_to_gguf(writer)


def main(argv: list[str]) -> None:
    llama_cpp, model_dir = Path(argv[0]), Path(argv[1])
    sys.path.insert(0, str(llama_cpp))
    import convert_hf_to_gguf as converter
    import gguf
    from conversion import base

    if is_byte_tokenizer(model_dir):  # each model's set_vocab ends in one of these
        for name in ("_set_vocab_gpt2", "_set_vocab_sentencepiece", "_set_vocab_qwen"):
            setattr(base.TextModel, name, lambda self: set_byte_vocab(self, gguf))
    sys.argv = ["convert_hf_to_gguf.py", *argv[1:]]
    converter.main()


if __name__ == "__main__":
    main(sys.argv[1:])
